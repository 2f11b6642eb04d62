//! Kubernetes API objects → model values, validating every field nftproxy uses.
//!
//! Upstream kube-proxy's rules: headless and ExternalName services, and objects labelled
//! `service.kubernetes.io/service-proxy-name` (owned by another proxy), are not ours. A field
//! that cannot be used (an unparsable IP, a port out of range, an unknown protocol) is skipped
//! with a [`Problem`]; only an object with an invalid name, a Service without a usable ClusterIP,
//! or a slice without a service, is skipped whole. What the API server would have refused (an
//! address of another family than `spec.ipFamilies` says, a repeated port name) can still come
//! from manifests: it is reported and skipped the same way, the first of duplicates kept.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use super::api;
use ipnet::IpNet;

use super::*;

/// Label naming the proxy that owns an object (upstream skips labelled objects).
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label of EndpointSlices of headless services.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label tying an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Annotation with the time the endpoints change was triggered.
pub const ANNOTATION_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// Default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_SECS: u32 = 10800;
/// Largest timeout the API server accepts.
pub const MAX_AFFINITY_SECS: u32 = 86400;

/// Result of converting one object: the value (if any part is usable) and its problems.
#[derive(Debug)]
pub struct Converted<T> {
    pub value: Option<T>,
    pub problems: Vec<Problem>,
}

struct Checker {
    object: ObjectRef,
    problems: Vec<Problem>,
}

impl Checker {
    fn field(&mut self, field: impl Into<String>, reason: impl Into<String>) {
        self.problems.push(Problem {
            object: self.object.clone(),
            field: field.into(),
            reason: reason.into(),
            object_skipped: false,
        });
    }

    fn skip<T>(mut self, field: impl Into<String>, reason: impl Into<String>) -> Converted<T> {
        self.problems.push(Problem {
            object: self.object.clone(),
            field: field.into(),
            reason: reason.into(),
            object_skipped: true,
        });
        Converted { value: None, problems: self.problems }
    }

    fn done<T>(self, value: Option<T>) -> Converted<T> {
        Converted { value, problems: self.problems }
    }
}

/// Longest DNS-1123 label.
pub const LABEL_MAX: usize = 63;
/// Longest DNS-1123 subdomain.
pub const SUBDOMAIN_MAX: usize = 253;

/// What breaks the DNS-1123 label rules in `s`, if anything: "is empty", "is 64 bytes long",
/// "contains 'é'", "starts or ends with '-'".
fn label_fault(s: &str) -> Option<String> {
    if s.is_empty() {
        return Some("is empty".into());
    }
    if s.len() > LABEL_MAX {
        return Some(format!("is {} bytes long", s.len()));
    }
    if let Some(ch) = s.chars().find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')) {
        return Some(format!("contains {ch:?}"));
    }
    if s.starts_with('-') || s.ends_with('-') {
        return Some("starts or ends with '-'".into());
    }
    None
}

/// Why `s` is not a DNS-1123 label, if it is not one.
pub fn label_error(s: &str) -> Option<String> {
    label_fault(s).map(|fault| {
        format!(
            "{fault}: a DNS-1123 label is 1-{LABEL_MAX} lower-case ASCII letters, digits or '-', starting and \
             ending with a letter or digit"
        )
    })
}

/// Why `s` is not a DNS-1123 subdomain (dot-separated labels, at most 253 bytes), if it is not.
pub fn subdomain_error(s: &str) -> Option<String> {
    let fault = if s.len() > SUBDOMAIN_MAX {
        Some(format!("is {} bytes long", s.len()))
    } else {
        s.split('.')
            .find_map(|part| label_fault(part).map(|f| if part == s { f } else { format!("has a part that {f}") }))
    };
    fault.map(|fault| {
        format!(
            "{fault}: a DNS-1123 subdomain is at most {SUBDOMAIN_MAX} bytes of dot-separated labels, each 1-{LABEL_MAX} \
             lower-case ASCII letters, digits or '-'"
        )
    })
}

fn parse_ip(s: &str) -> Option<IpAddr> {
    s.trim().parse().ok()
}

fn port_number(n: i32) -> Option<u16> {
    u16::try_from(n).ok().filter(|p| *p != 0)
}

