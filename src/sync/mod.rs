//! The syncer: owns the handle on the kernel, what it programmed there, and where every endpoint
//! window is; turns the cluster state into one transaction per sync.
//!
//! A **partial** sync plans only the services that changed, old version and new, and sends
//! their difference; a **full** sync (at start, at a periodic sync when the tables may have
//! changed (at least hourly), after any failure, when
//! the node, the node-port addresses or the families in use change, and for `nftproxy sync`)
//! plans everything and diffs it with nftproxy's tables read back from the kernel, so anything
//! that drifted is repaired in the same transaction. Both stream through the one builder,
//! `delta::Delta`: it never holds the desired ruleset or the transaction.
//!
//! The syncer never sees Kubernetes API objects: it plans from the [`ClusterState`] the index
//! holds.

mod delta;
mod programmed;
mod status;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{info, info_span, warn};

use crate::config::ProxyConfig;
use crate::index::Pending;
use crate::model::{ClusterState, NamespacedName, NodeInfo, ObjectKind, ObjectRef, Problem};
use crate::net::{FamilyMap, IpFamily};
use crate::netlink::{ApplyStats, Netfilter, NetlinkError};
use crate::nft::diff::OpKind;
use crate::nft::diff::{Op, OpTag, diff};
use crate::nft::lower::{lower_ruleset, lower_table};
use crate::nft::wire::{NumgenWindow, WireData, WireKey, address_from_bytes};
use crate::nft::wire::{WireRuleset, WireTable, consts};
use crate::nodeaddr::NodePortTargets;
use crate::plan::affinity::{AffinityId, AffinitySlots, GROUP_SLOTS, SlotTarget};
use crate::plan::placement::{Demands, Placed, Placement, SPLIT, Slot, SlotFlush, WindowId};
use crate::plan::{self, ConntrackTarget, HealthCheck, PlanInput, PlanStats, SharedSet, names};
use delta::{Delta, View};
use programmed::{Change, Fragments, Programmed, ProgrammedService};
pub use status::{FamilyEndpoints, PortState, PortStatus, StatusQuery, SyncStatus};

/// Errors of a sync.
#[derive(Debug, Error)]
pub enum SyncError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error("internal error: {0}")]
    Internal(&'static str),
}

/// Why a sync runs (logged, and a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SyncReason {
    Startup,
    Changes,
    Periodic,
    PreviousFailure,
    NodeChanged,
}

impl fmt::Display for SyncReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SyncReason::Startup => "startup",
            SyncReason::Changes => "changes",
            SyncReason::Periodic => "periodic",
            SyncReason::PreviousFailure => "previous-failure",
            SyncReason::NodeChanged => "node-changed",
        })
    }
}

/// What one sync did.
#[derive(Debug, Clone)]
pub struct SyncReport {
    pub reason: SyncReason,
    pub full: bool,
    pub apply: ApplyStats,
    /// Operations that repaired drift found by a full sync (0 on partial syncs).
    pub drift_repairs: usize,
    pub services_changed: usize,
    /// Services planned (all of them on a full sync; old and new versions count once).
    pub services_planned: usize,
    /// Time planning, diffing and encoding, which run interleaved (one service at a time,
    /// straight into the batch).
    pub plan: Duration,
    /// Time reading the kernel's tables back (full syncs).
    pub read: Duration,
    pub total: Duration,
}

/// What observers (health servers, metrics, conntrack cleanup) learn after a successful sync.
#[derive(Debug, Clone)]
pub struct Synced {
    /// Where NodePorts (and health-check servers) listen.
    pub nodeports: NodePortTargets,
    /// Every health check; the same allocation as the last sync's when none changed.
    pub health_checks: Arc<[HealthCheck]>,
    /// UDP and SCTP service ports and their endpoints: every one after a full sync, those of
    /// the services planned again after a partial one (nothing when conntrack cleanup is off).
    pub conntrack: ConntrackUpdate,
    pub stats: PlanStats,
    pub report: SyncReport,
}

/// The UDP and SCTP service ports a sync programmed, for the conntrack reconciler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConntrackUpdate {
    /// Every programmed port (a full sync).
    All(Vec<ConntrackTarget>),
    /// The ports of the services a partial sync planned again, before and after it.
    Changed { before: Vec<ConntrackTarget>, after: Vec<ConntrackTarget> },
}

impl ConntrackUpdate {
    /// No port changed.
    pub fn none() -> ConntrackUpdate {
        ConntrackUpdate::Changed { before: Vec::new(), after: Vec::new() }
    }
}

/// Resolves node-port addresses for a plan (reads interfaces; tests substitute fixed values).
pub type NodePortResolver = Box<dyn FnMut(&ProxyConfig, Option<&NodeInfo>) -> NodePortTargets + Send>;

/// The resolver reading this network namespace's interfaces.
pub fn local_nodeports() -> NodePortResolver {
    Box::new(|config: &ProxyConfig, node: Option<&NodeInfo>| crate::nodeaddr::resolve(&config.nodeport_addresses, node))
}

