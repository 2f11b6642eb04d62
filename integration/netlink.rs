//! The netlink layer against the real kernel, in throwaway network namespaces: every set shape
//! and statement nftproxy uses is applied in one transaction, listed by `nft`, read back, and
//! compared with what `render` prints.

use std::net::IpAddr;

use crate::common::Proxy;
use nftproxy::net::{IpFamily, L4Proto};
use nftproxy::netlink::{Kernel, Netfilter};
use nftproxy::nft::canonical::canonicalize;
use nftproxy::nft::diff::Transaction;
use nftproxy::nft::lower::lower_ruleset;
use nftproxy::nft::*;
use nftproxy::sync::{SyncReason, SyncReport};
use nftproxy_tools::lab::Netns;

use crate::common::{ruleset_of, skip_unless_privileged};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A table with every shape and statement nftproxy emits, for one family.
fn every_shape(family: IpFamily) -> Table {
    let (svc, ep1, ep2, cidr, lo): (IpAddr, IpAddr, IpAddr, &str, Value) = match family {
        IpFamily::V4 => (
            ip("172.30.0.41"),
            ip("10.180.0.1"),
            ip("10.180.0.2"),
            "10.0.0.0/8",
            Value::Prefix("127.0.0.0/8".parse().unwrap()),
        ),
        IpFamily::V6 => {
            (ip("fd00:172:30::41"), ip("fd00:10:180::1"), ip("fd00:10:180::2"), "fd00:10::/48", Value::Addr(ip("::1")))
        }
    };
    let infra = Owner::infrastructure;
    let own = Owner::from_comment("ns1/svc1:p80");
    let mut t = Table::new(family, "nftproxy", Some("rules for nftproxy"));

    let mut cluster_ips =
        Set::new("cluster-ips", SetShape::Addresses(family), infra()).with_comment("Active ClusterIPs");
    cluster_ips.insert(vec![Value::Addr(svc)], Element::key_only(own.clone()));
    t.add_set(cluster_ips);
    let mut cidrs = Set::new("pod-cidrs", SetShape::Prefixes(family), infra());
    cidrs.insert(vec![Value::Prefix(cidr.parse().unwrap())], Element::key_only(infra()));
    t.add_set(cidrs);
    let mut hairpin = Set::new("hairpin-endpoints", SetShape::AddressPairs(family), infra());
    hairpin.insert(vec![Value::Addr(ep1), Value::Addr(ep1)], Element::key_only(own.clone()));
    t.add_set(hairpin);
    let mut service_ips =
        Set::new("service-ips", SetShape::ServiceVerdicts(family), infra()).with_comment("ClusterIP traffic");
    service_ips.insert(
        vec![Value::Addr(svc), Value::Proto(L4Proto::Tcp), Value::Port(80)],
        Element::verdict(Verdict::Goto("service-A".into()), own.clone()),
    );
    t.add_set(service_ips);
    let mut no_ep = Set::new("no-endpoint-services", SetShape::ServiceVerdicts(family), infra());
    no_ep.insert(
        vec![Value::Addr(svc), Value::Proto(L4Proto::Udp), Value::Port(53)],
        Element::verdict(Verdict::Goto("reject-chain".into()), own.clone()).with_comment("ns1/svc1:dns"),
    );
    no_ep.insert(
        vec![Value::Addr(svc), Value::Proto(L4Proto::Sctp), Value::Port(9)],
        Element::verdict(Verdict::Drop, own.clone()).with_comment("ns1/svc1:sctp"),
    );
    t.add_set(no_ep);
    let mut nodeports = Set::new("service-nodeports", SetShape::PortVerdicts, infra());
    nodeports.insert(
        vec![Value::Proto(L4Proto::Tcp), Value::Port(30080)],
        Element::verdict(Verdict::Goto("service-A".into()), own.clone()),
    );
    t.add_set(nodeports);
    let mut targets = Set::new("endpoints-A", SetShape::EndpointTargets(family), own.clone());
    targets.insert(
        vec![Value::IndexRange(0, 524_287)],
        Element::values(vec![Value::Addr(ep1), Value::Port(8080)], own.clone()),
    );
    targets.insert(
        vec![Value::IndexRange(524_288, 1_048_575)],
        Element::values(vec![Value::Addr(ep2), Value::Port(8080)], own.clone()),
    );
    t.add_set(targets);
    let mut windows = Set::new("affinity-windows-0", SetShape::SlotWindows, own.clone());
    windows.insert(vec![Value::IndexRange(2_162_688, 2_195_455)], Element::key_only(own.clone()));
    windows.insert(
        vec![Value::IndexRange(2_293_760, 2_326_527)],
        Element::key_only(own.clone()).with_comment("ns1/svc1:dns"),
    );
    t.add_set(windows);
    let mut targets = Set::new("affinity-targets-0", SetShape::SlotTargets(family), own.clone());
    targets
        .insert(vec![Value::Index(2_097_152)], Element::values(vec![Value::Addr(ep1), Value::Port(53)], own.clone()));
    targets
        .insert(vec![Value::Index(2_097_154)], Element::values(vec![Value::Addr(ep2), Value::Port(53)], own.clone()));
    t.add_set(targets);
    // The balancing maps for three endpoints (a service address) and two (a node port): their
    // typeof carries the count as the rule's `numgen random mod N`.
    let mut by_index = Set::new("service-endpoints-3", SetShape::ServiceEndpoints(family, 3), infra());
    for (i, ep) in [ep1, ep2, ep1].into_iter().enumerate() {
        let key = vec![Value::Addr(svc), Value::Proto(L4Proto::Tcp), Value::Port(80), Value::Index(i as u32)];
        by_index.insert(
            key,
            Element::values(vec![Value::Addr(ep), Value::Port(8080)], own.clone()).with_comment("ns1/svc1:p80"),
        );
    }
    t.add_set(by_index);
    let mut nodeport_by_index = Set::new("nodeport-endpoints-2", SetShape::NodeportEndpoints(family, 2), infra());
    for (i, ep) in [ep1, ep2].into_iter().enumerate() {
        let key = vec![Value::Proto(L4Proto::Udp), Value::Port(30053), Value::Index(i as u32)];
        nodeport_by_index.insert(key, Element::values(vec![Value::Addr(ep), Value::Port(53)], own.clone()));
    }
    t.add_set(nodeport_by_index);
    // Clients with their port's timeout, in a set whose size is raised after it is created.
    let mut aff = Set::new("affinity-clients-0", SetShape::AffinityClients(family), own.clone());
    aff.size = Some(16_776_960);
    t.add_set(aff);

    let base = |name: &str, chain_type, hook, priority| Chain::base(name, BaseHook { chain_type, hook, priority });
    let mut pre = base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100);
    pre.push(Rule::new(vec![Stmt::Verdict(Verdict::Jump("services".into()))]));
    t.add_chain(pre);
    let mut post = base("nat-postrouting", ChainType::Nat, Hook::Postrouting, 100);
    post.push(Rule::new(vec![Stmt::Verdict(Verdict::Jump("masquerading".into()))]));
    t.add_chain(post);
    let mut fpre = base("filter-prerouting-pre-dnat", ChainType::Filter, Hook::Prerouting, -110);
    fpre.push(Rule::new(vec![Stmt::CtStateNew, Stmt::Verdict(Verdict::Jump("cluster-ips-check".into()))]));
    t.add_chain(fpre);
    t.add_chain(base("filter-output-pre-dnat", ChainType::Filter, Hook::Output, -110));
    let mut input = base("filter-input", ChainType::Filter, Hook::Input, 0).with_comment("input checks");
    input.push(Rule::new(vec![Stmt::CtStateNew, Stmt::Verdict(Verdict::Jump("service-endpoints-check".into()))]));
    t.add_chain(input);
    t.add_chain(base("nat-output", ChainType::Nat, Hook::Output, -100));

    let mut mark = Chain::regular("mark-for-masquerade", infra());
    mark.push(Rule::new(vec![Stmt::MarkOr(0x4000)]));
    t.add_chain(mark);
    let mut masq = Chain::regular("masquerading", infra());
    masq.push(Rule::new(vec![
        Stmt::CtStatusDnat,
        Stmt::Lookup {
            key: vec![Selector::Saddr(family), Selector::Daddr(family)],
            set: "hairpin-endpoints".into(),
            negate: false,
        },
        Stmt::Verdict(Verdict::Jump("mark-for-masquerade".into())),
    ]));
    masq.push(Rule::new(vec![Stmt::MarkBitsEq { mask: 0x4000, value: 0 }, Stmt::Verdict(Verdict::Return)]));
    masq.push(Rule::new(vec![Stmt::MarkXor(0x4000)]));
    masq.push(Rule::new(vec![Stmt::Masquerade { fully_random: true }]));
    t.add_chain(masq);
    let mut reject = Chain::regular("reject-chain", infra()).with_comment("helper for @no-endpoint-services");
    reject.push(Rule::new(vec![Stmt::Reject(family)]));
    t.add_chain(reject);
    let mut check = Chain::regular("service-endpoints-check", infra());
    check.push(Rule::new(vec![Stmt::Vmap {
        key: vec![Selector::Daddr(family), Selector::L4Proto, Selector::Dport],
        map: "no-endpoint-services".into(),
    }]));
    t.add_chain(check);
    let mut cip = Chain::regular("cluster-ips-check", infra());
    cip.push(
        Rule::new(vec![
            Stmt::Lookup { key: vec![Selector::Daddr(family)], set: "cluster-ips".into(), negate: false },
            Stmt::Reject(family),
        ])
        .with_comment("Reject traffic to invalid ports of ClusterIPs"),
    );
    t.add_chain(cip);
    let mut services = Chain::regular("services", infra());
    services.push(Rule::new(vec![
        Stmt::Lookup { key: vec![Selector::Daddr(family)], set: "cluster-ips".into(), negate: false },
        Stmt::Cmp { sel: Selector::Saddr(family), op: CmpOp::Ne, value: Value::Prefix(cidr.parse().unwrap()) },
        Stmt::Verdict(Verdict::Jump("mark-for-masquerade".into())),
    ]));
    services.push(Rule::new(vec![
        Stmt::Lookup { key: vec![Selector::Saddr(family)], set: "pod-cidrs".into(), negate: true },
        Stmt::Verdict(Verdict::Jump("mark-for-masquerade".into())),
    ]));
    services.push(Rule::new(vec![Stmt::Vmap {
        key: vec![Selector::Daddr(family), Selector::L4Proto, Selector::Dport],
        map: "service-ips".into(),
    }]));
    services.push(Rule::new(vec![
        Stmt::FibLocal(FibAddr::Daddr),
        Stmt::Cmp { sel: Selector::Daddr(family), op: CmpOp::Ne, value: lo },
        Stmt::Vmap { key: vec![Selector::L4Proto, Selector::Dport], map: "service-nodeports".into() },
    ]));
    // reject in a nat chain (prerouting: Linux >= 5.9), behind a negated fib test.
    services.push(Rule::new(vec![Stmt::CtStateNew, Stmt::FibNotLocal(FibAddr::Daddr), Stmt::Reject(family)]));
    services.push(Rule::new(vec![
        Stmt::Cmp { sel: Selector::Iifname, op: CmpOp::Ne, value: Value::Ifname("veth*".into()) },
        Stmt::Cmp { sel: Selector::Iifname, op: CmpOp::Eq, value: Value::Ifname("cbr0".into()) },
        Stmt::Verdict(Verdict::Jump("mark-for-masquerade".into())),
    ]));
    t.add_chain(services);
    let mut a = Chain::regular("service-A", own.clone());
    a.push(
        Rule::new(vec![
            Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(L4Proto::Tcp) },
            Stmt::DnatNumgenMap { family, modulus: 1_048_576, offset: 0, map: "endpoints-A".into() },
        ])
        .with_comment("ns1/svc1:p80"),
    );
    t.add_chain(a);
    let mut b = Chain::regular("service-B", own.clone());
    let hash = |offset| Jhash { modulus: 32_768, seed: 0x6e66_7470, offset };
    b.push(Rule::new(vec![
        Stmt::SlotLookup { family, slot: 0, set: "affinity-clients-0".into() },
        Stmt::KeyLookup { key: 2_097_152, set: "affinity-targets-0".into() },
        Stmt::UpdateSlot { family, slot: 0, set: "affinity-clients-0".into(), timeout_secs: 10800 },
        Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(L4Proto::Udp) },
        Stmt::DnatKeyMap { family, key: 2_097_152, map: "affinity-targets-0".into() },
    ]));
    b.push(Rule::new(vec![
        Stmt::HashLookup { family, hash: hash(2_129_920), set: "affinity-windows-0".into() },
        Stmt::UpdateSlot { family, slot: 1, set: "affinity-clients-0".into(), timeout_secs: 10800 },
    ]));
    b.push(
        Rule::new(vec![Stmt::DnatHashMap {
            family,
            proto: L4Proto::Udp,
            hash: hash(2_097_152),
            map: "endpoints-A".into(),
        }])
        .with_comment("ns1/svc1:dns"),
    );
    // Slot groups: the split's hash (another seed) goes to a group's chain, with its records
    // and its choice.
    let gate = Jhash { modulus: 524_288, seed: 0x6772_7570, offset: 2_162_688 };
    b.push(Rule::new(vec![
        Stmt::HashLookup { family, hash: gate, set: "affinity-windows-0".into() },
        Stmt::Verdict(Verdict::Goto("service-B_g1".into())),
    ]));
    let mut group = Chain::regular("service-B_g1", own.clone());
    group.push(Rule::new(vec![
        Stmt::HashLookup { family, hash: hash(2_129_920), set: "affinity-windows-0".into() },
        Stmt::UpdateSlot { family, slot: 256, set: "affinity-clients-0".into(), timeout_secs: 10800 },
    ]));
    group.push(
        Rule::new(vec![Stmt::DnatHashMap {
            family,
            proto: L4Proto::Tcp,
            hash: Jhash { modulus: 4096, seed: 0x6e66_7471, offset: 2_097_152 },
            map: "endpoints-A".into(),
        }])
        .with_comment("ns1/svc1:p80"),
    );
    t.add_chain(group);
    t.add_chain(b);
    let mut e1 = Chain::regular("endpoint-1", own.clone());
    e1.push(Rule::new(vec![
        Stmt::Lookup { key: vec![Selector::Saddr(family)], set: "cluster-ips".into(), negate: true },
        Stmt::Verdict(Verdict::Return),
    ]));
    e1.push(Rule::new(vec![
        Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(L4Proto::Udp) },
        Stmt::Dnat { addr: ep1, port: 53 },
    ]));
    t.add_chain(e1);
    let mut e2 = Chain::regular("endpoint-2", own.clone());
    e2.push(Rule::new(vec![
        Stmt::Cmp { sel: Selector::Saddr(family), op: CmpOp::Eq, value: Value::Addr(ep2) },
        Stmt::Verdict(Verdict::Jump("mark-for-masquerade".into())),
    ]));
    e2.push(Rule::new(vec![
        Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(L4Proto::Sctp) },
        Stmt::Dnat { addr: ep2, port: 53 },
    ]));
    t.add_chain(e2);
    t
}

