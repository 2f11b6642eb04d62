//! kube-proxy's `KubeProxyConfiguration` (`kubeproxy.config.k8s.io/v1alpha1`, Kubernetes
//! v1.37), read, defaulted and validated as upstream does it (`pkg/proxy/apis/config/v1alpha1/
//! defaults.go`, `.../validation/validation.go`, `cmd/kube-proxy/app/options.go`).
//!
//! Installers write every field, most of them `""`, `0`, `0s` or `null` (kubeadm serialises the
//! zero value of the whole type): each such field takes upstream's default here, so the file a
//! cluster already has means what it meant to kube-proxy. The same value, defaulted, is what
//! `/configz` serves.
//!
//! nftproxy always runs nftables mode. `mode` still chooses, as upstream's conversion does,
//! which section's sync periods and masquerade settings apply: `""` and `iptables` read
//! `iptables:`, `ipvs` reads `ipvs:` (and `iptables.masqueradeAll`), `nftables` reads
//! `nftables:`. So a kubeadm file (`mode: ""`) keeps the periods its operator set.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::duration::GoDuration;
use super::{ConfigError, DetectLocal, LoggingFormat, NodePortAddresses, parse_nodeport_addresses};

/// The API group and version nftproxy reads.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The kind.
pub const KIND: &str = "KubeProxyConfiguration";
/// The health server's default port (`ports.ProxyHealthzPort`).
pub const HEALTHZ_PORT: u16 = 10256;
/// The metrics server's default port (`ports.ProxyStatusPort`).
pub const METRICS_PORT: u16 = 10249;
/// kube-proxy's OOM score adjustment (`qos.KubeProxyOOMScoreAdj`).
pub const OOM_SCORE_ADJ: i32 = -999;

/// The proxy mode a configuration names. nftproxy runs nftables mode whatever it says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// `""`: upstream's "best available", iptables on Linux in v1.37.
    Unset,
    IpTables,
    Ipvs,
    NfTables,
}

impl ProxyMode {
    /// Reads a mode name; `None` for a name upstream rejects.
    pub fn parse(s: &str) -> Option<ProxyMode> {
        match s {
            "" => Some(ProxyMode::Unset),
            "iptables" => Some(ProxyMode::IpTables),
            "ipvs" => Some(ProxyMode::Ipvs),
            "nftables" => Some(ProxyMode::NfTables),
            _ => None,
        }
    }
}

/// `clientConnection`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub struct ClientConnection {
    pub kubeconfig: String,
    pub accept_content_types: String,
    pub content_type: String,
    pub qps: f64,
    pub burst: i64,
}

/// `logging` (component-base's LoggingConfiguration; only `format` and `verbosity` are used).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub struct Logging {
    pub format: String,
    /// A duration string or nanoseconds, as component-base accepts either.
    #[serde(skip_serializing_if = "Value::is_null")]
    pub flush_frequency: Value,
    pub verbosity: u32,
    #[serde(skip_serializing_if = "Value::is_null")]
    pub vmodule: Value,
    #[serde(skip_serializing_if = "Value::is_null")]
    pub options: Value,
}

/// `iptables`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub struct IpTablesSection {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: bool,
    pub localhost_node_ports: Option<bool>,
    pub sync_period: GoDuration,
    pub min_sync_period: GoDuration,
}

/// `ipvs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub struct IpvsSection {
    pub sync_period: GoDuration,
    pub min_sync_period: GoDuration,
    pub scheduler: String,
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    pub strict_arp: bool,
    pub tcp_timeout: GoDuration,
    pub tcp_fin_timeout: GoDuration,
    pub udp_timeout: GoDuration,
}

/// `nftables`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub struct NfTablesSection {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: bool,
    pub sync_period: GoDuration,
    pub min_sync_period: GoDuration,
}

/// `winkernel` (Windows only; carried so `/configz` shows it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub struct WinkernelSection {
    pub network_name: String,
    pub source_vip: String,
    #[serde(rename = "enableDSR")]
    pub enable_dsr: bool,
    pub root_hns_endpoint_name: String,
    pub forward_health_check_vip: bool,
}

/// `detectLocal`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub struct DetectLocalSection {
    pub bridge_interface: String,
    pub interface_name_prefix: String,
    /// Not in v1alpha1 (it has `clusterCIDR`), but in the internal type; accepted here too.
    #[serde(rename = "clusterCIDRs", skip_serializing_if = "Option::is_none")]
    pub cluster_cidrs: Option<Vec<String>>,
}

/// `conntrack`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub struct ConntrackSection {
    pub max_per_core: Option<i64>,
    pub min: Option<i64>,
    pub tcp_established_timeout: Option<GoDuration>,
    pub tcp_close_wait_timeout: Option<GoDuration>,
    pub tcp_be_liberal: bool,
    pub udp_timeout: GoDuration,
    pub udp_stream_timeout: GoDuration,
}

/// A `KubeProxyConfiguration`, field for field as v1alpha1 has it (and in its order, which is
/// `/configz`'s order).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct KubeProxyConfiguration {
    pub kind: String,
    pub api_version: String,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub feature_gates: BTreeMap<String, bool>,
    pub client_connection: ClientConnection,
    pub logging: Logging,
    pub hostname_override: String,
    pub bind_address: String,
    pub healthz_bind_address: String,
    pub metrics_bind_address: String,
    pub bind_address_hard_fail: bool,
    pub enable_profiling: bool,
    pub show_hidden_metrics_for_version: String,
    pub mode: String,
    pub iptables: IpTablesSection,
    pub ipvs: IpvsSection,
    pub nftables: NfTablesSection,
    pub winkernel: WinkernelSection,
    pub detect_local_mode: String,
    pub detect_local: DetectLocalSection,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: String,
    pub node_port_addresses: Option<Vec<String>>,
    pub oom_score_adj: Option<i32>,
    pub conntrack: ConntrackSection,
    pub config_sync_period: GoDuration,
    pub port_range: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub windows_run_as_service: bool,
}

