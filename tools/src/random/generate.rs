//! Random but valid clusters from a seed: Services of every type with their EndpointSlices (or
//! selectors the EndpointSlice controller resolves), written as the YAML the API server takes.
//!
//! Every address is routable in the lab ([`super::lab`]): ClusterIPs in the lab's service range,
//! external and load-balancer IPs in the range the wan routes to node1, endpoints at pod
//! addresses (each pod answers on all of its addresses), NodePorts unique in the default range.
//! Consecutive seeds use alternate halves of the ClusterIP, NodePort and external ranges, so a
//! seed's objects can be created while the previous seed's are still being deleted.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::Ipv4Addr;

use nftproxy::net::L4Proto;

use super::lab::{self as rlab, POOL_PER_POD, SERVED_PORTS};

/// A small deterministic generator (SplitMix64): the same seed gives the same cluster on every
/// machine and with every version of the crate's dependencies.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x6e66_7470_726f_7879)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// One of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

/// A Service's type (headless is a ClusterIP Service without a ClusterIP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    ClusterIp,
    NodePort,
    LoadBalancer,
    Headless,
}

/// Where a Service port sends: a number, or a container port's name (selector Services).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetPort {
    Number(u16),
    Name(&'static str),
}

/// One Service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    pub name: String,
    pub protocol: L4Proto,
    pub port: u16,
    pub target: TargetPort,
    pub node_port: Option<u16>,
}

/// One endpoint of a selector-less Service's slices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub ip: Ipv4Addr,
    pub node: Option<&'static str>,
    pub zone: Option<&'static str>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    pub zone_hint: Option<&'static str>,
    pub node_hint: Option<&'static str>,
}

/// One port of a selector-less Service's slices (usually one per Service port, by name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
    pub protocol: L4Proto,
    pub port: u16,
}

/// One Service and, without a selector, its endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub name: String,
    pub kind: Kind,
    pub cluster_ip: Option<Ipv4Addr>,
    pub ports: Vec<Port>,
    /// A label selector over the lab's Pods (`key: value`); the controller writes the slices.
    pub selector: Option<&'static str>,
    pub external_ips: Vec<Ipv4Addr>,
    /// Written into `status.loadBalancer.ingress`, as a load-balancer controller would.
    pub lb_ingress: Vec<Ipv4Addr>,
    pub source_ranges: Vec<&'static str>,
    pub external_local: bool,
    pub internal_local: bool,
    pub health_check_node_port: Option<u16>,
    pub allocate_lb_node_ports: bool,
    pub affinity_seconds: Option<u32>,
    pub traffic_distribution: Option<&'static str>,
    pub slice_ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
    /// Endpoints per EndpointSlice (at most 1,000, the API's limit).
    pub per_slice: usize,
}

/// A generated cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scenario {
    pub seed: u64,
    pub services: Vec<Service>,
}

/// The label every generated object carries (the runner deletes by it).
pub const LABEL: &str = "nftproxy.io/random";

/// Zones of the lab's nodes (node1 is in zone-a).
const ZONES: [&str; 3] = ["zone-a", "zone-b", "zone-c"];
const NODES: [&str; 2] = ["node1", "node2"];
/// Source ranges a load balancer may have: one client, the other (and a range of no one), all.
const SOURCE_RANGES: [&[&str]; 3] =
    [&["192.168.50.100/32"], &["192.168.50.101/32", "10.0.0.0/8"], &["192.168.50.0/24"]];
/// Selectors over the lab's Pods ([`rlab::PODS`]).
const SELECTORS: [&str; 3] = ["app: web", "tier: front", "tier: back"];

/// Half of a range that seed `seed` uses: even seeds the lower, odd seeds the upper.
fn half(seed: u64, lo: u32, hi: u32) -> (u32, u32) {
    let mid = lo + (hi - lo) / 2;
    if seed.is_multiple_of(2) { (lo, mid) } else { (mid + 1, hi) }
}

