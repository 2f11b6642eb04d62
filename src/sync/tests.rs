//! The syncer's own pieces against the fake kernel; the differential oracle over synthetic
//! clusters is `integration/sync.rs`.

use super::*;
use crate::index::{Change, ClusterIndex, Update};
use crate::netlink::{FakeNetfilter, SharedFake};
use crate::nft::ast::{Chain, Element, Owner, Rule, Ruleset, Set, SetShape, Stmt, Table, Value};
use crate::nft::lower::lower_set;
use crate::nft::wire::WireElement;
use crate::plan::NodePorts;
use crate::plan::objects::BalanceMap;
use nftproxy_core::fixtures::{config, state};

fn fixed_nodeports() -> NodePortResolver {
    Box::new(|_: &ProxyConfig, _: Option<&NodeInfo>| NodePortTargets {
        v4: NodePorts::Addresses(vec!["192.168.0.2".parse().unwrap()]),
        v6: NodePorts::Addresses(vec![]),
        loopback: Vec::new(),
    })
}

/// Service `ns/web` with these endpoints on node1; `extra` goes into its spec.
fn web_with(endpoints: &[&str], extra: &str) -> String {
    let eps: String = endpoints.iter().map(|ip| format!("- {{addresses: [\"{ip}\"], nodeName: node1}}\n")).collect();
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: ns}}
spec: {{clusterIP: 10.96.0.10, ports: [{{name: http, port: 80}}]{extra}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: ns, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
{eps}"#
    )
}

fn sync(syncer: &mut Syncer, index: &mut ClusterIndex, reason: SyncReason, full: bool) -> Synced {
    let pending = index.take_pending();
    syncer.sync(index.state(), &pending, reason, full).unwrap()
}

fn reset(index: &mut ClusterIndex, yaml: &str) {
    let s = state(yaml);
    let slices = s.services().flat_map(|svc| s.slices_of(&svc.name).cloned().collect::<Vec<_>>()).collect();
    index.apply(Update::Service(Change::Reset(s.services().cloned().collect())));
    index.apply(Update::EndpointSlice(Change::Reset(slices)));
}

#[test]
fn a_partial_sync_creates_an_endpoint_map_before_the_rule_that_names_it() {
    let ips = ["10.0.1.1", "10.0.1.2", "10.0.1.3"];
    // A balanced port reaching a count no port had (its map and rule are created), then one
    // with session affinity getting its first endpoint (which balances over a window of a
    // shared map, beside its slot maps).
    for (extra, before, after, map) in [
        ("", &ips[..2], &ips[..], "service-endpoints-3"),
        (", sessionAffinity: ClientIP", &ips[..0], &ips[..1], "affinity-endpoints-0"),
    ] {
        let (kernel, mut syncer) = shared_syncer(true);
        let mut index = ClusterIndex::new();
        reset(&mut index, &web_with(before, extra));
        let first = sync(&mut syncer, &mut index, SyncReason::Startup, true);
        assert!(first.report.full);
        // A rule now names a map that does not exist yet; the fake kernel refuses a rule naming
        // a missing set, as the kernel does.
        reset(&mut index, &web_with(after, extra));
        let second = sync(&mut syncer, &mut index, SyncReason::Changes, false);
        assert!(!second.report.full);
        assert!(syncer.render(index.state()).contains(&format!("map @{map}")), "{extra}");
        // And back. An affinity port's map goes with its last element, after the rule naming
        // it; a balancing map stays, empty, with its rule, while this process runs.
        reset(&mut index, &web_with(before, extra));
        sync(&mut syncer, &mut index, SyncReason::Changes, false);
        assert!(diff(&kernel.lock().state, &syncer.desired(index.state())).is_empty(), "{extra}");
        let balancing = map.starts_with("service-endpoints-");
        assert_eq!(syncer.render(index.state()).contains(&format!("map @{map}")), balancing, "{extra}");
        if balancing {
            // The count comes back: elements only.
            reset(&mut index, &web_with(after, extra));
            sync(&mut syncer, &mut index, SyncReason::Changes, false);
            let ops = kernel.lock().applied.last().unwrap().summary();
            assert!(ops.iter().all(|o| o.contains(" element ")), "{ops:#?}");
            reset(&mut index, &web_with(before, extra));
            sync(&mut syncer, &mut index, SyncReason::Changes, false);
            // Full syncs keep it too: deleting it would be no drift repaired.
            syncer.age_read_back(READ_BACK_PERIOD);
            let full = sync(&mut syncer, &mut index, SyncReason::Periodic, true);
            assert!(full.report.full);
            assert_eq!((full.report.apply.operations, full.report.drift_repairs), (0, 0));
            assert!(syncer.render(index.state()).contains(&format!("map {map} {{")));
            // A new process plans from nothing: it deletes the empty map.
            syncer = Syncer::new(config(), Box::new(kernel.clone()), fixed_nodeports());
            sync(&mut syncer, &mut index, SyncReason::Startup, true);
            let ops = kernel.lock().applied.last().unwrap().summary();
            assert!(ops.contains(&format!("delete set ip nftproxy {map}")), "{ops:#?}");
        }
        assert!(!syncer.render(index.state()).contains(map), "{extra}");
        assert!(diff(&kernel.lock().state, &syncer.desired(index.state())).is_empty(), "{extra}");
    }
}

