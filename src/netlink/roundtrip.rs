//! Every statement of the rule AST survives libnftnl, without a kernel or root: each sample is
//! lowered, encoded into a batch exactly as a sync sends it, every `NEWRULE` message of the
//! batch is parsed back by libnftnl (as a dump's answer is) and decoded, and the decoded rule
//! must equal the lowered one.
//!
//! The samples cannot fall behind the AST: [`stmt_kind`] matches every [`Stmt`] variant, so a
//! new variant is a compile error until it has a [`StmtKind`], and [`samples`] matches every
//! `StmtKind`, so that kind is a compile error until it has samples. The test then checks that
//! the samples, taken together, reach every selector, value shape, comparison, `fib` address,
//! verdict, family and kernel expression ([`LowExpr`]) the AST and the wire form know: the
//! classifiers below match those enums exhaustively too.
//!
//! What the kernel itself does to a rule is not checked here (that stays with the root-only
//! tests in `integration/netlink.rs`): it echoes NAT flags it derives from the registers (which
//! `decode` drops again) and never echoes a set id (which `decode` ignores: rules name their sets).
//! libnftnl's parser reads the attributes a kernel dump carries, so every rule attribute nftproxy
//! writes and reads is checked; every statement round-trips, none needed an exception.

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::decode;
use super::decode::decode_rule;
use super::encode::{encode, encode_expr};
use super::error::NetlinkError;
use super::sys::{self as raw, Body, each_message, msg};
use crate::net::{IpFamily, L4Proto};
use crate::nft::ast::*;
use crate::nft::diff::{Op, OpKind, Transaction};
use crate::nft::lower::{lower_rule, set_spec};
use crate::nft::wire::{LowExpr, PayloadBase, WireRule};

use nftnl_sys as sys;

/// `NFNL_SUBSYS_NFTABLES`, the high byte of every nf_tables message type.
const SUBSYS_NFTABLES: u16 = 10;
const TABLE: &str = "nftproxy";
const CHAIN: &str = "roundtrip";

