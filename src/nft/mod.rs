//! nftables vocabulary as plain values.
//!
//! - [`ast`]: the desired ruleset (what `plan` builds), printable as nft text by [`render`];
//! - [`wire`]: the same objects as the kernel holds them, produced by [`lower`] and by the
//!   netlink read-back;
//! - [`diff`](mod@diff): two wire rulesets → one ordered [`diff::Transaction`];
//! - [`canonical`]: a normal form of nft text, to compare our rendering with `nft list ruleset`.

pub mod ast;
pub mod canonical;
pub mod diff;
pub mod lower;
pub mod render;
pub mod wire;

pub use ast::*;
pub use diff::{Op, OpKind, Transaction, diff};
pub use wire::{WireRuleset, WireTable};

use std::collections::BTreeMap;

use indexmap::IndexMap;

/// Merges one table's sets and chains (`from_*`) into another's, by name, keeping what is
/// there: a set present in both gains only the elements whose keys it lacks, so where two
/// sources claim one key the first merged wins. Serves both forms of a table: the desired
/// ([`ast::Table`]) and the kernel's ([`wire::WireTable`]); `elements` picks a set's elements.
pub fn merge_first_claim<S, C, K: Ord, E>(
    sets: &mut IndexMap<String, S>,
    chains: &mut IndexMap<String, C>,
    from_sets: IndexMap<String, S>,
    from_chains: IndexMap<String, C>,
    elements: fn(&mut S) -> &mut BTreeMap<K, E>,
) {
    for (name, mut set) in from_sets {
        match sets.get_mut(&name) {
            Some(have) => {
                let have = elements(have);
                for (key, element) in std::mem::take(elements(&mut set)) {
                    have.entry(key).or_insert(element);
                }
            }
            None => {
                sets.insert(name, set);
            }
        }
    }
    for (name, chain) in from_chains {
        chains.entry(name).or_insert(chain);
    }
}
