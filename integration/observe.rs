//! What an operator of upstream kube-proxy observes, with real output: NodePorts per family
//! (an IPv6 NodePort reachable with IPv4-only `--nodeport-addresses` on a dual-stack node),
//! kube-proxy's metric families and `/healthz` on the metrics port, JSON log lines with the
//! sync span's fields, a busy metrics port retried (or fatal with `--bind-address-hard-fail`),
//! and against the test API server: no sync before the Node is known, and upstream's Event for
//! a health-check node port that cannot be bound.

use std::time::{Duration, SystemTime};

use crate::common::apiserver::{FakeApi, objects};
use crate::common::*;
use nftproxy::net::L4Proto;
use serde_json::Value;

/// The dual-stack node that lost its IPv6 NodePorts: `--nodeport-addresses` lists only an IPv4
/// range, so IPv6 (no CIDR given) accepts NodePorts on all its addresses, as upstream.
#[test]
fn ipv6_nodeports_stay_with_ipv4_only_nodeport_addresses() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    lab.sync_with(
        &crate::selection::dual_stack_yaml(),
        &["--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56", "--nodeport-addresses", "192.168.50.0/24"],
    );
    // The lab's IPv6 neighbours may still be resolving: the first connection can time out.
    let v6 = || lab.ask("client", L4Proto::Tcp, "[fd00:50::2]:30080").is_ok();
    assert!(lab.eventually(Duration::from_secs(3), v6), "IPv6 NodePort TCP:\n{}", lab.listing());
    let t = lab.tally("client", L4Proto::Tcp, "[fd00:50::2]:30080", 40);
    assert!(t.answered() >= 38 && backends(&t).len() == 2, "IPv6 NodePort TCP: {t:?}");
    let u = lab.tally("client", L4Proto::Udp, "[fd00:50::2]:30081", 20);
    assert!(u.answered() >= 18, "IPv6 NodePort UDP: {u:?}");
    // IPv4 keeps to the range: the node's wan address, not its pod bridge.
    let t = lab.tally("client", L4Proto::Tcp, "192.168.50.2:30080", 10);
    assert_eq!(t.failed(), 0, "IPv4 NodePort: {t:?}");
    assert!(lab.tally("web-3", L4Proto::Tcp, "10.244.1.1:30080", 3).answered() == 0, "outside the IPv4 range");

    // An unknown keyword is skipped alone (the range still applies), named with the flag.
    let path = lab.write("ds.yaml", &crate::selection::dual_stack_yaml());
    let out = lab.nftproxy(&[
        "render",
        "--manifests",
        path.to_str().unwrap(),
        "--hostname-override",
        "node1",
        "--nodeport-addresses",
        "192.168.50.0/24,nodeips",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("--nodeport-addresses: unknown keyword \"nodeips\""), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("192.168.50.2"), "the range still applies");
    // An invalid CIDR stops start-up, as upstream's validation.
    let out = lab.nftproxy(&["render", "--manifests", path.to_str().unwrap(), "--nodeport-addresses", "10.0.0.0/33"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--nodeport-addresses"));
}

/// The TYPE lines of an exposition: family name → type.
fn families(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect()
}

/// `nftproxy run --logging-format json`: every stderr line is one JSON object, and the sync's
/// line carries the sync span's fields; the metrics port serves kube-proxy's families with
/// `ip_family`, the process metrics, build info and `/healthz`.
#[test]
fn run_logs_json_lines_and_exports_kube_proxys_metrics() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let svc = Svc { name: "web", cluster_ip: "10.96.0.10", endpoints: &[WEB_1, WEB_3], ..Default::default() };
    let path = lab.write("cluster.yaml", &services_yaml(&[svc]));
    let _proxy = lab.run_proxy(&path, &["--logging-format", "json", "--metrics-bind-address", "127.0.0.1:10249"]);
    assert!(lab.eventually(Duration::from_secs(5), || lab.proxy_log().contains("\"message\":\"synced\"")));
    // A health probe, counted by code.
    assert!(matches!(lab.http_get("node1", "127.0.0.1:10256", "/livez"), Ok((200, _))));

    let log = lab.proxy_log();
    let mut synced = None;
    for line in log.lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}\n{log}"));
        assert!(v["timestamp"].is_string() && v["level"].is_string() && v["message"].is_string(), "{line}");
        if v["message"] == "synced" {
            synced.get_or_insert(v);
        }
    }
    let synced = synced.expect("a synced line");
    assert_eq!(synced["span"]["name"], "sync", "{synced}");
    assert_eq!(synced["span"]["reason"], "startup", "{synced}");
    assert_eq!(synced["span"]["full"], true, "{synced}");
    assert_eq!(synced["services"], 1, "{synced}");
    assert!(synced["ms"].is_string() && synced["kernel_ms"].is_string(), "{synced}");

    let (code, text) = lab.http_get("node1", "127.0.0.1:10249", "/metrics").expect("metrics");
    assert_eq!(code, 200);
    // Families with labels appear with their first series, as upstream's vectors do (no
    // network-programming sample without a trigger time, no cleanup failure).
    let exported = families(&text);
    for (name, kind) in [
        ("kubeproxy_sync_proxy_rules_duration_seconds", "histogram"),
        ("kubeproxy_sync_full_proxy_rules_duration_seconds", "histogram"),
        ("kubeproxy_sync_proxy_rules_no_local_endpoints_total", "gauge"),
        ("kubeproxy_proxy_livez_total", "counter"),
        ("kubernetes_build_info", "gauge"),
        ("process_cpu_seconds_total", "counter"),
        ("process_resident_memory_bytes", "gauge"),
        ("process_open_fds", "gauge"),
        ("process_start_time_seconds", "gauge"),
    ] {
        assert!(exported.contains(&(name.to_string(), kind.to_string())), "{name} {kind}:\n{text}");
    }
    for line in [
        "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
        "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
        "kubeproxy_proxy_livez_total{code=\"200\"} 1",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\",ip_family=\"IPv4\"} 0",
    ] {
        assert!(text.contains(line), "{line}:\n{text}");
    }
    assert!(matches!(lab.http_get("node1", "127.0.0.1:10249", "/healthz"), Ok((200, body)) if body == "ok"));
}

