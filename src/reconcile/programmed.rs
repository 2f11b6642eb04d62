//! What nftproxy has programmed, in kernel form: each family's infrastructure and one fragment
//! per service (its chains, its own sets, its elements of the shared sets and maps).
//!
//! A partial sync replaces the fragments of the services that changed and diffs only those,
//! with the shared elements they touch, so its cost follows the size of the change rather than
//! the size of the cluster. A full sync assembles the whole ruleset from here and diffs it with
//! what the kernel holds. Assembling merges in service-name order with the first claim to a
//! shared key winning, exactly as [`crate::plan::plan`] does, so both paths program the same
//! ruleset.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::model::NamespacedName;
use crate::net::IpFamily;
use crate::nft::ast::Owner;
use crate::nft::diff::{Transaction, diff_table};
use crate::nft::lower::lower_table;
use crate::nft::wire::{WireData, WireElement, WireKey, WireRuleset, WireSet, WireTable};
use crate::plan::slots::MapKind;
use crate::plan::objects::HAIRPIN;
use crate::plan::{ConntrackTarget, HealthCheck, PlanStats, ServicePlan, set_rank};

/// One service as programmed.
#[derive(Debug, Clone)]
pub struct ProgrammedService {
    /// One partial table per family, in the order of [`Programmed::families`].
    pub fragments: Vec<WireTable>,
    pub health_check: Option<HealthCheck>,
    pub conntrack: Vec<ConntrackTarget>,
    pub stats: PlanStats,
}

impl ProgrammedService {
    /// Lowers a service's plan.
    pub fn lower(plan: ServicePlan) -> (NamespacedName, ProgrammedService) {
        let fragments = plan.fragments.iter().map(lower_table).collect();
        let service = ProgrammedService {
            fragments,
            health_check: plan.health_check,
            conntrack: plan.conntrack,
            stats: plan.stats,
        };
        (plan.service, service)
    }

    /// The service's chains, by family.
    pub fn chains(&self) -> impl Iterator<Item = (IpFamily, &str)> {
        self.fragments.iter().flat_map(|f| f.chains.keys().map(move |c| (f.family, c.as_str())))
    }
}

/// A key of a shared set that is not an endpoint map: family index, set, element key.
type SharedKey = (usize, String, WireKey);

/// The programmed ruleset.
#[derive(Debug, Clone)]
pub struct Programmed {
    families: Vec<IpFamily>,
    infrastructure: Vec<WireTable>,
    services: BTreeMap<NamespacedName, ProgrammedService>,
    /// How many services claim each key of the shared sets other than the endpoint maps
    /// (keys of those belong to one block, hence one service, by construction). More than one
    /// is legitimate for `hairpin-endpoints` (a pod behind two services) and a conflict
    /// elsewhere.
    claims: HashMap<SharedKey, u32>,
    /// Elements per endpoint map (a map exists while it holds any), with an empty copy of each.
    shards: HashMap<(usize, String), (usize, WireSet)>,
}

