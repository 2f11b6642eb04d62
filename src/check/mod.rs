//! `nftproxy check`: which foreign tables and base chains may compete with nftproxy's.
//!
//! Netfilter runs every base chain attached to a hook, in priority order, across all tables of
//! the families that see the packet (`ip` and `inet` for IPv4, `ip6` and `inet` for IPv6). Two
//! facts decide whether a foreign chain interferes with service traffic:
//! - a **drop** anywhere is final: `accept` only ends one chain, so a foreign chain whose policy
//!   is drop drops service traffic that nftproxy's chains let through, unless it accepts it;
//! - for **NAT**, the first nat chain (by priority) that NATs a new connection decides its
//!   address; later nat chains on that hook never see the connection. A foreign nat chain at or
//!   before nftproxy's `dstnat` chains can take service traffic away from nftproxy.
//!
//! On top of those, known neighbours are recognised by name: a leftover kube-proxy (its
//! nftables table, or its iptables-nft chains), Docker and firewalld. [`check`] is pure: it
//! takes what the kernel holds ([`TableInfo`], read by [`crate::netlink::Kernel::list_tables`])
//! and nftproxy's own base chains ([`crate::plan::base_chains`]); [`host`] reads the rest.

pub(crate) mod api;
pub(crate) mod host;
pub(crate) mod permissions;

pub(crate) use host::Process;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::Serialize;

use crate::net::IpFamily;
use crate::netlink::{BaseChainInfo, ChainInfo, ChainPolicy, TABLE_F_OWNER, TABLE_F_PERSIST, TableFamily, TableInfo};
use crate::nft::ast::{BaseHook, ChainType, Hook};

/// How much a finding matters. Warnings and conflicts make `check` exit 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Severity {
    /// Worth knowing; nothing competes with nftproxy.
    Info,
    /// May break or divert service traffic, depending on rules `check` does not interpret.
    Warning,
    /// Competes with nftproxy for service traffic as it stands.
    Conflict,
}

impl Severity {
    /// The label the text report prints.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Severity::Info => "INFO",
            Severity::Warning => "WARNING",
            Severity::Conflict => "CONFLICT",
        }
    }

    /// The value of `nftproxy_check_findings`' `severity` label (as `--output json` spells it).
    pub(crate) fn metric_label(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Conflict => "conflict",
        }
    }
}

/// What a finding is about (a stable code, for `--output json` and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum FindingKind {
    /// Neither `ip` nor `ip6` nftproxy table exists.
    OwnTablesMissing,
    /// Only one family's nftproxy table exists.
    OwnTableOneFamily,
    /// An nftproxy table is owned by a netlink socket (`NFT_TABLE_F_OWNER`).
    OwnTableOwned,
    /// An nftproxy table is dormant: its chains are detached.
    OwnTableDormant,
    /// An nftproxy table's base chains differ from what nftproxy creates.
    OwnTableChanged,
    /// A table whose comment says nftproxy made it, under another name.
    OtherNftproxyTable,
    /// kube-proxy's nftables-mode table.
    KubeProxyNftables,
    /// kube-proxy's iptables- or ipvs-mode chains in an iptables-nft table.
    KubeProxyIptables,
    /// Only kubelet's own `KUBE-` chains.
    KubeletIptables,
    /// kube-router's NetworkPolicy chains (kube-router's firewall, or k3s' embedded one).
    KubeRouterFirewall,
    /// Calico's iptables-dataplane chains (`cali-`) beside nftproxy's nftables rules.
    CalicoIptables,
    /// Calico's nftables-dataplane table.
    CalicoNftables,
    /// Docker's chains.
    Docker,
    /// firewalld's table.
    Firewalld,
    /// A foreign base chain with policy drop on a hook service traffic passes.
    PolicyDrop,
    /// A foreign nat chain that can DNAT before nftproxy's.
    DnatFirst,
    /// A foreign nat chain that can SNAT before nftproxy's masquerade.
    SnatFirst,
    /// iptables-legacy tables, which netlink for nf_tables cannot show.
    IptablesLegacy,
    /// kube-proxy's iptables-mode chains in an iptables-legacy (x_tables) table.
    KubeProxyIptablesLegacy,
    /// The API identity lacks a permission nftproxy uses (`check --kubeconfig`/`--api`).
    MissingPermission,
}

/// One thing `check` found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Finding {
    pub severity: Severity,
    pub kind: FindingKind,
    /// The table as nft names it (`ip kube-proxy`).
    pub table: String,
    /// The chain, for findings about one chain.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain: Option<String>,
    /// The chain's hook (`prerouting`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hook: Option<String>,
    /// The chain's priority.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// What was found.
    pub summary: String,
    /// What may happen to service traffic.
    pub effect: String,
    /// What to do about it.
    pub remedy: String,
}

/// Everything [`check`] looks at.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CheckInput<'a> {
    /// Every table in the network namespace.
    pub tables: &'a [TableInfo],
    /// nftproxy's table name (`--table`), in the `ip` and `ip6` families.
    pub table: &'a str,
    /// nftproxy's base chains ([`crate::plan::base_chains`]).
    pub ours: &'a [(String, BaseHook)],
    /// The processes behind owned tables' netlink port ids, where known.
    pub owners: &'a BTreeMap<u32, Process>,
    /// iptables-legacy (x_tables) tables loaded in the namespace (`nat`, `ip6 filter`, …).
    pub legacy_iptables: &'a [String],
}