/// A busy metrics port: retried every 5 s while the proxy works, and served once it is free;
/// with `--bind-address-hard-fail` the process exits with upstream's message instead.
#[test]
fn a_busy_metrics_port_is_retried_unless_hard_fail() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let ns = &lab.lab.node("node1").ns;
    let squatter = ns.run(|| std::net::TcpListener::bind("127.0.0.1:10249")).unwrap().expect("squat");
    let svc = Svc { name: "web", cluster_ip: "10.96.0.10", endpoints: &[WEB_1], ..Default::default() };
    let path = lab.write("cluster.yaml", &services_yaml(&[svc]));

    let hard = lab.nftproxy(&[
        "run",
        "--manifests",
        path.to_str().unwrap(),
        "--hostname-override",
        "node1",
        "--healthz-bind-address",
        "127.0.0.1:10256",
        "--bind-address-hard-fail",
    ]);
    let stderr = String::from_utf8_lossy(&hard.stderr);
    assert!(!hard.status.success(), "{stderr}");
    assert!(stderr.contains("starting metrics server failed: listen tcp 127.0.0.1:10249"), "{stderr}");
    assert!(!lab.listing().contains("table ip nftproxy"), "exited before syncing");

    let _proxy = lab.run_proxy(&path, &["--metrics-bind-address", "127.0.0.1:10249"]);
    assert!(lab.proxy_log().contains("failed to start the metrics server; retrying"), "{}", lab.proxy_log());
    assert_eq!(lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 5).failed(), 0, "the proxy works meanwhile");
    drop(squatter);
    assert!(
        lab.eventually(Duration::from_secs(8), || lab
            .http_get("node1", "127.0.0.1:10249", "/metrics")
            .is_ok_and(|(code, body)| code == 200 && body.contains("kubeproxy_"))),
        "never served after the port was freed:\n{}",
        lab.proxy_log()
    );
}

