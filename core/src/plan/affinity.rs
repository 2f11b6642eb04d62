//! Session affinity as data: each service port with ClientIP affinity has a fixed number of
//! **slots**, and endpoints are bound to slots by map elements, so that an endpoint coming or
//! going changes elements only (no rule, no chain, no `goto`: nothing that makes the kernel
//! validate the table).
//!
//! A port has one dynamic set `affinity-…` of `client . slot` (upstream keeps one set of clients
//! per endpoint). A balancing chain over the port's endpoints, with its window at offset `W` of
//! an `affinity-endpoints-N` map, holds:
//! - per slot `j`, the sticky check: `ip saddr . numgen inc mod 1 offset j @affinity-…` (the
//!   client is recorded in slot `j`; `numgen inc mod 1` is always 0, so the field is the
//!   constant `j`), `numgen inc mod 1 offset W+j @affinity-targets-N` (the slot is bound), the
//!   update that refreshes the entry, then `dnat to numgen inc mod 1 offset W+j map
//!   @affinity-targets-N`, the endpoint bound to the slot;
//! - per slot `j`, the record: `jhash ip saddr . th sport mod M … offset W+M(j+1)
//!   @affinity-windows-N update @affinity-… { ip saddr . j }`: the map holds, at the slot's own
//!   offset, the hash range its endpoint gets below;
//! - the choice: `dnat to jhash ip saddr . th sport mod M … offset W map @affinity-endpoints-N`,
//!   one hash range per endpoint.
//!
//! The record and the choice hash the same fields with the same seed, so a new client is
//! recorded in the slot of the endpoint it is sent to. A port with C slots has `M = 2^20 / 2^k`
//! for the smallest `2^k > C`: its window holds the choice's range and one range per slot.
//!
//! **Groups.** Each slot needs its own copy of the choice's range, so one window holds at most
//! [`GROUP_SLOTS`] slots with `M` at least 4,096 (each endpoint's share of the range at least
//! 16 numbers). A port with more slots splits them into groups of [`GROUP_SLOTS`] (slot `j` is
//! slot `j % 255` of group `j / 255`). The sticky checks stay in the chain, one per slot; each
//! group's records and choice, exactly as above with the seed `SEED + g` and a window of the
//! group's own (placed on its own, in any map, so the maps a group's rules look up stay as
//! small as a shard's), are in a chain of the group's own (`…_gG`). After the sticky checks, a
//! second hash, of another seed ([`GROUP_SEED`]) and modulus `S`, picks the group in proportion
//! to its endpoints: one rule per group, `jhash … seed GROUP_SEED … @affinity-windows-N goto
//! …_gG`, the split's window holding at `S·g` from its start group `g`'s share of `S`. So a
//! client is recorded and balanced in one group, and a new client passes one gate per group
//! and its group's records, not every slot's record. A port has at most [`MAX_GROUPS`] groups
//! (261,120 slots); a port of up to 255 slots has one group, no group chain and no gate, the
//! shape of every small port.
//!
//! C leaves room for a quarter more endpoints, rounded up (at least one: a rolling update's
//! surge), grows when they outgrow it and shrinks when it is more than twice what they need;
//! both change rules, which is rare. An endpoint keeps its slot while it stays. Whenever a
//! slot's binding changes (its endpoint goes, another comes, the slot goes with a shrink), the
//! clients recorded in it are deleted in the same transaction (upstream deletes the endpoint's
//! set), so that no client follows a slot to another endpoint. A new endpoint takes a slot that
//! was free before the change rather than one its endpoint is leaving, so that clients recorded
//! while the deleting transaction was being built are deleted when the slot is bound again.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use crate::net::IpFamily;
use crate::nft::ast::Jhash;

use crate::nft::wire::NUMGEN_WINDOW as WINDOW;

/// The `jhash` seed of every affinity rule of a port's first slot group ("nftp"); group `g`
/// uses `SEED + g`. Any constants do, as long as the record and the choice of a group use the
/// same one.
pub const SEED: u32 = 0x6e66_7470;
/// The `jhash` seed of the split between slot groups ("grup"): not `SEED + g` for any group, so
/// the group a connection falls in and its hash inside the group are independent.
pub const GROUP_SEED: u32 = 0x6772_7570;
/// Slot bits of a group: 255 slots, each slot's part of the group's window (M) at least 4,096
/// numbers wide.
const GROUP_BITS: u32 = 8;
/// Slots per group.
pub const GROUP_SLOTS: usize = (1 << GROUP_BITS) - 1;
/// Most groups of a port: each group's part of the split is at least 1,024 numbers wide.
pub const MAX_GROUPS: usize = 1 << 10;
/// Most slots of a port.
pub const MAX_SLOTS: usize = GROUP_SLOTS * MAX_GROUPS;

