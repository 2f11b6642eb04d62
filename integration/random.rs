//! Randomised clusters (`nftproxy_tools::random`) as a three-way differential, a handful of
//! seeds: upstream kube-proxy v1.37 (nftables mode) and nftproxy each run once over the seeds'
//! generated clusters through the real API server, `nftproxy explain` predicts every probe, and
//! any difference that docs/differences.md does not list (the tools' `differences` lists, shared
//! with differential.rs) fails the test. `nftproxy-tools random --seeds 0..500` runs hundreds.

use crate::common::*;
use nftproxy_tools::random::{self, Options, probe::Outcome};

/// The seeds CI runs: every Service type, both policies, affinity, topology, a Service of over
/// 1,023 endpoints with affinity (seed 1) and one past 16 (seed 6).
const SEEDS: std::ops::Range<u64> = 0..8;

#[test]
fn random_clusters_agree_with_kube_proxy_and_explain() {
    if skip_unless_privileged() {
        return;
    }
    let _one = crate::control_plane::ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let options = Options {
        seeds: SEEDS.collect(),
        nftproxy: std::path::PathBuf::from(env!("CARGO_BIN_EXE_nftproxy")),
        minimise: 2,
        minimise_budget: 25,
        progress: true,
    };
    let report = random::run::run(&options).unwrap_or_else(|e| panic!("{e}"));
    let text = random::report_markdown(&report, &format!("{SEEDS:?}"), "test");
    eprintln!("{text}");

    let failed: Vec<&str> = report.seeds.iter().filter_map(|s| s.failed.as_deref()).collect();
    assert!(failed.is_empty(), "seeds that did not run: {failed:?}");
    // The probes reach real endpoints through both proxies (a lab that answers nothing would
    // agree on everything).
    let answered = |pick: fn(&random::run::SeedRun) -> &Vec<Outcome>| {
        report
            .seeds
            .iter()
            .flat_map(|s| pick(s).iter())
            .filter(|o| matches!(o, Outcome::Answered { .. } | Outcome::Sticky { .. }))
            .count()
    };
    let probes: usize = report.seeds.iter().map(|s| s.probes.len()).sum();
    let (kube_proxy, nftproxy) = (answered(|s| &s.kube_proxy), answered(|s| &s.nftproxy));
    assert!(
        probes > 200 && kube_proxy > probes / 2 && nftproxy > probes / 2,
        "{kube_proxy} and {nftproxy} of {probes}"
    );
    assert!(report.seeds.iter().any(|s| s.endpoints > 1023), "the seeds include a Service past 1,023 endpoints");

    let unlisted = random::unlisted(&report);
    assert!(
        unlisted.is_empty(),
        "{} difference(s) from upstream or explain that docs/differences.md does not list (the report above has them, minimised):\n{}",
        unlisted.len(),
        unlisted.iter().map(|d| format!("seed {}: {}", d.seed, d.check())).collect::<Vec<_>>().join("\n")
    );
}
