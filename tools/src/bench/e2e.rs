//! The end-to-end benchmark: the `nftproxy` binary a user runs, source included, measured from
//! outside. `run` reads the synthetic cluster through the Kubernetes watch (the test API server)
//! or from manifests; `render` and `sync` read manifests. Each figure comes from the process
//! itself: its JSON log (every `synced` line is a commit), `/proc` (CPU time, resident and peak
//! memory) and the wall clock.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use super::agent::{Agent, Commit, Cost, file_size, measure};
use super::error::BenchError;
use super::figures::{mib, ms, quantile};
use crate::apiserver::FakeApi;
use crate::cluster::{self, CLUSTER_CIDR, Size};
use crate::lab::Netns;

/// The flags every `nftproxy` command of this benchmark gets.
fn proxy_flags() -> Vec<String> {
    ["--hostname-override", "node1", "--cluster-cidr", CLUSTER_CIDR].iter().map(|s| s.to_string()).collect()
}

/// The flags of a benchmark `run` (its servers stay inside the benchmark namespace; conntrack's
/// global sysctls are left alone).
pub(super) fn run_flags() -> Vec<String> {
    let mut flags = proxy_flags();
    flags.extend(["--conntrack-max-per-core", "0"].iter().map(|s| s.to_string()));
    flags
}

/// A part of the end-to-end benchmark (`--e2e-phases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Phase {
    /// `render` of documents and of one List.
    Render,
    /// `run --manifests` start-up.
    Manifests,
    /// `run` through the API watch: start-up and single changes.
    Changes,
    /// An idle agent's CPU.
    Idle,
    /// A cold `sync`, then a restart over its ruleset.
    Restart,
    /// The moonshot's cold `sync`.
    Moonshot,
}

/// What the end-to-end benchmark measures, and at which sizes.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The parts measured.
    pub phases: Vec<Phase>,
    /// `run` start-up (API and manifests) and `render`.
    pub start: Size,
    /// Single changes through the API watch.
    pub changes: Vec<Size>,
    /// Changes per size (spread over the kinds).
    pub change_count: usize,
    /// The idle measurement: size and window.
    pub idle: Size,
    pub idle_window: Duration,
    /// A `kind: List` rendered, and the same cluster as documents.
    pub list: Size,
    /// `sync` cold, then a new process over the ruleset (a restart).
    pub restart: Size,
    /// The largest cold `sync` tried.
    pub moonshot: Option<Size>,
}

/// A `run` start-up.
#[derive(Debug, Clone)]
pub struct Startup {
    pub source: &'static str,
    pub size: Size,
    /// Manifests file size (manifests source).
    pub file: Option<u64>,
    /// From "the first lists have arrived" to the end of the first sync.
    pub after_listed: Duration,
    /// From process start to the end of the first sync.
    pub total: Duration,
    /// The first sync itself (planning to commit).
    pub sync: Duration,
    pub peak_rss: u64,
}

/// One kind of single change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    EndpointAdded,
    EndpointRemoved,
    ServiceAdded,
    ServiceRemoved,
    AffinityEndpointAdded,
    AffinityEndpointRemoved,
}

impl ChangeKind {
    const ALL: [ChangeKind; 6] = [
        ChangeKind::EndpointAdded,
        ChangeKind::EndpointRemoved,
        ChangeKind::ServiceAdded,
        ChangeKind::ServiceRemoved,
        ChangeKind::AffinityEndpointAdded,
        ChangeKind::AffinityEndpointRemoved,
    ];

    fn label(self) -> &'static str {
        match self {
            ChangeKind::EndpointAdded => "endpoint added",
            ChangeKind::EndpointRemoved => "endpoint removed",
            ChangeKind::ServiceAdded => "service added",
            ChangeKind::ServiceRemoved => "service removed",
            ChangeKind::AffinityEndpointAdded => "affinity endpoint added",
            ChangeKind::AffinityEndpointRemoved => "affinity endpoint removed",
        }
    }
}

