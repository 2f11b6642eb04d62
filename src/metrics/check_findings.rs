//! `nftproxy check` as a metric, `nftproxy_check_findings{severity}`: what a check of this
//! node's tables would report now, so that an alert can tell when something competes with
//! nftproxy's rules after the start — kube-proxy back beside it (a rollback, an installer's
//! upgrade writing its DaemonSet again), leftovers the takeover could not remove, a foreign
//! chain that drops or NATs service traffic at nftproxy's hooks.
//!
//! The check reads the tables over a socket of its own at scrape time (the syncer is not
//! involved), at most once per [`CACHE_FOR`] however many scrapers ask: it lists tables, chains
//! and base chains' rule counts, not the rules of regular chains.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::check::Severity;

/// How long one check answers scrapes.
pub(crate) const CACHE_FOR: Duration = Duration::from_secs(30);

/// Where findings come from: the kernel here, or a test's.
pub(crate) trait FindingSource: Send + Sync + fmt::Debug {
    /// The severity of every finding, or why the check could not run.
    fn severities(&self) -> Result<Vec<Severity>, String>;
}

/// The check of this network namespace's tables against nftproxy's `table`.
#[derive(Debug)]
pub(crate) struct KernelFindings {
    table: String,
}

impl KernelFindings {
    pub(crate) fn new(table: &str) -> KernelFindings {
        KernelFindings { table: table.to_string() }
    }
}

impl FindingSource for KernelFindings {
    fn severities(&self) -> Result<Vec<Severity>, String> {
        let report = crate::check::inspect(&self.table).map_err(|e| e.to_string())?;
        Ok(report.findings.iter().map(|f| f.severity).collect())
    }
}

/// Findings counted by severity: conflicts, warnings and notes.
type Counts = [(Severity, usize); 3];

/// The collector, with its cache.
#[derive(Debug)]
pub(crate) struct CheckFindings {
    source: Box<dyn FindingSource>,
    cache: Mutex<Option<(Instant, Option<Counts>)>>,
}

impl CheckFindings {
    pub(crate) fn new(source: Box<dyn FindingSource>) -> CheckFindings {
        CheckFindings { source, cache: Mutex::new(None) }
    }

    /// The counts, from the cache while it is fresh; `None` when the check could not run (the
    /// family is then left out, rather than reporting a clean node).
    fn counts(&self) -> Option<Counts> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, counts)) = *cache
            && at.elapsed() < CACHE_FOR
        {
            return counts;
        }
        let counts = match self.source.severities() {
            Ok(found) => Some(
                [Severity::Conflict, Severity::Warning, Severity::Info]
                    .map(|s| (s, found.iter().filter(|f| **f == s).count())),
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cannot check this node's tables for nftproxy_check_findings");
                None
            }
        };
        *cache = Some((Instant::now(), counts));
        counts
    }
}

impl Collector for CheckFindings {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let Some(counts) = self.counts() else { return Ok(()) };
        let mut family = encoder.encode_descriptor(
            "nftproxy_check_findings",
            "What `nftproxy check` finds on this node now (foreign tables and chains competing with nftproxy's, kube-proxy's rules or leftovers), by severity",
            None,
            MetricType::Gauge,
        )?;
        for (severity, n) in counts {
            let labels = [("severity", severity.metric_label())];
            ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX)).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[derive(Debug, Default)]
    struct Counting(Arc<AtomicUsize>);

    impl FindingSource for Counting {
        fn severities(&self) -> Result<Vec<Severity>, String> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(vec![Severity::Conflict, Severity::Info, Severity::Info])
        }
    }

    #[derive(Debug)]
    struct Failing;

    impl FindingSource for Failing {
        fn severities(&self) -> Result<Vec<Severity>, String> {
            Err("no netlink".into())
        }
    }

    fn scrape(c: CheckFindings) -> (String, CheckFindings) {
        let mut registry = prometheus_client::registry::Registry::default();
        let c = Arc::new(c);
        registry.register_collector(Box::new(Shared(Arc::clone(&c))));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        drop(registry);
        (out, Arc::into_inner(c).unwrap())
    }

    #[derive(Debug)]
    struct Shared(Arc<CheckFindings>);

    impl Collector for Shared {
        fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
            self.0.encode(encoder)
        }
    }

    #[test]
    fn findings_are_counted_by_severity_and_read_once_per_period() {
        let reads = Arc::new(AtomicUsize::new(0));
        let (text, c) = scrape(CheckFindings::new(Box::new(Counting(Arc::clone(&reads)))));
        assert!(text.contains("# TYPE nftproxy_check_findings gauge"), "{text}");
        assert!(text.contains("nftproxy_check_findings{severity=\"conflict\"} 1"), "{text}");
        assert!(text.contains("nftproxy_check_findings{severity=\"warning\"} 0"), "{text}");
        assert!(text.contains("nftproxy_check_findings{severity=\"info\"} 2"), "{text}");
        let (again, _) = scrape(c);
        assert_eq!(again, text);
        assert_eq!(reads.load(Ordering::SeqCst), 1, "the second scrape is answered from the cache");
    }

    #[test]
    fn a_check_that_cannot_run_leaves_the_family_out() {
        let (text, _) = scrape(CheckFindings::new(Box::new(Failing)));
        assert!(!text.contains("nftproxy_check_findings"), "{text}");
    }
}
