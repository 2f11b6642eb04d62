//! A real Kubernetes control plane in the lab: etcd, kube-apiserver and kube-controller-manager
//! from upstream's own releases (built from their Go modules by `scripts/upstream-bins`), in a
//! network namespace of their own on the lab's wan, so that the objects nftproxy sees come from
//! the real API server (watch semantics, RBAC, admission, defaulting) and its EndpointSlices
//! from the real EndpointSlice controller.
//!
//! - etcd listens on the namespace's loopback; kube-apiserver serves TLS (a self-signed
//!   certificate it writes into `--cert-dir`) on the namespace's wan address, with RBAC,
//!   ServiceAccount token signing and the lab's service range; kube-controller-manager runs the
//!   controllers a proxy depends on (EndpointSlice and its mirroring, ServiceAccounts and their
//!   tokens, ServiceCIDRs, garbage collection) and not node-lifecycle: no kubelet heartbeats here.
//! - The tests play kubelet: Nodes and Pods are created through the API, and a Pod's status
//!   (IP, readiness) is written as a kubelet writes it, so the controller derives every slice.
//! - Everything is started here and stopped on drop (by PID); the namespace is the lab's.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;

/// The admin's bearer token (a static token file: the lab's only cluster-admin).
const ADMIN_TOKEN: &str = "nftproxy-lab-admin";
/// The API server's port.
pub const API_PORT: u16 = 6443;

/// kube-proxy's identity as kubeadm makes it: its ServiceAccount bound to upstream's own
/// ClusterRole `system:node-proxier` (the image swap keeps it).
pub const KUBE_PROXY_IDENTITY: &str = r#"apiVersion: v1
kind: ServiceAccount
metadata: {name: kube-proxy, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: kubeadm:node-proxier}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: system:node-proxier}
subjects: [{kind: ServiceAccount, name: kube-proxy, namespace: kube-system}]
"#;

/// Errors running the control plane.
#[derive(Debug, Error)]
pub enum ControlPlaneError {
    #[error("cannot build or find the upstream binaries: {0}")]
    Binaries(String),
    #[error("cannot run {what}: {source}")]
    Spawn { what: String, source: std::io::Error },
    #[error("{what} failed: {output}")]
    Failed { what: String, output: String },
    #[error("{what} did not become ready within {waited:?}; its log:\n{log}")]
    NotReady { what: &'static str, waited: Duration, log: String },
    #[error("interrupted while waiting for {0}")]
    Interrupted(&'static str),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Lab(#[from] crate::lab::LabError),
}

/// The upstream binaries (`etcd`, `kube-apiserver`, `kube-controller-manager`, `kube-proxy`,
/// `kubectl`).
#[derive(Debug, Clone)]
pub struct UpstreamBins {
    dir: PathBuf,
}

impl UpstreamBins {
    /// `$NFTPROXY_UPSTREAM_BIN` when set, else what `scripts/upstream-bins` builds or has cached
    /// (seconds once cached; about 15 minutes on a fresh 2-core machine).
    pub fn locate() -> Result<UpstreamBins, ControlPlaneError> {
        if let Some(dir) = std::env::var_os("NFTPROXY_UPSTREAM_BIN") {
            return Ok(UpstreamBins { dir: dir.into() });
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/upstream-bins");
        let out = Command::new(&script)
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| ControlPlaneError::Binaries(format!("{}: {e}", script.display())))?;
        if !out.status.success() {
            return Err(ControlPlaneError::Binaries(format!("{} exited with {}", script.display(), out.status)));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let dir = stdout.lines().last().unwrap_or("").trim();
        if dir.is_empty() {
            return Err(ControlPlaneError::Binaries("scripts/upstream-bins printed no directory".into()));
        }
        Ok(UpstreamBins { dir: dir.into() })
    }

    /// The path of one binary.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// Helm's and promtool's binaries (`scripts/operator-bins`): the one named, from
/// `$NFTPROXY_OPERATOR_BIN` when set, else from what the script builds or has cached.
pub fn operator_bin(name: &str) -> Result<PathBuf, ControlPlaneError> {
    static DIR: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("NFTPROXY_OPERATOR_BIN") {
            return Ok(dir.into());
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/operator-bins");
        let out = Command::new(&script)
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("{}: {e}", script.display()))?;
        if !out.status.success() {
            return Err(format!("{} exited with {}", script.display(), out.status));
        }
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or("").trim()))
    });
    dir.as_ref().map(|d| d.join(name)).map_err(|e| ControlPlaneError::Binaries(e.clone()))
}

