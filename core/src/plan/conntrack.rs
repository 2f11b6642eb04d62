//! What the conntrack reconciler needs to know of a UDP or SCTP service port in one family:
//! where its flows arrive, and which endpoints they may legitimately go to.
//!
//! As upstream's reconciler, the allowed endpoints are every **serving** endpoint of the port
//! cluster-wide (ready, or terminating and still serving), not the ones this node DNATs new
//! flows to: traffic policies, topology hints and the ready-over-terminating choice decide
//! where new flows go, but a change of them must not cut existing flows. Only a flow to an
//! endpoint that is no longer serving is stale.

use std::net::IpAddr;

use super::fragment::ConntrackTarget;
use crate::model::{ClusterState, ServicePort};
use crate::net::{IpFamily, L4Proto};

/// The conntrack target of a service port in `family` (`None` for TCP and for a family the
/// service has no ClusterIP in), with its serving endpoints from `state`.
pub(super) fn target(family: IpFamily, sp: &ServicePort, state: &ClusterState) -> Option<ConntrackTarget> {
    if sp.name.protocol == L4Proto::Tcp {
        return None;
    }
    sp.cluster_ip(family)?;
    let destinations = sp.frontends(family).map(|ip| (ip, sp.port)).collect();
    Some(ConntrackTarget {
        name: sp.name.clone(),
        family,
        protocol: sp.name.protocol,
        destinations,
        node_port: sp.node_port,
        endpoints: serving_endpoints(sp, family, state),
    })
}

/// The port's serving endpoints in `family`, sorted and once each: an address serving in any of
/// the service's slices (as `ClusterState::endpoints` merges them, without copying endpoints).
fn serving_endpoints(sp: &ServicePort, family: IpFamily, state: &ClusterState) -> Vec<(IpAddr, u16)> {
    let mut out: Vec<(IpAddr, u16)> = Vec::new();
    for slice in state.slices_of(&sp.name.service).filter(|s| s.family == family) {
        for (_, _, port) in slice.ports.iter().filter(|(n, p, _)| *n == sp.name.port && *p == sp.name.protocol) {
            out.extend(slice.endpoints.iter().filter(|e| e.serving).map(|e| (e.ip, *port)));
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(yaml: &str) -> ClusterState {
        let mut m = crate::manifests::Manifests::default();
        crate::manifests::load_text(std::path::Path::new("t.yaml"), yaml, &mut m);
        assert!(m.problems.is_empty(), "{:?}", m.problems);
        let (state, problems) = m.into_state("node1");
        assert!(problems.is_empty(), "{problems:?}");
        state
    }

    const YAML: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: dns, namespace: kube-system}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  externalIPs: [203.0.113.9]
  externalTrafficPolicy: Local
  internalTrafficPolicy: Local
  ports:
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30053}
  - {name: dns-tcp, port: 53, protocol: TCP, targetPort: 5353}
status: {loadBalancer: {ingress: [{ip: 198.51.100.7}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dns-1, namespace: kube-system, labels: {kubernetes.io/service-name: dns}}
addressType: IPv4
ports: [{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5353, protocol: TCP}]
endpoints:
- {addresses: [10.244.2.10], nodeName: node2, hints: {forZones: [{name: zone-b}]}}
- {addresses: [10.244.1.10], nodeName: node1, conditions: {ready: false, serving: true, terminating: true}}
- {addresses: [10.244.1.11], nodeName: node1, conditions: {ready: false, serving: false, terminating: true}}
- {addresses: [10.244.3.10], nodeName: node3, conditions: {ready: false}}
"#;

    #[test]
    fn every_serving_endpoint_is_allowed_whatever_this_node_picks() {
        let state = state(YAML);
        let svc = state.services().next().unwrap();
        let udp = &svc.ports[0];
        let t = target(IpFamily::V4, udp, &state).unwrap();
        assert_eq!(t.name, udp.name);
        assert_eq!((t.family, t.protocol, t.node_port), (IpFamily::V4, L4Proto::Udp, Some(30053)));
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(t.destinations, vec![(ip("10.96.0.10"), 53), (ip("203.0.113.9"), 53), (ip("198.51.100.7"), 53)]);
        // node1 DNATs new flows to its terminating endpoint only (Local policies, no ready local
        // endpoint); the reconciler keeps flows to both serving endpoints anyway, and drops
        // flows to the not-serving and the not-ready ones.
        assert_eq!(t.endpoints, vec![(ip("10.244.1.10"), 5353), (ip("10.244.2.10"), 5353)]);
        assert_eq!(target(IpFamily::V6, udp, &state), None, "no IPv6 ClusterIP");
        assert_eq!(target(IpFamily::V4, &svc.ports[1], &state), None, "TCP is never touched");
    }

    #[test]
    fn an_address_in_several_slices_is_allowed_once_if_any_copy_serves() {
        let second = r#"
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dns-2, namespace: kube-system, labels: {kubernetes.io/service-name: dns}}
addressType: IPv4
ports: [{name: dns, port: 5353, protocol: UDP}]
endpoints:
- {addresses: [10.244.2.10], nodeName: node2}
- {addresses: [10.244.3.10], nodeName: node3}
"#;
        let state = state(&format!("{YAML}{second}"));
        let udp = &state.services().next().unwrap().ports[0];
        let t = target(IpFamily::V4, udp, &state).unwrap();
        let merged: Vec<(IpAddr, u16)> =
            state.endpoints(&udp.name, IpFamily::V4).iter().filter(|e| e.serving).map(|e| (e.ip, e.port)).collect();
        assert_eq!(t.endpoints, merged, "the same as the merged endpoints");
        assert_eq!(t.endpoints.len(), 3, "{:?}", t.endpoints);
    }
}
