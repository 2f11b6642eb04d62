//! The full sync, streamed into the batch one service at a time.
//!
//! A full sync diffs the whole planned ruleset with the kernel's tables. Building the desired
//! tables and the transaction first would hold the ruleset twice more than the batch (at
//! 10,000 services × 10 endpoints, ~55 MB of kernel objects and operations beside a 22 MB
//! batch); instead each service is planned, diffed with the kernel's objects of the same names
//! and written into the batch, and then dropped. The kernel's read-back is consumed as planned
//! objects claim its chains, sets and elements: what is left at the end is stale.
//!
//! Order inside the one transaction:
//! 1. per family, the table (deleted and created again inside the transaction when something
//!    that cannot change in place did) and the infrastructure: base chains, shared sets and
//!    their own elements;
//! 2. per service, in name order, [`diff_table`] of its objects against the kernel's objects of
//!    the same names: new chains, changed elements, flushed chains, new sets, elements, rules.
//!    Elements of shared sets are collected per set and sent a few hundred per operation, each
//!    set's deletions before its additions;
//! 3. the stale rest: its elements in kept shared sets are deleted (releasing the chains they
//!    point at), then its chains flushed, its sets and chains deleted; tables of families no
//!    longer planned are deleted.

use std::collections::{BTreeMap, HashSet};
use std::ops::ControlFlow;

use crate::nft::ast::Owner;
use crate::nft::diff::{Op, OpKind, OpSink, create_table, diff_table, needs_rebuild};
use crate::nft::wire::{WireElement, WireKey, WireRuleset, WireSet, WireTable};
use crate::plan::slots::MapKind;

/// Shared-set elements go out in operations of about this many (a few messages each).
const SHARED_ELEMENTS_PER_OP: usize = 256;

/// A full sync in progress: the kernel's objects not claimed yet, per planned family.
pub struct FullStream {
    families: Vec<FamilyStream>,
    /// Kernel tables of families no longer planned.
    stale_tables: Vec<WireTable>,
    pending: Pending,
    /// Endpoint maps added right after the infrastructure.
    up_front: Vec<(usize, WireSet)>,
    /// Why the stream stopped: something cannot change in place (a regular chain's comment, an
    /// endpoint map's type), so the sync starts over rebuilding the tables.
    pub rebuild_reason: Option<String>,
}

/// Element operations of shared sets waiting to be sent, per (family index, set).
type Pending = BTreeMap<(usize, String), PendingElements>;

#[derive(Default)]
struct PendingElements {
    op: Option<(crate::net::IpFamily, String, Owner)>,
    dels: Vec<(WireKey, Owner)>,
    adds: Vec<(WireKey, WireElement)>,
}

struct FamilyStream {
    /// The table's family and name.
    table: (crate::net::IpFamily, String),
    /// The desired infrastructure, until it is written.
    infrastructure: Option<WireTable>,
    infrastructure_sets: HashSet<String>,
    /// The kernel's table minus what planned objects claimed so far; `None` when the kernel
    /// has none (or it is rebuilt in this transaction).
    have: Option<WireTable>,
    /// Whether the kernel's table is deleted at the start of the transaction.
    rebuilt: bool,
    /// Endpoint maps that exist by now (read back, or added in this transaction).
    shards_present: HashSet<String>,
    /// Endpoint maps the planned services use.
    shards_used: HashSet<String>,
}

