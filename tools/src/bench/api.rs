//! Writes to the real API server (tools/src/controlplane.rs) at the rates the head-to-head
//! needs: thousands of objects created with many requests in flight, and a steady stream of
//! EndpointSlice patches (100 a second) whose sending times are recorded. `kubectl` starts a
//! process per write and sends one object at a time; this is one kube client on a thread inside
//! the control plane's namespace (its sockets live there) with a runtime of its own.

use std::future::Future;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::{StreamExt as _, TryStreamExt as _};
use serde_json::{Value, json};

use super::error::BenchError;
use crate::controlplane::ControlPlane;

/// The annotation both proxies turn into `kubeproxy_network_programming_duration_seconds`.
pub const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// Requests in flight while creating objects.
const CREATE_CONCURRENCY: usize = 16;

/// The admin's client of one control plane.
#[derive(Debug, Clone)]
pub struct ApiClient {
    netns: String,
    kubeconfig: PathBuf,
}

/// One object to create: the collection it is POSTed to, and the object.
#[derive(Debug, Clone)]
pub struct NewObject {
    pub collection: String,
    pub object: Value,
}

fn failed(what: impl std::fmt::Display) -> BenchError {
    BenchError::HeadToHead(format!("API: {what}"))
}

impl ApiClient {
    /// The admin's client of `cp`.
    pub fn new(cp: &ControlPlane) -> ApiClient {
        ApiClient { netns: cp.namespace().to_string(), kubeconfig: cp.admin_kubeconfig() }
    }

    /// Runs `work` with a connected client on a thread inside the control plane's namespace, on
    /// a runtime of its own, and returns what it returns.
    pub fn run<T, F, Fut>(&self, work: F) -> Result<T, BenchError>
    where
        T: Send,
        F: FnOnce(kube::Client) -> Fut + Send,
        Fut: Future<Output = Result<T, BenchError>>,
    {
        let path = format!("/run/netns/{}", self.netns);
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    crate::lab::netns::enter(&path)?;
                    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                    runtime.block_on(async {
                        let client = self.connect().await?;
                        work(client).await
                    })
                })
                .join()
                .map_err(|_| failed("the client's thread panicked"))?
        })
    }

    /// A client with its connection open (so the first timed request does not pay for the TLS
    /// handshake).
    async fn connect(&self) -> Result<kube::Client, BenchError> {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig).map_err(failed)?;
        let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(failed)?;
        let client = kube::Client::try_from(config).map_err(failed)?;
        send(&client, "GET", "/version", "", Vec::new()).await?;
        Ok(client)
    }

    /// Creates the objects, `CREATE_CONCURRENCY` requests at a time.
    pub fn create_all(&self, objects: Vec<NewObject>) -> Result<(), BenchError> {
        self.run(|client| async move {
            futures::stream::iter(objects)
                .map(|o| {
                    let client = client.clone();
                    async move {
                        let body = serde_json::to_vec(&o.object).map_err(failed)?;
                        send(&client, "POST", &o.collection, "application/json", body).await
                    }
                })
                .buffer_unordered(CREATE_CONCURRENCY)
                .try_collect::<Vec<()>>()
                .await
                .map(|_| ())
        })
    }

    /// Deletes objects by their paths, ignoring those already gone.
    pub fn delete_all(&self, paths: Vec<String>) -> Result<(), BenchError> {
        self.run(|client| async move {
            futures::stream::iter(paths)
                .map(|p| {
                    let client = client.clone();
                    async move {
                        match send(&client, "DELETE", &p, "", Vec::new()).await {
                            Err(BenchError::HeadToHead(e)) if e.contains("NotFound") || e.contains("404") => Ok(()),
                            other => other,
                        }
                    }
                })
                .buffer_unordered(CREATE_CONCURRENCY)
                .try_collect::<Vec<()>>()
                .await
                .map(|_| ())
        })
    }

    /// One write, timed: returns when it was sent (just before the request left).
    pub fn write(&self, write: &Write) -> Result<SystemTime, BenchError> {
        self.run(|client| async move {
            let sent = SystemTime::now();
            write.send(&client, sent).await?;
            Ok(sent)
        })
    }

    /// Sends `writes(k)` for k = 0, 1, … at `rate` a second for `duration`, without waiting
    /// for one answer before the next is due (at most `in_flight` unanswered); `before(k)` runs
    /// just before each is sent. Returns each write's sending time and whether it succeeded.
    pub fn stream<W, B>(
        &self,
        rate: u32,
        duration: Duration,
        in_flight: usize,
        writes: W,
        before: B,
    ) -> Result<Vec<(SystemTime, bool)>, BenchError>
    where
        W: Fn(u64) -> Write + Send + Sync,
        B: Fn(u64) + Send + Sync,
    {
        self.run(|client| async move {
            let interval = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
            let permits = Arc::new(tokio::sync::Semaphore::new(in_flight.max(1)));
            let started = tokio::time::Instant::now();
            let mut tasks = Vec::new();
            let mut k: u64 = 0;
            loop {
                let due = interval.mul_f64(k as f64);
                if due >= duration {
                    break;
                }
                tokio::time::sleep_until(started + due).await;
                let permit = Arc::clone(&permits).acquire_owned().await.map_err(failed)?;
                let write = writes(k);
                before(k);
                let sent = SystemTime::now();
                let client = client.clone();
                tasks.push(tokio::spawn(async move {
                    let ok = write.send(&client, sent).await.is_ok();
                    drop(permit);
                    (sent, ok)
                }));
                k += 1;
            }
            let mut out = Vec::with_capacity(tasks.len());
            for t in tasks {
                out.push(t.await.map_err(failed)?);
            }
            Ok(out)
        })
    }
}

