//! Validated settings shared by every command.

pub mod duration;
pub mod feature_gates;
pub mod kubeproxy;

use std::net::IpAddr;

use ipnet::IpNet;
use thiserror::Error;

use crate::net::IpFamily;

/// Invalid settings: start-up stops with this message.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("--masquerade-bit must be in 0..=31, got {0}")]
    MasqueradeBit(u32),
    #[error("invalid CIDR {value:?} in {field}")]
    Cidr { field: &'static str, value: String },
    #[error("--cluster-cidr has more than one {0} range; give one range per family")]
    TooManyClusterCidrs(IpFamily),
    #[error("--hostname-override must not be empty")]
    EmptyHostname,
    #[error("invalid --detect-local-mode {0:?} (ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix)")]
    DetectLocalMode(String),
    #[error("--detect-local-mode {0} needs {1}")]
    DetectLocalMissing(&'static str, &'static str),
    #[error("invalid {field} entry {value:?}: must be a valid CIDR (or a keyword: primary, all, localhost)")]
    NodePortAddress { field: &'static str, value: String },
    #[error("invalid {field} {value:?}: expected {expected}")]
    Value { field: &'static str, value: String, expected: &'static str },
    #[error("cannot read the config file: {0}")]
    File(String),
    /// Upstream's validation errors, in its words.
    #[error("failed validate: {0}")]
    Invalid(String),
    /// What upstream refuses before validating (an unknown or locked feature gate), in its words.
    #[error("failed complete: {0}")]
    Complete(String),
    /// What upstream's logging set-up refuses (an alpha option without its gate), in its words.
    #[error("initialize logging: {0}")]
    Logging(String),
}

/// How pod traffic is told apart from other traffic (kube-proxy's `detectLocalMode`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DetectLocal {
    /// Sources inside `--cluster-cidr` are pods.
    ClusterCidr,
    /// Sources inside this node's `spec.podCIDRs` are pods.
    NodeCidr,
    /// Traffic arriving on this bridge is from pods.
    BridgeInterface(String),
    /// Traffic arriving on interfaces with this name prefix is from pods.
    InterfaceNamePrefix(String),
}

/// `--logging-format` / `logging.format`: kube-proxy's permitted formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoggingFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl LoggingFormat {
    /// Parses a format name; anything else is refused, as upstream refuses it.
    pub fn parse(field: &'static str, value: &str) -> Result<LoggingFormat, ConfigError> {
        match value.trim() {
            "" | "text" => Ok(LoggingFormat::Text),
            "json" => Ok(LoggingFormat::Json),
            other => Err(ConfigError::Value {
                field,
                value: other.to_string(),
                expected: "one of the permitted formats: text, json",
            }),
        }
    }
}

/// Which addresses accept NodePort traffic (`--nodeport-addresses`): CIDRs and upstream's
/// keywords, in any combination. Each family is resolved on its own: a family nothing here
/// names (no CIDR of it, no keyword) accepts NodePorts on every local address of that family,
/// as upstream's per-family proxiers do.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodePortAddresses {
    /// Ranges given (host bits cleared); a `/0` range means every address of its family.
    pub cidrs: Vec<IpNet>,
    /// `primary`: the node's primary IP of each family (its Node's first InternalIP of the
    /// family, or `--bind-address` for its family).
    pub primary: bool,
    /// `all`: every local address of both families.
    pub all: bool,
    /// `localhost` was given. As upstream, it stands for the ranges `127.0.0.0/8` and
    /// `::1/128` (added to [`cidrs`](Self::cidrs)): NodePorts are never served on loopback (as
    /// in upstream's nftables mode without its alpha gate `KubeProxyNFTablesLocalhostNodePorts`),
    /// but a family so limited does not match all its addresses, and health-check node ports
    /// listen on the loopback addresses.
    pub localhost: bool,
}

impl NodePortAddresses {
    /// kube-proxy's default in nftables mode: `primary`.
    pub fn primary() -> NodePortAddresses {
        NodePortAddresses { primary: true, ..NodePortAddresses::default() }
    }

