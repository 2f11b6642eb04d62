//! `nftproxy demo`: a lab of network namespaces (node1 with a bridge of pods, node2, two clients
//! outside the cluster), `nftproxy run` on node1 with the bundled manifests, and traffic through
//! a ClusterIP, a NodePort and a Local-policy LoadBalancer IP, showing who answered and which
//! source address they saw. Everything is removed at the end, also on failure or Ctrl-C.
//!
//! With `--apiserver` the cluster comes from the real Kubernetes control plane instead of the
//! manifests file (`demo/control_plane.rs`).

mod control_plane;
mod error;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Args;

use crate::lab::traffic::{self, Tally};
pub use error::DemoError;
use error::check;

use crate::lab::{self, Lab, LabError, Netns, ServerSpec};
use nftproxy::net::L4Proto;

/// The manifests the demo runs with (also `examples/cluster.yaml`).
pub const DEMO_MANIFESTS: &str = include_str!("../../examples/cluster.yaml");

/// Demo options.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Requests per traffic run.
    #[arg(long, default_value_t = 300)]
    pub requests: usize,
    /// Keep the lab (and `nftproxy run` on node1) after the traffic runs, until Ctrl-C, to try
    /// `nftproxy trace` and `nftproxy status` in it; prints the namespaces' names.
    #[arg(long)]
    pub hold: bool,
    /// Take the cluster from a real Kubernetes control plane (upstream etcd, kube-apiserver and
    /// kube-controller-manager v1.37, built or cached by scripts/upstream-bins) in a namespace of
    /// the lab, instead of from the manifests file.
    ///
    /// examples/cluster.yaml's Services are applied with kubectl, Nodes and Pods are created
    /// through the API, the EndpointSlice controller makes the slices, and `nftproxy run
    /// --kubeconfig` runs on node1 with a ServiceAccount token bound to deploy/rbac.yaml's
    /// ClusterRole. After the traffic, an EndpointSlice without a Service is applied and
    /// `kubectl get endpointslices` and `kubectl get events` show nftproxy's NotProgrammed Event.
    #[arg(long)]
    pub apiserver: bool,
}

/// Where `nftproxy run` reads the cluster from.
enum Source {
    /// `--manifests`: the bundled examples/cluster.yaml.
    Manifests,
    /// `--kubeconfig`: a kubeconfig (its contents) for the API server.
    Kubeconfig(String),
}

/// The agent process and its scratch directory, removed on drop.
struct Agent {
    child: Child,
    dir: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
}