/// One single change: its kind, API event → commit, the sync's own duration and the kernel's
/// share of it.
#[derive(Debug, Clone, Copy)]
pub struct ChangeSample {
    pub kind: ChangeKind,
    pub latency: Duration,
    pub sync: Duration,
    pub kernel: Duration,
}

/// Single changes at one size.
#[derive(Debug, Clone, Default)]
pub struct Changes {
    pub size: Option<Size>,
    pub samples: Vec<ChangeSample>,
}

/// CPU of an idle agent.
#[derive(Debug, Clone, Copy)]
pub struct Idle {
    pub size: Size,
    pub window: Duration,
    pub cpu: Duration,
    /// Syncs in the window, and how many read the tables back.
    pub syncs: usize,
    pub read_backs: usize,
    pub rss: u64,
}

/// A command measured to completion.
#[derive(Debug, Clone)]
pub struct Measured {
    pub what: String,
    pub size: Size,
    pub file: Option<u64>,
    pub cost: Result<Cost, String>,
}

/// Everything the end-to-end benchmark found.
#[derive(Debug, Default)]
pub struct Results {
    pub startups: Vec<Startup>,
    pub renders: Vec<Measured>,
    pub changes: Vec<Changes>,
    pub idle: Option<Idle>,
    pub syncs: Vec<Measured>,
}

/// Manifest files of the synthetic cluster, written once per size and kind.
pub struct Files {
    dir: PathBuf,
}

impl Files {
    pub fn new(dir: &Path) -> Result<Files, BenchError> {
        std::fs::create_dir_all(dir)?;
        Ok(Files { dir: dir.to_path_buf() })
    }

    /// The cluster of `size` as manifests (a `kind: List` when `list`).
    pub fn manifests(&self, size: Size, list: bool) -> Result<PathBuf, BenchError> {
        let kind = if list { "list" } else { "docs" };
        let path = self.dir.join(format!("cluster-{}x{}-{kind}.yaml", size.services, size.endpoints));
        if !path.exists() {
            let mut w = std::io::BufWriter::new(std::fs::File::create(&path)?);
            if list {
                cluster::write_list_yaml(size, &mut w)?;
            } else {
                cluster::write_yaml(size, &mut w)?;
            }
            std::io::Write::flush(&mut w)?;
        }
        Ok(path)
    }
}

fn progress(what: &str) {
    eprintln!("bench: {what}");
}

/// Runs every end-to-end measurement of `plan`.
pub fn run(plan: &Plan, files: &Files) -> Result<Results, BenchError> {
    let mut results = Results::default();
    let wanted = |p: Phase| plan.phases.contains(&p);

    if wanted(Phase::Render) {
        progress(&format!("end to end: render of {} ({} manifests)", plan.start, "documents"));
        results.renders.push(render(plan.start, files, false)?);
        progress(&format!("end to end: render of {} as documents and as one List", plan.list));
        results.renders.push(render(plan.list, files, false)?);
        results.renders.push(render(plan.list, files, true)?);
    }
    if wanted(Phase::Manifests) {
        progress(&format!("end to end: run --manifests at {}", plan.start));
        results.startups.push(run_manifests(plan.start, files)?);
    }

    let change_sizes = if wanted(Phase::Changes) { plan.changes.as_slice() } else { &[] };
    for &size in change_sizes {
        progress(&format!("end to end: run through the API watch at {size}, then single changes"));
        let ns = Netns::create("e2e")?;
        let api = api_server(&ns, size, plan.change_count)?;
        let (startup, mut agent) = run_api(&ns, &api, size)?;
        results.startups.push(startup);
        results.changes.push(single_changes(&mut agent, &api, size, plan.change_count)?);
        if size == plan.idle && wanted(Phase::Idle) {
            progress(&format!("end to end: idle at {size} for {}", humantime::format_duration(plan.idle_window)));
            results.idle = Some(idle(&mut agent, size, plan.idle_window));
        }
        agent.stop();
    }
    if results.idle.is_none() && wanted(Phase::Idle) {
        progress(&format!("end to end: idle at {} for {}", plan.idle, humantime::format_duration(plan.idle_window)));
        let ns = Netns::create("e2e")?;
        let api = api_server(&ns, plan.idle, 0)?;
        let (_, mut agent) = run_api(&ns, &api, plan.idle)?;
        results.idle = Some(idle(&mut agent, plan.idle, plan.idle_window));
        agent.stop();
    }

    if wanted(Phase::Restart) {
        progress(&format!("end to end: sync at {}, then a restart over its ruleset", plan.restart));
        let ns = Netns::create("e2e")?;
        let path = files.manifests(plan.restart, false)?;
        results.syncs.push(sync(&ns, "sync, cold", plan.restart, &path));
        results.syncs.push(sync(&ns, "sync, restart (read back)", plan.restart, &path));
    }
    if let Some(size) = plan.moonshot.filter(|_| wanted(Phase::Moonshot)) {
        progress(&format!("end to end: moonshot, a cold sync at {size}"));
        let ns = Netns::create("e2e")?;
        let path = files.manifests(size, false)?;
        results.syncs.push(sync(&ns, "sync, cold (moonshot)", size, &path));
    }
    Ok(results)
}

