//! The elements of one set or map: their keys and data as the kernel holds them, in key order.
//!
//! A cluster's shared maps hold hundreds of thousands of elements, and a restart reads them all
//! back from the kernel. A `BTreeMap` built from such a dump needs the dump collected and sorted
//! first, so the map and the vector it is built from are alive together (at 5,000 services × 50
//! endpoints, two maps of 250,000 elements: 27 MB more at the peak). [`SetElements`] keeps the
//! sorted vector itself: built in place, looked up by binary search. Removals leave a hole (the
//! sync moves a service's elements out of the read-back one by one, and shifting the vector each
//! time would be quadratic); keys that were not in the vector go to an ordered map beside it
//! (all of them for a set built empty, which then behaves as a `BTreeMap`).

use std::cmp::Ordering;
use std::collections::{BTreeMap, btree_map};
use std::fmt;
use std::iter::Peekable;
use std::ops::{Bound, RangeBounds};

use std::sync::Arc;

use smallvec::SmallVec;

use super::ast::Owner;

/// An element key: bytes, plus the interval-end flag (an interval set can hold the same bytes
/// as both the end of one range and the start of the next).
///
/// Keys order by bytes and, for equal bytes, the end before the start: the order in which the
/// kernel accepts adjacent ranges of an interval set (the end of one range must exist before
/// the next range can start at the same key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WireKey {
    pub bytes: Bytes,
    pub interval_end: bool,
}

/// Key and data bytes: inline up to 24 bytes (every key and value but IPv6 address pairs), as
/// a cluster's ruleset holds hundreds of thousands of them.
pub type Bytes = SmallVec<[u8; 24]>;

impl WireKey {
    /// A start (or plain) key.
    pub fn new(bytes: &[u8]) -> WireKey {
        WireKey { bytes: Bytes::from_slice(bytes), interval_end: false }
    }

    /// An interval end key.
    pub fn end(bytes: &[u8]) -> WireKey {
        WireKey { bytes: Bytes::from_slice(bytes), interval_end: true }
    }
}

impl Ord for WireKey {
    fn cmp(&self, other: &WireKey) -> std::cmp::Ordering {
        self.bytes.cmp(&other.bytes).then(other.interval_end.cmp(&self.interval_end))
    }
}

impl PartialOrd for WireKey {
    fn partial_cmp(&self, other: &WireKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// What a map element maps to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum WireData {
    None,
    Verdict { code: i32, chain: Option<String> },
    Bytes(Bytes),
}

/// A set or map element.
#[derive(Debug, Clone)]
pub struct WireElement {
    pub data: WireData,
    /// The comment TLV; elements of one service port share one allocation.
    pub userdata: Option<Arc<[u8]>>,
    pub owner: Owner,
}

impl WireElement {
    /// Same data and comment.
    pub fn same_content(&self, other: &WireElement) -> bool {
        self.data == other.data && self.userdata == other.userdata
    }
}

/// The elements of a set or map by key, iterated in key order.
#[derive(Clone, Default)]
pub struct SetElements {
    /// Sorted by key, keys unique; `None` where an element was removed.
    sorted: Vec<(WireKey, Option<WireElement>)>,
    /// Elements whose keys are not in `sorted` (added after it was built).
    added: BTreeMap<WireKey, WireElement>,
    /// How many of `sorted` are present.
    present: usize,
}

// Marking an element present or removed needs no room of its own.
const _: () = assert!(size_of::<Option<WireElement>>() == size_of::<WireElement>());

/// Below this many slots a removal never compacts the vector (holes cost little).
const COMPACT_MIN: usize = 1024;

impl SetElements {
    /// No elements.
    pub fn new() -> SetElements {
        SetElements::default()
    }

