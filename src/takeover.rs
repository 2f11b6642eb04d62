//! Taking over from kube-proxy: the leftovers of its other modes that `run` removes when it
//! starts, as upstream kube-proxy does when it starts in nftables mode, and `check` reports.
//!
//! - its nftables-mode tables, `ip kube-proxy` and `ip6 kube-proxy`;
//! - its iptables- and ipvs-mode chains in the iptables-nft tables (`filter`, `nat`, `mangle`
//!   of `ip` and `ip6`), with the rules of the built-in chains that jump to them; kubelet's own
//!   chains (`KUBE-FIREWALL`, `KUBE-KUBELET-CANARY`, `KUBE-MARK-DROP`, `KUBE-IPTABLES-HINT`) stay,
//!   as upstream leaves them.
//!
//! Upstream deletes each jump by its exact arguments and then the chains, best effort. Here a
//! jump is any rule of a built-in chain whose verdict targets a removed chain, found by reading
//! the rules back over netlink, and the deletions ([`Leftovers::ops`]) go first in nftproxy's
//! first full sync: one transaction, so the node never has neither kube-proxy's rules nor
//! nftproxy's. A chain something else still jumps to (a rule of a regular chain that is not
//! kube-proxy's) is kept, with the reason, since deleting it would fail the whole transaction.
//!
//! IPVS leftovers (virtual servers, the `kube-ipvs0` device, `KUBE-` ipsets) and the same
//! iptables chains written with the legacy backend (x_tables, which netlink for nf_tables cannot
//! see or change) are not nftables objects: `run` removes them right after that transaction
//! ([`crate::netlink::ipvs`], [`crate::netlink::xtables`]), as upstream's cleanup does with
//! `iptables-legacy` when its image's iptables-wrapper picked that backend.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;

use crate::net::IpFamily;
use crate::netlink::ipvs::IpvsLeftovers;
use crate::netlink::xtables::{self, LegacyTable, Removal};
use crate::netlink::{ChainInfo, Kernel, NetlinkError, RuleInfo, TABLE_F_OWNER, TableFamily, TableInfo};
use crate::nft::ast::Owner;
use crate::nft::diff::{Op, OpKind};
use crate::nft::render::family_keyword;

/// kube-proxy's nftables-mode table, in the `ip` and `ip6` families.
pub(crate) const KUBE_PROXY_TABLE: &str = "kube-proxy";

/// The iptables-nft tables kube-proxy writes into.
const IPTABLES_TABLES: [&str; 3] = ["filter", "nat", "mangle"];

/// kube-proxy's chains per iptables table, in its iptables and ipvs modes (what upstream's
/// cleanup deletes).
fn removed_chains(table: &str) -> &'static [&'static str] {
    match table {
        "nat" => &[
            "KUBE-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-MARK-MASQ",
            "KUBE-PROXY-CANARY",
            "KUBE-NODE-PORT",
            "KUBE-LOAD-BALANCER",
        ],
        "filter" => &[
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-FORWARD",
            "KUBE-NODEPORTS",
            "KUBE-PROXY-FIREWALL",
            "KUBE-PROXY-CANARY",
            "KUBE-NODE-PORT",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
        ],
        "mangle" => &["KUBE-PROXY-CANARY"],
        _ => &[],
    }
}

/// Prefixes of kube-proxy's per-service and per-endpoint chains (nat only).
const REMOVED_PREFIXES: [&str; 5] = ["KUBE-SVC-", "KUBE-SVL-", "KUBE-SEP-", "KUBE-FW-", "KUBE-EXT-"];

fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    removed_chains(table).contains(&chain) || (table == "nat" && REMOVED_PREFIXES.iter().any(|p| chain.starts_with(p)))
}

fn ip_family(family: TableFamily) -> Option<IpFamily> {
    match family {
        TableFamily::Ip => Some(IpFamily::V4),
        TableFamily::Ip6 => Some(IpFamily::V6),
        _ => None,
    }
}

