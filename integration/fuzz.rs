//! Property tests over random manifests: YAML text of Services, EndpointSlices and Nodes —
//! valid, hostile and malformed mixed — fed through the manifests parser, the model, the planner
//! and the renderer.
//!
//! - `random_manifests_never_panic`: no panic anywhere on the way; every Service the model keeps
//!   holds what the API server guarantees (unique port names, ports and NodePorts, addresses of
//!   its ClusterIPs' families); every object name fits the kernel (≤ 255 bytes) and every
//!   comment nft (< 128 bytes); the plan applies to the fake kernel (references resolve,
//!   intervals do not overlap); and a well-formed sentinel service, placed among the random
//!   objects, is always planned whole.
//! - `random_manifests_render_what_the_kernel_accepts`: the rendered ruleset passes
//!   `nft -c -f FILE` (the kernel's check mode) in a fresh network namespace, never the root one.
//! - `the_hostile_corpus_renders_what_the_kernel_accepts`: the same for a fixed file of the worst
//!   cases (names at the length limits, thousands of ports and endpoints, family mix-ups).
//!
//! `PROPTEST_CASES` sets the number of cases of both properties (defaults: 256 without the
//! kernel, 64 with it); `PROPTEST_RNG_SEED` replays a run. What the properties found (a Service
//! keeping two ports with one number, an external IP of a family it has no ClusterIP in) is
//! fixed in `model::convert` and kept as deterministic tests in `core/src/manifests/hostile.rs` and in the
//! corpus here.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use nftproxy::config::{DetectLocal, ProxyConfig, parse_cidrs};
use nftproxy::model::{ClusterState, NamespacedName};
use nftproxy::net::IpFamily;
use nftproxy::netlink::{FakeNetfilter, Netfilter};
use nftproxy::nft::lower::lower_ruleset;
use nftproxy::nft::{ElementData, Ruleset, Value, WireRuleset, diff};
use nftproxy::plan::{NodePorts, PlanInput, plan};
use nftproxy::source::{manifests, state_from_manifests};
use nftproxy_tools::lab::Netns;

/// The node the plans are for.
const NODE: &str = "node1";
/// nftables names (tables, chains, sets) are at most 255 bytes (NFT_NAME_MAXLEN with the NUL).
const NAME_MAX: usize = 255;
/// nft refuses comments of 128 bytes or more.
const COMMENT_MAX: usize = 127;
/// Rulesets larger than this skip the fake kernel (see [`check_fake_kernel`]).
const FAKE_KERNEL_MAX_ELEMENTS: usize = 1000;

// ---------------------------------------------------------------------------------------------
// Generators. Each takes `h`, the weight of hostile choices against ~20 for plausible ones (0:
// a clean manifest, 1: a few bad fields, 5: mostly bad), and returns YAML text. Strings are
// written double-quoted (JSON escapes are valid YAML); a few hostile values are bare, so YAML's
// own typing (`null`, `0x50`, `[]`) gets exercised too. Pools are small, so services, slices and
// the Node refer to each other and collide (shared ClusterIPs, NodePorts).

/// A double-quoted YAML scalar.
fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// `[a, b, …]` of YAML values.
fn flow_list(items: &[String]) -> String {
    format!("[{}]", items.join(", "))
}

/// `[a, b, …]` of quoted strings.
fn quoted_list(items: &[String]) -> String {
    flow_list(&items.iter().map(|s| quoted(s)).collect::<Vec<_>>())
}

/// One of a few fixed strings.
fn pick(items: &'static [&'static str]) -> BoxedStrategy<String> {
    proptest::sample::select(items).prop_map(str::to_string).boxed()
}

/// What an address is for: each has its own small pool.
#[derive(Debug, Clone, Copy)]
enum Pool {
    Service,
    Pod,
    External,
    Node,
}

/// An address of the pool's family `v6`; hostile: the other family, any address, special
/// addresses and text that is no address at all.
fn ip_text(h: u32, v6: bool, pool: Pool) -> BoxedStrategy<String> {
    let in_pool = move |v6: bool| -> BoxedStrategy<String> {
        (0u8..3, 1u8..5)
            .prop_map(move |(a, b)| match (pool, v6) {
                (Pool::Service, false) => format!("10.96.{a}.{b}"),
                (Pool::Service, true) => format!("fd00:96::{a}:{b}"),
                (Pool::Pod, false) => format!("10.244.{a}.{b}"),
                (Pool::Pod, true) => format!("fd00:10:244::{a}:{b}"),
                (Pool::External, false) => format!("203.0.113.{}", a * 10 + b),
                (Pool::External, true) => format!("2001:db8::{a}:{b}"),
                (Pool::Node, false) => format!("192.168.0.{b}"),
                (Pool::Node, true) => format!("fd00:192:168::{b}"),
            })
            .boxed()
    };
    prop_oneof![
        20 => in_pool(v6),
        h => in_pool(!v6),
        h => any::<u32>().prop_map(|n| Ipv4Addr::from(n).to_string()),
        h => any::<u128>().prop_map(|n| Ipv6Addr::from(n).to_string()),
        h => pick(&[
            "0.0.0.0", "::", "127.0.0.1", "::1", "224.0.0.1", "ff02::1", "255.255.255.255", "169.254.0.1",
            "fe80::1", "::ffff:10.96.0.1", "64:ff9b::10.96.0.1", "::ffff:0.0.0.0", "2001:db8::",
        ]),
        h => pick(&[
            "10.96.0.300", "1.2.3", "", " ", " 10.96.0.1 ", "fe80::1%eth0", "None", "10.96.0.0/24", "not-an-ip",
            "١٠.٩٦.٠.١", "010.096.000.001", "10.96.0.1\n", "1:2:3:4:5:6:7:8:9", "10.96.0.1:80", "[fd00::1]",
        ]),
    ]
    .boxed()
}

