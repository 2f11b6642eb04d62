//! The benchmark's anchors: the rulesets upstream kube-proxy writes for the same synthetic
//! cluster, as text for `nft -f` and `iptables-restore`, so the benchmark can load them into the
//! kernel and compare their cost with nftproxy's.
//!
//! The shapes follow kube-proxy 1.33 (`pkg/proxy/nftables/proxier.go` written through knftables,
//! and `pkg/proxy/iptables/proxier.go`) with its defaults: masquerade bit 14,
//! `--detect-local-mode ClusterCIDR` (the `cluster_cidr` argument; empty means no local
//! detector), NodePorts on the node's primary IP in nftables mode and on every local address in
//! iptables mode. IPv4 only: services without an IPv4 ClusterIP are skipped, as the IPv4 proxier
//! does. Upstream iterates a Go map; here services come in [`ClusterState`] order.
//!
//! What matters for the comparison is kept exact: one chain per endpoint, per-service chains
//! balancing with an anonymous `numgen … vmap { … }` (nftables) or a `statistic` rule per endpoint
//! (iptables), and the add-then-flush of every chain a sync touches.

use std::collections::{BTreeSet, HashMap};
use std::fmt::{self, Write};
use std::net::IpAddr;

use data_encoding::BASE32;
use sha2::{Digest, Sha256};

use nftproxy::model::{ClusterState, Endpoint, NamespacedName, ServiceInfo, ServicePort};
use nftproxy::net::IpFamily;
use nftproxy::plan::endpoints::{Categorized, NodeView, categorize};
use nftproxy::plan::names::{endpoint_base, service_port_base};

/// The table every nftables line addresses.
const T: &str = "ip kube-proxy";
/// `--masquerade-bit 14` as upstream prints it (Go's `%#08x` pads the digits, not the `0x`).
const MASQ_MARK: &str = "0x00004000";
/// The ServiceCIDR the bench cluster takes ClusterIPs from ([`crate::cluster::cluster_ip`]);
/// 1.33 watches ServiceCIDRs and drops traffic to unallocated addresses in them.
const SERVICE_CIDR: &str = "10.96.0.0/12";
/// iptables mode drops per-endpoint comments above this many endpoints ("large cluster mode").
const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// nftables base chains: name, type, hook, priority (knftables prints `dstnat-10` as `-110`).
const BASE_CHAINS: [(&str, &str, &str, i32); 8] = [
    ("filter-prerouting", "filter", "prerouting", -110),
    ("filter-input", "filter", "input", -110),
    ("filter-forward", "filter", "forward", -110),
    ("filter-output", "filter", "output", -110),
    ("filter-output-post-dnat", "filter", "output", -90),
    ("nat-prerouting", "nat", "prerouting", -100),
    ("nat-output", "nat", "output", -100),
    ("nat-postrouting", "nat", "postrouting", 100),
];

/// Regular chains jumped to from base chains: destination, source, match before the jump.
const JUMP_CHAINS: [(&str, &str, &str); 11] = [
    ("nodeport-endpoints-check", "filter-input", "ct state new"),
    ("service-endpoints-check", "filter-input", "ct state new"),
    ("service-endpoints-check", "filter-forward", "ct state new"),
    ("service-endpoints-check", "filter-output", "ct state new"),
    ("firewall-check", "filter-prerouting", "ct state new"),
    ("firewall-check", "filter-output", "ct state new"),
    ("services", "nat-output", ""),
    ("services", "nat-prerouting", ""),
    ("masquerading", "nat-postrouting", ""),
    ("cluster-ips-check", "filter-forward", "ct state new"),
    ("cluster-ips-check", "filter-output-post-dnat", "ct state new"),
];

/// kube-proxy 1.33 nftables mode's full ruleset for `state` as `nft -f` input, knftables-style
/// (`add table ip kube-proxy { comment "..." ; }`, `add chain …`, `add set/map …`, `add rule …`,
/// `add element …` lines, one object per line, a `flush table`-free first sync).
///
/// This is the transaction of the first sync after kube-proxy starts on a node with no
/// `kube-proxy` table: the base chains are added and deleted once (upstream does so to pick up
/// changed hook priorities), every chain is added then flushed, the shared sets and maps are
/// flushed and refilled. `node` is this node's name (which endpoints are local); NodePorts are
/// accepted on the first IPv4 InternalIP of the state's Node.
pub fn nft_ruleset(state: &ClusterState, node: &str, cluster_cidr: &str) -> String {
    let mut out = String::with_capacity(8192 + state.service_count() * 2048);
    // Writing into a String cannot fail.
    let _ = write_nft_ruleset(&mut out, state, node, cluster_cidr);
    out
}

/// The incremental transaction kube-proxy 1.33 sends when the service `changed` goes from its
/// state in `before` to its state in `after` (endpoints added/removed, or the service
/// added/removed): flush and refill the service chain(s), add new endpoint chains, delete the
/// removed ones and their map elements, as upstream's partial sync does.
///
/// Upstream's partial sync re-adds and flushes every chain of the changed service and refills
/// it, adds or replaces only the set and map elements whose value changed, deletes elements and
/// affinity sets that went away, and flushes the chains that went away. It deletes those chains
/// in a later transaction (at least a second later, for kernels before 6.2); here that deletion
/// is appended to the same text, so one `nft -f` leaves no stale chain behind.
pub fn nft_service_update(
    before: &ClusterState,
    after: &ClusterState,
    changed: &NamespacedName,
    node: &str,
    cluster_cidr: &str,
) -> String {
    let mut out = String::with_capacity(16384);
    // Writing into a String cannot fail.
    let _ = write_nft_update(&mut out, before, after, changed, node, cluster_cidr);
    out
}

/// kube-proxy iptables mode's nat table for `state` as `iptables-restore` input (`*nat` … `COMMIT`),
/// KUBE-SERVICES with one rule per service port in order, the service `last` placed last,
/// KUBE-SVC-* chains with `-m statistic --mode random --probability` per endpoint,
/// KUBE-SEP-* with the masquerade-mark rule and DNAT, KUBE-MARK-MASQ, KUBE-POSTROUTING,
/// KUBE-NODEPORTS; jumps from PREROUTING/OUTPUT/POSTROUTING. Chain names hashed as upstream
/// (sha256 + base32, first 16 chars).
///
/// Each service port has its ClusterIP rule in KUBE-SERVICES (plus one per LoadBalancer or
/// external IP, as upstream); `last`'s rules come after every other service's, followed only by
/// upstream's tail jump to KUBE-NODEPORTS, which must stay last. The jumps from the built-in
/// chains, which upstream adds with separate `iptables -I` calls, are part of the text, so apply
/// it to an empty nat table (or without `--noflush`).
pub fn iptables_restore(state: &ClusterState, node: &str, cluster_cidr: &str, last: &NamespacedName) -> String {
    let mut out = String::with_capacity(8192 + state.service_count() * 2048);
    // Writing into a String cannot fail.
    let _ = write_iptables(&mut out, state, node, cluster_cidr, last);
    out
}

// ---------------------------------------------------------------------------------------------
// What upstream computes for one service port

/// One IPv4 service port with its endpoints sorted into the lists upstream programs.
struct Port<'a> {
    sp: &'a ServicePort,
    proto: &'static str,
    cluster_ip: IpAddr,
    eps: Categorized,
    /// Every endpoint of the port, usable or not (iptables' large-cluster threshold counts these).
    total: usize,
}

