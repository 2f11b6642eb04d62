//! The proxies the head-to-head runs — nftproxy, and upstream's own kube-proxy v1.37.2 in its
//! nftables and iptables modes — as processes in a lab node, measured the same way: kube-proxy's
//! metrics (both export them), `/proc` (CPU time with the children it waited for: upstream runs
//! `nft` and `iptables-restore` as child processes; resident and peak memory), and their own
//! cleanup between them.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::error::BenchError;
use crate::controlplane::UpstreamBins;
use crate::lab::{Netns, traffic};
use crate::process::{self, ProcessGroup};

/// Where every proxy serves its metrics, inside the node's namespace.
pub const METRICS_ADDRESS: &str = "127.0.0.1:10249";
/// kube-proxy's last-sync timestamp, set when a sync has been written to the kernel.
pub const LAST_SYNC: &str = "kubeproxy_sync_proxy_rules_last_timestamp_seconds";
/// The histogram of full syncs.
pub const FULL_SYNC: &str = "kubeproxy_sync_full_proxy_rules_duration_seconds";
/// The histogram of every sync.
pub const SYNC: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
/// The histogram from an EndpointSlice's trigger time to its rules being in the kernel.
pub const PROGRAMMING: &str = "kubeproxy_network_programming_duration_seconds";

/// A proxy of the head-to-head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proxy {
    Nftproxy,
    /// Upstream kube-proxy v1.37.2, `mode: nftables`.
    KubeProxyNftables,
    /// Upstream kube-proxy v1.37.2, `mode: iptables` (a reference row).
    KubeProxyIptables,
}

impl Proxy {
    /// Every proxy, in the order they run.
    pub const ALL: [Proxy; 3] = [Proxy::Nftproxy, Proxy::KubeProxyNftables, Proxy::KubeProxyIptables];

    /// A short name for files and logs.
    pub fn slug(self) -> &'static str {
        match self {
            Proxy::Nftproxy => "nftproxy",
            Proxy::KubeProxyNftables => "kube-proxy-nftables",
            Proxy::KubeProxyIptables => "kube-proxy-iptables",
        }
    }

    /// The mode in its configuration file.
    pub fn mode(self) -> &'static str {
        match self {
            Proxy::Nftproxy | Proxy::KubeProxyNftables => "nftables",
            Proxy::KubeProxyIptables => "iptables",
        }
    }

    fn binary(self, bins: &UpstreamBins) -> PathBuf {
        match self {
            Proxy::Nftproxy => crate::nftproxy_binary(),
            Proxy::KubeProxyNftables | Proxy::KubeProxyIptables => bins.path("kube-proxy"),
        }
    }
}

impl fmt::Display for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Proxy::Nftproxy => "nftproxy",
            Proxy::KubeProxyNftables => "kube-proxy v1.37.2 (nftables)",
            Proxy::KubeProxyIptables => "kube-proxy v1.37.2 (iptables)",
        })
    }
}

