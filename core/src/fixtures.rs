//! The planner's test fixtures: the golden scenarios of `nft-templates/` (manifests, settings,
//! expected ruleset and transactions), the settings and node they are planned for, and the
//! comparison with expected files. Built for this crate's tests and, with the
//! `testing` feature, for the agent crate's.

use std::path::{Path, PathBuf};

use crate::config::{ProxyConfig, parse_cidrs};
use crate::manifests::{self, state_from_manifests};
use crate::model::ClusterState;
use crate::plan::placement::Placement;
use crate::plan::{NodePorts, Plan, PlanInput, demands, families, plan_placed};

/// The node every fixture runs on.
pub const NODE: &str = "node1";

/// A cluster state from manifest YAML.
pub fn state(yaml: &str) -> ClusterState {
    let mut m = manifests::Manifests::default();
    manifests::load_text(Path::new("fixture.yaml"), yaml, &mut m);
    assert!(m.problems.is_empty(), "fixture problems: {:?}", m.problems);
    let (state, problems) = state_from_manifests(&m, NODE);
    assert!(problems.is_empty(), "fixture problems: {problems:?}");
    state
}

/// The settings fixtures use: cluster CIDR 10.0.0.0/8.
pub fn config() -> ProxyConfig {
    let mut c = ProxyConfig::new(NODE);
    c.cluster_cidrs = parse_cidrs("--cluster-cidr", "10.0.0.0/8").unwrap_or_default();
    c
}

/// Plans with node ports on 192.168.0.2 / fd00:192:168::2, for an empty kernel.
pub fn plan_with(config: &ProxyConfig, state: &ClusterState) -> Plan {
    plan_after(config, state, &mut Placement::new())
}

/// Plans like [`plan_with`], keeping endpoint windows where `placement` has them, as a full
/// sync does.
pub fn plan_after(config: &ProxyConfig, state: &ClusterState, placement: &mut Placement) -> Plan {
    let (v4, v6) = default_node_ports();
    plan_placed_with(config, state, &v4, &v6, placement)
}

/// The directory of golden scenarios.
pub fn scenarios_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new("..")).join("nft-templates")
}

/// Whether `NFTPROXY_UPDATE_GOLDEN` asks for expected files to be rewritten.
pub fn updating_golden() -> bool {
    std::env::var_os("NFTPROXY_UPDATE_GOLDEN").is_some()
}

/// The text of an expected file without its header of `#` lines (the description a human
/// wrote, which a rewrite keeps).
fn without_header(text: &str) -> String {
    text.lines().filter(|l| !l.starts_with('#')).map(|l| format!("{l}\n")).collect()
}

