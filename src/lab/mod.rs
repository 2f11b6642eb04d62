//! A lab of network namespaces for the demo, the integration tests and the benchmark: a node,
//! its pods, a client, all wired with veth pairs and none with a route out of the machine.

pub mod netns;

use thiserror::Error;

pub use netns::Netns;

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
