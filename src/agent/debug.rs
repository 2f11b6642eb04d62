//! `/debug/services` on the metrics port (its document in [`crate::debug_services`]): every service port as programmed (addresses, the
//! endpoints each policy uses on this node, affinity, health-check port), the services the
//! kernel refused, the objects and fields the sources left out and why, and the last sync's
//! reason, duration and result, as JSON. `nftproxy status` prints it for a person.
//!
//! The syncer and the index live on the sync loop's thread, so the server hands each request to
//! the loop ([`DebugAnswerer`]), which answers between syncs; the server waits at most
//! [`ANSWER_TIMEOUT`] and serves one such request at a time. The answer is bounded:
//! `?limit=N` service ports (default [`DEFAULT_LIMIT`], at most [`MAX_LIMIT`]), the rest only
//! counted (`servicePortsTotal`, `truncated`); `?namespace=NS` and `?service=NS/NAME` select.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use hyper::StatusCode;

use super::problems::ProblemLog;
use crate::debug_services::{
    ANSWER_TIMEOUT, EndpointsReport, Excluded, LastSync, NodePortAddresses, PATH, ProblemReport, Selection,
    ServicePortReport, ServicesReport,
};
#[cfg(test)]
use crate::http::Asked;
use crate::http::{Handler, Reply};
use crate::index::{ClusterIndex, Update};
use crate::model::Problem;
use crate::net::IpFamily;
use crate::plan::NodePorts;
use crate::plan::endpoints::Topology;
use crate::sync::{PortState, StatusQuery, SyncError, SyncStatus, Synced, Syncer};

/// The sync loop's query for a selection.
fn status_query(selection: &Selection) -> StatusQuery {
    StatusQuery { service: selection.service.clone(), namespace: selection.namespace.clone(), limit: selection.limit }
}

/// One request, handed from the server to the sync loop.
pub(crate) struct Request {
    selection: Selection,
    answer: SyncSender<String>,
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// The sync loop's side: keeps what the JSON needs besides the syncer (problems, the last sync)
/// and answers requests between syncs.
pub(crate) struct DebugAnswerer {
    requests: Receiver<Request>,
    problems: ProblemLog,
    last_sync: Option<LastSync>,
}

impl DebugAnswerer {
    /// An answerer, and the sender the server hands requests to.
    pub(crate) fn new() -> (DebugAnswerer, Sender<Request>) {
        let (tx, rx) = mpsc::channel();
        (DebugAnswerer { requests: rx, problems: ProblemLog::default(), last_sync: None }, tx)
    }

    /// Problems a source reported.
    pub(crate) fn reported(&mut self, problems: &[Problem]) {
        self.problems.reported(problems, SystemTime::now());
    }

    /// An update a source sent.
    pub(crate) fn updated(&mut self, update: &Update) {
        self.problems.updated(update);
    }

    /// A sync finished.
    pub(crate) fn synced(&mut self, result: Result<&Synced, &SyncError>, reason: &str) {
        let at = rfc3339(SystemTime::now());
        self.last_sync = Some(match result {
            Ok(s) => LastSync {
                at,
                reason: reason.to_string(),
                kind: if s.report.full { "full" } else { "partial" }.into(),
                result: "success".into(),
                error: None,
                duration_seconds: Some(s.report.total.as_secs_f64()),
                kernel_seconds: Some(s.report.apply.kernel.as_secs_f64()),
                messages: Some(s.report.apply.messages),
                services_changed: Some(s.report.services_changed),
            },
            Err(e) => LastSync {
                at,
                reason: reason.to_string(),
                kind: "full".into(),
                result: "failure".into(),
                error: Some(e.to_string()),
                duration_seconds: None,
                kernel_seconds: None,
                messages: None,
                services_changed: None,
            },
        });
    }

    /// The objects the sources left out now, by kind.
    pub(crate) fn skipped_by_kind(&self) -> std::collections::BTreeMap<crate::model::ObjectKind, usize> {
        self.problems.skipped_by_kind()
    }

    /// Answers every waiting request.
    pub(crate) fn answer(&mut self, index: &ClusterIndex, syncer: &Syncer) {
        while let Ok(request) = self.requests.try_recv() {
            let report = self.report(index, syncer, &request.selection);
            let body = serde_json::to_string(&report).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
            let _ = request.answer.try_send(body);
        }
    }

