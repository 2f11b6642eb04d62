//! The benchmark's errors, shared by every part of it.

use thiserror::Error;

use super::dataplane;
use crate::lab::LabError;

/// Errors of the benchmark.
#[derive(Debug, Error)]
pub enum BenchError {
    #[error(transparent)]
    Lab(#[from] LabError),
    #[error(transparent)]
    Sync(#[from] nftproxy::sync::SyncError),
    #[error(transparent)]
    Netlink(#[from] nftproxy::netlink::NetlinkError),
    #[error(transparent)]
    DataPlane(#[from] dataplane::DataPlaneError),
    #[error("{0} failed: {1}")]
    Tool(String, String),
    #[error("benchmark worker: {0}")]
    Worker(String),
    #[error("invalid size {0:?}: expected SERVICESxENDPOINTS, e.g. 10000x10")]
    Size(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("head to head: {0}")]
    HeadToHead(String),
}