/// A chain of a table (`ip nat KUBE-SERVICES`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub(crate) struct ChainRef {
    #[serde(serialize_with = "family_name")]
    pub family: IpFamily,
    pub table: String,
    pub chain: String,
}

fn family_name<S: serde::Serializer>(family: &IpFamily, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(family_keyword(*family))
}

impl fmt::Display for ChainRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", family_keyword(self.family), self.table, self.chain)
    }
}

/// A rule of a built-in chain jumping to one of kube-proxy's chains.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Jump {
    #[serde(flatten)]
    pub from: ChainRef,
    pub handle: u64,
    pub target: String,
}

/// One of kube-proxy's leftovers that stays, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Kept {
    pub what: String,
    pub why: String,
}

/// What taking over removes (and what it cannot) in this network namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Leftovers {
    /// kube-proxy's nftables-mode tables (`ip kube-proxy`, `ip6 kube-proxy`).
    #[serde(serialize_with = "table_names")]
    pub tables: Vec<IpFamily>,
    /// Rules of built-in chains that jump to a removed chain.
    pub jumps: Vec<Jump>,
    /// kube-proxy's iptables-mode chains.
    pub chains: Vec<ChainRef>,
    /// Leftovers that stay.
    pub kept: Vec<Kept>,
    /// IPVS state, removed right after the transaction.
    pub ipvs: IpvsLeftovers,
    /// kube-proxy's chains in iptables-legacy tables, removed right after the transaction.
    pub legacy: Vec<LegacyLeftover>,
}

/// kube-proxy's leftovers in one iptables-legacy table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct LegacyLeftover {
    #[serde(serialize_with = "family_name")]
    pub family: IpFamily,
    pub table: String,
    /// Its chains (kube-proxy's), flushed and deleted.
    pub chains: Vec<String>,
    /// Rules of built-in chains that jump to them: (chain, position from 1, target).
    pub jumps: Vec<(String, usize, String)>,
}

impl LegacyLeftover {
    /// `iptables-legacy nat` or `ip6tables-legacy nat`.
    fn label(&self) -> String {
        legacy_label(self.family, &self.table)
    }
}

fn legacy_label(family: IpFamily, table: &str) -> String {
    match family {
        IpFamily::V4 => format!("iptables-legacy {table}"),
        IpFamily::V6 => format!("ip6tables-legacy {table}"),
    }
}

fn table_names<S: serde::Serializer>(tables: &[IpFamily], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(tables.iter().map(|f| format!("{} {KUBE_PROXY_TABLE}", family_keyword(*f))))
}

/// One iptables-nft table as read for the takeover: its chains and its rules.
#[derive(Debug, Clone)]
pub(crate) struct IptablesTable<'a> {
    pub info: &'a TableInfo,
    pub rules: Vec<RuleInfo>,
}

impl Leftovers {
    /// Reads this network namespace's tables and finds kube-proxy's leftovers.
    pub(crate) fn read(kernel: &mut Kernel) -> Result<Leftovers, NetlinkError> {
        let tables = kernel.list_tables()?;
        Leftovers::read_with(kernel, &tables)
    }

