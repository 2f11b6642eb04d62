//! The image swap, installer by installer: nftproxy started exactly as each installer starts
//! kube-proxy (its command line from `fixtures/installers/<name>/args.txt`, its files at the
//! paths it mounts them, the binary at `/usr/local/bin/kube-proxy`), in node1 of the lab,
//! against the test API server. Each must run, serve `/healthz`, `/livez` and `/metrics` where
//! kube-proxy would (`expect.yaml`), program a Service, apply a change within a second, and sit
//! idle below 1% of a core.
//!
//! The process gets a private mount namespace (tmpfs over the installer's directories) and UTS
//! namespace (hostname `node1`, for installers that pass no `--hostname-override`), so nothing
//! is written outside the test's own directories. What differs from a real node is what names
//! the cluster: the API server's address (in the kubeconfig and kops' `--master`) and the node's
//! name.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::apiserver::{FakeApi, objects};
use crate::common::*;
use nftproxy::net::L4Proto;
use nftproxy_tools::controlplane::ControlPlane;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/integration/fixtures/installers");

/// Where an installer puts things, beyond its command line.
struct Installer {
    name: &'static str,
    /// Fixture files copied to their place in the node: (file in the fixture, path).
    files: &'static [(&'static str, &'static str)],
    /// Where the kubeconfig goes, and whether it is the installer's own (service account token
    /// file, as kubeadm's and kind's ConfigMap) or the cluster's (anything: the lab's is used).
    kubeconfig: (&'static str, Kubeconfig),
    /// The node's name in the fixture, replaced by the lab's.
    node_name: &'static str,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kubeconfig {
    /// The fixture's kubeconfig, pointed at the lab (token from its `tokenFile`).
    Installers(&'static str),
    /// The lab's kubeconfig at the installer's path.
    Lab,
}

const TOKEN_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
/// Where a pod finds its cluster's CA (kubeadm's kubeconfig names it).
const CA_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";

/// The API server the proxy talks to: its URL, the CA that signs its certificate (none for the
/// test API server's plain HTTP), a bearer token, and the lab's kubeconfig for it.
struct ApiTarget {
    url: String,
    ca: Option<PathBuf>,
    token: String,
    kubeconfig: String,
}

impl ApiTarget {
    fn fake(api: &FakeApi) -> ApiTarget {
        let kubeconfig = api.kubeconfig();
        let url = kubeconfig.split("server: \"").nth(1).and_then(|s| s.split('"').next()).unwrap().to_string();
        ApiTarget { url, ca: None, token: "test".into(), kubeconfig }
    }

    fn real(cp: &ControlPlane, token: String) -> ApiTarget {
        ApiTarget { url: cp.url(), ca: Some(cp.ca_file()), kubeconfig: cp.kubeconfig(&token), token }
    }
}

const INSTALLERS: &[Installer] = &[
    Installer {
        name: "kubeadm",
        files: &[("config.conf", "/var/lib/kube-proxy/config.conf")],
        kubeconfig: ("/var/lib/kube-proxy/kubeconfig.conf", Kubeconfig::Installers("kubeconfig.conf")),
        node_name: "$(NODE_NAME)",
    },
    Installer {
        name: "kind",
        files: &[("config.conf", "/var/lib/kube-proxy/config.conf")],
        kubeconfig: ("/var/lib/kube-proxy/kubeconfig.conf", Kubeconfig::Installers("kubeconfig.conf")),
        node_name: "$(NODE_NAME)",
    },
    Installer {
        name: "kind-nftables",
        files: &[("config.conf", "/var/lib/kube-proxy/config.conf")],
        kubeconfig: ("/var/lib/kube-proxy/kubeconfig.conf", Kubeconfig::Installers("kubeconfig.conf")),
        node_name: "$(NODE_NAME)",
    },
    Installer {
        name: "kops",
        files: &[],
        kubeconfig: ("/var/lib/kube-proxy/kubeconfig", Kubeconfig::Lab),
        node_name: "",
    },
    Installer {
        name: "k3s",
        files: &[],
        kubeconfig: ("/var/lib/rancher/k3s/agent/kubeproxy.kubeconfig", Kubeconfig::Lab),
        node_name: "worker-1",
    },
    Installer {
        name: "rke2",
        files: &[],
        kubeconfig: ("/var/lib/rancher/rke2/agent/kubeproxy.kubeconfig", Kubeconfig::Lab),
        node_name: "worker-1",
    },
    Installer {
        name: "talos",
        files: &[("config.conf", "/var/lib/kube-proxy/config.conf")],
        kubeconfig: ("/etc/kubernetes/kubeconfig", Kubeconfig::Lab),
        node_name: "$(NODE_NAME)",
    },
    Installer {
        name: "talos-legacy-flags",
        files: &[],
        kubeconfig: ("/etc/kubernetes/kubeconfig", Kubeconfig::Lab),
        node_name: "$(NODE_NAME)",
    },
];

/// The installer's arguments (one a line, `#` comments skipped).
fn args_of(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("args.txt"))
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

/// A top-level `key: value` of `expect.yaml`.
fn expected(dir: &Path, key: &str) -> String {
    let text = std::fs::read_to_string(dir.join("expect.yaml")).unwrap();
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    match &doc[key] {
        serde_yaml_ng::Value::String(s) => s.clone(),
        serde_yaml_ng::Value::Null => String::new(),
        other => serde_yaml_ng::to_string(other).unwrap().trim().to_string(),
    }
}

/// A nested `key: value` of `expect.yaml`, as text.
fn expected_in(dir: &Path, path: &[&str]) -> String {
    let text = std::fs::read_to_string(dir.join("expect.yaml")).unwrap();
    let mut v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    for key in path {
        v = v[*key].clone();
    }
    match v {
        serde_yaml_ng::Value::String(s) => s,
        other => serde_yaml_ng::to_string(&other).unwrap().trim().to_string(),
    }
}

/// A process started by the test, killed on drop.
struct Started(std::process::Child);

impl Drop for Started {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// CPU time the process has used (user + system), from `/proc/<pid>/stat`.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the file; index 11 and 12 after the name.
    let ticks: u64 = [11, 12].iter().filter_map(|&i| fields.get(i)?.parse::<u64>().ok()).sum();
    Duration::from_millis(ticks * 10)
}

/// The address to ask for a server bound to `bound` (a wildcard is asked on loopback).
fn reachable(bound: &str) -> String {
    bound.replace("0.0.0.0", "127.0.0.1").replace("[::]", "[::1]")
}

/// Writes the start script: a private mount namespace with the installer's files in place,
/// the binary as `/usr/local/bin/kube-proxy`, then the installer's command line.
fn start_script(lab: &ClusterLab, installer: &Installer, api: &ApiTarget, args: &[String]) -> PathBuf {
    let dir = Path::new(FIXTURES).join(installer.name);
    let stage = lab.dir.path().join("stage");
    let mut lines = vec![
        "set -eu".to_string(),
        "mount --make-rprivate /".to_string(),
        // conntrack's hashsize is global: hidden, so the test cannot change the host's.
        "mount -t tmpfs -o ro tmpfs /sys/module/nf_conntrack/parameters 2>/dev/null || true".to_string(),
        "hostname node1".to_string(),
        "mount -t tmpfs tmpfs /usr/local/bin".to_string(),
        format!("ln -s {} /usr/local/bin/kube-proxy", env!("CARGO_BIN_EXE_nftproxy")),
    ];
    let mut placed: Vec<(PathBuf, String)> =
        installer.files.iter().map(|(file, to)| (dir.join(file), to.to_string())).collect();
    let kubeconfig_text = match installer.kubeconfig.1 {
        // With --master on the command line (kops), the kubeconfig's own server must not be
        // the one used: it names an address nothing answers on.
        Kubeconfig::Lab if args.iter().any(|a| a.starts_with("--master=")) => {
            api.kubeconfig.replace(&api.url, "https://192.0.2.1:6443")
        }
        Kubeconfig::Lab => api.kubeconfig.clone(),
        Kubeconfig::Installers(file) => {
            // The installer's own kubeconfig, as the pod has it: the ServiceAccount's token and
            // CA files where it names them; only the server is the lab's.
            let text = std::fs::read_to_string(dir.join(file)).unwrap();
            let token = stage.join("token");
            std::fs::create_dir_all(&stage).unwrap();
            std::fs::write(&token, &api.token).unwrap();
            placed.push((token, TOKEN_FILE.to_string()));
            if let Some(ca) = &api.ca {
                placed.push((ca.clone(), CA_FILE.to_string()));
            }
            text.lines()
                .filter(|l| api.ca.is_some() || !l.trim_start().starts_with("certificate-authority"))
                .map(|l| match l.split_once("server:") {
                    Some((indent, _)) => format!("{indent}server: {}", api.url),
                    None => l.to_string(),
                })
                .collect::<Vec<_>>()
                .join("\n")
        }
    };
    let staged = lab.write(&format!("{}-kubeconfig", installer.name), &kubeconfig_text);
    placed.push((staged, installer.kubeconfig.0.to_string()));
    // tmpfs over each top directory the files go under (/var/lib, /run, /etc/kubernetes via /etc).
    let mut tops: Vec<&str> = Vec::new();
    for (_, to) in &placed {
        let to = to.replace("/var/run/", "/run/");
        let top = ["/var/lib", "/run/secrets", "/etc"].into_iter().find(|t| to.starts_with(t)).unwrap();
        if !tops.contains(&top) {
            tops.push(top);
        }
    }
    for top in &tops {
        if *top == "/etc" {
            // Keep what name resolution and TLS need; the rest of /etc is the installer's.
            let kept = "hosts passwd group nsswitch.conf ssl";
            lines.push(format!(
                "mkdir -p \"$STAGE\"/etc && for f in {kept}; do cp -a /etc/$f \"$STAGE\"/etc/ 2>/dev/null || true; done"
            ));
            lines.push("mount -t tmpfs tmpfs /etc".into());
            lines.push("cp -a \"$STAGE\"/etc/. /etc/".into());
        } else {
            lines.push(format!("mkdir -p {top} && mount -t tmpfs tmpfs {top}"));
        }
    }
    for (from, to) in &placed {
        let to = to.replace("/var/run/", "/run/");
        lines.push(format!("mkdir -p \"$(dirname {to})\" && cp {} {to}", from.display()));
    }
    let quoted: Vec<String> = args.iter().map(|a| format!("'{}'", a.replace('\'', "'\\''"))).collect();
    lines.push(format!("exec /usr/local/bin/kube-proxy {}", quoted.join(" ")));
    std::fs::create_dir_all(&stage).unwrap();
    let script = lab.dir.path().join(format!("{}.sh", installer.name));
    std::fs::write(&script, format!("STAGE={}\n{}\n", stage.display(), lines.join("\n"))).unwrap();
    script
}

/// Where the installer's proxy gets its objects, and how a test changes them.
trait Cluster {
    /// Writes the `web` Service (10.96.0.10, web-1 and web-2 behind it).
    fn web(&self);
    /// Writes a new Service `api` (10.96.0.11).
    fn new_service(&self);
    /// Writes its endpoints (web-1), where the test writes them (the real API's controller
    /// writes them by itself).
    fn new_endpoints(&self);
    /// The Events written so far.
    fn events(&self) -> Vec<serde_json::Value>;
}

trait NewObjects {
    fn new_objects(&self, kind: &str);
}

impl NewObjects for FakeApi {
    /// The `api` Service's objects of one kind.
    fn new_objects(&self, kind: &str) {
        let yaml =
            services_yaml(&[Svc { name: "api", cluster_ip: "10.96.0.11", endpoints: &[WEB_1], ..Default::default() }]);
        for obj in objects(&yaml).into_iter().filter(|o| o["kind"] == kind) {
            self.apply(obj);
        }
    }
}

impl Cluster for FakeApi {
    fn web(&self) {
        for obj in objects(&services_yaml(&[Svc {
            name: "web",
            cluster_ip: "10.96.0.10",
            endpoints: &[WEB_1, WEB_2],
            ..Default::default()
        }])) {
            self.apply(obj);
        }
    }

    fn new_service(&self) {
        self.new_objects("Service");
    }

    fn new_endpoints(&self) {
        self.new_objects("EndpointSlice");
    }

    fn events(&self) -> Vec<serde_json::Value> {
        FakeApi::events(self)
    }
}

fn run_installer(installer: &Installer) {
    let lab = ClusterLab::new();
    let api = FakeApi::start(&lab.lab.node("node1").ns);
    api.web();
    let target = ApiTarget::fake(&api);
    run_installer_against(&lab, installer, &api, &target);
}

fn run_installer_against(lab: &ClusterLab, installer: &Installer, api: &dyn Cluster, target: &ApiTarget) {
    let dir = Path::new(FIXTURES).join(installer.name);
    let lab_url = target.url.clone();
    let args: Vec<String> = args_of(&dir)
        .into_iter()
        .map(|a| {
            let a = if installer.node_name.is_empty() { a } else { a.replace(installer.node_name, "node1") };
            // kops names its API server on the command line.
            if a.starts_with("--master=") { format!("--master={lab_url}") } else { a }
        })
        .collect();
    let script = start_script(lab, installer, target, &args);
    let log_path = lab.dir.path().join("proxy.log");
    let child = lab
        .lab
        .node("node1")
        .ns
        .command("unshare")
        .args(["--mount", "--uts", "--propagation", "private", "sh"])
        .arg(&script)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let proxy = Started(child);
    let pid = proxy.0.id();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let name = installer.name;

    let healthz = reachable(&expected(&dir, "healthz"));
    let metrics = reachable(&expected(&dir, "metrics"));
    assert!(
        lab.eventually(Duration::from_secs(20), || {
            // Synced: the table is there and the health state says so (per-family status).
            lab.http_get("node1", &healthz, "/healthz").is_ok_and(|(c, body)| c == 200 && body.contains("IPv4"))
                && lab.listing().contains("table ip nftproxy")
        }),
        "{name}: no first sync, or /healthz on {healthz} did not answer 200:\n{}",
        log()
    );
    let (code, body) = lab.http_get("node1", &healthz, "/livez").unwrap();
    assert_eq!(code, 200, "{name}: /livez {body}");
    let livez: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(livez["healthy"], true, "{name}: {body}");
    assert!(livez["status"]["IPv4"]["lastUpdated"].is_string(), "{name}: per-family status: {body}");
    let (code, text) = lab.http_get("node1", &metrics, "/metrics").unwrap();
    assert_eq!(code, 200, "{name}: /metrics on {metrics}");
    assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram"), "{name}: {text}");
    assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_total counter"), "{name}: text format");
    assert!(!text.contains("# EOF"), "{name}: the Prometheus text format, not OpenMetrics");
    let (code, configz) = lab.http_get("node1", &metrics, "/configz").unwrap();
    assert_eq!(code, 200, "{name}: /configz");
    let configz: serde_json::Value = serde_json::from_str(&configz).unwrap();
    // The effective configuration is what upstream's would be (expect.yaml, checked against
    // upstream's own `kube-proxy --write-config-to`), field by field.
    let z = &configz["kubeproxy.config.k8s.io"];
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let expect = |key: &str| expected(&dir, key);
    let hostname = expect("hostname").replace(installer.node_name, "node1");
    for (field, want) in [
        (&z["nftables"]["syncPeriod"], expect("syncPeriod")),
        (&z["nftables"]["minSyncPeriod"], expect("minSyncPeriod")),
        (&z["nftables"]["masqueradeBit"], expect("masqueradeBit")),
        (&z["nftables"]["masqueradeAll"], expect("masqueradeAll")),
        (&z["clusterCIDR"], expect("clusterCIDR")),
        (&z["oomScoreAdj"], expect("oomScoreAdj")),
        (&z["bindAddress"], expect("bindAddress")),
        (&z["healthzBindAddress"], expect("healthz")),
        (&z["metricsBindAddress"], expect("metrics")),
        (&z["conntrack"]["maxPerCore"], expected_in(&dir, &["conntrack", "maxPerCore"])),
        (&z["conntrack"]["min"], expected_in(&dir, &["conntrack", "min"])),
        (&z["conntrack"]["tcpEstablishedTimeout"], expected_in(&dir, &["conntrack", "tcpEstablishedTimeout"])),
        (&z["conntrack"]["tcpCloseWaitTimeout"], expected_in(&dir, &["conntrack", "tcpCloseWaitTimeout"])),
        (&z["conntrack"]["tcpBeLiberal"], expected_in(&dir, &["conntrack", "tcpBeLiberal"])),
    ] {
        assert_eq!(text(field), want, "{name}: /configz {z}");
    }
    if !installer.node_name.is_empty() {
        assert_eq!(text(&z["hostnameOverride"]), hostname, "{name}");
    }

    // The Service is programmed.
    let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 20);
    assert_eq!(backends(&t), set(&["web-1", "web-2"]), "{name}: {t:?}\n{}", log());
    assert!(
        lab.eventually(Duration::from_secs(5), || api.events().iter().any(|e| e["reason"] == "Starting")),
        "{name}: the Starting Event on the Node: {:?}",
        api.events()
    );

    // A change is applied within a second: a new Service is in the kernel within a second of
    // its write. Its endpoints come as a second event (written by the test for the stand-in,
    // by the EndpointSlice controller for the real API server) and may wait out the minimum
    // sync period (1 s) the first sync started, as upstream's runner makes them wait: they
    // answer within that plus 500 ms for the asking.
    // From a quiet proxy: its last sync at least 1.2 s ago, so the write is not held by the
    // minimum sync period. The log's timestamps tell when the last sync was.
    let last_sync_age = || {
        let log = log();
        let line = log.lines().rev().find(|l| l.contains(" synced "))?;
        let stamp = humantime::parse_rfc3339_weak(line.split_whitespace().next()?.trim_end_matches('Z')).ok()?;
        std::time::SystemTime::now().duration_since(stamp).ok()
    };
    let quiet_by = Instant::now() + Duration::from_secs(15);
    while last_sync_age().is_none_or(|age| age < Duration::from_millis(1200)) && Instant::now() < quiet_by {
        std::thread::sleep(Duration::from_millis(100));
    }
    let asked = Instant::now();
    api.new_service();
    assert!(
        lab.eventually(Duration::from_secs(5), || lab.listing().contains("10.96.0.11")),
        "{name}: the new Service was not programmed:\n{}",
        log()
    );
    let programmed = asked.elapsed();
    let endpoints_asked = Instant::now();
    api.new_endpoints();
    assert!(
        lab.eventually(Duration::from_secs(5), || lab
            .ask("client", L4Proto::Tcp, "10.96.0.11:80")
            .is_ok_and(|a| a.backend == "web-1")),
        "{name}: the new Service did not answer:\n{}",
        log()
    );
    let answered = endpoints_asked.elapsed();
    eprintln!(
        "{name}: a new Service in the kernel {:.0} ms after it was written, answering {:.0} ms after its endpoints",
        programmed.as_secs_f64() * 1000.0,
        answered.as_secs_f64() * 1000.0
    );
    assert!(programmed <= Duration::from_secs(1), "{name}: the Service took {programmed:?}\n{}", log());
    assert!(answered <= Duration::from_millis(1500), "{name}: its endpoints took {answered:?}");

    // Idle: below 1% of a core over 5 s.
    let before = cpu_time(pid);
    std::thread::sleep(Duration::from_secs(5));
    let used = cpu_time(pid) - before;
    eprintln!("{name}: {} ms of CPU in 5 s idle", used.as_millis());
    assert!(used <= Duration::from_millis(50), "{name}: {used:?} of CPU in 5 s idle (over 1% of a core)");
    let log = log();
    if std::env::var_os("NFTPROXY_SHOW_LOGS").is_some() {
        eprintln!("{log}");
    }
    assert!(!log.contains("ERROR"), "{name}: errors in the log:\n{log}");
    assert!(log.contains("nftproxy started with kube-proxy's command line"), "{name}:\n{log}");
}

#[test]
fn every_installer_starts_nftproxy_as_it_starts_kube_proxy() {
    if skip_unless_privileged() {
        return;
    }
    // Timed steps: not beside a control plane of the other tests on two cores.
    let _one = crate::control_plane::ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for installer in INSTALLERS {
        run_installer(installer);
    }
}

/// kubeadm's file as kube-proxy reads it: no servers disabled, no zero periods (the issue's
/// three failures), without root.
#[test]
fn kubeadms_files_parse_with_upstreams_defaults() {
    let dir = Path::new(FIXTURES).join("kubeadm");
    let text = std::fs::read_to_string(dir.join("config.conf")).unwrap();
    let (c, warnings) = nftproxy::config::kubeproxy::KubeProxyConfiguration::parse(&text).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(c.validate(), Ok(()));
    assert_eq!(c.healthz_bind_address, expected(&dir, "healthz"));
    assert_eq!(c.metrics_bind_address, expected(&dir, "metrics"));
    assert_eq!(c.sync_periods().0.to_string(), expected(&dir, "syncPeriod"));
    assert_eq!(c.sync_periods().1.to_string(), expected(&dir, "minSyncPeriod"));
    // The DaemonSet's command line is kube-proxy's, read as kube-proxy reads it.
    let mut argv = vec![std::ffi::OsString::from("/usr/local/bin/kube-proxy")];
    argv.extend(args_of(&dir).into_iter().map(Into::into));
    assert!(nftproxy::cli::kube_proxy::is_kube_proxy(&argv));
    let t = nftproxy::cli::kube_proxy::translate(&argv).unwrap();
    assert_eq!(t.action, nftproxy::cli::kube_proxy::Action::Run);
}

/// Every fixture's command line is accepted as kube-proxy v1.37 accepts it, and so is every
/// flag kube-proxy has (FLAGS.txt, read off upstream's binary).
#[test]
fn every_installers_command_line_and_every_kube_proxy_flag_is_accepted() {
    for installer in INSTALLERS {
        let mut argv = vec![std::ffi::OsString::from("kube-proxy")];
        argv.extend(args_of(&Path::new(FIXTURES).join(installer.name)).into_iter().map(Into::into));
        let t = nftproxy::cli::kube_proxy::translate(&argv).unwrap_or_else(|e| panic!("{}: {e}", installer.name));
        assert_eq!(t.action, nftproxy::cli::kube_proxy::Action::Run, "{}", installer.name);
    }
    let flags = std::fs::read_to_string(Path::new(FIXTURES).join("FLAGS.txt")).unwrap();
    let mut seen = 0;
    for line in flags.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let mut cols = line.split('\t');
        let (name, kind) = (cols.next().unwrap().trim(), cols.next().unwrap_or("").trim());
        if name == "help" || name == "version" {
            continue;
        }
        let arg = if kind == "bool" { format!("--{name}") } else { format!("--{name}=1") };
        let result = nftproxy::cli::kube_proxy::translate(&["kube-proxy".into(), arg.clone().into()]);
        // A value of "1" may be the wrong type for the flag; it must not be unknown.
        assert!(!matches!(result, Err(nftproxy::cli::kube_proxy::FlagError::Unknown(_))), "{arg}: {result:?}");
        seen += 1;
    }
    assert!(seen >= 50, "FLAGS.txt lists kube-proxy's flags ({seen})");
}

