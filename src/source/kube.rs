//! Services, EndpointSlices, this node's Node and the ServiceCIDRs from the Kubernetes API, with
//! kube-rs watchers.
//!
//! Like upstream kube-proxy: objects labelled `service.kubernetes.io/service-proxy-name` belong to
//! another proxy and EndpointSlices labelled `service.kubernetes.io/headless` to headless
//! services, so the API server filters both out. A list (the first one, or a relist after a
//! `410 Gone` or a reconnect) is delivered whole, so objects that disappeared while the watch was
//! down are removed. Errors are logged and retried with backoff; the reconciler keeps the last
//! programmed rules meanwhile.
//!
//! ServiceCIDRs (`networking.k8s.io/v1`, GA in 1.33) may be missing: an API server that does not
//! serve them (404) or a role that may not list them (403) counts as "no ServiceCIDRs" (logged
//! once), so the first sync is not held up, and the watch keeps retrying with backoff.

use std::borrow::Cow;
use std::sync::mpsc::Sender;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Event as K8sEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher::{self, Event as WatchEvent};
use kube::{Api, Client, Resource};
use serde::{Deserialize, Deserializer};
use thiserror::Error;
use tracing::{debug, error, info, warn};

use super::SourceEvent;
use crate::index::{Change, Kind, Update};
use crate::model::api::{EndpointSlice, HasMeta, Node, Service, ServiceCidr};
use crate::model::{NamespacedName, Problem};

/// Label selector for Services and EndpointSlices nftproxy proxies.
pub(crate) const SERVICE_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name";
/// Label selector for EndpointSlices.
pub(crate) const SLICE_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// Errors setting up the API client.
#[derive(Debug, Error)]
pub enum KubeSourceError {
    #[error("cannot read kubeconfig {path}: {source}")]
    Kubeconfig { path: String, source: kube::config::KubeconfigError },
    #[error("no Kubernetes configuration: not in a cluster and no --kubeconfig ({0})")]
    Infer(String),
    #[error("cannot create the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
    #[error("invalid --master {0:?}: expected a URL such as https://10.0.0.1:6443")]
    Master(String),
}

/// A client from `--kubeconfig`, or in-cluster (service account), or the usual inference;
/// `master` (kube-proxy's `--master`) replaces the server address. As upstream's
/// `createClient`: `--master` without a kubeconfig is that server alone (no in-cluster
/// credentials, no inference).
pub(crate) async fn client(kubeconfig: Option<&str>, master: Option<&str>) -> Result<Client, KubeSourceError> {
    let mut config = match (kubeconfig, master) {
        (None, Some(master)) => {
            kube::Config::new(master.parse().map_err(|_| KubeSourceError::Master(master.to_string()))?)
        }
        (Some(path), _) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|source| KubeSourceError::Kubeconfig { path: path.to_string(), source })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|source| KubeSourceError::Kubeconfig { path: path.to_string(), source })?
        }
        (None, None) => {
            let config = kube::Config::infer().await.map_err(|e| KubeSourceError::Infer(e.to_string()))?;
            if through_service_ip(|k| std::env::var(k).ok()) {
                THROUGH_SERVICE_IP.store(true, std::sync::atomic::Ordering::Relaxed);
                info!(
                    server = %config.cluster_url,
                    "the API server is reached through the kubernetes Service's ClusterIP, which only a service \
                     proxy's rules make reachable: on a node without them (a new node, after a reboot, no kube-proxy) \
                     set KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT to the API server's own address \
                     (docs/install.md#the-api-servers-address)"
                );
            }
            config
        }
    };
    if let Some(master) = master {
        config.cluster_url = master.parse().map_err(|_| KubeSourceError::Master(master.to_string()))?;
    }
    config.read_timeout = Some(READ_TIMEOUT);
    // A request's write restarts the clock: a connection idle in the pool for a minute still
    // gives a LIST its whole limit for the first byte (nftproxy has no exec or attach sessions,
    // whose pings would hide a dead peer).
    config.reset_reader_on_write = true;
    Ok(Client::try_from(config)?)
}

