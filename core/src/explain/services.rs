//! Naming a traced packet in Kubernetes terms from what nftproxy programmed: which service port
//! its destination is, and which endpoint its DNAT target is.
//!
//! Names come from the elements of nftproxy's maps, whose comments name the service port
//! (`namespace/name:port`), never from chain names: a service port may have no chain of its
//! own. Any map keyed by destination address, protocol and port (possibly followed by more
//! fields, such as a `numgen` range) names the port a destination belongs to; any map keyed by
//! protocol and port names a NodePort; any map whose data is an address and a port names an
//! endpoint. Only the address sets `cluster-ips` and `nodeport-ips` are looked up by name, to
//! tell ClusterIPs, external addresses and NodePorts apart. This is the one place that knows
//! how the ruleset is keyed.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;

use crate::nft::ast::Owner;
use crate::nft::wire::consts::{TYPE_INET_PROTOCOL, TYPE_INET_SERVICE, TYPE_IP6ADDR, TYPE_IPADDR};
use crate::nft::wire::{WireData, WireRuleset, WireSet, address_bytes, address_from_bytes};
use crate::plan::SharedSet;

/// How a packet reached a service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    ClusterIp,
    /// An external IP or a load-balancer IP.
    ExternalIp,
    NodePort,
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Destination::ClusterIp => "ClusterIP",
            Destination::ExternalIp => "external or load-balancer IP",
            Destination::NodePort => "NodePort",
        })
    }
}

/// The service port a destination belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceMatch {
    /// `namespace/name:port`, as the element comments name it.
    pub service_port: String,
    pub destination: Destination,
    /// The maps holding the destination (`service-ips`, `no-endpoint-services`, …).
    pub maps: Vec<String>,
}

/// Where a key was found: the map and the service port its comment names.
type Claims = Vec<(String, String)>;

/// Lookups into nftproxy's tables as read back from the kernel.
#[derive(Debug, Default)]
pub struct ServiceDirectory {
    /// `address . protocol . port` (padded as in set keys) → claims.
    destinations: HashMap<Vec<u8>, Claims>,
    /// `protocol . port` → claims (NodePorts).
    nodeports: HashMap<Vec<u8>, Claims>,
    cluster_ips: HashSet<IpAddr>,
    /// `None` when a family's table has no `nodeport-ips` (NodePorts on every local address).
    nodeport_ips: Option<HashSet<IpAddr>>,
    /// `address . port` (padded) → service ports with that endpoint.
    endpoints: HashMap<Vec<u8>, BTreeSet<String>>,
}

/// The nft data type ids a concatenated key or data type is made of, first field first (nft
/// packs each id in 6 bits).
fn type_fields(mut concatenated: u32) -> Vec<u32> {
    let mut out = Vec::new();
    while concatenated != 0 {
        out.push(concatenated & 0x3f);
        concatenated >>= 6;
    }
    out.reverse();
    out
}

/// Key bytes of a concatenation: each field padded to 32 bits.
fn concat(fields: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for field in fields {
        out.extend_from_slice(field);
        out.resize(out.len().div_ceil(4) * 4, 0);
    }
    out
}

impl ServiceDirectory {
    /// Indexes every map of `ruleset` (nftproxy's tables).
    pub fn new(ruleset: &WireRuleset) -> ServiceDirectory {
        let mut d = ServiceDirectory::default();
        let mut every_table_has_nodeport_ips = !ruleset.tables.is_empty();
        for table in &ruleset.tables {
            every_table_has_nodeport_ips &= table.sets.contains_key(SharedSet::NodeportIps.name().as_ref());
            for set in table.sets.values().filter(|s| !s.dynamic) {
                d.index(set);
            }
        }
        if !every_table_has_nodeport_ips {
            d.nodeport_ips = None;
        }
        d
    }

