//! `nftproxy status`: fetches `/debug/services` from a running `nftproxy run` on its metrics
//! address and prints it for a person (or passes the JSON through).

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use thiserror::Error;

use crate::debug_services::{ANSWER_TIMEOUT, EndpointsReport, PATH, Selection, ServicePortReport, ServicesReport};

/// Endpoints printed per list; longer lists end with a count.
const ENDPOINTS_SHOWN: usize = 12;
/// The largest answer read (a document of 20,000 service ports is far below).
const MAX_BODY: u64 = 256 << 20;

/// Errors of `nftproxy status`.
#[derive(Debug, Error)]
pub enum StatusError {
    #[error(
        "cannot reach nftproxy's metrics server at {address}: {source} (is `nftproxy run` running here, with this --metrics-bind-address?)"
    )]
    Connect {
        address: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("http://{address}/debug/services answered {status}: {body}")]
    Http { address: SocketAddr, status: u16, body: String },
    #[error("cannot read the answer of http://{address}/debug/services: {source}")]
    Answer {
        address: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("http://{address}/debug/services sent JSON this version cannot read: {source}")]
    Json {
        address: SocketAddr,
        #[source]
        source: serde_json::Error,
    },
}

/// The raw JSON of `/debug/services` for a selection.
pub(crate) fn fetch(address: SocketAddr, selection: &Selection) -> Result<String, StatusError> {
    let connect = |source| StatusError::Connect { address, source };
    let answer = |source| StatusError::Answer { address, source };
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5)).map_err(connect)?;
    // The loop answers between syncs: allow for a long one.
    stream.set_read_timeout(Some(ANSWER_TIMEOUT + Duration::from_secs(5))).map_err(answer)?;
    let request =
        format!("GET {PATH}?{} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n", selection.to_query());
    stream.write_all(request.as_bytes()).map_err(answer)?;
    let mut raw = Vec::new();
    stream.take(MAX_BODY).read_to_end(&mut raw).map_err(answer)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse::<u16>().ok()).unwrap_or(0);
    if status != 200 {
        return Err(StatusError::Http { address, status, body: body.trim().to_string() });
    }
    Ok(body.to_string())
}

/// Parses the JSON `fetch` returned.
pub(crate) fn parse(address: SocketAddr, json: &str) -> Result<ServicesReport, StatusError> {
    serde_json::from_str(json).map_err(|source| StatusError::Json { address, source })
}

fn list(items: &[String]) -> String {
    let mut out = items.iter().take(ENDPOINTS_SHOWN).cloned().collect::<Vec<_>>().join(", ");
    if items.len() > ENDPOINTS_SHOWN {
        let _ = write!(out, " and {} more", items.len() - ENDPOINTS_SHOWN);
    }
    if out.is_empty() { "none".into() } else { out }
}

fn endpoints(e: &EndpointsReport) -> String {
    let mut parts = Vec::new();
    if let Some(c) = &e.cluster {
        let topology = if e.topology == "None" { String::new() } else { format!(" ({})", e.topology) };
        parts.push(format!("cluster{topology}: {}", list(c)));
    }
    if let Some(l) = &e.local {
        parts.push(format!("local: {}", list(l)));
    }
    format!("{} {}; {} known", e.family, parts.join("; "), e.known)
}

fn port(p: &ServicePortReport, out: &mut String) {
    let name = if p.port.is_empty() { p.service.clone() } else { format!("{}:{}", p.service, p.port) };
    let _ = writeln!(
        out,
        "{name}  {} {}{}",
        p.protocol,
        p.port_number,
        if p.state == "pending" { "  (pending: changed since the last sync)" } else { "" }
    );
    let mut addresses: Vec<String> = p.cluster_ips.iter().map(|ip| format!("ClusterIP {ip}")).collect();
    addresses.extend(p.external_ips.iter().map(|ip| format!("external IP {ip}")));
    addresses.extend(p.load_balancer_ips.iter().map(|ip| format!("load balancer {ip}")));
    addresses.extend(p.node_port.map(|n| format!("NodePort {n}")));
    let _ = writeln!(out, "  addresses  {}", addresses.join(", "));
    let mut policy = format!("internal {}", p.internal_traffic_policy);
    if let Some(e) = &p.external_traffic_policy {
        let _ = write!(policy, ", external {e}");
    }
    if !p.load_balancer_source_ranges.is_empty() {
        let _ = write!(policy, ", source ranges {}", p.load_balancer_source_ranges.join(" "));
    }
    if let Some(s) = p.session_affinity_seconds {
        let _ = write!(policy, ", affinity ClientIP {s}s");
    }
    if let Some(h) = p.health_check_node_port {
        let _ = write!(policy, ", health check on port {h}");
    }
    let _ = writeln!(out, "  policy     {policy}");
    for e in &p.endpoints {
        let _ = writeln!(out, "  endpoints  {}", endpoints(e));
    }
}