/// `spec.ipFamilies`, one entry per ClusterIP (`None` for an unknown family, reported).
fn ip_families(spec: &api::ServiceSpec, c: &mut Checker) -> Vec<Option<IpFamily>> {
    let mut out = Vec::new();
    for (i, raw) in spec.ip_families.iter().flatten().enumerate() {
        out.push(match raw.as_str() {
            "IPv4" => Some(IpFamily::V4),
            "IPv6" => Some(IpFamily::V6),
            other => {
                c.field(format!("spec.ipFamilies[{i}]"), format!("unknown IP family {other:?}"));
                None
            }
        });
    }
    out
}

fn has_label(labels: &Option<BTreeMap<String, String>>, key: &str) -> bool {
    labels.as_ref().is_some_and(|l| l.contains_key(key))
}

/// Converts a Service. `Ok(None)`-like results (headless, ExternalName, another proxy's) come
/// back with no value and no problems.
pub fn service(svc: &api::Service) -> Converted<ServiceInfo> {
    let meta = &svc.metadata;
    let namespace = meta.namespace.clone().unwrap_or_else(|| "default".to_string());
    let name = meta.name.clone().unwrap_or_default();
    let mut c = Checker {
        object: ObjectRef { kind: ObjectKind::Service, namespace: Some(namespace.clone()), name: name.clone() },
        problems: Vec::new(),
    };
    // Both end up in nftables object names and comments: anything else is refused here.
    if let Some(e) = label_error(&namespace) {
        return c.skip("metadata.namespace", e);
    }
    if let Some(e) = label_error(&name) {
        return c.skip("metadata.name", e);
    }
    if has_label(&meta.labels, LABEL_SERVICE_PROXY_NAME) {
        return c.done(None);
    }
    let Some(spec) = &svc.spec else { return c.skip("spec", "missing") };
    let svc_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    if svc_type == "ExternalName" {
        return c.done(None);
    }
    if !matches!(svc_type, "ClusterIP" | "NodePort" | "LoadBalancer") {
        return c.skip("spec.type", format!("unknown service type {svc_type:?}"));
    }

    // `clusterIPs` when set (its first entry is `clusterIP`), else `clusterIP`; the field name
    // goes into problems as the user wrote it.
    let (ips_field, raw_ips): (&str, Vec<&str>) = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ("spec.clusterIPs", ips.iter().map(String::as_str).collect()),
        _ => ("spec.clusterIP", spec.cluster_ip.as_deref().into_iter().collect()),
    };
    if raw_ips.is_empty() || raw_ips.iter().any(|ip| ip.trim().is_empty() || *ip == "None") {
        return c.done(None); // headless: no ClusterIP, nothing to proxy
    }
    if ips_field == "spec.clusterIPs"
        && let Some(single) = spec.cluster_ip.as_deref()
        && !single.is_empty()
        && single != raw_ips[0]
    {
        c.field(
            "spec.clusterIP",
            format!("{single:?} differs from spec.clusterIPs[0] {:?}; using clusterIPs", raw_ips[0]),
        );
    }
    let families = ip_families(spec, &mut c);
    let mut cluster_ips: Vec<IpAddr> = Vec::new();
    for (i, raw) in raw_ips.iter().enumerate() {
        let field = if ips_field == "spec.clusterIP" { ips_field.to_string() } else { format!("{ips_field}[{i}]") };
        match parse_ip(raw) {
            // `ipFamilies[i]` is the family of `clusterIPs[i]` (upstream picks the address by
            // it): an address of the other family would end up in the wrong table.
            Some(ip) if families.get(i).copied().flatten().is_some_and(|f| f != IpFamily::of(&ip)) => {
                let declared = families.get(i).copied().flatten().map_or("", IpFamily::k8s_name);
                c.field(
                    field,
                    format!("{raw:?} is an {} address, but spec.ipFamilies[{i}] is {declared}", IpFamily::of(&ip)),
                );
            }
            Some(ip) if cluster_ips.iter().any(|x| IpFamily::of(x) == IpFamily::of(&ip)) => {
                c.field(field, format!("second {} ClusterIP {raw:?}", IpFamily::of(&ip)));
            }
            Some(ip) if ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() => {
                c.field(field, format!("{raw:?} cannot be a ClusterIP"));
            }
            Some(ip) => cluster_ips.push(ip),
            None => c.field(field, format!("invalid IP address {raw:?}")),
        }
    }
    if cluster_ips.is_empty() {
        return c.skip(ips_field, "no valid ClusterIP");
    }
    let has_family = |ip: &IpAddr| cluster_ips.iter().any(|x| IpFamily::of(x) == IpFamily::of(ip));
    let other_family = |ip: &IpAddr| {
        format!("{ip} is an {} address, but the Service has no {} ClusterIP", IpFamily::of(ip), IpFamily::of(ip))
    };

    let externally = svc_type == "NodePort" || svc_type == "LoadBalancer";
    let mut external_ips = Vec::new();
    for (i, raw) in spec.external_ips.iter().flatten().enumerate() {
        match parse_ip(raw) {
            // Upstream proxies an address only in its family's table, and only when the Service
            // has a ClusterIP there: an IPv6 address on an IPv4-only Service does nothing.
            Some(ip) if !has_family(&ip) => c.field(format!("spec.externalIPs[{i}]"), other_family(&ip)),
            Some(ip) if !ip.is_unspecified() && !ip.is_loopback() && !ip.is_multicast() => external_ips.push(ip),
            _ => c.field(format!("spec.externalIPs[{i}]"), format!("invalid external IP {raw:?}")),
        }
    }
    let mut load_balancer_ips = Vec::new();
    if svc_type == "LoadBalancer" {
        let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|lb| lb.ingress.as_ref());
        for (i, ing) in ingress.into_iter().flatten().enumerate() {
            let Some(raw) = ing.ip.as_deref() else { continue };
            // ipMode Proxy: the load balancer delivers to the node itself; capturing the VIP
            // would bypass it.
            if ing.ip_mode.as_deref() == Some("Proxy") {
                continue;
            }
            match parse_ip(raw) {
                Some(ip) if !has_family(&ip) => {
                    c.field(format!("status.loadBalancer.ingress[{i}].ip"), other_family(&ip));
                }
                Some(ip) if !ip.is_unspecified() && !ip.is_loopback() => load_balancer_ips.push(ip),
                _ => c.field(format!("status.loadBalancer.ingress[{i}].ip"), format!("invalid IP {raw:?}")),
            }
        }
    }
    // Ranges of a family the Service has no ClusterIP in are kept and unused, without a
    // problem: one list for both families is the usual way to write them (as upstream).
    let mut source_ranges = Vec::new();
    for (i, raw) in spec.load_balancer_source_ranges.iter().flatten().enumerate() {
        match raw.trim().parse::<IpNet>() {
            Ok(net) => source_ranges.push(net.trunc()),
            Err(_) => c.field(format!("spec.loadBalancerSourceRanges[{i}]"), format!("invalid CIDR {raw:?}")),
        }
    }

    let external_policy_local = spec.external_traffic_policy.as_deref() == Some("Local");
    let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let session_affinity_secs = match spec.session_affinity.as_deref() {
        Some("ClientIP") => {
            let raw = spec
                .session_affinity_config
                .as_ref()
                .and_then(|cfg| cfg.client_ip.as_ref())
                .and_then(|cip| cip.timeout_seconds);
            match raw {
                None => Some(DEFAULT_AFFINITY_SECS),
                Some(t) if t >= 1 && (t as u32) <= MAX_AFFINITY_SECS => Some(t as u32),
                Some(t) => {
                    c.field(
                        "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                        format!("{t} is outside 1..{MAX_AFFINITY_SECS}; using {DEFAULT_AFFINITY_SECS}"),
                    );
                    Some(DEFAULT_AFFINITY_SECS)
                }
            }
        }
        None | Some("None") => None,
        Some(other) => {
            c.field("spec.sessionAffinity", format!("unknown affinity {other:?}"));
            None
        }
    };
    let health_check_node_port = if svc_type == "LoadBalancer" && external_policy_local {
        match spec.health_check_node_port {
            Some(p) => {
                let port = port_number(p);
                if port.is_none() {
                    c.field("spec.healthCheckNodePort", format!("{p} is not a valid port"));
                }
                port
            }
            None => None,
        }
    } else {
        None
    };

    let svc_name = NamespacedName::new(namespace, name);
    // Exact capacities here and below: 44,000 one-port Services would otherwise hold room for
    // three more ports each (a Vec's first allocation is four).
    let mut ports: Vec<ServicePort> = Vec::with_capacity(spec.ports.as_ref().map_or(0, Vec::len));
    // What the API server keeps unique among a Service's ports (each with the index of the port
    // that has it): names, (protocol, port) and (protocol, nodePort). From manifests the first
    // usable port keeps it and later ones are reported, as the API server would have refused
    // them; maps rather than scans, as a Service may have thousands of ports.
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut numbers: HashMap<(L4Proto, u16), usize> = HashMap::new();
    let mut node_ports: HashMap<(L4Proto, u16), usize> = HashMap::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let field = format!("spec.ports[{i}]");
        let port_name = p.name.clone().unwrap_or_default();
        // A Service's port names are DNS-1123 labels, as the API server validates them (up to
        // 63 bytes); the 15-byte IANA service name is the rule for a container's port names.
        if !port_name.is_empty()
            && let Some(e) = label_error(&port_name)
        {
            c.field(format!("{field}.name"), format!("invalid port name {port_name:?}: {e}"));
            continue;
        }
        if let Some(first) = names.get(&port_name) {
            c.field(
                format!("{field}.name"),
                format!("duplicate port name {port_name:?} (first in spec.ports[{first}])"),
            );
            continue;
        }
        let protocol = match p.protocol.as_deref().map_or(Some(L4Proto::Tcp), L4Proto::from_k8s) {
            Some(proto) => proto,
            None => {
                c.field(
                    format!("{field}.protocol"),
                    format!("unknown protocol {:?}", p.protocol.as_deref().unwrap_or("")),
                );
                continue;
            }
        };
        let Some(port) = port_number(p.port) else {
            c.field(format!("{field}.port"), format!("{} is not a valid port (1-65535)", p.port));
            continue;
        };
        if let Some(first) = numbers.get(&(protocol, port)) {
            c.field(
                format!("{field}.port"),
                format!("duplicate port {port}/{protocol} (first in spec.ports[{first}])"),
            );
            continue;
        }
        let node_port = match p.node_port {
            Some(np) if externally => match port_number(np) {
                Some(np) => match node_ports.get(&(protocol, np)) {
                    // The port itself stays: only its NodePort is someone else's.
                    Some(first) => {
                        c.field(
                            format!("{field}.nodePort"),
                            format!("duplicate NodePort {np}/{protocol} (first in spec.ports[{first}])"),
                        );
                        None
                    }
                    None => Some(np),
                },
                None => {
                    c.field(format!("{field}.nodePort"), format!("{np} is not a valid port"));
                    None
                }
            },
            _ => None,
        };
        names.insert(port_name.clone(), i);
        numbers.insert((protocol, port), i);
        if let Some(np) = node_port {
            node_ports.insert((protocol, np), i);
        }
        let spn = ServicePortName { service: svc_name.clone(), port: port_name, protocol };
        ports.push(ServicePort {
            name: spn,
            cluster_ips: cluster_ips.clone(),
            port,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            load_balancer_source_ranges: source_ranges.clone(),
            external_policy_local,
            internal_policy_local,
            session_affinity_secs,
            health_check_node_port,
        });
    }
    ports.shrink_to_fit();
    c.done(Some(ServiceInfo { name: svc_name, ports }))
}

