//! Cluster state → desired ruleset. A pure function: no I/O, no clock, no randomness.
//!
//! The semantics are upstream kube-proxy's nftables mode; the shape is chosen for the kernel's
//! cost (see docs/design.md, "Why the ruleset has this shape"):
//! - dispatch is a few set lookups by `address . protocol . port` (the `balanced-…` sets; the
//!   verdict maps `service-ips` and `service-nodeports` for ports with chains of their own);
//! - a service port without session affinity has no chain: its addresses are keys of the
//!   `balanced-…` sets and its endpoints elements of shared maps for their count
//!   (`service-endpoints-N`, `local-endpoints-N` for `externalTrafficPolicy: Local`; see
//!   `balance`), so adding or removing a service or an endpoint is element operations, and the
//!   kernel neither validates its chains again nor scans thousands of set names;
//! - a port with session affinity has its chain, balancing over its window of shared named
//!   maps (see `placement`), and binds endpoints to its slots by map elements (see `affinity`),
//!   so its endpoint changes are elements too; no per-endpoint chains;
//! - hairpin (a pod reaching itself through its service) is one set lookup in postrouting
//!   instead of a rule per endpoint;
//! - masquerading ClusterIP traffic from outside the cluster is one rule in `services` instead
//!   of one per service;
//! - the new-connection checks upstream makes in filter chains at prerouting, forward and output
//!   (firewall, no endpoints, unserved ClusterIP ports) are made in the nat chains, which run
//!   once per connection, so later packets pass no chain of ours.
//!
//! Each service is planned alone (`plan_service`) into a `ServicePlan`: per family, its own
//! chains and sets and its elements of the shared sets. The whole ruleset is the
//! infrastructure with every service merged in, first claim of a shared key winning
//! ([`plan`]), so the syncer can plan one service again and get exactly its share.

pub mod affinity;
mod balance;
mod conntrack;
pub mod endpoints;
mod fragment;
mod infrastructure;
mod input;
pub mod names;
pub mod objects;
pub mod placement;
mod rules;
mod service;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::model::{ClusterState, Endpoint, ServiceInfo};
use crate::net::{FamilyMap, IpFamily};
use crate::nft::*;
pub use balance::chains as balance_chains;
pub use balance::keep as keep_balance_maps;
pub use fragment::{ConntrackTarget, Fragment, HealthCheck, PlanStats, ServicePlan, SharedElements, WireFragment};
pub use infrastructure::base_chains;
pub use input::{NodePorts, PlanInput};
pub use objects::{SharedSet, order_sets, set_rank};
use placement::{Demands, Placement, SlotLookup};

/// The whole desired ruleset with what observers need: what `render` prints.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub ruleset: Ruleset,
    pub stats: PlanStats,
    pub health_checks: Vec<HealthCheck>,
    pub conntrack: Vec<ConntrackTarget>,
}

/// Plans the whole ruleset with endpoint windows placed from nothing (an empty kernel:
/// `render`, tests).
pub fn plan(input: &PlanInput<'_>) -> Plan {
    let families = families(input);
    let demands = input.state.services().map(|svc| (svc.name.clone(), demands(input, &families, svc)));
    plan_placed(input, &Placement::settle([], [], demands))
}

/// Plans the whole ruleset with endpoint windows where `slots` has them.
pub fn plan_placed(input: &PlanInput<'_>, slots: &dyn SlotLookup) -> Plan {
    let mut out = Plan::default();
    let families = families(input);
    out.ruleset.tables = plan_infrastructure(input, &families).into_iter().map(|(_, t)| t).collect();
    for service in input.state.services() {
        let planned = plan_service(input, &families, service, slots);
        for (family, fragment) in planned.fragments {
            if let Some(table) = out.ruleset.tables.iter_mut().find(|t| t.family == family) {
                merge(table, fragment);
            }
        }
        out.stats.add(&planned.stats);
        out.health_checks.extend(planned.health_check);
        out.conntrack.extend(planned.conntrack);
    }
    for table in &mut out.ruleset.tables {
        order_sets(table);
        balance::fill(table);
    }
    out
}

/// The fixed part of each family's table: base chains, dispatch maps, masquerade plumbing.
pub fn plan_infrastructure(input: &PlanInput<'_>, families: &[IpFamily]) -> FamilyMap<Table> {
    FamilyMap::from_fn(families, |f| infrastructure::table(f, input))
}

/// The endpoint windows and affinity slots a service needs, in every family of `families`.
pub fn demands(input: &PlanInput<'_>, families: &[IpFamily], service: &ServiceInfo) -> Demands {
    let node = service::NodeContext::of(input);
    let mut out = Demands::default();
    for &family in families {
        // A balanced port has no window: it is skipped before its endpoints are sorted.
        for sp in service.ports.iter().filter(|sp| !service::balanced(sp)) {
            if let Some(port) = service::PortPlan::new(family, sp, input, &node) {
                port.demands(&mut out);
            }
        }
    }
    out
}