impl Port<'_> {
    fn uses_cluster_chain(&self) -> bool {
        !self.eps.cluster.is_empty() && self.sp.uses_cluster_endpoints()
    }

    fn uses_local_chain(&self) -> bool {
        !self.eps.local.is_empty() && self.sp.uses_local_endpoints()
    }

    fn has_internal(&self) -> bool {
        self.eps.has_any && !(self.sp.internal_policy_local && self.eps.local.is_empty())
    }

    fn has_external(&self) -> bool {
        self.eps.has_any && !(self.sp.external_local() && self.eps.local.is_empty())
    }

    /// The external chain is needed even without externally usable endpoints, for the
    /// short-circuit rules.
    fn uses_external_chain(&self) -> bool {
        self.eps.has_any && self.sp.externally_accessible()
    }

    fn lb_ips(&self) -> impl Iterator<Item = &IpAddr> {
        self.sp.load_balancer_ips.iter().filter(|ip| ip.is_ipv4())
    }

    fn external_ips(&self) -> impl Iterator<Item = &IpAddr> {
        self.sp.external_ips.iter().filter(|ip| ip.is_ipv4())
    }

    fn source_ranges(&self) -> impl Iterator<Item = &ipnet::IpNet> {
        self.sp.load_balancer_source_ranges.iter().filter(|n| IpFamily::of_net(n) == IpFamily::V4)
    }

    fn has_firewall(&self) -> bool {
        self.lb_ips().next().is_some() && self.source_ranges().next().is_some()
    }

    /// Whether the node's own address is inside a source range (then LB IPs are let through).
    fn allows_node(&self, node_ip: Option<IpAddr>) -> bool {
        node_ip.is_some_and(|ip| self.source_ranges().any(|n| n.contains(&ip)))
    }

    /// Positions in `eps.reachable` of a list's endpoints (reachable is their sorted union).
    fn positions<'e>(&'e self, list: &'e [Endpoint]) -> impl Iterator<Item = usize> + 'e {
        list.iter().filter_map(|ep| self.eps.reachable.binary_search_by_key(&(ep.ip, ep.port), |e| (e.ip, e.port)).ok())
    }
}

fn node_view<'a>(state: &'a ClusterState, node: &'a str) -> NodeView<'a> {
    let zone = state.node().filter(|n| n.name == node).and_then(|n| n.zone());
    NodeView { name: node, zone }
}

/// The node's primary IPv4 address: where nftables mode accepts NodePorts by default.
fn node_ip(state: &ClusterState) -> Option<IpAddr> {
    state.node()?.host_ips.iter().copied().find(IpAddr::is_ipv4)
}

