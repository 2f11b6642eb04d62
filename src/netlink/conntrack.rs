//! Conntrack entries over ctnetlink: dump a family's flows of some protocols and delete
//! exact tuples (nftproxy never flushes the table).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::error::NetlinkError;
use super::socket::Socket;
use crate::net::IpFamily;

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const NLA_F_NESTED: u16 = 0x8000;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
/// `IPS_SEEN_REPLY`: a packet went the other way.
const IPS_SEEN_REPLY: u32 = 1 << 1;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

/// One direction of a connection: source and destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Tuple {
    pub src: SocketAddr,
    pub dst: SocketAddr,
}

/// A conntrack entry: protocol, original and reply tuples, and whether anything answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Flow {
    pub protocol: u8,
    pub original: Tuple,
    pub reply: Tuple,
    /// `IPS_SEEN_REPLY`: not `[UNREPLIED]` in `conntrack -L`.
    pub replied: bool,
}

fn family_code(family: IpFamily) -> u8 {
    match family {
        IpFamily::V4 => libc::AF_INET as u8,
        IpFamily::V6 => libc::AF_INET6 as u8,
    }
}

/// Builds one ctnetlink message.
struct Message {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl Message {
    fn new(kind: u16, flags: u16, seq: u32, family: IpFamily) -> Message {
        let mut buf = Vec::with_capacity(128);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | kind).to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&[family_code(family), 0, 0, 0]);
        Message { buf, nests: Vec::new() }
    }

    fn attr(&mut self, kind: u16, value: &[u8]) {
        let len = u16::try_from(4 + value.len()).unwrap_or(u16::MAX);
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value);
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn open(&mut self, kind: u16) {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    }

    fn close(&mut self) {
        if let Some(start) = self.nests.pop() {
            let len = u16::try_from(self.buf.len() - start).unwrap_or(u16::MAX);
            self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        }
    }

    fn tuple(&mut self, kind: u16, protocol: u8, t: &Tuple) {
        self.open(kind);
        self.open(CTA_TUPLE_IP);
        match (t.src.ip(), t.dst.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                self.attr(CTA_IP_V4_SRC, &s.octets());
                self.attr(CTA_IP_V4_DST, &d.octets());
            }
            (s, d) => {
                self.attr(CTA_IP_V6_SRC, &v6(s).octets());
                self.attr(CTA_IP_V6_DST, &v6(d).octets());
            }
        }
        self.close();
        self.open(CTA_TUPLE_PROTO);
        self.attr(CTA_PROTO_NUM, &[protocol]);
        self.attr(CTA_PROTO_SRC_PORT, &t.src.port().to_be_bytes());
        self.attr(CTA_PROTO_DST_PORT, &t.dst.port().to_be_bytes());
        self.close();
        self.close();
    }

    fn finish(mut self) -> Vec<u8> {
        let len = u32::try_from(self.buf.len()).unwrap_or(u32::MAX);
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }
}

fn v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V6(a) => a,
        IpAddr::V4(a) => a.to_ipv6_mapped(),
    }
}

/// Iterates the attributes in `b`: (type without flags, value).
fn attrs(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if b.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
        let kind = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            return None;
        }
        let value = &b[4..len];
        b = &b[(len.div_ceil(4) * 4).min(b.len())..];
        Some((kind, value))
    })
}

