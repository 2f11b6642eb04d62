//! The reconciler against the real kernel: partial syncs in a ruleset of hundreds of services,
//! drift repair, and `nftproxy run` following a manifests file with metrics.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::common::*;
use nftproxy::config::{ProxyConfig, parse_cidrs};
use nftproxy::model::NamespacedName;
use nftproxy::netlink::Kernel;
use nftproxy::nft::canonical::canonicalize;
use nftproxy::sync::SyncReason;
use nftproxy_tools::cluster::{self, Size};
use nftproxy_tools::lab::Netns;

/// `n` services, each with three endpoints; `bump` adds a fourth endpoint to service 7.
fn many_services(n: usize, bump: bool) -> String {
    let mut yaml = String::new();
    for i in 0..n {
        let (a, b) = (i / 250, i % 250);
        yaml.push_str(&format!(
            r#"apiVersion: v1
kind: Service
metadata: {{name: svc{i}, namespace: bench}}
spec: {{clusterIP: 10.96.{a}.{b}, ports: [{{name: http, port: 80}}, {{name: dns, port: 53, protocol: UDP}}]}}
---
"#
        ));
        let extra = if bump && i == 7 { "- {addresses: [\"10.128.9.9\"]}\n" } else { "" };
        yaml.push_str(&format!(
            r#"apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: svc{i}-x, namespace: bench, labels: {{kubernetes.io/service-name: svc{i}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}, {{name: dns, port: 53, protocol: UDP}}]
endpoints:
- {{addresses: ["10.128.{a}.{b}"]}}
- {{addresses: ["10.129.{a}.{b}"]}}
- {{addresses: ["10.130.{a}.{b}"]}}
{extra}---
"#
        ));
    }
    yaml
}

fn reconciler() -> Proxy {
    let mut config = ProxyConfig::new("node1");
    config.cluster_cidrs = parse_cidrs("x", "10.128.0.0/9").unwrap();
    // Unowned, so the drift test can tamper with the tables through nft.
    config.table_ownership = false;
    Proxy::new(config, Kernel::open().unwrap())
}

#[test]
fn a_partial_sync_in_hundreds_of_services_sends_only_the_change() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("partial300").unwrap();
    let (transactions, rendered) = ns
        .run(|| {
            let mut r = reconciler();
            r.load(&many_services(300, false));
            let first = r.sync(SyncReason::Startup, false).unwrap();
            assert!(first.report.full, "the first sync is full");
            // Service 7 gains an endpoint, loses it, gains it again.
            let mut transactions = Vec::new();
            for bump in [true, false, true] {
                r.load(&many_services(300, bump));
                let next = r.sync(SyncReason::Changes, false).unwrap();
                assert!(!next.report.full);
                assert_eq!(next.report.services_changed, 1);
                transactions.push(r.last_transaction());
            }
            (transactions, r.render())
        })
        .unwrap();
    // Its two ports now have four endpoints: their elements move to the map for four endpoints
    // (one message each way), and the hairpin set gets the new address. The first time, no port
    // had four endpoints: that map is created, with its rule. Then the map stays (empty while
    // no port has four), and the changes are elements only. Nothing of the 299 other services is
    // touched.
    let moved = [
        "add element ip nftproxy service-endpoints-4 (8 elements)",
        "delete element ip nftproxy service-endpoints-3 (6 elements)",
        "add element ip nftproxy hairpin-endpoints (1 elements)",
    ];
    let back = [
        "add element ip nftproxy service-endpoints-3 (6 elements)",
        "delete element ip nftproxy service-endpoints-4 (8 elements)",
        "delete element ip nftproxy hairpin-endpoints (1 elements)",
    ];
    let created = ["add set ip nftproxy service-endpoints-4", "add rule ip nftproxy balance-service"];
    let expected: [Vec<&str>; 3] = [moved.iter().chain(&created).copied().collect(), back.to_vec(), moved.to_vec()];
    for (tx, expected) in transactions.iter().zip(expected) {
        for op in &tx.ops {
            let owners = op.owners();
            let svc7 = owners.iter().all(|o| o.to_string().starts_with("bench/svc7:"));
            let shared = op.to_string().contains("hairpin-endpoints") || created.contains(&op.to_string().as_str());
            assert!(svc7 || shared, "{op}");
        }
        let mut ops = tx.summary();
        ops.sort();
        let mut expected: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
        expected.sort();
        assert_eq!(ops, expected);
    }
    assert_eq!(canonicalize(&ruleset_of(&ns)), canonicalize(&rendered));
}

#[test]
fn the_ruleset_generation_spares_read_backs_and_guards_partial_syncs() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("generation").unwrap();
    let (to_worker, commands) = std::sync::mpsc::channel::<(SyncReason, bool, bool)>();
    let (reports, from_worker) = std::sync::mpsc::channel::<(bool, usize)>();
    let worker = ns.spawn(move || {
        let mut r = reconciler();
        r.load(&many_services(20, false));
        r.sync(SyncReason::Startup, false).unwrap();
        while let Ok((reason, full, bump)) = commands.recv() {
            r.load(&many_services(20, bump));
            let s = r.sync(reason, full).unwrap();
            reports.send((s.report.full, s.report.apply.operations)).unwrap();
        }
    });
    let ask = |reason, full, bump| {
        to_worker.send((reason, full, bump)).unwrap();
        from_worker.recv().unwrap()
    };
    // Nothing committed since: the periodic sync reads nothing back (the tables are unowned).
    assert_eq!(ask(SyncReason::Periodic, true, false), (false, 0));
    // Another process commits a table of its own: the kernel refuses the partial transaction,
    // which expected the generation before, and a full sync reads the ruleset back.
    ns.exec("nft", &["add", "table", "ip", "someone-else"]).unwrap();
    let (full, ops) = ask(SyncReason::Changes, false, true);
    assert!(full && ops > 0, "full {full}, ops {ops}");
    // Its own transactions keep the proof.
    assert!(!ask(SyncReason::Changes, false, false).0);
    assert_eq!(ask(SyncReason::Periodic, true, false), (false, 0));
    ns.exec("nft", &["delete", "table", "ip", "someone-else"]).unwrap();
    assert!(ask(SyncReason::Periodic, true, false).0, "a foreign commit: read back");
    drop(to_worker);
    worker.join().unwrap().unwrap();
}

