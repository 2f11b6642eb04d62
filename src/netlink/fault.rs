//! Fault injection for tests: a [`Netfilter`] that makes the real kernel refuse the objects of
//! one owner, to prove that one refused service does not block the rest.

use super::{ApplyStats, Netfilter, NetlinkError};
use crate::net::IpFamily;
use crate::nft::diff::{Op, OpKind, Transaction};
use crate::nft::wire::{WireRule, WireRuleset};

/// Wraps a [`Netfilter`]; every transaction that adds something for an owner starting with
/// `prefix` gets, right after that owner's first addition, one more message of that owner that
/// the kernel refuses (a rule for a chain that does not exist: `ENOENT`), as a kernel that
/// cannot take that service's new objects would. Deletions are never refused, so a service
/// programmed earlier can still be taken out. Everything else is sent as is; the refused
/// message's `op_index` counts in the transaction with the extra message.
pub struct RefuseOwner<N> {
    pub inner: N,
    pub prefix: String,
}

/// The chain the injected rule names; no table of nftproxy's has it.
pub const MISSING_CHAIN: &str = "fault-injected-missing-chain";

impl<N: Netfilter> Netfilter for RefuseOwner<N> {
    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NetlinkError> {
        let target = tx.ops.iter().enumerate().filter(|(_, op)| op.kind.is_addition()).find_map(|(i, op)| {
            op.owners().into_iter().find(|o| o.as_str().starts_with(self.prefix.as_str())).map(|o| (i, o, op))
        });
        let Some((index, owner, op)) = target else { return self.inner.apply(tx) };
        let refused = Op {
            family: op.family,
            table: op.table.clone(),
            kind: OpKind::AddRule {
                chain: MISSING_CHAIN.to_string(),
                rule: WireRule { exprs: Vec::new(), userdata: None },
            },
            owner,
        };
        let mut faulty = Transaction { ops: Vec::with_capacity(tx.ops.len() + 1) };
        faulty.ops.extend(tx.ops[..=index].iter().cloned());
        faulty.ops.push(refused);
        faulty.ops.extend(tx.ops[index + 1..].iter().cloned());
        self.inner.apply(&faulty)
    }

    fn read(&mut self, tables: &[(IpFamily, &str)]) -> Result<WireRuleset, NetlinkError> {
        self.inner.read(tables)
    }
}
