//! An in-memory stand-in for the kernel, for tests that need no privileges.
//!
//! It applies transactions atomically with the checks that make the kernel refuse a batch
//! ([`nft::kernel_model`](crate::nft::kernel_model)), and can be told to fail in the ways tests need.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::error::{MessageFailure, NetlinkError};
use super::netfilter::{ApplyStats, Netfilter};
use crate::net::IpFamily;
use crate::nft::diff::{OpKind, Transaction};
use crate::nft::kernel_model::{self, Refusal};
use crate::nft::wire::{WireKey, WireRuleset};

/// The fake kernel's state and a log of what it was sent.
#[derive(Debug, Default)]
pub struct FakeNetfilter {
    pub state: WireRuleset,
    /// Every transaction applied successfully, in order.
    pub applied: Vec<Transaction>,
    /// Fail the next transaction that contains an operation whose text contains this string.
    pub fail_on: Option<String>,
    /// Refuse every addition (chain, rule, set, element) whose owner starts with this string,
    /// naming that owner alone, as the kernel's extended ACK lets the real edge do. Deletions
    /// go through.
    pub refuse_owner: Option<String>,
    /// Table flags this kernel does not know (`EOPNOTSUPP`, as kernels before 6.9 answer
    /// `persist`).
    pub unknown_table_flags: u32,
    /// The ruleset generation: 1 at start, one more per transaction applied (tests add their
    /// own to stand for another process's commits).
    pub generation: u32,
    /// The generation the next transaction expects.
    pub expected: Option<u32>,
}

impl FakeNetfilter {
    /// An empty kernel.
    pub fn new() -> FakeNetfilter {
        FakeNetfilter { generation: 1, ..FakeNetfilter::default() }
    }

    /// Another process commits a transaction (of its own tables).
    pub fn foreign_commit(&mut self) {
        self.generation = super::generation::next(self.generation);
    }
}

/// A fake kernel shared between the syncer that owns it (boxed) and the test that inspects it.
#[derive(Debug, Clone, Default)]
pub struct SharedFake(pub Arc<Mutex<FakeNetfilter>>);

impl SharedFake {
    /// Shares `kernel`.
    pub fn new(kernel: FakeNetfilter) -> SharedFake {
        SharedFake(Arc::new(Mutex::new(kernel)))
    }

    /// The fake kernel (a test that panicked while holding it leaves it usable).
    pub fn lock(&self) -> MutexGuard<'_, FakeNetfilter> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Netfilter for SharedFake {
    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NetlinkError> {
        self.lock().apply(tx)
    }

    fn set_keys(&mut self, family: IpFamily, table: &str, set: &str) -> Result<Vec<WireKey>, NetlinkError> {
        self.lock().set_keys(family, table, set)
    }

    fn read(&mut self, tables: &[(IpFamily, &str)]) -> Result<WireRuleset, NetlinkError> {
        self.lock().read(tables)
    }

    fn generation(&mut self) -> Result<Option<u32>, NetlinkError> {
        self.lock().generation()
    }

    fn expect_generation(&mut self, genid: Option<u32>) {
        self.lock().expect_generation(genid);
    }
}

fn err(index: usize, tx: &Transaction, errno: i32) -> NetlinkError {
    let op = &tx.ops[index];
    NetlinkError::Rejected(vec![MessageFailure {
        op_index: index,
        tag: op.kind.tag(),
        op: op.to_string(),
        errno,
        owners: op.owners(),
        text: None,
    }])
}

impl Netfilter for FakeNetfilter {
    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NetlinkError> {
        if self.expected.take().is_some_and(|g| g != self.generation) && !tx.is_empty() {
            return Err(NetlinkError::GenerationChanged);
        }
        let mut state = self.state.clone();
        for (i, op) in tx.ops.iter().enumerate() {
            if let Some(pattern) = &self.fail_on
                && op.to_string().contains(pattern.as_str())
            {
                return Err(err(i, tx, libc::EINVAL));
            }
            if let OpKind::AddTable { flags, .. } = &op.kind
                && flags & self.unknown_table_flags != 0
            {
                return Err(err(i, tx, libc::EOPNOTSUPP));
            }
            if let Some(prefix) = &self.refuse_owner
                && op.kind.is_addition()
                && let Some(owner) = op.owners().into_iter().find(|o| o.to_string().starts_with(prefix.as_str()))
            {
                return Err(NetlinkError::Rejected(vec![MessageFailure {
                    op_index: i,
                    tag: op.kind.tag(),
                    op: op.to_string(),
                    errno: libc::EINVAL,
                    owners: vec![owner],
                    text: None,
                }]));
            }
            kernel_model::apply_op(&mut state, op).map_err(|r| err(i, tx, errno(r)))?;
        }
        for table in &state.tables {
            kernel_model::check_references(table).map_err(|r| err(tx.ops.len().saturating_sub(1), tx, errno(r)))?;
        }
        self.state = state;
        if !tx.is_empty() {
            self.generation = super::generation::next(self.generation);
        }
        self.applied.push(tx.clone());
        Ok(ApplyStats { operations: tx.ops.len(), messages: tx.ops.len(), ..ApplyStats::default() })
    }

    fn set_keys(&mut self, family: IpFamily, table: &str, set: &str) -> Result<Vec<WireKey>, NetlinkError> {
        let table = self.state.tables.iter().find(|t| t.family == family && t.name == table);
        Ok(table.and_then(|t| t.sets.get(set)).map(|s| s.elements.keys().cloned().collect()).unwrap_or_default())
    }

    fn read(&mut self, tables: &[(IpFamily, &str)]) -> Result<WireRuleset, NetlinkError> {
        Ok(WireRuleset {
            tables: self
                .state
                .tables
                .iter()
                .filter(|t| tables.iter().any(|(f, n)| *f == t.family && *n == t.name))
                .cloned()
                .collect(),
        })
    }

    fn generation(&mut self) -> Result<Option<u32>, NetlinkError> {
        Ok(Some(self.generation))
    }

    fn expect_generation(&mut self, genid: Option<u32>) {
        self.expected = genid;
    }
}

/// The errno the kernel answers a refusal with.
fn errno(refusal: Refusal) -> i32 {
    match refusal {
        Refusal::NotFound => libc::ENOENT,
        Refusal::InUse => libc::EBUSY,
        Refusal::Exists => libc::EEXIST,
    }
}
