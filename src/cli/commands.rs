//! The commands: what `render`, `sync`, `run`, `cleanup`, `check`, `conntrack-sysctls`,
//! `trace`, `explain`, `status`, `demo` and `bench` do with their checked arguments, and kube-proxy's
//! `--cleanup` and `--write-config-to`; their errors and exit statuses.

use std::net::IpAddr;
use std::process::ExitCode;

use thiserror::Error;
use tracing::{error, warn};

use super::args::{
    CheckArgs, CheckOutput, Cli, Command, ConntrackSysctlsArgs, ExplainArgs, ManifestArgs, StatusArgs, TraceArgs,
};
use super::settings::conntrack_settings;
use crate::config::{ConfigError, ProxyConfig};
use crate::model::ClusterState;
use crate::netlink::{Kernel, NetlinkError};
use crate::oneshot::{OneShotError, plan_here, sync_once};
use crate::source::{self, manifests::ManifestError};
use crate::sync::{self, SyncError};

/// Runs the CLI; returns the process exit code. `matches` tells flags given on the command line
/// from defaults (a config file sits between them).
pub fn run(cli: Cli, matches: Option<&clap::ArgMatches>) -> ExitCode {
    // `check` has its own exit statuses: 1 reports findings, so a failure to check is 2.
    if let Command::Check(args) = &cli.command {
        return match check(args) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                error!("{e}");
                eprintln!("error: {e}");
                ExitCode::from(CHECK_FAILED)
            }
        };
    }
    // `hand-back --check` is a readiness probe: 0 handed back, 1 not yet, 2 could not tell.
    if let Command::HandBack(args) = &cli.command
        && args.check
    {
        return match args.hand_back().done() {
            Ok(done) => ExitCode::from(u8::from(!done)),
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(CHECK_FAILED)
            }
        };
    }
    match execute(cli, matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `check`'s exit status when it could not read the ruleset (1 means it found problems).
const CHECK_FAILED: u8 = 2;

fn execute(cli: Cli, matches: Option<&clap::ArgMatches>) -> Result<(), CliError> {
    match cli.command {
        Command::Render(args) => {
            let config = args.proxy.config()?;
            let state = load_state(&args, &config)?;
            let stdout = std::io::stdout();
            write_rendered(&config, &state, &mut std::io::BufWriter::new(stdout.lock())).map_err(CliError::Output)?;
            Ok(())
        }
        Command::Sync(args) => {
            let config = args.proxy.config()?;
            let state = load_state(&args, &config)?;
            let synced = sync_once(&config, &state)?;
            if config.conntrack_cleanup {
                // A one-shot process has no previous sync: every flow is checked, nothing is
                // known to be deleted.
                let mut table = crate::conntrack::KernelFlows::default();
                crate::conntrack::Reconciler::default().reconcile(
                    &mut table,
                    &synced.conntrack,
                    &synced.nodeports,
                    &state,
                );
            }
            println!(
                "synced {} services ({} ports, {} endpoints): 1 transaction, {} messages, {:.1} ms",
                synced.stats.services,
                synced.stats.service_ports,
                synced.stats.endpoints,
                synced.report.apply.messages,
                synced.report.total.as_secs_f64() * 1000.0
            );
            Ok(())
        }
        Command::HandBack(args) => {
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
                signal_hook::flag::register(signal, std::sync::Arc::clone(&stop)).map_err(CliError::Output)?;
            }
            Ok(args.hand_back().run(args.once, &stop)?)
        }
        Command::Cleanup(args) => {
            let mut config = ProxyConfig::new("cleanup");
            config.table = args.table;
            let mut kernel = Kernel::open()?;
            let n = sync::cleanup(&mut kernel, &config)?;
            println!("deleted {n} nftproxy table(s)");
            Ok(())
        }
        Command::Check(args) => {
            // Handled by `run`, which owns check's exit statuses.
            check(&args).map(|_| ())
        }
        Command::Run(args) => {
            let sub = matches.and_then(|m| m.subcommand_matches("run"));
            let (settings, warnings) = args.settings(sub)?;
            for w in warnings {
                warn!("--config {w}");
            }
            Ok(crate::agent::run(settings)?)
        }
        Command::ConntrackSysctls(args) => {
            conntrack_sysctls(&args, matches.and_then(|m| m.subcommand_matches("conntrack-sysctls")))
        }
        Command::Trace(args) => {
            let options = args.options()?;
            let stdout = std::io::stdout();
            crate::trace::trace(&options, &mut stdout.lock())?;
            Ok(())
        }
        Command::Explain(args) => explain(&args),
        Command::Status(args) => {
            let address = bind_address("--metrics-address", &args.metrics_address)?
                .ok_or(CliError::Address { flag: "--metrics-address", value: args.metrics_address.clone() })?;
            let json = crate::status::fetch(address, &args.selection()?)?;
            match args.output {
                CheckOutput::Json => println!("{}", json.trim_end()),
                CheckOutput::Text => print!("{}", crate::status::to_text(&crate::status::parse(address, &json)?)),
            }
            Ok(())
        }
        Command::Demo(args) => Ok(crate::tools_binary::forward("demo", &args.args)?),
        Command::Bench(args) => Ok(crate::tools_binary::forward("bench", &args.args)?),
    }
}

