//! Services, EndpointSlices and this node's Node from the Kubernetes API, with kube-rs watchers.
//!
//! Like upstream kube-proxy: objects labelled `service.kubernetes.io/service-proxy-name` belong to
//! another proxy and EndpointSlices labelled `service.kubernetes.io/headless` to headless
//! services, so the API server filters both out. A list (the first one, or a relist after a
//! `410 Gone` or a reconnect) is delivered whole, so objects that disappeared while the watch was
//! down are removed. Errors are logged and retried with backoff; the reconciler keeps the last
//! programmed rules meanwhile.

use std::sync::mpsc::Sender;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, ObjectReference, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Event as K8sEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher::{self, Event as WatchEvent};
use kube::{Api, Client, Resource};
use thiserror::Error;
use tracing::{debug, info, warn};

use super::{Event, Kind};
use crate::model::{NamespacedName, Problem};

/// Label selector for Services and EndpointSlices nftproxy proxies.
pub const SERVICE_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name";
/// Label selector for EndpointSlices.
pub const SLICE_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// Errors setting up the API client.
#[derive(Debug, Error)]
pub enum KubeSourceError {
    #[error("cannot read kubeconfig {path}: {source}")]
    Kubeconfig { path: String, source: kube::config::KubeconfigError },
    #[error("no Kubernetes configuration: not in a cluster and no --kubeconfig ({0})")]
    Infer(String),
    #[error("cannot create the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

/// A client from `--kubeconfig`, or in-cluster (service account), or the usual inference.
pub async fn client(kubeconfig: Option<&str>) -> Result<Client, KubeSourceError> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|source| KubeSourceError::Kubeconfig { path: path.to_string(), source })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|source| KubeSourceError::Kubeconfig { path: path.to_string(), source })?
        }
        None => kube::Config::infer().await.map_err(|e| KubeSourceError::Infer(e.to_string()))?,
    };
    Ok(Client::try_from(config)?)
}

fn namespaced<K: Resource>(obj: &K) -> NamespacedName {
    let meta = obj.meta();
    NamespacedName::new(
        meta.namespace.clone().unwrap_or_else(|| "default".into()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Watches one kind and turns its events into source events.
async fn watch_kind<K, F>(api: Api<K>, config: watcher::Config, kind: Kind, tx: Sender<Event>, to_event: F)
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    F: Fn(WatchEvent<K>, &mut Vec<K>) -> Vec<Event>,
{
    let mut buffer: Vec<K> = Vec::new();
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    loop {
        match stream.try_next().await {
            Ok(Some(ev)) => {
                let done = matches!(ev, WatchEvent::InitDone);
                for e in to_event(ev, &mut buffer) {
                    if tx.send(e).is_err() {
                        return;
                    }
                }
                if done {
                    debug!(?kind, "list complete");
                    if tx.send(Event::Synced(kind)).is_err() {
                        return;
                    }
                }
            }
            Ok(None) => return,
            Err(e) => warn!(?kind, error = %e, "watch failed; retrying with backoff (rules stay as they are)"),
        }
    }
}

fn list_events<K: Clone>(
    ev: WatchEvent<K>,
    buffer: &mut Vec<K>,
    listed: fn(Vec<K>) -> Event,
    applied: fn(K) -> Event,
    deleted: fn(K) -> Event,
) -> Vec<Event> {
    match ev {
        WatchEvent::Init => {
            buffer.clear();
            Vec::new()
        }
        WatchEvent::InitApply(obj) => {
            buffer.push(obj);
            Vec::new()
        }
        WatchEvent::InitDone => vec![listed(std::mem::take(buffer))],
        WatchEvent::Apply(obj) => vec![applied(obj)],
        WatchEvent::Delete(obj) => vec![deleted(obj)],
    }
}

/// Starts the three watchers on the current tokio runtime.
pub fn spawn_watchers(client: Client, hostname: &str, tx: Sender<Event>) {
    let services: Api<Service> = Api::all(client.clone());
    let slices: Api<EndpointSlice> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client);
    let svc_tx = tx.clone();
    tokio::spawn(watch_kind(
        services,
        watcher::Config::default().labels(SERVICE_SELECTOR),
        Kind::Services,
        svc_tx,
        |ev, buf| {
            list_events(
                ev,
                buf,
                Event::ServicesListed,
                |s| Event::ServiceApplied(Box::new(s)),
                |s: Service| Event::ServiceDeleted(namespaced(&s)),
            )
        },
    ));
    let slice_tx = tx.clone();
    tokio::spawn(watch_kind(
        slices,
        watcher::Config::default().labels(SLICE_SELECTOR),
        Kind::EndpointSlices,
        slice_tx,
        |ev, buf| {
            list_events(
                ev,
                buf,
                Event::SlicesListed,
                |s| Event::SliceApplied(Box::new(s)),
                |s: EndpointSlice| Event::SliceDeleted(namespaced(&s)),
            )
        },
    ));
    let node_selector = format!("metadata.name={hostname}");
    tokio::spawn(watch_kind(nodes, watcher::Config::default().fields(&node_selector), Kind::Nodes, tx, |ev, buf| {
        list_events(ev, buf, Event::NodesListed, |n| Event::NodeApplied(Box::new(n)), |_| Event::NodeDeleted)
    }));
    info!("watching Services, EndpointSlices and this Node");
}

/// Publishes Kubernetes Events for objects that cannot be programmed (once per problem).
pub struct EventPublisher {
    recorder: Recorder,
    sent: std::collections::HashSet<String>,
}

impl EventPublisher {
    /// A publisher reporting as `nftproxy` on `hostname`.
    pub fn new(client: Client, hostname: &str) -> EventPublisher {
        let reporter = Reporter { controller: "nftproxy".into(), instance: Some(hostname.to_string()) };
        EventPublisher { recorder: Recorder::new(client, reporter), sent: Default::default() }
    }

    /// Publishes a warning Event on the object of `problem`, unless already sent.
    pub async fn publish(&mut self, problem: &Problem) {
        if !self.sent.insert(problem.to_string()) {
            return;
        }
        let (api_version, kind) = match problem.object.kind {
            "EndpointSlice" => ("discovery.k8s.io/v1", "EndpointSlice"),
            other => ("v1", other),
        };
        let reference = ObjectReference {
            api_version: Some(api_version.into()),
            kind: Some(kind.into()),
            name: Some(problem.object.name.clone()),
            namespace: problem.object.namespace.clone(),
            ..Default::default()
        };
        let note = if problem.field.is_empty() {
            problem.reason.clone()
        } else {
            format!("{}: {}", problem.field, problem.reason)
        };
        let event = K8sEvent {
            type_: EventType::Warning,
            reason: if problem.object_skipped { "NotProgrammed".into() } else { "FieldIgnored".into() },
            note: Some(note.chars().take(1024).collect()),
            action: "Sync".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &reference).await {
            debug!(error = %e, "cannot publish event");
        }
    }
}
