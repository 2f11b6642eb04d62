//! The one way a transaction is built: a [`View`] of what the kernel holds, and the planned
//! objects streamed in service by service, each diffed against the kernel's objects of the same
//! names and written straight into the batch.
//!
//! A full sync's view is the whole read-back of nftproxy's tables; a partial sync's is the part
//! the changed services own (their old objects, planned again, and the shared keys they touch:
//! [`super::programmed::Programmed::scope`]). Either way the view is consumed as planned objects
//! claim its chains, sets and elements, and what is left at the end is stale.
//!
//! Order inside the one transaction:
//! 1. (full syncs) per family, the table (deleted and created again inside the transaction when
//!    something that cannot change in place did) and the infrastructure: base chains, shared
//!    sets and their own elements; on a cold start, the endpoint maps right after them;
//! 2. per service, in name order, [`diff_table`] of its objects against the view's objects of the
//!    same names: new chains, changed elements, flushed chains, new sets, elements, rules.
//!    Elements of shared sets are collected per set and sent a few hundred per operation, each
//!    set's deletions before its additions;
//! 3. the stale rest: its elements in kept shared sets are deleted (releasing the chains they
//!    point at); the balancing chains get their rules for the balancing maps that exist now
//!    (only when an endpoint count came into or went out of use); then the stale chains are
//!    flushed, its sets and chains deleted; tables of families no longer planned are deleted.
//!
//! Nothing is held but the view as it shrinks and the operations of one service: the batch
//! writer encodes each operation as it arrives.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::{Bound, ControlFlow};

use crate::net::{FamilyMap, IpFamily};
use crate::nft::ast::Owner;
use crate::nft::diff::{Op, OpKind, OpSink, create_table, diff_table, needs_rebuild};
use crate::nft::lower::{lower_chain, lower_set};
use crate::nft::wire::{NUMGEN_WINDOW_BITS, WireElement, WireKey, WireRule, WireRuleset, WireSet, WireTable};
use crate::plan::{SharedSet, WireFragment, balance_chains};

/// Shared-set elements go out in operations of about this many (a few messages each).
const SHARED_ELEMENTS_PER_OP: usize = 256;

/// What the kernel holds, in the scope of one sync.
#[derive(Debug, Default)]
pub(super) struct View {
    /// nftproxy's table per planned family.
    pub tables: FamilyMap<ViewTable>,
    /// Tables of families no longer planned (deleted).
    pub stale: Vec<WireTable>,
}

/// One of nftproxy's tables as the view holds it: the table's identity with its own chains and
/// per-service sets, and the shared sets by type.
#[derive(Debug)]
pub(super) struct ViewTable {
    pub table: WireTable,
    pub shared: BTreeMap<SharedSet, WireSet>,
}

impl ViewTable {
    /// A table with the identity of `table` and nothing in it.
    pub(super) fn empty_like(table: &WireTable) -> ViewTable {
        ViewTable { table: table.empty_like(), shared: BTreeMap::new() }
    }

    /// A table read back from the kernel, its sets sorted into shared and per-service ones by
    /// name: the one place a kernel set's role is recognised.
    pub(super) fn from_kernel(mut table: WireTable) -> ViewTable {
        let sets = std::mem::take(&mut table.sets);
        let mut shared = BTreeMap::new();
        for (name, set) in sets {
            match SharedSet::from_name(&name) {
                Some(id) => {
                    shared.insert(id, set);
                }
                None => {
                    table.sets.insert(name, set);
                }
            }
        }
        ViewTable { table, shared }
    }

    /// Adds a service's own chains and sets (a partial sync's view of its old version).
    pub(super) fn add_own(&mut self, own: &WireTable) {
        for (name, chain) in &own.chains {
            self.table.chains.insert(name.clone(), chain.clone());
        }
        for (name, set) in &own.sets {
            self.table.sets.insert(name.clone(), set.clone());
        }
    }
}