/// Converts an EndpointSlice.
pub fn endpoint_slice(slice: &api::EndpointSlice) -> Converted<EndpointSliceInfo> {
    let meta = &slice.metadata;
    let namespace = meta.namespace.clone().unwrap_or_else(|| "default".to_string());
    let name = meta.name.clone().unwrap_or_default();
    let mut c = Checker {
        object: ObjectRef { kind: ObjectKind::EndpointSlice, namespace: Some(namespace.clone()), name: name.clone() },
        problems: Vec::new(),
    };
    if let Some(e) = label_error(&namespace) {
        return c.skip("metadata.namespace", e);
    }
    if let Some(e) = subdomain_error(&name) {
        return c.skip("metadata.name", e);
    }
    if has_label(&meta.labels, LABEL_SERVICE_PROXY_NAME) || has_label(&meta.labels, LABEL_HEADLESS) {
        return c.done(None);
    }
    let Some(service) = meta.labels.as_ref().and_then(|l| l.get(LABEL_SERVICE_NAME)).cloned() else {
        return c.skip(format!("metadata.labels[{LABEL_SERVICE_NAME}]"), "missing: the slice belongs to no Service");
    };
    if let Some(e) = label_error(&service) {
        return c.skip(format!("metadata.labels[{LABEL_SERVICE_NAME}]"), format!("not a Service name: {e}"));
    }
    let family = match slice.address_type.as_str() {
        "IPv4" => IpFamily::V4,
        "IPv6" => IpFamily::V6,
        "FQDN" => return c.done(None),
        other => return c.skip("addressType", format!("unknown address type {other:?}")),
    };

    let mut ports = Vec::with_capacity(slice.ports.as_ref().map_or(0, Vec::len));
    // Port names are unique in a slice (the API server refuses duplicates): the first keeps it.
    let mut names: HashMap<String, usize> = HashMap::new();
    for (i, p) in slice.ports.iter().flatten().enumerate() {
        let field = format!("ports[{i}]");
        let port_name = p.name.clone().unwrap_or_default();
        if !port_name.is_empty()
            && let Some(e) = label_error(&port_name)
        {
            c.field(format!("{field}.name"), format!("invalid port name: {e}"));
            continue;
        }
        if let Some(first) = names.get(&port_name) {
            c.field(format!("{field}.name"), format!("duplicate port name {port_name:?} (first in ports[{first}])"));
            continue;
        }
        let protocol = match p.protocol.as_deref().map_or(Some(L4Proto::Tcp), L4Proto::from_k8s) {
            Some(proto) => proto,
            None => {
                c.field(
                    format!("{field}.protocol"),
                    format!("unknown protocol {:?}", p.protocol.as_deref().unwrap_or("")),
                );
                continue;
            }
        };
        let Some(port) = p.port.and_then(port_number) else {
            let reason = match p.port {
                Some(n) => format!("{n} is not a valid port (1-65535)"),
                None => "missing".to_string(),
            };
            c.field(format!("{field}.port"), reason);
            continue;
        };
        names.insert(port_name.clone(), i);
        ports.push((port_name, protocol, port));
    }

    let mut endpoints = Vec::with_capacity(slice.endpoints.len());
    for (i, ep) in slice.endpoints.iter().enumerate() {
        let field = format!("endpoints[{i}].addresses");
        // Upstream uses the first address only.
        let Some(raw) = ep.addresses.first() else {
            c.field(field, "no address");
            continue;
        };
        let ip = match parse_ip(raw) {
            Some(ip) if IpFamily::of(&ip) == family && !ip.is_unspecified() && !ip.is_multicast() => ip,
            Some(_) => {
                c.field(field, format!("{raw:?} is not a usable {family} address"));
                continue;
            }
            None => {
                c.field(field, format!("invalid IP address {raw:?}"));
                continue;
            }
        };
        let cond = ep.conditions.clone().unwrap_or_default();
        let ready = cond.ready.unwrap_or(true);
        let hints = ep.hints.as_ref();
        endpoints.push(SliceEndpoint {
            ip,
            ready,
            serving: cond.serving.unwrap_or(ready),
            terminating: cond.terminating.unwrap_or(false),
            node_name: ep.node_name.clone(),
            zone: ep.zone.clone(),
            zone_hints: hints
                .and_then(|h| h.for_zones.as_ref())
                .map(|z| z.iter().map(|z| z.name.clone()).collect())
                .unwrap_or_default(),
            node_hints: hints
                .and_then(|h| h.for_nodes.as_ref())
                .map(|n| n.iter().map(|n| n.name.clone()).collect())
                .unwrap_or_default(),
        });
    }
    ports.shrink_to_fit();
    endpoints.shrink_to_fit();
    let trigger_time = meta.annotations.as_ref().and_then(|a| a.get(ANNOTATION_TRIGGER_TIME)).cloned();
    c.done(Some(EndpointSliceInfo {
        name: NamespacedName::new(namespace.clone(), name),
        service: NamespacedName::new(namespace, service),
        family,
        ports,
        endpoints,
        trigger_time,
    }))
}

