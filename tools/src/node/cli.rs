//! `nftproxy-tools nodes`: a cluster of real nodes with kubeadm's kube-proxy and CoreDNS addons,
//! held for a person (or a script) until Ctrl-C; or, with `--scenario`, the operator's path run
//! on it ([`super::scenario`]) and written to a dated results file.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::scenario::{self, NodeScenario};

/// `nftproxy-tools nodes`' options.
#[derive(Debug, clap::Args)]
pub struct NodesArgs {
    /// The nodes' names (the scenario always runs two: node1 and node2).
    #[arg(long, value_delimiter = ',', default_value = "node1,node2")]
    pub nodes: Vec<String>,
    /// A directory `scripts/images` wrote (its archives are imported into every node's
    /// containerd); default: `$NFTPROXY_IMAGES`, else what `scripts/images` builds.
    #[arg(long)]
    pub images: Option<PathBuf>,
    /// Also deploy the scenario's workload (web servers, clients, their Services).
    #[arg(long)]
    pub workload: bool,
    /// Run the operator's path (swap, way back, longer path, node events) and write its
    /// failure counts to a dated file in --results.
    #[arg(long)]
    pub scenario: bool,
    /// Where --scenario writes DATE.md.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/real-node"))]
    pub results: PathBuf,
}

/// Runs `nodes`.
pub fn run(args: &NodesArgs) -> Result<(), String> {
    let images = match &args.images {
        Some(dir) => crate::images::Images::open(dir),
        None => crate::images::Images::locate(),
    }
    .map_err(|e| e.to_string())?;
    let images: Vec<PathBuf> = images.all().iter().map(|i| i.archive.clone()).collect();
    if args.scenario {
        return run_scenario(&images, &args.results);
    }
    let names: Vec<&str> = args.nodes.iter().map(String::as_str).collect();
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, Arc::clone(&stop)).map_err(|e| e.to_string())?;
    }
    let nodes: Vec<(&str, super::config::IptablesBackend)> =
        names.iter().map(|n| (*n, super::config::IptablesBackend::Nft)).collect();
    let mut s = NodeScenario::start(&nodes, &images).map_err(|e| e.to_string())?;
    if args.workload {
        s.deploy_workload().map_err(|e| e.to_string())?;
    }
    let cp = &s.cluster.cp;
    println!("control plane in namespace {}; kubectl:", cp.namespace());
    println!("  ip netns exec {} kubectl --kubeconfig {} get nodes", cp.namespace(), cp.admin_kubeconfig().display());
    for node in &s.cluster.nodes {
        println!(
            "node {}: files {}; a shell in it: nsenter -t {} -m -n",
            node.spec.name,
            node.dir().display(),
            node.pid().unwrap_or_default()
        );
    }
    println!("held until Ctrl-C");
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// On SIGINT or SIGTERM, a long run (the scenario, the e2e runs) stops at once: every process in
/// its namespaces and node cgroups killed, both removed, exit 130. (A held cluster stops through
/// its own drops instead.)
fn clean_up_on_signal() -> Result<(), String> {
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM])
        .map_err(|e| e.to_string())?;
    std::thread::spawn(move || {
        if signals.forever().next().is_some() {
            eprintln!("interrupted: removing the nodes, the control plane and their namespaces");
            super::cgroup::remove_own();
            crate::lab::remove_own();
            std::process::exit(130);
        }
    });
    Ok(())
}

fn run_scenario(images: &[PathBuf], results: &std::path::Path) -> Result<(), String> {
    clean_up_on_signal()?;
    let started = std::time::SystemTime::now();
    let scenario::Outcome { records, error } = scenario::run(images);
    let failing: Vec<&str> =
        records.iter().filter(|r| r.endpoints_unchanged && r.failed() > 0).map(|r| r.name.as_str()).collect();
    let date = humantime::format_rfc3339_seconds(started).to_string();
    let path = dated_file(results, &date[..10])?;
    let commit = commit();
    let mut text = format!(
        "# Real nodes: the operator's path, {date}\n\nCommit {commit}; `nftproxy-tools nodes --scenario` \
         (tools/src/node/scenario.rs): two nodes, each containerd 1.6 and kubelet v1.37.2 in a lab \
         namespace, kubeadm's kube-proxy and CoreDNS addons, clients in pods and outside the cluster \
         opening a new connection every 20 ms per target.\n\n"
    );
    text.push_str(&scenario::to_markdown(&records));
    if let Some(e) = &error {
        text.push_str(&format!("\n## Stopped\n\n```\n{e}\n```\n"));
    }
    std::fs::write(&path, text).map_err(|e| e.to_string())?;
    println!("wrote {}", path.display());
    match (error, failing.is_empty()) {
        (Some(e), _) => Err(e),
        (None, false) => Err(format!("connections failed where endpoints did not change: {}", failing.join("; "))),
        (None, true) => Ok(()),
    }
}

