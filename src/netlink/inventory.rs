//! Reading every table of every family, with its chains and the hooks of its base chains, for
//! `nftproxy check`. Unlike [`super::decode`] this reads foreign tables too, and keeps only what
//! decides whether they compete with nftproxy's: hooks, priorities, types, policies, rule counts,
//! table flags and owners. Rules of regular chains are not read.

use nftnl_sys as sys;

use super::decode::{a, absent_is_empty};
use super::error::NetlinkError;
use super::socket::{NLM_F_DUMP, Socket};
use super::sys::{self as raw, Body, msg};
use crate::nft::wire::udata;

/// `NFPROTO_UNSPEC`: a dump request for this family answers with every family's objects.
const NFPROTO_UNSPEC: u16 = 0;

/// `NFT_TABLE_F_DORMANT`: the table's base chains are not attached to their hooks.
pub(crate) const TABLE_F_DORMANT: u32 = 0x1;
/// `NFT_TABLE_F_OWNER` (only the owning netlink socket may change the table, which goes away
/// with it) and `NFT_TABLE_F_PERSIST` (an owned table stays when its owner closes).
pub use crate::nft::wire::consts::{TABLE_F_OWNER, TABLE_F_PERSIST};

/// An nftables address family (`nft list tables` spells them `ip`, `ip6`, `inet`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum TableFamily {
    Ip,
    Ip6,
    Inet,
    Arp,
    Bridge,
    Netdev,
}

impl TableFamily {
    /// Every family, in `nft list ruleset` order.
    pub(crate) const ALL: [TableFamily; 6] = [
        TableFamily::Ip,
        TableFamily::Ip6,
        TableFamily::Inet,
        TableFamily::Arp,
        TableFamily::Bridge,
        TableFamily::Netdev,
    ];

    /// The nft keyword.
    pub(crate) fn keyword(self) -> &'static str {
        match self {
            TableFamily::Ip => "ip",
            TableFamily::Ip6 => "ip6",
            TableFamily::Inet => "inet",
            TableFamily::Arp => "arp",
            TableFamily::Bridge => "bridge",
            TableFamily::Netdev => "netdev",
        }
    }

    /// The kernel's `NFPROTO_*` number.
    pub(crate) fn nfproto(self) -> u32 {
        match self {
            TableFamily::Inet => 1,
            TableFamily::Ip => 2,
            TableFamily::Arp => 3,
            TableFamily::Netdev => 5,
            TableFamily::Bridge => 7,
            TableFamily::Ip6 => 10,
        }
    }

    /// The family with this `NFPROTO_*` number.
    pub(crate) fn from_nfproto(n: u32) -> Option<TableFamily> {
        TableFamily::ALL.into_iter().find(|f| f.nfproto() == n)
    }

    /// The name of hook number `hooknum` in this family (`NF_INET_*`, `NF_ARP_*`,
    /// `NF_NETDEV_*`, `NF_BR_*`), as nft prints it.
    pub(crate) fn hook_name(self, hooknum: u32) -> Option<&'static str> {
        let names: &[&'static str] = match self {
            TableFamily::Ip | TableFamily::Ip6 | TableFamily::Bridge => {
                &["prerouting", "input", "forward", "output", "postrouting"]
            }
            TableFamily::Inet => &["prerouting", "input", "forward", "output", "postrouting", "ingress"],
            TableFamily::Arp => &["input", "output"],
            TableFamily::Netdev => &["ingress", "egress"],
        };
        names.get(usize::try_from(hooknum).ok()?).copied()
    }
}

impl std::fmt::Display for TableFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.keyword())
    }
}

/// A base chain's default verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChainPolicy {
    Accept,
    Drop,
}

impl ChainPolicy {
    /// The nft keyword.
    pub(crate) fn keyword(self) -> &'static str {
        match self {
            ChainPolicy::Accept => "accept",
            ChainPolicy::Drop => "drop",
        }
    }
}

/// What attaches a chain to a hook, as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BaseChainInfo {
    /// The hook number in the table's family (see [`TableFamily::hook_name`]).
    pub hooknum: u32,
    /// Lower runs first.
    pub priority: i32,
    /// `filter`, `nat` or `route`.
    pub chain_type: String,
    pub policy: ChainPolicy,
    /// Devices of `netdev` (and `inet ingress`) chains.
    pub devices: Vec<String>,
    /// Rules in the chain.
    pub rules: usize,
}

/// One chain of a table; only base chains carry details.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChainInfo {
    pub name: String,
    pub base: Option<BaseChainInfo>,
}

