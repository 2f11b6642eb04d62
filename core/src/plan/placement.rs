//! Where each service port's endpoints sit in the shared endpoint maps.
//!
//! A service port with a chain of its own (session affinity: the others are balanced by the
//! shared chains, see `balance`) balances over its own **window** of 2^20 numbers in one of a
//! few shared interval maps (`affinity-endpoints-0`, … with their slot maps, see
//! [`super::affinity`]). The window is split into one range per endpoint, as evenly as its size
//! allows. A port with more affinity slots than one window holds has a window per slot group
//! and one for the split between the groups, each placed on its own (see [`WindowId::part`]).
//!
//! The shape follows the kernel's costs, measured on the benchmark's clusters:
//! - the rule never changes while the service port has endpoints, so adding or removing one is
//!   a few element operations in a data map, which the kernel commits without re-validating
//!   every chain of the table (a rule change costs that walk: ~13 ms at 10,000 services);
//! - one map per service port would make every set reference a linear scan by name over
//!   thousands of sets (the kernel keeps a table's sets in a list);
//! - one map for everything would make every rule that looks it up walk all its elements (the
//!   kernel checks a map's data against each rule that binds it: its check for an earlier
//!   binding by the same chain compares a chain it has not set yet), so the groups of a large
//!   affinity port are placed like ports of their own, each in a map of about [`SHARD_LOAD`]
//!   endpoints, and its rules cost the kernel in proportion to its endpoints, not their square.
//!
//! Maps of about [`SHARD_LOAD`] endpoints bound both scans. (No verdict maps: whenever the
//! table is validated, the kernel walks a verdict map in full for each rule that looks it up.)
//!
//! A [`Placement`] is a plain value, an input to planning: planning asks it where a window is,
//! and which endpoint each affinity slot is bound to ([`SlotLookup`]), and never changes it. The
//! syncer changes it explicitly: [`Placement::settle`] places every service at once (a full
//! sync: windows found in the kernel, or placed before, stay where they are),
//! [`Placement::update_service`] moves one service to its new windows (a partial sync). A window
//! never moves while its service port keeps needing it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::model::NamespacedName;
use crate::net::IpFamily;
use crate::plan::affinity::{AffinityDemand, AffinityId, AffinitySlots, SlotTarget};
use crate::plan::names;
use crate::plan::objects::SharedSet;

/// The numbers `numgen` draws for one service port.
pub const WINDOW: u32 = crate::nft::wire::NUMGEN_WINDOW;
/// Windows per map: offsets stay below 2^31, so a window's end never overflows.
pub const SHARD_WINDOWS: u32 = 2048;
pub use crate::plan::objects::SHARD_LOAD;

/// A window a balancing chain needs: its family, the chain (which names the service port and
/// the policy), and which of the chain's windows.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WindowId {
    pub family: IpFamily,
    pub chain: String,
    /// Slot group `g`'s window (a port of up to 255 slots has group 0 only), or [`SPLIT`].
    pub part: u32,
}

/// The part of the window of the split between a port's slot groups.
pub const SPLIT: u32 = u32::MAX;

impl WindowId {
    /// Window `part` of `chain`.
    pub fn new(family: IpFamily, chain: &str, part: u32) -> WindowId {
        WindowId { family, chain: chain.to_string(), part }
    }
}

/// The windows a balancing chain needs: one per slot group of its port (and one for the split
/// between them, with more than one), each as full as the chain's endpoints in that group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowDemand {
    pub family: IpFamily,
    pub chain: String,
    /// The service port whose affinity slots decide the groups; none: one window.
    pub port: Option<AffinityId>,
    /// The chain's endpoints (which decide how full each window's map is).
    pub endpoints: Vec<SlotTarget>,
}

/// Where a window is: map shard and offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub shard: u32,
    pub offset: u32,
}

impl Slot {
    /// The window number inside its shard.
    pub fn window(self) -> u32 {
        self.offset / WINDOW
    }
}

/// What one service asks of the placement: a window per balancing chain, slots per service
/// port with session affinity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Demands {
    pub windows: Vec<WindowDemand>,
    pub affinity: Vec<AffinityDemand>,
}

