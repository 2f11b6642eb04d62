//! A test Kubernetes API server speaking the real list/watch wire format over plain HTTP:
//! lists with a resourceVersion, chunked watch streams of ADDED/MODIFIED/DELETED/BOOKMARK events,
//! `410 Gone` on demand (forcing a relist), dropped connections, and shutting down. It serves
//! Services, EndpointSlices, Nodes and ServiceCIDRs (with `labelSelector` `!key` and
//! `fieldSelector` `metadata.name=`; a resource can be hidden, answering 404 as an older API
//! server does), and accepts Events, which tests can read back.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

/// Resource paths and their list kinds.
pub const SERVICES: &str = "/api/v1/services";
pub const SLICES: &str = "/apis/discovery.k8s.io/v1/endpointslices";
pub const NODES: &str = "/api/v1/nodes";
pub const SERVICE_CIDRS: &str = "/apis/networking.k8s.io/v1/servicecidrs";

fn list_kind(path: &str) -> (&'static str, &'static str) {
    match path {
        SERVICES => ("ServiceList", "v1"),
        SLICES => ("EndpointSliceList", "discovery.k8s.io/v1"),
        SERVICE_CIDRS => ("ServiceCIDRList", "networking.k8s.io/v1"),
        _ => ("NodeList", "v1"),
    }
}

/// Watch events kept per resource: older ones are dropped, and a watch from before them is
/// answered `410 Gone`, as an API server's compaction does (churn benchmarks send hundreds of
/// thousands of events).
const LOG_CAPACITY: usize = 100_000;

#[derive(Default)]
struct Store {
    rv: u64,
    objects: HashMap<&'static str, BTreeMap<String, Value>>,
    /// Watch events per resource, in resource-version order.
    log: HashMap<&'static str, Vec<(u64, &'static str, Value)>>,
    /// Per resource, the newest resource version dropped from the log.
    compacted: HashMap<&'static str, u64>,
    expired: std::collections::HashSet<&'static str>,
    /// Resources answered with 404.
    hidden: std::collections::HashSet<&'static str>,
    events: Vec<Value>,
    watch_requests: usize,
    list_requests: usize,
}

impl Store {
    /// Appends a watch event, dropping the oldest half of the log when it is full.
    fn record(&mut self, res: &'static str, event: (u64, &'static str, Value)) {
        let log = self.log.entry(res).or_default();
        log.push(event);
        if log.len() > LOG_CAPACITY {
            let dropped: Vec<_> = log.drain(..LOG_CAPACITY / 2).collect();
            if let Some((rv, _, _)) = dropped.last() {
                self.compacted.insert(res, *rv);
            }
        }
    }

    /// Watch events of `res` after `since` (the log is in resource-version order).
    fn events_after(&self, res: &str, since: u64, q: &HashMap<String, String>) -> Vec<(u64, &'static str, Value)> {
        let Some(log) = self.log.get(res) else { return Vec::new() };
        let from = log.partition_point(|(rv, _, _)| *rv <= since);
        log[from..].iter().filter(|(_, _, o)| selected(o, q)).cloned().collect()
    }
}

fn key(obj: &Value) -> String {
    let ns = obj["metadata"]["namespace"].as_str().unwrap_or("");
    let name = obj["metadata"]["name"].as_str().unwrap_or("");
    format!("{ns}/{name}")
}

fn resource(kind: &str) -> &'static str {
    match kind {
        "Service" => SERVICES,
        "EndpointSlice" => SLICES,
        "Node" => NODES,
        "ServiceCIDR" => SERVICE_CIDRS,
        other => panic!("the test API server does not serve {other}"),
    }
}

/// The server's handle; dropping it stops the server.
pub struct FakeApi {
    store: Arc<Mutex<Store>>,
    changed: broadcast::Sender<()>,
    disconnect: watch::Sender<u64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub addr: SocketAddr,
}

