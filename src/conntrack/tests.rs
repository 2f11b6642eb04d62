use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;

use super::*;
use crate::model::NamespacedName;
use crate::net::L4Proto;
use crate::netlink::conntrack::Tuple;

const NODE_IP: &str = "192.168.50.2";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn flow(orig_dst: &str, reply_src: &str) -> Flow {
    Flow {
        protocol: 17,
        original: Tuple { src: "10.244.1.10:5000".parse().unwrap(), dst: orig_dst.parse().unwrap() },
        reply: Tuple { src: reply_src.parse().unwrap(), dst: "10.244.1.10:5000".parse().unwrap() },
        replied: true,
    }
}

fn port_name(service: &str) -> ServicePortName {
    ServicePortName { service: NamespacedName::new("default", service), port: "dns".into(), protocol: L4Proto::Udp }
}

/// default/<service>:dns on `cluster_ip`:53 and `node_port`, with these endpoints on 5353.
fn target(service: &str, cluster_ip: &str, node_port: Option<u16>, endpoints: &[&str]) -> ConntrackTarget {
    ConntrackTarget {
        name: port_name(service),
        family: IpFamily::of(&ip(cluster_ip)),
        protocol: L4Proto::Udp,
        destinations: vec![(ip(cluster_ip), 53), (ip("203.0.113.5"), 53)],
        node_port,
        endpoints: endpoints.iter().map(|e| (ip(e), 5353)).collect(),
    }
}

fn node_ips() -> HashSet<IpAddr> {
    [ip(NODE_IP)].into_iter().collect()
}

fn flows_of(stale: Vec<StaleFlow<'_>>) -> Vec<Flow> {
    stale.into_iter().map(|s| s.flow).collect()
}

#[test]
fn only_flows_of_a_service_to_a_non_serving_endpoint_are_stale() {
    let t = target("dns", "10.96.0.10", Some(30053), &["10.244.2.10"]);
    let flows = vec![
        flow("10.96.0.10:53", "10.244.2.10:5353"),        // serving endpoint: kept
        flow("10.96.0.10:53", "10.244.1.11:5353"),        // gone endpoint: stale
        flow("203.0.113.5:53", "10.244.1.11:5353"),       // LB IP, gone endpoint: stale
        flow("192.168.50.2:30053", "10.244.1.11:5353"),   // NodePort, gone endpoint: stale
        flow("10.96.0.10:53", "10.96.0.10:53"),           // sent before the rules existed (not DNATed): stale
        flow("10.96.0.99:53", "10.244.1.11:5353"),        // not a service: kept
        flow("10.96.0.10:54", "10.244.1.11:5353"),        // another port: kept
        flow("198.51.100.1:30053", "198.51.100.1:30053"), // the NodePort's number on another host: kept
        flow("192.168.50.2:30053", "10.244.2.10:5353"),   // NodePort, serving endpoint: kept
    ];
    let stale = stale_flows(&flows, &[&t], &[], &node_ips());
    assert!(stale.iter().all(|s| *s.port == t.name));
    assert_eq!(flows_of(stale), vec![flows[1], flows[2], flows[3], flows[4]]);
    let mut tcp = flows[1];
    tcp.protocol = 6;
    assert!(stale_flows(&[tcp], &[&t], &[], &node_ips()).is_empty(), "other protocols are left alone");
}

#[test]
fn a_port_without_serving_endpoints_loses_every_flow_to_its_frontends() {
    let t = target("dns", "10.96.0.10", Some(30053), &[]);
    let flows = vec![
        flow("10.96.0.10:53", "10.244.2.10:5353"),
        flow("203.0.113.5:53", "10.244.2.10:5353"),
        flow("192.168.50.2:30053", "10.244.2.10:5353"),
        flow("198.51.100.1:30053", "198.51.100.1:30053"),
    ];
    assert_eq!(flows_of(stale_flows(&flows, &[&t], &[], &node_ips())), flows[..3].to_vec());
}

