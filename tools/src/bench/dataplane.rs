//! The data-plane half of the scale benchmark: new TCP connections per second and connect
//! latency through one ClusterIP while S other services exist, for four rulesets measured in
//! interleaved trials on one lab.
//!
//! ```text
//!  client 192.168.50.100 ── wan ── node1 192.168.50.2 ── cbr0 ── server pod 10.244.1.10:8080
//!          connects to            rules under test,
//!          10.111.0.1:80          conntrack
//! ```
//!
//! The client sits on the wan, a different L3 subnet from the pod, and the wan router sends the
//! target ClusterIP to node1; the pod's replies go back through node1 (its default route), so
//! the node that DNATed a connection also un-NATs its replies. [`CLUSTER_CIDR`] holds the
//! client's subnet, so the client counts as a pod on another node: kube-proxy and nftproxy DNAT
//! its connections without masquerading, exactly as the hand-written single DNAT rule does.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4, TcpListener};
use std::os::fd::AsRawFd as _;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, connect, setsockopt, socket, sockopt};
use nix::sys::time::TimeVal;
use thiserror::Error;

use crate::cluster::{self, Size};
use crate::lab::{Lab, LabError, Netns};
use nftproxy::config::{ConfigError, ProxyConfig, parse_cidrs};
use nftproxy::model::*;
use nftproxy::net::{IpFamily, L4Proto};

/// The target service's ClusterIP: inside the service range 10.96.0.0/12 but far above the
/// synthetic services' addresses (they would reach it only at 983,040 services).
pub const TARGET_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 111, 0, 1);
/// The target service's port.
pub const TARGET_PORT: u16 = 80;
/// The port the server pod listens on (the target's endpoint port).
pub const POD_PORT: u16 = 8080;
/// The node whose rules are measured (the synthetic cluster's own node).
pub const NODE: &str = "node1";
/// `--cluster-cidr` for every ruleset: the wan subnet holding the client, so the client's
/// ClusterIP traffic is pod traffic and is not masqueraded (DNAT only, in every ruleset).
pub const CLUSTER_CIDR: &str = "192.168.50.0/24";
/// The service range of the control plane that holds the cluster for upstream's kube-proxy
/// (the synthetic ClusterIPs and the target's).
pub const SERVICE_CIDR: &str = "10.96.0.0/12";
/// Endpoints of each synthetic service (they only add rules the target's path never visits).
pub const ENDPOINTS: usize = 10;

/// How long one connect may take before it counts as a failure (a lost SYN would otherwise
/// block for the kernel's whole retry schedule).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Connections made before each trial's clock starts (neighbour entries, caches).
const WARMUP_CONNECTIONS: usize = 50;

/// The rules the node holds during a trial.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Ruleset {
    /// No rules: the client connects straight to the pod (the floor, without NAT or conntrack).
    None,
    /// One hand-written nft DNAT rule for the target only.
    SingleDnat,
    /// kube-proxy's iptables mode for the whole cluster, loaded with `iptables-nft-restore`.
    Iptables,
    /// Upstream's kube-proxy v1.37.2 in nftables mode for the whole cluster: the table the real
    /// process programmed (listed after its first sync), loaded with `nft -f`.
    KubeProxyNftables,
    /// nftproxy's ruleset for the whole cluster, synced over netlink.
    Nftproxy,
}

impl Ruleset {
    /// Every ruleset, in the order trials interleave them.
    pub const ALL: [Ruleset; 5] =
        [Ruleset::None, Ruleset::SingleDnat, Ruleset::Iptables, Ruleset::KubeProxyNftables, Ruleset::Nftproxy];
}

impl fmt::Display for Ruleset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Ruleset::None => "none",
            Ruleset::SingleDnat => "single-dnat",
            Ruleset::Iptables => "iptables",
            Ruleset::KubeProxyNftables => "kube-proxy-nftables",
            Ruleset::Nftproxy => "nftproxy",
        })
    }
}

