//! Reading nftproxy's tables back from the kernel into [`WireTable`]s.
//!
//! Values are normalized the way [`crate::nft::lower`] writes them, so an unchanged table
//! compares equal: NAT flags and max registers the kernel derives from the min registers are
//! dropped, absent optional attributes read as their defaults.

use std::sync::Arc;

use indexmap::IndexMap;
use nftnl_sys as sys;

use super::elements::{DumpedElement, each_dumped_element};
use super::error::NetlinkError;
use super::socket::{NLM_F_ACK, NLM_F_DUMP, Socket};
use super::sys::{self as raw, Body, ExprRef, msg};
use crate::net::IpFamily;
use crate::nft::ast::Owner;
use crate::nft::lower::nfproto;
use crate::nft::wire::consts::*;
use crate::nft::wire::*;

pub(super) fn a(attr: u32) -> u16 {
    u16::try_from(attr).unwrap_or(u16::MAX)
}

/// Reads table `name` of `family`, or `None` if it does not exist. A table another live process
/// owns is an error ([`NetlinkError::OwnedElsewhere`]): every change to it would be refused.
pub(super) fn read_table(sock: &mut Socket, family: IpFamily, name: &str) -> Result<Option<WireTable>, NetlinkError> {
    read(sock, family, name, Reading::Claiming)
}

/// Reads all of table `name` of `family` whoever owns it, only to look at it (`nftproxy
/// explain` evaluating what a running `nftproxy run` programmed).
pub(super) fn inspect_table(
    sock: &mut Socket,
    family: IpFamily,
    name: &str,
) -> Result<Option<WireTable>, NetlinkError> {
    read(sock, family, name, Reading::Looking)
}

/// Reads the sets and maps of table `name` of `family` (no chains or rules) whoever owns it,
/// only to look at them (`nftproxy trace` naming what a running `nftproxy run` programmed).
pub(super) fn inspect_sets(sock: &mut Socket, family: IpFamily, name: &str) -> Result<Option<WireTable>, NetlinkError> {
    read(sock, family, name, Reading::SetsOnly)
}

/// What a read is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// The caller will change the table (so another owner is an error): everything.
    Claiming,
    /// Only looking, whoever owns it: everything.
    Looking,
    /// Only looking, whoever owns it: the sets and maps.
    SetsOnly,
}

/// Reads a table as `reading` asks.
fn read(sock: &mut Socket, family: IpFamily, name: &str, reading: Reading) -> Result<Option<WireTable>, NetlinkError> {
    let fam = u16::try_from(nfproto(family)).unwrap_or(2);

    // The table itself (a plain GET; ENOENT means absent).
    let mut t = raw::Table::new()?;
    t.set_str(a(sys::NFTNL_TABLE_NAME), name)?;
    t.set_u32(a(sys::NFTNL_TABLE_FAMILY), u32::from(fam));
    let mut table: Option<(u32, Option<Vec<u8>>, Option<u32>)> = None;
    let answered = sock.query(msg::GETTABLE, fam, NLM_F_ACK, Body::Table(&t), |msg| {
        if let Some(got) = msg.table()
            && got.get_str(a(sys::NFTNL_TABLE_NAME)).as_deref() == Some(name)
        {
            table = Some((
                got.get_u32(a(sys::NFTNL_TABLE_FLAGS)).unwrap_or(0),
                got.get_data(a(sys::NFTNL_TABLE_USERDATA)),
                got.get_u32(a(sys::NFTNL_TABLE_OWNER)),
            ));
        }
        Ok(())
    });
    absent_is_empty(answered)?;
    let Some((flags, userdata, owner)) = table else { return Ok(None) };
    // Another live process owns the table: every change would be refused (EPERM), so say who
    // instead of planning against it. (The kernel drops the owner flag when its owner exits.)
    if reading == Reading::Claiming
        && flags & TABLE_F_OWNER != 0
        && let Some(port) = owner
        && port != sock.port_id()
    {
        let table = format!("{} {name}", crate::nft::render::family_keyword(family));
        return Err(NetlinkError::OwnedElsewhere { table, port });
    }

    let mut wire =
        WireTable { family, name: name.to_string(), flags, userdata, sets: IndexMap::new(), chains: IndexMap::new() };
    if reading != Reading::SetsOnly {
        read_chains(sock, fam, &mut wire)?;
        read_rules(sock, fam, &mut wire)?;
    }
    read_sets(sock, fam, &mut wire)?;
    Ok(Some(wire))
}