#[test]
fn a_deleted_port_loses_its_flows_unless_a_current_port_took_its_frontend_over() {
    let gone = target("old", "10.96.0.10", Some(30053), &["10.244.2.10"]);
    let flows = vec![
        flow("10.96.0.10:53", "10.244.2.10:5353"),
        flow("192.168.50.2:30053", "10.244.2.10:5353"),
        flow("10.96.0.11:53", "10.244.3.10:5353"),
    ];
    assert_eq!(flows_of(stale_flows(&flows, &[], &[&gone], &node_ips())), flows[..2].to_vec());
    // A new service on the same ClusterIP and NodePort: its own endpoints decide.
    let new = target("new", "10.96.0.10", Some(30053), &["10.244.2.10"]);
    assert!(stale_flows(&flows, &[&new], &[&gone], &node_ips()).is_empty());
}

/// A conntrack table in memory.
#[derive(Default)]
struct FakeTable {
    flows: BTreeMap<IpFamily, Vec<Flow>>,
    lists: usize,
    fail_list: bool,
}

impl FlowTable for FakeTable {
    fn flows(&mut self, family: IpFamily, keep: &dyn Fn(&Flow) -> bool) -> Result<Vec<Flow>, NetlinkError> {
        self.lists += 1;
        if self.fail_list {
            return Err(NetlinkError::Dump(std::io::Error::from_raw_os_error(libc::ENOBUFS)));
        }
        Ok(self.flows.get(&family).into_iter().flatten().filter(|f| keep(f)).copied().collect())
    }

    fn delete(&mut self, family: IpFamily, flows: &[Flow]) -> Result<usize, NetlinkError> {
        let table = self.flows.entry(family).or_default();
        let before = table.len();
        table.retain(|f| !flows.iter().any(|d| d.original == f.original && d.protocol == f.protocol));
        Ok(before - table.len())
    }
}

/// What a full sync hands the reconciler.
fn all(targets: &[ConntrackTarget]) -> ConntrackUpdate {
    ConntrackUpdate::All(targets.to_vec())
}

fn nodeports() -> NodePortTargets {
    NodePortTargets::new(NodePorts::Addresses(vec![ip(NODE_IP)]), NodePorts::Addresses(vec![]))
}

/// A state holding Service default/<name> with a UDP port `dns` on `cluster_ip`.
fn state_with(name: &str, cluster_ip: &str) -> ClusterState {
    let yaml = format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  clusterIP: {cluster_ip}
  ports:
  - {{name: dns, port: 53, protocol: UDP}}
"#
    );
    let mut m = crate::source::manifests::Manifests::default();
    crate::source::manifests::load_text(std::path::Path::new("t.yaml"), &yaml, &mut m);
    m.into_state("node1").0
}

#[test]
fn passes_run_when_ports_change_and_remember_deleted_ones() {
    let mut table = FakeTable::default();
    let to_web3 = flow("10.96.0.10:53", "10.244.2.10:5353");
    let to_web1 = Flow { original: Tuple { src: "10.244.1.99:6000".parse().unwrap(), ..to_web3.original }, ..to_web3 };
    let np = flow("192.168.50.2:30053", "10.244.2.10:5353");
    table.flows.insert(IpFamily::V4, vec![to_web3, to_web1, np]);
    let mut r = Reconciler::default();
    let state = state_with("dns", "10.96.0.10");
    let both = [target("dns", "10.96.0.10", Some(30053), &["10.244.2.10"])];

    // The first pass checks every flow (a restart): all three are to a serving endpoint.
    let passes = r.reconcile(&mut table, &all(&both), &nodeports(), &state);
    assert_eq!(passes.iter().map(|p| (p.family, p.deleted)).collect::<Vec<_>>(), vec![(IpFamily::V4, 0)]);
    assert_eq!(table.lists, 1, "IPv6 has no ports: not listed");
    // Nothing changed: no pass, no dump.
    assert!(r.reconcile(&mut table, &all(&both), &nodeports(), &state).is_empty());
    assert_eq!(table.lists, 1);

    // The service is deleted: every flow to its ClusterIP and NodePort goes.
    let passes = r.reconcile(&mut table, &all(&[]), &nodeports(), &ClusterState::default());
    assert_eq!(passes.iter().map(|p| p.deleted).sum::<usize>(), 3);
    assert!(table.flows[&IpFamily::V4].is_empty());
    // And it is forgotten: the next sync has nothing to do.
    assert!(r.reconcile(&mut table, &all(&[]), &nodeports(), &ClusterState::default()).is_empty());
}

