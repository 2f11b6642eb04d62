//! The operator's path on real nodes, phase by phase, with clients opening new connections to
//! the Services all along: kubeadm's kube-proxy DaemonSet (upstream's image, nftables mode)
//! serves first; the image swap to nftproxy (`kubectl set image` and nothing else); the way back
//! (`kubectl rollout undo`); the longer path (`kubectl apply -k deploy/` on nodes whose rules a
//! reboot emptied); then node events under nftproxy: kubelet and containerd restarted, a node
//! rebooted, a rolling update of nftproxy's DaemonSet from one build to another. Each phase
//! records its failure counts ([`PhaseRecord`]); the integration test requires none where the
//! Services' endpoints did not change, and `nftproxy-tools nodes --scenario` writes them to a
//! dated results file.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::cluster::{ClusterError, NodeCluster};
use super::config::IptablesBackend;
use super::error::NodeError;
use super::kubeadm;
use super::probe::{Ask, ProbeReport, Prober, Target};
use crate::lab::topology::{CLUSTER_CIDR_V4, SERVICE_CIDR_V4};

/// nftproxy's image as `scripts/images` names it, and a second build of it (another digest).
pub const NFTPROXY_IMAGE: &str = "nftproxy:0.1.0";
pub const NFTPROXY_ROLLOUT_IMAGE: &str = "nftproxy:0.1.0-rollout";
/// The workload: web servers and clients on every node, and their Services.
const WORKLOAD: &str = include_str!("manifests/workload.yaml");
/// The LoadBalancer address the scenario gives `web-local` (the wan routes it to node 1).
pub const LOAD_BALANCER_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// The `web` Service's DNS name.
const WEB_NAME: &str = "web.default.svc.cluster.local";
/// How long the clients keep asking after a change is complete.
const SETTLE: Duration = Duration::from_secs(5);

/// The node daemons a phase restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeDaemon {
    Kubelet,
    Containerd,
}

/// What one phase saw.
#[derive(Debug, Clone, Default)]
pub struct PhaseRecord {
    pub name: String,
    pub took: Duration,
    /// Whether the Services' endpoints stayed as they were (then no failure is allowed).
    pub endpoints_unchanged: bool,
    pub probes: Vec<ProbeReport>,
    pub notes: Vec<String>,
}

impl PhaseRecord {
    /// Failed asks across the phase's clients.
    pub fn failed(&self) -> usize {
        self.probes.iter().map(ProbeReport::failed).sum()
    }

    /// Successful asks across the phase's clients.
    pub fn ok(&self) -> usize {
        self.probes.iter().map(ProbeReport::ok).sum()
    }
}

/// A cluster of real nodes running the scenario, and what its phases saw.
pub struct NodeScenario {
    pub cluster: NodeCluster,
    dir: tempfile::TempDir,
    pub records: Vec<PhaseRecord>,
}

impl NodeScenario {
    /// Boots `nodes` with `images`, installs kubeadm's kube-proxy (nftables mode) and CoreDNS
    /// addons as kubeadm writes them, and waits until both serve.
    pub fn start(nodes: &[(&str, IptablesBackend)], images: &[PathBuf]) -> Result<NodeScenario, ClusterError> {
        let started = Instant::now();
        let cluster = NodeCluster::start_with(nodes, images)?;
        let dir = tempfile::Builder::new().prefix("nftproxy-scenario-").tempdir().map_err(NodeError::from)?;
        let mut s = NodeScenario { cluster, dir, records: Vec::new() };
        let config = kubeadm::configuration(
            s.cluster.cp.ip,
            CLUSTER_CIDR_V4,
            SERVICE_CIDR_V4,
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n",
        );
        let mut notes = Vec::new();
        for addon in ["kube-proxy", "coredns"] {
            let out = kubeadm::addon(&s.cluster.cp, s.dir.path(), addon, &config)?;
            notes.push(format!("kubeadm init phase addon {addon}: {}", out.trim()));
        }
        s.rollout("daemonset/kube-proxy", Duration::from_secs(180))?;
        s.rollout("deployment/coredns", Duration::from_secs(180))?;
        s.records.push(PhaseRecord {
            name: "boot: nodes Ready, kubeadm's kube-proxy and CoreDNS serving".into(),
            took: started.elapsed(),
            notes,
            ..PhaseRecord::default()
        });
        Ok(s)
    }

    /// The scenario's working directory (kubeadm's configuration, the edited `deploy/`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `kubectl` as the admin; its output, or an error with its stderr.
    pub fn kubectl(&self, args: &[&str]) -> Result<String, ClusterError> {
        Ok(self.cluster.cp.kubectl_ok(args)?)
    }