fn every_shape_ruleset() -> Ruleset {
    Ruleset { tables: vec![every_shape(IpFamily::V4), every_shape(IpFamily::V6)] }
}

#[test]
fn every_shape_round_trips_through_the_kernel() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("netlink").unwrap();
    let desired = every_shape_ruleset();
    let wire = lower_ruleset(&desired);
    let names = [(IpFamily::V4, "nftproxy"), (IpFamily::V6, "nftproxy")];

    let readback = ns
        .run(|| {
            let mut kernel = Kernel::open().unwrap();
            let before = kernel.read(&names).unwrap();
            assert!(before.tables.is_empty(), "a fresh namespace has no tables");
            let tx = diff(&before, &wire);
            let stats = kernel.apply(&tx).unwrap_or_else(|e| panic!("apply failed: {e}"));
            assert!(stats.messages > 40);
            kernel.read(&names).unwrap()
        })
        .unwrap();

    // What nft lists is exactly what we render.
    let rendered = desired.to_string();
    assert_eq!(canonicalize(&ruleset_of(&ns)), canonicalize(&rendered));

    // Reading the tables back gives what we wrote: a second sync has nothing to do.
    let again = diff(&readback, &wire);
    assert!(again.is_empty(), "read-back differs: {:#?}", again.summary());

    // Our text is valid nft input, and nft's own encoding lists identically.
    let other = Netns::create("nftf").unwrap();
    let path = std::env::temp_dir().join(format!("nftproxy-every-shape-{}.nft", std::process::id()));
    std::fs::write(&path, &rendered).unwrap();
    other.exec("nft", &["-f", path.to_str().unwrap()]).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(canonicalize(&ruleset_of(&other)), canonicalize(&rendered));
    // And byte for byte: every set nft declared reads back as we declare it (its `typeof`
    // userdata included).
    let nfts = other.run(|| Kernel::open().unwrap().read(&names).unwrap()).unwrap();
    for (table, ours) in nfts.tables.iter().zip(&wire.tables) {
        for (name, set) in &ours.sets {
            let theirs = table.sets.get(name).map(|s| &s.spec);
            assert_eq!(theirs, Some(&set.spec), "{} {name}", table.family);
        }
    }
}

