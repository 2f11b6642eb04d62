//! A read-only view of what the syncer programmed, for `/debug/services`: every service port as
//! the last successful sync planned it — its addresses, the endpoints each traffic policy uses
//! on this node, affinity, the health-check port — and the services the kernel refused, with
//! why. Built from the syncer's records and nothing else; it changes nothing.

use std::collections::BTreeMap;

use super::programmed::Programmed;
use crate::config::ProxyConfig;
use crate::model::{ClusterState, Endpoint, NamespacedName, ServicePort};
use crate::net::IpFamily;
use crate::nodeaddr::NodePortTargets;
use crate::plan::endpoints::{NodeView, Topology, categorize};

/// Which services a status covers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatusQuery {
    /// Only this service.
    pub service: Option<NamespacedName>,
    /// Only this namespace.
    pub namespace: Option<String>,
    /// Service ports described at most; the rest are only counted.
    pub limit: usize,
}

impl StatusQuery {
    fn selects(&self, name: &NamespacedName) -> bool {
        self.service.as_ref().is_none_or(|s| s == name) && self.namespace.as_ref().is_none_or(|n| *n == name.namespace)
    }
}

/// Whether a service port is in the kernel as described.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// As the last successful sync programmed it.
    Programmed,
    /// Changed since (or never synced): described as the cluster has it now, programmed by the
    /// next sync.
    Pending,
}

/// The endpoints one service port uses in one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyEndpoints {
    pub family: IpFamily,
    /// Endpoints the EndpointSlices list for the port, usable or not.
    pub known: usize,
    /// What traffic under the Cluster policy is balanced to (`None`: no traffic uses it).
    pub cluster: Option<Vec<Endpoint>>,
    /// What traffic under the Local policy is balanced to (`None`: no traffic uses it).
    pub local: Option<Vec<Endpoint>>,
    /// How topology hints narrowed the cluster-wide list.
    pub topology: Topology,
}

/// One service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortStatus {
    pub port: ServicePort,
    pub state: PortState,
    pub endpoints: Vec<FamilyEndpoints>,
    /// The health-check server's port, when this node serves one for the service.
    pub health_check_port: Option<u16>,
}

/// What the syncer programmed, for the services a [`StatusQuery`] selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncStatus {
    pub node: String,
    pub table: String,
    /// Whether this process owns nftproxy's tables.
    pub owns_tables: bool,
    /// Whether the next sync is a full one (nothing programmed yet, or after a failure).
    pub needs_full_sync: bool,
    /// Where NodePorts are accepted, as last programmed.
    pub nodeports: Option<NodePortTargets>,
    /// The selected service ports, up to the query's limit, in service name order.
    pub ports: Vec<PortStatus>,
    /// Service ports the query selects, described or not.
    pub matched: usize,
    /// Services left out because the kernel refused their rules, and why.
    pub excluded: Vec<(NamespacedName, String)>,
}

/// What a status reads of the syncer's records.
pub(super) struct Records<'a> {
    pub config: &'a ProxyConfig,
    pub programmed: Option<&'a Programmed>,
    pub targets: &'a Option<NodePortTargets>,
    pub excluded: &'a BTreeMap<NamespacedName, String>,
    pub ownership: bool,
    pub needs_full_sync: bool,
}

