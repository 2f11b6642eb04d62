//! Endpoint selection with real packets: session affinity, internalTrafficPolicy, terminating
//! fallback, topology hints, stale conntrack cleanup, IPv6 and SCTP.

use std::net::SocketAddr;

use crate::common::*;
use nftproxy::net::L4Proto;
use nftproxy::nft::canonical::canonicalize;
use nftproxy_tools::lab::traffic;

fn web<'a>(endpoints: &'a [Ep<'a>]) -> Svc<'a> {
    Svc { name: "web", cluster_ip: "10.96.0.10", endpoints, ..Default::default() }
}

const ALL: [Ep<'static>; 3] = [WEB_1, WEB_2, WEB_3];

#[test]
fn session_affinity_holds_and_moves_when_the_endpoint_goes() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let affine = |endpoints| Svc { affinity_secs: Some(600), ..web(endpoints) };
    lab.sync(&services_yaml(&[affine(&ALL[..2])]));
    let first = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 25);
    assert_eq!(first.failed(), 0);
    assert_eq!(first.by_backend.len(), 1, "one client, one endpoint: {first:?}");
    let chosen = first.by_backend.keys().next().cloned().unwrap();

    // A third endpoint is bound to a free slot (elements only): the client stays where it is.
    lab.sync(&services_yaml(&[affine(&ALL)]));
    let stayed = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 25);
    assert_eq!(stayed.by_backend.keys().collect::<Vec<_>>(), vec![&chosen], "{stayed:?}");
    let udp = lab.tally("client", L4Proto::Udp, "10.96.0.10:53", 20);
    assert_eq!(udp.by_backend.len(), 1, "UDP sticks too: {udp:?}");

    // Remove the chosen endpoint: its affinity set goes with it; the client moves and sticks again.
    let rest: Vec<Ep<'_>> = ALL
        .iter()
        .copied()
        .filter(|e| lab.lab.pod(&chosen).map(|p| p.ip.to_string()) != Some(e.0.to_string()))
        .collect();
    lab.sync(&services_yaml(&[affine(&rest)]));
    let moved = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 25);
    assert_eq!(moved.by_backend.len(), 1, "{moved:?}");
    assert!(!moved.by_backend.contains_key(&chosen), "{moved:?}");

    // Without affinity the same client is balanced.
    lab.sync(&services_yaml(&[web(&ALL)]));
    assert!(lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 60).by_backend.len() > 1);
}

#[test]
fn internal_traffic_policy_local_keeps_pod_traffic_on_the_node() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let local = |endpoints| Svc { internal_local: true, ..web(endpoints) };
    lab.sync(&services_yaml(&[local(&[WEB_2, WEB_3])]));
    let t = lab.tally("web-1", L4Proto::Tcp, "10.96.0.10:80", 40);
    assert_eq!(backends(&t), set(&["web-2"]), "{t:?}");
    let u = lab.tally("web-1", L4Proto::Udp, "10.96.0.10:53", 40);
    assert_eq!(backends(&u), set(&["web-2"]), "{u:?}");
    // No endpoint on this node: dropped, not rejected (endpoints exist elsewhere).
    lab.sync(&services_yaml(&[local(&[WEB_3])]));
    let err = lab.ask("web-1", L4Proto::Tcp, "10.96.0.10:80").expect_err("dropped");
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
}

