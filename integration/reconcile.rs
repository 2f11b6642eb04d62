//! The reconciler against the real kernel: partial syncs in a ruleset of hundreds of services,
//! drift repair, and `nftproxy run` following a manifests file with metrics.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nftproxy::bench::cluster::{self, Size};
use nftproxy::config::{ProxyConfig, parse_cidrs};
use nftproxy::lab::Netns;
use nftproxy::netlink::Kernel;
use nftproxy::nft::canonical::canonicalize;
use nftproxy::reconcile::{Reconciler, SyncReason, local_nodeports};
use nftproxy::source::{Event, Kind, Snapshot};

/// `n` services, each with three endpoints; `bump` adds a fourth endpoint to service 7.
fn many_services(n: usize, bump: bool) -> Snapshot {
    let mut yaml = String::new();
    for i in 0..n {
        let (a, b) = (i / 250, i % 250);
        yaml.push_str(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: svc{i}, namespace: bench}}\nspec: {{clusterIP: 10.96.{a}.{b}, ports: [{{name: http, port: 80}}, {{name: dns, port: 53, protocol: UDP}}]}}\n---\n"
        ));
        let extra = if bump && i == 7 { "- {addresses: [\"10.128.9.9\"]}\n" } else { "" };
        yaml.push_str(&format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: svc{i}-x, namespace: bench, labels: {{kubernetes.io/service-name: svc{i}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080}}, {{name: dns, port: 53, protocol: UDP}}]\nendpoints:\n- {{addresses: [\"10.128.{a}.{b}\"]}}\n- {{addresses: [\"10.129.{a}.{b}\"]}}\n- {{addresses: [\"10.130.{a}.{b}\"]}}\n{extra}---\n"
        ));
    }
    snapshot_of(&yaml)
}

fn reconciler() -> Reconciler {
    let mut config = ProxyConfig::new("node1");
    config.cluster_cidrs = parse_cidrs("x", "10.128.0.0/9").unwrap();
    // Unowned, so the drift test can tamper with the tables through nft.
    config.table_ownership = false;
    let kernel = Kernel::open().unwrap();
    let mut r = Reconciler::new(config, Box::new(kernel), local_nodeports());
    r.on_event(Event::Synced(Kind::Services));
    r.on_event(Event::Synced(Kind::EndpointSlices));
    r
}

#[test]
fn a_partial_sync_in_hundreds_of_services_sends_only_the_change() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("partial300").unwrap();
    let (ops, rendered) = ns
        .run(|| {
            let mut r = reconciler();
            r.on_event(Event::Snapshot(Box::new(many_services(300, false))));
            let first = r.sync(SyncReason::Startup, false).unwrap();
            assert!(first.report.full, "the first sync is full");
            assert!(first.report.apply.messages > 1000, "{}", first.report.apply.messages);
            r.on_event(Event::Snapshot(Box::new(many_services(300, true))));
            let second = r.sync(SyncReason::Changes, false).unwrap();
            assert!(!second.report.full);
            assert_eq!(second.report.services_changed, 1);
            (second.report.transaction, r.render())
        })
        .unwrap();
    // One service gained an endpoint on two ports: each port's window of the endpoint map is
    // re-split (its ranges replaced, both ports in one message each way) and the hairpin set
    // gets the new address. No rule changes, and nothing of the 299 other services is touched.
    for op in &ops.ops {
        let owners = op.owners();
        let svc7 = owners.iter().all(|o| o.as_str().starts_with("bench/svc7:"));
        assert!(svc7 || op.to_string() == "add element ip nftproxy hairpin-endpoints (1 elements)", "{op}");
    }
    let mut ops = ops.summary();
    ops.sort();
    let shard = ops.iter().find_map(|o| o.strip_prefix("add element ip nftproxy endpoints-")).unwrap_or_default();
    let shard = shard.split(' ').next().unwrap_or_default();
    let mut expected = vec![
        format!("add element ip nftproxy endpoints-{shard} (16 elements)"),
        "add element ip nftproxy hairpin-endpoints (1 elements)".to_string(),
        format!("delete element ip nftproxy endpoints-{shard} (12 elements)"),
    ];
    expected.sort();
    assert_eq!(ops, expected);
    assert_eq!(canonicalize(&ruleset_of(&ns)), canonicalize(&rendered));
}