fn render(size: Size, files: &Files, list: bool) -> Result<Measured, BenchError> {
    let path = files.manifests(size, list)?;
    let ns = Netns::create("e2e")?;
    let mut args = vec!["render".to_string(), "--manifests".into(), path.display().to_string()];
    args.extend(proxy_flags());
    let what = if list { "render, one List" } else { "render, documents" };
    Ok(Measured {
        what: what.into(),
        size,
        file: Some(file_size(&path)),
        cost: measure(&ns, &args).map_err(|e| e.to_string()),
    })
}

fn sync(ns: &Netns, what: &str, size: Size, path: &Path) -> Measured {
    let mut args = vec!["sync".to_string(), "--manifests".into(), path.display().to_string()];
    args.extend(proxy_flags());
    Measured {
        what: what.into(),
        size,
        file: Some(file_size(path)),
        cost: measure(ns, &args).map_err(|e| e.to_string()),
    }
}

/// Waits for the first sync of a starting agent and reads its figures.
fn startup(agent: &mut Agent, source: &'static str, size: Size, file: Option<u64>) -> Result<Startup, BenchError> {
    let listed = agent.wait_for(Duration::from_secs(600), |l| l.message.starts_with("the first lists have arrived"))?;
    let (commit, _) = agent.next_commit(Duration::from_secs(600))?;
    let since = |t: SystemTime| commit.at.duration_since(t).unwrap_or_default();
    Ok(Startup {
        source,
        size,
        file,
        after_listed: since(listed.at),
        total: since(agent.started),
        sync: commit.took,
        peak_rss: agent.peak_rss(),
    })
}

fn run_manifests(size: Size, files: &Files) -> Result<Startup, BenchError> {
    let path = files.manifests(size, false)?;
    let ns = Netns::create("e2e")?;
    let mut args = vec!["run".to_string(), "--manifests".into(), path.display().to_string()];
    args.extend(run_flags());
    let mut agent = Agent::start(&ns, &args)?;
    let result = startup(&mut agent, "run --manifests", size, Some(file_size(&path)));
    // Memory a moment later: what the running agent keeps, not only its peak.
    std::thread::sleep(Duration::from_secs(1));
    let result = result.map(|mut s| {
        s.peak_rss = agent.peak_rss();
        s
    });
    agent.stop();
    result
}

/// The test API server in `ns` holding the synthetic cluster of `size`, with node1 (its
/// InternalIP in `ns`, so `primary` node-port addresses resolve), and the EndpointSlices of
/// `extra` services that do not exist yet (so a service added later is one event, arriving
/// with its endpoints).
fn api_server(ns: &Netns, size: Size, extra: usize) -> Result<FakeApi, BenchError> {
    let node_ip = Ipv4Addr::new(192, 168, 0, 2);
    // A bridge stands for the node's interface (this kernel may lack dummy devices).
    ns.ip(&["link", "add", "eth0", "type", "bridge"])?;
    ns.ip(&["addr", "add", &format!("{node_ip}/24"), "dev", "eth0"])?;
    ns.ip(&["link", "set", "eth0", "up"])?;
    let api = FakeApi::start(ns);
    api.apply_silently(cluster::node_object(IpAddr::V4(node_ip)));
    for i in 0..size.services {
        api.apply_silently(cluster::service_object(i));
        api.apply_silently(cluster::slice_object(&cluster::slice(i, size.endpoints, 0), i, None));
    }
    for i in size.services..size.services + extra {
        api.apply_silently(cluster::slice_object(&cluster::slice(i, size.endpoints, 0), i, None));
    }
    Ok(api)
}

