//! The kernel edge: applies a [`Transaction`] as one netlink batch and reads nftproxy's tables
//! back. This module holds all of nftproxy's `unsafe` code (libnftnl calls and socket syscalls).

pub(crate) mod conntrack;
mod counters;
mod decode;
mod elements;
mod encode;
mod error;
pub mod fake;
mod generation;
pub(crate) mod inventory;
pub(crate) mod ipvs;
mod netfilter;
#[cfg(test)]
mod roundtrip;
pub(crate) mod trace;
// The only `unsafe` code of nftproxy: syscalls on the netlink socket, and libnftnl behind one
// typed API (messages built from objects, received messages parsed into objects).
#[allow(unsafe_code)]
mod socket;
#[allow(unsafe_code)]
mod sys;
// Raw socket options with byte buffers (iptables-legacy's x_tables interface).
#[allow(unsafe_code)]
mod sockopt;
pub(crate) mod xtables;

use std::time::{Duration, Instant};

use crate::net::IpFamily;
use crate::nft::ast::Owner;
use crate::nft::diff::{OpTag, Transaction};
use crate::nft::wire::{WireKey, WireRuleset};

pub(crate) use counters::CountedElement;
pub use error::{MessageFailure, NetlinkError};
pub use fake::{FakeNetfilter, SharedFake};
pub(crate) use inventory::{BaseChainInfo, ChainInfo, ChainPolicy, RuleInfo, TableFamily, TableInfo};
pub use inventory::{TABLE_F_OWNER, TABLE_F_PERSIST};
pub use netfilter::{ApplyStats, Netfilter, StreamWriter};

pub(crate) use generation::next as next_generation;

/// The kernel of the current network namespace.
pub struct Kernel {
    socket: socket::Socket,
    /// The generation the next batch expects (see [`Netfilter::expect_generation`]).
    expected: Option<u32>,
}

impl Kernel {
    /// Opens a netfilter socket in the current network namespace.
    pub fn open() -> Result<Kernel, NetlinkError> {
        Ok(Kernel { socket: socket::Socket::open()?, expected: None })
    }

    /// Every table of every family in this network namespace (nftproxy's and foreign ones),
    /// with its chains, the hooks of its base chains and their rule counts, sorted by family
    /// and name. Reads only; regular chains' rules and sets are not read.
    pub(crate) fn list_tables(&mut self) -> Result<Vec<TableInfo>, NetlinkError> {
        inventory::list_tables(&mut self.socket)
    }

    /// The rules of one table (any family's, foreign ones too), with their handles and the
    /// chains they jump or go to.
    pub(crate) fn list_rules(&mut self, family: TableFamily, table: &str) -> Result<Vec<RuleInfo>, NetlinkError> {
        inventory::list_rules(&mut self.socket, family, table)
    }

    /// The sets and maps of the named tables (those that exist; no chains or rules), decoded as
    /// [`Netfilter::read`] does, also when another process owns them: for looking only, never
    /// for planning changes.
    pub(crate) fn inspect_sets(&mut self, tables: &[(IpFamily, &str)]) -> Result<WireRuleset, NetlinkError> {
        let mut out = WireRuleset::default();
        for (family, name) in tables {
            if let Some(t) = decode::inspect_sets(&mut self.socket, *family, name)? {
                out.tables.push(t);
            }
        }
        Ok(out)
    }

    /// The named tables (those that exist), decoded as [`Netfilter::read`] does, also when
    /// another process owns them: for looking only, never for planning changes.
    pub(crate) fn inspect(&mut self, tables: &[(IpFamily, &str)]) -> Result<WireRuleset, NetlinkError> {
        let mut out = WireRuleset::default();
        for (family, name) in tables {
            if let Some(t) = decode::inspect_table(&mut self.socket, *family, name)? {
                out.tables.push(t);
            }
        }
        Ok(out)
    }
}

impl Kernel {
    /// The element counters of the named sets and maps in the named tables (those that exist),
    /// for the per-service metrics: reads only, also when another process owns the tables.
    pub(crate) fn read_counters(
        &mut self,
        tables: &[(IpFamily, &str)],
        sets: &[&str],
    ) -> Result<Vec<CountedElement>, NetlinkError> {
        let mut out = Vec::new();
        for (family, name) in tables {
            counters::read_counted(&mut self.socket, *family, name, sets, &mut out)?;
        }
        Ok(out)
    }
}

