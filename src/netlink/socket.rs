//! The nfnetlink socket: sending one batch as one datagram, reading every reply, and dumps.
//!
//! Kernel facts this depends on (Linux 6.x):
//! - a batch must arrive in one `sendmsg`: a batch split across datagrams is aborted silently;
//! - the kernel processes the batch inside `sendmsg`, so every reply is queued when it returns;
//! - a failing message always gets an error reply, ACK flag or not; ≥ 6.10 ACKs BATCH_END only
//!   when the transaction committed;
//! - each reply is its own skb (~800 bytes of receive buffer), so nftproxy asks for ACKs only on
//!   BEGIN and END and sizes the receive buffer for the errors.

use std::io;
use std::os::fd::RawFd;

use super::error::NetlinkError;
use super::sys::{Body, Received};

/// `NLM_F_DUMP`: every object the request's filter matches.
pub(super) const NLM_F_DUMP: u16 = 0x300;
/// `NLM_F_ACK`
pub(super) const NLM_F_ACK: u16 = 0x4;

const SOL_NETLINK: libc::c_int = 270;
const NETLINK_ADD_MEMBERSHIP: libc::c_int = 1;
const NETLINK_CAP_ACK: libc::c_int = 10;
const NETLINK_EXT_ACK: libc::c_int = 11;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_CAPPED: u16 = 0x100;
const NLM_F_ACK_TLVS: u16 = 0x200;
const NLMSGERR_ATTR_MSG: u16 = 1;
const NLMSGERR_ATTR_OFFS: u16 = 2;
const NLMSG_HDRLEN: usize = 16;
/// The most iovecs one `sendmsg` accepts (`UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// One reply to a message of a batch.
#[derive(Debug, Clone)]
pub(super) struct Reply {
    /// Sequence number of the message this answers.
    pub seq: u32,
    /// 0 for an ACK, a negative errno otherwise.
    pub error: i32,
    /// Offset of the offending attribute in the original message (extended ACK).
    pub offset: Option<u32>,
    /// Error text from the kernel, if it gave one.
    pub text: Option<String>,
}

/// An nfnetlink socket.
pub(super) struct Socket {
    inner: mnl::Socket,
    fd: RawFd,
    seq: u32,
    buf: Vec<u32>,
}

