//! Prometheus metrics, with kube-proxy's names where they apply (dashboards and alerts keep
//! working after a migration) and nftproxy's own under `nftproxy_`. Served as text at
//! `/metrics` on `--metrics-bind-address`, beside `/proxyMode` (which answers `nftables`).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{SystemTime, UNIX_EPOCH};

use hyper::StatusCode;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::health::http::{Handler, Reply};
use crate::reconcile::Synced;

type Labels = Vec<(String, String)>;

/// Every metric nftproxy exports.
pub struct Metrics {
    registry: Registry,
    pub sync_duration: Histogram,
    pub full_sync_duration: Histogram,
    pub partial_sync_duration: Histogram,
    pub last_sync_timestamp: Gauge<f64, AtomicU64>,
    pub last_queued_timestamp: Gauge<f64, AtomicU64>,
    pub network_programming: Histogram,
    pub endpoint_changes: Counter,
    pub endpoint_changes_pending: Gauge,
    pub service_changes: Counter,
    pub service_changes_pending: Gauge,
    pub sync_failures: Counter,
    pub no_local_endpoints: Family<Labels, Gauge>,
    pub conntrack_deleted: Counter,
    pub transaction_messages: Counter,
    pub kernel_duration: Histogram,
    pub drift_repairs: Counter,
    pub rejected_objects: Family<Labels, Counter>,
    pub syncs: Family<Labels, Counter>,
}

fn seconds_buckets() -> impl Iterator<Item = f64> {
    // 1 ms … ~16 s, as kube-proxy's sync histograms cover.
    exponential_buckets(0.001, 2.0, 15)
}

