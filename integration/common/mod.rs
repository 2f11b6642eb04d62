//! Shared pieces of the integration tests: a lab with nftproxy on node1, manifests written to a
//! temporary directory, and the `nftproxy` binary run inside the node's namespace.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use std::sync::{Arc, Mutex};

use nftproxy::config::ProxyConfig;
use nftproxy::index::{Change, ClusterIndex, Update};
use nftproxy::model::{ClusterState, EndpointSliceInfo};
use nftproxy::net::L4Proto;
use nftproxy::netlink::Netfilter;
use nftproxy::nft::diff::Transaction;
use nftproxy::nft::wire::WireRuleset;
use nftproxy::sync::{NodePortResolver, SyncError, SyncReason, Synced, Syncer, local_nodeports};
use nftproxy_tools::lab::traffic::{self, Answer, Tally};
use nftproxy_tools::lab::{self, Lab, ServerSpec};
use nftproxy_tools::netfilter::Recording;

#[allow(unused_imports)]
pub use nftproxy_tools::apiserver;

/// `nft list ruleset` in a namespace.
pub fn ruleset_of(ns: &nftproxy_tools::lab::Netns) -> String {
    String::from_utf8_lossy(&ns.exec("nft", &["list", "ruleset"]).unwrap().stdout).into_owned()
}

/// The pods that answered.
pub fn backends(t: &nftproxy_tools::lab::traffic::Tally) -> std::collections::BTreeSet<String> {
    t.by_backend.keys().cloned().collect()
}

/// A set of names, to compare with [`backends`].
pub fn set(items: &[&str]) -> std::collections::BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// Manifests text as a source sends it to the index: complete lists of every kind. The text
/// must have no problems.
pub fn updates_of(yaml: &str) -> Vec<Update> {
    let mut m = nftproxy::source::manifests::Manifests::default();
    nftproxy::source::manifests::load_text(std::path::Path::new("cluster.yaml"), yaml, &mut m);
    assert!(m.problems.is_empty(), "{:?}", m.problems);
    let (updates, problems) = m.into_updates("node1");
    assert!(problems.is_empty(), "{problems:?}");
    updates
}

/// The agent's two halves, driven by hand: the index fed with manifests, the syncer applying
/// to a kernel wrapped in a [`Recording`], so a test can read each transaction sent.
pub struct Proxy {
    pub index: ClusterIndex,
    pub syncer: Syncer,
    pub log: Arc<Mutex<Vec<Transaction>>>,
}

impl Proxy {
    /// A proxy for node1 applying to `kernel`, node-port addresses read from this namespace.
    pub fn new(config: ProxyConfig, kernel: impl Netfilter + 'static) -> Proxy {
        Proxy::with_resolver(config, kernel, local_nodeports())
    }

    /// A proxy whose node-port addresses come from `nodeports`.
    pub fn with_resolver(config: ProxyConfig, kernel: impl Netfilter + 'static, nodeports: NodePortResolver) -> Proxy {
        let recording = Recording::new(kernel);
        let log = Arc::clone(&recording.log);
        Proxy { index: ClusterIndex::new(), syncer: Syncer::new(config, Box::new(recording), nodeports), log }
    }

    /// Replaces everything the index holds with `state`, as a source's relist does.
    pub fn replace_state(&mut self, state: ClusterState) {
        let slices: Vec<EndpointSliceInfo> =
            state.services().flat_map(|s| state.slices_of(&s.name).cloned().collect::<Vec<_>>()).collect();
        self.index.apply(Update::Service(Change::Reset(state.services().cloned().collect())));
        self.index.apply(Update::EndpointSlice(Change::Reset(slices)));
        self.index.apply(Update::Node(Change::Reset(state.node().cloned().into_iter().collect())));
    }

    /// The index's state.
    pub fn state(&self) -> &ClusterState {
        self.index.state()
    }

    /// The whole ruleset planned from scratch, windows where they are.
    pub fn desired(&mut self) -> WireRuleset {
        self.syncer.desired(self.index.state())
    }

    /// The index gets `yaml` as complete lists, as from a manifests source.
    pub fn load(&mut self, yaml: &str) {
        for update in updates_of(yaml) {
            self.index.apply(update);
        }
    }

    /// One sync of what changed since the last.
    pub fn sync(&mut self, reason: SyncReason, full: bool) -> Result<Synced, SyncError> {
        let pending = self.index.take_pending();
        self.syncer.sync(self.index.state(), &pending, reason, full)
    }

    /// The last transaction applied.
    pub fn last_transaction(&self) -> Transaction {
        self.log.lock().unwrap().last().cloned().unwrap_or_default()
    }

    /// The programmed ruleset as nft text.
    pub fn render(&mut self) -> String {
        self.syncer.render(self.index.state())
    }
}