/// nftproxy's tables in both families (whether they exist or not).
pub(crate) fn table_names(config: &ProxyConfig) -> Vec<(IpFamily, &str)> {
    IpFamily::ALL.iter().map(|f| (*f, config.table.as_str())).collect()
}

/// The flags nftproxy's table should have. Owned: `owner` and `persist`, so no other process
/// can change the table while nftproxy runs and it outlives the process (Linux ≥ 6.9 lets a new
/// process claim an orphaned persistent table, in the transaction that updates it). Not owned:
/// whatever `persist` the kernel's table has, since that flag cannot be toggled.
pub fn table_flags(owned: bool, have: Option<&WireTable>) -> u32 {
    if owned {
        consts::TABLE_F_OWNER | consts::TABLE_F_PERSIST
    } else {
        have.map_or(0, |t| t.flags & consts::TABLE_F_PERSIST)
    }
}

/// Deletes nftproxy's tables (and nothing else). Returns how many there were.
pub fn cleanup(nf: &mut dyn Netfilter, config: &ProxyConfig) -> Result<usize, SyncError> {
    let current = nf.read(&table_names(config))?;
    let n = current.tables.len();
    nf.apply(&diff(&current, &WireRuleset::default()))?;
    Ok(n)
}

/// How many times a full sync reads the kernel back when another transaction commits while it
/// reads, before it applies without that check (something commits all the time).
const MAX_STALE_READS: u32 = 3;

/// How long nftproxy's tables go without being read back while nothing says they changed: an
/// hour, as upstream's full resync.
pub const READ_BACK_PERIOD: Duration = Duration::from_secs(3600);

/// How many refused services one sync leaves out before it gives up (the services stay left
/// out, so the next sync, after a backoff, goes on where this one stopped).
const MAX_EXCLUSIONS_PER_SYNC: usize = 16;

/// The syncer's state.
pub struct Syncer {
    /// Shared with each sync's plan input, which outlives borrows of the syncer.
    config: Arc<ProxyConfig>,
    kernel: Box<dyn Netfilter>,
    nodeports: NodePortResolver,
    /// What the last successful sync programmed (`None` before it, and after a failure).
    programmed: Option<Programmed>,
    /// Where every service port's endpoint window is (kept across syncs).
    placement: Placement,
    /// Node-port addresses the programmed state was planned with.
    targets: Option<NodePortTargets>,
    needs_full: bool,
    /// Services left out because the kernel refused their objects, with the reason; each gets
    /// another chance when it changes.
    excluded: BTreeMap<NamespacedName, String>,
    /// Whether the tables are claimed (`--table-ownership`, unless the kernel cannot).
    ownership: bool,
    /// The table flags the last full sync programmed, per family.
    table_flags: FamilyMap<u32>,
    /// The ruleset generation right after this process's last transaction, when known exactly
    /// (it was applied over the generation it expected): the same generation later proves
    /// nobody committed anything since.
    generation: Option<u32>,
    /// When the kernel's tables were last read back (full syncs).
    last_read_back: Option<Instant>,
    problems: Vec<Problem>,
    /// Issue 14 (taking over from kube-proxy): operations on foreign tables that the next full
    /// sync's transaction starts with, until one succeeds.
    prepended: Vec<Op>,
}

