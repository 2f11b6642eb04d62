//! Command-line interface. Flag names follow kube-proxy's.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use thiserror::Error;
use tracing::{error, warn};

use crate::config::{self, ConfigError, ProxyConfig};
use crate::model::ClusterState;
use crate::netlink::{Kernel, NetlinkError};
use crate::plan::slots::SlotTable;
use crate::plan::{Plan, PlanInput, plan};
use crate::reconcile::{self, SyncError};
use crate::source::{self, manifests::ManifestError};

/// nftproxy: a Kubernetes service proxy on nftables.
#[derive(Debug, Parser)]
#[command(name = "nftproxy", version, about, long_about = None)]
pub struct Cli {
    /// Log verbosity: -v debug, -vv trace (RUST_LOG overrides).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the desired ruleset as nft text; touches no kernel state.
    Render(ManifestArgs),
    /// Apply the desired ruleset in the current network namespace as one transaction.
    Sync(ManifestArgs),
    /// Delete nftproxy's tables (and only those) in the current network namespace.
    Cleanup(TableArgs),
    /// Report foreign tables and base chains whose hooks and priorities may conflict with
    /// nftproxy's (a leftover kube-proxy, Docker, firewalld, drop policies, early NAT). Exit
    /// status: 0 nothing conflicts, 1 warnings or conflicts, 2 the check could not run.
    Check(CheckArgs),
    /// Run as the node's service proxy: watch the sources and keep the kernel in step.
    Run(RunArgs),
    /// Build a lab of network namespaces, send traffic through a ClusterIP and show the results.
    Demo(crate::demo::DemoArgs),
    /// Measure syncs, memory and the data plane at cluster scale in network namespaces.
    Bench(crate::bench::BenchArgs),
    /// One phase of the benchmark, inside a benchmark namespace (started by `bench`).
    #[command(hide = true)]
    BenchWorker(crate::bench::worker::WorkerArgs),
}

/// `run` options.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// A YAML/JSON manifest file or a directory of them, watched for changes (instead of the
    /// Kubernetes API).
    #[arg(long, value_name = "PATH", conflicts_with = "kubeconfig")]
    pub manifests: Option<PathBuf>,
    /// A kubeconfig for the Kubernetes API (default: in-cluster service account).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<String>,
    /// A kube-proxy KubeProxyConfiguration file; flags given on the command line override it.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub proxy: ProxyArgs,
    /// Minimum time between syncs: changes arriving faster are applied together.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
    pub min_sync_period: std::time::Duration,
    /// Time between full syncs, which also repair rules changed outside nftproxy.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub sync_period: std::time::Duration,
    /// Address of /healthz and /livez (empty disables).
    #[arg(long, value_name = "IP:PORT", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: String,
    /// Address of /metrics and /proxyMode (empty disables).
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: String,
    /// How often manifests are checked for changes.
    #[arg(long, value_name = "DURATION", default_value = "200ms", value_parser = humantime::parse_duration, hide = true)]
    pub manifests_poll: std::time::Duration,
}

impl RunArgs {
    /// Settings from the flags, the config file under them; warnings name unused file fields.
    pub fn settings(
        &self,
        matches: Option<&clap::ArgMatches>,
    ) -> Result<(crate::run::RunSettings, Vec<String>), CliError> {
        let explicit = |id: &str| -> bool {
            matches.is_some_and(|m| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
        };
        let (file, warnings) = match &self.config {
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|e| ConfigError::File(format!("{}: {e}", path.display())))?;
                config::file::parse(&text)?
            }
            None => (config::file::FileSettings::default(), Vec::new()),
        };
        let proxy = config::merge(self.proxy.config()?, &explicit, &file)?;
        let pick = |id: &str, flag: std::time::Duration, from_file: Option<std::time::Duration>| {
            if explicit(id) { flag } else { from_file.unwrap_or(flag) }
        };
        let address = |id: &'static str, flag: &str, from_file: Option<Option<std::net::SocketAddr>>| {
            if explicit(id) { bind_address(id, flag) } else { from_file.map_or_else(|| bind_address(id, flag), Ok) }
        };
        let source = match (&self.manifests, &self.kubeconfig) {
            (Some(path), _) => crate::run::SourceSetting::Manifests(path.clone()),
            (None, Some(kc)) => crate::run::SourceSetting::Kubernetes { kubeconfig: Some(kc.clone()) },
            (None, None) => crate::run::SourceSetting::Kubernetes { kubeconfig: file.kubeconfig.clone() },
        };
        let settings = crate::run::RunSettings {
            proxy,
            source,
            timing: crate::reconcile::runner::Timing {
                min_sync_period: pick("min_sync_period", self.min_sync_period, file.min_sync_period),
                sync_period: pick("sync_period", self.sync_period, file.sync_period),
                ..Default::default()
            },
            healthz: address("healthz_bind_address", &self.healthz_bind_address, file.healthz_bind_address)?,
            metrics: address("metrics_bind_address", &self.metrics_bind_address, file.metrics_bind_address)?,
            poll: self.manifests_poll,
            conntrack: file.conntrack.clone(),
        };
        Ok((settings, warnings))
    }
}