/// Unique draws from a range.
struct Draw {
    lo: u32,
    hi: u32,
    used: BTreeSet<u32>,
}

impl Draw {
    fn new((lo, hi): (u32, u32)) -> Draw {
        Draw { lo, hi, used: BTreeSet::new() }
    }
    fn take(&mut self, rng: &mut Rng) -> u32 {
        loop {
            let v = rng.range(u64::from(self.lo), u64::from(self.hi)) as u32;
            if self.used.insert(v) {
                return v;
            }
        }
    }
}

/// The cluster of `seed`.
pub fn generate(seed: u64) -> Scenario {
    let mut rng = Rng::new(seed);
    // ClusterIPs 10.96.1.0–10.96.254.255 (10.96.0.x holds `kubernetes`, 10.96.255.x the
    // runner's sync markers), NodePorts 30000–32767, external IPs 203.0.113.10–249.
    let mut cluster_ips =
        Draw::new(half(seed, u32::from(Ipv4Addr::new(10, 96, 1, 0)), u32::from(Ipv4Addr::new(10, 96, 254, 255))));
    let mut node_ports = Draw::new(half(seed, 30000, 32767));
    let mut external =
        Draw::new(half(seed, u32::from(Ipv4Addr::new(203, 0, 113, 10)), u32::from(Ipv4Addr::new(203, 0, 113, 249))));
    // At most one large Service a seed: past 16 endpoints, over 1,023 with affinity, thousands.
    let large = match rng.below(100) {
        0..=11 => Some(rng.range(17, 60) as usize),
        12..=15 => Some(rng.range(1024, 1300) as usize),
        16..=18 => Some(rng.range(2000, 3200) as usize),
        _ => None,
    };
    let count = rng.range(2, 10) as usize;
    let large_at = rng.below(count as u64) as usize;
    let mut services = Vec::new();
    for i in 0..count {
        let size = if i == large_at { large } else { None };
        services.push(service(&mut rng, seed, i, size, &mut cluster_ips, &mut node_ports, &mut external));
    }
    Scenario { seed, services }
}

fn protocol(rng: &mut Rng) -> L4Proto {
    if rng.chance(70) { L4Proto::Tcp } else { L4Proto::Udp }
}