fn read_chains(sock: &mut Socket, fam: u16, wire: &mut WireTable) -> Result<(), NetlinkError> {
    let mut filter = raw::Chain::new()?;
    filter.set_str(a(sys::NFTNL_CHAIN_TABLE), &wire.name)?;
    filter.set_u32(a(sys::NFTNL_CHAIN_FAMILY), u32::from(fam));
    let table = wire.name.clone();
    sock.query(msg::GETCHAIN, fam, NLM_F_DUMP, Body::Chain(&filter), |msg| {
        let Some(c) = msg.chain() else { return Ok(()) };
        if c.get_str(a(sys::NFTNL_CHAIN_TABLE)).as_deref() != Some(&table) {
            return Ok(());
        }
        let Some(name) = c.get_str(a(sys::NFTNL_CHAIN_NAME)) else { return Ok(()) };
        let hook = c.get_u32(a(sys::NFTNL_CHAIN_HOOKNUM)).map(|hooknum| WireHook {
            hooknum,
            priority: c.get_s32(a(sys::NFTNL_CHAIN_PRIO)).unwrap_or(0),
            chain_type: c.get_str(a(sys::NFTNL_CHAIN_TYPE)).unwrap_or_default(),
            policy: c.get_u32(a(sys::NFTNL_CHAIN_POLICY)).unwrap_or(POLICY_ACCEPT),
        });
        wire.chains.insert(
            name.clone(),
            WireChain {
                name,
                hook,
                userdata: c.get_data(a(sys::NFTNL_CHAIN_USERDATA)),
                rules: Vec::new(),
                owner: Owner::infrastructure(),
            },
        );
        Ok(())
    })
}

fn read_rules(sock: &mut Socket, fam: u16, wire: &mut WireTable) -> Result<(), NetlinkError> {
    let mut filter = raw::Rule::new()?;
    filter.set_str(a(sys::NFTNL_RULE_TABLE), &wire.name)?;
    filter.set_u32(a(sys::NFTNL_RULE_FAMILY), u32::from(fam));
    let table = wire.name.clone();
    sock.query(msg::GETRULE, fam, NLM_F_DUMP, Body::Rule(&filter), |msg| {
        let Some(r) = msg.rule() else { return Ok(()) };
        if r.get_str(a(sys::NFTNL_RULE_TABLE)).as_deref() != Some(&table) {
            return Ok(());
        }
        let Some(chain) = r.get_str(a(sys::NFTNL_RULE_CHAIN)) else { return Ok(()) };
        let rule = decode_rule(&r);
        if let Some(c) = wire.chains.get_mut(&chain) {
            c.rules.push(rule);
        }
        Ok(())
    })
}

/// A rule read from the kernel, in the form [`crate::nft::lower`] writes.
pub(super) fn decode_rule(r: &raw::Rule) -> WireRule {
    let mut exprs = Vec::new();
    r.for_each_expr(|e| exprs.push(decode_expr(e)));
    exprs.shrink_to_fit();
    WireRule { exprs, userdata: r.get_data(a(sys::NFTNL_RULE_USERDATA)) }
}

