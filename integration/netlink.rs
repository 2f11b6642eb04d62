//! The netlink layer against the real kernel, in throwaway network namespaces: every set shape
//! and statement nftproxy uses is applied in one transaction, listed by `nft`, read back, and
//! compared with what `render` prints.

use std::net::IpAddr;

use nftproxy::lab::{self, Netns};
use nftproxy::net::{IpFamily, L4Proto};
use nftproxy::netlink::{Kernel, Netfilter};
use nftproxy::nft::canonical::canonicalize;
use nftproxy::nft::lower::lower_ruleset;
use nftproxy::nft::*;

fn skip_unless_privileged() -> bool {
    if let Err(e) = lab::require_privileges() {
        eprintln!("SKIPPED: {e}");
        return true;
    }
    false
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A table with every shape and statement nftproxy emits, for one family.
fn every_shape(family: IpFamily) -> Table {
    let (svc, ep1, ep2, cidr, lo): (IpAddr, IpAddr, IpAddr, &str, Value) = match family {
        IpFamily::V4 => (ip("172.30.0.41"), ip("10.180.0.1"), ip("10.180.0.2"), "10.0.0.0/8", Value::Prefix("127.0.0.0/8".parse().unwrap())),
        IpFamily::V6 => (ip("fd00:172:30::41"), ip("fd00:10:180::1"), ip("fd00:10:180::2"), "fd00:10::/48", Value::Addr(ip("::1"))),
    };
    let infra = Owner::infrastructure;
    let own = Owner::new("ns1/svc1:p80");
    let mut t = Table::new(family, "nftproxy", Some("rules for nftproxy"));

    let mut cluster_ips = Set::new("cluster-ips", SetShape::Addresses(family), infra()).with_comment("Active ClusterIPs");
    cluster_ips.insert(vec![Value::Addr(svc)], Element::key_only(own.clone()));
    t.add_set(cluster_ips);
    let mut cidrs = Set::new("pod-cidrs", SetShape::Prefixes(family), infra());
    cidrs.insert(vec![Value::Prefix(cidr.parse().unwrap())], Element::key_only(infra()));
    t.add_set(cidrs);
    let mut hairpin = Set::new("hairpin-endpoints", SetShape::AddressPairs(family), infra());
    hairpin.insert(vec![Value::Addr(ep1), Value::Addr(ep1)], Element::key_only(own.clone()));
    t.add_set(hairpin);
    let mut service_ips = Set::new("service-ips", SetShape::ServiceVerdicts(family), infra()).with_comment("ClusterIP traffic");
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
    nodeports.insert(vec![Value::Proto(L4Proto::Tcp), Value::Port(30080)], Element::verdict(Verdict::Goto("service-A".into()), own.clone()));
    t.add_set(nodeports);
    let mut targets = Set::new("endpoints-A", SetShape::EndpointTargets(family), own.clone());
    targets.insert(vec![Value::Index(0)], Element::values(vec![Value::Addr(ep1), Value::Port(8080)], own.clone()));
    targets.insert(vec![Value::Index(1)], Element::values(vec![Value::Addr(ep2), Value::Port(8080)], own.clone()));
    t.add_set(targets);
    let mut chains = Set::new("endpoints-B", SetShape::EndpointChains, own.clone());
    chains.insert(vec![Value::Index(0)], Element::verdict(Verdict::Goto("endpoint-1".into()), own.clone()));
    chains.insert(vec![Value::Index(1)], Element::verdict(Verdict::Goto("endpoint-2".into()), own.clone()));
    t.add_set(chains);
    let mut aff = Set::new("affinity-1", SetShape::Affinity(family), own.clone());
    aff.timeout_secs = Some(10800);
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
        Stmt::Lookup { key: vec![Selector::Saddr(family), Selector::Daddr(family)], set: "hairpin-endpoints".into(), negate: false },
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
    cip.push(Rule::new(vec![Stmt::Lookup { key: vec![Selector::Daddr(family)], set: "cluster-ips".into(), negate: false }, Stmt::Reject(family)]).with_comment("Reject traffic to invalid ports of ClusterIPs"));
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
    services.push(Rule::new(vec![
        Stmt::Cmp { sel: Selector::Iifname, op: CmpOp::Ne, value: Value::Ifname("veth*".into()) },
        Stmt::Cmp { sel: Selector::Iifname, op: CmpOp::Eq, value: Value::Ifname("cbr0".into()) },
        Stmt::Verdict(Verdict::Jump("mark-for-masquerade".into())),
    ]));
    t.add_chain(services);
    let mut a = Chain::regular("service-A", own.clone());
    a.push(Rule::new(vec![
        Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(L4Proto::Tcp) },
        Stmt::DnatNumgenMap { family, modulus: 2, map: "endpoints-A".into() },
    ]).with_comment("ns1/svc1:p80"));
    t.add_chain(a);
    let mut b = Chain::regular("service-B", own.clone());
    b.push(Rule::new(vec![
        Stmt::Lookup { key: vec![Selector::Saddr(family)], set: "affinity-1".into(), negate: false },
        Stmt::Verdict(Verdict::Goto("endpoint-1".into())),
    ]));
    b.push(Rule::new(vec![Stmt::NumgenVmap { modulus: 2, map: "endpoints-B".into() }]));
    t.add_chain(b);
    let mut e1 = Chain::regular("endpoint-1", own.clone());
    e1.push(Rule::new(vec![Stmt::UpdateSet { set: "affinity-1".into(), key: Selector::Saddr(family) }]));
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

fn nft_list(ns: &Netns) -> String {
    String::from_utf8(ns.exec("nft", &["list", "ruleset"]).unwrap().stdout).unwrap()
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
    assert_eq!(canonicalize(&nft_list(&ns)), canonicalize(&rendered));

    // Reading the tables back gives what we wrote: a second sync has nothing to do.
    let again = diff(&readback, &wire);
    assert!(again.is_empty(), "read-back differs: {:#?}", again.summary());

    // Our text is valid nft input, and nft's own encoding lists identically.
    let other = Netns::create("nftf").unwrap();
    let path = std::env::temp_dir().join(format!("nftproxy-every-shape-{}.nft", std::process::id()));
    std::fs::write(&path, &rendered).unwrap();
    other.exec("nft", &["-f", path.to_str().unwrap()]).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(canonicalize(&nft_list(&other)), canonicalize(&rendered));
}
