//! Errors running a node.

use std::time::Duration;

use thiserror::Error;

/// Errors running a node.
#[derive(Debug, Error)]
pub enum NodeError {
    #[error("setting up the node: {0}")]
    Setup(String),
    #[error("{what} did not become ready within {waited:?}; its log:\n{log}")]
    NotReady { what: String, waited: Duration, log: String },
    #[error("{what} failed: {output}")]
    Failed { what: String, output: String },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