/// Set when the in-cluster API address is the `kubernetes` Service's ClusterIP (see
/// [`through_service_ip`]): a failing list then says how to give the real address.
static THROUGH_SERVICE_IP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the in-cluster configuration points at the `kubernetes` Service's ClusterIP: kubelet
/// sets `KUBERNETES_SERVICE_HOST` and `KUBERNETES_PORT_443_TCP_ADDR` to it in every container, and
/// a pod spec that gives the API server's own address overrides the first only.
fn through_service_ip(env: impl Fn(&str) -> Option<String>) -> bool {
    match (env("KUBERNETES_SERVICE_HOST"), env("KUBERNETES_PORT_443_TCP_ADDR")) {
        (Some(host), Some(service)) => !host.is_empty() && host == service,
        _ => false,
    }
}

/// The longest a connection may stay silent before it counts as dead and is replaced. The API
/// server sends every watch a bookmark about once a minute, so a live watch is never this
/// quiet; a watch whose peer vanished without a reset (a load balancer failing over, a node
/// cut off) is given up after this long rather than kube-rs's idle limit of the watch's whole
/// timeout (290 s + 5 s), and resumes from its last resource version. client-go's HTTP/2 pings
/// give up after about 45 s. An API server without a watch cache sends no bookmarks: there a
/// quiet watch is re-established every 75 s, from its last resource version.
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(75);

fn namespaced<K: HasMeta>(obj: &K) -> NamespacedName {
    let meta = obj.meta();
    NamespacedName::new(
        meta.namespace.clone().unwrap_or_else(|| "default".into()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// An object's change and problems, `None` for objects the source does not want.
type Convert<K, T> = Box<dyn Fn(&K) -> Option<(Change<T>, Vec<Problem>)> + Send>;
/// The change of a deletion.
type Deleted<K, T> = Box<dyn Fn(&K) -> Change<T> + Send>;

/// Turns one kind's API objects into index changes.
struct Converter<K, T> {
    convert: Convert<K, T>,
    deleted: Deleted<K, T>,
    wrap: fn(Change<T>) -> Update,
    /// The kind may be absent from the API server (404) or not granted (403): the first such
    /// list failure counts as an empty list.
    optional: bool,
}

/// The API resource of a kind, as RBAC rules name it.
fn resource_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Services => "services",
        Kind::EndpointSlices => "endpointslices.discovery.k8s.io",
        Kind::Nodes => "nodes",
        Kind::ServiceCidrs => "servicecidrs.networking.k8s.io",
    }
}

/// The HTTP status of a failed list, when the API server answered one.
fn list_status(e: &watcher::Error) -> Option<u16> {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(status)) => Some(status.code),
        _ => None,
    }
}