impl View {
    /// The view of a full sync: the read-back, for the families planned.
    pub(super) fn from_kernel(kernel: WireRuleset, families: &[IpFamily]) -> View {
        let mut view = View::default();
        for table in kernel.tables {
            if families.contains(&table.family) && view.tables.get(table.family).is_none() {
                view.tables.insert(table.family, ViewTable::from_kernel(table));
            } else {
                view.stale.push(table);
            }
        }
        view
    }
}

/// The empty shared set `set` as nftproxy creates it in a family's table.
pub(super) fn empty_shared_set(set: SharedSet, family: IpFamily) -> WireSet {
    lower_set(&set.empty(family))
}

/// Element operations of shared sets waiting to be sent, per (family, set).
type Pending = BTreeMap<(IpFamily, SharedSet), PendingElements>;

#[derive(Default)]
struct PendingElements {
    op: Option<(String, Owner)>,
    dels: Vec<(WireKey, Owner)>,
    adds: Vec<(WireKey, WireElement)>,
}

struct FamilyDelta {
    table: String,
    /// The desired infrastructure, until it is written (full syncs).
    infrastructure: Option<WireTable>,
    /// The view's objects not claimed yet.
    have: ViewTable,
    /// Whether the kernel's table exists and is kept (else it is created, after being deleted
    /// when `rebuilt`).
    exists: bool,
    rebuilt: bool,
    /// Shared sets that exist by now (in the kernel, or added in this transaction).
    present: HashSet<SharedSet>,
    /// Shared sets that exist afterwards.
    kept: HashSet<SharedSet>,
    /// The names of the shared sets present, for telling their operations apart.
    names: HashMap<String, SharedSet>,
    /// The balancing chains' rules as the kernel has them once the infrastructure is written:
    /// [`Delta::finish`] brings them in line with the balancing maps kept.
    balance_rules: Vec<(String, Vec<WireRule>)>,
}

impl FamilyDelta {
    fn mark_present(&mut self, set: SharedSet) {
        if self.present.insert(set) {
            self.names.insert(set.name().into_owned(), set);
        }
    }
}

/// A transaction being built.
pub(super) struct Delta {
    families: FamilyMap<FamilyDelta>,
    stale_tables: Vec<WireTable>,
    pending: Pending,
    /// Endpoint maps added right after the infrastructure.
    up_front: Vec<(IpFamily, SharedSet)>,
    /// Empty copies of the shared sets (their specs), per family.
    templates: HashMap<(IpFamily, SharedSet), WireSet>,
    /// Why the stream stopped: something cannot change in place (a regular chain's comment, an
    /// endpoint map's type), so the sync starts over rebuilding the tables.
    pub rebuild_reason: Option<String>,
}

impl Delta {
    /// A full sync from `view` to `infrastructure` (one table per planned family, table flags
    /// set) and the services written after it. `rebuild` deletes and re-creates the tables
    /// inside the transaction.
    pub(super) fn full(view: View, infrastructure: FamilyMap<WireTable>, rebuild: bool) -> Delta {
        let View { mut tables, stale } = view;
        let mut stale_tables = stale;
        let mut families = FamilyMap::new();
        for (family, want) in infrastructure {
            let have = tables.remove(family);
            let rebuilt = have.as_ref().is_some_and(|h| rebuild || must_rebuild(h, &want));
            let (have, exists) = match have {
                Some(h) if !rebuilt => (h, true),
                _ => (ViewTable::empty_like(&want), false),
            };
            let kept = want.sets.keys().filter_map(|n| SharedSet::from_name(n)).collect();
            let mut fd = FamilyDelta {
                table: want.name.clone(),
                have,
                exists,
                rebuilt,
                present: HashSet::new(),
                kept,
                names: HashMap::new(),
                balance_rules: Vec::new(),
                infrastructure: Some(want),
            };
            let present: Vec<SharedSet> = fd.have.shared.keys().copied().collect();
            for set in present {
                fd.mark_present(set);
            }
            families.insert(family, fd);
        }
        stale_tables.extend(tables.into_iter().map(|(_, t)| t.table));
        Delta {
            families,
            stale_tables,
            pending: Pending::new(),
            up_front: Vec::new(),
            templates: HashMap::new(),
            rebuild_reason: None,
        }
    }

