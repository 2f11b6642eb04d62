//! The syncer against the in-memory kernel, through the public API the agent uses (index →
//! syncer): after every sync, partial or full, the kernel must hold exactly what planning
//! everything from scratch gives, whatever the change — the differential oracle.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::common::Proxy;
use nftproxy::config::ProxyConfig;
use nftproxy::model::{ClusterState, EndpointSliceInfo, NodeInfo, SliceEndpoint};
use nftproxy::net::IpFamily;
use nftproxy::netlink::{NetlinkError, SharedFake};
use nftproxy::nft::diff::{OpKind, diff};
use nftproxy::nft::wire::consts;
use nftproxy::nodeaddr::NodePortTargets;
use nftproxy::plan::NodePorts;
use nftproxy::sync::{SyncError, SyncReason, table_flags};
use nftproxy_tools::cluster::{self, Size};

/// How many refused services one sync leaves out (the syncer's limit).
const MAX_EXCLUSIONS_PER_SYNC: usize = 16;

/// The agent's two halves on node1 (cluster CIDR 10.128.0.0/9, node ports on 192.168.0.2).
fn proxy(kernel: &SharedFake) -> Proxy {
    let mut config = ProxyConfig::new("node1");
    config.cluster_cidrs = nftproxy::config::parse_cidrs("x", "10.128.0.0/9").unwrap();
    let targets = NodePortTargets::new(
        NodePorts::Addresses(vec![IpAddr::V4(Ipv4Addr::new(192, 168, 0, 2))]),
        NodePorts::Addresses(vec![]),
    );
    Proxy::with_resolver(config, kernel.clone(), Box::new(move |_: &ProxyConfig, _: Option<&NodeInfo>| targets.clone()))
}

/// Asserts the kernel equals the from-scratch plan; returns the summary of the transaction
/// the sync applied (the fake kernel's log has it).
fn check(r: &mut Proxy, kernel: &SharedFake, step: &str) -> Vec<String> {
    let synced = r.sync(SyncReason::Changes, false).unwrap_or_else(|e| panic!("{step}: {e}"));
    let desired = r.desired();
    let k = kernel.lock();
    let drift = diff(&k.state, &desired);
    assert!(drift.is_empty(), "{step}: the kernel differs from a full plan: {:#?}", drift.summary());
    let applied = k.applied.last().expect("a sync applies a transaction");
    assert_eq!(applied.ops.len(), synced.report.apply.operations, "{step}");
    applied.summary()
}