/// One base chain on a hook, for the report's overview.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct HookRow {
    /// Where the chain runs: `IPv4 prerouting` (`ip` and `inet` chains), `IPv6 forward`,
    /// `netdev ingress (eth0)`, …
    pub point: String,
    pub priority: i32,
    pub table: String,
    pub chain: String,
    pub chain_type: String,
    pub policy: &'static str,
    pub rules: usize,
    /// One of nftproxy's chains.
    pub ours: bool,
    /// Its table is dormant, so the chain is not attached.
    pub dormant: bool,
    #[serde(skip)]
    order: (u8, u32),
}

/// What `check` found.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    /// nftproxy's table name that was checked.
    pub table: String,
    /// Tables in the namespace.
    pub tables: usize,
    /// Most severe first.
    pub findings: Vec<Finding>,
    /// Every base chain, grouped by hook, in the order they run.
    pub hooks: Vec<HookRow>,
    /// kube-proxy's leftovers `nftproxy run` removes in its first sync (read by the CLI).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub takeover: Option<crate::takeover::Leftovers>,
}

impl Report {
    /// Findings of one severity.
    pub(crate) fn count(&self, severity: Severity) -> usize {
        self.findings.iter().filter(|f| f.severity == severity).count()
    }

    /// 1 when anything may conflict (a warning or a conflict), 0 otherwise.
    pub(crate) fn exit_code(&self) -> u8 {
        u8::from(self.findings.iter().any(|f| f.severity >= Severity::Warning))
    }
}

/// kube-proxy's chains left in iptables-legacy tables (a kube-proxy whose image picked the
/// legacy backend): a conflict, one finding per table.
pub(crate) fn legacy_leftover_findings(legacy: &[crate::takeover::LegacyLeftover]) -> Vec<Finding> {
    legacy
        .iter()
        .map(|l| {
            let tool = match l.family {
                IpFamily::V4 => "iptables-legacy",
                IpFamily::V6 => "ip6tables-legacy",
            };
            let jumps: Vec<String> = l.jumps.iter().map(|(chain, _, target)| format!("{chain} -> {target}")).collect();
            let mut chains: Vec<&str> = l.chains.iter().map(String::as_str).collect();
            chains.sort_by_key(|n| kube_proxy_rank(n));
            Finding {
                severity: Severity::Conflict,
                kind: FindingKind::KubeProxyIptablesLegacy,
                table: format!("{tool} {}", l.table),
                chain: None,
                hook: None,
                priority: None,
                summary: format!(
                    "{tool} table {} holds kube-proxy iptables-mode chains: {}{}.",
                    l.table,
                    name_list(&chains),
                    if jumps.is_empty() { String::new() } else { format!(" (jumps: {})", jumps.join(", ")) }
                ),
                effect: "kube-proxy in iptables mode with the legacy backend: its nat chains DNAT service traffic \
                         like nftproxy's, to endpoints it no longer updates, and its filter chains reject what it \
                         thought had none. nf_tables cannot see them, so `nft list ruleset` does not show them."
                    .into(),
                remedy: format!(
                    "Make sure kube-proxy no longer runs on this node: `nftproxy run` then removes these chains and \
                     the jumps to them right after its first sync's transaction (unless --cleanup-kube-proxy=false). \
                     By hand: {}",
                    legacy_commands(tool, l).join("; ")
                ),
            }
        })
        .collect()
}

/// The commands that remove one table's leftovers by hand: the jumps, last position first (a
/// deletion moves the rules after it), then each chain flushed and deleted.
fn legacy_commands(tool: &str, l: &crate::takeover::LegacyLeftover) -> Vec<String> {
    let mut jumps: Vec<&(String, usize, String)> = l.jumps.iter().collect();
    jumps.sort_by(|a, b| (&a.0, std::cmp::Reverse(a.1)).cmp(&(&b.0, std::cmp::Reverse(b.1))));
    let t = &l.table;
    let mut out: Vec<String> = jumps.iter().map(|(chain, pos, _)| format!("{tool} -t {t} -D {chain} {pos}")).collect();
    out.extend(l.chains.iter().map(|c| format!("{tool} -t {t} -F {c}")));
    out.extend(l.chains.iter().map(|c| format!("{tool} -t {t} -X {c}")));
    out
}

/// Checks this network namespace as `nftproxy check` does without `--api`: every table read
/// over netlink, what else holds the netfilter sockets, iptables-legacy, and kube-proxy's
/// leftovers that `run` would remove.
pub(crate) fn inspect(table: &str) -> Result<Report, crate::netlink::NetlinkError> {
    let mut kernel = crate::netlink::Kernel::open()?;
    let tables = kernel.list_tables()?;
    let ports: Vec<u32> = tables.iter().filter_map(|t| t.owner).collect();
    let owners = host::netlink_owners(&ports);
    let legacy = host::legacy_iptables();
    let ours = crate::plan::base_chains();
    let mut report =
        check(&CheckInput { tables: &tables, table, ours: &ours, owners: &owners, legacy_iptables: &legacy });
    let leftovers = crate::takeover::Leftovers::read_with(&mut kernel, &tables)?;
    report.findings.extend(legacy_leftover_findings(&leftovers.legacy));
    report.findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    report.takeover = Some(leftovers).filter(|l| !l.is_empty() || !l.kept.is_empty());
    Ok(report)
}

