//! kube-proxy's feature gates (`--feature-gates`, `featureGates:`), as kube-proxy v1.37.2 knows
//! them: the list is `kube_proxy_feature_gates.tsv`, checked against the real binary by
//! `integration/audit.rs`. nftproxy has no feature gates of its own (it implements kube-proxy's
//! nftables mode with its default gates), so a gate never switches anything here; but what
//! upstream refuses is refused with upstream's message, and a gate set to anything but its
//! default is named in a warning, never ignored in silence.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use super::ConfigError;

/// Whether upstream accepts a value other than the gate's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fixed {
    /// Either value is accepted.
    No,
    /// Locked to its default: any other value is refused.
    Locked,
    /// Gates on by default depend on it: the other value is refused unless they are turned off
    /// too.
    Needed,
}

/// One of kube-proxy's feature gates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gate {
    pub name: String,
    /// `ALPHA`, `BETA`, `GA` or `DEPRECATED`.
    pub stage: String,
    pub default: bool,
    pub fixed: Fixed,
}

/// Every gate kube-proxy v1.37.2 knows, by name.
pub fn known() -> &'static BTreeMap<String, Gate> {
    static GATES: OnceLock<BTreeMap<String, Gate>> = OnceLock::new();
    GATES.get_or_init(|| {
        include_str!("kube_proxy_feature_gates.tsv")
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let mut f = l.split('\t');
                let (name, stage, default, fixed) = (f.next()?, f.next()?, f.next()?, f.next()?);
                let fixed = match fixed {
                    "locked" => Fixed::Locked,
                    "needed" => Fixed::Needed,
                    _ => Fixed::No,
                };
                let gate = Gate { name: name.to_string(), stage: stage.to_string(), default: default == "true", fixed };
                Some((name.to_string(), gate))
            })
            .collect()
    })
}

/// Checks the gates a configuration sets as upstream's `Complete` does: an unknown gate, or a
/// locked one set to the other value, is refused with upstream's message; every gate set to
/// something other than its default is named in a warning (nftproxy switches nothing with it).
pub fn review(gates: &BTreeMap<String, bool>) -> Result<Vec<String>, ConfigError> {
    let known = known();
    let mut warnings = Vec::new();
    for (name, &value) in gates {
        let Some(gate) = known.get(name) else {
            return Err(ConfigError::Complete(format!("unrecognized feature gate: {name}")));
        };
        if value == gate.default {
            continue;
        }
        match gate.fixed {
            Fixed::Locked => {
                return Err(ConfigError::Complete(format!(
                    "cannot set feature gate {name} to {value}, feature is locked to {}",
                    gate.default
                )));
            }
            Fixed::Needed => warnings.push(format!(
                "feature gate {name}={value}: ignored; nftproxy has no feature gates (kube-proxy refuses this unless \
                 the gates on by default that depend on {name} are turned off too)"
            )),
            Fixed::No => warnings.push(format!(
                "feature gate {name}={value}: ignored; nftproxy has no feature gates and behaves as kube-proxy v1.37 \
                 with {name} at its default ({}, {})",
                gate.default,
                gate.stage.to_lowercase()
            )),
        }
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gates(pairs: &[(&str, bool)]) -> BTreeMap<String, bool> {
        pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
    }

    #[test]
    fn the_list_is_kube_proxys() {
        let known = known();
        assert!(known.len() > 200, "{}", known.len());
        let g = &known["KubeProxyNFTablesLocalhostNodePorts"];
        assert_eq!((g.stage.as_str(), g.default, g.fixed), ("ALPHA", false, Fixed::No));
        assert_eq!(known["AllAlpha"].fixed, Fixed::No);
    }

    #[test]
    fn upstreams_refusals_and_each_ignored_gate_named() {
        let err = review(&gates(&[("NoSuchGate", true)])).unwrap_err();
        assert_eq!(err.to_string(), "failed complete: unrecognized feature gate: NoSuchGate");
        let err = review(&gates(&[("AggregatedDiscoveryRemoveBetaType", false)])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "failed complete: cannot set feature gate AggregatedDiscoveryRemoveBetaType to false, feature is locked to true"
        );
        // Defaults switch nothing anywhere: quiet.
        assert_eq!(review(&gates(&[("AggregatedDiscoveryRemoveBetaType", true), ("AllAlpha", false)])), Ok(vec![]));
        let warnings =
            review(&gates(&[("KubeProxyNFTablesLocalhostNodePorts", true), ("APIServerIdentity", false)])).unwrap();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].starts_with("feature gate APIServerIdentity=false: ignored"), "{warnings:?}");
        assert!(
            warnings[1].starts_with("feature gate KubeProxyNFTablesLocalhostNodePorts=true: ignored"),
            "{warnings:?}"
        );
    }
}
