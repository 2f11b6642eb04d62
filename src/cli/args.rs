//! The command line as clap reads it: the subcommands and their flags (kube-proxy's names where
//! kube-proxy has the flag). What the flags and a `--config` file come to is
//! [`settings`](super::settings); what each command does is [`commands`](super::commands).

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use super::kube_proxy;
use crate::config::{LoggingFormat, ProxyConfig};

/// nftproxy: a Kubernetes service proxy on nftables.
#[derive(Debug, Parser)]
#[command(name = "nftproxy", version, about, long_about = None)]
pub struct Cli {
    /// Log verbosity: -v debug, -vv trace (RUST_LOG overrides).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Log format, as kube-proxy's flag: `text`, or `json` (one JSON object per line on stderr).
    /// `run --config` files may set it as `logging.format`; this flag overrides them.
    #[arg(long, value_name = "FORMAT", global = true, value_parser = parse_logging_format)]
    pub logging_format: Option<LoggingFormat>,
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
    /// Hand the node back to kube-proxy (a rollback): wait until nftproxy has stopped here and
    /// kube-proxy has synced its own rules, then delete nftproxy's tables, and stay until
    /// stopped (deploy/hand-back's DaemonSet runs it on every node). With --check, exit 0 when
    /// no table of nftproxy's is left here, 1 otherwise (its readiness probe), 2 when it could
    /// not tell.
    HandBack(HandBackArgs),
    /// Report foreign tables and base chains whose hooks and priorities may conflict with
    /// nftproxy's (a leftover kube-proxy, Docker, firewalld, drop policies, early NAT). Exit
    /// status: 0 nothing conflicts, 1 warnings or conflicts, 2 the check could not run.
    Check(CheckArgs),
    /// Run as the node's service proxy: watch the sources and keep the kernel in step.
    Run(Box<RunArgs>),
    /// Set the kernel's conntrack limits and timeouts as kube-proxy does at start-up (the
    /// `conntrack:` settings of --config and the --conntrack-* flags), then exit: for a
    /// privileged init container, so `run` itself needs no writable /proc/sys. Exit status 1
    /// when a value could not be set (a read-only /sys for the hashsize only warns).
    ConntrackSysctls(ConntrackSysctlsArgs),
    /// Follow real packets (new connections) through nftproxy's chains with the kernel's
    /// nftrace and print each one's way, its service and endpoint, and the verdict. The trace
    /// table it adds is removed when it exits, however it ends. Exit status 1 when no packet
    /// matched.
    Trace(TraceArgs),
    /// Tell what nftproxy's ruleset does to one new connection, without sending a packet: every
    /// base chain, rule and map element it matches, then the outcome (DNAT to which endpoints
    /// with which share, masquerade or not and why, or why it is dropped or rejected). Reads
    /// the ruleset the kernel holds here, or with --manifests plans it offline.
    Explain(ExplainArgs),
    /// Print what a running `nftproxy run` programmed, from its `/debug/services` on the
    /// metrics address: every service port with its addresses and the endpoints each policy
    /// uses here, left-out services and objects, and the last sync.
    Status(StatusArgs),
    /// Build a lab of network namespaces, send traffic through a ClusterIP and show the results
    /// (runs `nftproxy-tools demo`; `nftproxy demo --help` for its options).
    #[command(disable_help_flag = true)]
    Demo(ToolArgs),
    /// Measure syncs, memory and the data plane at cluster scale in network namespaces (runs
    /// `nftproxy-tools bench`; `nftproxy bench --help` for its options).
    #[command(disable_help_flag = true)]
    Bench(ToolArgs),
}