/// The document as text for a person.
pub(crate) fn to_text(r: &ServicesReport) -> String {
    let mut out = String::new();
    let owned = if r.owns_tables { "owned by this nftproxy" } else { "not owned" };
    let ready = if r.ready { "" } else { "; waiting for the first lists of Services and EndpointSlices" };
    let _ = writeln!(out, "node {}, tables {} ({owned}){ready}", r.node, r.table);
    match &r.last_sync {
        Some(s) => {
            let _ = write!(out, "last sync: {} at {} ({}, {}", s.result, s.at, s.kind, s.reason);
            if let Some(d) = s.duration_seconds {
                let _ = write!(out, ", {:.1} ms", d * 1000.0);
            }
            if let (Some(k), Some(m)) = (s.kernel_seconds, s.messages) {
                let _ = write!(out, ", kernel {:.1} ms, {m} messages", k * 1000.0);
            }
            if let Some(c) = s.services_changed {
                let _ = write!(out, ", {c} services changed");
            }
            let _ = writeln!(out, ")");
            if let Some(e) = &s.error {
                let _ = writeln!(out, "  error: {e}");
            }
        }
        None => {
            let _ = writeln!(out, "last sync: none yet");
        }
    }
    if let Some(n) = &r.node_port_addresses {
        let show = |a: &[String]| if a == ["local"] { "every local address".to_string() } else { list(a) };
        let _ = writeln!(out, "NodePort addresses: IPv4 {}; IPv6 {}", show(&n.ipv4), show(&n.ipv6));
    }
    let _ = writeln!(out);
    for p in &r.service_ports {
        port(p, &mut out);
    }
    if r.truncated {
        let _ = writeln!(
            out,
            "… {} of {} service ports shown (--limit, --namespace, --service for others)",
            r.service_ports.len(),
            r.service_ports_total
        );
    } else if r.service_ports.is_empty() {
        let _ = writeln!(out, "no service ports");
    }
    if !r.excluded.is_empty() {
        let _ = writeln!(out, "\nleft out (the kernel refused their rules; tried again when they change):");
        for e in &r.excluded {
            let _ = writeln!(out, "  {}: {}", e.service, e.reason);
        }
    }
    if !r.problems.is_empty() {
        let _ = writeln!(out, "\nproblems in objects (latest per object):");
        for p in &r.problems {
            let object = match &p.namespace {
                Some(ns) => format!("{} {ns}/{}", p.kind, p.name),
                None => format!("{} {}", p.kind, p.name),
            };
            let what = if p.object_skipped { "left out" } else { "ignored" };
            let field = if p.field.is_empty() { String::new() } else { format!("{} ", p.field) };
            let _ = writeln!(out, "  {object}: {field}{what}: {} ({})", p.reason, p.reported_at);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::debug_services::{Excluded, LastSync, NodePortAddresses, ProblemReport};

    #[test]
    fn a_document_reads_well() {
        let report = ServicesReport {
            node: "node1".into(),
            table: "nftproxy".into(),
            owns_tables: true,
            ready: true,
            last_sync: Some(LastSync {
                at: "2025-06-01T10:00:00Z".into(),
                reason: "changes".into(),
                kind: "partial".into(),
                result: "success".into(),
                error: None,
                duration_seconds: Some(0.0041),
                kernel_seconds: Some(0.0012),
                messages: Some(12),
                services_changed: Some(1),
            }),
            node_port_addresses: Some(NodePortAddresses {
                ipv4: vec!["192.168.50.2".into()],
                ipv6: vec!["local".into()],
            }),
            service_ports: vec![ServicePortReport {
                service: "default/web-lb".into(),
                port: "http".into(),
                protocol: "TCP".into(),
                port_number: 80,
                state: "programmed".into(),
                cluster_ips: vec!["10.96.0.40".parse().unwrap()],
                external_ips: vec![],
                load_balancer_ips: vec!["203.0.113.10".parse().unwrap()],
                load_balancer_source_ranges: vec![],
                node_port: Some(30081),
                internal_traffic_policy: "Cluster".into(),
                external_traffic_policy: Some("Local".into()),
                session_affinity_seconds: None,
                health_check_node_port: Some(32000),
                endpoints: vec![EndpointsReport {
                    family: "IPv4".into(),
                    known: 3,
                    cluster: Some((10..24).map(|i| format!("10.244.1.{i}:8080")).collect()),
                    local: Some(vec!["10.244.1.10:8080".into()]),
                    topology: "None".into(),
                }],
            }],
            service_ports_total: 2,
            truncated: true,
            excluded: vec![Excluded { service: "default/bad".into(), reason: "the kernel refused its rules".into() }],
            problems: vec![ProblemReport {
                kind: "Service".into(),
                namespace: Some("default".into()),
                name: "odd".into(),
                field: "spec.ports[1].port".into(),
                reason: "70000 is not a port".into(),
                object_skipped: false,
                reported_at: "2025-06-01T09:59:00Z".into(),
            }],
            build_seconds: 0.001,
        };
        let text = to_text(&report);
        for line in [
            "node node1, tables nftproxy (owned by this nftproxy)\n",
            "last sync: success at 2025-06-01T10:00:00Z (partial, changes, 4.1 ms, kernel 1.2 ms, 12 messages, 1 services changed)\n",
            "NodePort addresses: IPv4 192.168.50.2; IPv6 every local address\n",
            "default/web-lb:http  TCP 80\n",
            "  addresses  ClusterIP 10.96.0.40, load balancer 203.0.113.10, NodePort 30081\n",
            "  policy     internal Cluster, external Local, health check on port 32000\n",
            "  endpoints  IPv4 cluster: 10.244.1.10:8080, ",
            " and 2 more; local: 10.244.1.10:8080; 3 known\n",
            "… 1 of 2 service ports shown",
            "  default/bad: the kernel refused its rules\n",
            "  Service default/odd: spec.ports[1].port ignored: 70000 is not a port (2025-06-01T09:59:00Z)\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }
}
