//! The bounded-frequency sync loop: events are folded in as they come; a sync starts at most
//! once per `min_sync_period` (bursts coalesce into one transaction), a periodic sync runs every
//! `sync_period` (full when the tables may have changed, see [`Syncer::periodic_needs_read_back`]),
//! and a failed sync is retried with exponential backoff as a full sync. The
//! index and the syncer never meet but here: the loop takes what changed from one and hands it
//! to the other.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{info, warn};

use crate::config::DetectLocal;
use crate::index::{Change, ClusterIndex, Kind, Update};
use crate::model::Problem;
use crate::source::SourceEvent;
use crate::sync::{SyncError, SyncReason, Synced, Syncer};

/// Loop timing.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Minimum time between the starts of two syncs, but for the retries of a failed one
    /// (`--min-sync-period`, default 1s).
    pub min_sync_period: Duration,
    /// Time between periodic syncs (`--sync-period`, default 30s).
    pub sync_period: Duration,
    /// Longest wait before retrying a failed sync.
    pub max_backoff: Duration,
    /// How long to wait for this node's Node before giving up (upstream: 5 minutes, then
    /// kube-proxy exits).
    pub node_timeout: Duration,
}

/// The shortest periodic sync interval the loop runs, whatever it is given: a zero period (which
/// validation refuses; this is the loop's own guard) would otherwise make every pass of the
/// loop a full sync, a core spinning on nothing.
pub(crate) const PERIODIC_FLOOR: Duration = Duration::from_millis(100);

impl Default for Timing {
    fn default() -> Self {
        Timing {
            min_sync_period: Duration::from_secs(1),
            sync_period: Duration::from_secs(30),
            max_backoff: Duration::from_secs(30),
            node_timeout: Duration::from_secs(300),
        }
    }
}

/// What the first sync waits for besides the Services and EndpointSlices lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeGate {
    /// The Node list (manifests: the Node may be absent, NodePorts then use the default-route
    /// interface).
    Listed,
    /// This node's Node with an InternalIP (and spec.podCIDRs in NodeCIDR mode), as upstream's
    /// NodeManager waits for before anything is programmed: without it `primary` node-port
    /// addresses are unknown, and a restart would briefly program none.
    Present,
}

/// Why the loop stopped without a signal.
#[derive(Debug, Error)]
pub enum LoopError {
    #[error("node {node:?} was not ready after {waited:?}: {reason}")]
    NodeTimeout { node: String, waited: Duration, reason: String },
}

/// Why the first sync cannot run yet, or `None` when it can.
fn not_ready(index: &ClusterIndex, gate: NodeGate, syncer: &Syncer) -> Option<String> {
    if !index.ready() {
        return Some("the first lists of Services and EndpointSlices have not arrived".into());
    }
    if !index.listed(Kind::Nodes) {
        return Some("the Node has not been listed".into());
    }
    if gate == NodeGate::Listed {
        return None;
    }
    let name = &syncer.config().hostname;
    let Some(node) = index.state().node() else {
        return Some(format!("node {name:?} not found"));
    };
    if node.host_ips.is_empty() {
        return Some(format!("node {name:?} has no InternalIP"));
    }
    if syncer.config().detect_local == DetectLocal::NodeCidr && node.pod_cidrs.is_empty() {
        return Some(format!("node {name:?} does not have any PodCIDR allocated"));
    }
    None
}

/// Called around syncs (health, metrics, conntrack cleanup, events).
pub(crate) trait Observer {
    /// A change arrived that is not applied yet.
    fn queued(&mut self, _at: Instant) {}
    /// A source found objects or fields it cannot use.
    fn problems(&mut self, _problems: Vec<Problem>) {}
    /// A source sent an update (just before the index folds it in).
    fn updated(&mut self, _update: &Update) {}
    /// The loop is between syncs: called at least every 200 ms, and after each event.
    fn idle(&mut self, _index: &ClusterIndex, _syncer: &Syncer) {}
    /// A sync finished, after `took`.
    fn synced(
        &mut self,
        result: Result<&Synced, &SyncError>,
        took: Duration,
        index: &mut ClusterIndex,
        syncer: &mut Syncer,
    );
}

