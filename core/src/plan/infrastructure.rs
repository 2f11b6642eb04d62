//! The fixed part of every family's table: base chains at upstream's hooks and priorities,
//! the dispatch maps and the masquerade plumbing.

use std::net::IpAddr;

use ipnet::IpNet;

use super::input::{NodePorts, PlanInput};
use super::objects::*;
use super::rules::{
    external_local_short_circuits, goto, jump, local_cidrs, local_match, lookup, port_key, service_key,
};
use crate::config::ProxyConfig;
use crate::model::ClusterState;
use crate::net::IpFamily;
use crate::nft::*;

/// nftproxy's base chains (name, type, hook, priority), the same in every family's table and
/// whatever the cluster holds. Taken from the planned infrastructure, so `check` compares
/// foreign chains with exactly what `sync` creates.
pub fn base_chains() -> Vec<(String, BaseHook)> {
    let config = ProxyConfig::new("");
    let state = ClusterState::default();
    let nodeports = NodePorts::Addresses(Vec::new());
    let input = PlanInput { config: &config, state: &state, nodeports_v4: &nodeports, nodeports_v6: &nodeports };
    table(IpFamily::V4, &input).chains.into_values().filter_map(|c| c.base.map(|b| (c.name, b))).collect()
}

fn not_localhost(family: IpFamily) -> Stmt {
    let value = match family {
        IpFamily::V4 => Value::Prefix("127.0.0.0/8".parse().unwrap_or(IpNet::V4(Default::default()))),
        IpFamily::V6 => Value::Addr(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)),
    };
    Stmt::Cmp { sel: Selector::Daddr(family), op: CmpOp::Ne, value }
}