impl Socket {
    /// Opens and binds a netfilter socket in the current network namespace.
    pub(super) fn open() -> Result<Socket, NetlinkError> {
        let inner = mnl::Socket::new(mnl::Bus::Netfilter).map_err(NetlinkError::Socket)?;
        #[allow(unsafe_code)]
        // SAFETY: the mnl socket is valid for as long as `inner` lives, which owns the fd.
        let fd = unsafe { mnl_sys::mnl_socket_get_fd(inner.as_raw_socket()) };
        // libmnl opens without SOCK_CLOEXEC: a child would keep the socket, and with it the
        // ownership of an owned table, after this process ends (and `check` would name the
        // child as the owner).
        #[allow(unsafe_code)]
        // SAFETY: `fd` is the open socket `inner` owns; F_SETFD only sets its descriptor flags.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
            return Err(NetlinkError::Socket(io::Error::last_os_error()));
        }
        let sock = Socket { inner, fd, seq: 0, buf: vec![0u32; 64 * 1024] };
        sock.set_int(SOL_NETLINK, NETLINK_EXT_ACK, 1).map_err(NetlinkError::Socket)?;
        sock.set_int(SOL_NETLINK, NETLINK_CAP_ACK, 1).map_err(NetlinkError::Socket)?;
        Ok(sock)
    }

    fn set_int(&self, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
        #[allow(unsafe_code)]
        // SAFETY: valid fd; the option value is a c_int we pass by pointer with its size.
        let rc = unsafe {
            libc::setsockopt(
                self.fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
    }

    /// The socket's netlink port id (what the kernel records as an owned table's owner).
    pub(super) fn port_id(&self) -> u32 {
        self.inner.portid()
    }

    /// Raises the send and receive buffers (needs CAP_NET_ADMIN for the `FORCE` variants; falls
    /// back to the unforced ones).
    pub(super) fn size_buffers(&self, send: usize, recv: usize) {
        let clamp = |n: usize| libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
        if self.set_int(libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, clamp(send)).is_err() {
            let _ = self.set_int(libc::SOL_SOCKET, libc::SO_SNDBUF, clamp(send));
        }
        if self.set_int(libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, clamp(recv)).is_err() {
            let _ = self.set_int(libc::SOL_SOCKET, libc::SO_RCVBUF, clamp(recv));
        }
    }

    /// The next sequence number for a standalone request.
    pub(super) fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Sends all `pages` as one datagram.
    pub(super) fn send_pages(&self, pages: &[&[u8]]) -> Result<(), NetlinkError> {
        if pages.len() > IOV_MAX {
            return Err(NetlinkError::BatchTooLarge { pages: pages.len() });
        }
        let mut iov: Vec<libc::iovec> =
            pages.iter().map(|p| libc::iovec { iov_base: p.as_ptr() as *mut libc::c_void, iov_len: p.len() }).collect();
        #[allow(unsafe_code)]
        // SAFETY: zeroed sockaddr_nl/msghdr are valid initial values; fields are set below.
        let (mut addr, mut msg): (libc::sockaddr_nl, libc::msghdr) = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        msg.msg_name = (&mut addr as *mut libc::sockaddr_nl).cast();
        msg.msg_namelen = std::mem::size_of::<libc::sockaddr_nl>() as u32;
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len();
        #[allow(unsafe_code)]
        // SAFETY: the msghdr points at live iovecs, whose buffers outlive the call.
        let rc = unsafe { libc::sendmsg(self.fd, &msg, 0) };
        if rc < 0 {
            return Err(NetlinkError::Send(io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Sends one request message (already built in `req`).
    pub(super) fn send(&self, req: &[u8]) -> Result<(), NetlinkError> {
        self.inner.send(req).map(|_| ()).map_err(NetlinkError::Send)
    }

    /// Joins a multicast group (`NETLINK_ADD_MEMBERSHIP`); nf_tables' groups need CAP_NET_ADMIN.
    pub(super) fn subscribe(&self, group: u32) -> io::Result<()> {
        self.set_int(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, libc::c_int::try_from(group).unwrap_or(libc::c_int::MAX))
    }

    /// Waits up to `timeout` for messages, then reads every message already queued and calls
    /// `each` with it. Returns whether the kernel dropped messages for want of buffer space
    /// (`ENOBUFS`: multicast does not wait for slow readers) since the last call.
    pub(super) fn receive(
        &mut self,
        timeout: std::time::Duration,
        mut each: impl FnMut(Received<'_>),
    ) -> Result<bool, NetlinkError> {
        let mut poll = libc::pollfd { fd: self.fd, events: libc::POLLIN, revents: 0 };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        #[allow(unsafe_code)]
        // SAFETY: one valid pollfd, passed with its count.
        let rc = unsafe { libc::poll(&mut poll, 1, ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted { Ok(false) } else { Err(NetlinkError::Receive(e)) };
        }
        let mut lost = false;
        loop {
            let n = match self.recv(libc::MSG_DONTWAIT) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    lost = true;
                    continue;
                }
                Err(e) => return Err(NetlinkError::Receive(e)),
            };
            let mut off = 0usize;
            while off + NLMSG_HDRLEN <= n {
                let (len, _, _, _) = header(&self.bytes(n)[off..]);
                if len < NLMSG_HDRLEN || off + len > n {
                    break;
                }
                if let Some(message) = Received::new(&self.bytes(n)[off..off + len]) {
                    each(message);
                }
                off += len.div_ceil(4) * 4;
            }
        }
        Ok(lost)
    }

    /// Reads every reply already queued, without blocking.
    pub(super) fn drain_replies(&mut self) -> Result<Vec<Reply>, NetlinkError> {
        let mut replies = Vec::new();
        loop {
            match self.recv(libc::MSG_DONTWAIT) {
                Ok(0) => break,
                Ok(n) => parse_replies(self.bytes(n), &mut replies),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => return Err(NetlinkError::RepliesLost),
                Err(e) => return Err(NetlinkError::Receive(e)),
            }
        }
        Ok(replies)
    }

    fn recv(&mut self, flags: libc::c_int) -> io::Result<usize> {
        let len = self.buf.len() * 4;
        #[allow(unsafe_code)]
        // SAFETY: the buffer is valid for `len` bytes and u32-aligned, as netlink parsing needs.
        let rc = unsafe { libc::recv(self.fd, self.buf.as_mut_ptr().cast(), len, flags) };
        if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc as usize) }
    }

    fn bytes(&self, n: usize) -> &[u8] {
        #[allow(unsafe_code)]
        // SAFETY: the first `n` bytes of the buffer were just written by recv.
        unsafe {
            std::slice::from_raw_parts(self.buf.as_ptr().cast::<u8>(), n)
        }
    }

    /// Sends one `GET…` request for the objects `filter` selects (a dump with
    /// [`NLM_F_DUMP`]) and calls `each` with every message of the answer.
    pub(super) fn query(
        &mut self,
        kind: u16,
        family: u16,
        flags: u16,
        filter: Body<'_>,
        mut each: impl FnMut(Received<'_>) -> Result<(), NetlinkError>,
    ) -> Result<(), NetlinkError> {
        let seq = self.next_seq();
        let req = super::sys::request(kind, family, flags, seq, filter);
        self.exchange(&req, seq, |bytes| {
            let message = Received::new(bytes).ok_or(NetlinkError::Malformed("misaligned dump message"))?;
            each(message)
        })
    }

    /// Sends a request already built (with sequence number `seq`) and calls `each` with every
    /// message of its answer: whole netlink messages, at 4-byte offsets of the receive buffer.
    pub(super) fn exchange(
        &mut self,
        req: &[u8],
        seq: u32,
        mut each: impl FnMut(&[u8]) -> Result<(), NetlinkError>,
    ) -> Result<(), NetlinkError> {
        self.send(req)?;
        loop {
            let n = self.recv(0).map_err(NetlinkError::Receive)?;
            let mut off = 0usize;
            while off + NLMSG_HDRLEN <= n {
                let (len, msg_kind, _flags, msg_seq) = header(&self.bytes(n)[off..]);
                if len < NLMSG_HDRLEN || off + len > n {
                    return Err(NetlinkError::Malformed("truncated dump message"));
                }
                if msg_seq == seq {
                    match msg_kind {
                        NLMSG_DONE => return Ok(()),
                        NLMSG_ERROR => {
                            let errno = error_code(&self.bytes(n)[off..off + len]);
                            if errno != 0 {
                                return Err(NetlinkError::Dump(io::Error::from_raw_os_error(-errno)));
                            }
                            return Ok(());
                        }
                        _ => each(&self.bytes(n)[off..off + len])?,
                    }
                }
                off += len.div_ceil(4) * 4;
            }
        }
    }
}

/// (length, type, flags, seq) of the netlink header at the start of `b`.
fn header(b: &[u8]) -> (usize, u16, u16, u32) {
    let u32_at = |i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let u16_at = |i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
    (u32_at(0) as usize, u16_at(4), u16_at(6), u32_at(8))
}

fn error_code(msg: &[u8]) -> i32 {
    msg.get(NLMSG_HDRLEN..NLMSG_HDRLEN + 4).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]])).unwrap_or(0)
}

