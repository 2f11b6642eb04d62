//! Randomised clusters as a three-way differential: upstream kube-proxy v1.37 (nftables mode),
//! nftproxy, and `nftproxy explain`'s prediction, through a real API server in the lab.
//!
//! - [`generate`]: a random but valid cluster from a seed (Services of every type, TCP and UDP,
//!   both traffic policies, affinity, topology, every endpoint condition, source ranges, named
//!   ports, now and then past nftproxy's shape thresholds).
//! - [`lab`]: the lab those clusters run in (pods with a thousand extra addresses each, echo
//!   servers that say which address they were reached at).
//! - [`probe`]: the probes, their outcomes, explain's predictions and how they compare.
//! - [`run`](mod@run): the runner (each proxy once over every seed) and the minimiser.
//!
//! `nftproxy-tools random --seeds 0..500` runs it and writes a dated results file
//! ([`report_markdown`]); the integration test `random::` runs a handful of seeds.

pub mod error;
pub mod generate;
pub mod lab;
pub mod probe;
pub mod run;

use std::fmt::Write as _;
use std::path::PathBuf;

pub use error::RandomError;
pub use run::{Options, Report};

/// `nftproxy-tools random` options.
#[derive(Debug, clap::Args)]
pub struct RandomArgs {
    /// Seeds to run: a range `A..B` (B excluded) or a comma-separated list.
    #[arg(long, default_value = "0..20")]
    pub seeds: String,
    /// Kinds of difference to minimise at most.
    #[arg(long, default_value_t = 5)]
    pub minimise: usize,
    /// Candidate scenarios tried at most while minimising one difference.
    #[arg(long, default_value_t = 60)]
    pub minimise_budget: usize,
    /// Where to write the dated results file (`random-YYYY-MM-DD.md`, then `-2`, `-3`, … for
    /// later runs that day).
    #[arg(long, default_value = "docs/differential")]
    pub out_dir: PathBuf,
}

/// Parses `A..B` or `a,b,c`.
pub fn parse_seeds(text: &str) -> Result<Vec<u64>, RandomError> {
    let bad = || RandomError::Seeds(text.to_string());
    if let Some((a, b)) = text.split_once("..") {
        let (a, b): (u64, u64) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
        return Ok((a..b).collect());
    }
    text.split(',').map(|s| s.trim().parse().map_err(|_| bad())).collect()
}

/// `nftproxy-tools random`: runs the seeds, prints the report and writes it to the results
/// directory; fails when any difference is not listed as deliberate.
pub fn run_cli(args: &RandomArgs) -> Result<(), RandomError> {
    crate::lab::require_privileges()?;
    let options = Options {
        seeds: parse_seeds(&args.seeds)?,
        nftproxy: crate::nftproxy_binary(),
        minimise: args.minimise,
        minimise_budget: args.minimise_budget,
        progress: true,
    };
    let report = run::run(&options)?;
    let date = humantime::format_rfc3339(std::time::SystemTime::now()).to_string();
    let text = report_markdown(&report, &args.seeds, &date[..10]);
    print!("{text}");
    std::fs::create_dir_all(&args.out_dir)?;
    // A second run on one day gets its own file: results are records, never overwritten.
    let path = (1..)
        .map(|n| match n {
            1 => args.out_dir.join(format!("random-{}.md", &date[..10])),
            n => args.out_dir.join(format!("random-{}-{n}.md", &date[..10])),
        })
        .find(|p| !p.exists())
        .unwrap_or_else(|| args.out_dir.join("random.md"));
    std::fs::write(&path, &text)?;
    eprintln!("written to {}", path.display());
    let unlisted = unlisted(&report);
    if !unlisted.is_empty() {
        return Err(RandomError::Cluster(format!("{} difference(s) not listed as deliberate", unlisted.len())));
    }
    Ok(())
}

/// The differences that [`crate::differences::DELIBERATE`] does not list.
pub fn unlisted(report: &Report) -> Vec<&run::Difference> {
    report.differences.iter().filter(|d| !crate::differences::is_deliberate(&d.check())).collect()
}

fn stats(mut values: Vec<f64>) -> String {
    if values.is_empty() {
        return "-".into();
    }
    values.sort_by(f64::total_cmp);
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let median = values[values.len() / 2];
    let max = values[values.len() - 1];
    format!("{mean:.2} / {median:.2} / {max:.2}")
}