/// Checks the tables of one network namespace against nftproxy's.
pub(crate) fn check(input: &CheckInput<'_>) -> Report {
    let mut findings = Vec::new();
    let families = own_tables(input, &mut findings);
    for table in input.tables {
        if is_ours(table, input.table) {
            continue;
        }
        recognise(table, input.table, &mut findings);
        if table.is_dormant() {
            continue;
        }
        for (chain, base) in table.base_chains() {
            foreign_chain(input, &families, table, chain, base, &mut findings);
        }
    }
    if !input.legacy_iptables.is_empty() {
        findings.push(Finding {
            severity: Severity::Info,
            kind: FindingKind::IptablesLegacy,
            table: input.legacy_iptables.join(", "),
            chain: None,
            hook: None,
            priority: None,
            summary: format!("iptables-legacy tables are loaded here: {}.", input.legacy_iptables.join(", ")),
            effect: "Their rules live in x_tables, which nf_tables netlink does not show: check reads them only for \
                     kube-proxy's chains (reported on their own). Other rules there run on the same hooks (nat at \
                     -100 and 100, filter at 0) and compete the same way as nftables chains."
                .into(),
            remedy: "Inspect them with `iptables-legacy-save` and `ip6tables-legacy-save`.".into(),
        });
    }
    // Stable: within a severity, findings keep the order of the tables they are about.
    findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    Report {
        table: input.table.to_string(),
        tables: input.tables.len(),
        findings,
        hooks: hook_rows(input.tables, input.table),
        takeover: None,
    }
}

fn is_ours(table: &TableInfo, name: &str) -> bool {
    matches!(table.family, TableFamily::Ip | TableFamily::Ip6) && table.name == name
}

