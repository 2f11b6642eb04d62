//! Head to head with upstream: nftproxy and upstream's own kube-proxy v1.37.2 (built from its
//! module by `scripts/upstream-bins`) in nftables mode, and in iptables mode as a reference,
//! one after the other in the same lab node, through the same real API server
//! (tools/src/controlplane.rs), with the same objects, configuration file and identity. Each is
//! measured the same way:
//!
//! - **first sync**: from the process's start to `kubeproxy_sync_proxy_rules_last_timestamp_seconds`
//!   appearing on its `/metrics`, and the sync itself (`kubeproxy_sync_full_proxy_rules_duration_seconds`);
//! - **single changes** (one endpoint replaced, a Service added): from the API write to the
//!   kernel's commit of the transaction that carries it, seen from outside ([`KernelCommits`]),
//!   with the proxy's own `kubeproxy_sync_proxy_rules_duration_seconds` and
//!   `kubeproxy_network_programming_duration_seconds` for the same change;
//! - **churn**: endpoint updates at a steady rate for minutes; per event the same API write →
//!   kernel commit, the two histograms over the whole run, CPU time (with the `nft` and
//!   `iptables-restore` children upstream waits for) and RSS per minute, and a plot;
//! - **idle CPU** over a quiet window, **peak RSS** (`VmHWM`), and a **restart**: the process
//!   stopped and started again with its rules and the objects in place, to its first sync.
//!
//! Between proxies: each one's own cleanup, the node's ruleset and conntrack table flushed, and
//! the Services added deleted, so each starts with the same objects on an empty kernel.
//!
//! The Services are selector-less and their EndpointSlices written directly (as the scale
//! issue allows: no 100,000 Pod objects), so no controller competes with the writes; each write
//! of an EndpointSlice carries `endpoints.kubernetes.io/last-change-trigger-time`, as the
//! EndpointSlice controller's do, so both proxies observe their programming-latency metric.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};

use super::api::{self, ApiClient, NewObject, Write};
use super::error::BenchError;
use super::figures::{mib, ms, quantile};
use super::kernel::KernelCommits;
use super::load::{self, Window};
use super::proxies::{self, FULL_SYNC, Histogram, PROGRAMMING, Proxy, Running, SYNC};
use super::record::{self, Record, Report};
use crate::cluster::{Size, endpoint_ip};
use crate::controlplane::{ControlPlane, KUBE_PROXY_IDENTITY, UpstreamBins};
use crate::lab::Lab;
use nftproxy::model::ClusterState;

/// The namespace of the head-to-head's objects.
const NAMESPACE: &str = "bench";
/// How often CPU time and memory are sampled during churn.
const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// How long a single change may take to reach the kernel before it counts as missed.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(120);
/// The pause after a change reached the kernel, so the next is past both proxies'
/// `minSyncPeriod` (1 s by default).
const CHANGE_SPACING: Duration = Duration::from_millis(1500);
/// Writes of the churn in flight at most (a slow API server delays the later ones' sending,
/// which the rate then makes up).
const CHURN_IN_FLIGHT: usize = 64;

/// What the head-to-head runs.
#[derive(Debug, Clone)]
pub struct Plan {
    pub sizes: Vec<Size>,
    pub proxies: Vec<Proxy>,
    /// Single changes of each kind per proxy.
    pub changes: usize,
    /// The sizes with a churn run.
    pub churn_sizes: Vec<Size>,
    pub churn_rate: u32,
    pub churn_duration: Duration,
    /// The quiet window of the idle CPU figure.
    pub idle: Duration,
    /// The longest wait for a first sync.
    pub first_sync_timeout: Duration,
    /// How long syncs must have stopped before a proxy counts as settled (after its first sync,
    /// before the idle window).
    pub settle: Duration,
    /// Runs of each proxy at each size (the objects are created once; churn runs in the first):
    /// the tables give the medians of the quiet ones, with their spread.
    pub runs: usize,
}

/// Single changes of one kind.
#[derive(Debug, Clone, Default)]
pub struct Changes {
    /// API write → kernel commit, per change seen in the kernel.
    pub latencies: Vec<Duration>,
    /// Changes not seen in the kernel within `CHANGE_TIMEOUT`.
    pub missed: usize,
    /// The proxy's `sync_proxy_rules_duration_seconds`, mean over the syncs between the write
    /// and the commit, per change.
    pub sync: Vec<Duration>,
    /// The proxy's `network_programming_duration_seconds` observed for the change.
    pub programming: Vec<Duration>,
    /// API write → the API server's answer to it (the object stored), per change: the part of
    /// the latency no proxy can shorten.
    pub answered: Vec<Duration>,
}

/// One minute of a churn run.
#[derive(Debug, Clone, Default)]
pub struct ChurnMinute {
    pub events: usize,
    pub latency_p50: Duration,
    pub latency_p99: Duration,
    pub commits: usize,
    /// Share of one core.
    pub cpu: f64,
    pub rss: u64,
}

/// A churn run of one proxy.
#[derive(Debug, Clone, Default)]
pub struct Churn {
    pub events: usize,
    /// Writes the API server refused or did not answer.
    pub failed_writes: usize,
    /// API write → kernel commit, per event seen in the kernel.
    pub latencies: Vec<Duration>,
    /// Events never seen in the kernel although no later write replaced them.
    pub unprogrammed: usize,
    /// Events never seen because a later write to the same EndpointSlice replaced the address
    /// before a sync carried it (the proxies program the latest state).
    pub superseded: usize,
    pub programming: Histogram,
    pub sync: Histogram,
    /// Kernel transactions during the run.
    pub commits: usize,
    /// Share of one core over the run, children included.
    pub cpu: f64,
    pub rss_start: u64,
    pub rss_end: u64,
    pub rss_max: u64,
    pub minutes: Vec<ChurnMinute>,
    /// (minutes since the start, CPU % of one core over the interval before, RSS MiB).
    pub samples: Vec<(f64, f64, f64)>,
    /// (minutes since the start, p50 ms, p99 ms) of the events sent in each sampling interval
    /// ending then.
    pub latency_samples: Vec<(f64, f64, f64)>,
    /// Times the kernel dropped notifications for the listener (events may be missed).
    pub overruns: usize,
}

/// Everything measured of one proxy at one size.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    pub first_sync: Duration,
    pub sync: Duration,
    pub endpoint_change: Changes,
    pub service_added: Changes,
    pub churn: Option<Churn>,
    /// Share of one core.
    pub idle_cpu: f64,
    pub peak_rss: u64,
    pub restart_first_sync: Duration,
    pub restart_sync: Duration,
    pub restart_peak_rss: u64,
    /// Tables the proxies' own cleanups left behind (flushed anyway).
    pub leftovers: Vec<String>,
    /// Why its measurement stopped early (the figures before it are kept).
    pub error: Option<String>,
    /// Times the kernel dropped nftables notifications for the listener (a change may then be
    /// missed).
    pub overruns: usize,
}

/// The head-to-head at one size.
#[derive(Debug, Clone)]
pub struct SizeResult {
    pub size: Size,
    /// How long creating the objects through the API took.
    pub created_in: Duration,
    /// Per proxy, the medians of its quiet runs (of all of them when none was quiet).
    pub figures: BTreeMap<Proxy, Figures>,
    /// Per proxy, every run's figures and the machine's load around it, in order.
    pub runs: BTreeMap<Proxy, Vec<(Figures, Window)>>,
    /// The churn plot, when there was a churn run.
    pub plot: Option<PathBuf>,
}

/// A ClusterIP inside the lab's service range, clear of the API server's own Service.
fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000u32 + 1000 + i as u32)
}

/// The `n`-th churn address of proxy number `p`: 2^20 fresh addresses each in 100.64.0.0/10,
/// so an address first seen in the kernel was written by this event.
fn churn_address(p: usize, k: u64) -> Ipv4Addr {
    Ipv4Addr::from(0x6440_0000u32 + ((p as u32) << 20) + (k as u32 & 0x000f_ffff))
}

