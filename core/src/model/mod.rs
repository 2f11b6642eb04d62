//! Kubernetes objects as nftproxy needs them: Services split into service ports, EndpointSlices
//! merged into endpoints per service port, this node's Node, and the ServiceCIDRs.
//!
//! [`ClusterState`] is the in-memory state the reconciler keeps. Converting from the API types
//! (`convert`) validates every field; a bad field is skipped alone and reported as a
//! [`Problem`], so one malformed object never blocks the rest.

pub mod api;
pub mod convert;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use crate::net::{IpFamily, L4Proto};

/// `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespacedName {
    pub namespace: String,
    pub name: String,
}

impl NamespacedName {
    /// A name in a namespace.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> NamespacedName {
        NamespacedName { namespace: namespace.into(), name: name.into() }
    }
}

impl fmt::Display for NamespacedName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One port of one Service, as upstream names it: `namespace/name:port` (`namespace/name`
/// for an unnamed port). The protocol is part of its identity.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    pub service: NamespacedName,
    pub port: String,
    pub protocol: L4Proto,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() { write!(f, "{}", self.service) } else { write!(f, "{}:{}", self.service, self.port) }
    }
}

/// What nftproxy needs of one Service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub name: ServicePortName,
    /// One ClusterIP per family the Service has.
    pub cluster_ips: Vec<IpAddr>,
    pub port: u16,
    pub node_port: Option<u16>,
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` with ipMode VIP (or unset).
    pub load_balancer_ips: Vec<IpAddr>,
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// `externalTrafficPolicy: Local` (only meaningful when externally accessible).
    pub external_policy_local: bool,
    /// `internalTrafficPolicy: Local`.
    pub internal_policy_local: bool,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub session_affinity_secs: Option<u32>,
    pub health_check_node_port: Option<u16>,
}

impl ServicePort {
    /// A plain ClusterIP port `name` on `cluster_ips`, port `port`: no NodePort, external or
    /// load-balancer addresses, source ranges, session affinity or health check, both traffic
    /// policies `Cluster`. Tests and the tools' synthetic clusters start from it and set what
    /// they need (`ServicePort { node_port: Some(30080), ..ServicePort::new(…) }`).
    pub fn new(name: ServicePortName, cluster_ips: Vec<IpAddr>, port: u16) -> ServicePort {
        ServicePort {
            name,
            cluster_ips,
            port,
            node_port: None,
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            load_balancer_source_ranges: Vec::new(),
            external_policy_local: false,
            internal_policy_local: false,
            session_affinity_secs: None,
            health_check_node_port: None,
        }
    }

    /// The ClusterIP of a family, if the Service has one.
    pub fn cluster_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.cluster_ips.iter().copied().find(|ip| IpFamily::of(ip) == family)
    }

    /// The addresses the port is reached at in `family` (with [`ServicePort::port`]): its
    /// ClusterIP, ExternalIPs and LoadBalancer IPs. NodePorts are not among them.
    pub fn frontends(&self, family: IpFamily) -> impl Iterator<Item = IpAddr> + '_ {
        let others = self.external_ips.iter().chain(&self.load_balancer_ips).copied();
        self.cluster_ip(family).into_iter().chain(others.filter(move |ip| IpFamily::of(ip) == family))
    }

    /// NodePort, ExternalIPs or LoadBalancer IPs: traffic can come from outside the cluster.
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }

    /// External traffic goes to local endpoints only.
    pub fn external_local(&self) -> bool {
        self.externally_accessible() && self.external_policy_local
    }

    /// Some traffic uses the cluster-wide endpoint list: internal traffic under the Cluster
    /// policy, and any externally accessible port — even with `externalTrafficPolicy: Local`,
    /// pods and the node reaching its external addresses are short-circuited to the
    /// cluster-wide endpoints (as upstream's `UsesClusterEndpoints`).
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_policy_local || self.externally_accessible()
    }

    /// Some traffic uses the local endpoint list.
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || self.external_local()
    }
}

/// An endpoint's topology hints of one kind (`hints.forZones` or `hints.forNodes` names). Most
/// endpoints have none, so the names are boxed: an endpoint's two are 16 bytes, where two empty
/// `BTreeSet`s cost 48 (8 MB at 250,000 endpoints).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[allow(clippy::box_collection, reason = "the box is the point: one pointer when there are no hints")]
pub struct Hints(Option<Box<BTreeSet<String>>>);

impl Hints {
    /// No hint of this kind.
    pub fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(|names| names.is_empty())
    }

    /// Whether the hint names `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.0.as_ref().is_some_and(|names| names.contains(name))
    }

    /// Adds a name.
    pub fn insert(&mut self, name: String) {
        self.0.get_or_insert_default().insert(name);
    }
}

