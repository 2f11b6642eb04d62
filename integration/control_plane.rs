//! nftproxy against the real Kubernetes control plane: upstream's etcd, kube-apiserver and
//! kube-controller-manager v1.37 in a namespace of the lab (tools/src/controlplane.rs). Nodes
//! and Pods are created through the API and their status written as a kubelet would, so every
//! EndpointSlice nftproxy programs is the real EndpointSlice controller's. nftproxy runs in
//! node1 with exactly the DaemonSet's rights: a ServiceAccount token bound to deploy/rbac.yaml's
//! ClusterRole (and, in the image-swap case, kube-proxy's own `system:node-proxier`).
//!
//! One control plane serves the whole scenario (starting one takes 10-20 s on 2 cores); each
//! phase says what it proves.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use crate::common::*;
use nftproxy::net::L4Proto;
use nftproxy_tools::controlplane::ControlPlane;

/// One control plane at a time in this process: each is an etcd, an API server and a controller
/// manager, a lot for two cores beside the other tests.
pub(crate) static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A lab with node1 (web-1, web-2), node2 (web-3), a client, and the control plane on the wan.
struct RealCluster {
    lab: ClusterLab,
    cp: ControlPlane,
}

const WEB_PODS: [(&str, &str); 3] = [("web-1", "node1"), ("web-2", "node1"), ("web-3", "node2")];

impl RealCluster {
    fn start() -> RealCluster {
        let mut lab = ClusterLab::new();
        let cp = ControlPlane::start_in(&mut lab.lab, nftproxy_tools::lab::topology::SERVICE_CIDR_V4)
            .expect("control plane");
        for (name, zone) in [("node1", "zone-a"), ("node2", "zone-b")] {
            cp.add_node(name, lab.lab.node(name).ip, zone).expect("node");
        }
        for (pod, node) in WEB_PODS {
            cp.add_pod(pod, node, pod_ip(&lab, pod), "app: web", true).expect("pod");
        }
        RealCluster { lab, cp }
    }

    /// nftproxy's own DaemonSet rights (deploy/rbac.yaml, as `kubectl apply -k deploy/` makes
    /// them) and a kubeconfig file with its ServiceAccount's token.
    fn deploy_identity(&self) -> std::path::PathBuf {
        self.cp.apply(&deploy_rbac()).expect("rbac");
        self.kubeconfig_for("kube-system", "nftproxy")
    }

    /// A kubeconfig file for the ServiceAccount `namespace/name`.
    fn kubeconfig_for(&self, namespace: &str, name: &str) -> std::path::PathBuf {
        let token = self.cp.token(namespace, name).expect("token");
        self.lab.write(&format!("{name}.kubeconfig"), &self.cp.kubeconfig(&token))
    }

    fn service(&self, yaml: &str) {
        self.cp.apply(yaml).unwrap_or_else(|e| panic!("{e}\n{}", self.cp.logs()));
    }
}

/// deploy/rbac.yaml: nftproxy's ServiceAccount, ClusterRole and binding.
fn deploy_rbac() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac.yaml")).expect("deploy/rbac.yaml")
}

fn pod_ip(lab: &ClusterLab, pod: &str) -> Ipv4Addr {
    match lab.lab.pod_ip(pod, false) {
        Some(std::net::IpAddr::V4(ip)) => ip,
        other => panic!("{pod}: {other:?}"),
    }
}

const WEB: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  selector: {app: web}
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP}
  - {name: dns, port: 53, targetPort: 8080, protocol: UDP}
"#;

/// External traffic: a LoadBalancer with `externalTrafficPolicy: Local`, an ExternalIP, a
/// NodePort and its health-check node port, as the API server allocates and validates them.
const LB: &str = r#"apiVersion: v1
kind: Service
metadata: {name: lb, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.20
  externalTrafficPolicy: Local
  healthCheckNodePort: 32100
  externalIPs: [203.0.113.7]
  selector: {app: web}
  ports:
  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}
"#;

/// An EndpointSlice the API server accepts and nftproxy cannot use: it names no Service.
const ORPHAN: &str = r#"apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: orphan, namespace: default}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.1.10]}]
"#;