impl Default for KubeProxyConfiguration {
    /// The zero value, as a file with no fields decodes to (not yet defaulted).
    fn default() -> Self {
        KubeProxyConfiguration {
            kind: String::new(),
            api_version: String::new(),
            feature_gates: BTreeMap::new(),
            client_connection: ClientConnection::default(),
            logging: Logging::default(),
            hostname_override: String::new(),
            bind_address: String::new(),
            healthz_bind_address: String::new(),
            metrics_bind_address: String::new(),
            bind_address_hard_fail: false,
            enable_profiling: false,
            show_hidden_metrics_for_version: String::new(),
            mode: String::new(),
            iptables: IpTablesSection::default(),
            ipvs: IpvsSection::default(),
            nftables: NfTablesSection::default(),
            winkernel: WinkernelSection::default(),
            detect_local_mode: String::new(),
            detect_local: DetectLocalSection::default(),
            cluster_cidr: String::new(),
            node_port_addresses: None,
            oom_score_adj: None,
            conntrack: ConntrackSection::default(),
            config_sync_period: GoDuration::ZERO,
            port_range: String::new(),
            windows_run_as_service: false,
        }
    }
}

/// Every v1alpha1 field by path (a path ending in `.*` takes any children).
const KNOWN: &[&str] = &[
    "apiVersion",
    "kind",
    "featureGates.*",
    "clientConnection.kubeconfig",
    "clientConnection.acceptContentTypes",
    "clientConnection.contentType",
    "clientConnection.qps",
    "clientConnection.burst",
    "logging.format",
    "logging.flushFrequency",
    "logging.verbosity",
    "logging.vmodule",
    "logging.options.*",
    "hostnameOverride",
    "bindAddress",
    "healthzBindAddress",
    "metricsBindAddress",
    "bindAddressHardFail",
    "enableProfiling",
    "showHiddenMetricsForVersion",
    "mode",
    "iptables.masqueradeBit",
    "iptables.masqueradeAll",
    "iptables.localhostNodePorts",
    "iptables.syncPeriod",
    "iptables.minSyncPeriod",
    "ipvs.syncPeriod",
    "ipvs.minSyncPeriod",
    "ipvs.scheduler",
    "ipvs.excludeCIDRs",
    "ipvs.strictARP",
    "ipvs.tcpTimeout",
    "ipvs.tcpFinTimeout",
    "ipvs.udpTimeout",
    "nftables.masqueradeBit",
    "nftables.masqueradeAll",
    "nftables.syncPeriod",
    "nftables.minSyncPeriod",
    "winkernel.networkName",
    "winkernel.sourceVip",
    "winkernel.enableDSR",
    "winkernel.rootHnsEndpointName",
    "winkernel.forwardHealthCheckVip",
    "detectLocalMode",
    "detectLocal.bridgeInterface",
    "detectLocal.interfaceNamePrefix",
    "detectLocal.clusterCIDRs",
    "clusterCIDR",
    "nodePortAddresses",
    "oomScoreAdj",
    "conntrack.maxPerCore",
    "conntrack.min",
    "conntrack.tcpEstablishedTimeout",
    "conntrack.tcpCloseWaitTimeout",
    "conntrack.tcpBeLiberal",
    "conntrack.udpTimeout",
    "conntrack.udpStreamTimeout",
    "configSyncPeriod",
    "portRange",
    "windowsRunAsService",
];

/// Fields nftproxy applies in every mode (the mode's own section is added by [`used`]).
const APPLIED: &[&str] = &[
    "apiVersion",
    "kind",
    "clientConnection.kubeconfig",
    "logging.format",
    "logging.verbosity",
    "hostnameOverride",
    "bindAddress",
    "healthzBindAddress",
    "metricsBindAddress",
    "bindAddressHardFail",
    "mode",
    "detectLocalMode",
    "detectLocal.bridgeInterface",
    "detectLocal.interfaceNamePrefix",
    "detectLocal.clusterCIDRs",
    "clusterCIDR",
    "nodePortAddresses",
    "oomScoreAdj",
    "conntrack.maxPerCore",
    "conntrack.min",
    "conntrack.tcpEstablishedTimeout",
    "conntrack.tcpCloseWaitTimeout",
    "conntrack.tcpBeLiberal",
    "conntrack.udpTimeout",
    "conntrack.udpStreamTimeout",
];

/// Whether nftproxy applies the field at `path` in `mode`.
fn used(path: &str, mode: ProxyMode) -> bool {
    if APPLIED.contains(&path) {
        return true;
    }
    let (periods, masquerade_all, masquerade_bit) = sections(mode);
    match path.split_once('.') {
        Some((section, "syncPeriod" | "minSyncPeriod")) => section == periods,
        Some((section, "masqueradeAll")) => section == masquerade_all,
        Some((section, "masqueradeBit")) => section == masquerade_bit,
        _ => false,
    }
}

/// The sections the sync periods, `masqueradeAll` and `masqueradeBit` come from in `mode`, as
/// upstream's conversion and proxiers take them.
fn sections(mode: ProxyMode) -> (&'static str, &'static str, &'static str) {
    match mode {
        ProxyMode::NfTables => ("nftables", "nftables", "nftables"),
        ProxyMode::Ipvs => ("ipvs", "iptables", "iptables"),
        ProxyMode::Unset | ProxyMode::IpTables => ("iptables", "iptables", "iptables"),
    }
}

