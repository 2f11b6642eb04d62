//! Trace events grouped per packet.
//!
//! The kernel names a packet's events with an id computed when each base chain is entered (a
//! hash of the packet's buffer, its flow and its input interface), so:
//! - a packet's record starts at the event of the trace table's own rule, which marks it,
//!   and takes every later event with that id, in any table;
//! - ids are reused (the next packet of a flow often gets the same one): a new start with an
//!   open record's id ends that record;
//! - the id changes when a packet loops back through `lo` (its input interface changed); the
//!   conntrack id does not, so a start whose conntrack id is an open record's joins it;
//! - nothing marks a packet's last event: a record is complete when no event came for it for
//!   a short while (events of one packet arrive within microseconds);
//! - another trace running at the same time has a table too: its events are left out.

use std::time::{Duration, Instant};

use crate::netlink::inventory::TableFamily;
use crate::netlink::trace::{TraceEvent, TraceKind};

/// Trace tables are named this and the tracing process's id (events of another process's trace
/// table are not this trace's).
pub(crate) const TABLE_PREFIX: &str = "nftproxy-trace-";

/// One traced packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PacketTrace {
    /// 1 for the first packet traced.
    pub(crate) number: usize,
    /// The trace table's rule event that marked the packet (with its headers as it arrived).
    pub(crate) start: TraceEvent,
    /// Every later event of the packet, in order, the trace table's own left out.
    pub(crate) events: Vec<TraceEvent>,
}

struct Open {
    trace: PacketTrace,
    ids: Vec<u32>,
    conntrack: Option<u32>,
    last: Instant,
}

/// Groups events into packets.
pub(crate) struct Correlator {
    /// The trace table (family `inet`).
    table: String,
    quiet: Duration,
    /// Packets to trace at most; later starts are ignored.
    limit: usize,
    started: usize,
    open: Vec<Open>,
}

impl Correlator {
    /// Groups the events of packets marked by `table`, at most `limit` packets; a packet is
    /// complete after `quiet` without events.
    pub(crate) fn new(table: &str, quiet: Duration, limit: usize) -> Correlator {
        Correlator { table: table.to_string(), quiet, limit, started: 0, open: Vec::new() }
    }

    /// Packets started so far.
    pub(crate) fn started(&self) -> usize {
        self.started
    }

    /// Packets started and not complete yet.
    pub(crate) fn pending(&self) -> usize {
        self.open.len()
    }

    fn is_ours(&self, e: &TraceEvent) -> bool {
        e.family == Some(TableFamily::Inet) && e.table == self.table
    }

    fn is_another_trace(&self, e: &TraceEvent) -> bool {
        e.family == Some(TableFamily::Inet) && e.table.starts_with(TABLE_PREFIX) && e.table != self.table
    }

    /// Folds in one event; returns the packets it completes (a start reusing an open id).
    pub(crate) fn push(&mut self, event: TraceEvent, now: Instant) -> Vec<PacketTrace> {
        let mut done = Vec::new();
        let holder = self.open.iter().position(|o| o.ids.contains(&event.id));
        if !self.is_ours(&event) {
            if let Some(i) = holder {
                self.open[i].last = now;
                if !self.is_another_trace(&event) {
                    self.open[i].trace.events.push(event);
                }
            }
            return done;
        }
        // The trace table's own chain end and policy: only a sign of life.
        let marks = event.kind == TraceKind::Rule && event.rule.is_some();
        if !marks {
            if let Some(i) = holder {
                self.open[i].last = now;
            }
            return done;
        }
        let conntrack = event.conntrack.and_then(|c| c.id);
        if holder.is_none()
            && let Some(looped) = self.open.iter_mut().find(|o| conntrack.is_some() && o.conntrack == conntrack)
        {
            looped.ids.push(event.id);
            looped.last = now;
            return done;
        }
        if let Some(i) = holder {
            done.push(self.open.remove(i).trace);
        }
        if self.started < self.limit {
            self.started += 1;
            self.open.push(Open {
                trace: PacketTrace { number: self.started, start: event.clone(), events: Vec::new() },
                ids: vec![event.id],
                conntrack,
                last: now,
            });
        }
        done
    }

