//! `nftproxy bench`: the scale benchmark (docs/performance.md).
//!
//! For each cluster size it creates fresh network namespaces and runs worker processes
//! ([`worker`]) inside them: a cold sync, then a restart (a new process meeting the ruleset
//! already in the kernel) followed by one-change and burst syncs. Beside them, in the same run,
//! the anchors: nftproxy's own `render` output and the upstream-shaped ruleset ([`upstream`]),
//! each applied with `nft -f`, and the upstream ruleset's incremental updates. Last, the data
//! plane ([`dataplane`]), and the head-to-head with upstream's own kube-proxy ([`head_to_head`]).
//! It prints Markdown tables with the machine described, and keeps them, with the plots, in a
//! dated results file ([`Record`]).

pub mod agent;
pub mod api;
pub mod churn;
pub mod dataplane;
pub mod e2e;
pub mod error;
pub mod figures;
pub mod head_to_head;
pub mod kernel;
pub mod load;
mod plot;
pub mod proxies;
pub mod record;
pub mod sizing;
pub mod upstream;
pub mod worker;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Args;

pub use error::BenchError;
use figures::{mib, ms, quantile};
pub use record::{Record, Report};

use crate::cluster::{self, CLUSTER_CIDR, NODE, Size};
use crate::lab::Netns;
use nftproxy::model::ClusterState;
use worker::{ChangeKind, Phase, SyncFigures, WorkerReport};

