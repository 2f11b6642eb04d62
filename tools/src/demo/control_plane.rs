//! `nftproxy demo --apiserver`: the demo's cluster through the real Kubernetes control plane
//! ([`ControlPlane`]: upstream etcd, kube-apiserver and kube-controller-manager in a lab
//! namespace of their own). `examples/cluster.yaml`'s Services are applied with `kubectl`; Nodes
//! and Pods are created through the API and their status written as a kubelet writes it, so the
//! EndpointSlices nftproxy programs are the EndpointSlice controller's; nftproxy runs with a
//! ServiceAccount token bound to `deploy/rbac.yaml`'s ClusterRole.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::error::{DemoError, check};
use crate::controlplane::{ControlPlane, ControlPlaneError};
use crate::lab::{Lab, topology};

/// The lab client the control plane runs in.
pub const NAMESPACE: &str = "control-plane";

/// deploy/rbac.yaml: nftproxy's ServiceAccount, ClusterRole and binding.
const RBAC: &str = include_str!("../../../deploy/rbac.yaml");

/// The label every demo pod carries, and the selector the demo gives the Services that
/// `examples/cluster.yaml` lists endpoints for (its Services have no selector: its
/// EndpointSlices are written by hand, and they list exactly the demo's pods).
const POD_LABEL: (&str, &str) = ("app", "web");

/// An EndpointSlice the API server accepts and nftproxy cannot use: it names no Service (no
/// `kubernetes.io/service-name` label).
const ORPHAN: &str = r#"apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: orphan, namespace: default}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.1.10]}]
"#;

/// What the demo applies of `examples/cluster.yaml`.
#[derive(Debug, PartialEq)]
pub(crate) struct Services {
    /// A `kind: List` of the file's Services (JSON, for `kubectl apply`), with a selector added
    /// where the file has EndpointSlices for the Service and no selector.
    pub list: String,
    /// The Services given a selector (their slices are the controller's).
    pub selected: Vec<String>,
    /// `(namespace, name, status)` of Services whose status the file sets (a load balancer's
    /// ingress), written after the apply through the status subresource.
    pub statuses: Vec<(String, String, Value)>,
}

/// The Services of `manifests` (a `kind: List`, as examples/cluster.yaml) for the API server:
/// its Nodes and EndpointSlices are left out (the lab's Nodes and Pods are created through the
/// API, and the EndpointSlice controller makes the slices).
pub(crate) fn services(manifests: &str) -> Result<Services, String> {
    let file: Value = serde_yaml_ng::from_str(manifests).map_err(|e| format!("examples/cluster.yaml: {e}"))?;
    let items = file["items"].as_array().cloned().unwrap_or_default();
    let sliced: BTreeSet<(String, String)> = items
        .iter()
        .filter(|i| i["kind"] == "EndpointSlice")
        .filter_map(|i| {
            let name = i["metadata"]["labels"]["kubernetes.io/service-name"].as_str()?;
            Some((namespace(i), name.to_string()))
        })
        .collect();
    let mut list = Vec::new();
    let (mut selected, mut statuses) = (Vec::new(), Vec::new());
    for mut item in items.into_iter().filter(|i| i["kind"] == "Service") {
        let (ns, name) = (namespace(&item), item["metadata"]["name"].as_str().unwrap_or_default().to_string());
        if sliced.contains(&(ns.clone(), name.clone())) && item["spec"].get("selector").is_none() {
            item["spec"]["selector"] = json!({ POD_LABEL.0: POD_LABEL.1 });
            selected.push(name.clone());
        }
        if let Some(status) = item.as_object_mut().and_then(|o| o.remove("status")) {
            statuses.push((ns, name, status));
        }
        list.push(item);
    }
    let list = json!({"apiVersion": "v1", "kind": "List", "items": list}).to_string();
    Ok(Services { list, selected, statuses })
}

fn namespace(item: &Value) -> String {
    item["metadata"]["namespace"].as_str().unwrap_or("default").to_string()
}

