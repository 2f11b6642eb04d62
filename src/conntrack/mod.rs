//! The conntrack reconciler for UDP and SCTP services, with upstream kube-proxy's rule (its
//! `CleanStaleEntries`, ≥ 1.32): a flow whose original destination is a service port's
//! frontend — its ClusterIP, ExternalIPs or LoadBalancer IPs with the port, or its NodePort on
//! a node-port address — is stale when its reply source is not a **serving** endpoint of that
//! port. Which endpoints this node picks for new flows (ready before terminating, topology
//! hints, Local policies) does not matter: a change of the service must not cut existing flows,
//! only an endpoint that stopped serving does. Without this, a UDP client that keeps sending
//! (DNS, statsd, QUIC) stays DNATed to a pod that is gone.
//!
//! Beyond the current service ports, the ports of services deleted since the previous pass
//! lose every flow to their frontends (upstream k/k#141371), and a port scaled to zero loses
//! its flows as well (k/k#139629); NodePort flows are matched only on node-port addresses, so
//! that is safe for NodePorts too. A pass runs after a successful sync when the service ports
//! differ from the previous pass (always for the first, so restarts and the one-shot `sync`
//! check every flow), dumps the family's table over ctnetlink and deletes exact tuples: there
//! is never a flush.
//!
//! TCP flows are left alone, as upstream leaves them, but for one case upstream does not
//! handle: at start-up (and after a failed pass), TCP connections to a frontend that nothing
//! answered and that were never DNATed — sent while this node had no rules, as pods do when
//! a node boots — are deleted. Their entries live two minutes in SYN_SENT, and a client that
//! reuses the tuple (the kernel hands source ports out in sequence per destination) matches
//! the entry, whose NAT was decided once, and is never DNATed (docs/differences.md).
//!
//! The start-up sysctls kube-proxy writes live in [`sysctls`].

pub(crate) mod sysctls;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use tracing::{debug, error, info, trace};

use crate::model::{ClusterState, ServicePortName};
use crate::net::{FamilyMap, IpFamily, L4Proto};
use crate::netlink::NetlinkError;
use crate::netlink::conntrack::{Conntrack, Flow};
use crate::nodeaddr::NodePortTargets;
use crate::plan::{ConntrackTarget, NodePorts};
use crate::sync::ConntrackUpdate;

/// The kernel's conntrack table as the reconciler uses it.
pub(crate) trait FlowTable {
    /// The flows of `family` that `keep` keeps.
    fn flows(&mut self, family: IpFamily, keep: &dyn Fn(&Flow) -> bool) -> Result<Vec<Flow>, NetlinkError>;
    /// Deletes these flows by their exact original tuple; returns how many the kernel removed.
    fn delete(&mut self, family: IpFamily, flows: &[Flow]) -> Result<usize, NetlinkError>;
}

/// ctnetlink in the current network namespace, opened on first use (most syncs change no UDP
/// or SCTP service port and never need it).
#[derive(Default)]
pub(crate) struct KernelFlows {
    socket: Option<Conntrack>,
}

impl KernelFlows {
    fn socket(&mut self) -> Result<&mut Conntrack, NetlinkError> {
        match &mut self.socket {
            Some(s) => Ok(s),
            empty => Ok(empty.insert(Conntrack::open()?)),
        }
    }
}

impl FlowTable for KernelFlows {
    fn flows(&mut self, family: IpFamily, keep: &dyn Fn(&Flow) -> bool) -> Result<Vec<Flow>, NetlinkError> {
        self.socket()?.flows(family, keep)
    }

    fn delete(&mut self, family: IpFamily, flows: &[Flow]) -> Result<usize, NetlinkError> {
        self.socket()?.delete(family, flows)
    }
}

/// A stale flow and the service port it belonged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StaleFlow<'a> {
    pub flow: Flow,
    pub port: &'a ServicePortName,
}

/// The frontends of one family's service ports and the reply sources each allows.
struct Frontends<'a> {
    by_destination: HashMap<(u8, SocketAddr), usize>,
    by_node_port: HashMap<(u8, u16), usize>,
    ports: Vec<(&'a ServicePortName, HashSet<SocketAddr>)>,
}

