//! NodePort, LoadBalancer and ExternalIP traffic with real packets: who answers, and which
//! source address the backend sees.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::common::*;
use nftproxy::net::L4Proto;

const NODE: &str = "192.168.50.2";

fn sources(t: &nftproxy_tools::lab::traffic::Tally) -> BTreeSet<String> {
    t.sources.keys().map(|s| s.to_string()).collect()
}

/// The addresses node1 masquerades to: its bridge (local pods) or its wan address (node2).
fn masqueraded(t: &nftproxy_tools::lab::traffic::Tally) -> bool {
    sources(t).iter().all(|s| s == "10.244.1.1" || s == NODE)
}

#[test]
fn nodeport_with_cluster_policy_reaches_any_endpoint_masqueraded() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&services_yaml(&[Svc {
        name: "web",
        cluster_ip: "10.96.0.10",
        kind: "NodePort",
        node_port: Some(30080),
        endpoints: &[WEB_1, WEB_3],
        ..Default::default()
    }]));
    let t = lab.tally("client", L4Proto::Tcp, "192.168.50.2:30080", 80);
    assert_eq!(t.failed(), 0, "{t:?}");
    assert_eq!(backends(&t), set(&["web-1", "web-3"]), "{t:?}");
    assert!(masqueraded(&t), "{t:?}");
    let u = lab.tally("client", L4Proto::Udp, "192.168.50.2:30081", 80);
    assert_eq!(backends(&u), set(&["web-1", "web-3"]), "{u:?}");
    assert!(masqueraded(&u), "{u:?}");
}

#[test]
fn nodeport_with_local_policy_keeps_the_client_ip_and_stays_on_the_node() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let svc = |endpoints| Svc {
        name: "web",
        cluster_ip: "10.96.0.10",
        kind: "NodePort",
        node_port: Some(30080),
        external_local: true,
        endpoints,
        ..Default::default()
    };
    lab.sync(&services_yaml(&[svc(&[WEB_1, WEB_2, WEB_3])]));
    let t = lab.tally("client", L4Proto::Tcp, "192.168.50.2:30080", 80);
    assert_eq!(t.failed(), 0);
    assert_eq!(backends(&t), set(&["web-1", "web-2"]), "only node1's endpoints: {t:?}");
    assert_eq!(sources(&t), set(&["192.168.50.100"]), "client IP preserved: {t:?}");
    let u = lab.tally("client", L4Proto::Udp, "192.168.50.2:30081", 60);
    assert_eq!(sources(&u), set(&["192.168.50.100"]), "{u:?}");

    // No local endpoint: external traffic is dropped (no answer) …
    lab.sync(&services_yaml(&[svc(&[WEB_3])]));
    let err = lab.ask("client", L4Proto::Tcp, "192.168.50.2:30080").expect_err("dropped");
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    // … while the ClusterIP still reaches the remote endpoint.
    assert_eq!(lab.ask("client", L4Proto::Tcp, "10.96.0.10:80").unwrap().backend, "web-3");
}

#[test]
fn load_balancer_ips_with_and_without_source_ranges() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&services_yaml(&[
        Svc {
            name: "open",
            cluster_ip: "10.96.0.10",
            kind: "LoadBalancer",
            node_port: Some(30080),
            lb_ips: &["203.0.113.10"],
            endpoints: &[WEB_1, WEB_3],
            ..Default::default()
        },
        Svc {
            name: "guarded",
            cluster_ip: "10.96.0.11",
            kind: "LoadBalancer",
            node_port: Some(30090),
            lb_ips: &["203.0.113.11"],
            source_ranges: &["192.168.50.100/32", " 10.9.0.0/16"],
            endpoints: &[WEB_2],
            ..Default::default()
        },
    ]));
    for client in ["client", "client2"] {
        let t = lab.tally(client, L4Proto::Tcp, "203.0.113.10:80", 40);
        assert_eq!(t.failed(), 0, "{client}: {t:?}");
        assert_eq!(backends(&t), set(&["web-1", "web-3"]));
        assert!(masqueraded(&t), "{t:?}");
    }
    let allowed = lab.tally("client", L4Proto::Tcp, "203.0.113.11:80", 20);
    assert_eq!(backends(&allowed), set(&["web-2"]), "{allowed:?}");
    let err = lab.ask("client2", L4Proto::Tcp, "203.0.113.11:80").expect_err("outside the source ranges");
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "dropped, not rejected: {err}");
    let err = lab.ask("client2", L4Proto::Udp, "203.0.113.11:53").expect_err("outside the source ranges");
    assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock, "{err}");
    // The source ranges guard the LB IP only; the NodePort stays open (as upstream).
    assert!(lab.ask("client2", L4Proto::Tcp, "192.168.50.2:30090").is_ok());
}

#[test]
fn external_ips_are_served() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&services_yaml(&[Svc {
        name: "ext",
        cluster_ip: "10.96.0.10",
        external_ips: &["203.0.113.20"],
        endpoints: &[WEB_1, WEB_3],
        ..Default::default()
    }]));
    let t = lab.tally("client", L4Proto::Tcp, "203.0.113.20:80", 60);
    assert_eq!(t.failed(), 0, "{t:?}");
    assert_eq!(backends(&t), set(&["web-1", "web-3"]));
    assert!(masqueraded(&t), "{t:?}");
    let u = lab.tally("client", L4Proto::Udp, "203.0.113.20:53", 30);
    assert_eq!(u.failed(), 0, "{u:?}");
}