    /// A partial sync from `view` (the changed services' part of the kernel) to the objects
    /// streamed after it; `kept` are the shared sets that exist afterwards.
    pub(super) fn partial(view: View, kept: FamilyMap<BTreeSet<SharedSet>>) -> Delta {
        let mut families = FamilyMap::new();
        for (family, have) in view.tables {
            let kept = kept.get(family).map(|k| k.iter().copied().collect()).unwrap_or_default();
            // The view holds every shared set that exists, so the kernel's balancing rules are
            // the ones for the balancing maps in it.
            let balance_rules = balance_wire_rules(family, have.shared.keys().copied());
            let mut fd = FamilyDelta {
                table: have.table.name.clone(),
                have,
                exists: true,
                rebuilt: false,
                present: HashSet::new(),
                kept,
                names: HashMap::new(),
                balance_rules,
                infrastructure: None,
            };
            let present: Vec<SharedSet> = fd.have.shared.keys().copied().collect();
            for set in present {
                fd.mark_present(set);
            }
            families.insert(family, fd);
        }
        Delta {
            families,
            stale_tables: view.stale,
            pending: Pending::new(),
            up_front: Vec::new(),
            templates: HashMap::new(),
            rebuild_reason: None,
        }
    }

    /// Whether a table is created (a cold start, or a rebuild): see [`Delta::add_up_front`].
    pub(super) fn creates_tables(&self) -> bool {
        self.families.values().any(|f| !f.exists)
    }

    /// Whether `family`'s table is created (a cold start, or a rebuild): its sets start empty.
    pub(super) fn creates_table(&self, family: IpFamily) -> bool {
        self.families.get(family).is_none_or(|f| !f.exists)
    }

    /// Endpoint maps to add with the infrastructure, rather than when the first service using
    /// each is written. The kernel keeps a table's sets in a list in the order they were added
    /// and finds a set by walking it, for every rule and element message naming one: maps added
    /// early are found at once, maps added after thousands of services' own sets cost a walk
    /// over all of them, every time (measured at 10,000 services: a fifth of a cold sync's
    /// kernel time went to that walk).
    pub(super) fn add_up_front(&mut self, maps: impl IntoIterator<Item = (IpFamily, SharedSet)>) {
        self.up_front.extend(maps);
    }

    /// Keeps these shared sets whether or not a service writes into them (the balancing maps
    /// emptied earlier), created with the endpoint maps added up front if the kernel lacks them.
    pub(super) fn keep(&mut self, sets: &[(IpFamily, SharedSet)]) {
        for &(family, set) in sets {
            if let Some(fd) = self.families.get_mut(family) {
                fd.kept.insert(set);
                self.up_front.push((family, set));
            }
        }
    }

    fn template(&mut self, family: IpFamily, set: SharedSet) -> &WireSet {
        self.templates.entry((family, set)).or_insert_with(|| empty_shared_set(set, family))
    }

