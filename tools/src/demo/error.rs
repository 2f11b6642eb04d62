//! Why the demo stopped, and the check between its steps that stops it on Ctrl-C.

use std::sync::atomic::{AtomicBool, Ordering};

use thiserror::Error;

use crate::controlplane::ControlPlaneError;
use crate::lab::LabError;

/// Why the demo stopped.
#[derive(Debug, Error)]
pub enum DemoError {
    #[error(transparent)]
    Lab(#[from] LabError),
    #[error("interrupted; the lab was removed")]
    Interrupted,
    #[error("{0}")]
    Agent(String),
    #[error(transparent)]
    ControlPlane(ControlPlaneError),
}

/// `Interrupted` once Ctrl-C was pressed (`stop` set), so the demo removes its lab and ends.
pub(crate) fn check(stop: &AtomicBool) -> Result<(), DemoError> {
    if stop.load(Ordering::Relaxed) { Err(DemoError::Interrupted) } else { Ok(()) }
}