fn known(path: &str) -> bool {
    KNOWN.iter().any(|k| match k.strip_suffix(".*") {
        Some(prefix) => path == prefix || path.starts_with(&format!("{prefix}.")),
        None => *k == path,
    })
}

/// A value that says nothing: what upstream's defaulting treats as unset, or a zero that
/// changes nothing (an installer writes these for every field).
fn is_unset(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || s == "0" || GoDuration::parse(s) == Some(GoDuration::ZERO),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_unset),
    }
}

/// Names the fields that are unknown, and those set but not used by nftproxy (one line each).
fn unused_fields(prefix: &str, v: &Value, mode: ProxyMode, warnings: &mut Vec<String>) {
    let Value::Object(map) = v else { return };
    for (k, child) in map {
        let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        if path == "featureGates" {
            // Checked as upstream checks them (`complete`): refused or named there.
            continue;
        } else if !known(&path) {
            // A section (`iptables:`, `conntrack:`) is known when any of its fields is.
            if child.is_object() && KNOWN.iter().any(|f| f.starts_with(&format!("{path}."))) {
                unused_fields(&path, child, mode, warnings);
            } else {
                warnings.push(format!("{path}: unknown field, ignored"));
            }
        } else if !used(&path, mode) && !is_unset(child) {
            warnings.push(format!("{path}: not used by nftproxy, ignored"));
        }
    }
}

/// Removes `null` members (recursively): Go's decoder leaves a field at its zero value for
/// `null`, as an absent field is left.
fn drop_nulls(v: &mut Value) {
    if let Value::Object(map) = v {
        map.retain(|_, child| !child.is_null());
        map.values_mut().for_each(drop_nulls);
    }
}

/// A path in upstream's error messages (the internal type's Go field names).
const ROOT: &str = "KubeProxyConfiguration";

/// One of upstream's validation errors, formatted as `field.Error` formats it.
fn invalid(path: &str, value: impl Into<Shown>, detail: &str) -> String {
    format!("{ROOT}.{path}: Invalid value: {}: {detail}", value.into().0)
}

/// A bad value as `field.Error` shows it: strings quoted, numbers bare, durations as JSON.
struct Shown(String);

impl From<&str> for Shown {
    fn from(s: &str) -> Shown {
        Shown(format!("{s:?}"))
    }
}
impl From<&String> for Shown {
    fn from(s: &String) -> Shown {
        Shown(format!("{s:?}"))
    }
}
impl From<i64> for Shown {
    fn from(n: i64) -> Shown {
        Shown(n.to_string())
    }
}
impl From<GoDuration> for Shown {
    fn from(d: GoDuration) -> Shown {
        Shown(format!("\"{d}\""))
    }
}

impl KubeProxyConfiguration {
    /// Upstream's defaults, as an empty file or no file gives them.
    pub fn defaults() -> KubeProxyConfiguration {
        let mut c = KubeProxyConfiguration::default();
        c.set_defaults();
        c
    }

    /// Reads a file's text (YAML or JSON) and defaults it. Returns the configuration and one
    /// warning per field that is unknown, or set but not used by nftproxy.
    pub fn parse(text: &str) -> Result<(KubeProxyConfiguration, Vec<String>), ConfigError> {
        let mut value: Value = serde_yaml_ng::from_str(text).map_err(|e| {
            ConfigError::File(format!("failed to decode: {}", e.to_string().lines().next().unwrap_or("")))
        })?;
        if !value.is_object() {
            return Err(ConfigError::File("failed to decode: not a KubeProxyConfiguration object".into()));
        }
        let mode = value.get("mode").and_then(Value::as_str).and_then(ProxyMode::parse).unwrap_or(ProxyMode::Unset);
        let mut warnings = Vec::new();
        unused_fields("", &value, mode, &mut warnings);
        drop_nulls(&mut value);
        let mut config: KubeProxyConfiguration = serde_path_to_error::deserialize(value)
            .map_err(|e| ConfigError::File(format!("failed to decode: {}: {}", e.path(), e.inner())))?;
        if !config.kind.is_empty() && config.kind != KIND {
            return Err(ConfigError::File(format!(
                "got unexpected config type: {}, Kind={}",
                config.api_version, config.kind
            )));
        }
        if !config.api_version.is_empty() && config.api_version != API_VERSION {
            return Err(ConfigError::File(format!(
                "failed to decode: no kind {:?} is registered for version {:?}",
                config.kind, config.api_version
            )));
        }
        if config.api_version.is_empty() || config.kind.is_empty() {
            warnings.push(format!("apiVersion/kind missing: expected {API_VERSION} {KIND}; reading it as one"));
        }
        config.set_defaults();
        Ok((config, warnings))
    }

