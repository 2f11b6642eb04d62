//! Kernel commits seen from outside the proxy: a listener on the nftables notification group
//! (`NFNLGRP_NFTABLES`, what `nft monitor` reads) in the node's network namespace. Every
//! committed transaction — nftproxy's netlink batch, the `nft -f` that upstream's nftables mode
//! runs, the `iptables-nft-restore` of its iptables mode — is announced there object by object,
//! and closed by a `NEWGEN` message. The listener timestamps each `NEWGEN` and looks in the
//! transaction's messages for the IPv4 addresses it was asked to watch: the moment a fresh
//! endpoint address or ClusterIP first appears in a committed transaction is when the kernel
//! started serving it, whichever proxy wrote it and however.
//!
//! Addresses are looked for at 4-byte aligned offsets of each message: netlink attributes are
//! aligned, and an IPv4 address is the start of its attribute's payload (a set element's key
//! or data, a comparison's or an immediate's data, an xtables NAT target's range), or a
//! register-sized piece of a concatenation.
//!
//! With a listener present the kernel builds a notification for every object a transaction
//! touches, for every proxy alike; it is started after a proxy's first sync and stopped before
//! its restart, so the large transactions are not measured with it.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use nix::errno::Errno;
use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, setsockopt, socket, sockopt,
};
use nix::sys::time::TimeVal;

use super::error::BenchError;
use crate::lab::Netns;

/// The nftables multicast group (`NFNLGRP_NFTABLES`).
const NFNLGRP_NFTABLES: u32 = 7;
/// `NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWGEN`: the message that ends a transaction's
/// notifications.
const NEWGEN: u16 = (10 << 8) | 15;
/// The socket's receive buffer: a sync at 100 changes a second announces a few hundred objects;
/// this holds seconds of them while the reading thread waits for a CPU.
const RECEIVE_BUFFER: usize = 64 << 20;

/// What the listener has seen.
#[derive(Debug, Default)]
struct Seen {
    /// Watched addresses and the commit each first appeared in.
    watched: HashMap<u32, Option<SystemTime>>,
    /// The top 16 bits of every watched address: most words of a message are rejected here.
    prefixes: Vec<u64>,
    /// Every `NEWGEN`: when it was read.
    commits: Vec<SystemTime>,
    /// Times the kernel dropped notifications because the socket's buffer was full.
    overruns: usize,
    /// Notification bytes read.
    bytes: u64,
}

impl Seen {
    fn watch(&mut self, addr: u32) {
        if self.prefixes.is_empty() {
            self.prefixes = vec![0; 1024];
        }
        let p = (addr >> 16) as usize;
        self.prefixes[p / 64] |= 1 << (p % 64);
        self.watched.entry(addr).or_insert(None);
    }

    fn is_candidate(&self, word: u32) -> bool {
        let p = (word >> 16) as usize;
        self.prefixes.get(p / 64).is_some_and(|w| w & (1 << (p % 64)) != 0)
            && self.watched.get(&word).is_some_and(Option::is_none)
    }
}

/// A listener on the node's nftables notifications; stops on drop.
pub struct KernelCommits {
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// What a listener saw over its life.
#[derive(Debug, Clone, Default)]
pub struct CommitLog {
    /// When each transaction was read.
    pub commits: Vec<SystemTime>,
    /// Times notifications were lost (a full receive buffer): watched addresses may be missed.
    pub overruns: usize,
    /// Notification bytes read.
    pub bytes: u64,
}

impl KernelCommits {
    /// Subscribes to the nftables notifications of `ns` and reads them on a thread of its own.
    pub fn start(ns: &Netns) -> Result<KernelCommits, BenchError> {
        let fd = ns.run(subscribe)?.map_err(|e| BenchError::Worker(format!("nftables notifications: {e}")))?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (seen, stop) = (Arc::clone(&seen), Arc::clone(&stop));
            std::thread::spawn(move || read_loop(&fd, &seen, &stop))
        };
        Ok(KernelCommits { seen, stop, thread: Some(thread) })
    }