fn read_sets(sock: &mut Socket, fam: u16, wire: &mut WireTable) -> Result<(), NetlinkError> {
    let mut filter = raw::Set::new()?;
    filter.set_str(a(sys::NFTNL_SET_TABLE), &wire.name)?;
    filter.set_u32(a(sys::NFTNL_SET_FAMILY), u32::from(fam));
    let table = wire.name.clone();
    let mut sets = Vec::new();
    sock.query(msg::GETSET, fam, NLM_F_DUMP, Body::Set(&filter), |msg| {
        let Some(s) = msg.set() else { return Ok(()) };
        if s.get_str(a(sys::NFTNL_SET_TABLE)).as_deref() != Some(&table) {
            return Ok(());
        }
        let Some(name) = s.get_str(a(sys::NFTNL_SET_NAME)) else { return Ok(()) };
        let flags = s.get_u32(a(sys::NFTNL_SET_FLAGS)).unwrap_or(0);
        let is_map = flags & SET_MAP != 0;
        let data_type = if is_map { s.get_u32(a(sys::NFTNL_SET_DATA_TYPE)) } else { None };
        // The kernel reports verdict data as 16 bytes whatever length was sent (it ignores it).
        let data_len = match data_type {
            Some(DATA_VERDICT) | None => 0,
            Some(_) => s.get_u32(a(sys::NFTNL_SET_DATA_LEN)).unwrap_or(0),
        };
        let spec = WireSetSpec {
            flags,
            key_type: s.get_u32(a(sys::NFTNL_SET_KEY_TYPE)).unwrap_or(0),
            key_len: s.get_u32(a(sys::NFTNL_SET_KEY_LEN)).unwrap_or(0),
            data_type,
            data_len,
            timeout_ms: s.get_u64(a(sys::NFTNL_SET_TIMEOUT)).filter(|t| *t != 0),
            userdata: s.get_data(a(sys::NFTNL_SET_USERDATA)),
            counter: s.expr_names().iter().any(|n| n == "counter"),
            // Raised after creation and never compared (see `WireSetSpec::size`).
            size: None,
        };
        // Anonymous sets belong to the rules that bind them; nftproxy never makes any.
        if name.starts_with("__") {
            return Ok(());
        }
        let dynamic = flags & SET_EVAL != 0;
        sets.push(WireSet { name, spec, elements: SetElements::new(), dynamic, owner: Owner::infrastructure() });
        Ok(())
    })?;
    for mut set in sets {
        if !set.dynamic {
            read_elements(sock, fam, &wire.name, &mut set)?;
        }
        wire.sets.insert(set.name.clone(), set);
    }
    Ok(())
}

