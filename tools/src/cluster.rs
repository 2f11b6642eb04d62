//! A synthetic cluster of S services × E endpoints, built straight into a [`ClusterState`].
//!
//! The mix: 70% TCP and 30% UDP ports; every 10th service a NodePort (half of those with
//! `externalTrafficPolicy: Local`), every 20th a LoadBalancer, every 25th with ClientIP affinity.
//! Endpoints spread over 20 nodes; node1 holds every 20th.

use std::net::{IpAddr, Ipv4Addr};

use nftproxy::model::*;
use nftproxy::net::{IpFamily, L4Proto};

/// The cluster CIDR the synthetic pods live in ([`endpoint_ip`]'s range).
pub const CLUSTER_CIDR: &str = "10.128.0.0/9";
/// The node the proxy runs as (it holds every 20th endpoint).
pub const NODE: &str = "node1";

/// The shape of a synthetic cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    pub services: usize,
    pub endpoints: usize,
}

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} × {}", self.services, self.endpoints)
    }
}

/// ClusterIP of service `i` (in 10.96.0.0/12).
pub fn cluster_ip(i: usize) -> Ipv4Addr {
    let n = 0x0a60_0000u32 + 1 + i as u32;
    Ipv4Addr::from(n)
}

/// Address of endpoint `j` of service `i` (in 10.128.0.0/9): service `i` owns the 64 addresses
/// from `i * 64`, so adding or removing one endpoint leaves the others' addresses alone.
/// `generation` shifts addresses so a replaced endpoint gets a new one.
pub fn endpoint_ip(i: usize, j: usize, generation: usize) -> Ipv4Addr {
    let n = 0x0a80_0000u32 + ((i * 64 + j + generation * 3) as u32 % 0x007f_ffff);
    Ipv4Addr::from(n)
}

/// The service port of service `i`.
pub fn service(i: usize) -> ServiceInfo {
    let name = NamespacedName::new(format!("ns{}", i % 100), format!("svc{i}"));
    let protocol = if i % 10 < 7 { L4Proto::Tcp } else { L4Proto::Udp };
    let port = if protocol == L4Proto::Tcp { 80 } else { 53 };
    let node_port = i.is_multiple_of(10).then(|| 30000 + (i / 10 % 2700) as u16);
    let lb = (i % 20 == 5).then(|| IpAddr::V4(Ipv4Addr::from(0xcb00_0000u32 + i as u32)));
    ServiceInfo {
        name: name.clone(),
        ports: vec![ServicePort {
            node_port: node_port.or(lb.map(|_| 30000 + 2700 + (i / 20 % 60) as u16)),
            load_balancer_ips: lb.into_iter().collect(),
            external_policy_local: i.is_multiple_of(20),
            session_affinity_secs: (i % 25 == 3).then_some(10800),
            ..ServicePort::new(
                ServicePortName { service: name, port: "p".into(), protocol },
                vec![IpAddr::V4(cluster_ip(i))],
                port,
            )
        }],
    }
}

/// The EndpointSlice of service `i` with `endpoints` endpoints.
pub fn slice(i: usize, endpoints: usize, generation: usize) -> EndpointSliceInfo {
    let svc = service(i);
    let sp = &svc.ports[0];
    EndpointSliceInfo {
        name: NamespacedName::new(svc.name.namespace.clone(), format!("svc{i}-abcde")),
        service: svc.name.clone(),
        family: IpFamily::V4,
        ports: vec![(sp.name.port.clone(), sp.name.protocol, 8080)],
        endpoints: (0..endpoints)
            .map(|j| SliceEndpoint {
                node_name: Some(format!("node{}", j % 20 + 1)),
                ..SliceEndpoint::ready(IpAddr::V4(endpoint_ip(i, j, generation)))
            })
            .collect(),
        trigger_time: None,
    }
}

