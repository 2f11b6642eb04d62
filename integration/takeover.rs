//! Taking over from kube-proxy on node1: its iptables-mode chains (written with iptables-nft,
//! DNATing the web service to web-1) and its nftables-mode tables are removed in the same
//! transaction as nftproxy's first sync (one generation in `nft monitor`), while a client keeps
//! connecting to the service; `check` lists what `run` removes, and `--cleanup-kube-proxy=false`
//! keeps it all.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::common::*;
use nftproxy::net::L4Proto;

/// kube-proxy's iptables mode for the web service (10.96.0.10:80 → web-1), with kubelet's
/// `KUBE-FIREWALL`, as `iptables-save` prints them.
const IPTABLES: &str = r#"*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-SVC-WEB - [0:0]
:KUBE-SEP-WEB1 - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-PROXY-CANARY - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-WEB
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-WEB -m comment --comment "default/web:http -> 10.244.1.10:8080" -j KUBE-SEP-WEB1
-A KUBE-SEP-WEB1 -s 10.244.1.10/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-WEB1 -p tcp -m tcp -j DNAT --to-destination 10.244.1.10:8080
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
COMMIT
*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-FIREWALL - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
COMMIT
*mangle
:KUBE-PROXY-CANARY - [0:0]
COMMIT
"#;

const IP6TABLES: &str = r#"*nat
:KUBE-SERVICES - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
COMMIT
"#;

/// kube-proxy's nftables mode (abridged: its table and a base chain).
const NFTABLES: &str = r#"table ip kube-proxy {
	comment "rules for kube-proxy"
	chain nat-prerouting { type nat hook prerouting priority dstnat; policy accept; }
}
table ip6 kube-proxy {
	comment "rules for kube-proxy"
	chain nat-prerouting { type nat hook prerouting priority dstnat; policy accept; }
}
"#;