/// `nftproxy bench` options.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// CI mode: the smallest size, few changes, short data-plane trials; checks that everything
    /// completes.
    #[arg(long)]
    pub quick: bool,
    /// Only the head-to-head with upstream kube-proxy v1.37.2 through the real API server, at
    /// these sizes (SERVICESxENDPOINTS, comma-separated): the same as `--h2h-sizes SIZES`
    /// with every other part skipped.
    #[arg(long, value_name = "SIZES")]
    pub head_to_head: Option<String>,
    /// Only the sizing table (what `run` needs at each size, and the DaemonSet's memory request
    /// and limit derived from it; docs/install.md#sizing), at these sizes: the same as
    /// `--sizing-sizes SIZES` with every other part skipped.
    #[arg(long, value_name = "SIZES")]
    pub sizing: Option<String>,
    /// The sizing table's sizes, SERVICESxENDPOINTS, comma-separated (empty for none).
    #[arg(long, value_delimiter = ',', default_value = "1000x10,10000x10,50000x10,100000x10")]
    pub sizing_sizes: Vec<String>,
    /// Skip the head-to-head.
    #[arg(long)]
    pub no_head_to_head: bool,
    /// Head to head: sizes, SERVICESxENDPOINTS, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1000x10,10000x10,44000x1")]
    pub h2h_sizes: Vec<String>,
    /// Head to head: the proxies, in the order they run.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "nftproxy,kube-proxy-nftables,kube-proxy-iptables")]
    pub h2h_proxies: Vec<H2hProxy>,
    /// Head to head: runs of each proxy at each size (the figures are the medians of the quiet
    /// ones, with their spread; churn runs in the first). `--quick`: one.
    #[arg(long, default_value_t = 3)]
    pub h2h_runs: usize,
    /// Head to head: single changes of each kind (endpoint replaced, Service added) per proxy.
    #[arg(long, default_value_t = 5)]
    pub h2h_changes: usize,
    /// Head to head: the sizes with a churn run (empty for none).
    #[arg(long, value_delimiter = ',', default_value = "10000x10")]
    pub h2h_churn_sizes: Vec<String>,
    /// Head to head: churn endpoint updates per second, and for how long.
    #[arg(long, default_value_t = 100)]
    pub h2h_churn_rate: u32,
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub h2h_churn_duration: Duration,
    /// Head to head: the quiet window of the idle CPU figure.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub h2h_idle: Duration,
    /// Head to head: the longest wait for a proxy's first sync.
    #[arg(long, default_value = "30m", value_parser = humantime::parse_duration)]
    pub h2h_first_sync_timeout: Duration,
    /// Cluster sizes, SERVICESxENDPOINTS, comma-separated; empty (`--sizes ''`) for none.
    #[arg(long, value_delimiter = ',', default_value = "1000x10,10000x10,5000x50,44000x1")]
    pub sizes: Vec<String>,
    /// One-change syncs measured per size (a quarter each: endpoint added, endpoint removed,
    /// service added, service removed).
    #[arg(long, default_value_t = 60)]
    pub changes: usize,
    /// Endpoint changes coalesced into the burst sync.
    #[arg(long, default_value_t = 1000)]
    pub burst: usize,
    /// Incremental `nft -f` updates measured on the upstream-shaped ruleset.
    #[arg(long, default_value_t = 8)]
    pub upstream_changes: usize,
    /// Stop waiting for an anchor's `nft -f` after this long (the table says so).
    #[arg(long, default_value = "150s", value_parser = humantime::parse_duration)]
    pub anchor_cap: Duration,
    /// Skip the `nft -f` anchors.
    #[arg(long)]
    pub no_anchors: bool,
    /// Data plane: numbers of other services, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10,1000,10000")]
    pub dataplane: Vec<usize>,
    /// Skip the data-plane measurement.
    #[arg(long)]
    pub no_dataplane: bool,
    /// Data plane: interleaved rounds per ruleset (10 complete the balanced Latin square of
    /// the five rulesets: each runs in every position and after every other equally often).
    #[arg(long, default_value_t = 10)]
    pub rounds: usize,
    /// Data plane: length of one trial.
    #[arg(long, default_value = "1500ms", value_parser = humantime::parse_duration)]
    pub trial: Duration,
    /// Data plane: the rulesets compared, comma-separated (each round interleaves them).
    #[arg(long, value_delimiter = ',', default_value = "none,single-dnat,iptables,kube-proxy-nftables,nftproxy")]
    pub rulesets: Vec<dataplane::Ruleset>,
    /// Data plane: pause between loading a ruleset and its trial.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub settle: Duration,
    /// Skip the end-to-end measurements of the `nftproxy` binary.
    #[arg(long)]
    pub no_e2e: bool,
    /// End to end: the parts measured, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "render,manifests,changes,idle,restart,moonshot")]
    pub e2e_phases: Vec<e2e::Phase>,
    /// End to end: the size `run` starts at (API and manifests) and `render` reads.
    #[arg(long, default_value = "10000x10")]
    pub e2e_size: String,
    /// End to end: sizes of the single changes through the API watch, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "10000x10,44000x1")]
    pub change_sizes: Vec<String>,
    /// End to end: single changes per size (spread over six kinds).
    #[arg(long, default_value_t = 48)]
    pub e2e_changes: usize,
    /// End to end: the idle measurement's size and window.
    #[arg(long, default_value = "44000x1")]
    pub idle_size: String,
    #[arg(long, default_value = "90s", value_parser = humantime::parse_duration)]
    pub idle_window: Duration,
    /// End to end: the size rendered from one `kind: List` (and from documents).
    #[arg(long, default_value = "20000x10")]
    pub list_size: String,
    /// End to end: the size of the cold `sync` and the restart after it.
    #[arg(long, default_value = "5000x50")]
    pub restart_size: String,
    /// End to end: the largest cold `sync` tried (empty for none).
    #[arg(long, default_value = "100000x10")]
    pub moonshot: String,
    /// Skip the churn benchmark.
    #[arg(long)]
    pub no_churn: bool,
    /// Churn: the cluster, the endpoint updates per second and how long.
    #[arg(long, default_value = "10000x10")]
    pub churn_size: String,
    #[arg(long, default_value_t = 100)]
    pub churn_rate: u32,
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub churn_duration: Duration,
    /// Churn: where its plot (SVG) goes (default: beside the results file).
    #[arg(long)]
    pub churn_plot: Option<PathBuf>,
    /// Where the results file (`DATE[-HHMM].md`) and its plots go. Default: the source tree's
    /// `docs/performance/results` for a full run; a directory under the system's temporary
    /// directory with `--quick` (unless `--record`).
    #[arg(long, value_name = "DIR")]
    pub results: Option<PathBuf>,
    /// With `--quick`: write the results file into `docs/performance/results` all the same.
    #[arg(long)]
    pub record: bool,
    /// A note for the results file (e.g. what else ran on the machine).
    #[arg(long)]
    pub note: Option<String>,
}

