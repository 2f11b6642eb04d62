//! Cluster state → desired ruleset. A pure function: no I/O, no clock, no randomness.
//!
//! The semantics are upstream kube-proxy's nftables mode; the shape is chosen for the kernel's
//! cost (see the README's Performance section):
//! - dispatch is one lookup in typed verdict maps (`service-ips`, `service-nodeports`);
//! - a service port balances with `numgen random mod N offset K` over its block of indices in a
//!   few shared **named** maps (`dnat ip to numgen random mod N offset K map @endpoints-0`; see
//!   [`slots`] for why shards), so an endpoint change is element operations, and the kernel
//!   neither walks anonymous-set bindings nor scans thousands of set names; one endpoint is a
//!   plain DNAT;
//! - per-endpoint chains exist only where they carry state: session affinity;
//! - hairpin (a pod reaching itself through its service) is one set lookup in postrouting
//!   instead of a rule per endpoint;
//! - masquerading ClusterIP traffic from outside the cluster is one rule in `services` instead
//!   of one per service.
//! - the new-connection checks upstream makes in filter chains at prerouting, forward and output
//!   (firewall, no endpoints, unserved ClusterIP ports) are made in the nat chains, which run
//!   once per connection, so later packets pass no chain of ours.

pub mod endpoints;
pub mod names;
pub mod slots;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;

use crate::config::{DetectLocal, ProxyConfig};
use crate::model::{ClusterState, Endpoint, NamespacedName, ServicePort};
use crate::net::IpFamily;
use crate::nft::wire::udata::truncate_comment;
use crate::nft::*;
use endpoints::{NodeView, categorize};
use slots::{MapKind, SlotTable};

/// Names of the objects every nftproxy table has.
pub mod objects {
    pub const CLUSTER_IPS: &str = "cluster-ips";
    pub const NODEPORT_IPS: &str = "nodeport-ips";
    pub const FIREWALL_IPS: &str = "firewall-ips";
    pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
    pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
    pub const SERVICE_IPS: &str = "service-ips";
    pub const SERVICE_NODEPORTS: &str = "service-nodeports";
    pub const HAIRPIN: &str = "hairpin-endpoints";
    pub const CLUSTER_CIDRS: &str = "cluster-cidrs";

    pub const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
    pub const FIREWALL_CHECK: &str = "firewall-check";
    pub const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";
    pub const MASQUERADING: &str = "masquerading";
    pub const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
    pub const REJECT_CHAIN: &str = "reject-chain";
    pub const SERVICES: &str = "services";
    pub const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
}
use objects::*;

/// Where NodePort traffic is accepted in one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePorts {
    /// Every local address except loopback (`fib daddr type local`).
    MatchAll,
    /// These addresses (the `nodeport-ips` set).
    Addresses(Vec<IpAddr>),
}

/// Everything a plan depends on.
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
}

/// A `healthCheckNodePort` to serve, with the count it reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub service: NamespacedName,
    pub port: u16,
    pub local_endpoints: usize,
}

/// Where a UDP or SCTP service port is reached and which endpoints it has now, so stale
/// conntrack entries pointing elsewhere can be removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConntrackTarget {
    pub protocol: crate::net::L4Proto,
    /// Destination IP:port pairs of the service (ClusterIP, external and LB IPs).
    pub destinations: Vec<(IpAddr, u16)>,
    pub node_port: Option<u16>,
    /// Endpoint addresses traffic may be DNATed to.
    pub endpoints: Vec<(IpAddr, u16)>,
}

/// The desired state for one sync.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub ruleset: Ruleset,
    pub stats: PlanStats,
    pub health_checks: Vec<HealthCheck>,
    pub conntrack: Vec<ConntrackTarget>,
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
    }
}

/// One service's share of the ruleset: per family, a partial table holding its own chains and
/// sets and its elements of the shared sets and maps. The whole ruleset is the infrastructure
/// with every service's fragments merged in ([`merge`]), so the reconciler can re-plan one
/// service alone and the result is the same as planning everything.
#[derive(Debug, Clone)]
pub struct ServicePlan {
    pub service: NamespacedName,
    /// One partial table per family the plan has (empty where the service has no ClusterIP).
    pub fragments: Vec<Table>,
    pub stats: PlanStats,
    pub health_check: Option<HealthCheck>,
    pub conntrack: Vec<ConntrackTarget>,
}

