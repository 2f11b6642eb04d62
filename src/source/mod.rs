//! Where Kubernetes objects come from. Every source ends in the same [`ClusterState`].

pub mod manifests;

use crate::model::{ClusterState, NamespacedName, Problem, convert};
use manifests::Manifests;

/// Builds the cluster state from loaded manifests. Objects that cannot be used are reported;
/// a later definition of the same object replaces an earlier one (with a warning problem).
pub fn state_from_manifests(m: &Manifests, hostname: &str) -> (ClusterState, Vec<Problem>) {
    let mut state = ClusterState::new();
    let mut problems = Vec::new();
    let mut seen_services = std::collections::BTreeSet::new();
    for svc in &m.services {
        let c = convert::service(svc);
        problems.extend(c.problems);
        if let Some(info) = c.value {
            if !seen_services.insert(info.name.clone()) {
                problems.push(duplicate("Service", &info.name));
            }
            state.upsert_service(info);
        }
    }
    for slice in &m.slices {
        let c = convert::endpoint_slice(slice);
        problems.extend(c.problems);
        if let Some(info) = c.value {
            state.upsert_slice(info);
        }
    }
    for node in &m.nodes {
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
