//! One real node: its cgroup root, its mount namespace, containerd and kubelet, started,
//! stopped and rebooted.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use super::anchor::{self, Anchor};
use super::cgroup::{self, CgroupRoot};
use super::config;
use super::error::NodeError;
use crate::controlplane::UpstreamBins;
use crate::process::ProcessGroup;

/// The last lines of a log file.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// How a node joins the cluster.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    /// The node's name (kubelet's `--hostname-override`).
    pub name: String,
    /// Its lab network namespace (as `ip netns` knows it).
    pub netns: String,
    /// Its address on the wan (kubelet's `--node-ip`).
    pub ip: Ipv4Addr,
    /// kubelet's kubeconfig (the API server and the node's credentials).
    pub kubeconfig: String,
    /// The cluster's DNS Service address (kubelet's `clusterDNS`).
    pub cluster_dns: Ipv4Addr,
    /// The iptables the node's distribution uses.
    pub iptables: config::IptablesBackend,
}

/// A running node: its mount namespace, containerd and kubelet.
#[derive(Debug)]
pub struct Node {
    pub spec: NodeSpec,
    bins: UpstreamBins,
    // Field order is drop order: the daemons, the namespace's holder, the cgroups (which kill
    // whatever is left: shims and containers), and only then the disk they wrote to.
    kubelet: Option<ProcessGroup>,
    containerd: Option<ProcessGroup>,
    anchor: Option<Anchor>,
    cgroups: CgroupRoot,
    /// The node's disk: configuration, images, kubelet's state, the overlays' upper layers.
    dir: tempfile::TempDir,
}

impl Node {
    /// Boots the node: its cgroup root, its mount namespace, containerd (with `images`, archives
    /// of OCI or Docker images, imported), then kubelet, which registers the Node.
    pub fn start(spec: NodeSpec, bins: UpstreamBins, images: &[PathBuf]) -> Result<Node, NodeError> {
        cgroup::cleanup_stale();
        let cgroups = CgroupRoot::create(&format!("nftp-{}-{}", spec.name, std::process::id()))?;
        let dir = tempfile::Builder::new().prefix(&format!("nftproxy-node-{}-", spec.name)).tempdir()?;
        let mut node = Node { spec, bins, dir, kubelet: None, containerd: None, anchor: None, cgroups };
        node.write_config()?;
        node.boot()?;
        node.import_images(images)?;
        node.start_kubelet()?;
        Ok(node)
    }

    /// The PID whose namespaces are the node's: `nsenter -t PID -m -n` enters it.
    pub fn pid(&self) -> Option<u32> {
        self.anchor.as_ref().map(Anchor::pid)
    }