/// The churn's service of event `k` (a stride coprime with every size used: each service once
/// before any twice).
fn churn_service(services: usize, k: u64) -> usize {
    ((k as usize).wrapping_mul(7919) + 1) % services
}

/// Runs the head-to-head at every size; each size's tables are added to `report` as it ends.
pub fn run(plan: &Plan, record: &Record, report: &mut Report) -> Result<Vec<SizeResult>, BenchError> {
    let bins = UpstreamBins::locate().map_err(|e| BenchError::HeadToHead(e.to_string()))?;
    report.add(&intro(plan, &bins));
    let mut results = Vec::new();
    for &size in &plan.sizes {
        crate::lab::cleanup_stale();
        let result = one_size(plan, size, &bins, record)?;
        report.add(&tables(&result, plan));
        results.push(result);
    }
    report.add(&targets(&results));
    Ok(results)
}

fn intro(plan: &Plan, bins: &UpstreamBins) -> String {
    let iptables = record::tool_output("iptables", &["--version"]);
    let kube_proxy = record::tool_output(&bins.path("kube-proxy").to_string_lossy(), &["--version"]);
    format!(
        "\n## Head to head with upstream kube-proxy\n\n\
         Upstream's kube-proxy ({kube_proxy}, built by `scripts/upstream-bins`) in nftables mode, \
         and in iptables mode as a reference ({iptables}), against nftproxy: one after the other in node1 of the lab, \
         through the same real kube-apiserver v1.37.2, with the same selector-less Services and \
         EndpointSlices (written through the API), configuration file and identity. Between them: \
         each one's cleanup, the node's ruleset and conntrack flushed. \"API write → kernel \
         commit\" is from the moment the write is sent to the end of the kernel transaction that \
         carries it, read from the node's nftables notifications; the metrics are each proxy's \
         own. Single changes: {} of each kind per proxy. Churn: {} endpoint updates a second for {} \
         (each replaces one endpoint's address; its trigger-time annotation set as the \
         EndpointSlice controller sets it); CPU includes the child processes upstream runs (`nft`, \
         `iptables-restore`). Idle CPU over {}. \"÷ nftproxy\": upstream's figure divided by \
         nftproxy's (for the histograms, their means).\n",
        plan.changes,
        plan.churn_rate,
        humantime::format_duration(plan.churn_duration),
        humantime::format_duration(plan.idle),
    )
}

/// The objects of one size: a selector-less Service and one EndpointSlice per service.
fn objects(size: Size) -> Vec<NewObject> {
    let mut out = Vec::with_capacity(2 * size.services);
    for i in 0..size.services {
        let name = format!("svc{i}");
        let addresses: Vec<Ipv4Addr> = (0..size.endpoints).map(|j| endpoint_ip(i, j, 0)).collect();
        out.push(api::service(NAMESPACE, &name, cluster_ip(i)));
        out.push(api::slice(NAMESPACE, &name, &addresses));
    }
    out
}

fn one_size(plan: &Plan, size: Size, bins: &UpstreamBins, record: &Record) -> Result<SizeResult, BenchError> {
    let hth = |e: crate::controlplane::ControlPlaneError| BenchError::HeadToHead(e.to_string());
    let mut lab = Lab::new()?;
    lab.add_node("node1")?;
    eprintln!("head-to-head {size}: starting the control plane…");
    let mut cp = ControlPlane::start_in(&mut lab, crate::lab::topology::SERVICE_CIDR_V4).map_err(hth)?;
    cp.add_node("node1", lab.node("node1").ip, "zone-a").map_err(hth)?;
    cp.apply(&format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {NAMESPACE}}}\n")).map_err(hth)?;
    cp.apply(KUBE_PROXY_IDENTITY).map_err(hth)?;
    // Every EndpointSlice is written here: no controller is needed once the ServiceCIDR is
    // ready, and the garbage collector's graph of 100,000 objects would compete for the CPU.
    cp.stop_controller_manager();
    let client = ApiClient::new(&cp);
    let started = Instant::now();
    client.create_all(objects(size))?;
    let created_in = started.elapsed();
    eprintln!("  {} objects created through the API in {:.1} s", size.services * 2, created_in.as_secs_f64());
    let dir = tempfile::Builder::new().prefix("nftproxy-head-to-head-").tempdir()?;
    let token = cp.token("kube-system", "kube-proxy").map_err(hth)?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, cp.kubeconfig(&token))?;
    let mut runs: BTreeMap<Proxy, Vec<(Figures, Window)>> = BTreeMap::new();
    let churn = plan.churn_sizes.contains(&size);
    for (n, (p, &proxy)) in (0..plan.runs.max(1)).flat_map(|n| plan.proxies.iter().enumerate().map(move |x| (n, x))) {
        let config = dir.path().join(format!("{}.conf", proxy.slug()));
        std::fs::write(
            &config,
            proxies::config_file(proxy.mode(), &kubeconfig, crate::lab::topology::CLUSTER_CIDR_V4),
        )?;
        let run = Run { lab: &lab, client: &client, bins, plan, size, proxy, index: p, dir: dir.path() };
        let mut measured = Figures::default();
        // One proxy's failure (a first sync that never comes, at the largest size) leaves the
        // others to run; the tables say what stopped it.
        let part = format!("{proxy}, run {} of {}", n + 1, plan.runs.max(1));
        let (result, window) = load::watch(&part, || run.measure(churn && n == 0, &mut measured));
        if !window.quiet() {
            eprintln!(
                "  {part}: not quiet (other processes {:.2} / {:.2} cores, {:.1}% stolen)",
                window.others_before,
                window.others_during,
                window.steal_during * 100.0
            );
        }
        if let Err(e) = result {
            eprintln!("  {proxy}: {e}");
            measured.error = Some(e.to_string());
        }
        // Whatever happened, the next proxy starts on an empty kernel with the same objects.
        let added: Vec<String> = (0..plan.changes)
            .flat_map(|n| {
                let name = added_name(p, n);
                [
                    format!("{}/{name}", api::collection("Service", NAMESPACE)),
                    format!("{}/{name}-1", api::collection("EndpointSlice", NAMESPACE)),
                ]
            })
            .collect();
        client.delete_all(added)?;
        measured.leftovers = proxies::clean_switch(&lab.node("node1").ns, bins)?;
        runs.entry(proxy).or_default().push((measured, window));
    }
    let figures: BTreeMap<Proxy, Figures> = runs.iter().map(|(p, r)| (*p, medians(r))).collect();
    let plot = if churn && figures.values().any(|f| f.churn.is_some()) {
        let path = record.file(&format!("head-to-head-churn-{}x{}.svg", size.services, size.endpoints));
        let series: Vec<super::plot::ChurnSeries<'_>> = figures
            .iter()
            .filter_map(|(p, f)| {
                let c = f.churn.as_ref()?;
                Some(super::plot::ChurnSeries {
                    name: p.to_string(),
                    latency_samples: &c.latency_samples,
                    samples: &c.samples,
                })
            })
            .collect();
        super::plot::head_to_head_churn(
            &path,
            &format!(
                "{} services × {} endpoints, {} endpoint updates/s through kube-apiserver",
                size.services, size.endpoints, plan.churn_rate
            ),
            &series,
        )?;
        Some(path)
    } else {
        None
    };
    Ok(SizeResult { size, created_in, figures, runs, plot })
}

fn added_name(p: usize, n: usize) -> String {
    format!("added-{p}-{n}")
}

/// One proxy's turn at one size.
struct Run<'a> {
    lab: &'a Lab,
    client: &'a ApiClient,
    bins: &'a UpstreamBins,
    plan: &'a Plan,
    size: Size,
    proxy: Proxy,
    /// Its position among the proxies (its addresses are its own).
    index: usize,
    dir: &'a Path,
}