/// A CIDR of family `v6`; hostile: any prefix length, the other family, garbage.
fn cidr_text(h: u32, v6: bool) -> BoxedStrategy<String> {
    let good = if v6 {
        pick(&["fd00::/8", "2001:db8::/32", "2001:db8::1/128", "::/0", "fd00:10:244::/64"])
    } else {
        pick(&["10.0.0.0/8", "192.168.0.0/16", "203.0.113.0/24", "203.0.113.7/32", "0.0.0.0/0", "192.168.0.0/24"])
    };
    prop_oneof![
        20 => good,
        h => (ip_text(h, v6, Pool::External), 0u8..140).prop_map(|(ip, len)| format!("{ip}/{len}")),
        h => pick(&["10.0.0.0/33", "/8", "10.0.0.0/-1", "10.0.0.1/24", "fd00::/129", "10.0.0.0", "any"]),
    ]
    .boxed()
}

/// An object name: from a small pool (so references match), random, at the length limits
/// (valid: 63 for labels, 253 for subdomains), and, hostile, past them, non-ASCII or otherwise
/// not a DNS name.
fn name_text(h: u32) -> BoxedStrategy<String> {
    prop_oneof![
        20 => pick(&["web", "db", "a", "b-c", "dns"]),
        2 => "[a-z][a-z0-9-]{0,20}[a-z0-9]",
        1 => Just("a".repeat(63)),
        h => Just("a".repeat(64)),
        h => Just(format!("{}.{}.{}.{}", "a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61))),
        h => Just("b".repeat(254)),
        h => Just("x".repeat(1000)),
        h => pick(&[
            "wéb", "ñs", "日本", "web\u{200b}", "Web", "-web", "web-", "", "a.b", "a..b", "1abc", "web_1", "null",
            "on", "0123", "we\"b", "we b", "we/b", "we:b", "we\\b", "we\nb", "we{b}",
        ]),
        h => "\\PC{1,12}",
    ]
    .boxed()
}

/// A namespace: the pool is tiny, so collisions are common.
fn namespace_text(h: u32) -> BoxedStrategy<String> {
    prop_oneof![20 => pick(&["ns", "default", "kube-system"]), 1 => Just("n".repeat(63)), h => name_text(h)].boxed()
}

/// A port name (IANA service name, at most 15 characters).
fn port_name_text(h: u32) -> BoxedStrategy<String> {
    prop_oneof![
        20 => pick(&["http", "https", "dns", "p", ""]),
        2 => "[a-z][a-z0-9-]{0,14}",
        1 => Just("x".repeat(15)),
        h => pick(&["a-very-long-port-name", "HTTP", "hţtp", "h t", "-", "h\"t", "h/t"]),
    ]
    .boxed()
}

/// A port number as YAML; hostile: 0, past 65535, negative, and values that are no integer
/// (which make the whole object unreadable).
fn port_text(h: u32) -> BoxedStrategy<String> {
    prop_oneof![
        20 => pick(&["80", "443", "53", "8080", "9000"]),
        5 => (1i64..=65535)
            // 7777 and 31777 are the sentinel's.
            .prop_map(|n| if n == 7777 || n == 31777 { n + 1 } else { n })
            .prop_map(|n| n.to_string()),
        1 => Just("65535".to_string()),
        h => pick(&["0", "65536", "-1", "-65535", "4294967376", "2147483647", "-2147483648"]),
        h => pick(&["99999999999999999999", "1.5", "\"80\"", "eighty", "null", "~", "0x50", "[]", "{}"]),
    ]
    .boxed()
}

/// A node port: a small pool (collisions), or any port.
fn node_port_text(h: u32) -> BoxedStrategy<String> {
    prop_oneof![10 => pick(&["30080", "30081", "30053", "32767"]), 2 => port_text(h)].boxed()
}

/// A protocol (`None`: the field is left out, TCP).
fn protocol_text(h: u32) -> BoxedStrategy<Option<String>> {
    prop_oneof![
        8 => Just(None),
        12 => pick(&["TCP", "UDP", "SCTP"]).prop_map(Some),
        h => pick(&["tcp", "ICMP", "", "TCP ", "HTTP", "Sctp", "6"]).prop_map(Some),
    ]
    .boxed()
}

/// A boolean; hostile: YAML 1.1 spellings and strings (unreadable for Kubernetes types).
fn bool_text(h: u32) -> BoxedStrategy<String> {
    prop_oneof![20 => pick(&["true", "false"]), h => pick(&["yes", "no", "1", "\"true\"", "null"])].boxed()
}

fn node_name_text(h: u32) -> BoxedStrategy<String> {
    prop_oneof![20 => pick(&["node1", "node2", "node3"]), h => name_text(h)].boxed()
}

fn zone_text(h: u32) -> BoxedStrategy<String> {
    prop_oneof![20 => pick(&["zone-a", "zone-b"]), h => name_text(h)].boxed()
}

/// One of a few values, or (hostile) something no one defined.
fn choice(h: u32, good: &'static [&'static str], bad: &'static [&'static str]) -> BoxedStrategy<String> {
    prop_oneof![20 => pick(good), h => pick(bad)].boxed()
}

/// One entry of `spec.ports`, kept structured so slices can refer to it.
#[derive(Debug, Clone)]
struct PortSpec {
    name: String,
    port: String,
    protocol: Option<String>,
    node_port: Option<String>,
}

impl PortSpec {
    fn yaml(&self) -> String {
        let mut s = format!("{{name: {}, port: {}", quoted(&self.name), self.port);
        if let Some(p) = &self.protocol {
            let _ = write!(s, ", protocol: {}", quoted(p));
        }
        if let Some(np) = &self.node_port {
            let _ = write!(s, ", nodePort: {np}");
        }
        s.push_str(", targetPort: 8080}");
        s
    }
}

fn service_port(h: u32) -> BoxedStrategy<PortSpec> {
    (port_name_text(h), port_text(h), protocol_text(h), proptest::option::of(node_port_text(h)))
        .prop_map(|(name, port, protocol, node_port)| PortSpec { name, port, protocol, node_port })
        .boxed()
}