impl Syncer {
    /// A syncer applying to `kernel`.
    pub fn new(config: ProxyConfig, kernel: Box<dyn Netfilter>, nodeports: NodePortResolver) -> Syncer {
        Syncer {
            kernel,
            nodeports,
            programmed: None,
            placement: Placement::new(),
            targets: None,
            needs_full: true,
            excluded: BTreeMap::new(),
            ownership: config.table_ownership,
            table_flags: FamilyMap::new(),
            generation: None,
            last_read_back: None,
            problems: Vec::new(),
            prepended: Vec::new(),
            config: Arc::new(config),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.config
    }

    /// Services the kernel refused, left out of the ruleset until they change, and why.
    pub fn excluded(&self) -> &BTreeMap<NamespacedName, String> {
        &self.excluded
    }

    /// Whether nftproxy's tables are claimed (owned) by this process.
    pub fn owns_tables(&self) -> bool {
        self.ownership
    }

    /// Makes the next sync a full one that reads the kernel's tables back, whatever proves
    /// they cannot have changed.
    pub fn read_back_next(&mut self) {
        self.needs_full = true;
    }

    /// Whether the next sync must be full.
    pub fn needs_full(&self) -> bool {
        self.needs_full || self.programmed.is_none()
    }

    /// What is programmed for the services `query` selects, `state` being the cluster as the
    /// index holds it now (services changed since the last sync are described from it, and
    /// marked [`PortState::Pending`]).
    pub fn status(&self, state: &ClusterState, query: &StatusQuery) -> SyncStatus {
        let records = status::Records {
            config: &self.config,
            programmed: self.programmed.as_ref(),
            targets: &self.targets,
            excluded: &self.excluded,
            ownership: self.ownership,
            needs_full_sync: self.needs_full(),
        };
        records.status(state, query)
    }

    /// Issue 14: `ops` (kube-proxy's leftovers to delete) go first in the next full sync's
    /// transaction, so they and nftproxy's rules take effect in one commit; they are sent with
    /// every full sync until one succeeds. Replaces what was handed before (empty: nothing).
    pub fn prepend_to_next_full_sync(&mut self, ops: Vec<Op>) {
        self.prepended = ops;
    }

    /// Pretends the last read-back happened `by` earlier (tests of [`READ_BACK_PERIOD`]).
    #[cfg(test)]
    pub(crate) fn age_read_back(&mut self, by: Duration) {
        self.last_read_back = self.last_read_back.and_then(|t| t.checked_sub(by));
    }

    /// Services left out since the last call (for Events and metrics).
    pub fn take_problems(&mut self) -> Vec<Problem> {
        std::mem::take(&mut self.problems)
    }

    /// Programs `state`: the services in `pending` changed since the last sync. Works around
    /// what the kernel refuses: when it rejects a transaction (which changes nothing: it is
    /// atomic), the service the first refused message belonged to is left out, reported (a log
    /// line, an Event, a metric), and the rest applied in a new full transaction. A kernel that
    /// cannot keep owned tables gets unowned ones. Failures of nftproxy's own objects are
    /// returned (the caller backs off; the next sync is full).
    pub fn sync(
        &mut self,
        state: &ClusterState,
        pending: &Pending,
        reason: SyncReason,
        full: bool,
    ) -> Result<Synced, SyncError> {
        for name in &pending.services {
            if self.excluded.remove(name).is_some() {
                info!(service = %name, "trying again a service the kernel refused: it changed");
            }
        }
        if full
            && reason == SyncReason::Periodic
            && pending.is_empty()
            && let Some(synced) = self.unchanged_since_last_sync(state)?
        {
            return Ok(synced);
        }
        let mut full = full;
        let mut exclusions = 0;
        loop {
            let was_full = full || self.needs_full();
            let failures = match self.sync_once(state, pending, reason, full) {
                Err(SyncError::Netlink(NetlinkError::Rejected(failures))) => failures,
                // Another process committed since this one's last transaction: nothing was
                // applied; read the kernel back.
                Err(SyncError::Netlink(NetlinkError::GenerationChanged)) if !was_full => {
                    info!("the ruleset changed since nftproxy's last transaction: a full sync reads it back");
                    full = true;
                    continue;
                }
                other => return other,
            };
            full = true;
            // Another live process owns the tables: every message is refused, nobody's fault.
            if failures.iter().any(|f| f.errno == libc::EPERM) {
                warn!(
                    "the kernel refused a change to nftproxy's tables with EPERM: another process owns them \
                     (a second nftproxy? `nftproxy check` names it); retrying with backoff"
                );
                return Err(NetlinkError::Rejected(failures).into());
            }
            // Kernels before 6.9 do not know `persist` (before 5.12 not `owner`): EOPNOTSUPP.
            if self.ownership && failures.iter().any(|f| f.tag == OpTag::AddTable && f.errno == libc::EOPNOTSUPP) {
                warn!("this kernel cannot keep owned tables (NFT_TABLE_F_PERSIST needs Linux 6.9): ownership off");
                self.ownership = false;
                continue;
            }
            // Later failures may only follow from the first (an element naming a refused chain).
            let first = failures.iter().min_by_key(|f| f.op_index);
            let culprits: BTreeSet<NamespacedName> = match first {
                Some(f) if !f.owners.iter().any(|o| o.is_infrastructure()) => f
                    .owners
                    .iter()
                    .filter_map(|o| o.service())
                    .filter(|n| !self.excluded.contains_key(*n) && state.service(n).is_some())
                    .cloned()
                    .collect(),
                _ => BTreeSet::new(),
            };
            let Some(first) = first.filter(|_| !culprits.is_empty() && exclusions < MAX_EXCLUSIONS_PER_SYNC) else {
                // A partial sync names shared elements after nftproxy; a full one names the
                // service that claims them, so try that once before backing off.
                if !was_full {
                    continue;
                }
                return Err(NetlinkError::Rejected(failures).into());
            };
            exclusions += culprits.len();
            let why = format!("the kernel refused its rules, so it is not programmed: {first}");
            for name in culprits {
                let problem = Problem {
                    object: ObjectRef {
                        kind: ObjectKind::Service,
                        namespace: Some(name.namespace.clone()),
                        name: name.name.clone(),
                    },
                    field: String::new(),
                    reason: why.clone(),
                    object_skipped: true,
                };
                warn!("{problem}");
                self.problems.push(problem);
                self.excluded.insert(name, why.clone());
            }
        }
    }

    /// Whether a periodic sync must read the tables back; `false` when nobody can have changed
    /// them (the proof is the kernel's ruleset generation, unchanged since the last sync). A
    /// periodic sync that falls due while changes are pending then syncs just the changes: a
    /// full sync of 10,000 services takes about a second, which every change of that second
    /// would wait for.
    pub fn periodic_needs_read_back(&mut self, state: &ClusterState) -> Result<bool, SyncError> {
        Ok(self.no_drift_proof(state)?.is_none())
    }

    /// Why nftproxy's tables cannot have changed since its last transaction, with the node-port
    /// addresses (which must be the same): the tables were read back less than
    /// [`READ_BACK_PERIOD`] ago, and the kernel refuses other processes any change to owned
    /// tables, and for unowned ones the ruleset generation is still the one this process's last
    /// transaction produced. `None`: no proof, a full sync is needed.
    fn no_drift_proof(&mut self, state: &ClusterState) -> Result<Option<(&'static str, NodePortTargets)>, SyncError> {
        let recent = self.last_read_back.is_some_and(|t| t.elapsed() < READ_BACK_PERIOD);
        if !recent || self.needs_full() || self.programmed.is_none() {
            return Ok(None);
        }
        let targets = (self.nodeports)(&self.config, state.node());
        if self.targets.as_ref() != Some(&targets) {
            return Ok(None);
        }
        let proof = if self.ownership {
            "owned"
        } else {
            match (self.kernel.generation()?, self.generation) {
                (Some(now), Some(ours)) if now == ours => "generation",
                _ => return Ok(None),
            }
        };
        Ok(Some((proof, targets)))
    }

    /// A periodic sync that needs no read-back: nothing changed in the cluster and nobody can
    /// have changed the tables ([`Syncer::no_drift_proof`]). `None`: a full sync is needed.
    fn unchanged_since_last_sync(&mut self, state: &ClusterState) -> Result<Option<Synced>, SyncError> {
        let started = Instant::now();
        let Some((proof, targets)) = self.no_drift_proof(state)? else { return Ok(None) };
        let Some(programmed) = self.programmed.as_mut() else { return Ok(None) };
        tracing::debug!(proof, "periodic sync: nftproxy's tables cannot have changed; no read-back");
        let report = SyncReport {
            reason: SyncReason::Periodic,
            full: false,
            apply: ApplyStats::default(),
            drift_repairs: 0,
            services_changed: 0,
            services_planned: 0,
            plan: Duration::ZERO,
            read: Duration::ZERO,
            total: started.elapsed(),
        };
        Ok(Some(Synced {
            nodeports: targets,
            health_checks: programmed.health_checks(),
            conntrack: ConntrackUpdate::none(),
            stats: programmed.stats(),
            report,
        }))
    }

    /// Plans and applies once. Only services with pending changes are planned again, unless
    /// something every service depends on changed (the node, node-port addresses, the IP
    /// families in use) or nothing is programmed yet.
    fn sync_once(
        &mut self,
        state: &ClusterState,
        pending: &Pending,
        reason: SyncReason,
        full: bool,
    ) -> Result<Synced, SyncError> {
        let span = info_span!("sync", %reason, full = full || self.needs_full());
        let _enter = span.enter();
        let started = Instant::now();

        // Node-port addresses come from the interfaces (a netlink dump, slow right after a
        // commit): read them on full syncs and node changes; partial syncs reuse them.
        let targets = match &self.targets {
            Some(t) if !full && !self.needs_full() && !pending.node_changed => t.clone(),
            _ => (self.nodeports)(&self.config, state.node()),
        };
        let state = plannable(state, &self.excluded);
        let config = Arc::clone(&self.config);
        let input = PlanInput { config: &config, state: &state, nodeports_v4: &targets.v4, nodeports_v6: &targets.v6 };
        let families = plan::families(&input);
        let full = full
            || self.needs_full()
            || pending.node_changed
            // ServiceCIDRs are in the infrastructure, which full syncs write.
            || pending.service_cidrs_changed
            || self.programmed.as_ref().is_none_or(|p| p.families() != families)
            || self.targets.as_ref() != Some(&targets);

        let outcome = if full {
            // Only drift is left to repair when nothing else changed since the last sync.
            let only_drift = self.programmed.is_some() && pending.is_empty();
            self.full_sync(&input, &families)
                .map(|(apply, read, planned)| {
                    let drift = if only_drift { apply.operations } else { 0 };
                    (apply, read, planned, drift, None)
                })
                .map_err(SyncError::from)
        } else {
            self.partial_sync(&input, &families, pending)
                .map(|(apply, planned, conntrack)| (apply, Duration::ZERO, planned, 0, Some(conntrack)))
        };
        if let Err(SyncError::Internal(why)) = &outcome {
            self.needs_full = true;
            self.programmed = None;
            return Err(SyncError::Internal(why));
        }
        let (apply, read, services_planned, drift_repairs, conntrack) = match outcome {
            Ok(done) => done,
            Err(e) => {
                // The kernel kept its old state; forget ours so the next (full) sync plans
                // everything again from what the kernel holds.
                self.needs_full = true;
                self.programmed = None;
                warn!(error = %e, "sync failed; the next sync is a full one");
                return Err(e);
            }
        };
        self.needs_full = false;
        self.targets = Some(targets.clone());
        let Some(programmed) = self.programmed.as_mut() else {
            return Err(SyncError::Internal("a successful sync recorded nothing"));
        };
        let conntrack = match conntrack {
            _ if !self.config.conntrack_cleanup => ConntrackUpdate::none(),
            Some(changed) => changed,
            None => ConntrackUpdate::All(programmed.conntrack()),
        };
        let total = started.elapsed();
        let report = SyncReport {
            reason,
            full,
            apply,
            drift_repairs,
            services_changed: pending.services.len(),
            services_planned,
            plan: total.saturating_sub(read).saturating_sub(apply.kernel),
            read,
            total,
        };
        let stats = programmed.stats();
        if drift_repairs > 0 {
            warn!(operations = drift_repairs, "repaired drift: nftproxy's tables had been changed outside nftproxy");
        }
        info!(
            services = stats.services,
            ports = stats.service_ports,
            endpoints = stats.endpoints,
            changed = report.services_changed,
            planned = report.services_planned,
            messages = report.apply.messages,
            ms = format!("{:.1}", report.total.as_secs_f64() * 1000.0),
            kernel_ms = format!("{:.1}", report.apply.kernel.as_secs_f64() * 1000.0),
            "synced"
        );
        Ok(Synced { nodeports: targets, health_checks: programmed.health_checks(), conntrack, stats, report })
    }

    /// Reads the kernel's tables and streams everything planned against them (see [`delta`]).
    /// Returns what the kernel did, the read-back time and how many services were planned.
    fn full_sync(
        &mut self,
        input: &PlanInput<'_>,
        families: &[IpFamily],
    ) -> Result<(ApplyStats, Duration, usize), NetlinkError> {
        // Windows stay where they are: where this process placed them, or, when it has
        // programmed nothing yet (a start, or after a failure), where the kernel has them, so a
        // restart changes nothing that did not change.
        let placed_here = self.programmed.is_some();
        // The balancing maps this process emptied stay, as partial syncs keep them; a process
        // that has programmed nothing yet plans them from nothing (it deletes the empty ones).
        let emptied: Vec<(IpFamily, SharedSet)> =
            self.programmed.as_ref().map(|p| p.emptied().collect()).unwrap_or_default();
        self.programmed = None;
        self.generation = None;
        let mut read = Duration::ZERO;
        let mut rebuild = false;
        let mut stale_reads = 0;
        loop {
            let reading = Instant::now();
            // The generation the read-back shows: the transaction applies only if it still is
            // (else something committed while we read, and we read again).
            let before = self.kernel.generation()?;
            let kernel = self.kernel.read(&table_names(&self.config))?;
            read += reading.elapsed();
            let (prior, prior_affinity) = if placed_here {
                (self.placement.windows().collect::<Vec<_>>(), self.placement.affinity_slots().collect::<Vec<_>>())
            } else {
                let found = found_placement(&kernel);
                (found.windows, found.affinity)
            };
            let demands = input.state.services().map(|svc| (svc.name.clone(), plan::demands(input, families, svc)));
            let mut placement = Placement::settle(prior, prior_affinity, demands);
            // Only for sets the kernel holds: a new one starts empty.
            let flushes: Vec<SlotFlush> = placement
                .take_flushes()
                .into_iter()
                .filter(|f| kernel.table(f.family).is_some_and(|t| t.sets.contains_key(&f.set)))
                .collect();
            let infrastructure: FamilyMap<WireTable> = plan::plan_infrastructure(input, families).map(|family, t| {
                let mut table = lower_table(t);
                table.flags = table_flags(self.ownership, kernel.table(family));
                table
            });
            self.table_flags = infrastructure.map(|_, t| t.flags);
            let mut delta = Delta::full(View::from_kernel(kernel, families), infrastructure.clone(), rebuild);
            if delta.creates_tables() {
                delta.add_up_front(placement.maps());
            }
            delta.keep(&emptied);
            let mut programmed = Programmed::new(infrastructure);
            programmed.keep_emptied(&emptied);
            // Only for tables the transaction keeps: one it creates (at a cold start, a rebuild,
            // or because the diff re-creates it) starts its sets empty.
            let flushes: Vec<SlotFlush> = flushes.into_iter().filter(|f| !delta.creates_table(f.family)).collect();
            let forget = slot_deletions(&mut *self.kernel, &self.config.table, &flushes)?;
            let prepended = &self.prepended;
            let guard = before.filter(|_| stale_reads < MAX_STALE_READS);
            self.kernel.expect_generation(guard);
            let applied = self.kernel.apply_stream(&mut |sink| {
                prepended.iter().for_each(|op| sink.push(op.clone()));
                delta.begin(sink);
                // Before the services' operations: a set they recreate (a new timeout) loses its
                // clients anyway, and a plain delete (before Linux 6.3) must find the old one.
                forget.iter().for_each(|op| sink.push(op.clone()));
                for svc in input.state.services() {
                    let service_plan = plan::plan_service(input, families, svc, &placement);
                    let mut fragments = service_plan.lower();
                    let record = record(&service_plan, input.state, &placement);
                    programmed.insert_first_claims(svc.name.clone(), record, &mut fragments);
                    delta.service(sink, fragments)?;
                }
                delta.finish(sink);
                ControlFlow::Continue(())
            });
            let applied = match applied {
                Err(NetlinkError::GenerationChanged) => {
                    stale_reads += 1;
                    info!(attempt = stale_reads, "the ruleset changed while nftproxy read it back; reading again");
                    continue;
                }
                other => other?,
            };
            match applied {
                Some(apply) => {
                    let planned = input.state.service_count();
                    self.prepended.clear();
                    self.programmed = Some(programmed);
                    self.placement = placement;
                    self.generation =
                        guard.map(|g| if apply.messages > 0 { crate::netlink::next_generation(g) } else { g });
                    self.last_read_back = Some(Instant::now());
                    return Ok((apply, read, planned));
                }
                None => {
                    warn!(
                        reason = %delta.rebuild_reason.take().unwrap_or_default(),
                        "a full sync rebuilds nftproxy's tables (in one transaction)"
                    );
                    // Once: a rebuild claims nothing from the kernel, so it cannot stop again.
                    rebuild = true;
                }
            }
        }
    }

    /// Plans the changed services, old and new, and streams their difference. Returns what the
    /// kernel did and how many services were planned.
    fn partial_sync(
        &mut self,
        input: &PlanInput<'_>,
        families: &[IpFamily],
        pending: &Pending,
    ) -> Result<(ApplyStats, usize, ConntrackUpdate), SyncError> {
        let Some(programmed) = self.programmed.as_mut() else {
            return Err(SyncError::Internal("a partial sync without programmed state"));
        };
        let (mut before, mut after) = (Vec::new(), Vec::new());
        let (config, placement) = (&self.config, &mut self.placement);
        let targets = (input.nodeports_v4, input.nodeports_v6);
        let mut replan =
            |name: &NamespacedName, service: &ProgrammedService| replan(config, targets, families, name, service);
        let mut changes: Vec<Change> = Vec::with_capacity(pending.services.len());
        for name in &pending.services {
            let old = programmed.service(name).map(|old| {
                before.extend(old.conntrack.iter().cloned());
                replan(name, old)
            });
            let new = match input.state.service(name) {
                Some(svc) => {
                    placement.update_service(name, &plan::demands(input, families, svc));
                    let service_plan = plan::plan_service(input, families, svc, &*placement);
                    after.extend(service_plan.conntrack.iter().cloned());
                    Some((record(&service_plan, input.state, placement), service_plan.lower()))
                }
                None => {
                    placement.update_service(name, &Demands::default());
                    None
                }
            };
            changes.push((name.clone(), old, new));
        }
        let planned = changes.len();
        let flushes = placement.take_flushes();
        let scope = programmed.scope(changes, &mut replan);
        let mut delta = Delta::partial(scope.view, scope.kept);
        let mut wants = scope.wants.into_iter();
        let forget = slot_deletions(&mut *self.kernel, &self.config.table, &flushes)?;
        // Unowned tables may have been changed by anyone: apply only over the generation this
        // process last saw (else a full sync reads the kernel back). Owned ones cannot be.
        let guard = self.generation.filter(|_| !self.ownership);
        self.kernel.expect_generation(guard);
        let applied = self.kernel.apply_stream(&mut |sink| {
            delta.begin(sink);
            forget.iter().for_each(|op| sink.push(op.clone()));
            for want in wants.by_ref() {
                delta.service(sink, want)?;
            }
            delta.finish(sink);
            ControlFlow::Continue(())
        })?;
        // A partial sync replaces whole services, so nothing in its view must change in place.
        let apply = applied.ok_or(SyncError::Internal("a partial sync met an object that cannot change in place"))?;
        self.generation = guard.map(|g| if apply.messages > 0 { crate::netlink::next_generation(g) } else { g });
        Ok((apply, planned, ConntrackUpdate::Changed { before, after }))
    }

    /// The whole ruleset planned from scratch for `state`, with endpoint windows where they are
    /// and the emptied balancing maps kept since the last full sync: what the kernel holds
    /// after a successful sync, partial or full (tests compare the two).
    pub fn desired(&mut self, state: &ClusterState) -> WireRuleset {
        let mut desired = lower_ruleset(&self.planned(state));
        for table in &mut desired.tables {
            table.flags =
                self.table_flags.get(table.family).copied().unwrap_or_else(|| table_flags(self.ownership, None));
        }
        desired
    }

    /// The programmed ruleset as nft text (what `nft list ruleset` should show).
    pub fn render(&mut self, state: &ClusterState) -> String {
        self.planned(state).to_string()
    }

    /// The whole ruleset planned from `state` with the programmed node-port addresses and
    /// endpoint windows, leaving out the services the kernel refused, with the balancing maps
    /// kept after their last element (until the next full sync).
    fn planned(&mut self, state: &ClusterState) -> crate::nft::ast::Ruleset {
        let targets = self.targets.clone().unwrap_or_else(|| (self.nodeports)(&self.config, state.node()));
        let state = plannable(state, &self.excluded);
        let input =
            PlanInput { config: &self.config, state: &state, nodeports_v4: &targets.v4, nodeports_v6: &targets.v6 };
        let mut ruleset = plan::plan_placed(&input, &self.placement).ruleset;
        if let Some(programmed) = &self.programmed {
            for table in &mut ruleset.tables {
                plan::keep_balance_maps(table, programmed.emptied_maps(table.family));
            }
        }
        ruleset
    }
}

/// The cluster state without the excluded services: what is planned.
fn plannable<'a>(state: &'a ClusterState, excluded: &BTreeMap<NamespacedName, String>) -> Cow<'a, ClusterState> {
    if excluded.is_empty() {
        return Cow::Borrowed(state);
    }
    let mut state = state.clone();
    for name in excluded.keys() {
        state.remove_service(name);
    }
    Cow::Owned(state)
}

