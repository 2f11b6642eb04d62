//! The pieces rules are made of: jumps and gotos, the service and port keys, set lookups, the
//! match of pod traffic per detect-local mode and the first rules of a Local-policy external
//! chain.

use ipnet::IpNet;

use super::input::PlanInput;
use super::objects;
use crate::config::DetectLocal;
use crate::net::IpFamily;
use crate::nft::*;

/// A jump to `chain`, which returns here.
pub(super) fn jump(chain: &str) -> Stmt {
    Stmt::Verdict(Verdict::Jump(chain.to_string()))
}

/// A goto to `chain`, which does not return.
pub(super) fn goto(chain: &str) -> Stmt {
    Stmt::Verdict(Verdict::Goto(chain.to_string()))
}

/// The dispatch key `daddr . l4proto . dport`.
pub(super) fn service_key(family: IpFamily) -> Vec<Selector> {
    vec![Selector::Daddr(family), Selector::L4Proto, Selector::Dport]
}

/// The node-port key `l4proto . dport`.
pub(super) fn port_key() -> Vec<Selector> {
    vec![Selector::L4Proto, Selector::Dport]
}

/// `sel` looked up in the named set `set`.
pub(super) fn lookup(sel: Selector, set: &str) -> Stmt {
    Stmt::Lookup { key: vec![sel], set: set.to_string(), negate: false }
}

/// The statement matching traffic from pods (or, negated, from anything else), per detect-local
/// mode; `None` when pods cannot be told apart (then nothing is masqueraded for it and no
/// short-circuit applies, as upstream).
pub(super) fn local_match(family: IpFamily, input: &PlanInput<'_>, negate: bool) -> Option<Stmt> {
    let op = if negate { CmpOp::Ne } else { CmpOp::Eq };
    match &input.config.detect_local {
        DetectLocal::ClusterCidr | DetectLocal::NodeCidr => match local_cidrs(family, input).as_slice() {
            [] => None,
            [one] if one.prefix_len() == 0 => None,
            [one] => Some(Stmt::Cmp { sel: Selector::Saddr(family), op, value: Value::Prefix(*one) }),
            // Several ranges (a node with several pod CIDRs of one family): the named interval
            // set the infrastructure holds, never an anonymous one.
            _ => Some(Stmt::Lookup {
                key: vec![Selector::Saddr(family)],
                set: objects::CLUSTER_CIDRS.to_string(),
                negate,
            }),
        },
        DetectLocal::BridgeInterface(bridge) => {
            Some(Stmt::Cmp { sel: Selector::Iifname, op, value: Value::Ifname(bridge.clone()) })
        }
        DetectLocal::InterfaceNamePrefix(prefix) => {
            Some(Stmt::Cmp { sel: Selector::Iifname, op, value: Value::Ifname(format!("{prefix}*")) })
        }
    }
}

/// The first rules of upstream's external chain for `externalTrafficPolicy: Local`: pods and
/// the node go to every endpoint, at `cluster` (the node masqueraded, as its source would be the
/// external address itself); what the caller adds next serves everyone else.
pub(super) fn external_local_short_circuits(family: IpFamily, input: &PlanInput<'_>, cluster: &str) -> Vec<Rule> {
    let pods = local_match(family, input, false)
        .map(|pods| Rule::new(vec![pods, goto(cluster)]).with_comment("short-circuit pod traffic"));
    pods.into_iter()
        .chain([
            Rule::new(vec![Stmt::FibLocal(FibAddr::Saddr), jump(objects::MARK_FOR_MASQUERADE)])
                .with_comment("masquerade local traffic"),
            Rule::new(vec![Stmt::FibLocal(FibAddr::Saddr), goto(cluster)]).with_comment("short-circuit local traffic"),
        ])
        .collect()
}

/// The pod ranges of one family for the CIDR-based detect-local modes.
pub(super) fn local_cidrs(family: IpFamily, input: &PlanInput<'_>) -> Vec<IpNet> {
    match &input.config.detect_local {
        DetectLocal::ClusterCidr => input.config.cluster_cidr(family).into_iter().collect(),
        DetectLocal::NodeCidr => input
            .state
            .node()
            .map(|n| n.pod_cidrs.iter().copied().filter(|c| IpFamily::of_net(c) == family).collect())
            .unwrap_or_default(),
        DetectLocal::BridgeInterface(_) | DetectLocal::InterfaceNamePrefix(_) => Vec::new(),
    }
}
