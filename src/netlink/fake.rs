//! An in-memory stand-in for the kernel, for tests that need no privileges.
//!
//! It applies transactions atomically with the checks that make the kernel refuse a batch:
//! objects must exist before they are referenced (`ENOENT`), referenced chains and sets cannot
//! be deleted (`EBUSY`), and an element cannot be re-added with different data (`EEXIST`).
//! Rules have no handles here: a rule's handle is taken as its 1-based position in its chain
//! (so tests delete several rules of one chain last first).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use indexmap::IndexMap;

use super::{ApplyStats, MessageFailure, Netfilter, NetlinkError};
use crate::net::IpFamily;
use crate::nft::diff::{OpKind, Transaction};
use crate::nft::wire::*;

/// The fake kernel's state and a log of what it was sent.
#[derive(Debug, Default)]
pub struct FakeNetfilter {
    pub state: WireRuleset,
    /// Every transaction applied successfully, in order.
    pub applied: Vec<Transaction>,
    /// Fail the next transaction that contains an operation whose text contains this string.
    pub fail_on: Option<String>,
    /// Refuse every addition (chain, rule, set, element) whose owner starts with this string,
    /// naming that owner alone, as the kernel's extended ACK lets the real edge do. Deletions
    /// go through.
    pub refuse_owner: Option<String>,
    /// Table flags this kernel does not know (`EOPNOTSUPP`, as kernels before 6.9 answer
    /// `persist`).
    pub unknown_table_flags: u32,
    /// The ruleset generation: 1 at start, one more per transaction applied (tests add their
    /// own to stand for another process's commits).
    pub generation: u32,
    /// The generation the next transaction expects.
    pub expected: Option<u32>,
}

impl FakeNetfilter {
    /// An empty kernel.
    pub fn new() -> FakeNetfilter {
        FakeNetfilter { generation: 1, ..FakeNetfilter::default() }
    }

    /// Another process commits a transaction (of its own tables).
    pub fn foreign_commit(&mut self) {
        self.generation = super::next_generation(self.generation);
    }
}

/// A fake kernel shared between the syncer that owns it (boxed) and the test that inspects it.
#[derive(Debug, Clone, Default)]
pub struct SharedFake(pub Arc<Mutex<FakeNetfilter>>);

impl SharedFake {
    /// Shares `kernel`.
    pub fn new(kernel: FakeNetfilter) -> SharedFake {
        SharedFake(Arc::new(Mutex::new(kernel)))
    }

    /// The fake kernel (a test that panicked while holding it leaves it usable).
    pub fn lock(&self) -> MutexGuard<'_, FakeNetfilter> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Netfilter for SharedFake {
    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NetlinkError> {
        self.lock().apply(tx)
    }

    fn set_keys(&mut self, family: IpFamily, table: &str, set: &str) -> Result<Vec<WireKey>, NetlinkError> {
        self.lock().set_keys(family, table, set)
    }

    fn read(&mut self, tables: &[(IpFamily, &str)]) -> Result<WireRuleset, NetlinkError> {
        self.lock().read(tables)
    }

    fn generation(&mut self) -> Result<Option<u32>, NetlinkError> {
        self.lock().generation()
    }

    fn expect_generation(&mut self, genid: Option<u32>) {
        self.lock().expect_generation(genid);
    }
}

fn err(index: usize, tx: &Transaction, errno: i32) -> NetlinkError {
    let op = &tx.ops[index];
    NetlinkError::Rejected(vec![MessageFailure {
        op_index: index,
        tag: op.kind.tag(),
        op: op.to_string(),
        errno,
        owners: op.owners(),
        text: None,
    }])
}

impl Netfilter for FakeNetfilter {
    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NetlinkError> {
        if self.expected.take().is_some_and(|g| g != self.generation) && !tx.is_empty() {
            return Err(NetlinkError::GenerationChanged);
        }
        let mut state = self.state.clone();
        for (i, op) in tx.ops.iter().enumerate() {
            if let Some(pattern) = &self.fail_on
                && op.to_string().contains(pattern.as_str())
            {
                return Err(err(i, tx, libc::EINVAL));
            }
            if let OpKind::AddTable { flags, .. } = &op.kind
                && flags & self.unknown_table_flags != 0
            {
                return Err(err(i, tx, libc::EOPNOTSUPP));
            }
            if let Some(prefix) = &self.refuse_owner
                && op.kind.is_addition()
                && let Some(owner) = op.owners().into_iter().find(|o| o.to_string().starts_with(prefix.as_str()))
            {
                return Err(NetlinkError::Rejected(vec![MessageFailure {
                    op_index: i,
                    tag: op.kind.tag(),
                    op: op.to_string(),
                    errno: libc::EINVAL,
                    owners: vec![owner],
                    text: None,
                }]));
            }
            apply_op(&mut state, op).map_err(|errno| err(i, tx, errno))?;
        }
        for table in &state.tables {
            check_references(table).map_err(|errno| err(tx.ops.len().saturating_sub(1), tx, errno))?;
        }
        self.state = state;
        if !tx.is_empty() {
            self.generation = super::next_generation(self.generation);
        }
        self.applied.push(tx.clone());
        Ok(ApplyStats { operations: tx.ops.len(), messages: tx.ops.len(), ..ApplyStats::default() })
    }

