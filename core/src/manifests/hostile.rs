//! Hostile input, from manifest text to the rendered ruleset: each bad piece is reported with
//! the object and the field, skipped alone, and a good service in the same input is still
//! planned and rendered.

use std::path::Path;

use super::{Manifests, state_from_manifests};
use crate::fixtures::{NODE, config, plan_with};
use crate::manifests;
use crate::model::{ClusterState, NamespacedName, ObjectRef, Problem};
use crate::nft::Ruleset;

/// A good service (`ns/ok`, 10.96.9.1:80 → 10.244.9.1:8080) that every test puts beside the
/// bad input.
const GOOD: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: ok, namespace: ns}
spec:
  clusterIP: 10.96.9.1
  ports: [{name: http, port: 80}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: ok-1, namespace: ns, labels: {kubernetes.io/service-name: ok}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: ["10.244.9.1"], nodeName: node1}]
"#;

/// What became of an input.
struct Outcome {
    manifests: Manifests,
    state: ClusterState,
    problems: Vec<Problem>,
    ruleset: Ruleset,
    rendered: String,
}

/// Loads `yaml` and [`GOOD`] as one file, converts, plans and renders for node1.
fn load(yaml: &str) -> Outcome {
    let mut m = Manifests::default();
    manifests::load_text(Path::new("hostile.yaml"), &format!("{yaml}\n---\n{GOOD}"), &mut m);
    let (state, problems) = state_from_manifests(&m, NODE);
    let ruleset = plan_with(&config(), &state).ruleset;
    let rendered = ruleset.to_string();
    let out = Outcome { manifests: m, state, problems, ruleset, rendered };
    out.assert_good_planned();
    out
}

impl Outcome {
    /// The good service is planned: its ClusterIP is balanced, to its pod.
    fn assert_good_planned(&self) {
        assert!(
            self.rendered.contains("10.96.9.1 . tcp . 80 counter packets 0 bytes 0 comment \"ns/ok:http\""),
            "good service not dispatched:\n{}",
            self.rendered
        );
        assert!(self.dnats_to("10.244.9.1 . 8080"), "good service has no DNAT");
    }

    /// Whether some balanced service address DNATs to `target` (`ip . port`).
    fn dnats_to(&self, target: &str) -> bool {
        self.rendered.contains(&format!(" : {target}\n"))
            || self.rendered.contains(&format!(" : {target},"))
            || self.rendered.contains(&format!(" : {target} }}"))
    }

    /// The one problem reported for `object`'s `field` (skipping the object, or not); its
    /// message names both.
    fn problem(&self, object: &str, field: &str, skipped: bool) -> &Problem {
        let found: Vec<&Problem> = self
            .problems
            .iter()
            .filter(|p| p.object.to_string() == object && p.field == field && p.object_skipped == skipped)
            .collect();
        assert_eq!(found.len(), 1, "expected one problem for {object} {field}, got {:#?}", self.problems);
        let text = found[0].to_string();
        assert!(text.contains(object) && text.contains(field), "{text}");
        found[0]
    }

    /// A problem with a field skipped alone.
    fn field_ignored(&self, object: &str, field: &str, reason: &str) {
        let p = self.problem(object, field, false);
        assert!(p.reason.contains(reason), "{p}");
    }

    /// A problem that skipped the whole object.
    fn object_skipped(&self, object: &str, field: &str, reason: &str) {
        let p = self.problem(object, field, true);
        assert!(p.reason.contains(reason), "{p}");
    }

    /// The ports `ns/name` was planned with, as `name/port/protocol[/nodePort]`.
    fn ports(&self, service: &str) -> Vec<String> {
        let info = self.state.service(&NamespacedName::new("ns", service)).expect("service planned");
        info.ports
            .iter()
            .map(|p| {
                let mut s = format!("{}/{}/{}", p.name.port, p.port, p.name.protocol);
                if let Some(np) = p.node_port {
                    s.push_str(&format!("/{np}"));
                }
                s
            })
            .collect()
    }

