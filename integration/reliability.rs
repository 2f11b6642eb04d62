//! Failure handling against the real kernel: a service whose objects the kernel refuses is left
//! out while the rest is applied; owned tables refuse other writers and outlive a killed
//! process; `kill -9` at random points of large syncs leaves the old or the new ruleset, never a
//! mix and never none, while traffic to an untouched service keeps flowing.

use std::process::{Child, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::common::*;
use nftproxy::config::{ProxyConfig, parse_cidrs};
use nftproxy::net::L4Proto;
use nftproxy::netlink::Kernel;
use nftproxy::nft::canonical::canonicalize;
use nftproxy::sync::SyncReason;
use nftproxy_tools::lab::traffic;
use nftproxy_tools::lab::{self, Netns};
use nftproxy_tools::netfilter::RefuseOwner;

/// `n` services `bench/svc<i>` with `endpoints` endpoints each; `generation` moves the
/// endpoints to other addresses (same count, so every service keeps its endpoint window).
fn filler_yaml(n: usize, endpoints: usize, generation: usize) -> String {
    let mut yaml = String::new();
    for i in 0..n {
        let (a, b) = (i / 250, i % 250);
        yaml.push_str(&format!(
            r#"apiVersion: v1
kind: Service
metadata: {{name: svc{i}, namespace: bench}}
spec: {{clusterIP: 10.97.{a}.{b}, ports: [{{name: http, port: 80}}, {{name: dns, port: 53, protocol: UDP}}]}}
---
"#
        ));
        let eps: String = (0..endpoints)
            .map(|j| format!("- {{addresses: [\"10.{}.{a}.{b}\"]}}\n", 140 + j + generation * endpoints))
            .collect();
        yaml.push_str(&format!(
            r#"apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: svc{i}-x, namespace: bench, labels: {{kubernetes.io/service-name: svc{i}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}, {{name: dns, port: 53, protocol: UDP}}]
endpoints:
{eps}---
"#
        ));
    }
    yaml
}

#[test]
fn a_service_the_kernel_refuses_is_left_out_and_the_rest_applied() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("refuse").unwrap();
    let (first, problems, excluded, rendered, second_full) = ns
        .run(|| {
            let mut config = ProxyConfig::new("node1");
            config.cluster_cidrs = parse_cidrs("x", "10.128.0.0/9").unwrap();
            let kernel = RefuseOwner { inner: Kernel::open().unwrap(), prefix: "bench/svc3:".into() };
            let mut r = Proxy::new(config, kernel);
            r.load(&filler_yaml(8, 2, 0));
            let first = r.sync(SyncReason::Startup, true).map(|s| s.report.full);
            let problems: Vec<String> = r.syncer.take_problems().iter().map(|p| p.to_string()).collect();
            let excluded: Vec<String> = r.syncer.excluded().keys().map(|n| n.to_string()).collect();
            let rendered = r.render();
            // Another service changes: a partial sync, the refused one still left out.
            r.load(&filler_yaml(8, 2, 0).replace("10.140.0.5\"", "10.140.0.5\"]}\n- {addresses: [\"10.150.0.5\""));
            let second = r.sync(SyncReason::Changes, false).map(|s| s.report.full);
            (first, problems, excluded, rendered, second)
        })
        .unwrap();
    assert!(first.expect("the other services are applied"), "a full sync");
    assert!(!second_full.expect("later syncs go on"), "a partial sync");
    assert_eq!(excluded, vec!["bench/svc3".to_string()]);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].starts_with("Service bench/svc3: skipped: the kernel refused its rules"), "{}", problems[0]);
    assert!(problems[0].contains("No such file or directory"), "the kernel's errno is reported: {}", problems[0]);
    let kernel = ruleset_of(&ns);
    assert!(!kernel.contains("bench/svc3:"), "the refused service is not in the kernel");
    for i in [0, 1, 2, 4, 5, 6, 7] {
        assert!(kernel.contains(&format!("bench/svc{i}:http")), "svc{i} is programmed");
    }
    assert!(kernel.contains("10.150.0.5"), "the second (partial) sync was applied");
    assert!(!rendered.contains("bench/svc3:"));
}