/// Compares `actual` with the expected file at `path` (its `#` header aside) and returns the
/// difference, if any; `NFTPROXY_UPDATE_GOLDEN=1` rewrites the file first, keeping the header.
pub fn check_expected(path: &Path, actual: &str) -> Option<String> {
    if updating_golden() {
        let old = std::fs::read_to_string(path).unwrap_or_default();
        let header: String = old.lines().take_while(|l| l.starts_with('#')).map(|l| format!("{l}\n")).collect();
        std::fs::write(path, format!("{header}{actual}")).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    let expected = match std::fs::read_to_string(path) {
        Ok(text) => without_header(&text),
        Err(e) => return Some(format!("{}: {e} (NFTPROXY_UPDATE_GOLDEN=1 writes it)", path.display())),
    };
    (expected != actual).then(|| format!("{} differs:\n{}", path.display(), line_diff(&expected, actual)))
}

/// The lines only in `expected` (`-`) or only in `actual` (`+`), in order, up to 40 of them:
/// enough to see what changed without printing two whole rulesets.
fn line_diff(expected: &str, actual: &str) -> String {
    let (e, a): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    // The longest common subsequence, by dynamic programming over suffixes.
    let mut lcs = vec![vec![0u32; a.len() + 1]; e.len() + 1];
    for i in (0..e.len()).rev() {
        for j in (0..a.len()).rev() {
            lcs[i][j] = if e[i] == a[j] { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < e.len() || j < a.len() {
        if i < e.len() && j < a.len() && e[i] == a[j] {
            (i, j) = (i + 1, j + 1);
        } else if i < e.len() && (j == a.len() || lcs[i + 1][j] >= lcs[i][j + 1]) {
            out.push(format!("-{}", e[i]));
            i += 1;
        } else {
            out.push(format!("+{}", a[j]));
            j += 1;
        }
    }
    let more = out.len().saturating_sub(40);
    out.truncate(40);
    if more > 0 {
        out.push(format!("… and {more} more lines"));
    }
    out.join("\n")
}

/// A scenario's `settings.yaml`: what it plans with besides the defaults of [`config`] and
/// [`plan_with`] (node `node1`, cluster CIDR 10.0.0.0/8, node ports on 192.168.0.2 and
/// fd00:192:168::2).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ScenarioSettings {
    /// kube-proxy's `clusterCIDR`: comma-separated, at most one per family; `""` for none.
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    /// kube-proxy's `nftables.masqueradeAll`.
    #[serde(default)]
    pub masquerade_all: bool,
    /// kube-proxy's `nftables.masqueradeBit`.
    pub masquerade_bit: Option<u32>,
    /// The node's addresses that accept NodePort traffic (both families in one list), or
    /// `all` for every local address (`fib daddr type local`).
    #[serde(rename = "nodePortIPs")]
    pub node_port_ips: Option<NodePortIps>,
}

/// [`ScenarioSettings::node_port_ips`].
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
pub enum NodePortIps {
    /// `all`.
    Keyword(String),
    /// These addresses.
    Addresses(Vec<std::net::IpAddr>),
}

/// One golden scenario: a directory of `nft-templates/` (its layout is described in
/// `nft-templates/README.md`).
#[derive(Debug)]
pub struct Scenario {
    /// The directory's name.
    pub name: String,
    pub dir: PathBuf,
    pub settings: ScenarioSettings,
    /// `input.yaml`: the manifests.
    pub input: String,
    /// `changes/NAME.yaml` (the manifests after the change) by NAME, sorted.
    pub changes: Vec<(String, String)>,
}

/// The files a scenario directory may hold; anything else is a mistake the runner reports
/// (a misspelt file would otherwise be skipped in silence).
const SCENARIO_FILES: [&str; 4] = ["input.yaml", "settings.yaml", "expected.nft", "changes"];

impl Scenario {
    /// Every scenario under `nft-templates/`, by name.
    pub fn all() -> Vec<Scenario> {
        let dir = scenarios_dir();
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap_or_else(|e| panic!("{}: {e}", dir.display())))
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names.iter().map(|n| Scenario::load(n)).collect()
    }

    /// The scenario in `nft-templates/NAME/`.
    pub fn load(name: &str) -> Scenario {
        let dir = scenarios_dir().join(name);
        let read = |file: &str| std::fs::read_to_string(dir.join(file));
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let file = entry.unwrap_or_else(|e| panic!("{}: {e}", dir.display())).file_name();
            let file = file.to_string_lossy().into_owned();
            assert!(SCENARIO_FILES.contains(&file.as_str()), "{}: unexpected {file}", dir.display());
        }
        let input = read("input.yaml").unwrap_or_else(|e| panic!("{}/input.yaml: {e}", dir.display()));
        let settings = match read("settings.yaml") {
            Ok(text) => serde_yaml_ng::from_str::<Option<ScenarioSettings>>(&text)
                .unwrap_or_else(|e| panic!("{}/settings.yaml: {e}", dir.display()))
                .unwrap_or_default(),
            Err(_) => ScenarioSettings::default(),
        };
        let mut changes = Vec::new();
        if let Ok(entries) = std::fs::read_dir(dir.join("changes")) {
            for entry in entries {
                let path = entry.unwrap_or_else(|e| panic!("{}/changes: {e}", dir.display())).path();
                let file = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
                if let Some(change) = file.strip_suffix(".yaml") {
                    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                    changes.push((change.to_string(), text));
                } else {
                    assert!(file.ends_with(".txt"), "{}: unexpected {file}", dir.join("changes").display());
                    let yaml = path.with_extension("yaml");
                    assert!(yaml.exists(), "{}: no {} beside it", path.display(), yaml.display());
                }
            }
        }
        changes.sort();
        Scenario { name: name.to_string(), dir, settings, input, changes }
    }

    /// The settings planned with.
    pub fn config(&self) -> ProxyConfig {
        let mut c = config();
        if let Some(cidrs) = &self.settings.cluster_cidr {
            c.cluster_cidrs = parse_cidrs("clusterCIDR", cidrs)
                .unwrap_or_else(|e| panic!("{}/settings.yaml: {e}", self.dir.display()));
        }
        c.masquerade_all = self.settings.masquerade_all;
        if let Some(bit) = self.settings.masquerade_bit {
            c.masquerade_bit = bit;
        }
        c
    }

    /// Where node ports are accepted, IPv4 then IPv6.
    pub fn node_ports(&self) -> (NodePorts, NodePorts) {
        match &self.settings.node_port_ips {
            None => default_node_ports(),
            Some(NodePortIps::Keyword(k)) if k == "all" => (NodePorts::MatchAll, NodePorts::MatchAll),
            Some(NodePortIps::Keyword(k)) => {
                panic!("{}/settings.yaml: nodePortIPs: {k}: not `all`", self.dir.display())
            }
            Some(NodePortIps::Addresses(ips)) => {
                let (v4, v6): (Vec<_>, Vec<_>) = ips.iter().partition(|ip| ip.is_ipv4());
                (NodePorts::Addresses(v4), NodePorts::Addresses(v6))
            }
        }
    }

    /// Plans `manifests` with this scenario's settings, keeping endpoint windows where
    /// `placement` has them (as a sync does).
    pub fn plan(&self, manifests: &str, placement: &mut Placement) -> Plan {
        let (v4, v6) = self.node_ports();
        plan_placed_with(&self.config(), &state(manifests), &v4, &v6, placement)
    }
}

/// Node ports on 192.168.0.2 and fd00:192:168::2.
fn default_node_ports() -> (NodePorts, NodePorts) {
    (
        NodePorts::Addresses(vec![std::net::IpAddr::from([192, 168, 0, 2])]),
        NodePorts::Addresses(vec![std::net::IpAddr::from([0xfd00, 0x192, 0x168, 0, 0, 0, 0, 2])]),
    )
}

/// Plans with these node ports, keeping endpoint windows where `placement` has them.
fn plan_placed_with(
    config: &ProxyConfig,
    state: &ClusterState,
    v4: &NodePorts,
    v6: &NodePorts,
    placement: &mut Placement,
) -> Plan {
    let input = PlanInput { config, state, nodeports_v4: v4, nodeports_v6: v6 };
    let families = families(&input);
    let demands = state.services().map(|svc| (svc.name.clone(), demands(&input, &families, svc)));
    let prior_affinity: Vec<_> = placement.affinity_slots().collect();
    *placement = Placement::settle(placement.windows().collect::<Vec<_>>(), prior_affinity, demands);
    plan_placed(&input, placement)
}

/// The manifests of the ClusterIP scenario (`nft-templates/clusterip/`).
pub const CLUSTERIP: &str = include_str!("../../nft-templates/clusterip/input.yaml");

/// The external-traffic scenario (`nft-templates/external/`, after upstream's overall test;
/// the upgrade test in `integration/netlink.rs` loads it too).
pub const EXTERNAL: &str = include_str!("../../nft-templates/external/input.yaml");

/// Session affinity (`nft-templates/affinity/`): three endpoints, and one.
pub const AFFINITY: &str = include_str!("../../nft-templates/affinity/input.yaml");

/// A service `ns/NAME` on `cluster_ip` port 80 (TCP) with `n` ready endpoints 10.100.x.y:8080
/// on node2 (`local`: half of them on node1), with ClientIP affinity when `affine`.
pub fn affine_service(name: &str, cluster_ip: &str, n: u32, affine: bool) -> String {
    let affinity = if affine { "\n  sessionAffinity: ClientIP" } else { "" };
    let endpoints: String = (0..n)
        .map(|i| format!("- {{addresses: [\"10.100.{}.{}\"], nodeName: node{}}}\n", i / 250, i % 250 + 1, 1 + i % 2))
        .collect();
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: ns}}
spec:
  clusterIP: {cluster_ip}{affinity}
  ports: [{{name: http, port: 80, protocol: TCP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: ns, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
{endpoints}"#
    )
}
