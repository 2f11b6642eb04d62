//! Client side of lab traffic: ask a service who answers, and count the answers.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use crate::net::L4Proto;

/// One answer: which pod answered and the source address it saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub backend: String,
    pub source: IpAddr,
}

fn parse(text: &str) -> io::Result<Answer> {
    let mut parts = text.split_whitespace();
    let backend = parts.next().unwrap_or_default().to_string();
    let source = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("unexpected answer {text:?}")))?;
    Ok(Answer { backend, source })
}

/// Opens a TCP connection to `target` and reads the answer.
pub fn tcp_ask(target: SocketAddr, timeout: Duration) -> io::Result<Answer> {
    let mut conn = TcpStream::connect_timeout(&target, timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    let mut text = String::new();
    conn.read_to_string(&mut text)?;
    parse(&text)
}

/// Sends a UDP datagram to `target` (from `local`, if given) and reads the answer.
pub fn udp_ask(target: SocketAddr, local: Option<SocketAddr>, timeout: Duration) -> io::Result<Answer> {
    let bind = local.unwrap_or_else(|| match target {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().unwrap_or(target),
        SocketAddr::V6(_) => "[::]:0".parse().unwrap_or(target),
    });
    let socket = UdpSocket::bind(bind)?;
    socket.set_read_timeout(Some(timeout))?;
    socket.connect(target)?;
    socket.send(b"who\n")?;
    let mut buf = [0u8; 512];
    let n = socket.recv(&mut buf)?;
    parse(&String::from_utf8_lossy(&buf[..n]))
}

/// Asks over `protocol`.
pub fn ask(protocol: L4Proto, target: SocketAddr, timeout: Duration) -> io::Result<Answer> {
    match protocol {
        L4Proto::Udp => udp_ask(target, None, timeout),
        _ => tcp_ask(target, timeout),
    }
}

/// Answers counted by backend, with the sources seen and the failures.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    pub by_backend: BTreeMap<String, usize>,
    pub sources: BTreeMap<IpAddr, usize>,
    pub errors: BTreeMap<String, usize>,
    pub elapsed: Duration,
}

impl Tally {
    /// Successful answers.
    pub fn answered(&self) -> usize {
        self.by_backend.values().sum()
    }
    /// Failed attempts.
    pub fn failed(&self) -> usize {
        self.errors.values().sum()
    }
}

/// Asks `n` times and counts who answered.
pub fn tally(protocol: L4Proto, target: SocketAddr, n: usize, timeout: Duration) -> Tally {
    let started = Instant::now();
    let mut t = Tally::default();
    for _ in 0..n {
        match ask(protocol, target, timeout) {
            Ok(a) => {
                *t.by_backend.entry(a.backend).or_default() += 1;
                *t.sources.entry(a.source).or_default() += 1;
            }
            Err(e) => *t.errors.entry(e.kind().to_string()).or_default() += 1,
        }
    }
    t.elapsed = started.elapsed();
    t
}

/// A minimal HTTP/1.1 GET: returns the status code and the body.
pub fn http_get(target: SocketAddr, path: &str, timeout: Duration) -> io::Result<(u16, String)> {
    use std::io::Write;
    let mut s = TcpStream::connect_timeout(&target, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    Ok((status, body))
}
