//! An interpreter of nftables' register machine over one synthetic packet: the expressions of
//! [`crate::nft::wire`] as the kernel runs them, rule by rule, chain by chain.
//!
//! Random choices (`numgen`) fork the evaluation: every value of a small modulus, every window
//! between the boundaries of the interval map the result is looked up in, or, for a larger
//! modulus looked up as the last field of a hash map's key, every value the map has a key for
//! (and one branch for all the values it has none for), each with its share of the modulus. A
//! connection's `jhash` (affinity) forks the same way, once per seed and modulus, over the
//! boundaries of every map its chain looks it up in; later hashes of the branch with the same
//! seed and modulus reuse the value, and hashes of different seeds are independent. Branches
//! that end alike merge, so a chain of 16 `numgen` rules costs the sum of their moduli, not
//! their product. A rule that starts by looking a known hash up in a set where it is not (an
//! affinity slot's record, a slot group's gate) is skipped without running, through an index
//! of the chain's rules by hash value, so a chain of thousands of such rules costs each branch
//! the rules that can match it. Anything the interpreter does not model ends the branch as
//! [`ChainEnd::Unknown`] naming the expression, chain and rule: it never guesses.

use std::cell::RefCell;
use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::rc::Rc;

use crate::net::IpFamily;
use crate::nft::wire::consts::*;
use crate::nft::wire::{
    LowExpr, PayloadBase, WireData, WireKey, WireSet, WireTable, address_bytes, address_from_bytes, udata,
};

/// Moduli up to this are forked value by value; larger ones by the windows of the map.
const ENUMERATED_MODULUS: u32 = 256;
/// The kernel's `NFT_JUMP_STACK_SIZE`.
const JUMP_STACK: usize = 16;
/// Register file: 16 words of 32 bits (`NFT_REG32_00` … `NFT_REG32_15`).
const REGISTER_BYTES: usize = 64;

/// The connection being explained, as its packet looks at the current hook.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Packet {
    pub family: IpFamily,
    pub saddr: IpAddr,
    pub daddr: IpAddr,
    pub sport: u16,
    pub dport: u16,
    /// IANA protocol number.
    pub proto: u8,
    pub mark: u32,
    /// The input interface: `Some("")` where there is none (output), `None` when not known.
    pub iif: Option<String>,
}

/// What the interpreter needs from the machine around the packet.
pub trait Surroundings {
    /// Whether `address` is one of this node's (`fib … type local`).
    fn is_local(&self, address: IpAddr) -> bool;
}

/// One matched rule on the packet's way.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Step {
    /// `prerouting`, `input`, `forward`, `output`, `postrouting`.
    pub hook: &'static str,
    pub chain: String,
    /// 1-based rule number in its chain; 0 for the chain's policy.
    pub rule: usize,
    /// The rule's comment.
    pub comment: Option<String>,
    /// Map and set elements the rule matched: (set, element comment).
    pub elements: Vec<(String, Option<String>)>,
    /// What the rule did, in nft words (`jump services`, `dnat to 10.0.0.1:80`).
    pub action: String,
}

/// The state that travels with one branch of the evaluation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Flow {
    pub packet: Packet,
    /// The hook being evaluated (for the path).
    pub hook: &'static str,
    /// Whether the connection was DNATed (`ct status dnat`).
    pub dnatted: bool,
    /// A DNAT set up at the current hook, applied once its chain is done.
    pub dnat: Option<(IpAddr, Option<u16>)>,
    pub masquerade: bool,
    pub path: Vec<Step>,
    /// Affinity sets the connection would be added to, with the key (`@set { client . slot }`).
    pub affinity_updates: Vec<String>,
    /// The `jhash` choices this branch made, as (seed, modulus, value): every later `jhash` of
    /// the same seed and modulus is the same hash of the same connection, so it reuses it.
    pub hashes: Vec<(u32, u32, u32)>,
    /// Things the reader should know (affinity evaluated as a first connection, …).
    pub notes: Vec<String>,
}

/// How a chain (or a whole evaluation) ended for one branch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ChainEnd {
    /// Fell off the end or `return`: back to the caller (the policy, for a base chain).
    Return,
    Accept,
    /// `drop` or `reject`.
    Drop {
        reject: bool,
    },
    /// An expression, chain or set the interpreter cannot evaluate.
    Unknown(String),
}

/// One branch: its share of connections, its state and how it ended.
pub type Branch = (f64, Flow, ChainEnd);

/// How one rule ended.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum RuleEnd {
    /// An expression did not match (`NFT_BREAK`).
    NoMatch,
    /// Every expression ran without a verdict (`NFT_CONTINUE`).
    Continue,
    Verdict(i32, Option<String>),
    Unknown(String),
}

/// The register file of one rule evaluation.
#[derive(Debug, Clone)]
struct Registers {
    verdict: Option<(i32, Option<String>)>,
    data: [u8; REGISTER_BYTES],
}

/// Byte offset of a data register (`NFT_REG_1`…`4` are 16 bytes wide, `NFT_REG32_xx` 4).
fn register_offset(reg: u32) -> Option<usize> {
    let offset = match reg {
        1..=4 => (reg - 1) * 16,
        8..=23 => (reg - 8) * 4,
        _ => return None,
    };
    usize::try_from(offset).ok()
}

impl Registers {
    fn new() -> Registers {
        Registers { verdict: None, data: [0; REGISTER_BYTES] }
    }

    fn read(&self, reg: u32, len: usize) -> Option<&[u8]> {
        let start = register_offset(reg)?;
        self.data.get(start..start + len)
    }

    /// Stores `bytes` and zeroes the rest of the last word, as the kernel's loads do.
    fn write(&mut self, reg: u32, bytes: &[u8]) -> Option<()> {
        let start = register_offset(reg)?;
        let padded = bytes.len().div_ceil(4) * 4;
        let slot = self.data.get_mut(start..start + padded)?;
        slot.fill(0);
        slot[..bytes.len()].copy_from_slice(bytes);
        Some(())
    }
}

