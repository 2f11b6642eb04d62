//! The Helm chart in `deploy/chart`: linted by Helm, and rendered with its defaults into exactly
//! the objects `kubectl kustomize deploy/` gives, so the two ways to install cannot drift; each
//! value then changes what it says. Helm and kubectl are the real ones (`scripts/operator-bins`,
//! `scripts/upstream-bins`); no root needed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::CommandFactory;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use serde_json::Value;

use crate::common::operator_bin;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn chart() -> PathBuf {
    repo().join("deploy/chart")
}

/// Runs a program; its stdout, or a panic with its stderr.
fn output(program: &Path, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{}: {e}", program.display()));
    assert!(
        out.status.success(),
        "{} {args:?}: {}\n{}",
        program.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The chart rendered as `helm template nftproxy deploy/chart -n kube-system` with `values` (a
/// YAML text) on top of its defaults.
fn template(values: &str) -> Result<String, String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.yaml");
    std::fs::write(&file, values).unwrap();
    let out = Command::new(operator_bin("helm"))
        .args(["template", "nftproxy"])
        .arg(chart())
        .args(["--namespace", "kube-system", "--values"])
        .arg(&file)
        .output()
        .unwrap();
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn documents(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|doc| <Value as serde::Deserialize>::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// Objects by `Kind/namespace/name`; a ConfigMap's `config.yaml` parsed, so that key order and
/// comments do not count.
fn objects(text: &str) -> BTreeMap<String, Value> {
    documents(text)
        .into_iter()
        .map(|mut o| {
            let key = format!(
                "{}/{}/{}",
                o["kind"].as_str().unwrap_or(""),
                o["metadata"]["namespace"].as_str().unwrap_or(""),
                o["metadata"]["name"].as_str().unwrap_or("")
            );
            if let Some(text) = o["data"]["config.yaml"].as_str() {
                let parsed: Value = serde_yaml_ng::from_str(text).unwrap();
                o["data"]["config.yaml"] = parsed;
            }
            (key, o)
        })
        .collect()
}

fn typed<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_path_to_error::deserialize(v.clone()).unwrap_or_else(|e| panic!("{}: {}", e.path(), e.inner()))
}

#[test]
fn helm_lints_the_chart_with_every_switch() {
    let helm = operator_bin("helm");
    let chart = chart();
    output(&helm, &["lint", "--strict", chart.to_str().unwrap()]);
    output(
        &helm,
        &[
            "lint",
            "--strict",
            chart.to_str().unwrap(),
            "--set",
            "metrics.bindAddress=0.0.0.0,serviceMonitor.enabled=true,prometheusRule.enabled=true",
            "--set",
            "apiServer.host=192.0.2.10,image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ],
    );
}

#[test]
fn the_charts_defaults_render_what_kustomize_renders() {
    let kubectl = nftproxy_tools::controlplane::UpstreamBins::locate().unwrap().path("kubectl");
    let kustomized = objects(&output(&kubectl, &["kustomize", repo().join("deploy").to_str().unwrap()]));
    let helm = objects(&template("{}").unwrap());
    assert_eq!(
        kustomized.keys().collect::<Vec<_>>(),
        helm.keys().collect::<Vec<_>>(),
        "the same objects (deploy/chart and deploy/kustomization.yaml)"
    );
    for (key, object) in &kustomized {
        assert_eq!(
            object,
            &helm[key],
            "{key}: kustomize (left) and the chart's defaults (right) differ:\n{}\n---\n{}",
            serde_yaml_ng::to_string(object).unwrap(),
            serde_yaml_ng::to_string(&helm[key]).unwrap()
        );
    }
    assert_eq!(kustomized.len(), 6, "{:?}", kustomized.keys());
}

#[test]
fn each_value_changes_what_it_says() {
    let rendered = template(
        r#"
image: {repository: registry.example/nftproxy, tag: "0.2.0", digest: "sha256:abc"}
apiServer: {host: 192.0.2.10, port: 6443}
metrics: {bindAddress: 0.0.0.0, port: 10249}
healthz: {port: 10266}
serviceMonitor: {enabled: true, labels: {release: prom}}
prometheusRule: {enabled: true, disabled: [NftproxyNetworkProgrammingSlow]}
configFile: |
  apiVersion: kubeproxy.config.k8s.io/v1alpha1
  kind: KubeProxyConfiguration
  mode: iptables
  clusterCIDR: 10.1.0.0/16,fd00:1::/56
  iptables: {syncPeriod: 1m}
  metricsBindAddress: 10.0.0.1:9999
extraArgs: [--table-ownership=false]
debug: {bindAddress: "127.0.0.1:10259"}
serviceCounters: false
tolerations: []
resources: {requests: {cpu: 50m, memory: 100Mi}, limits: {memory: 1Gi}}
"#,
    )
    .unwrap();
    let raw = documents(&rendered);
    let rendered = objects(&rendered);
    let ds: DaemonSet = typed(&rendered["DaemonSet/kube-system/nftproxy"]);
    let pod = ds.spec.unwrap().template.spec.unwrap();
    let c = &pod.containers[0];
    assert_eq!(c.image.as_deref(), Some("registry.example/nftproxy:0.2.0@sha256:abc"));
    assert_eq!(pod.init_containers.unwrap()[0].image, c.image, "one image for both containers");
    // The API server's address: the ConfigMap the pods' KUBERNETES_SERVICE_HOST/PORT come from.
    let from: BTreeMap<String, String> = c
        .env
        .clone()
        .unwrap()
        .into_iter()
        .filter_map(|e| Some((e.name, e.value_from?.config_map_key_ref?.name)))
        .collect();
    let api = &rendered["ConfigMap/kube-system/nftproxy-api-server"];
    assert_eq!(from.get("KUBERNETES_SERVICE_HOST").map(String::as_str), api["metadata"]["name"].as_str());
    assert_eq!(api["data"]["KUBERNETES_SERVICE_HOST"], "192.0.2.10");
    assert_eq!(api["data"]["KUBERNETES_SERVICE_PORT"], "6443");
    let args = c.args.clone().unwrap();
    assert!(args.contains(&"--table-ownership=false".to_string()));
    assert!(args.contains(&"--debug-bind-address=127.0.0.1:10259".to_string()));
    assert!(args.contains(&"--service-counters=false".to_string()));
    // The binary takes the arguments the chart gives it.
    let mut argv = vec!["nftproxy".to_string()];
    argv.extend(args);
    nftproxy::cli::Cli::command().try_get_matches_from(argv).expect("the chart's arguments parse");
    assert!(pod.tolerations.is_none());
    let ports: Vec<(String, i32)> =
        c.ports.clone().unwrap().into_iter().map(|p| (p.name.unwrap_or_default(), p.container_port)).collect();
    assert_eq!(ports, [("healthz".to_string(), 10266), ("metrics".to_string(), 10249)]);
    let probe = c.liveness_probe.clone().unwrap().http_get.unwrap();
    assert_eq!(probe.port, k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(10266));
    assert_eq!(c.resources.clone().unwrap().limits.unwrap()["memory"].0, "1Gi");

    // The configuration nftproxy reads: the values' fields and the two addresses, without a
    // warning.
    let cm: ConfigMap =
        typed(raw.iter().find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "nftproxy").unwrap());
    let text = cm.data.unwrap().remove("config.yaml").unwrap();
    let (kp, warnings) = nftproxy::config::kubeproxy::KubeProxyConfiguration::parse(&text).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(kp.validate(), Ok(()));
    assert_eq!(kp.healthz_bind_address, "0.0.0.0:10266");
    assert_eq!(kp.metrics_bind_address, "0.0.0.0:10249");
    assert_eq!(kp.sync_periods().0, nftproxy::config::duration::GoDuration::from_secs(60), "mode iptables' section");
    assert_eq!(kp.cluster_cidrs(), ["10.1.0.0/16", "fd00:1::/56"]);
    // `config` is merged into the defaults.
    let merged = documents(&template("config: {clusterCIDR: 10.9.0.0/16}").unwrap());
    let text = merged.iter().find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "nftproxy").unwrap()["data"]
        ["config.yaml"]
        .as_str()
        .unwrap();
    let (kp, _) = nftproxy::config::kubeproxy::KubeProxyConfiguration::parse(text).unwrap();
    assert_eq!((kp.cluster_cidrs(), kp.masquerade_bit()), (vec!["10.9.0.0/16".to_string()], 14));

    // Scraping: a headless Service over the metrics port, and the ServiceMonitor selecting it.
    let svc: Service = typed(&rendered["Service/kube-system/nftproxy-metrics"]);
    let spec = svc.spec.unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
    let monitor = &rendered["ServiceMonitor/kube-system/nftproxy"];
    assert_eq!(monitor["metadata"]["labels"]["release"], "prom");
    for (k, v) in monitor["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(svc.metadata.labels.as_ref().unwrap().get(k).map(String::as_str), v.as_str(), "{k}");
    }
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], spec.ports.unwrap()[0].name.clone().unwrap());

    // The alerts: the rule file's, less the disabled one.
    let rules: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(chart().join("files/nftproxy.rules.yaml")).unwrap()).unwrap();
    let names = |groups: &Value| -> Vec<String> {
        groups
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap().iter().map(|r| r["alert"].as_str().unwrap().to_string()))
            .collect()
    };
    let mut expected = names(&rules["groups"]);
    assert!(expected.len() >= 6, "{expected:?}");
    expected.retain(|n| n != "NftproxyNetworkProgrammingSlow");
    let rule = &rendered["PrometheusRule/kube-system/nftproxy"];
    assert_eq!(names(&rule["spec"]["groups"]), expected);
    // With nothing disabled, the PrometheusRule's spec is the rule file, rule for rule.
    let all = objects(&template("prometheusRule: {enabled: true}").unwrap());
    assert_eq!(all["PrometheusRule/kube-system/nftproxy"]["spec"], rules);
}

#[test]
fn a_service_monitor_on_a_loopback_address_is_refused() {
    let err = template("serviceMonitor: {enabled: true}").unwrap_err();
    assert!(err.contains("metrics.bindAddress is a loopback address"), "{err}");
    // Without it, the metrics port is not declared and nothing selects it.
    let objects = objects(&template("{}").unwrap());
    assert!(!objects.keys().any(|k| k.starts_with("Service/") || k.starts_with("ServiceMonitor/")));
}