impl FakeApi {
    /// Starts the server on 127.0.0.1 inside `ns`.
    pub fn start(ns: &crate::lab::Netns) -> FakeApi {
        let store = Arc::new(Mutex::new(Store::default()));
        let (changed, _) = broadcast::channel(1024);
        let (disconnect, _) = watch::channel(0u64);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (s, c, d) = (Arc::clone(&store), changed.clone(), disconnect.clone());
        let thread = ns.spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the test API server");
            rt.block_on(serve(s, c, d, stop_rx, addr_tx));
        });
        let addr = addr_rx.recv_timeout(Duration::from_secs(5)).expect("test API server did not start");
        FakeApi {
            store,
            changed,
            disconnect,
            stop: Some(stop_tx),
            thread: Some(std::thread::spawn(move || {
                let _ = thread.join();
            })),
            addr,
        }
    }

    /// A kubeconfig pointing at the server.
    pub fn kubeconfig(&self) -> String {
        format!(
            r#"apiVersion: v1
kind: Config
clusters: [{{name: lab, cluster: {{server: "http://{}"}}}}]
users: [{{name: lab, user: {{token: test}}}}]
contexts: [{{name: lab, context: {{cluster: lab, user: lab, namespace: default}}}}]
current-context: lab
"#,
            self.addr
        )
    }

    /// Creates or updates an object (from its `kind`), emitting ADDED or MODIFIED.
    pub fn apply(&self, obj: Value) {
        self.put(obj, true);
    }

    /// Changes an object without emitting a watch event (as if the event was missed).
    pub fn apply_silently(&self, obj: Value) {
        self.put(obj, false);
    }

    fn put(&self, mut obj: Value, notify: bool) {
        let res = resource(obj["kind"].as_str().unwrap_or(""));
        {
            let mut s = lock(&self.store);
            s.rv += 1;
            let rv = s.rv;
            obj["metadata"]["resourceVersion"] = json!(rv.to_string());
            let k = key(&obj);
            let existed = s.objects.entry(res).or_default().insert(k, obj.clone()).is_some();
            if notify {
                s.record(res, (rv, if existed { "MODIFIED" } else { "ADDED" }, obj));
            }
        }
        let _ = self.changed.send(());
    }

    /// Deletes an object, emitting DELETED.
    pub fn delete(&self, kind: &str, namespace: &str, name: &str) {
        let res = resource(kind);
        {
            let mut s = lock(&self.store);
            s.rv += 1;
            let rv = s.rv;
            if let Some(mut obj) = s.objects.entry(res).or_default().remove(&format!("{namespace}/{name}")) {
                obj["metadata"]["resourceVersion"] = json!(rv.to_string());
                s.record(res, (rv, "DELETED", obj));
            }
        }
        let _ = self.changed.send(());
    }

    /// Answers 404 for a resource (one of the path constants), as an API server that does not
    /// serve it.
    pub fn hide(&self, resource: &'static str) {
        lock(&self.store).hidden.insert(resource);
    }

    /// Ends every watch with `410 Gone`: watchers must list again.
    pub fn expire_watches(&self) {
        lock(&self.store).expired = [SERVICES, SLICES, NODES, SERVICE_CIDRS].into_iter().collect();
        self.drop_connections();
    }

    /// Closes every open watch stream.
    pub fn drop_connections(&self) {
        self.disconnect.send_modify(|g| *g += 1);
    }

    /// Events posted so far.
    pub fn events(&self) -> Vec<Value> {
        lock(&self.store).events.clone()
    }

    /// (list requests, watch requests) served so far.
    pub fn requests(&self) -> (usize, usize) {
        let s = lock(&self.store);
        (s.list_requests, s.watch_requests)
    }

    /// Stops the server (connections drop; new ones are refused).
    pub fn stop(&mut self) {
        self.drop_connections();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop();
    }
}

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// The store, locked (poisoned only when a thread panicked holding it: the test fails anyway).
fn lock(store: &Mutex<Store>) -> std::sync::MutexGuard<'_, Store> {
    store.lock().expect("the test API server's store (a thread panicked holding it)")
}

fn full(status: StatusCode, body: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("Content-Type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed_unsync())
        .expect("a status and a fixed header make a valid response")
}

fn query(req: &Request<Incoming>) -> HashMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), percent_decode(v)))
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn selected(obj: &Value, q: &HashMap<String, String>) -> bool {
    if let Some(sel) = q.get("labelSelector") {
        for req in sel.split(',').filter(|r| !r.is_empty()) {
            if let Some(label) = req.strip_prefix('!')
                && !obj["metadata"]["labels"][label].is_null()
            {
                return false;
            }
        }
    }
    if let Some(sel) = q.get("fieldSelector")
        && let Some(name) = sel.strip_prefix("metadata.name=")
        && obj["metadata"]["name"].as_str() != Some(name)
    {
        return false;
    }
    true
}

