//! `nftproxy run`: the long-running node agent. Sources feed the reconciler's sync loop; after
//! every sync the health state, the health-check servers, conntrack, metrics and Events follow.
//! On SIGTERM/SIGINT it stops and leaves the rules in the kernel (like kube-proxy), so traffic
//! keeps flowing across a restart.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::{Instant, SystemTime};

use thiserror::Error;
use tracing::{error, info, warn};

use crate::config::ProxyConfig;
use crate::config::file::ConntrackSettings;
use crate::health::http::Limits;
use crate::health::{self, ProxyHealth, ServiceHealthServers};
use crate::metrics::Metrics;
use crate::model::Problem;
use crate::netlink::{Kernel, NetlinkError};
use crate::reconcile::runner::{self, Observer, Timing};
use crate::reconcile::{Reconciler, SyncError, Synced, local_nodeports};
use crate::source::kube::{EventPublisher, KubeSourceError};
use crate::source::watch::spawn_manifest_watcher;

/// Where objects come from.
#[derive(Debug, Clone)]
pub enum SourceSetting {
    /// A manifests file or directory, watched for changes.
    Manifests(PathBuf),
    /// The Kubernetes API: `--kubeconfig`, or in-cluster.
    Kubernetes { kubeconfig: Option<String> },
}

/// Settings of the long-running agent.
#[derive(Debug, Clone)]
pub struct RunSettings {
    pub proxy: ProxyConfig,
    pub source: SourceSetting,
    pub timing: Timing,
    /// `/healthz` and `/livez`; `None` disables.
    pub healthz: Option<SocketAddr>,
    /// `/metrics` and `/proxyMode`; `None` disables.
    pub metrics: Option<SocketAddr>,
    /// How often the manifests are checked for changes.
    pub poll: std::time::Duration,
    /// Kernel conntrack settings to apply at start-up.
    pub conntrack: ConntrackSettings,
}

/// Errors that stop the agent.
#[derive(Debug, Error)]
pub enum RunError {
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot serve {what} on {addr}: {source}")]
    Serve { what: &'static str, addr: SocketAddr, source: std::io::Error },
    #[error("cannot start a thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Kube(#[from] KubeSourceError),
}

struct AgentObserver {
    health: Arc<ProxyHealth>,
    servers: ServiceHealthServers,
    metrics: Arc<Metrics>,
    events: Option<tokio::sync::mpsc::UnboundedSender<Problem>>,
}

impl Observer for AgentObserver {
    fn queued(&mut self, at: Instant) {
        self.health.queued(at);
        self.metrics.queued();
    }

    fn synced(&mut self, result: Result<&Synced, &SyncError>, reconciler: &mut Reconciler) {
        self.health.set_node_eligible(!reconciler.state().node().is_some_and(|n| n.being_deleted));
        for problem in reconciler.take_problems() {
            self.metrics.rejected(problem.object.kind);
            if let Some(tx) = &self.events {
                let _ = tx.send(problem);
            }
        }
        let reason = match result {
            Ok(s) => s.report.reason.to_string(),
            Err(_) => "failed".to_string(),
        };
        self.metrics.synced(result, &reason);
        match result {
            Ok(s) => {
                let changes = reconciler.take_changes();
                self.metrics.service_changes.inc_by(changes.services);
                self.metrics.endpoint_changes.inc_by(changes.endpoints);
                self.metrics.service_changes_pending.set(0);
                self.metrics.endpoint_changes_pending.set(0);
                let now = SystemTime::now();
                for t in changes.trigger_times {
                    if let Ok(latency) = now.duration_since(t) {
                        self.metrics.network_programming.observe(latency.as_secs_f64());
                    }
                }
                if reconciler.config().conntrack_cleanup {
                    match crate::conntrack::clean(&s.conntrack) {
                        Ok(n) => {
                            self.metrics.conntrack_deleted.inc_by(n as u64);
                        }
                        Err(e) => error!(error = %e, "conntrack cleanup failed"),
                    }
                }
                self.health.updated(&s.health_checks);
                self.servers.sync(&s.health_checks, &s.nodeports.v4, &s.nodeports.v6);
            }
            Err(e) => {
                let pending = reconciler.pending_changes();
                self.metrics.service_changes_pending.set(pending.services as i64);
                self.metrics.endpoint_changes_pending.set(pending.endpoints as i64);
                error!(error = %e, "sync failed");
            }
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
    crate::conntrack::apply_sysctls(&settings.conntrack);

    let health = ProxyHealth::new(settings.timing.sync_period * 2);
    let metrics = Metrics::new();
    let limits = Limits::default();
    let serve = |what, addr: Option<SocketAddr>, handler| -> Result<_, RunError> {
        addr.map(|addr| {
            health::start(rt.handle(), addr, handler, limits).map_err(|source| RunError::Serve { what, addr, source })
        })
        .transpose()
    };
    let _healthz = serve("health", settings.healthz, health::proxier_handler(Arc::clone(&health)))?;
    let _metrics = serve("metrics", settings.metrics, crate::metrics::handler(Arc::clone(&metrics)))?;

    let (tx, rx) = mpsc::channel();
    let mut events = None;
    let _source = match &settings.source {
        SourceSetting::Manifests(path) => {
            info!(path = %path.display(), "watching manifests");
            Some(spawn_manifest_watcher(path.clone(), tx, Arc::clone(&stop), settings.poll).map_err(RunError::Thread)?)
        }
        SourceSetting::Kubernetes { kubeconfig } => {
            let client = rt.block_on(crate::source::kube::client(kubeconfig.as_deref()))?;
            let hostname = settings.proxy.hostname.clone();
            let (etx, mut erx) = tokio::sync::mpsc::unbounded_channel::<Problem>();
            let mut publisher = EventPublisher::new(client.clone(), &hostname);
            rt.spawn(async move {
                while let Some(p) = erx.recv().await {
                    publisher.publish(&p).await;
                }
            });
            events = Some(etx);
            let _guard = rt.enter();
            crate::source::kube::spawn_watchers(client, &hostname, tx);
            None
        }
    };

    let kernel = Kernel::open()?;
    let mut reconciler = Reconciler::new(settings.proxy, Box::new(kernel), local_nodeports());
    let mut observer = AgentObserver {
        servers: ServiceHealthServers::new(rt.handle().clone(), Arc::clone(&health), limits),
        health,
        metrics,
        events,
    };
    info!(hostname = %reconciler.config().hostname, "nftproxy running");
    runner::run(&mut reconciler, &rx, &stop, settings.timing, &mut observer);
    if !reconciler.ready() {
        warn!("stopped before the first complete list of Services and EndpointSlices");
    }
    info!("stopping; nftproxy's rules stay in the kernel");
    Ok(())
}
