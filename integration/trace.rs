//! `nftproxy trace` with real packets in the lab: connections to a ClusterIP from outside the
//! cluster and from the node, a rejected connection, and a trace killed with SIGKILL, whose
//! table the kernel removes.

use std::io::Read;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use nftproxy::net::L4Proto;

/// `nftproxy trace <args>` started in node1, its output piped.
fn start_trace(lab: &ClusterLab, args: &[&str]) -> Child {
    let child = lab
        .lab
        .node("node1")
        .ns
        .command(env!("CARGO_BIN_EXE_nftproxy"))
        .arg("trace")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // It is ready once its table is in the kernel.
    assert!(
        lab.eventually(Duration::from_secs(10), || trace_tables(lab).len() == 1),
        "no trace table appeared:\n{}",
        lab.listing()
    );
    child
}

/// The trace tables in node1.
fn trace_tables(lab: &ClusterLab) -> Vec<String> {
    let out = lab.lab.node("node1").ns.exec("nft", &["list", "tables"]).unwrap();
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains("nftproxy-trace-")).map(str::to_string).collect()
}

/// Waits for the trace to exit; returns its exit success, stdout and stderr.
fn finish(mut child: Child) -> (bool, String, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("nftproxy trace did not exit");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status.success(), out, err)
}

/// Each packet's text, split at `packet N:` lines.
fn packets(out: &str) -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    for line in out.lines() {
        if line.starts_with("packet ") {
            all.push(String::new());
        }
        if let Some(p) = all.last_mut() {
            p.push_str(line);
            p.push('\n');
        }
    }
    all
}

fn pod_ip(name: &str) -> &'static str {
    match name {
        "web-1" => WEB_1.0,
        "web-2" => WEB_2.0,
        "web-3" => WEB_3.0,
        other => panic!("unknown pod {other}"),
    }
}

#[test]
fn a_traced_connection_shows_the_service_the_endpoint_and_the_verdict() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let manifests = lab.write("cluster.yaml", &web_manifests(&[WEB_1, WEB_3]));
    // A running proxy owns its tables: trace reads them all the same.
    let _proxy = lab.run_proxy(&manifests, &[]);
    let child = start_trace(&lab, &["--dst", "10.96.0.10:80", "--proto", "tcp", "--count", "3", "--timeout", "20s"]);
    let mut backends = Vec::new();
    for who in ["client", "client", "node1"] {
        backends.push(lab.ask(who, L4Proto::Tcp, "10.96.0.10:80").expect("the service answers").backend);
    }
    // A fourth connection is past --count: not traced.
    lab.ask("client", L4Proto::Tcp, "10.96.0.10:80").unwrap();
    let (ok, out, err) = finish(child);
    assert!(ok, "trace failed: {err}\n{out}");
    assert!(err.contains("traced 3 packet(s)"), "{err}");
    let packets = packets(&out);
    assert_eq!(packets.len(), 3, "{out}");
    for (i, (p, backend)) in packets.iter().zip(&backends).enumerate() {
        let from_node = i == 2;
        let first = p.lines().next().unwrap();
        assert!(first.starts_with(&format!("packet {}: tcp ", i + 1)), "{p}");
        assert!(first.contains("-> 10.96.0.10:80 [SYN]"), "{p}");
        let hook = if from_node { ", at output" } else { ", at prerouting" };
        assert!(first.contains(hook), "{p}");
        if !from_node {
            assert!(first.contains("192.168.50.100:") && first.contains(", in eth0"), "{p}");
        }
        assert!(
            p.contains(
                "  service   default/web:http (ClusterIP 10.96.0.10:80, in balanced-service-ips, service-endpoints-2)"
            ),
            "{p}"
        );
        let nat = if from_node {
            "  at output, ip nftproxy nat-output (priority -100)\n"
        } else {
            "  at prerouting, ip nftproxy nat-prerouting (priority -100)\n"
        };
        assert!(p.contains(nat), "{p}");
        assert!(p.contains(": jump services\n") && p.contains("      services "), "{p}");
        assert!(p.contains("      balance-service      rule ") && p.contains(": accept (nat)\n"), "{p}");
        // The endpoint the trace names is the pod that answered.
        let endpoint = format!("{}:8080", pod_ip(backend));
        let postrouting = format!(
            "  at postrouting, ip nftproxy nat-postrouting (priority 100), now tcp {}",
            if from_node { "" } else { "192.168.50.100:" }
        );
        assert!(p.contains(&postrouting) && p.contains(&format!(" -> {endpoint} [SYN]\n")), "{p}");
        assert!(p.contains(&format!("  endpoint  {endpoint} (default/web:http)")), "{backend}: {p}");
        assert!(p.contains(&format!("verdict   accept, forwarded to {endpoint}")), "{p}");
        if !from_node {
            assert!(p.contains("masqueraded"), "a client outside the cluster is masqueraded: {p}");
        }
    }
    assert!(trace_tables(&lab).is_empty(), "the trace table is gone:\n{}", lab.listing());
}