/// A process of the control plane, killed (by PID) on drop.
struct Process {
    what: &'static str,
    child: Child,
    log: PathBuf,
}

impl Process {
    fn log(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Real kubelets joining the control plane (`tools/src/node`): their Nodes' names (each gets a
/// credential of the `system:nodes` group, as a kubelet's client certificate names it) and the
/// cluster's pod range, from which the node-IPAM controller gives each Node its `podCIDR`.
#[derive(Debug, Clone)]
pub struct Kubelets {
    pub nodes: Vec<String>,
    pub cluster_cidr: String,
}

/// The running control plane.
pub struct ControlPlane {
    /// The namespace it runs in (a lab client's).
    ns: String,
    /// Its address on the wan (the API server's advertise address).
    pub ip: Ipv4Addr,
    /// The service range it allocates ClusterIPs from.
    pub service_cidr: String,
    pub bins: UpstreamBins,
    dir: tempfile::TempDir,
    etcd: Option<Process>,
    /// Behind a lock: tests kill and restart it while others hold the control plane.
    apiserver: std::sync::Mutex<Option<Process>>,
    controller_manager: Option<Process>,
    /// With real kubelets: the scheduler (the tests play kubelet and scheduler otherwise).
    scheduler: Option<Process>,
    kubelets: Option<Kubelets>,
    /// Set (by a signal handler) to stop waiting for a process to become ready.
    interrupt: Arc<AtomicBool>,
}

impl ControlPlane {
    /// Adds a lab client named `control-plane` on the wan and starts the control plane there.
    pub fn start_in(lab: &mut crate::lab::Lab, service_cidr: &str) -> Result<ControlPlane, ControlPlaneError> {
        let client = lab.add_client("control-plane")?;
        let (ns, ip) = (client.ns.name().to_string(), client.ip);
        ControlPlane::start(&ns, ip, service_cidr)
    }

    /// Starts etcd, kube-apiserver and kube-controller-manager in namespace `ns` (whose wan
    /// address is `ip`), and waits until the API server is ready.
    pub fn start(ns: &str, ip: Ipv4Addr, service_cidr: &str) -> Result<ControlPlane, ControlPlaneError> {
        ControlPlane::start_interruptible(ns, ip, service_cidr, Arc::new(AtomicBool::new(false)))
    }

    /// A control plane for real kubelets ([`Kubelets`]): the API server authorizes nodes with
    /// the Node authorizer and reaches kubelets at their InternalIP; the controller manager runs
    /// upstream's default set of controllers (node IPAM and lifecycle, DaemonSets, Deployments,
    /// the root CA's publisher…), and kube-scheduler places pods.
    pub fn start_for_kubelets(
        lab: &mut crate::lab::Lab,
        service_cidr: &str,
        kubelets: Kubelets,
    ) -> Result<ControlPlane, ControlPlaneError> {
        let client = lab.add_client("control-plane")?;
        let (ns, ip) = (client.ns.name().to_string(), client.ip);
        ControlPlane::start_with(&ns, ip, service_cidr, Some(kubelets), Arc::new(AtomicBool::new(false)))
    }

    /// [`start`](ControlPlane::start), giving up ([`ControlPlaneError::Interrupted`]) as soon as
    /// `interrupt` is set (Ctrl-C), with whatever it had started stopped.
    pub fn start_interruptible(
        ns: &str,
        ip: Ipv4Addr,
        service_cidr: &str,
        interrupt: Arc<AtomicBool>,
    ) -> Result<ControlPlane, ControlPlaneError> {
        ControlPlane::start_with(ns, ip, service_cidr, None, interrupt)
    }

    fn start_with(
        ns: &str,
        ip: Ipv4Addr,
        service_cidr: &str,
        kubelets: Option<Kubelets>,
        interrupt: Arc<AtomicBool>,
    ) -> Result<ControlPlane, ControlPlaneError> {
        let bins = UpstreamBins::locate()?;
        let dir = tempfile::Builder::new().prefix("nftproxy-controlplane-").tempdir()?;
        let mut cp = ControlPlane {
            ns: ns.to_string(),
            ip,
            service_cidr: service_cidr.to_string(),
            bins,
            dir,
            etcd: None,
            apiserver: std::sync::Mutex::new(None),
            controller_manager: None,
            scheduler: None,
            kubelets,
            interrupt,
        };
        cp.write_pki()?;
        cp.start_etcd()?;
        cp.start_apiserver()?;
        cp.start_controller_manager()?;
        if cp.kubelets.is_some() {
            cp.start_scheduler()?;
        }
        Ok(cp)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The ServiceAccount signing key and the static admin token.
    fn write_pki(&self) -> Result<(), ControlPlaneError> {
        let key = self.file("sa.key");
        run("openssl genrsa", Command::new("openssl").args(["genrsa", "-out"]).arg(&key).arg("2048"))?;
        run(
            "openssl rsa -pubout",
            Command::new("openssl").arg("rsa").arg("-in").arg(&key).arg("-pubout").arg("-out").arg(self.file("sa.pub")),
        )?;
        let mut tokens = format!("{ADMIN_TOKEN},admin,admin,system:masters\n");
        for node in self.kubelets.iter().flat_map(|k| &k.nodes) {
            tokens.push_str(&format!("{},system:node:{node},node-{node},system:nodes\n", kubelet_token(node)));
        }
        std::fs::write(self.file("tokens.csv"), tokens)?;
        std::fs::create_dir_all(self.file("serving"))?;
        Ok(())
    }

    fn command(&self, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns]).arg(program);
        c
    }

    fn spawn(&self, what: &'static str, program: &str, args: &[String]) -> Result<Process, ControlPlaneError> {
        let log = self.file(&format!("{what}.log"));
        let child = self
            .command(&self.bins.path(program))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::OpenOptions::new().create(true).append(true).open(&log)?)
            .spawn()
            .map_err(|source| ControlPlaneError::Spawn { what: what.to_string(), source })?;
        Ok(Process { what, child, log })
    }

