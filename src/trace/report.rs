//! One traced packet for a person: where it came from and went, the service port and the
//! endpoint in Kubernetes names, every rule and chain end it met (comments and chain names as
//! they are), and the final verdict.

use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::net::IpAddr;

use super::packet::PacketTrace;
use crate::explain::services::{ServiceDirectory, ServiceMatch};
use crate::net::headers::{Headers, endpoint};
use crate::netlink::TableFamily;
use crate::netlink::trace::{RuleNote, TraceEvent, TraceKind};

/// Verdict codes (`NF_*`, `NFT_*`).
const DROP: i32 = 0;
const ACCEPT: i32 = 1;
const STOLEN: i32 = 2;
const QUEUE: i32 = 3;
const CONTINUE: i32 = -1;
const BREAK: i32 = -2;
const JUMP: i32 = -3;
const GOTO: i32 = -4;
const RETURN: i32 = -5;

/// A chain, as trace events name it.
type ChainKey = (TableFamily, String, String);

/// What the report needs besides the events: nftproxy's maps, the rules' comments and the
/// hooks of the base chains.
#[derive(Default)]
pub(crate) struct Context {
    pub(crate) services: ServiceDirectory,
    rules: HashMap<(ChainKey, u64), RuleNote>,
    /// Base chains: hook name and priority.
    hooks: HashMap<ChainKey, (&'static str, i32)>,
    interfaces: HashMap<u32, String>,
}

impl Context {
    /// A context from the maps, the rules and the base chains read from the kernel.
    pub(crate) fn new(
        services: ServiceDirectory,
        rules: Vec<RuleNote>,
        hooks: impl IntoIterator<Item = (ChainKey, (&'static str, i32))>,
        interfaces: HashMap<u32, String>,
    ) -> Context {
        let rules = rules.into_iter().map(|r| (((r.family, r.table.clone(), r.chain.clone()), r.handle), r)).collect();
        Context { services, rules, hooks: hooks.into_iter().collect(), interfaces }
    }

    fn rule(&self, e: &TraceEvent) -> Option<&RuleNote> {
        let key = (e.family?, e.table.clone(), e.chain.clone());
        self.rules.get(&(key, e.rule?))
    }

    fn hook(&self, e: &TraceEvent) -> Option<(&'static str, i32)> {
        self.hooks.get(&(e.family?, e.table.clone(), e.chain.clone())).copied()
    }

    /// Whether the packet names something not read yet (a rule, or a destination that is no
    /// service port): the ruleset may have changed since it was read.
    pub(crate) fn misses(&self, trace: &PacketTrace) -> bool {
        trace.events.iter().any(|e| e.rule.is_some() && self.rule(e).is_none())
            || headers(&trace.start).is_some_and(|h| self.service(&h).is_none())
    }

    fn service(&self, h: &Headers) -> Option<ServiceMatch> {
        self.services.destination(h.destination, h.protocol, h.destination_port().unwrap_or(0))
    }

    fn interface(&self, index: u32) -> String {
        self.interfaces.get(&index).cloned().unwrap_or_else(|| format!("if{index}"))
    }
}

fn headers(e: &TraceEvent) -> Option<Headers> {
    Headers::parse(e.network_header.as_deref()?, e.transport_header.as_deref())
}

/// How a packet ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Accepted by every base chain; the last hook that saw it.
    Accepted { last_hook: Option<&'static str> },
    /// Dropped (or rejected) by a rule or a policy.
    Dropped { by: String, reject: bool },
    /// Queued to user space or taken by an expression.
    Other(String),
}

/// A traced packet, analysed.
pub(crate) struct PacketReport<'a> {
    trace: &'a PacketTrace,
    context: &'a Context,
    /// The headers when it was marked.
    pub(crate) arrived: Option<Headers>,
    pub(crate) service: Option<ServiceMatch>,
    /// The destination after DNAT, if it changed.
    pub(crate) endpoint: Option<(IpAddr, Option<u16>)>,
    /// Service ports whose endpoint maps hold the endpoint.
    pub(crate) endpoint_of: Vec<String>,
    pub(crate) masqueraded: bool,
    pub(crate) outcome: Outcome,
}

fn has(note: Option<&RuleNote>, expression: &str) -> bool {
    note.is_some_and(|n| n.expressions.iter().any(|e| e == expression))
}

fn place(e: &TraceEvent) -> String {
    format!("{} {} {}", e.family.map_or("?", |f| f.keyword()), e.table, e.chain)
}

impl<'a> PacketReport<'a> {
    /// Analyses a packet's events.
    pub(crate) fn new(trace: &'a PacketTrace, context: &'a Context) -> PacketReport<'a> {
        let arrived = headers(&trace.start);
        let service = arrived.as_ref().and_then(|h| context.service(h));
        let mut endpoint = None;
        let mut masqueraded = false;
        let mut outcome = None;
        let mut last_hook = context.hook(&trace.start).map(|(h, _)| h);
        for e in &trace.events {
            if let Some((hook, _)) = context.hook(e) {
                last_hook = Some(hook);
            }
            if let (Some(now), Some(first)) = (headers(e), arrived.as_ref())
                && (now.destination, now.destination_port()) != (first.destination, first.destination_port())
            {
                endpoint = Some((now.destination, now.destination_port()));
            }
            let note = context.rule(e);
            match (e.kind, e.verdict, e.policy) {
                (TraceKind::Policy, _, Some(0)) => {
                    outcome.get_or_insert(Outcome::Dropped { by: format!("{} policy drop", place(e)), reject: false });
                }
                (TraceKind::Rule | TraceKind::Return, Some(DROP), _) => {
                    let by = match e.rule {
                        Some(h) => format!("{} rule {h}", place(e)),
                        None => place(e),
                    };
                    outcome.get_or_insert(Outcome::Dropped { by, reject: has(note, "reject") });
                }
                (_, Some(ACCEPT), _) if has(note, "masq") => masqueraded = true,
                (_, Some(v @ (STOLEN | QUEUE)), _) => {
                    outcome.get_or_insert(Outcome::Other(format!("{} by {}", verdict_name(v), place(e))));
                }
                _ => {}
            }
        }
        // Endpoint maps hold address and port, not the protocol: prefer the port the packet is for.
        let mut endpoint_of = endpoint.and_then(|(ip, port)| port.map(|p| context.services.endpoint(ip, p)));
        if let (Some(owners), Some(s)) = (&mut endpoint_of, &service)
            && owners.contains(&s.service_port)
        {
            owners.retain(|o| *o == s.service_port);
        }
        PacketReport {
            trace,
            context,
            arrived,
            service,
            endpoint,
            endpoint_of: endpoint_of.unwrap_or_default(),
            masqueraded,
            outcome: outcome.unwrap_or(Outcome::Accepted { last_hook }),
        }
    }
}

fn verdict_name(v: i32) -> String {
    match v {
        DROP => "drop".into(),
        ACCEPT => "accept".into(),
        STOLEN => "stolen".into(),
        QUEUE => "queue".into(),
        CONTINUE => "continue".into(),
        BREAK => "break".into(),
        JUMP => "jump".into(),
        GOTO => "goto".into(),
        RETURN => "return".into(),
        n => format!("verdict {n}"),
    }
}

/// What an event says: `rule 12: jump services`, `end of chain`, `policy accept`.
fn step(e: &TraceEvent, note: Option<&RuleNote>, base: bool) -> String {
    let mut out = String::new();
    match (e.kind, e.rule) {
        (TraceKind::Policy, _) => {
            let policy = if e.policy == Some(0) { "drop" } else { "accept" };
            let _ = write!(out, "policy {policy}");
        }
        // A chain's end: Linux 6.x reports it as a rule event without a handle.
        (TraceKind::Rule | TraceKind::Return, None) => {
            out.push_str(if base { "end of chain" } else { "end of chain, back to the caller" });
        }
        (TraceKind::Unknown(kind), None) => {
            let _ = write!(out, "event type {kind}");
        }
        (_, Some(handle)) => {
            let verdict = e.verdict.map_or_else(|| "?".into(), verdict_name);
            let _ = write!(out, "rule {handle}: {verdict}");
            if let Some(target) = &e.target {
                let _ = write!(out, " {target}");
            }
            for (expression, what) in [("nat", "nat"), ("masq", "masquerade"), ("reject", "reject")] {
                if has(note, expression) {
                    let _ = write!(out, " ({what})");
                }
            }
        }
    }
    out
}

impl fmt::Display for PacketReport<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let start = &self.trace.start;
        write!(f, "packet {}: ", self.trace.number)?;
        match &self.arrived {
            Some(h) => write!(f, "{h}")?,
            None => write!(f, "(no headers)")?,
        }
        if let Some(iif) = start.iif {
            write!(f, ", in {}", self.context.interface(iif))?;
        }
        if let Some(hook) = self.context.hook(start).map(|(h, _)| h) {
            write!(f, ", at {hook}")?;
        }
        writeln!(f)?;
        match (&self.service, &self.arrived) {
            (Some(s), Some(h)) => writeln!(
                f,
                "  service   {} ({} {}, in {})",
                s.service_port,
                s.destination,
                endpoint(h.destination, h.destination_port()),
                s.maps.join(", ")
            )?,
            (None, Some(h)) if self.context.services.is_cluster_ip(h.destination) => writeln!(
                f,
                "  service   none: {} is a ClusterIP, but no service port of it serves {}{}",
                h.destination,
                crate::net::headers::protocol_name(h.protocol),
                h.destination_port().map(|p| format!(" port {p}")).unwrap_or_default()
            )?,
            (None, _) => writeln!(f, "  service   none: nftproxy programmed nothing for this destination")?,
            (Some(s), None) => writeln!(f, "  service   {}", s.service_port)?,
        }
        // One block per base chain the packet entered (its first event carries the headers);
        // jumps never leave a table, so the block names it once.
        let mut previous = self.arrived;
        let mut mark = None;
        let mut block: Option<(Option<TableFamily>, &str)> = None;
        let width = self.trace.events.iter().map(|e| e.chain.len()).max().unwrap_or(0);
        for e in &self.trace.events {
            let hook = self.context.hook(e);
            if e.network_header.is_some() || block != Some((e.family, e.table.as_str())) {
                block = Some((e.family, e.table.as_str()));
                write!(f, "  at {}, {}", hook.map_or("?", |(h, _)| h), place(e))?;
                if let Some((_, priority)) = hook {
                    write!(f, " (priority {priority})")?;
                }
                if let Some(now) = headers(e)
                    && Some(now) != previous
                {
                    write!(f, ", now {now}")?;
                    previous = Some(now);
                }
                writeln!(f)?;
            }
            let note = self.context.rule(e);
            let mut what = step(e, note, hook.is_some());
            if e.mark != mark {
                what.push_str(&format!(" [mark {:#x}]", e.mark.unwrap_or(0)));
                mark = e.mark;
            }
            if let Some(comment) = note.and_then(|n| n.comment.as_deref()) {
                what.push_str(&format!("  # {comment}"));
            }
            writeln!(f, "      {:<width$}  {what}", e.chain)?;
        }
        if let Some((ip, port)) = self.endpoint {
            write!(f, "  endpoint  {}", endpoint(ip, port))?;
            if !self.endpoint_of.is_empty() {
                write!(f, " ({})", self.endpoint_of.join(", "))?;
            }
            writeln!(f)?;
        }
        write!(f, "  verdict   ")?;
        match &self.outcome {
            Outcome::Dropped { by, reject: true } => write!(f, "rejected by {by}")?,
            Outcome::Dropped { by, reject: false } => write!(f, "dropped by {by}")?,
            Outcome::Other(what) => write!(f, "{what}")?,
            Outcome::Accepted { last_hook } => {
                write!(f, "accept")?;
                match (last_hook, self.endpoint) {
                    (Some("input"), _) => write!(f, ", delivered on this node")?,
                    (Some("forward" | "postrouting"), Some((ip, port))) => {
                        write!(f, ", forwarded to {}", endpoint(ip, port))?
                    }
                    (Some("forward" | "postrouting"), None) => write!(f, ", forwarded")?,
                    (_, Some((ip, port))) => write!(f, ", to {}", endpoint(ip, port))?,
                    _ => {}
                }
                if self.masqueraded {
                    write!(f, ", masqueraded")?;
                }
            }
        }
        writeln!(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::trace::TraceConntrack;
    use crate::trace::packet::tests::{event, start};

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn with_headers(mut e: TraceEvent, network: &str, transport: &str) -> TraceEvent {
        e.network_header = Some(hex(network));
        e.transport_header = Some(hex(transport));
        e
    }

    fn rule(e: TraceEvent, handle: u64, verdict: i32, target: Option<&str>) -> TraceEvent {
        TraceEvent { rule: Some(handle), verdict: Some(verdict), target: target.map(str::to_string), ..e }
    }

    fn note(chain: &str, handle: u64, comment: Option<&str>, expressions: &[&str]) -> RuleNote {
        RuleNote {
            family: TableFamily::Ip,
            table: "nftproxy".into(),
            chain: chain.into(),
            handle,
            comment: comment.map(str::to_string),
            expressions: expressions.iter().map(|e| e.to_string()).collect(),
        }
    }

    // 10.99.0.2:46342 -> 172.30.0.41:80 SYN, then DNATed to 10.180.0.2:8081.
    const SYN: (&str, &str) = ("4500003c8fc740004006f4480a630002ac1e0029", "b506005025c0cd7c00000000a002faf0b6da0000");
    const DNATED: (&str, &str) =
        ("4500003c8fc74000400695da0a6300020ab40002", "b5061f9125c0cd7c00000000a002faf015490000");

    fn context(rules: Vec<RuleNote>) -> Context {
        let hooks = [
            ((TableFamily::Inet, "nftproxy-trace-1".to_string(), "prerouting".to_string()), ("prerouting", -150)),
            ((TableFamily::Ip, "nftproxy".to_string(), "nat-prerouting".to_string()), ("prerouting", -100)),
            ((TableFamily::Ip, "nftproxy".to_string(), "filter-input".to_string()), ("input", 0)),
        ];
        Context::new(ServiceDirectory::default(), rules, hooks, HashMap::from([(2, "eth0".to_string())]))
    }

    fn ip(chain: &str) -> TraceEvent {
        event(TableFamily::Ip, "nftproxy", chain, 7)
    }

    #[test]
    fn an_accepted_dnat_to_a_local_endpoint() {
        let mut marked = with_headers(start(7, 1), SYN.0, SYN.1);
        marked.iif = Some(2);
        let trace = PacketTrace {
            number: 1,
            start: marked,
            events: vec![
                with_headers(rule(ip("nat-prerouting"), 13, JUMP, Some("services")), SYN.0, SYN.1),
                rule(ip("services"), 21, GOTO, Some("service-A")),
                rule(ip("service-A"), 23, ACCEPT, None),
                TraceEvent {
                    conntrack: Some(TraceConntrack { state: Some(8), ..TraceConntrack::default() }),
                    ..with_headers(TraceEvent { verdict: Some(CONTINUE), ..ip("filter-input") }, DNATED.0, DNATED.1)
                },
                TraceEvent { kind: TraceKind::Policy, policy: Some(1), ..ip("filter-input") },
            ],
        };
        let ctx = context(vec![note("service-A", 23, Some("default/web:http"), &["numgen", "lookup", "nat"])]);
        let report = PacketReport::new(&trace, &ctx);
        assert_eq!(report.endpoint, Some(("10.180.0.2".parse().unwrap(), Some(8081))));
        assert_eq!(report.outcome, Outcome::Accepted { last_hook: Some("input") });
        let text = report.to_string();
        for line in [
            "packet 1: tcp 10.99.0.2:46342 -> 172.30.0.41:80 [SYN], in eth0, at prerouting",
            "service   none",
            "  at prerouting, ip nftproxy nat-prerouting (priority -100)\n      nat-prerouting  rule 13: jump services\n",
            "      services        rule 21: goto service-A\n",
            "      service-A       rule 23: accept (nat)  # default/web:http\n",
            "  at input, ip nftproxy filter-input (priority 0), now tcp 10.99.0.2:46342 -> 10.180.0.2:8081 [SYN]\n",
            "      filter-input    end of chain\n      filter-input    policy accept\n",
            "endpoint  10.180.0.2:8081",
            "verdict   accept, delivered on this node",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn a_reject_is_reported_with_its_rule() {
        let trace = PacketTrace {
            number: 2,
            start: with_headers(start(7, 1), SYN.0, SYN.1),
            events: vec![
                with_headers(rule(ip("nat-prerouting"), 15, JUMP, Some("service-endpoints-check")), SYN.0, SYN.1),
                rule(ip("service-endpoints-check"), 30, GOTO, Some("reject-chain")),
                rule(ip("reject-chain"), 31, DROP, None),
            ],
        };
        let ctx = context(vec![note("reject-chain", 31, None, &["reject"])]);
        let report = PacketReport::new(&trace, &ctx);
        assert_eq!(report.outcome, Outcome::Dropped { by: "ip nftproxy reject-chain rule 31".into(), reject: true });
        assert!(report.endpoint.is_none());
        assert!(report.to_string().ends_with("verdict   rejected by ip nftproxy reject-chain rule 31\n"));
        // A drop policy of a foreign base chain.
        let policy = PacketTrace {
            number: 3,
            start: with_headers(start(7, 1), SYN.0, SYN.1),
            events: vec![TraceEvent {
                kind: TraceKind::Policy,
                policy: Some(0),
                ..event(TableFamily::Inet, "firewall", "input", 7)
            }],
        };
        let report = PacketReport::new(&policy, &ctx);
        assert_eq!(report.outcome, Outcome::Dropped { by: "inet firewall input policy drop".into(), reject: false });
    }
}
