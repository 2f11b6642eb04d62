//! The runner: one lab, one real control plane; upstream kube-proxy runs once over every seed,
//! then nftproxy once over the same seeds (each seed's objects replace the previous seed's
//! through the API server, and the runner waits until the proxy has synced them); `explain`
//! predicts every probe from the objects the API server holds; then the three are compared, and
//! each kind of difference is minimised against the proxy that departs from explain's
//! prediction.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::error::RandomError;
use super::generate::{Kind, LABEL, Scenario, generate};
use super::lab::{self as rlab, EchoServers, PODS};
use super::probe::{self, Disagreement, Outcome, Prediction, Probe, Who};
use crate::controlplane::{ControlPlane, KUBE_PROXY_IDENTITY};
use crate::lab::{Lab, Netns, topology};

/// Which proxy runs in node1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Proxy {
    KubeProxy,
    Nftproxy,
}

impl Proxy {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Proxy::KubeProxy => "kube-proxy",
            Proxy::Nftproxy => "nftproxy",
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub seeds: Vec<u64>,
    /// The `nftproxy` binary (the proxy and `explain`).
    pub nftproxy: PathBuf,
    /// Differences to minimise at most (one per kind of difference).
    pub minimise: usize,
    /// Candidate scenarios tried at most while minimising one difference.
    pub minimise_budget: usize,
    /// Print each seed's figures as it is done.
    pub progress: bool,
}

/// Time spent on one seed with one proxy.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    /// Deleting the previous objects and creating these through the API.
    pub apply: Duration,
    /// From the sync marker's creation until it answered through the proxy.
    pub sync: Duration,
    /// Sending every probe.
    pub probe: Duration,
}

impl Timing {
    /// The whole.
    pub fn total(&self) -> Duration {
        self.apply + self.sync + self.probe
    }
}

/// One seed's run.
#[derive(Debug, Clone)]
pub struct SeedRun {
    pub seed: u64,
    pub services: usize,
    pub endpoints: usize,
    pub probes: Vec<Probe>,
    pub predictions: Vec<Prediction>,
    pub kube_proxy: Vec<Outcome>,
    pub nftproxy: Vec<Outcome>,
    pub timing_kube_proxy: Timing,
    pub timing_nftproxy: Timing,
    /// Dumping the objects and running `explain` for every probe.
    pub explain: Duration,
    /// Why the seed could not run (its objects were refused, a proxy did not sync).
    pub failed: Option<String>,
}

/// One probe on which the three disagree.
#[derive(Debug, Clone)]
pub struct Difference {
    pub seed: u64,
    pub probe: Probe,
    pub disagreement: Disagreement,
    pub kube_proxy: Outcome,
    pub nftproxy: Outcome,
    pub predicted: Prediction,
}

impl Difference {
    /// The check name ([`crate::differences::DELIBERATE`] lists deliberate ones by prefix).
    pub fn check(&self) -> String {
        format!("random {}: {}", self.probe.check, self.disagreement.text())
    }
}

/// A difference reduced to a small scenario that still shows it.
#[derive(Debug, Clone)]
pub struct Minimised {
    pub difference: Difference,
    /// The scenario's YAML.
    pub yaml: String,
    /// The minimised scenario's outcome with the proxy that departs, and the prediction.
    pub outcome: String,
    pub predicted: String,
    pub tried: usize,
    pub took: Duration,
}

/// Everything a run found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub seeds: Vec<SeedRun>,
    pub differences: Vec<Difference>,
    pub minimised: Vec<Minimised>,
    /// Lab, control plane and cluster set up.
    pub setup: Duration,
    /// Each proxy's start until healthy.
    pub starts: Vec<(Proxy, Duration)>,
    pub total: Duration,
    /// Where the proxies' logs were kept (when anything differed).
    pub logs: Option<PathBuf>,
}

/// The lab, its control plane and the proxies' configuration.
struct Cluster {
    // Field order is drop order: servers, the control plane, then the lab's namespaces.
    _servers: EchoServers,
    cp: ControlPlane,
    lab: Lab,
    dir: tempfile::TempDir,
    config: PathBuf,
    nftproxy: PathBuf,
    /// Sync markers created so far (each a new ClusterIP).
    markers: AtomicU32,
}

