//! The sizing table: what `nftproxy run` needs at each cluster size — its first sync, the CPU
//! and peak memory that took, what it keeps while running, and a restart over its own rules (a
//! DaemonSet rollout) — and the DaemonSet's memory request and limit derived from it. The one
//! source for the sizes docs/install.md quotes; `integration/deploy.rs` checks that
//! `deploy/daemonset.yaml` and the chart ask for what [`resources`] derives from the latest
//! table.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use super::agent::{Agent, file_size};
use super::e2e::{Files, run_flags};
use super::error::BenchError;
use super::figures::{mib, ms};
use crate::cluster::Size;
use crate::lab::Netns;

/// The size the DaemonSet's memory limit is set for: Services of 10 endpoints.
pub const LIMIT_FOR_SERVICES: usize = 50_000;
/// The size its memory request is set for (a typical cluster).
pub const REQUEST_FOR_SERVICES: usize = 10_000;
/// The limit's room above the measured peak.
pub const LIMIT_HEADROOM: f64 = 1.5;

/// One size's figures.
#[derive(Debug, Clone, Copy)]
pub struct Row {
    pub size: Size,
    /// The manifests file read.
    pub file: u64,
    /// Process start to the end of the first sync.
    pub first_sync: Duration,
    /// CPU time (user and system) the process used to get there.
    pub first_sync_cpu: Duration,
    /// Peak resident memory (VmHWM) a second after the first sync.
    pub peak_rss: u64,
    /// Resident memory then: what the running agent keeps.
    pub rss: u64,
    /// A new process over the rules in the kernel: start to the end of its first sync.
    pub restart: Duration,
    pub restart_cpu: Duration,
    pub restart_peak_rss: u64,
    /// The first sync itself (its `synced` line: planning to commit) and the kernel's share.
    pub sync: (Duration, Duration),
    /// The same of the restart's first sync.
    pub restart_sync: (Duration, Duration),
}

/// The memory request and limit derived from a table, in MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resources {
    pub request_mib: u64,
    pub limit_mib: u64,
}

fn progress(what: &str) {
    eprintln!("bench: {what}");
}

/// One start of `run` to its first sync: the time, CPU and memory, and the sync's own time with
/// the kernel's share.
struct Started {
    took: Duration,
    cpu: Duration,
    peak: u64,
    rss: u64,
    sync: (Duration, Duration),
}

/// `run --manifests` at `size` in a fresh namespace, to its first sync; stopped (SIGTERM: the
/// rules stay), then started again over them.
fn measure_size(size: Size, files: &Files) -> Result<Row, BenchError> {
    let path = files.manifests(size, false)?;
    let ns = Netns::create("sizing")?;
    let mut args = vec!["run".to_string(), "--manifests".into(), path.display().to_string()];
    args.extend(run_flags());
    let start = |what: &str| -> Result<Started, BenchError> {
        progress(&format!("sizing: {what} at {size}"));
        let started = Instant::now();
        let mut agent = Agent::start(&ns, &args)?;
        let (commit, _) = agent.next_commit(Duration::from_secs(900))?;
        let took = started.elapsed();
        let cpu = agent.cpu();
        std::thread::sleep(Duration::from_secs(1));
        let (peak, rss) = (agent.peak_rss(), agent.rss());
        agent.stop();
        Ok(Started { took, cpu, peak, rss, sync: (commit.took, commit.kernel) })
    };
    let first = start("run --manifests, first sync")?;
    let restart = start("restart over its rules")?;
    Ok(Row {
        size,
        file: file_size(&path),
        first_sync: first.took,
        first_sync_cpu: first.cpu,
        peak_rss: first.peak,
        rss: first.rss,
        restart: restart.took,
        restart_cpu: restart.cpu,
        restart_peak_rss: restart.peak,
        sync: first.sync,
        restart_sync: restart.sync,
    })
}

/// Measures every size, smallest first.
pub fn run(sizes: &[Size], files: &Files) -> Result<Vec<Row>, BenchError> {
    let mut sizes = sizes.to_vec();
    sizes.sort_by_key(|s| (s.services * s.endpoints, s.services));
    sizes.iter().map(|&s| measure_size(s, files)).collect()
}

/// MiB, rounded up to a multiple of `step`.
fn round_up(bytes: f64, step: u64) -> u64 {
    let mib = (bytes / (1024.0 * 1024.0)).ceil() as u64;
    mib.div_ceil(step) * step
}

/// The DaemonSet's memory request and limit from `(size, peak RSS of the first sync or the
/// restart, whichever is higher)`: the request covers the peak of the largest measured size up
/// to [`REQUEST_FOR_SERVICES`] × 10 (16 MiB steps); the limit is [`LIMIT_HEADROOM`] × the peak
/// of the largest measured size up to [`LIMIT_FOR_SERVICES`] × 10 (64 MiB steps). `None`
/// without a measured size of 10 endpoints up to each.
pub fn resources(peaks: &[(Size, u64)]) -> Option<Resources> {
    let at_most = |services: usize| {
        peaks
            .iter()
            .filter(|(s, _)| s.endpoints == 10 && s.services <= services)
            .max_by_key(|(s, _)| s.services)
            .map(|(_, peak)| *peak as f64)
    };
    let request = at_most(REQUEST_FOR_SERVICES)?;
    let limit = at_most(LIMIT_FOR_SERVICES)?;
    Some(Resources { request_mib: round_up(request, 16), limit_mib: round_up(limit * LIMIT_HEADROOM, 64) })
}