    /// Upstream's `SetDefaults_KubeProxyConfiguration`: every zero field takes its default.
    pub fn set_defaults(&mut self) {
        self.kind = KIND.to_string();
        self.api_version = API_VERSION.to_string();
        if self.bind_address.is_empty() {
            self.bind_address = "0.0.0.0".to_string();
        }
        let v4 = self.bind_address.parse::<IpAddr>().map_or(true, |ip| ip.is_ipv4());
        let (healthz_host, metrics_host) = if v4 { ("0.0.0.0", "127.0.0.1") } else { ("[::]", "[::1]") };
        self.healthz_bind_address = if self.healthz_bind_address.is_empty() {
            format!("{healthz_host}:{HEALTHZ_PORT}")
        } else {
            append_port_if_needed(&self.healthz_bind_address, HEALTHZ_PORT)
        };
        self.metrics_bind_address = if self.metrics_bind_address.is_empty() {
            format!("{metrics_host}:{METRICS_PORT}")
        } else {
            append_port_if_needed(&self.metrics_bind_address, METRICS_PORT)
        };
        self.oom_score_adj.get_or_insert(OOM_SCORE_ADJ);
        for (sync, min) in [
            (&mut self.iptables.sync_period, &mut self.iptables.min_sync_period),
            (&mut self.nftables.sync_period, &mut self.nftables.min_sync_period),
        ] {
            if *sync == GoDuration::ZERO {
                *sync = GoDuration::from_secs(30);
            }
            if *min == GoDuration::ZERO {
                *min = GoDuration::from_secs(1);
            }
        }
        // Upstream defaults ipvs.syncPeriod only (its minSyncPeriod of 0 means "no minimum").
        if self.ipvs.sync_period == GoDuration::ZERO {
            self.ipvs.sync_period = GoDuration::from_secs(30);
        }
        self.iptables.localhost_node_ports.get_or_insert(true);
        self.iptables.masquerade_bit.get_or_insert(14);
        self.nftables.masquerade_bit.get_or_insert(14);
        self.conntrack.max_per_core.get_or_insert(32 * 1024);
        self.conntrack.min.get_or_insert(128 * 1024);
        self.conntrack.tcp_established_timeout.get_or_insert(GoDuration::from_secs(24 * 3600));
        self.conntrack.tcp_close_wait_timeout.get_or_insert(GoDuration::from_secs(3600));
        if self.config_sync_period == GoDuration::ZERO {
            self.config_sync_period = GoDuration::from_secs(15 * 60);
        }
        if self.client_connection.content_type.is_empty() {
            self.client_connection.content_type = "application/vnd.kubernetes.protobuf".to_string();
        }
        if self.client_connection.qps == 0.0 {
            self.client_connection.qps = 5.0;
        }
        if self.client_connection.burst == 0 {
            self.client_connection.burst = 10;
        }
        // component-base's recommended logging configuration.
        if self.logging.format.is_empty() {
            self.logging.format = "text".to_string();
        }
        if self.logging.flush_frequency.is_null()
            || self.logging.flush_frequency == 0
            || self.logging.flush_frequency.as_str().and_then(GoDuration::parse) == Some(GoDuration::ZERO)
        {
            self.logging.flush_frequency = Value::from("5s");
        }
    }

    /// The mode the file names (`None` for one upstream rejects; [`validate`] says so).
    ///
    /// [`validate`]: KubeProxyConfiguration::validate
    pub fn proxy_mode(&self) -> Option<ProxyMode> {
        ProxyMode::parse(&self.mode)
    }

    /// The sync period and minimum sync period that apply (see the module's doc).
    pub fn sync_periods(&self) -> (GoDuration, GoDuration) {
        match self.proxy_mode() {
            Some(ProxyMode::NfTables) => (self.nftables.sync_period, self.nftables.min_sync_period),
            Some(ProxyMode::Ipvs) => (self.ipvs.sync_period, self.ipvs.min_sync_period),
            _ => (self.iptables.sync_period, self.iptables.min_sync_period),
        }
    }

    /// `masqueradeAll` as it applies.
    pub fn masquerade_all(&self) -> bool {
        match self.proxy_mode() {
            Some(ProxyMode::NfTables) => self.nftables.masquerade_all,
            _ => self.iptables.masquerade_all,
        }
    }

    /// `masqueradeBit` as it applies.
    pub fn masquerade_bit(&self) -> i32 {
        match self.proxy_mode() {
            Some(ProxyMode::NfTables) => self.nftables.masquerade_bit,
            _ => self.iptables.masquerade_bit,
        }
        .unwrap_or(14)
    }

    /// The pod ranges (`clusterCIDR`, or the internal type's `detectLocal.clusterCIDRs`), as
    /// upstream splits them.
    pub fn cluster_cidrs(&self) -> Vec<String> {
        match &self.detect_local.cluster_cidrs {
            Some(c) if !c.is_empty() => c.clone(),
            _ if self.cluster_cidr.is_empty() => Vec::new(),
            _ => self.cluster_cidr.split(',').map(str::to_string).collect(),
        }
    }

