//! Where Kubernetes objects come from: the API server's watches, or manifest files. Every
//! source converts each object into the model's validated values as it arrives
//! (`model::convert`), so neither the index nor the syncer ever holds an API object,
//! and speaks the index's verbs ([`Update`]); problems found while converting go to the agent
//! on their own (log lines, Events, metrics).

pub(crate) mod kube;
pub(crate) mod watch;

use crate::index::{Change, Update};
use crate::model::api::{EndpointSlice, Node, Service, ServiceCidr};
use crate::model::{NamespacedName, NodeInfo, Problem, ServiceCidrInfo, ServiceInfo, convert};
pub use nftproxy_core::manifests::{self, state_from_manifests};

/// What a source sends the agent.
#[derive(Debug, Clone)]
pub(crate) enum SourceEvent {
    /// A change for the index.
    Update(Update),
    /// Objects or fields that cannot be used (already skipped).
    Problems(Vec<Problem>),
}

/// The name of an API object (`default` when the namespace is unset, as the API server does).
fn name_of(meta: &crate::model::api::Meta) -> NamespacedName {
    NamespacedName::new(
        meta.namespace.clone().unwrap_or_else(|| "default".into()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// A Service as an index change: applied when usable, else the deletion of its name (a
/// headless Service, another proxy's, or one that became invalid), with its problems.
pub(crate) fn service_change(svc: &Service) -> (Change<ServiceInfo>, Vec<Problem>) {
    let converted = convert::service(svc);
    let change = match converted.value {
        Some(info) => Change::Apply(info),
        None => Change::Delete(name_of(&svc.metadata)),
    };
    (change, converted.problems)
}

/// An EndpointSlice as an index change.
pub(crate) fn slice_change(slice: &EndpointSlice) -> (Change<crate::model::EndpointSliceInfo>, Vec<Problem>) {
    let converted = convert::endpoint_slice(slice);
    let change = match converted.value {
        Some(info) => Change::Apply(info),
        None => Change::Delete(name_of(&slice.metadata)),
    };
    (change, converted.problems)
}

/// This node's Node as an index change (`None` for another node's).
pub(crate) fn node_change(node: &Node, hostname: &str) -> Option<(Change<NodeInfo>, Vec<Problem>)> {
    if node.metadata.name.as_deref() != Some(hostname) {
        return None;
    }
    let converted = convert::node(node);
    let change = match converted.value {
        Some(info) => Change::Apply(info),
        None => Change::Delete(NamespacedName::new("", hostname)),
    };
    Some((change, converted.problems))
}

/// A ServiceCIDR as an index change (the deletion of its name when it has no usable CIDR).
pub(crate) fn service_cidr_change(cidr: &ServiceCidr) -> (Change<ServiceCidrInfo>, Vec<Problem>) {
    let converted = convert::service_cidr(cidr);
    let change = match converted.value {
        Some(info) => Change::Apply(info),
        None => Change::Delete(NamespacedName::new("", cidr.metadata.name.clone().unwrap_or_default())),
    };
    (change, converted.problems)
}