impl FromIterator<String> for Hints {
    fn from_iter<I: IntoIterator<Item = String>>(names: I) -> Hints {
        let names: BTreeSet<String> = names.into_iter().collect();
        Hints((!names.is_empty()).then(|| Box::new(names)))
    }
}

/// One endpoint of a service port (an address from an EndpointSlice, with the slice's port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
    pub zone: Option<String>,
    pub zone_hints: Hints,
    pub node_hints: Hints,
}

impl Endpoint {
    /// `ip:port` (`[ip]:port` for IPv6), as upstream prints endpoints.
    pub fn address(&self) -> String {
        std::net::SocketAddr::new(self.ip, self.port).to_string()
    }
}

/// An EndpointSlice's ports and endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSliceInfo {
    pub name: NamespacedName,
    pub service: NamespacedName,
    pub family: IpFamily,
    /// (port name, protocol, port number)
    pub ports: Vec<(String, L4Proto, u16)>,
    pub endpoints: Vec<SliceEndpoint>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, if set (for latency metrics).
    pub trigger_time: Option<String>,
}

/// One endpoint of a slice, before it is paired with a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceEndpoint {
    pub ip: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
    pub zone: Option<String>,
    pub zone_hints: Hints,
    pub node_hints: Hints,
}

impl SliceEndpoint {
    /// A ready, serving endpoint at `ip`, not terminating, on no named node, without zone or
    /// hints. Tests and the tools' synthetic clusters start from it
    /// (`SliceEndpoint { node_name: Some(…), ..SliceEndpoint::ready(ip) }`).
    pub fn ready(ip: IpAddr) -> SliceEndpoint {
        SliceEndpoint {
            ip,
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            zone: None,
            zone_hints: Hints::default(),
            node_hints: Hints::default(),
        }
    }
}

/// This node, as its Node object describes it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// The Node's addresses as upstream's `GetNodeHostIPs` orders them: InternalIPs, then
    /// ExternalIPs. The first of each family is its node IP (`primary` NodePort addresses).
    pub host_ips: Vec<IpAddr>,
    pub pod_cidrs: Vec<IpNet>,
    /// Being deleted (deletionTimestamp set, or tainted `ToBeDeletedByClusterAutoscaler`):
    /// `/healthz` then fails so load balancers drain the node, as upstream does.
    pub being_deleted: bool,
}

impl NodeInfo {
    /// `topology.kubernetes.io/zone`.
    pub fn zone(&self) -> Option<&str> {
        self.labels.get("topology.kubernetes.io/zone").map(String::as_str)
    }
}

/// A ServiceCIDR: ranges ClusterIPs are allocated from (one per family at most).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceCidrInfo {
    pub name: String,
    pub cidrs: Vec<IpNet>,
}

/// The kinds of Kubernetes objects nftproxy reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectKind {
    Service,
    EndpointSlice,
    Node,
    ServiceCidr,
}

impl ObjectKind {
    /// Every kind nftproxy reads.
    pub const ALL: [ObjectKind; 4] =
        [ObjectKind::Service, ObjectKind::EndpointSlice, ObjectKind::Node, ObjectKind::ServiceCidr];

