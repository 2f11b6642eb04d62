//! Health endpoints, with upstream kube-proxy's semantics.
//!
//! - `--healthz-bind-address` serves `/healthz` and `/livez`: healthy unless a change has waited
//!   longer than the health timeout (twice `--sync-period`) without being applied; `/healthz`
//!   also answers 503 while this node is being deleted.
//! - Every `externalTrafficPolicy: Local` LoadBalancer service gets an HTTP server on its
//!   `healthCheckNodePort` (on the node-port addresses): any path answers 200 when this node has
//!   local ready endpoints and the proxy is healthy, 503 otherwise, with a JSON body naming the
//!   service and the count. Load balancers use it to send traffic only to nodes with endpoints.

pub mod http;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use hyper::StatusCode;
use tokio::runtime::Handle;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::model::NamespacedName;
use crate::plan::{HealthCheck, NodePorts};
use http::{Handler, Limits, Reply};

#[derive(Debug)]
struct State {
    last_updated: Option<SystemTime>,
    oldest_pending: Option<Instant>,
    node_eligible: bool,
    services: BTreeMap<NamespacedName, usize>,
}

/// The proxy's health, shared by the sync loop and the servers.
#[derive(Debug)]
pub struct ProxyHealth {
    timeout: Duration,
    state: Mutex<State>,
}

/// A point-in-time view of [`ProxyHealth`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub healthy: bool,
    pub node_eligible: bool,
    pub last_updated: Option<SystemTime>,
}

