//! Validated settings shared by every command.

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
    #[error("invalid --nodeport-addresses entry {0:?} (a CIDR, or `primary`)")]
    NodePortAddress(String),
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

/// Which addresses accept NodePort traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// The node's primary IPs: its Node's InternalIPs, else the default-route interface's.
    Primary,
    /// Local addresses inside these ranges (`0.0.0.0/0` / `::/0`: every local address).
    Cidrs(Vec<IpNet>),
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
    /// The nftables table name in both families.
    pub table: String,
    /// Delete stale UDP/SCTP conntrack entries after each sync.
    pub conntrack_cleanup: bool,
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
            nodeport_addresses: NodePortAddresses::Primary,
            table: Self::DEFAULT_TABLE.to_string(),
            conntrack_cleanup: true,
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

/// Parses `--nodeport-addresses`.
pub fn parse_nodeport_addresses(values: &[String]) -> Result<NodePortAddresses, ConfigError> {
    let items: Vec<&str> = values.iter().flat_map(|v| v.split(',')).map(str::trim).filter(|s| !s.is_empty()).collect();
    if items.is_empty() || items == ["primary"] {
        return Ok(NodePortAddresses::Primary);
    }
    let mut cidrs = Vec::new();
    for item in items {
        let net = item.parse::<IpNet>().map_err(|_| ConfigError::NodePortAddress(item.to_string()))?;
        cidrs.push(net.trunc());
    }
    Ok(NodePortAddresses::Cidrs(cidrs))
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
        assert_eq!(parse_nodeport_addresses(&[]).unwrap(), NodePortAddresses::Primary);
        assert_eq!(parse_nodeport_addresses(&["primary".into()]).unwrap(), NodePortAddresses::Primary);
        let NodePortAddresses::Cidrs(c) = parse_nodeport_addresses(&["192.168.0.0/24,0.0.0.0/0".into()]).unwrap() else {
            panic!()
        };
        assert_eq!(c.len(), 2);
        assert!(parse_nodeport_addresses(&["nope".into()]).is_err());
    }
}