fn ports_of<'a>(state: &ClusterState, svc: &'a ServiceInfo, node: &NodeView<'_>) -> Vec<Port<'a>> {
    svc.ports
        .iter()
        .filter_map(|sp| {
            let cluster_ip = sp.cluster_ip(IpFamily::V4)?;
            let all = state.endpoints(&sp.name, IpFamily::V4);
            let eps = categorize(&all, sp, node);
            Some(Port { sp, proto: sp.name.protocol.name(), cluster_ip, eps, total: all.len() })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// nftables

/// nftables names of one service port's objects.
struct NftNames {
    service: String,
    local: String,
    external: String,
    firewall: String,
    /// `HASH-ns/name/proto/port__ip/port` per reachable endpoint (for `endpoint-` and `affinity-`).
    eps: Vec<String>,
}

impl NftNames {
    fn new(p: &Port<'_>) -> NftNames {
        let base = service_port_base(&p.sp.name);
        NftNames {
            service: format!("service-{base}"),
            local: format!("local-{base}"),
            external: format!("external-{base}"),
            firewall: format!("firewall-{base}"),
            eps: p.eps.reachable.iter().map(|ep| endpoint_base(&p.sp.name, ep)).collect(),
        }
    }

    fn internal<'n>(&'n self, p: &Port<'_>) -> &'n str {
        if p.sp.internal_policy_local { &self.local } else { &self.service }
    }

    fn external_policy<'n>(&'n self, p: &Port<'_>) -> &'n str {
        if p.sp.external_local() { &self.local } else { &self.service }
    }

    /// Visits every chain the port uses, in the order upstream ensures them, as prefix and rest
    /// (endpoint chains are `endpoint-` and their base; the full ruleset needs no `String` each).
    fn visit_chains(&self, p: &Port<'_>, mut f: impl FnMut(&str, &str) -> fmt::Result) -> fmt::Result {
        for b in &self.eps {
            f("endpoint-", b)?;
        }
        if p.uses_cluster_chain() {
            f("", &self.service)?;
        }
        if p.uses_local_chain() {
            f("", &self.local)?;
        }
        if p.uses_external_chain() {
            f("", &self.external)?;
        }
        if p.has_firewall() {
            f("", &self.firewall)?;
        }
        Ok(())
    }

    fn chains(&self, p: &Port<'_>) -> Vec<String> {
        let mut chains = Vec::with_capacity(self.eps.len() + 3);
        let _ = self.visit_chains(p, |prefix, rest| {
            chains.push(format!("{prefix}{rest}"));
            Ok(())
        });
        chains
    }

    fn affinity_sets(&self, p: &Port<'_>) -> Vec<String> {
        match p.sp.session_affinity_secs {
            Some(_) => self.eps.iter().map(|b| format!("affinity-{b}")).collect(),
            None => Vec::new(),
        }
    }
}

/// One element of a shared set or map.
struct Elem {
    set: &'static str,
    key: String,
    /// The verdict of a map element; `None` in a set.
    value: Option<String>,
    comment: Option<String>,
}

/// The elements upstream keeps for a port in the shared sets and maps.
fn nft_elements(p: &Port<'_>, n: &NftNames) -> Vec<Elem> {
    let spn = p.sp.name.to_string();
    let (proto, port) = (p.proto, p.sp.port);
    let key = |ip: &IpAddr| format!("{ip} . {proto} . {port}");
    // Nothing anywhere: reject; only external traffic without local endpoints: drop.
    let internal_verdict = if p.eps.has_any { "drop" } else { "goto reject-chain" };
    let external_verdict = internal_verdict;
    let no_endpoint = |set: &'static str, key: String, verdict: &str| Elem {
        set,
        key,
        value: Some(verdict.to_string()),
        comment: Some(spn.clone()),
    };
    let jump = |set: &'static str, key: String, chain: &str| Elem {
        set,
        key,
        value: Some(format!("goto {chain}")),
        comment: None,
    };

    let mut out = vec![Elem { set: "cluster-ips", key: p.cluster_ip.to_string(), value: None, comment: None }];
    if p.has_internal() {
        out.push(jump("service-ips", key(&p.cluster_ip), n.internal(p)));
    } else {
        out.push(no_endpoint("no-endpoint-services", key(&p.cluster_ip), internal_verdict));
    }
    for ip in p.external_ips() {
        if p.eps.has_any {
            out.push(jump("service-ips", key(ip), &n.external));
        }
        if !p.has_external() {
            out.push(no_endpoint("no-endpoint-services", key(ip), external_verdict));
        }
    }
    for ip in p.lb_ips() {
        if p.eps.has_any {
            out.push(jump("service-ips", key(ip), &n.external));
        }
        if p.has_firewall() {
            out.push(jump("firewall-ips", key(ip), &n.firewall));
        }
    }
    if !p.has_external() {
        for ip in p.lb_ips() {
            out.push(no_endpoint("no-endpoint-services", key(ip), external_verdict));
        }
    }
    if let Some(node_port) = p.sp.node_port {
        if p.eps.has_any {
            out.push(jump("service-nodeports", format!("{proto} . {node_port}"), &n.external));
        }
        if !p.has_external() {
            out.push(no_endpoint("no-endpoint-nodeports", format!("{proto} . {node_port}"), external_verdict));
        }
    }
    out
}

fn write_add_elem(out: &mut String, e: &Elem) -> fmt::Result {
    write!(out, "add element {T} {} {{ {}", e.set, e.key)?;
    if let Some(c) = &e.comment {
        write!(out, " comment \"{c}\"")?;
    }
    if let Some(v) = &e.value {
        write!(out, " : {v}")?;
    }
    out.write_str(" }\n")
}

/// Add, then flush: a chain a sync touches is emptied and refilled, whether or not it existed.
fn write_ensure_chain(out: &mut String, chain: &str) -> fmt::Result {
    write_ensure_chain_parts(out, "", chain)
}

fn write_ensure_chain_parts(out: &mut String, prefix: &str, rest: &str) -> fmt::Result {
    // push_str rather than write!: this runs twice per endpoint.
    for verb in ["add chain ", "flush chain "] {
        for part in [verb, T, " ", prefix, rest, "\n"] {
            out.push_str(part);
        }
    }
    Ok(())
}

/// The table, base chains, shared chains, sets and maps (upstream's `setupNFTables`).
fn write_nft_setup(out: &mut String, node_ip: Option<IpAddr>) -> fmt::Result {
    writeln!(out, "add table {T} {{ comment \"rules for kube-proxy\" ; }}")?;
    for (name, ..) in BASE_CHAINS {
        writeln!(out, "add chain {T} {name}")?;
        writeln!(out, "delete chain {T} {name}")?;
    }
    for (name, kind, hook, priority) in BASE_CHAINS {
        writeln!(out, "add chain {T} {name} {{ type {kind} hook {hook} priority {priority} ; }}")?;
        writeln!(out, "flush chain {T} {name}")?;
    }
    let mut created: Vec<&str> = Vec::new();
    for (dst, src, extra) in JUMP_CHAINS {
        if !created.contains(&dst) {
            write_ensure_chain(out, dst)?;
            created.push(dst);
        }
        let sep = if extra.is_empty() { "" } else { " " };
        writeln!(out, "add rule {T} {src} {extra}{sep}jump {dst}")?;
    }
    write_ensure_chain(out, "mark-for-masquerade")?;
    writeln!(out, "add rule {T} mark-for-masquerade mark set mark or {MASQ_MARK}")?;
    writeln!(out, "add rule {T} masquerading mark and {MASQ_MARK} == 0 return")?;
    writeln!(out, "add rule {T} masquerading mark set mark xor {MASQ_MARK}")?;
    writeln!(out, "add rule {T} masquerading masquerade fully-random")?;

    writeln!(out, "add set {T} cluster-ips {{ type ipv4_addr ; comment \"Active ClusterIPs\" ; }}")?;
    writeln!(
        out,
        "add rule {T} cluster-ips-check ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\""
    )?;
    writeln!(
        out,
        "add rule {T} cluster-ips-check ip daddr {{ {SERVICE_CIDR} }} drop comment \"Drop traffic to unallocated ClusterIPs\""
    )?;

    // 1.33's default `--nodeport-addresses primary`: a set of the node's IPs rather than
    // `fib daddr type local`.
    writeln!(out, "add set {T} nodeport-ips {{ type ipv4_addr ; comment \"IPs that accept NodePort traffic\" ; }}")?;
    writeln!(out, "flush set {T} nodeport-ips")?;
    if let Some(ip) = node_ip {
        writeln!(out, "add element {T} nodeport-ips {{ {ip} }}")?;
    }

    writeln!(
        out,
        "add map {T} no-endpoint-services {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to services with no endpoints\" ; }}"
    )?;
    writeln!(
        out,
        "add map {T} no-endpoint-nodeports {{ type inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to service nodeports with no endpoints\" ; }}"
    )?;
    writeln!(
        out,
        "add chain {T} reject-chain {{ comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ; }}"
    )?;
    writeln!(out, "flush chain {T} reject-chain")?;
    writeln!(out, "add rule {T} reject-chain reject")?;
    writeln!(
        out,
        "add rule {T} service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services"
    )?;
    writeln!(
        out,
        "add rule {T} nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports"
    )?;

    writeln!(
        out,
        "add map {T} firewall-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment \"destinations that are subject to LoadBalancerSourceRanges\" ; }}"
    )?;
    writeln!(out, "add rule {T} firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips")?;

    writeln!(
        out,
        "add map {T} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }}"
    )?;
    writeln!(
        out,
        "add map {T} service-nodeports {{ type inet_proto . inet_service : verdict ; comment \"NodePort traffic\" ; }}"
    )?;
    writeln!(out, "add rule {T} services ip daddr . meta l4proto . th dport vmap @service-ips")?;
    writeln!(out, "add rule {T} services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports")?;

    // A full sync empties the shared sets and maps and refills them.
    writeln!(out, "flush set {T} cluster-ips")?;
    for map in ["service-ips", "firewall-ips", "no-endpoint-services", "no-endpoint-nodeports", "service-nodeports"] {
        writeln!(out, "flush map {T} {map}")?;
    }
    Ok(())
}

/// The rules (and affinity sets) of one port's chains; the chains already exist and are empty.
fn write_nft_port_rules(
    out: &mut String,
    p: &Port<'_>,
    n: &NftNames,
    cidr: &str,
    node_ip: Option<IpAddr>,
) -> fmt::Result {
    let proto = p.proto;
    if p.has_internal() && !cidr.is_empty() {
        // Off-cluster sources reaching a ClusterIP (a static route to the service range) may
        // bounce to another node: masquerade them.
        writeln!(
            out,
            "add rule {T} {} ip daddr {} {proto} dport {} ip saddr != {cidr} jump mark-for-masquerade",
            n.internal(p),
            p.cluster_ip,
            p.sp.port
        )?;
    }
    if p.uses_external_chain() {
        let ext = &n.external;
        if !p.sp.external_local() {
            writeln!(out, "add rule {T} {ext} jump mark-for-masquerade")?;
        } else {
            // Upstream always has the Cluster chain here; the guard keeps the text loadable if
            // the model ever leaves it out.
            let cluster = p.uses_cluster_chain();
            if cluster && !cidr.is_empty() {
                writeln!(
                    out,
                    "add rule {T} {ext} ip saddr {cidr} goto {} comment \"short-circuit pod traffic\"",
                    n.service
                )?;
            }
            writeln!(
                out,
                "add rule {T} {ext} fib saddr type local jump mark-for-masquerade comment \"masquerade local traffic\""
            )?;
            if cluster {
                writeln!(
                    out,
                    "add rule {T} {ext} fib saddr type local goto {} comment \"short-circuit local traffic\"",
                    n.service
                )?;
            }
        }
        if p.has_external() {
            writeln!(out, "add rule {T} {ext} goto {}", n.external_policy(p))?;
        }
    }
    if p.has_firewall() {
        write!(out, "add rule {T} {} ip saddr != {{ ", n.firewall)?;
        let mut first = true;
        for range in p.source_ranges() {
            write!(out, "{}{range}", if first { "" } else { " , " })?;
            first = false;
        }
        if p.allows_node(node_ip) {
            for ip in p.lb_ips() {
                write!(out, " , {ip}")?;
            }
        }
        out.write_str(" } drop\n")?;
    }
    if let Some(secs) = p.sp.session_affinity_secs {
        for b in &n.eps {
            writeln!(out, "add set {T} affinity-{b} {{ type ipv4_addr ; flags dynamic,timeout ; timeout {secs}s ; }}")?;
        }
    }
    if p.uses_cluster_chain() {
        write_nft_balance(out, p, n, &n.service, &p.eps.cluster)?;
    }
    if p.uses_local_chain() {
        write_nft_balance(out, p, n, &n.local, &p.eps.local)?;
    }
    let affinity = p.sp.session_affinity_secs.is_some();
    for (ep, b) in p.eps.reachable.iter().zip(&n.eps) {
        // push_str rather than write! where it runs per endpoint.
        let rule = |out: &mut String| {
            for part in ["add rule ", T, " endpoint-", b.as_str(), " "] {
                out.push_str(part);
            }
        };
        // Hairpin: an endpoint reaching itself through the service must be masqueraded.
        rule(out);
        writeln!(out, "ip saddr {} jump mark-for-masquerade", ep.ip)?;
        if affinity {
            rule(out);
            writeln!(out, "update @affinity-{b} {{ ip saddr }}")?;
        }
        rule(out);
        // IPv4 only, so no brackets around the address.
        writeln!(out, "meta l4proto {proto} dnat to {}:{}", ep.ip, ep.port)?;
    }
    Ok(())
}

/// Affinity lookups, then one rule with an anonymous verdict map over the endpoints.
fn write_nft_balance(out: &mut String, p: &Port<'_>, n: &NftNames, chain: &str, list: &[Endpoint]) -> fmt::Result {
    if p.sp.session_affinity_secs.is_some() {
        for i in p.positions(list) {
            let b = &n.eps[i];
            writeln!(out, "add rule {T} {chain} ip saddr @affinity-{b} goto endpoint-{b}")?;
        }
    }
    write!(out, "add rule {T} {chain} numgen random mod {} vmap {{ ", list.len())?;
    for (k, i) in p.positions(list).enumerate() {
        write!(out, "{}{k} : goto endpoint-{}", if k == 0 { "" } else { " , " }, n.eps[i])?;
    }
    out.write_str(" }\n")
}

fn write_nft_ruleset(out: &mut String, state: &ClusterState, node: &str, cidr: &str) -> fmt::Result {
    let nv = node_view(state, node);
    let node_ip = node_ip(state);
    write_nft_setup(out, node_ip)?;
    for svc in state.services() {
        for p in ports_of(state, svc, &nv) {
            let n = NftNames::new(&p);
            n.visit_chains(&p, |prefix, rest| write_ensure_chain_parts(out, prefix, rest))?;
            for e in nft_elements(&p, &n) {
                write_add_elem(out, &e)?;
            }
            write_nft_port_rules(out, &p, &n, cidr, node_ip)?;
        }
    }
    Ok(())
}

/// What one service has in the table: chains, affinity sets, elements by (set, key) → value.
#[derive(Default)]
struct ServiceObjects {
    chains: BTreeSet<String>,
    sets: BTreeSet<String>,
    elems: HashMap<(&'static str, String), Option<String>>,
}

fn service_objects(state: &ClusterState, name: &NamespacedName, node: &str) -> ServiceObjects {
    let mut objs = ServiceObjects::default();
    let Some(svc) = state.service(name) else { return objs };
    for p in ports_of(state, svc, &node_view(state, node)) {
        let n = NftNames::new(&p);
        objs.chains.extend(n.chains(&p));
        objs.sets.extend(n.affinity_sets(&p));
        objs.elems.extend(nft_elements(&p, &n).into_iter().map(|e| ((e.set, e.key), e.value)));
    }
    objs
}

fn write_nft_update(
    out: &mut String,
    before: &ClusterState,
    after: &ClusterState,
    changed: &NamespacedName,
    node: &str,
    cidr: &str,
) -> fmt::Result {
    let old = service_objects(before, changed, node);
    let mut new = ServiceObjects::default();
    if let Some(svc) = after.service(changed) {
        let node_ip = node_ip(after);
        for p in ports_of(after, svc, &node_view(after, node)) {
            let n = NftNames::new(&p);
            let chains = n.chains(&p);
            for chain in &chains {
                write_ensure_chain(out, chain)?;
            }
            new.chains.extend(chains);
            new.sets.extend(n.affinity_sets(&p));
            for e in nft_elements(&p, &n) {
                // Upstream remembers what it wrote and sends only what differs.
                match old.elems.get(&(e.set, e.key.clone())) {
                    Some(value) if *value == e.value => {}
                    Some(_) => {
                        writeln!(out, "delete element {T} {} {{ {} }}", e.set, e.key)?;
                        write_add_elem(out, &e)?;
                    }
                    None => write_add_elem(out, &e)?,
                }
                new.elems.insert((e.set, e.key), e.value);
            }
            write_nft_port_rules(out, &p, &n, cidr, node_ip)?;
        }
    }
    let stale_chains: Vec<&String> = old.chains.difference(&new.chains).collect();
    for chain in &stale_chains {
        writeln!(out, "flush chain {T} {chain}")?;
    }
    for set in old.sets.difference(&new.sets) {
        writeln!(out, "delete set {T} {set}")?;
    }
    let mut gone: Vec<&(&str, String)> = old.elems.keys().filter(|k| !new.elems.contains_key(*k)).collect();
    gone.sort();
    for (set, key) in gone {
        writeln!(out, "delete element {T} {set} {{ {key} }}")?;
    }
    // Upstream's deferred deletion of the flushed chains, merged into this transaction.
    for chain in &stale_chains {
        writeln!(out, "delete chain {T} {chain}")?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// iptables

/// First 16 characters of base32(sha256(input)): upstream's iptables chain-name hash.
fn iptables_hash(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    let mut encoded = BASE32.encode(&digest);
    encoded.truncate(16);
    encoded
}

/// iptables names of one service port's chains.
struct IptNames {
    /// `ns/name:port`, upstream's comment text.
    spn: String,
    svc: String,
    svl: String,
    ext: String,
    fw: String,
    /// `KUBE-SEP-…` per reachable endpoint.
    seps: Vec<String>,
}

impl IptNames {
    fn new(p: &Port<'_>) -> IptNames {
        let spn = p.sp.name.to_string();
        let hash = iptables_hash(&format!("{spn}{}", p.proto));
        let seps = p
            .eps
            .reachable
            .iter()
            .map(|ep| format!("KUBE-SEP-{}", iptables_hash(&format!("{spn}{}{}", p.proto, ep.address()))))
            .collect();
        IptNames {
            svc: format!("KUBE-SVC-{hash}"),
            svl: format!("KUBE-SVL-{hash}"),
            ext: format!("KUBE-EXT-{hash}"),
            fw: format!("KUBE-FW-{hash}"),
            spn,
            seps,
        }
    }
}

/// The nat table's text, in two parts as upstream builds it: chain declarations, then rules.
struct Nat {
    chains: String,
    rules: String,
    /// Per-endpoint comments are dropped in large clusters, as upstream does.
    large: bool,
    /// `1/n` with ten decimals, by `n` (upstream caches these too).
    probabilities: Vec<String>,
}

impl Nat {
    fn chain(&mut self, name: &str) -> fmt::Result {
        writeln!(self.chains, ":{name} - [0:0]")
    }

    fn probability(&mut self, n: usize) -> &str {
        while self.probabilities.len() <= n {
            let k = self.probabilities.len().max(1);
            self.probabilities.push(format!("{:.10}", 1.0 / k as f64));
        }
        &self.probabilities[n]
    }

    /// ` -m comment --comment <text>` unless in large-cluster mode.
    fn comment(&self, text: fmt::Arguments<'_>) -> String {
        if self.large { String::new() } else { format!(" -m comment --comment {text}") }
    }

    fn port(&mut self, p: &Port<'_>, cidr: &str, node_ip: Option<IpAddr>) -> fmt::Result {
        let n = IptNames::new(p);
        let (spn, proto, port) = (&n.spn, p.proto, p.sp.port);
        let internal = if p.sp.internal_policy_local { &n.svl } else { &n.svc };
        let external_policy = if p.sp.external_local() { &n.svl } else { &n.svc };
        let uses_fw = p.eps.has_any && p.has_firewall();
        let lb_target = if uses_fw { &n.fw } else { &n.ext };

        // Dispatch. (Services without usable endpoints get REJECT/DROP rules in the filter
        // table, which this nat-only text leaves out.)
        if p.has_internal() {
            writeln!(
                self.rules,
                "-A KUBE-SERVICES -m comment --comment \"{spn} cluster IP\" -m {proto} -p {proto} -d {} --dport {port} -j {internal}",
                p.cluster_ip
            )?;
        }
        if p.eps.has_any {
            for ip in p.external_ips() {
                writeln!(
                    self.rules,
                    "-A KUBE-SERVICES -m comment --comment \"{spn} external IP\" -m {proto} -p {proto} -d {ip} --dport {port} -j {}",
                    n.ext
                )?;
            }
            for ip in p.lb_ips() {
                writeln!(
                    self.rules,
                    "-A KUBE-SERVICES -m comment --comment \"{spn} loadbalancer IP\" -m {proto} -p {proto} -d {ip} --dport {port} -j {lb_target}"
                )?;
            }
            if let Some(node_port) = p.sp.node_port {
                writeln!(
                    self.rules,
                    "-A KUBE-NODEPORTS -m comment --comment {spn} -m {proto} -p {proto} --dport {node_port} -j {}",
                    n.ext
                )?;
            }
        }

        if p.has_internal() && !cidr.is_empty() {
            writeln!(
                self.rules,
                "-A {internal} -m comment --comment \"{spn} cluster IP\" -m {proto} -p {proto} -d {} --dport {port} ! -s {cidr} -j KUBE-MARK-MASQ",
                p.cluster_ip
            )?;
        }

        if p.uses_external_chain() {
            self.chain(&n.ext)?;
            let ext = &n.ext;
            if !p.sp.external_local() {
                writeln!(
                    self.rules,
                    "-A {ext} -m comment --comment \"masquerade traffic for {spn} external destinations\" -j KUBE-MARK-MASQ"
                )?;
            } else {
                // As in nftables: only jump to the Cluster chain if it exists.
                let cluster = p.uses_cluster_chain();
                if cluster && !cidr.is_empty() {
                    writeln!(
                        self.rules,
                        "-A {ext} -m comment --comment \"pod traffic for {spn} external destinations\" -s {cidr} -j {}",
                        n.svc
                    )?;
                }
                writeln!(
                    self.rules,
                    "-A {ext} -m comment --comment \"masquerade LOCAL traffic for {spn} external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ"
                )?;
                if cluster {
                    writeln!(
                        self.rules,
                        "-A {ext} -m comment --comment \"route LOCAL traffic for {spn} external destinations\" -m addrtype --src-type LOCAL -j {}",
                        n.svc
                    )?;
                }
            }
            if p.has_external() {
                writeln!(self.rules, "-A {ext} -j {external_policy}")?;
            }
        }

        if uses_fw {
            self.chain(&n.fw)?;
            for range in p.source_ranges() {
                writeln!(
                    self.rules,
                    "-A {} -m comment --comment \"{spn} loadbalancer IP\" -s {range} -j {}",
                    n.fw, n.ext
                )?;
            }
            if p.allows_node(node_ip) {
                for ip in p.lb_ips() {
                    writeln!(
                        self.rules,
                        "-A {} -m comment --comment \"{spn} loadbalancer IP\" -s {ip} -j {}",
                        n.fw, n.ext
                    )?;
                }
            }
            // Anything left is dropped by KUBE-PROXY-FIREWALL in the filter table.
            writeln!(
                self.rules,
                "-A {} -m comment --comment \"other traffic to {spn} will be dropped by KUBE-PROXY-FIREWALL\"",
                n.fw
            )?;
        }

        if p.uses_cluster_chain() {
            self.chain(&n.svc)?;
            self.balance(p, &n, &n.svc, &p.eps.cluster)?;
        }
        if p.uses_local_chain() {
            self.chain(&n.svl)?;
            self.balance(p, &n, &n.svl, &p.eps.local)?;
        }

        let affinity = p.sp.session_affinity_secs.is_some();
        for (ep, sep) in p.eps.reachable.iter().zip(&n.seps) {
            self.chain(sep)?;
            let comment = self.comment(format_args!("{spn}"));
            writeln!(self.rules, "-A {sep}{comment} -s {} -j KUBE-MARK-MASQ", ep.ip)?;
            write!(self.rules, "-A {sep}{comment}")?;
            if affinity {
                write!(self.rules, " -m recent --name {sep} --set")?;
            }
            writeln!(self.rules, " -m {proto} -p {proto} -j DNAT --to-destination {}", ep.address())?;
        }
        Ok(())
    }

    /// Affinity checks, then one `statistic` rule per endpoint (the last unconditional).
    fn balance(&mut self, p: &Port<'_>, n: &IptNames, chain: &str, list: &[Endpoint]) -> fmt::Result {
        if let Some(secs) = p.sp.session_affinity_secs {
            for i in p.positions(list) {
                let ep = &p.eps.reachable[i];
                let comment = self.comment(format_args!("\"{} -> {}\"", n.spn, ep.address()));
                let sep = &n.seps[i];
                writeln!(
                    self.rules,
                    "-A {chain}{comment} -m recent --name {sep} --rcheck --seconds {secs} --reap -j {sep}"
                )?;
            }
        }
        let count = list.len();
        for (k, i) in p.positions(list).enumerate() {
            let comment = self.comment(format_args!("\"{} -> {}\"", n.spn, p.eps.reachable[i].address()));
            write!(self.rules, "-A {chain}{comment}")?;
            if k + 1 < count {
                let probability = self.probability(count - k).to_string();
                write!(self.rules, " -m statistic --mode random --probability {probability}")?;
            }
            writeln!(self.rules, " -j {}", n.seps[i])?;
        }
        Ok(())
    }
}

fn write_iptables(
    out: &mut String,
    state: &ClusterState,
    node: &str,
    cidr: &str,
    last: &NamespacedName,
) -> fmt::Result {
    let nv = node_view(state, node);
    let ordered = state.services().filter(|s| s.name != *last).chain(state.service(last));
    let ports: Vec<Port<'_>> = ordered.flat_map(|svc| ports_of(state, svc, &nv)).collect();
    let total: usize = ports.iter().map(|p| p.total).sum();
    let capacity = out.capacity();
    let mut nat = Nat {
        chains: String::with_capacity(capacity / 4),
        rules: String::with_capacity(capacity),
        large: total > LARGE_CLUSTER_ENDPOINTS,
        probabilities: Vec::new(),
    };
    for chain in ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"] {
        nat.chain(chain)?;
    }
    writeln!(nat.rules, "-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN")?;
    // Clear the mark so a packet that traverses the stack again is not masqueraded twice.
    writeln!(nat.rules, "-A KUBE-POSTROUTING -j MARK --xor-mark {MASQ_MARK}")?;
    writeln!(
        nat.rules,
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
    )?;
    writeln!(nat.rules, "-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}")?;

    let node_ip = node_ip(state);
    for p in &ports {
        nat.port(p, cidr, node_ip)?;
    }
    // Default nodePortAddresses (all local addresses) with localhost NodePorts allowed.
    writeln!(
        nat.rules,
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
    )?;

    out.push_str("*nat\n");
    out.push_str(&nat.chains);
    out.push_str("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    out.push_str("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    out.push_str("-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n");
    out.push_str(&nat.rules);
    out.push_str("COMMIT\n");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;
    use std::process::{Command, Output, Stdio};
    use std::time::Instant;

    use super::*;
    use crate::cluster::{self, Size};

    const NODE: &str = "node1";
    const CIDR: &str = "10.128.0.0/9";

    fn small() -> ClusterState {
        cluster::state(Size { services: 30, endpoints: 3 })
    }

    fn name(i: usize) -> NamespacedName {
        cluster::service(i).name
    }

    fn lines_starting<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
        text.lines().filter(|l| l.starts_with(prefix)).collect()
    }

    #[test]
    fn nft_ruleset_has_upstreams_shape() {
        let text = nft_ruleset(&small(), NODE, CIDR);
        assert!(text.starts_with("add table ip kube-proxy { comment \"rules for kube-proxy\" ; }\n"));
        assert!(!text.contains("flush table"));
        // Every endpoint is reachable (Cluster policy everywhere): 30 × 3 endpoint chains.
        assert_eq!(lines_starting(&text, "add chain ip kube-proxy endpoint-").len(), 90);
        let service_chains = lines_starting(&text, "add chain ip kube-proxy service-");
        assert_eq!(service_chains.iter().filter(|l| l.contains('/')).count(), 30);
        assert_eq!(lines_starting(&text, "add element ip kube-proxy cluster-ips ").len(), 30);
        assert_eq!(
            lines_starting(&text, "add element ip kube-proxy service-ips ").len(),
            30 + 2,
            "30 ClusterIPs + 2 LB IPs"
        );
        // NodePorts: services 0, 10, 20 and the LoadBalancers 5, 25.
        assert_eq!(lines_starting(&text, "add element ip kube-proxy service-nodeports ").len(), 5);
        assert!(
            text.contains("add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips\n")
        );
        assert!(text.contains("add element ip kube-proxy nodeport-ips { 192.168.0.2 }\n"));
        assert!(text.contains("add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }\n"));

        // The anonymous verdict map, with upstream's chain names.
        let svc1 = service_port_base(&cluster::service(1).ports[0].name);
        let ep = |j| {
            endpoint_base(
                &cluster::service(1).ports[0].name,
                &small().endpoints(&cluster::service(1).ports[0].name, IpFamily::V4)[j],
            )
        };
        assert!(svc1.ends_with("-ns1/svc1/tcp/p"));
        let expected = format!(
            "add rule ip kube-proxy service-{svc1} numgen random mod 3 vmap {{ 0 : goto endpoint-{} , 1 : goto endpoint-{} , 2 : goto endpoint-{} }}\n",
            ep(0),
            ep(1),
            ep(2)
        );
        assert!(text.contains(&expected), "missing {expected}");
        let ip = cluster::cluster_ip(1);
        assert!(text.contains(&format!(
            "add rule ip kube-proxy service-{svc1} ip daddr {ip} tcp dport 80 ip saddr != {CIDR} jump mark-for-masquerade\n"
        )));
        let ep0 = &small().endpoints(&cluster::service(1).ports[0].name, IpFamily::V4)[0];
        assert!(text.contains(&format!(
            "add rule ip kube-proxy endpoint-{} ip saddr {} jump mark-for-masquerade\n",
            ep(0),
            ep0.ip
        )));
        assert!(text.contains(&format!(
            "add rule ip kube-proxy endpoint-{} meta l4proto tcp dnat to {}\n",
            ep(0),
            ep0.address()
        )));
        // UDP services DNAT with their protocol.
        assert!(text.contains(" meta l4proto udp dnat to "));
    }

    #[test]
    fn nft_affinity_and_external_policies() {
        let state = small();
        let text = nft_ruleset(&state, NODE, CIDR);
        // Service 3 has ClientIP affinity: a set per endpoint, updated in the endpoint chain and
        // checked in the service chain before the numgen rule.
        let spn3 = &cluster::service(3).ports[0].name;
        let base3 = service_port_base(spn3);
        let eps3 = state.endpoints(spn3, IpFamily::V4);
        for ep in &eps3 {
            let b = endpoint_base(spn3, ep);
            assert!(text.contains(&format!(
                "add set ip kube-proxy affinity-{b} {{ type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }}\n"
            )));
            assert!(
                text.contains(&format!("add rule ip kube-proxy endpoint-{b} update @affinity-{b} {{ ip saddr }}\n"))
            );
            assert!(text.contains(&format!(
                "add rule ip kube-proxy service-{base3} ip saddr @affinity-{b} goto endpoint-{b}\n"
            )));
        }
        let service3: Vec<&str> = lines_starting(&text, &format!("add rule ip kube-proxy service-{base3} "));
        assert!(service3.last().is_some_and(|l| l.contains("numgen random mod 3 vmap")), "{service3:?}");
        assert_eq!(lines_starting(&text, "add set ip kube-proxy affinity-").len(), 6, "services 3 and 28");

        // Service 0: NodePort with externalTrafficPolicy Local; its one endpoint on node1 is
        // local, so the external chain falls through to the local chain.
        let base0 = service_port_base(&cluster::service(0).ports[0].name);
        let ext0: Vec<&str> = lines_starting(&text, &format!("add rule ip kube-proxy external-{base0} "));
        assert_eq!(ext0.len(), 4, "{ext0:?}");
        assert!(ext0[0].contains(&format!("ip saddr {CIDR} goto service-{base0}")));
        assert!(ext0[3].ends_with(&format!("goto local-{base0}")));
        assert!(
            text.contains(&format!(
                "add rule ip kube-proxy local-{base0} numgen random mod 1 vmap {{ 0 : goto endpoint-"
            ))
        );
        assert!(text.contains(&format!(
            "add element ip kube-proxy service-nodeports {{ tcp . 30000 : goto external-{base0} }}\n"
        )));

        // Service 5: LoadBalancer with Cluster policy: masquerade, then the service chain.
        let base5 = service_port_base(&cluster::service(5).ports[0].name);
        let ext5: Vec<&str> = lines_starting(&text, &format!("add rule ip kube-proxy external-{base5} "));
        assert_eq!(
            ext5,
            vec![
                format!("add rule ip kube-proxy external-{base5} jump mark-for-masquerade"),
                format!("add rule ip kube-proxy external-{base5} goto service-{base5}"),
            ]
        );
        assert!(text.contains(&format!(
            "add element ip kube-proxy service-ips {{ 203.0.0.5 . tcp . 80 : goto external-{base5} }}\n"
        )));
    }

    #[test]
    fn nft_local_policy_without_local_endpoints_drops_external_traffic() {
        let mut state = small();
        // Service 0's endpoints all move off node1.
        let mut slice = cluster::slice(0, 3, 0);
        for ep in &mut slice.endpoints {
            ep.node_name = Some("node7".into());
        }
        state.upsert_slice(slice);
        let text = nft_ruleset(&state, NODE, CIDR);
        let base0 = service_port_base(&cluster::service(0).ports[0].name);
        assert!(!text.contains(&format!("add chain ip kube-proxy local-{base0}")));
        assert!(text.contains(
            "add element ip kube-proxy no-endpoint-nodeports { tcp . 30000 comment \"ns0/svc0:p\" : drop }\n"
        ));
        let ext0: Vec<&str> = lines_starting(&text, &format!("add rule ip kube-proxy external-{base0} "));
        assert_eq!(ext0.len(), 3, "short-circuit rules only: {ext0:?}");
    }

    /// Service `i`'s slice with only its first `n` of 3 endpoints (asking `cluster::slice` for
    /// fewer endpoints would renumber them all).
    fn shrunk(i: usize, n: usize) -> nftproxy::model::EndpointSliceInfo {
        let mut slice = cluster::slice(i, 3, 0);
        slice.endpoints.truncate(n);
        slice
    }

    fn before_after(change: impl FnOnce(&mut ClusterState)) -> (ClusterState, ClusterState) {
        let before = small();
        let mut after = before.clone();
        change(&mut after);
        (before, after)
    }

    #[test]
    fn update_for_a_removed_endpoint() {
        let (before, after) = before_after(|s| {
            s.upsert_slice(shrunk(1, 2));
        });
        let text = nft_service_update(&before, &after, &name(1), NODE, CIDR);
        let spn = &cluster::service(1).ports[0].name;
        let base = service_port_base(spn);
        let removed = endpoint_base(spn, &before.endpoints(spn, IpFamily::V4)[2]);
        assert!(
            text.contains(&format!(
                "add chain ip kube-proxy service-{base}\nflush chain ip kube-proxy service-{base}\n"
            ))
        );
        assert!(text.contains("numgen random mod 2 vmap { 0 : goto endpoint-"));
        assert!(text.contains(&format!("flush chain ip kube-proxy endpoint-{removed}\n")));
        assert!(text.ends_with(&format!("delete chain ip kube-proxy endpoint-{removed}\n")));
        assert!(!text.contains(&format!("add chain ip kube-proxy endpoint-{removed}")));
        // The remaining endpoint chains are rewritten; no element changes.
        assert_eq!(lines_starting(&text, "add chain ip kube-proxy endpoint-").len(), 2);
        assert!(!text.contains("element"), "{text}");
        // Nothing of other services.
        assert!(!text.contains("/svc2/"));
    }

    #[test]
    fn update_for_replaced_endpoints_and_affinity() {
        // Service 3 has affinity; its endpoints all get new addresses.
        let (before, after) = before_after(|s| {
            s.upsert_slice(cluster::slice(3, 3, 1));
        });
        let text = nft_service_update(&before, &after, &name(3), NODE, CIDR);
        let spn = &cluster::service(3).ports[0].name;
        let old: BTreeSet<String> = before.endpoints(spn, IpFamily::V4).iter().map(|e| endpoint_base(spn, e)).collect();
        let new: BTreeSet<String> = after.endpoints(spn, IpFamily::V4).iter().map(|e| endpoint_base(spn, e)).collect();
        let gone: Vec<&String> = old.difference(&new).collect();
        let added: Vec<&String> = new.difference(&old).collect();
        assert!(!gone.is_empty() && !added.is_empty());
        for b in &gone {
            assert!(text.contains(&format!("delete chain ip kube-proxy endpoint-{b}\n")));
            assert!(text.contains(&format!("delete set ip kube-proxy affinity-{b}\n")));
        }
        for b in &added {
            assert!(text.contains(&format!("add chain ip kube-proxy endpoint-{b}\n")));
            assert!(text.contains(&format!("add set ip kube-proxy affinity-{b} ")));
        }
    }

    #[test]
    fn update_for_a_removed_and_an_added_service() {
        let ip = cluster::cluster_ip(5);
        let (with, without) = before_after(|s| {
            s.remove_service(&name(5));
            s.remove_slice(&cluster::slice(5, 3, 0).name);
        });
        let removal = nft_service_update(&with, &without, &name(5), NODE, CIDR);
        let base = service_port_base(&cluster::service(5).ports[0].name);
        assert!(!removal.contains("add "), "{removal}");
        for line in [
            format!("delete element ip kube-proxy cluster-ips {{ {ip} }}"),
            format!("delete element ip kube-proxy service-ips {{ {ip} . tcp . 80 }}"),
            "delete element ip kube-proxy service-ips { 203.0.0.5 . tcp . 80 }".to_string(),
            "delete element ip kube-proxy service-nodeports { tcp . 32700 }".to_string(),
            format!("delete chain ip kube-proxy service-{base}"),
            format!("delete chain ip kube-proxy external-{base}"),
        ] {
            assert!(removal.lines().any(|l| l == line), "missing {line} in\n{removal}");
        }
        assert_eq!(lines_starting(&removal, "delete chain ip kube-proxy endpoint-").len(), 3);

        let addition = nft_service_update(&without, &with, &name(5), NODE, CIDR);
        assert!(addition.contains(&format!("add element ip kube-proxy cluster-ips {{ {ip} }}\n")));
        assert!(
            addition.contains(&format!(
                "add element ip kube-proxy service-ips {{ {ip} . tcp . 80 : goto service-{base} }}\n"
            ))
        );
        assert!(!addition.contains("delete"), "{addition}");
        assert_eq!(lines_starting(&addition, "add chain ip kube-proxy endpoint-").len(), 3);
    }

    #[test]
    fn update_when_the_last_endpoint_goes() {
        let (before, after) = before_after(|s| {
            s.upsert_slice(cluster::slice(1, 0, 0));
        });
        let text = nft_service_update(&before, &after, &name(1), NODE, CIDR);
        let ip = cluster::cluster_ip(1);
        assert!(text.contains(&format!(
            "add element ip kube-proxy no-endpoint-services {{ {ip} . tcp . 80 comment \"ns1/svc1:p\" : goto reject-chain }}\n"
        )));
        assert!(text.contains(&format!("delete element ip kube-proxy service-ips {{ {ip} . tcp . 80 }}\n")));
        assert_eq!(lines_starting(&text, "delete chain ").len(), 4, "service chain and 3 endpoint chains");
    }

    #[test]
    fn iptables_chain_names_match_upstream_test_vectors() {
        assert_eq!(iptables_hash("ns1/svc1:p80tcp"), "XPGD46QRK7WJZT7O");
        assert_eq!(iptables_hash("ns1/svc1:p80tcp10.180.0.1:80"), "SXIVWICOYRO3J4NJ");
    }

    #[test]
    fn iptables_restore_has_upstreams_shape() {
        let state = small();
        let last = name(7);
        let text = iptables_restore(&state, NODE, CIDR, &last);
        assert!(text.starts_with("*nat\n:KUBE-SERVICES - [0:0]\n"));
        assert!(text.ends_with("COMMIT\n"));
        assert_eq!(lines_starting(&text, ":KUBE-SEP-").len(), 90);
        assert_eq!(lines_starting(&text, ":KUBE-SVC-").len(), 30);
        assert_eq!(lines_starting(&text, ":KUBE-SVL-").len(), 2, "services 0 and 20");
        assert_eq!(lines_starting(&text, ":KUBE-EXT-").len(), 5);
        assert!(text.contains("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n"));
        assert!(text.contains("-A KUBE-MARK-MASQ -j MARK --or-mark 0x00004000\n"));

        // KUBE-SERVICES: one ClusterIP rule per service port, `last` after all others, then
        // the NodePort tail.
        let services: Vec<&str> = lines_starting(&text, "-A KUBE-SERVICES ");
        let cluster_ip_rules: Vec<&&str> = services.iter().filter(|l| l.contains(" cluster IP\"")).collect();
        assert_eq!(cluster_ip_rules.len(), 30);
        assert!(
            cluster_ip_rules[29]
                .contains(&format!("\"ns7/svc7:p cluster IP\" -m udp -p udp -d {} --dport 53", cluster::cluster_ip(7)))
        );
        assert!(services[services.len() - 2].contains("ns7/svc7:p cluster IP"));
        assert!(services[services.len() - 1].ends_with("-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"));

        // Load balancing: probabilities 1/3, 1/2, then unconditional.
        let spn = &cluster::service(1).ports[0].name;
        let svc = format!("KUBE-SVC-{}", iptables_hash(&format!("{spn}tcp")));
        let rules: Vec<&str> = lines_starting(&text, &format!("-A {svc} "));
        assert_eq!(rules.len(), 4, "masquerade + 3 endpoints: {rules:?}");
        assert!(rules[0].ends_with(&format!("! -s {CIDR} -j KUBE-MARK-MASQ")));
        assert!(rules[1].contains("-m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-"));
        assert!(rules[2].contains("-m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-"));
        assert!(!rules[3].contains("statistic"));
        let ep = &state.endpoints(spn, IpFamily::V4)[0];
        let sep = format!("KUBE-SEP-{}", iptables_hash(&format!("{spn}tcp{}", ep.address())));
        assert!(text.contains(&format!("-A {sep} -m comment --comment ns1/svc1:p -s {} -j KUBE-MARK-MASQ\n", ep.ip)));
        assert!(text.contains(&format!(
            "-A {sep} -m comment --comment ns1/svc1:p -m tcp -p tcp -j DNAT --to-destination {}\n",
            ep.address()
        )));

        // Affinity (services 3 and 28): recent checks before the statistic rules, set in the SEP.
        assert_eq!(text.matches("--rcheck --seconds 10800 --reap").count(), 6);
        assert_eq!(text.matches("-m recent --name KUBE-SEP-").count(), 12);
    }

    #[test]
    fn iptables_large_clusters_drop_endpoint_comments() {
        let state = cluster::state(Size { services: 200, endpoints: 6 });
        let text = iptables_restore(&state, NODE, CIDR, &name(0));
        assert!(lines_starting(&text, "-A KUBE-SEP-").iter().all(|l| !l.contains("--comment")));
        assert!(lines_starting(&text, "-A KUBE-SERVICES ").iter().all(|l| l.contains("--comment")));
    }

    #[test]
    fn two_thousand_by_ten_generates_quickly() {
        let state = cluster::state(Size { services: 2000, endpoints: 10 });
        let start = Instant::now();
        let nft = nft_ruleset(&state, NODE, CIDR);
        let ipt = iptables_restore(&state, NODE, CIDR, &name(1999));
        let took = start.elapsed();
        eprintln!("2000×10: nft {} bytes, iptables {} bytes in {took:?}", nft.len(), ipt.len());
        assert_eq!(lines_starting(&nft, "add chain ip kube-proxy endpoint-").len(), 20_000);
        assert_eq!(lines_starting(&ipt, ":KUBE-SEP-").len(), 20_000);
    }

    /// Run with `--ignored` to time the full-size anchors.
    #[test]
    #[ignore]
    fn ten_thousand_by_ten_generates_under_a_second() {
        let state = cluster::state(Size { services: 10_000, endpoints: 10 });
        let start = Instant::now();
        let nft = nft_ruleset(&state, NODE, CIDR);
        let nft_took = start.elapsed();
        let start = Instant::now();
        let ipt = iptables_restore(&state, NODE, CIDR, &name(9999));
        let ipt_took = start.elapsed();
        eprintln!("10000×10: nft {} bytes in {nft_took:?}, iptables {} bytes in {ipt_took:?}", nft.len(), ipt.len());
        assert!(nft_took.as_secs_f64() < 1.0 && ipt_took.as_secs_f64() < 1.0);
    }

    // --- validation with the real tools, only ever inside a new network namespace -------------

    fn can_use_netns() -> bool {
        if !nix::unistd::geteuid().is_root() {
            crate::lab::skip_test("needs root");
            return false;
        }
        match Command::new("unshare").args(["-n", "true"]).status() {
            Ok(s) if s.success() => true,
            _ => {
                crate::lab::skip_test("cannot create a network namespace (unshare -n)");
                false
            }
        }
    }

    /// `unshare -n <args>` with `input` on stdin.
    fn in_new_netns(args: &[&str], input: &str) -> Output {
        let mut child = Command::new("unshare")
            .arg("-n")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let input = input.to_owned();
        let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
        let out = child.wait_with_output().unwrap();
        // A tool that fails early stops reading: its exit status tells, not the broken pipe.
        let _ = writer.join();
        out
    }

    fn assert_ok(what: &str, out: &Output) {
        assert!(
            out.status.success(),
            "{what} failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }

    /// Loads `full` then `update` into a fresh namespace's nftables and lists the table.
    fn apply_in_new_netns(full: &str, update: &str) -> Output {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("full.nft"), dir.path().join("update.nft"));
        std::fs::write(&a, full).unwrap();
        std::fs::write(&b, update).unwrap();
        in_new_netns(
            &[
                "sh",
                "-c",
                r#"nft -f "$1" && nft -f "$2" && nft list table ip kube-proxy"#,
                "sh",
                a.to_str().unwrap(),
                b.to_str().unwrap(),
            ],
            "",
        )
    }

    #[test]
    fn texts_load_into_the_real_tools() {
        if !can_use_netns() {
            return;
        }
        let state = small();
        let full = nft_ruleset(&state, NODE, CIDR);
        assert_ok("nft -c -f (full ruleset)", &in_new_netns(&["nft", "-c", "-f", "-"], &full));
        let larger = nft_ruleset(&cluster::state(Size { services: 300, endpoints: 10 }), NODE, CIDR);
        assert_ok("nft -c -f (300×10)", &in_new_netns(&["nft", "-c", "-f", "-"], &larger));

        type Change = Box<dyn Fn(&mut ClusterState)>;
        let cases: Vec<(usize, Change)> = vec![
            (
                1,
                Box::new(|s| {
                    s.upsert_slice(shrunk(1, 2));
                }),
            ),
            (
                1,
                Box::new(|s| {
                    s.upsert_slice(cluster::slice(1, 5, 1));
                }),
            ),
            (
                1,
                Box::new(|s| {
                    s.upsert_slice(cluster::slice(1, 0, 0));
                }),
            ),
            (
                3,
                Box::new(|s| {
                    s.upsert_slice(cluster::slice(3, 3, 1));
                }),
            ),
            (
                0,
                Box::new(|s| {
                    s.upsert_slice(cluster::slice(0, 1, 2));
                }),
            ),
            (
                5,
                Box::new(|s| {
                    s.remove_service(&name(5));
                    s.remove_slice(&cluster::slice(5, 3, 0).name);
                }),
            ),
        ];
        for (i, change) in cases {
            let mut after = state.clone();
            change(&mut after);
            let update = nft_service_update(&state, &after, &name(i), NODE, CIDR);
            // Check mode on the concatenation (one transaction)...
            let both = format!("{full}{update}");
            assert_ok(
                &format!("nft -c -f (ruleset + update of svc{i})"),
                &in_new_netns(&["nft", "-c", "-f", "-"], &both),
            );
            // ...and for real, in sequence, in a namespace thrown away afterwards.
            let out = apply_in_new_netns(&full, &update);
            assert_ok(&format!("nft -f ruleset; nft -f update of svc{i}"), &out);
            let listing = String::from_utf8_lossy(&out.stdout);
            for line in lines_starting(&update, "delete chain ip kube-proxy ") {
                let chain = line.trim_start_matches("delete chain ip kube-proxy ");
                assert!(!listing.contains(&format!("chain {chain} {{")), "{chain} left behind");
            }
            // Re-adding the removed service must work too.
            let back = nft_service_update(&after, &state, &name(i), NODE, CIDR);
            assert_ok(
                &format!("nft -c -f (ruleset + update + back, svc{i})"),
                &in_new_netns(&["nft", "-c", "-f", "-"], &format!("{full}{update}{back}")),
            );
        }

        if Command::new("iptables-nft-restore").arg("--version").output().is_err() {
            crate::lab::skip_test(
                "the iptables part: iptables-nft-restore is not installed (apt-get install -y iptables)",
            );
            return;
        }
        let ipt = iptables_restore(&state, NODE, CIDR, &name(7));
        assert_ok("iptables-nft-restore --test", &in_new_netns(&["iptables-nft-restore", "--test"], &ipt));
        let large = iptables_restore(&cluster::state(Size { services: 300, endpoints: 10 }), NODE, CIDR, &name(0));
        assert_ok("iptables-nft-restore --test (300×10)", &in_new_netns(&["iptables-nft-restore", "--test"], &large));
    }
}
