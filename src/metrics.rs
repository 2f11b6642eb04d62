//! Prometheus metrics, with kube-proxy's names, types, labels, help texts and buckets where
//! they apply (dashboards and alerts keep working after a migration), the standard `process_*`
//! metrics and `kubernetes_build_info`, and nftproxy's own under `nftproxy_`. Served as text at
//! `/metrics` on `--metrics-bind-address`, beside `/healthz` (`ok`, as upstream's metrics
//! port) and `/proxyMode` (which answers `nftables`).
//!
//! **`ip_family`.** Upstream runs one proxier per family and labels most metrics with it;
//! nftproxy programs both families in one transaction. Each sync is therefore recorded once
//! under every family it programmed, with the whole sync's duration (that is the time that
//! family's rules took), and a failed transaction counts for every family it carried; the
//! per-family counts (`no_local_endpoints`) are each family's own.

pub(crate) mod check_findings;
pub(crate) mod service_counters;
pub(crate) mod text_format;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hyper::StatusCode;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets, linear_buckets};
use prometheus_client::registry::Registry;

#[cfg(test)]
use crate::http::Asked;
use crate::http::{Handler, Reply};
use crate::model::ObjectKind;
use crate::net::IpFamily;

type Labels = Vec<(String, String)>;
type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;
type TimestampFamily = Family<Labels, Gauge<f64, AtomicU64>>;

/// kube-proxy's sync histograms: `ExponentialBuckets(0.001, 2, 15)`, 1 ms … 16.384 s.
fn sync_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// kube-proxy's network-programming buckets: component-base's `MergeBuckets` (which starts
/// with a 0 bucket) of 0.25 s steps to 0.5 s, 1 s steps to 59 s, 5 s steps to 115 s and 30 s
/// steps to 5 min.
fn network_programming_buckets() -> Histogram {
    let buckets = std::iter::once(0.0)
        .chain(linear_buckets(0.25, 0.25, 2))
        .chain(linear_buckets(1.0, 1.0, 59))
        .chain(linear_buckets(60.0, 5.0, 12))
        .chain(linear_buckets(120.0, 30.0, 7));
    Histogram::new(buckets)
}

fn now_seconds() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

fn label(k: &str, v: &str) -> (String, String) {
    (k.to_string(), v.to_string())
}

fn family_label(family: IpFamily) -> Labels {
    vec![label("ip_family", family.k8s_name())]
}

/// Service ports with a Local traffic policy and no local endpoints, in one family.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct NoLocalEndpoints {
    pub internal: usize,
    pub external: usize,
}

/// One sync, as the metrics see it.
#[derive(Debug, Clone)]
pub(crate) struct SyncSample {
    /// The families the transaction programmed.
    pub families: Vec<IpFamily>,
    /// Why it ran (`nftproxy_syncs_total{reason}`).
    pub reason: String,
    pub full: bool,
    /// From the start of planning to the kernel's answer.
    pub duration: Duration,
    /// `None` when the transaction failed.
    pub applied: Option<Applied>,
}

/// What a successful sync did.
#[derive(Debug, Clone, Default)]
pub(crate) struct Applied {
    pub kernel: Duration,
    pub messages: usize,
    pub drift_repairs: usize,
    pub no_local: Vec<(IpFamily, NoLocalEndpoints)>,
}

/// Every metric nftproxy exports.
pub(crate) struct Metrics {
    registry: Registry,
    /// The families the last sync programmed (IPv4 before the first), for the queued timestamp.
    families: Mutex<Vec<IpFamily>>,
    sync_duration: HistogramFamily,
    full_sync_duration: HistogramFamily,
    partial_sync_duration: HistogramFamily,
    last_sync_timestamp: TimestampFamily,
    last_queued_timestamp: TimestampFamily,
    network_programming: HistogramFamily,
    pub endpoint_changes: Counter,
    pub endpoint_changes_pending: Gauge,
    pub service_changes: Counter,
    pub service_changes_pending: Gauge,
    sync_failures: Family<Labels, Counter>,
    cleanup_failures: Family<Labels, Counter>,
    healthz: Family<Labels, Counter>,
    livez: Family<Labels, Counter>,
    no_local_endpoints: Family<Labels, Gauge>,
    build_info: Family<Labels, Gauge>,
    pub conntrack: ConntrackMetrics,
    transaction_messages: Counter,
    kernel_duration: Histogram,
    drift_repairs: Counter,
    rejected_objects: Family<Labels, Counter>,
    syncs: Family<Labels, Counter>,
    node_eligible: Gauge,
    left_out: Family<Labels, Gauge>,
}

impl Metrics {
    /// A registry with every metric registered but those read from the kernel at scrape time.
    #[cfg(test)]
    pub(crate) fn new() -> Arc<Metrics> {
        Self::build(None, None)
    }

