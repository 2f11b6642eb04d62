//! `nftproxy explain`: what nftproxy's ruleset does to one new connection, without sending a
//! packet.
//!
//! The ruleset is the one the kernel holds (read back over netlink, the objects the full sync
//! diffs against) or, offline, the one planned from manifests and lowered to the same objects;
//! [`eval`] interprets those objects hook by hook as the kernel would for the connection's first
//! packet, and [`report`] tells the way and the outcome in Kubernetes names: the service port,
//! the endpoints with their shares, masquerade or not and why, or why it is refused.

pub mod eval;
pub mod report;
pub mod services;

use std::net::IpAddr;

use thiserror::Error;

use crate::explain::services::ServiceDirectory;
use crate::net::IpFamily;
use crate::nft::ast::Hook;
use crate::nft::wire::{WireRuleset, WireTable};
use crate::plan::objects::{
    BALANCE_EXTERNAL, BALANCE_EXTERNAL_NODEPORT, MARK_FOR_MASQUERADE, NO_ENDPOINT_NODEPORTS, NO_ENDPOINT_SERVICES,
};
use eval::{Branch, ChainEnd, Evaluator, Flow, Packet, Step, Surroundings};

/// The connection to explain.
#[derive(Debug, Clone)]
pub struct Connection {
    pub source: IpAddr,
    pub source_port: u16,
    pub destination: IpAddr,
    pub destination_port: u16,
    /// IANA protocol number (tcp, udp or sctp).
    pub protocol: u8,
    /// From the node itself (entering at output) rather than arriving (prerouting).
    pub local: bool,
    /// The input interface of an arriving connection, when known.
    pub input_interface: Option<String>,
}

/// Errors that keep `explain` from evaluating anything.
#[derive(Debug, Error)]
pub enum ExplainError {
    #[error("no table {family} {table} here: is nftproxy running in this network namespace (or pass --table)?")]
    NoTable { family: &'static str, table: String },
    #[error("--src {src} and --dst {dst} are of different address families")]
    Families { src: IpAddr, dst: IpAddr },
}

/// Addresses that are this node's, for `fib … type local`.
#[derive(Debug, Clone, Default)]
pub struct LocalAddresses(pub Vec<IpAddr>);

impl Surroundings for LocalAddresses {
    fn is_local(&self, address: IpAddr) -> bool {
        address.is_loopback() || self.0.contains(&address)
    }
}

/// What happens to one share of the connections.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub share: f64,
    pub verdict: Verdict,
    /// The DNAT target, when the connection was DNATed.
    pub endpoint: Option<(IpAddr, u16)>,
    pub masquerade: bool,
    /// Why it was refused, masqueraded or left alone.
    pub reason: String,
    pub masquerade_reason: Option<String>,
    pub path: Vec<Step>,
    pub notes: Vec<String>,
    pub affinity_updates: Vec<String>,
}

/// The end of the connection's first packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Dnat,
    Accept,
    Drop,
    Reject,
    /// The evaluation met something it does not model.
    Unknown,
}

/// Everything `explain` found.
#[derive(Debug, Clone)]
pub struct Explanation {
    pub connection: Connection,
    pub family: IpFamily,
    pub table: String,
    /// `kernel` or `manifests`.
    pub ruleset: &'static str,
    /// `namespace/name:port`, if the destination is a service port.
    pub service: Option<String>,
    /// `ClusterIP`, `NodePort`, `external or load-balancer IP`.
    pub destination_kind: Option<String>,
    /// By decreasing share.
    pub outcomes: Vec<Outcome>,
}

