//! The churn benchmark: `nftproxy run` against the test API server holding a synthetic
//! cluster, fed endpoint updates at a steady rate for minutes, while a pod of the lab connects
//! to a service that never changes. Per minute it reports the network-programming latency
//! (API event → the commit carrying it), the agent's CPU and memory, and the probe's failures.

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;

use super::agent::{Agent, Commit};
use super::error::BenchError;
use super::figures::{mib, ms, quantile};
use crate::apiserver::FakeApi;
use crate::cluster::{self, Size};
use crate::lab::servers::ServerSpec;
use crate::lab::topology::{CLUSTER_CIDR_V4, Lab};
use crate::lab::traffic;

/// The probe service's ClusterIP (outside the synthetic services' range at any size used).
const PROBE_IP: &str = "10.96.250.1";
/// How long after an event a sync must start to be counted as carrying it: the watch takes a
/// little while to deliver an event, so an event sent just before a sync started may not be in
/// it. Counting it in the next sync instead overstates its latency, never understates it.
const DELIVERY_MARGIN: Duration = Duration::from_millis(10);
/// How often CPU time and memory are sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// What to run.
#[derive(Debug, Clone)]
pub struct ChurnPlan {
    pub size: Size,
    /// Endpoint updates per second.
    pub rate: u32,
    pub duration: Duration,
    /// Where the SVG plot goes.
    pub plot: PathBuf,
    /// How the results file links to it.
    pub plot_link: String,
}

/// One minute of the run.
#[derive(Debug, Clone, Default)]
pub struct Minute {
    pub events: usize,
    pub syncs: usize,
    pub latency_p50: Duration,
    pub latency_p99: Duration,
    /// Share of one core.
    pub cpu: f64,
    pub rss: u64,
    pub probe_ok: usize,
    pub probe_failed: usize,
}

/// What the run found.
#[derive(Debug, Clone, Default)]
pub struct ChurnResult {
    pub plan: Option<ChurnPlan>,
    pub minutes: Vec<Minute>,
    pub latency_p50: Duration,
    pub latency_p99: Duration,
    /// Events no commit carried by the end (should be none).
    pub unprogrammed: usize,
    pub cpu: f64,
    /// RSS at the end of minute 2 and at the end.
    pub rss_minute_2: u64,
    pub rss_end: u64,
    pub probe_ok: usize,
    pub probe_failed: usize,
    /// nftproxy's own `kubeproxy_network_programming_duration_seconds`: mean, and the share of
    /// observations at most 1 s and at most 2 s.
    pub metric: Option<(Duration, f64, f64)>,
}

/// One sample of the agent.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Duration,
    cpu: Duration,
    rss: u64,
}