    /// Every nftables name fits the kernel (255 bytes) and every comment nft (127 bytes).
    fn assert_kernel_limits(&self) {
        for table in &self.ruleset.tables {
            for name in table.sets.keys().chain(table.chains.keys()) {
                assert!(name.len() <= 255, "name of {} bytes: {name}", name.len());
            }
            let comments = table
                .sets
                .values()
                .flat_map(|s| s.elements.values().map(|e| e.comment.as_deref()).chain([s.comment.as_deref()]))
                .chain(
                    table
                        .chains
                        .values()
                        .flat_map(|c| c.rules.iter().map(|r| r.comment.as_deref()).chain([c.comment.as_deref()])),
                );
            for c in comments.flatten() {
                assert!(c.len() < 128, "comment of {} bytes: {c}", c.len());
            }
        }
    }
}

fn service(name: &str, spec: &str) -> String {
    format!("apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec:\n{spec}")
}

fn slice(name: &str, service: &str, body: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: ns, labels: {{kubernetes.io/service-name: {service}}}}}\n{body}"
    )
}

// --- invalid IPs -----------------------------------------------------------------------------

#[test]
fn an_invalid_cluster_ip_skips_its_service_only() {
    let out = load(&service("web", "  clusterIP: 10.96.0.300\n  ports: [{port: 80}]\n"));
    out.field_ignored("Service ns/web", "spec.clusterIP", "invalid IP address \"10.96.0.300\"");
    out.object_skipped("Service ns/web", "spec.clusterIP", "no valid ClusterIP");
    assert!(out.state.service(&NamespacedName::new("ns", "web")).is_none());
}

#[test]
fn an_invalid_external_ip_is_skipped_alone() {
    let out = load(&service(
        "web",
        "  type: NodePort\n  clusterIP: 10.96.0.1\n  externalIPs: [\"1.2.3\", \"203.0.113.7\"]\n  ports: [{port: 80, nodePort: 30080}]\n",
    ));
    out.field_ignored("Service ns/web", "spec.externalIPs[0]", "invalid external IP \"1.2.3\"");
    assert!(out.rendered.contains("203.0.113.7 . tcp . 80"));
}

#[test]
fn an_invalid_load_balancer_ip_is_skipped_alone() {
    let out = load(&format!(
        "{}status: {{loadBalancer: {{ingress: [{{ip: bogus}}, {{ip: 203.0.113.8}}]}}}}\n",
        service("web", "  type: LoadBalancer\n  clusterIP: 10.96.0.1\n  ports: [{port: 80, nodePort: 30080}]\n")
    ));
    out.field_ignored("Service ns/web", "status.loadBalancer.ingress[0].ip", "invalid IP \"bogus\"");
    assert!(out.rendered.contains("203.0.113.8 . tcp . 80"));
}

#[test]
fn an_invalid_source_range_is_skipped_alone() {
    let out = load(&format!(
        "{}status: {{loadBalancer: {{ingress: [{{ip: 203.0.113.8}}]}}}}\n",
        service(
            "web",
            "  type: LoadBalancer\n  clusterIP: 10.96.0.1\n  loadBalancerSourceRanges: [10.0.0.0/33, 192.0.2.0/24]\n  ports: [{port: 80, nodePort: 30080}]\n",
        )
    ));
    out.field_ignored("Service ns/web", "spec.loadBalancerSourceRanges[0]", "invalid CIDR \"10.0.0.0/33\"");
    assert!(out.rendered.contains("elements = { 192.0.2.0/24 }"), "{}", out.rendered);
}

#[test]
fn an_invalid_endpoint_address_is_skipped_alone() {
    let out = load(&format!(
        "{}---\n{}",
        service("web", "  clusterIP: 10.96.0.1\n  ports: [{name: http, port: 80}]\n"),
        slice(
            "web-1",
            "web",
            "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [not-an-ip]}, {addresses: [\"10.244.0.5\"]}]\n",
        )
    ));
    out.field_ignored("EndpointSlice ns/web-1", "endpoints[0].addresses", "invalid IP address \"not-an-ip\"");
    assert!(out.dnats_to("10.244.0.5 . 8080"), "{}", out.rendered);
}

#[test]
fn an_invalid_node_address_is_skipped_alone() {
    let out = load(
        "apiVersion: v1\nkind: Node\nmetadata: {name: node1}\nstatus: {addresses: [{type: InternalIP, address: 192.168.0.300}, {type: InternalIP, address: 192.168.0.9}]}\n",
    );
    out.field_ignored("Node node1", "status.addresses[0]", "invalid IP \"192.168.0.300\"");
    assert_eq!(out.state.node().map(|n| n.host_ips.len()), Some(1));
}

