//! Health endpoints, with upstream kube-proxy's semantics.
//!
//! - `--healthz-bind-address` serves `/healthz` and `/livez`: healthy unless a change has waited
//!   longer than the health timeout (twice `--sync-period`) without being applied; `/healthz`
//!   also answers 503 while this node is being deleted.
//! - Every `externalTrafficPolicy: Local` LoadBalancer service gets an HTTP server on its
//!   `healthCheckNodePort` (on the node-port addresses): any path answers 200 when this node has
//!   local ready endpoints and the proxy is healthy, 503 otherwise, with a JSON body naming the
//!   service and the count. Load balancers use it to send traffic only to nodes with endpoints.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use hyper::StatusCode;
use tokio::runtime::Handle;
use tokio::sync::watch;
use tracing::{error, info};

#[cfg(test)]
use crate::http::{Asked, start};
use crate::http::{Handler, Limits, Reply, start_on};
use crate::metrics::Metrics;
use crate::model::NamespacedName;
use crate::net::IpFamily;
use crate::plan::{HealthCheck, NodePorts};

#[derive(Debug)]
struct State {
    last_updated: Option<SystemTime>,
    /// The families the last sync programmed (upstream: one proxier each).
    families: Vec<IpFamily>,
    oldest_pending: Option<Instant>,
    node_eligible: bool,
    services: BTreeMap<NamespacedName, BTreeMap<IpFamily, usize>>,
}

/// The proxy's health, shared by the sync loop and the servers.
#[derive(Debug)]
pub(crate) struct ProxyHealth {
    timeout: Duration,
    state: Mutex<State>,
}

/// A point-in-time view of [`ProxyHealth`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Status {
    pub healthy: bool,
    pub node_eligible: bool,
    pub last_updated: Option<SystemTime>,
    pub families: Vec<IpFamily>,
}