/// The report as Markdown: what ran, the time it took, every difference, the minimised
/// scenarios.
pub fn report_markdown(report: &Report, seeds: &str, date: &str) -> String {
    let mut out = String::new();
    let ran: Vec<&run::SeedRun> = report.seeds.iter().filter(|s| s.failed.is_none()).collect();
    let probes: usize = ran.iter().map(|s| s.probes.len()).sum();
    let answered = |outcomes: &[probe::Outcome]| {
        outcomes.iter().filter(|o| matches!(o, probe::Outcome::Answered { .. } | probe::Outcome::Sticky { .. })).count()
    };
    let _ = writeln!(out, "# Randomised differential, {date}\n");
    let _ = writeln!(
        out,
        "`nftproxy-tools random --seeds {seeds}`: upstream kube-proxy v1.37.2 (nftables mode), nftproxy and `nftproxy explain` on {} generated clusters through a real API server (docs/differences.md, \"Randomised clusters\").\n",
        ran.len()
    );
    let _ = writeln!(out, "| | |\n|---|---|");
    let _ = writeln!(out, "| seeds run | {} (of {}) |", ran.len(), report.seeds.len());
    let _ = writeln!(
        out,
        "| Services / endpoints | {} / {} |",
        ran.iter().map(|s| s.services).sum::<usize>(),
        ran.iter().map(|s| s.endpoints).sum::<usize>()
    );
    let _ = writeln!(out, "| largest Service | {} endpoints |", ran.iter().map(|s| s.endpoints).max().unwrap_or(0));
    let _ = writeln!(
        out,
        "| probes | {probes} (answered: kube-proxy {}, nftproxy {}) |",
        ran.iter().map(|s| answered(&s.kube_proxy)).sum::<usize>(),
        ran.iter().map(|s| answered(&s.nftproxy)).sum::<usize>()
    );
    let _ = writeln!(
        out,
        "| differences | {} on {} seeds ({} not listed as deliberate) |",
        report.differences.len(),
        report.differences.iter().map(|d| d.seed).collect::<std::collections::BTreeSet<_>>().len(),
        unlisted(report).len()
    );
    let _ = writeln!(
        out,
        "| wall time | {:.0} s (setup {:.0} s) |",
        report.total.as_secs_f64(),
        report.setup.as_secs_f64()
    );
    if let Some(logs) = &report.logs {
        let _ = writeln!(out, "| proxies' logs (this machine) | `{}` |", logs.display());
    }
    for (proxy, start) in &report.starts {
        let _ = writeln!(out, "| {} healthy after start | {:.1} s |", proxy.name(), start.as_secs_f64());
    }
    let _ = writeln!(out, "\nPer seed, seconds (mean / median / max):\n");
    let _ = writeln!(out, "| | apply through the API | until synced | probes | whole seed |\n|---|---|---|---|---|");
    for (name, pick) in [
        ("kube-proxy", (|s: &run::SeedRun| s.timing_kube_proxy) as fn(&run::SeedRun) -> run::Timing),
        ("nftproxy", |s: &run::SeedRun| s.timing_nftproxy),
    ] {
        let t: Vec<run::Timing> = ran.iter().map(|s| pick(s)).collect();
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {} |",
            stats(t.iter().map(|t| t.apply.as_secs_f64()).collect()),
            stats(t.iter().map(|t| t.sync.as_secs_f64()).collect()),
            stats(t.iter().map(|t| t.probe.as_secs_f64()).collect()),
            stats(t.iter().map(|t| t.total().as_secs_f64()).collect()),
        );
    }
    let _ = writeln!(
        out,
        "| explain (all probes of a seed) | | | {} | |",
        stats(ran.iter().map(|s| s.explain.as_secs_f64()).collect())
    );
    let failed: Vec<&run::SeedRun> = report.seeds.iter().filter(|s| s.failed.is_some()).collect();
    if !failed.is_empty() {
        let _ = writeln!(out, "\n## Seeds not run\n");
        for s in failed {
            let _ = writeln!(out, "- {}", s.failed.as_deref().unwrap_or(""));
        }
    }
    let _ = writeln!(out, "\n## Differences\n");
    if report.differences.is_empty() {
        let _ = writeln!(out, "None.");
    }
    let mut by_check: std::collections::BTreeMap<String, Vec<&run::Difference>> = Default::default();
    for d in &report.differences {
        by_check.entry(d.check()).or_default().push(d);
    }
    for (check, ds) in &by_check {
        let listed = if crate::differences::is_deliberate(check) { " (deliberate)" } else { "" };
        let seeds: std::collections::BTreeSet<u64> = ds.iter().map(|d| d.seed).collect();
        let _ = writeln!(out, "### {check}{listed}\n\n{} probe(s), seeds {seeds:?}. First:\n", ds.len());
        let d = ds[0];
        let _ = writeln!(
            out,
            "- seed {}, `{}` ({} → {} {})\n- kube-proxy: {}\n- nftproxy: {}\n- explain: {}\n",
            d.seed,
            d.probe.key,
            d.probe.who.host(),
            d.probe.target,
            d.probe.protocol.name(),
            d.kube_proxy,
            d.nftproxy,
            d.predicted
        );
    }
    if !report.minimised.is_empty() {
        let _ = writeln!(out, "## Minimised scenarios\n");
        for m in &report.minimised {
            let d = &m.difference;
            let _ = writeln!(
                out,
                "### seed {}: {}\n\n`{}`, {} candidates tried in {:.0} s. With the minimised objects: {}; explain: {}.\n\n```yaml\n{}```\n",
                d.seed,
                d.check(),
                d.probe.key,
                m.tried,
                m.took.as_secs_f64(),
                m.outcome,
                m.predicted,
                m.yaml
            );
        }
    }
    out
}
