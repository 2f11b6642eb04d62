//! What nftproxy has programmed: each family's infrastructure, and for every service the part
//! of the cluster state it was planned from (sharing the objects of the live state) and where
//! its endpoint windows are, with the claimants of every shared key.
//!
//! A service's kernel objects are not stored: planning is deterministic, so they are planned
//! again from the record when needed. A partial sync plans the old and the new version of each
//! changed service and hands the [`delta`](super::delta) builder only their objects and the
//! shared keys they touch ([`Programmed::scope`]), so its cost follows the size of the change
//! rather than the size of the cluster, and memory holds no second copy of the ruleset. Both
//! sync kinds give a contested shared key to its first claimant in service-name order, exactly
//! as [`crate::plan::plan`] merges, so both program the same ruleset.

use std::collections::{BTreeMap, BTreeSet};

use foldhash::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use smallvec::SmallVec;

use super::delta::{View, ViewTable};
use crate::model::{NamespacedName, ServiceSnapshot};
use crate::net::{FamilyMap, IpFamily};
use crate::nft::ast::Owner;
use crate::nft::wire::{SetElements, WireData, WireElement, WireKey, WireSet, WireTable};
use crate::plan::placement::Placed;
use crate::plan::{ConntrackTarget, HealthCheck, PlanStats, SharedSet, WireFragment};

/// One service as programmed.
#[derive(Debug, Clone)]
pub(super) struct ProgrammedService {
    /// The service, its slices and the node, as they were planned.
    pub state: ServiceSnapshot,
    /// Where its endpoint windows were, and its affinity slots.
    pub slots: Placed,
    pub health_check: Option<HealthCheck>,
    pub conntrack: Vec<ConntrackTarget>,
    pub stats: PlanStats,
}

/// A service's kernel objects, per family.
pub(super) type Fragments = FamilyMap<WireFragment>;

/// A key of a shared set other than an endpoint map and `hairpin-endpoints`.
type SharedKey = (IpFamily, SharedSet, WireKey);

/// Bytes of the endpoint index that ends every key of a balancing map (`numgen` writes a
/// 32-bit register).
const INDEX_LEN: usize = 4;

/// The key a claim on `key` is counted under. A balancing map's keys are a service address
/// (`address . proto . port`, or `proto . port` for a node port) and then an endpoint index, and
/// an address with N endpoints claims the indexes `0..N` together (N elements of
/// `service-endpoints-N`), so its claim is kept once, under the address: at 5,000 × 50 that is
/// 5,000 claims instead of 250,000.
fn claim_key(set: SharedSet, key: &WireKey) -> WireKey {
    match set {
        SharedSet::Balance(..) => WireKey::new(&key.bytes[..key.bytes.len().saturating_sub(INDEX_LEN)]),
        _ => key.clone(),
    }
}

/// The endpoint address of a `hairpin-endpoints` key (`address . address`, the same address
/// twice), which its count is kept under.
fn hairpin_address(family: IpFamily, key: &WireKey) -> Option<IpAddr> {
    match family {
        IpFamily::V4 => {
            let octets: [u8; 4] = key.bytes.get(..4)?.try_into().ok()?;
            Some(IpAddr::V4(Ipv4Addr::from(octets)))
        }
        IpFamily::V6 => {
            let octets: [u8; 16] = key.bytes.get(..16)?.try_into().ok()?;
            Some(IpAddr::V6(Ipv6Addr::from(octets)))
        }
    }
}

/// Claim counts of `hairpin-endpoints` keys by address, one map per family: an IPv4 count
/// takes 8 bytes instead of the 24 of an `IpAddr` entry, and a cluster has one per endpoint
/// (250,000 at 5,000 services × 50, where the map's growth was a restart's peak).
#[derive(Debug, Clone, Default)]
struct HairpinCounts {
    v4: HashMap<Ipv4Addr, u32>,
    v6: HashMap<Ipv6Addr, u32>,
}

impl HairpinCounts {
    /// How many claim `address`; `None` when nobody does.
    fn get(&self, address: IpAddr) -> Option<u32> {
        match address {
            IpAddr::V4(a) => self.v4.get(&a).copied(),
            IpAddr::V6(a) => self.v6.get(&a).copied(),
        }
    }

