//! Planner tests: the golden scenarios (`nft-templates/`, one directory each, run by
//! [`golden_scenarios`]) and the diffs between plans, applied to the kernel's rules
//! (`nft::kernel_model`) so that ordering and reference bugs fail here too.

use super::*;
use crate::fixtures::*;
use crate::model::NamespacedName;
use crate::net::L4Proto;
use crate::nft::diff::{Transaction, diff};
use crate::nft::kernel_model;
use crate::nft::lower::lower_ruleset;
use crate::nft::wire::WireRuleset;
use crate::plan::objects::SharedSet;
use crate::plan::placement::Placement;

fn wire(plan: &Plan) -> WireRuleset {
    lower_ruleset(&plan.ruleset)
}

/// Applies `from` then the diff to `to` by the kernel's rules, checks the result equals `to`,
/// and returns the diff.
fn transition(from: &Plan, to: &Plan) -> Transaction {
    let mut state = WireRuleset::default();
    kernel_model::apply(&mut state, &diff(&WireRuleset::default(), &wire(from))).unwrap();
    changed(&mut state, to).unwrap_or_else(|e| panic!("{e}"))
}

/// The diff from `state` to `to`, applied to `state` by the kernel's rules, which must accept
/// it and end equal to `to`.
fn changed(state: &mut WireRuleset, to: &Plan) -> Result<Transaction, String> {
    let tx = diff(state, &wire(to));
    kernel_model::apply(state, &tx).map_err(|e| format!("the kernel refused the diff: {e:?}\n{:#?}", tx.summary()))?;
    let left = diff(state, &wire(to));
    if !left.is_empty() {
        return Err(format!("the state after the diff differs from the plan by {:#?}", left.summary()));
    }
    Ok(tx)
}

