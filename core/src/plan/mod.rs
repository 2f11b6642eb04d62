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
mod infrastructure;
pub mod names;
pub mod objects;
pub mod placement;
mod service;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;

use crate::config::{DetectLocal, ProxyConfig};
use crate::model::{ClusterState, NamespacedName, ServiceInfo};
use crate::net::{FamilyMap, IpFamily, L4Proto};
use crate::nft::lower::{lower_elements, lower_table};
use crate::nft::wire::{SetElements, WireTable};
use crate::nft::*;
pub use balance::chains as balance_chains;
pub use balance::keep as keep_balance_maps;
pub use infrastructure::base_chains;
pub use objects::SharedSet;
use placement::{Demands, Placement, SlotLookup};

/// Where NodePort traffic is accepted in one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePorts {
    /// Every local address except loopback (`fib daddr type local`).
    MatchAll,
    /// These addresses (the `nodeport-ips` set).
    Addresses(Vec<IpAddr>),
}

/// Everything a plan depends on besides where endpoint windows are.
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    pub config: &'a ProxyConfig,
    pub state: &'a ClusterState,
    pub nodeports_v4: &'a NodePorts,
    pub nodeports_v6: &'a NodePorts,
}

impl PlanInput<'_> {
    fn nodeports(&self, family: IpFamily) -> &NodePorts {
        match family {
            IpFamily::V4 => self.nodeports_v4,
            IpFamily::V6 => self.nodeports_v6,
        }
    }
}

/// Counts describing a plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanStats {
    pub services: usize,
    pub service_ports: usize,
    /// Endpoints DNAT can reach, summed over service ports and families.
    pub endpoints: usize,
    /// Service ports with no usable endpoint anywhere (traffic rejected).
    pub no_endpoints: usize,
    /// Service ports whose internal traffic is dropped for lack of local endpoints.
    pub no_local_internal: usize,
    /// Service ports whose external traffic is dropped for lack of local endpoints.
    pub no_local_external: usize,
    /// Of `no_local_internal` and `no_local_external`, the IPv6 ones (the metrics split them
    /// by family).
    pub no_local_internal_v6: usize,
    pub no_local_external_v6: usize,
}

impl PlanStats {
    /// Adds another plan's counts to these.
    pub fn add(&mut self, other: &PlanStats) {
        self.services += other.services;
        self.service_ports += other.service_ports;
        self.endpoints += other.endpoints;
        self.no_endpoints += other.no_endpoints;
        self.no_local_internal += other.no_local_internal;
        self.no_local_external += other.no_local_external;
        self.no_local_internal_v6 += other.no_local_internal_v6;
        self.no_local_external_v6 += other.no_local_external_v6;
    }

    /// Takes another plan's counts out of these (a service replaced or gone).
    pub fn subtract(&mut self, other: &PlanStats) {
        self.services -= other.services;
        self.service_ports -= other.service_ports;
        self.endpoints -= other.endpoints;
        self.no_endpoints -= other.no_endpoints;
        self.no_local_internal -= other.no_local_internal;
        self.no_local_external -= other.no_local_external;
        self.no_local_internal_v6 -= other.no_local_internal_v6;
        self.no_local_external_v6 -= other.no_local_external_v6;
    }

    /// Service ports of `family` whose internal and external traffic is dropped for lack of
    /// local endpoints.
    pub fn no_local(&self, family: IpFamily) -> (usize, usize) {
        match family {
            IpFamily::V4 => {
                (self.no_local_internal - self.no_local_internal_v6, self.no_local_external - self.no_local_external_v6)
            }
            IpFamily::V6 => (self.no_local_internal_v6, self.no_local_external_v6),
        }
    }
}

/// A `healthCheckNodePort` to serve, with the count it reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub service: NamespacedName,
    pub port: u16,
    /// Local ready endpoints per family of the service: each family's server reports its own
    /// family's count, as each of upstream's per-family proxiers does.
    pub local_endpoints: BTreeMap<IpFamily, usize>,
    /// The service's families: its server listens on their node-port addresses only, as
    /// upstream's per-family proxiers each serve their own family's services.
    pub families: Vec<IpFamily>,
}

