//! Nothing kube-proxy accepts is ignored in silence. Every flag of the real kube-proxy v1.37.2
//! (its `--help`) and every field of its configuration file (what its `--write-config-to`
//! writes, every field with its default) is given a value other than its default, one at a
//! time, and read by nftproxy as the image swap reads it: it must change nftproxy's settings
//! (applied), or be named in a warning, or stop start-up — and stop it exactly when the real
//! kube-proxy refuses the same command line or file (`--write-config-to` makes kube-proxy check
//! everything and exit without touching the node). The feature gates, which nftproxy lists
//! itself (`core/src/config/kube_proxy_feature_gates.tsv`), are checked against the same binary.
//! No root needed; the upstream binaries come from `scripts/upstream-bins`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::{CommandFactory, FromArgMatches};
use nftproxy::cli::kube_proxy::{self, Action};
use nftproxy::cli::{Cli, Command as Sub};
use nftproxy::config::feature_gates::{self, Fixed};
use serde_json::Value;

fn kube_proxy_bin() -> PathBuf {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| nftproxy_tools::controlplane::UpstreamBins::locate().unwrap().path("kube-proxy")).clone()
}

/// Whether the real kube-proxy accepts these arguments: `--write-config-to` runs its whole
/// completion and validation, then writes the file and exits before anything touches the node.
fn upstream_accepts(args: &[String], dir: &Path) -> (bool, String) {
    let out = Command::new(kube_proxy_bin())
        .args(args)
        .arg(format!("--write-config-to={}", dir.join("upstream-out.yaml").display()))
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// What nftproxy makes of a kube-proxy command line: the action, and for `run` its settings
/// (with `/configz`'s echo left out: echoing a value is not applying it), the log format and
/// verbosity, and the warnings; or the error that stops it.
fn nftproxy_reads(args: &[String]) -> Result<(String, Vec<String>), String> {
    let mut argv: Vec<OsString> = vec!["kube-proxy".into()];
    argv.extend(args.iter().map(OsString::from));
    let t = kube_proxy::translate(&argv).map_err(|e| e.to_string())?;
    if t.action != Action::Run {
        return Ok((format!("{:?}", t.action), vec![]));
    }
    let matches = Cli::command().try_get_matches_from(&t.argv).map_err(|e| e.to_string())?;
    let mut cli = Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    let Sub::Run(run) = &mut cli.command else { return Err("not run".into()) };
    run.kube_proxy = t.extras.clone();
    let (mut settings, warnings) = run.settings(matches.subcommand_matches("run")).map_err(|e| e.to_string())?;
    settings.configz.clear();
    let seen = format!(
        "{settings:?} format {:?} verbosity {} -v {}",
        nftproxy::cli::logging_format(&cli),
        nftproxy::cli::config_verbosity(&cli),
        cli.verbose
    );
    Ok((seen, warnings))
}

/// A value other than the default for each of kube-proxy's flags (the test fails on a flag of
/// `--help` this table does not have).
const FLAG_VALUES: &[(&str, &str)] = &[
    ("bind-address", "10.0.0.1"),
    ("bind-address-hard-fail", "true"),
    ("cleanup", "true"),
    ("cluster-cidr", "10.1.0.0/16"),
    ("config", "CONFIG"),
    ("config-sync-period", "1m"),
    ("conntrack-max-per-core", "100"),
    ("conntrack-min", "100"),
    ("conntrack-tcp-be-liberal", "true"),
    ("conntrack-tcp-timeout-close-wait", "2h"),
    ("conntrack-tcp-timeout-established", "48h"),
    ("conntrack-udp-timeout", "30s"),
    ("conntrack-udp-timeout-stream", "2m"),
    ("detect-local-mode", "NodeCIDR"),
    ("feature-gates", "KubeProxyNFTablesLocalhostNodePorts=true"),
    ("healthz-bind-address", "127.0.0.1:10266"),
    ("help", "true"),
    ("hostname-override", "node2"),
    ("init-only", "true"),
    ("iptables-localhost-nodeports", "false"),
    ("iptables-masquerade-bit", "15"),
    ("iptables-min-sync-period", "2s"),
    ("iptables-sync-period", "1m"),
    ("ipvs-exclude-cidrs", "10.0.0.0/8"),
    ("ipvs-min-sync-period", "2s"),
    ("ipvs-scheduler", "rr"),
    ("ipvs-strict-arp", "true"),
    ("ipvs-sync-period", "1m"),
    ("ipvs-tcp-timeout", "1m"),
    ("ipvs-tcpfin-timeout", "1m"),
    ("ipvs-udp-timeout", "1m"),
    ("kube-api-burst", "20"),
    ("kube-api-content-type", "application/json"),
    ("kube-api-qps", "10"),
    ("kubeconfig", "/etc/kubernetes/proxy.conf"),
    ("log-flush-frequency", "10s"),
    ("log-json-info-buffer-size", "1Mi"),
    ("log-json-split-stream", "true"),
    ("log-text-info-buffer-size", "1Mi"),
    ("log-text-split-stream", "true"),
    ("logging-format", "json"),
    ("masquerade-all", "true"),
    ("master", "http://127.0.0.1:8080"),
    ("metrics-bind-address", "127.0.0.1:10259"),
    ("nodeport-addresses", "10.0.0.0/8"),
    ("oom-score-adj", "-500"),
    ("pod-bridge-interface", "cbr0"),
    ("pod-interface-name-prefix", "veth"),
    ("profiling", "true"),
    ("proxy-mode", "ipvs"),
    ("show-hidden-metrics-for-version", "1.36"),
    ("v", "4"),
    ("version", "true"),
    ("vmodule", "proxier=4"),
    ("write-config-to", "OUT"),
];

/// Flags whose sample is an action that ends the process: nftproxy must take it as its own
/// action; upstream is not run with them (`--cleanup` and `--init-only` would touch the node).
const ACTIONS: &[&str] = &["cleanup", "help", "init-only", "version", "write-config-to"];

/// The outcome of one value, as nftproxy read it against the baseline.
#[derive(Debug, PartialEq)]
enum Outcome {
    Applied,
    Warned,
    Refused(String),
    Silent,
}

fn outcome(base: &(String, Vec<String>), read: Result<(String, Vec<String>), String>, names: &[&str]) -> Outcome {
    match read {
        Err(e) => Outcome::Refused(e),
        Ok((seen, _)) if seen != base.0 => Outcome::Applied,
        Ok((_, warnings)) => {
            let new: Vec<&String> = warnings.iter().filter(|w| !base.1.contains(w)).collect();
            if new.iter().any(|w| names.iter().any(|n| w.contains(n))) { Outcome::Warned } else { Outcome::Silent }
        }
    }
}

#[test]
fn every_kube_proxy_flag_is_applied_warned_or_refused_as_upstream_refuses_it() {
    let help = Command::new(kube_proxy_bin()).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let flags: Vec<String> = help
        .lines()
        .filter_map(|l| {
            let l = l.trim_start().trim_start_matches("-h, ").trim_start_matches("-v, ");
            let name = l.strip_prefix("--")?.split_whitespace().next()?;
            Some(name.to_string())
        })
        .collect();
    assert!(flags.len() > 50, "{flags:?}");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.9.0.0/16\n",
    )
    .unwrap();
    let base_args = vec!["--hostname-override=node1".to_string()];
    let base = nftproxy_reads(&base_args).unwrap();
    assert!(upstream_accepts(&base_args, dir.path()).0);
    let mut wrong = Vec::new();
    for flag in &flags {
        let Some((_, value)) = FLAG_VALUES.iter().find(|(f, _)| f == flag) else {
            panic!("--{flag} (in kube-proxy --help) has no value in FLAG_VALUES");
        };
        let value = match *value {
            "CONFIG" => config.display().to_string(),
            "OUT" => dir.path().join("nftproxy-out.yaml").display().to_string(),
            v => v.to_string(),
        };
        let mut args = base_args.clone();
        // `--hostname-override` itself is the flag under test: given once.
        args.retain(|a| !(flag == "hostname-override" && a.starts_with("--hostname-override")));
        args.push(format!("--{flag}={value}"));
        let gate = value.split('=').next().unwrap_or("").to_string();
        let got = outcome(&base, nftproxy_reads(&args), &[&format!("--{flag}"), &gate]);
        if ACTIONS.contains(&flag.as_str()) {
            assert_eq!(got, Outcome::Applied, "--{flag}: an action");
            continue;
        }
        let (accepted, why) = upstream_accepts(&args, dir.path());
        match (&got, accepted) {
            (Outcome::Refused(e), true) => {
                wrong.push(format!("--{flag}={value}: nftproxy refuses ({e}), kube-proxy accepts"))
            }
            (Outcome::Refused(_), false) => {}
            (_, false) => wrong
                .push(format!("--{flag}={value}: kube-proxy refuses ({}), nftproxy takes it ({got:?})", why.trim())),
            (Outcome::Silent, true) => wrong.push(format!("--{flag}={value}: ignored without a word")),
            _ => {}
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Every leaf of a YAML document, by dotted path.
fn leaves(prefix: &str, v: &Value, out: &mut Vec<(String, Value)>) {
    match v {
        Value::Object(map) if !map.is_empty() => {
            for (k, child) in map {
                let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                leaves(&path, child, out);
            }
        }
        _ => out.push((prefix.to_string(), v.clone())),
    }
}

/// A value other than `default` for the field at `path`.
fn other_value(path: &str, default: &Value) -> Value {
    let named: &[(&str, &str)] = &[
        ("bindAddress", "10.0.0.1"),
        ("clusterCIDR", "10.1.0.0/16"),
        ("detectLocalMode", "NodeCIDR"),
        ("healthzBindAddress", "0.0.0.0:10266"),
        ("metricsBindAddress", "127.0.0.1:10259"),
        ("mode", "ipvs"),
        ("hostnameOverride", "node2"),
        ("clientConnection.kubeconfig", "/etc/kubernetes/proxy.conf"),
        ("clientConnection.acceptContentTypes", "application/json"),
        ("clientConnection.contentType", "application/json"),
        ("portRange", "30000-32767"),
        ("showHiddenMetricsForVersion", "1.36"),
        ("ipvs.scheduler", "rr"),
        ("detectLocal.bridgeInterface", "cbr0"),
        ("detectLocal.interfaceNamePrefix", "veth"),
        ("logging.format", "json"),
        ("logging.options.json.infoBufferSize", "1Mi"),
        ("logging.options.text.infoBufferSize", "1Mi"),
    ];
    if let Some((_, v)) = named.iter().find(|(p, _)| *p == path) {
        return Value::String(v.to_string());
    }
    match default {
        Value::Bool(b) => Value::Bool(!b),
        Value::Number(n) => Value::from(n.as_i64().map(|i| if i == 0 { 4 } else { i + 1 }).unwrap_or(6)),
        Value::Null => serde_json::json!(["10.0.0.0/8"]),
        Value::String(s) if nftproxy::config::duration::GoDuration::parse(s).is_some() => {
            Value::String(if s == "0s" { "1m0s".into() } else { "2h0m0s".into() })
        }
        Value::String(_) => Value::String("x".into()),
        other => panic!("{path}: no other value for {other}"),
    }
}

fn set(doc: &mut Value, path: &str, value: Value) {
    let mut at = doc;
    let parts: Vec<&str> = path.split('.').collect();
    for p in &parts[..parts.len() - 1] {
        at = at.as_object_mut().unwrap().entry(p.to_string()).or_insert_with(|| Value::Object(Default::default()));
    }
    at[parts[parts.len() - 1]] = value;
}

#[test]
fn every_config_field_is_applied_warned_or_refused_as_upstream_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full.yaml");
    let out = Command::new(kube_proxy_bin()).arg(format!("--write-config-to={}", full.display())).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let defaults: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&full).unwrap()).unwrap();
    let mut fields = Vec::new();
    leaves("", &defaults, &mut fields);
    fields.retain(|(p, _)| p != "apiVersion" && p != "kind");
    // Fields kube-proxy leaves out of its file when empty.
    fields.push(("featureGates.KubeProxyNFTablesLocalhostNodePorts".into(), Value::Bool(false)));
    fields.push(("detectLocal.clusterCIDRs".into(), Value::Null));
    assert!(fields.len() > 50, "{fields:?}");

    let read = |doc: &Value, name: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, serde_yaml_ng::to_string(doc).unwrap()).unwrap();
        let args = vec![format!("--config={}", path.display()), "--hostname-override=node1".to_string()];
        (nftproxy_reads(&args), upstream_accepts(&args, dir.path()))
    };
    let (base, accepted) = read(&defaults, "base.yaml");
    let base = base.unwrap();
    assert!(accepted.0, "{}", accepted.1);
    let mut wrong = Vec::new();
    for (path, default) in &fields {
        let mut doc = defaults.clone();
        let value = other_value(path, default);
        set(&mut doc, path, value.clone());
        let (got, (accepted, why)) = read(&doc, "field.yaml");
        let last = path.rsplit('.').next().unwrap_or(path);
        let got = outcome(&base, got, &[path.as_str(), last]);
        match (&got, accepted) {
            (Outcome::Refused(e), true) => {
                wrong.push(format!("{path}: {value}: nftproxy refuses ({e}), kube-proxy accepts"))
            }
            (Outcome::Refused(_), false) => {}
            (_, false) => {
                wrong.push(format!("{path}: {value}: kube-proxy refuses ({}), nftproxy takes it ({got:?})", why.trim()))
            }
            (Outcome::Silent, true) => wrong.push(format!("{path}: {value}: ignored without a word")),
            _ => {}
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_feature_gates_are_kube_proxys() {
    let help = Command::new(kube_proxy_bin()).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    // `Name=true|false (STAGE - default=VALUE)` lines of --feature-gates' help.
    let listed: BTreeMap<String, (String, bool)> = help
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().split_once("=true|false (")?;
            let (stage, default) = rest.trim_end_matches(')').split_once(" - default=")?;
            Some((name.to_string(), (stage.to_string(), default == "true")))
        })
        .collect();
    assert!(listed.len() > 100, "{}", listed.len());
    let known = feature_gates::known();
    for (name, (stage, default)) in &listed {
        let g = known.get(name).unwrap_or_else(|| panic!("{name} (kube-proxy --help) is not in the list"));
        assert_eq!((&g.stage, g.default), (stage, *default), "{name}");
    }
    // The gates --help does not list (GA and deprecated ones) and every gate upstream refuses
    // to change: asked of the binary itself.
    let dir = tempfile::tempdir().unwrap();
    for g in known.values().filter(|g| !listed.contains_key(&g.name) || g.fixed != Fixed::No) {
        let gate = |v: bool| vec![format!("--feature-gates={}={v}", g.name)];
        let (ok, why) = upstream_accepts(&gate(g.default), dir.path());
        assert!(ok, "{}={}: {why}", g.name, g.default);
        let (ok, why) = upstream_accepts(&gate(!g.default), dir.path());
        assert_eq!(!ok, g.fixed != Fixed::No, "{}={}: {why}", g.name, !g.default);
        if g.fixed == Fixed::Locked {
            let ours = feature_gates::review(&[(g.name.clone(), !g.default)].into()).unwrap_err().to_string();
            assert!(why.contains(&ours), "{}: upstream says {why}, nftproxy {ours}", g.name);
        }
    }
    let (ok, why) = upstream_accepts(&["--feature-gates=NoSuchGate=true".into()], dir.path());
    assert!(!ok && why.contains("unrecognized feature gate: NoSuchGate"), "{why}");
}

