//! What `/debug/services` answers, as types shared by the server (`agent::debug`, on the
//! metrics port) and its reader (`nftproxy status`): the JSON document, the query it takes,
//! and the route's limits.

use std::net::IpAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::model::{NamespacedName, ObjectKind};

/// The route.
pub(crate) const PATH: &str = "/debug/services";
/// Service ports described when the request does not say.
pub(crate) const DEFAULT_LIMIT: usize = 500;
/// Service ports described at most.
pub(crate) const MAX_LIMIT: usize = 20_000;
/// How long the server waits for the sync loop (which answers between syncs).
pub(crate) const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// The JSON document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ServicesReport {
    pub(crate) node: String,
    pub(crate) table: String,
    pub(crate) owns_tables: bool,
    /// Whether the first complete lists of Services and EndpointSlices have arrived.
    pub(crate) ready: bool,
    pub(crate) last_sync: Option<LastSync>,
    /// Where NodePorts are accepted, per family: addresses, or `["local"]` for every local one.
    pub(crate) node_port_addresses: Option<NodePortAddresses>,
    pub(crate) service_ports: Vec<ServicePortReport>,
    /// Service ports the request selects, described or not.
    pub(crate) service_ports_total: usize,
    /// Whether `servicePorts` stops short of `servicePortsTotal`.
    pub(crate) truncated: bool,
    /// Services the kernel refused, left out until they change.
    pub(crate) excluded: Vec<Excluded>,
    /// The latest problems of objects the sources left out or fields they ignored.
    pub(crate) problems: Vec<ProblemReport>,
    /// Seconds the loop took to build this document.
    pub(crate) build_seconds: f64,
}

/// The last sync.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct LastSync {
    /// RFC 3339, UTC.
    pub(crate) at: String,
    pub(crate) reason: String,
    /// `full` or `partial` (`full` for failures: the next sync is full).
    pub(crate) kind: String,
    /// `success` or `failure`.
    pub(crate) result: String,
    pub(crate) error: Option<String>,
    pub(crate) duration_seconds: Option<f64>,
    pub(crate) kernel_seconds: Option<f64>,
    pub(crate) messages: Option<usize>,
    pub(crate) services_changed: Option<usize>,
}

/// NodePort addresses per family.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct NodePortAddresses {
    pub(crate) ipv4: Vec<String>,
    pub(crate) ipv6: Vec<String>,
}

/// One service port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ServicePortReport {
    /// `namespace/name`.
    pub(crate) service: String,
    /// The port's name (empty for a single unnamed port).
    pub(crate) port: String,
    pub(crate) protocol: String,
    pub(crate) port_number: u16,
    /// `programmed`, or `pending` (changed since the last sync, described as it is now).
    pub(crate) state: String,
    #[serde(rename = "clusterIPs")]
    pub(crate) cluster_ips: Vec<IpAddr>,
    #[serde(rename = "externalIPs", default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) external_ips: Vec<IpAddr>,
    #[serde(rename = "loadBalancerIPs", default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) load_balancer_ips: Vec<IpAddr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) load_balancer_source_ranges: Vec<String>,
    pub(crate) node_port: Option<u16>,
    pub(crate) internal_traffic_policy: String,
    /// Only for ports reachable from outside (NodePort, external or load-balancer IPs).
    pub(crate) external_traffic_policy: Option<String>,
    /// ClientIP affinity timeout, when set.
    pub(crate) session_affinity_seconds: Option<u32>,
    pub(crate) health_check_node_port: Option<u16>,
    pub(crate) endpoints: Vec<EndpointsReport>,
}

/// A service port's endpoints in one family.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct EndpointsReport {
    /// `IPv4` or `IPv6`.
    pub(crate) family: String,
    /// Endpoints the EndpointSlices list, usable or not.
    pub(crate) known: usize,
    /// Cluster policy: where traffic goes (`null` when no traffic uses it).
    pub(crate) cluster: Option<Vec<String>>,
    /// Local policy: where traffic goes (`null` when no traffic uses it).
    pub(crate) local: Option<Vec<String>>,
    /// `None`, `PreferSameZone` or `PreferSameNode`: how topology hints narrowed `cluster`.
    pub(crate) topology: String,
}