#[test]
fn windows_found_in_the_kernel_are_read_from_its_balancing_rules() {
    let mut table = Table::new(IpFamily::V4, "nftproxy", None);
    let window = crate::plan::placement::WINDOW;
    for (chain, map, offset, modulus) in [
        ("a", "endpoints-0", 3 * window, window),
        ("c", "endpoints-3", 0, window),
        ("service-X", "affinity-endpoints-1", window, window >> 4),
        ("local-X", "affinity-endpoints-1", 2 * window, window >> 4),
        ("old", "endpoints-0", 5 * window, 7),
        ("odd-affinity", "affinity-endpoints-1", 4 * window, 1000),
        ("foreign", "other-map", 0, window),
    ] {
        let mut c = Chain::regular(chain, Owner::infrastructure());
        let (family, map) = (IpFamily::V4, map.to_string());
        c.push(Rule::new(vec![if map.starts_with("affinity") {
            let hash = crate::nft::ast::Jhash { modulus, seed: 1, offset };
            Stmt::DnatHashMap { family, proto: crate::net::L4Proto::Tcp, hash, map }
        } else {
            Stmt::DnatNumgenMap { family, modulus, offset, map }
        }]));
        if chain == "service-X" {
            // Its slots' record rules: 13 slots.
            for j in 1..=13 {
                let hash = crate::nft::ast::Jhash { modulus, seed: 1, offset: offset + j * modulus };
                let set = "affinity-windows-1".to_string();
                c.push(Rule::new(vec![Stmt::HashLookup { family, hash, set }]));
            }
        }
        table.add_chain(c);
    }
    // Slot 2 of service-X bound to 10.0.0.2:80; slot 0 of local-X to 10.0.0.7:80; a key in no
    // window of ours.
    let mut targets = Set::new("affinity-targets-1", SetShape::SlotTargets(IpFamily::V4), Owner::infrastructure());
    let ep = |last: u8| {
        Element::values(vec![Value::Addr([10, 0, 0, last].into()), Value::Port(80)], Owner::infrastructure())
    };
    targets.insert(vec![Value::Index(window + 2)], ep(2));
    targets.insert(vec![Value::Index(2 * window)], ep(7));
    targets.insert(vec![Value::Index(9 * window)], ep(9));
    table.add_set(targets);
    let kernel = lower_ruleset(&Ruleset { tables: vec![table] });
    let crate::plan::placement::Placed { windows: found, affinity } = found_placement(&kernel);
    let id = |chain: &str| WindowId::new(IpFamily::V4, chain, 0);
    // The `endpoints-N` windows of an earlier version's chains are not read: nothing uses them
    // (the restart deletes those chains and maps).
    assert_eq!(
        found,
        vec![
            (id("local-X"), Slot { shard: 1, offset: 2 * window }),
            (id("service-X"), Slot { shard: 1, offset: window }),
        ]
    );
    assert_eq!(affinity.len(), 1);
    let (port, slots) = &affinity[0];
    assert_eq!(port.base, "X");
    assert_eq!(slots.capacity(), 13);
    assert_eq!(slots.slot_of(([10, 0, 0, 2].into(), 80)), Some(2));
    assert_eq!(slots.slot_of(([10, 0, 0, 7].into(), 80)), Some(0));
    assert_eq!(slots.slot_of(([10, 0, 0, 9].into(), 80)), None);
}