/// Where objects come from, plus the proxy flags.
#[derive(Debug, Args)]
pub struct ManifestArgs {
    /// A YAML/JSON manifest file or a directory of them (Services, EndpointSlices, Nodes).
    #[arg(long, value_name = "PATH")]
    pub manifests: PathBuf,
    #[command(flatten)]
    pub proxy: ProxyArgs,
}

/// kube-proxy-compatible flags.
#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// This node's name, as in EndpointSlice `nodeName` (default: the machine's hostname).
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// Pod CIDRs, comma-separated (IPv4 and/or IPv6); ClusterIP traffic from outside is masqueraded.
    #[arg(long, value_name = "CIDRS", default_value = "")]
    pub cluster_cidr: String,
    /// Masquerade all traffic to ClusterIPs.
    #[arg(long)]
    pub masquerade_all: bool,
    /// The packet-mark bit that requests masquerade (14 → 0x4000).
    #[arg(long, value_name = "BIT", default_value_t = 14)]
    pub masquerade_bit: u32,
    /// Addresses that accept NodePorts: `primary` (default) or CIDRs, comma-separated.
    #[arg(long, value_name = "CIDRS")]
    pub nodeport_addresses: Vec<String>,
    /// How pod traffic is recognised: ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix.
    #[arg(long, value_name = "MODE", default_value = "ClusterCIDR")]
    pub detect_local_mode: String,
    /// The pod bridge, for --detect-local-mode BridgeInterface.
    #[arg(long, value_name = "NAME")]
    pub pod_bridge_interface: Option<String>,
    /// The pod interface prefix, for --detect-local-mode InterfaceNamePrefix.
    #[arg(long, value_name = "PREFIX")]
    pub pod_interface_name_prefix: Option<String>,
    /// Delete stale UDP/SCTP conntrack entries after each sync (`false` to disable).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub conntrack_cleanup: bool,
    /// Own nftproxy's tables while running so no other process can change them (`flags owner,
    /// persist`, Linux >= 6.9; ignored on older kernels). `false` allows editing them by hand.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub table_ownership: bool,
    #[command(flatten)]
    pub table: TableArgs,
}

/// The table name.
#[derive(Debug, Clone, Args)]
pub struct TableArgs {
    /// The nftables table name (in the ip and ip6 families).
    #[arg(long, value_name = "NAME", default_value = ProxyConfig::DEFAULT_TABLE)]
    pub table: String,
}

/// `check` options.
#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// Report format.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    pub output: CheckOutput,
}

/// How `check` prints its report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CheckOutput {
    /// Readable text: findings, then every base chain by hook.
    Text,
    /// One JSON object (findings with stable `kind` codes, base chains).
    Json,
}