    fn start_etcd(&mut self) -> Result<(), ControlPlaneError> {
        let data = self.file("etcd");
        let args = [
            format!("--data-dir={}", data.display()),
            "--name=lab".into(),
            "--listen-client-urls=http://127.0.0.1:2379".into(),
            "--advertise-client-urls=http://127.0.0.1:2379".into(),
            "--listen-peer-urls=http://127.0.0.1:2380".into(),
            "--initial-advertise-peer-urls=http://127.0.0.1:2380".into(),
            "--initial-cluster=lab=http://127.0.0.1:2380".into(),
            // A test cluster: durability across power loss is not needed, speed is.
            "--unsafe-no-fsync".into(),
            "--log-level=warn".into(),
        ];
        let etcd = self.spawn("etcd", "etcd", &args)?;
        self.etcd = Some(etcd);
        self.wait_for("etcd", Duration::from_secs(30), |cp| {
            cp.etcd_request("GET", "/health", "").is_ok_and(|b| b.contains("true"))
        })
    }

    /// Starts (or starts again) kube-apiserver and waits until `/readyz` answers.
    pub fn start_apiserver(&self) -> Result<(), ControlPlaneError> {
        let mut args = vec![
            "--etcd-servers=http://127.0.0.1:2379".to_string(),
            format!("--advertise-address={}", self.ip),
            "--bind-address=0.0.0.0".into(),
            format!("--secure-port={API_PORT}"),
            format!("--cert-dir={}", self.file("serving").display()),
            format!("--service-cluster-ip-range={}", self.service_cidr),
            "--authorization-mode=RBAC".into(),
            format!("--token-auth-file={}", self.file("tokens.csv").display()),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", self.file("sa.pub").display()),
            format!("--service-account-signing-key-file={}", self.file("sa.key").display()),
            "--allow-privileged=true".into(),
            "--enable-priority-and-fairness=false".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ];
        if self.kubelets.is_some() {
            args.retain(|a| !a.starts_with("--authorization-mode="));
            args.extend([
                "--authorization-mode=Node,RBAC".to_string(),
                "--enable-admission-plugins=NodeRestriction".into(),
                // Node names are not in any DNS here.
                "--kubelet-preferred-address-types=InternalIP".into(),
            ]);
        }
        let apiserver = self.spawn("kube-apiserver", "kube-apiserver", &args)?;
        *self.apiserver.lock().unwrap_or_else(|e| e.into_inner()) = Some(apiserver);
        self.wait_for("kube-apiserver", Duration::from_secs(120), |cp| {
            cp.kubectl(&["get", "--raw=/readyz"]).is_ok_and(|o| o.status.success())
        })
    }