/// The whole cluster.
pub fn state(size: Size) -> ClusterState {
    let mut s = ClusterState::new();
    for i in 0..size.services {
        s.upsert_service(service(i));
        s.upsert_slice(slice(i, size.endpoints, 0));
    }
    s.set_node(Some(NodeInfo {
        name: "node1".into(),
        labels: [("kubernetes.io/hostname".to_string(), "node1".to_string())].into(),
        host_ips: vec![IpAddr::V4(Ipv4Addr::new(192, 168, 0, 2))],
        ..NodeInfo::default()
    }));
    s
}

/// The cluster of [`state`] (`services` × 3) after changes made while no proxy ran: services gone,
/// new ones (one taking a gone service's ClusterIP), endpoint counts changed both ways (so
/// endpoint windows are re-split), affinity and NodePorts turned on and off.
pub fn changed_while_down(services: usize) -> ClusterState {
    let mut s = state(Size { services, endpoints: 3 });
    for i in (0..services).step_by(7) {
        let name = service(i).name;
        s.remove_slice(&slice(i, 3, 0).name);
        s.remove_service(&name);
    }
    for i in (1..services).step_by(5) {
        s.upsert_slice(slice(i, 1 + i % 6, 1));
    }
    for i in (2..services).step_by(9) {
        let mut svc = service(i);
        svc.ports[0].session_affinity_secs = svc.ports[0].session_affinity_secs.xor(Some(60));
        svc.ports[0].node_port = svc.ports[0].node_port.xor(Some(31999 - (i % 1000) as u16));
        s.upsert_service(svc);
    }
    for i in services..services + 6 {
        s.upsert_service(service(i));
        s.upsert_slice(slice(i, 4, 0));
    }
    // A new service with the ClusterIP and port of a gone one (service 0).
    let mut taker = service(services + 10);
    taker.ports[0].cluster_ips = service(0).ports[0].cluster_ips.clone();
    taker.ports[0].port = service(0).ports[0].port;
    taker.ports[0].name.protocol = service(0).ports[0].name.protocol;
    s.upsert_service(taker);
    s.upsert_slice(slice(services + 10, 2, 0));
    s
}

/// The node the synthetic cluster runs on, as YAML.
const NODE1_YAML: &str = r#"apiVersion: v1
kind: Node
metadata:
  name: node1
  labels: {kubernetes.io/hostname: node1}
status:
  addresses:
  - {type: InternalIP, address: 192.168.0.2}
  - {type: Hostname, address: node1}"#;

/// The cluster of [`state`] as `kubectl get svc,endpointslices,nodes -A -o yaml` would print
/// it (one multi-document stream, with the metadata the API server adds), written to `out`: the
/// input of `nftproxy run --manifests` and `render` at scale, and of the test API server.
pub fn write_yaml(size: Size, out: &mut impl std::io::Write) -> std::io::Result<()> {
    writeln!(out, "{NODE1_YAML}")?;
    for i in 0..size.services {
        write_service_yaml(i, out)?;
        write_slice_yaml(&slice(i, size.endpoints, 0), i, out)?;
    }
    Ok(())
}

/// One object's metadata as the API server returns it.
fn metadata(out: &mut impl std::io::Write, name: &str, namespace: &str, uid: usize) -> std::io::Result<()> {
    writeln!(out, "metadata:\n  name: {name}\n  namespace: {namespace}")?;
    writeln!(out, "  uid: 0b1c2d3e-{uid:04x}-4a5b-8c9d-{uid:012x}\n  resourceVersion: \"{}\"", 1000 + uid)?;
    writeln!(out, "  creationTimestamp: \"2026-01-01T00:00:00Z\"")
}