#[test]
fn a_port_missing_from_the_sync_but_still_in_the_cluster_keeps_its_flows() {
    // The kernel refused the service: it is not programmed, but it was not deleted either.
    let mut table = FakeTable::default();
    let f = flow("10.96.0.10:53", "10.244.2.10:5353");
    table.flows.insert(IpFamily::V4, vec![f]);
    let mut r = Reconciler::default();
    let state = state_with("dns", "10.96.0.10");
    r.reconcile(&mut table, &all(&[target("dns", "10.96.0.10", None, &["10.244.2.10"])]), &nodeports(), &state);
    r.reconcile(&mut table, &all(&[]), &nodeports(), &state);
    assert_eq!(table.flows[&IpFamily::V4], vec![f]);
}

#[test]
fn a_failed_listing_is_not_a_pass_and_is_tried_again() {
    let mut table = FakeTable { fail_list: true, ..Default::default() };
    table.flows.insert(IpFamily::V4, vec![flow("10.96.0.10:53", "10.244.1.11:5353")]);
    let mut r = Reconciler::default();
    let state = state_with("dns", "10.96.0.10");
    let t = [target("dns", "10.96.0.10", None, &["10.244.2.10"])];
    assert!(r.reconcile(&mut table, &all(&t), &nodeports(), &state).is_empty(), "no metrics without a listing");
    table.fail_list = false;
    let passes = r.reconcile(&mut table, &all(&t), &nodeports(), &state);
    assert_eq!(passes.iter().map(|p| p.deleted).collect::<Vec<_>>(), vec![1]);
}

#[test]
fn after_a_partial_sync_only_the_changed_ports_flows_are_checked() {
    let mut table = FakeTable::default();
    let dns = target("dns", "10.96.0.10", None, &["10.244.2.10"]);
    let other = target("other", "10.96.0.11", None, &["10.244.3.10"]);
    let state = state_with("dns", "10.96.0.10");
    let mut r = Reconciler::default();
    r.reconcile(&mut table, &all(&[dns.clone(), other.clone()]), &nodeports(), &state);
    // A flow to `other`'s gone endpoint appears (only a stale rule could make one); a partial
    // sync that changes `dns` alone does not look at it, and removes dns's stale flow.
    let to_other = flow("10.96.0.11:53", "10.244.9.9:5353");
    let to_dns = flow("10.96.0.10:53", "10.244.2.10:5353");
    table.flows.insert(IpFamily::V4, vec![to_other, to_dns]);
    let moved = target("dns", "10.96.0.10", None, &["10.244.2.11"]);
    let update = ConntrackUpdate::Changed { before: vec![dns.clone()], after: vec![moved.clone()] };
    let passes = r.reconcile(&mut table, &update, &nodeports(), &state);
    assert_eq!(passes.iter().map(|p| p.deleted).sum::<usize>(), 1);
    assert_eq!(table.flows[&IpFamily::V4], vec![to_other]);
    // A partial sync that changed no UDP port: no pass, no dump.
    let lists = table.lists;
    assert!(r.reconcile(&mut table, &ConntrackUpdate::none(), &nodeports(), &state).is_empty());
    assert_eq!(table.lists, lists);
    // `other` deleted by a partial sync: its flows go.
    let update = ConntrackUpdate::Changed { before: vec![other], after: vec![] };
    let passes = r.reconcile(&mut table, &update, &nodeports(), &state);
    assert_eq!(passes.iter().map(|p| p.deleted).sum::<usize>(), 1);
    assert!(table.flows[&IpFamily::V4].is_empty());
    // A full sync with what the reconciler already follows: nothing to do.
    assert!(r.reconcile(&mut table, &all(&[moved]), &nodeports(), &state).is_empty());
}

