//! The lab network: nodes with a bridge of pods, a "wan" router joining nodes and external
//! clients, all in their own network namespaces.
//!
//! ```text
//!  client 192.168.50.100 ─┐                    ┌─ node1 192.168.50.2 ── cbr0 10.244.1.1 ── pods 10.244.1.10…
//!  client 192.168.50.101 ─┼─ wan (br-wan .1) ──┤
//!                         │  routes pod and    └─ node2 192.168.50.3 ── cbr0 10.244.2.1 ── pods 10.244.2.10…
//!                         │  service ranges to nodes
//! ```
//!
//! Pods have /32 (/128) addresses and an on-link default route via their node's bridge, so all
//! pod traffic, even between pods of one node, crosses the node's IP stack and its nftables
//! hooks (real bridge CNIs load `br_netfilter` for that; the lab does not touch host modules).
//! Bridge ports are in hairpin mode, as kubelet sets them, so a pod can reach itself through a
//! service. Nothing has a route out of the machine.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::error::LabError;
use super::netns::Netns;
use super::servers::{EchoServers, ServerSpec};

/// The service range the wan router sends to node 1 (so external clients can reach ClusterIPs).
pub const SERVICE_CIDR_V4: &str = "10.96.0.0/16";
/// IPv6 service range.
pub const SERVICE_CIDR_V6: &str = "fd00:96::/112";
/// Where the wan router sends LoadBalancer and external IPs (to node 1, as a load balancer or an
/// operator's route would).
pub const EXTERNAL_CIDR_V4: &str = "203.0.113.0/24";
/// IPv6 LoadBalancer and external IPs.
pub const EXTERNAL_CIDR_V6: &str = "2001:db8:e::/64";
/// The cluster (pod) range, for `--cluster-cidr`.
pub const CLUSTER_CIDR_V4: &str = "10.244.0.0/16";
/// IPv6 pod range.
pub const CLUSTER_CIDR_V6: &str = "fd00:10:244::/56";

/// A Kubernetes node of the lab.
#[derive(Debug)]
pub struct LabNode {
    pub name: String,
    pub ns: Netns,
    /// Address on the wan.
    pub ip: Ipv4Addr,
    pub ip6: Ipv6Addr,
    /// The bridge's address (pods' gateway).
    pub gateway: Ipv4Addr,
    pub gateway6: Ipv6Addr,
    index: u8,
    pods: u8,
}

/// A pod: a namespace on a node running echo servers.
#[derive(Debug)]
pub struct LabPod {
    pub name: String,
    pub ns: Netns,
    pub ip: Ipv4Addr,
    pub ip6: Ipv6Addr,
    pub node: String,
}

/// A host outside the cluster.
#[derive(Debug)]
pub struct LabClient {
    pub name: String,
    pub ns: Netns,
    pub ip: Ipv4Addr,
    pub ip6: Ipv6Addr,
}

/// The whole lab. Dropping it stops the servers and deletes every namespace.
#[derive(Debug)]
pub struct Lab {
    servers: Option<EchoServers>,
    pub pods: Vec<LabPod>,
    pub clients: Vec<LabClient>,
    pub nodes: Vec<LabNode>,
    pub wan: Netns,
}

fn sysctl(ns: &Netns, key: &str, value: &str) -> Result<(), LabError> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    let value = value.to_string();
    ns.run(move || std::fs::write(&path, value))?.map_err(LabError::from)
}

impl Lab {
    /// An empty lab: just the wan router.
    pub fn new() -> Result<Lab, LabError> {
        super::privileges::require_privileges()?;
        let wan = Netns::create("wan")?;
        for key in ["net.ipv4.conf.all.send_redirects", "net.ipv4.conf.default.send_redirects"] {
            sysctl(&wan, key, "0")?;
        }
        wan.ip(&["link", "add", "br-wan", "type", "bridge"])?;
        wan.ip(&["addr", "add", "192.168.50.1/24", "dev", "br-wan"])?;
        wan.ip(&["addr", "add", "fd00:50::1/64", "dev", "br-wan", "nodad"])?;
        wan.ip(&["link", "set", "br-wan", "up"])?;
        sysctl(&wan, "net.ipv4.ip_forward", "1")?;
        sysctl(&wan, "net.ipv6.conf.all.forwarding", "1")?;
        Ok(Lab { servers: None, pods: Vec::new(), clients: Vec::new(), nodes: Vec::new(), wan })
    }