#[test]
fn terminating_endpoints_serve_only_when_nothing_is_ready() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let terminating = "conditions: {ready: false, serving: true, terminating: true}";
    let not_serving = "conditions: {ready: false, serving: false, terminating: true}";
    let yaml = |ready3: bool| {
        services_yaml(&[Svc {
            endpoints: &[
                ("10.244.1.10", "node1", false),
                ("10.244.1.11", "node1", false),
                ("10.244.2.10", "node2", ready3),
            ],
            endpoint_extra: &[terminating, not_serving, if ready3 { "" } else { not_serving }],
            ..web(&[])
        }])
        // The builder writes `conditions: {ready: …}` first; the extra line overrides it.
        .replace("    conditions: {ready: false}\n    conditions:", "    conditions:")
    };
    lab.sync(&yaml(false));
    let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 30);
    assert_eq!(backends(&t), set(&["web-1"]), "only the serving, terminating endpoint: {t:?}");
    lab.sync(&yaml(true));
    let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 30);
    assert_eq!(backends(&t), set(&["web-3"]), "a ready endpoint wins: {t:?}");
    lab.sync(&yaml(false));
    let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 30);
    assert_eq!(backends(&t), set(&["web-1"]), "and back: {t:?}");
}

#[test]
fn topology_hints_select_the_zone_and_fall_back_without_them() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    // node1 is in zone-a (its Node label, written by services_yaml).
    lab.sync(&services_yaml(&[Svc {
        endpoint_extra: &[
            "hints: {forZones: [{name: zone-a}]}",
            "hints: {forZones: [{name: zone-b}]}",
            "hints: {forZones: [{name: zone-a}]}",
        ],
        ..web(&ALL)
    }]));
    let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 60);
    assert_eq!(backends(&t), set(&["web-1", "web-3"]), "zone-a endpoints only: {t:?}");
    // One endpoint without a hint: hints are ignored.
    lab.sync(&services_yaml(&[Svc {
        endpoint_extra: &["hints: {forZones: [{name: zone-a}]}", "", "hints: {forZones: [{name: zone-a}]}"],
        ..web(&ALL)
    }]));
    let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 90);
    assert_eq!(backends(&t), set(&["web-1", "web-2", "web-3"]), "{t:?}");
}

fn udp_from(lab: &ClusterLab, who: &str, local: &str, target: &str) -> std::io::Result<traffic::Answer> {
    let (local, target): (SocketAddr, SocketAddr) = (local.parse().unwrap(), target.parse().unwrap());
    let ns = &lab.lab.client(who).unwrap().ns;
    ns.run(move || traffic::udp_ask(target, Some(local), TIMEOUT)).unwrap()
}

fn stale_conntrack_case(cleanup: bool) -> (String, String) {
    let lab = ClusterLab::new();
    let flag = if cleanup { "true" } else { "false" };
    let sync = |endpoints| lab.sync_with(&services_yaml(&[web(endpoints)]), &["--conntrack-cleanup", flag]);
    sync(&ALL);
    // A DNS-like client: fixed source port, one datagram at a time.
    let first = udp_from(&lab, "client", "0.0.0.0:5353", "10.96.0.10:53").unwrap().backend;
    let rest: Vec<Ep<'_>> = ALL
        .iter()
        .copied()
        .filter(|e| lab.lab.pod(&first).map(|p| p.ip.to_string()) != Some(e.0.to_string()))
        .collect();
    sync(&rest);
    let second =
        udp_from(&lab, "client", "0.0.0.0:5353", "10.96.0.10:53").map(|a| a.backend).unwrap_or_else(|e| e.to_string());
    (first, second)
}

#[test]
fn stale_udp_conntrack_entries_are_removed() {
    if skip_unless_privileged() {
        return;
    }
    let (first, second) = stale_conntrack_case(true);
    assert_ne!(first, second, "the client moved to a live endpoint");
    assert!(second.starts_with("web-"), "{second}");
}

#[test]
fn without_cleanup_a_udp_client_sticks_to_the_removed_endpoint() {
    if skip_unless_privileged() {
        return;
    }
    // The control case: the same steps with --conntrack-cleanup false keep the old flow.
    let (first, second) = stale_conntrack_case(false);
    assert_eq!(first, second, "the stale entry still points at the removed endpoint");
}

