//! The desired ruleset as a plain value, in nftables vocabulary.
//!
//! `plan` builds it, [`super::render`] prints it as nft text (what `nft list ruleset` shows) and
//! [`super::lower`] turns it into the kernel's objects. Only the shapes nftproxy needs exist here;
//! each one is written the way nft 1.0.x writes and prints it, so any `nft` can read our tables.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use indexmap::IndexMap;
use ipnet::IpNet;

use crate::model::{NamespacedName, ServicePortName};
use crate::net::{IpFamily, L4Proto};

/// Who an nftables object belongs to, so a kernel error can be traced back to a Kubernetes
/// object: a service port, or nftproxy's shared plumbing. Cheap to clone (elements of one
/// service port share one allocation).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Owner {
    /// The table, base chains, shared sets and maps.
    Infrastructure,
    /// A service port's chains, sets and elements.
    ServicePort(Arc<OwnerRef>),
}

/// The service port an object belongs to, as its comments name it (`namespace/name:port`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OwnerRef {
    pub service: NamespacedName,
    /// The port name; empty for a Service's single unnamed port.
    pub port: String,
}

impl Owner {
    /// The owner of the table, base chains and shared maps.
    pub fn infrastructure() -> Owner {
        Owner::Infrastructure
    }

    /// The owner of a service port's objects.
    pub fn service_port(name: &ServicePortName) -> Owner {
        Owner::ServicePort(Arc::new(OwnerRef { service: name.service.clone(), port: name.port.clone() }))
    }

    /// True for shared plumbing rather than a service port.
    pub fn is_infrastructure(&self) -> bool {
        matches!(self, Owner::Infrastructure)
    }

    /// The Service this owner belongs to, if any.
    pub fn service(&self) -> Option<&NamespacedName> {
        match self {
            Owner::Infrastructure => None,
            Owner::ServicePort(r) => Some(&r.service),
        }
    }

    /// The owner an element comment read back from the kernel names: `namespace/name:port` (or
    /// `namespace/name`) for a service port; anything else is nftproxy's own. A comment cut at
    /// nft's 127-byte limit can lose the port name, never the Service (two DNS labels and a `/`
    /// fit).
    pub fn from_comment(comment: &str) -> Owner {
        let (service, port) = comment.split_once(':').unwrap_or((comment, ""));
        let Some((namespace, name)) = service.split_once('/') else { return Owner::Infrastructure };
        let label =
            |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !label(namespace) || !label(name) {
            return Owner::Infrastructure;
        }
        Owner::ServicePort(Arc::new(OwnerRef { service: NamespacedName::new(namespace, name), port: port.to_string() }))
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Owner::Infrastructure => f.write_str("nftproxy"),
            Owner::ServicePort(r) if r.port.is_empty() => write!(f, "{}", r.service),
            Owner::ServicePort(r) => write!(f, "{}:{}", r.service, r.port),
        }
    }
}

/// A whole ruleset: one table per IP family in use.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ruleset {
    pub tables: Vec<Table>,
}

impl Ruleset {
    /// The table of one family, if present.
    pub fn table(&self, family: IpFamily) -> Option<&Table> {
        self.tables.iter().find(|t| t.family == family)
    }
}

/// An nftables table (`table ip nftproxy`).
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    pub family: IpFamily,
    pub name: String,
    pub comment: Option<String>,
    /// Sets and maps, in the order they are created and printed.
    pub sets: IndexMap<String, Set>,
    /// Chains, in the order they are created and printed.
    pub chains: IndexMap<String, Chain>,
}

impl Table {
    /// An empty table.
    pub fn new(family: IpFamily, name: &str, comment: Option<&str>) -> Table {
        Table {
            family,
            name: name.to_string(),
            comment: comment.map(str::to_string),
            sets: IndexMap::new(),
            chains: IndexMap::new(),
        }
    }

    /// Adds a set (replacing one with the same name).
    pub fn add_set(&mut self, set: Set) {
        self.sets.insert(set.name.clone(), set);
    }

    /// Adds a chain (replacing one with the same name).
    pub fn add_chain(&mut self, chain: Chain) {
        self.chains.insert(chain.name.clone(), chain);
    }

    /// Total number of set and map elements.
    pub fn element_count(&self) -> usize {
        self.sets.values().map(|s| s.elements.len()).sum()
    }

    /// Total number of rules.
    pub fn rule_count(&self) -> usize {
        self.chains.values().map(|c| c.rules.len()).sum()
    }
}

/// Netfilter hooks nftproxy attaches to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

impl Hook {
    /// nft keyword.
    pub fn name(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }

    /// The kernel's hook number (`NF_INET_*`).
    pub fn number(self) -> u32 {
        match self {
            Hook::Prerouting => 0,
            Hook::Input => 1,
            Hook::Forward => 2,
            Hook::Output => 3,
            Hook::Postrouting => 4,
        }
    }