/// Runs the churn benchmark.
pub fn run(plan: &ChurnPlan) -> Result<ChurnResult, BenchError> {
    crate::lab::cleanup_stale();
    let mut lab = Lab::new()?;
    lab.add_node("node1")?;
    lab.add_pod("web-1", "node1")?;
    lab.add_pod("web-2", "node1")?;
    lab.add_pod("probe", "node1")?;
    lab.start_servers(&[ServerSpec::tcp(8080)])?;
    let node = lab.node("node1");
    let api = FakeApi::start(&node.ns);
    api.apply_silently(cluster::node_object(IpAddr::V4(node.ip)));
    for i in 0..plan.size.services {
        api.apply_silently(cluster::service_object(i));
        api.apply_silently(cluster::slice_object(&cluster::slice(i, plan.size.endpoints, 0), i, None));
    }
    let web: Vec<IpAddr> = ["web-1", "web-2"].iter().filter_map(|p| lab.pod_ip(p, false)).collect();
    for obj in probe_objects(&web) {
        api.apply_silently(obj);
    }
    let kubeconfig = std::env::temp_dir().join(format!("nftproxy-bench-{}-churn-kubeconfig", std::process::id()));
    std::fs::write(&kubeconfig, api.kubeconfig())?;
    let args: Vec<String> = [
        "run",
        "--kubeconfig",
        &kubeconfig.display().to_string(),
        "--hostname-override",
        "node1",
        "--cluster-cidr",
        CLUSTER_CIDR_V4,
        "--conntrack-max-per-core",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut agent = Agent::start(&node.ns, &args)?;
    let first = agent.wait_for(Duration::from_secs(600), |l| l.commit().is_some());
    // `run` reads its kubeconfig once, at start.
    let _ = std::fs::remove_file(&kubeconfig);
    first?;

    // The probe: a pod connecting to the unchanged service throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let probe_ns = lab.pod("probe").map(|p| &p.ns).ok_or_else(|| BenchError::Worker("no probe pod".into()))?;
    let target: SocketAddr = format!("{PROBE_IP}:80").parse().map_err(|_| BenchError::Worker("probe".into()))?;
    let probe_stop = Arc::clone(&stop);
    let probe = probe_ns.spawn(move || {
        let mut tries = Vec::new();
        while !probe_stop.load(Ordering::Relaxed) {
            let ok = traffic::tcp_ask(target, Duration::from_secs(1)).is_ok();
            tries.push((SystemTime::now(), ok));
            std::thread::sleep(Duration::from_millis(50));
        }
        tries
    });

    // The events, at a steady rate, and the samples.
    let started = Instant::now();
    let t0 = SystemTime::now();
    let mut sent: Vec<SystemTime> = Vec::new();
    let mut grown = vec![false; plan.size.services];
    let mut samples = vec![Sample { at: Duration::ZERO, cpu: agent.cpu(), rss: agent.rss() }];
    let mut commits: Vec<Commit> = Vec::new();
    let mut next_sample = SAMPLE_EVERY;
    let mut last_progress = Duration::ZERO;
    let interval = Duration::from_secs_f64(1.0 / f64::from(plan.rate.max(1)));
    let mut k: u32 = 0;
    while started.elapsed() < plan.duration {
        let due = interval * k;
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
        let i = (k as usize * 7919 + 1) % plan.size.services;
        grown[i] = !grown[i];
        let endpoints = plan.size.endpoints + usize::from(grown[i]);
        let now = SystemTime::now();
        api.apply(cluster::slice_object(&cluster::slice(i, endpoints, 0), i, Some(now)));
        sent.push(now);
        k += 1;
        if started.elapsed() >= next_sample {
            commits.extend(agent.drain().iter().filter_map(|l| l.commit()));
            samples.push(Sample { at: started.elapsed(), cpu: agent.cpu(), rss: agent.rss() });
            next_sample += SAMPLE_EVERY;
        }
        if started.elapsed() >= last_progress + Duration::from_secs(60) {
            last_progress = started.elapsed();
            eprintln!(
                "bench: churn {:.0} of {:.0} s, {} events, RSS {}",
                last_progress.as_secs_f64(),
                plan.duration.as_secs_f64(),
                sent.len(),
                mib(agent.rss())
            );
        }
    }
    // Let the last events be programmed, then stop everything.
    std::thread::sleep(Duration::from_secs(3));
    commits.extend(agent.drain().iter().filter_map(|l| l.commit()));
    samples.push(Sample { at: started.elapsed(), cpu: agent.cpu(), rss: agent.rss() });
    stop.store(true, Ordering::Relaxed);
    let tries = probe.join().map_err(|_| BenchError::Worker("the probe panicked".into()))??;
    let metric = node
        .ns
        .run(|| traffic::http_get(SocketAddr::from(([127, 0, 0, 1], 10249)), "/metrics", Duration::from_secs(5)))?
        .ok()
        .and_then(|(_, body)| programming_metric(&body));
    agent.stop();

    let result = summarize(plan, t0, &sent, &commits, &samples, &tries, metric);
    let title = format!(
        "nftproxy run, {} services × {} endpoints, {} endpoint updates/s",
        plan.size.services, plan.size.endpoints, plan.rate
    );
    let latency: Vec<(f64, f64, f64)> = result
        .minutes
        .iter()
        .enumerate()
        .map(|(m, row)| {
            (m as f64 + 1.0, row.latency_p50.as_secs_f64() * 1000.0, row.latency_p99.as_secs_f64() * 1000.0)
        })
        .collect();
    super::plot::churn(&plan.plot, &title, &latency, &samples_for_plot(&samples))?;
    Ok(result)
}

/// The probe service `bench/probe` and its EndpointSlice (the lab pods `web`, port 8080).
fn probe_objects(web: &[IpAddr]) -> Vec<serde_json::Value> {
    let endpoints: Vec<serde_json::Value> = web
        .iter()
        .map(|ip| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}, "nodeName": "node1"}))
        .collect();
    vec![
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "probe", "namespace": "bench", "resourceVersion": "1"},
            "spec": {"clusterIP": PROBE_IP, "clusterIPs": [PROBE_IP], "ipFamilies": ["IPv4"],
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}
        }),
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "probe-1", "namespace": "bench", "resourceVersion": "1",
                         "labels": {"kubernetes.io/service-name": "probe"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": endpoints
        }),
    ]
}