/// What one ruleset achieved, over all rounds.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnStats {
    pub ruleset: Ruleset,
    /// Services in the cluster besides the target.
    pub services: usize,
    /// Connections established during the measured time.
    pub connections: u64,
    /// Connects that failed (refused, timed out, …): 0 on a correct NAT path.
    pub failures: u64,
    /// `connections` over the measured time.
    pub per_second: f64,
    /// Median time of one `connect()` (SYN out to SYN-ACK back).
    pub p50: Duration,
    /// 99th percentile of the same.
    pub p99: Duration,
    /// The median over rounds of this ruleset's rate relative to the single DNAT rule's in the
    /// same round, in percent (−2.0: 2% fewer connections per second); robust against a round
    /// that a noisy neighbour slowed down. `None` without single-DNAT trials.
    pub rate_vs_floor: Option<f64>,
    /// The same for the p99 connect latency (+5.0: 5% slower).
    pub p99_vs_floor: Option<f64>,
}

/// The order of the rulesets in round `round`: a balanced Latin square (Williams design), so
/// over every `n` rounds (`2n` for odd `n`) each ruleset runs in each position once and follows
/// each other ruleset once. The kernel frees a removed ruleset in the background (tens of
/// thousands of iptables rules at 10,000 services), which slows whatever runs next: with a
/// plain rotation one ruleset would always follow the same, heaviest one.
pub fn round_order(n: usize, round: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    let first = round % n;
    // 0, 1, n−1, 2, n−2, … shifted by the row.
    let mut row: Vec<usize> = (0..n)
        .map(|k| {
            let step = if k % 2 == 1 { k.div_ceil(2) } else { n - k / 2 };
            (first + step % n) % n
        })
        .collect();
    // Odd n needs the mirrored square as well to balance predecessors.
    if n % 2 == 1 && (round / n) % 2 == 1 {
        row.reverse();
    }
    row
}

