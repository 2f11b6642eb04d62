//! The random clusters' lab: the tools' lab of network namespaces (two nodes, two pods on each,
//! two outside clients, the control plane on the wan), each pod holding a thousand extra /32
//! addresses so that thousands of endpoints answer, and echo servers that say which address
//! they were reached at.
//!
//! ```text
//!  node1: p1a 10.244.1.10 (+10.244.128.1…), p1b 10.244.1.11 (+10.244.132.1…)
//!  node2: p2a 10.244.2.10 (+10.244.192.1…), p2b 10.244.2.11 (+10.244.196.1…)
//! ```
//!
//! A node routes each pod's extra range to the pod's own address (the pod is a router for its
//! addresses, so the node keeps one neighbour entry a pod), and the other node's ranges to that
//! node; the wan router knows them all.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, SockaddrIn, recvmsg, sendmsg, setsockopt, sockopt,
};

use nftproxy::net::L4Proto;

use crate::lab::{Lab, LabError, Netns};

/// A pod of the lab.
#[derive(Debug, Clone, Copy)]
pub struct Pod {
    pub name: &'static str,
    pub node: &'static str,
    pub ip: Ipv4Addr,
    /// The first address of its extra range (a /22), if it has one.
    pub pool: Option<Ipv4Addr>,
    /// Its labels (what the generated selectors match) and readiness.
    pub labels: &'static str,
    pub ready: bool,
}

/// The pods, in the order the lab creates them (so their addresses are the lab's). p1c sends
/// the probes from a pod: it has no extra addresses, since a pod reaching another address of
/// its own through a Service answers itself directly (no proxy has the reply to un-DNAT), but
/// its own address is an endpoint now and then (a pod reaching itself, hairpin).
pub const PODS: [Pod; 5] = [
    Pod {
        name: "p1a",
        node: "node1",
        ip: Ipv4Addr::new(10, 244, 1, 10),
        pool: Some(Ipv4Addr::new(10, 244, 128, 0)),
        labels: "app: web, tier: front",
        ready: true,
    },
    Pod {
        name: "p1b",
        node: "node1",
        ip: Ipv4Addr::new(10, 244, 1, 11),
        pool: Some(Ipv4Addr::new(10, 244, 132, 0)),
        labels: "app: web, tier: back",
        ready: true,
    },
    Pod {
        name: "p1c",
        node: "node1",
        ip: Ipv4Addr::new(10, 244, 1, 12),
        pool: None,
        labels: "app: web, tier: probe",
        ready: true,
    },
    Pod {
        name: "p2a",
        node: "node2",
        ip: Ipv4Addr::new(10, 244, 2, 10),
        pool: Some(Ipv4Addr::new(10, 244, 192, 0)),
        labels: "app: web, tier: front",
        ready: true,
    },
    Pod {
        name: "p2b",
        node: "node2",
        ip: Ipv4Addr::new(10, 244, 2, 11),
        pool: Some(Ipv4Addr::new(10, 244, 196, 0)),
        labels: "app: web, tier: back",
        ready: false,
    },
];

/// Extra addresses each pod holds.
pub const POOL_PER_POD: usize = 1000;

/// The ports every pod serves on every address, over TCP and UDP (named `http`/`dns` 8080,
/// `alt`/`altu` 9090 in the Pods' specs).
pub const SERVED_PORTS: [u16; 3] = [8080, 8081, 9090];

/// The pods with extra addresses.
pub fn pooled() -> impl Iterator<Item = &'static Pod> {
    PODS.iter().filter(|p| p.pool.is_some())
}

/// The `k`th extra address of a pod (its own address if it has none).
pub fn pool_address(pod: &Pod, k: usize) -> Ipv4Addr {
    pod.pool.map_or(pod.ip, |pool| Ipv4Addr::from(u32::from(pool) + 1 + k as u32))
}

/// The pod an endpoint address belongs to.
pub fn pod_of(ip: Ipv4Addr) -> Option<&'static Pod> {
    PODS.iter().find(|p| {
        ip == p.ip
            || p.pool.is_some_and(|pool| {
                u32::from(ip) > u32::from(pool) && u32::from(ip) <= u32::from(pool) + POOL_PER_POD as u32
            })
    })
}

