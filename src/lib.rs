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

// The pure core, under the paths the agent and the tools have always used.
use nftproxy_core::explain;
pub use nftproxy_core::{config, index, model, net, nft, plan};

mod agent;
mod check;
pub mod cli;
mod conntrack;
mod debug_services;
mod handback;
mod health;
mod http;
mod metrics;
pub mod netlink;
pub mod nodeaddr;
pub mod oneshot;
pub mod source;
mod status;
pub mod sync;
mod takeover;
mod tools_binary;
mod trace;