    /// Adds a node (`node1`, `node2`, … get 192.168.50.2, .3, … and pod range 10.244.N.0/24).
    pub fn add_node(&mut self, name: &str) -> Result<&LabNode, LabError> {
        let node = self.wire_node(name)?;
        let (ns, index, ip, ip6) = (&node.ns, node.index, node.ip, node.ip6);
        ns.ip(&["link", "add", "cbr0", "type", "bridge"])?;
        ns.ip(&["addr", "add", &format!("{}/24", node.gateway), "dev", "cbr0"])?;
        ns.ip(&["addr", "add", &format!("{}/64", node.gateway6), "dev", "cbr0", "nodad"])?;
        ns.ip(&["link", "set", "cbr0", "up"])?;
        // Pod ranges of other nodes, and theirs to us, over the wan; the router learns ours.
        self.wan.ip(&["route", "add", &format!("10.244.{index}.0/24"), "via", &ip.to_string()])?;
        self.wan.ip(&["-6", "route", "add", &format!("fd00:10:244:{index}::/64"), "via", &ip6.to_string()])?;
        for other in &self.nodes {
            ns.ip(&["route", "add", &format!("10.244.{}.0/24", other.index), "via", &other.ip.to_string()])?;
            ns.ip(&[
                "-6",
                "route",
                "add",
                &format!("fd00:10:244:{}::/64", other.index),
                "via",
                &other.ip6.to_string(),
            ])?;
            other.ns.ip(&["route", "add", &format!("10.244.{index}.0/24"), "via", &ip.to_string()])?;
            other.ns.ip(&["-6", "route", "add", &format!("fd00:10:244:{index}::/64"), "via", &ip6.to_string()])?;
        }
        self.nodes.push(node);
        Ok(&self.nodes[self.nodes.len() - 1])
    }

    /// Adds a node with only its wan link: no pod bridge and no pod routes, for a node whose CNI
    /// makes its pods' network and whose pod range the cluster assigns ([`crate::node`]).
    pub fn add_bare_node(&mut self, name: &str) -> Result<&LabNode, LabError> {
        let node = self.wire_node(name)?;
        self.nodes.push(node);
        Ok(&self.nodes[self.nodes.len() - 1])
    }

    /// A node's namespace on the wan: its address, routes out, forwarding, and (node 1) the
    /// service and external ranges the router sends to it.
    fn wire_node(&mut self, name: &str) -> Result<LabNode, LabError> {
        let index = u8::try_from(self.nodes.len() + 1).map_err(|_| LabError::NotPrivileged("too many nodes".into()))?;
        let ns = Netns::create(&format!("n{index}"))?;
        let ip = Ipv4Addr::new(192, 168, 50, 1 + index);
        let ip6: Ipv6Addr =
            format!("fd00:50::{}", 1 + index).parse().map_err(|_| LabError::NotPrivileged("address".into()))?;
        let gateway = Ipv4Addr::new(10, 244, index, 1);
        let gateway6: Ipv6Addr =
            format!("fd00:10:244:{index}::1").parse().map_err(|_| LabError::NotPrivileged("address".into()))?;
        // A node never sends ICMP redirects: the lab routes service traffic back out the
        // interface it came in on, and a redirect would also use up the ICMP rate token the
        // port-unreachable of a rejected connection needs. Defaults first, so every
        // interface created below inherits them.
        for key in ["net.ipv4.conf.all.send_redirects", "net.ipv4.conf.default.send_redirects"] {
            sysctl(&ns, key, "0")?;
        }
        // Nor does it limit its ICMP errors per peer (a burst of 6, then one a second): the
        // tests count rejects exactly, and a port-unreachable held back makes the client retry
        // and be rejected, and counted, again.
        sysctl(&ns, "net.ipv4.icmp_ratelimit", "0")?;
        sysctl(&ns, "net.ipv6.icmp.ratelimit", "0")?;
        let wan_if = format!("wan-n{index}");
        self.wan.ip(&["link", "add", &wan_if, "type", "veth", "peer", "name", "eth0", "netns", ns.name()])?;
        self.wan.ip(&["link", "set", &wan_if, "master", "br-wan", "up"])?;
        ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
        ns.ip(&["addr", "add", &format!("{ip6}/64"), "dev", "eth0", "nodad"])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        ns.ip(&["route", "add", "default", "via", "192.168.50.1"])?;
        ns.ip(&["-6", "route", "add", "default", "via", "fd00:50::1"])?;
        sysctl(&ns, "net.ipv4.ip_forward", "1")?;
        sysctl(&ns, "net.ipv6.conf.all.forwarding", "1")?;
        if index == 1 {
            self.wan.ip(&["route", "add", SERVICE_CIDR_V4, "via", &ip.to_string()])?;
            self.wan.ip(&["-6", "route", "add", SERVICE_CIDR_V6, "via", &ip6.to_string()])?;
            self.wan.ip(&["route", "add", EXTERNAL_CIDR_V4, "via", &ip.to_string()])?;
            self.wan.ip(&["-6", "route", "add", EXTERNAL_CIDR_V6, "via", &ip6.to_string()])?;
        }
        Ok(LabNode { name: name.to_string(), ns, ip, ip6, gateway, gateway6, index, pods: 0 })
    }