    fn set_keys(&mut self, family: IpFamily, table: &str, set: &str) -> Result<Vec<WireKey>, NetlinkError> {
        let table = self.state.tables.iter().find(|t| t.family == family && t.name == table);
        Ok(table.and_then(|t| t.sets.get(set)).map(|s| s.elements.keys().cloned().collect()).unwrap_or_default())
    }

    fn read(&mut self, tables: &[(IpFamily, &str)]) -> Result<WireRuleset, NetlinkError> {
        Ok(WireRuleset {
            tables: self
                .state
                .tables
                .iter()
                .filter(|t| tables.iter().any(|(f, n)| *f == t.family && *n == t.name))
                .cloned()
                .collect(),
        })
    }

    fn generation(&mut self) -> Result<Option<u32>, NetlinkError> {
        Ok(Some(self.generation))
    }

    fn expect_generation(&mut self, genid: Option<u32>) {
        self.expected = genid;
    }
}

fn table_mut<'a>(state: &'a mut WireRuleset, op: &crate::nft::diff::Op) -> Result<&'a mut WireTable, i32> {
    state.tables.iter_mut().find(|t| t.family == op.family && t.name == op.table).ok_or(libc::ENOENT)
}

/// Names referenced by a table's rules and map elements.
fn chain_refs(table: &WireTable) -> Vec<String> {
    let mut out: Vec<String> = table.chains.values().flat_map(|c| c.targets().map(str::to_string)).collect();
    for set in table.sets.values() {
        for e in set.elements.values() {
            if let WireData::Verdict { chain: Some(c), .. } = &e.data {
                out.push(c.clone());
            }
        }
    }
    out
}

fn set_refs(table: &WireTable) -> Vec<String> {
    table.chains.values().flat_map(|c| c.set_refs().map(str::to_string)).collect()
}

fn check_references(table: &WireTable) -> Result<(), i32> {
    for c in chain_refs(table) {
        if !table.chains.contains_key(&c) {
            return Err(libc::ENOENT);
        }
    }
    for s in set_refs(table) {
        if !table.sets.contains_key(&s) {
            return Err(libc::ENOENT);
        }
    }
    Ok(())
}

