//! nftproxy's pure core: from the cluster state to the desired nftables ruleset, the
//! transaction that takes the kernel there, and what a packet would meet on the way.
//!
//! Data flow: [`manifests`] (or the agent's API watches) produce [`model`] values; [`index`]
//! holds the cluster state and what changed; [`plan`] turns it, with [`config`]'s settings,
//! into an [`nft`] ruleset (a plain value, renderable as nft text), which [`nft::lower`] lowers
//! to the kernel's wire form and [`nft::diff`](mod@nft::diff) compares with what the kernel
//! holds; [`explain`] evaluates a wire ruleset for one packet.
//!
//! Nothing here performs I/O on the kernel or the network: this crate depends on no netlink,
//! tokio, kube or libc, so "pure up to the last step" is enforced by Cargo. The `nftproxy` crate
//! (the node agent) supplies the effects.
// Stricter than the workspace's `deny`: no module of the core may allow unsafe code.
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]

pub mod config;
pub mod explain;
pub mod index;
pub mod manifests;
pub mod model;
pub mod net;
pub mod nft;
pub mod plan;

#[cfg(any(test, feature = "testing"))]
pub mod fixtures;
#[cfg(test)]
mod hostile;
