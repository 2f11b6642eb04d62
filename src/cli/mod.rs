//! Command-line interface. Flag names follow kube-proxy's.

pub mod kube_proxy;

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use thiserror::Error;
use tracing::{error, warn};

use crate::config::duration::GoDuration;
use crate::config::kubeproxy::KubeProxyConfiguration;
use crate::config::{self, ConfigError, LoggingFormat, ProxyConfig};
use crate::model::ClusterState;
use crate::netlink::{Kernel, NetlinkError};
use crate::oneshot::{OneShotError, plan_here, sync_once};
use crate::source::{self, manifests::ManifestError};
use crate::sync::{self, SyncError};

/// nftproxy: a Kubernetes service proxy on nftables.
#[derive(Debug, Parser)]
#[command(name = "nftproxy", version, about, long_about = None)]
pub struct Cli {
    /// Log verbosity: -v debug, -vv trace (RUST_LOG overrides).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Log format, as kube-proxy's flag: `text`, or `json` (one JSON object per line on stderr).
    /// `run --config` files may set it as `logging.format`; this flag overrides them.
    #[arg(long, value_name = "FORMAT", global = true, value_parser = parse_logging_format)]
    pub logging_format: Option<LoggingFormat>,
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the desired ruleset as nft text; touches no kernel state.
    Render(ManifestArgs),
    /// Apply the desired ruleset in the current network namespace as one transaction.
    Sync(ManifestArgs),
    /// Delete nftproxy's tables (and only those) in the current network namespace.
    Cleanup(TableArgs),
    /// Report foreign tables and base chains whose hooks and priorities may conflict with
    /// nftproxy's (a leftover kube-proxy, Docker, firewalld, drop policies, early NAT). Exit
    /// status: 0 nothing conflicts, 1 warnings or conflicts, 2 the check could not run.
    Check(CheckArgs),
    /// Run as the node's service proxy: watch the sources and keep the kernel in step.
    Run(Box<RunArgs>),
    /// Set the kernel's conntrack limits and timeouts as kube-proxy does at start-up (the
    /// `conntrack:` settings of --config and the --conntrack-* flags), then exit: for a
    /// privileged init container, so `run` itself needs no writable /proc/sys. Exit status 1
    /// when a value could not be set (a read-only /sys for the hashsize only warns).
    ConntrackSysctls(ConntrackSysctlsArgs),
    /// Follow real packets (new connections) through nftproxy's chains with the kernel's
    /// nftrace and print each one's way, its service and endpoint, and the verdict. The trace
    /// table it adds is removed when it exits, however it ends. Exit status 1 when no packet
    /// matched.
    Trace(TraceArgs),
    /// Tell what nftproxy's ruleset does to one new connection, without sending a packet: every
    /// base chain, rule and map element it matches, then the outcome (DNAT to which endpoints
    /// with which share, masquerade or not and why, or why it is dropped or rejected). Reads
    /// the ruleset the kernel holds here, or with --manifests plans it offline.
    Explain(ExplainArgs),
    /// Print what a running `nftproxy run` programmed, from its `/debug/services` on the
    /// metrics address: every service port with its addresses and the endpoints each policy
    /// uses here, left-out services and objects, and the last sync.
    Status(StatusArgs),
    /// Build a lab of network namespaces, send traffic through a ClusterIP and show the results
    /// (runs `nftproxy-tools demo`; `nftproxy demo --help` for its options).
    #[command(disable_help_flag = true)]
    Demo(ToolArgs),
    /// Measure syncs, memory and the data plane at cluster scale in network namespaces (runs
    /// `nftproxy-tools bench`; `nftproxy bench --help` for its options).
    #[command(disable_help_flag = true)]
    Bench(ToolArgs),
}

/// Arguments handed to `nftproxy-tools` as they are.
#[derive(Debug, Args)]
pub struct ToolArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "ARGS")]
    pub args: Vec<std::ffi::OsString>,
}

/// `run` options.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// A YAML/JSON manifest file or a directory of them, watched for changes (instead of the
    /// Kubernetes API).
    #[arg(long, value_name = "PATH", conflicts_with = "kubeconfig")]
    pub manifests: Option<PathBuf>,
    /// A kubeconfig for the Kubernetes API (default: in-cluster service account).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<String>,
    /// A kube-proxy KubeProxyConfiguration file. As in kube-proxy, it then decides every
    /// kube-proxy setting but --hostname-override and the log format (flags beside it are
    /// ignored, with a warning naming them).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub proxy: ProxyArgs,
    #[command(flatten)]
    pub conntrack: ConntrackArgs,
    /// Minimum time between the starts of two syncs (but for the retries of a failed one):
    /// changes arriving faster are applied together.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
    pub min_sync_period: std::time::Duration,
    /// Time between periodic syncs: each reads nftproxy's tables back and repairs rules changed
    /// outside nftproxy, unless nobody can have changed them (owned tables, or an unchanged
    /// ruleset generation) and the last read-back is less than an hour old.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub sync_period: std::time::Duration,
    /// Address of /healthz and /livez; a bare IP gets port 10256 (empty disables).
    #[arg(long, value_name = "IP:PORT", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: String,
    /// Address of /metrics, /healthz, /proxyMode and /configz; a bare IP gets port 10249
    /// (empty disables).
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: String,
    /// Treat a failure to bind the healthz or metrics port as fatal and exit (otherwise it is
    /// logged and retried every 5 seconds, as upstream).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub bind_address_hard_fail: bool,
    /// How often manifests are checked for changes.
    #[arg(long, value_name = "DURATION", default_value = "200ms", value_parser = humantime::parse_duration, hide = true)]
    pub manifests_poll: std::time::Duration,
    /// Remove kube-proxy's leftovers (its nftables tables, its iptables-mode KUBE- chains and
    /// jumps, IPVS state) in the first sync, as kube-proxy does in nftables mode (`false` keeps
    /// them; `nftproxy check` lists them).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub cleanup_kube_proxy: bool,
    /// kube-proxy's own flags, when started with kube-proxy's command line.
    #[arg(skip)]
    pub kube_proxy: kube_proxy::KubeProxyExtras,
}

/// `run`'s flags that upstream takes from the file when `--config` is given, by clap id.
const FILE_WINS: &[(&str, &str)] = &[
    ("kubeconfig", "kubeconfig"),
    ("cluster_cidr", "cluster-cidr"),
    ("masquerade_all", "masquerade-all"),
    ("masquerade_bit", "masquerade-bit"),
    ("nodeport_addresses", "nodeport-addresses"),
    ("bind_address", "bind-address"),
    ("detect_local_mode", "detect-local-mode"),
    ("pod_bridge_interface", "pod-bridge-interface"),
    ("pod_interface_name_prefix", "pod-interface-name-prefix"),
    ("min_sync_period", "min-sync-period"),
    ("sync_period", "sync-period"),
    ("healthz_bind_address", "healthz-bind-address"),
    ("metrics_bind_address", "metrics-bind-address"),
    ("bind_address_hard_fail", "bind-address-hard-fail"),
    ("conntrack_max_per_core", "conntrack-max-per-core"),
    ("conntrack_min", "conntrack-min"),
    ("conntrack_tcp_timeout_established", "conntrack-tcp-timeout-established"),
    ("conntrack_tcp_timeout_close_wait", "conntrack-tcp-timeout-close-wait"),
    ("conntrack_tcp_be_liberal", "conntrack-tcp-be-liberal"),
    ("conntrack_udp_timeout", "conntrack-udp-timeout"),
    ("conntrack_udp_timeout_stream", "conntrack-udp-timeout-stream"),
];

