//! nftproxy beside upstream kube-proxy v1.37 (nftables mode), on the same lab, the same real
//! API server, the same configuration file and the same probes. Each proxy in turn runs in node1
//! (the previous one stopped, its rules removed with its own cleanup, conntrack flushed); the
//! probes' outcomes, the health endpoints' bodies (also with the API server down), what each does
//! when its Node is deleted, and the metric families are compared, and any
//! difference not listed in [`DELIBERATE`] (docs/differences.md) fails the test.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::common::*;
use nftproxy::net::L4Proto;
use nftproxy_tools::controlplane::ControlPlane;
// Differences from upstream that nftproxy makes on purpose, by check name, each a row of
// docs/differences.md: one list, shared with the randomised clusters (integration/random.rs).
// Any other difference fails the test, and so does a listed one of this test's checks that no
// longer shows (the list must stay true).
use nftproxy_tools::differences::DELIBERATE;

/// Which proxy runs in node1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Proxy {
    Nftproxy,
    KubeProxy,
}

/// What a proxy did with one probe.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// Answered: by which pods, and the source address they saw (by role).
    Answered { backends: BTreeSet<String>, sources: BTreeSet<String> },
    /// Every answer from one pod (session affinity), whichever it was.
    Sticky { sources: BTreeSet<String> },
    /// Refused at once (a reject).
    Refused,
    /// No answer (dropped).
    Dropped,
    /// Anything else.
    Other(String),
}

struct Probe {
    name: &'static str,
    who: &'static str,
    proto: L4Proto,
    target: String,
    sticky: bool,
    /// How many connections to try (a dropped probe waits 2 s each).
    asks: usize,
}

const SERVICES: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec:\n  clusterIP: 10.96.0.10\n  selector: {app: web}\n  ports:\n  - {name: http, port: 80, targetPort: 8080, protocol: TCP}\n  - {name: dns, port: 53, targetPort: 8080, protocol: UDP}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: np, namespace: default}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.15\n  selector: {app: web}\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30090, protocol: TCP}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: default}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.20\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32100\n  externalIPs: [203.0.113.7]\n  selector: {app: web}\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: sticky, namespace: default}\nspec:\n  clusterIP: 10.96.0.30\n  sessionAffinity: ClientIP\n  selector: {app: web}\n  ports:\n  - {name: http, port: 80, targetPort: 8080, protocol: TCP}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: empty, namespace: default}\nspec:\n  clusterIP: 10.96.0.40\n  selector: {app: nothing}\n  ports:\n  - {name: http, port: 80, targetPort: 8080, protocol: TCP}\n";

/// The configuration both proxies start with, kubeadm-style. Conntrack sysctls are left alone:
/// in a network namespace the global ones are not theirs to change.
fn config(kubeconfig: &std::path::Path) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nclientConnection: {{kubeconfig: {}}}\nhostnameOverride: node1\nclusterCIDR: {}\nhealthzBindAddress: 0.0.0.0:10256\nmetricsBindAddress: 127.0.0.1:10249\nconntrack: {{maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}\n",
        kubeconfig.display(),
        nftproxy_tools::lab::topology::CLUSTER_CIDR_V4
    )
}

/// A name for an address the pods see: a lab host's role.
fn role(lab: &ClusterLab, ip: IpAddr) -> String {
    for n in &lab.lab.nodes {
        if ip == IpAddr::V4(n.ip) || ip == IpAddr::V4(n.gateway) {
            return n.name.clone();
        }
    }
    for c in &lab.lab.clients {
        if ip == IpAddr::V4(c.ip) {
            return c.name.clone();
        }
    }
    for p in &lab.lab.pods {
        if ip == IpAddr::V4(p.ip) {
            return p.name.clone();
        }
    }
    ip.to_string()
}

