//! A real Kubernetes node in the lab: containerd and kubelet (upstream's, built from the pinned
//! module) in a lab node's network namespace and a mount namespace of their own, pods as real
//! containers from imported images with addresses from the CNI bridge and host-local plugins.
//!
//! Nothing reaches the machine's root network namespace, its mounts or its cgroups beyond a
//! cgroup root of the node's own (`nftp-<node>-<pid>`), removed with the node ([`cgroup`]); the
//! node's filesystem view is in [`anchor`]. Every process the node starts (the daemons, the
//! shims, the containers) sits in that cgroup root and is killed with it.

pub mod anchor;
pub mod cgroup;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod e2e;
pub mod error;
pub mod kubeadm;
pub mod machine;
pub mod probe;
pub mod scenario;

pub use error::NodeError;
pub use machine::{Node, NodeSpec};
