//! ClusterIP services with real packets in network namespaces (see `common` for the lab).

use std::time::{Duration, Instant};

use crate::common::*;
use nftproxy::net::L4Proto;
use nftproxy::nft::canonical::canonicalize;

const WEB_TCP: &str = "10.96.0.10:80";
const WEB_UDP: &str = "10.96.0.10:53";

fn assert_fair(t: &nftproxy_tools::lab::traffic::Tally, backends: &[&str], what: &str) {
    assert_eq!(t.failed(), 0, "{what}: failures {:?}", t.errors);
    let total = t.answered();
    for b in backends {
        let n = t.by_backend.get(*b).copied().unwrap_or(0);
        // With 3 backends and ≥ 200 requests, each share is far above 15% unless balancing is broken.
        assert!(n * 100 >= total * 15, "{what}: {b} got {n} of {total}: {:?}", t.by_backend);
    }
    assert_eq!(t.by_backend.len(), backends.len(), "{what}: unexpected backends {:?}", t.by_backend);
}

#[test]
fn tcp_and_udp_reach_every_ready_endpoint() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    // web-2 is not ready: it must never be used while ready endpoints exist.
    let out = lab.sync(&web_manifests(&[WEB_1, ("10.244.1.11", "node1", false), WEB_3]));
    assert!(out.starts_with("synced 2 services (4 ports, 4 endpoints)"), "{out}");
    let all = ["web-1", "web-3"];
    assert_fair(&lab.tally("client", L4Proto::Tcp, WEB_TCP, 200), &all, "tcp from client");
    assert_fair(&lab.tally("client", L4Proto::Udp, WEB_UDP, 200), &all, "udp from client");

    lab.sync(&web_manifests(&[WEB_1, WEB_2, WEB_3]));
    let three = ["web-1", "web-2", "web-3"];
    assert_fair(&lab.tally("client", L4Proto::Tcp, WEB_TCP, 300), &three, "tcp, three endpoints");
    assert_fair(&lab.tally("client", L4Proto::Udp, WEB_UDP, 300), &three, "udp, three endpoints");
}

#[test]
fn a_removed_endpoint_is_no_longer_used() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&web_manifests(&[WEB_1, WEB_2, WEB_3]));
    assert_eq!(lab.tally("client", L4Proto::Tcp, WEB_TCP, 60).by_backend.len(), 3);
    lab.sync(&web_manifests(&[WEB_1, WEB_3]));
    let t = lab.tally("client", L4Proto::Tcp, WEB_TCP, 150);
    assert!(!t.by_backend.contains_key("web-2"), "{:?}", t.by_backend);
    assert_eq!(t.failed(), 0);
    let u = lab.tally("client", L4Proto::Udp, WEB_UDP, 150);
    assert!(!u.by_backend.contains_key("web-2"), "{:?}", u.by_backend);
}

#[test]
fn a_service_without_endpoints_is_refused_at_once() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&web_manifests(&[WEB_1]));
    for who in ["client", "web-2", "node1"] {
        let started = Instant::now();
        let err = lab.ask(who, L4Proto::Tcp, "10.96.0.20:80").expect_err("no endpoints");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{who}: {err}");
        // At once: well under the 1 s SYN retransmission a dropped SYN would wait for.
        assert!(started.elapsed() < Duration::from_millis(900), "{who}: took {:?}", started.elapsed());
        let err = lab.ask(who, L4Proto::Udp, "10.96.0.20:53").expect_err("no endpoints");
        // The node's own UDP send is rejected in the output hook, which the kernel reports to
        // the sender as EPERM; elsewhere the ICMP error reports "connection refused".
        let fast = [std::io::ErrorKind::ConnectionRefused, std::io::ErrorKind::PermissionDenied];
        assert!(fast.contains(&err.kind()), "{who} udp: {err}");
    }
    // A port the ClusterIP does not serve is rejected too (cluster-ips-check), whether the
    // connection is forwarded (from a pod, from outside) or the node's own.
    for who in ["web-2", "client", "node1"] {
        let err = lab.ask(who, L4Proto::Tcp, "10.96.0.10:81").expect_err("unknown port");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{who}: {err}");
    }
    // Once endpoints exist, the same service answers.
    lab.sync(&web_manifests(&[WEB_1]).replace("clusterIP: 10.96.0.20", "clusterIP: 10.96.0.21"));
    assert!(lab.ask("client", L4Proto::Tcp, WEB_TCP).is_ok());
}

#[test]
fn pods_keep_their_source_and_outsiders_are_masqueraded() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&web_manifests(&[WEB_2, WEB_3]));
    // From a pod (inside --cluster-cidr): the backend sees the pod.
    let t = lab.tally("web-1", L4Proto::Tcp, WEB_TCP, 40);
    assert_eq!(t.sources.keys().map(|s| s.to_string()).collect::<Vec<_>>(), vec!["10.244.1.10"], "{t:?}");
    let t = lab.tally("web-1", L4Proto::Udp, WEB_UDP, 40);
    assert_eq!(t.sources.keys().map(|s| s.to_string()).collect::<Vec<_>>(), vec!["10.244.1.10"], "{t:?}");
    // From outside: masqueraded to the node's address towards the backend.
    let t = lab.tally("client", L4Proto::Tcp, WEB_TCP, 60);
    for source in t.sources.keys() {
        assert!(["10.244.1.1", "192.168.50.2"].contains(&source.to_string().as_str()), "{t:?}");
    }
    assert!(!t.sources.keys().any(|s| s.to_string() == "192.168.50.100"));
}

