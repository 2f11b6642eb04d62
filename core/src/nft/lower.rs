//! Turns the desired ruleset into kernel objects: the same expressions, registers, key bytes and
//! userdata nft 1.0.6 would produce for the same nft text, so `nft list ruleset` decompiles our
//! tables exactly as [`super::render`] prints them. One deliberate difference: a session
//! affinity rule loads the client and its slot once and its lookups and update read the same
//! registers (`Held`), where nft would load them again for each; nft decompiles registers,
//! not text, so its listing is the same.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::ast::*;
use super::wire::consts::*;
use super::wire::*;
use crate::net::IpFamily;

/// Lowers every table.
pub fn lower_ruleset(ruleset: &Ruleset) -> WireRuleset {
    WireRuleset { tables: ruleset.tables.iter().map(lower_table).collect() }
}

/// Lowers one table.
pub fn lower_table(table: &Table) -> WireTable {
    WireTable {
        family: table.family,
        name: table.name.clone(),
        flags: 0,
        userdata: table.comment.as_deref().map(udata::comment),
        sets: table.sets.values().map(|s| (s.name.clone(), lower_set(s))).collect(),
        chains: table.chains.values().map(|c| (c.name.clone(), lower_chain(c))).collect(),
    }
}

/// Lowers one chain and its rules.
pub fn lower_chain(chain: &Chain) -> WireChain {
    WireChain {
        name: chain.name.clone(),
        hook: chain.base.map(|b| WireHook {
            hooknum: b.hook.number(),
            priority: b.priority,
            chain_type: b.chain_type.name().to_string(),
            policy: POLICY_ACCEPT,
        }),
        userdata: chain.comment.as_deref().map(udata::comment),
        rules: chain.rules.iter().map(lower_rule).collect(),
        owner: chain.owner.clone(),
    }
}

/// Lowers one rule.
pub fn lower_rule(rule: &Rule) -> WireRule {
    let mut exprs = Vec::with_capacity(rule.stmts.len() * 3);
    let mut held = Held::default();
    for stmt in &rule.stmts {
        lower_stmt(stmt, &mut held, &mut exprs);
    }
    WireRule { exprs, userdata: rule.comment.as_deref().map(udata::comment) }
}

/// What the registers hold between the statements of one rule, for a later statement to read
/// instead of loading it again. The kernel's cost of a rule grows with its expressions (it
/// finds each one's type by name), and a sticky rule (`ip saddr . numgen inc mod 1 offset J
/// @clients numgen inc mod 1 offset K @targets update @clients { … } … map @targets`) needs
/// the client, J and K once: 9 expressions instead of nft's 13; an affinity record rule, 7
/// instead of 8. Only these values are tracked; any statement that writes registers in another
/// way forgets them.
#[derive(Debug, Default)]
struct Held {
    /// The source address (`ip saddr` / `ip6 saddr`), from this word on.
    saddr: Option<(IpFamily, u32)>,
    /// `numgen inc mod 1 offset K` constants: (K, the word holding it).
    keys: Vec<(u32, u32)>,
}

impl Held {
    /// The register words `first..first + words` were written.
    fn clobber(&mut self, first: u32, words: u32) {
        let overlaps = |start: u32, len: u32| start < first + words && first < start + len;
        if self.saddr.is_some_and(|(family, at)| overlaps(at, address_words(family))) {
            self.saddr = None;
        }
        self.keys.retain(|&(_, at)| !overlaps(at, 1));
    }

    fn forget(&mut self) {
        *self = Held::default();
    }

    /// The word holding constant `key`.
    fn key(&self, key: u32) -> Option<u32> {
        self.keys.iter().find(|&&(k, _)| k == key).map(|&(_, at)| at)
    }

    /// The first word past everything held.
    fn free_word(&self) -> u32 {
        let saddr_end = self.saddr.map_or(0, |(family, at)| at + address_words(family));
        self.keys.iter().map(|&(_, at)| at + 1).fold(saddr_end, u32::max)
    }

    /// Loads constant `key` into `word` (unless it holds it already).
    fn load_key(&mut self, key: u32, word: u32, out: &mut Vec<LowExpr>) {
        if self.key(key) == Some(word) {
            return;
        }
        self.clobber(word, 1);
        out.push(numgen_key(register_for_word(word), key));
        self.keys.push((key, word));
    }

    /// The register of `ip saddr . numgen inc mod 1 offset J`: reused when held, completed
    /// with J when the address is held, else loaded from `reg 1` on.
    fn client_slot(&mut self, family: IpFamily, slot: u32, out: &mut Vec<LowExpr>) -> u32 {
        let at = match self.saddr {
            Some((held, at)) if held == family => at,
            _ => {
                self.forget();
                load_concat_words(&[Selector::Saddr(family)], out);
                self.saddr = Some((family, 0));
                0
            }
        };
        self.load_key(slot, at + address_words(family), out);
        register_for_word(at)
    }

    /// The register of constant `key`: reused when held, else loaded past what is held (or
    /// into `reg 1` when that is full).
    fn key_register(&mut self, key: u32, out: &mut Vec<LowExpr>) -> u32 {
        if let Some(at) = self.key(key) {
            return register_for_word(at);
        }
        let word = match self.free_word() {
            free if free < REGISTER_WORDS => free,
            _ => {
                self.forget();
                0
            }
        };
        self.load_key(key, word, out);
        register_for_word(word)
    }
}

/// The 32-bit words of the four data registers.
const REGISTER_WORDS: u32 = 16;

/// How many 32-bit words an address fills.
fn address_words(family: IpFamily) -> u32 {
    match family {
        IpFamily::V4 => 1,
        IpFamily::V6 => 4,
    }
}

