//! The one place effects run in order: source events → cluster state → plan → diff → apply.
//!
//! [`Reconciler`] keeps the cluster state and, per service, the part of it that service was
//! last programmed from ([`programmed`]). A **partial** sync plans only the services with
//! pending changes, old and new version, and sends only their difference; a **full** sync (at
//! start, every `--sync-period`, after any failure, and when the node, node-port addresses or
//! families change) plans everything and diffs it with nftproxy's tables read back from the
//! kernel, so anything that drifted (a flushed chain, a deleted element, a deleted table) is
//! repaired in the same single transaction; it is streamed into the batch one service at a
//! time (`full.rs`), so it never holds the desired ruleset or the transaction.

mod full;
pub mod programmed;
pub mod runner;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{debug, info, info_span, warn};

use crate::config::ProxyConfig;
use crate::model::{
    ClusterState, EndpointSliceInfo, NamespacedName, NodeInfo, ObjectRef, Problem, ServiceInfo, convert,
};
use crate::net::IpFamily;
use crate::netlink::{ApplyStats, Netfilter, NetlinkError};
use crate::nft::ast::Owner;
use crate::nft::diff::{Transaction, diff, diff_into};
use crate::nft::lower::{lower_ruleset, lower_table};
use crate::nft::wire::{WireRuleset, WireSet, WireTable, consts};
use crate::nodeaddr::NodePortTargets;
use crate::plan::slots::{MapKind, SlotTable};
use crate::plan::{self, ConntrackTarget, HealthCheck, Plan, PlanInput, PlanStats, plan};
use crate::source::{Event, Kind};
use full::FullStream;
use programmed::{Programmed, ProgrammedService};

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
    /// The operations a partial sync sent (a full sync streams its operations into the batch
    /// and keeps none: `apply.operations` counts them).
    pub transaction: Transaction,
    pub apply: ApplyStats,
    /// Operations that repaired drift found by a full sync (0 on partial syncs).
    pub drift_repairs: usize,
    pub services_changed: usize,
    /// Time planning; for a full sync, planning, diffing and encoding, which run interleaved
    /// (one service at a time, straight into the batch).
    pub plan: Duration,
    /// Time reading the kernel's tables back (full syncs).
    pub read: Duration,
    /// Time lowering and diffing (partial syncs).
    pub diff: Duration,
    pub total: Duration,
}

/// nftproxy's tables in both families (whether they exist or not).
pub fn table_names(config: &ProxyConfig) -> Vec<(IpFamily, &str)> {
    IpFamily::ALL.iter().map(|f| (*f, config.table.as_str())).collect()
}

