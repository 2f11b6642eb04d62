//! The latest problems of each object the sources reported (objects left out, fields ignored),
//! kept for `/debug/services`: bounded, and forgotten when the object comes back without them.
//!
//! Sources send an object's problems just before the update they belong to: an `Apply` or
//! `Delete` of that object, or a `Reset` of its whole kind (a list). So an update that names an
//! object without problems just reported for it means the object is fine (or gone) now.

use std::collections::{BTreeMap, HashSet};
use std::time::SystemTime;

use crate::index::{Change, Update};
use crate::model::{ObjectKind, ObjectRef, Problem};

/// Objects kept at most; the oldest reported go first.
pub(crate) const MAX_OBJECTS: usize = 1000;
/// Problems kept per object at most.
const MAX_PER_OBJECT: usize = 16;

/// One object's latest problems.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reported {
    pub(crate) problems: Vec<Problem>,
    pub(crate) at: SystemTime,
    /// Report order (for eviction and listing, newest last).
    order: u64,
}

/// The latest problems per object.
#[derive(Debug, Default)]
pub(crate) struct ProblemLog {
    entries: BTreeMap<ObjectRef, Reported>,
    /// Objects reported and not yet named by an update.
    unmatched: HashSet<ObjectRef>,
    next: u64,
}

impl ProblemLog {
    /// Records a source's problems: each object's replace what it had.
    pub(crate) fn reported(&mut self, problems: &[Problem], at: SystemTime) {
        let mut by_object: BTreeMap<&ObjectRef, Vec<Problem>> = BTreeMap::new();
        for p in problems {
            let list = by_object.entry(&p.object).or_default();
            if list.len() < MAX_PER_OBJECT {
                list.push(p.clone());
            }
        }
        for (object, problems) in by_object {
            self.next += 1;
            self.entries.insert(object.clone(), Reported { problems, at, order: self.next });
            self.unmatched.insert(object.clone());
        }
        while self.entries.len() > MAX_OBJECTS {
            let Some(oldest) = self.entries.iter().min_by_key(|(_, r)| r.order).map(|(o, _)| o.clone()) else { break };
            self.entries.remove(&oldest);
            self.unmatched.remove(&oldest);
        }
    }

    /// An update a source sent: objects it names without problems just reported are fine now.
    pub(crate) fn updated(&mut self, update: &Update) {
        let named = match update {
            Update::Service(c) => Named::of(ObjectKind::Service, c, |s| (&s.name.namespace, &s.name.name)),
            Update::EndpointSlice(c) => Named::of(ObjectKind::EndpointSlice, c, |s| (&s.name.namespace, &s.name.name)),
            Update::Node(c) => Named::of(ObjectKind::Node, c, |n| ("", &n.name)),
            Update::ServiceCidr(c) => Named::of(ObjectKind::ServiceCidr, c, |n| ("", &n.name)),
        };
        match named {
            Named::Objects(objects) => {
                for object in objects {
                    if !self.unmatched.remove(&object) {
                        self.entries.remove(&object);
                    }
                }
            }
            // A complete list: every object of the kind without fresh problems is fine.
            Named::Every(kind) => {
                let unmatched = &self.unmatched;
                self.entries.retain(|o, _| o.kind != kind || unmatched.contains(o));
                self.unmatched.retain(|o| o.kind != kind);
            }
        }
    }

    /// The objects left out (skipped whole) now, by kind.
    pub(crate) fn skipped_by_kind(&self) -> BTreeMap<ObjectKind, usize> {
        let mut counts = BTreeMap::new();
        for (object, reported) in &self.entries {
            if reported.problems.iter().any(|p| p.object_skipped) {
                *counts.entry(object.kind).or_insert(0) += 1;
            }
        }
        counts
    }

    /// Every object's problems, newest report first.
    pub(crate) fn latest(&self) -> Vec<(&ObjectRef, &Reported)> {
        let mut all: Vec<_> = self.entries.iter().collect();
        all.sort_by_key(|(_, r)| std::cmp::Reverse(r.order));
        all
    }
}

/// What an update names: objects, or every object of a kind (a complete list).
enum Named {
    Objects(Vec<ObjectRef>),
    Every(ObjectKind),
}