/// Where a selector lives and how wide it is.
fn selector_load(sel: Selector, dreg: u32) -> (LowExpr, usize) {
    let payload = |base, offset, len: u32| LowExpr::Payload { base, offset, len, dreg };
    match sel {
        Selector::Saddr(IpFamily::V4) => (payload(PayloadBase::Network, 12, 4), 4),
        Selector::Daddr(IpFamily::V4) => (payload(PayloadBase::Network, 16, 4), 4),
        Selector::Saddr(IpFamily::V6) => (payload(PayloadBase::Network, 8, 16), 16),
        Selector::Daddr(IpFamily::V6) => (payload(PayloadBase::Network, 24, 16), 16),
        Selector::Dport => (payload(PayloadBase::Transport, 2, 2), 2),
        Selector::L4Proto => (LowExpr::Meta { key: META_L4PROTO, dreg }, 1),
        Selector::Mark => (LowExpr::Meta { key: META_MARK, dreg }, 4),
        Selector::Iifname => (LowExpr::Meta { key: META_IIFNAME, dreg }, 16),
    }
}

/// Loads a (possibly concatenated) key into consecutive registers starting at `reg 1`, each
/// field padded to 32 bits, as nft does. Returns the first register.
fn load_concat(key: &[Selector], out: &mut Vec<LowExpr>) -> u32 {
    load_concat_words(key, out);
    REG_1
}

/// [`load_concat`], returning how many 32-bit words the key fills.
fn load_concat_words(key: &[Selector], out: &mut Vec<LowExpr>) -> u32 {
    let mut word = 0u32;
    for sel in key {
        let (load, len) = selector_load(*sel, register_for_word(word));
        out.push(load);
        word += u32::try_from(len.div_ceil(4)).unwrap_or(4);
    }
    word
}

fn verdict_expr(v: &Verdict) -> LowExpr {
    let (code, chain) = verdict_code(v);
    LowExpr::Verdict { code, chain }
}

/// The kernel's verdict code and chain for a verdict.
pub fn verdict_code(v: &Verdict) -> (i32, Option<String>) {
    match v {
        Verdict::Accept => (VERDICT_ACCEPT, None),
        Verdict::Drop => (VERDICT_DROP, None),
        Verdict::Return => (VERDICT_RETURN, None),
        Verdict::Jump(c) => (VERDICT_JUMP, Some(c.clone())),
        Verdict::Goto(c) => (VERDICT_GOTO, Some(c.clone())),
    }
}

fn cmp_op(op: CmpOp) -> u32 {
    match op {
        CmpOp::Eq => CMP_EQ,
        CmpOp::Ne => CMP_NEQ,
    }
}

fn lower_stmt(stmt: &Stmt, held: &mut Held, out: &mut Vec<LowExpr>) {
    let tracked = matches!(
        stmt,
        Stmt::Cmp { .. }
            | Stmt::SlotLookup { .. }
            | Stmt::UpdateSlot { .. }
            | Stmt::KeyLookup { .. }
            | Stmt::DnatKeyMap { .. }
            | Stmt::HashLookup { .. }
    );
    if !tracked {
        held.forget();
    }
    match stmt {
        Stmt::SlotLookup { family, slot, set } => {
            let sreg = held.client_slot(*family, *slot, out);
            out.push(LowExpr::Lookup { sreg, dreg: None, set: set.clone(), flags: 0 });
        }
        Stmt::UpdateSlot { family, slot, set, timeout_secs } => {
            let sreg_key = held.client_slot(*family, *slot, out);
            let timeout_ms = Some(u64::from(*timeout_secs) * 1000);
            out.push(LowExpr::Dynset { op: DYNSET_OP_UPDATE, sreg_key, set: set.clone(), timeout_ms });
        }
        Stmt::KeyLookup { key, set } => {
            let sreg = held.key_register(*key, out);
            out.push(LowExpr::Lookup { sreg, dreg: None, set: set.clone(), flags: 0 });
        }
        Stmt::DnatKeyMap { family, key, map } => {
            // A hash map compares keys as bytes: the value stays in host order (no byteorder).
            let sreg = held.key_register(*key, out);
            out.push(LowExpr::Lookup { sreg, dreg: Some(REG_1), set: map.clone(), flags: 0 });
            out.push(dnat_from_registers(*family));
            held.forget();
        }
        Stmt::HashLookup { family, hash, set } => {
            held.forget();
            lower_jhash(*family, hash, out);
            out.push(hton_u32());
            out.push(LowExpr::Lookup { sreg: REG_1, dreg: None, set: set.clone(), flags: 0 });
            // The address stays where the hash read it; the port after it may be overwritten.
            held.saddr = Some((*family, JHASH_FIRST_WORD));
        }
        Stmt::Cmp { sel, op, value } => {
            let (_, len) = selector_load(*sel, REG_1);
            held.clobber(0, u32::try_from(len.div_ceil(4)).unwrap_or(REGISTER_WORDS));
            lower_cmp(*sel, *op, value, out);
        }
        Stmt::MarkBitsEq { mask, value } => {
            out.push(LowExpr::Meta { key: META_MARK, dreg: REG_1 });
            out.push(LowExpr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                len: 4,
                mask: mask.to_ne_bytes().to_vec(),
                xor: 0u32.to_ne_bytes().to_vec(),
            });
            out.push(LowExpr::Cmp { sreg: REG_1, op: CMP_EQ, data: value.to_ne_bytes().to_vec() });
        }
        Stmt::CtStateNew => lower_ct_bits(CT_STATE, CT_STATE_NEW, out),
        Stmt::CtStatusDnat => lower_ct_bits(CT_STATUS, CT_STATUS_DNAT, out),
        Stmt::FibLocal(addr) | Stmt::FibNotLocal(addr) => {
            let flags = match addr {
                FibAddr::Saddr => FIB_F_SADDR,
                FibAddr::Daddr => FIB_F_DADDR,
            };
            let op = if matches!(stmt, Stmt::FibLocal(_)) { CMP_EQ } else { CMP_NEQ };
            out.push(LowExpr::Fib { dreg: REG_1, result: FIB_RESULT_ADDRTYPE, flags });
            out.push(LowExpr::Cmp { sreg: REG_1, op, data: RTN_LOCAL.to_ne_bytes().to_vec() });
        }
        Stmt::Lookup { key, set, negate } => {
            let sreg = load_concat(key, out);
            let flags = if *negate { LOOKUP_F_INV } else { 0 };
            out.push(LowExpr::Lookup { sreg, dreg: None, set: set.clone(), flags });
        }
        Stmt::Vmap { key, map } => {
            let sreg = load_concat(key, out);
            out.push(LowExpr::Lookup { sreg, dreg: Some(REG_VERDICT), set: map.clone(), flags: 0 });
        }
        Stmt::MarkOr(bits) => lower_mark_set(!bits, *bits, out),
        Stmt::MarkXor(bits) => lower_mark_set(u32::MAX, *bits, out),
        Stmt::Masquerade { fully_random } => {
            let flags = if *fully_random { NAT_RANGE_PROTO_RANDOM_FULLY } else { 0 };
            out.push(LowExpr::Masq { flags });
        }
        Stmt::Reject(family) => {
            let code = match family {
                IpFamily::V4 => ICMP_PORT_UNREACH,
                IpFamily::V6 => ICMPV6_PORT_UNREACH,
            };
            out.push(LowExpr::Reject { kind: REJECT_ICMP_UNREACH, code });
        }
        Stmt::Dnat { addr, port } => {
            out.push(LowExpr::Immediate { dreg: REG_1, data: address_bytes(addr) });
            out.push(LowExpr::Immediate { dreg: REG_1 + 1, data: port.to_be_bytes().to_vec() });
            out.push(LowExpr::Nat {
                kind: NAT_DNAT,
                family: nfproto(IpFamily::of(addr)),
                reg_addr: Some(REG_1),
                reg_proto: Some(REG_1 + 1),
                // nft also sends PROTO_SPECIFIED here; the kernel implies it (and MAP_IPS) from
                // the registers and echoes both, so the normal form leaves implied flags out.
                flags: 0,
            });
        }
        Stmt::DnatNumgenMap { family, modulus, offset, map } => {
            out.push(numgen(*modulus, *offset));
            out.push(hton_u32());
            out.push(LowExpr::Lookup { sreg: REG_1, dreg: Some(REG_1), set: map.clone(), flags: 0 });
            out.push(dnat_from_registers(*family));
        }
        Stmt::DnatBalanceMap { family, key, modulus, map } => {
            // The key's fields, then the numgen result in the word after them: a hash map's
            // key compares as bytes, so the index stays in host order (no byteorder).
            let words = load_concat_words(key, out);
            out.push(LowExpr::Numgen { dreg: register_for_word(words), modulus: *modulus, kind: NG_RANDOM, offset: 0 });
            out.push(LowExpr::Lookup { sreg: REG_1, dreg: Some(REG_1), set: map.clone(), flags: 0 });
            out.push(dnat_from_registers(*family));
        }
        Stmt::DnatHashMap { family, proto, hash, map } => {
            lower_cmp(Selector::L4Proto, CmpOp::Eq, &Value::Proto(*proto), out);
            lower_jhash(*family, hash, out);
            out.push(hton_u32());
            out.push(LowExpr::Lookup { sreg: REG_1, dreg: Some(REG_1), set: map.clone(), flags: 0 });
            out.push(dnat_from_registers(*family));
        }
        Stmt::Verdict(v) => out.push(verdict_expr(v)),
    }
}