/// Where planning finds windows and affinity slots.
pub trait SlotLookup {
    /// The slot of a window, if it is placed.
    fn slot(&self, id: &WindowId) -> Option<Slot>;
    /// A service port's affinity slots, if it has any.
    fn affinity(&self, id: &AffinityId) -> Option<&AffinitySlots>;

    /// Where a service port's affinity clients are keyed: the window of its cluster-wide
    /// balancing chain (its first slot group's), else of its chain of this node's endpoints. Its
    /// client of slot `j` is `CLIENT . K + j` in `affinity-clients-N` of that window's shard, so
    /// both chains of a port share its clients, and no two ports' keys meet.
    fn clients(&self, id: &AffinityId) -> Option<Slot> {
        client_window(id).into_iter().find_map(|w| self.slot(&w))
    }
}

/// The windows a port's clients may be keyed by, in order of preference (see
/// [`SlotLookup::clients`]).
fn client_window(id: &AffinityId) -> [WindowId; 2] {
    [
        WindowId::new(id.family, &names::cluster_chain(&id.base), 0),
        WindowId::new(id.family, &names::local_chain(&id.base), 0),
    ]
}

/// One service's windows and affinity slots: what planning it again needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placed {
    pub windows: Vec<(WindowId, Slot)>,
    pub affinity: Vec<(AffinityId, AffinitySlots)>,
}

impl SlotLookup for Placed {
    fn slot(&self, id: &WindowId) -> Option<Slot> {
        self.windows.iter().find(|(w, _)| w == id).map(|(_, s)| *s)
    }

    fn affinity(&self, id: &AffinityId) -> Option<&AffinitySlots> {
        self.affinity.iter().find(|(a, _)| a == id).map(|(_, s)| s)
    }
}

/// Affinity client keys to empty: a slot whose endpoint went or was replaced, or a window newly
/// taken for a port's clients (a port gone, or placed while nftproxy did not run, may have left
/// clients under its keys). Its clients are the elements of `set` whose slot field is in
/// `first..=last`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotFlush {
    pub family: IpFamily,
    pub set: String,
    pub first: u32,
    pub last: u32,
    pub service: NamespacedName,
}

