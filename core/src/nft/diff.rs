//! The difference between two rulesets as one ordered transaction.
//!
//! `current` is what the kernel holds (the last applied ruleset, or a read-back) and `desired`
//! what `plan` wants. The operations are ordered so the kernel accepts them in one batch:
//! objects exist before anything references them, and references are gone before the objects
//! they point to are deleted (the kernel counts them: deleting a referenced chain is `EBUSY`).

use std::collections::HashSet;
use std::fmt;

use super::ast::Owner;
use super::render::family_keyword;
use super::wire::*;
use crate::net::IpFamily;

/// What one operation does. `DeleteRule` deletes a rule by its kernel handle (kube-proxy's
/// leftovers in foreign tables, issue 14). `ForgetElements` deletes elements if they are still
/// there (an affinity slot's clients when its endpoint goes: the kernel may expire any of them
/// before the transaction commits).
#[derive(Debug, Clone)]
pub enum OpKind {
    AddTable { flags: u32, userdata: Option<Vec<u8>> },
    DeleteTable,
    AddChain { chain: String, hook: Option<WireHook>, userdata: Option<Vec<u8>> },
    FlushChain { chain: String },
    DeleteChain { chain: String },
    AddRule { chain: String, rule: WireRule },
    AddSet { set: String, spec: WireSetSpec },
    DeleteSet { set: String },
    AddElements { set: String, elements: Vec<(WireKey, WireElement)> },
    DeleteElements { set: String, keys: Vec<(WireKey, Owner)> },
    ForgetElements { set: String, keys: Vec<WireKey> },
    DeleteRule { chain: String, handle: u64 },
}

/// What an operation does, without its data: what decisions about a refused message look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpTag {
    AddTable,
    DeleteTable,
    AddChain,
    FlushChain,
    DeleteChain,
    AddRule,
    AddSet,
    DeleteSet,
    AddElements,
    DeleteElements,
    ForgetElements,
    DeleteRule,
}

impl OpKind {
    /// The operation's tag.
    pub fn tag(&self) -> OpTag {
        match self {
            OpKind::AddTable { .. } => OpTag::AddTable,
            OpKind::DeleteTable => OpTag::DeleteTable,
            OpKind::AddChain { .. } => OpTag::AddChain,
            OpKind::FlushChain { .. } => OpTag::FlushChain,
            OpKind::DeleteChain { .. } => OpTag::DeleteChain,
            OpKind::AddRule { .. } => OpTag::AddRule,
            OpKind::AddSet { .. } => OpTag::AddSet,
            OpKind::DeleteSet { .. } => OpTag::DeleteSet,
            OpKind::AddElements { .. } => OpTag::AddElements,
            OpKind::DeleteElements { .. } => OpTag::DeleteElements,
            OpKind::ForgetElements { .. } => OpTag::ForgetElements,
            OpKind::DeleteRule { .. } => OpTag::DeleteRule,
        }
    }

    /// Whether the operation adds an object (rather than flushing or deleting one).
    pub fn is_addition(&self) -> bool {
        match self {
            OpKind::AddTable { .. }
            | OpKind::AddChain { .. }
            | OpKind::AddRule { .. }
            | OpKind::AddSet { .. }
            | OpKind::AddElements { .. } => true,
            OpKind::DeleteTable
            | OpKind::FlushChain { .. }
            | OpKind::DeleteChain { .. }
            | OpKind::DeleteSet { .. }
            | OpKind::DeleteElements { .. }
            | OpKind::ForgetElements { .. }
            | OpKind::DeleteRule { .. } => false,
        }
    }
}

/// One operation on one table, and who it is for.
#[derive(Debug, Clone)]
pub struct Op {
    pub family: IpFamily,
    pub table: String,
    pub kind: OpKind,
    pub owner: Owner,
}