/// `spec.ports`: a few ports, thousands (names `p0`, `p1`, …), or a hostile literal.
#[derive(Debug, Clone)]
enum Ports {
    List(Vec<PortSpec>),
    Many(usize),
    Raw(&'static str),
}

impl Ports {
    fn yaml(&self) -> String {
        match self {
            Ports::List(ports) => flow_list(&ports.iter().map(PortSpec::yaml).collect::<Vec<_>>()),
            Ports::Many(n) => flow_list(
                &(0..*n)
                    .map(|i| format!("{{name: p{i}, port: {}, nodePort: {}}}", 10000 + i, 40000 + i))
                    .collect::<Vec<_>>(),
            ),
            Ports::Raw(s) => s.to_string(),
        }
    }

    /// (name, protocol) of the ports a slice may name.
    fn names(&self) -> Vec<(String, Option<String>)> {
        match self {
            Ports::List(ports) => ports.iter().map(|p| (p.name.clone(), p.protocol.clone())).collect(),
            Ports::Many(n) => (0..(*n).min(4)).map(|i| (format!("p{i}"), None)).collect(),
            Ports::Raw(_) => vec![("a".into(), None), ("b".into(), None)],
        }
    }
}

fn ports(h: u32) -> BoxedStrategy<Ports> {
    prop_oneof![
        // Thousands of ports are rare: they are slow to parse in a debug build.
        200 => prop::collection::vec(service_port(h), 0..4).prop_map(Ports::List),
        1 => (1000usize..2500).prop_map(Ports::Many),
        h => proptest::sample::select(&[
            "null",
            "[{port: 80}, {port: 80}]",
            "[{name: a, port: 80}, {name: a, port: 81, protocol: UDP}]",
            "[{name: a, port: 80, nodePort: 30080}, {name: b, port: 81, nodePort: 30080}]",
            "[{name: a, port: 80}, {name: b, port: 80}]",
        ][..])
        .prop_map(Ports::Raw),
    ]
    .boxed()
}

/// The ClusterIP fields (`clusterIP`, `clusterIPs`, `ipFamilies`) and the families of the
/// addresses: consistent, or (hostile) mixed up, headless or missing.
fn cluster_ips(h: u32) -> BoxedStrategy<(String, Vec<bool>)> {
    let families = prop_oneof![
        12 => Just(vec![false]),
        4 => Just(vec![true]),
        4 => Just(vec![false, true]),
        2 => Just(vec![true, false]),
        h => Just(vec![false, false]),
    ];
    let form =
        prop_oneof![10 => Just(0u8), 5 => Just(1u8), 5 => Just(2u8), h => Just(3u8), h => Just(4u8), h => Just(5u8)];
    (families, form)
        .prop_flat_map(move |(families, form)| {
            let ips: Vec<BoxedStrategy<String>> = families.iter().map(|v6| ip_text(h, *v6, Pool::Service)).collect();
            (Just(families), Just(form), ips, choice(h, &["IPv4"], &["IPv6", "IPv5", ""]))
        })
        .prop_map(|(families, form, ips, odd_family)| {
            let names: Vec<String> = families.iter().map(|v6| if *v6 { "IPv6" } else { "IPv4" }.to_string()).collect();
            let first = ips.first().cloned().unwrap_or_default();
            let text = match form {
                // clusterIP only, the way single-stack services are often written.
                0 => format!("  clusterIP: {}\n", quoted(&first)),
                // Everything, as the API server fills it in.
                1 => format!(
                    "  clusterIP: {}\n  clusterIPs: {}\n  ipFamilies: {}\n",
                    quoted(&first),
                    quoted_list(&ips),
                    flow_list(&names)
                ),
                // clusterIPs and ipFamilies.
                2 => format!("  clusterIPs: {}\n  ipFamilies: {}\n", quoted_list(&ips), flow_list(&names)),
                // ipFamilies that do not match the addresses.
                3 => format!("  clusterIPs: {}\n  ipFamilies: [{odd_family}]\n", quoted_list(&ips)),
                // Headless.
                4 => "  clusterIP: None\n".to_string(),
                // clusterIP and clusterIPs[0] disagree (or nothing is set).
                _ => match ips.len() {
                    1 => String::new(),
                    _ => format!("  clusterIP: {}\n  clusterIPs: {}\n", quoted(&ips[1]), quoted_list(&ips)),
                },
            };
            (text, families)
        })
        .boxed()
}

/// A Service document and EndpointSlices for it (whose ports mostly match the service's).
fn service_with_slices(h: u32) -> BoxedStrategy<Vec<String>> {
    let meta = (namespace_text(h), name_text(h), choice(h, &[""], &["other", "nftproxy"]));
    let kind = choice(h, &["ClusterIP", "ClusterIP", "NodePort", "LoadBalancer"], &["ExternalName", "Bogus", ""]);
    let v6 = any::<bool>();
    let external = v6.prop_flat_map(move |v6| {
        (
            proptest::option::of(prop::collection::vec(ip_text(h, v6, Pool::External), 0..3)),
            proptest::option::of(prop::collection::vec(cidr_text(h, v6), 0..3)),
            proptest::option::of(prop::collection::vec(
                (ip_text(h, v6, Pool::External), proptest::option::of(choice(h, &["VIP", "Proxy"], &["Bogus"]))),
                0..3,
            )),
        )
    });
    let policies = (
        proptest::option::of(choice(h, &["Local", "Cluster"], &["Bogus"])),
        proptest::option::of(choice(h, &["Local", "Cluster"], &["Bogus"])),
        proptest::option::of(node_port_text(h)),
        proptest::option::of(choice(h, &["ClientIP", "None"], &["Bogus"])),
        proptest::option::of(choice(h, &["1", "10800", "86400"], &["86401", "0", "-5", "99999999999"])),
    );
    (meta, kind, cluster_ips(h), ports(h), external, policies)
        .prop_flat_map(move |((ns, name, proxy), kind, (cluster_ips, families), ports, external, policies)| {
            let mut s = String::from("apiVersion: v1\nkind: Service\nmetadata:\n");
            let _ = writeln!(s, "  name: {}\n  namespace: {}", quoted(&name), quoted(&ns));
            if !proxy.is_empty() {
                let _ = writeln!(s, "  labels: {{service.kubernetes.io/service-proxy-name: {proxy}}}");
            }
            let _ = writeln!(s, "spec:\n  type: {}", quoted(&kind));
            s.push_str(&cluster_ips);
            let _ = writeln!(s, "  ports: {}", ports.yaml());
            let (external_ips, ranges, ingress) = external;
            let (etp, itp, hc, affinity, timeout) = policies;
            if let Some(e) = external_ips {
                let _ = writeln!(s, "  externalIPs: {}", quoted_list(&e));
            }
            if let Some(r) = ranges {
                let _ = writeln!(s, "  loadBalancerSourceRanges: {}", quoted_list(&r));
            }
            if let Some(p) = etp {
                let _ = writeln!(s, "  externalTrafficPolicy: {p}");
            }
            if let Some(p) = itp {
                let _ = writeln!(s, "  internalTrafficPolicy: {p}");
            }
            if let Some(p) = hc {
                let _ = writeln!(s, "  healthCheckNodePort: {p}");
            }
            if let Some(a) = affinity {
                let _ = writeln!(s, "  sessionAffinity: {a}");
            }
            if let Some(t) = timeout {
                let _ = writeln!(s, "  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {t}}}}}");
            }
            if let Some(ing) = ingress {
                let items: Vec<String> = ing
                    .iter()
                    .map(|(ip, mode)| match mode {
                        Some(m) => format!("{{ip: {}, ipMode: {m}}}", quoted(ip)),
                        None => format!("{{ip: {}}}", quoted(ip)),
                    })
                    .collect();
                let _ = writeln!(s, "status:\n  loadBalancer:\n    ingress: {}", flow_list(&items));
            }
            let target = SliceTarget { namespace: ns, service: name, ports: ports.names(), families };
            (Just(s), prop::collection::vec(slice_doc(h, Some(target)), 0..3))
        })
        .prop_map(|(service, mut slices)| {
            slices.insert(0, service);
            slices
        })
        .boxed()
}

/// One endpoint of a slice of family `v6`.
fn endpoint(h: u32, v6: bool) -> BoxedStrategy<String> {
    let addresses = prop_oneof![
        20 => ip_text(h, v6, Pool::Pod).prop_map(|ip| vec![ip]),
        h => prop::collection::vec(ip_text(h, v6, Pool::Pod), 0..3),
    ];
    let conditions =
        (proptest::option::of(bool_text(h)), proptest::option::of(bool_text(h)), proptest::option::of(bool_text(h)));
    let hints = (prop::collection::vec(zone_text(h), 0..3), prop::collection::vec(node_name_text(h), 0..3));
    (
        addresses,
        proptest::option::of(conditions),
        proptest::option::of(node_name_text(h)),
        proptest::option::of(zone_text(h)),
        proptest::option::weighted(0.2, hints),
    )
        .prop_map(|(addresses, conditions, node, zone, hints)| {
            let mut s = format!("  - addresses: {}\n", quoted_list(&addresses));
            if let Some((ready, serving, terminating)) = conditions {
                let c: Vec<String> = [("ready", ready), ("serving", serving), ("terminating", terminating)]
                    .into_iter()
                    .filter_map(|(k, v)| v.map(|v| format!("{k}: {v}")))
                    .collect();
                let _ = writeln!(s, "    conditions: {{{}}}", c.join(", "));
            }
            if let Some(n) = node {
                let _ = writeln!(s, "    nodeName: {}", quoted(&n));
            }
            if let Some(z) = zone {
                let _ = writeln!(s, "    zone: {}", quoted(&z));
            }
            if let Some((zones, nodes)) = hints {
                let z: Vec<String> = zones.iter().map(|z| format!("{{name: {}}}", quoted(z))).collect();
                let n: Vec<String> = nodes.iter().map(|n| format!("{{name: {}}}", quoted(n))).collect();
                let _ = writeln!(s, "    hints: {{forZones: {}, forNodes: {}}}", flow_list(&z), flow_list(&n));
            }
            s
        })
        .boxed()
}

/// Many ready endpoints over three nodes.
fn many_endpoints(n: usize, v6: bool) -> String {
    let mut s = String::new();
    for i in 0..n {
        let ip =
            if v6 { format!("fd00:10:244::1:{:x}", i + 1) } else { format!("10.244.{}.{}", 10 + i / 250, i % 250 + 1) };
        let _ = writeln!(s, "  - addresses: [\"{ip}\"]\n    nodeName: node{}", i % 3 + 1);
    }
    s
}

/// The Service a slice is generated for.
#[derive(Debug, Clone)]
struct SliceTarget {
    namespace: String,
    service: String,
    /// (name, protocol) of the service's ports.
    ports: Vec<(String, Option<String>)>,
    /// The families of its ClusterIPs (true: IPv6).
    families: Vec<bool>,
}

/// One entry of a slice's `ports`: one of the service's ports (with a target port number), or
/// a random one.
fn slice_port(h: u32, names: Vec<(String, Option<String>)>) -> BoxedStrategy<String> {
    let random = (port_name_text(h), protocol_text(h)).prop_map(|(n, p)| (n, p));
    let named = if names.is_empty() { random.clone().boxed() } else { proptest::sample::select(names).boxed() };
    (
        prop_oneof![20 => named.prop_map(Some), 2 => random.prop_map(Some), h => Just(None)],
        prop_oneof![20 => port_text(h).prop_map(Some), h => Just(None)],
    )
        .prop_map(|(name, port)| {
            let mut fields = Vec::new();
            if let Some((name, protocol)) = name {
                fields.push(format!("name: {}", quoted(&name)));
                if let Some(p) = protocol {
                    fields.push(format!("protocol: {}", quoted(&p)));
                }
            }
            if let Some(p) = port {
                fields.push(format!("port: {p}"));
            }
            format!("{{{}}}", fields.join(", "))
        })
        .boxed()
}

/// An EndpointSlice document, for `target` or for a random service.
fn slice_doc(h: u32, target: Option<SliceTarget>) -> BoxedStrategy<String> {
    let target = match target {
        Some(t) => Just(t).boxed(),
        None => (namespace_text(h), name_text(h), prop::collection::vec((port_name_text(h), protocol_text(h)), 0..3))
            .prop_map(|(namespace, service, ports)| SliceTarget {
                namespace,
                service,
                ports,
                families: vec![false, true],
            })
            .boxed(),
    };
    target
        .prop_flat_map(move |target| {
            let families: Vec<&'static str> =
                target.families.iter().map(|v6| if *v6 { "IPv6" } else { "IPv4" }).collect();
            let family = prop_oneof![
                20 => proptest::sample::select(if families.is_empty() { vec!["IPv4"] } else { families }),
                h => proptest::sample::select(&["IPv4", "IPv6", "FQDN", "IPv5"][..]),
            ];
            (Just(target), family, any::<u8>())
        })
        .prop_flat_map(move |(target, family, suffix)| {
            let v6 = family == "IPv6";
            let endpoints = prop_oneof![
                200 => prop::collection::vec(endpoint(h, v6), 0..6)
                    .prop_map(|e| if e.is_empty() { "  []\n".to_string() } else { e.concat() }),
                1 => (1000usize..3000).prop_map(move |n| many_endpoints(n, v6)),
            ];
            let name = prop_oneof![20 => Just(format!("{}-{suffix:02x}", target.service)), h => name_text(h)];
            let label = prop_oneof![20 => Just(Some(target.service.clone())), h => Just(None), h => name_text(h).prop_map(Some)];
            (
                Just(family),
                Just(target.namespace.clone()),
                name,
                label,
                prop::collection::vec(slice_port(h, target.ports), 0..4),
                endpoints,
                choice(h, &["app"], &["service.kubernetes.io/headless", "service.kubernetes.io/service-proxy-name"]),
            )
        })
        .prop_map(|(family, ns, name, service, ports, endpoints, extra_label)| {
            let mut s = String::from("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n");
            let _ = writeln!(s, "  name: {}\n  namespace: {}\n  labels:", quoted(&name), quoted(&ns));
            if let Some(svc) = service {
                let _ = writeln!(s, "    kubernetes.io/service-name: {}", quoted(&svc));
            }
            let _ = writeln!(s, "    {extra_label}: \"\"");
            let _ = writeln!(s, "addressType: {family}\nports: {}\nendpoints:", flow_list(&ports));
            s.push_str(&endpoints);
            s
        })
        .boxed()
}

/// This node's (or another node's) Node document.
fn node_doc(h: u32) -> BoxedStrategy<String> {
    (
        node_name_text(h),
        proptest::option::of(zone_text(h)),
        prop::collection::vec(any::<bool>().prop_flat_map(move |v6| ip_text(h, v6, Pool::Node)), 0..3),
        prop::collection::vec(any::<bool>().prop_flat_map(move |v6| cidr_text(h, v6)), 0..3),
        proptest::bool::weighted(0.1),
    )
        .prop_map(|(name, zone, ips, cidrs, deleting)| {
            let mut s = format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {}\n", quoted(&name));
            if let Some(z) = zone {
                let _ = writeln!(s, "  labels: {{topology.kubernetes.io/zone: {}}}", quoted(&z));
            }
            if deleting {
                s.push_str("  deletionTimestamp: \"2024-01-01T00:00:00Z\"\n");
            }
            let _ = writeln!(s, "spec: {{podCIDRs: {}}}", quoted_list(&cidrs));
            let addrs: Vec<String> =
                ips.iter().map(|ip| format!("{{type: InternalIP, address: {}}}", quoted(ip))).collect();
            let _ = writeln!(s, "status: {{addresses: {}}}", flow_list(&addrs));
            s
        })
        .boxed()
}

/// Something that is not a usable object.
fn junk_doc(h: u32) -> BoxedStrategy<String> {
    prop_oneof![
        pick(&[
            "- just\n- a list\n",
            "kind: Service\nmetadata: {name: nover}\n",
            "apiVersion: v1\nkind: Service\nmetadata: {name: x, namespace: ns}\nspec: {ports: \"eighty\"}\n",
            "apiVersion: v1\nkind: Service\nmetadata: {name: x, namespace: ns}\nspec: [1, 2]\n",
            "apiVersion: v1\nkind: List\nitems: 3\n",
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: cm}\ndata: {a: b}\n",
            "kind: [unclosed\n",
            "{\"apiVersion\": \"v1\", \"kind\": \"Service\", \"metadata\": {\"name\": \"j\", \"namespace\": \"ns\"}, \"spec\": {\"clusterIP\": \"10.96.9.9\", \"ports\": [{\"port\": 80}]}}\n",
            "&a [*a]\n",
            "42\n",
            "\"\\xff\"\n",
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s}\naddressType: IPv4\nendpoints: {a: 1}\n",
            "apiVersion: v1\nkind: Service\nmetadata: {name: dup, namespace: ns, name: other}\n",
        ]),
        "\\PC{0,40}",
        // A real object cut short.
        (service_with_slices(h), any::<prop::sample::Index>()).prop_map(|(docs, at)| {
            let doc = &docs[0];
            let mut cut = at.index(doc.len().max(1));
            while !doc.is_char_boundary(cut) {
                cut -= 1;
            }
            doc[..cut].to_string()
        }),
        // A List of objects.
        prop::collection::vec(service_with_slices(h), 0..3).prop_map(|docs| {
            let items: Vec<String> = docs
                .concat()
                .iter()
                .map(|d| d.lines().enumerate().map(|(i, l)| if i == 0 { format!("- {l}\n") } else { format!("  {l}\n") }).collect())
                .collect();
            format!("apiVersion: v1\nkind: List\nitems:\n{}", items.concat())
        }),
    ]
    .boxed()
}

