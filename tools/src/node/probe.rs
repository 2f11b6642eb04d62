//! Clients that keep opening new connections to Services while a test changes the node under
//! them (an image swap, a rollback, a rolling update, a restart), from inside a pod's network
//! namespace or a lab namespace, counting what failed and when.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What one probe asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// A new TCP connection and `GET <path>`; a 200 answer counts.
    Http { addr: SocketAddr, path: String },
    /// A DNS query for `name` (type A) from a new UDP socket; an answer with an address counts.
    Dns { server: SocketAddr, name: String },
}

impl std::fmt::Display for Ask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ask::Http { addr, path } => write!(f, "http://{addr}{path}"),
            Ask::Dns { server, name } => write!(f, "dns {name} @{server}"),
        }
    }
}

/// One target a prober asks, named for the report.
#[derive(Debug, Clone)]
pub struct Target {
    pub name: String,
    pub ask: Ask,
}

/// A failed ask: when (since the prober started) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub at: Duration,
    pub error: String,
}

/// The counts of one target.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    pub ok: usize,
    pub failed: Vec<Failure>,
    /// Who answered (the HTTP body's first line: a pod's name), how often.
    pub answers: BTreeMap<String, usize>,
}

/// What a prober saw, by target name.
#[derive(Debug, Clone, Default)]
pub struct ProbeReport {
    pub from: String,
    pub targets: BTreeMap<String, Counts>,
    pub elapsed: Duration,
}

impl ProbeReport {
    /// Failures across targets.
    pub fn failed(&self) -> usize {
        self.targets.values().map(|c| c.failed.len()).sum()
    }

    /// Successful asks across targets.
    pub fn ok(&self) -> usize {
        self.targets.values().map(|c| c.ok).sum()
    }

    /// One line per target: `from → name: ok, failed (first errors)`.
    pub fn lines(&self) -> Vec<String> {
        self.targets
            .iter()
            .map(|(name, c)| {
                let first: Vec<String> =
                    c.failed.iter().take(3).map(|f| format!("{:.1} s: {}", f.at.as_secs_f64(), f.error)).collect();
                format!(
                    "{} -> {name}: {} ok, {} failed{}",
                    self.from,
                    c.ok,
                    c.failed.len(),
                    if first.is_empty() { String::new() } else { format!(" ({})", first.join("; ")) }
                )
            })
            .collect()
    }
}

/// A running prober: a thread in a network namespace asking its targets in turn, every
/// `interval`, until stopped.
pub struct Prober {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<ProbeReport>>,
}

impl Prober {
    /// Starts asking `targets` from the network namespace at `netns` (`/run/netns/NAME` or
    /// `/proc/PID/ns/net`), as `from`.
    pub fn start(from: &str, netns: PathBuf, targets: Vec<Target>, interval: Duration, timeout: Duration) -> Prober {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let from = from.to_string();
        let thread =
            std::thread::spawn(move || {
                let started = Instant::now();
                let mut report = ProbeReport { from, ..ProbeReport::default() };
                if let Err(e) = crate::lab::netns::enter(&netns.to_string_lossy()) {
                    for t in &targets {
                        report.targets.entry(t.name.clone()).or_default().failed.push(Failure {
                            at: Duration::ZERO,
                            error: format!("cannot enter {}: {e}", netns.display()),
                        });
                    }
                    return report;
                }
                let mut id: u16 = 1;
                while !flag.load(Ordering::Relaxed) {
                    for t in &targets {
                        id = id.wrapping_add(1);
                        let counts = report.targets.entry(t.name.clone()).or_default();
                        match ask(&t.ask, timeout, id) {
                            Ok(answer) => {
                                counts.ok += 1;
                                *counts.answers.entry(answer).or_default() += 1;
                            }
                            Err(e) => counts.failed.push(Failure { at: started.elapsed(), error: e.to_string() }),
                        }
                    }
                    std::thread::sleep(interval);
                }
                report.elapsed = started.elapsed();
                report
            });
        Prober { stop, thread: Some(thread) }
    }