// --- IPv6 addresses in IPv4 fields -----------------------------------------------------------

#[test]
fn an_ipv6_cluster_ip_in_an_ipv4_only_service_is_refused() {
    // Before: accepted, and planned into the ip6 table of a service declared IPv4-only.
    let out = load(&service(
        "web",
        "  clusterIP: fd00::10\n  clusterIPs: [fd00::10]\n  ipFamilies: [IPv4]\n  ipFamilyPolicy: SingleStack\n  ports: [{port: 80}]\n",
    ));
    out.field_ignored("Service ns/web", "spec.clusterIPs[0]", "is an IPv6 address, but spec.ipFamilies[0] is IPv4");
    out.object_skipped("Service ns/web", "spec.clusterIPs", "no valid ClusterIP");
    assert!(!out.rendered.contains("table ip6"), "no IPv6 table for an IPv4-only cluster");
}

#[test]
fn swapped_ip_families_keep_only_the_matching_address() {
    let out = load(&service(
        "web",
        "  clusterIPs: [10.96.0.1, fd00::10]\n  ipFamilies: [IPv4, IPv4]\n  ports: [{port: 80}]\n",
    ));
    out.field_ignored("Service ns/web", "spec.clusterIPs[1]", "is an IPv6 address, but spec.ipFamilies[1] is IPv4");
    let info = out.state.service(&NamespacedName::new("ns", "web")).unwrap();
    assert_eq!(info.ports[0].cluster_ips, vec!["10.96.0.1".parse::<std::net::IpAddr>().unwrap()]);
}

#[test]
fn an_ipv6_external_ip_of_an_ipv4_only_service_is_reported() {
    // Before: kept silently, and made the port count as externally accessible.
    let out = load(&service(
        "web",
        "  clusterIP: 10.96.0.1\n  ipFamilies: [IPv4]\n  externalIPs: [\"2001:db8::7\"]\n  ports: [{port: 80}]\n",
    ));
    out.field_ignored("Service ns/web", "spec.externalIPs[0]", "the Service has no IPv6 ClusterIP");
    let info = out.state.service(&NamespacedName::new("ns", "web")).unwrap();
    assert!(!info.ports[0].externally_accessible());
}

#[test]
fn an_ipv6_load_balancer_ip_of_an_ipv4_only_service_is_reported() {
    let out = load(&format!(
        "{}status: {{loadBalancer: {{ingress: [{{ip: \"2001:db8::8\"}}]}}}}\n",
        service("web", "  type: LoadBalancer\n  clusterIP: 10.96.0.1\n  ports: [{port: 80, nodePort: 30080}]\n")
    ));
    out.field_ignored("Service ns/web", "status.loadBalancer.ingress[0].ip", "the Service has no IPv6 ClusterIP");
}

#[test]
fn an_ipv6_endpoint_in_an_ipv4_slice_is_skipped() {
    let out = load(&format!(
        "{}---\n{}",
        service("web", "  clusterIP: 10.96.0.1\n  ports: [{name: http, port: 80}]\n"),
        slice(
            "web-1",
            "web",
            "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [\"fd00::5\"]}, {addresses: [\"10.244.0.5\"]}]\n",
        )
    ));
    out.field_ignored("EndpointSlice ns/web-1", "endpoints[0].addresses", "\"fd00::5\" is not a usable IPv4 address");
    assert!(out.dnats_to("10.244.0.5 . 8080"), "{}", out.rendered);
}

#[test]
fn cluster_ip_and_cluster_ips_disagreeing_is_reported() {
    let out = load(&service("web", "  clusterIP: 10.96.0.2\n  clusterIPs: [10.96.0.1]\n  ports: [{port: 80}]\n"));
    out.field_ignored("Service ns/web", "spec.clusterIP", "differs from spec.clusterIPs[0]");
    assert!(out.rendered.contains("10.96.0.1 . tcp . 80"));
}