/// The median of some values (`None` for none).
fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// Why a data-plane comparison stopped.
#[derive(Debug, Error)]
pub enum DataPlaneError {
    #[error("lab: {0}")]
    Lab(#[from] LabError),
    #[error("the lab has not got {0}")]
    Topology(&'static str),
    #[error("invalid cluster CIDR: {0}")]
    Config(#[from] ConfigError),
    #[error("cannot run {program} in namespace {namespace}: {source}")]
    Spawn {
        program: String,
        namespace: String,
        #[source]
        source: std::io::Error,
    },
    #[error("applying the {ruleset} ruleset on {namespace} failed: {detail}")]
    Apply { ruleset: Ruleset, namespace: String, detail: String },
    #[error("clearing rules and conntrack on {namespace} failed: {detail}")]
    Clear { namespace: String, detail: String },
    #[error("the server in {namespace} failed: {detail}")]
    Server { namespace: String, detail: String },
    #[error("the {ruleset} trial's client failed: {detail}")]
    Client { ruleset: Ruleset, detail: String },
}

/// The synthetic cluster of `size` plus the target service `bench/target` (ClusterIP
/// [`TARGET_CLUSTER_IP`]:[`TARGET_PORT`]/TCP) whose single endpoint is `pod`:[`POD_PORT`] on
/// [`NODE`]. Returns the state, the target's name and its ClusterIP address.
pub fn cluster_with_target(size: Size, pod: Ipv4Addr) -> (ClusterState, NamespacedName, SocketAddrV4) {
    let mut state = cluster::state(size);
    let name = NamespacedName::new("bench", "target");
    let port_name = ServicePortName { service: name.clone(), port: "http".into(), protocol: L4Proto::Tcp };
    state.upsert_service(ServiceInfo {
        name: name.clone(),
        ports: vec![ServicePort::new(port_name, vec![IpAddr::V4(TARGET_CLUSTER_IP)], TARGET_PORT)],
    });
    state.upsert_slice(EndpointSliceInfo {
        name: NamespacedName::new("bench", "target-abcde"),
        service: name.clone(),
        family: IpFamily::V4,
        ports: vec![("http".into(), L4Proto::Tcp, POD_PORT)],
        endpoints: vec![SliceEndpoint { node_name: Some(NODE.into()), ..SliceEndpoint::ready(IpAddr::V4(pod)) }],
        trigger_time: None,
    });
    (state, name, SocketAddrV4::new(TARGET_CLUSTER_IP, TARGET_PORT))
}

/// The `nft -f` input of [`Ruleset::SingleDnat`].
fn single_dnat(cluster_ip: SocketAddrV4, pod: SocketAddrV4) -> String {
    format!(
        "table ip bench {{\n  chain pre {{\n    type nat hook prerouting priority dstnat;\n    \
         ip daddr {} tcp dport {} dnat to {}:{}\n  }}\n}}\n",
        cluster_ip.ip(),
        cluster_ip.port(),
        pod.ip(),
        pod.port()
    )
}

/// How a comparison runs its trials.
#[derive(Debug, Clone)]
pub struct Trials<'a> {
    /// The rulesets compared (duplicates count once), interleaved in this order.
    pub rulesets: &'a [Ruleset],
    /// Rounds: one trial per ruleset each.
    pub rounds: usize,
    /// Length of one trial.
    pub trial: Duration,
    /// Pause between loading a ruleset and starting its trial, so the kernel's deferred work
    /// from the previous flush and the load does not fall into the trial.
    pub settle: Duration,
}

/// Where the rulesets that are not nftproxy's own come from.
pub struct Sources<'a> {
    /// The iptables-restore input of kube-proxy's iptables mode for a cluster, the target last.
    pub iptables: &'a dyn Fn(&ClusterState, &NamespacedName) -> String,
    /// The `nft -f` input of the table upstream's kube-proxy programs for a cluster, with the
    /// lab (whose node it runs on) to run it in.
    pub kube_proxy_nftables: &'a dyn Fn(&mut Lab, &ClusterState) -> Result<String, String>,
}

/// One data-plane comparison at `services` other services. Creates and removes its own
/// namespaces.
///
/// Each round runs one trial per ruleset (in the order of [`round_order`]), each starting once
/// the CPUs are idle (`wait_until_idle`); between
/// trials the node's ruleset and conntrack table are flushed. Each trial is also reported on
/// stderr, so the spread of rounds can be read. The result has one entry per ruleset, in
/// [`Ruleset::ALL`] order. Callers with kube-proxy's generator pass e.g.
/// `&|s, t| upstream::iptables_restore(s, NODE, CLUSTER_CIDR, t)` as `iptables`.
pub fn compare(services: usize, sources: &Sources<'_>, trials: &Trials<'_>) -> Result<Vec<ConnStats>, DataPlaneError> {
    let rulesets: Vec<Ruleset> = Ruleset::ALL.into_iter().filter(|r| trials.rulesets.contains(r)).collect();
    let order: Vec<Ruleset> = {
        let mut seen = Vec::new();
        for r in trials.rulesets {
            if !seen.contains(r) {
                seen.push(*r);
            }
        }
        seen
    };
    let mut lab = Lab::new()?;
    let node_ip = lab.add_node(NODE)?.ip;
    let pod_ip = lab.add_pod("server", NODE)?.ip;
    lab.add_client("client")?;
    // The lab's wan routes only 10.96.0.0/16 to node1; the target lives higher in the range.
    lab.wan.ip(&["route", "add", &format!("{TARGET_CLUSTER_IP}/32"), "via", &node_ip.to_string()])?;

    let (state, target, cluster_ip) = cluster_with_target(Size { services, endpoints: ENDPOINTS }, pod_ip);
    let pod_addr = SocketAddrV4::new(pod_ip, POD_PORT);
    let iptables = if order.contains(&Ruleset::Iptables) { (sources.iptables)(&state, &target) } else { String::new() };
    let kube_proxy = if order.contains(&Ruleset::KubeProxyNftables) {
        (sources.kube_proxy_nftables)(&mut lab, &state).map_err(|detail| DataPlaneError::Apply {
            ruleset: Ruleset::KubeProxyNftables,
            namespace: NODE.into(),
            detail,
        })?
    } else {
        String::new()
    };
    let mut config = ProxyConfig::new(NODE);
    config.cluster_cidrs = parse_cidrs("--cluster-cidr", CLUSTER_CIDR)?;

    let (node, pod, client) = match (lab.nodes.first(), lab.pods.first(), lab.clients.first()) {
        (Some(n), Some(p), Some(c)) => (&n.ns, &p.ns, &c.ns),
        _ => return Err(DataPlaneError::Topology("a node, a pod and a client")),
    };
    // Declared after the lab, so it stops (and leaves the pod) before the namespaces go.
    let _server = Server::start(pod, POD_PORT)?;

    let mut totals: BTreeMap<Ruleset, Totals> = BTreeMap::new();
    let mut rounds: Vec<BTreeMap<Ruleset, ConnStats>> = Vec::new();
    for round in 0..trials.rounds {
        let mut this_round = BTreeMap::new();
        for k in round_order(order.len(), round) {
            let ruleset = order[k];
            clear(node)?;
            let target_addr = match ruleset {
                Ruleset::None => pod_addr,
                Ruleset::SingleDnat => {
                    feed(node, "nft", &["-f", "-"], &single_dnat(cluster_ip, pod_addr))
                        .map_err(|detail| apply_error(ruleset, node, detail))?;
                    cluster_ip
                }
                Ruleset::Iptables => {
                    feed(node, "iptables-nft-restore", &[], &iptables)
                        .map_err(|detail| apply_error(ruleset, node, detail))?;
                    cluster_ip
                }
                Ruleset::KubeProxyNftables => {
                    feed(node, "nft", &["-f", "-"], &kube_proxy)
                        .map_err(|detail| apply_error(ruleset, node, detail))?;
                    cluster_ip
                }
                Ruleset::Nftproxy => {
                    sync_nftproxy(node, &config, &state).map_err(|detail| apply_error(ruleset, node, detail))?;
                    cluster_ip
                }
            };
            if !trials.settle.is_zero() {
                std::thread::sleep(trials.settle);
            }
            let waited = wait_until_idle(IDLE_WAIT_MAX);
            let trial = trials.trial;
            let result = client.run(move || connect_loop(target_addr, trial))?;
            let result = result.map_err(|e| DataPlaneError::Client { ruleset, detail: e.to_string() })?;
            let s = Totals::of(&result).stats(ruleset, services);
            eprintln!(
                "bench: data plane {services} services, round {round}, {ruleset:<11}: {:>6.0} conn/s, p50 {:.1} µs, p99 {:.1} µs, {} failures (waited {} ms for idle CPUs)",
                s.per_second,
                s.p50.as_secs_f64() * 1e6,
                s.p99.as_secs_f64() * 1e6,
                s.failures,
                waited.as_millis()
            );
            this_round.insert(ruleset, s);
            totals.entry(ruleset).or_default().add(result);
        }
        rounds.push(this_round);
    }
    clear(node)?;

    let relative = |ruleset: Ruleset, value: fn(&ConnStats) -> f64| {
        let ratios = rounds.iter().filter_map(|round| {
            let (this, floor) = (round.get(&ruleset)?, round.get(&Ruleset::SingleDnat)?);
            (value(floor) > 0.0).then(|| 100.0 * (value(this) / value(floor) - 1.0))
        });
        median(ratios.collect())
    };
    Ok(rulesets
        .iter()
        .map(|r| ConnStats {
            rate_vs_floor: relative(*r, |s| s.per_second),
            p99_vs_floor: relative(*r, |s| s.p99.as_secs_f64()),
            ..totals.remove(r).unwrap_or_default().stats(*r, services)
        })
        .collect())
}

fn apply_error(ruleset: Ruleset, node: &Netns, detail: String) -> DataPlaneError {
    DataPlaneError::Apply { ruleset, namespace: node.name().to_string(), detail }
}

/// Removes every table (nft's and iptables-nft's alike) and every conntrack entry of the node's
/// namespace, so no trial inherits rules or a full conntrack table from the previous one.
fn clear(node: &Netns) -> Result<(), DataPlaneError> {
    let err = |e: LabError| DataPlaneError::Clear { namespace: node.name().to_string(), detail: e.to_string() };
    node.exec("nft", &["flush", "ruleset"]).map_err(err)?;
    node.exec("conntrack", &["-F"]).map_err(err)?;
    Ok(())
}

/// The longest wait for idle CPUs before a trial.
const IDLE_WAIT_MAX: Duration = Duration::from_secs(15);

/// Waits until the CPUs have been idle (under 5% busy, stolen time counted as busy) for a
/// quarter of a second, at most `max`, and returns how long it waited. The kernel frees a
/// removed ruleset and grows its hash tables after a large commit in the background: at 10,000
/// services that runs on into the next trial, whichever ruleset it measures.
fn wait_until_idle(max: Duration) -> Duration {
    let started = Instant::now();
    let mut last = cpu_times();
    while started.elapsed() < max {
        std::thread::sleep(Duration::from_millis(250));
        let now = cpu_times();
        if let (Some((busy0, total0)), Some((busy1, total1))) = (last, now) {
            let (busy, total) = (busy1.saturating_sub(busy0), total1.saturating_sub(total0));
            if total > 0 && busy * 100 < total * 5 {
                break;
            }
        }
        last = now;
    }
    started.elapsed()
}

/// All CPUs' busy and total time from `/proc/stat`, in clock ticks.
fn cpu_times() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    // user nice system idle iowait irq softirq steal (guest time is inside user already)
    let fields: Vec<u64> = line.split_whitespace().take(8).filter_map(|f| f.parse().ok()).collect();
    if fields.len() < 8 {
        return None;
    }
    let total: u64 = fields.iter().sum();
    let idle = fields[3] + fields[4];
    Some((total - idle, total))
}