fn with_endpoints(i: usize, ips: &[IpAddr]) -> EndpointSliceInfo {
    let mut slice = cluster::slice(i, 1, 0);
    let template: SliceEndpoint = slice.endpoints[0].clone();
    slice.family = IpFamily::of(&ips[0]);
    slice.endpoints = ips.iter().map(|ip| SliceEndpoint { ip: *ip, ..template.clone() }).collect();
    slice
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn change(r: &mut Proxy, edit: impl FnOnce(&mut ClusterState)) {
    let mut state = r.state().clone();
    edit(&mut state);
    r.replace_state(state);
}

#[test]
fn partial_syncs_program_what_a_full_plan_would() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 60, endpoints: 3 }));
    let first = check(&mut r, &kernel, "initial");
    assert!(first.len() > 100);

    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(1, 4, 0));
    });
    let ops = check(&mut r, &kernel, "an endpoint added");
    assert!(ops.iter().all(|o| !o.contains("svc2") && !o.contains("add chain")), "{ops:#?}");

    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(2, 1, 0));
    });
    check(&mut r, &kernel, "down to one endpoint (the block is freed)");

    change(&mut r, |s| {
        s.remove_service(&cluster::service(3).name);
    });
    let ops = check(&mut r, &kernel, "a service deleted");
    assert!(ops.iter().any(|o| o.starts_with("delete chain")), "{ops:#?}");

    change(&mut r, |s| {
        s.upsert_service(cluster::service(100));
        s.upsert_slice(cluster::slice(100, 20, 0));
    });
    check(&mut r, &kernel, "a service added, reusing freed space");

    // svc28 has ClientIP affinity (3 endpoints, 4 slots): outgrowing its slots rewrites its
    // rules; far fewer endpoints shrink them again.
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(28, 6, 0));
    });
    let ops = check(&mut r, &kernel, "an affinity port outgrows its slots");
    assert!(ops.iter().any(|o| o.starts_with("add rule") && o.contains("/svc28/")), "{ops:#?}");
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(28, 1, 0));
    });
    check(&mut r, &kernel, "an affinity port shrinks");

    // Two services claiming one ClusterIP (bad input): the first by name wins, and when it
    // goes the other one takes over.
    change(&mut r, |s| {
        let mut svc = cluster::service(5);
        svc.ports[0].cluster_ips = cluster::service(4).ports[0].cluster_ips.clone();
        s.upsert_service(svc);
    });
    check(&mut r, &kernel, "a contested ClusterIP");
    // The winner's balancing keys move to another map; the loser's become the kernel's.
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(4, 5, 0));
    });
    check(&mut r, &kernel, "the winner of a contested ClusterIP gets more endpoints");
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(4, 3, 0));
    });
    check(&mut r, &kernel, "and as many as the other claimant again");
    change(&mut r, |s| {
        s.remove_service(&cluster::service(4).name);
    });
    check(&mut r, &kernel, "the winner of a contested ClusterIP deleted");

    // One pod behind two services: its hairpin element stays while either has it.
    let shared = ip("10.200.0.1");
    change(&mut r, |s| {
        s.upsert_slice(with_endpoints(6, &[shared, ip("10.200.0.2")]));
        s.upsert_slice(with_endpoints(7, &[shared, ip("10.200.0.3")]));
    });
    check(&mut r, &kernel, "a pod behind two services");
    change(&mut r, |s| {
        s.remove_service(&cluster::service(6).name);
    });
    check(&mut r, &kernel, "one of them deleted");
    assert!(r.render().contains("10.200.0.1 . 10.200.0.1"), "the shared pod's hairpin element stays");

    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(8, 300, 0));
    });
    check(&mut r, &kernel, "a service outgrows a shard");
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(8, 2, 1));
    });
    check(&mut r, &kernel, "and shrinks back");

    // Service 3 would have affinity in the synthetic cluster; 28 has it (i % 25 == 3).
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(28, 5, 2));
    });
    check(&mut r, &kernel, "an affinity service's endpoints replaced");

    // Switching a service to IPv6 brings the ip6 table: everything is planned again.
    change(&mut r, |s| {
        let mut svc = cluster::service(9);
        svc.ports[0].cluster_ips = vec![IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 9))];
        s.upsert_service(svc);
        s.upsert_slice(with_endpoints(9, &[ip("fd00:200::1"), ip("fd00:200::2")]));
    });
    check(&mut r, &kernel, "a dual-stack cluster");
    change(&mut r, |s| {
        s.upsert_slice(with_endpoints(9, &[ip("fd00:200::1"), ip("fd00:200::2"), ip("fd00:200::3")]));
    });
    let ops = check(&mut r, &kernel, "an IPv6 endpoint added");
    assert!(ops.iter().all(|o| o.contains("ip6 nftproxy")), "{ops:#?}");
}

#[test]
fn a_burst_of_changes_is_one_transaction_touching_only_them() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 300, endpoints: 4 }));
    check(&mut r, &kernel, "initial");
    change(&mut r, |s| {
        for i in (0..300).step_by(3) {
            s.upsert_slice(cluster::slice(i, 4, 1));
        }
    });
    let synced = r.sync(SyncReason::Changes, false).unwrap();
    assert!(!synced.report.full);
    let untouched: Vec<String> = (0..300).filter(|i| i % 3 != 0).map(|i| format!("ns{}/svc{i}:", i % 100)).collect();
    let applied = kernel.lock().applied.last().unwrap().clone();
    for op in &applied.ops {
        // New endpoints, with affinity too: elements (affinity slots are bound by data).
        assert!(
            matches!(
                op.kind,
                OpKind::AddElements { .. } | OpKind::DeleteElements { .. } | OpKind::ForgetElements { .. }
            ),
            "{op}"
        );
        for owner in op.owners() {
            assert!(!untouched.iter().any(|u| owner.to_string().starts_with(u.as_str())), "{op} touches {owner}");
        }
    }
    let desired = r.desired();
    assert!(diff(&kernel.lock().state, &desired).is_empty());
}