    /// Writes the tables and the infrastructure (full syncs), and the endpoint maps added up
    /// front.
    pub(super) fn begin(&mut self, sink: &mut dyn OpSink) {
        for (family, fd) in self.families.iter_mut() {
            let Some(want) = fd.infrastructure.take() else { continue };
            for set in want.sets.keys().filter_map(|n| SharedSet::from_name(n)) {
                fd.mark_present(set);
            }
            let mut out = Buffered { sink: &mut *sink, pending: &mut self.pending, family, names: &fd.names };
            if fd.rebuilt {
                out.push(table_op(&want, OpKind::DeleteTable));
            }
            let balance_names = balance_wire_rules(family, []).into_iter().map(|(name, _)| name);
            fd.balance_rules = balance_names
                .filter_map(|name| {
                    let want = want.chains.get(&name)?;
                    let kernel = fd.exists.then(|| fd.have.table.chains.get(&name)).flatten();
                    Some((name, kernel.unwrap_or(want).rules.clone()))
                })
                .collect();
            if !fd.exists {
                create_table(want, &mut out);
                continue;
            }
            let mut claimed = fd.have.table.empty_like();
            for name in want.chains.keys() {
                if let Some(mut chain) = fd.have.table.chains.swap_remove(name) {
                    // The balancing chains' rules follow the maps, which are known at the end:
                    // `finish` decides on them.
                    if fd.balance_rules.iter().any(|(n, _)| n == name) {
                        chain.rules.clone_from(&want.chains[name].rules);
                    }
                    claimed.chains.insert(name.clone(), chain);
                }
            }
            for set in want.sets.values() {
                let from = SharedSet::from_name(&set.name).and_then(|id| fd.have.shared.get_mut(&id));
                if let Some(from) = from {
                    claimed.sets.insert(set.name.clone(), take_keys(from, set));
                }
            }
            diff_table(&claimed, want, &mut out);
        }
        for (family, set) in std::mem::take(&mut self.up_front) {
            let Some(present) = self.families.get(family).map(|f| f.present.contains(&set)) else { continue };
            if present {
                continue;
            }
            let spec = self.template(family, set).spec.clone();
            let Some(fd) = self.families.get_mut(family) else { continue };
            fd.mark_present(set);
            let kind = OpKind::AddSet { set: set.name().into_owned(), spec };
            sink.push(Op { family, table: fd.table.clone(), kind, owner: Owner::infrastructure() });
        }
    }

    /// Writes one service's objects (per family: its own objects and its elements of the shared
    /// sets, shared keys another claimant holds already removed). Breaks when an object cannot
    /// change in place ([`Delta::rebuild_reason`]).
    pub(super) fn service(&mut self, sink: &mut dyn OpSink, fragments: FamilyMap<WireFragment>) -> ControlFlow<()> {
        for (family, fragment) in fragments {
            if self.families.get(family).is_none() {
                continue;
            }
            let WireFragment { own: mut want, shared } = fragment;
            let wanted_shared: Vec<(SharedSet, WireSet)> = shared
                .into_iter()
                .map(|(set, elements)| {
                    let mut s = self.template(family, set).clone();
                    s.elements = elements;
                    (set, s)
                })
                .collect();
            let Some(fd) = self.families.get_mut(family) else { continue };
            let mut claimed = want.empty_like();
            for (name, chain) in &want.chains {
                let Some(have) = fd.have.table.chains.swap_remove(name) else { continue };
                if !have.same_spec(chain) {
                    self.rebuild_reason = Some(format!("chain {name} changed its hook or comment"));
                    return ControlFlow::Break(());
                }
                claimed.chains.insert(name.clone(), have);
            }
            for name in want.sets.keys() {
                if let Some(own) = fd.have.table.sets.swap_remove(name) {
                    claimed.sets.insert(name.clone(), own);
                }
            }
            for (id, set) in wanted_shared {
                if id.on_demand() {
                    fd.kept.insert(id);
                }
                // A balancing map of an earlier shape (its typeof): the rules naming it are
                // flushed with their chain (`finish` writes them again), and it is deleted, then
                // created again by `diff_table` with this service's elements, the first it holds.
                let replaced = match (fd.have.shared.get(&id), id) {
                    (Some(from), SharedSet::Balance(map, _)) if from.spec != set.spec => Some(map),
                    _ => None,
                };
                if let Some(map) = replaced {
                    fd.have.shared.remove(&id);
                    let op =
                        |kind: OpKind| Op { family, table: fd.table.clone(), kind, owner: Owner::infrastructure() };
                    if let Some((chain, rules)) = fd.balance_rules.iter_mut().find(|(n, _)| n == map.chain())
                        && !rules.is_empty()
                    {
                        rules.clear();
                        sink.push(op(OpKind::FlushChain { chain: chain.clone() }));
                    }
                    sink.push(op(OpKind::DeleteSet { set: set.name.clone() }));
                    want.sets.insert(set.name.clone(), set);
                    continue;
                }
                match fd.have.shared.get_mut(&id) {
                    Some(from) if from.spec != set.spec => {
                        self.rebuild_reason = Some(format!("set {} changed its type or flags", set.name));
                        return ControlFlow::Break(());
                    }
                    Some(from) => {
                        claimed.sets.insert(set.name.clone(), take_keys(from, &set));
                    }
                    // Written with the infrastructure, or an endpoint map an earlier service
                    // added in this transaction: only elements now.
                    None if fd.present.contains(&id) => {
                        claimed.sets.insert(set.name.clone(), set.empty_like());
                    }
                    // A new endpoint map: `diff_table` adds it with its elements.
                    None => fd.mark_present(id),
                }
                want.sets.insert(set.name.clone(), set);
            }
            let mut out = Buffered { sink: &mut *sink, pending: &mut self.pending, family, names: &fd.names };
            diff_table(&claimed, want, &mut out);
        }
        ControlFlow::Continue(())
    }

