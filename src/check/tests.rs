use super::*;
use crate::netlink::inventory::TABLE_F_DORMANT;
use crate::plan::base_chains;

const PREROUTING: u32 = 0;
const INPUT: u32 = 1;
const FORWARD: u32 = 2;
const OUTPUT: u32 = 3;
const POSTROUTING: u32 = 4;

fn base(name: &str, hooknum: u32, priority: i32, chain_type: &str, policy: ChainPolicy, rules: usize) -> ChainInfo {
    ChainInfo {
        name: name.into(),
        base: Some(BaseChainInfo {
            hooknum,
            priority,
            chain_type: chain_type.into(),
            policy,
            devices: Vec::new(),
            rules,
        }),
    }
}

fn accept(name: &str, hooknum: u32, priority: i32, chain_type: &str, rules: usize) -> ChainInfo {
    base(name, hooknum, priority, chain_type, ChainPolicy::Accept, rules)
}

fn drop(name: &str, hooknum: u32, priority: i32, rules: usize) -> ChainInfo {
    base(name, hooknum, priority, "filter", ChainPolicy::Drop, rules)
}

fn regular(name: &str) -> ChainInfo {
    ChainInfo { name: name.into(), base: None }
}

fn table(family: TableFamily, name: &str, chains: Vec<ChainInfo>) -> TableInfo {
    TableInfo { family, name: name.into(), flags: 0, owner: None, comment: None, chains }
}

/// nftproxy's table as `sync` creates it.
fn ours(family: TableFamily) -> TableInfo {
    let mut chains: Vec<ChainInfo> = base_chains()
        .into_iter()
        .map(|(name, b)| accept(&name, b.hook.number(), b.priority, b.chain_type.name(), 1))
        .collect();
    chains.push(regular("services"));
    TableInfo { comment: Some("rules for nftproxy".into()), ..table(family, "nftproxy", chains) }
}

fn check_with(tables: &[TableInfo], owners: &BTreeMap<u32, Process>, legacy: &[String]) -> Report {
    let ours = base_chains();
    check(&CheckInput { tables, table: "nftproxy", ours: &ours, owners, legacy_iptables: legacy })
}

fn run(tables: &[TableInfo]) -> Report {
    check_with(tables, &BTreeMap::new(), &[])
}

/// (severity, kind, table, chain) of each finding, in report order.
fn found(report: &Report) -> Vec<(Severity, FindingKind, String, Option<String>)> {
    report.findings.iter().map(|f| (f.severity, f.kind, f.table.clone(), f.chain.clone())).collect()
}

fn has(report: &Report, severity: Severity, kind: FindingKind, table: &str, chain: Option<&str>) -> bool {
    found(report).contains(&(severity, kind, table.to_string(), chain.map(str::to_string)))
}

#[test]
fn our_chains_are_the_planners() {
    let ours = base_chains();
    assert_eq!(ours.len(), 4);
    let find = |name: &str| ours.iter().find(|(n, _)| n == name).map(|(_, b)| *b).unwrap();
    assert_eq!(find("nat-prerouting"), BaseHook { chain_type: ChainType::Nat, hook: Hook::Prerouting, priority: -100 });
    assert_eq!(find("nat-output"), BaseHook { chain_type: ChainType::Nat, hook: Hook::Output, priority: -100 });
    assert_eq!(
        find("nat-postrouting"),
        BaseHook { chain_type: ChainType::Nat, hook: Hook::Postrouting, priority: 100 }
    );
    assert_eq!(find("filter-input"), BaseHook { chain_type: ChainType::Filter, hook: Hook::Input, priority: 0 });
    // The checks upstream runs in filter chains at prerouting, forward and output are in the nat
    // chains: nothing of ours runs on every forwarded packet.
    assert!(ours.iter().all(|(_, b)| b.hook != Hook::Forward), "{ours:?}");
}

