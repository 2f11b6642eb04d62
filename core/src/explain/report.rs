//! `explain`'s output: a story a person follows (text), or one JSON object.

use std::fmt::Write as _;

use serde::Serialize;

use super::eval::{Step, socket_text};
use super::{Explanation, Outcome, Verdict};
use crate::net::headers::protocol_name;

/// One rule on the way, as JSON.
#[derive(Debug, Serialize)]
struct JsonStep<'a> {
    hook: &'a str,
    chain: &'a str,
    /// 1-based.
    rule: usize,
    comment: Option<&'a str>,
    elements: Vec<JsonElement<'a>>,
    action: &'a str,
}

#[derive(Debug, Serialize)]
struct JsonElement<'a> {
    set: &'a str,
    comment: Option<&'a str>,
}

#[derive(Debug, Serialize)]
struct JsonEndpoint {
    address: String,
    share: f64,
    masquerade: bool,
}

#[derive(Debug, Serialize)]
struct JsonBranch<'a> {
    share: f64,
    verdict: Verdict,
    endpoint: Option<String>,
    masquerade: bool,
    reason: &'a str,
    masquerade_reason: Option<&'a str>,
    /// The rules after `path` (the common part).
    path: Vec<JsonStep<'a>>,
}

#[derive(Debug, Serialize)]
struct JsonExplanation<'a> {
    protocol: String,
    source: String,
    destination: String,
    entry: &'static str,
    table: String,
    ruleset: &'static str,
    verdict: Verdict,
    service: Option<&'a str>,
    destination_kind: Option<&'a str>,
    endpoints: Vec<JsonEndpoint>,
    /// True when any share is masqueraded (`endpoints[].masquerade` says which).
    masquerade: bool,
    reason: Option<&'a str>,
    masquerade_reason: Option<&'a str>,
    /// The rules every share passes, in order.
    path: Vec<JsonStep<'a>>,
    /// Every share, when they differ (the endpoint a `numgen` picks).
    branches: Vec<JsonBranch<'a>>,
    notes: Vec<&'a str>,
}

fn json_step(s: &Step) -> JsonStep<'_> {
    JsonStep {
        hook: s.hook,
        chain: &s.chain,
        rule: s.rule,
        comment: s.comment.as_deref(),
        elements: s.elements.iter().map(|(set, c)| JsonElement { set, comment: c.as_deref() }).collect(),
        action: &s.action,
    }
}

/// The steps every outcome shares, from the start.
fn common_prefix(outcomes: &[Outcome]) -> usize {
    let Some(first) = outcomes.first() else { return 0 };
    (0..first.path.len()).take_while(|i| outcomes.iter().all(|o| o.path.get(*i) == Some(&first.path[*i]))).count()
}

/// The steps every outcome ends with, after the `shared` first ones.
fn common_suffix(outcomes: &[Outcome], shared: usize) -> usize {
    let Some(shortest) = outcomes.iter().map(|o| o.path.len()).min() else { return 0 };
    let first = &outcomes[0].path;
    (1..=shortest.saturating_sub(shared))
        .take_while(|i| outcomes.iter().all(|o| o.path[o.path.len() - i] == first[first.len() - i]))
        .count()
}

/// The verdict of the whole: the shared one, unknown if any share is, else the largest share's.
fn overall(outcomes: &[Outcome]) -> Verdict {
    if outcomes.iter().any(|o| o.verdict == Verdict::Unknown) {
        return Verdict::Unknown;
    }
    if outcomes.iter().any(|o| o.verdict == Verdict::Dnat) {
        return Verdict::Dnat;
    }
    outcomes.first().map_or(Verdict::Unknown, |o| o.verdict)
}

fn notes(e: &Explanation) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    for n in e.outcomes.iter().flat_map(|o| o.notes.iter()) {
        if !out.contains(&n.as_str()) {
            out.push(n);
        }
    }
    out
}

fn entry(e: &Explanation) -> &'static str {
    if e.connection.local { "output" } else { "prerouting" }
}