    /// Stops kube-apiserver (SIGKILL, as a crash).
    pub fn kill_apiserver(&self) {
        self.apiserver.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    /// Stops kube-controller-manager (by PID), for a benchmark that writes every EndpointSlice
    /// itself: its controllers (the garbage collector's graph of every object above all) would
    /// only compete for the CPU with what is measured.
    pub fn stop_controller_manager(&mut self) {
        self.controller_manager.take();
    }

    fn start_controller_manager(&mut self) -> Result<(), ControlPlaneError> {
        let kubeconfig = self.file("admin.kubeconfig");
        std::fs::write(&kubeconfig, self.kubeconfig(ADMIN_TOKEN))?;
        let mut args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--authentication-kubeconfig={}", kubeconfig.display()),
            format!("--authorization-kubeconfig={}", kubeconfig.display()),
            "--controllers=endpointslice-controller,endpointslice-mirroring-controller,serviceaccount-controller,serviceaccount-token-controller,service-cidr-controller,garbage-collector-controller,namespace-controller,root-ca-certificate-publisher-controller".into(),
            format!("--service-account-private-key-file={}", self.file("sa.key").display()),
            format!("--root-ca-file={}", self.file("serving/apiserver.crt").display()),
            "--use-service-account-credentials=false".into(),
            "--leader-elect=false".into(),
            // Its client's default 20 requests/s would take a minute to slice 1,000 Services.
            "--kube-api-qps=200".into(),
            "--kube-api-burst=400".into(),
            "--concurrent-service-endpoint-syncs=10".into(),
            "--bind-address=127.0.0.1".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ];
        if let Some(kubelets) = &self.kubelets {
            // Upstream's default controllers, with node IPAM (kube-controller-manager's
            // `--allocate-node-cidrs`), as kubeadm runs them.
            args.retain(|a| !a.starts_with("--controllers="));
            args.extend([
                "--controllers=*".to_string(),
                "--allocate-node-cidrs=true".into(),
                format!("--cluster-cidr={}", kubelets.cluster_cidr),
                "--node-cidr-mask-size=24".into(),
                format!("--service-cluster-ip-range={}", self.service_cidr),
            ]);
        }
        let kcm = self.spawn("kube-controller-manager", "kube-controller-manager", &args)?;
        self.controller_manager = Some(kcm);
        // Ready once it has created the default namespace's ServiceAccount.
        self.wait_for("kube-controller-manager", Duration::from_secs(60), |cp| {
            cp.kubectl(&["get", "serviceaccount", "default", "-n", "default"]).is_ok_and(|o| o.status.success())
        })
    }

    /// kube-scheduler, as the admin, and waits until it serves its health endpoint.
    fn start_scheduler(&mut self) -> Result<(), ControlPlaneError> {
        let kubeconfig = self.file("admin.kubeconfig");
        let args = [
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--authentication-kubeconfig={}", kubeconfig.display()),
            format!("--authorization-kubeconfig={}", kubeconfig.display()),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ];
        self.scheduler = Some(self.spawn("kube-scheduler", "kube-scheduler", &args)?);
        let ns = self.ns.clone();
        self.wait_for("kube-scheduler", Duration::from_secs(60), move |_| {
            Command::new("ip")
                .args(["netns", "exec", &ns, "curl", "-sk", "-m", "2", "https://127.0.0.1:10259/healthz"])
                .output()
                .is_ok_and(|o| o.stdout == b"ok")
        })
    }

    /// A kubelet's kubeconfig for `node` (its `system:nodes` credential).
    pub fn kubelet_kubeconfig(&self, node: &str) -> String {
        self.kubeconfig(&kubelet_token(node))
    }

