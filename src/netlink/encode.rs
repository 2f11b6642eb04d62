//! Transaction operations → nf_tables messages in one `nftnl::Batch`.
//!
//! No message asks for an ACK (the kernel reports errors anyway; thousands of ACKs would
//! overflow the receive buffer), except BATCH_BEGIN/END, which the `nftnl` crate flags on
//! kernels that honour it (≥ 6.10): END's ACK is the commit signal.

use std::collections::HashMap;

use nftnl::{Batch, FinalizedBatch, MsgType};
use nftnl_sys as sys;

use super::elements::element_list;
use super::error::NetlinkError;
use super::sys::{self as raw, BatchMessage, Object, msg};
use crate::nft::ast::Owner;
use crate::nft::diff::{Op, OpKind, OpSink, OpTag, Transaction};
use crate::nft::lower::nfproto;
use crate::nft::wire::*;

const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;

/// Keep element messages well below the per-message buffer (`nft_nlmsg_maxsize`, ~68 KiB).
const ELEMENT_MESSAGE_BUDGET: usize = 32 * 1024;

/// What one message in the batch was for (kept after the operation itself is gone, so a
/// refused message can still be named and blamed).
#[derive(Debug, Clone)]
pub(super) struct MessageInfo {
    pub seq: u32,
    pub op_index: usize,
    /// What the operation does.
    pub tag: OpTag,
    /// The operation, as text (`add rule ip nftproxy services`).
    pub op: Box<str>,
    /// Whom the message is for: the owner of each element, in message order, for element
    /// messages; the operation's owner otherwise.
    pub owners: Vec<Owner>,
    /// Whether `owners` lists elements (an extended ACK can then name one).
    pub elements: bool,
}

/// A finalized batch and what each message in it was for.
pub(super) struct EncodedBatch {
    pub batch: FinalizedBatch,
    pub messages: Vec<MessageInfo>,
    /// Whether BATCH_END asks for an ACK (kernel ≥ 6.10), and its seq.
    pub end_ack_seq: Option<u32>,
    pub bytes: usize,
    /// Operations encoded.
    pub ops: usize,
}

fn u16_attr(attr: u32) -> u16 {
    u16::try_from(attr).unwrap_or(u16::MAX)
}

/// Encodes a transaction into one batch.
pub(super) fn encode(tx: &Transaction) -> Result<EncodedBatch, NetlinkError> {
    let mut writer = BatchWriter::new();
    for op in &tx.ops {
        writer.write(op);
    }
    writer.finish()
}

/// Encodes operations one by one into one batch: each message is written into the batch as
/// soon as it is built, so neither libnftnl's objects (one per element) nor the operations
/// themselves pile up: a streamed full sync holds only the batch's bytes.
pub(super) struct BatchWriter {
    batch: Batch,
    messages: Vec<MessageInfo>,
    /// Set ids of the sets added in this batch, for rules that look them up before the commit.
    set_ids: HashMap<(u16, String, String), u32>,
    next_set_id: u32,
    ops: usize,
    /// The first operation that could not be encoded (the batch is not sent then).
    error: Option<NetlinkError>,
}

impl Default for BatchWriter {
    fn default() -> BatchWriter {
        BatchWriter::new()
    }
}

/// Bytes per batch page. Each page is one iovec and one `sendmsg` takes at most `IOV_MAX`
/// (1024) of them, one of which may be the generation-guarded BEGIN, so the page size bounds a
/// transaction: libnftnl's default (32 memory pages, 128 KiB with 4 KiB pages) stops near
/// 128 MiB, less than a cold sync of 100,000 services × 10 endpoints needs. 1 MiB pages (or the
/// default, where memory pages are larger) reach 1 GiB; a page's untouched tail costs address
/// space, not memory.
fn batch_page_bytes() -> u32 {
    nftnl::default_batch_page_size().max(1 << 20)
}

impl OpSink for BatchWriter {
    fn push(&mut self, op: Op) {
        self.write(&op);
    }
}

impl BatchWriter {
    /// An empty batch.
    pub(super) fn new() -> BatchWriter {
        BatchWriter {
            batch: Batch::with_page_size(batch_page_bytes()),
            messages: Vec::new(),
            set_ids: HashMap::new(),
            next_set_id: 1,
            ops: 0,
            error: None,
        }
    }