/// Plans one service in each of `families` (as [`families`] returned them), with its endpoint
/// windows where `slots` has them.
pub fn plan_service(
    input: &PlanInput<'_>,
    families: &[IpFamily],
    service: &ServiceInfo,
    slots: &dyn SlotLookup,
) -> ServicePlan {
    let node = service::NodeContext::of(input);
    let mut out = ServicePlan {
        service: service.name.clone(),
        fragments: FamilyMap::new(),
        stats: PlanStats { services: 1, ..PlanStats::default() },
        health_check: health_check(input.state, service, &input.config.hostname),
        conntrack: Vec::new(),
    };
    for &family in families {
        let mut fragment = Fragment::new(family, &input.config.table);
        let mut hairpins: BTreeMap<IpAddr, Owner> = BTreeMap::new();
        for sp in &service.ports {
            let Some(port) = service::PortPlan::new(family, sp, input, &node) else { continue };
            let used = port.write(&mut fragment, slots, &mut out);
            // One owner per port: the batch keeps every element's owner (to name it in an
            // error), and a port of 50 endpoints would otherwise hold 50 copies of its name.
            let owner = Owner::service_port(&sp.name);
            // Only an endpoint on this node can be the source of a packet this node DNATs to
            // it (a pod's packets pass its own node's rules first), so endpoints on other nodes
            // need no element; one without `nodeName` may be anywhere, so it keeps one.
            let here = |e: &Endpoint| e.node_name.as_deref().is_none_or(|n| n == input.config.hostname);
            for e in used.iter().filter(|e| here(e)) {
                hairpins.entry(e.ip).or_insert_with(|| owner.clone());
            }
        }
        for (ip, owner) in hairpins {
            fragment.add(SharedSet::Hairpin, vec![Value::Addr(ip), Value::Addr(ip)], Element::key_only(owner));
        }
        out.fragments.insert(family, fragment);
    }
    out
}

/// Merges a service's fragment into a table. Shared sets gain the fragment's elements; where two
/// services claim the same key (conflicting input), the element merged first stays, so the
/// result depends only on the services' order.
pub fn merge(table: &mut Table, fragment: Fragment) {
    let family = table.family;
    for (name, set) in fragment.own.sets {
        table.sets.entry(name).or_insert(set);
    }
    for (set, elements) in fragment.shared {
        let have = table.sets.entry(set.name().into_owned()).or_insert_with(|| set.empty(family));
        for (key, element) in elements {
            have.elements.entry(key).or_insert(element);
        }
    }
    for (name, chain) in fragment.own.chains {
        table.chains.entry(name).or_insert(chain);
    }
}

/// The health check of a Local-policy LoadBalancer service: the number of distinct local ready
/// endpoint IPs over all its ports (upstream counts 10.0.0.1:80 and 10.0.0.1:443 as one), in
/// the service's primary family. Terminating endpoints do not count: a node with only those
/// should fail the check.
fn health_check(state: &ClusterState, service: &ServiceInfo, node_name: &str) -> Option<HealthCheck> {
    let port = service.ports.iter().find_map(|p| p.health_check_node_port)?;
    let mut families: Vec<IpFamily> =
        service.ports.first().map(|p| p.cluster_ips.iter().map(IpFamily::of).collect()).unwrap_or_default();
    families.dedup();
    if families.is_empty() {
        return None;
    }
    let local_endpoints = families
        .iter()
        .map(|&family| {
            let ips: BTreeSet<IpAddr> = service
                .ports
                .iter()
                .flat_map(|sp| state.endpoints(&sp.name, family))
                .filter(|e| e.ready && e.node_name.as_deref() == Some(node_name))
                .map(|e| e.ip)
                .collect();
            (family, ips.len())
        })
        .collect();
    Some(HealthCheck { service: service.name.clone(), port, local_endpoints, families })
}

/// IPv4 always; IPv6 when anything in the cluster or the configuration uses it (ServiceCIDRs
/// included).
pub fn families(input: &PlanInput<'_>) -> Vec<IpFamily> {
    let v6 = input.config.cluster_cidrs.iter().any(|c| IpFamily::of_net(c) == IpFamily::V6)
        || input.state.has_ipv6_services()
        || input.state.node().is_some_and(|n| n.host_ips.iter().any(|ip| ip.is_ipv6()))
        // ServiceCIDR (issue 14): an IPv6 service range is dropped in the ip6 table.
        || !input.state.service_cidrs(IpFamily::V6).is_empty();
    if v6 { vec![IpFamily::V4, IpFamily::V6] } else { vec![IpFamily::V4] }
}

#[cfg(test)]
pub mod tests;
