//! `nftproxy hand-back`: giving a node back to upstream kube-proxy (a rollback, or removing
//! nftproxy), with one ruleset on the node at every moment that matters.
//!
//! nftproxy's tables outlive its process on purpose: a restart, an upgrade, a rolling update of
//! its DaemonSet keep serving from them until the next process claims them. That same choice
//! means a node handed back to kube-proxy keeps them, and kube-proxy does not know them: its
//! rules and nftproxy's would sit side by side on the same hooks, nftproxy's never updated
//! again. Deleting them when nftproxy stops would leave the node without service rules until
//! kube-proxy's first sync (seconds, with every new connection refused); nothing in a stopping
//! nftproxy can tell a rollback from a restart.
//!
//! So the hand-back is its own small process, run on every node by `deploy/hand-back/`'s
//! DaemonSet before `kubectl rollout undo`: it waits until no nftproxy owns the tables here (the
//! rollback stopped it) and kube-proxy has synced its own rules (its ruleset is in the kernel
//! and its `/healthz` reports a sync), then deletes nftproxy's tables in one transaction, and
//! stays, idle, until its DaemonSet is deleted. `--check` is its readiness probe: ready once
//! nothing of nftproxy's is left. Between kube-proxy's first sync and the deletion both rulesets
//! serve; for a Service whose endpoints did not change they send each connection to the same
//! endpoints.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{info, warn};

use crate::config::ProxyConfig;
use crate::net::IpFamily;
use crate::netlink::{Kernel, NetlinkError, TABLE_F_OWNER, TableFamily, TableInfo};
use crate::takeover::KUBE_PROXY_TABLE;

/// Errors of the hand-back.
#[derive(Debug, Error)]
pub enum HandBackError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Sync(#[from] crate::sync::SyncError),
}

/// What the hand-back needs to know.
#[derive(Debug, Clone)]
pub(crate) struct HandBack {
    /// nftproxy's table name (`--table`).
    pub(crate) table: String,
    /// Where the node's proxy serves `/healthz` (kube-proxy's `healthzBindAddress`).
    pub(crate) healthz: SocketAddr,
    /// How often to look again.
    pub(crate) every: Duration,
}

/// The node as the hand-back sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NodeState {
    /// No table of nftproxy's here: handed back (or never taken).
    Done,
    /// A running nftproxy still owns its tables.
    NftproxyRuns,
    /// nftproxy is gone, and no other proxy's rules are here yet.
    NoSuccessor,
    /// Another proxy's rules are here (what), but its `/healthz` reports no sync yet.
    NotSynced(String),
    /// Another proxy serves the node (what): nftproxy's tables can go.
    Served(String),
}

/// nftproxy's tables here.
fn ours<'a>(tables: &'a [TableInfo], table: &str) -> Vec<&'a TableInfo> {
    tables.iter().filter(|t| t.name == table && matches!(t.family, TableFamily::Ip | TableFamily::Ip6)).collect()
}

/// Another service proxy's rules here: kube-proxy's nftables table, or its `KUBE-SERVICES`
/// chain in an iptables-nft or iptables-legacy table (iptables and ipvs modes).
fn successor(tables: &[TableInfo]) -> Option<String> {
    if let Some(t) = tables.iter().find(|t| t.name == KUBE_PROXY_TABLE) {
        return Some(t.label());
    }
    if let Some(t) = tables.iter().find(|t| t.name == "nat" && t.chains.iter().any(|c| c.name == "KUBE-SERVICES")) {
        return Some(format!("{} KUBE-SERVICES", t.label()));
    }
    for family in IpFamily::ALL {
        if crate::netlink::xtables::loaded_tables(family).iter().any(|t| t == "nat")
            && crate::netlink::xtables::LegacyTable::read(family, "nat")
                .is_ok_and(|t| t.user_chains().contains(&"KUBE-SERVICES"))
        {
            return Some("iptables-legacy nat KUBE-SERVICES".into());
        }
    }
    None
}

/// Whether the proxy serving `/healthz` at `address` has synced once: kube-proxy answers 200
/// while it starts up too, with a `lastUpdated` of Go's zero time until its first sync.
fn synced(address: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&address, Duration::from_secs(2)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut raw = Vec::new();
    let _ = stream.take(64 * 1024).read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let ok = head.split_whitespace().nth(1) == Some("200");
    let last = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("lastUpdated").and_then(|l| l.as_str().map(str::to_string)));
    ok && last.is_some_and(|l| !l.starts_with("0001-01-01"))
}

impl HandBack {
    /// Where the node stands.
    pub(crate) fn state(&self, kernel: &mut Kernel) -> Result<NodeState, HandBackError> {
        let tables = kernel.list_tables()?;
        let ours = ours(&tables, &self.table);
        if ours.is_empty() {
            return Ok(NodeState::Done);
        }
        if ours.iter().any(|t| t.flags & TABLE_F_OWNER != 0) {
            return Ok(NodeState::NftproxyRuns);
        }
        let Some(what) = successor(&tables) else { return Ok(NodeState::NoSuccessor) };
        if synced(self.healthz) { Ok(NodeState::Served(what)) } else { Ok(NodeState::NotSynced(what)) }
    }

    /// Whether nothing of nftproxy's is left (the readiness probe).
    pub(crate) fn done(&self) -> Result<bool, HandBackError> {
        let mut kernel = Kernel::open()?;
        Ok(self.state(&mut kernel)? == NodeState::Done)
    }

    /// Waits for the moment, deletes nftproxy's tables, and then idles until `stop` is set
    /// (a DaemonSet's pod is not meant to exit); with `once`, returns after the deletion.
    pub(crate) fn run(&self, once: bool, stop: &std::sync::atomic::AtomicBool) -> Result<(), HandBackError> {
        let mut kernel = Kernel::open()?;
        let mut said: Option<NodeState> = None;
        let mut last_said = Instant::now();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let state = self.state(&mut kernel)?;
            let repeat = last_said.elapsed() > Duration::from_secs(60);
            if said.as_ref() != Some(&state) || repeat {
                match &state {
                    NodeState::Done => info!("no table of nftproxy's here: the node is handed back"),
                    NodeState::NftproxyRuns => {
                        info!("nftproxy still runs here (it owns its tables); waiting for it to stop")
                    }
                    NodeState::NoSuccessor => info!("nftproxy has stopped; waiting for kube-proxy's rules"),
                    NodeState::NotSynced(what) => {
                        info!(rules = %what, healthz = %self.healthz, "kube-proxy's rules are here; waiting for its first sync")
                    }
                    NodeState::Served(_) => {}
                }
                said = Some(state.clone());
                last_said = Instant::now();
            }
            match state {
                NodeState::Served(what) => {
                    let mut config = ProxyConfig::new("hand-back");
                    config.table = self.table.clone();
                    let n = crate::sync::cleanup(&mut kernel, &config)?;
                    info!(tables = n, serving = %what, "kube-proxy serves the node: nftproxy's tables deleted");
                    if once {
                        return Ok(());
                    }
                }
                NodeState::Done if once => return Ok(()),
                _ => {}
            }
            std::thread::sleep(self.every);
        }
        if said != Some(NodeState::Done) {
            warn!("stopped before the node was handed back: nftproxy's tables stay");
        }
        Ok(())
    }
}
