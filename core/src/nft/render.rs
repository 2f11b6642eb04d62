//! nft text for a [`Ruleset`], in the layout `nft list ruleset` (nft 1.0.x) prints.
//!
//! The output is valid `nft -f` input. Tests compare it with the kernel's listing after
//! [`super::canonical::canonicalize`], which only forgives what nft itself varies: the order of
//! chains and sets (creation order) and the order and wrapping of set elements (hash order).

use std::fmt::{self, Display, Write};
use std::net::IpAddr;

use super::ast::*;
use crate::net::IpFamily;

impl Display for Ruleset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for table in &self.tables {
            write!(f, "{table}")?;
        }
        Ok(())
    }
}

impl Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "table {} {} {{", family_keyword(self.family), self.name)?;
        if let Some(c) = &self.comment {
            writeln!(f, "\tcomment {}", quoted(c))?;
        }
        let mut first = true;
        for set in self.sets.values() {
            if !first {
                writeln!(f)?;
            }
            first = false;
            write_set(f, set)?;
        }
        for chain in self.chains.values() {
            if !first {
                writeln!(f)?;
            }
            first = false;
            write_chain(f, chain)?;
        }
        writeln!(f, "}}")
    }
}

/// nft's family keyword for a table of this IP family.
pub fn family_keyword(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

fn quoted(s: &str) -> String {
    format!("\"{s}\"")
}

fn write_set(f: &mut fmt::Formatter<'_>, set: &Set) -> fmt::Result {
    let keyword = if set.shape.is_map() { "map" } else { "set" };
    writeln!(f, "\t{keyword} {} {{", set.name)?;
    writeln!(f, "\t\t{}", shape_declaration(set.shape))?;
    if let SetShape::AffinityClients(_) = set.shape {
        // The kernel gives dynamic sets a default size, and nft lists it.
        writeln!(f, "\t\tsize {}", set.size.unwrap_or(DYNAMIC_SET_SIZE))?;
        writeln!(f, "\t\tflags dynamic,timeout")?;
    }
    if set.shape.is_interval() {
        writeln!(f, "\t\tflags interval")?;
    }
    if let Some(t) = set.timeout_secs {
        writeln!(f, "\t\ttimeout {}", duration(u64::from(t) * 1000))?;
    }
    if set.counter {
        writeln!(f, "\t\tcounter")?;
    }
    if let Some(c) = &set.comment {
        writeln!(f, "\t\tcomment {}", quoted(c))?;
    }
    if !set.elements.is_empty() {
        write!(f, "\t\telements = {{ ")?;
        for (i, (key, element)) in set.elements.iter().enumerate() {
            if i > 0 {
                write!(f, ",\n\t\t\t     ")?;
            }
            write!(f, "{}", counted_element_text(key, element, set.counter))?;
        }
        writeln!(f, " }}")?;
    }
    writeln!(f, "\t}}")
}

/// One element as nft prints it: `key [comment "…"] [: data]`.
pub fn element_text(key: &[Value], element: &Element) -> String {
    counted_element_text(key, element, false)
}

/// One element as nft prints it, with its counter (as created: zero) when the set has
/// `counter`: `key [counter packets 0 bytes 0] [comment "…"] [: data]`.
fn counted_element_text(key: &[Value], element: &Element, counter: bool) -> String {
    let mut s = concat_values(key);
    if counter {
        s.push_str(" counter packets 0 bytes 0");
    }
    if let Some(c) = &element.comment {
        let _ = write!(s, " comment {}", quoted(c));
    }
    match &element.data {
        ElementData::None => {}
        ElementData::Verdict(v) => {
            let _ = write!(s, " : {v}");
        }
        ElementData::Values(values) => {
            let _ = write!(s, " : {}", concat_values(values));
        }
    }
    s
}

fn concat_values(values: &[Value]) -> String {
    values.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(" . ")
}

/// The `type …` / `typeof …` line of a set of this shape.
pub fn shape_declaration(shape: SetShape) -> String {
    let addr = |fam: IpFamily| match fam {
        IpFamily::V4 => "ipv4_addr",
        IpFamily::V6 => "ipv6_addr",
    };
    match shape {
        SetShape::Addresses(fam) | SetShape::Prefixes(fam) => format!("type {}", addr(fam)),
        SetShape::AffinityClients(fam) => format!("typeof {} saddr . numgen inc mod 1", family_keyword(fam)),
        SetShape::AddressPairs(fam) => format!("type {0} . {0}", addr(fam)),
        SetShape::ServiceVerdicts(fam) => {
            format!("type {} . inet_proto . inet_service : verdict", addr(fam))
        }
        SetShape::PortVerdicts => "type inet_proto . inet_service : verdict".to_string(),
        SetShape::EndpointTargets(fam) => {
            format!("typeof numgen random mod 1 : {} daddr . th dport", family_keyword(fam))
        }
        SetShape::SlotWindows => "typeof numgen random mod 1".to_string(),
        SetShape::SlotTargets(fam) => {
            format!("typeof numgen inc mod 1 : {} daddr . th dport", family_keyword(fam))
        }
        SetShape::ServiceKeys(fam) => format!("type {} . inet_proto . inet_service", addr(fam)),
        SetShape::PortKeys => "type inet_proto . inet_service".to_string(),
        SetShape::ServiceEndpoints(fam, n) => {
            let ip = family_keyword(fam);
            format!("typeof {ip} daddr . meta l4proto . th dport . numgen random mod {n} : {ip} daddr . th dport")
        }
        SetShape::NodeportEndpoints(fam, n) => {
            format!("typeof meta l4proto . th dport . numgen random mod {n} : {} daddr . th dport", family_keyword(fam))
        }
    }
}

/// The `size` the kernel gives a dynamic set created without one.
pub const DYNAMIC_SET_SIZE: u32 = 65_535;

/// A duration in nft's notation (`3h`, `3h1s`, `500ms`).
pub fn duration(ms: u64) -> String {
    if ms == 0 {
        return "0s".to_string();
    }
    let mut out = String::new();
    let mut rest = ms;
    for (unit, len) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)] {
        let n = rest / len;
        if n > 0 {
            let _ = write!(out, "{n}{unit}");
            rest -= n * len;
        }
    }
    out
}

