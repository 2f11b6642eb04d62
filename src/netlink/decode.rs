//! Reading nftproxy's tables back from the kernel into [`WireTable`]s.
//!
//! Values are normalized the way [`crate::nft::lower`] writes them, so an unchanged table
//! compares equal: NAT flags and max registers the kernel derives from the min registers are
//! dropped, absent optional attributes read as their defaults.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use indexmap::IndexMap;
use nftnl_sys as sys;

use super::NetlinkError;
use super::socket::Socket;
use super::sys::{self as raw, ExprRef, msg};
use crate::net::IpFamily;
use crate::nft::ast::Owner;
use crate::nft::lower::nfproto;
use crate::nft::wire::consts::*;
use crate::nft::wire::*;

pub(super) const NLM_F_DUMP: u16 = 0x300;
const NLM_F_ACK: u16 = 0x4;

pub(super) fn a(attr: u32) -> u16 {
    u16::try_from(attr).unwrap_or(u16::MAX)
}

/// Builds a request message (GET…) for `obj` in an aligned buffer.
pub(super) fn request(
    kind: u16,
    family: u16,
    flags: u16,
    seq: u32,
    write: impl FnOnce(*mut libc::nlmsghdr),
) -> Vec<u8> {
    let mut buf = vec![0u32; 2048];
    #[allow(unsafe_code)]
    // SAFETY: 8 KiB is more than any GET request with a table and object name needs.
    let len = unsafe {
        let nlh = raw::build_header(buf.as_mut_ptr().cast(), kind, family, flags, seq);
        write(nlh);
        (*nlh).nlmsg_len as usize
    };
    let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
    bytes[..len].to_vec()
}

/// Reads table `name` of `family`, or `None` if it does not exist.
pub fn read_table(sock: &mut Socket, family: IpFamily, name: &str) -> Result<Option<WireTable>, NetlinkError> {
    let fam = u16::try_from(nfproto(family)).unwrap_or(2);

    // The table itself (a plain GET; ENOENT means absent).
    let mut t = raw::Table::new()?;
    t.set_str(a(sys::NFTNL_TABLE_NAME), name)?;
    t.set_u32(a(sys::NFTNL_TABLE_FAMILY), u32::from(fam));
    let seq = sock.next_seq();
    #[allow(unsafe_code)]
    // SAFETY: the header was just built in a buffer large enough for the payload.
    let req = request(msg::GETTABLE, fam, NLM_F_ACK, seq, |nlh| unsafe { raw::table_payload(nlh, &t) });
    let mut table: Option<(u32, Option<Vec<u8>>, Option<u32>)> = None;
    match sock.dump(&req, seq, |msg| {
        let nlh: *const libc::nlmsghdr = msg.as_ptr().cast();
        let mut got = raw::Table::new()?;
        if raw::parse_table(nlh, &mut got) && got.get_str(a(sys::NFTNL_TABLE_NAME)).as_deref() == Some(name) {
            table = Some((
                got.get_u32(a(sys::NFTNL_TABLE_FLAGS)).unwrap_or(0),
                got.get_data(a(sys::NFTNL_TABLE_USERDATA)),
                got.get_u32(a(sys::NFTNL_TABLE_OWNER)),
            ));
        }
        Ok(())
    }) {
        Ok(()) => {}
        Err(NetlinkError::Dump(e)) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
        Err(e) => return Err(e),
    }
    let Some((flags, userdata, owner)) = table else { return Ok(None) };
    // Another live process owns the table: every change would be refused (EPERM), so say who
    // instead of planning against it. (The kernel drops the owner flag when its owner exits.)
    if flags & TABLE_F_OWNER != 0
        && let Some(port) = owner
        && port != sock.port_id()
    {
        let table = format!("{} {name}", crate::nft::render::family_keyword(family));
        return Err(NetlinkError::OwnedElsewhere { table, port });
    }

    let mut wire =
        WireTable { family, name: name.to_string(), flags, userdata, sets: IndexMap::new(), chains: IndexMap::new() };
    read_chains(sock, fam, &mut wire)?;
    read_rules(sock, fam, &mut wire)?;
    read_sets(sock, fam, &mut wire)?;
    Ok(Some(wire))
}

