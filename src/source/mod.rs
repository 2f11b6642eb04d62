//! Where Kubernetes objects come from. Every source emits the same [`Event`]s, which the
//! reconciler folds into its [`ClusterState`].

pub mod kube;
pub mod manifests;
pub mod watch;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

/// Something a source observed.
#[derive(Debug, Clone)]
pub enum Event {
    /// A complete set of objects that replaces everything seen before (manifests).
    Snapshot(Box<Snapshot>),
    /// A complete list of one kind that replaces every object of that kind (a watch's first
    /// list, or a relist).
    ServicesListed(Vec<Service>),
    SlicesListed(Vec<EndpointSlice>),
    NodesListed(Vec<Node>),
    ServiceApplied(Box<Service>),
    ServiceDeleted(NamespacedName),
    SliceApplied(Box<EndpointSlice>),
    SliceDeleted(NamespacedName),
    /// This node's Node object.
    NodeApplied(Box<Node>),
    NodeDeleted,
    /// The first complete list of a kind has been delivered.
    Synced(Kind),
}

/// Object kinds a source lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Services,
    EndpointSlices,
    Nodes,
}

/// Everything a source knows at one moment.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
    /// Problems found while reading (already logged by the source).
    pub problems: usize,
}

use crate::model::{ClusterState, NamespacedName, Problem, convert};
use manifests::Manifests;

/// Builds the cluster state from loaded manifests. Objects that cannot be used are reported;
/// a later definition of the same object replaces an earlier one (with a warning problem).
pub fn state_from_manifests(m: &Manifests, hostname: &str) -> (ClusterState, Vec<Problem>) {
    state_from_objects(&m.services, &m.slices, &m.nodes, hostname)
}

/// Builds the cluster state from a snapshot.
pub fn state_from_snapshot(s: &Snapshot, hostname: &str) -> (ClusterState, Vec<Problem>) {
    state_from_objects(&s.services, &s.slices, &s.nodes, hostname)
}

fn state_from_objects(
    services: &[Service],
    slices: &[EndpointSlice],
    nodes: &[Node],
    hostname: &str,
) -> (ClusterState, Vec<Problem>) {
    let mut state = ClusterState::new();
    let mut problems = Vec::new();
    let mut seen_services = std::collections::BTreeSet::new();
    for svc in services {
        let c = convert::service(svc);
        problems.extend(c.problems);
        if let Some(info) = c.value {
            if !seen_services.insert(info.name.clone()) {
                problems.push(duplicate("Service", &info.name));
            }
            state.upsert_service(info);
        }
    }
    for slice in slices {
        let c = convert::endpoint_slice(slice);
        problems.extend(c.problems);
        if let Some(info) = c.value {
            state.upsert_slice(info);
        }
    }
    for node in nodes {
        if node.metadata.name.as_deref() != Some(hostname) {
            continue;
        }
        let c = convert::node(node);
        problems.extend(c.problems);
        if let Some(info) = c.value {
            state.set_node(Some(info));
        }
    }
    (state, problems)
}

fn duplicate(kind: &'static str, name: &NamespacedName) -> Problem {
    Problem {
        object: crate::model::ObjectRef { kind, namespace: Some(name.namespace.clone()), name: name.name.clone() },
        field: String::new(),
        reason: "defined more than once; the last definition wins".into(),
        object_skipped: false,
    }
}

#[cfg(test)]
mod tests;