/// The latency of each event: from its sending to the end of the first sync that started at
/// least [`DELIVERY_MARGIN`] after it (`None`: no sync did).
fn latencies(sent: &[SystemTime], commits: &[Commit]) -> Vec<Option<Duration>> {
    let mut commits: Vec<&Commit> = commits.iter().collect();
    commits.sort_by_key(|c| c.started());
    let first_from = |t: SystemTime| commits.get(commits.partition_point(|c| c.started() < t)).copied();
    sent.iter()
        .map(|t| {
            // With no sync that late, the one that started within the margin carried it (the
            // last events of a run).
            let commit = first_from(*t + DELIVERY_MARGIN).or_else(|| first_from(*t))?;
            Some(commit.at.duration_since(*t).unwrap_or_default())
        })
        .collect()
}

/// `kubeproxy_network_programming_duration_seconds` from a `/metrics` text: mean, share ≤ 1 s,
/// share ≤ 2 s.
fn programming_metric(text: &str) -> Option<(Duration, f64, f64)> {
    let name = "kubeproxy_network_programming_duration_seconds";
    let value = |prefix: &str| -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .reduce(|a, b| a + b)
    };
    let count = value(&format!("{name}_count"))?;
    let sum = value(&format!("{name}_sum"))?;
    if count <= 0.0 {
        return None;
    }
    let bucket = |le: &str| value(&format!("{name}_bucket{{le=\"{le}\"")).unwrap_or(0.0) / count;
    Some((Duration::from_secs_f64(sum / count), bucket("1.0"), bucket("2.0")))
}

fn summarize(
    plan: &ChurnPlan,
    t0: SystemTime,
    sent: &[SystemTime],
    commits: &[Commit],
    samples: &[Sample],
    tries: &[(SystemTime, bool)],
    metric: Option<(Duration, f64, f64)>,
) -> ChurnResult {
    let lat = latencies(sent, commits);
    let minute_of = |t: SystemTime| t.duration_since(t0).unwrap_or_default().as_secs() as usize / 60;
    let minutes = (plan.duration.as_secs() as usize).div_ceil(60).max(1);
    let mut out = ChurnResult {
        plan: Some(plan.clone()),
        minutes: vec![Minute::default(); minutes],
        metric,
        ..ChurnResult::default()
    };
    let mut per_minute: Vec<Vec<Duration>> = vec![Vec::new(); minutes];
    let mut all = Vec::new();
    for (t, l) in sent.iter().zip(&lat) {
        let m = minute_of(*t).min(minutes - 1);
        out.minutes[m].events += 1;
        match l {
            Some(l) => {
                per_minute[m].push(*l);
                all.push(*l);
            }
            None => out.unprogrammed += 1,
        }
    }
    for c in commits {
        if let Ok(d) = c.at.duration_since(t0) {
            let m = (d.as_secs() as usize / 60).min(minutes - 1);
            out.minutes[m].syncs += 1;
        }
    }
    for (m, l) in per_minute.iter().enumerate() {
        out.minutes[m].latency_p50 = quantile(l, 0.5);
        out.minutes[m].latency_p99 = quantile(l, 0.99);
    }
    for (t, ok) in tries {
        let m = minute_of(*t).min(minutes - 1);
        if *ok {
            out.minutes[m].probe_ok += 1;
            out.probe_ok += 1;
        } else {
            out.minutes[m].probe_failed += 1;
            out.probe_failed += 1;
        }
    }
    // CPU per minute from the samples at or around its ends; RSS at its end.
    let at = |d: Duration| samples.iter().rev().find(|s| s.at <= d).or(samples.first()).copied();
    for m in 0..minutes {
        let (from, to) = (Duration::from_secs(60 * m as u64), Duration::from_secs(60 * (m as u64 + 1)));
        if let (Some(a), Some(b)) = (at(from), at(to))
            && b.at > a.at
        {
            out.minutes[m].cpu = (b.cpu.saturating_sub(a.cpu)).as_secs_f64() / (b.at - a.at).as_secs_f64();
            out.minutes[m].rss = b.rss;
        }
    }
    out.latency_p50 = quantile(&all, 0.5);
    out.latency_p99 = quantile(&all, 0.99);
    if let (Some(first), Some(last)) = (samples.first(), samples.last())
        && last.at > first.at
    {
        out.cpu = last.cpu.saturating_sub(first.cpu).as_secs_f64() / (last.at - first.at).as_secs_f64();
    }
    out.rss_minute_2 = at(Duration::from_secs(120)).map_or(0, |s| s.rss);
    out.rss_end = samples.last().map_or(0, |s| s.rss);
    out
}