/// Arguments handed to `nftproxy-tools` as they are.
#[derive(Debug, Args)]
pub struct ToolArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "ARGS")]
    pub args: Vec<std::ffi::OsString>,
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
    /// A kube-proxy KubeProxyConfiguration file. As in kube-proxy, it then decides every
    /// kube-proxy setting but --hostname-override and the log format (flags beside it are
    /// ignored, with a warning naming them).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub proxy: ProxyArgs,
    #[command(flatten)]
    pub conntrack: ConntrackArgs,
    /// Minimum time between the starts of two syncs (but for the retries of a failed one):
    /// changes arriving faster are applied together.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
    pub min_sync_period: std::time::Duration,
    /// Time between periodic syncs: each reads nftproxy's tables back and repairs rules changed
    /// outside nftproxy, unless nobody can have changed them (owned tables, or an unchanged
    /// ruleset generation) and the last read-back is less than an hour old.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub sync_period: std::time::Duration,
    /// Address of /healthz and /livez; a bare IP gets port 10256 (empty disables).
    #[arg(long, value_name = "IP:PORT", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: String,
    /// Address of /metrics, /healthz, /proxyMode and /configz; a bare IP gets port 10249
    /// (empty disables).
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: String,
    /// Export the per-service connection and reject counters on /metrics (one series per
    /// service port and family: about 10,000 at 10,000 Services). `false` leaves them out, and
    /// a scrape no longer reads the kernel's counters; the kernel still counts (`nft list set`).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub service_counters: bool,
    /// Address of /debug/services (what `nftproxy status` reads: every service and endpoint this
    /// node programs). Empty (the default): on the metrics address when that is a loopback
    /// address, else nowhere, so that opening /metrics to Prometheus does not open it too. An
    /// IP:PORT serves it there (the metrics address itself shares that server).
    #[arg(long, value_name = "IP:PORT", default_value = "")]
    pub debug_bind_address: String,
    /// Treat a failure to bind the healthz or metrics port as fatal and exit (otherwise it is
    /// logged and retried every 5 seconds, as upstream).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub bind_address_hard_fail: bool,
    /// How often manifests are checked for changes.
    #[arg(long, value_name = "DURATION", default_value = "200ms", value_parser = humantime::parse_duration, hide = true)]
    pub manifests_poll: std::time::Duration,
    /// Remove kube-proxy's leftovers (its nftables tables, its iptables-mode KUBE- chains and
    /// jumps, IPVS state) in the first sync, as kube-proxy does in nftables mode (`false` keeps
    /// them; `nftproxy check` lists them).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub cleanup_kube_proxy: bool,
    /// kube-proxy's own flags, when started with kube-proxy's command line.
    #[arg(skip)]
    pub kube_proxy: kube_proxy::KubeProxyExtras,
}

/// kube-proxy's `--conntrack-*` flags: the kernel conntrack settings applied at start-up (with
/// `--config`, the file's `conntrack:` decides instead, as in kube-proxy).
#[derive(Debug, Clone, Args)]
pub struct ConntrackArgs {
    /// Maximum number of NAT connections to track per CPU core (0 to leave the limit as-is and
    /// ignore conntrack-min).
    #[arg(long, value_name = "N", default_value_t = 32768)]
    pub conntrack_max_per_core: u32,
    /// Minimum number of conntrack entries to allocate, regardless of conntrack-max-per-core
    /// (set conntrack-max-per-core=0 to leave the limit as-is).
    #[arg(long, value_name = "N", default_value_t = 131072)]
    pub conntrack_min: u32,
    /// Idle timeout for established TCP connections (0 to leave as-is).
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = humantime::parse_duration)]
    pub conntrack_tcp_timeout_established: std::time::Duration,
    /// NAT timeout for TCP connections in the CLOSE_WAIT state (0 to leave as-is).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = humantime::parse_duration)]
    pub conntrack_tcp_timeout_close_wait: std::time::Duration,
    /// Enable liberal mode for tracking TCP packets by setting nf_conntrack_tcp_be_liberal to 1.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub conntrack_tcp_be_liberal: bool,
    /// Idle timeout for UNREPLIED UDP connections (0 to leave as-is).
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = humantime::parse_duration)]
    pub conntrack_udp_timeout: std::time::Duration,
    /// Idle timeout for ASSURED UDP connections (0 to leave as-is).
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = humantime::parse_duration)]
    pub conntrack_udp_timeout_stream: std::time::Duration,
}

/// `conntrack-sysctls` options.
#[derive(Debug, Args)]
pub struct ConntrackSysctlsArgs {
    /// A kube-proxy KubeProxyConfiguration file: its `conntrack:` settings decide (the
    /// `--conntrack-*` flags are then ignored, as kube-proxy ignores them).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub conntrack: ConntrackArgs,
    /// Where /proc/sys is (tests point it elsewhere).
    #[arg(long, value_name = "PATH", default_value = "/proc/sys", hide = true)]
    pub proc_sys_root: PathBuf,
    /// Where /sys is (tests point it elsewhere).
    #[arg(long, value_name = "PATH", default_value = "/sys", hide = true)]
    pub sys_root: PathBuf,
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
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub masquerade_all: bool,
    /// The packet-mark bit that requests masquerade (14 → 0x4000).
    #[arg(long, value_name = "BIT", default_value_t = 14)]
    pub masquerade_bit: u32,
    /// Addresses that accept NodePorts: CIDRs and the keywords `primary` (the default), `all`
    /// and `localhost` (127.0.0.0/8 and ::1/128; NodePorts are never served on loopback),
    /// comma-separated; a family none of them names accepts NodePorts on all its local
    /// addresses.
    #[arg(long, value_name = "CIDRS")]
    pub nodeport_addresses: Vec<String>,
    /// Overrides this node's primary IP (of its family) for `primary` node-port addresses and
    /// the LoadBalancerSourceRanges node check; nothing binds to it (kube-proxy's historical
    /// name). `0.0.0.0` or `::` leaves the Node's own addresses.
    #[arg(long, value_name = "IP", default_value = "0.0.0.0")]
    pub bind_address: String,
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

/// `hand-back` options.
#[derive(Debug, Args)]
pub struct HandBackArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// Where kube-proxy serves /healthz on this node (its healthzBindAddress).
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10256")]
    pub healthz_address: std::net::SocketAddr,
    /// Only tell whether the node is handed back: exit 0 when no table of nftproxy's is left.
    #[arg(long)]
    pub check: bool,
    /// Exit once the tables are deleted (or none was there) instead of staying.
    #[arg(long, conflicts_with = "check")]
    pub once: bool,
}