/// Plans the whole ruleset. `slots` remembers where each service port's endpoints sit in the
/// shared endpoint maps; pass the same table to every plan of one kernel (a fresh one for a
/// kernel without nftproxy's tables, or one seeded by [`SlotTable::from_kernel`]).
pub fn plan(input: &PlanInput<'_>, slots: &mut SlotTable) -> Plan {
    let mut out = Plan::default();
    let families = families(input);
    out.ruleset.tables = plan_infrastructure(input, &families);
    slots.begin();
    for service in input.state.services() {
        let planned = plan_service(input, &families, service, slots);
        for (table, fragment) in out.ruleset.tables.iter_mut().zip(planned.fragments) {
            merge(table, fragment);
        }
        out.stats.add(&planned.stats);
        out.health_checks.extend(planned.health_check);
        out.conntrack.extend(planned.conntrack);
    }
    slots.finish();
    for table in &mut out.ruleset.tables {
        order_sets(table);
    }
    out
}

/// The fixed part of each family's table: base chains, dispatch maps, masquerade plumbing.
pub fn plan_infrastructure(input: &PlanInput<'_>, families: &[IpFamily]) -> Vec<Table> {
    families.iter().map(|f| infrastructure(*f, input)).collect()
}

/// nftproxy's base chains (name, type, hook, priority), the same in every family's table and
/// whatever the cluster holds. Taken from the planned infrastructure, so `check` compares
/// foreign chains with exactly what `sync` creates.
pub fn base_chains() -> Vec<(String, BaseHook)> {
    let config = ProxyConfig::new("");
    let state = ClusterState::default();
    let nodeports = NodePorts::Addresses(Vec::new());
    let input = PlanInput { config: &config, state: &state, nodeports_v4: &nodeports, nodeports_v6: &nodeports };
    let table = infrastructure(IpFamily::V4, &input);
    table.chains.into_values().filter_map(|c| c.base.map(|b| (c.name, b))).collect()
}

/// Plans one service in each of `families` (as [`families`] returned them).
pub fn plan_service(
    input: &PlanInput<'_>,
    families: &[IpFamily],
    service: &crate::model::ServiceInfo,
    slots: &mut SlotTable,
) -> ServicePlan {
    let node_name = input.config.hostname.as_str();
    let zone = input.state.node().and_then(|n| n.zone());
    let node = NodeView { name: node_name, zone };
    let mut out = ServicePlan {
        service: service.name.clone(),
        fragments: Vec::with_capacity(families.len()),
        stats: PlanStats { services: 1, ..PlanStats::default() },
        health_check: health_check(input.state, service, node_name),
        conntrack: Vec::new(),
    };
    for &family in families {
        let mut fragment = Table::new(family, &input.config.table, None);
        let mut hairpins: BTreeMap<IpAddr, Owner> = BTreeMap::new();
        for sp in &service.ports {
            let Some(cluster_ip) = sp.cluster_ip(family) else { continue };
            let endpoints = input.state.endpoints(&sp.name, family);
            let port_plan = ServicePortPlan { family, sp, cluster_ip, input, node: &node };
            let used = port_plan.write(&endpoints, &mut fragment, slots, &mut out);
            for e in used {
                hairpins.entry(e.ip).or_insert_with(|| Owner::new(sp.name.to_string()));
            }
        }
        for (ip, owner) in hairpins {
            shared(&mut fragment, HAIRPIN).insert(vec![Value::Addr(ip), Value::Addr(ip)], Element::key_only(owner));
        }
        out.fragments.push(fragment);
    }
    out
}

/// Merges a service's fragment into a table. Sets and maps the table has (the shared ones)
/// gain the fragment's elements; where two services claim the same key (conflicting input),
/// the element merged first stays, so the result depends only on the services' order.
pub fn merge(table: &mut Table, fragment: Table) {
    for (name, set) in fragment.sets {
        match table.sets.get_mut(&name) {
            Some(have) => {
                for (key, element) in set.elements {
                    have.elements.entry(key).or_insert(element);
                }
            }
            None => {
                table.sets.insert(name, set);
            }
        }
    }
    for (name, chain) in fragment.chains {
        table.chains.entry(name).or_insert(chain);
    }
}

