//! Whether the identity nftproxy runs as may do what it needs in the API. After an image swap
//! nftproxy runs under kube-proxy's ServiceAccount, bound to `system:node-proxier`: that role
//! lists and watches Services, EndpointSlices and Nodes, writes Events and, where the
//! MultiCIDRServiceAllocator gate is on (GA), lists ServiceCIDRs. A cluster whose role was
//! narrowed, or an older one, may lack a rule; `check --kubeconfig` asks the API server
//! (SelfSubjectAccessReview) and names each missing permission.

use super::{Finding, FindingKind, Severity};

/// One permission nftproxy uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Permission {
    pub verb: &'static str,
    pub group: &'static str,
    pub resource: &'static str,
    /// What nftproxy does with it, for the report.
    pub used_for: &'static str,
    /// Without it nftproxy cannot run at all (else it runs with less).
    pub required: bool,
}

const fn p(
    verb: &'static str,
    group: &'static str,
    resource: &'static str,
    used_for: &'static str,
    required: bool,
) -> Permission {
    Permission { verb, group, resource, used_for, required }
}

/// Every permission nftproxy uses (`deploy/rbac.yaml` grants them).
pub(crate) const NEEDED: &[Permission] = &[
    p("list", "", "services", "to program Services", true),
    p("watch", "", "services", "to follow Service changes", true),
    p("list", "discovery.k8s.io", "endpointslices", "to program endpoints", true),
    p("watch", "discovery.k8s.io", "endpointslices", "to follow endpoint changes", true),
    p("list", "", "nodes", "to read this node's addresses and zone", true),
    p("watch", "", "nodes", "to follow this node's Node", true),
    p(
        "list",
        "networking.k8s.io",
        "servicecidrs",
        "to drop traffic to unallocated addresses of the ServiceCIDRs, as upstream does",
        false,
    ),
    p("watch", "networking.k8s.io", "servicecidrs", "to follow ServiceCIDR changes", false),
    p("create", "events.k8s.io", "events", "to report bad objects and start-up problems as Events", false),
    p("patch", "events.k8s.io", "events", "to count repeated Events", false),
];

/// Findings for the permissions the API server denied.
pub(crate) fn findings(denied: &[Permission], identity: &str) -> Vec<Finding> {
    denied
        .iter()
        .map(|d| {
            let resource = if d.group.is_empty() { d.resource.to_string() } else { format!("{}.{}", d.resource, d.group) };
            Finding {
                severity: if d.required { Severity::Conflict } else { Severity::Warning },
                kind: FindingKind::MissingPermission,
                table: format!("api {identity}"),
                chain: None,
                hook: None,
                priority: None,
                summary: format!("{identity} may not {} {resource}", d.verb),
                effect: if d.required {
                    format!("nftproxy cannot start: it needs this {}", d.used_for)
                } else {
                    format!("nftproxy runs without it, unable {}", d.used_for)
                },
                remedy: format!(
                    "add `{{apiGroups: [\"{}\"], resources: [{}], verbs: [{}]}}` to the ClusterRole bound to {identity} \
                     (kube-proxy's is system:node-proxier; deploy/rbac.yaml has nftproxy's)",
                    d.group, d.resource, d.verb
                ),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_permission_is_named_with_its_rule() {
        let denied = [NEEDED[6], NEEDED[0]];
        let f = findings(&denied, "system:serviceaccount:kube-system:kube-proxy");
        assert_eq!(f[0].severity, Severity::Warning, "ServiceCIDRs are optional");
        assert_eq!(
            f[0].summary,
            "system:serviceaccount:kube-system:kube-proxy may not list servicecidrs.networking.k8s.io"
        );
        assert!(f[0].remedy.contains("apiGroups: [\"networking.k8s.io\"], resources: [servicecidrs], verbs: [list]"));
        assert_eq!(f[1].severity, Severity::Conflict, "Services are required");
    }

    /// The DaemonSet's role grants every permission listed here.
    #[test]
    fn the_shipped_role_grants_them_all() {
        let rbac = include_str!("../../deploy/rbac.yaml");
        for need in NEEDED {
            let granted = rbac.split("\n- apiGroups:").skip(1).any(|rule| {
                let group = if need.group.is_empty() { "\"\"" } else { need.group };
                let first = rule.lines().next().unwrap_or("");
                first.contains(group) && rule.contains(need.resource) && rule.contains(need.verb)
            });
            assert!(granted, "deploy/rbac.yaml lacks {need:?}");
        }
    }
}