    /// A registry with every metric registered: the per-service counters read from `counters`,
    /// `nftproxy_check_findings` from `findings`.
    /// Without `counters` (`--service-counters=false`) the per-service families are not exported.
    pub(crate) fn for_node(
        counters: Option<Box<dyn service_counters::CounterSource>>,
        findings: Box<dyn check_findings::FindingSource>,
    ) -> Arc<Metrics> {
        Self::build(
            counters.map(service_counters::ServiceCounters::new),
            Some(check_findings::CheckFindings::new(findings)),
        )
    }

    fn build(
        service_counters: Option<service_counters::ServiceCounters>,
        check_findings: Option<check_findings::CheckFindings>,
    ) -> Arc<Metrics> {
        let mut registry = Registry::default();
        let m = Metrics {
            families: Mutex::new(vec![IpFamily::V4]),
            sync_duration: Family::new_with_constructor(sync_buckets),
            full_sync_duration: Family::new_with_constructor(sync_buckets),
            partial_sync_duration: Family::new_with_constructor(sync_buckets),
            last_sync_timestamp: Family::default(),
            last_queued_timestamp: Family::default(),
            network_programming: Family::new_with_constructor(network_programming_buckets),
            endpoint_changes: Counter::default(),
            endpoint_changes_pending: Gauge::default(),
            service_changes: Counter::default(),
            service_changes_pending: Gauge::default(),
            sync_failures: Family::default(),
            cleanup_failures: Family::default(),
            healthz: Family::default(),
            livez: Family::default(),
            no_local_endpoints: Family::default(),
            build_info: Family::default(),
            conntrack: ConntrackMetrics::default(),
            transaction_messages: Counter::default(),
            kernel_duration: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            drift_repairs: Counter::default(),
            rejected_objects: Family::default(),
            syncs: Family::default(),
            node_eligible: Gauge::default(),
            left_out: Family::default(),
            registry: Registry::default(),
        };
        // kube-proxy's (pkg/proxy/metrics/metrics.go, nftables mode), with its help texts;
        // counters get their `_total` suffix from the encoder.
        let r = &mut registry;
        r.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "[ALPHA] SyncProxyRules latency in seconds",
            m.sync_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "[ALPHA] SyncProxyRules latency in seconds for full resyncs",
            m.full_sync_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "[ALPHA] SyncProxyRules latency in seconds for partial resyncs",
            m.partial_sync_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "[ALPHA] The last time proxy rules were successfully synced",
            m.last_sync_timestamp.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "[ALPHA] The last time a sync of proxy rules was queued",
            m.last_queued_timestamp.clone(),
        );
        r.register(
            "kubeproxy_network_programming_duration_seconds",
            "[ALPHA] In Cluster Network Programming Latency in seconds",
            m.network_programming.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "[ALPHA] Cumulative proxy rules Endpoint changes",
            m.endpoint_changes.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "[ALPHA] Pending proxy rules Endpoint changes",
            m.endpoint_changes_pending.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "[ALPHA] Cumulative proxy rules Service changes",
            m.service_changes.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "[ALPHA] Pending proxy rules Service changes",
            m.service_changes_pending.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "[ALPHA] Cumulative proxy nftables sync failures",
            m.sync_failures.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
            "[ALPHA] Cumulative proxy nftables cleanup failures",
            m.cleanup_failures.clone(),
        );
        r.register("kubeproxy_proxy_healthz", "[ALPHA] Cumulative proxy healthz HTTP status", m.healthz.clone());
        r.register("kubeproxy_proxy_livez", "[ALPHA] Cumulative proxy livez HTTP status", m.livez.clone());
        // A gauge whose name ends in `_total`, as upstream's.
        r.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "[ALPHA] Number of services with a Local traffic policy and no endpoints",
            m.no_local_endpoints.clone(),
        );
        r.register(
            "kubernetes_build_info",
            "[ALPHA] A metric with a constant '1' value labeled by major, minor, git version, git commit, git tree state, build date, Go version, and compiler from which Kubernetes was built, and platform on which it is running.",
            m.build_info.clone(),
        );
        r.register_collector(Box::new(ProcessCollector));

        m.conntrack.register(r);

        // nftproxy's own.
        r.register(
            "nftproxy_transaction_messages",
            "Netlink messages sent in nftables transactions",
            m.transaction_messages.clone(),
        );
        r.register(
            "nftproxy_sync_kernel_duration_seconds",
            "Time the kernel took to process a transaction",
            m.kernel_duration.clone(),
        );
        r.register(
            "nftproxy_drift_repairs",
            "Operations that repaired rules changed outside nftproxy",
            m.drift_repairs.clone(),
        );
        r.register(
            "nftproxy_rejected_objects",
            "Objects (or fields) that could not be programmed, by kind",
            m.rejected_objects.clone(),
        );
        r.register("nftproxy_syncs", "Syncs, by reason and result", m.syncs.clone());
        r.register(
            "nftproxy_node_eligible",
            "Whether this node takes load-balancer traffic: 1, or 0 while its Node is being deleted or after it changed (the nodeEligible of /healthz)",
            m.node_eligible.clone(),
        );
        r.register(
            "nftproxy_objects_left_out",
            "Objects left out of the ruleset now, by kind: invalid objects the sources skipped, and Services the kernel refused",
            m.left_out.clone(),
        );
        if let Some(collector) = service_counters {
            r.register_collector(Box::new(collector));
        }
        if let Some(collector) = check_findings {
            r.register_collector(Box::new(collector));
        }
        m.build_info.get_or_create(&build_labels()).set(1);
        m.node_eligible.set(1);
        for kind in ObjectKind::ALL {
            m.left_out.get_or_create(&vec![label("kind", kind.name())]).set(0);
        }
        Arc::new(Metrics { registry, ..m })
    }

    /// Records a change waiting to be synced (for every family nftproxy programs).
    pub(crate) fn queued(&self) {
        let now = now_seconds();
        for family in self.families() {
            self.last_queued_timestamp.get_or_create(&family_label(family)).set(now);
        }
    }

    fn families(&self) -> Vec<IpFamily> {
        self.families.lock().map(|f| f.clone()).unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Records a finished sync, successful or not (upstream observes the durations of both).
    pub(crate) fn synced(&self, sample: &SyncSample) {
        if let Ok(mut families) = self.families.lock() {
            families.clone_from(&sample.families);
        }
        let secs = sample.duration.as_secs_f64();
        for &family in &sample.families {
            let labels = family_label(family);
            self.sync_duration.get_or_create(&labels).observe(secs);
            let by_kind = if sample.full { &self.full_sync_duration } else { &self.partial_sync_duration };
            by_kind.get_or_create(&labels).observe(secs);
        }
        let result = if sample.applied.is_some() { "success" } else { "failure" };
        self.syncs.get_or_create(&vec![label("reason", &sample.reason), label("result", result)]).inc();
        let Some(applied) = &sample.applied else {
            for &family in &sample.families {
                self.sync_failures.get_or_create(&family_label(family)).inc();
            }
            return;
        };
        self.kernel_duration.observe(applied.kernel.as_secs_f64());
        self.transaction_messages.inc_by(applied.messages as u64);
        self.drift_repairs.inc_by(applied.drift_repairs as u64);
        let now = now_seconds();
        for &family in &sample.families {
            self.last_sync_timestamp.get_or_create(&family_label(family)).set(now);
        }
        for (family, counts) in &applied.no_local {
            for (policy, n) in [("internal", counts.internal), ("external", counts.external)] {
                let labels = vec![label("traffic_policy", policy), label("ip_family", family.k8s_name())];
                self.no_local_endpoints.get_or_create(&labels).set(n as i64);
            }
        }
    }

    /// Records an endpoint change's network-programming latency (from its EndpointSlice's
    /// `endpoints.kubernetes.io/last-change-trigger-time` to its rules being in the kernel).
    pub(crate) fn network_programmed(&self, family: IpFamily, latency: Duration) {
        self.network_programming.get_or_create(&family_label(family)).observe(latency.as_secs_f64());
    }

    /// Counts an answer of `/healthz` or `/livez`, by status code.
    pub(crate) fn health_answered(&self, livez: bool, code: StatusCode) {
        let family = if livez { &self.livez } else { &self.healthz };
        family.get_or_create(&vec![label("code", code.as_str())]).inc();
    }

    /// Counts an object or field that could not be programmed.
    pub(crate) fn rejected(&self, kind: ObjectKind) {
        self.rejected_objects.get_or_create(&vec![label("kind", kind.name())]).inc();
    }

    /// Whether the node takes load-balancer traffic (`/healthz`'s `nodeEligible`).
    pub(crate) fn node_eligible(&self, eligible: bool) {
        self.node_eligible.set(i64::from(eligible));
    }

    /// The objects left out now, by kind (every kind is set: one missing from `counts` is 0).
    pub(crate) fn left_out(&self, counts: &std::collections::BTreeMap<ObjectKind, usize>) {
        for kind in ObjectKind::ALL {
            let n = counts.get(&kind).copied().unwrap_or(0);
            self.left_out.get_or_create(&vec![label("kind", kind.name())]).set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// The text exposition.
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

// ---- The conntrack reconciler's metrics (kube-proxy's names, help, labels and buckets). ----

/// Per-family series of the conntrack reconciler, recorded after each pass that could list the
/// table (no series appears before the first pass, as upstream).
pub(crate) struct ConntrackMetrics {
    sync_duration: HistogramFamily,
    deleted_entries: Family<Labels, Counter>,
}

impl Default for ConntrackMetrics {
    fn default() -> Self {
        ConntrackMetrics {
            sync_duration: Family::new_with_constructor(sync_buckets),
            deleted_entries: Family::default(),
        }
    }
}

impl ConntrackMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            self.sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            self.deleted_entries.clone(),
        );
    }

    /// Records one family's pass.
    pub(crate) fn reconciled(&self, family: IpFamily, took: Duration, deleted: usize) {
        let labels = family_label(family);
        self.sync_duration.get_or_create(&labels).observe(took.as_secs_f64());
        self.deleted_entries.get_or_create(&labels).inc_by(deleted as u64);
    }
}