    fn wait_for(
        &self,
        what: &'static str,
        within: Duration,
        ready: impl Fn(&ControlPlane) -> bool,
    ) -> Result<(), ControlPlaneError> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.interrupt.load(Ordering::Relaxed) {
                return Err(ControlPlaneError::Interrupted(what));
            }
            if ready(self) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let log = match what {
            "etcd" => self.etcd.as_ref().map(Process::log),
            "kube-apiserver" => self.apiserver.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(Process::log),
            "kube-scheduler" => self.scheduler.as_ref().map(Process::log),
            _ => self.controller_manager.as_ref().map(Process::log),
        };
        Err(ControlPlaneError::NotReady { what, waited: within, log: log.unwrap_or_default() })
    }

    /// The network namespace it runs in (as `ip netns` knows it).
    pub fn namespace(&self) -> &str {
        &self.ns
    }

    /// The API server's URL.
    pub fn url(&self) -> String {
        format!("https://{}:{API_PORT}", self.ip)
    }

    /// The admin's kubeconfig file (cluster-admin), e.g. for a person's `kubectl`.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.file("admin.kubeconfig")
    }

    /// The API server's serving certificate (with its self-signed CA): what clients trust.
    pub fn ca_file(&self) -> PathBuf {
        self.file("serving/apiserver.crt")
    }

    /// A kubeconfig for the API server with a bearer token.
    pub fn kubeconfig(&self, token: &str) -> String {
        format!(
            r#"apiVersion: v1
kind: Config
clusters:
- name: lab
  cluster:
    server: {}
    certificate-authority: {}
users:
- name: lab
  user:
    token: {token}
contexts:
- name: lab
  context: {{cluster: lab, user: lab, namespace: default}}
current-context: lab
"#,
            self.url(),
            self.ca_file().display()
        )
    }

    /// Runs `kubectl` as the admin, inside the control plane's namespace.
    pub fn kubectl(&self, args: &[&str]) -> Result<Output, ControlPlaneError> {
        let kubeconfig = self.file("admin.kubeconfig");
        if !kubeconfig.exists() {
            std::fs::write(&kubeconfig, self.kubeconfig(ADMIN_TOKEN))?;
        }
        self.command(&self.bins.path("kubectl"))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(args)
            .output()
            .map_err(|source| ControlPlaneError::Spawn { what: "kubectl".into(), source })
    }

    /// `kubectl` that must succeed; returns its standard output.
    pub fn kubectl_ok(&self, args: &[&str]) -> Result<String, ControlPlaneError> {
        let out = self.kubectl(args)?;
        if !out.status.success() {
            return Err(ControlPlaneError::Failed {
                what: format!("kubectl {}", args.join(" ")),
                output: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `kubectl <verb> -f -` with `yaml` on its standard input (`apply`, `create`, `delete`).
    pub fn kubectl_stdin(&self, args: &[&str], yaml: &str) -> Result<String, ControlPlaneError> {
        let kubeconfig = self.file("admin.kubeconfig");
        let mut child = self
            .command(&self.bins.path("kubectl"))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(args)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| ControlPlaneError::Spawn { what: "kubectl".into(), source })?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(yaml.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            return Err(ControlPlaneError::Failed {
                what: format!("kubectl {} -f -", args.join(" ")),
                output: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `kubectl apply -f -`.
    pub fn apply(&self, yaml: &str) -> Result<String, ControlPlaneError> {
        self.kubectl_stdin(&["apply"], yaml)
    }

    /// Writes a status subresource as its owner would (a kubelet for Pods and Nodes, a load
    /// balancer controller for Services): a merge patch of `status`.
    pub fn patch_status(
        &self,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        status: &serde_json::Value,
    ) -> Result<(), ControlPlaneError> {
        let patch = serde_json::json!({ "status": status }).to_string();
        let mut args = vec!["patch", kind, name, "--subresource=status", "--type=merge", "-p", &patch];
        if let Some(ns) = namespace {
            args.extend(["-n", ns]);
        }
        self.kubectl_ok(&args).map(|_| ())
    }

    /// A Node with an InternalIP and a zone, as a kubelet registers it.
    pub fn add_node(&self, name: &str, ip: Ipv4Addr, zone: &str) -> Result<(), ControlPlaneError> {
        self.add_node_with(name, &[IpAddr::V4(ip)], zone)
    }

    /// A Node with one InternalIP per address (dual-stack: one of each family) and a zone.
    pub fn add_node_with(&self, name: &str, ips: &[IpAddr], zone: &str) -> Result<(), ControlPlaneError> {
        let mut addresses: Vec<serde_json::Value> =
            ips.iter().map(|ip| serde_json::json!({"type": "InternalIP", "address": ip.to_string()})).collect();
        addresses.push(serde_json::json!({"type": "Hostname", "address": name}));
        self.apply(&format!(
            r#"apiVersion: v1
kind: Node
metadata:
  name: {name}
  labels: {{kubernetes.io/hostname: {name}, topology.kubernetes.io/zone: {zone}}}
"#
        ))?;
        self.patch_status(
            "node",
            None,
            name,
            &serde_json::json!({
                "addresses": addresses,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "lab"}],
            }),
        )
    }

    /// A Pod bound to `node` with `labels`, running at `ip`, ready or not, as the scheduler and
    /// a kubelet would leave it.
    pub fn add_pod(
        &self,
        name: &str,
        node: &str,
        ip: Ipv4Addr,
        labels: &str,
        ready: bool,
    ) -> Result<(), ControlPlaneError> {
        self.apply(&format!(
            r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: default
  labels: {{{labels}}}
spec:
  nodeName: {node}
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: 30
  containers:
  - name: echo
    image: registry.example/echo:1
    ports:
    - {{containerPort: 8080, name: http}}
"#
        ))?;
        self.set_pod_ready(name, ip, ready)
    }

    /// Writes a Pod's status as a kubelet does: Running, its IP, Ready as given.
    pub fn set_pod_ready(&self, name: &str, ip: Ipv4Addr, ready: bool) -> Result<(), ControlPlaneError> {
        self.set_pod_status(name, &[IpAddr::V4(ip)], ready)
    }

    /// Writes a Pod's status as a kubelet does, with one IP per family (the first is `podIP`).
    pub fn set_pod_status(&self, name: &str, ips: &[IpAddr], ready: bool) -> Result<(), ControlPlaneError> {
        let ready = if ready { "True" } else { "False" };
        let first = ips.first().map(ToString::to_string).unwrap_or_default();
        let pod_ips: Vec<serde_json::Value> = ips.iter().map(|ip| serde_json::json!({"ip": ip.to_string()})).collect();
        self.patch_status(
            "pod",
            Some("default"),
            name,
            &serde_json::json!({
                "phase": "Running",
                "podIP": first,
                "podIPs": pod_ips,
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Initialized", "status": "True"},
                    {"type": "ContainersReady", "status": ready},
                    {"type": "Ready", "status": ready},
                ],
            }),
        )
    }

    /// A bearer token for a ServiceAccount (`kubectl create token`).
    pub fn token(&self, namespace: &str, service_account: &str) -> Result<String, ControlPlaneError> {
        Ok(self.kubectl_ok(&["create", "token", service_account, "-n", namespace, "--duration=2h"])?.trim().to_string())
    }

    /// An HTTP request to etcd's JSON gateway on the namespace's loopback (etcd speaks plain
    /// HTTP there); returns the body.
    pub fn etcd_request(&self, method: &str, path: &str, body: &str) -> Result<String, ControlPlaneError> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns, "curl", "-s", "-m", "5", "-X", method])
            .args(if body.is_empty() { vec![] } else { vec!["-d", body] })
            .arg(format!("http://127.0.0.1:2379{path}"))
            .output()
            .map_err(|source| ControlPlaneError::Spawn { what: "curl".into(), source })?;
        if !out.status.success() {
            return Err(ControlPlaneError::Failed { what: format!("etcd {path}"), output: format!("{}", out.status) });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Compacts etcd's history up to its current revision, so that a watch resuming from an
    /// older resourceVersion gets `410 Gone` and must list again.
    pub fn compact_etcd(&self) -> Result<i64, ControlPlaneError> {
        let range = self.etcd_request("POST", "/v3/kv/range", r#"{"key":"AA==","limit":1}"#)?;
        let value: serde_json::Value = serde_json::from_str(&range)
            .map_err(|e| ControlPlaneError::Failed { what: "etcd range".into(), output: format!("{e}: {range}") })?;
        let revision: i64 = value["header"]["revision"].as_str().and_then(|r| r.parse().ok()).unwrap_or(0);
        self.etcd_request("POST", "/v3/kv/compaction", &format!(r#"{{"revision":"{revision}","physical":true}}"#))?;
        Ok(revision)
    }

    /// The last lines each process logged (for a failing test's message).
    pub fn logs(&self) -> String {
        let apiserver = self.apiserver.lock().unwrap_or_else(|e| e.into_inner());
        [self.etcd.as_ref(), apiserver.as_ref(), self.controller_manager.as_ref(), self.scheduler.as_ref()]
            .into_iter()
            .flatten()
            .map(|p| format!("--- {} ---\n{}", p.what, p.log()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for ControlPlane {
    /// Stops the processes (the controller manager, the API server, then etcd) before their
    /// working directory is removed.
    fn drop(&mut self) {
        self.scheduler.take();
        self.controller_manager.take();
        self.kill_apiserver();
        self.etcd.take();
    }
}

/// A kubelet's bearer token (static: the lab's API server reads its tokens at start).
fn kubelet_token(node: &str) -> String {
    format!("nftproxy-lab-kubelet-{node}")
}

fn run(what: &str, cmd: &mut Command) -> Result<Output, ControlPlaneError> {
    let out = cmd.output().map_err(|source| ControlPlaneError::Spawn { what: what.to_string(), source })?;
    if !out.status.success() {
        return Err(ControlPlaneError::Failed {
            what: what.to_string(),
            output: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(out)
}