impl Records<'_> {
    /// What is programmed for the services `query` selects, `state` being the cluster as the
    /// index holds it now (services changed since the last sync are described from it, and
    /// marked [`PortState::Pending`]).
    pub(super) fn status(&self, state: &ClusterState, query: &StatusQuery) -> SyncStatus {
        let mut ports = Vec::new();
        let mut matched = 0;
        for service in state.services().filter(|s| query.selects(&s.name) && !self.excluded.contains_key(&s.name)) {
            matched += service.ports.len();
            if ports.len() >= query.limit {
                continue;
            }
            let record = self.programmed.and_then(|p| p.service(&service.name));
            // The record shares its objects with the state it was planned from.
            let current = state.snapshot(&service.name);
            let unchanged = record.is_some_and(|r| r.state == current);
            let (planned, programmed) = match record.filter(|_| unchanged) {
                Some(r) => (r.state.to_state(), Some(r)),
                None => (current.to_state(), None),
            };
            let Some(info) = planned.service(&service.name) else { continue };
            let zone = planned.node().and_then(|n| n.zone());
            let node = NodeView { name: &self.config.hostname, zone };
            for port in info.ports.iter().take(query.limit - ports.len()) {
                let endpoints = IpFamily::ALL
                    .iter()
                    .filter(|f| port.cluster_ip(**f).is_some())
                    .map(|family| {
                        let known = planned.endpoints(&port.name, *family);
                        let c = categorize(&known, port, &node);
                        FamilyEndpoints {
                            family: *family,
                            known: known.len(),
                            cluster: port.uses_cluster_endpoints().then_some(c.cluster),
                            local: port.uses_local_endpoints().then_some(c.local),
                            topology: c.topology,
                        }
                    })
                    .collect();
                let (state, health_check_port) = match programmed {
                    Some(r) => (PortState::Programmed, r.health_check.as_ref().map(|h| h.port)),
                    None => (PortState::Pending, port.health_check_node_port.filter(|_| port.external_local())),
                };
                ports.push(PortStatus { port: port.clone(), state, endpoints, health_check_port });
            }
        }
        let excluded: BTreeMap<_, _> = self.excluded.iter().filter(|(n, _)| query.selects(n)).collect();
        SyncStatus {
            node: self.config.hostname.clone(),
            table: self.config.table.clone(),
            owns_tables: self.ownership,
            needs_full_sync: self.needs_full_sync,
            nodeports: self.targets.clone(),
            ports,
            matched,
            excluded: excluded.into_iter().map(|(n, why)| (n.clone(), why.clone())).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Pending;
    use crate::netlink::FakeNetfilter;
    use crate::plan::NodePorts;
    use crate::source::manifests;
    use crate::sync::{SyncReason, Syncer};

    fn state(yaml: &str) -> ClusterState {
        let mut m = manifests::Manifests::default();
        manifests::load_text(std::path::Path::new("t.yaml"), yaml, &mut m);
        let (state, problems) = m.into_state("node1");
        assert!(problems.is_empty(), "{problems:?}");
        state
    }

    fn syncer() -> Syncer {
        let nodeports = Box::new(|_: &ProxyConfig, _: Option<&crate::model::NodeInfo>| NodePortTargets {
            v4: NodePorts::Addresses(vec!["192.168.50.2".parse().unwrap()]),
            v6: NodePorts::Addresses(vec![]),
            loopback: Vec::new(),
        });
        Syncer::new(ProxyConfig::new("node1"), Box::new(FakeNetfilter::new()), nodeports)
    }

    fn service(name: &str, ip: &str, extra: &str, endpoints: &[(&str, &str)]) -> String {
        let eps: String = endpoints
            .iter()
            .map(|(ip, node)| format!("- {{addresses: [\"{ip}\"], nodeName: {node}, conditions: {{ready: true}}}}\n"))
            .collect();
        format!(
            r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  clusterIP: {ip}
{extra}  ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
{eps}---
"#
        )
    }

    fn sync(syncer: &mut Syncer, state: &ClusterState) {
        let all = Pending {
            services: state.services().map(|s| s.name.clone()).collect(),
            node_changed: true,
            ..Pending::default()
        };
        syncer.sync(state, &all, SyncReason::Startup, true).unwrap();
    }

    fn ips(endpoints: &Option<Vec<Endpoint>>) -> Option<Vec<String>> {
        endpoints.as_ref().map(|e| e.iter().map(Endpoint::address).collect())
    }

    #[test]
    fn every_policy_lists_the_endpoints_it_uses() {
        let yaml = [
            service("web", "10.96.0.10", "", &[("10.244.1.10", "node1"), ("10.244.2.10", "node2")]),
            service(
                "lb",
                "10.96.0.11",
                "  type: LoadBalancer\n  externalIPs: [203.0.113.7]\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n  sessionAffinity: ClientIP\n",
                &[("10.244.1.11", "node1"), ("10.244.2.11", "node2")],
            ),
        ]
        .concat()
            + "apiVersion: v1\nkind: Node\nmetadata: {name: node1}\n";
        let state = state(&yaml);
        let mut s = syncer();
        let before = s.status(&state, &StatusQuery { limit: 10, ..StatusQuery::default() });
        assert!(before.needs_full_sync);
        assert!(before.ports.iter().all(|p| p.state == PortState::Pending), "nothing synced yet");
        sync(&mut s, &state);
        let status = s.status(&state, &StatusQuery { limit: 10, ..StatusQuery::default() });
        assert_eq!(status.matched, 2);
        assert!(!status.needs_full_sync);
        let lb = &status.ports[0];
        assert_eq!(lb.port.name.to_string(), "default/lb:http");
        assert_eq!(lb.state, PortState::Programmed);
        assert_eq!(lb.port.session_affinity_secs, Some(10800));
        assert_eq!(lb.health_check_port, Some(32000));
        let v4 = &lb.endpoints[0];
        assert_eq!(v4.known, 2);
        assert_eq!(ips(&v4.cluster), Some(vec!["10.244.1.11:8080".into(), "10.244.2.11:8080".into()]));
        assert_eq!(ips(&v4.local), Some(vec!["10.244.1.11:8080".into()]), "Local: this node's only");
        let web = &status.ports[1];
        assert_eq!(ips(&web.endpoints[0].local), None, "no traffic uses local endpoints");
        assert_eq!(web.health_check_port, None);
    }

    #[test]
    fn queries_select_and_bound_and_changes_show_as_pending() {
        let yaml: String = (0..5).map(|i| service(&format!("s{i}"), &format!("10.96.0.{i}"), "", &[])).collect();
        let mut state = state(&yaml);
        let mut s = syncer();
        sync(&mut s, &state);
        let limited = s.status(&state, &StatusQuery { limit: 2, ..StatusQuery::default() });
        assert_eq!((limited.ports.len(), limited.matched), (2, 5));
        let one = s.status(
            &state,
            &StatusQuery { service: Some(NamespacedName::new("default", "s3")), limit: 10, ..StatusQuery::default() },
        );
        assert_eq!(one.ports.len(), 1);
        assert_eq!(one.ports[0].port.cluster_ips, vec!["10.96.0.3".parse::<std::net::IpAddr>().unwrap()]);
        let other = s.status(
            &state,
            &StatusQuery { namespace: Some("kube-system".into()), limit: 10, ..StatusQuery::default() },
        );
        assert_eq!(other.matched, 0);
        // A change not synced yet.
        let changed = service("s3", "10.96.0.33", "", &[]);
        let mut m = manifests::Manifests::default();
        manifests::load_text(std::path::Path::new("t.yaml"), &changed, &mut m);
        state.upsert_service(m.into_state("node1").0.services().next().unwrap().clone());
        let one = s.status(
            &state,
            &StatusQuery { service: Some(NamespacedName::new("default", "s3")), limit: 10, ..StatusQuery::default() },
        );
        assert_eq!(one.ports[0].state, PortState::Pending);
        assert_eq!(one.ports[0].port.cluster_ips, vec!["10.96.0.33".parse::<std::net::IpAddr>().unwrap()]);
    }
}