/// Service `i` of [`service`] as YAML.
pub fn write_service_yaml(i: usize, out: &mut impl std::io::Write) -> std::io::Result<()> {
    let svc = service(i);
    let sp = &svc.ports[0];
    let kind = if !sp.load_balancer_ips.is_empty() {
        "LoadBalancer"
    } else if sp.node_port.is_some() {
        "NodePort"
    } else {
        "ClusterIP"
    };
    writeln!(out, "---\napiVersion: v1\nkind: Service")?;
    metadata(out, &svc.name.name, &svc.name.namespace, 2 * i)?;
    writeln!(out, "  labels: {{app: {}}}", svc.name.name)?;
    let ip = sp.cluster_ips[0];
    writeln!(out, "spec:\n  type: {kind}\n  clusterIP: {ip}\n  clusterIPs: [{ip}]")?;
    writeln!(out, "  ipFamilies: [IPv4]\n  ipFamilyPolicy: SingleStack\n  internalTrafficPolicy: Cluster")?;
    if kind != "ClusterIP" {
        let policy = if sp.external_policy_local { "Local" } else { "Cluster" };
        writeln!(out, "  externalTrafficPolicy: {policy}")?;
    }
    match sp.session_affinity_secs {
        Some(t) => writeln!(
            out,
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {t}}}}}"
        )?,
        None => writeln!(out, "  sessionAffinity: None")?,
    }
    let protocol = sp.name.protocol.name().to_uppercase();
    write!(
        out,
        "  ports:\n  - name: {}\n    port: {}\n    protocol: {protocol}\n    targetPort: 8080\n",
        sp.name.port, sp.port
    )?;
    if let Some(np) = sp.node_port {
        writeln!(out, "    nodePort: {np}")?;
    }
    writeln!(out, "  selector: {{app: {}}}", svc.name.name)?;
    match sp.load_balancer_ips.first() {
        Some(lb) => writeln!(out, "status:\n  loadBalancer:\n    ingress:\n    - {{ip: {lb}, ipMode: VIP}}"),
        None => writeln!(out, "status:\n  loadBalancer: {{}}"),
    }
}

/// An EndpointSlice of service `i` as YAML.
pub fn write_slice_yaml(slice: &EndpointSliceInfo, i: usize, out: &mut impl std::io::Write) -> std::io::Result<()> {
    writeln!(out, "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice")?;
    metadata(out, &slice.name.name, &slice.name.namespace, 2 * i + 1)?;
    writeln!(
        out,
        "  labels:\n    kubernetes.io/service-name: {}\n    endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io",
        slice.service.name
    )?;
    writeln!(out, "addressType: IPv4")?;
    writeln!(out, "ports:")?;
    for (name, protocol, port) in &slice.ports {
        writeln!(out, "- name: {name}\n  port: {port}\n  protocol: {}", protocol.name().to_uppercase())?;
    }
    if slice.endpoints.is_empty() {
        return writeln!(out, "endpoints: []");
    }
    writeln!(out, "endpoints:")?;
    for (j, ep) in slice.endpoints.iter().enumerate() {
        writeln!(out, "- addresses: [\"{}\"]", ep.ip)?;
        writeln!(
            out,
            "  conditions: {{ready: {}, serving: {}, terminating: {}}}",
            ep.ready, ep.serving, ep.terminating
        )?;
        if let Some(node) = &ep.node_name {
            writeln!(out, "  nodeName: {node}")?;
        }
        writeln!(
            out,
            "  targetRef: {{kind: Pod, name: {}-{j}, namespace: {}}}",
            slice.service.name, slice.name.namespace
        )?;
    }
    Ok(())
}

/// The cluster of [`write_yaml`] as one `kind: List` (what `kubectl get … -o yaml` prints): the
/// same objects, each an item of the list.
pub fn write_list_yaml(size: Size, out: &mut impl std::io::Write) -> std::io::Result<()> {
    use std::io::Write as _;
    writeln!(out, "apiVersion: v1\nkind: List\nmetadata:\n  resourceVersion: \"\"\nitems:")?;
    let mut item = Vec::new();
    let emit = |item: &mut Vec<u8>, out: &mut dyn std::io::Write| -> std::io::Result<()> {
        let text = String::from_utf8_lossy(item);
        for (n, line) in text.lines().filter(|l| *l != "---").enumerate() {
            writeln!(out, "{}{line}", if n == 0 { "- " } else { "  " })?;
        }
        item.clear();
        Ok(())
    };
    writeln!(item, "{NODE1_YAML}")?;
    emit(&mut item, out)?;
    for i in 0..size.services {
        write_service_yaml(i, &mut item)?;
        emit(&mut item, out)?;
        write_slice_yaml(&slice(i, size.endpoints, 0), i, &mut item)?;
        emit(&mut item, out)?;
    }
    Ok(())
}