impl<'a> Frontends<'a> {
    /// Deleted ports go in first with no endpoint allowed; a current port claiming the same
    /// frontend (an address or NodePort reused at once) replaces them.
    fn new(current: &[&'a ConntrackTarget], deleted: &[&'a ConntrackTarget]) -> Frontends<'a> {
        let mut f = Frontends { by_destination: HashMap::new(), by_node_port: HashMap::new(), ports: Vec::new() };
        for (t, keep) in deleted.iter().map(|t| (t, false)).chain(current.iter().map(|t| (t, true))) {
            let i = f.ports.len();
            let allowed = if keep {
                t.endpoints.iter().map(|(ip, port)| canonical(SocketAddr::new(*ip, *port))).collect()
            } else {
                HashSet::new()
            };
            f.ports.push((&t.name, allowed));
            let proto = t.protocol.number();
            for (ip, port) in &t.destinations {
                f.by_destination.insert((proto, canonical(SocketAddr::new(*ip, *port))), i);
            }
            if let Some(np) = t.node_port {
                f.by_node_port.insert((proto, np), i);
            }
        }
        f
    }

    /// The port whose frontend a flow was sent to, if any. A NodePort counts only on a
    /// node-port address: a flow to the same port number elsewhere is not ours.
    fn port_of(&self, flow: &Flow, node_ips: &HashSet<IpAddr>) -> Option<usize> {
        let dst = canonical(flow.original.dst);
        self.by_destination.get(&(flow.protocol, dst)).copied().or_else(|| {
            node_ips.contains(&dst.ip()).then(|| self.by_node_port.get(&(flow.protocol, dst.port())).copied()).flatten()
        })
    }
}

/// Which of `flows` are stale: sent to a frontend of a `current` port and answered by
/// something that is not one of its serving endpoints, or sent to a frontend of a `deleted`
/// port that no current port has taken over. `node_ips` are the addresses NodePorts are
/// served on.
pub(crate) fn stale_flows<'a>(
    flows: &[Flow],
    current: &[&'a ConntrackTarget],
    deleted: &[&'a ConntrackTarget],
    node_ips: &HashSet<IpAddr>,
) -> Vec<StaleFlow<'a>> {
    let frontends = Frontends::new(current, deleted);
    flows
        .iter()
        .filter_map(|f| {
            let i = frontends.port_of(f, node_ips)?;
            let (port, allowed) = &frontends.ports[i];
            (!allowed.contains(&canonical(f.reply.src))).then_some(StaleFlow { flow: *f, port })
        })
        .collect()
}

/// The TCP frontends (address and port) of `state`'s service ports in `family`.
fn tcp_frontends(state: &ClusterState, family: IpFamily) -> HashMap<SocketAddr, &ServicePortName> {
    state
        .services()
        .flat_map(|s| &s.ports)
        .filter(|p| p.name.protocol == L4Proto::Tcp)
        .flat_map(|p| p.frontends(family).map(move |ip| (canonical(SocketAddr::new(ip, p.port)), &p.name)))
        .collect()
}

/// Which of `flows` are TCP connections to one of `frontends` that nothing answered and that
/// were never DNATed (their reply would come from the frontend itself): sent while this node
/// had no rule for the frontend.
pub(crate) fn never_dnated<'a>(
    flows: &[Flow],
    frontends: &HashMap<SocketAddr, &'a ServicePortName>,
) -> Vec<StaleFlow<'a>> {
    flows
        .iter()
        .filter(|f| unanswered_tcp_without_nat(f))
        .filter_map(|f| frontends.get(&canonical(f.original.dst)).map(|port| StaleFlow { flow: *f, port }))
        .collect()
}

/// A TCP flow nothing answered whose reply would come from its original destination (no DNAT).
fn unanswered_tcp_without_nat(f: &Flow) -> bool {
    f.protocol == L4Proto::Tcp.number() && !f.replied && canonical(f.reply.src) == canonical(f.original.dst)
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// The addresses NodePort traffic is accepted on, in both families: the `nodeport-ips`, or
/// every local address but loopback where NodePorts match `fib daddr type local`.
pub(crate) fn node_port_addresses(targets: &NodePortTargets) -> HashSet<IpAddr> {
    let mut out = HashSet::new();
    let mut local: Option<Vec<IpAddr>> = None;
    for (family, ports) in [(IpFamily::V4, &targets.v4), (IpFamily::V6, &targets.v6)] {
        match ports {
            NodePorts::Addresses(ips) => out.extend(ips.iter().map(|ip| ip.to_canonical())),
            NodePorts::MatchAll => {
                let local = local
                    .get_or_insert_with(|| crate::nodeaddr::local_addresses().into_iter().map(|(_, ip)| ip).collect());
                out.extend(local.iter().filter(|ip| IpFamily::of(ip) == family && !ip.is_loopback()).copied());
            }
        }
    }
    out
}

/// One family's pass over the conntrack table, for the metrics: recorded when the table could
/// be listed, as upstream records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pass {
    pub family: IpFamily,
    pub took: Duration,
    pub deleted: usize,
}