/// What a scrape says about syncs.
struct Scrape {
    last_sync: f64,
    sync: Histogram,
    programming: Histogram,
}

impl Run<'_> {
    fn node(&self) -> &crate::lab::Netns {
        &self.lab.node("node1").ns
    }

    fn start(&self, what: &str) -> Result<Running, BenchError> {
        let log = self.dir.join(format!("{}-{what}.log", self.proxy.slug()));
        let config = self.dir.join(format!("{}.conf", self.proxy.slug()));
        Running::start(self.node(), self.proxy, self.bins, &config, &log)
    }

    fn scrape(&self, running: &Running) -> Result<Scrape, BenchError> {
        let text = running.scrape().ok_or_else(|| running.failure("its /metrics did not answer"))?;
        Ok(Scrape {
            last_sync: proxies::gauge(&text, proxies::LAST_SYNC).unwrap_or(0.0),
            sync: Histogram::parse(&text, SYNC),
            programming: Histogram::parse(&text, PROGRAMMING),
        })
    }

    /// Waits for the first sync, then until syncs have stopped for the plan's `settle` (later
    /// lists, the minimum sync period); returns the start → first sync time and the first sync's length.
    fn first_sync(&self, running: &mut Running) -> Result<(Duration, Duration), BenchError> {
        let first = running.wait_first_sync(self.plan.first_sync_timeout)?;
        eprintln!("  {}: first sync done {:.2} s after its start", self.proxy, first.as_secs_f64());
        // Upstream writes the timestamp before it observes the duration.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut full = Histogram::default();
        while Instant::now() < deadline {
            full = running.scrape().map(|t| Histogram::parse(&t, FULL_SYNC)).unwrap_or_default();
            if full.count >= 1.0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // The first observation when it is the only one (else the mean of those made so far).
        let sync = full.mean().unwrap_or_default();
        let mut last = running.last_sync().unwrap_or(0.0);
        let mut quiet_since = Instant::now();
        let settle = Instant::now() + Duration::from_secs(120);
        while quiet_since.elapsed() < self.plan.settle && Instant::now() < settle {
            std::thread::sleep(Duration::from_millis(250));
            let now = running.last_sync().unwrap_or(0.0);
            if now != last {
                last = now;
                quiet_since = Instant::now();
            }
        }
        Ok((first, sync))
    }

    /// Measures the proxy into `figures`, which keeps what was measured when a step fails.
    fn measure(&self, churn: bool, figures: &mut Figures) -> Result<(), BenchError> {
        eprintln!("head-to-head {}: {}", self.size, self.proxy);
        let mut running = self.start("run")?;
        (figures.first_sync, figures.sync) = self.first_sync(&mut running)?;
        let commits = KernelCommits::start(self.node())?;
        for n in 0..self.plan.changes {
            self.endpoint_change(&mut running, &commits, n, &mut figures.endpoint_change)?;
        }
        for n in 0..self.plan.changes {
            self.service_added(&mut running, &commits, n, &mut figures.service_added)?;
        }
        if churn && self.plan.churn_duration > Duration::ZERO {
            figures.churn = Some(self.churn(&running, &commits)?);
        }
        std::thread::sleep(self.plan.settle);
        let cpu = running.cpu();
        let quiet = Instant::now();
        std::thread::sleep(self.plan.idle);
        figures.idle_cpu = running.cpu().saturating_sub(cpu).as_secs_f64() / quiet.elapsed().as_secs_f64();
        figures.peak_rss = running.peak_rss();
        let log = commits.stop();
        figures.overruns = log.overruns;
        if let Some(c) = figures.churn.as_mut() {
            c.overruns = log.overruns;
        }
        // The restart: the same process started again over its rules, the objects unchanged.
        running.stop();
        let mut running = self.start("restart")?;
        (figures.restart_first_sync, figures.restart_sync) = self.first_sync(&mut running)?;
        figures.restart_peak_rss = running.peak_rss();
        running.stop();
        Ok(())
    }

    /// One endpoint of a service replaced by a fresh address.
    fn endpoint_change(
        &self,
        running: &mut Running,
        commits: &KernelCommits,
        n: usize,
        out: &mut Changes,
    ) -> Result<(), BenchError> {
        let i = (self.size.services / 2 + n * 7919) % self.size.services;
        let address = Ipv4Addr::new(100, 127, self.index as u8, n as u8);
        let write = Write::ReplaceEndpoint { namespace: NAMESPACE.into(), slice: format!("svc{i}-1"), address };
        self.timed_change(running, commits, address, &write, out)
    }

    /// A Service added, its EndpointSlice (one endpoint) written first, so the commit that
    /// brings its ClusterIP also brings its endpoint.
    fn service_added(
        &self,
        running: &mut Running,
        commits: &KernelCommits,
        n: usize,
        out: &mut Changes,
    ) -> Result<(), BenchError> {
        let name = added_name(self.index, n);
        let ip = Ipv4Addr::new(10, 96, 240 + self.index as u8, n as u8 + 1);
        self.client.write(&Write::Create(api::slice(
            NAMESPACE,
            &name,
            &[Ipv4Addr::new(100, 126, self.index as u8, n as u8)],
        )))?;
        // The slice alone may cause a sync; the Service's is measured on its own.
        std::thread::sleep(CHANGE_SPACING);
        self.timed_change(running, commits, ip, &Write::Create(api::service(NAMESPACE, &name, ip)), out)
    }

    fn timed_change(
        &self,
        running: &mut Running,
        commits: &KernelCommits,
        address: Ipv4Addr,
        write: &Write,
        out: &mut Changes,
    ) -> Result<(), BenchError> {
        commits.watch(address);
        let before = self.scrape(running)?;
        let sent = self.client.write(write)?;
        out.answered.push(SystemTime::now().duration_since(sent).unwrap_or_default());
        let Some(seen) = commits.wait_for(address, CHANGE_TIMEOUT) else {
            eprintln!("  {}: {address} not seen in the kernel in {CHANGE_TIMEOUT:?}", self.proxy);
            out.missed += 1;
            return Ok(());
        };
        out.latencies.push(seen.duration_since(sent).unwrap_or_default());
        // The metrics of the sync that carried it (upstream observes them after the timestamp).
        running.wait_sync_after(before.last_sync, Duration::from_secs(30))?;
        std::thread::sleep(Duration::from_millis(300));
        let after = self.scrape(running)?;
        if let Some(d) = after.sync.since(&before.sync).mean() {
            out.sync.push(d);
        }
        if let Some(d) = after.programming.since(&before.programming).mean() {
            out.programming.push(d);
        }
        std::thread::sleep(CHANGE_SPACING);
        Ok(())
    }

    fn churn(&self, running: &Running, commits: &KernelCommits) -> Result<Churn, BenchError> {
        let plan = self.plan;
        eprintln!(
            "  {}: churn, {} updates/s for {}",
            self.proxy,
            plan.churn_rate,
            humantime::format_duration(plan.churn_duration)
        );
        let services = self.size.services;
        let p = self.index;
        let before = self.scrape(running)?;
        let commits_before = commits.commits();
        let t0 = SystemTime::now();
        let started = Instant::now();
        let mut samples = vec![(Duration::ZERO, running.cpu(), running.rss())];
        let writes = std::thread::scope(|scope| {
            let writer = scope.spawn(|| {
                self.client.stream(
                    plan.churn_rate,
                    plan.churn_duration,
                    CHURN_IN_FLIGHT,
                    |k| Write::ReplaceEndpoint {
                        namespace: NAMESPACE.into(),
                        slice: format!("svc{}-1", churn_service(services, k)),
                        address: churn_address(p, k),
                    },
                    |k| commits.watch(churn_address(p, k)),
                )
            });
            let mut next = SAMPLE_EVERY;
            let mut last_progress = Duration::ZERO;
            while !writer.is_finished() {
                std::thread::sleep(Duration::from_millis(100));
                if started.elapsed() >= next {
                    samples.push((started.elapsed(), running.cpu(), running.rss()));
                    next += SAMPLE_EVERY;
                }
                if started.elapsed() >= last_progress + Duration::from_secs(60) {
                    last_progress = started.elapsed();
                    eprintln!(
                        "  {}: churn {:.0} of {:.0} s, RSS {}",
                        self.proxy,
                        last_progress.as_secs_f64(),
                        plan.churn_duration.as_secs_f64(),
                        mib(running.rss())
                    );
                }
            }
            writer.join().map_err(|_| BenchError::HeadToHead("the churn's writer panicked".into()))?
        })?;
        // The last events' commits: until every one is seen, at most 30 s.
        let grace = Instant::now();
        while grace.elapsed() < Duration::from_secs(30)
            && (0..writes.len() as u64).any(|k| commits.seen(churn_address(p, k)).is_none())
        {
            std::thread::sleep(Duration::from_millis(200));
        }
        samples.push((started.elapsed(), running.cpu(), running.rss()));
        let after = self.scrape(running)?;
        let seen: Vec<Option<SystemTime>> =
            (0..writes.len() as u64).map(|k| commits.seen(churn_address(p, k))).collect();
        Ok(summarize_churn(
            plan.churn_duration,
            services,
            t0,
            &writes,
            &seen,
            &samples,
            commits.commits() - commits_before,
            after.sync.since(&before.sync),
            after.programming.since(&before.programming),
        ))
    }
}