    /// The kind as the API names it.
    pub fn name(self) -> &'static str {
        match self {
            ObjectKind::Service => "Service",
            ObjectKind::EndpointSlice => "EndpointSlice",
            ObjectKind::Node => "Node",
            ObjectKind::ServiceCidr => "ServiceCIDR",
        }
    }

    /// The API group and version the kind lives in.
    pub fn api_version(self) -> &'static str {
        match self {
            ObjectKind::Service | ObjectKind::Node => "v1",
            ObjectKind::EndpointSlice => "discovery.k8s.io/v1",
            ObjectKind::ServiceCidr => "networking.k8s.io/v1",
        }
    }
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which Kubernetes object something came from.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectRef {
    pub kind: ObjectKind,
    pub namespace: Option<String>,
    pub name: String,
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {ns}/{}", self.kind, self.name),
            None => write!(f, "{} {}", self.kind, self.name),
        }
    }
}

/// Something wrong with an object: logged, counted, and (with the API source) sent as an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub object: ObjectRef,
    /// The field at fault (`spec.ports[1].port`), or empty when the whole object is.
    pub field: String,
    pub reason: String,
    /// Whether the whole object was skipped (rather than one field).
    pub object_skipped: bool,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = if self.object_skipped { "skipped" } else { "ignored" };
        if self.field.is_empty() {
            write!(f, "{}: {what}: {}", self.object, self.reason)
        } else {
            write!(f, "{}: {} {what}: {}", self.object, self.field, self.reason)
        }
    }
}

/// A Service's ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceInfo {
    pub name: NamespacedName,
    pub ports: Vec<ServicePort>,
}

/// What one service was planned from: its Service, EndpointSlices and this node, shared with
/// the [`ClusterState`] they came from. Snapshots compare by content.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceSnapshot {
    pub name: NamespacedName,
    pub service: Option<Arc<ServiceInfo>>,
    pub slices: Vec<Arc<EndpointSliceInfo>>,
    pub node: Option<Arc<NodeInfo>>,
}

impl ServiceSnapshot {
    /// A cluster state holding just this service (to plan it again).
    pub fn to_state(&self) -> ClusterState {
        let mut s = ClusterState { node: self.node.clone(), ..ClusterState::default() };
        if let Some(info) = &self.service {
            s.ipv6_services = usize::from(has_ipv6(info));
            s.services.insert(self.name.clone(), info.clone());
        }
        for slice in &self.slices {
            s.slice_owner.insert(slice.name.clone(), self.name.clone());
            s.slices.entry(self.name.clone()).or_default().insert(slice.name.clone(), slice.clone());
        }
        s
    }
}

/// Services, EndpointSlices and this node, as last seen.
///
/// Objects are shared (`Arc`), so the state of one service can be kept cheaply as it was when
/// it was programmed ([`ClusterState::snapshot`]).
#[derive(Debug, Clone, Default)]
pub struct ClusterState {
    services: BTreeMap<NamespacedName, Arc<ServiceInfo>>,
    /// Slices by service, then by slice name.
    slices: BTreeMap<NamespacedName, BTreeMap<NamespacedName, Arc<EndpointSliceInfo>>>,
    /// Which service each slice was filed under (a slice can be relabelled).
    slice_owner: BTreeMap<NamespacedName, NamespacedName>,
    node: Option<Arc<NodeInfo>>,
    /// ServiceCIDRs by name.
    service_cidrs: BTreeMap<String, ServiceCidrInfo>,
    /// How many services have an IPv6 ClusterIP (whether the ip6 table is needed is asked on
    /// every sync; counting 44,000 services each time would cost more than the sync).
    ipv6_services: usize,
}

/// Whether a service has an IPv6 ClusterIP.
fn has_ipv6(service: &ServiceInfo) -> bool {
    service.ports.iter().any(|p| p.cluster_ip(IpFamily::V6).is_some())
}

impl ClusterState {
    /// An empty state.
    pub fn new() -> ClusterState {
        ClusterState::default()
    }

    /// Adds or replaces a service. Returns whether anything changed.
    pub fn upsert_service(&mut self, service: ServiceInfo) -> bool {
        match self.services.get(&service.name) {
            Some(existing) if **existing == service => false,
            _ => {
                self.ipv6_services += usize::from(has_ipv6(&service));
                if let Some(old) = self.services.insert(service.name.clone(), Arc::new(service)) {
                    self.ipv6_services -= usize::from(has_ipv6(&old));
                }
                true
            }
        }
    }

