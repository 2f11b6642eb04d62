//! Probes of a generated cluster, what each proxy did with them, what `nftproxy explain`
//! predicts, and how the three compare.

use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use nftproxy::net::L4Proto;

use super::generate::Scenario;
use super::lab::{self as rlab, Answer};

/// Who sends a probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Who {
    /// An outside client (192.168.50.100).
    Client,
    /// The other outside client (192.168.50.101), outside most source ranges.
    Client2,
    /// A pod on node1 (p1c).
    Pod,
    /// node1 itself.
    Node,
}

impl Who {
    /// The lab host's name.
    pub fn host(self) -> &'static str {
        match self {
            Who::Client => "client",
            Who::Client2 => "client2",
            Who::Pod => "p1c",
            Who::Node => "node1",
        }
    }

    /// The source address its connections start from.
    pub fn own(self) -> Ipv4Addr {
        match self {
            Who::Client => Ipv4Addr::new(192, 168, 50, 100),
            Who::Client2 => Ipv4Addr::new(192, 168, 50, 101),
            Who::Pod => rlab::PODS[2].ip,
            Who::Node => NODE1,
        }
    }

    fn text(self) -> &'static str {
        match self {
            Who::Client => "a client",
            Who::Client2 => "the other client",
            Who::Pod => "a pod",
            Who::Node => "the node",
        }
    }
}

/// node1's address on the wan (where NodePorts are probed).
pub const NODE1: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 2);

/// One probe: a connection's kind, from whom, to where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Stable across minimisation: `service:port check`.
    pub key: String,
    /// The kind of probe, a check name (as [`crate::differences::DELIBERATE`] lists them).
    pub check: String,
    pub who: Who,
    pub protocol: L4Proto,
    pub target: SocketAddrV4,
    /// The Service has ClientIP affinity: every answer must come from one endpoint.
    pub sticky: bool,
    /// Endpoints the Service has (selector Services: the pods it selects); past
    /// [`FULL_COVERAGE`] the proxies' answering sets are samples, not compared.
    pub endpoints: usize,
}

/// Whether a masquerade shows in the source an endpoint sees: from the node to an endpoint on
/// the other node, masquerading leaves the node's own address.
pub fn masquerade_observable(who: Who, endpoint: Ipv4Addr) -> bool {
    who != Who::Node || rlab::pod_of(endpoint).is_some_and(|p| p.node == "node1")
}

/// Service ports probed a Service (a Service with many ports: the first three and the last).
const PORTS_PROBED: usize = 4;

/// The probes of a scenario: each Service port at its ClusterIP (from a client, a pod and the
/// node), NodePort, external and load-balancer IPs (from a client, and from the other client
/// where source ranges apply), a port each Service does not serve, and addresses no Service
/// has.
pub fn probes(scenario: &Scenario) -> Vec<Probe> {
    let mut out = Vec::new();
    for s in &scenario.services {
        let Some(cluster_ip) = s.cluster_ip else { continue };
        let sticky = s.affinity_seconds.is_some();
        let endpoints = match s.selector {
            Some(sel) => rlab::PODS.iter().filter(|p| p.labels.contains(sel)).count(),
            None => s.endpoints.len(),
        };
        // The probing pod among the endpoints: it reaches itself (hairpin).
        let own = Who::Pod.own();
        let hairpin = match (s.selector, s.endpoints.iter().find(|e| e.ip == own)) {
            (Some(sel), _) if rlab::PODS[2].labels.contains(sel) => Some("a pod that is its own endpoint"),
            (None, Some(e)) if e.node.is_none() => Some("a pod that is its own endpoint without a nodeName"),
            (None, Some(_)) => Some("a pod that is its own endpoint"),
            _ => None,
        };
        let ports: Vec<_> = if s.ports.len() > PORTS_PROBED {
            s.ports.iter().take(PORTS_PROBED - 1).chain(s.ports.last()).collect()
        } else {
            s.ports.iter().collect()
        };
        for p in ports {
            let proto = p.protocol.name();
            let mut add = |check: String, who: Who, target: SocketAddrV4| {
                out.push(Probe {
                    key: format!("{}:{} {check}", s.name, p.name),
                    check,
                    who,
                    protocol: p.protocol,
                    target,
                    sticky,
                    endpoints,
                });
            };
            for who in [Who::Client, Who::Pod, Who::Node] {
                let from = match (who, &hairpin) {
                    (Who::Pod, Some(text)) => text,
                    _ => who.text(),
                };
                add(format!("ClusterIP {proto} from {from}"), who, SocketAddrV4::new(cluster_ip, p.port));
            }
            if let Some(np) = p.node_port {
                add(format!("NodePort {proto} from a client"), Who::Client, SocketAddrV4::new(NODE1, np));
            }
            for ip in &s.external_ips {
                add(format!("external IP {proto} from a client"), Who::Client, SocketAddrV4::new(*ip, p.port));
            }
            for ip in &s.lb_ingress {
                add(format!("load-balancer IP {proto} from a client"), Who::Client, SocketAddrV4::new(*ip, p.port));
                if !s.source_ranges.is_empty() {
                    add(
                        format!("load-balancer IP {proto} from the other client"),
                        Who::Client2,
                        SocketAddrV4::new(*ip, p.port),
                    );
                }
            }
        }
        let unserved = (1..).find(|n| !s.ports.iter().any(|p| p.port == *n && p.protocol == L4Proto::Tcp)).unwrap_or(1);
        out.push(Probe {
            key: format!("{}:unserved ClusterIP, a port it does not serve", s.name),
            check: "ClusterIP, a port it does not serve".into(),
            who: Who::Client,
            protocol: L4Proto::Tcp,
            target: SocketAddrV4::new(cluster_ip, unserved),
            sticky: false,
            endpoints,
        });
    }
    let spare_node_port = if scenario.seed.is_multiple_of(2) { 32700 } else { 30001 };
    for (check, target) in [
        ("an unallocated ClusterIP", SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 200), 80)),
        ("an unassigned external IP", SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 5), 80)),
        ("an unallocated NodePort", SocketAddrV4::new(NODE1, spare_node_port)),
    ] {
        out.push(Probe {
            key: format!("- {check}"),
            check: check.into(),
            who: Who::Client,
            protocol: L4Proto::Tcp,
            target,
            sticky: false,
            endpoints: 0,
        });
    }
    out
}