#[test]
fn an_unknown_ip_family_is_reported() {
    let out = load(&service("web", "  clusterIPs: [10.96.0.1]\n  ipFamilies: [IPv5]\n  ports: [{port: 80}]\n"));
    out.field_ignored("Service ns/web", "spec.ipFamilies[0]", "unknown IP family \"IPv5\"");
    assert!(out.rendered.contains("10.96.0.1 . tcp . 80"));
}

// --- ports 0 or > 65535 ----------------------------------------------------------------------

#[test]
fn port_zero_is_skipped_alone() {
    let out = load(&service("web", "  clusterIP: 10.96.0.1\n  ports: [{name: a, port: 0}, {name: b, port: 81}]\n"));
    out.field_ignored("Service ns/web", "spec.ports[0].port", "0 is not a valid port (1-65535)");
    assert_eq!(out.ports("web"), vec!["b/81/tcp"]);
}

#[test]
fn port_above_65535_is_skipped_alone() {
    let out =
        load(&service("web", "  clusterIP: 10.96.0.1\n  ports: [{name: a, port: 65536}, {name: b, port: 65535}]\n"));
    out.field_ignored("Service ns/web", "spec.ports[0].port", "65536 is not a valid port (1-65535)");
    assert_eq!(out.ports("web"), vec!["b/65535/tcp"]);
}

#[test]
fn a_negative_port_is_skipped_alone() {
    let out = load(&service("web", "  clusterIP: 10.96.0.1\n  ports: [{name: a, port: -1}, {name: b, port: 81}]\n"));
    out.field_ignored("Service ns/web", "spec.ports[0].port", "-1 is not a valid port (1-65535)");
    assert_eq!(out.ports("web"), vec!["b/81/tcp"]);
}

#[test]
fn a_port_beyond_32_bits_makes_the_object_unreadable_and_is_reported() {
    // Kubernetes' type is int32: the object cannot be read at all (kubectl refuses it too).
    let out = load(&service("web", "  clusterIP: 10.96.0.1\n  ports: [{port: 4294967376}]\n"));
    let p = &out.manifests.problems;
    assert_eq!(p.len(), 1, "{p:#?}");
    assert_eq!(p[0].name.as_deref(), Some("ns/web"));
    assert!(p[0].reason.contains("spec.ports[0].port"), "{}", p[0]);
}

#[test]
fn an_invalid_node_port_drops_only_the_node_port() {
    let out = load(&service(
        "web",
        "  type: NodePort\n  clusterIP: 10.96.0.1\n  ports: [{name: a, port: 80, nodePort: 70000}, {name: b, port: 81, nodePort: 0}]\n",
    ));
    out.field_ignored("Service ns/web", "spec.ports[0].nodePort", "70000 is not a valid port");
    assert_eq!(out.ports("web"), vec!["a/80/tcp", "b/81/tcp"]);
}

#[test]
fn a_slice_port_of_zero_or_none_is_skipped_alone() {
    let out = load(&format!(
        "{}---\n{}",
        service(
            "web",
            "  clusterIP: 10.96.0.1\n  ports: [{name: http, port: 80}, {name: dns, port: 53, protocol: UDP}]\n"
        ),
        slice(
            "web-1",
            "web",
            "addressType: IPv4\nports: [{name: http, port: 0}, {name: dns}, {name: x, port: 9000}]\nendpoints: [{addresses: [\"10.244.0.5\"]}]\n",
        )
    ));
    out.field_ignored("EndpointSlice ns/web-1", "ports[0].port", "0 is not a valid port");
    out.field_ignored("EndpointSlice ns/web-1", "ports[1].port", "missing");
    let info = out.state.slices_of(&NamespacedName::new("ns", "web")).next().unwrap();
    assert_eq!(info.ports.len(), 1);
}

// --- unknown protocols -----------------------------------------------------------------------

#[test]
fn an_unknown_service_protocol_is_skipped_alone() {
    let out = load(&service(
        "web",
        "  clusterIP: 10.96.0.1\n  ports: [{name: a, port: 80, protocol: ICMP}, {name: b, port: 80, protocol: tcp}, {name: c, port: 80, protocol: SCTP}]\n",
    ));
    out.field_ignored("Service ns/web", "spec.ports[0].protocol", "unknown protocol \"ICMP\"");
    out.field_ignored("Service ns/web", "spec.ports[1].protocol", "unknown protocol \"tcp\"");
    assert_eq!(out.ports("web"), vec!["c/80/sctp"]);
}

