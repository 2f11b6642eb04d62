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
//! So adding or removing an endpoint, or a whole service, is element operations only while the
//! counts it moves between are in use: no rule, chain or `goto` changes, and no verdict-map
//! element, the changes after which the kernel validates every chain reachable from the base
//! chains (a walk that grows with the ruleset). A plan has a count's map and its rule while
//! some port has that many endpoints, so `nft list ruleset` shows the counts in use. The
//! transaction of the first port to reach a count creates them; the syncer then keeps them,
//! empty or not, while its process runs ([`keep`]), so that a count that comes back is
//! elements again rather than a new rule, whose validation walk is what a created map costs
//! (docs/design.md has the measurements).

use super::objects::*;
use super::rules::{goto, jump, port_key, service_key};
use crate::net::IpFamily;
use crate::nft::*;

/// The balancing chains of a family's table: one rule for each balancing map in `maps` (which
/// may name other sets: they are ignored), in ascending count. Their rules depend on nothing
/// else, so the syncer can tell the kernel's from the maps it holds.
pub fn chains(family: IpFamily, maps: impl IntoIterator<Item = SharedSet>) -> [Chain; 6] {
    let infra = Owner::infrastructure;
    let mut counts: Vec<(BalanceMap, u32)> = maps
        .into_iter()
        .filter_map(|set| match set {
            SharedSet::Balance(map, n) => Some((map, n)),
            _ => None,
        })
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

/// Adds to a planned table the balancing maps in `kept` it does not hold (empty), with their
/// rules: the maps the syncer keeps after their last element went (see
/// `nftproxy::sync::programmed`), so that the planned ruleset is what the kernel holds.
pub fn keep(table: &mut Table, kept: impl IntoIterator<Item = SharedSet>) {
    let family = table.family;
    let mut added = false;
    for set in kept.into_iter().filter(|s| matches!(s, SharedSet::Balance(..))) {
        if !table.sets.contains_key(set.name().as_ref()) {
            table.add_set(set.empty(family));
            added = true;
        }
    }
    if added {
        order_sets(table);
        fill(table);
    }
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
    fn one_rule_per_endpoint_count_in_use_in_ascending_order() {
        let maps = [
            SharedSet::Balance(BalanceMap::Service, 20),
            SharedSet::ServiceIps,
            SharedSet::Balance(BalanceMap::Service, 2),
            SharedSet::Balance(BalanceMap::Nodeport, 3),
            SharedSet::Balance(BalanceMap::Service, 2),
        ];
        let [service, external, nodeport, external_nodeport, local, local_nodeport] = chains(IpFamily::V4, maps);
        let text = |c: &Chain| c.rules.iter().map(|r| r.to_string()).collect::<Vec<_>>();
        let service_rule = |n: u32| {
            format!("dnat ip to ip daddr . meta l4proto . th dport . numgen random mod {n} map @service-endpoints-{n}")
        };
        assert_eq!(text(&service), vec![service_rule(2), service_rule(20)], "the counts in use, once each");
        assert_eq!(text(&external), vec!["jump mark-for-masquerade", "goto balance-service"]);
        assert_eq!(text(&external_nodeport), vec!["jump mark-for-masquerade", "goto balance-nodeport"]);
        assert_eq!(
            text(&nodeport),
            vec!["dnat ip to meta l4proto . th dport . numgen random mod 3 map @nodeport-endpoints-3"]
        );
        assert!(local.rules.is_empty() && local_nodeport.rules.is_empty(), "no count in use, no rule");
    }

    #[test]
    fn kept_maps_are_added_empty_with_their_rules() {
        let mut table = Table::new(IpFamily::V4, "nftproxy", None);
        table.add_set(SharedSet::Balance(BalanceMap::Service, 2).empty(IpFamily::V4));
        fill(&mut table);
        keep(&mut table, [SharedSet::Balance(BalanceMap::Service, 5), SharedSet::ServiceIps]);
        assert!(table.sets["service-endpoints-5"].elements.is_empty());
        assert!(!table.sets.contains_key("service-ips"), "only balancing maps are kept");
        let rules: Vec<String> = table.chains[BALANCE_SERVICE].rules.iter().map(|r| r.to_string()).collect();
        assert_eq!(rules.len(), 2);
        assert!(rules[1].ends_with("numgen random mod 5 map @service-endpoints-5"), "{rules:?}");
    }
}