/// deploy/rbac.yaml's ClusterRole without its EndpointSlice rule.
const NARROW: &str = r#"apiVersion: v1
kind: ServiceAccount
metadata: {name: narrow, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: narrow}
rules:
- apiGroups: [""]
  resources: [services, nodes]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [servicecidrs]
  verbs: [get, list, watch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: narrow}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: narrow}
subjects: [{kind: ServiceAccount, name: narrow, namespace: kube-system}]
"#;

/// kube-proxy's identity as kubeadm makes it (system:node-proxier).
pub(crate) const KUBE_PROXY_SA: &str = nftproxy_tools::controlplane::KUBE_PROXY_IDENTITY;

/// `nftproxy check --kubeconfig K --output json` in node1: the permission findings' summaries.
fn missing_permissions(lab: &ClusterLab, kubeconfig: &std::path::Path) -> Vec<String> {
    let out = lab.nftproxy(&["check", "--kubeconfig", kubeconfig.to_str().unwrap(), "--output", "json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("check: {e}\n{}", String::from_utf8_lossy(&out.stderr)));
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "missing-permission")
        .map(|f| f["summary"].as_str().unwrap_or("").to_string())
        .collect()
}

/// The Events (events.k8s.io) in all namespaces, as the API returns them.
fn events(cp: &ControlPlane) -> Vec<serde_json::Value> {
    let text = cp.kubectl_ok(&["get", "events.events.k8s.io", "-A", "-o", "json"]).unwrap_or_default();
    serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["items"].as_array().cloned())
        .unwrap_or_default()
}

