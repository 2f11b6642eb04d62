//! nftables vocabulary as plain values.
//!
//! - [`ast`]: the desired ruleset (what `plan` builds), printable as nft text by [`render`];
//! - [`wire`]: the same objects as the kernel holds them, produced by [`lower`] and by the
//!   netlink read-back;
//! - [`elements`]: a set's elements in key order, built in place from a kernel dump;
//! - [`diff`](mod@diff): two wire rulesets → one ordered [`diff::Transaction`];
//! - [`kernel_model`]: a model of the kernel: its rules for a transaction, as a pure function;
//! - [`canonical`]: a normal form of nft text, to compare our rendering with `nft list ruleset`.

pub mod ast;
pub mod canonical;
pub mod diff;
pub mod elements;
pub mod kernel_model;
pub mod lower;
pub mod render;
pub mod wire;

pub use ast::*;
pub use diff::{Op, OpKind, Transaction, diff};
pub use wire::{WireRuleset, WireTable};