/// The ranges `n` endpoints get in `width` numbers at `offset`: `(first, last)` per endpoint.
pub fn ranges_in(offset: u32, n: u32, width: u32) -> Vec<(u32, u32)> {
    let n = n.clamp(1, width.max(1));
    let (width, extra) = (width / n, width % n);
    let mut start = offset;
    (0..n)
        .map(|i| {
            let len = width + u32::from(i < extra);
            let range = (start, start + len - 1);
            start += len;
            range
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    shard: u32,
    window: u32,
    load: u32,
}

/// One shared map's windows.
#[derive(Debug, Clone, Default)]
struct Shard {
    /// Windows given back below `top`.
    free: BTreeSet<u32>,
    top: u32,
    load: u32,
    blocks: usize,
}

impl Shard {
    fn take_window(&mut self) -> Option<u32> {
        if let Some(w) = self.free.pop_first() {
            return Some(w);
        }
        (self.top < SHARD_WINDOWS).then(|| {
            self.top += 1;
            self.top - 1
        })
    }

    fn has_window(&self) -> bool {
        !self.free.is_empty() || self.top < SHARD_WINDOWS
    }
}

/// Every placed window, by chain, and every service port's affinity slots, with the service
/// holding them.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    blocks: HashMap<WindowId, Block>,
    shards: BTreeMap<IpFamily, BTreeMap<u32, Shard>>,
    services: HashMap<NamespacedName, Vec<WindowId>>,
    affinity: HashMap<AffinityId, AffinitySlots>,
    affinity_of: HashMap<NamespacedName, Vec<AffinityId>>,
    /// Client keys to flush with the next transaction (see [`Placement::take_flushes`]).
    flushes: Vec<SlotFlush>,
    /// Slots whose binding changed since the windows were last placed, per port: flushed once
    /// the port's client window is known.
    rebound: Vec<(NamespacedName, AffinityId, Vec<usize>)>,
    /// Windows placed anew since then.
    fresh: HashSet<WindowId>,
}

impl Placement {
    /// Nothing placed (an empty kernel).
    pub fn new() -> Placement {
        Placement::default()
    }

    /// Places every service's windows at once, services in the order given. A window in
    /// `prior` (where it was placed before, or found in the kernel) stays there when demanded
    /// again, unless an earlier service already holds that spot; every other demand gets a free
    /// window. Windows of `prior` nobody demands are free. Affinity slots are seated from
    /// `prior_affinity` (see [`AffinitySlots::seat`]); the slots that changed endpoint are to be
    /// flushed.
    pub fn settle(
        prior: impl IntoIterator<Item = (WindowId, Slot)>,
        prior_affinity: impl IntoIterator<Item = (AffinityId, AffinitySlots)>,
        demands: impl IntoIterator<Item = (NamespacedName, Demands)>,
    ) -> Placement {
        let prior: HashMap<WindowId, Slot> = prior.into_iter().collect();
        let prior_affinity: HashMap<AffinityId, AffinitySlots> = prior_affinity.into_iter().collect();
        let demands: Vec<(NamespacedName, Demands)> = demands.into_iter().collect();
        let mut p = Placement::new();
        for (service, wanted) in &demands {
            for demand in &wanted.affinity {
                p.seat(service, demand, prior_affinity.get(&demand.id));
            }
        }
        let demands: Vec<(NamespacedName, Vec<(WindowId, u32)>)> =
            demands.into_iter().map(|(service, d)| (service, p.expand(&d.windows))).collect();
        // First the windows that stay, so that nothing new lands on them.
        let mut taken: BTreeSet<(IpFamily, u32, u32)> = BTreeSet::new();
        for (service, wanted) in &demands {
            for (id, load) in wanted {
                let Some(slot) = prior.get(id) else { continue };
                let at = (id.family, slot.shard, slot.window());
                if slot.offset % WINDOW != 0 || slot.window() >= SHARD_WINDOWS || !taken.insert(at) {
                    continue;
                }
                let shard = p.shards.entry(id.family).or_default().entry(slot.shard).or_default();
                shard.top = shard.top.max(slot.window() + 1);
                shard.load = shard.load.saturating_add(*load);
                shard.blocks += 1;
                p.blocks.insert(id.clone(), Block { shard: slot.shard, window: slot.window(), load: *load });
                p.services.entry(service.clone()).or_default().push(id.clone());
            }
        }
        for (family, shards) in &mut p.shards {
            for (id, shard) in shards.iter_mut() {
                shard.free = (0..shard.top).filter(|w| !taken.contains(&(*family, *id, *w))).collect();
            }
        }
        for (service, wanted) in demands {
            for (id, load) in wanted {
                if !p.blocks.contains_key(&id) {
                    p.allocate(&id, load);
                    p.services.entry(service.clone()).or_default().push(id);
                }
            }
        }
        p.resolve_flushes();
        p
    }

    /// Moves one service to the windows and slots it demands now: windows it keeps stay where
    /// they are (with their new endpoint counts), windows it no longer needs are freed, new ones
    /// placed; endpoints keep their affinity slots.
    pub fn update_service(&mut self, service: &NamespacedName, demands: &Demands) {
        let old_affinity = self.affinity_of.remove(service).unwrap_or_default();
        let mut prior: HashMap<AffinityId, AffinitySlots> =
            old_affinity.into_iter().filter_map(|id| Some((id.clone(), self.affinity.remove(&id)?))).collect();
        for demand in &demands.affinity {
            self.seat(service, demand, prior.remove(&demand.id).as_ref());
        }
        let demands = self.expand(&demands.windows);
        let old = self.services.remove(service).unwrap_or_default();
        for id in old.iter().filter(|id| !demands.iter().any(|(d, _)| d == *id)) {
            self.release(id);
        }
        for (id, load) in &demands {
            match self.blocks.get_mut(id) {
                Some(block) => {
                    let shards = self.shards.get_mut(&id.family);
                    if let Some(shard) = shards.and_then(|s| s.get_mut(&block.shard)) {
                        shard.load = shard.load.saturating_sub(block.load).saturating_add(*load);
                    }
                    block.load = *load;
                }
                None => self.allocate(id, *load),
            }
        }
        if !demands.is_empty() {
            self.services.insert(service.clone(), demands.into_iter().map(|(id, _)| id).collect());
        }
        self.drop_empty_shards();
        self.resolve_flushes();
    }

    /// Seats one port's affinity slots from `prior`, and notes the slots to flush.
    fn seat(&mut self, service: &NamespacedName, demand: &AffinityDemand, prior: Option<&AffinitySlots>) {
        let slots = AffinitySlots::seat(prior, &demand.endpoints);
        // Without a prior binding every bound slot is new: a set the kernel already holds (found
        // without readable bindings) may have clients in it.
        let none = AffinitySlots::default();
        let rebound = prior.unwrap_or(&none).flushed_by(&slots);
        self.rebound.push((service.clone(), demand.id.clone(), rebound));
        self.affinity.insert(demand.id.clone(), slots);
        self.affinity_of.entry(service.clone()).or_default().push(demand.id.clone());
    }

    /// The flushes of the ports seated since the windows were last placed: the whole window of
    /// a port whose client window is new, else the slots whose binding changed.
    fn resolve_flushes(&mut self) {
        let fresh = std::mem::take(&mut self.fresh);
        for (service, id, slots) in std::mem::take(&mut self.rebound) {
            let Some(window) = client_window(&id).into_iter().find(|w| self.blocks.contains_key(w)) else { continue };
            let Some(at) = self.slot(&window) else { continue };
            let set = SharedSet::SlotClients(at.shard).name().into_owned();
            let flush = |first: u32, last: u32| SlotFlush {
                family: id.family,
                set: set.clone(),
                first,
                last,
                service: service.clone(),
            };
            if fresh.contains(&window) {
                self.flushes.push(flush(at.offset, at.offset + (WINDOW - 1)));
                continue;
            }
            for j in slots {
                let key = at.offset.saturating_add(u32::try_from(j).unwrap_or(u32::MAX));
                self.flushes.push(flush(key, key));
            }
        }
    }

    /// The client keys to empty since the last call: the transaction that binds a slot anew must
    /// remove its clients, or a client recorded for the old endpoint would stick to the new one.
    pub fn take_flushes(&mut self) -> Vec<SlotFlush> {
        std::mem::take(&mut self.flushes)
    }

    /// Every service port's affinity slots.
    pub fn affinity_slots(&self) -> impl Iterator<Item = (AffinityId, AffinitySlots)> + '_ {
        self.affinity.iter().map(|(id, s)| (id.clone(), s.clone()))
    }

    /// Every placed window and its slot.
    pub fn windows(&self) -> impl Iterator<Item = (WindowId, Slot)> + '_ {
        self.blocks.iter().map(|(id, b)| (id.clone(), Slot { shard: b.shard, offset: b.window * WINDOW }))
    }

    /// The endpoint maps in use, and the client sets.
    pub fn maps(&self) -> BTreeSet<(IpFamily, SharedSet)> {
        let shards: BTreeSet<(IpFamily, u32)> = self.blocks.iter().map(|(id, b)| (id.family, b.shard)).collect();
        let clients =
            self.affinity.keys().filter_map(|id| Some((id.family, SharedSet::SlotClients(self.clients(id)?.shard))));
        shards
            .into_iter()
            .flat_map(|(family, shard)| SharedSet::affinity_shard(shard).map(move |m| (family, m)))
            .chain(clients)
            .collect()
    }

    /// The windows and affinity slots one service holds.
    pub fn placed(&self, service: &NamespacedName) -> Placed {
        let ids = self.services.get(service).map(Vec::as_slice).unwrap_or_default();
        let affinity = self.affinity_of.get(service).map(Vec::as_slice).unwrap_or_default();
        Placed {
            windows: ids.iter().filter_map(|id| Some((id.clone(), self.slot(id)?))).collect(),
            affinity: affinity.iter().filter_map(|id| Some((id.clone(), self.affinity.get(id)?.clone()))).collect(),
        }
    }

    /// The windows chains need, with how many endpoints each holds: one per slot group of the
    /// chain's port (as seated: call after seating), and the split's with more than one.
    fn expand(&self, demands: &[WindowDemand]) -> Vec<(WindowId, u32)> {
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let mut out = Vec::new();
        for demand in demands {
            let slots = demand.port.as_ref().and_then(|p| self.affinity.get(p)).filter(|s| s.grouped());
            let Some(slots) = slots else {
                out.push((WindowId::new(demand.family, &demand.chain, 0), count(demand.endpoints.len())));
                continue;
            };
            let index = slots.index();
            let mut loads = vec![0usize; slots.groups()];
            for ep in &demand.endpoints {
                if let Some(load) = index.get(ep).and_then(|j| loads.get_mut(AffinitySlots::group_of(*j).0)) {
                    *load += 1;
                }
            }
            for (g, load) in loads.into_iter().enumerate() {
                let part = u32::try_from(g).unwrap_or(u32::MAX);
                out.push((WindowId::new(demand.family, &demand.chain, part), count(load)));
            }
            out.push((WindowId::new(demand.family, &demand.chain, SPLIT), 0));
        }
        out
    }

    fn allocate(&mut self, id: &WindowId, n: u32) {
        let shards = self.shards.entry(id.family).or_default();
        let fits = |s: &Shard| s.has_window() && s.load.saturating_add(n) <= SHARD_LOAD;
        let shard = match shards.iter().find(|(_, s)| fits(s)) {
            Some((number, _)) => *number,
            // The lowest unused shard number, so names stay small and are reused.
            None => (0..).find(|i| !shards.contains_key(i)).unwrap_or(0),
        };
        let entry = shards.entry(shard).or_default();
        let window = entry.take_window().unwrap_or(0);
        entry.load = entry.load.saturating_add(n);
        entry.blocks += 1;
        self.blocks.insert(id.clone(), Block { shard, window, load: n });
        self.fresh.insert(id.clone());
    }

    fn release(&mut self, id: &WindowId) {
        let Some(block) = self.blocks.remove(id) else { return };
        if let Some(shard) = self.shards.get_mut(&id.family).and_then(|s| s.get_mut(&block.shard)) {
            shard.free.insert(block.window);
            shard.load = shard.load.saturating_sub(block.load);
            shard.blocks = shard.blocks.saturating_sub(1);
        }
    }

    fn drop_empty_shards(&mut self) {
        for shards in self.shards.values_mut() {
            shards.retain(|_, s| s.blocks > 0);
        }
    }
}

