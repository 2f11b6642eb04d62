//! nftproxy's integration tests, in one binary (one link instead of one per file): real
//! packets in network namespaces (the tools' lab), netlink round trips against the real kernel,
//! the syncer's differential oracle against the fake kernel, `nftproxy run` against a test API
//! server, the deploy manifests, and fuzzed input. Tests that need root say `SKIPPED` without
//! it, or fail with `NFTPROXY_PRIVILEGED_TESTS=1`. `cargo test --test integration <module>::`
//! runs one file's tests.

// Every file here is test code, helpers included: a failed unwrap is a failed test. (Clippy's
// `allow-unwrap-in-tests` covers `#[test]` functions and `#[cfg(test)]` modules only, not the
// helpers of an integration test crate.)
#![allow(clippy::unwrap_used)]

mod common;

mod alerts;
mod architecture;
mod audit;
mod chart;
mod check;
mod clusterip;
mod conntrack;
mod control_plane;
mod counters;
mod deploy;
mod differential;
mod docs;
mod explain;
mod external;
mod fuzz;
mod images;
mod installers;
mod kube;
mod netlink;
mod node;
mod observe;
mod random;
mod reconcile;
mod reliability;
mod selection;
mod service_cidr;
mod status;
mod sync;
mod takeover;
mod trace;
