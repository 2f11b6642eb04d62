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
//! C leaves room for a quarter more endpoints, rounded up (at least one: a rolling update's
//! surge), grows when they outgrow it and shrinks when it is more than twice what they need;
//! both change rules, which is rare. An endpoint keeps its slot while it stays. Whenever a
//! slot's binding changes (its endpoint goes, another comes, the slot goes with a shrink), the
//! clients recorded in it are deleted in the same transaction (upstream deletes the endpoint's
//! set), so that no client follows a slot to another endpoint. A new endpoint takes a slot that
//! was free before the change rather than one its endpoint is leaving, so that clients recorded
//! while the deleting transaction was being built are deleted when the slot is bound again.

use std::net::IpAddr;

use crate::net::IpFamily;
use crate::nft::ast::Jhash;

use super::placement::WINDOW;

/// The `jhash` seed of every affinity rule ("nftp"): any constant does, as long as the record
/// and the choice use the same one.
pub(crate) const SEED: u32 = 0x6e66_7470;
/// Most slot bits: 1023 slots, each slot's part of the window (M) at least 1024 numbers wide.
const MAX_BITS: u32 = 10;
/// Most slots.
const MAX_SLOTS: usize = (1 << MAX_BITS) - 1;

/// An endpoint as a slot is bound to it.
pub(crate) type SlotTarget = (IpAddr, u16);

/// A service port in one family, as its affinity slots are keyed: the base of its object names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct AffinityId {
    pub family: IpFamily,
    pub base: String,
}

/// What a service port with affinity asks for: its endpoints, in planning order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AffinityDemand {
    pub id: AffinityId,
    pub endpoints: Vec<SlotTarget>,
}

/// A port's slots and the endpoint bound to each (the default: none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AffinitySlots {
    bound: Vec<Option<SlotTarget>>,
}

impl AffinitySlots {
    /// Slots for `endpoints`: those bound in `prior` keep their slot, the others take free ones,
    /// those free in `prior` first, lowest first. Endpoints beyond the largest capacity get none.
    pub(crate) fn seat(prior: Option<&AffinitySlots>, endpoints: &[SlotTarget]) -> AffinitySlots {
        let wanted = slots_for(endpoints.len());
        let capacity = match prior.map(AffinitySlots::capacity) {
            Some(c) if c >= endpoints.len().min(MAX_SLOTS) && c <= 2 * wanted => c,
            _ => wanted,
        };
        let mut bound: Vec<Option<SlotTarget>> = vec![None; capacity];
        let mut unseated = Vec::new();
        for ep in endpoints {
            let kept = prior.and_then(|p| p.slot_of(*ep)).filter(|j| *j < bound.len() && bound[*j].is_none());
            match kept {
                Some(j) => bound[j] = Some(*ep),
                None => unseated.push(*ep),
            }
        }
        let was_free = |j: &usize| prior.is_none_or(|p| p.bound.get(*j).is_none_or(Option::is_none));
        let (mut free, vacated): (Vec<usize>, Vec<usize>) =
            (0..bound.len()).filter(|j| bound[*j].is_none()).partition(was_free);
        free.extend(vacated);
        let mut free = free.into_iter();
        for ep in unseated {
            if bound.contains(&Some(ep)) {
                continue;
            }
            let Some(j) = free.next() else { break };
            bound[j] = Some(ep);
        }
        AffinitySlots { bound }
    }