impl SlotLookup for Placement {
    fn slot(&self, id: &WindowId) -> Option<Slot> {
        self.blocks.get(id).map(|b| Slot { shard: b.shard, offset: b.window * WINDOW })
    }

    fn affinity(&self, id: &AffinityId) -> Option<&AffinitySlots> {
        self.affinity.get(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::affinity::AffinityDemand;

    const F: IpFamily = IpFamily::V4;

    fn at(shard: u32, window: u32) -> Slot {
        Slot { shard, offset: window * WINDOW }
    }

    fn id(chain: &str) -> WindowId {
        WindowId::new(F, chain, 0)
    }

    fn endpoints(n: u32) -> Vec<SlotTarget> {
        (0..n).map(|i| (std::net::IpAddr::from(std::net::Ipv4Addr::from((10u32 << 24) + i)), 80)).collect()
    }

    fn want(chain: &str, n: u32) -> WindowDemand {
        WindowDemand { family: F, chain: chain.to_string(), port: None, endpoints: endpoints(n) }
    }

    fn windows(windows: Vec<WindowDemand>) -> Demands {
        Demands { windows, affinity: Vec::new() }
    }

    fn svc(name: &str) -> NamespacedName {
        NamespacedName::new("ns", name)
    }

    #[test]
    fn ranges_split_a_window_evenly() {
        let r = ranges_in(WINDOW, 3, WINDOW);
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].0, WINDOW);
        assert_eq!(r[2].1, 2 * WINDOW - 1);
        for pair in r.windows(2) {
            assert_eq!(pair[0].1 + 1, pair[1].0, "contiguous");
        }
        let sizes: Vec<u32> = r.iter().map(|(a, b)| b - a + 1).collect();
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{sizes:?}");
        assert_eq!(ranges_in(0, 1, WINDOW), vec![(0, WINDOW - 1)]);
    }