fn ip_family(family: TableFamily) -> Option<IpFamily> {
    match family {
        TableFamily::Ip => Some(IpFamily::V4),
        TableFamily::Ip6 => Some(IpFamily::V6),
        _ => None,
    }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// nftproxy's own tables: present, unowned, awake and as planned. Returns the IP families
/// nftproxy serves here (both when it has no table yet, since `sync` may create either).
fn own_tables(input: &CheckInput<'_>, findings: &mut Vec<Finding>) -> BTreeSet<IpFamily> {
    let ours: Vec<&TableInfo> = input.tables.iter().filter(|t| is_ours(t, input.table)).collect();
    let name = input.table;
    if ours.is_empty() {
        findings.push(Finding {
            severity: Severity::Warning,
            kind: FindingKind::OwnTablesMissing,
            table: format!("ip {name}, ip6 {name}"),
            chain: None,
            hook: None,
            priority: None,
            summary: format!("nftproxy's tables (ip {name}, ip6 {name}) are not here."),
            effect: "No service traffic is handled by nftproxy in this network namespace: nftproxy has not synced \
                     here, `nftproxy cleanup` removed its tables, or it runs with another --table."
                .into(),
            remedy: "Start `nftproxy run` (or `nftproxy sync`) here, or pass the --table the proxy uses.".into(),
        });
        return IpFamily::ALL.into_iter().collect();
    }
    if let [only] = ours.as_slice() {
        let (present, absent) = match only.family {
            TableFamily::Ip6 => ("ip6", "ip"),
            _ => ("ip", "ip6"),
        };
        findings.push(Finding {
            severity: Severity::Info,
            kind: FindingKind::OwnTableOneFamily,
            table: format!("{absent} {name}"),
            chain: None,
            hook: None,
            priority: None,
            summary: format!("Only {present} {name} exists; {absent} {name} does not."),
            effect: "Expected in a single-stack cluster: nftproxy creates a family's table only when the cluster \
                     uses it. Services of the other family are not served here."
                .into(),
            remedy: "Nothing, unless this node should serve both families (then check --cluster-cidr and the \
                     Services' ipFamilies)."
                .into(),
        });
    }
    for table in &ours {
        own_table(input, table, findings);
    }
    ours.iter().filter_map(|t| ip_family(t.family)).collect()
}

fn own_table(input: &CheckInput<'_>, table: &TableInfo, findings: &mut Vec<Finding>) {
    let label = table.label();
    if table.flags & TABLE_F_OWNER != 0 {
        let port = table.owner;
        let process = port.and_then(|p| input.owners.get(&p));
        let holder = match (port, process) {
            (Some(p), Some(proc)) => match &proc.exe {
                Some(exe) if *exe != proc.comm => {
                    format!("netlink port {p}, held by process {} ({}, executable {exe})", proc.pid, proc.comm)
                }
                _ => format!("netlink port {p}, held by process {} ({})", proc.pid, proc.comm),
            },
            (Some(p), None) => format!("netlink port {p} (no process found holding it)"),
            (None, _) => "a netlink socket the kernel did not name".to_string(),
        };
        let by_nftproxy = process.is_some_and(Process::is_nftproxy);
        findings.push(Finding {
            severity: if by_nftproxy { Severity::Info } else { Severity::Warning },
            kind: FindingKind::OwnTableOwned,
            table: label.clone(),
            chain: None,
            hook: None,
            priority: None,
            summary: format!("{label} is owned by {holder}."),
            effect: if by_nftproxy && table.flags & TABLE_F_PERSIST != 0 {
                "An nftproxy process owns the table (`nftproxy run` does by default): only it can change the \
                 table, which stays (persist) when the process exits, for the next one to claim."
                    .into()
            } else if by_nftproxy {
                "An nftproxy process owns the table without the persist flag: only it can change the table, and \
                 the table goes away when it exits."
                    .into()
            } else {
                "Only the owner can change an owned table: every sync from nftproxy fails with \"Operation not \
                 permitted\", and the table is deleted when the owner closes its socket."
                    .into()
            },
            remedy: if by_nftproxy {
                "Nothing, if that is the nftproxy meant to run on this node; otherwise stop the extra one.".into()
            } else {
                "Stop the process holding the table (its rules go with it), then let nftproxy sync again.".into()
            },
        });
    }
    if table.is_dormant() {
        findings.push(Finding {
            severity: Severity::Warning,
            kind: FindingKind::OwnTableDormant,
            table: label.clone(),
            chain: None,
            hook: None,
            priority: None,
            summary: format!("{label} is dormant (flags dormant)."),
            effect: "A dormant table's base chains are detached from their hooks: no service traffic is handled."
                .into(),
            remedy: "Run a full sync (`nftproxy sync`, or wait for `nftproxy run`'s --sync-period): it resets the \
                     table's flags."
                .into(),
        });
    }
    let mut changes = Vec::new();
    for (name, want) in input.ours {
        match table.chains.iter().find(|c| &c.name == name) {
            None => changes.push(format!("base chain {name} is missing")),
            Some(ChainInfo { base: None, .. }) => changes.push(format!("{name} is not a base chain")),
            Some(ChainInfo { base: Some(have), .. }) => {
                if have.hooknum != want.hook.number()
                    || have.priority != want.priority
                    || have.chain_type != want.chain_type.name()
                {
                    changes.push(format!(
                        "{name} is {} {} priority {}, not {} {} priority {}",
                        have.chain_type,
                        table.family.hook_name(have.hooknum).unwrap_or("?"),
                        have.priority,
                        want.chain_type.name(),
                        want.hook.name(),
                        want.priority
                    ));
                }
                if have.policy == ChainPolicy::Drop {
                    changes.push(format!("{name} has policy drop"));
                }
            }
        }
    }
    for (chain, _) in table.base_chains() {
        if !input.ours.iter().any(|(name, _)| name == &chain.name) {
            changes.push(format!("{} is a base chain nftproxy did not create", chain.name));
        }
    }
    if !changes.is_empty() {
        findings.push(Finding {
            severity: Severity::Warning,
            kind: FindingKind::OwnTableChanged,
            table: label.clone(),
            chain: None,
            hook: None,
            priority: None,
            summary: format!("{label} was changed outside nftproxy: {}.", changes.join("; ")),
            effect: "Service traffic is not handled as planned until nftproxy repairs the table.".into(),
            remedy: "A full sync repairs it (`nftproxy sync`, or `nftproxy run`'s next --sync-period); find what \
                     changed it, or it will happen again."
                .into(),
        });
    }
}

/// kube-proxy's chains in its iptables and ipvs modes (iptables-nft tables).
const KUBE_PROXY_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
    "KUBE-LOAD-BALANCER",
    "KUBE-NODE-PORT",
    "KUBE-SOURCE-RANGES-FIREWALL",
];
/// Prefixes of kube-proxy's per-service and per-endpoint chains.
const KUBE_PROXY_PREFIXES: &[&str] = &["KUBE-SVC-", "KUBE-SVL-", "KUBE-SEP-", "KUBE-EXT-", "KUBE-FW-", "KUBE-XLB-"];
/// Prefixes of kube-router's NetworkPolicy chains (`pkg/controllers/netpol`): not kube-proxy's.
const KUBE_ROUTER_PREFIXES: &[&str] = &["KUBE-ROUTER-", "KUBE-NWPLCY-", "KUBE-POD-FW-"];

/// The prefix of Felix's iptables chains.
const CALICO_CHAIN_PREFIX: &str = "cali-";

/// Felix's nftables-dataplane table (in `ip` and `ip6`).
const CALICO_NFTABLES_TABLE: &str = "calico";

/// The tables iptables-nft writes.
const IPTABLES_TABLE_NAMES: &[&str] = &["filter", "nat", "mangle", "raw", "security"];

/// Chains kubelet itself creates; they do not handle services.
const KUBELET_CHAINS: &[&str] = &[
    "KUBE-FIREWALL",
    "KUBE-KUBELET-CANARY",
    "KUBE-IPTABLES-HINT",
    "KUBE-MARK-DROP",
    "KUBE-MARK-MASQ",
    "KUBE-POSTROUTING",
];

/// Sort key that names kube-proxy's top-level chains first, its per-service chains next, and
/// any other `KUBE-` chain (a kube-proxy version this list does not know) last.
fn kube_proxy_rank(name: &str) -> usize {
    if let Some(i) = KUBE_PROXY_CHAINS.iter().position(|c| *c == name) {
        i
    } else if KUBE_PROXY_PREFIXES.iter().any(|p| name.starts_with(p)) {
        KUBE_PROXY_CHAINS.len()
    } else {
        KUBE_PROXY_CHAINS.len() + 1
    }
}