fn feed(lab: &ClusterLab, program: &str, args: &[&str], input: &str) {
    use std::io::Write;
    let mut child = lab
        .lab
        .node("node1")
        .ns
        .command(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{program}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Whether the `ipset` program is here (the IPVS leftovers' ipsets are made with it).
fn have_ipset() -> bool {
    std::process::Command::new("ipset").arg("version").output().is_ok_and(|o| o.status.success())
}

/// Leaves what kube-proxy (IPVS and iptables modes, then a short nftables-mode run) leaves on
/// node1: the IPVS mode's device (a bridge here: the kernel may lack dummy devices) and an
/// ipset that one of its iptables rules matches.
fn kube_proxy_leftovers(lab: &ClusterLab) {
    let ns = &lab.lab.node("node1").ns;
    ns.ip(&["link", "add", "kube-ipvs0", "type", "bridge"]).unwrap();
    let mut iptables = IPTABLES.to_string();
    if have_ipset() {
        let out = ns.exec("ipset", &["create", "KUBE-CLUSTER-IP", "hash:ip,port"]).unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        iptables = iptables.replacen(
            "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\"",
            "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\n-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\"",
            1,
        );
    } else {
        eprintln!("no ipset program: the ipset leftover is not tested");
    }
    feed(lab, "iptables-nft-restore", &["--noflush"], &iptables);
    feed(lab, "ip6tables-nft-restore", &["--noflush"], IP6TABLES);
    feed(lab, "nft", &["-f", "-"], NFTABLES);
}

/// The manifests nftproxy gets: web with web-2 alone, so its answers tell whose rules DNATed.
fn cluster(lab: &ClusterLab) -> std::path::PathBuf {
    lab.write(
        "cluster.yaml",
        &services_yaml(&[Svc { name: "web", cluster_ip: "10.96.0.10", endpoints: &[WEB_2], ..Default::default() }]),
    )
}

/// `nft monitor`'s events grouped by the generation they ended in: (who committed, events).
fn generations(monitor: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut events = Vec::new();
    for line in monitor.lines() {
        if let Some(rest) = line.strip_prefix("# new generation ") {
            let who = rest.rsplit_once('(').map(|(_, c)| c.trim_end_matches(')').to_string()).unwrap_or_default();
            out.push((who, std::mem::take(&mut events)));
        } else if !line.trim().is_empty() {
            events.push(line.trim().to_string());
        }
    }
    out
}

#[test]
fn kube_proxys_leftovers_go_in_the_first_sync_with_no_gap() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    kube_proxy_leftovers(&lab);
    assert_eq!(lab.ask("client", L4Proto::Tcp, "10.96.0.10:80").unwrap().backend, "web-1", "kube-proxy's DNAT serves");
    let manifests = cluster(&lab);

    let monitor_path = lab.dir.path().join("monitor.txt");
    let mut monitor = lab
        .lab
        .node("node1")
        .ns
        .command("nft")
        .arg("monitor")
        .stdout(std::fs::File::create(&monitor_path).unwrap())
        .spawn()
        .unwrap();
    // Subscribed once it reports a probe table's coming and going.
    let node = &lab.lab.node("node1").ns;
    let subscribed = lab.eventually(Duration::from_secs(5), || {
        node.exec("nft", &["add", "table", "inet", "monitor-probe"]).unwrap();
        node.exec("nft", &["delete", "table", "inet", "monitor-probe"]).unwrap();
        std::fs::read_to_string(&monitor_path).unwrap_or_default().contains("monitor-probe")
    });
    assert!(subscribed, "nft monitor reported nothing");

    // A client connects all along: first kube-proxy's rules answer (web-1), then nftproxy's
    // (web-2); no connection may fail in between.
    let stop = AtomicBool::new(false);
    let rounds = std::sync::atomic::AtomicUsize::new(0);
    let (tally, proxy) = std::thread::scope(|s| {
        let client = s.spawn(|| {
            let mut all = nftproxy_tools::lab::traffic::Tally::default();
            while !stop.load(Ordering::Relaxed) {
                let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 10);
                rounds.fetch_add(1, Ordering::Relaxed);
                for (k, v) in t.by_backend {
                    *all.by_backend.entry(k).or_default() += v;
                }
                for (k, v) in t.errors {
                    *all.errors.entry(k).or_default() += v;
                }
            }
            all
        });
        // The client stops when this scope ends, also by a failed assertion (the scope joins it).
        let _stop_client = SetOnDrop(&stop);
        // kube-proxy's rules answered the client before nftproxy starts.
        assert!(
            lab.eventually(Duration::from_secs(5), || rounds.load(Ordering::Relaxed) > 0),
            "the client never asked"
        );
        let proxy = lab.run_proxy(&manifests, &[]);
        let switched = lab.eventually(Duration::from_secs(5), || {
            lab.ask("client", L4Proto::Tcp, "10.96.0.10:80").is_ok_and(|a| a.backend == "web-2")
        });
        assert!(switched, "{}", lab.proxy_log());
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        (client.join().unwrap(), proxy)
    });
    assert_eq!(tally.failed(), 0, "connections failed during the takeover: {tally:?}\n{}", lab.proxy_log());
    assert!(tally.by_backend.contains_key("web-1") && tally.by_backend.contains_key("web-2"), "{tally:?}");
    let after = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 20);
    assert_eq!(after.by_backend.keys().collect::<Vec<_>>(), vec!["web-2"], "{after:?}");

    // Gone: kube-proxy's tables, chains and jumps; kubelet's KUBE-FIREWALL and its jumps stay.
    let listing = lab.listing();
    for gone in [
        "table ip kube-proxy",
        "table ip6 kube-proxy",
        "KUBE-SERVICES",
        "KUBE-SVC-",
        "KUBE-SEP-",
        "KUBE-MARK-MASQ",
        "KUBE-POSTROUTING",
        "KUBE-FORWARD",
        "KUBE-PROXY-CANARY",
        "KUBE-NODEPORTS",
        "KUBE-EXTERNAL-SERVICES",
    ] {
        assert!(!listing.contains(gone), "{gone} is left:\n{listing}");
    }
    assert!(listing.contains("chain KUBE-FIREWALL") && listing.contains("jump KUBE-FIREWALL"), "{listing}");
    assert!(listing.contains("table ip nftproxy"));

    // One generation: the deletions and nftproxy's tables were committed together.
    let _ = monitor.kill();
    let _ = monitor.wait();
    let mut text = String::new();
    std::fs::File::open(&monitor_path).unwrap().read_to_string(&mut text).unwrap();
    let generations = generations(&text);
    let removing: Vec<&(String, Vec<String>)> = generations
        .iter()
        .filter(|(_, events)| {
            events.iter().any(|e| e.starts_with("delete") && (e.contains("kube-proxy") || e.contains("KUBE-")))
        })
        .collect();
    assert_eq!(removing.len(), 1, "the leftovers went in one generation:\n{text}");
    let (who, events) = removing[0];
    assert_eq!(who, "nftproxy", "{text}");
    for expected in [
        "delete table ip kube-proxy",
        "delete table ip6 kube-proxy",
        "delete chain ip nat KUBE-SERVICES",
        "delete chain ip6 nat KUBE-SERVICES",
        "delete chain ip filter KUBE-FORWARD",
        "delete chain ip mangle KUBE-PROXY-CANARY",
        "delete rule ip nat PREROUTING handle",
        "delete rule ip filter FORWARD handle",
        "add table ip nftproxy",
    ] {
        assert!(
            events.iter().any(|e| e.starts_with(expected)),
            "{expected} is not in the generation:\n{}",
            events.join("\n")
        );
    }
    assert!(lab.proxy_log().contains("took over from kube-proxy"), "{}", lab.proxy_log());

    // Then the IPVS mode's leftovers outside nftables.
    let ns = &lab.lab.node("node1").ns;
    assert!(!ns.ip(&["link", "show", "kube-ipvs0"]).is_ok_and(|o| o.status.success()), "{}", lab.proxy_log());
    if have_ipset() {
        let sets = ns.exec("ipset", &["list", "-n"]).unwrap();
        assert!(!String::from_utf8_lossy(&sets.stdout).contains("KUBE-CLUSTER-IP"), "{}", lab.proxy_log());
    }
    assert!(lab.proxy_log().contains("removed kube-proxy's IPVS leftovers"), "{}", lab.proxy_log());
    drop(proxy);
}

