//! nftproxy beside upstream kube-proxy v1.37 (nftables mode), on the same lab, the same real
//! API server (dual-stack), the same configuration file and the same probes. Each proxy in turn
//! runs in node1 (the previous one stopped, its rules removed with its own cleanup, conntrack
//! flushed) and goes through the same scenario:
//!
//! 1. probes of every kind of frontend and policy, over IPv4 and IPv6, from a client, a pod and
//!    the node itself, and the health endpoints and metric families;
//! 2. UDP conntrack entries left after an endpoint goes, turns unready, and after a Service is
//!    deleted;
//! 3. the API server down (health endpoints);
//! 4. a restart with every object present: an established UDP flow and TCP connection, probes
//!    while the proxy is down, and the health endpoints right after its start;
//! 5. restarts with loopback-only and mixed loopback `nodePortAddresses`;
//! 6. its Node deleted (both exit 1).
//!
//! Any difference between nftproxy and upstream in nftables mode that is not listed in
//! [`DELIBERATE`] (docs/differences.md) fails the test. Upstream in iptables mode runs the same
//! scenario as a reference: its outcomes are printed beside the others and never fail the test
//! (iptables mode serves NodePorts on every address and on localhost by default, by design).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::common::*;
use nftproxy::net::L4Proto;
use nftproxy_tools::controlplane::ControlPlane;
use nftproxy_tools::lab::traffic;
use nftproxy_tools::process::ProcessGroup;
// Differences from upstream that nftproxy makes on purpose, by check name, each a row of
// docs/differences.md: one list, shared with the randomised clusters (integration/random.rs).
// Any other difference fails the test, and so does a listed one of this test's checks that no
// longer shows (the list must stay true).
use nftproxy_tools::differences::DELIBERATE;

/// Which proxy runs in node1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Proxy {
    Nftproxy,
    UpstreamNftables,
    /// Upstream in iptables mode: a reference, never compared for failure.
    UpstreamIptables,
}

/// What a proxy did with one probe.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// Answered: by which pods, and the source address they saw (by role).
    Answered { backends: BTreeSet<String>, sources: BTreeSet<String> },
    /// Every answer from one pod (session affinity), whichever it was.
    Sticky { sources: BTreeSet<String> },
    /// Refused at once (a reject).
    Refused,
    /// No answer (dropped).
    Dropped,
    /// Anything else.
    Other(String),
}

struct Probe {
    name: String,
    who: &'static str,
    proto: L4Proto,
    target: String,
    sticky: bool,
    /// How many connections to try (a dropped probe waits [`DROP_WAIT`] each).
    asks: usize,
}

/// How long a probe waits for an answer: a dropped probe costs this much per ask.
const DROP_WAIT: Duration = Duration::from_millis(1200);

fn probe(name: &str, who: &'static str, proto: L4Proto, target: impl Into<String>) -> Probe {
    Probe { name: name.to_string(), who, proto, target: target.into(), sticky: false, asks: 24 }
}

/// A probe that is expected to see few answers, or none: two asks.
fn short(name: &str, who: &'static str, proto: L4Proto, target: impl Into<String>) -> Probe {
    Probe { asks: 2, ..probe(name, who, proto, target) }
}

/// The Services of the differential test (every type and policy it compares).
const SERVICES: &str = include_str!("fixtures/differential/services.yaml");

/// The UDP Service the conntrack phase deletes (and the next proxy's phase recreates).
const UDP_GONE: &str = r#"apiVersion: v1
kind: Service
metadata: {name: udp-gone, namespace: default}
spec:
  clusterIP: 10.96.0.61
  ports: [{name: p, port: 53, protocol: UDP}]
"#;

/// An endpoint's conditions in a hand-written EndpointSlice.
#[derive(Clone, Copy)]
enum Cond {
    Ready,
    /// Being deleted, still serving.
    Terminating,
    /// Unready and not terminating (serving follows ready).
    Unready,
}

/// An EndpointSlice for a selector-less Service, with one endpoint per pod.
fn slice(lab: &ClusterLab, service: &str, proto: &str, port: u16, endpoints: &[(&str, Cond)]) -> String {
    let mut eps = String::new();
    for (pod, cond) in endpoints {
        let p = lab.lab.pod(pod).expect("pod");
        let (ready, serving, terminating) = match cond {
            Cond::Ready => (true, true, false),
            Cond::Terminating => (false, true, true),
            Cond::Unready => (false, false, false),
        };
        eps.push_str(&format!(
            "- {{addresses: [{}], nodeName: {}, conditions: {{ready: {ready}, serving: {serving}, terminating: {terminating}}}}}\n",
            p.ip, p.node
        ));
    }
    format!(
        r#"apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {service}-1, namespace: default, labels: {{kubernetes.io/service-name: {service}}}}}
addressType: IPv4
ports: [{{name: p, port: {port}, protocol: {proto}}}]
endpoints:
{eps}"#
    )
}