/// An endpoint as a slot is bound to it.
pub type SlotTarget = (IpAddr, u16);

/// A service port in one family, as its affinity slots are keyed: the base of its object names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AffinityId {
    pub family: IpFamily,
    pub base: String,
}

/// What a service port with affinity asks for: its endpoints, in planning order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AffinityDemand {
    pub id: AffinityId,
    pub endpoints: Vec<SlotTarget>,
}

/// A port's slots and the endpoint bound to each (the default: none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AffinitySlots {
    bound: Vec<Option<SlotTarget>>,
}

impl AffinitySlots {
    /// Slots for `endpoints`: those bound in `prior` keep their slot, the others take free ones,
    /// those free in `prior` first, lowest first. Endpoints beyond the largest capacity get none.
    pub fn seat(prior: Option<&AffinitySlots>, endpoints: &[SlotTarget]) -> AffinitySlots {
        let wanted = slots_for(endpoints.len());
        let capacity = match prior.map(AffinitySlots::capacity) {
            Some(c) if c >= endpoints.len().min(MAX_SLOTS) && c <= 2 * wanted => c,
            _ => wanted,
        };
        let prior_slots = prior.map(AffinitySlots::index).unwrap_or_default();
        let mut bound: Vec<Option<SlotTarget>> = vec![None; capacity];
        let mut seated: HashSet<SlotTarget> = HashSet::with_capacity(endpoints.len());
        let mut unseated = Vec::new();
        for ep in endpoints {
            let kept = prior_slots.get(ep).copied().filter(|j| *j < bound.len() && bound[*j].is_none());
            match kept {
                Some(j) => {
                    bound[j] = Some(*ep);
                    seated.insert(*ep);
                }
                None => unseated.push(*ep),
            }
        }
        let was_free = |j: &usize| prior.is_none_or(|p| p.bound.get(*j).is_none_or(Option::is_none));
        let (mut free, vacated): (Vec<usize>, Vec<usize>) =
            (0..bound.len()).filter(|j| bound[*j].is_none()).partition(was_free);
        free.extend(vacated);
        let mut free = free.into_iter();
        for ep in unseated {
            if !seated.insert(ep) {
                continue;
            }
            let Some(j) = free.next() else { break };
            bound[j] = Some(ep);
        }
        AffinitySlots { bound }
    }

    /// Slots as found in the kernel: how many from the rules, bindings from the targets map.
    pub fn found(capacity: usize, bindings: impl IntoIterator<Item = (usize, SlotTarget)>) -> Option<AffinitySlots> {
        if !(1..=MAX_SLOTS).contains(&capacity) {
            return None;
        }
        let mut bound = vec![None; capacity];
        // A key past the slots is not ours to keep: its slot is treated as free (and its
        // clients, if any, as a slot whose binding changes).
        for (j, ep) in bindings {
            if let Some(slot) = bound.get_mut(j) {
                *slot = Some(ep);
            }
        }
        Some(AffinitySlots { bound })
    }

    /// How many slots the port has.
    pub fn capacity(&self) -> usize {
        self.bound.len()
    }

    /// The slot `endpoint` is bound to.
    #[cfg(any(test, feature = "testing"))]
    pub fn slot_of(&self, endpoint: SlotTarget) -> Option<usize> {
        self.bound.iter().position(|b| *b == Some(endpoint))
    }

    /// Every bound endpoint's slot.
    pub fn index(&self) -> HashMap<SlotTarget, usize> {
        self.bound.iter().enumerate().filter_map(|(j, b)| Some(((*b)?, j))).collect()
    }

    /// The slots whose clients must be deleted going from `self` to `new`: every slot whose
    /// binding changes, a slot past either capacity counting as unbound. An unbound slot can
    /// hold clients recorded while the transaction that unbound it was being built, or found
    /// in the kernel without a binding; deleting them on binding keeps them from following.
    pub fn flushed_by(&self, new: &AffinitySlots) -> Vec<usize> {
        let at = |s: &AffinitySlots, j: usize| s.bound.get(j).copied().flatten();
        (0..self.capacity().max(new.capacity())).filter(|j| at(self, *j) != at(new, *j)).collect()
    }

    /// How many slot groups the port has (see the module's documentation).
    pub fn groups(&self) -> usize {
        self.capacity().div_ceil(GROUP_SLOTS).clamp(1, MAX_GROUPS)
    }