    /// The node's directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write_config(&self) -> Result<(), NodeError> {
        let dir = self.dir.path();
        std::fs::create_dir_all(dir.join("cni"))?;
        std::fs::write(dir.join("containerd.toml"), config::containerd(dir))?;
        std::fs::write(dir.join("cni-template.json"), config::cni_template())?;
        let settings = config::KubeletSettings {
            node_ip: self.spec.ip,
            cgroup_root: &self.cgroups.path(),
            cluster_dns: self.spec.cluster_dns,
            dir,
        };
        std::fs::write(dir.join("kubelet.yaml"), config::kubelet(&settings))?;
        std::fs::write(dir.join("kubelet.kubeconfig"), &self.spec.kubeconfig)?;
        std::fs::write(dir.join("resolv.conf"), config::resolv_conf())?;
        Ok(())
    }

    /// The mount namespace and containerd: what a machine's boot brings up before kubelet.
    fn boot(&mut self) -> Result<(), NodeError> {
        let disk = self.file("disk");
        std::fs::create_dir_all(&disk)?;
        let hierarchies = cgroup::hierarchies()?;
        let anchor = Anchor::start(&self.spec.netns, &self.cgroups.procs_file()?, &disk, &hierarchies)?;
        for [name, path] in self.spec.iptables.alternatives() {
            let out = anchor.command("update-alternatives").args(["--set", name, path]).output()?;
            if !out.status.success() {
                return Err(NodeError::Failed {
                    what: format!("update-alternatives --set {name} {path}"),
                    output: String::from_utf8_lossy(&out.stderr).into_owned(),
                });
            }
        }
        self.anchor = Some(anchor);
        self.start_containerd()
    }

    fn anchor(&self) -> Result<&Anchor, NodeError> {
        self.anchor.as_ref().ok_or_else(|| NodeError::Setup(format!("node {} is down", self.spec.name)))
    }

    /// Spawns a daemon inside the node, in its cgroup, logging to `<what>.log`.
    fn spawn(&self, what: &str, program: &Path, args: &[String]) -> Result<ProcessGroup, NodeError> {
        let log = self.file(&format!("{what}.log"));
        let anchor = self.anchor()?;
        let mut command = anchor::in_cgroup(&self.cgroups.procs_file()?, "nsenter");
        command
            .args(["-t", &anchor.pid().to_string(), "-m", "-n", "--"])
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(std::fs::OpenOptions::new().create(true).append(true).open(&log)?)
            .stderr(std::fs::OpenOptions::new().create(true).append(true).open(&log)?);
        ProcessGroup::spawn(&mut command).map_err(|e| NodeError::Setup(format!("cannot start {what}: {e}")))
    }

    /// Starts (or starts again) containerd and waits until it answers.
    pub fn start_containerd(&mut self) -> Result<(), NodeError> {
        let args = vec![format!("--config={}", self.file("containerd.toml").display())];
        self.containerd = Some(self.spawn("containerd", Path::new("containerd"), &args)?);
        self.wait_for("containerd", Duration::from_secs(30), |n| n.ctr(&["version"]).is_ok_and(|o| o.status.success()))
    }

    /// Stops containerd (SIGTERM): its shims, and so the pods, keep running.
    pub fn stop_containerd(&mut self) {
        if let Some(mut d) = self.containerd.take() {
            d.stop(Duration::from_secs(10));
        }
    }

    /// Starts (or starts again) kubelet and waits until its health endpoint answers.
    pub fn start_kubelet(&mut self) -> Result<(), NodeError> {
        let d = self.dir.path().display().to_string();
        let args = vec![
            format!("--config={d}/kubelet.yaml"),
            format!("--kubeconfig={d}/kubelet.kubeconfig"),
            format!("--root-dir={d}/kubelet"),
            format!("--cert-dir={d}/kubelet-pki"),
            format!("--hostname-override={}", self.spec.name),
            format!("--node-ip={}", self.spec.ip),
            "--v=2".into(),
        ];
        let kubelet = self.bins.path("kubelet");
        self.kubelet = Some(self.spawn("kubelet", &kubelet, &args)?);
        self.wait_for("kubelet", Duration::from_secs(60), |n| {
            n.exec("curl", &["-sf", "-m", "2", "http://127.0.0.1:10248/healthz"]).is_ok_and(|o| o.status.success())
        })
    }

    /// Stops kubelet (SIGTERM): the pods keep running.
    pub fn stop_kubelet(&mut self) {
        if let Some(mut d) = self.kubelet.take() {
            d.stop(Duration::from_secs(10));
        }
    }

    /// A power cut and a boot: every process of the node killed (daemons, shims, containers),
    /// its `/run` gone, and the kernel state a reboot clears in its network namespace (nftables
    /// and iptables rules, conntrack, the CNI bridge and the pods' links); then containerd and
    /// kubelet start again over the same disk.
    pub fn reboot(&mut self, wan_routes: &[(String, Ipv4Addr)]) -> Result<(), NodeError> {
        self.kubelet.take();
        self.containerd.take();
        self.anchor.take();
        self.cgroups.kill_all(Duration::from_secs(20))?;
        let ns = self.spec.netns.clone();
        let in_ns = |program: &str, args: &[&str]| -> Result<Output, NodeError> {
            Ok(std::process::Command::new("ip").args(["netns", "exec", &ns, program]).args(args).output()?)
        };
        in_ns("nft", &["flush", "ruleset"])?;
        // The legacy tables that exist (asking for another would create it): emptied, as a
        // boot leaves them.
        for (tool, names) in
            [("iptables-legacy", "/proc/net/ip_tables_names"), ("ip6tables-legacy", "/proc/net/ip6_tables_names")]
        {
            let tables = in_ns("cat", &[names])?;
            for table in String::from_utf8_lossy(&tables.stdout).split_whitespace() {
                in_ns(tool, &["-t", table, "-F"])?;
                in_ns(tool, &["-t", table, "-X"])?;
            }
        }
        in_ns("conntrack", &["-F"])?;
        let links = in_ns("ip", &["-o", "link", "show"])?;
        for line in String::from_utf8_lossy(&links.stdout).lines() {
            let name = line.split(':').nth(1).map(|s| s.trim().split('@').next().unwrap_or("").to_string());
            if let Some(name) = name
                && name != "lo"
                && name != "eth0"
            {
                let _ = in_ns("ip", &["link", "delete", &name]);
            }
        }
        for (cidr, via) in wan_routes {
            in_ns("ip", &["route", "replace", cidr, "via", &via.to_string()])?;
        }
        self.boot()?;
        self.start_kubelet()
    }

    /// Imports image archives into containerd's `k8s.io` namespace (the CRI's).
    pub fn import_images(&self, images: &[PathBuf]) -> Result<(), NodeError> {
        for image in images {
            let path = image.to_string_lossy();
            let out = self.ctr(&["images", "import", &path])?;
            if !out.status.success() {
                return Err(NodeError::Failed {
                    what: format!("ctr images import {path}"),
                    output: String::from_utf8_lossy(&out.stderr).into_owned(),
                });
            }
        }
        Ok(())
    }

    /// The network namespace of a running pod (`/proc/PID/ns/net` of one of its processes), by
    /// the pod's UID.
    pub fn pod_netns(&self, uid: &str) -> Option<PathBuf> {
        let pids = self.cgroups.processes_of(&format!("pod{uid}"));
        pids.iter().map(|p| PathBuf::from(format!("/proc/{p}/ns/net"))).find(|p| p.exists())
    }

    /// `ctr` against the node's containerd, in the CRI's namespace.
    pub fn ctr(&self, args: &[&str]) -> Result<Output, NodeError> {
        let socket = self.file("containerd.sock");
        Ok(std::process::Command::new("ctr")
            .arg("--address")
            .arg(&socket)
            .args(["-n", "k8s.io"])
            .args(args)
            .output()?)
    }

    /// Runs a command inside the node (its network and mount namespaces).
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<Output, NodeError> {
        Ok(self.anchor()?.command(program).args(args).output()?)
    }

    fn wait_for(&self, what: &str, within: Duration, ready: impl Fn(&Node) -> bool) -> Result<(), NodeError> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if ready(self) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(NodeError::NotReady {
            what: format!("{what} on {}", self.spec.name),
            waited: within,
            log: tail(&self.file(&format!("{what}.log")), 40),
        })
    }

    /// The last lines of containerd's and kubelet's logs (for a failing test's message).
    pub fn logs(&self) -> String {
        ["containerd", "kubelet"]
            .iter()
            .map(|w| format!("--- {} on {} ---\n{}", w, self.spec.name, tail(&self.file(&format!("{w}.log")), 40)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