fn backoff(failures: u32, timing: &Timing) -> Duration {
    let secs = 1u64 << failures.min(6).saturating_sub(1);
    Duration::from_secs(secs).min(timing.max_backoff)
}

/// Folds one source event in; `bind` (`--bind-address`) overrides the Node's primary IP.
fn receive(event: SourceEvent, index: &mut ClusterIndex, observer: &mut dyn Observer, bind: Option<IpAddr>) {
    match event {
        SourceEvent::Update(Update::Node(mut change)) => {
            match &mut change {
                Change::Apply(node) => crate::nodeaddr::apply_bind_address(node, bind),
                Change::Reset(nodes) => nodes.iter_mut().for_each(|n| crate::nodeaddr::apply_bind_address(n, bind)),
                Change::Delete(_) => {}
            }
            let update = Update::Node(change);
            observer.updated(&update);
            index.apply(update);
        }
        SourceEvent::Update(update) => {
            observer.updated(&update);
            index.apply(update)
        }
        SourceEvent::Problems(problems) if !problems.is_empty() => {
            for p in &problems {
                warn!("{p}");
            }
            observer.problems(problems);
        }
        SourceEvent::Problems(_) => {}
    }
}

/// Runs until `stop` is set or every event sender is gone; fails when the Node `gate` asks
/// for does not become ready within `timing.node_timeout`.
pub(crate) fn run(
    index: &mut ClusterIndex,
    syncer: &mut Syncer,
    events: &Receiver<SourceEvent>,
    stop: &AtomicBool,
    timing: Timing,
    gate: NodeGate,
    observer: &mut dyn Observer,
) -> Result<(), LoopError> {
    let started = Instant::now();
    let bind = syncer.config().bind_address;
    let mut waiting: Option<(String, Instant)> = None;
    let mut started_syncing = false;
    let mut last_sync: Option<Instant> = None;
    let mut last_full: Option<Instant> = None;
    let mut retry_at: Option<Instant> = None;
    let mut failures = 0u32;
    let mut disconnected = false;
    while !stop.load(Ordering::Relaxed) {
        observer.idle(index, syncer);
        let now = Instant::now();
        if !started_syncing {
            match not_ready(index, gate, syncer) {
                None => {
                    started_syncing = true;
                    let waited = format!("{:.1}", now.duration_since(started).as_secs_f64() * 1000.0);
                    info!(waited_ms = waited, "the first lists have arrived; first sync");
                }
                Some(reason) => {
                    if now.duration_since(started) >= timing.node_timeout && index.ready() {
                        let node = syncer.config().hostname.clone();
                        return Err(LoopError::NodeTimeout { node, waited: timing.node_timeout, reason });
                    }
                    // Said when the reason changes, then every 30 s.
                    let repeat = waiting
                        .as_ref()
                        .is_none_or(|(r, at)| *r != reason || now.duration_since(*at) >= Duration::from_secs(30));
                    if repeat {
                        info!(%reason, "waiting before the first sync");
                        waiting = Some((reason, now));
                    }
                }
            }
        }
        let due = if !started_syncing {
            None
        } else if let Some(at) = retry_at {
            Some(at)
        } else if last_sync.is_none() || index.has_pending() {
            Some(last_sync.map_or(now, |t| (t + timing.min_sync_period).max(now)))
        } else {
            None
        };
        // A failed sync's retry is full anyway: the periodic timer waits for it (else, once a
        // failure outlasts the period, every pass of the loop would sync). Like any sync, a
        // periodic one starts no sooner than --min-sync-period after the last start.
        let periodic = match (started_syncing, retry_at) {
            (true, None) => last_full
                .map(|t| t + timing.sync_period.max(PERIODIC_FLOOR))
                .map(|p| last_sync.map_or(p, |s| p.max(s + timing.min_sync_period))),
            _ => None,
        };
        let deadline = [due, periodic].into_iter().flatten().min();
        let wait = deadline
            .map_or(Duration::from_millis(200), |d| d.saturating_duration_since(now))
            .min(Duration::from_millis(200));

        if !wait.is_zero() && !disconnected {
            match events.recv_timeout(wait) {
                Ok(event) => {
                    let before = index.has_pending();
                    receive(event, index, observer, bind);
                    while let Ok(more) = events.try_recv() {
                        receive(more, index, observer, bind);
                    }
                    if !before && index.has_pending() {
                        observer.queued(Instant::now());
                    }
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => disconnected = true,
            }
        } else if !wait.is_zero() {
            std::thread::sleep(wait);
        }

        let now = Instant::now();
        let sync_due = due.is_some_and(|d| d <= now);
        let periodic_due = periodic.is_some_and(|p| p <= now);
        if !(sync_due || periodic_due) {
            continue;
        }
        let pending = index.take_pending();
        let reason = if last_sync.is_none() {
            SyncReason::Startup
        } else if retry_at.is_some() {
            SyncReason::PreviousFailure
        } else if pending.node_changed {
            SyncReason::NodeChanged
        } else if !pending.is_empty() {
            SyncReason::Changes
        } else {
            SyncReason::Periodic
        };
        // Syncs that are full anyway need no drift check (the syncer also makes a ServiceCIDR
        // change full by itself). A periodic sync is full unless changes are pending and the
        // tables provably cannot have drifted: then the changes alone are synced, and it still
        // counts as the periodic sync (a full one would hold every change of its second back by
        // its own length).
        let forced_full = last_sync.is_none() || retry_at.is_some() || pending.service_cidrs_changed;
        let full = forced_full || (periodic_due && (pending.is_empty() || needs_read_back(syncer, index)));
        let syncing = Instant::now();
        let result = syncer.sync(index.state(), &pending, reason, full);
        let previous = last_sync;
        // --min-sync-period spaces the syncs' starts, as upstream's rate limiter does: a change
        // waits at most that long plus one sync, not plus two.
        last_sync = Some(syncing);
        let ended = Instant::now();
        let took = ended.duration_since(syncing);
        match &result {
            Ok(s) => {
                failures = 0;
                retry_at = None;
                // A periodic sync the syncer answered without a read-back counts as one too.
                // The period runs from its end: a full sync longer than the period must not
                // be followed by another at once.
                if s.report.full || periodic_due {
                    last_full = Some(ended);
                }
                // A periodic sync that proved nothing changed sent nothing: it must not hold
                // the next change back by --min-sync-period (up to 1 s every --sync-period).
                if reason == SyncReason::Periodic && !s.report.full && s.report.apply.messages == 0 {
                    last_sync = previous.or(last_sync);
                }
            }
            Err(_) => {
                failures += 1;
                retry_at = Some(Instant::now() + backoff(failures, &timing));
                if last_full.is_none() {
                    last_full = Some(ended);
                }
            }
        }
        observer.synced(result.as_ref(), took, index, syncer);
    }
    Ok(())
}

/// Whether a periodic sync with changes pending must be full (see
/// [`Syncer::periodic_needs_read_back`]); when that cannot be told, it must.
fn needs_read_back(syncer: &mut Syncer, index: &ClusterIndex) -> bool {
    syncer.periodic_needs_read_back(index.state()).unwrap_or_else(|e| {
        warn!(error = %e, "cannot tell whether nftproxy's tables changed; the periodic sync reads them back");
        true
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::mpsc;

    use super::*;
    use crate::config::ProxyConfig;
    use crate::netlink::FakeNetfilter;
    use crate::nodeaddr::NodePortTargets;
    use crate::plan::NodePorts;
    use crate::source::manifests;

    fn fixed_nodeports() -> crate::sync::NodePortResolver {
        Box::new(|_: &ProxyConfig, _: Option<&crate::model::NodeInfo>| NodePortTargets {
            v4: NodePorts::Addresses(vec![]),
            v6: NodePorts::Addresses(vec![]),
            loopback: Vec::new(),
        })
    }

    /// The manifests `yaml` as a source sends them: the services' list, then (when `rest`)
    /// the slices' and the Nodes' lists.
    fn lists(yaml: &str, rest: bool) -> Vec<SourceEvent> {
        let mut m = manifests::Manifests::default();
        manifests::load_text(std::path::Path::new("t.yaml"), yaml, &mut m);
        let (updates, _) = m.into_updates("node1");
        updates.into_iter().take(if rest { 3 } else { 1 }).map(SourceEvent::Update).collect()
    }

    struct Record(Vec<(SyncReason, bool, usize)>, Arc<AtomicBool>, usize);

    impl Observer for Record {
        fn synced(&mut self, result: Result<&Synced, &SyncError>, _: Duration, _: &mut ClusterIndex, _: &mut Syncer) {
            let s = result.unwrap();
            self.0.push((s.report.reason, s.report.full, s.report.apply.operations));
            if self.0.len() >= self.2 {
                self.1.store(true, Ordering::Relaxed);
            }
        }
    }

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: ns}\nspec: {clusterIP: 10.96.0.1, ports: [{name: p, port: 80}]}\n";

    #[test]
    fn waits_for_both_lists_then_coalesces_a_burst() {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut index = ClusterIndex::new();
        let mut syncer = Syncer::new(ProxyConfig::new("node1"), Box::new(FakeNetfilter::new()), fixed_nodeports());
        // Not ready: no EndpointSlices list yet, so the first tick must not sync.
        for e in lists(SVC, false) {
            tx.send(e).unwrap();
        }
        let timing = Timing {
            min_sync_period: Duration::from_millis(300),
            sync_period: Duration::from_secs(60),
            max_backoff: Duration::from_secs(1),
            ..Timing::default()
        };
        let mut rec = Record(Vec::new(), Arc::clone(&stop), 2);
        let stopper = Arc::clone(&stop);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            for e in lists(SVC, true).into_iter().skip(1) {
                tx.send(e).unwrap();
            }
            std::thread::sleep(Duration::from_millis(100));
            // A burst of ten changes inside one min-sync-period.
            for i in 2..12 {
                for e in lists(&SVC.replace("10.96.0.1", &format!("10.96.0.{i}")), false) {
                    tx.send(e).unwrap();
                }
            }
            std::thread::sleep(Duration::from_secs(3));
            stopper.store(true, Ordering::Relaxed);
        });
        let started = Instant::now();
        run(&mut index, &mut syncer, &rx, &stop, timing, NodeGate::Listed, &mut rec).unwrap();
        assert!(started.elapsed() < Duration::from_secs(2), "stopped after the second sync");
        sender.join().unwrap();
        assert_eq!(rec.0.len(), 2, "{:?}", rec.0);
        assert_eq!(rec.0[0].0, SyncReason::Startup);
        assert!(rec.0[0].1, "the first sync is full");
        assert_eq!(rec.0[1].0, SyncReason::Changes);
        assert!(!rec.0[1].1, "the burst is one partial sync");
    }

    /// Under steady churn the periodic sync falls due with changes pending: the tables are
    /// owned, so it syncs the changes alone rather than a full sync (which would hold every
    /// change of its duration back).
    #[test]
    fn a_periodic_sync_under_churn_syncs_only_the_changes_when_nothing_can_have_drifted() {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut index = ClusterIndex::new();
        let mut syncer = Syncer::new(ProxyConfig::new("node1"), Box::new(FakeNetfilter::new()), fixed_nodeports());
        assert!(syncer.owns_tables());
        for e in lists(SVC, true) {
            tx.send(e).unwrap();
        }
        let timing = Timing {
            min_sync_period: Duration::from_millis(50),
            sync_period: Duration::from_millis(300),
            max_backoff: Duration::from_secs(1),
            ..Timing::default()
        };
        let mut rec = Record(Vec::new(), Arc::clone(&stop), usize::MAX);
        let stopper = Arc::clone(&stop);
        let sender = std::thread::spawn(move || {
            // A change every 5 ms for 1.2 s: four sync periods, never a quiet moment.
            for i in 0..240 {
                for e in lists(&SVC.replace("10.96.0.1", &format!("10.96.1.{}", i % 200 + 1)), false) {
                    tx.send(e).unwrap();
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            stopper.store(true, Ordering::Relaxed);
        });
        run(&mut index, &mut syncer, &rx, &stop, timing, NodeGate::Listed, &mut rec).unwrap();
        sender.join().unwrap();
        assert!(rec.0.len() >= 8, "{:?}", rec.0);
        assert!(rec.0[0].1, "the first sync is full");
        let full_after_start: Vec<_> = rec.0[1..].iter().filter(|(_, full, _)| *full).collect();
        assert!(full_after_start.is_empty(), "periodic syncs read back while owned: {:?}", rec.0);
    }

    struct Count(usize);

    impl Observer for Count {
        fn synced(&mut self, _: Result<&Synced, &SyncError>, _: Duration, _: &mut ClusterIndex, _: &mut Syncer) {
            self.0 += 1;
        }
    }

    /// A sync that keeps failing is retried with backoff; the periodic timer does not sync on
    /// every pass of the loop once the failures outlast the period.
    #[test]
    fn a_failing_sync_is_retried_with_backoff_not_by_the_periodic_timer() {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut kernel = FakeNetfilter::new();
        // Every operation is refused, the table's first: the sync fails as a whole.
        kernel.fail_on = Some(String::new());
        let mut syncer = Syncer::new(ProxyConfig::new("node1"), Box::new(kernel), fixed_nodeports());
        for e in lists(SVC, true) {
            tx.send(e).unwrap();
        }
        let timing = Timing {
            min_sync_period: Duration::from_millis(10),
            sync_period: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            ..Timing::default()
        };
        let stopper = Arc::clone(&stop);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            stopper.store(true, Ordering::Relaxed);
            drop(tx);
        });
        let mut count = Count(0);
        run(&mut ClusterIndex::new(), &mut syncer, &rx, &stop, timing, NodeGate::Listed, &mut count).unwrap();
        sender.join().unwrap();
        // The first sync at once, a retry a second later (the backoff), nothing else.
        assert!((1..=3).contains(&count.0), "{} syncs in 1.5 s", count.0);
    }

    /// Zero periods (refused by validation; the loop guards itself too) never spin: idle, the
    /// loop syncs at most once per [`PERIODIC_FLOOR`] and otherwise sleeps.
    #[test]
    fn zero_periods_never_spin_the_loop() {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut syncer = Syncer::new(ProxyConfig::new("node1"), Box::new(FakeNetfilter::new()), fixed_nodeports());
        for e in lists(SVC, true) {
            tx.send(e).unwrap();
        }
        let timing = Timing { min_sync_period: Duration::ZERO, sync_period: Duration::ZERO, ..Timing::default() };
        let stopper = Arc::clone(&stop);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1000));
            stopper.store(true, Ordering::Relaxed);
            drop(tx);
        });
        let mut count = Count(0);
        run(&mut ClusterIndex::new(), &mut syncer, &rx, &stop, timing, NodeGate::Listed, &mut count).unwrap();
        sender.join().unwrap();
        // One sync at start, then one per 100 ms floor at most: about 10 in a second.
        assert!((1..=12).contains(&count.0), "{} syncs in 1 s with zero periods", count.0);
    }

    /// Node-port addresses from the Node, as `primary` resolves them.
    fn nodeports_from_node() -> crate::sync::NodePortResolver {
        Box::new(|_: &ProxyConfig, node: Option<&crate::model::NodeInfo>| NodePortTargets {
            v4: NodePorts::Addresses(node.map(|n| n.host_ips.clone()).unwrap_or_default()),
            v6: NodePorts::Addresses(vec![]),
            loopback: Vec::new(),
        })
    }

    struct FirstNodePorts(Vec<NodePortTargets>, Arc<AtomicBool>);

    impl Observer for FirstNodePorts {
        fn synced(&mut self, result: Result<&Synced, &SyncError>, _: Duration, _: &mut ClusterIndex, _: &mut Syncer) {
            self.0.push(result.unwrap().nodeports.clone());
            self.1.store(true, Ordering::Relaxed);
        }
    }

    const NODE: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node1}\nstatus: {addresses: [{type: InternalIP, address: 192.168.50.2}]}\n";

    /// With the API as source, the Node arrives on its own watch, after the other lists: the
    /// first sync waits for it, so it never programs empty node-port addresses.
    #[test]
    fn the_first_sync_waits_for_the_node() {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut index = ClusterIndex::new();
        let mut syncer = Syncer::new(ProxyConfig::new("node1"), Box::new(FakeNetfilter::new()), nodeports_from_node());
        // Services, slices and an empty Node list (the Node object is not there yet).
        for e in lists(SVC, true) {
            tx.send(e).unwrap();
        }
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(400));
            for e in lists(&format!("{SVC}---\n{NODE}"), true).into_iter().skip(2) {
                tx.send(e).unwrap();
            }
            std::thread::sleep(Duration::from_secs(3));
        });
        let mut rec = FirstNodePorts(Vec::new(), Arc::clone(&stop));
        let started = Instant::now();
        run(&mut index, &mut syncer, &rx, &stop, Timing::default(), NodeGate::Present, &mut rec).unwrap();
        assert!(started.elapsed() >= Duration::from_millis(400), "synced before the Node arrived");
        assert_eq!(rec.0[0].v4, NodePorts::Addresses(vec!["192.168.50.2".parse().unwrap()]));
        drop(sender);
    }

    /// `--bind-address` replaces the Node's primary IP of its family; a Node that never comes
    /// ends the loop with upstream's reason after the timeout.
    #[test]
    fn bind_address_overrides_the_node_ip_and_a_missing_node_times_out() {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut config = ProxyConfig::new("node1");
        config.bind_address = Some("10.1.2.3".parse().unwrap());
        let mut syncer = Syncer::new(config.clone(), Box::new(FakeNetfilter::new()), nodeports_from_node());
        for e in lists(&format!("{SVC}---\n{NODE}"), true) {
            tx.send(e).unwrap();
        }
        let mut rec = FirstNodePorts(Vec::new(), Arc::clone(&stop));
        let mut index = ClusterIndex::new();
        run(&mut index, &mut syncer, &rx, &stop, Timing::default(), NodeGate::Present, &mut rec).unwrap();
        assert_eq!(rec.0[0].v4, NodePorts::Addresses(vec!["10.1.2.3".parse().unwrap()]));

        let (tx, rx) = mpsc::channel();
        for e in lists(SVC, true) {
            tx.send(e).unwrap();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut rec = FirstNodePorts(Vec::new(), Arc::clone(&stop));
        let mut syncer = Syncer::new(config, Box::new(FakeNetfilter::new()), nodeports_from_node());
        let timing = Timing { node_timeout: Duration::from_millis(300), ..Timing::default() };
        let err = run(&mut ClusterIndex::new(), &mut syncer, &rx, &stop, timing, NodeGate::Present, &mut rec)
            .expect_err("no Node, no sync");
        assert!(err.to_string().contains("node \"node1\" not found"), "{err}");
        assert!(rec.0.is_empty());
        drop(tx);
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let t = Timing::default();
        assert_eq!(backoff(1, &t), Duration::from_secs(1));
        assert_eq!(backoff(2, &t), Duration::from_secs(2));
        assert_eq!(backoff(4, &t), Duration::from_secs(8));
        assert_eq!(backoff(20, &t), Duration::from_secs(30));
    }
}