fn run_api(ns: &Netns, api: &FakeApi, size: Size) -> Result<(Startup, Agent), BenchError> {
    let kubeconfig = std::env::temp_dir().join(format!("nftproxy-bench-{}-kubeconfig", std::process::id()));
    std::fs::write(&kubeconfig, api.kubeconfig())?;
    let mut args = vec!["run".to_string(), "--kubeconfig".into(), kubeconfig.display().to_string()];
    args.extend(run_flags());
    let mut agent = Agent::start(ns, &args)?;
    let startup = startup(&mut agent, "run, Kubernetes API", size, None);
    // `run` reads its kubeconfig once, at start.
    let _ = std::fs::remove_file(&kubeconfig);
    Ok((startup?, agent))
}

/// One change of `kind` at `size` (the `n`-th of its kind), applied through the API server.
fn apply_change(api: &FakeApi, size: Size, kind: ChangeKind, n: usize) {
    let plain = |n: usize| {
        // A service without affinity or Local policy (the synthetic mix's plain majority).
        let mut i = (n * 7919 + 1) % size.services;
        while i % 25 == 3 || i.is_multiple_of(20) {
            i = (i + 1) % size.services;
        }
        i
    };
    // Every 25th service, from the 4th, has ClientIP affinity.
    let affinity = |n: usize| 3 + 25 * ((n * 13) % (size.services / 25).max(1));
    let slice = |i: usize, endpoints: usize| cluster::slice_object(&cluster::slice(i, endpoints, 0), i, None);
    match kind {
        ChangeKind::EndpointAdded => api.apply(slice(plain(n), size.endpoints + 1)),
        ChangeKind::EndpointRemoved => api.apply(slice(plain(n), size.endpoints)),
        // Its EndpointSlice is there already (see `api_server`): one event.
        ChangeKind::ServiceAdded => api.apply(cluster::service_object(size.services + n)),
        ChangeKind::ServiceRemoved => {
            let svc = cluster::service(size.services + n).name;
            api.delete("Service", &svc.namespace, &svc.name);
        }
        ChangeKind::AffinityEndpointAdded => api.apply(slice(affinity(n), size.endpoints + 1)),
        ChangeKind::AffinityEndpointRemoved => api.apply(slice(affinity(n), size.endpoints)),
    }
}

/// `count` single changes through the API watch, each alone (more than `--min-sync-period`
/// after the last sync): from the API event to the commit that carries it.
fn single_changes(agent: &mut Agent, api: &FakeApi, size: Size, count: usize) -> Result<Changes, BenchError> {
    let mut out = Changes { size: Some(size), samples: Vec::new() };
    for k in 0..count {
        let kind = ChangeKind::ALL[k % ChangeKind::ALL.len()];
        // Changes come in pairs (added, then removed) on the same object.
        let n = k / ChangeKind::ALL.len();
        // Alone: no sync for longer than --min-sync-period (1 s), so nothing holds this one back.
        let mut quiet_since = Instant::now();
        while quiet_since.elapsed() < Duration::from_millis(1200) {
            std::thread::sleep(Duration::from_millis(100));
            if agent.drain().iter().any(|l| l.commit().is_some()) {
                quiet_since = Instant::now();
            }
        }
        let sent = SystemTime::now();
        apply_change(api, size, kind, n);
        let commit = loop {
            let (c, _) = agent.next_commit(Duration::from_secs(30))?;
            if c.started() >= sent {
                break c;
            }
        };
        let latency = commit.at.duration_since(sent).unwrap_or_default();
        if latency > Duration::from_millis(100) {
            progress(&format!(
                "end to end: change {k} ({}) took {} to commit (its sync {}, full: {}, services changed: {})",
                kind.label(),
                ms(latency),
                ms(commit.took),
                commit.full,
                commit.changed
            ));
        }
        out.samples.push(ChangeSample { kind, latency, sync: commit.took, kernel: commit.kernel });
    }
    Ok(out)
}