/// The documents of a manifest file.
fn manifest_docs(h: u32) -> BoxedStrategy<Vec<String>> {
    let docs = prop_oneof![
        10 => service_with_slices(h),
        3 => slice_doc(h, None).prop_map(|d| vec![d]),
        2 => node_doc(h).prop_map(|d| vec![d]),
        1 + h => junk_doc(h).prop_map(|d| vec![d]),
    ];
    prop::collection::vec(docs, 1..10).prop_map(|d| d.concat()).prop_shuffle().boxed()
}

// ---------------------------------------------------------------------------------------------
// The sentinel: a well-formed service whose addresses and ports no generator produces, with two
// endpoints. Whatever else the input holds, it must be planned as if it were alone.

const SENTINEL: &str = r#"apiVersion: v1
kind: Service
metadata: {name: sentinel, namespace: guard}
spec:
  type: NodePort
  clusterIP: 198.51.100.10
  ports: [{name: http, port: 7777, nodePort: 31777}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sentinel-1, namespace: guard, labels: {kubernetes.io/service-name: sentinel}}
addressType: IPv4
ports: [{name: http, port: 7070}]
endpoints:
- addresses: ["198.51.100.21"]
  nodeName: node1
- addresses: ["198.51.100.22"]
  nodeName: node2
"#;

