//! Echo servers for lab pods: each answers a TCP connection or UDP datagram with
//! `<pod name> <source address it saw>`, which tells a test who answered and whether the client
//! was masqueraded.

use std::io::Write;
use std::net::{Ipv6Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::error::LabError;
use super::netns::Netns;
use nftproxy::net::L4Proto;

/// One listening port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerSpec {
    pub protocol: L4Proto,
    pub port: u16,
}

impl ServerSpec {
    /// A TCP server on `port`.
    pub fn tcp(port: u16) -> ServerSpec {
        ServerSpec { protocol: L4Proto::Tcp, port }
    }
    /// A UDP server on `port`.
    pub fn udp(port: u16) -> ServerSpec {
        ServerSpec { protocol: L4Proto::Udp, port }
    }
    /// An SCTP server on `port` (needs the kernel's sctp module).
    pub fn sctp(port: u16) -> ServerSpec {
        ServerSpec { protocol: L4Proto::Sctp, port }
    }
}

/// Running servers; dropping stops them.
#[derive(Debug)]
pub struct EchoServers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Result<(), LabError>>>,
}

/// The text a server sends for a peer (IPv4 peers of a dual-stack socket print as IPv4).
pub fn answer(name: &str, peer: SocketAddr) -> String {
    format!("{name} {}\n", peer.ip().to_canonical())
}

impl EchoServers {
    /// Starts the servers; returns once every socket is bound.
    pub fn start(targets: &[(String, &Netns)], specs: &[ServerSpec]) -> Result<EchoServers, LabError> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for (name, ns) in targets {
            for spec in specs {
                let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
                let name = name.clone();
                let stop = Arc::clone(&stop);
                let spec = *spec;
                threads.push(ns.spawn(move || serve(&name, spec, &stop, ready_tx)));
                match ready_rx.recv_timeout(Duration::from_secs(5)) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(LabError::Spawn(format!("echo server in {}", ns.name()), e)),
                    Err(_) => {
                        return Err(LabError::Spawn(format!("echo server in {}", ns.name()), "did not start".into()));
                    }
                }
            }
        }
        Ok(EchoServers { stop, threads })
    }
}

fn serve(name: &str, spec: ServerSpec, stop: &AtomicBool, ready: mpsc::Sender<Result<(), String>>) {
    let any = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), spec.port);
    match spec.protocol {
        L4Proto::Tcp | L4Proto::Sctp => {
            let bound =
                if spec.protocol == L4Proto::Tcp { TcpListener::bind(any) } else { super::traffic::sctp_listener(any) };
            let listener = match bound.and_then(|l| l.set_nonblocking(true).map(|_| l)) {
                Ok(l) => l,
                Err(e) => {
                    let _ = ready.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = ready.send(Ok(()));
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut conn, peer)) => {
                        let _ = conn.write_all(answer(name, peer).as_bytes());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        }
        L4Proto::Udp => {
            let socket = match UdpSocket::bind(any)
                .and_then(|s| s.set_read_timeout(Some(Duration::from_millis(50))).map(|_| s))
            {
                Ok(s) => s,
                Err(e) => {
                    let _ = ready.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = ready.send(Ok(()));
            let mut buf = [0u8; 1500];
            while !stop.load(Ordering::Relaxed) {
                if let Ok((_, peer)) = socket.recv_from(&mut buf) {
                    let _ = socket.send_to(answer(name, peer).as_bytes(), peer);
                }
            }
        }
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