/// Runs `program args` inside `ns` with `input` on its stdin.
fn feed(ns: &Netns, program: &str, args: &[&str], input: &str) -> Result<(), String> {
    let mut child = ns
        .command(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    // Written from another thread: a large input could fill the pipe while the program is
    // blocked writing its stderr.
    let writer = child.stdin.take().map(|mut stdin| {
        let input = input.to_string();
        std::thread::spawn(move || stdin.write_all(input.as_bytes()))
    });
    let out = child.wait_with_output().map_err(|e| format!("{program}: {e}"))?;
    if let Some(w) = writer {
        match w.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("writing to {program}: {e}")),
            Err(_) => return Err(format!("writing to {program}: the writer panicked")),
        }
    }
    if !out.status.success() {
        return Err(format!("{program} {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

/// Syncs nftproxy's ruleset for `state` from inside the node's namespace (planning reads the
/// namespace's addresses too).
fn sync_nftproxy(node: &Netns, config: &ProxyConfig, state: &ClusterState) -> Result<(), String> {
    node.run(|| nftproxy::oneshot::sync_once(config, state).map(|_| ()).map_err(|e| e.to_string()))
        .map_err(|e| e.to_string())?
}

/// One trial's raw result.
#[derive(Debug, Default)]
struct TrialResult {
    latencies_ns: Vec<u64>,
    failures: u64,
    elapsed: Duration,
}

/// Every trial of one ruleset.
#[derive(Debug, Default)]
struct Totals {
    latencies_ns: Vec<u64>,
    failures: u64,
    elapsed: Duration,
}

impl Totals {
    /// One trial's totals (a copy, for reporting the trial alone).
    fn of(t: &TrialResult) -> Totals {
        Totals { latencies_ns: t.latencies_ns.clone(), failures: t.failures, elapsed: t.elapsed }
    }

    fn add(&mut self, t: TrialResult) {
        self.latencies_ns.extend(t.latencies_ns);
        self.failures += t.failures;
        self.elapsed += t.elapsed;
    }

    fn stats(mut self, ruleset: Ruleset, services: usize) -> ConnStats {
        self.latencies_ns.sort_unstable();
        let n = self.latencies_ns.len();
        let pct = |p: usize| {
            if n == 0 { Duration::ZERO } else { Duration::from_nanos(self.latencies_ns[(n * p / 100).min(n - 1)]) }
        };
        let secs = self.elapsed.as_secs_f64();
        ConnStats {
            ruleset,
            services,
            connections: n as u64,
            failures: self.failures,
            per_second: if secs > 0.0 { n as f64 / secs } else { 0.0 },
            p50: pct(50),
            p99: pct(99),
            rate_vs_floor: None,
            p99_vs_floor: None,
        }
    }
}

/// Connects to `target` again and again for `duration` (after a short warm-up), closing each
/// connection at once. Runs on a thread inside the client's namespace.
fn connect_loop(target: SocketAddrV4, duration: Duration) -> std::io::Result<TrialResult> {
    pin_to_cpu(CLIENT_CPU);
    let addr = SockaddrIn::from(target);
    for _ in 0..WARMUP_CONNECTIONS {
        let _ = connect_once(&addr)?;
    }
    let mut result = TrialResult { latencies_ns: Vec::with_capacity(1 << 16), ..TrialResult::default() };
    let started = Instant::now();
    while started.elapsed() < duration {
        match connect_once(&addr)? {
            Ok(took) => result.latencies_ns.push(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX)),
            Err(errno) => {
                if result.failures == 0 {
                    tracing::warn!(%target, error = %errno, "connect failed");
                }
                result.failures += 1;
            }
        }
    }
    result.elapsed = started.elapsed();
    Ok(result)
}

/// The CPU the client's thread runs on. The connect path (the SYN through the node's rules to
/// the pod and the SYN-ACK back) runs in softirq on the sending CPU; pinning the client and the
/// server's accepting thread gives every trial the same placement, which the scheduler would
/// otherwise choose anew each time. (Some trials still run ~30% slower, for any ruleset: noise
/// from outside the VM, which the median of per-round ratios is there to absorb.)
const CLIENT_CPU: usize = 0;

/// The CPU the server's accepting thread runs on: the last one (the client's on a 1-CPU machine).
fn server_cpu() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_sub(1)
}

/// Pins the calling thread to one CPU (best effort: a benchmark on a machine that refuses still
/// runs, only noisier).
fn pin_to_cpu(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    let pinned = set.set(cpu).and_then(|()| nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set));
    if let Err(e) = pinned {
        tracing::debug!(cpu, error = %e, "cannot pin the benchmark thread");
    }
}

