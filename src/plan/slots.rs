//! Where each service port's endpoints sit in the shared endpoint maps.
//!
//! A service port with several endpoints balances with `numgen random mod 1048576 offset K`
//! over its own **window** of 2^20 numbers in one of a few shared interval maps
//! (`endpoints-0`, `endpoints-1`, … for DNAT targets; `endpoint-chains-0`, … for the endpoint
//! chains of session affinity). The window is split into one range per endpoint, as evenly as
//! 2^20 allows (the largest relative difference between two endpoints is N / 2^20).
//!
//! The shape follows the kernel's costs, measured on the benchmark's clusters:
//! - the rule never changes while the service port has endpoints, so adding or removing one is
//!   a few element operations in a data map, which the kernel commits without re-validating
//!   every chain of the table (a rule change costs that walk: ~13 ms at 10,000 services);
//! - one map per service port would make every set reference a linear scan by name over
//!   thousands of sets (the kernel keeps a table's sets in a list);
//! - one map for everything would make every rule that looks it up walk all its elements (the
//!   kernel checks a map's data against each chain that binds it).
//!
//! Maps of about [`SHARD_LOAD`] endpoints bound both scans for DNAT targets. Verdict maps are
//! different: whenever the table is validated (every commit that adds a rule or a `goto`), the
//! kernel walks a verdict map in full for each rule that looks it up, so a shared
//! `endpoint-chains` map would make that walk quadratic; each affinity port has its own. A window never moves; the table is
//! kept by the reconciler across syncs and rebuilt from the kernel's rules after a restart.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use crate::net::IpFamily;
use crate::nft::wire::{LowExpr, WireRuleset};

/// The numbers `numgen` draws for one service port.
pub const WINDOW: u32 = 1 << crate::nft::wire::NUMGEN_WINDOW_BITS;
/// Windows per map: offsets stay below 2^31, so a window's end never overflows.
pub const SHARD_WINDOWS: u32 = 2048;
/// Endpoints per map before the next map is used (a service port that grows later may pass
/// it; it never moves).
pub const SHARD_LOAD: u32 = 1024;

/// What a shared map holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MapKind {
    /// `endpoints-N`: numgen range → endpoint address and port (DNAT targets).
    Targets,
    /// `endpoint-chains-N`: numgen range → `goto endpoint-…` (session affinity).
    Chains,
}

impl MapKind {
    const ALL: [MapKind; 2] = [MapKind::Targets, MapKind::Chains];

    fn prefix(self) -> &'static str {
        match self {
            MapKind::Targets => "endpoints-",
            MapKind::Chains => "endpoint-chains-",
        }
    }

    /// The name of shard `n`.
    pub fn map_name(self, n: u32) -> String {
        format!("{}{n}", self.prefix())
    }

    /// The kind and shard number of a map name made by [`MapKind::map_name`].
    pub fn parse(name: &str) -> Option<(MapKind, u32)> {
        MapKind::ALL.into_iter().find_map(|kind| {
            let digits = name.strip_prefix(kind.prefix())?;
            let canonical = !digits.is_empty()
                && digits.bytes().all(|b| b.is_ascii_digit())
                && (digits == "0" || !digits.starts_with('0'));
            if !canonical {
                return None;
            }
            digits.parse().ok().map(|n| (kind, n))
        })
    }
}

/// Where a chain's endpoints are: map shard and window offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub shard: u32,
    pub offset: u32,
}