/// What `explain` predicts for a probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prediction {
    /// DNATed to these endpoints (address → masqueraded).
    Dnat(BTreeMap<Ipv4Addr, bool>),
    /// Rejected.
    Reject,
    /// Dropped.
    Drop,
    /// Accepted untouched: not a Service's; the lab's routing decides (no answer).
    Accept,
    /// `explain` could not say (or failed): the text.
    Unknown(String),
}

impl Prediction {
    /// From `explain --output json`.
    pub fn from_json(text: &str) -> Prediction {
        let Ok(json) = serde_json::from_str::<serde_json::Value>(text) else {
            return Prediction::Unknown(format!("not JSON: {}", text.chars().take(300).collect::<String>()));
        };
        match json["verdict"].as_str() {
            Some("dnat") => {
                let mut endpoints = BTreeMap::new();
                for ep in json["endpoints"].as_array().into_iter().flatten() {
                    let address = ep["address"].as_str().unwrap_or("");
                    let ip = address.parse::<SocketAddr>().map(|a| a.ip()).or_else(|_| address.parse::<IpAddr>());
                    if let Ok(IpAddr::V4(ip)) = ip {
                        endpoints.insert(ip, ep["masquerade"].as_bool().unwrap_or(false));
                    }
                }
                Prediction::Dnat(endpoints)
            }
            Some("reject") => Prediction::Reject,
            Some("drop") => Prediction::Drop,
            Some("accept") => Prediction::Accept,
            other => Prediction::Unknown(format!("verdict {other:?}: {}", json["reason"])),
        }
    }

    /// Endpoints it names.
    pub fn endpoints(&self) -> usize {
        match self {
            Prediction::Dnat(e) => e.len(),
            _ => 0,
        }
    }
}

impl std::fmt::Display for Prediction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Prediction::Dnat(e) if e.len() > 8 => {
                let masq: BTreeSet<bool> = e.values().copied().collect();
                write!(f, "DNAT to {} endpoints, masquerade {masq:?}", e.len())
            }
            Prediction::Dnat(e) => write!(f, "DNAT to {e:?} (endpoint → masquerade)"),
            Prediction::Reject => f.write_str("reject"),
            Prediction::Drop => f.write_str("drop"),
            Prediction::Accept => f.write_str("accept (not a Service's)"),
            Prediction::Unknown(why) => write!(f, "unknown: {why}"),
        }
    }
}

/// Up to this many endpoints, the answering set must be every predicted endpoint (the probe
/// asks until it has seen them all); past it, a subset.
pub const FULL_COVERAGE: usize = 16;