    /// Slots as found in the kernel: how many from the rules, bindings from the targets map.
    pub(crate) fn found(
        capacity: usize,
        bindings: impl IntoIterator<Item = (usize, SlotTarget)>,
    ) -> Option<AffinitySlots> {
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
    pub(crate) fn capacity(&self) -> usize {
        self.bound.len()
    }

    /// The slot `endpoint` is bound to.
    pub(crate) fn slot_of(&self, endpoint: SlotTarget) -> Option<usize> {
        self.bound.iter().position(|b| *b == Some(endpoint))
    }

    /// The slots whose clients must be deleted going from `self` to `new`: every slot whose
    /// binding changes, a slot past either capacity counting as unbound. An unbound slot can
    /// hold clients recorded while the transaction that unbound it was being built, or found
    /// in the kernel without a binding; deleting them on binding keeps them from following.
    pub(crate) fn flushed_by(&self, new: &AffinitySlots) -> Vec<usize> {
        let at = |s: &AffinitySlots, j: usize| s.bound.get(j).copied().flatten();
        (0..self.capacity().max(new.capacity())).filter(|j| at(self, *j) != at(new, *j)).collect()
    }

    /// The range of the hash every rule of the port's chains draws from.
    pub(crate) fn modulus(&self) -> u32 {
        let parts = u32::try_from(self.capacity() + 1).unwrap_or(u32::MAX).next_power_of_two();
        WINDOW / parts.min(1 << MAX_BITS)
    }

    /// The choice of a chain with its window at `window`.
    pub(crate) fn choice(&self, window: u32) -> Jhash {
        Jhash { modulus: self.modulus(), seed: SEED, offset: window }
    }

    /// Slot `j`'s record in a chain with its window at `window`: the same hash, moved to the
    /// slot's own part of the window.
    pub(crate) fn record(&self, window: u32, j: usize) -> Jhash {
        Jhash { modulus: self.modulus(), seed: SEED, offset: window + self.shift(j) }
    }

    /// How far slot `j`'s hash ranges sit above the choice's.
    pub(crate) fn shift(&self, j: usize) -> u32 {
        self.modulus() * (u32::try_from(j).unwrap_or(0) + 1)
    }

    /// Slot `j`'s key in the targets map, for a chain with its window at `window`.
    pub(crate) fn target_key(window: u32, j: usize) -> u32 {
        window + u32::try_from(j).unwrap_or(0)
    }

    /// The slot a targets key belongs to, with its window's offset.
    pub(crate) fn slot_of_key(key: u32) -> (u32, usize) {
        let window = key - key % WINDOW;
        (window, (key - window) as usize)
    }

    /// Whether a chain's rules could have this modulus (a window split in a power of two).
    pub(crate) fn is_modulus(modulus: u32) -> bool {
        modulus.is_power_of_two() && (WINDOW >> MAX_BITS..WINDOW).contains(&modulus)
    }
}

/// The slots for `n` endpoints: a quarter more, at least one more (a rolling update's surge).
fn slots_for(n: usize) -> usize {
    (n + n.div_ceil(4).max(1)).min(MAX_SLOTS)
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
        assert_eq!((s.capacity(), s.modulus()), (13, 1 << 16));
        let last = s.record(5 * WINDOW, s.capacity() - 1);
        assert!(last.offset + last.modulus <= 6 * WINDOW, "the last slot ends inside the window");
        assert_eq!(AffinitySlots::slot_of_key(AffinitySlots::target_key(5 * WINDOW, 12)), (5 * WINDOW, 12));
        assert!(AffinitySlots::is_modulus(s.modulus()));
        assert!(!AffinitySlots::is_modulus(WINDOW));
        let full = AffinitySlots::seat(None, &(1..=15).map(ep).collect::<Vec<_>>());
        assert_eq!((full.capacity(), full.modulus()), (19, 1 << 15));
    }

    #[test]
    fn slots_found_in_the_kernel_keep_what_fits() {
        let found = AffinitySlots::found(3, [(0, ep(1)), (7, ep(2)), (2, ep(3))]).unwrap();
        assert_eq!((found.capacity(), found.slot_of(ep(1)), found.slot_of(ep(3))), (3, Some(0), Some(2)));
        assert_eq!(found.slot_of(ep(2)), None, "a key past the slots is dropped, not the port");
        assert!(AffinitySlots::found(0, []).is_none());
    }

    #[test]
    fn endpoints_past_the_largest_capacity_get_no_slot() {
        let eps: Vec<SlotTarget> =
            (0..1100u32).map(|i| (IpAddr::from(std::net::Ipv4Addr::from((10u32 << 24) + i)), 80)).collect();
        let s = AffinitySlots::seat(None, &eps);
        assert_eq!(s.capacity(), 1023);
        assert_eq!(s.slot_of(eps[1022]), Some(1022));
        assert_eq!(s.slot_of(eps[1023]), None);
        assert_eq!(s.modulus(), WINDOW >> 10);
    }
}