/// Where a set goes in the table: shared sets first, then the endpoint maps in shard order,
/// then per-service sets. The kernel finds a set by scanning the table's sets in creation
/// order, so the sets most rules refer to go first.
pub fn set_rank(name: &str, infrastructure: bool) -> (u8, Option<(MapKind, u32)>) {
    match MapKind::parse(name) {
        Some(shard) => (1, Some(shard)),
        None if infrastructure => (0, None),
        None => (2, None),
    }
}

/// Orders a merged table's sets by [`set_rank`] (a stable sort: planning order otherwise).
pub fn order_sets(table: &mut Table) {
    let rank = |name: &str, set: &crate::nft::ast::Set| set_rank(name, set.owner.is_infrastructure());
    table.sets.sort_by(|a, x, b, y| rank(a, x).cmp(&rank(b, y)));
}

/// The health check of a Local-policy LoadBalancer service: the number of distinct local ready
/// endpoint IPs over all its ports (upstream counts 10.0.0.1:80 and 10.0.0.1:443 as one), in
/// the service's primary family. Terminating endpoints do not count: a node with only those
/// should fail the check.
fn health_check(state: &ClusterState, service: &crate::model::ServiceInfo, node_name: &str) -> Option<HealthCheck> {
    let port = service.ports.iter().find_map(|p| p.health_check_node_port)?;
    let family = service.ports.first().and_then(|p| p.cluster_ips.first()).map(IpFamily::of)?;
    let ips: BTreeSet<IpAddr> = service
        .ports
        .iter()
        .flat_map(|sp| state.endpoints(&sp.name, family))
        .filter(|e| e.ready && e.node_name.as_deref() == Some(node_name))
        .map(|e| e.ip)
        .collect();
    Some(HealthCheck { service: service.name.clone(), port, local_endpoints: ips.len() })
}

/// IPv4 always; IPv6 when anything in the cluster or the configuration uses it.
pub fn families(input: &PlanInput<'_>) -> Vec<IpFamily> {
    let v6 = input.config.cluster_cidrs.iter().any(|c| IpFamily::of_net(c) == IpFamily::V6)
        || input.state.services().any(|s| s.ports.iter().any(|p| p.cluster_ip(IpFamily::V6).is_some()))
        || input.state.node().is_some_and(|n| n.internal_ips.iter().any(|ip| ip.is_ipv6()));
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
            _ => Some(Stmt::Lookup { key: vec![Selector::Saddr(family)], set: CLUSTER_CIDRS.to_string(), negate }),
        },
        DetectLocal::BridgeInterface(bridge) => {
            Some(Stmt::Cmp { sel: Selector::Iifname, op, value: Value::Ifname(bridge.clone()) })
        }
        DetectLocal::InterfaceNamePrefix(prefix) => {
            Some(Stmt::Cmp { sel: Selector::Iifname, op, value: Value::Ifname(format!("{prefix}*")) })
        }
    }
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

/// An empty shared set or map: one every service port may add elements to.
fn shared_set(family: IpFamily, name: &str) -> Set {
    let infra = Owner::infrastructure();
    let (shape, comment) = match name {
        CLUSTER_IPS => (SetShape::Addresses(family), "Active ClusterIPs"),
        FIREWALL_IPS => {
            (SetShape::ServiceVerdicts(family), "destinations that are subject to LoadBalancerSourceRanges")
        }
        NO_ENDPOINT_NODEPORTS => {
            (SetShape::PortVerdicts, "vmap to drop or reject packets to service nodeports with no endpoints")
        }
        NO_ENDPOINT_SERVICES => {
            (SetShape::ServiceVerdicts(family), "vmap to drop or reject packets to services with no endpoints")
        }
        SERVICE_IPS => (SetShape::ServiceVerdicts(family), "ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        SERVICE_NODEPORTS => (SetShape::PortVerdicts, "NodePort traffic"),
        _ => (SetShape::AddressPairs(family), "endpoints reaching themselves through a service (masqueraded)"),
    };
    Set::new(name, shape, infra).with_comment(comment)
}

/// The shared set `name` of a fragment, created on first use.
fn shared<'t>(table: &'t mut Table, name: &str) -> &'t mut Set {
    let family = table.family;
    table.sets.entry(name.to_string()).or_insert_with(|| shared_set(family, name))
}

