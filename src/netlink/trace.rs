//! `nftproxy trace` at the kernel edge: a short-lived table whose rules set `meta nftrace set 1`
//! on the packets to follow, and the trace events the kernel multicasts for them.
//!
//! Kernel facts this depends on (Linux 6.x, each tested in network namespaces):
//! - `nftrace` is a bit on the packet: once set, every nf_tables base chain the packet passes
//!   afterwards, in any table and family and on later hooks too, reports what it did with it.
//!   So one rule before nftproxy's nat chains is enough: at priority -150 (`mangle`) on
//!   prerouting and output it runs after conntrack (-200), so `ct state new` picks exactly the
//!   packets nftproxy's nat chains see (a connection's first), and before them (-100).
//! - The table is owned by the socket that created it (`NFT_TABLE_F_OWNER` without `persist`):
//!   the kernel deletes it when that socket closes, however the process ends (SIGKILL
//!   included), and no other process can change it meanwhile.
//! - Events go to the multicast group `NFNLGRP_NFTRACE`, whose members need CAP_NET_ADMIN.
//!   They are read on a second socket, so they never mix with the replies to the table's
//!   batch; multicast does not wait for a slow reader (`ENOBUFS`), hence a large buffer.
//! - libnftnl 1.2.4 parses every attribute but the conntrack ones (18–21, Linux 6.8+), which
//!   are read from the message here.

use std::io;
use std::net::IpAddr;
use std::time::Duration;

use nftnl::{Batch, MsgType};
use nftnl_sys as sys;

use super::Kernel;
use super::decode::a;
use super::encode::encode_expr;
use super::error::NetlinkError;
use super::inventory::TableFamily;
use super::socket::{NLM_F_DUMP, Socket};
use super::sys::{self as raw, BatchMessage, Body, Object, msg};
use crate::nft::wire::consts::{CMP_EQ, CMP_NEQ, CT_STATE, CT_STATE_NEW, META_L4PROTO, POLICY_ACCEPT, REG_1, REG32_00};
use crate::nft::wire::{LowExpr, PayloadBase, udata};

/// `NFNLGRP_NFTRACE`: the multicast group of trace events.
const NFNLGRP_NFTRACE: u32 = 9;
/// `NFNL_SUBSYS_NFTABLES`, the high byte of every nf_tables message type.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// `NFT_TABLE_F_OWNER`
const TABLE_F_OWNER: u32 = 0x2;
/// `NFPROTO_INET`: a table for both IPv4 and IPv6.
const NFPROTO_INET: u16 = 1;
/// `NF_INET_PRE_ROUTING` and `NF_INET_LOCAL_OUT`.
const HOOK_PREROUTING: u32 = 0;
const HOOK_OUTPUT: u32 = 3;
/// `NF_IP_PRI_MANGLE`: after conntrack (-200), before the nat chains (-100).
pub(crate) const TRACE_PRIORITY: i32 = -150;
/// `NFT_META_NFPROTO` and `NFT_META_NFTRACE`.
const META_NFPROTO: u32 = 15;
const META_NFTRACE: u32 = 12;
/// `NFT_LIMIT_PKTS`
const LIMIT_PACKETS: u32 = 0;

const NLM_F_CREATE: u16 = 0x400;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_APPEND: u16 = 0x800;

/// What the packets to trace must match: every field given, and always `ct state new` (a
/// connection's first packet, the one nftproxy's nat chains see).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TraceMatch {
    pub(crate) source: Option<IpAddr>,
    pub(crate) destination: Option<IpAddr>,
    /// IANA protocol numbers; empty matches any (but a port needs one: TCP, UDP and SCTP are
    /// then each matched).
    pub(crate) protocols: Vec<u8>,
    pub(crate) destination_port: Option<u16>,
    /// Packets marked per second at most, so a flood cannot flood the listener too.
    pub(crate) rate: u32,
}