    /// Stops asking and returns what it saw.
    pub fn finish(mut self) -> ProbeReport {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Asks once; returns who answered.
pub fn ask(ask: &Ask, timeout: Duration, id: u16) -> io::Result<String> {
    match ask {
        Ask::Http { addr, path } => {
            let mut s = TcpStream::connect_timeout(addr, timeout)?;
            s.set_read_timeout(Some(timeout))?;
            write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
            let mut text = String::new();
            s.read_to_string(&mut text)?;
            let status: u16 = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
            if status != 200 {
                return Err(io::Error::other(format!("HTTP status {status}")));
            }
            let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
            Ok(body.lines().next().unwrap_or("").trim().to_string())
        }
        Ask::Dns { server, name } => {
            let socket = UdpSocket::bind(if server.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" })?;
            socket.set_read_timeout(Some(timeout))?;
            socket.connect(server)?;
            socket.send(&dns_query(id, name))?;
            let mut buf = [0u8; 1500];
            let n = socket.recv(&mut buf)?;
            dns_answer(&buf[..n], id).map(|a| a.to_string())
        }
    }
}

/// A DNS query (RFC 1035) for the A records of `name`, recursion desired.
fn dns_query(id: u16, name: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(32 + name.len());
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        q.push(u8::try_from(label.len()).unwrap_or(63).min(63));
        q.extend_from_slice(&label.as_bytes()[..label.len().min(63)]);
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// The first A record of a DNS answer to query `id`.
fn dns_answer(msg: &[u8], id: u16) -> io::Result<Ipv4Addr> {
    let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
    if msg.len() < 12 || msg[0..2] != id.to_be_bytes() {
        return Err(bad("not an answer to the query"));
    }
    let rcode = msg[3] & 0x0f;
    if rcode != 0 {
        return Err(bad(&format!("DNS rcode {rcode}")));
    }
    let (qd, an) = (u16::from_be_bytes([msg[4], msg[5]]), u16::from_be_bytes([msg[6], msg[7]]));
    let mut at = 12;
    let skip_name = |mut at: usize| -> Option<usize> {
        loop {
            let len = *msg.get(at)? as usize;
            if len == 0 {
                return Some(at + 1);
            }
            if len & 0xc0 == 0xc0 {
                return Some(at + 2);
            }
            at += 1 + len;
        }
    };
    for _ in 0..qd {
        at = skip_name(at).ok_or_else(|| bad("cut short"))? + 4;
    }
    for _ in 0..an {
        at = skip_name(at).ok_or_else(|| bad("cut short"))?;
        let header = msg.get(at..at + 10).ok_or_else(|| bad("cut short"))?;
        let (kind, len) = (u16::from_be_bytes([header[0], header[1]]), u16::from_be_bytes([header[8], header[9]]));
        at += 10;
        if kind == 1 && len == 4 {
            let a = msg.get(at..at + 4).ok_or_else(|| bad("cut short"))?;
            return Ok(Ipv4Addr::new(a[0], a[1], a[2], a[3]));
        }
        at += len as usize;
    }
    Err(bad("no A record"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dns_answer_is_read_back() {
        let query = dns_query(7, "web.default.svc.cluster.local");
        let mut answer = query.clone();
        answer[2] = 0x85;
        answer[3] = 0x80;
        answer[7] = 1;
        answer.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4, 10, 96, 0, 20]);
        assert_eq!(dns_answer(&answer, 7).unwrap(), Ipv4Addr::new(10, 96, 0, 20));
        assert!(dns_answer(&answer, 8).is_err());
        let mut nx = query;
        nx[3] = 0x83;
        assert!(dns_answer(&nx, 7).unwrap_err().to_string().contains("rcode 3"));
    }
}