/// What a proxy did with a probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Answered by these endpoints; the sources they saw were masqueraded (true) or not.
    Answered {
        endpoints: BTreeSet<Ipv4Addr>,
        masqueraded: BTreeSet<bool>,
    },
    /// Every answer from one endpoint (session affinity).
    Sticky {
        endpoint: Ipv4Addr,
        masqueraded: bool,
    },
    Refused,
    Dropped,
    /// From the node: the kernel refused to send (EPERM: dropped or rejected on output).
    Blocked,
    Other(String),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Answered { endpoints, masqueraded } if endpoints.len() > 8 => {
                write!(f, "answered by {} endpoints, masqueraded {masqueraded:?}", endpoints.len())
            }
            Outcome::Answered { endpoints, masqueraded } => {
                write!(f, "answered by {endpoints:?}, masqueraded {masqueraded:?}")
            }
            Outcome::Sticky { endpoint, masqueraded } => {
                write!(f, "sticky to {endpoint}, masqueraded {masqueraded}")
            }
            Outcome::Refused => f.write_str("refused"),
            Outcome::Dropped => f.write_str("dropped"),
            Outcome::Blocked => f.write_str("blocked on output (EPERM)"),
            Outcome::Other(s) => write!(f, "other: {s}"),
        }
    }
}

/// How long a probe waits for an answer before calling it dropped.
pub const TIMEOUT: Duration = Duration::from_millis(300);

/// Asks most: enough that 16 endpoints all answer, with room.
const MAX_ASKS: usize = 400;

/// Sends the probe from inside the sender's namespace (the caller's thread is there): asks
/// until every predicted endpoint answered (up to [`FULL_COVERAGE`] of them) or enough asks
/// were made; an error is asked once more.
pub fn send(probe: &Probe, predicted: &Prediction) -> Outcome {
    let target = SocketAddr::V4(probe.target);
    let want: BTreeSet<Ipv4Addr> = match predicted {
        Prediction::Dnat(e) if e.len() <= FULL_COVERAGE => e.keys().copied().collect(),
        _ => BTreeSet::new(),
    };
    let first_asks = match (probe.sticky, predicted) {
        (true, _) => 10,
        (false, Prediction::Dnat(e)) => (e.len().min(FULL_COVERAGE) * 4).clamp(8, 48),
        _ => 8,
    };
    let mut held = Vec::new();
    let mut answers: Vec<Answer> = Vec::new();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    let mut asked = 0;
    loop {
        let (answer, socket) = rlab::ask(probe.protocol, target, TIMEOUT);
        held.extend(socket);
        asked += 1;
        match answer {
            Ok(a) => answers.push(a),
            Err(e) => *errors.entry(error_kind(&e)).or_default() += 1,
        }
        if answers.is_empty() && asked >= 2 {
            break;
        }
        if asked < first_asks {
            continue;
        }
        if probe.sticky || !errors.is_empty() || want.is_empty() || asked >= MAX_ASKS {
            break;
        }
        // Until every predicted endpoint answered, unless one it did not predict did.
        let seen: BTreeSet<Ipv4Addr> = answers.iter().filter_map(|a| v4(a.reached)).collect();
        if want.is_subset(&seen) || !seen.is_subset(&want) {
            break;
        }
    }
    // One answer late among many on a loaded machine is not a drop: asked again, a path that
    // drops some connections shows it again.
    if answers.len() >= 4 && errors.len() == 1 && errors.get("timed out") == Some(&1) {
        let again: Vec<_> = (0..8).map(|_| rlab::ask(probe.protocol, target, TIMEOUT)).collect();
        if again.iter().all(|(a, _)| a.is_ok()) {
            errors.clear();
        }
        for (answer, socket) in again {
            held.extend(socket);
            if let Ok(a) = answer {
                answers.push(a);
            }
        }
    }
    drop(held);
    let own = probe.who.own();
    let endpoints: BTreeSet<Ipv4Addr> = answers.iter().filter_map(|a| v4(a.reached)).collect();
    let masqueraded: BTreeSet<bool> = answers
        .iter()
        .filter(|a| v4(a.reached).is_some_and(|e| masquerade_observable(probe.who, e)))
        .map(|a| a.source != IpAddr::V4(own))
        .collect();
    if answers.is_empty() {
        return match errors.keys().collect::<Vec<_>>().as_slice() {
            [e] if *e == "refused" => Outcome::Refused,
            [e] if *e == "timed out" => Outcome::Dropped,
            [e] if *e == "blocked" => Outcome::Blocked,
            _ => Outcome::Other(format!("{errors:?}")),
        };
    }
    if !errors.is_empty() {
        return Outcome::Other(format!("answered by {} endpoints, and failed {errors:?}", endpoints.len()));
    }
    if probe.sticky {
        return match (endpoints.len(), masqueraded.len()) {
            (1, 0 | 1) => Outcome::Sticky {
                endpoint: endpoints.iter().next().copied().unwrap_or(Ipv4Addr::UNSPECIFIED),
                masqueraded: masqueraded.contains(&true),
            },
            _ => Outcome::Other(format!("not sticky: {endpoints:?} masqueraded {masqueraded:?}")),
        };
    }
    Outcome::Answered { endpoints, masqueraded }
}

