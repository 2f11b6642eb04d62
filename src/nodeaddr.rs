//! Which local addresses accept NodePort traffic (`--nodeport-addresses`).
//!
//! Per family, as upstream: the family's CIDRs (`localhost` is `127.0.0.0/8` and `::1/128`)
//! and, for `primary` (the default), the node's primary IP of the family; a family with
//! neither, a `/0` range and `all` mean every local address of the family (matched with
//! `fib daddr type local`). Loopback is never served, as in upstream's nftables mode without
//! its alpha gate `KubeProxyNFTablesLocalhostNodePorts` (nor is `route_localnet` set); the
//! loopback addresses inside the ranges are still where health-check node ports listen, as
//! upstream's health-check servers take every local address the ranges hold. These lookups
//! read the calling thread's network namespace.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::config::NodePortAddresses;
use crate::model::NodeInfo;
use crate::net::IpFamily;
use crate::plan::NodePorts;

/// Node-port targets per family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePortTargets {
    pub v4: NodePorts,
    pub v6: NodePorts,
    /// Loopback addresses inside a family's ranges (when the family does not match all): no
    /// NodePort answers there, but health-check node ports listen there too, as upstream's.
    pub loopback: Vec<IpAddr>,
}

impl NodePortTargets {
    /// These targets, with no loopback address in the ranges.
    pub fn new(v4: NodePorts, v6: NodePorts) -> NodePortTargets {
        NodePortTargets { v4, v6, loopback: Vec::new() }
    }
}

/// Addresses of the local interfaces: (interface, address).
pub(crate) fn local_addresses() -> Vec<(String, IpAddr)> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else { return Vec::new() };
    addrs
        .filter_map(|ifa| {
            let addr = ifa.address?;
            let ip = if let Some(v4) = addr.as_sockaddr_in() {
                IpAddr::V4(v4.ip())
            } else if let Some(v6) = addr.as_sockaddr_in6() {
                IpAddr::V6(v6.ip())
            } else {
                return None;
            };
            Some((ifa.interface_name, ip))
        })
        .collect()
}

/// The interface holding the default route of a family, from /proc (thread's namespace).
pub(crate) fn default_route_interface(family: IpFamily) -> Option<String> {
    match family {
        IpFamily::V4 => {
            let text = std::fs::read_to_string("/proc/thread-self/net/route").ok()?;
            text.lines().skip(1).find_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                (f.len() > 7 && f[1] == "00000000" && f[7] == "00000000").then(|| f[0].to_string())
            })
        }
        IpFamily::V6 => {
            let text = std::fs::read_to_string("/proc/thread-self/net/ipv6_route").ok()?;
            text.lines().find_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let default = f.len() == 10 && f[0].chars().all(|c| c == '0') && f[1] == "00" && f[9] != "lo";
                default.then(|| f[9].to_string())
            })
        }
    }
}

