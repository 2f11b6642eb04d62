//! A lab of network namespaces for the demo, the integration tests and the benchmark: a node,
//! its pods, a client, all wired with veth pairs and none with a route out of the machine.

pub mod netns;
pub mod servers;
pub mod topology;
pub mod traffic;

use thiserror::Error;

pub use netns::Netns;
pub use servers::ServerSpec;
pub use topology::{Lab, LabClient, LabNode, LabPod};

/// Errors building or using the lab.
#[derive(Debug, Error)]
pub enum LabError {
    #[error("{0}")]
    NotPrivileged(String),
    #[error("cannot run {0}: {1}")]
    Spawn(String, String),
    #[error("{command} failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("cannot enter network namespace {0}: {1}")]
    Enter(String, String),
    #[error("a thread inside namespace {0} panicked")]
    ThreadPanicked(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Checks that this process can create network namespaces (root, or CAP_SYS_ADMIN and
/// CAP_NET_ADMIN). Tests call it first and skip with its message when it fails.
pub fn require_privileges() -> Result<(), LabError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(LabError::NotPrivileged(
            "this test needs root (network namespaces and nftables); run it as root, e.g. with sudo".into(),
        ));
    }
    if std::process::Command::new("ip").arg("-V").output().is_err() {
        return Err(LabError::NotPrivileged("this test needs iproute2 (`ip`) on PATH".into()));
    }
    Ok(())
}

/// Deletes lab namespaces left behind by processes that no longer exist (a crashed or killed
/// demo or test): names are `nftp-<role>-<pid>-<n>`.
pub fn cleanup_stale() {
    let Ok(out) = std::process::Command::new("ip").args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let mut parts = name.split('-');
        if parts.next() != Some("nftp") {
            continue;
        }
        let pid = parts.nth(1).and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid
            && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::process::Command::new("ip").args(["netns", "delete", name]).output();
        }
    }
}