    /// Like [`Leftovers::read`], with the tables already listed (`check`).
    pub(crate) fn read_with(kernel: &mut Kernel, tables: &[TableInfo]) -> Result<Leftovers, NetlinkError> {
        let mut iptables = Vec::new();
        for info in tables {
            let theirs = info.chains.iter().any(|c| is_kube_proxy_chain(&info.name, &c.name));
            if ip_family(info.family).is_some() && IPTABLES_TABLES.contains(&info.name.as_str()) && theirs {
                iptables.push(IptablesTable { info, rules: kernel.list_rules(info.family, &info.name)? });
            }
        }
        let mut out = Leftovers::find(tables, &iptables);
        out.ipvs = IpvsLeftovers::read().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot read IPVS state (virtual servers, kube-ipvs0, ipsets); left as it is");
            IpvsLeftovers::default()
        });
        for family in IpFamily::ALL {
            for name in xtables::loaded_tables(family) {
                if !IPTABLES_TABLES.contains(&name.as_str()) {
                    continue;
                }
                match LegacyTable::read(family, &name) {
                    Ok(table) => out.add_legacy(&table),
                    Err(e) => tracing::warn!(error = %e, "cannot read an iptables-legacy table; left as it is"),
                }
            }
        }
        Ok(out)
    }

    /// kube-proxy's chains in one iptables-legacy table, and the jumps to them.
    pub(crate) fn add_legacy(&mut self, table: &LegacyTable) {
        let (removal, kept) = legacy_removal(table);
        for (chain, why) in kept {
            self.kept.push(Kept { what: format!("{} {chain}", legacy_label(table.family, &table.name)), why });
        }
        if removal.chains.is_empty() {
            return;
        }
        let targets: BTreeMap<(String, usize), String> =
            table.rules().into_iter().filter_map(|r| Some(((r.chain, r.position), r.jump?))).collect();
        self.legacy.push(LegacyLeftover {
            family: table.family,
            table: table.name.clone(),
            chains: removal.chains.iter().cloned().collect(),
            jumps: removal
                .rules
                .iter()
                .map(|(chain, pos)| {
                    (chain.clone(), *pos, targets.get(&(chain.clone(), *pos)).cloned().unwrap_or_default())
                })
                .collect(),
        });
    }

    /// What to remove, from every table here (`tables`) and the rules of the iptables-nft
    /// tables holding kube-proxy's chains (`iptables`).
    pub(crate) fn find(tables: &[TableInfo], iptables: &[IptablesTable<'_>]) -> Leftovers {
        let mut out = Leftovers::default();
        for t in tables.iter().filter(|t| t.name == KUBE_PROXY_TABLE) {
            let Some(family) = ip_family(t.family) else { continue };
            if t.flags & TABLE_F_OWNER != 0 {
                out.kept.push(Kept {
                    what: t.label(),
                    why: "owned by a running process (flags owner): only it can delete the table".into(),
                });
                continue;
            }
            out.tables.push(family);
        }
        for table in iptables {
            let Some(family) = ip_family(table.info.family) else { continue };
            out.add_iptables(family, table);
        }
        out
    }

    fn add_iptables(&mut self, family: IpFamily, table: &IptablesTable<'_>) {
        let name = table.info.name.as_str();
        let chains: Vec<(&str, bool)> =
            table.info.chains.iter().map(|c: &ChainInfo| (c.name.as_str(), c.base.is_some())).collect();
        let rules: Vec<(&str, String, &[String])> = table
            .rules
            .iter()
            .map(|r| (r.chain.as_str(), format!("rule handle {}", r.handle), r.targets.as_slice()))
            .collect();
        let decision = decide(name, &chains, &rules);
        for (chain, why) in decision.kept {
            self.kept.push(Kept { what: format!("{} {name} {chain}", family_keyword(family)), why });
        }
        let chain_ref = |chain: &str| ChainRef { family, table: name.to_string(), chain: chain.to_string() };
        for (i, target) in decision.jumps {
            let rule = &table.rules[i];
            self.jumps.push(Jump { from: chain_ref(&rule.chain), handle: rule.handle, target });
        }
        self.chains.extend(decision.removed.iter().map(|c| chain_ref(c)));
    }

    /// Nothing to remove.
    pub(crate) fn is_empty(&self) -> bool {
        self.tables.is_empty()
            && self.jumps.is_empty()
            && self.chains.is_empty()
            && self.ipvs.is_empty()
            && self.legacy.is_empty()
    }

    /// The deletions, in an order the kernel accepts in one transaction: the jumps, then every
    /// removed chain flushed (its rules jump to other removed chains), the chains, the tables.
    pub(crate) fn ops(&self) -> Vec<Op> {
        let op =
            |family, table: &str, kind| Op { family, table: table.to_string(), kind, owner: Owner::infrastructure() };
        let mut out = Vec::new();
        // Last first within a chain: handles and positions agree on the fake kernel too.
        let mut jumps: Vec<&Jump> = self.jumps.iter().collect();
        jumps.sort_by(|a, b| (&a.from, std::cmp::Reverse(a.handle)).cmp(&(&b.from, std::cmp::Reverse(b.handle))));
        for j in jumps {
            let kind = OpKind::DeleteRule { chain: j.from.chain.clone(), handle: j.handle };
            out.push(op(j.from.family, &j.from.table, kind));
        }
        for c in &self.chains {
            out.push(op(c.family, &c.table, OpKind::FlushChain { chain: c.chain.clone() }));
        }
        for c in &self.chains {
            out.push(op(c.family, &c.table, OpKind::DeleteChain { chain: c.chain.clone() }));
        }
        for family in &self.tables {
            out.push(op(*family, KUBE_PROXY_TABLE, OpKind::DeleteTable));
        }
        out
    }

    /// The `check` report's section: what `nftproxy run` removes, one line per operation, and
    /// what stays.
    pub(crate) fn write_text(&self, out: &mut String) {
        use std::fmt::Write as _;
        let _ = writeln!(
            out,
            "nftproxy run removes (kube-proxy's leftovers, in the transaction of its first sync; \
             --cleanup-kube-proxy=false keeps them):"
        );
        for j in &self.jumps {
            let _ = writeln!(out, "  delete rule {} handle {} (it jumps to {})", j.from, j.handle, j.target);
        }
        for c in &self.chains {
            let _ = writeln!(out, "  delete chain {c} (flushed first)");
        }
        for family in &self.tables {
            let _ = writeln!(out, "  delete table {} {KUBE_PROXY_TABLE}", family_keyword(*family));
        }
        if !self.ipvs.is_empty() {
            let _ = writeln!(out, "  then, outside nftables: {}", self.ipvs.summary());
        }
        for l in &self.legacy {
            for (chain, position, target) in &l.jumps {
                let _ = writeln!(out, "  then: delete rule {} {chain} {position} (it jumps to {target})", l.label());
            }
            for chain in &l.chains {
                let _ = writeln!(out, "  then: delete chain {} {chain} (flushed first)", l.label());
            }
        }
        for k in &self.kept {
            let _ = writeln!(out, "  stays: {} ({})", k.what, k.why);
        }
        out.push('\n');
    }

    /// One line for logs: what is removed (`ip kube-proxy; 3 jumps, 12 chains in ip nat, …`).
    pub(crate) fn summary(&self) -> String {
        let mut parts: Vec<String> =
            self.tables.iter().map(|f| format!("{} {KUBE_PROXY_TABLE}", family_keyword(*f))).collect();
        let mut per_table: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for j in &self.jumps {
            per_table.entry(format!("{} {}", family_keyword(j.from.family), j.from.table)).or_default().0 += 1;
        }
        for c in &self.chains {
            per_table.entry(format!("{} {}", family_keyword(c.family), c.table)).or_default().1 += 1;
        }
        for (table, (jumps, chains)) in per_table {
            parts.push(format!("{table}: {jumps} jump rule(s) and {chains} KUBE- chain(s)"));
        }
        if !self.ipvs.is_empty() {
            parts.push(self.ipvs.summary());
        }
        for l in &self.legacy {
            parts.push(format!("{}: {} jump rule(s) and {} KUBE- chain(s)", l.label(), l.jumps.len(), l.chains.len()));
        }
        parts.join("; ")
    }
}