/// A kubeadm-style KubeProxyConfiguration in `mode`: node1, the cluster CIDR, metrics on the
/// node's loopback, conntrack sysctls left alone (they are global to the machine).
pub fn config_file(mode: &str, kubeconfig: &Path, cluster_cidr: &str) -> String {
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: {mode}
clientConnection: {{kubeconfig: {}}}
hostnameOverride: node1
clusterCIDR: {cluster_cidr}
metricsBindAddress: {METRICS_ADDRESS}
conntrack: {{maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
"#,
        kubeconfig.display()
    )
}

/// A proxy process in the node's namespace, leading a process group of its own, killed with it
/// on drop.
pub struct Running {
    pub proxy: Proxy,
    process: ProcessGroup,
    /// When it was started.
    pub started: Instant,
    node: String,
    log: PathBuf,
}

impl Running {
    /// Starts `proxy` in `node` with the configuration file `config`, its log in `log`.
    pub fn start(
        node: &Netns,
        proxy: Proxy,
        bins: &UpstreamBins,
        config: &Path,
        log: &Path,
    ) -> Result<Running, BenchError> {
        let binary = proxy.binary(bins);
        let mut command = node.command(&binary.to_string_lossy());
        if proxy == Proxy::Nftproxy {
            command.arg("run");
        }
        let started = Instant::now();
        command
            .arg(format!("--config={}", config.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?);
        // A process group of its own: upstream's `nft` and `iptables-restore` children are
        // stopped with it.
        let process = ProcessGroup::spawn(&mut command)
            .map_err(|e| BenchError::Tool(binary.display().to_string(), e.to_string()))?;
        Ok(Running { proxy, process, started, node: node.name().to_string(), log: log.to_path_buf() })
    }

    /// The process id (`ip netns exec` execs the proxy itself).
    pub fn pid(&self) -> u32 {
        self.process.id()
    }

    /// Its `/metrics` text, `None` while it does not answer.
    pub fn scrape(&self) -> Option<String> {
        let at: SocketAddr = METRICS_ADDRESS.parse().ok()?;
        let path = format!("/run/netns/{}", self.node);
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    crate::lab::netns::enter(&path).ok()?;
                    traffic::http_get(at, "/metrics", Duration::from_secs(5)).ok().map(|(_, body)| body)
                })
                .join()
                .ok()
                .flatten()
        })
    }

    /// The IPv4 last-sync timestamp (0 before the first sync).
    pub fn last_sync(&self) -> Option<f64> {
        self.scrape().map(|t| gauge(&t, LAST_SYNC).unwrap_or(0.0))
    }

    /// Waits for the first sync and returns the time from the start to it.
    pub fn wait_first_sync(&mut self, timeout: Duration) -> Result<Duration, BenchError> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.last_sync().is_some_and(|t| t > 0.0) {
                return Ok(self.started.elapsed());
            }
            if self.process.exited() {
                return Err(self.failure("exited before its first sync"));
            }
            if Instant::now() > deadline {
                return Err(self.failure(&format!("no first sync within {}", humantime::format_duration(timeout))));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the last-sync timestamp is past `after` (UNIX seconds); returns it.
    pub fn wait_sync_after(&mut self, after: f64, timeout: Duration) -> Result<f64, BenchError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(t) = self.last_sync()
                && t > after
            {
                return Ok(t);
            }
            if Instant::now() > deadline {
                return Err(self.failure("no sync"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// An error with the end of the proxy's log.
    pub fn failure(&self, what: &str) -> BenchError {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(15)..].join("\n");
        BenchError::HeadToHead(format!("{}: {what}; the end of its log:\n{tail}", self.proxy))
    }

    /// CPU time so far: its own and that of the children it has waited for.
    pub fn cpu(&self) -> Duration {
        process::cpu_time_with_children(self.pid()).unwrap_or_default()
    }

    /// Resident memory now, bytes.
    pub fn rss(&self) -> u64 {
        process::rss(self.pid())
    }

    /// Peak resident memory so far, bytes.
    pub fn peak_rss(&self) -> u64 {
        process::peak_rss(self.pid())
    }

    /// Stops it as a DaemonSet rollout does (SIGTERM; SIGKILL after 10 s) and reaps it, and
    /// whatever of its process group is left. Both proxies leave their rules in place.
    pub fn stop(mut self) {
        self.process.stop(Duration::from_secs(10));
    }
}

/// Removes what the proxies left in `node`: each one's own cleanup (`nftproxy cleanup`,
/// `kube-proxy --cleanup`, which removes every mode's rules), then whatever tables remain (the
/// empty base tables iptables-nft leaves), and the conntrack table. Returns the tables the
/// cleanups left.
pub fn clean_switch(node: &Netns, bins: &UpstreamBins) -> Result<Vec<String>, BenchError> {
    node.command(&crate::nftproxy_binary().to_string_lossy()).arg("cleanup").output()?;
    node.command(&bins.path("kube-proxy").to_string_lossy()).arg("--cleanup").output()?;
    let tables = node.exec("nft", &["list", "tables"])?;
    let left: Vec<String> = String::from_utf8_lossy(&tables.stdout).lines().map(|l| l.trim().to_string()).collect();
    node.exec("nft", &["flush", "ruleset"])?;
    node.exec("conntrack", &["-F"])?;
    Ok(left)
}

/// Now, as UNIX seconds (the metric's clock).
pub fn now_unix() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// A UNIX-seconds value as a time.
pub fn unix_time(secs: f64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs_f64(secs.max(0.0))
}

/// The sum of a metric's IPv4 samples (`name{…ip_family="IPv4"…}` or unlabelled).
pub fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let labels = match series.strip_prefix(name)? {
                "" => "",
                rest => rest.strip_prefix('{')?.strip_suffix('}')?,
            };
            (!labels.contains("ip_family=") || labels.contains("ip_family=\"IPv4\""))
                .then(|| value.parse::<f64>().ok())?
        })
        .reduce(|a, b| a + b)
}