/// Builds the lab's namespaces: nodes, pods with their extra addresses and routes, clients.
/// The control plane is added by the caller.
pub fn build() -> Result<Lab, LabError> {
    crate::lab::cleanup_stale();
    let mut lab = Lab::new()?;
    lab.add_node("node1")?;
    lab.add_node("node2")?;
    for pod in &PODS {
        let made = lab.add_pod(pod.name, pod.node)?;
        if made.ip != pod.ip {
            return Err(LabError::NotPrivileged(format!("{} got {}, not {}", pod.name, made.ip, pod.ip)));
        }
    }
    lab.add_client("client")?;
    lab.add_client("client2")?;
    // Every reject is an ICMP error, and a seed's probes reject dozens at once: the node's
    // token bucket for ICMP errors (per namespace; 50 at once, 1,000 a second) would hold some
    // back, and a rejected probe would look dropped.
    for ns in [&lab.node("node1").ns, &lab.node("node2").ns, &lab.wan] {
        for (key, value) in [("icmp_msgs_per_sec", "1000000"), ("icmp_msgs_burst", "100000")] {
            let path = format!("/proc/sys/net/ipv4/{key}");
            ns.run(move || std::fs::write(&path, value))??;
        }
    }
    let node_ip = |name: &str| lab.node(name).ip.to_string();
    for pod in pooled() {
        let Some(pool) = pod.pool else { continue };
        let ns = &lab.pod(pod.name).ok_or_else(|| LabError::NotPrivileged(pod.name.into()))?.ns;
        let batch: String =
            (0..POOL_PER_POD).map(|k| format!("address add {}/32 dev eth0\n", pool_address(pod, k))).collect();
        let file = std::env::temp_dir().join(format!("nftproxy-random-{}-{}.batch", std::process::id(), pod.name));
        std::fs::write(&file, batch)?;
        let done = ns.ip(&["-batch", &file.to_string_lossy()]);
        let _ = std::fs::remove_file(&file);
        done?;
        let range = format!("{pool}/22");
        let own = &lab.node(pod.node).ns;
        own.ip(&["route", "add", &range, "via", &pod.ip.to_string(), "dev", "cbr0"])?;
        let other = if pod.node == "node1" { "node2" } else { "node1" };
        lab.node(other).ns.ip(&["route", "add", &range, "via", &node_ip(pod.node)])?;
        lab.wan.ip(&["route", "add", &range, "via", &node_ip(pod.node)])?;
    }
    Ok(lab)
}

/// What a pod sends back: its name, the source it saw and the address it was reached at.
fn answer(name: &str, peer: IpAddr, reached: IpAddr) -> String {
    format!("{name} {} {}\n", peer.to_canonical(), reached.to_canonical())
}

/// Echo servers in every pod, on [`SERVED_PORTS`] over TCP and UDP; dropping stops them.
#[derive(Debug)]
pub struct EchoServers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Result<(), LabError>>>,
}

impl EchoServers {
    /// One thread a pod, polling its sockets.
    pub fn start(lab: &Lab) -> Result<EchoServers, LabError> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for pod in &PODS {
            let ns: &Netns = &lab.pod(pod.name).ok_or_else(|| LabError::NotPrivileged(pod.name.into()))?.ns;
            let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
            let stop = Arc::clone(&stop);
            let name = pod.name;
            threads.push(ns.spawn(move || serve(name, &stop, &ready_tx)));
            match ready_rx.recv_timeout(Duration::from_secs(5)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(LabError::Spawn(format!("echo servers in {name}"), e)),
                Err(_) => return Err(LabError::Spawn(format!("echo servers in {name}"), "did not start".into())),
            }
        }
        Ok(EchoServers { stop, threads })
    }
}