fn name_list(names: &[&str]) -> String {
    const SHOWN: usize = 5;
    let mut s = names.iter().take(SHOWN).copied().collect::<Vec<_>>().join(", ");
    if names.len() > SHOWN {
        let _ = write!(s, ", … ({} in all)", names.len());
    }
    s
}

/// Foreign tables known by name: kube-proxy, Docker, firewalld, another nftproxy.
fn recognise(table: &TableInfo, our_name: &str, findings: &mut Vec<Finding>) {
    let label = table.label();
    let finding = |severity, kind, summary: String, effect: String, remedy: String| Finding {
        severity,
        kind,
        table: label.clone(),
        chain: None,
        hook: None,
        priority: None,
        summary,
        effect,
        remedy,
    };
    let base_chains = table.base_chains().count();
    let base_rules: usize = table.base_chains().map(|(_, b)| b.rules).sum();

    if table.comment.as_deref() == Some("rules for nftproxy") {
        findings.push(finding(
            Severity::Warning,
            FindingKind::OtherNftproxyTable,
            format!("{label} was made by nftproxy (its comment says so), but this check is for table {our_name}."),
            "Two nftproxy tables DNAT the same services at the same priority; the one attached first wins, and \
             the other is not kept up to date if its proxy has stopped."
                .into(),
            format!(
                "If no nftproxy runs with --table {} any more, remove it: `nftproxy cleanup --table {}` (or `nft \
                 delete table {label}`). If this check used the wrong --table, run it with --table {}.",
                table.name, table.name, table.name
            ),
        ));
    }

    if table.name == "kube-proxy" || table.comment.as_deref() == Some("rules for kube-proxy") {
        findings.push(finding(
            Severity::Conflict,
            FindingKind::KubeProxyNftables,
            format!(
                "kube-proxy's nftables-mode table {label} is here ({}, {}).",
                plural(base_chains, "base chain", "base chains"),
                plural(base_rules, "rule", "rules")
            ),
            "Its nat chains DNAT service traffic at priority -100 (dstnat), like nftproxy's: per connection, \
             whichever chain registered first wins (double NAT at best, endpoints kube-proxy no longer updates at \
             worst), and its filter chains reject traffic to services it thinks have no endpoints."
                .into(),
            format!(
                "Make sure kube-proxy no longer runs on this node: `nftproxy run` then deletes the table in its first \
                 sync (unless --cleanup-kube-proxy=false; see \"nftproxy run removes\" below), or delete it by hand: \
                 `nft delete table {label}`."
            ),
        ));
    }

    let kube: Vec<&str> = table.chains.iter().map(|c| c.name.as_str()).filter(|n| n.starts_with("KUBE-")).collect();
    let (router, kube): (Vec<&str>, Vec<&str>) =
        kube.into_iter().partition(|n| KUBE_ROUTER_PREFIXES.iter().any(|p| n.starts_with(p)));
    // Any other KUBE- chain that is not kubelet's is taken for kube-proxy's.
    let mut proxy: Vec<&str> = kube.iter().copied().filter(|n| !KUBELET_CHAINS.contains(n)).collect();
    proxy.sort_by_key(|n| kube_proxy_rank(n));
    if !proxy.is_empty() {
        findings.push(finding(
            Severity::Conflict,
            FindingKind::KubeProxyIptables,
            format!("{label} holds kube-proxy iptables-mode chains: {}.", name_list(&proxy)),
            "kube-proxy in iptables (or ipvs) mode, written through iptables-nft: its nat chains (PREROUTING and \
             OUTPUT jump to KUBE-SERVICES at priority -100) DNAT service traffic like nftproxy's, and its filter \
             chains accept or reject it: double NAT, or endpoints it no longer updates."
                .into(),
            "Make sure kube-proxy no longer runs on this node: `nftproxy run` then removes these chains and the \
             jumps to them in its first sync (unless --cleanup-kube-proxy=false; see \"nftproxy run removes\" \
             below), or run `kube-proxy --cleanup`."
                .into(),
        ));
    } else if !kube.is_empty() {
        findings.push(finding(
            Severity::Info,
            FindingKind::KubeletIptables,
            format!("{label} holds kubelet's chains: {}.", name_list(&kube)),
            "kubelet's own chains (a canary, a hint for the iptables mode, a martian-packet filter); they do not \
             NAT or filter service traffic."
                .into(),
            "Nothing.".into(),
        ));
    }

    let docker: Vec<&str> =
        table.chains.iter().map(|c| c.name.as_str()).filter(|n| *n == "DOCKER" || n.starts_with("DOCKER-")).collect();
    if !docker.is_empty() {
        let (effect, remedy) = match table.name.as_str() {
            "nat" => (
                "Docker DNATs published container ports in its nat chains (PREROUTING jumps to DOCKER for local \
                 addresses, at priority -100 like nftproxy's dstnat): a NodePort or service port a container also \
                 publishes goes to whichever chain registered first.",
                "Do not publish container ports that overlap NodePorts (30000-32767 by default) or service ports \
                 on this node.",
            ),
            "filter" => (
                "Docker sets the FORWARD chain's policy to drop and accepts only its own bridges' traffic: service \
                 traffic nftproxy DNATs to pods is dropped unless DOCKER-USER accepts it.",
                "Accept pod traffic in DOCKER-USER (`iptables -I DOCKER-USER -d POD-CIDR -j ACCEPT` and `-s \
                 POD-CIDR`), or run Docker with \"iptables\": false in /etc/docker/daemon.json on Kubernetes nodes.",
            ),
            _ => (
                "Docker filters or NATs container traffic in this table, on the same hooks as nftproxy.",
                "Check that Docker's rules do not match pod or service traffic.",
            ),
        };
        findings.push(finding(
            Severity::Warning,
            FindingKind::Docker,
            format!("{label} holds Docker's chains: {}.", name_list(&docker)),
            effect.into(),
            remedy.into(),
        ));
    }

    if !router.is_empty() {
        findings.push(finding(
            Severity::Info,
            FindingKind::KubeRouterFirewall,
            format!("{label} holds kube-router's NetworkPolicy chains: {}.", name_list(&router)),
            "kube-router's firewall (also embedded in k3s and RKE2) enforces NetworkPolicies on pod \
             traffic after nftproxy's DNAT, as it does behind kube-proxy; it does not NAT service \
             traffic. Its service proxy (--run-service-proxy, IPVS) is another matter: it must be off \
             where nftproxy runs."
                .into(),
            "Nothing.".into(),
        ));
    }

    let calico: Vec<&str> =
        table.chains.iter().map(|c| c.name.as_str()).filter(|n| n.starts_with(CALICO_CHAIN_PREFIX)).collect();
    if !calico.is_empty() && IPTABLES_TABLE_NAMES.contains(&table.name.as_str()) {
        findings.push(finding(
            Severity::Warning,
            FindingKind::CalicoIptables,
            format!("{label} holds Calico's iptables-dataplane chains: {}.", name_list(&calico)),
            "Calico's Felix runs its iptables dataplane beside nftproxy, which is kube-proxy's \
             nftables mode; Calico requires its dataplane to match kube-proxy's mode. With \
             NFTablesMode Auto (what the Tigera operator sets for linuxDataplane: Nftables), Felix \
             decides by looking for kube-proxy's table (ip or ip6 kube-proxy), which nftproxy \
             replaces, so it picks iptables."
                .into(),
            "Make Felix use nftables on this node: a FelixConfiguration named node.<node> with \
             `nftablesMode: Enabled` (it wins over the operator-managed `default`), or \
             FELIX_NFTABLESMODE=Enabled on calico-node; without the operator, `nftablesMode: Enabled` \
             in the `default` FelixConfiguration. See docs/compatibility.md#calico."
                .into(),
        ));
    }
    if table.name == CALICO_NFTABLES_TABLE {
        findings.push(finding(
            Severity::Info,
            FindingKind::CalicoNftables,
            format!("Calico's nftables-dataplane table {label} is here."),
            "Felix enforces policy in nftables mode, matching nftproxy's (kube-proxy's nftables \
             mode), as Calico requires; it does not NAT service traffic."
                .into(),
            "Nothing.".into(),
        ));
    }

    if table.name == "firewalld" {
        findings.push(finding(
            Severity::Warning,
            FindingKind::Firewalld,
            format!("firewalld's table {label} is here ({}).", plural(base_chains, "base chain", "base chains")),
            "firewalld rejects whatever its zones do not allow, forwarded traffic included: service traffic \
             DNATed to pods, NodePorts and health-check node ports are dropped unless a zone or policy allows \
             them. (firewalld only touches its own table, so a reload does not remove nftproxy's rules.)"
                .into(),
            "Put the pod interfaces or the pod CIDR in a zone that allows them (`firewall-cmd --permanent \
             --zone=trusted --add-source=POD-CIDR`), open the NodePort range (`--add-port=30000-32767/tcp`, and \
             /udp), then `firewall-cmd --reload`."
                .into(),
        ));
    }
}