/// Where a hash's fields are loaded: `reg 2`, as nft does.
const JHASH_FIRST_WORD: u32 = 4;

/// `jhash ip saddr . th sport …` into `reg 1`: the source address and port loaded from
/// `reg 2` on, each padded to 32 bits, and hashed together, as nft lays them out.
fn lower_jhash(family: IpFamily, hash: &Jhash, out: &mut Vec<LowExpr>) {
    const FIRST_WORD: u32 = JHASH_FIRST_WORD;
    let (load, len) = selector_load(Selector::Saddr(family), register_for_word(FIRST_WORD));
    out.push(load);
    let addr_words = u32::try_from(len / 4).unwrap_or(4);
    let sport = register_for_word(FIRST_WORD + addr_words);
    out.push(LowExpr::Payload { base: PayloadBase::Transport, offset: 0, len: 2, dreg: sport });
    out.push(LowExpr::Hash {
        sreg: register_for_word(FIRST_WORD),
        dreg: REG_1,
        len: (addr_words + 1) * 4,
        modulus: hash.modulus,
        seed: hash.seed,
        offset: hash.offset,
    });
}

/// `dnat` to the address in `reg 1` and the port in the word after it (a map lookup's result).
fn dnat_from_registers(family: IpFamily) -> LowExpr {
    let addr_words = match family {
        IpFamily::V4 => 1,
        IpFamily::V6 => 4,
    };
    LowExpr::Nat {
        kind: NAT_DNAT,
        family: nfproto(family),
        reg_addr: Some(REG_1),
        reg_proto: Some(register_for_word(addr_words)),
        flags: 0,
    }
}

/// Interval maps compare keys as big-endian bytes: nft converts the numgen result first.
fn hton_u32() -> LowExpr {
    LowExpr::Byteorder { sreg: REG_1, dreg: REG_1, op: BYTEORDER_HTON, len: 4, size: 4 }
}

fn numgen(modulus: u32, offset: u32) -> LowExpr {
    LowExpr::Numgen { dreg: REG_1, modulus, kind: NG_RANDOM, offset }
}

/// `numgen inc mod 1 offset K`: always 0 plus K, a constant in a register.
fn numgen_key(dreg: u32, key: u32) -> LowExpr {
    LowExpr::Numgen { dreg, modulus: 1, kind: NG_INCREMENTAL, offset: key }
}

/// `NFPROTO_IPV4` / `NFPROTO_IPV6`.
pub fn nfproto(family: IpFamily) -> u32 {
    match family {
        IpFamily::V4 => 2,
        IpFamily::V6 => 10,
    }
}

fn lower_ct_bits(key: u32, bits: u32, out: &mut Vec<LowExpr>) {
    out.push(LowExpr::Ct { key, dreg: REG_1 });
    out.push(LowExpr::Bitwise {
        sreg: REG_1,
        dreg: REG_1,
        len: 4,
        mask: bits.to_ne_bytes().to_vec(),
        xor: 0u32.to_ne_bytes().to_vec(),
    });
    out.push(LowExpr::Cmp { sreg: REG_1, op: CMP_NEQ, data: 0u32.to_ne_bytes().to_vec() });
}

