//! Which local addresses accept NodePort traffic (`--nodeport-addresses`).
//!
//! `primary` (the default) means the node's InternalIPs from its Node object, else the
//! addresses of the interface holding the default route. A CIDR list means the local addresses
//! inside it; a `/0` range means every local address (matched with `fib daddr type local`).
//! Loopback is never served, as in upstream's nftables mode. These lookups read the calling
//! thread's network namespace.

use std::net::IpAddr;

use crate::config::NodePortAddresses;
use crate::model::NodeInfo;
use crate::net::IpFamily;
use crate::plan::NodePorts;

/// Node-port targets per family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePortTargets {
    pub v4: NodePorts,
    pub v6: NodePorts,
}

/// Addresses of the local interfaces: (interface, address).
pub fn local_addresses() -> Vec<(String, IpAddr)> {
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
pub fn default_route_interface(family: IpFamily) -> Option<String> {
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

/// Resolves `--nodeport-addresses` for both families.
pub fn resolve(setting: &NodePortAddresses, node: Option<&NodeInfo>) -> NodePortTargets {
    let local = local_addresses();
    let per_family = |family: IpFamily| -> NodePorts {
        match setting {
            NodePortAddresses::Primary => {
                let from_node: Vec<IpAddr> = node
                    .map(|n| {
                        n.internal_ips.iter().copied().filter(|ip| IpFamily::of(ip) == family && usable(ip)).collect()
                    })
                    .unwrap_or_default();
                if !from_node.is_empty() {
                    return NodePorts::Addresses(from_node);
                }
                let iface = default_route_interface(family);
                NodePorts::Addresses(
                    local
                        .iter()
                        .filter(|(name, ip)| Some(name) == iface.as_ref() && IpFamily::of(ip) == family && usable(ip))
                        .map(|(_, ip)| *ip)
                        .collect(),
                )
            }
            NodePortAddresses::Cidrs(cidrs) => {
                let mine: Vec<_> = cidrs.iter().filter(|c| IpFamily::of_net(c) == family).collect();
                if mine.iter().any(|c| c.prefix_len() == 0) {
                    return NodePorts::MatchAll;
                }
                let mut ips: Vec<IpAddr> = local
                    .iter()
                    .map(|(_, ip)| *ip)
                    .filter(|ip| usable(ip) && mine.iter().any(|c| c.contains(ip)))
                    .collect();
                ips.sort();
                ips.dedup();
                NodePorts::Addresses(ips)
            }
        }
    };
    NodePortTargets { v4: per_family(IpFamily::V4), v6: per_family(IpFamily::V6) }
}