/// Service default/web (TCP http and UDP echo-udp, three endpoints) and one without endpoints.
const PARTIAL_CLUSTER: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080}
  - {name: echo-udp, port: 53, protocol: UDP, targetPort: 8080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-7f9c2, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: echo-udp, port: 8080, protocol: UDP}]
endpoints:
- {addresses: ["10.244.1.10"], nodeName: node1}
- {addresses: ["10.244.1.11"], nodeName: node1}
- {addresses: ["10.244.2.10"], nodeName: node2}
---
apiVersion: v1
kind: Service
metadata: {name: no-backends, namespace: default}
spec:
  clusterIP: 10.96.0.20
  ports: [{name: http, port: 80, protocol: TCP}]
"#;

fn handles(listing: &str, chain: &str) -> Vec<String> {
    let mut inside = false;
    let mut out = Vec::new();
    for line in listing.lines() {
        if line.trim_start().starts_with(&format!("chain {chain} ")) {
            inside = true;
        } else if inside && line.trim() == "}" {
            break;
        } else if inside && let Some(h) = line.split("# handle ").nth(1) {
            out.push(h.trim().to_string());
        }
    }
    out
}

/// What `nftproxy sync` does, on the calling thread (run it in a namespace): a new process's
/// one-shot full sync of `yaml` for node1, pods in `cluster_cidr`, that leaves the tables
/// unowned. Its report, its transaction and its ruleset as nft text.
fn one_shot_sync(cluster_cidr: &str, yaml: &str) -> (SyncReport, Transaction, String) {
    let mut config = nftproxy::config::ProxyConfig::new("node1");
    config.cluster_cidrs = nftproxy::config::parse_cidrs("x", cluster_cidr).unwrap();
    config.table_ownership = false;
    let mut p = Proxy::new(config, Kernel::open().unwrap());
    p.load(yaml);
    let report = p.sync(SyncReason::Startup, true).unwrap().report;
    (report, p.last_transaction(), p.render())
}