#[test]
fn an_unknown_slice_protocol_is_skipped_alone() {
    let out = load(&format!(
        "{}---\n{}",
        service("web", "  clusterIP: 10.96.0.1\n  ports: [{name: http, port: 80}]\n"),
        slice(
            "web-1",
            "web",
            "addressType: IPv4\nports: [{name: http, port: 8080, protocol: HTTP}, {name: dns, port: 53, protocol: UDP}]\nendpoints: [{addresses: [\"10.244.0.5\"]}]\n",
        )
    ));
    out.field_ignored("EndpointSlice ns/web-1", "ports[0].protocol", "unknown protocol \"HTTP\"");
}

// --- duplicates ------------------------------------------------------------------------------

#[test]
fn a_duplicate_port_name_keeps_the_first_port() {
    // Also across protocols: the API server refuses any repeated name. Before, http/UDP was kept
    // as a second port.
    let out = load(&service(
        "web",
        "  clusterIP: 10.96.0.1\n  ports: [{name: http, port: 80}, {name: http, port: 81}, {name: http, port: 82, protocol: UDP}]\n",
    ));
    out.field_ignored("Service ns/web", "spec.ports[1].name", "duplicate port name \"http\" (first in spec.ports[0])");
    out.field_ignored("Service ns/web", "spec.ports[2].name", "duplicate port name \"http\" (first in spec.ports[0])");
    assert_eq!(out.ports("web"), vec!["http/80/tcp"]);
}

#[test]
fn a_duplicate_port_number_keeps_the_first_port() {
    // Before: both planned, and the second one's element replaced the first one's in
    // service-ips, leaving the first port's chain unreachable.
    let out = load(&service(
        "web",
        "  clusterIP: 10.96.0.1\n  ports: [{name: a, port: 80}, {name: b, port: 80}, {name: c, port: 80, protocol: UDP}]\n",
    ));
    out.field_ignored("Service ns/web", "spec.ports[1].port", "duplicate port 80/tcp (first in spec.ports[0])");
    assert_eq!(out.ports("web"), vec!["a/80/tcp", "c/80/udp"]);
    assert!(out.rendered.contains("10.96.0.1 . tcp . 80 counter packets 0 bytes 0 comment \"ns/web:a\""));
}

#[test]
fn a_duplicate_node_port_is_dropped_from_the_later_port() {
    let out = load(&service(
        "web",
        "  type: NodePort\n  clusterIP: 10.96.0.1\n  ports: [{name: a, port: 80, nodePort: 30080}, {name: b, port: 81, nodePort: 30080}]\n",
    ));
    out.field_ignored(
        "Service ns/web",
        "spec.ports[1].nodePort",
        "duplicate NodePort 30080/tcp (first in spec.ports[0])",
    );
    assert_eq!(out.ports("web"), vec!["a/80/tcp/30080", "b/81/tcp"]);
}

#[test]
fn a_duplicate_slice_port_name_keeps_the_first() {
    let out = load(&format!(
        "{}---\n{}",
        service("web", "  clusterIP: 10.96.0.1\n  ports: [{name: http, port: 80}]\n"),
        slice(
            "web-1",
            "web",
            "addressType: IPv4\nports: [{name: http, port: 8080}, {name: http, port: 9090}]\nendpoints: [{addresses: [\"10.244.0.5\"]}]\n",
        )
    ));
    out.field_ignored("EndpointSlice ns/web-1", "ports[1].name", "duplicate port name \"http\" (first in ports[0])");
    assert!(out.dnats_to("10.244.0.5 . 8080"), "{}", out.rendered);
    assert!(!out.rendered.contains("10.244.0.5 . 9090"));
}

// --- thousands -------------------------------------------------------------------------------

