//! The process's life as upstream's kube-proxy lives it: the kernel check its nftables mode
//! makes, its OOM score, the restart it asks for when the `--config` file changes or its Node
//! goes away or changes addresses (the DaemonSet then starts it again with what is new).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tracing::{error, info, warn};

use crate::model::NodeInfo;
use crate::net::IpFamily;

/// The lowest kernel upstream's nftables mode runs on (`NFTablesKubeProxyKernelVersion`).
pub(crate) const NFTABLES_KERNEL: (u32, u32) = (5, 13);
/// Upstream's override of that check: any non-empty value skips it.
pub(crate) const SKIP_KERNEL_CHECK: &str = "KUBE_PROXY_NFTABLES_SKIP_KERNEL_VERSION_CHECK";

/// Upstream's kernel check for a `uname -r` release: `Err` with upstream's message when the
/// kernel is older than 5.13 (or its version cannot be read) and the check is not skipped.
pub(crate) fn kernel_check(release: &str, skip: bool) -> Result<(), String> {
    if skip {
        return Ok(());
    }
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|p| p.parse::<u32>().ok());
    let minor = parts.next().and_then(|p| p.parse::<u32>().ok());
    match (major, minor) {
        (Some(major), Some(minor)) if (major, minor) >= NFTABLES_KERNEL => Ok(()),
        (Some(_), Some(_)) => Err(format!(
            "kube-proxy in nftables mode requires kernel {}.{} or later",
            NFTABLES_KERNEL.0, NFTABLES_KERNEL.1
        )),
        _ => Err(format!("could not check kernel version: cannot parse {release:?}")),
    }
}

/// Whether this kernel does IPv6, as upstream checks it (`/proc/net/if_inet6` exists and
/// `disable_ipv6` is not set): upstream then runs an IPv6 proxier beside the IPv4 one, whose
/// health `/healthz` reports, whether or not the cluster uses IPv6.
pub(crate) fn ipv6_supported() -> bool {
    std::path::Path::new("/proc/net/if_inet6").exists()
        && std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/disable_ipv6").map_or(true, |v| v.trim() != "1")
}

/// This kernel's release (`uname -r`).
pub(crate) fn kernel_release() -> String {
    nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_default()
}

/// Sets the process's OOM score adjustment (upstream: `oomScoreAdj`, default -999). Lowering
/// it needs CAP_SYS_RESOURCE, which nftproxy's own DaemonSet does not give (`NET_ADMIN` only):
/// there the container keeps what its runtime set, -997 for a `system-node-critical` pod, as
/// good as -999 against the OOM killer, and that is said once, as information. Only a process
/// left without protection (a score of zero or more kept) is warned about. Upstream logs the failure
/// at verbosity 2 whatever the score is.
pub(crate) fn set_oom_score_adj(value: i32) {
    let path = "/proc/self/oom_score_adj";
    let current = std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<i32>().ok());
    if current == Some(value) {
        return;
    }
    match (std::fs::write(path, value.to_string()), current) {
        (Ok(()), _) => info!(oom_score_adj = value, "OOM score adjusted"),
        (Err(e), Some(kept)) if kept < 0 => info!(
            oom_score_adj = value,
            kept,
            error = %e,
            "kept the OOM score adjustment the container runtime set (lowering it needs CAP_SYS_RESOURCE)"
        ),
        (Err(e), kept) => warn!(
            oom_score_adj = value,
            ?kept,
            error = %e,
            "cannot set the OOM score adjustment: the OOM killer may pick this process (give the container \
             CAP_SYS_RESOURCE, or run it in a system-node-critical pod, whose runtime sets -997)"
        ),
    }
}

/// Why the process ends so that it is started again.
#[derive(Debug, Clone, Default)]
pub(crate) struct Restart {
    reason: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
}

impl Restart {
    /// A restart that stops the loop behind `stop`.
    pub(crate) fn new(stop: Arc<AtomicBool>) -> Restart {
        Restart { reason: Arc::default(), stop }
    }