/// A flag given on the command line (not a default), by clap id.
fn explicit_in(matches: Option<&clap::ArgMatches>) -> impl Fn(&str) -> bool + '_ {
    move |id: &str| matches.is_some_and(|m| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
}

/// An address flag with its deprecated port flag (`--healthz-port`, `--metrics-port`), as
/// upstream combines them without a config file: port 0 disables, a bare IP gets the port.
/// An empty address disables the server too (nftproxy's own flags allow it).
fn address_with_port(address: &str, port: Option<i32>, default_port: u16) -> String {
    match port {
        Some(0) => String::new(),
        _ if address.trim().is_empty() => String::new(),
        // A port out of range is kept as given: validation refuses it with upstream's message.
        Some(p) => match u16::try_from(p) {
            Ok(p) => config::kubeproxy::append_port_if_needed(address.trim(), p),
            Err(_) => format!("{}:{p}", address.trim()),
        },
        None => config::kubeproxy::append_port_if_needed(address.trim(), default_port),
    }
}

impl RunArgs {
    /// kube-proxy's configuration as the flags give it, without a config file: upstream's
    /// defaults, then each flag (their defaults are upstream's).
    fn kube_proxy_config_from_flags(&self) -> KubeProxyConfiguration {
        let x = &self.kube_proxy;
        let mut kp = KubeProxyConfiguration::defaults();
        kp.mode = x.mode.clone().unwrap_or_default();
        kp.feature_gates = x.feature_gates.clone();
        kp.client_connection.kubeconfig = self.kubeconfig.clone().unwrap_or_default();
        kp.bind_address = self.proxy.bind_address.trim().to_string();
        kp.healthz_bind_address =
            address_with_port(&self.healthz_bind_address, x.healthz_port, config::kubeproxy::HEALTHZ_PORT);
        kp.metrics_bind_address =
            address_with_port(&self.metrics_bind_address, x.metrics_port, config::kubeproxy::METRICS_PORT);
        kp.bind_address_hard_fail = self.bind_address_hard_fail;
        kp.cluster_cidr = self.proxy.cluster_cidr.clone();
        // pflag's StringSlice: each value is a comma-separated list.
        let nodeport_addresses: Vec<String> = self
            .proxy
            .nodeport_addresses
            .iter()
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(str::to_string)
            .collect();
        kp.node_port_addresses = (!nodeport_addresses.is_empty()).then_some(nodeport_addresses);
        kp.detect_local_mode = self.proxy.detect_local_mode.clone();
        kp.detect_local.bridge_interface = self.proxy.pod_bridge_interface.clone().unwrap_or_default();
        kp.detect_local.interface_name_prefix = self.proxy.pod_interface_name_prefix.clone().unwrap_or_default();
        let bit = i32::try_from(self.proxy.masquerade_bit).unwrap_or(i32::MAX);
        kp.iptables.masquerade_bit = Some(x.iptables_masquerade_bit.unwrap_or(bit));
        kp.nftables.masquerade_bit = Some(bit);
        kp.iptables.masquerade_all = self.proxy.masquerade_all;
        kp.nftables.masquerade_all = self.proxy.masquerade_all;
        // One pair of periods for whichever mode is named: upstream's --iptables-* flags set
        // them unless the mode is ipvs, its --ipvs-* flags when it is; nftproxy's own flags
        // otherwise.
        let own = (GoDuration::from_std(self.sync_period), GoDuration::from_std(self.min_sync_period));
        let named = if kp.mode == "ipvs" { x.ipvs_periods } else { x.iptables_periods };
        let periods = (named.0.unwrap_or(own.0), named.1.unwrap_or(own.1));
        (kp.iptables.sync_period, kp.iptables.min_sync_period) = periods;
        (kp.ipvs.sync_period, kp.ipvs.min_sync_period) = periods;
        (kp.nftables.sync_period, kp.nftables.min_sync_period) = periods;
        let c = &self.conntrack;
        kp.conntrack.max_per_core = Some(i64::from(c.conntrack_max_per_core));
        kp.conntrack.min = Some(i64::from(c.conntrack_min));
        kp.conntrack.tcp_established_timeout = Some(GoDuration::from_std(c.conntrack_tcp_timeout_established));
        kp.conntrack.tcp_close_wait_timeout = Some(GoDuration::from_std(c.conntrack_tcp_timeout_close_wait));
        kp.conntrack.tcp_be_liberal = c.conntrack_tcp_be_liberal;
        kp.conntrack.udp_timeout = GoDuration::from_std(c.conntrack_udp_timeout);
        kp.conntrack.udp_stream_timeout = GoDuration::from_std(c.conntrack_udp_timeout_stream);
        kp.oom_score_adj = Some(x.oom_score_adj.unwrap_or(config::kubeproxy::OOM_SCORE_ADJ));
        kp
    }

    /// kube-proxy's configuration with upstream's precedence: with `--config`, the file (every
    /// kube-proxy flag but `--hostname-override` and the logging flags is then ignored, with a
    /// warning naming it); without, the flags. Validated as upstream validates it. Returns the
    /// configuration and warnings.
    pub fn kube_proxy_config(
        &self,
        matches: Option<&clap::ArgMatches>,
    ) -> Result<(KubeProxyConfiguration, Vec<String>), CliError> {
        let explicit = explicit_in(matches);
        let mut warnings: Vec<String> = self
            .kube_proxy
            .unused
            .iter()
            .map(|f| format!("--{f}: a kube-proxy flag nftproxy does not use; ignored"))
            .collect();
        let mut kp = match &self.config {
            Some(path) => {
                let (kp, found) = read_config(path)?;
                warnings.extend(found.into_iter().map(|w| format!("--config {w}")));
                let mut ignored: Vec<String> =
                    FILE_WINS.iter().filter(|(id, _)| explicit(id)).map(|(_, flag)| flag.to_string()).collect();
                let named: Vec<String> =
                    self.kube_proxy.given.iter().filter(|f| !ignored.contains(f)).cloned().collect();
                ignored.extend(named);
                for flag in ignored {
                    warnings.push(format!(
                        "--{flag} is ignored: --config is given, and kube-proxy then takes it from the file"
                    ));
                }
                kp
            }
            None => self.kube_proxy_config_from_flags(),
        };
        // Upstream: a non-empty flag wins (all whitespace is refused); an empty one is as if
        // absent. Whatever the source, the name is trimmed and lowercased (GetHostname).
        if let Some(h) = self.proxy.hostname_override.as_deref().filter(|h| !h.is_empty()) {
            if h.trim().is_empty() {
                return Err(ConfigError::EmptyHostname.into());
            }
            kp.hostname_override = h.to_string();
        }
        kp.hostname_override = kp.hostname_override.trim().to_lowercase();
        kp.validate()?;
        Ok((kp, warnings))
    }