    /// Ranges, nothing else.
    pub fn cidrs(cidrs: Vec<IpNet>) -> NodePortAddresses {
        NodePortAddresses { cidrs, ..NodePortAddresses::default() }
    }
}

/// Settings for planning and applying rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyConfig {
    /// This node's name, matched against EndpointSlice `nodeName`.
    pub hostname: String,
    /// Pod ranges, at most one per family.
    pub cluster_cidrs: Vec<IpNet>,
    pub masquerade_all: bool,
    /// The bit of the packet mark that asks for masquerade (14 → 0x4000).
    pub masquerade_bit: u32,
    pub detect_local: DetectLocal,
    pub nodeport_addresses: NodePortAddresses,
    /// `--bind-address` / `bindAddress` when not `0.0.0.0` or `::`: overrides the node's primary
    /// IP of its family (`primary` node-port addresses, the LoadBalancerSourceRanges node check),
    /// as upstream does; nothing binds to it.
    pub bind_address: Option<IpAddr>,
    /// The nftables table name in both families.
    pub table: String,
    /// Delete stale UDP/SCTP conntrack entries after each sync.
    pub conntrack_cleanup: bool,
    /// Claim nftproxy's tables (`flags owner, persist`, Linux ≥ 6.9) so that no other process
    /// can change them while nftproxy runs; they outlive the process and are claimed again by
    /// the next one. Off for operators who need to edit the tables by hand.
    pub table_ownership: bool,
}

impl ProxyConfig {
    /// The table name nftproxy uses unless told otherwise.
    pub const DEFAULT_TABLE: &'static str = "nftproxy";

    /// Defaults for a node called `hostname`.
    pub fn new(hostname: impl Into<String>) -> ProxyConfig {
        ProxyConfig {
            hostname: hostname.into(),
            cluster_cidrs: Vec::new(),
            masquerade_all: false,
            masquerade_bit: 14,
            detect_local: DetectLocal::ClusterCidr,
            nodeport_addresses: NodePortAddresses::primary(),
            bind_address: None,
            table: Self::DEFAULT_TABLE.to_string(),
            conntrack_cleanup: true,
            table_ownership: true,
        }
    }

    /// The mark value for masquerade.
    pub fn masquerade_mark(&self) -> u32 {
        1u32 << self.masquerade_bit
    }

    /// The cluster CIDR of a family, if configured.
    pub fn cluster_cidr(&self, family: IpFamily) -> Option<IpNet> {
        self.cluster_cidrs.iter().copied().find(|c| IpFamily::of_net(c) == family)
    }

    /// Checks cross-field constraints.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.masquerade_bit > 31 {
            return Err(ConfigError::MasqueradeBit(self.masquerade_bit));
        }
        if self.hostname.trim().is_empty() {
            return Err(ConfigError::EmptyHostname);
        }
        for fam in IpFamily::ALL {
            if self.cluster_cidrs.iter().filter(|c| IpFamily::of_net(c) == fam).count() > 1 {
                return Err(ConfigError::TooManyClusterCidrs(fam));
            }
        }
        match &self.detect_local {
            DetectLocal::BridgeInterface(s) if s.is_empty() => {
                Err(ConfigError::DetectLocalMissing("BridgeInterface", "--pod-bridge-interface"))
            }
            DetectLocal::InterfaceNamePrefix(s) if s.is_empty() => {
                Err(ConfigError::DetectLocalMissing("InterfaceNamePrefix", "--pod-interface-name-prefix"))
            }
            _ => Ok(()),
        }
    }
}

/// Parses a comma-separated CIDR list (`10.244.0.0/16,fd00:10::/48`), normalizing host bits.
pub fn parse_cidrs(field: &'static str, s: &str) -> Result<Vec<IpNet>, ConfigError> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<IpNet>()
                .or_else(|_| p.parse::<IpAddr>().map(IpNet::from))
                .map(|n| n.trunc())
                .map_err(|_| ConfigError::Cidr { field, value: p.to_string() })
        })
        .collect()
}