    /// Encodes one operation (the first encoding error is kept and returned by `finish`).
    pub(super) fn write(&mut self, op: &Op) {
        if self.error.is_some() {
            return;
        }
        let index = self.ops;
        self.ops += 1;
        if let Err(e) = self.encode(index, op) {
            self.error = Some(e);
        }
    }

    /// The finalized batch, or the first encoding error.
    pub(super) fn finish(self) -> Result<EncodedBatch, NetlinkError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let batch = self.batch.finalize();
        let seqs = batch.sequence_numbers();
        let bytes = batch.iter().map(<[u8]>::len).sum();
        // With BEGIN/END ACKs the batch holds n + 2 sequence numbers; END has the last one.
        let acked = seqs.len() == self.messages.len() + 2;
        let end_ack_seq = acked.then(|| seqs.end - 1);
        Ok(EncodedBatch { batch, messages: self.messages, end_ack_seq, bytes, ops: self.ops })
    }

    fn encode(&mut self, index: usize, op: &Op) -> Result<(), NetlinkError> {
        let family = u16::try_from(nfproto(op.family)).unwrap_or(2);
        let table = op.table.as_str();
        let (batch, messages, set_ids) = (&mut self.batch, &mut self.messages, &mut self.set_ids);
        let mut label: Option<Box<str>> = None;
        let mut push = |kind, flags, body, owners: Option<Vec<Owner>>| {
            let message = BatchMessage::new(kind, family, flags, body);
            batch.add(&message, MsgType::Add);
            let op_text = label.get_or_insert_with(|| op.to_string().into_boxed_str()).clone();
            let elements = owners.is_some();
            let owners = owners.unwrap_or_else(|| vec![op.owner.clone()]);
            messages.push(MessageInfo {
                seq: message.seq(),
                op_index: index,
                tag: op.kind.tag(),
                op: op_text,
                owners,
                elements,
            });
        };
        match &op.kind {
            OpKind::AddTable { flags, userdata } => {
                let mut t = table_obj(table, family)?;
                t.set_u32(u16_attr(sys::NFTNL_TABLE_FLAGS), *flags);
                if let Some(ud) = userdata {
                    t.set_data(u16_attr(sys::NFTNL_TABLE_USERDATA), ud);
                }
                push(msg::NEWTABLE, NLM_F_CREATE, Object::Table(t), None);
            }
            OpKind::DeleteTable => {
                push(msg::DELTABLE, 0, Object::Table(table_obj(table, family)?), None);
            }
            OpKind::AddChain { chain, hook, userdata } => {
                let mut c = chain_obj(table, family, chain)?;
                if let Some(h) = hook {
                    c.set_u32(u16_attr(sys::NFTNL_CHAIN_HOOKNUM), h.hooknum);
                    c.set_s32(u16_attr(sys::NFTNL_CHAIN_PRIO), h.priority);
                    c.set_str(u16_attr(sys::NFTNL_CHAIN_TYPE), &h.chain_type)?;
                    c.set_u32(u16_attr(sys::NFTNL_CHAIN_POLICY), h.policy);
                }
                if let Some(ud) = userdata {
                    c.set_data(u16_attr(sys::NFTNL_CHAIN_USERDATA), ud);
                }
                push(msg::NEWCHAIN, NLM_F_CREATE, Object::Chain(c), None);
            }
            OpKind::FlushChain { chain } => {
                let mut r = raw::Rule::new()?;
                r.set_str(u16_attr(sys::NFTNL_RULE_TABLE), table)?;
                r.set_str(u16_attr(sys::NFTNL_RULE_CHAIN), chain)?;
                r.set_u32(u16_attr(sys::NFTNL_RULE_FAMILY), u32::from(family));
                push(msg::DELRULE, 0, Object::Rule(r), None);
            }
            OpKind::DeleteChain { chain } => {
                push(msg::DELCHAIN, 0, Object::Chain(chain_obj(table, family, chain)?), None);
            }
            OpKind::DeleteRule { chain, handle } => {
                let mut r = raw::Rule::new()?;
                r.set_str(u16_attr(sys::NFTNL_RULE_TABLE), table)?;
                r.set_str(u16_attr(sys::NFTNL_RULE_CHAIN), chain)?;
                r.set_u32(u16_attr(sys::NFTNL_RULE_FAMILY), u32::from(family));
                r.set_u64(u16_attr(sys::NFTNL_RULE_HANDLE), *handle);
                push(msg::DELRULE, 0, Object::Rule(r), None);
            }
            OpKind::AddRule { chain, rule } => {
                let set_id = |name: &str| set_ids.get(&(family, table.to_string(), name.to_string())).copied();
                let r = rule_obj(table, family, chain, rule, set_id)?;
                push(msg::NEWRULE, NLM_F_CREATE | NLM_F_APPEND, Object::Rule(r), None);
            }
            OpKind::AddSet { set, spec } => {
                let id = self.next_set_id;
                self.next_set_id += 1;
                set_ids.insert((family, table.to_string(), set.clone()), id);
                let object = || -> Result<raw::Set, NetlinkError> {
                    let mut s = set_obj(table, family, set)?;
                    s.set_u32(u16_attr(sys::NFTNL_SET_FLAGS), spec.flags);
                    s.set_u32(u16_attr(sys::NFTNL_SET_KEY_TYPE), spec.key_type);
                    s.set_u32(u16_attr(sys::NFTNL_SET_KEY_LEN), spec.key_len);
                    if let Some(dt) = spec.data_type {
                        s.set_u32(u16_attr(sys::NFTNL_SET_DATA_TYPE), dt);
                        s.set_u32(u16_attr(sys::NFTNL_SET_DATA_LEN), spec.data_len);
                    }
                    if let Some(t) = spec.timeout_ms {
                        s.set_u64(u16_attr(sys::NFTNL_SET_TIMEOUT), t);
                    }
                    if let Some(ud) = &spec.userdata {
                        s.set_data(u16_attr(sys::NFTNL_SET_USERDATA), ud);
                    }
                    if spec.counter {
                        s.add_expr(raw::Expr::new("counter")?);
                    }
                    Ok(s)
                };
                let mut s = object()?;
                s.set_u32(u16_attr(sys::NFTNL_SET_ID), id);
                push(msg::NEWSET, NLM_F_CREATE, Object::Set(s), None);
                // The size as an update of the set just created: a size at creation is the
                // kernel's hint for the hash table it allocates at once; an update only raises
                // the limit. The kernel finds a set of this transaction by its id (by name it
                // answers EINVAL); an older kernel that ignores set updates keeps 65,535.
                if let Some(size) = spec.size {
                    let mut s = object()?;
                    s.set_u32(u16_attr(sys::NFTNL_SET_ID), id);
                    s.set_u32(u16_attr(sys::NFTNL_SET_DESC_SIZE), size);
                    push(msg::NEWSET, NLM_F_CREATE, Object::Set(s), None);
                }
            }
            OpKind::DeleteSet { set } => {
                push(msg::DELSET, 0, Object::Set(set_obj(table, family, set)?), None);
            }
            OpKind::AddElements { set, elements } => {
                let id = set_ids.get(&(family, table.to_string(), set.clone())).copied();
                for chunk in chunk_by_size(elements, |(k, e)| element_size(k, e)) {
                    let items = chunk.iter().map(|(key, element)| (key, Some(element)));
                    let owners = chunk.iter().map(|(_, element)| element.owner.clone()).collect();
                    let attributes = element_list(table, set, id, items);
                    push(msg::NEWSETELEM, NLM_F_CREATE, Object::Attributes(attributes), Some(owners));
                }
            }
            OpKind::ForgetElements { set, keys } => {
                // DESTROYSETELEM (Linux 6.3) deletes what is there and ignores what is not; before
                // it, an element that expired in the meantime fails the batch (and a full sync
                // follows).
                let kind = if destroy_supported() { msg::DESTROYSETELEM } else { msg::DELSETELEM };
                for chunk in chunk_by_size(keys, |k| 32 + k.bytes.len()) {
                    let attributes = element_list(table, set, None, chunk.iter().map(|key| (key, None)));
                    push(kind, 0, Object::Attributes(attributes), None);
                }
            }
            OpKind::DeleteElements { set, keys } => {
                for chunk in chunk_by_size(keys, |(k, _)| 32 + k.bytes.len()) {
                    let owners = chunk.iter().map(|(_, owner)| owner.clone()).collect();
                    let attributes = element_list(table, set, None, chunk.iter().map(|(key, _)| (key, None)));
                    push(msg::DELSETELEM, 0, Object::Attributes(attributes), Some(owners));
                }
            }
        }
        Ok(())
    }
}