    /// Settings from kube-proxy's configuration (see [`RunArgs::kube_proxy_config`]) and
    /// nftproxy's own flags; warnings name what was not applied.
    pub fn settings(
        &self,
        matches: Option<&clap::ArgMatches>,
    ) -> Result<(crate::agent::RunSettings, Vec<String>), CliError> {
        let (kp, mut warnings) = self.kube_proxy_config(matches)?;
        let hostname = if kp.hostname_override.is_empty() {
            nix::unistd::gethostname().map(|h| h.to_string_lossy().trim().to_lowercase()).unwrap_or_default()
        } else {
            kp.hostname_override.clone()
        };
        let mut proxy = ProxyConfig::new(hostname);
        let detect_local = kp.detect_local()?;
        // Pod ranges matter only to ClusterCIDR mode; upstream ignores them in the others.
        proxy.cluster_cidrs = match config::parse_cidrs("clusterCIDR", &kp.cluster_cidrs().join(",")) {
            Ok(c) => c,
            Err(_) if detect_local != config::DetectLocal::ClusterCidr => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        proxy.detect_local = detect_local;
        proxy.masquerade_all = kp.masquerade_all();
        proxy.masquerade_bit = u32::try_from(kp.masquerade_bit()).map_err(|_| ConfigError::MasqueradeBit(u32::MAX))?;
        let (nodeport_addresses, found) = kp.node_port_addresses()?;
        warnings.extend(found);
        proxy.nodeport_addresses = nodeport_addresses;
        proxy.bind_address = config::parse_bind_address("bindAddress", &kp.bind_address)?;
        proxy.table = self.proxy.table.table.clone();
        proxy.conntrack_cleanup = self.proxy.conntrack_cleanup;
        proxy.table_ownership = self.proxy.table_ownership;
        proxy.validate()?;
        let (sync, min) = kp.sync_periods();
        let source = match &self.manifests {
            Some(path) => crate::agent::SourceSetting::Manifests(path.clone()),
            None => crate::agent::SourceSetting::Kubernetes {
                kubeconfig: Some(kp.client_connection.kubeconfig.clone()).filter(|k| !k.is_empty()),
                master: self.kube_proxy.master.clone(),
            },
        };
        let settings = crate::agent::RunSettings {
            proxy,
            source,
            timing: crate::agent::runner::Timing {
                min_sync_period: min.to_std().unwrap_or_default(),
                sync_period: sync.to_std().unwrap_or(crate::agent::runner::Timing::default().sync_period),
                ..Default::default()
            },
            healthz: kp.healthz_address(),
            metrics: kp.metrics_address(),
            poll: self.manifests_poll,
            conntrack: conntrack_sysctls_of(&kp),
            bind_address_hard_fail: kp.bind_address_hard_fail,
            cleanup_kube_proxy: self.cleanup_kube_proxy,
            mode: kp.proxy_mode().unwrap_or(config::kubeproxy::ProxyMode::Unset),
            oom_score_adj: kp.oom_score_adj,
            config_file: self.config.clone(),
            configz: kp.configz(),
        };
        Ok((settings, warnings))
    }
}

/// The conntrack sysctls a validated configuration asks for (negative values were refused).
fn conntrack_sysctls_of(kp: &KubeProxyConfiguration) -> crate::conntrack::sysctls::ConntrackSysctls {
    let c = &kp.conntrack;
    let defaults = crate::conntrack::sysctls::ConntrackSysctls::default();
    let count = |v: Option<i64>, default: u32| v.and_then(|v| u32::try_from(v).ok()).unwrap_or(default);
    let time = |d: Option<GoDuration>| d.and_then(GoDuration::to_std).unwrap_or_default();
    crate::conntrack::sysctls::ConntrackSysctls {
        max_per_core: count(c.max_per_core, defaults.max_per_core),
        min: count(c.min, defaults.min),
        tcp_established_timeout: time(c.tcp_established_timeout),
        tcp_close_wait_timeout: time(c.tcp_close_wait_timeout),
        tcp_be_liberal: c.tcp_be_liberal,
        udp_timeout: time(Some(c.udp_timeout)),
        udp_stream_timeout: time(Some(c.udp_stream_timeout)),
    }
}

/// Reads a `--config` file: defaulted, with warnings for unknown and unused fields.
fn read_config(path: &std::path::Path) -> Result<(KubeProxyConfiguration, Vec<String>), CliError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File(format!("{}: {e}", path.display())))?;
    // A decoding error names the file as well as the field.
    KubeProxyConfiguration::parse(&text).map_err(|e| match e {
        ConfigError::File(why) => ConfigError::File(format!("{}: {why}", path.display())).into(),
        other => other.into(),
    })
}

/// kube-proxy's `--conntrack-*` flags: the kernel conntrack settings applied at start-up (with
/// `--config`, the file's `conntrack:` decides instead, as in kube-proxy).
#[derive(Debug, Clone, Args)]
pub struct ConntrackArgs {
    /// Maximum number of NAT connections to track per CPU core (0 to leave the limit as-is and
    /// ignore conntrack-min).
    #[arg(long, value_name = "N", default_value_t = 32768)]
    pub conntrack_max_per_core: u32,
    /// Minimum number of conntrack entries to allocate, regardless of conntrack-max-per-core
    /// (set conntrack-max-per-core=0 to leave the limit as-is).
    #[arg(long, value_name = "N", default_value_t = 131072)]
    pub conntrack_min: u32,
    /// Idle timeout for established TCP connections (0 to leave as-is).
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = humantime::parse_duration)]
    pub conntrack_tcp_timeout_established: std::time::Duration,
    /// NAT timeout for TCP connections in the CLOSE_WAIT state (0 to leave as-is).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = humantime::parse_duration)]
    pub conntrack_tcp_timeout_close_wait: std::time::Duration,
    /// Enable liberal mode for tracking TCP packets by setting nf_conntrack_tcp_be_liberal to 1.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub conntrack_tcp_be_liberal: bool,
    /// Idle timeout for UNREPLIED UDP connections (0 to leave as-is).
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = humantime::parse_duration)]
    pub conntrack_udp_timeout: std::time::Duration,
    /// Idle timeout for ASSURED UDP connections (0 to leave as-is).
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = humantime::parse_duration)]
    pub conntrack_udp_timeout_stream: std::time::Duration,
}

impl ConntrackArgs {
    /// The flags' values.
    pub fn sysctls(&self) -> crate::conntrack::sysctls::ConntrackSysctls {
        crate::conntrack::sysctls::ConntrackSysctls {
            max_per_core: self.conntrack_max_per_core,
            min: self.conntrack_min,
            tcp_established_timeout: self.conntrack_tcp_timeout_established,
            tcp_close_wait_timeout: self.conntrack_tcp_timeout_close_wait,
            tcp_be_liberal: self.conntrack_tcp_be_liberal,
            udp_timeout: self.conntrack_udp_timeout,
            udp_stream_timeout: self.conntrack_udp_timeout_stream,
        }
    }
}