#[test]
fn one_endpoint_change_sends_only_what_changed() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("partial").unwrap();
    let yaml = PARTIAL_CLUSTER;
    let changed = yaml.replace("10.244.2.10", "10.244.2.11");
    let one_shot = |yaml: &str| one_shot_sync("10.244.0.0/16", yaml);
    let (first, _, _) = ns.run(|| one_shot(yaml)).unwrap();
    assert!(first.apply.messages > 40);
    let listing_before = String::from_utf8(ns.exec("nft", &["-a", "list", "ruleset"]).unwrap().stdout).unwrap();

    // Planning reads the node's addresses, so it runs inside the namespace too.
    let (second, transaction, planned) = ns.run(|| one_shot(&changed)).unwrap();
    // One endpoint replaced, same count: elements only, in the balancing map for that count
    // (both ports, TCP and UDP, in one message each way; the endpoint is on another node, so
    // it has no hairpin element): no chain is flushed, no rule rewritten.
    let mut ops = transaction.summary();
    ops.sort();
    let mut expected = vec![
        "add element ip nftproxy service-endpoints-3 (2 elements)".to_string(),
        "delete element ip nftproxy service-endpoints-3 (2 elements)".to_string(),
    ];
    expected.sort();
    assert_eq!(ops, expected);
    assert_eq!(second.apply.messages, 2);

    let listing_after = String::from_utf8(ns.exec("nft", &["-a", "list", "ruleset"]).unwrap().stdout).unwrap();
    assert!(listing_after.contains("10.244.2.11 . 8080") && !listing_after.contains("10.244.2.10 . 8080"));
    for chain in ["services", "masquerading", "balance-service"] {
        assert_eq!(handles(&listing_before, chain), handles(&listing_after, chain), "rules of {chain} untouched");
        assert!(!handles(&listing_after, chain).is_empty());
    }
    let plain = ruleset_of(&ns);
    assert_eq!(canonicalize(&plain), canonicalize(&planned));
}