/// The ranges `n` endpoints get in a window at `offset`: `(first, last)` per endpoint.
pub fn ranges(offset: u32, n: u32) -> Vec<(u32, u32)> {
    let n = n.clamp(1, WINDOW);
    let (width, extra) = (WINDOW / n, WINDOW % n);
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

type Space = (IpFamily, MapKind);
type BlockKey = (IpFamily, MapKind, String);

/// Blocks by chain, shards by family and map kind.
#[derive(Debug, Clone, Default)]
pub struct SlotTable {
    blocks: BTreeMap<BlockKey, Block>,
    shards: BTreeMap<Space, BTreeMap<u32, Shard>>,
    used: BTreeSet<BlockKey>,
    /// Windows found in the kernel while seeding.
    seeded: HashSet<(IpFamily, MapKind, u32, u32)>,
    /// While set, [`SlotTable::place`] only looks blocks up (re-planning what was programmed).
    frozen: bool,
}

impl SlotTable {
    /// An empty table (for a kernel without nftproxy's tables).
    pub fn new() -> SlotTable {
        SlotTable::default()
    }

    /// Freezes (or thaws) the table: while frozen, placing a chain that has a block returns it
    /// and changes nothing, so what was programmed can be planned again exactly.
    pub fn set_frozen(&mut self, frozen: bool) {
        self.frozen = frozen;
    }

    /// Starts a plan: blocks not placed again before [`SlotTable::finish`] are freed.
    pub fn begin(&mut self) {
        self.used.clear();
    }

    /// Frees the blocks of chains the last plan did not place, and shards left empty.
    pub fn finish(&mut self) {
        let unused: Vec<BlockKey> = self.blocks.keys().filter(|k| !self.used.contains(*k)).cloned().collect();
        for key in unused {
            self.release(&key);
        }
        self.drop_empty_shards();
    }

    /// Ends a plan of some services only: frees the blocks of `chains` (what those services
    /// had before) that were not placed again, and shards left empty.
    pub fn finish_for<'a>(&mut self, chains: impl IntoIterator<Item = (IpFamily, &'a str)>) {
        for (family, chain) in chains {
            for kind in MapKind::ALL {
                let key = (family, kind, chain.to_string());
                if !self.used.contains(&key) {
                    self.release(&key);
                }
            }
        }
        self.drop_empty_shards();
    }

    fn drop_empty_shards(&mut self) {
        for shards in self.shards.values_mut() {
            shards.retain(|_, s| s.blocks > 0);
        }
    }

    fn release(&mut self, key: &BlockKey) {
        let Some(block) = self.blocks.remove(key) else { return };
        if let Some(shard) = self.shards.get_mut(&(key.0, key.1)).and_then(|s| s.get_mut(&block.shard)) {
            shard.free.insert(block.window);
            shard.load = shard.load.saturating_sub(block.load);
            shard.blocks = shard.blocks.saturating_sub(1);
        }
    }

    /// Places `n` endpoints of `chain`: its window so far, or a new one.
    pub fn place(&mut self, family: IpFamily, kind: MapKind, chain: &str, n: u32) -> Slot {
        let key = (family, kind, chain.to_string());
        if self.frozen
            && let Some(block) = self.blocks.get(&key)
        {
            return Slot { shard: block.shard, offset: block.window * WINDOW };
        }
        self.used.insert(key.clone());
        let shards = self.shards.entry((family, kind)).or_default();
        if let Some(block) = self.blocks.get_mut(&key) {
            if let Some(shard) = shards.get_mut(&block.shard) {
                shard.load = shard.load.saturating_sub(block.load).saturating_add(n);
            }
            block.load = n;
            return Slot { shard: block.shard, offset: block.window * WINDOW };
        }
        // A verdict map is walked in full for every rule that looks it up whenever the table is
        // validated (any commit adding a rule or a goto), so sharing one between service ports
        // makes that walk quadratic: each affinity port gets a map of its own.
        let fits = |s: &Shard| {
            s.has_window() && s.load.saturating_add(n) <= SHARD_LOAD && (kind == MapKind::Targets || s.blocks == 0)
        };
        let id = match shards.iter().find(|(_, s)| fits(s)) {
            Some((id, _)) => *id,
            // The lowest unused shard number, so names stay small and are reused.
            None => (0..).find(|i| !shards.contains_key(i)).unwrap_or(0),
        };
        let shard = shards.entry(id).or_default();
        let window = shard.take_window().unwrap_or(0);
        shard.load = shard.load.saturating_add(n);
        shard.blocks += 1;
        self.blocks.insert(key, Block { shard: id, window, load: n });
        Slot { shard: id, offset: window * WINDOW }
    }

    /// The windows nftproxy's rules in the kernel use (`numgen random mod 1048576 offset K`
    /// followed by a lookup in a shard map), so a restarted proxy keeps every service port
    /// where it is and its first sync changes nothing. A window claimed twice is kept once (the
    /// other chain gets a new one).
    pub fn from_kernel(ruleset: &WireRuleset) -> SlotTable {
        let mut t = SlotTable::new();
        for table in &ruleset.tables {
            // Endpoints per window, from the maps' range starts.
            let mut loads: BTreeMap<(&str, u32), u32> = BTreeMap::new();
            for set in table.sets.values().filter(|s| MapKind::parse(&s.name).is_some()) {
                for key in set.elements.keys().filter(|k| !k.interval_end) {
                    if let Ok(bytes) = <[u8; 4]>::try_from(key.bytes.as_slice()) {
                        *loads.entry((set.name.as_str(), u32::from_be_bytes(bytes) / WINDOW)).or_default() += 1;
                    }
                }
            }
            for chain in table.chains.values() {
                for rule in &chain.rules {
                    for triple in rule.exprs.windows(3) {
                        let [
                            LowExpr::Numgen { modulus, offset, .. },
                            LowExpr::Byteorder { .. },
                            LowExpr::Lookup { set, .. },
                        ] = triple
                        else {
                            continue;
                        };
                        let Some((kind, id)) = MapKind::parse(set) else { continue };
                        let window = offset / WINDOW;
                        if *modulus != WINDOW || offset % WINDOW != 0 || window >= SHARD_WINDOWS {
                            continue;
                        }
                        let load = loads.get(&(set.as_str(), window)).copied().unwrap_or(0);
                        t.seed(table.family, kind, &chain.name, id, window, load);
                    }
                }
            }
        }
        t.rebuild_free();
        t
    }

    /// Records one block found in the kernel, unless its window or its chain is taken.
    fn seed(&mut self, family: IpFamily, kind: MapKind, chain: &str, id: u32, window: u32, load: u32) {
        let key = (family, kind, chain.to_string());
        let window_key = (family, kind, id, window);
        if self.blocks.contains_key(&key) || !self.seeded.insert(window_key) {
            return;
        }
        let shard = self.shards.entry((family, kind)).or_default().entry(id).or_default();
        shard.top = shard.top.max(window + 1);
        shard.load = shard.load.saturating_add(load);
        shard.blocks += 1;
        self.blocks.insert(key, Block { shard: id, window, load });
    }

    /// Recomputes every shard's free windows from the seeded blocks.
    fn rebuild_free(&mut self) {
        for ((family, kind), shards) in &mut self.shards {
            for (id, shard) in shards.iter_mut() {
                let taken = |w: &u32| self.seeded.contains(&(*family, *kind, *id, *w));
                shard.free = (0..shard.top).filter(|w| !taken(w)).collect();
            }
        }
        self.seeded.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: IpFamily = IpFamily::V4;
    const T: MapKind = MapKind::Targets;

    fn at(shard: u32, window: u32) -> Slot {
        Slot { shard, offset: window * WINDOW }
    }

    #[test]
    fn ranges_split_a_window_evenly() {
        let r = ranges(WINDOW, 3);
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].0, WINDOW);
        assert_eq!(r[2].1, 2 * WINDOW - 1);
        for pair in r.windows(2) {
            assert_eq!(pair[0].1 + 1, pair[1].0, "contiguous");
        }
        let sizes: Vec<u32> = r.iter().map(|(a, b)| b - a + 1).collect();
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{sizes:?}");
        assert_eq!(ranges(0, 1), vec![(0, WINDOW - 1)]);
    }

    #[test]
    fn windows_never_move_and_are_reused_when_freed() {
        let mut t = SlotTable::new();
        t.begin();
        assert_eq!(t.place(F, T, "a", 3), at(0, 0));
        assert_eq!(t.place(F, T, "b", 5), at(0, 1));
        t.finish();
        t.begin();
        assert_eq!(t.place(F, T, "a", 300), at(0, 0), "growing keeps the window");
        assert_eq!(t.place(F, T, "c", 2), at(0, 2));
        t.finish();
        t.begin();
        t.place(F, T, "a", 300);
        t.place(F, T, "c", 2);
        assert_eq!(t.place(F, T, "d", 2), at(0, 1), "b's window is free again");
        t.finish();
    }

    #[test]
    fn a_full_map_sends_new_blocks_to_the_next_and_empty_maps_go() {
        let mut t = SlotTable::new();
        t.begin();
        assert_eq!(t.place(F, T, "big", SHARD_LOAD - 10), at(0, 0));
        assert_eq!(t.place(F, T, "next", 20), at(1, 0), "map 0 is full");
        assert_eq!(t.place(F, T, "small", 10), at(0, 1), "map 0 still takes what fits");
        assert_eq!(t.place(IpFamily::V6, T, "a", 3), at(0, 0), "families are separate spaces");
        assert_eq!(t.place(F, MapKind::Chains, "a", 3), at(0, 0), "so are map kinds");
        t.finish();
        t.begin();
        t.place(F, T, "big", SHARD_LOAD - 10);
        t.place(F, T, "small", 10);
        t.finish();
        assert_eq!(t.shards[&(F, T)].len(), 1, "map 1 was dropped when it emptied");
    }

    #[test]
    fn a_partial_plan_frees_only_the_old_chains_of_the_services_it_planned() {
        let mut t = SlotTable::new();
        t.begin();
        t.place(F, T, "a", 3);
        t.place(F, T, "b", 3);
        t.finish();
        t.begin();
        assert_eq!(t.place(F, T, "a2", 3), at(0, 2));
        t.finish_for([(F, "a")]);
        assert_eq!(t.place(F, T, "c", 4), at(0, 0), "a's window is free");
        assert_eq!(t.place(F, T, "b", 3), at(0, 1), "b was not planned and keeps its window");
    }

    fn kernel_with(blocks: &[(&str, &str, u32, u32)]) -> WireRuleset {
        use crate::nft::ast::*;
        let mut table = Table::new(F, "nftproxy", None);
        for (chain, map, offset, modulus) in blocks {
            let mut c = Chain::regular(*chain, Owner::infrastructure());
            c.push(Rule::new(vec![Stmt::DnatNumgenMap {
                family: F,
                modulus: *modulus,
                offset: *offset,
                map: map.to_string(),
            }]));
            table.add_chain(c);
        }
        crate::nft::lower::lower_ruleset(&Ruleset { tables: vec![table] })
    }

    #[test]
    fn windows_found_in_the_kernel_are_kept() {
        let kernel = kernel_with(&[
            ("a", "endpoints-0", 3 * WINDOW, WINDOW),
            ("b", "endpoints-0", 0, WINDOW),
            ("x", "endpoints-0", 3 * WINDOW, WINDOW),
            ("c", "endpoints-3", 0, WINDOW),
            ("old", "endpoints-0", 5 * WINDOW, 7),
            ("foreign", "other-map", 0, WINDOW),
        ]);
        let mut t = SlotTable::from_kernel(&kernel);
        t.begin();
        assert_eq!(t.place(F, T, "a", 3), at(0, 3));
        assert_eq!(t.place(F, T, "b", 3), at(0, 0));
        assert_eq!(t.place(F, T, "c", 8), at(3, 0));
        assert_eq!(t.place(F, T, "x", 2), at(0, 1), "x claimed a's window: it gets a free one");
        assert_eq!(t.place(F, T, "old", 2), at(0, 2), "a rule of another shape is not a window");
        assert_eq!(t.place(F, T, "d", 2), at(0, 4));
        t.finish();
    }

    #[test]
    fn map_names_parse_back() {
        assert_eq!(MapKind::parse(&T.map_name(12)), Some((T, 12)));
        assert_eq!(MapKind::parse("endpoint-chains-0"), Some((MapKind::Chains, 0)));
        for bad in ["endpoints-", "endpoints-01", "endpoints-x", "endpoints-AB12-ns/svc", "service-ips"] {
            assert_eq!(MapKind::parse(bad), None, "{bad}");
        }
    }
}