/// A proxy of the head-to-head (`--h2h-proxies`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum H2hProxy {
    Nftproxy,
    KubeProxyNftables,
    KubeProxyIptables,
}

impl From<H2hProxy> for proxies::Proxy {
    fn from(p: H2hProxy) -> proxies::Proxy {
        match p {
            H2hProxy::Nftproxy => proxies::Proxy::Nftproxy,
            H2hProxy::KubeProxyNftables => proxies::Proxy::KubeProxyNftables,
            H2hProxy::KubeProxyIptables => proxies::Proxy::KubeProxyIptables,
        }
    }
}

impl BenchArgs {
    /// `--quick` overrides (what CI can afford in about three minutes), and `--head-to-head`'s.
    fn effective(&self) -> BenchArgs {
        if let Some(sizes) = &self.sizing {
            let mut only = if self.quick { self.quick_parts() } else { self.clone() };
            only.sizing = None;
            only.sizing_sizes = sizes.split(',').map(|s| s.trim().to_string()).collect();
            only.no_head_to_head = true;
            only.no_e2e = true;
            only.no_churn = true;
            only.sizes = Vec::new();
            only.no_dataplane = true;
            return only;
        }
        if let Some(sizes) = &self.head_to_head {
            let mut only = if self.quick { self.quick_parts() } else { self.clone() };
            only.head_to_head = None;
            only.h2h_sizes = sizes.split(',').map(|s| s.trim().to_string()).collect();
            only.no_head_to_head = false;
            only.sizing_sizes = Vec::new();
            only.no_e2e = true;
            only.no_churn = true;
            only.sizes = Vec::new();
            only.no_dataplane = true;
            return only;
        }
        if !self.quick {
            return self.clone();
        }
        self.quick_parts()
    }

    fn quick_parts(&self) -> BenchArgs {
        BenchArgs {
            quick: true,
            head_to_head: None,
            sizing: None,
            sizing_sizes: vec!["1000x10".into()],
            no_head_to_head: self.no_head_to_head,
            h2h_sizes: vec!["200x10".into()],
            h2h_proxies: self.h2h_proxies.clone(),
            h2h_runs: 1,
            h2h_changes: 1,
            h2h_churn_sizes: vec!["200x10".into()],
            h2h_churn_rate: 20,
            h2h_churn_duration: Duration::from_secs(10),
            h2h_idle: Duration::from_secs(2),
            h2h_first_sync_timeout: Duration::from_secs(120),
            sizes: vec!["1000x10".into()],
            changes: 12,
            burst: 100,
            upstream_changes: 2,
            anchor_cap: Duration::from_secs(60),
            no_anchors: self.no_anchors,
            dataplane: vec![10],
            no_dataplane: self.no_dataplane,
            rounds: 1,
            trial: Duration::from_millis(300),
            rulesets: self.rulesets.clone(),
            settle: Duration::ZERO,
            no_e2e: self.no_e2e,
            e2e_phases: self.e2e_phases.clone(),
            e2e_size: "1000x10".into(),
            change_sizes: vec!["1000x10".into()],
            e2e_changes: 6,
            idle_size: "1000x10".into(),
            idle_window: Duration::from_secs(5),
            list_size: "2000x10".into(),
            restart_size: "500x10".into(),
            moonshot: String::new(),
            no_churn: self.no_churn,
            churn_size: "1000x10".into(),
            churn_rate: 20,
            churn_duration: Duration::from_secs(30),
            churn_plot: self.churn_plot.clone(),
            results: self.results.clone(),
            record: self.record,
            note: self.note.clone(),
        }
    }

