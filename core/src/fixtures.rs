//! The planner's test fixtures: scenarios as manifest YAML, the settings and node they are
//! planned for, and the golden-file comparison. Built for this crate's tests and, with the
//! `testing` feature, for the agent crate's.

use std::path::{Path, PathBuf};

use crate::config::{ProxyConfig, parse_cidrs};
use crate::manifests::{self, state_from_manifests};
use crate::model::ClusterState;
use crate::plan::placement::Placement;
use crate::plan::{NodePorts, Plan, PlanInput, demands, families, plan_placed};

/// The node every fixture runs on.
pub const NODE: &str = "node1";

/// A cluster state from manifest YAML.
pub fn state(yaml: &str) -> ClusterState {
    let mut m = manifests::Manifests::default();
    manifests::load_text(Path::new("fixture.yaml"), yaml, &mut m);
    assert!(m.problems.is_empty(), "fixture problems: {:?}", m.problems);
    let (state, problems) = state_from_manifests(&m, NODE);
    assert!(problems.is_empty(), "fixture problems: {problems:?}");
    state
}

/// The settings fixtures use: cluster CIDR 10.0.0.0/8.
pub fn config() -> ProxyConfig {
    let mut c = ProxyConfig::new(NODE);
    c.cluster_cidrs = parse_cidrs("--cluster-cidr", "10.0.0.0/8").unwrap_or_default();
    c
}

/// Plans with node ports on 192.168.0.2 / fd00:192:168::2, for an empty kernel.
pub fn plan_with(config: &ProxyConfig, state: &ClusterState) -> Plan {
    plan_after(config, state, &mut Placement::new())
}

/// Plans like [`plan_with`], keeping endpoint windows where `placement` has them, as a full
/// sync does.
pub fn plan_after(config: &ProxyConfig, state: &ClusterState, placement: &mut Placement) -> Plan {
    let v4 = NodePorts::Addresses(vec!["192.168.0.2".parse().unwrap()]);
    let v6 = NodePorts::Addresses(vec!["fd00:192:168::2".parse().unwrap()]);
    let input = PlanInput { config, state, nodeports_v4: &v4, nodeports_v6: &v6 };
    let families = families(&input);
    let demands = state.services().map(|svc| (svc.name.clone(), demands(&input, &families, svc)));
    let prior_affinity: Vec<_> = placement.affinity_slots().collect();
    *placement = Placement::settle(placement.windows().collect::<Vec<_>>(), prior_affinity, demands);
    plan_placed(&input, placement)
}

pub fn golden_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("nft-templates").join(name)
}

/// Compares a rendering with its golden file; `NFTPROXY_UPDATE_GOLDEN=1` rewrites the file.
pub fn assert_golden(name: &str, rendered: &str) {
    let path = golden_path(name);
    if std::env::var_os("NFTPROXY_UPDATE_GOLDEN").is_some() {
        let old = std::fs::read_to_string(&path).unwrap_or_default();
        let header: String = old.lines().take_while(|l| l.starts_with('#')).map(|l| format!("{l}\n")).collect();
        std::fs::write(&path, format!("{header}{rendered}")).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let expected: String = expected.lines().filter(|l| !l.starts_with('#')).map(|l| format!("{l}\n")).collect();
    assert_eq!(rendered, expected, "render differs from {}", path.display());
}

/// The ClusterIP scenario of `nft-templates/clusterip.nft`.
pub const CLUSTERIP: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: svc1, namespace: ns1}
spec:
  clusterIP: 172.30.0.41
  ports: [{name: p80, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc1-abc, namespace: ns1, labels: {kubernetes.io/service-name: svc1}}
addressType: IPv4
ports: [{name: p80, port: 80, protocol: TCP}]
endpoints:
- {addresses: ["10.180.0.1"], nodeName: node1}
---
apiVersion: v1
kind: Service
metadata: {name: svc2, namespace: ns2}
spec:
  clusterIP: 172.30.0.42
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080}
  - {name: dns-udp, port: 53, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc2-abc, namespace: ns2, labels: {kubernetes.io/service-name: svc2}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns-udp, port: 53, protocol: UDP}]
endpoints:
- {addresses: ["10.180.0.2"], nodeName: node1}
- {addresses: ["10.180.2.1"], nodeName: node2}
- {addresses: ["10.180.3.1"], nodeName: node3, conditions: {ready: false, serving: true, terminating: true}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc2-def, namespace: ns2, labels: {kubernetes.io/service-name: svc2}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.180.4.1"], nodeName: node4}
---
apiVersion: v1
kind: Service
metadata: {name: svc3, namespace: ns3}
spec:
  clusterIP: 172.30.0.43
  ports: [{name: p80, port: 80, protocol: TCP}]
"#;

/// The external-traffic scenario of `nft-templates/external.nft` (upstream's overall test), in
/// `nft-templates/external.yaml` (the upgrade test loads it too).
pub const EXTERNAL: &str = include_str!("../../nft-templates/external.yaml");

/// Session affinity (`nft-templates/affinity.nft`): three endpoints, and one.
pub const AFFINITY: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: ns1}
spec:
  clusterIP: 172.30.0.41
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 10800}}
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sticky-abc, namespace: ns1, labels: {kubernetes.io/service-name: sticky}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.180.0.1"], nodeName: node1}
- {addresses: ["10.180.0.2"], nodeName: node2}
- {addresses: ["10.180.0.3"], nodeName: node3}
---
apiVersion: v1
kind: Service
metadata: {name: one, namespace: ns2}
spec:
  clusterIP: 172.30.0.42
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}
  ports: [{name: dns, port: 53, protocol: UDP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: one-abc, namespace: ns2, labels: {kubernetes.io/service-name: one}}
addressType: IPv4
ports: [{name: dns, port: 53, protocol: UDP}]
endpoints:
- {addresses: ["10.180.0.9"], nodeName: node2}
"#;

/// A service `ns/NAME` on `cluster_ip` port 80 (TCP) with `n` ready endpoints 10.100.x.y:8080
/// on node2 (`local`: half of them on node1), with ClientIP affinity when `affine`.
pub fn affine_service(name: &str, cluster_ip: &str, n: u32, affine: bool) -> String {
    let affinity = if affine { "\n  sessionAffinity: ClientIP" } else { "" };
    let endpoints: String = (0..n)
        .map(|i| format!("- {{addresses: [\"10.100.{}.{}\"], nodeName: node{}}}\n", i / 250, i % 250 + 1, 1 + i % 2))
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec:\n  clusterIP: {cluster_ip}{affinity}\n  ports: [{{name: http, port: 80, protocol: TCP}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: ns, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints:\n{endpoints}"
    )
}
