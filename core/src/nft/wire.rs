//! nftables objects as the kernel holds them: expressions with registers, keys as bytes,
//! userdata as TLVs.
//!
//! Both sides of every comparison live here: [`super::lower`] turns the desired ruleset into
//! these values, and the netlink read-back decodes the kernel's tables into them, so a full
//! sync can diff what the kernel has against what nftproxy wants, byte for byte.

use std::net::IpAddr;

use indexmap::IndexMap;

use super::ast::Owner;
pub use super::elements::{Bytes, SetElements, WireData, WireElement, WireKey};
use crate::net::IpFamily;

/// An address as nftables data holds it: 4 or 16 bytes, network order.
pub fn address_bytes(address: &IpAddr) -> Vec<u8> {
    match address {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The address 4 or 16 bytes of nftables data hold.
pub fn address_from_bytes(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => <[u8; 4]>::try_from(bytes).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(bytes).ok().map(IpAddr::from),
        _ => None,
    }
}

/// Kernel constants used by the expressions nftproxy emits (`linux/netfilter/nf_tables.h`).
pub mod consts {
    /// `NFT_REG_VERDICT`
    pub const REG_VERDICT: u32 = 0;
    /// `NFT_REG_1` (aliases `NFT_REG32_00`)
    pub const REG_1: u32 = 1;
    /// `NFT_REG32_00`
    pub const REG32_00: u32 = 8;

    /// `NFT_PAYLOAD_NETWORK_HEADER`
    pub const PAYLOAD_NETWORK: u32 = 1;
    /// `NFT_PAYLOAD_TRANSPORT_HEADER`
    pub const PAYLOAD_TRANSPORT: u32 = 2;

    /// `NFT_META_MARK`
    pub const META_MARK: u32 = 3;
    /// `NFT_META_IIFNAME`
    pub const META_IIFNAME: u32 = 6;
    /// `NFT_META_L4PROTO`
    pub const META_L4PROTO: u32 = 16;

    /// `NFT_CMP_EQ`
    pub const CMP_EQ: u32 = 0;
    /// `NFT_CMP_NEQ`
    pub const CMP_NEQ: u32 = 1;

    /// `NFT_CT_STATE`
    pub const CT_STATE: u32 = 0;
    /// `NFT_CT_STATUS`
    pub const CT_STATUS: u32 = 2;
    /// `NF_CT_STATE_BIT(IP_CT_NEW)`
    pub const CT_STATE_NEW: u32 = 1 << 3;
    /// `IPS_DST_NAT`
    pub const CT_STATUS_DNAT: u32 = 1 << 5;

    /// `NFT_NG_INCREMENTAL`
    pub const NG_INCREMENTAL: u32 = 0;
    /// `NFT_NG_RANDOM`
    pub const NG_RANDOM: u32 = 1;
    /// `NFT_HASH_JENKINS`
    pub const HASH_JENKINS: u32 = 0;
    /// `NFT_BYTEORDER_HTON`
    pub const BYTEORDER_HTON: u32 = 1;
    /// `NFT_FIB_RESULT_ADDRTYPE`
    pub const FIB_RESULT_ADDRTYPE: u32 = 3;
    /// `NFTA_FIB_F_SADDR`
    pub const FIB_F_SADDR: u32 = 1;
    /// `NFTA_FIB_F_DADDR`
    pub const FIB_F_DADDR: u32 = 2;
    /// `RTN_LOCAL`
    pub const RTN_LOCAL: u32 = 2;

    /// `NFT_DYNSET_OP_UPDATE`
    pub const DYNSET_OP_UPDATE: u32 = 1;
    /// `NFT_LOOKUP_F_INV`
    pub const LOOKUP_F_INV: u32 = 1;

    /// `NFT_NAT_DNAT`
    pub const NAT_DNAT: u32 = 1;
    /// `NF_NAT_RANGE_MAP_IPS`
    pub const NAT_RANGE_MAP_IPS: u32 = 1;
    /// `NF_NAT_RANGE_PROTO_SPECIFIED`
    pub const NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
    /// `NF_NAT_RANGE_PROTO_RANDOM_FULLY`
    pub const NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;

    /// `NFT_REJECT_ICMP_UNREACH`
    pub const REJECT_ICMP_UNREACH: u32 = 0;
    /// ICMP port unreachable
    pub const ICMP_PORT_UNREACH: u8 = 3;
    /// ICMPv6 port unreachable
    pub const ICMPV6_PORT_UNREACH: u8 = 4;

    /// `NF_DROP`
    pub const VERDICT_DROP: i32 = 0;
    /// `NF_ACCEPT`
    pub const VERDICT_ACCEPT: i32 = 1;
    /// `NFT_JUMP`
    pub const VERDICT_JUMP: i32 = -3;
    /// `NFT_GOTO`
    pub const VERDICT_GOTO: i32 = -4;
    /// `NFT_RETURN`
    pub const VERDICT_RETURN: i32 = -5;

    /// `NFT_SET_INTERVAL`
    pub const SET_INTERVAL: u32 = 0x4;
    /// `NFT_SET_MAP`
    pub const SET_MAP: u32 = 0x8;
    /// `NFT_SET_TIMEOUT`
    pub const SET_TIMEOUT: u32 = 0x10;
    /// `NFT_SET_EVAL` (nft's "dynamic")
    pub const SET_EVAL: u32 = 0x20;
    /// `NFT_DATA_VERDICT`
    pub const DATA_VERDICT: u32 = 0xffff_ff00;
    /// `NFT_SET_ELEM_INTERVAL_END`
    pub const ELEM_INTERVAL_END: u32 = 0x1;

    /// nft datatype ids used in set key/data types.
    pub const TYPE_INTEGER: u32 = 4;
    pub const TYPE_IPADDR: u32 = 7;
    pub const TYPE_IP6ADDR: u32 = 8;
    pub const TYPE_INET_PROTOCOL: u32 = 12;
    pub const TYPE_INET_SERVICE: u32 = 13;

    /// `NF_ACCEPT` as a chain policy.
    pub const POLICY_ACCEPT: u32 = 1;

    /// `NFT_TABLE_F_OWNER`
    pub const TABLE_F_OWNER: u32 = 0x2;
    /// `NFT_TABLE_F_PERSIST`
    pub const TABLE_F_PERSIST: u32 = 0x4;
}

/// Which header a payload expression reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadBase {
    Link,
    Network,
    Transport,
}