/// What to remember of a planned service.
fn record(plan: &plan::ServicePlan, state: &ClusterState, placement: &Placement) -> ProgrammedService {
    ProgrammedService {
        state: state.snapshot(&plan.service),
        slots: placement.placed(&plan.service),
        health_check: plan.health_check.clone(),
        conntrack: plan.conntrack.clone(),
        stats: plan.stats,
    }
}

/// Plans a programmed service again from its record, its endpoint windows where they were:
/// exactly the objects it programmed.
fn replan(
    config: &ProxyConfig,
    (nodeports_v4, nodeports_v6): (&plan::NodePorts, &plan::NodePorts),
    families: &[IpFamily],
    name: &NamespacedName,
    service: &ProgrammedService,
) -> Fragments {
    let state = service.state.to_state();
    let Some(svc) = state.service(name) else { return FamilyMap::new() };
    let input = PlanInput { config, state: &state, nodeports_v4, nodeports_v6 };
    plan::plan_service(&input, families, svc, &service.slots).lower()
}

/// The deletions that empty the affinity client keys of `flushes`: the clients the kernel
/// recorded under them (the elements of each client set whose slot field is in a flushed range).
/// Each set is read once.
fn slot_deletions(kernel: &mut dyn Netfilter, table: &str, flushes: &[SlotFlush]) -> Result<Vec<Op>, NetlinkError> {
    /// Per client set: the key ranges to empty, and the service a failure is blamed on.
    type Flushed<'a> = (Vec<(u32, u32)>, &'a NamespacedName);
    let mut ranges: BTreeMap<(IpFamily, &str), Flushed<'_>> = BTreeMap::new();
    for flush in flushes {
        let entry = ranges.entry((flush.family, flush.set.as_str())).or_insert_with(|| (Vec::new(), &flush.service));
        entry.0.push((flush.first, flush.last));
    }
    let mut ops = Vec::new();
    for ((family, set), (ranges, service)) in ranges {
        let slot_of = |key: &WireKey| key.bytes.last_chunk::<4>().map(|b| u32::from_ne_bytes(*b));
        let flushed = |j: u32| ranges.iter().any(|(first, last)| (*first..=*last).contains(&j));
        let keys: Vec<WireKey> =
            kernel.set_keys(family, table, set)?.into_iter().filter(|k| slot_of(k).is_some_and(flushed)).collect();
        if !keys.is_empty() {
            // A failure is the service's.
            let service = service.clone();
            let owner = crate::nft::ast::Owner::ServicePort(Arc::new(crate::nft::ast::OwnerRef {
                service,
                port: String::new(),
            }));
            ops.push(Op {
                family,
                table: table.to_string(),
                kind: OpKind::ForgetElements { set: set.to_string(), keys },
                owner,
            });
        }
    }
    Ok(ops)
}