/// What passing a hook means for service traffic.
fn hook_traffic(hook: Hook) -> &'static str {
    match hook {
        Hook::Prerouting => {
            "Every packet arriving at the node passes prerouting: ClusterIP traffic from pods, NodePort and \
             LoadBalancer traffic from outside."
        }
        Hook::Input => {
            "Traffic to the node itself passes input: NodePorts served by host-network endpoints, health-check \
             node ports, and replies to the node's own connections (ClusterIPs included)."
        }
        Hook::Forward => {
            "Service traffic nftproxy DNATs to pods (from pods, other nodes and outside clients) is forwarded, \
             and so are the replies."
        }
        Hook::Output => {
            "Traffic the node sends passes output, including its own connections to ClusterIPs and NodePorts."
        }
        Hook::Postrouting => "Every packet leaving the node passes postrouting, service traffic to endpoints included.",
    }
}

/// Where a foreign chain runs relative to nftproxy's chains on its hook.
fn position(ours: &[(String, BaseHook)], hook: Hook, priority: i32) -> String {
    let mut on_hook: Vec<&(String, BaseHook)> = ours.iter().filter(|(_, b)| b.hook == hook).collect();
    on_hook.sort_by_key(|(_, b)| b.priority);
    let before: Vec<String> =
        on_hook.iter().filter(|(_, b)| priority <= b.priority).map(|(n, b)| format!("{n} ({})", b.priority)).collect();
    let after: Vec<String> =
        on_hook.iter().filter(|(_, b)| priority > b.priority).map(|(n, b)| format!("{n} ({})", b.priority)).collect();
    let mut s = String::new();
    if !after.is_empty() {
        let _ = write!(s, "It runs after nftproxy's {}", after.join(", "));
    }
    if !before.is_empty() {
        s.push_str(if s.is_empty() { "It runs before nftproxy's " } else { " and before " });
        s.push_str(&before.join(", "));
    }
    if on_hook.iter().any(|(_, b)| b.priority == priority) {
        s.push_str(" (at equal priority, the chain registered first runs first)");
    }
    if !s.is_empty() {
        s.push('.');
    }
    s
}