/// Removes kube-proxy's IPVS-mode state, right after the takeover's transaction (see
/// [`crate::netlink::ipvs`]). Best effort: what cannot be removed is logged.
pub(crate) fn remove_ipvs_leftovers(ipvs: &IpvsLeftovers) {
    if ipvs.is_empty() {
        return;
    }
    let failed = ipvs.remove();
    for (what, error) in &failed {
        tracing::warn!(leftover = %what, %error, "cannot remove a kube-proxy IPVS leftover; it stays");
    }
    if failed.is_empty() {
        tracing::info!(removed = %ipvs.summary(), "removed kube-proxy's IPVS leftovers");
    }
}

/// Removes kube-proxy's chains from iptables-legacy tables, right after the takeover's
/// transaction (see [`crate::netlink::xtables`]). Each table is read again and decided again
/// when written, so a change in between is not undone. Best effort: failures are logged.
pub(crate) fn remove_legacy_leftovers(legacy: &[LegacyLeftover]) {
    for l in legacy {
        match xtables::remove(l.family, &l.table, |t| legacy_removal(t).0) {
            Ok(removal) => tracing::info!(
                table = %l.label(),
                chains = removal.chains.len(),
                jumps = removal.rules.len(),
                "removed kube-proxy's iptables-legacy leftovers"
            ),
            Err(e) => {
                tracing::warn!(table = %l.label(), error = %e, "cannot remove kube-proxy's iptables-legacy leftovers; they stay")
            }
        }
    }
}