/// An upgrade: the ruleset the previous version wrote for the external-traffic scenario (its
/// `Local` ports with three chains each and an `endpoints-0` window map) becomes this version's
/// in one transaction, without deleting the table (which would empty every affinity client
/// set): the old chains and map go, the next sync has nothing to do.
#[test]
fn a_ruleset_of_the_previous_shape_converges_without_re_creating_the_table() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("upgrade").unwrap();
    let old = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("integration/fixtures/external-previous-shape.nft");
    ns.exec("nft", &["-f", old.to_str().unwrap()]).unwrap();
    let one_shot = || one_shot_sync("10.0.0.0/8", include_str!("../nft-templates/external/input.yaml"));
    let (first, transaction, planned) = ns.run(one_shot).unwrap();
    let ops = transaction.summary();
    assert!(!ops.iter().any(|o| o.starts_with("delete table")), "{ops:#?}");
    for gone in ["delete chain ip nftproxy external-42NFTM6N-ns2/svc2/tcp/p80", "delete set ip nftproxy endpoints-0"] {
        assert!(ops.iter().any(|o| o.starts_with(gone)), "{gone}: {ops:#?}");
    }
    assert!(first.apply.messages > 0);
    assert_eq!(canonicalize(&ruleset_of(&ns)), canonicalize(&planned));
    let (again, _, _) = ns.run(one_shot).unwrap();
    assert_eq!(again.apply.messages, 0, "the read-back finds what was planned");
}