    fn head_to_head_plan(&self) -> Result<head_to_head::Plan, BenchError> {
        let sizes = |v: &[String]| -> Result<Vec<Size>, BenchError> {
            v.iter().filter(|s| !s.trim().is_empty()).map(|s| parse_size(s)).collect()
        };
        Ok(head_to_head::Plan {
            sizes: sizes(&self.h2h_sizes)?,
            proxies: self.h2h_proxies.iter().map(|p| (*p).into()).collect(),
            changes: self.h2h_changes.min(200),
            churn_sizes: sizes(&self.h2h_churn_sizes)?,
            churn_rate: self.h2h_churn_rate,
            churn_duration: self.h2h_churn_duration,
            idle: self.h2h_idle,
            first_sync_timeout: self.h2h_first_sync_timeout,
            settle: if self.quick { Duration::from_secs(1) } else { Duration::from_secs(3) },
            runs: if self.quick { 1 } else { self.h2h_runs.clamp(1, 20) },
        })
    }

    fn e2e_plan(&self) -> Result<e2e::Plan, BenchError> {
        Ok(e2e::Plan {
            phases: self.e2e_phases.clone(),
            start: parse_size(&self.e2e_size)?,
            changes: self
                .change_sizes
                .iter()
                .filter(|s| !s.trim().is_empty())
                .map(|s| parse_size(s))
                .collect::<Result<_, _>>()?,
            change_count: self.e2e_changes,
            idle: parse_size(&self.idle_size)?,
            idle_window: self.idle_window,
            list: parse_size(&self.list_size)?,
            restart: parse_size(&self.restart_size)?,
            moonshot: if self.moonshot.trim().is_empty() { None } else { Some(parse_size(&self.moonshot)?) },
        })
    }

    fn churn_plan(&self, record: &Record) -> Result<churn::ChurnPlan, BenchError> {
        let size = parse_size(&self.churn_size)?;
        let plot = self
            .churn_plot
            .clone()
            .unwrap_or_else(|| record.file(&format!("churn-{}x{}.svg", size.services, size.endpoints)));
        Ok(churn::ChurnPlan {
            size,
            rate: self.churn_rate,
            duration: self.churn_duration,
            plot_link: record.link(&plot),
            plot,
        })
    }
}

/// Everything measured at one size.
#[derive(Debug, Default)]
struct SizeResult {
    cold: WorkerReport,
    restart: WorkerReport,
    /// nftproxy's `render` output applied with `nft -f`.
    own_nft: Option<WorkerReport>,
    /// The upstream-shaped ruleset applied with `nft -f`.
    upstream_nft: Option<WorkerReport>,
    /// Incremental `nft -f` updates of the upstream-shaped ruleset.
    upstream_changes: Vec<Duration>,
}

/// Runs the benchmark, prints its tables and writes them, with its plots, to a dated results
/// file (also when a part fails: what was measured is kept, with the error).
pub fn run(args: &BenchArgs) -> Result<(), BenchError> {
    crate::lab::require_privileges()?;
    crate::lab::cleanup_stale();
    stop_children_on_signal();
    let args = args.effective();
    let record = Record::new(args.results.as_deref(), args.quick && !args.record)?;
    let mut report = Report::default();
    report.add(&record.header(args.note.as_deref()));
    let result = run_parts(&args, &record, &mut report);
    if let Err(e) = &result {
        report.add(&format!("\n**The run stopped with an error**: {e}\n"));
    }
    let path = record.results();
    std::fs::write(&path, report.text())?;
    eprintln!("bench: results written to {}", path.display());
    result
}