/// One blocking connect, timed. The outer error is a local socket problem (the trial cannot go
/// on); the inner one a failed connection. SO_LINGER 0 makes the close send a RST: neither side
/// keeps a TIME_WAIT socket, so the client's ephemeral ports never run out.
fn connect_once(addr: &SockaddrIn) -> std::io::Result<Result<Duration, nix::errno::Errno>> {
    let fd = socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::Linger, &libc::linger { l_onoff: 1, l_linger: 0 })?;
    let timeout = TimeVal::new(CONNECT_TIMEOUT.as_secs() as libc::time_t, 0);
    setsockopt(&fd, sockopt::SendTimeout, &timeout)?;
    let started = Instant::now();
    let connected = connect(fd.as_raw_fd(), addr);
    let took = started.elapsed();
    drop(fd);
    Ok(connected.map(|()| took))
}

/// A TCP server in the pod that accepts connections and drops them; stops on drop.
struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(), LabError>>>,
}

impl Server {
    fn start(ns: &Netns, port: u16) -> Result<Server, DataPlaneError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let flag = Arc::clone(&stop);
        let thread = ns.spawn(move || accept_loop(port, &flag, &ready_tx));
        let server = Server { stop, thread: Some(thread) };
        let err = |detail: String| DataPlaneError::Server { namespace: ns.name().to_string(), detail };
        match ready_rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(())) => Ok(server),
            Ok(Err(e)) => Err(err(e)),
            Err(_) => Err(err("did not start".into())),
        }
    }
}

