//! nftproxy: a Kubernetes service proxy on nftables.
//!
//! Data flow: [`source`] (API watches or manifests, objects converted as they arrive) →
//! [`index`] (the cluster state and what changed) → [`sync`] (plans with [`plan`], a pure
//! function, lowers and diffs with [`nft`], applies one atomic transaction with [`netlink`]);
//! the node agent (`agent`, private) runs the loop and the servers around it.
//!
//! The public modules are what the `nftproxy` binary, the tools (`nftproxy-tools`) and the
//! integration tests use; everything else is crate-private.
#![warn(unreachable_pub)]

mod agent;
mod check;
pub mod cli;
pub mod config;
mod conntrack;
mod explain;
mod health;
pub mod index;
mod metrics;
pub mod model;
pub mod net;
pub mod netlink;
pub mod nft;
pub mod nodeaddr;
pub mod plan;
pub mod source;
mod status;
pub mod sync;
mod takeover;
mod tools;
mod trace;
