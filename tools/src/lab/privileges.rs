//! Whether this process may build a lab (root, iproute2), and how a test that cannot run says
//! so: it skips, or with `NFTPROXY_PRIVILEGED_TESTS=1` it fails.

use super::error::LabError;

/// The environment variable that makes privileged tests fail rather than skip: set to `1` where
/// they must run (CI, as root), so a run that somehow lacks the privileges fails loudly instead
/// of passing with every kernel test skipped.
pub const PRIVILEGED_TESTS_ENV: &str = "NFTPROXY_PRIVILEGED_TESTS";

/// Whether privileged tests must run here (`NFTPROXY_PRIVILEGED_TESTS=1`).
pub fn privileged_tests_required() -> bool {
    std::env::var_os(PRIVILEGED_TESTS_ENV).is_some_and(|v| v == "1")
}

/// Skips a test that lacks the privileges to run: prints `SKIPPED: {reason}`, or, with
/// `NFTPROXY_PRIVILEGED_TESTS=1`, panics with the reason (the test fails).
pub fn skip_test(reason: impl std::fmt::Display) {
    assert!(!privileged_tests_required(), "{PRIVILEGED_TESTS_ENV}=1, but this test cannot run: {reason}");
    eprintln!("SKIPPED: {reason}");
}

/// Skips the part of a test that needs a kernel feature this kernel lacks (`feature`, e.g. the
/// `sctp` module): prints `SKIPPED ({feature}): {reason}`. With `NFTPROXY_PRIVILEGED_TESTS=1`
/// it panics instead ([`skip_test`]) unless the kernel cannot load modules at all (no
/// `/proc/modules`): such a kernel was built with or without the feature for good, and nothing
/// installed on the machine can add it.
pub fn skip_without_kernel_feature(feature: &str, reason: impl std::fmt::Display) {
    if std::path::Path::new("/proc/modules").exists() {
        skip_test(format_args!("{reason} (load or install the {feature} module)"));
    } else {
        eprintln!("SKIPPED ({feature}): {reason}; this kernel cannot load modules");
    }
}

/// For tests: whether to skip because this process cannot build a lab ([`require_privileges`]),
/// after saying why; with `NFTPROXY_PRIVILEGED_TESTS=1` it panics instead ([`skip_test`]).
pub fn skip_unless_privileged() -> bool {
    match require_privileges() {
        Ok(()) => false,
        Err(e) => {
            skip_test(e);
            true
        }
    }
}

/// Checks that this process can create network namespaces (root, or CAP_SYS_ADMIN and
/// CAP_NET_ADMIN). Tests call it first, through [`skip_unless_privileged`].
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
