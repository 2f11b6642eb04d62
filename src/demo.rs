//! `nftproxy demo`: a lab of network namespaces (a node with a bridge of pods, a second node, an
//! external client), the bundled manifests synced into the node, traffic through a ClusterIP,
//! and the node's ruleset. Everything is removed at the end, also on failure or Ctrl-C.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Args;
use thiserror::Error;

use crate::config::{ProxyConfig, parse_cidrs};
use crate::lab::traffic::{self, Tally};
use crate::lab::{self, Lab, LabError, ServerSpec};
use crate::net::L4Proto;
use crate::netlink::Kernel;
use crate::source;

/// The manifests the demo syncs (also `examples/cluster.yaml`).
pub const DEMO_MANIFESTS: &str = include_str!("../examples/cluster.yaml");

/// Demo options.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Requests per traffic run.
    #[arg(long, default_value_t = 300)]
    pub requests: usize,
}

/// Why the demo stopped.
#[derive(Debug, Error)]
pub enum DemoError {
    #[error(transparent)]
    Lab(#[from] LabError),
    #[error("interrupted; the lab was removed")]
    Interrupted,
    #[error("sync failed: {0}")]
    Sync(String),
}

fn check(stop: &AtomicBool) -> Result<(), DemoError> {
    if stop.load(Ordering::Relaxed) { Err(DemoError::Interrupted) } else { Ok(()) }
}

/// Runs the demo.
pub fn run(args: &DemoArgs) -> Result<(), DemoError> {
    lab::require_privileges()?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let _ = signal_hook::flag::register(signal, Arc::clone(&stop));
    }
    lab::cleanup_stale();

    println!("nftproxy demo: building a lab of network namespaces");
    let mut lab = Lab::new()?;
    lab.add_node("node1")?;
    lab.add_node("node2")?;
    lab.add_pod("web-1", "node1")?;
    lab.add_pod("web-2", "node1")?;
    lab.add_pod("web-3", "node2")?;
    lab.add_client("client")?;
    lab.start_servers(&[ServerSpec::tcp(8080), ServerSpec::udp(8080)])?;
    for node in &lab.nodes {
        let pods: Vec<String> = lab.pods.iter().filter(|p| p.node == node.name).map(|p| format!("{} {}", p.name, p.ip)).collect();
        println!("  {:<7} {:<14} bridge cbr0 {:<12} pods: {}", node.name, node.ip, node.gateway, pods.join(", "));
    }
    for c in &lab.clients {
        println!("  {:<7} {:<14} (outside the cluster)", c.name, c.ip);
    }
    check(&stop)?;

    // Sync the bundled manifests inside node1, in-process.
    let mut config = ProxyConfig::new("node1");
    config.cluster_cidrs = parse_cidrs("--cluster-cidr", lab::topology::CLUSTER_CIDR_V4).unwrap_or_default();
    let mut manifests = source::manifests::Manifests::default();
    source::manifests::load_text(std::path::Path::new("examples/cluster.yaml"), DEMO_MANIFESTS, &mut manifests);
    let (state, _) = source::state_from_manifests(&manifests, &config.hostname);
    let summary = lab
        .node("node1")
        .ns
        .run(|| -> Result<String, String> {
            let planned = crate::cli::plan_for(&config, &state);
            let mut kernel = Kernel::open().map_err(|e| e.to_string())?;
            let report = crate::reconcile::sync_with_kernel(&mut kernel, &config, &planned).map_err(|e| e.to_string())?;
            Ok(format!(
                "synced {} services ({} ports, {} endpoints) into node1: 1 transaction, {} messages, {:.1} ms",
                planned.stats.services,
                planned.stats.service_ports,
                planned.stats.endpoints,
                report.apply.messages,
                report.total.as_secs_f64() * 1000.0
            ))
        })?
        .map_err(DemoError::Sync)?;
    println!("\n{summary}");
    println!("Service default/web: ClusterIP 10.96.0.10, 80/TCP and 53/UDP → pods' port 8080");
    check(&stop)?;

    let timeout = Duration::from_secs(2);
    let web_tcp: SocketAddr = "10.96.0.10:80".parse().unwrap_or_else(|_| SocketAddr::from(([10, 96, 0, 10], 80)));
    let web_udp: SocketAddr = "10.96.0.10:53".parse().unwrap_or_else(|_| SocketAddr::from(([10, 96, 0, 10], 53)));
    let client = lab.client("client").map(|c| &c.ns).ok_or_else(|| DemoError::Sync("no client".into()))?;
    let n = args.requests;
    let t = client.run(|| traffic::tally(L4Proto::Tcp, web_tcp, n, timeout))?;
    print_tally(&format!("TCP {web_tcp} from client (outside the cluster CIDR: masqueraded)"), &t);
    check(&stop)?;
    let t = client.run(|| traffic::tally(L4Proto::Udp, web_udp, n, timeout))?;
    print_tally(&format!("UDP {web_udp} from client"), &t);
    check(&stop)?;
    let pod = lab.pod("web-1").map(|p| &p.ns).ok_or_else(|| DemoError::Sync("no pod".into()))?;
    let t = pod.run(|| traffic::tally(L4Proto::Tcp, web_tcp, n / 3, timeout))?;
    print_tally(&format!("TCP {web_tcp} from pod web-1 (inside the cluster: source kept; hairpin to itself masqueraded)"), &t);
    check(&stop)?;
    let empty: SocketAddr = SocketAddr::from(([10, 96, 0, 20], 80));
    let refused = client.run(|| traffic::tcp_ask(empty, timeout))?;
    match refused {
        Err(e) => println!("\nTCP {empty} (default/no-backends, no endpoints): {e} — rejected at once, no timeout"),
        Ok(a) => println!("\nTCP {empty}: unexpectedly answered by {}", a.backend),
    }

    let listing = lab.node("node1").ns.exec("nft", &["list", "ruleset"])?;
    println!("\n`nft list ruleset` on node1:\n{}", String::from_utf8_lossy(&listing.stdout));
    println!("removing the lab…");
    drop(lab);
    println!("done.");
    Ok(())
}

fn print_tally(title: &str, t: &Tally) {
    let mut out = format!("\n{title}: {} answers in {:.2} s\n", t.answered(), t.elapsed.as_secs_f64());
    let total = t.answered().max(1);
    for (backend, count) in &t.by_backend {
        let share = *count as f64 / total as f64;
        let bar = "█".repeat((share * 40.0).round() as usize);
        let _ = writeln!(out, "  {backend:<6} {count:>4} ({:>3.0}%) {bar}", share * 100.0);
    }
    let sources: Vec<String> = t.sources.iter().map(|(ip, n)| format!("{ip} ×{n}")).collect();
    let _ = writeln!(out, "  source addresses the pods saw: {}", sources.join(", "));
    if t.failed() > 0 {
        let errors: Vec<String> = t.errors.iter().map(|(e, n)| format!("{e} ×{n}")).collect();
        let _ = writeln!(out, "  failures: {}", errors.join(", "));
    }
    print!("{out}");
}