    /// Asks for the restart (the first reason is kept).
    pub(crate) fn ask(&self, reason: String) {
        if let Ok(mut r) = self.reason.lock() {
            r.get_or_insert(reason);
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    /// The reason, once asked.
    pub(crate) fn reason(&self) -> Option<String> {
        self.reason.lock().ok().and_then(|r| r.clone())
    }
}

/// The `--config` file's content, hashed (a ConfigMap update swaps a symlink: the content is
/// what tells).
fn digest(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok().map(|bytes| Sha256::digest(&bytes).to_vec())
}

/// Watches the `--config` file; when its content changes, logs upstream's line and asks for a
/// restart, as kube-proxy exits so that the new configuration is read at start-up.
pub(crate) fn watch_config_file(path: PathBuf, every: Duration, restart: Restart) -> std::io::Result<()> {
    let first = digest(&path);
    std::thread::Builder::new().name("config-watch".into()).spawn(move || {
        while !restart.stop.load(Ordering::Relaxed) {
            std::thread::sleep(every);
            let now = digest(&path);
            // A file briefly absent mid-update is not a change yet.
            if now.is_some() && now != first {
                error!(file = %path.display(), "content of the proxy server's configuration file was updated; exiting to restart with it");
                restart.ask(format!("the configuration file {} changed", path.display()));
                return;
            }
        }
    })?;
    Ok(())
}

/// The first IP of each family, in the Node's order: upstream's node IPs.
fn node_ips(node: &NodeInfo) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    for ip in &node.host_ips {
        if !out.iter().any(|o| IpFamily::of(o) == IpFamily::of(ip)) {
            out.push(*ip);
        }
    }
    out
}

/// What upstream's NodeManager does when this node's Node changes after start-up.
#[derive(Debug, Default)]
pub(crate) struct NodeWatch {
    /// The node IPs (and pod CIDRs, when watched) first seen.
    seen: Option<(Vec<IpAddr>, Vec<ipnet::IpNet>)>,
    /// NodeCIDR mode: pod CIDR changes restart too.
    pub(crate) watch_pod_cidrs: bool,
}

impl NodeWatch {
    /// A watch that also restarts on pod CIDR changes when `watch_pod_cidrs` (NodeCIDR mode).
    pub(crate) fn new(watch_pod_cidrs: bool) -> NodeWatch {
        NodeWatch { seen: None, watch_pod_cidrs }
    }

    /// Checks the Node as the index has it now: `Some(reason)` when the process must restart
    /// (the Node was deleted, or its IPs or watched pod CIDRs changed).
    pub(crate) fn check(&mut self, node: Option<&NodeInfo>) -> Option<String> {
        let Some(node) = node else {
            return self.seen.is_some().then(|| "Node is being deleted".to_string());
        };
        let now = (node_ips(node), node.pod_cidrs.clone());
        let Some(seen) = &self.seen else {
            if !now.0.is_empty() {
                self.seen = Some(now);
            }
            return None;
        };
        if seen.0 != now.0 {
            return Some(format!("NodeIPs changed for the node: new {:?}, old {:?}", now.0, seen.0));
        }
        if self.watch_pod_cidrs && seen.1 != now.1 {
            return Some(format!("PodCIDRs changed for the node: new {:?}, old {:?}", now.1, seen.1));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_check_is_upstreams() {
        assert_eq!(kernel_check("6.8.0-45-generic", false), Ok(()));
        assert_eq!(kernel_check("5.13.0", false), Ok(()));
        assert_eq!(
            kernel_check("5.10.0-28-amd64", false),
            Err("kube-proxy in nftables mode requires kernel 5.13 or later".into())
        );
        assert_eq!(kernel_check("5.10.0", true), Ok(()), "skipped");
        assert!(kernel_check("weird", false).unwrap_err().starts_with("could not check kernel version"));
    }

    fn node(ips: &[&str], cidrs: &[&str]) -> NodeInfo {
        NodeInfo {
            name: "n".into(),
            host_ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
            pod_cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            ..NodeInfo::default()
        }
    }

    #[test]
    fn a_deleted_node_or_new_ips_restart() {
        let mut w = NodeWatch::default();
        assert_eq!(w.check(None), None, "not seen yet: upstream waits");
        assert_eq!(w.check(Some(&node(&[], &[]))), None, "no IPs yet");
        assert_eq!(w.check(Some(&node(&["10.0.0.1", "10.0.0.9"], &["10.244.0.0/24"]))), None);
        assert_eq!(
            w.check(Some(&node(&["10.0.0.1", "10.0.0.7"], &["10.244.1.0/24"]))),
            None,
            "only the first of a family counts; pod CIDRs unwatched"
        );
        assert!(w.check(Some(&node(&["10.0.0.2"], &[]))).unwrap().starts_with("NodeIPs changed"));
        assert_eq!(w.check(None).as_deref(), Some("Node is being deleted"));
        let mut w = NodeWatch::new(true);
        w.check(Some(&node(&["10.0.0.1"], &["10.244.0.0/24"])));
        assert!(w.check(Some(&node(&["10.0.0.1"], &["10.244.1.0/24"]))).unwrap().starts_with("PodCIDRs changed"));
    }

    #[test]
    fn an_edited_config_file_asks_for_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.conf");
        std::fs::write(&path, "mode: nftables\n").unwrap();
        let restart = Restart::new(Arc::new(AtomicBool::new(false)));
        watch_config_file(path.clone(), Duration::from_millis(20), restart.clone()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(restart.reason(), None, "unchanged");
        std::fs::write(&path, "mode: iptables\n").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while restart.reason().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(restart.reason().unwrap().contains("config.conf"));
        assert!(restart.stop.load(Ordering::Relaxed));
    }
}