/// `nftproxy-tools e2e`'s options.
#[derive(Debug, clap::Args)]
pub struct E2eArgs {
    /// Run the wide selection (`[sig-network] Services`, Networking, DNS, EndpointSlices and
    /// the Conformance specs of `[sig-network]`) instead of the Conformance subset.
    #[arg(long)]
    pub wide: bool,
    /// A directory `scripts/images` wrote; default: `$NFTPROXY_IMAGES`, else what
    /// `scripts/images` builds.
    #[arg(long)]
    pub images: Option<PathBuf>,
    /// Where the dated results file goes.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/e2e"))]
    pub results: PathBuf,
}

/// Runs upstream's e2e selection with kube-proxy, then with nftproxy, on one cluster of real
/// nodes, and writes both columns to a dated results file; fails when a spec kube-proxy passed
/// did not pass with nftproxy.
pub fn run_e2e(args: &E2eArgs) -> Result<(), String> {
    let images = match &args.images {
        Some(dir) => crate::images::Images::open(dir),
        None => crate::images::Images::locate(),
    }
    .map_err(|e| e.to_string())?;
    let images: Vec<PathBuf> = images.all().iter().map(|i| i.archive.clone()).collect();
    let selection = if args.wide { super::e2e::Selection::wide() } else { super::e2e::Selection::conformance() };
    clean_up_on_signal()?;
    let started = std::time::SystemTime::now();
    let nodes = [("node1", super::config::IptablesBackend::Nft), ("node2", super::config::IptablesBackend::Nft)];
    let mut s = NodeScenario::start(&nodes, &images).map_err(|e| e.to_string())?;
    let work = s.dir().to_path_buf();
    let comparison =
        super::e2e::compare(&mut s, selection, &super::e2e::work_dir(&work, "run")).map_err(|e| s.diagnose(&e))?;
    let date = humantime::format_rfc3339_seconds(started).to_string();
    let path = dated_file(&args.results, &format!("{}-{}", &date[..10], comparison.selection.name))?;
    let mut text = format!(
        "# Upstream's e2e against nftproxy: {} selection, {date}\n\nCommit {}; `nftproxy-tools e2e{}`: \
         `e2e.test` v1.37.2 on two real nodes (containerd 1.6, kubelet v1.37.2), first with kubeadm's \
         kube-proxy DaemonSet (upstream's image, nftables mode), then after `kubectl set image` to \
         nftproxy's, on the same cluster.\n\nFocus: `{}`\n\nSkip: `{}` (docs/e2e/README.md says why).\n\n",
        comparison.selection.name,
        commit(),
        if args.wide { " --wide" } else { "" },
        comparison.selection.focus,
        comparison.selection.skip,
    );
    text.push_str(&comparison.to_markdown());
    let regressions = comparison.regressions();
    if !regressions.is_empty() {
        text.push_str("\n## Passed by kube-proxy, not by nftproxy\n\n");
        for (name, r) in &regressions {
            text.push_str(&format!("- {name}: {} — {}\n", r.state, r.message));
        }
    }
    std::fs::write(&path, text).map_err(|e| e.to_string())?;
    println!("wrote {}", path.display());
    if regressions.is_empty() {
        Ok(())
    } else {
        Err(format!("{} spec(s) passed with kube-proxy and not with nftproxy", regressions.len()))
    }
}

/// `DIR/NAME.md`, or `DIR/NAME-2.md`, … when taken.
fn dated_file(dir: &std::path::Path, name: &str) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let mut path = dir.join(format!("{name}.md"));
    let mut n = 2;
    while path.exists() {
        path = dir.join(format!("{name}-{n}.md"));
        n += 1;
    }
    Ok(path)
}

/// This tree's commit, short.
fn commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}