#[test]
fn a_connection_to_a_service_without_endpoints_is_traced_to_its_reject() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&web_manifests(&[WEB_1]));
    let child = start_trace(&lab, &["--dst", "10.96.0.20:80", "--count", "1", "--timeout", "20s"]);
    let err = lab.ask("client", L4Proto::Tcp, "10.96.0.20:80").expect_err("no endpoints");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    let (ok, out, err) = finish(child);
    assert!(ok, "{err}");
    assert!(out.contains("  service   default/empty:http (ClusterIP 10.96.0.20:80, in no-endpoint-services)"), "{out}");
    assert!(out.contains("verdict   rejected by ip nftproxy reject-chain rule "), "{out}");
    assert!(!out.contains("  endpoint  "), "{out}");
}

#[test]
fn a_trace_killed_with_sigkill_leaves_nothing_behind() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&web_manifests(&[WEB_1]));
    let node = &lab.lab.node("node1").ns;
    node.exec("nft", &["add", "table", "inet", "firewall"]).unwrap();
    let before = lab.listing();
    let mut child = start_trace(&lab, &["--timeout", "60s"]);
    let table = trace_tables(&lab).pop().unwrap();
    let name = table.split_whitespace().last().unwrap().to_string();
    // Owned: no other process may change or delete it while the trace runs.
    let listing = lab.listing();
    assert!(listing.contains("flags owner"), "{listing}");
    assert!(node.exec("nft", &["delete", "table", "inet", &name]).is_err(), "another process deleted the trace table");
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        lab.eventually(Duration::from_secs(2), || trace_tables(&lab).is_empty()),
        "the kernel kept the trace table after SIGKILL:\n{}",
        lab.listing()
    );
    assert_eq!(lab.listing(), before, "everything else is as it was");
}

#[test]
fn a_trace_that_matches_nothing_fails_after_its_timeout() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&web_manifests(&[WEB_1]));
    let out = lab.nftproxy(&["trace", "--dst", "10.96.0.10:80", "--timeout", "1s"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no packet matched within 1s"), "{stderr}");
    assert!(trace_tables(&lab).is_empty());
    let bad = lab.nftproxy(&["trace", "--dst", "10.96.0.10:80", "--proto", "icmp"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("a port needs tcp, udp or sctp"));
}

#[test]
fn ipv6_clusterip_and_nodeport_are_named_too() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let yaml = r#"apiVersion: v1
kind: Service
metadata: {name: web6, namespace: default}
spec:
  type: NodePort
  ipFamilies: [IPv6]
  clusterIP: fd00:96::10
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web6-v6, namespace: default, labels: {kubernetes.io/service-name: web6}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["fd00:10:244:1::a"], nodeName: node1}
- {addresses: ["fd00:10:244:2::a"], nodeName: node2}
---
apiVersion: v1
kind: Node
metadata: {name: node1}
status:
  addresses: [{type: InternalIP, address: 192.168.50.2}, {type: InternalIP, address: "fd00:50::2"}]
"#;
    lab.sync_with(yaml, &["--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56"]);
    // The lab's first IPv6 connection can time out while neighbours are resolved.
    for target in ["[fd00:96::10]:80", "[fd00:50::2]:30080"] {
        assert!(
            lab.eventually(Duration::from_secs(10), || lab.ask("client", L4Proto::Tcp, target).is_ok()),
            "{target}"
        );
    }
    let child = start_trace(&lab, &["--src", "fd00:50::100", "--proto", "tcp", "--count", "2", "--timeout", "20s"]);
    let mut backends = Vec::new();
    for target in ["[fd00:96::10]:80", "[fd00:50::2]:30080"] {
        backends.push(lab.ask("client", L4Proto::Tcp, target).expect("the service answers").backend);
    }
    let (ok, out, err) = finish(child);
    assert!(ok, "{err}\n{out}");
    let packets = packets(&out);
    assert_eq!(packets.len(), 2, "{out}");
    let ip6 = |pod: &str| if pod == "web-1" { "[fd00:10:244:1::a]:8080" } else { "[fd00:10:244:2::a]:8080" };
    assert!(packets[0].contains("-> [fd00:96::10]:80 [SYN]"), "{out}");
    assert!(
        packets[0].contains(
            "  service   default/web6:http (ClusterIP [fd00:96::10]:80, in balanced-service-ips, service-endpoints-2)"
        ),
        "{out}"
    );
    assert!(packets[0].contains("at prerouting, ip6 nftproxy nat-prerouting (priority -100)"), "{out}");
    assert!(
        packets[1].contains(
            "  service   default/web6:http (NodePort [fd00:50::2]:30080, in balanced-nodeports, nodeport-endpoints-2)"
        ),
        "{out}"
    );
    for (p, backend) in packets.iter().zip(&backends) {
        assert!(p.contains(&format!("  endpoint  {} (default/web6:http)", ip6(backend))), "{backend}: {p}");
        assert!(p.contains(&format!("verdict   accept, forwarded to {}", ip6(backend))), "{p}");
    }
}
