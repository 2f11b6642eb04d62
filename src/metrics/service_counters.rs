//! Per-service traffic counters (issue 16): new connections and rejects per service port,
//! counted in the kernel and read at scrape time.
//!
//! The dispatch sets and maps a new connection is classified in (`service-ips`, the
//! `balanced-…` sets, `service-nodeports`, `no-endpoint-services`, `no-endpoint-nodeports`) are
//! declared with `counter` (see [`SharedSet::counted`]): the kernel gives each element its own
//! counter and a match increments it. Those lookups are in nat chains, which see only the first
//! packet of a connection, so an element's packet count is the connections that matched it. A
//! scrape dumps those sets (at most once a second, however many scrapers ask) and sums the
//! elements of each service port: the element comment names it (`namespace/name:port`), the key
//! holds the protocol, the table's family is `ip_family`. Nothing comes from the syncer.
//!
//! An element deleted and added again (its verdict changed, its service port switched between
//! balanced and chained) starts from zero in the kernel; the collector keeps each series
//! monotonic by adding what each element gained since the last read (all of it when the
//! element is new or its count went down).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;

use crate::net::{IpFamily, L4Proto};
use crate::netlink::{CountedElement, Kernel, NetlinkError};
use crate::nft::ast::{Owner, SetShape};
use crate::plan::objects::SharedSet;

/// How long one read of the kernel's counters answers scrapes.
pub(crate) const CACHE_FOR: Duration = Duration::from_secs(1);

/// The netfilter verdict `drop` (`NF_DROP`).
const NF_DROP: i32 = 0;
/// The nftables verdict `goto` (`NFT_GOTO`).
const NFT_GOTO: i32 = -4;

/// Why a connection to a service port was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum RejectReason {
    /// The service port has no endpoints at all: rejected (ICMP port unreachable, TCP RST).
    NoEndpoints,
    /// It has endpoints, but none on this node for its `Local` traffic policy: dropped.
    NoLocalEndpoints,
}

impl RejectReason {
    /// The `reason` label value.
    pub(crate) fn label(self) -> &'static str {
        match self {
            RejectReason::NoEndpoints => "no_endpoints",
            RejectReason::NoLocalEndpoints => "no_local_endpoints",
        }
    }
}

/// Which family of counters a sample belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Counted {
    /// `nftproxy_service_connections_total`: sent to the service port's endpoints.
    Connections,
    /// `nftproxy_service_rejects_total`: rejected or dropped.
    Rejects(RejectReason),
}

/// One series: a service port in one family, and what is counted.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Series {
    pub counted: Counted,
    pub namespace: String,
    pub service: String,
    /// The Service port's name (empty for a Service's single unnamed port), as kube-proxy names
    /// service ports (`namespace/name:port`).
    pub port: String,
    pub protocol: L4Proto,
    pub family: IpFamily,
}

impl Series {
    fn labels(&self) -> Vec<(&'static str, String)> {
        let mut labels = vec![
            ("namespace", self.namespace.clone()),
            ("service", self.service.clone()),
            ("port", self.port.clone()),
            ("protocol", k8s_protocol(self.protocol).to_string()),
            ("ip_family", self.family.k8s_name().to_string()),
        ];
        if let Counted::Rejects(reason) = self.counted {
            labels.push(("reason", reason.label().to_string()));
        }
        labels
    }
}

/// Kubernetes' spelling of a protocol (`TCP`), as Services write it.
fn k8s_protocol(p: L4Proto) -> &'static str {
    match p {
        L4Proto::Tcp => "TCP",
        L4Proto::Udp => "UDP",
        L4Proto::Sctp => "SCTP",
    }
}

/// The names of the counted sets and maps.
pub(crate) fn counted_sets() -> Vec<String> {
    SharedSet::SERVICE_WRITTEN.into_iter().filter(|s| s.counted()).map(|s| s.name().into_owned()).collect()
}

