//! `nftproxy check` against real kernels in throwaway network namespaces: foreign tables made
//! with `nft -f` (a leftover kube-proxy, firewalld, iptables-nft tables with Docker's and
//! kube-proxy's chains) beside the tables `nftproxy sync` creates.

use std::process::Output;

use crate::common::skip_unless_privileged;
use nftproxy::net::IpFamily;
use nftproxy::netlink::{Kernel, Netfilter};
use nftproxy::nft::{Op, OpKind, Owner, Transaction};
use nftproxy_tools::lab::Netns;

const MANIFESTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/cluster.yaml");

/// What an upgraded node can hold besides nftproxy: kube-proxy's nftables table left behind,
/// firewalld's table, and the tables iptables-nft writes for Docker and kube-proxy's iptables
/// mode (uppercase base chains named after the iptables built-ins).
const FOREIGN: &str = r#"
table ip kube-proxy {
    comment "rules for kube-proxy"
    chain filter-forward { type filter hook forward priority -110; policy accept; }
    chain nat-prerouting { type nat hook prerouting priority -100; policy accept; jump services; }
    chain nat-output { type nat hook output priority -100; policy accept; jump services; }
    chain nat-postrouting { type nat hook postrouting priority 100; policy accept; jump masquerading; }
    chain services { }
    chain masquerading { meta mark & 0x4000 == 0x4000 masquerade; }
}
table inet firewalld {
    chain filter_FORWARD {
        type filter hook forward priority 10; policy drop;
        ct state established,related accept
    }
    chain filter_INPUT { type filter hook input priority 10; policy accept; }
}
table ip nat {
    chain PREROUTING { type nat hook prerouting priority -100; policy accept; fib daddr type local counter jump DOCKER; }
    chain POSTROUTING { type nat hook postrouting priority 100; policy accept; }
    chain DOCKER { }
}
table ip filter {
    chain FORWARD { type filter hook forward priority 0; policy accept; counter jump KUBE-FORWARD; }
    chain KUBE-FORWARD { }
    chain KUBE-SERVICES { }
}
"#;

fn nftproxy(ns: &Netns, args: &[&str]) -> Output {
    ns.command(env!("CARGO_BIN_EXE_nftproxy")).args(args).output().unwrap()
}

fn sync(ns: &Netns) {
    let out = nftproxy(ns, &["sync", "--manifests", MANIFESTS, "--hostname-override", "node1"]);
    assert!(out.status.success(), "sync failed: {}", String::from_utf8_lossy(&out.stderr));
}

fn check(ns: &Netns, args: &[&str]) -> (Option<i32>, String) {
    let mut all = vec!["check"];
    all.extend_from_slice(args);
    let out = nftproxy(ns, &all);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.stderr.is_empty(), "check wrote to stderr: {}", String::from_utf8_lossy(&out.stderr));
    (out.status.code(), stdout)
}

#[test]
fn check_names_each_foreign_conflict_and_exits_1() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("check").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("foreign.nft");
    std::fs::write(&path, FOREIGN).unwrap();
    ns.exec("nft", &["-f", path.to_str().unwrap()]).unwrap();
    sync(&ns);

    let (code, text) = check(&ns, &[]);
    assert_eq!(code, Some(1), "{text}");
    for expected in [
        // The leftover kube-proxy: the table, and its nat chains that DNAT no later than ours.
        "CONFLICT  ip kube-proxy\n",
        "kube-proxy's nftables-mode table ip kube-proxy is here (4 base chains, 3 rules).",
        "WARNING   ip kube-proxy chain nat-prerouting (hook prerouting, priority -100)",
        "WARNING   ip kube-proxy chain nat-output (hook output, priority -100)",
        "`nft delete table ip kube-proxy`",
        // firewalld, and its forward chain that drops what it does not accept.
        "WARNING   inet firewalld\n",
        "WARNING   inet firewalld chain filter_FORWARD (hook forward, priority 10)",
        "A filter chain with policy drop and 1 rule.",
        "It sees service traffic after DNAT, addressed to the endpoints",
        // iptables-nft: Docker's nat table and its PREROUTING chain; kube-proxy's iptables mode.
        "WARNING   ip nat\n",
        "ip nat holds Docker's chains: DOCKER.",
        "WARNING   ip nat chain PREROUTING (hook prerouting, priority -100)",
        "CONFLICT  ip filter\n",
        "ip filter holds kube-proxy iptables-mode chains: KUBE-SERVICES, KUBE-FORWARD.",
        // The overview puts every chain on its hook, ours marked.
        "ip nftproxy nat-prerouting *",
        "inet firewalld filter_FORWARD",
        ": exit 1\n",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    // Conflicts are listed before warnings.
    let first_warning = text.find("WARNING").unwrap();
    assert!(text.rfind("CONFLICT").unwrap() < first_warning, "{text}");
    // nftproxy's own chains are never reported as foreign.
    assert!(!text.contains("ip nftproxy chain"), "{text}");

    let (code, json) = check(&ns, &["--output", "json"]);
    assert_eq!(code, Some(1));
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    let findings = report["findings"].as_array().unwrap();
    let has = |kind: &str, table: &str, chain: Option<&str>| {
        findings
            .iter()
            .any(|f| f["kind"] == kind && f["table"] == table && f.get("chain").and_then(|c| c.as_str()) == chain)
    };
    assert!(has("kube-proxy-nftables", "ip kube-proxy", None), "{json}");
    assert!(has("dnat-first", "ip kube-proxy", Some("nat-prerouting")), "{json}");
    assert!(has("firewalld", "inet firewalld", None), "{json}");
    assert!(has("policy-drop", "inet firewalld", Some("filter_FORWARD")), "{json}");
    assert!(has("docker", "ip nat", None), "{json}");
    assert!(has("dnat-first", "ip nat", Some("PREROUTING")), "{json}");
    assert!(has("kube-proxy-iptables", "ip filter", None), "{json}");
}

