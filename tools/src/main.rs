use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// nftproxy's tools: the lab demo and the scale benchmark.
#[derive(Debug, Parser)]
#[command(name = "nftproxy-tools", version, about, long_about = None)]
struct Cli {
    /// Log verbosity: -v debug, -vv trace (RUST_LOG overrides).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Build a lab of network namespaces, send traffic through a ClusterIP and show the results.
    Demo(nftproxy_tools::demo::DemoArgs),
    /// Measure syncs, memory and the data plane at cluster scale in network namespaces.
    Bench(Box<nftproxy_tools::bench::BenchArgs>),
    /// Write the benchmark's synthetic cluster (SERVICESxENDPOINTS) as manifests, for
    /// `nftproxy render|sync|run --manifests`.
    Cluster {
        /// The size, e.g. 10000x10.
        #[arg(long, default_value = "1000x10")]
        size: String,
        /// The file to write (default: standard output).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        /// One `kind: List` (as `kubectl get -o yaml` prints) instead of a stream of documents.
        #[arg(long)]
        list: bool,
    },
    /// nftproxy and upstream kube-proxy v1.37.2 (nftables, and iptables as a reference) one
    /// after the other through the same real API server, side by side: `bench` with only its
    /// head-to-head (`--h2h-*` options; `--head-to-head SIZES` is implied by `--h2h-sizes`).
    HeadToHead(Box<nftproxy_tools::bench::BenchArgs>),
    /// Randomised clusters through a real API server: upstream kube-proxy v1.37 (nftables
    /// mode), nftproxy and `nftproxy explain` compared probe by probe; writes a dated results
    /// file.
    Random(nftproxy_tools::random::RandomArgs),
    /// A cluster of real nodes (containerd and kubelet in lab namespaces) with kubeadm's
    /// kube-proxy and CoreDNS addons, held until Ctrl-C.
    Nodes(nftproxy_tools::node::cli::NodesArgs),
    /// Upstream's e2e tests (`e2e.test` v1.37.2: the Conformance specs of `[sig-network]`, or
    /// `--wide`) on real nodes with kubeadm's kube-proxy, then with nftproxy on the same
    /// cluster; writes both columns to a dated results file in docs/e2e/.
    E2e(nftproxy_tools::node::cli::E2eArgs),
    /// One phase of the benchmark, inside a benchmark namespace (started by `bench`).
    #[command(hide = true)]
    BenchWorker(nftproxy_tools::bench::worker::WorkerArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default = match cli.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command {
        Command::Demo(args) => nftproxy_tools::demo::run(&args).map_err(|e| e.to_string()),
        Command::Bench(args) => nftproxy_tools::bench::run(&args).map_err(|e| e.to_string()),
        Command::HeadToHead(mut args) => {
            if args.head_to_head.is_none() {
                args.head_to_head = Some(args.h2h_sizes.join(","));
            }
            nftproxy_tools::bench::run(&args).map_err(|e| e.to_string())
        }
        Command::Random(args) => nftproxy_tools::random::run_cli(&args).map_err(|e| e.to_string()),
        Command::BenchWorker(args) => nftproxy_tools::bench::worker::run(&args).map_err(|e| e.to_string()),
        Command::Nodes(args) => nftproxy_tools::node::cli::run(&args),
        Command::E2e(args) => nftproxy_tools::node::cli::run_e2e(&args),
        Command::Cluster { size, out, list } => write_cluster(&size, out.as_deref(), list),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn write_cluster(size: &str, out: Option<&std::path::Path>, list: bool) -> Result<(), String> {
    let size = nftproxy_tools::bench::parse_size(size).map_err(|e| e.to_string())?;
    let write = |w: &mut dyn std::io::Write| -> std::io::Result<()> {
        let mut w = std::io::BufWriter::new(w);
        if list {
            nftproxy_tools::cluster::write_list_yaml(size, &mut w)?;
        } else {
            nftproxy_tools::cluster::write_yaml(size, &mut w)?;
        }
        std::io::Write::flush(&mut w)
    };
    let result = match out {
        Some(path) => std::fs::File::create(path).and_then(|mut f| write(&mut f)),
        None => write(&mut std::io::stdout().lock()),
    };
    result.map_err(|e| format!("cannot write the cluster: {e}"))
}