/// Explains `connection` against `ruleset` (nftproxy's tables named `table`).
pub fn explain(
    ruleset: &WireRuleset,
    table: &str,
    origin: &'static str,
    surroundings: &dyn Surroundings,
    connection: &Connection,
) -> Result<Explanation, ExplainError> {
    let family = IpFamily::of(&connection.destination);
    if IpFamily::of(&connection.source) != family {
        return Err(ExplainError::Families { src: connection.source, dst: connection.destination });
    }
    let wire = ruleset
        .tables
        .iter()
        .find(|t| t.family == family && t.name == table)
        .ok_or_else(|| ExplainError::NoTable { family: family_name(family), table: table.to_string() })?;
    let packet = Packet {
        family,
        saddr: connection.source,
        daddr: connection.destination,
        sport: connection.source_port,
        dport: connection.destination_port,
        proto: connection.protocol,
        mark: 0,
        iif: if connection.local { Some(String::new()) } else { connection.input_interface.clone() },
    };
    let flow = Flow {
        packet,
        hook: "",
        dnatted: false,
        dnat: None,
        masquerade: false,
        path: Vec::new(),
        affinity_updates: Vec::new(),
        hashes: Vec::new(),
        notes: Vec::new(),
    };
    let ends = walk(wire, surroundings, flow, connection.local);
    let mut outcomes: Vec<Outcome> = ends.into_iter().map(outcome).collect();
    outcomes.sort_by(|a, b| b.share.total_cmp(&a.share).then(a.endpoint.cmp(&b.endpoint)));

    let directory = ServiceDirectory::new(ruleset);
    let matched = directory.destination(connection.destination, connection.protocol, connection.destination_port);
    let service = outcomes
        .iter()
        .flat_map(|o| o.path.iter())
        .find_map(service_port_of)
        .or_else(|| matched.as_ref().map(|m| m.service_port.clone()));
    Ok(Explanation {
        connection: connection.clone(),
        family,
        table: table.to_string(),
        ruleset: origin,
        service,
        destination_kind: matched.map(|m| m.destination.to_string()),
        outcomes,
    })
}

