//! kubeadm's own addons, written by kubeadm itself against the running API server
//! (`kubeadm init phase addon kube-proxy|coredns`): kube-proxy's ServiceAccount, RBAC, ConfigMap
//! and DaemonSet, and CoreDNS's Deployment, Service and ConfigMap, exactly as a kubeadm cluster
//! has them. The project writes only kubeadm's configuration file.

use std::net::Ipv4Addr;
use std::path::Path;

use super::error::NodeError;
use crate::controlplane::{API_PORT, ControlPlane};

/// kubeadm's configuration: the control plane's endpoint (what kube-proxy's kubeconfig names),
/// the cluster's ranges, and the `KubeProxyConfiguration` kubeadm puts into its ConfigMap.
pub fn configuration(endpoint: Ipv4Addr, pod_cidr: &str, service_cidr: &str, proxy: &str) -> String {
    format!(
        r#"apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
localAPIEndpoint:
  advertiseAddress: {endpoint}
  bindPort: {API_PORT}
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: v1.37.2
controlPlaneEndpoint: {endpoint}:{API_PORT}
networking:
  podSubnet: {pod_cidr}
  serviceSubnet: {service_cidr}
  dnsDomain: cluster.local
---
{proxy}"#
    )
}

/// Runs `kubeadm init phase addon <addon>` as the admin, in the control plane's namespace, with
/// `config` (written to `dir`); returns what kubeadm printed.
pub fn addon(cp: &ControlPlane, dir: &Path, addon: &str, config: &str) -> Result<String, NodeError> {
    let file = dir.join("kubeadm.yaml");
    std::fs::write(&file, config)?;
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", cp.namespace()])
        .arg(cp.bins.path("kubeadm"))
        .args(["init", "phase", "addon", addon])
        .arg(format!("--config={}", file.display()))
        .arg(format!("--kubeconfig={}", cp.admin_kubeconfig().display()))
        .output()?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(NodeError::Failed { what: format!("kubeadm init phase addon {addon}"), output: text });
    }
    Ok(text)
}