/// `run --kubeconfig` when the Node arrives late: no transaction before it (so a restart never
/// programs empty `nodeport-ips`), and the first one holds the Node's address; a health-check
/// node port that cannot be bound raises upstream's `FailedToStartServiceHealthcheck` Event.
#[test]
fn the_first_sync_waits_for_the_node_and_a_busy_health_check_port_is_an_event() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let ns = &lab.lab.node("node1").ns;
    // Held on every address: whichever node-port addresses the server wants, it cannot bind.
    let squatter = ns.run(|| std::net::TcpListener::bind("[::]:30999")).unwrap().expect("squat");
    let api = FakeApi::start(ns);
    let lb = Svc {
        name: "lb",
        cluster_ip: "10.96.0.10",
        kind: "LoadBalancer",
        node_port: Some(30080),
        external_local: true,
        health_check_port: Some(30999),
        lb_ips: &["203.0.113.10"],
        endpoints: &[WEB_1],
        ..Default::default()
    };
    let all = objects(&services_yaml(&[lb]));
    let node: Vec<Value> = all.iter().filter(|o| o["kind"] == "Node").cloned().collect();
    for obj in all.into_iter().filter(|o| o["kind"] != "Node") {
        api.apply(obj);
    }
    let kubeconfig = lab.write("kubeconfig", &api.kubeconfig());
    let (_proxy, applied_at) = std::thread::scope(|scope| {
        // The Node arrives once the proxy has said it is waiting for it.
        let late = scope.spawn(|| {
            let waiting =
                lab.eventually(Duration::from_secs(20), || lab.proxy_log().contains("node \\\"node1\\\" not found"));
            assert!(waiting, "never waited for the Node:\n{}", lab.proxy_log());
            let at = SystemTime::now();
            for obj in node {
                api.apply(obj);
            }
            at
        });
        let proxy = lab.run_proxy_from(&["--kubeconfig", kubeconfig.to_str().unwrap()], &["--logging-format", "json"]);
        (proxy, late.join().unwrap())
    });
    let log = lab.proxy_log();
    assert!(log.contains("node \\\"node1\\\" not found"), "waited for the Node:\n{log}");
    let first = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["message"] == "synced")
        .expect("synced");
    let at = humantime::parse_rfc3339_weak(first["timestamp"].as_str().unwrap()).unwrap();
    assert!(at >= applied_at, "the first sync ran before the Node existed: {first}");
    let listing = lab.listing();
    let nodeport_ips = listing.split("set nodeport-ips").nth(1).unwrap_or("");
    assert!(nodeport_ips[..nodeport_ips.find('}').unwrap_or(0)].contains("192.168.50.2"), "{listing}");

    let event = |api: &FakeApi| api.events().into_iter().find(|e| e["reason"] == "FailedToStartServiceHealthcheck");
    assert!(lab.eventually(Duration::from_secs(5), || event(&api).is_some()), "{:?}", api.events());
    let e = event(&api).unwrap();
    assert_eq!(e["type"], "Warning");
    assert_eq!(e["action"], "Listen");
    assert_eq!(e["regarding"]["kind"], "Service");
    assert_eq!(e["regarding"]["name"], "lb");
    assert_eq!(e["regarding"]["uid"], "default/lb");
    let note = e["note"].as_str().unwrap();
    assert!(note.starts_with("node node1 failed to start healthcheck \"default/lb\" on port 30999: "), "{note}");
    // Freed: the next sync opens it.
    drop(squatter);
    api.apply(
        objects(&services_yaml(&[Svc { name: "other", cluster_ip: "10.96.0.11", ..Default::default() }]))[0].clone(),
    );
    assert!(
        lab.eventually(Duration::from_secs(5), || lab.http_get("client", "192.168.50.2:30999", "/").is_ok()),
        "{}",
        lab.proxy_log()
    );
}