/// The sysctls `conntrack-sysctls` sets: with `--config`, the file's `conntrack:` (defaulted,
/// validated; flags are then ignored with a warning, as kube-proxy ignores them); else the flags.
fn conntrack_settings(
    args: &ConntrackSysctlsArgs,
    matches: Option<&clap::ArgMatches>,
) -> Result<crate::conntrack::sysctls::ConntrackSysctls, CliError> {
    let Some(path) = &args.config else { return Ok(args.conntrack.sysctls()) };
    let (kp, _unused_fields) = read_config(path)?;
    kp.validate()?;
    let explicit = explicit_in(matches);
    for (id, flag) in FILE_WINS.iter().filter(|(id, _)| id.starts_with("conntrack_")) {
        if explicit(id) {
            warn!("--{flag} is ignored: --config is given, and kube-proxy then takes it from the file");
        }
    }
    Ok(conntrack_sysctls_of(&kp))
}

/// `conntrack-sysctls` options.
#[derive(Debug, Args)]
pub struct ConntrackSysctlsArgs {
    /// A kube-proxy KubeProxyConfiguration file: its `conntrack:` settings decide (the
    /// `--conntrack-*` flags are then ignored, as kube-proxy ignores them).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub conntrack: ConntrackArgs,
    /// Where /proc/sys is (tests point it elsewhere).
    #[arg(long, value_name = "PATH", default_value = "/proc/sys", hide = true)]
    pub proc_sys_root: PathBuf,
    /// Where /sys is (tests point it elsewhere).
    #[arg(long, value_name = "PATH", default_value = "/sys", hide = true)]
    pub sys_root: PathBuf,
}

/// `nftproxy conntrack-sysctls`: applies the settings, prints one line per value, and fails
/// when start-up would have to refuse.
fn conntrack_sysctls(args: &ConntrackSysctlsArgs, matches: Option<&clap::ArgMatches>) -> Result<(), CliError> {
    let settings = conntrack_settings(args, matches)?;
    let roots =
        crate::conntrack::sysctls::SysctlRoots { proc_sys: args.proc_sys_root.clone(), sys: args.sys_root.clone() };
    let cpus = crate::conntrack::sysctls::machine_cpus(&roots);
    let report = crate::conntrack::sysctls::apply(&settings, &roots, cpus);
    crate::conntrack::sysctls::log(&report);
    for applied in &report.applied {
        println!("{applied}");
    }
    match report.failure_summary() {
        Some(failed) if report.refuses_start_up() => Err(CliError::Sysctls(failed)),
        Some(failed) => {
            warn!(failed, "cannot set the conntrack hashsize: /sys is read-only; problems may arise later");
            Ok(())
        }
        None => Ok(()),
    }
}

/// Where objects come from, plus the proxy flags.
#[derive(Debug, Args)]
pub struct ManifestArgs {
    /// A YAML/JSON manifest file or a directory of them (Services, EndpointSlices, Nodes).
    #[arg(long, value_name = "PATH")]
    pub manifests: PathBuf,
    #[command(flatten)]
    pub proxy: ProxyArgs,
}

/// kube-proxy-compatible flags.
#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// This node's name, as in EndpointSlice `nodeName` (default: the machine's hostname).
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// Pod CIDRs, comma-separated (IPv4 and/or IPv6); ClusterIP traffic from outside is masqueraded.
    #[arg(long, value_name = "CIDRS", default_value = "")]
    pub cluster_cidr: String,
    /// Masquerade all traffic to ClusterIPs.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub masquerade_all: bool,
    /// The packet-mark bit that requests masquerade (14 → 0x4000).
    #[arg(long, value_name = "BIT", default_value_t = 14)]
    pub masquerade_bit: u32,
    /// Addresses that accept NodePorts: CIDRs and the keywords `primary` (the default), `all`
    /// and `localhost` (127.0.0.0/8 and ::1/128; NodePorts are never served on loopback),
    /// comma-separated; a family none of them names accepts NodePorts on all its local
    /// addresses.
    #[arg(long, value_name = "CIDRS")]
    pub nodeport_addresses: Vec<String>,
    /// Overrides this node's primary IP (of its family) for `primary` node-port addresses and
    /// the LoadBalancerSourceRanges node check; nothing binds to it (kube-proxy's historical
    /// name). `0.0.0.0` or `::` leaves the Node's own addresses.
    #[arg(long, value_name = "IP", default_value = "0.0.0.0")]
    pub bind_address: String,
    /// How pod traffic is recognised: ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix.
    #[arg(long, value_name = "MODE", default_value = "ClusterCIDR")]
    pub detect_local_mode: String,
    /// The pod bridge, for --detect-local-mode BridgeInterface.
    #[arg(long, value_name = "NAME")]
    pub pod_bridge_interface: Option<String>,
    /// The pod interface prefix, for --detect-local-mode InterfaceNamePrefix.
    #[arg(long, value_name = "PREFIX")]
    pub pod_interface_name_prefix: Option<String>,
    /// Delete stale UDP/SCTP conntrack entries after each sync (`false` to disable).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub conntrack_cleanup: bool,
    /// Own nftproxy's tables while running so no other process can change them (`flags owner,
    /// persist`, Linux >= 6.9; ignored on older kernels). `false` allows editing them by hand.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub table_ownership: bool,
    #[command(flatten)]
    pub table: TableArgs,
}

/// The table name.
#[derive(Debug, Clone, Args)]
pub struct TableArgs {
    /// The nftables table name (in the ip and ip6 families).
    #[arg(long, value_name = "NAME", default_value = ProxyConfig::DEFAULT_TABLE)]
    pub table: String,
}

/// `trace` options.
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Trace packets to this address, and port if given (`10.96.0.10:80`, `[fd00::10]:80`).
    #[arg(long, value_name = "IP[:PORT]")]
    pub dst: Option<String>,
    /// Trace packets from this address.
    #[arg(long, value_name = "IP")]
    pub src: Option<IpAddr>,
    /// Trace this protocol only: tcp, udp, sctp, icmp, icmpv6 (default: any; with a port,
    /// tcp, udp and sctp).
    #[arg(long, value_name = "PROTO")]
    pub proto: Option<String>,
    /// Exit after this many packets.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub count: usize,
    /// Exit after this long, however many packets were traced.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = humantime::parse_duration)]
    pub timeout: std::time::Duration,
    #[command(flatten)]
    pub table: TableArgs,
}