    /// The elements of `v`, sorted in place (no second copy). Keys are expected to be unique (a
    /// kernel dump, or the keys of a map); of duplicates, one is kept.
    pub fn from_vec(mut v: Vec<(WireKey, WireElement)>) -> SetElements {
        v.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        v.dedup_by(|a, b| a.0 == b.0);
        // The same vector, each element marked present: `Option<WireElement>` has the size of
        // `WireElement`, so this collects in place.
        let mut sorted: Vec<(WireKey, Option<WireElement>)> = v.into_iter().map(|(k, e)| (k, Some(e))).collect();
        sorted.shrink_to_fit();
        let present = sorted.len();
        SetElements { sorted, added: BTreeMap::new(), present }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.present + self.added.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn slot(&self, key: &WireKey) -> Result<usize, usize> {
        self.sorted.binary_search_by(|(k, _)| k.cmp(key))
    }

    /// The element at `key`.
    pub fn get(&self, key: &WireKey) -> Option<&WireElement> {
        self.get_key_value(key).map(|(_, e)| e)
    }

    /// The element at `key`, with the stored key.
    pub fn get_key_value(&self, key: &WireKey) -> Option<(&WireKey, &WireElement)> {
        match self.slot(key) {
            Ok(i) => {
                let (k, e) = &self.sorted[i];
                e.as_ref().map(|e| (k, e))
            }
            Err(_) => self.added.get_key_value(key),
        }
    }

    /// Whether `key` has an element.
    pub fn contains_key(&self, key: &WireKey) -> bool {
        self.get(key).is_some()
    }

    /// Sets the element at `key`, returning the one it replaces.
    pub fn insert(&mut self, key: WireKey, element: WireElement) -> Option<WireElement> {
        match self.slot(&key) {
            Ok(i) => {
                let old = self.sorted[i].1.replace(element);
                if old.is_none() {
                    self.present += 1;
                }
                old
            }
            Err(_) => self.added.insert(key, element),
        }
    }

    /// Removes the element at `key` and returns it.
    pub fn remove(&mut self, key: &WireKey) -> Option<WireElement> {
        match self.slot(key) {
            Ok(i) => {
                let old = self.sorted[i].1.take();
                if old.is_some() {
                    self.present -= 1;
                    // Half holes: close them (in place, order kept) and give the room back, so
                    // a read-back shrinks as the sync moves its elements out.
                    if self.sorted.len() >= COMPACT_MIN && self.present < self.sorted.len() / 2 {
                        self.sorted.retain(|(_, e)| e.is_some());
                        self.sorted.shrink_to_fit();
                    }
                }
                old
            }
            Err(_) => self.added.remove(key),
        }
    }

    /// Keeps only the elements `keep` accepts (called on the vector's elements, then on the added
    /// ones: not in key order).
    pub fn retain(&mut self, mut keep: impl FnMut(&WireKey, &mut WireElement) -> bool) {
        for (k, slot) in &mut self.sorted {
            if slot.as_mut().is_some_and(|e| !keep(k, e)) {
                *slot = None;
                self.present -= 1;
            }
        }
        self.added.retain(|k, e| keep(k, e));
        if self.present < self.sorted.len() {
            self.sorted.retain(|(_, e)| e.is_some());
            self.sorted.shrink_to_fit();
        }
    }

    /// Keys and elements in key order.
    pub fn iter(&self) -> Iter<'_> {
        Iter { inner: merge(present(&self.sorted), self.added.iter()) }
    }

    /// Keys in order.
    pub fn keys(&self) -> impl Iterator<Item = &WireKey> {
        self.iter().map(|(k, _)| k)
    }

    /// Elements in key order.
    pub fn values(&self) -> impl Iterator<Item = &WireElement> {
        self.iter().map(|(_, e)| e)
    }

    /// Elements in key order, to change in place.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut WireElement> {
        let sorted = self.sorted.iter_mut().filter_map(|(k, e)| e.as_mut().map(|e| (&*k, e)));
        merge(sorted, self.added.iter_mut()).map(|(_, e)| e)
    }

    /// Keys and elements in key order within `range`. An inverted range is empty here, where a
    /// `BTreeMap` panics; no caller makes one.
    pub fn range<R: RangeBounds<WireKey>>(&self, range: R) -> impl Iterator<Item = (&WireKey, &WireElement)> {
        let start = match range.start_bound() {
            Bound::Included(k) => self.sorted.partition_point(|(s, _)| s < k),
            Bound::Excluded(k) => self.sorted.partition_point(|(s, _)| s <= k),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(k) => self.sorted.partition_point(|(s, _)| s <= k),
            Bound::Excluded(k) => self.sorted.partition_point(|(s, _)| s < k),
            Bound::Unbounded => self.sorted.len(),
        };
        let sorted = present(self.sorted.get(start..end.max(start)).unwrap_or_default());
        let bounds = (range.start_bound().cloned(), range.end_bound().cloned());
        merge(sorted, self.added.range(bounds))
    }

    /// The element with the greatest key at or below `key` (the range an interval key falls in).
    pub fn last_at_or_below(&self, key: &WireKey) -> Option<(&WireKey, &WireElement)> {
        let end = self.sorted.partition_point(|(s, _)| s <= key);
        let sorted = self.sorted[..end].iter().rev().find_map(present_slot);
        let added = self.added.range(..=key).next_back();
        match (sorted, added) {
            (Some(s), Some(a)) => Some(if a.0 > s.0 { a } else { s }),
            (s, a) => s.or(a),
        }
    }
}