/// What to take out of one iptables-legacy table, and what stays with why.
fn legacy_removal(table: &LegacyTable) -> (Removal, BTreeMap<String, String>) {
    let builtin = table.builtin_chains();
    let chains: Vec<(&str, bool)> =
        builtin.iter().map(|c| (*c, true)).chain(table.user_chains().into_iter().map(|c| (c, false))).collect();
    let rules = table.rules();
    let targets: Vec<Vec<String>> = rules.iter().map(|r| r.jump.iter().cloned().collect()).collect();
    let described: Vec<(&str, String, &[String])> = rules
        .iter()
        .zip(&targets)
        .map(|(r, t)| (r.chain.as_str(), format!("rule {}", r.position), t.as_slice()))
        .collect();
    let decision = decide(&table.name, &chains, &described);
    let removal = Removal {
        chains: decision.removed.iter().map(|c| c.to_string()).collect(),
        rules: decision.jumps.iter().map(|(i, _)| (rules[*i].chain.clone(), rules[*i].position)).collect(),
    };
    (removal, decision.kept.into_iter().map(|(c, why)| (c.to_string(), why)).collect())
}

/// Which of kube-proxy's chains one iptables table loses, for either backend.
struct Decision<'a> {
    /// kube-proxy's chains to delete.
    removed: BTreeSet<&'a str>,
    /// kube-proxy's chains that stay, with why.
    kept: BTreeMap<&'a str, String>,
    /// Rules of built-in chains jumping to a removed chain: (index into the rules, target).
    jumps: Vec<(usize, String)>,
}