fn now_seconds() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl Metrics {
    /// A registry with every metric registered.
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::default();
        let m = Metrics {
            sync_duration: Histogram::new(seconds_buckets()),
            full_sync_duration: Histogram::new(seconds_buckets()),
            partial_sync_duration: Histogram::new(seconds_buckets()),
            last_sync_timestamp: Gauge::default(),
            last_queued_timestamp: Gauge::default(),
            network_programming: Histogram::new(exponential_buckets(0.01, 2.0, 16)),
            endpoint_changes: Counter::default(),
            endpoint_changes_pending: Gauge::default(),
            service_changes: Counter::default(),
            service_changes_pending: Gauge::default(),
            sync_failures: Counter::default(),
            no_local_endpoints: Family::default(),
            conntrack_deleted: Counter::default(),
            transaction_messages: Counter::default(),
            kernel_duration: Histogram::new(seconds_buckets()),
            drift_repairs: Counter::default(),
            rejected_objects: Family::default(),
            syncs: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "Sync latency (plan, diff and kernel) in seconds",
            m.sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "Full sync latency in seconds",
            m.full_sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "Partial sync latency in seconds",
            m.partial_sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time rules were successfully synced",
            m.last_sync_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync was queued",
            m.last_queued_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "Time from an endpoint change (last-change-trigger-time) to its rules being in the kernel",
            m.network_programming.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative EndpointSlice changes",
            m.endpoint_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending EndpointSlice changes",
            m.endpoint_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative Service changes",
            m.service_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending Service changes",
            m.service_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "Failed nftables transactions",
            m.sync_failures.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints",
            "Service ports with Local traffic policy and no local endpoints",
            m.no_local_endpoints.clone(),
        );
        registry.register(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Stale conntrack entries deleted",
            m.conntrack_deleted.clone(),
        );
        registry.register(
            "nftproxy_transaction_messages",
            "Netlink messages sent in nftables transactions",
            m.transaction_messages.clone(),
        );
        registry.register(
            "nftproxy_sync_kernel_duration_seconds",
            "Time the kernel took to process a transaction",
            m.kernel_duration.clone(),
        );
        registry.register(
            "nftproxy_drift_repairs",
            "Operations that repaired rules changed outside nftproxy",
            m.drift_repairs.clone(),
        );
        registry.register(
            "nftproxy_rejected_objects",
            "Objects (or fields) that could not be programmed, by kind",
            m.rejected_objects.clone(),
        );
        registry.register("nftproxy_syncs", "Syncs, by reason and result", m.syncs.clone());
        Arc::new(Metrics { registry, ..m })
    }

    /// Records a change waiting to be synced.
    pub fn queued(&self) {
        self.last_queued_timestamp.set(now_seconds());
    }

    /// Records a finished sync.
    pub fn synced(&self, result: Result<&Synced, &crate::reconcile::SyncError>, reason: &str) {
        let label = |k: &str, v: &str| (k.to_string(), v.to_string());
        match result {
            Ok(s) => {
                let secs = s.report.total.as_secs_f64();
                self.sync_duration.observe(secs);
                if s.report.full {
                    self.full_sync_duration.observe(secs);
                } else {
                    self.partial_sync_duration.observe(secs);
                }
                self.kernel_duration.observe(s.report.apply.kernel.as_secs_f64());
                self.transaction_messages.inc_by(s.report.apply.messages as u64);
                self.drift_repairs.inc_by(s.report.drift_repairs as u64);
                self.last_sync_timestamp.set(now_seconds());
                let stats = s.stats;
                self.no_local_endpoints
                    .get_or_create(&vec![label("traffic_policy", "internal")])
                    .set(stats.no_local_internal as i64);
                self.no_local_endpoints
                    .get_or_create(&vec![label("traffic_policy", "external")])
                    .set(stats.no_local_external as i64);
                self.syncs.get_or_create(&vec![label("reason", reason), label("result", "success")]).inc();
            }
            Err(_) => {
                self.sync_failures.inc();
                self.syncs.get_or_create(&vec![label("reason", reason), label("result", "failure")]).inc();
            }
        }
    }

    /// Counts an object or field that could not be programmed.
    pub fn rejected(&self, kind: &str) {
        self.rejected_objects.get_or_create(&vec![("kind".to_string(), kind.to_string())]).inc();
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// The `/metrics` and `/proxyMode` handler.
pub fn handler(metrics: Arc<Metrics>) -> Handler {
    Arc::new(move |_method, path| match path {
        "/metrics" => Reply {
            status: StatusCode::OK,
            content_type: "application/openmetrics-text; version=1.0.0; charset=utf-8",
            headers: Vec::new(),
            body: metrics.encode(),
        },
        "/proxyMode" => Reply::text(StatusCode::OK, "nftables"),
        _ => Reply::text(StatusCode::NOT_FOUND, "404 page not found\n"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::http::tests::{bounded, free_port, get_path, limits, withstands_hostile_clients};

    /// `/metrics` through the limited server, bound to 127.0.0.1 only.
    #[tokio::test]
    async fn metrics_server_withstands_hostile_clients() {
        bounded(async {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
            let handle = tokio::runtime::Handle::current();
            let _stop = crate::health::start(&handle, addr, handler(Metrics::new()), limits()).expect("start");
            withstands_hostile_clients(addr, "/metrics", limits()).await;
            let metrics = get_path(addr, "/metrics").await.expect("metrics");
            assert!(metrics.contains("kubeproxy_sync_proxy_rules_duration_seconds_bucket"), "{metrics}");
            let mode = get_path(addr, "/proxyMode").await.expect("proxyMode");
            assert!(mode.ends_with("\r\n\r\nnftables"), "{mode}");
        })
        .await
    }

    #[test]
    fn kube_proxy_names_are_exported() {
        let m = Metrics::new();
        m.sync_failures.inc();
        m.rejected("Service");
        let text = m.encode();
        for name in [
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_sum",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "kubeproxy_network_programming_duration_seconds_bucket",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total 1",
            "kubeproxy_conntrack_reconciler_deleted_entries_total",
            "nftproxy_drift_repairs_total",
            "nftproxy_rejected_objects_total{kind=\"Service\"} 1",
        ] {
            assert!(text.contains(name), "{name} missing:\n{text}");
        }
        assert_eq!(handler(m)("GET", "/proxyMode").body, "nftables");
    }
}