/// `nftproxy run` in node1 of the lab, not waiting for anything.
fn spawn_run(lab: &ClusterLab, manifests: &std::path::Path, extra: &[&str], log: &str) -> Child {
    let log = std::fs::File::create(lab.dir.path().join(log)).unwrap();
    let mut args = vec![
        "run",
        "--manifests",
        manifests.to_str().unwrap(),
        "--hostname-override",
        "node1",
        "--cluster-cidr",
        lab::topology::CLUSTER_CIDR_V4,
        "--healthz-bind-address",
        "",
        "--metrics-bind-address",
        "",
        "--min-sync-period",
        "0s",
        // nf_conntrack_max and the hashsize are global: a test never tries to change them.
        "--conntrack-max-per-core",
        "0",
    ];
    args.extend_from_slice(extra);
    lab.lab
        .node("node1")
        .ns
        .command(env!("CARGO_BIN_EXE_nftproxy"))
        .args(&args)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// Waits until node1's ruleset is `want` (canonical), or fails showing the difference.
fn converges(lab: &ClusterLab, want: &str, what: &str) {
    if lab.eventually(Duration::from_secs(20), || canonicalize(&lab.listing()) == want) {
        return;
    }
    let have = canonicalize(&lab.listing());
    let missing: Vec<&str> = want.lines().filter(|l| !have.contains(l)).take(10).collect();
    let extra: Vec<&str> = have.lines().filter(|l| !want.contains(l)).take(10).collect();
    panic!("{what}: the kernel did not converge\nmissing: {missing:#?}\nextra: {extra:#?}");
}

fn kill9(child: &mut Child) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    child.wait().unwrap();
}

#[test]
fn owned_tables_refuse_other_writers_and_outlive_a_killed_owner() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let manifests = lab.write("cluster.yaml", &web_manifests(&[WEB_1, WEB_2]));
    let node = &lab.lab.node("node1").ns;
    let want = canonicalize(&lab.render(&web_manifests(&[WEB_1, WEB_2])));
    let tamper = ["add", "chain", "ip", "nftproxy", "intruder"];

    let mut proxy = spawn_run(&lab, &manifests, &[], "owned.log");
    converges(&lab, &want, "owned");
    let refused = node.exec("nft", &tamper).expect_err("another process cannot change an owned table");
    assert!(refused.to_string().contains("Operation not permitted"), "{refused}");
    assert!(node.exec("nft", &["delete", "table", "ip", "nftproxy"]).is_err());
    assert_eq!(lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 10).answered(), 10);

    // A second nftproxy meanwhile says who holds the tables and changes nothing.
    let mut second = spawn_run(&lab, &manifests, &[], "second.log");
    let log = || std::fs::read_to_string(lab.dir.path().join("second.log")).unwrap_or_default();
    assert!(
        lab.eventually(Duration::from_secs(10), || log().contains("is owned by another process")),
        "the second process names the owner: {}",
        log()
    );
    assert!(second.try_wait().unwrap().is_none(), "it keeps running (and retrying)");
    kill9(&mut second);
    assert!(lab.listing().contains("flags owner"), "the first still owns the tables");

    // Killed, the owner's tables stay (persist) and keep serving.
    kill9(&mut proxy);
    assert_eq!(canonicalize(&lab.listing()), want, "the tables outlive their owner");
    assert_eq!(lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 10).answered(), 10);

    // Orphaned, nft shows no owner; a new process claims them again (no rebuild: nothing else
    // changes).
    assert!(!lab.listing().contains("flags owner"));
    let mut proxy = spawn_run(&lab, &manifests, &[], "owned2.log");
    assert!(lab.eventually(Duration::from_secs(10), || lab.listing().contains("flags owner")), "claimed again");
    assert_eq!(canonicalize(&lab.listing()), want);
    assert!(node.exec("nft", &tamper).is_err_and(|e| e.to_string().contains("not permitted")));
    kill9(&mut proxy);

    // With --table-ownership false a running nftproxy leaves them editable by hand.
    let manifests = lab.write("cluster.yaml", &web_manifests(&[WEB_1]));
    let mut proxy = spawn_run(&lab, &manifests, &["--table-ownership", "false"], "unowned.log");
    converges(&lab, &canonicalize(&lab.render(&web_manifests(&[WEB_1]))), "unowned");
    assert!(proxy.try_wait().unwrap().is_none(), "running");
    assert!(!lab.listing().contains("flags owner"));
    node.exec("nft", &tamper).expect("unowned tables can be edited");
    kill9(&mut proxy);
}