impl ProxyHealth {
    /// Health that turns bad when a change waits longer than `timeout`.
    pub(crate) fn new(timeout: Duration) -> Arc<ProxyHealth> {
        Arc::new(ProxyHealth {
            timeout,
            state: Mutex::new(State {
                last_updated: None,
                families: Vec::new(),
                oldest_pending: None,
                node_eligible: true,
                services: BTreeMap::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A change arrived at `at` and is not applied yet.
    pub(crate) fn queued(&self, at: Instant) {
        let mut s = self.lock();
        if s.oldest_pending.is_none() {
            s.oldest_pending = Some(at);
        }
    }

    /// A sync of `families` succeeded: nothing is pending, and these are the health-checked
    /// services.
    pub(crate) fn updated(&self, families: &[IpFamily], checks: &[HealthCheck]) {
        let mut s = self.lock();
        s.last_updated = Some(SystemTime::now());
        s.families = families.to_vec();
        s.oldest_pending = None;
        s.services = checks.iter().map(|c| (c.service.clone(), c.local_endpoints.clone())).collect();
    }

    /// A sync of `families` succeeded and the health-checked services are the same as after
    /// the last one.
    pub(crate) fn synced(&self, families: &[IpFamily]) {
        let mut s = self.lock();
        s.last_updated = Some(SystemTime::now());
        s.families = families.to_vec();
        s.oldest_pending = None;
    }

    /// Whether this node may receive traffic (false while its Node is being deleted).
    pub(crate) fn set_node_eligible(&self, eligible: bool) {
        self.lock().node_eligible = eligible;
    }

    /// The current status.
    pub(crate) fn status(&self, now: Instant) -> Status {
        let s = self.lock();
        let healthy = s.oldest_pending.is_none_or(|t| now.saturating_duration_since(t) < self.timeout);
        Status { healthy, node_eligible: s.node_eligible, last_updated: s.last_updated, families: s.families.clone() }
    }

    /// Local ready endpoints in `family` of a health-checked service, if it is one.
    pub(crate) fn local_endpoints(&self, service: &NamespacedName, family: IpFamily) -> Option<usize> {
        self.lock().services.get(service).map(|counts| counts.get(&family).copied().unwrap_or(0))
    }
}

/// A time as Go's `time.Time` marshals it in UTC (RFC 3339 with nanoseconds, trailing zeros
/// dropped); `None` is Go's zero time.
fn go_time(t: Option<SystemTime>) -> String {
    let Some(t) = t else { return "0001-01-01T00:00:00Z".to_string() };
    let full = humantime::format_rfc3339_nanos(t).to_string();
    match full.split_once('.') {
        Some((seconds, fraction)) => {
            let digits = fraction.trim_end_matches('Z').trim_end_matches('0');
            if digits.is_empty() { format!("{seconds}Z") } else { format!("{seconds}.{digits}Z") }
        }
        None => full,
    }
}

/// One family's entry of `status` (upstream's `ProxierHealth`).
#[derive(serde::Serialize)]
struct ProxierHealthBody {
    #[serde(rename = "lastUpdated")]
    last_updated: String,
    healthy: bool,
}

/// `/healthz` and `/livez`'s body, field for field as upstream's `ProxyHealth` marshals it.
#[derive(serde::Serialize)]
struct ProxyHealthBody {
    #[serde(rename = "lastUpdated")]
    last_updated: String,
    #[serde(rename = "currentTime")]
    current_time: String,
    #[serde(rename = "nodeEligible", skip_serializing_if = "Option::is_none")]
    node_eligible: Option<bool>,
    healthy: bool,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    status: BTreeMap<&'static str, ProxierHealthBody>,
}

/// The body for `status` at `now`; `node_eligible` only for `/healthz`. A healthy answer's
/// `lastUpdated` is the current time, as upstream writes it.
fn health_body(status: &Status, now: SystemTime, node_eligible: Option<bool>, ok: bool) -> String {
    let family_status = status
        .families
        .iter()
        .map(|f| {
            let name = match f {
                IpFamily::V4 => "IPv4",
                IpFamily::V6 => "IPv6",
            };
            (name, ProxierHealthBody { last_updated: go_time(status.last_updated), healthy: status.healthy })
        })
        .collect();
    let body = ProxyHealthBody {
        last_updated: go_time(if ok { Some(now) } else { status.last_updated }),
        current_time: go_time(Some(now)),
        node_eligible,
        healthy: status.healthy,
        status: family_status,
    };
    serde_json::to_string(&body).unwrap_or_default()
}

/// The `/healthz` and `/livez` handler; each answer is counted in
/// `kubeproxy_proxy_healthz_total` / `kubeproxy_proxy_livez_total` by status code.
pub(crate) fn proxier_handler(health: Arc<ProxyHealth>, metrics: Arc<Metrics>) -> Handler {
    Arc::new(move |asked| {
        let status = health.status(Instant::now());
        let (ok, livez) = match asked.path {
            "/healthz" => (status.healthy && status.node_eligible, false),
            "/livez" => (status.healthy, true),
            _ => return Reply::text(StatusCode::NOT_FOUND, "404 page not found\n"),
        };
        let code = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        metrics.health_answered(livez, code);
        let eligible = (!livez).then_some(status.node_eligible);
        Reply::json(code, health_body(&status, SystemTime::now(), eligible, ok))
    })
}

/// The handler of one service's health-check port on an address of `family`: it reports that
/// family's local endpoints, as upstream's server of that family's proxier does.
pub(crate) fn service_handler(health: Arc<ProxyHealth>, service: NamespacedName, family: IpFamily) -> Handler {
    Arc::new(move |_| {
        let count = health.local_endpoints(&service, family).unwrap_or(0);
        let healthy = health.status(Instant::now()).healthy;
        let body = serde_json::to_string_pretty(&serde_json::json!({
            "service": {"namespace": service.namespace, "name": service.name},
            "localEndpoints": count,
            "serviceProxyHealthy": healthy,
        }))
        .unwrap_or_default();
        let status = if count > 0 && healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        let mut reply = Reply::json(status, body);
        reply.headers.push(("X-Load-Balancing-Endpoint-Weight", count.to_string()));
        reply
    })
}

/// A health-check node port that could not be opened (upstream's
/// `FailedToStartServiceHealthcheck`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HealthCheckBindFailure {
    pub service: NamespacedName,
    pub port: u16,
    pub address: IpAddr,
    pub error: String,
}

/// The health-check servers of Local-policy LoadBalancer services, kept in step with the plan:
/// one per service port and node-port address. When an address cannot be bound (its port taken,
/// even briefly by one of ours still closing), the service's other servers on that port are
/// closed too and all of them are tried again at the next sync, as upstream does; each failure
/// is returned so an Event can report it.
pub(crate) struct ServiceHealthServers {
    rt: Handle,
    health: Arc<ProxyHealth>,
    limits: Limits,
    /// (service, port) → the stop switch of the server on each address it listens on.
    running: BTreeMap<(NamespacedName, u16), BTreeMap<IpAddr, watch::Sender<bool>>>,
}

impl ServiceHealthServers {
    /// No servers yet.
    pub(crate) fn new(rt: Handle, health: Arc<ProxyHealth>, limits: Limits) -> ServiceHealthServers {
        ServiceHealthServers { rt, health, limits, running: BTreeMap::new() }
    }

    /// Ports served on at least one address.
    #[cfg(test)]
    fn ports(&self) -> Vec<u16> {
        self.running.iter().filter(|(_, servers)| !servers.is_empty()).map(|((_, port), _)| *port).collect()
    }

    /// Opens servers for new checks and new addresses, and closes those of services that went
    /// away and of former addresses. Addresses are the node-port addresses of the service's
    /// families and the `loopback` addresses inside their ranges (the family's wildcard when
    /// its NodePorts match all), as upstream's per-family health-check servers have them.
    pub(crate) fn sync(
        &mut self,
        checks: &[HealthCheck],
        v4: &NodePorts,
        v6: &NodePorts,
        loopback: &[IpAddr],
    ) -> Vec<HealthCheckBindFailure> {
        let mut failures = Vec::new();
        let wanted: BTreeMap<(NamespacedName, u16), Vec<IpAddr>> = checks
            .iter()
            .map(|c| ((c.service.clone(), c.port), listen_addresses(&c.families, v4, v6, loopback)))
            .collect();
        self.running.retain(|key, servers| {
            let addresses = wanted.get(key);
            let (service, port) = key;
            servers.retain(|ip, stop| {
                let stays = addresses.is_some_and(|a| a.contains(ip));
                if !stays {
                    info!(service = %service, port, address = %ip, "closing health-check server");
                    let _ = stop.send(true);
                }
                stays
            });
            addresses.is_some()
        });
        for ((service, port), addresses) in wanted {
            let servers = self.running.entry((service.clone(), port)).or_default();
            for ip in &addresses {
                if servers.contains_key(ip) {
                    continue;
                }
                let handler = service_handler(Arc::clone(&self.health), service.clone(), IpFamily::of(ip));
                let addr = SocketAddr::new(*ip, port);
                match health_check_listener(addr).and_then(|l| start_on(&self.rt, l, handler, self.limits)) {
                    Ok(stop) => {
                        info!(service = %service, port, address = %ip, "health-check server open");
                        servers.insert(*ip, stop);
                    }
                    Err(e) => {
                        error!(
                            service = %service, port, address = %ip, error = %e,
                            "failed to start healthcheck; closing the service's others and retrying at the next sync"
                        );
                        for (_, stop) in std::mem::take(servers) {
                            let _ = stop.send(true);
                        }
                        failures.push(HealthCheckBindFailure {
                            service: service.clone(),
                            port,
                            address: *ip,
                            error: e.to_string(),
                        });
                        break;
                    }
                }
            }
        }
        failures
    }
}

impl Drop for ServiceHealthServers {
    fn drop(&mut self) {
        for stop in self.running.values().flat_map(BTreeMap::values) {
            let _ = stop.send(true);
        }
    }
}

/// A non-blocking listener for a health-check server. An IPv6 socket takes IPv6 only (as
/// upstream's `tcp6` listeners), so that `[::]` does not also take IPv4 for a service that
/// may not have that family.
fn health_check_listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, bind, listen, setsockopt, socket, sockopt,
    };
    if addr.is_ipv4() {
        return crate::http::bind(addr);
    }
    let flags = SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK;
    let fd = socket(AddressFamily::Inet6, SockType::Stream, flags, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(addr))?;
    listen(&fd, Backlog::new(1024)?)?;
    Ok(std::net::TcpListener::from(fd))
}

/// Where a service's health-check servers listen, per family of the service: each node-port
/// address of the family and the loopback addresses inside its ranges, or the family's
/// wildcard (`0.0.0.0`, or `[::]` for IPv6 only) when its NodePorts match every local address.
fn listen_addresses(families: &[IpFamily], v4: &NodePorts, v6: &NodePorts, loopback: &[IpAddr]) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for family in families {
        let (nodeports, any) = match family {
            IpFamily::V4 => (v4, IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
            IpFamily::V6 => (v6, IpAddr::V6(Ipv6Addr::UNSPECIFIED)),
        };
        match nodeports {
            NodePorts::MatchAll => out.push(any),
            NodePorts::Addresses(ips) => {
                out.extend(ips.iter().chain(loopback).copied().filter(|ip| IpFamily::of(ip) == *family));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::tests::{bounded, free_port, get_path, limits, withstands_hostile_clients};

    /// `/healthz` and `/livez` through the limited server, bound to 127.0.0.1 only.
    #[tokio::test]
    async fn healthz_server_withstands_hostile_clients() {
        bounded(async {
            let h = ProxyHealth::new(Duration::from_secs(60));
            let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
            let _stop = start(&Handle::current(), addr, proxier_handler(h, Metrics::new()), limits()).expect("start");
            withstands_hostile_clients(addr, "/healthz", limits()).await;
            let livez = get_path(addr, "/livez").await.expect("livez");
            assert!(livez.starts_with("HTTP/1.1 200"), "{livez}");
        })
        .await
    }

    /// A Local service's health-check server: on the node-port addresses only, limited, and
    /// closed when the service goes.
    #[tokio::test]
    async fn health_check_servers_listen_on_node_port_addresses_only() {
        bounded(async {
            let h = ProxyHealth::new(Duration::from_secs(60));
            let port = free_port();
            let checks = [HealthCheck {
                service: NamespacedName::new("ns", "lb"),
                port,
                local_endpoints: [(IpFamily::V4, 2)].into(),
                families: vec![IpFamily::V4],
            }];
            h.updated(&[], &checks);
            let mut servers = ServiceHealthServers::new(Handle::current(), h, limits());
            let v4 = NodePorts::Addresses(vec![IpAddr::from([127, 0, 0, 1])]);
            let v6 = NodePorts::Addresses(Vec::new());
            servers.sync(&checks, &v4, &v6, &[]);
            assert_eq!(servers.ports(), vec![port]);
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            withstands_hostile_clients(addr, "/", limits()).await;
            let response = get_path(addr, "/").await.expect("answer");
            assert!(response.to_ascii_lowercase().contains("x-load-balancing-endpoint-weight: 2"), "{response}");
            assert!(response.contains("\"localEndpoints\": 2"), "{response}");
            // The service goes: so does its server.
            servers.sync(&[], &v4, &v6, &[]);
            assert!(servers.ports().is_empty());
            stops_listening(addr).await;
        })
        .await
    }

    /// Upstream's health-check servers run per family (one per proxier): a service's server
    /// listens on its own families' node-port addresses, loopback ones included, or on the
    /// family's wildcard when that family's NodePorts match all.
    #[test]
    fn health_check_servers_listen_on_their_families_addresses() {
        let ips = |list: &[&str]| list.iter().map(|ip| ip.parse::<IpAddr>().unwrap()).collect::<Vec<_>>();
        let v4 = NodePorts::Addresses(ips(&["192.168.50.2"]));
        let v6 = NodePorts::Addresses(ips(&["fd00:50::2"]));
        let loopback = ips(&["127.0.0.1", "::1"]);
        let (only4, dual) = ([IpFamily::V4], [IpFamily::V4, IpFamily::V6]);
        assert_eq!(listen_addresses(&only4, &v4, &v6, &[]), ips(&["192.168.50.2"]));
        assert_eq!(listen_addresses(&dual, &v4, &v6, &[]), ips(&["192.168.50.2", "fd00:50::2"]));
        assert_eq!(listen_addresses(&only4, &v4, &v6, &loopback), ips(&["127.0.0.1", "192.168.50.2"]));
        let none = NodePorts::Addresses(Vec::new());
        assert_eq!(listen_addresses(&[IpFamily::V6], &v4, &none, &loopback), ips(&["::1"]));
        assert_eq!(listen_addresses(&only4, &NodePorts::MatchAll, &v6, &loopback), ips(&["0.0.0.0"]));
        assert_eq!(listen_addresses(&dual, &v4, &NodePorts::MatchAll, &[]), ips(&["192.168.50.2", "::"]));
    }

    /// An IPv6 health-check server on `[::]` takes IPv6 only, so that a port held on an IPv4
    /// address stays free for the IPv4 server of the same or another service.
    #[test]
    fn an_ipv6_wildcard_health_check_listener_leaves_ipv4_alone() {
        let v6 = health_check_listener(SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0))).expect("bind [::]");
        let port = v6.local_addr().expect("address").port();
        std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).expect("0.0.0.0 on the same port is free");
    }

    /// Waits until nothing listens on `addr` any more.
    async fn stops_listening(addr: SocketAddr) {
        let deadline = Instant::now() + Duration::from_secs(2);
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            assert!(Instant::now() < deadline, "still listening on {addr}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A port that cannot be bound is tried again at the next sync, and servers follow the
    /// node-port addresses when they change.
    #[tokio::test]
    async fn health_check_servers_retry_and_follow_addresses() {
        bounded(async {
            let h = ProxyHealth::new(Duration::from_secs(60));
            let port = free_port();
            let checks = [HealthCheck {
                service: NamespacedName::new("ns", "lb"),
                port,
                local_endpoints: [(IpFamily::V4, 1)].into(),
                families: vec![IpFamily::V4],
            }];
            h.updated(&[], &checks);
            let mut servers = ServiceHealthServers::new(Handle::current(), h, limits());
            let first = SocketAddr::from(([127, 0, 0, 1], port));
            let second = SocketAddr::from(([127, 0, 0, 2], port));
            let v6 = NodePorts::Addresses(Vec::new());
            let on = |addr: SocketAddr| NodePorts::Addresses(vec![addr.ip()]);
            let squatter = std::net::TcpListener::bind(first).expect("bind");
            let failures = servers.sync(&checks, &on(first), &v6, &[]);
            assert!(servers.ports().is_empty(), "opened on a taken port");
            assert_eq!(failures.len(), 1, "{failures:?}");
            assert_eq!((failures[0].service.name.as_str(), failures[0].port), ("lb", port));
            // Both addresses wanted, one taken: the service's other server is closed too.
            let both = NodePorts::Addresses(vec![first.ip(), second.ip()]);
            assert_eq!(servers.sync(&checks, &both, &v6, &[]).len(), 1);
            assert!(servers.ports().is_empty(), "a half-open service");
            stops_listening(second).await;
            drop(squatter);
            assert!(servers.sync(&checks, &on(first), &v6, &[]).is_empty());
            assert_eq!(servers.ports(), vec![port], "not retried");
            assert!(get_path(first, "/").await.expect("answer").starts_with("HTTP/1.1 200"));
            servers.sync(&checks, &on(second), &v6, &[]);
            stops_listening(first).await;
            assert!(get_path(second, "/").await.expect("answer").starts_with("HTTP/1.1 200"));
            drop(servers);
            stops_listening(second).await;
        })
        .await
    }

    #[test]
    fn healthy_until_a_change_waits_too_long() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert!(h.status(t0).healthy, "nothing pending");
        h.queued(t0);
        assert!(h.status(t0 + Duration::from_secs(59)).healthy);
        assert!(!h.status(t0 + Duration::from_secs(61)).healthy);
        h.updated(&[IpFamily::V4], &[]);
        assert!(h.status(t0 + Duration::from_secs(61)).healthy);
        assert!(h.status(t0).last_updated.is_some());
    }

    #[test]
    fn service_health_follows_local_endpoints() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        let svc = NamespacedName::new("ns", "lb");
        let check = |counts: &[(IpFamily, usize)], families: Vec<IpFamily>| HealthCheck {
            service: svc.clone(),
            port: 30000,
            local_endpoints: counts.iter().copied().collect(),
            families,
        };
        h.updated(&[], &[check(&[(IpFamily::V4, 2)], vec![IpFamily::V4])]);
        let reply = service_handler(Arc::clone(&h), svc.clone(), IpFamily::V4)(&Asked::get("/anything", ""));
        assert_eq!(reply.status, StatusCode::OK);
        let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        assert_eq!(body["localEndpoints"], 2);
        assert_eq!(body["service"]["name"], "lb");
        assert_eq!(body["serviceProxyHealthy"], true);
        h.updated(&[], &[check(&[(IpFamily::V4, 0)], vec![IpFamily::V4])]);
        let reply = service_handler(Arc::clone(&h), svc.clone(), IpFamily::V4)(&Asked::get("/", ""));
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        // Dual-stack with local pods in IPv4 only: each family's server reports its own count,
        // as upstream's per-family proxiers do.
        h.updated(&[], &[check(&[(IpFamily::V4, 1), (IpFamily::V6, 0)], vec![IpFamily::V4, IpFamily::V6])]);
        let v4 = service_handler(Arc::clone(&h), svc.clone(), IpFamily::V4)(&Asked::get("/", ""));
        let v6 = service_handler(Arc::clone(&h), svc, IpFamily::V6)(&Asked::get("/", ""));
        assert_eq!((v4.status, v6.status), (StatusCode::OK, StatusCode::SERVICE_UNAVAILABLE));
        let count =
            |reply: &Reply| serde_json::from_str::<serde_json::Value>(&reply.body).unwrap()["localEndpoints"].clone();
        assert_eq!((count(&v4), count(&v6)), (serde_json::json!(1), serde_json::json!(0)));
    }

    #[test]
    fn healthz_reports_node_eligibility_but_livez_does_not() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        h.set_node_eligible(false);
        let metrics = Metrics::new();
        let handler = proxier_handler(Arc::clone(&h), Arc::clone(&metrics));
        assert_eq!(handler(&Asked::get("/healthz", "")).status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(handler(&Asked::get("/livez", "")).status, StatusCode::OK);
        assert_eq!(handler(&Asked::get("/other", "")).status, StatusCode::NOT_FOUND);
        let text = metrics.encode();
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 1"), "{text}");
        assert!(text.contains("kubeproxy_proxy_livez_total{code=\"200\"} 1"), "{text}");
    }

    /// Upstream's `ProxyHealth` JSON: its fields in its order, `nodeEligible` on /healthz only,
    /// a status per family synced, Go's time format.
    #[test]
    fn health_bodies_are_upstreams_field_for_field() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        let handler = proxier_handler(Arc::clone(&h), Metrics::new());
        let before: serde_json::Value = serde_json::from_str(&handler(&Asked::get("/livez", "")).body).unwrap();
        assert!(before.get("status").is_none(), "no family synced yet: {before}");
        h.updated(&[IpFamily::V4, IpFamily::V6], &[]);
        let healthz = handler(&Asked::get("/healthz", "")).body;
        assert!(healthz.starts_with(r#"{"lastUpdated":""#), "{healthz}");
        let keys: Vec<&str> = healthz
            .match_indices("\":")
            .map(|(i, _)| {
                let start = healthz[..i].rfind('"').unwrap() + 1;
                &healthz[start..i]
            })
            .collect();
        assert_eq!(&keys[..4], ["lastUpdated", "currentTime", "nodeEligible", "healthy"], "{healthz}");
        let v: serde_json::Value = serde_json::from_str(&healthz).unwrap();
        assert_eq!(v["healthy"], true);
        assert_eq!(v["status"]["IPv4"]["healthy"], true);
        assert!(v["status"]["IPv6"]["lastUpdated"].as_str().unwrap().ends_with('Z'));
        let livez: serde_json::Value = serde_json::from_str(&handler(&Asked::get("/livez", "")).body).unwrap();
        assert!(livez.get("nodeEligible").is_none(), "{livez}");
        assert_eq!(go_time(None), "0001-01-01T00:00:00Z");
        let t = std::time::UNIX_EPOCH + Duration::from_millis(1_500);
        assert_eq!(go_time(Some(t)), "1970-01-01T00:00:01.5Z");
        assert_eq!(go_time(Some(std::time::UNIX_EPOCH + Duration::from_secs(2))), "1970-01-01T00:00:02Z");
    }

    /// A port that is taken is retried every period until it is free.
    #[tokio::test]
    async fn a_server_whose_port_is_taken_retries() {
        bounded(async {
            let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
            let squatter = std::net::TcpListener::bind(addr).expect("bind");
            let handler: Handler = Arc::new(|_| Reply::text(StatusCode::OK, "ok"));
            let _stop = crate::http::start_retrying(
                &Handle::current(),
                "test",
                addr,
                handler,
                limits(),
                Duration::from_millis(100),
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
            drop(squatter);
            let deadline = Instant::now() + Duration::from_secs(3);
            loop {
                if get_path(addr, "/").await.is_some_and(|r| r.ends_with("\r\n\r\nok")) {
                    break;
                }
                assert!(Instant::now() < deadline, "never bound after the port was freed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
    }
}
