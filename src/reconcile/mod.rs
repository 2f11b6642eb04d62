//! The one place effects run in order: plan → lower → diff against the kernel → apply.

use std::time::{Duration, Instant};

use thiserror::Error;

use crate::config::ProxyConfig;
use crate::net::IpFamily;
use crate::netlink::{ApplyStats, NetlinkError, Netfilter};
use crate::nft::diff::{Transaction, diff};
use crate::nft::lower::lower_ruleset;
use crate::nft::wire::WireRuleset;
use crate::plan::Plan;

/// Errors of a sync.
#[derive(Debug, Error)]
pub enum SyncError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
}

/// What one sync did.
#[derive(Debug, Clone)]
pub struct SyncReport {
    /// The operations sent (empty when the kernel already matched).
    pub transaction: Transaction,
    pub apply: ApplyStats,
    /// Time reading the kernel's tables back.
    pub read: Duration,
    /// Time lowering and diffing.
    pub diff: Duration,
    pub total: Duration,
}

/// nftproxy's tables in both families (whether they exist or not).
pub fn table_names(config: &ProxyConfig) -> Vec<(IpFamily, &str)> {
    IpFamily::ALL.iter().map(|f| (*f, config.table.as_str())).collect()
}

/// Reads nftproxy's tables, diffs them with the plan and applies the difference as one
/// transaction. Tables of a family the plan no longer has are deleted.
pub fn sync_with_kernel(nf: &mut dyn Netfilter, config: &ProxyConfig, plan: &Plan) -> Result<SyncReport, SyncError> {
    let started = Instant::now();
    let current = nf.read(&table_names(config))?;
    let read = started.elapsed();
    let diffed = Instant::now();
    let desired = lower_ruleset(&plan.ruleset);
    let transaction = diff(&current, &desired);
    let diff_time = diffed.elapsed();
    let apply = nf.apply(&transaction)?;
    Ok(SyncReport { transaction, apply, read, diff: diff_time, total: started.elapsed() })
}

/// Applies the difference between an applied ruleset nftproxy remembers and the plan.
pub fn sync_from(
    nf: &mut dyn Netfilter,
    applied: &WireRuleset,
    desired: &WireRuleset,
) -> Result<(Transaction, ApplyStats), SyncError> {
    let transaction = diff(applied, desired);
    let stats = nf.apply(&transaction)?;
    Ok((transaction, stats))
}

/// Deletes nftproxy's tables (and nothing else). Returns how many there were.
pub fn cleanup(nf: &mut dyn Netfilter, config: &ProxyConfig) -> Result<usize, SyncError> {
    let current = nf.read(&table_names(config))?;
    let n = current.tables.len();
    let transaction = diff(&current, &WireRuleset::default());
    nf.apply(&transaction)?;
    Ok(n)
}
