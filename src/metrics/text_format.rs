//! The Prometheus text format (0.0.4) that kube-proxy's `/metrics` serves, from the OpenMetrics
//! text that `prometheus-client` writes. OpenMetrics is served as it is when the scraper asks
//! for it in `Accept` (upstream serves the text format only).

/// The text format's content type.
pub(crate) const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// OpenMetrics' content type.
pub(crate) const OPENMETRICS_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Whether an `Accept` header asks for OpenMetrics.
pub(crate) fn wants_openmetrics(accept: &str) -> bool {
    accept.split(',').any(|part| {
        let mut params = part.split(';').map(str::trim);
        let media = params.next().unwrap_or("");
        // `q=0` refuses a type.
        media.eq_ignore_ascii_case("application/openmetrics-text") && !params.any(|p| p == "q=0" || p == "q=0.0")
    })
}

/// What a family's name is in the text format, and which samples it drops, by OpenMetrics type.
fn text_name(name: &str, kind: &str) -> (String, &'static str) {
    match kind {
        "counter" if !name.ends_with("_total") => (format!("{name}_total"), "counter"),
        "counter" => (name.to_string(), "counter"),
        "info" => (format!("{name}_info"), "gauge"),
        "gauge" => (name.to_string(), "gauge"),
        "histogram" => (name.to_string(), "histogram"),
        "summary" => (name.to_string(), "summary"),
        _ => (name.to_string(), "untyped"),
    }
}

/// Rewrites OpenMetrics text as Prometheus text: counters' and infos' families named as their
/// samples are, no `# UNIT`, no `_created` samples, no exemplars, no `# EOF`.
pub(crate) fn from_openmetrics(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    // Families whose `_created` samples go (created timestamps are OpenMetrics-only).
    let mut with_created: Vec<String> = Vec::new();
    let mut kinds: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some((name, kind)) = rest.split_once(' ')
        {
            kinds.insert(name, kind);
            if matches!(kind, "counter" | "histogram" | "summary") {
                with_created.push(format!("{name}_created"));
            }
        }
    }
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            let (name, _) = text_name(name, kinds.get(name).copied().unwrap_or("unknown"));
            // OpenMetrics escapes `"` in help texts; the text format does not.
            out.push_str(&format!("# HELP {name} {}\n", text.replace("\\\"", "\"")));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (name, kind) = text_name(name, kind);
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        let sample_name = line.split(['{', ' ']).next().unwrap_or("");
        if with_created.iter().any(|c| c == sample_name) {
            continue;
        }
        // Exemplars follow ` # ` after the value.
        let sample = match line.find(" # ") {
            Some(i) if !line.starts_with('#') => &line[..i],
            _ => line,
        };
        out.push_str(sample);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OM: &str = "# HELP kubeproxy_sync_proxy_rules_endpoint_changes Cumulative proxy rules \\\"Endpoint\\\" changes.\n\
# TYPE kubeproxy_sync_proxy_rules_endpoint_changes counter\n\
kubeproxy_sync_proxy_rules_endpoint_changes_total 3\n\
kubeproxy_sync_proxy_rules_endpoint_changes_created 1700000000.0\n\
# HELP kubeproxy_sync_proxy_rules_duration_seconds SyncProxyRules latency in seconds.\n\
# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n\
# UNIT kubeproxy_sync_proxy_rules_duration_seconds seconds\n\
kubeproxy_sync_proxy_rules_duration_seconds_sum 0.5\n\
kubeproxy_sync_proxy_rules_duration_seconds_count 2\n\
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.001\"} 1 # {trace=\"x\"} 0.0005\n\
# HELP build Build information.\n\
# TYPE build info\n\
build_info{version=\"0.1.0\"} 1\n\
# HELP kubeproxy_sync_proxy_rules_last_timestamp_seconds The last time proxy rules were successfully synced.\n\
# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge\n\
kubeproxy_sync_proxy_rules_last_timestamp_seconds 1.7e9\n\
# EOF\n";

    #[test]
    fn openmetrics_becomes_the_text_format_kube_proxy_serves() {
        let text = from_openmetrics(OM);
        let expected = "# HELP kubeproxy_sync_proxy_rules_endpoint_changes_total Cumulative proxy rules \"Endpoint\" changes.\n\
# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_total counter\n\
kubeproxy_sync_proxy_rules_endpoint_changes_total 3\n\
# HELP kubeproxy_sync_proxy_rules_duration_seconds SyncProxyRules latency in seconds.\n\
# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n\
kubeproxy_sync_proxy_rules_duration_seconds_sum 0.5\n\
kubeproxy_sync_proxy_rules_duration_seconds_count 2\n\
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.001\"} 1\n\
# HELP build_info Build information.\n\
# TYPE build_info gauge\n\
build_info{version=\"0.1.0\"} 1\n\
# HELP kubeproxy_sync_proxy_rules_last_timestamp_seconds The last time proxy rules were successfully synced.\n\
# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge\n\
kubeproxy_sync_proxy_rules_last_timestamp_seconds 1.7e9\n";
        assert_eq!(text, expected);
    }

    #[test]
    fn openmetrics_only_when_asked() {
        assert!(!wants_openmetrics(""));
        assert!(!wants_openmetrics("text/plain;version=0.0.4;q=0.3,*/*;q=0.2"));
        assert!(wants_openmetrics(
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        ));
        assert!(!wants_openmetrics("application/openmetrics-text;q=0"));
    }
}
