//! `nftproxy trace`: follows real packets with the kernel's nftrace and prints each one's way
//! through nftproxy's chains, with the service port and the endpoint in Kubernetes names and
//! the final verdict.
//!
//! The kernel side is `netlink::trace` (a table owned by this process marks the packets; a
//! second socket receives the events). Here: [`packet`] groups the events per packet,
//! `explain::services` names destinations and endpoints from nftproxy's maps, [`report`] prints a
//! packet. The table goes away with the process, however it ends; other tables are only read.

pub(crate) mod packet;
pub(crate) mod report;

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::warn;

use crate::explain::services::ServiceDirectory;
use crate::net::IpFamily;
use crate::net::headers::{self, protocol_name};
use crate::netlink::trace::{TraceEvent, TraceListener, TraceMatch, TraceTable};
use crate::netlink::{Kernel, NetlinkError};
use packet::{Correlator, PacketTrace, TABLE_PREFIX};
use report::{Context, PacketReport};

/// A packet is complete after this long without events (one packet's events arrive within
/// microseconds).
const QUIET: Duration = Duration::from_millis(300);
/// How long one wait for events lasts (and so how soon a signal or the timeout is noticed).
const POLL: Duration = Duration::from_millis(100);
/// New connections marked per second at most.
const RATE: u32 = 20;
/// The ruleset is read again at most this often when a packet names something unknown.
const REREAD: Duration = Duration::from_secs(2);

/// What to trace and for how long.
#[derive(Debug, Clone)]
pub(crate) struct TraceOptions {
    pub(crate) source: Option<IpAddr>,
    pub(crate) destination: Option<IpAddr>,
    pub(crate) destination_port: Option<u16>,
    /// IANA protocol numbers (empty: any).
    pub(crate) protocols: Vec<u8>,
    /// Packets to trace before exiting.
    pub(crate) count: usize,
    pub(crate) timeout: Duration,
    /// nftproxy's table name (in the `ip` and `ip6` families).
    pub(crate) table: String,
}

impl TraceOptions {
    fn matching(&self) -> TraceMatch {
        TraceMatch {
            source: self.source,
            destination: self.destination,
            protocols: self.protocols.clone(),
            destination_port: self.destination_port,
            rate: RATE,
        }
    }

    /// `tcp to 10.96.0.10:80 from 192.168.50.100`.
    fn describe(&self) -> String {
        let mut out = String::new();
        if !self.protocols.is_empty() {
            let names: Vec<String> = self.protocols.iter().map(|p| protocol_name(*p)).collect();
            out.push_str(&names.join("/"));
            out.push(' ');
        }
        match (self.destination, self.destination_port) {
            (Some(ip), port) => out.push_str(&format!("to {} ", headers::endpoint(ip, port))),
            (None, Some(port)) => out.push_str(&format!("to port {port} ")),
            (None, None) => {}
        }
        if let Some(ip) = self.source {
            out.push_str(&format!("from {ip} "));
        }
        if out.is_empty() { "every new connection".into() } else { format!("new connections {}", out.trim_end()) }
    }
}

/// Errors that end a trace.
#[derive(Debug, Error)]
pub enum TraceError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error("cannot write the trace: {0}")]
    Output(#[source] io::Error),
    #[error("no packet matched within {}s", .0.as_secs())]
    NothingTraced(Duration),
}

/// Reads what the report needs: nftproxy's maps (whoever owns the tables), every rule's comment
/// and every base chain's hook. The maps are dropped once indexed.
fn read_context(kernel: &mut Kernel, table: &str) -> Result<Context, NetlinkError> {
    let names: Vec<(IpFamily, &str)> = IpFamily::ALL.iter().map(|f| (*f, table)).collect();
    let services = ServiceDirectory::new(&kernel.inspect_sets(&names)?);
    let rules = kernel.rule_notes()?;
    let hooks: Vec<_> = kernel
        .list_tables()?
        .into_iter()
        .flat_map(|t| {
            t.base_chains()
                .map(|(c, b)| {
                    (
                        (t.family, t.name.clone(), c.name.clone()),
                        (t.family.hook_name(b.hooknum).unwrap_or("?"), b.priority),
                    )
                })
                .collect::<Vec<_>>()
        })
        .collect();
    Ok(Context::new(services, rules, hooks, interface_names()))
}