impl HandBackArgs {
    /// The hand-back these options describe.
    pub(crate) fn hand_back(&self) -> crate::handback::HandBack {
        crate::handback::HandBack {
            table: self.table.table.clone(),
            healthz: self.healthz_address,
            every: std::time::Duration::from_secs(1),
        }
    }
}

/// `trace` options.
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Trace packets to this address, and port if given (`10.96.0.10:80`, `[fd00::10]:80`).
    #[arg(long, value_name = "IP[:PORT]")]
    pub dst: Option<String>,
    /// Trace packets from this address.
    #[arg(long, value_name = "IP")]
    pub src: Option<IpAddr>,
    /// Trace this protocol only: tcp, udp, sctp, icmp, icmpv6 (default: any; with a port,
    /// tcp, udp and sctp).
    #[arg(long, value_name = "PROTO")]
    pub proto: Option<String>,
    /// Exit after this many packets.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub count: usize,
    /// Exit after this long, however many packets were traced.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = humantime::parse_duration)]
    pub timeout: std::time::Duration,
    #[command(flatten)]
    pub table: TableArgs,
}

/// `explain` options.
#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// The connection's source address, and port if given (`10.244.1.10`, `[fd00::1]:40000`).
    #[arg(long, value_name = "IP[:PORT]")]
    pub src: String,
    /// The connection's destination (`10.96.0.10:80`, `[fd00:96::10]:80`).
    #[arg(long, value_name = "IP:PORT")]
    pub dst: String,
    /// tcp, udp or sctp.
    #[arg(long, value_name = "PROTO", default_value = "tcp")]
    pub proto: String,
    /// The connection starts on the node itself (entering at output, not prerouting).
    #[arg(long)]
    pub local: bool,
    /// The interface an arriving connection comes in on, for rules that match it
    /// (--detect-local-mode BridgeInterface or InterfaceNamePrefix).
    #[arg(long, value_name = "NAME", conflicts_with = "local")]
    pub iif: Option<String>,
    /// Evaluate the ruleset planned from these manifests and the proxy flags (offline) instead
    /// of the one the kernel holds here.
    #[arg(long, value_name = "PATH")]
    pub manifests: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    pub output: CheckOutput,
    #[command(flatten)]
    pub proxy: ProxyArgs,
}

/// `status` options.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Where `nftproxy run` serves metrics (its --metrics-bind-address).
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10249")]
    pub metrics_address: String,
    /// Only this service.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub service: Option<String>,
    /// Only this namespace.
    #[arg(long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// Service ports shown at most (the rest are counted).
    #[arg(long, value_name = "N", default_value_t = crate::debug_services::DEFAULT_LIMIT)]
    pub limit: usize,
    /// Output format.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    pub output: CheckOutput,
}

/// `check` options.
#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// Also ask the API server, with this kubeconfig, whether nftproxy's identity may list,
    /// watch and write what nftproxy uses (after an image swap: kube-proxy's ServiceAccount and
    /// its ClusterRole, system:node-proxier). Each missing permission is a finding.
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<String>,
    /// As --kubeconfig, with the in-cluster ServiceAccount (inside nftproxy's pod).
    #[arg(long, conflicts_with = "kubeconfig")]
    pub api: bool,
    /// Report format.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    pub output: CheckOutput,
}

/// How `check` and `status` print their report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CheckOutput {
    /// Readable text (`check`: findings, then every base chain by hook).
    Text,
    /// One JSON object (`check`: findings with stable `kind` codes, base chains; `status`:
    /// `/debug/services` as served).
    Json,
}

fn parse_logging_format(s: &str) -> Result<LoggingFormat, String> {
    LoggingFormat::parse("--logging-format", s).map_err(|e| e.to_string())
}
