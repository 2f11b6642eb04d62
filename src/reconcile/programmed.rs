//! What nftproxy has programmed: each family's infrastructure, and for every service the part
//! of the cluster state it was planned from (sharing the objects of the live state), with the
//! owners of the shared keys.
//!
//! A service's kernel objects are not stored: planning is deterministic, so they are planned
//! again from the recorded state when needed (with the slot table frozen, so endpoint windows
//! come out where they are). A partial sync plans the old and the new version of each changed
//! service and diffs only those, with the shared elements they touch, so its cost follows the
//! size of the change rather than the size of the cluster, and memory holds no second copy of
//! the ruleset. A full sync plans everything and diffs it with what the kernel holds; both
//! merge in service-name order with the first claim to a shared key winning, exactly as
//! [`crate::plan::plan`] does, so both paths program the same ruleset.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use smallvec::SmallVec;

use crate::model::{NamespacedName, ServiceSnapshot};
use crate::net::IpFamily;
use crate::nft::ast::Owner;
use crate::nft::diff::{Transaction, diff_table};
use crate::nft::lower::lower_table;
use crate::nft::wire::{WireData, WireElement, WireKey, WireSet, WireTable};
use crate::plan::objects::HAIRPIN;
use crate::plan::slots::MapKind;
use crate::plan::{ConntrackTarget, HealthCheck, PlanStats, ServicePlan};

/// One service as programmed.
#[derive(Debug, Clone)]
pub struct ProgrammedService {
    /// The service, its slices and the node, as they were planned.
    pub state: ServiceSnapshot,
    pub health_check: Option<HealthCheck>,
    pub conntrack: Vec<ConntrackTarget>,
    pub stats: PlanStats,
}

/// A service's kernel objects: one partial table per family, in the order of
/// [`Programmed::families`].
pub type Fragments = Vec<WireTable>;

impl ProgrammedService {
    /// Lowers a service's plan: the record to keep, and the kernel objects.
    pub fn lower(plan: ServicePlan, state: ServiceSnapshot) -> (NamespacedName, ProgrammedService, Fragments) {
        let fragments = plan.fragments.iter().map(lower_table).collect();
        let service =
            ProgrammedService { state, health_check: plan.health_check, conntrack: plan.conntrack, stats: plan.stats };
        (plan.service, service, fragments)
    }
}

/// The chains of a service's fragments, by family.
pub fn chains(fragments: &[WireTable]) -> impl Iterator<Item = (IpFamily, &str)> {
    fragments.iter().flat_map(|f| f.chains.keys().map(move |c| (f.family, c.as_str())))
}

/// A key of a shared set that is neither an endpoint map nor `hairpin-endpoints`: family
/// index, the set's index in [`Programmed::claimed_sets`], element key. Small, since a cluster
/// has one per service IP and port.
type SharedKey = (u8, u8, WireKey);

/// Who claims a shared key, in name order: almost always one service (a key claimed twice is
/// conflicting input, and the first claimant wins).
type Claim = SmallVec<[NamespacedName; 1]>;

/// A changed service: its name, what it programmed (planned again), and its new version with
/// its objects (`None`: the service is gone).
pub type Change = (NamespacedName, Fragments, Option<(ProgrammedService, Fragments)>);

/// Plans a programmed service again (with the slot table frozen).
pub type Replan<'a> = dyn FnMut(&NamespacedName, &ProgrammedService) -> Fragments + 'a;

/// The programmed ruleset.
#[derive(Debug, Clone)]
pub struct Programmed {
    families: Vec<IpFamily>,
    infrastructure: Vec<WireTable>,
    services: BTreeMap<NamespacedName, ProgrammedService>,
    /// The claimants of each key of the shared sets other than the endpoint maps (keys of
    /// those belong to one block, hence one service, by construction) and `hairpin-endpoints`.
    claims: HashMap<SharedKey, Claim>,
    /// The names of the sets in `claims` keys.
    claimed_sets: Vec<String>,
    /// How many services claim each `hairpin-endpoints` key (family index, key): a pod behind
    /// two services is legitimate, and the element is the same whoever claims it.
    hairpins: HashMap<(u8, WireKey), u32>,
    /// Elements per endpoint map (a map exists while it holds any), with an empty copy of each.
    shards: HashMap<(usize, String), (usize, WireSet)>,
}