/// `check`'s exit status when it could not read the ruleset (1 means it found problems).
const CHECK_FAILED: u8 = 2;

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
    Demo(#[from] crate::demo::DemoError),
    #[error(transparent)]
    Run(#[from] crate::run::RunError),
    #[error(transparent)]
    Bench(#[from] crate::bench::BenchError),
    #[error("cannot encode the check report as JSON: {0}")]
    ReportJson(#[source] serde_json::Error),
    #[error("invalid {flag} {value:?}: expected IP:PORT")]
    Address { flag: &'static str, value: String },
}

/// Parses an optional `IP:PORT` flag (empty disables).
fn bind_address(flag: &'static str, value: &str) -> Result<Option<std::net::SocketAddr>, CliError> {
    if value.trim().is_empty() {
        return Ok(None);
    }
    value.trim().parse().map(Some).map_err(|_| CliError::Address { flag, value: value.to_string() })
}

impl ProxyArgs {
    /// Validated settings.
    pub fn config(&self) -> Result<ProxyConfig, ConfigError> {
        let hostname = match &self.hostname_override {
            Some(h) => h.trim().to_string(),
            None => nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default(),
        };
        let mut c = ProxyConfig::new(hostname.to_lowercase());
        c.cluster_cidrs = config::parse_cidrs("--cluster-cidr", &self.cluster_cidr)?;
        c.masquerade_all = self.masquerade_all;
        c.masquerade_bit = self.masquerade_bit;
        c.nodeport_addresses = config::parse_nodeport_addresses(&self.nodeport_addresses)?;
        c.detect_local = config::parse_detect_local(
            &self.detect_local_mode,
            self.pod_bridge_interface.as_deref(),
            self.pod_interface_name_prefix.as_deref(),
        )?;
        c.table = self.table.table.clone();
        c.conntrack_cleanup = self.conntrack_cleanup;
        c.table_ownership = self.table_ownership;
        c.validate()?;
        Ok(c)
    }
}

/// Loads manifests into a cluster state, logging every problem.
pub fn load_state(args: &ManifestArgs, config: &ProxyConfig) -> Result<ClusterState, CliError> {
    let manifests = source::manifests::load(&args.manifests)?;
    for p in &manifests.problems {
        warn!("{p}");
    }
    let (state, problems) = source::state_from_manifests(&manifests, &config.hostname);
    for p in &problems {
        warn!("{p}");
    }
    Ok(state)
}

/// Plans the ruleset for a state (resolving node-port addresses in this namespace), keeping
/// endpoint blocks where `slots` has them.
pub fn plan_for(config: &ProxyConfig, state: &ClusterState, slots: &mut SlotTable) -> Plan {
    let targets = crate::nodeaddr::resolve(&config.nodeport_addresses, state.node());
    plan(&PlanInput { config, state, nodeports_v4: &targets.v4, nodeports_v6: &targets.v6 }, slots)
}

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
    match execute(cli, matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Reads every table here over netlink, checks it against nftproxy's base chains and prints the
/// report; returns the exit status (0 nothing conflicts, 1 warnings or conflicts).
fn check(args: &CheckArgs) -> Result<u8, CliError> {
    let tables = Kernel::open()?.list_tables()?;
    let ports: Vec<u32> = tables.iter().filter_map(|t| t.owner).collect();
    let owners = crate::check::host::netlink_owners(&ports);
    let legacy = crate::check::host::legacy_iptables();
    let ours = crate::plan::base_chains();
    let report = crate::check::check(&crate::check::CheckInput {
        tables: &tables,
        table: &args.table.table,
        ours: &ours,
        owners: &owners,
        legacy_iptables: &legacy,
    });
    match args.output {
        CheckOutput::Text => print!("{}", report.to_text()),
        CheckOutput::Json => {
            println!("{}", serde_json::to_string_pretty(&report).map_err(CliError::ReportJson)?)
        }
    }
    Ok(report.exit_code())
}

fn execute(cli: Cli, matches: Option<&clap::ArgMatches>) -> Result<(), CliError> {
    match cli.command {
        Command::Render(args) => {
            let config = args.proxy.config()?;
            let state = load_state(&args, &config)?;
            print!("{}", plan_for(&config, &state, &mut SlotTable::new()).ruleset);
            Ok(())
        }
        Command::Sync(args) => {
            let config = args.proxy.config()?;
            let state = load_state(&args, &config)?;
            let mut kernel = Kernel::open()?;
            let (planned, report) =
                reconcile::sync_with_kernel(&mut kernel, &config, |slots| plan_for(&config, &state, slots))?;
            if config.conntrack_cleanup
                && let Err(e) = crate::conntrack::clean(&planned.conntrack)
            {
                warn!(error = %e, "conntrack cleanup failed");
            }
            println!(
                "synced {} services ({} ports, {} endpoints): 1 transaction, {} messages, {:.1} ms",
                planned.stats.services,
                planned.stats.service_ports,
                planned.stats.endpoints,
                report.apply.messages,
                report.total.as_secs_f64() * 1000.0
            );
            Ok(())
        }
        Command::Cleanup(args) => {
            let mut config = ProxyConfig::new("cleanup");
            config.table = args.table;
            let mut kernel = Kernel::open()?;
            let n = reconcile::cleanup(&mut kernel, &config)?;
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
            Ok(crate::run::run(settings)?)
        }
        Command::Demo(args) => Ok(crate::demo::run(&args)?),
        Command::Bench(args) => Ok(crate::bench::run(&args)?),
        Command::BenchWorker(args) => Ok(crate::bench::worker::run(&args)?),
    }
}
