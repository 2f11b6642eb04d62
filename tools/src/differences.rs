//! Differences from upstream kube-proxy that the differential tests see (integration/
//! differential.rs, and the randomised clusters of [`crate::random`]), each a row of
//! docs/differences.md: one list for both, and a difference neither lists fails them.

/// Check names (or prefixes of them) of differences nftproxy makes on purpose. Empty: every
/// check agrees.
pub const DELIBERATE: &[&str] = &[];

/// Differences found and not yet resolved (fixed, or declared deliberate): the check name and
/// what is known, as docs/differences.md's "Open" section says. Tests report them and pass.
pub const OPEN: &[(&str, &str)] = &[
    (
        "random ClusterIP tcp from a pod that is its own endpoint without a nodeName",
        "hairpin: upstream v1.37 masquerades a pod reaching itself through a Service only for endpoints whose nodeName is this node (hairpin-connections set, pkg/proxy/nftables/proxier.go); nftproxy for every endpoint",
    ),
    ("random ClusterIP udp from a pod that is its own endpoint without a nodeName", "hairpin, as for tcp"),
];

fn listed(check: &str, entry: &str) -> bool {
    check == entry || check.strip_prefix(entry).is_some_and(|rest| rest.starts_with([':', ' ']))
}

/// Whether a check's difference is listed in [`DELIBERATE`] (an entry is the check's name or a
/// prefix of it that ends at a word).
pub fn is_deliberate(check: &str) -> bool {
    DELIBERATE.iter().any(|entry| listed(check, entry))
}

/// The [`OPEN`] entry a check's difference falls under, if any.
pub fn open(check: &str) -> Option<&'static (&'static str, &'static str)> {
    OPEN.iter().find(|(entry, _)| listed(check, entry))
}
