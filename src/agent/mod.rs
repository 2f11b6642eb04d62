//! `nftproxy run`: the long-running node agent. Sources feed the index; the sync loop
//! ([`runner`]) hands what changed to the syncer; after every sync the health state, the
//! health-check servers, conntrack, metrics and Events follow. On SIGTERM/SIGINT it stops and
//! leaves the rules in the kernel (like kube-proxy), so traffic keeps flowing across a restart.

pub(crate) mod debug;
mod lifecycle;
mod problems;
pub(crate) mod runner;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use thiserror::Error;
use tracing::{error, info, warn};

use crate::config::ProxyConfig;
use crate::config::kubeproxy::ProxyMode;
use crate::conntrack::sysctls::{self, ConntrackSysctls, SysctlRoots};
use crate::conntrack::{KernelFlows, Reconciler};
use crate::health::{self, ProxyHealth, ServiceHealthServers};
use crate::http::Limits;
use crate::index::{ClusterIndex, Update};
use crate::metrics::{Applied, Metrics, NoLocalEndpoints, SyncSample};
use crate::model::{ClusterState, Problem};
use crate::net::IpFamily;
use crate::netlink::{Kernel, NetlinkError};
use crate::nodeaddr::NodePortTargets;
use crate::plan::HealthCheck;
use crate::plan::{self, NodePorts, PlanInput};
use crate::source::kube::{EventPublisher, KubeSourceError, Notice};
use crate::source::watch::{Polling, spawn_manifest_watcher};
use crate::sync::{SyncError, Synced, Syncer, local_nodeports};
use crate::takeover::Leftovers;
use runner::{NodeGate, Observer, Timing};

/// Where objects come from.
#[derive(Debug, Clone)]
pub enum SourceSetting {
    /// A manifests file or directory, watched for changes.
    Manifests(PathBuf),
    /// The Kubernetes API: `--kubeconfig`, or in-cluster; `--master` over its server.
    Kubernetes { kubeconfig: Option<String>, master: Option<String> },
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
    /// `/debug/services`: on the metrics server when equal to `metrics`, else a server of its
    /// own; `None` disables.
    pub debug: Option<SocketAddr>,
    /// Export the per-service counters (`nftproxy_service_connections_total`,
    /// `nftproxy_service_rejects_total`); the kernel counts either way.
    pub service_counters: bool,
    /// How often the manifests are checked for changes.
    pub poll: std::time::Duration,
    /// Kernel conntrack settings to apply at start-up.
    pub conntrack: ConntrackSysctls,
    /// Exit when the healthz or metrics port cannot be bound (else retry every 5 s).
    pub bind_address_hard_fail: bool,
    /// Remove kube-proxy's leftovers in the first sync (`--cleanup-kube-proxy`).
    pub cleanup_kube_proxy: bool,
    /// The mode the configuration names (nftproxy runs nftables mode whatever it is).
    pub mode: ProxyMode,
    /// The OOM score adjustment to set (`oomScoreAdj`).
    pub oom_score_adj: Option<i32>,
    /// The `--config` file: a change of its content restarts the process, as upstream.
    pub config_file: Option<PathBuf>,
    /// The effective configuration, as `/configz` serves it.
    pub configz: String,
}

