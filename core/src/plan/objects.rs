//! The names of nftproxy's own objects, and the shared sets and maps every service writes into,
//! as a type: the syncer keys its claims by [`SharedSet`], never by parsing names; a name read
//! back from the kernel is classified once, by [`SharedSet::from_name`].

use std::borrow::Cow;
use std::fmt;

use crate::net::IpFamily;
use crate::nft::ast::{Owner, Set, SetShape, Table};

pub const CLUSTER_IPS: &str = "cluster-ips";
pub const NODEPORT_IPS: &str = "nodeport-ips";
pub const FIREWALL_IPS: &str = "firewall-ips";
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
pub const SERVICE_IPS: &str = "service-ips";
pub const SERVICE_NODEPORTS: &str = "service-nodeports";
pub const HAIRPIN: &str = "hairpin-endpoints";
pub const CLUSTER_CIDRS: &str = "cluster-cidrs";
pub const BALANCED_SERVICE_IPS: &str = "balanced-service-ips";
pub const BALANCED_EXTERNAL_IPS: &str = "balanced-external-ips";
pub const BALANCED_NODEPORTS: &str = "balanced-nodeports";
pub const BALANCED_LOCAL_IPS: &str = "balanced-local-ips";
pub const BALANCED_LOCAL_NODEPORTS: &str = "balanced-local-nodeports";
// ServiceCIDR (issue 14): the ranges of the ServiceCIDR objects.
pub const SERVICE_CIDRS: &str = "service-cidrs";

pub const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
pub const FIREWALL_CHECK: &str = "firewall-check";
pub const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";
pub const MASQUERADING: &str = "masquerading";
pub const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
pub const REJECT_CHAIN: &str = "reject-chain";
pub const SERVICES: &str = "services";
pub const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
pub const NODEPORTS: &str = "nodeports";
pub const BALANCE_SERVICE: &str = "balance-service";
pub const BALANCE_EXTERNAL: &str = "balance-external";
pub const BALANCE_NODEPORT: &str = "balance-nodeport";
pub const BALANCE_EXTERNAL_NODEPORT: &str = "balance-external-nodeport";
pub const BALANCE_LOCAL: &str = "balance-local";
pub const BALANCE_LOCAL_NODEPORT: &str = "balance-local-nodeport";
pub const BALANCE_EXTERNAL_LOCAL: &str = "balance-external-local";
pub const BALANCE_EXTERNAL_LOCAL_NODEPORT: &str = "balance-external-local-nodeport";

const ENDPOINT_MAP: &str = "affinity-endpoints-";
const SLOT_WINDOWS: &str = "affinity-windows-";
const SLOT_TARGETS: &str = "affinity-targets-";
const SLOT_CLIENTS: &str = "affinity-clients-";

/// Endpoints per shard of affinity maps before the next shard is used (a service port that
/// grows later may pass it; it never moves): see [`crate::plan::placement`].
pub const SHARD_LOAD: u32 = 256;

/// The most clients an `affinity-clients-N` set holds: 65,535 (upstream's limit for one
/// endpoint's set) for each endpoint a shard holds before the next is used.
pub const CLIENTS_PER_SHARD: u32 = 65_535 * SHARD_LOAD;

/// Which family of balancing maps: what they are keyed by and which endpoints they hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BalanceMap {
    /// `service-endpoints-N`: service address . protocol . port . index → endpoint.
    Service,
    /// `nodeport-endpoints-N`: protocol . node port . index → endpoint.
    Nodeport,
    /// `local-endpoints-N`: the external addresses of ports with `externalTrafficPolicy:
    /// Local`, keyed as `Service`, to this node's endpoints.
    Local,
    /// `local-nodeport-endpoints-N`: their node ports, keyed as `Nodeport`, to this node's
    /// endpoints.
    LocalNodeport,
}

impl BalanceMap {
    pub const ALL: [BalanceMap; 4] =
        [BalanceMap::Service, BalanceMap::Nodeport, BalanceMap::Local, BalanceMap::LocalNodeport];