/// Loads manifests into a cluster state, logging every problem.
pub(crate) fn load_state(args: &ManifestArgs, config: &ProxyConfig) -> Result<ClusterState, CliError> {
    let started = std::time::Instant::now();
    let manifests = source::manifests::load(&args.manifests)?;
    for p in &manifests.problems {
        warn!("{p}");
    }
    let (mut state, problems) = manifests.into_state(&config.hostname);
    if let Some(mut node) = state.node().cloned() {
        crate::nodeaddr::apply_bind_address(&mut node, config.bind_address);
        state.set_node(Some(node));
    }
    for p in &problems {
        warn!("{p}");
    }
    tracing::debug!(
        services = state.service_count(),
        slices = state.slice_count(),
        ms = started.elapsed().as_millis() as u64,
        "manifests loaded"
    );
    Ok(state)
}

/// Writes the ruleset for a state as nft text to `out` (what `render` prints).
fn write_rendered(config: &ProxyConfig, state: &ClusterState, out: &mut impl std::io::Write) -> std::io::Result<()> {
    let started = std::time::Instant::now();
    let (planned, _) = plan_here(config, state);
    tracing::debug!(ms = started.elapsed().as_millis() as u64, "planned");
    write!(out, "{}", planned.ruleset)?;
    out.flush()
}

/// Reads every table here over netlink, checks it against nftproxy's base chains and prints the
/// report; returns the exit status (0 nothing conflicts, 1 warnings or conflicts).
fn check(args: &CheckArgs) -> Result<u8, CliError> {
    let mut report = crate::check::inspect(&args.table.table)?;
    if args.api || args.kubeconfig.is_some() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(CliError::Output)?;
        let (who, denied) = rt.block_on(crate::check::api::denied(args.kubeconfig.as_deref()))?;
        let mut missing = crate::check::permissions::findings(&denied, &who);
        missing.append(&mut report.findings);
        report.findings = missing;
        report.findings.sort_by_key(|f| std::cmp::Reverse(f.severity));
    }
    match args.output {
        CheckOutput::Text => print!("{}", report.to_text()),
        CheckOutput::Json => {
            println!("{}", serde_json::to_string_pretty(&report).map_err(CliError::ReportJson)?)
        }
    }
    Ok(report.exit_code())
}

/// `nftproxy conntrack-sysctls`: applies the settings, prints one line per value, and fails
/// when start-up would have to refuse.
fn conntrack_sysctls(args: &ConntrackSysctlsArgs, matches: Option<&clap::ArgMatches>) -> Result<(), CliError> {
    let settings = conntrack_settings(args, matches)?;
    let roots =
        crate::conntrack::sysctls::SysctlRoots { proc_sys: args.proc_sys_root.clone(), sys: args.sys_root.clone() };
    let cpus = crate::conntrack::sysctls::machine_cpus(&roots);
    let report = crate::conntrack::sysctls::apply(&settings, &roots, cpus);
    crate::conntrack::sysctls::log(&report);
    for applied in &report.applied {
        println!("{applied}");
    }
    match report.failure_summary() {
        Some(failed) if report.refuses_start_up() => Err(CliError::Sysctls(failed)),
        Some(failed) => {
            warn!(failed, "cannot set the conntrack hashsize: /sys is read-only; problems may arise later");
            Ok(())
        }
        None => Ok(()),
    }
}