fn write_chain(f: &mut fmt::Formatter<'_>, chain: &Chain) -> fmt::Result {
    writeln!(f, "\tchain {} {{", chain.name)?;
    if let Some(c) = &chain.comment {
        writeln!(f, "\t\tcomment {}", quoted(c))?;
    }
    if let Some(base) = &chain.base {
        writeln!(
            f,
            "\t\ttype {} hook {} priority {}; policy accept;",
            base.chain_type.name(),
            base.hook.name(),
            priority_text(base.hook, base.priority)
        )?;
    }
    for rule in &chain.rules {
        writeln!(f, "\t\t{rule}")?;
    }
    writeln!(f, "\t}}")
}

/// A base chain priority as nft prints it: a standard name (`dstnat`, `filter`), a name with a
/// small offset (`dstnat - 10`), or the number.
pub fn priority_text(hook: Hook, priority: i32) -> String {
    // nft 1.0.x's standard priorities for ip/ip6 tables; dstnat and srcnat only name
    // priorities at their own hooks.
    let standard: [(&str, i32, Option<Hook>); 6] = [
        ("raw", -300, None),
        ("mangle", -150, None),
        ("dstnat", -100, Some(Hook::Prerouting)),
        ("filter", 0, None),
        ("security", 50, None),
        ("srcnat", 100, Some(Hook::Postrouting)),
    ];
    for (name, value, only) in standard {
        if only.is_some_and(|h| h != hook) {
            continue;
        }
        let offset = priority - value;
        if offset == 0 {
            return name.to_string();
        }
        if (-10..=10).contains(&offset) {
            let sign = if offset < 0 { '-' } else { '+' };
            return format!("{name} {sign} {}", offset.abs());
        }
    }
    priority.to_string()
}

impl Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.stmts.iter().map(|s| s.to_string()).collect();
        f.write_str(&parts.join(" "))?;
        if let Some(c) = &self.comment {
            write!(f, " comment {}", quoted(c))?;
        }
        Ok(())
    }
}