    /// Whether the slots are split into groups, chosen by a hash of their own.
    pub fn grouped(&self) -> bool {
        self.groups() > 1
    }

    /// Slot `j`'s group and its place in the group.
    pub fn group_of(j: usize) -> (usize, usize) {
        (j / GROUP_SLOTS, j % GROUP_SLOTS)
    }

    /// How many slots group `g` has.
    pub fn group_capacity(&self, g: usize) -> usize {
        self.capacity().saturating_sub(g * GROUP_SLOTS).min(GROUP_SLOTS)
    }

    /// The range of the hash the rules of group `g` draw from.
    pub fn modulus(&self, g: usize) -> u32 {
        let parts = u32::try_from(self.group_capacity(g) + 1).unwrap_or(u32::MAX).next_power_of_two();
        WINDOW / parts.min(1 << GROUP_BITS)
    }

    /// The seed of group `g`'s hash.
    pub fn seed(g: usize) -> u32 {
        SEED.wrapping_add(u32::try_from(g).unwrap_or(0))
    }

    /// Group `g`'s choice in a chain with the group's window at `window`.
    pub fn choice(&self, window: u32, g: usize) -> Jhash {
        Jhash { modulus: self.modulus(g), seed: Self::seed(g), offset: window }
    }

    /// Slot `j`'s record in a chain with its group's window at `window`: the group's hash,
    /// moved to the slot's own part of the window.
    pub fn record(&self, window: u32, j: usize) -> Jhash {
        let (g, _) = Self::group_of(j);
        Jhash { modulus: self.modulus(g), seed: Self::seed(g), offset: window + self.shift(j) }
    }

    /// How far slot `j`'s hash ranges sit above its group's choice.
    pub fn shift(&self, j: usize) -> u32 {
        let (g, i) = Self::group_of(j);
        self.modulus(g) * (u32::try_from(i).unwrap_or(0) + 1)
    }

    /// The range of the hash that chooses the group (grouped slots only).
    pub fn split_modulus(&self) -> u32 {
        let groups = u32::try_from(self.groups()).unwrap_or(u32::MAX).next_power_of_two();
        WINDOW / groups
    }

    /// The gate of group `g` in a chain with the split's window at `split` (grouped slots
    /// only): the split's hash, moved to the group's part of that window.
    pub fn group_check(&self, split: u32, g: usize) -> Jhash {
        let offset = split + self.split_modulus() * u32::try_from(g).unwrap_or(0);
        Jhash { modulus: self.split_modulus(), seed: GROUP_SEED, offset }
    }

    /// Slot `j`'s key in the targets map, for a chain with its group's window at `window`: its
    /// place in the group.
    pub fn target_key(window: u32, j: usize) -> u32 {
        window + u32::try_from(Self::group_of(j).1).unwrap_or(0)
    }

    /// The window a targets key belongs to (a group's), and the key's place in it.
    pub fn slot_of_key(key: u32) -> (u32, usize) {
        let window = key - key % WINDOW;
        (window, (key - window) as usize)
    }

    /// Whether a chain's rules could have this modulus (a window split in a power of two; an
    /// earlier version split one window in up to 1,024 parts).
    pub fn is_modulus(modulus: u32) -> bool {
        modulus.is_power_of_two() && (WINDOW >> 10..WINDOW).contains(&modulus)
    }
}

/// The slots for `n` endpoints: a quarter more, at least one more (a rolling update's surge).
fn slots_for(n: usize) -> usize {
    (n + n.div_ceil(4).max(1)).min(MAX_SLOTS)
}