    fn index(&mut self, set: &WireSet) {
        let key = type_fields(set.spec.key_type);
        let addresses = |d: &mut HashSet<IpAddr>| {
            for k in set.elements.keys().filter(|k| !k.interval_end) {
                d.extend(address_from_bytes(&k.bytes));
            }
        };
        if set.name == SharedSet::ClusterIps.name() {
            return addresses(&mut self.cluster_ips);
        }
        if set.name == SharedSet::NodeportIps.name() {
            return addresses(self.nodeport_ips.get_or_insert_with(HashSet::new));
        }
        let address_len = match key.first() {
            Some(&TYPE_IPADDR) => Some(4),
            Some(&TYPE_IP6ADDR) => Some(16),
            _ => None,
        };
        let keyed_by = |fields: &[u32]| key.len() >= fields.len() && key[..fields.len()] == *fields;
        let (mut index, prefix) = match address_len {
            Some(len) if keyed_by(&[key[0], TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]) => {
                (Some(&mut self.destinations), len + 8)
            }
            None if keyed_by(&[TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]) => (Some(&mut self.nodeports), 8),
            _ => (None, 0),
        };
        // Endpoint data: an address and a port.
        let data = set.spec.data_type.map(type_fields).unwrap_or_default();
        let endpoint_data = matches!(data.as_slice(), [TYPE_IPADDR | TYPE_IP6ADDR, TYPE_INET_SERVICE]);
        for (k, element) in set.elements.iter().filter(|(k, _)| !k.interval_end) {
            let Owner::ServicePort(_) = &element.owner else { continue };
            let owner = element.owner.to_string();
            if let Some(index) = index.as_mut()
                && let Some(p) = k.bytes.get(..prefix)
            {
                let claims = index.entry(p.to_vec()).or_default();
                if !claims.iter().any(|(m, o)| *m == set.name && *o == owner) {
                    claims.push((set.name.clone(), owner.clone()));
                }
            }
            if endpoint_data && let WireData::Bytes(b) = &element.data {
                self.endpoints.entry(b.to_vec()).or_default().insert(owner);
            }
        }
    }

    /// The service port traffic to `address`, `protocol` (IANA number) and `port` belongs to:
    /// a ClusterIP, an external or load-balancer IP, or a NodePort on a node-port address.
    pub fn destination(&self, address: IpAddr, protocol: u8, port: u16) -> Option<ServiceMatch> {
        let key = concat(&[&address_bytes(&address), &[protocol], &port.to_be_bytes()]);
        if let Some(claims) = self.destinations.get(&key) {
            let destination =
                if self.cluster_ips.contains(&address) { Destination::ClusterIp } else { Destination::ExternalIp };
            return Some(matched(claims, destination));
        }
        let accepts_nodeports = self.nodeport_ips.as_ref().is_none_or(|ips| ips.contains(&address));
        if accepts_nodeports && let Some(claims) = self.nodeports.get(&concat(&[&[protocol], &port.to_be_bytes()])) {
            return Some(matched(claims, Destination::NodePort));
        }
        None
    }

    /// The service ports whose endpoints include `address:port`.
    pub fn endpoint(&self, address: IpAddr, port: u16) -> Vec<String> {
        let key = concat(&[&address_bytes(&address), &port.to_be_bytes()]);
        self.endpoints.get(&key).map(|s| s.iter().cloned().collect()).unwrap_or_default()
    }

    /// Whether `address` is an active ClusterIP.
    pub fn is_cluster_ip(&self, address: IpAddr) -> bool {
        self.cluster_ips.contains(&address)
    }

    /// Whether nothing was found (no nftproxy table here).
    pub fn is_empty(&self) -> bool {
        self.destinations.is_empty() && self.nodeports.is_empty()
    }
}

/// The first claimant in name order names the port; every map is listed. A key claimed by two
/// ports is conflicting input: within one map the first in name order wins, as in nftproxy's
/// planning, but across maps the lookup order does (see `SharedSet`), which this name need
/// not follow; the maps listed show the conflict.
fn matched(claims: &Claims, destination: Destination) -> ServiceMatch {
    let mut owners: Vec<&String> = claims.iter().map(|(_, o)| o).collect();
    owners.sort();
    ServiceMatch {
        service_port: owners.first().map(|o| o.to_string()).unwrap_or_default(),
        destination,
        maps: claims.iter().map(|(m, _)| m.clone()).collect::<BTreeSet<_>>().into_iter().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProxyConfig;
    use crate::manifests;
    use crate::nft::lower::lower_ruleset;
    use crate::plan::{NodePorts, PlanInput, plan};

    /// The ruleset nftproxy plans for `yaml`, as the kernel would hand it back.
    fn programmed(yaml: &str, nodeports: NodePorts) -> WireRuleset {
        let mut m = manifests::Manifests::default();
        manifests::load_text(std::path::Path::new("t.yaml"), yaml, &mut m);
        let (state, problems) = m.into_state("node1");
        assert!(problems.is_empty(), "{problems:?}");
        let config = ProxyConfig::new("node1");
        let input =
            PlanInput { config: &config, state: &state, nodeports_v4: &nodeports, nodeports_v6: &NodePorts::MatchAll };
        let mut ruleset = lower_ruleset(&plan(&input).ruleset);
        // Element owners come from comments on the way back from the kernel.
        for table in &mut ruleset.tables {
            for set in table.sets.values_mut() {
                for element in set.elements.values_mut() {
                    element.owner = element
                        .userdata
                        .as_deref()
                        .and_then(|u| crate::nft::wire::udata::find_comment(u, crate::nft::wire::udata::COMMENT))
                        .map_or_else(Owner::infrastructure, |c| Owner::from_comment(&c));
                }
            }
        }
        ruleset
    }

    const CLUSTER: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  externalIPs: [203.0.113.7]
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, targetPort: 8053}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 8053, protocol: UDP}]
endpoints:
- {addresses: ["10.244.1.10"], nodeName: node1, conditions: {ready: true}}
- {addresses: ["10.244.2.10"], nodeName: node2, conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: other}
spec:
  clusterIP: 10.96.0.20
  ports: [{name: http, port: 80, protocol: TCP}]
