use std::ffi::OsString;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use nftproxy::cli::kube_proxy::{self, Action};
use nftproxy::cli::{Cli, Command, config_verbosity, logging_format, run};
use nftproxy::config::LoggingFormat;
use tracing_subscriber::EnvFilter;

/// jemalloc, configured with one arena (`.cargo/config.toml`). glibc's malloc gives each
/// allocating thread an arena and keeps what is freed there, so the watch threads' parsed lists
/// and the sync never shared freed memory: `run` at 10,000 × 10 through the API peaked at
/// 214 MiB with glibc, 149–150 MiB with this (and `render` of that cluster fell from 1.2 s to 0.9 s).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    // Under kube-proxy's name, or with kube-proxy's flags and no subcommand: kube-proxy's
    // command line, read as kube-proxy reads it.
    let translated = if kube_proxy::is_kube_proxy(&argv) {
        match kube_proxy::translate(&argv) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("Error: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let wants_version = argv.iter().skip(1).any(|a| a == "--version" || a == "-V");
    match translated.as_ref().map(|t| &t.action) {
        Some(Action::Version) => {
            print!("{}", kube_proxy::version_lines());
            return ExitCode::SUCCESS;
        }
        Some(Action::Help) => {
            let mut run = Cli::command().find_subcommand("run").cloned().unwrap_or_else(Cli::command);
            println!(
                "nftproxy, started with kube-proxy's command line: every kube-proxy {} flag is accepted and those that apply are honoured (see docs/install.md). nftproxy run's own flags:\n",
                kube_proxy::KUBE_PROXY_VERSION
            );
            let _ = run.print_help();
            return ExitCode::SUCCESS;
        }
        None if wants_version && argv.len() == 2 => {
            print!("{}", kube_proxy::version_lines());
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    let args = translated.as_ref().map_or_else(|| argv.clone(), |t| t.argv.clone());
    let matches = match Cli::command().try_get_matches_from(&args) {
        Ok(m) => m,
        Err(e) => e.exit(),
    };
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if let (Some(t), Command::Run(run_args)) = (&translated, &mut cli.command) {
        run_args.kube_proxy = t.extras.clone();
    }
    // Flags win over the file's `logging.verbosity`, as upstream copies logging flags over it.
    let v_given = translated.as_ref().is_some_and(|t| t.extras.verbosity.is_some());
    let verbose = if cli.verbose > 0 || v_given { cli.verbose } else { config_verbosity(&cli) };
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match logging_format(&cli) {
        // One object per line: the event's fields at the top level, the span it ran in (the
        // sync's reason and kind) under "span".
        LoggingFormat::Json => logs.json().flatten_event(true).with_current_span(true).with_span_list(false).init(),
        LoggingFormat::Text => logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
    }
    if let Some(t) = &translated {
        tracing::info!(
            version = env!("CARGO_PKG_VERSION"),
            kube_proxy = kube_proxy::KUBE_PROXY_VERSION,
            "nftproxy started with kube-proxy's command line"
        );
        match &t.action {
            Action::Cleanup => return nftproxy::cli::kube_proxy_cleanup(&cli),
            Action::WriteConfigTo(path) => return nftproxy::cli::write_config_to(&cli, &matches, path),
            _ => {}
        }
    }
    run(cli, Some(&matches))
}