/// Beside a CNI's rules, written with iptables-nft as the CNI writes them: Calico's iptables
/// dataplane (`cali-` chains) is a warning naming the Felix setting that matches nftproxy's mode;
/// kube-router's NetworkPolicy chains (k3s and RKE2 embed them) are a note, never kube-proxy's.
/// Once Felix runs nftables (its `calico` table, no `cali-` chains) nothing is left to warn about.
#[test]
fn check_tells_cni_chains_from_kube_proxys() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("check-cni").unwrap();
    sync(&ns);
    let iptables = |args: &[&str]| {
        ns.exec("iptables-nft", args).unwrap();
    };
    for chain in ["cali-FORWARD", "KUBE-ROUTER-FORWARD"] {
        iptables(&["-t", "filter", "-N", chain]);
        iptables(&["-t", "filter", "-A", "FORWARD", "-j", chain]);
    }
    iptables(&["-t", "filter", "-N", "KUBE-NWPLCY-DEFAULT"]);
    iptables(&["-t", "filter", "-N", "KUBE-POD-FW-4K2GS3ZQ7GCAR2J7"]);

    let (code, json) = check(&ns, &["--output", "json"]);
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    let kinds: Vec<(String, String, String)> = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["severity"].to_string(), f["kind"].to_string(), f["table"].to_string()))
        .collect();
    let has = |severity: &str, kind: &str| {
        kinds.contains(&(format!("\"{severity}\""), format!("\"{kind}\""), "\"ip filter\"".to_string()))
    };
    assert!(has("warning", "calico-iptables"), "{kinds:?}");
    assert!(has("info", "kube-router-firewall"), "{kinds:?}");
    assert!(!kinds.iter().any(|(_, k, _)| k.contains("kube-proxy")), "{kinds:?}");
    assert_eq!(code, Some(1), "{json}");
    let (_, text) = check(&ns, &[]);
    assert!(text.contains("nftablesMode: Enabled"), "{text}");

    // Felix switched to nftables: its iptables chains go, its table comes.
    iptables(&["-t", "filter", "-D", "FORWARD", "-j", "cali-FORWARD"]);
    iptables(&["-t", "filter", "-X", "cali-FORWARD"]);
    ns.exec("nft", &["add table ip calico; add chain ip calico filter-FORWARD"]).unwrap();
    let (code, text) = check(&ns, &[]);
    assert!(text.contains("Calico's nftables-dataplane table ip calico is here."), "{text}");
    assert!(!text.contains("cali-"), "{text}");
    assert_eq!(code, Some(0), "{text}");
}

#[test]
fn check_exits_0_with_only_nftproxys_tables() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("checkok").unwrap();
    // Before any sync: nothing of ours here, which is worth a warning.
    let (code, text) = check(&ns, &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("nftproxy's tables (ip nftproxy, ip6 nftproxy) are not here."), "{text}");

    sync(&ns);
    let (code, text) = check(&ns, &[]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("No foreign table or chain conflicts with nftproxy's."), "{text}");
    // All four base chains were read back with their hooks and priorities.
    for line in [
        "  IPv4 prerouting\n      -100  nat     accept    4 rules  ip nftproxy nat-prerouting *\n",
        "  IPv4 input\n         0  filter  accept    2 rules  ip nftproxy filter-input *\n",
        "  IPv4 postrouting\n       100  nat     accept     1 rule  ip nftproxy nat-postrouting *\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    assert!(text.ends_with("0 conflicts, 0 warnings, 1 note: exit 0\n"), "{text}");

    // Without CAP_NET_ADMIN the ruleset cannot be read: exit 2, not 1 (which means findings).
    let out = ns
        .command("setpriv")
        .args(["--bounding-set=-net_admin", env!("CARGO_BIN_EXE_nftproxy"), "check"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("Operation not permitted"), "{stderr}");
    assert!(out.stdout.is_empty(), "no report without a ruleset");
}

#[test]
fn check_names_the_process_owning_an_nftproxy_table() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("checkowned").unwrap();
    // This test process owns `ip nftproxy` (NFT_TABLE_F_OWNER) through a socket it keeps open.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let holder = ns.spawn(move || {
        let mut kernel = Kernel::open().unwrap();
        let tx = Transaction {
            ops: vec![Op {
                family: IpFamily::V4,
                table: "nftproxy".into(),
                kind: OpKind::AddTable { flags: nftproxy::netlink::TABLE_F_OWNER, userdata: None },
                owner: Owner::infrastructure(),
            }],
        };
        kernel.apply(&tx).unwrap();
        ready_tx.send(()).unwrap();
        let _ = done_rx.recv();
    });
    ready_rx.recv().unwrap();
    let (code, text) = check(&ns, &[]);
    done_tx.send(()).unwrap();
    holder.join().unwrap().unwrap();

    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("WARNING   ip nftproxy\n"), "{text}");
    let held_by = format!(", held by process {} (", std::process::id());
    assert!(text.contains("ip nftproxy is owned by netlink port ") && text.contains(&held_by), "{text}");
    assert!(text.contains("Operation not permitted"), "{text}");
}
