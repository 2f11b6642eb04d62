//! What planning one service yields ([`ServicePlan`]): its share of each family's table
//! ([`Fragment`], and as the kernel holds it, [`WireFragment`]), its counts ([`PlanStats`]), the
//! health check it serves ([`HealthCheck`]) and its conntrack targets ([`ConntrackTarget`]).

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::objects::SharedSet;
use crate::model::NamespacedName;
use crate::net::{FamilyMap, IpFamily, L4Proto};
use crate::nft::lower::{lower_elements, lower_table};
use crate::nft::wire::{SetElements, WireTable};
use crate::nft::*;

/// Counts describing a plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanStats {
    pub services: usize,
    pub service_ports: usize,
    /// Endpoints DNAT can reach, summed over service ports and families.
    pub endpoints: usize,
    /// Service ports with no usable endpoint anywhere (traffic rejected).
    pub no_endpoints: usize,
    /// Service ports whose internal traffic is dropped for lack of local endpoints.
    pub no_local_internal: usize,
    /// Service ports whose external traffic is dropped for lack of local endpoints.
    pub no_local_external: usize,
    /// Of `no_local_internal` and `no_local_external`, the IPv6 ones (the metrics split them
    /// by family).
    pub no_local_internal_v6: usize,
    pub no_local_external_v6: usize,
}

impl PlanStats {
    /// Adds another plan's counts to these.
    pub fn add(&mut self, other: &PlanStats) {
        self.services += other.services;
        self.service_ports += other.service_ports;
        self.endpoints += other.endpoints;
        self.no_endpoints += other.no_endpoints;
        self.no_local_internal += other.no_local_internal;
        self.no_local_external += other.no_local_external;
        self.no_local_internal_v6 += other.no_local_internal_v6;
        self.no_local_external_v6 += other.no_local_external_v6;
    }

    /// Takes another plan's counts out of these (a service replaced or gone).
    pub fn subtract(&mut self, other: &PlanStats) {
        self.services -= other.services;
        self.service_ports -= other.service_ports;
        self.endpoints -= other.endpoints;
        self.no_endpoints -= other.no_endpoints;
        self.no_local_internal -= other.no_local_internal;
        self.no_local_external -= other.no_local_external;
        self.no_local_internal_v6 -= other.no_local_internal_v6;
        self.no_local_external_v6 -= other.no_local_external_v6;
    }

    /// Service ports of `family` whose internal and external traffic is dropped for lack of
    /// local endpoints.
    pub fn no_local(&self, family: IpFamily) -> (usize, usize) {
        match family {
            IpFamily::V4 => {
                (self.no_local_internal - self.no_local_internal_v6, self.no_local_external - self.no_local_external_v6)
            }
            IpFamily::V6 => (self.no_local_internal_v6, self.no_local_external_v6),
        }
    }
}

/// A `healthCheckNodePort` to serve, with the count it reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub service: NamespacedName,
    pub port: u16,
    /// Local ready endpoints per family of the service: each family's server reports its own
    /// family's count, as each of upstream's per-family proxiers does.
    pub local_endpoints: BTreeMap<IpFamily, usize>,
    /// The service's families: its server listens on their node-port addresses only, as
    /// upstream's per-family proxiers each serve their own family's services.
    pub families: Vec<IpFamily>,
}

impl HealthCheck {
    /// Local ready endpoints in `family` (0 for a family the service does not have).
    pub fn local_endpoints_in(&self, family: IpFamily) -> usize {
        self.local_endpoints.get(&family).copied().unwrap_or(0)
    }
}

/// A UDP or SCTP service port in one family as the conntrack reconciler sees it (built in
/// `plan/conntrack.rs`): where its flows arrive and which endpoints they may still go to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConntrackTarget {
    pub name: crate::model::ServicePortName,
    pub family: IpFamily,
    pub protocol: L4Proto,
    /// Destination IP:port pairs of the service (ClusterIP, external and LB IPs).
    pub destinations: Vec<(IpAddr, u16)>,
    pub node_port: Option<u16>,
    /// Every serving endpoint of the port, cluster-wide, sorted: flows to these are kept.
    pub endpoints: Vec<(IpAddr, u16)>,
}

/// A service's elements of the shared sets, per set.
pub type SharedElements = BTreeMap<SharedSet, BTreeMap<Vec<Value>, Element>>;

/// One service's share of one family's table.
#[derive(Debug, Clone)]
pub struct Fragment {
    /// The service's own chains and sets (service, local, external and firewall chains,
    /// affinity slot sets, source ranges), in a table of the right family and name.
    pub own: Table,
    /// Its elements of the shared sets and maps, and the maps its rules name (an entry,
    /// possibly without elements).
    pub shared: SharedElements,
}

impl Fragment {
    pub(super) fn new(family: IpFamily, table: &str) -> Fragment {
        Fragment { own: Table::new(family, table, None), shared: SharedElements::new() }
    }

    /// Notes that the service's rules name a shared set, with or without elements of its own
    /// in it: a set created on demand exists while any service names it.
    pub(super) fn names(&mut self, set: SharedSet) {
        self.shared.entry(set).or_default();
    }

    /// Adds an element to a shared set (a later one with the same key replaces it).
    pub(super) fn add(&mut self, set: SharedSet, key: Vec<Value>, element: Element) {
        self.shared.entry(set).or_default().insert(key, element);
    }

    /// The same objects as the kernel holds them.
    pub fn lower(&self) -> WireFragment {
        let family = self.own.family;
        WireFragment {
            own: lower_table(&self.own),
            shared: self
                .shared
                .iter()
                .map(|(set, elements)| (*set, lower_elements(set.shape(family), elements)))
                .collect(),
        }
    }
}

/// A [`Fragment`] as the kernel holds it.
#[derive(Debug, Clone)]
pub struct WireFragment {
    pub own: WireTable,
    pub shared: BTreeMap<SharedSet, SetElements>,
}

/// One service's share of the ruleset.
#[derive(Debug, Clone)]
pub struct ServicePlan {
    pub service: NamespacedName,
    /// One fragment per family the plan has (empty where the service has no ClusterIP).
    pub fragments: FamilyMap<Fragment>,
    pub stats: PlanStats,
    pub health_check: Option<HealthCheck>,
    pub conntrack: Vec<ConntrackTarget>,
}

impl ServicePlan {
    /// The fragments as the kernel holds them.
    pub fn lower(&self) -> FamilyMap<WireFragment> {
        self.fragments.map(|_, f| f.lower())
    }
}