    /// `kubectl -n kube-system rollout status <what>`.
    pub fn rollout(&self, what: &str, within: Duration) -> Result<(), ClusterError> {
        let timeout = format!("--timeout={}s", within.as_secs());
        self.kubectl(&["-n", "kube-system", "rollout", "status", what, &timeout]).map(|_| ()).map_err(|e| {
            ClusterError::Timeout { what: format!("rollout of {what}"), waited: within, detail: self.diagnose(&e) }
        })
    }

    /// What a failure message should carry: the error, the pods, the nodes' logs.
    pub fn diagnose(&self, e: &dyn std::fmt::Display) -> String {
        let pods = self.cluster.cp.kubectl_ok(&["get", "pods", "-A", "-o", "wide"]).unwrap_or_default();
        let events =
            self.cluster.cp.kubectl_ok(&["get", "events", "-A", "--sort-by=.lastTimestamp"]).unwrap_or_default();
        let tail: Vec<&str> = events.lines().rev().take(25).collect();
        let logs: Vec<String> = self.cluster.nodes.iter().map(super::machine::Node::logs).collect();
        format!("{e}\n{pods}\n{}\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"), logs.join("\n"))
    }

    /// Deploys the workload, gives `web-local` its load-balancer address, and waits until every
    /// Service answers from every client.
    pub fn deploy_workload(&mut self) -> Result<(), ClusterError> {
        let started = Instant::now();
        self.cluster.cp.apply(WORKLOAD)?;
        self.cluster.cp.patch_status(
            "service",
            Some("default"),
            "web-local",
            &serde_json::json!({"loadBalancer": {"ingress": [{"ip": LOAD_BALANCER_IP.to_string()}]}}),
        )?;
        for ds in ["web", "client"] {
            self.kubectl(&["-n", "default", "rollout", "status", &format!("daemonset/{ds}"), "--timeout=180s"])
                .map_err(|e| ClusterError::Timeout {
                    what: format!("daemonset {ds}"),
                    waited: Duration::from_secs(180),
                    detail: self.diagnose(&e),
                })?;
        }
        self.wait_until_served(Duration::from_secs(60))?;
        self.records.push(PhaseRecord {
            name: "workload: web and client pods on every node, Services served by kube-proxy".into(),
            took: started.elapsed(),
            ..PhaseRecord::default()
        });
        Ok(())
    }

    /// Every client's targets: from each client pod, the web ClusterIP, DNS through CoreDNS's
    /// ClusterIP and the other node's NodePort; from the wan, every node's NodePort and the
    /// Local LoadBalancer address.
    pub fn clients(&self) -> Result<Vec<(String, PathBuf, Vec<Target>)>, ClusterError> {
        let web = self.cluster_ip("default", "web")?;
        let http = |addr: SocketAddr| Ask::Http { addr, path: "/hostname".into() };
        let node_ips: Vec<(String, Ipv4Addr)> =
            self.cluster.nodes.iter().map(|n| (n.spec.name.clone(), n.spec.ip)).collect();
        let mut out = Vec::new();
        for (uid, node) in self.pods("default", "app=client")? {
            let Some(n) = self.cluster.node(&node) else { continue };
            let netns = n.pod_netns(&uid).ok_or_else(|| {
                NodeError::Setup(format!("client pod {uid} on {node} has no process (is it running?)"))
            })?;
            let mut targets = vec![
                Target { name: "web ClusterIP".into(), ask: http(SocketAddr::new(IpAddr::V4(web), 80)) },
                Target {
                    name: "DNS via kube-dns ClusterIP".into(),
                    ask: Ask::Dns {
                        server: SocketAddr::new(IpAddr::V4(super::cluster::CLUSTER_DNS), 53),
                        name: WEB_NAME.into(),
                    },
                },
            ];
            for (other, ip) in node_ips.iter().filter(|(o, _)| *o != node) {
                targets.push(Target {
                    name: format!("NodePort on {other}"),
                    ask: http(SocketAddr::new(IpAddr::V4(*ip), 30080)),
                });
            }
            out.push((format!("client pod on {node}"), netns, targets));
        }
        let wan_client = self.cluster.lab.clients.iter().find(|c| c.name != "control-plane");
        let wan_netns = match wan_client {
            Some(c) => PathBuf::from(format!("/run/netns/{}", c.ns.name())),
            None => PathBuf::from(format!("/run/netns/{}", self.cluster.cp.namespace())),
        };
        let mut wan = Vec::new();
        for (name, ip) in &node_ips {
            wan.push(Target {
                name: format!("NodePort on {name}"),
                ask: http(SocketAddr::new(IpAddr::V4(*ip), 30080)),
            });
        }
        wan.push(Target {
            name: "LoadBalancer (Local)".into(),
            ask: http(SocketAddr::new(IpAddr::V4(LOAD_BALANCER_IP), 80)),
        });
        out.push(("outside the cluster (wan)".into(), wan_netns, wan));
        Ok(out)
    }

    /// Waits until one round of every client's asks succeeds (a client pod that kubelet is
    /// still starting again counts as not served yet).
    pub fn wait_until_served(&self, within: Duration) -> Result<(), ClusterError> {
        let deadline = Instant::now() + within;
        let mut last = String::new();
        while Instant::now() < deadline {
            match self.clients() {
                Ok(clients) => {
                    let probers: Vec<Prober> = clients
                        .into_iter()
                        .map(|(from, netns, targets)| {
                            Prober::start(&from, netns, targets, Duration::from_millis(50), Duration::from_secs(2))
                        })
                        .collect();
                    std::thread::sleep(Duration::from_millis(300));
                    let reports: Vec<ProbeReport> = probers.into_iter().map(Prober::finish).collect();
                    let failed = reports.iter().any(|r| r.failed() > 0 || r.targets.values().any(|c| c.ok == 0));
                    if !failed && reports.len() == self.cluster.nodes.len() + 1 {
                        return Ok(());
                    }
                    last = reports.iter().flat_map(ProbeReport::lines).collect::<Vec<_>>().join("\n");
                }
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Err(ClusterError::Timeout {
            what: "every Service answers every client".into(),
            waited: within,
            detail: self.diagnose(&last),
        })
    }

    /// Runs `change` with every client asking all along and for a few seconds after it, and
    /// records the phase.
    pub fn probed(
        &mut self,
        name: &str,
        endpoints_unchanged: bool,
        change: impl FnOnce(&mut NodeScenario) -> Result<Vec<String>, ClusterError>,
    ) -> Result<&PhaseRecord, ClusterError> {
        let started = Instant::now();
        let clients = self.clients()?;
        let probers: Vec<Prober> = clients
            .into_iter()
            .map(|(from, netns, targets)| {
                Prober::start(&from, netns, targets, Duration::from_millis(20), Duration::from_secs(2))
            })
            .collect();
        let result = change(self);
        std::thread::sleep(SETTLE);
        let probes: Vec<ProbeReport> = probers.into_iter().map(Prober::finish).collect();
        let notes = result?;
        self.records.push(PhaseRecord {
            name: name.to_string(),
            took: started.elapsed(),
            endpoints_unchanged,
            probes,
            notes,
        });
        Ok(&self.records[self.records.len() - 1])
    }

    /// A Service's ClusterIP.
    pub fn cluster_ip(&self, namespace: &str, name: &str) -> Result<Ipv4Addr, ClusterError> {
        let text = self.kubectl(&["-n", namespace, "get", "service", name, "-o", "jsonpath={.spec.clusterIP}"])?;
        text.trim()
            .parse()
            .map_err(|_| NodeError::Setup(format!("service {namespace}/{name} has ClusterIP {text:?}")).into())
    }

    /// Pods matching a label selector: (UID, node).
    pub fn pods(&self, namespace: &str, selector: &str) -> Result<Vec<(String, String)>, ClusterError> {
        self.pods_by(namespace, selector, "uid", &["--field-selector=status.phase=Running"])
    }

    /// `(.metadata.<field>, .spec.nodeName)` of the pods matching a selector, with `filters`.
    fn pods_by(
        &self,
        namespace: &str,
        selector: &str,
        field: &str,
        filters: &[&str],
    ) -> Result<Vec<(String, String)>, ClusterError> {
        let jsonpath =
            format!(r#"jsonpath={{range .items[*]}}{{.metadata.{field}}} {{.spec.nodeName}}{{"\n"}}{{end}}"#);
        let mut args = vec!["-n", namespace, "get", "pods", "-l", selector];
        args.extend_from_slice(filters);
        args.extend(["-o", jsonpath.as_str()]);
        let text = self.kubectl(&args)?;
        Ok(text.lines().filter_map(|l| l.split_once(' ').map(|(a, n)| (a.to_string(), n.to_string()))).collect())
    }

    /// `kubectl set image` on kubeadm's DaemonSet, then its rollout.
    pub fn swap_image(&mut self, image: &str) -> Result<Vec<String>, ClusterError> {
        self.kubectl(&["-n", "kube-system", "set", "image", "daemonset/kube-proxy", &format!("kube-proxy={image}")])?;
        self.rollout("daemonset/kube-proxy", Duration::from_secs(240))?;
        Ok(vec![format!("kubectl -n kube-system set image daemonset/kube-proxy kube-proxy={image}")])
    }

    /// The nftables tables in a node's network namespace (`ip nftproxy`, `ip kube-proxy`, …).
    pub fn tables(&self, node: &str) -> Result<Vec<String>, ClusterError> {
        let n = self.cluster.node(node).ok_or_else(|| NodeError::Setup(format!("no node {node}")))?;
        let out = n.exec("nft", &["list", "tables"])?;
        Ok(String::from_utf8_lossy(&out.stdout).lines().map(|l| l.trim_start_matches("table ").to_string()).collect())
    }
}

/// The repository's `deploy/` directory (the kustomizations the scenario applies).
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

impl NodeScenario {
    /// `kubectl` as the admin, with a directory: `apply -k DIR`, `delete -k DIR`.
    fn kubectl_dir(&self, verb: &str, dir: &Path) -> Result<String, ClusterError> {
        let dir = dir.to_string_lossy();
        self.kubectl(&[verb, "-k", &dir])
    }

    /// What must hold once nftproxy serves the nodes in kube-proxy's place: kube-proxy's table
    /// gone and nftproxy's there on every node, `/healthz` on every node's address (from the
    /// wan), `/metrics` with kube-proxy's families on each node's loopback, and
    /// `nftproxy check --api` clean in each of its pods.
    pub fn verify_nftproxy_serves(&self, namespace: &str, selector: &str) -> Result<Vec<String>, ClusterError> {
        let mut notes = Vec::new();
        let mut problems = Vec::new();
        for node in &self.cluster.nodes {
            let name = &node.spec.name;
            let tables = self.tables(name)?;
            if tables.iter().any(|t| t.ends_with(" kube-proxy")) || !tables.iter().any(|t| t == "ip nftproxy") {
                problems.push(format!("{name}'s tables: {tables:?}"));
            }
            let healthz = self.wan_get(SocketAddr::new(IpAddr::V4(node.spec.ip), 10256), "/healthz");
            match &healthz {
                Ok((200, body)) if body.contains("\"lastUpdated\"") => {}
                other => problems.push(format!("{name}'s /healthz: {other:?}")),
            }
            let metrics = node.exec("curl", &["-s", "-m", "5", "http://127.0.0.1:10249/metrics"])?;
            let text = String::from_utf8_lossy(&metrics.stdout);
            if !text.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds") {
                problems.push(format!("{name}'s /metrics on 127.0.0.1:10249 lacks kube-proxy's families"));
            }
            notes
                .push(format!("{name}: tables {}; /healthz 200; /metrics has kubeproxy_* families", tables.join(", ")));
        }
        for (pod, node) in self.pod_names(namespace, selector)? {
            let out = self.cluster.cp.kubectl(&[
                "-n",
                namespace,
                "exec",
                &pod,
                "--",
                "/usr/local/bin/nftproxy",
                "check",
                "--api",
            ])?;
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let summary = text.lines().last().unwrap_or("").to_string();
            if !out.status.success() {
                problems.push(format!(
                    "nftproxy check --api in {pod} ({node}) exited {}: {text}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            notes.push(format!("{node}: `nftproxy check --api` in {pod}: {summary}"));
            let log = self.cluster.cp.kubectl(&["-n", namespace, "logs", &pod])?;
            let log = String::from_utf8_lossy(&log.stdout).to_string();
            let said: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ") || l.contains(" ERROR ")).collect();
            notes.push(format!(
                "{node}: {pod}'s log: {} lines, {} warnings or errors{}",
                log.lines().count(),
                said.len(),
                said.iter().take(5).map(|l| format!("; `{}`", l.trim())).collect::<String>()
            ));
            // Connections tried before the node had rules (a boot, the longer path).
            for line in log.lines().filter(|l| l.contains("never DNATed")) {
                let entries = line.split_whitespace().find_map(|w| w.strip_prefix("entries=")).unwrap_or("?");
                notes
                    .push(format!("{node}: {pod} deleted {entries} conntrack entries of TCP connections never DNATed"));
            }
        }
        if problems.is_empty() {
            Ok(notes)
        } else {
            Err(NodeError::Failed {
                what: "nftproxy serving in kube-proxy's place".into(),
                output: problems.join("\n"),
            }
            .into())
        }
    }

    /// What must hold once kube-proxy serves the nodes again: its table there and nftproxy's
    /// gone, on every node (one ruleset).
    pub fn verify_kube_proxy_serves(&self) -> Result<Vec<String>, ClusterError> {
        let mut notes = Vec::new();
        for node in &self.cluster.nodes {
            let tables = self.tables(&node.spec.name)?;
            let ours: Vec<&String> = tables.iter().filter(|t| t.ends_with(" nftproxy")).collect();
            if !ours.is_empty() || !tables.iter().any(|t| t == "ip kube-proxy") {
                return Err(NodeError::Failed {
                    what: format!("one ruleset on {}", node.spec.name),
                    output: format!("tables: {tables:?}"),
                }
                .into());
            }
            notes.push(format!("{}: tables {}", node.spec.name, tables.join(", ")));
        }
        Ok(notes)
    }

    /// Pods matching a selector: (name, node).
    pub fn pod_names(&self, namespace: &str, selector: &str) -> Result<Vec<(String, String)>, ClusterError> {
        self.pods_by(namespace, selector, "name", &[])
    }

    /// An HTTP GET from the wan client.
    fn wan_get(&self, addr: SocketAddr, path: &str) -> Result<(u16, String), ClusterError> {
        let client = self
            .cluster
            .lab
            .clients
            .iter()
            .find(|c| c.name == "client")
            .ok_or_else(|| NodeError::Setup("no wan client".into()))?;
        let path = path.to_string();
        let answer = client.ns.run(move || crate::lab::traffic::http_get(addr, &path, Duration::from_secs(3)))?;
        answer.map_err(|e| NodeError::Failed { what: format!("GET http://{addr}"), output: e.to_string() }.into())
    }

    /// The way back, as docs/install.md says it: the hand-back DaemonSet first, then
    /// `kubectl rollout undo`; once every hand-back pod is Ready (nftproxy's tables gone), the
    /// hand-back is deleted.
    pub fn roll_back(&mut self) -> Result<Vec<String>, ClusterError> {
        let hand_back = deploy_dir().join("hand-back");
        self.kubectl_dir("apply", &hand_back)?;
        self.kubectl(&["-n", "kube-system", "rollout", "undo", "daemonset/kube-proxy"])?;
        self.rollout("daemonset/kube-proxy", Duration::from_secs(240))?;
        self.rollout("daemonset/nftproxy-hand-back", Duration::from_secs(120))?;
        self.kubectl_dir("delete", &hand_back)?;
        Ok(vec![
            "kubectl apply -k deploy/hand-back".into(),
            "kubectl -n kube-system rollout undo daemonset/kube-proxy".into(),
            "kubectl -n kube-system rollout status daemonset/nftproxy-hand-back (Ready: nftproxy's tables gone)".into(),
            "kubectl delete -k deploy/hand-back".into(),
        ])
    }

    /// Nodes where no proxy runs and no rule is left: kubeadm's kube-proxy DaemonSet deleted,
    /// every node rebooted (a fresh node's state), then the workload back on them.
    pub fn without_proxy(&mut self) -> Result<(), ClusterError> {
        let started = Instant::now();
        self.kubectl(&["-n", "kube-system", "delete", "daemonset", "kube-proxy", "--wait=true"])?;
        let names: Vec<String> = self.cluster.nodes.iter().map(|n| n.spec.name.clone()).collect();
        let mut notes = vec!["kubectl -n kube-system delete daemonset kube-proxy; every node rebooted".to_string()];
        for name in &names {
            self.cluster.reboot(name)?;
            let tables = self.tables(name)?;
            notes.push(format!("{name} after its reboot: {} nftables table(s) {}", tables.len(), tables.join(", ")));
        }
        self.cluster.wait_until_ready(Duration::from_secs(120))?;
        self.wait_for_pods(Duration::from_secs(180))?;
        self.records.push(PhaseRecord {
            name: "no proxy: kube-proxy's DaemonSet deleted, nodes rebooted (no rules)".into(),
            took: started.elapsed(),
            notes,
            ..PhaseRecord::default()
        });
        Ok(())
    }

    /// Waits until every pod's containers are ready again (after a reboot, the API shows pods
    /// Running before kubelet has started them anew).
    pub fn wait_for_pods(&self, within: Duration) -> Result<(), ClusterError> {
        let deadline = Instant::now() + within;
        loop {
            let text = self.kubectl(&[
                "get",
                "pods",
                "-A",
                "-o",
                r#"jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name} {.status.containerStatuses[*].ready} {.metadata.deletionTimestamp}{"\n"}{end}"#,
            ])?;
            let waiting: Vec<&str> = text
                .lines()
                .filter(|l| {
                    let mut parts = l.split_whitespace();
                    let _name = parts.next();
                    let states: Vec<&str> = parts.collect();
                    states.is_empty() || states.contains(&"false")
                })
                .collect();
            // Pods of kube-proxy-less phases whose network needs the proxy (CoreDNS reaches the API
            // server through its ClusterIP) may only get ready once a proxy runs: not waited for.
            let waiting: Vec<&str> = waiting.into_iter().filter(|l| !l.starts_with("kube-system/coredns")).collect();
            if waiting.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(ClusterError::Timeout {
                    what: "pods ready".into(),
                    waited: within,
                    detail: self.diagnose(&waiting.join("\n")),
                });
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The longer path, as docs/install.md says it: `deploy/` with the API server's address in
    /// `api-server.env`, `kubectl apply -k`, on nodes without service rules; every Service
    /// answers again once nftproxy has synced on every node.
    pub fn longer_path(&mut self) -> Result<Vec<String>, ClusterError> {
        let started = Instant::now();
        let deploy = self.dir().join("deploy");
        copy_dir(&deploy_dir(), &deploy)?;
        let env = format!(
            "KUBERNETES_SERVICE_HOST={}\nKUBERNETES_SERVICE_PORT={}\n",
            self.cluster.cp.ip,
            crate::controlplane::API_PORT
        );
        std::fs::write(deploy.join("api-server.env"), &env).map_err(NodeError::from)?;
        self.kubectl_dir("apply", &deploy)?;
        self.rollout("daemonset/nftproxy", Duration::from_secs(240))?;
        self.wait_until_served(Duration::from_secs(120))?;
        Ok(vec![
            format!("api-server.env: {}", env.trim().replace('\n', ", ")),
            "kubectl apply -k deploy/".into(),
            format!(
                "every Service answered every client {:.1} s after `kubectl apply`",
                started.elapsed().as_secs_f64()
            ),
        ])
    }

    /// A rolling update of nftproxy's DaemonSet to another build.
    pub fn roll_out(&mut self, image: &str) -> Result<Vec<String>, ClusterError> {
        self.kubectl(&[
            "-n",
            "kube-system",
            "set",
            "image",
            "daemonset/nftproxy",
            &format!("nftproxy={image}"),
            &format!("conntrack-sysctls={image}"),
        ])?;
        self.rollout("daemonset/nftproxy", Duration::from_secs(240))?;
        Ok(vec![format!(
            "kubectl -n kube-system set image daemonset/nftproxy nftproxy={image} conntrack-sysctls={image}"
        )])
    }
}

/// Copies a directory and everything in it.
fn copy_dir(from: &Path, to: &Path) -> Result<(), NodeError> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

impl NodeScenario {
    /// Adds notes to the last phase's record.
    fn note(&mut self, notes: Vec<String>) {
        if let Some(last) = self.records.last_mut() {
            last.notes.extend(notes);
        }
    }

    /// A restart of one of a node's daemons (SIGTERM, then started again) with its pods running.
    pub fn restart(&mut self, node: &str, daemon: NodeDaemon) -> Result<Vec<String>, ClusterError> {
        let n = self.cluster.node_mut(node).ok_or_else(|| NodeError::Setup(format!("no node {node}")))?;
        let what = match daemon {
            NodeDaemon::Kubelet => {
                n.stop_kubelet();
                n.start_kubelet()?;
                "kubelet"
            }
            NodeDaemon::Containerd => {
                n.stop_containerd();
                n.start_containerd()?;
                "containerd (its shims kept the pods)"
            }
        };
        self.cluster.wait_until_ready(Duration::from_secs(60))?;
        Ok(vec![format!("{what} on {node}: SIGTERM, started again, Node Ready")])
    }

    /// A node rebooted ([`super::machine::Node::reboot`]), then every Service served again.
    pub fn reboot(&mut self, node: &str) -> Result<Vec<String>, ClusterError> {
        let started = Instant::now();
        self.cluster.reboot(node)?;
        self.cluster.wait_until_ready(Duration::from_secs(120))?;
        self.wait_for_pods(Duration::from_secs(180))?;
        self.wait_until_served(Duration::from_secs(120))?;
        Ok(vec![format!(
            "{node} rebooted: every Service served again {:.1} s after the power cut",
            started.elapsed().as_secs_f64()
        )])
    }
}

/// What a run of the whole path saw: each phase's record, and why it stopped early, if it did
/// (with the cluster's state then: pods, events, the nodes' logs).
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub records: Vec<PhaseRecord>,
    pub error: Option<String>,
}

/// The whole path: boot with kubeadm's kube-proxy, the workload, the image swap, the way back,
/// the longer path, then node events under nftproxy's own DaemonSet. Stops at the first error.
/// The cluster is gone when it returns.
pub fn run(images: &[PathBuf]) -> Outcome {
    // node2's distribution uses iptables-legacy: kubelet writes its chains there, and so does
    // kube-proxy in iptables mode (its image follows kubelet).
    let nodes = [("node1", IptablesBackend::Nft), ("node2", IptablesBackend::Legacy)];
    let mut s = match NodeScenario::start(&nodes, images) {
        Ok(s) => s,
        Err(e) => return Outcome { records: Vec::new(), error: Some(e.to_string()) },
    };
    let error = run_phases(&mut s).err().map(|e| s.diagnose(&e));
    Outcome { records: std::mem::take(&mut s.records), error }
}

fn run_phases(s: &mut NodeScenario) -> Result<(), ClusterError> {
    s.deploy_workload()?;
    s.probed("migration: kubectl set image to nftproxy's image, nothing else", true, |s| s.swap_image(NFTPROXY_IMAGE))?;
    let notes = s.verify_nftproxy_serves("kube-system", "k8s-app=kube-proxy")?;
    s.note(notes);
    s.probed("the way back: hand-back DaemonSet, kubectl rollout undo", true, NodeScenario::roll_back)?;
    let notes = s.verify_kube_proxy_serves()?;
    s.note(notes);
    s.kube_proxy_iptables_mode()?;
    s.probed("migration from iptables mode (node2 on iptables-legacy): kubectl set image", true, |s| {
        s.swap_image(NFTPROXY_IMAGE)
    })?;
    let mut notes = s.verify_no_iptables_leftovers()?;
    notes.extend(s.verify_nftproxy_serves("kube-system", "k8s-app=kube-proxy")?);
    s.note(notes);
    s.without_proxy()?;
    s.probed("the longer path: kubectl apply -k deploy/ on nodes without rules", false, NodeScenario::longer_path)?;
    let notes = s.verify_nftproxy_serves("kube-system", "app.kubernetes.io/name=nftproxy")?;
    s.note(notes);
    s.probed("kubelet restarted on node1", true, |s| s.restart("node1", NodeDaemon::Kubelet))?;
    s.probed("containerd restarted on node1", true, |s| s.restart("node1", NodeDaemon::Containerd))?;
    s.probed("rolling update of nftproxy's DaemonSet to another build", true, |s| s.roll_out(NFTPROXY_ROLLOUT_IMAGE))?;
    let notes = s.verify_nftproxy_serves("kube-system", "app.kubernetes.io/name=nftproxy")?;
    s.note(notes);
    s.probed("the Helm chart in place of the kustomization", true, NodeScenario::helm_chart)?;
    let notes = s.verify_nftproxy_serves("kube-system", "app.kubernetes.io/name=nftproxy")?;
    s.note(notes);
    s.probed("node2 rebooted (containers, rules and conntrack gone)", false, |s| s.reboot("node2"))?;
    Ok(())
}

/// The records as a results file's Markdown: one table row per phase, then each phase's
/// clients and notes.
pub fn to_markdown(records: &[PhaseRecord]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "| phase | took | endpoints unchanged | asks | failed |");
    let _ = writeln!(out, "|---|---:|---|---:|---:|");
    for r in records {
        let _ = writeln!(
            out,
            "| {} | {:.0} s | {} | {} | {} |",
            r.name,
            r.took.as_secs_f64(),
            if r.probes.is_empty() {
                "-"
            } else if r.endpoints_unchanged {
                "yes"
            } else {
                "no"
            },
            r.ok() + r.failed(),
            r.failed()
        );
    }
    for r in records {
        let _ = writeln!(out, "\n### {}\n", r.name);
        for p in &r.probes {
            for line in p.lines() {
                let _ = writeln!(out, "- {line}");
            }
        }
        for n in &r.notes {
            let _ = writeln!(out, "- {}", n.replace('\n', " "));
        }
    }
    out
}

impl NodeScenario {
    /// kubeadm's kube-proxy switched to iptables mode (its ConfigMap's `mode`, its pods
    /// restarted): upstream removes its nftables table and writes `KUBE-` chains with the
    /// node's iptables, iptables-legacy on a node whose distribution uses it.
    pub fn kube_proxy_iptables_mode(&mut self) -> Result<(), ClusterError> {
        let started = Instant::now();
        let text = self.kubectl(&["-n", "kube-system", "get", "configmap", "kube-proxy", "-o", "json"])?;
        let cm: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| NodeError::Failed { what: "kube-proxy's ConfigMap".into(), output: e.to_string() })?;
        let config = cm["data"]["config.conf"].as_str().unwrap_or_default();
        if !config.contains("mode: nftables") {
            return Err(NodeError::Failed { what: "kube-proxy's ConfigMap".into(), output: config.to_string() }.into());
        }
        let patch = serde_json::json!({"data": {"config.conf": config.replace("mode: nftables", "mode: iptables")}});
        self.kubectl(&[
            "-n",
            "kube-system",
            "patch",
            "configmap",
            "kube-proxy",
            "--type=merge",
            "-p",
            &patch.to_string(),
        ])?;
        self.kubectl(&["-n", "kube-system", "rollout", "restart", "daemonset/kube-proxy"])?;
        self.rollout("daemonset/kube-proxy", Duration::from_secs(240))?;
        self.wait_until_served(Duration::from_secs(120))?;
        let mut notes =
            vec!["kube-proxy's ConfigMap: mode: iptables; kubectl rollout restart daemonset/kube-proxy".to_string()];
        for node in &self.cluster.nodes {
            let save = match node.spec.iptables {
                IptablesBackend::Nft => "iptables-nft-save",
                IptablesBackend::Legacy => "iptables-legacy-save",
            };
            let out = node.exec(save, &["-t", "nat"])?;
            let text = String::from_utf8_lossy(&out.stdout);
            let chains = text.lines().filter(|l| l.starts_with(":KUBE-")).count();
            if !text.contains(":KUBE-SERVICES") {
                return Err(NodeError::Failed {
                    what: format!("kube-proxy's iptables-mode chains on {} ({save})", node.spec.name),
                    output: text.into_owned(),
                }
                .into());
            }
            notes.push(format!("{}: {save} -t nat holds {chains} KUBE- chains", node.spec.name));
        }
        self.records.push(PhaseRecord {
            name: "kube-proxy in iptables mode (node2's distribution on iptables-legacy)".into(),
            took: started.elapsed(),
            notes,
            ..PhaseRecord::default()
        });
        Ok(())
    }

    /// After the takeover from iptables mode: no chain of kube-proxy's in either backend on any
    /// node, kubelet's still there.
    pub fn verify_no_iptables_leftovers(&self) -> Result<Vec<String>, ClusterError> {
        let mut notes = Vec::new();
        for node in &self.cluster.nodes {
            for save in ["iptables-nft-save", "iptables-legacy-save"] {
                let out = node.exec(save, &[])?;
                let text = String::from_utf8_lossy(&out.stdout);
                let left: Vec<&str> = text
                    .lines()
                    .filter_map(|l| l.strip_prefix(':'))
                    .filter_map(|l| l.split_whitespace().next())
                    .filter(|c| {
                        c.starts_with("KUBE-")
                            && !["KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT", "KUBE-MARK-DROP"]
                                .contains(c)
                    })
                    .collect();
                if !left.is_empty() {
                    return Err(NodeError::Failed {
                        what: format!("kube-proxy's chains left on {} ({save})", node.spec.name),
                        output: text.into_owned(),
                    }
                    .into());
                }
                let kubelet = text.lines().filter(|l| l.starts_with(":KUBE-")).count();
                notes.push(format!("{}: {save}: no chain of kube-proxy's; kubelet's {kubelet} stay", node.spec.name));
            }
        }
        Ok(notes)
    }
}

impl NodeScenario {
    /// nftproxy's own DaemonSet replaced by the Helm chart's (`deploy/chart`), as an operator
    /// moving to Helm does: `kubectl delete -k` of the kustomization (nftproxy's rules stay in
    /// the kernel meanwhile), then `helm template … | kubectl apply -f -` with the API server's
    /// address; the new pods claim the tables.
    pub fn helm_chart(&mut self) -> Result<Vec<String>, ClusterError> {
        let deploy = self.dir().join("deploy");
        self.kubectl_dir("delete", &deploy)?;
        let helm = crate::controlplane::operator_bin("helm")?;
        let chart = deploy_dir().join("chart");
        let host = format!("apiServer.host={}", self.cluster.cp.ip);
        let port = format!("apiServer.port={}", crate::controlplane::API_PORT);
        let out = std::process::Command::new(&helm)
            .arg("template")
            .arg("nftproxy")
            .arg(&chart)
            .args(["-n", "kube-system", "--set", &host, "--set", &port])
            .output()
            .map_err(|e| NodeError::Setup(format!("cannot run {}: {e}", helm.display())))?;
        if !out.status.success() {
            return Err(NodeError::Failed {
                what: "helm template".into(),
                output: String::from_utf8_lossy(&out.stderr).into_owned(),
            }
            .into());
        }
        self.cluster.cp.apply(&String::from_utf8_lossy(&out.stdout))?;
        self.rollout("daemonset/nftproxy", Duration::from_secs(240))?;
        let mut notes = vec![
            "kubectl delete -k deploy/".to_string(),
            format!(
                "helm template nftproxy deploy/chart -n kube-system --set {host} --set {port} | kubectl apply -f -"
            ),
        ];
        for node in &self.cluster.nodes {
            let metrics = node.exec("curl", &["-s", "-m", "5", "http://127.0.0.1:10249/metrics"])?;
            let text = String::from_utf8_lossy(&metrics.stdout);
            let conflicts = text
                .lines()
                .find(|l| l.starts_with("nftproxy_check_findings{severity=\"conflict\"}"))
                .unwrap_or("nftproxy_check_findings{severity=\"conflict\"} (absent)")
                .to_string();
            if !conflicts.ends_with(" 0") {
                return Err(
                    NodeError::Failed { what: format!("{}'s /metrics", node.spec.name), output: conflicts }.into()
                );
            }
            notes.push(format!("{}: {conflicts}", node.spec.name));
        }
        Ok(notes)
    }
}
