//! The parts of Services, EndpointSlices, Nodes and ServiceCIDRs nftproxy reads, as the API server and
//! manifests spell them. Everything else an object carries (managedFields, selectors,
//! targetRefs, …) is skipped while parsing, never allocated; an object is converted into the
//! model's values as soon as it is parsed (`convert`) and dropped.
//!
//! Field names follow k8s-openapi's types, and so does leniency: a field the API requires reads
//! as its default when missing or `null`, as k8s-openapi reads it.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};

/// A field the API requires, read as k8s-openapi reads it: missing or `null` is its default.
fn or_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// The metadata nftproxy reads.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Meta {
    pub name: Option<String>,
    pub namespace: Option<String>,
    pub labels: Option<BTreeMap<String, String>>,
    pub annotations: Option<BTreeMap<String, String>>,
    pub resource_version: Option<String>,
    pub deletion_timestamp: Option<String>,
}

/// A Service.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Service {
    #[serde(default)]
    pub metadata: Meta,
    pub spec: Option<ServiceSpec>,
    pub status: Option<ServiceStatus>,
}

/// `Service.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceSpec {
    #[serde(rename = "type")]
    pub type_: Option<String>,
    #[serde(rename = "clusterIP")]
    pub cluster_ip: Option<String>,
    #[serde(rename = "clusterIPs")]
    pub cluster_ips: Option<Vec<String>>,
    pub ip_families: Option<Vec<String>>,
    #[serde(rename = "externalIPs")]
    pub external_ips: Option<Vec<String>>,
    pub load_balancer_source_ranges: Option<Vec<String>>,
    pub external_traffic_policy: Option<String>,
    pub internal_traffic_policy: Option<String>,
    pub session_affinity: Option<String>,
    pub session_affinity_config: Option<SessionAffinityConfig>,
    pub health_check_node_port: Option<i32>,
    pub ports: Option<Vec<ServicePort>>,
}

/// `Service.spec.sessionAffinityConfig`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionAffinityConfig {
    #[serde(rename = "clientIP")]
    pub client_ip: Option<ClientIpConfig>,
}

/// `Service.spec.sessionAffinityConfig.clientIP`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientIpConfig {
    pub timeout_seconds: Option<i32>,
}

/// `Service.spec.ports[]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicePort {
    pub name: Option<String>,
    pub protocol: Option<String>,
    #[serde(default, deserialize_with = "or_default")]
    pub port: i32,
    pub node_port: Option<i32>,
}

/// `Service.status`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceStatus {
    pub load_balancer: Option<LoadBalancerStatus>,
}

/// `Service.status.loadBalancer`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct LoadBalancerStatus {
    pub ingress: Option<Vec<LoadBalancerIngress>>,
}

/// `Service.status.loadBalancer.ingress[]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerIngress {
    pub ip: Option<String>,
    pub ip_mode: Option<String>,
}

/// An EndpointSlice.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointSlice {
    #[serde(default)]
    pub metadata: Meta,
    #[serde(default, deserialize_with = "or_default")]
    pub address_type: String,
    pub ports: Option<Vec<EndpointPort>>,
    #[serde(default, deserialize_with = "or_default")]
    pub endpoints: Vec<Endpoint>,
}

/// `EndpointSlice.ports[]`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct EndpointPort {
    pub name: Option<String>,
    pub protocol: Option<String>,
    pub port: Option<i32>,
}

/// `EndpointSlice.endpoints[]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    #[serde(default, deserialize_with = "or_default")]
    pub addresses: Vec<String>,
    pub conditions: Option<EndpointConditions>,
    pub hints: Option<EndpointHints>,
    pub node_name: Option<String>,
    pub zone: Option<String>,
}

/// `EndpointSlice.endpoints[].conditions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct EndpointConditions {
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

/// `EndpointSlice.endpoints[].hints`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointHints {
    pub for_zones: Option<Vec<ForName>>,
    pub for_nodes: Option<Vec<ForName>>,
}

/// A zone or node a hint names.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ForName {
    #[serde(default, deserialize_with = "or_default")]
    pub name: String,
}

/// A Node.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Node {
    #[serde(default)]
    pub metadata: Meta,
    pub spec: Option<NodeSpec>,
    pub status: Option<NodeStatus>,
}

/// `Node.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSpec {
    #[serde(rename = "podCIDR")]
    pub pod_cidr: Option<String>,
    #[serde(rename = "podCIDRs")]
    pub pod_cidrs: Option<Vec<String>>,
    pub taints: Option<Vec<Taint>>,
}

/// `Node.spec.taints[]`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Taint {
    #[serde(default, deserialize_with = "or_default")]
    pub key: String,
}

/// `Node.status`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct NodeStatus {
    pub addresses: Option<Vec<NodeAddress>>,
}

/// `Node.status.addresses[]`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct NodeAddress {
    #[serde(rename = "type", default, deserialize_with = "or_default")]
    pub type_: String,
    #[serde(default, deserialize_with = "or_default")]
    pub address: String,
}

/// A ServiceCIDR (`networking.k8s.io/v1`): a range ClusterIPs are allocated from.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ServiceCidr {
    #[serde(default)]
    pub metadata: Meta,
    pub spec: Option<ServiceCidrSpec>,
}

/// `ServiceCIDR.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ServiceCidrSpec {
    /// At most two, one per family (the API server refuses more).
    pub cidrs: Option<Vec<String>>,
}

/// Objects with metadata.
pub trait HasMeta {
    /// The object's metadata.
    fn meta(&self) -> &Meta;
}

impl HasMeta for Service {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}

impl HasMeta for EndpointSlice {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}

impl HasMeta for Node {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}

impl HasMeta for ServiceCidr {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}