fn lower_mark_set(mask: u32, xor: u32, out: &mut Vec<LowExpr>) {
    out.push(LowExpr::Meta { key: META_MARK, dreg: REG_1 });
    out.push(LowExpr::Bitwise {
        sreg: REG_1,
        dreg: REG_1,
        len: 4,
        mask: mask.to_ne_bytes().to_vec(),
        xor: xor.to_ne_bytes().to_vec(),
    });
    out.push(LowExpr::MetaSet { key: META_MARK, sreg: REG_1 });
}

fn lower_cmp(sel: Selector, op: CmpOp, value: &Value, out: &mut Vec<LowExpr>) {
    let (load, len) = selector_load(sel, REG_1);
    match value {
        Value::Prefix(net) if net.prefix_len() < net.max_prefix_len() => {
            lower_prefix_cmp(load, net, op, out);
        }
        Value::Ifname(name) => {
            out.push(load);
            let data = match name.strip_suffix('*') {
                Some(prefix) => prefix.as_bytes().to_vec(),
                None => {
                    let mut d = name.as_bytes().to_vec();
                    d.resize(len.max(d.len()), 0);
                    d
                }
            };
            out.push(LowExpr::Cmp { sreg: REG_1, op: cmp_op(op), data });
        }
        // A whole-address prefix compares as the address.
        Value::Addr(_)
        | Value::Prefix(_)
        | Value::Proto(_)
        | Value::Port(_)
        | Value::IndexRange(..)
        | Value::Index(_) => {
            out.push(load);
            out.push(LowExpr::Cmp { sreg: REG_1, op: cmp_op(op), data: value_bytes(value, len) });
        }
    }
}

/// `ip saddr != 10.0.0.0/8`: nft shortens the load to whole bytes of the prefix, or loads the
/// whole address and masks it when the prefix is not byte-aligned.
fn lower_prefix_cmp(load: LowExpr, net: &IpNet, op: CmpOp, out: &mut Vec<LowExpr>) {
    let network = address_bytes(&net.network());
    let bits = usize::from(net.prefix_len());
    let LowExpr::Payload { base, offset, len, dreg } = load else {
        out.push(load);
        return;
    };
    if bits % 8 == 0 {
        let bytes = bits / 8;
        out.push(LowExpr::Payload { base, offset, len: u32::try_from(bytes).unwrap_or(len), dreg });
        out.push(LowExpr::Cmp { sreg: REG_1, op: cmp_op(op), data: network[..bytes].to_vec() });
    } else {
        out.push(LowExpr::Payload { base, offset, len, dreg });
        let mask = address_bytes(&net.netmask());
        out.push(LowExpr::Bitwise { sreg: REG_1, dreg: REG_1, len, mask, xor: vec![0; network.len()] });
        out.push(LowExpr::Cmp { sreg: REG_1, op: cmp_op(op), data: network });
    }
}

/// The bytes of a value in a register of `len` bytes (network order for packet fields).
fn value_bytes(value: &Value, len: usize) -> Vec<u8> {
    match value {
        Value::Addr(a) => address_bytes(a),
        Value::Prefix(p) => address_bytes(&p.addr()),
        Value::Proto(p) => vec![p.number()],
        Value::Port(p) => p.to_be_bytes().to_vec(),
        Value::IndexRange(lo, _) | Value::Index(lo) => lo.to_ne_bytes().to_vec(),
        Value::Ifname(n) => {
            let mut d = n.as_bytes().to_vec();
            d.resize(len, 0);
            d
        }
    }
}

/// A field of a concatenated key: value bytes padded to 32 bits, written in place (a cluster's
/// ruleset has hundreds of thousands of keys).
fn push_field(buf: &mut Bytes, value: &Value) {
    match value {
        Value::Addr(a) => push_address(buf, a),
        Value::Prefix(p) => push_address(buf, &p.addr()),
        Value::Proto(p) => buf.push(p.number()),
        Value::Port(p) => buf.extend_from_slice(&p.to_be_bytes()),
        Value::IndexRange(lo, _) | Value::Index(lo) => buf.extend_from_slice(&lo.to_ne_bytes()),
        Value::Ifname(_) => buf.extend_from_slice(&value_bytes(value, 0)),
    }
    buf.resize(buf.len().div_ceil(4) * 4, 0);
}

fn push_address(buf: &mut Bytes, address: &IpAddr) {
    match address {
        IpAddr::V4(a) => buf.extend_from_slice(&a.octets()),
        IpAddr::V6(a) => buf.extend_from_slice(&a.octets()),
    }
}

fn concat_bytes(values: &[Value]) -> Bytes {
    let mut buf = Bytes::new();
    buf.reserve(values.len() * 4);
    for v in values {
        push_field(&mut buf, v);
    }
    buf
}