#[test]
fn nftproxy_through_the_real_api_server() {
    if skip_unless_privileged() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = RealCluster::start();
    let (lab, cp) = (&cluster.lab, &cluster.cp);

    let kubeconfig = cluster.deploy_identity();
    cluster.service(WEB);
    cluster.service(LB);
    cp.patch_status(
        "service",
        Some("default"),
        "lb",
        &serde_json::json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}}),
    )
    .expect("load balancer status");
    let proxy = lab.run_proxy_from(&["--kubeconfig", kubeconfig.to_str().unwrap()], &[]);
    let within = Duration::from_secs(10);
    let all = set(&["web-1", "web-2", "web-3"]);
    let tcp = |target: &str| backends(&lab.tally("client", L4Proto::Tcp, target, 30));

    // 1. The controller's slices: every ready pod answers, TCP and UDP.
    assert!(
        lab.eventually(within, || tcp("10.96.0.10:80") == all),
        "{}\n{}",
        lab.proxy_log(),
        cp.kubectl_ok(&["get", "endpointslices", "-o", "yaml"]).unwrap_or_default()
    );
    let udp = lab.tally("client", L4Proto::Udp, "10.96.0.10:53", 30);
    assert_eq!(backends(&udp), all, "{udp:?}");
    // The default `kubernetes` Service, allocated by the real API server, and its ServiceCIDR.
    let listing = lab.listing();
    assert!(listing.contains("10.96.0.1 "), "the kubernetes Service is programmed");

    // 2. External traffic with policy Local: node1's own pods only, on the NodePort, the
    //    LoadBalancer IP and the ExternalIP; the health-check node port counts them.
    let node1 = lab.lab.node("node1").ip;
    let local = set(&["web-1", "web-2"]);
    for target in [format!("{node1}:30080"), "203.0.113.10:80".into(), "203.0.113.7:80".into()] {
        assert!(lab.eventually(within, || tcp(&target) == local), "{target}: {:?}\n{}", tcp(&target), lab.proxy_log());
    }
    let (code, body) = lab.http_get("client", &format!("{node1}:32100"), "/").expect("health check node port");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"localEndpoints\": 2") || body.contains("\"localEndpoints\":2"), "{body}");

    // 3. Live changes, as kubelets report them.
    let ip = |pod: &str| pod_ip(lab, pod);
    // A pod turns unready: it leaves.
    cp.set_pod_ready("web-2", ip("web-2"), false).unwrap();
    assert!(lab.eventually(within, || tcp("10.96.0.10:80") == set(&["web-1", "web-3"])), "unready web-2 left");
    cp.set_pod_ready("web-2", ip("web-2"), true).unwrap();
    assert!(lab.eventually(within, || tcp("10.96.0.10:80") == all), "web-2 is back");
    // Rolling replacement: web-3 is deleted (terminating, still ready: the controller marks it
    // serving and terminating); while other pods are ready it gets no new connections.
    cp.kubectl_ok(&["delete", "pod", "web-3", "--wait=false"]).unwrap();
    assert!(lab.eventually(within, || tcp("10.96.0.10:80") == local), "terminating web-3 left");
    // With no ready pod left, serving terminating ones take the traffic, as upstream.
    cp.set_pod_ready("web-1", ip("web-1"), false).unwrap();
    cp.set_pod_ready("web-2", ip("web-2"), false).unwrap();
    assert!(
        lab.eventually(within, || tcp("10.96.0.10:80") == set(&["web-3"])),
        "only the serving terminating pod: {:?}\n{}",
        tcp("10.96.0.10:80"),
        cp.kubectl_ok(&["get", "endpointslices", "-o", "yaml"]).unwrap_or_default()
    );
    // The replacement arrives (scale back up): all three.
    cp.kubectl_ok(&["delete", "pod", "web-3", "--grace-period=0", "--force"]).unwrap();
    cp.add_pod("web-3", "node2", ip("web-3"), "app: web", true).unwrap();
    cp.set_pod_ready("web-1", ip("web-1"), true).unwrap();
    cp.set_pod_ready("web-2", ip("web-2"), true).unwrap();
    assert!(lab.eventually(within, || tcp("10.96.0.10:80") == all), "scaled back up");

    // 4. Events, read back through the API: Starting on the Node, and one for an object the
    //    API server accepts and nftproxy cannot program.
    cp.apply(ORPHAN).unwrap();
    assert!(
        lab.eventually(within, || {
            let events = events(cp);
            events.iter().any(|e| e["reason"] == "Starting" && e["regarding"]["name"] == "node1")
                && events.iter().any(|e| e["reason"] == "NotProgrammed" && e["regarding"]["name"] == "orphan")
        }),
        "{:#?}",
        events(cp)
    );

    // 5. Permissions. The DaemonSet's role lacks nothing; kube-proxy's system:node-proxier
    //    lacks nothing either (the image swap keeps kube-proxy's identity).
    assert_eq!(missing_permissions(lab, &kubeconfig), Vec::<String>::new());
    cp.apply(KUBE_PROXY_SA).unwrap();
    let kube_proxy = cluster.kubeconfig_for("kube-system", "kube-proxy");
    assert_eq!(missing_permissions(lab, &kube_proxy), Vec::<String>::new());
    // One rule taken away: check names it, and a proxy with that identity says which.
    cp.apply(NARROW).unwrap();
    let narrow = cluster.kubeconfig_for("kube-system", "narrow");
    let missing = missing_permissions(lab, &narrow);
    assert!(missing.iter().any(|m| m.ends_with("may not list endpointslices.discovery.k8s.io")), "{missing:?}");
    let narrow_log = lab.dir.path().join("narrow.log");
    let narrow_run = lab
        .lab
        .node("node2")
        .ns
        .command(env!("CARGO_BIN_EXE_nftproxy"))
        .args(["run", "--kubeconfig", narrow.to_str().unwrap(), "--hostname-override", "node2"])
        .args(["--healthz-bind-address=", "--metrics-bind-address=", "--conntrack-max-per-core=0"])
        .stderr(std::fs::File::create(&narrow_log).unwrap())
        .spawn()
        .unwrap();
    let narrow_pid = narrow_run.id();
    let mut narrow_run = scopeguard(narrow_run);
    let forbidden = "forbidden: nftproxy's identity may not list and watch endpointslices.discovery.k8s.io";
    assert!(
        lab.eventually(within, || std::fs::read_to_string(&narrow_log).unwrap_or_default().contains(forbidden)),
        "{}",
        std::fs::read_to_string(&narrow_log).unwrap_or_default()
    );
    assert!(narrow_pid > 0);
    narrow_run.stop();

    // 6. The API server dies: rules stay, traffic flows. It comes back with its history
    //    compacted, so the watches cannot resume (410 Gone) and list again; a Service created
    //    meanwhile is programmed.
    cp.kill_apiserver();
    assert_eq!(
        backends(&lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 30)),
        all,
        "rules stay while the API server is down"
    );
    cp.compact_etcd().expect("compaction");
    let restarted = Instant::now();
    cp.start_apiserver().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("the API server was ready again {:.1} s after it was started", restarted.elapsed().as_secs_f64());
    cp.apply(&WEB.replace("name: web,", "name: web2,").replace("10.96.0.10", "10.96.0.11")).unwrap();
    assert!(
        lab.eventually(Duration::from_secs(30), || tcp("10.96.0.11:80") == all),
        "caught up after the restart:\n{}",
        lab.proxy_log()
    );
    assert!(lab.proxy_log().contains("listed again"), "the watches relisted:\n{}", lab.proxy_log());

    // 7. The Node is deleted: /healthz stops being eligible and the process exits 1 so the
    //    DaemonSet restarts it.
    cp.kubectl_ok(&["delete", "node", "node1", "--wait=false"]).unwrap();
    let mut proxy = proxy;
    let status = wait_exit(&mut proxy.child, Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{}", lab.proxy_log());
    assert!(lab.proxy_log().contains("Node is being deleted"), "{}", lab.proxy_log());
    if std::env::var_os("NFTPROXY_SHOW_LOGS").is_some() {
        eprintln!("{}", lab.proxy_log());
    }
}

