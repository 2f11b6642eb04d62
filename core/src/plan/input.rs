//! What a plan depends on besides where endpoint windows are: the settings, the cluster state
//! and where NodePort traffic is accepted ([`PlanInput`]).

use std::net::IpAddr;

use crate::config::ProxyConfig;
use crate::model::ClusterState;
use crate::net::IpFamily;

/// Where NodePort traffic is accepted in one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePorts {
    /// Every local address except loopback (`fib daddr type local`).
    MatchAll,
    /// These addresses (the `nodeport-ips` set).
    Addresses(Vec<IpAddr>),
}

/// Everything a plan depends on besides where endpoint windows are.
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    pub config: &'a ProxyConfig,
    pub state: &'a ClusterState,
    pub nodeports_v4: &'a NodePorts,
    pub nodeports_v6: &'a NodePorts,
}

impl PlanInput<'_> {
    pub(super) fn nodeports(&self, family: IpFamily) -> &NodePorts {
        match family {
            IpFamily::V4 => self.nodeports_v4,
            IpFamily::V6 => self.nodeports_v6,
        }
    }
}