/// One table, as `nft list tables` and `nft list chains` would show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableInfo {
    pub family: TableFamily,
    pub name: String,
    /// `NFT_TABLE_F_*` ([`TABLE_F_DORMANT`], [`TABLE_F_OWNER`], [`TABLE_F_PERSIST`]).
    pub flags: u32,
    /// The netlink port id of the owning socket (`NFTA_TABLE_OWNER`), for owned tables.
    pub owner: Option<u32>,
    /// The table comment, if it has one.
    pub comment: Option<String>,
    /// Chains in the order the kernel listed them.
    pub chains: Vec<ChainInfo>,
}

impl TableInfo {
    /// `ip nftproxy`, as nft names a table.
    pub(crate) fn label(&self) -> String {
        format!("{} {}", self.family, self.name)
    }

    /// True when the table's base chains are not attached (`flags dormant`).
    pub(crate) fn is_dormant(&self) -> bool {
        self.flags & TABLE_F_DORMANT != 0
    }

    /// The base chains, with their hooks.
    pub(crate) fn base_chains(&self) -> impl Iterator<Item = (&ChainInfo, &BaseChainInfo)> {
        self.chains.iter().filter_map(|c| c.base.as_ref().map(|b| (c, b)))
    }
}

/// Reads every table of every family with its chains, and counts the rules of base chains.
pub(super) fn list_tables(sock: &mut Socket) -> Result<Vec<TableInfo>, NetlinkError> {
    let mut tables = read_tables(sock)?;
    read_chains(sock, &mut tables)?;
    for table in &mut tables {
        let fam = u16::try_from(table.family.nfproto()).unwrap_or(NFPROTO_UNSPEC);
        for chain in &mut table.chains {
            if let Some(base) = &mut chain.base {
                base.rules = count_rules(sock, fam, &table.name, &chain.name)?;
            }
        }
    }
    tables.sort_by(|x, y| (x.family, &x.name).cmp(&(y.family, &y.name)));
    Ok(tables)
}

fn read_tables(sock: &mut Socket) -> Result<Vec<TableInfo>, NetlinkError> {
    let filter = raw::Table::new()?;
    let mut tables = Vec::new();
    sock.query(msg::GETTABLE, NFPROTO_UNSPEC, NLM_F_DUMP, Body::Table(&filter), |msg| {
        let Some(t) = msg.table() else { return Ok(()) };
        let (Some(name), Some(family)) = (
            t.get_str(a(sys::NFTNL_TABLE_NAME)),
            t.get_u32(a(sys::NFTNL_TABLE_FAMILY)).and_then(TableFamily::from_nfproto),
        ) else {
            return Ok(());
        };
        let comment = t.get_data(a(sys::NFTNL_TABLE_USERDATA)).and_then(|u| udata::find_comment(&u, udata::COMMENT));
        tables.push(TableInfo {
            family,
            name,
            flags: t.get_u32(a(sys::NFTNL_TABLE_FLAGS)).unwrap_or(0),
            owner: t.get_u32(a(sys::NFTNL_TABLE_OWNER)),
            comment,
            chains: Vec::new(),
        });
        Ok(())
    })?;
    Ok(tables)
}

fn read_chains(sock: &mut Socket, tables: &mut [TableInfo]) -> Result<(), NetlinkError> {
    let filter = raw::Chain::new()?;
    sock.query(msg::GETCHAIN, NFPROTO_UNSPEC, NLM_F_DUMP, Body::Chain(&filter), |msg| {
        let Some(c) = msg.chain() else { return Ok(()) };
        let (Some(name), Some(table), Some(family)) = (
            c.get_str(a(sys::NFTNL_CHAIN_NAME)),
            c.get_str(a(sys::NFTNL_CHAIN_TABLE)),
            c.get_u32(a(sys::NFTNL_CHAIN_FAMILY)).and_then(TableFamily::from_nfproto),
        ) else {
            return Ok(());
        };
        // A chain of a table created after the table dump is skipped; the next check sees both.
        let Some(t) = tables.iter_mut().find(|t| t.family == family && t.name == table) else { return Ok(()) };
        let base = c.get_u32(a(sys::NFTNL_CHAIN_HOOKNUM)).map(|hooknum| {
            let mut devices = c.get_str_array(a(sys::NFTNL_CHAIN_DEVICES));
            if devices.is_empty() {
                devices.extend(c.get_str(a(sys::NFTNL_CHAIN_DEV)));
            }
            BaseChainInfo {
                hooknum,
                priority: c.get_s32(a(sys::NFTNL_CHAIN_PRIO)).unwrap_or(0),
                chain_type: c.get_str(a(sys::NFTNL_CHAIN_TYPE)).unwrap_or_else(|| "filter".to_string()),
                // NF_DROP is 0, NF_ACCEPT 1; the kernel allows no other policy.
                policy: match c.get_u32(a(sys::NFTNL_CHAIN_POLICY)) {
                    Some(0) => ChainPolicy::Drop,
                    _ => ChainPolicy::Accept,
                },
                devices,
                rules: 0,
            }
        });
        t.chains.push(ChainInfo { name, base });
        Ok(())
    })
}

