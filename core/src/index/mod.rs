//! The cluster as nftproxy knows it: Services, EndpointSlices, this node's Node and the
//! ServiceCIDRs, already validated by the sources, plus what changed since the last sync.
//!
//! A pure index in the manner of kubert's and linkerd's: every source speaks the same three
//! verbs per kind ([`Change::Apply`], [`Change::Delete`], [`Change::Reset`] for a complete list),
//! and the index folds them into its [`ClusterState`], recording which services changed. It
//! never sees netlink, and it never sees Kubernetes API objects: sources convert them first.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::SystemTime;

use tracing::debug;

use crate::model::{ClusterState, EndpointSliceInfo, NamespacedName, NodeInfo, ServiceCidrInfo, ServiceInfo};
use crate::net::IpFamily;

/// The object kinds the index holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Services,
    EndpointSlices,
    Nodes,
    ServiceCidrs,
}

/// One change to one kind.
#[derive(Debug, Clone)]
pub enum Change<T> {
    /// An object was added or modified (validated; an object the source cannot use arrives as
    /// a deletion of its name).
    Apply(T),
    /// An object is gone.
    Delete(NamespacedName),
    /// The complete list of this kind (a first list, or a relist after the watch broke): it
    /// replaces everything known of the kind.
    Reset(Vec<T>),
}

/// Something a source observed, converted.
#[derive(Debug, Clone)]
pub enum Update {
    Service(Change<ServiceInfo>),
    EndpointSlice(Change<EndpointSliceInfo>),
    /// This node's Node (sources pass only this node's).
    Node(Change<NodeInfo>),
    /// A ServiceCIDR (cluster-scoped: deletions name it with an empty namespace).
    ServiceCidr(Change<ServiceCidrInfo>),
}

/// Services to plan again, and whether the node changed (which makes every service change).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pending {
    pub services: BTreeSet<NamespacedName>,
    pub node_changed: bool,
    /// The ServiceCIDRs' ranges changed: only the infrastructure uses them, which a full sync
    /// writes.
    pub service_cidrs_changed: bool,
}

impl Pending {
    /// Whether there is anything to sync.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && !self.node_changed && !self.service_cidrs_changed
    }
}

/// Changes folded in since the last [`ClusterIndex::take_changes`], for metrics.
#[derive(Debug, Clone, Default)]
pub struct Changes {
    pub services: u64,
    pub endpoints: u64,
    /// `endpoints.kubernetes.io/last-change-trigger-time` of changed EndpointSlices, with the
    /// slices' family.
    pub trigger_times: Vec<(IpFamily, SystemTime)>,
}

/// The index.
#[derive(Debug, Default)]
pub struct ClusterIndex {
    state: ClusterState,
    pending: Pending,
    listed: HashSet<Kind>,
    /// Kinds besides Services and EndpointSlices whose first list [`ClusterIndex::ready`] waits for.
    awaited: HashSet<Kind>,
    changes: Changes,
}

impl ClusterIndex {
    /// An empty index.
    pub fn new() -> ClusterIndex {
        ClusterIndex::default()
    }

    /// The cluster state as last seen.
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// The cluster state, consuming the index.
    pub fn into_state(self) -> ClusterState {
        self.state
    }

    /// Whether the first complete lists of Services and EndpointSlices have arrived (upstream
    /// never syncs before that, so a restart does not briefly program a partial view).
    pub fn ready(&self) -> bool {
        self.listed.contains(&Kind::Services)
            && self.listed.contains(&Kind::EndpointSlices)
            && self.awaited.iter().all(|k| self.listed.contains(k))
    }

    /// Makes [`ClusterIndex::ready`] wait for the first list of `kind` too (the API source waits
    /// for ServiceCIDRs, so the first sync already drops traffic to unallocated ClusterIPs; it
    /// sends an empty list where the API server has none).
    pub fn await_list(&mut self, kind: Kind) {
        self.awaited.insert(kind);
    }

    /// Whether a complete list of `kind` has arrived.
    pub fn listed(&self, kind: Kind) -> bool {
        self.listed.contains(&kind)
    }

