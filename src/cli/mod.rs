//! Command-line interface. Flag names follow kube-proxy's.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use thiserror::Error;
use tracing::{error, warn};

use crate::config::{self, ConfigError, LoggingFormat, ProxyConfig};
use crate::index::Pending;
use crate::model::ClusterState;
use crate::netlink::{Kernel, NetlinkError};
use crate::plan::{PlanInput, plan};
use crate::source::{self, manifests::ManifestError};
use crate::sync::{self, SyncError, SyncReason, Syncer};

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
    Run(RunArgs),
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
    /// A kube-proxy KubeProxyConfiguration file; flags given on the command line override it.
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
    /// Address of /healthz and /livez (empty disables; default `[::]:10256` when
    /// --bind-address is IPv6).
    #[arg(long, value_name = "IP:PORT", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: String,
    /// Address of /metrics, /healthz and /proxyMode (empty disables; default `[::1]:10249`
    /// when --bind-address is IPv6).
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
}

impl RunArgs {
    /// Settings from the flags, the config file under them; warnings name unused file fields.
    pub fn settings(
        &self,
        matches: Option<&clap::ArgMatches>,
    ) -> Result<(crate::agent::RunSettings, Vec<String>), CliError> {
        let explicit = |id: &str| -> bool {
            matches.is_some_and(|m| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
        };
        let (file, warnings) = read_config(self.config.as_deref())?;
        let proxy = config::merge(self.proxy.config()?, &explicit, &file)?;
        let pick = |id: &str, flag: std::time::Duration, from_file: Option<std::time::Duration>| {
            if explicit(id) { flag } else { from_file.unwrap_or(flag) }
        };
        // Upstream picks the servers' default addresses in the family of --bind-address.
        let v6 = proxy.bind_address.is_some_and(|ip| ip.is_ipv6());
        let address = |id: &'static str, flag: &str, from_file: Option<Option<std::net::SocketAddr>>| {
            if explicit(id) {
                return bind_address(id, flag);
            }
            match from_file {
                Some(addr) => Ok(addr),
                None if v6 => bind_address(id, &v6_default(flag)),
                None => bind_address(id, flag),
            }
        };
        let source = match (&self.manifests, &self.kubeconfig) {
            (Some(path), _) => crate::agent::SourceSetting::Manifests(path.clone()),
            (None, Some(kc)) => crate::agent::SourceSetting::Kubernetes { kubeconfig: Some(kc.clone()) },
            (None, None) => crate::agent::SourceSetting::Kubernetes { kubeconfig: file.kubeconfig.clone() },
        };
        let settings = crate::agent::RunSettings {
            proxy,
            source,
            timing: crate::agent::runner::Timing {
                min_sync_period: pick("min_sync_period", self.min_sync_period, file.min_sync_period),
                sync_period: pick("sync_period", self.sync_period, file.sync_period),
                ..Default::default()
            },
            healthz: address("healthz_bind_address", &self.healthz_bind_address, file.healthz_bind_address)?,
            metrics: address("metrics_bind_address", &self.metrics_bind_address, file.metrics_bind_address)?,
            poll: self.manifests_poll,
            conntrack: self.conntrack.settings(&explicit, &file.conntrack),
            bind_address_hard_fail: if explicit("bind_address_hard_fail") {
                self.bind_address_hard_fail
            } else {
                file.bind_address_hard_fail.unwrap_or(self.bind_address_hard_fail)
            },
            cleanup_kube_proxy: self.cleanup_kube_proxy,
        };
        Ok((settings, warnings))
    }
}

/// Reads a `--config` file, if one is given.
fn read_config(path: Option<&std::path::Path>) -> Result<(config::file::FileSettings, Vec<String>), CliError> {
    match path {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| ConfigError::File(format!("{}: {e}", path.display())))?;
            Ok(config::file::parse(&text)?)
        }
        None => Ok((config::file::FileSettings::default(), Vec::new())),
    }
}