#[test]
fn a_full_sync_repairs_drift_and_counts_it() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("drift").unwrap();
    let tamper: [&[&str]; 3] = [
        &["delete", "element", "ip", "nftproxy", "balanced-service-ips", "{ 10.96.0.3 . tcp . 80 }"],
        &["flush", "chain", "ip", "nftproxy", "services"],
        &["delete", "table", "ip", "nftproxy"],
    ];
    // The reconciler lives on one thread in the namespace; nft runs from the test thread.
    let (to_worker, commands) = std::sync::mpsc::channel::<bool>();
    let (reports, from_worker) = std::sync::mpsc::channel::<(usize, usize, String)>();
    let worker = ns.spawn(move || {
        let mut r = reconciler();
        r.load(&many_services(20, false));
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
    let (first, second, owners, again, rendered) = ns
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
            let owners: BTreeSet<String> = new
                .last_transaction()
                .ops
                .iter()
                .flat_map(|op| op.owners())
                .filter_map(|o| o.service().map(|s| s.to_string()))
                .collect();
            let again = new.sync(SyncReason::Periodic, true).unwrap().report;
            (first, second, owners, again, new.render())
        })
        .unwrap();
    assert!(first.full && second.full);
    assert!(second.apply.operations > 0, "{second:?}");
    // Unchanged services cost nothing: every operation is for a service that changed.
    let (old, new) = (cluster::state(Size { services: 200, endpoints: 3 }), cluster::changed_while_down(200));
    let changed = |name: &NamespacedName| {
        old.service(name) != new.service(name)
            || old.slices_of(name).collect::<Vec<_>>() != new.slices_of(name).collect::<Vec<_>>()
    };
    let names: BTreeSet<NamespacedName> = old.services().chain(new.services()).map(|s| s.name.clone()).collect();
    let changed: BTreeSet<String> = names.iter().filter(|n| changed(n)).map(|n| n.to_string()).collect();
    assert!(changed.len() < names.len() / 2, "most services are unchanged: {}", changed.len());
    let unchanged_touched: Vec<&String> = owners.difference(&changed).collect();
    assert!(unchanged_touched.is_empty(), "operations for unchanged services: {unchanged_touched:?}");
    assert_eq!(canonicalize(&ruleset_of(&ns)), canonicalize(&rendered));
    assert_eq!(again.apply.operations, 0, "converged: {again:?}");
}

#[test]
fn run_applies_a_manifest_edit_promptly_and_exports_metrics() {
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

    // A poll (200 ms), the settle time (50 ms) and a sync: typically 0.15–0.35 s. The bound is
    // loose, for a loaded CI machine running a debug build; the figure is printed.
    let edited = Instant::now();
    rewrite(&file, &web_manifests(&[WEB_1]).replace("10.96.0.20", "10.96.0.21"));
    assert!(
        lab.eventually(Duration::from_secs(5), || lab.listing().contains("10.96.0.21")),
        "in the kernel within 5 s"
    );
    let latency = edited.elapsed();
    eprintln!("manifest edit to kernel: {latency:?}");
    assert!(latency < Duration::from_secs(3), "{latency:?}");

    // Drift behind its back is repaired by the periodic full sync and counted.
    lab.lab.node("node1").ns.exec("nft", &["flush", "chain", "ip", "nftproxy", "services"]).unwrap();
    assert!(lab.eventually(Duration::from_secs(3), || lab.listing().contains("vmap @service-ips")), "repaired");
    let value_in = |metrics: &str, name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1.0)
    };
    // The metrics follow the commit (they are recorded after the kernel answered): a scrape
    // right after the repair shows in the kernel can precede them.
    let scrape = || lab.http_get("node1", "127.0.0.1:10249", "/metrics").unwrap();
    assert!(
        lab.eventually(Duration::from_secs(1), || value_in(&scrape().1, "nftproxy_drift_repairs_total") >= 1.0),
        "the repair is counted"
    );
    let (status, metrics) = scrape();
    assert_eq!(status, 200);
    let value = |name: &str| value_in(&metrics, name);
    assert!(value("nftproxy_drift_repairs_total") >= 1.0, "{metrics}");
    assert!(value("kubeproxy_sync_proxy_rules_service_changes_total") >= 2.0, "{metrics}");
    assert!(value("kubeproxy_sync_full_proxy_rules_duration_seconds_count") >= 2.0, "{metrics}");
    assert!(value("kubeproxy_sync_partial_proxy_rules_duration_seconds_count") >= 1.0, "{metrics}");
    assert!(value("kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 1.7e9, "{metrics}");
    assert_eq!(lab.http_get("node1", "127.0.0.1:10249", "/proxyMode").unwrap().1, "nftables");
}