/// `--bind-address`: `None` for the unspecified addresses (upstream's "not set").
pub fn specified(ip: IpAddr) -> Option<IpAddr> {
    (!ip.is_unspecified()).then_some(ip)
}

/// Parses `--bind-address` / `bindAddress`: an IP address (`0.0.0.0` and `::` mean unset).
pub fn parse_bind_address(field: &'static str, value: &str) -> Result<Option<IpAddr>, ConfigError> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(None);
    }
    value.parse().map(specified).map_err(|_| ConfigError::Value {
        field,
        value: value.to_string(),
        expected: "an IP address",
    })
}

/// Parses `--nodeport-addresses` (`field` names the flag or config field in messages): CIDRs
/// and the keywords `primary`, `all` and `localhost`, in any combination, as upstream accepts
/// them. An entry that is not a CIDR but looks like a keyword (letters only) and is not one
/// upstream knows is skipped alone, with a warning naming it; an invalid CIDR stops start-up,
/// as upstream's validation does. Returns the setting and the warnings. An empty list (or one
/// left empty by skipped entries) is nftables mode's default, `primary`.
pub fn parse_nodeport_addresses(
    field: &'static str,
    values: &[String],
) -> Result<(NodePortAddresses, Vec<String>), ConfigError> {
    let items: Vec<&str> = values.iter().flat_map(|v| v.split(',')).map(str::trim).filter(|s| !s.is_empty()).collect();
    let mut out = NodePortAddresses::default();
    let mut warnings = Vec::new();
    let mut used = 0;
    for item in items {
        match item {
            "primary" => out.primary = true,
            "all" => out.all = true,
            "localhost" => {
                // Upstream expands the keyword to these ranges before its proxiers see it.
                out.localhost = true;
                let loopback = [
                    IpNet::new(IpAddr::from([127, 0, 0, 0]), 8),
                    IpNet::new(IpAddr::from(std::net::Ipv6Addr::LOCALHOST), 128),
                ];
                out.cidrs.extend(loopback.into_iter().flatten());
                warnings.push(format!(
                    "{field}: {item:?}: NodePorts are not served on loopback addresses (as in upstream's nftables mode without the alpha gate KubeProxyNFTablesLocalhostNodePorts)"
                ));
            }
            word if word.chars().all(|c| c.is_ascii_alphabetic() || c == '-' || c == '_') => {
                warnings.push(format!(
                    "{field}: unknown keyword {word:?} skipped (known: primary, all, localhost, or a CIDR)"
                ));
                continue;
            }
            cidr => {
                let net = cidr
                    .parse::<IpNet>()
                    .map_err(|_| ConfigError::NodePortAddress { field, value: cidr.to_string() })?;
                let loopback = [IpAddr::from([127, 0, 0, 1]), IpAddr::from(std::net::Ipv6Addr::LOCALHOST)];
                if net.prefix_len() > 0 && loopback.iter().any(|ip| net.contains(ip)) {
                    warnings.push(format!(
                        "{field}: {cidr:?} includes loopback addresses: NodePorts are not served on them (as in upstream's nftables mode)"
                    ));
                }
                out.cidrs.push(net.trunc());
            }
        }
        used += 1;
    }
    if used == 0 {
        out.primary = true;
    }
    Ok((out, warnings))
}