fn service(
    rng: &mut Rng,
    seed: u64,
    i: usize,
    large: Option<usize>,
    cluster_ips: &mut Draw,
    node_ports: &mut Draw,
    external: &mut Draw,
) -> Service {
    let kind = match (large, rng.below(100)) {
        (None, 0..=4) => Kind::Headless,
        (_, 0..=39) => Kind::ClusterIp,
        (_, 40..=69) => Kind::NodePort,
        _ => Kind::LoadBalancer,
    };
    let selector = (large.is_none() && rng.chance(15)).then(|| *rng.pick(&SELECTORS));
    let port_count = match rng.below(100) {
        0..=59 => 1,
        60..=89 => 2,
        90..=96 => 3,
        _ => rng.range(8, 40) as usize,
    };
    let mut ports = Vec::new();
    let mut numbers = BTreeSet::new();
    let exposes_node_ports = kind == Kind::NodePort || kind == Kind::LoadBalancer;
    let allocate_lb_node_ports = kind != Kind::LoadBalancer || rng.chance(85);
    for p in 0..port_count {
        let protocol = protocol(rng);
        let port = loop {
            let n = if rng.chance(50) { *rng.pick(&[80u16, 53, 443, 8080, 5000]) } else { rng.range(1, 20000) as u16 };
            if numbers.insert((n, protocol)) {
                break n;
            }
        };
        let target = match (selector, protocol) {
            (Some(_), L4Proto::Udp) if rng.chance(50) => TargetPort::Name(["dns", "altu"][rng.below(2) as usize]),
            (Some(_), _) if rng.chance(50) => TargetPort::Name(["http", "alt"][rng.below(2) as usize]),
            _ => TargetPort::Number(*rng.pick(&SERVED_PORTS)),
        };
        let node_port = (exposes_node_ports && allocate_lb_node_ports).then(|| node_ports.take(rng) as u16);
        ports.push(Port { name: format!("p{p}-{}", protocol.name()), protocol, port, target, node_port });
    }
    let external_ips: Vec<Ipv4Addr> = if kind != Kind::Headless && rng.chance(20) {
        (0..rng.range(1, 2)).map(|_| Ipv4Addr::from(external.take(rng))).collect()
    } else {
        Vec::new()
    };
    let lb_ingress: Vec<Ipv4Addr> = if kind == Kind::LoadBalancer && rng.chance(85) {
        (0..rng.range(1, 2)).map(|_| Ipv4Addr::from(external.take(rng))).collect()
    } else {
        Vec::new()
    };
    let source_ranges =
        if kind == Kind::LoadBalancer && rng.chance(35) { rng.pick(&SOURCE_RANGES).to_vec() } else { Vec::new() };
    let external_local = (exposes_node_ports || !external_ips.is_empty()) && rng.chance(40);
    let health_check_node_port = (kind == Kind::LoadBalancer && external_local).then(|| node_ports.take(rng) as u16);
    let internal_local = kind != Kind::Headless && rng.chance(20);
    let affinity_seconds = match (kind, large) {
        (Kind::Headless, _) => None,
        (_, Some(n)) if n > 1023 && n < 1400 => Some(rng.range(60, 10800) as u32),
        _ if rng.chance(15) => Some(if rng.chance(50) { 10800 } else { rng.range(1, 86400) as u32 }),
        _ => None,
    };
    let traffic_distribution =
        if rng.chance(25) { Some(*rng.pick(&["PreferClose", "PreferSameZone", "PreferSameNode"])) } else { None };
    // The slices' ports: one per Service port, by name; now and then one missing or renamed.
    let mut slice_ports: Vec<SlicePort> = ports
        .iter()
        .map(|p| SlicePort {
            name: p.name.clone(),
            protocol: p.protocol,
            port: match p.target {
                TargetPort::Number(n) => n,
                TargetPort::Name(_) => SERVED_PORTS[0],
            },
        })
        .collect();
    if slice_ports.len() > 1 && rng.chance(10) {
        slice_ports.remove(rng.below(slice_ports.len() as u64) as usize);
    }
    if rng.chance(5)
        && let Some(first) = slice_ports.first_mut()
    {
        first.name = format!("{}-renamed", first.name);
    }
    let endpoints = match (selector, large) {
        (Some(_), _) => Vec::new(),
        (None, Some(n)) => large_endpoints(rng, n),
        (None, None) => {
            let n = match rng.below(100) {
                0..=9 => 0,
                10..=89 => rng.range(1, 4) as usize,
                _ => rng.range(5, 16) as usize,
            };
            small_endpoints(rng, n)
        }
    };
    let per_slice = match rng.below(100) {
        0..=69 => 1000,
        70..=89 => 100,
        _ => rng.range(1, 8) as usize,
    };
    Service {
        name: format!("s{seed}-{i}"),
        kind,
        cluster_ip: (kind != Kind::Headless).then(|| Ipv4Addr::from(cluster_ips.take(rng))),
        ports,
        selector,
        external_ips,
        lb_ingress,
        source_ranges,
        external_local,
        internal_local,
        health_check_node_port,
        allocate_lb_node_ports,
        affinity_seconds,
        traffic_distribution,
        slice_ports,
        endpoints,
        per_slice,
    }
}

/// An endpoint's conditions: mostly ready, then the other states kubelet and the controller
/// write (conditions left out mean ready).
fn conditions(rng: &mut Rng) -> (Option<bool>, Option<bool>, Option<bool>) {
    match rng.below(100) {
        0..=59 => (Some(true), Some(true), Some(false)),
        60..=69 => (None, None, None),
        70..=79 => (Some(false), Some(false), Some(false)),
        80..=89 => (Some(false), Some(true), Some(true)),
        90..=94 => (Some(false), Some(false), Some(true)),
        _ => (Some(true), None, None),
    }
}