#[test]
fn a_service_with_thousands_of_ports_is_planned_whole() {
    let n = 5000;
    let ports: Vec<String> =
        (0..n).map(|i| format!("{{name: p{i}, port: {}, nodePort: {}}}", 1000 + i, 40000 + i)).collect();
    let eps = slice(
        "big-1",
        "big",
        &format!(
            "addressType: IPv4\nports: [{{name: p0, port: 8080}}, {{name: p{}, port: 8080}}]\nendpoints: [{{addresses: [\"10.244.0.5\"]}}, {{addresses: [\"10.244.0.6\"]}}]\n",
            n - 1
        ),
    );
    let start = std::time::Instant::now();
    let out = load(&format!(
        "{}---\n{eps}",
        service("big", &format!("  type: NodePort\n  clusterIP: 10.96.0.1\n  ports: [{}]\n", ports.join(", ")))
    ));
    assert!(out.problems.is_empty(), "{:#?}", out.problems);
    assert_eq!(out.ports("big").len(), n);
    // Two ports have endpoints (and the good service's one), the others reject.
    let elements = |set: &str| out.ruleset.tables[0].sets[set].elements.len();
    assert_eq!(elements("balanced-service-ips"), 3);
    assert_eq!(elements("no-endpoint-services"), n - 2);
    assert_eq!(elements("balanced-nodeports"), 2);
    assert_eq!(elements("no-endpoint-nodeports"), n - 2);
    out.assert_kernel_limits();
    // Duplicate detection is by map, not by scanning the ports seen so far.
    assert!(start.elapsed() < std::time::Duration::from_secs(60), "{:?}", start.elapsed());
}

#[test]
fn an_endpoint_slice_with_thousands_of_endpoints_is_planned_whole() {
    let n = 5000;
    let endpoints: Vec<String> =
        (0..n).map(|i| format!("{{addresses: [\"10.244.{}.{}\"]}}", i / 250, i % 250 + 1)).collect();
    let out = load(&format!(
        "{}---\n{}",
        service("web", "  clusterIP: 10.96.0.1\n  ports: [{name: http, port: 80}]\n"),
        slice(
            "web-1",
            "web",
            &format!("addressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{}]\n", endpoints.join(", "))
        )
    ));
    assert!(out.problems.is_empty(), "{:#?}", out.problems);
    let owner = "ns/web:http";
    let targets: usize = out.ruleset.tables[0]
        .sets
        .values()
        .filter(|s| s.name.starts_with("service-endpoints-"))
        .flat_map(|s| s.elements.values())
        .filter(|e| e.owner.to_string() == owner)
        .count();
    assert_eq!(targets, n);
    out.assert_kernel_limits();
}

// --- names at the limits ---------------------------------------------------------------------

#[test]
fn names_at_the_length_limits_are_planned_within_the_kernels_limits() {
    let ns = "n".repeat(63);
    let name = format!("{}z", "s".repeat(62));
    let port = "p".repeat(15);
    let slice_name = format!("{}.{}.{}.{}", "a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61));
    assert_eq!(slice_name.len(), 253);
    let yaml = format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {ns}}}
spec:
  type: LoadBalancer
  clusterIPs: [10.96.0.1, "fd00::1"]
  ipFamilies: [IPv4, IPv6]
  externalTrafficPolicy: Local
  sessionAffinity: ClientIP
  loadBalancerSourceRanges: [192.0.2.0/24, "2001:db8::/64"]
  ports: [{{name: {port}, port: 65535, nodePort: 32767, protocol: SCTP}}]
status: {{loadBalancer: {{ingress: [{{ip: 203.0.113.1}}, {{ip: "2001:db8::1"}}]}}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {slice_name}, namespace: {ns}, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv6
ports: [{{name: {port}, port: 65535, protocol: SCTP}}]
endpoints:
- {{addresses: ["fd00:ffff:ffff:ffff:ffff:ffff:ffff:fff1"], nodeName: node1}}
- {{addresses: ["fd00:ffff:ffff:ffff:ffff:ffff:ffff:fff2"], nodeName: node1}}
"#
    );
    let out = load(&yaml);
    assert!(out.problems.is_empty(), "{:#?}", out.problems);
    let client_set = out
        .rendered
        .lines()
        .find(|l| l.trim_start().starts_with("set affinity-") && l.contains("/sctp/"))
        .unwrap_or_default();
    assert!(client_set.ends_with(&format!("-{ns}/{name}/sctp/{port} {{")), "{}", out.rendered);
    out.assert_kernel_limits();
}