/// The settings a case runs with.
#[derive(Debug, Clone)]
struct Settings {
    masquerade_all: bool,
    cluster_cidrs: &'static str,
    detect_local: u8,
    match_all_nodeports: bool,
}

fn settings() -> BoxedStrategy<Settings> {
    (
        any::<bool>(),
        prop::sample::select(&["", "10.0.0.0/8", "10.244.0.0/16,fd00:10:244::/48", "::/0"][..]),
        0u8..4,
        any::<bool>(),
    )
        .prop_map(|(masquerade_all, cluster_cidrs, detect_local, match_all_nodeports)| Settings {
            masquerade_all,
            cluster_cidrs,
            detect_local,
            match_all_nodeports,
        })
        .boxed()
}

/// A case: settings and the documents (the sentinel goes in at `at`).
#[derive(Debug, Clone)]
struct Case {
    /// The weight of hostile choices the documents were made with.
    #[allow(dead_code, reason = "shown in failure reports")]
    hostility: u32,
    settings: Settings,
    docs: Vec<String>,
    at: prop::sample::Index,
}

impl Case {
    fn text(&self) -> String {
        let mut docs: Vec<String> =
            self.docs.iter().map(|d| if d.ends_with('\n') { d.clone() } else { format!("{d}\n") }).collect();
        docs.insert(self.at.index(docs.len() + 1), SENTINEL.to_string());
        docs.join("---\n")
    }
}