fn outcome(lab: &ClusterLab, probe: &Probe) -> Outcome {
    let t = lab.tally(probe.who, probe.proto, &probe.target, probe.asks);
    let sources: BTreeSet<String> = t.sources.keys().map(|ip| role(lab, *ip)).collect();
    if t.answered() == 0 {
        let errors: Vec<&String> = t.errors.keys().collect();
        return match errors.as_slice() {
            [e] if e.contains("refused") || e.contains("unreachable") => Outcome::Refused,
            [e] if e.contains("timed out") || e.contains("WouldBlock") || e.contains("temporarily") => Outcome::Dropped,
            _ => Outcome::Other(format!("{:?}", t.errors)),
        };
    }
    if !t.errors.is_empty() {
        return Outcome::Other(format!("answered {:?} and failed {:?}", t.by_backend, t.errors));
    }
    if probe.sticky {
        return match t.by_backend.len() {
            1 => Outcome::Sticky { sources },
            _ => Outcome::Other(format!("not sticky: {:?}", t.by_backend)),
        };
    }
    Outcome::Answered { backends: t.by_backend.keys().cloned().collect(), sources }
}

/// What one proxy showed: each probe's outcome, and each other check's value.
type Observed = BTreeMap<String, String>;

/// The status code and a body's JSON, flattened as `a.b=value`: every key, and every value but
/// the times (which differ between any two runs).
fn shape(code: u16, body: &str) -> String {
    fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeSet<String>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, child) in map {
                    let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    out.insert(path.clone());
                    flatten(&path, child, out);
                }
            }
            leaf if !(prefix.ends_with("lastUpdated") || prefix.ends_with("currentTime")) => {
                out.insert(format!("{prefix}={leaf}"));
            }
            _ => {}
        }
    }
    let mut out = BTreeSet::new();
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
        flatten("", &v, &mut out);
    }
    format!("{code} {out:?}")
}

/// `kubeproxy_*` families of a /metrics text with their label names.
fn families(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap_or("");
            if name.starts_with("kubeproxy_") {
                out.entry(name.to_string()).or_default();
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or("");
        let family = out.keys().filter(|f| name.starts_with(f.as_str())).max_by_key(|f| f.len()).cloned();
        if let (Some(family), Some(labels)) = (family, line.split_once('{').and_then(|(_, l)| l.split_once('}'))) {
            for pair in labels.0.split(',') {
                if let Some((k, _)) = pair.split_once('=')
                    && k != "le"
                {
                    out.entry(family.clone()).or_default().insert(k.to_string());
                }
            }
        }
    }
    out
}

fn observe(lab: &ClusterLab, probes: &[Probe]) -> Observed {
    let mut seen = Observed::new();
    for p in probes {
        seen.insert(format!("probe {}", p.name), format!("{:?}", outcome(lab, p)));
    }
    let node1 = lab.lab.node("node1").ip;
    let (code, body) = lab.http_get("client", &format!("{node1}:32100"), "/").unwrap_or((0, String::new()));
    seen.insert("health check node port".into(), shape(code, &body));
    for path in ["/healthz", "/livez"] {
        let (code, body) = lab.http_get("node1", "127.0.0.1:10256", path).unwrap_or((0, String::new()));
        seen.insert(format!("healthz port {path}"), shape(code, &body));
    }
    let (_, metrics) = lab.http_get("node1", "127.0.0.1:10249", "/metrics").unwrap_or((0, String::new()));
    for (family, labels) in families(&metrics) {
        seen.insert(format!("metric {family}"), format!("{labels:?}"));
    }
    seen
}