/// `ip:port`, IPv6 in brackets.
pub fn socket_text(address: IpAddr, port: Option<u16>) -> String {
    match (address, port) {
        (IpAddr::V6(a), Some(p)) => format!("[{a}]:{p}"),
        (a, Some(p)) => format!("{a}:{p}"),
        (a, None) => a.to_string(),
    }
}

fn verdict_text(code: i32, chain: Option<&str>) -> String {
    match (code, chain) {
        (VERDICT_ACCEPT, _) => "accept".into(),
        (VERDICT_DROP, _) => "drop".into(),
        (VERDICT_RETURN, _) => "return".into(),
        (VERDICT_JUMP, Some(c)) => format!("jump {c}"),
        (VERDICT_GOTO, Some(c)) => format!("goto {c}"),
        (code, _) => format!("verdict {code}"),
    }
}

/// The comment of a userdata blob.
pub fn comment_of(userdata: Option<&[u8]>, kind: u8) -> Option<String> {
    userdata.and_then(|u| udata::find_comment(u, kind))
}

/// The element a key selects: the exact key, or for an interval set the range holding it.
fn find_element<'s>(set: &'s WireSet, key: &[u8]) -> Option<(&'s WireKey, &'s crate::nft::wire::WireElement)> {
    if set.spec.is_interval() {
        // The greatest boundary at or below the key: inside a range when it is a start.
        let (k, e) = set.elements.last_at_or_below(&WireKey::new(key))?;
        (!k.interval_end && k.bytes.len() == key.len()).then_some((k, e))
    } else {
        set.elements.get_key_value(&WireKey::new(key))
    }
}

/// The boundaries an interval set has strictly inside `[lo, lo + width)` (its 4-byte,
/// big-endian keys), relative to `lo`.
fn inner_bounds(set: &WireSet, lo: u32, width: u32) -> impl Iterator<Item = u64> + '_ {
    let (start, end) = (u64::from(lo), u64::from(lo) + u64::from(width));
    // Keys from lo + 1 (an end key sorts before a start of the same bytes) up to, not
    // including, lo + width.
    let first = WireKey::end(&lo.saturating_add(1).to_be_bytes());
    let last = u32::try_from(end).map(|e| WireKey::end(&e.to_be_bytes()));
    let keys: Box<dyn Iterator<Item = &WireKey>> = match last {
        Ok(last) => Box::new(set.elements.range(first..last).map(|(k, _)| k)),
        Err(_) => Box::new(set.elements.range(first..).map(|(k, _)| k)),
    };
    keys.filter_map(|k| <[u8; 4]>::try_from(k.bytes.as_slice()).ok())
        .map(|b| u64::from(u32::from_be_bytes(b)))
        .filter(move |v| *v > start && *v < end)
        .map(move |v| v - start)
}

/// The ranges an interval set has over `[lo, lo + width)`, relative to `lo`: `(first, end)`,
/// `end` excluded.
fn ranges_within(set: &WireSet, lo: u32, width: u32) -> Vec<(u64, u64)> {
    let (start, end) = (u64::from(lo), u64::from(lo) + u64::from(width));
    let mut out = Vec::new();
    // Inside a range at `lo` when the greatest boundary at or below it is a range's start.
    let mut open = set
        .elements
        .last_at_or_below(&WireKey::new(&lo.to_be_bytes()))
        .is_some_and(|(k, _)| !k.interval_end)
        .then_some(0);
    let bounds = set.elements.range(WireKey::end(&lo.saturating_add(1).to_be_bytes())..).map(|(k, _)| k);
    for key in bounds {
        let Ok(bytes) = <[u8; 4]>::try_from(key.bytes.as_slice()) else { continue };
        let v = u64::from(u32::from_be_bytes(bytes));
        if v >= end {
            break;
        }
        match (key.interval_end, open) {
            (true, Some(first)) => {
                out.push((first, v - start));
                open = None;
            }
            (false, None) => open = Some(v - start),
            _ => {}
        }
    }
    if let Some(first) = open {
        out.push((first, end - start));
    }
    out
}

/// One value per window between `bounds` (relative, inside `0..width`), `base` added, with the
/// window's share of `width`.
fn shares(mut bounds: Vec<u64>, width: u32, base: u32) -> Vec<(u32, f64)> {
    bounds.extend([0, u64::from(width)]);
    bounds.sort_unstable();
    bounds.dedup();
    let total = f64::from(width.max(1));
    bounds
        .windows(2)
        .filter_map(|w| Some((base.checked_add(u32::try_from(w[0]).ok()?)?, (w[1] - w[0]) as f64 / total)))
        .collect()
}

/// A hash of a connection, as rules compute it: (seed, modulus).
type HashKey = (u32, u32);

/// The values a hash of one key can take, split where any lookup of the chain changes its
/// answer: each part's first value and its share of the modulus.
type Atoms = Rc<Vec<(u32, f64)>>;

/// The maps a chain's rules look each hash key up in, at which offsets.
type HashLookups = HashMap<HashKey, Vec<(String, u32)>>;

/// A rule's leading `jhash … @set` (a set lookup, not inverted) before anything that acts: the
/// rule does nothing for a connection whose hash is not in the set there.
#[derive(Debug, Clone)]
struct Guard {
    key: HashKey,
    offset: u32,
    set: String,
}

/// A chain's rules indexed by the hash values that can get past their guards.
#[derive(Debug, Default)]
struct ChainIndex {
    len: usize,
    /// Rules without a guard, ascending.
    unguarded: Vec<usize>,
    /// Per hash key some rule has a guard of: the rules, and which values each lets through.
    guarded: Vec<Guarded>,
    /// Per rule, its guards' keys (indexes into `guarded`; the first guard of each key).
    keys: Vec<Vec<usize>>,
}

