//! Which endpoints a service port uses on this node, with upstream kube-proxy's semantics:
//! ready endpoints, else serving-and-terminating ones (independently for the cluster-wide and
//! the local list); topology hints when every ready endpoint carries them and one matches this
//! node (node hints first, then zone hints); local means `nodeName` equals this node.

use crate::model::{Endpoint, ServicePort};

/// The endpoints a service port uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Categorized {
    /// Endpoints for Cluster traffic policy (empty when the port never uses it).
    pub cluster: Vec<Endpoint>,
    /// Endpoints for Local traffic policy (empty when the port never uses it).
    pub local: Vec<Endpoint>,
    /// Union of both: every endpoint this node may DNAT to, sorted by address.
    pub reachable: Vec<Endpoint>,
    /// Whether the service has usable endpoints anywhere in the cluster.
    pub has_any: bool,
    /// The topology mode in effect for the cluster list.
    pub topology: Topology,
}

/// How topology narrowed the cluster-wide endpoint list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Topology {
    #[default]
    None,
    PreferSameZone,
    PreferSameNode,
}

/// This node's identity for locality and topology.
#[derive(Debug, Clone, Copy)]
pub struct NodeView<'a> {
    pub name: &'a str,
    pub zone: Option<&'a str>,
}

fn is_local(ep: &Endpoint, node: &NodeView<'_>) -> bool {
    ep.node_name.as_deref() == Some(node.name)
}

fn serving_terminating(ep: &Endpoint) -> bool {
    ep.serving && ep.terminating
}

fn topology_mode(endpoints: &[Endpoint], node: &NodeView<'_>) -> Topology {
    let ready: Vec<&Endpoint> = endpoints.iter().filter(|e| e.ready).collect();
    let all_node_hints = ready.iter().all(|e| !e.node_hints.is_empty());
    let for_node = ready.iter().any(|e| e.node_hints.contains(node.name));
    if all_node_hints && for_node {
        return Topology::PreferSameNode;
    }
    let all_zone_hints = ready.iter().all(|e| !e.zone_hints.is_empty());
    let for_zone = node.zone.is_some_and(|z| ready.iter().any(|e| e.zone_hints.contains(z)));
    if all_zone_hints && for_zone {
        return Topology::PreferSameZone;
    }
    Topology::None
}

fn available(ep: &Endpoint, mode: Topology, node: &NodeView<'_>) -> bool {
    match mode {
        Topology::None => true,
        Topology::PreferSameNode => ep.node_hints.contains(node.name),
        Topology::PreferSameZone => node.zone.is_some_and(|z| ep.zone_hints.contains(z)),
    }
}