/// Counts the rules of one chain (a dump filtered by table and chain).
fn count_rules(sock: &mut Socket, fam: u16, table: &str, chain: &str) -> Result<usize, NetlinkError> {
    let mut filter = raw::Rule::new()?;
    filter.set_str(a(sys::NFTNL_RULE_TABLE), table)?;
    filter.set_str(a(sys::NFTNL_RULE_CHAIN), chain)?;
    filter.set_u32(a(sys::NFTNL_RULE_FAMILY), u32::from(fam));
    let mut n = 0usize;
    let result = sock.query(msg::GETRULE, fam, NLM_F_DUMP, Body::Rule(&filter), |msg| {
        // Filtered again here in case the kernel ignores the filter.
        if let Some(r) = msg.rule()
            && r.get_str(a(sys::NFTNL_RULE_TABLE)).as_deref() == Some(table)
            && r.get_str(a(sys::NFTNL_RULE_CHAIN)).as_deref() == Some(chain)
        {
            n += 1;
        }
        Ok(())
    });
    // The chain (or its table) went away since it was listed: no rules.
    absent_is_empty(result).map(|()| n)
}

/// One rule of a foreign table: where it is, its handle, and the chains it jumps or goes to
/// (what deleting a chain it targets needs removed first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RuleInfo {
    pub chain: String,
    pub handle: u64,
    /// Targets of its `jump` and `goto` verdicts.
    pub targets: Vec<String>,
}

/// The rules of one table, in chain order (a dump of the table's rules).
pub(super) fn list_rules(sock: &mut Socket, family: TableFamily, table: &str) -> Result<Vec<RuleInfo>, NetlinkError> {
    let fam = u16::try_from(family.nfproto()).unwrap_or(NFPROTO_UNSPEC);
    let mut filter = raw::Rule::new()?;
    filter.set_str(a(sys::NFTNL_RULE_TABLE), table)?;
    filter.set_u32(a(sys::NFTNL_RULE_FAMILY), family.nfproto());
    let mut out = Vec::new();
    let result = sock.query(msg::GETRULE, fam, NLM_F_DUMP, Body::Rule(&filter), |msg| {
        let Some(r) = msg.rule() else { return Ok(()) };
        if r.get_str(a(sys::NFTNL_RULE_TABLE)).as_deref() != Some(table) {
            return Ok(());
        }
        let (Some(chain), Some(handle)) = (r.get_str(a(sys::NFTNL_RULE_CHAIN)), r.get_u64(a(sys::NFTNL_RULE_HANDLE)))
        else {
            return Ok(());
        };
        let mut targets = Vec::new();
        r.for_each_expr(|e| {
            if e.name() == "immediate"
                && let Some(target) = e.str(a(sys::NFTNL_EXPR_IMM_CHAIN))
            {
                targets.push(target);
            }
        });
        out.push(RuleInfo { chain, handle, targets });
        Ok(())
    });
    // The table went away since it was listed: no rules (the kernel refuses such a dump before
    // sending any).
    absent_is_empty(result).map(|()| out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_round_trip_their_nfproto_numbers() {
        for f in TableFamily::ALL {
            assert_eq!(TableFamily::from_nfproto(f.nfproto()), Some(f));
        }
        assert_eq!(TableFamily::from_nfproto(0), None);
    }

    #[test]
    fn hook_names_depend_on_the_family() {
        assert_eq!(TableFamily::Ip.hook_name(2), Some("forward"));
        assert_eq!(TableFamily::Inet.hook_name(5), Some("ingress"));
        assert_eq!(TableFamily::Ip.hook_name(5), None);
        assert_eq!(TableFamily::Arp.hook_name(1), Some("output"));
        assert_eq!(TableFamily::Netdev.hook_name(0), Some("ingress"));
    }
}