/// Errors that stop the agent.
#[derive(Debug, Error)]
pub enum RunError {
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("{}", serve_message(what, addr, source))]
    Serve { what: &'static str, addr: SocketAddr, source: std::io::Error },
    #[error("cannot start a thread: {0}")]
    Thread(std::io::Error),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Kube(#[from] KubeSourceError),
    #[error(transparent)]
    Loop(#[from] runner::LoopError),
    /// Upstream's kernel check for nftables mode.
    #[error("{0} (set {var} to skip this check)", var = lifecycle::SKIP_KERNEL_CHECK)]
    Kernel(String),
    /// The process must start again (the DaemonSet restarts it), as upstream exits.
    #[error("exiting to be restarted: {0}")]
    Restart(String),
}

/// Upstream's error texts for the two servers.
fn serve_message(what: &str, addr: &SocketAddr, source: &std::io::Error) -> String {
    match what {
        "healthz" => format!("failed to start proxy healthz on {addr}: {source}"),
        _ => format!("starting metrics server failed: listen tcp {addr}: {source}"),
    }
}

struct AgentObserver {
    health: Arc<ProxyHealth>,
    servers: ServiceHealthServers,
    metrics: Arc<Metrics>,
    events: Option<tokio::sync::mpsc::UnboundedSender<Notice>>,
    conntrack: Reconciler,
    /// kube-proxy's leftovers handed to the syncer, until a full sync removed them.
    takeover: Option<Leftovers>,
    debug: debug::DebugAnswerer,
    /// The health checks the servers serve, with the addresses and families they were
    /// served for (`None` until all were bound).
    health_served: Option<(Arc<[HealthCheck]>, NodePortTargets, Vec<IpFamily>)>,
    /// This node's Node, watched for deletion and new addresses (API source only).
    node_watch: Option<lifecycle::NodeWatch>,
    restart: lifecycle::Restart,
    /// When the process started: slices changed before it are not network-programming samples
    /// (upstream's tracker start time), else a restart reports the age of every object.
    started: SystemTime,
    /// The kernel does IPv6: `/healthz` reports an IPv6 status as upstream's IPv6 proxier does,
    /// even when nftproxy has nothing to program in that family.
    ipv6: bool,
}

impl AgentObserver {
    fn notify(&self, notice: Notice) {
        if let Some(tx) = &self.events {
            let _ = tx.send(notice);
        }
    }

    fn report(&mut self, problems: Vec<Problem>) {
        for problem in problems {
            self.metrics.rejected(problem.object.kind);
            self.notify(Notice::Problem(problem));
        }
    }
}

/// The families a sync of `state` programs (IPv4 always, IPv6 when anything uses it).
fn families(state: &ClusterState, config: &ProxyConfig) -> Vec<IpFamily> {
    let none = NodePorts::Addresses(Vec::new());
    plan::families(&PlanInput { config, state, nodeports_v4: &none, nodeports_v6: &none })
}

impl AgentObserver {
    /// Follows the takeover from kube-proxy: done with the first successful full sync (which
    /// carried the deletions), abandoned when the kernel refused one of them (the syncer goes on
    /// without them), kept for the next full sync after any other failure.
    fn took_over(&mut self, result: Result<&Synced, &SyncError>, syncer: &mut Syncer) {
        let Some(leftovers) = &self.takeover else { return };
        match result {
            Ok(s) if s.report.full => {
                info!(
                    removed = %leftovers.summary(),
                    "took over from kube-proxy: its leftovers went in the same transaction as nftproxy's rules"
                );
                crate::takeover::remove_ipvs_leftovers(&leftovers.ipvs);
                crate::takeover::remove_legacy_leftovers(&leftovers.legacy);
                self.takeover = None;
            }
            Ok(_) => {}
            Err(SyncError::Netlink(NetlinkError::Rejected(failures))) => {
                let ops = leftovers.ops().len();
                if let Some(f) = failures.iter().find(|f| f.op_index < ops) {
                    warn!(
                        failure = %f,
                        "the kernel refused removing kube-proxy's leftovers; they stay (`nftproxy check` lists them) \
                         and nftproxy syncs without removing them"
                    );
                    syncer.prepend_to_next_full_sync(Vec::new());
                    self.takeover = None;
                }
            }
            Err(_) => {}
        }
    }
}

impl Observer for AgentObserver {
    fn queued(&mut self, at: Instant) {
        self.health.queued(at);
        self.metrics.queued();
    }

    fn problems(&mut self, problems: Vec<Problem>) {
        self.debug.reported(&problems);
        self.report(problems);
    }

    fn updated(&mut self, update: &Update) {
        self.debug.updated(update);
    }

    fn idle(&mut self, index: &ClusterIndex, syncer: &Syncer) {
        self.debug.answer(index, syncer);
        if let Some(reason) = self.node_watch.as_mut().and_then(|w| w.check(index.state().node())) {
            // Load balancers stop sending here first; the DaemonSet starts the process again.
            self.health.set_node_eligible(false);
            self.metrics.node_eligible(false);
            error!(node = %syncer.config().hostname, %reason, "this node's Node changed; exiting so that the proxy restarts with it");
            self.restart.ask(reason);
        }
    }

    fn synced(
        &mut self,
        result: Result<&Synced, &SyncError>,
        took: Duration,
        index: &mut ClusterIndex,
        syncer: &mut Syncer,
    ) {
        self.took_over(result, syncer);
        let eligible = !index.state().node().is_some_and(|n| n.being_deleted);
        self.health.set_node_eligible(eligible);
        self.metrics.node_eligible(eligible);
        let refused = syncer.take_problems();
        self.report(refused);
        let mut left_out = self.debug.skipped_by_kind();
        *left_out.entry(crate::model::ObjectKind::Service).or_insert(0) += syncer.excluded().len();
        self.metrics.left_out(&left_out);
        let families = families(index.state(), syncer.config());
        let sample = |full: bool, duration: Duration, applied: Option<Applied>, reason: String| SyncSample {
            families: families.clone(),
            reason,
            full,
            duration,
            applied,
        };
        let reason = match result {
            Ok(s) => s.report.reason.to_string(),
            Err(_) => "failed".to_string(),
        };
        self.debug.synced(result, &reason);
        match result {
            Ok(s) => {
                let applied = Applied {
                    kernel: s.report.apply.kernel,
                    messages: s.report.apply.messages,
                    drift_repairs: s.report.drift_repairs,
                    no_local: families
                        .iter()
                        .map(|&family| {
                            let (internal, external) = s.stats.no_local(family);
                            (family, NoLocalEndpoints { internal, external })
                        })
                        .collect(),
                };
                let reason = s.report.reason.to_string();
                // A periodic check that found nothing to do (owned tables, nothing pending) is
                // not a sync to upstream, whose runner syncs only for changes, after failures and
                // hourly: it is not counted in the sync metrics.
                let idle_check = s.report.reason == crate::sync::SyncReason::Periodic
                    && !s.report.full
                    && s.report.apply.messages == 0;
                if !idle_check {
                    self.metrics.synced(&sample(s.report.full, s.report.total, Some(applied), reason));
                }
                let changes = index.take_changes();
                self.metrics.service_changes.inc_by(changes.services);
                self.metrics.endpoint_changes.inc_by(changes.endpoints);
                self.metrics.service_changes_pending.set(0);
                self.metrics.endpoint_changes_pending.set(0);
                let now = SystemTime::now();
                for (family, t) in changes.trigger_times {
                    if t < self.started {
                        continue;
                    }
                    if let Ok(latency) = now.duration_since(t) {
                        self.metrics.network_programmed(family, latency);
                    }
                }
                // The same health checks (one allocation while none changes) on the same
                // addresses, all served: nothing to do, at any number of services.
                let served = (Arc::clone(&s.health_checks), s.nodeports.clone(), families.clone());
                let unchanged = self.health_served.as_ref().is_some_and(|(checks, nodeports, fams)| {
                    Arc::ptr_eq(checks, &served.0) && *nodeports == served.1 && *fams == served.2
                });
                let mut reported = families.clone();
                if self.ipv6 && !reported.contains(&IpFamily::V6) {
                    reported.push(IpFamily::V6);
                }
                if unchanged {
                    self.health.synced(&reported);
                } else {
                    self.health.updated(&reported, &s.health_checks);
                    // A family nftproxy does not program (IPv6 on a single-stack cluster)
                    // matches all its addresses, but must not widen the health-check servers
                    // to every address: upstream has no proxier, hence no server, for it.
                    let unused = NodePorts::Addresses(Vec::new());
                    let v6 = if families.contains(&IpFamily::V6) { &s.nodeports.v6 } else { &unused };
                    let failures = self.servers.sync(&s.health_checks, &s.nodeports.v4, v6, &s.nodeports.loopback);
                    // A server that could not bind is tried again after the next sync.
                    self.health_served = failures.is_empty().then_some(served);
                    for f in failures {
                        self.notify(Notice::HealthCheckBindFailed { service: f.service, port: f.port, error: f.error });
                    }
                }
                // After the health-check servers, as upstream: a sync's servers listen as soon as
                // it is reported done, however long the conntrack table takes to read.
                if syncer.config().conntrack_cleanup {
                    let mut table = KernelFlows::default();
                    for pass in self.conntrack.reconcile(&mut table, &s.conntrack, &s.nodeports, index.state()) {
                        self.metrics.conntrack.reconciled(pass.family, pass.took, pass.deleted);
                    }
                }
            }
            Err(e) => {
                // A failed sync is always planned as a full one next; upstream observes the
                // duration of failed syncs too.
                self.metrics.synced(&sample(true, took, None, "failed".to_string()));
                let pending = index.changes();
                self.metrics.service_changes_pending.set(pending.services as i64);
                self.metrics.endpoint_changes_pending.set(pending.endpoints as i64);
                error!(error = %e, "sync failed");
            }
        }
    }
}

/// Starts the healthz or metrics server. A port that cannot be bound is fatal with
/// `--bind-address-hard-fail` (after a Warning Event on the Node with upstream's reason),
/// else logged and retried every 5 s, as upstream.
fn serve(
    rt: &tokio::runtime::Runtime,
    what: &'static str,
    addr: SocketAddr,
    handler: crate::http::Handler,
    hard_fail: bool,
    events: Option<&tokio::sync::mpsc::UnboundedSender<Notice>>,
) -> Result<tokio::sync::watch::Sender<bool>, RunError> {
    if !hard_fail {
        return Ok(crate::http::start_retrying(
            rt.handle(),
            what,
            addr,
            handler,
            Limits::default(),
            crate::http::BIND_RETRY,
        ));
    }
    crate::http::start(rt.handle(), addr, handler, Limits::default()).map_err(|source| {
        let err = RunError::Serve { what, addr, source };
        if let Some(tx) = events {
            let reason =
                if what == "healthz" { "FailedToStartProxierHealthcheck" } else { "FailedToStartMetricServer" };
            let _ = tx.send(Notice::NodeEvent { warning: true, reason, note: err.to_string() });
            // The publisher runs on the runtime: give it a moment before the process exits.
            std::thread::sleep(Duration::from_millis(500));
        }
        err
    })
}

/// kube-proxy's leftovers here, to remove in the first sync (`None` when there are none, or
/// they cannot be read: then they are only logged).
fn find_leftovers(kernel: &mut Kernel) -> Option<Leftovers> {
    match Leftovers::read(kernel) {
        Ok(l) if l.is_empty() && l.kept.is_empty() => None,
        Ok(l) => {
            for k in &l.kept {
                warn!(leftover = %k.what, why = %k.why, "a kube-proxy leftover stays");
            }
            if l.is_empty() {
                return None;
            }
            info!(leftovers = %l.summary(), "kube-proxy's leftovers go in nftproxy's first sync");
            Some(l)
        }
        Err(e) => {
            warn!(error = %e, "cannot read kube-proxy's leftovers; they stay (`nftproxy check` lists them)");
            None
        }
    }
}

/// Runs until a termination signal.
pub(crate) fn run(settings: RunSettings) -> Result<(), RunError> {
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
    match settings.mode {
        ProxyMode::NfTables => info!("Using nftables Proxier"),
        other => {
            let named = match other {
                ProxyMode::IpTables => "iptables",
                ProxyMode::Ipvs => "ipvs",
                _ => "\"\" (upstream's default, iptables)",
            };
            info!(
                configured_mode = named,
                "the configuration names mode {named}: nftproxy runs nftables mode, with that mode's sync periods and masquerade settings, and removes its leftovers"
            );
        }
    }
    // Upstream makes the check in nftables mode only (its nft binary must suit the kernel); a
    // cluster that ran iptables mode on an older kernel is not stopped by the swap.
    let release = lifecycle::kernel_release();
    let skip = std::env::var_os(lifecycle::SKIP_KERNEL_CHECK).is_some_and(|v| !v.is_empty());
    match lifecycle::kernel_check(&release, skip) {
        Err(e) if settings.mode == ProxyMode::NfTables => return Err(RunError::Kernel(e)),
        Err(e) => {
            warn!(kernel = %release, "{e}; upstream checks this in nftables mode only, and the configuration names another mode: going on")
        }
        Ok(()) => {}
    }
    if let Some(adj) = settings.oom_score_adj {
        lifecycle::set_oom_score_adj(adj);
    }
    sysctls::apply_at_start_up(&settings.conntrack, &SysctlRoots::default());
    let restart = lifecycle::Restart::new(Arc::clone(&stop));
    if let Some(path) = &settings.config_file {
        lifecycle::watch_config_file(path.clone(), Duration::from_secs(1), restart.clone())
            .map_err(RunError::Thread)?;
    }

    let health = ProxyHealth::new(settings.timing.sync_period * 2);
    let counters = settings.service_counters.then(|| {
        Box::new(crate::metrics::service_counters::KernelCounters::new(&settings.proxy.table))
            as Box<dyn crate::metrics::service_counters::CounterSource>
    });
    let findings = crate::metrics::check_findings::KernelFindings::new(&settings.proxy.table);
    let metrics = Metrics::for_node(counters, Box::new(findings));
    let limits = Limits::default();

    let (tx, rx) = mpsc::channel();
    let mut events = None;
    let (_source, gate) = match &settings.source {
        SourceSetting::Manifests(path) => {
            info!(path = %path.display(), "watching manifests");
            let hostname = settings.proxy.hostname.clone();
            let watcher =
                spawn_manifest_watcher(path.clone(), hostname, tx, Arc::clone(&stop), Polling::every(settings.poll))
                    .map_err(RunError::Thread)?;
            (Some(watcher), NodeGate::Listed)
        }
        SourceSetting::Kubernetes { kubeconfig, master } => {
            let client = rt.block_on(crate::source::kube::client(kubeconfig.as_deref(), master.as_deref()))?;
            let hostname = settings.proxy.hostname.clone();
            let (etx, mut erx) = tokio::sync::mpsc::unbounded_channel::<Notice>();
            let mut publisher = EventPublisher::new(client.clone(), &hostname);
            rt.spawn(async move {
                while let Some(n) = erx.recv().await {
                    publisher.publish(&n).await;
                }
            });
            events = Some(etx);
            let _guard = rt.enter();
            crate::source::kube::spawn_watchers(client, &hostname, tx);
            (None, NodeGate::Present)
        }
    };

    let hard_fail = settings.bind_address_hard_fail;
    let proxier = health::proxier_handler(Arc::clone(&health), Arc::clone(&metrics));
    let _healthz =
        settings.healthz.map(|a| serve(&rt, "healthz", a, proxier, hard_fail, events.as_ref())).transpose()?;
    let (answerer, debug_requests) = debug::DebugAnswerer::new();
    let configz: Arc<str> = Arc::from(settings.configz.as_str());
    let mut metrics_handler = crate::metrics::handler(Arc::clone(&metrics), configz);
    let own_debug = settings.debug.filter(|d| Some(*d) != settings.metrics);
    match (settings.debug, own_debug) {
        (Some(_), None) => metrics_handler = debug::with_route(metrics_handler, debug_requests.clone()),
        (None, _) => info!(
            metrics = ?settings.metrics,
            "/debug/services is not served: the metrics address is not a loopback address, or is off \
             (--debug-bind-address=127.0.0.1:PORT serves it)"
        ),
        _ => {}
    }
    let _metrics =
        settings.metrics.map(|a| serve(&rt, "metrics", a, metrics_handler, hard_fail, events.as_ref())).transpose()?;
    let _debug = own_debug
        .map(|a| {
            let not_found: crate::http::Handler =
                Arc::new(|_| crate::http::Reply::text(hyper::StatusCode::NOT_FOUND, "404 page not found\n"));
            serve(&rt, "debug", a, debug::with_route(not_found, debug_requests.clone()), hard_fail, events.as_ref())
        })
        .transpose()?;

    let mut kernel = Kernel::open()?;
    let takeover = if settings.cleanup_kube_proxy { find_leftovers(&mut kernel) } else { None };
    let mut index = ClusterIndex::new();
    if matches!(settings.source, SourceSetting::Kubernetes { .. }) {
        // The first sync already drops traffic to unallocated ClusterIPs (the watch sends an
        // empty list where the API server has no ServiceCIDRs).
        index.await_list(crate::index::Kind::ServiceCidrs);
    }
    let mut syncer = Syncer::new(settings.proxy, Box::new(kernel), local_nodeports());
    if let Some(leftovers) = &takeover {
        syncer.prepend_to_next_full_sync(leftovers.ops());
    }
    if let Some(tx) = &events {
        let _ = tx.send(Notice::NodeEvent { warning: false, reason: "Starting", note: String::new() });
    }
    let node_watch = matches!(settings.source, SourceSetting::Kubernetes { .. })
        .then(|| lifecycle::NodeWatch::new(syncer.config().detect_local == crate::config::DetectLocal::NodeCidr));
    let mut observer = AgentObserver {
        servers: ServiceHealthServers::new(rt.handle().clone(), Arc::clone(&health), limits),
        health,
        metrics,
        events,
        conntrack: Reconciler::default(),
        takeover,
        debug: answerer,
        health_served: None,
        node_watch,
        restart: restart.clone(),
        started: SystemTime::now(),
        ipv6: lifecycle::ipv6_supported(),
    };
    // As upstream's sync loop: healthy from the start (every family's time is now), so a
    // first sync that never succeeds turns /healthz bad after the timeout, not before.
    let mut start_families = vec![IpFamily::V4];
    if observer.ipv6 {
        start_families.push(IpFamily::V6);
    }
    observer.health.synced(&start_families);
    info!(hostname = %syncer.config().hostname, "nftproxy running");
    runner::run(&mut index, &mut syncer, &rx, &stop, settings.timing, gate, &mut observer)?;
    if !index.ready() {
        warn!("stopped before the first complete list of Services and EndpointSlices");
    }
    info!("stopping; nftproxy's rules stay in the kernel");
    match restart.reason() {
        Some(reason) => Err(RunError::Restart(reason)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::manifests;

    const LOCAL: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: itp, namespace: ns}
spec:
  internalTrafficPolicy: Local
  ipFamilies: [IPv4, IPv6]
  clusterIPs: [10.96.0.1, "fd00:96::1"]
  ports: [{name: p, port: 80}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: itp-4, namespace: ns, labels: {kubernetes.io/service-name: itp}}
addressType: IPv4
ports: [{name: p, port: 80}]
endpoints: [{addresses: [10.244.2.10], nodeName: node2}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: itp-6, namespace: ns, labels: {kubernetes.io/service-name: itp}}
addressType: IPv6
ports: [{name: p, port: 80}]
endpoints: [{addresses: ["fd00:10::a"], nodeName: node1}]
---
apiVersion: v1
kind: Service
metadata: {name: etp, namespace: ns}
spec:
  type: NodePort
  externalTrafficPolicy: Local
  clusterIP: 10.96.0.2
  ports: [{name: p, port: 80, nodePort: 30080}, {name: q, port: 81, nodePort: 30081}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: etp-4, namespace: ns, labels: {kubernetes.io/service-name: etp}}
addressType: IPv4
ports: [{name: p, port: 80}, {name: q, port: 81}]
endpoints: [{addresses: [10.244.2.11], nodeName: node2}]
"#;

    /// The per-family split of the no-local-endpoints gauge adds up to the plan's own counts,
    /// and puts each service port in its family.
    #[test]
    fn no_local_endpoints_split_by_family_adds_up_to_the_plan() {
        let mut m = manifests::Manifests::default();
        manifests::load_text(std::path::Path::new("t.yaml"), LOCAL, &mut m);
        let (state, problems) = m.into_state("node1");
        assert!(problems.is_empty(), "{problems:?}");
        let config = ProxyConfig::new("node1");
        let none = NodePorts::Addresses(Vec::new());
        let planned =
            plan::plan(&PlanInput { config: &config, state: &state, nodeports_v4: &none, nodeports_v6: &none });
        let fams = families(&state, &config);
        assert_eq!(fams, [IpFamily::V4, IpFamily::V6]);
        assert_eq!(planned.stats.no_local(IpFamily::V4), (1, 2));
        assert_eq!(planned.stats.no_local(IpFamily::V6), (0, 0));
        assert_eq!((planned.stats.no_local_internal, planned.stats.no_local_external), (1, 2));
    }
}