/// Set attributes per shape, exactly as nft 1.0.6 sends them; `counter`: with the `counter`
/// set expression.
pub fn set_spec(shape: SetShape, timeout_secs: Option<u32>, comment: Option<&str>, counter: bool) -> WireSetSpec {
    let addr_type = |fam: IpFamily| match fam {
        IpFamily::V4 => (TYPE_IPADDR, 4),
        IpFamily::V6 => (TYPE_IP6ADDR, 16),
    };
    let concat = |types: &[u32]| types.iter().fold(0, |acc, t| (acc << 6) | t);
    let (flags, key_type, key_len, data_type, data_len, mut ud) = match shape {
        SetShape::Addresses(fam) => {
            let (t, l) = addr_type(fam);
            (0, t, l, None, 0, udata_prefix::BIG_ENDIAN_KEY.to_vec())
        }
        SetShape::Prefixes(fam) => {
            let (t, l) = addr_type(fam);
            (SET_INTERVAL, t, l, None, 0, udata_prefix::BIG_ENDIAN_KEY.to_vec())
        }
        SetShape::AffinityClients(fam) => {
            let (t, l) = addr_type(fam);
            let blob = match fam {
                IpFamily::V4 => udata_prefix::IP_SLOT,
                IpFamily::V6 => udata_prefix::IP6_SLOT,
            };
            (SET_TIMEOUT | SET_EVAL, concat(&[t, TYPE_INTEGER]), l + 4, None, 0, hex(blob))
        }
        SetShape::AddressPairs(fam) => {
            let (t, l) = addr_type(fam);
            (0, concat(&[t, t]), 2 * l, None, 0, udata_prefix::CONCAT_KEY.to_vec())
        }
        SetShape::ServiceVerdicts(fam) => {
            let (t, l) = addr_type(fam);
            let key = concat(&[t, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]);
            (SET_MAP, key, l + 8, Some(DATA_VERDICT), 0, udata_prefix::CONCAT_VERDICT_MAP.to_vec())
        }
        SetShape::PortVerdicts => {
            let key = concat(&[TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]);
            (SET_MAP, key, 8, Some(DATA_VERDICT), 0, udata_prefix::CONCAT_VERDICT_MAP.to_vec())
        }
        SetShape::EndpointTargets(fam) => {
            let (t, l) = addr_type(fam);
            let blob = match fam {
                IpFamily::V4 => udata_prefix::NUMGEN_TO_IP_DPORT,
                IpFamily::V6 => udata_prefix::NUMGEN_TO_IP6_DPORT,
            };
            let data = concat(&[t, TYPE_INET_SERVICE]);
            (SET_MAP | SET_INTERVAL, TYPE_INTEGER, 4, Some(data), l + 4, hex(blob))
        }
        SetShape::SlotWindows => (SET_INTERVAL, TYPE_INTEGER, 4, None, 0, hex(udata_prefix::NUMGEN)),
        SetShape::SlotTargets(fam) => {
            let (t, l) = addr_type(fam);
            let blob = match fam {
                IpFamily::V4 => udata_prefix::NUMGEN_INC_TO_IP_DPORT,
                IpFamily::V6 => udata_prefix::NUMGEN_INC_TO_IP6_DPORT,
            };
            (SET_MAP, TYPE_INTEGER, 4, Some(concat(&[t, TYPE_INET_SERVICE])), l + 4, hex(blob))
        }
        SetShape::ServiceKeys(fam) => {
            let (t, l) = addr_type(fam);
            let key = concat(&[t, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]);
            (0, key, l + 8, None, 0, udata_prefix::CONCAT_KEY.to_vec())
        }
        SetShape::PortKeys => {
            let key = concat(&[TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]);
            (0, key, 8, None, 0, udata_prefix::CONCAT_KEY.to_vec())
        }
        SetShape::ServiceEndpoints(fam, n) => {
            let (t, l) = addr_type(fam);
            let blob = match fam {
                IpFamily::V4 => udata_prefix::SERVICE_INDEX_TO_IP_DPORT,
                IpFamily::V6 => udata_prefix::SERVICE_INDEX_TO_IP6_DPORT,
            };
            let key = concat(&[t, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE, TYPE_INTEGER]);
            (SET_MAP, key, l + 12, Some(concat(&[t, TYPE_INET_SERVICE])), l + 4, numgen_modulus(hex(blob), n))
        }
        SetShape::NodeportEndpoints(fam, n) => {
            let (t, l) = addr_type(fam);
            let blob = match fam {
                IpFamily::V4 => udata_prefix::NODEPORT_INDEX_TO_IP_DPORT,
                IpFamily::V6 => udata_prefix::NODEPORT_INDEX_TO_IP6_DPORT,
            };
            let key = concat(&[TYPE_INET_PROTOCOL, TYPE_INET_SERVICE, TYPE_INTEGER]);
            (SET_MAP, key, 12, Some(concat(&[t, TYPE_INET_SERVICE])), l + 4, numgen_modulus(hex(blob), n))
        }
    };
    if let Some(c) = comment {
        udata::put_str(&mut ud, udata::SET_COMMENT, c);
    }
    WireSetSpec {
        flags,
        key_type,
        key_len,
        data_type,
        data_len,
        timeout_ms: timeout_secs.map(|t| u64::from(t) * 1000),
        userdata: Some(ud),
        counter,
        size: None,
    }
}