    #[test]
    fn windows_never_move_and_are_reused_when_freed() {
        let mut p = Placement::settle(
            [],
            [],
            [(svc("a"), windows(vec![want("a", 3)])), (svc("b"), windows(vec![want("b", 5)]))],
        );
        assert_eq!(p.slot(&id("a")), Some(at(0, 0)));
        assert_eq!(p.slot(&id("b")), Some(at(0, 1)));
        p.update_service(&svc("a"), &windows(vec![want("a", SHARD_LOAD / 2)]));
        assert_eq!(p.slot(&id("a")), Some(at(0, 0)), "growing keeps the window");
        p.update_service(&svc("c"), &windows(vec![want("c", 2)]));
        assert_eq!(p.slot(&id("c")), Some(at(0, 2)));
        p.update_service(&svc("b"), &Demands::default());
        p.update_service(&svc("d"), &windows(vec![want("d", 2)]));
        assert_eq!(p.slot(&id("d")), Some(at(0, 1)), "b's window is free again");
        assert_eq!(p.placed(&svc("b")), Placed::default());
    }

    #[test]
    fn a_full_map_sends_new_windows_to_the_next_and_empty_maps_go() {
        let mut p = Placement::new();
        p.update_service(&svc("big"), &windows(vec![want("big", SHARD_LOAD - 10)]));
        p.update_service(&svc("next"), &windows(vec![want("next", 20)]));
        p.update_service(&svc("small"), &windows(vec![want("small", 10)]));
        assert_eq!(p.slot(&id("big")), Some(at(0, 0)));
        assert_eq!(p.slot(&id("next")), Some(at(1, 0)), "map 0 is full");
        assert_eq!(p.slot(&id("small")), Some(at(0, 1)), "map 0 still takes what fits");
        let v6 = WindowDemand { family: IpFamily::V6, ..want("a", 3) };
        p.update_service(&svc("a"), &windows(vec![v6]));
        assert_eq!(p.slot(&WindowId::new(IpFamily::V6, "a", 0)), Some(at(0, 0)), "families are separate spaces");
        p.update_service(&svc("next"), &Demands::default());
        assert_eq!(p.shards[&F].len(), 1, "map 1 was dropped when it emptied");
    }

