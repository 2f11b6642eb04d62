//! A synthetic cluster of S services × E endpoints, built straight into a [`ClusterState`].
//!
//! The mix: 70% TCP and 30% UDP ports; every 10th service a NodePort (half of those with
//! `externalTrafficPolicy: Local`), every 20th a LoadBalancer, every 25th with ClientIP affinity.
//! Endpoints spread over 20 nodes; node1 holds every 20th.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use crate::model::*;
use crate::net::{IpFamily, L4Proto};

/// The shape of a synthetic cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    pub services: usize,
    pub endpoints: usize,
}

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} × {}", self.services, self.endpoints)
    }
}

/// ClusterIP of service `i` (in 10.96.0.0/12).
pub fn cluster_ip(i: usize) -> Ipv4Addr {
    let n = 0x0a60_0000u32 + 1 + i as u32;
    Ipv4Addr::from(n)
}

/// Address of endpoint `j` of service `i` (in 10.128.0.0/9): service `i` owns the 64 addresses
/// from `i * 64`, so adding or removing one endpoint leaves the others' addresses alone.
/// `generation` shifts addresses so a replaced endpoint gets a new one.
pub fn endpoint_ip(i: usize, j: usize, generation: usize) -> Ipv4Addr {
    let n = 0x0a80_0000u32 + ((i * 64 + j + generation * 3) as u32 % 0x007f_ffff);
    Ipv4Addr::from(n)
}

/// The service port of service `i`.
pub fn service(i: usize) -> ServiceInfo {
    let name = NamespacedName::new(format!("ns{}", i % 100), format!("svc{i}"));
    let protocol = if i % 10 < 7 { L4Proto::Tcp } else { L4Proto::Udp };
    let port = if protocol == L4Proto::Tcp { 80 } else { 53 };
    let node_port = i.is_multiple_of(10).then(|| 30000 + (i / 10 % 2700) as u16);
    let lb = (i % 20 == 5).then(|| IpAddr::V4(Ipv4Addr::from(0xcb00_0000u32 + i as u32)));
    ServiceInfo {
        name: name.clone(),
        ports: vec![ServicePort {
            name: ServicePortName { service: name, port: "p".into(), protocol },
            cluster_ips: vec![IpAddr::V4(cluster_ip(i))],
            port,
            node_port: node_port.or(lb.map(|_| 30000 + 2700 + (i / 20 % 60) as u16)),
            external_ips: Vec::new(),
            load_balancer_ips: lb.into_iter().collect(),
            load_balancer_source_ranges: Vec::new(),
            external_policy_local: i.is_multiple_of(20),
            internal_policy_local: false,
            session_affinity_secs: (i % 25 == 3).then_some(10800),
            health_check_node_port: None,
        }],
    }
}

/// The EndpointSlice of service `i` with `endpoints` endpoints.
pub fn slice(i: usize, endpoints: usize, generation: usize) -> EndpointSliceInfo {
    let svc = service(i);
    let sp = &svc.ports[0];
    EndpointSliceInfo {
        name: NamespacedName::new(svc.name.namespace.clone(), format!("svc{i}-abcde")),
        service: svc.name.clone(),
        family: IpFamily::V4,
        ports: vec![(sp.name.port.clone(), sp.name.protocol, 8080)],
        endpoints: (0..endpoints)
            .map(|j| SliceEndpoint {
                ip: IpAddr::V4(endpoint_ip(i, j, generation)),
                ready: true,
                serving: true,
                terminating: false,
                node_name: Some(format!("node{}", j % 20 + 1)),
                zone: None,
                zone_hints: BTreeSet::new(),
                node_hints: BTreeSet::new(),
            })
            .collect(),
        trigger_time: None,
    }
}

/// The whole cluster.
pub fn state(size: Size) -> ClusterState {
    let mut s = ClusterState::new();
    for i in 0..size.services {
        s.upsert_service(service(i));
        s.upsert_slice(slice(i, size.endpoints, 0));
    }
    s.set_node(Some(NodeInfo {
        name: "node1".into(),
        internal_ips: vec![IpAddr::V4(Ipv4Addr::new(192, 168, 0, 2))],
        ..NodeInfo::default()
    }));
    s
}

/// The cluster of [`state`] (`services` × 3) after changes made while no proxy ran: services gone,
/// new ones (one taking a gone service's ClusterIP), endpoint counts changed both ways (so
/// endpoint windows are re-split), affinity and NodePorts turned on and off.
pub fn changed_while_down(services: usize) -> ClusterState {
    let mut s = state(Size { services, endpoints: 3 });
    for i in (0..services).step_by(7) {
        let name = service(i).name;
        s.remove_slice(&slice(i, 3, 0).name);
        s.remove_service(&name);
    }
    for i in (1..services).step_by(5) {
        s.upsert_slice(slice(i, 1 + i % 6, 1));
    }
    for i in (2..services).step_by(9) {
        let mut svc = service(i);
        svc.ports[0].session_affinity_secs = svc.ports[0].session_affinity_secs.xor(Some(60));
        svc.ports[0].node_port = svc.ports[0].node_port.xor(Some(31999 - (i % 1000) as u16));
        s.upsert_service(svc);
    }
    for i in services..services + 6 {
        s.upsert_service(service(i));
        s.upsert_slice(slice(i, 4, 0));
    }
    // A new service with the ClusterIP and port of a gone one (service 0).
    let mut taker = service(services + 10);
    taker.ports[0].cluster_ips = service(0).ports[0].cluster_ips.clone();
    taker.ports[0].port = service(0).ports[0].port;
    taker.ports[0].name.protocol = service(0).ports[0].name.protocol;
    s.upsert_service(taker);
    s.upsert_slice(slice(services + 10, 2, 0));
    s
}