/// Watches one kind and sends its events, converted. Objects are parsed into the lean types of
/// [`crate::model::api`] (managedFields and everything else nftproxy does not read is skipped
/// while parsing), and during a (re)list only the converted values are kept until the list is
/// complete, never the API objects.
async fn watch_kind<K, T>(
    api: Api<Watched<K>>,
    config: watcher::Config,
    kind: Kind,
    tx: Sender<SourceEvent>,
    c: Converter<K, T>,
) where
    K: Clone + std::fmt::Debug + HasMeta + for<'de> Deserialize<'de> + Send + Sync + 'static,
    Watched<K>: Resource<DynamicType = ()>,
{
    let mut listing: Vec<T> = Vec::new();
    let mut problems: Vec<Problem> = Vec::new();
    let mut listed = false;
    let mut forbidden_said = false;
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    loop {
        let event = match stream.try_next().await {
            Ok(Some(ev)) => ev,
            Ok(None) => return,
            Err(e) => match list_status(&e) {
                Some(code @ (403 | 404)) if c.optional => {
                    if !listed {
                        listed = true;
                        let why = if code == 404 {
                            "the API server does not serve them"
                        } else {
                            "nftproxy's role may not list them (RBAC: list/watch servicecidrs)"
                        };
                        warn!(
                            ?kind,
                            code,
                            "no {kind:?}: {why}; traffic to unallocated ClusterIPs is not dropped (retrying with backoff)"
                        );
                        if tx.send(SourceEvent::Update((c.wrap)(Change::Reset(Vec::new())))).is_err() {
                            return;
                        }
                    } else {
                        debug!(?kind, code, "still no list");
                    }
                    continue;
                }
                Some(403) => {
                    // A missing RBAC rule will not fix itself: said as an error, once, naming it.
                    if !forbidden_said {
                        forbidden_said = true;
                        error!(
                            ?kind,
                            error = %e,
                            "forbidden: nftproxy's identity may not list and watch {}; grant `list` and `watch` on it in the ClusterRole bound to it (deploy/rbac.yaml; kube-proxy's system:node-proxier has them); retrying with backoff",
                            resource_name(kind)
                        );
                    } else {
                        debug!(?kind, "still forbidden");
                    }
                    continue;
                }
                _ => {
                    if !listed && THROUGH_SERVICE_IP.load(std::sync::atomic::Ordering::Relaxed) {
                        warn!(
                            ?kind,
                            error = %e,
                            "cannot list through the kubernetes Service's ClusterIP; if no service proxy serves it \
                             on this node yet, set KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT to the API \
                             server's own address (docs/install.md#the-api-servers-address); retrying with backoff"
                        );
                    } else {
                        warn!(?kind, error = %e, "watch failed; retrying with backoff (rules stay as they are)");
                    }
                    continue;
                }
            },
        };
        let mut out = Vec::new();
        match event {
            WatchEvent::Init => {
                listing.clear();
                problems.clear();
            }
            WatchEvent::InitApply(obj) => {
                if let Some((change, found)) = (c.convert)(&obj.object) {
                    problems.extend(found);
                    if let Change::Apply(value) = change {
                        listing.push(value);
                    }
                }
            }
            WatchEvent::InitDone => {
                if listed {
                    // The watch could not resume (410 Gone after a compaction, a restarted API
                    // server): the list replaces everything.
                    info!(?kind, objects = listing.len(), "listed again");
                } else {
                    debug!(?kind, "list complete");
                }
                listed = true;
                out.push(SourceEvent::Problems(std::mem::take(&mut problems)));
                out.push(SourceEvent::Update((c.wrap)(Change::Reset(std::mem::take(&mut listing)))));
            }
            WatchEvent::Apply(obj) => {
                if let Some((change, found)) = (c.convert)(&obj.object) {
                    out.push(SourceEvent::Problems(found));
                    out.push(SourceEvent::Update((c.wrap)(change)));
                }
            }
            WatchEvent::Delete(obj) => out.push(SourceEvent::Update((c.wrap)((c.deleted)(&obj.object)))),
        }
        for e in out {
            if tx.send(e).is_err() {
                return;
            }
        }
    }
}

