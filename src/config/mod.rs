//! Validated settings shared by every command.

pub mod file;

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
    #[error("invalid {field} {value:?}: expected {expected}")]
    Value { field: &'static str, value: String, expected: &'static str },
    #[error("cannot read the config file: {0}")]
    File(String),
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
            nodeport_addresses: NodePortAddresses::Primary,
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

/// Applies a config file under the flags: a setting comes from the command line when the flag
/// was given there (`explicit(flag id)`), else from the file when it has it, else it keeps the
/// flag's default already in `flags`.
pub fn merge(
    mut flags: ProxyConfig,
    explicit: &dyn Fn(&str) -> bool,
    file: &file::FileSettings,
) -> Result<ProxyConfig, ConfigError> {
    let from_file = |id: &str| !explicit(id);
    if let (true, Some(h)) = (from_file("hostname_override"), &file.hostname_override) {
        flags.hostname = h.clone();
    }
    if let (true, Some(c)) = (from_file("cluster_cidr"), &file.cluster_cidrs) {
        flags.cluster_cidrs = c.clone();
    }
    if let (true, Some(m)) = (from_file("masquerade_all"), file.masquerade_all) {
        flags.masquerade_all = m;
    }
    if let (true, Some(b)) = (from_file("masquerade_bit"), file.masquerade_bit) {
        flags.masquerade_bit = b;
    }
    if let (true, Some(n)) = (from_file("nodeport_addresses"), &file.nodeport_addresses) {
        flags.nodeport_addresses = n.clone();
    }
    let detect_flags = ["detect_local_mode", "pod_bridge_interface", "pod_interface_name_prefix"];
    if let (true, Some(d)) = (detect_flags.iter().all(|f| from_file(f)), &file.detect_local) {
        flags.detect_local = d.clone();
    }
    flags.validate()?;
    Ok(flags)
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
    fn flags_override_the_file_which_overrides_defaults() {
        let (file, _) = file::parse(
            "clusterCIDR: 10.1.0.0/16\nhostnameOverride: from-file\nnftables: {masqueradeBit: 5, masqueradeAll: true}\ndetectLocalMode: NodeCIDR\n",
        )
        .unwrap();
        let mut flags = ProxyConfig::new("from-flags");
        flags.cluster_cidrs = parse_cidrs("x", "10.2.0.0/16").unwrap();
        // (flags given on the command line, hostname, cluster CIDR, mark bit, masquerade-all, detect-local)
        type Case<'a> = (&'a [&'a str], &'a str, &'a str, u32, bool, DetectLocal);
        let cases: [Case<'_>; 4] = [
            (&[], "from-file", "10.1.0.0/16", 5, true, DetectLocal::NodeCidr),
            (&["hostname_override", "masquerade_bit"], "from-flags", "10.1.0.0/16", 14, true, DetectLocal::NodeCidr),
            (
                &["cluster_cidr", "masquerade_all", "detect_local_mode"],
                "from-file",
                "10.2.0.0/16",
                5,
                false,
                DetectLocal::ClusterCidr,
            ),
            (
                &["hostname_override", "cluster_cidr", "masquerade_bit", "masquerade_all", "detect_local_mode"],
                "from-flags",
                "10.2.0.0/16",
                14,
                false,
                DetectLocal::ClusterCidr,
            ),
        ];
        for (explicit, host, cidr, bit, all, detect) in cases {
            let merged = merge(flags.clone(), &|id| explicit.contains(&id), &file).unwrap();
            assert_eq!(merged.hostname, host, "{explicit:?}");
            assert_eq!(merged.cluster_cidrs[0].to_string(), cidr, "{explicit:?}");
            assert_eq!(merged.masquerade_bit, bit, "{explicit:?}");
            assert_eq!(merged.masquerade_all, all, "{explicit:?}");
            assert_eq!(merged.detect_local, detect, "{explicit:?}");
        }
        let (bad, _) = file::parse("detectLocalMode: BridgeInterface\n").unwrap();
        assert!(merge(flags, &|_| false, &bad).is_err(), "a bridge mode without a bridge is invalid");
    }

    #[test]
    fn nodeport_addresses() {
        assert_eq!(parse_nodeport_addresses(&[]).unwrap(), NodePortAddresses::Primary);
        assert_eq!(parse_nodeport_addresses(&["primary".into()]).unwrap(), NodePortAddresses::Primary);
        let NodePortAddresses::Cidrs(c) = parse_nodeport_addresses(&["192.168.0.0/24,0.0.0.0/0".into()]).unwrap()
        else {
            panic!()
        };
        assert_eq!(c.len(), 2);
        assert!(parse_nodeport_addresses(&["nope".into()]).is_err());
    }
}