/// Starts the control plane in a new lab client (on the wan, outside the cluster).
pub(crate) fn start(lab: &mut Lab, stop: &Arc<AtomicBool>) -> Result<ControlPlane, DemoError> {
    let client = lab.add_client(NAMESPACE)?;
    let (ns, ip) = (client.ns.name().to_string(), client.ip);
    println!(
        "\nstarting etcd, kube-apiserver and kube-controller-manager v1.37 (scripts/upstream-bins) in {NAMESPACE} {ip}…"
    );
    let started = Instant::now();
    let cp = ControlPlane::start_interruptible(&ns, ip, topology::SERVICE_CIDR_V4, Arc::clone(stop))?;
    println!("  kube-apiserver {} ready after {:.1} s", cp.url(), started.elapsed().as_secs_f64());
    Ok(cp)
}

/// Makes the demo's cluster (the Services of `manifests`) through the API and returns a
/// kubeconfig for nftproxy's ServiceAccount.
pub(crate) fn populate(cp: &ControlPlane, lab: &Lab, manifests: &str, stop: &AtomicBool) -> Result<String, DemoError> {
    let services = services(manifests).map_err(DemoError::Agent)?;
    println!(
        "\nkubectl apply: examples/cluster.yaml's Services (its Nodes and EndpointSlices left out; \
         selector {}: {} added to {})",
        POD_LABEL.0,
        POD_LABEL.1,
        services.selected.join(", ")
    );
    print_indented(&cp.kubectl_stdin(&["apply"], &services.list)?);
    for (ns, name, status) in &services.statuses {
        cp.patch_status("service", Some(ns), name, status)?;
        println!("  service/{name} status written, as a load balancer controller would: {status}");
    }
    check(stop)?;

    println!("\nNodes and Pods through the API, their status written as a kubelet writes it:");
    for (node, zone) in lab.nodes.iter().zip(["zone-a", "zone-b", "zone-c"]) {
        cp.add_node(&node.name, node.ip, zone)?;
        println!("  node/{:<6} InternalIP {:<14} {zone}, Ready", node.name, node.ip);
    }
    let labels = format!("{}: {}", POD_LABEL.0, POD_LABEL.1);
    for pod in &lab.pods {
        cp.add_pod(&pod.name, &pod.node, pod.ip, &labels, true)?;
        println!("  pod/{:<7} on {:<6} {:<12} {labels}, Running, Ready", pod.name, pod.node, pod.ip);
    }
    check(stop)?;

    let waited = wait_for_slices(cp, &services.selected, lab.pods.len(), stop)?;
    println!(
        "  the EndpointSlice controller made the slices of {} ({} ready endpoints each) in {:.1} s",
        services.selected.join(", "),
        lab.pods.len(),
        waited.as_secs_f64()
    );

    cp.apply(RBAC)?;
    let token = cp.token("kube-system", "nftproxy")?;
    println!(
        "\nkubectl apply -f deploy/rbac.yaml; nftproxy runs as ServiceAccount kube-system/nftproxy \
         (a token from `kubectl create token`, bound to ClusterRole nftproxy)"
    );
    Ok(cp.kubeconfig(&token))
}