    #[test]
    fn settling_keeps_prior_windows_and_gives_conflicts_to_the_first() {
        let prior = vec![
            (id("a"), at(0, 3)),
            (id("b"), at(0, 0)),
            (id("x"), at(0, 3)),
            (id("c"), at(3, 0)),
            (id("gone"), at(0, 1)),
            (id("odd"), Slot { shard: 0, offset: 5 }),
        ];
        let demands = vec![
            (svc("a"), vec![want("a", 3)]),
            (svc("b"), vec![want("b", 3)]),
            (svc("c"), vec![want("c", 8)]),
            (svc("d"), vec![want("d", 2)]),
            (svc("odd"), vec![want("odd", 2)]),
            (svc("x"), vec![want("x", 2)]),
        ];
        let p = Placement::settle(prior, [], demands.into_iter().map(|(s, w)| (s, windows(w))));
        assert_eq!(p.slot(&id("a")), Some(at(0, 3)));
        assert_eq!(p.slot(&id("b")), Some(at(0, 0)));
        assert_eq!(p.slot(&id("c")), Some(at(3, 0)));
        assert_eq!(p.slot(&id("d")), Some(at(0, 1)), "the window nobody kept is free");
        assert_eq!(p.slot(&id("odd")), Some(at(0, 2)), "an offset that is not a window is not kept");
        assert_eq!(p.slot(&id("x")), Some(at(0, 4)), "x claimed a's window: it gets a free one");
        assert_eq!(p.slot(&id("gone")), None);
    }
    /// A service whose affinity port has `n` endpoints from the `first`, with its cluster
    /// chain's windows.
    fn affine_from(name: &str, first: u32, n: u32) -> Demands {
        let port = AffinityId { family: F, base: name.to_string() };
        let eps: Vec<SlotTarget> = endpoints(first + n).split_off(first as usize);
        let chain = WindowDemand { port: Some(port.clone()), endpoints: eps.clone(), ..want(&chain(name), 0) };
        Demands { windows: vec![chain], affinity: vec![AffinityDemand { id: port, endpoints: eps }] }
    }