    /// Upstream's validation, with its messages (`field.ErrorList.ToAggregate()`): `Err` holds
    /// `failed validate: ` and the errors, one or `[a, b]`.
    /// What upstream's `Complete` checks before validation: the feature gates, refused as
    /// upstream refuses them (unknown, or locked to the other value) and each one that would
    /// switch something named in a warning ([`super::feature_gates::review`]).
    pub fn complete(&self) -> Result<Vec<String>, ConfigError> {
        let warnings = super::feature_gates::review(&self.feature_gates)?;
        // component-base refuses its alpha logging options unless their gate is on.
        if self.feature_gates.get("LoggingAlphaOptions") != Some(&true) {
            for format in ["json", "text"] {
                let options = &self.logging.options[format];
                let buffer = match &options["infoBufferSize"] {
                    Value::Null => false,
                    Value::String(s) => !s.is_empty() && s != "0",
                    Value::Number(n) => n.as_f64() != Some(0.0),
                    _ => true,
                };
                for (field, set) in [("infoBufferSize", buffer), ("splitStream", options["splitStream"] == true)] {
                    if set {
                        return Err(ConfigError::Logging(format!(
                            "logging.options.{format}.{field}: Forbidden: Feature LoggingAlphaOptions is disabled"
                        )));
                    }
                }
            }
        }
        Ok(warnings)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut errs: Vec<String> = Vec::new();
        let bit_range = |errs: &mut Vec<String>, path: &str, bit: Option<i32>| {
            if let Some(b) = bit.filter(|b| !(0..=31).contains(b)) {
                errs.push(invalid(path, i64::from(b), "must be within the range [0, 31]"));
            }
        };
        bit_range(&mut errs, "KubeProxyIPTablesConfiguration.MasqueradeBit", self.iptables.masquerade_bit);
        match self.proxy_mode() {
            Some(ProxyMode::Ipvs) => {
                let ipvs = &self.ipvs;
                for (name, d) in [
                    ("TCPTimeout", ipvs.tcp_timeout),
                    ("TCPFinTimeout", ipvs.tcp_fin_timeout),
                    ("UDPTimeout", ipvs.udp_timeout),
                ] {
                    if d.0 < 0 {
                        errs.push(invalid(
                            &format!("KubeProxyIPVSConfiguration.{name}"),
                            d,
                            "must be greater than or equal to 0",
                        ));
                    }
                }
                for (i, cidr) in ipvs.exclude_cidrs.iter().flatten().enumerate() {
                    if cidr.parse::<ipnet::IpNet>().is_err() {
                        errs.push(invalid(
                            &format!("KubeProxyIPVSConfiguration.ExcludeCidrs[{i}]"),
                            cidr,
                            "must be a valid CIDR",
                        ));
                    }
                }
            }
            Some(ProxyMode::NfTables) => {
                bit_range(&mut errs, "KubeProxyNFTablesConfiguration.MasqueradeBit", self.nftables.masquerade_bit);
            }
            _ => {}
        }
        let ct = &self.conntrack;
        let linux = "KubeProxyLinuxConfiguration.KubeProxyConntrackConfiguration";
        for (name, v) in [("MaxPerCore", ct.max_per_core), ("Min", ct.min)] {
            if let Some(v) = v.filter(|v| *v < 0) {
                errs.push(invalid(&format!("{linux}.{name}"), v, "must be greater than or equal to 0"));
            }
        }
        for (name, d) in [
            ("TCPEstablishedTimeout", ct.tcp_established_timeout.unwrap_or_default()),
            ("TCPCloseWaitTimeout", ct.tcp_close_wait_timeout.unwrap_or_default()),
            ("UDPTimeout", ct.udp_timeout),
            ("UDPStreamTimeout", ct.udp_stream_timeout),
        ] {
            if d.0 < 0 {
                errs.push(invalid(&format!("{linux}.{name}"), d, "must be greater than or equal to 0"));
            }
        }
        if let Some(adj) = self.oom_score_adj.filter(|a| !(-1000..=1000).contains(a)) {
            errs.push(invalid(
                "KubeProxyLinuxConfiguration.OOMScoreAdj",
                i64::from(adj),
                "must be within the range [-1000, 1000]",
            ));
        }
        if self.proxy_mode().is_none() {
            errs.push(invalid(
                "Mode.ProxyMode",
                &self.mode,
                "must be iptables, ipvs, nftables or blank (blank means the best-available proxy [currently iptables])",
            ));
        }
        if self.client_connection.burst < 0 {
            errs.push(invalid(
                "ClientConnection.Burst",
                self.client_connection.burst,
                "must be greater than or equal to 0",
            ));
        }
        if self.config_sync_period.0 <= 0 {
            errs.push(invalid("ConfigSyncPeriod", self.config_sync_period, "must be greater than 0"));
        }
        let (sync, min) = self.sync_periods();
        if sync.0 <= 0 {
            errs.push(invalid("SyncPeriod", sync, "must be greater than 0"));
        }
        if min.0 < 0 {
            errs.push(invalid("MinSyncPeriod", min, "must be greater than or equal to 0"));
        }
        if min > sync {
            errs.push(invalid("SyncPeriod", min, &format!("must be greater than or equal to {ROOT}.MinSyncPeriod")));
        }
        if self.bind_address.parse::<IpAddr>().is_err() {
            errs.push(invalid(
                "BindAddress",
                &self.bind_address,
                "not a valid textual representation of an IP address",
            ));
        }
        if !self.healthz_bind_address.is_empty() {
            errs.extend(host_port_errors(&self.healthz_bind_address, "HealthzBindAddress"));
        }
        // Empty only from flags (`--metrics-port=0`, or nftproxy's `--metrics-bind-address=`):
        // the server is off. Upstream's validation would refuse it; disabling is kept.
        if !self.metrics_bind_address.is_empty() {
            errs.extend(host_port_errors(&self.metrics_bind_address, "MetricsBindAddress"));
        }
        let mut seen = Vec::new();
        for (i, a) in self.node_port_addresses.iter().flatten().enumerate() {
            match a.as_str() {
                "primary" | "localhost" | "all" => {
                    if seen.contains(&a) {
                        errs.push(format!("{ROOT}.NodePortAddresses[{i}]: Duplicate value: {a:?}"));
                    }
                    seen.push(a);
                }
                cidr if cidr.parse::<ipnet::IpNet>().is_err() => errs.push(invalid(
                    &format!("NodePortAddresses[{i}]"),
                    cidr,
                    "must be a valid CIDR or one of the keywords 'primary', 'localhost', 'all'",
                )),
                _ => {}
            }
        }
        const LOCAL_MODES: [&str; 5] = ["ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix", ""];
        if !LOCAL_MODES.contains(&self.detect_local_mode.as_str()) {
            errs.push(format!(
                "{ROOT}.DetectLocalMode: Unsupported value: {:?}: supported values: {}",
                self.detect_local_mode,
                LOCAL_MODES.iter().map(|m| format!("{m:?}")).collect::<Vec<_>>().join(", ")
            ));
        }
        let dl = "DetectLocalConfiguration";
        match self.detect_local_mode.as_str() {
            "BridgeInterface" if self.detect_local.bridge_interface.is_empty() => {
                errs.push(invalid(&format!("{dl}.InterfaceName"), "", "must not be empty"));
            }
            "InterfaceNamePrefix" if self.detect_local.interface_name_prefix.is_empty() => {
                errs.push(invalid(&format!("{dl}.InterfacePrefix"), "", "must not be empty"));
            }
            "ClusterCIDR" | "" => errs.extend(dual_stack_errors(&self.cluster_cidrs(), &format!("{dl}.ClusterCIDRs"))),
            _ => {}
        }
        if !["text", "json"].contains(&self.logging.format.as_str()) {
            errs.push(format!(
                "logging.format: Unsupported value: {:?}: supported values: \"json\", \"text\"",
                self.logging.format
            ));
        }
        errs.dedup();
        match errs.len() {
            0 => Ok(()),
            1 => Err(ConfigError::Invalid(errs.remove(0))),
            _ => Err(ConfigError::Invalid(format!("[{}]", errs.join(", ")))),
        }
    }

