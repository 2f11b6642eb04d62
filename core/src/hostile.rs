//! Hostile input, from manifest text to the rendered ruleset: each bad piece is reported with
//! the object and the field, skipped alone, and a good service in the same input is still
//! planned and rendered.
//!
//! The cases are data, one file each in `core/fixtures/hostile/`, run by [`hostile_input`]: the
//! manifests (`input`) are loaded beside a good service, converted, planned and rendered for
//! node1, and what the file expects is checked (see [`Case`]). The cases whose input is
//! generated (thousands of ports or endpoints, names at the length limits) or that plan for
//! another node are tests here.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use crate::fixtures::{NODE, config, plan_with};
use crate::manifests::{self, Manifests, state_from_manifests};
use crate::model::{ClusterState, NamespacedName, ObjectKind, ObjectRef, Problem};
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

/// One case of `core/fixtures/hostile/`: the input and what must come of it. Every list may be
/// left out; services are named `namespace/name`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    /// The manifests (loaded as one file, with [`GOOD`] after them).
    input: String,
    /// Fields skipped alone: exactly one problem for each object and field, not skipping the
    /// object, whose reason contains `reason`.
    #[serde(default)]
    field_ignored: Vec<Expected>,
    /// Objects skipped: exactly one problem for each object and field, skipping the object.
    #[serde(default)]
    object_skipped: Vec<Expected>,
    /// No object or field is reported at all.
    #[serde(default)]
    no_problems: bool,
    /// Documents that cannot be read at all: exactly these, in order.
    unreadable: Option<Vec<Unreadable>>,
    /// Services not planned.
    #[serde(default)]
    absent: Vec<String>,
    /// The ports a service was planned with, as `name/port/protocol[/nodePort]`.
    #[serde(default)]
    ports: BTreeMap<String, Vec<String>>,
    /// The ClusterIPs of a service's first port.
    #[serde(default)]
    cluster_ips: BTreeMap<String, Vec<IpAddr>>,
    /// Whether a service's first port counts as reachable from outside the cluster.
    #[serde(default)]
    externally_accessible: BTreeMap<String, bool>,
    /// How many addresses node1 was planned with.
    node_addresses: Option<usize>,
    /// How many ports the first EndpointSlice of a service kept.
    #[serde(default)]
    slice_ports: BTreeMap<String, usize>,
    /// Text the rendered ruleset contains.
    #[serde(default)]
    rendered: Vec<String>,
    /// Text it does not contain.
    #[serde(default)]
    not_rendered: Vec<String>,
    /// Endpoints (`ip . port`) some balanced service address DNATs to.
    #[serde(default)]
    dnats: Vec<String>,
}

/// A problem a case expects.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Expected {
    /// `Kind namespace/name`, as a problem names its object.
    object: String,
    field: String,
    reason: String,
}

/// A document that cannot be read.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Unreadable {
    /// The object's `namespace/name`.
    name: String,
    /// Text its reason contains (the field that could not be read).
    reason: String,
}

/// Every case in `core/fixtures/hostile/`; all failures are reported, each with its case.
#[test]
fn hostile_input() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hostile");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 30, "{} holds {} cases", dir.display(), files.len());
    let mut failures = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let case: Case = serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let name = file.file_stem().unwrap_or_default().to_string_lossy();
        failures.extend(case.failures().into_iter().map(|f| format!("{name}: {f}")));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

impl Case {
    /// What of this case's expectations the outcome of its input does not meet.
    fn failures(&self) -> Vec<String> {
        let out = load(&self.input);
        let mut failures = out.good_planned();
        for e in &self.field_ignored {
            failures.extend(out.problem(&e.object, &e.field, false, &e.reason));
        }
        for e in &self.object_skipped {
            failures.extend(out.problem(&e.object, &e.field, true, &e.reason));
        }
        if self.no_problems && !out.problems.is_empty() {
            failures.push(format!("problems reported: {:#?}", out.problems));
        }
        if let Some(unreadable) = &self.unreadable {
            let p = &out.manifests.problems;
            let matches = p.len() == unreadable.len()
                && p.iter()
                    .zip(unreadable)
                    .all(|(p, u)| p.name.as_deref() == Some(u.name.as_str()) && p.reason.contains(&u.reason));
            if !matches {
                failures.push(format!("unreadable documents {p:#?}, expected {unreadable:?}"));
            }
        }
        for service in &self.absent {
            if out.state.service(&name(service)).is_some() {
                failures.push(format!("{service} was planned"));
            }
        }
        for (service, ports) in &self.ports {
            let planned = out.ports(service);
            if planned.as_ref() != Some(ports) {
                failures.push(format!("{service} was planned with ports {planned:?}, expected {ports:?}"));
            }
        }
        for (service, ips) in &self.cluster_ips {
            let planned = out.state.service(&name(service)).map(|s| s.ports[0].cluster_ips.clone());
            if planned.as_ref() != Some(ips) {
                failures.push(format!("{service}'s ClusterIPs are {planned:?}, expected {ips:?}"));
            }
        }
        for (service, accessible) in &self.externally_accessible {
            let planned = out.state.service(&name(service)).map(|s| s.ports[0].externally_accessible());
            if planned != Some(*accessible) {
                failures.push(format!("{service} externally accessible: {planned:?}, expected {accessible}"));
            }
        }
        if let Some(n) = self.node_addresses {
            let planned = out.state.node().map(|node| node.host_ips.len());
            if planned != Some(n) {
                failures.push(format!("node1 has {planned:?} addresses, expected {n}"));
            }
        }
        for (service, n) in &self.slice_ports {
            let kept = out.state.slices_of(&name(service)).next().map(|s| s.ports.len());
            if kept != Some(*n) {
                failures.push(format!("{service}'s first EndpointSlice kept {kept:?} ports, expected {n}"));
            }
        }
        for text in &self.rendered {
            if !out.rendered.contains(text.as_str()) {
                failures.push(format!("the ruleset lacks {text:?}:\n{}", out.rendered));
            }
        }
        for text in &self.not_rendered {
            if out.rendered.contains(text.as_str()) {
                failures.push(format!("the ruleset contains {text:?}:\n{}", out.rendered));
            }
        }
        for target in &self.dnats {
            if !out.dnats_to(target) {
                failures.push(format!("nothing DNATs to {target}:\n{}", out.rendered));
            }
        }
        failures
    }
}