/// A fieldless mirror of an enum, with the list of all its variants (complete by construction).
macro_rules! kinds {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
        enum $name { $($(#[$vdoc])* $variant),* }

        impl $name {
            const ALL: &'static [$name] = &[$($name::$variant),*];
        }
    };
}

kinds!(
    /// One per [`Stmt`] variant.
    StmtKind {
        Cmp,
        MarkBitsEq,
        CtStateNew,
        CtStatusDnat,
        FibLocal,
        FibNotLocal,
        Lookup,
        Vmap,
        MarkOr,
        MarkXor,
        SlotLookup,
        UpdateSlot,
        KeyLookup,
        Masquerade,
        Reject,
        Dnat,
        DnatNumgenMap,
        DnatBalanceMap,
        HashLookup,
        DnatHashMap,
        DnatKeyMap,
        Verdict,
    }
);

kinds!(
    /// Each [`Selector`], per family where it has one.
    SelectorKind { SaddrV4, SaddrV6, DaddrV4, DaddrV6, L4Proto, Dport, Mark, Iifname }
);

kinds!(
    /// Each [`Value`], split where lowering takes different paths (prefix lengths, interface
    /// name prefixes).
    ValueKind {
        AddrV4,
        AddrV6,
        /// Shorter than the address, whole bytes: a shortened load.
        PrefixBytes,
        /// Not byte-aligned: a load and a mask.
        PrefixBits,
        /// As long as the address: compared as an address.
        PrefixFull,
        Proto,
        Port,
        IndexRange,
        Index,
        Ifname,
        /// `veth*`: compared on its prefix only.
        IfnamePrefix,
    }
);

kinds!(
    /// Each [`CmpOp`].
    CmpOpKind { Eq, Ne }
);

kinds!(
    /// Each [`FibAddr`].
    FibAddrKind { Saddr, Daddr }
);

kinds!(
    /// Each [`Verdict`].
    VerdictKind { Accept, Drop, Return, Jump, Goto }
);

kinds!(
    /// Each [`IpFamily`].
    FamilyKind { V4, V6 }
);

kinds!(
    /// Each [`LowExpr`] variant.
    ExprKind {
        Payload,
        Meta,
        MetaSet,
        Cmp,
        Bitwise,
        Lookup,
        Verdict,
        Immediate,
        Numgen,
        Hash,
        Byteorder,
        Fib,
        Ct,
        Dynset,
        Nat,
        Masq,
        Reject,
        Foreign,
    }
);

kinds!(
    /// Each [`PayloadBase`].
    PayloadBaseKind { Link, Network, Transport }
);

fn stmt_kind(stmt: &Stmt) -> StmtKind {
    match stmt {
        Stmt::Cmp { .. } => StmtKind::Cmp,
        Stmt::MarkBitsEq { .. } => StmtKind::MarkBitsEq,
        Stmt::CtStateNew => StmtKind::CtStateNew,
        Stmt::CtStatusDnat => StmtKind::CtStatusDnat,
        Stmt::FibLocal(_) => StmtKind::FibLocal,
        Stmt::FibNotLocal(_) => StmtKind::FibNotLocal,
        Stmt::Lookup { .. } => StmtKind::Lookup,
        Stmt::Vmap { .. } => StmtKind::Vmap,
        Stmt::MarkOr(_) => StmtKind::MarkOr,
        Stmt::MarkXor(_) => StmtKind::MarkXor,
        Stmt::SlotLookup { .. } => StmtKind::SlotLookup,
        Stmt::UpdateSlot { .. } => StmtKind::UpdateSlot,
        Stmt::KeyLookup { .. } => StmtKind::KeyLookup,
        Stmt::Masquerade { .. } => StmtKind::Masquerade,
        Stmt::Reject(_) => StmtKind::Reject,
        Stmt::Dnat { .. } => StmtKind::Dnat,
        Stmt::DnatNumgenMap { .. } => StmtKind::DnatNumgenMap,
        Stmt::DnatBalanceMap { .. } => StmtKind::DnatBalanceMap,
        Stmt::HashLookup { .. } => StmtKind::HashLookup,
        Stmt::DnatHashMap { .. } => StmtKind::DnatHashMap,
        Stmt::DnatKeyMap { .. } => StmtKind::DnatKeyMap,
        Stmt::Verdict(_) => StmtKind::Verdict,
    }
}

fn selector_kind(sel: Selector) -> SelectorKind {
    match sel {
        Selector::Saddr(IpFamily::V4) => SelectorKind::SaddrV4,
        Selector::Saddr(IpFamily::V6) => SelectorKind::SaddrV6,
        Selector::Daddr(IpFamily::V4) => SelectorKind::DaddrV4,
        Selector::Daddr(IpFamily::V6) => SelectorKind::DaddrV6,
        Selector::L4Proto => SelectorKind::L4Proto,
        Selector::Dport => SelectorKind::Dport,
        Selector::Mark => SelectorKind::Mark,
        Selector::Iifname => SelectorKind::Iifname,
    }
}

fn value_kind(value: &Value) -> ValueKind {
    match value {
        Value::Addr(IpAddr::V4(_)) => ValueKind::AddrV4,
        Value::Addr(IpAddr::V6(_)) => ValueKind::AddrV6,
        Value::Prefix(net) if net.prefix_len() == net.max_prefix_len() => ValueKind::PrefixFull,
        Value::Prefix(net) if net.prefix_len() % 8 == 0 => ValueKind::PrefixBytes,
        Value::Prefix(_) => ValueKind::PrefixBits,
        Value::Proto(_) => ValueKind::Proto,
        Value::Port(_) => ValueKind::Port,
        Value::IndexRange(..) => ValueKind::IndexRange,
        Value::Index(_) => ValueKind::Index,
        Value::Ifname(name) if name.ends_with('*') => ValueKind::IfnamePrefix,
        Value::Ifname(_) => ValueKind::Ifname,
    }
}

fn cmp_op_kind(op: CmpOp) -> CmpOpKind {
    match op {
        CmpOp::Eq => CmpOpKind::Eq,
        CmpOp::Ne => CmpOpKind::Ne,
    }
}

fn fib_addr_kind(addr: FibAddr) -> FibAddrKind {
    match addr {
        FibAddr::Saddr => FibAddrKind::Saddr,
        FibAddr::Daddr => FibAddrKind::Daddr,
    }
}

fn verdict_kind(verdict: &Verdict) -> VerdictKind {
    match verdict {
        Verdict::Accept => VerdictKind::Accept,
        Verdict::Drop => VerdictKind::Drop,
        Verdict::Return => VerdictKind::Return,
        Verdict::Jump(_) => VerdictKind::Jump,
        Verdict::Goto(_) => VerdictKind::Goto,
    }
}

fn family_kind(family: IpFamily) -> FamilyKind {
    match family {
        IpFamily::V4 => FamilyKind::V4,
        IpFamily::V6 => FamilyKind::V6,
    }
}

fn expr_kind(expr: &LowExpr) -> ExprKind {
    match expr {
        LowExpr::Payload { .. } => ExprKind::Payload,
        LowExpr::Meta { .. } => ExprKind::Meta,
        LowExpr::MetaSet { .. } => ExprKind::MetaSet,
        LowExpr::Cmp { .. } => ExprKind::Cmp,
        LowExpr::Bitwise { .. } => ExprKind::Bitwise,
        LowExpr::Lookup { .. } => ExprKind::Lookup,
        LowExpr::Verdict { .. } => ExprKind::Verdict,
        LowExpr::Immediate { .. } => ExprKind::Immediate,
        LowExpr::Numgen { .. } => ExprKind::Numgen,
        LowExpr::Hash { .. } => ExprKind::Hash,
        LowExpr::Byteorder { .. } => ExprKind::Byteorder,
        LowExpr::Fib { .. } => ExprKind::Fib,
        LowExpr::Ct { .. } => ExprKind::Ct,
        LowExpr::Dynset { .. } => ExprKind::Dynset,
        LowExpr::Nat { .. } => ExprKind::Nat,
        LowExpr::Masq { .. } => ExprKind::Masq,
        LowExpr::Reject { .. } => ExprKind::Reject,
        LowExpr::Foreign(_) => ExprKind::Foreign,
    }
}

fn payload_base_kind(base: PayloadBase) -> PayloadBaseKind {
    match base {
        PayloadBase::Link => PayloadBaseKind::Link,
        PayloadBase::Network => PayloadBaseKind::Network,
        PayloadBase::Transport => PayloadBaseKind::Transport,
    }
}

fn addr(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn cmp(sel: Selector, op: CmpOp, value: Value) -> Stmt {
    Stmt::Cmp { sel, op, value }
}

/// Statements of one kind: every path its lowering can take (families, options, offsets of 0,
/// which libnftnl leaves out, and others).
fn samples(kind: StmtKind) -> Vec<Stmt> {
    use IpFamily::{V4, V6};
    let prefix = |s: &str| Value::Prefix(s.parse().unwrap());
    let hash = |offset| Jhash { modulus: 1 << 20, seed: 0x5eed_1234, offset };
    match kind {
        StmtKind::Cmp => vec![
            cmp(Selector::Saddr(V4), CmpOp::Ne, prefix("10.0.0.0/8")),
            cmp(Selector::Saddr(V4), CmpOp::Eq, prefix("10.96.0.0/12")),
            cmp(Selector::Daddr(V4), CmpOp::Eq, prefix("10.96.0.10/32")),
            cmp(Selector::Daddr(V4), CmpOp::Eq, Value::Addr(addr("10.96.0.10"))),
            cmp(Selector::Saddr(V6), CmpOp::Ne, prefix("fd00:10::/64")),
            cmp(Selector::Saddr(V6), CmpOp::Eq, prefix("fd00:10::/60")),
            cmp(Selector::Daddr(V6), CmpOp::Eq, Value::Addr(addr("fd00::10"))),
            cmp(Selector::Daddr(V6), CmpOp::Ne, prefix("fd00::10/128")),
            cmp(Selector::L4Proto, CmpOp::Eq, Value::Proto(L4Proto::Tcp)),
            cmp(Selector::L4Proto, CmpOp::Ne, Value::Proto(L4Proto::Udp)),
            cmp(Selector::L4Proto, CmpOp::Eq, Value::Proto(L4Proto::Sctp)),
            cmp(Selector::Dport, CmpOp::Eq, Value::Port(30080)),
            cmp(Selector::Mark, CmpOp::Eq, Value::Index(0x4000)),
            cmp(Selector::Mark, CmpOp::Ne, Value::IndexRange(0x8000, 0x8fff)),
            cmp(Selector::Iifname, CmpOp::Eq, Value::Ifname("eth0".into())),
            cmp(Selector::Iifname, CmpOp::Ne, Value::Ifname("veth*".into())),
        ],
        StmtKind::MarkBitsEq => vec![Stmt::MarkBitsEq { mask: 0x4000, value: 0 }],
        StmtKind::CtStateNew => vec![Stmt::CtStateNew],
        StmtKind::CtStatusDnat => vec![Stmt::CtStatusDnat],
        StmtKind::FibLocal => vec![Stmt::FibLocal(FibAddr::Daddr), Stmt::FibLocal(FibAddr::Saddr)],
        StmtKind::FibNotLocal => vec![Stmt::FibNotLocal(FibAddr::Daddr), Stmt::FibNotLocal(FibAddr::Saddr)],
        StmtKind::Lookup => vec![
            Stmt::Lookup { key: vec![Selector::Daddr(V4)], set: "cluster-ips".into(), negate: false },
            Stmt::Lookup {
                key: vec![Selector::Saddr(V6), Selector::Daddr(V6)],
                set: "old-source-ranges".into(),
                negate: true,
            },
        ],
        StmtKind::Vmap => vec![
            Stmt::Vmap {
                key: vec![Selector::Daddr(V4), Selector::L4Proto, Selector::Dport],
                map: "service-ips".into(),
            },
            Stmt::Vmap {
                key: vec![Selector::Daddr(V6), Selector::L4Proto, Selector::Dport],
                map: "service-ips".into(),
            },
            Stmt::Vmap { key: vec![Selector::L4Proto, Selector::Dport], map: "service-nodeports".into() },
        ],
        StmtKind::MarkOr => vec![Stmt::MarkOr(0x4000)],
        StmtKind::MarkXor => vec![Stmt::MarkXor(0x4000)],
        StmtKind::SlotLookup => vec![
            Stmt::SlotLookup { family: V4, slot: 0, set: "affinity-clients".into() },
            Stmt::SlotLookup { family: V6, slot: 3, set: "affinity-clients".into() },
        ],
        StmtKind::UpdateSlot => vec![
            Stmt::UpdateSlot { family: V4, slot: 0, set: "affinity-clients".into(), timeout_secs: 10800 },
            Stmt::UpdateSlot { family: V6, slot: 3, set: "affinity-clients".into(), timeout_secs: 60 },
        ],
        StmtKind::KeyLookup => vec![
            Stmt::KeyLookup { key: 0, set: "slot-targets".into() },
            Stmt::KeyLookup { key: 7, set: "slot-targets".into() },
        ],
        StmtKind::Masquerade => vec![Stmt::Masquerade { fully_random: true }, Stmt::Masquerade { fully_random: false }],
        StmtKind::Reject => vec![Stmt::Reject(V4), Stmt::Reject(V6)],
        StmtKind::Dnat => vec![
            Stmt::Dnat { addr: addr("10.244.1.10"), port: 8080 },
            Stmt::Dnat { addr: addr("fd00:244::10"), port: 8443 },
        ],
        StmtKind::DnatNumgenMap => vec![
            Stmt::DnatNumgenMap { family: V4, modulus: 3, offset: 0, map: "endpoint-targets".into() },
            Stmt::DnatNumgenMap { family: V6, modulus: 1 << 20, offset: 5 << 20, map: "endpoint-targets".into() },
        ],
        StmtKind::DnatBalanceMap => vec![
            Stmt::DnatBalanceMap {
                family: V4,
                key: vec![Selector::Daddr(V4), Selector::L4Proto, Selector::Dport],
                modulus: 1 << 20,
                map: "service-endpoints".into(),
            },
            Stmt::DnatBalanceMap {
                family: V6,
                key: vec![Selector::L4Proto, Selector::Dport],
                modulus: 4,
                map: "nodeport-endpoints".into(),
            },
        ],
        StmtKind::HashLookup => vec![
            Stmt::HashLookup { family: V4, hash: hash(0), set: "slot-windows".into() },
            Stmt::HashLookup { family: V6, hash: hash(2 << 20), set: "slot-windows".into() },
        ],
        StmtKind::DnatHashMap => vec![
            Stmt::DnatHashMap { family: V4, proto: L4Proto::Tcp, hash: hash(0), map: "endpoint-targets".into() },
            Stmt::DnatHashMap { family: V6, proto: L4Proto::Udp, hash: hash(9), map: "endpoint-targets".into() },
        ],
        StmtKind::DnatKeyMap => vec![
            Stmt::DnatKeyMap { family: V4, key: 0, map: "slot-targets".into() },
            Stmt::DnatKeyMap { family: V6, key: 4, map: "slot-targets".into() },
        ],
        StmtKind::Verdict => vec![
            Stmt::Verdict(Verdict::Accept),
            Stmt::Verdict(Verdict::Drop),
            Stmt::Verdict(Verdict::Return),
            Stmt::Verdict(Verdict::Jump("services".into())),
            Stmt::Verdict(Verdict::Goto("svc-abcdef-default/web:http".into())),
        ],
    }
}

/// What a set of samples reaches.
#[derive(Debug, Default)]
struct Seen {
    stmts: BTreeSet<StmtKind>,
    /// The families of statements that have one, per statement kind.
    families: BTreeSet<(StmtKind, FamilyKind)>,
    selectors: BTreeSet<SelectorKind>,
    values: BTreeSet<ValueKind>,
    ops: BTreeSet<CmpOpKind>,
    fib_addrs: BTreeSet<FibAddrKind>,
    verdicts: BTreeSet<VerdictKind>,
    exprs: BTreeSet<ExprKind>,
    payload_bases: BTreeSet<PayloadBaseKind>,
}

impl Seen {
    fn stmt(&mut self, stmt: &Stmt) {
        let kind = stmt_kind(stmt);
        self.stmts.insert(kind);
        let family = match stmt {
            Stmt::Cmp { sel, op, value } => {
                self.selectors.insert(selector_kind(*sel));
                self.ops.insert(cmp_op_kind(*op));
                self.values.insert(value_kind(value));
                None
            }
            Stmt::MarkBitsEq { .. }
            | Stmt::CtStateNew
            | Stmt::CtStatusDnat
            | Stmt::MarkOr(_)
            | Stmt::MarkXor(_)
            | Stmt::KeyLookup { .. }
            | Stmt::Masquerade { .. } => None,
            Stmt::FibLocal(a) | Stmt::FibNotLocal(a) => {
                self.fib_addrs.insert(fib_addr_kind(*a));
                None
            }
            Stmt::Lookup { key, .. } | Stmt::Vmap { key, .. } => {
                self.selectors.extend(key.iter().map(|s| selector_kind(*s)));
                None
            }
            Stmt::DnatBalanceMap { family, key, .. } => {
                self.selectors.extend(key.iter().map(|s| selector_kind(*s)));
                Some(*family)
            }
            Stmt::SlotLookup { family, .. }
            | Stmt::UpdateSlot { family, .. }
            | Stmt::Reject(family)
            | Stmt::DnatNumgenMap { family, .. }
            | Stmt::HashLookup { family, .. }
            | Stmt::DnatHashMap { family, .. }
            | Stmt::DnatKeyMap { family, .. } => Some(*family),
            Stmt::Dnat { addr, .. } => Some(IpFamily::of(addr)),
            Stmt::Verdict(v) => {
                self.verdicts.insert(verdict_kind(v));
                None
            }
        };
        if let Some(f) = family {
            self.families.insert((kind, family_kind(f)));
        }
    }

    fn exprs(&mut self, exprs: &[LowExpr]) {
        for e in exprs {
            self.exprs.insert(expr_kind(e));
            if let LowExpr::Payload { base, .. } = e {
                self.payload_bases.insert(payload_base_kind(*base));
            }
        }
    }
}

/// Encodes `rules` into one batch, as a sync would (the table, the chain, the sets the rules
/// use but those named `old-…`, which stand for sets already in the kernel, so the rules name
/// them without a set id; then the rules), and decodes every rule of the batch back.
fn through_libnftnl(rules: &[WireRule]) -> Vec<WireRule> {
    let op = |kind| Op { family: IpFamily::V4, table: TABLE.into(), kind, owner: Owner::infrastructure() };
    let mut tx = Transaction::default();
    tx.ops.push(op(OpKind::AddTable { flags: 0, userdata: None }));
    tx.ops.push(op(OpKind::AddChain { chain: CHAIN.into(), hook: None, userdata: None }));
    let mut sets = BTreeSet::new();
    for e in rules.iter().flat_map(|r| &r.exprs) {
        if let LowExpr::Lookup { set, .. } | LowExpr::Dynset { set, .. } = e
            && !set.starts_with("old-")
            && sets.insert(set.clone())
        {
            let spec = set_spec(SetShape::Addresses(IpFamily::V4), None, None, false);
            tx.ops.push(op(OpKind::AddSet { set: set.clone(), spec }));
        }
    }
    for rule in rules {
        tx.ops.push(op(OpKind::AddRule { chain: CHAIN.into(), rule: rule.clone() }));
    }
    let batch = encode(&tx).expect("the batch encodes");
    let mut decoded = Vec::new();
    for page in batch.batch.iter() {
        each_message(page, |kind, message| {
            if kind != (SUBSYS_NFTABLES << 8) | msg::NEWRULE {
                return;
            }
            let rule = message.rule().expect("libnftnl parses the rule message");
            assert_eq!(rule.get_str(decode::a(sys::NFTNL_RULE_TABLE)).as_deref(), Some(TABLE));
            assert_eq!(rule.get_str(decode::a(sys::NFTNL_RULE_CHAIN)).as_deref(), Some(CHAIN));
            decoded.push(decode_rule(&rule));
        });
    }
    decoded
}

#[test]
fn every_statement_survives_libnftnl() {
    let mut seen = Seen::default();
    let mut stmts = Vec::new();
    for &kind in StmtKind::ALL {
        let of_kind = samples(kind);
        assert!(!of_kind.is_empty(), "no samples of {kind:?}");
        for stmt in of_kind {
            assert_eq!(stmt_kind(&stmt), kind, "{stmt:?} is listed as {kind:?}");
            seen.stmt(&stmt);
            stmts.push(stmt);
        }
    }
    // One rule per statement (half of them with a comment), then all of them in one rule.
    let mut rules: Vec<Rule> = stmts
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let rule = Rule::new(vec![s.clone()]);
            if i % 2 == 0 { rule.with_comment(format!("default/web:http #{i}")) } else { rule }
        })
        .collect();
    rules.push(Rule::new(stmts.clone()).with_comment("everything"));
    let mut lowered: Vec<WireRule> = rules.iter().map(lower_rule).collect();
    // Wire shapes no statement lowers to: a link-layer load.
    lowered.push(WireRule {
        exprs: vec![
            LowExpr::Payload { base: PayloadBase::Link, offset: 6, len: 6, dreg: 1 },
            LowExpr::Cmp { sreg: 1, op: 0, data: vec![2, 0, 0, 0, 0, 1] },
        ],
        userdata: None,
    });
    for rule in &lowered {
        seen.exprs(&rule.exprs);
    }

    assert_eq!(seen.stmts, StmtKind::ALL.iter().copied().collect(), "statement kinds without samples");
    let with_family: BTreeSet<StmtKind> = seen.families.iter().map(|(k, _)| *k).collect();
    for kind in with_family {
        for &f in FamilyKind::ALL {
            assert!(seen.families.contains(&(kind, f)), "no {f:?} sample of {kind:?}");
        }
    }
    assert_eq!(seen.selectors, SelectorKind::ALL.iter().copied().collect(), "selectors without samples");
    assert_eq!(seen.values, ValueKind::ALL.iter().copied().collect(), "values without samples");
    assert_eq!(seen.ops, CmpOpKind::ALL.iter().copied().collect(), "comparisons without samples");
    assert_eq!(seen.fib_addrs, FibAddrKind::ALL.iter().copied().collect(), "fib addresses without samples");
    assert_eq!(seen.verdicts, VerdictKind::ALL.iter().copied().collect(), "verdicts without samples");
    assert_eq!(seen.payload_bases, PayloadBaseKind::ALL.iter().copied().collect(), "payload bases without samples");
    // Every kernel expression but `Foreign`, which nftproxy never writes (see the next test).
    let written: BTreeSet<ExprKind> = ExprKind::ALL.iter().copied().filter(|k| *k != ExprKind::Foreign).collect();
    assert_eq!(seen.exprs, written, "kernel expressions no sample lowers to");

    let decoded = through_libnftnl(&lowered);
    assert_eq!(decoded.len(), lowered.len(), "rule messages in the batch");
    for (i, (want, got)) in lowered.iter().zip(&decoded).enumerate() {
        let what = rules.get(i).map_or_else(|| format!("wire rule {want:?}"), |r| format!("{:?}", r.stmts));
        assert_eq!(got, want, "{what} changed through libnftnl");
    }
}

/// An expression nftproxy does not write (someone else's, in our table) decodes as `Foreign`,
/// and is never encoded.
#[test]
fn foreign_expressions_decode_as_foreign_and_never_encode() -> Result<(), NetlinkError> {
    let mut rule = raw::Rule::new()?;
    rule.set_str(decode::a(sys::NFTNL_RULE_TABLE), TABLE)?;
    rule.set_str(decode::a(sys::NFTNL_RULE_CHAIN), CHAIN)?;
    rule.set_u32(decode::a(sys::NFTNL_RULE_FAMILY), 2);
    rule.add_expr(raw::Expr::new("counter")?);
    rule.add_expr(encode_expr(&LowExpr::Verdict { code: 1, chain: None }, |_| None)?);
    let bytes = raw::request(msg::NEWRULE, 2, 0, 1, Body::Rule(&rule));
    let mut decoded = Vec::new();
    each_message(&bytes, |_, message| decoded.extend(message.rule().map(|r| decode_rule(&r))));
    assert_eq!(
        decoded,
        vec![WireRule {
            exprs: vec![LowExpr::Foreign("counter".into()), LowExpr::Verdict { code: 1, chain: None }],
            userdata: None,
        }]
    );
    assert!(matches!(
        encode_expr(&LowExpr::Foreign("counter".into()), |_| None),
        Err(NetlinkError::ForeignExpression(name)) if name == "counter"
    ));
    Ok(())
}
