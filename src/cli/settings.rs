//! Flags and the config file to settings: the one place where `run`'s flags, kube-proxy's
//! extra flags and a `--config` file (kube-proxy's `KubeProxyConfiguration`) become the settings
//! a command runs with, with upstream's precedence and validation — [`RunArgs::settings`] for
//! `run`, [`ProxyArgs::config`] for the one-shot commands, the conntrack sysctls for
//! `conntrack-sysctls`, and the log format and verbosity `main` sets up before any of them.

use tracing::warn;

use super::args::{Cli, Command, ConntrackArgs, ConntrackSysctlsArgs, ProxyArgs, RunArgs};
use super::kube_proxy::verbosity_count;
use crate::config::duration::GoDuration;
use crate::config::kubeproxy::KubeProxyConfiguration;
use crate::config::{self, ConfigError, LoggingFormat, ProxyConfig};

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
        for (field, value) in &x.logging_options {
            let (format, option) = field.split_once('.').unwrap_or((field.as_str(), ""));
            let value = match value.as_str() {
                "true" => serde_json::Value::Bool(true),
                "false" => serde_json::Value::Bool(false),
                other => serde_json::Value::from(other),
            };
            if !kp.logging.options.is_object() {
                kp.logging.options = serde_json::json!({});
            }
            kp.logging.options[format][option] = value;
        }
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

    /// Flags that kube-proxy takes but the configured mode or detect-local mode never reads, as
    /// upstream ignores them: named, so that nothing is ignored in silence.
    fn flags_the_mode_ignores(&self, kp: &KubeProxyConfiguration) -> Vec<String> {
        let x = &self.kube_proxy;
        let mut out = Vec::new();
        let ipvs = kp.mode == "ipvs";
        let mode = if kp.mode.is_empty() { "\"\" (iptables)" } else { kp.mode.as_str() };
        let periods = [
            ("ipvs-sync-period", x.ipvs_periods.0.is_some() && !ipvs),
            ("ipvs-min-sync-period", x.ipvs_periods.1.is_some() && !ipvs),
            ("iptables-sync-period", x.iptables_periods.0.is_some() && ipvs),
            ("iptables-min-sync-period", x.iptables_periods.1.is_some() && ipvs),
        ];
        for (flag, ignored) in periods {
            if ignored {
                out.push(format!("--{flag}: not read in mode {mode}, as kube-proxy does not read it; ignored"));
            }
        }
        let detect = kp.detect_local_mode.as_str();
        let detect_flags = [
            ("pod-bridge-interface", self.proxy.pod_bridge_interface.is_some(), "BridgeInterface"),
            ("pod-interface-name-prefix", self.proxy.pod_interface_name_prefix.is_some(), "InterfaceNamePrefix"),
            ("cluster-cidr", !self.proxy.cluster_cidr.trim().is_empty(), "ClusterCIDR"),
        ];
        for (flag, given, needs) in detect_flags {
            let used = detect == needs || (needs == "ClusterCIDR" && detect.is_empty());
            if given && !used {
                out.push(format!(
                    "--{flag}: read only with --detect-local-mode {needs} (it is {detect}), as kube-proxy reads it; ignored"
                ));
            }
        }
        out
    }

    /// kube-proxy's configuration with upstream's precedence: with `--config`, the file (every
    /// kube-proxy flag but `--hostname-override` and the logging flags is then ignored, with a
    /// warning naming it); without, the flags. Validated as upstream validates it. Returns the
    /// configuration and warnings.
    pub fn kube_proxy_config(
        &self,
        matches: Option<&clap::ArgMatches>,
    ) -> Result<(KubeProxyConfiguration, Vec<String>), ConfigError> {
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
            None => {
                let kp = self.kube_proxy_config_from_flags();
                warnings.extend(self.flags_the_mode_ignores(&kp));
                kp
            }
        };
        // Upstream: a non-empty flag wins (all whitespace is refused); an empty one is as if
        // absent. Whatever the source, the name is trimmed and lowercased (GetHostname).
        if let Some(h) = self.proxy.hostname_override.as_deref().filter(|h| !h.is_empty()) {
            if h.trim().is_empty() {
                return Err(ConfigError::EmptyHostname);
            }
            kp.hostname_override = h.to_string();
        }
        kp.hostname_override = kp.hostname_override.trim().to_lowercase();
        warnings.extend(kp.complete()?);
        kp.validate()?;
        Ok((kp, warnings))
    }

    /// Settings from kube-proxy's configuration (see [`RunArgs::kube_proxy_config`]) and
    /// nftproxy's own flags; warnings name what was not applied.
    pub fn settings(
        &self,
        matches: Option<&clap::ArgMatches>,
    ) -> Result<(crate::agent::RunSettings, Vec<String>), ConfigError> {
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
            Err(e) => return Err(e),
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
            debug: debug_address(&self.debug_bind_address, kp.metrics_address())?,
            service_counters: self.service_counters,
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

/// Where `/debug/services` is served: `--debug-bind-address`, or by default the metrics address
/// when it is a loopback address (an address Prometheus scrapes is not a place for it).
fn debug_address(
    flag: &str,
    metrics: Option<std::net::SocketAddr>,
) -> Result<Option<std::net::SocketAddr>, ConfigError> {
    match flag.trim() {
        "" => Ok(metrics.filter(|m| m.ip().is_loopback())),
        given => given.parse().map(Some).map_err(|_| ConfigError::Value {
            field: "--debug-bind-address",
            value: given.to_string(),
            expected: "IP:PORT",
        }),
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
fn read_config(path: &std::path::Path) -> Result<(KubeProxyConfiguration, Vec<String>), ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File(format!("{}: {e}", path.display())))?;
    // A decoding error names the file as well as the field.
    KubeProxyConfiguration::parse(&text).map_err(|e| match e {
        ConfigError::File(why) => ConfigError::File(format!("{}: {why}", path.display())),
        other => other,
    })
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
pub(super) fn conntrack_settings(
    args: &ConntrackSysctlsArgs,
    matches: Option<&clap::ArgMatches>,
) -> Result<crate::conntrack::sysctls::ConntrackSysctls, ConfigError> {
    let Some(path) = &args.config else { return Ok(args.conntrack.sysctls()) };
    let (kp, _unused_fields) = read_config(path)?;
    kp.complete()?;
    kp.validate()?;
    let explicit = explicit_in(matches);
    for (id, flag) in FILE_WINS.iter().filter(|(id, _)| id.starts_with("conntrack_")) {
        if explicit(id) {
            warn!("--{flag} is ignored: --config is given, and kube-proxy then takes it from the file");
        }
    }
    Ok(conntrack_sysctls_of(&kp))
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

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches, Parser};

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
    fn run_settings(
        args: &[&str],
        file: Option<&str>,
    ) -> Result<(crate::agent::RunSettings, Vec<String>), ConfigError> {
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