/// `n` selector Services named `bulk-<i>`, as one List for `kubectl apply`.
fn bulk_services(range: std::ops::Range<usize>) -> String {
    let items: Vec<String> = range
        .map(|i| {
            format!(
                r#"- apiVersion: v1
  kind: Service
  metadata: {{name: bulk-{i}, namespace: default}}
  spec:
    selector: {{app: web}}
    ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]
"#
            )
        })
        .collect();
    format!("apiVersion: v1\nkind: List\nitems:\n{}", items.concat())
}

/// The `bulk-<i>` Services the kernel holds (by the service name in nftproxy's comments).
fn bulk_in_kernel(lab: &ClusterLab) -> std::collections::BTreeSet<usize> {
    let listing = lab.listing();
    let mut found = std::collections::BTreeSet::new();
    for part in listing.split("default/bulk-").skip(1) {
        let digits: String = part.chars().take_while(char::is_ascii_digit).collect();
        if let Ok(i) = digits.parse() {
            found.insert(i);
        }
    }
    found
}

/// How a connection from `who` to `target` ends: `Ok` answered, `Err(true)` given up on (the
/// packets vanished), `Err(false)` refused or unreachable at once.
fn probe(lab: &ClusterLab, who: &str, target: &str) -> Result<(), bool> {
    let started = Instant::now();
    match lab.ask(who, L4Proto::Tcp, target) {
        Ok(_) => Ok(()),
        Err(_) => Err(started.elapsed() >= Duration::from_millis(1500)),
    }
}