/// The set userdata nft writes for each shape, before the comment. Byte order TLVs tell nft how
/// to print keys; the `typeof` nests (nft expression ids and their private udata) let it print
/// `typeof numgen random mod 1 : ip daddr . th dport` instead of raw integers.
mod udata_prefix {
    /// KEYBYTEORDER = big endian.
    pub(super) const BIG_ENDIAN_KEY: [u8; 6] = [0, 4, 2, 0, 0, 0];
    /// KEYBYTEORDER = 0, KEY_TYPEOF = concat with no typeof data.
    pub(super) const CONCAT_KEY: [u8; 16] = [0, 4, 0, 0, 0, 0, 3, 8, 0, 4, 0x0d, 0, 0, 0, 1, 0];
    /// KEYBYTEORDER, DATABYTEORDER, KEY_TYPEOF concat, DATA_INTERVAL = 0.
    pub(super) const CONCAT_VERDICT_MAP: [u8; 28] =
        [0, 4, 0, 0, 0, 0, 1, 4, 0, 0, 0, 0, 3, 8, 0, 4, 0x0d, 0, 0, 0, 1, 0, 6, 4, 0, 0, 0, 0];
    /// `typeof numgen random mod 1 : ip daddr . th dport`
    pub(super) const NUMGEN_TO_IP_DPORT: &str = "000401000000010400000000031a0004170000000112000401000000010401000000020400000000043400040d000000012c0014000407000000010c00040c00000001040c0000000114000407000000010c00040b000000010402000000060400000000";
    /// `typeof numgen random mod 1 : ip6 daddr . th dport`
    pub(super) const NUMGEN_TO_IP6_DPORT: &str = "000401000000010400000000031a0004170000000112000401000000010401000000020400000000043400040d000000012c0014000407000000010c00040d0000000104090000000114000407000000010c00040b000000010402000000060400000000";
    /// `typeof ip daddr . meta l4proto . th dport . numgen random mod 1 : ip daddr . th dport`
    /// (the modulus is set by [`super::numgen_modulus`])
    pub(super) const SERVICE_INDEX_TO_IP_DPORT: &str = "000400000000010400000000036000040d00000001580014000407000000010c00040c00000001040c000000010e00040900000001060004100000000214000407000000010c00040b000000010402000000031a0004170000000112000401000000010401000000020400000000043400040d000000012c0014000407000000010c00040c00000001040c0000000114000407000000010c00040b000000010402000000060400000000";
    /// `typeof ip6 daddr . meta l4proto . th dport . numgen random mod 1 : ip6 daddr . th dport`
    pub(super) const SERVICE_INDEX_TO_IP6_DPORT: &str = "000400000000010400000000036000040d00000001580014000407000000010c00040d000000010409000000010e00040900000001060004100000000214000407000000010c00040b000000010402000000031a0004170000000112000401000000010401000000020400000000043400040d000000012c0014000407000000010c00040d0000000104090000000114000407000000010c00040b000000010402000000060400000000";
    /// `typeof meta l4proto . th dport . numgen random mod 1 : ip daddr . th dport`
    pub(super) const NODEPORT_INDEX_TO_IP_DPORT: &str = "000400000000010400000000034a00040d0000000142000e00040900000001060004100000000114000407000000010c00040b000000010402000000021a0004170000000112000401000000010401000000020400000000043400040d000000012c0014000407000000010c00040c00000001040c0000000114000407000000010c00040b000000010402000000060400000000";
    /// `typeof meta l4proto . th dport . numgen random mod 1 : ip6 daddr . th dport`
    pub(super) const NODEPORT_INDEX_TO_IP6_DPORT: &str = "000400000000010400000000034a00040d0000000142000e00040900000001060004100000000114000407000000010c00040b000000010402000000021a0004170000000112000401000000010401000000020400000000043400040d000000012c0014000407000000010c00040d0000000104090000000114000407000000010c00040b000000010402000000060400000000";
    /// `typeof ip saddr . numgen inc mod 1`
    pub(super) const IP_SLOT: &str = "000400000000033a00040d00000001320014000407000000010c00040c00000001040b000000011a0004170000000112000400000000010401000000020400000000";
    /// `typeof ip6 saddr . numgen inc mod 1`
    pub(super) const IP6_SLOT: &str = "000400000000033a00040d00000001320014000407000000010c00040d000000010408000000011a0004170000000112000400000000010401000000020400000000";
    /// `typeof numgen random mod 1`
    pub(super) const NUMGEN: &str = "000401000000031a0004170000000112000401000000010401000000020400000000";
    /// `typeof numgen inc mod 1 : ip daddr . th dport`
    pub(super) const NUMGEN_INC_TO_IP_DPORT: &str = "000401000000010400000000031a0004170000000112000400000000010401000000020400000000043400040d000000012c0014000407000000010c00040c00000001040c0000000114000407000000010c00040b000000010402000000060400000000";
    /// `typeof numgen inc mod 1 : ip6 daddr . th dport`
    pub(super) const NUMGEN_INC_TO_IP6_DPORT: &str = "000401000000010400000000031a0004170000000112000400000000010401000000020400000000043400040d000000012c0014000407000000010c00040d0000000104090000000114000407000000010c00040b000000010402000000060400000000";
}

/// The numgen expression in a `typeof` key, as nft writes it: expression id 0x17 (numgen),
/// then its own userdata — type (1: random), modulus, offset, each a host-order u32.
const NUMGEN_TYPEOF: [u8; 14] = [0, 4, 0x17, 0, 0, 0, 1, 18, 0, 4, 1, 0, 0, 0];

/// `udata` with the modulus of its `numgen random` typeof set to `modulus`, so that nft prints
/// the map's key as the rule that reads it computes it (`numgen random mod N`).
fn numgen_modulus(mut udata: Vec<u8>, modulus: u32) -> Vec<u8> {
    let at = udata.windows(NUMGEN_TYPEOF.len()).position(|w| w == NUMGEN_TYPEOF);
    // The modulus attribute (type 1, length 4) follows the type attribute.
    if let Some(value) = at.map(|at| at + NUMGEN_TYPEOF.len() + 2)
        && let Some(bytes) = udata.get_mut(value..value + 4)
    {
        bytes.copy_from_slice(&modulus.to_ne_bytes());
    }
    udata
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).filter_map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// Element comments, one allocation per distinct text (a service port's elements share one, and
/// one `Arc<str>`: found by pointer first, as a set of one service holds a comment or two).
#[derive(Default)]
struct Comments(Vec<(Arc<str>, Arc<[u8]>)>);

impl Comments {
    fn get(&mut self, comment: Option<&Arc<str>>) -> Option<Arc<[u8]>> {
        let c = comment?;
        let known = self.0.iter().find(|(text, _)| Arc::ptr_eq(text, c) || **text == **c);
        if let Some((_, blob)) = known {
            return Some(blob.clone());
        }
        let blob: Arc<[u8]> = Arc::from(udata::comment(c));
        self.0.push((c.clone(), blob.clone()));
        Some(blob)
    }
}

/// Lowers one set and its elements.
pub fn lower_set(set: &Set) -> WireSet {
    WireSet {
        name: set.name.clone(),
        spec: WireSetSpec {
            size: set.size,
            ..set_spec(set.shape, set.timeout_secs, set.comment.as_deref(), set.counter)
        },
        elements: lower_elements(set.shape, &set.elements),
        dynamic: set.shape.is_dynamic(),
        owner: set.owner.clone(),
    }
}

