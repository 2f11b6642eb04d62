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
//! IPVS leftovers (virtual servers, the `kube-ipvs0` device, `KUBE-` ipsets) are not nftables
//! objects: `run` removes them right after that transaction ([`crate::netlink::ipvs`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;

use crate::net::IpFamily;
use crate::netlink::ipvs::IpvsLeftovers;
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
        Ok(out)
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
        let base: BTreeSet<&str> =
            table.info.chains.iter().filter(|c| c.base.is_some()).map(|c| c.name.as_str()).collect();
        let mut removed: BTreeSet<&str> = table
            .info
            .chains
            .iter()
            .map(|c: &ChainInfo| c.name.as_str())
            .filter(|c| is_kube_proxy_chain(name, c))
            .collect();
        // A chain a kept regular chain jumps to must stay (deleting it would fail the whole
        // transaction); and then so must whatever its own rules jump to.
        let mut kept: BTreeMap<&str, String> = BTreeMap::new();
        loop {
            let holder = table.rules.iter().find_map(|r| {
                let from_kept = !removed.contains(r.chain.as_str()) && !base.contains(r.chain.as_str());
                let target = r.targets.iter().find(|t| removed.contains(t.as_str()))?;
                from_kept.then_some((target.as_str(), r))
            });
            let Some((target, rule)) = holder else { break };
            removed.remove(target);
            let why = format!("chain {} jumps to it (rule handle {})", rule.chain, rule.handle);
            kept.insert(target, why);
        }
        for (chain, why) in kept {
            self.kept.push(Kept { what: format!("{} {name} {chain}", family_keyword(family)), why });
        }
        let chain_ref = |chain: &str| ChainRef { family, table: name.to_string(), chain: chain.to_string() };
        for rule in table.rules.iter().filter(|r| base.contains(r.chain.as_str())) {
            if let Some(target) = rule.targets.iter().find(|t| removed.contains(t.as_str())) {
                self.jumps.push(Jump { from: chain_ref(&rule.chain), handle: rule.handle, target: target.clone() });
            }
        }
        self.chains.extend(removed.into_iter().map(chain_ref));
    }

    /// Nothing to remove.
    pub(crate) fn is_empty(&self) -> bool {
        self.tables.is_empty() && self.jumps.is_empty() && self.chains.is_empty() && self.ipvs.is_empty()
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