fn usable(ip: &IpAddr) -> bool {
    !ip.is_loopback() && !ip.is_unspecified() && !matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

/// The node's primary IP of a family, as upstream's `detectNodeIPs` finds it: the Node's first
/// InternalIP of the family (`--bind-address` has already replaced it, see
/// [`apply_bind_address`]); without a Node object (manifests that have none), the first address
/// of the interface holding the family's default route. Loopback is never a primary IP.
fn primary_ip(
    family: IpFamily,
    node: Option<&NodeInfo>,
    local: &[(String, IpAddr)],
    default_iface: &dyn Fn(IpFamily) -> Option<String>,
) -> Option<IpAddr> {
    match node {
        Some(n) => n.host_ips.iter().copied().find(|ip| IpFamily::of(ip) == family && !ip.is_loopback()),
        None => {
            let iface = default_iface(family)?;
            local
                .iter()
                .find(|(name, ip)| *name == iface && IpFamily::of(ip) == family && usable(ip))
                .map(|(_, ip)| *ip)
        }
    }
}

/// `--bind-address` overrides the node's primary IP of its family, as upstream: it becomes the
/// first (and only) InternalIP of that family nftproxy sees.
pub fn apply_bind_address(node: &mut NodeInfo, bind: Option<IpAddr>) {
    if let Some(bind) = bind {
        let family = IpFamily::of(&bind);
        node.host_ips.retain(|ip| IpFamily::of(ip) != family);
        node.host_ips.insert(0, bind);
    }
}

/// Resolves `--nodeport-addresses` for both families in this network namespace.
pub fn resolve(setting: &NodePortAddresses, node: Option<&NodeInfo>) -> NodePortTargets {
    resolve_with(setting, node, &local_addresses(), &default_route_interface)
}

/// Resolves `--nodeport-addresses` against given local addresses, per family as upstream's
/// per-family proxiers do: the family's CIDRs plus, for `primary`, the node's primary IP of
/// the family; a family left with nothing (no CIDR of it, no primary IP known) or holding a
/// `/0` range, and every family under `all`, accepts NodePorts on every local address
/// (`fib daddr type local`). Otherwise the local addresses inside the ranges, never loopback:
/// a family limited to loopback (`localhost`, `127.0.0.0/8`) serves NodePorts nowhere, as
/// upstream's nftables mode. The loopback addresses inside the ranges are returned apart.
pub(crate) fn resolve_with(
    setting: &NodePortAddresses,
    node: Option<&NodeInfo>,
    local: &[(String, IpAddr)],
    default_iface: &dyn Fn(IpFamily) -> Option<String>,
) -> NodePortTargets {
    let mut loopback = Vec::new();
    let mut per_family = |family: IpFamily| -> NodePorts {
        if setting.all {
            return NodePorts::MatchAll;
        }
        let mut ranges: Vec<IpNet> = setting.cidrs.iter().copied().filter(|c| IpFamily::of_net(c) == family).collect();
        if setting.primary
            && let Some(ip) = primary_ip(family, node, local, default_iface)
        {
            ranges.push(IpNet::from(ip));
        }
        if ranges.is_empty() || ranges.iter().any(|c| c.prefix_len() == 0) {
            return NodePorts::MatchAll;
        }
        let inside = |ip: &IpAddr| ranges.iter().any(|c| c.contains(ip));
        loopback.extend(local.iter().map(|(_, ip)| *ip).filter(|ip| ip.is_loopback() && inside(ip)));
        let mut ips: Vec<IpAddr> = local.iter().map(|(_, ip)| *ip).filter(|ip| usable(ip) && inside(ip)).collect();
        ips.sort();
        ips.dedup();
        NodePorts::Addresses(ips)
    };
    let (v4, v6) = (per_family(IpFamily::V4), per_family(IpFamily::V6));
    loopback.sort();
    loopback.dedup();
    NodePortTargets { v4, v6, loopback }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local() -> Vec<(String, IpAddr)> {
        [("lo", "127.0.0.1"), ("lo", "::1"), ("eth0", "192.168.50.2"), ("eth0", "fd00:50::2"), ("eth1", "10.0.0.5")]
            .iter()
            .map(|(n, ip)| (n.to_string(), ip.parse().unwrap()))
            .collect()
    }

    fn node(ips: &[&str]) -> NodeInfo {
        NodeInfo {
            name: "node1".into(),
            host_ips: ips.iter().map(|ip| ip.parse().unwrap()).collect(),
            ..NodeInfo::default()
        }
    }

    fn addrs(ips: &[&str]) -> NodePorts {
        NodePorts::Addresses(ips.iter().map(|ip| ip.parse().unwrap()).collect())
    }

    fn resolved(setting: &NodePortAddresses, node: Option<&NodeInfo>) -> NodePortTargets {
        resolve_with(setting, node, &local(), &|_| Some("eth0".to_string()))
    }

    fn cidrs(list: &str) -> NodePortAddresses {
        NodePortAddresses::cidrs(crate::config::parse_cidrs("x", list).unwrap())
    }

    #[test]
    fn a_family_without_cidrs_matches_all_its_addresses() {
        // The dual-stack node that lost its IPv6 NodePorts with IPv4-only CIDRs.
        let t = resolved(&cidrs("192.168.50.0/24"), Some(&node(&["192.168.50.2", "fd00:50::2"])));
        assert_eq!(t.v4, addrs(&["192.168.50.2"]));
        assert_eq!(t.v6, NodePorts::MatchAll);
        let t = resolved(&cidrs("fd00:50::/64"), None);
        assert_eq!((t.v4, t.v6), (NodePorts::MatchAll, addrs(&["fd00:50::2"])));
        // A zero range matches all of its family only.
        let t = resolved(&cidrs("0.0.0.0/0,fd00:50::/64"), None);
        assert_eq!((t.v4, t.v6), (NodePorts::MatchAll, addrs(&["fd00:50::2"])));
        // Loopback inside a range is never served, but kept apart for health-check servers.
        let t = resolved(&cidrs("127.0.0.0/8,10.0.0.0/8"), None);
        assert_eq!((&t.v4, &t.v6), (&addrs(&["10.0.0.5"]), &NodePorts::MatchAll));
        assert_eq!(t.loopback, ["127.0.0.1".parse::<IpAddr>().unwrap()]);
    }

    /// Upstream v1.37 (nftables mode, its localhost gate off) expands `localhost` to
    /// `127.0.0.0/8` and `::1/128`, skips loopback in `nodeport-ips`, and listens for health
    /// checks on every local address inside the ranges, loopback included.
    #[test]
    fn loopback_only_ranges_serve_no_nodeport_and_limit_their_family() {
        let parse = |list: &str| crate::config::parse_nodeport_addresses("x", &[list.to_string()]).unwrap().0;
        let dual = node(&["192.168.50.2", "fd00:50::2"]);
        // localhost alone: no NodePort anywhere, in either family (neither matches all).
        let t = resolved(&parse("localhost"), Some(&dual));
        assert_eq!((&t.v4, &t.v6), (&addrs(&[]), &addrs(&[])));
        assert_eq!(t.loopback, ["127.0.0.1".parse::<IpAddr>().unwrap(), "::1".parse().unwrap()]);
        // An IPv4 loopback range alone: no IPv4 NodePort; IPv6, which it does not name, on all.
        let t = resolved(&parse("127.0.0.0/8"), Some(&dual));
        assert_eq!((&t.v4, &t.v6), (&addrs(&[]), &NodePorts::MatchAll));
        assert_eq!(t.loopback, ["127.0.0.1".parse::<IpAddr>().unwrap()]);
        // Mixed with another range or with primary: the other addresses only.
        let t = resolved(&parse("127.0.0.0/8,192.168.50.0/24"), Some(&dual));
        assert_eq!((&t.v4, &t.v6), (&addrs(&["192.168.50.2"]), &NodePorts::MatchAll));
        let t = resolved(&parse("localhost,primary"), Some(&dual));
        assert_eq!((&t.v4, &t.v6), (&addrs(&["192.168.50.2"]), &addrs(&["fd00:50::2"])));
        assert_eq!(t.loopback.len(), 2);
        // A family that matches all has no loopback apart (its health checks bind the wildcard).
        let t = resolved(&parse("0.0.0.0/0,::1/128"), Some(&dual));
        assert_eq!((&t.v4, &t.v6), (&NodePorts::MatchAll, &addrs(&[])));
        assert_eq!(t.loopback, ["::1".parse::<IpAddr>().unwrap()]);
        // The default and all: no loopback anywhere.
        assert!(resolved(&NodePortAddresses::primary(), Some(&dual)).loopback.is_empty());
    }

    #[test]
    fn primary_is_the_first_node_ip_of_each_family() {
        let primary = NodePortAddresses::primary();
        let t = resolved(&primary, Some(&node(&["192.168.50.2", "10.0.0.5", "fd00:50::2"])));
        assert_eq!((t.v4, t.v6), (addrs(&["192.168.50.2"]), addrs(&["fd00:50::2"])));
        // A single-stack Node: the other family matches all (upstream's node IP is unknown).
        let t = resolved(&primary, Some(&node(&["192.168.50.2"])));
        assert_eq!((t.v4, t.v6), (addrs(&["192.168.50.2"]), NodePorts::MatchAll));
        // No Node object: the default-route interface's addresses.
        let t = resolved(&primary, None);
        assert_eq!((t.v4, t.v6), (addrs(&["192.168.50.2"]), addrs(&["fd00:50::2"])));
        // primary with CIDRs and with all.
        let mut both = cidrs("10.0.0.0/8");
        both.primary = true;
        assert_eq!(resolved(&both, Some(&node(&["192.168.50.2"]))).v4, addrs(&["10.0.0.5", "192.168.50.2"]));
        both.all = true;
        assert_eq!(resolved(&both, None), NodePortTargets::new(NodePorts::MatchAll, NodePorts::MatchAll));
    }

    #[test]
    fn bind_address_overrides_the_primary_ip_of_its_family() {
        let mut n = node(&["192.168.50.2", "fd00:50::2"]);
        apply_bind_address(&mut n, Some("10.0.0.5".parse().unwrap()));
        let t = resolved(&NodePortAddresses::primary(), Some(&n));
        assert_eq!((t.v4, t.v6), (addrs(&["10.0.0.5"]), addrs(&["fd00:50::2"])));
        apply_bind_address(&mut n, None);
        assert_eq!(n.host_ips.len(), 2);
    }
}