impl Programmed {
    /// The programmed state of the infrastructure tables (one per family), no services yet.
    pub fn new(families: Vec<IpFamily>, infrastructure: Vec<WireTable>) -> Programmed {
        Programmed {
            families,
            infrastructure,
            services: BTreeMap::new(),
            claims: HashMap::new(),
            claimed_sets: Vec::new(),
            hairpins: HashMap::new(),
            shards: HashMap::new(),
        }
    }

    /// Records a service of a full sync, where services arrive in name order, and removes from
    /// its fragments the shared keys an earlier claimant holds (the infrastructure, or a
    /// service before it): what is left is what this service writes into the shared sets, as
    /// [`crate::plan::plan`] merges them.
    pub fn insert_first_claims(&mut self, name: NamespacedName, service: ProgrammedService, fragments: &mut Fragments) {
        self.count_claims(&name, fragments, 1);
        for (fi, fragment) in fragments.iter_mut().enumerate() {
            let family = u8::try_from(fi).unwrap_or(u8::MAX);
            for set in fragment.sets.values_mut() {
                if set_is_shard(&set.name) || !self.is_shared(fi, &set.name) {
                    continue;
                }
                let infrastructure = self.infrastructure.get(fi).and_then(|t| t.sets.get(&set.name));
                let held = |key: &WireKey| infrastructure.is_some_and(|s| s.elements.contains_key(key));
                if set.name == HAIRPIN {
                    let hairpins = &self.hairpins;
                    set.elements.retain(|key, _| !held(key) && hairpins.get(&(family, key.clone())) == Some(&1));
                    continue;
                }
                let Some(id) = self.claimed_sets.iter().position(|s| *s == set.name) else { continue };
                let id = u8::try_from(id).unwrap_or(u8::MAX);
                let claims = &self.claims;
                set.elements.retain(|key, _| {
                    !held(key) && claims.get(&(family, id, key.clone())).and_then(|c| c.first()) == Some(&name)
                });
            }
        }
        self.services.insert(name, service);
    }

    /// The families the tables are for.
    pub fn families(&self) -> &[IpFamily] {
        &self.families
    }

    /// The services, in name order.
    pub fn services(&self) -> impl Iterator<Item = (&NamespacedName, &ProgrammedService)> {
        self.services.iter()
    }

    /// A programmed service.
    pub fn service(&self, name: &NamespacedName) -> Option<&ProgrammedService> {
        self.services.get(name)
    }

    /// Counts describing the whole ruleset.
    pub fn stats(&self) -> PlanStats {
        let mut stats = PlanStats::default();
        for s in self.services.values() {
            stats.add(&s.stats);
        }
        stats
    }

    /// Health checks of every service that has one.
    pub fn health_checks(&self) -> Vec<HealthCheck> {
        self.services.values().filter_map(|s| s.health_check.clone()).collect()
    }

    /// Conntrack targets of every UDP and SCTP service port.
    pub fn conntrack(&self) -> Vec<ConntrackTarget> {
        self.services.values().flat_map(|s| s.conntrack.iter().cloned()).collect()
    }

    /// Whether `set` of family `fi` is shared (the infrastructure has it, or it is an endpoint
    /// map) rather than a service's own.
    fn is_shared(&self, fi: usize, set: &str) -> bool {
        MapKind::parse(set).is_some() || self.infrastructure.get(fi).is_some_and(|t| t.sets.contains_key(set))
    }

    /// The index of a shared set's name in `claimed_sets` (added when new).
    fn claimed_set_id(&mut self, set: &str) -> u8 {
        let at = self.claimed_sets.iter().position(|s| s == set).unwrap_or_else(|| {
            self.claimed_sets.push(set.to_string());
            self.claimed_sets.len() - 1
        });
        u8::try_from(at).unwrap_or(u8::MAX)
    }