fn endpoint_text(o: &Outcome) -> Option<String> {
    o.endpoint.map(|(a, p)| socket_text(a, Some(p)))
}

/// The explanation as one JSON object.
pub fn to_json(e: &Explanation) -> Result<String, serde_json::Error> {
    let shared = common_prefix(&e.outcomes);
    let first = e.outcomes.first();
    let distinct = |f: &dyn Fn(&Outcome) -> Option<&str>| -> Option<&str> {
        let v = first.and_then(f);
        e.outcomes.iter().all(|o| f(o) == v).then_some(v).flatten()
    };
    let c = &e.connection;
    let object = JsonExplanation {
        protocol: protocol_name(c.protocol),
        source: socket_text(c.source, Some(c.source_port)),
        destination: socket_text(c.destination, Some(c.destination_port)),
        entry: entry(e),
        table: format!("{} {}", super::family_name(e.family), e.table),
        ruleset: e.ruleset,
        verdict: overall(&e.outcomes),
        service: e.service.as_deref(),
        destination_kind: e.destination_kind.as_deref(),
        endpoints: e
            .outcomes
            .iter()
            .filter_map(|o| {
                Some(JsonEndpoint { address: endpoint_text(o)?, share: round(o.share), masquerade: o.masquerade })
            })
            .collect(),
        masquerade: e.outcomes.iter().any(|o| o.masquerade),
        reason: distinct(&|o| Some(o.reason.as_str()).filter(|r| !r.is_empty())),
        masquerade_reason: distinct(&|o| o.masquerade_reason.as_deref()),
        path: first.map(|o| o.path[..shared].iter().map(json_step).collect()).unwrap_or_default(),
        branches: e
            .outcomes
            .iter()
            .map(|o| JsonBranch {
                share: round(o.share),
                verdict: o.verdict,
                endpoint: endpoint_text(o),
                masquerade: o.masquerade,
                reason: &o.reason,
                masquerade_reason: o.masquerade_reason.as_deref(),
                path: o.path[shared..].iter().map(json_step).collect(),
            })
            .collect(),
        notes: notes(e),
    };
    serde_json::to_string_pretty(&object)
}

/// Shares to six decimals: 1/3 reads 0.333333, not 0.33333333333333331.
fn round(share: f64) -> f64 {
    (share * 1e6).round() / 1e6
}

/// A share as a percentage: one decimal, three below 1% (one of 5,000 endpoints reads 0.020%).
fn percent(share: f64) -> String {
    let pct = share * 100.0;
    if pct > 0.0 && pct < 1.0 { format!("{pct:.3}%") } else { format!("{pct:.1}%") }
}

/// Writes steps, a hook heading whenever the hook changes.
fn write_steps(out: &mut String, steps: &[Step], hook: &mut &'static str, indent: &str) {
    for s in steps {
        if s.hook != *hook {
            let _ = writeln!(out, "{indent}at {}:", s.hook);
            *hook = s.hook;
        }
        let comment = s.comment.as_ref().map(|c| format!(" \"{c}\"")).unwrap_or_default();
        let _ = write!(out, "{indent}  {} rule {}{comment}: {}", s.chain, s.rule, s.action);
        let elements: Vec<String> = s
            .elements
            .iter()
            .map(|(set, c)| match c {
                Some(c) => format!("@{set} element \"{c}\""),
                None => format!("@{set}"),
            })
            .filter(|t| t.contains("element"))
            .collect();
        if !elements.is_empty() {
            let _ = write!(out, " (matched {})", elements.join(", "));
        }
        out.push('\n');
    }
}