fn hints(rng: &mut Rng, all: bool) -> (Option<&'static str>, Option<&'static str>) {
    if !all && rng.chance(70) {
        return (None, None);
    }
    let zone = rng.chance(90).then(|| *rng.pick(&ZONES));
    let node = rng.chance(40).then(|| *rng.pick(&NODES));
    (zone, node)
}

/// A few endpoints at pod addresses (primary or extra), on either node or on none.
fn small_endpoints(rng: &mut Rng, n: usize) -> Vec<Endpoint> {
    let hinted = rng.chance(30);
    let mut used = BTreeSet::new();
    let mut out = Vec::new();
    while out.len() < n {
        let pod = rng.pick(&rlab::PODS);
        let ip = if rng.chance(40) { pod.ip } else { rlab::pool_address(pod, rng.below(POOL_PER_POD as u64) as usize) };
        if !used.insert(ip) {
            continue;
        }
        let node = if rng.chance(92) { Some(pod.node) } else { None };
        let zone = node.map(|n| if n == "node1" { ZONES[0] } else { ZONES[1] }).filter(|_| rng.chance(80));
        let (ready, serving, terminating) = conditions(rng);
        let (zone_hint, node_hint) = hints(rng, hinted);
        out.push(Endpoint { ip, node, zone, ready, serving, terminating, zone_hint, node_hint });
    }
    out
}

/// Many endpoints at consecutive extra addresses of the lab's pods, spread over both nodes.
fn large_endpoints(rng: &mut Rng, n: usize) -> Vec<Endpoint> {
    let hinted = rng.chance(20);
    let pods: Vec<&rlab::Pod> = rlab::pooled().collect();
    let start = rng.below((POOL_PER_POD - n.div_ceil(pods.len())) as u64) as usize;
    let mostly_ready = rng.chance(70);
    (0..n)
        .map(|k| {
            let pod = pods[k % pods.len()];
            let ip = rlab::pool_address(pod, start + k / pods.len());
            let (ready, serving, terminating) =
                if mostly_ready && rng.chance(95) { (Some(true), Some(true), Some(false)) } else { conditions(rng) };
            let (zone_hint, node_hint) = hints(rng, hinted);
            let zone = Some(if pod.node == "node1" { ZONES[0] } else { ZONES[1] });
            Endpoint { ip, node: Some(pod.node), zone, ready, serving, terminating, zone_hint, node_hint }
        })
        .collect()
}

impl Service {
    /// How many endpoints it has (selector Services: none written here).
    pub fn endpoint_count(&self) -> usize {
        self.endpoints.len()
    }
}

fn proto_name(p: L4Proto) -> &'static str {
    match p {
        L4Proto::Tcp => "TCP",
        L4Proto::Udp => "UDP",
        L4Proto::Sctp => "SCTP",
    }
}

fn ip_list(ips: &[Ipv4Addr]) -> String {
    ips.iter().map(|ip| format!("\"{ip}\"")).collect::<Vec<_>>().join(", ")
}