/// The churn's figures from its writes (sending time, success), when each write's address was
/// first seen in the kernel, and the samples (time since the start, CPU time, RSS).
#[allow(clippy::too_many_arguments)]
fn summarize_churn(
    duration: Duration,
    services: usize,
    t0: SystemTime,
    writes: &[(SystemTime, bool)],
    seen: &[Option<SystemTime>],
    samples: &[(Duration, Duration, u64)],
    commits: usize,
    sync: Histogram,
    programming: Histogram,
) -> Churn {
    let minutes = (duration.as_secs() as usize).div_ceil(60).max(1);
    let mut out = Churn {
        events: writes.len(),
        minutes: vec![ChurnMinute::default(); minutes],
        commits,
        sync,
        programming,
        ..Churn::default()
    };
    let minute_of = |t: SystemTime| (t.duration_since(t0).unwrap_or_default().as_secs() as usize / 60).min(minutes - 1);
    let mut per_minute: Vec<Vec<Duration>> = vec![Vec::new(); minutes];
    let windows = (duration.as_secs_f64() / SAMPLE_EVERY.as_secs_f64()).ceil().max(1.0) as usize;
    let mut per_window: Vec<Vec<Duration>> = vec![Vec::new(); windows];
    // The last write to each service: an unseen event with a later write to its slice was
    // replaced before a sync carried it.
    let mut last_of_service: BTreeMap<usize, usize> = BTreeMap::new();
    for k in 0..writes.len() {
        last_of_service.insert(churn_service(services, k as u64), k);
    }
    for (k, ((sent, ok), seen)) in writes.iter().zip(seen).enumerate() {
        let m = minute_of(*sent);
        out.minutes[m].events += 1;
        if !ok {
            out.failed_writes += 1;
        }
        match seen {
            Some(t) => {
                let l = t.duration_since(*sent).unwrap_or_default();
                per_minute[m].push(l);
                let w = sent.duration_since(t0).unwrap_or_default().as_secs_f64() / SAMPLE_EVERY.as_secs_f64();
                per_window[(w as usize).min(windows - 1)].push(l);
                out.latencies.push(l);
            }
            None if last_of_service.get(&churn_service(services, k as u64)) != Some(&k) => out.superseded += 1,
            None if *ok => out.unprogrammed += 1,
            None => {}
        }
    }
    for (m, l) in per_minute.iter().enumerate() {
        out.minutes[m].latency_p50 = quantile(l, 0.5);
        out.minutes[m].latency_p99 = quantile(l, 0.99);
    }
    let window_end = |w: usize| (SAMPLE_EVERY * (w as u32 + 1)).min(duration).as_secs_f64() / 60.0;
    out.latency_samples = per_window
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_empty())
        .map(|(w, l)| {
            (window_end(w), quantile(l, 0.5).as_secs_f64() * 1000.0, quantile(l, 0.99).as_secs_f64() * 1000.0)
        })
        .collect();
    // The samples nearest each minute's ends (they are taken every few seconds; the last one
    // after the run's last commits).
    let at = |d: Duration| samples.iter().min_by_key(|s| s.0.abs_diff(d)).copied();
    for m in 0..minutes {
        let (from, to) = (Duration::from_secs(60 * m as u64), Duration::from_secs(60 * (m as u64 + 1)));
        let to = if m + 1 == minutes { samples.last().map_or(to, |s| s.0.max(to)) } else { to };
        if let (Some(a), Some(b)) = (at(from), at(to))
            && b.0 > a.0
        {
            out.minutes[m].cpu = b.1.saturating_sub(a.1).as_secs_f64() / (b.0 - a.0).as_secs_f64();
            out.minutes[m].rss = b.2;
        }
    }
    if let (Some(first), Some(last)) = (samples.first(), samples.last())
        && last.0 > first.0
    {
        out.cpu = last.1.saturating_sub(first.1).as_secs_f64() / (last.0 - first.0).as_secs_f64();
        out.rss_start = first.2;
        out.rss_end = last.2;
    }
    out.rss_max = samples.iter().map(|s| s.2).max().unwrap_or(0);
    out.samples = samples
        .windows(2)
        .map(|w| {
            let cpu = w[1].1.saturating_sub(w[0].1).as_secs_f64() / (w[1].0 - w[0].0).as_secs_f64().max(1e-9);
            (w[1].0.as_secs_f64() / 60.0, cpu * 100.0, w[1].2 as f64 / (1024.0 * 1024.0))
        })
        .collect();
    out
}

/// The runs the medians are taken over: the quiet ones, or every one when none was quiet.
fn chosen(runs: &[(Figures, Window)]) -> Vec<&Figures> {
    let quiet: Vec<&Figures> = runs.iter().filter(|(_, w)| w.quiet()).map(|(f, _)| f).collect();
    if quiet.is_empty() { runs.iter().map(|(f, _)| f).collect() } else { quiet }
}

/// The median of `values` (the lower middle one of an even count), zero for none.
fn middle<T: Copy + PartialOrd + Default>(mut values: Vec<T>) -> T {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    values.get(values.len().saturating_sub(1) / 2).copied().unwrap_or_default()
}

/// One proxy's figures over its runs: the median of each figure over the quiet runs (every
/// single change of them for the changes' rows), the churn of the run that had it.
fn medians(runs: &[(Figures, Window)]) -> Figures {
    let chosen = chosen(runs);
    let over =
        |f: &dyn Fn(&Figures) -> Duration| middle(chosen.iter().map(|x| f(x)).filter(|d| !d.is_zero()).collect());
    let bytes = |f: &dyn Fn(&Figures) -> u64| middle(chosen.iter().map(|x| f(x)).filter(|b| *b > 0).collect());
    let changes = |f: &dyn Fn(&Figures) -> &Changes| {
        let mut all = Changes::default();
        for x in &chosen {
            let c = f(x);
            all.latencies.extend(&c.latencies);
            all.missed += c.missed;
            all.sync.extend(&c.sync);
            all.programming.extend(&c.programming);
            all.answered.extend(&c.answered);
        }
        all
    };
    Figures {
        first_sync: over(&|x| x.first_sync),
        sync: over(&|x| x.sync),
        endpoint_change: changes(&|x| &x.endpoint_change),
        service_added: changes(&|x| &x.service_added),
        churn: runs.iter().find_map(|(f, _)| f.churn.clone()),
        idle_cpu: middle(chosen.iter().map(|x| x.idle_cpu).collect()),
        peak_rss: bytes(&|x| x.peak_rss),
        restart_first_sync: over(&|x| x.restart_first_sync),
        restart_sync: over(&|x| x.restart_sync),
        restart_peak_rss: bytes(&|x| x.restart_peak_rss),
        leftovers: runs.last().map(|(f, _)| f.leftovers.clone()).unwrap_or_default(),
        error: runs.iter().find_map(|(f, _)| f.error.clone()),
        overruns: runs.iter().map(|(f, _)| f.overruns).sum(),
    }
}