    /// Adds `delta` claims of `address`; a count that reaches zero is dropped.
    fn add(&mut self, address: IpAddr, delta: i64) {
        fn apply<A: std::hash::Hash + Eq + Copy>(counts: &mut HashMap<A, u32>, address: A, delta: i64) {
            let count = counts.entry(address).or_default();
            *count = u32::try_from((i64::from(*count) + delta).max(0)).unwrap_or(0);
            if *count == 0 {
                counts.remove(&address);
            }
        }
        match address {
            IpAddr::V4(a) => apply(&mut self.v4, a, delta),
            IpAddr::V6(a) => apply(&mut self.v6, a, delta),
        }
    }
}

/// Who claims a shared key, in name order: almost always one service (a key claimed twice is
/// conflicting input, and the first claimant wins). The name is shared by all the keys one
/// service claims: 100,000 claimed keys would otherwise hold 200,000 copies of small strings.
type Claim = SmallVec<[Arc<NamespacedName>; 1]>;

/// A changed service: its name, what it programmed (planned again; `None` if it had nothing),
/// and its new version with its objects (`None`: the service is gone or left out).
pub(super) type Change = (NamespacedName, Option<Fragments>, Option<(ProgrammedService, Fragments)>);

/// Plans a programmed service again, from its record.
pub(super) type Replan<'a> = dyn FnMut(&NamespacedName, &ProgrammedService) -> Fragments + 'a;

/// What a partial sync diffs: the changed services' part of the kernel, and what replaces it.
pub(super) struct Scope {
    /// The changed services' old own objects, and the shared sets they touch holding the
    /// elements the kernel has for the touched keys.
    pub view: View,
    /// The new versions' objects (own objects only), then one fragment per family with the
    /// elements the touched shared keys have afterwards, whoever claims them.
    pub wants: Vec<Fragments>,
    /// Shared sets that exist afterwards, per family.
    pub kept: FamilyMap<BTreeSet<SharedSet>>,
}

/// The programmed ruleset.
#[derive(Debug, Clone)]
pub(super) struct Programmed {
    infrastructure: FamilyMap<WireTable>,
    services: BTreeMap<NamespacedName, ProgrammedService>,
    /// Who claims each shared key, under [`claim_key`] (a balancing map's keys without their
    /// index).
    claims: HashMap<SharedKey, Claim>,
    /// How many services claim each `hairpin-endpoints` key, by its address (one per endpoint):
    /// a pod behind two services is legitimate, and the element is the same whoever claims it.
    hairpins: HairpinCounts,
    /// Uses of each set created on demand (endpoint and balancing maps): its claimed elements,
    /// and one per service whose rules name it. An endpoint map exists while it has any use; a
    /// balancing map (named by the infrastructure's rules, not a service's) from the first
    /// element it holds while this process runs (an entry at zero: emptied, kept).
    maps: HashMap<(IpFamily, SharedSet), usize>,
    /// The sum of the services' counts, kept as services come and go (a sync reports it, and
    /// summing 44,000 services per sync would cost more than the sync).
    totals: PlanStats,
    /// Every health check, built on demand and kept until a service's health check changes:
    /// observers compare the pointer to skip work when nothing changed.
    health_checks: Option<Arc<[HealthCheck]>>,
}

impl Programmed {
    /// The programmed state of the infrastructure tables (one per family), no services yet.
    pub(super) fn new(infrastructure: FamilyMap<WireTable>) -> Programmed {
        Programmed {
            infrastructure,
            services: BTreeMap::new(),
            claims: HashMap::default(),
            hairpins: HairpinCounts::default(),
            maps: HashMap::default(),
            totals: PlanStats::default(),
            health_checks: None,
        }
    }

    /// Records `service` under `name` (or removes it), returning what was there, with the
    /// totals following.
    fn put(&mut self, name: NamespacedName, service: Option<ProgrammedService>) -> Option<ProgrammedService> {
        if let Some(new) = &service {
            self.totals.add(&new.stats);
        }
        let old = match service {
            Some(new) => self.services.insert(name, new),
            None => self.services.remove(&name),
        };
        if let Some(old) = &old {
            self.totals.subtract(&old.stats);
        }
        old
    }

