//! `--config`: a kube-proxy `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1).
//!
//! The fields that apply to nftables mode are honoured; fields nftproxy does not use produce a
//! warning naming them (so a migrated config is not silently half-applied), unknown fields a
//! warning too, and invalid values an error that stops start-up.

use std::net::SocketAddr;
use std::time::Duration;

use ipnet::IpNet;
use serde::Deserialize;
use serde_json::Value;

use super::{ConfigError, DetectLocal, LoggingFormat, NodePortAddresses, parse_detect_local, parse_nodeport_addresses};

/// The settings a config file gave (each `None` when absent).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileSettings {
    pub hostname_override: Option<String>,
    pub cluster_cidrs: Option<Vec<IpNet>>,
    pub bind_address: Option<std::net::IpAddr>,
    pub healthz_bind_address: Option<Option<SocketAddr>>,
    pub metrics_bind_address: Option<Option<SocketAddr>>,
    pub nodeport_addresses: Option<NodePortAddresses>,
    pub detect_local: Option<DetectLocal>,
    pub masquerade_bit: Option<u32>,
    pub masquerade_all: Option<bool>,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    pub kubeconfig: Option<String>,
    pub conntrack: ConntrackSettings,
    pub bind_address_hard_fail: Option<bool>,
    pub logging_format: Option<LoggingFormat>,
}