/// Reads nftproxy's tables, plans with the endpoint blocks found there, diffs and applies the
/// difference as one transaction (the one-shot `sync`). Tables of a family the plan no longer
/// has are deleted.
pub fn sync_with_kernel(
    nf: &mut dyn Netfilter,
    config: &ProxyConfig,
    make_plan: impl FnOnce(&mut SlotTable) -> Plan,
) -> Result<(Plan, SyncReport), SyncError> {
    let started = Instant::now();
    let current = nf.read(&table_names(config))?;
    let read = started.elapsed();
    let planning = Instant::now();
    let plan = make_plan(&mut SlotTable::from_kernel(&current));
    let plan_time = planning.elapsed();
    let diffed = Instant::now();
    let mut desired = lower_ruleset(&plan.ruleset);
    // A one-shot sync exits at once: owning the tables would mean nothing, so it keeps their
    // flags as they are (the kernel refuses to toggle `persist`).
    for table in &mut desired.tables {
        table.flags = table_flags(false, current.table(table.family));
    }
    let transaction = diff_into(&current, desired);
    let diff_time = diffed.elapsed();
    let apply = nf.apply(&transaction)?;
    let report = SyncReport {
        reason: SyncReason::Startup,
        full: true,
        transaction,
        apply,
        drift_repairs: 0,
        services_changed: plan.stats.services,
        plan: plan_time,
        read,
        diff: diff_time,
        total: started.elapsed(),
    };
    Ok((plan, report))
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

/// The service an owner names (`ns/name:port` → `ns/name`); `None` for nftproxy's own objects.
pub fn owner_service(owner: &Owner) -> Option<NamespacedName> {
    if owner.is_infrastructure() {
        return None;
    }
    let service = owner.as_str().split(':').next()?;
    let (namespace, name) = service.split_once('/')?;
    Some(NamespacedName::new(namespace, name))
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

/// How many refused services one sync leaves out before it gives up (the services stay left
/// out, so the next sync, after a backoff, goes on where this one stopped).
const MAX_EXCLUSIONS_PER_SYNC: usize = 16;

/// Deletes nftproxy's tables (and nothing else). Returns how many there were.
pub fn cleanup(nf: &mut dyn Netfilter, config: &ProxyConfig) -> Result<usize, SyncError> {
    let current = nf.read(&table_names(config))?;
    let n = current.tables.len();
    let transaction = diff(&current, &WireRuleset::default());
    nf.apply(&transaction)?;
    Ok(n)
}

fn parse_time(s: &str) -> Option<std::time::SystemTime> {
    humantime::parse_rfc3339_weak(s.trim()).ok()
}

/// Resolves node-port addresses for a plan (reads interfaces; tests substitute fixed values).
pub type NodePortResolver = Box<dyn FnMut(&ProxyConfig, Option<&NodeInfo>) -> NodePortTargets + Send>;

/// The resolver reading this namespace's interfaces.
pub fn local_nodeports() -> NodePortResolver {
    Box::new(|config: &ProxyConfig, node: Option<&NodeInfo>| crate::nodeaddr::resolve(&config.nodeport_addresses, node))
}

/// What observers (health servers, metrics, conntrack cleanup) learn after a successful sync.
#[derive(Debug, Clone)]
pub struct Synced {
    pub at: Instant,
    /// Where NodePorts (and health-check servers) listen.
    pub nodeports: NodePortTargets,
    pub health_checks: Vec<HealthCheck>,
    /// UDP and SCTP service ports and their endpoints (empty when conntrack cleanup is off).
    pub conntrack: Vec<ConntrackTarget>,
    pub stats: PlanStats,
    pub report: SyncReport,
}

/// The reconciler's state.
pub struct Reconciler {
    config: ProxyConfig,
    nf: Box<dyn Netfilter>,
    nodeports: NodePortResolver,
    state: ClusterState,
    pending: BTreeSet<NamespacedName>,
    node_changed: bool,
    synced_kinds: HashSet<Kind>,
    /// What the last successful sync programmed (`None` before it, and after a failure).
    programmed: Option<Programmed>,
    /// Node-port addresses the programmed state was planned with.
    targets: Option<NodePortTargets>,
    /// Where each service port's endpoints sit in the shared maps (kept across syncs).
    slots: SlotTable,
    needs_full: bool,
    problems: Vec<Problem>,
    changes: Changes,
    /// Services left out because the kernel refused their objects, with the reason; each gets
    /// another chance when it changes.
    excluded: BTreeMap<NamespacedName, String>,
    /// Whether the tables are claimed (`--table-ownership`, unless the kernel cannot).
    ownership: bool,
    /// The table flags the last full sync programmed, per family.
    table_flags: Vec<(IpFamily, u32)>,
}

/// Changes folded in since the last [`Reconciler::take_changes`].
#[derive(Debug, Clone, Default)]
pub struct Changes {
    pub services: u64,
    pub endpoints: u64,
    /// `endpoints.kubernetes.io/last-change-trigger-time` of changed EndpointSlices.
    pub trigger_times: Vec<std::time::SystemTime>,
}

impl Reconciler {
    /// A reconciler applying to `nf`.
    pub fn new(config: ProxyConfig, nf: Box<dyn Netfilter>, nodeports: NodePortResolver) -> Reconciler {
        Reconciler {
            nf,
            nodeports,
            state: ClusterState::new(),
            pending: BTreeSet::new(),
            node_changed: false,
            synced_kinds: HashSet::new(),
            programmed: None,
            targets: None,
            slots: SlotTable::new(),
            needs_full: true,
            problems: Vec::new(),
            changes: Changes::default(),
            excluded: BTreeMap::new(),
            ownership: config.table_ownership,
            table_flags: Vec::new(),
            config,
        }
    }

    /// Services the kernel refused, left out of the ruleset until they change, and why.
    pub fn excluded(&self) -> &BTreeMap<NamespacedName, String> {
        &self.excluded
    }

    /// Whether nftproxy's tables are claimed (owned) by this process.
    pub fn owns_tables(&self) -> bool {
        self.ownership
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.config
    }

    /// The cluster state as last seen.
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// Whether the first complete lists of Services and EndpointSlices have arrived (upstream
    /// never syncs before that, so a restart does not briefly program a partial view).
    pub fn ready(&self) -> bool {
        self.synced_kinds.contains(&Kind::Services) && self.synced_kinds.contains(&Kind::EndpointSlices)
    }

    /// Whether there is something to sync.
    pub fn has_changes(&self) -> bool {
        !self.pending.is_empty() || self.node_changed
    }

    /// Whether the next sync must be full.
    pub fn needs_full(&self) -> bool {
        self.needs_full || self.programmed.is_none()
    }

    /// Asks for a full sync next time.
    pub fn request_full(&mut self) {
        self.needs_full = true;
    }

    /// Changes since the last call (for metrics).
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    /// Changes not taken yet.
    pub fn pending_changes(&self) -> &Changes {
        &self.changes
    }

    /// Problems reported since the last call (for Events and metrics).
    pub fn take_problems(&mut self) -> Vec<Problem> {
        std::mem::take(&mut self.problems)
    }

    fn report(&mut self, problems: Vec<Problem>) {
        for p in &problems {
            warn!("{p}");
        }
        self.problems.extend(problems);
    }

    /// Replaces the state, recording which services changed and how.
    pub fn replace_state(&mut self, new: ClusterState) {
        let (services, endpoints) = self.state.changes(&new);
        self.changes.services += services.len() as u64;
        self.changes.endpoints += endpoints.len() as u64;
        self.changes.trigger_times.extend(
            endpoints
                .iter()
                .flat_map(|svc| new.slices_of(svc))
                .filter_map(|s| s.trigger_time.as_deref())
                .filter_map(parse_time),
        );
        if self.state.node() != new.node() {
            self.node_changed = true;
        }
        debug!(services = services.len(), endpoints = endpoints.len(), "state replaced");
        for name in services.into_iter().chain(endpoints) {
            self.mark_changed(name);
        }
        self.state = new;
    }

    /// Folds one source event into the state.
    pub fn on_event(&mut self, event: Event) {
        match event {
            Event::Snapshot(snapshot) => {
                let (new, problems) = crate::source::state_from_snapshot(&snapshot, &self.config.hostname);
                self.report(problems);
                self.replace_state(new);
            }
            Event::ServicesListed(list) => {
                let mut new = self.state.clone();
                new.clear_services();
                for svc in &list {
                    let converted = convert::service(svc);
                    self.report(converted.problems);
                    if let Some(info) = converted.value {
                        new.upsert_service(info);
                    }
                }
                self.replace_state(new);
            }
            Event::SlicesListed(list) => {
                let mut new = self.state.clone();
                new.clear_slices();
                for slice in &list {
                    let converted = convert::endpoint_slice(slice);
                    self.report(converted.problems);
                    if let Some(info) = converted.value {
                        new.upsert_slice(info);
                    }
                }
                self.replace_state(new);
            }
            Event::NodesListed(list) => {
                let ours = list.iter().find(|n| n.metadata.name.as_deref() == Some(self.config.hostname.as_str()));
                let info = ours.and_then(|n| {
                    let converted = convert::node(n);
                    self.report(converted.problems.clone());
                    converted.value
                });
                if self.state.set_node(info) {
                    self.node_changed = true;
                }
            }
            Event::ServiceApplied(svc) => {
                let name = NamespacedName::new(
                    svc.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
                    svc.metadata.name.clone().unwrap_or_default(),
                );
                let converted = convert::service(&svc);
                self.report(converted.problems);
                match converted.value {
                    Some(info) => self.upsert_service(info),
                    None => self.remove_service(&name),
                }
            }
            Event::ServiceDeleted(name) => self.remove_service(&name),
            Event::SliceApplied(slice) => {
                let name = NamespacedName::new(
                    slice.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
                    slice.metadata.name.clone().unwrap_or_default(),
                );
                let converted = convert::endpoint_slice(&slice);
                self.report(converted.problems);
                match converted.value {
                    Some(info) => self.upsert_slice(info),
                    None => self.remove_slice(&name),
                }
            }
            Event::SliceDeleted(name) => self.remove_slice(&name),
            Event::NodeApplied(node) => {
                if node.metadata.name.as_deref() != Some(self.config.hostname.as_str()) {
                    return;
                }
                let converted = convert::node(&node);
                self.report(converted.problems);
                if self.state.set_node(converted.value) {
                    self.node_changed = true;
                }
            }
            Event::NodeDeleted => {
                if self.state.set_node(None) {
                    self.node_changed = true;
                }
            }
            Event::Synced(kind) => {
                self.synced_kinds.insert(kind);
            }
        }
    }

    /// Adds or replaces a Service (already validated).
    pub fn upsert_service(&mut self, info: ServiceInfo) {
        let name = info.name.clone();
        if self.state.upsert_service(info) {
            self.changes.services += 1;
            self.mark_changed(name);
        }
    }

    /// Removes a Service.
    pub fn remove_service(&mut self, name: &NamespacedName) {
        if self.state.remove_service(name) {
            self.changes.services += 1;
            self.mark_changed(name.clone());
        }
    }

    /// Adds or replaces an EndpointSlice (already validated).
    pub fn upsert_slice(&mut self, info: EndpointSliceInfo) {
        let trigger = info.trigger_time.as_deref().and_then(parse_time);
        let changed = self.state.upsert_slice(info);
        if !changed.is_empty() {
            self.changes.endpoints += 1;
            self.changes.trigger_times.extend(trigger);
        }
        for name in changed {
            self.mark_changed(name);
        }
    }

    /// Removes an EndpointSlice.
    pub fn remove_slice(&mut self, name: &NamespacedName) {
        if let Some(service) = self.state.remove_slice(name) {
            self.changes.endpoints += 1;
            self.mark_changed(service);
        }
    }

    /// Queues a service whose Service or EndpointSlices changed; one the kernel refused gets
    /// another chance.
    fn mark_changed(&mut self, name: NamespacedName) {
        if self.excluded.remove(&name).is_some() {
            info!(service = %name, "trying again a service the kernel refused: it changed");
        }
        self.pending.insert(name);
    }

    /// Plans and applies as one transaction, working around what the kernel refuses: when it
    /// rejects a transaction (which changes nothing: it is atomic), the service that the first
    /// refused message belonged to is left out, reported (a log line, an Event, a metric), and
    /// the rest applied in a new full transaction. A kernel that cannot keep owned tables gets
    /// unowned ones. Failures of nftproxy's own objects are returned (the caller backs off).
    pub fn sync(&mut self, reason: SyncReason, full: bool) -> Result<Synced, SyncError> {
        let mut full = full;
        let mut exclusions = 0;
        loop {
            let was_full = full || self.needs_full();
            let failures = match self.sync_once(reason, full) {
                Err(SyncError::Netlink(NetlinkError::Rejected(failures))) => failures,
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
            if self.ownership && failures.iter().any(|f| f.op.starts_with("add table ") && f.errno == libc::EOPNOTSUPP)
            {
                warn!("this kernel cannot keep owned tables (NFT_TABLE_F_PERSIST needs Linux 6.9): ownership off");
                self.ownership = false;
                continue;
            }
            // Later failures may only follow from the first (an element naming a refused chain).
            let first = failures.iter().min_by_key(|f| f.op_index);
            let culprits: BTreeSet<NamespacedName> = match first {
                Some(f) if !f.owners.iter().any(Owner::is_infrastructure) => f
                    .owners
                    .iter()
                    .filter_map(owner_service)
                    .filter(|n| !self.excluded.contains_key(n) && self.state.service(n).is_some())
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
            let reason = format!("the kernel refused its rules, so it is not programmed: {first}");
            let problems = culprits
                .into_iter()
                .map(|name| {
                    self.excluded.insert(name.clone(), reason.clone());
                    Problem {
                        object: ObjectRef { kind: "Service", namespace: Some(name.namespace), name: name.name },
                        field: String::new(),
                        reason: reason.clone(),
                        object_skipped: true,
                    }
                })
                .collect();
            self.report(problems);
        }
    }

    /// Plans and applies once. `full` forces a read-back of the kernel's tables.
    ///
    /// Only services with pending changes are planned again, unless something every service
    /// depends on changed (the node, node-port addresses, the IP families in use) or nothing
    /// is programmed yet; the transaction holds only their difference, or on a full sync
    /// everything that differs from what the kernel holds.
    fn sync_once(&mut self, reason: SyncReason, full: bool) -> Result<Synced, SyncError> {
        let span = info_span!("sync", %reason, full = full || self.needs_full());
        let _enter = span.enter();
        let started = Instant::now();
        let services_changed = self.pending.len();

        // Node-port addresses come from the interfaces (a netlink dump, slow right after a
        // commit): read them on full syncs and node changes; partial syncs reuse them.
        let targets = match &self.targets {
            Some(t) if !full && !self.needs_full() && !self.node_changed => t.clone(),
            _ => (self.nodeports)(&self.config, self.state.node()),
        };
        let state = plannable(&self.state, &self.excluded);
        let families = {
            let input =
                PlanInput { config: &self.config, state: &state, nodeports_v4: &targets.v4, nodeports_v6: &targets.v6 };
            plan::families(&input)
        };
        // Everything is planned again when asked, when nothing is programmed (a start, or after
        // a failure), or when something every service depends on changed (the node, node-port
        // addresses, the IP families in use).
        let full = full
            || self.needs_full()
            || self.node_changed
            || self.programmed.as_ref().is_none_or(|p| p.families() != families.as_slice())
            || self.targets.as_ref() != Some(&targets);

        let planning = Instant::now();
        let input =
            PlanInput { config: &self.config, state: &state, nodeports_v4: &targets.v4, nodeports_v6: &targets.v6 };
        let mut drift_repairs = 0;
        let mut read = Duration::ZERO;
        let (outcome, transaction, planned_services, plan_time, diff_time) = if full {
            // Only drift is left to repair when nothing else changed since the last sync.
            let only_drift = self.programmed.is_some() && self.pending.is_empty() && !self.node_changed;
            let seed_slots = self.programmed.is_none();
            self.programmed = None;
            let mut rebuild = false;
            loop {
                // A full sync reads the kernel first. With nothing programmed the endpoint
                // blocks found there seed the plan, so a restart changes nothing that did not
                // change.
                let reading = Instant::now();
                let kernel = match self.nf.read(&table_names(&self.config)) {
                    Ok(k) => k,
                    Err(e) => {
                        self.needs_full = true;
                        return Err(e.into());
                    }
                };
                read += reading.elapsed();
                if seed_slots {
                    self.slots = SlotTable::from_kernel(&kernel);
                }
                let mut infrastructure: Vec<WireTable> =
                    plan::plan_infrastructure(&input, &families).iter().map(lower_table).collect();
                for table in &mut infrastructure {
                    table.flags = table_flags(self.ownership, kernel.table(table.family));
                }
                self.table_flags = infrastructure.iter().map(|t| (t.family, t.flags)).collect();
                let streamed = stream_full_sync(
                    self.nf.as_mut(),
                    &mut self.slots,
                    &input,
                    &families,
                    infrastructure,
                    kernel,
                    rebuild,
                );
                match streamed {
                    Ok((None, _, reason)) => {
                        warn!(reason = %reason.unwrap_or_default(), "a full sync rebuilds nftproxy's tables (in one transaction)");
                        // Once: a rebuild claims nothing from the kernel, so it cannot stop.
                        rebuild = true;
                        continue;
                    }
                    Ok((Some(apply), programmed, _)) => {
                        if only_drift {
                            drift_repairs = apply.operations;
                        }
                        let planned = programmed.services().count();
                        self.programmed = Some(programmed);
                        let plan_time = planning.elapsed().saturating_sub(read).saturating_sub(apply.kernel);
                        break (Ok(apply), Transaction::default(), planned, plan_time, Duration::ZERO);
                    }
                    Err(e) => {
                        let plan_time = planning.elapsed().saturating_sub(read);
                        break (Err(e), Transaction::default(), 0, plan_time, Duration::ZERO);
                    }
                }
            }
        } else if let Some(programmed) = self.programmed.as_mut() {
            let (config, slots) = (&self.config, &mut self.slots);
            let mut replan = |name: &NamespacedName, service: &ProgrammedService| {
                replan_service(config, &targets, &families, slots, name, service)
            };
            // What the changed services programmed, planned again before their blocks move.
            let mut olds: Vec<programmed::Fragments> = Vec::with_capacity(self.pending.len());
            for name in &self.pending {
                olds.push(programmed.service(name).map(|old| replan(name, old)).unwrap_or_default());
            }
            self.slots.begin();
            let mut changes = Vec::with_capacity(self.pending.len());
            for (name, old) in self.pending.iter().zip(olds) {
                let new = state.service(name).map(|svc| {
                    let (_, record, fragments) = ProgrammedService::lower(
                        plan::plan_service(&input, &families, svc, &mut self.slots),
                        state.snapshot(name),
                    );
                    (record, fragments)
                });
                changes.push((name.clone(), old, new));
            }
            let old_chains: Vec<(IpFamily, String)> = changes
                .iter()
                .flat_map(|(_, old, _)| programmed::chains(old).map(|(f, c)| (f, c.to_string())))
                .collect();
            self.slots.finish_for(old_chains.iter().map(|(f, c)| (*f, c.as_str())));
            let planned = changes.len();
            let diffing = Instant::now();
            let (config, slots) = (&self.config, &mut self.slots);
            let mut replan = |name: &NamespacedName, service: &ProgrammedService| {
                replan_service(config, &targets, &families, slots, name, service)
            };
            let tx = programmed.replace(changes, &mut replan);
            let diff_time = diffing.elapsed();
            let plan_time = planning.elapsed().saturating_sub(diff_time);
            let outcome = self.nf.apply(&tx);
            (outcome, tx, planned, plan_time, diff_time)
        } else {
            return Err(SyncError::Internal("a partial sync without programmed state"));
        };

        match outcome {
            Ok(apply) => {
                let Some(programmed) = self.programmed.as_ref() else {
                    return Err(SyncError::Internal("no programmed state after planning"));
                };
                self.needs_full = false;
                self.pending.clear();
                self.node_changed = false;
                self.targets = Some(targets.clone());
                let stats = programmed.stats();
                let report = SyncReport {
                    reason,
                    full,
                    apply,
                    drift_repairs,
                    services_changed,
                    plan: plan_time,
                    read,
                    diff: diff_time,
                    total: started.elapsed(),
                    transaction,
                };
                if drift_repairs > 0 {
                    warn!(
                        operations = drift_repairs,
                        "repaired drift: nftproxy's tables had been changed outside nftproxy"
                    );
                }
                info!(
                    services = stats.services,
                    ports = stats.service_ports,
                    endpoints = stats.endpoints,
                    changed = services_changed,
                    planned = planned_services,
                    messages = report.apply.messages,
                    ms = format!("{:.1}", report.total.as_secs_f64() * 1000.0),
                    kernel_ms = format!("{:.1}", report.apply.kernel.as_secs_f64() * 1000.0),
                    "synced"
                );
                Ok(Synced {
                    at: Instant::now(),
                    nodeports: targets,
                    health_checks: programmed.health_checks(),
                    conntrack: if self.config.conntrack_cleanup { programmed.conntrack() } else { Vec::new() },
                    stats,
                    report,
                })
            }
            Err(e) => {
                // The kernel kept its old state; forget ours so the next (full) sync plans
                // everything again from what the kernel holds.
                self.needs_full = true;
                self.programmed = None;
                warn!(error = %e, "sync failed; the next sync is a full one");
                Err(e.into())
            }
        }
    }

    /// The whole ruleset planned from scratch for the current state, keeping endpoint blocks
    /// where they are: what the kernel holds after a successful sync, partial or full.
    pub fn desired(&mut self) -> WireRuleset {
        let targets = match &self.targets {
            Some(t) => t.clone(),
            None => (self.nodeports)(&self.config, self.state.node()),
        };
        let state = plannable(&self.state, &self.excluded);
        let input =
            PlanInput { config: &self.config, state: &state, nodeports_v4: &targets.v4, nodeports_v6: &targets.v6 };
        let mut desired = lower_ruleset(&plan(&input, &mut self.slots.clone()).ruleset);
        for table in &mut desired.tables {
            let applied = self.table_flags.iter().find(|(f, _)| *f == table.family).map(|(_, flags)| *flags);
            table.flags = applied.unwrap_or_else(|| table_flags(self.ownership, None));
        }
        desired
    }

    /// The programmed ruleset as nft text (what `nft list ruleset` should show).
    pub fn render(&mut self) -> String {
        let targets = match &self.targets {
            Some(t) => t.clone(),
            None => (self.nodeports)(&self.config, self.state.node()),
        };
        let state = plannable(&self.state, &self.excluded);
        let input =
            PlanInput { config: &self.config, state: &state, nodeports_v4: &targets.v4, nodeports_v6: &targets.v6 };
        plan(&input, &mut self.slots.clone()).ruleset.to_string()
    }
}

/// What a streamed full sync returns: the kernel's answer (`None`: it stopped before sending
/// anything, since the tables must be rebuilt), what was programmed, and why it stopped.
type Streamed = (Option<ApplyStats>, Programmed, Option<String>);

/// Plans every service and streams the difference with the kernel's tables into one
/// transaction (see [`full`]): the infrastructure, then each service in name order, then the
/// removal of whatever the kernel holds that nothing planned claimed.
fn stream_full_sync(
    nf: &mut dyn Netfilter,
    slots: &mut SlotTable,
    input: &PlanInput<'_>,
    families: &[IpFamily],
    infrastructure: Vec<WireTable>,
    kernel: WireRuleset,
    rebuild: bool,
) -> Result<Streamed, NetlinkError> {
    let mut programmed = Programmed::new(families.to_vec(), infrastructure.clone());
    let mut stream = FullStream::new(kernel, infrastructure, rebuild);
    slots.begin();
    if stream.creates_tables() {
        stream.add_up_front(endpoint_maps(input, families, slots));
    }
    let applied = nf.apply_stream(&mut |sink| {
        stream.begin(sink);
        for svc in input.state.services() {
            let service_plan = plan::plan_service(input, families, svc, slots);
            let (name, record, mut fragments) = ProgrammedService::lower(service_plan, input.state.snapshot(&svc.name));
            programmed.insert_first_claims(name, record, &mut fragments);
            stream.service(sink, fragments)?;
        }
        slots.finish();
        stream.finish(sink);
        ControlFlow::Continue(())
    })?;
    Ok((applied, programmed, stream.rebuild_reason.take()))
}

/// The endpoint maps the services use, (family index, empty map): every service is planned
/// once without keeping anything, which also places every endpoint window in the slot table.
fn endpoint_maps(input: &PlanInput<'_>, families: &[IpFamily], slots: &mut SlotTable) -> Vec<(usize, WireSet)> {
    let mut seen: HashSet<(usize, String)> = HashSet::new();
    let mut maps = Vec::new();
    for svc in input.state.services() {
        let service_plan = plan::plan_service(input, families, svc, slots);
        for (fi, fragment) in service_plan.fragments.iter().enumerate() {
            let new = |name: &String| MapKind::parse(name).is_some() && !seen.contains(&(fi, name.clone()));
            if !fragment.sets.keys().any(new) {
                continue;
            }
            for (name, mut set) in lower_table(fragment).sets {
                if MapKind::parse(&name).is_some() && seen.insert((fi, name)) {
                    set.elements.clear();
                    maps.push((fi, set));
                }
            }
        }
    }
    maps
}

/// Plans a programmed service again from the state it was planned with, its endpoint windows
/// where they are (the slot table frozen): exactly the objects it programmed.
fn replan_service(
    config: &ProxyConfig,
    targets: &NodePortTargets,
    families: &[IpFamily],
    slots: &mut SlotTable,
    name: &NamespacedName,
    service: &ProgrammedService,
) -> programmed::Fragments {
    let state = service.state.to_state();
    let Some(svc) = state.service(name) else { return Vec::new() };
    let input = PlanInput { config, state: &state, nodeports_v4: &targets.v4, nodeports_v6: &targets.v6 };
    slots.set_frozen(true);
    let fragments = plan::plan_service(&input, families, svc, slots).fragments;
    slots.set_frozen(false);
    fragments.iter().map(lower_table).collect()
}

#[cfg(test)]
mod tests;