fn apply_op(state: &mut WireRuleset, op: &crate::nft::diff::Op) -> Result<(), i32> {
    match &op.kind {
        OpKind::AddTable { flags, userdata } => {
            if let Ok(t) = table_mut(state, op) {
                t.flags = *flags;
            } else {
                state.tables.push(WireTable {
                    family: op.family,
                    name: op.table.clone(),
                    flags: *flags,
                    userdata: userdata.clone(),
                    sets: IndexMap::new(),
                    chains: IndexMap::new(),
                });
            }
        }
        OpKind::DeleteTable => {
            let before = state.tables.len();
            state.tables.retain(|t| !(t.family == op.family && t.name == op.table));
            if state.tables.len() == before {
                return Err(libc::ENOENT);
            }
        }
        OpKind::AddChain { chain, hook, userdata } => {
            let t = table_mut(state, op)?;
            match t.chains.get(chain) {
                Some(existing) if existing.hook != *hook => return Err(libc::EBUSY),
                Some(_) => {}
                None => {
                    t.chains.insert(
                        chain.clone(),
                        WireChain {
                            name: chain.clone(),
                            hook: hook.clone(),
                            userdata: userdata.clone(),
                            rules: Vec::new(),
                            owner: op.owner.clone(),
                        },
                    );
                }
            }
        }
        OpKind::FlushChain { chain } => {
            table_mut(state, op)?.chains.get_mut(chain).ok_or(libc::ENOENT)?.rules.clear();
        }
        OpKind::DeleteRule { chain, handle } => {
            let rules = &mut table_mut(state, op)?.chains.get_mut(chain).ok_or(libc::ENOENT)?.rules;
            let index = usize::try_from(*handle).ok().and_then(|h| h.checked_sub(1)).ok_or(libc::ENOENT)?;
            if index >= rules.len() {
                return Err(libc::ENOENT);
            }
            rules.remove(index);
        }
        OpKind::DeleteChain { chain } => {
            let t = table_mut(state, op)?;
            let removed = t.chains.shift_remove(chain).ok_or(libc::ENOENT)?;
            if chain_refs(t).iter().any(|c| c == chain) {
                t.chains.insert(chain.clone(), removed);
                return Err(libc::EBUSY);
            }
        }
        OpKind::AddRule { chain, rule } => {
            let t = table_mut(state, op)?;
            for target in rule.exprs.iter().filter_map(|e| match e {
                LowExpr::Verdict { chain: Some(c), .. } => Some(c),
                _ => None,
            }) {
                if !t.chains.contains_key(target) {
                    return Err(libc::ENOENT);
                }
            }
            for set in rule.exprs.iter().filter_map(|e| match e {
                LowExpr::Lookup { set, .. } | LowExpr::Dynset { set, .. } => Some(set),
                _ => None,
            }) {
                if !t.sets.contains_key(set) {
                    return Err(libc::ENOENT);
                }
            }
            t.chains.get_mut(chain).ok_or(libc::ENOENT)?.rules.push(rule.clone());
        }
        OpKind::AddSet { set, spec } => {
            let t = table_mut(state, op)?;
            match t.sets.get(set) {
                Some(existing) if existing.spec != *spec => return Err(libc::EEXIST),
                Some(_) => {}
                None => {
                    t.sets.insert(
                        set.clone(),
                        WireSet {
                            name: set.clone(),
                            spec: spec.clone(),
                            elements: SetElements::new(),
                            dynamic: spec.flags & consts::SET_EVAL != 0,
                            owner: op.owner.clone(),
                        },
                    );
                }
            }
        }
        OpKind::DeleteSet { set } => {
            let t = table_mut(state, op)?;
            if set_refs(t).iter().any(|s| s == set) {
                return Err(libc::EBUSY);
            }
            t.sets.shift_remove(set).ok_or(libc::ENOENT)?;
        }
        OpKind::AddElements { set, elements } => {
            let t = table_mut(state, op)?;
            for (_, e) in elements {
                if let WireData::Verdict { chain: Some(c), .. } = &e.data
                    && !t.chains.contains_key(c)
                {
                    return Err(libc::ENOENT);
                }
            }
            let s = t.sets.get_mut(set).ok_or(libc::ENOENT)?;
            let interval = s.spec.is_interval();
            for (k, e) in elements {
                match s.elements.get(k) {
                    Some(existing) if !existing.same_content(e) => return Err(libc::EEXIST),
                    Some(_) => {}
                    None if interval && interval_overlap(&s.elements, k) => return Err(libc::EEXIST),
                    None => {
                        s.elements.insert(k.clone(), e.clone());
                    }
                }
            }
        }
        OpKind::ForgetElements { set, keys } => {
            let s = table_mut(state, op)?.sets.get_mut(set).ok_or(libc::ENOENT)?;
            for k in keys {
                s.elements.remove(k);
            }
        }
        OpKind::DeleteElements { set, keys } => {
            let s = table_mut(state, op)?.sets.get_mut(set).ok_or(libc::ENOENT)?;
            for (k, _) in keys {
                s.elements.remove(k).ok_or(libc::ENOENT)?;
            }
        }
    }
    Ok(())
}

/// The kernel's overlap rules for a new element of an interval set (`__nft_rbtree_insert` in
/// `nft_set_rbtree.c`): it looks at the closest greater-or-equal and less-or-equal elements and
/// refuses a start or end that falls inside a range it holds (reported as `EEXIST`).
fn interval_overlap(existing: &SetElements, new: &WireKey) -> bool {
    // The kernel walks from the closest greater key downwards; at equal keys a start comes
    // before an end.
    let mut ge: Option<&WireKey> = existing.keys().filter(|k| k.bytes > new.bytes).min_by(|a, b| a.bytes.cmp(&b.bytes));
    let mut le: Option<&WireKey> = None;
    let equal_start = existing.keys().find(|k| k.bytes == new.bytes && !k.interval_end);
    let equal_end = existing.keys().find(|k| k.bytes == new.bytes && k.interval_end);
    if let Some(start) = equal_start
        && (ge.is_none_or(|g| g.bytes != new.bytes))
    {
        ge = Some(start);
    }
    if let Some(end) = equal_end {
        le = Some(end);
    } else {
        let below = existing.keys().filter(|k| k.bytes < new.bytes).map(|k| &k.bytes).max();
        if let Some(bytes) = below {
            // At one key the walk meets the start first.
            le = existing.keys().filter(|k| &k.bytes == bytes).min_by_key(|k| k.interval_end);
        }
    }
    let same = |k: &WireKey| k.bytes == new.bytes && k.interval_end == new.interval_end;
    ge.is_some_and(same)
        || le.is_some_and(same)
        || le.is_some_and(|l| !l.interval_end && !new.interval_end)
        || le.is_some_and(|l| l.interval_end && new.interval_end)
        || ge.is_some_and(|g| g.interval_end && new.interval_end)
}