/// Interface index → name, in this network namespace.
fn interface_names() -> HashMap<u32, String> {
    let Ok(addresses) = nix::ifaddrs::getifaddrs() else { return HashMap::new() };
    let mut out = HashMap::new();
    for a in addresses {
        if let Ok(index) = nix::net::if_::if_nametoindex(a.interface_name.as_str()) {
            out.insert(index, a.interface_name);
        }
    }
    out
}

/// Traces until `options.count` packets were seen, the timeout passes, or SIGINT/SIGTERM;
/// prints each packet to `out` as it completes. Returns how many were traced.
pub(crate) fn trace(options: &TraceOptions, out: &mut dyn Write) -> Result<usize, TraceError> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let _ = signal_hook::flag::register(signal, Arc::clone(&stop));
    }
    // Listen first, so the first marked packet is not missed.
    let mut listener = TraceListener::open()?;
    let table = TraceTable::create(&format!("{TABLE_PREFIX}{}", std::process::id()), &options.matching())?;
    let mut kernel = Kernel::open()?;
    let mut context = read_context(&mut kernel, &options.table)?;
    let mut read_at = Instant::now();
    if context.services.is_empty() {
        warn!(table = %options.table, "no nftproxy table here: is nftproxy running in this network namespace?");
    }
    eprintln!(
        "tracing {} (up to {} packet(s), at most {}); table inet {} goes away when this exits",
        options.describe(),
        options.count,
        humantime::format_duration(options.timeout),
        table.name()
    );

    let mut correlator = Correlator::new(table.name(), QUIET, options.count);
    let mut print = |trace: PacketTrace, context: &mut Context, kernel: &mut Kernel| -> Result<(), TraceError> {
        if context.misses(&trace) && read_at.elapsed() >= REREAD {
            // One copy at a time: at 10,000 services the maps are tens of MB.
            *context = Context::default();
            *context = read_context(kernel, &options.table)?;
            read_at = Instant::now();
        }
        write!(out, "{}", PacketReport::new(&trace, context)).and_then(|()| out.flush()).map_err(TraceError::Output)
    };
    let started = Instant::now();
    let mut events: Vec<TraceEvent> = Vec::new();
    let mut warned = false;
    while !stop.load(Ordering::Relaxed) && started.elapsed() < options.timeout {
        if correlator.started() >= options.count && correlator.pending() == 0 {
            break;
        }
        let lost = listener.receive(POLL, &mut events)?;
        if lost && !warned {
            warn!("the kernel dropped trace events (receive buffer full): some packets may be incomplete");
            warned = true;
        }
        let now = Instant::now();
        for event in events.drain(..) {
            for done in correlator.push(event, now) {
                print(done, &mut context, &mut kernel)?;
            }
        }
        for done in correlator.expire(now) {
            print(done, &mut context, &mut kernel)?;
        }
    }
    // Events already queued belong to packets that may still be open.
    let _ = listener.receive(Duration::ZERO, &mut events);
    let now = Instant::now();
    for event in events.drain(..) {
        for done in correlator.push(event, now) {
            print(done, &mut context, &mut kernel)?;
        }
    }
    for done in correlator.finish() {
        print(done, &mut context, &mut kernel)?;
    }
    drop(table);
    let traced = correlator.started();
    if traced == 0 {
        return Err(TraceError::NothingTraced(started.elapsed().min(options.timeout)));
    }
    eprintln!("traced {traced} packet(s)");
    Ok(traced)
}