pub(crate) fn dual_stack_yaml() -> String {
    r#"apiVersion: v1
kind: Service
metadata: {name: web6, namespace: default}
spec:
  type: NodePort
  ipFamilies: [IPv6, IPv4]
  clusterIP: fd00:96::10
  clusterIPs: [fd00:96::10, 10.96.0.10]
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, targetPort: 8080, nodePort: 30081}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web6-v6, namespace: default, labels: {kubernetes.io/service-name: web6}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 8080, protocol: UDP}]
endpoints:
- {addresses: ["fd00:10:244:1::a"], nodeName: node1}
- {addresses: ["fd00:10:244:2::a"], nodeName: node2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web6-v4, namespace: default, labels: {kubernetes.io/service-name: web6}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 8080, protocol: UDP}]
endpoints:
- {addresses: ["10.244.1.11"], nodeName: node1}
---
apiVersion: v1
kind: Node
metadata: {name: node1}
status:
  addresses: [{type: InternalIP, address: 192.168.50.2}, {type: InternalIP, address: "fd00:50::2"}]
"#
    .to_string()
}

#[test]
fn ipv6_and_dual_stack_services() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let out = lab.sync_with(&dual_stack_yaml(), &["--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56"]);
    assert!(out.contains("1 transaction"), "{out}");
    let listing = lab.listing();
    assert!(
        listing.contains("table ip nftproxy") && listing.contains("table ip6 nftproxy"),
        "both families in one transaction"
    );
    let both = set(&["web-1", "web-3"]);
    let t = lab.tally("client", L4Proto::Tcp, "[fd00:96::10]:80", 60);
    assert_eq!(backends(&t), both, "IPv6 ClusterIP TCP: {t:?}");
    let u = lab.tally("client", L4Proto::Udp, "[fd00:96::10]:53", 60);
    assert_eq!(backends(&u), both, "IPv6 ClusterIP UDP: {u:?}");
    let t = lab.tally("client", L4Proto::Tcp, "[fd00:50::2]:30080", 60);
    assert_eq!(backends(&t), both, "IPv6 NodePort TCP: {t:?}");
    assert!(t.sources.keys().all(|s| s.is_ipv6() && s.to_string() != "fd00:50::100"), "masqueraded: {t:?}");
    let u = lab.tally("client", L4Proto::Udp, "[fd00:50::2]:30081", 40);
    assert_eq!(backends(&u), both, "IPv6 NodePort UDP: {u:?}");
    // From a pod: the source is kept.
    let t = lab.tally("web-2", L4Proto::Tcp, "[fd00:96::10]:80", 20);
    assert!(t.sources.keys().all(|s| s.to_string() == "fd00:10:244:1::b"), "{t:?}");
    // The IPv4 side of the same service.
    let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 20);
    assert_eq!(backends(&t), set(&["web-2"]), "{t:?}");
    // Hairpin over IPv6.
    let t = lab.tally("web-1", L4Proto::Tcp, "[fd00:96::10]:80", 30);
    assert_eq!(t.failed(), 0, "{t:?}");
}

#[test]
fn sctp_service_ports() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let yaml = services_yaml(&[web(&ALL)]).replace("protocol: UDP", "protocol: SCTP");
    lab.sync(&yaml);
    // The rules are programmed on any kernel, and read as nft would write them.
    assert_eq!(canonicalize(&lab.listing()), canonicalize(&lab.render(&yaml)));
    assert!(lab.listing().contains(" . sctp . 53 . 0 comment \"default/web:dns\" : "), "{}", lab.listing());
    if !traffic::sctp_supported() {
        eprintln!("SKIPPED (SCTP traffic): this kernel has no sctp module (socket(IPPROTO_SCTP) is not supported)");
        return;
    }
    let mut lab = lab;
    lab.lab.start_servers(&[nftproxy_tools::lab::ServerSpec::sctp(8080)]).unwrap();
    let t = lab.tally("client", L4Proto::Sctp, "10.96.0.10:53", 60);
    assert_eq!(backends(&t), set(&["web-1", "web-2", "web-3"]), "{t:?}");
}