/// Starts `nftproxy run` inside `ns` and waits for its first sync.
fn start_agent(ns: &Netns, stop: &AtomicBool, source: &Source) -> Result<Agent, DemoError> {
    let dir = std::env::temp_dir().join(format!("nftproxy-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(LabError::from)?;
    let (flag, file, contents) = match source {
        Source::Manifests => ("--manifests", dir.join("cluster.yaml"), DEMO_MANIFESTS),
        Source::Kubeconfig(kubeconfig) => ("--kubeconfig", dir.join("nftproxy.kubeconfig"), kubeconfig.as_str()),
    };
    std::fs::write(&file, contents).map_err(LabError::from)?;
    let exe = crate::nftproxy_binary();
    let log = std::fs::File::create(dir.join("agent.log")).map_err(LabError::from)?;
    let child = ns
        .command(&exe.to_string_lossy())
        .args(["run", flag])
        .arg(&file)
        .args(["--hostname-override", "node1", "--cluster-cidr", lab::topology::CLUSTER_CIDR_V4])
        .args(["--healthz-bind-address", "127.0.0.1:10256"])
        // nf_conntrack_max and the hashsize are global, not the lab's to change.
        .args(["--conntrack-max-per-core", "0"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(LabError::from)?;
    let agent = Agent { child, dir };
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        check(stop)?;
        let healthy = ns.run(|| traffic::http_get(addr("127.0.0.1:10256"), "/healthz", Duration::from_millis(500)))?;
        if matches!(healthy, Ok((200, _))) {
            let log = std::fs::read_to_string(agent.dir.join("agent.log")).unwrap_or_default();
            if let Some(line) = log.lines().find(|l| l.contains(" synced ")) {
                println!("\nnftproxy run on node1: {}", line.split(": ").last().unwrap_or(line));
                return Ok(agent);
            }
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(agent.dir.join("agent.log")).unwrap_or_default();
            return Err(DemoError::Agent(format!("nftproxy run did not start:\n{log}")));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs the demo.
pub fn run(args: &DemoArgs) -> Result<(), DemoError> {
    lab::require_privileges()?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let _ = signal_hook::flag::register(signal, Arc::clone(&stop));
    }
    lab::cleanup_stale();
    // Ctrl-C reaches the whole process group: a kubectl or control plane process killed by it
    // makes a step fail, which is the interruption, not an error of its own.
    demo(args, &stop).map_err(|e| if stop.load(Ordering::Relaxed) { DemoError::Interrupted } else { e })
}

fn demo(args: &DemoArgs, stop: &Arc<AtomicBool>) -> Result<(), DemoError> {
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
        let pods: Vec<String> =
            lab.pods.iter().filter(|p| p.node == node.name).map(|p| format!("{} {}", p.name, p.ip)).collect();
        println!("  {:<7} {:<14} bridge cbr0 {:<12} pods: {}", node.name, node.ip, node.gateway, pods.join(", "));
    }
    for c in &lab.clients {
        println!(
            "  {:<7} {:<14} outside the cluster (the wan routes 10.96.0.0/16 and 203.0.113.0/24 to node1)",
            c.name, c.ip
        );
    }
    check(stop)?;

    // Dropped in reverse: the agent, then the control plane, then the lab.
    let control_plane = if args.apiserver { Some(control_plane::start(&mut lab, stop)?) } else { None };
    let source = match &control_plane {
        Some(cp) => Source::Kubeconfig(control_plane::populate(cp, &lab, DEMO_MANIFESTS, stop)?),
        None => Source::Manifests,
    };
    let agent = start_agent(&lab.node("node1").ns, stop, &source)?;
    let timeout = Duration::from_secs(2);
    let n = args.requests;
    let client = lab.client("client").map(|c| &c.ns).ok_or_else(|| DemoError::Agent("no client".into()))?;
    let pod = lab.pod("web-1").map(|p| &p.ns).ok_or_else(|| DemoError::Agent("no pod".into()))?;

    let runs: [(&Netns, L4Proto, &str, usize, &str); 6] = [
        (
            client,
            L4Proto::Tcp,
            "10.96.0.10:80",
            n,
            "ClusterIP default/web, TCP, from the client (outside --cluster-cidr: masqueraded)",
        ),
        (client, L4Proto::Udp, "10.96.0.10:53", n, "ClusterIP default/web, UDP, from the client"),
        (
            pod,
            L4Proto::Tcp,
            "10.96.0.10:80",
            n / 3,
            "ClusterIP from pod web-1 (source kept; reaching itself: hairpin, masqueraded)",
        ),
        (
            client,
            L4Proto::Tcp,
            "192.168.50.2:30080",
            n / 2,
            "NodePort default/web-nodeport on node1 (Cluster policy: any pod, masqueraded)",
        ),
        (
            client,
            L4Proto::Tcp,
            "203.0.113.10:80",
            n / 2,
            "LoadBalancer default/web-lb, externalTrafficPolicy Local (node1's pods only, client IP kept)",
        ),
        (
            pod,
            L4Proto::Tcp,
            "203.0.113.10:80",
            n / 3,
            "the same LB IP from pod web-1 (short-circuited to every endpoint)",
        ),
    ];
    for (ns, protocol, target, count, title) in runs {
        let target = addr(target);
        let t = ns.run(|| traffic::tally(protocol, target, count, timeout))?;
        print_tally(&format!("{title}\n  {protocol} {target}"), &t);
        check(stop)?;
    }

    let hc = client.run(|| traffic::http_get(addr("192.168.50.2:30999"), "/", timeout))?;
    match hc {
        Ok((status, body)) => println!(
            "\nhealth check of default/web-lb (healthCheckNodePort 30999 on node1): HTTP {status}\n  {}",
            body.split_whitespace().collect::<Vec<_>>().join(" ")
        ),
        Err(e) => println!("\nhealth check of default/web-lb: {e}"),
    }
    let empty = addr("10.96.0.20:80");
    match client.run(|| traffic::tcp_ask(empty, timeout))? {
        Err(e) => println!("\nTCP {empty} (default/no-backends, no endpoints): {e} — rejected at once, no timeout"),
        Ok(a) => println!("\nTCP {empty}: unexpectedly answered by {}", a.backend),
    }

    let listing = lab.node("node1").ns.exec("nft", &["list", "ruleset"])?;
    println!("\n`nft list ruleset` on node1:\n{}", String::from_utf8_lossy(&listing.stdout));
    if let Some(cp) = &control_plane {
        control_plane::bad_object(cp, stop)?;
    }
    if args.hold {
        let extra = match (&control_plane, lab.client(control_plane::NAMESPACE)) {
            (Some(cp), Some(c)) => control_plane::hold_hint(cp, c.ns.name()),
            _ => String::new(),
        };
        hold(&lab, stop, &extra);
    }
    println!("removing the lab…");
    drop(agent);
    drop(control_plane);
    drop(lab);
    println!("done.");
    Ok(())
}

/// Waits for Ctrl-C, after saying how to reach the lab.
fn hold(lab: &Lab, stop: &AtomicBool, extra: &str) {
    let node = lab.node("node1").ns.name();
    let client = lab.client("client").map_or("", |c| c.ns.name());
    let exe = crate::nftproxy_binary();
    let exe = exe.display();
    println!(
        "the lab stays until Ctrl-C. In another terminal, as root:\n  \
         ip netns exec {node} {exe} status\n  \
         ip netns exec {node} {exe} trace --dst 10.96.0.10:80 --count 1\n  \
         ip netns exec {client} bash -c 'cat < /dev/tcp/10.96.0.10/80'    # a connection to trace{extra}"
    );
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn print_tally(title: &str, t: &Tally) {
    let mut out = format!("\n{title}: {} answers in {:.2} s\n", t.answered(), t.elapsed.as_secs_f64());
    let total = t.answered().max(1);
    for (backend, count) in &t.by_backend {
        let share = *count as f64 / total as f64;
        let bar = "█".repeat((share * 40.0).round() as usize);
        let _ = writeln!(out, "    {backend:<6} {count:>4} ({:>3.0}%) {bar}", share * 100.0);
    }
    let sources: Vec<String> = t.sources.iter().map(|(ip, n)| format!("{ip} ×{n}")).collect();
    let _ = writeln!(out, "    source addresses the pods saw: {}", sources.join(", "));
    if t.failed() > 0 {
        let errors: Vec<String> = t.errors.iter().map(|(e, n)| format!("{e} ×{n}")).collect();
        let _ = writeln!(out, "    failures: {}", errors.join(", "));
    }
    print!("{out}");
}