impl TraceArgs {
    /// The options, checked.
    fn options(&self) -> Result<crate::trace::TraceOptions, CliError> {
        let invalid = |flag: &'static str, value: &str, why: &str| CliError::Invalid {
            flag,
            value: value.to_string(),
            why: why.to_string(),
        };
        let (destination, destination_port) = match self.dst.as_deref().map(str::trim) {
            None => (None, None),
            Some(d) => match (d.parse::<std::net::SocketAddr>(), d.parse::<IpAddr>()) {
                (Ok(a), _) => (Some(a.ip()), Some(a.port())),
                (_, Ok(ip)) => (Some(ip), None),
                _ => return Err(invalid("--dst", d, "expected IP or IP:PORT ([IPv6]:PORT)")),
            },
        };
        if let (Some(d), Some(s)) = (destination, self.src)
            && d.is_ipv4() != s.is_ipv4()
        {
            return Err(invalid("--src", &s.to_string(), "not of --dst's address family"));
        }
        let protocols = match self.proto.as_deref().map(|p| p.trim().to_ascii_lowercase()) {
            None => Vec::new(),
            Some(p) => {
                let number = match p.as_str() {
                    "tcp" => 6,
                    "udp" => 17,
                    "sctp" => 132,
                    "icmp" => 1,
                    "icmpv6" | "ipv6-icmp" => 58,
                    _ => return Err(invalid("--proto", &p, "expected tcp, udp, sctp, icmp or icmpv6")),
                };
                if destination_port.is_some() && ![6, 17, 132].contains(&number) {
                    return Err(invalid("--proto", &p, "a port needs tcp, udp or sctp"));
                }
                vec![number]
            }
        };
        if self.count == 0 {
            return Err(invalid("--count", "0", "trace at least one packet"));
        }
        Ok(crate::trace::TraceOptions {
            source: self.src,
            destination,
            destination_port,
            protocols,
            count: self.count,
            timeout: self.timeout,
            table: self.table.table.clone(),
        })
    }
}

/// The source port of a connection when `--src` has none (any ephemeral port: nftproxy's rules
/// never look at it).
const EXPLAIN_SOURCE_PORT: u16 = 40000;

impl ExplainArgs {
    /// The connection, checked.
    fn connection(&self) -> Result<crate::explain::Connection, CliError> {
        let invalid = |flag: &'static str, value: &str, why: &str| CliError::Invalid {
            flag,
            value: value.to_string(),
            why: why.to_string(),
        };
        let src = self.src.trim();
        let (source, source_port) = match (src.parse::<std::net::SocketAddr>(), src.parse::<IpAddr>()) {
            (Ok(a), _) => (a.ip(), a.port()),
            (_, Ok(ip)) => (ip, EXPLAIN_SOURCE_PORT),
            _ => return Err(invalid("--src", src, "expected IP or IP:PORT ([IPv6]:PORT)")),
        };
        let dst = self.dst.trim();
        let destination =
            dst.parse::<std::net::SocketAddr>().map_err(|_| invalid("--dst", dst, "expected IP:PORT ([IPv6]:PORT)"))?;
        let protocol = match self.proto.trim().to_ascii_lowercase().as_str() {
            "tcp" => 6,
            "udp" => 17,
            "sctp" => 132,
            other => return Err(invalid("--proto", other, "expected tcp, udp or sctp")),
        };
        Ok(crate::explain::Connection {
            source,
            source_port,
            destination: destination.ip(),
            destination_port: destination.port(),
            protocol,
            local: self.local,
            input_interface: self.iif.clone(),
        })
    }
}

/// `nftproxy explain`: evaluates the connection and prints the explanation.
fn explain(args: &ExplainArgs) -> Result<(), CliError> {
    let connection = args.connection()?;
    let table = args.proxy.table.table.clone();
    let (ruleset, locals, origin) = match &args.manifests {
        Some(path) => {
            let config = args.proxy.config()?;
            let state = load_state(&ManifestArgs { manifests: path.clone(), proxy: args.proxy.clone() }, &config)?;
            let (planned, targets) = plan_here(&config, &state);
            // Offline, the node's addresses are the Node's and the node-port addresses; a
            // connection from the node starts at one of them.
            let mut locals: Vec<IpAddr> = state.node().map(|n| n.host_ips.clone()).unwrap_or_default();
            for targets in [&targets.v4, &targets.v6] {
                if let crate::plan::NodePorts::Addresses(ips) = targets {
                    locals.extend(ips.iter().copied());
                }
            }
            if connection.local {
                locals.push(connection.source);
            }
            (crate::nft::lower::lower_ruleset(&planned.ruleset), locals, "manifests")
        }
        None => {
            let mut kernel = Kernel::open()?;
            let names: Vec<(crate::net::IpFamily, &str)> =
                crate::net::IpFamily::ALL.iter().map(|f| (*f, table.as_str())).collect();
            // A running `nftproxy run` owns its tables: looking is allowed all the same.
            let ruleset = kernel.inspect(&names)?;
            let locals = crate::nodeaddr::local_addresses().into_iter().map(|(_, a)| a).collect();
            (ruleset, locals, "kernel")
        }
    };
    let surroundings = crate::explain::LocalAddresses(locals);
    let explanation = crate::explain::explain(&ruleset, &table, origin, &surroundings, &connection)?;
    match args.output {
        CheckOutput::Text => print!("{}", crate::explain::report::to_text(&explanation)),
        CheckOutput::Json => {
            println!("{}", crate::explain::report::to_json(&explanation).map_err(CliError::ReportJson)?)
        }
    }
    Ok(())
}