/// Splits a service port's endpoints into the lists its chains use.
pub fn categorize(endpoints: &[Endpoint], sp: &ServicePort, node: &NodeView<'_>) -> Categorized {
    let mut out = Categorized::default();
    if sp.uses_cluster_endpoints() {
        out.topology = topology_mode(endpoints, node);
        out.cluster = endpoints.iter().filter(|e| e.ready && available(e, out.topology, node)).cloned().collect();
        if out.cluster.is_empty() {
            out.cluster = endpoints.iter().filter(|e| serving_terminating(e)).cloned().collect();
        }
        out.has_any = !out.cluster.is_empty();
    }
    if sp.uses_local_endpoints() {
        out.has_any |= endpoints.iter().any(|e| e.ready || serving_terminating(e));
        let local_ready: Vec<Endpoint> = endpoints.iter().filter(|e| is_local(e, node) && e.ready).cloned().collect();
        out.local = if local_ready.is_empty() {
            endpoints.iter().filter(|e| is_local(e, node) && serving_terminating(e)).cloned().collect()
        } else {
            local_ready
        };
    }
    let mut reachable: Vec<Endpoint> = out.cluster.iter().chain(out.local.iter()).cloned().collect();
    reachable.sort_by_key(|e| (e.ip, e.port));
    reachable.dedup_by_key(|e| (e.ip, e.port));
    out.reachable = reachable;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NamespacedName, ServicePortName};
    use crate::net::L4Proto;

    fn ep(ip: &str, ready: bool, serving: bool, terminating: bool, node: &str) -> Endpoint {
        Endpoint {
            ip: ip.parse().unwrap(),
            port: 80,
            ready,
            serving,
            terminating,
            node_name: Some(node.to_string()),
            zone: None,
            zone_hints: Default::default(),
            node_hints: Default::default(),
        }
    }

    fn port() -> ServicePort {
        ServicePort::new(
            ServicePortName { service: NamespacedName::new("ns", "svc"), port: "p".into(), protocol: L4Proto::Tcp },
            vec!["10.96.0.1".parse().unwrap()],
            80,
        )
    }

    const NODE: NodeView<'static> = NodeView { name: "node1", zone: Some("zone-a") };

    fn ips(eps: &[Endpoint]) -> Vec<String> {
        eps.iter().map(|e| e.ip.to_string()).collect()
    }

    #[test]
    fn ready_endpoints_win_and_terminating_is_a_fallback() {
        let eps = vec![ep("10.0.0.1", true, true, false, "node2"), ep("10.0.0.2", false, true, true, "node1")];
        let c = categorize(&eps, &port(), &NODE);
        assert_eq!(ips(&c.cluster), vec!["10.0.0.1"]);
        assert!(c.has_any);
        let only_terminating =
            vec![ep("10.0.0.2", false, true, true, "node1"), ep("10.0.0.3", false, false, true, "node1")];
        let c = categorize(&only_terminating, &port(), &NODE);
        assert_eq!(ips(&c.cluster), vec!["10.0.0.2"], "serving && terminating only");
        let none = vec![ep("10.0.0.3", false, false, false, "node1")];
        assert!(!categorize(&none, &port(), &NODE).has_any);
    }

    #[test]
    fn local_policy_uses_local_endpoints_with_its_own_fallback() {
        let mut sp = port();
        sp.internal_policy_local = true;
        let eps = vec![ep("10.0.0.1", true, true, false, "node2"), ep("10.0.0.2", false, true, true, "node1")];
        let c = categorize(&eps, &sp, &NODE);
        assert!(c.cluster.is_empty(), "cluster list unused");
        assert_eq!(ips(&c.local), vec!["10.0.0.2"]);
        assert!(c.has_any);
        assert_eq!(ips(&c.reachable), vec!["10.0.0.2"]);
    }

    #[test]
    fn zone_hints_apply_only_when_complete_and_matching() {
        let mut a = ep("10.0.0.1", true, true, false, "node2");
        a.zone_hints.insert("zone-a".into());
        let mut b = ep("10.0.0.2", true, true, false, "node3");
        b.zone_hints.insert("zone-b".into());
        let c = categorize(&[a.clone(), b.clone()], &port(), &NODE);
        assert_eq!(c.topology, Topology::PreferSameZone);
        assert_eq!(ips(&c.cluster), vec!["10.0.0.1"]);
        // One endpoint without hints: hints are ignored.
        let plain = ep("10.0.0.3", true, true, false, "node4");
        let c = categorize(&[a.clone(), b.clone(), plain], &port(), &NODE);
        assert_eq!(c.topology, Topology::None);
        assert_eq!(c.cluster.len(), 3);
        // No hint for our zone: ignored too.
        let c = categorize(&[b], &port(), &NODE);
        assert_eq!(c.topology, Topology::None);
    }

    #[test]
    fn node_hints_take_precedence() {
        let mut a = ep("10.0.0.1", true, true, false, "node1");
        a.node_hints.insert("node1".into());
        a.zone_hints.insert("zone-a".into());
        let mut b = ep("10.0.0.2", true, true, false, "node2");
        b.node_hints.insert("node2".into());
        b.zone_hints.insert("zone-a".into());
        let c = categorize(&[a, b], &port(), &NODE);
        assert_eq!(c.topology, Topology::PreferSameNode);
        assert_eq!(ips(&c.cluster), vec!["10.0.0.1"]);
    }
}