/// A blocking listener on `port` with the namespace's largest backlog (a burst of SYNs while the
/// accepting thread waits for a CPU must not overflow it: the dropped SYN would cost the client
/// a 1 s retransmission) whose accept wakes every 100 ms (SO_RCVTIMEO).
fn listen(port: u16) -> std::io::Result<TcpListener> {
    use nix::sys::socket::{Backlog, bind};
    let fd = socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    bind(fd.as_raw_fd(), &SockaddrIn::from(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)))?;
    nix::sys::socket::listen(&fd, Backlog::MAXCONN)?;
    setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(0, 100_000))?;
    Ok(TcpListener::from(fd))
}

/// Accepts and drops connections until `stop`, which it looks at whenever accept times out.
fn accept_loop(port: u16, stop: &AtomicBool, ready: &mpsc::Sender<Result<(), String>>) {
    pin_to_cpu(server_cpu());
    let listener = match listen(port) {
        Ok(l) => l,
        Err(e) => {
            let _ = ready.send(Err(format!("cannot listen on port {port}: {e}")));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    while !stop.load(Ordering::Relaxed) {
        // A connection reset while queued still comes out of accept; dropping it is all we do.
        let _ = listener.accept();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_orders_balance_positions_and_predecessors() {
        for n in 1..=5 {
            let rows = if n % 2 == 1 { 2 * n } else { n };
            let orders: Vec<Vec<usize>> = (0..rows).map(|r| round_order(n, r)).collect();
            let mut followed = std::collections::BTreeMap::new();
            for order in &orders {
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n={n}: each ruleset once a round: {order:?}");
                for pair in order.windows(2) {
                    *followed.entry((pair[0], pair[1])).or_insert(0) += 1;
                }
            }
            for position in 0..n {
                let at: std::collections::BTreeSet<usize> = orders.iter().map(|o| o[position]).collect();
                assert_eq!(at.len(), n, "n={n}: every ruleset at position {position}: {orders:?}");
            }
            if n > 1 {
                let per_pair = rows / n;
                assert_eq!(followed.len(), n * (n - 1), "n={n}: every ordered pair: {orders:?}");
                assert!(followed.values().all(|c| *c == per_pair), "n={n}: pairs equally often: {followed:?}");
            }
        }
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![3.0, -30.0, 1.0]), Some(1.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
    }

    /// kube-proxy-shaped iptables-restore input for the target service only.
    fn tiny_iptables(state: &ClusterState, target: &NamespacedName) -> String {
        let (cip, pod) = state
            .service(target)
            .and_then(|s| s.ports.first())
            .and_then(|p| {
                let cip = p.cluster_ip(IpFamily::V4)?;
                let ep = state.endpoints(&p.name, IpFamily::V4).first()?.ip;
                Some((cip, ep))
            })
            .expect("target service with an endpoint");
        format!(
            "*nat\n\
             :PREROUTING ACCEPT [0:0]\n\
             :KUBE-SERVICES - [0:0]\n\
             :KUBE-SVC-TARGET - [0:0]\n\
             :KUBE-SEP-TARGET - [0:0]\n\
             -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -A KUBE-SERVICES -d {cip}/32 -p tcp -m comment --comment \"bench/target:http cluster IP\" \
             -m tcp --dport {TARGET_PORT} -j KUBE-SVC-TARGET\n\
             -A KUBE-SVC-TARGET -j KUBE-SEP-TARGET\n\
             -A KUBE-SEP-TARGET -p tcp -m tcp -j DNAT --to-destination {pod}:{POD_PORT}\n\
             COMMIT\n"
        )
    }

    #[test]
    fn target_is_added_beside_the_synthetic_services() {
        let pod = Ipv4Addr::new(10, 244, 1, 10);
        let (state, target, cip) = cluster_with_target(Size { services: 3, endpoints: 2 }, pod);
        assert_eq!(state.services().count(), 4);
        assert_eq!(cip, SocketAddrV4::new(TARGET_CLUSTER_IP, 80));
        assert!(tiny_iptables(&state, &target).contains("--to-destination 10.244.1.10:8080"));
        assert!(
            single_dnat(cip, SocketAddrV4::new(pod, 8080))
                .contains("ip daddr 10.111.0.1 tcp dport 80 dnat to 10.244.1.10:8080")
        );
    }

    /// A kube-proxy-shaped nftables table for the target service only (the real process needs
    /// the control plane; `nftproxy bench --quick` runs that).
    fn tiny_kube_proxy(_: &mut Lab, state: &ClusterState) -> Result<String, String> {
        let target = NamespacedName::new("bench", "target");
        let port = state.service(&target).and_then(|s| s.ports.first()).ok_or("no target")?;
        let cip = port.cluster_ip(IpFamily::V4).ok_or("no ClusterIP")?;
        let ep = state.endpoints(&port.name, IpFamily::V4).first().ok_or("no endpoint")?.ip;
        Ok(format!(
            "table ip kube-proxy {{\n\
               map service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict; \
                 elements = {{ {cip} . tcp . {TARGET_PORT} : goto service-target }}; }}\n\
               chain service-target {{ meta l4proto tcp dnat to {ep}:{POD_PORT}; }}\n\
               chain services {{ ip daddr . meta l4proto . th dport vmap @service-ips; }}\n\
               chain nat-prerouting {{ type nat hook prerouting priority dstnat; jump services; }}\n\
             }}\n"
        ))
    }

    #[test]
    fn every_ruleset_carries_connections() {
        if crate::lab::skip_unless_privileged() {
            return;
        }
        let trials =
            Trials { rulesets: &Ruleset::ALL, rounds: 1, trial: Duration::from_millis(300), settle: Duration::ZERO };
        let sources = Sources { iptables: &tiny_iptables, kube_proxy_nftables: &tiny_kube_proxy };
        let stats = compare(10, &sources, &trials).expect("compare");
        assert_eq!(stats.iter().map(|s| s.ruleset).collect::<Vec<_>>(), Ruleset::ALL);
        for s in &stats {
            eprintln!(
                "{:<12} {:>6} connections {:>9.0}/s p50 {:?} p99 {:?} failures {}",
                s.ruleset, s.connections, s.per_second, s.p50, s.p99, s.failures
            );
            assert!(s.connections > 100, "{s:?}");
            assert_eq!(s.failures, 0, "{s:?}");
            assert_eq!(s.services, 10);
        }
    }
}