    fn prefix(self) -> &'static str {
        match self {
            BalanceMap::Service => "service-endpoints-",
            BalanceMap::Nodeport => "nodeport-endpoints-",
            BalanceMap::Local => "local-endpoints-",
            BalanceMap::LocalNodeport => "local-nodeport-endpoints-",
        }
    }

    /// The balancing chain whose rules read the maps of this kind.
    pub fn chain(self) -> &'static str {
        match self {
            BalanceMap::Service => BALANCE_SERVICE,
            BalanceMap::Nodeport => BALANCE_NODEPORT,
            BalanceMap::Local => BALANCE_LOCAL,
            BalanceMap::LocalNodeport => BALANCE_LOCAL_NODEPORT,
        }
    }

    /// Whether the map is keyed by a node port (protocol . port), not an address.
    pub fn by_nodeport(self) -> bool {
        matches!(self, BalanceMap::Nodeport | BalanceMap::LocalNodeport)
    }
}

/// The number a shared set's name ends with, written the one way nftproxy writes it.
fn numbered(name: &str, prefix: &str) -> Option<u32> {
    let digits = name.strip_prefix(prefix)?;
    let canonical =
        !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && (digits == "0" || !digits.starts_with('0'));
    if canonical { digits.parse().ok() } else { None }
}

/// A set or map that every service port may add elements to. Elements of one key may be claimed
/// by several services (conflicting input): within one set the first in name order wins, in full
/// and partial syncs alike. Claims are per set, so when the services put the key in different
/// sets (an ExternalIP equal to another service's ClusterIP; one address in a Cluster and a
/// Local service; endpoint maps of different counts) both elements are written and the lookup
/// order decides the path: the `services` chain looks up `service-ips` (the ports with chains
/// of their own, ClusterIPs and external IPs alike), then balanced ClusterIPs, external IPs and
/// Local ones, and the balancing chains try the smallest endpoint count first. Within the map
/// it reaches, the key's endpoints are still those of the first claimant in name order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SharedSet {
    ClusterIps,
    NodeportIps,
    FirewallIps,
    NoEndpointNodeports,
    NoEndpointServices,
    ServiceIps,
    ServiceNodeports,
    /// `hairpin-endpoints`: the same element whoever claims it (a pod behind two services).
    Hairpin,
    ClusterCidrs,
    /// `service-cidrs`: the ServiceCIDRs' ranges (issue 14), written by the infrastructure.
    ServiceCidrs,
    /// `affinity-endpoints-N`: hash range → endpoint, for the service ports with session
    /// affinity; each owns a window of it, so its keys are never contested. Beside it
    /// `affinity-windows-N` and `affinity-targets-N` hold their slots (see
    /// [`crate::plan::placement`]).
    EndpointMap(u32),
    /// `affinity-windows-N`: each affinity slot's share of its port's hash window, at the
    /// slot's own offset in the port's window.
    SlotWindows(u32),
    /// `affinity-targets-N`: the endpoint each affinity slot is bound to, under the slot's key.
    SlotTargets(u32),
    /// `affinity-clients-N`: the clients of the affinity ports whose client keys are in shard N
    /// (a port's are `K + j` for its slots `j`, K the offset of its first chain's window), each
    /// with its port's timeout. The kernel fills it; one set per shard rather than one per port,
    /// as the kernel finds a set by a scan of the table's sets for every rule that names one.
    SlotClients(u32),
    /// `balanced-service-ips`: ClusterIPs (with protocol and port) balanced by `balance-service`.
    BalancedServiceIps,
    /// `balanced-external-ips`: external and LoadBalancer IPs balanced by `balance-external`.
    BalancedExternalIps,
    /// `balanced-nodeports`: node ports balanced by `balance-external-nodeport` (which
    /// masquerades, then goes to `balance-nodeport`).
    BalancedNodeports,
    /// `balanced-local-ips`: external and LoadBalancer IPs of ports with
    /// `externalTrafficPolicy: Local`, balanced by `balance-external-local`.
    BalancedLocalIps,
    /// `balanced-local-nodeports`: their node ports, balanced by
    /// `balance-external-local-nodeport`.
    BalancedLocalNodeports,
    /// `service-endpoints-N`, `nodeport-endpoints-N`, `local-endpoints-N`,
    /// `local-nodeport-endpoints-N`: the endpoints (of the kind the [`BalanceMap`] says) of every
    /// balanced service address (node port) that has N of them, by index `0..N`. Planned, with
    /// its rule in the balancing chain, while it holds any; the syncer keeps it once created
    /// (see `plan/balance.rs`).
    Balance(BalanceMap, u32),
}