/// `min–max` of a figure over the runs the medians were taken over.
fn spread(runs: &[(Figures, Window)], f: impl Fn(&Figures) -> Option<f64>, show: impl Fn(f64) -> String) -> String {
    let values: Vec<f64> = chosen(runs).into_iter().filter_map(f).collect();
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if values.is_empty() { "-".into() } else { format!("{}–{}", show(lo), show(hi)) }
}

/// Each proxy's runs: how many were quiet, and the spread of the figures the medians are of.
fn runs_table(r: &SizeResult) -> String {
    let mut out = String::new();
    let duration = |d: Duration| (!d.is_zero()).then_some(d.as_secs_f64());
    let as_ms = |s: f64| ms(Duration::from_secs_f64(s));
    let as_mib = |b: f64| mib(b as u64);
    let _ = writeln!(
        out,
        "
Runs (medians above are of the quiet runs; when none was quiet, of all of them):

         | {} | runs quiet | start → first sync | the first sync itself | one endpoint replaced (run medians) | a Service added (run medians) | restart: start → first sync | peak RSS |
|---|---:|---:|---:|---:|---:|---:|---:|",
        r.size
    );
    for (p, runs) in &r.runs {
        let quiet = runs.iter().filter(|(_, w)| w.quiet()).count();
        let change = |c: &Changes| median(&c.latencies).map(|d| d.as_secs_f64());
        let _ = writeln!(
            out,
            "| {p} | {quiet} of {} | {} | {} | {} | {} | {} | {} |",
            runs.len(),
            spread(runs, |f| duration(f.first_sync), as_ms),
            spread(runs, |f| duration(f.sync), as_ms),
            spread(runs, |f| change(&f.endpoint_change), as_ms),
            spread(runs, |f| change(&f.service_added), as_ms),
            spread(runs, |f| duration(f.restart_first_sync), as_ms),
            spread(runs, |f| (f.peak_rss > 0).then_some(f.peak_rss as f64), as_mib),
        );
    }
    let windows: Vec<Window> = r.runs.values().flat_map(|runs| runs.iter().map(|(_, w)| w.clone())).collect();
    let _ = write!(
        out,
        "
The machine around each run ({} s watched before each; quiet: other processes under {} of a core before and during, under {:.0}% stolen):

{}",
        load::BEFORE.as_secs(),
        load::QUIET_OTHERS,
        load::QUIET_STEAL * 100.0,
        load::table(&windows)
    );
    out
}

fn ratio(ours: f64, theirs: f64) -> String {
    if ours > 0.0 && theirs > 0.0 { format!("{:.1}×", theirs / ours) } else { "-".into() }
}

fn median(values: &[Duration]) -> Option<Duration> {
    (!values.is_empty()).then(|| quantile(values, 0.5))
}

fn opt_ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), ms)
}

/// A row of a side-by-side table: one cell per proxy, and a ratio to nftproxy's after each
/// upstream one.
fn row(out: &mut String, what: &str, proxies: &[Proxy], cell: impl Fn(&Proxy) -> (String, Option<f64>)) {
    let ours = proxies.iter().find(|p| **p == Proxy::Nftproxy).and_then(|p| cell(p).1);
    let _ = write!(out, "| {what} |");
    for p in proxies {
        let (text, value) = cell(p);
        let _ = write!(out, " {text} |");
        if *p != Proxy::Nftproxy && proxies.contains(&Proxy::Nftproxy) {
            let _ = write!(
                out,
                " {} |",
                match (ours, value) {
                    (Some(a), Some(b)) => ratio(a, b),
                    _ => "-".into(),
                }
            );
        }
    }
    out.push('\n');
}

fn header(out: &mut String, first: &str, proxies: &[Proxy]) {
    let _ = write!(out, "| {first} |");
    let mut align = String::from("|---|");
    for p in proxies {
        let _ = write!(out, " {p} |");
        align.push_str("---:|");
        if *p != Proxy::Nftproxy && proxies.contains(&Proxy::Nftproxy) {
            out.push_str(" ÷ nftproxy |");
            align.push_str("---:|");
        }
    }
    let _ = writeln!(out, "\n{align}");
}

fn changes_cells(c: &Changes) -> (String, Option<f64>) {
    match median(&c.latencies) {
        Some(m) => {
            let max = c.latencies.iter().max().copied().unwrap_or_default();
            let missed = if c.missed > 0 { format!(", {} not seen", c.missed) } else { String::new() };
            (format!("{} ({}{missed})", ms(m), ms(max)), Some(m.as_secs_f64()))
        }
        None if c.missed > 0 => (format!("{} not seen", c.missed), None),
        None => ("-".into(), None),
    }
}

/// The tables of one size.
pub fn tables(r: &SizeResult, plan: &Plan) -> String {
    let mut out = String::new();
    let proxies: Vec<Proxy> = r.figures.keys().copied().collect();
    let f = |p: &Proxy| r.figures.get(p).cloned().unwrap_or_default();
    let _ = writeln!(
        out,
        "\n### Head to head at {}\n\n{} objects created through the API in {:.0} s. Single changes: median (max) of {}.\n",
        r.size,
        2 * r.size.services,
        r.created_in.as_secs_f64(),
        plan.changes
    );
    header(&mut out, &r.size.to_string(), &proxies);
    let dur = |d: Duration| if d.is_zero() { ("-".to_string(), None) } else { (ms(d), Some(d.as_secs_f64())) };
    let mem = |b: u64| if b == 0 { ("-".to_string(), None) } else { (mib(b), Some(b as f64)) };
    row(&mut out, "start → first sync done", &proxies, |p| dur(f(p).first_sync));
    row(&mut out, "the first sync itself (`sync_full_proxy_rules_duration_seconds`)", &proxies, |p| dur(f(p).sync));
    row(&mut out, "one endpoint replaced, API write → kernel commit", &proxies, |p| {
        changes_cells(&f(p).endpoint_change)
    });
    row(&mut out, "… the API server's answer to the write", &proxies, |p| {
        let m = median(&f(p).endpoint_change.answered);
        (opt_ms(m), m.map(|d| d.as_secs_f64()))
    });
    row(&mut out, "… its sync (`sync_proxy_rules_duration_seconds`)", &proxies, |p| {
        let m = median(&f(p).endpoint_change.sync);
        (opt_ms(m), m.map(|d| d.as_secs_f64()))
    });
    row(&mut out, "… its `network_programming_duration_seconds`", &proxies, |p| {
        let m = median(&f(p).endpoint_change.programming);
        (opt_ms(m), m.map(|d| d.as_secs_f64()))
    });
    row(&mut out, "a Service added, API write → kernel commit", &proxies, |p| changes_cells(&f(p).service_added));
    row(&mut out, "… the API server's answer to the write", &proxies, |p| {
        let m = median(&f(p).service_added.answered);
        (opt_ms(m), m.map(|d| d.as_secs_f64()))
    });
    row(&mut out, "… its sync (`sync_proxy_rules_duration_seconds`)", &proxies, |p| {
        let m = median(&f(p).service_added.sync);
        (opt_ms(m), m.map(|d| d.as_secs_f64()))
    });
    row(
        &mut out,
        &format!("idle CPU over {} (share of one core)", humantime::format_duration(plan.idle)),
        &proxies,
        |p| {
            let c = f(p).idle_cpu;
            (format!("{:.2}%", c * 100.0), (c > 0.0).then_some(c))
        },
    );
    row(&mut out, "peak RSS (start, changes, churn)", &proxies, |p| mem(f(p).peak_rss));
    row(&mut out, "restart: start → first sync done", &proxies, |p| dur(f(p).restart_first_sync));
    row(&mut out, "restart: the first sync itself", &proxies, |p| dur(f(p).restart_sync));
    row(&mut out, "restart: peak RSS", &proxies, |p| mem(f(p).restart_peak_rss));
    out.push_str(&runs_table(r));
    let left: Vec<String> = r
        .figures
        .iter()
        .filter(|(_, f)| !f.leftovers.is_empty())
        .map(|(p, f)| format!("after {p}: {}", f.leftovers.join(", ")))
        .collect();
    if !left.is_empty() {
        let _ = writeln!(out, "\nLeft by the cleanups (then flushed): {}.", left.join("; "));
    }
    for (p, f) in &r.figures {
        if let Some(e) = &f.error {
            let _ = writeln!(out, "\n**{p} stopped early**: {e}");
        }
        if f.overruns > 0 {
            let _ = writeln!(
                out,
                "\nWhile {p} ran, the kernel dropped nftables notifications {} times (its buffer was full): a change may be missing.",
                f.overruns
            );
        }
    }
    let churns: Vec<(Proxy, Churn)> = r.figures.iter().filter_map(|(p, f)| Some((*p, f.churn.clone()?))).collect();
    if !churns.is_empty() {
        out.push_str(&churn_tables(r, plan, &churns));
    }
    out
}