/// CPU used while nothing changes (periodic syncs only).
fn idle(agent: &mut Agent, size: Size, window: Duration) -> Idle {
    agent.drain();
    let cpu = agent.cpu();
    std::thread::sleep(window);
    let cpu = agent.cpu().saturating_sub(cpu);
    let commits: Vec<Commit> = agent.drain().iter().filter_map(|l| l.commit()).collect();
    Idle {
        size,
        window,
        cpu,
        syncs: commits.len(),
        read_backs: commits.iter().filter(|c| c.full).count(),
        rss: agent.rss(),
    }
}

/// The end-to-end tables.
pub fn tables(r: &Results) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n### End to end: the `nftproxy` binary, source included\n");
    let _ = writeln!(
        out,
        "| `run` start-up | size | manifests | first sync after the lists arrived | process start → first sync done | the sync itself | peak RSS |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|");
    for s in &r.startups {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            s.source,
            s.size,
            s.file.map_or("-".into(), mib),
            ms(s.after_listed),
            ms(s.total),
            ms(s.sync),
            mib(s.peak_rss)
        );
    }
    let _ = writeln!(out, "\n| command | size | manifests | wall | peak RSS |");
    let _ = writeln!(out, "|---|---|---:|---:|---:|");
    for m in r.renders.iter().chain(&r.syncs) {
        let (wall, rss) = match &m.cost {
            Ok(c) => (ms(c.wall), mib(c.peak_rss)),
            Err(e) => (format!("failed: {e}"), "-".into()),
        };
        let _ = writeln!(out, "| {} | {} | {} | {wall} | {rss} |", m.what, m.size, m.file.map_or("-".into(), mib));
    }
    if !r.changes.is_empty() {
        let _ = writeln!(
            out,
            "\n| single change through the API watch | size | n | API event → commit p50 / p99 / max | the sync itself p50 / p99 | kernel p50 |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|");
        for c in &r.changes {
            let Some(size) = c.size else { continue };
            let mut rows: Vec<(String, Vec<ChangeKind>)> =
                ChangeKind::ALL.iter().map(|k| (k.label().to_string(), vec![*k])).collect();
            rows.push(("all kinds".into(), ChangeKind::ALL.to_vec()));
            for (label, kinds) in rows {
                let picked: Vec<&ChangeSample> = c.samples.iter().filter(|s| kinds.contains(&s.kind)).collect();
                if picked.is_empty() {
                    continue;
                }
                let wall: Vec<Duration> = picked.iter().map(|s| s.latency).collect();
                let own: Vec<Duration> = picked.iter().map(|s| s.sync).collect();
                let kernel: Vec<Duration> = picked.iter().map(|s| s.kernel).collect();
                let _ = writeln!(
                    out,
                    "| {label} | {size} | {} | {} / {} / {} | {} / {} | {} |",
                    picked.len(),
                    ms(quantile(&wall, 0.5)),
                    ms(quantile(&wall, 0.99)),
                    ms(quantile(&wall, 1.0)),
                    ms(quantile(&own, 0.5)),
                    ms(quantile(&own, 0.99)),
                    ms(quantile(&kernel, 0.5))
                );
            }
        }
    }
    if let Some(i) = &r.idle {
        let _ = writeln!(out, "\n| idle | window | CPU (share of one core) | syncs | read-backs | RSS |");
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|");
        let _ = writeln!(
            out,
            "| {} | {} | {:.2}% | {} | {} | {} |",
            i.size,
            humantime::format_duration(i.window),
            100.0 * i.cpu.as_secs_f64() / i.window.as_secs_f64().max(1e-9),
            i.syncs,
            i.read_backs,
            mib(i.rss)
        );
    }
    out
}