    /// Removes a service. Returns whether it was there.
    pub fn remove_service(&mut self, name: &NamespacedName) -> bool {
        let Some(old) = self.services.remove(name) else { return false };
        self.ipv6_services -= usize::from(has_ipv6(&old));
        true
    }

    /// Whether any service has an IPv6 ClusterIP.
    pub fn has_ipv6_services(&self) -> bool {
        self.ipv6_services > 0
    }

    /// Adds or replaces an EndpointSlice. Returns the services whose endpoints changed.
    pub fn upsert_slice(&mut self, slice: EndpointSliceInfo) -> Vec<NamespacedName> {
        let mut changed = Vec::new();
        if let Some(previous) = self.slice_owner.get(&slice.name).cloned() {
            if previous != slice.service {
                self.remove_slice(&slice.name);
                changed.push(previous);
            } else if self.slices.get(&previous).and_then(|m| m.get(&slice.name)).map(|s| &**s) == Some(&slice) {
                return changed;
            }
        }
        self.slice_owner.insert(slice.name.clone(), slice.service.clone());
        changed.push(slice.service.clone());
        self.slices.entry(slice.service.clone()).or_default().insert(slice.name.clone(), Arc::new(slice));
        changed
    }

    /// Removes an EndpointSlice. Returns the service it belonged to.
    pub fn remove_slice(&mut self, name: &NamespacedName) -> Option<NamespacedName> {
        let service = self.slice_owner.remove(name)?;
        if let Some(m) = self.slices.get_mut(&service) {
            m.remove(name);
            if m.is_empty() {
                self.slices.remove(&service);
            }
        }
        Some(service)
    }

    /// Replaces every service with `list` (a later entry of a name replaces an earlier one).
    /// Returns the services that changed: added, removed or different.
    pub fn replace_services(&mut self, list: Vec<ServiceInfo>) -> Vec<NamespacedName> {
        let mut new: BTreeMap<NamespacedName, Arc<ServiceInfo>> = BTreeMap::new();
        for info in list {
            // An unchanged service keeps its shared copy (programmed snapshots point at it).
            let shared = match self.services.get(&info.name) {
                Some(old) if **old == info => old.clone(),
                _ => Arc::new(info),
            };
            new.insert(shared.name.clone(), shared);
        }
        let changed = self.services.keys().chain(new.keys()).filter(|n| self.services.get(*n) != new.get(*n)).cloned();
        let changed: BTreeSet<NamespacedName> = changed.collect();
        self.ipv6_services = new.values().filter(|s| has_ipv6(s)).count();
        self.services = new;
        changed.into_iter().collect()
    }

    /// Replaces every EndpointSlice with `list`. Returns the services whose slices changed.
    pub fn replace_slices(&mut self, list: Vec<EndpointSliceInfo>) -> Vec<NamespacedName> {
        let mut fresh = ClusterState::default();
        for slice in list {
            let unchanged =
                self.slices.get(&slice.service).and_then(|m| m.get(&slice.name)).filter(|old| ***old == slice);
            match unchanged {
                Some(old) => {
                    let old = old.clone();
                    fresh.slice_owner.insert(old.name.clone(), old.service.clone());
                    fresh.slices.entry(old.service.clone()).or_default().insert(old.name.clone(), old);
                }
                None => {
                    fresh.upsert_slice(slice);
                }
            }
        }
        let changed: BTreeSet<NamespacedName> = self
            .slices
            .keys()
            .chain(fresh.slices.keys())
            .filter(|n| self.slices.get(*n) != fresh.slices.get(*n))
            .cloned()
            .collect();
        self.slices = fresh.slices;
        self.slice_owner = fresh.slice_owner;
        changed.into_iter().collect()
    }

    /// Sets (or clears) this node's Node. Returns whether it changed.
    pub fn set_node(&mut self, node: Option<NodeInfo>) -> bool {
        if self.node.as_deref() == node.as_ref() {
            return false;
        }
        self.node = node.map(Arc::new);
        true
    }

    /// This node, if its Node object is known.
    pub fn node(&self) -> Option<&NodeInfo> {
        self.node.as_deref()
    }