fn parse_tuple(b: &[u8]) -> Option<(u8, Tuple)> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, None, None);
    for (kind, value) in attrs(b) {
        match kind {
            CTA_TUPLE_IP => {
                for (k, v) in attrs(value) {
                    let ip = match v.len() {
                        4 => Some(IpAddr::V4(Ipv4Addr::new(v[0], v[1], v[2], v[3]))),
                        16 => <[u8; 16]>::try_from(v).ok().map(|o| IpAddr::V6(Ipv6Addr::from(o))),
                        _ => None,
                    };
                    match k {
                        CTA_IP_V4_SRC | CTA_IP_V6_SRC => src = ip,
                        CTA_IP_V4_DST | CTA_IP_V6_DST => dst = ip,
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (k, v) in attrs(value) {
                    match (k, v.len()) {
                        (CTA_PROTO_NUM, 1) => proto = Some(v[0]),
                        (CTA_PROTO_SRC_PORT, 2) => sport = Some(u16::from_be_bytes([v[0], v[1]])),
                        (CTA_PROTO_DST_PORT, 2) => dport = Some(u16::from_be_bytes([v[0], v[1]])),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((
        proto?,
        Tuple { src: SocketAddr::new(src?, sport.unwrap_or(0)), dst: SocketAddr::new(dst?, dport.unwrap_or(0)) },
    ))
}

/// Parses one IPCTNL_MSG_CT_NEW message of a dump.
fn parse_flow(msg: &[u8]) -> Option<Flow> {
    let kind = u16::from_ne_bytes([*msg.get(4)?, *msg.get(5)?]);
    if kind != (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW {
        return None;
    }
    // Without a status the entry counts as answered: never deleted for lack of an answer.
    let (mut original, mut reply, mut status) = (None, None, IPS_SEEN_REPLY);
    for (k, v) in attrs(msg.get(20..)?) {
        match k {
            CTA_TUPLE_ORIG => original = parse_tuple(v),
            CTA_TUPLE_REPLY => reply = parse_tuple(v),
            CTA_STATUS => status = <[u8; 4]>::try_from(v).map(u32::from_be_bytes).unwrap_or(IPS_SEEN_REPLY),
            _ => {}
        }
    }
    let (protocol, original) = original?;
    let (_, reply) = reply?;
    Some(Flow { protocol, original, reply, replied: status & IPS_SEEN_REPLY != 0 })
}

/// A ctnetlink connection.
pub(crate) struct Conntrack {
    socket: Socket,
}

impl Conntrack {
    /// Opens a ctnetlink socket in the current network namespace.
    pub(crate) fn open() -> Result<Conntrack, NetlinkError> {
        let socket = Socket::open()?;
        socket.size_buffers(1 << 20, 8 << 20);
        Ok(Conntrack { socket })
    }

    /// The flows of `family` that `keep` keeps (a busy node holds hundreds of thousands: only
    /// those are held in memory).
    pub(crate) fn flows(&mut self, family: IpFamily, keep: &dyn Fn(&Flow) -> bool) -> Result<Vec<Flow>, NetlinkError> {
        let seq = self.socket.next_seq();
        let req = Message::new(IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, seq, family).finish();
        let mut out = Vec::new();
        self.socket.exchange(&req, seq, |msg| {
            if let Some(f) = parse_flow(msg)
                && keep(&f)
            {
                out.push(f);
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Deletes these flows by their original tuple. Returns how many the kernel removed (an
    /// entry may have expired meanwhile).
    pub(crate) fn delete(&mut self, family: IpFamily, flows: &[Flow]) -> Result<usize, NetlinkError> {
        if flows.is_empty() {
            return Ok(0);
        }
        let mut buf = Vec::new();
        for f in flows {
            let seq = self.socket.next_seq();
            let mut m = Message::new(IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST, seq, family);
            m.tuple(CTA_TUPLE_ORIG, f.protocol, &f.original);
            buf.extend_from_slice(&m.finish());
            // Stay well inside one receive buffer's worth of error replies per datagram.
            if buf.len() > 256 * 1024 {
                self.socket.send(&buf)?;
                buf.clear();
            }
        }
        if !buf.is_empty() {
            self.socket.send(&buf)?;
        }
        let replies = self.socket.drain_replies()?;
        let missing = replies.iter().filter(|r| r.error != 0).count();
        Ok(flows.len().saturating_sub(missing))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delete_message_parses_back_as_its_tuple() {
        let flow = Flow {
            protocol: 17,
            original: Tuple { src: "10.0.0.5:5353".parse().unwrap(), dst: "10.96.0.10:53".parse().unwrap() },
            reply: Tuple { src: "10.244.1.10:53".parse().unwrap(), dst: "10.0.0.5:5353".parse().unwrap() },
            replied: true,
        };
        let mut m = Message::new(IPCTNL_MSG_CT_NEW, 0, 1, IpFamily::V4);
        m.tuple(CTA_TUPLE_ORIG, flow.protocol, &flow.original);
        m.tuple(CTA_TUPLE_REPLY, flow.protocol, &flow.reply);
        // IPS_CONFIRMED | IPS_SEEN_REPLY | IPS_DST_NAT
        m.attr(CTA_STATUS, &(0x8u32 | 0x2 | 0x20).to_be_bytes());
        assert_eq!(parse_flow(&m.finish()), Some(flow));
        let mut m = Message::new(IPCTNL_MSG_CT_NEW, 0, 1, IpFamily::V4);
        m.tuple(CTA_TUPLE_ORIG, flow.protocol, &flow.original);
        m.tuple(CTA_TUPLE_REPLY, flow.protocol, &flow.reply);
        m.attr(CTA_STATUS, &0x8u32.to_be_bytes());
        assert_eq!(parse_flow(&m.finish()), Some(Flow { replied: false, ..flow }));
        let v6 = Tuple { src: "[fd00::5]:1".parse().unwrap(), dst: "[fd00:96::10]:53".parse().unwrap() };
        let mut m = Message::new(IPCTNL_MSG_CT_NEW, 0, 1, IpFamily::V6);
        m.tuple(CTA_TUPLE_ORIG, 132, &v6);
        m.tuple(CTA_TUPLE_REPLY, 132, &v6);
        assert_eq!(parse_flow(&m.finish()).map(|f| (f.protocol, f.original)), Some((132, v6)));
    }
}