/// Converts a Node.
pub fn node(node: &api::Node) -> Converted<NodeInfo> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let mut c = Checker {
        object: ObjectRef { kind: ObjectKind::Node, namespace: None, name: name.clone() },
        problems: Vec::new(),
    };
    if let Some(e) = subdomain_error(&name) {
        return c.skip("metadata.name", e);
    }
    // Upstream's GetNodeHostIPs: InternalIPs first, then ExternalIPs.
    let mut host_ips = Vec::new();
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for kind in ["InternalIP", "ExternalIP"] {
        for (i, addr) in addresses.into_iter().flatten().enumerate() {
            if addr.type_ != kind {
                continue;
            }
            match parse_ip(&addr.address) {
                Some(ip) => host_ips.push(ip),
                None => c.field(format!("status.addresses[{i}]"), format!("invalid IP {:?}", addr.address)),
            }
        }
    }
    let mut pod_cidrs = Vec::new();
    let spec = node.spec.as_ref();
    let raw_cidrs: Vec<&String> = match spec.and_then(|s| s.pod_cidrs.as_ref()) {
        Some(v) if !v.is_empty() => v.iter().collect(),
        _ => spec.and_then(|s| s.pod_cidr.as_ref()).into_iter().collect(),
    };
    for (i, raw) in raw_cidrs.into_iter().enumerate() {
        match raw.trim().parse::<IpNet>() {
            Ok(n) => pod_cidrs.push(n.trunc()),
            Err(_) => c.field(format!("spec.podCIDRs[{i}]"), format!("invalid CIDR {raw:?}")),
        }
    }
    let tainted = spec
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == "ToBeDeletedByClusterAutoscaler"));
    c.done(Some(NodeInfo {
        name,
        labels: node.metadata.labels.clone().unwrap_or_default(),
        host_ips,
        pod_cidrs,
        being_deleted: node.metadata.deletion_timestamp.is_some() || tainted,
    }))
}