/// Parses every `NLMSG_ERROR` reply in a buffer.
fn parse_replies(buf: &[u8], out: &mut Vec<Reply>) {
    let mut off = 0usize;
    while off + NLMSG_HDRLEN <= buf.len() {
        let (len, kind, flags, _) = header(&buf[off..]);
        if len < NLMSG_HDRLEN || off + len > buf.len() {
            break;
        }
        let msg = &buf[off..off + len];
        if kind == NLMSG_ERROR && msg.len() >= NLMSG_HDRLEN + 4 + NLMSG_HDRLEN {
            let error = error_code(msg);
            // The original header follows the error code; its seq says which message failed.
            let (orig_len, _, _, orig_seq) = header(&msg[NLMSG_HDRLEN + 4..]);
            let mut reply = Reply { seq: orig_seq, error, offset: None, text: None };
            if flags & NLM_F_ACK_TLVS != 0 {
                // NLM_F_CAPPED: only the original header was echoed (always so for ACKs, and for
                // errors too with NETLINK_CAP_ACK).
                let echoed = if flags & NLM_F_CAPPED != 0 { NLMSG_HDRLEN } else { orig_len };
                let tlv_start = NLMSG_HDRLEN + 4 + echoed.div_ceil(4) * 4;
                parse_ack_tlvs(msg.get(tlv_start..).unwrap_or(&[]), &mut reply);
            }
            out.push(reply);
        }
        off += len.div_ceil(4) * 4;
    }
}