#[test]
fn a_node_cut_off_service_cidrs_and_a_thousand_services() {
    if skip_unless_privileged() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = RealCluster::start();
    let (lab, cp) = (&cluster.lab, &cluster.cp);
    let kubeconfig = cluster.deploy_identity();
    cluster.service(WEB);
    let proxy = lab.run_proxy_from(&["--kubeconfig", kubeconfig.to_str().unwrap()], &[]);
    let within = Duration::from_secs(10);
    let all = set(&["web-1", "web-2", "web-3"]);
    let tcp = |target: &str| backends(&lab.tally("client", L4Proto::Tcp, target, 30));
    assert!(lab.eventually(within, || tcp("10.96.0.10:80") == all), "{}", lab.proxy_log());

    // 1. node1 cut off from the API server for 30 s: its rules stay and serve; a change made
    //    meanwhile arrives once the path is back.
    // Both ways: a route for one direction alone still lets the server push watch events in.
    let node1 = &lab.lab.node("node1").ns;
    let cp_ns = &lab.lab.client("control-plane").expect("control plane").ns;
    let route = format!("{}/32", cp.ip);
    let back_route = format!("{}/32", lab.lab.node("node1").ip);
    node1.ip(&["route", "add", "blackhole", &route]).expect("cut node1 off");
    cp_ns.ip(&["route", "add", "blackhole", &back_route]).expect("cut node1 off");
    let cut = Instant::now();
    cp.set_pod_ready("web-2", pod_ip(lab, "web-2"), false).unwrap();
    while cut.elapsed() < Duration::from_secs(30) {
        assert_eq!(tcp("10.96.0.10:80"), all, "cut off: the last rules serve ({:?} in)", cut.elapsed());
        std::thread::sleep(Duration::from_secs(5));
    }
    node1.ip(&["route", "del", "blackhole", &route]).expect("reconnect node1");
    cp_ns.ip(&["route", "del", "blackhole", &back_route]).expect("reconnect node1");
    let back = Instant::now();
    assert!(
        lab.eventually(Duration::from_secs(60), || tcp("10.96.0.10:80") == set(&["web-1", "web-3"])),
        "the change made while cut off arrives:\n{}",
        lab.proxy_log()
    );
    eprintln!("caught up {:.1} s after the API server was reachable again", back.elapsed().as_secs_f64());
    cp.set_pod_ready("web-2", pod_ip(lab, "web-2"), true).unwrap();
    assert!(lab.eventually(within, || tcp("10.96.0.10:80") == all), "{}", lab.proxy_log());

    // 1b. The API server's end of every connection node1 has vanishes without a reset (a load
    //     balancer failing over): those connections go silent, new ones pass. A change made
    //     meanwhile arrives once the silent watches are given up (75 s without a byte: the API
    //     server sends each watch a bookmark about once a minute; a new watch that gets a
    //     silenced pooled connection waits once more), not after a watch's whole timeout (295 s,
    //     from the last bookmark: at least 235 s after the silence).
    let peer = format!("{}:{}", cp.ip, nftproxy_tools::controlplane::API_PORT);
    let listed = node1.exec("ss", &["-Htn", "state", "established", "dst", &peer]).expect("ss");
    let ports: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|line| Some(line.split_whitespace().nth(2)?.rsplit_once(':')?.1.to_string()))
        .collect();
    assert!(!ports.is_empty(), "nftproxy's connections to the API server: {listed:?}");
    let ports = ports.join(", ");
    let vanish = lab.write(
        "vanish.nft",
        &format!(
            "table inet vanished-peer {{\n\
             chain out {{ type filter hook output priority 0; ip daddr {cp} tcp dport {api} tcp sport {{ {ports} }} drop; }}\n\
             chain in {{ type filter hook input priority 0; ip saddr {cp} tcp sport {api} tcp dport {{ {ports} }} drop; }}\n}}\n",
            cp = cp.ip,
            api = nftproxy_tools::controlplane::API_PORT,
        ),
    );
    node1.exec("nft", &["-f", vanish.to_str().unwrap()]).expect("silence node1's connections");
    let silenced = Instant::now();
    cp.set_pod_ready("web-2", pod_ip(lab, "web-2"), false).unwrap();
    let arrived = lab.eventually(Duration::from_secs(200), || tcp("10.96.0.10:80") == set(&["web-1", "web-3"]));
    let took = silenced.elapsed();
    node1.exec("nft", &["delete", "table", "inet", "vanished-peer"]).expect("restore node1's connections");
    assert!(arrived, "the change made after the peer vanished never arrived:\n{}", lab.proxy_log());
    eprintln!("a change made after the API server's end vanished arrived {:.1} s later", took.as_secs_f64());
    cp.set_pod_ready("web-2", pod_ip(lab, "web-2"), true).unwrap();

    // 2. A second ServiceCIDR, added and removed through the API: traffic to its unallocated
    //    addresses is dropped while it exists (from a pod, forwarded through node1), and goes
    //    its way (unreachable, at once) when it is gone.
    assert_eq!(probe(lab, "web-1", "10.97.0.5:80"), Err(false), "no ServiceCIDR: the lab has no route");
    cp.apply(
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: extra}\nspec: {cidrs: [10.97.0.0/24]}\n",
    )
    .unwrap();
    assert!(lab.eventually(within, || lab.listing().contains("10.97.0.0/24")), "{}", lab.proxy_log());
    assert_eq!(probe(lab, "web-1", "10.97.0.5:80"), Err(true), "inside a ServiceCIDR, unallocated: dropped");
    cp.kubectl_ok(&["delete", "servicecidr", "extra"]).unwrap();
    assert!(lab.eventually(Duration::from_secs(30), || !lab.listing().contains("10.97.0.0/24")), "{}", lab.proxy_log());
    assert_eq!(probe(lab, "web-1", "10.97.0.5:80"), Err(false), "the ServiceCIDR is gone");

    // 3. 1,000 Services, sliced by the controller, listed by a restarted nftproxy (more than one
    //    page: kube-rs lists 500 at a time), then a minute of changes watched.
    let t = Instant::now();
    cp.apply(&bulk_services(0..1000)).expect("1,000 Services");
    eprintln!("1,000 Services applied in {:.1} s", t.elapsed().as_secs_f64());
    drop(proxy);
    let proxy = lab.run_proxy_from(&["--kubeconfig", kubeconfig.to_str().unwrap()], &[]);
    let expected: std::collections::BTreeSet<usize> = (0..1000).collect();
    assert!(
        lab.eventually(Duration::from_secs(120), || bulk_in_kernel(lab) == expected),
        "{} of 1,000 Services programmed:\n{}",
        bulk_in_kernel(lab).len(),
        lab.proxy_log()
    );
    eprintln!("1,000 Services listed and programmed {:.1} s after they were applied", t.elapsed().as_secs_f64());
    let minute = Instant::now();
    let mut i = 0;
    while minute.elapsed() < Duration::from_secs(60) {
        // Every 2 s: one Service more, one fewer.
        cp.apply(&bulk_services(1000 + i..1001 + i)).unwrap();
        cp.kubectl_ok(&["delete", "service", &format!("bulk-{i}"), "--wait=false"]).unwrap();
        i += 1;
        std::thread::sleep(Duration::from_secs(2));
    }
    let expected: std::collections::BTreeSet<usize> = (i..1000 + i).collect();
    assert!(
        lab.eventually(Duration::from_secs(30), || bulk_in_kernel(lab) == expected),
        "after {i} changes: {} programmed, {} expected\n{}",
        bulk_in_kernel(lab).len(),
        expected.len(),
        lab.proxy_log()
    );
    assert_eq!(backends(&lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 30)), all);
    drop(proxy);
}