/// The reconciler's memory, per family: the service ports as of the last sync, ports deleted
/// whose flows are not gone yet, and whether every flow has been checked since start-up or
/// the last failed pass.
#[derive(Debug, Default)]
pub(crate) struct Reconciler {
    ports: FamilyMap<BTreeMap<ServicePortName, ConntrackTarget>>,
    deleted: FamilyMap<Vec<ConntrackTarget>>,
    checked: FamilyMap<()>,
}

/// Whether `state` still has this service port in `family` (a port the kernel refused is
/// missing from the sync's targets but not deleted).
fn exists(state: &ClusterState, name: &ServicePortName, family: IpFamily) -> bool {
    state
        .service(&name.service)
        .is_some_and(|s| s.ports.iter().any(|p| p.name == *name && p.cluster_ip(family).is_some()))
}

impl Reconciler {
    /// Follows a sync's `update` and runs a pass in each family whose service ports changed:
    /// over every flow the first time (a restart, or the one-shot `sync`), after a full sync
    /// that changed anything, and after a failed pass; else over the flows to the frontends
    /// of the ports that changed or went (a flow to an unchanged port was checked when that
    /// port last changed, and the rules have sent new flows only to its serving endpoints
    /// since), so a sync at 44,000 services does not compare them all. `state` tells deleted
    /// ports from refused ones. Failures are logged; a family whose pass failed checks every
    /// flow after the next sync.
    pub(crate) fn reconcile(
        &mut self,
        table: &mut dyn FlowTable,
        update: &ConntrackUpdate,
        nodeports: &NodePortTargets,
        state: &ClusterState,
    ) -> Vec<Pass> {
        let mut node_ips: Option<HashSet<IpAddr>> = None;
        let mut passes = Vec::new();
        for family in IpFamily::ALL {
            let ports = self.ports.get_or_insert_with(family, BTreeMap::new);
            let deleted = self.deleted.get_or_insert_with(family, Vec::new);
            let mut changed: Vec<ServicePortName> = Vec::new();
            let mut whole = self.checked.get(family).is_none();
            let unanswered = if whole { tcp_frontends(state, family) } else { HashMap::new() };
            match update {
                ConntrackUpdate::All(targets) => {
                    let current: BTreeMap<ServicePortName, ConntrackTarget> =
                        targets.iter().filter(|t| t.family == family).map(|t| (t.name.clone(), t.clone())).collect();
                    whole |= current != *ports;
                    let gone =
                        ports.values().filter(|t| !current.contains_key(&t.name) && !exists(state, &t.name, family));
                    for t in gone {
                        forget(deleted, t);
                    }
                    *ports = current;
                }
                ConntrackUpdate::Changed { before, after } => {
                    for t in before.iter().filter(|t| t.family == family) {
                        if !after.iter().any(|a| a.name == t.name && a.family == family) {
                            ports.remove(&t.name);
                            if !exists(state, &t.name, family) {
                                forget(deleted, t);
                            }
                        }
                    }
                    for t in after.iter().filter(|t| t.family == family) {
                        if ports.get(&t.name) != Some(t) {
                            changed.push(t.name.clone());
                            ports.insert(t.name.clone(), t.clone());
                        }
                    }
                }
            }
            // A deleted port's frontend may be an unchanged port's too (two Services with the
            // same externalIP): with every current port in, the current one keeps its flows.
            let live: Vec<&ConntrackTarget> = if whole || !deleted.is_empty() {
                ports.values().collect()
            } else {
                changed.iter().filter_map(|n| ports.get(n)).collect()
            };
            if live.is_empty() && deleted.is_empty() && unanswered.is_empty() {
                if whole {
                    self.checked.insert(family, ());
                }
                continue;
            }
            let node_ips = node_ips.get_or_insert_with(|| node_port_addresses(nodeports));
            let deleted_now: Vec<&ConntrackTarget> = deleted.iter().collect();
            let sweep = Sweep { current: &live, deleted: &deleted_now, unanswered: &unanswered };
            match pass(table, family, sweep, node_ips) {
                Some((p, true)) => {
                    passes.push(p);
                    deleted.clear();
                    self.checked.insert(family, ());
                }
                Some((p, false)) => {
                    passes.push(p);
                    self.checked.remove(family);
                }
                None => {
                    self.checked.remove(family);
                }
            }
        }
        passes
    }
}