"#;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn destinations_name_their_service_port() {
        let d = ServiceDirectory::new(&programmed(CLUSTER, NodePorts::Addresses(vec![ip("192.168.50.2")])));
        let m = d.destination(ip("10.96.0.10"), 6, 80).expect("ClusterIP");
        assert!(d.is_cluster_ip(ip("10.96.0.10")) && !d.is_cluster_ip(ip("203.0.113.7")));
        assert_eq!(m.service_port, "default/web:http");
        assert_eq!(m.destination, Destination::ClusterIp);
        assert!(m.maps.contains(&"balanced-service-ips".to_string()), "{m:?}");
        assert!(m.maps.contains(&"service-endpoints-2".to_string()), "{m:?}");
        assert_eq!(d.destination(ip("10.96.0.10"), 17, 53).unwrap().service_port, "default/web:dns");
        let external = d.destination(ip("203.0.113.7"), 6, 80).expect("external IP");
        assert_eq!(
            (external.service_port.as_str(), external.destination),
            ("default/web:http", Destination::ExternalIp)
        );
        let nodeport = d.destination(ip("192.168.50.2"), 6, 30080).expect("NodePort");
        assert_eq!((nodeport.service_port.as_str(), nodeport.destination), ("default/web:http", Destination::NodePort));
        // A NodePort only on node-port addresses; a port the service does not serve is nothing.
        assert_eq!(d.destination(ip("10.1.2.3"), 6, 30080), None);
        assert_eq!(d.destination(ip("10.96.0.10"), 6, 81), None);
        assert_eq!(d.destination(ip("10.96.0.10"), 17, 80), None, "the protocol is part of the key");
    }

    #[test]
    fn a_service_without_endpoints_is_named_by_its_reject_map() {
        let d = ServiceDirectory::new(&programmed(CLUSTER, NodePorts::MatchAll));
        let m = d.destination(ip("10.96.0.20"), 6, 80).expect("no-endpoint service");
        assert_eq!(m.service_port, "other/empty:http");
        assert_eq!(m.maps, vec!["no-endpoint-services".to_string()]);
        // Without nodeport-ips, NodePorts are open on every address.
        assert_eq!(d.destination(ip("10.1.2.3"), 6, 30080).unwrap().destination, Destination::NodePort);
    }

    #[test]
    fn endpoints_are_named_by_the_maps_that_balance_to_them() {
        let d = ServiceDirectory::new(&programmed(CLUSTER, NodePorts::MatchAll));
        assert_eq!(d.endpoint(ip("10.244.1.10"), 8080), vec!["default/web:http".to_string()]);
        assert_eq!(d.endpoint(ip("10.244.2.10"), 8053), vec!["default/web:dns".to_string()]);
        assert!(d.endpoint(ip("10.244.1.10"), 9999).is_empty());
        assert!(!d.is_empty());
        assert!(ServiceDirectory::new(&WireRuleset::default()).is_empty());
    }

    #[test]
    fn keys_with_more_fields_still_match_by_their_prefix() {
        // The balancing maps are keyed `ip daddr . meta l4proto . th dport . numgen`: the
        // destination comes first.
        assert_eq!(type_fields(0x730d), vec![TYPE_IPADDR, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]);
        let mut ruleset = programmed(CLUSTER, NodePorts::MatchAll);
        let table = &mut ruleset.tables[0];
        let set = table.sets.get("service-endpoints-2").unwrap().clone();
        assert_eq!(type_fields(set.spec.key_type), vec![TYPE_IPADDR, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE, 4]);
        table.sets.clear();
        table.sets.insert(set.name.clone(), set);
        let d = ServiceDirectory::new(&ruleset);
        let m = d.destination(ip("10.96.0.10"), 6, 80).expect("prefix match");
        assert_eq!(m.service_port, "default/web:http");
        assert_eq!(m.maps, vec!["service-endpoints-2".to_string()]);
        assert_eq!(m.destination, Destination::ExternalIp, "no cluster-ips set in this table");
    }
}