#[test]
fn a_failed_sync_forgets_its_memory_and_the_next_full_sync_converges() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 20, endpoints: 3 }));
    check(&mut r, &kernel, "initial");
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(1, 6, 1));
    });
    kernel.lock().fail_on = Some("endpoints-".into());
    assert!(r.sync(SyncReason::Changes, false).is_err());
    assert!(r.syncer.needs_full());
    kernel.lock().fail_on = None;
    let synced = r.sync(SyncReason::PreviousFailure, false).unwrap();
    assert!(synced.report.full);
    let desired = r.desired();
    assert!(diff(&kernel.lock().state, &desired).is_empty());
}

#[test]
fn a_service_the_kernel_refuses_is_left_out_reported_and_retried_when_it_changes() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 20, endpoints: 3 }));
    kernel.lock().refuse_owner = Some("ns7/svc7:".into());
    let synced = r.sync(SyncReason::Startup, true).expect("the others are applied");
    assert!(synced.report.full);
    let bad = cluster::service(7).name;
    assert_eq!(r.syncer.excluded().keys().collect::<Vec<_>>(), vec![&bad]);
    let problems = r.syncer.take_problems();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].object.to_string(), "Service ns7/svc7");
    assert!(problems[0].object_skipped, "{}", problems[0]);
    assert!(problems[0].reason.contains("refused its rules"), "{}", problems[0]);
    {
        let k = kernel.lock();
        assert!(diff(&k.state, &r.desired()).is_empty(), "the kernel holds everything but the refused service");
        let listing = r.render();
        assert!(!listing.contains("ns7/svc7:"), "the refused service is not programmed");
        assert!(listing.contains("ns8/svc8:") && listing.contains("ns6/svc6:"));
    }

    // Partial syncs of other services go on while it stays out.
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(3, 5, 1));
    });
    let synced = r.sync(SyncReason::Changes, false).unwrap();
    assert!(!synced.report.full);
    assert!(r.syncer.excluded().contains_key(&bad));

    // Once the kernel accepts it and it changes, it is programmed again.
    kernel.lock().refuse_owner = None;
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(7, 2, 1));
    });
    check(&mut r, &kernel, "the refused service changed");
    assert!(r.syncer.excluded().is_empty());
    assert!(r.render().contains("ns7/svc7:"));
}

#[test]
fn a_refused_shared_object_fails_the_sync_and_excludes_nobody() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 5, endpoints: 2 }));
    kernel.lock().fail_on = Some("add chain ip nftproxy services".into());
    assert!(matches!(r.sync(SyncReason::Startup, true), Err(SyncError::Netlink(NetlinkError::Rejected(_)))));
    assert!(r.syncer.excluded().is_empty() && r.syncer.take_problems().is_empty());
    assert!(r.syncer.needs_full());
    assert!(kernel.lock().state.tables.is_empty(), "nothing was applied");
}

#[test]
fn owned_tables_carry_owner_and_persist_and_unowned_keep_persist() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 3, endpoints: 1 }));
    check(&mut r, &kernel, "initial");
    let flags = kernel.lock().state.tables[0].flags;
    assert_eq!(flags, consts::TABLE_F_OWNER | consts::TABLE_F_PERSIST);
    let have = kernel.lock().state.tables[0].clone();
    assert_eq!(table_flags(false, Some(&have)), consts::TABLE_F_PERSIST, "persist cannot be toggled");
    assert_eq!(table_flags(false, None), 0);
}

#[test]
fn a_kernel_without_persist_gets_unowned_tables() {
    let kernel = SharedFake::default();
    kernel.lock().unknown_table_flags = consts::TABLE_F_PERSIST;
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 3, endpoints: 1 }));
    assert!(r.syncer.owns_tables());
    r.sync(SyncReason::Startup, true).expect("falls back to unowned tables");
    assert!(!r.syncer.owns_tables());
    assert!(r.syncer.excluded().is_empty());
    assert!(kernel.lock().state.tables.iter().all(|t| t.flags == 0));
    check(&mut r, &kernel, "later syncs");
}