#[test]
fn only_nftproxys_tables_pass() {
    let report = run(&[ours(TableFamily::Ip), ours(TableFamily::Ip6)]);
    assert!(report.findings.is_empty(), "{:?}", found(&report));
    assert_eq!(report.exit_code(), 0);

    // A single-stack node has one table: a note, not a warning.
    let report = run(&[ours(TableFamily::Ip)]);
    assert_eq!(found(&report), vec![(Severity::Info, FindingKind::OwnTableOneFamily, "ip6 nftproxy".into(), None)]);
    assert_eq!(report.exit_code(), 0);
}

#[test]
fn missing_own_tables_are_a_warning() {
    let report = run(&[]);
    assert_eq!(
        found(&report),
        vec![(Severity::Warning, FindingKind::OwnTablesMissing, "ip nftproxy, ip6 nftproxy".into(), None)]
    );
    assert_eq!(report.exit_code(), 1);
}

#[test]
fn a_leftover_kube_proxy_table_conflicts_and_its_nat_chains_dnat_first() {
    let kube_proxy = TableInfo {
        comment: Some("rules for kube-proxy".into()),
        ..table(
            TableFamily::Ip,
            "kube-proxy",
            vec![
                accept("filter-forward", FORWARD, -110, "filter", 3),
                accept("nat-prerouting", PREROUTING, -100, "nat", 1),
                accept("nat-output", OUTPUT, -100, "nat", 1),
                accept("nat-postrouting", POSTROUTING, 100, "nat", 1),
                regular("services"),
                regular("service-ULMVA6XW-default/web/tcp/http"),
            ],
        )
    };
    let report = run(&[kube_proxy, ours(TableFamily::Ip)]);
    assert!(has(&report, Severity::Conflict, FindingKind::KubeProxyNftables, "ip kube-proxy", None));
    assert!(has(&report, Severity::Warning, FindingKind::DnatFirst, "ip kube-proxy", Some("nat-prerouting")));
    assert!(has(&report, Severity::Warning, FindingKind::DnatFirst, "ip kube-proxy", Some("nat-output")));
    assert!(has(&report, Severity::Info, FindingKind::SnatFirst, "ip kube-proxy", Some("nat-postrouting")));
    // Conflicts come first.
    assert_eq!(report.findings[0].kind, FindingKind::KubeProxyNftables);
    assert_eq!(report.exit_code(), 1);
    let f = &report.findings[0];
    assert!(f.summary.contains("4 base chains, 6 rules"), "{}", f.summary);
    assert!(f.remedy.contains("nft delete table ip kube-proxy"), "{}", f.remedy);
}

#[test]
fn kube_proxy_iptables_mode_chains_conflict_and_kubelets_own_are_a_note() {
    let nat = table(
        TableFamily::Ip,
        "nat",
        vec![
            accept("PREROUTING", PREROUTING, -100, "nat", 1),
            regular("KUBE-SERVICES"),
            regular("KUBE-SVC-NPX46M4PTMTKRN6Y"),
            regular("KUBE-SEP-IT2ZTR26TO4XFPTO"),
            regular("KUBE-MARK-MASQ"),
        ],
    );
    let filter = table(TableFamily::Ip, "filter", vec![regular("KUBE-FIREWALL"), regular("KUBE-KUBELET-CANARY")]);
    let report = run(&[filter, nat, ours(TableFamily::Ip)]);
    assert!(has(&report, Severity::Conflict, FindingKind::KubeProxyIptables, "ip nat", None));
    assert!(has(&report, Severity::Info, FindingKind::KubeletIptables, "ip filter", None));
    assert!(!has(&report, Severity::Conflict, FindingKind::KubeProxyIptables, "ip filter", None));
    let f = report.findings.iter().find(|f| f.kind == FindingKind::KubeProxyIptables).unwrap();
    assert!(f.summary.contains("KUBE-SERVICES"), "{}", f.summary);
    assert!(!f.summary.contains("KUBE-MARK-MASQ"), "kubelet's chain is not named as kube-proxy's: {}", f.summary);
}

