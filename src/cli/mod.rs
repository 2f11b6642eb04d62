//! The command line, in three parts, each below the next: [`args`], what clap reads (the
//! subcommands and their flags; kube-proxy's names); [`settings`], what the flags and a
//! `--config` file come to (the one place where flags and kube-proxy's configuration file become
//! the settings a command runs with); [`commands`], what each command does with them. Under
//! kube-proxy's own command line, [`kube_proxy`] translates it to `run`'s first.

pub mod args;
pub mod commands;
pub mod kube_proxy;
pub mod settings;

pub use args::{
    CheckArgs, CheckOutput, Cli, Command, ConntrackArgs, ConntrackSysctlsArgs, ExplainArgs, ManifestArgs, ProxyArgs,
    RunArgs, StatusArgs, TableArgs, ToolArgs, TraceArgs,
};
pub use commands::{CliError, kube_proxy_cleanup, run, write_config_to};
pub use settings::{config_verbosity, logging_format};