/// Dumps the elements of one set (`fam` as the netlink header carries it), calling `each` on
/// every one, read straight from the messages.
fn dump_dumped_elements(
    sock: &mut Socket,
    fam: u16,
    table: &str,
    set: &str,
    mut each: impl FnMut(DumpedElement<'_>),
) -> Result<(), NetlinkError> {
    let mut filter = raw::Set::new()?;
    filter.set_str(a(sys::NFTNL_SET_TABLE), table)?;
    filter.set_str(a(sys::NFTNL_SET_NAME), set)?;
    filter.set_u32(a(sys::NFTNL_SET_FAMILY), u32::from(fam));
    sock.query(msg::GETSETELEM, fam, NLM_F_DUMP, Body::SetElements(&filter), |msg| {
        each_dumped_element(msg.bytes(), &mut each);
        Ok(())
    })
}

/// Dumps the elements of one set (`fam` as the netlink header carries it), calling `each` on
/// every one as libnftnl parses it (with its expressions: the counters).
pub(super) fn dump_elements(
    sock: &mut Socket,
    fam: u16,
    table: &str,
    set: &str,
    mut each: impl FnMut(&raw::SetElemRef<'_>),
) -> Result<(), NetlinkError> {
    let mut filter = raw::Set::new()?;
    filter.set_str(a(sys::NFTNL_SET_TABLE), table)?;
    filter.set_str(a(sys::NFTNL_SET_NAME), set)?;
    filter.set_u32(a(sys::NFTNL_SET_FAMILY), u32::from(fam));
    sock.query(msg::GETSETELEM, fam, NLM_F_DUMP, Body::SetElements(&filter), |msg| {
        if let Some(s) = msg.set_elements() {
            s.for_each_elem(&mut each);
        }
        Ok(())
    })
}

/// The keys of one set's elements; none when the set does not exist.
pub(super) fn read_keys(
    sock: &mut Socket,
    family: IpFamily,
    table: &str,
    set: &str,
) -> Result<Vec<WireKey>, NetlinkError> {
    let fam = u16::try_from(nfproto(family)).unwrap_or(2);
    let mut out = Vec::new();
    let dumped = dump_dumped_elements(sock, fam, table, set, |e| out.push(WireKey::new(e.key)));
    absent_is_empty(dumped)?;
    Ok(out)
}

/// A dump of something that does not exist (`ENOENT`: a set, a chain, a table) is an empty one.
pub(super) fn absent_is_empty(dumped: Result<(), NetlinkError>) -> Result<(), NetlinkError> {
    match dumped {
        Err(NetlinkError::Dump(e)) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

fn read_elements(sock: &mut Socket, fam: u16, table: &str, set: &mut WireSet) -> Result<(), NetlinkError> {
    let mut comments: foldhash::HashMap<Vec<u8>, (Arc<[u8]>, Owner)> = foldhash::HashMap::default();
    // The comment of the element before: a service port's elements are mostly adjacent.
    let mut last: Option<(Arc<[u8]>, Owner)> = None;
    // Collected in the kernel's dump order, then sorted in place: the vector is the set's
    // elements (no second copy, which at a cluster's hundreds of thousands of elements is tens
    // of MB).
    let mut elements: Vec<(WireKey, WireElement)> = Vec::new();
    dump_dumped_elements(sock, fam, table, &set.name, |e| {
        let interval_end = e.flags & ELEM_INTERVAL_END != 0;
        let data = match (e.verdict, e.data) {
            (Some((code, chain)), _) => WireData::Verdict { code, chain: chain.map(str::to_string) },
            (None, Some(d)) => WireData::Bytes(d.into()),
            (None, None) => WireData::None,
        };
        // Our element comments name the service port that owns the element; elements of
        // one service port share one copy of both.
        let (userdata, owner) = match e.userdata {
            Some(u) => {
                let known = last.as_ref().filter(|(blob, _)| **blob == *u).or_else(|| comments.get(u)).cloned();
                let (blob, owner) = known.unwrap_or_else(|| {
                    let owner = udata::find_comment(u, udata::COMMENT)
                        .map_or_else(Owner::infrastructure, |c| Owner::from_comment(&c));
                    let found = (Arc::<[u8]>::from(u), owner);
                    comments.insert(u.to_vec(), found.clone());
                    found
                });
                last = Some((blob.clone(), owner.clone()));
                (Some(blob), owner)
            }
            None => (None, Owner::infrastructure()),
        };
        let key = WireKey { bytes: e.key.into(), interval_end };
        elements.push((key, WireElement { data, userdata, owner }));
    })?;
    set.elements = SetElements::from_vec(elements);
    Ok(())
}

fn decode_payload_base(b: u32) -> PayloadBase {
    match b {
        0 => PayloadBase::Link,
        1 => PayloadBase::Network,
        _ => PayloadBase::Transport,
    }
}

/// One kernel expression back into the form [`crate::nft::lower`] writes.
fn decode_expr(e: &ExprRef<'_>) -> LowExpr {
    let u = |attr: u32| e.u32(a(attr)).unwrap_or(0);
    let name = e.name();
    match name.as_str() {
        "payload" if !e.is_set(a(sys::NFTNL_EXPR_PAYLOAD_SREG)) => LowExpr::Payload {
            base: decode_payload_base(u(sys::NFTNL_EXPR_PAYLOAD_BASE)),
            offset: u(sys::NFTNL_EXPR_PAYLOAD_OFFSET),
            len: u(sys::NFTNL_EXPR_PAYLOAD_LEN),
            dreg: u(sys::NFTNL_EXPR_PAYLOAD_DREG),
        },
        "meta" => match e.u32(a(sys::NFTNL_EXPR_META_SREG)) {
            Some(sreg) => LowExpr::MetaSet { key: u(sys::NFTNL_EXPR_META_KEY), sreg },
            None => LowExpr::Meta { key: u(sys::NFTNL_EXPR_META_KEY), dreg: u(sys::NFTNL_EXPR_META_DREG) },
        },
        "cmp" => LowExpr::Cmp {
            sreg: u(sys::NFTNL_EXPR_CMP_SREG),
            op: u(sys::NFTNL_EXPR_CMP_OP),
            data: e.data(a(sys::NFTNL_EXPR_CMP_DATA)).unwrap_or_default(),
        },
        // Only the boolean form (op 0) is ours.
        "bitwise" if e.u32(a(sys::NFTNL_EXPR_BITWISE_OP)).unwrap_or(0) == 0 => LowExpr::Bitwise {
            sreg: u(sys::NFTNL_EXPR_BITWISE_SREG),
            dreg: u(sys::NFTNL_EXPR_BITWISE_DREG),
            len: u(sys::NFTNL_EXPR_BITWISE_LEN),
            mask: e.data(a(sys::NFTNL_EXPR_BITWISE_MASK)).unwrap_or_default(),
            xor: e.data(a(sys::NFTNL_EXPR_BITWISE_XOR)).unwrap_or_default(),
        },
        "lookup" => LowExpr::Lookup {
            sreg: u(sys::NFTNL_EXPR_LOOKUP_SREG),
            dreg: e.u32(a(sys::NFTNL_EXPR_LOOKUP_DREG)),
            set: e.str(a(sys::NFTNL_EXPR_LOOKUP_SET)).unwrap_or_default(),
            flags: u(sys::NFTNL_EXPR_LOOKUP_FLAGS),
        },
        "immediate" => {
            let dreg = u(sys::NFTNL_EXPR_IMM_DREG);
            if dreg == REG_VERDICT {
                LowExpr::Verdict {
                    code: u(sys::NFTNL_EXPR_IMM_VERDICT) as i32,
                    chain: e.str(a(sys::NFTNL_EXPR_IMM_CHAIN)),
                }
            } else {
                LowExpr::Immediate { dreg, data: e.data(a(sys::NFTNL_EXPR_IMM_DATA)).unwrap_or_default() }
            }
        }
        "numgen" => LowExpr::Numgen {
            dreg: u(sys::NFTNL_EXPR_NG_DREG),
            modulus: u(sys::NFTNL_EXPR_NG_MODULUS),
            kind: u(sys::NFTNL_EXPR_NG_TYPE),
            offset: u(sys::NFTNL_EXPR_NG_OFFSET),
        },
        // Only jhash (type 0) is ours.
        "hash" if e.u32(a(sys::NFTNL_EXPR_HASH_TYPE)).unwrap_or(0) == HASH_JENKINS => LowExpr::Hash {
            sreg: u(sys::NFTNL_EXPR_HASH_SREG),
            dreg: u(sys::NFTNL_EXPR_HASH_DREG),
            len: u(sys::NFTNL_EXPR_HASH_LEN),
            modulus: u(sys::NFTNL_EXPR_HASH_MODULUS),
            seed: u(sys::NFTNL_EXPR_HASH_SEED),
            offset: u(sys::NFTNL_EXPR_HASH_OFFSET),
        },
        "byteorder" => LowExpr::Byteorder {
            sreg: u(sys::NFTNL_EXPR_BYTEORDER_SREG),
            dreg: u(sys::NFTNL_EXPR_BYTEORDER_DREG),
            op: u(sys::NFTNL_EXPR_BYTEORDER_OP),
            len: u(sys::NFTNL_EXPR_BYTEORDER_LEN),
            size: u(sys::NFTNL_EXPR_BYTEORDER_SIZE),
        },
        "fib" => LowExpr::Fib {
            dreg: u(sys::NFTNL_EXPR_FIB_DREG),
            result: u(sys::NFTNL_EXPR_FIB_RESULT),
            flags: u(sys::NFTNL_EXPR_FIB_FLAGS),
        },
        "ct" if !e.is_set(a(sys::NFTNL_EXPR_CT_SREG)) && !e.is_set(a(sys::NFTNL_EXPR_CT_DIR)) => {
            LowExpr::Ct { key: u(sys::NFTNL_EXPR_CT_KEY), dreg: u(sys::NFTNL_EXPR_CT_DREG) }
        }
        "dynset" => LowExpr::Dynset {
            op: u(sys::NFTNL_EXPR_DYNSET_OP),
            sreg_key: u(sys::NFTNL_EXPR_DYNSET_SREG_KEY),
            set: e.str(a(sys::NFTNL_EXPR_DYNSET_SET_NAME)).unwrap_or_default(),
            timeout_ms: e.u64(a(sys::NFTNL_EXPR_DYNSET_TIMEOUT)).filter(|t| *t != 0),
        },
        "nat" => {
            let reg_addr = e.u32(a(sys::NFTNL_EXPR_NAT_REG_ADDR_MIN));
            let reg_proto = e.u32(a(sys::NFTNL_EXPR_NAT_REG_PROTO_MIN));
            let mut flags = u(sys::NFTNL_EXPR_NAT_FLAGS);
            if reg_addr.is_some() {
                flags &= !NAT_RANGE_MAP_IPS;
            }
            if reg_proto.is_some() {
                flags &= !NAT_RANGE_PROTO_SPECIFIED;
            }
            LowExpr::Nat {
                kind: u(sys::NFTNL_EXPR_NAT_TYPE),
                family: u(sys::NFTNL_EXPR_NAT_FAMILY),
                reg_addr,
                reg_proto,
                flags,
            }
        }
        "masq" => LowExpr::Masq { flags: u(sys::NFTNL_EXPR_MASQ_FLAGS) },
        "reject" => LowExpr::Reject {
            kind: u(sys::NFTNL_EXPR_REJECT_TYPE),
            code: e.u8(a(sys::NFTNL_EXPR_REJECT_CODE)).unwrap_or(0),
        },
        _ => LowExpr::Foreign(name),
    }
}