    /// Writes what is left: the stale objects' removal.
    pub(super) fn finish(&mut self, sink: &mut dyn OpSink) {
        for (family, fd) in self.families.iter_mut() {
            let mut out = Buffered { sink: &mut *sink, pending: &mut self.pending, family, names: &fd.names };
            for (id, set) in fd.have.shared.iter_mut() {
                if !fd.kept.contains(id) || set.dynamic || set.elements.is_empty() {
                    continue;
                }
                let keys = std::mem::take(&mut set.elements).into_iter().map(|(k, e)| (k, e.owner)).collect();
                out.push(Op {
                    family,
                    table: fd.table.clone(),
                    kind: OpKind::DeleteElements { set: set.name.clone(), keys },
                    owner: set.owner.clone(),
                });
            }
        }
        // Element changes before chains go: deleted elements release the chains they name.
        flush_all(&mut self.pending, sink);
        for (family, fd) in self.families.iter_mut() {
            let op = |kind: OpKind| Op { family, table: fd.table.clone(), kind, owner: Owner::infrastructure() };
            // After every map added, before any deleted: the rules name the maps kept.
            let want = balance_wire_rules(family, fd.kept.iter().copied());
            for (name, rules) in want {
                let Some((_, have)) = fd.balance_rules.iter().find(|(n, _)| *n == name) else { continue };
                let rest = match rules.strip_prefix(have.as_slice()) {
                    Some(rest) => rest.to_vec(),
                    None => {
                        sink.push(op(OpKind::FlushChain { chain: name.clone() }));
                        rules
                    }
                };
                for rule in rest {
                    sink.push(op(OpKind::AddRule { chain: name.clone(), rule }));
                }
            }
        }
        for (family, fd) in self.families.iter_mut() {
            let have = &fd.have.table;
            let op = |kind: OpKind, owner: Owner| Op { family, table: fd.table.clone(), kind, owner };
            for chain in have.chains.values() {
                sink.push(op(OpKind::FlushChain { chain: chain.name.clone() }, chain.owner.clone()));
            }
            for set in have.sets.values() {
                sink.push(op(OpKind::DeleteSet { set: set.name.clone() }, set.owner.clone()));
            }
            for (id, set) in &fd.have.shared {
                if !fd.kept.contains(id) {
                    sink.push(op(OpKind::DeleteSet { set: set.name.clone() }, set.owner.clone()));
                }
            }
            for chain in have.chains.values() {
                sink.push(op(OpKind::DeleteChain { chain: chain.name.clone() }, chain.owner.clone()));
            }
        }
        for table in std::mem::take(&mut self.stale_tables) {
            sink.push(table_op(&table, OpKind::DeleteTable));
        }
    }
}