#[derive(Debug, Default)]
struct Guarded {
    key: HashKey,
    /// Rules whose first guard has this key, ascending.
    first: Vec<usize>,
    /// Runs of consecutive rules with a guard of this key: `(first, end)`, end excluded.
    runs: Vec<(usize, usize)>,
    /// Part starts of the key's atoms, ascending.
    starts: Vec<u32>,
    /// Per part: every rule with a guard of this key that lets it through, ascending.
    passing: Vec<Vec<usize>>,
}

impl Guarded {
    fn part(&self, value: u32) -> &[usize] {
        let i = self.starts.partition_point(|s| *s <= value).checked_sub(1);
        i.and_then(|i| self.passing.get(i)).map(Vec::as_slice).unwrap_or_default()
    }

    /// The end of the run of rules with a guard of this key that holds `rule`.
    fn run_end(&self, rule: usize) -> usize {
        let i = self.runs.partition_point(|(first, _)| *first <= rule);
        i.checked_sub(1).map_or(rule + 1, |i| self.runs[i].1.max(rule + 1))
    }
}

/// The first of `sorted` at or after `from`.
fn first_from(sorted: &[usize], from: usize) -> Option<usize> {
    sorted.get(sorted.partition_point(|r| *r < from)).copied()
}

impl ChainIndex {
    /// The next rule at or after `from` that can act for a branch with these hash values: one
    /// without a guard, or whose every guard of a known key lets the value through (a guard of
    /// an unknown key forks the branch when it runs).
    fn next(&self, from: usize, hashes: &[(u32, u32, u32)]) -> Option<usize> {
        if self.guarded.is_empty() {
            return (from < self.len).then_some(from);
        }
        let values: Vec<Option<u32>> = self
            .guarded
            .iter()
            .map(|g| hashes.iter().find(|(s, m, _)| (*s, *m) == g.key).map(|(_, _, v)| *v))
            .collect();
        let mut from = from;
        loop {
            // The earliest candidate: a rule without a guard, or one whose first guard lets the
            // value through (or has no value yet).
            let mut best = first_from(&self.unguarded, from);
            for (guarded, value) in self.guarded.iter().zip(&values) {
                let candidates = match value {
                    Some(v) => guarded.part(*v),
                    None => &guarded.first,
                };
                if let Some(r) = first_from(candidates, from) {
                    best = Some(best.map_or(r, |b| b.min(r)));
                }
            }
            let rule = best?;
            // Its other guards: the first that stops the value skips the rules after it that
            // have a guard of the same key, up to the next that lets the value through.
            let stopped = self.keys[rule].iter().find_map(|k| {
                let (guarded, v) = (&self.guarded[*k], values[*k]?);
                let part = guarded.part(v);
                part.binary_search(&rule).is_err().then(|| {
                    let passing = first_from(part, rule + 1).unwrap_or(self.len);
                    passing.min(guarded.run_end(rule))
                })
            });
            match stopped {
                None => return Some(rule),
                Some(next) => from = next.max(rule + 1),
            }
        }
    }
}

/// Sums the shares of items that are alike, in the order they first appear.
fn merged<E: Hash + Eq>(items: Vec<(f64, Flow, E)>) -> Vec<(f64, Flow, E)> {
    if items.len() < 2 {
        return items;
    }
    let mut out: Vec<(f64, Flow, E)> = Vec::with_capacity(items.len());
    let mut seen: HashMap<u64, Vec<usize>> = HashMap::new();
    for (w, f, e) in items {
        let mut h = DefaultHasher::new();
        f.hash(&mut h);
        e.hash(&mut h);
        let bucket = seen.entry(h.finish()).or_default();
        match bucket.iter().find(|i| out[**i].1 == f && out[**i].2 == e) {
            Some(i) => out[*i].0 += w,
            None => {
                bucket.push(out.len());
                out.push((w, f, e));
            }
        }
    }
    out
}

/// The interpreter over one table.
pub struct Evaluator<'a> {
    table: &'a WireTable,
    surroundings: &'a dyn Surroundings,
    /// Per chain and hash key, the hash's parts (computed once).
    atoms: RefCell<HashMap<(String, HashKey), Atoms>>,
    /// Per chain, the maps its rules look each hash key up in, at which offsets.
    hash_lookups: RefCell<HashMap<String, HashLookups>>,
    /// Per chain, its rules by guard (built once).
    indexes: RefCell<HashMap<String, Rc<ChainIndex>>>,
}