/// Parses `--detect-local-mode` with its companion flags.
pub fn parse_detect_local(mode: &str, bridge: Option<&str>, prefix: Option<&str>) -> Result<DetectLocal, ConfigError> {
    match mode {
        "" | "ClusterCIDR" => Ok(DetectLocal::ClusterCidr),
        "NodeCIDR" => Ok(DetectLocal::NodeCidr),
        "BridgeInterface" => Ok(DetectLocal::BridgeInterface(bridge.unwrap_or_default().to_string())),
        "InterfaceNamePrefix" => Ok(DetectLocal::InterfaceNamePrefix(prefix.unwrap_or_default().to_string())),
        other => Err(ConfigError::DetectLocalMode(other.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_lists_parse_and_normalize() {
        let cidrs = parse_cidrs("--cluster-cidr", "10.244.1.7/16, fd00:10::/48").unwrap();
        assert_eq!(cidrs[0].to_string(), "10.244.0.0/16");
        assert_eq!(cidrs.len(), 2);
        assert!(parse_cidrs("--cluster-cidr", "10.244.0.0/33").is_err());
    }

    #[test]
    fn validation_catches_bad_settings() {
        let mut c = ProxyConfig::new("node1");
        assert!(c.validate().is_ok());
        c.masquerade_bit = 32;
        assert_eq!(c.validate(), Err(ConfigError::MasqueradeBit(32)));
        c.masquerade_bit = 14;
        c.cluster_cidrs = parse_cidrs("x", "10.0.0.0/8,10.1.0.0/16").unwrap();
        assert_eq!(c.validate(), Err(ConfigError::TooManyClusterCidrs(IpFamily::V4)));
        assert_eq!(ProxyConfig::new("n").masquerade_mark(), 0x4000);
    }

    #[test]
    fn nodeport_addresses() {
        let parse = |v: &str| parse_nodeport_addresses("--nodeport-addresses", &[v.to_string()]);
        assert_eq!(parse_nodeport_addresses("x", &[]).unwrap(), (NodePortAddresses::primary(), vec![]));
        assert_eq!(parse("primary").unwrap().0, NodePortAddresses::primary());
        let (np, warnings) = parse("192.168.0.7/24,0.0.0.0/0").unwrap();
        assert_eq!(np.cidrs.iter().map(|c| c.to_string()).collect::<Vec<_>>(), ["192.168.0.0/24", "0.0.0.0/0"]);
        assert!(!np.primary && warnings.is_empty());
        // Keywords in any combination with each other and with CIDRs (upstream after 1.35).
        let (np, _) = parse("primary, 10.0.0.0/8, all").unwrap();
        assert!(np.primary && np.all && np.cidrs.len() == 1);
        // localhost: upstream's two loopback ranges, reported (NodePorts are not served there);
        // alone, it is not the default.
        let (np, warnings) = parse("localhost,10.0.0.0/8").unwrap();
        assert!(np.localhost && !np.primary && warnings[0].contains("localhost"), "{warnings:?}");
        assert_eq!(
            np.cidrs.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
            ["127.0.0.0/8", "::1/128", "10.0.0.0/8"]
        );
        let (np, _) = parse("localhost").unwrap();
        assert!(np.localhost && !np.primary && !np.all && np.cidrs.len() == 2, "{np:?}");
        // An unknown keyword is skipped alone, named with the field.
        let (np, warnings) = parse("10.0.0.0/8,nodeips").unwrap();
        assert_eq!(np.cidrs.len(), 1);
        assert!(warnings[0].starts_with("--nodeport-addresses: unknown keyword \"nodeips\""), "{warnings:?}");
        // Alone, it leaves the default.
        assert_eq!(parse("nodeips").unwrap().0, NodePortAddresses::primary());
        // An invalid CIDR is refused, as upstream's validation does.
        let err = parse("10.0.0.0/33").unwrap_err().to_string();
        assert!(err.contains("--nodeport-addresses") && err.contains("10.0.0.0/33"), "{err}");
        assert!(parse("10.0.0.300").is_err());
    }

    #[test]
    fn bind_address_unspecified_means_unset() {
        assert_eq!(parse_bind_address("--bind-address", "0.0.0.0").unwrap(), None);
        assert_eq!(parse_bind_address("--bind-address", "::").unwrap(), None);
        assert_eq!(parse_bind_address("--bind-address", "10.1.2.3").unwrap(), Some("10.1.2.3".parse().unwrap()));
        assert!(parse_bind_address("--bind-address", "nope").is_err());
    }
}