fn case() -> BoxedStrategy<Case> {
    // Clean, a little hostile, very hostile.
    prop::sample::select(&[0u32, 1, 5][..])
        .prop_flat_map(|h| (Just(h), settings(), manifest_docs(h), any::<prop::sample::Index>()))
        .prop_map(|(hostility, settings, docs, at)| Case { hostility, settings, docs, at })
        .boxed()
}

// ---------------------------------------------------------------------------------------------
// The pipeline and its checks.

fn config(s: &Settings) -> ProxyConfig {
    let mut c = ProxyConfig::new(NODE);
    c.masquerade_all = s.masquerade_all;
    if !s.cluster_cidrs.is_empty() {
        c.cluster_cidrs = parse_cidrs("--cluster-cidr", s.cluster_cidrs).unwrap_or_default();
    }
    c.detect_local = match s.detect_local {
        0 => DetectLocal::ClusterCidr,
        1 => DetectLocal::NodeCidr,
        2 => DetectLocal::BridgeInterface("cbr0".into()),
        _ => DetectLocal::InterfaceNamePrefix("veth".into()),
    };
    c
}

/// Node-port addresses as `--nodeport-addresses primary` picks them (the Node's InternalIPs),
/// with a fixed address when the Node has none, or every local address.
fn nodeports(state: &ClusterState, family: IpFamily, match_all: bool) -> NodePorts {
    if match_all {
        return NodePorts::MatchAll;
    }
    let mut ips: Vec<IpAddr> = state
        .node()
        .map(|n| n.host_ips.iter().copied().filter(|ip| IpFamily::of(ip) == family).collect())
        .unwrap_or_default();
    if ips.is_empty() {
        ips.push(match family {
            IpFamily::V4 => "192.168.0.2".parse().unwrap(),
            IpFamily::V6 => "fd00:192:168::2".parse().unwrap(),
        });
    }
    NodePorts::Addresses(ips)
}

/// Parses, converts and plans `text`; returns the state, the ruleset and the problems' text.
fn pipeline(settings: &Settings, text: &str) -> (ClusterState, Ruleset, Vec<String>) {
    let mut m = manifests::Manifests::default();
    manifests::load_text(Path::new("fuzz.yaml"), text, &mut m);
    let (state, problems) = state_from_manifests(&m, NODE);
    let mut messages: Vec<String> = m.problems.iter().map(ToString::to_string).collect();
    messages.extend(problems.iter().map(ToString::to_string));
    let config = config(settings);
    let v4 = nodeports(&state, IpFamily::V4, settings.match_all_nodeports);
    let v6 = nodeports(&state, IpFamily::V6, settings.match_all_nodeports);
    let planned = plan(&PlanInput { config: &config, state: &state, nodeports_v4: &v4, nodeports_v6: &v6 });
    (state, planned.ruleset, messages)
}

