//! kube-proxy's IPVS-mode state outside nftables, over small hand-written netlink messages
//! (no `unsafe`: the sockets are nix's): IPVS virtual servers (generic netlink family `IPVS`),
//! the `kube-ipvs0` device (rtnetlink) and its `KUBE-` ipsets (nfnetlink ipset). None of it can
//! go in an nftables transaction, so `run` removes it right after the transaction that took over
//! from kube-proxy (once its iptables rules, which reference the ipsets, are gone), as upstream
//! does when it starts in nftables mode: every virtual server (upstream flushes IPVS), the
//! device, and the ipsets by the names kube-proxy gives them.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, send, setsockopt, socket,
    sockopt,
};
use serde::Serialize;

/// The dummy device kube-proxy's IPVS mode puts every service address on.
pub(crate) const IPVS_DEVICE: &str = "kube-ipvs0";

/// The ipsets kube-proxy's IPVS mode creates (IPv4 names; IPv6 ones are `KUBE-6-…`).
const IPSETS: [&str; 17] = [
    "KUBE-LOOP-BACK",
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
];

/// Every ipset name kube-proxy's IPVS mode may have used, both families.
fn ipset_names() -> impl Iterator<Item = String> {
    IPSETS.iter().flat_map(|n| [n.to_string(), n.replacen("KUBE-", "KUBE-6-", 1)])
}

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const IPVS_GENL_VERSION: u8 = 1;
const IPVS_CMD_GET_SERVICE: u8 = 4;
const IPVS_CMD_FLUSH: u8 = 17;

const RTM_DELLINK: u16 = 17;

const NFNL_SUBSYS_IPSET: u16 = 6;
const IPSET_CMD_DESTROY: u16 = 3;
const IPSET_CMD_HEADER: u16 = 12;
const IPSET_ATTR_PROTOCOL: u16 = 1;
const IPSET_ATTR_SETNAME: u16 = 2;
/// The oldest ipset protocol the kernel speaks (it answers newer clients too).
const IPSET_PROTOCOL: u8 = 6;

/// A netlink socket of one protocol, talking to the kernel.
struct Socket {
    fd: OwnedFd,
    seq: u32,
}

impl Socket {
    fn open(protocol: SockProtocol) -> io::Result<Socket> {
        let fd = socket(AddressFamily::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, protocol)?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))?;
        setsockopt(&fd, sockopt::ReceiveTimeout, &nix::sys::time::TimeVal::new(2, 0))?;
        Ok(Socket { fd, seq: 0 })
    }

    /// Sends one request and returns the bodies (after the netlink header) of the replies: the
    /// messages of a dump, or nothing for an acknowledged request. An error reply is an
    /// `io::Error` with its errno.
    fn request(&mut self, kind: u16, flags: u16, body: &[u8]) -> io::Result<Vec<Vec<u8>>> {
        self.seq += 1;
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        let flags = NLM_F_REQUEST | flags | if dump { 0 } else { NLM_F_ACK };
        let mut msg = Vec::with_capacity(16 + body.len());
        msg.extend_from_slice(&u32::try_from(16 + body.len()).unwrap_or(u32::MAX).to_ne_bytes());
        msg.extend_from_slice(&kind.to_ne_bytes());
        msg.extend_from_slice(&flags.to_ne_bytes());
        msg.extend_from_slice(&self.seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(body);
        send(self.fd.as_raw_fd(), &msg, MsgFlags::empty())?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
            let mut at = 0;
            while at + 16 <= n {
                let len = u32_at(&buf, at) as usize;
                let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
                let seq = u32_at(&buf, at + 8);
                if len < 16 || at + len > n {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "malformed netlink reply"));
                }
                let payload = &buf[at + 16..at + len];
                at += (len + 3) & !3;
                if seq != self.seq {
                    continue;
                }
                match kind {
                    NLMSG_ERROR => {
                        let errno = payload.get(..4).map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                        return if errno == 0 { Ok(out) } else { Err(io::Error::from_raw_os_error(-errno)) };
                    }
                    NLMSG_DONE => return Ok(out),
                    _ => out.push(payload.to_vec()),
                }
            }
        }
    }
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]])
}

/// Appends a netlink attribute (padded to 4 bytes).
fn attr(out: &mut Vec<u8>, kind: u16, data: &[u8]) {
    out.extend_from_slice(&u16::try_from(4 + data.len()).unwrap_or(u16::MAX).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(data);
    out.resize((out.len() + 3) & !3, 0);
}

/// The attributes of a message body after its `skip`-byte family header: (type, data).
fn attrs(body: &[u8], skip: usize) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut at = skip;
    while at + 4 <= body.len() {
        let len = usize::from(u16::from_ne_bytes([body[at], body[at + 1]]));
        let kind = u16::from_ne_bytes([body[at + 2], body[at + 3]]) & 0x3fff;
        if len < 4 || at + len > body.len() {
            break;
        }
        out.push((kind, &body[at + 4..at + len]));
        at += (len + 3) & !3;
    }
    out
}

fn cstr(name: &str) -> Vec<u8> {
    let mut v = name.as_bytes().to_vec();
    v.push(0);
    v
}