impl TraceMatch {
    /// The address family the match is limited to, if an address is given.
    fn family(&self) -> Option<IpAddr> {
        self.destination.or(self.source)
    }

    /// The rule expressions: one rule per protocol (or one when any protocol goes).
    fn rules(&self) -> Vec<Vec<LowExpr>> {
        let protocols: Vec<Option<u8>> = match (&self.protocols[..], self.destination_port) {
            ([], None) => vec![None],
            ([], Some(_)) => [6u8, 17, 132].into_iter().map(Some).collect(),
            (list, _) => list.iter().copied().map(Some).collect(),
        };
        protocols.into_iter().map(|protocol| self.rule(protocol)).collect()
    }

    fn rule(&self, protocol: Option<u8>) -> Vec<LowExpr> {
        let mut out = vec![
            LowExpr::Ct { key: CT_STATE, dreg: REG_1 },
            LowExpr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                len: 4,
                mask: CT_STATE_NEW.to_ne_bytes().to_vec(),
                xor: vec![0; 4],
            },
            LowExpr::Cmp { sreg: REG_1, op: CMP_NEQ, data: vec![0; 4] },
        ];
        let eq = |data: Vec<u8>| LowExpr::Cmp { sreg: REG_1, op: CMP_EQ, data };
        if let Some(any) = self.family() {
            let nfproto: u8 = if any.is_ipv4() { 2 } else { 10 };
            out.push(LowExpr::Meta { key: META_NFPROTO, dreg: REG_1 });
            out.push(eq(vec![nfproto]));
        }
        for (address, v4_offset, v6_offset) in [(self.source, 12, 8), (self.destination, 16, 24)] {
            let Some(address) = address else { continue };
            let (offset, bytes) = match address {
                IpAddr::V4(a) => (v4_offset, a.octets().to_vec()),
                IpAddr::V6(a) => (v6_offset, a.octets().to_vec()),
            };
            let len = u32::try_from(bytes.len()).unwrap_or(4);
            out.push(LowExpr::Payload { base: PayloadBase::Network, offset, len, dreg: REG_1 });
            out.push(eq(bytes));
        }
        if let Some(protocol) = protocol {
            out.push(LowExpr::Meta { key: META_L4PROTO, dreg: REG_1 });
            out.push(eq(vec![protocol]));
        }
        if let Some(port) = self.destination_port {
            out.push(LowExpr::Payload { base: PayloadBase::Transport, offset: 2, len: 2, dreg: REG_1 });
            out.push(eq(port.to_be_bytes().to_vec()));
        }
        out
    }
}

/// The trace table, owned by this process: the kernel deletes it when the table's socket
/// closes (when this value is dropped, or the process ends in any way).
pub(crate) struct TraceTable {
    name: String,
    /// Never read: the table lives as long as the socket is open.
    _owner: Socket,
}