impl TraceArgs {
    /// The options, checked.
    fn options(&self) -> Result<crate::trace::TraceOptions, CliError> {
        let invalid = |flag: &'static str, value: &str, why: &str| CliError::Invalid {
            flag,
            value: value.to_string(),
            why: why.to_string(),
        };
        let (destination, destination_port) = match self.dst.as_deref().map(str::trim) {
            None => (None, None),
            Some(d) => match (d.parse::<std::net::SocketAddr>(), d.parse::<IpAddr>()) {
                (Ok(a), _) => (Some(a.ip()), Some(a.port())),
                (_, Ok(ip)) => (Some(ip), None),
                _ => return Err(invalid("--dst", d, "expected IP or IP:PORT ([IPv6]:PORT)")),
            },
        };
        if let (Some(d), Some(s)) = (destination, self.src)
            && d.is_ipv4() != s.is_ipv4()
        {
            return Err(invalid("--src", &s.to_string(), "not of --dst's address family"));
        }
        let protocols = match self.proto.as_deref().map(|p| p.trim().to_ascii_lowercase()) {
            None => Vec::new(),
            Some(p) => {
                let number = match p.as_str() {
                    "tcp" => 6,
                    "udp" => 17,
                    "sctp" => 132,
                    "icmp" => 1,
                    "icmpv6" | "ipv6-icmp" => 58,
                    _ => return Err(invalid("--proto", &p, "expected tcp, udp, sctp, icmp or icmpv6")),
                };
                if destination_port.is_some() && ![6, 17, 132].contains(&number) {
                    return Err(invalid("--proto", &p, "a port needs tcp, udp or sctp"));
                }
                vec![number]
            }
        };
        if self.count == 0 {
            return Err(invalid("--count", "0", "trace at least one packet"));
        }
        Ok(crate::trace::TraceOptions {
            source: self.src,
            destination,
            destination_port,
            protocols,
            count: self.count,
            timeout: self.timeout,
            table: self.table.table.clone(),
        })
    }
}

/// `explain` options.
#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The connection's source address, and port if given (`10.244.1.10`, `[fd00::1]:40000`).
    #[arg(long, value_name = "IP[:PORT]")]
    pub src: String,
    /// The connection's destination (`10.96.0.10:80`, `[fd00:96::10]:80`).
    #[arg(long, value_name = "IP:PORT")]
    pub dst: String,
    /// tcp, udp or sctp.
    #[arg(long, value_name = "PROTO", default_value = "tcp")]
    pub proto: String,
    /// The connection starts on the node itself (entering at output, not prerouting).
    #[arg(long)]
    pub local: bool,
    /// The interface an arriving connection comes in on, for rules that match it
    /// (--detect-local-mode BridgeInterface or InterfaceNamePrefix).
    #[arg(long, value_name = "NAME", conflicts_with = "local")]
    pub iif: Option<String>,
    /// Evaluate the ruleset planned from these manifests and the proxy flags (offline) instead
    /// of the one the kernel holds here.
    #[arg(long, value_name = "PATH")]
    pub manifests: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    pub output: CheckOutput,
    #[command(flatten)]
    pub proxy: ProxyArgs,
}

/// The source port of a connection when `--src` has none (any ephemeral port: nftproxy's rules
/// never look at it).
const EXPLAIN_SOURCE_PORT: u16 = 40000;

impl ExplainArgs {
    /// The connection, checked.
    fn connection(&self) -> Result<crate::explain::Connection, CliError> {
        let invalid = |flag: &'static str, value: &str, why: &str| CliError::Invalid {
            flag,
            value: value.to_string(),
            why: why.to_string(),
        };
        let src = self.src.trim();
        let (source, source_port) = match (src.parse::<std::net::SocketAddr>(), src.parse::<IpAddr>()) {
            (Ok(a), _) => (a.ip(), a.port()),
            (_, Ok(ip)) => (ip, EXPLAIN_SOURCE_PORT),
            _ => return Err(invalid("--src", src, "expected IP or IP:PORT ([IPv6]:PORT)")),
        };
        let dst = self.dst.trim();
        let destination =
            dst.parse::<std::net::SocketAddr>().map_err(|_| invalid("--dst", dst, "expected IP:PORT ([IPv6]:PORT)"))?;
        let protocol = match self.proto.trim().to_ascii_lowercase().as_str() {
            "tcp" => 6,
            "udp" => 17,
            "sctp" => 132,
            other => return Err(invalid("--proto", other, "expected tcp, udp or sctp")),
        };
        Ok(crate::explain::Connection {
            source,
            source_port,
            destination: destination.ip(),
            destination_port: destination.port(),
            protocol,
            local: self.local,
            input_interface: self.iif.clone(),
        })
    }
}

/// `nftproxy explain`: evaluates the connection and prints the explanation.
fn explain(args: &ExplainArgs) -> Result<(), CliError> {
    let connection = args.connection()?;
    let table = args.proxy.table.table.clone();
    let (ruleset, locals, origin) = match &args.manifests {
        Some(path) => {
            let config = args.proxy.config()?;
            let state = load_state(&ManifestArgs { manifests: path.clone(), proxy: args.proxy.clone() }, &config)?;
            let (planned, targets) = plan_here(&config, &state);
            // Offline, the node's addresses are the Node's and the node-port addresses; a
            // connection from the node starts at one of them.
            let mut locals: Vec<IpAddr> = state.node().map(|n| n.host_ips.clone()).unwrap_or_default();
            for targets in [&targets.v4, &targets.v6] {
                if let crate::plan::NodePorts::Addresses(ips) = targets {
                    locals.extend(ips.iter().copied());
                }
            }
            if connection.local {
                locals.push(connection.source);
            }
            (crate::nft::lower::lower_ruleset(&planned.ruleset), locals, "manifests")
        }
        None => {
            let mut kernel = Kernel::open()?;
            let names: Vec<(crate::net::IpFamily, &str)> =
                crate::net::IpFamily::ALL.iter().map(|f| (*f, table.as_str())).collect();
            // A running `nftproxy run` owns its tables: looking is allowed all the same.
            let ruleset = kernel.inspect(&names)?;
            let locals = crate::nodeaddr::local_addresses().into_iter().map(|(_, a)| a).collect();
            (ruleset, locals, "kernel")
        }
    };
    let surroundings = crate::explain::LocalAddresses(locals);
    let explanation = crate::explain::explain(&ruleset, &table, origin, &surroundings, &connection)?;
    match args.output {
        CheckOutput::Text => print!("{}", crate::explain::report::to_text(&explanation)),
        CheckOutput::Json => {
            println!("{}", crate::explain::report::to_json(&explanation).map_err(CliError::ReportJson)?)
        }
    }
    Ok(())
}

/// `status` options.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Where `nftproxy run` serves metrics (its --metrics-bind-address).
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10249")]
    pub metrics_address: String,
    /// Only this service.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub service: Option<String>,
    /// Only this namespace.
    #[arg(long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// Service ports shown at most (the rest are counted).
    #[arg(long, value_name = "N", default_value_t = crate::debug_services::DEFAULT_LIMIT)]
    pub limit: usize,
    /// Output format.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    pub output: CheckOutput,
}

impl StatusArgs {
    /// The query, checked the way the server checks it.
    fn selection(&self) -> Result<crate::debug_services::Selection, CliError> {
        let mut query = vec![format!("limit={}", self.limit)];
        query.extend(self.namespace.as_ref().map(|n| format!("namespace={n}")));
        query.extend(self.service.as_ref().map(|s| format!("service={s}")));
        crate::debug_services::Selection::parse(&query.join("&")).map_err(|why| CliError::Invalid {
            flag: "--service/--namespace/--limit",
            value: query.join(" "),
            why,
        })
    }
}