/// The table's fixed part: base chains at upstream's hooks and priorities, dispatch maps and
/// the masquerade plumbing.
pub(super) fn table(family: IpFamily, input: &PlanInput<'_>) -> Table {
    let infra = Owner::infrastructure;
    let cfg = input.config;
    let mut t = Table::new(family, &cfg.table, Some("rules for nftproxy"));
    let match_all_nodeports = matches!(input.nodeports(family), NodePorts::MatchAll);

    t.add_set(SharedSet::ClusterIps.empty(family));
    if let NodePorts::Addresses(ips) = input.nodeports(family) {
        let mut set = SharedSet::NodeportIps.empty(family);
        for ip in ips.iter().filter(|ip| IpFamily::of(ip) == family && !ip.is_loopback()) {
            set.insert(vec![Value::Addr(*ip)], Element::key_only(infra()));
        }
        t.add_set(set);
    }
    for set in SharedSet::SERVICE_WRITTEN.into_iter().filter(|s| *s != SharedSet::ClusterIps) {
        t.add_set(set.empty(family));
    }
    let cidrs = local_cidrs(family, input);
    if cidrs.len() > 1 {
        let mut set = SharedSet::ClusterCidrs.empty(family);
        for net in IpNet::aggregate(&cidrs) {
            set.insert(vec![Value::Prefix(net)], Element::key_only(infra()));
        }
        t.add_set(set);
    }

    // Upstream checks new connections in filter chains at four more hooks (firewall-check at
    // prerouting/output -110, service-endpoints-check and cluster-ips-check at forward/output 0),
    // which every packet of every connection then passes: a base chain costs a hook call and a
    // `ct state` test per packet. The nat chains below run once per connection (the first packet
    // of a conntrack entry, which is the packet `ct state new` picks out), so the same checks
    // there cost nothing on the packets after it. In order: the firewall drops before DNAT, as
    // at -110; what `services` DNATs (a terminal verdict) never reaches the rules after it, as
    // the forward/output checks never matched it (they see the endpoint address); the rest are
    // the service addresses without endpoints and the ClusterIP ports nothing serves, rejected
    // (Linux ≥ 5.9 allows reject in prerouting). Upstream checks ClusterIPs only in forward and
    // output, not input: hence `fib daddr type != local` (looked at only for ClusterIPs).
    // `filter-input` keeps upstream's checks for the node's own addresses.
    let base = |name: &str, chain_type, hook, priority| Chain::base(name, BaseHook { chain_type, hook, priority });
    let new = || Stmt::CtStateNew;
    let mut c = base("filter-input", ChainType::Filter, Hook::Input, 0);
    c.push(Rule::new(vec![new(), jump(NODEPORT_ENDPOINTS_CHECK)]));
    c.push(Rule::new(vec![new(), jump(SERVICE_ENDPOINTS_CHECK)]));
    t.add_chain(c);
    let mut c = base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100);
    c.push(Rule::new(vec![new(), jump(FIREWALL_CHECK)]));
    c.push(Rule::new(vec![jump(SERVICES)]));
    c.push(Rule::new(vec![new(), jump(SERVICE_ENDPOINTS_CHECK)]));
    c.push(
        Rule::new(vec![
            new(),
            lookup(Selector::Daddr(family), CLUSTER_IPS),
            Stmt::FibNotLocal(FibAddr::Daddr),
            Stmt::Reject(family),
        ])
        .with_comment("Reject forwarded traffic to invalid ports of ClusterIPs"),
    );
    t.add_chain(c);
    let mut c = base("nat-output", ChainType::Nat, Hook::Output, -100);
    c.push(Rule::new(vec![new(), jump(FIREWALL_CHECK)]));
    c.push(Rule::new(vec![jump(SERVICES)]));
    c.push(Rule::new(vec![new(), jump(SERVICE_ENDPOINTS_CHECK)]));
    c.push(Rule::new(vec![new(), jump(CLUSTER_IPS_CHECK)]));
    t.add_chain(c);
    let mut c = base("nat-postrouting", ChainType::Nat, Hook::Postrouting, 100);
    c.push(Rule::new(vec![jump(MASQUERADING)]));
    t.add_chain(c);

    let mut c = Chain::regular(CLUSTER_IPS_CHECK, infra());
    c.push(
        Rule::new(vec![lookup(Selector::Daddr(family), CLUSTER_IPS), Stmt::Reject(family)])
            .with_comment("Reject traffic to invalid ports of ClusterIPs"),
    );
    t.add_chain(c);
    let mut c = Chain::regular(FIREWALL_CHECK, infra());
    c.push(Rule::new(vec![Stmt::Vmap { key: service_key(family), map: FIREWALL_IPS.into() }]));
    t.add_chain(c);
    let mut c = Chain::regular(MARK_FOR_MASQUERADE, infra());
    c.push(Rule::new(vec![Stmt::MarkOr(cfg.masquerade_mark())]));
    t.add_chain(c);
    let mut c = Chain::regular(MASQUERADING, infra());
    c.push(
        Rule::new(vec![
            Stmt::CtStatusDnat,
            Stmt::Lookup {
                key: vec![Selector::Saddr(family), Selector::Daddr(family)],
                set: HAIRPIN.into(),
                negate: false,
            },
            jump(MARK_FOR_MASQUERADE),
        ])
        .with_comment("hairpin"),
    );
    c.push(Rule::new(vec![Stmt::MarkBitsEq { mask: cfg.masquerade_mark(), value: 0 }, Stmt::Verdict(Verdict::Return)]));
    // xor clears the bit so a packet re-entering the stack (VXLAN) is not masqueraded twice.
    c.push(Rule::new(vec![Stmt::MarkXor(cfg.masquerade_mark())]));
    c.push(Rule::new(vec![Stmt::Masquerade { fully_random: true }]));
    t.add_chain(c);

    let nodeport_guard = |family| -> Vec<Stmt> {
        if match_all_nodeports {
            vec![Stmt::FibLocal(FibAddr::Daddr), not_localhost(family)]
        } else {
            vec![lookup(Selector::Daddr(family), NODEPORT_IPS)]
        }
    };
    let mut c = Chain::regular(NODEPORT_ENDPOINTS_CHECK, infra());
    let mut stmts = nodeport_guard(family);
    stmts.push(Stmt::Vmap { key: port_key(), map: NO_ENDPOINT_NODEPORTS.into() });
    c.push(Rule::new(stmts));
    t.add_chain(c);
    let mut c =
        Chain::regular(REJECT_CHAIN, infra()).with_comment("helper for @no-endpoint-services / @no-endpoint-nodeports");
    c.push(Rule::new(vec![Stmt::Reject(family)]));
    t.add_chain(c);

    let mut services = Chain::regular(SERVICES, infra());
    let masq = if cfg.masquerade_all {
        Some(Rule::new(vec![lookup(Selector::Daddr(family), CLUSTER_IPS), jump(MARK_FOR_MASQUERADE)]))
    } else {
        // The source test first: pod traffic, most of what arrives, then needs no set lookup.
        local_match(family, input, true).map(|not_local| {
            Rule::new(vec![not_local, lookup(Selector::Daddr(family), CLUSTER_IPS), jump(MARK_FOR_MASQUERADE)])
        })
    };
    if let Some(rule) = masq {
        services.push(rule.with_comment("masquerade ClusterIP traffic from outside the cluster"));
    }
    services.push(Rule::new(vec![Stmt::Vmap { key: service_key(family), map: SERVICE_IPS.into() }]));
    let balanced = |key: Vec<Selector>, set: &str, chain: &str| {
        Rule::new(vec![Stmt::Lookup { key, set: set.into(), negate: false }, goto(chain)])
    };
    services.push(balanced(service_key(family), BALANCED_SERVICE_IPS, BALANCE_SERVICE));
    services.push(balanced(service_key(family), BALANCED_EXTERNAL_IPS, BALANCE_EXTERNAL));
    services.push(balanced(service_key(family), BALANCED_LOCAL_IPS, BALANCE_EXTERNAL_LOCAL));
    // Last in `services`, so a goto is as good as a jump; the guard (a fib lookup when every
    // local address takes node ports) is evaluated once for both kinds of node port.
    let mut stmts = nodeport_guard(family);
    stmts.push(goto(NODEPORTS));
    services.push(Rule::new(stmts));
    t.add_chain(services);
    let mut c = Chain::regular(NODEPORTS, infra());
    c.push(Rule::new(vec![Stmt::Vmap { key: port_key(), map: SERVICE_NODEPORTS.into() }]));
    c.push(balanced(port_key(), BALANCED_NODEPORTS, BALANCE_EXTERNAL_NODEPORT));
    c.push(balanced(port_key(), BALANCED_LOCAL_NODEPORTS, BALANCE_EXTERNAL_LOCAL_NODEPORT));
    t.add_chain(c);
    for chain in super::balance::chains(family, []) {
        t.add_chain(chain);
    }
    // `externalTrafficPolicy: Local`, upstream's external chain for that policy with the
    // service's chains replaced by the shared balancing chains: pods and the node reach any
    // endpoint (the node masqueraded, as its source would be the external address itself);
    // everyone else this node's endpoints, keeping the client's address. No endpoint here: the
    // last `goto` finds no element and the address's no-endpoint verdict (`drop`) follows.
    for (name, cluster, local) in [
        (BALANCE_EXTERNAL_LOCAL, BALANCE_SERVICE, BALANCE_LOCAL),
        (BALANCE_EXTERNAL_LOCAL_NODEPORT, BALANCE_NODEPORT, BALANCE_LOCAL_NODEPORT),
    ] {
        let mut c = Chain::regular(name, infra());
        for rule in external_local_short_circuits(family, input, cluster) {
            c.push(rule);
        }
        c.push(Rule::new(vec![goto(local)]));
        t.add_chain(c);
    }
    let mut c = Chain::regular(SERVICE_ENDPOINTS_CHECK, infra());
    c.push(Rule::new(vec![Stmt::Vmap { key: service_key(family), map: NO_ENDPOINT_SERVICES.into() }]));
    t.add_chain(c);

    // ServiceCIDR (issue 14). Upstream's second rule of `cluster-ips-check`: after the reject of
    // allocated ClusterIPs on ports they do not serve, what is left inside a range of the
    // ServiceCIDR objects is an address no Service has, and is dropped. Only when this family
    // has such ranges: else no set and no rule.
    let service_cidrs = input.state.service_cidrs(family);
    if !service_cidrs.is_empty() {
        let mut set = SharedSet::ServiceCidrs.empty(family);
        for net in service_cidrs {
            set.insert(vec![Value::Prefix(net)], Element::key_only(infra()));
        }
        t.add_set(set);
        let unallocated = |new: Option<Stmt>, forwarded: Option<Stmt>| {
            let range = lookup(Selector::Daddr(family), SERVICE_CIDRS);
            let drop = Stmt::Verdict(Verdict::Drop);
            Rule::new(new.into_iter().chain([range]).chain(forwarded).chain([drop]).collect())
        };
        let forwarded = unallocated(Some(new()), Some(Stmt::FibNotLocal(FibAddr::Daddr)));
        if let Some(c) = t.chains.get_mut("nat-prerouting") {
            c.push(forwarded.with_comment("Drop forwarded traffic to unallocated ClusterIPs"));
        }
        if let Some(c) = t.chains.get_mut(CLUSTER_IPS_CHECK) {
            c.push(unallocated(None, None).with_comment("Drop traffic to unallocated ClusterIPs"));
        }
    }
    // End of ServiceCIDR.
    t
}