impl TraceTable {
    /// Creates `inet <name>` with a chain at prerouting and one at output, priority -150, whose
    /// rules set `meta nftrace set 1` on new connections `filter` matches. Fails, touching
    /// nothing, if a table of that name exists (it is someone else's).
    pub(crate) fn create(name: &str, filter: &TraceMatch) -> Result<TraceTable, NetlinkError> {
        let socket = Socket::open()?;
        let refused = |source: io::Error| NetlinkError::TraceTable { table: format!("inet {name}"), source };
        let mut batch = Batch::new();
        let mut table = raw::Table::new()?;
        table.set_str(a(sys::NFTNL_TABLE_NAME), name)?;
        table.set_u32(a(sys::NFTNL_TABLE_FAMILY), u32::from(NFPROTO_INET));
        table.set_u32(a(sys::NFTNL_TABLE_FLAGS), TABLE_F_OWNER);
        table.set_data(
            a(sys::NFTNL_TABLE_USERDATA),
            &udata::comment(&format!("nftproxy trace (pid {}); gone when it exits", std::process::id())),
        );
        let message = |kind, flags, object| BatchMessage::new(kind, NFPROTO_INET, flags, object);
        batch.add(&message(msg::NEWTABLE, NLM_F_CREATE | NLM_F_EXCL, Object::Table(table)), MsgType::Add);
        for (chain_name, hook) in [("prerouting", HOOK_PREROUTING), ("output", HOOK_OUTPUT)] {
            let mut chain = raw::Chain::new()?;
            chain.set_str(a(sys::NFTNL_CHAIN_TABLE), name)?;
            chain.set_str(a(sys::NFTNL_CHAIN_NAME), chain_name)?;
            chain.set_u32(a(sys::NFTNL_CHAIN_FAMILY), u32::from(NFPROTO_INET));
            chain.set_u32(a(sys::NFTNL_CHAIN_HOOKNUM), hook);
            chain.set_s32(a(sys::NFTNL_CHAIN_PRIO), TRACE_PRIORITY);
            chain.set_str(a(sys::NFTNL_CHAIN_TYPE), "filter")?;
            chain.set_u32(a(sys::NFTNL_CHAIN_POLICY), POLICY_ACCEPT);
            batch.add(&message(msg::NEWCHAIN, NLM_F_CREATE, Object::Chain(chain)), MsgType::Add);
            for exprs in filter.rules() {
                let mut rule = raw::Rule::new()?;
                rule.set_str(a(sys::NFTNL_RULE_TABLE), name)?;
                rule.set_str(a(sys::NFTNL_RULE_CHAIN), chain_name)?;
                rule.set_u32(a(sys::NFTNL_RULE_FAMILY), u32::from(NFPROTO_INET));
                for expr in &exprs {
                    rule.add_expr(encode_expr(expr, |_| None)?);
                }
                let mut limit = raw::Expr::new("limit")?;
                limit
                    .u64(a(sys::NFTNL_EXPR_LIMIT_RATE), u64::from(filter.rate.max(1)))
                    .u64(a(sys::NFTNL_EXPR_LIMIT_UNIT), 1)
                    .u32(a(sys::NFTNL_EXPR_LIMIT_BURST), filter.rate.max(1))
                    .u32(a(sys::NFTNL_EXPR_LIMIT_TYPE), LIMIT_PACKETS);
                rule.add_expr(limit);
                for expr in [
                    LowExpr::Immediate { dreg: REG32_00, data: vec![1] },
                    LowExpr::MetaSet { key: META_NFTRACE, sreg: REG32_00 },
                ] {
                    rule.add_expr(encode_expr(&expr, |_| None)?);
                }
                batch.add(&message(msg::NEWRULE, NLM_F_CREATE | NLM_F_APPEND, Object::Rule(rule)), MsgType::Add);
            }
        }
        let batch = batch.finalize();
        let pages: Vec<&[u8]> = batch.iter().collect();
        socket.size_buffers(pages.iter().map(|p| p.len()).sum::<usize>() + 64 * 1024, 1 << 20);
        let mut socket = socket;
        socket.send_pages(&pages)?;
        // The kernel handles the batch inside sendmsg: every error is queued by now.
        if let Some(reply) = socket.drain_replies()?.into_iter().find(|r| r.error != 0) {
            return Err(refused(io::Error::from_raw_os_error(-reply.error)));
        }
        Ok(TraceTable { name: name.to_string(), _owner: socket })
    }

    /// The table's name (in the `inet` family).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

/// What a trace event reports (`enum nft_trace_types`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum TraceKind {
    /// A rule matched (or, without a rule handle, the chain's end was reached: Linux 6.x
    /// reports falling off a chain as a rule event with verdict continue).
    #[default]
    Rule,
    /// The chain returned.
    Return,
    /// A base chain's policy decided.
    Policy,
    Unknown(u32),
}