/// One kernel expression, with the attributes nftproxy sets (and the read-back compares).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LowExpr {
    Payload {
        base: PayloadBase,
        offset: u32,
        len: u32,
        dreg: u32,
    },
    Meta {
        key: u32,
        dreg: u32,
    },
    MetaSet {
        key: u32,
        sreg: u32,
    },
    Cmp {
        sreg: u32,
        op: u32,
        data: Vec<u8>,
    },
    Bitwise {
        sreg: u32,
        dreg: u32,
        len: u32,
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    Lookup {
        sreg: u32,
        dreg: Option<u32>,
        set: String,
        flags: u32,
    },
    Verdict {
        code: i32,
        chain: Option<String>,
    },
    Immediate {
        dreg: u32,
        data: Vec<u8>,
    },
    Numgen {
        dreg: u32,
        modulus: u32,
        kind: u32,
        offset: u32,
    },
    /// `jhash(sreg, len, seed) % modulus + offset`: the bytes of consecutive registers hashed
    /// with the kernel's `jhash`.
    Hash {
        sreg: u32,
        dreg: u32,
        len: u32,
        modulus: u32,
        seed: u32,
        offset: u32,
    },
    /// `byteorder reg 1 = hton(reg 1, 4, 4)`: nft converts a numgen result to network order
    /// before looking it up in an interval map (interval keys compare as big-endian bytes).
    Byteorder {
        sreg: u32,
        dreg: u32,
        op: u32,
        len: u32,
        size: u32,
    },
    Fib {
        dreg: u32,
        result: u32,
        flags: u32,
    },
    Ct {
        key: u32,
        dreg: u32,
    },
    Dynset {
        op: u32,
        sreg_key: u32,
        set: String,
        /// The timeout of the element it adds or refreshes, when not the set's.
        timeout_ms: Option<u64>,
    },
    Nat {
        kind: u32,
        family: u32,
        reg_addr: Option<u32>,
        reg_proto: Option<u32>,
        flags: u32,
    },
    Masq {
        flags: u32,
    },
    Reject {
        kind: u32,
        code: u8,
    },
    /// An expression nftproxy never writes (found in the kernel: someone edited our table).
    Foreign(String),
}