/// k3s and kube-router's firewall: their KUBE- chains are not kube-proxy's (the takeover never
/// removes them, and `check` must not call them a conflict).
#[test]
fn kube_routers_netpol_chains_are_not_kube_proxys() {
    let filter = table(
        TableFamily::Ip,
        "filter",
        vec![
            accept("FORWARD", FORWARD, 0, "filter", 2),
            regular("KUBE-ROUTER-FORWARD"),
            regular("KUBE-ROUTER-INPUT"),
            regular("KUBE-NWPLCY-DEFAULT"),
            regular("KUBE-POD-FW-4K2GS3ZQ7GCAR2J7"),
            regular("KUBE-FIREWALL"),
        ],
    );
    let report = run(&[filter, ours(TableFamily::Ip)]);
    assert!(has(&report, Severity::Info, FindingKind::KubeRouterFirewall, "ip filter", None), "{:?}", found(&report));
    assert!(!report.findings.iter().any(|f| f.kind == FindingKind::KubeProxyIptables), "{:?}", found(&report));
    assert_eq!(report.exit_code(), 0, "{:?}", found(&report));
}

/// Felix behind nftproxy: its iptables dataplane is a warning naming the setting; its nftables
/// table a note.
#[test]
fn calicos_dataplane_must_be_nftables() {
    let filter = table(
        TableFamily::Ip,
        "filter",
        vec![accept("FORWARD", FORWARD, 0, "filter", 3), regular("cali-FORWARD"), regular("cali-from-wl-dispatch")],
    );
    let report = run(&[filter, ours(TableFamily::Ip)]);
    assert!(has(&report, Severity::Warning, FindingKind::CalicoIptables, "ip filter", None), "{:?}", found(&report));
    let f = report.findings.iter().find(|f| f.kind == FindingKind::CalicoIptables).unwrap();
    assert!(f.remedy.contains("nftablesMode: Enabled"), "{}", f.remedy);
    let calico = table(TableFamily::Ip, "calico", vec![regular("filter-FORWARD")]);
    let report = run(&[calico, ours(TableFamily::Ip)]);
    assert!(has(&report, Severity::Info, FindingKind::CalicoNftables, "ip calico", None), "{:?}", found(&report));
    assert!(!report.findings.iter().any(|f| f.kind == FindingKind::CalicoIptables));
}

#[test]
fn docker_is_recognised_in_nat_and_filter_with_its_forward_drop() {
    let nat = table(
        TableFamily::Ip,
        "nat",
        vec![
            accept("PREROUTING", PREROUTING, -100, "nat", 1),
            accept("OUTPUT", OUTPUT, -100, "nat", 1),
            accept("POSTROUTING", POSTROUTING, 100, "nat", 1),
            regular("DOCKER"),
        ],
    );
    let filter = table(
        TableFamily::Ip,
        "filter",
        vec![drop("FORWARD", FORWARD, 0, 4), regular("DOCKER"), regular("DOCKER-USER"), regular("DOCKER-FORWARD")],
    );
    let report = run(&[filter, nat, ours(TableFamily::Ip)]);
    assert!(has(&report, Severity::Warning, FindingKind::Docker, "ip nat", None));
    assert!(has(&report, Severity::Warning, FindingKind::Docker, "ip filter", None));
    assert!(has(&report, Severity::Warning, FindingKind::PolicyDrop, "ip filter", Some("FORWARD")));
    assert!(has(&report, Severity::Warning, FindingKind::DnatFirst, "ip nat", Some("PREROUTING")));
    let docker_filter =
        report.findings.iter().find(|f| f.kind == FindingKind::Docker && f.table == "ip filter").unwrap();
    assert!(docker_filter.remedy.contains("DOCKER-USER"), "{}", docker_filter.remedy);
    let drop = report.findings.iter().find(|f| f.kind == FindingKind::PolicyDrop).unwrap();
    assert!(drop.effect.contains("after DNAT"), "{}", drop.effect);
    assert_eq!(drop.hook.as_deref(), Some("forward"));
    assert_eq!(drop.priority, Some(0));
}