fn read_chains(sock: &mut Socket, fam: u16, wire: &mut WireTable) -> Result<(), NetlinkError> {
    let mut filter = raw::Chain::new()?;
    filter.set_str(a(sys::NFTNL_CHAIN_TABLE), &wire.name)?;
    filter.set_u32(a(sys::NFTNL_CHAIN_FAMILY), u32::from(fam));
    let seq = sock.next_seq();
    #[allow(unsafe_code)]
    // SAFETY: the header was just built in a buffer large enough for the payload.
    let req = request(msg::GETCHAIN, fam, NLM_F_DUMP, seq, |nlh| unsafe { raw::chain_payload(nlh, &filter) });
    let table = wire.name.clone();
    sock.dump(&req, seq, |msg| {
        let nlh: *const libc::nlmsghdr = msg.as_ptr().cast();
        let mut c = raw::Chain::new()?;
        if !raw::parse_chain(nlh, &mut c) || c.get_str(a(sys::NFTNL_CHAIN_TABLE)).as_deref() != Some(&table) {
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
    let seq = sock.next_seq();
    #[allow(unsafe_code)]
    // SAFETY: the header was just built in a buffer large enough for the payload.
    let req = request(msg::GETRULE, fam, NLM_F_DUMP, seq, |nlh| unsafe { raw::rule_payload(nlh, &filter) });
    let table = wire.name.clone();
    sock.dump(&req, seq, |msg| {
        let nlh: *const libc::nlmsghdr = msg.as_ptr().cast();
        let mut r = raw::Rule::new()?;
        if !raw::parse_rule(nlh, &mut r) || r.get_str(a(sys::NFTNL_RULE_TABLE)).as_deref() != Some(&table) {
            return Ok(());
        }
        let Some(chain) = r.get_str(a(sys::NFTNL_RULE_CHAIN)) else { return Ok(()) };
        let mut exprs = Vec::new();
        r.for_each_expr(|e| exprs.push(decode_expr(e)));
        exprs.shrink_to_fit();
        let rule = WireRule { exprs, userdata: r.get_data(a(sys::NFTNL_RULE_USERDATA)) };
        if let Some(c) = wire.chains.get_mut(&chain) {
            c.rules.push(rule);
        }
        Ok(())
    })
}

fn read_sets(sock: &mut Socket, fam: u16, wire: &mut WireTable) -> Result<(), NetlinkError> {
    let mut filter = raw::Set::new()?;
    filter.set_str(a(sys::NFTNL_SET_TABLE), &wire.name)?;
    filter.set_u32(a(sys::NFTNL_SET_FAMILY), u32::from(fam));
    let seq = sock.next_seq();
    #[allow(unsafe_code)]
    // SAFETY: the header was just built in a buffer large enough for the payload.
    let req = request(msg::GETSET, fam, NLM_F_DUMP, seq, |nlh| unsafe { raw::set_payload(nlh, &filter) });
    let table = wire.name.clone();
    let mut sets = Vec::new();
    sock.dump(&req, seq, |msg| {
        let nlh: *const libc::nlmsghdr = msg.as_ptr().cast();
        let mut s = raw::Set::new()?;
        if !raw::parse_set(nlh, &mut s) || s.get_str(a(sys::NFTNL_SET_TABLE)).as_deref() != Some(&table) {
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
        };
        // Anonymous sets belong to the rules that bind them; nftproxy never makes any.
        if name.starts_with("__") {
            return Ok(());
        }
        let dynamic = flags & SET_EVAL != 0;
        sets.push(WireSet { name, spec, elements: BTreeMap::new(), dynamic, owner: Owner::infrastructure() });
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

fn read_elements(sock: &mut Socket, fam: u16, table: &str, set: &mut WireSet) -> Result<(), NetlinkError> {
    let mut filter = raw::Set::new()?;
    filter.set_str(a(sys::NFTNL_SET_TABLE), table)?;
    filter.set_str(a(sys::NFTNL_SET_NAME), &set.name)?;
    filter.set_u32(a(sys::NFTNL_SET_FAMILY), u32::from(fam));
    let seq = sock.next_seq();
    #[allow(unsafe_code)]
    // SAFETY: the header was just built in a buffer large enough for the payload.
    let req = request(msg::GETSETELEM, fam, NLM_F_DUMP, seq, |nlh| unsafe { raw::set_elems_payload(nlh, &filter) });
    let mut comments: HashMap<Vec<u8>, (Arc<[u8]>, Owner)> = HashMap::new();
    // Collected first and built into the map at once: a map built from sorted elements has
    // full nodes, one filled element by element (the kernel's dump order) about half-full
    // ones, which at a cluster's hundreds of thousands of elements is tens of MB.
    let mut elements: Vec<(WireKey, WireElement)> = Vec::new();
    sock.dump(&req, seq, |msg| {
        let nlh: *const libc::nlmsghdr = msg.as_ptr().cast();
        let mut s = raw::Set::new()?;
        if !raw::parse_set_elems(nlh, &mut s) {
            return Ok(());
        }
        s.for_each_elem(|e| {
            let Some(key) = e.data(a(sys::NFTNL_SET_ELEM_KEY)) else { return };
            let interval_end = e.u32(a(sys::NFTNL_SET_ELEM_FLAGS)).unwrap_or(0) & ELEM_INTERVAL_END != 0;
            let data = if let Some(code) = e.u32(a(sys::NFTNL_SET_ELEM_VERDICT)) {
                WireData::Verdict { code: code as i32, chain: e.str(a(sys::NFTNL_SET_ELEM_CHAIN)) }
            } else if let Some(d) = e.data(a(sys::NFTNL_SET_ELEM_DATA)) {
                WireData::Bytes(d.into())
            } else {
                WireData::None
            };
            // Our element comments name the service port that owns the element; elements of
            // one service port share one copy of both.
            let (userdata, owner) = match e.data(a(sys::NFTNL_SET_ELEM_USERDATA)) {
                Some(u) => {
                    let (blob, owner) = comments
                        .entry(u)
                        .or_insert_with_key(|u| {
                            let owner =
                                udata::find_comment(u, udata::COMMENT).map_or_else(Owner::infrastructure, Owner::new);
                            (Arc::from(u.as_slice()), owner)
                        })
                        .clone();
                    (Some(blob), owner)
                }
                None => (None, Owner::infrastructure()),
            };
            let key = WireKey { bytes: key.into(), interval_end };
            elements.push((key, WireElement { data, userdata, owner }));
        });
        Ok(())
    })?;
    set.elements = elements.into_iter().collect();
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
