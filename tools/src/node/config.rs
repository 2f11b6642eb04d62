//! The node's configuration files: containerd's, the CNI network containerd fills in with the
//! node's pod range, kubelet's, and the kubeconfig kubelet authenticates with. Text in, text out:
//! what a provisioning tool (kind's node image, `hack/local-up-cluster.sh`) writes on a real node.

use std::net::Ipv4Addr;
use std::path::Path;

/// The pause image containerd runs every pod's sandbox from (kubeadm v1.37's `PauseVersion`).
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10.2";

/// Where Debian's containernetworking-plugins puts the CNI plugins.
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// containerd 1.6's configuration (version 2) for a node whose files live in `dir`.
///
/// - state under `/run` (the node's tmpfs: gone on reboot), images and snapshots in `dir`;
/// - the CRI plugin with the pause image above, cgroupfs (kubelet's driver here), and
///   `restrict_oom_score_adj`: root on this machine lacks CAP_SYS_RESOURCE, so a negative
///   `oom_score_adj` cannot be set and runc fails the sandbox without it;
/// - CNI from Debian's plugins, its network written from `cni-template.json` once kubelet tells
///   containerd the node's pod range.
pub fn containerd(dir: &Path) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{d}/containerd.sock"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{d}/cni"
    conf_template = "{d}/cni-template.json"
"#
    )
}

/// The CNI network: a bridge (`cni0`, the pods' gateway, hairpin on as kubelet's bridge
/// networks have it) with host-local addresses from the node's pod range (`{{.PodCIDR}}` is
/// containerd's template field). Addresses are kept under `/run`: a reboot frees them.
pub fn cni_template() -> String {
    r#"{
  "cniVersion": "1.0.0",
  "name": "nftp",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "/run/cni-ipam",
        "ranges": [[{"subnet": "{{.PodCIDR}}"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
"#
    .to_string()
}

/// Which iptables the node's distribution uses (Debian's alternatives choose it): kubelet
/// writes its chains with it, and kube-proxy's image follows kubelet's choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IptablesBackend {
    Nft,
    Legacy,
}

impl IptablesBackend {
    /// `update-alternatives --set` arguments that make `iptables` and `ip6tables` this backend.
    pub fn alternatives(self) -> [[&'static str; 2]; 2] {
        match self {
            IptablesBackend::Nft => [["iptables", "/usr/sbin/iptables-nft"], ["ip6tables", "/usr/sbin/ip6tables-nft"]],
            IptablesBackend::Legacy => {
                [["iptables", "/usr/sbin/iptables-legacy"], ["ip6tables", "/usr/sbin/ip6tables-legacy"]]
            }
        }
    }
}

/// What kubelet needs of the cluster and the node.
#[derive(Debug, Clone)]
pub struct KubeletSettings<'a> {
    pub node_ip: Ipv4Addr,
    pub cgroup_root: &'a str,
    pub cluster_dns: Ipv4Addr,
    pub dir: &'a Path,
}

/// kubelet's configuration file.
///
/// - cgroup v1 (`failCgroupV1: false`) with the cgroupfs driver, under the node's own cgroup
///   root;
/// - the API server reaches it (logs, exec, port-forward) at the node's address; it accepts that
///   without client certificates (the lab has no CA to issue them: anonymous, always allowed,
///   on a network of namespaces that nothing outside reaches);
/// - eviction thresholds low enough for a shared build machine's disk;
/// - image garbage collection off (every image was imported; nothing can be pulled again).
pub fn kubelet(s: &KubeletSettings<'_>) -> String {
    let d = s.dir.display();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: {root}
containerRuntimeEndpoint: unix://{d}/containerd.sock
address: {ip}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {{enabled: true}}
  webhook: {{enabled: false}}
authorization:
  mode: AlwaysAllow
clusterDNS: [{dns}]
clusterDomain: cluster.local
resolvConf: {d}/resolv.conf
failSwapOn: false
protectKernelDefaults: false
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  nodefs.inodesFree: 1%
  imagefs.available: 1%
nodeStatusReportFrequency: 10s
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
fileCheckFrequency: 10s
rotateCertificates: false
serverTLSBootstrap: false
tlsCertFile: ""
"#,
        root = s.cgroup_root,
        ip = s.node_ip,
        dns = s.cluster_dns,
    )
}

/// The node's resolver configuration (what pods with `dnsPolicy: Default` get, and CoreDNS
/// forwards to): the wan router, which answers nothing — no name outside the cluster resolves.
pub fn resolv_conf() -> String {
    "nameserver 192.168.50.1\n".to_string()
}
