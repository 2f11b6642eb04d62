//! Real nodes (tools/src/node): upstream's containerd, runc and CNI plugins with kubelet
//! v1.37.2 in lab namespaces, pods as real containers from images built offline
//! (`scripts/images`), kubeadm's own kube-proxy and CoreDNS addons. The operator's path runs on
//! them with clients opening new connections to the Services all along
//! (`tools/src/node/scenario.rs`): the image swap, the way back, the longer path on rebooted
//! nodes, kubelet and containerd restarts, a rolling update and a reboot. No connection to a
//! Service whose endpoints did not change may fail.

use crate::common::*;
use nftproxy_tools::node::scenario;

/// The image archives the nodes import (`scripts/images`).
fn images() -> Vec<std::path::PathBuf> {
    let images = nftproxy_tools::images::Images::locate().expect("the images (scripts/images)");
    images.all().iter().map(|i| i.archive.clone()).collect()
}

#[test]
fn kubeadms_kube_proxy_swapped_rolled_back_and_the_longer_path_on_real_nodes() {
    if skip_unless_privileged() {
        return;
    }
    let _one = crate::control_plane::ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let outcome = scenario::run(&images());
    let report = scenario::to_markdown(&outcome.records);
    if let Some(e) = &outcome.error {
        panic!("{e}\nphases so far:\n{report}");
    }
    eprintln!("{report}");
    for r in &outcome.records {
        if r.endpoints_unchanged {
            assert_eq!(r.failed(), 0, "{}: connections failed\n{report}", r.name);
            assert!(r.ok() > 0, "{}: no client asked\n{report}", r.name);
        }
    }
}

/// Kubernetes' own Conformance specs of `[sig-network]` (`e2e.test` v1.37.2, 47 specs), on real
/// nodes with kubeadm's kube-proxy and then, on the same cluster, with nftproxy after the image
/// swap: every spec kube-proxy passes must pass with nftproxy (`nftproxy-tools e2e` records the
/// same in docs/e2e/).
#[test]
fn upstreams_conformance_specs_pass_with_nftproxy_where_they_pass_with_kube_proxy() {
    use nftproxy_tools::node::config::IptablesBackend;
    use nftproxy_tools::node::e2e;
    if skip_unless_privileged() {
        return;
    }
    let _one = crate::control_plane::ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let nodes = [("node1", IptablesBackend::Nft), ("node2", IptablesBackend::Nft)];
    let mut s = scenario::NodeScenario::start(&nodes, &images()).expect("the cluster");
    let dir = s.dir().join("e2e");
    let comparison = match e2e::compare(&mut s, e2e::Selection::conformance(), &dir) {
        Ok(c) => c,
        Err(e) => panic!("{}", s.diagnose(&e)),
    };
    let table = comparison.to_markdown();
    eprintln!("{table}");
    assert!(comparison.reference.count("passed") >= 40, "the reference ran the Conformance specs:\n{table}");
    let regressions: Vec<String> =
        comparison.regressions().iter().map(|(name, r)| format!("{name}: {} — {}", r.state, r.message)).collect();
    assert!(regressions.is_empty(), "passed with kube-proxy, not with nftproxy:\n{}\n{table}", regressions.join("\n"));
}