    /// The families the tables are for.
    pub(super) fn families(&self) -> Vec<IpFamily> {
        self.infrastructure.families().collect()
    }

    /// Records a service of a full sync, where services arrive in name order, and removes from
    /// its fragments the shared keys an earlier claimant holds (the infrastructure, or a
    /// service before it): what is left is what this service writes into the shared sets, as
    /// [`crate::plan::plan`] merges them.
    pub(super) fn insert_first_claims(
        &mut self,
        name: NamespacedName,
        service: ProgrammedService,
        fragments: &mut Fragments,
    ) {
        self.count_claims(&name, fragments, 1);
        for (family, fragment) in fragments.iter_mut() {
            let infrastructure = self.infrastructure.get(family);
            for (set, elements) in fragment.shared.iter_mut() {
                if set.is_endpoint_map() {
                    continue;
                }
                // Sets made on demand are never the infrastructure's (and their names are
                // formatted: found once per set, not per key).
                let infrastructure_set =
                    if set.on_demand() { None } else { infrastructure.and_then(|t| t.sets.get(set.name().as_ref())) };
                let held_by_infrastructure =
                    |key: &WireKey| infrastructure_set.is_some_and(|s| s.elements.contains_key(key));
                if *set == SharedSet::Hairpin {
                    let hairpins = &self.hairpins;
                    elements.retain(|key, _| {
                        !held_by_infrastructure(key)
                            && hairpin_address(family, key).and_then(|a| hairpins.get(a)) == Some(1)
                    });
                    continue;
                }
                let claims = &self.claims;
                elements.retain(|key, _| {
                    !held_by_infrastructure(key)
                        && claims
                            .get(&(family, *set, claim_key(*set, key)))
                            .and_then(|c| c.first())
                            .is_some_and(|c| **c == name)
                });
            }
        }
        self.put(name, Some(service));
    }

    /// A programmed service.
    pub(super) fn service(&self, name: &NamespacedName) -> Option<&ProgrammedService> {
        self.services.get(name)
    }

    /// Counts describing the whole ruleset.
    pub(super) fn stats(&self) -> PlanStats {
        self.totals
    }

    /// The services' counts summed afresh (tests compare the running totals with it).
    #[cfg(test)]
    pub(super) fn recount(&self) -> PlanStats {
        let mut stats = PlanStats::default();
        for s in self.services.values() {
            stats.add(&s.stats);
        }
        stats
    }

    /// Health checks of every service that has one: the same allocation until one changes.
    pub(super) fn health_checks(&mut self) -> Arc<[HealthCheck]> {
        let services = &self.services;
        Arc::clone(
            self.health_checks
                .get_or_insert_with(|| services.values().filter_map(|s| s.health_check.clone()).collect()),
        )
    }

    /// Conntrack targets of every UDP and SCTP service port.
    pub(super) fn conntrack(&self) -> Vec<ConntrackTarget> {
        self.services.values().flat_map(|s| s.conntrack.iter().cloned()).collect()
    }

    /// The shared sets that exist now in a family: the infrastructure's and the maps created on
    /// demand that are in use (see `maps`).
    fn shared_sets(&self, family: IpFamily) -> BTreeSet<SharedSet> {
        let infrastructure = self.infrastructure.get(family).into_iter().flat_map(|t| t.sets.keys());
        infrastructure
            .filter_map(|name| SharedSet::from_name(name))
            .chain(self.maps.keys().filter(|(f, _)| *f == family).map(|(_, set)| *set))
            .collect()
    }