/// Waits until the controller's slices of each of `services` list `pods` ready endpoints.
fn wait_for_slices(
    cp: &ControlPlane,
    services: &[String],
    pods: usize,
    stop: &AtomicBool,
) -> Result<Duration, DemoError> {
    let started = Instant::now();
    loop {
        check(stop)?;
        let text = cp.kubectl_ok(&["get", "endpointslices", "-n", "default", "-o", "json"])?;
        let ready = ready_endpoints(&text);
        if services.iter().all(|s| ready.get(s.as_str()).copied().unwrap_or(0) >= pods) {
            return Ok(started.elapsed());
        }
        if started.elapsed() > Duration::from_secs(30) {
            let slices = cp.kubectl_ok(&["get", "endpointslices", "-A"]).unwrap_or_default();
            return Err(DemoError::Agent(format!(
                "the EndpointSlice controller did not make the slices within 30 s:\n{slices}\n{}",
                cp.logs()
            )));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Ready endpoints per Service in a `kubectl get endpointslices -o json`.
fn ready_endpoints(json: &str) -> BTreeMap<String, usize> {
    let list: Value = serde_json::from_str(json).unwrap_or_default();
    let mut ready = BTreeMap::new();
    for slice in list["items"].as_array().into_iter().flatten() {
        let Some(service) = slice["metadata"]["labels"]["kubernetes.io/service-name"].as_str() else { continue };
        let n = slice["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["conditions"]["ready"] != Value::Bool(false))
            .count();
        *ready.entry(service.to_string()).or_default() += n;
    }
    ready
}

/// Applies an EndpointSlice without the `kubernetes.io/service-name` label (the API accepts it;
/// nftproxy cannot tell its Service), waits for nftproxy's NotProgrammed Event about it, and
/// shows `kubectl get endpointslices` and `kubectl get events`.
pub(crate) fn bad_object(cp: &ControlPlane, stop: &AtomicBool) -> Result<(), DemoError> {
    println!("\na bad object: an EndpointSlice without the kubernetes.io/service-name label, which the API accepts");
    print_indented(&cp.kubectl_stdin(&["apply"], ORPHAN)?);
    let started = Instant::now();
    loop {
        check(stop)?;
        let events = cp.kubectl_ok(&["get", "events.events.k8s.io", "-n", "default", "-o", "json"])?;
        let events: Value = serde_json::from_str(&events).unwrap_or_default();
        let reported = events["items"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["reason"] == "NotProgrammed" && e["regarding"]["name"] == "orphan");
        if reported {
            break;
        }
        if started.elapsed() > Duration::from_secs(15) {
            println!("  (no NotProgrammed Event about it within 15 s)");
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    println!("\n$ kubectl get endpointslices");
    print_indented(&cp.kubectl_ok(&["get", "endpointslices"])?);
    println!("\n$ kubectl get events");
    print_indented(&cp.kubectl_ok(&["get", "events"])?);
    Ok(())
}

/// How to reach the control plane while the lab is held.
pub(crate) fn hold_hint(cp: &ControlPlane, ns: &str) -> String {
    format!(
        "\n  ip netns exec {ns} {} --kubeconfig {} get endpointslices,events",
        cp.bins.path("kubectl").display(),
        cp.admin_kubeconfig().display()
    )
}

fn print_indented(text: &str) {
    for line in text.lines() {
        println!("  {line}");
    }
}

impl From<ControlPlaneError> for DemoError {
    fn from(e: ControlPlaneError) -> DemoError {
        match e {
            ControlPlaneError::Interrupted(_) => DemoError::Interrupted,
            e => DemoError::ControlPlane(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_services_get_selectors_and_lose_slices_and_nodes() {
        let s = services(crate::demo::DEMO_MANIFESTS).unwrap();
        let list: Value = serde_json::from_str(&s.list).unwrap();
        let items = list["items"].as_array().unwrap();
        assert!(items.iter().all(|i| i["kind"] == "Service"), "{items:?}");
        let names: Vec<&str> = items.iter().filter_map(|i| i["metadata"]["name"].as_str()).collect();
        assert_eq!(names, ["web", "no-backends", "web-nodeport", "web-lb"]);
        assert_eq!(s.selected, ["web", "web-nodeport", "web-lb"]);
        for item in items {
            let selected = item["spec"].get("selector").is_some();
            assert_eq!(selected, item["metadata"]["name"] != "no-backends", "{item}");
            assert!(item.get("status").is_none(), "{item}");
        }
        assert_eq!(s.statuses.len(), 1);
        assert_eq!(s.statuses[0].1, "web-lb");
        assert_eq!(s.statuses[0].2["loadBalancer"]["ingress"][0]["ip"], "203.0.113.10");
    }

    #[test]
    fn ready_endpoints_per_service() {
        let json = r#"{"items": [
            {"metadata": {"labels": {"kubernetes.io/service-name": "web"}},
             "endpoints": [{"conditions": {"ready": true}}, {"conditions": {"ready": false}}]},
            {"metadata": {"labels": {"kubernetes.io/service-name": "web"}}, "endpoints": [{}]},
            {"metadata": {"name": "orphan"}, "endpoints": [{}]}
        ]}"#;
        assert_eq!(ready_endpoints(json), BTreeMap::from([("web".to_string(), 2)]));
    }
}