/// The register nft and the kernel's dump use for the 32-bit word `word` of the register
/// file: `reg 1`, `reg 2`, … at 16-byte boundaries, `NFT_REG32_xx` in between. Using the dump's
/// spelling when writing makes read-back comparisons exact.
pub fn register_for_word(word: u32) -> u32 {
    if word.is_multiple_of(4) { consts::REG_1 + word / 4 } else { consts::REG32_00 + word }
}

/// A base chain's hook, as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireHook {
    pub hooknum: u32,
    pub priority: i32,
    pub chain_type: String,
    pub policy: u32,
}

/// A rule: expressions and userdata (the comment TLV).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WireRule {
    pub exprs: Vec<LowExpr>,
    pub userdata: Option<Vec<u8>>,
}

/// A chain and its rules.
#[derive(Debug, Clone)]
pub struct WireChain {
    pub name: String,
    pub hook: Option<WireHook>,
    pub userdata: Option<Vec<u8>>,
    pub rules: Vec<WireRule>,
    pub owner: Owner,
}

impl WireChain {
    /// Same hook and userdata (what cannot change without recreating the chain).
    pub fn same_spec(&self, other: &WireChain) -> bool {
        self.hook == other.hook && self.userdata == other.userdata
    }

    /// Chains this chain's rules jump or go to.
    pub fn targets(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().flat_map(|r| r.exprs.iter()).filter_map(|e| match named(e) {
            Some(Named::Chain(c)) => Some(c),
            Some(Named::Set(_)) | None => None,
        })
    }

    /// Sets this chain's rules look up or update.
    pub fn set_refs(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().flat_map(|r| r.exprs.iter()).filter_map(|e| match named(e) {
            Some(Named::Set(s)) => Some(s),
            Some(Named::Chain(_)) | None => None,
        })
    }
}

/// An object an expression refers to by name.
enum Named<'a> {
    Chain(&'a str),
    Set(&'a str),
}

/// The chain or set `expr` names, if any. Every variant is listed: one that names an object must
/// say so here, or the diff would order its operations wrongly (a rule added before the set it
/// uses, a chain deleted while still a target).
fn named(expr: &LowExpr) -> Option<Named<'_>> {
    match expr {
        LowExpr::Verdict { chain, .. } => chain.as_deref().map(Named::Chain),
        LowExpr::Lookup { set, .. } | LowExpr::Dynset { set, .. } => Some(Named::Set(set)),
        LowExpr::Payload { .. }
        | LowExpr::Meta { .. }
        | LowExpr::MetaSet { .. }
        | LowExpr::Cmp { .. }
        | LowExpr::Bitwise { .. }
        | LowExpr::Immediate { .. }
        | LowExpr::Numgen { .. }
        | LowExpr::Hash { .. }
        | LowExpr::Byteorder { .. }
        | LowExpr::Fib { .. }
        | LowExpr::Ct { .. }
        | LowExpr::Nat { .. }
        | LowExpr::Masq { .. }
        | LowExpr::Reject { .. }
        | LowExpr::Foreign(_) => None,
    }
}

/// The numgen window of a key in an endpoint map (`numgen random mod 2^NUMGEN_WINDOW_BITS`
/// per service port): an end element belongs to the range before it.
pub const NUMGEN_WINDOW_BITS: u32 = 20;

/// The numbers numgen draws for one service port: its window of an endpoint map.
pub const NUMGEN_WINDOW: u32 = 1 << NUMGEN_WINDOW_BITS;

impl WireKey {
    /// The window of a 4-byte big-endian numgen key, if it is one.
    pub fn numgen_window(&self) -> Option<u32> {
        let value = u32::from_be_bytes(<[u8; 4]>::try_from(self.bytes.as_slice()).ok()?);
        let value = if self.interval_end { value.checked_sub(1)? } else { value };
        Some(value >> NUMGEN_WINDOW_BITS)
    }
}

impl WireSetSpec {
    /// Whether elements are ranges (start and end elements in the kernel's rbtree).
    pub fn is_interval(&self) -> bool {
        self.flags & consts::SET_INTERVAL != 0
    }

    /// Whether keys are numgen results (the endpoint maps).
    pub fn is_numgen_interval_map(&self) -> bool {
        self.is_interval() && self.key_type == consts::TYPE_INTEGER && self.key_len == 4
    }
}