/// The Service's own YAML (without status).
pub fn service_yaml(s: &Service, out: &mut String) {
    let _ = writeln!(out, "apiVersion: v1\nkind: Service\nmetadata:\n  name: {}\n  namespace: default", s.name);
    let _ = writeln!(out, "  labels: {{{LABEL}: \"true\"}}\nspec:");
    let kind = match s.kind {
        Kind::ClusterIp | Kind::Headless => "ClusterIP",
        Kind::NodePort => "NodePort",
        Kind::LoadBalancer => "LoadBalancer",
    };
    let _ = writeln!(out, "  type: {kind}");
    match s.cluster_ip {
        Some(ip) => {
            let _ = writeln!(out, "  clusterIP: {ip}");
        }
        None => out.push_str("  clusterIP: None\n"),
    }
    if let Some(sel) = s.selector {
        let _ = writeln!(out, "  selector: {{{sel}}}");
    }
    if !s.external_ips.is_empty() {
        let _ = writeln!(out, "  externalIPs: [{}]", ip_list(&s.external_ips));
    }
    if !s.source_ranges.is_empty() {
        let ranges: Vec<String> = s.source_ranges.iter().map(|r| format!("\"{r}\"")).collect();
        let _ = writeln!(out, "  loadBalancerSourceRanges: [{}]", ranges.join(", "));
    }
    if s.kind == Kind::LoadBalancer && !s.allocate_lb_node_ports {
        out.push_str("  allocateLoadBalancerNodePorts: false\n");
    }
    if s.kind == Kind::NodePort || s.kind == Kind::LoadBalancer || !s.external_ips.is_empty() {
        let _ = writeln!(out, "  externalTrafficPolicy: {}", if s.external_local { "Local" } else { "Cluster" });
    }
    if let Some(port) = s.health_check_node_port {
        let _ = writeln!(out, "  healthCheckNodePort: {port}");
    }
    if s.internal_local {
        out.push_str("  internalTrafficPolicy: Local\n");
    }
    if let Some(seconds) = s.affinity_seconds {
        let _ = writeln!(
            out,
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {seconds}}}}}"
        );
    }
    if let Some(td) = s.traffic_distribution {
        let _ = writeln!(out, "  trafficDistribution: {td}");
    }
    out.push_str("  ports:\n");
    for p in &s.ports {
        let target = match &p.target {
            TargetPort::Number(n) => n.to_string(),
            TargetPort::Name(n) => (*n).to_string(),
        };
        let _ = write!(
            out,
            "  - {{name: {}, protocol: {}, port: {}, targetPort: {target}",
            p.name,
            proto_name(p.protocol),
            p.port
        );
        if let Some(np) = p.node_port {
            let _ = write!(out, ", nodePort: {np}");
        }
        out.push_str("}\n");
    }
}

/// The Service's EndpointSlices (selector-less Services only).
pub fn slices_yaml(s: &Service, out: &mut String) {
    if s.selector.is_some() {
        return;
    }
    let chunks: Vec<&[Endpoint]> =
        if s.endpoints.is_empty() { vec![&[]] } else { s.endpoints.chunks(s.per_slice.clamp(1, 1000)).collect() };
    for (k, chunk) in chunks.iter().enumerate() {
        let _ = writeln!(
            out,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {}-{k}\n  namespace: default",
            s.name
        );
        let _ = writeln!(
            out,
            "  labels: {{{LABEL}: \"true\", kubernetes.io/service-name: {}, endpointslice.kubernetes.io/managed-by: nftproxy-random}}\naddressType: IPv4",
            s.name
        );
        if s.slice_ports.is_empty() {
            out.push_str("ports: []\n");
        } else {
            out.push_str("ports:\n");
            for p in &s.slice_ports {
                let _ = writeln!(out, "- {{name: {}, protocol: {}, port: {}}}", p.name, proto_name(p.protocol), p.port);
            }
        }
        if chunk.is_empty() {
            out.push_str("endpoints: []\n");
            continue;
        }
        out.push_str("endpoints:\n");
        for e in *chunk {
            let _ = write!(out, "- addresses: [\"{}\"]", e.ip);
            if let Some(node) = e.node {
                let _ = write!(out, "\n  nodeName: {node}");
            }
            if let Some(zone) = e.zone {
                let _ = write!(out, "\n  zone: {zone}");
            }
            let mut conditions = Vec::new();
            for (name, v) in [("ready", e.ready), ("serving", e.serving), ("terminating", e.terminating)] {
                if let Some(v) = v {
                    conditions.push(format!("{name}: {v}"));
                }
            }
            let _ = write!(out, "\n  conditions: {{{}}}", conditions.join(", "));
            if e.zone_hint.is_some() || e.node_hint.is_some() {
                let mut hints = Vec::new();
                if let Some(z) = e.zone_hint {
                    hints.push(format!("forZones: [{{name: {z}}}]"));
                }
                if let Some(n) = e.node_hint {
                    hints.push(format!("forNodes: [{{name: {n}}}]"));
                }
                let _ = write!(out, "\n  hints: {{{}}}", hints.join(", "));
            }
            out.push('\n');
        }
    }
}