    /// Adds or replaces a ServiceCIDR. Returns whether the ranges changed.
    pub fn upsert_service_cidr(&mut self, cidr: ServiceCidrInfo) -> bool {
        let before = self.all_service_cidrs();
        self.service_cidrs.insert(cidr.name.clone(), cidr);
        before != self.all_service_cidrs()
    }

    /// Removes a ServiceCIDR. Returns whether the ranges changed.
    pub fn remove_service_cidr(&mut self, name: &str) -> bool {
        let before = self.all_service_cidrs();
        self.service_cidrs.remove(name);
        before != self.all_service_cidrs()
    }

    /// Replaces every ServiceCIDR with `list`. Returns whether the ranges changed.
    pub fn replace_service_cidrs(&mut self, list: Vec<ServiceCidrInfo>) -> bool {
        let before = self.all_service_cidrs();
        self.service_cidrs = list.into_iter().map(|c| (c.name.clone(), c)).collect();
        before != self.all_service_cidrs()
    }

    /// Number of ServiceCIDR objects.
    pub fn service_cidr_count(&self) -> usize {
        self.service_cidrs.len()
    }

    /// The ranges of every ServiceCIDR in one family, merged (objects may overlap, as when a
    /// range is being replaced by a larger one: upstream takes their union too).
    pub fn service_cidrs(&self, family: IpFamily) -> Vec<IpNet> {
        let nets: Vec<IpNet> = self
            .service_cidrs
            .values()
            .flat_map(|c| c.cidrs.iter().copied())
            .filter(|n| IpFamily::of_net(n) == family)
            .collect();
        IpNet::aggregate(&nets)
    }

    fn all_service_cidrs(&self) -> Vec<IpNet> {
        let mut out = self.service_cidrs(IpFamily::V4);
        out.extend(self.service_cidrs(IpFamily::V6));
        out
    }

    /// All services.
    pub fn services(&self) -> impl Iterator<Item = &ServiceInfo> {
        self.services.values().map(|s| &**s)
    }

    /// One service.
    pub fn service(&self, name: &NamespacedName) -> Option<&ServiceInfo> {
        self.services.get(name).map(|s| &**s)
    }

    /// Number of services.
    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    /// Number of EndpointSlices.
    pub fn slice_count(&self) -> usize {
        self.slice_owner.len()
    }

    /// The slices of a service.
    pub fn slices_of(&self, service: &NamespacedName) -> impl Iterator<Item = &EndpointSliceInfo> {
        self.slices.get(service).into_iter().flat_map(|m| m.values().map(|s| &**s))
    }

    /// The part of the state one service is planned from: the service, its slices and the
    /// node, sharing their objects with `self` (a few pointers, kept per programmed service).
    pub fn snapshot(&self, service: &NamespacedName) -> ServiceSnapshot {
        ServiceSnapshot {
            name: service.clone(),
            service: self.services.get(service).cloned(),
            slices: self.slices.get(service).map(|m| m.values().cloned().collect()).unwrap_or_default(),
            node: self.node.clone(),
        }
    }

    /// Services whose ports or endpoints differ between `self` and `other` (present in either).
    pub fn changed_services(&self, other: &ClusterState) -> std::collections::BTreeSet<NamespacedName> {
        let (services, endpoints) = self.changes(other);
        services.union(&endpoints).cloned().collect()
    }

    /// Services whose Service (first) and whose EndpointSlices (second) differ from `other`.
    pub fn changes(&self, other: &ClusterState) -> (BTreeSet<NamespacedName>, BTreeSet<NamespacedName>) {
        let services = self
            .services
            .keys()
            .chain(other.services.keys())
            .filter(|n| self.services.get(*n) != other.services.get(*n))
            .cloned()
            .collect();
        let endpoints = self
            .slices
            .keys()
            .chain(other.slices.keys())
            .filter(|n| self.slices.get(*n) != other.slices.get(*n))
            .cloned()
            .collect();
        (services, endpoints)
    }