impl Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Selector::Saddr(fam) => write!(f, "{} saddr", family_keyword(*fam)),
            Selector::Daddr(fam) => write!(f, "{} daddr", family_keyword(*fam)),
            Selector::L4Proto => f.write_str("meta l4proto"),
            Selector::Dport => f.write_str("th dport"),
            Selector::Mark => f.write_str("meta mark"),
            Selector::Iifname => f.write_str("iifname"),
        }
    }
}

fn concat_selectors(key: &[Selector]) -> String {
    key.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(" . ")
}

impl Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Addr(a) => write!(f, "{a}"),
            Value::Prefix(p) => {
                if p.prefix_len() == p.max_prefix_len() {
                    write!(f, "{}", p.addr())
                } else {
                    write!(f, "{}/{}", p.network(), p.prefix_len())
                }
            }
            Value::Proto(p) => f.write_str(p.name()),
            Value::Port(p) => write!(f, "{p}"),
            Value::IndexRange(lo, hi) if lo == hi => write!(f, "{lo}"),
            Value::IndexRange(lo, hi) => write!(f, "{lo}-{hi}"),
            Value::Index(i) => write!(f, "{i}"),
            Value::Ifname(n) => write!(f, "{}", quoted(n)),
        }
    }
}

impl Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Accept => f.write_str("accept"),
            Verdict::Drop => f.write_str("drop"),
            Verdict::Return => f.write_str("return"),
            Verdict::Jump(c) => write!(f, "jump {c}"),
            Verdict::Goto(c) => write!(f, "goto {c}"),
        }
    }
}

/// `numgen random mod N` with ` offset K` when K is not 0 (as nft prints it).
struct Numgen(u32, u32);

impl Display for Numgen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "numgen random mod {}", self.0)?;
        if self.1 != 0 {
            write!(f, " offset {}", self.1)?;
        }
        Ok(())
    }
}

impl Display for Stmt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stmt::Cmp { sel, op, value } => match op {
                CmpOp::Eq => write!(f, "{sel} {value}"),
                CmpOp::Ne => write!(f, "{sel} != {value}"),
            },
            Stmt::MarkBitsEq { mask, value } => {
                write!(f, "meta mark & {mask:#010x} == {value:#010x}")
            }
            Stmt::CtStateNew => f.write_str("ct state new"),
            Stmt::CtStatusDnat => f.write_str("ct status dnat"),
            Stmt::FibLocal(FibAddr::Saddr) => f.write_str("fib saddr type local"),
            Stmt::FibLocal(FibAddr::Daddr) => f.write_str("fib daddr type local"),
            Stmt::FibNotLocal(FibAddr::Saddr) => f.write_str("fib saddr type != local"),
            Stmt::FibNotLocal(FibAddr::Daddr) => f.write_str("fib daddr type != local"),
            Stmt::Lookup { key, set, negate } => {
                let op = if *negate { "!= " } else { "" };
                write!(f, "{} {op}@{set}", concat_selectors(key))
            }
            Stmt::Vmap { key, map } => write!(f, "{} vmap @{map}", concat_selectors(key)),
            Stmt::MarkOr(bits) => write!(f, "meta mark set meta mark | {bits:#010x}"),
            Stmt::MarkXor(bits) => write!(f, "meta mark set meta mark ^ {bits:#010x}"),
            Stmt::SlotLookup { family, slot, set } => write!(f, "{} @{set}", ClientSlot(*family, *slot)),
            Stmt::UpdateSlot { family, slot, set, timeout_secs } => {
                write!(
                    f,
                    "update @{set} {{ {} timeout {} }}",
                    ClientSlot(*family, *slot),
                    duration(u64::from(*timeout_secs) * 1000)
                )
            }
            Stmt::KeyLookup { key, set } => write!(f, "{} @{set}", NumgenInc(*key)),
            Stmt::Masquerade { fully_random: true } => f.write_str("masquerade fully-random"),
            Stmt::Masquerade { fully_random: false } => f.write_str("masquerade"),
            Stmt::Reject(_) => f.write_str("reject"),
            Stmt::Dnat { addr: IpAddr::V4(a), port } => write!(f, "dnat to {a}:{port}"),
            Stmt::Dnat { addr: IpAddr::V6(a), port } => write!(f, "dnat to [{a}]:{port}"),
            Stmt::DnatNumgenMap { family, modulus, offset, map } => {
                write!(f, "dnat {} to {} map @{map}", family_keyword(*family), Numgen(*modulus, *offset))
            }
            Stmt::DnatBalanceMap { family, key, modulus, map } => {
                let (ip, key) = (family_keyword(*family), concat_selectors(key));
                write!(f, "dnat {ip} to {key} . {} map @{map}", Numgen(*modulus, 0))
            }
            Stmt::HashLookup { family, hash, set } => write!(f, "{} @{set}", JhashText(*family, "th", *hash)),
            Stmt::DnatHashMap { family, proto, hash, map } => {
                let hash = JhashText(*family, proto.name(), *hash);
                write!(f, "dnat {} to {hash} map @{map}", family_keyword(*family))
            }
            Stmt::DnatKeyMap { family, key, map } => {
                write!(f, "dnat {} to {} map @{map}", family_keyword(*family), NumgenInc(*key))
            }
            Stmt::Verdict(v) => write!(f, "{v}"),
        }
    }
}

