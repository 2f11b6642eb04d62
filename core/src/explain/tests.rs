//! The evaluator over the golden scenarios' rulesets (`nft-templates/`), planned and lowered
//! to the wire objects the kernel read-back also gives.

use std::net::IpAddr;

use super::*;
use crate::fixtures::{AFFINITY, CLUSTERIP, EXTERNAL, affine_service, config, plan_with, state};
use crate::nft::lower::lower_ruleset;
use crate::nft::wire::{LowExpr, WireRuleset};

/// The node's address in the fixtures (their node-port address).
const NODE: &str = "192.168.0.2";
/// A pod of the cluster CIDR 10.0.0.0/8 and a client outside it.
const POD: &str = "10.180.9.9";
const OUTSIDE: &str = "203.0.113.7";

fn ruleset(yaml: &str) -> WireRuleset {
    lower_ruleset(&plan_with(&config(), &state(yaml)).ruleset)
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn connection(src: &str, dst: &str, proto: u8, local: bool) -> Connection {
    let dst: std::net::SocketAddr = dst.parse().unwrap();
    Connection {
        source: ip(src),
        source_port: 40000,
        destination: dst.ip(),
        destination_port: dst.port(),
        protocol: proto,
        local,
        input_interface: None,
    }
}

fn run(rules: &WireRuleset, src: &str, dst: &str, proto: u8, local: bool) -> Explanation {
    let locals = LocalAddresses(vec![ip(NODE)]);
    explain(rules, "nftproxy", "manifests", &locals, &connection(src, dst, proto, local)).unwrap()
}

/// (endpoint, share rounded to 3 decimals, masquerade) of every outcome, sorted.
fn endpoints(e: &Explanation) -> Vec<(String, u32, bool)> {
    let mut out: Vec<_> = e
        .outcomes
        .iter()
        .map(|o| {
            let ep = o.endpoint.map(|(a, p)| format!("{a}:{p}")).unwrap_or_default();
            (ep, (o.share * 1000.0).round() as u32, o.masquerade)
        })
        .collect();
    out.sort();
    out
}

fn verdicts(e: &Explanation) -> Vec<Verdict> {
    e.outcomes.iter().map(|o| o.verdict).collect()
}

#[test]
fn a_balanced_clusterip_splits_evenly_over_its_endpoints() {
    let rules = ruleset(CLUSTERIP);
    let e = run(&rules, POD, "172.30.0.42:80", 6, false);
    assert_eq!(e.service.as_deref(), Some("ns2/svc2:http"));
    assert_eq!(e.destination_kind.as_deref(), Some("ClusterIP"));
    assert_eq!(
        endpoints(&e),
        vec![
            ("10.180.0.2:8080".into(), 333, false),
            ("10.180.2.1:8080".into(), 333, false),
            ("10.180.4.1:8080".into(), 333, false)
        ]
    );
    assert!(e.outcomes.iter().all(|o| o.verdict == Verdict::Dnat));
    // The way: nat-prerouting jumps to firewall-check (no match there) and services, which
    // goes to balance-service; then postrouting's masquerading returns.
    let chains: Vec<&str> = e.outcomes[0].path.iter().map(|s| s.chain.as_str()).collect();
    assert_eq!(
        chains,
        ["nat-prerouting", "nat-prerouting", "services", "balance-service", "nat-postrouting", "masquerading"],
    );
    let text = report::to_text(&e);
    assert!(text.contains("outcome: DNAT to the endpoints of ns2/svc2:http"), "{text}");
    assert!(text.contains("33.3%"), "{text}");
}

#[test]
fn outside_clients_of_a_clusterip_are_masqueraded_and_hairpins_too() {
    let rules = ruleset(CLUSTERIP);
    let e = run(&rules, OUTSIDE, "172.30.0.41:80", 6, false);
    assert_eq!(endpoints(&e), vec![("10.180.0.1:80".into(), 1000, true)]);
    let why = e.outcomes[0].masquerade_reason.as_deref().unwrap();
    assert!(why.contains("outside the cluster CIDR"), "{why}");
    // The endpoint reaching itself through its service.
    let e = run(&rules, "10.180.0.1", "172.30.0.41:80", 6, false);
    assert_eq!(endpoints(&e), vec![("10.180.0.1:80".into(), 1000, true)]);
    assert!(e.outcomes[0].masquerade_reason.as_deref().unwrap().contains("hairpin"));
    // Another pod: not masqueraded.
    let e = run(&rules, POD, "172.30.0.41:80", 6, false);
    assert_eq!(endpoints(&e), vec![("10.180.0.1:80".into(), 1000, false)]);
    let json: serde_json::Value = serde_json::from_str(&report::to_json(&e).unwrap()).unwrap();
    assert_eq!(json["verdict"], "dnat");
    assert_eq!(json["service"], "ns1/svc1:p80");
    assert_eq!(json["masquerade"], false);
    assert_eq!(json["endpoints"][0]["address"], "10.180.0.1:80");
    assert_eq!(json["endpoints"][0]["share"], 1.0);
    assert!(json["path"].as_array().unwrap().len() >= 3, "{json}");
}

#[test]
fn refusals_say_why() {
    let rules = ruleset(CLUSTERIP);
    // No endpoints: rejected by the no-endpoint-services element.
    let e = run(&rules, POD, "172.30.0.43:80", 6, false);
    assert_eq!(verdicts(&e), [Verdict::Reject]);
    assert!(e.outcomes[0].reason.contains("ns3/svc3:p80 has no endpoints"), "{}", e.outcomes[0].reason);
    // A port the ClusterIP does not serve.
    let e = run(&rules, POD, "172.30.0.41:81", 6, false);
    assert_eq!(verdicts(&e), [Verdict::Reject]);
    assert!(e.outcomes[0].reason.contains("does not serve"), "{}", e.outcomes[0].reason);
    assert_eq!(e.service, None);
    // Not a service at all: accepted as it is.
    let e = run(&rules, POD, "10.180.4.1:8080", 6, false);
    assert_eq!(verdicts(&e), [Verdict::Accept]);
    assert!(e.outcomes[0].path.is_empty() || e.outcomes[0].endpoint.is_none());
}

#[test]
fn external_traffic_follows_its_policy() {
    let rules = ruleset(EXTERNAL);
    // ns3/svc3: NodePort 3003 with Cluster policy, balanced and masqueraded.
    let e = run(&rules, OUTSIDE, &format!("{NODE}:3003"), 6, false);
    assert!(verdicts(&e).iter().all(|v| *v == Verdict::Dnat), "{}", report::to_text(&e));
    assert!(e.outcomes.iter().all(|o| o.masquerade));
    let why = e.outcomes[0].masquerade_reason.as_deref().unwrap();
    assert!(why.contains("externalTrafficPolicy Cluster"), "{why}");
    assert_eq!(e.destination_kind.as_deref(), Some("NodePort"));
    // ns2/svc2: Local policy, its only endpoint elsewhere: external traffic dropped…
    let e = run(&rules, OUTSIDE, "1.2.3.4:80", 6, false);
    assert_eq!(verdicts(&e), [Verdict::Drop], "{}", report::to_text(&e));
    assert!(e.outcomes[0].reason.contains("Local"), "{}", e.outcomes[0].reason);
    let e = run(&rules, OUTSIDE, &format!("{NODE}:3001"), 6, false);
    assert_eq!(verdicts(&e), [Verdict::Drop], "{}", report::to_text(&e));
    // …pods short-circuited to the endpoint, not masqueraded…
    let e = run(&rules, POD, "1.2.3.4:80", 6, false);
    assert_eq!(endpoints(&e), vec![("10.180.0.2:80".into(), 1000, false)], "{}", report::to_text(&e));
    // …and the node too, masqueraded.
    let e = run(&rules, NODE, "1.2.3.4:80", 6, true);
    assert_eq!(endpoints(&e), vec![("10.180.0.2:80".into(), 1000, true)], "{}", report::to_text(&e));
    assert!(e.outcomes[0].masquerade_reason.as_deref().unwrap().contains("node itself"));
    // ns4/svc4: an interval map of two endpoints for its ClusterIP, half each.
    let e = run(&rules, POD, "172.30.0.44:80", 6, false);
    assert_eq!(
        endpoints(&e),
        vec![("10.180.0.4:80".into(), 500, false), ("10.180.0.5:80".into(), 500, false)],
        "{}",
        report::to_text(&e)
    );
    // ns5/svc5: load-balancer source ranges.
    let e = run(&rules, "203.0.113.7", "5.6.7.8:80", 6, false);
    assert!(verdicts(&e).iter().all(|v| *v == Verdict::Dnat), "{}", report::to_text(&e));
    let e = run(&rules, "198.51.100.1", "5.6.7.8:80", 6, false);
    assert_eq!(verdicts(&e), [Verdict::Drop], "{}", report::to_text(&e));
    assert!(e.outcomes[0].reason.contains("loadBalancerSourceRanges"), "{}", e.outcomes[0].reason);
}

#[test]
fn affinity_is_evaluated_as_a_first_connection() {
    let rules = ruleset(AFFINITY);
    let e = run(&rules, POD, "172.30.0.41:80", 6, false);
    let eps = endpoints(&e);
    assert_eq!(eps.len(), 3, "{}", report::to_text(&e));
    let total: u32 = eps.iter().map(|(_, s, _)| s).sum();
    assert!((999..=1001).contains(&total), "{eps:?}");
    assert!(e.outcomes.iter().all(|o| o.affinity_updates.len() == 1));
    let text = report::to_text(&e);
    assert!(text.contains("first connection"), "{text}");
}

#[test]
fn a_foreign_expression_is_reported_not_guessed() {
    let mut rules = ruleset(CLUSTERIP);
    let table = rules.tables.iter_mut().find(|t| t.family == IpFamily::V4).unwrap();
    let services = table.chains.get_mut("services").unwrap();
    services.rules[1].exprs.insert(0, LowExpr::Foreign("counter".into()));
    let e = run(&rules, POD, "172.30.0.42:80", 6, false);
    assert_eq!(verdicts(&e), [Verdict::Unknown]);
    assert!(
        e.outcomes[0].reason.contains("foreign expression (counter) in chain services rule 2"),
        "{}",
        e.outcomes[0].reason
    );
    let json: serde_json::Value = serde_json::from_str(&report::to_json(&e).unwrap()).unwrap();
    assert_eq!(json["verdict"], "unknown");
}

#[test]
fn a_missing_table_or_mixed_families_are_errors() {
    let rules = WireRuleset::default();
    let locals = LocalAddresses::default();
    let c = connection(POD, "172.30.0.42:80", 6, false);
    assert!(matches!(explain(&rules, "nftproxy", "kernel", &locals, &c), Err(ExplainError::NoTable { .. })));
    let c = connection("fd00::1", "172.30.0.42:80", 6, false);
    assert!(matches!(explain(&rules, "nftproxy", "kernel", &locals, &c), Err(ExplainError::Families { .. })));
}

/// A connection that misses every balancing rule (no endpoint on this node) passes rules whose
/// `numgen` forks sum to a share of one only up to rounding (mod 6, mod 7): it must still reach
/// the end of the chain, not vanish.
#[test]
fn a_miss_through_every_balancing_rule_reaches_the_chain_end() {
    let rules = ruleset(EXTERNAL);
    let e = run(&rules, OUTSIDE, "192.168.99.22:80", 6, false);
    assert_eq!(verdicts(&e), [Verdict::Drop], "{}", report::to_text(&e));
    let total: f64 = e.outcomes.iter().map(|o| o.share).sum();
    assert!((total - 1.0).abs() < 1e-9, "{total}");
}

/// A Service of 5,000 endpoints, as `explain --manifests` sees it: without affinity its
/// ClusterIP is balanced by `numgen random mod 5000` over `service-endpoints-5000` (a hash map
/// keyed by the address, protocol, port and index), and every endpoint gets 1/5000; with
/// affinity its slots are split in groups, and every endpoint gets its share, the client
/// recorded in that endpoint's slot.
#[test]
fn a_service_of_5000_endpoints_is_predicted_endpoint_by_endpoint() {
    let rules = ruleset(&affine_service("big", "172.30.9.9", 5000, false));
    let e = run(&rules, POD, "172.30.9.9:80", 6, false);
    assert_eq!(e.service.as_deref(), Some("ns/big:http"));
    assert_eq!(e.outcomes.len(), 5000, "{}", e.outcomes[0].reason);
    assert!(e.outcomes.iter().all(|o| o.verdict == Verdict::Dnat && (o.share * 5000.0 - 1.0).abs() < 1e-9));
    let path = &e.outcomes[0].path;
    let step = path.iter().find(|s| s.chain == "balance-service").unwrap();
    assert!(step.action.contains("numgen random mod 5000"), "{}", step.action);
    let text = report::to_text(&e);
    assert!(text.contains("then 5000 ways") && text.contains(" 0.020%  not masqueraded"), "{}", &text[..2000]);
    let json: serde_json::Value = serde_json::from_str(&report::to_json(&e).unwrap()).unwrap();
    assert_eq!(json["endpoints"].as_array().unwrap().len(), 5000);
    assert_eq!(json["endpoints"][0]["share"], 0.0002);

    // Another service's connection is not slowed down or changed by the big one's rule.
    let both = format!("{CLUSTERIP}---\n{}", affine_service("big", "172.30.9.9", 5000, false));
    let e = run(&ruleset(&both), POD, "172.30.0.42:80", 6, false);
    assert_eq!(endpoints(&e).len(), 3);

    let rules = ruleset(&affine_service("big", "172.30.9.9", 5000, true));
    let e = run(&rules, POD, "172.30.9.9:80", 6, false);
    assert_eq!(e.outcomes.len(), 5000, "{}", e.outcomes[0].reason);
    let total: f64 = e.outcomes.iter().map(|o| o.share).sum();
    assert!((total - 1.0).abs() < 1e-9, "{total}");
    assert!(e.outcomes.iter().all(|o| o.verdict == Verdict::Dnat && (o.share * 5000.0 - 1.0).abs() < 0.1));
    assert!(e.outcomes.iter().all(|o| o.affinity_updates.len() == 1));
    let text = report::to_text(&e);
    assert!(text.contains("first connection"), "{}", &text[..2000]);
}
