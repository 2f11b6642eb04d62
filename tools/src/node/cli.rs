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
    let mut s = NodeScenario::start(&names, &images).map_err(|e| e.to_string())?;
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

fn run_scenario(images: &[PathBuf], results: &std::path::Path) -> Result<(), String> {
    let started = std::time::SystemTime::now();
    let scenario::Outcome { records, error } = scenario::run(images);
    let failing: Vec<&str> =
        records.iter().filter(|r| r.endpoints_unchanged && r.failed() > 0).map(|r| r.name.as_str()).collect();
    let date = humantime::format_rfc3339_seconds(started).to_string();
    let day = &date[..10];
    std::fs::create_dir_all(results).map_err(|e| e.to_string())?;
    let mut path = results.join(format!("{day}.md"));
    let mut n = 2;
    while path.exists() {
        path = results.join(format!("{day}-{n}.md"));
        n += 1;
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
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