/// `check` options.
#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// Also ask the API server, with this kubeconfig, whether nftproxy's identity may list,
    /// watch and write what nftproxy uses (after an image swap: kube-proxy's ServiceAccount and
    /// its ClusterRole, system:node-proxier). Each missing permission is a finding.
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<String>,
    /// As --kubeconfig, with the in-cluster ServiceAccount (inside nftproxy's pod).
    #[arg(long, conflicts_with = "kubeconfig")]
    pub api: bool,
    /// Report format.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    pub output: CheckOutput,
}

/// How `check` and `status` print their report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CheckOutput {
    /// Readable text (`check`: findings, then every base chain by hook).
    Text,
    /// One JSON object (`check`: findings with stable `kind` codes, base chains; `status`:
    /// `/debug/services` as served).
    Json,
}

/// `check`'s exit status when it could not read the ruleset (1 means it found problems).
const CHECK_FAILED: u8 = 2;

/// Errors that end a command.
#[derive(Debug, Error)]
pub enum CliError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Manifests(#[from] ManifestError),
    #[error(transparent)]
    Sync(#[from] SyncError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    OneShot(#[from] OneShotError),
    #[error(transparent)]
    Run(#[from] crate::agent::RunError),
    #[error(transparent)]
    Tool(#[from] crate::tools::ToolError),
    #[error("cannot write the output: {0}")]
    Output(#[source] std::io::Error),
    #[error("cannot encode the report as JSON: {0}")]
    ReportJson(#[source] serde_json::Error),
    #[error("invalid {flag} {value:?}: expected IP:PORT")]
    Address { flag: &'static str, value: String },
    #[error("cannot set conntrack sysctls: {0}")]
    Sysctls(String),
    #[error("invalid {flag} {value:?}: {why}")]
    Invalid { flag: &'static str, value: String, why: String },
    #[error(transparent)]
    Trace(#[from] crate::trace::TraceError),
    #[error(transparent)]
    Status(#[from] crate::status::StatusError),
    #[error(transparent)]
    Explain(#[from] crate::explain::ExplainError),
    #[error(transparent)]
    Kube(#[from] crate::source::kube::KubeSourceError),
}

fn parse_logging_format(s: &str) -> Result<LoggingFormat, String> {
    LoggingFormat::parse("--logging-format", s).map_err(|e| e.to_string())
}

/// klog's verbosity as `-v` counts: 0 up to 3, 1 (debug) for 4 and 5, 2 (trace) from 6.
pub fn verbosity_count(v: u32) -> u8 {
    match v {
        0..=3 => 0,
        4 | 5 => 1,
        _ => 2,
    }
}

/// The verbosity `run --config`'s `logging.verbosity` asks for, as `-v` counts (0 without one).
pub fn config_verbosity(cli: &Cli) -> u8 {
    let Command::Run(args) = &cli.command else { return 0 };
    args.config
        .as_ref()
        .and_then(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| KubeProxyConfiguration::parse(&text).ok())
        .map_or(0, |(file, _)| verbosity_count(file.logging.verbosity))
}

/// The log format: `--logging-format` when given, else `logging.format` of `run --config`,
/// else text. A config file that cannot be read gives text here; `run` reports it.
pub fn logging_format(cli: &Cli) -> LoggingFormat {
    if let Some(f) = cli.logging_format {
        return f;
    }
    let Command::Run(args) = &cli.command else { return LoggingFormat::Text };
    args.config
        .as_ref()
        .and_then(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| KubeProxyConfiguration::parse(&text).ok())
        .and_then(|(file, _)| file.logging_format().ok())
        .unwrap_or_default()
}

/// Parses an optional `IP:PORT` flag (empty disables).
fn bind_address(flag: &'static str, value: &str) -> Result<Option<std::net::SocketAddr>, CliError> {
    if value.trim().is_empty() {
        return Ok(None);
    }
    value.trim().parse().map(Some).map_err(|_| CliError::Address { flag, value: value.to_string() })
}

impl ProxyArgs {
    /// Validated settings.
    pub fn config(&self) -> Result<ProxyConfig, ConfigError> {
        let hostname = match &self.hostname_override {
            Some(h) => h.trim().to_string(),
            None => nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default(),
        };
        let mut c = ProxyConfig::new(hostname.to_lowercase());
        c.cluster_cidrs = config::parse_cidrs("--cluster-cidr", &self.cluster_cidr)?;
        c.masquerade_all = self.masquerade_all;
        c.masquerade_bit = self.masquerade_bit;
        let (nodeport_addresses, warnings) =
            config::parse_nodeport_addresses("--nodeport-addresses", &self.nodeport_addresses)?;
        for w in warnings {
            warn!("{w}");
        }
        c.nodeport_addresses = nodeport_addresses;
        c.bind_address = config::parse_bind_address("--bind-address", &self.bind_address)?;
        c.detect_local = config::parse_detect_local(
            &self.detect_local_mode,
            self.pod_bridge_interface.as_deref(),
            self.pod_interface_name_prefix.as_deref(),
        )?;
        c.table = self.table.table.clone();
        c.conntrack_cleanup = self.conntrack_cleanup;
        c.table_ownership = self.table_ownership;
        c.validate()?;
        Ok(c)
    }
}

/// Loads manifests into a cluster state, logging every problem.
pub(crate) fn load_state(args: &ManifestArgs, config: &ProxyConfig) -> Result<ClusterState, CliError> {
    let started = std::time::Instant::now();
    let manifests = source::manifests::load(&args.manifests)?;
    for p in &manifests.problems {
        warn!("{p}");
    }
    let (mut state, problems) = manifests.into_state(&config.hostname);
    if let Some(mut node) = state.node().cloned() {
        crate::nodeaddr::apply_bind_address(&mut node, config.bind_address);
        state.set_node(Some(node));
    }
    for p in &problems {
        warn!("{p}");
    }
    tracing::debug!(
        services = state.service_count(),
        slices = state.slice_count(),
        ms = started.elapsed().as_millis() as u64,
        "manifests loaded"
    );
    Ok(state)
}

/// Writes the ruleset for a state as nft text to `out` (what `render` prints).
fn write_rendered(config: &ProxyConfig, state: &ClusterState, out: &mut impl std::io::Write) -> std::io::Result<()> {
    let started = std::time::Instant::now();
    let (planned, _) = plan_here(config, state);
    tracing::debug!(ms = started.elapsed().as_millis() as u64, "planned");
    write!(out, "{}", planned.ruleset)?;
    out.flush()
}

/// kube-proxy's `--cleanup`: deletes nftproxy's tables here and exits (kube-proxy's own
/// leftovers go in the first sync of the next start, or with `nftproxy check`'s guidance).
pub fn kube_proxy_cleanup(cli: &Cli) -> ExitCode {
    let Command::Run(args) = &cli.command else { return ExitCode::FAILURE };
    let mut config = ProxyConfig::new("cleanup");
    config.table = args.proxy.table.table.clone();
    let result = Kernel::open().map_err(CliError::from).and_then(|mut k| Ok(sync::cleanup(&mut k, &config)?));
    match result {
        Ok(n) => {
            tracing::info!(tables = n, "--cleanup: nftproxy's tables deleted");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// kube-proxy's `--write-config-to`: writes the configuration the command line gives (the
/// defaults under the flags, or the `--config` file defaulted) as YAML, then exits.
pub fn write_config_to(cli: &Cli, matches: &clap::ArgMatches, path: &str) -> ExitCode {
    let Command::Run(args) = &cli.command else { return ExitCode::FAILURE };
    let written = args
        .kube_proxy_config(matches.subcommand_matches("run"))
        .and_then(|(kp, _)| {
            serde_yaml_ng::to_string(&kp).map_err(|e| CliError::Invalid {
                flag: "--write-config-to",
                value: path.to_string(),
                why: e.to_string(),
            })
        })
        .and_then(|text| {
            std::fs::write(path, text).map_err(|e| CliError::Invalid {
                flag: "--write-config-to",
                value: path.to_string(),
                why: e.to_string(),
            })
        });
    match written {
        Ok(()) => {
            tracing::info!(file = path, "Wrote configuration");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!("{e}");
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the CLI; returns the process exit code. `matches` tells flags given on the command line
/// from defaults (a config file sits between them).
pub fn run(cli: Cli, matches: Option<&clap::ArgMatches>) -> ExitCode {
    // `check` has its own exit statuses: 1 reports findings, so a failure to check is 2.
    if let Command::Check(args) = &cli.command {
        return match check(args) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                error!("{e}");
                eprintln!("error: {e}");
                ExitCode::from(CHECK_FAILED)
            }
        };
    }
    match execute(cli, matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Reads every table here over netlink, checks it against nftproxy's base chains and prints the
/// report; returns the exit status (0 nothing conflicts, 1 warnings or conflicts).
fn check(args: &CheckArgs) -> Result<u8, CliError> {
    let mut kernel = Kernel::open()?;
    let tables = kernel.list_tables()?;
    let ports: Vec<u32> = tables.iter().filter_map(|t| t.owner).collect();
    let owners = crate::check::host::netlink_owners(&ports);
    let legacy = crate::check::host::legacy_iptables();
    let ours = crate::plan::base_chains();
    let mut report = crate::check::check(&crate::check::CheckInput {
        tables: &tables,
        table: &args.table.table,
        ours: &ours,
        owners: &owners,
        legacy_iptables: &legacy,
    });
    let leftovers = crate::takeover::Leftovers::read_with(&mut kernel, &tables)?;
    report.findings.extend(crate::check::legacy_leftover_findings(&leftovers.legacy));
    report.findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    report.takeover = Some(leftovers).filter(|l| !l.is_empty() || !l.kept.is_empty());
    if args.api || args.kubeconfig.is_some() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(CliError::Output)?;
        let (who, denied) = rt.block_on(crate::check::api::denied(args.kubeconfig.as_deref()))?;
        let mut missing = crate::check::permissions::findings(&denied, &who);
        missing.append(&mut report.findings);
        report.findings = missing;
        report.findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    }
    match args.output {
        CheckOutput::Text => print!("{}", report.to_text()),
        CheckOutput::Json => {
            println!("{}", serde_json::to_string_pretty(&report).map_err(CliError::ReportJson)?)
        }
    }
    Ok(report.exit_code())
}

fn execute(cli: Cli, matches: Option<&clap::ArgMatches>) -> Result<(), CliError> {
    match cli.command {
        Command::Render(args) => {
            let config = args.proxy.config()?;
            let state = load_state(&args, &config)?;
            let stdout = std::io::stdout();
            write_rendered(&config, &state, &mut std::io::BufWriter::new(stdout.lock())).map_err(CliError::Output)?;
            Ok(())
        }
        Command::Sync(args) => {
            let config = args.proxy.config()?;
            let state = load_state(&args, &config)?;
            let synced = sync_once(&config, &state)?;
            if config.conntrack_cleanup {
                // A one-shot process has no previous sync: every flow is checked, nothing is
                // known to be deleted.
                let mut table = crate::conntrack::KernelFlows::default();
                crate::conntrack::Reconciler::default().reconcile(
                    &mut table,
                    &synced.conntrack,
                    &synced.nodeports,
                    &state,
                );
            }
            println!(
                "synced {} services ({} ports, {} endpoints): 1 transaction, {} messages, {:.1} ms",
                synced.stats.services,
                synced.stats.service_ports,
                synced.stats.endpoints,
                synced.report.apply.messages,
                synced.report.total.as_secs_f64() * 1000.0
            );
            Ok(())
        }
        Command::Cleanup(args) => {
            let mut config = ProxyConfig::new("cleanup");
            config.table = args.table;
            let mut kernel = Kernel::open()?;
            let n = sync::cleanup(&mut kernel, &config)?;
            println!("deleted {n} nftproxy table(s)");
            Ok(())
        }
        Command::Check(args) => {
            // Handled by `run`, which owns check's exit statuses.
            check(&args).map(|_| ())
        }
        Command::Run(args) => {
            let sub = matches.and_then(|m| m.subcommand_matches("run"));
            let (settings, warnings) = args.settings(sub)?;
            for w in warnings {
                warn!("--config {w}");
            }
            Ok(crate::agent::run(settings)?)
        }
        Command::ConntrackSysctls(args) => {
            conntrack_sysctls(&args, matches.and_then(|m| m.subcommand_matches("conntrack-sysctls")))
        }
        Command::Trace(args) => {
            let options = args.options()?;
            let stdout = std::io::stdout();
            crate::trace::trace(&options, &mut stdout.lock())?;
            Ok(())
        }
        Command::Explain(args) => explain(&args),
        Command::Status(args) => {
            let address = bind_address("--metrics-address", &args.metrics_address)?
                .ok_or(CliError::Address { flag: "--metrics-address", value: args.metrics_address.clone() })?;
            let json = crate::status::fetch(address, &args.selection()?)?;
            match args.output {
                CheckOutput::Json => println!("{}", json.trim_end()),
                CheckOutput::Text => print!("{}", crate::status::to_text(&crate::status::parse(address, &json)?)),
            }
            Ok(())
        }
        Command::Demo(args) => Ok(crate::tools::forward("demo", &args.args)?),
        Command::Bench(args) => Ok(crate::tools::forward("bench", &args.args)?),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;

    /// `conntrack-sysctls` parsed as the binary parses it, with `file` as its config's text.
    fn sysctls(args: &[&str], file: Option<&str>) -> crate::conntrack::sysctls::ConntrackSysctls {
        let dir = tempfile::tempdir().unwrap();
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        if let Some(text) = file {
            let path = dir.path().join("config.yaml");
            std::fs::write(&path, text).unwrap();
            args.push(format!("--config={}", path.display()));
        }
        let matches = Cli::command().try_get_matches_from(&args).unwrap();
        let Command::ConntrackSysctls(parsed) = Cli::from_arg_matches(&matches).unwrap().command else {
            panic!("not conntrack-sysctls")
        };
        conntrack_settings(&parsed, matches.subcommand_matches("conntrack-sysctls")).unwrap()
    }

    #[test]
    fn conntrack_settings_come_from_the_file_when_given_as_upstream_takes_them() {
        let defaults = sysctls(&["nftproxy", "conntrack-sysctls"], None);
        assert_eq!(defaults, crate::conntrack::sysctls::ConntrackSysctls::default());
        assert_eq!(sysctls(&["nftproxy", "conntrack-sysctls"], Some("{}")), defaults, "an empty file is the defaults");
        let file = "conntrack: {maxPerCore: 0, min: 5, udpTimeout: 45s, tcpBeLiberal: true, tcpCloseWaitTimeout: null}";
        let s = sysctls(&["nftproxy", "conntrack-sysctls", "--conntrack-min=7"], Some(file));
        assert_eq!((s.max_per_core, s.min, s.tcp_be_liberal), (0, 5, true), "the file wins");
        assert_eq!(s.udp_timeout, std::time::Duration::from_secs(45));
        assert_eq!(s.tcp_close_wait_timeout, std::time::Duration::from_secs(3600), "null is the default");
        let flags = sysctls(
            &[
                "nftproxy",
                "conntrack-sysctls",
                "--conntrack-min=7",
                "--conntrack-tcp-be-liberal",
                "--conntrack-tcp-timeout-established",
                "24h0m0s",
            ],
            None,
        );
        assert_eq!((flags.min, flags.tcp_be_liberal), (7, true));
        assert_eq!(flags.tcp_established_timeout, std::time::Duration::from_secs(86400));
        assert!(Cli::command().try_get_matches_from(["nftproxy", "run", "--conntrack-min=-1"]).is_err());
    }

    /// `run`'s settings as the binary reads them, with `file` as the config file if given.
    fn run_settings(args: &[&str], file: Option<&str>) -> Result<(crate::agent::RunSettings, Vec<String>), CliError> {
        let dir = tempfile::tempdir().unwrap();
        let mut argv: Vec<String> = ["nftproxy", "run"].iter().chain(args).map(|a| a.to_string()).collect();
        if let Some(text) = file {
            let path = dir.path().join("config.conf");
            std::fs::write(&path, text).unwrap();
            argv.push(format!("--config={}", path.display()));
        }
        let matches = Cli::command().try_get_matches_from(&argv).unwrap();
        let Command::Run(parsed) = Cli::from_arg_matches(&matches).unwrap().command else { panic!("not run") };
        parsed.settings(matches.subcommand_matches("run"))
    }

    /// The three failures with kubeadm's file: no servers, zero periods.
    #[test]
    fn kubeadms_config_serves_and_syncs_as_kube_proxy_would() {
        let kubeadm = include_str!("../../integration/fixtures/installers/kubeadm/config.conf");
        let (s, warnings) = run_settings(&["--hostname-override=Node1"], Some(kubeadm)).unwrap();
        assert_eq!(s.healthz, Some("0.0.0.0:10256".parse().unwrap()));
        assert_eq!(s.metrics, Some("127.0.0.1:10249".parse().unwrap()));
        assert_eq!(s.timing.sync_period, std::time::Duration::from_secs(30));
        assert_eq!(s.timing.min_sync_period, std::time::Duration::from_secs(1));
        assert_eq!(s.proxy.hostname, "node1");
        assert_eq!(s.proxy.masquerade_bit, 14);
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[test]
    fn with_a_config_file_the_file_wins_but_for_the_hostname() {
        let file = "clusterCIDR: 10.1.0.0/16\nhostnameOverride: from-file\nmode: nftables\nnftables: {masqueradeBit: 5, masqueradeAll: true, syncPeriod: 1m}\n";
        let (s, warnings) = run_settings(
            &["--hostname-override=from-flags", "--cluster-cidr=10.2.0.0/16", "--sync-period=5s"],
            Some(file),
        )
        .unwrap();
        assert_eq!(s.proxy.hostname, "from-flags");
        assert_eq!(s.proxy.cluster_cidrs[0].to_string(), "10.1.0.0/16");
        assert_eq!((s.proxy.masquerade_bit, s.proxy.masquerade_all), (5, true));
        assert_eq!(s.timing.sync_period, std::time::Duration::from_secs(60));
        assert!(warnings.iter().any(|w| w.starts_with("--cluster-cidr is ignored")), "{warnings:?}");
        assert!(warnings.iter().any(|w| w.starts_with("--sync-period is ignored")), "{warnings:?}");
        // Without a file the flags apply.
        let (s, _) =
            run_settings(&["--hostname-override=n", "--cluster-cidr=10.2.0.0/16", "--sync-period=5s"], None).unwrap();
        assert_eq!(s.proxy.cluster_cidrs[0].to_string(), "10.2.0.0/16");
        assert_eq!(s.timing.sync_period, std::time::Duration::from_secs(5));
        assert!(run_settings(&["--hostname-override=  "], None).is_err(), "upstream refuses an empty override");
    }

    #[test]
    fn zero_or_negative_periods_never_reach_the_loop() {
        let err = run_settings(&["--hostname-override=n", "--sync-period=0s"], None).unwrap_err().to_string();
        assert!(
            err.contains("KubeProxyConfiguration.SyncPeriod: Invalid value: \"0s\": must be greater than 0"),
            "{err}"
        );
        let err = run_settings(&["--hostname-override=n"], Some("mode: nftables\nnftables: {syncPeriod: -1s}\n"))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("failed validate: "), "{err}");
        let (s, _) =
            run_settings(&["--hostname-override=n"], Some("nftables: {syncPeriod: 0s, minSyncPeriod: 0s}\n")).unwrap();
        assert_eq!(s.timing.sync_period, std::time::Duration::from_secs(30), "zero is upstream's default");
    }

    /// pflag's comma-separated lists, and the hostname as upstream's GetHostname makes it.
    #[test]
    fn lists_split_on_commas_and_hostnames_are_normalised() {
        let (s, _) = run_settings(&["--hostname-override=n", "--nodeport-addresses=primary,10.0.0.0/8"], None).unwrap();
        assert!(s.proxy.nodeport_addresses.primary && s.proxy.nodeport_addresses.cidrs.len() == 1);
        let (s, _) = run_settings(&[], Some("hostnameOverride: \" Node-1 \"\n")).unwrap();
        assert_eq!(s.proxy.hostname, "node-1", "trimmed and lowercased, from the file too");
        let (s, _) = run_settings(&["--hostname-override="], Some("hostnameOverride: node-2\n")).unwrap();
        assert_eq!(s.proxy.hostname, "node-2", "an empty flag is as if absent");
        // kube-proxy's --metrics-port out of range: refused by validation, not defaulted.
        let cli = Cli::try_parse_from(["nftproxy", "run", "--metrics-bind-address=1.2.3.4"]).unwrap();
        let Command::Run(mut args) = cli.command else { panic!("not run") };
        args.kube_proxy.metrics_port = Some(70000);
        let err = args.kube_proxy_config(None).unwrap_err().to_string();
        assert!(err.contains("MetricsBindAddress") && err.contains("must be a valid port"), "{err}");
    }

    #[test]
    fn bare_ip_flags_get_ports_and_deprecated_ports_apply() {
        let (s, _) = run_settings(&["--hostname-override=n", "--healthz-bind-address=127.0.0.1"], None).unwrap();
        assert_eq!(s.healthz, Some("127.0.0.1:10256".parse().unwrap()));
        let (s, _) = run_settings(&["--hostname-override=n", "--healthz-bind-address="], None).unwrap();
        assert_eq!(s.healthz, None, "empty disables");
    }
}