impl Programmed {
    /// The programmed state for a whole plan: infrastructure tables (one per family) and every
    /// service.
    pub fn new(
        families: Vec<IpFamily>,
        infrastructure: Vec<WireTable>,
        services: impl IntoIterator<Item = (NamespacedName, ProgrammedService)>,
    ) -> Programmed {
        let mut p = Programmed {
            families,
            infrastructure,
            services: BTreeMap::new(),
            claims: HashMap::new(),
            shards: HashMap::new(),
        };
        for (name, service) in services {
            p.count_claims(&service, 1);
            p.services.insert(name, service);
        }
        p
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

    /// The whole ruleset, as the kernel should hold it.
    pub fn assemble(&self) -> WireRuleset {
        let mut tables = self.infrastructure.clone();
        for service in self.services.values() {
            for (table, fragment) in tables.iter_mut().zip(&service.fragments) {
                merge(table, fragment);
            }
        }
        for table in &mut tables {
            table.sets.sort_by(|a, x, b, y| {
                set_rank(a, x.owner.is_infrastructure()).cmp(&set_rank(b, y.owner.is_infrastructure()))
            });
        }
        WireRuleset { tables }
    }

    /// Whether `set` of family `fi` is shared (the infrastructure has it, or it is an endpoint
    /// map) rather than a service's own.
    fn is_shared(&self, fi: usize, set: &str) -> bool {
        MapKind::parse(set).is_some() || self.infrastructure.get(fi).is_some_and(|t| t.sets.contains_key(set))
    }

    fn count_claims(&mut self, service: &ProgrammedService, delta: i64) {
        for (fi, fragment) in service.fragments.iter().enumerate() {
            for set in fragment.sets.values() {
                if set_is_shard(&set.name) {
                    let entry = self.shards.entry((fi, set.name.clone())).or_insert_with(|| (0, empty_set_like(set)));
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
                for key in set.elements.keys() {
                    let k = (fi, set.name.clone(), key.clone());
                    let count = self.claims.entry(k.clone()).or_insert(0);
                    *count = u32::try_from((i64::from(*count) + delta).max(0)).unwrap_or(0);
                    if *count == 0 {
                        self.claims.remove(&k);
                    }
                }
            }
        }
    }

    /// The element the kernel holds (or should hold) for a shared key, given the services'
    /// fragments now. `hint` is a service known to claim the key, if any.
    fn effective(&self, fi: usize, set: &str, key: &WireKey, hint: Option<&NamespacedName>) -> Option<WireElement> {
        if let Some(e) = self.infrastructure.get(fi).and_then(|t| t.sets.get(set)).and_then(|s| s.elements.get(key)) {
            return Some(e.clone());
        }
        let claimed_by = |name: &NamespacedName| {
            self.services
                .get(name)
                .and_then(|s| s.fragments.get(fi))
                .and_then(|f| f.sets.get(set))
                .and_then(|s| s.elements.get(key))
        };
        if set_is_shard(set) {
            // An index belongs to one block, and blocks move only between changed services.
            return hint.and_then(claimed_by).cloned();
        }
        let claims = self.claims.get(&(fi, set.to_string(), key.clone())).copied().unwrap_or(0);
        match (claims, hint.and_then(claimed_by)) {
            (0, _) => None,
            (1, Some(e)) => Some(e.clone()),
            // Hairpin elements are the same whoever claims them (only the owner differs, and
            // only content is compared).
            _ if set == HAIRPIN => {
                Some(WireElement { data: WireData::None, userdata: None, owner: Owner::infrastructure() })
            }
            // Shared with, or contested by, services that did not change: the first in name
            // order wins, as when assembling.
            _ => self.services.keys().find_map(claimed_by).cloned(),
        }
    }

    /// Replaces the fragments of some services (`None`: the service is gone) and returns the
    /// operations that take the kernel from the old state to the new one.
    pub fn replace(&mut self, changes: Vec<(NamespacedName, Option<ProgrammedService>)>) -> Transaction {
        // Every shared key the changed services claim, before or after, with the claimant
        // (an index into `changes`) on each side.
        type Claimants = (Option<usize>, Option<usize>);
        let mut touched: BTreeMap<SharedKey, Claimants> = BTreeMap::new();
        for (i, (name, new)) in changes.iter().enumerate() {
            let sides = [(self.services.get(name), true), (new.as_ref(), false)];
            for (service, before) in sides {
                let Some(service) = service else { continue };
                for (fi, fragment) in service.fragments.iter().enumerate() {
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
        let hint = |i: Option<usize>| i.map(|i| &changes[i].0);
        let before: Vec<Option<WireElement>> =
            touched.iter().map(|((fi, set, key), (b, _))| self.effective(*fi, set, key, hint(*b))).collect();
        let sets: BTreeSet<(usize, String)> = touched.keys().map(|(fi, set, _)| (*fi, set.clone())).collect();
        let mut have_sets: BTreeMap<(usize, String), WireSet> =
            sets.iter().filter_map(|(fi, set)| Some(((*fi, set.clone()), self.empty_shared(*fi, set)?))).collect();

        let mut have: Vec<WireTable> = self.infrastructure.iter().map(empty_like).collect();
        let mut want = have.clone();
        for (name, new) in &changes {
            if let Some(old) = self.services.remove(name) {
                self.count_claims(&old, -1);
                add_own(&mut have, &old, self);
            }
            if let Some(new) = new {
                add_own(&mut want, new, self);
                self.count_claims(new, 1);
                self.services.insert(name.clone(), new.clone());
            }
        }

        let after: Vec<Option<WireElement>> =
            touched.iter().map(|((fi, set, key), (_, a))| self.effective(*fi, set, key, hint(*a))).collect();
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
            return Some(empty_set_like(s));
        }
        self.shards.get(&(fi, set.to_string())).map(|(_, s)| s.clone())
    }
}

fn set_is_shard(name: &str) -> bool {
    MapKind::parse(name).is_some()
}

/// A table with the same identity and no contents.
fn empty_like(table: &WireTable) -> WireTable {
    WireTable {
        family: table.family,
        name: table.name.clone(),
        flags: table.flags,
        userdata: table.userdata.clone(),
        sets: Default::default(),
        chains: Default::default(),
    }
}

fn empty_set_like(set: &WireSet) -> WireSet {
    WireSet {
        name: set.name.clone(),
        spec: set.spec.clone(),
        elements: BTreeMap::new(),
        dynamic: set.dynamic,
        owner: Owner::infrastructure(),
    }
}

/// Adds a service's chains and own sets to per-family tables.
fn add_own(tables: &mut [WireTable], service: &ProgrammedService, programmed: &Programmed) {
    for (fi, (table, fragment)) in tables.iter_mut().zip(&service.fragments).enumerate() {
        for (name, chain) in &fragment.chains {
            table.chains.insert(name.clone(), chain.clone());
        }
        for (name, set) in fragment.sets.iter().filter(|(n, _)| !programmed.is_shared(fi, n)) {
            table.sets.insert(name.clone(), set.clone());
        }
    }
}

/// Merges a fragment into a table: first claim to a key wins.
fn merge(table: &mut WireTable, fragment: &WireTable) {
    for (name, set) in &fragment.sets {
        match table.sets.get_mut(name) {
            Some(have) => {
                for (key, element) in &set.elements {
                    have.elements.entry(key.clone()).or_insert_with(|| element.clone());
                }
            }
            None => {
                table.sets.insert(name.clone(), set.clone());
            }
        }
    }
    for (name, chain) in &fragment.chains {
        table.chains.entry(name.clone()).or_insert_with(|| chain.clone());
    }
}