    /// The endpoints of a service port in one family: every slice of the service that has a
    /// port with this name and protocol contributes its addresses with that port's number.
    /// Duplicates (the same ip:port in several slices) merge, preferring the most usable copy.
    pub fn endpoints(&self, spn: &ServicePortName, family: IpFamily) -> Vec<Endpoint> {
        let mut merged: BTreeMap<(IpAddr, u16), Endpoint> = BTreeMap::new();
        for slice in self.slices_of(&spn.service).filter(|s| s.family == family) {
            for (_, _, port) in slice.ports.iter().filter(|(n, p, _)| *n == spn.port && *p == spn.protocol) {
                for ep in &slice.endpoints {
                    let candidate = Endpoint {
                        ip: ep.ip,
                        port: *port,
                        ready: ep.ready,
                        serving: ep.serving,
                        terminating: ep.terminating,
                        node_name: ep.node_name.clone(),
                        zone: ep.zone.clone(),
                        zone_hints: ep.zone_hints.clone(),
                        node_hints: ep.node_hints.clone(),
                    };
                    let rank = |e: &Endpoint| (e.ready, e.serving, !e.terminating);
                    match merged.get(&(ep.ip, *port)) {
                        Some(existing) if rank(existing) >= rank(&candidate) => {}
                        _ => {
                            merged.insert((ep.ip, *port), candidate);
                        }
                    }
                }
            }
        }
        merged.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(name: &str, service: &str, ready: bool, ips: &[&str]) -> EndpointSliceInfo {
        EndpointSliceInfo {
            name: NamespacedName::new("ns", name),
            service: NamespacedName::new("ns", service),
            family: IpFamily::V4,
            ports: vec![("http".into(), L4Proto::Tcp, 8080)],
            endpoints: ips
                .iter()
                .map(|ip| SliceEndpoint { ready, serving: ready, ..SliceEndpoint::ready(ip.parse().unwrap()) })
                .collect(),
            trigger_time: None,
        }
    }

    fn spn(service: &str) -> ServicePortName {
        ServicePortName { service: NamespacedName::new("ns", service), port: "http".into(), protocol: L4Proto::Tcp }
    }

    #[test]
    fn slices_merge_and_prefer_ready_duplicates() {
        let mut state = ClusterState::new();
        state.upsert_slice(slice("a", "web", false, &["10.0.0.1", "10.0.0.2"]));
        state.upsert_slice(slice("b", "web", true, &["10.0.0.2", "10.0.0.3"]));
        let eps = state.endpoints(&spn("web"), IpFamily::V4);
        let summary: Vec<(String, bool)> = eps.iter().map(|e| (e.address(), e.ready)).collect();
        assert_eq!(
            summary,
            vec![("10.0.0.1:8080".into(), false), ("10.0.0.2:8080".into(), true), ("10.0.0.3:8080".into(), true)]
        );
        assert!(state.endpoints(&spn("other"), IpFamily::V4).is_empty());
        assert!(state.endpoints(&spn("web"), IpFamily::V6).is_empty());
    }

    #[test]
    fn relabelled_slice_moves_between_services() {
        let mut state = ClusterState::new();
        state.upsert_slice(slice("a", "web", true, &["10.0.0.1"]));
        let changed = state.upsert_slice(slice("a", "api", true, &["10.0.0.1"]));
        assert_eq!(changed, vec![NamespacedName::new("ns", "web"), NamespacedName::new("ns", "api")]);
        assert!(state.endpoints(&spn("web"), IpFamily::V4).is_empty());
        assert_eq!(state.endpoints(&spn("api"), IpFamily::V4).len(), 1);
        assert!(state.upsert_slice(slice("a", "api", true, &["10.0.0.1"])).is_empty(), "no-op update");
        assert_eq!(state.remove_slice(&NamespacedName::new("ns", "a")), Some(NamespacedName::new("ns", "api")));
        assert_eq!(state.slice_count(), 0);
    }

    #[test]
    fn service_port_names_print_like_upstream() {
        assert_eq!(spn("web").to_string(), "ns/web:http");
        let unnamed = ServicePortName { port: String::new(), ..spn("web") };
        assert_eq!(unnamed.to_string(), "ns/web");
    }
}
