//! The randomised differential's errors.

use thiserror::Error;

/// Errors running the randomised differential.
#[derive(Debug, Error)]
pub enum RandomError {
    #[error(transparent)]
    Lab(#[from] crate::lab::LabError),
    #[error(transparent)]
    ControlPlane(#[from] crate::controlplane::ControlPlaneError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Cluster(String),
    #[error("seed {seed}: the API server refused the objects: {why}")]
    Invalid { seed: u64, why: String },
    #[error("{proxy}: {why}; its log ends:\n{log}")]
    Proxy { proxy: &'static str, why: String, log: String },
    #[error("--seeds {0}: expected A..B or a comma-separated list")]
    Seeds(String),
}