impl FullStream {
    /// A full sync from `kernel` (what the read-back found) to the planned `infrastructure`
    /// (one table per family, table flags set) and the services written after it. `rebuild`
    /// deletes and re-creates the tables inside the transaction.
    pub fn new(kernel: WireRuleset, infrastructure: Vec<WireTable>, rebuild: bool) -> FullStream {
        let mut kernel_tables = kernel.tables;
        let families = infrastructure
            .into_iter()
            .map(|want| {
                let at = kernel_tables.iter().position(|t| t.family == want.family && t.name == want.name);
                let have = at.map(|i| kernel_tables.swap_remove(i));
                let rebuilt = have.as_ref().is_some_and(|h| rebuild || must_rebuild(h, &want));
                let have = have.filter(|_| !rebuilt);
                let shards_present =
                    have.iter().flat_map(|h| h.sets.keys()).filter(|n| MapKind::parse(n).is_some()).cloned().collect();
                FamilyStream {
                    table: (want.family, want.name.clone()),
                    infrastructure_sets: want.sets.keys().cloned().collect(),
                    infrastructure: Some(want),
                    have,
                    rebuilt,
                    shards_present,
                    shards_used: HashSet::new(),
                }
            })
            .collect();
        FullStream {
            families,
            stale_tables: kernel_tables,
            pending: Pending::new(),
            up_front: Vec::new(),
            rebuild_reason: None,
        }
    }

    /// Whether a table is created (a cold start, or a rebuild): see [`FullStream::add_up_front`].
    pub fn creates_tables(&self) -> bool {
        self.families.iter().any(|f| f.have.is_none())
    }

    /// Endpoint maps to add with the infrastructure, (family index, empty map), rather than
    /// when the first service using each is written. The kernel keeps a table's sets in a
    /// list in the order they were added and finds a set by walking it, for every rule and
    /// element message naming one: maps added early are found at once, maps added after
    /// thousands of services' own sets cost a walk over all of them, every time (measured at
    /// 10,000 services: a fifth of a cold sync's kernel time went to that walk).
    pub fn add_up_front(&mut self, maps: Vec<(usize, WireSet)>) {
        self.up_front.extend(maps);
    }

    /// Writes the tables and the infrastructure.
    pub fn begin(&mut self, sink: &mut dyn OpSink) {
        for (fi, fs) in self.families.iter_mut().enumerate() {
            let Some(want) = fs.infrastructure.take() else { continue };
            let mut out =
                Buffered { sink: &mut *sink, pending: &mut self.pending, fi, shared: &fs.infrastructure_sets };
            if fs.rebuilt {
                out.push(table_op(&want, OpKind::DeleteTable));
            }
            match fs.have.as_mut() {
                None => create_table(want, &mut out),
                Some(have) => {
                    let mut claimed = have.empty_like();
                    for name in want.chains.keys() {
                        if let Some(chain) = have.chains.swap_remove(name) {
                            claimed.chains.insert(name.clone(), chain);
                        }
                    }
                    for set in want.sets.values() {
                        if let Some(from) = have.sets.get_mut(&set.name) {
                            claimed.sets.insert(set.name.clone(), take_keys(from, set));
                        }
                    }
                    diff_table(&claimed, want, &mut out);
                }
            }
        }
        for (fi, map) in std::mem::take(&mut self.up_front) {
            let Some(fs) = self.families.get_mut(fi) else { continue };
            if fs.shards_present.insert(map.name.clone()) {
                let kind = OpKind::AddSet { set: map.name.clone(), spec: map.spec };
                sink.push(Op { family: fs.table.0, table: fs.table.1.clone(), kind, owner: map.owner });
            }
        }
    }

