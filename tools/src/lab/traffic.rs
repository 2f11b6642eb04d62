//! Client side of lab traffic: ask a service who answers, and count the answers.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use nftproxy::net::L4Proto;

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

/// Opens a TCP connection to `target` from the fixed address `local` (the same tuple again
/// and again, as a client reusing a source port does) and reads the answer.
pub fn tcp_ask_from(target: SocketAddr, local: SocketAddr, timeout: Duration) -> io::Result<Answer> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, setsockopt, socket, sockopt,
    };
    let family = if target.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, SockType::Stream, SockFlag::empty(), None).map_err(io::Error::from)?;
    // The previous connection from this port may be in TIME_WAIT.
    setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(io::Error::from)?;
    // SO_SNDTIMEO bounds connect() too.
    let tv = nix::sys::time::TimeVal::new(timeout.as_secs() as i64, timeout.subsec_micros() as i64);
    setsockopt(&fd, sockopt::SendTimeout, &tv).map_err(io::Error::from)?;
    setsockopt(&fd, sockopt::ReceiveTimeout, &tv).map_err(io::Error::from)?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(local)).map_err(io::Error::from)?;
    connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(target)).map_err(io::Error::from)?;
    let mut conn = TcpStream::from(fd);
    let mut text = String::new();
    conn.read_to_string(&mut text)?;
    parse(&text)
}

/// A UDP socket bound to `local` (or an ephemeral port) and connected to `target`.
fn udp_socket(target: SocketAddr, local: Option<SocketAddr>, timeout: Duration) -> io::Result<UdpSocket> {
    let bind = local.unwrap_or_else(|| match target {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().unwrap_or(target),
        SocketAddr::V6(_) => "[::]:0".parse().unwrap_or(target),
    });
    let socket = UdpSocket::bind(bind)?;
    socket.set_read_timeout(Some(timeout))?;
    socket.connect(target)?;
    Ok(socket)
}

/// Sends one datagram on a connected socket and reads the answer.
fn udp_exchange(socket: &UdpSocket) -> io::Result<Answer> {
    socket.send(b"who\n")?;
    let mut buf = [0u8; 512];
    let n = socket.recv(&mut buf)?;
    parse(&String::from_utf8_lossy(&buf[..n]))
}

/// Sends a UDP datagram to `target` (from `local`, if given) and reads the answer.
pub fn udp_ask(target: SocketAddr, local: Option<SocketAddr>, timeout: Duration) -> io::Result<Answer> {
    udp_exchange(&udp_socket(target, local, timeout)?)
}

/// Asks over `protocol`.
pub fn ask(protocol: L4Proto, target: SocketAddr, timeout: Duration) -> io::Result<Answer> {
    match protocol {
        L4Proto::Udp => udp_ask(target, None, timeout),
        L4Proto::Sctp => sctp_ask(target, timeout),
        L4Proto::Tcp => tcp_ask(target, timeout),
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

/// How many of a tally's last UDP sockets stay bound (see [`tally`]).
const HELD_UDP_SOCKETS: usize = 512;

/// Asks `n` times and counts who answered: every UDP ask from an ephemeral port none of the
/// last 512 asks holds, so each is a flow of its own.
pub fn tally(protocol: L4Proto, target: SocketAddr, n: usize, timeout: Duration) -> Tally {
    let started = Instant::now();
    let mut t = Tally::default();
    // Each UDP ask's socket stays bound while the next asks are made: an ephemeral port picked
    // again would meet the earlier ask's conntrack entry and be one flow, not two (no new
    // connection to balance or count). The last HELD_UDP_SOCKETS are held, within the usual
    // limit of 1,024 open files; tests that count flows exactly ask fewer times.
    let mut held = std::collections::VecDeque::new();
    for _ in 0..n {
        let answer = match protocol {
            L4Proto::Udp => udp_socket(target, None, timeout).and_then(|socket| {
                let answer = udp_exchange(&socket);
                if held.len() == HELD_UDP_SOCKETS {
                    held.pop_front();
                }
                held.push_back(socket);
                answer
            }),
            _ => ask(protocol, target, timeout),
        };
        match answer {
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

/// Whether this kernel can create SCTP sockets (the `sctp` module is loadable).
pub fn sctp_supported() -> bool {
    use nix::sys::socket::{AddressFamily, SockFlag, SockProtocol, SockType, socket};
    socket(AddressFamily::Inet, SockType::Stream, SockFlag::empty(), SockProtocol::Sctp).is_ok()
}

/// An SCTP one-to-one listening socket on `addr`, usable through std's listener API.
pub fn sctp_listener(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockProtocol, SockType, SockaddrStorage, bind, listen, socket,
    };
    let family = if addr.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, SockType::Stream, SockFlag::empty(), SockProtocol::Sctp).map_err(io::Error::from)?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(addr)).map_err(io::Error::from)?;
    listen(&fd, Backlog::new(64).map_err(io::Error::from)?).map_err(io::Error::from)?;
    Ok(std::net::TcpListener::from(fd))
}

/// Opens an SCTP association to `target` and reads the answer.
pub fn sctp_ask(target: SocketAddr, timeout: Duration) -> io::Result<Answer> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockProtocol, SockType, SockaddrStorage, connect, setsockopt, socket, sockopt,
    };
    let family = if target.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, SockType::Stream, SockFlag::empty(), SockProtocol::Sctp).map_err(io::Error::from)?;
    let tv = nix::sys::time::TimeVal::new(timeout.as_secs() as i64, timeout.subsec_micros() as i64);
    setsockopt(&fd, sockopt::SendTimeout, &tv).map_err(io::Error::from)?;
    setsockopt(&fd, sockopt::ReceiveTimeout, &tv).map_err(io::Error::from)?;
    connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(target)).map_err(io::Error::from)?;
    let mut conn = TcpStream::from(fd);
    let mut text = String::new();
    conn.read_to_string(&mut text)?;
    parse(&text)
}