fn present(slots: &[(WireKey, Option<WireElement>)]) -> Present<'_> {
    slots.iter().filter_map(present_slot as PresentFn<'_>)
}

fn present_slot((k, e): &(WireKey, Option<WireElement>)) -> Option<(&WireKey, &WireElement)> {
    e.as_ref().map(|e| (k, e))
}

/// Two ascending iterators of disjoint keys as one.
fn merge<K: Ord, V, A, B>(a: A, b: B) -> Merge<A, B>
where
    A: Iterator<Item = (K, V)>,
    B: Iterator<Item = (K, V)>,
{
    Merge { a: a.peekable(), b: b.peekable() }
}

struct Merge<A: Iterator, B: Iterator> {
    a: Peekable<A>,
    b: Peekable<B>,
}

impl<K: Ord, V, A, B> Iterator for Merge<A, B>
where
    A: Iterator<Item = (K, V)>,
    B: Iterator<Item = (K, V)>,
{
    type Item = (K, V);

    fn next(&mut self) -> Option<(K, V)> {
        let first = match (self.a.peek(), self.b.peek()) {
            (Some((ka, _)), Some((kb, _))) => ka.cmp(kb),
            (Some(_), None) => Ordering::Less,
            (None, _) => Ordering::Greater,
        };
        if first == Ordering::Greater { self.b.next() } else { self.a.next() }
    }
}

type Present<'a> = std::iter::FilterMap<std::slice::Iter<'a, (WireKey, Option<WireElement>)>, PresentFn<'a>>;
type PresentFn<'a> = fn(&'a (WireKey, Option<WireElement>)) -> Option<(&'a WireKey, &'a WireElement)>;

/// The iterator of [`SetElements::iter`].
pub struct Iter<'a> {
    inner: Merge<Present<'a>, btree_map::Iter<'a, WireKey, WireElement>>,
}

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a WireKey, &'a WireElement);

    fn next(&mut self) -> Option<Self::Item> {
        self.inner.next()
    }
}

impl<'a> IntoIterator for &'a SetElements {
    type Item = (&'a WireKey, &'a WireElement);
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

type OwnedPresent = std::iter::FilterMap<
    std::vec::IntoIter<(WireKey, Option<WireElement>)>,
    fn((WireKey, Option<WireElement>)) -> Option<(WireKey, WireElement)>,
>;

/// The iterator of `SetElements::into_iter`.
pub struct IntoIter {
    inner: Merge<OwnedPresent, btree_map::IntoIter<WireKey, WireElement>>,
}

impl Iterator for IntoIter {
    type Item = (WireKey, WireElement);

    fn next(&mut self) -> Option<(WireKey, WireElement)> {
        self.inner.next()
    }
}

impl IntoIterator for SetElements {
    type Item = (WireKey, WireElement);
    type IntoIter = IntoIter;

    fn into_iter(self) -> IntoIter {
        let owned: OwnedPresent = self.sorted.into_iter().filter_map(|(k, e)| e.map(|e| (k, e)));
        IntoIter { inner: merge(owned, self.added.into_iter()) }
    }
}

impl FromIterator<(WireKey, WireElement)> for SetElements {
    fn from_iter<I: IntoIterator<Item = (WireKey, WireElement)>>(iter: I) -> SetElements {
        SetElements::from_vec(iter.into_iter().collect())
    }
}

impl fmt::Debug for SetElements {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nft::ast::Owner;
    use crate::nft::wire::WireData;

    fn key(n: u32) -> WireKey {
        WireKey::new(&n.to_be_bytes())
    }

    fn element(n: u8) -> WireElement {
        WireElement { data: WireData::Bytes([n].as_slice().into()), userdata: None, owner: Owner::infrastructure() }
    }

    fn data(e: &WireElement) -> u8 {
        match &e.data {
            WireData::Bytes(b) => b[0],
            _ => panic!("no data"),
        }
    }