    /// Writes one service's objects (one partial table per family, in the order of the
    /// infrastructure; shared keys another claimant holds already removed). Breaks when an
    /// object cannot change in place ([`FullStream::rebuild_reason`]).
    pub fn service(&mut self, sink: &mut dyn OpSink, fragments: Vec<WireTable>) -> ControlFlow<()> {
        for (fi, want) in fragments.into_iter().enumerate() {
            let Some(fs) = self.families.get_mut(fi) else { continue };
            let mut claimed = want.empty_like();
            for (name, chain) in &want.chains {
                let Some(have) = fs.have.as_mut().and_then(|h| h.chains.swap_remove(name)) else { continue };
                if !have.same_spec(chain) {
                    self.rebuild_reason = Some(format!("chain {name} changed its hook or comment"));
                    return ControlFlow::Break(());
                }
                claimed.chains.insert(name.clone(), have);
            }
            for set in want.sets.values() {
                let name = &set.name;
                let shard = MapKind::parse(name).is_some();
                if shard {
                    fs.shards_used.insert(name.clone());
                }
                if shard || fs.infrastructure_sets.contains(name) {
                    let from = fs.have.as_mut().and_then(|h| h.sets.get_mut(name));
                    match from {
                        Some(from) if from.spec != set.spec => {
                            self.rebuild_reason = Some(format!("set {name} changed its type or flags"));
                            return ControlFlow::Break(());
                        }
                        Some(from) => {
                            claimed.sets.insert(name.clone(), take_keys(from, set));
                        }
                        // Written with the infrastructure, or an endpoint map an earlier service
                        // added in this transaction: only elements now.
                        None if fs.infrastructure_sets.contains(name) || fs.shards_present.contains(name) => {
                            claimed.sets.insert(name.clone(), set.empty_like());
                        }
                        None => {
                            fs.shards_present.insert(name.clone());
                        }
                    }
                } else if let Some(own) = fs.have.as_mut().and_then(|h| h.sets.swap_remove(name)) {
                    claimed.sets.insert(name.clone(), own);
                }
            }
            let mut out =
                Buffered { sink: &mut *sink, pending: &mut self.pending, fi, shared: &fs.infrastructure_sets };
            diff_table(&claimed, want, &mut out);
        }
        ControlFlow::Continue(())
    }

    /// Writes what is left: the stale objects' removal.
    pub fn finish(&mut self, sink: &mut dyn OpSink) {
        for (fi, fs) in self.families.iter_mut().enumerate() {
            let Some(have) = fs.have.as_mut() else { continue };
            let mut out =
                Buffered { sink: &mut *sink, pending: &mut self.pending, fi, shared: &fs.infrastructure_sets };
            for set in have.sets.values_mut() {
                let kept = fs.infrastructure_sets.contains(&set.name) || fs.shards_used.contains(&set.name);
                if !kept || set.dynamic || set.elements.is_empty() {
                    continue;
                }
                let keys = std::mem::take(&mut set.elements).into_iter().map(|(k, e)| (k, e.owner)).collect();
                out.push(Op {
                    family: have.family,
                    table: have.name.clone(),
                    kind: OpKind::DeleteElements { set: set.name.clone(), keys },
                    owner: set.owner.clone(),
                });
            }
        }
        // Element changes before chains go: deleted elements release the chains they name.
        flush_all(&mut self.pending, sink);
        for fs in &mut self.families {
            let Some(have) = fs.have.take() else { continue };
            let chains: Vec<_> = have.chains.values().map(|c| (c.name.clone(), c.owner.clone())).collect();
            for (chain, owner) in &chains {
                sink.push(object_op(&have, OpKind::FlushChain { chain: chain.clone() }, owner.clone()));
            }
            for set in have.sets.values() {
                if !fs.infrastructure_sets.contains(&set.name) && !fs.shards_used.contains(&set.name) {
                    sink.push(object_op(&have, OpKind::DeleteSet { set: set.name.clone() }, set.owner.clone()));
                }
            }
            for (chain, owner) in chains {
                sink.push(object_op(&have, OpKind::DeleteChain { chain }, owner));
            }
        }
        for table in std::mem::take(&mut self.stale_tables) {
            sink.push(table_op(&table, OpKind::DeleteTable));
        }
    }
}

/// Whether the kernel's table must be deleted and created again: what [`needs_rebuild`] says,
/// or an infrastructure set whose type changed (its elements come from every service).
fn must_rebuild(have: &WireTable, want: &WireTable) -> bool {
    needs_rebuild(have, want) || want.sets.values().any(|s| have.sets.get(&s.name).is_some_and(|h| h.spec != s.spec))
}

