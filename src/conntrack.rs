//! Stale conntrack entries for UDP and SCTP services (upstream's stateless cleanup, kube-proxy
//! ≥ 1.32): after a sync, an entry whose original destination is a service IP:port (ClusterIP,
//! ExternalIP, LoadBalancer IP) or a NodePort, and whose reply source is not one of that service
//! port's current endpoints, is deleted. Without this a UDP client keeps talking to a removed
//! backend as long as it keeps sending (DNS failover is the classic case). It needs no memory of
//! previous endpoints, so it also works for a one-shot `sync` and after a restart. Deletion is by
//! exact tuple, never a flush.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use tracing::{debug, info};

use crate::net::IpFamily;
use crate::netlink::NetlinkError;
use crate::netlink::conntrack::{Conntrack, Flow};
use crate::plan::ConntrackTarget;

/// Which flows are stale.
pub fn stale_flows(flows: &[Flow], targets: &[ConntrackTarget]) -> Vec<Flow> {
    let mut by_destination: HashMap<(u8, SocketAddr), usize> = HashMap::new();
    let mut by_node_port: HashMap<(u8, u16), usize> = HashMap::new();
    let endpoints: Vec<HashSet<SocketAddr>> =
        targets.iter().map(|t| t.endpoints.iter().map(|(ip, port)| SocketAddr::new(*ip, *port)).collect()).collect();
    for (i, t) in targets.iter().enumerate() {
        let proto = t.protocol.number();
        for (ip, port) in &t.destinations {
            by_destination.insert((proto, SocketAddr::new(*ip, *port)), i);
        }
        if let Some(np) = t.node_port {
            by_node_port.insert((proto, np), i);
        }
    }
    flows
        .iter()
        .filter(|f| {
            let dst = canonical(f.original.dst);
            let target = by_destination.get(&(f.protocol, dst)).or_else(|| by_node_port.get(&(f.protocol, dst.port())));
            target.is_some_and(|&i| !endpoints[i].contains(&canonical(f.reply.src)))
        })
        .copied()
        .collect()
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// Deletes the stale entries of these targets in the current network namespace. Returns how
/// many were deleted.
pub fn clean(targets: &[ConntrackTarget]) -> Result<usize, NetlinkError> {
    if targets.is_empty() {
        return Ok(0);
    }
    let mut ct = Conntrack::open()?;
    let protocols: Vec<u8> = {
        let mut p: Vec<u8> = targets.iter().map(|t| t.protocol.number()).collect();
        p.sort_unstable();
        p.dedup();
        p
    };
    let mut deleted = 0;
    for family in IpFamily::ALL {
        let mine: Vec<ConntrackTarget> = targets
            .iter()
            .filter(|t| t.destinations.first().is_some_and(|(ip, _)| family_of(ip) == family))
            .cloned()
            .collect();
        if mine.is_empty() {
            continue;
        }
        let flows = ct.flows(family, &protocols)?;
        let stale = stale_flows(&flows, &mine);
        debug!(%family, flows = flows.len(), stale = stale.len(), "conntrack scan");
        deleted += ct.delete(family, &stale)?;
    }
    if deleted > 0 {
        info!(deleted, "deleted stale conntrack entries of UDP/SCTP services");
    }
    Ok(deleted)
}

/// Whether an address belongs to a family (IPv4-mapped IPv6 counts as IPv4).
pub fn family_of(ip: &IpAddr) -> IpFamily {
    IpFamily::of(&ip.to_canonical())
}

/// Applies the `conntrack:` settings of a kube-proxy config, as kube-proxy does at start-up
/// (`nf_conntrack_max` = max(min, maxPerCore × CPUs), timeouts, be-liberal). Each failure is
/// logged and skipped: some of these are only writable in the host's namespace.
pub fn apply_sysctls(c: &crate::config::file::ConntrackSettings) {
    let mut writes: Vec<(&str, String)> = Vec::new();
    if let Some(per_core) = c.max_per_core.filter(|p| *p > 0) {
        let cpus = std::thread::available_parallelism().map(|n| n.get() as u64).unwrap_or(1);
        let max = (u64::from(per_core) * cpus).max(u64::from(c.min.unwrap_or(0)));
        writes.push(("nf_conntrack_max", max.to_string()));
    }
    let secs = |d: &Option<std::time::Duration>| d.filter(|d| !d.is_zero()).map(|d| d.as_secs().to_string());
    if let Some(v) = secs(&c.tcp_established_timeout) {
        writes.push(("nf_conntrack_tcp_timeout_established", v));
    }
    if let Some(v) = secs(&c.tcp_close_wait_timeout) {
        writes.push(("nf_conntrack_tcp_timeout_close_wait", v));
    }
    if let Some(v) = secs(&c.udp_timeout) {
        writes.push(("nf_conntrack_udp_timeout", v));
    }
    if let Some(v) = secs(&c.udp_stream_timeout) {
        writes.push(("nf_conntrack_udp_timeout_stream", v));
    }
    if let Some(b) = c.tcp_be_liberal {
        writes.push(("nf_conntrack_tcp_be_liberal", if b { "1".into() } else { "0".into() }));
    }
    for (name, value) in writes {
        let path = format!("/proc/sys/net/netfilter/{name}");
        match std::fs::write(&path, &value) {
            Ok(()) => info!(sysctl = name, value, "conntrack setting applied"),
            Err(e) => tracing::warn!(sysctl = name, value, error = %e, "cannot apply conntrack setting"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::L4Proto;
    use crate::netlink::conntrack::Tuple;

    fn flow(orig_dst: &str, reply_src: &str) -> Flow {
        Flow {
            protocol: 17,
            original: Tuple { src: "10.244.1.10:5000".parse().unwrap(), dst: orig_dst.parse().unwrap() },
            reply: Tuple { src: reply_src.parse().unwrap(), dst: "10.244.1.10:5000".parse().unwrap() },
        }
    }

    fn target() -> ConntrackTarget {
        ConntrackTarget {
            protocol: L4Proto::Udp,
            destinations: vec![("10.96.0.10".parse().unwrap(), 53), ("203.0.113.5".parse().unwrap(), 53)],
            node_port: Some(30053),
            endpoints: vec![("10.244.2.10".parse().unwrap(), 5353)],
        }
    }

    #[test]
    fn only_flows_of_a_service_to_a_non_endpoint_are_stale() {
        let flows = vec![
            flow("10.96.0.10:53", "10.244.2.10:5353"),      // live endpoint: kept
            flow("10.96.0.10:53", "10.244.1.11:5353"),      // removed endpoint: stale
            flow("203.0.113.5:53", "10.244.1.11:5353"),     // LB IP, removed endpoint: stale
            flow("192.168.50.2:30053", "10.244.1.11:5353"), // NodePort, removed endpoint: stale
            flow("10.96.0.10:53", "10.96.0.10:53"),         // before the first endpoint (not DNATed): stale
            flow("10.96.0.99:53", "10.244.1.11:5353"),      // not a service: kept
            flow("10.96.0.10:54", "10.244.1.11:5353"),      // other port: kept
        ];
        let stale = stale_flows(&flows, &[target()]);
        assert_eq!(stale, vec![flows[1], flows[2], flows[3], flows[4]]);
        let mut tcp = flows[1];
        tcp.protocol = 6;
        assert!(stale_flows(&[tcp], &[target()]).is_empty(), "other protocols are left alone");
    }
}