/// The configuration every proxy starts with, kubeadm-style, dual-stack, with `extra` lines.
/// Conntrack sysctls are left alone: in a network namespace the global ones are not theirs to
/// change.
fn config(kubeconfig: &std::path::Path, mode: &str, extra: &str) -> String {
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: {mode}
clientConnection: {{kubeconfig: {}}}
hostnameOverride: node1
clusterCIDR: {},{}
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
conntrack: {{maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
{extra}"#,
        kubeconfig.display(),
        nftproxy_tools::lab::topology::CLUSTER_CIDR_V4,
        nftproxy_tools::lab::topology::CLUSTER_CIDR_V6,
    )
}

/// The `nodePortAddresses` settings the restarts of phase 5 use, by name.
const NODEPORT_ADDRESSES: [(&str, &str); 2] = [
    ("localhost", "nodePortAddresses: [localhost]\n"),
    ("loopback and wan", "nodePortAddresses: [127.0.0.0/8, 192.168.50.0/24]\n"),
];

/// A name for an address the pods see: a lab host's role.
fn role(lab: &ClusterLab, ip: IpAddr) -> String {
    let ip = ip.to_canonical();
    for n in &lab.lab.nodes {
        if [IpAddr::V4(n.ip), IpAddr::V4(n.gateway), IpAddr::V6(n.ip6), IpAddr::V6(n.gateway6)].contains(&ip) {
            return n.name.clone();
        }
    }
    for c in &lab.lab.clients {
        if ip == IpAddr::V4(c.ip) || ip == IpAddr::V6(c.ip6) {
            return c.name.clone();
        }
    }
    for p in &lab.lab.pods {
        if ip == IpAddr::V4(p.ip) || ip == IpAddr::V6(p.ip6) {
            return p.name.clone();
        }
    }
    ip.to_string()
}

/// The network namespace of a lab host by name.
fn ns<'a>(lab: &'a ClusterLab, who: &str) -> &'a nftproxy_tools::lab::Netns {
    if let Some(c) = lab.lab.client(who) {
        return &c.ns;
    }
    if let Some(p) = lab.lab.pod(who) {
        return &p.ns;
    }
    &lab.lab.node(who).ns
}

fn tally(lab: &ClusterLab, who: &str, proto: L4Proto, target: &str, n: usize) -> traffic::Tally {
    let target: SocketAddr = target.parse().expect("target");
    ns(lab, who).run(move || traffic::tally(proto, target, n, DROP_WAIT)).expect("namespace")
}

fn outcome(lab: &ClusterLab, probe: &Probe) -> Outcome {
    let t = tally(lab, probe.who, probe.proto, &probe.target, probe.asks);
    let sources: BTreeSet<String> = t.sources.keys().map(|ip| role(lab, *ip)).collect();
    if t.answered() == 0 {
        let errors: Vec<&String> = t.errors.keys().collect();
        return match errors.as_slice() {
            [e] if e.contains("refused") || e.contains("unreachable") => Outcome::Refused,
            [e] if e.contains("timed out") || e.contains("would block") || e.contains("temporarily") => {
                Outcome::Dropped
            }
            _ => Outcome::Other(format!("{:?}", t.errors)),
        };
    }
    if !t.errors.is_empty() {
        return Outcome::Other(format!("answered {:?} and failed {:?}", t.by_backend, t.errors));
    }
    if probe.sticky {
        return match t.by_backend.len() {
            1 => Outcome::Sticky { sources },
            _ => Outcome::Other(format!("not sticky: {:?}", t.by_backend)),
        };
    }
    Outcome::Answered { backends: t.by_backend.keys().cloned().collect(), sources }
}

/// An outcome without which pods answered: for probes that ask too few times to reach them all.
fn reached(outcome: Outcome) -> String {
    match outcome {
        Outcome::Answered { sources, .. } => format!("Answered, sources {sources:?}"),
        other => format!("{other:?}"),
    }
}

/// What one proxy showed: each probe's outcome, and each other check's value.
type Observed = BTreeMap<String, String>;

/// The status code and a body's JSON, flattened as `a.b=value`: every key, and every value but
/// the times (which differ between any two runs).
fn shape(code: u16, body: &str) -> String {
    fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeSet<String>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, child) in map {
                    let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    out.insert(path.clone());
                    flatten(&path, child, out);
                }
            }
            leaf if !(prefix.ends_with("lastUpdated") || prefix.ends_with("currentTime")) => {
                out.insert(format!("{prefix}={leaf}"));
            }
            _ => {}
        }
    }
    let mut out = BTreeSet::new();
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
        flatten("", &v, &mut out);
    }
    format!("{code} {out:?}")
}

/// An HTTP GET from `who`: the status and body's [`shape`], or how the connection failed.
fn http_shape(lab: &ClusterLab, who: &str, addr: &str, path: &str) -> String {
    match lab.http_get(who, addr, path) {
        Ok((code, body)) => shape(code, &body),
        Err(e) => format!("failed: {}", e.kind()),
    }
}

/// `kubeproxy_*` families of a /metrics text with their label names.
fn families(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap_or("");
            if name.starts_with("kubeproxy_") {
                out.entry(name.to_string()).or_default();
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or("");
        let family = out.keys().filter(|f| name.starts_with(f.as_str())).max_by_key(|f| f.len()).cloned();
        if let (Some(family), Some(labels)) = (family, line.split_once('{').and_then(|(_, l)| l.split_once('}'))) {
            for pair in labels.0.split(',') {
                if let Some((k, _)) = pair.split_once('=')
                    && k != "le"
                {
                    out.entry(family.clone()).or_default().insert(k.to_string());
                }
            }
        }
    }
    out
}

