//! `nftproxy explain` checked against real packets: for each connection, what `explain`
//! predicts from the ruleset the kernel holds (the endpoints, whether each is masqueraded, or the
//! refusal) must be what real connections from a pod, the node or an outside client meet.

use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;

use crate::common::*;
use nftproxy::net::L4Proto;

const NODE_IP: &str = "192.168.50.2";
const CLIENT_IP: &str = "192.168.50.100";
const CLIENT2_IP: &str = "192.168.50.101";
/// Connections per case: enough for every endpoint of a share ≥ 1/3 to answer.
const ASKS: usize = 30;

/// The lab's services: Cluster and Local NodePorts, an ExternalIP, load-balancer IPs with
/// source ranges and with a Local policy whose only endpoint is on node2, and no endpoints.
fn services() -> String {
    services_yaml(&[
        Svc {
            name: "web",
            cluster_ip: "10.96.0.10",
            kind: "NodePort",
            node_port: Some(30080),
            external_ips: &["203.0.113.20"],
            endpoints: &[WEB_1, WEB_3],
            ..Default::default()
        },
        Svc {
            name: "local",
            cluster_ip: "10.96.0.11",
            kind: "NodePort",
            node_port: Some(30090),
            external_local: true,
            endpoints: &[WEB_1, WEB_2, WEB_3],
            ..Default::default()
        },
        Svc {
            name: "guarded",
            cluster_ip: "10.96.0.12",
            kind: "LoadBalancer",
            node_port: Some(30100),
            lb_ips: &["203.0.113.11"],
            source_ranges: &["192.168.50.100/32"],
            endpoints: &[WEB_1, WEB_3],
            ..Default::default()
        },
        Svc {
            name: "remote",
            cluster_ip: "10.96.0.13",
            kind: "LoadBalancer",
            node_port: Some(30110),
            external_local: true,
            lb_ips: &["203.0.113.12"],
            endpoints: &[WEB_3],
            ..Default::default()
        },
        Svc { name: "empty", cluster_ip: "10.96.0.20", endpoints: &[], ..Default::default() },
    ])
}

fn pod_name(endpoint: &str) -> String {
    let ip = endpoint.rsplit_once(':').map_or(endpoint, |(ip, _)| ip);
    match ip {
        ip if ip == WEB_1.0 => "web-1",
        ip if ip == WEB_2.0 => "web-2",
        ip if ip == WEB_3.0 => "web-3",
        other => panic!("unexpected endpoint {other}"),
    }
    .to_string()
}

/// The address node1 masquerades to towards an endpoint: its bridge for its own pods.
fn masquerade_address(pod: &str) -> &'static str {
    if pod == "web-3" { NODE_IP } else { "10.244.1.1" }
}

/// What `explain` says, as (verdict, endpoint pod → masquerade, the JSON).
fn predict(
    lab: &ClusterLab,
    src: &str,
    dst: &str,
    proto: &str,
    local: bool,
) -> (String, BTreeMap<String, bool>, String) {
    let mut args = vec!["explain", "--src", src, "--dst", dst, "--proto", proto, "--output", "json"];
    if local {
        args.push("--local");
    }
    let out = lab.nftproxy(&args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "explain failed: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let verdict = json["verdict"].as_str().unwrap().to_string();
    let mut endpoints = BTreeMap::new();
    let mut total = 0.0;
    for ep in json["endpoints"].as_array().unwrap() {
        endpoints.insert(pod_name(ep["address"].as_str().unwrap()), ep["masquerade"].as_bool().unwrap());
        total += ep["share"].as_f64().unwrap();
    }
    if verdict == "dnat" {
        assert!((total - 1.0).abs() < 1e-3, "shares sum to {total}: {text}");
    }
    (verdict, endpoints, text)
}

/// Asks `target` from `who` (whose own address is `own`) and compares with `explain`'s
/// prediction for a connection from `own`.
fn check(lab: &ClusterLab, who: &str, own: &str, proto: L4Proto, target: &str) {
    let local = who == "node1";
    let (verdict, predicted, json) = predict(lab, own, target, proto.name(), local);
    let context = format!("{who} -> {target} ({}): explain says\n{json}", proto.name());
    match verdict.as_str() {
        "dnat" => {
            let mut seen: BTreeMap<String, BTreeSet<bool>> = BTreeMap::new();
            for _ in 0..ASKS {
                let answer = lab.ask(who, proto, target).unwrap_or_else(|e| panic!("{e}: {context}"));
                let masqueraded = answer.source.to_string() != own;
                seen.entry(answer.backend).or_default().insert(masqueraded);
            }
            let reached: BTreeSet<&String> = seen.keys().collect();
            assert_eq!(reached, predicted.keys().collect(), "endpoints reached: {seen:?}\n{context}");
            for (pod, masquerade) in &predicted {
                // From the node, masquerading to its own address changes nothing visible.
                if *masquerade && masquerade_address(pod) == own {
                    continue;
                }
                assert_eq!(seen[pod], BTreeSet::from([*masquerade]), "masquerade at {pod}: {seen:?}\n{context}");
            }
        }
        "reject" => {
            let err = lab.ask(who, proto, target).expect_err(&context);
            assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}: {context}");
        }
        "drop" => {
            let err = lab.ask(who, proto, target).expect_err(&context);
            assert!(matches!(err.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock), "{err}: {context}");
        }
        other => panic!("verdict {other}: {context}"),
    }
}