/// The generic netlink family id of IPVS, `None` when the kernel has no IPVS (module absent).
fn ipvs_family(sock: &mut Socket) -> io::Result<Option<u16>> {
    let mut body = vec![CTRL_CMD_GETFAMILY, 1, 0, 0];
    attr(&mut body, CTRL_ATTR_FAMILY_NAME, &cstr("IPVS"));
    match sock.request(GENL_ID_CTRL, 0, &body) {
        Ok(replies) => Ok(replies.iter().flat_map(|r| attrs(r, 4)).find_map(|(kind, data)| {
            (kind == CTRL_ATTR_FAMILY_ID && data.len() >= 2).then(|| u16::from_ne_bytes([data[0], data[1]]))
        })),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

fn ipset_request(sock: &mut Socket, cmd: u16, name: &str) -> io::Result<()> {
    // nfgenmsg: AF_INET, NFNETLINK_V0, res_id 0.
    let mut body = vec![libc::AF_INET as u8, 0, 0, 0];
    attr(&mut body, IPSET_ATTR_PROTOCOL, &[IPSET_PROTOCOL]);
    attr(&mut body, IPSET_ATTR_SETNAME, &cstr(name));
    sock.request((NFNL_SUBSYS_IPSET << 8) | cmd, 0, &body).map(|_| ())
}

/// What of kube-proxy's IPVS mode is here.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct IpvsLeftovers {
    /// IPVS virtual servers (`None`: the kernel has no IPVS).
    pub virtual_servers: Option<usize>,
    /// Whether the `kube-ipvs0` device exists.
    pub device: bool,
    /// kube-proxy's ipsets that exist.
    pub ipsets: Vec<String>,
}

impl IpvsLeftovers {
    /// Nothing to remove.
    pub(crate) fn is_empty(&self) -> bool {
        self.virtual_servers.unwrap_or(0) == 0 && !self.device && self.ipsets.is_empty()
    }

    /// Reads them in this network namespace.
    pub(crate) fn read() -> io::Result<IpvsLeftovers> {
        let mut out =
            IpvsLeftovers { device: nix::net::if_::if_nametoindex(IPVS_DEVICE).is_ok(), ..Default::default() };
        let mut genl = Socket::open(SockProtocol::NetlinkGeneric)?;
        if let Some(family) = ipvs_family(&mut genl)? {
            let services = genl.request(family, NLM_F_DUMP, &[IPVS_CMD_GET_SERVICE, IPVS_GENL_VERSION, 0, 0])?;
            out.virtual_servers = Some(services.len());
        }
        let mut nf = Socket::open(SockProtocol::NetlinkNetFilter)?;
        for name in ipset_names() {
            match ipset_request(&mut nf, IPSET_CMD_HEADER, &name) {
                Ok(()) => out.ipsets.push(name),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                // No ipset in this kernel.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EPROTONOSUPPORT | libc::EINVAL)) => {
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Removes them: flushes IPVS, deletes the device, destroys the ipsets. Returns what could
    /// not be removed, each with the error.
    pub(crate) fn remove(&self) -> Vec<(String, io::Error)> {
        let mut failed = Vec::new();
        if self.virtual_servers.unwrap_or(0) > 0 {
            let flushed =
                Socket::open(SockProtocol::NetlinkGeneric).and_then(|mut genl| match ipvs_family(&mut genl)? {
                    Some(family) => genl.request(family, 0, &[IPVS_CMD_FLUSH, IPVS_GENL_VERSION, 0, 0]).map(|_| ()),
                    None => Ok(()),
                });
            if let Err(e) = flushed {
                failed.push(("IPVS virtual servers".to_string(), e));
            }
        }
        if self.device {
            let deleted = nix::net::if_::if_nametoindex(IPVS_DEVICE).map_err(io::Error::from).and_then(|index| {
                let mut body = vec![libc::AF_UNSPEC as u8, 0, 0, 0];
                body.extend_from_slice(&i32::try_from(index).unwrap_or(0).to_ne_bytes());
                body.extend_from_slice(&[0; 8]);
                Socket::open(SockProtocol::NetlinkRoute)?.request(RTM_DELLINK, 0, &body).map(|_| ())
            });
            if let Err(e) = deleted {
                failed.push((format!("device {IPVS_DEVICE}"), e));
            }
        }
        if !self.ipsets.is_empty() {
            match Socket::open(SockProtocol::NetlinkNetFilter) {
                Ok(mut nf) => {
                    for name in &self.ipsets {
                        if let Err(e) = destroy_ipset(&mut nf, name) {
                            failed.push((format!("ipset {name}"), e));
                        }
                    }
                }
                Err(e) => failed.push(("ipsets".to_string(), e)),
            }
        }
        failed
    }

    /// One line for logs and `check`.
    pub(crate) fn summary(&self) -> String {
        let mut parts = Vec::new();
        if let Some(n) = self.virtual_servers.filter(|n| *n > 0) {
            parts.push(format!("{n} IPVS virtual server(s) (all are flushed, as upstream does)"));
        }
        if self.device {
            parts.push(format!("device {IPVS_DEVICE}"));
        }
        if !self.ipsets.is_empty() {
            parts.push(format!("ipsets {}", self.ipsets.join(", ")));
        }
        parts.join("; ")
    }
}

/// Destroys an ipset; the iptables rules that used it were deleted in the transaction just
/// committed, and the kernel releases their references shortly after, so `EBUSY` is retried.
fn destroy_ipset(nf: &mut Socket, name: &str) -> io::Result<()> {
    let mut tries = 0;
    loop {
        match ipset_request(nf, IPSET_CMD_DESTROY, name) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 20 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_parse_back() {
        let mut body = vec![0u8; 4];
        attr(&mut body, IPSET_ATTR_PROTOCOL, &[IPSET_PROTOCOL]);
        attr(&mut body, IPSET_ATTR_SETNAME, &cstr("KUBE-CLUSTER-IP"));
        assert_eq!(body.len() % 4, 0);
        let parsed = attrs(&body, 4);
        assert_eq!(parsed[0], (IPSET_ATTR_PROTOCOL, &[6u8][..]));
        assert_eq!(parsed[1].1, b"KUBE-CLUSTER-IP\0");
        assert!(ipset_names().any(|n| n == "KUBE-6-CLUSTER-IP"));
        assert_eq!(ipset_names().count(), 34);
    }
}