/// A port with thousands of affine endpoints has its slots in groups, each in a window of its
/// own: a restart finds each chain's first window and every slot's binding where planning put
/// them.
#[test]
fn grouped_affinity_slots_are_found_where_they_were_placed() {
    use crate::plan::placement::Placement;
    use nftproxy_core::fixtures::{AFFINITY, affine_service, plan_after};
    let yaml = format!("{AFFINITY}---\n{}", affine_service("many", "172.30.9.9", 1300, true));
    let mut placement = Placement::new();
    let plan = plan_after(&config(), &state(&yaml), &mut placement);
    let found = found_placement(&lower_ruleset(&plan.ruleset));
    let mut windows: Vec<_> = placement.windows().collect();
    windows.sort_by(|a, b| a.0.cmp(&b.0));
    let mut found_windows = found.windows.clone();
    found_windows.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(found_windows, windows);
    let mut slots: Vec<_> = placement.affinity_slots().collect();
    slots.sort_by(|a, b| a.0.cmp(&b.0));
    let mut found_slots = found.affinity.clone();
    found_slots.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(found_slots.len(), 3);
    assert!(
        found_slots.iter().any(|(_, s)| s.grouped() && s.capacity() == 1625),
        "{:?}",
        found_slots.iter().map(|(i, s)| (i, s.capacity())).collect::<Vec<_>>()
    );
    assert_eq!(found_slots, slots);
}

fn shared_syncer(owned: bool) -> (SharedFake, Syncer) {
    let kernel = SharedFake::new(FakeNetfilter::new());
    let mut c = config();
    c.table_ownership = owned;
    (kernel.clone(), Syncer::new(c, Box::new(kernel), fixed_nodeports()))
}

/// The shape before a count's map existed only while in use: the maps for 1 to 16 endpoints of
/// every kind, each declared `numgen random mod 1`, with a rule each. A restart replaces the
/// maps in use (their declaration changed), deletes the others with their rules, and keeps the
/// table, whose deletion would forget every affinity client.
#[test]
fn balancing_maps_of_the_preset_shape_are_replaced_without_re_creating_the_table() {
    let (kernel, mut syncer) = shared_syncer(true);
    let mut index = ClusterIndex::new();
    reset(&mut index, &web_with(&["10.0.1.1", "10.0.1.2"], ""));
    sync(&mut syncer, &mut index, SyncReason::Startup, true);
    {
        let mut k = kernel.lock();
        let table = &mut k.state.tables[0];
        let mut maps = Vec::new();
        for map in BalanceMap::ALL {
            for n in 1..=16 {
                let set = SharedSet::Balance(map, n);
                let old = lower_set(&SharedSet::Balance(map, 1).empty(table.family));
                let mut kernels = table.sets.get(set.name().as_ref()).cloned().unwrap_or_else(|| old.clone());
                kernels.name = set.name().into_owned();
                kernels.spec = old.spec;
                table.sets.insert(kernels.name.clone(), kernels);
                maps.push(set);
            }
        }
        for chain in crate::plan::balance_chains(table.family, maps) {
            if let Some(have) = table.chains.get_mut(&chain.name) {
                have.rules = crate::nft::lower::lower_chain(&chain).rules;
            }
        }
    }
    let mut restarted = Syncer::new(config(), Box::new(kernel.clone()), fixed_nodeports());
    let first = sync(&mut restarted, &mut index, SyncReason::Startup, true);
    let ops = kernel.lock().applied.last().unwrap().summary();
    assert!(!ops.iter().any(|o| o.starts_with("delete table")), "{ops:#?}");
    for op in [
        "flush chain ip nftproxy balance-service",
        "delete set ip nftproxy service-endpoints-2",
        "add set ip nftproxy service-endpoints-2",
        "add element ip nftproxy service-endpoints-2 (2 elements)",
        "delete set ip nftproxy service-endpoints-16",
        "delete set ip nftproxy local-nodeport-endpoints-1",
    ] {
        assert!(ops.iter().any(|o| o == op), "{op}: {ops:#?}");
    }
    assert!(first.report.apply.operations > 0);
    assert!(diff(&kernel.lock().state, &restarted.desired(index.state())).is_empty());
    let text = restarted.render(index.state());
    assert!(text.contains("numgen random mod 2 : ip daddr . th dport"), "{text}");
    assert!(!text.contains("service-endpoints-1 "), "{text}");
    let again = sync(&mut restarted, &mut index, SyncReason::Startup, true);
    assert_eq!(again.report.apply.operations, 0, "{:#?}", kernel.lock().applied.last().unwrap().summary());
}