#[test]
fn check_lists_what_run_removes_and_the_flag_keeps_it() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    kube_proxy_leftovers(&lab);
    let out = lab.nftproxy(&["check"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("nftproxy run removes"), "{text}");
    for line in [
        "delete table ip kube-proxy",
        "delete chain ip nat KUBE-SEP-WEB1 (flushed first)",
        "(it jumps to KUBE-SERVICES)",
        "delete chain ip6 nat KUBE-SERVICES",
    ] {
        assert!(text.contains(line), "{line}:\n{text}");
    }
    assert!(!text.contains("delete chain ip filter KUBE-FIREWALL"), "kubelet's chain stays:\n{text}");
    assert!(text.contains("then, outside nftables:") && text.contains("device kube-ipvs0"), "{text}");
    let json = lab.nftproxy(&["check", "--output", "json"]);
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(report["takeover"]["tables"], serde_json::json!(["ip kube-proxy", "ip6 kube-proxy"]));

    let _proxy = lab.run_proxy(&cluster(&lab), &["--cleanup-kube-proxy=false"]);
    let listing = lab.listing();
    assert!(listing.contains("table ip kube-proxy") && listing.contains("KUBE-SVC-WEB"), "{listing}");
    assert!(lab.lab.node("node1").ns.ip(&["link", "show", "kube-ipvs0"]).is_ok_and(|o| o.status.success()));
}