    fn count_claims(&mut self, name: &NamespacedName, fragments: &[WireTable], delta: i64) {
        for (fi, fragment) in fragments.iter().enumerate() {
            for set in fragment.sets.values() {
                if set_is_shard(&set.name) {
                    let entry = self.shards.entry((fi, set.name.clone())).or_insert_with(|| (0, shared_empty(set)));
                    let n = i64::try_from(entry.0).unwrap_or(i64::MAX) + delta * set.elements.len() as i64;
                    entry.0 = usize::try_from(n.max(0)).unwrap_or(0);
                    if entry.0 == 0 {
                        self.shards.remove(&(fi, set.name.clone()));
                    }
                    continue;
                }
                if !self.is_shared(fi, &set.name) {
                    continue;
                }
                // Family indexes and shared sets are a handful (the infrastructure's).
                let family = u8::try_from(fi).unwrap_or(u8::MAX);
                if set.name == HAIRPIN {
                    for key in set.elements.keys() {
                        let k = (family, key.clone());
                        let count = self.hairpins.entry(k.clone()).or_default();
                        *count = u32::try_from((i64::from(*count) + delta).max(0)).unwrap_or(0);
                        if *count == 0 {
                            self.hairpins.remove(&k);
                        }
                    }
                    continue;
                }
                let id = self.claimed_set_id(&set.name);
                for key in set.elements.keys() {
                    let k = (family, id, key.clone());
                    let claim = self.claims.entry(k.clone()).or_default();
                    match (claim.binary_search(name), delta > 0) {
                        (Err(at), true) => claim.insert(at, name.clone()),
                        (Ok(at), false) => {
                            claim.remove(at);
                        }
                        _ => {}
                    }
                    if claim.is_empty() {
                        self.claims.remove(&k);
                    }
                }
            }
        }
    }

    /// The element the kernel holds (or should hold) for a shared key, given the services
    /// recorded now. `hint` is a service known to claim the key, with its fragments.
    fn effective(
        &self,
        fi: usize,
        set: &str,
        key: &WireKey,
        hint: Option<(&NamespacedName, &Fragments)>,
        replan: &mut Replan<'_>,
    ) -> Option<WireElement> {
        if let Some(e) = self.infrastructure.get(fi).and_then(|t| t.sets.get(set)).and_then(|s| s.elements.get(key)) {
            return Some(e.clone());
        }
        let element_of = |fragments: &Fragments| {
            fragments.get(fi).and_then(|f| f.sets.get(set)).and_then(|s| s.elements.get(key)).cloned()
        };
        if set_is_shard(set) {
            // An index belongs to one block, and blocks move only between changed services.
            return hint.and_then(|(_, f)| element_of(f));
        }
        let family = u8::try_from(fi).ok()?;
        if set == HAIRPIN {
            // Hairpin elements are the same whoever claims them (only the owner differs, and
            // only content is compared).
            return self.hairpins.get(&(family, key.clone())).filter(|n| **n > 0).map(|_| WireElement {
                data: WireData::None,
                userdata: None,
                owner: Owner::infrastructure(),
            });
        }
        let id = u8::try_from(self.claimed_sets.iter().position(|s| s == set)?).ok()?;
        let claim = self.claims.get(&(family, id, key.clone()))?;
        // The first claimant in name order wins, as when the whole ruleset is planned.
        let first = claim.first()?;
        match hint {
            Some((name, fragments)) if name == first => element_of(fragments),
            _ => {
                let service = self.services.get(first)?;
                element_of(&replan(first, service))
            }
        }
    }

