//! Small network vocabulary shared by the Kubernetes model and the nftables layer.

use std::fmt;
use std::net::IpAddr;

/// An IP family. Each family gets its own nftables table (`ip nftproxy`, `ip6 nftproxy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    /// Both families, IPv4 first (the order tables are programmed and rendered in).
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    /// The family of an address.
    pub fn of(addr: &IpAddr) -> IpFamily {
        match addr {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    /// The family of a network.
    pub fn of_net(net: &ipnet::IpNet) -> IpFamily {
        match net {
            ipnet::IpNet::V4(_) => IpFamily::V4,
            ipnet::IpNet::V6(_) => IpFamily::V6,
        }
    }

    /// Kubernetes' spelling (`IPv4`, `IPv6`), as in `spec.ipFamilies` and EndpointSlice `addressType`.
    pub fn k8s_name(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.k8s_name())
    }
}

/// A layer-4 protocol a Service port can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum L4Proto {
    Tcp,
    Udp,
    Sctp,
}

impl L4Proto {
    /// The IANA protocol number (what `meta l4proto` loads).
    pub fn number(self) -> u8 {
        match self {
            L4Proto::Tcp => 6,
            L4Proto::Udp => 17,
            L4Proto::Sctp => 132,
        }
    }

    /// Lower-case name, as nft prints `inet_proto` values and as upstream puts it in chain names.
    pub fn name(self) -> &'static str {
        match self {
            L4Proto::Tcp => "tcp",
            L4Proto::Udp => "udp",
            L4Proto::Sctp => "sctp",
        }
    }

    /// The protocol with this IANA number, if it is one a Service can use.
    pub fn from_number(n: u8) -> Option<L4Proto> {
        match n {
            6 => Some(L4Proto::Tcp),
            17 => Some(L4Proto::Udp),
            132 => Some(L4Proto::Sctp),
            _ => None,
        }
    }

    /// Parses Kubernetes' spelling (`TCP`, `UDP`, `SCTP`).
    pub fn from_k8s(s: &str) -> Option<L4Proto> {
        match s {
            "TCP" => Some(L4Proto::Tcp),
            "UDP" => Some(L4Proto::Udp),
            "SCTP" => Some(L4Proto::Sctp),
            _ => None,
        }
    }
}

impl fmt::Display for L4Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