/// The endpoint windows and affinity slots nftproxy's rules and maps in the kernel use, so a
/// restarted proxy keeps every service port where it is and every endpoint in its slot (and its
/// clients with it). Each table's balancing rules are read once for both.
fn found_placement(kernel: &WireRuleset) -> Placed {
    let mut out = Placed::default();
    for table in &kernel.tables {
        let rules = table.numgen_windows();
        let windows = found_windows(table.family, &rules);
        out.affinity.extend(found_affinity(table, &rules, &windows));
        out.windows.extend(windows);
    }
    out
}

/// The endpoint windows of one table's balancing rules: a chain's choice is its window (its
/// slot group 0's); a chain whose port has more than 255 slots has a chain per slot group
/// (`…_gG`), whose choice is group G's window, and reaches them through the split's window (the
/// offset of its first lookup in `affinity-windows-N`).
fn found_windows(family: IpFamily, rules: &[NumgenWindow]) -> Vec<(WindowId, Slot)> {
    let window = plan::placement::WINDOW;
    let mut out: BTreeMap<(&str, u32), Slot> = BTreeMap::new();
    for found in rules {
        let Some(SharedSet::EndpointMap(shard)) = SharedSet::from_name(&found.map) else { continue };
        if !AffinitySlots::is_modulus(found.modulus) || found.offset % window != 0 {
            continue;
        }
        let (chain, part) = match names::of_group_chain(&found.chain) {
            Some((chain, g)) => (chain, u32::try_from(g).unwrap_or(u32::MAX)),
            None => (found.chain.as_str(), 0),
        };
        out.entry((chain, part)).or_insert(Slot { shard, offset: found.offset });
    }
    let grouped = grouped_chains(rules);
    let mut first: BTreeMap<&str, &NumgenWindow> = BTreeMap::new();
    for found in rules.iter().filter(|r| grouped.contains(r.chain.as_str())) {
        if matches!(SharedSet::from_name(&found.map), Some(SharedSet::SlotWindows(_))) {
            let at = first.entry(found.chain.as_str()).or_insert(found);
            if found.rule < at.rule {
                *at = found;
            }
        }
    }
    for (chain, found) in first {
        if let Some(SharedSet::SlotWindows(shard)) = SharedSet::from_name(&found.map) {
            out.insert((chain, SPLIT), Slot { shard, offset: found.offset - found.offset % window });
        }
    }
    out.into_iter().map(|((chain, part), slot)| (WindowId::new(family, chain, part), slot)).collect()
}

