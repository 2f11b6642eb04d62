//! The balancing chains. A service port without session affinity has no chain of its own: its
//! addresses are keys of the `balanced-…` sets, and its endpoints elements of the map for their
//! count, `service-endpoints-N` (`nodeport-endpoints-N`), keyed by the packet's own address,
//! protocol and port and an index `0..N`. One rule per endpoint count in use picks the index
//! with `numgen random mod N` and DNATs to what the map holds for the packet; a miss (the
//! packet's service has another count) falls through to the next rule.
//!
//! `externalTrafficPolicy: Local` is data too: an external address (node port) of such a port
//! is a key of `balanced-local-ips` (`balanced-local-nodeports`), its cluster-wide endpoints are
//! in `service-endpoints-N` (`nodeport-endpoints-N`) under that key, for the pods and the node
//! the infrastructure's `balance-external-local…` chains short-circuit to them, and this node's
//! endpoints in `local-endpoints-N` (`local-nodeport-endpoints-N`), balanced by `balance-local`
//! (`balance-local-nodeport`) for everyone else.
//!
//! So adding or removing an endpoint, or a whole service, is element operations only: no rule,
//! chain or `goto` changes, and no verdict-map element, the changes after which the kernel
//! validates every chain reachable from the base chains (a walk that grows with the ruleset).
//! The maps and rules for up to [`BalanceMap::PRESET`] endpoints exist always; beyond that, a
//! map and its rule exist while some port has that many endpoints, so the rules change only
//! when such a count comes into use or goes out of it.

use super::objects::*;
use super::{goto, jump, port_key, service_key};
use crate::net::IpFamily;
use crate::nft::*;

/// The balancing chains of a family's table: rules for the preset endpoint counts and for the
/// balancing maps in `maps` (which may name other sets: they are ignored). Their rules depend on
/// nothing else, so the syncer can tell the kernel's from the maps it holds.
pub fn chains(family: IpFamily, maps: impl IntoIterator<Item = SharedSet>) -> [Chain; 6] {
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
        let key = if map.by_nodeport() { port_key() } else { service_key(family) };
        let map = SharedSet::Balance(map, n).name().into_owned();
        Rule::new(vec![Stmt::DnatBalanceMap { family, key, modulus: n, map }])
    };
    // Masquerade, then the cluster-wide endpoints: upstream's external chain under the Cluster
    // policy.
    let masquerade_then = |name: &str, target: &str| {
        let mut chain = Chain::regular(name, infra());
        chain.push(Rule::new(vec![jump(MARK_FOR_MASQUERADE)]));
        chain.push(Rule::new(vec![goto(target)]));
        chain
    };

    let mut service = Chain::regular(BALANCE_SERVICE, infra());
    let mut nodeport = Chain::regular(BALANCE_NODEPORT, infra());
    let mut local = Chain::regular(BALANCE_LOCAL, infra());
    let mut local_nodeport = Chain::regular(BALANCE_LOCAL_NODEPORT, infra());
    for (map, n) in counts {
        let chain = match map {
            BalanceMap::Service => &mut service,
            BalanceMap::Nodeport => &mut nodeport,
            BalanceMap::Local => &mut local,
            BalanceMap::LocalNodeport => &mut local_nodeport,
        };
        chain.push(dnat(map, n));
    }
    [
        service,
        masquerade_then(BALANCE_EXTERNAL, BALANCE_SERVICE),
        nodeport,
        masquerade_then(BALANCE_EXTERNAL_NODEPORT, BALANCE_NODEPORT),
        local,
        local_nodeport,
    ]
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
        let [service, external, nodeport, external_nodeport, local, local_nodeport] = chains(IpFamily::V4, maps);
        let text = |c: &Chain| c.rules.iter().map(|r| r.to_string()).collect::<Vec<_>>();
        let service_rule = |n: u32| {
            format!("dnat ip to ip daddr . meta l4proto . th dport . numgen random mod {n} map @service-endpoints-{n}")
        };
        let mut want: Vec<String> = (1..=BalanceMap::PRESET).map(service_rule).collect();
        want.push(service_rule(big));
        assert_eq!(text(&service), want, "the preset counts, then the one in use, once each");
        assert_eq!(text(&external), vec!["jump mark-for-masquerade", "goto balance-service"]);
        assert_eq!(text(&external_nodeport), vec!["jump mark-for-masquerade", "goto balance-nodeport"]);
        let nodeport = text(&nodeport);
        assert_eq!(nodeport.len(), BalanceMap::PRESET as usize);
        assert_eq!(nodeport[2], "dnat ip to meta l4proto . th dport . numgen random mod 3 map @nodeport-endpoints-3");
        let local = text(&local);
        assert_eq!(
            local[0],
            "dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 1 map @local-endpoints-1"
        );
        let local_nodeport = text(&local_nodeport);
        assert_eq!(
            local_nodeport[1],
            "dnat ip to meta l4proto . th dport . numgen random mod 2 map @local-nodeport-endpoints-2"
        );
    }
}