impl HealthCheck {
    /// Local ready endpoints in `family` (0 for a family the service does not have).
    pub fn local_endpoints_in(&self, family: IpFamily) -> usize {
        self.local_endpoints.get(&family).copied().unwrap_or(0)
    }
}

/// A UDP or SCTP service port in one family as the conntrack reconciler sees it (built in
/// `plan/conntrack.rs`): where its flows arrive and which endpoints they may still go to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConntrackTarget {
    pub name: crate::model::ServicePortName,
    pub family: IpFamily,
    pub protocol: L4Proto,
    /// Destination IP:port pairs of the service (ClusterIP, external and LB IPs).
    pub destinations: Vec<(IpAddr, u16)>,
    pub node_port: Option<u16>,
    /// Every serving endpoint of the port, cluster-wide, sorted: flows to these are kept.
    pub endpoints: Vec<(IpAddr, u16)>,
}

/// The whole desired ruleset with what observers need: what `render` prints.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub ruleset: Ruleset,
    pub stats: PlanStats,
    pub health_checks: Vec<HealthCheck>,
    pub conntrack: Vec<ConntrackTarget>,
}

/// A service's elements of the shared sets, per set.
pub type SharedElements = BTreeMap<SharedSet, BTreeMap<Vec<Value>, Element>>;

/// One service's share of one family's table.
#[derive(Debug, Clone)]
pub struct Fragment {
    /// The service's own chains and sets (service, local, external and firewall chains,
    /// affinity slot sets, source ranges), in a table of the right family and name.
    pub own: Table,
    /// Its elements of the shared sets and maps, and the maps its rules name (an entry,
    /// possibly without elements).
    pub shared: SharedElements,
}

impl Fragment {
    fn new(family: IpFamily, table: &str) -> Fragment {
        Fragment { own: Table::new(family, table, None), shared: SharedElements::new() }
    }

    /// Notes that the service's rules name a shared set, with or without elements of its own
    /// in it: a set created on demand exists while any service names it.
    fn names(&mut self, set: SharedSet) {
        self.shared.entry(set).or_default();
    }

    /// Adds an element to a shared set (a later one with the same key replaces it).
    fn add(&mut self, set: SharedSet, key: Vec<Value>, element: Element) {
        self.shared.entry(set).or_default().insert(key, element);
    }

    /// The same objects as the kernel holds them.
    pub fn lower(&self) -> WireFragment {
        let family = self.own.family;
        WireFragment {
            own: lower_table(&self.own),
            shared: self
                .shared
                .iter()
                .map(|(set, elements)| (*set, lower_elements(set.shape(family), elements)))
                .collect(),
        }
    }
}

/// A [`Fragment`] as the kernel holds it.
#[derive(Debug, Clone)]
pub struct WireFragment {
    pub own: WireTable,
    pub shared: BTreeMap<SharedSet, SetElements>,
}

/// One service's share of the ruleset.
#[derive(Debug, Clone)]
pub struct ServicePlan {
    pub service: NamespacedName,
    /// One fragment per family the plan has (empty where the service has no ClusterIP).
    pub fragments: FamilyMap<Fragment>,
    pub stats: PlanStats,
    pub health_check: Option<HealthCheck>,
    pub conntrack: Vec<ConntrackTarget>,
}