/// Starts the four watchers on the current tokio runtime.
pub(crate) fn spawn_watchers(client: Client, hostname: &str, tx: Sender<SourceEvent>) {
    let services: Api<Watched<Service>> = Api::all(client.clone());
    let slices: Api<Watched<EndpointSlice>> = Api::all(client.clone());
    let nodes: Api<Watched<Node>> = Api::all(client.clone());
    let service_cidrs: Api<Watched<ServiceCidr>> = Api::all(client);
    tokio::spawn(watch_kind(
        services,
        watcher::Config::default().labels(SERVICE_SELECTOR),
        Kind::Services,
        tx.clone(),
        Converter {
            convert: Box::new(|s: &Service| Some(super::service_change(s))),
            deleted: Box::new(|s: &Service| Change::Delete(namespaced(s))),
            wrap: Update::Service,
            optional: false,
        },
    ));
    tokio::spawn(watch_kind(
        slices,
        watcher::Config::default().labels(SLICE_SELECTOR),
        Kind::EndpointSlices,
        tx.clone(),
        Converter {
            convert: Box::new(|s: &EndpointSlice| Some(super::slice_change(s))),
            deleted: Box::new(|s: &EndpointSlice| Change::Delete(namespaced(s))),
            wrap: Update::EndpointSlice,
            optional: false,
        },
    ));
    let node_selector = format!("metadata.name={hostname}");
    let name = hostname.to_string();
    let gone = hostname.to_string();
    tokio::spawn(watch_kind(
        nodes,
        watcher::Config::default().fields(&node_selector),
        Kind::Nodes,
        tx.clone(),
        Converter {
            convert: Box::new(move |n: &Node| super::node_change(n, &name)),
            deleted: Box::new(move |_: &Node| Change::Delete(NamespacedName::new("", gone.as_str()))),
            wrap: Update::Node,
            optional: false,
        },
    ));
    tokio::spawn(watch_kind(
        service_cidrs,
        watcher::Config::default(),
        Kind::ServiceCidrs,
        tx,
        Converter {
            convert: Box::new(|c: &ServiceCidr| Some(super::service_cidr_change(c))),
            deleted: Box::new(|c: &ServiceCidr| Change::Delete(NamespacedName::new("", namespaced(c).name))),
            wrap: Update::ServiceCidr,
            optional: true,
        },
    ));
    info!("watching Services, EndpointSlices, this Node and ServiceCIDRs");
}

/// Something the agent reports as a Kubernetes Event.
#[derive(Debug, Clone)]
pub(crate) enum Notice {
    /// An object or field that cannot be programmed (`NotProgrammed` / `FieldIgnored`, once
    /// per problem).
    Problem(Problem),
    /// A health-check node port that could not be opened: upstream's Warning
    /// `FailedToStartServiceHealthcheck` on the Service, sent at every sync until it opens.
    HealthCheckBindFailed { service: NamespacedName, port: u16, error: String },
    /// An Event on this node's Node with upstream's reason and action `StartKubeProxy`:
    /// Normal `Starting`; Warning `FailedToStartProxierHealthcheck`, `FailedToStartMetricServer`.
    NodeEvent { warning: bool, reason: &'static str, note: String },
}

/// Publishes Kubernetes Events (events.k8s.io/v1) for what the agent reports.
pub(crate) struct EventPublisher {
    recorder: Recorder,
    hostname: String,
    sent: std::collections::HashSet<String>,
}

impl EventPublisher {
    /// A publisher reporting as `nftproxy` on `hostname`.
    pub(crate) fn new(client: Client, hostname: &str) -> EventPublisher {
        let reporter = Reporter { controller: "nftproxy".into(), instance: Some(hostname.to_string()) };
        EventPublisher {
            recorder: Recorder::new(client, reporter),
            hostname: hostname.to_string(),
            sent: Default::default(),
        }
    }

