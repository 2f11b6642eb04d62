//! One service port in one family: its dispatch elements, policy chains, firewall, NodePort,
//! affinity, and the endpoint windows it balances over.

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::affinity::{AffinityDemand, AffinityId, AffinitySlots, GROUP_SLOTS, weighted_ranges};
use super::endpoints::{Categorized, NodeView, categorize};
use super::fragment::{Fragment, ServicePlan};
use super::input::PlanInput;
use super::names;
use super::objects::*;
use super::placement::{self, Demands, SPLIT, Slot, SlotLookup, WindowDemand, WindowId};
use super::rules::{external_local_short_circuits, goto, jump};
use crate::model::convert::DEFAULT_AFFINITY_SECS;
use crate::model::{Endpoint, ServicePort};
use crate::net::IpFamily;
use crate::nft::wire::udata::truncate_comment;
use crate::nft::*;

/// This node, as planning sees it.
pub(super) struct NodeContext<'a> {
    view: NodeView<'a>,
}

impl<'a> NodeContext<'a> {
    pub(super) fn of(input: &PlanInput<'a>) -> NodeContext<'a> {
        let zone = input.state.node().and_then(|n| n.zone());
        NodeContext { view: NodeView { name: input.config.hostname.as_str(), zone } }
    }
}

/// Planning of one service port in one family: its endpoints sorted into the lists each policy
/// uses, and its chain names.
pub(super) struct PortPlan<'a> {
    family: IpFamily,
    sp: &'a ServicePort,
    cluster_ip: IpAddr,
    input: &'a PlanInput<'a>,
    cat: Categorized,
    base: String,
}

/// Whether the port is balanced by the shared balancing chains, with no chain of its own: all
/// but session affinity (per-client state). `externalTrafficPolicy: Local` is balanced too, by
/// the shared chains that tell pods and the node apart from other sources.
pub(super) fn balanced(sp: &ServicePort) -> bool {
    sp.session_affinity_secs.is_none()
}