impl Named {
    fn of<T>(kind: ObjectKind, change: &Change<T>, name: impl Fn(&T) -> (&str, &str)) -> Named {
        // Nodes have no namespace (a deleted Node arrives with an empty one).
        let object = |namespace: &str, name: &str| ObjectRef {
            kind,
            namespace: (kind != ObjectKind::Node).then(|| namespace.to_string()),
            name: name.to_string(),
        };
        match change {
            Change::Apply(value) => {
                let (namespace, name) = name(value);
                Named::Objects(vec![object(namespace, name)])
            }
            Change::Delete(n) => Named::Objects(vec![object(&n.namespace, &n.name)]),
            Change::Reset(_) => Named::Every(kind),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NamespacedName, ServiceInfo};

    fn problem(kind: ObjectKind, name: &str, field: &str) -> Problem {
        let namespace = (kind != ObjectKind::Node).then(|| "default".to_string());
        Problem {
            object: ObjectRef { kind, namespace, name: name.into() },
            field: field.into(),
            reason: "bad".into(),
            object_skipped: false,
        }
    }

    fn service(name: &str) -> Update {
        Update::Service(Change::Apply(ServiceInfo { name: NamespacedName::new("default", name), ports: vec![] }))
    }

    fn fields(log: &ProblemLog) -> Vec<String> {
        log.latest()
            .iter()
            .flat_map(|(_, r)| r.problems.iter().map(|p| format!("{}:{}", p.object.name, p.field)))
            .collect()
    }

    #[test]
    fn an_object_updated_without_problems_is_forgotten() {
        let mut log = ProblemLog::default();
        let now = SystemTime::now();
        log.reported(&[problem(ObjectKind::Service, "a", "spec.ports[0]")], now);
        log.updated(&service("a"));
        assert_eq!(fields(&log), vec!["a:spec.ports[0]"], "the update its problems came with");
        log.updated(&service("b"));
        assert_eq!(fields(&log), vec!["a:spec.ports[0]"], "another object's update");
        log.updated(&service("a"));
        assert!(fields(&log).is_empty(), "fixed");
        // Problems, then the deletion of the object they made unusable.
        log.reported(&[problem(ObjectKind::Service, "c", "")], now);
        log.updated(&Update::Service(Change::Delete(NamespacedName::new("default", "c"))));
        assert_eq!(fields(&log), vec!["c:"]);
        log.updated(&Update::Service(Change::Delete(NamespacedName::new("default", "c"))));
        assert!(fields(&log).is_empty(), "deleted");
    }

    #[test]
    fn a_list_keeps_only_what_it_reported_for_its_kind() {
        let mut log = ProblemLog::default();
        let now = SystemTime::now();
        log.reported(&[problem(ObjectKind::Service, "old", "x"), problem(ObjectKind::EndpointSlice, "s", "y")], now);
        log.updated(&Update::Service(Change::Apply(ServiceInfo {
            name: NamespacedName::new("default", "old"),
            ports: vec![],
        })));
        // A manifests reload: all problems, then every kind's list.
        log.reported(&[problem(ObjectKind::Service, "new", "z"), problem(ObjectKind::Node, "node1", "w")], now);
        log.updated(&Update::Service(Change::Reset(vec![])));
        assert_eq!(fields(&log), vec!["node1:w", "new:z", "s:y"]);
        // The slice's problems were reported for the list that follows.
        log.updated(&Update::EndpointSlice(Change::Reset(vec![])));
        log.updated(&Update::Node(Change::Reset(vec![])));
        assert_eq!(fields(&log), vec!["node1:w", "new:z", "s:y"]);
        // The next lists come without problems.
        log.reported(&[], now);
        for update in [
            Update::Service(Change::Reset(vec![])),
            Update::EndpointSlice(Change::Reset(vec![])),
            Update::Node(Change::Reset(vec![])),
        ] {
            log.updated(&update);
        }
        assert!(fields(&log).is_empty());
    }

    #[test]
    fn the_log_is_bounded() {
        let mut log = ProblemLog::default();
        let now = SystemTime::now();
        for i in 0..MAX_OBJECTS + 10 {
            let p: Vec<Problem> =
                (0..20).map(|f| problem(ObjectKind::Service, &format!("s{i}"), &format!("f{f}"))).collect();
            log.reported(&p, now);
        }
        let latest = log.latest();
        assert_eq!(latest.len(), MAX_OBJECTS);
        assert_eq!(latest[0].0.name, format!("s{}", MAX_OBJECTS + 9), "newest first");
        assert!(latest.iter().all(|(_, r)| r.problems.len() == MAX_PER_OBJECT));
        assert!(!latest.iter().any(|(o, _)| o.name == "s0"), "the oldest went first");
    }
}