    /// Publishes the Event of `notice` (a problem only once).
    pub(crate) async fn publish(&mut self, notice: &Notice) {
        let (reference, event) = match notice {
            Notice::Problem(problem) => {
                if !self.sent.insert(problem.to_string()) {
                    return;
                }
                problem_event(problem)
            }
            Notice::HealthCheckBindFailed { service, port, error } => {
                health_check_event(&self.hostname, service, *port, error)
            }
            Notice::NodeEvent { warning, reason, note } => node_event(&self.hostname, *warning, reason, note),
        };
        if let Err(e) = self.recorder.publish(&event, &reference).await {
            debug!(error = %e, "cannot publish event");
        }
    }
}

fn problem_event(problem: &Problem) -> (ObjectReference, K8sEvent) {
    let kind = problem.object.kind;
    let reference = ObjectReference {
        api_version: Some(kind.api_version().into()),
        kind: Some(kind.name().into()),
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
    (reference, event)
}

/// Upstream's event for a health-check port: regarding the Service (its UID is the namespaced
/// name, as upstream sets it), Warning, reason `FailedToStartServiceHealthcheck`, action
/// `Listen`, note `node <node> failed to start healthcheck "<ns>/<name>" on port <port>: <err>`.
pub(crate) fn health_check_event(
    node: &str,
    service: &NamespacedName,
    port: u16,
    error: &str,
) -> (ObjectReference, K8sEvent) {
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        name: Some(service.name.clone()),
        namespace: Some(service.namespace.clone()),
        uid: Some(service.to_string()),
        ..Default::default()
    };
    let event = K8sEvent {
        type_: EventType::Warning,
        reason: "FailedToStartServiceHealthcheck".into(),
        note: Some(format!("node {node} failed to start healthcheck \"{service}\" on port {port}: {error}")),
        action: "Listen".into(),
        secondary: None,
    };
    (reference, event)
}

/// An Event on this node's Node (UID: the node's name, as upstream's NodeRef).
fn node_event(node: &str, warning: bool, reason: &str, note: &str) -> (ObjectReference, K8sEvent) {
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.to_string()),
        uid: Some(node.to_string()),
        ..Default::default()
    };
    let event = K8sEvent {
        type_: if warning { EventType::Warning } else { EventType::Normal },
        reason: reason.to_string(),
        note: Some(note.chars().take(1024).collect()),
        action: "StartKubeProxy".into(),
        secondary: None,
    };
    (reference, event)
}

/// A lean object as kube-rs watches it: the object, and the metadata kube-rs keeps track of
/// (name, namespace, resourceVersion).
#[derive(Debug, Clone)]
pub(crate) struct Watched<T> {
    pub(crate) object: T,
    meta: ObjectMeta,
}

impl<'de, T: Deserialize<'de> + HasMeta> Deserialize<'de> for Watched<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let object = T::deserialize(deserializer)?;
        let m = object.meta();
        let meta = ObjectMeta {
            name: m.name.clone(),
            namespace: m.namespace.clone(),
            resource_version: m.resource_version.clone(),
            ..ObjectMeta::default()
        };
        Ok(Watched { object, meta })
    }
}

/// `kube::Resource` for a lean type: its API group, version, kind and plural, as k8s-openapi
/// gives them for the full type.
macro_rules! watched_resource {
    ($lean:ty, $full:ty, $scope:ty) => {
        impl kube::Resource for Watched<$lean> {
            type DynamicType = ();
            type Scope = $scope;

            fn kind(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(<$full as k8s_openapi::Resource>::KIND)
            }
            fn group(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(<$full as k8s_openapi::Resource>::GROUP)
            }
            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(<$full as k8s_openapi::Resource>::VERSION)
            }
            fn plural(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(<$full as k8s_openapi::Resource>::URL_PATH_SEGMENT)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.meta
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.meta
            }
        }
    };
}

watched_resource!(Service, k8s_openapi::api::core::v1::Service, k8s_openapi::NamespaceResourceScope);
watched_resource!(EndpointSlice, k8s_openapi::api::discovery::v1::EndpointSlice, k8s_openapi::NamespaceResourceScope);
watched_resource!(Node, k8s_openapi::api::core::v1::Node, k8s_openapi::ClusterResourceScope);
watched_resource!(ServiceCidr, k8s_openapi::api::networking::v1::ServiceCIDR, k8s_openapi::ClusterResourceScope);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_ip_is_told_from_an_address_given_in_the_pod_spec() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let kubelets = &[("KUBERNETES_SERVICE_HOST", "10.96.0.1"), ("KUBERNETES_PORT_443_TCP_ADDR", "10.96.0.1")];
        assert!(through_service_ip(env(kubelets)));
        let given = &[("KUBERNETES_SERVICE_HOST", "192.168.50.100"), ("KUBERNETES_PORT_443_TCP_ADDR", "10.96.0.1")];
        assert!(!through_service_ip(env(given)));
        assert!(!through_service_ip(env(&[("KUBERNETES_SERVICE_HOST", "10.96.0.1")])));
    }
}
