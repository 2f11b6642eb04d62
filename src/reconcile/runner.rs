//! The bounded-frequency sync loop: events are folded in as they come; a sync runs at most once
//! per `min_sync_period` (bursts coalesce into one transaction), a full sync runs every
//! `sync_period`, and a failed sync is retried with exponential backoff as a full sync.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::{Reconciler, SyncError, SyncReason, Synced};
use crate::source::Event;

/// Loop timing.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Minimum time between syncs (`--min-sync-period`, default 1s).
    pub min_sync_period: Duration,
    /// Time between full syncs (`--sync-period`, default 30s).
    pub sync_period: Duration,
    /// Longest wait before retrying a failed sync.
    pub max_backoff: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            min_sync_period: Duration::from_secs(1),
            sync_period: Duration::from_secs(30),
            max_backoff: Duration::from_secs(30),
        }
    }
}

/// Called around syncs (health, metrics, conntrack cleanup, events).
pub trait Observer {
    /// A change arrived that is not applied yet.
    fn queued(&mut self, _at: Instant) {}
    /// A sync finished.
    fn synced(&mut self, result: Result<&Synced, &SyncError>, reconciler: &mut Reconciler);
}

fn backoff(failures: u32, timing: &Timing) -> Duration {
    let secs = 1u64 << failures.min(6).saturating_sub(1);
    Duration::from_secs(secs).min(timing.max_backoff)
}

/// Runs until `stop` is set or every event sender is gone.
pub fn run(
    reconciler: &mut Reconciler,
    events: &Receiver<Event>,
    stop: &AtomicBool,
    timing: Timing,
    observer: &mut dyn Observer,
) {
    let mut last_sync: Option<Instant> = None;
    let mut last_full: Option<Instant> = None;
    let mut retry_at: Option<Instant> = None;
    let mut failures = 0u32;
    let mut disconnected = false;
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let due = if !reconciler.ready() {
            None
        } else if let Some(at) = retry_at {
            Some(at)
        } else if last_sync.is_none() || reconciler.has_changes() {
            Some(last_sync.map_or(now, |t| (t + timing.min_sync_period).max(now)))
        } else {
            None
        };
        let periodic = if reconciler.ready() { last_full.map(|t| t + timing.sync_period) } else { None };
        let deadline = [due, periodic].into_iter().flatten().min();
        let wait = deadline
            .map_or(Duration::from_millis(200), |d| d.saturating_duration_since(now))
            .min(Duration::from_millis(200));

        if !wait.is_zero() && !disconnected {
            match events.recv_timeout(wait) {
                Ok(event) => {
                    let before = reconciler.has_changes();
                    reconciler.on_event(event);
                    while let Ok(more) = events.try_recv() {
                        reconciler.on_event(more);
                    }
                    if !before && reconciler.has_changes() {
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
        let reason = if last_sync.is_none() {
            SyncReason::Startup
        } else if retry_at.is_some() {
            SyncReason::PreviousFailure
        } else if reconciler.has_changes() {
            SyncReason::Changes
        } else {
            SyncReason::Periodic
        };
        let full = periodic_due || last_sync.is_none() || retry_at.is_some();
        let result = reconciler.sync(reason, full);
        last_sync = Some(Instant::now());
        match &result {
            Ok(s) => {
                failures = 0;
                retry_at = None;
                if s.report.full {
                    last_full = last_sync;
                }
            }
            Err(_) => {
                failures += 1;
                retry_at = Some(Instant::now() + backoff(failures, &timing));
                if last_full.is_none() {
                    last_full = last_sync;
                }
            }
        }
        observer.synced(result.as_ref(), reconciler);
    }
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
    use crate::source::{Kind, Snapshot, manifests};

    fn fixed_nodeports() -> super::super::NodePortResolver {
        Box::new(|_: &ProxyConfig, _: Option<&crate::model::NodeInfo>| NodePortTargets {
            v4: NodePorts::Addresses(vec![]),
            v6: NodePorts::Addresses(vec![]),
        })
    }

    fn snapshot(yaml: &str) -> Event {
        let mut m = manifests::Manifests::default();
        manifests::load_text(std::path::Path::new("t.yaml"), yaml, &mut m);
        Event::Snapshot(Box::new(Snapshot { services: m.services, slices: m.slices, nodes: m.nodes, problems: 0 }))
    }

    struct Record(Vec<(SyncReason, bool, usize)>, Arc<AtomicBool>, usize);

    impl Observer for Record {
        fn synced(&mut self, result: Result<&Synced, &SyncError>, _: &mut Reconciler) {
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
        let mut r = Reconciler::new(ProxyConfig::new("node1"), Box::new(FakeNetfilter::new()), fixed_nodeports());
        tx.send(snapshot(SVC)).unwrap();
        tx.send(Event::Synced(Kind::Services)).unwrap();
        // Not ready: no EndpointSlices list yet, so the first tick must not sync.
        let timing = Timing {
            min_sync_period: Duration::from_millis(300),
            sync_period: Duration::from_secs(60),
            max_backoff: Duration::from_secs(1),
        };
        let mut rec = Record(Vec::new(), Arc::clone(&stop), 2);
        let stopper = Arc::clone(&stop);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            tx.send(Event::Synced(Kind::EndpointSlices)).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            // A burst of ten changes inside one min-sync-period.
            for i in 2..12 {
                tx.send(snapshot(&SVC.replace("10.96.0.1", &format!("10.96.0.{i}")))).unwrap();
            }
            std::thread::sleep(Duration::from_secs(3));
            stopper.store(true, Ordering::Relaxed);
        });
        let started = Instant::now();
        run(&mut r, &rx, &stop, timing, &mut rec);
        assert!(started.elapsed() < Duration::from_secs(2), "stopped after the second sync");
        sender.join().unwrap();
        assert_eq!(rec.0.len(), 2, "{:?}", rec.0);
        assert_eq!(rec.0[0].0, SyncReason::Startup);
        assert!(rec.0[0].1, "the first sync is full");
        assert_eq!(rec.0[1].0, SyncReason::Changes);
        assert!(!rec.0[1].1, "the burst is one partial sync");
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
