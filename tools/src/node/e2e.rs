//! Kubernetes' own end-to-end tests (`e2e.test` v1.37.2, built from the pinned module) against
//! real nodes, twice on the same cluster: with upstream kube-proxy from kubeadm's DaemonSet
//! (nftables mode, the reference), then with nftproxy after the image swap. Each run's spec
//! results come from ginkgo's JSON report; the comparison is the point: a spec upstream passes
//! must pass with nftproxy.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::cluster::ClusterError;
use super::error::NodeError;
use super::scenario::{NFTPROXY_IMAGE, NodeScenario};

/// The specs a selection runs: ginkgo's focus and skip expressions.
#[derive(Debug, Clone)]
pub struct Selection {
    pub name: &'static str,
    pub focus: String,
    pub skip: String,
}

/// What upstream's own kind job for the network tests skips
/// (`ci-kubernetes-kind-network*`: features a kind cluster lacks, cloud load balancers,
/// NetworkPolicy, dual-stack on a single-stack cluster), and what this machine cannot do, each
/// with its reason (docs/e2e/README.md lists them).
pub const SKIPS: [(&str, &str); 9] = [
    (r"\[Feature:(Networking-IPv6|Example|Federation|PerformanceDNS)\]", "upstream's kind network job skips them"),
    (
        r"LB.health.check|LoadBalancer|load.balancer|GCE",
        "a cloud load balancer (upstream's kind network job skips them)",
    ),
    (r"NetworkPolicy", "NetworkPolicy is the CNI's, not the proxy's (upstream's kind network job skips them)"),
    (r"DualStack", "the cluster is single-stack IPv4 (upstream's kind network job skips them on one)"),
    (r"\[Feature:SCTPConnectivity\]|SCTP HostPort", "this machine's kernel has no SCTP (CONFIG_IP_SCTP unset)"),
    (r"\[Feature:Networking-(IPv4|DNS)\]", "no Internet connection here"),
    (r"\[Feature:Networking-Performance\]", "iperf throughput figures, not a pass or fail of the proxy"),
    (
        r"should recreate its iptables rules if they are deleted",
        "it deletes kubelet's iptables rules over SSH; the nodes have no SSH",
    ),
    (
        r"should work after restarting (apiserver|kube-proxy)",
        "it restarts components over SSH or the cloud's API; the nodes have neither",
    ),
];

impl Selection {
    /// The Conformance specs of `[sig-network]` (47 in v1.37.2): what CI runs.
    pub fn conformance() -> Selection {
        Selection { name: "conformance", focus: r"\[sig-network\].*\[Conformance\]".into(), skip: skip_expression() }
    }

    /// `[sig-network] Services` with every spec that touches Services, DNS through a ClusterIP,
    /// EndpointSlices and Networking, and the Conformance specs of `[sig-network]`.
    pub fn wide() -> Selection {
        Selection {
            name: "wide",
            focus: concat!(
                r"\[sig-network\] (Services|Networking|DNS|EndpointSlice|EndpointSliceMirroring|Endpoints|",
                r"EndpointsController|Service endpoints latency|API Server)|\[sig-network\].*\[Conformance\]"
            )
            .into(),
            skip: skip_expression(),
        }
    }
}

fn skip_expression() -> String {
    SKIPS.iter().map(|(e, _)| *e).collect::<Vec<_>>().join("|")
}

/// One spec's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecResult {
    pub state: String,
    pub took: Duration,
    /// The failure's or skip's message, first line.
    pub message: String,
}

/// One run of a selection: spec name → outcome.
#[derive(Debug, Clone, Default)]
pub struct E2eRun {
    pub specs: BTreeMap<String, SpecResult>,
    pub took: Duration,
}