impl Kernel {
    /// Sends an encoded batch and reads the kernel's verdict.
    fn send(&mut self, encoded: encode::EncodedBatch, encode_time: Duration) -> Result<ApplyStats, NetlinkError> {
        let expected = self.expected.take();
        if encoded.messages.is_empty() {
            return Ok(ApplyStats::default());
        }
        let mut pages: Vec<&[u8]> = encoded.batch.iter().collect();
        // The BEGIN message is the first of the first page: a copy carrying the expected
        // generation replaces it.
        let guarded_begin = match (expected, pages.first()) {
            (Some(genid), Some(first)) if first.len() >= 4 => {
                let len = u32::from_ne_bytes([first[0], first[1], first[2], first[3]]) as usize;
                let len = len.div_ceil(4) * 4;
                (len <= first.len()).then(|| (generation::begin_expecting(&first[..len], genid), len))
            }
            _ => None,
        };
        if let Some((_, len)) = &guarded_begin
            && let Some(first) = pages.first_mut()
        {
            *first = &first[*len..];
        }
        if let Some((begin, _)) = &guarded_begin {
            pages.insert(0, begin.as_slice());
        }
        // Errors are the only replies besides BEGIN/END: one per failing message at most.
        let recv = (encoded.messages.len() + 16) * 1024;
        self.socket.size_buffers(encoded.bytes + 64 * 1024, recv.max(1 << 20));

        let sent = Instant::now();
        self.socket.send_pages(&pages)?;
        let replies = self.socket.drain_replies()?;
        let kernel = sent.elapsed();

        if replies.iter().any(|r| r.error == -generation::ERESTART) {
            return Err(NetlinkError::GenerationChanged);
        }
        let mut failures = Vec::new();
        let mut committed = false;
        for reply in &replies {
            if reply.error == 0 {
                if Some(reply.seq) == encoded.end_ack_seq {
                    committed = true;
                }
                continue;
            }
            failures.push(failure(&encoded, &pages, reply));
        }
        if !failures.is_empty() {
            return Err(NetlinkError::Rejected(failures));
        }
        // Kernels before 6.10 do not ACK BATCH_END; there, no error means committed.
        if encoded.end_ack_seq.is_some() && !committed {
            return Err(NetlinkError::NotCommitted);
        }
        Ok(ApplyStats {
            operations: encoded.ops,
            messages: encoded.messages.len(),
            bytes: encoded.bytes,
            encode: encode_time,
            kernel,
        })
    }
}

impl Netfilter for Kernel {
    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NetlinkError> {
        if tx.is_empty() {
            self.expected = None;
            return Ok(ApplyStats::default());
        }
        let started = Instant::now();
        let encoded = encode::encode(tx)?;
        self.send(encoded, started.elapsed())
    }

    fn apply_stream(&mut self, write: &mut StreamWriter<'_>) -> Result<Option<ApplyStats>, NetlinkError> {
        let mut writer = encode::BatchWriter::new();
        if write(&mut writer).is_break() {
            return Ok(None);
        }
        // Encoding runs inside `write`, interleaved with whatever produces the operations:
        // only finishing the batch is counted here.
        let finishing = Instant::now();
        let encoded = writer.finish()?;
        self.send(encoded, finishing.elapsed()).map(Some)
    }

    fn read(&mut self, tables: &[(IpFamily, &str)]) -> Result<WireRuleset, NetlinkError> {
        let mut out = WireRuleset::default();
        for (family, name) in tables {
            if let Some(t) = decode::read_table(&mut self.socket, *family, name)? {
                out.tables.push(t);
            }
        }
        Ok(out)
    }

    fn set_keys(&mut self, family: IpFamily, table: &str, set: &str) -> Result<Vec<WireKey>, NetlinkError> {
        decode::read_keys(&mut self.socket, family, table, set)
    }

    fn generation(&mut self) -> Result<Option<u32>, NetlinkError> {
        generation::read(&mut self.socket).map(Some)
    }

    fn expect_generation(&mut self, genid: Option<u32>) {
        self.expected = genid;
    }
}

/// Maps an error reply to the operation and owners it belongs to.
fn failure(encoded: &encode::EncodedBatch, pages: &[&[u8]], reply: &socket::Reply) -> MessageFailure {
    let info = encoded.messages.iter().find(|m| m.seq == reply.seq);
    let errno = -reply.error;
    let Some(info) = info else {
        return MessageFailure {
            op_index: 0,
            tag: OpTag::AddTable,
            op: format!("batch message seq {}", reply.seq),
            errno,
            owners: vec![Owner::infrastructure()],
            text: reply.text.clone(),
        };
    };
    let mut owners = info.owners.clone();
    if info.elements {
        // The extended ACK offset points into the failing element's nest.
        if let Some(offset) = reply.offset {
            let message = pages
                .iter()
                .flat_map(|p| socket::split_messages(p))
                .find(|(seq, _)| *seq == reply.seq)
                .map(|(_, bytes)| bytes);
            if let Some(idx) = message.and_then(|m| socket::element_index_at(m, offset))
                && let Some(owner) = info.owners.get(idx)
            {
                owners = vec![owner.clone()];
            }
        }
    }
    owners.dedup();
    MessageFailure {
        op_index: info.op_index,
        tag: info.tag,
        op: info.op.to_string(),
        errno,
        owners,
        text: reply.text.clone(),
    }
}