/// Moves out of the kernel's `from` the elements `want` decides on: its keys for plain sets,
/// for an endpoint map the whole numgen window of each of its keys (a service port's window is
/// diffed as a group, and nothing else may be left inside it).
fn take_keys(from: &mut WireSet, want: &WireSet) -> WireSet {
    let mut out = from.empty_like();
    if from.dynamic {
        return out;
    }
    if want.spec.is_numgen_interval_map() {
        let windows: HashSet<u32> = want.elements.keys().filter_map(WireKey::numgen_window).collect();
        for window in windows {
            let start = WireKey::new(&(window << crate::nft::wire::NUMGEN_WINDOW_BITS).to_be_bytes());
            let keys: Vec<WireKey> = from
                .elements
                .range(start..)
                .map(|(k, _)| k)
                .take_while(|k| k.numgen_window() == Some(window))
                .cloned()
                .collect();
            for key in keys {
                if let Some(e) = from.elements.remove(&key) {
                    out.elements.insert(key, e);
                }
            }
        }
    } else {
        for key in want.elements.keys() {
            if let Some(e) = from.elements.remove(key) {
                out.elements.insert(key.clone(), e);
            }
        }
    }
    out
}

/// Passes operations on, holding back element operations of shared sets to send them in
/// larger operations (one per service would mean tens of thousands of small messages, each a
/// lookup of its set by name in the kernel).
struct Buffered<'a> {
    sink: &'a mut dyn OpSink,
    pending: &'a mut Pending,
    fi: usize,
    shared: &'a HashSet<String>,
}

impl OpSink for Buffered<'_> {
    fn push(&mut self, op: Op) {
        let set = match &op.kind {
            OpKind::AddElements { set, .. }
            | OpKind::DeleteElements { set, .. }
            | OpKind::AddSet { set, .. }
            | OpKind::DeleteSet { set } => set,
            _ => {
                self.sink.push(op);
                return;
            }
        };
        if MapKind::parse(set).is_none() && !self.shared.contains(set) {
            self.sink.push(op);
            return;
        }
        let key = (self.fi, set.clone());
        let Op { family, table, kind, owner } = op;
        let (set, dels, adds) = match kind {
            OpKind::AddElements { set, elements } => (set, Vec::new(), elements),
            OpKind::DeleteElements { set, keys } => (set, keys, Vec::new()),
            // A set is added or deleted: what waits for it goes first (nothing, for a new one).
            kind => {
                if let Some(pending) = self.pending.get_mut(&key) {
                    flush(&key.1, pending, self.sink);
                }
                self.sink.push(Op { family, table, kind, owner });
                return;
            }
        };
        let pending = self.pending.entry(key).or_default();
        pending.op.get_or_insert((family, table, owner));
        pending.dels.extend(dels);
        pending.adds.extend(adds);
        if pending.adds.len() + pending.dels.len() >= SHARED_ELEMENTS_PER_OP {
            flush(&set, pending, self.sink);
        }
    }
}

fn flush(set: &str, pending: &mut PendingElements, sink: &mut dyn OpSink) {
    let Some((family, table, owner)) = pending.op.clone() else { return };
    if !pending.dels.is_empty() {
        let keys = std::mem::take(&mut pending.dels);
        let kind = OpKind::DeleteElements { set: set.to_string(), keys };
        sink.push(Op { family, table: table.clone(), kind, owner: owner.clone() });
    }
    if !pending.adds.is_empty() {
        let elements = std::mem::take(&mut pending.adds);
        sink.push(Op { family, table, kind: OpKind::AddElements { set: set.to_string(), elements }, owner });
    }
}

fn flush_all(pending: &mut Pending, sink: &mut dyn OpSink) {
    for ((_, set), p) in pending.iter_mut() {
        flush(set, p, sink);
    }
    pending.clear();
}

fn table_op(table: &WireTable, kind: OpKind) -> Op {
    object_op(table, kind, Owner::infrastructure())
}

fn object_op(table: &WireTable, kind: OpKind, owner: Owner) -> Op {
    Op { family: table.family, table: table.name.clone(), kind, owner }
}