    /// The same operations on a `BTreeMap` and on `SetElements` give the same contents, in
    /// order, whether a key was in the built vector or added later, present or removed.
    #[test]
    fn behaves_as_an_ordered_map() {
        let mut model: BTreeMap<WireKey, WireElement> = BTreeMap::new();
        // Built from an unsorted dump of even keys.
        let dump: Vec<(WireKey, WireElement)> = (0..2000u32).rev().map(|n| (key(n * 2), element(1))).collect();
        model.extend(dump.iter().cloned());
        let mut set = SetElements::from_vec(dump);
        // A deterministic mix of inserts and removals over even (built) and odd (added) keys,
        // enough removals to compact the vector.
        let mut x: u32 = 7;
        for step in 0..12_000u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let k = key((x >> 8) % 4100);
            if step % 3 == 0 {
                let n = u8::try_from(step % 200).unwrap();
                assert_eq!(
                    set.insert(k.clone(), element(n)).map(|e| data(&e)),
                    model.insert(k, element(n)).map(|e| data(&e))
                );
            } else {
                assert_eq!(set.remove(&k).map(|e| data(&e)), model.remove(&k).map(|e| data(&e)));
            }
            assert_eq!(set.len(), model.len());
        }
        let ours: Vec<(u32, u8)> =
            set.iter().map(|(k, e)| (u32::from_be_bytes(k.bytes[..4].try_into().unwrap()), data(e))).collect();
        let theirs: Vec<(u32, u8)> =
            model.iter().map(|(k, e)| (u32::from_be_bytes(k.bytes[..4].try_into().unwrap()), data(e))).collect();
        assert_eq!(ours, theirs);
        for n in [0u32, 1, 2, 999, 1000, 4099, 5000] {
            assert_eq!(set.get(&key(n)).map(data), model.get(&key(n)).map(data), "get {n}");
            let below = |m: Option<(&WireKey, &WireElement)>| m.map(|(k, _)| k.clone());
            assert_eq!(below(set.last_at_or_below(&key(n))), below(model.range(..=key(n)).next_back()), "below {n}");
            let from: Vec<WireKey> = set.range(key(n)..).map(|(k, _)| k.clone()).collect();
            let want: Vec<WireKey> = model.range(key(n)..).map(|(k, _)| k.clone()).collect();
            assert_eq!(from, want, "range from {n}");
            let after: Vec<WireKey> =
                set.range((Bound::Excluded(key(n)), Bound::Included(key(n + 9)))).map(|(k, _)| k.clone()).collect();
            let want: Vec<WireKey> =
                model.range((Bound::Excluded(key(n)), Bound::Included(key(n + 9)))).map(|(k, _)| k.clone()).collect();
            assert_eq!(after, want, "range after {n}");
            let within: Vec<WireKey> = set.range(key(n)..key(n + 300)).map(|(k, _)| k.clone()).collect();
            let want: Vec<WireKey> = model.range(key(n)..key(n + 300)).map(|(k, _)| k.clone()).collect();
            assert_eq!(within, want, "range {n}..{}", n + 300);
        }
        for e in set.values_mut() {
            e.data = WireData::None;
        }
        assert!(set.values().all(|e| e.data == WireData::None));
        let owned: Vec<WireKey> = set.clone().into_iter().map(|(k, _)| k).collect();
        assert_eq!(owned, model.keys().cloned().collect::<Vec<_>>());
        // Most of the vector removed: its holes are closed, nothing else changes.
        for n in 0..3800 {
            assert_eq!(set.remove(&key(n)).is_some(), model.remove(&key(n)).is_some());
        }
        assert!(set.sorted.len() < 1000, "compacted: {} slots", set.sorted.len());
        assert!(set.keys().eq(model.keys()));
        set.retain(|k, _| k.bytes[3] % 2 == 0);
        model.retain(|k, _| k.bytes[3] % 2 == 0);
        assert!(set.keys().eq(model.keys()));
        assert!(set.sorted.iter().all(|(_, e)| e.is_some()));
    }

    /// Duplicate keys in a dump keep one element; the rest is the dump sorted.
    #[test]
    fn a_dump_with_duplicates_keeps_one_of_each() {
        let dump = vec![(key(3), element(1)), (key(1), element(2)), (key(3), element(1)), (key(2), element(3))];
        let set = SetElements::from_vec(dump);
        assert_eq!(set.len(), 3);
        let keys: Vec<u32> = set.keys().map(|k| u32::from_be_bytes(k.bytes[..4].try_into().unwrap())).collect();
        assert_eq!(keys, [1, 2, 3]);
        assert_eq!(set.get(&key(3)).map(data), Some(1));
    }

    /// An interval end orders before a start at the same bytes, in the vector and beside it.
    #[test]
    fn interval_ends_order_before_starts() {
        let mut set: SetElements = [(WireKey::new(&[0, 0, 0, 5]), element(1))].into_iter().collect();
        set.insert(WireKey::end(&[0, 0, 0, 5]), element(2));
        let order: Vec<bool> = set.keys().map(|k| k.interval_end).collect();
        assert_eq!(order, [true, false]);
    }
}