#[test]
fn a_full_sync_repairs_drift_and_counts_it() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("drift").unwrap();
    let tamper: [&[&str]; 3] = [
        &["delete", "element", "ip", "nftproxy", "service-ips", "{ 10.96.0.3 . tcp . 80 }"],
        &["flush", "chain", "ip", "nftproxy", "services"],
        &["delete", "table", "ip", "nftproxy"],
    ];
    // The reconciler lives on one thread in the namespace; nft runs from the test thread.
    let (to_worker, commands) = std::sync::mpsc::channel::<bool>();
    let (reports, from_worker) = std::sync::mpsc::channel::<(usize, usize, String)>();
    let worker = ns.spawn(move || {
        let mut r = reconciler();
        r.on_event(Event::Snapshot(Box::new(many_services(20, false))));
        let s = r.sync(SyncReason::Startup, false).unwrap();
        reports.send((s.report.drift_repairs, s.report.apply.operations, r.render())).unwrap();
        while let Ok(full) = commands.recv() {
            let s = r.sync(SyncReason::Periodic, full).unwrap();
            reports.send((s.report.drift_repairs, s.report.apply.operations, r.render())).unwrap();
        }
    });
    let (_, _, rendered) = from_worker.recv().unwrap();
    let want = canonicalize(&rendered);
    for cmd in tamper {
        ns.exec("nft", cmd).unwrap();
        assert_ne!(canonicalize(&ruleset_of(&ns)), want, "{cmd:?} changed the ruleset");
        // A partial sync trusts its memory and changes nothing…
        to_worker.send(false).unwrap();
        let (repairs, ops, _) = from_worker.recv().unwrap();
        assert_eq!((repairs, ops), (0, 0), "{cmd:?}");
        // …the full sync reads the kernel back and repairs it, in one transaction.
        to_worker.send(true).unwrap();
        let (repairs, ops, _) = from_worker.recv().unwrap();
        assert!(repairs > 0 && ops > 0, "{cmd:?}: repairs {repairs}, ops {ops}");
        assert_eq!(canonicalize(&ruleset_of(&ns)), want, "{cmd:?} repaired");
    }
    drop(to_worker);
    worker.join().unwrap().unwrap();
}

#[test]
fn a_new_process_over_a_stale_ruleset_converges_in_one_transaction() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("stale").unwrap();
    let (first, second, again, rendered) = ns
        .run(|| {
            let mut old = reconciler();
            old.replace_state(cluster::state(Size { services: 200, endpoints: 3 }));
            let first = old.sync(SyncReason::Startup, false).unwrap().report;
            drop(old);
            // Services gone and new (one with a gone one's ClusterIP), endpoints re-split,
            // affinity and NodePorts switched: a new process finds the old ruleset.
            let mut new = reconciler();
            new.replace_state(cluster::changed_while_down(200));
            let second = new.sync(SyncReason::Startup, false).unwrap().report;
            let again = new.sync(SyncReason::Periodic, true).unwrap().report;
            (first, second, again, new.render())
        })
        .unwrap();
    assert!(first.full && second.full);
    // Unchanged services cost nothing: fewer operations than writing everything.
    assert!(second.apply.operations > 0 && second.apply.operations < first.apply.operations, "{second:?}");
    assert_eq!(canonicalize(&ruleset_of(&ns)), canonicalize(&rendered));
    assert_eq!(again.apply.operations, 0, "converged: {again:?}");
}

#[test]
fn run_applies_a_manifest_edit_within_a_second_and_exports_metrics() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let dir = lab.dir.path().join("watched");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cluster.yaml");
    std::fs::write(&file, web_manifests(&[WEB_1])).unwrap();
    let _proxy = lab.run_proxy(
        &dir,
        &["--metrics-bind-address", "127.0.0.1:10249", "--sync-period", "1s", "--table-ownership", "false"],
    );

    let edited = Instant::now();
    std::fs::write(&file, web_manifests(&[WEB_1]).replace("10.96.0.20", "10.96.0.21")).unwrap();
    assert!(
        lab.eventually(Duration::from_secs(1), || lab.listing().contains("10.96.0.21")),
        "in the kernel within a second"
    );
    let latency = edited.elapsed();
    assert!(latency < Duration::from_secs(1), "{latency:?}");

    // Drift behind its back is repaired by the periodic full sync and counted.
    lab.lab.node("node1").ns.exec("nft", &["flush", "chain", "ip", "nftproxy", "services"]).unwrap();
    assert!(lab.eventually(Duration::from_secs(3), || lab.listing().contains("vmap @service-ips")), "repaired");
    let (status, metrics) = lab.http_get("node1", "127.0.0.1:10249", "/metrics").unwrap();
    assert_eq!(status, 200);
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1.0)
    };
    assert!(value("nftproxy_drift_repairs_total") >= 1.0, "{metrics}");
    assert!(value("kubeproxy_sync_proxy_rules_service_changes_total") >= 2.0, "{metrics}");
    assert!(value("kubeproxy_sync_full_proxy_rules_duration_seconds_count") >= 2.0, "{metrics}");
    assert!(value("kubeproxy_sync_partial_proxy_rules_duration_seconds_count") >= 1.0, "{metrics}");
    assert!(value("kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 1.7e9, "{metrics}");
    assert_eq!(lab.http_get("node1", "127.0.0.1:10249", "/proxyMode").unwrap().1, "nftables");
}