/// The series a counted element adds to, or `None` for an element no service port owns, of a
/// set that is not counted, or whose key or verdict is not one nftproxy writes.
pub(crate) fn series_of(element: &CountedElement) -> Option<Series> {
    let set = SharedSet::from_name(&element.set).filter(|s| s.counted())?;
    let proto_at = match set.shape(element.family) {
        SetShape::ServiceVerdicts(IpFamily::V4) | SetShape::ServiceKeys(IpFamily::V4) => 4,
        SetShape::ServiceVerdicts(IpFamily::V6) | SetShape::ServiceKeys(IpFamily::V6) => 16,
        SetShape::PortVerdicts | SetShape::PortKeys => 0,
        _ => return None,
    };
    let protocol = L4Proto::from_number(*element.key.get(proto_at)?)?;
    let counted = match set {
        SharedSet::NoEndpointServices | SharedSet::NoEndpointNodeports => Counted::Rejects(match element.verdict? {
            NF_DROP => RejectReason::NoLocalEndpoints,
            NFT_GOTO => RejectReason::NoEndpoints,
            _ => return None,
        }),
        _ => Counted::Connections,
    };
    let Owner::ServicePort(owner) = Owner::from_comment(element.comment.as_deref()?) else { return None };
    Some(Series {
        counted,
        namespace: owner.service.namespace.clone(),
        service: owner.service.name.clone(),
        port: owner.port.clone(),
        protocol,
        family: element.family,
    })
}

/// Where the counters are read from.
pub(crate) trait CounterSource: fmt::Debug + Send + Sync {
    /// Every counted element now.
    fn read(&self) -> Result<Vec<CountedElement>, NetlinkError>;
}

/// nftproxy's tables (both families) in the kernel of the current network namespace.
#[derive(Debug)]
pub(crate) struct KernelCounters {
    table: String,
    sets: Vec<String>,
}

impl KernelCounters {
    /// The counters of nftproxy's tables named `table`.
    pub(crate) fn new(table: &str) -> KernelCounters {
        KernelCounters { table: table.to_string(), sets: counted_sets() }
    }
}

impl CounterSource for KernelCounters {
    fn read(&self) -> Result<Vec<CountedElement>, NetlinkError> {
        let sets: Vec<&str> = self.sets.iter().map(String::as_str).collect();
        let tables = [(IpFamily::V4, self.table.as_str()), (IpFamily::V6, self.table.as_str())];
        Kernel::open()?.read_counters(&tables, &sets)
    }
}

/// The totals as of the last read.
#[derive(Debug, Default)]
struct Totals {
    read_at: Option<Instant>,
    /// Each element's count at the last read, by family, set and key.
    last: HashMap<(IpFamily, Arc<str>, Vec<u8>), u64>,
    /// Monotonic totals of the series that have elements now.
    series: BTreeMap<Series, u64>,
    /// Whether the last read failed (then no series is exported until one succeeds).
    failed: bool,
}

impl Totals {
    /// Folds a read into the totals.
    fn update(&mut self, elements: Vec<CountedElement>) {
        let mut last = HashMap::with_capacity(elements.len());
        let mut present: BTreeMap<Series, u64> = BTreeMap::new();
        for element in elements {
            let Some(series) = series_of(&element) else { continue };
            let id = (element.family, element.set, element.key);
            let gained = match self.last.get(&id) {
                Some(before) if *before <= element.packets => element.packets - before,
                _ => element.packets,
            };
            last.insert(id, element.packets);
            let total = self.series.get(&series).copied().unwrap_or(0);
            *present.entry(series).or_insert(total) += gained;
        }
        self.last = last;
        self.series = present;
    }
}

/// The `prometheus_client` collector of the per-service counters.
#[derive(Debug)]
pub(crate) struct ServiceCounters {
    source: Box<dyn CounterSource>,
    totals: Mutex<Totals>,
}

impl ServiceCounters {
    /// A collector reading `source`.
    pub(crate) fn new(source: Box<dyn CounterSource>) -> ServiceCounters {
        ServiceCounters { source, totals: Mutex::new(Totals::default()) }
    }

    /// The series and their totals, read from the source unless a read less than
    /// [`CACHE_FOR`] ago answers (concurrent scrapes wait for one read).
    pub(crate) fn snapshot(&self) -> Option<Vec<(Series, u64)>> {
        let mut totals = self.totals.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let fresh = totals.read_at.is_some_and(|at| at.elapsed() < CACHE_FOR);
        if !fresh {
            // A dump of every counted set takes ~0.1 s at 10,000 services: off the async
            // workers, so /healthz and the health-check servers answer meanwhile.
            let read = || self.source.read();
            let multi_threaded = tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
            let result = if multi_threaded { tokio::task::block_in_place(read) } else { read() };
            match result {
                Ok(elements) => {
                    totals.update(elements);
                    totals.failed = false;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the per-service counters");
                    totals.failed = true;
                }
            }
            totals.read_at = Some(Instant::now());
        }
        (!totals.failed).then(|| totals.series.iter().map(|(s, n)| (s.clone(), *n)).collect())
    }
}