fn parse_ack_tlvs(mut b: &[u8], reply: &mut Reply) {
    while b.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
        let kind = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            break;
        }
        let value = &b[4..len];
        match kind {
            NLMSGERR_ATTR_OFFS if value.len() >= 4 => {
                reply.offset = Some(u32::from_ne_bytes([value[0], value[1], value[2], value[3]]));
            }
            NLMSGERR_ATTR_MSG => {
                let text = value.strip_suffix(&[0]).unwrap_or(value);
                reply.text = Some(String::from_utf8_lossy(text).into_owned());
            }
            _ => {}
        }
        b = &b[(len.div_ceil(4) * 4).min(b.len())..];
    }
}

/// Which element of a set-element message contains byte `offset` (from the message start):
/// the index of its `NFTA_LIST_ELEM` nest within `NFTA_SET_ELEM_LIST_ELEMENTS`.
pub(super) fn element_index_at(message: &[u8], offset: u32) -> Option<usize> {
    const NFGEN_HDRLEN: usize = 4;
    const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
    let offset = offset as usize;
    let mut pos = NLMSG_HDRLEN + NFGEN_HDRLEN;
    while pos + 4 <= message.len() {
        let len = usize::from(u16::from_ne_bytes([message[pos], message[pos + 1]]));
        let kind = u16::from_ne_bytes([message[pos + 2], message[pos + 3]]) & 0x3fff;
        if len < 4 {
            return None;
        }
        if kind == NFTA_SET_ELEM_LIST_ELEMENTS {
            let mut inner = pos + 4;
            let mut index = 0;
            while inner + 4 <= pos + len {
                let elen = usize::from(u16::from_ne_bytes([message[inner], message[inner + 1]]));
                if elen < 4 {
                    return None;
                }
                if (inner..inner + elen).contains(&offset) {
                    return Some(index);
                }
                index += 1;
                inner += elen.div_ceil(4) * 4;
            }
            return None;
        }
        pos += len.div_ceil(4) * 4;
    }
    None
}

/// Splits a batch buffer into messages: (seq, bytes) in order.
pub(super) fn split_messages(buf: &[u8]) -> Vec<(u32, &[u8])> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off + NLMSG_HDRLEN <= buf.len() {
        let (len, _, _, seq) = header(&buf[off..]);
        if len < NLMSG_HDRLEN || off + len > buf.len() {
            break;
        }
        out.push((seq, &buf[off..off + len]));
        off += len.div_ceil(4) * 4;
    }
    out
}