#[test]
fn names_past_the_length_limits_are_refused() {
    let long = "a".repeat(64);
    let out = load(&format!(
        "{}---\n{}",
        service(&long, "  clusterIP: 10.96.0.1\n  ports: [{port: 80}]\n"),
        slice(&"b".repeat(254), "ok", "addressType: IPv4\nendpoints: []\n")
    ));
    out.object_skipped(&format!("Service ns/{long}"), "metadata.name", "64 bytes long");
    out.object_skipped(&format!("EndpointSlice ns/{}", "b".repeat(254)), "metadata.name", "254 bytes long");
}

#[test]
fn a_namespace_past_the_length_limit_is_refused() {
    let ns = "n".repeat(64);
    let out = load(&format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: {ns}}}\nspec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}]}}\n"
    ));
    out.object_skipped(&format!("Service {ns}/web"), "metadata.namespace", "64 bytes long");
}

// --- non-ASCII names -------------------------------------------------------------------------

#[test]
fn a_non_ascii_service_name_is_refused() {
    let out = load(&service("wéb", "  clusterIP: 10.96.0.1\n  ports: [{port: 80}]\n"));
    out.object_skipped("Service ns/wéb", "metadata.name", "contains 'é'");
}

#[test]
fn a_non_ascii_namespace_is_refused() {
    let out = load(
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: ñs}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n",
    );
    out.object_skipped("Service ñs/web", "metadata.namespace", "contains 'ñ'");
}

#[test]
fn a_non_ascii_port_name_is_skipped_alone() {
    let out =
        load(&service("web", "  clusterIP: 10.96.0.1\n  ports: [{name: hţtp, port: 80}, {name: dns, port: 53}]\n"));
    out.field_ignored("Service ns/web", "spec.ports[0].name", "invalid port name \"hţtp\"");
    assert_eq!(out.ports("web"), vec!["dns/53/tcp"]);
}

#[test]
fn non_ascii_slice_names_are_refused() {
    let out = load(&format!(
        "{}---\n{}---\n{}",
        slice("wéb-1", "ok", "addressType: IPv4\nendpoints: []\n"),
        slice("web-2", "wéb", "addressType: IPv4\nendpoints: []\n"),
        slice("web-3", "ok", "addressType: IPv4\nports: [{name: ħttp, port: 8080}]\nendpoints: []\n"),
    ));
    out.object_skipped("EndpointSlice ns/wéb-1", "metadata.name", "contains 'é'");
    out.object_skipped("EndpointSlice ns/web-2", "metadata.labels[kubernetes.io/service-name]", "contains 'é'");
    out.field_ignored("EndpointSlice ns/web-3", "ports[0].name", "contains 'ħ'");
}

#[test]
fn a_non_ascii_node_name_is_refused() {
    let mut m = Manifests::default();
    manifests::load_text(Path::new("n.yaml"), "apiVersion: v1\nkind: Node\nmetadata: {name: nöde}\n", &mut m);
    let (state, problems) = state_from_manifests(&m, "nöde");
    assert!(state.node().is_none());
    assert_eq!(problems.len(), 1);
    assert_eq!(
        problems[0].object,
        ObjectRef { kind: crate::model::ObjectKind::Node, namespace: None, name: "nöde".into() }
    );
    assert_eq!(problems[0].field, "metadata.name");
    assert!(
        problems[0].to_string().contains("Node nöde: metadata.name skipped: contains 'ö': a DNS-1123 subdomain"),
        "{}",
        problems[0]
    );
}

#[test]
fn non_ascii_node_names_zones_and_hints_of_endpoints_change_nothing_else() {
    // They are only compared, never written into the ruleset.
    let out = load(&format!(
        "{}---\n{}",
        service("web", "  clusterIP: 10.96.0.1\n  ports: [{name: http, port: 80}]\n"),
        slice(
            "web-1",
            "web",
            "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints:\n- {addresses: [\"10.244.0.5\"], nodeName: nöde, zone: zöne, hints: {forZones: [{name: zöne}], forNodes: [{name: nöde}]}}\n- {addresses: [\"10.244.0.6\"], nodeName: \"日本\"}\n",
        )
    ));
    assert!(out.problems.is_empty(), "{:#?}", out.problems);
    assert!(out.rendered.contains("10.244.0.5 . 8080") && out.rendered.contains("10.244.0.6 . 8080"));
    assert!(!out.rendered.contains('ö') && !out.rendered.contains('日'));
}