    /// The hook with this kernel number.
    pub fn from_number(n: u32) -> Option<Hook> {
        Some(match n {
            0 => Hook::Prerouting,
            1 => Hook::Input,
            2 => Hook::Forward,
            3 => Hook::Output,
            4 => Hook::Postrouting,
            _ => return None,
        })
    }
}

/// Base chain types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainType {
    Filter,
    Nat,
}

impl ChainType {
    /// nft keyword (also the kernel's type name).
    pub fn name(self) -> &'static str {
        match self {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
        }
    }
}

/// What makes a chain a base chain: its hook, type and priority. Policy is always accept
/// (like upstream, nftproxy never accepts or drops by policy; other tables decide).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseHook {
    pub chain_type: ChainType,
    pub hook: Hook,
    pub priority: i32,
}

/// A chain with its rules.
#[derive(Debug, Clone, PartialEq)]
pub struct Chain {
    pub name: String,
    pub base: Option<BaseHook>,
    pub comment: Option<String>,
    pub rules: Vec<Rule>,
    pub owner: Owner,
}

impl Chain {
    /// A regular chain (reached only by jump/goto).
    pub fn regular(name: impl Into<String>, owner: Owner) -> Chain {
        Chain { name: name.into(), base: None, comment: None, rules: Vec::new(), owner }
    }

    /// A base chain attached to a hook.
    pub fn base(name: impl Into<String>, base: BaseHook) -> Chain {
        Chain { name: name.into(), base: Some(base), comment: None, rules: Vec::new(), owner: Owner::infrastructure() }
    }

    /// Sets the chain comment.
    pub fn with_comment(mut self, comment: &str) -> Chain {
        self.comment = Some(comment.to_string());
        self
    }

    /// Appends a rule.
    pub fn push(&mut self, rule: Rule) {
        self.rules.push(rule);
    }
}

/// One rule: statements evaluated left to right, and an optional comment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub stmts: Vec<Stmt>,
    pub comment: Option<String>,
}

impl Rule {
    /// A rule made of these statements.
    pub fn new(stmts: Vec<Stmt>) -> Rule {
        Rule { stmts, comment: None }
    }

    /// Sets the rule comment.
    pub fn with_comment(mut self, comment: impl Into<String>) -> Rule {
        self.comment = Some(comment.into());
        self
    }
}

/// Packet fields a rule loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Selector {
    /// `ip saddr` / `ip6 saddr`
    Saddr(IpFamily),
    /// `ip daddr` / `ip6 daddr`
    Daddr(IpFamily),
    /// `meta l4proto`
    L4Proto,
    /// `th dport` (TCP, UDP and SCTP keep the destination port at the same offset)
    Dport,
    /// `meta mark`
    Mark,
    /// `iifname`
    Iifname,
}

/// Comparison operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmpOp {
    Eq,
    Ne,
}

/// Which address `fib … type local` looks up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FibAddr {
    Saddr,
    Daddr,
}

/// A constant a rule compares with, or a set element's field.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Value {
    Addr(IpAddr),
    /// An address prefix: a rule operand (`ip saddr != 10.0.0.0/8`) or an interval-set element.
    Prefix(IpNet),
    Proto(L4Proto),
    Port(u16),
    /// A range of `numgen` results (the key of an endpoint map), both ends included.
    IndexRange(u32, u32),
    /// One `numgen` result, a field of a balancing map's key (host byte order, as numgen
    /// writes it).
    Index(u32),
    /// An interface name; a trailing `*` matches a prefix.
    Ifname(String),
}

/// Verdicts.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    Accept,
    Drop,
    Return,
    Jump(String),
    Goto(String),
}

impl Verdict {
    /// The chain this verdict continues in, if any.
    pub fn target(&self) -> Option<&str> {
        match self {
            Verdict::Jump(c) | Verdict::Goto(c) => Some(c),
            Verdict::Accept | Verdict::Drop | Verdict::Return => None,
        }
    }
}