/// A TCP flow from a pod to `orig_dst`, answered from `reply_src`, `replied` or not.
fn tcp_flow(orig_dst: &str, reply_src: &str, replied: bool) -> Flow {
    Flow { protocol: 6, replied, ..flow(orig_dst, reply_src) }
}

/// A state holding Service default/web: `http` 80/TCP on 10.96.0.40 and the external IP
/// 203.0.113.40, and `dns` 53/UDP.
fn tcp_state() -> ClusterState {
    let yaml = r#"apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.40
  externalIPs: [203.0.113.40]
  ports:
  - {name: http, port: 80, protocol: TCP}
  - {name: dns, port: 53, protocol: UDP}
"#;
    let mut m = crate::source::manifests::Manifests::default();
    crate::source::manifests::load_text(std::path::Path::new("t.yaml"), yaml, &mut m);
    m.into_state("node1").0
}

#[test]
fn only_tcp_flows_to_a_frontend_never_answered_and_never_dnated_go() {
    let state = tcp_state();
    let frontends = tcp_frontends(&state, IpFamily::V4);
    let mut keys: Vec<String> = frontends.keys().map(|a| a.to_string()).collect();
    keys.sort();
    assert_eq!(keys, ["10.96.0.40:80", "203.0.113.40:80"], "TCP ports only, every frontend address");
    let gone =
        [tcp_flow("10.96.0.40:80", "10.96.0.40:80", false), tcp_flow("203.0.113.40:80", "203.0.113.40:80", false)];
    let kept = [
        // DNATed: its SYN reached the rules.
        tcp_flow("10.96.0.40:80", "10.244.1.10:8080", false),
        // Answered: something at that address talks back (an ipMode Proxy load balancer).
        tcp_flow("10.96.0.40:80", "10.96.0.40:80", true),
        // Not a frontend: another port, an address no service has, a UDP flow.
        tcp_flow("10.96.0.40:443", "10.96.0.40:443", false),
        tcp_flow("10.96.0.99:80", "10.96.0.99:80", false),
        flow("10.96.0.40:80", "10.96.0.40:80"),
    ];
    let flows: Vec<Flow> = gone.iter().chain(&kept).copied().collect();
    assert_eq!(flows_of(never_dnated(&flows, &frontends)), gone.to_vec());
}

#[test]
fn never_dnated_tcp_flows_are_looked_for_at_start_up_only() {
    let mut table = FakeTable::default();
    let before_rules = tcp_flow("10.96.0.40:80", "10.96.0.40:80", false);
    let dnated = tcp_flow("10.96.0.40:80", "10.244.1.10:8080", true);
    let dnated = Flow { original: Tuple { src: "10.244.1.11:5000".parse().unwrap(), ..dnated.original }, ..dnated };
    table.flows.insert(IpFamily::V4, vec![before_rules, dnated]);
    let mut r = Reconciler::default();
    let state = tcp_state();

    // Start-up: no UDP port to check, but the TCP flows are listed and the one never DNATed goes.
    let passes = r.reconcile(&mut table, &all(&[]), &nodeports(), &state);
    assert_eq!(passes.iter().map(|p| (p.family, p.deleted)).collect::<Vec<_>>(), vec![(IpFamily::V4, 1)]);
    assert_eq!(table.flows[&IpFamily::V4], vec![dnated]);

    // Later syncs do not list TCP flows again: one sent now met the rules.
    table.flows.get_mut(&IpFamily::V4).unwrap().push(before_rules);
    assert!(r.reconcile(&mut table, &all(&[]), &nodeports(), &state).is_empty());
    assert_eq!(table.lists, 1);
}