impl<'a> PortPlan<'a> {
    /// The service port in `family`, if it has a ClusterIP there.
    pub(super) fn new(
        family: IpFamily,
        sp: &'a ServicePort,
        input: &'a PlanInput<'a>,
        node: &NodeContext<'_>,
    ) -> Option<PortPlan<'a>> {
        let cluster_ip = sp.cluster_ip(family)?;
        let endpoints = input.state.endpoints(&sp.name, family);
        let cat = categorize(&endpoints, sp, &node.view);
        Some(PortPlan { family, sp, cluster_ip, input, cat, base: names::service_port_base(&sp.name) })
    }

    fn uses_cluster_chain(&self) -> bool {
        !self.cat.cluster.is_empty() && self.sp.uses_cluster_endpoints()
    }

    fn uses_local_chain(&self) -> bool {
        !self.cat.local.is_empty() && self.sp.uses_local_endpoints()
    }

    fn balanced(&self) -> bool {
        balanced(self.sp)
    }

    /// The endpoint windows this port's balancing chains need, and its affinity slots. Every
    /// affinity chain has a window, one endpoint included, so that going from one endpoint to
    /// two (or back) is element operations, not a rule rewritten (a chain exists only while it
    /// has endpoints).
    pub(super) fn demands(&self, out: &mut Demands) {
        if self.balanced() {
            return;
        }
        let mut demand = |chain: String, endpoints: &[Endpoint]| {
            out.windows.push(WindowDemand {
                family: self.family,
                chain,
                port: Some(self.affinity_id()),
                endpoints: endpoints.iter().map(|ep| (ep.ip, ep.port)).collect(),
            });
        };
        let (cluster, local) = (self.uses_cluster_chain(), self.uses_local_chain());
        if cluster {
            demand(names::cluster_chain(&self.base), &self.cat.cluster);
        }
        if local {
            demand(names::local_chain(&self.base), &self.cat.local);
        }
        if cluster || local {
            out.affinity.push(AffinityDemand {
                id: self.affinity_id(),
                endpoints: self.cat.reachable.iter().map(|ep| (ep.ip, ep.port)).collect(),
            });
        }
    }

    fn affinity_id(&self) -> AffinityId {
        AffinityId { family: self.family, base: self.base.clone() }
    }

    /// Writes the service port's objects into `table`; returns the endpoints it DNATs to.
    pub(super) fn write(self, table: &mut Fragment, slots: &dyn SlotLookup, out: &mut ServicePlan) -> Vec<Endpoint> {
        let sp = self.sp;
        let family = self.family;
        let owner = Owner::service_port(&sp.name);
        let comment: Arc<str> = Arc::from(truncate_comment(&sp.name.to_string()));
        let base = &self.base;
        let cluster_chain = names::cluster_chain(base);
        let local_chain = names::local_chain(base);
        let external_chain = format!("external-{base}");
        let firewall_chain = format!("firewall-{base}");

        let cat = &self.cat;
        out.stats.service_ports += 1;
        out.stats.endpoints += cat.reachable.len();

        let uses_cluster_chain = self.uses_cluster_chain();
        let uses_local_chain = self.uses_local_chain();
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
            let v6 = usize::from(self.family == IpFamily::V6);
            if !has_internal {
                out.stats.no_local_internal += 1;
                out.stats.no_local_internal_v6 += v6;
            }
            if sp.externally_accessible() && !has_external {
                out.stats.no_local_external += 1;
                out.stats.no_local_external_v6 += v6;
            }
        }

        let proto = Value::Proto(sp.name.protocol);
        let port = Value::Port(sp.port);
        let element = |verdict: Verdict| Element::verdict(verdict, owner.clone()).with_comment(Arc::clone(&comment));
        let add = |table: &mut Fragment, set: SharedSet, key: Vec<Value>, element: Element| {
            table.add(set, key, element);
        };

        // ClusterIP
        add(table, SharedSet::ClusterIps, vec![Value::Addr(self.cluster_ip)], Element::key_only(owner.clone()));
        let balanced = self.balanced();
        let internal_endpoints = if sp.internal_policy_local { &cat.local } else { &cat.cluster };
        let cip_key = vec![Value::Addr(self.cluster_ip), proto.clone(), port.clone()];
        if !has_internal {
            add(table, SharedSet::NoEndpointServices, cip_key, element(no_endpoint_verdict.clone()));
        } else if balanced {
            self.write_balanced(table, SharedSet::BalancedServiceIps, cip_key, internal_endpoints, &owner, &comment);
        } else {
            add(table, SharedSet::ServiceIps, cip_key, element(Verdict::Goto(internal_chain.clone())));
        }

        // ExternalIPs and LoadBalancer IPs
        let external_ips: Vec<IpAddr> =
            sp.external_ips.iter().copied().filter(|ip| IpFamily::of(ip) == family).collect();
        let lb_ips: Vec<IpAddr> =
            sp.load_balancer_ips.iter().copied().filter(|ip| IpFamily::of(ip) == family).collect();
        for ip in external_ips.iter().chain(lb_ips.iter()) {
            let key = vec![Value::Addr(*ip), proto.clone(), port.clone()];
            if balanced && external_local {
                self.write_balanced_local(table, SharedSet::BalancedLocalIps, &key, &owner, &comment);
            } else if balanced && has_external {
                self.write_balanced(table, SharedSet::BalancedExternalIps, key.clone(), &cat.cluster, &owner, &comment);
            } else if cat.has_any && !balanced {
                add(table, SharedSet::ServiceIps, key.clone(), element(Verdict::Goto(external_chain.clone())));
            }
            if !has_external {
                add(table, SharedSet::NoEndpointServices, key, element(no_endpoint_verdict.clone()));
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
            let node_ip =
                self.input.state.node().and_then(|n| n.host_ips.iter().copied().find(|ip| IpFamily::of(ip) == family));
            if node_ip.is_some_and(|ip| ranges.iter().any(|r| r.contains(&ip))) {
                allowed.extend(lb_ips.iter().map(|ip| IpNet::from(*ip)));
            }
            let mut set = Set::new(&set_name, SetShape::Prefixes(family), owner.clone());
            for net in IpNet::aggregate(&allowed) {
                set.insert(vec![Value::Prefix(net)], Element::key_only(owner.clone()));
            }
            table.own.add_set(set);
            let mut fw = Chain::regular(&firewall_chain, owner.clone());
            fw.push(
                Rule::new(vec![
                    Stmt::Lookup { key: vec![Selector::Saddr(family)], set: set_name, negate: true },
                    Stmt::Verdict(Verdict::Drop),
                ])
                .with_comment(&*comment),
            );
            table.own.add_chain(fw);
            for ip in &lb_ips {
                add(
                    table,
                    SharedSet::FirewallIps,
                    vec![Value::Addr(*ip), proto.clone(), port.clone()],
                    element(Verdict::Goto(firewall_chain.clone())),
                );
            }
        }

        // NodePort
        if let Some(node_port) = sp.node_port {
            let key = vec![proto.clone(), Value::Port(node_port)];
            if balanced && external_local {
                self.write_balanced_local(table, SharedSet::BalancedLocalNodeports, &key, &owner, &comment);
            } else if balanced && has_external {
                self.write_balanced(table, SharedSet::BalancedNodeports, key.clone(), &cat.cluster, &owner, &comment);
            } else if cat.has_any && !balanced {
                add(table, SharedSet::ServiceNodeports, key.clone(), element(Verdict::Goto(external_chain.clone())));
            }
            if !has_external {
                add(table, SharedSet::NoEndpointNodeports, key, element(no_endpoint_verdict.clone()));
            }
        }

        out.conntrack.extend(super::conntrack::target(family, sp, self.input.state));
        if balanced {
            return self.cat.reachable;
        }

        // Policy chains first, so the external chain's gotos point at existing names.
        if uses_cluster_chain {
            self.write_affinity_chain(table, slots, &cluster_chain, &cat.cluster, &owner, &comment);
        }
        if uses_local_chain {
            self.write_affinity_chain(table, slots, &local_chain, &cat.local, &owner, &comment);
        }
        if uses_external_chain {
            let mut ext = Chain::regular(&external_chain, owner.clone());
            if !external_local {
                ext.push(Rule::new(vec![jump(MARK_FOR_MASQUERADE)]));
            } else {
                for rule in external_local_short_circuits(family, self.input, &cluster_chain) {
                    ext.push(rule);
                }
            }
            if has_external {
                let target = if external_local { &local_chain } else { &cluster_chain };
                ext.push(Rule::new(vec![goto(target)]));
            }
            table.own.add_chain(ext);
        }
        self.cat.reachable
    }

    /// A balanced service address (node port): its key in `keys` (a `balanced-…` set) and its
    /// endpoints, by index, in the balancing map for their count. No endpoints: nothing (the
    /// caller has written the address's no-endpoint verdict).
    fn write_balanced(
        &self,
        table: &mut Fragment,
        keys: SharedSet,
        key: Vec<Value>,
        endpoints: &[Endpoint],
        owner: &Owner,
        comment: &Arc<str>,
    ) {
        if endpoints.is_empty() {
            return;
        }
        let map = if keys == SharedSet::BalancedNodeports { BalanceMap::Nodeport } else { BalanceMap::Service };
        balance(table, map, &key, endpoints, owner, comment);
        table.add(keys, key, Element::key_only(owner.clone()).with_comment(Arc::clone(comment)));
    }

    /// An external address (node port) with `externalTrafficPolicy: Local`: its key in `keys`
    /// (`balanced-local-ips`, `balanced-local-nodeports`) whenever the port has endpoints
    /// anywhere (pods and the node are short-circuited to them), the cluster-wide endpoints in
    /// the map `balance-service` (`balance-nodeport`) reads, and this node's in the one
    /// `balance-local` (`balance-local-nodeport`) reads.
    fn write_balanced_local(
        &self,
        table: &mut Fragment,
        keys: SharedSet,
        key: &[Value],
        owner: &Owner,
        comment: &Arc<str>,
    ) {
        if !self.cat.has_any {
            return;
        }
        let (cluster, local) = if keys == SharedSet::BalancedLocalNodeports {
            (BalanceMap::Nodeport, BalanceMap::LocalNodeport)
        } else {
            (BalanceMap::Service, BalanceMap::Local)
        };
        balance(table, cluster, key, &self.cat.cluster, owner, comment);
        balance(table, local, key, &self.cat.local, owner, comment);
        table.add(keys, key.to_vec(), Element::key_only(owner.clone()).with_comment(Arc::clone(comment)));
    }

    /// `meta l4proto tcp dnat to ip:port`
    fn dnat_to(&self, ep: &Endpoint) -> Vec<Stmt> {
        vec![
            Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(self.sp.name.protocol) },
            Stmt::Dnat { addr: ep.ip, port: ep.port },
        ]
    }

    /// A chain balancing over `endpoints` with ClientIP affinity (only such ports have chains of
    /// their own), and its elements: per slot a sticky check, per slot a record, then per slot
    /// group the choice by hash, gated by the group split when there are several groups (see
    /// [`super::affinity`]). Only the endpoints that have a slot are balanced over. Without a
    /// window or slots (the placement places every demand, so only a bug gets here) the chain
    /// gets a plain DNAT to its first endpoint rather than a rule naming no window.
    fn write_affinity_chain(
        &self,
        table: &mut Fragment,
        slots: &dyn SlotLookup,
        chain_name: &str,
        endpoints: &[Endpoint],
        owner: &Owner,
        comment: &Arc<str>,
    ) {
        let family = self.family;
        let mut chain = Chain::regular(chain_name, owner.clone());
        let seats = slots.affinity(&self.affinity_id());
        // The windows: one per slot group, and the split's when there are several groups; and
        // where the port's clients are keyed.
        let windows: Option<(Vec<Slot>, Option<Slot>, Slot)> = seats.and_then(|seats| {
            let window = |part: u32| slots.slot(&WindowId::new(family, chain_name, part));
            let groups = (0..seats.groups()).map(|g| window(u32::try_from(g).ok()?)).collect::<Option<Vec<Slot>>>()?;
            let split = if seats.grouped() { Some(window(SPLIT)?) } else { None };
            Some((groups, split, slots.clients(&self.affinity_id())?))
        });
        let (Some(seats), Some((groups, split, client_window))) = (seats, windows) else {
            tracing::error!(
                chain = chain_name,
                "no endpoint window or affinity slots placed for a balancing chain; using its first endpoint"
            );
            if let Some(ep) = endpoints.first() {
                chain.push(Rule::new(self.dnat_to(ep)).with_comment(&**comment));
            }
            table.own.add_chain(chain);
            return;
        };
        let slot_of = seats.index();
        let seated: Vec<(&Endpoint, usize)> =
            endpoints.iter().filter_map(|ep| Some((ep, *slot_of.get(&(ep.ip, ep.port))?))).collect();
        if seated.len() < endpoints.len() {
            tracing::warn!(
                service = %self.sp.name,
                endpoints = endpoints.len(),
                slots = seats.capacity(),
                "more endpoints than a port with session affinity has slots: the rest get no traffic"
            );
        }
        // Each group's maps are those of the shard its window is in.
        let maps = |window: Slot| {
            (
                SharedSet::EndpointMap(window.shard),
                SharedSet::SlotWindows(window.shard),
                SharedSet::SlotTargets(window.shard),
            )
        };
        let name = |set: SharedSet| set.name().into_owned();
        // The rules name every group's maps, and the split's, whether or not an endpoint of
        // this port is in them: a window with no endpoint (an empty slot group, the split) can
        // sit in a shard no endpoint uses, and its maps must exist as long as the rules do.
        groups.iter().flat_map(|w| SharedSet::affinity_shard(w.shard)).for_each(|set| table.names(set));
        if let Some(split) = split {
            table.names(SharedSet::SlotWindows(split.shard));
        }
        let clients = SharedSet::SlotClients(client_window.shard);
        table.names(clients);
        let clients = name(clients);
        let timeout_secs = self.sp.session_affinity_secs.unwrap_or(DEFAULT_AFFINITY_SECS);
        let l4proto = Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(self.sp.name.protocol) };
        // Slot j's clients are `client . K + j`: unique in the shard's set, the same in both of
        // the port's chains.
        let slot_number = |j: usize| client_window.offset.saturating_add(u32::try_from(j).unwrap_or(u32::MAX));
        for j in 0..seats.capacity() {
            let window = groups[AffinitySlots::group_of(j).0];
            let (slot, key, targets) =
                (slot_number(j), AffinitySlots::target_key(window.offset, j), name(maps(window).2));
            chain.push(Rule::new(vec![
                Stmt::SlotLookup { family, slot, set: clients.clone() },
                Stmt::KeyLookup { key, set: targets.clone() },
                Stmt::UpdateSlot { family, slot, set: clients.clone(), timeout_secs },
                l4proto.clone(),
                Stmt::DnatKeyMap { family, key, map: targets },
            ]));
        }
        // Per group its records and its choice: in the chain itself with one group; with several,
        // in a chain per group, which the chain reaches by the split's hash (one `goto` each).
        let proto = self.sp.name.protocol;
        let mut group_chains = Vec::new();
        for (g, window) in groups.iter().enumerate() {
            let first = g * GROUP_SLOTS;
            let mut rules: Vec<Rule> = (first..first + seats.group_capacity(g))
                .map(|j| {
                    Rule::new(vec![
                        Stmt::HashLookup { family, hash: seats.record(window.offset, j), set: name(maps(*window).1) },
                        Stmt::UpdateSlot { family, slot: slot_number(j), set: clients.clone(), timeout_secs },
                    ])
                })
                .collect();
            let (hash, map) = (seats.choice(window.offset, g), name(maps(*window).0));
            rules.push(Rule::new(vec![Stmt::DnatHashMap { family, proto, hash, map }]).with_comment(&**comment));
            let Some(split) = split else {
                rules.into_iter().for_each(|r| chain.push(r));
                continue;
            };
            let group_name = names::group_chain(chain_name, g);
            let (hash, set) = (seats.group_check(split.offset, g), name(SharedSet::SlotWindows(split.shard)));
            chain.push(Rule::new(vec![Stmt::HashLookup { family, hash, set }, goto(&group_name)]));
            let mut group_chain = Chain::regular(&group_name, owner.clone());
            rules.into_iter().for_each(|r| group_chain.push(r));
            group_chains.push(group_chain);
        }
        // Each group's endpoints split its hash range, in planning order.
        let mut members: Vec<Vec<(&Endpoint, usize)>> = vec![Vec::new(); seats.groups()];
        for (ep, j) in seated {
            if let Some(group) = members.get_mut(AffinitySlots::group_of(j).0) {
                group.push((ep, j));
            }
        }
        let element = |data: Element| data.with_comment(Arc::clone(comment));
        for (g, (group, window)) in members.iter().zip(&groups).enumerate() {
            let n = u32::try_from(group.len()).unwrap_or(u32::MAX);
            if n == 0 {
                continue;
            }
            let (endpoint_map, windows_map, targets_map) = maps(*window);
            for ((lo, hi), (ep, j)) in placement::ranges_in(window.offset, n, seats.modulus(g)).into_iter().zip(group) {
                let target = || vec![Value::Addr(ep.ip), Value::Port(ep.port)];
                table.add(
                    endpoint_map,
                    vec![Value::IndexRange(lo, hi)],
                    element(Element::values(target(), owner.clone())),
                );
                let shift = seats.shift(*j);
                table.add(
                    windows_map,
                    vec![Value::IndexRange(lo + shift, hi + shift)],
                    element(Element::key_only(owner.clone())),
                );
                let key = AffinitySlots::target_key(window.offset, *j);
                table.add(targets_map, vec![Value::Index(key)], element(Element::values(target(), owner.clone())));
            }
        }
        if let Some(split) = split {
            // The split: each group's share of the split's range in proportion to its endpoints,
            // at the group's own offset (its gate's).
            let weights: Vec<u32> = members.iter().map(|m| u32::try_from(m.len()).unwrap_or(u32::MAX)).collect();
            for (g, range) in weighted_ranges(seats.split_modulus(), &weights).into_iter().enumerate() {
                let Some((lo, hi)) = range else { continue };
                let at = seats.group_check(split.offset, g).offset;
                table.add(
                    SharedSet::SlotWindows(split.shard),
                    vec![Value::IndexRange(at + lo, at + hi)],
                    element(Element::key_only(owner.clone())),
                );
            }
        }
        // The group chains first, so that the chain's gotos name existing chains.
        group_chains.into_iter().for_each(|c| table.own.add_chain(c));
        table.own.add_chain(chain);
    }
}

/// `endpoints` by index under `key` in the balancing map of `map`'s kind for their count.
fn balance(
    table: &mut Fragment,
    map: BalanceMap,
    key: &[Value],
    endpoints: &[Endpoint],
    owner: &Owner,
    comment: &Arc<str>,
) {
    let Ok(n) = u32::try_from(endpoints.len()) else { return };
    if n == 0 {
        return;
    }
    for (i, ep) in (0..n).zip(endpoints) {
        // Exact capacity: a clone then a push would double it, for every endpoint.
        let mut indexed = Vec::with_capacity(key.len() + 1);
        indexed.extend_from_slice(key);
        indexed.push(Value::Index(i));
        let target = vec![Value::Addr(ep.ip), Value::Port(ep.port)];
        table.add(
            SharedSet::Balance(map, n),
            indexed,
            Element::values(target, owner.clone()).with_comment(Arc::clone(comment)),
        );
    }
}