/// Statements: the building blocks of nftproxy's rules.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Stmt {
    /// `ip saddr != 10.0.0.0/8`, `meta l4proto tcp`, `iifname "veth*"`.
    Cmp { sel: Selector, op: CmpOp, value: Value },
    /// `meta mark & 0x00004000 == 0x00000000`
    MarkBitsEq { mask: u32, value: u32 },
    /// `ct state new`
    CtStateNew,
    /// `ct status dnat`
    CtStatusDnat,
    /// `fib daddr type local`
    FibLocal(FibAddr),
    /// `fib daddr type != local`
    FibNotLocal(FibAddr),
    /// `ip daddr @cluster-ips`, `ip saddr != @set`, `ip saddr . ip daddr @set`.
    Lookup { key: Vec<Selector>, set: String, negate: bool },
    /// `ip daddr . meta l4proto . th dport vmap @service-ips`
    Vmap { key: Vec<Selector>, map: String },
    /// `meta mark set meta mark | 0x00004000`
    MarkOr(u32),
    /// `meta mark set meta mark ^ 0x00004000`
    MarkXor(u32),
    /// `ip saddr . numgen inc mod 1 offset J @set`: the client is recorded in affinity slot J
    /// (`numgen inc mod 1` is always 0, so the second field is the constant J).
    SlotLookup { family: IpFamily, slot: u32, set: String },
    /// `update @set { ip saddr . numgen inc mod 1 offset J timeout T }`: records the client in
    /// slot J for T seconds, or refreshes its timeout.
    UpdateSlot { family: IpFamily, slot: u32, set: String, timeout_secs: u32 },
    /// `numgen inc mod 1 offset K @map`: the map has the key K (an affinity slot is bound).
    KeyLookup { key: u32, set: String },
    /// `masquerade fully-random`
    Masquerade { fully_random: bool },
    /// `reject`: ICMP(v6) port unreachable for the table's family; a TCP client sees
    /// "connection refused" at once.
    Reject(IpFamily),
    /// `dnat to 10.180.0.1:80`
    Dnat { addr: IpAddr, port: u16 },
    /// `dnat ip to numgen random mod N offset K map @map`
    DnatNumgenMap { family: IpFamily, modulus: u32, offset: u32, map: String },
    /// `dnat ip to ip daddr . meta l4proto . th dport . numgen random mod N map @map`: the
    /// packet's own fields and a random index in `0..N` pick the endpoint.
    DnatBalanceMap { family: IpFamily, key: Vec<Selector>, modulus: u32, map: String },
    /// `jhash ip saddr . th sport mod N seed S offset K @set`: the connection's hash is in
    /// the set (an affinity slot's window).
    HashLookup { family: IpFamily, hash: Jhash, set: String },
    /// `dnat ip to jhash ip saddr . tcp sport mod N seed S offset K map @map`: the connection's
    /// hash picks the endpoint (nft adds, and lists without, `meta l4proto tcp`).
    DnatHashMap { family: IpFamily, proto: L4Proto, hash: Jhash, map: String },
    /// `dnat ip to numgen inc mod 1 offset K map @map`: the endpoint under the constant key K
    /// (`numgen inc mod 1` is always 0), so the target is data while the rule stays.
    DnatKeyMap { family: IpFamily, key: u32, map: String },
    /// `jump x`, `goto x`, `drop`, `return`.
    Verdict(Verdict),
}

/// `jhash ip saddr . th sport mod N seed S offset K`: the kernel's `jhash` of a connection's
/// source address and port, scaled to `0..N`, plus K.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Jhash {
    pub modulus: u32,
    pub seed: u32,
    pub offset: u32,
}

/// The shapes of sets and maps nftproxy uses. Each has a fixed key and data layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SetShape {
    /// `type ipv4_addr`
    Addresses(IpFamily),
    /// `type ipv4_addr; flags interval`
    Prefixes(IpFamily),
    /// `type ipv4_addr . ipv4_addr`
    AddressPairs(IpFamily),
    /// `type ipv4_addr . inet_proto . inet_service : verdict`
    ServiceVerdicts(IpFamily),
    /// `type inet_proto . inet_service : verdict`
    PortVerdicts,
    /// `type ipv4_addr . inet_proto . inet_service` (service addresses that are balanced)
    ServiceKeys(IpFamily),
    /// `type inet_proto . inet_service` (node ports that are balanced)
    PortKeys,
    /// `typeof ip daddr . meta l4proto . th dport . numgen random mod N : ip daddr . th dport`
    /// (the endpoints of service addresses with N of them, by index: the key is what the rule
    /// that reads the map looks up, `numgen random mod N` included)
    ServiceEndpoints(IpFamily, u32),
    /// `typeof meta l4proto . th dport . numgen random mod N : ip daddr . th dport` (the
    /// endpoints of node ports with N of them, by index)
    NodeportEndpoints(IpFamily, u32),
    /// `typeof numgen random mod 1 : ip daddr . th dport; flags interval` (numgen range → DNAT
    /// target)
    EndpointTargets(IpFamily),
    /// `typeof numgen random mod 1; flags interval` (the hash windows of affinity slots)
    SlotWindows,
    /// `typeof numgen inc mod 1 : ip daddr . th dport` (the endpoint an affinity slot is bound
    /// to, under the slot's constant key)
    SlotTargets(IpFamily),
    /// `typeof ip saddr . numgen inc mod 1; flags dynamic,timeout; timeout Ns` (session
    /// affinity: a client and the slot it is recorded in)
    AffinityClients(IpFamily),
}

