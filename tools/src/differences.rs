//! Differences from upstream kube-proxy that the differential tests see (integration/
//! differential.rs, and the randomised clusters of [`crate::random`]), each a row of
//! docs/differences.md: one list for both, and a difference neither lists fails them.

/// Check names (or prefixes of them) of differences nftproxy makes on purpose, each a row of
/// docs/differences.md's table.
pub const DELIBERATE: &[&str] = &[
    // integration/differential.rs: nftproxy deletes a deleted UDP Service's flows.
    "conntrack: UDP Service deleted",
    // The randomised clusters: a pod reaching itself through a Service when its endpoint
    // carries no nodeName is masqueraded (the connection works); upstream's hairpin set holds
    // only endpoints with this node's name (the connection times out).
    "random ClusterIP tcp from a pod that is its own endpoint without a nodeName",
    "random ClusterIP udp from a pod that is its own endpoint without a nodeName",
];

fn listed(check: &str, entry: &str) -> bool {
    check == entry || check.strip_prefix(entry).is_some_and(|rest| rest.starts_with([':', ' ']))
}

/// Whether a check's difference is listed in [`DELIBERATE`] (an entry is the check's name or a
/// prefix of it that ends at a word).
pub fn is_deliberate(check: &str) -> bool {
    DELIBERATE.iter().any(|entry| listed(check, entry))
}