impl SharedSet {
    /// The sets and maps of the infrastructure that services write into.
    pub const SERVICE_WRITTEN: [SharedSet; 12] = [
        SharedSet::ClusterIps,
        SharedSet::FirewallIps,
        SharedSet::NoEndpointNodeports,
        SharedSet::NoEndpointServices,
        SharedSet::ServiceIps,
        SharedSet::ServiceNodeports,
        SharedSet::BalancedServiceIps,
        SharedSet::BalancedExternalIps,
        SharedSet::BalancedNodeports,
        SharedSet::BalancedLocalIps,
        SharedSet::BalancedLocalNodeports,
        SharedSet::Hairpin,
    ];

    /// The shared maps one shard of affinity windows is made of.
    pub fn affinity_shard(shard: u32) -> [SharedSet; 3] {
        [SharedSet::EndpointMap(shard), SharedSet::SlotWindows(shard), SharedSet::SlotTargets(shard)]
    }

    /// The object's name in the table.
    pub fn name(self) -> Cow<'static, str> {
        Cow::Borrowed(match self {
            SharedSet::ClusterIps => CLUSTER_IPS,
            SharedSet::NodeportIps => NODEPORT_IPS,
            SharedSet::FirewallIps => FIREWALL_IPS,
            SharedSet::NoEndpointNodeports => NO_ENDPOINT_NODEPORTS,
            SharedSet::NoEndpointServices => NO_ENDPOINT_SERVICES,
            SharedSet::ServiceIps => SERVICE_IPS,
            SharedSet::ServiceNodeports => SERVICE_NODEPORTS,
            SharedSet::Hairpin => HAIRPIN,
            SharedSet::ClusterCidrs => CLUSTER_CIDRS,
            SharedSet::BalancedServiceIps => BALANCED_SERVICE_IPS,
            SharedSet::BalancedExternalIps => BALANCED_EXTERNAL_IPS,
            SharedSet::BalancedNodeports => BALANCED_NODEPORTS,
            SharedSet::BalancedLocalIps => BALANCED_LOCAL_IPS,
            SharedSet::BalancedLocalNodeports => BALANCED_LOCAL_NODEPORTS,
            SharedSet::ServiceCidrs => SERVICE_CIDRS,
            SharedSet::EndpointMap(n) => return Cow::Owned(format!("{ENDPOINT_MAP}{n}")),
            SharedSet::SlotWindows(n) => return Cow::Owned(format!("{SLOT_WINDOWS}{n}")),
            SharedSet::SlotTargets(n) => return Cow::Owned(format!("{SLOT_TARGETS}{n}")),
            SharedSet::SlotClients(n) => return Cow::Owned(format!("{SLOT_CLIENTS}{n}")),
            SharedSet::Balance(map, n) => return Cow::Owned(format!("{}{n}", map.prefix())),
        })
    }

    /// The shared set a name read back from the kernel is, if it is one.
    pub fn from_name(name: &str) -> Option<SharedSet> {
        // The named ones: those services write into, and those only the infrastructure writes.
        let mut fixed = SharedSet::SERVICE_WRITTEN.into_iter().chain([
            SharedSet::NodeportIps,
            SharedSet::ClusterCidrs,
            SharedSet::ServiceCidrs,
        ]);
        if let Some(s) = fixed.find(|s| s.name() == name) {
            return Some(s);
        }
        let window = numbered(name, ENDPOINT_MAP)
            .map(SharedSet::EndpointMap)
            .or_else(|| numbered(name, SLOT_WINDOWS).map(SharedSet::SlotWindows))
            .or_else(|| numbered(name, SLOT_TARGETS).map(SharedSet::SlotTargets))
            .or_else(|| numbered(name, SLOT_CLIENTS).map(SharedSet::SlotClients));
        let balance = || {
            BalanceMap::ALL.into_iter().find_map(|map| {
                let n = numbered(name, map.prefix())?;
                (n > 0).then_some(SharedSet::Balance(map, n))
            })
        };
        window.or_else(balance)
    }

    /// Whether this is keyed by the numbers of endpoint windows (each service port owns a
    /// window, so its keys are never contested).
    pub fn is_endpoint_map(self) -> bool {
        matches!(
            self,
            SharedSet::EndpointMap(..)
                | SharedSet::SlotWindows(_)
                | SharedSet::SlotTargets(_)
                | SharedSet::SlotClients(_)
        )
    }

    /// Whether the set is created by the first service that writes into it or names it, rather
    /// than with the infrastructure: an endpoint map is deleted once no service's elements or
    /// rules use it, a balancing map kept by the syncer while its process runs.
    pub fn on_demand(self) -> bool {
        matches!(
            self,
            SharedSet::EndpointMap(..)
                | SharedSet::SlotWindows(_)
                | SharedSet::SlotTargets(_)
                | SharedSet::SlotClients(_)
                | SharedSet::Balance(..)
        )
    }

    /// The set's shape in a family's table.
    pub fn shape(self, family: IpFamily) -> SetShape {
        match self {
            SharedSet::ClusterIps | SharedSet::NodeportIps => SetShape::Addresses(family),
            SharedSet::FirewallIps | SharedSet::NoEndpointServices | SharedSet::ServiceIps => {
                SetShape::ServiceVerdicts(family)
            }
            SharedSet::BalancedServiceIps | SharedSet::BalancedExternalIps | SharedSet::BalancedLocalIps => {
                SetShape::ServiceKeys(family)
            }
            SharedSet::BalancedNodeports | SharedSet::BalancedLocalNodeports => SetShape::PortKeys,
            SharedSet::Balance(map, n) if map.by_nodeport() => SetShape::NodeportEndpoints(family, n),
            SharedSet::Balance(_, n) => SetShape::ServiceEndpoints(family, n),
            SharedSet::NoEndpointNodeports | SharedSet::ServiceNodeports => SetShape::PortVerdicts,
            SharedSet::Hairpin => SetShape::AddressPairs(family),
            SharedSet::ClusterCidrs | SharedSet::ServiceCidrs => SetShape::Prefixes(family),
            SharedSet::EndpointMap(..) => SetShape::EndpointTargets(family),
            SharedSet::SlotWindows(_) => SetShape::SlotWindows,
            SharedSet::SlotTargets(_) => SetShape::SlotTargets(family),
            SharedSet::SlotClients(_) => SetShape::AffinityClients(family),
        }
    }

    fn comment(self) -> Cow<'static, str> {
        Cow::Borrowed(match self {
            SharedSet::ClusterIps => "Active ClusterIPs",
            SharedSet::NodeportIps => "IPs that accept NodePort traffic",
            SharedSet::FirewallIps => "destinations that are subject to LoadBalancerSourceRanges",
            SharedSet::NoEndpointNodeports => "vmap to drop or reject packets to service nodeports with no endpoints",
            SharedSet::NoEndpointServices => "vmap to drop or reject packets to services with no endpoints",
            SharedSet::ServiceIps => "ClusterIP, ExternalIP and LoadBalancer IP traffic",
            SharedSet::ServiceNodeports => "NodePort traffic",
            SharedSet::Hairpin => "endpoints reaching themselves through a service (masqueraded)",
            SharedSet::ClusterCidrs => "pod ranges (detect-local)",
            SharedSet::ServiceCidrs => "ranges of the ServiceCIDRs",
            SharedSet::EndpointMap(_) => {
                "endpoints of service ports with session affinity: a jhash window per port, a range per endpoint"
            }
            SharedSet::SlotWindows(_) => "affinity slots: the hash range of each slot's endpoint",
            SharedSet::SlotTargets(_) => "affinity slots: the endpoint each slot is bound to",
            SharedSet::SlotClients(_) => "affinity clients: each client . slot, for its port's timeout",
            SharedSet::BalancedServiceIps => "ClusterIP traffic balanced by balance-service",
            SharedSet::BalancedExternalIps => "ExternalIP and LoadBalancer IP traffic balanced by balance-external",
            // Unchanged since `balance-nodeport` masqueraded itself: a set's comment is part of
            // its type, and a changed type re-creates the table (forgetting affinity clients).
            SharedSet::BalancedNodeports => "NodePort traffic balanced by balance-nodeport",
            SharedSet::BalancedLocalIps => {
                "ExternalIP and LoadBalancer IP traffic with externalTrafficPolicy Local, balanced by balance-external-local"
            }
            SharedSet::BalancedLocalNodeports => {
                "NodePort traffic with externalTrafficPolicy Local, balanced by balance-external-local-nodeport"
            }
            SharedSet::Balance(BalanceMap::Service, n) => {
                return Cow::Owned(format!("balanced service addresses with {n} endpoints, by numgen index"));
            }
            SharedSet::Balance(BalanceMap::Nodeport, n) => {
                return Cow::Owned(format!("balanced node ports with {n} endpoints, by numgen index"));
            }
            SharedSet::Balance(BalanceMap::Local, n) => {
                return Cow::Owned(format!("external addresses with {n} endpoints on this node, by numgen index"));
            }
            SharedSet::Balance(BalanceMap::LocalNodeport, n) => {
                return Cow::Owned(format!("node ports with {n} endpoints on this node, by numgen index"));
            }
        })
    }

    /// Whether each element has a counter (issue 16): the sets and maps whose lookups in the nat
    /// chains classify a new connection, once per connection. A connection to a service port
    /// matches one element of one of them: where it is balanced (`service-ips`, the `balanced-…`
    /// sets, `service-nodeports`) or where it is rejected or dropped (the `no-endpoint-…` maps).
    pub fn counted(self) -> bool {
        matches!(
            self,
            SharedSet::ServiceIps
                | SharedSet::BalancedServiceIps
                | SharedSet::BalancedExternalIps
                | SharedSet::ServiceNodeports
                | SharedSet::BalancedNodeports
                | SharedSet::BalancedLocalIps
                | SharedSet::BalancedLocalNodeports
                | SharedSet::NoEndpointServices
                | SharedSet::NoEndpointNodeports
        )
    }

    /// The empty set or map as nftproxy creates it in a family's table.
    pub fn empty(self, family: IpFamily) -> Set {
        let mut set = Set::new(self.name(), self.shape(family), Owner::infrastructure()).with_comment(&self.comment());
        if let SharedSet::SlotClients(_) = self {
            set.size = Some(CLIENTS_PER_SHARD);
        }
        if self.counted() { set.with_counter() } else { set }
    }
}