impl SetShape {
    /// Whether this shape's keys are ranges (`flags interval`: each a start and an end element).
    pub fn is_interval(self) -> bool {
        match self {
            SetShape::Prefixes(_) | SetShape::EndpointTargets(_) | SetShape::SlotWindows => true,
            SetShape::Addresses(_)
            | SetShape::AddressPairs(_)
            | SetShape::ServiceVerdicts(_)
            | SetShape::PortVerdicts
            | SetShape::ServiceKeys(_)
            | SetShape::PortKeys
            | SetShape::ServiceEndpoints(..)
            | SetShape::NodeportEndpoints(..)
            | SetShape::SlotTargets(_)
            | SetShape::AffinityClients(_) => false,
        }
    }

    /// Whether this shape is a map (elements carry data).
    pub fn is_map(self) -> bool {
        match self {
            SetShape::ServiceVerdicts(_)
            | SetShape::PortVerdicts
            | SetShape::EndpointTargets(_)
            | SetShape::SlotTargets(_)
            | SetShape::ServiceEndpoints(..)
            | SetShape::NodeportEndpoints(..) => true,
            SetShape::Addresses(_)
            | SetShape::Prefixes(_)
            | SetShape::AddressPairs(_)
            | SetShape::ServiceKeys(_)
            | SetShape::PortKeys
            | SetShape::SlotWindows
            | SetShape::AffinityClients(_) => false,
        }
    }

    /// Whether the kernel fills this shape's elements (`flags dynamic`: affinity), so nftproxy
    /// never diffs them.
    pub fn is_dynamic(self) -> bool {
        match self {
            SetShape::AffinityClients(_) => true,
            SetShape::Addresses(_)
            | SetShape::Prefixes(_)
            | SetShape::AddressPairs(_)
            | SetShape::ServiceVerdicts(_)
            | SetShape::PortVerdicts
            | SetShape::ServiceKeys(_)
            | SetShape::PortKeys
            | SetShape::ServiceEndpoints(..)
            | SetShape::NodeportEndpoints(..)
            | SetShape::EndpointTargets(_)
            | SetShape::SlotWindows
            | SetShape::SlotTargets(_) => false,
        }
    }
}

/// A named set or map.
#[derive(Debug, Clone, PartialEq)]
pub struct Set {
    pub name: String,
    pub shape: SetShape,
    /// Element timeout in seconds (affinity sets).
    pub timeout_secs: Option<u32>,
    /// The most elements a dynamic set holds (`size`), when not the kernel's default: raised
    /// after the set is created, as a large `size` at creation makes the kernel allocate a hash
    /// table for that many elements at once.
    pub size: Option<u32>,
    /// `counter`: the kernel gives every element its own packet and byte counter, which a
    /// lookup or map match on the element increments (the per-service counters, issue 16).
    pub counter: bool,
    pub comment: Option<String>,
    pub elements: BTreeMap<Vec<Value>, Element>,
    pub owner: Owner,
}

impl Set {
    /// An empty set.
    pub fn new(name: impl Into<String>, shape: SetShape, owner: Owner) -> Set {
        Set {
            name: name.into(),
            shape,
            timeout_secs: None,
            size: None,
            counter: false,
            comment: None,
            elements: BTreeMap::new(),
            owner,
        }
    }

    /// Gives every element a counter (`counter` in the set's declaration).
    pub fn with_counter(mut self) -> Set {
        self.counter = true;
        self
    }

    /// Sets the comment.
    pub fn with_comment(mut self, comment: &str) -> Set {
        self.comment = Some(comment.to_string());
        self
    }

    /// Adds an element (a later insert with the same key replaces the earlier one).
    pub fn insert(&mut self, key: Vec<Value>, element: Element) {
        self.elements.insert(key, element);
    }
}

/// A set or map element's value and bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Element {
    pub data: ElementData,
    /// Shared by the elements of one service port (there are hundreds of thousands).
    pub comment: Option<Arc<str>>,
    pub owner: Owner,
}

impl Element {
    /// A key-only element (plain sets).
    pub fn key_only(owner: Owner) -> Element {
        Element { data: ElementData::None, comment: None, owner }
    }

    /// A verdict-map element.
    pub fn verdict(verdict: Verdict, owner: Owner) -> Element {
        Element { data: ElementData::Verdict(verdict), comment: None, owner }
    }

    /// A data-map element.
    pub fn values(values: Vec<Value>, owner: Owner) -> Element {
        Element { data: ElementData::Values(values), comment: None, owner }
    }

    /// Sets the element comment.
    pub fn with_comment(mut self, comment: impl Into<Arc<str>>) -> Element {
        self.comment = Some(comment.into());
        self
    }
}

/// What a map element maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ElementData {
    None,
    Verdict(Verdict),
    Values(Vec<Value>),
}
