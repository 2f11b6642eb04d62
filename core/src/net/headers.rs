//! The packet headers a trace event carries (the first bytes of the network and transport
//! headers, as the packet was when it entered a base chain): protocol, addresses, ports.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// IANA protocol numbers the trace prints by name.
const TCP: u8 = 6;
const UDP: u8 = 17;
const SCTP: u8 = 132;
const ICMP: u8 = 1;
const ICMPV6: u8 = 58;

/// What a traced packet is, at one point of its way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headers {
    pub protocol: u8,
    pub source: IpAddr,
    pub destination: IpAddr,
    /// Ports of TCP, UDP and SCTP.
    pub ports: Option<(u16, u16)>,
    /// TCP flags (SYN, ACK, …).
    pub tcp_flags: Option<u8>,
}

impl Headers {
    /// Parses the headers of an event; `None` when they are missing or cut short.
    pub fn parse(network: &[u8], transport: Option<&[u8]>) -> Option<Headers> {
        let (protocol, source, destination) = match network.first()? >> 4 {
            4 if network.len() >= 20 => {
                let at = |i: usize| Ipv4Addr::new(network[i], network[i + 1], network[i + 2], network[i + 3]);
                (network[9], IpAddr::V4(at(12)), IpAddr::V4(at(16)))
            }
            6 if network.len() >= 40 => {
                let at = |i: usize| -> Option<IpAddr> {
                    let b: [u8; 16] = network.get(i..i + 16)?.try_into().ok()?;
                    Some(IpAddr::V6(Ipv6Addr::from(b)))
                };
                (network[6], at(8)?, at(24)?)
            }
            _ => return None,
        };
        let transport = transport.unwrap_or(&[]);
        let ports = match (protocol, transport) {
            (TCP | UDP | SCTP, [a, b, c, d, ..]) => Some((u16::from_be_bytes([*a, *b]), u16::from_be_bytes([*c, *d]))),
            _ => None,
        };
        let tcp_flags = (protocol == TCP).then(|| transport.get(13).copied()).flatten();
        Some(Headers { protocol, source, destination, ports, tcp_flags })
    }

    /// The destination port, if the protocol has ports.
    pub fn destination_port(&self) -> Option<u16> {
        self.ports.map(|(_, d)| d)
    }
}

/// The protocol's name (`tcp`), or its number.
pub fn protocol_name(protocol: u8) -> String {
    match protocol {
        TCP => "tcp".into(),
        UDP => "udp".into(),
        SCTP => "sctp".into(),
        ICMP => "icmp".into(),
        ICMPV6 => "icmpv6".into(),
        n => format!("protocol {n}"),
    }
}

/// `address:port` (`[address]:port` for IPv6), or the address alone.
pub fn endpoint(address: IpAddr, port: Option<u16>) -> String {
    match port {
        Some(p) => std::net::SocketAddr::new(address, p).to_string(),
        None => address.to_string(),
    }
}

fn flag_names(flags: u8) -> String {
    const NAMES: [(u8, &str); 6] =
        [(0x02, "SYN"), (0x10, "ACK"), (0x01, "FIN"), (0x04, "RST"), (0x08, "PSH"), (0x20, "URG")];
    NAMES.iter().filter(|(bit, _)| flags & bit != 0).map(|(_, n)| *n).collect::<Vec<_>>().join(",")
}

impl fmt::Display for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (sport, dport) = match self.ports {
            Some((s, d)) => (Some(s), Some(d)),
            None => (None, None),
        };
        write!(
            f,
            "{} {} -> {}",
            protocol_name(self.protocol),
            endpoint(self.source, sport),
            endpoint(self.destination, dport)
        )?;
        if let Some(flags) = self.tcp_flags.filter(|f| *f != 0) {
            write!(f, " [{}]", flag_names(flags))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn an_ipv4_tcp_syn_as_the_kernel_reports_it() {
        // Captured from a trace event: 10.99.0.2:46342 -> 172.30.0.41:80, SYN.
        let network = hex("4500003c8fc740004006f4480a630002ac1e0029");
        let transport = hex("b506005025c0cd7c00000000a002faf0b6da0000");
        let h = Headers::parse(&network, Some(&transport)).unwrap();
        assert_eq!(h.to_string(), "tcp 10.99.0.2:46342 -> 172.30.0.41:80 [SYN]");
        assert_eq!(h.destination_port(), Some(80));
    }

    #[test]
    fn ipv6_udp_and_short_headers() {
        let mut network = vec![0x60, 0, 0, 0, 0, 8, UDP, 64];
        network.extend_from_slice(&"fd00::1".parse::<Ipv6Addr>().unwrap().octets());
        network.extend_from_slice(&"fd00:96::10".parse::<Ipv6Addr>().unwrap().octets());
        let h = Headers::parse(&network, Some(&[0x30, 0x39, 0, 53, 0, 8, 0, 0])).unwrap();
        assert_eq!(h.to_string(), "udp [fd00::1]:12345 -> [fd00:96::10]:53");
        assert_eq!(Headers::parse(&network[..30], None), None);
        assert_eq!(Headers::parse(&[], None), None);
        let icmp = Headers::parse(&hex("45000054000040004001000a0a6300020a60000a"), Some(&[8, 0])).unwrap();
        assert_eq!(icmp.to_string(), "icmp 10.99.0.2 -> 10.96.0.10");
    }
}