/// Lowers the elements of a set of this shape: keys as the kernel orders them, interval sets as
/// start and end elements.
pub fn lower_elements(shape: SetShape, set: &BTreeMap<Vec<Value>, Element>) -> SetElements {
    // Keys are unique but for prefixes with the same start (the later one wins). Ranges are two
    // elements each; exact keys one (the endpoint maps of a large cluster hold hundreds of
    // thousands).
    let mut elements = Vec::with_capacity(if shape.is_interval() { 2 * set.len() } else { set.len() });
    let mut comments = Comments::default();
    match shape {
        SetShape::AffinityClients(_) => {}
        SetShape::Prefixes(fam) => {
            let unique: BTreeMap<WireKey, WireElement> =
                interval_elements(fam, set, &mut comments).into_iter().collect();
            elements.extend(unique);
        }
        SetShape::EndpointTargets(_) | SetShape::SlotWindows => {
            for (key, element) in set {
                // Big-endian keys: the rule converts the numgen result before the lookup.
                let Some(Value::IndexRange(lo, hi)) = key.first() else { continue };
                elements.push((WireKey::new(&lo.to_be_bytes()), lower_element(element, &mut comments)));
                if let Some(end) = hi.checked_add(1) {
                    let end_element =
                        WireElement { data: WireData::None, userdata: None, owner: element.owner.clone() };
                    elements.push((WireKey::end(&end.to_be_bytes()), end_element));
                }
            }
        }
        SetShape::Addresses(_)
        | SetShape::AddressPairs(_)
        | SetShape::ServiceVerdicts(_)
        | SetShape::PortVerdicts
        | SetShape::ServiceKeys(_)
        | SetShape::PortKeys
        | SetShape::ServiceEndpoints(..)
        | SetShape::NodeportEndpoints(..)
        | SetShape::SlotTargets(_) => {
            for (key, element) in set {
                let key = WireKey { bytes: concat_bytes(key), interval_end: false };
                elements.push((key, lower_element(element, &mut comments)));
            }
        }
    }
    SetElements::from_vec(elements)
}

/// One element's data and comment.
fn lower_element(element: &Element, comments: &mut Comments) -> WireElement {
    let data = match &element.data {
        ElementData::None => WireData::None,
        ElementData::Verdict(v) => {
            let (code, chain) = verdict_code(v);
            WireData::Verdict { code, chain }
        }
        ElementData::Values(values) => WireData::Bytes(concat_bytes(values)),
    };
    WireElement { data, userdata: comments.get(element.comment.as_ref()), owner: element.owner.clone() }
}

/// Interval sets as nft encodes them for the kernel's rbtree: each range becomes a start element
/// and an end element one past its last address (flagged `INTERVAL_END`), and a leading end
/// element at the zero address opens the tree when the first range starts above it.
fn interval_elements(
    family: IpFamily,
    set: &BTreeMap<Vec<Value>, Element>,
    comments: &mut Comments,
) -> Vec<(WireKey, WireElement)> {
    let mut ranges: Vec<(u128, u128, &Element)> = set
        .iter()
        .filter_map(|(key, element)| match key.first() {
            Some(Value::Prefix(net)) => Some((net, element)),
            _ => None,
        })
        .map(|(net, element)| {
            let (start, end) = match net {
                IpNet::V4(n) => (u128::from(u32::from(n.network())), u128::from(u32::from(n.broadcast()))),
                IpNet::V6(n) => (u128::from(n.network()), u128::from(n.broadcast())),
            };
            (start, end, element)
        })
        .collect();
    ranges.sort_by_key(|r| r.0);
    let max = match family {
        IpFamily::V4 => u128::from(u32::MAX),
        IpFamily::V6 => u128::MAX,
    };
    let to_bytes = |v: u128| -> Vec<u8> {
        match family {
            IpFamily::V4 => u32::try_from(v).unwrap_or(u32::MAX).to_be_bytes().to_vec(),
            IpFamily::V6 => v.to_be_bytes().to_vec(),
        }
    };
    let infra = |owner: &Owner| WireElement { data: WireData::None, userdata: None, owner: owner.clone() };
    let mut out = Vec::new();
    // The leading end element belongs to whoever owns the first range (the whole set has one
    // owner: the infrastructure, or the service port of a source-ranges set).
    if let Some((start, _, first)) = ranges.first()
        && *start != 0
    {
        out.push((WireKey::end(&to_bytes(0)), infra(&first.owner)));
    }
    for (start, end, element) in ranges {
        out.push((WireKey::new(&to_bytes(start)), lower_element(element, comments)));
        if end < max {
            out.push((WireKey::end(&to_bytes(end + 1)), infra(&element.owner)));
        }
    }
    out
}