/// Set attributes that cannot change without recreating the set (and `size`, which can).
#[derive(Debug, Clone, Eq)]
pub struct WireSetSpec {
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    pub data_type: Option<u32>,
    pub data_len: u32,
    pub timeout_ms: Option<u64>,
    pub userdata: Option<Vec<u8>>,
    /// The set's `counter` expression, which the kernel clones into every element added
    /// without expressions of its own (the element counters, never their values).
    pub counter: bool,
    /// The most elements a dynamic set may hold, when not the kernel's default: sent as an
    /// update right after the set is created (see [`crate::nft::ast::Set::size`]). Not compared,
    /// and not read back: a kernel that cannot raise it keeps its default, and the set is the
    /// same set.
    pub size: Option<u32>,
}

impl PartialEq for WireSetSpec {
    fn eq(&self, other: &WireSetSpec) -> bool {
        let WireSetSpec { flags, key_type, key_len, data_type, data_len, timeout_ms, userdata, counter, size: _ } =
            self;
        *flags == other.flags
            && *key_type == other.key_type
            && *key_len == other.key_len
            && *data_type == other.data_type
            && *data_len == other.data_len
            && *timeout_ms == other.timeout_ms
            && *userdata == other.userdata
            && *counter == other.counter
    }
}

/// A set or map.
#[derive(Debug, Clone)]
pub struct WireSet {
    pub name: String,
    pub spec: WireSetSpec,
    pub elements: SetElements,
    /// Dynamic sets (affinity) are filled by the kernel; their elements are never diffed.
    pub dynamic: bool,
    pub owner: Owner,
}

impl WireSet {
    /// The same set without elements.
    pub fn empty_like(&self) -> WireSet {
        WireSet {
            name: self.name.clone(),
            spec: self.spec.clone(),
            elements: SetElements::new(),
            dynamic: self.dynamic,
            owner: self.owner.clone(),
        }
    }
}

/// A table and everything in it.
#[derive(Debug, Clone)]
pub struct WireTable {
    pub family: IpFamily,
    pub name: String,
    pub flags: u32,
    pub userdata: Option<Vec<u8>>,
    pub sets: IndexMap<String, WireSet>,
    pub chains: IndexMap<String, WireChain>,
}

impl WireTable {
    /// A table with the same identity and no contents.
    pub fn empty_like(&self) -> WireTable {
        WireTable {
            family: self.family,
            name: self.name.clone(),
            flags: self.flags,
            userdata: self.userdata.clone(),
            sets: IndexMap::new(),
            chains: IndexMap::new(),
        }
    }

    /// Number of rules.
    pub fn rule_count(&self) -> usize {
        self.chains.values().map(|c| c.rules.len()).sum()
    }

    /// Number of elements in non-dynamic sets.
    pub fn element_count(&self) -> usize {
        self.sets.values().filter(|s| !s.dynamic).map(|s| s.elements.len()).sum()
    }
}

/// A balancing rule found in a table: `numgen random mod {modulus} offset {offset}` followed by
/// a lookup of the result in `map`, and how many ranges start inside that window of the map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumgenWindow {
    pub chain: String,
    /// The rule's index in its chain (a rule may have several such lookups).
    pub rule: usize,
    pub map: String,
    pub modulus: u32,
    pub offset: u32,
    /// Range starts in `[offset, offset + modulus)` of the map: the endpoints the window holds.
    pub load: u32,
}

impl WireTable {
    /// Every balancing rule of the table (`numgen` or `jhash … offset K` then a map lookup), read back from
    /// the kernel so that a restarted proxy finds where each chain's endpoints are.
    pub fn numgen_windows(&self) -> Vec<NumgenWindow> {
        let mut out = Vec::new();
        for chain in self.chains.values() {
            for (index, rule) in chain.rules.iter().enumerate() {
                for triple in rule.exprs.windows(3) {
                    let [
                        LowExpr::Numgen { modulus, offset, .. } | LowExpr::Hash { modulus, offset, .. },
                        LowExpr::Byteorder { .. },
                        LowExpr::Lookup { set, .. },
                    ] = triple
                    else {
                        continue;
                    };
                    // Keys are big-endian numbers, so the window is a range of the ordered map.
                    let load = self.sets.get(set).map_or(0, |s| {
                        let start = WireKey::new(&offset.to_be_bytes());
                        let starts = |k: &&WireKey| !k.interval_end && k.bytes.len() == 4;
                        match offset.checked_add(*modulus) {
                            Some(end) => s
                                .elements
                                .range(start..WireKey::end(&end.to_be_bytes()))
                                .map(|(k, _)| k)
                                .filter(starts)
                                .count(),
                            None => s.elements.range(start..).map(|(k, _)| k).filter(starts).count(),
                        }
                    });
                    out.push(NumgenWindow {
                        chain: chain.name.clone(),
                        rule: index,
                        map: set.clone(),
                        modulus: *modulus,
                        offset: *offset,
                        load: u32::try_from(load).unwrap_or(u32::MAX),
                    });
                }
            }
        }
        out
    }
}