    /// Upstream's `platformApplyDefaults` for the mode nftproxy runs: nftables mode's
    /// `nodePortAddresses` default (`primary`) and `detectLocalMode` (`ClusterCIDR`).
    pub fn node_port_addresses(&self) -> Result<(NodePortAddresses, Vec<String>), ConfigError> {
        parse_nodeport_addresses("nodePortAddresses", self.node_port_addresses.as_deref().unwrap_or(&[]))
    }

    /// How pod traffic is recognised (`detectLocalMode` with `detectLocal`).
    pub fn detect_local(&self) -> Result<DetectLocal, ConfigError> {
        super::parse_detect_local(
            &self.detect_local_mode,
            Some(&self.detect_local.bridge_interface),
            Some(&self.detect_local.interface_name_prefix),
        )
    }

    /// `logging.format`.
    pub fn logging_format(&self) -> Result<LoggingFormat, ConfigError> {
        LoggingFormat::parse("logging.format", &self.logging.format)
    }

    /// The healthz server's address (`None`: disabled, only possible from flags).
    pub fn healthz_address(&self) -> Option<SocketAddr> {
        socket_addr(&self.healthz_bind_address)
    }

    /// The metrics server's address (`None`: disabled).
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        socket_addr(&self.metrics_bind_address)
    }

    /// The configuration as upstream's `/configz` serves it for nftables mode: the running
    /// mode, its periods and masquerade settings in `nftables:`, as upstream's conversion of
    /// its internal configuration writes them.
    pub fn configz(&self) -> String {
        let mut shown = self.clone();
        let (sync, min) = self.sync_periods();
        shown.nftables = NfTablesSection {
            masquerade_bit: Some(self.masquerade_bit()),
            masquerade_all: self.masquerade_all(),
            sync_period: sync,
            min_sync_period: min,
        };
        shown.iptables.sync_period = GoDuration::ZERO;
        shown.iptables.min_sync_period = GoDuration::ZERO;
        shown.iptables.masquerade_all = false;
        shown.ipvs.sync_period = GoDuration::ZERO;
        shown.ipvs.min_sync_period = GoDuration::ZERO;
        shown.mode = "nftables".to_string();
        if shown.detect_local_mode.is_empty() {
            shown.detect_local_mode = "ClusterCIDR".to_string();
        }
        if shown.node_port_addresses.as_ref().is_none_or(Vec::is_empty) {
            shown.node_port_addresses = Some(vec!["primary".to_string()]);
        }
        #[derive(Serialize)]
        struct Configz<'a> {
            #[serde(rename = "kubeproxy.config.k8s.io")]
            config: &'a KubeProxyConfiguration,
        }
        // Serialised from the struct (not a map) to keep upstream's field order.
        serde_json::to_string(&Configz { config: &shown }).unwrap_or_default()
    }
}

/// `proxyutil.AppendPortIfNeeded`: a bare IP gets `port`; anything else is left for validation.
pub fn append_port_if_needed(addr: &str, port: u16) -> String {
    if addr.parse::<SocketAddr>().is_ok() || split_host_port(addr).is_some() {
        return addr.to_string();
    }
    match addr.parse::<IpAddr>() {
        Ok(ip) => SocketAddr::new(ip, port).to_string(),
        Err(_) => addr.to_string(),
    }
}

/// Go's `net.SplitHostPort`, loosely: `host:port` or `[host]:port`.
fn split_host_port(s: &str) -> Option<(&str, &str)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, port) = rest.split_once("]:")?;
        return Some((host, port));
    }
    let (host, port) = s.rsplit_once(':')?;
    (!host.contains(':')).then_some((host, port))
}

fn socket_addr(s: &str) -> Option<SocketAddr> {
    let (host, port) = split_host_port(s)?;
    Some(SocketAddr::new(host.parse().ok()?, port.parse().ok()?))
}

/// Upstream's `validateHostPort`.
fn host_port_errors(input: &str, field: &str) -> Vec<String> {
    let Some((host, port)) = split_host_port(input) else {
        return vec![invalid(field, input, "must be IP:port")];
    };
    let mut errs = Vec::new();
    if host.parse::<IpAddr>().is_err() {
        errs.push(invalid(field, host, "must be a valid IP"));
    }
    if !port.parse::<i64>().is_ok_and(|p| (1..=65535).contains(&p)) {
        errs.push(invalid(field, port, "must be a valid port"));
    }
    errs
}

