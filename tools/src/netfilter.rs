//! Wrappers of the syncer's [`Netfilter`] for tests: fault injection ([`RefuseOwner`], which
//! makes the real kernel refuse the objects of one owner, to prove that one refused service does
//! not block the rest) and [`Recording`], which keeps every transaction sent (the syncer streams
//! them into the batch and keeps none).

use std::sync::{Arc, Mutex};

use nftproxy::net::IpFamily;
use nftproxy::netlink::{ApplyStats, Netfilter, NetlinkError, StreamWriter};
use nftproxy::nft::diff::{Op, OpKind, OpSink, Transaction};
use nftproxy::nft::wire::{WireKey, WireRule, WireRuleset};

/// Passes everything to `inner` and keeps a copy of every transaction it applied.
pub struct Recording<N> {
    pub inner: N,
    /// The transactions applied successfully, in order (shared: the test keeps a handle).
    pub log: Arc<Mutex<Vec<Transaction>>>,
}

impl<N> Recording<N> {
    /// Records what `inner` applies.
    pub fn new(inner: N) -> Recording<N> {
        Recording { inner, log: Arc::default() }
    }
}

struct Tee<'a> {
    sink: &'a mut dyn OpSink,
    copy: &'a mut Transaction,
}

impl OpSink for Tee<'_> {
    fn push(&mut self, op: Op) {
        self.copy.ops.push(op.clone());
        self.sink.push(op);
    }
}

impl<N: Netfilter> Netfilter for Recording<N> {
    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NetlinkError> {
        let stats = self.inner.apply(tx)?;
        self.log.lock().unwrap_or_else(|e| e.into_inner()).push(tx.clone());
        Ok(stats)
    }

    fn apply_stream(&mut self, write: &mut StreamWriter<'_>) -> Result<Option<ApplyStats>, NetlinkError> {
        let mut copy = Transaction::default();
        let applied = self.inner.apply_stream(&mut |sink| write(&mut Tee { sink, copy: &mut copy }))?;
        if applied.is_some() {
            self.log.lock().unwrap_or_else(|e| e.into_inner()).push(copy);
        }
        Ok(applied)
    }

    fn read(&mut self, tables: &[(IpFamily, &str)]) -> Result<WireRuleset, NetlinkError> {
        self.inner.read(tables)
    }

    fn set_keys(&mut self, family: IpFamily, table: &str, set: &str) -> Result<Vec<WireKey>, NetlinkError> {
        self.inner.set_keys(family, table, set)
    }

    fn generation(&mut self) -> Result<Option<u32>, NetlinkError> {
        self.inner.generation()
    }

    fn expect_generation(&mut self, genid: Option<u32>) {
        self.inner.expect_generation(genid);
    }
}

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
            op.owners().into_iter().find(|o| o.to_string().starts_with(self.prefix.as_str())).map(|o| (i, o, op))
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

    fn set_keys(&mut self, family: IpFamily, table: &str, set: &str) -> Result<Vec<WireKey>, NetlinkError> {
        self.inner.set_keys(family, table, set)
    }

    fn generation(&mut self) -> Result<Option<u32>, NetlinkError> {
        self.inner.generation()
    }

    fn expect_generation(&mut self, genid: Option<u32>) {
        self.inner.expect_generation(genid);
    }
}
