//! A cluster of real nodes in the lab: the wan, the control plane (etcd, kube-apiserver,
//! kube-controller-manager with node IPAM, kube-scheduler) in a namespace of its own, and one
//! [`Node`] per name, each with containerd and kubelet. Pods get addresses from the range
//! node IPAM gives their Node; the cluster routes those ranges across the wan as a CNI's
//! routing daemon (flannel's host-gw, Calico's BGP) would.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use thiserror::Error;

use super::config::IptablesBackend;
use super::error::NodeError;
use super::machine::{Node, NodeSpec};
use crate::controlplane::{ControlPlane, ControlPlaneError, Kubelets};
use crate::lab::Lab;
use crate::lab::topology::{CLUSTER_CIDR_V4, SERVICE_CIDR_V4};

/// The cluster DNS Service's address (kubeadm's: the tenth of the service range).
pub const CLUSTER_DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// Errors running the cluster.
#[derive(Debug, Error)]
pub enum ClusterError {
    #[error(transparent)]
    ControlPlane(#[from] ControlPlaneError),
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error(transparent)]
    Lab(#[from] crate::lab::LabError),
    #[error("{what} within {waited:?}: {detail}")]
    Timeout { what: String, waited: Duration, detail: String },
}

/// The running cluster. Dropped in field order: nodes, control plane, lab.
pub struct NodeCluster {
    pub nodes: Vec<Node>,
    pub cp: ControlPlane,
    pub lab: Lab,
    /// Each node's pod range once node IPAM gave it: (range, the node's wan address).
    pod_ranges: Vec<(String, Ipv4Addr)>,
}

impl NodeCluster {
    /// Builds the lab and the control plane, boots one node per name with `images` imported,
    /// routes the pod ranges, and waits until every Node is Ready.
    pub fn start(names: &[&str], images: &[PathBuf]) -> Result<NodeCluster, ClusterError> {
        let nodes: Vec<(&str, IptablesBackend)> = names.iter().map(|n| (*n, IptablesBackend::Nft)).collect();
        NodeCluster::start_with(&nodes, images)
    }

    /// [`NodeCluster::start`], each node with the iptables its distribution uses.
    pub fn start_with(nodes: &[(&str, IptablesBackend)], images: &[PathBuf]) -> Result<NodeCluster, ClusterError> {
        let names: Vec<&str> = nodes.iter().map(|(n, _)| *n).collect();
        let mut lab = Lab::new()?;
        for name in &names {
            lab.add_bare_node(name)?;
        }
        let kubelets = Kubelets {
            nodes: names.iter().map(|n| n.to_string()).collect(),
            cluster_cidr: CLUSTER_CIDR_V4.to_string(),
        };
        let cp = ControlPlane::start_for_kubelets(&mut lab, SERVICE_CIDR_V4, kubelets)?;
        // A host outside the cluster, on the wan: NodePorts and load balancers are reached from it.
        lab.add_client("client")?;
        let mut started = Vec::new();
        for (name, iptables) in nodes {
            let lab_node = lab.node(name);
            let spec = NodeSpec {
                name: name.to_string(),
                netns: lab_node.ns.name().to_string(),
                ip: lab_node.ip,
                kubeconfig: cp.kubelet_kubeconfig(name),
                cluster_dns: CLUSTER_DNS,
                iptables: *iptables,
            };
            started.push(Node::start(spec, cp.bins.clone(), images)?);
        }
        let mut cluster = NodeCluster { nodes: started, cp, lab, pod_ranges: Vec::new() };
        cluster.route_pod_ranges()?;
        cluster.wait_until_ready(Duration::from_secs(120))?;
        Ok(cluster)
    }

    /// Waits for every Node's `podCIDR` and routes it: the wan router and every other node send
    /// it to the node's wan address.
    fn route_pod_ranges(&mut self) -> Result<(), ClusterError> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut ranges = Vec::new();
        for node in &self.nodes {
            let range = loop {
                let out = self.cp.kubectl(&["get", "node", &node.spec.name, "-o", "jsonpath={.spec.podCIDR}"])?;
                let range = String::from_utf8_lossy(&out.stdout).trim().to_string();
                if !range.is_empty() {
                    break range;
                }
                if Instant::now() > deadline {
                    return Err(ClusterError::Timeout {
                        what: format!("node {} got no podCIDR", node.spec.name),
                        waited: Duration::from_secs(60),
                        detail: format!("{}\n{}", node.logs(), self.cp.logs()),
                    });
                }
                std::thread::sleep(Duration::from_millis(250));
            };
            ranges.push((range, node.spec.ip));
        }
        for (range, via) in &ranges {
            self.lab.wan.ip(&["route", "replace", range, "via", &via.to_string()])?;
            for node in &self.nodes {
                if node.spec.ip != *via {
                    self.lab.node(&node.spec.name).ns.ip(&["route", "replace", range, "via", &via.to_string()])?;
                }
            }
        }
        self.pod_ranges = ranges;
        Ok(())
    }

    /// The routes a node's network configuration gives it at boot: the other nodes' pod ranges.
    pub fn boot_routes(&self, node: &str) -> Vec<(String, Ipv4Addr)> {
        let own = self.lab.node(node).ip;
        self.pod_ranges.iter().filter(|(_, via)| *via != own).cloned().collect()
    }

    /// The pod range node IPAM gave a node.
    pub fn pod_range(&self, node: &str) -> Option<&str> {
        let ip = self.lab.node(node).ip;
        self.pod_ranges.iter().find(|(_, via)| *via == ip).map(|(r, _)| r.as_str())
    }

    /// Waits until every Node reports Ready.
    pub fn wait_until_ready(&self, within: Duration) -> Result<(), ClusterError> {
        let deadline = Instant::now() + within;
        loop {
            let out = self.cp.kubectl(&[
                "get",
                "nodes",
                "-o",
                r#"jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}"#,
            ])?;
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let ready = text.lines().filter(|l| l.ends_with("=True")).count();
            if ready == self.nodes.len() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let logs: Vec<String> = self.nodes.iter().map(Node::logs).collect();
                return Err(ClusterError::Timeout {
                    what: "nodes Ready".into(),
                    waited: within,
                    detail: format!("{text}\n{}", logs.join("\n")),
                });
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// A node by name.
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.spec.name == name)
    }

    /// A node by name, to restart or reboot it.
    pub fn node_mut(&mut self, name: &str) -> Option<&mut Node> {
        self.nodes.iter_mut().find(|n| n.spec.name == name)
    }

    /// Reboots a node ([`Node::reboot`]) with its boot routes.
    pub fn reboot(&mut self, name: &str) -> Result<(), ClusterError> {
        let routes = self.boot_routes(name);
        let node = self.node_mut(name).ok_or_else(|| NodeError::Setup(format!("no node {name}")))?;
        node.reboot(&routes)?;
        Ok(())
    }
}