/// Upstream's `validateDualStackCIDRStrings`, for a non-empty list.
fn dual_stack_errors(cidrs: &[String], path: &str) -> Vec<String> {
    let pair = "must be a either a single CIDR or dual-stack pair of CIDRs (e.g. [10.100.0.0/16, fde4:8dba:82e1::/48]";
    let shown = || Shown(format!("[{}]", cidrs.iter().map(|c| format!("{c:?}")).collect::<Vec<_>>().join(",")));
    match cidrs.len() {
        0 => Vec::new(),
        n if n > 2 => vec![format!("{ROOT}.{path}: Invalid value: {}: {pair}", shown().0)],
        _ => {
            let parsed: Vec<Option<ipnet::IpNet>> = cidrs.iter().map(|c| c.parse().ok()).collect();
            let mut errs: Vec<String> = cidrs
                .iter()
                .zip(&parsed)
                .enumerate()
                .filter(|(_, (_, p))| p.is_none())
                .map(|(i, (c, _))| {
                    invalid(
                        &format!("{path}[{i}]"),
                        c,
                        "must be a valid CIDR block (e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)",
                    )
                })
                .collect();
            if let [Some(a), Some(b)] = parsed.as_slice()
                && a.addr().is_ipv4() == b.addr().is_ipv4()
            {
                errs.push(format!("{ROOT}.{path}: Invalid value: {}: {pair}", shown().0));
            }
            errs
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kubeadm's `config.conf` as v1.37's kubeadm writes it (the zero value of every field but
    /// the few it sets).
    const KUBEADM: &str = include_str!("../../../integration/fixtures/installers/kubeadm/config.conf");

    #[test]
    fn kubeadms_zero_values_take_upstreams_defaults() {
        let (c, warnings) = KubeProxyConfiguration::parse(KUBEADM).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(c.healthz_bind_address, "0.0.0.0:10256");
        assert_eq!(c.metrics_bind_address, "127.0.0.1:10249");
        assert_eq!(c.sync_periods(), (GoDuration::from_secs(30), GoDuration::from_secs(1)));
        assert_eq!(c.masquerade_bit(), 14);
        assert_eq!(c.conntrack.max_per_core, Some(32768));
        assert_eq!(c.conntrack.tcp_close_wait_timeout, Some(GoDuration::from_secs(3600)));
        assert_eq!(c.client_connection.kubeconfig, "/var/lib/kube-proxy/kubeconfig.conf");
        assert_eq!(c.oom_score_adj, Some(-999));
        assert_eq!(c.proxy_mode(), Some(ProxyMode::IpTables), "kubeadm v1.37 writes the mode");
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.healthz_address(), Some("0.0.0.0:10256".parse().unwrap()));
    }

    #[test]
    fn the_mode_chooses_the_section_as_upstreams_conversion_does() {
        let text = "mode: MODE\niptables: {syncPeriod: 10s, masqueradeAll: true, masqueradeBit: 3}\nipvs: {syncPeriod: 20s, minSyncPeriod: 2s}\nnftables: {syncPeriod: 40s, minSyncPeriod: 4s, masqueradeBit: 5}\n";
        let read = |mode: &str| KubeProxyConfiguration::parse(&text.replace("MODE", mode)).unwrap();
        let (c, warnings) = read("\"\"");
        assert_eq!(c.sync_periods(), (GoDuration::from_secs(10), GoDuration::from_secs(1)));
        assert!(c.masquerade_all() && c.masquerade_bit() == 3);
        assert!(warnings.iter().any(|w| w.starts_with("nftables.syncPeriod: not used")), "{warnings:?}");
        let (c, _) = read("ipvs");
        assert_eq!(c.sync_periods(), (GoDuration::from_secs(20), GoDuration::from_secs(2)));
        assert!(c.masquerade_all());
        let (c, warnings) = read("nftables");
        assert_eq!(c.sync_periods(), (GoDuration::from_secs(40), GoDuration::from_secs(4)));
        assert!(!c.masquerade_all() && c.masquerade_bit() == 5);
        assert!(warnings.iter().any(|w| w.starts_with("iptables.syncPeriod: not used")), "{warnings:?}");
    }

    #[test]
    fn bare_ips_get_upstreams_ports_and_v6_bind_addresses_v6_servers() {
        let (c, _) =
            KubeProxyConfiguration::parse("healthzBindAddress: 127.0.0.1\nmetricsBindAddress: \"::\"\n").unwrap();
        assert_eq!(c.healthz_bind_address, "127.0.0.1:10256");
        assert_eq!(c.metrics_bind_address, "[::]:10249");
        let (c, _) = KubeProxyConfiguration::parse("bindAddress: fd00::1\n").unwrap();
        assert_eq!((c.healthz_bind_address.as_str(), c.metrics_bind_address.as_str()), ("[::]:10256", "[::1]:10249"));
    }

    #[test]
    fn upstream_rejects_with_its_messages() {
        let cases = [
            (
                "nftables: {syncPeriod: -5s}\nmode: nftables\n",
                "KubeProxyConfiguration.SyncPeriod: Invalid value: \"-5s\": must be greater than 0",
            ),
            (
                "mode: nftables\nnftables: {syncPeriod: 1s, minSyncPeriod: 2s}\n",
                "KubeProxyConfiguration.SyncPeriod: Invalid value: \"2s\": must be greater than or equal to KubeProxyConfiguration.MinSyncPeriod",
            ),
            (
                "mode: nftables\nnftables: {masqueradeBit: 40}\n",
                "KubeProxyConfiguration.KubeProxyNFTablesConfiguration.MasqueradeBit: Invalid value: 40: must be within the range [0, 31]",
            ),
            (
                "mode: userspace\n",
                "KubeProxyConfiguration.Mode.ProxyMode: Invalid value: \"userspace\": must be iptables, ipvs, nftables or blank",
            ),
            (
                "healthzBindAddress: nowhere\n",
                "KubeProxyConfiguration.HealthzBindAddress: Invalid value: \"nowhere\": must be IP:port",
            ),
            (
                "metricsBindAddress: 1.2.3.4:0\n",
                "KubeProxyConfiguration.MetricsBindAddress: Invalid value: \"0\": must be a valid port",
            ),
            (
                "bindAddress: nope\n",
                "KubeProxyConfiguration.BindAddress: Invalid value: \"nope\": not a valid textual representation of an IP address",
            ),
            (
                "detectLocalMode: Magic\n",
                "KubeProxyConfiguration.DetectLocalMode: Unsupported value: \"Magic\": supported values: \"ClusterCIDR\"",
            ),
            (
                "detectLocalMode: BridgeInterface\n",
                "KubeProxyConfiguration.DetectLocalConfiguration.InterfaceName: Invalid value: \"\": must not be empty",
            ),
            (
                "clusterCIDR: 10.0.0.0/33\n",
                "KubeProxyConfiguration.DetectLocalConfiguration.ClusterCIDRs[0]: Invalid value: \"10.0.0.0/33\"",
            ),
            ("clusterCIDR: 10.0.0.0/8,10.1.0.0/16\n", "must be a either a single CIDR or dual-stack pair"),
            (
                "conntrack: {min: -1}\n",
                "KubeProxyConfiguration.KubeProxyLinuxConfiguration.KubeProxyConntrackConfiguration.Min: Invalid value: -1: must be greater than or equal to 0",
            ),
            (
                "nodePortAddresses: [primary, primary]\n",
                "KubeProxyConfiguration.NodePortAddresses[1]: Duplicate value: \"primary\"",
            ),
            (
                "nodePortAddresses: [10.0.0.0/33]\n",
                "KubeProxyConfiguration.NodePortAddresses[0]: Invalid value: \"10.0.0.0/33\"",
            ),
            (
                "oomScoreAdj: 5000\n",
                "KubeProxyConfiguration.KubeProxyLinuxConfiguration.OOMScoreAdj: Invalid value: 5000",
            ),
            (
                "configSyncPeriod: -1s\n",
                "KubeProxyConfiguration.ConfigSyncPeriod: Invalid value: \"-1s\": must be greater than 0",
            ),
        ];
        for (text, message) in cases {
            let (c, _) = KubeProxyConfiguration::parse(text).unwrap();
            let err = c.validate().expect_err(text).to_string();
            assert!(err.starts_with("failed validate: "), "{err}");
            assert!(err.contains(message), "{text:?}\n  got  {err}\n  want {message}");
        }
        let (c, _) = KubeProxyConfiguration::parse("bindAddress: x\nconntrack: {min: -1}\n").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.starts_with("failed validate: [") && err.ends_with(']'), "two errors are listed: {err}");
    }

    #[test]
    fn undecodable_files_are_refused() {
        for (text, needle) in [
            ("nftables: {syncPeriod: soon}\n", "nftables.syncPeriod"),
            ("nftables: [1, 2]\n", "nftables"),
            ("kind: Deployment\n", "Deployment"),
            ("apiVersion: v1\nkind: KubeProxyConfiguration\n", "no kind"),
            ("- 1\n", "failed to decode"),
        ] {
            let err = KubeProxyConfiguration::parse(text).expect_err(text).to_string();
            assert!(err.contains(needle), "{text:?} → {err}");
        }
    }

    #[test]
    fn unknown_and_unused_fields_are_named_once_each_and_zeros_are_quiet() {
        let text = "ipvs: {scheduler: rr, strictARP: false}\nwinkernel: {networkName: \"\"}\nwhatIsThis: 1\nfeatureGates: {Foo: true}\nconntrack: {nope: 1}\n";
        let (_, warnings) = KubeProxyConfiguration::parse(text).unwrap();
        assert_eq!(
            warnings,
            [
                "conntrack.nope: unknown field, ignored",
                "ipvs.scheduler: not used by nftproxy, ignored",
                "whatIsThis: unknown field, ignored",
                "apiVersion/kind missing: expected kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration; reading it as one",
            ]
        );
    }

    #[test]
    fn configz_shows_the_running_mode_and_its_values() {
        let (c, _) = KubeProxyConfiguration::parse(KUBEADM).unwrap();
        let text = c.configz();
        let z: Value = serde_json::from_str(&text).unwrap();
        let inner = &z["kubeproxy.config.k8s.io"];
        assert_eq!(inner["mode"], "nftables");
        assert_eq!(inner["nftables"]["syncPeriod"], "30s");
        assert_eq!(inner["nftables"]["masqueradeBit"], 14);
        assert_eq!(inner["iptables"]["syncPeriod"], "0s");
        assert_eq!(inner["conntrack"]["tcpEstablishedTimeout"], "24h0m0s");
        assert_eq!(inner["healthzBindAddress"], "0.0.0.0:10256");
        assert_eq!(inner["kind"], "KubeProxyConfiguration");
        assert_eq!(inner["nodePortAddresses"], serde_json::json!(["primary"]));
        assert!(
            text.starts_with(r#"{"kubeproxy.config.k8s.io":{"kind":"KubeProxyConfiguration","apiVersion":"#),
            "upstream's order: {text}"
        );
    }
}