async fn serve(
    store: Arc<Mutex<Store>>,
    changed: broadcast::Sender<()>,
    disconnect: watch::Sender<u64>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
    addr_tx: std::sync::mpsc::Sender<SocketAddr>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a port on 127.0.0.1");
    let address = listener.local_addr().expect("a bound listener's address");
    if addr_tx.send(address).is_err() {
        return; // nobody waits for this server any more
    }
    loop {
        let (stream, _) = tokio::select! {
            a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
            _ = &mut stop => return,
        };
        let (store, changed, disconnect) = (Arc::clone(&store), changed.clone(), disconnect.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let (store, changed, disconnect) = (Arc::clone(&store), changed.clone(), disconnect.clone());
                async move { Ok::<_, Infallible>(handle(req, store, changed, disconnect).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

async fn handle(
    req: Request<Incoming>,
    store: Arc<Mutex<Store>>,
    changed: broadcast::Sender<()>,
    disconnect: watch::Sender<u64>,
) -> Response<Body> {
    let path = req.uri().path().to_string();
    if req.method() == Method::POST && path.ends_with("/events") {
        let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let event: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        lock(&store).events.push(event.clone());
        return full(StatusCode::CREATED, event);
    }
    if req.method() == Method::PATCH && path.contains("/events/") {
        let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        return full(StatusCode::OK, serde_json::from_slice(&body).unwrap_or(Value::Null));
    }
    let hidden = |res: &str| lock(&store).hidden.contains(res);
    let res: &'static str = match path.as_str() {
        SERVICES => SERVICES,
        SLICES => SLICES,
        NODES => NODES,
        SERVICE_CIDRS if !hidden(SERVICE_CIDRS) => SERVICE_CIDRS,
        _ => {
            return full(
                StatusCode::NOT_FOUND,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound"}),
            );
        }
    };
    let q = query(&req);
    if q.get("watch").map(String::as_str) != Some("true") {
        let mut s = lock(&store);
        s.list_requests += 1;
        let (kind, api_version) = list_kind(res);
        let items: Vec<Value> =
            s.objects.get(res).map(|m| m.values().filter(|o| selected(o, &q)).cloned().collect()).unwrap_or_default();
        return full(
            StatusCode::OK,
            json!({"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}),
        );
    }

    // A watch: replay what happened after the requested version, then follow.
    let since: u64 = q.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let timeout = Duration::from_secs(q.get("timeoutSeconds").and_then(|v| v.parse().ok()).unwrap_or(290));
    let expired = {
        let mut s = lock(&store);
        s.watch_requests += 1;
        let compacted = s.compacted.get(res).is_some_and(|rv| since < *rv);
        s.expired.remove(res) || compacted
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    if expired {
        let _ = tx.send(Bytes::from(format!("{}\n", gone())));
        drop(tx);
    } else {
        let mut changes = changed.subscribe();
        let mut dropped = disconnect.subscribe();
        let generation = *dropped.borrow();
        let q2 = q.clone();
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + timeout;
            let mut sent = since;
            let (kind, api_version) = list_kind(res);
            let item_kind = kind.trim_end_matches("List");
            loop {
                let (events, rv, behind) = {
                    let s = lock(&store);
                    let behind = s.compacted.get(res).is_some_and(|rv| sent < *rv);
                    (s.events_after(res, sent, &q2), s.rv, behind)
                };
                // Events this watch has not sent were dropped: it must list again.
                if behind {
                    let _ = tx.send(Bytes::from(format!("{}\n", gone())));
                    return;
                }
                for (rv, ty, obj) in events {
                    sent = rv;
                    if tx.send(Bytes::from(format!("{}\n", json!({"type": ty, "object": obj})))).is_err() {
                        return;
                    }
                }
                let bookmark = json!({"type": "BOOKMARK", "object": {"kind": item_kind, "apiVersion": api_version, "metadata": {"resourceVersion": rv.to_string()}}});
                if tx.send(Bytes::from(format!("{bookmark}\n"))).is_err() {
                    return;
                }
                sent = sent.max(rv);
                tokio::select! {
                    _ = changes.recv() => {}
                    _ = dropped.changed() => if *dropped.borrow() != generation { return },
                    _ = tokio::time::sleep_until(deadline) => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        });
    }
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("Content-Type", "application/json")
        .body(BodyExt::boxed_unsync(StreamBody::new(stream.boxed())))
        .expect("a status and a fixed header make a valid response")
}

/// The watch event ending a watch whose resource version is too old.
fn gone() -> Value {
    json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": "too old resource version", "reason": "Expired", "code": 410}})
}

/// Every document of manifest YAML, as JSON values (for `FakeApi::apply`).
pub fn objects(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|doc| <Value as serde::Deserialize>::deserialize(doc).unwrap_or_else(|e| panic!("manifest YAML: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}