/// `width` numbers split in proportion to `weights`, in order: `(first, last)` for each nonzero
/// weight (at least one number each, as long as `width` has one for each), `None` for a zero.
pub fn weighted_ranges(width: u32, weights: &[u32]) -> Vec<Option<(u32, u32)>> {
    let nonzero = u64::try_from(weights.iter().filter(|w| **w > 0).count()).unwrap_or(u64::MAX);
    let total: u64 = weights.iter().map(|w| u64::from(*w)).sum();
    let width = u64::from(width);
    // One number each first, the rest in proportion, by the cumulative weight so that the
    // ranges are contiguous and fill `width` exactly.
    let rest = width.saturating_sub(nonzero);
    let (mut seen, mut counted, mut start) = (0u64, 0u64, 0u64);
    weights
        .iter()
        .map(|w| {
            if *w == 0 || total == 0 {
                return None;
            }
            seen += u64::from(*w);
            counted += 1;
            let end = (counted.min(width) + rest * seen / total).min(width);
            let range = (end > start).then(|| (start as u32, (end - 1) as u32));
            start = end;
            range
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(i: u8) -> SlotTarget {
        (IpAddr::from([10, 0, 0, i]), 80)
    }

    #[test]
    fn endpoints_keep_their_slots_and_new_ones_take_free_slots() {
        let a = AffinitySlots::seat(None, &[ep(1), ep(2)]);
        assert_eq!(a.capacity(), 3);
        assert_eq!((a.slot_of(ep(1)), a.slot_of(ep(2))), (Some(0), Some(1)));
        let b = AffinitySlots::seat(Some(&a), &[ep(2), ep(3)]);
        assert_eq!((b.slot_of(ep(2)), b.slot_of(ep(3)), b.slot_of(ep(1))), (Some(1), Some(2), None));
        assert_eq!(a.flushed_by(&b), vec![0, 2], "slot 2 was free before: it is taken, slot 0 is left");
        let c = AffinitySlots::seat(Some(&b), &[ep(2), ep(3), ep(4)]);
        assert_eq!(c.slot_of(ep(4)), Some(0), "the slot left earlier, emptied again when bound");
        assert_eq!(b.flushed_by(&c), vec![0]);
        assert!(c.flushed_by(&c.clone()).is_empty(), "nothing changed");
    }

    #[test]
    fn slots_leave_room_grow_when_outgrown_and_shrink_when_twice_too_many() {
        let eps: Vec<SlotTarget> = (1..=40).map(ep).collect();
        let a = AffinitySlots::seat(None, &eps[..1]);
        assert_eq!(a.capacity(), 2, "one endpoint and room for one more");
        let b = AffinitySlots::seat(Some(&a), &eps[..2]);
        assert_eq!(b.capacity(), 2, "the room is used: no change of rules");
        let c = AffinitySlots::seat(Some(&b), &eps[..3]);
        assert_eq!(c.capacity(), 4);
        assert_eq!(c.slot_of(ep(1)), Some(0), "growing keeps the bindings");
        assert_eq!(b.flushed_by(&c), vec![2], "only the slot the new endpoint takes");
        assert_eq!(AffinitySlots::seat(None, &eps[..10]).capacity(), 13);
        let big = AffinitySlots::seat(None, &eps[..40]);
        assert_eq!(big.capacity(), 50);
        assert_eq!(AffinitySlots::seat(Some(&big), &eps[..20]).capacity(), 50, "twice fewer: no change of rules");
        let small = AffinitySlots::seat(Some(&big), &eps[38..]);
        assert_eq!(small.capacity(), 3);
        assert_eq!(small.slot_of(ep(39)), Some(0), "moved below the new capacity");
        let flushed = big.flushed_by(&small);
        assert_eq!(flushed, (0..40).collect::<Vec<_>>(), "every bound slot: moved, emptied or gone");
    }

    #[test]
    fn a_window_holds_the_choice_and_every_slot() {
        let s = AffinitySlots::seat(None, &(1..=10).map(ep).collect::<Vec<_>>());
        assert_eq!((s.capacity(), s.modulus(0), s.groups()), (13, 1 << 16, 1));
        assert_eq!(s.choice(5 * WINDOW, 0), Jhash { modulus: 1 << 16, seed: SEED, offset: 5 * WINDOW });
        let last = s.record(5 * WINDOW, s.capacity() - 1);
        assert!(last.offset + last.modulus <= 6 * WINDOW, "the last slot ends inside the window");
        assert_eq!(AffinitySlots::slot_of_key(AffinitySlots::target_key(5 * WINDOW, 12)), (5 * WINDOW, 12));
        assert!(AffinitySlots::is_modulus(s.modulus(0)));
        assert!(!AffinitySlots::is_modulus(WINDOW));
        let full = AffinitySlots::seat(None, &(1..=15).map(ep).collect::<Vec<_>>());
        assert_eq!((full.capacity(), full.modulus(0)), (19, 1 << 15));
    }

    fn many(n: u32) -> Vec<SlotTarget> {
        (0..n).map(|i| (IpAddr::from(std::net::Ipv4Addr::from((10u32 << 24) + i)), 80)).collect()
    }

    #[test]
    fn a_port_of_up_to_255_slots_has_one_group_and_larger_ones_a_group_per_255() {
        let one = AffinitySlots::seat(None, &many(204));
        assert_eq!((one.capacity(), one.groups(), one.grouped()), (255, 1, false));
        assert_eq!(one.modulus(0), WINDOW >> 8, "255 slots and the choice: 256 parts");
        let two = AffinitySlots::seat(None, &many(205));
        assert_eq!((two.capacity(), two.groups()), (257, 2));
        assert_eq!((two.group_capacity(0), two.group_capacity(1)), (255, 2));
        assert_eq!((two.modulus(0), two.modulus(1)), (WINDOW >> 8, WINDOW >> 2));
        assert_eq!(two.split_modulus(), WINDOW >> 1);
        // Slot 256 is the second of group 1, whose window is at w.
        let w = 7 * WINDOW;
        assert_eq!(AffinitySlots::target_key(w, 256), w + 1);
        assert_eq!(two.record(w, 256), Jhash { modulus: WINDOW >> 2, seed: SEED + 1, offset: w + 2 * (WINDOW >> 2) });
        assert_eq!(two.choice(w, 1), Jhash { modulus: WINDOW >> 2, seed: SEED + 1, offset: w });
        // The split's window: a part per group.
        assert_eq!(two.group_check(w, 0), Jhash { modulus: WINDOW >> 1, seed: GROUP_SEED, offset: w });
        assert_eq!(two.group_check(w, 1), Jhash { modulus: WINDOW >> 1, seed: GROUP_SEED, offset: w + (WINDOW >> 1) });
        for j in 0..two.capacity() {
            let r = two.record(w, j);
            assert!(r.offset >= w + r.modulus && r.offset + r.modulus <= w + WINDOW, "slot {j}");
        }
    }

    #[test]
    fn thousands_of_endpoints_all_get_slots() {
        let eps = many(5000);
        let s = AffinitySlots::seat(None, &eps);
        assert_eq!((s.capacity(), s.groups()), (6250, 25));
        assert_eq!(s.index().len(), 5000, "every endpoint has a slot");
        assert!((0..s.groups()).all(|g| s.modulus(g) >= WINDOW >> 8), "each group's hash range stays wide");
        let grown = AffinitySlots::seat(Some(&s), &many(6000));
        assert_eq!(grown.capacity(), 6250, "the room is used");
        assert!(eps.iter().all(|e| grown.slot_of(*e) == s.slot_of(*e)), "endpoints keep their slots");
        let outgrown = AffinitySlots::seat(Some(&grown), &many(6300));
        assert_eq!((outgrown.capacity(), outgrown.groups()), (7875, 31));
        assert!(eps.iter().all(|e| outgrown.slot_of(*e) == s.slot_of(*e)), "growing keeps the bindings");
    }

    #[test]
    fn the_split_gives_each_group_its_share_and_at_least_one_number() {
        assert_eq!(weighted_ranges(100, &[1, 0, 3]), vec![Some((0, 24)), None, Some((25, 99))]);
        assert_eq!(weighted_ranges(8, &[1000, 1, 1]), vec![Some((0, 4)), Some((5, 5)), Some((6, 7))]);
        let ranges = weighted_ranges(1 << 15, &[255; 19].iter().copied().chain([155, 0, 0]).collect::<Vec<_>>());
        assert_eq!(ranges.iter().flatten().last().map(|r| r.1), Some((1 << 15) - 1), "the whole range");
        assert_eq!(weighted_ranges(4, &[0, 0]), vec![None, None]);
    }

    #[test]
    fn slots_found_in_the_kernel_keep_what_fits() {
        let found = AffinitySlots::found(3, [(0, ep(1)), (7, ep(2)), (2, ep(3))]).unwrap();
        assert_eq!((found.capacity(), found.slot_of(ep(1)), found.slot_of(ep(3))), (3, Some(0), Some(2)));
        assert_eq!(found.slot_of(ep(2)), None, "a key past the slots is dropped, not the port");
        assert!(AffinitySlots::found(0, []).is_none());
        assert!(AffinitySlots::found(MAX_SLOTS + 1, []).is_none());
    }

    #[test]
    fn endpoints_past_the_largest_capacity_get_no_slot() {
        let eps = many(u32::try_from(MAX_SLOTS).unwrap() + 10);
        let s = AffinitySlots::seat(None, &eps);
        assert_eq!((s.capacity(), s.groups()), (MAX_SLOTS, MAX_GROUPS));
        let index = s.index();
        assert_eq!(index.get(&eps[MAX_SLOTS - 1]), Some(&(MAX_SLOTS - 1)));
        assert_eq!(index.get(&eps[MAX_SLOTS]), None);
        assert_eq!(s.split_modulus(), WINDOW >> 10);
    }
}