/// What the API server guarantees of a Service holds for every one the model keeps: port
/// names, (protocol, port) and (protocol, NodePort) unique; one ClusterIP per family; external
/// and load-balancer addresses only in a family the Service has a ClusterIP in.
fn check_state(state: &ClusterState) -> Result<(), TestCaseError> {
    for service in state.services() {
        let mut names = HashSet::new();
        let mut numbers = HashSet::new();
        let mut node_ports = HashSet::new();
        for p in &service.ports {
            prop_assert!(names.insert(p.name.port.clone()), "{}: port name {:?} twice", service.name, p.name.port);
            prop_assert!(
                numbers.insert((p.name.protocol, p.port)),
                "{}: port {}/{} twice",
                service.name,
                p.port,
                p.name.protocol
            );
            if let Some(np) = p.node_port {
                prop_assert!(node_ports.insert((p.name.protocol, np)), "{}: NodePort {np} twice", service.name);
            }
            let families: HashSet<IpFamily> = p.cluster_ips.iter().map(IpFamily::of).collect();
            prop_assert_eq!(families.len(), p.cluster_ips.len(), "{}: two ClusterIPs of one family", service.name);
            for ip in p.external_ips.iter().chain(&p.load_balancer_ips) {
                prop_assert!(
                    families.contains(&IpFamily::of(ip)),
                    "{}: {ip} has no ClusterIP of its family",
                    service.name
                );
            }
        }
    }
    Ok(())
}

/// Names and comments within the kernel's and nft's limits.
fn check_limits(ruleset: &Ruleset) -> Result<(), TestCaseError> {
    let comment = |c: Option<&str>, what: &str| -> Result<(), TestCaseError> {
        if let Some(c) = c {
            prop_assert!(c.len() <= COMMENT_MAX, "comment of {what} is {} bytes: {c:?}", c.len());
            prop_assert!(!c.contains('"') && !c.contains('\n'), "comment of {what} cannot be quoted: {c:?}");
        }
        Ok(())
    };
    for table in &ruleset.tables {
        prop_assert!(table.name.len() <= NAME_MAX);
        comment(table.comment.as_deref(), &table.name)?;
        for set in table.sets.values() {
            prop_assert!(set.name.len() <= NAME_MAX, "set name of {} bytes: {}", set.name.len(), set.name);
            comment(set.comment.as_deref(), &set.name)?;
            for element in set.elements.values() {
                comment(element.comment.as_deref(), &set.name)?;
            }
        }
        for chain in table.chains.values() {
            prop_assert!(chain.name.len() <= NAME_MAX, "chain name of {} bytes: {}", chain.name.len(), chain.name);
            comment(chain.comment.as_deref(), &chain.name)?;
            for rule in &chain.rules {
                comment(rule.comment.as_deref(), &chain.name)?;
            }
        }
    }
    Ok(())
}

/// The sentinel is planned as alone: its ClusterIP and NodePort lead to its chain, which
/// balances over both endpoints.
fn check_sentinel(ruleset: &Ruleset) -> Result<(), TestCaseError> {
    let sentinel = NamespacedName::new("guard", "sentinel").to_string();
    let table = ruleset.tables.iter().find(|t| t.family == IpFamily::V4);
    let Some(table) = table else { return Err(TestCaseError::fail("no ip table")) };
    let key: Vec<Value> = vec![
        Value::Addr("198.51.100.10".parse().unwrap()),
        Value::Proto(nftproxy::net::L4Proto::Tcp),
        Value::Port(7777),
    ];
    let owned_by_sentinel = |set: &str, key: &Vec<Value>| {
        table
            .sets
            .get(set)
            .and_then(|s| s.elements.get(key))
            .is_some_and(|e| e.owner.to_string().starts_with(&sentinel))
    };
    prop_assert!(owned_by_sentinel("balanced-service-ips", &key), "sentinel ClusterIP is not balanced");
    let np = vec![Value::Proto(nftproxy::net::L4Proto::Tcp), Value::Port(31777)];
    prop_assert!(owned_by_sentinel("balanced-nodeports", &np), "sentinel NodePort is not balanced");
    for (map, key) in [("service-endpoints-2", key), ("nodeport-endpoints-2", np)] {
        for i in 0..2 {
            let mut indexed = key.clone();
            indexed.push(Value::Index(i));
            prop_assert!(owned_by_sentinel(map, &indexed), "sentinel endpoint {i} missing in {map}");
        }
    }
    // Its two endpoints, for the ClusterIP and the NodePort.
    let endpoints: usize = table
        .sets
        .values()
        .flat_map(|s| s.elements.values())
        .filter(|e| e.owner.to_string() == format!("{sentinel}:http"))
        .filter(|e| matches!(&e.data, ElementData::Values(v) if matches!(v.first(), Some(Value::Addr(IpAddr::V4(a))) if a.octets()[..3] == [198, 51, 100])))
        .count();
    prop_assert_eq!(endpoints, 4, "sentinel endpoints");
    Ok(())
}

/// Lowers the plan and applies it to the fake kernel, which refuses dangling references and
/// overlapping intervals. Its interval check is quadratic, so only for rulesets of at most
/// [`FAKE_KERNEL_MAX_ELEMENTS`] elements (the big ones go through `nft -c`).
fn check_fake_kernel(ruleset: &Ruleset) -> Result<(), TestCaseError> {
    if ruleset.tables.iter().map(|t| t.element_count()).sum::<usize>() > FAKE_KERNEL_MAX_ELEMENTS {
        return Ok(());
    }
    let wire = lower_ruleset(ruleset);
    let tx = diff(&WireRuleset::default(), &wire);
    let mut kernel = FakeNetfilter::new();
    kernel.apply(&tx).map_err(|e| TestCaseError::fail(format!("fake kernel refused the plan: {e}")))?;
    Ok(())
}