/// A ruleset as the kernel holds it: nftproxy's tables, one per family.
#[derive(Debug, Clone, Default)]
pub struct WireRuleset {
    pub tables: Vec<WireTable>,
}

impl WireRuleset {
    /// The table of a family, if present.
    pub fn table(&self, family: IpFamily) -> Option<&WireTable> {
        self.tables.iter().find(|t| t.family == family)
    }
}

/// Userdata TLVs as libnftnl writes them: one byte type, one byte length, value.
pub mod udata {
    /// `NFTNL_UDATA_*_COMMENT` for tables, chains, rules and elements.
    pub const COMMENT: u8 = 0;
    /// `NFTNL_UDATA_SET_COMMENT`
    pub const SET_COMMENT: u8 = 7;
    /// nft (like libnftnl) refuses comments longer than this, including the NUL.
    pub const COMMENT_MAXLEN: usize = 128;

    /// Appends one TLV.
    pub fn put(buf: &mut Vec<u8>, kind: u8, value: &[u8]) {
        let len = u8::try_from(value.len()).unwrap_or(u8::MAX);
        buf.push(kind);
        buf.push(len);
        buf.extend_from_slice(&value[..usize::from(len)]);
    }

    /// Appends a NUL-terminated string TLV (truncated to what nft accepts).
    pub fn put_str(buf: &mut Vec<u8>, kind: u8, s: &str) {
        let mut bytes = truncate_comment(s).as_bytes().to_vec();
        bytes.push(0);
        put(buf, kind, &bytes);
    }

    /// A comment cut to nft's limit at a character boundary.
    pub fn truncate_comment(s: &str) -> &str {
        if s.len() < COMMENT_MAXLEN {
            return s;
        }
        let mut end = COMMENT_MAXLEN - 1;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        &s[..end]
    }

    /// Userdata holding only a comment (tables, chains, rules, elements).
    pub fn comment(s: &str) -> Vec<u8> {
        let mut buf = Vec::new();
        put_str(&mut buf, COMMENT, s);
        buf
    }

    /// Iterates the TLVs of a userdata blob.
    pub fn parse(mut buf: &[u8]) -> impl Iterator<Item = (u8, &[u8])> {
        std::iter::from_fn(move || {
            if buf.len() < 2 {
                return None;
            }
            let (kind, len) = (buf[0], usize::from(buf[1]));
            if buf.len() < 2 + len {
                return None;
            }
            let value = &buf[2..2 + len];
            buf = &buf[2 + len..];
            Some((kind, value))
        })
    }

    /// The comment TLV of a userdata blob, without its NUL.
    pub fn find_comment(buf: &[u8], kind: u8) -> Option<String> {
        parse(buf).find(|(k, _)| *k == kind).map(|(_, v)| {
            let v = v.strip_suffix(&[0]).unwrap_or(v);
            String::from_utf8_lossy(v).into_owned()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_follow_the_kernel_dump_spelling() {
        assert_eq!(register_for_word(0), 1);
        assert_eq!(register_for_word(1), 9);
        assert_eq!(register_for_word(2), 10);
        assert_eq!(register_for_word(4), 2);
        assert_eq!(register_for_word(5), 13);
    }

    #[test]
    fn comments_are_cut_at_nfts_limit() {
        let long = "é".repeat(100);
        let cut = udata::truncate_comment(&long);
        assert!(cut.len() < udata::COMMENT_MAXLEN);
        assert!(long.starts_with(cut));
        let blob = udata::comment("ns/svc:http");
        assert_eq!(blob[0], udata::COMMENT);
        assert_eq!(usize::from(blob[1]), "ns/svc:http".len() + 1);
        assert_eq!(udata::find_comment(&blob, udata::COMMENT).as_deref(), Some("ns/svc:http"));
    }
}
