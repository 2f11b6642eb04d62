//! `nftproxy demo` and `nftproxy bench`: the lab demo and the scale benchmark live in the
//! `nftproxy-tools` binary (workspace member `tools/`), so the node agent carries none of their
//! code. `cargo build` puts both binaries side by side; these commands run the other one. This
//! is the only place the `nftproxy` binary starts a program (a test holds it to that).

use std::ffi::OsString;
use std::path::PathBuf;

use thiserror::Error;

/// Errors running the tools.
#[derive(Debug, Error)]
pub enum ToolError {
    #[error(
        "cannot run {program}: {source} (the demo and the benchmark are in the nftproxy-tools binary: \
         `cargo build --release -p nftproxy-tools`, then keep it next to nftproxy or on the PATH)"
    )]
    Spawn { program: String, source: std::io::Error },
    #[error("nftproxy-tools {0} failed")]
    Failed(String),
}

/// The `nftproxy-tools` next to this executable, else the one on the `PATH`.
fn program() -> PathBuf {
    let sibling = std::env::current_exe().ok().and_then(|exe| Some(exe.parent()?.join("nftproxy-tools")));
    sibling.filter(|p| p.is_file()).unwrap_or_else(|| "nftproxy-tools".into())
}

/// Runs `nftproxy-tools <command> <args>` and waits for it.
pub(crate) fn forward(command: &str, args: &[OsString]) -> Result<(), ToolError> {
    let program = program();
    let status = std::process::Command::new(&program)
        .arg(command)
        .args(args)
        .status()
        .map_err(|source| ToolError::Spawn { program: program.display().to_string(), source })?;
    if status.success() { Ok(()) } else { Err(ToolError::Failed(command.to_string())) }
}