/// Proptest settings: `default` cases unless `PROPTEST_CASES` says otherwise; no regression
/// files (found inputs become tests here); shrinking bounded so a failure reports in time.
fn runner_config(default: u32) -> Config {
    let mut config = Config::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = default;
    }
    config.failure_persistence = None;
    config.max_shrink_iters = 512;
    config.max_shrink_time = 60_000;
    config
}

#[test]
fn random_manifests_never_panic() {
    let mut runner = TestRunner::new(runner_config(256));
    let result = runner.run(&case(), |case| {
        let text = case.text();
        let (state, ruleset, problems) = pipeline(&case.settings, &text);
        for p in &problems {
            prop_assert!(!p.is_empty());
        }
        check_state(&state)?;
        let rendered = ruleset.to_string();
        prop_assert!(rendered.starts_with("table ip nftproxy"));
        check_limits(&ruleset)?;
        check_sentinel(&ruleset)?;
        check_fake_kernel(&ruleset)?;
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Writes the ruleset and runs `nft -c -f` on it inside `ns`.
fn nft_check(ns: &Netns, ruleset: &str) -> Result<(), String> {
    let file = tempfile::Builder::new().suffix(".nft").tempfile().map_err(|e| e.to_string())?;
    std::fs::write(file.path(), ruleset).map_err(|e| e.to_string())?;
    let path = file.path().to_str().ok_or("temporary path is not UTF-8")?;
    ns.exec("nft", &["-c", "-f", path]).map(|_| ()).map_err(|e| e.to_string())
}

#[test]
fn random_manifests_render_what_the_kernel_accepts() {
    if crate::common::skip_unless_privileged() {
        return;
    }
    nftproxy_tools::lab::cleanup_stale();
    // nft -c talks to the kernel: only ever inside a namespace of our own.
    let ns = Netns::create("fuzz").expect("network namespace");
    let mut runner = TestRunner::new(runner_config(64));
    let result = runner.run(&case(), |case| {
        let (_, ruleset, _) = pipeline(&case.settings, &case.text());
        let rendered = ruleset.to_string();
        nft_check(&ns, &rendered).map_err(|e| TestCaseError::fail(format!("nft -c refused the ruleset: {e}")))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// The hostile cases of the unit tests in one file (names at the length limits with affinity
/// and IPv6 endpoints, thousands of ports and of endpoints, address-family mix-ups, duplicate
/// and invalid ports, non-ASCII names), planned and checked by the kernel.
fn hostile_corpus() -> String {
    let ns = "n".repeat(63);
    let name = format!("{}z", "s".repeat(62));
    let port = "p".repeat(15);
    let slice_name = format!("{}.{}.{}.{}", "a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61));
    let mut docs = vec![format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {ns}}}
spec:
  type: LoadBalancer
  clusterIPs: [10.96.0.1, "fd00::1"]
  ipFamilies: [IPv4, IPv6]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  sessionAffinity: ClientIP
  loadBalancerSourceRanges: [192.0.2.0/24, "2001:db8::/64"]
  ports: [{{name: {port}, port: 65535, nodePort: 32767, protocol: SCTP}}, {{name: a, port: 65535, protocol: UDP}}]
status: {{loadBalancer: {{ingress: [{{ip: 203.0.113.1}}, {{ip: "2001:db8::1"}}]}}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {slice_name}, namespace: {ns}, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv6
ports: [{{name: {port}, port: 65535, protocol: SCTP}}, {{name: a, port: 1, protocol: UDP}}]
endpoints:
- {{addresses: ["fd00:ffff:ffff:ffff:ffff:ffff:ffff:fff1"], nodeName: node1}}
- {{addresses: ["fd00:ffff:ffff:ffff:ffff:ffff:ffff:fff2"], nodeName: nöde, zone: zöne}}
"#
    )];
    docs.push(format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: many, namespace: ns}}
spec:
  type: NodePort
  clusterIP: 10.96.0.2
  ports: {}
"#,
        Ports::Many(3000).yaml()
    ));
    docs.push(format!(
        r#"apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: many-1, namespace: ns, labels: {{kubernetes.io/service-name: many}}}}
addressType: IPv4
ports: [{{name: p0, port: 8080}}, {{name: p1, port: 8081}}]
endpoints:
{}"#,
        many_endpoints(5000, false)
    ));
    docs.push(
        r#"apiVersion: v1
kind: Service
metadata: {name: mixed, namespace: ns}
spec:
  type: NodePort
  clusterIPs: [fd00::3, 10.96.0.3]
  ipFamilies: [IPv4, IPv4]
  externalIPs: ["2001:db8::9", 203.0.113.9, 1.2.3]
  ports:
  - {name: a, port: 80, nodePort: 30080}
  - {name: a, port: 81, protocol: UDP}
  - {name: b, port: 80}
  - {name: c, port: 82, nodePort: 30080}
  - {name: d, port: 0}
  - {name: e, port: 65536}
  - {name: f, port: 83, protocol: ICMP}
  - {name: hţtp, port: 84}
---
apiVersion: v1
kind: Service
metadata: {name: wéb, namespace: ns}
spec: {clusterIP: 10.96.0.4, ports: [{port: 80}]}
"#
        .to_string(),
    );
    docs.join("---\n")
}

#[test]
fn the_hostile_corpus_renders_what_the_kernel_accepts() {
    let settings =
        Settings { masquerade_all: false, cluster_cidrs: "10.0.0.0/8", detect_local: 0, match_all_nodeports: false };
    let (state, ruleset, problems) = pipeline(&settings, &hostile_corpus());
    assert_eq!(state.service_count(), 3, "{problems:#?}");
    check_state(&state).unwrap();
    check_limits(&ruleset).unwrap();
    if crate::common::skip_unless_privileged() {
        return;
    }
    let ns = Netns::create("fuzz").expect("network namespace");
    if let Err(e) = nft_check(&ns, &ruleset.to_string()) {
        panic!("nft -c refused the ruleset: {e}");
    }
}