/// kube-proxy's `--conntrack-*` flags: the kernel conntrack settings applied at start-up. A flag
/// given on the command line overrides the config file's `conntrack:` field, which overrides
/// the default.
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
    /// The settings: flags given on the command line, else the file's, else the defaults.
    pub fn settings(
        &self,
        explicit: &dyn Fn(&str) -> bool,
        file: &config::file::ConntrackSettings,
    ) -> crate::conntrack::sysctls::ConntrackSysctls {
        fn pick<T>(explicit: bool, flag: T, file: Option<T>) -> T {
            if explicit { flag } else { file.unwrap_or(flag) }
        }
        crate::conntrack::sysctls::ConntrackSysctls {
            max_per_core: pick(explicit("conntrack_max_per_core"), self.conntrack_max_per_core, file.max_per_core),
            min: pick(explicit("conntrack_min"), self.conntrack_min, file.min),
            tcp_established_timeout: pick(
                explicit("conntrack_tcp_timeout_established"),
                self.conntrack_tcp_timeout_established,
                file.tcp_established_timeout,
            ),
            tcp_close_wait_timeout: pick(
                explicit("conntrack_tcp_timeout_close_wait"),
                self.conntrack_tcp_timeout_close_wait,
                file.tcp_close_wait_timeout,
            ),
            tcp_be_liberal: pick(
                explicit("conntrack_tcp_be_liberal"),
                self.conntrack_tcp_be_liberal,
                file.tcp_be_liberal,
            ),
            udp_timeout: pick(explicit("conntrack_udp_timeout"), self.conntrack_udp_timeout, file.udp_timeout),
            udp_stream_timeout: pick(
                explicit("conntrack_udp_timeout_stream"),
                self.conntrack_udp_timeout_stream,
                file.udp_stream_timeout,
            ),
        }
    }
}