#[test]
fn firewalld_and_an_empty_drop_chain() {
    let firewalld = table(
        TableFamily::Inet,
        "firewalld",
        vec![drop("filter_FORWARD", FORWARD, 10, 0), accept("filter_INPUT", INPUT, 10, "filter", 12)],
    );
    let report = run(&[ours(TableFamily::Ip), firewalld]);
    assert!(has(&report, Severity::Warning, FindingKind::Firewalld, "inet firewalld", None));
    // No rules and policy drop: everything forwarded is dropped.
    assert!(has(&report, Severity::Conflict, FindingKind::PolicyDrop, "inet firewalld", Some("filter_FORWARD")));
    let f = report.findings.iter().find(|f| f.kind == FindingKind::PolicyDrop).unwrap();
    assert!(!f.effect.contains("It runs"), "no chain of ours on forward: {}", f.effect);
    assert!(f.effect.contains("after DNAT, addressed to the endpoints"), "{}", f.effect);

    // A drop chain early in prerouting sees the service addresses.
    let early = table(TableFamily::Ip, "guard", vec![drop("prerouting", PREROUTING, -200, 3)]);
    let report = run(&[ours(TableFamily::Ip), early]);
    let f = report.findings.iter().find(|f| f.kind == FindingKind::PolicyDrop).unwrap();
    assert_eq!(f.severity, Severity::Warning);
    assert!(f.effect.contains("It runs before nftproxy's nat-prerouting (-100)."), "{}", f.effect);
    assert!(f.effect.contains("before DNAT, addressed to ClusterIPs"), "{}", f.effect);
    assert_eq!(report.exit_code(), 1);
}

#[test]
fn families_nftproxy_does_not_serve_are_not_its_concern() {
    let ip6 = table(TableFamily::Ip6, "filter", vec![drop("FORWARD", FORWARD, 0, 0)]);
    let bridge = table(TableFamily::Bridge, "filter", vec![drop("forward", FORWARD, -200, 0)]);
    let report = run(&[ours(TableFamily::Ip), ip6.clone(), bridge]);
    assert!(!report.findings.iter().any(|f| f.kind == FindingKind::PolicyDrop), "{:?}", found(&report));

    // With both nftproxy tables the ip6 chain matters.
    let report = run(&[ours(TableFamily::Ip), ours(TableFamily::Ip6), ip6.clone()]);
    assert!(has(&report, Severity::Conflict, FindingKind::PolicyDrop, "ip6 filter", Some("FORWARD")));

    // With none, both families are considered (sync may create either).
    let report = run(&[ip6]);
    assert!(has(&report, Severity::Conflict, FindingKind::PolicyDrop, "ip6 filter", Some("FORWARD")));
}

#[test]
fn nat_chains_after_nftproxys_only_see_what_it_did_not_nat() {
    let later = table(TableFamily::Ip, "portmap", vec![accept("prerouting", PREROUTING, -90, "nat", 5)]);
    let report = run(&[ours(TableFamily::Ip), later]);
    assert!(!report.findings.iter().any(|f| f.kind == FindingKind::DnatFirst), "{:?}", found(&report));

    // Before, but empty: a note.
    let empty = table(TableFamily::Inet, "early", vec![accept("prerouting", PREROUTING, -150, "nat", 0)]);
    let report = run(&[ours(TableFamily::Ip), empty]);
    assert!(has(&report, Severity::Info, FindingKind::DnatFirst, "inet early", Some("prerouting")));
    assert_eq!(report.exit_code(), 0);

    // Filter chains with policy accept never compete, whatever their priority.
    let filter = table(TableFamily::Ip, "mangle", vec![accept("PREROUTING", PREROUTING, -150, "filter", 9)]);
    assert!(run(&[ours(TableFamily::Ip), ours(TableFamily::Ip6), filter]).findings.is_empty());
}