#[test]
fn many_refused_services_are_left_out_over_several_syncs() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 200, endpoints: 2 }));
    // ns1/ and ns10/ to ns19/: 22 services, more than one sync leaves out.
    kernel.lock().refuse_owner = Some("ns1".into());
    assert!(r.sync(SyncReason::Startup, true).is_err(), "gives up after {MAX_EXCLUSIONS_PER_SYNC}");
    assert_eq!(r.syncer.excluded().len(), MAX_EXCLUSIONS_PER_SYNC);
    let synced = r.sync(SyncReason::PreviousFailure, true).expect("the next sync goes on");
    assert!(synced.report.full);
    assert_eq!(r.syncer.excluded().len(), 22);
    assert!(r.syncer.excluded().keys().all(|n| n.namespace.starts_with("ns1")));
    assert_eq!(r.syncer.take_problems().len(), 22, "one Problem per service, not per port or retry");
    assert!(diff(&kernel.lock().state, &r.desired()).is_empty());
}

#[test]
fn a_service_refused_after_it_was_programmed_is_taken_out() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 10, endpoints: 2 }));
    check(&mut r, &kernel, "initial");
    kernel.lock().refuse_owner = Some("ns4/svc4:".into());
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(4, 3, 1));
    });
    let synced = r.sync(SyncReason::Changes, false).expect("the rest is applied");
    assert!(synced.report.full);
    assert!(r.syncer.excluded().contains_key(&cluster::service(4).name));
    assert!(diff(&kernel.lock().state, &r.desired()).is_empty());
    assert!(!r.render().contains("ns4/svc4:"), "its old rules are gone too");
}

#[test]
fn a_restart_over_a_stale_ruleset_converges_in_one_transaction() {
    let kernel = SharedFake::default();
    let mut first = proxy(&kernel);
    first.replace_state(cluster::state(Size { services: 120, endpoints: 3 }));
    check(&mut first, &kernel, "initial");
    drop(first);

    // A new process: nothing programmed, the kernel holds the old ruleset.
    let mut second = proxy(&kernel);
    second.replace_state(cluster::changed_while_down(120));
    let ops = check(&mut second, &kernel, "restart over a stale ruleset");
    assert_eq!(kernel.lock().applied.len(), 2, "one transaction per sync");
    assert!(ops.iter().any(|o| o.starts_with("delete chain ")), "gone services' chains are deleted: {ops:#?}");
    assert!(ops.iter().any(|o| o.starts_with("delete element ip nftproxy affinity-endpoints-")), "{ops:#?}");
    assert!(ops.iter().any(|o| o.starts_with("delete element ip nftproxy local-nodeport-endpoints-")), "{ops:#?}");
    // Nothing is added again that the kernel already held: unchanged services cost nothing.
    assert!(!ops.iter().any(|o| o.contains("service-") && o.contains("/svc3/")), "{ops:#?}");

    // A further full sync finds nothing to do.
    second.syncer.read_back_next();
    let again = second.sync(SyncReason::Periodic, true).unwrap();
    assert!(again.report.full);
    assert_eq!(again.report.apply.operations, 0, "{:#?}", kernel.lock().applied.last().unwrap().summary());
    assert_eq!(again.report.drift_repairs, 0);
}