impl Scenario {
    /// Services and slices as one YAML stream (the load-balancer status as a comment: it is
    /// written through the status subresource).
    pub fn to_yaml(&self) -> String {
        let mut out = String::new();
        for (i, s) in self.services.iter().enumerate() {
            if i > 0 {
                out.push_str("---\n");
            }
            if !s.lb_ingress.is_empty() {
                let _ = writeln!(out, "# status.loadBalancer.ingress: [{}]", ip_list(&s.lb_ingress));
            }
            service_yaml(s, &mut out);
            slices_yaml(s, &mut out);
        }
        out
    }

    /// The Services' YAML only.
    pub fn services_yaml(&self) -> String {
        let mut out = String::new();
        for (i, s) in self.services.iter().enumerate() {
            if i > 0 {
                out.push_str("---\n");
            }
            service_yaml(s, &mut out);
        }
        out
    }

    /// The slices' YAML only (empty when every Service has a selector).
    pub fn slices_yaml(&self) -> String {
        let mut out = String::new();
        for s in &self.services {
            slices_yaml(s, &mut out);
        }
        out
    }

    /// Endpoints over all Services.
    pub fn endpoint_count(&self) -> usize {
        self.services.iter().map(Service::endpoint_count).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_cluster_every_time() {
        assert_eq!(generate(7), generate(7));
        assert_ne!(generate(7), generate(8));
    }

    #[test]
    fn addresses_and_ports_are_unique_and_in_their_ranges() {
        for seed in 0..300 {
            let s = generate(seed);
            let mut ips = BTreeSet::new();
            let mut node_ports = BTreeSet::new();
            for svc in &s.services {
                if let Some(ip) = svc.cluster_ip {
                    assert!(ip.octets()[0..2] == [10, 96] && (1..=254).contains(&ip.octets()[2]), "{ip}");
                    assert!(ips.insert(ip));
                }
                for ip in svc.external_ips.iter().chain(&svc.lb_ingress) {
                    assert!(ip.octets()[0..3] == [203, 0, 113], "{ip}");
                    assert!(ips.insert(*ip));
                }
                for np in svc.ports.iter().filter_map(|p| p.node_port).chain(svc.health_check_node_port) {
                    assert!((30000..=32767).contains(&np));
                    assert!(node_ports.insert(np));
                }
                let eps: BTreeSet<Ipv4Addr> = svc.endpoints.iter().map(|e| e.ip).collect();
                assert_eq!(eps.len(), svc.endpoints.len(), "seed {seed} {}", svc.name);
            }
        }
    }

    #[test]
    fn seeds_cover_the_shapes() {
        let all: Vec<Scenario> = (0..400).map(generate).collect();
        let services = || all.iter().flat_map(|s| s.services.iter());
        assert!(services().any(|s| s.endpoints.len() > 16 && s.endpoints.len() < 100));
        assert!(services().any(|s| s.endpoints.len() > 1023 && s.affinity_seconds.is_some()));
        assert!(services().any(|s| s.endpoints.len() >= 2000));
        assert!(services().any(|s| s.ports.len() >= 8));
        for kind in [Kind::ClusterIp, Kind::NodePort, Kind::LoadBalancer, Kind::Headless] {
            assert!(services().any(|s| s.kind == kind), "{kind:?}");
        }
        assert!(services().any(|s| s.selector.is_some()));
        assert!(services().any(|s| !s.source_ranges.is_empty() && !s.lb_ingress.is_empty()));
        assert!(services().any(|s| s.endpoints.iter().any(|e| e.terminating == Some(true) && e.serving == Some(true))));
    }
}