#[test]
fn an_owned_nftproxy_table_names_its_holder() {
    let mut owned = ours(TableFamily::Ip);
    owned.flags = TABLE_F_OWNER;
    owned.owner = Some(4242);
    let holder = BTreeMap::from([(4242, Process { pid: 4242, comm: "holder".into(), exe: None })]);
    let report = check_with(&[owned.clone(), ours(TableFamily::Ip6)], &holder, &[]);
    assert!(has(&report, Severity::Warning, FindingKind::OwnTableOwned, "ip nftproxy", None));
    assert!(report.findings[0].summary.contains("process 4242 (holder)"), "{}", report.findings[0].summary);
    assert!(report.findings[0].effect.contains("Operation not permitted"));

    // Owned by an nftproxy process: expected when `run` owns its table.
    let proxy = BTreeMap::from([(4242, Process { pid: 4242, comm: "nftproxy".into(), exe: None })]);
    let report = check_with(&[owned.clone(), ours(TableFamily::Ip6)], &proxy, &[]);
    assert!(has(&report, Severity::Info, FindingKind::OwnTableOwned, "ip nftproxy", None));
    assert_eq!(report.exit_code(), 0);

    // The image swap starts nftproxy as /usr/local/bin/kube-proxy: comm says kube-proxy, the
    // executable nftproxy (found on a real node: `check --api` in the swapped pod warned).
    let swapped = BTreeMap::from([(1, Process { pid: 1, comm: "kube-proxy".into(), exe: Some("nftproxy".into()) })]);
    let mut by_pid_1 = owned.clone();
    by_pid_1.owner = Some(1);
    let report = check_with(&[by_pid_1, ours(TableFamily::Ip6)], &swapped, &[]);
    assert!(has(&report, Severity::Info, FindingKind::OwnTableOwned, "ip nftproxy", None));
    assert!(report.findings[0].summary.contains("process 1 (kube-proxy, executable nftproxy)"), "{report:?}");
    assert_eq!(report.exit_code(), 0);

    // The holder could not be found.
    let report = run(&[owned, ours(TableFamily::Ip6)]);
    assert!(
        report.findings[0].summary.contains("netlink port 4242 (no process found"),
        "{}",
        report.findings[0].summary
    );
}

#[test]
fn changes_to_nftproxys_base_chains_are_named() {
    let mut changed = ours(TableFamily::Ip);
    changed.chains.retain(|c| c.name != "nat-output");
    for c in &mut changed.chains {
        if let Some(b) = &mut c.base {
            if c.name == "nat-prerouting" {
                b.priority = -50;
            }
            if c.name == "filter-input" {
                b.policy = ChainPolicy::Drop;
            }
        }
    }
    changed.chains.push(drop("sneaky", INPUT, 0, 0));
    let report = run(&[changed, ours(TableFamily::Ip6)]);
    let f = report.findings.iter().find(|f| f.kind == FindingKind::OwnTableChanged).unwrap();
    assert_eq!(f.severity, Severity::Warning);
    for part in [
        "base chain nat-output is missing",
        "nat-prerouting is nat prerouting priority -50, not nat prerouting priority -100",
        "filter-input has policy drop",
        "sneaky is a base chain nftproxy did not create",
    ] {
        assert!(f.summary.contains(part), "{part:?} in {}", f.summary);
    }
    // Our own chains are not reported as foreign ones.
    assert!(!report.findings.iter().any(|f| f.kind == FindingKind::PolicyDrop));
}

#[test]
fn dormant_tables_chains_are_not_attached() {
    let mut sleeping = table(TableFamily::Ip, "sleepy", vec![drop("forward", FORWARD, 0, 0)]);
    sleeping.flags = TABLE_F_DORMANT;
    let report = run(&[ours(TableFamily::Ip), ours(TableFamily::Ip6), sleeping]);
    assert!(report.findings.is_empty(), "{:?}", found(&report));
    assert!(report.hooks.iter().any(|r| r.dormant && r.chain == "forward"));

    let mut ours_asleep = ours(TableFamily::Ip);
    ours_asleep.flags = TABLE_F_DORMANT;
    let report = run(&[ours_asleep, ours(TableFamily::Ip6)]);
    assert!(has(&report, Severity::Warning, FindingKind::OwnTableDormant, "ip nftproxy", None));
}