impl<'a> Evaluator<'a> {
    /// An interpreter of `table`'s chains.
    pub fn new(table: &'a WireTable, surroundings: &'a dyn Surroundings) -> Evaluator<'a> {
        Evaluator {
            table,
            surroundings,
            atoms: RefCell::default(),
            hash_lookups: RefCell::default(),
            indexes: RefCell::default(),
        }
    }

    /// The guards of a rule: its leading `jhash … @set` lookups, before anything but loads,
    /// comparisons and other guards.
    fn guards(exprs: &[LowExpr]) -> Vec<Guard> {
        let mut out = Vec::new();
        let mut i = 0;
        while let Some(expr) = exprs.get(i) {
            match (expr, exprs.get(i + 1), exprs.get(i + 2)) {
                (
                    LowExpr::Hash { dreg, modulus, seed, offset, .. },
                    Some(LowExpr::Byteorder { sreg: b_in, dreg: b_out, .. }),
                    Some(LowExpr::Lookup { sreg, dreg: None, set, flags: 0 }),
                ) if b_in == dreg && sreg == b_out => {
                    out.push(Guard { key: (*seed, *modulus), offset: *offset, set: set.clone() });
                    i += 3;
                }
                (LowExpr::Payload { .. } | LowExpr::Meta { .. } | LowExpr::Cmp { .. }, _, _) => i += 1,
                _ => break,
            }
        }
        out
    }

    /// The index of `name`'s rules by guard.
    fn chain_index(&self, name: &str) -> Rc<ChainIndex> {
        if let Some(index) = self.indexes.borrow().get(name) {
            return Rc::clone(index);
        }
        let rules = self.table.chains.get(name).map(|c| c.rules.as_slice()).unwrap_or_default();
        let mut index = ChainIndex { len: rules.len(), ..ChainIndex::default() };
        let mut slot: HashMap<HashKey, usize> = HashMap::new();
        for (r, rule) in rules.iter().enumerate() {
            // Only guards on interval sets of 4-byte keys are indexed (the others just run).
            let mut keys: Vec<usize> = Vec::new();
            for guard in Self::guards(&rule.exprs) {
                let Some(set) = self.table.sets.get(&guard.set) else { continue };
                if !set.spec.is_interval() || set.spec.key_len != 4 || set.dynamic {
                    continue;
                }
                let k = *slot.entry(guard.key).or_insert_with(|| {
                    let atoms = self.hash_choices(name, guard.key.0, guard.key.1);
                    let starts: Vec<u32> = atoms.iter().map(|(v, _)| *v).collect();
                    let passing = vec![Vec::new(); starts.len()];
                    index.guarded.push(Guarded { key: guard.key, starts, passing, ..Guarded::default() });
                    index.guarded.len() - 1
                });
                if keys.contains(&k) {
                    continue;
                }
                let guarded = &mut index.guarded[k];
                if keys.is_empty() {
                    guarded.first.push(r);
                }
                match guarded.runs.last_mut() {
                    Some(run) if run.1 == r => run.1 = r + 1,
                    _ => guarded.runs.push((r, r + 1)),
                }
                // The parts this guard lets through: those whose values fall in a range of the
                // set (every value of a part is alike for every lookup of the key).
                for (lo, hi) in ranges_within(set, guard.offset, guard.key.1) {
                    let first = guarded.starts.partition_point(|s| u64::from(*s) < lo);
                    let end = guarded.starts.partition_point(|s| u64::from(*s) < hi);
                    for part in &mut guarded.passing[first..end] {
                        part.push(r);
                    }
                }
                keys.push(k);
            }
            if keys.is_empty() {
                index.unguarded.push(r);
            }
            index.keys.push(keys);
        }
        let index = Rc::new(index);
        self.indexes.borrow_mut().insert(name.to_string(), Rc::clone(&index));
        index
    }

    /// Runs a chain from its first rule; a base chain's policy applies when it returns.
    pub fn chain(&self, flow: Flow, name: &str) -> Vec<Branch> {
        let mut out = Vec::new();
        self.run_chain(1.0, flow, name, 0, 0, &mut out);
        let Some(chain) = self.table.chains.get(name) else { return out };
        if let Some(hook) = &chain.hook {
            for branch in &mut out {
                if branch.2 == ChainEnd::Return {
                    branch.2 =
                        if hook.policy == POLICY_ACCEPT { ChainEnd::Accept } else { ChainEnd::Drop { reject: false } };
                }
            }
        }
        merge(out)
    }

    /// Runs `name` from rule index `start`, pushing every branch's end to `out`.
    fn run_chain(&self, weight: f64, mut flow: Flow, name: &str, start: usize, depth: usize, out: &mut Vec<Branch>) {
        if !self.table.chains.contains_key(name) {
            out.push((weight, flow, ChainEnd::Unknown(format!("chain {name} is not in table {}", self.table.name))));
            return;
        }
        if depth > JUMP_STACK {
            out.push((weight, flow, ChainEnd::Unknown(format!("more than {JUMP_STACK} nested jumps at chain {name}"))));
            return;
        }
        let rules = self.chain_index(name);
        let mut next = start;
        while let Some(index) = rules.next(next, &flow.hashes) {
            next = index + 1;
            let mut results = self.rule(flow.clone(), name, index);
            // Most rules do not fork: carry on in this loop rather than recursing.
            // A whole share (the forks of a `numgen` all ending alike sum to it, give or take
            // rounding).
            if results.len() == 1
                && matches!(results[0].2, RuleEnd::NoMatch | RuleEnd::Continue)
                && (results[0].0 - 1.0).abs() < 1e-9
            {
                flow = results.remove(0).1;
                continue;
            }
            for (share, next, end) in results {
                let weight = weight * share;
                match end {
                    RuleEnd::NoMatch | RuleEnd::Continue => self.run_chain(weight, next, name, index + 1, depth, out),
                    RuleEnd::Unknown(why) => out.push((weight, next, ChainEnd::Unknown(why))),
                    RuleEnd::Verdict(code, target) => match (code, target) {
                        (VERDICT_ACCEPT, _) => out.push((weight, next, ChainEnd::Accept)),
                        (VERDICT_DROP, target) => {
                            let reject = target.as_deref() == Some(REJECTED);
                            out.push((weight, next, ChainEnd::Drop { reject }))
                        }
                        (VERDICT_RETURN, _) => out.push((weight, next, ChainEnd::Return)),
                        (VERDICT_JUMP, Some(target)) => {
                            let mut called = Vec::new();
                            self.run_chain(weight, next, &target, 0, depth + 1, &mut called);
                            for (w, f, end) in merge(called) {
                                match end {
                                    ChainEnd::Return => self.run_chain(w, f, name, index + 1, depth, out),
                                    end @ (ChainEnd::Accept | ChainEnd::Drop { .. } | ChainEnd::Unknown(_)) => {
                                        out.push((w, f, end))
                                    }
                                }
                            }
                        }
                        // The target's return goes to this chain's caller.
                        (VERDICT_GOTO, Some(target)) => self.run_chain(weight, next, &target, 0, depth + 1, out),
                        (code, _) => out.push((
                            weight,
                            next,
                            ChainEnd::Unknown(format!("verdict code {code} in chain {name} rule {}", index + 1)),
                        )),
                    },
                }
            }
            return;
        }
        out.push((weight, flow, ChainEnd::Return));
    }

    /// Evaluates rule `index` of chain `chain`: every fork of it, alike ones merged.
    fn rule(&self, flow: Flow, chain: &str, index: usize) -> Vec<(f64, Flow, RuleEnd)> {
        let Some(rule) = self.table.chains.get(chain).and_then(|c| c.rules.get(index)) else {
            return vec![(1.0, flow, RuleEnd::Unknown(format!("no rule {} in chain {chain}", index + 1)))];
        };
        let step = Step {
            hook: flow.hook,
            chain: chain.to_string(),
            rule: index + 1,
            comment: comment_of(rule.userdata.as_deref(), udata::COMMENT),
            elements: Vec::new(),
            action: String::new(),
        };
        let mut out = Vec::new();
        let at = Position { chain, rule: index + 1 };
        self.exprs(&rule.exprs, 0, Registers::new(), flow, step, 1.0, at, &mut out);
        merged(out)
    }

    /// Runs `exprs[i..]`; pushes each fork's end to `out`.
    #[allow(clippy::too_many_arguments)]
    fn exprs(
        &self,
        exprs: &[LowExpr],
        mut i: usize,
        mut regs: Registers,
        mut flow: Flow,
        mut step: Step,
        weight: f64,
        at: Position<'_>,
        out: &mut Vec<(f64, Flow, RuleEnd)>,
    ) {
        let unknown =
            |what: String| RuleEnd::Unknown(format!("cannot evaluate {what} in chain {} rule {}", at.chain, at.rule));
        while let Some(expr) = exprs.get(i) {
            i += 1;
            let outcome = match expr {
                // `numgen inc mod 1` is always 0: the key is the offset.
                LowExpr::Numgen { dreg, modulus: 1, kind: NG_INCREMENTAL, offset } => regs
                    .write(*dreg, &offset.to_ne_bytes())
                    .map_or_else(|| Err(unknown(format!("{expr:?}"))), |()| Ok(None)),
                LowExpr::Hash { dreg, modulus, seed, offset, .. } => {
                    let known = flow.hashes.iter().find(|(s, m, _)| s == seed && m == modulus).map(|(_, _, v)| *v);
                    if let Some(value) = known {
                        regs.write(*dreg, &value.wrapping_add(*offset).to_ne_bytes())
                            .map_or_else(|| Err(unknown(format!("{expr:?}"))), |()| Ok(None))
                    } else {
                        let share = format!("jhash mod {modulus}");
                        for &(value, part) in self.hash_choices(at.chain, *seed, *modulus).iter() {
                            let mut r = regs.clone();
                            if r.write(*dreg, &value.wrapping_add(*offset).to_ne_bytes()).is_none() {
                                out.push((weight, flow.clone(), unknown(format!("{expr:?}"))));
                                return;
                            }
                            let mut f = flow.clone();
                            f.hashes.push((*seed, *modulus, value));
                            let mut s = step.clone();
                            if !s.action.contains(&share) {
                                s.action = append(&s.action, &share);
                            }
                            self.exprs(exprs, i, r, f, s, weight * part, at, out);
                        }
                        return;
                    }
                }
                LowExpr::Numgen { dreg, modulus, kind, offset } => {
                    if *kind != NG_RANDOM || *modulus == 0 {
                        Err(unknown(format!("{expr:?}")))
                    } else {
                        match self.numgen_choices(*modulus, *offset, *dreg, &exprs[i..], &regs) {
                            Some(choices) => {
                                let share = match offset {
                                    0 => format!("numgen random mod {modulus}"),
                                    o => format!("numgen random mod {modulus} offset {o}"),
                                };
                                for (value, part) in choices {
                                    let mut r = regs.clone();
                                    if r.write(*dreg, &value.to_ne_bytes()).is_none() {
                                        out.push((weight, flow.clone(), unknown(format!("{expr:?}"))));
                                        return;
                                    }
                                    let mut s = step.clone();
                                    if !s.action.contains(&share) {
                                        s.action = append(&s.action, &share);
                                    }
                                    self.exprs(exprs, i, r, flow.clone(), s, weight * part, at, out);
                                }
                                return;
                            }
                            None => Err(unknown(format!(
                                "numgen random mod {modulus} (not followed by a lookup in an interval map, or in a map keyed by it)"
                            ))),
                        }
                    }
                }
                other => self.expr(other, &mut regs, &mut flow, &mut step),
            };
            match outcome {
                Ok(None) => {}
                Ok(Some(end)) => {
                    let end = match end {
                        RuleEnd::Unknown(what) => unknown(what),
                        e @ (RuleEnd::NoMatch | RuleEnd::Continue | RuleEnd::Verdict(..)) => e,
                    };
                    if end != RuleEnd::NoMatch {
                        flow.path.push(step);
                    }
                    out.push((weight, flow, end));
                    return;
                }
                Err(end) => {
                    out.push((weight, flow, end));
                    return;
                }
            }
            if regs.verdict.is_some() {
                break;
            }
        }
        let end = match regs.verdict.take() {
            Some((code, chain)) => {
                step.action = append(&step.action, &verdict_text(code, chain.as_deref()));
                RuleEnd::Verdict(code, chain)
            }
            None => RuleEnd::Continue,
        };
        flow.path.push(step);
        out.push((weight, flow, end));
    }

    /// The values a connection's `jhash` (of this seed and modulus) is forked over, with their
    /// shares: one per window between the boundaries of every interval map a rule of `chain`
    /// looks such a hash up in, each boundary taken relative to its rule's offset (the record
    /// rules of affinity slots and the choice split the hash alike). Computed once per chain
    /// and key.
    fn hash_choices(&self, chain: &str, seed: u32, modulus: u32) -> Atoms {
        let key = (chain.to_string(), (seed, modulus));
        if let Some(atoms) = self.atoms.borrow().get(&key) {
            return Rc::clone(atoms);
        }
        if !self.hash_lookups.borrow().contains_key(chain) {
            // Every rule's hash lookups, by key, each (map, offset) once: a slot group's gate is
            // in every record of the group.
            let mut lookups = HashLookups::new();
            let rules = self.table.chains.get(chain).map(|c| c.rules.as_slice()).unwrap_or_default();
            for rule in rules {
                for triple in rule.exprs.windows(3) {
                    let [
                        LowExpr::Hash { modulus: m, seed: s, offset, .. },
                        LowExpr::Byteorder { .. },
                        LowExpr::Lookup { set, .. },
                    ] = triple
                    else {
                        continue;
                    };
                    lookups.entry((*s, *m)).or_default().push((set.clone(), *offset));
                }
            }
            for list in lookups.values_mut() {
                list.sort_unstable();
                list.dedup();
            }
            self.hash_lookups.borrow_mut().insert(chain.to_string(), lookups);
        }
        let mut bounds: Vec<u64> = Vec::new();
        if let Some(lookups) = self.hash_lookups.borrow().get(chain).and_then(|l| l.get(&(seed, modulus))) {
            for (set, offset) in lookups {
                if let Some(set) = self.table.sets.get(set).filter(|s| s.spec.is_interval()) {
                    bounds.extend(inner_bounds(set, *offset, modulus));
                }
            }
        }
        let atoms = Rc::new(shares(bounds, modulus, 0));
        self.atoms.borrow_mut().insert(key, Rc::clone(&atoms));
        atoms
    }

    /// The values a `numgen` result is forked over, with their shares: every value of a small
    /// modulus; for a large one, one value per window between the boundaries of the interval
    /// map the rule looks the result up in (all values of a window select the same element),
    /// or, when the result is a field of the key of a map looked up right after it (the other
    /// fields already in the registers), each value the map has a key for and one value for
    /// all the others (which select nothing).
    fn numgen_choices(
        &self,
        modulus: u32,
        offset: u32,
        dreg: u32,
        rest: &[LowExpr],
        regs: &Registers,
    ) -> Option<Vec<(u32, f64)>> {
        let total = f64::from(modulus);
        if modulus <= ENUMERATED_MODULUS {
            return Some((0..modulus).map(|v| (offset.wrapping_add(v), 1.0 / total)).collect());
        }
        let set = rest.iter().find_map(|e| match e {
            LowExpr::Lookup { set, .. } => Some(set),
            _ => None,
        })?;
        let set = self.table.sets.get(set)?;
        if set.spec.is_interval() && set.spec.key_len == 4 {
            return Some(shares(inner_bounds(set, offset, modulus).collect(), modulus, offset));
        }
        // A hash map keyed by fields then the result: the lookup must come next, so that nothing
        // changes the registers in between.
        let Some(LowExpr::Lookup { sreg, .. }) = rest.first() else { return None };
        if set.spec.is_interval() || set.dynamic {
            return None;
        }
        let key_len = set.spec.key_len as usize;
        let hole = register_offset(dreg)?.checked_sub(register_offset(*sreg)?)?;
        if hole + 4 > key_len {
            return None;
        }
        let template = regs.read(*sreg, key_len)?;
        let prefix = &template[..hole];
        let mut hits: Vec<u32> = set
            .elements
            .range(WireKey::new(prefix)..)
            .map(|(k, _)| k)
            .take_while(|k| k.bytes.starts_with(prefix))
            .filter(|k| k.bytes.len() == key_len && k.bytes[hole + 4..] == template[hole + 4..])
            .filter_map(|k| <[u8; 4]>::try_from(&k.bytes[hole..hole + 4]).ok())
            .map(|b| u32::from_ne_bytes(b).wrapping_sub(offset))
            .filter(|v| *v < modulus)
            .collect();
        hits.sort_unstable();
        hits.dedup();
        let share = 1.0 / total;
        let mut out: Vec<(u32, f64)> = hits.iter().map(|v| (offset.wrapping_add(*v), share)).collect();
        let missed = modulus - u32::try_from(hits.len()).unwrap_or(modulus);
        if missed > 0 {
            // The first value without a key stands for all of them.
            let free = (0..modulus).find(|v| hits.binary_search(v).is_err())?;
            out.push((offset.wrapping_add(free), f64::from(missed) / total));
        }
        Some(out)
    }

    /// Runs one expression. `Ok(None)`: go on; `Ok(Some(end))`: the rule ends.
    fn expr(
        &self,
        expr: &LowExpr,
        regs: &mut Registers,
        flow: &mut Flow,
        step: &mut Step,
    ) -> Result<Option<RuleEnd>, RuleEnd> {
        let unknown = |what: String| Ok(Some(RuleEnd::Unknown(what)));
        let cannot = || unknown(format!("{expr:?}"));
        let p = &flow.packet;
        match expr {
            LowExpr::Payload { base, offset, len, dreg } => {
                let field = match (base, p.family, offset, len) {
                    (PayloadBase::Network, IpFamily::V4, 12, l @ 1..=4) => {
                        address_bytes(&p.saddr)[..*l as usize].to_vec()
                    }
                    (PayloadBase::Network, IpFamily::V4, 16, l @ 1..=4) => {
                        address_bytes(&p.daddr)[..*l as usize].to_vec()
                    }
                    (PayloadBase::Network, IpFamily::V6, 8, l @ 1..=16) => {
                        address_bytes(&p.saddr)[..*l as usize].to_vec()
                    }
                    (PayloadBase::Network, IpFamily::V6, 24, l @ 1..=16) => {
                        address_bytes(&p.daddr)[..*l as usize].to_vec()
                    }
                    (PayloadBase::Transport, _, 0, 2) => p.sport.to_be_bytes().to_vec(),
                    (PayloadBase::Transport, _, 2, 2) => p.dport.to_be_bytes().to_vec(),
                    _ => return cannot(),
                };
                if regs.write(*dreg, &field).is_none() {
                    return cannot();
                }
            }
            LowExpr::Meta { key, dreg } => {
                let value = match *key {
                    META_L4PROTO => vec![p.proto],
                    META_MARK => p.mark.to_ne_bytes().to_vec(),
                    META_IIFNAME => match &p.iif {
                        Some(name) => {
                            let mut b = name.as_bytes().to_vec();
                            b.resize(16, 0);
                            b
                        }
                        None => return unknown("meta iifname: the input interface is not known (give --iif)".into()),
                    },
                    _ => return cannot(),
                };
                if regs.write(*dreg, &value).is_none() {
                    return cannot();
                }
            }
            LowExpr::MetaSet { key: META_MARK, sreg } => {
                let Some(bytes) = regs.read(*sreg, 4).and_then(|b| <[u8; 4]>::try_from(b).ok()) else {
                    return cannot();
                };
                let mark = u32::from_ne_bytes(bytes);
                step.action = append(&step.action, &format!("meta mark set {mark:#010x}"));
                flow.packet.mark = mark;
            }
            LowExpr::Cmp { sreg, op, data } => {
                let Some(value) = regs.read(*sreg, data.len()) else { return cannot() };
                let equal = value == data.as_slice();
                let matched = match *op {
                    CMP_EQ => equal,
                    CMP_NEQ => !equal,
                    _ => return cannot(),
                };
                if !matched {
                    return Ok(Some(RuleEnd::NoMatch));
                }
            }
            LowExpr::Bitwise { sreg, dreg, len, mask, xor } => {
                let len = *len as usize;
                if mask.len() != len || xor.len() != len {
                    return cannot();
                }
                let Some(value) = regs.read(*sreg, len) else { return cannot() };
                let result: Vec<u8> = value.iter().zip(mask).zip(xor).map(|((v, m), x)| (v & m) ^ x).collect();
                if regs.write(*dreg, &result).is_none() {
                    return cannot();
                }
            }
            LowExpr::Lookup { sreg, dreg, set, flags } => {
                return self.lookup(*sreg, *dreg, set, *flags, regs, flow, step);
            }
            LowExpr::Verdict { code, chain } => regs.verdict = Some((*code, chain.clone())),
            LowExpr::Immediate { dreg, data } => {
                if *dreg == REG_VERDICT || regs.write(*dreg, data).is_none() {
                    return cannot();
                }
            }
            LowExpr::Byteorder { sreg, dreg, op, len, size } => {
                let (len, size) = (*len as usize, *size as usize);
                if ![2, 4, 8].contains(&size) || len % size != 0 {
                    return cannot();
                }
                let Some(value) = regs.read(*sreg, len) else { return cannot() };
                // Host order is little-endian on every machine nftproxy supports; both
                // directions swap each word.
                let _ = op;
                let swapped: Vec<u8> = value
                    .chunks(size)
                    .flat_map(|c| {
                        let mut c = c.to_vec();
                        if cfg!(target_endian = "little") {
                            c.reverse();
                        }
                        c
                    })
                    .collect();
                if regs.write(*dreg, &swapped).is_none() {
                    return cannot();
                }
            }
            LowExpr::Fib { dreg, result: FIB_RESULT_ADDRTYPE, flags } => {
                let address = match *flags {
                    FIB_F_SADDR => p.saddr,
                    FIB_F_DADDR => p.daddr,
                    _ => return cannot(),
                };
                // RTN_UNICAST (1) for anything not local: nftproxy only asks "local or not".
                let kind: u32 = if self.surroundings.is_local(address) { RTN_LOCAL } else { 1 };
                if regs.write(*dreg, &kind.to_ne_bytes()).is_none() {
                    return cannot();
                }
            }
            LowExpr::Ct { key, dreg } => {
                let bits = match *key {
                    // The first packet of a new connection.
                    CT_STATE => CT_STATE_NEW,
                    CT_STATUS => {
                        if flow.dnatted {
                            CT_STATUS_DNAT
                        } else {
                            0
                        }
                    }
                    _ => return cannot(),
                };
                if regs.write(*dreg, &bits.to_ne_bytes()).is_none() {
                    return cannot();
                }
            }
            LowExpr::Dynset { op: DYNSET_OP_UPDATE, sreg_key, set, timeout_ms: _ } => {
                let Some(spec) = self.table.sets.get(set) else {
                    return unknown(format!("set {set} is not in table {}", self.table.name));
                };
                let Some(key) = regs.read(*sreg_key, spec.spec.key_len as usize) else {
                    return cannot();
                };
                // An affinity set's key: the client, then the slot (a 32-bit word in host order).
                let width = match p.family {
                    IpFamily::V4 => 4,
                    IpFamily::V6 => 16,
                };
                let entry = match (address_from_bytes(&key[..width.min(key.len())]), key.get(width..)) {
                    (Some(client), Some(slot)) if slot.len() == 4 => {
                        let slot = u32::from_ne_bytes([slot[0], slot[1], slot[2], slot[3]]);
                        format!("@{set} {{ {client} . {slot} }}")
                    }
                    _ => format!("@{set}"),
                };
                step.action = append(&step.action, &format!("update {entry}"));
                flow.affinity_updates.push(entry);
            }
            LowExpr::Nat { kind: NAT_DNAT, family, reg_addr, reg_proto, flags: _ } => {
                let width = match *family {
                    2 => 4,
                    10 => 16,
                    _ => return cannot(),
                };
                let Some(address) = reg_addr.and_then(|r| regs.read(r, width)).and_then(address_from_bytes) else {
                    return cannot();
                };
                let port = match reg_proto {
                    Some(r) => match regs.read(*r, 2) {
                        Some(b) => Some(u16::from_be_bytes([b[0], b[1]])),
                        None => return cannot(),
                    },
                    None => None,
                };
                step.action = append(&step.action, &format!("dnat to {}", socket_text(address, port)));
                flow.dnat = Some((address, port));
                regs.verdict = Some((VERDICT_ACCEPT, None));
                return Ok(Some(RuleEnd::Verdict(VERDICT_ACCEPT, None)));
            }
            LowExpr::Masq { .. } => {
                step.action = append(&step.action, "masquerade");
                flow.masquerade = true;
                return Ok(Some(RuleEnd::Verdict(VERDICT_ACCEPT, None)));
            }
            LowExpr::Reject { .. } => {
                step.action = append(&step.action, "reject");
                return Ok(Some(RuleEnd::Verdict(VERDICT_DROP, Some(REJECTED.into()))));
            }
            LowExpr::Foreign(what) => return unknown(format!("a foreign expression ({what})")),
            // Forms nftproxy never writes: another mark key, another `fib` result, another
            // `dynset` operation, SNAT.
            LowExpr::MetaSet { .. } | LowExpr::Fib { .. } | LowExpr::Dynset { .. } | LowExpr::Nat { .. } => {
                return cannot();
            }
            // `exprs` runs these (they fork the evaluation) and never hands them here.
            LowExpr::Numgen { .. } | LowExpr::Hash { .. } => return cannot(),
        }
        Ok(None)
    }

    /// `lookup`: a set match (perhaps inverted), or a map's data into a register or the verdict.
    #[allow(clippy::too_many_arguments)]
    fn lookup(
        &self,
        sreg: u32,
        dreg: Option<u32>,
        name: &str,
        flags: u32,
        regs: &mut Registers,
        flow: &mut Flow,
        step: &mut Step,
    ) -> Result<Option<RuleEnd>, RuleEnd> {
        let Some(set) = self.table.sets.get(name) else {
            return Ok(Some(RuleEnd::Unknown(format!(
                "a lookup in @{name}, which is not in table {}",
                self.table.name
            ))));
        };
        let Some(key) = regs.read(sreg, set.spec.key_len as usize).map(<[u8]>::to_vec) else {
            return Ok(Some(RuleEnd::Unknown(format!("a lookup in @{name} (key of {} bytes)", set.spec.key_len))));
        };
        let found = find_element(set, &key);
        if set.dynamic || set.spec.flags & SET_EVAL != 0 {
            // The kernel fills these (affinity); their elements are not read back.
            let note = format!("@{name} is filled by the kernel: evaluated as a first connection, with no entry");
            if !flow.notes.contains(&note) {
                flow.notes.push(note);
            }
        }
        let inverted = flags & LOOKUP_F_INV != 0;
        match (dreg, found) {
            (None, found) => {
                if found.is_some() == inverted {
                    return Ok(Some(RuleEnd::NoMatch));
                }
                let comment = found.and_then(|(_, e)| comment_of(e.userdata.as_deref(), udata::COMMENT));
                let sign = if inverted { "!= " } else { "" };
                step.elements.push((name.to_string(), comment));
                step.action = append(&step.action, &format!("{sign}@{name}"));
            }
            (Some(_), None) => return Ok(Some(RuleEnd::NoMatch)),
            (Some(dreg), Some((_, element))) => {
                let comment = comment_of(element.userdata.as_deref(), udata::COMMENT);
                step.elements.push((name.to_string(), comment));
                match (&element.data, dreg) {
                    (WireData::Verdict { code, chain }, REG_VERDICT) => {
                        step.action = append(&step.action, &format!("vmap @{name}"));
                        regs.verdict = Some((*code, chain.clone()));
                    }
                    (WireData::Bytes(b), dreg) if dreg != REG_VERDICT => {
                        step.action = append(&step.action, &format!("map @{name}"));
                        if regs.write(dreg, b).is_none() {
                            return Ok(Some(RuleEnd::Unknown(format!("map @{name} data into register {dreg}"))));
                        }
                    }
                    (WireData::None | WireData::Verdict { .. } | WireData::Bytes(_), _) => {
                        return Ok(Some(RuleEnd::Unknown(format!("map @{name}: its data does not fit the rule"))));
                    }
                }
            }
        }
        Ok(None)
    }
}

/// The chain name a reject's verdict carries, to tell it from a plain drop.
pub const REJECTED: &str = "\0reject";

/// Where a rule is (for messages).
#[derive(Debug, Clone, Copy)]
struct Position<'c> {
    chain: &'c str,
    rule: usize,
}

fn append(action: &str, more: &str) -> String {
    if action.is_empty() { more.to_string() } else { format!("{action}, {more}") }
}

/// Sums the shares of branches that ended alike.
pub fn merge(branches: Vec<Branch>) -> Vec<Branch> {
    merged(branches)
}

/// Base chains of a table at `hook` (kernel number), by priority: (name, chain type, priority).
pub fn base_chains(table: &WireTable, hook: u32) -> Vec<(String, String, i32)> {
    let mut chains: BTreeMap<(i32, String), String> = BTreeMap::new();
    for chain in table.chains.values() {
        if let Some(h) = chain.hook.as_ref().filter(|h| h.hooknum == hook) {
            chains.insert((h.priority, chain.name.clone()), h.chain_type.clone());
        }
    }
    chains.into_iter().map(|((p, n), t)| (n, t, p)).collect()
}