impl ProxyHealth {
    /// Health that turns bad when a change waits longer than `timeout`.
    pub fn new(timeout: Duration) -> Arc<ProxyHealth> {
        Arc::new(ProxyHealth {
            timeout,
            state: Mutex::new(State {
                last_updated: None,
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
    pub fn queued(&self, at: Instant) {
        let mut s = self.lock();
        if s.oldest_pending.is_none() {
            s.oldest_pending = Some(at);
        }
    }

    /// A sync succeeded: nothing is pending, and these are the health-checked services.
    pub fn updated(&self, checks: &[HealthCheck]) {
        let mut s = self.lock();
        s.last_updated = Some(SystemTime::now());
        s.oldest_pending = None;
        s.services = checks.iter().map(|c| (c.service.clone(), c.local_endpoints)).collect();
    }

    /// Whether this node may receive traffic (false while its Node is being deleted).
    pub fn set_node_eligible(&self, eligible: bool) {
        self.lock().node_eligible = eligible;
    }

    /// The current status.
    pub fn status(&self, now: Instant) -> Status {
        let s = self.lock();
        let healthy = s.oldest_pending.is_none_or(|t| now.saturating_duration_since(t) < self.timeout);
        Status { healthy, node_eligible: s.node_eligible, last_updated: s.last_updated }
    }

    /// Local ready endpoints of a health-checked service, if it is one.
    pub fn local_endpoints(&self, service: &NamespacedName) -> Option<usize> {
        self.lock().services.get(service).copied()
    }
}

fn rfc3339(t: Option<SystemTime>) -> String {
    t.map(|t| humantime::format_rfc3339_millis(t).to_string()).unwrap_or_default()
}

/// The `/healthz` and `/livez` handler.
pub fn proxier_handler(health: Arc<ProxyHealth>) -> Handler {
    Arc::new(move |_method, path| {
        let status = health.status(Instant::now());
        let ok = match path {
            "/healthz" => status.healthy && status.node_eligible,
            "/livez" => status.healthy,
            _ => return Reply::text(StatusCode::NOT_FOUND, "404 page not found\n"),
        };
        let body = serde_json::json!({
            "lastUpdated": rfc3339(status.last_updated),
            "currentTime": rfc3339(Some(SystemTime::now())),
            "nodeEligible": status.node_eligible,
        })
        .to_string();
        Reply::json(if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, body)
    })
}

/// The handler of one service's health-check port.
pub fn service_handler(health: Arc<ProxyHealth>, service: NamespacedName) -> Handler {
    Arc::new(move |_method, _path| {
        let count = health.local_endpoints(&service).unwrap_or(0);
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

/// Starts a server for `handler` on `addr` in the runtime behind `rt`.
pub fn start(rt: &Handle, addr: SocketAddr, handler: Handler, limits: Limits) -> std::io::Result<watch::Sender<bool>> {
    let std_listener = http::bind(addr)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let _guard = rt.enter();
    let listener = tokio::net::TcpListener::from_std(std_listener)?;
    rt.spawn(http::serve(listener, handler, limits, stop_rx));
    Ok(stop_tx)
}

/// The health-check servers of Local-policy LoadBalancer services, kept in step with the plan.
pub struct ServiceHealthServers {
    rt: Handle,
    health: Arc<ProxyHealth>,
    limits: Limits,
    /// (service, port) → one stop switch per listening address.
    running: BTreeMap<(NamespacedName, u16), Vec<watch::Sender<bool>>>,
}

impl ServiceHealthServers {
    /// No servers yet.
    pub fn new(rt: Handle, health: Arc<ProxyHealth>, limits: Limits) -> ServiceHealthServers {
        ServiceHealthServers { rt, health, limits, running: BTreeMap::new() }
    }

    /// Ports currently served.
    pub fn ports(&self) -> Vec<u16> {
        self.running.keys().map(|(_, p)| *p).collect()
    }

    /// Opens servers for new checks and closes those of services that went away. Addresses are
    /// the node-port addresses (every address when NodePorts match all).
    pub fn sync(&mut self, checks: &[HealthCheck], v4: &NodePorts, v6: &NodePorts) {
        let wanted: BTreeMap<(NamespacedName, u16), ()> =
            checks.iter().map(|c| ((c.service.clone(), c.port), ())).collect();
        self.running.retain(|key, stops| {
            let keep = wanted.contains_key(key);
            if !keep {
                info!(service = %key.0, port = key.1, "closing health-check server");
                for s in stops.iter() {
                    let _ = s.send(true);
                }
            }
            keep
        });
        let addresses = listen_addresses(v4, v6);
        for (service, port) in wanted.into_keys() {
            if self.running.contains_key(&(service.clone(), port)) {
                continue;
            }
            let mut stops = Vec::new();
            for ip in &addresses {
                let handler = service_handler(Arc::clone(&self.health), service.clone());
                match start(&self.rt, SocketAddr::new(*ip, port), handler, self.limits) {
                    Ok(stop) => stops.push(stop),
                    Err(e) => {
                        warn!(service = %service, port, address = %ip, error = %e, "cannot open health-check server")
                    }
                }
            }
            info!(service = %service, port, addresses = addresses.len(), "health-check server open");
            self.running.insert((service, port), stops);
        }
    }
}

impl Drop for ServiceHealthServers {
    fn drop(&mut self) {
        for stops in self.running.values() {
            for s in stops {
                let _ = s.send(true);
            }
        }
    }
}

/// Where health-check servers listen: each node-port address, or everywhere (`[::]`, which also
/// takes IPv4) when NodePorts match every local address.
fn listen_addresses(v4: &NodePorts, v6: &NodePorts) -> Vec<IpAddr> {
    if matches!(v4, NodePorts::MatchAll) || matches!(v6, NodePorts::MatchAll) {
        return vec![IpAddr::V6(Ipv6Addr::UNSPECIFIED)];
    }
    let mut out = Vec::new();
    for np in [v4, v6] {
        if let NodePorts::Addresses(ips) = np {
            out.extend(ips.iter().copied());
        }
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthy_until_a_change_waits_too_long() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert!(h.status(t0).healthy, "nothing pending");
        h.queued(t0);
        assert!(h.status(t0 + Duration::from_secs(59)).healthy);
        assert!(!h.status(t0 + Duration::from_secs(61)).healthy);
        h.updated(&[]);
        assert!(h.status(t0 + Duration::from_secs(61)).healthy);
        assert!(h.status(t0).last_updated.is_some());
    }

    #[test]
    fn service_health_follows_local_endpoints() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        let svc = NamespacedName::new("ns", "lb");
        h.updated(&[HealthCheck { service: svc.clone(), port: 30000, local_endpoints: 2 }]);
        let reply = service_handler(Arc::clone(&h), svc.clone())("GET", "/anything");
        assert_eq!(reply.status, StatusCode::OK);
        let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        assert_eq!(body["localEndpoints"], 2);
        assert_eq!(body["service"]["name"], "lb");
        assert_eq!(body["serviceProxyHealthy"], true);
        h.updated(&[HealthCheck { service: svc.clone(), port: 30000, local_endpoints: 0 }]);
        assert_eq!(service_handler(Arc::clone(&h), svc)("GET", "/").status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn healthz_reports_node_eligibility_but_livez_does_not() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        h.set_node_eligible(false);
        let handler = proxier_handler(Arc::clone(&h));
        assert_eq!(handler("GET", "/healthz").status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(handler("GET", "/livez").status, StatusCode::OK);
        assert_eq!(handler("GET", "/other").status, StatusCode::NOT_FOUND);
    }
}