#[test]
fn kill_9_during_large_syncs_leaves_old_or_new_rules_and_traffic_flows() {
    if skip_unless_privileged() {
        return;
    }
    const SERVICES: usize = 400;
    let rounds: usize = std::env::var("NFTPROXY_KILL_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(12);
    let lab = ClusterLab::new();
    let versions: Vec<String> = (0..2)
        .map(|g| format!("{}---\n{}", web_manifests(&[WEB_1, WEB_2, WEB_3]), filler_yaml(SERVICES, 4, g)))
        .collect();
    let expected: Vec<String> = versions.iter().map(|v| canonicalize(&lab.render(v))).collect();
    assert_ne!(expected[0], expected[1]);
    let manifests = lab.dir.path().join("cluster.yaml");

    // Version 0 in the kernel, and how long a new process takes to converge to version 1.
    std::fs::write(&manifests, &versions[0]).unwrap();
    let mut proxy = spawn_run(&lab, &manifests, &[], "first.log");
    assert!(lab.eventually(Duration::from_secs(20), || canonicalize(&lab.listing()) == expected[0]), "converged");
    kill9(&mut proxy);
    std::fs::write(&manifests, &versions[1]).unwrap();
    let started = Instant::now();
    let mut proxy = spawn_run(&lab, &manifests, &[], "timing.log");
    assert!(lab.eventually(Duration::from_secs(20), || canonicalize(&lab.listing()) == expected[1]));
    let converge = started.elapsed();
    kill9(&mut proxy);

    // Traffic to the untouched service from outside the cluster, all along.
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let client = {
        let (stop, sent, failed) = (stop.clone(), sent.clone(), failed.clone());
        lab.lab.client("client").unwrap().ns.spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let ok = traffic::ask(L4Proto::Tcp, "10.96.0.10:80".parse().unwrap(), Duration::from_secs(1)).is_ok();
                sent.fetch_add(1, Ordering::Relaxed);
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };

    // Kill at random points of the start-up sync that moves the kernel to the other version:
    // at least `rounds` kills, and more (up to 60) until both outcomes were seen. The span of
    // delays follows what happens, since a loaded machine's start-ups are not the timed one's:
    // it widens while every kill lands before the commit and narrows while every kill after.
    let mut seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    eprintln!("kill -9 test: seed {seed}, {rounds} rounds, a new process converges in {converge:?}");
    let mut in_kernel = 1;
    let (mut old, mut new) = (0, 0);
    let mut span: f64 = 1.3;
    let mut round = 0;
    while round < rounds || ((old == 0 || new == 0) && round < 60) {
        round += 1;
        if round > 4 && new == 0 {
            span = (span * 1.3).min(4.0);
        } else if round > 4 && old == 0 {
            span /= 1.3;
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let delay = converge.mul_f64(span * (seed % 1000) as f64 / 1000.0);
        let target = 1 - in_kernel;
        std::fs::write(&manifests, &versions[target]).unwrap();
        let mut proxy = spawn_run(&lab, &manifests, &[], "kill.log");
        std::thread::sleep(delay);
        if let Some(status) = proxy.try_wait().unwrap() {
            let log = std::fs::read_to_string(lab.dir.path().join("kill.log")).unwrap_or_default();
            panic!("round {round}: nftproxy exited ({status}) before the kill:\n{log}");
        }
        kill9(&mut proxy);
        let now = canonicalize(&lab.listing());
        if now == expected[target] {
            new += 1;
            in_kernel = target;
        } else {
            assert_eq!(
                now, expected[in_kernel],
                "round {round}: killed after {delay:?}, neither the old nor the new ruleset"
            );
            old += 1;
        }
    }
    // A restart converges.
    let mut proxy = spawn_run(&lab, &manifests, &[], "last.log");
    let target = versions.iter().position(|v| *v == std::fs::read_to_string(&manifests).unwrap()).unwrap();
    assert!(
        lab.eventually(Duration::from_secs(20), || canonicalize(&lab.listing()) == expected[target]),
        "a restart converges"
    );
    kill9(&mut proxy);
    stop.store(true, Ordering::Relaxed);
    client.join().unwrap().unwrap();
    let (sent, failed) = (sent.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!("kill -9 test: {old} kills left the old ruleset, {new} the new; {sent} connections, {failed} failed");
    assert!(sent > 50, "the client kept connecting ({sent})");
    assert!(old > 0 && new > 0, "kills landed both before and after a sync committed ({old} old, {new} new)");
    assert_eq!(failed, 0, "connections to the untouched service failed during the kills");
}