/// The explanation as text.
pub fn to_text(e: &Explanation) -> String {
    let mut out = String::new();
    let c = &e.connection;
    let from = if c.local { "from this node" } else { "arriving" };
    let _ = writeln!(
        out,
        "{} {} -> {}: a new connection {from}, entering at {}",
        protocol_name(c.protocol),
        socket_text(c.source, Some(c.source_port)),
        socket_text(c.destination, Some(c.destination_port)),
        entry(e)
    );
    let read = if e.ruleset == "kernel" { "as the kernel holds it" } else { "as planned from the manifests" };
    let _ = writeln!(out, "ruleset: table {} {}, {read}", super::family_name(e.family), e.table);
    match (&e.service, &e.destination_kind) {
        (Some(s), Some(k)) => {
            let _ = writeln!(out, "service: {s} ({k} {})", socket_text(c.destination, Some(c.destination_port)));
        }
        (Some(s), None) => {
            let _ = writeln!(out, "service: {s}");
        }
        (None, _) => {
            let _ = writeln!(out, "service: none (no service port has this address, protocol and port)");
        }
    }
    out.push('\n');
    let shared = common_prefix(&e.outcomes);
    let mut hook = "";
    if let Some(first) = e.outcomes.first() {
        write_steps(&mut out, &first.path[..shared], &mut hook, "");
    }
    if e.outcomes.len() > 1 {
        let tail = common_suffix(&e.outcomes, shared);
        let _ = writeln!(out, "then {} ways, by share of new connections:", e.outcomes.len());
        for o in &e.outcomes {
            let target = endpoint_text(o).map(|t| format!(" -> {t}")).unwrap_or_default();
            let _ = writeln!(out, "  {}{target}:", percent(o.share));
            let mut h = hook;
            write_steps(&mut out, &o.path[shared..o.path.len() - tail], &mut h, "  ");
        }
        if let Some(first) = e.outcomes.first().filter(|_| tail > 0) {
            let _ = writeln!(out, "and every way then:");
            write_steps(&mut out, &first.path[first.path.len() - tail..], &mut "", "");
        }
    }
    out.push('\n');
    let verdict = overall(&e.outcomes);
    match verdict {
        Verdict::Dnat => {
            let service = e.service.as_deref().unwrap_or("the service");
            let _ = writeln!(out, "outcome: DNAT to the endpoints of {service}");
            for o in &e.outcomes {
                let masq = if o.masquerade { "masqueraded" } else { "not masqueraded" };
                match endpoint_text(o) {
                    Some(t) => {
                        let _ = writeln!(out, "  {t:<24} {:>6}  {masq}", percent(o.share));
                    }
                    None => {
                        let _ =
                            writeln!(out, "  {:<24} {:>6}  {:?}: {}", "(none)", percent(o.share), o.verdict, o.reason);
                    }
                }
            }
        }
        Verdict::Accept => {
            let _ = writeln!(out, "outcome: accepted, untouched");
        }
        Verdict::Drop | Verdict::Reject => {
            let word =
                if verdict == Verdict::Drop { "dropped (no answer)" } else { "rejected (ICMP port unreachable)" };
            let _ = writeln!(out, "outcome: {word}");
        }
        Verdict::Unknown => {
            let _ = writeln!(out, "outcome: unknown, the evaluation stopped at something nftproxy does not write");
        }
    }
    let mut reasons: Vec<&str> = Vec::new();
    for o in &e.outcomes {
        for r in [Some(o.reason.as_str()), o.masquerade_reason.as_deref()].into_iter().flatten() {
            if !r.is_empty() && !reasons.contains(&r) {
                reasons.push(r);
            }
        }
    }
    let masquerade_reasons: Vec<&str> = e.outcomes.iter().filter_map(|o| o.masquerade_reason.as_deref()).collect();
    for r in reasons {
        let label = if masquerade_reasons.contains(&r) {
            if e.outcomes.iter().any(|o| o.masquerade && o.masquerade_reason.as_deref() == Some(r)) {
                "masquerade: yes,"
            } else {
                "masquerade: no,"
            }
        } else {
            "why:"
        };
        let _ = writeln!(out, "{label} {r}");
    }
    let updates: Vec<&String> = e.outcomes.iter().flat_map(|o| o.affinity_updates.iter()).collect();
    if !updates.is_empty() {
        let _ = writeln!(
            out,
            "affinity: the source is recorded in the chosen endpoint's slot in the affinity clients set (updated as in the path), which then sends its next connections there"
        );
    }
    for n in notes(e) {
        let _ = writeln!(out, "note: {n}");
    }
    out
}