impl Drop for EchoServers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve(name: &str, stop: &AtomicBool, ready: &std::sync::mpsc::Sender<Result<(), String>>) {
    let bound = (|| -> io::Result<(Vec<TcpListener>, Vec<UdpSocket>)> {
        let mut tcp = Vec::new();
        let mut udp = Vec::new();
        for port in SERVED_PORTS {
            let any = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port));
            let listener = TcpListener::bind(any)?;
            listener.set_nonblocking(true)?;
            tcp.push(listener);
            let socket = UdpSocket::bind(any)?;
            socket.set_nonblocking(true)?;
            setsockopt(&socket, sockopt::Ipv4PacketInfo, &true).map_err(io::Error::from)?;
            udp.push(socket);
        }
        Ok((tcp, udp))
    })();
    let (tcp, udp) = match bound {
        Ok(b) => b,
        Err(e) => {
            let _ = ready.send(Err(e.to_string()));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    while !stop.load(Ordering::Relaxed) {
        let mut fds: Vec<PollFd<'_>> = tcp
            .iter()
            .map(|l| PollFd::new(l.as_fd(), PollFlags::POLLIN))
            .chain(udp.iter().map(|s| PollFd::new(s.as_fd(), PollFlags::POLLIN)))
            .collect();
        if poll(&mut fds, PollTimeout::from(100u16)).unwrap_or(0) <= 0 {
            continue;
        }
        let readable: Vec<bool> =
            fds.iter().map(|f| f.revents().is_some_and(|r| r.contains(PollFlags::POLLIN))).collect();
        drop(fds);
        for (i, listener) in tcp.iter().enumerate() {
            if !readable[i] {
                continue;
            }
            while let Ok((mut conn, peer)) = listener.accept() {
                let reached = conn.local_addr().map(|a| a.ip()).unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
                let _ = conn.set_nonblocking(false);
                let _ = conn.write_all(answer(name, peer.ip(), reached).as_bytes());
            }
        }
        for (i, socket) in udp.iter().enumerate() {
            if readable[tcp.len() + i] {
                while udp_echo(name, socket).is_ok() {}
            }
        }
    }
}

/// Answers one datagram from the address it was sent to (IP_PKTINFO both ways: a pod has many
/// addresses, and the reply must leave from the one the proxy DNATed to).
fn udp_echo(name: &str, socket: &UdpSocket) -> io::Result<()> {
    let mut buf = [0u8; 512];
    let mut cmsg = nix::cmsg_space!(libc::in_pktinfo);
    let (peer, info) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<SockaddrIn>(socket.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())
            .map_err(io::Error::from)?;
        let peer = msg.address.ok_or_else(|| io::Error::other("no peer address"))?;
        let mut info = None;
        for c in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::Ipv4PacketInfo(i) = c {
                info = Some(i);
            }
        }
        (peer, info.ok_or_else(|| io::Error::other("no IP_PKTINFO"))?)
    };
    let reached = Ipv4Addr::from(u32::from_be(info.ipi_addr.s_addr));
    let text = answer(name, IpAddr::V4(peer.ip()), IpAddr::V4(reached));
    let reply = libc::in_pktinfo { ipi_ifindex: 0, ipi_spec_dst: info.ipi_addr, ipi_addr: info.ipi_addr };
    sendmsg(
        socket.as_raw_fd(),
        &[IoSlice::new(text.as_bytes())],
        &[ControlMessage::Ipv4PacketInfo(&reply)],
        MsgFlags::empty(),
        Some(&peer),
    )
    .map_err(io::Error::from)?;
    Ok(())
}

/// One answer: the pod, the source it saw, the address it was reached at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub pod: String,
    pub source: IpAddr,
    pub reached: IpAddr,
}

fn parse(text: &str) -> io::Result<Answer> {
    let mut parts = text.split_whitespace();
    let pod = parts.next().unwrap_or_default().to_string();
    let mut ip = || parts.next().and_then(|s| s.parse::<IpAddr>().ok());
    match (ip(), ip()) {
        (Some(source), Some(reached)) => Ok(Answer { pod, source, reached }),
        _ => Err(io::Error::new(io::ErrorKind::InvalidData, format!("unexpected answer {text:?}"))),
    }
}

/// One connection (TCP) or exchange (UDP) to `target`. A UDP socket is returned to be held, so
/// that the next ask's ephemeral port differs (a new flow, not the same conntrack entry).
pub fn ask(protocol: L4Proto, target: SocketAddr, timeout: Duration) -> (io::Result<Answer>, Option<UdpSocket>) {
    match protocol {
        L4Proto::Udp => {
            let socket = match UdpSocket::bind("0.0.0.0:0").and_then(|s| {
                s.set_read_timeout(Some(timeout))?;
                s.connect(target)?;
                Ok(s)
            }) {
                Ok(s) => s,
                Err(e) => return (Err(e), None),
            };
            let mut buf = [0u8; 512];
            let answer = socket
                .send(b"who\n")
                .and_then(|_| socket.recv(&mut buf))
                .and_then(|n| parse(&String::from_utf8_lossy(&buf[..n])));
            (answer, Some(socket))
        }
        _ => {
            let answer = TcpStream::connect_timeout(&target, timeout).and_then(|mut conn| {
                conn.set_read_timeout(Some(timeout))?;
                let mut text = String::new();
                conn.read_to_string(&mut text)?;
                parse(&text)
            });
            (answer, None)
        }
    }
}