fn chunk_by_size<T>(items: &[T], size: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut acc = 0;
    for (i, item) in items.iter().enumerate() {
        let s = size(item);
        if acc + s > ELEMENT_MESSAGE_BUDGET && i > start {
            out.push(&items[start..i]);
            start = i;
            acc = 0;
        }
        acc += s;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

fn element_size(key: &WireKey, element: &WireElement) -> usize {
    let data = match &element.data {
        WireData::None => 0,
        WireData::Verdict { chain, .. } => 24 + chain.as_ref().map_or(0, String::len),
        WireData::Bytes(b) => 8 + b.len(),
    };
    48 + key.bytes.len() + data + element.userdata.as_ref().map_or(0, |u| u.len())
}

fn table_obj(name: &str, family: u16) -> Result<raw::Table, NetlinkError> {
    let mut t = raw::Table::new()?;
    t.set_str(u16_attr(sys::NFTNL_TABLE_NAME), name)?;
    t.set_u32(u16_attr(sys::NFTNL_TABLE_FAMILY), u32::from(family));
    Ok(t)
}

fn chain_obj(table: &str, family: u16, name: &str) -> Result<raw::Chain, NetlinkError> {
    let mut c = raw::Chain::new()?;
    c.set_str(u16_attr(sys::NFTNL_CHAIN_TABLE), table)?;
    c.set_str(u16_attr(sys::NFTNL_CHAIN_NAME), name)?;
    c.set_u32(u16_attr(sys::NFTNL_CHAIN_FAMILY), u32::from(family));
    Ok(c)
}

/// A rule of `chain` as libnftnl holds it: its expressions and userdata (`set_id`: the id of a
/// set added in the same batch).
fn rule_obj(
    table: &str,
    family: u16,
    chain: &str,
    rule: &WireRule,
    set_id: impl Fn(&str) -> Option<u32>,
) -> Result<raw::Rule, NetlinkError> {
    let mut r = raw::Rule::new()?;
    r.set_str(u16_attr(sys::NFTNL_RULE_TABLE), table)?;
    r.set_str(u16_attr(sys::NFTNL_RULE_CHAIN), chain)?;
    r.set_u32(u16_attr(sys::NFTNL_RULE_FAMILY), u32::from(family));
    for expr in &rule.exprs {
        r.add_expr(encode_expr(expr, &set_id)?);
    }
    if let Some(ud) = &rule.userdata {
        r.set_data(u16_attr(sys::NFTNL_RULE_USERDATA), ud);
    }
    Ok(r)
}

fn set_obj(table: &str, family: u16, name: &str) -> Result<raw::Set, NetlinkError> {
    let mut s = raw::Set::new()?;
    s.set_str(u16_attr(sys::NFTNL_SET_TABLE), table)?;
    s.set_str(u16_attr(sys::NFTNL_SET_NAME), name)?;
    s.set_u32(u16_attr(sys::NFTNL_SET_FAMILY), u32::from(family));
    Ok(s)
}

#[cfg(test)]
fn encode_element(key: &WireKey, element: Option<&WireElement>) -> Result<raw::SetElem, NetlinkError> {
    let mut e = raw::SetElem::new()?;
    e.data(u16_attr(sys::NFTNL_SET_ELEM_KEY), &key.bytes);
    if key.interval_end {
        e.u32(u16_attr(sys::NFTNL_SET_ELEM_FLAGS), consts::ELEM_INTERVAL_END);
    }
    if let Some(element) = element {
        match &element.data {
            WireData::None => {}
            WireData::Verdict { code, chain } => {
                e.u32(u16_attr(sys::NFTNL_SET_ELEM_VERDICT), *code as u32);
                if let Some(c) = chain {
                    e.str(u16_attr(sys::NFTNL_SET_ELEM_CHAIN), c)?;
                }
            }
            WireData::Bytes(b) => e.data(u16_attr(sys::NFTNL_SET_ELEM_DATA), b),
        }
        if let Some(ud) = &element.userdata {
            e.data(u16_attr(sys::NFTNL_SET_ELEM_USERDATA), ud);
        }
    }
    Ok(e)
}

fn payload_base(base: PayloadBase) -> u32 {
    match base {
        PayloadBase::Link => 0,
        PayloadBase::Network => 1,
        PayloadBase::Transport => 2,
    }
}

pub(super) fn encode_expr(expr: &LowExpr, set_id: impl Fn(&str) -> Option<u32>) -> Result<raw::Expr, NetlinkError> {
    let a = |attr: u32| u16::try_from(attr).unwrap_or(u16::MAX);
    let e = match expr {
        LowExpr::Payload { base, offset, len, dreg } => {
            let mut e = raw::Expr::new("payload")?;
            e.u32(a(sys::NFTNL_EXPR_PAYLOAD_DREG), *dreg)
                .u32(a(sys::NFTNL_EXPR_PAYLOAD_BASE), payload_base(*base))
                .u32(a(sys::NFTNL_EXPR_PAYLOAD_OFFSET), *offset)
                .u32(a(sys::NFTNL_EXPR_PAYLOAD_LEN), *len);
            e
        }
        LowExpr::Meta { key, dreg } => {
            let mut e = raw::Expr::new("meta")?;
            e.u32(a(sys::NFTNL_EXPR_META_KEY), *key).u32(a(sys::NFTNL_EXPR_META_DREG), *dreg);
            e
        }
        LowExpr::MetaSet { key, sreg } => {
            let mut e = raw::Expr::new("meta")?;
            e.u32(a(sys::NFTNL_EXPR_META_KEY), *key).u32(a(sys::NFTNL_EXPR_META_SREG), *sreg);
            e
        }
        LowExpr::Cmp { sreg, op, data } => {
            let mut e = raw::Expr::new("cmp")?;
            e.u32(a(sys::NFTNL_EXPR_CMP_SREG), *sreg)
                .u32(a(sys::NFTNL_EXPR_CMP_OP), *op)
                .data(a(sys::NFTNL_EXPR_CMP_DATA), data);
            e
        }
        LowExpr::Bitwise { sreg, dreg, len, mask, xor } => {
            let mut e = raw::Expr::new("bitwise")?;
            e.u32(a(sys::NFTNL_EXPR_BITWISE_SREG), *sreg)
                .u32(a(sys::NFTNL_EXPR_BITWISE_DREG), *dreg)
                .u32(a(sys::NFTNL_EXPR_BITWISE_LEN), *len)
                .data(a(sys::NFTNL_EXPR_BITWISE_MASK), mask)
                .data(a(sys::NFTNL_EXPR_BITWISE_XOR), xor);
            e
        }
        LowExpr::Lookup { sreg, dreg, set, flags } => {
            let mut e = raw::Expr::new("lookup")?;
            e.u32(a(sys::NFTNL_EXPR_LOOKUP_SREG), *sreg).str(a(sys::NFTNL_EXPR_LOOKUP_SET), set)?;
            if let Some(d) = dreg {
                e.u32(a(sys::NFTNL_EXPR_LOOKUP_DREG), *d);
            }
            if let Some(id) = set_id(set) {
                e.u32(a(sys::NFTNL_EXPR_LOOKUP_SET_ID), id);
            }
            if *flags != 0 {
                e.u32(a(sys::NFTNL_EXPR_LOOKUP_FLAGS), *flags);
            }
            e
        }
        LowExpr::Verdict { code, chain } => {
            let mut e = raw::Expr::new("immediate")?;
            e.u32(a(sys::NFTNL_EXPR_IMM_DREG), consts::REG_VERDICT).u32(a(sys::NFTNL_EXPR_IMM_VERDICT), *code as u32);
            if let Some(c) = chain {
                e.str(a(sys::NFTNL_EXPR_IMM_CHAIN), c)?;
            }
            e
        }
        LowExpr::Immediate { dreg, data } => {
            let mut e = raw::Expr::new("immediate")?;
            e.u32(a(sys::NFTNL_EXPR_IMM_DREG), *dreg).data(a(sys::NFTNL_EXPR_IMM_DATA), data);
            e
        }
        LowExpr::Numgen { dreg, modulus, kind, offset } => {
            let mut e = raw::Expr::new("numgen")?;
            e.u32(a(sys::NFTNL_EXPR_NG_DREG), *dreg)
                .u32(a(sys::NFTNL_EXPR_NG_MODULUS), *modulus)
                .u32(a(sys::NFTNL_EXPR_NG_TYPE), *kind);
            if *offset != 0 {
                e.u32(a(sys::NFTNL_EXPR_NG_OFFSET), *offset);
            }
            e
        }
        LowExpr::Hash { sreg, dreg, len, modulus, seed, offset } => {
            let mut e = raw::Expr::new("hash")?;
            e.u32(a(sys::NFTNL_EXPR_HASH_SREG), *sreg)
                .u32(a(sys::NFTNL_EXPR_HASH_DREG), *dreg)
                .u32(a(sys::NFTNL_EXPR_HASH_LEN), *len)
                .u32(a(sys::NFTNL_EXPR_HASH_MODULUS), *modulus)
                .u32(a(sys::NFTNL_EXPR_HASH_SEED), *seed)
                .u32(a(sys::NFTNL_EXPR_HASH_TYPE), consts::HASH_JENKINS);
            if *offset != 0 {
                e.u32(a(sys::NFTNL_EXPR_HASH_OFFSET), *offset);
            }
            e
        }
        LowExpr::Byteorder { sreg, dreg, op, len, size } => {
            let mut e = raw::Expr::new("byteorder")?;
            e.u32(a(sys::NFTNL_EXPR_BYTEORDER_SREG), *sreg)
                .u32(a(sys::NFTNL_EXPR_BYTEORDER_DREG), *dreg)
                .u32(a(sys::NFTNL_EXPR_BYTEORDER_OP), *op)
                .u32(a(sys::NFTNL_EXPR_BYTEORDER_LEN), *len)
                .u32(a(sys::NFTNL_EXPR_BYTEORDER_SIZE), *size);
            e
        }
        LowExpr::Fib { dreg, result, flags } => {
            let mut e = raw::Expr::new("fib")?;
            e.u32(a(sys::NFTNL_EXPR_FIB_DREG), *dreg)
                .u32(a(sys::NFTNL_EXPR_FIB_RESULT), *result)
                .u32(a(sys::NFTNL_EXPR_FIB_FLAGS), *flags);
            e
        }
        LowExpr::Ct { key, dreg } => {
            let mut e = raw::Expr::new("ct")?;
            e.u32(a(sys::NFTNL_EXPR_CT_KEY), *key).u32(a(sys::NFTNL_EXPR_CT_DREG), *dreg);
            e
        }
        LowExpr::Dynset { op, sreg_key, set, timeout_ms } => {
            let mut e = raw::Expr::new("dynset")?;
            e.u32(a(sys::NFTNL_EXPR_DYNSET_OP), *op)
                .u32(a(sys::NFTNL_EXPR_DYNSET_SREG_KEY), *sreg_key)
                .str(a(sys::NFTNL_EXPR_DYNSET_SET_NAME), set)?;
            if let Some(timeout) = timeout_ms {
                e.u64(a(sys::NFTNL_EXPR_DYNSET_TIMEOUT), *timeout);
            }
            if let Some(id) = set_id(set) {
                e.u32(a(sys::NFTNL_EXPR_DYNSET_SET_ID), id);
            }
            e
        }
        LowExpr::Nat { kind, family, reg_addr, reg_proto, flags } => {
            let mut e = raw::Expr::new("nat")?;
            e.u32(a(sys::NFTNL_EXPR_NAT_TYPE), *kind).u32(a(sys::NFTNL_EXPR_NAT_FAMILY), *family);
            if let Some(r) = reg_addr {
                e.u32(a(sys::NFTNL_EXPR_NAT_REG_ADDR_MIN), *r);
            }
            if let Some(r) = reg_proto {
                e.u32(a(sys::NFTNL_EXPR_NAT_REG_PROTO_MIN), *r);
            }
            if *flags != 0 {
                e.u32(a(sys::NFTNL_EXPR_NAT_FLAGS), *flags);
            }
            e
        }
        LowExpr::Masq { flags } => {
            let mut e = raw::Expr::new("masq")?;
            if *flags != 0 {
                e.u32(a(sys::NFTNL_EXPR_MASQ_FLAGS), *flags);
            }
            e
        }
        LowExpr::Reject { kind, code } => {
            let mut e = raw::Expr::new("reject")?;
            e.u32(a(sys::NFTNL_EXPR_REJECT_TYPE), *kind).u8(a(sys::NFTNL_EXPR_REJECT_CODE), *code);
            e
        }
        LowExpr::Foreign(name) => return Err(NetlinkError::ForeignExpression(name.clone())),
    };
    Ok(e)
}

/// Whether the running kernel has `NFT_MSG_DESTROYSETELEM` (Linux 6.3 and later).
fn destroy_supported() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut parts = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        (major, minor) >= (6, 3)
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::nft::wire::udata;
    use raw::Body;

    /// The encoder's element messages are byte for byte what libnftnl writes for a set object
    /// holding the same elements: every kind of key and data, with and without a comment, an
    /// interval end, in a set added in the same batch or not.
    #[test]
    fn element_lists_are_what_libnftnl_writes() {
        let comment: Arc<[u8]> = Arc::from(udata::comment("ns/svc:p80"));
        let element = |data: WireData, userdata: Option<Arc<[u8]>>| WireElement {
            data,
            userdata,
            owner: Owner::infrastructure(),
        };
        let key = |bytes: &[u8], interval_end: bool| WireKey { bytes: bytes.iter().copied().collect(), interval_end };
        let items: Vec<(WireKey, WireElement)> = vec![
            (key(&[10, 96, 0, 1], false), element(WireData::None, None)),
            (key(&[10, 96, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0], false), element(WireData::None, Some(comment.clone()))),
            (
                key(&[10, 96, 0, 2, 17, 0, 0, 0, 0, 53, 0, 0, 3, 0, 0, 0], false),
                element(
                    WireData::Bytes([10, 128, 0, 7, 0x1f, 0x90, 0, 0].into_iter().collect()),
                    Some(comment.clone()),
                ),
            ),
            (
                key(&[1, 2, 3, 4, 6, 0, 0, 0, 0, 80, 0, 0], false),
                element(WireData::Verdict { code: -4, chain: Some("firewall-X-ns/svc/tcp/p80".into()) }, None),
            ),
            (key(&[0, 0, 0, 0], false), element(WireData::Verdict { code: 0, chain: None }, Some(comment.clone()))),
            (key(&[0, 16, 0, 0], true), element(WireData::None, None)),
            (key(&[0xfd; 32], false), element(WireData::None, None)),
        ];
        for set_id in [None, Some(7)] {
            let mut set = set_obj("nftproxy", 2, "service-endpoints-3").unwrap();
            if let Some(id) = set_id {
                set.set_u32(u16_attr(sys::NFTNL_SET_ID), id);
            }
            for (k, e) in &items {
                set.add_elem(encode_element(k, Some(e)).unwrap());
            }
            let libnftnl = raw::request(msg::NEWSETELEM, 2, NLM_F_CREATE, 9, Body::SetElements(&set));
            let ours = element_list("nftproxy", "service-endpoints-3", set_id, items.iter().map(|(k, e)| (k, Some(e))));
            let ours = raw::request(msg::NEWSETELEM, 2, NLM_F_CREATE, 9, Body::Attributes(&ours));
            assert_eq!(ours, libnftnl, "with set id {set_id:?}");
        }
        // Keys only, as deletions send them.
        let mut set = set_obj("nftproxy", 10, "hairpin-endpoints").unwrap();
        for (k, _) in &items {
            set.add_elem(encode_element(k, None).unwrap());
        }
        let libnftnl = raw::request(msg::DELSETELEM, 10, 0, 3, Body::SetElements(&set));
        let ours = element_list("nftproxy", "hairpin-endpoints", None, items.iter().map(|(k, _)| (k, None)));
        assert_eq!(raw::request(msg::DELSETELEM, 10, 0, 3, Body::Attributes(&ours)), libnftnl);
    }
}