/// `kubernetes_build_info`'s labels, with nftproxy's build: its version as `git_version`
/// (`v0.1.0`), `compiler` `rustc`, and the commit when the build sets `NFTPROXY_GIT_COMMIT`.
fn build_labels() -> Labels {
    let version = env!("CARGO_PKG_VERSION");
    vec![
        label("build_date", option_env!("NFTPROXY_BUILD_DATE").unwrap_or("")),
        label("compiler", "rustc"),
        label("git_commit", option_env!("NFTPROXY_GIT_COMMIT").unwrap_or("")),
        label("git_tree_state", ""),
        label("git_version", &format!("v{version}")),
        label("go_version", ""),
        label("major", env!("CARGO_PKG_VERSION_MAJOR")),
        label("minor", env!("CARGO_PKG_VERSION_MINOR")),
        label("platform", &format!("{}/{}", std::env::consts::OS, goarch())),
    ]
}

/// The architecture as Go names it (`platform` is `linux/amd64` in upstream's builds).
fn goarch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// The standard `process_*` metrics of Prometheus clients, read from `/proc/self` at each
/// scrape. A value that cannot be read is left out.
#[derive(Debug)]
struct ProcessCollector;

/// The unit of `/proc/<pid>/stat` times (`USER_HZ`, 100 on every Linux architecture).
const USER_HZ: f64 = 100.0;