    fn lock(&self) -> MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Looks for `addr` in the transactions committed from now on (call before the write that
    /// introduces it).
    pub fn watch(&self, addr: Ipv4Addr) {
        self.lock().watch(u32::from(addr));
    }

    /// When `addr` first appeared in a committed transaction.
    pub fn seen(&self, addr: Ipv4Addr) -> Option<SystemTime> {
        self.lock().watched.get(&u32::from(addr)).copied().flatten()
    }

    /// Waits until `addr` appears in a committed transaction, at most `timeout`.
    pub fn wait_for(&self, addr: Ipv4Addr, timeout: Duration) -> Option<SystemTime> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(t) = self.seen(addr) {
                return Some(t);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Transactions committed so far.
    pub fn commits(&self) -> usize {
        self.lock().commits.len()
    }

    /// Stops listening and returns what was seen.
    pub fn stop(mut self) -> CommitLog {
        self.halt();
        let mut seen = self.lock();
        CommitLog { commits: std::mem::take(&mut seen.commits), overruns: seen.overruns, bytes: seen.bytes }
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for KernelCommits {
    fn drop(&mut self) {
        self.halt();
    }
}

/// A netlink socket in the calling thread's namespace, subscribed to the nftables group, whose
/// reads wake every 100 ms.
fn subscribe() -> Result<OwnedFd, Errno> {
    let fd = socket(AddressFamily::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, SockProtocol::NetlinkNetFilter)?;
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 1 << (NFNLGRP_NFTABLES - 1)))?;
    // Beyond rmem_max (needs CAP_NET_ADMIN, which the benchmark has); the plain size otherwise.
    if setsockopt(&fd, sockopt::RcvBufForce, &RECEIVE_BUFFER).is_err() {
        setsockopt(&fd, sockopt::RcvBuf, &RECEIVE_BUFFER)?;
    }
    setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(0, 100_000))?;
    Ok(fd)
}

fn read_loop(fd: &OwnedFd, seen: &Mutex<Seen>, stop: &AtomicBool) {
    let mut buf = vec![0u8; 1 << 20];
    // Watched addresses found in the transaction being read (its NEWGEN not yet seen).
    let mut pending: Vec<u32> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()) {
            Ok(n) => {
                let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                seen.bytes += n as u64;
                scan(&buf[..n], &mut seen, &mut pending, SystemTime::now());
            }
            Err(Errno::ENOBUFS) => seen.lock().unwrap_or_else(|e| e.into_inner()).overruns += 1,
            Err(Errno::EAGAIN | Errno::EINTR) => {}
            Err(_) => break,
        }
    }
}

/// Reads the netlink messages in `buf`: watched addresses go to `pending` until the `NEWGEN`
/// that ends their transaction, which gives them its time (`now`).
fn scan(buf: &[u8], seen: &mut Seen, pending: &mut Vec<u32>, now: SystemTime) {
    let mut off = 0;
    while off + 16 <= buf.len() {
        let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
        if len < 16 || off + len > buf.len() {
            break;
        }
        let kind = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
        if kind == NEWGEN {
            seen.commits.push(now);
            for addr in pending.drain(..) {
                if let Some(slot) = seen.watched.get_mut(&addr) {
                    slot.get_or_insert(now);
                }
            }
        } else if !seen.watched.is_empty() {
            let mut at = off + 16;
            while at + 4 <= off + len {
                let word = u32::from_be_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
                if seen.is_candidate(word) && !pending.contains(&word) {
                    pending.push(word);
                }
                at += 4;
            }
        }
        off += len.next_multiple_of(4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One netlink message of `kind` with `payload` after the 16-byte header.
    fn message(kind: u16, payload: &[u8]) -> Vec<u8> {
        let len = 16 + payload.len();
        let mut m = Vec::new();
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(payload);
        m.resize(len.next_multiple_of(4), 0);
        m
    }

    #[test]
    fn an_address_is_seen_at_the_end_of_its_transaction() {
        let mut seen = Seen::default();
        let (a, b) = (Ipv4Addr::new(100, 64, 0, 7), Ipv4Addr::new(10, 96, 240, 1));
        seen.watch(u32::from(a));
        seen.watch(u32::from(b));
        let t1 = SystemTime::UNIX_EPOCH + Duration::from_secs(1);
        let t2 = SystemTime::UNIX_EPOCH + Duration::from_secs(2);
        // A set element (nfgenmsg, then attributes) holding `a`, aligned; `b` only unaligned.
        let mut element = vec![2, 0, 0, 0, 8, 0, 1, 0];
        element.extend_from_slice(&a.octets());
        element.extend_from_slice(&[0, 0]);
        element.extend_from_slice(&b.octets());
        let mut buf = message((10 << 8) | 12, &element);
        let mut pending = Vec::new();
        scan(&buf, &mut seen, &mut pending, t1);
        assert_eq!(pending, vec![u32::from(a)], "aligned words only");
        assert_eq!(seen.watched[&u32::from(a)], None, "not before its transaction ends");
        buf = message(NEWGEN, &[0; 12]);
        scan(&buf, &mut seen, &mut pending, t2);
        assert_eq!(seen.watched[&u32::from(a)], Some(t2));
        assert_eq!(seen.watched[&u32::from(b)], None);
        assert_eq!(seen.commits, vec![t2]);
        // Seen once: a later transaction does not move it.
        let mut again = message((10 << 8) | 12, &element);
        again.extend(message(NEWGEN, &[0; 12]));
        scan(&again, &mut seen, &mut pending, t2 + Duration::from_secs(1));
        assert_eq!(seen.watched[&u32::from(a)], Some(t2));
        assert_eq!(seen.commits.len(), 2);
    }
}