    /// Packets without events for the quiet time, in the order they started.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<PacketTrace> {
        let quiet = self.quiet;
        let (done, open): (Vec<Open>, Vec<Open>) =
            std::mem::take(&mut self.open).into_iter().partition(|o| now.duration_since(o.last) >= quiet);
        self.open = open;
        done.into_iter().map(|o| o.trace).collect()
    }

    /// Every packet still open (the trace is ending).
    pub(crate) fn finish(&mut self) -> Vec<PacketTrace> {
        std::mem::take(&mut self.open).into_iter().map(|o| o.trace).collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::netlink::trace::TraceConntrack;

    /// An event of `table`/`chain` for packet `id`.
    pub(crate) fn event(family: TableFamily, table: &str, chain: &str, id: u32) -> TraceEvent {
        TraceEvent { family: Some(family), table: table.into(), chain: chain.into(), id, ..TraceEvent::default() }
    }

    /// The trace table's marking rule for packet `id` (conntrack id `ct`).
    pub(crate) fn start(id: u32, ct: u32) -> TraceEvent {
        TraceEvent {
            rule: Some(3),
            verdict: Some(-1),
            conntrack: Some(TraceConntrack { id: Some(ct), ..TraceConntrack::default() }),
            ..event(TableFamily::Inet, "nftproxy-trace-1", "prerouting", id)
        }
    }

    fn ours_end(id: u32) -> TraceEvent {
        TraceEvent { verdict: Some(-1), ..event(TableFamily::Inet, "nftproxy-trace-1", "prerouting", id) }
    }

    fn theirs(id: u32, chain: &str) -> TraceEvent {
        event(TableFamily::Ip, "nftproxy", chain, id)
    }

    fn chains(p: &PacketTrace) -> Vec<&str> {
        p.events.iter().map(|e| e.chain.as_str()).collect()
    }

    #[test]
    fn events_group_by_id_until_quiet() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut c = Correlator::new("nftproxy-trace-1", Duration::from_millis(100), 10);
        assert!(c.push(start(7, 100), t0).is_empty());
        c.push(ours_end(7), t0);
        c.push(start(8, 200), t0);
        c.push(theirs(7, "nat-prerouting"), ms(1));
        c.push(theirs(8, "nat-output"), ms(1));
        c.push(theirs(9, "unrelated"), ms(1));
        c.push(event(TableFamily::Inet, "nftproxy-trace-2", "prerouting", 7), ms(1));
        c.push(theirs(7, "services"), ms(50));
        assert_eq!(c.started(), 2);
        assert!(c.expire(ms(120)).iter().map(|p| p.number).eq([2]), "packet 2 went quiet first");
        let done = c.expire(ms(200));
        assert_eq!(done.len(), 1);
        assert_eq!(chains(&done[0]), vec!["nat-prerouting", "services"], "the trace table's own events left out");
        assert_eq!(c.pending(), 0);
    }

    #[test]
    fn a_reused_id_ends_the_previous_packet() {
        let t0 = Instant::now();
        let mut c = Correlator::new("nftproxy-trace-1", Duration::from_secs(1), 10);
        c.push(start(7, 100), t0);
        c.push(theirs(7, "a"), t0);
        let done = c.push(start(7, 101), t0);
        assert_eq!(done.len(), 1);
        assert_eq!((done[0].number, chains(&done[0])), (1, vec!["a"]));
        c.push(theirs(7, "b"), t0);
        let rest = c.finish();
        assert_eq!((rest[0].number, chains(&rest[0])), (2, vec!["b"]));
    }

    #[test]
    fn a_packet_looping_back_keeps_its_record() {
        let t0 = Instant::now();
        let mut c = Correlator::new("nftproxy-trace-1", Duration::from_secs(1), 10);
        c.push(start(1, 500), t0);
        c.push(theirs(1, "nat-output"), t0);
        // Back in through lo: a new id, the same connection.
        assert!(c.push(start(2, 500), t0).is_empty());
        c.push(theirs(2, "filter-input"), t0);
        assert_eq!(c.started(), 1);
        let done = c.finish();
        assert_eq!(chains(&done[0]), vec!["nat-output", "filter-input"]);
    }

    #[test]
    fn packets_beyond_the_limit_are_not_traced() {
        let t0 = Instant::now();
        let mut c = Correlator::new("nftproxy-trace-1", Duration::from_secs(1), 1);
        c.push(start(1, 1), t0);
        c.push(start(2, 2), t0);
        c.push(theirs(2, "x"), t0);
        assert_eq!(c.started(), 1);
        let done = c.finish();
        assert_eq!(done.len(), 1);
        assert!(done[0].events.is_empty());
    }
}