    /// Whether there is something to sync.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// What changed since the last call: the services to plan again.
    pub fn take_pending(&mut self) -> Pending {
        std::mem::take(&mut self.pending)
    }

    /// Counts of changes since the last call (for metrics).
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    /// Counts of changes not taken yet.
    pub fn changes(&self) -> &Changes {
        &self.changes
    }

    /// Folds one update in.
    pub fn apply(&mut self, update: Update) {
        match update {
            Update::Service(Change::Apply(info)) => {
                let name = info.name.clone();
                if self.state.upsert_service(info) {
                    self.service_changed(name);
                }
            }
            Update::Service(Change::Delete(name)) => {
                if self.state.remove_service(&name) {
                    self.service_changed(name);
                }
            }
            Update::Service(Change::Reset(list)) => {
                let changed = self.state.replace_services(list);
                debug!(services = changed.len(), "services listed");
                for name in changed {
                    self.service_changed(name);
                }
                self.listed.insert(Kind::Services);
            }
            Update::EndpointSlice(Change::Apply(info)) => {
                let trigger = info.trigger_time.as_deref().and_then(parse_time).map(|t| (info.family, t));
                let changed = self.state.upsert_slice(info);
                if !changed.is_empty() {
                    self.changes.endpoints += 1;
                    self.changes.trigger_times.extend(trigger);
                }
                self.pending.services.extend(changed);
            }
            Update::EndpointSlice(Change::Delete(name)) => {
                if let Some(service) = self.state.remove_slice(&name) {
                    self.changes.endpoints += 1;
                    self.pending.services.insert(service);
                }
            }
            Update::EndpointSlice(Change::Reset(list)) => {
                let triggers: BTreeMap<NamespacedName, Option<(IpFamily, SystemTime)>> = list
                    .iter()
                    .map(|s| (s.service.clone(), s.trigger_time.as_deref().and_then(parse_time).map(|t| (s.family, t))))
                    .collect();
                let changed = self.state.replace_slices(list);
                debug!(services = changed.len(), "endpoint slices listed");
                self.changes.endpoints += changed.len() as u64;
                self.changes.trigger_times.extend(changed.iter().filter_map(|s| triggers.get(s).copied().flatten()));
                self.pending.services.extend(changed);
                self.listed.insert(Kind::EndpointSlices);
            }
            Update::Node(change) => {
                let node = match change {
                    Change::Apply(node) => Some(node),
                    Change::Delete(_) => None,
                    Change::Reset(list) => {
                        self.listed.insert(Kind::Nodes);
                        list.into_iter().next()
                    }
                };
                if self.state.set_node(node) {
                    self.pending.node_changed = true;
                }
            }
            Update::ServiceCidr(change) => {
                let changed = match change {
                    Change::Apply(cidr) => self.state.upsert_service_cidr(cidr),
                    Change::Delete(name) => self.state.remove_service_cidr(&name.name),
                    Change::Reset(list) => {
                        self.listed.insert(Kind::ServiceCidrs);
                        self.state.replace_service_cidrs(list)
                    }
                };
                if changed {
                    debug!(service_cidrs = self.state.service_cidr_count(), "service CIDRs changed");
                    self.pending.service_cidrs_changed = true;
                }
            }
        }
    }

    fn service_changed(&mut self, name: NamespacedName) {
        self.changes.services += 1;
        self.pending.services.insert(name);
    }
}

