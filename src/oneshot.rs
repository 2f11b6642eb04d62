//! nftproxy as a library, one shot at a time: the ruleset a cluster state plans to here, as
//! nft text, and that state applied here in one full sync. `nftproxy render` and `nftproxy
//! sync` are these; the tools (benchmark, demo) call them too. The long-running agent is
//! `nftproxy run`.

use thiserror::Error;

use crate::config::ProxyConfig;
use crate::index::Pending;
use crate::model::ClusterState;
use crate::netlink::{Kernel, NetlinkError};
use crate::nodeaddr::{self, NodePortTargets};
use crate::plan::{Plan, PlanInput, plan};
use crate::sync::{self, SyncError, SyncReason, Synced, Syncer};

/// Why a one-shot sync failed.
#[derive(Debug, Error)]
pub enum OneShotError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Sync(#[from] SyncError),
}

/// The plan for a state, node-port addresses resolved in this network namespace and endpoint
/// windows placed from nothing (what `render` prints and `explain --manifests` walks), and
/// those addresses.
pub fn plan_here(config: &ProxyConfig, state: &ClusterState) -> (Plan, NodePortTargets) {
    let targets = nodeaddr::resolve(&config.nodeport_addresses, state.node());
    let planned = plan(&PlanInput { config, state, nodeports_v4: &targets.v4, nodeports_v6: &targets.v6 });
    (planned, targets)
}

/// The ruleset for a state as nft text (`nftproxy render`).
pub fn render(config: &ProxyConfig, state: &ClusterState) -> String {
    plan_here(config, state).0.ruleset.to_string()
}

/// Applies a state here as one full sync (`nftproxy sync`): the same streamed transaction as
/// `run` and restarts, without claiming the tables (the process exits at once).
pub fn sync_once(config: &ProxyConfig, state: &ClusterState) -> Result<Synced, OneShotError> {
    let mut config = config.clone();
    config.table_ownership = false;
    let mut syncer = Syncer::new(config, Box::new(Kernel::open()?), sync::local_nodeports());
    let everything = Pending {
        services: state.services().map(|s| s.name.clone()).collect(),
        node_changed: true,
        service_cidrs_changed: true,
    };
    Ok(syncer.sync(state, &everything, SyncReason::Startup, true)?)
}