fn family_name(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// A `namespace/name:port` comment of a step: an element's, else the rule's.
fn service_port_of(step: &Step) -> Option<String> {
    let looks = |c: &str| {
        let (ns, rest) = c.split_once('/')?;
        let (name, port) = rest.split_once(':')?;
        let word = |s: &str| !s.is_empty() && !s.contains(char::is_whitespace);
        (word(ns) && word(name) && word(port)).then(|| c.to_string())
    };
    step.elements.iter().filter_map(|(_, c)| c.as_deref()).chain(step.comment.as_deref()).find_map(looks)
}

/// The hooks the connection's first packet passes, evaluated in order; a branch stops at a drop
/// or an unknown. Arriving: prerouting, then input when the (DNATed) destination is local, else
/// forward and postrouting. From the node: output and postrouting, then, for a local
/// destination, prerouting and input over loopback, where NAT is already set up.
fn walk(table: &WireTable, surroundings: &dyn Surroundings, flow: Flow, local: bool) -> Vec<Branch> {
    let evaluator = Evaluator::new(table, surroundings);
    let first = if local { Hook::Output } else { Hook::Prerouting };
    let mut done = Vec::new();
    for (w, flow, end) in hook(&evaluator, table, flow, first, true) {
        if end != ChainEnd::Accept {
            done.push((w, flow, end));
            continue;
        }
        let to_here = surroundings.is_local(flow.packet.daddr);
        let rest: &[(Hook, bool)] = match (local, to_here) {
            (false, true) => &[(Hook::Input, true)],
            (false, false) => &[(Hook::Forward, true), (Hook::Postrouting, true)],
            (true, false) => &[(Hook::Postrouting, true)],
            (true, true) => &[(Hook::Postrouting, true), (Hook::Prerouting, false), (Hook::Input, false)],
        };
        let mut live = vec![(w, flow, ChainEnd::Accept)];
        for (h, nat) in rest {
            let mut next = Vec::new();
            for (w, flow, end) in live {
                if end != ChainEnd::Accept {
                    done.push((w, flow, end));
                    continue;
                }
                for (w2, f, e) in hook(&evaluator, table, flow, *h, *nat) {
                    next.push((w * w2, f, e));
                }
            }
            live = next;
        }
        done.extend(live);
    }
    eval::merge(done)
}

/// Runs the table's base chains at `at`, by priority. NAT chains run for the first packet of a
/// connection only until one of them sets the binding (`nat` false: already set, over
/// loopback).
fn hook(evaluator: &Evaluator<'_>, table: &WireTable, mut flow: Flow, at: Hook, nat: bool) -> Vec<Branch> {
    flow.hook = at.name();
    let mut live: Vec<Branch> = vec![(1.0, flow, ChainEnd::Accept)];
    for (name, chain_type, _) in eval::base_chains(table, at.number()) {
        let mut next = Vec::new();
        for (w, flow, end) in live {
            let bound = match at {
                Hook::Prerouting | Hook::Output => flow.dnatted,
                _ => flow.masquerade,
            };
            if end != ChainEnd::Accept || (chain_type == "nat" && (!nat || bound)) {
                next.push((w, flow, end));
                continue;
            }
            for (w2, mut f, e) in evaluator.chain(flow, &name) {
                if let Some((address, port)) = f.dnat.take() {
                    f.packet.daddr = address;
                    if let Some(port) = port {
                        f.packet.dport = port;
                    }
                    f.dnatted = true;
                }
                // Accept ends this chain only: later base chains at the hook still run.
                let e = if e == ChainEnd::Return { ChainEnd::Accept } else { e };
                next.push((w * w2, f, e));
            }
        }
        live = next;
    }
    live
}

/// One branch's end in Kubernetes terms.
fn outcome((share, flow, end): Branch) -> Outcome {
    let endpoint = flow.dnatted.then_some((flow.packet.daddr, flow.packet.dport));
    let (verdict, reason) = match &end {
        ChainEnd::Unknown(why) => (Verdict::Unknown, why.clone()),
        ChainEnd::Drop { reject } => {
            let verdict = if *reject { Verdict::Reject } else { Verdict::Drop };
            (verdict, refusal(&flow.path, *reject))
        }
        ChainEnd::Accept | ChainEnd::Return if endpoint.is_some() => (Verdict::Dnat, String::new()),
        ChainEnd::Accept | ChainEnd::Return => (
            Verdict::Accept,
            "no nftproxy rule matched it: not a service address and port here, so the kernel delivers or routes it as it is"
                .into(),
        ),
    };
    let masquerade_reason = masquerade_reason(&flow.path, flow.masquerade, verdict);
    Outcome {
        share,
        verdict,
        endpoint,
        masquerade: flow.masquerade,
        reason,
        masquerade_reason,
        path: flow.path,
        notes: flow.notes,
        affinity_updates: flow.affinity_updates,
    }
}

/// Why a connection was dropped or rejected, from the rules and elements that refused it.
fn refusal(path: &[Step], reject: bool) -> String {
    for step in path.iter().rev() {
        let comment = step.comment.as_deref().unwrap_or_default();
        let element = |prefix: &str| step.elements.iter().find(|(set, _)| set.starts_with(prefix));
        if let Some((set, c)) = element(NO_ENDPOINT_SERVICES).or_else(|| element(NO_ENDPOINT_NODEPORTS)) {
            let port = c.as_deref().unwrap_or("the service port");
            return if reject {
                format!("{port} has no endpoints (element of @{set}): rejected")
            } else {
                format!(
                    "{port} has no endpoint this traffic may use on this node (traffic policy Local without a local endpoint, element of @{set}): dropped"
                )
            };
        }
        if step.elements.iter().any(|(set, _)| set.starts_with("source-ranges-")) || step.chain.starts_with("firewall-")
        {
            return format!(
                "the source is outside the service's loadBalancerSourceRanges ({} rule {}): dropped",
                step.chain, step.rule
            );
        }
        if comment.contains("invalid ports of ClusterIPs") {
            return format!(
                "the ClusterIP does not serve this protocol and port ({} rule {}): rejected",
                step.chain, step.rule
            );
        }
        if comment.contains("unallocated ClusterIPs") {
            return format!(
                "the address is in a ServiceCIDR but no Service has it, an unallocated ClusterIP ({} rule {}): dropped",
                step.chain, step.rule
            );
        }
    }
    match path.last() {
        Some(step) => format!("{} rule {}: {}", step.chain, step.rule, step.action),
        None => "the base chain's policy".into(),
    }
}

/// Why the connection is masqueraded, from the rule that asked for it; or why not.
fn masquerade_reason(path: &[Step], masquerade: bool, verdict: Verdict) -> Option<String> {
    if !masquerade {
        return (verdict == Verdict::Dnat)
            .then(|| "no rule asked for masquerade: the endpoint sees the client's own address".to_string());
    }
    let asked = format!("jump {MARK_FOR_MASQUERADE}");
    let step = path.iter().find(|s| s.action.contains(&asked))?;
    let comment = step.comment.as_deref().unwrap_or_default();
    let why = if comment.contains("from outside the cluster") {
        "the source is outside the cluster CIDR"
    } else if comment == "hairpin" {
        "hairpin: the endpoint is the client itself"
    } else if comment.contains("local traffic") {
        "traffic from the node itself to an external address (Local policy short-circuits it to any endpoint)"
    } else if step.chain == BALANCE_EXTERNAL
        || step.chain == BALANCE_EXTERNAL_NODEPORT
        || step.chain.starts_with("external-")
    {
        "external traffic with externalTrafficPolicy Cluster (the endpoint may be on another node)"
    } else {
        "a rule asked for it"
    };
    let comment = step.comment.as_ref().map(|c| format!(" \"{c}\"")).unwrap_or_default();
    Some(format!("{why} ({} rule {}{comment})", step.chain, step.rule))
}

#[cfg(test)]
mod tests;