#[test]
fn a_periodic_sync_reads_back_only_when_the_tables_may_have_changed() {
    for owned in [true, false] {
        let (kernel, mut syncer) = shared_syncer(owned);
        let mut index = ClusterIndex::new();
        reset(&mut index, &web_with(&["10.0.1.1", "10.0.1.2"], ""));
        assert!(sync(&mut syncer, &mut index, SyncReason::Startup, true).report.full);
        let transactions = kernel.lock().applied.len();
        // Nothing changed anywhere: no read-back, nothing sent.
        let quiet = sync(&mut syncer, &mut index, SyncReason::Periodic, true);
        assert!(!quiet.report.full, "owned {owned}");
        assert_eq!(kernel.lock().applied.len(), transactions);
        // A change of this process's own keeps the proof.
        reset(&mut index, &web_with(&["10.0.1.1"], ""));
        assert!(!sync(&mut syncer, &mut index, SyncReason::Changes, false).report.full);
        assert!(!sync(&mut syncer, &mut index, SyncReason::Periodic, true).report.full, "owned {owned}");
        // What the loop asks when a periodic sync falls due with changes pending.
        assert!(!syncer.periodic_needs_read_back(index.state()).unwrap(), "owned {owned}");
        // Another process commits: owned tables cannot have changed; unowned ones are read back.
        kernel.lock().foreign_commit();
        assert_eq!(syncer.periodic_needs_read_back(index.state()).unwrap(), !owned, "owned {owned}");
        let after_foreign = sync(&mut syncer, &mut index, SyncReason::Periodic, true);
        assert_eq!(after_foreign.report.full, !owned, "owned {owned}");
        // Whatever the proof, the tables are read back at least hourly.
        syncer.age_read_back(READ_BACK_PERIOD);
        assert!(syncer.periodic_needs_read_back(index.state()).unwrap(), "owned {owned}");
        assert!(sync(&mut syncer, &mut index, SyncReason::Periodic, true).report.full, "owned {owned}");
    }
}

#[test]
fn a_partial_sync_over_a_foreign_commit_becomes_a_full_one() {
    let (kernel, mut syncer) = shared_syncer(false);
    let mut index = ClusterIndex::new();
    reset(&mut index, &web_with(&["10.0.1.1"], ""));
    sync(&mut syncer, &mut index, SyncReason::Startup, true);
    kernel.lock().foreign_commit();
    reset(&mut index, &web_with(&["10.0.1.1", "10.0.1.2"], ""));
    let next = sync(&mut syncer, &mut index, SyncReason::Changes, false);
    assert!(next.report.full, "the guarded partial transaction was refused, a full sync followed");
    assert_eq!(syncer.desired(index.state()).tables.len(), kernel.lock().state.tables.len());
    // Owned tables need no guard: another process's commit changes nothing for them.
    let (kernel, mut syncer) = shared_syncer(true);
    reset(&mut index, &web_with(&["10.0.1.1"], ""));
    sync(&mut syncer, &mut index, SyncReason::Startup, true);
    kernel.lock().foreign_commit();
    reset(&mut index, &web_with(&["10.0.1.1", "10.0.1.2"], ""));
    assert!(!sync(&mut syncer, &mut index, SyncReason::Changes, false).report.full);
}