fn parse_time(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s.trim()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ServicePort, ServicePortName, SliceEndpoint};
    use crate::net::L4Proto;

    fn service(name: &str, ip: &str) -> ServiceInfo {
        let name = NamespacedName::new("ns", name);
        ServiceInfo {
            name: name.clone(),
            ports: vec![ServicePort::new(
                ServicePortName { service: name, port: "http".into(), protocol: L4Proto::Tcp },
                vec![ip.parse().unwrap()],
                80,
            )],
        }
    }

    fn slice(name: &str, service: &str, ip: &str) -> EndpointSliceInfo {
        EndpointSliceInfo {
            name: NamespacedName::new("ns", name),
            service: NamespacedName::new("ns", service),
            family: IpFamily::V4,
            ports: vec![("http".into(), L4Proto::Tcp, 8080)],
            endpoints: vec![SliceEndpoint::ready(ip.parse().unwrap())],
            trigger_time: Some("2026-01-02T03:04:05Z".into()),
        }
    }

    fn names(p: &Pending) -> Vec<String> {
        p.services.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn applies_deletes_and_resets_record_what_changed() {
        let mut index = ClusterIndex::new();
        assert!(!index.ready());
        index.apply(Update::Service(Change::Reset(vec![service("a", "10.96.0.1"), service("b", "10.96.0.2")])));
        index.apply(Update::EndpointSlice(Change::Reset(vec![slice("a-1", "a", "10.0.0.1")])));
        assert!(index.ready() && !index.listed(Kind::Nodes));
        assert_eq!(names(&index.take_pending()), vec!["ns/a", "ns/b"]);
        let changes = index.take_changes();
        assert_eq!((changes.services, changes.endpoints, changes.trigger_times.len()), (2, 1, 1));

        // The same object again changes nothing.
        index.apply(Update::Service(Change::Apply(service("a", "10.96.0.1"))));
        assert!(!index.has_pending());
        index.apply(Update::EndpointSlice(Change::Apply(slice("a-1", "a", "10.0.0.2"))));
        index.apply(Update::Service(Change::Delete(NamespacedName::new("ns", "b"))));
        assert_eq!(names(&index.take_pending()), vec!["ns/a", "ns/b"]);

        // A relist that lost b's slice and gained c: only what differs is pending.
        index.apply(Update::Service(Change::Reset(vec![service("a", "10.96.0.1"), service("c", "10.96.0.3")])));
        assert_eq!(names(&index.take_pending()), vec!["ns/c"]);
        index.apply(Update::EndpointSlice(Change::Reset(vec![])));
        assert_eq!(names(&index.take_pending()), vec!["ns/a"]);
    }

    #[test]
    fn service_cidrs_change_the_infrastructure_and_can_be_awaited() {
        let mut index = ClusterIndex::new();
        index.await_list(Kind::ServiceCidrs);
        index.apply(Update::Service(Change::Reset(vec![])));
        index.apply(Update::EndpointSlice(Change::Reset(vec![])));
        assert!(!index.ready(), "waits for the ServiceCIDRs");
        let cidr = |name: &str, net: &str| ServiceCidrInfo { name: name.into(), cidrs: vec![net.parse().unwrap()] };
        index.apply(Update::ServiceCidr(Change::Reset(vec![cidr("kubernetes", "10.96.0.0/16")])));
        assert!(index.ready());
        assert!(index.take_pending().service_cidrs_changed);
        // A second object inside the first changes no range.
        index.apply(Update::ServiceCidr(Change::Apply(cidr("inner", "10.96.1.0/24"))));
        assert!(!index.has_pending());
        index.apply(Update::ServiceCidr(Change::Apply(cidr("more", "10.100.0.0/16"))));
        assert!(index.take_pending().service_cidrs_changed);
        assert_eq!(index.state().service_cidrs(crate::net::IpFamily::V4).len(), 2);
        index.apply(Update::ServiceCidr(Change::Delete(NamespacedName::new("", "more"))));
        assert!(index.take_pending().service_cidrs_changed);
        assert!(index.state().service_cidrs(crate::net::IpFamily::V6).is_empty());
    }

    #[test]
    fn the_node_changing_makes_everything_pending() {
        let mut index = ClusterIndex::new();
        let node = NodeInfo { name: "node1".into(), ..NodeInfo::default() };
        index.apply(Update::Node(Change::Reset(vec![node.clone()])));
        assert!(index.listed(Kind::Nodes));
        assert!(index.take_pending().node_changed);
        index.apply(Update::Node(Change::Apply(node)));
        assert!(!index.has_pending(), "the same node");
        index.apply(Update::Node(Change::Delete(NamespacedName::new("", "node1"))));
        assert!(index.take_pending().node_changed);
        assert!(index.state().node().is_none());
    }
}