impl ServicePlan {
    /// The fragments as the kernel holds them.
    pub fn lower(&self) -> FamilyMap<WireFragment> {
        self.fragments.map(|_, f| f.lower())
    }
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
            for e in used {
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

/// Where a set goes in the table: shared sets first, then the endpoint maps in shard order,
/// then per-service sets. The kernel finds a set by scanning the table's sets in creation
/// order, so the sets most rules refer to go first.
pub fn set_rank(name: &str, infrastructure: bool) -> (u8, Option<SharedSet>) {
    match SharedSet::from_name(name) {
        Some(set) if set.on_demand() => (1, Some(set)),
        _ if infrastructure => (0, None),
        _ => (2, None),
    }
}

/// Orders a merged table's sets by [`set_rank`] (a stable sort: planning order otherwise).
pub fn order_sets(table: &mut Table) {
    let rank = |name: &str, set: &Set| set_rank(name, set.owner.is_infrastructure());
    table.sets.sort_by(|a, x, b, y| rank(a, x).cmp(&rank(b, y)));
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

fn jump(chain: &str) -> Stmt {
    Stmt::Verdict(Verdict::Jump(chain.to_string()))
}

fn goto(chain: &str) -> Stmt {
    Stmt::Verdict(Verdict::Goto(chain.to_string()))
}

fn service_key(family: IpFamily) -> Vec<Selector> {
    vec![Selector::Daddr(family), Selector::L4Proto, Selector::Dport]
}

fn port_key() -> Vec<Selector> {
    vec![Selector::L4Proto, Selector::Dport]
}

fn lookup(sel: Selector, set: &str) -> Stmt {
    Stmt::Lookup { key: vec![sel], set: set.to_string(), negate: false }
}

/// The statement matching traffic from pods (or, negated, from anything else), per detect-local
/// mode; `None` when pods cannot be told apart (then nothing is masqueraded for it and no
/// short-circuit applies, as upstream).
fn local_match(family: IpFamily, input: &PlanInput<'_>, negate: bool) -> Option<Stmt> {
    let op = if negate { CmpOp::Ne } else { CmpOp::Eq };
    match &input.config.detect_local {
        DetectLocal::ClusterCidr | DetectLocal::NodeCidr => match local_cidrs(family, input).as_slice() {
            [] => None,
            [one] if one.prefix_len() == 0 => None,
            [one] => Some(Stmt::Cmp { sel: Selector::Saddr(family), op, value: Value::Prefix(*one) }),
            // Several ranges (a node with several pod CIDRs of one family): the named interval
            // set the infrastructure holds, never an anonymous one.
            _ => Some(Stmt::Lookup {
                key: vec![Selector::Saddr(family)],
                set: objects::CLUSTER_CIDRS.to_string(),
                negate,
            }),
        },
        DetectLocal::BridgeInterface(bridge) => {
            Some(Stmt::Cmp { sel: Selector::Iifname, op, value: Value::Ifname(bridge.clone()) })
        }
        DetectLocal::InterfaceNamePrefix(prefix) => {
            Some(Stmt::Cmp { sel: Selector::Iifname, op, value: Value::Ifname(format!("{prefix}*")) })
        }
    }
}

/// The first rules of upstream's external chain for `externalTrafficPolicy: Local`: pods and
/// the node go to every endpoint, at `cluster` (the node masqueraded, as its source would be the
/// external address itself); what the caller adds next serves everyone else.
fn external_local_short_circuits(family: IpFamily, input: &PlanInput<'_>, cluster: &str) -> Vec<Rule> {
    let pods = local_match(family, input, false)
        .map(|pods| Rule::new(vec![pods, goto(cluster)]).with_comment("short-circuit pod traffic"));
    pods.into_iter()
        .chain([
            Rule::new(vec![Stmt::FibLocal(FibAddr::Saddr), jump(objects::MARK_FOR_MASQUERADE)])
                .with_comment("masquerade local traffic"),
            Rule::new(vec![Stmt::FibLocal(FibAddr::Saddr), goto(cluster)]).with_comment("short-circuit local traffic"),
        ])
        .collect()
}

/// The pod ranges of one family for the CIDR-based detect-local modes.
fn local_cidrs(family: IpFamily, input: &PlanInput<'_>) -> Vec<IpNet> {
    match &input.config.detect_local {
        DetectLocal::ClusterCidr => input.config.cluster_cidr(family).into_iter().collect(),
        DetectLocal::NodeCidr => input
            .state
            .node()
            .map(|n| n.pod_cidrs.iter().copied().filter(|c| IpFamily::of_net(c) == family).collect())
            .unwrap_or_default(),
        DetectLocal::BridgeInterface(_) | DetectLocal::InterfaceNamePrefix(_) => Vec::new(),
    }
}

#[cfg(test)]
pub mod tests;