#[test]
fn a_pod_reaches_itself_through_its_service() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&web_manifests(&[WEB_1]));
    let t = lab.tally("web-1", L4Proto::Tcp, WEB_TCP, 20);
    assert_eq!(t.by_backend.get("web-1"), Some(&20), "{t:?}");
    // Hairpin traffic is masqueraded, or the pod would drop a packet from itself.
    assert_eq!(t.sources.keys().map(|s| s.to_string()).collect::<Vec<_>>(), vec!["10.244.1.1"]);
    let u = lab.tally("web-1", L4Proto::Udp, WEB_UDP, 20);
    assert_eq!(u.by_backend.get("web-1"), Some(&20), "{u:?}");
}

#[test]
fn traffic_from_the_node_itself_works() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&web_manifests(&[WEB_1, WEB_3]));
    let t = lab.tally("node1", L4Proto::Tcp, WEB_TCP, 60);
    assert_eq!(t.failed(), 0, "{t:?}");
    assert_eq!(t.by_backend.len(), 2, "{t:?}");
    let u = lab.tally("node1", L4Proto::Udp, WEB_UDP, 60);
    assert_eq!(u.failed(), 0, "{u:?}");
}

#[test]
fn sync_matches_render_and_a_second_sync_does_nothing() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let yaml = web_manifests(&[WEB_1, WEB_2, WEB_3]);
    let first = lab.sync(&yaml);
    assert!(first.contains("1 transaction"), "{first}");
    assert_eq!(canonicalize(&lab.listing()), canonicalize(&lab.render(&yaml)));
    let second = lab.sync(&yaml);
    assert!(second.contains(" 0 messages"), "an unchanged sync sends nothing: {second}");
}

#[test]
fn cleanup_deletes_only_nftproxys_tables() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&web_manifests(&[WEB_1]));
    let node = &lab.lab.node("node1").ns;
    node.exec("nft", &["add", "table", "inet", "firewall"]).unwrap();
    node.exec("nft", &["add", "chain", "inet", "firewall", "input", "{ type filter hook input priority 0; }"]).unwrap();
    let out = lab.nftproxy(&["cleanup"]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "deleted 1 nftproxy table(s)");
    let listing = lab.listing();
    assert!(!listing.contains("nftproxy"), "{listing}");
    assert!(listing.contains("table inet firewall"), "foreign table kept: {listing}");
    // Without our rules, the ClusterIP is gone.
    assert!(lab.ask("client", L4Proto::Tcp, WEB_TCP).is_err());
}

#[test]
fn malformed_objects_are_reported_and_the_rest_applies() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let yaml = format!(
        r#"{}---
apiVersion: v1
kind: Service
metadata: {{name: broken, namespace: default}}
spec: {{clusterIP: 10.96.0.300, ports: [{{port: 80}}]}}
---
apiVersion: v1
kind: Service
metadata: {{name: bad-port, namespace: default}}
spec: {{clusterIP: 10.96.0.30, ports: [{{port: "x"}}]}}
"#,
        web_manifests(&[WEB_1])
    );
    let path = lab.write("mixed.yaml", &yaml);
    let out = lab.nftproxy(&["sync", "--manifests", path.to_str().unwrap(), "--hostname-override", "node1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Service default/broken"), "{stderr}");
    assert!(stderr.contains("mixed.yaml document 4 (default/bad-port)"), "{stderr}");
    assert_eq!(lab.ask("client", L4Proto::Tcp, WEB_TCP).unwrap().backend, "web-1");
}

#[test]
fn every_detect_local_mode_tells_pods_from_outsiders() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let node = r#"---
apiVersion: v1
kind: Node
metadata: {name: node1}
spec: {podCIDRs: [10.244.1.0/24]}
"#;
    let yaml = format!("{}{node}", web_manifests(&[WEB_2]));
    let modes: [&[&str]; 3] = [
        &["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cbr0"],
        &["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "cbr"],
        &["--detect-local-mode", "NodeCIDR"],
    ];
    for flags in modes {
        let mut args = vec!["--cluster-cidr", ""];
        args.extend_from_slice(flags);
        lab.sync_with(&yaml, &args);
        let pod = lab.ask("web-1", L4Proto::Tcp, WEB_TCP).unwrap();
        assert_eq!(pod.source.to_string(), "10.244.1.10", "{flags:?}: pod source kept");
        let outside = lab.ask("client", L4Proto::Tcp, WEB_TCP).unwrap();
        assert_eq!(outside.source.to_string(), "10.244.1.1", "{flags:?}: outsider masqueraded");
    }
}