/// Encodes a key the way elements of `shape` are keyed (used to address single elements).
pub fn encode_key(values: &[Value]) -> Bytes {
    concat_bytes(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::L4Proto;

    fn owner() -> Owner {
        Owner::infrastructure()
    }

    #[test]
    fn concatenated_keys_pad_each_field() {
        let key =
            encode_key(&[Value::Addr("172.30.0.41".parse().unwrap()), Value::Proto(L4Proto::Tcp), Value::Port(80)]);
        assert_eq!(key.as_slice(), [172, 30, 0, 41, 6, 0, 0, 0, 0, 80, 0, 0]);
    }

    #[test]
    fn service_map_spec_matches_nft() {
        let spec = set_spec(SetShape::ServiceVerdicts(IpFamily::V4), None, None, false);
        assert_eq!(spec.key_type, 0x730d);
        assert_eq!(spec.key_len, 12);
        assert_eq!(spec.data_type, Some(DATA_VERDICT));
        let v6 = set_spec(SetShape::ServiceVerdicts(IpFamily::V6), None, None, false);
        assert_eq!(v6.key_type, 0x830d);
        assert_eq!(v6.key_len, 24);
        let targets = set_spec(SetShape::EndpointTargets(IpFamily::V4), None, None, false);
        assert_eq!((targets.data_type, targets.data_len), (Some(0x1cd), 8));
        assert_eq!(targets.userdata.as_ref().map(Vec::len), Some(100));
    }

    /// The `typeof` of a balancing map is the key its rule looks up, `numgen random mod N`
    /// included: only the modulus differs between the maps of two counts.
    #[test]
    fn a_balancing_map_declares_the_modulus_of_its_rule() {
        for (three, one) in [
            (SetShape::ServiceEndpoints(IpFamily::V4, 3), SetShape::ServiceEndpoints(IpFamily::V4, 1)),
            (SetShape::NodeportEndpoints(IpFamily::V6, 3), SetShape::NodeportEndpoints(IpFamily::V6, 1)),
        ] {
            let ud = |shape| set_spec(shape, None, None, false).userdata.unwrap();
            let (three, one) = (ud(three), ud(one));
            let at = three.windows(NUMGEN_TYPEOF.len()).position(|w| w == NUMGEN_TYPEOF).unwrap() + NUMGEN_TYPEOF.len();
            assert_eq!(three[at..at + 2], [1, 4], "the modulus attribute follows the type");
            assert_eq!(three[at + 2..at + 6], 3u32.to_ne_bytes());
            assert_eq!(one[at + 2..at + 6], 1u32.to_ne_bytes());
            assert_eq!(three.iter().zip(&one).filter(|(a, b)| a != b).count(), 1);
        }
    }

    #[test]
    fn set_comment_follows_the_shape_udata() {
        let spec = set_spec(SetShape::Addresses(IpFamily::V4), None, Some("Active ClusterIPs"), false);
        let expected = hex("000402000000071241637469766520436c757374657249507300");
        assert_eq!(spec.userdata, Some(expected));
    }

    #[test]
    fn prefixes_match_what_nft_emits() {
        let rule = Rule::new(vec![Stmt::Cmp {
            sel: Selector::Saddr(IpFamily::V4),
            op: CmpOp::Ne,
            value: Value::Prefix("10.96.0.0/12".parse().unwrap()),
        }]);
        let exprs = lower_rule(&rule).exprs;
        assert_eq!(exprs.len(), 3);
        assert!(matches!(&exprs[1], LowExpr::Bitwise { mask, .. } if mask == &vec![255, 240, 0, 0]));
        let aligned = Rule::new(vec![Stmt::Cmp {
            sel: Selector::Saddr(IpFamily::V4),
            op: CmpOp::Ne,
            value: Value::Prefix("10.244.0.0/16".parse().unwrap()),
        }]);
        let exprs = lower_rule(&aligned).exprs;
        assert_eq!(exprs[0], LowExpr::Payload { base: PayloadBase::Network, offset: 12, len: 2, dreg: 1 });
        assert_eq!(exprs[1], LowExpr::Cmp { sreg: 1, op: CMP_NEQ, data: vec![10, 244] });
    }

    #[test]
    fn service_dispatch_loads_three_registers() {
        let rule = Rule::new(vec![Stmt::Vmap {
            key: vec![Selector::Daddr(IpFamily::V6), Selector::L4Proto, Selector::Dport],
            map: "service-ips".into(),
        }]);
        let regs: Vec<u32> = lower_rule(&rule)
            .exprs
            .iter()
            .filter_map(|e| match e {
                LowExpr::Payload { dreg, .. } | LowExpr::Meta { dreg, .. } => Some(*dreg),
                _ => None,
            })
            .collect();
        // ip6 daddr fills words 0-3, so l4proto lands at word 4 (`reg 2`) and dport at word 5.
        assert_eq!(regs, vec![1, 2, 13]);
    }

    /// A sticky rule loads the client, its slot and the target key once; every lookup and the
    /// update read them where they are, also after `meta l4proto` took `reg 1`'s first word.
    #[test]
    fn affinity_rules_read_what_the_registers_hold() {
        let sticky = |family, slot, key| {
            let l4proto = Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(L4Proto::Tcp) };
            lower_rule(&Rule::new(vec![
                Stmt::SlotLookup { family, slot, set: "affinity-clients-0".into() },
                Stmt::KeyLookup { key, set: "affinity-targets-0".into() },
                Stmt::UpdateSlot { family, slot, set: "affinity-clients-0".into(), timeout_secs: 10 },
                l4proto,
                Stmt::DnatKeyMap { family, key, map: "affinity-targets-0".into() },
            ]))
            .exprs
        };
        let lookups = |exprs: &[LowExpr]| -> Vec<u32> {
            exprs
                .iter()
                .filter_map(|e| match e {
                    LowExpr::Lookup { sreg, .. } => Some(*sreg),
                    LowExpr::Dynset { sreg_key, .. } => Some(*sreg_key),
                    _ => None,
                })
                .collect()
        };
        // The slot is the key: the client in word 0, the slot in word 1 (`NFT_REG32_01`).
        let same = sticky(IpFamily::V4, 7, 7);
        assert_eq!(same.len(), 9, "{same:#?}");
        assert_eq!(lookups(&same), vec![REG_1, REG32_00 + 1, REG_1, REG32_00 + 1]);
        // Another key goes past the client and its slot (word 2), loaded once.
        let other = sticky(IpFamily::V4, 7, 300);
        assert_eq!(other.len(), 10, "{other:#?}");
        assert_eq!(lookups(&other), vec![REG_1, REG32_00 + 2, REG_1, REG32_00 + 2]);
        // IPv6: the address fills words 0-3, the slot word 4 (`reg 2`), another key word 5.
        let v6 = sticky(IpFamily::V6, 7, 300);
        assert_eq!(v6.len(), 10, "{v6:#?}");
        assert_eq!(lookups(&v6), vec![REG_1, REG32_00 + 5, REG_1, REG32_00 + 5]);

        // A record rule: the slot goes after the address the hash read (word 4 on), over the
        // port.
        let record = lower_rule(&Rule::new(vec![
            Stmt::HashLookup {
                family: IpFamily::V4,
                hash: Jhash { modulus: 4, seed: 1, offset: 8 },
                set: "affinity-windows-0".into(),
            },
            Stmt::UpdateSlot { family: IpFamily::V4, slot: 7, set: "affinity-clients-0".into(), timeout_secs: 10 },
        ]))
        .exprs;
        assert_eq!(record.len(), 7, "{record:#?}");
        assert_eq!(lookups(&record), vec![REG_1, REG_1 + 1]);
        assert_eq!(record[5], numgen_key(REG32_00 + 5, 7));
    }

    #[test]
    fn interval_sets_encode_rbtree_ranges() {
        let mut set = Set::new("cidrs", SetShape::Prefixes(IpFamily::V4), owner());
        for p in ["10.244.0.0/16", "192.168.0.0/16"] {
            set.insert(vec![Value::Prefix(p.parse().unwrap())], Element::key_only(owner()));
        }
        let wire = lower_set(&set);
        let keys: Vec<(Vec<u8>, bool)> = wire.elements.keys().map(|k| (k.bytes.to_vec(), k.interval_end)).collect();
        assert_eq!(
            keys,
            vec![
                (vec![0, 0, 0, 0], true),
                (vec![10, 244, 0, 0], false),
                (vec![10, 245, 0, 0], true),
                (vec![192, 168, 0, 0], false),
                (vec![192, 169, 0, 0], true),
            ]
        );
    }
}