#[test]
fn pods_and_the_node_reach_a_local_policy_lb_ip_with_only_remote_endpoints() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&services_yaml(&[Svc {
        name: "lb",
        cluster_ip: "10.96.0.10",
        kind: "LoadBalancer",
        node_port: Some(30080),
        external_local: true,
        lb_ips: &["203.0.113.12"],
        external_ips: &["203.0.113.21"],
        endpoints: &[WEB_3],
        ..Default::default()
    }]));
    // From outside: no local endpoint, dropped.
    assert!(lab.ask("client", L4Proto::Tcp, "203.0.113.12:80").is_err());
    // A pod on the node is short-circuited to the cluster-wide endpoints, keeping its source.
    let t = lab.tally("web-1", L4Proto::Tcp, "203.0.113.12:80", 10);
    assert_eq!(backends(&t), set(&["web-3"]), "{t:?}");
    assert_eq!(sources(&t), set(&["10.244.1.10"]), "{t:?}");
    let t = lab.tally("web-1", L4Proto::Tcp, "203.0.113.21:80", 10);
    assert_eq!(backends(&t), set(&["web-3"]), "ExternalIP too: {t:?}");
    // The node itself too, masqueraded.
    let t = lab.tally("node1", L4Proto::Tcp, "203.0.113.12:80", 10);
    assert_eq!(backends(&t), set(&["web-3"]), "{t:?}");
    assert_eq!(sources(&t), set(&[NODE]), "{t:?}");
}

#[test]
fn nodeports_only_on_nodeport_addresses() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let yaml = services_yaml(&[Svc {
        name: "web",
        cluster_ip: "10.96.0.10",
        kind: "NodePort",
        node_port: Some(30080),
        endpoints: &[WEB_2],
        ..Default::default()
    }]);
    // Default `primary`: the Node's InternalIP (192.168.50.2) only, not the bridge address.
    lab.sync(&yaml);
    assert_eq!(lab.ask("web-1", L4Proto::Tcp, "192.168.50.2:30080").unwrap().backend, "web-2");
    let err = lab.ask("web-1", L4Proto::Tcp, "10.244.1.1:30080").expect_err("not a node-port address");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "nothing listens there: {err}");
    // Loopback is never served.
    let err = lab.ask("node1", L4Proto::Tcp, "127.0.0.1:30080").expect_err("no NodePorts on loopback");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    // An explicit range that includes the bridge address.
    lab.sync_with(&yaml, &["--nodeport-addresses", "10.244.1.0/24"]);
    assert_eq!(lab.ask("web-1", L4Proto::Tcp, "10.244.1.1:30080").unwrap().backend, "web-2");
    assert!(lab.ask("client", L4Proto::Tcp, "192.168.50.2:30080").is_err(), "no longer on the wan address");
    // 0.0.0.0/0: every local address except loopback.
    lab.sync_with(&yaml, &["--nodeport-addresses", "0.0.0.0/0"]);
    assert!(lab.ask("client", L4Proto::Tcp, "192.168.50.2:30080").is_ok());
    assert!(lab.ask("web-1", L4Proto::Tcp, "10.244.1.1:30080").is_ok());
    assert!(lab.ask("node1", L4Proto::Tcp, "127.0.0.1:30080").is_err());
}

#[test]
fn health_check_node_port_follows_local_endpoints() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let dir = lab.dir.path().join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    let write = |endpoints: &[Ep<'_>]| {
        let yaml = services_yaml(&[Svc {
            name: "lb",
            cluster_ip: "10.96.0.10",
            kind: "LoadBalancer",
            node_port: Some(30080),
            external_local: true,
            health_check_port: Some(30999),
            lb_ips: &["203.0.113.12"],
            endpoints,
            ..Default::default()
        }]);
        rewrite(&dir.join("cluster.yaml"), &yaml);
    };
    write(&[WEB_1, WEB_2, WEB_3]);
    let _proxy = lab.run_proxy(&dir, &[]);
    // The health-check server opens after the sync that planned it.
    let serving = lab.eventually(Duration::from_secs(3), || lab.http_get("client", "192.168.50.2:30999", "/").is_ok());
    assert!(serving, "health-check server never answered:\n{}", lab.proxy_log());
    let (status, body) = lab.http_get("client", "192.168.50.2:30999", "/").unwrap();
    assert_eq!(status, 200, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["localEndpoints"], 2);
    assert_eq!(json["service"]["namespace"], "default");
    assert_eq!(json["service"]["name"], "lb");
    assert_eq!(json["serviceProxyHealthy"], true);
    assert_eq!(sources(&lab.tally("client", L4Proto::Tcp, "203.0.113.12:80", 20)), set(&["192.168.50.100"]));

    write(&[WEB_3]);
    let unhealthy = lab.eventually(Duration::from_secs(3), || {
        matches!(lab.http_get("client", "192.168.50.2:30999", "/healthz"), Ok((503, _)))
    });
    assert!(unhealthy, "503 once no endpoint is local");
    let (_, body) = lab.http_get("client", "192.168.50.2:30999", "/").unwrap();
    assert_eq!(serde_json::from_str::<serde_json::Value>(&body).unwrap()["localEndpoints"], 0);

    // The service goes away: so does its server.
    rewrite(&dir.join("cluster.yaml"), &services_yaml(&[]));
    let closed = lab.eventually(Duration::from_secs(3), || lab.http_get("client", "192.168.50.2:30999", "/").is_err());
    assert!(closed, "health-check server closed with its service");
}
