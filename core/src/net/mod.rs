//! Small network vocabulary shared by the Kubernetes model and the nftables layer.

pub mod headers;

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

/// One value per IP family, for the families in use (nftproxy's tables, a service's objects in
/// each table): at most two entries, IPv4 first, without allocating.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyMap<T> {
    v4: Option<T>,
    v6: Option<T>,
}

impl<T> Default for FamilyMap<T> {
    fn default() -> Self {
        FamilyMap { v4: None, v6: None }
    }
}

impl<T> FamilyMap<T> {
    /// An empty map.
    pub fn new() -> FamilyMap<T> {
        FamilyMap::default()
    }

    /// A value for each of `families`.
    pub fn from_fn(families: &[IpFamily], mut f: impl FnMut(IpFamily) -> T) -> FamilyMap<T> {
        let mut map = FamilyMap::new();
        for family in families {
            map.insert(*family, f(*family));
        }
        map
    }

    fn slot(&self, family: IpFamily) -> &Option<T> {
        match family {
            IpFamily::V4 => &self.v4,
            IpFamily::V6 => &self.v6,
        }
    }

    fn slot_mut(&mut self, family: IpFamily) -> &mut Option<T> {
        match family {
            IpFamily::V4 => &mut self.v4,
            IpFamily::V6 => &mut self.v6,
        }
    }

    /// The value of a family.
    pub fn get(&self, family: IpFamily) -> Option<&T> {
        self.slot(family).as_ref()
    }

    /// The value of a family, mutably.
    pub fn get_mut(&mut self, family: IpFamily) -> Option<&mut T> {
        self.slot_mut(family).as_mut()
    }

    /// Sets a family's value, returning the old one.
    pub fn insert(&mut self, family: IpFamily, value: T) -> Option<T> {
        self.slot_mut(family).replace(value)
    }

    /// Removes a family's value.
    pub fn remove(&mut self, family: IpFamily) -> Option<T> {
        self.slot_mut(family).take()
    }

    /// The value of a family, inserted by `f` when missing.
    pub fn get_or_insert_with(&mut self, family: IpFamily, f: impl FnOnce() -> T) -> &mut T {
        self.slot_mut(family).get_or_insert_with(f)
    }

    /// The families present, IPv4 first.
    pub fn families(&self) -> impl Iterator<Item = IpFamily> + '_ {
        IpFamily::ALL.into_iter().filter(|f| self.slot(*f).is_some())
    }

    /// (family, value) pairs, IPv4 first.
    pub fn iter(&self) -> impl Iterator<Item = (IpFamily, &T)> {
        [(IpFamily::V4, self.v4.as_ref()), (IpFamily::V6, self.v6.as_ref())]
            .into_iter()
            .filter_map(|(f, v)| Some((f, v?)))
    }

    /// (family, value) pairs, mutably, IPv4 first.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (IpFamily, &mut T)> {
        [(IpFamily::V4, self.v4.as_mut()), (IpFamily::V6, self.v6.as_mut())]
            .into_iter()
            .filter_map(|(f, v)| Some((f, v?)))
    }

    /// The values, IPv4 first.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.iter().map(|(_, v)| v)
    }

    /// Whether no family has a value.
    pub fn is_empty(&self) -> bool {
        self.v4.is_none() && self.v6.is_none()
    }

    /// The same families with each value mapped.
    pub fn map<U>(&self, mut f: impl FnMut(IpFamily, &T) -> U) -> FamilyMap<U> {
        FamilyMap { v4: self.v4.as_ref().map(|v| f(IpFamily::V4, v)), v6: self.v6.as_ref().map(|v| f(IpFamily::V6, v)) }
    }
}

impl<T> IntoIterator for FamilyMap<T> {
    type Item = (IpFamily, T);
    type IntoIter = std::iter::Flatten<std::array::IntoIter<Option<(IpFamily, T)>, 2>>;

    fn into_iter(self) -> Self::IntoIter {
        [self.v4.map(|v| (IpFamily::V4, v)), self.v6.map(|v| (IpFamily::V6, v))].into_iter().flatten()
    }
}