    /// The document for a selection.
    pub(crate) fn report(&self, index: &ClusterIndex, syncer: &Syncer, selection: &Selection) -> ServicesReport {
        let started = Instant::now();
        let status = syncer.status(index.state(), &status_query(selection));
        let problems = self
            .problems
            .latest()
            .into_iter()
            .filter(|(o, _)| selection.covers(o.kind, o.namespace.as_deref(), &o.name))
            .flat_map(|(_, reported)| {
                reported.problems.iter().map(|p| ProblemReport {
                    kind: p.object.kind.name().to_string(),
                    namespace: p.object.namespace.clone(),
                    name: p.object.name.clone(),
                    field: p.field.clone(),
                    reason: p.reason.clone(),
                    object_skipped: p.object_skipped,
                    reported_at: rfc3339(reported.at),
                })
            })
            .collect();
        let mut report = document(status, self.last_sync.clone(), problems);
        report.ready = index.ready();
        report.build_seconds = started.elapsed().as_secs_f64();
        report
    }
}

fn addresses(n: &NodePorts) -> Vec<String> {
    match n {
        NodePorts::MatchAll => vec!["local".into()],
        NodePorts::Addresses(a) => a.iter().map(IpAddr::to_string).collect(),
    }
}

fn policy(local: bool) -> String {
    if local { "Local" } else { "Cluster" }.into()
}

/// The JSON of a status.
fn document(status: SyncStatus, last_sync: Option<LastSync>, problems: Vec<ProblemReport>) -> ServicesReport {
    let truncated = status.ports.len() < status.matched;
    let service_ports = status
        .ports
        .into_iter()
        .map(|p| {
            let sp = p.port;
            let endpoints = p
                .endpoints
                .into_iter()
                .map(|e| EndpointsReport {
                    family: match e.family {
                        IpFamily::V4 => "IPv4",
                        IpFamily::V6 => "IPv6",
                    }
                    .into(),
                    known: e.known,
                    cluster: e.cluster.map(|l| l.iter().map(|e| e.address()).collect()),
                    local: e.local.map(|l| l.iter().map(|e| e.address()).collect()),
                    topology: match e.topology {
                        Topology::None => "None",
                        Topology::PreferSameZone => "PreferSameZone",
                        Topology::PreferSameNode => "PreferSameNode",
                    }
                    .into(),
                })
                .collect();
            ServicePortReport {
                service: sp.name.service.to_string(),
                port: sp.name.port.clone(),
                protocol: sp.name.protocol.name().to_ascii_uppercase(),
                port_number: sp.port,
                state: match p.state {
                    PortState::Programmed => "programmed",
                    PortState::Pending => "pending",
                }
                .into(),
                external_traffic_policy: sp.externally_accessible().then(|| policy(sp.external_policy_local)),
                internal_traffic_policy: policy(sp.internal_policy_local),
                cluster_ips: sp.cluster_ips,
                external_ips: sp.external_ips,
                load_balancer_ips: sp.load_balancer_ips,
                load_balancer_source_ranges: sp.load_balancer_source_ranges.iter().map(|r| r.to_string()).collect(),
                node_port: sp.node_port,
                session_affinity_seconds: sp.session_affinity_secs,
                health_check_node_port: p.health_check_port,
                endpoints,
            }
        })
        .collect();
    ServicesReport {
        node: status.node,
        table: status.table,
        owns_tables: status.owns_tables,
        ready: false,
        last_sync,
        node_port_addresses: status
            .nodeports
            .map(|t| NodePortAddresses { ipv4: addresses(&t.v4), ipv6: addresses(&t.v6) }),
        service_ports,
        service_ports_total: status.matched,
        truncated,
        excluded: status
            .excluded
            .into_iter()
            .map(|(service, reason)| Excluded { service: service.to_string(), reason })
            .collect(),
        problems,
        build_seconds: 0.0,
    }
}

/// Waits for the loop's answer without stalling the server's other work: on the agent's
/// multi-threaded runtime the worker hands its tasks to another thread meanwhile.
fn wait(answer: &Receiver<String>) -> Option<String> {
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    let receive = || answer.recv_timeout(ANSWER_TIMEOUT).ok();
    if multi_thread { tokio::task::block_in_place(receive) } else { receive() }
}

/// `inner` with `/debug/services` added: requests go to the sync loop through `requests`.
pub(crate) fn with_route(inner: Handler, requests: Sender<Request>) -> Handler {
    let requests = Mutex::new(requests);
    let busy = Arc::new(AtomicBool::new(false));
    Arc::new(move |asked| {
        if asked.path != PATH {
            return inner(asked);
        }
        if asked.method != "GET" {
            return Reply::text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
        }
        let selection = match Selection::parse(asked.query) {
            Ok(s) => s,
            Err(e) => return Reply::text(StatusCode::BAD_REQUEST, format!("{e}\n")),
        };
        // One at a time: each is answered by the sync loop, which must get back to syncing.
        if busy.swap(true, Ordering::AcqRel) {
            return Reply::text(StatusCode::SERVICE_UNAVAILABLE, "another /debug/services request is being answered\n");
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let sent = requests.lock().map(|r| r.send(Request { selection, answer: tx }).is_ok()).unwrap_or(false);
        let answer = if sent { wait(&rx) } else { None };
        busy.store(false, Ordering::Release);
        match answer {
            Some(body) => Reply::json(StatusCode::OK, body),
            None => Reply::text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the sync loop did not answer within {}s (a long sync?); try again\n",
                    ANSWER_TIMEOUT.as_secs()
                ),
            ),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProxyConfig;
    use crate::index::Change;
    use crate::model::ObjectRef;
    use crate::model::{NamespacedName, ObjectKind};
    use crate::netlink::FakeNetfilter;
    use crate::nodeaddr::NodePortTargets;
    use crate::source::manifests;
    use crate::sync::SyncReason;
    use std::time::Duration;

    fn synced_proxy(yaml: &str) -> (ClusterIndex, Syncer) {
        let mut m = manifests::Manifests::default();
        manifests::load_text(std::path::Path::new("t.yaml"), yaml, &mut m);
        let (updates, problems) = m.into_updates("node1");
        assert!(problems.is_empty());
        let mut index = ClusterIndex::new();
        for u in updates {
            index.apply(u);
        }
        let nodeports = Box::new(|_: &ProxyConfig, _: Option<&crate::model::NodeInfo>| NodePortTargets {
            v4: NodePorts::Addresses(vec!["192.168.50.2".parse().unwrap()]),
            v6: NodePorts::MatchAll,
            loopback: Vec::new(),
        });
        let mut syncer = Syncer::new(ProxyConfig::new("node1"), Box::new(FakeNetfilter::new()), nodeports);
        let pending = index.take_pending();
        syncer.sync(index.state(), &pending, SyncReason::Startup, true).unwrap();
        (index, syncer)
    }

    const WEB: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.10"], nodeName: node1, conditions: {ready: true}}
"#;

    #[test]
    fn the_document_describes_ports_problems_and_the_last_sync() {
        let (index, syncer) = synced_proxy(WEB);
        let (mut answerer, tx) = DebugAnswerer::new();
        let problem = Problem {
            object: ObjectRef { kind: ObjectKind::Service, namespace: Some("default".into()), name: "bad".into() },
            field: "spec.ports[0].port".into(),
            reason: "out of range".into(),
            object_skipped: false,
        };
        answerer.reported(std::slice::from_ref(&problem));
        answerer.updated(&Update::Service(Change::Delete(NamespacedName::new("default", "bad"))));
        let selection = Selection { service: None, namespace: None, limit: 10 };
        let report = answerer.report(&index, &syncer, &selection);
        assert!(report.ready && report.last_sync.is_none());
        assert_eq!((report.service_ports_total, report.truncated), (1, false));
        let port = &report.service_ports[0];
        assert_eq!((port.service.as_str(), port.port.as_str(), port.protocol.as_str()), ("default/web", "http", "TCP"));
        assert_eq!((port.state.as_str(), port.node_port), ("programmed", Some(30080)));
        assert_eq!(port.external_traffic_policy.as_deref(), Some("Cluster"));
        assert_eq!(port.endpoints[0].cluster, Some(vec!["10.244.1.10:8080".to_string()]));
        assert_eq!(report.problems.len(), 1);
        assert_eq!(report.problems[0].field, "spec.ports[0].port");
        assert_eq!(
            report.node_port_addresses,
            Some(NodePortAddresses { ipv4: vec!["192.168.50.2".into()], ipv6: vec!["local".into()] })
        );
        // The JSON round-trips (what `nftproxy status` reads).
        let json = serde_json::to_string(&report).unwrap();
        assert!(json.contains("\"clusterIPs\":[\"10.96.0.10\"]"), "{json}");
        assert_eq!(serde_json::from_str::<ServicesReport>(&json).unwrap(), report);
        // Another namespace: nothing, not even the problem.
        let other = answerer.report(&index, &syncer, &Selection { namespace: Some("x".into()), ..selection.clone() });
        assert!(other.service_ports.is_empty() && other.problems.is_empty());
        // Requests through the channel.
        let (answer, rx) = mpsc::sync_channel(1);
        tx.send(Request { selection, answer }).unwrap();
        answerer.answer(&index, &syncer);
        let body = rx.try_recv().unwrap();
        assert!(body.starts_with("{\"node\":\"node1\""), "{body}");
    }

    #[test]
    fn the_route_hands_requests_to_the_loop_and_bounds_them() {
        let inner: Handler = Arc::new(|asked| Reply::text(StatusCode::OK, asked.path.to_string()));
        let (mut answerer, tx) = DebugAnswerer::new();
        let handler = with_route(inner, tx);
        assert_eq!(handler(&Asked::get("/metrics", "")).body, "/metrics");
        assert_eq!(handler(&Asked::get(PATH, "limit=0")).status, StatusCode::BAD_REQUEST);
        assert_eq!(handler(&Asked { method: "POST", ..Asked::get(PATH, "") }).status, StatusCode::METHOD_NOT_ALLOWED);
        let (index, syncer) = synced_proxy(WEB);
        let server = std::thread::spawn(move || handler(&Asked::get(PATH, "service=default/web")));
        // The loop answers between syncs.
        while !server.is_finished() {
            answerer.answer(&index, &syncer);
            std::thread::sleep(Duration::from_millis(10));
        }
        let reply = server.join().unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        let report: ServicesReport = serde_json::from_str(&reply.body).unwrap();
        assert_eq!(report.service_ports.len(), 1);
    }
}