impl fmt::Display for SharedSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// Where a set goes in the table: shared sets first, then the endpoint maps in shard order,
/// then per-service sets. The kernel finds a set by scanning the table's sets in creation
/// order, so the sets most rules refer to go first.
pub fn set_rank(name: &str, infrastructure: bool) -> (u8, Option<SharedSet>) {
    match SharedSet::from_name(name) {
        Some(set) if set.on_demand() => (1, Some(set)),
        _ if infrastructure => (0, None),
        _ => (2, None),
    }
}

/// Orders a merged table's sets by [`set_rank`] (a stable sort: planning order otherwise).
pub fn order_sets(table: &mut Table) {
    let rank = |name: &str, set: &Set| set_rank(name, set.owner.is_infrastructure());
    table.sets.sort_by(|a, x, b, y| rank(a, x).cmp(&rank(b, y)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for set in SharedSet::SERVICE_WRITTEN
            .into_iter()
            .chain([SharedSet::NodeportIps, SharedSet::ClusterCidrs, SharedSet::ServiceCidrs])
            .chain([SharedSet::EndpointMap(12), SharedSet::EndpointMap(0)])
            .chain([SharedSet::SlotWindows(3), SharedSet::SlotTargets(0), SharedSet::SlotClients(7)])
            .chain([SharedSet::Balance(BalanceMap::Service, 1), SharedSet::Balance(BalanceMap::Nodeport, 250)])
            .chain([SharedSet::Balance(BalanceMap::Local, 2), SharedSet::Balance(BalanceMap::LocalNodeport, 17)])
        {
            assert_eq!(SharedSet::from_name(&set.name()), Some(set), "{set}");
        }
        for bad in [
            "endpoints-0",
            "affinity-endpoints-",
            "endpoints-",
            "endpoints-01",
            "endpoints-x",
            "endpoints-AB12-ns/svc",
            "affinity-x",
            "services",
            "service-endpoints-0",
            "nodeport-endpoints-07",
        ] {
            assert_eq!(SharedSet::from_name(bad), None, "{bad}");
        }
    }
}
