//! A model of the kernel (the real one is the agent's `netlink::Kernel`): its rules for a
//! transaction, as a pure function on the wire ruleset. Objects must exist before they are
//! referenced (`ENOENT`), referenced chains and sets cannot be deleted (`EBUSY`), an element
//! cannot be re-added with different data or overlap an interval (`EEXIST`). The planner's
//! tests apply every diff through it, and the agent's fake kernel is built on it. Rules have no
//! handles here: a rule's handle is its 1-based position in its chain.

use indexmap::IndexMap;

use crate::nft::diff::{Op, OpKind, Transaction};
use crate::nft::wire::*;

/// Why the kernel would refuse an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A table, chain, set, rule or element that is not there (`ENOENT`).
    NotFound,
    /// A chain or set still referenced, or a base chain's hook changed (`EBUSY`).
    InUse,
    /// An element or set re-added with other content, or an overlapping interval (`EEXIST`).
    Exists,
}

/// Applies `tx` to `state` atomically: on a refusal, `state` is unchanged and the index of the
/// refused operation is returned with the reason.
pub fn apply(state: &mut WireRuleset, tx: &Transaction) -> Result<(), (usize, Refusal)> {
    let mut next = state.clone();
    for (i, op) in tx.ops.iter().enumerate() {
        apply_op(&mut next, op).map_err(|r| (i, r))?;
    }
    for table in &next.tables {
        check_references(table).map_err(|r| (tx.ops.len().saturating_sub(1), r))?;
    }
    *state = next;
    Ok(())
}

fn table_mut<'a>(state: &'a mut WireRuleset, op: &Op) -> Result<&'a mut WireTable, Refusal> {
    state.tables.iter_mut().find(|t| t.family == op.family && t.name == op.table).ok_or(Refusal::NotFound)
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

/// Checks that every chain and set a table's rules and verdict maps name exists (the kernel
/// checks this when the batch commits).
pub fn check_references(table: &WireTable) -> Result<(), Refusal> {
    for c in chain_refs(table) {
        if !table.chains.contains_key(&c) {
            return Err(Refusal::NotFound);
        }
    }
    for s in set_refs(table) {
        if !table.sets.contains_key(&s) {
            return Err(Refusal::NotFound);
        }
    }
    Ok(())
}

/// Applies one operation as the kernel would, or says why it would refuse it.
pub fn apply_op(state: &mut WireRuleset, op: &Op) -> Result<(), Refusal> {
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
                return Err(Refusal::NotFound);
            }
        }
        OpKind::AddChain { chain, hook, userdata } => {
            let t = table_mut(state, op)?;
            match t.chains.get(chain) {
                Some(existing) if existing.hook != *hook => return Err(Refusal::InUse),
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
            table_mut(state, op)?.chains.get_mut(chain).ok_or(Refusal::NotFound)?.rules.clear();
        }
        OpKind::DeleteRule { chain, handle } => {
            let rules = &mut table_mut(state, op)?.chains.get_mut(chain).ok_or(Refusal::NotFound)?.rules;
            let index = usize::try_from(*handle).ok().and_then(|h| h.checked_sub(1)).ok_or(Refusal::NotFound)?;
            if index >= rules.len() {
                return Err(Refusal::NotFound);
            }
            rules.remove(index);
        }
        OpKind::DeleteChain { chain } => {
            let t = table_mut(state, op)?;
            let removed = t.chains.shift_remove(chain).ok_or(Refusal::NotFound)?;
            if chain_refs(t).iter().any(|c| c == chain) {
                t.chains.insert(chain.clone(), removed);
                return Err(Refusal::InUse);
            }
        }
        OpKind::AddRule { chain, rule } => {
            let t = table_mut(state, op)?;
            for target in rule.exprs.iter().filter_map(|e| match e {
                LowExpr::Verdict { chain: Some(c), .. } => Some(c),
                _ => None,
            }) {
                if !t.chains.contains_key(target) {
                    return Err(Refusal::NotFound);
                }
            }
            for set in rule.exprs.iter().filter_map(|e| match e {
                LowExpr::Lookup { set, .. } | LowExpr::Dynset { set, .. } => Some(set),
                _ => None,
            }) {
                if !t.sets.contains_key(set) {
                    return Err(Refusal::NotFound);
                }
            }
            t.chains.get_mut(chain).ok_or(Refusal::NotFound)?.rules.push(rule.clone());
        }
        OpKind::AddSet { set, spec } => {
            let t = table_mut(state, op)?;
            match t.sets.get(set) {
                Some(existing) if existing.spec != *spec => return Err(Refusal::Exists),
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
                return Err(Refusal::InUse);
            }
            t.sets.shift_remove(set).ok_or(Refusal::NotFound)?;
        }
        OpKind::AddElements { set, elements } => {
            let t = table_mut(state, op)?;
            for (_, e) in elements {
                if let WireData::Verdict { chain: Some(c), .. } = &e.data
                    && !t.chains.contains_key(c)
                {
                    return Err(Refusal::NotFound);
                }
            }
            let s = t.sets.get_mut(set).ok_or(Refusal::NotFound)?;
            let interval = s.spec.is_interval();
            for (k, e) in elements {
                match s.elements.get(k) {
                    Some(existing) if !existing.same_content(e) => return Err(Refusal::Exists),
                    Some(_) => {}
                    None if interval && interval_overlap(&s.elements, k) => return Err(Refusal::Exists),
                    None => {
                        s.elements.insert(k.clone(), e.clone());
                    }
                }
            }
        }
        OpKind::ForgetElements { set, keys } => {
            let s = table_mut(state, op)?.sets.get_mut(set).ok_or(Refusal::NotFound)?;
            for k in keys {
                s.elements.remove(k);
            }
        }
        OpKind::DeleteElements { set, keys } => {
            let s = table_mut(state, op)?.sets.get_mut(set).ok_or(Refusal::NotFound)?;
            for (k, _) in keys {
                s.elements.remove(k).ok_or(Refusal::NotFound)?;
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