fn churn_tables(r: &SizeResult, plan: &Plan, churns: &[(Proxy, Churn)]) -> String {
    let mut out = String::new();
    let proxies: Vec<Proxy> = churns.iter().map(|(p, _)| *p).collect();
    let c = |p: &Proxy| churns.iter().find(|(q, _)| q == p).map(|(_, c)| c.clone()).unwrap_or_default();
    let _ = writeln!(
        out,
        "\n#### Churn at {}: {} endpoint updates a second for {}\n",
        r.size,
        plan.churn_rate,
        humantime::format_duration(plan.churn_duration)
    );
    header(&mut out, "whole run", &proxies);
    row(&mut out, "events sent / seen in the kernel", &proxies, |p| {
        let c = c(p);
        (format!("{} / {}", c.events, c.latencies.len()), None)
    });
    row(&mut out, "API write → kernel commit p50", &proxies, |p| {
        let c = c(p);
        let v = median(&c.latencies);
        (opt_ms(v), v.map(|d| d.as_secs_f64()))
    });
    row(&mut out, "API write → kernel commit p99", &proxies, |p| {
        let c = c(p);
        let v = (!c.latencies.is_empty()).then(|| quantile(&c.latencies, 0.99));
        (opt_ms(v), v.map(|d| d.as_secs_f64()))
    });
    row(&mut out, "`network_programming_duration_seconds` p50 / p99 (from its buckets); mean", &proxies, |p| {
        let h = c(p).programming;
        (
            format!("{} / {}; {}", opt_ms(h.quantile(0.5)), opt_ms(h.quantile(0.99)), opt_ms(h.mean())),
            h.mean().map(|d| d.as_secs_f64()),
        )
    });
    row(&mut out, "`sync_proxy_rules_duration_seconds` p50 / p99 (from its buckets); mean", &proxies, |p| {
        let h = c(p).sync;
        (
            format!("{} / {}; {}", opt_ms(h.quantile(0.5)), opt_ms(h.quantile(0.99)), opt_ms(h.mean())),
            h.mean().map(|d| d.as_secs_f64()),
        )
    });
    row(&mut out, "syncs (metric) / kernel transactions", &proxies, |p| {
        let c = c(p);
        (format!("{:.0} / {}", c.sync.count, c.commits), None)
    });
    row(&mut out, "CPU, share of one core (children included)", &proxies, |p| {
        let c = c(p);
        (format!("{:.1}%", c.cpu * 100.0), (c.cpu > 0.0).then_some(c.cpu))
    });
    row(&mut out, "RSS at the start → at the end (max)", &proxies, |p| {
        let c = c(p);
        (
            format!("{} → {} ({})", mib(c.rss_start), mib(c.rss_end), mib(c.rss_max)),
            (c.rss_max > 0).then_some(c.rss_max as f64),
        )
    });
    let notes: Vec<String> = churns
        .iter()
        .filter(|(_, c)| c.unprogrammed + c.superseded + c.failed_writes + c.overruns > 0)
        .map(|(p, c)| {
            format!(
                "{p}: {} events never seen in the kernel, {} replaced by a later write before a sync carried them, {} writes failed, {} notification overruns",
                c.unprogrammed, c.superseded, c.failed_writes, c.overruns
            )
        })
        .collect();
    if !notes.is_empty() {
        let _ = writeln!(out, "\n{}.", notes.join("; "));
    }
    let _ = write!(out, "\n| minute |");
    let mut align = String::from("|---:|");
    for p in &proxies {
        let _ = write!(out, " {p}: p50 / p99 | CPU | RSS |");
        align.push_str("---:|---:|---:|");
    }
    let _ = writeln!(out, "\n{align}");
    let minutes = churns.iter().map(|(_, c)| c.minutes.len()).max().unwrap_or(0);
    for m in 0..minutes {
        let _ = write!(out, "| {} |", m + 1);
        for (_, c) in churns {
            match c.minutes.get(m) {
                Some(row) => {
                    let _ = write!(
                        out,
                        " {} / {} | {:.1}% | {} |",
                        ms(row.latency_p50),
                        ms(row.latency_p99),
                        row.cpu * 100.0,
                        mib(row.rss)
                    );
                }
                None => out.push_str(" - | - | - |"),
            }
        }
        out.push('\n');
    }
    if let Some(plot) = &r.plot {
        let name = plot.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let _ = writeln!(out, "\n![API write → kernel commit, CPU and RSS of each proxy under churn]({name})");
    }
    out
}

/// The README's three-row headline from this run: start-up and memory, churn, and the data
/// plane at its largest size (each row when this run measured it).
pub fn headline(results: &[SizeResult], plan: &Plan, dataplane: &[super::dataplane::ConnStats]) -> String {
    let ten_thousand = Size { services: 10000, endpoints: 10 };
    let Some(r) = results.iter().find(|r| r.size == ten_thousand).or(results.last()) else {
        return String::new();
    };
    let (Some(ours), Some(theirs)) = (r.figures.get(&Proxy::Nftproxy), r.figures.get(&Proxy::KubeProxyNftables)) else {
        return String::new();
    };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let x = |a: f64, b: f64| ratio(a, b);
    let quiet = |p: Proxy| {
        let runs = r.runs.get(&p).map(Vec::as_slice).unwrap_or_default();
        (runs.iter().filter(|(_, w)| w.quiet()).count(), runs.len())
    };
    let ((ours_quiet, ours_runs), (theirs_quiet, theirs_runs)) =
        (quiet(Proxy::Nftproxy), quiet(Proxy::KubeProxyNftables));
    let first_sync_spread = |p: Proxy| {
        let runs = r.runs.get(&p).map(Vec::as_slice).unwrap_or_default();
        spread(
            runs,
            |f| (!f.first_sync.is_zero()).then_some(f.first_sync.as_secs_f64()),
            |s| ms(Duration::from_secs_f64(s)),
        )
    };
    let mut out = format!(
        "\n## Headline\n\nFor the README's Performance section: medians of the quiet runs (nftproxy {ours_quiet} of {ours_runs}, \
         upstream {theirs_quiet} of {theirs_runs}; of every run when none was quiet), the first sync's spread in brackets.\n\n\
         | at {} Services × {} endpoints, {cores}-core machine, real kube-apiserver v1.37.2 | nftproxy | upstream kube-proxy v1.37.2 (nftables) |\n|---|---:|---:|\n",
        r.size.services, r.size.endpoints
    );
    let _ = writeln!(
        out,
        "| start → first sync done; peak RSS | {} [{}]; {} | {} [{}] ({}); {} ({}) |",
        ms(ours.first_sync),
        first_sync_spread(Proxy::Nftproxy),
        mib(ours.peak_rss),
        ms(theirs.first_sync),
        first_sync_spread(Proxy::KubeProxyNftables),
        x(ours.first_sync.as_secs_f64(), theirs.first_sync.as_secs_f64()),
        mib(theirs.peak_rss),
        x(ours.peak_rss as f64, theirs.peak_rss as f64)
    );
    if let (Some(a), Some(b)) = (&ours.churn, &theirs.churn)
        && !a.latencies.is_empty()
        && !b.latencies.is_empty()
    {
        let (pa, pb) = (quantile(&a.latencies, 0.99), quantile(&b.latencies, 0.99));
        let _ = writeln!(
            out,
            "| {} endpoint updates/s: API write → kernel commit p99; CPU | {}; {:.1}% of a core | {}; {:.1}% ({}) |",
            plan.churn_rate,
            ms(pa),
            a.cpu * 100.0,
            ms(pb),
            b.cpu * 100.0,
            x(a.cpu, b.cpu)
        );
    }
    let most = dataplane.iter().map(|r| r.services).max();
    let row = |set: super::dataplane::Ruleset| dataplane.iter().find(|r| Some(r.services) == most && r.ruleset == set);
    if let (Some(a), Some(b)) =
        (row(super::dataplane::Ruleset::Nftproxy), row(super::dataplane::Ruleset::KubeProxyNftables))
    {
        let vs = |v: Option<f64>| v.map_or(String::new(), |v| format!(" ({v:+.1}%)"));
        let _ = writeln!(
            out,
            "| new TCP connections through one ClusterIP with {} other services (vs a single DNAT rule) | {:.0}/s{} | {:.0}/s{} |",
            a.services,
            a.per_second,
            vs(a.rate_vs_floor),
            b.per_second,
            vs(b.rate_vs_floor)
        );
    }
    out
}

