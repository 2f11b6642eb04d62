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
    for (name, pid) in lab_namespaces() {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::process::Command::new("ip").args(["netns", "delete", &name]).output();
        }
    }
}

/// Kills every process in this process's lab namespaces and deletes them: the way out of a
/// run interrupted by a signal, when the lab's own drops cannot run (a control plane, nodes and
/// their daemons all live in those namespaces).
pub fn remove_own() {
    let own = std::process::id();
    for (name, _) in lab_namespaces().into_iter().filter(|(_, pid)| *pid == own) {
        if let Ok(out) = std::process::Command::new("ip").args(["netns", "pids", &name]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
        }
        let _ = std::process::Command::new("ip").args(["netns", "delete", &name]).output();
    }
}

/// The lab's namespaces here, with the PID of the process that made each.
fn lab_namespaces() -> Vec<(String, u32)> {
    let Ok(out) = std::process::Command::new("ip").args(["netns", "list"]).output() else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let name = line.split_whitespace().next()?;
            let mut parts = name.split('-');
            (parts.next() == Some("nftp")).then_some(())?;
            let pid = parts.nth(1)?.parse::<u32>().ok()?;
            Some((name.to_string(), pid))
        })
        .collect()
}