/// Sets its flag when dropped.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What `iptables-legacy-save` (or `ip6tables-legacy-save`) prints on node1.
fn legacy_save(lab: &ClusterLab, program: &str) -> String {
    let out = lab.lab.node("node1").ns.exec(program, &[]).unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A kube-proxy that ran in iptables mode with the legacy backend (its image's iptables-wrapper
/// picks the backend with more rules) leaves its chains in x_tables, out of nf_tables' sight:
/// `check` reports them as a conflict with the commands that remove them, and `run` removes
/// them right after the transaction of its first sync; kubelet's chains stay.
#[test]
fn kube_proxys_legacy_iptables_chains_go_right_after_the_first_sync() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    feed(&lab, "iptables-legacy-restore", &["--noflush"], IPTABLES);
    feed(&lab, "ip6tables-legacy-restore", &["--noflush"], IP6TABLES);
    assert_eq!(lab.ask("client", L4Proto::Tcp, "10.96.0.10:80").unwrap().backend, "web-1", "the legacy DNAT serves");

    let out = lab.nftproxy(&["check"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("then: delete chain iptables-legacy filter KUBE-FORWARD (flushed first)"), "{text}");
    let json = lab.nftproxy(&["check", "--output", "json"]);
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let legacy: Vec<&serde_json::Value> =
        report["findings"].as_array().unwrap().iter().filter(|f| f["kind"] == "kube-proxy-iptables-legacy").collect();
    let nat = legacy.iter().find(|f| f["table"] == "iptables-legacy nat").expect("the nat table's finding");
    assert_eq!(nat["severity"], "conflict");
    for part in ["holds kube-proxy iptables-mode chains: KUBE-SERVICES", "PREROUTING -> KUBE-SERVICES"] {
        assert!(nat["summary"].as_str().unwrap().contains(part), "{part}: {nat}");
    }
    for command in [
        "iptables-legacy -t nat -D PREROUTING 1",
        "iptables-legacy -t nat -X KUBE-SERVICES",
        "iptables-legacy -t nat -X KUBE-SVC-WEB",
    ] {
        assert!(nat["remedy"].as_str().unwrap().contains(command), "{command}: {nat}");
    }
    let v6 = legacy.iter().find(|f| f["table"] == "ip6tables-legacy nat").expect("the ip6 nat table's finding");
    assert!(v6["summary"].as_str().unwrap().contains("KUBE-SERVICES"), "{v6}");
    assert!(!text.contains("KUBE-FIREWALL (flushed first)"), "kubelet's chain stays:\n{text}");

    // A client connects all along: the legacy rules answer (web-1), then nftproxy's (web-2).
    let manifests = cluster(&lab);
    let stop = AtomicBool::new(false);
    let (tally, proxy) = std::thread::scope(|s| {
        let client = s.spawn(|| {
            let mut all = nftproxy_tools::lab::traffic::Tally::default();
            while !stop.load(Ordering::Relaxed) {
                let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 10);
                for (k, v) in t.by_backend {
                    *all.by_backend.entry(k).or_default() += v;
                }
                for (k, v) in t.errors {
                    *all.errors.entry(k).or_default() += v;
                }
            }
            all
        });
        let _stop_client = SetOnDrop(&stop);
        std::thread::sleep(Duration::from_millis(200));
        let proxy = lab.run_proxy(&manifests, &[]);
        let switched = lab.eventually(Duration::from_secs(10), || {
            lab.ask("client", L4Proto::Tcp, "10.96.0.10:80").is_ok_and(|a| a.backend == "web-2")
        });
        assert!(switched, "{}", lab.proxy_log());
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        (client.join().unwrap(), proxy)
    });
    assert_eq!(tally.failed(), 0, "connections failed during the takeover: {tally:?}\n{}", lab.proxy_log());
    assert!(lab.proxy_log().contains("removed kube-proxy's iptables-legacy leftovers"), "{}", lab.proxy_log());

    let v4 = legacy_save(&lab, "iptables-legacy-save");
    for gone in ["KUBE-SERVICES", "KUBE-SVC-", "KUBE-SEP-", "KUBE-MARK-MASQ", "KUBE-POSTROUTING", "KUBE-FORWARD"] {
        assert!(!v4.contains(gone), "{gone} is left:\n{v4}");
    }
    assert!(v4.contains(":KUBE-FIREWALL") && v4.contains("-A INPUT -j KUBE-FIREWALL"), "kubelet's chain stays:\n{v4}");
    assert!(v4.contains("-A KUBE-FIREWALL ! -s 127.0.0.0/8"), "its rule too:\n{v4}");
    let v6 = legacy_save(&lab, "ip6tables-legacy-save");
    assert!(!v6.contains("KUBE-SERVICES"), "{v6}");

    let json = lab.nftproxy(&["check", "--output", "json"]);
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let kinds: Vec<&str> = report["findings"].as_array().unwrap().iter().filter_map(|f| f["kind"].as_str()).collect();
    assert!(!kinds.contains(&"kube-proxy-iptables-legacy"), "{report}");
    drop(proxy);
}
