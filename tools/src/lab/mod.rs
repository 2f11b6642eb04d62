//! A lab of network namespaces for the demo, the integration tests and the benchmark: a node,
//! its pods, a client, all wired with veth pairs and none with a route out of the machine.

pub mod error;
pub mod netns;
pub mod privileges;
pub mod servers;
pub mod topology;
pub mod traffic;

pub use error::LabError;
pub use netns::Netns;
pub use privileges::{
    PRIVILEGED_TESTS_ENV, privileged_tests_required, require_privileges, skip_test, skip_unless_privileged,
    skip_without_kernel_feature,
};
pub use servers::ServerSpec;
pub use topology::{Lab, LabClient, LabNode, LabPod};

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