/// An object written as YAML, as the API server's JSON.
fn as_json(write: impl FnOnce(&mut Vec<u8>) -> std::io::Result<()>) -> serde_json::Value {
    let mut text = Vec::new();
    // Writing to a Vec cannot fail, and the YAML is this module's own.
    let _ = write(&mut text);
    serde_yaml_ng::from_slice(&text).unwrap_or(serde_json::Value::Null)
}

/// Service `i` of [`service`] as the API server returns it.
pub fn service_object(i: usize) -> serde_json::Value {
    as_json(|out| write_service_yaml(i, out))
}

/// An EndpointSlice of service `i` as the API server returns it, with
/// `endpoints.kubernetes.io/last-change-trigger-time` when `trigger` is given (what the
/// EndpointSlice controller sets, and kube-proxy's network-programming latency counts from).
pub fn slice_object(slice: &EndpointSliceInfo, i: usize, trigger: Option<std::time::SystemTime>) -> serde_json::Value {
    let mut obj = as_json(|out| write_slice_yaml(slice, i, out));
    if let Some(t) = trigger {
        obj["metadata"]["annotations"] = serde_json::json!({
            "endpoints.kubernetes.io/last-change-trigger-time": humantime::format_rfc3339_nanos(t).to_string()
        });
    }
    obj
}

/// The Node `node1` with InternalIP `ip`.
pub fn node_object(ip: IpAddr) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node1", "labels": {"kubernetes.io/hostname": "node1"}, "resourceVersion": "1"},
        "status": {"addresses": [{"type": "InternalIP", "address": ip.to_string()}, {"type": "Hostname", "address": "node1"}]}
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The YAML, loaded as `nftproxy` loads manifests, is the same cluster as [`state`].
    #[test]
    fn the_yaml_is_the_same_cluster() {
        let size = Size { services: 60, endpoints: 3 };
        let mut text = Vec::new();
        write_yaml(size, &mut text).unwrap();
        let mut m = nftproxy::source::manifests::Manifests::default();
        nftproxy::source::manifests::load_text(
            std::path::Path::new("c.yaml"),
            &String::from_utf8(text).unwrap(),
            &mut m,
        );
        assert!(m.problems.is_empty(), "{:?}", m.problems);
        let (loaded, problems) = nftproxy::source::state_from_manifests(&m, "node1");
        assert!(problems.is_empty(), "{problems:?}");
        let expected = state(size);
        assert!(loaded.changed_services(&expected).is_empty(), "{:?}", loaded.changed_services(&expected));
        assert_eq!(loaded.node(), expected.node());
        // The same cluster as one List.
        let mut list = Vec::new();
        write_list_yaml(size, &mut list).unwrap();
        let mut m = nftproxy::source::manifests::Manifests::default();
        nftproxy::source::manifests::load_text(
            std::path::Path::new("list.yaml"),
            &String::from_utf8(list).unwrap(),
            &mut m,
        );
        assert!(m.problems.is_empty(), "{:?}", m.problems);
        let (from_list, _) = nftproxy::source::state_from_manifests(&m, "node1");
        assert!(from_list.changed_services(&expected).is_empty());
        assert_eq!(from_list.node(), expected.node());
    }

    #[test]
    fn objects_for_the_api_server_carry_their_fields() {
        let svc = service_object(3);
        assert_eq!(svc["spec"]["sessionAffinity"], "ClientIP");
        assert_eq!(svc["metadata"]["name"], "svc3");
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(1_700_000_000_123_456_789);
        let s = slice_object(&slice(3, 2, 0), 3, Some(t));
        assert_eq!(s["endpoints"].as_array().map(Vec::len), Some(2));
        assert_eq!(
            s["metadata"]["annotations"]["endpoints.kubernetes.io/last-change-trigger-time"],
            "2023-11-14T22:13:20.123456789Z"
        );
    }
}
