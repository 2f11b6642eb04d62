//! Head to head with upstream: nftproxy and kube-proxy v1.37 in nftables mode (built from its
//! module by `scripts/upstream-bins`), one after the other in the same lab node, through the same
//! real API server (tools/src/controlplane.rs), with the same objects and the same kubeadm-style
//! configuration file. Both export kube-proxy's metrics, so both are measured the same way:
//!
//! - first sync: from the process's start to `kubeproxy_sync_proxy_rules_last_timestamp_seconds`
//!   appearing, and the sync itself (`kubeproxy_sync_full_proxy_rules_duration_seconds`);
//! - one endpoint change: from the EndpointSlice's write through the API to that timestamp
//!   moving (polled every 10 ms);
//! - peak RSS (`VmHWM`) and idle CPU over a quiet window.
//!
//! The Services are selector-less and their EndpointSlices written directly (as the scale
//! issue allows: no 100,000 Pod objects), so no controller competes with the writes.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::cluster::{Size, endpoint_ip};
use crate::controlplane::{ControlPlane, KUBE_PROXY_IDENTITY};
use crate::lab::{Lab, traffic};

/// `head-to-head` options.
#[derive(Debug, clap::Args)]
pub struct HeadToHeadArgs {
    /// Cluster sizes, SERVICESxENDPOINTS, comma-separated.
    #[arg(long, default_value = "1000x10")]
    pub sizes: String,
    /// The quiet window for idle CPU.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub idle: Duration,
}

/// One proxy's figures at one size.
#[derive(Debug, Default, Clone)]
struct Figures {
    first_sync: Duration,
    sync: Duration,
    change: Duration,
    peak_rss_kib: u64,
    idle_cpu: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proxy {
    Nftproxy,
    KubeProxy,
}

impl Proxy {
    fn name(self) -> &'static str {
        match self {
            Proxy::Nftproxy => "nftproxy",
            Proxy::KubeProxy => "kube-proxy v1.37.2 (nftables)",
        }
    }
}

/// A ClusterIP inside the lab's service range, clear of the API server's own Service.
fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000u32 + 1000 + i as u32)
}

/// Services `range` (selector-less) with one EndpointSlice each, as one List.
fn objects(range: std::ops::Range<usize>, endpoints: usize) -> String {
    let mut out = String::from("apiVersion: v1\nkind: List\nitems:\n");
    for i in range {
        let _ = write!(
            out,
            "- apiVersion: v1\n  kind: Service\n  metadata: {{name: svc{i}, namespace: bench}}\n  spec:\n    clusterIP: {}\n    ports: [{{name: p, port: 80, targetPort: 8080, protocol: TCP}}]\n",
            cluster_ip(i)
        );
        let _ = write!(
            out,
            "- apiVersion: discovery.k8s.io/v1\n  kind: EndpointSlice\n  metadata:\n    name: svc{i}-1\n    namespace: bench\n    labels: {{kubernetes.io/service-name: svc{i}, endpointslice.kubernetes.io/managed-by: nftproxy-bench}}\n  addressType: IPv4\n  ports: [{{name: p, port: 8080, protocol: TCP}}]\n  endpoints:\n"
        );
        for j in 0..endpoints {
            let _ = writeln!(
                out,
                "  - {{addresses: [\"{}\"], conditions: {{ready: true}}, nodeName: node1}}",
                endpoint_ip(i, j, 0)
            );
        }
    }
    out
}

fn now_unix() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// A sample's value in a /metrics text.
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok())
}

fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, r)| r).split_whitespace().collect();
    let ticks: f64 = [11, 12].iter().filter_map(|&i| fields.get(i)?.parse::<f64>().ok()).sum();
    ticks / 100.0
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs the head-to-head at every size and prints the tables.
pub fn run(args: &HeadToHeadArgs) -> Result<(), String> {
    crate::lab::require_privileges().map_err(|e| e.to_string())?;
    crate::lab::cleanup_stale();
    let sizes: Vec<Size> = args
        .sizes
        .split(',')
        .map(|s| super::parse_size(s.trim()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let mut report = String::new();
    for size in sizes {
        let (ours, theirs) = one_size(size, args.idle)?;
        let ratio = |a: f64, b: f64| if a > 0.0 { format!("{:.1}×", b / a) } else { "-".into() };
        let _ = writeln!(report, "\n{size} through the real API server (v1.37.2), node1 of the lab:\n");
        let _ = writeln!(report, "| | nftproxy | kube-proxy v1.37.2 (nftables) | kube-proxy / nftproxy |");
        let _ = writeln!(report, "|---|---:|---:|---:|");
        let ms = |d: Duration| format!("{:.0} ms", d.as_secs_f64() * 1000.0);
        for (what, a, b, ra, rb) in [
            (
                "start → first sync done",
                ms(ours.first_sync),
                ms(theirs.first_sync),
                ours.first_sync.as_secs_f64(),
                theirs.first_sync.as_secs_f64(),
            ),
            (
                "the first sync itself",
                ms(ours.sync),
                ms(theirs.sync),
                ours.sync.as_secs_f64(),
                theirs.sync.as_secs_f64(),
            ),
            (
                "one endpoint change, API write → commit",
                ms(ours.change),
                ms(theirs.change),
                ours.change.as_secs_f64(),
                theirs.change.as_secs_f64(),
            ),
            (
                "peak RSS",
                format!("{} MiB", ours.peak_rss_kib / 1024),
                format!("{} MiB", theirs.peak_rss_kib / 1024),
                ours.peak_rss_kib as f64,
                theirs.peak_rss_kib as f64,
            ),
            (
                "idle CPU (share of a core)",
                format!("{:.2}%", ours.idle_cpu * 100.0),
                format!("{:.2}%", theirs.idle_cpu * 100.0),
                ours.idle_cpu,
                theirs.idle_cpu,
            ),
        ] {
            let _ = writeln!(report, "| {what} | {a} | {b} | {} |", ratio(ra, rb));
        }
    }
    println!("{report}");
    Ok(())
}

fn one_size(size: Size, idle: Duration) -> Result<(Figures, Figures), String> {
    let mut lab = Lab::new().map_err(|e| e.to_string())?;
    lab.add_node("node1").map_err(|e| e.to_string())?;
    eprintln!("head-to-head {size}: starting the control plane…");
    let cp = ControlPlane::start_in(&mut lab, crate::lab::topology::SERVICE_CIDR_V4).map_err(|e| e.to_string())?;
    cp.add_node("node1", lab.node("node1").ip, "zone-a").map_err(|e| e.to_string())?;
    cp.apply("apiVersion: v1\nkind: Namespace\nmetadata: {name: bench}\n").map_err(|e| e.to_string())?;
    cp.apply(KUBE_PROXY_IDENTITY).map_err(|e| e.to_string())?;
    let started = Instant::now();
    // Four writers at once: kubectl sends one object at a time.
    let chunk = size.services.div_ceil(4);
    let writers: Vec<_> = (0..4)
        .map(|k| {
            let range = (k * chunk).min(size.services)..((k + 1) * chunk).min(size.services);
            let yaml = objects(range, size.endpoints);
            let cp = &cp;
            move || cp.kubectl_stdin(&["create"], &yaml).map(|_| ())
        })
        .collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = writers.into_iter().map(|w| scope.spawn(w)).collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| "a writer panicked".to_string())?.map_err(|e| e.to_string()))
    })?;
    eprintln!("  {} objects created through the API in {:.1} s", size.services * 2, started.elapsed().as_secs_f64());
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let token = cp.token("kube-system", "kube-proxy").map_err(|e| e.to_string())?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, cp.kubeconfig(&token)).map_err(|e| e.to_string())?;
    let config = dir.path().join("config.conf");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nclientConnection: {{kubeconfig: {}}}\nhostnameOverride: node1\nclusterCIDR: {}\nmetricsBindAddress: 127.0.0.1:10249\nconntrack: {{maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}\n",
            kubeconfig.display(),
            crate::lab::topology::CLUSTER_CIDR_V4
        ),
    )
    .map_err(|e| e.to_string())?;
    let mut figures = Vec::new();
    for proxy in [Proxy::Nftproxy, Proxy::KubeProxy] {
        figures.push(measure(&lab, &cp, proxy, &config, size, idle, dir.path())?);
    }
    Ok((figures[0].clone(), figures[1].clone()))
}