fn v4(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip.to_canonical() {
        IpAddr::V4(v4) => Some(v4),
        IpAddr::V6(_) => None,
    }
}

fn error_kind(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::ConnectionRefused | ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => "refused".into(),
        ErrorKind::TimedOut | ErrorKind::WouldBlock => "timed out".into(),
        ErrorKind::PermissionDenied => "blocked".into(),
        _ => e.to_string(),
    }
}

/// Whether an outcome is what the prediction says for the probe.
pub fn fits(probe: &Probe, outcome: &Outcome, predicted: &Prediction) -> bool {
    let observable = |e: &&Ipv4Addr| masquerade_observable(probe.who, **e);
    match (predicted, outcome) {
        (Prediction::Dnat(eps), Outcome::Answered { endpoints, masqueraded }) => {
            let inside = endpoints.iter().all(|e| eps.contains_key(e));
            let covered = eps.len() > FULL_COVERAGE || eps.keys().all(|e| endpoints.contains(e));
            let masq: BTreeSet<bool> =
                endpoints.iter().filter(observable).filter_map(|e| eps.get(e).copied()).collect();
            inside && covered && masq == *masqueraded
        }
        (Prediction::Dnat(eps), Outcome::Sticky { endpoint, masqueraded }) => {
            eps.get(endpoint) == Some(masqueraded) || (!observable(&endpoint) && eps.contains_key(endpoint))
        }
        (Prediction::Reject, Outcome::Refused) | (Prediction::Drop, Outcome::Dropped) => true,
        (Prediction::Reject | Prediction::Drop, Outcome::Blocked) => probe.who == Who::Node,
        (Prediction::Accept, Outcome::Refused | Outcome::Dropped) => true,
        _ => false,
    }
}

/// Whether the two proxies did the same (the answering sets of a Service with many endpoints
/// are samples and not compared: each must fit the prediction instead).
pub fn same(probe: &Probe, a: &Outcome, b: &Outcome) -> bool {
    match (a, b) {
        (
            Outcome::Answered { endpoints: ea, masqueraded: ma },
            Outcome::Answered { endpoints: eb, masqueraded: mb },
        ) => ma == mb && (ea == eb || probe.endpoints > FULL_COVERAGE),
        // Each picked its endpoint at random (and its masquerade with it): each must fit.
        (Outcome::Sticky { .. }, Outcome::Sticky { .. }) => true,
        (Outcome::Other(_), Outcome::Other(_)) => true,
        _ => a == b,
    }
}

/// How the three disagree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Disagreement {
    /// Both fit the prediction but not each other (a prediction that allows either).
    ProxiesOnly,
    /// nftproxy is not what upstream and explain say.
    Nftproxy,
    /// Upstream is not what nftproxy and explain say.
    Upstream,
    /// explain is wrong about both, which agree.
    Explain,
    /// All three differ.
    All,
}

impl Disagreement {
    /// Compares one probe's three answers; `None` when they agree.
    pub fn of(probe: &Probe, upstream: &Outcome, nftproxy: &Outcome, predicted: &Prediction) -> Option<Disagreement> {
        let (fu, fnp, s) =
            (fits(probe, upstream, predicted), fits(probe, nftproxy, predicted), same(probe, upstream, nftproxy));
        match (fu, fnp, s) {
            (true, true, true) => None,
            (true, true, false) => Some(Disagreement::ProxiesOnly),
            (true, false, _) => Some(Disagreement::Nftproxy),
            (false, true, _) => Some(Disagreement::Upstream),
            (false, false, true) => Some(Disagreement::Explain),
            (false, false, false) => Some(Disagreement::All),
        }
    }

    /// In words, after the check's name.
    pub fn text(self) -> &'static str {
        match self {
            Disagreement::ProxiesOnly => "nftproxy and kube-proxy differ (explain allows both)",
            Disagreement::Nftproxy => "nftproxy differs from kube-proxy and explain",
            Disagreement::Upstream => "nftproxy and explain differ from kube-proxy",
            Disagreement::Explain => "explain differs from both proxies",
            Disagreement::All => "all three differ",
        }
    }
}