/// The real control plane (integration/control_plane.rs): Services through kubectl, slices by
/// the EndpointSlice controller from Pods written as kubelets write them.
struct Real<'a> {
    cp: &'a ControlPlane,
}

const REAL_WEB: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  selector: {app: web}
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
"#;
const REAL_API: &str = r#"apiVersion: v1
kind: Service
metadata: {name: api, namespace: default}
spec:
  clusterIP: 10.96.0.11
  selector: {api: "yes"}
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
"#;

impl Cluster for Real<'_> {
    fn web(&self) {
        self.cp.apply(REAL_WEB).unwrap_or_else(|e| panic!("{e}"));
    }

    fn new_service(&self) {
        self.cp.apply(REAL_API).unwrap_or_else(|e| panic!("{e}"));
    }

    fn new_endpoints(&self) {}

    fn events(&self) -> Vec<serde_json::Value> {
        let text = self.cp.kubectl_ok(&["get", "events.events.k8s.io", "-A", "-o", "json"]).unwrap_or_default();
        serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["items"].as_array().cloned())
            .unwrap_or_default()
    }
}

/// The whole migration of a kubeadm cluster, against the real API server: kubeadm's DaemonSet
/// command line and ConfigMap, kube-proxy's ServiceAccount bound to `system:node-proxier`, its
/// token and CA where a pod finds them; only the image is nftproxy's.
#[test]
fn kubeadms_daemonset_with_nftproxys_image_against_the_real_api_server() {
    if skip_unless_privileged() {
        return;
    }
    let _one = crate::control_plane::ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut lab = ClusterLab::new();
    let cp =
        ControlPlane::start_in(&mut lab.lab, nftproxy_tools::lab::topology::SERVICE_CIDR_V4).expect("control plane");
    cp.add_node("node1", lab.lab.node("node1").ip, "zone-a").unwrap();
    for (pod, labels) in [("web-1", "app: web, api: \"yes\""), ("web-2", "app: web")] {
        let Some(std::net::IpAddr::V4(pod_ip)) = lab.lab.pod_ip(pod, false) else { panic!("{pod}") };
        cp.add_pod(pod, "node1", pod_ip, labels, true).unwrap();
    }
    cp.apply(crate::control_plane::KUBE_PROXY_SA).unwrap();
    // The DaemonSet's command is the fixture's args.txt (checked against daemonset.yaml below).
    let daemonset = std::fs::read_to_string(Path::new(FIXTURES).join("kubeadm/daemonset.yaml")).unwrap();
    for arg in args_of(&Path::new(FIXTURES).join("kubeadm")) {
        assert!(daemonset.contains(&format!("- {arg}")), "{arg} is in kubeadm's DaemonSet");
    }
    assert!(daemonset.contains("- /usr/local/bin/kube-proxy"));
    assert!(daemonset.contains("serviceAccountName: kube-proxy"));
    let real = Real { cp: &cp };
    real.web();
    let target = ApiTarget::real(&cp, cp.token("kube-system", "kube-proxy").unwrap());
    let kubeadm = INSTALLERS.iter().find(|i| i.name == "kubeadm").unwrap();
    run_installer_against(&lab, kubeadm, &real, &target);
}