/// The affinity slot `endpoint` is bound to in a listing: the key of its element in
/// `affinity-targets-0` (slot j of a window at offset 0).
fn slot_of(listing: &str, endpoint: &str) -> String {
    let targets = listing.split("map affinity-targets-0 {").nth(1).expect("targets map");
    let element = targets.split(['{', ',']).find(|e| e.contains(&format!(": {endpoint} . 8080"))).expect("bound");
    element.split_whitespace().next().unwrap().to_string()
}

#[test]
fn an_affinity_endpoint_change_is_elements_and_forgets_its_slots_clients() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("slots").unwrap();
    // One port with ClientIP affinity (its window at offset 0: the targets' keys are the slots).
    let yaml = PARTIAL_CLUSTER
        .replace("  clusterIP: 10.96.0.10\n", "  clusterIP: 10.96.0.10\n  sessionAffinity: ClientIP\n")
        .replace("  - {name: echo-udp, port: 53, protocol: UDP, targetPort: 8080}\n", "");
    let changed = yaml.replace("10.244.2.10", "10.244.2.11");
    // A new process each time, as `nftproxy sync` is: the slots are read back from the kernel.
    let one_shot = |yaml: &str| one_shot_sync("10.244.0.0/16", yaml);
    ns.run(|| one_shot(&yaml)).unwrap();
    let list = || String::from_utf8(ns.exec("nft", &["-a", "list", "ruleset"]).unwrap().stdout).unwrap();
    let before = list();
    let set = before
        .lines()
        .find_map(|l| l.trim().strip_prefix("set affinity-clients-")?.split_once(' '))
        .map(|(n, _)| format!("affinity-clients-{n}"))
        .expect("the port's client set");
    let (going, staying) = (slot_of(&before, "10.244.2.10"), slot_of(&before, "10.244.1.10"));
    // Clients the kernel recorded for the endpoint that goes, and for one that stays.
    let (gone_client, kept_client) = (format!("192.0.2.1 . {going}"), format!("192.0.2.2 . {staying}"));
    let elements = format!("{{ {gone_client}, {kept_client} }}");
    let out = ns.exec("nft", &["add", "element", "ip", "nftproxy", &set, &elements]).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let (_, transaction, planned) = ns.run(|| one_shot(&changed)).unwrap();
    let ops = transaction.summary();
    assert!(ops.iter().all(|op| op.contains(" element ")), "elements only: {ops:#?}");
    assert!(ops.iter().any(|op| op.starts_with("add element ip nftproxy affinity-targets-0")), "{ops:#?}");
    assert!(ops.contains(&format!("destroy element ip nftproxy {set} (1 elements)")), "{ops:#?}");
    let after = list();
    let taken = slot_of(&after, "10.244.2.11");
    assert!(taken != going && taken != staying, "the new endpoint takes a slot free before the change: {taken}");
    let members = String::from_utf8(ns.exec("nft", &["list", "set", "ip", "nftproxy", &set]).unwrap().stdout).unwrap();
    assert!(!members.contains(&gone_client), "{members}");
    assert!(members.contains(&kept_client), "{members}");
    // The service port's chain: its name ends with the port, and `-a` adds `{ # handle N`.
    let port_chain = before
        .lines()
        .find_map(|l| l.trim().strip_prefix("chain service-").filter(|c| c.contains("default/web/tcp/http")))
        .and_then(|c| c.split_whitespace().next())
        .map(|c| format!("service-{c}"))
        .expect("the port's chain");
    for chain in ["services", port_chain.as_str()] {
        assert!(!handles(&before, chain).is_empty(), "{chain}");
        assert_eq!(handles(&before, chain), handles(&after, chain), "rules of {chain} untouched");
    }
    // Without the client the kernel recorded, the ruleset is exactly as planned.
    let kept = format!("{{ {kept_client} }}");
    let out = ns.exec("nft", &["delete", "element", "ip", "nftproxy", &set, &kept]).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(canonicalize(&ruleset_of(&ns)), canonicalize(&planned));
}