/// The packet's conntrack entry, as the first event of each base chain reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TraceConntrack {
    /// `NFTA_TRACE_CT_ID`: the same for the packets of one connection, and across loopback.
    pub(crate) id: Option<u32>,
    /// 0 original, 1 reply.
    pub(crate) direction: Option<u8>,
    /// `NF_CT_STATE_BIT`s: 8 new, 2 established, 4 related, 1 invalid, 64 untracked.
    pub(crate) state: Option<u32>,
    /// `IPS_*` bits (absent when 0).
    pub(crate) status: Option<u32>,
}

/// One trace event: a rule, a chain's end or a policy, for one packet in one base chain pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TraceEvent {
    /// The family of the chain's table.
    pub(crate) family: Option<TableFamily>,
    pub(crate) table: String,
    pub(crate) chain: String,
    /// Names one packet's pass through the base chains of one hook sequence; not unique over
    /// time, and it changes when a packet loops back (see `crate::trace`).
    pub(crate) id: u32,
    pub(crate) kind: TraceKind,
    /// The rule's handle (none at a chain's end and for policies).
    pub(crate) rule: Option<u64>,
    /// `NF_*`/`NFT_*` verdict code (1 accept, 0 drop, -1 continue, -3 jump, -4 goto, -5 return).
    pub(crate) verdict: Option<i32>,
    /// The chain of a jump or goto.
    pub(crate) target: Option<String>,
    /// The policy of a base chain (1 accept, 0 drop).
    pub(crate) policy: Option<u32>,
    /// `NFPROTO_IPV4` (2) or `NFPROTO_IPV6` (10): the packet's family.
    pub(crate) nfproto: Option<u32>,
    pub(crate) iif: Option<u32>,
    pub(crate) oif: Option<u32>,
    pub(crate) mark: Option<u32>,
    /// The network and transport headers, on the first event of each base chain.
    pub(crate) network_header: Option<Vec<u8>>,
    pub(crate) transport_header: Option<Vec<u8>>,
    pub(crate) conntrack: Option<TraceConntrack>,
}

impl TraceEvent {
    fn parse(message: &raw::Received<'_>) -> Option<TraceEvent> {
        let t = message.trace()?;
        let attr = |x: u32| a(x);
        let kind = match t.get_u32(attr(sys::NFTNL_TRACE_TYPE)).unwrap_or(0) {
            1 => TraceKind::Policy,
            2 => TraceKind::Return,
            3 => TraceKind::Rule,
            other => TraceKind::Unknown(other),
        };
        Some(TraceEvent {
            family: t.get_u32(attr(sys::NFTNL_TRACE_FAMILY)).and_then(TableFamily::from_nfproto),
            table: t.get_str(attr(sys::NFTNL_TRACE_TABLE)).unwrap_or_default(),
            chain: t.get_str(attr(sys::NFTNL_TRACE_CHAIN)).unwrap_or_default(),
            id: t.get_u32(attr(sys::NFTNL_TRACE_ID)).unwrap_or(0),
            kind,
            rule: t.get_u64(attr(sys::NFTNL_TRACE_RULE_HANDLE)),
            verdict: t.get_u32(attr(sys::NFTNL_TRACE_VERDICT)).map(|v| v as i32),
            target: t.get_str(attr(sys::NFTNL_TRACE_JUMP_TARGET)),
            policy: t.get_u32(attr(sys::NFTNL_TRACE_POLICY)),
            nfproto: t.get_u32(attr(sys::NFTNL_TRACE_NFPROTO)),
            iif: t.get_u32(attr(sys::NFTNL_TRACE_IIF)),
            oif: t.get_u32(attr(sys::NFTNL_TRACE_OIF)),
            mark: t.get_u32(attr(sys::NFTNL_TRACE_MARK)),
            network_header: t.get_data(attr(sys::NFTNL_TRACE_NETWORK_HEADER)),
            transport_header: t.get_data(attr(sys::NFTNL_TRACE_TRANSPORT_HEADER)),
            conntrack: conntrack_attributes(message.bytes()),
        })
    }
}