fn run_parts(args: &BenchArgs, record: &Record, report: &mut Report) -> Result<(), BenchError> {
    let sizes =
        args.sizes.iter().filter(|s| !s.trim().is_empty()).map(|s| parse_size(s)).collect::<Result<Vec<_>, _>>()?;
    let scratch = Scratch::new()?;
    if !args.no_e2e {
        let files = e2e::Files::new(&scratch.0.join("manifests"))?;
        let e2e = e2e::run(&args.e2e_plan()?, &files)?;
        report.add(&e2e::tables(&e2e));
    }
    let sizing_sizes = args
        .sizing_sizes
        .iter()
        .filter(|s| !s.trim().is_empty())
        .map(|s| parse_size(s))
        .collect::<Result<Vec<_>, _>>()?;
    if !sizing_sizes.is_empty() {
        let files = e2e::Files::new(&scratch.0.join("manifests"))?;
        report.add(&sizing::table(&sizing::run(&sizing_sizes, &files)?));
    }
    if !args.no_churn {
        let plan = args.churn_plan(record)?;
        eprintln!(
            "bench: churn at {}, {} updates/s for {}",
            plan.size,
            plan.rate,
            humantime::format_duration(plan.duration)
        );
        let churn = churn::run(&plan)?;
        report.add(&churn::tables(&churn));
        if args.quick && (churn.probe_failed > 0 || churn.unprogrammed > 0 || churn.probe_ok == 0) {
            return Err(BenchError::Worker(format!(
                "churn: {} probe failures, {} events not programmed, {} probe connections",
                churn.probe_failed, churn.unprogrammed, churn.probe_ok
            )));
        }
    }
    let mut results = Vec::new();
    for &size in &sizes {
        eprintln!("bench: {size}");
        let result = measure_size(args, size, &scratch)?;
        report.add(&size_table(size, &result, args));
        results.push((size, result));
    }
    if !results.is_empty() {
        report.add(&summary_table(&results, args));
    }
    let mut rows = Vec::new();
    if !args.no_dataplane {
        let mut windows = Vec::new();
        for &services in &args.dataplane {
            eprintln!("bench: data plane at {services} services");
            // The data-plane lab's own node and cluster CIDR (its client counts as a pod on
            // another node, so no ruleset masquerades).
            let iptables = |state: &ClusterState, last: &nftproxy::model::NamespacedName| {
                upstream::iptables_restore(state, dataplane::NODE, dataplane::CLUSTER_CIDR, last)
            };
            let kube_proxy = |lab: &mut crate::lab::Lab, state: &ClusterState| {
                head_to_head::kube_proxy_ruleset(
                    lab,
                    dataplane::NODE,
                    state,
                    dataplane::SERVICE_CIDR,
                    dataplane::CLUSTER_CIDR,
                )
                .map_err(|e| e.to_string())
            };
            let (compared, window) = load::watch(&format!("data plane, {services} services"), || {
                dataplane::compare(
                    services,
                    &dataplane::Sources { iptables: &iptables, kube_proxy_nftables: &kube_proxy },
                    &dataplane::Trials {
                        rulesets: &args.rulesets,
                        rounds: args.rounds,
                        trial: args.trial,
                        settle: args.settle,
                    },
                )
            });
            rows.extend(compared?);
            windows.push(window);
        }
        report.add(&dataplane_table(&rows));
        report.add(&format!("\nThe machine around the data-plane trials:\n\n{}", load::table(&windows)));
        if args.quick {
            for row in &rows {
                if row.connections == 0 || row.failures > 0 {
                    return Err(BenchError::Worker(format!(
                        "data plane {:?} at {} services: {} connections, {} failures",
                        row.ruleset, row.services, row.connections, row.failures
                    )));
                }
            }
        }
    }
    if !args.no_head_to_head {
        let plan = args.head_to_head_plan()?;
        if !plan.sizes.is_empty() && !plan.proxies.is_empty() {
            let results = head_to_head::run(&plan, record, report)?;
            report.add(&head_to_head::headline(&results, &plan, &rows));
            if args.quick {
                head_to_head::check(&results)?;
            }
        }
    }
    Ok(())
}

/// On Ctrl-C, SIGTERM or SIGHUP a run of hours must not leave its control plane, proxies and
/// namespaces behind (drop handlers do not run on a signal): this kills, by PID, the processes
/// this one started (`ip netns exec` runs each as this process's child) and the process groups
/// they lead, deletes its lab namespaces, and exits.
fn stop_children_on_signal() {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    // SIGHUP too: the proxies lead process groups of their own, so a terminal that hangs up no
    // longer reaches them.
    let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGHUP, SIGINT, SIGTERM]) else { return };
    std::thread::spawn(move || {
        let Some(signal) = signals.forever().next() else { return };
        let me = std::process::id();
        let children = std::fs::read_dir("/proc").into_iter().flatten().flatten().filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let ppid: u32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
            (ppid == me).then_some(pid)
        });
        for pid in children.collect::<Vec<_>>() {
            let pid = nix::unistd::Pid::from_raw(pid);
            // The proxies lead process groups of their own, with their children in them.
            let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        let listed = Command::new("ip").args(["netns", "list"]).output();
        let mine = format!("-{me}-");
        for line in listed.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default().lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            if name.starts_with("nftp-") && name.contains(&mine) {
                let _ = Command::new("ip").args(["netns", "delete", name]).output();
            }
        }
        eprintln!("bench: interrupted; the processes it started and its namespaces were removed");
        std::process::exit(128 + signal);
    });
}