/// The health-check list is shared from sync to sync until a service's check changes, and the
/// running totals follow partial syncs as a recount would.
#[test]
fn health_checks_are_shared_until_one_changes_and_totals_follow_partial_syncs() {
    let local = ", type: LoadBalancer, externalTrafficPolicy: Local, healthCheckNodePort: 32000";
    let mut syncer = Syncer::new(config(), Box::new(FakeNetfilter::new()), fixed_nodeports());
    let mut index = ClusterIndex::new();
    reset(&mut index, &web_with(&["10.0.1.1"], local));
    let first = sync(&mut syncer, &mut index, SyncReason::Startup, true);
    assert_eq!(first.health_checks.len(), 1);
    assert_eq!(first.health_checks[0].local_endpoints_in(IpFamily::V4), 1);

    // An endpoint on another node: the local count, hence the check, stays the same.
    let remote = web_with(&["10.0.1.1"], local)
        .replace("endpoints:\n", "endpoints:\n- {addresses: [\"10.0.2.1\"], nodeName: node2}\n");
    reset(&mut index, &remote);
    let same = sync(&mut syncer, &mut index, SyncReason::Changes, false);
    assert!(!same.report.full);
    assert!(Arc::ptr_eq(&first.health_checks, &same.health_checks), "unchanged checks share one list");
    assert_eq!(same.stats, syncer.programmed.as_ref().map(|p| p.recount()).unwrap());

    // A second local endpoint changes the check: a new list.
    reset(&mut index, &web_with(&["10.0.1.1", "10.0.1.2"], local));
    let changed = sync(&mut syncer, &mut index, SyncReason::Changes, false);
    assert!(!Arc::ptr_eq(&same.health_checks, &changed.health_checks));
    assert_eq!(changed.health_checks[0].local_endpoints_in(IpFamily::V4), 2);
    assert_eq!(changed.stats, syncer.programmed.as_ref().map(|p| p.recount()).unwrap());

    // The service gone: no checks, and totals of nothing.
    reset(&mut index, "");
    let gone = sync(&mut syncer, &mut index, SyncReason::Changes, false);
    assert!(gone.health_checks.is_empty());
    assert_eq!(gone.stats, PlanStats::default());
}

/// ServiceCIDRs live in the infrastructure, which only a full sync writes: a sync asked to be
/// partial with a ServiceCIDR change pending is full, whoever calls it.
#[test]
fn a_service_cidr_change_makes_the_sync_full() {
    let (kernel, mut syncer) = shared_syncer(true);
    let mut index = ClusterIndex::new();
    reset(&mut index, &web_with(&["10.0.1.1"], ""));
    assert!(sync(&mut syncer, &mut index, SyncReason::Startup, true).report.full);
    let cidr =
        crate::model::ServiceCidrInfo { name: "kubernetes".into(), cidrs: vec!["10.96.0.0/16".parse().unwrap()] };
    index.apply(Update::ServiceCidr(Change::Apply(cidr)));
    let after = sync(&mut syncer, &mut index, SyncReason::Changes, false);
    assert!(after.report.full);
    let k = kernel.lock();
    assert!(k.state.tables[0].sets.get("service-cidrs").is_some_and(|s| !s.elements.is_empty()));
}

/// `ns/web` with session affinity over `endpoints`, synced once into a fresh fake kernel, and
/// `clients` (address, slot key) recorded in its shard's client set as the kernel would (its
/// window is the first, so its slot keys are its slot numbers): the kernel, the syncer, its
/// index and the client set's name.
fn affine_web_with_clients(
    endpoints: &[&str],
    clients: &[([u8; 4], u32)],
) -> (SharedFake, Syncer, ClusterIndex, String) {
    let (kernel, mut syncer) = shared_syncer(true);
    let mut index = ClusterIndex::new();
    reset(&mut index, &web_with(endpoints, AFFINE));
    sync(&mut syncer, &mut index, SyncReason::Startup, true);
    let mut k = kernel.lock();
    let table = k.state.tables.iter_mut().find(|t| t.family == IpFamily::V4).unwrap();
    let (name, set) = table.sets.iter_mut().find(|(n, _)| n.starts_with("affinity-clients-")).unwrap();
    for (client, slot) in clients {
        let mut key = client.to_vec();
        key.extend_from_slice(&slot.to_ne_bytes());
        let element = WireElement { data: WireData::None, userdata: None, owner: Owner::infrastructure() };
        set.elements.insert(WireKey::new(&key), element);
    }
    let name = name.clone();
    drop(k);
    (kernel, syncer, index, name)
}

const AFFINE: &str = ", sessionAffinity: ClientIP";