#[test]
fn nftproxy_and_kube_proxy_give_the_same_answers() {
    if skip_unless_privileged() {
        return;
    }
    let _one = crate::control_plane::ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut lab = ClusterLab::new();
    let cp =
        ControlPlane::start_in(&mut lab.lab, nftproxy_tools::lab::topology::SERVICE_CIDR_V4).expect("control plane");
    let lab = &lab;
    for (name, zone) in [("node1", "zone-a"), ("node2", "zone-b")] {
        cp.add_node(name, lab.lab.node(name).ip, zone).unwrap();
    }
    for (pod, node) in [("web-1", "node1"), ("web-2", "node1"), ("web-3", "node2")] {
        let Some(IpAddr::V4(pod_ip)) = lab.lab.pod_ip(pod, false) else { panic!("{pod}") };
        cp.add_pod(pod, node, pod_ip, "app: web", true).unwrap();
    }
    cp.apply(SERVICES).unwrap();
    cp.patch_status(
        "service",
        Some("default"),
        "lb",
        &serde_json::json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}}),
    )
    .unwrap();
    cp.apply(crate::control_plane::KUBE_PROXY_SA).unwrap();
    let token = cp.token("kube-system", "kube-proxy").unwrap();
    let kubeconfig = lab.write("kube-proxy.kubeconfig", &cp.kubeconfig(&token));
    let config_file = lab.write("config.conf", &config(&kubeconfig));

    let node1_ip = lab.lab.node("node1").ip;
    let probe = |name, who, proto, target: String| Probe { name, who, proto, target, sticky: false, asks: 24 };
    let probes = vec![
        probe("ClusterIP TCP from a client", "client", L4Proto::Tcp, "10.96.0.10:80".into()),
        probe("ClusterIP UDP from a client", "client", L4Proto::Udp, "10.96.0.10:53".into()),
        probe("ClusterIP TCP from a pod", "web-1", L4Proto::Tcp, "10.96.0.10:80".into()),
        probe("ClusterIP TCP from the node", "node1", L4Proto::Tcp, "10.96.0.10:80".into()),
        probe("ClusterIP, a port it does not serve", "client", L4Proto::Tcp, "10.96.0.10:81".into()),
        probe("NodePort, cluster policy", "client", L4Proto::Tcp, format!("{node1_ip}:30090")),
        probe("NodePort, local policy", "client", L4Proto::Tcp, format!("{node1_ip}:30080")),
        probe("LoadBalancer IP, local policy", "client", L4Proto::Tcp, "203.0.113.10:80".into()),
        probe("ExternalIP, local policy", "client", L4Proto::Tcp, "203.0.113.7:80".into()),
        probe("a Service without endpoints", "client", L4Proto::Tcp, "10.96.0.40:80".into()),
        Probe { asks: 3, ..probe("an unallocated ClusterIP", "web-1", L4Proto::Tcp, "10.96.0.99:80".into()) },
        Probe { sticky: true, ..probe("session affinity", "client", L4Proto::Tcp, "10.96.0.30:80".into()) },
    ];

    let node1 = &lab.lab.node("node1").ns;
    let kube_proxy_bin = cp.bins.path("kube-proxy");
    let mut seen: BTreeMap<Proxy, Observed> = BTreeMap::new();
    for proxy in [Proxy::Nftproxy, Proxy::KubeProxy] {
        let log = lab.dir.path().join(format!("{proxy:?}.log"));
        let program = match proxy {
            Proxy::Nftproxy => std::path::PathBuf::from(env!("CARGO_BIN_EXE_nftproxy")),
            Proxy::KubeProxy => kube_proxy_bin.clone(),
        };
        let mut command = node1.command(program.to_str().unwrap());
        if proxy == Proxy::Nftproxy {
            command.arg("run");
        }
        let child = command
            .arg(format!("--config={}", config_file.display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut running = crate::control_plane::Guarded(Some(child));
        let text = || std::fs::read_to_string(&log).unwrap_or_default();
        let started = Instant::now();
        assert!(
            lab.eventually(Duration::from_secs(60), || {
                lab.http_get("node1", "127.0.0.1:10256", "/healthz").is_ok_and(|(c, b)| c == 200 && b.contains("IPv4"))
                    && lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 3).answered() == 3
            }),
            "{proxy:?} did not start:\n{}",
            text()
        );
        eprintln!("{proxy:?}: serving {:.1} s after its start", started.elapsed().as_secs_f64());
        let mut observed = observe(lab, &probes);
        // The API server down: the health endpoints as each proxy answers then.
        cp.kill_apiserver();
        std::thread::sleep(Duration::from_secs(2));
        for path in ["/healthz", "/livez"] {
            let (code, body) = lab.http_get("node1", "127.0.0.1:10256", path).unwrap_or((0, String::new()));
            observed.insert(format!("API server down: {path}"), shape(code, &body));
        }
        cp.start_apiserver().unwrap_or_else(|e| panic!("{e}"));
        // The Node deleted: what the proxy does (upstream exits 1 so that it is restarted). The
        // watches are still reconnecting after the restart (with backoff), so the exit may take
        // a while on a loaded machine: the outcome is compared, not its timing.
        cp.kubectl_ok(&["delete", "node", "node1", "--wait=false"]).unwrap();
        let exited = (0..1200).find_map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            running.0.as_mut().and_then(|c| c.try_wait().ok().flatten())
        });
        observed.insert("Node deleted: exit status".into(), format!("{:?}", exited.map(|s| s.code())));
        cp.add_node("node1", lab.lab.node("node1").ip, "zone-a").unwrap();
        // Without its Node, the EndpointSlice controller left node1's pods out of the slices:
        // the next proxy starts once they are back.
        let web_endpoints = || {
            cp.kubectl_ok(&[
                "get",
                "endpointslices",
                "-l",
                "kubernetes.io/service-name=web",
                "-o",
                "jsonpath={.items[*].endpoints[*].addresses[0]}",
            ])
            .map(|out| out.split_whitespace().count())
            .unwrap_or(0)
        };
        assert!(
            lab.eventually(Duration::from_secs(60), || web_endpoints() == 3),
            "node1's pods are back in the slices"
        );
        seen.insert(proxy, observed);
        let syncs: Vec<String> =
            text().lines().filter(|l| l.contains("synced") || l.contains("Sync")).map(str::to_string).collect();
        eprintln!("{proxy:?} syncs:\n{}", syncs.join("\n"));
        running.stop();
        // Clean switch: the proxy's own cleanup, then conntrack flushed.
        let cleanup = match proxy {
            Proxy::Nftproxy => node1.command(env!("CARGO_BIN_EXE_nftproxy")).arg("cleanup").output().unwrap(),
            Proxy::KubeProxy => node1.command(kube_proxy_bin.to_str().unwrap()).arg("--cleanup").output().unwrap(),
        };
        assert!(cleanup.status.success(), "{proxy:?} cleanup: {}", String::from_utf8_lossy(&cleanup.stderr));
        let _ = node1.command("conntrack").arg("-F").output();
    }

    // Compare.
    let ours = &seen[&Proxy::Nftproxy];
    let theirs = &seen[&Proxy::KubeProxy];
    let mut differences: Vec<String> = Vec::new();
    let keys: BTreeSet<&String> = ours.keys().chain(theirs.keys()).collect();
    for key in keys {
        match (ours.get(key), theirs.get(key)) {
            (Some(a), Some(b)) if a == b => {}
            (a, b) => differences.push(format!("{key}:\n    nftproxy:   {a:?}\n    kube-proxy: {b:?}")),
        }
    }
    let mut report = String::new();
    for (key, value) in theirs {
        report.push_str(&format!("{key}: {value}\n"));
    }
    eprintln!("kube-proxy v1.37.2 (nftables mode) observed:\n{report}");
    let unlisted: Vec<&String> =
        differences.iter().filter(|d| !DELIBERATE.iter().any(|k| d.starts_with(&format!("{k}:")))).collect();
    assert!(
        unlisted.is_empty(),
        "{} difference(s) from upstream that docs/differences.md does not list:\n{}",
        unlisted.len(),
        unlisted.iter().map(|d| d.as_str()).collect::<Vec<_>>().join("\n")
    );
    for listed in DELIBERATE.iter().filter(|l| !l.starts_with("random ")) {
        assert!(
            differences.iter().any(|d| d.starts_with(&format!("{listed}:"))),
            "{listed}: listed as a deliberate difference but nftproxy and kube-proxy agree: remove it"
        );
    }
}