/// A refused service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Excluded {
    pub(crate) service: String,
    pub(crate) reason: String,
}

/// One problem of one object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ProblemReport {
    pub(crate) kind: String,
    pub(crate) namespace: Option<String>,
    pub(crate) name: String,
    /// The field at fault; empty for the whole object.
    pub(crate) field: String,
    pub(crate) reason: String,
    /// Whether the whole object was left out (else only the field was ignored).
    pub(crate) object_skipped: bool,
    /// RFC 3339, UTC.
    pub(crate) reported_at: String,
}

/// What a request selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Selection {
    pub(crate) service: Option<NamespacedName>,
    pub(crate) namespace: Option<String>,
    pub(crate) limit: usize,
}

impl Selection {
    /// Parses `limit`, `namespace` and `service` from a query string.
    pub(crate) fn parse(query: &str) -> Result<Selection, String> {
        let mut s = Selection { service: None, namespace: None, limit: DEFAULT_LIMIT };
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = value.replace("%2F", "/").replace("%2f", "/");
            match key {
                "limit" => {
                    s.limit = value
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_LIMIT).contains(n))
                        .ok_or(format!("limit must be a number from 1 to {MAX_LIMIT}"))?
                }
                "namespace" if !value.is_empty() => s.namespace = Some(value),
                "service" => {
                    let (ns, name) = value
                        .split_once('/')
                        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
                        .ok_or("service must be NAMESPACE/NAME")?;
                    s.service = Some(NamespacedName::new(ns, name));
                }
                other => return Err(format!("unknown parameter {other:?} (limit, namespace, service)")),
            }
        }
        Ok(s)
    }

    /// The query string for this selection (what `nftproxy status` sends).
    pub(crate) fn to_query(&self) -> String {
        let mut parts = vec![format!("limit={}", self.limit)];
        if let Some(ns) = &self.namespace {
            parts.push(format!("namespace={ns}"));
        }
        if let Some(s) = &self.service {
            parts.push(format!("service={}/{}", s.namespace, s.name));
        }
        parts.join("&")
    }

    /// Whether a problem's object belongs to the selection: the Service itself, and its
    /// EndpointSlices by the name the EndpointSlice controller gives them (`<service>-…`).
    pub(crate) fn covers(&self, kind: ObjectKind, namespace: Option<&str>, name: &str) -> bool {
        if self.namespace.as_deref().is_some_and(|n| namespace != Some(n)) {
            return false;
        }
        self.service.as_ref().is_none_or(|s| {
            namespace == Some(s.namespace.as_str())
                && match kind {
                    ObjectKind::Service => name == s.name,
                    ObjectKind::EndpointSlice => name.strip_prefix(s.name.as_str()).is_some_and(|r| r.starts_with('-')),
                    ObjectKind::Node | ObjectKind::ServiceCidr => false,
                }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_parse_and_print() {
        assert_eq!(Selection::parse("").unwrap(), Selection { service: None, namespace: None, limit: DEFAULT_LIMIT });
        let s = Selection::parse("limit=3&service=default%2Fweb").unwrap();
        assert_eq!((s.limit, s.service.clone()), (3, Some(NamespacedName::new("default", "web"))));
        assert_eq!(Selection::parse(&s.to_query()).unwrap(), s);
        assert_eq!(Selection::parse("namespace=kube-system").unwrap().namespace.as_deref(), Some("kube-system"));
        for bad in ["limit=0", "limit=x", &format!("limit={}", MAX_LIMIT + 1), "service=web", "verbose=1"] {
            assert!(Selection::parse(bad).is_err(), "{bad}");
        }
    }
}