#[test]
fn an_affinity_endpoint_that_goes_takes_only_its_slots_clients_with_it() {
    // Clients the kernel recorded: two in slot 0 (10.0.1.1, the first seated), one in slot 1.
    let clients = [([192, 0, 2, 1], 0), ([192, 0, 2, 2], 0), ([192, 0, 2, 3], 1)];
    let (kernel, mut syncer, mut index, set) = affine_web_with_clients(&["10.0.1.1", "10.0.1.2"], &clients);
    // 10.0.1.1 goes and 10.0.1.3 comes: slot 0 is bound anew, in one partial sync.
    reset(&mut index, &web_with(&["10.0.1.2", "10.0.1.3"], AFFINE));
    assert!(!sync(&mut syncer, &mut index, SyncReason::Changes, false).report.full);
    let k = kernel.lock();
    let last = k.applied.last().unwrap();
    let forgotten: Vec<&OpKind> =
        last.ops.iter().map(|o| &o.kind).filter(|k| matches!(k, OpKind::ForgetElements { .. })).collect();
    assert_eq!(forgotten.len(), 1, "{:#?}", last.summary());
    let OpKind::ForgetElements { set: forgotten_set, keys } = forgotten[0] else { unreachable!() };
    assert_eq!((forgotten_set, keys.len()), (&set, 2));
    assert!(last.ops.iter().all(|o| matches!(
        o.kind,
        OpKind::AddElements { .. } | OpKind::DeleteElements { .. } | OpKind::ForgetElements { .. }
    )));
    let left = &k.state.tables.iter().find(|t| t.family == IpFamily::V4).unwrap().sets[&set];
    assert_eq!(left.elements.len(), 1, "slot 1's client stays");
}

/// A restart whose full sync re-creates the table (an infrastructure set's type changed) while
/// an affinity slot was bound anew during the downtime: the re-created client set starts
/// empty, so no client is deleted from it: the deletes would name a set that does not exist yet,
/// the kernel would refuse them, and the service would be left out as refused.
#[test]
fn a_re_created_table_gets_no_slot_deletes() {
    // A client in every slot, whichever the new endpoint takes.
    let clients = [([192, 0, 2, 1], 0), ([192, 0, 2, 1], 1), ([192, 0, 2, 1], 2)];
    let (kernel, syncer, _, _) = affine_web_with_clients(&["10.0.1.1", "10.0.1.2"], &clients);
    {
        let mut k = kernel.lock();
        let table = k.state.tables.iter_mut().find(|t| t.family == IpFamily::V4).unwrap();
        // As an older version would have written it: another comment, so another type.
        table.sets.get_mut("cluster-ips").unwrap().spec.userdata = Some(b"\x00\x05older\x00".to_vec());
    }
    drop(syncer);
    // The new process: 10.0.1.1 went and 10.0.1.3 came while it was down (slot 0 bound anew).
    let mut c = config();
    c.table_ownership = true;
    let mut restarted = Syncer::new(c, Box::new(kernel.clone()), fixed_nodeports());
    let mut index = ClusterIndex::new();
    reset(&mut index, &web_with(&["10.0.1.2", "10.0.1.3"], AFFINE));
    let before = kernel.lock().applied.len();
    let synced = sync(&mut restarted, &mut index, SyncReason::Startup, true);
    assert!(synced.report.full);
    assert!(restarted.excluded().is_empty(), "{:?}", restarted.excluded());
    let k = kernel.lock();
    assert_eq!(k.applied.len(), before + 1, "one transaction, accepted at once");
    let last = k.applied.last().unwrap();
    assert!(last.ops.iter().any(|o| matches!(o.kind, OpKind::DeleteTable)), "{:#?}", last.summary());
    assert!(!last.ops.iter().any(|o| matches!(o.kind, OpKind::ForgetElements { .. })), "{:#?}", last.summary());
}

#[test]
fn slot_targets_read_back_in_both_families() {
    let mut v6 = "fd00::1".parse::<std::net::Ipv6Addr>().unwrap().octets().to_vec();
    v6.extend_from_slice(&[0x1f, 0x90, 0, 0]);
    assert_eq!(target_of(IpFamily::V6, &v6), Some(("fd00::1".parse().unwrap(), 8080)));
    assert_eq!(target_of(IpFamily::V4, &[10, 0, 0, 1, 0, 80, 0, 0]), Some(([10, 0, 0, 1].into(), 80)));
    assert_eq!(target_of(IpFamily::V6, &[10, 0, 0, 1, 0, 80, 0, 0]), None, "too short for IPv6");
}