/// `conntrack-sysctls` options.
#[derive(Debug, Args)]
pub struct ConntrackSysctlsArgs {
    /// A kube-proxy KubeProxyConfiguration file (its `conntrack:` settings); flags given on the
    /// command line override it.
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
    let explicit = |id: &str| -> bool {
        matches.is_some_and(|m| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
    };
    let (file, _unused_fields) = read_config(args.config.as_deref())?;
    let settings = args.conntrack.settings(&explicit, &file.conntrack);
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
    #[arg(long)]
    pub masquerade_all: bool,
    /// The packet-mark bit that requests masquerade (14 → 0x4000).
    #[arg(long, value_name = "BIT", default_value_t = 14)]
    pub masquerade_bit: u32,
    /// Addresses that accept NodePorts: CIDRs and the keywords `primary` (the default), `all`
    /// and `localhost` (not served), comma-separated; a family none of them names accepts
    /// NodePorts on all its local addresses.
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
            let mut locals: Vec<IpAddr> = state.node().map(|n| n.internal_ips.clone()).unwrap_or_default();
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
    #[arg(long, value_name = "N", default_value_t = crate::agent::debug::DEFAULT_LIMIT)]
    pub limit: usize,
    /// Output format.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    pub output: CheckOutput,
}

impl StatusArgs {
    /// The query, checked the way the server checks it.
    fn selection(&self) -> Result<crate::agent::debug::Selection, CliError> {
        let mut query = vec![format!("limit={}", self.limit)];
        query.extend(self.namespace.as_ref().map(|n| format!("namespace={n}")));
        query.extend(self.service.as_ref().map(|s| format!("service={s}")));
        crate::agent::debug::Selection::parse(&query.join("&")).map_err(|why| CliError::Invalid {
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
}

fn parse_logging_format(s: &str) -> Result<LoggingFormat, String> {
    LoggingFormat::parse("--logging-format", s).map_err(|e| e.to_string())
}

/// A default server address moved to IPv6: `0.0.0.0:P` → `[::]:P`, `127.0.0.1:P` → `[::1]:P`.
fn v6_default(v4: &str) -> String {
    match v4.rsplit_once(':') {
        Some(("0.0.0.0", port)) => format!("[::]:{port}"),
        Some(("127.0.0.1", port)) => format!("[::1]:{port}"),
        _ => v4.to_string(),
    }
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
        .and_then(|text| config::file::parse(&text).ok())
        .and_then(|(file, _)| file.logging_format)
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

/// The plan for a state, node-port addresses resolved in this namespace and endpoint windows
/// placed from nothing (what `render` prints and `explain --manifests` walks), and those
/// addresses.
fn plan_here(config: &ProxyConfig, state: &ClusterState) -> (crate::plan::Plan, crate::nodeaddr::NodePortTargets) {
    let targets = crate::nodeaddr::resolve(&config.nodeport_addresses, state.node());
    let planned = plan(&PlanInput { config, state, nodeports_v4: &targets.v4, nodeports_v6: &targets.v6 });
    (planned, targets)
}

/// The ruleset for a state as nft text (`render`).
pub fn render(config: &ProxyConfig, state: &ClusterState) -> String {
    plan_here(config, state).0.ruleset.to_string()
}

/// Writes the ruleset for a state as nft text to `out` (what `render` prints).
fn write_rendered(config: &ProxyConfig, state: &ClusterState, out: &mut impl std::io::Write) -> std::io::Result<()> {
    let started = std::time::Instant::now();
    let (planned, _) = plan_here(config, state);
    tracing::debug!(ms = started.elapsed().as_millis() as u64, "planned");
    write!(out, "{}", planned.ruleset)?;
    out.flush()
}

/// Applies a state here as one full sync (`nftproxy sync`): the same streamed transaction as
/// `run` and restarts, without claiming the tables (the process exits at once).
pub fn sync_once(config: &ProxyConfig, state: &ClusterState) -> Result<sync::Synced, CliError> {
    let mut config = config.clone();
    config.table_ownership = false;
    let mut syncer = Syncer::new(config, Box::new(Kernel::open()?), sync::local_nodeports());
    let everything = Pending {
        services: state.services().map(|s| s.name.clone()).collect(),
        node_changed: true,
        service_cidrs_changed: true,
    };
    Ok(syncer.sync(state, &everything, SyncReason::Startup, true)?)
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
    report.takeover = Some(leftovers).filter(|l| !l.is_empty() || !l.kept.is_empty());
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
    fn sysctls(args: &[&str], file: &str) -> crate::conntrack::sysctls::ConntrackSysctls {
        let matches = Cli::command().try_get_matches_from(args).unwrap();
        let Command::ConntrackSysctls(parsed) = Cli::from_arg_matches(&matches).unwrap().command else {
            panic!("not conntrack-sysctls")
        };
        let sub = matches.subcommand_matches("conntrack-sysctls").unwrap();
        let explicit = |id: &str| sub.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        let (file, _) = config::file::parse(file).unwrap();
        parsed.conntrack.settings(&explicit, &file.conntrack)
    }

    #[test]
    fn conntrack_flags_override_the_file_which_overrides_the_defaults() {
        let defaults = sysctls(&["nftproxy", "conntrack-sysctls"], "{}");
        assert_eq!(defaults, crate::conntrack::sysctls::ConntrackSysctls::default());
        let file = "conntrack: {maxPerCore: 0, min: 5, udpTimeout: 45s, tcpBeLiberal: true}";
        let s = sysctls(
            &[
                "nftproxy",
                "conntrack-sysctls",
                "--conntrack-min=7",
                "--conntrack-tcp-be-liberal=false",
                "--conntrack-tcp-timeout-established",
                "24h0m0s",
                "--conntrack-udp-timeout-stream=0",
            ],
            file,
        );
        assert_eq!((s.max_per_core, s.min, s.tcp_be_liberal), (0, 7, false));
        assert_eq!(s.udp_timeout, std::time::Duration::from_secs(45));
        assert_eq!(s.tcp_established_timeout, std::time::Duration::from_secs(86400));
        assert_eq!(s.tcp_close_wait_timeout, std::time::Duration::from_secs(3600), "the default");
        let liberal = sysctls(&["nftproxy", "conntrack-sysctls", "--conntrack-tcp-be-liberal"], "{}");
        assert!(liberal.tcp_be_liberal);
        assert!(Cli::command().try_get_matches_from(["nftproxy", "run", "--conntrack-min=-1"]).is_err());
    }
}