impl ProcessCollector {
    fn stat() -> Option<Vec<String>> {
        let text = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The command name may hold spaces: the fields start after its closing parenthesis.
        let rest = &text[text.rfind(')')? + 1..];
        Some(rest.split_whitespace().map(str::to_string).collect())
    }

    /// A `kB` field of `/proc/self/status` (read once per scrape), in bytes.
    fn status_kib(text: &str, key: &str) -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().next()?.parse::<f64>().ok().map(|kib| kib * 1024.0)
    }

    fn boot_time() -> Option<f64> {
        let text = std::fs::read_to_string("/proc/stat").ok()?;
        text.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()
    }

    fn limit(resource: nix::sys::resource::Resource) -> Option<f64> {
        let (soft, _) = nix::sys::resource::getrlimit(resource).ok()?;
        Some(if soft == nix::sys::resource::RLIM_INFINITY { u64::MAX as f64 } else { soft as f64 })
    }
}

fn gauge(encoder: &mut DescriptorEncoder<'_>, name: &str, help: &str, value: Option<f64>) -> std::fmt::Result {
    let Some(value) = value else { return Ok(()) };
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        // After the command name: state is field 3 of the file, so index 0 here; utime and
        // stime are fields 14 and 15, starttime 22.
        let stat = Self::stat();
        let field = |n: usize| stat.as_ref().and_then(|f| f.get(n - 3)).and_then(|v| v.parse::<f64>().ok());
        if let (Some(user), Some(system)) = (field(14), field(15)) {
            let metric = ConstCounter::new((user + system) / USER_HZ);
            metric.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                metric.metric_type(),
            )?)?;
        }
        let open = std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count() as f64);
        gauge(&mut encoder, "process_open_fds", "Number of open file descriptors.", open)?;
        let max_fds = Self::limit(nix::sys::resource::Resource::RLIMIT_NOFILE);
        gauge(&mut encoder, "process_max_fds", "Maximum number of open file descriptors.", max_fds)?;
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let vm = Self::status_kib(&status, "VmSize:");
        gauge(&mut encoder, "process_virtual_memory_bytes", "Virtual memory size in bytes.", vm)?;
        let vm_max = Self::limit(nix::sys::resource::Resource::RLIMIT_AS);
        gauge(
            &mut encoder,
            "process_virtual_memory_max_bytes",
            "Maximum amount of virtual memory available in bytes.",
            vm_max,
        )?;
        let rss = Self::status_kib(&status, "VmRSS:");
        gauge(&mut encoder, "process_resident_memory_bytes", "Resident memory size in bytes.", rss)?;
        let start = field(22).zip(Self::boot_time()).map(|(ticks, boot)| boot + ticks / USER_HZ);
        gauge(
            &mut encoder,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            start,
        )
    }
}