/// Parses `SERVICESxENDPOINTS` (e.g. `10000x10`).
pub fn parse_size(s: &str) -> Result<Size, BenchError> {
    let (a, b) = s.split_once(['x', '×']).ok_or_else(|| BenchError::Size(s.into()))?;
    let services = a.trim().parse().map_err(|_| BenchError::Size(s.into()))?;
    let endpoints = b.trim().parse().map_err(|_| BenchError::Size(s.into()))?;
    if services == 0 || endpoints == 0 || endpoints > 56 {
        return Err(BenchError::Size(s.into()));
    }
    Ok(Size { services, endpoints })
}

fn measure_size(args: &BenchArgs, size: Size, scratch: &Scratch) -> Result<SizeResult, BenchError> {
    let mut result = SizeResult::default();
    {
        let ns = Netns::create("bench")?;
        result.cold = spawn_worker(&ns, Phase::Cold, size, args, None)?;
        result.restart = spawn_worker(&ns, Phase::Restart, size, args, None)?;
    }
    if args.no_anchors {
        return Ok(result);
    }
    let state = cluster::state(size);
    let own = scratch.write("own.nft", &render_own(&state))?;
    {
        let ns = Netns::create("bench")?;
        result.own_nft = Some(spawn_worker(&ns, Phase::NftFile, size, args, Some(&own))?);
    }
    let upstream_file = scratch.write("upstream.nft", &upstream::nft_ruleset(&state, NODE, CLUSTER_CIDR))?;
    let ns = Netns::create("bench")?;
    let report = spawn_worker(&ns, Phase::NftFile, size, args, Some(&upstream_file))?;
    let loaded = report.nft_file.is_some();
    result.upstream_nft = Some(report);
    if loaded {
        result.upstream_changes = upstream_changes(&ns, &state, size, args, scratch)?;
    }
    Ok(result)
}

/// The same one-endpoint changes the workers make, applied to the upstream-shaped ruleset as
/// kube-proxy would send them, each with `nft -f`.
fn upstream_changes(
    ns: &Netns,
    state: &ClusterState,
    size: Size,
    args: &BenchArgs,
    scratch: &Scratch,
) -> Result<Vec<Duration>, BenchError> {
    let mut before = state.clone();
    let mut times = Vec::new();
    for n in 0..args.upstream_changes {
        let i = (n / 2 * 7919 + 1) % size.services;
        let endpoints = if n % 2 == 0 { size.endpoints + 1 } else { size.endpoints };
        let mut after = before.clone();
        let changed = cluster::service(i).name;
        after.upsert_slice(cluster::slice(i, endpoints, 0));
        let file = scratch
            .write("update.nft", &upstream::nft_service_update(&before, &after, &changed, NODE, CLUSTER_CIDR))?;
        let started = Instant::now();
        let out = ns.command("nft").arg("-f").arg(&file).output()?;
        if !out.status.success() {
            return Err(BenchError::Tool(
                "nft -f (upstream update)".into(),
                String::from_utf8_lossy(&out.stderr).into(),
            ));
        }
        times.push(started.elapsed());
        before = after;
    }
    Ok(times)
}

fn render_own(state: &ClusterState) -> String {
    let config = worker::config();
    nftproxy::oneshot::render(&config, state)
}

