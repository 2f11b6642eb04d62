//! The alert rules in `deploy/chart/files/`: checked and unit-tested by the real promtool
//! (`scripts/operator-bins`), and every series their unit tests feed them is one `nftproxy run`
//! really exports — the family, its label names, and each label's value — read from a running
//! agent's `/metrics` in the lab.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::common::*;

fn files() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/chart/files")
}

fn promtool(args: &[&str]) -> String {
    let out = Command::new(operator_bin("promtool")).args(args).current_dir(files()).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool {args:?}: {}\n{text}", out.status);
    text
}

#[test]
fn promtool_checks_the_rules_and_passes_their_unit_tests() {
    let checked = promtool(&["check", "rules", "nftproxy.rules.yaml"]);
    assert!(checked.contains("SUCCESS: 7 rules found"), "{checked}");
    let tested = promtool(&["test", "rules", "nftproxy.rules.test.yaml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // Every alert has a unit test that expects it to fire.
    let rules: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(files().join("nftproxy.rules.yaml")).unwrap()).unwrap();
    let tests = unit_tests();
    let fired: BTreeSet<&str> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .filter(|a| a["exp_alerts"].as_array().is_some_and(|e| !e.is_empty()))
        .filter_map(|a| a["alertname"].as_str())
        .collect();
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let name = rule["alert"].as_str().unwrap();
            assert!(fired.contains(name), "{name} has no unit test in which it fires");
            let runbook = rule["annotations"]["runbook"].as_str().unwrap();
            let anchor = runbook.strip_prefix("docs/troubleshooting.md#").expect("a runbook in troubleshooting.md");
            assert_eq!(anchor, name.to_lowercase(), "{name}'s runbook anchor");
        }
    }
}

fn unit_tests() -> Value {
    serde_yaml_ng::from_str(&std::fs::read_to_string(files().join("nftproxy.rules.test.yaml")).unwrap()).unwrap()
}

/// `name{a="x",b="y"}` → (name, labels).
fn parse_series(series: &str) -> (String, BTreeMap<String, String>) {
    let (name, rest) = series.split_once('{').unwrap_or((series, "}"));
    let mut labels = BTreeMap::new();
    let body = rest.trim_end_matches('}');
    let mut chars = body.chars().peekable();
    while chars.peek().is_some() {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        assert_eq!(chars.next(), Some('"'), "{series}");
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => value.extend(chars.next()),
                '"' => break,
                c => value.push(c),
            }
        }
        labels.insert(key.trim().to_string(), value);
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
    (name.to_string(), labels)
}

/// The samples of an exposition: (series name, labels).
fn samples(text: &str) -> Vec<(String, BTreeMap<String, String>)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let series = match l.find('}') {
                Some(end) => &l[..=end],
                None => l.split_whitespace().next().unwrap(),
            };
            parse_series(series)
        })
        .collect()
}

/// Label values a lab run without failures cannot show, each with the place in the source that
/// writes it.
const UNSEEN: &[(&str, &str, &str, &str)] = &[
    ("nftproxy_syncs_total", "result", "failure", "src/metrics.rs"),
    ("nftproxy_syncs_total", "reason", "failed", "src/agent/mod.rs"),
];

#[test]
fn every_series_the_unit_tests_use_is_exported() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let manifests = |trigger: &str, endpoint: &str| {
        format!(
            r#"apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  clusterIP: 10.96.0.10
  ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1a2b3
  namespace: default
  labels: {{kubernetes.io/service-name: web}}
  annotations: {{endpoints.kubernetes.io/last-change-trigger-time: "{trigger}"}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
- {{addresses: ["{endpoint}"], nodeName: node1, conditions: {{ready: true}}}}
"#
        )
    };
    let rfc3339 = |t: std::time::SystemTime| humantime::format_rfc3339_seconds(t).to_string();
    let path = lab.write("cluster.yaml", &manifests(&rfc3339(std::time::SystemTime::now()), "10.244.1.10"));
    let _proxy = lab.run_proxy(&path, &["--metrics-bind-address", "127.0.0.1:10249"]);
    // A change after the start: a queued sync and a network-programming sample (its trigger
    // time, in whole seconds, after the process started).
    std::thread::sleep(Duration::from_millis(1500));
    rewrite(&path, &manifests(&rfc3339(std::time::SystemTime::now()), "10.244.1.11"));
    let scrape = || lab.http_get("node1", "127.0.0.1:10249", "/metrics").map(|(_, t)| t).unwrap_or_default();
    assert!(
        lab.eventually(Duration::from_secs(10), || {
            let text = scrape();
            text.contains("kubeproxy_network_programming_duration_seconds_count")
                && text.contains("nftproxy_syncs_total{reason=\"changes\"")
                && text.contains("nftproxy_check_findings")
        }),
        "no change synced:\n{}\n{}",
        scrape(),
        lab.proxy_log()
    );
    let text = scrape();
    let exported = samples(&text);

    let tests = unit_tests();
    let mut checked = 0;
    for test in tests["tests"].as_array().unwrap() {
        for input in test["input_series"].as_array().unwrap() {
            let (name, mut labels) = parse_series(input["series"].as_str().unwrap());
            // Added by Prometheus to every series of a target.
            labels.remove("job");
            labels.remove("instance");
            let same_name: Vec<&BTreeMap<String, String>> =
                exported.iter().filter(|(n, _)| *n == name).map(|(_, l)| l).collect();
            assert!(!same_name.is_empty(), "{name} is not exported:\n{text}");
            let names: BTreeSet<&String> = labels.keys().collect();
            assert!(
                same_name.iter().any(|l| l.keys().collect::<BTreeSet<_>>() == names),
                "{name}: no exported series has the labels {names:?}: {same_name:?}"
            );
            for (key, value) in &labels {
                let seen = same_name.iter().any(|l| match (l.get(key), key.as_str()) {
                    (Some(v), "le") => v.parse::<f64>().ok() == value.parse::<f64>().ok(),
                    (Some(v), _) => v == value,
                    (None, _) => false,
                });
                let unseen = UNSEEN.iter().find(|(n, k, v, _)| *n == name && k == key && v == value);
                match unseen {
                    _ if seen => {}
                    Some((_, _, value, source)) => {
                        let written = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(source))
                            .map(|s| s.contains(&format!("\"{value}\"")))
                            .unwrap_or(false);
                        assert!(written, "{name}{{{key}=\"{value}\"}}: not in {source}");
                    }
                    None => panic!("{name}{{{key}=\"{value}\"}} is not exported: {same_name:?}"),
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 30, "{checked} label values checked");
}