/// For `--quick` (CI): every proxy synced, every single change and churn event reached the
/// kernel, and no write failed.
pub fn check(results: &[SizeResult]) -> Result<(), BenchError> {
    for r in results {
        for (p, f) in &r.figures {
            let fail = |what: String| Err(BenchError::HeadToHead(format!("{p} at {}: {what}", r.size)));
            if let Some(e) = &f.error {
                return fail(e.clone());
            }
            if f.first_sync.is_zero() || f.restart_first_sync.is_zero() {
                return fail("no first sync".into());
            }
            for (kind, c) in [("endpoint changes", &f.endpoint_change), ("Services added", &f.service_added)] {
                if c.missed > 0 || c.latencies.is_empty() {
                    return fail(format!("{} of {kind} not seen in the kernel", c.missed));
                }
            }
            if let Some(c) = &f.churn
                && (c.latencies.is_empty() || c.unprogrammed > 0 || c.failed_writes > 0)
            {
                return fail(format!(
                    "churn: {} events seen in the kernel, {} never, {} writes failed",
                    c.latencies.len(),
                    c.unprogrammed,
                    c.failed_writes
                ));
            }
        }
    }
    Ok(())
}

/// The targets, as this run met them (printed, not asserted).
pub fn targets(results: &[SizeResult]) -> String {
    let mut rows: Vec<(String, String, Option<bool>)> = Vec::new();
    let get = |r: &SizeResult, p: Proxy| r.figures.get(&p).cloned();
    for r in results {
        let (Some(ours), Some(theirs)) = (get(r, Proxy::Nftproxy), get(r, Proxy::KubeProxyNftables)) else {
            continue;
        };
        if r.size == (Size { services: 10000, endpoints: 10 })
            && !ours.first_sync.is_zero()
            && !theirs.first_sync.is_zero()
        {
            let x = theirs.first_sync.as_secs_f64() / ours.first_sync.as_secs_f64().max(1e-9);
            rows.push((
                format!("first sync ≥ 30× faster than upstream nftables at {}", r.size),
                format!("{} against {}: {x:.1}×", ms(ours.first_sync), ms(theirs.first_sync)),
                Some(x >= 30.0),
            ));
        }
        if let (Some(a), Some(b)) = (&ours.churn, &theirs.churn) {
            let share = a.cpu / b.cpu.max(1e-9);
            rows.push((
                format!("under churn at {}, CPU ≤ 1/5 of upstream nftables'", r.size),
                format!(
                    "{:.1}% against {:.1}% of a core: 1/{:.1}",
                    a.cpu * 100.0,
                    b.cpu * 100.0,
                    1.0 / share.max(1e-9)
                ),
                Some(share <= 0.2),
            ));
            let (pa, pb) = (quantile(&a.latencies, 0.99), quantile(&b.latencies, 0.99));
            rows.push((
                format!("under churn at {}, p99 API write → kernel commit no worse", r.size),
                format!("{} against {}", ms(pa), ms(pb)),
                Some(!a.latencies.is_empty() && pa <= pb),
            ));
        }
        if ours.peak_rss == 0 || theirs.peak_rss == 0 {
            continue;
        }
        let x = theirs.peak_rss as f64 / ours.peak_rss as f64;
        rows.push((
            format!("peak RSS ≤ 1/2 of upstream nftables' at {}", r.size),
            format!("{} against {}: 1/{x:.1}", mib(ours.peak_rss), mib(theirs.peak_rss)),
            Some(x >= 2.0),
        ));
    }
    if rows.is_empty() {
        return String::new();
    }
    let mut out = String::from("\n### Head to head: the targets\n\n| target | this run | |\n|---|---|---|\n");
    for (target, figure, met) in rows {
        let verdict = match met {
            Some(true) => "met",
            Some(false) => "not met",
            None => "-",
        };
        let _ = writeln!(out, "| {target} | {figure} | {verdict} |");
    }
    out
}

/// The ruleset upstream's kube-proxy v1.37.2 in nftables mode programs for `state`, by the real
/// process: a control plane started in `lab` holds `state`'s Services and EndpointSlices
/// (written through the API; the one whose ClusterIP is the API server's own, 10.96.0.1, is
/// left out, the `kubernetes` Service standing in for it), kube-proxy runs on `node` until its
/// first sync, and its table is listed (`nft list table ip kube-proxy`), then it is stopped.
pub fn kube_proxy_ruleset(
    lab: &mut Lab,
    node: &str,
    state: &ClusterState,
    service_cidr: &str,
    cluster_cidr: &str,
) -> Result<String, BenchError> {
    let hth = |e: crate::controlplane::ControlPlaneError| BenchError::HeadToHead(e.to_string());
    let node_ip = lab.node(node).ip;
    let mut cp = ControlPlane::start_in(lab, service_cidr).map_err(hth)?;
    cp.add_node(node, node_ip, "zone-a").map_err(hth)?;
    cp.apply(KUBE_PROXY_IDENTITY).map_err(hth)?;
    cp.stop_controller_manager();
    let client = ApiClient::new(&cp);
    let (namespaces, objects, statuses) = state_objects(state);
    let started = Instant::now();
    client.create_all(namespaces)?;
    client.create_all(objects)?;
    client.run(|c| async move {
        for (path, status) in statuses {
            api::merge_patch(&c, &path, &status).await?;
        }
        Ok(())
    })?;
    eprintln!("bench: data plane: the cluster written through the API in {:.1} s", started.elapsed().as_secs_f64());
    let dir = tempfile::Builder::new().prefix("nftproxy-dataplane-").tempdir()?;
    let token = cp.token("kube-system", "kube-proxy").map_err(hth)?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, cp.kubeconfig(&token))?;
    let config = dir.path().join("config.conf");
    std::fs::write(&config, proxies::config_file("nftables", &kubeconfig, cluster_cidr))?;
    let ns = &lab.node(node).ns;
    let mut running =
        Running::start(ns, Proxy::KubeProxyNftables, &cp.bins, &config, &dir.path().join("kube-proxy.log"))?;
    let first = running.wait_first_sync(Duration::from_secs(1800))?;
    eprintln!("bench: data plane: kube-proxy's first sync done {:.1} s after its start", first.as_secs_f64());
    // Its next syncs (the Node, ServiceCIDRs arriving) settle within the minimum sync period.
    std::thread::sleep(Duration::from_secs(3));
    let listed = ns.exec("nft", &["list", "table", "ip", "kube-proxy"])?;
    running.stop();
    Ok(String::from_utf8_lossy(&listed.stdout).into_owned())
}

