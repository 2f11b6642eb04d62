//! Shared pieces of the integration tests: a lab with nftproxy on node1, manifests written to a
//! temporary directory, and the `nftproxy` binary run inside the node's namespace.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use nftproxy::lab::traffic::{self, Answer, Tally};
use nftproxy::lab::{self, Lab, ServerSpec};
use nftproxy::net::L4Proto;

/// Prints why a test is skipped and returns true when the machine cannot run lab tests.
pub fn skip_unless_privileged() -> bool {
    if let Err(e) = lab::require_privileges() {
        eprintln!("SKIPPED: {e}");
        return true;
    }
    false
}

/// A lab with nodes node1 (web-1, web-2) and node2 (web-3), a client outside the cluster,
/// echo servers on 8080/TCP and 8080/UDP, and a directory for manifests.
pub struct ClusterLab {
    pub lab: Lab,
    pub dir: tempfile::TempDir,
}

pub const TIMEOUT: Duration = Duration::from_secs(2);

impl ClusterLab {
    pub fn new() -> ClusterLab {
        lab::cleanup_stale();
        let mut lab = Lab::new().expect("lab");
        lab.add_node("node1").unwrap();
        lab.add_node("node2").unwrap();
        lab.add_pod("web-1", "node1").unwrap();
        lab.add_pod("web-2", "node1").unwrap();
        lab.add_pod("web-3", "node2").unwrap();
        lab.add_client("client").unwrap();
        lab.start_servers(&[ServerSpec::tcp(8080), ServerSpec::udp(8080)]).unwrap();
        ClusterLab { lab, dir: tempfile::tempdir().unwrap() }
    }

    /// Writes manifests and returns their path.
    pub fn write(&self, name: &str, yaml: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, yaml).unwrap();
        path
    }

    /// Runs `nftproxy <args>` inside node1.
    pub fn nftproxy(&self, args: &[&str]) -> Output {
        self.lab.node("node1").ns.command(env!("CARGO_BIN_EXE_nftproxy")).args(args).output().unwrap()
    }

    /// `nftproxy sync` of `yaml` on node1 with the lab's cluster CIDR; panics on failure.
    pub fn sync(&self, yaml: &str) -> String {
        let path = self.write("cluster.yaml", yaml);
        let out = self.nftproxy(&[
            "sync",
            "--manifests",
            path.to_str().unwrap(),
            "--hostname-override",
            "node1",
            "--cluster-cidr",
            lab::topology::CLUSTER_CIDR_V4,
        ]);
        assert!(out.status.success(), "sync failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `nftproxy render` of `yaml` for node1.
    pub fn render(&self, yaml: &str) -> String {
        let path = self.write("render.yaml", yaml);
        let out = self.nftproxy(&[
            "render",
            "--manifests",
            path.to_str().unwrap(),
            "--hostname-override",
            "node1",
            "--cluster-cidr",
            lab::topology::CLUSTER_CIDR_V4,
        ]);
        assert!(out.status.success(), "render failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `nft list ruleset` in node1.
    pub fn listing(&self) -> String {
        String::from_utf8_lossy(&self.lab.node("node1").ns.exec("nft", &["list", "ruleset"]).unwrap().stdout).into_owned()
    }

    fn ns(&self, who: &str) -> &nftproxy::lab::Netns {
        if let Some(c) = self.lab.client(who) {
            return &c.ns;
        }
        if let Some(p) = self.lab.pod(who) {
            return &p.ns;
        }
        &self.lab.node(who).ns
    }

    /// Asks `target` `n` times from `who` (a client, pod or node name).
    pub fn tally(&self, who: &str, protocol: L4Proto, target: &str, n: usize) -> Tally {
        let target: SocketAddr = target.parse().unwrap();
        self.ns(who).run(move || traffic::tally(protocol, target, n, TIMEOUT)).unwrap()
    }

    /// Asks `target` once from `who`.
    pub fn ask(&self, who: &str, protocol: L4Proto, target: &str) -> std::io::Result<Answer> {
        let target: SocketAddr = target.parse().unwrap();
        self.ns(who).run(move || traffic::ask(protocol, target, TIMEOUT)).unwrap()
    }
}

/// One endpoint of the web service: (pod IP, node, ready).
pub type Ep<'a> = (&'a str, &'a str, bool);

/// The lab's pods.
pub const WEB_1: Ep<'static> = ("10.244.1.10", "node1", true);
pub const WEB_2: Ep<'static> = ("10.244.1.11", "node1", true);
pub const WEB_3: Ep<'static> = ("10.244.2.10", "node2", true);

/// Service default/web (ClusterIP 10.96.0.10: http 80/TCP and dns 53/UDP → 8080) with these
/// endpoints, plus default/empty (10.96.0.20, no endpoints).
pub fn web_manifests(endpoints: &[Ep<'_>]) -> String {
    let mut eps = String::new();
    for (ip, node, ready) in endpoints {
        eps.push_str(&format!("  - addresses: [\"{ip}\"]\n    nodeName: {node}\n    conditions: {{ready: {ready}}}\n"));
    }
    if endpoints.is_empty() {
        eps.push_str("  []\n");
    }
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {{name: http, port: 80, protocol: TCP, targetPort: 8080}}
  - {{name: dns, port: 53, protocol: UDP, targetPort: 8080}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1a2b3
  namespace: default
  labels: {{kubernetes.io/service-name: web}}
addressType: IPv4
ports:
- {{name: http, port: 8080, protocol: TCP}}
- {{name: dns, port: 8080, protocol: UDP}}
endpoints:
{eps}---
apiVersion: v1
kind: Service
metadata: {{name: empty, namespace: default}}
spec:
  clusterIP: 10.96.0.20
  ports:
  - {{name: http, port: 80, protocol: TCP}}
  - {{name: dns, port: 53, protocol: UDP}}
"#
    )
}