/// The balancing chains' rules, as the kernel holds them, for these sets (only the balancing
/// maps among them count).
fn balance_wire_rules(family: IpFamily, sets: impl IntoIterator<Item = SharedSet>) -> Vec<(String, Vec<WireRule>)> {
    balance_chains(family, sets).iter().map(|c| (c.name.clone(), lower_chain(c).rules)).collect()
}

/// Whether the kernel's table must be deleted and created again: what [`needs_rebuild`] says,
/// or an infrastructure set whose type changed (its elements come from every service).
fn must_rebuild(have: &ViewTable, want: &WireTable) -> bool {
    needs_rebuild(&have.table, want)
        || want.sets.values().any(|s| {
            let kernel = SharedSet::from_name(&s.name).and_then(|id| have.shared.get(&id));
            kernel.is_some_and(|h| h.spec != s.spec)
        })
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
            let start = Bound::Included(WireKey::new(&(window << NUMGEN_WINDOW_BITS).to_be_bytes()));
            // Up to the next window's first start: its end key at the same bytes (the last
            // range's end) orders before it, so it is inside.
            let end = window
                .checked_add(1)
                .and_then(|next| next.checked_shl(NUMGEN_WINDOW_BITS))
                .filter(|next| next >> NUMGEN_WINDOW_BITS == window + 1)
                .map_or(Bound::Unbounded, |next| Bound::Excluded(WireKey::new(&next.to_be_bytes())));
            let keys: Vec<WireKey> = from
                .elements
                .range((start, end))
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
    family: IpFamily,
    names: &'a HashMap<String, SharedSet>,
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
        let Some(id) = self.names.get(set).copied() else {
            self.sink.push(op);
            return;
        };
        let key = (self.family, id);
        let Op { family, table, kind, owner } = op;
        let (set, dels, adds) = match kind {
            OpKind::AddElements { set, elements } => (set, Vec::new(), elements),
            OpKind::DeleteElements { set, keys } => (set, keys, Vec::new()),
            // A set is added or deleted: what waits for it goes first (nothing, for a new one).
            kind => {
                if let Some(pending) = self.pending.get_mut(&key) {
                    flush(family, id, pending, self.sink);
                }
                self.sink.push(Op { family, table, kind, owner });
                return;
            }
        };
        let pending = self.pending.entry(key).or_default();
        pending.op.get_or_insert((table, owner));
        pending.dels.extend(dels);
        pending.adds.extend(adds);
        drop(set);
        if pending.adds.len() + pending.dels.len() >= SHARED_ELEMENTS_PER_OP {
            flush(family, id, pending, self.sink);
        }
    }
}

fn flush(family: IpFamily, set: SharedSet, pending: &mut PendingElements, sink: &mut dyn OpSink) {
    let Some((table, owner)) = pending.op.clone() else { return };
    let name = set.name().into_owned();
    if !pending.dels.is_empty() {
        let keys = std::mem::take(&mut pending.dels);
        let kind = OpKind::DeleteElements { set: name.clone(), keys };
        sink.push(Op { family, table: table.clone(), kind, owner: owner.clone() });
    }
    if !pending.adds.is_empty() {
        let elements = std::mem::take(&mut pending.adds);
        sink.push(Op { family, table, kind: OpKind::AddElements { set: name, elements }, owner });
    }
}

fn flush_all(pending: &mut Pending, sink: &mut dyn OpSink) {
    for ((family, set), p) in pending.iter_mut() {
        flush(*family, *set, p, sink);
    }
    pending.clear();
}

fn table_op(table: &WireTable, kind: OpKind) -> Op {
    Op { family: table.family, table: table.name.clone(), kind, owner: Owner::infrastructure() }
}