#[test]
fn explain_predicts_the_endpoints_and_masquerade_real_connections_meet() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync(&services());
    let (web_1, web_2) = (WEB_1.0, WEB_2.0);
    let cases: &[(&str, &str, L4Proto, &str)] = &[
        // ClusterIP from a pod, from the endpoint itself (hairpin), from outside, from the node.
        ("web-2", web_2, L4Proto::Tcp, "10.96.0.10:80"),
        ("web-1", web_1, L4Proto::Tcp, "10.96.0.10:80"),
        ("client", CLIENT_IP, L4Proto::Tcp, "10.96.0.10:80"),
        ("node1", NODE_IP, L4Proto::Tcp, "10.96.0.10:80"),
        ("web-2", web_2, L4Proto::Udp, "10.96.0.10:53"),
        // NodePort with Cluster policy, and with Local policy (node1's endpoints only).
        ("client", CLIENT_IP, L4Proto::Tcp, "192.168.50.2:30080"),
        ("client", CLIENT_IP, L4Proto::Udp, "192.168.50.2:30081"),
        ("client", CLIENT_IP, L4Proto::Tcp, "192.168.50.2:30090"),
        ("node1", NODE_IP, L4Proto::Tcp, "192.168.50.2:30090"),
        // ExternalIP.
        ("client", CLIENT_IP, L4Proto::Tcp, "203.0.113.20:80"),
        // LoadBalancer with source ranges: inside, outside.
        ("client", CLIENT_IP, L4Proto::Tcp, "203.0.113.11:80"),
        ("client2", CLIENT2_IP, L4Proto::Tcp, "203.0.113.11:80"),
        // Local policy without a local endpoint: dropped from outside, short-circuited from a
        // pod and from the node.
        ("client", CLIENT_IP, L4Proto::Tcp, "203.0.113.12:80"),
        ("web-1", web_1, L4Proto::Tcp, "203.0.113.12:80"),
        ("node1", NODE_IP, L4Proto::Tcp, "203.0.113.12:80"),
        // No endpoints: rejected.
        ("web-2", web_2, L4Proto::Tcp, "10.96.0.20:80"),
        ("client", CLIENT_IP, L4Proto::Tcp, "10.96.0.20:80"),
        // A port the ClusterIP does not serve: rejected.
        ("web-2", web_2, L4Proto::Tcp, "10.96.0.10:81"),
    ];
    for (who, own, proto, target) in cases {
        check(&lab, who, own, *proto, target);
    }
}

#[test]
fn explain_tells_the_story_and_plans_offline_alike() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let yaml = services();
    // A running proxy owns its tables: explain reads them all the same.
    let manifests = lab.write("cluster.yaml", &yaml);
    let _proxy = lab.run_proxy(&manifests, &[]);
    let out = lab.nftproxy(&["explain", "--src", CLIENT_IP, "--dst", "10.96.0.10:80"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("ruleset: table ip nftproxy, as the kernel holds it"), "{text}");
    assert!(text.contains("service: default/web:http (ClusterIP 10.96.0.10:80)"), "{text}");
    assert!(text.contains("outcome: DNAT to the endpoints of default/web:http"), "{text}");
    assert!(text.contains("masquerade: yes, the source is outside the cluster CIDR"), "{text}");
    // The same question offline, from the manifests and the flags: the same answer.
    let path = lab.write("offline.yaml", &yaml);
    let offline = |src: &str, dst: &str| {
        let out = lab.nftproxy(&[
            "explain",
            "--src",
            src,
            "--dst",
            dst,
            "--output",
            "json",
            "--manifests",
            path.to_str().unwrap(),
            "--hostname-override",
            "node1",
            "--cluster-cidr",
            nftproxy_tools::lab::topology::CLUSTER_CIDR_V4,
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        json
    };
    for (src, dst) in [(CLIENT_IP, "10.96.0.10:80"), (CLIENT2_IP, "203.0.113.11:80"), (WEB_2.0, "10.96.0.20:80")] {
        let planned = offline(src, dst);
        assert_eq!(planned["ruleset"], "manifests");
        let (verdict, endpoints, live) = predict(&lab, src, dst, "tcp", false);
        assert_eq!(planned["verdict"], verdict.as_str(), "{src} -> {dst}: {planned}\n{live}");
        let offline_endpoints: BTreeMap<String, bool> = planned["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (pod_name(e["address"].as_str().unwrap()), e["masquerade"].as_bool().unwrap()))
            .collect();
        assert_eq!(offline_endpoints, endpoints, "{src} -> {dst}");
    }
}