    fn affine(name: &str, n: u32) -> Demands {
        affine_from(name, 0, n)
    }

    /// The cluster chain of the port `name` (its windows key its clients).
    fn chain(name: &str) -> String {
        names::cluster_chain(name)
    }

    #[test]
    fn each_slot_group_and_the_split_have_a_window_placed_like_a_port_of_their_own() {
        let mut p = Placement::new();
        p.update_service(&svc("small"), &affine("small", 3));
        assert_eq!(p.placed(&svc("small")).windows, vec![(id(&chain("small")), at(0, 0))], "one group: one window");
        // 1,600 endpoints, 2,000 slots: 8 groups (6 of 255 endpoints, one of 70, one empty) and
        // the split.
        p.update_service(&svc("big"), &affine("big", 1600));
        let placed = p.placed(&svc("big")).windows;
        assert_eq!(placed.len(), 9);
        let part = |g: u32| p.slot(&WindowId::new(F, &chain("big"), g)).unwrap();
        // Map 0 holds small's 3 endpoints; a group of 255 does not fit it, so each takes a map of
        // its own; the group of 70, the empty one and the split (no endpoints) fit map 0.
        assert_eq!((part(0), part(1), part(2), part(3)), (at(1, 0), at(2, 0), at(3, 0), at(4, 0)));
        assert_eq!((part(4), part(5), part(6), part(7)), (at(5, 0), at(6, 0), at(0, 1), at(0, 2)));
        assert_eq!(p.slot(&WindowId::new(F, &chain("big"), SPLIT)), Some(at(0, 3)));
        let clients = [(F, SharedSet::SlotClients(0)), (F, SharedSet::SlotClients(1))];
        assert!(clients.iter().all(|c| p.maps().contains(c)), "each port's clients are keyed in its first group's map");
        assert_eq!(p.maps().len(), 7 * 3 + 2, "seven maps of each kind, two client sets");
        // Shrinking to one group gives the other windows back.
        p.update_service(&svc("big"), &affine("big", 100));
        assert_eq!(p.placed(&svc("big")).windows, vec![(id(&chain("big")), at(1, 0))]);
        assert_eq!(p.maps().len(), 2 * 3 + 2);
    }

    #[test]
    fn a_new_client_window_is_emptied_and_a_rebound_slot_is() {
        let mut p = Placement::new();
        p.update_service(&svc("a"), &affine("a", 3));
        let flush = |first: u32, last: u32| SlotFlush {
            family: F,
            set: "affinity-clients-0".into(),
            first,
            last,
            service: svc("a"),
        };
        assert_eq!(p.take_flushes(), vec![flush(0, WINDOW - 1)], "the window may hold a gone port's clients");
        p.update_service(&svc("b"), &affine("b", 2));
        assert_eq!(p.take_flushes().len(), 1);
        // Endpoint 0 replaced by endpoint 3: it takes the free slot 3; slots 0 and 3 change.
        p.update_service(&svc("a"), &affine_from("a", 1, 3));
        assert_eq!(p.take_flushes(), vec![flush(0, 0), flush(3, 3)]);
        p.update_service(&svc("a"), &affine_from("a", 1, 3));
        assert_eq!(p.take_flushes(), vec![], "nothing changed");
        // Gone: its keys are emptied when another port takes its window.
        p.update_service(&svc("a"), &Demands::default());
        assert_eq!(p.take_flushes(), vec![]);
        p.update_service(&svc("c"), &affine("c", 1));
        let c = SlotFlush { service: svc("c"), ..flush(0, WINDOW - 1) };
        assert_eq!(p.take_flushes(), vec![c]);
    }
}