impl E2eRun {
    /// How many specs ended in `state`.
    pub fn count(&self, state: &str) -> usize {
        self.specs.values().filter(|s| s.state == state).count()
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SuiteReport {
    spec_reports: Vec<SpecReport>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SpecReport {
    #[serde(default)]
    container_hierarchy_texts: Option<Vec<String>>,
    #[serde(default)]
    leaf_node_text: String,
    leaf_node_type: String,
    state: String,
    #[serde(default)]
    run_time: u64,
    #[serde(default)]
    failure: Option<Failure>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Failure {
    #[serde(default)]
    message: String,
}

/// Reads ginkgo's JSON report: every spec that ran, or that skipped itself while running (a
/// spec the selection left out has no run time and no message, and is not listed).
pub fn parse_report(json: &str) -> Result<BTreeMap<String, SpecResult>, String> {
    let suites: Vec<SuiteReport> = serde_json::from_str(json).map_err(|e| format!("ginkgo's JSON report: {e}"))?;
    let mut out = BTreeMap::new();
    for spec in suites.into_iter().flat_map(|s| s.spec_reports) {
        if spec.leaf_node_type != "It" {
            continue;
        }
        let message =
            spec.failure.map(|f| f.message.lines().next().unwrap_or("").trim().to_string()).unwrap_or_default();
        if spec.state == "skipped" && spec.run_time == 0 && message.is_empty() {
            continue;
        }
        let mut name = spec.container_hierarchy_texts.unwrap_or_default().join(" ");
        name.push(' ');
        name.push_str(&spec.leaf_node_text);
        out.insert(name, SpecResult { state: spec.state, took: Duration::from_nanos(spec.run_time), message });
    }
    Ok(out)
}

/// How many ginkgo processes run specs at once (`[Serial]` ones still run alone, at the end):
/// most of a spec's time is spent waiting for pods, so a few in parallel use the two cores
/// better than one.
pub const PARALLEL: usize = 4;

/// Runs `e2e.test` with `selection` from the wan client (outside the cluster, as a CI runner
/// is), as the admin, through ginkgo's CLI with `procs` processes (built with the other
/// upstream binaries), and reads its report. `dir` keeps the report and the log.
pub fn run_suite(s: &NodeScenario, selection: &Selection, procs: usize, dir: &Path) -> Result<E2eRun, ClusterError> {
    std::fs::create_dir_all(dir).map_err(NodeError::from)?;
    let bins = &s.cluster.cp.bins;
    let client = s
        .cluster
        .lab
        .clients
        .iter()
        .find(|c| c.name == "client")
        .ok_or_else(|| NodeError::Setup("no wan client".into()))?;
    let log = std::fs::File::create(dir.join("e2e.log")).map_err(NodeError::from)?;
    let bin_dir = bins.path("kubectl").parent().map(Path::to_path_buf).unwrap_or_default();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let started = Instant::now();
    let status = std::process::Command::new("ip")
        .args(["netns", "exec", client.ns.name()])
        .arg(bins.path("ginkgo"))
        .arg(format!("--procs={}", procs.max(1)))
        .args(["--no-color", "--succinct", "--timeout=2h"])
        .arg(format!("--focus={}", selection.focus))
        .arg(format!("--skip={}", selection.skip))
        .arg(format!("--output-dir={}", dir.display()))
        .arg("--json-report=report.json")
        .arg(bins.path("e2e.test"))
        .arg("--")
        .arg(format!("--kubeconfig={}", s.cluster.cp.admin_kubeconfig().display()))
        .args(["--provider=local", "--num-nodes=2"])
        .env("PATH", path)
        .current_dir(dir)
        .stdout(log.try_clone().map_err(NodeError::from)?)
        .stderr(log)
        .status()
        .map_err(|e| NodeError::Setup(format!("cannot run ginkgo: {e}")))?;
    let took = started.elapsed();
    let text = std::fs::read_to_string(dir.join("report.json")).map_err(|e| NodeError::Failed {
        what: format!("ginkgo ({status}) wrote no report in {}", dir.display()),
        output: e.to_string(),
    })?;
    let specs = parse_report(&text).map_err(|e| NodeError::Failed { what: "ginkgo's report".into(), output: e })?;
    Ok(E2eRun { specs, took })
}

/// Both columns on one cluster: `selection` with kubeadm's kube-proxy, the image swap, then
/// `selection` with nftproxy.
pub struct Comparison {
    pub selection: Selection,
    pub reference: E2eRun,
    pub nftproxy: E2eRun,
}

impl Comparison {
    /// Specs upstream's kube-proxy passed and nftproxy did not.
    pub fn regressions(&self) -> Vec<(&str, &SpecResult)> {
        self.reference
            .specs
            .iter()
            .filter(|(_, r)| r.state == "passed")
            .filter_map(|(name, _)| {
                let ours = self.nftproxy.specs.get(name)?;
                (ours.state != "passed").then_some((name.as_str(), ours))
            })
            .chain(
                self.reference
                    .specs
                    .iter()
                    .filter(|(name, r)| r.state == "passed" && !self.nftproxy.specs.contains_key(*name))
                    .map(|(name, r)| (name.as_str(), r)),
            )
            .collect()
    }

    /// The results file's table: spec, reference result, nftproxy's, times; then the skips.
    pub fn to_markdown(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let col = |r: Option<&SpecResult>| match r {
            Some(r) => format!("{} ({:.0} s)", r.state, r.took.as_secs_f64()),
            None => "not run".into(),
        };
        let _ = writeln!(
            out,
            "| | kube-proxy v1.37.2 (nftables) | nftproxy |\n|---|---:|---:|\n| passed | {} | {} |\n| failed | {} | {} |\n| skipped while running | {} | {} |\n| time | {:.0} min | {:.0} min |\n",
            self.reference.count("passed"),
            self.nftproxy.count("passed"),
            self.reference.count("failed") + self.reference.count("timedout") + self.reference.count("panicked"),
            self.nftproxy.count("failed") + self.nftproxy.count("timedout") + self.nftproxy.count("panicked"),
            self.reference.count("skipped"),
            self.nftproxy.count("skipped"),
            self.reference.took.as_secs_f64() / 60.0,
            self.nftproxy.took.as_secs_f64() / 60.0,
        );
        let _ = writeln!(out, "| spec | kube-proxy v1.37.2 (nftables) | nftproxy |\n|---|---|---|");
        let mut names: Vec<&String> = self.reference.specs.keys().chain(self.nftproxy.specs.keys()).collect();
        names.sort();
        names.dedup();
        for name in names {
            let _ = writeln!(
                out,
                "| {} | {} | {} |",
                name.replace('|', "\\|"),
                col(self.reference.specs.get(name)),
                col(self.nftproxy.specs.get(name))
            );
        }
        let failing: Vec<(&String, &SpecResult, Option<&SpecResult>)> = self
            .reference
            .specs
            .iter()
            .filter(|(_, r)| r.state != "passed")
            .map(|(n, r)| (n, r, self.nftproxy.specs.get(n)))
            .collect();
        if !failing.is_empty() {
            let _ = writeln!(out, "\nNot passed by the reference, with its message:\n");
            for (name, r, ours) in failing {
                let _ = writeln!(
                    out,
                    "- {name}: {} — {}; nftproxy: {}",
                    r.state,
                    r.message,
                    ours.map_or("not run", |o| o.state.as_str())
                );
            }
        }
        out
    }
}

/// Runs `selection` with kubeadm's kube-proxy, swaps the image (`kubectl set image`), and runs
/// it again; reports and logs go under `dir`.
pub fn compare(s: &mut NodeScenario, selection: Selection, dir: &Path) -> Result<Comparison, ClusterError> {
    let reference = run_suite(s, &selection, PARALLEL, &dir.join("kube-proxy"))?;
    s.swap_image(NFTPROXY_IMAGE)?;
    let nftproxy = run_suite(s, &selection, PARALLEL, &dir.join("nftproxy"))?;
    Ok(Comparison { selection, reference, nftproxy })
}

/// Where `e2e` keeps a run's reports.
pub fn work_dir(base: &Path, name: &str) -> PathBuf {
    base.join(format!("e2e-{name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_lists_what_ran_and_what_skipped_itself() {
        let json = r#"[{"SpecReports": [
            {"LeafNodeType": "SynchronizedBeforeSuite", "State": "passed", "RunTime": 5},
            {"ContainerHierarchyTexts": ["[sig-network] Services"], "LeafNodeText": "should serve [Conformance]",
             "LeafNodeType": "It", "State": "passed", "RunTime": 10000000000},
            {"ContainerHierarchyTexts": ["[sig-network] Netpol"], "LeafNodeText": "left out",
             "LeafNodeType": "It", "State": "skipped", "RunTime": 0},
            {"ContainerHierarchyTexts": ["[sig-network] Services"], "LeafNodeText": "needs ssh",
             "LeafNodeType": "It", "State": "skipped", "RunTime": 300, "Failure": {"Message": "Only supported for providers [gce]\nmore"}},
            {"ContainerHierarchyTexts": ["[sig-network] DNS"], "LeafNodeText": "fails",
             "LeafNodeType": "It", "State": "failed", "RunTime": 7, "Failure": {"Message": "timed out"}}
        ]}]"#;
        let specs = parse_report(json).unwrap();
        let names: Vec<&str> = specs.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "[sig-network] DNS fails",
                "[sig-network] Services needs ssh",
                "[sig-network] Services should serve [Conformance]"
            ]
        );
        assert_eq!(specs["[sig-network] Services needs ssh"].message, "Only supported for providers [gce]");
        assert_eq!(specs["[sig-network] Services should serve [Conformance]"].took, Duration::from_secs(10));
    }

    #[test]
    fn a_spec_the_reference_passed_and_nftproxy_did_not_is_a_regression() {
        let result = |state: &str| SpecResult { state: state.into(), took: Duration::ZERO, message: String::new() };
        let reference = E2eRun {
            specs: BTreeMap::from([
                ("a".into(), result("passed")),
                ("b".into(), result("failed")),
                ("c".into(), result("passed")),
            ]),
            took: Duration::ZERO,
        };
        let nftproxy = E2eRun {
            specs: BTreeMap::from([("a".into(), result("failed")), ("b".into(), result("failed"))]),
            took: Duration::ZERO,
        };
        let c = Comparison { selection: Selection::conformance(), reference, nftproxy };
        let regressions: Vec<&str> = c.regressions().into_iter().map(|(n, _)| n).collect();
        assert_eq!(regressions, ["a", "c"]);
    }
}