/// `numgen inc mod 1 offset K` (a constant K), ` offset K` left out when K is 0, as nft does.
struct NumgenInc(u32);

impl Display for NumgenInc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("numgen inc mod 1")?;
        if self.0 != 0 {
            write!(f, " offset {}", self.0)?;
        }
        Ok(())
    }
}

/// `ip saddr . numgen inc mod 1 offset J`: a client and an affinity slot.
struct ClientSlot(IpFamily, u32);

impl Display for ClientSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} saddr . {}", family_keyword(self.0), NumgenInc(self.1))
    }
}

/// `jhash ip saddr . th sport mod N seed 0x… offset K`, as nft prints it (`tcp sport` where a
/// protocol match comes with it).
struct JhashText<'a>(IpFamily, &'a str, Jhash);

impl Display for JhashText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let JhashText(family, header, hash) = self;
        let ip = family_keyword(*family);
        write!(f, "jhash {ip} saddr . {header} sport mod {} seed {:#x}", hash.modulus, hash.seed)?;
        if hash.offset != 0 {
            write!(f, " offset {}", hash.offset)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_print_like_nft() {
        assert_eq!(priority_text(Hook::Prerouting, -100), "dstnat");
        assert_eq!(priority_text(Hook::Prerouting, -110), "dstnat - 10");
        assert_eq!(priority_text(Hook::Output, -100), "-100");
        assert_eq!(priority_text(Hook::Output, -90), "-90");
        assert_eq!(priority_text(Hook::Postrouting, 100), "srcnat");
        assert_eq!(priority_text(Hook::Input, 0), "filter");
        assert_eq!(priority_text(Hook::Forward, 5), "filter + 5");
    }

    #[test]
    fn durations_print_like_nft() {
        assert_eq!(duration(10_800_000), "3h");
        assert_eq!(duration(10_801_000), "3h1s");
        assert_eq!(duration(90_000), "1m30s");
        assert_eq!(duration(86_400_000 * 2 + 500), "2d500ms");
    }

    #[test]
    fn rules_print_like_nft() {
        let fam = IpFamily::V4;
        let rule = Rule::new(vec![
            Stmt::Lookup { key: vec![Selector::Daddr(fam)], set: "cluster-ips".into(), negate: false },
            Stmt::Cmp { sel: Selector::Saddr(fam), op: CmpOp::Ne, value: Value::Prefix("10.0.0.0/8".parse().unwrap()) },
            Stmt::Verdict(Verdict::Jump("mark-for-masquerade".into())),
        ]);
        assert_eq!(rule.to_string(), "ip daddr @cluster-ips ip saddr != 10.0.0.0/8 jump mark-for-masquerade");
        let dnat = Rule::new(vec![
            Stmt::Cmp { sel: Selector::L4Proto, op: CmpOp::Eq, value: Value::Proto(crate::net::L4Proto::Tcp) },
            Stmt::Dnat { addr: "fd00::1".parse().unwrap(), port: 80 },
        ])
        .with_comment("ns/svc:http");
        assert_eq!(dnat.to_string(), "meta l4proto tcp dnat to [fd00::1]:80 comment \"ns/svc:http\"");
        assert_eq!(Stmt::MarkBitsEq { mask: 0x4000, value: 0 }.to_string(), "meta mark & 0x00004000 == 0x00000000");
    }
}