/// Prints why a test is skipped and returns true when the machine cannot run lab tests; with
/// `NFTPROXY_PRIVILEGED_TESTS=1` ([`lab::PRIVILEGED_TESTS_ENV`]) it panics with the reason
/// instead, so the test fails.
pub fn skip_unless_privileged() -> bool {
    lab::skip_unless_privileged()
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
        lab.add_client("client2").unwrap();
        lab.start_servers(&[ServerSpec::tcp(8080), ServerSpec::udp(8080)]).unwrap();
        ClusterLab { lab, dir: tempfile::tempdir().unwrap() }
    }

    /// Writes manifests and returns their path.
    pub fn write(&self, name: &str, yaml: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        rewrite(&path, yaml);
        path
    }

    /// Runs `nftproxy <args>` inside node1.
    pub fn nftproxy(&self, args: &[&str]) -> Output {
        self.lab.node("node1").ns.command(env!("CARGO_BIN_EXE_nftproxy")).args(args).output().unwrap()
    }

    /// `nftproxy sync` of `yaml` on node1 with the lab's cluster CIDR; panics on failure.
    pub fn sync(&self, yaml: &str) -> String {
        self.sync_with(yaml, &[])
    }

    /// `nftproxy sync` with extra flags.
    pub fn sync_with(&self, yaml: &str, extra: &[&str]) -> String {
        let path = self.write("cluster.yaml", yaml);
        let mut args = vec!["sync", "--manifests", path.to_str().unwrap(), "--hostname-override", "node1"];
        if !extra.contains(&"--cluster-cidr") {
            args.extend_from_slice(&["--cluster-cidr", lab::topology::CLUSTER_CIDR_V4]);
        }
        args.extend_from_slice(extra);
        let out = self.nftproxy(&args);
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
        ruleset_of(&self.lab.node("node1").ns)
    }

    fn ns(&self, who: &str) -> &nftproxy_tools::lab::Netns {
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

/// Replaces the manifests at `path` as an editor saving by rename does: a hidden file beside it
/// (which the watcher skips), renamed over it, so a running proxy never reads it half-written.
pub fn rewrite(path: &std::path::Path, yaml: &str) {
    let name = path.file_name().unwrap().to_string_lossy();
    let staged = path.with_file_name(format!(".{name}.new"));
    std::fs::write(&staged, yaml).unwrap();
    std::fs::rename(&staged, path).unwrap();
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

/// A service for [`services_yaml`]: ports `http` 80/TCP and `dns` 53/UDP → 8080 on the pods;
/// with a node port N, `http` gets N and `dns` N+1.
#[derive(Clone, Default)]
pub struct Svc<'a> {
    pub name: &'a str,
    pub cluster_ip: &'a str,
    pub kind: &'a str,
    pub node_port: Option<u16>,
    pub external_local: bool,
    pub internal_local: bool,
    pub lb_ips: &'a [&'a str],
    pub external_ips: &'a [&'a str],
    pub source_ranges: &'a [&'a str],
    pub health_check_port: Option<u16>,
    pub affinity_secs: Option<u32>,
    pub endpoints: &'a [Ep<'a>],
    /// Extra endpoint fields per endpoint (by index), e.g. `hints: {forZones: [{name: a}]}`.
    pub endpoint_extra: &'a [&'a str],
}

fn list(items: &[&str]) -> String {
    items.iter().map(|i| format!("\"{}\"", i.trim())).collect::<Vec<_>>().join(", ")
}