#[test]
fn a_rejected_element_is_traced_to_its_owner() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("errmap").unwrap();
    let family = IpFamily::V4;
    let mut table = Table::new(family, "nftproxy", None);
    let mut map = Set::new("service-ips", SetShape::ServiceVerdicts(family), Owner::infrastructure());
    for i in 1..=50u8 {
        map.insert(
            vec![Value::Addr(ip(&format!("10.96.0.{i}"))), Value::Proto(L4Proto::Tcp), Value::Port(80)],
            Element::verdict(Verdict::Goto("ok".into()), Owner::from_comment(&format!("ns/svc{i}:http"))),
        );
    }
    // This element points at a chain that does not exist.
    map.insert(
        vec![Value::Addr(ip("10.96.1.1")), Value::Proto(L4Proto::Tcp), Value::Port(80)],
        Element::verdict(Verdict::Goto("missing".into()), Owner::from_comment("ns/broken:http")),
    );
    table.add_set(map);
    table.add_chain(Chain::regular("ok", Owner::infrastructure()));
    let wire = lower_ruleset(&Ruleset { tables: vec![table] });
    let err = ns
        .run(|| {
            let mut k = Kernel::open().unwrap();
            let result = k.apply(&diff(&nftproxy::nft::WireRuleset::default(), &wire));
            // Atomic: nothing was created.
            assert!(k.read(&[(family, "nftproxy")]).unwrap().tables.is_empty());
            result
        })
        .unwrap()
        .expect_err("the kernel must refuse a goto to a missing chain");
    let nftproxy::netlink::NetlinkError::Rejected(failures) = &err else { panic!("{err}") };
    assert_eq!(failures.len(), 1, "{err}");
    assert_eq!(failures[0].errno, libc::ENOENT);
    assert_eq!(failures[0].owners, vec![Owner::from_comment("ns/broken:http")], "{err}");
    assert!(err.to_string().contains("add element ip nftproxy service-ips"), "{err}");
}