/// (minutes since the start, CPU share over the interval before, RSS MiB) per sample.
fn samples_for_plot(samples: &[Sample]) -> Vec<(f64, f64, f64)> {
    samples
        .windows(2)
        .map(|w| {
            let cpu = w[1].cpu.saturating_sub(w[0].cpu).as_secs_f64() / (w[1].at - w[0].at).as_secs_f64().max(1e-9);
            (w[1].at.as_secs_f64() / 60.0, cpu * 100.0, w[1].rss as f64 / (1024.0 * 1024.0))
        })
        .collect()
}

/// The churn tables.
pub fn tables(r: &ChurnResult) -> String {
    let mut out = String::new();
    let Some(plan) = &r.plan else { return out };
    let _ = writeln!(
        out,
        "\n### Churn: `run` through the API watch at {}, {} endpoint updates/s for {}\n",
        plan.size,
        plan.rate,
        humantime::format_duration(plan.duration)
    );
    let _ = writeln!(
        out,
        "| minute | events | syncs | API event → commit p50 / p99 | CPU (share of one core) | RSS | probe connections / failures |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|");
    for (m, row) in r.minutes.iter().enumerate() {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} / {} | {:.1}% | {} | {} / {} |",
            m + 1,
            row.events,
            row.syncs,
            ms(row.latency_p50),
            ms(row.latency_p99),
            row.cpu * 100.0,
            mib(row.rss),
            row.probe_ok + row.probe_failed,
            row.probe_failed
        );
    }
    let growth = if r.rss_minute_2 > 0 {
        format!("{:+.1}%", 100.0 * (r.rss_end as f64 - r.rss_minute_2 as f64) / r.rss_minute_2 as f64)
    } else {
        "-".into()
    };
    let _ = writeln!(
        out,
        "\nWhole run: API event → commit p50 {} / p99 {} ({} events not programmed), CPU {:.1}% of one core, RSS {} at minute 2 → {} at the end ({growth}), probe {} connections, {} failures.",
        ms(r.latency_p50),
        ms(r.latency_p99),
        r.unprogrammed,
        r.cpu * 100.0,
        mib(r.rss_minute_2),
        mib(r.rss_end),
        r.probe_ok + r.probe_failed,
        r.probe_failed,
    );
    if let Some((mean, le1, le2)) = r.metric {
        let _ = writeln!(
            out,
            "nftproxy's own `kubeproxy_network_programming_duration_seconds`: mean {}, {:.1}% ≤ 1 s, {:.1}% ≤ 2 s.",
            ms(mean),
            le1 * 100.0,
            le2 * 100.0
        );
    }
    let _ = writeln!(out, "\n![API event → commit, CPU and RSS per minute of the churn run]({})", plan.plot_link);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn commit(start_ms: u64, took_ms: u64) -> Commit {
        let started = SystemTime::UNIX_EPOCH + Duration::from_millis(start_ms);
        Commit {
            at: started + Duration::from_millis(took_ms),
            took: Duration::from_millis(took_ms),
            kernel: Duration::ZERO,
            full: false,
            changed: 1,
        }
    }

    #[test]
    fn an_event_counts_in_the_first_sync_that_started_after_it() {
        let t = |ms: u64| SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
        let commits = [commit(1000, 20), commit(2000, 30)];
        let lat = latencies(&[t(500), t(995), t(1500), t(1995), t(2500)], &commits);
        assert_eq!(lat[0], Some(Duration::from_millis(520)));
        assert_eq!(lat[1], Some(Duration::from_millis(1035)), "too close to the first sync's start: the next");
        assert_eq!(lat[2], Some(Duration::from_millis(530)));
        assert_eq!(lat[3], Some(Duration::from_millis(35)), "no later sync: the one it was close to");
        assert_eq!(lat[4], None);
    }

    #[test]
    fn the_programming_metric_is_read_from_its_buckets() {
        let text = "kubeproxy_network_programming_duration_seconds_bucket{le=\"1.0\",ip_family=\"IPv4\"} 90\n\
                    kubeproxy_network_programming_duration_seconds_bucket{le=\"2.0\",ip_family=\"IPv4\"} 100\n\
                    kubeproxy_network_programming_duration_seconds_sum{ip_family=\"IPv4\"} 60.0\n\
                    kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"} 100\n";
        let (mean, le1, le2) = programming_metric(text).unwrap();
        assert_eq!(mean, Duration::from_millis(600));
        assert!((le1 - 0.9).abs() < 1e-9 && (le2 - 1.0).abs() < 1e-9);
        assert!(programming_metric("").is_none());
    }
}