/// A child process killed on drop.
pub(crate) struct Guarded(pub(crate) Option<std::process::Child>);

impl Guarded {
    pub(crate) fn stop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.stop();
    }
}

fn scopeguard(child: std::process::Child) -> Guarded {
    Guarded(Some(child))
}

/// Waits for `child` to exit, at most `within`.
fn wait_exit(child: &mut std::process::Child, within: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// Policies and topology through the real API, on a dual-stack control plane: internal traffic
/// policy Local, load-balancer source ranges, `trafficDistribution: PreferSameZone` (hints the
/// EndpointSlice controller writes from the Nodes' zones) and a RequireDualStack Service.
const POLICIES: &str = r#"apiVersion: v1
kind: Service
metadata: {name: local, namespace: default}
spec:
  clusterIP: 10.96.0.50
  internalTrafficPolicy: Local
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: ranged, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.51
  loadBalancerSourceRanges: [192.168.50.100/32]
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30051, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: close, namespace: default}
spec:
  clusterIP: 10.96.0.52
  trafficDistribution: PreferSameZone
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: dual, namespace: default}
spec:
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 10.96.0.53
  clusterIPs: [10.96.0.53, "fd00:96::53"]
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
"#;

#[test]
fn policies_topology_and_dual_stack_through_the_real_api_server() {
    if skip_unless_privileged() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut lab = ClusterLab::new();
    let service_cidrs = format!(
        "{},{}",
        nftproxy_tools::lab::topology::SERVICE_CIDR_V4,
        nftproxy_tools::lab::topology::SERVICE_CIDR_V6
    );
    let cp = ControlPlane::start_in(&mut lab.lab, &service_cidrs).expect("dual-stack control plane");
    let lab = &lab;
    for (name, zone) in [("node1", "zone-a"), ("node2", "zone-b")] {
        let n = lab.lab.node(name);
        cp.add_node_with(name, &[IpAddr::V4(n.ip), IpAddr::V6(n.ip6)], zone).unwrap();
    }
    for (pod, node) in WEB_PODS {
        let p = lab.lab.pod(pod).unwrap();
        cp.add_pod(pod, node, p.ip, "app: web", true).unwrap();
        cp.set_pod_status(pod, &[IpAddr::V4(p.ip), IpAddr::V6(p.ip6)], true).unwrap();
    }
    cp.apply(&deploy_rbac()).expect("rbac");
    cp.apply(POLICIES).unwrap_or_else(|e| panic!("{e}"));
    cp.patch_status(
        "service",
        Some("default"),
        "ranged",
        &serde_json::json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.51"}]}}),
    )
    .unwrap();
    let token = cp.token("kube-system", "nftproxy").unwrap();
    let kubeconfig = lab.write("nftproxy.kubeconfig", &cp.kubeconfig(&token));
    // Both pod ranges, so outside clients of either family are masqueraded (a reply from node2
    // must come back through node1). A config file, as a dual-stack cluster would have it: its
    // values win over the lab's flags.
    let config = lab.write(
        "config.conf",
        &format!(
            r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection: {{kubeconfig: {}}}
hostnameOverride: node1
clusterCIDR: {},{}
conntrack: {{maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
"#,
            kubeconfig.display(),
            nftproxy_tools::lab::topology::CLUSTER_CIDR_V4,
            nftproxy_tools::lab::topology::CLUSTER_CIDR_V6
        ),
    );
    let _proxy = lab.run_proxy_from(&["--config", config.to_str().unwrap()], &[]);
    let within = Duration::from_secs(10);
    let answers = |who: &str, target: &str| backends(&lab.tally(who, L4Proto::Tcp, target, 30));
    let node1_pods = set(&["web-1", "web-2"]);
    let all = set(&["web-1", "web-2", "web-3"]);

    // internalTrafficPolicy Local: node1's endpoints only, from a client and from a pod.
    assert!(lab.eventually(within, || answers("client", "10.96.0.50:80") == node1_pods), "{}", lab.proxy_log());
    assert_eq!(answers("web-1", "10.96.0.50:80"), node1_pods);
    // Source ranges: the allowed client gets in, the other's packets are dropped.
    assert!(lab.eventually(within, || answers("client", "203.0.113.51:80") == all), "{}", lab.proxy_log());
    assert!(lab.ask("client2", L4Proto::Tcp, "203.0.113.51:80").is_err(), "outside the source ranges");
    // PreferSameZone (PreferClose before 1.35): the controller hints each endpoint to its Node's zone; node1 (zone-a) uses
    // zone-a's endpoints.
    assert!(
        lab.eventually(within, || answers("client", "10.96.0.52:80") == node1_pods),
        "{}\n{}",
        lab.proxy_log(),
        cp.kubectl_ok(&["get", "endpointslices", "-l", "kubernetes.io/service-name=close", "-o", "yaml"])
            .unwrap_or_default()
    );
    // Dual-stack: both ClusterIPs, each family's slice from the controller.
    assert!(lab.eventually(within, || answers("client", "10.96.0.53:80") == all), "{}", lab.proxy_log());
    assert!(
        lab.eventually(within, || answers("client", "[fd00:96::53]:80") == all),
        "{:?}\n{}\n{}",
        lab.tally("client", L4Proto::Tcp, "[fd00:96::53]:80", 3),
        cp.kubectl_ok(&["get", "endpointslices", "-l", "kubernetes.io/service-name=dual", "-o", "yaml"])
            .unwrap_or_default(),
        lab.listing().lines().filter(|l| l.contains("fd00:96::53")).collect::<Vec<_>>().join("\n")
    );
}