/// Every golden scenario in `nft-templates/` (see its README.md): the rendered plan of
/// `input.yaml` is `expected.nft`, the kernel's rules accept it from nothing, and each change
/// `changes/NAME.yaml` is the transaction `changes/NAME.txt` from there, accepted by the
/// kernel's rules and ending equal to the new plan. `NFTPROXY_UPDATE_GOLDEN=1` rewrites the
/// expected files. Every difference is reported, not only the first.
#[test]
fn golden_scenarios() {
    let scenarios = Scenario::all();
    let names: Vec<&str> = scenarios.iter().map(|s| s.name.as_str()).collect();
    for known in ["affinity", "clusterip", "dualstack", "external", "topology"] {
        assert!(names.contains(&known), "the scenario {known} is missing from {names:?}");
    }
    let failures: Vec<String> = scenarios.iter().flat_map(run_scenario).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The failures of one scenario.
fn run_scenario(scenario: &Scenario) -> Vec<String> {
    let mut placement = Placement::new();
    let plan = scenario.plan(&scenario.input, &mut placement);
    let mut failures: Vec<String> =
        check_expected(&scenario.dir.join("expected.nft"), &plan.ruleset.to_string()).into_iter().collect();
    let mut created = WireRuleset::default();
    if let Err(e) = kernel_model::apply(&mut created, &diff(&WireRuleset::default(), &wire(&plan))) {
        failures.push(format!("{}: the kernel refused the ruleset: {e:?}", scenario.name));
        return failures;
    }
    for (name, manifests) in &scenario.changes {
        let mut state = created.clone();
        let after = scenario.plan(manifests, &mut placement.clone());
        match changed(&mut state, &after) {
            Ok(tx) => {
                let lines: String = tx.summary().iter().map(|l| format!("{l}\n")).collect();
                failures.extend(check_expected(&scenario.dir.join("changes").join(format!("{name}.txt")), &lines));
            }
            Err(e) => failures.push(format!("{}: change {name}: {e}", scenario.name)),
        }
    }
    failures
}

fn summary(tx: &Transaction) -> Vec<String> {
    tx.summary()
}

#[test]
fn clusterip_statistics() {
    let p = plan_with(&config(), &state(CLUSTERIP));
    assert_eq!(p.stats.service_ports, 4);
    assert_eq!(p.stats.no_endpoints, 1);
    // svc2:http has 3 ready endpoints; the terminating one is not used while ready ones exist.
    assert_eq!(p.stats.endpoints, 1 + 3 + 2);
}

#[test]
fn masquerade_all_marks_every_clusterip_packet() {
    let mut c = config();
    c.masquerade_all = true;
    let p = plan_with(&c, &state(CLUSTERIP));
    let text = p.ruleset.to_string();
    assert!(text.contains("ip daddr @cluster-ips jump mark-for-masquerade comment"));
    assert!(!text.contains("ip saddr != 10.0.0.0/8"));
    let mut none = config();
    none.cluster_cidrs.clear();
    let text = plan_with(&none, &state(CLUSTERIP)).ruleset.to_string();
    assert!(!text.contains("@cluster-ips jump mark-for-masquerade"), "no detector: no masquerade rule, as upstream");
    c.masquerade_bit = 3;
    assert!(plan_with(&c, &state(CLUSTERIP)).ruleset.to_string().contains("meta mark set meta mark | 0x00000008"));
}

#[test]
fn service_cidrs_drop_unallocated_cluster_ips_after_the_reject() {
    let with = format!(
        r#"{CLUSTERIP}---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {{name: kubernetes}}
spec: {{cidrs: [172.30.0.0/16]}}
"#
    );
    let before = plan_with(&config(), &state(CLUSTERIP));
    let after = plan_with(&config(), &state(&with));
    let text = after.ruleset.to_string();
    assert!(text.contains("set service-cidrs {\n\t\ttype ipv4_addr\n\t\tflags interval\n"), "{text}");
    assert!(text.contains("elements = { 172.30.0.0/16 }"), "{text}");
    let reject = "ct state new ip daddr @cluster-ips fib daddr type != local reject";
    let drop = "ct state new ip daddr @service-cidrs fib daddr type != local drop comment \"Drop forwarded traffic to unallocated ClusterIPs\"";
    let (r, d) = (text.find(reject).unwrap(), text.find(drop).unwrap_or_else(|| panic!("{text}")));
    assert!(r < d, "the reject of allocated ClusterIPs comes first");
    assert!(text.contains("ip daddr @service-cidrs drop comment \"Drop traffic to unallocated ClusterIPs\""));
    assert_eq!(text.matches("table ip6").count(), 0, "no IPv6 range, no ip6 table");
    // Appearing and going away are one transaction each, accepted by the kernel's rules.
    transition(&before, &after);
    transition(&after, &before);
    assert!(!before.ruleset.to_string().contains("service-cidrs"));
}

/// One service `ns/big` with `n` endpoints.
fn big_service(n: u32) -> String {
    let endpoints: String = (0..n).map(|i| format!("- {{addresses: [\"10.181.0.{}\"]}}\n", i + 1)).collect();
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: big, namespace: ns}}
spec: {{clusterIP: 172.30.1.1, ports: [{{name: http, port: 80}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: big-1, namespace: ns, labels: {{kubernetes.io/service-name: big}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
{endpoints}"#
    )
}

/// A count's map and its rule exist while some port has that many endpoints: the first port
/// to reach a count creates them, after the map and before the maps it leaves go (the rule
/// names the map); the last to leave it deletes them.
#[test]
fn a_count_s_map_and_rule_exist_while_a_port_has_that_many_endpoints() {
    let (five, six) = (plan_with(&config(), &state(&big_service(5))), plan_with(&config(), &state(&big_service(6))));
    let s = summary(&transition(&five, &six));
    for op in [
        "add set ip nftproxy service-endpoints-6",
        "add element ip nftproxy service-endpoints-6 (6 elements)",
        "flush chain ip nftproxy balance-service",
        "add rule ip nftproxy balance-service",
        "delete set ip nftproxy service-endpoints-5",
    ] {
        assert!(s.iter().any(|l| l == op), "{op} missing: {s:#?}");
    }
    let position = |op: &str| s.iter().position(|l| l == op);
    assert!(position("add set ip nftproxy service-endpoints-6") < position("add rule ip nftproxy balance-service"));
    assert!(position("add rule ip nftproxy balance-service") < position("delete set ip nftproxy service-endpoints-5"));
    let text = six.ruleset.to_string();
    assert_eq!(text.matches("map @service-endpoints-").count(), 1, "one count in use, one rule:\n{text}");
    assert!(text.contains("typeof ip daddr . meta l4proto . th dport . numgen random mod 6 : ip daddr . th dport"));
}

#[test]
fn the_same_state_plans_the_same_ruleset() {
    let a = plan_with(&config(), &state(CLUSTERIP));
    let b = plan_with(&config(), &state(CLUSTERIP));
    assert_eq!(a.ruleset, b.ruleset);
    assert!(diff(&wire(&a), &wire(&b)).is_empty());
}

#[test]
fn deleting_everything_deletes_the_tables() {
    let before = plan_with(&config(), &state(CLUSTERIP));
    let mut state = WireRuleset::default();
    kernel_model::apply(&mut state, &diff(&WireRuleset::default(), &wire(&before))).unwrap();
    let tx = diff(&state, &WireRuleset::default());
    assert_eq!(summary(&tx), vec!["delete table ip nftproxy"]);
    kernel_model::apply(&mut state, &tx).unwrap();
    assert!(state.tables.is_empty());
}

#[test]
fn external_health_checks_and_captured_ingress() {
    let p = plan_with(&config(), &state(EXTERNAL));
    let text = p.ruleset.to_string();
    assert!(!text.contains("9.9.9.9"), "ipMode Proxy ingress is not captured");
    // Only Local-policy LoadBalancers get health checks; svc2 has no local endpoint.
    assert_eq!(
        p.health_checks,
        vec![HealthCheck {
            service: NamespacedName::new("ns2", "svc2"),
            port: 30000,
            local_endpoints: [(IpFamily::V4, 0)].into(),
            families: vec![IpFamily::V4]
        }]
    );
    assert_eq!(p.stats.no_local_external, 1);
}

#[test]
fn match_all_nodeports_use_fib_and_drop_the_address_set() {
    let (v4, v6) = (NodePorts::MatchAll, NodePorts::MatchAll);
    let c = config();
    let s = state(EXTERNAL);
    let p = plan(&PlanInput { config: &c, state: &s, nodeports_v4: &v4, nodeports_v6: &v6 });
    let text = p.ruleset.to_string();
    assert!(text.contains("fib daddr type local ip daddr != 127.0.0.0/8 goto nodeports"));
    assert!(!text.contains("nodeport-ips"));
}

/// What `explain` predicts for a new TCP connection from a pod to `dst` over `plan`: per
/// endpoint its share, and the slot the connection is recorded in (affinity).
fn predicted(plan: &Plan, dst: &str) -> Vec<(std::net::IpAddr, f64, Option<u32>)> {
    use crate::explain::{Connection, LocalAddresses, Verdict, explain};
    let dst: std::net::SocketAddr = dst.parse().unwrap();
    let connection = Connection {
        source: "10.180.9.9".parse().unwrap(),
        source_port: 40000,
        destination: dst.ip(),
        destination_port: dst.port(),
        protocol: 6,
        local: false,
        input_interface: None,
    };
    let e = explain(&wire(plan), "nftproxy", "manifests", &LocalAddresses::default(), &connection).unwrap();
    e.outcomes
        .iter()
        .map(|o| {
            assert_eq!(o.verdict, Verdict::Dnat, "{}", o.reason);
            let slot = o.affinity_updates.iter().find_map(|u| u.rsplit_once(" . ")?.1.strip_suffix(" }")?.parse().ok());
            (o.endpoint.unwrap().0, o.share, slot)
        })
        .collect()
}

/// A port with more affine endpoints than one window of slots holds (255) splits its slots in
/// groups: every endpoint is still reached, new clients spread evenly over all of them, and a
/// client is recorded in the slot of the endpoint it is sent to (so it sticks there).
#[test]
fn every_endpoint_of_a_large_affine_port_is_reached_and_recorded_in_its_slot() {
    for n in [1500, 5000] {
        let mut placement = Placement::new();
        let plan = plan_after(&config(), &state(&affine_service("many", "172.30.9.9", n, true)), &mut placement);
        let slots: Vec<_> = placement.affinity_slots().collect();
        let [(_, slots)] = slots.as_slice() else { panic!("one affine port") };
        assert!(slots.grouped(), "{n} endpoints: {} slots", slots.capacity());
        let bound = slots.index();
        let outcomes = predicted(&plan, "172.30.9.9:80");
        let reached: BTreeSet<_> = outcomes.iter().map(|(ep, _, _)| *ep).collect();
        assert_eq!((outcomes.len(), reached.len()), (n as usize, n as usize), "every endpoint, once");
        let total: f64 = outcomes.iter().map(|(_, s, _)| s).sum();
        assert!((total - 1.0).abs() < 1e-9, "{total}");
        let fair = 1.0 / f64::from(n);
        for (ep, share, slot) in &outcomes {
            assert!((share / fair - 1.0).abs() < 0.1, "{ep}: {share} against {fair}");
            let want = bound.get(&(*ep, 8080)).map(|j| u32::try_from(*j).unwrap());
            assert_eq!(*slot, want, "{ep} is recorded in its own slot");
        }
    }
}

/// An empty slot group whose window sits alone in a shard no endpoint uses (a port grown
/// into new groups when every shard was past its load, or a restart finding it there) still
/// gets that shard's maps: its rules name them, and the kernel refuses a rule that names a
/// missing set. (The sync test of a port growing into empty groups no longer reaches this case
/// with maps of about 256 endpoints, so it is built here from the placement.)
#[test]
fn an_empty_slot_group_alone_in_a_new_shard_gets_the_maps_its_rules_name() {
    // 1,252 endpoints: 1,565 slots in 7 groups, groups 5 and 6 without an endpoint.
    let state = state(&affine_service("many", "172.30.9.9", 1252, true));
    let mut placement = Placement::new();
    plan_after(&config(), &state, &mut placement);
    let mut windows: Vec<_> = placement.windows().collect();
    let empty = windows.iter().position(|(id, _)| id.part == 6).expect("group 6 has a window");
    let lone = windows.iter().map(|(_, slot)| slot.shard).max().unwrap_or(0) + 1;
    windows[empty].1 = placement::Slot { shard: lone, offset: 0 };
    let group = names::group_chain(&windows[empty].0.chain, 6);
    // As a restart finds it: the window stays where the kernel has it.
    let (c, v4, v6) = (config(), NodePorts::MatchAll, NodePorts::MatchAll);
    let input = PlanInput { config: &c, state: &state, nodeports_v4: &v4, nodeports_v6: &v6 };
    let families = families(&input);
    let demands = state.services().map(|svc| (svc.name.clone(), demands(&input, &families, svc)));
    let found = Placement::settle(windows, placement.affinity_slots().collect::<Vec<_>>(), demands);
    let planned = plan_placed(&input, &found);
    assert_eq!(found.windows().filter(|(_, slot)| slot.shard == lone).count(), 1, "alone in shard {lone}");

    let names = [
        SharedSet::EndpointMap(lone).name().into_owned(),
        SharedSet::SlotWindows(lone).name().into_owned(),
        SharedSet::SlotTargets(lone).name().into_owned(),
    ];
    let table = &planned.ruleset.tables[0];
    let text = planned.ruleset.to_string();
    let rules =
        text.split(&format!("chain {group} {{")).nth(1).and_then(|c| c.split("\n\t}").next()).expect("group 6's chain");
    for name in &names {
        let set = table.sets.get(name.as_str()).unwrap_or_else(|| panic!("{name} missing"));
        assert!(set.elements.is_empty(), "{name} holds no endpoint");
        assert!(found.maps().contains(&(IpFamily::V4, SharedSet::from_name(name).unwrap())), "{name}");
    }
    assert!(rules.contains(&format!("@{}", names[0])) && rules.contains(&format!("@{}", names[1])), "{rules}");
    // The kernel's rules accept the plan from nothing, and from the plan before.
    transition(&Plan::default(), &planned);
    transition(&plan(&input), &planned);
}

/// A balanced port of thousands of endpoints (no affinity) gets its map and rule for its
/// count, and `explain` sees each endpoint's share.
#[test]
fn a_large_balanced_port_reaches_every_endpoint_evenly() {
    let plan = plan_with(&config(), &state(&affine_service("many", "172.30.9.9", 5000, false)));
    let text = plan.ruleset.to_string();
    assert!(text.contains("numgen random mod 5000 map @service-endpoints-5000"));
    let outcomes = predicted(&plan, "172.30.9.9:80");
    assert_eq!(outcomes.len(), 5000);
    assert!(outcomes.iter().all(|(_, share, slot)| (share * 5000.0 - 1.0).abs() < 1e-9 && slot.is_none()));
}

/// Both traffic policies Local on a NodePort: pods and the node reaching it are still
/// short-circuited to the cluster-wide endpoints (as upstream's `UsesClusterEndpoints`), so the
/// node port's cluster-wide endpoints are in `nodeport-endpoints-4` beside its local one.
#[test]
fn both_policies_local_still_short_circuit_to_every_endpoint() {
    let s = state(
        r#"
apiVersion: v1
kind: Service
metadata: {name: svc0, namespace: ns0}
spec:
  type: NodePort
  clusterIP: 10.96.0.1
  externalTrafficPolicy: Local
  internalTrafficPolicy: Local
  ports: [{name: http, port: 80, nodePort: 30000}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc0-a, namespace: ns0, labels: {kubernetes.io/service-name: svc0}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: ["10.128.0.1"], nodeName: node1}
- {addresses: ["10.128.0.2"], nodeName: node2}
- {addresses: ["10.128.0.3"], nodeName: node3}
- {addresses: ["10.128.0.4"], nodeName: node4}
"#,
    );
    let ruleset = plan_with(&config(), &s).ruleset;
    let text = ruleset.to_string();
    assert!(text.contains("short-circuit pod traffic"), "{text}");
    let table = &ruleset.tables[0];
    // The endpoints (address . port) each map holds for `key`, by index.
    let held = |map: &str, key: &[Value]| -> Vec<String> {
        let set = &table.sets[map];
        (0u32..)
            .map_while(|i| {
                let mut k = key.to_vec();
                k.push(Value::Index(i));
                match &set.elements.get(&k)?.data {
                    ElementData::Values(v) => Some(format!("{v:?}")),
                    _ => None,
                }
            })
            .collect()
    };
    let node_port = [Value::Proto(L4Proto::Tcp), Value::Port(30000)];
    let endpoint = |ip: &str| format!("{:?}", [Value::Addr(ip.parse().unwrap()), Value::Port(8080)]);
    // Pods and the node: every endpoint; everyone else: node1's.
    let all: Vec<String> = ["10.128.0.1", "10.128.0.2", "10.128.0.3", "10.128.0.4"].map(endpoint).to_vec();
    assert_eq!(held("nodeport-endpoints-4", &node_port), all);
    assert_eq!(held("local-nodeport-endpoints-1", &node_port), vec![endpoint("10.128.0.1")]);
    // The ClusterIP under internalTrafficPolicy Local: node1's endpoint.
    let cluster_ip = [Value::Addr("10.96.0.1".parse().unwrap()), Value::Proto(L4Proto::Tcp), Value::Port(80)];
    assert_eq!(held("service-endpoints-1", &cluster_ip), vec![endpoint("10.128.0.1")]);
    assert!(table.sets["balanced-local-nodeports"].elements.contains_key(node_port.as_slice()));
    kernel_model::apply(&mut WireRuleset::default(), &diff(&WireRuleset::default(), &lower_ruleset(&ruleset)))
        .unwrap_or_else(|e| panic!("kernel refused the plan: {e:?}\n{text}"));
}

/// A dual-stack Local LoadBalancer whose local pod has an IPv4 address only: each family's
/// health check counts its own family's local endpoints (upstream: one server per proxier).
#[test]
fn health_checks_count_local_endpoints_per_family() {
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: ns}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  healthCheckNodePort: 32100
  ipFamilies: [IPv4, IPv6]
  clusterIPs: [172.30.0.50, "fd00:172:30::50"]
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-v4, namespace: ns, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.180.0.1"], nodeName: node1}
- {addresses: ["10.180.0.2"], nodeName: node2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-v6, namespace: ns, labels: {kubernetes.io/service-name: lb}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["fd00:10:180::2"], nodeName: node2}
"#;
    let p = plan_with(&config(), &state(yaml));
    let [check] = p.health_checks.as_slice() else { panic!("{:?}", p.health_checks) };
    assert_eq!(check.families, vec![IpFamily::V4, IpFamily::V6]);
    assert_eq!((check.local_endpoints_in(IpFamily::V4), check.local_endpoints_in(IpFamily::V6)), (1, 0));
}

/// Topology (`nft-templates/topology/`): node1 is in zone-a, so the zone-b endpoint is unused,
/// and a `Local` service without an endpoint here drops.
#[test]
fn topology_uses_this_zones_endpoints_and_drops_without_a_local_one() {
    let scenario = Scenario::load("topology");
    let text = scenario.plan(&scenario.input, &mut Placement::new()).ruleset.to_string();
    assert!(!text.contains("10.180.0.3 . 8080"), "zone-b endpoint unused in zone-a");
    assert!(
        text.contains("172.30.0.43 . tcp . 80 counter packets 0 bytes 0 comment \"ns3/elsewhere:http\" : drop"),
        "{text}"
    );
}
