//! ServiceCIDRs with real packets: an address inside a ServiceCIDR that no Service has is dropped
//! on node1 (no answer, and nothing leaves by the default route), while without a ServiceCIDR it
//! leaves as before; from the API server, the ranges follow the objects, and an API server
//! without the resource holds nothing up.

use std::time::Duration;

use crate::common::apiserver::{FakeApi, SERVICE_CIDRS, objects};
use crate::common::*;
use nftproxy::net::L4Proto;

/// An address in the lab's service range that no Service has.
const UNALLOCATED: &str = "10.96.0.99";

fn service_cidr(name: &str, cidrs: &str) -> String {
    format!(
        r#"---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {{name: {name}}}
spec: {{cidrs: [{cidrs}]}}
"#
    )
}

/// A counter in node1 of packets to [`UNALLOCATED`] leaving the node (a table of the test's
/// own, after every other chain).
fn count_leaving(lab: &ClusterLab) {
    let ns = &lab.lab.node("node1").ns;
    let rule = format!("ip daddr {UNALLOCATED} counter");
    for args in [
        vec!["add", "table", "ip", "probe"],
        vec!["add", "chain", "ip", "probe", "out", "{ type filter hook postrouting priority 300; }"],
        vec!["add", "rule", "ip", "probe", "out", rule.as_str()],
    ] {
        let out = ns.exec("nft", &args).unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

fn packets_left(lab: &ClusterLab) -> u64 {
    let out = lab.lab.node("node1").ns.exec("nft", &["list", "table", "ip", "probe"]).unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let at = text.find("counter packets ").unwrap_or_else(|| panic!("{text}")) + "counter packets ".len();
    text[at..].split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn an_unallocated_cluster_ip_is_dropped_only_inside_a_service_cidr() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    count_leaving(&lab);
    let cluster = web_manifests(&[WEB_1]);

    // Today's behaviour without a ServiceCIDR: the address is nobody's, so it is routed like
    // any other, out by node1's default route.
    lab.sync(&cluster);
    for who in ["client", "web-2"] {
        assert!(lab.ask(who, L4Proto::Tcp, &format!("{UNALLOCATED}:80")).is_err(), "{who}: nothing answers");
    }
    let before = packets_left(&lab);
    assert!(before > 0, "without a ServiceCIDR the packets leave node1");

    // With a ServiceCIDR covering it: dropped, from outside, from a pod and from the node.
    let with = format!("{cluster}{}", service_cidr("kubernetes", "10.96.0.0/16, \"fd00:96::/112\""));
    lab.sync(&with);
    let listing = lab.listing();
    assert!(listing.contains("set service-cidrs"), "{listing}");
    assert!(listing.contains("table ip6 nftproxy"), "an IPv6 range is dropped in the ip6 table:\n{listing}");
    for who in ["client", "web-2"] {
        let err = lab.ask(who, L4Proto::Tcp, &format!("{UNALLOCATED}:80")).expect_err("dropped");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{who}: dropped, not refused: {err}");
        let err = lab.ask(who, L4Proto::Udp, &format!("{UNALLOCATED}:53")).expect_err("dropped");
        let silent = [std::io::ErrorKind::TimedOut, std::io::ErrorKind::WouldBlock];
        assert!(silent.contains(&err.kind()), "{who} udp: dropped, not refused: {err}");
    }
    // The node's own connection is dropped in the output hook (TCP retries its SYN until the
    // timeout; a datagram's sender sees EPERM).
    let err = lab.ask("node1", L4Proto::Tcp, &format!("{UNALLOCATED}:80")).expect_err("dropped");
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "node1: dropped, not refused: {err}");
    let err = lab.ask("node1", L4Proto::Udp, &format!("{UNALLOCATED}:53")).expect_err("dropped");
    assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "node1 udp: {err}");
    assert_eq!(packets_left(&lab), before, "nothing to the unallocated address left node1");

    // Allocated ClusterIPs are unchanged: served ports answer, unserved ones are refused.
    assert_eq!(lab.ask("client", L4Proto::Tcp, "10.96.0.10:80").unwrap().backend, "web-1");
    for who in ["client", "web-2", "node1"] {
        let err = lab.ask(who, L4Proto::Tcp, "10.96.0.10:81").expect_err("unserved port");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{who}: {err}");
    }

    // A malformed ServiceCIDR is skipped alone, with the field named.
    let bad = format!("{with}{}", service_cidr("broken", "10.100.0.0/16, 10.98.0.0/16"));
    let path = lab.write("bad.yaml", &bad);
    let out = lab.nftproxy(&[
        "sync",
        "--manifests",
        path.to_str().unwrap(),
        "--hostname-override",
        "node1",
        "--cluster-cidr",
        nftproxy_tools::lab::topology::CLUSTER_CIDR_V4,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("ServiceCIDR broken: spec.cidrs[1] ignored: second IPv4 CIDR"), "{stderr}");
    assert!(lab.listing().contains("10.100.0.0/16"), "the good CIDR of the object is used");

    // Without the ServiceCIDR again: back to today's behaviour.
    lab.sync(&cluster);
    assert!(!lab.listing().contains("service-cidrs"));
    let _ = lab.ask("client", L4Proto::Tcp, &format!("{UNALLOCATED}:80"));
    assert!(packets_left(&lab) > before, "the packets leave again");
}

#[test]
fn service_cidrs_follow_the_api_server_and_a_missing_resource_holds_nothing_up() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let mut api = FakeApi::start(&lab.lab.node("node1").ns);
    let cluster =
        services_yaml(&[Svc { name: "web", cluster_ip: "10.96.0.10", endpoints: &[WEB_1], ..Default::default() }]);
    for obj in objects(&format!("{cluster}{}", service_cidr("kubernetes", "10.96.0.0/16"))) {
        api.apply(obj);
    }
    let kubeconfig = lab.write("kubeconfig", &api.kubeconfig());
    let proxy = lab.run_proxy_from(&["--kubeconfig", kubeconfig.to_str().unwrap()], &[]);
    // The first sync waited for the ServiceCIDRs: the range is there from the start.
    assert!(lab.listing().contains("elements = { 10.96.0.0/16 }"), "{}\n{}", lab.listing(), lab.proxy_log());
    let err = lab.ask("client", L4Proto::Tcp, &format!("{UNALLOCATED}:80")).expect_err("dropped");
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");

    // A new object adds its range, a deleted one takes it away (each a full sync, at once).
    let within = Duration::from_secs(5);
    api.apply(objects(&service_cidr("more", "10.100.0.0/16")).remove(0));
    assert!(lab.eventually(within, || lab.listing().contains("10.100.0.0/16")), "{}", lab.proxy_log());
    api.delete("ServiceCIDR", "", "kubernetes");
    assert!(lab.eventually(within, || !lab.listing().contains("10.96.0.0/16")), "{}", lab.proxy_log());
    assert!(lab.listing().contains("10.100.0.0/16"));
    drop(proxy);
    api.stop();

    // An API server without ServiceCIDRs (before 1.33, or a role without the grant): the
    // proxy syncs anyway, without the drop, and says why.
    let mut old = FakeApi::start(&lab.lab.node("node1").ns);
    old.hide(SERVICE_CIDRS);
    for obj in objects(&cluster) {
        old.apply(obj);
    }
    let kubeconfig = lab.write("kubeconfig", &old.kubeconfig());
    let _proxy = lab.run_proxy_from(&["--kubeconfig", kubeconfig.to_str().unwrap()], &[]);
    assert!(lab.eventually(within, || !lab.listing().contains("service-cidrs")), "{}", lab.proxy_log());
    assert_eq!(lab.ask("client", L4Proto::Tcp, "10.96.0.10:80").unwrap().backend, "web-1");
    assert!(lab.proxy_log().contains("the API server does not serve them"), "{}", lab.proxy_log());
    old.stop();
}