    /// Replaces some services: each with its old fragments (planned again by the caller) and
    /// its new version (`None`: the service is gone), and returns the operations that take
    /// the kernel from the old state to the new one. `replan` plans other services again when
    /// a contested shared key needs their element.
    pub fn replace(&mut self, changes: Vec<Change>, replan: &mut Replan<'_>) -> Transaction {
        // Every shared key the changed services claim, before or after, with the claimant
        // (an index into `changes`) on each side.
        type Claimants = (Option<usize>, Option<usize>);
        let mut touched: BTreeMap<(usize, String, WireKey), Claimants> = BTreeMap::new();
        for (i, (name, old, new)) in changes.iter().enumerate() {
            let had = self.services.contains_key(name);
            let sides = [(had.then_some(old), true), (new.as_ref().map(|(_, f)| f), false)];
            for (fragments, before) in sides {
                let Some(fragments) = fragments else { continue };
                for (fi, fragment) in fragments.iter().enumerate() {
                    for set in fragment.sets.values().filter(|s| self.is_shared(fi, &s.name)) {
                        for key in set.elements.keys() {
                            let entry = touched.entry((fi, set.name.clone(), key.clone())).or_default();
                            let side = if before { &mut entry.0 } else { &mut entry.1 };
                            side.get_or_insert(i);
                        }
                    }
                }
            }
        }
        let before: Vec<Option<WireElement>> = touched
            .iter()
            .map(|((fi, set, key), (b, _))| {
                let hint = b.map(|i| (&changes[i].0, &changes[i].1));
                self.effective(*fi, set, key, hint, replan)
            })
            .collect();
        let sets: BTreeSet<(usize, String)> = touched.keys().map(|(fi, set, _)| (*fi, set.clone())).collect();
        let mut have_sets: BTreeMap<(usize, String), WireSet> =
            sets.iter().filter_map(|(fi, set)| Some(((*fi, set.clone()), self.empty_shared(*fi, set)?))).collect();

        let mut have: Vec<WireTable> = self.infrastructure.iter().map(WireTable::empty_like).collect();
        let mut want = have.clone();
        for (name, old, new) in &changes {
            if self.services.remove(name).is_some() {
                self.count_claims(name, old, -1);
                add_own(&mut have, old, self);
            }
            if let Some((service, fragments)) = new {
                add_own(&mut want, fragments, self);
                self.count_claims(name, fragments, 1);
                self.services.insert(name.clone(), service.clone());
            }
        }

        let after: Vec<Option<WireElement>> = touched
            .iter()
            .map(|((fi, set, key), (_, a))| {
                let hint = a.and_then(|i| changes[i].2.as_ref().map(|(_, f)| (&changes[i].0, f)));
                self.effective(*fi, set, key, hint, replan)
            })
            .collect();
        let mut want_sets: BTreeMap<(usize, String), WireSet> =
            sets.iter().filter_map(|(fi, set)| Some(((*fi, set.clone()), self.empty_shared(*fi, set)?))).collect();
        for (((fi, set, key), _), (old, new)) in touched.iter().zip(before.into_iter().zip(after)) {
            // An endpoint map absent on one side is created or deleted as a whole.
            if let (Some(s), Some(e)) = (have_sets.get_mut(&(*fi, set.clone())), old) {
                s.elements.insert(key.clone(), e);
            }
            if let (Some(s), Some(e)) = (want_sets.get_mut(&(*fi, set.clone())), new) {
                s.elements.insert(key.clone(), e);
            }
        }
        for ((fi, name), set) in have_sets {
            have[fi].sets.insert(name, set);
        }
        for ((fi, name), set) in want_sets {
            want[fi].sets.insert(name, set);
        }

        let mut tx = Transaction::default();
        for (h, w) in have.iter().zip(want) {
            diff_table(h, w, &mut tx);
        }
        tx
    }

    /// An empty copy of a shared set as it is now: the infrastructure's, or an endpoint map
    /// while it holds elements (`None` otherwise).
    fn empty_shared(&self, fi: usize, set: &str) -> Option<WireSet> {
        if let Some(s) = self.infrastructure.get(fi).and_then(|t| t.sets.get(set)) {
            return Some(shared_empty(s));
        }
        self.shards.get(&(fi, set.to_string())).map(|(_, s)| s.clone())
    }
}

fn set_is_shard(name: &str) -> bool {
    MapKind::parse(name).is_some()
}

/// Adds a service's chains and own sets to per-family tables.
fn add_own(tables: &mut [WireTable], fragments: &[WireTable], programmed: &Programmed) {
    for (fi, (table, fragment)) in tables.iter_mut().zip(fragments).enumerate() {
        for (name, chain) in &fragment.chains {
            table.chains.insert(name.clone(), chain.clone());
        }
        for (name, set) in fragment.sets.iter().filter(|(n, _)| !programmed.is_shared(fi, n)) {
            table.sets.insert(name.clone(), set.clone());
        }
    }
}

/// An empty copy of a shared set, owned by the infrastructure.
fn shared_empty(set: &WireSet) -> WireSet {
    WireSet { owner: Owner::infrastructure(), ..set.empty_like() }
}