/// A proxy running in node1; stopped and cleaned up by [`Running::stop`] (or killed on drop).
struct Running {
    child: Option<Child>,
    proxy: Proxy,
    log: PathBuf,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Cluster {
    fn new(nftproxy: &Path) -> Result<Cluster, RandomError> {
        let mut lab = rlab::build()?;
        let servers = EchoServers::start(&lab)?;
        let cp = ControlPlane::start_in(&mut lab, topology::SERVICE_CIDR_V4)?;
        for (name, zone) in [("node1", "zone-a"), ("node2", "zone-b")] {
            cp.add_node(name, lab.node(name).ip, zone)?;
        }
        for pod in &PODS {
            cp.apply(&format!(
                r#"apiVersion: v1
kind: Pod
metadata:
  name: {}
  namespace: default
  labels: {{{}}}
spec:
  nodeName: {}
  automountServiceAccountToken: false
  containers:
  - name: echo
    image: registry.example/echo:1
    ports:
    - {{containerPort: 8080, name: http, protocol: TCP}}
    - {{containerPort: 9090, name: alt, protocol: TCP}}
    - {{containerPort: 8080, name: dns, protocol: UDP}}
    - {{containerPort: 9090, name: altu, protocol: UDP}}
"#,
                pod.name, pod.labels, pod.node
            ))?;
            cp.set_pod_ready(pod.name, pod.ip, pod.ready)?;
        }
        cp.apply(KUBE_PROXY_IDENTITY)?;
        let token = cp.token("kube-system", "kube-proxy")?;
        let dir = tempfile::Builder::new().prefix("nftproxy-random-").tempdir()?;
        let kubeconfig = dir.path().join("kube-proxy.kubeconfig");
        std::fs::write(&kubeconfig, cp.kubeconfig(&token))?;
        let config = dir.path().join("config.conf");
        // kubeadm's configuration, a short minimum sync period (each seed waits for a sync),
        // conntrack sysctls left alone (a network namespace's are not theirs to change).
        std::fs::write(
            &config,
            format!(
                r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection: {{kubeconfig: {}}}
hostnameOverride: node1
clusterCIDR: {}
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
nftables: {{minSyncPeriod: 100ms}}
conntrack: {{maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
"#,
                kubeconfig.display(),
                topology::CLUSTER_CIDR_V4
            ),
        )?;
        Ok(Cluster {
            _servers: servers,
            cp,
            lab,
            dir,
            config,
            nftproxy: nftproxy.to_path_buf(),
            markers: AtomicU32::new(0),
        })
    }

    fn node1(&self) -> &Netns {
        &self.lab.node("node1").ns
    }

    fn ns(&self, who: Who) -> &Netns {
        let host = who.host();
        if let Some(c) = self.lab.client(host) {
            return &c.ns;
        }
        if let Some(p) = self.lab.pod(host) {
            return &p.ns;
        }
        &self.lab.node(host).ns
    }

    fn start(&self, proxy: Proxy) -> Result<(Running, Duration), RandomError> {
        let log = self.dir.path().join(format!("{}.log", proxy.name()));
        let mut command = match proxy {
            Proxy::Nftproxy => {
                let mut c = self.node1().command(&self.nftproxy.to_string_lossy());
                c.arg("run");
                c
            }
            Proxy::KubeProxy => self.node1().command(&self.cp.bins.path("kube-proxy").to_string_lossy()),
        };
        let started = Instant::now();
        let child = command
            .arg(format!("--config={}", self.config.display()))
            .stdout(Stdio::null())
            .stderr(std::fs::OpenOptions::new().create(true).append(true).open(&log)?)
            .spawn()?;
        let running = Running { child: Some(child), proxy, log };
        let healthz: SocketAddr = ([127, 0, 0, 1], 10256).into();
        while started.elapsed() < Duration::from_secs(90) {
            let ok = self
                .node1()
                .run(move || crate::lab::traffic::http_get(healthz, "/healthz", Duration::from_secs(1)))
                .ok()
                .and_then(Result::ok)
                .is_some_and(|(code, _)| code == 200);
            if ok {
                return Ok((running, started.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(RandomError::Proxy { proxy: proxy.name(), why: "not healthy within 90 s".into(), log: tail(&running.log) })
    }

    fn stop(&self, mut running: Running) -> Result<(), RandomError> {
        if let Some(mut c) = running.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let out = match running.proxy {
            Proxy::Nftproxy => self.node1().command(&self.nftproxy.to_string_lossy()).arg("cleanup").output()?,
            Proxy::KubeProxy => {
                self.node1().command(&self.cp.bins.path("kube-proxy").to_string_lossy()).arg("--cleanup").output()?
            }
        };
        if !out.status.success() {
            return Err(RandomError::Proxy {
                proxy: running.proxy.name(),
                why: "cleanup failed".into(),
                log: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        let _ = self.node1().exec("conntrack", &["-F"]);
        Ok(())
    }

    /// Replaces the cluster's generated objects with `scenario`'s and waits until the running
    /// proxy has synced them: a marker Service and slice are created last, and the proxy has
    /// synced every earlier object once the marker answers (each kind's watch delivers in
    /// order, and a sync takes everything received).
    fn apply(&self, scenario: &Scenario, running: &Running) -> Result<(Duration, Duration), RandomError> {
        let started = Instant::now();
        let n = self.markers.fetch_add(1, Ordering::Relaxed);
        let marker_ip = Ipv4Addr::new(10, 96, 255, (n % 250) as u8 + 1);
        let marker = format!(
            r#"---
apiVersion: v1
kind: Service
metadata:
  name: zz-marker-{n}
  namespace: default
  labels: {{{LABEL}: "true"}}
spec:
  clusterIP: {marker_ip}
  ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: zz-marker-{n}
  namespace: default
  labels: {{{LABEL}: "true", kubernetes.io/service-name: zz-marker-{n}, endpointslice.kubernetes.io/managed-by: nftproxy-random}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
- {{addresses: ["{}"], nodeName: node1, conditions: {{ready: true}}}}
"#,
            PODS[1].ip
        );
        // The marker goes last; in the same request unless load-balancer status or the
        // EndpointSlice controller's slices must come first.
        let marker_later = scenario
            .services
            .iter()
            .any(|s| !s.lb_ingress.is_empty() || (s.selector.is_some() && s.kind != Kind::Headless));
        let mut objects = scenario.services_yaml();
        let slices = scenario.slices_yaml();
        if !slices.is_empty() {
            objects.push_str(&slices);
        }
        if !marker_later {
            objects.push_str(&marker);
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.cp.kubectl_ok(&[
                "delete",
                "services,endpointslices",
                "-n",
                "default",
                "-l",
                &format!("{LABEL}=true"),
                "--wait=false",
            ])?;
            let created = if objects.trim().is_empty() {
                Ok(String::new())
            } else {
                self.cp.kubectl_stdin(&["create"], &objects)
            };
            match created {
                Ok(_) => break,
                // The previous objects' addresses and ports are released as they go.
                Err(e)
                    if attempt < 20
                        && (e.to_string().contains("already allocated")
                            || e.to_string().contains("AlreadyExists")
                            || e.to_string().contains("already exists")) =>
                {
                    std::thread::sleep(Duration::from_millis(300));
                }
                Err(e) => return Err(RandomError::Invalid { seed: scenario.seed, why: e.to_string() }),
            }
        }
        for s in scenario.services.iter().filter(|s| !s.lb_ingress.is_empty()) {
            let ingress: Vec<serde_json::Value> =
                s.lb_ingress.iter().map(|ip| serde_json::json!({"ip": ip.to_string()})).collect();
            self.cp.patch_status(
                "service",
                Some("default"),
                &s.name,
                &serde_json::json!({"loadBalancer": {"ingress": ingress}}),
            )?;
        }
        // Selector Services: the EndpointSlice controller's slices, complete, before the marker.
        for s in scenario.services.iter().filter(|s| s.selector.is_some() && s.kind != Kind::Headless) {
            let (key, value) = s.selector.and_then(|sel| sel.split_once(": ")).unwrap_or(("", ""));
            let expected = PODS.iter().filter(|p| p.labels.contains(&format!("{key}: {value}"))).count();
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let out = self.cp.kubectl_ok(&[
                    "get",
                    "endpointslices",
                    "-n",
                    "default",
                    "-l",
                    &format!("kubernetes.io/service-name={}", s.name),
                    "-o",
                    "jsonpath={.items[*].endpoints[*].addresses[0]}",
                ])?;
                let mut seen: Vec<&str> = out.split_whitespace().collect();
                seen.sort_unstable();
                seen.dedup();
                if seen.len() == expected {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(RandomError::Cluster(format!(
                        "seed {}: the controller did not slice {} ({} of {expected} endpoints)",
                        scenario.seed,
                        s.name,
                        seen.len()
                    )));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if marker_later {
            self.cp.kubectl_stdin(&["create"], &marker)?;
        }
        let applied = started.elapsed();
        let synced = Instant::now();
        let target: SocketAddr = (marker_ip, 80).into();
        loop {
            let answered = self
                .node1()
                .run(move || std::net::TcpStream::connect_timeout(&target, Duration::from_millis(150)).is_ok())
                .unwrap_or(false);
            if answered {
                break;
            }
            if synced.elapsed() > Duration::from_secs(120) {
                return Err(RandomError::Proxy {
                    proxy: running.proxy.name(),
                    why: format!("seed {}: the sync marker did not answer within 120 s", scenario.seed),
                    log: tail(&running.log),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok((applied, synced.elapsed()))
    }

    /// `explain`'s prediction for each probe, from the objects the API server holds now.
    fn predict(&self, probes: &[Probe]) -> Result<Vec<Prediction>, RandomError> {
        let objects = self.cp.kubectl_ok(&["get", "services,endpointslices,nodes", "-A", "-o", "json"])?;
        let manifests = self.dir.path().join("objects.json");
        std::fs::write(&manifests, objects)?;
        let next = AtomicUsize::new(0);
        let out: Mutex<Vec<Option<Prediction>>> = Mutex::new(vec![None; probes.len()]);
        std::thread::scope(|scope| {
            for _ in 0..3 {
                scope.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(p) = probes.get(i) else { break };
                        let prediction = explain(self.node1(), &self.nftproxy, &manifests, p);
                        if let Ok(mut all) = out.lock() {
                            all[i] = Some(prediction);
                        }
                    }
                });
            }
        });
        let all = out.into_inner().map_err(|_| RandomError::Cluster("an explain worker panicked".into()))?;
        Ok(all.into_iter().map(|p| p.unwrap_or_else(|| Prediction::Unknown("not run".into()))).collect())
    }

    /// Sends every probe and returns the outcomes: eight Service ports at a time, each port's
    /// probes one after the other (a ClusterIP, NodePort and external IP of one port share its
    /// session affinity, and racing first connections would each pick an endpoint).
    fn send(&self, probes: &[Probe], predictions: &[Prediction]) -> Vec<Outcome> {
        let mut groups: std::collections::BTreeMap<&str, Vec<usize>> = Default::default();
        for (i, p) in probes.iter().enumerate() {
            groups.entry(p.key.split(' ').next().unwrap_or("")).or_default().push(i);
        }
        let groups: Vec<Vec<usize>> = groups.into_values().collect();
        let next = AtomicUsize::new(0);
        let out: Mutex<Vec<Option<Outcome>>> = Mutex::new(vec![None; probes.len()]);
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    loop {
                        let g = next.fetch_add(1, Ordering::Relaxed);
                        let Some(group) = groups.get(g) else { break };
                        for &i in group {
                            let (p, predicted) = (&probes[i], &predictions[i]);
                            let outcome = self
                                .ns(p.who)
                                .run(|| probe::send(p, predicted))
                                .unwrap_or_else(|e| Outcome::Other(e.to_string()));
                            if let Ok(mut all) = out.lock() {
                                all[i] = Some(outcome);
                            }
                        }
                    }
                });
            }
        });
        out.into_inner()
            .map(|v| v.into_iter().map(|o| o.unwrap_or_else(|| Outcome::Other("not sent".into()))).collect())
            .unwrap_or_default()
    }
}

/// `nftproxy explain` offline, from the objects the API server held, with node1's flags, in
/// node1's namespace (where its node-port addresses are local).
fn explain(node1: &Netns, nftproxy: &Path, manifests: &Path, p: &Probe) -> Prediction {
    let mut command = node1.command(&nftproxy.to_string_lossy());
    command
        .arg("explain")
        .arg("--manifests")
        .arg(manifests)
        .args(["--hostname-override", "node1", "--cluster-cidr", topology::CLUSTER_CIDR_V4])
        .args(["--src", &p.who.own().to_string(), "--dst", &p.target.to_string()])
        .args(["--proto", p.protocol.name(), "--output", "json"]);
    if p.who == Who::Node {
        command.arg("--local");
    }
    match command.output() {
        Ok(out) if out.status.success() => Prediction::from_json(&String::from_utf8_lossy(&out.stdout)),
        Ok(out) => Prediction::Unknown(format!("explain failed: {}", String::from_utf8_lossy(&out.stderr).trim())),
        Err(e) => Prediction::Unknown(format!("cannot run {}: {e}", nftproxy.display())),
    }
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Runs the seeds: upstream over all of them, then nftproxy, then the comparison and the
/// minimisation of what differs.
pub fn run(options: &Options) -> Result<Report, RandomError> {
    let began = Instant::now();
    let cluster = Cluster::new(&options.nftproxy)?;
    let mut report = Report { setup: began.elapsed(), ..Report::default() };
    if options.progress {
        eprintln!("lab and control plane ready in {:.1} s", report.setup.as_secs_f64());
    }
    let scenarios: Vec<Scenario> = options.seeds.iter().map(|s| generate(*s)).collect();
    let mut runs: Vec<SeedRun> = scenarios
        .iter()
        .map(|s| SeedRun {
            seed: s.seed,
            services: s.services.len(),
            endpoints: s.endpoint_count(),
            probes: probe::probes(s),
            predictions: Vec::new(),
            kube_proxy: Vec::new(),
            nftproxy: Vec::new(),
            timing_kube_proxy: Timing::default(),
            timing_nftproxy: Timing::default(),
            explain: Duration::ZERO,
            failed: None,
        })
        .collect();
    for proxy in [Proxy::KubeProxy, Proxy::Nftproxy] {
        let (running, start) = cluster.start(proxy)?;
        report.starts.push((proxy, start));
        for (scenario, seed_run) in scenarios.iter().zip(runs.iter_mut()) {
            if seed_run.failed.is_some() {
                continue;
            }
            let (applied, synced) = match cluster.apply(scenario, &running) {
                Ok(t) => t,
                // A seed that cannot run (refused objects, no sync within two minutes) is
                // reported, and the run goes on.
                Err(e @ (RandomError::Invalid { .. } | RandomError::Proxy { .. } | RandomError::Cluster(_))) => {
                    seed_run.failed = Some(format!("{}: {e}", proxy.name()));
                    continue;
                }
                Err(e) => return Err(e),
            };
            if proxy == Proxy::KubeProxy {
                let t = Instant::now();
                seed_run.predictions = cluster.predict(&seed_run.probes)?;
                seed_run.explain = t.elapsed();
            }
            let t = Instant::now();
            let outcomes = cluster.send(&seed_run.probes, &seed_run.predictions);
            let timing = Timing { apply: applied, sync: synced, probe: t.elapsed() };
            match proxy {
                Proxy::KubeProxy => (seed_run.kube_proxy, seed_run.timing_kube_proxy) = (outcomes, timing),
                Proxy::Nftproxy => (seed_run.nftproxy, seed_run.timing_nftproxy) = (outcomes, timing),
            }
            if options.progress {
                eprintln!(
                    "{}: seed {} ({} services, {} endpoints, {} probes): apply {:.2} s, sync {:.2} s, probes {:.2} s{}",
                    proxy.name(),
                    scenario.seed,
                    seed_run.services,
                    seed_run.endpoints,
                    seed_run.probes.len(),
                    applied.as_secs_f64(),
                    synced.as_secs_f64(),
                    timing.probe.as_secs_f64(),
                    if proxy == Proxy::KubeProxy {
                        format!(", explain {:.2} s", seed_run.explain.as_secs_f64())
                    } else {
                        String::new()
                    }
                );
            }
        }
        cluster.stop(running)?;
    }
    for (scenario, seed_run) in scenarios.iter().zip(&runs) {
        if seed_run.failed.is_some() {
            continue;
        }
        for (i, p) in seed_run.probes.iter().enumerate() {
            let (u, n, pr) = (&seed_run.kube_proxy[i], &seed_run.nftproxy[i], &seed_run.predictions[i]);
            if let Some(d) = Disagreement::of(p, u, n, pr) {
                report.differences.push(Difference {
                    seed: scenario.seed,
                    probe: p.clone(),
                    disagreement: d,
                    kube_proxy: u.clone(),
                    nftproxy: n.clone(),
                    predicted: pr.clone(),
                });
            }
        }
    }
    report.minimised = minimise_all(&cluster, &scenarios, &report.differences, options)?;
    runs.iter_mut().for_each(|r| r.probes.shrink_to_fit());
    report.seeds = runs;
    if !report.differences.is_empty() {
        // The proxies' logs outlive the lab when something differed: a difference that does
        // not show again is read from them.
        let kept = std::env::temp_dir().join(format!("nftproxy-random-logs-{}", std::process::id()));
        std::fs::create_dir_all(&kept)?;
        for proxy in [Proxy::KubeProxy, Proxy::Nftproxy] {
            let name = format!("{}.log", proxy.name());
            let _ = std::fs::copy(cluster.dir.path().join(&name), kept.join(&name));
        }
        report.logs = Some(kept);
    }
    report.total = began.elapsed();
    Ok(report)
}

/// Minimises one difference of each kind (check and disagreement), up to `options.minimise`,
/// each with the proxy whose outcome departs from explain's prediction running.
fn minimise_all(
    cluster: &Cluster,
    scenarios: &[Scenario],
    differences: &[Difference],
    options: &Options,
) -> Result<Vec<Minimised>, RandomError> {
    let mut chosen: Vec<(Proxy, &Difference)> = Vec::new();
    let mut kinds = std::collections::BTreeSet::new();
    for d in differences {
        let proxy = match d.disagreement {
            Disagreement::ProxiesOnly => continue,
            Disagreement::Upstream => Proxy::KubeProxy,
            Disagreement::Nftproxy | Disagreement::Explain | Disagreement::All => Proxy::Nftproxy,
        };
        if chosen.len() < options.minimise && kinds.insert((d.probe.check.clone(), d.disagreement)) {
            chosen.push((proxy, d));
        }
    }
    let mut out = Vec::new();
    for proxy in [Proxy::KubeProxy, Proxy::Nftproxy] {
        let mine: Vec<&Difference> = chosen.iter().filter(|(p, _)| *p == proxy).map(|(_, d)| *d).collect();
        if mine.is_empty() {
            continue;
        }
        let (running, _) = cluster.start(proxy)?;
        for d in mine {
            let Some(scenario) = scenarios.iter().find(|s| s.seed == d.seed) else { continue };
            if options.progress {
                eprintln!(
                    "minimising seed {} {} ({}) with {}",
                    d.seed,
                    d.probe.key,
                    d.disagreement.text(),
                    proxy.name()
                );
            }
            match minimise(cluster, &running, scenario, d, options.minimise_budget) {
                Ok(m) => out.push(m),
                Err(e) => out.push(Minimised {
                    difference: d.clone(),
                    yaml: scenario.to_yaml(),
                    outcome: format!("not minimised: {e}"),
                    predicted: String::new(),
                    tried: 0,
                    took: Duration::ZERO,
                }),
            }
        }
        cluster.stop(running)?;
    }
    Ok(out)
}

/// Whether `candidate` still shows the difference: its probe exists, and the running proxy's
/// outcome does not fit explain's prediction. Returns the outcome and prediction when it does.
fn still_differs(
    cluster: &Cluster,
    running: &Running,
    candidate: &Scenario,
    key: &str,
) -> Result<Option<(Outcome, Prediction)>, RandomError> {
    let Some(p) = probe::probes(candidate).into_iter().find(|p| p.key == key) else { return Ok(None) };
    match cluster.apply(candidate, running) {
        Ok(_) => {}
        // A candidate the API server refuses (a Service left without ports) shows nothing.
        Err(RandomError::Invalid { .. }) => return Ok(None),
        Err(e) => return Err(e),
    }
    let predicted = cluster.predict(std::slice::from_ref(&p))?.remove(0);
    let outcome = cluster.send(std::slice::from_ref(&p), std::slice::from_ref(&predicted)).remove(0);
    Ok((!probe::fits(&p, &outcome, &predicted)).then_some((outcome, predicted)))
}

/// Delta debugging, greedily: drops Services, then endpoints, then Service ports, in halving
/// chunks, keeping each removal after which the difference persists.
fn minimise(
    cluster: &Cluster,
    running: &Running,
    scenario: &Scenario,
    d: &Difference,
    budget: usize,
) -> Result<Minimised, RandomError> {
    let started = Instant::now();
    let key = d.probe.key.as_str();
    let mut best = scenario.clone();
    let mut tried = 0;
    let mut last = match still_differs(cluster, running, &best, key)? {
        Some(found) => found,
        None => {
            return Ok(Minimised {
                difference: d.clone(),
                yaml: best.to_yaml(),
                outcome: "did not show again with the seed's own objects (not minimised)".into(),
                predicted: String::new(),
                tried: 1,
                took: started.elapsed(),
            });
        }
    };
    // Each pass: a list of "units" of the current best, and how to remove a range of them.
    type Units = fn(&Scenario) -> Vec<usize>;
    type Remove = fn(&Scenario, usize, std::ops::Range<usize>) -> Scenario;
    let passes: [(Units, Remove); 3] = [
        (
            |s| vec![s.services.len()],
            |s, _, r| {
                let mut c = s.clone();
                c.services.drain(r);
                c
            },
        ),
        (
            |s| s.services.iter().map(|x| x.endpoints.len()).collect(),
            |s, i, r| {
                let mut c = s.clone();
                c.services[i].endpoints.drain(r);
                c
            },
        ),
        (
            |s| s.services.iter().map(|x| x.ports.len()).collect(),
            |s, i, r| {
                let mut c = s.clone();
                if r.len() >= c.services[i].ports.len() {
                    return c;
                }
                let removed: Vec<String> = c.services[i].ports.drain(r).map(|p| p.name).collect();
                c.services[i].slice_ports.retain(|p| !removed.contains(&p.name));
                c
            },
        ),
    ];
    for (units, remove) in passes {
        let mut group = 0;
        while group < units(&best).len() {
            let mut chunk = units(&best)[group].div_ceil(2).max(1);
            loop {
                let mut start = 0;
                while start < units(&best)[group] {
                    if tried >= budget {
                        break;
                    }
                    let len = units(&best)[group];
                    let candidate = remove(&best, group, start..(start + chunk).min(len));
                    if candidate == best {
                        start += chunk;
                        continue;
                    }
                    tried += 1;
                    if let Some(found) = still_differs(cluster, running, &candidate, key)? {
                        best = candidate;
                        last = found;
                    } else {
                        start += chunk;
                    }
                }
                if chunk == 1 || tried >= budget {
                    break;
                }
                chunk = chunk.div_ceil(2);
            }
            group += 1;
        }
    }
    Ok(Minimised {
        difference: d.clone(),
        yaml: best.to_yaml(),
        outcome: last.0.to_string(),
        predicted: last.1.to_string(),
        tried,
        took: started.elapsed(),
    })
}
