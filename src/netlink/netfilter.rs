//! What the syncer asks of nftables state ([`Netfilter`]): the kernel ([`super::Kernel`]) or a
//! fake for tests ([`super::fake`]), and what applying a transaction cost ([`ApplyStats`]).

use std::ops::ControlFlow;
use std::time::Duration;

use super::error::NetlinkError;
use crate::net::IpFamily;
use crate::nft::diff::{OpSink, Transaction};
use crate::nft::wire::{WireKey, WireRuleset};

/// What applying a transaction cost.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApplyStats {
    /// Operations applied (an element operation may take several messages).
    pub operations: usize,
    /// Netlink messages sent, BEGIN/END excluded.
    pub messages: usize,
    /// Batch size in bytes.
    pub bytes: usize,
    /// Time spent encoding the batch (for [`Netfilter::apply_stream`], finishing it: the
    /// operations are encoded as they are produced).
    pub encode: Duration,
    /// Time inside sendmsg and reading the replies (the kernel's work).
    pub kernel: Duration,
}

/// Produces a transaction's operations into a sink; breaking abandons the transaction.
pub type StreamWriter<'a> = dyn FnMut(&mut dyn OpSink) -> ControlFlow<()> + 'a;

/// Something that holds nftables state: the kernel, or a fake for tests.
pub trait Netfilter {
    /// Applies all operations atomically, or none.
    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NetlinkError>;

    /// Applies the operations `write` produces, atomically, as [`Netfilter::apply`] does. The
    /// kernel encodes each operation as it arrives, so the whole transaction is never held in
    /// memory. When `write` breaks, nothing is applied and `Ok(None)` is returned.
    fn apply_stream(&mut self, write: &mut StreamWriter<'_>) -> Result<Option<ApplyStats>, NetlinkError> {
        let mut tx = Transaction::default();
        if write(&mut tx).is_break() {
            return Ok(None);
        }
        self.apply(&tx).map(Some)
    }

    /// Reads the named tables (those that exist).
    fn read(&mut self, tables: &[(IpFamily, &str)]) -> Result<WireRuleset, NetlinkError>;

    /// The keys of one set's elements (none when the set does not exist): the clients the
    /// kernel recorded in an affinity set.
    fn set_keys(&mut self, family: IpFamily, table: &str, set: &str) -> Result<Vec<WireKey>, NetlinkError>;

    /// The ruleset generation: the kernel increments it with every transaction committed in
    /// this network namespace, any table's. `None` when this handle cannot tell.
    fn generation(&mut self) -> Result<Option<u32>, NetlinkError> {
        Ok(None)
    }

    /// Makes the next transaction conditional on the generation still being `genid`: otherwise
    /// nothing is applied and it fails with [`NetlinkError::GenerationChanged`]. `None` sends
    /// it unconditionally.
    fn expect_generation(&mut self, _genid: Option<u32>) {}
}