impl Collector for ServiceCounters {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        let Some(snapshot) = self.snapshot() else { return Ok(()) };
        let families = [
            (
                "nftproxy_service_connections",
                "New connections to a service port, counted where nftproxy classifies them (includes external connections a Local policy then drops)",
                false,
            ),
            (
                "nftproxy_service_rejects",
                "New connections to a service port rejected or dropped, by reason (no endpoints, or none local for a Local traffic policy)",
                true,
            ),
        ];
        for (name, help, rejects) in families {
            let mut samples = snapshot.iter().filter(|(s, _)| matches!(s.counted, Counted::Rejects(_)) == rejects);
            let Some(first) = samples.next() else { continue };
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (series, n) in std::iter::once(first).chain(samples) {
                let labels = series.labels();
                ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::nft::ast::Value;
    use crate::nft::lower::encode_key;

    fn element(
        family: IpFamily,
        set: &str,
        key: &[Value],
        comment: &str,
        verdict: Option<i32>,
        packets: u64,
    ) -> CountedElement {
        CountedElement {
            family,
            set: Arc::from(set),
            key: encode_key(key).to_vec(),
            comment: Some(Arc::from(comment)),
            verdict,
            packets,
        }
    }

    fn cluster_ip(ip: &str, proto: L4Proto, port: u16) -> Vec<Value> {
        vec![Value::Addr(ip.parse::<IpAddr>().expect("ip")), Value::Proto(proto), Value::Port(port)]
    }

    fn series(counted: Counted, ns: &str, svc: &str, port: &str, protocol: L4Proto, family: IpFamily) -> Series {
        Series { counted, namespace: ns.into(), service: svc.into(), port: port.into(), protocol, family }
    }

    #[test]
    fn elements_name_their_service_port_protocol_and_family() {
        let v4 = element(
            IpFamily::V4,
            "balanced-service-ips",
            &cluster_ip("10.96.0.10", L4Proto::Udp, 53),
            "kube-system/dns:dns",
            None,
            3,
        );
        assert_eq!(
            series_of(&v4),
            Some(series(Counted::Connections, "kube-system", "dns", "dns", L4Proto::Udp, IpFamily::V4))
        );
        let v6 =
            element(IpFamily::V6, "service-ips", &cluster_ip("fd00::10", L4Proto::Sctp, 9), "a/b", Some(NFT_GOTO), 1);
        assert_eq!(series_of(&v6), Some(series(Counted::Connections, "a", "b", "", L4Proto::Sctp, IpFamily::V6)));
        let nodeport = vec![Value::Proto(L4Proto::Tcp), Value::Port(30080)];
        let np = element(IpFamily::V4, "balanced-nodeports", &nodeport, "a/web:http", None, 1);
        assert_eq!(series_of(&np), Some(series(Counted::Connections, "a", "web", "http", L4Proto::Tcp, IpFamily::V4)));
    }

    #[test]
    fn the_verdict_of_a_no_endpoint_element_is_the_reason() {
        let key = cluster_ip("10.96.0.1", L4Proto::Tcp, 80);
        let rejected = element(IpFamily::V4, "no-endpoint-services", &key, "a/b:http", Some(NFT_GOTO), 1);
        let want = |r| Some(series(Counted::Rejects(r), "a", "b", "http", L4Proto::Tcp, IpFamily::V4));
        assert_eq!(series_of(&rejected), want(RejectReason::NoEndpoints));
        let dropped = element(IpFamily::V4, "no-endpoint-services", &key, "a/b:http", Some(NF_DROP), 1);
        assert_eq!(series_of(&dropped), want(RejectReason::NoLocalEndpoints));
        let accepted = element(IpFamily::V4, "no-endpoint-services", &key, "a/b:http", Some(1), 1);
        assert_eq!(series_of(&accepted), None);
        let nodeport = vec![Value::Proto(L4Proto::Tcp), Value::Port(30080)];
        let np = element(IpFamily::V4, "no-endpoint-nodeports", &nodeport, "a/b:http", Some(NFT_GOTO), 1);
        assert_eq!(series_of(&np).map(|s| s.counted), Some(Counted::Rejects(RejectReason::NoEndpoints)));
    }

    #[test]
    fn elements_nobody_owns_or_of_uncounted_sets_add_nothing() {
        let key = cluster_ip("10.96.0.1", L4Proto::Tcp, 80);
        assert_eq!(series_of(&element(IpFamily::V4, "service-ips", &key, "nftproxy", Some(NFT_GOTO), 1)), None);
        assert_eq!(series_of(&element(IpFamily::V4, "firewall-ips", &key, "a/b:http", Some(NFT_GOTO), 1)), None);
        assert_eq!(series_of(&element(IpFamily::V4, "no-such-set", &key, "a/b:http", None, 1)), None);
        let mut bad_proto = element(IpFamily::V4, "service-ips", &key, "a/b:http", Some(NFT_GOTO), 1);
        bad_proto.key[4] = 1;
        assert_eq!(series_of(&bad_proto), None);
    }

    #[test]
    fn totals_sum_a_service_ports_elements_and_survive_element_resets() {
        let web = |set: &str, ip: &str, packets| {
            element(IpFamily::V4, set, &cluster_ip(ip, L4Proto::Tcp, 80), "a/web:http", None, packets)
        };
        let mut totals = Totals::default();
        totals.update(vec![web("balanced-service-ips", "10.96.0.1", 5), web("balanced-external-ips", "192.0.2.1", 2)]);
        let key = series(Counted::Connections, "a", "web", "http", L4Proto::Tcp, IpFamily::V4);
        assert_eq!(totals.series.get(&key), Some(&7));
        // The ClusterIP element is re-added (counts from 0 again) and sees 1; the external one
        // gains 3.
        totals.update(vec![web("balanced-service-ips", "10.96.0.1", 1), web("balanced-external-ips", "192.0.2.1", 5)]);
        assert_eq!(totals.series.get(&key), Some(&11));
        // The port becomes chained: its ClusterIP element moves to `service-ips`, new, with 2.
        totals.update(vec![web("service-ips", "10.96.0.1", 2), web("balanced-external-ips", "192.0.2.1", 5)]);
        assert_eq!(totals.series.get(&key), Some(&13));
        // The Service is deleted: its series goes.
        totals.update(Vec::new());
        assert!(totals.series.is_empty());
    }

    /// A source answering `results` in turn (the last one again and again), counting reads.
    #[derive(Debug)]
    struct Scripted {
        results: Mutex<Vec<Result<Vec<CountedElement>, ()>>>,
        reads: Arc<AtomicUsize>,
    }

    impl CounterSource for Scripted {
        fn read(&self) -> Result<Vec<CountedElement>, NetlinkError> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            let mut results = self.results.lock().expect("lock");
            let next = if results.len() > 1 { results.remove(0) } else { results[0].clone() };
            next.map_err(|()| NetlinkError::Malformed("scripted failure"))
        }
    }

    #[test]
    fn a_read_answers_scrapes_for_a_second_and_a_failed_read_exports_nothing() {
        let key = cluster_ip("10.96.0.1", L4Proto::Tcp, 80);
        let one = element(IpFamily::V4, "no-endpoint-services", &key, "a/b:http", Some(NFT_GOTO), 4);
        let reads = Arc::new(AtomicUsize::new(0));
        let source = Scripted { results: Mutex::new(vec![Ok(vec![one]), Err(())]), reads: Arc::clone(&reads) };
        let counters = ServiceCounters::new(Box::new(source));
        let first = counters.snapshot().expect("read");
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].1, 4);
        assert_eq!(first[0].0.labels().last(), Some(&("reason", "no_endpoints".to_string())));
        assert_eq!(counters.snapshot(), Some(first));
        assert_eq!(reads.load(Ordering::SeqCst), 1, "the second scrape was answered from the first read");
        counters.totals.lock().expect("lock").read_at = Instant::now().checked_sub(CACHE_FOR);
        assert_eq!(counters.snapshot(), None);
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }
}