/// Converts a ServiceCIDR. As the API server validates them: one CIDR per family (so two at most);
/// a CIDR that cannot be used (unparsable, a second one of a family, host bits set, or a `/0`
/// that would take in every address) is skipped alone with a problem, the rest kept.
pub fn service_cidr(obj: &api::ServiceCidr) -> Converted<ServiceCidrInfo> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let mut c = Checker {
        object: ObjectRef { kind: ObjectKind::ServiceCidr, namespace: None, name: name.clone() },
        problems: Vec::new(),
    };
    if let Some(e) = subdomain_error(&name) {
        return c.skip("metadata.name", e);
    }
    let raw = obj.spec.as_ref().and_then(|s| s.cidrs.as_ref());
    let Some(raw) = raw.filter(|r| !r.is_empty()) else { return c.skip("spec.cidrs", "missing: at least one CIDR") };
    let mut cidrs: Vec<IpNet> = Vec::new();
    for (i, text) in raw.iter().enumerate() {
        let field = format!("spec.cidrs[{i}]");
        let net = match text.trim().parse::<IpNet>() {
            Ok(net) => net,
            Err(_) => {
                c.field(field, format!("invalid CIDR {text:?}"));
                continue;
            }
        };
        let family = IpFamily::of_net(&net);
        if let Some(first) = cidrs.iter().position(|n| IpFamily::of_net(n) == family) {
            c.field(
                field,
                format!(
                    "second {family} CIDR {text:?} (a ServiceCIDR holds one per family; first in spec.cidrs[{first}])"
                ),
            );
            continue;
        }
        if net.prefix_len() == 0 {
            c.field(field, format!("{text:?} covers every {family} address"));
            continue;
        }
        if net.trunc() != net {
            c.field(field, format!("{text:?} has host bits set (the range is {})", net.trunc()));
            continue;
        }
        cidrs.push(net);
    }
    if cidrs.is_empty() {
        return c.skip("spec.cidrs", "no usable CIDR");
    }
    c.done(Some(ServiceCidrInfo { name, cidrs }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_cidrs_keep_one_good_range_per_family() {
        let parse = |yaml: &str| service_cidr(&serde_yaml_ng::from_str::<api::ServiceCidr>(yaml).unwrap());
        let c = parse("metadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16, \"fd00:96::/112\"]}\n");
        assert_eq!(c.value.unwrap().cidrs.len(), 2);
        assert!(c.problems.is_empty());

        let c = parse("metadata: {name: extra}\nspec: {cidrs: [10.96.0.0/16, 10.97.0.0/16]}\n");
        assert_eq!(c.value.unwrap().cidrs, vec!["10.96.0.0/16".parse::<IpNet>().unwrap()]);
        assert_eq!(c.problems.len(), 1);
        assert_eq!(c.problems[0].field, "spec.cidrs[1]");
        assert!(c.problems[0].reason.contains("second IPv4"), "{:?}", c.problems);

        for (bad, why) in [("10.96.0.1/16", "host bits"), ("bogus", "invalid CIDR"), ("0.0.0.0/0", "every")] {
            let c = parse(&format!("metadata: {{name: b}}\nspec: {{cidrs: [\"{bad}\", \"fd00::/108\"]}}\n"));
            assert_eq!(c.value.unwrap().cidrs, vec!["fd00::/108".parse::<IpNet>().unwrap()], "{bad}");
            assert!(c.problems[0].reason.contains(why) && !c.problems[0].object_skipped, "{:?}", c.problems);
        }
        let c = parse("metadata: {name: empty}\nspec: {cidrs: []}\n");
        assert!(c.value.is_none() && c.problems[0].object_skipped);
        let c = parse("metadata: {name: Bad_Name}\nspec: {cidrs: [10.0.0.0/24]}\n");
        assert!(c.value.is_none() && c.problems[0].field == "metadata.name");
    }

    fn svc(yaml: &str) -> api::Service {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn bad_ports_are_skipped_alone() {
        let s = svc(r#"
metadata: {name: web, namespace: ns}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80}
  - {name: zero, port: 0}
  - {name: big, port: 70000}
  - {name: weird, port: 81, protocol: ICMP}
  - {name: http, port: 82}
  - {name: dns, port: 53, protocol: UDP}
  - {name: Bad_Name, port: 83}
  - {name: -dash, port: 84}
  - {name: mutable-named-port, port: 8001, targetPort: mutable-port}
"#);
        let c = service(&s);
        let info = c.value.unwrap();
        let names: Vec<String> = info.ports.iter().map(|p| format!("{}/{}", p.name, p.port)).collect();
        // A Service's port names are DNS labels (up to 63 bytes), not the container's 15-byte
        // IANA names: upstream's e2e names one `mutable-named-port`.
        assert_eq!(names, vec!["ns/web:http/80", "ns/web:dns/53", "ns/web:mutable-named-port/8001"]);
        assert_eq!(c.problems.len(), 6, "{:#?}", c.problems);
        assert!(c.problems.iter().all(|p| !p.object_skipped));
    }

    #[test]
    fn invalid_cluster_ip_skips_the_service() {
        let c = service(&svc(
            "metadata: {name: web, namespace: ns}\nspec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}\n",
        ));
        assert!(c.value.is_none());
        assert!(c.problems.iter().any(|p| p.object_skipped));
    }

    #[test]
    fn headless_external_name_and_foreign_services_are_not_ours() {
        for yaml in [
            "metadata: {name: h, namespace: ns}\nspec: {clusterIP: None, ports: [{port: 80}]}\n",
            "metadata: {name: e, namespace: ns}\nspec: {type: ExternalName, externalName: example.com}\n",
            "metadata: {name: f, namespace: ns, labels: {service.kubernetes.io/service-proxy-name: other}}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n",
        ] {
            let c = service(&svc(yaml));
            assert!(c.value.is_none() && c.problems.is_empty(), "{yaml}");
        }
    }

    #[test]
    fn non_ascii_and_overlong_names_are_rejected() {
        let long = "a".repeat(64);
        for name in ["wéb", long.as_str(), "Web", "-web"] {
            let c = service(&svc(&format!(
                "metadata: {{name: \"{name}\", namespace: ns}}\nspec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}]}}\n"
            )));
            assert!(c.value.is_none() && c.problems[0].object_skipped, "{name}");
        }
        let ok = "a".repeat(63);
        let c = service(&svc(&format!(
            "metadata: {{name: {ok}, namespace: ns}}\nspec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}]}}\n"
        )));
        assert!(c.value.is_some());
    }

    #[test]
    fn slice_endpoints_of_the_wrong_family_are_skipped() {
        let s: api::EndpointSlice = serde_yaml_ng::from_str(
            r#"
metadata: {name: web-abc, namespace: ns, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: bad, port: 0}]
endpoints:
- addresses: ["10.0.0.1"]
  conditions: {ready: true}
  nodeName: node1
- addresses: ["fd00::1"]
- addresses: ["not-an-ip"]
- addresses: ["10.0.0.2"]
  conditions: {ready: false, serving: true, terminating: true}
"#,
        )
        .unwrap();
        let c = endpoint_slice(&s);
        let info = c.value.unwrap();
        assert_eq!(info.ports, vec![("http".to_string(), L4Proto::Tcp, 8080)]);
        assert_eq!(info.endpoints.len(), 2);
        assert!(info.endpoints[1].serving && info.endpoints[1].terminating && !info.endpoints[1].ready);
        assert_eq!(c.problems.len(), 3);
    }
}
