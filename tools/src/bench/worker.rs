//! The benchmark's worker: one process per phase, started by the orchestrator inside a
//! benchmark namespace (`nftproxy bench-worker …`), so that its peak RSS is the proxy's alone and
//! a restart is a real new process. It prints one JSON line: a [`WorkerReport`].

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use super::error::BenchError;
use crate::cluster::{self, Size};
use nftproxy::config::{ProxyConfig, parse_cidrs};
use nftproxy::index::{Change, ClusterIndex, Update};
use nftproxy::model::ClusterState;
use nftproxy::sync::{SyncReason, Synced, Syncer, local_nodeports};

/// What a worker process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum Phase {
    /// Empty kernel → the full ruleset in one transaction.
    Cold,
    /// The ruleset is already in the kernel: a new process converges, then the one-change and
    /// burst measurements run against it.
    Restart,
    /// Applies an nft file with `nft -f` (the anchors) and reports its time and peak RSS.
    NftFile,
    /// Runs the command after `--` to completion and reports its wall time and peak RSS (the
    /// end-to-end benchmark's `render` and `sync`).
    Measure,
}

/// `nftproxy bench-worker` arguments (internal: the orchestrator passes them).
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    #[arg(long, value_enum)]
    pub phase: Phase,
    #[arg(long, default_value_t = 0)]
    pub services: usize,
    #[arg(long, default_value_t = 0)]
    pub endpoints: usize,
    /// One-change measurements (restart phase).
    #[arg(long, default_value_t = 60)]
    pub changes: usize,
    /// Endpoint changes coalesced into the burst sync (restart phase).
    #[arg(long, default_value_t = 1000)]
    pub burst: usize,
    /// The nft file (nft-file phase).
    #[arg(long)]
    pub file: Option<std::path::PathBuf>,
    /// Give up on `nft -f` after this long (nft-file phase).
    #[arg(long, default_value = "300s", value_parser = humantime::parse_duration)]
    pub cap: Duration,
    /// The program and its arguments (measure phase).
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// One sync as the benchmark reports it.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct SyncFigures {
    pub total: Duration,
    /// Time inside sendmsg and reading the ACKs.
    pub kernel: Duration,
    pub plan: Duration,
    pub diff: Duration,
    pub encode: Duration,
    pub read: Duration,
    pub messages: usize,
    pub bytes: usize,
}

impl From<&Synced> for SyncFigures {
    fn from(s: &Synced) -> SyncFigures {
        let r = &s.report;
        SyncFigures {
            total: r.total,
            kernel: r.apply.kernel,
            plan: r.plan,
            diff: Duration::ZERO,
            encode: r.apply.encode,
            read: r.read,
            messages: r.apply.messages,
            bytes: r.apply.bytes,
        }
    }
}

/// Which kind of change a one-change measurement made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChangeKind {
    EndpointAdded,
    EndpointRemoved,
    ServiceAdded,
    ServiceRemoved,
}

/// What a worker measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WorkerReport {
    /// The cold or restart sync.
    pub sync: Option<SyncFigures>,
    /// One-change syncs, in order, with their kind.
    pub changes: Vec<(ChangeKind, SyncFigures)>,
    /// The burst: how many changes, and the one sync that applied them.
    pub burst: Option<(usize, SyncFigures)>,
    /// `nft -f`: wall time, or None when it was stopped at the cap.
    pub nft_file: Option<Duration>,
    /// Peak resident set size of this process (or of `nft`), bytes.
    pub peak_rss: u64,
}

/// Runs one phase and prints its report as one JSON line.
pub fn run(args: &WorkerArgs) -> Result<(), BenchError> {
    let report = match args.phase {
        Phase::Cold => cold(args)?,
        Phase::Restart => restart(args)?,
        Phase::NftFile => nft_file(args)?,
        Phase::Measure => {
            let cost = measure(args)?;
            let line = serde_json::to_string(&cost).map_err(|e| BenchError::Worker(e.to_string()))?;
            println!("{line}");
            return Ok(());
        }
    };
    let line = serde_json::to_string(&report).map_err(|e| BenchError::Worker(e.to_string()))?;
    println!("{line}");
    Ok(())
}

/// The proxy configuration every phase uses: node1, cluster CIDR 10.128.0.0/9 (the synthetic
/// pods), node addresses from the synthetic Node.
pub fn config() -> ProxyConfig {
    let mut config = ProxyConfig::new("node1");
    if let Ok(cidrs) = parse_cidrs("--cluster-cidr", "10.128.0.0/9") {
        config.cluster_cidrs = cidrs;
    }
    // The benchmark measures syncs; conntrack cleanup runs outside them.
    config.conntrack_cleanup = false;
    config
}

/// The index and the syncer the agent would have, the index holding `state` (nothing pending
/// is lost: the first sync is full).
struct Proxy {
    index: ClusterIndex,
    syncer: Syncer,
}

impl Proxy {
    fn new(state: &ClusterState) -> Result<Proxy, BenchError> {
        let kernel = nftproxy::netlink::Kernel::open()?;
        let mut index = ClusterIndex::new();
        index.apply(Update::Service(Change::Reset(state.services().cloned().collect())));
        let slices = state.services().flat_map(|s| state.slices_of(&s.name).cloned().collect::<Vec<_>>()).collect();
        index.apply(Update::EndpointSlice(Change::Reset(slices)));
        index.apply(Update::Node(Change::Reset(state.node().cloned().into_iter().collect())));
        Ok(Proxy { index, syncer: Syncer::new(config(), Box::new(kernel), local_nodeports()) })
    }