/// Decides for a table's `chains` (name, built in) and `rules` (chain, how a message names the
/// rule, the chains it jumps to): every chain of kube-proxy's goes, but one that a chain which
/// is not kube-proxy's (and not built in) still jumps to, and then whatever it jumps to (deleting
/// it would fail the whole transaction, or leave a dangling jump).
fn decide<'a>(table: &str, chains: &[(&'a str, bool)], rules: &[(&'a str, String, &'a [String])]) -> Decision<'a> {
    let base: BTreeSet<&str> = chains.iter().filter(|(_, b)| *b).map(|(c, _)| *c).collect();
    let mut removed: BTreeSet<&str> =
        chains.iter().map(|(c, _)| *c).filter(|c| is_kube_proxy_chain(table, c)).collect();
    let mut kept: BTreeMap<&str, String> = BTreeMap::new();
    loop {
        let holder = rules.iter().find_map(|(chain, label, targets)| {
            let from_kept = !removed.contains(chain) && !base.contains(chain);
            let target = targets.iter().find(|t| removed.contains(t.as_str()))?;
            from_kept.then_some((target.as_str(), chain, label))
        });
        let Some((target, chain, label)) = holder else { break };
        let Some(&target) = removed.get(target) else { break };
        removed.remove(target);
        kept.insert(target, format!("chain {chain} jumps to it ({label})"));
    }
    let mut jumps = Vec::new();
    for (i, (chain, _, targets)) in rules.iter().enumerate() {
        if !base.contains(chain) {
            continue;
        }
        if let Some(target) = targets.iter().find(|t| removed.contains(t.as_str())) {
            jumps.push((i, target.clone()));
        }
    }
    Decision { removed, kept, jumps }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::BaseChainInfo;

    fn chain(name: &str, base: bool) -> ChainInfo {
        let base = base.then(|| BaseChainInfo {
            hooknum: 0,
            priority: -100,
            chain_type: "nat".into(),
            policy: crate::netlink::ChainPolicy::Accept,
            devices: Vec::new(),
            rules: 0,
        });
        ChainInfo { name: name.into(), base }
    }

    fn table(family: TableFamily, name: &str, chains: &[(&str, bool)]) -> TableInfo {
        TableInfo {
            family,
            name: name.into(),
            flags: 0,
            owner: None,
            comment: None,
            chains: chains.iter().map(|(n, b)| chain(n, *b)).collect(),
        }
    }

    fn rule(chain: &str, handle: u64, targets: &[&str]) -> RuleInfo {
        RuleInfo { chain: chain.into(), handle, targets: targets.iter().map(|t| t.to_string()).collect() }
    }

    #[test]
    fn kube_proxy_chains_go_with_their_jumps_and_kubelets_stay() {
        let nat = table(
            TableFamily::Ip,
            "nat",
            &[
                ("PREROUTING", true),
                ("OUTPUT", true),
                ("POSTROUTING", true),
                ("KUBE-SERVICES", false),
                ("KUBE-SVC-ABC", false),
                ("KUBE-SEP-DEF", false),
                ("KUBE-POSTROUTING", false),
                ("KUBE-MARK-MASQ", false),
                ("KUBE-MARK-DROP", false),
                ("DOCKER", false),
            ],
        );
        let mut proxy_table = table(TableFamily::Ip6, KUBE_PROXY_TABLE, &[("nat-prerouting", true)]);
        proxy_table.flags = 0;
        let rules = vec![
            rule("PREROUTING", 3, &["KUBE-SERVICES"]),
            rule("PREROUTING", 4, &["DOCKER"]),
            rule("OUTPUT", 5, &["KUBE-SERVICES"]),
            rule("POSTROUTING", 6, &["KUBE-POSTROUTING"]),
            rule("KUBE-SERVICES", 7, &["KUBE-SVC-ABC"]),
            rule("KUBE-SVC-ABC", 8, &["KUBE-SEP-DEF"]),
            rule("KUBE-SEP-DEF", 9, &["KUBE-MARK-MASQ"]),
        ];
        let tables = vec![nat.clone(), proxy_table];
        let l = Leftovers::find(&tables, &[IptablesTable { info: &tables[0], rules }]);
        assert_eq!(l.tables, vec![IpFamily::V6]);
        let jumps: Vec<(String, u64)> = l.jumps.iter().map(|j| (j.from.chain.clone(), j.handle)).collect();
        assert_eq!(jumps, vec![("PREROUTING".into(), 3), ("OUTPUT".into(), 5), ("POSTROUTING".into(), 6)]);
        let chains: Vec<&str> = l.chains.iter().map(|c| c.chain.as_str()).collect();
        assert_eq!(chains, vec!["KUBE-MARK-MASQ", "KUBE-POSTROUTING", "KUBE-SEP-DEF", "KUBE-SERVICES", "KUBE-SVC-ABC"]);
        assert!(l.kept.is_empty());
        let ops: Vec<String> = l.ops().iter().map(|o| o.to_string()).collect();
        assert_eq!(ops[0], "delete rule ip nat OUTPUT handle 5");
        assert_eq!(ops[3], "flush chain ip nat KUBE-MARK-MASQ");
        assert_eq!(ops[8], "delete chain ip nat KUBE-MARK-MASQ");
        assert_eq!(ops.last().map(String::as_str), Some("delete table ip6 kube-proxy"));
        assert_eq!(l.summary(), "ip6 kube-proxy; ip nat: 3 jump rule(s) and 5 KUBE- chain(s)");
    }

    #[test]
    fn the_deletions_open_the_first_full_sync_and_only_it() {
        use crate::netlink::Netfilter as _;
        let kernel = crate::netlink::SharedFake::new(crate::netlink::FakeNetfilter::new());
        let leftovers = Leftovers { tables: vec![IpFamily::V4], ..Leftovers::default() };
        let create = Op {
            family: IpFamily::V4,
            table: KUBE_PROXY_TABLE.into(),
            kind: OpKind::AddTable { flags: 0, userdata: None },
            owner: Owner::infrastructure(),
        };
        kernel.lock().apply(&crate::nft::diff::Transaction { ops: vec![create] }).unwrap();
        let config = crate::config::ProxyConfig::new("node1");
        let nodeports: crate::sync::NodePortResolver = Box::new(|_, _| crate::nodeaddr::NodePortTargets {
            v4: crate::plan::NodePorts::Addresses(Vec::new()),
            v6: crate::plan::NodePorts::Addresses(Vec::new()),
            loopback: Vec::new(),
        });
        let mut syncer = crate::sync::Syncer::new(config, Box::new(kernel.clone()), nodeports);
        syncer.prepend_to_next_full_sync(leftovers.ops());
        let state = crate::model::ClusterState::new();
        let pending = crate::index::Pending::default();
        syncer.sync(&state, &pending, crate::sync::SyncReason::Startup, true).unwrap();
        {
            let k = kernel.lock();
            let first = k.applied.last().unwrap().summary();
            assert_eq!(first[0], "delete table ip kube-proxy");
            assert!(first[1..].iter().any(|op| op == "add table ip nftproxy"), "{first:?}");
            assert!(!k.state.tables.iter().any(|t| t.name == KUBE_PROXY_TABLE));
        }
        syncer.sync(&state, &pending, crate::sync::SyncReason::Periodic, true).unwrap();
        let k = kernel.lock();
        assert!(k.applied.iter().skip(2).all(|tx| !tx.summary().iter().any(|op| op.contains("kube-proxy"))));
    }

    #[test]
    fn a_chain_something_else_jumps_to_stays_with_what_it_jumps_to() {
        let nat = table(
            TableFamily::Ip,
            "nat",
            &[("PREROUTING", true), ("CNI-HOOK", false), ("KUBE-SERVICES", false), ("KUBE-SVC-ABC", false)],
        );
        let rules = vec![
            rule("PREROUTING", 1, &["KUBE-SERVICES"]),
            rule("CNI-HOOK", 2, &["KUBE-SERVICES"]),
            rule("KUBE-SERVICES", 3, &["KUBE-SVC-ABC"]),
        ];
        let mut owned = table(TableFamily::Ip, KUBE_PROXY_TABLE, &[]);
        owned.flags = TABLE_F_OWNER;
        let tables = vec![nat, owned];
        let l = Leftovers::find(&tables, &[IptablesTable { info: &tables[0], rules }]);
        assert!(l.chains.is_empty() && l.jumps.is_empty() && l.tables.is_empty(), "{l:?}");
        let kept: Vec<&str> = l.kept.iter().map(|k| k.what.as_str()).collect();
        assert_eq!(kept, vec!["ip kube-proxy", "ip nat KUBE-SERVICES", "ip nat KUBE-SVC-ABC"]);
        assert!(l.kept[1].why.contains("CNI-HOOK"), "{:?}", l.kept);
        assert!(l.is_empty());
    }
}