    /// Adds a pod on a node; it gets the node's next address (10.244.N.10, .11, …).
    pub fn add_pod(&mut self, name: &str, node: &str) -> Result<&LabPod, LabError> {
        let n = self
            .nodes
            .iter_mut()
            .find(|n| n.name == node)
            .ok_or_else(|| LabError::NotPrivileged(format!("no lab node {node}")))?;
        let host = 10 + n.pods;
        n.pods += 1;
        let ip = Ipv4Addr::new(10, 244, n.index, host);
        let ip6: Ipv6Addr = format!("fd00:10:244:{}::{:x}", n.index, host)
            .parse()
            .map_err(|_| LabError::NotPrivileged("address".into()))?;
        let ns = Netns::create(&format!("p{}", self.pods.len() + 1))?;
        let veth = format!("vp{}", self.pods.len() + 1);
        n.ns.ip(&["link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", ns.name()])?;
        // Hairpin mode, as kubelet sets it for bridge CNIs: a pod reaching itself through a
        // service is DNATed back out the port it came in on, which a bridge refuses otherwise.
        n.ns.ip(&["link", "set", &veth, "master", "cbr0", "up"])?;
        n.ns.ip(&["link", "set", &veth, "type", "bridge_slave", "hairpin", "on"])?;
        ns.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"])?;
        ns.ip(&["addr", "add", &format!("{ip6}/128"), "dev", "eth0", "nodad"])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        ns.ip(&["route", "add", &format!("{}/32", n.gateway), "dev", "eth0"])?;
        ns.ip(&["route", "add", "default", "via", &n.gateway.to_string(), "dev", "eth0"])?;
        ns.ip(&["-6", "route", "add", &format!("{}/128", n.gateway6), "dev", "eth0"])?;
        ns.ip(&["-6", "route", "add", "default", "via", &n.gateway6.to_string(), "dev", "eth0"])?;
        sysctl(&ns, "net.ipv4.conf.all.accept_redirects", "0")?;
        sysctl(&ns, "net.ipv6.conf.all.accept_redirects", "0")?;
        let node_name = n.name.clone();
        self.pods.push(LabPod { name: name.to_string(), ns, ip, ip6, node: node_name });
        Ok(&self.pods[self.pods.len() - 1])
    }

    /// Adds an external client on the wan (192.168.50.100, .101, …).
    pub fn add_client(&mut self, name: &str) -> Result<&LabClient, LabError> {
        let index = u8::try_from(self.clients.len()).map_err(|_| LabError::NotPrivileged("too many clients".into()))?;
        let ip = Ipv4Addr::new(192, 168, 50, 100 + index);
        let ip6: Ipv6Addr = format!("fd00:50::{:x}", 0x100 + u16::from(index))
            .parse()
            .map_err(|_| LabError::NotPrivileged("address".into()))?;
        let ns = Netns::create(&format!("c{}", index + 1))?;
        let wan_if = format!("wan-c{}", index + 1);
        self.wan.ip(&["link", "add", &wan_if, "type", "veth", "peer", "name", "eth0", "netns", ns.name()])?;
        self.wan.ip(&["link", "set", &wan_if, "master", "br-wan", "up"])?;
        ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
        ns.ip(&["addr", "add", &format!("{ip6}/64"), "dev", "eth0", "nodad"])?;
        ns.ip(&["link", "set", "eth0", "up"])?;
        ns.ip(&["route", "add", "default", "via", "192.168.50.1"])?;
        ns.ip(&["-6", "route", "add", "default", "via", "fd00:50::1"])?;
        self.clients.push(LabClient { name: name.to_string(), ns, ip, ip6 });
        Ok(&self.clients[self.clients.len() - 1])
    }

    /// Starts echo servers in every pod on these ports (TCP and UDP), answering with the pod's
    /// name and the source address they saw.
    pub fn start_servers(&mut self, specs: &[ServerSpec]) -> Result<(), LabError> {
        let targets: Vec<(String, &Netns)> = self.pods.iter().map(|p| (p.name.clone(), &p.ns)).collect();
        self.servers = Some(EchoServers::start(&targets, specs)?);
        Ok(())
    }

    /// A node by name.
    pub fn node(&self, name: &str) -> &LabNode {
        self.nodes.iter().find(|n| n.name == name).unwrap_or(&self.nodes[0])
    }

    /// A pod by name.
    pub fn pod(&self, name: &str) -> Option<&LabPod> {
        self.pods.iter().find(|p| p.name == name)
    }

    /// A client by name.
    pub fn client(&self, name: &str) -> Option<&LabClient> {
        self.clients.iter().find(|c| c.name == name)
    }

    /// The IP of a pod, by name, in a family.
    pub fn pod_ip(&self, name: &str, v6: bool) -> Option<IpAddr> {
        self.pod(name).map(|p| if v6 { IpAddr::V6(p.ip6) } else { IpAddr::V4(p.ip) })
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Servers first (their threads hold sockets in the namespaces), then namespaces.
        self.servers.take();
    }
}