#[test]
fn a_full_sync_repairs_drift() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 40, endpoints: 3 }));
    check(&mut r, &kernel, "initial");
    {
        let mut k = kernel.lock();
        let table = &mut k.state.tables[0];
        // An element gone from a shared map, a service chain flushed, a stray element added.
        let service_ips = table.sets.get_mut("service-ips").unwrap();
        let key = service_ips.elements.keys().next().cloned().unwrap();
        service_ips.elements.remove(&key).unwrap();
        let stray = nftproxy::nft::wire::WireKey::new(&[10, 99, 99, 99, 6, 0, 0, 0, 0, 80, 0, 0]);
        let element = service_ips.elements.values().next().unwrap().clone();
        service_ips.elements.insert(stray, element);
        assert_ne!(key.bytes.as_slice(), &[10, 99, 99, 99, 6, 0, 0, 0, 0, 80, 0, 0]);
        let chain = table.chains.values_mut().find(|c| c.name.starts_with("service-")).unwrap();
        chain.rules.clear();
    }
    // Owned tables cannot drift (the kernel refuses other processes): a periodic sync trusts
    // them. Only a read-back finds what happened anyway.
    assert!(!r.sync(SyncReason::Periodic, true).unwrap().report.full);
    r.syncer.read_back_next();
    let synced = r.sync(SyncReason::Periodic, true).unwrap();
    assert!(synced.report.drift_repairs >= 3, "{}", synced.report.drift_repairs);
    assert!(diff(&kernel.lock().state, &r.desired()).is_empty());
}

#[test]
fn an_object_that_cannot_change_in_place_rebuilds_the_table_in_one_transaction() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    r.replace_state(cluster::state(Size { services: 30, endpoints: 2 }));
    check(&mut r, &kernel, "initial");
    {
        let mut k = kernel.lock();
        let chain = k.state.tables[0].chains.values_mut().find(|c| c.name.starts_with("service-")).unwrap();
        chain.userdata = Some(nftproxy::nft::wire::udata::comment("changed by hand"));
    }
    let before = kernel.lock().applied.len();
    r.syncer.read_back_next();
    let synced = r.sync(SyncReason::Periodic, true).unwrap();
    assert!(synced.report.full);
    let k = kernel.lock();
    assert_eq!(k.applied.len(), before + 1, "one transaction");
    let ops = k.applied.last().unwrap().summary();
    assert_eq!(ops[0], "delete table ip nftproxy", "{ops:#?}");
    assert!(diff(&k.state, &r.desired()).is_empty());
}

/// An affinity port grows past its slots into slot groups no endpoint is in yet, while its map
/// shard is past its load: the empty groups' windows go to a shard no endpoint uses, whose maps
/// the group chains name all the same. (Found by the randomised clusters: a 1,252-endpoint
/// Service whose second EndpointSlice came a sync after its first; the kernel refused
/// `add rule … _g5` with ENOENT, and the Service was left out.)
#[test]
fn an_affinity_port_growing_into_empty_slot_groups_gets_the_maps_they_name() {
    let kernel = SharedFake::default();
    let mut r = proxy(&kernel);
    // svc3 has ClientIP affinity.
    r.replace_state(cluster::state(Size { services: 4, endpoints: 1 }));
    check(&mut r, &kernel, "initial");
    // 1,000 endpoints: 1,250 slots in 5 groups of 255, a group's window in each map shard.
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(3, 1000, 0));
    });
    check(&mut r, &kernel, "1,000 endpoints");
    // 1,252: 1,565 slots in 7 groups. The new endpoints take the free slots of groups 3 and 4,
    // so their shards are past their load, and groups 5 and 6 are new and empty: their windows
    // go wherever one is free, and their chains name that shard's maps (the fake kernel refuses
    // a rule naming a map that does not exist). With maps of about 256 endpoints they share
    // shards that endpoints use; a window alone in a new shard is the planner's test
    // `an_empty_slot_group_alone_in_a_new_shard_gets_the_maps_its_rules_name`.
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(3, 1252, 0));
    });
    let ops = check(&mut r, &kernel, "1,252 endpoints");
    assert!(r.syncer.excluded().is_empty(), "refused: {:?}", r.syncer.excluded());
    assert!(ops.iter().any(|o| o.starts_with("add chain") && o.contains("_g6")), "{ops:#?}");
    // Back down: the groups go, and the shards nothing uses any more.
    change(&mut r, |s| {
        s.upsert_slice(cluster::slice(3, 10, 0));
    });
    let ops = check(&mut r, &kernel, "10 endpoints");
    assert!(ops.iter().any(|o| o.starts_with("delete set ip nftproxy affinity-endpoints-")), "{ops:#?}");
}