/// Every golden scenario's `expected.nft` (`nft-templates/NAME/`) loads in nft and lists as
/// written.
#[test]
fn golden_rulesets_load_in_nft_and_list_identically() {
    if skip_unless_privileged() {
        return;
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("nft-templates");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path().join("expected.nft");
        if !path.exists() {
            continue;
        }
        let ns = Netns::create("golden").unwrap();
        ns.exec("nft", &["-f", path.to_str().unwrap()]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let golden = std::fs::read_to_string(&path).unwrap();
        assert_eq!(canonicalize(&ruleset_of(&ns)), canonicalize(&golden), "{}", path.display());
        checked += 1;
    }
    assert!(checked >= 5, "{checked} scenarios in {}", dir.display());
}

#[test]
fn sync_exits_non_zero_and_says_why_when_another_process_owns_the_table() {
    if skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("owned").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let manifests = dir.path().join("cluster.yaml");
    std::fs::write(&manifests, nftproxy_tools::demo::DEMO_MANIFESTS).unwrap();
    // Another process owns a table named nftproxy (NFT_TABLE_F_OWNER): the kernel would refuse
    // every change from anyone else (EPERM), so the read-back stops and names the owner.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let holder = ns.spawn(move || {
        let mut k = Kernel::open().unwrap();
        let tx = nftproxy::nft::Transaction {
            ops: vec![nftproxy::nft::Op {
                family: IpFamily::V4,
                table: "nftproxy".into(),
                kind: nftproxy::nft::OpKind::AddTable {
                    flags: nftproxy::nft::wire::consts::TABLE_F_OWNER,
                    userdata: None,
                },
                owner: Owner::infrastructure(),
            }],
        };
        k.apply(&tx).unwrap();
        ready_tx.send(()).unwrap();
        let _ = done_rx.recv();
    });
    ready_rx.recv().unwrap();
    let out = ns
        .command(env!("CARGO_BIN_EXE_nftproxy"))
        .args(["sync", "--manifests", manifests.to_str().unwrap(), "--hostname-override", "node1"])
        .output()
        .unwrap();
    done_tx.send(()).unwrap();
    holder.join().unwrap().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("table ip nftproxy is owned by another process (netlink port "), "{stderr}");
}