fn not_localhost(family: IpFamily) -> Stmt {
    let value = match family {
        IpFamily::V4 => Value::Prefix("127.0.0.0/8".parse().unwrap_or(IpNet::V4(Default::default()))),
        IpFamily::V6 => Value::Addr(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)),
    };
    Stmt::Cmp { sel: Selector::Daddr(family), op: CmpOp::Ne, value }
}

/// The table's fixed part: base chains at upstream's hooks and priorities, dispatch maps and
/// the masquerade plumbing.
fn infrastructure(family: IpFamily, input: &PlanInput<'_>) -> Table {
    let infra = Owner::infrastructure;
    let cfg = input.config;
    let mut t = Table::new(family, &cfg.table, Some("rules for nftproxy"));
    let match_all_nodeports = matches!(input.nodeports(family), NodePorts::MatchAll);

    t.add_set(shared_set(family, CLUSTER_IPS));
    if let NodePorts::Addresses(ips) = input.nodeports(family) {
        let mut set = Set::new(NODEPORT_IPS, SetShape::Addresses(family), infra())
            .with_comment("IPs that accept NodePort traffic");
        for ip in ips.iter().filter(|ip| IpFamily::of(ip) == family && !ip.is_loopback()) {
            set.insert(vec![Value::Addr(*ip)], Element::key_only(infra()));
        }
        t.add_set(set);
    }
    for name in [FIREWALL_IPS, NO_ENDPOINT_NODEPORTS, NO_ENDPOINT_SERVICES, SERVICE_IPS, SERVICE_NODEPORTS, HAIRPIN] {
        t.add_set(shared_set(family, name));
    }
    let cidrs = local_cidrs(family, input);
    if cidrs.len() > 1 {
        let mut set =
            Set::new(CLUSTER_CIDRS, SetShape::Prefixes(family), infra()).with_comment("pod ranges (detect-local)");
        for net in IpNet::aggregate(&cidrs) {
            set.insert(vec![Value::Prefix(net)], Element::key_only(infra()));
        }
        t.add_set(set);
    }

    // Upstream checks new connections in filter chains at four more hooks (firewall-check at
    // prerouting/output -110, service-endpoints-check and cluster-ips-check at forward/output 0),
    // which every packet of every connection then passes: a base chain costs a hook call and a
    // `ct state` test per packet. The nat chains below run once per connection (the first packet
    // of a conntrack entry, which is the packet `ct state new` picks out), so the same checks
    // there cost nothing on the packets after it. In order: the firewall drops before DNAT, as
    // at -110; what `services` DNATs (a terminal verdict) never reaches the rules after it, as
    // the forward/output checks never matched it (they see the endpoint address); the rest are
    // the service addresses without endpoints and the ClusterIP ports nothing serves, rejected
    // (Linux ≥ 5.9 allows reject in prerouting). Upstream checks ClusterIPs only in forward and
    // output, not input: hence `fib daddr type != local` (looked at only for ClusterIPs).
    // `filter-input` keeps upstream's checks for the node's own addresses.
    let base = |name: &str, chain_type, hook, priority| Chain::base(name, BaseHook { chain_type, hook, priority });
    let new = || Stmt::CtStateNew;
    let mut c = base("filter-input", ChainType::Filter, Hook::Input, 0);
    c.push(Rule::new(vec![new(), jump(NODEPORT_ENDPOINTS_CHECK)]));
    c.push(Rule::new(vec![new(), jump(SERVICE_ENDPOINTS_CHECK)]));
    t.add_chain(c);
    let mut c = base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100);
    c.push(Rule::new(vec![new(), jump(FIREWALL_CHECK)]));
    c.push(Rule::new(vec![jump(SERVICES)]));
    c.push(Rule::new(vec![new(), jump(SERVICE_ENDPOINTS_CHECK)]));
    c.push(
        Rule::new(vec![
            new(),
            lookup(Selector::Daddr(family), CLUSTER_IPS),
            Stmt::FibNotLocal(FibAddr::Daddr),
            Stmt::Reject(family),
        ])
        .with_comment("Reject forwarded traffic to invalid ports of ClusterIPs"),
    );
    t.add_chain(c);
    let mut c = base("nat-output", ChainType::Nat, Hook::Output, -100);
    c.push(Rule::new(vec![new(), jump(FIREWALL_CHECK)]));
    c.push(Rule::new(vec![jump(SERVICES)]));
    c.push(Rule::new(vec![new(), jump(SERVICE_ENDPOINTS_CHECK)]));
    c.push(Rule::new(vec![new(), jump(CLUSTER_IPS_CHECK)]));
    t.add_chain(c);
    let mut c = base("nat-postrouting", ChainType::Nat, Hook::Postrouting, 100);
    c.push(Rule::new(vec![jump(MASQUERADING)]));
    t.add_chain(c);

    let mut c = Chain::regular(CLUSTER_IPS_CHECK, infra());
    c.push(
        Rule::new(vec![lookup(Selector::Daddr(family), CLUSTER_IPS), Stmt::Reject(family)])
            .with_comment("Reject traffic to invalid ports of ClusterIPs"),
    );
    t.add_chain(c);
    let mut c = Chain::regular(FIREWALL_CHECK, infra());
    c.push(Rule::new(vec![Stmt::Vmap { key: service_key(family), map: FIREWALL_IPS.into() }]));
    t.add_chain(c);
    let mut c = Chain::regular(MARK_FOR_MASQUERADE, infra());
    c.push(Rule::new(vec![Stmt::MarkOr(cfg.masquerade_mark())]));
    t.add_chain(c);
    let mut c = Chain::regular(MASQUERADING, infra());
    c.push(
        Rule::new(vec![
            Stmt::CtStatusDnat,
            Stmt::Lookup {
                key: vec![Selector::Saddr(family), Selector::Daddr(family)],
                set: HAIRPIN.into(),
                negate: false,
            },
            jump(MARK_FOR_MASQUERADE),
        ])
        .with_comment("hairpin"),
    );
    c.push(Rule::new(vec![Stmt::MarkBitsEq { mask: cfg.masquerade_mark(), value: 0 }, Stmt::Verdict(Verdict::Return)]));
    // xor clears the bit so a packet re-entering the stack (VXLAN) is not masqueraded twice.
    c.push(Rule::new(vec![Stmt::MarkXor(cfg.masquerade_mark())]));
    c.push(Rule::new(vec![Stmt::Masquerade { fully_random: true }]));
    t.add_chain(c);

    let nodeport_guard = |family| -> Vec<Stmt> {
        if match_all_nodeports {
            vec![Stmt::FibLocal(FibAddr::Daddr), not_localhost(family)]
        } else {
            vec![lookup(Selector::Daddr(family), NODEPORT_IPS)]
        }
    };
    let mut c = Chain::regular(NODEPORT_ENDPOINTS_CHECK, infra());
    let mut stmts = nodeport_guard(family);
    stmts.push(Stmt::Vmap { key: port_key(), map: NO_ENDPOINT_NODEPORTS.into() });
    c.push(Rule::new(stmts));
    t.add_chain(c);
    let mut c =
        Chain::regular(REJECT_CHAIN, infra()).with_comment("helper for @no-endpoint-services / @no-endpoint-nodeports");
    c.push(Rule::new(vec![Stmt::Reject(family)]));
    t.add_chain(c);

    let mut services = Chain::regular(SERVICES, infra());
    let masq = if cfg.masquerade_all {
        Some(Rule::new(vec![lookup(Selector::Daddr(family), CLUSTER_IPS), jump(MARK_FOR_MASQUERADE)]))
    } else {
        // The source test first: pod traffic, most of what arrives, then needs no set lookup.
        local_match(family, input, true).map(|not_local| {
            Rule::new(vec![not_local, lookup(Selector::Daddr(family), CLUSTER_IPS), jump(MARK_FOR_MASQUERADE)])
        })
    };
    if let Some(rule) = masq {
        services.push(rule.with_comment("masquerade ClusterIP traffic from outside the cluster"));
    }
    services.push(Rule::new(vec![Stmt::Vmap { key: service_key(family), map: SERVICE_IPS.into() }]));
    let mut stmts = nodeport_guard(family);
    stmts.push(Stmt::Vmap { key: port_key(), map: SERVICE_NODEPORTS.into() });
    services.push(Rule::new(stmts));
    t.add_chain(services);
    let mut c = Chain::regular(SERVICE_ENDPOINTS_CHECK, infra());
    c.push(Rule::new(vec![Stmt::Vmap { key: service_key(family), map: NO_ENDPOINT_SERVICES.into() }]));
    t.add_chain(c);
    t
}

