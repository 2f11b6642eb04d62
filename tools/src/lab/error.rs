//! The lab's errors.

use thiserror::Error;

/// Errors building or using the lab.
#[derive(Debug, Error)]
pub enum LabError {
    #[error("{0}")]
    NotPrivileged(String),
    #[error("cannot run {0}: {1}")]
    Spawn(String, String),
    #[error("{command} failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("cannot enter network namespace {0}: {1}")]
    Enter(String, String),
    #[error("a thread inside namespace {0} panicked")]
    ThreadPanicked(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