/// A Prometheus histogram read from a `/metrics` text: its IPv4 series (upstream runs a proxier
/// per family, and so reports the IPv6 one's syncs too; the benchmark's objects are IPv4), or
/// its only one when unlabelled.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Upper bounds and cumulative counts, in order, `+Inf` last.
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// The histogram `name` in `text` (empty when absent).
    pub fn parse(text: &str, name: &str) -> Histogram {
        let mut h = Histogram::default();
        let bucket = format!("{name}_bucket{{");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else { continue };
            let Ok(value) = value.parse::<f64>() else { continue };
            if series.contains("ip_family=") && !series.contains("ip_family=\"IPv4\"") {
                continue;
            }
            if let Some(labels) = series.strip_prefix(&bucket) {
                let Some(le) = labels.split("le=\"").nth(1).and_then(|r| r.split('"').next()) else { continue };
                let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
                match h.buckets.iter_mut().find(|(b, _)| *b == le) {
                    Some(b) => b.1 += value,
                    None => h.buckets.push((le, value)),
                }
            } else if series == format!("{name}_sum") || series.starts_with(&format!("{name}_sum{{")) {
                h.sum += value;
            } else if series == format!("{name}_count") || series.starts_with(&format!("{name}_count{{")) {
                h.count += value;
            }
        }
        h.buckets.retain(|(le, _)| !le.is_nan());
        h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        h
    }

    /// The observations made since `earlier` (a scrape of the same process).
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let before = |le: f64| earlier.buckets.iter().find(|(b, _)| *b == le).map_or(0.0, |b| b.1);
        Histogram {
            buckets: self.buckets.iter().map(|&(le, n)| (le, n - before(le))).collect(),
            sum: self.sum - earlier.sum,
            count: self.count - earlier.count,
        }
    }

    /// The mean observation.
    pub fn mean(&self) -> Option<Duration> {
        (self.count > 0.0).then(|| Duration::from_secs_f64((self.sum / self.count).max(0.0)))
    }

    /// The `q`-quantile as Prometheus' `histogram_quantile` estimates it: linear within the
    /// bucket that holds it (from 0 for the first); the last finite bound for `+Inf`.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        let mut lower = (0.0, 0.0);
        for &(le, n) in &self.buckets {
            if n >= rank {
                if le.is_infinite() {
                    return Some(Duration::from_secs_f64(lower.0));
                }
                let within = if n > lower.1 { (rank - lower.1) / (n - lower.1) } else { 1.0 };
                return Some(Duration::from_secs_f64(lower.0 + (le - lower.0) * within));
            }
            lower = (le, n);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x\n\
        kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 1.7e+09\n\
        kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv6\"} 5\n\
        kubeproxy_network_programming_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.25\"} 2\n\
        kubeproxy_network_programming_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.5\"} 6\n\
        kubeproxy_network_programming_duration_seconds_bucket{ip_family=\"IPv4\",le=\"1\"} 10\n\
        kubeproxy_network_programming_duration_seconds_bucket{ip_family=\"IPv4\",le=\"+Inf\"} 10\n\
        kubeproxy_network_programming_duration_seconds_sum{ip_family=\"IPv4\"} 4.5\n\
        kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"} 10\n\
        kubeproxy_network_programming_duration_seconds_bucket{ip_family=\"IPv6\",le=\"0.25\"} 7\n\
        kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv6\"} 7\n";

    #[test]
    fn gauges_are_the_ipv4_series() {
        assert_eq!(gauge(TEXT, LAST_SYNC), Some(1.7e9));
        assert_eq!(gauge("up 1\n", "up"), Some(1.0));
        assert_eq!(gauge(TEXT, "absent"), None);
    }

    #[test]
    fn histogram_quantiles_interpolate_within_buckets() {
        let h = Histogram::parse(TEXT, PROGRAMMING);
        assert_eq!(h.count, 10.0);
        assert_eq!(h.buckets.len(), 4);
        assert_eq!(h.mean(), Some(Duration::from_millis(450)));
        // Rank 5 of 10: the second bucket (2 → 6 between 0.25 and 0.5), three quarters in.
        assert_eq!(h.quantile(0.5), Some(Duration::from_secs_f64(0.4375)));
        assert_eq!(h.quantile(0.1), Some(Duration::from_secs_f64(0.125)));
        assert_eq!(h.quantile(1.0), Some(Duration::from_secs(1)));
        let earlier = Histogram::parse(&TEXT.replace("} 2\n", "} 1\n").replace("} 6\n", "} 1\n"), PROGRAMMING);
        let d = h.since(&earlier);
        assert_eq!(d.buckets[0], (0.25, 1.0));
        assert_eq!(d.buckets[1], (0.5, 5.0));
        assert_eq!(Histogram::default().quantile(0.5), None);
    }
}