/// Adds a deleted port to those whose flows are still to go, once (while listing keeps
/// failing, the same port can go and come back many times).
fn forget(deleted: &mut Vec<ConntrackTarget>, port: &ConntrackTarget) {
    deleted.retain(|d| d.name != port.name);
    deleted.push(port.clone());
}

/// What one pass looks for: flows of the `current` and `deleted` UDP and SCTP ports, and the
/// never-answered, never-DNATed TCP flows to the `unanswered` frontends.
struct Sweep<'s, 'a> {
    current: &'s [&'a ConntrackTarget],
    deleted: &'s [&'a ConntrackTarget],
    unanswered: &'s HashMap<SocketAddr, &'a ServicePortName>,
}

/// One family's pass. `None` when the table could not be listed; otherwise the pass and
/// whether every deletion was sent.
fn pass(
    table: &mut dyn FlowTable,
    family: IpFamily,
    sweep: Sweep<'_, '_>,
    node_ips: &HashSet<IpAddr>,
) -> Option<(Pass, bool)> {
    let Sweep { current, deleted, unanswered } = sweep;
    let started = Instant::now();
    let protocols: BTreeSet<u8> = current.iter().chain(deleted).map(|t| t.protocol.number()).collect();
    // UDP and SCTP flows of the ports are all compared; of TCP only the candidates are kept.
    let keep = |f: &Flow| protocols.contains(&f.protocol) || (!unanswered.is_empty() && unanswered_tcp_without_nat(f));
    debug!(%family, ports = current.len(), deleted_ports = deleted.len(), "reconciling conntrack entries");
    let flows = match table.flows(family, &keep) {
        Ok(f) => f,
        Err(e) => {
            error!(%family, error = %e, "cannot list conntrack entries; trying again after the next sync");
            return None;
        }
    };
    let mut stale = stale_flows(&flows, current, deleted, node_ips);
    let never = never_dnated(&flows, unanswered);
    if !never.is_empty() {
        let ports: BTreeSet<String> = never.iter().map(|s| s.port.to_string()).collect();
        let ports: Vec<String> = ports.into_iter().collect();
        info!(
            %family,
            entries = never.len(),
            services = ports.join(","),
            "deleting the conntrack entries of TCP connections never DNATed (sent to a service before this node had its rules): a client reusing their tuple would match them and never reach an endpoint"
        );
    }
    stale.extend(never);
    for s in &stale {
        trace!(
            service = %s.port,
            protocol = s.flow.protocol,
            orig_dst = %s.flow.original.dst,
            reply_src = %s.flow.reply.src,
            "deleting stale conntrack entry"
        );
    }
    let exact: Vec<Flow> = stale.iter().map(|s| s.flow).collect();
    let (deleted_entries, complete) = match table.delete(family, &exact) {
        Ok(n) => (n, true),
        Err(e) => {
            error!(%family, error = %e, "cannot delete all stale conntrack entries; trying again after the next sync");
            (0, false)
        }
    };
    let took = started.elapsed();
    if deleted_entries > 0 {
        let ports: BTreeSet<String> = stale.iter().map(|s| s.port.to_string()).collect();
        let ports: Vec<String> = ports.into_iter().collect();
        info!(%family, deleted = deleted_entries, services = ports.join(","), "deleted stale conntrack entries");
    }
    debug!(%family, flows = flows.len(), deleted = deleted_entries, took_us = took.as_micros() as u64, "reconciled conntrack entries");
    Some((Pass { family, took, deleted: deleted_entries }, complete))
}

#[cfg(test)]
mod tests;