impl Op {
    /// The owners affected if this operation fails: the element owners for element operations,
    /// the operation's owner otherwise.
    pub fn owners(&self) -> Vec<Owner> {
        match &self.kind {
            OpKind::AddElements { elements, .. } => elements.iter().map(|(_, e)| e.owner.clone()).collect(),
            OpKind::DeleteElements { keys, .. } => keys.iter().map(|(_, o)| o.clone()).collect(),
            OpKind::AddTable { .. }
            | OpKind::DeleteTable
            | OpKind::AddChain { .. }
            | OpKind::FlushChain { .. }
            | OpKind::DeleteChain { .. }
            | OpKind::AddRule { .. }
            | OpKind::AddSet { .. }
            | OpKind::DeleteSet { .. }
            | OpKind::ForgetElements { .. }
            | OpKind::DeleteRule { .. } => vec![self.owner.clone()],
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = format!("{} {}", family_keyword(self.family), self.table);
        match &self.kind {
            OpKind::AddTable { .. } => write!(f, "add table {t}"),
            OpKind::DeleteTable => write!(f, "delete table {t}"),
            OpKind::AddChain { chain, .. } => write!(f, "add chain {t} {chain}"),
            OpKind::FlushChain { chain } => write!(f, "flush chain {t} {chain}"),
            OpKind::DeleteChain { chain } => write!(f, "delete chain {t} {chain}"),
            OpKind::AddRule { chain, .. } => write!(f, "add rule {t} {chain}"),
            OpKind::AddSet { set, .. } => write!(f, "add set {t} {set}"),
            OpKind::DeleteSet { set } => write!(f, "delete set {t} {set}"),
            OpKind::AddElements { set, elements } => {
                write!(f, "add element {t} {set} ({} elements)", elements.len())
            }
            OpKind::DeleteElements { set, keys } => {
                write!(f, "delete element {t} {set} ({} elements)", keys.len())
            }
            OpKind::ForgetElements { set, keys } => {
                write!(f, "destroy element {t} {set} ({} elements)", keys.len())
            }
            OpKind::DeleteRule { chain, handle } => write!(f, "delete rule {t} {chain} handle {handle}"),
        }
    }
}

/// Operations to apply atomically, in order.
#[derive(Debug, Clone, Default)]
pub struct Transaction {
    pub ops: Vec<Op>,
}

impl Transaction {
    /// True when there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// One line per operation (for logs and tests).
    pub fn summary(&self) -> Vec<String> {
        self.ops.iter().map(|op| op.to_string()).collect()
    }
}

/// Where operations go as they are produced: a [`Transaction`] in memory, or straight into
/// the netlink batch (a full sync streams its operations, so it never holds them all).
pub trait OpSink {
    /// Takes the next operation.
    fn push(&mut self, op: Op);
}

impl OpSink for Transaction {
    fn push(&mut self, op: Op) {
        self.ops.push(op);
    }
}

/// Operations turning `current` into `desired`. Tables of `current` missing from `desired` are
/// deleted.
pub fn diff(current: &WireRuleset, desired: &WireRuleset) -> Transaction {
    diff_into(current, desired.clone())
}

/// Like [`diff`], consuming `desired`: objects to create move into the transaction instead of
/// being copied (a cold sync would otherwise hold the whole ruleset twice).
pub fn diff_into(current: &WireRuleset, desired: WireRuleset) -> Transaction {
    let mut tx = Transaction::default();
    let wanted: Vec<(IpFamily, String)> = desired.tables.iter().map(|t| (t.family, t.name.clone())).collect();
    for want in desired.tables {
        match current.tables.iter().find(|t| t.family == want.family && t.name == want.name) {
            None => create_table(want, &mut tx),
            Some(have) if needs_rebuild(have, &want) => {
                tx.push(op(&want, OpKind::DeleteTable, Owner::infrastructure()));
                create_table(want, &mut tx);
            }
            Some(have) => diff_table(have, want, &mut tx),
        }
    }
    for have in &current.tables {
        if !wanted.iter().any(|(f, n)| *f == have.family && *n == have.name) {
            tx.push(op(have, OpKind::DeleteTable, Owner::infrastructure()));
        }
    }
    tx
}

fn op(table: &WireTable, kind: OpKind, owner: Owner) -> Op {
    Op { family: table.family, table: table.name.clone(), kind, owner }
}

/// Whether the table must be replaced as a whole (inside the same transaction): its comment, a
/// chain's hook or comment, or its `persist` flag changed, which the kernel cannot update in
/// place (it refuses to toggle `NFT_TABLE_F_PERSIST` with `EOPNOTSUPP`, Linux 6.9).
pub fn needs_rebuild(have: &WireTable, want: &WireTable) -> bool {
    have.userdata != want.userdata
        || (have.flags ^ want.flags) & super::wire::consts::TABLE_F_PERSIST != 0
        || want.chains.values().any(|c| have.chains.get(&c.name).is_some_and(|h| !h.same_spec(c)))
}

/// Everything for a table that does not exist yet.
pub fn create_table(mut want: WireTable, tx: &mut dyn OpSink) {
    tx.push(op(
        &want,
        OpKind::AddTable { flags: want.flags, userdata: want.userdata.clone() },
        Owner::infrastructure(),
    ));
    for chain in want.chains.values() {
        tx.push(add_chain(&want, chain));
    }
    let sets = std::mem::take(&mut want.sets);
    for set in sets.into_values() {
        add_set_with_elements(&want, set, tx);
    }
    let chains = std::mem::take(&mut want.chains);
    for chain in chains.into_values() {
        add_rules(&want, chain, tx);
    }
}

fn add_chain(table: &WireTable, chain: &WireChain) -> Op {
    op(
        table,
        OpKind::AddChain { chain: chain.name.clone(), hook: chain.hook.clone(), userdata: chain.userdata.clone() },
        chain.owner.clone(),
    )
}

fn add_rules(table: &WireTable, chain: WireChain, tx: &mut dyn OpSink) {
    for rule in chain.rules {
        tx.push(op(table, OpKind::AddRule { chain: chain.name.clone(), rule }, chain.owner.clone()));
    }
}

fn add_set_with_elements(table: &WireTable, set: WireSet, tx: &mut dyn OpSink) {
    tx.push(op(table, OpKind::AddSet { set: set.name.clone(), spec: set.spec }, set.owner.clone()));
    if !set.dynamic && !set.elements.is_empty() {
        let elements = set.elements.into_iter().collect();
        tx.push(op(table, OpKind::AddElements { set: set.name, elements }, set.owner));
    }
}

/// Operations turning one table into another (both must be the same family and name).
pub fn diff_table(have: &WireTable, mut want: WireTable, tx: &mut dyn OpSink) {
    if have.flags != want.flags {
        tx.push(op(
            &want,
            OpKind::AddTable { flags: want.flags, userdata: want.userdata.clone() },
            Owner::infrastructure(),
        ));
    }

    let recreated_sets: HashSet<String> = want
        .sets
        .values()
        .filter(|s| have.sets.get(&s.name).is_some_and(|h| h.spec != s.spec))
        .map(|s| s.name.clone())
        .collect();

    // Chains whose rules reference a recreated set must be rewritten, in the kernel's copy
    // (to release the old set) and in ours (to bind the new one).
    let referencing_recreated = |chain: &WireChain| chain.set_refs().any(|s| recreated_sets.contains(s));
    let rewritten: Vec<String> = want
        .chains
        .values()
        .filter(|c| match have.chains.get(&c.name) {
            Some(h) => h.rules != c.rules || referencing_recreated(h) || referencing_recreated(c),
            None => false,
        })
        .map(|c| c.name.clone())
        .collect();
    let new_chains: Vec<String> =
        want.chains.values().filter(|c| !have.chains.contains_key(&c.name)).map(|c| c.name.clone()).collect();
    let gone_chains: Vec<&WireChain> = have.chains.values().filter(|c| !want.chains.contains_key(&c.name)).collect();

    // 1. New chains, empty, so elements and rules below can point at them.
    for name in &new_chains {
        tx.push(add_chain(&want, &want.chains[name]));
    }

    // 2. Elements that go away or change, releasing the chains they point at.
    let mut element_adds: Vec<(String, Owner, ElementAdds)> = Vec::new();
    for set in want.sets.values() {
        let Some(old) = have.sets.get(&set.name) else { continue };
        if recreated_sets.contains(set.name.as_str()) || set.dynamic {
            continue;
        }
        let (dels, adds) = if set.spec.is_interval() {
            diff_intervals(&old.elements, &set.elements, set.spec.is_numgen_interval_map())
        } else {
            diff_elements(&old.elements, &set.elements)
        };
        if !dels.is_empty() {
            tx.push(op(&want, OpKind::DeleteElements { set: set.name.clone(), keys: dels }, set.owner.clone()));
        }
        if !adds.is_empty() {
            element_adds.push((set.name.clone(), set.owner.clone(), adds));
        }
    }

    // 3. Flush chains that are rewritten or deleted: their rules release sets and chains.
    for name in rewritten.iter().chain(gone_chains.iter().map(|c| &c.name)) {
        let owner = want.chains.get(name).or_else(|| have.chains.get(name)).map(|c| c.owner.clone());
        let owner = owner.unwrap_or_else(Owner::infrastructure);
        tx.push(op(&want, OpKind::FlushChain { chain: name.clone() }, owner));
    }

    // 4. Sets whose type changed are replaced, now that no rule uses them.
    for name in want.sets.keys().filter(|n| recreated_sets.contains(n.as_str())) {
        tx.push(op(&want, OpKind::DeleteSet { set: name.clone() }, want.sets[name].owner.clone()));
    }

    // 5. New and replaced sets with their elements; then new elements of kept sets.
    let gone_sets: Vec<&WireSet> = have.sets.values().filter(|s| !want.sets.contains_key(&s.name)).collect();
    let sets = std::mem::take(&mut want.sets);
    for set in sets.into_values() {
        if !have.sets.contains_key(&set.name) || recreated_sets.contains(set.name.as_str()) {
            add_set_with_elements(&want, set, tx);
        }
    }
    for (set, owner, adds) in element_adds {
        tx.push(op(&want, OpKind::AddElements { set, elements: adds }, owner));
    }

    // 6. Rules of new and rewritten chains, in the desired chain order.
    let rewritten: HashSet<String> = rewritten.into_iter().collect();
    let chains = std::mem::take(&mut want.chains);
    for chain in chains.into_values() {
        if !have.chains.contains_key(&chain.name) || rewritten.contains(&chain.name) {
            add_rules(&want, chain, tx);
        }
    }

    // 7. Sets and chains nothing references any more.
    for set in gone_sets {
        tx.push(op(&want, OpKind::DeleteSet { set: set.name.clone() }, set.owner.clone()));
    }
    for chain in gone_chains {
        tx.push(op(&want, OpKind::DeleteChain { chain: chain.name.clone() }, chain.owner.clone()));
    }
}

/// Keys to delete, with the owner a failure is reported against.
type ElementDeletes = Vec<(WireKey, Owner)>;
/// Elements to add.
type ElementAdds = Vec<(WireKey, WireElement)>;

/// Like [`diff_elements`], for interval sets. The kernel refuses a start or end element inside
/// a range it holds, so a group of ranges whose boundaries move is deleted and added whole (in
/// one transaction the deleted elements are inactive when the new ones arrive); a range that
/// only maps to something else is replaced alone. The groups are the numgen windows of endpoint
/// maps (one service port's ranges each), and the whole set for other interval sets (a few
/// prefixes).
fn diff_intervals(have: &SetElements, want: &SetElements, by_window: bool) -> (ElementDeletes, ElementAdds) {
    let group = |key: &WireKey| if by_window { key.numgen_window() } else { None };
    let moved: HashSet<Option<u32>> = have
        .keys()
        .filter(|k| !want.contains_key(k))
        .chain(want.keys().filter(|k| !have.contains_key(k)))
        .map(group)
        .collect();
    let (dels, adds) = diff_elements(have, want);
    if moved.is_empty() {
        return (dels, adds);
    }
    let mut dels: ElementDeletes = dels.into_iter().filter(|(k, _)| !moved.contains(&group(k))).collect();
    let mut adds: ElementAdds = adds.into_iter().filter(|(k, _)| !moved.contains(&group(k))).collect();
    for (k, e) in have.iter().filter(|(k, _)| moved.contains(&group(k))) {
        let owner = want.get(k).map_or_else(|| e.owner.clone(), |w| w.owner.clone());
        dels.push((k.clone(), owner));
    }
    adds.extend(want.iter().filter(|(k, _)| moved.contains(&group(k))).map(|(k, e)| (k.clone(), e.clone())));
    adds.sort_by(|a, b| a.0.cmp(&b.0));
    (dels, adds)
}

/// Element keys to delete (gone or changed) and elements to add (new or changed).
fn diff_elements(have: &SetElements, want: &SetElements) -> (ElementDeletes, ElementAdds) {
    let mut dels = Vec::new();
    let mut adds = Vec::new();
    for (key, old) in have {
        match want.get(key) {
            Some(new) if new.same_content(old) => {}
            Some(new) => dels.push((key.clone(), new.owner.clone())),
            None => dels.push((key.clone(), old.owner.clone())),
        }
    }
    for (key, new) in want {
        match have.get(key) {
            Some(old) if old.same_content(new) => {}
            _ => adds.push((key.clone(), new.clone())),
        }
    }
    (dels, adds)
}