    fn sync(&mut self, reason: SyncReason, full: bool) -> Result<Synced, BenchError> {
        let pending = self.index.take_pending();
        Ok(self.syncer.sync(self.index.state(), &pending, reason, full)?)
    }
}

fn size(args: &WorkerArgs) -> Size {
    Size { services: args.services, endpoints: args.endpoints }
}

fn cold(args: &WorkerArgs) -> Result<WorkerReport, BenchError> {
    let mut p = Proxy::new(&cluster::state(size(args)))?;
    let synced = p.sync(SyncReason::Startup, true)?;
    Ok(WorkerReport { sync: Some(SyncFigures::from(&synced)), peak_rss: peak_rss_self(), ..WorkerReport::default() })
}

fn restart(args: &WorkerArgs) -> Result<WorkerReport, BenchError> {
    let size = size(args);
    let mut p = Proxy::new(&cluster::state(size))?;
    let synced = p.sync(SyncReason::Startup, true)?;
    let mut report = WorkerReport { sync: Some(SyncFigures::from(&synced)), ..WorkerReport::default() };
    drop(synced);
    let apply = |p: &mut Proxy, update: Update| p.index.apply(update);
    // One change at a time, spread over the services (a prime stride): one endpoint added, the
    // same endpoint removed, one new service added, the same service removed.
    for n in 0..args.changes {
        let i = (n / 4 * 7919 + 1) % size.services.max(1);
        let extra = size.services + n / 4;
        let kind = match n % 4 {
            0 => {
                apply(&mut p, Update::EndpointSlice(Change::Apply(cluster::slice(i, size.endpoints + 1, 0))));
                ChangeKind::EndpointAdded
            }
            1 => {
                apply(&mut p, Update::EndpointSlice(Change::Apply(cluster::slice(i, size.endpoints, 0))));
                ChangeKind::EndpointRemoved
            }
            2 => {
                apply(&mut p, Update::Service(Change::Apply(cluster::service(extra))));
                apply(&mut p, Update::EndpointSlice(Change::Apply(cluster::slice(extra, size.endpoints, 0))));
                ChangeKind::ServiceAdded
            }
            _ => {
                apply(&mut p, Update::EndpointSlice(Change::Delete(cluster::slice(extra, size.endpoints, 0).name)));
                apply(&mut p, Update::Service(Change::Delete(cluster::service(extra).name)));
                ChangeKind::ServiceRemoved
            }
        };
        let synced = p.sync(SyncReason::Changes, false)?;
        report.changes.push((kind, SyncFigures::from(&synced)));
    }
    // The burst: one endpoint added to each of `burst` services, then one sync.
    let burst = args.burst.min(size.services);
    for k in 0..burst {
        let i = (k * 7919 + 3) % size.services.max(1);
        apply(&mut p, Update::EndpointSlice(Change::Apply(cluster::slice(i, size.endpoints + 1, 0))));
    }
    let synced = p.sync(SyncReason::Changes, false)?;
    report.burst = Some((burst, SyncFigures::from(&synced)));
    report.peak_rss = peak_rss_self();
    Ok(report)
}

fn nft_file(args: &WorkerArgs) -> Result<WorkerReport, BenchError> {
    let file = args.file.as_ref().ok_or_else(|| BenchError::Worker("nft-file needs --file".into()))?;
    let started = Instant::now();
    let mut child = Command::new("nft")
        .arg("-f")
        .arg(file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| BenchError::Tool("nft".into(), e.to_string()))?;
    let mut finished = None;
    while started.elapsed() < args.cap {
        if let Some(status) = child.try_wait().map_err(|e| BenchError::Tool("nft".into(), e.to_string()))? {
            finished = Some(status);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = started.elapsed();
    let nft_file = match finished {
        Some(status) if status.success() => Some(elapsed),
        Some(_) => {
            let out = child.wait_with_output().map_err(|e| BenchError::Tool("nft".into(), e.to_string()))?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(BenchError::Tool("nft -f".into(), stderr.lines().take(5).collect::<Vec<_>>().join("; ")));
        }
        None => {
            // The kernel finishes (or aborts) the batch it is in before the process dies.
            let _ = child.kill();
            let _ = child.wait();
            None
        }
    };
    Ok(WorkerReport { nft_file, peak_rss: peak_rss_children(), ..WorkerReport::default() })
}

fn measure(args: &WorkerArgs) -> Result<super::agent::Cost, BenchError> {
    let (program, rest) =
        args.command.split_first().ok_or_else(|| BenchError::Worker("measure needs a command".into()))?;
    let started = Instant::now();
    let out = Command::new(program)
        .args(rest)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| BenchError::Tool(program.clone(), e.to_string()))?;
    let wall = started.elapsed();
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(BenchError::Tool(program.clone(), stderr.lines().rev().take(5).collect::<Vec<_>>().join("; ")));
    }
    Ok(super::agent::Cost { wall, peak_rss: peak_rss_children() })
}

/// This process's peak RSS (VmHWM), bytes.
fn peak_rss_self() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The largest peak RSS among this process's waited-for children (here: the one `nft`), bytes.
fn peak_rss_children() -> u64 {
    nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        .map_or(0, |u| u.max_rss().max(0) as u64 * 1024)
}
