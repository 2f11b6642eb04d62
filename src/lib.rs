//! nftproxy: a Kubernetes service proxy on nftables.
//!
//! Data flow of one sync: [`source`] objects → [`model::ClusterState`] → [`plan`] (a pure
//! function) → desired [`nft::Ruleset`] → [`nft::lower`] → [`nft::diff`] against what the kernel
//! holds → [`netlink`] applies one atomic transaction.

pub mod net;
pub mod nft;
pub mod netlink;
pub mod lab;
pub mod metrics;
pub mod model;
pub mod config;
pub mod conntrack;
pub mod plan;
pub mod source;
pub mod cli;
pub mod health;
pub mod run;
pub mod demo;
pub mod nodeaddr;
pub mod reconcile;