/// The metrics port's handler: `/metrics` (the Prometheus text format, or OpenMetrics when
/// asked for), `/healthz` (and `/healthz/ping`: `ok`, as the apiserver healthz handler upstream
/// installs there), `/proxyMode` and `/configz` (the effective configuration, as upstream's).
pub(crate) fn handler(metrics: Arc<Metrics>, configz: Arc<str>) -> Handler {
    Arc::new(move |asked| match asked.path {
        "/metrics" if text_format::wants_openmetrics(asked.accept) => Reply {
            status: StatusCode::OK,
            content_type: text_format::OPENMETRICS_TEXT,
            headers: Vec::new(),
            body: metrics.encode(),
        },
        "/metrics" => Reply {
            status: StatusCode::OK,
            content_type: text_format::PROMETHEUS_TEXT,
            headers: Vec::new(),
            body: text_format::from_openmetrics(&metrics.encode()),
        },
        "/configz" if !configz.is_empty() => Reply::json(StatusCode::OK, configz.to_string()),
        "/healthz" | "/healthz/ping" => Reply::text(StatusCode::OK, "ok"),
        "/proxyMode" => Reply::text(StatusCode::OK, "nftables"),
        _ => Reply::text(StatusCode::NOT_FOUND, "404 page not found\n"),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;
    use crate::http::tests::{bounded, free_port, get_path, limits, withstands_hostile_clients};

    /// `/metrics` through the limited server, bound to 127.0.0.1 only, with `/healthz` beside
    /// it as upstream's metrics port has.
    #[tokio::test]
    async fn metrics_server_withstands_hostile_clients() {
        bounded(async {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
            let handle = tokio::runtime::Handle::current();
            let _stop =
                crate::http::start(&handle, addr, handler(Metrics::new(), Arc::from("")), limits()).expect("start");
            withstands_hostile_clients(addr, "/metrics", limits()).await;
            let metrics = get_path(addr, "/metrics").await.expect("metrics");
            assert!(metrics.contains("process_resident_memory_bytes"), "{metrics}");
            let mode = get_path(addr, "/proxyMode").await.expect("proxyMode");
            assert!(mode.ends_with("\r\n\r\nnftables"), "{mode}");
            let healthz = get_path(addr, "/healthz").await.expect("healthz");
            assert!(healthz.starts_with("HTTP/1.1 200") && healthz.ends_with("\r\n\r\nok"), "{healthz}");
        })
        .await
    }

    /// A family as exported: its type, the label names of its samples (`le` aside) and its
    /// histogram buckets.
    #[derive(Debug, Default)]
    pub(crate) struct Exported {
        pub kind: String,
        pub labels: BTreeSet<String>,
        pub buckets: Vec<f64>,
    }

    /// The families of a text exposition, by the name queries use (counters with `_total`).
    pub(crate) fn families(text: &str) -> BTreeMap<String, Exported> {
        let mut out: BTreeMap<String, Exported> = BTreeMap::new();
        let mut names: Vec<(String, String)> = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE line");
                let queried = if kind == "counter" { format!("{name}_total") } else { name.to_string() };
                names.push((name.to_string(), queried.clone()));
                out.insert(queried, Exported { kind: kind.to_string(), ..Exported::default() });
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let (sample, labels) = match line.split_once('{') {
                Some((name, rest)) => (name, rest.split_once('}').map_or("", |(l, _)| l)),
                None => (line.split_whitespace().next().unwrap_or(""), ""),
            };
            // The family whose name the sample extends the most.
            let Some((_, queried)) =
                names.iter().filter(|(n, _)| sample.starts_with(n.as_str())).max_by_key(|(n, _)| n.len())
            else {
                continue;
            };
            let family = out.get_mut(queried).expect("declared");
            for pair in labels.split("\",").filter(|p| !p.is_empty()) {
                let (key, value) = pair.split_once('=').expect("label");
                let value = value.trim_matches('"');
                if key == "le" {
                    if value != "+Inf"
                        && sample.ends_with("_bucket")
                        && !family.buckets.contains(&value.parse().unwrap())
                    {
                        family.buckets.push(value.parse().unwrap());
                    }
                } else {
                    family.labels.insert(key.to_string());
                }
            }
        }
        out
    }

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Buckets {
        None,
        /// `ExponentialBuckets(0.001, 2, 15)`.
        Sync,
        /// `MergeBuckets(LinearBuckets(0.25, 0.25, 2), LinearBuckets(1, 1, 59),
        /// LinearBuckets(60, 5, 12), LinearBuckets(120, 30, 7))`, with MergeBuckets' leading 0.
        NetworkProgramming,
    }

    impl Buckets {
        fn bounds(self) -> Vec<f64> {
            match self {
                Buckets::None => vec![],
                Buckets::Sync => (0..15).map(|i| 0.001 * 2f64.powi(i)).collect(),
                Buckets::NetworkProgramming => {
                    let mut b = vec![0.0, 0.25, 0.5];
                    b.extend((1..=59).map(f64::from));
                    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
                    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
                    b
                }
            }
        }
    }

    /// kube-proxy's metrics in nftables mode as upstream's `pkg/proxy/metrics/metrics.go`
    /// defines them (v1.37.2: the core list of `RegisterMetrics` plus its
    /// `case ProxyModeNFTables`, without the families of the alpha
    /// `KubeProxyNFTablesLocalhostNodePorts` gate, off by default), and the standard ones its `/metrics` carries beside them
    /// (component-base's `kubernetes_build_info`, the Prometheus process collector): the name
    /// as queried, type, label names and buckets. A rename, a retyping, a lost label or moved
    /// buckets fails here.
    const UPSTREAM: &[(&str, &str, &[&str], Buckets)] = &[
        ("kubeproxy_sync_proxy_rules_duration_seconds", "histogram", &["ip_family"], Buckets::Sync),
        ("kubeproxy_sync_full_proxy_rules_duration_seconds", "histogram", &["ip_family"], Buckets::Sync),
        ("kubeproxy_sync_partial_proxy_rules_duration_seconds", "histogram", &["ip_family"], Buckets::Sync),
        ("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "gauge", &["ip_family"], Buckets::None),
        ("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", "gauge", &["ip_family"], Buckets::None),
        ("kubeproxy_network_programming_duration_seconds", "histogram", &["ip_family"], Buckets::NetworkProgramming),
        ("kubeproxy_sync_proxy_rules_endpoint_changes_pending", "gauge", &[], Buckets::None),
        ("kubeproxy_sync_proxy_rules_endpoint_changes_total", "counter", &[], Buckets::None),
        ("kubeproxy_sync_proxy_rules_service_changes_pending", "gauge", &[], Buckets::None),
        ("kubeproxy_sync_proxy_rules_service_changes_total", "counter", &[], Buckets::None),
        ("kubeproxy_sync_proxy_rules_nftables_sync_failures_total", "counter", &["ip_family"], Buckets::None),
        ("kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total", "counter", &["ip_family"], Buckets::None),
        ("kubeproxy_proxy_healthz_total", "counter", &["code"], Buckets::None),
        ("kubeproxy_proxy_livez_total", "counter", &["code"], Buckets::None),
        (
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "gauge",
            &["ip_family", "traffic_policy"],
            Buckets::None,
        ),
        (
            "kubernetes_build_info",
            "gauge",
            &[
                "build_date",
                "compiler",
                "git_commit",
                "git_tree_state",
                "git_version",
                "go_version",
                "major",
                "minor",
                "platform",
            ],
            Buckets::None,
        ),
        ("process_cpu_seconds_total", "counter", &[], Buckets::None),
        ("process_open_fds", "gauge", &[], Buckets::None),
        ("process_max_fds", "gauge", &[], Buckets::None),
        ("process_virtual_memory_bytes", "gauge", &[], Buckets::None),
        ("process_virtual_memory_max_bytes", "gauge", &[], Buckets::None),
        ("process_resident_memory_bytes", "gauge", &[], Buckets::None),
        ("process_start_time_seconds", "gauge", &[], Buckets::None),
        ("kubeproxy_conntrack_reconciler_sync_duration_seconds", "histogram", &["ip_family"], Buckets::Sync),
        ("kubeproxy_conntrack_reconciler_deleted_entries_total", "counter", &["ip_family"], Buckets::None),
    ];

    /// A kernel with a connection to `a/web:http` and a rejected one to `a/gone:http`.
    #[derive(Debug)]
    struct OneOfEach;

    impl service_counters::CounterSource for OneOfEach {
        fn read(&self) -> Result<Vec<crate::netlink::CountedElement>, crate::netlink::NetlinkError> {
            let key = |ip: &str| {
                let ip = ip.parse().expect("ip");
                let key = [crate::nft::ast::Value::Addr(ip), Value::Proto(L4Proto::Tcp), Value::Port(80)];
                crate::nft::lower::encode_key(&key).to_vec()
            };
            let element = |set: &str, ip: &str, comment: &str, verdict| crate::netlink::CountedElement {
                family: IpFamily::V4,
                set: set.into(),
                key: key(ip),
                comment: Some(comment.into()),
                verdict,
                packets: 1,
            };
            Ok(vec![
                element("balanced-service-ips", "10.96.0.1", "a/web:http", None),
                element("no-endpoint-services", "10.96.0.2", "a/gone:http", Some(-4)),
            ])
        }
    }

    use crate::net::L4Proto;
    use crate::nft::ast::Value;

    /// A node where `check` finds one conflict.
    #[derive(Debug)]
    struct OneConflict;

    impl check_findings::FindingSource for OneConflict {
        fn severities(&self) -> Result<Vec<crate::check::Severity>, String> {
            Ok(vec![crate::check::Severity::Conflict])
        }
    }

    /// A registry with a sample in every family.
    fn populated() -> Arc<Metrics> {
        let m = Metrics::for_node(Some(Box::new(OneOfEach)), Box::new(OneConflict));
        let no_local = vec![(IpFamily::V4, NoLocalEndpoints { internal: 1, external: 0 })];
        let mut sample = SyncSample {
            families: vec![IpFamily::V4, IpFamily::V6],
            reason: "startup".into(),
            full: true,
            duration: Duration::from_millis(3),
            applied: Some(Applied { no_local, ..Applied::default() }),
        };
        m.synced(&sample);
        sample.full = false;
        m.synced(&sample);
        sample.applied = None;
        m.synced(&sample);
        m.queued();
        m.network_programmed(IpFamily::V6, Duration::from_millis(700));
        m.health_answered(false, StatusCode::OK);
        m.health_answered(true, StatusCode::SERVICE_UNAVAILABLE);
        // Nothing increments it: stale objects go in the sync's own transaction.
        m.cleanup_failures.get_or_create(&family_label(IpFamily::V4)).inc();
        m.rejected(ObjectKind::Service);
        m.conntrack.reconciled(IpFamily::V4, Duration::from_millis(3), 2);
        m
    }

    #[test]
    fn families_match_upstreams_list() {
        let exported = families(&populated().encode());
        for (name, kind, labels, buckets) in UPSTREAM {
            let Some(e) = exported.get(*name) else { panic!("{name} is not exported: {:?}", exported.keys()) };
            assert_eq!(e.kind, *kind, "{name}'s type");
            let want: BTreeSet<String> = labels.iter().map(|l| l.to_string()).collect();
            assert_eq!(e.labels, want, "{name}'s labels");
            assert_eq!(e.buckets, buckets.bounds(), "{name}'s buckets");
        }
        // Nothing under kube-proxy's prefixes that upstream does not have (a rename).
        let known: BTreeSet<&str> = UPSTREAM.iter().map(|(n, ..)| *n).collect();
        for name in exported.keys() {
            if name.starts_with("kubeproxy_") || name.starts_with("kubernetes_") || name.starts_with("process_") {
                assert!(known.contains(name.as_str()), "{name} is not one of upstream's metrics");
            }
        }
        let build = populated().encode();
        assert!(build.contains("compiler=\"rustc\""), "{build}");
    }

    /// docs/metrics.md lists every family the registry exports (as the Prometheus text format
    /// names them) with its type, and nothing else: the page is checked against the code.
    #[test]
    fn the_metrics_page_lists_exactly_what_is_exported() {
        let exported = families(&populated().encode());
        let page = include_str!("../docs/metrics.md");
        let mut documented: BTreeMap<String, String> = BTreeMap::new();
        for row in page.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`');
            if name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
                documented.insert(name.to_string(), cells[2].to_string());
            }
        }
        for (name, family) in &exported {
            let Some(kind) = documented.get(name) else {
                panic!("{name} ({}) is exported but not in docs/metrics.md", family.kind)
            };
            assert!(
                kind.starts_with(&family.kind),
                "docs/metrics.md gives {name} the type {kind:?}, the registry {:?}",
                family.kind
            );
        }
        for name in documented.keys() {
            assert!(exported.contains_key(name), "docs/metrics.md lists {name}, which is not exported");
        }
    }

    #[test]
    fn a_sync_is_recorded_per_family_and_process_metrics_are_read() {
        let text = populated().encode();
        for line in [
            "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"} 3",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 2",
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv6\"} 1",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\",ip_family=\"IPv4\"} 1",
            "kubeproxy_proxy_livez_total{code=\"503\"} 1",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"1.0\",ip_family=\"IPv6\"} 1",
            "nftproxy_syncs_total{reason=\"startup\",result=\"failure\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        let value = |name: &str| -> f64 {
            let line = text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        assert!(value("process_resident_memory_bytes") > 1e6);
        assert!(value("process_open_fds") >= 3.0);
        let start = value("process_start_time_seconds");
        assert!((now_seconds() - start).abs() < 24.0 * 3600.0 * 365.0 && start > 1.6e9, "{start}");
        assert!(value("process_cpu_seconds_total") >= 0.0);
    }

    #[test]
    fn the_metrics_port_answers_healthz_and_proxy_mode() {
        let h = handler(Metrics::new(), Arc::from(""));
        assert_eq!(h(&Asked::get("/proxyMode", "")).body, "nftables");
        assert_eq!(h(&Asked::get("/healthz", "")).body, "ok");
        assert_eq!(
            h(&Asked::get("/livez", "")).status,
            StatusCode::NOT_FOUND,
            "no /livez on the metrics port, as upstream"
        );
    }

    /// Metrics the dashboard may chart before the binary exports them: none now (the
    /// per-service counters of issue 16 were the last).
    const COMING: &[&str] = &[];

    #[test]
    fn per_service_counters_carry_the_dashboards_labels() {
        let exported = families(&populated().encode());
        let labels = |names: &[&str]| names.iter().map(|l| l.to_string()).collect::<BTreeSet<String>>();
        let service = ["namespace", "service", "port", "protocol", "ip_family"];
        let connections = &exported["nftproxy_service_connections_total"];
        assert_eq!((connections.kind.as_str(), &connections.labels), ("counter", &labels(&service)));
        let rejects = &exported["nftproxy_service_rejects_total"];
        let with_reason: Vec<&str> = service.iter().copied().chain(["reason"]).collect();
        assert_eq!((rejects.kind.as_str(), &rejects.labels), ("counter", &labels(&with_reason)));
        let text = populated().encode();
        assert!(
            text.contains(
                "nftproxy_service_connections_total{namespace=\"a\",service=\"web\",port=\"http\",protocol=\"TCP\",ip_family=\"IPv4\"} 1"
            ),
            "{text}"
        );
    }

    /// PromQL's functions, aggregations and keywords: the identifiers of a query that are not
    /// metrics.
    const PROMQL_WORDS: &[&str] = &[
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "topk",
        "bottomk",
        "quantile",
        "stddev",
        "stdvar",
        "group",
        "count_values",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "offset",
        "bool",
        "inf",
        "nan",
    ];

    /// The metric names a PromQL query reads: identifiers outside label matchers, ranges and
    /// strings that are neither a function call nor a keyword (nor the label list after
    /// `by`/`without`/`on`/`ignoring`).
    fn metric_names(expr: &str) -> Vec<String> {
        let chars: Vec<char> = expr.chars().collect();
        let mut out = Vec::new();
        let mut i = 0;
        let skip_to = |from: usize, close: char| {
            chars[from..].iter().position(|c| *c == close).map_or(chars.len(), |p| from + p + 1)
        };
        let mut labels_follow = false;
        while i < chars.len() {
            let c = chars[i];
            match c {
                '{' => i = skip_to(i, '}'),
                '[' => i = skip_to(i, ']'),
                '"' => i = skip_to(i + 1, '"'),
                '(' if labels_follow => {
                    i = skip_to(i, ')');
                    labels_follow = false;
                }
                '$' => {
                    i += 1;
                    while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                        i += 1;
                    }
                }
                c if c.is_ascii_digit() || c == '.' => {
                    while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                        i += 1;
                    }
                }
                c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                    let start = i;
                    while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':') {
                        i += 1;
                    }
                    let word: String = chars[start..i].iter().collect();
                    let next = chars[i..].iter().find(|c| !c.is_whitespace());
                    if matches!(word.as_str(), "by" | "without" | "on" | "ignoring" | "group_left" | "group_right") {
                        labels_follow = true;
                    } else if next != Some(&'(') && !PROMQL_WORDS.contains(&word.as_str()) {
                        out.push(word);
                    }
                }
                _ => i += 1,
            }
        }
        out
    }

    #[test]
    fn promql_metric_names_are_found() {
        let names = metric_names(
            r#"histogram_quantile(0.99, sum by (le, ip_family) (rate(a_bucket{x=~"$i", y="b c"}[$__rate_interval]))) / on(instance) b_total > 0"#,
        );
        assert_eq!(names, ["a_bucket", "b_total"]);
    }

    /// Every query of the Grafana dashboard in `deploy/` reads metrics the binary exports (or
    /// exactly the per-service counters in [`COMING`]).
    #[test]
    fn the_dashboards_queries_use_exported_metrics() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana-dashboard.json");
        let dashboard: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("JSON");
        let mut exported = BTreeSet::new();
        for (name, family) in families(&populated().encode()) {
            if family.kind == "histogram" {
                exported.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}")));
            }
            exported.insert(name);
        }
        let mut queries = Vec::new();
        let panels = dashboard["panels"].as_array().expect("panels");
        for panel in panels {
            for target in panel["targets"].as_array().into_iter().flatten() {
                queries.push(target["expr"].as_str().expect("expr").to_string());
            }
        }
        for var in dashboard["templating"]["list"].as_array().expect("templating") {
            if let Some(q) = var["query"]["query"].as_str() {
                // label_values(metric, label)
                let inner = q.strip_prefix("label_values(").and_then(|r| r.split(',').next()).expect("label_values");
                queries.push(inner.to_string());
            }
        }
        assert!(queries.len() >= 20, "{queries:?}");
        let mut coming_used = BTreeSet::new();
        for q in &queries {
            let names = metric_names(q);
            assert!(!names.is_empty(), "no metric in {q}");
            for name in names {
                if COMING.contains(&name.as_str()) {
                    assert!(!exported.contains(&name), "{name} is exported now: remove it from COMING");
                    coming_used.insert(name);
                } else {
                    assert!(
                        exported.contains(&name),
                        "the dashboard reads {name}, which nftproxy does not export: {q}"
                    );
                }
            }
        }
        assert_eq!(coming_used.len(), COMING.len(), "the dashboard charts every metric still coming");
        for name in ["nftproxy_service_connections_total", "nftproxy_service_rejects_total"] {
            assert!(queries.iter().any(|q| metric_names(q).contains(&name.to_string())), "the dashboard charts {name}");
        }
        for what in ["Drift", "Left-out", "Network programming", "Rejected", "New connections", "Sync latency"] {
            assert!(panels.iter().any(|p| p["title"].as_str().is_some_and(|t| t.contains(what))), "{what} panel");
        }
    }

    #[test]
    fn conntrack_reconciler_series_appear_with_their_first_pass() {
        let m = Metrics::new();
        assert!(!m.encode().contains("kubeproxy_conntrack_reconciler_deleted_entries_total{"));
        m.conntrack.reconciled(crate::net::IpFamily::V4, std::time::Duration::from_millis(3), 2);
        m.conntrack.reconciled(crate::net::IpFamily::V4, std::time::Duration::from_millis(20), 1);
        m.conntrack.reconciled(crate::net::IpFamily::V6, std::time::Duration::ZERO, 0);
        let text = m.encode();
        for line in [
            "kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv4\"} 3",
            "kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv6\"} 0",
            "kubeproxy_conntrack_reconciler_sync_duration_seconds_count{ip_family=\"IPv4\"} 2",
            "kubeproxy_conntrack_reconciler_sync_duration_seconds_bucket{le=\"0.004\",ip_family=\"IPv4\"} 1",
            "kubeproxy_conntrack_reconciler_sync_duration_seconds_bucket{le=\"16.384\",ip_family=\"IPv6\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        assert_eq!(handler(m, Arc::from(""))(&Asked::get("/proxyMode", "")).body, "nftables");
    }
}