/// The balancing chains that have chains per slot group.
fn grouped_chains(rules: &[NumgenWindow]) -> BTreeSet<&str> {
    rules.iter().filter_map(|r| Some(names::of_group_chain(&r.chain)?.0)).collect()
}

/// The affinity slots of one table: the slot count from a balancing chain's record rules (one
/// per slot: the rules that look a hash up in `affinity-windows-N` and not in
/// `affinity-endpoints-N`, in the chain or its group chains), the bindings from the
/// `affinity-targets-N` maps (a key at place `i` of the window of slot group `g` is slot
/// `255·g + i`).
fn found_affinity(
    table: &WireTable,
    rules: &[NumgenWindow],
    windows: &[(WindowId, Slot)],
) -> Vec<(AffinityId, AffinitySlots)> {
    let choice_rules: BTreeSet<(&str, usize)> = rules
        .iter()
        .filter(|r| matches!(SharedSet::from_name(&r.map), Some(SharedSet::EndpointMap(_))))
        .map(|r| (r.chain.as_str(), r.rule))
        .collect();
    let grouped = grouped_chains(rules);
    // A grouped chain's own lookups in `affinity-windows-N` choose the group: not records.
    let record_rules: BTreeSet<(&str, usize)> = rules
        .iter()
        .filter(|r| matches!(SharedSet::from_name(&r.map), Some(SharedSet::SlotWindows(_))))
        .map(|r| (r.chain.as_str(), r.rule))
        .filter(|rule| !choice_rules.contains(rule) && !grouped.contains(rule.0))
        .collect();
    let mut records: BTreeMap<&str, usize> = BTreeMap::new();
    for (chain, _) in record_rules {
        let chain = names::of_group_chain(chain).map_or(chain, |(chain, _)| chain);
        *records.entry(chain).or_default() += 1;
    }
    let mut capacity: BTreeMap<String, usize> = BTreeMap::new();
    for (chain, n) in records {
        if let Some(base) = port_base(chain) {
            // The cluster and the local chain of a port have the same slots.
            let c = capacity.entry(base.to_string()).or_default();
            *c = (*c).max(n);
        }
    }
    // Every group window of every chain: (shard, offset) → (chain, group).
    let chain_at: BTreeMap<(u32, u32), (&str, usize)> = windows
        .iter()
        .filter(|(id, _)| id.part != SPLIT)
        .map(|(id, slot)| ((slot.shard, slot.offset), (id.chain.as_str(), id.part as usize)))
        .collect();
    let mut bound: BTreeMap<String, Vec<(usize, SlotTarget)>> = BTreeMap::new();
    for set in table.sets.values() {
        let Some(SharedSet::SlotTargets(shard)) = SharedSet::from_name(&set.name) else { continue };
        for (key, element) in set.elements.iter() {
            let Ok(key) = <[u8; 4]>::try_from(key.bytes.as_slice()).map(u32::from_ne_bytes) else { continue };
            let (window, i) = AffinitySlots::slot_of_key(key);
            let Some((chain, group)) = chain_at.get(&(shard, window)) else { continue };
            let Some(base) = port_base(chain) else { continue };
            let WireData::Bytes(data) = &element.data else { continue };
            if let Some(target) = target_of(table.family, data) {
                bound.entry(base.to_string()).or_default().push((group * GROUP_SLOTS + i, target));
            }
        }
    }
    let mut out = Vec::new();
    for (base, n) in capacity {
        let bindings = bound.remove(&base).unwrap_or_default();
        if let Some(slots) = AffinitySlots::found(n, bindings) {
            out.push((AffinityId { family: table.family, base }, slots));
        }
    }
    out
}

/// The service port a balancing chain belongs to: its name without `service-` or `local-`.
fn port_base(chain: &str) -> Option<&str> {
    chain.strip_prefix("service-").or_else(|| chain.strip_prefix("local-"))
}

/// An endpoint as a map's data holds it: the address, then the port in a 32-bit word.
fn target_of(family: IpFamily, data: &[u8]) -> Option<SlotTarget> {
    let width = match family {
        IpFamily::V4 => 4,
        IpFamily::V6 => 16,
    };
    let address = address_from_bytes(data.get(..width)?)?;
    let (port, _) = data.get(width..)?.split_first_chunk::<2>()?;
    Some((address, u16::from_be_bytes(*port)))
}

#[cfg(test)]
mod tests;
