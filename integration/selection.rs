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

/// `big/many` (ClusterIP 10.96.0.30, 80/TCP → 9090) with ClientIP affinity over `n` endpoints
/// 10.245.x.y, all on node2.
fn many_endpoints_yaml(n: u32) -> String {
    let endpoints: String = (0..n)
        .map(|i| format!("  - addresses: [\"10.245.{}.{}\"]\n    nodeName: node2\n", i / 250, i % 250 + 1))
        .collect();
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: many, namespace: big}}
spec:
  clusterIP: 10.96.0.30
  sessionAffinity: ClientIP
  ports:
  - {{name: http, port: 80, protocol: TCP, targetPort: 9090}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: many-1
  namespace: big
  labels: {{kubernetes.io/service-name: many}}
addressType: IPv4
ports:
- {{name: http, port: 9090, protocol: TCP}}
endpoints:
{endpoints}"#
    )
}

/// One TCP connection to `target` from `source` (an address of the calling thread's namespace);
/// the answer of [`address_echo`]: the endpoint address that answered.
fn ask_from(source: std::net::Ipv4Addr, target: std::net::SocketAddrV4) -> std::io::Result<String> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, setsockopt, socket, sockopt};
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let fd = socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    // The send timeout bounds connect(2) too.
    setsockopt(&fd, sockopt::SendTimeout, &nix::sys::time::TimeVal::new(2, 0))?;
    bind(fd.as_raw_fd(), &SockaddrIn::from(std::net::SocketAddrV4::new(source, 0)))?;
    connect(fd.as_raw_fd(), &SockaddrIn::from(target))?;
    let mut stream = std::net::TcpStream::from(fd);
    stream.set_read_timeout(Some(TIMEOUT))?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    Ok(text.trim().to_string())
}

/// A TCP server on port 9090 of every address of the calling thread's namespace that answers
/// with the address it was reached at, until `stop`.
fn address_echo(stop: &std::sync::atomic::AtomicBool, ready: std::sync::mpsc::Sender<()>) {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("0.0.0.0:9090").unwrap();
    listener.set_nonblocking(true).unwrap();
    let _ = ready.send(());
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        match listener.accept() {
            Ok((mut conn, _)) => {
                let local = conn.local_addr().map(|a| a.ip().to_string()).unwrap_or_default();
                let _ = conn.write_all(format!("{local}\n").as_bytes());
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(1)),
        }
    }
}

/// ClientIP affinity over 1,400 endpoints, more than the 1,023 slots a port had before its
/// slots were split in groups of 255 (6 groups here): 131 clients each stick to one endpoint,
/// and together they reach endpoints of every group, those past the 1,023rd included (slots
/// are taken in address order, so the endpoint at index i has slot i).
#[test]
fn session_affinity_reaches_every_group_of_a_port_with_1400_endpoints() {
    if skip_unless_privileged() {
        return;
    }
    use std::net::{Ipv4Addr, SocketAddrV4};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let lab = ClusterLab::new();
    let n: u32 = 1400;
    let (node1, node2) = (lab.lab.node("node1"), lab.lab.node("node2"));
    let web3 = lab.lab.pod("web-3").unwrap();
    let batch = |ns: &nftproxy_tools::lab::Netns, name: &str, lines: String| {
        let path = lab.write(name, &lines);
        ns.ip(&["-batch", path.to_str().unwrap()]).unwrap();
    };
    // The endpoints: addresses on web-3's loopback, routed there by node2, and to node2 by node1.
    batch(
        &web3.ns,
        "endpoints.batch",
        (0..n).map(|i| format!("addr add 10.245.{}.{}/32 dev lo\n", i / 250, i % 250 + 1)).collect(),
    );
    node2.ns.ip(&["route", "add", "10.245.0.0/16", "via", &web3.ip.to_string()]).unwrap();
    node1.ns.ip(&["route", "add", "10.245.0.0/16", "via", &node2.ip.to_string()]).unwrap();
    // The clients: 131 addresses of the outside client.
    let clients: Vec<Ipv4Addr> = (120..=250).map(|h| Ipv4Addr::new(192, 168, 50, h)).collect();
    let client = &lab.lab.client("client").unwrap().ns;
    batch(client, "clients.batch", clients.iter().map(|c| format!("addr add {c}/24 dev eth0\n")).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server = {
        let stop = Arc::clone(&stop);
        web3.ns.spawn(move || address_echo(&stop, ready_tx))
    };
    ready_rx.recv_timeout(std::time::Duration::from_secs(5)).expect("the server listens");

    lab.sync(&many_endpoints_yaml(n));
    let target = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 30), 80);
    let answers: Vec<(Ipv4Addr, Vec<String>)> = client
        .run(|| {
            clients
                .iter()
                .map(|c| (*c, (0..2).map(|_| ask_from(*c, target).unwrap_or_else(|e| format!("error {e}"))).collect()))
                .collect()
        })
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    server.join().unwrap().unwrap();

    let mut reached = std::collections::BTreeSet::new();
    for (c, seen) in &answers {
        assert!(!seen[0].starts_with("error"), "{c}: {seen:?}");
        assert_eq!(seen[0], seen[1], "client {c} sticks to its endpoint");
        let ip: Ipv4Addr = seen[0].parse().unwrap();
        let [_, _, a, b] = ip.octets();
        reached.insert(u32::from(a) * 250 + u32::from(b) - 1);
    }
    assert!(reached.len() > 90, "new clients spread: {} endpoints for {} clients", reached.len(), answers.len());
    let groups: std::collections::BTreeSet<u32> = reached.iter().map(|i| i / 255).collect();
    assert_eq!(groups, (0..=5).collect(), "every group of slots is reached: {reached:?}");
    assert!(reached.iter().any(|i| *i >= 1023), "an endpoint past the 1,023rd: {reached:?}");
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
        nftproxy_tools::lab::skip_without_kernel_feature(
            "sctp",
            "SCTP traffic: this kernel has no SCTP (socket(IPPROTO_SCTP) is not supported)",
        );
        return;
    }
    let mut lab = lab;
    lab.lab.start_servers(&[nftproxy_tools::lab::ServerSpec::sctp(8080)]).unwrap();
    let t = lab.tally("client", L4Proto::Sctp, "10.96.0.10:53", 60);
    assert_eq!(backends(&t), set(&["web-1", "web-2", "web-3"]), "{t:?}");
}