/// The conntrack attributes of a trace message (`NFTA_TRACE_CT_ID` … `CT_STATE`, 18–21),
/// which libnftnl 1.2.4 skips. Byte order: status and state are big-endian; the id is opaque.
fn conntrack_attributes(message: &[u8]) -> Option<TraceConntrack> {
    const HEADERS: usize = 16 + 4;
    let mut ct = TraceConntrack::default();
    let mut found = false;
    let mut rest = message.get(HEADERS..)?;
    while rest.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([rest[0], rest[1]]));
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & 0x3fff;
        if len < 4 || len > rest.len() {
            break;
        }
        let value = &rest[4..len];
        let be32 = || value.get(..4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        match kind {
            18 => ct.id = be32(),
            19 => ct.direction = value.first().copied(),
            20 => ct.status = be32(),
            21 => ct.state = be32(),
            _ => {}
        }
        found |= (18..=21).contains(&kind);
        rest = rest.get(len.div_ceil(4) * 4..).unwrap_or(&[]);
    }
    found.then_some(ct)
}

/// A socket receiving every trace event of this network namespace.
pub(crate) struct TraceListener {
    socket: Socket,
}

impl TraceListener {
    /// Joins the trace group (needs CAP_NET_ADMIN here), with room for bursts of events.
    pub(crate) fn open() -> Result<TraceListener, NetlinkError> {
        let socket = Socket::open()?;
        socket.size_buffers(64 * 1024, 16 << 20);
        socket.subscribe(NFNLGRP_NFTRACE).map_err(NetlinkError::Subscribe)?;
        Ok(TraceListener { socket })
    }

    /// Waits up to `timeout` for events and appends what arrived to `out`. Returns whether the
    /// kernel dropped events for want of buffer space since the last call.
    pub(crate) fn receive(&mut self, timeout: Duration, out: &mut Vec<TraceEvent>) -> Result<bool, NetlinkError> {
        let trace_type = (NFNL_SUBSYS_NFTABLES << 8) | msg::TRACE;
        self.socket.receive(timeout, |message| {
            let bytes = message.bytes();
            if u16::from_ne_bytes([bytes[4], bytes[5]]) == trace_type
                && let Some(event) = TraceEvent::parse(&message)
            {
                out.push(event);
            }
        })
    }
}

/// A rule as a trace names it (table, chain, handle), with its comment and what its
/// expressions are: trace events carry only the handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RuleNote {
    pub(crate) family: TableFamily,
    pub(crate) table: String,
    pub(crate) chain: String,
    pub(crate) handle: u64,
    pub(crate) comment: Option<String>,
    /// Expression names in order (`payload`, `cmp`, `nat`, `masq`, `reject`, …).
    pub(crate) expressions: Vec<String>,
}

impl Kernel {
    /// Every rule of every table here: where it is, its comment and its expression names (one
    /// dump; reads only).
    pub(crate) fn rule_notes(&mut self) -> Result<Vec<RuleNote>, NetlinkError> {
        rule_notes(&mut self.socket)
    }
}

fn rule_notes(sock: &mut Socket) -> Result<Vec<RuleNote>, NetlinkError> {
    const NFPROTO_UNSPEC: u16 = 0;
    let filter = raw::Rule::new()?;
    let mut notes = Vec::new();
    sock.query(msg::GETRULE, NFPROTO_UNSPEC, NLM_F_DUMP, Body::Rule(&filter), |message| {
        let Some(r) = message.rule() else { return Ok(()) };
        let (Some(family), Some(table), Some(chain), Some(handle)) = (
            message_family(message.bytes()),
            r.get_str(a(sys::NFTNL_RULE_TABLE)),
            r.get_str(a(sys::NFTNL_RULE_CHAIN)),
            r.get_u64(a(sys::NFTNL_RULE_HANDLE)),
        ) else {
            return Ok(());
        };
        let comment = r.get_data(a(sys::NFTNL_RULE_USERDATA)).and_then(|u| udata::find_comment(&u, udata::COMMENT));
        let mut expressions = Vec::new();
        r.for_each_expr(|e| expressions.push(e.name()));
        notes.push(RuleNote { family, table, chain, handle, comment, expressions });
        Ok(())
    })?;
    Ok(notes)
}