fn measure(
    lab: &Lab,
    cp: &ControlPlane,
    proxy: Proxy,
    config: &Path,
    size: Size,
    idle: Duration,
    dir: &Path,
) -> Result<Figures, String> {
    let node = &lab.node("node1").ns;
    let metrics_at: SocketAddr = "127.0.0.1:10249".parse().map_err(|_| "address")?;
    let scrape = || {
        node.run(move || traffic::http_get(metrics_at, "/metrics", Duration::from_secs(5))).ok().and_then(Result::ok)
    };
    let log = std::fs::File::create(dir.join(format!("{}.log", proxy.name().split(' ').next().unwrap_or("proxy"))))
        .map_err(|e| e.to_string())?;
    let mut command = match proxy {
        Proxy::Nftproxy => {
            let mut c = node.command(crate::nftproxy_binary().to_str().unwrap_or("nftproxy"));
            c.arg("run");
            c
        }
        Proxy::KubeProxy => node.command(cp.bins.path("kube-proxy").to_str().unwrap_or("kube-proxy")),
    };
    let started = Instant::now();
    let child = command
        .arg(format!("--config={}", config.display()))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| e.to_string())?;
    let running = Running(child);
    let pid = running.0.id();
    let last_sync = "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}";
    let mut figures = Figures::default();
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if let Some((_, text)) = scrape()
            && sample(&text, last_sync).is_some_and(|t| t > 0.0)
        {
            figures.first_sync = started.elapsed();
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("{}: no first sync in 10 minutes", proxy.name()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("  {}: first sync done {:.2} s after its start", proxy.name(), figures.first_sync.as_secs_f64());
    // Let start-up settle (later lists, the minimum sync period), then change one endpoint.
    std::thread::sleep(Duration::from_secs(3));
    // The first sync's own length, once its histogram is written (upstream sets the timestamp
    // before it observes the duration).
    let full_sync = "kubeproxy_sync_full_proxy_rules_duration_seconds_sum{ip_family=\"IPv4\"}";
    figures.sync = Duration::from_secs_f64(scrape().and_then(|(_, t)| sample(&t, full_sync)).unwrap_or(0.0));
    let before = scrape().and_then(|(_, t)| sample(&t, last_sync)).unwrap_or(0.0);
    let i = size.services / 2;
    // A new address for each proxy: the slice keeps the previous proxy's change.
    let new_ip = endpoint_ip(i, 40, 7 + proxy as usize);
    let patch = format!("[{{\"op\": \"replace\", \"path\": \"/endpoints/0/addresses\", \"value\": [\"{new_ip}\"]}}]");
    let written = Instant::now();
    let written_unix = now_unix();
    cp.kubectl_ok(&["patch", "endpointslice", &format!("svc{i}-1"), "-n", "bench", "--type=json", "-p", &patch])
        .map_err(|e| e.to_string())?;
    let patched = written.elapsed();
    loop {
        if let Some(t) = scrape().and_then(|(_, t)| sample(&t, last_sync))
            && t > before
            && t >= written_unix - 0.001
        {
            figures.change = Duration::from_secs_f64((t - written_unix).max(0.0));
            break;
        }
        if written.elapsed() > Duration::from_secs(60) {
            return Err(format!("{}: the endpoint change was not synced in 60 s", proxy.name()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = patched;
    std::thread::sleep(Duration::from_secs(2));
    let cpu = cpu_seconds(pid);
    std::thread::sleep(idle);
    figures.idle_cpu = (cpu_seconds(pid) - cpu) / idle.as_secs_f64();
    figures.peak_rss_kib = status_kib(pid, "VmHWM:");
    drop(running);
    // A clean switch: the proxy's own cleanup, conntrack flushed.
    let cleanup = match proxy {
        Proxy::Nftproxy => {
            node.command(crate::nftproxy_binary().to_str().unwrap_or("nftproxy")).arg("cleanup").output()
        }
        Proxy::KubeProxy => {
            node.command(cp.bins.path("kube-proxy").to_str().unwrap_or("kube-proxy")).arg("--cleanup").output()
        }
    };
    cleanup.map_err(|e| e.to_string())?;
    let _ = Command::new("ip").args(["netns", "exec", node.name(), "conntrack", "-F"]).output();
    let _ = std::io::stderr().flush();
    Ok(figures)
}