fn spawn_worker(
    ns: &Netns,
    phase: Phase,
    size: Size,
    args: &BenchArgs,
    file: Option<&Path>,
) -> Result<WorkerReport, BenchError> {
    let exe = std::env::current_exe()?;
    let phase_name = match phase {
        Phase::Cold => "cold",
        Phase::Restart => "restart",
        Phase::NftFile => "nft-file",
        Phase::Measure => "measure",
    };
    let mut cmd = ns.command(&exe.to_string_lossy());
    cmd.args(["bench-worker", "--phase", phase_name])
        .args(["--services", &size.services.to_string(), "--endpoints", &size.endpoints.to_string()])
        .args(["--changes", &args.changes.to_string(), "--burst", &args.burst.to_string()])
        .args(["--cap", &humantime::format_duration(args.anchor_cap).to_string()])
        .env("RUST_LOG", "warn");
    if let Some(file) = file {
        cmd.arg("--file").arg(file);
    }
    let out = cmd.output()?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(BenchError::Worker(format!("{phase_name} at {size}: {}", stderr.trim())));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line)
        .map_err(|e| BenchError::Worker(format!("{phase_name} at {size}: unreadable report: {e}")))
}

/// A directory for the generated nft files, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Scratch, BenchError> {
        let dir = std::env::temp_dir().join(format!("nftproxy-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Scratch(dir))
    }

    fn write(&self, name: &str, text: &str) -> Result<PathBuf, BenchError> {
        let path = self.0.join(name);
        std::fs::write(&path, text)?;
        Ok(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn anchor(report: &Option<WorkerReport>, cap: Duration) -> String {
    match report {
        None => "skipped".into(),
        Some(WorkerReport { nft_file: Some(t), .. }) => ms(*t),
        Some(_) => format!("> {} (stopped)", ms(cap)),
    }
}

/// The detailed table of one size.
fn size_table(size: Size, r: &SizeResult, args: &BenchArgs) -> String {
    let mut out = String::new();
    let cold = r.cold.sync.unwrap_or_default();
    let restart = r.restart.sync.unwrap_or_default();
    let _ = writeln!(out, "\n### {size} ({} endpoints)\n", size.services * size.endpoints);
    let _ = writeln!(out, "| measurement | wall | ours (plan+diff+encode) | kernel | messages |");
    let _ = writeln!(out, "|---|---:|---:|---:|---:|");
    let own_part = |f: &SyncFigures| ms(f.total.saturating_sub(f.kernel));
    let _ = writeln!(
        out,
        "| cold full sync | {} | {} | {} | {} |",
        ms(cold.total),
        own_part(&cold),
        ms(cold.kernel),
        cold.messages
    );
    let _ = writeln!(
        out,
        "| restart sync (read back {}) | {} | {} | {} | {} |",
        ms(restart.read),
        ms(restart.total),
        own_part(&restart),
        ms(restart.kernel),
        restart.messages
    );
    for (label, kinds) in [
        (
            "one change, all kinds",
            &[
                ChangeKind::EndpointAdded,
                ChangeKind::EndpointRemoved,
                ChangeKind::ServiceAdded,
                ChangeKind::ServiceRemoved,
            ][..],
        ),
        ("one endpoint added/removed", &[ChangeKind::EndpointAdded, ChangeKind::EndpointRemoved][..]),
        ("one service added/removed", &[ChangeKind::ServiceAdded, ChangeKind::ServiceRemoved][..]),
    ] {
        let picked: Vec<&SyncFigures> =
            r.restart.changes.iter().filter(|(k, _)| kinds.contains(k)).map(|(_, f)| f).collect();
        if picked.is_empty() {
            continue;
        }
        let totals: Vec<Duration> = picked.iter().map(|f| f.total).collect();
        let kernels: Vec<Duration> = picked.iter().map(|f| f.kernel).collect();
        let msgs: Vec<usize> = picked.iter().map(|f| f.messages).collect();
        let _ = writeln!(
            out,
            "| {label} ×{}: median / p99 | {} / {} | | {} / {} | {}–{} |",
            picked.len(),
            ms(quantile(&totals, 0.5)),
            ms(quantile(&totals, 0.99)),
            ms(quantile(&kernels, 0.5)),
            ms(quantile(&kernels, 0.99)),
            msgs.iter().min().unwrap_or(&0),
            msgs.iter().max().unwrap_or(&0)
        );
    }
    if let Some((n, b)) = &r.restart.burst {
        let _ = writeln!(
            out,
            "| burst of {n} endpoint changes, one sync | {} | {} | {} | {} |",
            ms(b.total),
            own_part(b),
            ms(b.kernel),
            b.messages
        );
    }
    let _ = writeln!(
        out,
        "| peak RSS (cold / restart+changes) | {} / {} | | | |",
        mib(r.cold.peak_rss),
        mib(r.restart.peak_rss)
    );
    if !args.no_anchors {
        let rss = |r: &Option<WorkerReport>| r.as_ref().map_or("-".into(), |w| mib(w.peak_rss));
        let _ = writeln!(
            out,
            "| anchor: our `render` with `nft -f` | {} | | | nft peak RSS {} |",
            anchor(&r.own_nft, args.anchor_cap),
            rss(&r.own_nft)
        );
        let _ = writeln!(
            out,
            "| anchor: upstream-shaped (kube-proxy 1.33) with `nft -f` | {} | | | nft peak RSS {} |",
            anchor(&r.upstream_nft, args.anchor_cap),
            rss(&r.upstream_nft)
        );
        if !r.upstream_changes.is_empty() {
            let _ = writeln!(
                out,
                "| upstream-shaped one endpoint change with `nft -f` ×{}: median / max | {} / {} | | | |",
                r.upstream_changes.len(),
                ms(quantile(&r.upstream_changes, 0.5)),
                ms(quantile(&r.upstream_changes, 1.0))
            );
        }
    }
    out
}

/// One row per size: the figures the targets are about, with ratios measured in this run.
fn summary_table(results: &[(Size, SizeResult)], args: &BenchArgs) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n### Summary\n");
    let _ = writeln!(
        out,
        "| size | cold sync | upstream `nft -f` | × faster | our render `nft -f` | × faster | restart | endpoint change p50 / p99 | burst | peak RSS |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (size, r) in results {
        let cold = r.cold.sync.unwrap_or_default().total;
        let ratio = |report: &Option<WorkerReport>| match report {
            Some(WorkerReport { nft_file: Some(t), .. }) => {
                format!("{:.1}×", t.as_secs_f64() / cold.as_secs_f64().max(1e-9))
            }
            Some(_) => format!("> {:.0}×", args.anchor_cap.as_secs_f64() / cold.as_secs_f64().max(1e-9)),
            None => "-".into(),
        };
        let endpoint: Vec<Duration> = r
            .restart
            .changes
            .iter()
            .filter(|(k, _)| matches!(k, ChangeKind::EndpointAdded | ChangeKind::EndpointRemoved))
            .map(|(_, f)| f.total)
            .collect();
        let _ = writeln!(
            out,
            "| {size} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} |",
            ms(cold),
            anchor(&r.upstream_nft, args.anchor_cap),
            ratio(&r.upstream_nft),
            anchor(&r.own_nft, args.anchor_cap),
            ratio(&r.own_nft),
            ms(r.restart.sync.unwrap_or_default().total),
            ms(quantile(&endpoint, 0.5)),
            ms(quantile(&endpoint, 0.99)),
            r.restart.burst.map_or("-".into(), |(_, b)| ms(b.total)),
            mib(r.cold.peak_rss.max(r.restart.peak_rss))
        );
    }
    out
}

fn dataplane_table(rows: &[dataplane::ConnStats]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n### Data plane: new TCP connections through one ClusterIP\n");
    let _ = writeln!(
        out,
        "| other services | ruleset | conn/s | connect p50 | connect p99 | conn/s vs single DNAT, median of rounds | p99 vs single DNAT, median of rounds | connections | failures |"
    );
    let _ = writeln!(out, "|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    let percent = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:+.1}%"));
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.0} µs | {:.0} µs | {} | {} | {} | {} |",
            r.services,
            r.ruleset,
            r.per_second,
            r.p50.as_secs_f64() * 1e6,
            r.p99.as_secs_f64() * 1e6,
            percent(r.rate_vs_floor),
            percent(r.p99_vs_floor),
            r.connections,
            r.failures
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("10000x10").unwrap(), Size { services: 10000, endpoints: 10 });
        assert_eq!(parse_size("44000×1").unwrap(), Size { services: 44000, endpoints: 1 });
        assert!(parse_size("10000").is_err());
        assert!(parse_size("0x10").is_err());
        assert!(parse_size("10x100").is_err());
    }
}