/// Which destination a chain at `priority` on `hook` sees for service traffic, so its accept
/// rules can be written: the service's before nftproxy's DNAT, the endpoint's after it.
fn addresses_seen(ours: &[(String, BaseHook)], hook: Hook, priority: i32) -> &'static str {
    let dnat = ours.iter().find(|(_, b)| b.hook == hook && b.chain_type == ChainType::Nat && hook != Hook::Postrouting);
    match dnat {
        Some((_, b)) if priority < b.priority => {
            "It sees service traffic before DNAT, addressed to ClusterIPs, NodePorts and LoadBalancer IPs."
        }
        _ => "It sees service traffic after DNAT, addressed to the endpoints (pod IPs and target ports).",
    }
}

/// A foreign base chain against nftproxy's chains on the same hook.
fn foreign_chain(
    input: &CheckInput<'_>,
    families: &BTreeSet<IpFamily>,
    table: &TableInfo,
    chain: &ChainInfo,
    base: &BaseChainInfo,
    findings: &mut Vec<Finding>,
) {
    // Which of nftproxy's families this chain's packets belong to.
    let sees = match table.family {
        TableFamily::Ip => families.contains(&IpFamily::V4),
        TableFamily::Ip6 => families.contains(&IpFamily::V6),
        TableFamily::Inet => !families.is_empty(),
        // arp, bridge and netdev chains run on other hooks than nftproxy's.
        _ => false,
    };
    // inet's ingress hook (5) is per device, before prerouting; nftproxy has no chain there.
    let Some(hook) = Hook::from_number(base.hooknum).filter(|_| sees) else { return };
    let label = table.label();
    let rules = plural(base.rules, "rule", "rules");
    let finding = |severity, kind, summary: String, effect: String, remedy: String| Finding {
        severity,
        kind,
        table: label.clone(),
        chain: Some(chain.name.clone()),
        hook: Some(hook.name().to_string()),
        priority: Some(base.priority),
        summary,
        effect,
        remedy,
    };

    if base.policy == ChainPolicy::Drop {
        let empty = base.rules == 0;
        let consequence = if empty {
            "With no rules, it drops every packet on this hook, service traffic included."
        } else {
            "Service traffic is dropped there unless one of its rules accepts it: accepting in nftproxy's chains \
             does not stop the next chain from dropping."
        };
        findings.push(finding(
            if empty { Severity::Conflict } else { Severity::Warning },
            FindingKind::PolicyDrop,
            format!("A {} chain with policy drop and {rules}.", base.chain_type),
            format!(
                "{} {consequence} {} {}",
                hook_traffic(hook),
                position(input.ours, hook, base.priority),
                addresses_seen(input.ours, hook, base.priority)
            ),
            format!(
                "Accept service traffic in {} before its policy applies, e.g. `ct status dnat accept` (connections \
                 nftproxy DNATed) and the pod and service CIDRs, or give it policy accept if nothing relies on the \
                 drop.",
                chain.name
            ),
        ));
    }

    if base.chain_type != ChainType::Nat.name() {
        return;
    }
    let Some((ours, our_hook)) = input.ours.iter().find(|(_, b)| b.hook == hook && b.chain_type == ChainType::Nat)
    else {
        return;
    };
    if base.priority > our_hook.priority {
        // It only sees connections nftproxy did not NAT.
        return;
    }
    let empty = base.rules == 0;
    let idle = if empty { " It has no rules yet, so it NATs nothing for now." } else { "" };
    let summary = format!("A nat chain with {rules}, at or before nftproxy's {ours} (priority {}).", our_hook.priority);
    if hook == Hook::Postrouting {
        findings.push(finding(
            Severity::Info,
            FindingKind::SnatFirst,
            summary,
            format!(
                "The first nat chain that NATs a connection decides its source; nftproxy's masquerade of traffic \
                 it marked is skipped for connections this chain SNATs. Usually harmless (a CNI's or Docker's \
                 masquerade), unless it SNATs service traffic to an address the endpoints cannot answer.{idle}"
            ),
            format!("Check that {} does not SNAT traffic to pod endpoints to an unreachable address.", chain.name),
        ));
    } else {
        findings.push(finding(
            if empty { Severity::Info } else { Severity::Warning },
            FindingKind::DnatFirst,
            summary,
            format!(
                "The first nat chain that NATs a new connection decides its destination; later nat chains on the \
                 hook never see it. If {} DNATs (or redirects) traffic to a ClusterIP, NodePort, ExternalIP or \
                 LoadBalancer IP, nftproxy's DNAT to the endpoints does not happen for it.{idle}",
                chain.name
            ),
            format!(
                "Make sure {} matches no service traffic, remove it if it is a leftover, or move it after nftproxy \
                 (a priority above {}).",
                chain.name, our_hook.priority
            ),
        ));
    }
}