#[test]
fn another_nftproxy_table_is_a_warning() {
    let mut old = ours(TableFamily::Ip);
    old.name = "old-proxy".into();
    let report = run(&[old, ours(TableFamily::Ip), ours(TableFamily::Ip6)]);
    assert!(has(&report, Severity::Warning, FindingKind::OtherNftproxyTable, "ip old-proxy", None));
    // Its chains compete like any foreign ones.
    assert!(has(&report, Severity::Warning, FindingKind::DnatFirst, "ip old-proxy", Some("nat-prerouting")));
}

#[test]
fn legacy_iptables_is_a_note() {
    let report = check_with(&[ours(TableFamily::Ip), ours(TableFamily::Ip6)], &BTreeMap::new(), &["nat".into()]);
    assert_eq!(found(&report), vec![(Severity::Info, FindingKind::IptablesLegacy, "nat".into(), None)]);
    assert_eq!(report.exit_code(), 0);
}

#[test]
fn the_text_report_says_where_what_and_what_to_do() {
    let firewalld = table(TableFamily::Inet, "firewalld", vec![drop("filter_FORWARD", FORWARD, 10, 0)]);
    let report = run(&[ours(TableFamily::Ip), firewalld]);
    let text = report.to_text();
    assert!(text.contains("CONFLICT  inet firewalld chain filter_FORWARD (hook forward, priority 10)"), "{text}");
    assert!(text.contains("may happen: "), "{text}");
    assert!(text.contains("to do: "), "{text}");
    // Lines fit in 100 columns, except where a command in backticks must stay whole.
    assert!(text.lines().all(|l| l.chars().count() <= 100 || l.contains('`')), "{text}");
    assert!(text.contains("`ct status dnat accept`"), "commands are not broken: {text}");
    assert!(text.ends_with("1 conflict, 1 warning, 1 note: exit 1\n"), "{text}");

    // The hook overview: inet chains run for both families, in priority order with ours.
    let forward: Vec<&HookRow> = report.hooks.iter().filter(|r| r.point == "IPv4 forward").collect();
    assert_eq!(forward.iter().map(|r| r.chain.as_str()).collect::<Vec<_>>(), ["filter_FORWARD"]);
    assert!(!forward[0].ours);
    assert!(report.hooks.iter().any(|r| r.point == "IPv6 forward" && r.chain == "filter_FORWARD"));
    let prerouting: Vec<&HookRow> = report.hooks.iter().filter(|r| r.point == "IPv4 prerouting").collect();
    assert_eq!(prerouting.iter().map(|r| r.chain.as_str()).collect::<Vec<_>>(), ["nat-prerouting"]);
    assert!(prerouting[0].ours);
    assert!(
        text.contains("  IPv4 prerouting\n      -100  nat     accept     1 rule  ip nftproxy nat-prerouting *\n"),
        "{text}"
    );

    let clean = run(&[ours(TableFamily::Ip), ours(TableFamily::Ip6)]).to_text();
    assert!(clean.contains("No foreign table or chain conflicts with nftproxy's."), "{clean}");
    assert!(clean.ends_with("0 conflicts, 0 warnings, 0 notes: exit 0\n"), "{clean}");
}

#[test]
fn wrapping_keeps_commands_whole() {
    let mut out = String::new();
    wrap(&mut out, "to do: run `nft delete table ip kube-proxy` now, please", "  ", 20);
    assert_eq!(out, "  to do: run\n  `nft delete table ip kube-proxy`\n  now, please\n");
}

#[test]
fn the_json_report_uses_stable_codes() {
    let report = run(&[]);
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["findings"][0]["kind"], "own-tables-missing");
    assert_eq!(json["findings"][0]["severity"], "warning");
    assert!(json["findings"][0].get("chain").is_none());
}