fn observe(lab: &ClusterLab, probes: &[Probe], seen: &mut Observed) {
    for p in probes {
        seen.insert(format!("probe {}", p.name), format!("{:?}", outcome(lab, p)));
    }
    let node1 = lab.lab.node("node1");
    seen.insert("health check node port".into(), http_shape(lab, "client", &format!("{}:32100", node1.ip), "/"));
    seen.insert(
        "health check node port on the node's IPv6 address".into(),
        http_shape(lab, "client", &format!("[{}]:32100", node1.ip6), "/"),
    );
    seen.insert(
        "health check node port on the pods' gateway address".into(),
        http_shape(lab, "client", &format!("{}:32100", node1.gateway), "/"),
    );
    seen.insert(
        "health check node port on 127.0.0.1 from the node".into(),
        http_shape(lab, "node1", "127.0.0.1:32100", "/"),
    );
    for path in ["/healthz", "/livez"] {
        seen.insert(format!("healthz port {path}"), http_shape(lab, "node1", "127.0.0.1:10256", path));
    }
    let (_, metrics) = lab.http_get("node1", "127.0.0.1:10249", "/metrics").unwrap_or((0, String::new()));
    for (family, labels) in families(&metrics) {
        seen.insert(format!("metric {family}"), format!("{labels:?}"));
    }
}

/// node1's UDP conntrack entries to `service`, by role: `client -> 10.96.0.60:53 => web-3`
/// (original source, destination, and the reply's source: the endpoint, or the service itself
/// when the flow was never DNATed).
fn udp_flows(lab: &ClusterLab, service: &str) -> BTreeSet<String> {
    let out = lab.lab.node("node1").ns.command("conntrack").args(["-L", "-p", "udp"]).output().expect("conntrack");
    let mut flows = BTreeSet::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let fields: Vec<(&str, &str)> = line.split_whitespace().filter_map(|f| f.split_once('=')).collect();
        let all = |key: &str| fields.iter().filter(|(k, _)| *k == key).map(|(_, v)| *v).collect::<Vec<_>>();
        let (src, dst, dport) = (all("src"), all("dst"), all("dport"));
        if src.len() < 2 || dst.first() != Some(&service) {
            continue;
        }
        let name = |v: &str| v.parse::<IpAddr>().map(|ip| role(lab, ip)).unwrap_or_else(|_| v.to_string());
        flows.insert(format!("{} -> {service}:{} => {}", name(src[0]), dport.first().unwrap_or(&"?"), name(src[1])));
    }
    flows
}