/// A write the benchmark times.
#[derive(Debug, Clone)]
pub enum Write {
    /// An EndpointSlice's first endpoint gets a new address, with the trigger-time annotation
    /// set to the sending time (as the EndpointSlice controller sets it).
    ReplaceEndpoint { namespace: String, slice: String, address: Ipv4Addr },
    /// An object created.
    Create(NewObject),
}

impl Write {
    async fn send(&self, client: &kube::Client, sent: SystemTime) -> Result<(), BenchError> {
        match self {
            Write::ReplaceEndpoint { namespace, slice, address } => {
                let patch = json!([
                    {"op": "replace", "path": "/endpoints/0/addresses", "value": [address.to_string()]},
                    {"op": "add", "path": "/metadata/annotations",
                     "value": {TRIGGER_TIME: humantime::format_rfc3339_nanos(sent).to_string()}},
                ]);
                let path = format!("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/{slice}");
                let body = serde_json::to_vec(&patch).map_err(failed)?;
                send(client, "PATCH", &path, "application/json-patch+json", body).await
            }
            Write::Create(o) => {
                let body = serde_json::to_vec(&o.object).map_err(failed)?;
                send(client, "POST", &o.collection, "application/json", body).await
            }
        }
    }
}

async fn send(
    client: &kube::Client,
    method: &str,
    path: &str,
    content_type: &str,
    body: Vec<u8>,
) -> Result<(), BenchError> {
    let mut request = http::Request::builder().method(method).uri(path);
    if !content_type.is_empty() {
        request = request.header(http::header::CONTENT_TYPE, content_type);
    }
    let request = request.body(body).map_err(failed)?;
    client.request_text(request).await.map(|_| ()).map_err(|e| failed(format!("{method} {path}: {e}")))
}

/// A merge patch of the object at `path` (e.g. a Service's `…/status`, as its load balancer
/// controller writes it).
pub async fn merge_patch(client: &kube::Client, path: &str, patch: &Value) -> Result<(), BenchError> {
    let body = serde_json::to_vec(patch).map_err(failed)?;
    send(client, "PATCH", path, "application/merge-patch+json", body).await
}

/// The collection a namespaced object of `kind` is created in.
pub fn collection(kind: &str, namespace: &str) -> String {
    match kind {
        "EndpointSlice" => format!("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"),
        "Namespace" => "/api/v1/namespaces".into(),
        _ => format!("/api/v1/namespaces/{namespace}/{}s", kind.to_lowercase()),
    }
}

/// A selector-less ClusterIP Service `namespace/name` with one TCP port 80 → 8080.
pub fn service(namespace: &str, name: &str, cluster_ip: Ipv4Addr) -> NewObject {
    NewObject {
        collection: collection("Service", namespace),
        object: json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterIP": cluster_ip.to_string(),
                     "ports": [{"name": "p", "port": 80, "targetPort": 8080, "protocol": "TCP"}]},
        }),
    }
}

/// The EndpointSlice `<service>-1` of a Service made by [`service`]: ready endpoints on node1.
pub fn slice(namespace: &str, service: &str, addresses: &[Ipv4Addr]) -> NewObject {
    let endpoints: Vec<Value> = addresses
        .iter()
        .map(|a| json!({"addresses": [a.to_string()], "conditions": {"ready": true}, "nodeName": "node1"}))
        .collect();
    NewObject {
        collection: collection("EndpointSlice", namespace),
        object: json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{service}-1"), "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": service,
                                    "endpointslice.kubernetes.io/managed-by": "nftproxy-bench"}},
            "addressType": "IPv4",
            "ports": [{"name": "p", "port": 8080, "protocol": "TCP"}],
            "endpoints": endpoints,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_go_to_their_collections() {
        let s = service("bench", "svc1", Ipv4Addr::new(10, 96, 3, 233));
        assert_eq!(s.collection, "/api/v1/namespaces/bench/services");
        assert_eq!(s.object["spec"]["clusterIP"], "10.96.3.233");
        let e = slice("bench", "svc1", &[Ipv4Addr::new(10, 128, 0, 1)]);
        assert_eq!(e.collection, "/apis/discovery.k8s.io/v1/namespaces/bench/endpointslices");
        assert_eq!(e.object["metadata"]["name"], "svc1-1");
        assert_eq!(e.object["metadata"]["labels"]["kubernetes.io/service-name"], "svc1");
        assert_eq!(e.object["endpoints"][0]["addresses"][0], "10.128.0.1");
        assert_eq!(collection("Namespace", ""), "/api/v1/namespaces");
    }
}