/// The start of the sizing table's first line, as `table` writes it (the deploy test finds the
/// table by it; tables since 2026-11-28 have two more columns after it).
pub const TABLE_HEAD: &str = "| Services × endpoints | manifests | first sync | its CPU | peak RSS | RSS running | restart: first sync | its CPU | its peak RSS |";
/// The columns after [`TABLE_HEAD`]: each first sync's own duration and its kernel's share.
const SYNC_COLUMNS: &str = " the sync itself (kernel) | restart: the sync itself (kernel) |";

/// The table, then the requests and limits it gives.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from("\n## Sizing\n\n");
    out.push_str(
        "`nftproxy run --manifests` on the synthetic cluster of each size, in a fresh network namespace: from \
         the process's start to the end of its first sync, the CPU time it used to get there, its peak RSS \
         (`VmHWM`) and its RSS a second later; then the process stopped (SIGTERM: the rules stay) and a new \
         one started over the rules in the kernel, as a DaemonSet rollout restarts it. The last two \
         columns are each first sync itself, as its `synced` line gives it (planning to the kernel's \
         answer, after the manifests were read), and in brackets the kernel's share (`kernel_ms`: the \
         transaction sent to its answer).\n\n",
    );
    out.push_str(TABLE_HEAD);
    out.push_str(SYNC_COLUMNS);
    out.push('\n');
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        let sync = |(took, kernel): (Duration, Duration)| format!("{} ({})", ms(took), ms(kernel));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.size,
            mib(r.file),
            ms(r.first_sync),
            ms(r.first_sync_cpu),
            mib(r.peak_rss),
            mib(r.rss),
            ms(r.restart),
            ms(r.restart_cpu),
            mib(r.restart_peak_rss),
            sync(r.sync),
            sync(r.restart_sync)
        );
    }
    let peaks: Vec<(Size, u64)> = rows.iter().map(|r| (r.size, r.peak_rss.max(r.restart_peak_rss))).collect();
    match resources(&peaks) {
        Some(res) => {
            let _ = write!(
                out,
                "\n**Requests and limits** derived from this table (`bench::sizing::resources`): memory request \
                 **{}Mi** (the peak at up to {} Services × 10), memory limit **{}Mi** ({}× the peak at up to {} \
                 Services × 10); no CPU limit, as kube-proxy (a throttled sync is a late one).\n",
                res.request_mib, REQUEST_FOR_SERVICES, res.limit_mib, LIMIT_HEADROOM, LIMIT_FOR_SERVICES
            );
        }
        None => {
            let _ = writeln!(
                out,
                "\nNo requests and limits: the table needs sizes of 10 endpoints up to {REQUEST_FOR_SERVICES} and \
                 {LIMIT_FOR_SERVICES} Services."
            );
        }
    }
    out
}

/// Reads the peaks back from a results file's sizing table: `(size, max(peak RSS, restart's
/// peak RSS))`, bytes (as written, to the MiB).
pub fn peaks_in(text: &str) -> Vec<(Size, u64)> {
    let mut lines = text.lines().skip_while(|l| !l.starts_with(TABLE_HEAD)).skip(2);
    let mut out = Vec::new();
    for line in lines.by_ref().take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let mib_of = |c: &str| c.trim_end_matches(" MiB").parse::<u64>().ok().map(|m| m * 1024 * 1024);
        let (Some(size), Some(peak), Some(restart)) = (
            cells.first().and_then(|s| parse_size(s)),
            cells.get(4).and_then(|c| mib_of(c)),
            cells.get(8).and_then(|c| mib_of(c)),
        ) else {
            continue;
        };
        out.push((size, peak.max(restart)));
    }
    out
}

/// `10,000 × 10` (as `Size` prints itself) or `10000x10`.
fn parse_size(text: &str) -> Option<Size> {
    let clean: String = text.chars().filter(|c| !c.is_whitespace() && *c != ',').collect();
    let (s, e) = clean.split_once(['×', 'x'])?;
    Some(Size { services: s.parse().ok()?, endpoints: e.parse().ok()? })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(services: usize, endpoints: usize) -> Size {
        Size { services, endpoints }
    }

    #[test]
    fn requests_and_limits_come_from_the_table() {
        let mib = |m: u64| m * 1024 * 1024;
        let peaks = [(size(1000, 10), mib(30)), (size(10_000, 10), mib(90)), (size(50_000, 10), mib(300))];
        assert_eq!(resources(&peaks), Some(Resources { request_mib: 96, limit_mib: 512 }));
        // Sizes past the limit's don't count; a table without them gives nothing.
        let more = [peaks.as_slice(), &[(size(100_000, 10), mib(700))]].concat();
        assert_eq!(resources(&more), resources(&peaks));
        assert_eq!(resources(&[(size(1000, 10), mib(30))]), Some(Resources { request_mib: 32, limit_mib: 64 }));
        assert_eq!(resources(&[(size(44_000, 1), mib(30))]), None);
    }

    #[test]
    fn the_table_reads_back() {
        let row = |services, peak| Row {
            size: size(services, 10),
            file: 1 << 20,
            first_sync: Duration::from_millis(700),
            first_sync_cpu: Duration::from_millis(600),
            peak_rss: peak,
            rss: peak / 2,
            restart: Duration::from_millis(900),
            restart_cpu: Duration::from_millis(800),
            restart_peak_rss: peak + (3 << 20),
            sync: (Duration::from_millis(500), Duration::from_millis(300)),
            restart_sync: (Duration::from_millis(400), Duration::from_millis(10)),
        };
        let text = table(&[row(1000, 20 << 20), row(50_000, 300 << 20)]);
        assert_eq!(peaks_in(&text), [(size(1000, 10), 23 << 20), (size(50_000, 10), 303 << 20)]);
        assert!(text.contains("| 500 ms (300 ms) | 400 ms (10.0 ms) |"), "{text}");
        assert!(text.contains("memory limit **512Mi**"), "{text}");
    }
}
