//! `nftproxy run`: the long-running node agent. Sources feed the reconciler's sync loop; after
//! every sync the health state and the health-check servers follow. On SIGTERM/SIGINT it stops
//! and leaves the rules in the kernel (like kube-proxy), so traffic keeps flowing across a
//! restart.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{error, info};

use crate::config::ProxyConfig;
use crate::health::http::Limits;
use crate::health::{self, ProxyHealth, ServiceHealthServers};
use crate::netlink::{Kernel, NetlinkError};
use crate::reconcile::runner::{self, Observer, Timing};
use crate::reconcile::{Reconciler, SyncError, Synced, local_nodeports};
use crate::source::watch::spawn_manifest_watcher;

/// Where objects come from.
#[derive(Debug, Clone)]
pub enum SourceSetting {
    Manifests(PathBuf),
}

/// Settings of the long-running agent.
#[derive(Debug, Clone)]
pub struct RunSettings {
    pub proxy: ProxyConfig,
    pub source: SourceSetting,
    pub timing: Timing,
    /// `/healthz` and `/livez`; `None` disables.
    pub healthz: Option<SocketAddr>,
    /// How often the manifests are checked for changes.
    pub poll: Duration,
}

/// Errors that stop the agent.
#[derive(Debug, Error)]
pub enum RunError {
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot serve health on {addr}: {source}")]
    Healthz { addr: SocketAddr, source: std::io::Error },
    #[error("cannot start a thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
}

struct AgentObserver {
    health: Arc<ProxyHealth>,
    servers: ServiceHealthServers,
}

impl Observer for AgentObserver {
    fn queued(&mut self, at: Instant) {
        self.health.queued(at);
    }

    fn synced(&mut self, result: Result<&Synced, &SyncError>, reconciler: &mut Reconciler) {
        self.health.set_node_eligible(!reconciler.state().node().is_some_and(|n| n.being_deleted));
        match result {
            Ok(s) => {
                if reconciler.config().conntrack_cleanup {
                    if let Err(e) = crate::conntrack::clean(&s.plan.conntrack) {
                        error!(error = %e, "conntrack cleanup failed");
                    }
                }
                self.health.updated(&s.health_checks);
                self.servers.sync(&s.health_checks, &s.nodeports.v4, &s.nodeports.v6);
            }
            Err(e) => error!(error = %e, "sync failed"),
        }
    }
}

/// Runs until a termination signal.
pub fn run(settings: RunSettings) -> Result<(), RunError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("nftproxy-io")
        .enable_all()
        .build()
        .map_err(RunError::Runtime)?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let _ = signal_hook::flag::register(signal, Arc::clone(&stop));
    }

    let health = ProxyHealth::new(settings.timing.sync_period * 2);
    let limits = Limits::default();
    let _healthz = match settings.healthz {
        Some(addr) => Some(
            health::start(rt.handle(), addr, health::proxier_handler(Arc::clone(&health)), limits)
                .map_err(|source| RunError::Healthz { addr, source })?,
        ),
        None => None,
    };

    let (tx, rx) = mpsc::channel();
    let _source = match &settings.source {
        SourceSetting::Manifests(path) => {
            info!(path = %path.display(), "watching manifests");
            spawn_manifest_watcher(path.clone(), tx, Arc::clone(&stop), settings.poll).map_err(RunError::Thread)?
        }
    };

    let kernel = Kernel::open()?;
    let mut reconciler = Reconciler::new(settings.proxy, Box::new(kernel), local_nodeports());
    let mut observer = AgentObserver { servers: ServiceHealthServers::new(rt.handle().clone(), Arc::clone(&health), limits), health };
    info!(hostname = %reconciler.config().hostname, "nftproxy running");
    runner::run(&mut reconciler, &rx, &stop, settings.timing, &mut observer);
    info!("stopping; nftproxy's rules stay in the kernel");
    Ok(())
}