/// The family in a message's `nfgenmsg` (the table's family).
fn message_family(message: &[u8]) -> Option<TableFamily> {
    message.get(16).and_then(|f| TableFamily::from_nfproto(u32::from(*f)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_without_a_protocol_gives_one_rule_per_transport() {
        let m = TraceMatch {
            source: None,
            destination: Some("10.96.0.10".parse().unwrap()),
            protocols: vec![],
            destination_port: Some(80),
            rate: 10,
        };
        let rules = m.rules();
        assert_eq!(rules.len(), 3);
        let protocols: Vec<&[u8]> = rules
            .iter()
            .map(|r| {
                let at = r.iter().position(|e| *e == LowExpr::Meta { key: META_L4PROTO, dreg: REG_1 }).unwrap();
                match &r[at + 1] {
                    LowExpr::Cmp { data, .. } => data.as_slice(),
                    other => panic!("{other:?}"),
                }
            })
            .collect();
        assert_eq!(protocols, vec![&[6u8][..], &[17], &[132]]);
        // ct state new, the family, the address, the protocol, the port.
        assert_eq!(rules[0][..3].len(), 3);
        assert!(rules[0].contains(&LowExpr::Cmp { sreg: REG_1, op: CMP_EQ, data: vec![2] }));
        assert!(rules[0].contains(&LowExpr::Cmp { sreg: REG_1, op: CMP_EQ, data: vec![10, 96, 0, 10] }));
        assert!(rules[0].contains(&LowExpr::Cmp { sreg: REG_1, op: CMP_EQ, data: vec![0, 80] }));
    }

    #[test]
    fn ipv6_addresses_load_their_own_offsets() {
        let m = TraceMatch {
            source: Some("fd00::1".parse().unwrap()),
            destination: None,
            protocols: vec![17],
            destination_port: None,
            rate: 10,
        };
        let rules = m.rules();
        assert_eq!(rules.len(), 1);
        assert!(rules[0].contains(&LowExpr::Payload { base: PayloadBase::Network, offset: 8, len: 16, dreg: REG_1 }));
        assert!(rules[0].contains(&LowExpr::Cmp { sreg: REG_1, op: CMP_EQ, data: vec![10] }), "nfproto ipv6");
        let any = TraceMatch { source: None, destination: None, protocols: vec![], destination_port: None, rate: 1 };
        assert_eq!(any.rules(), vec![any.rule(None)]);
        assert_eq!(any.rules()[0].len(), 3, "only ct state new");
    }

    #[test]
    fn conntrack_attributes_are_read_from_the_message() {
        // nlmsghdr (16) + nfgenmsg (4), then: TABLE "t", CT_ID, CT_DIRECTION, CT_STATE.
        let mut m = vec![0u8; 20];
        let mut attr = |kind: u16, value: &[u8]| {
            let len = 4 + value.len();
            m.extend_from_slice(&(len as u16).to_ne_bytes());
            m.extend_from_slice(&kind.to_ne_bytes());
            m.extend_from_slice(value);
            m.resize(m.len().div_ceil(4) * 4, 0);
        };
        attr(1, b"t\0");
        attr(18, &[0x60, 0xe6, 0x1f, 0x53]);
        attr(19, &[0]);
        attr(21, &8u32.to_be_bytes());
        let ct = conntrack_attributes(&m).unwrap();
        assert_eq!(ct, TraceConntrack { id: Some(0x60e6_1f53), direction: Some(0), state: Some(8), status: None });
        assert_eq!(conntrack_attributes(&m[..28]), None, "no conntrack attribute");
    }
}