impl StatusArgs {
    /// The query, checked the way the server checks it.
    fn selection(&self) -> Result<crate::debug_services::Selection, CliError> {
        let mut query = vec![format!("limit={}", self.limit)];
        query.extend(self.namespace.as_ref().map(|n| format!("namespace={n}")));
        query.extend(self.service.as_ref().map(|s| format!("service={s}")));
        crate::debug_services::Selection::parse(&query.join("&")).map_err(|why| CliError::Invalid {
            flag: "--service/--namespace/--limit",
            value: query.join(" "),
            why,
        })
    }
}

/// Parses an optional `IP:PORT` flag (empty disables).
fn bind_address(flag: &'static str, value: &str) -> Result<Option<std::net::SocketAddr>, CliError> {
    if value.trim().is_empty() {
        return Ok(None);
    }
    value.trim().parse().map(Some).map_err(|_| CliError::Address { flag, value: value.to_string() })
}

/// kube-proxy's `--cleanup`: deletes nftproxy's tables here and exits (kube-proxy's own
/// leftovers go in the first sync of the next start, or with `nftproxy check`'s guidance).
pub fn kube_proxy_cleanup(cli: &Cli) -> ExitCode {
    let Command::Run(args) = &cli.command else { return ExitCode::FAILURE };
    let mut config = ProxyConfig::new("cleanup");
    config.table = args.proxy.table.table.clone();
    let result = Kernel::open().map_err(CliError::from).and_then(|mut k| Ok(sync::cleanup(&mut k, &config)?));
    match result {
        Ok(n) => {
            tracing::info!(tables = n, "--cleanup: nftproxy's tables deleted");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// kube-proxy's `--write-config-to`: writes the configuration the command line gives (the
/// defaults under the flags, or the `--config` file defaulted) as YAML, then exits.
pub fn write_config_to(cli: &Cli, matches: &clap::ArgMatches, path: &str) -> ExitCode {
    let Command::Run(args) = &cli.command else { return ExitCode::FAILURE };
    let written = args
        .kube_proxy_config(matches.subcommand_matches("run"))
        .map_err(CliError::from)
        .and_then(|(kp, _)| {
            serde_yaml_ng::to_string(&kp).map_err(|e| CliError::Invalid {
                flag: "--write-config-to",
                value: path.to_string(),
                why: e.to_string(),
            })
        })
        .and_then(|text| {
            std::fs::write(path, text).map_err(|e| CliError::Invalid {
                flag: "--write-config-to",
                value: path.to_string(),
                why: e.to_string(),
            })
        });
    match written {
        Ok(()) => {
            tracing::info!(file = path, "Wrote configuration");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!("{e}");
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Errors that end a command.
#[derive(Debug, Error)]
pub enum CliError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Manifests(#[from] ManifestError),
    #[error(transparent)]
    Sync(#[from] SyncError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    OneShot(#[from] OneShotError),
    #[error(transparent)]
    Run(#[from] crate::agent::RunError),
    #[error(transparent)]
    Tool(#[from] crate::tools_binary::ToolError),
    #[error("cannot write the output: {0}")]
    Output(#[source] std::io::Error),
    #[error("cannot encode the report as JSON: {0}")]
    ReportJson(#[source] serde_json::Error),
    #[error("invalid {flag} {value:?}: expected IP:PORT")]
    Address { flag: &'static str, value: String },
    #[error("cannot set conntrack sysctls: {0}")]
    Sysctls(String),
    #[error("invalid {flag} {value:?}: {why}")]
    Invalid { flag: &'static str, value: String, why: String },
    #[error(transparent)]
    Trace(#[from] crate::trace::TraceError),
    #[error(transparent)]
    Status(#[from] crate::status::StatusError),
    #[error(transparent)]
    HandBack(#[from] crate::handback::HandBackError),
    #[error(transparent)]
    Explain(#[from] crate::explain::ExplainError),
    #[error(transparent)]
    Kube(#[from] crate::source::kube::KubeSourceError),
}