/// `kube-proxy --master=URL` without a kubeconfig talks to that server, as upstream's client
/// does (it used to fail with "no Kubernetes configuration" outside a cluster).
#[test]
fn master_without_a_kubeconfig_is_the_server() {
    use crate::common::*;
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let ns = &lab.lab.node("node1").ns;
    let api = crate::common::apiserver::FakeApi::start(ns);
    let web = Svc { name: "web", cluster_ip: "10.96.0.10", endpoints: &[WEB_1], ..Default::default() };
    for obj in crate::common::apiserver::objects(&services_yaml(&[web])) {
        api.apply(obj);
    }
    let log = std::fs::File::create(lab.dir.path().join("proxy.log")).unwrap();
    let child = ns
        .command(env!("CARGO_BIN_EXE_nftproxy"))
        .args([
            &format!("--master=http://{}", api.addr),
            "--hostname-override=node1",
            "--healthz-bind-address=127.0.0.1:10256",
            "--metrics-bind-address=127.0.0.1:10249",
            "--conntrack-max-per-core=0",
        ])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let _proxy = RunningProxy { child };
    let synced = lab.eventually(std::time::Duration::from_secs(20), || lab.listing().contains("10.96.0.10"));
    assert!(synced, "no sync through --master:\n{}", lab.proxy_log());
}