    /// The balancing maps kept in a family after their last element went (see `maps`).
    pub(super) fn emptied_maps(&self, family: IpFamily) -> impl Iterator<Item = SharedSet> + '_ {
        self.emptied().filter(move |(f, _)| *f == family).map(|(_, set)| set)
    }

    /// The balancing maps kept after their last element went, in every family.
    pub(super) fn emptied(&self) -> impl Iterator<Item = (IpFamily, SharedSet)> + '_ {
        self.maps.iter().filter(|(_, n)| **n == 0).map(|(id, _)| *id)
    }

    /// Keeps these balancing maps (emptied before a full sync that records everything again)
    /// whether or not a service writes into them.
    pub(super) fn keep_emptied(&mut self, maps: &[(IpFamily, SharedSet)]) {
        for id in maps {
            self.maps.entry(*id).or_insert(0);
        }
    }

    fn count_claims(&mut self, name: &NamespacedName, fragments: &Fragments, delta: i64) {
        // One copy of the name for every key this service claims (removals need none).
        let shared = (delta > 0).then(|| Arc::new(name.clone()));
        for (family, fragment) in fragments.iter() {
            for (set, elements) in &fragment.shared {
                if set.on_demand() {
                    // Claims, not kernel elements: a contested key counts once per claimant,
                    // and the map exists while anyone claims anything in it or names it (one
                    // more per service whose fragment has it: an endpoint map's entry is there
                    // because the service's rules name it; a balancing map's only with elements).
                    let entry = self.maps.entry((family, *set)).or_insert(0);
                    let uses = i64::try_from(elements.len()).unwrap_or(i64::MAX).saturating_add(1);
                    let n = i64::try_from(*entry).unwrap_or(i64::MAX) + delta * uses;
                    *entry = usize::try_from(n.max(0)).unwrap_or(0);
                    // A balancing map outlives its last element, with its rule: a count that
                    // comes back (an endpoint added, then removed again) is elements again
                    // rather than a new map and rule, after which the kernel validates the
                    // whole table. A new process plans from nothing and deletes the empty ones.
                    if *entry == 0 && !matches!(set, SharedSet::Balance(..)) {
                        self.maps.remove(&(family, *set));
                    }
                }
                if set.is_endpoint_map() {
                    continue;
                }
                if *set == SharedSet::Hairpin {
                    for address in elements.keys().filter_map(|key| hairpin_address(family, key)) {
                        self.hairpins.add(address, delta);
                    }
                    continue;
                }
                let balance = matches!(set, SharedSet::Balance(..));
                let mut last: Option<WireKey> = None;
                for key in elements.keys() {
                    let claimed = claim_key(*set, key);
                    // A balancing map's keys of one address are adjacent (the index comes last):
                    // count the address once.
                    if balance {
                        if last.as_ref() == Some(&claimed) {
                            continue;
                        }
                        last = Some(claimed.clone());
                    }
                    let k = (family, *set, claimed);
                    let claim = self.claims.entry(k.clone()).or_default();
                    match (claim.binary_search_by(|c| c.as_ref().cmp(name)), delta > 0) {
                        (Err(at), true) => {
                            if let Some(shared) = &shared {
                                claim.insert(at, Arc::clone(shared));
                            }
                        }
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
        family: IpFamily,
        set: SharedSet,
        key: &WireKey,
        hint: Option<(&NamespacedName, &Fragments)>,
        replan: &mut Replan<'_>,
    ) -> Option<WireElement> {
        let infrastructure = self.infrastructure.get(family).and_then(|t| t.sets.get(set.name().as_ref()));
        if let Some(e) = infrastructure.and_then(|s| s.elements.get(key)) {
            return Some(e.clone());
        }
        let element_of = |fragments: &Fragments| {
            fragments.get(family).and_then(|f| f.shared.get(&set)).and_then(|s| s.get(key)).cloned()
        };
        if set.is_endpoint_map() {
            // A key belongs to one window, hence one service port, and windows move only
            // between changed services.
            return hint.and_then(|(_, f)| element_of(f));
        }
        if set == SharedSet::Hairpin {
            // The same element whoever claims it (only the owner differs, and only content is
            // compared).
            let address = hairpin_address(family, key)?;
            return self.hairpins.get(address).filter(|n| *n > 0).map(|_| WireElement {
                data: WireData::None,
                userdata: None,
                owner: Owner::infrastructure(),
            });
        }
        let claim = self.claims.get(&(family, set, claim_key(set, key)))?;
        // The first claimant in name order wins, as when the whole ruleset is planned.
        let first: &NamespacedName = claim.first()?;
        match hint {
            Some((name, fragments)) if name == first => element_of(fragments),
            _ => {
                let service = self.services.get(first)?;
                element_of(&replan(first, service))
            }
        }
    }

    /// Replaces some services with their new versions and returns what the partial sync diffs:
    /// the part of the kernel they touch, and what it becomes. `replan` plans other services
    /// again when a contested shared key needs their element.
    pub(super) fn scope(&mut self, changes: Vec<Change>, replan: &mut Replan<'_>) -> Scope {
        // Every shared key the changed services claim, before or after, with the claimant (an
        // index into `changes`) on each side.
        type Claimants = (Option<usize>, Option<usize>);
        let mut touched: BTreeMap<SharedKey, Claimants> = BTreeMap::new();
        for (i, (_, old, new)) in changes.iter().enumerate() {
            for (fragments, before) in [(old.as_ref(), true), (new.as_ref().map(|(_, f)| f), false)] {
                let Some(fragments) = fragments else { continue };
                for (family, fragment) in fragments.iter() {
                    for (set, elements) in &fragment.shared {
                        for key in elements.keys() {
                            let entry = touched.entry((family, *set, key.clone())).or_default();
                            let side = if before { &mut entry.0 } else { &mut entry.1 };
                            side.get_or_insert(i);
                        }
                    }
                }
            }
        }
        let before: Vec<Option<WireElement>> = touched
            .iter()
            .map(|((family, set, key), (b, _))| {
                let hint = b.and_then(|i| changes[i].1.as_ref().map(|f| (&changes[i].0, f)));
                self.effective(*family, *set, key, hint, replan)
            })
            .collect();
        let sets_before: FamilyMap<BTreeSet<SharedSet>> = self.infrastructure.map(|f, _| self.shared_sets(f));

        let mut view = View::default();
        for (family, table) in self.infrastructure.iter() {
            view.tables.insert(family, ViewTable::empty_like(table));
        }
        // Per change, the index of its fragment in `wants` (for its share of the shared keys).
        let mut want_of: Vec<Option<usize>> = vec![None; changes.len()];
        let mut wants: Vec<Fragments> = Vec::with_capacity(changes.len() + 1);
        for (i, (name, old, new)) in changes.iter().enumerate() {
            // The health-check list is rebuilt only when this service's check really changed.
            let health_after = new.as_ref().and_then(|(service, _)| service.health_check.as_ref());
            if self.services.get(name).and_then(|s| s.health_check.as_ref()) != health_after {
                self.health_checks = None;
            }
            if self.put(name.clone(), None).is_some()
                && let Some(old) = old
            {
                self.count_claims(name, old, -1);
                for (family, fragment) in old.iter() {
                    if let Some(t) = view.tables.get_mut(family) {
                        t.add_own(&fragment.own);
                    }
                }
            }
            if let Some((service, fragments)) = new {
                self.count_claims(name, fragments, 1);
                self.put(name.clone(), Some(service.clone()));
                want_of[i] = Some(wants.len());
                // The maps its rules name, each created (if new) in the same diff as the rules:
                // the touched keys below fill them.
                wants.push(fragments.map(|_, f| WireFragment {
                    own: f.own.clone(),
                    shared: f.shared.keys().map(|set| (*set, SetElements::default())).collect(),
                }));
            }
        }

        let after: Vec<Option<WireElement>> = touched
            .iter()
            .map(|((family, set, key), (_, a))| {
                let hint = a.and_then(|i| changes[i].2.as_ref().map(|(_, f)| (&changes[i].0, f)));
                self.effective(*family, *set, key, hint, replan)
            })
            .collect();
        let kept: FamilyMap<BTreeSet<SharedSet>> = self.infrastructure.map(|f, _| self.shared_sets(f));

        // Keys nobody changed claims afterwards (their element is an unchanged service's, or
        // gone) go in a fragment of their own, after the services'.
        let rest = wants.len();
        wants.push(self.infrastructure.map(|_, t| WireFragment { own: t.empty_like(), shared: BTreeMap::new() }));
        for (((family, set, key), (_, a)), (old, new)) in touched.into_iter().zip(before.into_iter().zip(after)) {
            // A set that does not exist before has no elements to lose; one created now gets
            // its elements with its creation.
            if let Some(e) = old
                && sets_before.get(family).is_some_and(|s| s.contains(&set))
                && let Some(t) = view.tables.get_mut(family)
            {
                t.shared_elements(set, family).elements.insert(key.clone(), e);
            }
            // A key a changed service claims goes with that service's objects, so an endpoint
            // map is created in the same diff as the rule that names it.
            let at = a.and_then(|i| want_of[i]).unwrap_or(rest);
            if let Some(e) = new
                && let Some(f) = wants.get_mut(at).and_then(|w| w.get_mut(family))
            {
                f.shared.entry(set).or_default().insert(key, e);
            }
        }
        // Every set that existed before is in the view, so one that goes away is deleted.
        for (family, sets) in sets_before.iter() {
            if let Some(t) = view.tables.get_mut(family) {
                for set in sets {
                    t.shared_elements(*set, family);
                }
            }
        }
        Scope { view, wants, kept }
    }
}

impl ViewTable {
    /// The shared set `set` of this view, created empty (with its spec) on first use.
    fn shared_elements(&mut self, set: SharedSet, family: IpFamily) -> &mut WireSet {
        self.shared.entry(set).or_insert_with(|| super::delta::empty_shared_set(set, family))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::L4Proto;
    use crate::nft::ast::Value;
    use crate::nft::lower::encode_key;
    use crate::plan::objects::BalanceMap;

    fn key(values: &[Value]) -> WireKey {
        WireKey::new(&encode_key(values))
    }

    /// Counts go up and down per address in either family, and a count back at zero is gone.
    #[test]
    fn hairpin_counts_per_address_in_both_families() {
        let mut counts = HairpinCounts::default();
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        let v6: IpAddr = "fd00::1".parse().unwrap();
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        counts.add(v4, 1);
        counts.add(v4, 1);
        counts.add(v6, 1);
        assert_eq!((counts.get(v4), counts.get(v6), counts.get(mapped)), (Some(2), Some(1), None));
        counts.add(v4, -1);
        counts.add(v6, -1);
        assert_eq!((counts.get(v4), counts.get(v6)), (Some(1), None));
        counts.add(v6, -1);
        assert_eq!(counts.get(v6), None, "no count below zero");
        assert!(counts.v6.is_empty());
    }

    #[test]
    fn a_balancing_key_is_claimed_under_its_address_in_both_families() {
        for addr in ["10.96.0.10", "fd00:96::a"] {
            let addr = Value::Addr(addr.parse().unwrap());
            let service =
                |index| key(&[addr.clone(), Value::Proto(L4Proto::Tcp), Value::Port(80), Value::Index(index)]);
            let set = SharedSet::Balance(BalanceMap::Service, 3);
            let address = key(&[addr.clone(), Value::Proto(L4Proto::Tcp), Value::Port(80)]);
            assert_eq!(claim_key(set, &service(0)), address);
            assert_eq!(claim_key(set, &service(2)), address);
            let other_port = key(&[addr.clone(), Value::Proto(L4Proto::Tcp), Value::Port(81), Value::Index(0)]);
            assert_ne!(claim_key(set, &other_port), address);
            // Other shared sets keep the whole key.
            assert_eq!(claim_key(SharedSet::ServiceIps, &address), address);
        }
        let nodeport = key(&[Value::Proto(L4Proto::Udp), Value::Port(30053), Value::Index(1)]);
        assert_eq!(
            claim_key(SharedSet::Balance(BalanceMap::Nodeport, 2), &nodeport),
            key(&[Value::Proto(L4Proto::Udp), Value::Port(30053)])
        );
    }

    #[test]
    fn a_hairpin_key_is_counted_under_its_endpoint_address() {
        for (family, addr) in [(IpFamily::V4, "10.180.0.7"), (IpFamily::V6, "fd00:10:180::7")] {
            let ip: IpAddr = addr.parse().unwrap();
            let pair = key(&[Value::Addr(ip), Value::Addr(ip)]);
            assert_eq!(hairpin_address(family, &pair), Some(ip));
        }
        assert_eq!(hairpin_address(IpFamily::V6, &key(&[Value::Port(1)])), None);
    }
}
