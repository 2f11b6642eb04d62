//! nftproxy: a Kubernetes service proxy on nftables.
//!
//! Data flow of one sync: [`source`] objects → [`model::ClusterState`] → [`plan`] (a pure
//! function) → desired [`nft::Ruleset`] → [`nft::lower`] → [`nft::diff`](mod@nft::diff) against what the kernel
//! holds → [`netlink`] applies one atomic transaction.

pub mod bench;
pub mod check;
pub mod cli;
pub mod config;
pub mod conntrack;
pub mod demo;
pub mod health;
pub mod lab;
pub mod metrics;
pub mod model;
pub mod net;
pub mod netlink;
pub mod nft;
pub mod nodeaddr;
pub mod plan;
pub mod reconcile;
pub mod run;
pub mod source;