/// A TCP server in a pod that keeps each connection open and answers every line with the pod's
/// name: an established connection to test across a restart. Stops when dropped.
struct LineServer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LineServer {
    fn start(lab: &ClusterLab, pod: &'static str, port: u16) -> LineServer {
        let listener = ns(lab, pod)
            .run(move || TcpListener::bind(("0.0.0.0", port)).and_then(|l| l.set_nonblocking(true).map(|_| l)))
            .expect("namespace")
            .expect("line server");
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        std::thread::spawn(move || {
                            let _ = conn.set_nonblocking(false);
                            let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
                            let mut writer = match conn.try_clone() {
                                Ok(w) => w,
                                Err(_) => return,
                            };
                            for line in BufReader::new(conn).lines() {
                                if line.is_err() || writeln!(writer, "{pod}").is_err() {
                                    break;
                                }
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        LineServer { stop, thread: Some(thread) }
    }
}

impl Drop for LineServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An established flow held across a restart: a UDP socket and a TCP connection, each asked
/// again by [`Held::ask`].
struct Held {
    udp: UdpSocket,
    tcp: BufReader<TcpStream>,
}

impl Held {
    fn open(lab: &ClusterLab) -> Held {
        let (udp, tcp) = ns(lab, "client")
            .run(|| {
                let udp = UdpSocket::bind("0.0.0.0:0")?;
                udp.set_read_timeout(Some(DROP_WAIT))?;
                udp.connect("10.96.0.10:53")?;
                let tcp = TcpStream::connect_timeout(&"10.96.0.70:9090".parse().expect("address"), DROP_WAIT)?;
                tcp.set_read_timeout(Some(DROP_WAIT))?;
                std::io::Result::Ok((udp, tcp))
            })
            .expect("namespace")
            .expect("established flows");
        Held { udp, tcp: BufReader::new(tcp) }
    }

    /// Who answers on the held UDP flow and on the held TCP connection (or how each failed).
    fn ask(&mut self) -> (String, String) {
        let mut buf = [0u8; 512];
        let udp = match self.udp.send(b"who\n").and_then(|_| self.udp.recv(&mut buf)) {
            Ok(n) => String::from_utf8_lossy(&buf[..n]).split_whitespace().next().unwrap_or("").to_string(),
            Err(e) => format!("failed: {}", e.kind()),
        };
        let mut line = String::new();
        let tcp = match writeln!(self.tcp.get_mut(), "who").and_then(|_| self.tcp.read_line(&mut line)) {
            Ok(0) => "closed".to_string(),
            Ok(_) => line.trim().to_string(),
            Err(e) => format!("failed: {}", e.kind()),
        };
        (udp, tcp)
    }
}

/// A proxy process in node1, leading a process group of its own (upstream's `nft` and
/// `iptables-restore` children stop with it), killed with it when dropped.
struct Running {
    proxy: Proxy,
    process: ProcessGroup,
    log: std::path::PathBuf,
    /// When it was started (wall clock, as the sync timestamp metric has it).
    started: std::time::SystemTime,
}

impl Running {
    fn start(
        lab: &ClusterLab,
        proxy: Proxy,
        program: &std::path::Path,
        config: &std::path::Path,
        run: usize,
    ) -> Running {
        let log = lab.dir.path().join(format!("{proxy:?}-{run}.log"));
        let started = std::time::SystemTime::now();
        let mut command = lab.lab.node("node1").ns.command(program.to_str().expect("path"));
        match proxy {
            Proxy::Nftproxy => command.arg("run"),
            // At level 2 upstream logs each sync's end ("SyncProxyRules complete").
            Proxy::UpstreamNftables | Proxy::UpstreamIptables => command.arg("--v=2"),
        };
        command
            .arg(format!("--config={}", config.display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"));
        let process = ProcessGroup::spawn(&mut command).expect("spawn the proxy");
        Running { proxy, process, log, started }
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether this process has synced both families. Neither /healthz nor probes tell: a
    /// restarted proxy finds its predecessor's rules in place, and upstream reports each
    /// family updated before its first sync. nftproxy's sync timestamp metric says it; upstream
    /// logs each sync (its metrics are not polled: in iptables mode a /metrics scrape at start
    /// sometimes never returned, its nfacct collector stuck on this kernel).
    fn synced(&self, lab: &ClusterLab) -> bool {
        match self.proxy {
            Proxy::Nftproxy => synced_since(lab, self.started),
            Proxy::UpstreamNftables | Proxy::UpstreamIptables => {
                let text = self.text();
                ["IPv4", "IPv6"].iter().all(|f| text.contains(&format!("\"SyncProxyRules complete\" ipFamily=\"{f}\"")))
            }
        }
    }

    /// Stops the process as an operator's restart does: SIGTERM, then SIGKILL after 10 s.
    fn stop(&mut self) {
        self.process.stop(Duration::from_secs(10));
    }

    /// Waits up to `within` for the process to exit by itself; its exit code.
    fn exit_within(&mut self, within: Duration) -> Option<Option<i32>> {
        self.process.exit_within(within).map(|status| status.code())
    }
}

/// Whether node1's ruleset (nftables, or iptables-nft's tables) mentions `text`.
fn programmed(lab: &ClusterLab, text: &str) -> bool {
    lab.listing().contains(text)
}

/// Whether both families' last successful sync (`kubeproxy_sync_proxy_rules_last_timestamp_seconds`)
/// came after `since`.
fn synced_since(lab: &ClusterLab, since: std::time::SystemTime) -> bool {
    let since = since.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let Ok((200, metrics)) = lab.http_get("node1", "127.0.0.1:10249", "/metrics") else { return false };
    ["IPv4", "IPv6"].iter().all(|family| {
        let series = format!("kubeproxy_sync_proxy_rules_last_timestamp_seconds{{ip_family=\"{family}\"}}");
        metrics
            .lines()
            .any(|l| l.strip_prefix(&series).and_then(|v| v.trim().parse::<f64>().ok()).is_some_and(|t| t >= since))
    })
}

/// Waits for a freshly started proxy to serve: both families synced by this process, /healthz
/// 200 and the web ClusterIP answering.
fn wait_serving(lab: &ClusterLab, proxy: Proxy, running: &Running) -> Duration {
    let started = Instant::now();
    assert!(
        lab.eventually(Duration::from_secs(60), || {
            running.synced(lab)
                && lab.http_get("node1", "127.0.0.1:10256", "/healthz").is_ok_and(|(c, _)| c == 200)
                && tally(lab, "client", L4Proto::Tcp, "10.96.0.10:80", 3).answered() == 3
        }),
        "{proxy:?} did not start:\n{}",
        running.text()
    );
    started.elapsed()
}

/// Everything the lab holds, for every proxy alike.
struct Setup<'a> {
    lab: &'a ClusterLab,
    cp: &'a ControlPlane,
    configs: BTreeMap<(Proxy, &'static str), std::path::PathBuf>,
}

impl Setup<'_> {
    fn program(&self, proxy: Proxy) -> std::path::PathBuf {
        match proxy {
            Proxy::Nftproxy => std::path::PathBuf::from(env!("CARGO_BIN_EXE_nftproxy")),
            Proxy::UpstreamNftables | Proxy::UpstreamIptables => self.cp.bins.path("kube-proxy"),
        }
    }

    fn start(&self, proxy: Proxy, config: &'static str, run: usize) -> Running {
        Running::start(self.lab, proxy, &self.program(proxy), &self.configs[&(proxy, config)], run)
    }

    /// The proxy's own cleanup of its rules in node1, then conntrack flushed.
    fn cleanup(&self, proxy: Proxy) {
        let node1 = &self.lab.lab.node("node1").ns;
        let cleanup = match proxy {
            Proxy::Nftproxy => node1.command(env!("CARGO_BIN_EXE_nftproxy")).arg("cleanup").output(),
            Proxy::UpstreamNftables | Proxy::UpstreamIptables => {
                node1.command(self.program(proxy).to_str().expect("path")).arg("--cleanup").output()
            }
        }
        .expect("cleanup");
        assert!(cleanup.status.success(), "{proxy:?} cleanup: {}", String::from_utf8_lossy(&cleanup.stderr));
        let _ = node1.command("conntrack").arg("-F").output();
    }

    /// The slices and Services the scenario changes, as each proxy's run starts with them.
    fn reset(&self) {
        let lab = self.lab;
        self.cp.apply(&slice(lab, "udp-ep", "UDP", 8080, &[("web-3", Cond::Ready)])).expect("udp-ep slice");
        self.cp.apply(UDP_GONE).expect("udp-gone");
        self.cp.apply(&slice(lab, "udp-gone", "UDP", 8080, &[("web-1", Cond::Ready)])).expect("udp-gone slice");
    }
}

/// Phase 2: the UDP conntrack entries each proxy leaves.
fn conntrack_phase(setup: &Setup<'_>, observed: &mut Observed) {
    let (lab, cp) = (setup.lab, setup.cp);
    let answered_by = |target: &str, pod: &str| {
        let t = tally(lab, "client", L4Proto::Udp, target, 3);
        t.answered() == 3 && t.by_backend.contains_key(pod)
    };
    // An endpoint goes: flows to web-3, then web-3 replaced by web-2.
    assert!(lab.eventually(Duration::from_secs(20), || answered_by("10.96.0.60:53", "web-3")), "udp-ep on web-3");
    cp.apply(&slice(lab, "udp-ep", "UDP", 8080, &[("web-2", Cond::Ready)])).expect("slice");
    assert!(lab.eventually(Duration::from_secs(20), || answered_by("10.96.0.60:53", "web-2")), "udp-ep on web-2");
    std::thread::sleep(Duration::from_secs(1));
    observed.insert("conntrack: UDP endpoint removed".into(), format!("{:?}", udp_flows(lab, "10.96.0.60")));
    // The endpoint turns unready (not terminating: not serving either); web-1 takes over.
    cp.apply(&slice(lab, "udp-ep", "UDP", 8080, &[("web-2", Cond::Unready), ("web-1", Cond::Ready)])).expect("slice");
    assert!(lab.eventually(Duration::from_secs(20), || answered_by("10.96.0.60:53", "web-1")), "udp-ep on web-1");
    std::thread::sleep(Duration::from_secs(1));
    observed.insert("conntrack: UDP endpoint unready".into(), format!("{:?}", udp_flows(lab, "10.96.0.60")));
    // A terminating endpoint still serves: its flows stay.
    cp.apply(&slice(lab, "udp-ep", "UDP", 8080, &[("web-1", Cond::Terminating), ("web-3", Cond::Ready)]))
        .expect("slice");
    assert!(lab.eventually(Duration::from_secs(20), || answered_by("10.96.0.60:53", "web-3")), "udp-ep on web-3");
    std::thread::sleep(Duration::from_secs(1));
    observed.insert("conntrack: UDP endpoint terminating".into(), format!("{:?}", udp_flows(lab, "10.96.0.60")));
    // The Service deleted.
    assert!(lab.eventually(Duration::from_secs(20), || answered_by("10.96.0.61:53", "web-1")), "udp-gone");
    cp.kubectl_ok(&["delete", "service", "udp-gone"]).expect("delete udp-gone");
    assert!(lab.eventually(Duration::from_secs(20), || !programmed(lab, "10.96.0.61")), "udp-gone unprogrammed");
    std::thread::sleep(Duration::from_secs(1));
    observed.insert("conntrack: UDP Service deleted".into(), format!("{:?}", udp_flows(lab, "10.96.0.61")));
}

/// Phase 4: a restart with every object present.
fn restart_phase(setup: &Setup<'_>, proxy: Proxy, running: &mut Running, observed: &mut Observed) -> Running {
    let lab = setup.lab;
    let mut held = Held::open(lab);
    let (udp_before, tcp_before) = held.ask();
    running.stop();
    let (udp, tcp) = held.ask();
    let same = |before: &str, now: &str| if before == now { "same endpoint".to_string() } else { now.to_string() };
    observed.insert("restart: held UDP flow, proxy stopped".into(), same(&udp_before, &udp));
    observed.insert("restart: held TCP connection, proxy stopped".into(), same(&tcp_before, &tcp));
    observed.insert(
        "restart: new connections, proxy stopped".into(),
        format!("{:?}", outcome(lab, &probe("", "client", L4Proto::Tcp, "10.96.0.10:80"))),
    );
    let next = setup.start(proxy, "main", 1);
    // The first answer of /healthz after the start, whatever it is.
    let mut first = None;
    lab.eventually(Duration::from_secs(30), || {
        first = lab.http_get("node1", "127.0.0.1:10256", "/healthz").ok();
        first.is_some()
    });
    let first = first.map(|(code, body)| {
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        format!("{code} healthy={}", v["healthy"])
    });
    observed.insert("restart: first /healthz answer".into(), format!("{first:?}"));
    wait_serving(lab, proxy, &next);
    let (udp, tcp) = held.ask();
    observed.insert("restart: held UDP flow, after the start".into(), same(&udp_before, &udp));
    observed.insert("restart: held TCP connection, after the start".into(), same(&tcp_before, &tcp));
    for path in ["/healthz", "/livez"] {
        observed.insert(format!("restart: {path} once serving"), http_shape(lab, "node1", "127.0.0.1:10256", path));
    }
    next
}

/// Phase 5: restarts with loopback in `nodePortAddresses`.
fn nodeport_addresses_phase(setup: &Setup<'_>, proxy: Proxy, observed: &mut Observed) {
    let lab = setup.lab;
    let node1 = lab.lab.node("node1");
    for (run, (name, _)) in NODEPORT_ADDRESSES.iter().enumerate() {
        // A clean start: nothing of the previous configuration's rules to mistake for this one's.
        setup.cleanup(proxy);
        let mut running = setup.start(proxy, name, 10 + run);
        wait_serving(lab, proxy, &running);
        let probes = [
            Probe { asks: 3, ..probe("NodePort on 127.0.0.1 from the node", "node1", L4Proto::Tcp, "127.0.0.1:30090") },
            Probe { asks: 3, ..probe("NodePort on ::1 from the node", "node1", L4Proto::Tcp, "[::1]:30090") },
            Probe { asks: 3, ..probe("NodePort from a client", "client", L4Proto::Tcp, format!("{}:30090", node1.ip)) },
            Probe {
                asks: 3,
                ..probe("NodePort over IPv6 from a client", "client", L4Proto::Tcp, format!("[{}]:30090", node1.ip6))
            },
            Probe {
                asks: 3,
                ..probe(
                    "NodePort on the pods' gateway from a pod",
                    "web-1",
                    L4Proto::Tcp,
                    format!("{}:30090", node1.gateway),
                )
            },
        ];
        for p in &probes {
            observed.insert(format!("nodePortAddresses {name}: {}", p.name), reached(outcome(lab, p)));
        }
        for (what, who, addr) in [
            ("on 127.0.0.1 from the node", "node1", "127.0.0.1:32100".to_string()),
            ("on ::1 from the node", "node1", "[::1]:32100".to_string()),
            ("from a client", "client", format!("{}:32100", node1.ip)),
        ] {
            observed.insert(
                format!("nodePortAddresses {name}: health check node port {what}"),
                http_shape(lab, who, &addr, "/"),
            );
        }
        // iptables mode sets it to serve NodePorts on 127.0.0.1; nftables mode never does.
        let sysctl = lab
            .lab
            .node("node1")
            .ns
            .command("cat")
            .arg("/proc/sys/net/ipv4/conf/all/route_localnet")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        observed.insert(format!("nodePortAddresses {name}: route_localnet"), sysctl);
        running.stop();
    }
}

#[test]
fn nftproxy_and_kube_proxy_give_the_same_answers() {
    if skip_unless_privileged() {
        return;
    }
    let _one = crate::control_plane::ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let test_started = Instant::now();
    let mut lab = ClusterLab::new();
    let service_cidrs = format!(
        "{},{}",
        nftproxy_tools::lab::topology::SERVICE_CIDR_V4,
        nftproxy_tools::lab::topology::SERVICE_CIDR_V6
    );
    let cp = ControlPlane::start_in(&mut lab.lab, &service_cidrs).expect("control plane");
    let lab = &lab;
    let add_node = |name: &str, zone: &str| {
        let n = lab.lab.node(name);
        cp.add_node_with(name, &[IpAddr::V4(n.ip), IpAddr::V6(n.ip6)], zone).expect("node");
    };
    add_node("node1", "zone-a");
    add_node("node2", "zone-b");
    for pod in ["web-1", "web-2", "web-3"] {
        let p = lab.lab.pod(pod).expect("pod");
        cp.add_pod(pod, &p.node, p.ip, &format!("app: web, pod: {pod}"), true).expect("pod");
        cp.set_pod_status(pod, &[IpAddr::V4(p.ip), IpAddr::V6(p.ip6)], true).expect("pod status");
    }
    cp.apply(SERVICES).unwrap_or_else(|e| panic!("{e}"));
    for (service, ip) in [("lb", "203.0.113.10"), ("ranged", "203.0.113.51")] {
        cp.patch_status(
            "service",
            Some("default"),
            service,
            &serde_json::json!({"loadBalancer": {"ingress": [{"ip": ip}]}}),
        )
        .expect("load balancer status");
    }
    for manifest in [
        slice(lab, "term", "TCP", 8080, &[("web-1", Cond::Terminating), ("web-3", Cond::Terminating)]),
        slice(lab, "term-mixed", "TCP", 8080, &[("web-2", Cond::Ready), ("web-3", Cond::Terminating)]),
        slice(lab, "hold", "TCP", 9090, &[("web-3", Cond::Ready)]),
    ] {
        cp.apply(&manifest).expect("slice");
    }
    let _line_server = LineServer::start(lab, "web-3", 9090);
    cp.apply(crate::control_plane::KUBE_PROXY_SA).expect("identity");
    let token = cp.token("kube-system", "kube-proxy").expect("token");
    let kubeconfig = lab.write("kube-proxy.kubeconfig", &cp.kubeconfig(&token));
    let mut configs = BTreeMap::new();
    for proxy in [Proxy::Nftproxy, Proxy::UpstreamNftables, Proxy::UpstreamIptables] {
        let mode = if proxy == Proxy::UpstreamIptables { "iptables" } else { "nftables" };
        configs.insert((proxy, "main"), lab.write(&format!("{proxy:?}.conf"), &config(&kubeconfig, mode, "")));
        for (name, extra) in NODEPORT_ADDRESSES {
            let file = format!("{proxy:?}-{}.conf", name.replace(' ', "-"));
            configs.insert((proxy, name), lab.write(&file, &config(&kubeconfig, mode, extra)));
        }
    }
    let setup = Setup { lab, cp: &cp, configs };

    let node1 = lab.lab.node("node1");
    let (n1, n1v6) = (node1.ip, node1.ip6);
    let probes = vec![
        probe("ClusterIP TCP from a client", "client", L4Proto::Tcp, "10.96.0.10:80"),
        probe("ClusterIP UDP from a client", "client", L4Proto::Udp, "10.96.0.10:53"),
        probe("ClusterIP TCP from a pod", "web-1", L4Proto::Tcp, "10.96.0.10:80"),
        probe("ClusterIP TCP from the node", "node1", L4Proto::Tcp, "10.96.0.10:80"),
        probe("ClusterIP, a port it does not serve", "client", L4Proto::Tcp, "10.96.0.10:81"),
        probe("IPv6 ClusterIP TCP from a client", "client", L4Proto::Tcp, "[fd00:96::10]:80"),
        probe("IPv6 ClusterIP UDP from a client", "client", L4Proto::Udp, "[fd00:96::10]:53"),
        probe("IPv6 ClusterIP TCP from a pod", "web-1", L4Proto::Tcp, "[fd00:96::10]:80"),
        probe("IPv6 ClusterIP TCP from the node", "node1", L4Proto::Tcp, "[fd00:96::10]:80"),
        probe("IPv6 ClusterIP, a port it does not serve", "client", L4Proto::Tcp, "[fd00:96::10]:81"),
        short("an unallocated IPv6 ClusterIP", "web-1", L4Proto::Tcp, "[fd00:96::99]:80"),
        probe("NodePort, cluster policy", "client", L4Proto::Tcp, format!("{n1}:30090")),
        probe("NodePort over IPv6", "client", L4Proto::Tcp, format!("[{n1v6}]:30090")),
        probe("NodePort from the node", "node1", L4Proto::Tcp, format!("{n1}:30090")),
        short("NodePort on 127.0.0.1 from the node", "node1", L4Proto::Tcp, "127.0.0.1:30090"),
        probe("NodePort on the pods' gateway from a pod", "web-1", L4Proto::Tcp, format!("{}:30090", node1.gateway)),
        probe("NodePort, local policy", "client", L4Proto::Tcp, format!("{n1}:30080")),
        short("NodePort, local policy, no local endpoint", "client", L4Proto::Tcp, format!("{n1}:30052")),
        probe("NodePort, local policy, no local endpoint, from the node", "node1", L4Proto::Tcp, format!("{n1}:30052")),
        probe("LoadBalancer IP, local policy", "client", L4Proto::Tcp, "203.0.113.10:80"),
        probe("LoadBalancer IP from the node", "node1", L4Proto::Tcp, "203.0.113.10:80"),
        probe("LoadBalancer IP from a pod", "web-1", L4Proto::Tcp, "203.0.113.10:80"),
        probe("ExternalIP, local policy", "client", L4Proto::Tcp, "203.0.113.7:80"),
        probe("ExternalIP from the node", "node1", L4Proto::Tcp, "203.0.113.7:80"),
        probe("source ranges, allowed client", "client", L4Proto::Tcp, "203.0.113.51:80"),
        short("source ranges, other client", "client2", L4Proto::Tcp, "203.0.113.51:80"),
        probe("source ranges, NodePort from the other client", "client2", L4Proto::Tcp, format!("{n1}:30051")),
        probe("internalTrafficPolicy Local from a client", "client", L4Proto::Tcp, "10.96.0.50:80"),
        probe("internalTrafficPolicy Local from a pod", "web-3", L4Proto::Tcp, "10.96.0.50:80"),
        probe("a pod to its own Service (hairpin)", "web-1", L4Proto::Tcp, "10.96.0.53:80"),
        probe("only terminating endpoints", "client", L4Proto::Tcp, "10.96.0.54:80"),
        probe("ready and terminating endpoints", "client", L4Proto::Tcp, "10.96.0.55:80"),
        probe("a Service without endpoints", "client", L4Proto::Tcp, "10.96.0.40:80"),
        short("an unallocated ClusterIP", "web-1", L4Proto::Tcp, "10.96.0.99:80"),
        Probe { sticky: true, ..probe("session affinity", "client", L4Proto::Tcp, "10.96.0.30:80") },
    ];

    let mut seen: BTreeMap<Proxy, Observed> = BTreeMap::new();
    for proxy in [Proxy::Nftproxy, Proxy::UpstreamNftables, Proxy::UpstreamIptables] {
        let proxy_started = Instant::now();
        setup.reset();
        let mut observed = Observed::new();
        let mut running = setup.start(proxy, "main", 0);
        let took = wait_serving(lab, proxy, &running);
        eprintln!("{proxy:?}: serving {:.1} s after its start", took.as_secs_f64());
        // 1. Probes, health, metrics.
        observe(lab, &probes, &mut observed);
        // 2. Conntrack.
        conntrack_phase(&setup, &mut observed);
        // 3. The API server down: the health endpoints as each proxy answers then.
        cp.kill_apiserver();
        std::thread::sleep(Duration::from_secs(2));
        for path in ["/healthz", "/livez"] {
            observed.insert(format!("API server down: {path}"), http_shape(lab, "node1", "127.0.0.1:10256", path));
        }
        cp.start_apiserver().unwrap_or_else(|e| panic!("{e}"));
        // 4. A restart.
        let mut restarted = restart_phase(&setup, proxy, &mut running, &mut observed);
        restarted.stop();
        // 5. Loopback in nodePortAddresses.
        nodeport_addresses_phase(&setup, proxy, &mut observed);
        // 6. The Node deleted: what the proxy does (upstream exits 1 so that it is restarted).
        // The watches may still be reconnecting after the API server's restart (with backoff),
        // so the exit may take a while on a loaded machine: the outcome is compared, not its
        // timing.
        let mut last = setup.start(proxy, "main", 20);
        wait_serving(lab, proxy, &last);
        cp.kubectl_ok(&["delete", "node", "node1", "--wait=false"]).expect("delete node1");
        observed.insert("Node deleted: exit status".into(), format!("{:?}", last.exit_within(Duration::from_secs(60))));
        add_node("node1", "zone-a");
        // Without its Node, the EndpointSlice controller left node1's pods out of the slices:
        // the next proxy starts once they are back.
        let web_endpoints = || {
            cp.kubectl_ok(&[
                "get",
                "endpointslices",
                "-l",
                "kubernetes.io/service-name=web",
                "-o",
                "jsonpath={.items[*].endpoints[*].addresses[0]}",
            ])
            .map(|out| out.split_whitespace().count())
            .unwrap_or(0)
        };
        assert!(
            lab.eventually(Duration::from_secs(60), || web_endpoints() == 6),
            "node1's pods are back in the slices"
        );
        let syncs: Vec<String> =
            last.text().lines().filter(|l| l.contains("synced") || l.contains("Sync")).map(str::to_string).collect();
        eprintln!("{proxy:?} syncs (last run):\n{}", syncs.join("\n"));
        last.stop();
        seen.insert(proxy, observed);
        // Clean switch: the proxy's own cleanup, then conntrack flushed.
        setup.cleanup(proxy);
        // Nothing of the proxy's is left, but upstream's copy of kubelet's KUBE-FIREWALL chain,
        // which iptables mode creates and by design never deletes (kubelet owns it).
        let left = lab.listing();
        let chains: BTreeSet<&str> = left
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .filter(|w| w.starts_with("KUBE-") && *w != "KUBE-FIREWALL")
            .collect();
        assert!(
            chains.is_empty() && !left.contains("table ip kube-proxy") && !left.contains("table ip nftproxy"),
            "{proxy:?} cleanup left rules {chains:?}:\n{left}"
        );
        eprintln!("{proxy:?}: scenario took {:.1} s", proxy_started.elapsed().as_secs_f64());
    }

    // Report: every check, with the three proxies' values side by side where they differ.
    let ours = &seen[&Proxy::Nftproxy];
    let theirs = &seen[&Proxy::UpstreamNftables];
    let iptables = &seen[&Proxy::UpstreamIptables];
    let keys: BTreeSet<&String> = ours.keys().chain(theirs.keys()).chain(iptables.keys()).collect();
    let mut differences: Vec<String> = Vec::new();
    let mut report = String::new();
    for key in keys {
        let (a, b, c) = (ours.get(key), theirs.get(key), iptables.get(key));
        if a == b && b == c {
            report.push_str(&format!("{key}: {}\n", b.map(String::as_str).unwrap_or("-")));
        } else {
            report.push_str(&format!(
                "{key}:\n    nftproxy:             {a:?}\n    kube-proxy nftables:  {b:?}\n    kube-proxy iptables:  {c:?}\n"
            ));
        }
        if a != b {
            differences.push(format!("{key}:\n    nftproxy:   {a:?}\n    kube-proxy: {b:?}"));
        }
    }
    eprintln!("Observed (one value where all three proxies agree):\n{report}");
    eprintln!("The whole test took {:.1} s", test_started.elapsed().as_secs_f64());
    let unlisted: Vec<&String> =
        differences.iter().filter(|d| !DELIBERATE.iter().any(|k| d.starts_with(&format!("{k}:")))).collect();
    assert!(
        unlisted.is_empty(),
        "{} difference(s) from upstream that docs/differences.md does not list:\n{}",
        unlisted.len(),
        unlisted.iter().map(|d| d.as_str()).collect::<Vec<_>>().join("\n")
    );
    for listed in DELIBERATE.iter().filter(|l| !l.starts_with("random ")) {
        assert!(
            differences.iter().any(|d| d.starts_with(&format!("{listed}:"))),
            "{listed}: listed as a deliberate difference but nftproxy and kube-proxy agree: remove it"
        );
    }
}