/// `conntrack:`: kernel conntrack settings kube-proxy applies at start-up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConntrackSettings {
    pub max_per_core: Option<u32>,
    pub min: Option<u32>,
    pub tcp_established_timeout: Option<Duration>,
    pub tcp_close_wait_timeout: Option<Duration>,
    pub udp_timeout: Option<Duration>,
    pub udp_stream_timeout: Option<Duration>,
    pub tcp_be_liberal: Option<bool>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Raw {
    api_version: Option<String>,
    kind: Option<String>,
    mode: Option<String>,
    hostname_override: Option<String>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    bind_address: Option<String>,
    healthz_bind_address: Option<String>,
    metrics_bind_address: Option<String>,
    node_port_addresses: Option<Vec<String>>,
    detect_local_mode: Option<String>,
    detect_local: Option<RawDetectLocal>,
    nftables: Option<RawNftables>,
    conntrack: Option<RawConntrack>,
    client_connection: Option<RawClientConnection>,
    bind_address_hard_fail: Option<bool>,
    logging: Option<RawLogging>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RawLogging {
    format: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RawDetectLocal {
    bridge_interface: Option<String>,
    interface_name_prefix: Option<String>,
    #[serde(rename = "clusterCIDRs")]
    cluster_cidrs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RawNftables {
    masquerade_bit: Option<i64>,
    masquerade_all: Option<bool>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RawConntrack {
    max_per_core: Option<i64>,
    min: Option<i64>,
    tcp_established_timeout: Option<String>,
    tcp_close_wait_timeout: Option<String>,
    udp_timeout: Option<String>,
    udp_stream_timeout: Option<String>,
    tcp_be_liberal: Option<bool>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RawClientConnection {
    kubeconfig: Option<String>,
}

/// Fields nftproxy honours, by path.
const HONOURED: &[&str] = &[
    "apiVersion",
    "kind",
    "mode",
    "hostnameOverride",
    "clusterCIDR",
    "bindAddress",
    "healthzBindAddress",
    "metricsBindAddress",
    "nodePortAddresses",
    "detectLocalMode",
    "detectLocal",
    "detectLocal.bridgeInterface",
    "detectLocal.interfaceNamePrefix",
    "detectLocal.clusterCIDRs",
    "nftables",
    "nftables.masqueradeBit",
    "nftables.masqueradeAll",
    "nftables.syncPeriod",
    "nftables.minSyncPeriod",
    "conntrack",
    "conntrack.maxPerCore",
    "conntrack.min",
    "conntrack.tcpEstablishedTimeout",
    "conntrack.tcpCloseWaitTimeout",
    "conntrack.udpTimeout",
    "conntrack.udpStreamTimeout",
    "conntrack.tcpBeLiberal",
    "clientConnection",
    "clientConnection.kubeconfig",
    "bindAddressHardFail",
    "logging",
    "logging.format",
];

/// kube-proxy fields that exist but do not apply to nftproxy (ignored with a warning).
const IGNORED: &[&str] = &[
    "featureGates",
    "iptables",
    "ipvs",
    "winkernel",
    "oomScoreAdj",
    "portRange",
    "configSyncPeriod",
    "showHiddenMetricsForVersion",
    "logging.flushFrequency",
    "logging.verbosity",
    "logging.vmodule",
    "logging.options",
    "enableProfiling",
    "windowsRunAsService",
    "clientConnection.acceptContentTypes",
    "clientConnection.contentType",
    "clientConnection.qps",
    "clientConnection.burst",
    "nftables.localhostNodePorts",
    "nodeIPOverride",
];

fn walk(prefix: &str, v: &Value, warnings: &mut Vec<String>) {
    let Value::Object(map) = v else { return };
    for (k, child) in map {
        let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        if IGNORED.contains(&path.as_str()) {
            warnings.push(format!("{path}: not used by nftproxy, ignored"));
        } else if !HONOURED.contains(&path.as_str()) {
            warnings.push(format!("{path}: unknown field, ignored"));
        } else {
            walk(&path, child, warnings);
        }
    }
}

fn duration(field: &'static str, s: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(s.trim()).map_err(|_| ConfigError::Value {
        field,
        value: s.to_string(),
        expected: "a duration such as 30s or 1m0s",
    })
}

fn address(field: &'static str, s: &str) -> Result<Option<SocketAddr>, ConfigError> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    // kube-proxy also accepts a bare IP for these (port defaulted); keep it strict: IP:PORT.
    s.parse().map(Some).map_err(|_| ConfigError::Value { field, value: s.to_string(), expected: "IP:PORT" })
}

fn positive(field: &'static str, v: i64) -> Result<u32, ConfigError> {
    u32::try_from(v).map_err(|_| ConfigError::Value { field, value: v.to_string(), expected: "a non-negative number" })
}

/// Parses a config file's text. Returns the settings and warnings about fields not applied.
pub fn parse(text: &str) -> Result<(FileSettings, Vec<String>), ConfigError> {
    let value: Value = serde_yaml_ng::from_str(text)
        .map_err(|e| ConfigError::File(e.to_string().lines().next().unwrap_or("").to_string()))?;
    let mut warnings = Vec::new();
    walk("", &value, &mut warnings);
    let raw: Raw = serde_path_to_error::deserialize(value)
        .map_err(|e| ConfigError::File(format!("{}: {}", e.path(), e.inner())))?;

    if let Some(kind) = raw.kind.as_deref()
        && kind != "KubeProxyConfiguration"
    {
        return Err(ConfigError::Value { field: "kind", value: kind.into(), expected: "KubeProxyConfiguration" });
    }
    if let Some(api) = raw.api_version.as_deref()
        && api != "kubeproxy.config.k8s.io/v1alpha1"
    {
        warnings.push(format!("apiVersion {api:?}: expected kubeproxy.config.k8s.io/v1alpha1; reading it anyway"));
    }
    match raw.mode.as_deref().map(str::trim) {
        None | Some("") | Some("nftables") => {}
        Some(other) => {
            return Err(ConfigError::Value { field: "mode", value: other.into(), expected: "nftables (or empty)" });
        }
    }

    let mut s = FileSettings {
        hostname_override: raw.hostname_override.filter(|h| !h.trim().is_empty()).map(|h| h.trim().to_lowercase()),
        ..FileSettings::default()
    };
    if let Some(c) = raw.cluster_cidr.as_deref().filter(|c| !c.trim().is_empty()) {
        s.cluster_cidrs = Some(super::parse_cidrs("clusterCIDR", c)?);
    }
    if let Some(b) = raw.bind_address.as_deref().filter(|b| !b.trim().is_empty()) {
        s.bind_address = Some(b.trim().parse().map_err(|_| ConfigError::Value {
            field: "bindAddress",
            value: b.into(),
            expected: "an IP address",
        })?);
    }
    if let Some(h) = raw.healthz_bind_address.as_deref() {
        s.healthz_bind_address = Some(address("healthzBindAddress", h)?);
    }
    if let Some(m) = raw.metrics_bind_address.as_deref() {
        s.metrics_bind_address = Some(address("metricsBindAddress", m)?);
    }
    if let Some(np) = raw.node_port_addresses {
        let (np, found) = parse_nodeport_addresses("nodePortAddresses", &np)?;
        warnings.extend(found);
        s.nodeport_addresses = Some(np);
    }
    s.bind_address_hard_fail = raw.bind_address_hard_fail;
    if let Some(format) = raw.logging.and_then(|l| l.format) {
        s.logging_format = Some(LoggingFormat::parse("logging.format", &format)?);
    }
    let detect = raw.detect_local.unwrap_or_default();
    if let Some(cidrs) = &detect.cluster_cidrs
        && !cidrs.is_empty()
    {
        s.cluster_cidrs = Some(super::parse_cidrs("detectLocal.clusterCIDRs", &cidrs.join(","))?);
    }
    if let Some(mode) = raw.detect_local_mode.as_deref() {
        s.detect_local = Some(parse_detect_local(
            mode.trim(),
            detect.bridge_interface.as_deref(),
            detect.interface_name_prefix.as_deref(),
        )?);
    }
    if let Some(n) = raw.nftables {
        if let Some(bit) = n.masquerade_bit {
            let bit = u32::try_from(bit)
                .ok()
                .filter(|b| *b <= 31)
                .ok_or(ConfigError::MasqueradeBit(bit.clamp(0, i64::from(u32::MAX)) as u32))?;
            s.masquerade_bit = Some(bit);
        }
        s.masquerade_all = n.masquerade_all;
        if let Some(d) = n.sync_period.as_deref() {
            s.sync_period = Some(duration("nftables.syncPeriod", d)?);
        }
        if let Some(d) = n.min_sync_period.as_deref() {
            s.min_sync_period = Some(duration("nftables.minSyncPeriod", d)?);
        }
    }
    if let Some(c) = raw.conntrack {
        s.conntrack = ConntrackSettings {
            max_per_core: c.max_per_core.map(|v| positive("conntrack.maxPerCore", v)).transpose()?,
            min: c.min.map(|v| positive("conntrack.min", v)).transpose()?,
            tcp_established_timeout: c
                .tcp_established_timeout
                .as_deref()
                .map(|d| duration("conntrack.tcpEstablishedTimeout", d))
                .transpose()?,
            tcp_close_wait_timeout: c
                .tcp_close_wait_timeout
                .as_deref()
                .map(|d| duration("conntrack.tcpCloseWaitTimeout", d))
                .transpose()?,
            udp_timeout: c.udp_timeout.as_deref().map(|d| duration("conntrack.udpTimeout", d)).transpose()?,
            udp_stream_timeout: c
                .udp_stream_timeout
                .as_deref()
                .map(|d| duration("conntrack.udpStreamTimeout", d))
                .transpose()?,
            tcp_be_liberal: c.tcp_be_liberal,
        };
    }
    s.kubeconfig = raw.client_connection.and_then(|c| c.kubeconfig).filter(|k| !k.trim().is_empty());
    Ok((s, warnings))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clusterCIDR: 10.244.0.0/16,fd00:10::/48
hostnameOverride: Node1
bindAddress: 0.0.0.0
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: [192.168.0.0/24]
detectLocalMode: BridgeInterface
detectLocal: {bridgeInterface: cbr0}
nftables: {masqueradeBit: 15, masqueradeAll: true, syncPeriod: 1m0s, minSyncPeriod: 2s}
conntrack: {maxPerCore: 32768, min: 131072, tcpEstablishedTimeout: 24h0m0s, udpTimeout: 30s}
clientConnection: {kubeconfig: /var/lib/kube-proxy/kubeconfig.conf, qps: 5}
featureGates: {Foo: true}
whatIsThis: 1
"#;

    #[test]
    fn a_full_config_is_read_and_the_rest_named() {
        let (s, warnings) = parse(FULL).unwrap();
        assert_eq!(s.hostname_override.as_deref(), Some("node1"));
        assert_eq!(s.cluster_cidrs.as_ref().map(Vec::len), Some(2));
        assert_eq!(s.masquerade_bit, Some(15));
        assert_eq!(s.masquerade_all, Some(true));
        assert_eq!(s.sync_period, Some(Duration::from_secs(60)));
        assert_eq!(s.min_sync_period, Some(Duration::from_secs(2)));
        assert_eq!(s.detect_local, Some(DetectLocal::BridgeInterface("cbr0".into())));
        assert_eq!(s.healthz_bind_address, Some(Some("0.0.0.0:10256".parse().unwrap())));
        assert_eq!(s.conntrack.tcp_established_timeout, Some(Duration::from_secs(86400)));
        assert_eq!(s.kubeconfig.as_deref(), Some("/var/lib/kube-proxy/kubeconfig.conf"));
        assert!(s.nodeport_addresses.as_ref().is_some_and(|n| n.cidrs.len() == 1 && !n.primary));
        assert_eq!(
            warnings,
            vec![
                "clientConnection.qps: not used by nftproxy, ignored".to_string(),
                "featureGates: not used by nftproxy, ignored".to_string(),
                "whatIsThis: unknown field, ignored".to_string(),
            ]
        );
    }

    #[test]
    fn invalid_values_stop_start_up() {
        let bad = [
            ("mode: iptables\n", "mode"),
            ("clusterCIDR: 10.0.0.0/33\n", "clusterCIDR"),
            ("nftables: {masqueradeBit: 40}\n", "masquerade"),
            ("nftables: {syncPeriod: soon}\n", "nftables.syncPeriod"),
            ("healthzBindAddress: nowhere\n", "healthzBindAddress"),
            ("detectLocalMode: Magic\n", "Magic"),
            ("kind: Deployment\n", "kind"),
            ("conntrack: {min: -1}\n", "conntrack.min"),
            ("nftables: [1, 2]\n", "nftables"),
        ];
        for (text, needle) in bad {
            let err = parse(text).expect_err(text).to_string();
            assert!(err.contains(needle), "{text:?} → {err}");
        }
    }

    #[test]
    fn an_empty_config_sets_nothing() {
        let (s, warnings) =
            parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n").unwrap();
        assert_eq!(s, FileSettings::default());
        assert!(warnings.is_empty());
    }
}
