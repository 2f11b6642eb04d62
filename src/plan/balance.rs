//! The balancing chains. A service port without session affinity or `externalTrafficPolicy:
//! Local` has no chain of its own: its addresses are keys of `balanced-service-ips`,
//! `balanced-external-ips` and `balanced-nodeports`, and its endpoints elements of the map for
//! its endpoint count, `service-endpoints-N` (`nodeport-endpoints-N`), keyed by the packet's
//! own address, protocol and port and an index `0..N`. One rule per endpoint count in use
//! picks the index with `numgen random mod N` and DNATs to what the map holds for the packet;
//! a miss (the packet's service has another count) falls through to the next rule.
//!
//! So adding or removing an endpoint, or a whole service, is element operations only: no rule,
//! chain or `goto` changes, and no verdict-map element, the changes after which the kernel
//! validates every chain reachable from the base chains (a walk that grows with the ruleset).
//! The maps and rules for up to [`BalanceMap::PRESET`] endpoints exist always; beyond that, a
//! map and its rule exist while some port has that many endpoints, so the rules change only
//! when such a count comes into use or goes out of it.

use super::objects::*;
use super::{jump, port_key, service_key};
use crate::net::IpFamily;
use crate::nft::*;

/// The three balancing chains of a family's table: rules for the preset endpoint counts and
/// for the balancing maps in `maps` (which may name other sets: they are ignored).
pub(crate) fn chains(family: IpFamily, maps: impl IntoIterator<Item = SharedSet>) -> [Chain; 3] {
    let infra = Owner::infrastructure;
    let preset = BalanceMap::ALL.into_iter().flat_map(|map| (1..=BalanceMap::PRESET).map(move |n| (map, n)));
    let mut counts: Vec<(BalanceMap, u32)> = maps
        .into_iter()
        .filter_map(|set| match set {
            SharedSet::Balance(map, n) => Some((map, n)),
            _ => None,
        })
        .chain(preset)
        .collect();
    counts.sort_unstable();
    counts.dedup();
    let dnat = |map: BalanceMap, n: u32| {
        let key = match map {
            BalanceMap::Service => service_key(family),
            BalanceMap::Nodeport => port_key(),
        };
        let map = SharedSet::Balance(map, n).name().into_owned();
        Rule::new(vec![Stmt::DnatBalanceMap { family, key, modulus: n, map }])
    };

    let mut service = Chain::regular(BALANCE_SERVICE, infra());
    let mut external = Chain::regular(BALANCE_EXTERNAL, infra());
    external.push(Rule::new(vec![jump(MARK_FOR_MASQUERADE)]));
    external.push(Rule::new(vec![Stmt::Verdict(Verdict::Goto(BALANCE_SERVICE.to_string()))]));
    let mut nodeport = Chain::regular(BALANCE_NODEPORT, infra());
    nodeport.push(Rule::new(vec![jump(MARK_FOR_MASQUERADE)]));
    for (map, n) in counts {
        match map {
            BalanceMap::Service => service.push(dnat(map, n)),
            BalanceMap::Nodeport => nodeport.push(dnat(map, n)),
        }
    }
    [service, external, nodeport]
}

/// Rewrites a merged table's balancing chains for the balancing maps it holds.
pub(super) fn fill(table: &mut Table) {
    let maps: Vec<SharedSet> = table.sets.keys().filter_map(|name| SharedSet::from_name(name)).collect();
    for chain in chains(table.family, maps) {
        table.add_chain(chain);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rule_per_endpoint_count_in_ascending_order() {
        let big = BalanceMap::PRESET + 4;
        let maps = [
            SharedSet::Balance(BalanceMap::Service, big),
            SharedSet::ServiceIps,
            SharedSet::Balance(BalanceMap::Service, 2),
            SharedSet::Balance(BalanceMap::Nodeport, 3),
        ];
        let [service, external, nodeport] = chains(IpFamily::V4, maps);
        let text = |c: &Chain| c.rules.iter().map(|r| r.to_string()).collect::<Vec<_>>();
        let service_rule = |n: u32| {
            format!("dnat ip to ip daddr . meta l4proto . th dport . numgen random mod {n} map @service-endpoints-{n}")
        };
        let mut want: Vec<String> = (1..=BalanceMap::PRESET).map(service_rule).collect();
        want.push(service_rule(big));
        assert_eq!(text(&service), want, "the preset counts, then the one in use, once each");
        assert_eq!(text(&external), vec!["jump mark-for-masquerade", "goto balance-service"]);
        let nodeport = text(&nodeport);
        assert_eq!(nodeport.len(), 1 + BalanceMap::PRESET as usize);
        assert_eq!(nodeport[0], "jump mark-for-masquerade");
        assert_eq!(nodeport[3], "dnat ip to meta l4proto . th dport . numgen random mod 3 map @nodeport-endpoints-3");
    }
}