/// `state` as API objects: its namespaces, its Services (selector-less; NodePorts left to the
/// API server to allocate) and EndpointSlices, and the status patches of its load balancers.
fn state_objects(state: &ClusterState) -> (Vec<NewObject>, Vec<NewObject>, Vec<(String, Value)>) {
    let mut namespaces = std::collections::BTreeSet::new();
    let mut objects = Vec::new();
    let mut statuses = Vec::new();
    let taken = std::net::IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1));
    for svc in state.services() {
        if svc.ports.iter().any(|p| p.cluster_ips.contains(&taken)) {
            continue;
        }
        let (ns, name) = (&svc.name.namespace, &svc.name.name);
        namespaces.insert(ns.clone());
        let Some(first) = svc.ports.first() else { continue };
        let kind = if !first.load_balancer_ips.is_empty() {
            "LoadBalancer"
        } else if first.node_port.is_some() {
            "NodePort"
        } else {
            "ClusterIP"
        };
        let ports: Vec<Value> = svc
            .ports
            .iter()
            .map(|p| json!({"name": p.name.port, "port": p.port, "protocol": p.name.protocol.name().to_uppercase()}))
            .collect();
        let mut spec = json!({
            "type": kind,
            "clusterIP": first.cluster_ips.first().map(ToString::to_string),
            "ports": ports,
        });
        if kind != "ClusterIP" {
            spec["externalTrafficPolicy"] = json!(if first.external_policy_local { "Local" } else { "Cluster" });
        }
        if let Some(t) = first.session_affinity_secs {
            spec["sessionAffinity"] = json!("ClientIP");
            spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": t}});
        }
        objects.push(NewObject {
            collection: api::collection("Service", ns),
            object: json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns}, "spec": spec}),
        });
        if !first.load_balancer_ips.is_empty() {
            let ingress: Vec<Value> = first.load_balancer_ips.iter().map(|ip| json!({"ip": ip.to_string()})).collect();
            statuses.push((
                format!("{}/{name}/status", api::collection("Service", ns)),
                json!({"status": {"loadBalancer": {"ingress": ingress}}}),
            ));
        }
        for slice in state.slices_of(&svc.name) {
            let endpoints: Vec<Value> = slice
                .endpoints
                .iter()
                .map(|e| {
                    json!({"addresses": [e.ip.to_string()],
                           "conditions": {"ready": e.ready, "serving": e.serving, "terminating": e.terminating},
                           "nodeName": e.node_name})
                })
                .collect();
            let ports: Vec<Value> = slice
                .ports
                .iter()
                .map(|(n, proto, port)| json!({"name": n, "port": port, "protocol": proto.name().to_uppercase()}))
                .collect();
            objects.push(NewObject {
                collection: api::collection("EndpointSlice", &slice.name.namespace),
                object: json!({
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"name": slice.name.name, "namespace": slice.name.namespace,
                                 "labels": {"kubernetes.io/service-name": name,
                                            "endpointslice.kubernetes.io/managed-by": "nftproxy-bench"}},
                    "addressType": "IPv4",
                    "ports": ports,
                    "endpoints": endpoints,
                }),
            });
        }
    }
    let namespaces = namespaces
        .into_iter()
        .filter(|n| n != "default")
        .map(|n| NewObject {
            collection: api::collection("Namespace", ""),
            object: json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}),
        })
        .collect();
    (namespaces, objects, statuses)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn churn_addresses_are_fresh_per_proxy_and_event() {
        assert_eq!(churn_address(0, 0), Ipv4Addr::new(100, 64, 0, 0));
        assert_eq!(churn_address(0, 65_537), Ipv4Addr::new(100, 65, 0, 1));
        assert_eq!(churn_address(1, 0), Ipv4Addr::new(100, 80, 0, 0));
        assert_eq!(churn_address(2, 60_000), Ipv4Addr::new(100, 96, 234, 96));
        // Each service once before any twice.
        let hits: std::collections::BTreeSet<usize> = (0..1000).map(|k| churn_service(1000, k)).collect();
        assert_eq!(hits.len(), 1000);
    }

    #[test]
    fn churn_is_summarized_per_minute() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Four services, written by events 0‥5 in the order 1, 0, 3, 2, 1, 0: five in the
        // first minute, one in the second.
        let writes: Vec<(SystemTime, bool)> =
            [0, 1000, 2000, 3000, 4000, 61_000].iter().map(|&m| (at(m), true)).collect();
        let seen = vec![None, Some(at(1100)), None, Some(at(3100)), Some(at(5000)), Some(at(61_300))];
        let samples = vec![
            (Duration::ZERO, Duration::ZERO, 10 << 20),
            (Duration::from_secs(60), Duration::from_secs(6), 12 << 20),
            (Duration::from_secs(120), Duration::from_secs(9), 11 << 20),
        ];
        let c = summarize_churn(
            Duration::from_secs(120),
            4,
            t0,
            &writes,
            &seen,
            &samples,
            7,
            Histogram::default(),
            Histogram::default(),
        );
        assert_eq!(c.events, 6);
        assert_eq!(c.latencies.len(), 4);
        // Event 0's service is written again by event 4; event 2's never again.
        assert_eq!((c.unprogrammed, c.superseded), (1, 1));
        assert_eq!(c.minutes.len(), 2);
        assert_eq!(c.minutes[0].events, 5);
        assert_eq!(c.minutes[0].latency_p50, Duration::from_millis(100));
        assert_eq!(c.minutes[1].latency_p99, Duration::from_millis(300));
        assert!((c.minutes[0].cpu - 0.1).abs() < 1e-9);
        assert!((c.minutes[1].cpu - 0.05).abs() < 1e-9);
        assert!((c.cpu - 0.075).abs() < 1e-9);
        assert_eq!((c.rss_start, c.rss_end, c.rss_max), (10 << 20, 11 << 20, 12 << 20));
        assert_eq!(c.samples.len(), 2);
        // Windows of 10 s: events 0‥4 in the first (three seen), event 5 in the seventh.
        assert_eq!(c.latency_samples.len(), 2);
        assert_eq!(c.latency_samples[0].1, 100.0);
        assert!((c.latency_samples[1].0 - 70.0 / 60.0).abs() < 1e-9);
        assert_eq!(c.latency_samples[1].2, 300.0);
    }

    #[test]
    fn a_state_becomes_api_objects() {
        let state = crate::cluster::state(Size { services: 30, endpoints: 2 });
        let (namespaces, objects, statuses) = state_objects(&state);
        // Service 0 has the API server's ClusterIP: left out with its slice.
        assert_eq!(objects.len(), 2 * 29);
        assert_eq!(namespaces.len(), 29);
        let lb = objects.iter().find(|o| o.object["metadata"]["name"] == "svc5").unwrap();
        assert_eq!(lb.object["spec"]["type"], "LoadBalancer");
        assert_eq!(statuses.len(), 2, "svc5 and svc25");
        let affinity = objects.iter().find(|o| o.object["metadata"]["name"] == "svc3").unwrap();
        assert_eq!(affinity.object["spec"]["sessionAffinity"], "ClientIP");
        let udp = objects.iter().find(|o| o.object["metadata"]["name"] == "svc7").unwrap();
        assert_eq!(udp.object["spec"]["ports"][0]["protocol"], "UDP");
    }
}