/// Manifests for these services in namespace `default`.
pub fn services_yaml(services: &[Svc<'_>]) -> String {
    let mut out = String::new();
    for s in services {
        let kind = if s.kind.is_empty() { "ClusterIP" } else { s.kind };
        let np = |offset: u16| s.node_port.map(|n| format!(", nodePort: {}", n + offset)).unwrap_or_default();
        out.push_str(&format!(
            r#"apiVersion: v1
kind: Service
metadata: {{name: {}, namespace: default}}
spec:
  type: {kind}
  clusterIP: {}
"#,
            s.name, s.cluster_ip
        ));
        if s.external_local {
            out.push_str("  externalTrafficPolicy: Local\n");
        }
        if s.internal_local {
            out.push_str("  internalTrafficPolicy: Local\n");
        }
        if !s.external_ips.is_empty() {
            out.push_str(&format!("  externalIPs: [{}]\n", list(s.external_ips)));
        }
        if !s.source_ranges.is_empty() {
            out.push_str(&format!("  loadBalancerSourceRanges: [{}]\n", list(s.source_ranges)));
        }
        if let Some(p) = s.health_check_port {
            out.push_str(&format!("  healthCheckNodePort: {p}\n"));
        }
        if let Some(t) = s.affinity_secs {
            out.push_str(&format!(
                "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {t}}}}}\n"
            ));
        }
        out.push_str(&format!(
            "  ports:\n  - {{name: http, port: 80, protocol: TCP, targetPort: 8080{}}}\n  - {{name: dns, port: 53, protocol: UDP, targetPort: 8080{}}}\n",
            np(0),
            np(1)
        ));
        if !s.lb_ips.is_empty() {
            let ingress: Vec<String> = s.lb_ips.iter().map(|ip| format!("{{ip: {ip}}}")).collect();
            out.push_str(&format!("status:\n  loadBalancer:\n    ingress: [{}]\n", ingress.join(", ")));
        }
        out.push_str(&format!(
            r#"---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {}-abcde
  namespace: default
  labels: {{kubernetes.io/service-name: {}}}
addressType: IPv4
ports:
- {{name: http, port: 8080, protocol: TCP}}
- {{name: dns, port: 8080, protocol: UDP}}
endpoints:
"#,
            s.name, s.name
        ));
        if s.endpoints.is_empty() {
            out.push_str("  []\n");
        }
        for (i, (ip, node, ready)) in s.endpoints.iter().enumerate() {
            out.push_str(&format!(
                "  - addresses: [\"{ip}\"]\n    nodeName: {node}\n    conditions: {{ready: {ready}}}\n"
            ));
            if let Some(extra) = s.endpoint_extra.get(i)
                && !extra.is_empty()
            {
                out.push_str(&format!("    {extra}\n"));
            }
        }
        out.push_str("---\n");
    }
    out.push_str(
        r#"apiVersion: v1
kind: Node
metadata:
  name: node1
  labels: {topology.kubernetes.io/zone: zone-a}
status:
  addresses: [{type: InternalIP, address: 192.168.50.2}]
"#,
    );
    out
}

/// `nftproxy run` inside node1, killed on drop.
pub struct RunningProxy {
    pub child: std::process::Child,
}

impl Drop for RunningProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ClusterLab {
    /// Starts `nftproxy run --manifests <dir>` in node1 with `extra` flags, and waits for its
    /// first sync (healthz answering 200).
    pub fn run_proxy(&self, manifests: &std::path::Path, extra: &[&str]) -> RunningProxy {
        self.run_proxy_from(&["--manifests", manifests.to_str().unwrap()], extra)
    }

    /// Starts `nftproxy run <source> <extra>` in node1 and waits for its first sync.
    pub fn run_proxy_from(&self, source: &[&str], extra: &[&str]) -> RunningProxy {
        let mut args = vec!["run"];
        args.extend_from_slice(source);
        args.extend_from_slice(&[
            "--hostname-override",
            "node1",
            "--cluster-cidr",
            lab::topology::CLUSTER_CIDR_V4,
            "--healthz-bind-address",
            "127.0.0.1:10256",
            "--min-sync-period",
            "100ms",
        ]);
        // nf_conntrack_max and the hashsize are global: a test never tries to change them.
        if !extra.contains(&"--conntrack-max-per-core") {
            args.extend_from_slice(&["--conntrack-max-per-core", "0"]);
        }
        args.extend_from_slice(extra);
        let log = std::fs::File::create(self.dir.path().join("proxy.log")).unwrap();
        let child = self
            .lab
            .node("node1")
            .ns
            .command(env!("CARGO_BIN_EXE_nftproxy"))
            .args(&args)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let proxy = RunningProxy { child };
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok((200, _)) = self.http_get("node1", "127.0.0.1:10256", "/healthz")
                && self.listing().contains("table ip nftproxy")
            {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "nftproxy run did not become healthy:\n{}", self.proxy_log());
            std::thread::sleep(Duration::from_millis(50));
        }
        proxy
    }

    /// What `nftproxy run` logged.
    pub fn proxy_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("proxy.log")).unwrap_or_default()
    }

    /// A minimal HTTP GET from `who`; returns the status and body.
    pub fn http_get(&self, who: &str, addr: &str, path: &str) -> std::io::Result<(u16, String)> {
        let target: SocketAddr = addr.parse().unwrap();
        let path = path.to_string();
        self.ns(who).run(move || traffic::http_get(target, &path, TIMEOUT)).unwrap()
    }

    /// Polls `f` until it returns true or `within` passes.
    pub fn eventually(&self, within: Duration, mut f: impl FnMut() -> bool) -> bool {
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        f()
    }
}

/// A tool of `scripts/operator-bins` (`helm`, `promtool`): from `$NFTPROXY_OPERATOR_BIN` when
/// set, else what the script builds or has cached (well under a second once cached; about 5
/// minutes on a fresh 2-core machine).
pub fn operator_bin(name: &str) -> PathBuf {
    nftproxy_tools::controlplane::operator_bin(name).unwrap_or_else(|e| panic!("{e}"))
}