/// The shared endpoint map `kind` number `shard`, created on first use.
fn endpoint_map(table: &mut Table, family: IpFamily, kind: MapKind, shard: u32) -> &mut Set {
    let name = kind.map_name(shard);
    table.sets.entry(name.clone()).or_insert_with(|| {
        let (shape, comment) = match kind {
            MapKind::Targets => (
                SetShape::EndpointTargets(family),
                "service port endpoints: a numgen window per port, a range per endpoint",
            ),
            MapKind::Chains => {
                (SetShape::EndpointChains, "endpoint chains of service ports with session affinity: a window per port")
            }
        };
        Set::new(name, shape, Owner::infrastructure()).with_comment(comment)
    })
}

/// Planning of one service port in one family.
struct ServicePortPlan<'a> {
    family: IpFamily,
    sp: &'a ServicePort,
    cluster_ip: IpAddr,
    input: &'a PlanInput<'a>,
    node: &'a NodeView<'a>,
}

impl ServicePortPlan<'_> {
    /// Writes the service port's objects into `table`; returns the endpoints it DNATs to.
    fn write(
        &self,
        endpoints: &[Endpoint],
        table: &mut Table,
        slots: &mut SlotTable,
        out: &mut ServicePlan,
    ) -> Vec<Endpoint> {
        let sp = self.sp;
        let family = self.family;
        let owner = Owner::new(sp.name.to_string());
        let comment = truncate_comment(&sp.name.to_string()).to_string();
        let base = names::service_port_base(&sp.name);
        let cluster_chain = format!("service-{base}");
        let local_chain = format!("local-{base}");
        let external_chain = format!("external-{base}");
        let firewall_chain = format!("firewall-{base}");

        let cat = categorize(endpoints, sp, self.node);
        out.stats.service_ports += 1;
        out.stats.endpoints += cat.reachable.len();

        let uses_cluster_chain = !cat.cluster.is_empty() && sp.uses_cluster_endpoints();
        let uses_local_chain = !cat.local.is_empty() && sp.uses_local_endpoints();
        let internal_chain = if sp.internal_policy_local { &local_chain } else { &cluster_chain };
        let has_internal = cat.has_any && (!sp.internal_policy_local || !cat.local.is_empty());
        let external_local = sp.external_local();
        let uses_external_chain = cat.has_any && sp.externally_accessible();
        let has_external = cat.has_any && (!external_local || !cat.local.is_empty());
        // No endpoints anywhere: reject (fail fast). Endpoints exist, but not for this
        // policy on this node: drop, as upstream.
        let no_endpoint_verdict = if cat.has_any { Verdict::Drop } else { Verdict::Goto(REJECT_CHAIN.to_string()) };
        if !cat.has_any {
            out.stats.no_endpoints += 1;
        } else {
            if !has_internal {
                out.stats.no_local_internal += 1;
            }
            if sp.externally_accessible() && !has_external {
                out.stats.no_local_external += 1;
            }
        }

        let proto = Value::Proto(sp.name.protocol);
        let port = Value::Port(sp.port);
        let element = |verdict: Verdict| Element::verdict(verdict, owner.clone()).with_comment(comment.clone());
        let add = |table: &mut Table, set: &str, key: Vec<Value>, element: Element| {
            shared(table, set).insert(key, element);
        };

        // ClusterIP
        add(table, CLUSTER_IPS, vec![Value::Addr(self.cluster_ip)], Element::key_only(owner.clone()));
        let cip_key = vec![Value::Addr(self.cluster_ip), proto.clone(), port.clone()];
        if has_internal {
            add(table, SERVICE_IPS, cip_key, element(Verdict::Goto(internal_chain.clone())));
        } else {
            add(table, NO_ENDPOINT_SERVICES, cip_key, element(no_endpoint_verdict.clone()));
        }

        // ExternalIPs and LoadBalancer IPs
        let external_ips: Vec<IpAddr> =
            sp.external_ips.iter().copied().filter(|ip| IpFamily::of(ip) == family).collect();
        let lb_ips: Vec<IpAddr> =
            sp.load_balancer_ips.iter().copied().filter(|ip| IpFamily::of(ip) == family).collect();
        for ip in external_ips.iter().chain(lb_ips.iter()) {
            let key = vec![Value::Addr(*ip), proto.clone(), port.clone()];
            if cat.has_any {
                add(table, SERVICE_IPS, key.clone(), element(Verdict::Goto(external_chain.clone())));
            }
            if !has_external {
                add(table, NO_ENDPOINT_SERVICES, key, element(no_endpoint_verdict.clone()));
            }
        }

        // loadBalancerSourceRanges
        let ranges: Vec<IpNet> =
            sp.load_balancer_source_ranges.iter().copied().filter(|n| IpFamily::of_net(n) == family).collect();
        if !lb_ips.is_empty() && !ranges.is_empty() {
            let set_name = format!("source-ranges-{base}");
            let mut allowed = ranges.clone();
            // A node inside the allowed ranges may reach the VIP with the VIP itself as source
            // (the VIP is often a local address): allow that too, as upstream does.
            let node_ip = self
                .input
                .state
                .node()
                .and_then(|n| n.internal_ips.iter().copied().find(|ip| IpFamily::of(ip) == family));
            if node_ip.is_some_and(|ip| ranges.iter().any(|r| r.contains(&ip))) {
                allowed.extend(lb_ips.iter().map(|ip| IpNet::from(*ip)));
            }
            let mut set = Set::new(&set_name, SetShape::Prefixes(family), owner.clone());
            for net in IpNet::aggregate(&allowed) {
                set.insert(vec![Value::Prefix(net)], Element::key_only(owner.clone()));
            }
            table.add_set(set);
            let mut fw = Chain::regular(&firewall_chain, owner.clone());
            fw.push(
                Rule::new(vec![
                    Stmt::Lookup { key: vec![Selector::Saddr(family)], set: set_name, negate: true },
                    Stmt::Verdict(Verdict::Drop),
                ])
                .with_comment(comment.clone()),
            );
            table.add_chain(fw);
            for ip in &lb_ips {
                add(
                    table,
                    FIREWALL_IPS,
                    vec![Value::Addr(*ip), proto.clone(), port.clone()],
                    element(Verdict::Goto(firewall_chain.clone())),
                );
            }
        }

        // NodePort
        if let Some(node_port) = sp.node_port {
            let key = vec![proto.clone(), Value::Port(node_port)];
            if cat.has_any {
                add(table, SERVICE_NODEPORTS, key.clone(), element(Verdict::Goto(external_chain.clone())));
            }
            if !has_external {
                add(table, NO_ENDPOINT_NODEPORTS, key, element(no_endpoint_verdict.clone()));
            }
        }

        // Policy chains first, so the external chain's gotos point at existing names.
        let affinity = sp.session_affinity_secs;
        if uses_cluster_chain {
            self.write_policy_chain(table, slots, &cluster_chain, &cat.cluster, &owner, &comment);
        }
        if uses_local_chain {
            self.write_policy_chain(table, slots, &local_chain, &cat.local, &owner, &comment);
        }
        if uses_external_chain {
            let mut ext = Chain::regular(&external_chain, owner.clone());
            if !external_local {
                ext.push(Rule::new(vec![jump(MARK_FOR_MASQUERADE)]));
            } else {
                if let Some(pods) = local_match(family, self.input, false) {
                    ext.push(Rule::new(vec![pods, goto(&cluster_chain)]).with_comment("short-circuit pod traffic"));
                }
                ext.push(
                    Rule::new(vec![Stmt::FibLocal(FibAddr::Saddr), jump(MARK_FOR_MASQUERADE)])
                        .with_comment("masquerade local traffic"),
                );
                ext.push(
                    Rule::new(vec![Stmt::FibLocal(FibAddr::Saddr), goto(&cluster_chain)])
                        .with_comment("short-circuit local traffic"),
                );
            }
            if has_external {
                let target = if external_local { &local_chain } else { &cluster_chain };
                ext.push(Rule::new(vec![goto(target)]));
            }
            table.add_chain(ext);
        }
        if let Some(timeout) = affinity {
            for ep in &cat.reachable {
                let eb = names::endpoint_base(&sp.name, ep);
                let mut set = Set::new(format!("affinity-{eb}"), SetShape::Affinity(family), owner.clone());
                set.timeout_secs = Some(timeout);
                table.add_set(set);
                let mut chain = Chain::regular(format!("endpoint-{eb}"), owner.clone());
                chain.push(Rule::new(vec![Stmt::UpdateSet {
                    set: format!("affinity-{eb}"),
                    key: Selector::Saddr(family),
                }]));
                chain.push(Rule::new(self.dnat_to(ep)).with_comment(comment.clone()));
                table.add_chain(chain);
            }
        }

        // Conntrack cleanup follows the same categorization.
        if sp.name.protocol != crate::net::L4Proto::Tcp {
            let mut destinations = vec![(self.cluster_ip, sp.port)];
            destinations.extend(external_ips.iter().chain(lb_ips.iter()).map(|ip| (*ip, sp.port)));
            out.conntrack.push(ConntrackTarget {
                protocol: sp.name.protocol,
                destinations,
                node_port: sp.node_port,
                endpoints: cat.reachable.iter().map(|e| (e.ip, e.port)).collect(),
            });
        }
        cat.reachable
    }

    /// `meta l4proto tcp dnat to ip:port`
    fn dnat_to(&self, ep: &Endpoint) -> Vec<Stmt> {
        vec![
            Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(self.sp.name.protocol) },
            Stmt::Dnat { addr: ep.ip, port: ep.port },
        ]
    }

    /// A chain balancing over `endpoints`: a plain DNAT for one, numgen over a block of the
    /// shared DNAT map for more; with ClientIP affinity, lookups of the affinity sets first and
    /// endpoint chains behind a block of the shared verdict map.
    fn write_policy_chain(
        &self,
        table: &mut Table,
        slots: &mut SlotTable,
        chain_name: &str,
        endpoints: &[Endpoint],
        owner: &Owner,
        comment: &str,
    ) {
        let family = self.family;
        let mut chain = Chain::regular(chain_name, owner.clone());
        let n = u32::try_from(endpoints.len()).unwrap_or(u32::MAX);
        if self.sp.session_affinity_secs.is_some() {
            let chains: Vec<String> =
                endpoints.iter().map(|ep| format!("endpoint-{}", names::endpoint_base(&self.sp.name, ep))).collect();
            for (ep, ep_chain) in endpoints.iter().zip(&chains) {
                let eb = names::endpoint_base(&self.sp.name, ep);
                chain.push(Rule::new(vec![lookup(Selector::Saddr(family), &format!("affinity-{eb}")), goto(ep_chain)]));
            }
            if n == 1 {
                chain.push(Rule::new(vec![goto(&chains[0])]).with_comment(comment));
            } else {
                let slot = slots.place(family, MapKind::Chains, chain_name, n);
                let map = endpoint_map(table, family, MapKind::Chains, slot.shard);
                for ((lo, hi), ep_chain) in slots::ranges(slot.offset, n).into_iter().zip(&chains) {
                    map.insert(
                        vec![Value::IndexRange(lo, hi)],
                        Element::verdict(Verdict::Goto(ep_chain.clone()), owner.clone()).with_comment(comment),
                    );
                }
                let map = map.name.clone();
                chain.push(
                    Rule::new(vec![Stmt::NumgenVmap { modulus: slots::WINDOW, offset: slot.offset, map }])
                        .with_comment(comment),
                );
            }
        } else if n == 1 {
            chain.push(Rule::new(self.dnat_to(&endpoints[0])).with_comment(comment));
        } else {
            let slot = slots.place(family, MapKind::Targets, chain_name, n);
            let map = endpoint_map(table, family, MapKind::Targets, slot.shard);
            for ((lo, hi), ep) in slots::ranges(slot.offset, n).into_iter().zip(endpoints) {
                map.insert(
                    vec![Value::IndexRange(lo, hi)],
                    Element::values(vec![Value::Addr(ep.ip), Value::Port(ep.port)], owner.clone())
                        .with_comment(comment),
                );
            }
            let map = map.name.clone();
            chain.push(
                Rule::new(vec![
                    Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(self.sp.name.protocol) },
                    Stmt::DnatNumgenMap { family, modulus: slots::WINDOW, offset: slot.offset, map },
                ])
                .with_comment(comment),
            );
        }
        table.add_chain(chain);
    }
}

#[cfg(test)]
pub(crate) mod tests;