/// `namespace/name`.
fn name(service: &str) -> NamespacedName {
    let (namespace, name) = service.split_once('/').unwrap_or_else(|| panic!("{service}: expected namespace/name"));
    NamespacedName::new(namespace, name)
}

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
    Outcome { manifests: m, state, problems, ruleset, rendered }
}

impl Outcome {
    /// Whether the good service is planned: its ClusterIP is balanced, to its pod.
    fn good_planned(&self) -> Vec<String> {
        let mut failures = Vec::new();
        if !self.rendered.contains("10.96.9.1 . tcp . 80 counter packets 0 bytes 0 comment \"ns/ok:http\"") {
            failures.push(format!("good service not dispatched:\n{}", self.rendered));
        }
        if !self.dnats_to("10.244.9.1 . 8080") {
            failures.push("good service has no DNAT".to_string());
        }
        failures
    }

    /// Asserts that the good service is planned.
    fn assert_good_planned(&self) {
        let failures = self.good_planned();
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// Whether some balanced service address DNATs to `target` (`ip . port`).
    fn dnats_to(&self, target: &str) -> bool {
        self.rendered.contains(&format!(" : {target}\n"))
            || self.rendered.contains(&format!(" : {target},"))
            || self.rendered.contains(&format!(" : {target} }}"))
    }

    /// Unless there is exactly one problem for `object`'s `field` (skipping the object, or
    /// not), its message naming both and its reason containing `reason`: what is wrong.
    fn problem(&self, object: &str, field: &str, skipped: bool, reason: &str) -> Option<String> {
        let found: Vec<&Problem> = self
            .problems
            .iter()
            .filter(|p| p.object.to_string() == object && p.field == field && p.object_skipped == skipped)
            .collect();
        if found.len() != 1 {
            return Some(format!("expected one problem for {object} {field}, got {:#?}", self.problems));
        }
        let text = found[0].to_string();
        if !(text.contains(object) && text.contains(field)) {
            return Some(format!("the problem does not name {object} and {field}: {text}"));
        }
        (!found[0].reason.contains(reason)).then(|| format!("the reason is not {reason:?}: {}", found[0]))
    }

    /// The ports `namespace/name` was planned with, as `name/port/protocol[/nodePort]`.
    fn ports(&self, service: &str) -> Option<Vec<String>> {
        let info = self.state.service(&name(service))?;
        Some(
            info.ports
                .iter()
                .map(|p| {
                    let mut s = format!("{}/{}/{}", p.name.port, p.port, p.name.protocol);
                    if let Some(np) = p.node_port {
                        s.push_str(&format!("/{np}"));
                    }
                    s
                })
                .collect(),
        )
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
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: ns}}
spec:
{spec}"#
    )
}

fn slice(name: &str, service: &str, body: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: ns, labels: {{kubernetes.io/service-name: {service}}}}}\n{body}"
    )
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
    out.assert_good_planned();
    assert!(out.problems.is_empty(), "{:#?}", out.problems);
    assert_eq!(out.ports("ns/big").map(|p| p.len()), Some(n));
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
    out.assert_good_planned();
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
    out.assert_good_planned();
    assert!(out.problems.is_empty(), "{:#?}", out.problems);
    let chain = out
        .rendered
        .lines()
        .find(|l| l.trim_start().starts_with("chain service-") && l.contains("/sctp/"))
        .unwrap_or_default();
    assert!(chain.ends_with(&format!("-{ns}/{name}/sctp/{port} {{")), "{}", out.rendered);
    out.assert_kernel_limits();
}

// --- non-ASCII names -------------------------------------------------------------------------

#[test]
fn a_non_ascii_node_name_is_refused() {
    let mut m = Manifests::default();
    manifests::load_text(Path::new("n.yaml"), "apiVersion: v1\nkind: Node\nmetadata: {name: nöde}\n", &mut m);
    let (state, problems) = state_from_manifests(&m, "nöde");
    assert!(state.node().is_none());
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].object, ObjectRef { kind: ObjectKind::Node, namespace: None, name: "nöde".into() });
    assert_eq!(problems[0].field, "metadata.name");
    assert!(
        problems[0].to_string().contains("Node nöde: metadata.name skipped: contains 'ö': a DNS-1123 subdomain"),
        "{}",
        problems[0]
    );
}