/// Every base chain, by the hook it runs on and in the order it runs.
fn hook_rows(tables: &[TableInfo], our_name: &str) -> Vec<HookRow> {
    let mut rows = Vec::new();
    for table in tables {
        for (chain, base) in table.base_chains() {
            let hook = table.family.hook_name(base.hooknum).unwrap_or("?");
            let devices =
                if base.devices.is_empty() { String::new() } else { format!(" ({})", base.devices.join(", ")) };
            // IPv4 packets meet ip and inet chains, IPv6 packets ip6 and inet chains.
            let points: Vec<(u8, String)> = match (table.family, Hook::from_number(base.hooknum)) {
                (TableFamily::Ip, Some(_)) => vec![(0, format!("IPv4 {hook}"))],
                (TableFamily::Ip6, Some(_)) => vec![(1, format!("IPv6 {hook}"))],
                (TableFamily::Inet, Some(_)) => vec![(0, format!("IPv4 {hook}")), (1, format!("IPv6 {hook}"))],
                (family, _) => vec![(2, format!("{family} {hook}{devices}"))],
            };
            for (group, point) in points {
                rows.push(HookRow {
                    point,
                    priority: base.priority,
                    table: table.label(),
                    chain: chain.name.clone(),
                    chain_type: base.chain_type.clone(),
                    policy: base.policy.keyword(),
                    rules: base.rules,
                    ours: is_ours(table, our_name),
                    dormant: table.is_dormant(),
                    order: (group, base.hooknum),
                });
            }
        }
    }
    rows.sort_by(|a, b| {
        (a.order, &a.point, a.priority, &a.table, &a.chain).cmp(&(b.order, &b.point, b.priority, &b.table, &b.chain))
    });
    rows
}

/// Breaks `text` into lines of at most `width` characters, each prefixed by `indent`. A
/// `command in backticks` is never broken, so it can be copied whole.
fn wrap(out: &mut String, text: &str, indent: &str, width: usize) {
    let mut words: Vec<String> = Vec::new();
    let mut in_code = false;
    for word in text.split_whitespace() {
        match words.last_mut() {
            Some(last) if in_code => {
                last.push(' ');
                last.push_str(word);
            }
            _ => words.push(word.to_string()),
        }
        if word.matches('`').count() % 2 == 1 {
            in_code = !in_code;
        }
    }
    let mut line = String::new();
    for word in &words {
        if !line.is_empty() && indent.len() + line.chars().count() + 1 + word.chars().count() > width {
            let _ = writeln!(out, "{indent}{line}");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        let _ = writeln!(out, "{indent}{line}");
    }
}

impl Report {
    /// The human-readable report.
    pub(crate) fn to_text(&self) -> String {
        const WIDTH: usize = 100;
        let mut out = String::new();
        let base_chains: BTreeSet<(&str, &str)> =
            self.hooks.iter().map(|r| (r.table.as_str(), r.chain.as_str())).collect();
        let _ = writeln!(
            out,
            "nftproxy check: {}, {} in this network namespace; nftproxy's table: {}\n",
            plural(self.tables, "table", "tables"),
            plural(base_chains.len(), "base chain", "base chains"),
            self.table
        );
        for f in &self.findings {
            let mut head = format!("{:<9} {}", f.severity.label(), f.table);
            if let Some(chain) = &f.chain {
                let _ = write!(head, " chain {chain}");
            }
            if let (Some(hook), Some(priority)) = (&f.hook, f.priority) {
                let _ = write!(head, " (hook {hook}, priority {priority})");
            }
            let _ = writeln!(out, "{head}");
            wrap(&mut out, &f.summary, "          ", WIDTH);
            wrap(&mut out, &format!("may happen: {}", f.effect), "          ", WIDTH);
            wrap(&mut out, &format!("to do: {}", f.remedy), "          ", WIDTH);
            out.push('\n');
        }
        if self.findings.iter().all(|f| f.severity == Severity::Info) {
            let _ = writeln!(out, "No foreign table or chain conflicts with nftproxy's.\n");
        }
        if let Some(l) = &self.takeover {
            l.write_text(&mut out);
        }
        let _ = writeln!(
            out,
            "Base chains by hook, lowest priority first (* nftproxy's; at equal priority, the kernel runs\n\
             them in the order they were registered, which is not shown):"
        );
        let mut point = "";
        for r in &self.hooks {
            if r.point != point {
                point = &r.point;
                let _ = writeln!(out, "  {point}");
            }
            let _ = writeln!(
                out,
                "    {:>6}  {:<6}  {:<6}  {:>9}  {} {}{}{}",
                r.priority,
                r.chain_type,
                r.policy,
                plural(r.rules, "rule", "rules"),
                r.table,
                r.chain,
                if r.ours { " *" } else { "" },
                if r.dormant { " (dormant: not attached)" } else { "" }
            );
        }
        let _ = writeln!(
            out,
            "\n{}, {}, {}: exit {}",
            plural(self.count(Severity::Conflict), "conflict", "conflicts"),
            plural(self.count(Severity::Warning), "warning", "warnings"),
            plural(self.count(Severity::Info), "note", "notes"),
            self.exit_code()
        );
        out
    }
}

#[cfg(test)]
mod tests;
