//! nftables object names for service ports and endpoints, as upstream kube-proxy forms them:
//! `<prefix><HASH>-<namespace>/<name>/<protocol>/<port>`, where HASH is the first 8 characters
//! of base32(sha256(name)). The hash keeps names unique when they are truncated and makes
//! near-identical names easy to tell apart.

use sha2::{Digest, Sha256};

use crate::model::{Endpoint, ServicePortName};

/// nftables names are at most 255 bytes; upstream reserves 16 for the prefix.
const NAME_BASE_MAX: usize = 256 - 16;

/// `HASH-name`, truncated to the kernel's limit with `...`.
pub fn hash_and_truncate(name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    let encoded = data_encoding::BASE32.encode(&digest);
    let mut out = format!("{}-{name}", &encoded[..8]);
    if out.len() > NAME_BASE_MAX {
        let mut cut = NAME_BASE_MAX - 3;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str("...");
    }
    out
}

/// The base name of a service port's objects: `HASH-ns/svc/proto/port`.
pub fn service_port_base(spn: &ServicePortName) -> String {
    hash_and_truncate(&format!("{}/{}/{}/{}", spn.service.namespace, spn.service.name, spn.protocol.name(), spn.port))
}

/// A service port's balancing chain over its cluster-wide endpoints (session affinity; as
/// upstream's service chain): `service-HASH-ns/svc/proto/port`.
pub fn cluster_chain(base: &str) -> String {
    format!("service-{base}")
}

/// A service port's balancing chain over this node's endpoints: `local-HASH-ns/svc/proto/port`.
pub fn local_chain(base: &str) -> String {
    format!("local-{base}")
}

/// The chain of slot group `g` of a port's balancing chain `chain` (a port of more than 255
/// affinity slots): `chain_gG`. No part of a base name has a `_` (its namespace, name and port
/// are DNS labels, the protocol a word), so the suffix cannot be mistaken for a port's name; at
/// most 8 + 240 + 6 bytes.
pub fn group_chain(chain: &str, g: usize) -> String {
    format!("{chain}_g{g}")
}

/// The balancing chain and slot group of a group chain's name.
pub fn of_group_chain(chain: &str) -> Option<(&str, usize)> {
    let (base, g) = chain.rsplit_once("_g")?;
    let canonical = !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()) && (g == "0" || !g.starts_with('0'));
    if canonical { Some((base, g.parse().ok()?)) } else { None }
}

/// The base name of an endpoint's objects: `HASH-ns/svc/proto/port__ip/port`, with IPv6 colons
/// replaced by dots (colons are not allowed in nftables names).
pub fn endpoint_base(spn: &ServicePortName, ep: &Endpoint) -> String {
    let ip = ep.ip.to_string().replace(':', ".");
    hash_and_truncate(&format!(
        "{}/{}/{}/{}__{ip}/{}",
        spn.service.namespace,
        spn.service.name,
        spn.protocol.name(),
        spn.port,
        ep.port
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(name: &str) -> String {
        hash_and_truncate(name)[..8].to_string()
    }

    #[test]
    fn upstream_test_vectors() {
        assert_eq!(hash("ns1/svc1/tcp/p80"), "ULMVA6XW");
        assert_eq!(hash("ns2/svc2/tcp/p80"), "42NFTM6N");
        assert_eq!(hash("ns1/svc1/tcp/p80__10.180.0.1/80"), "5OJB2KTY");
        assert_eq!(hash("testing/service/tcp/http"), "P4ZYZVCF");
        assert_eq!(hash("testing/service/tcp/http__10.180.0.1/80"), "JO2XBXZR");
        assert_eq!(hash_and_truncate("ns1/svc1/tcp/p80"), "ULMVA6XW-ns1/svc1/tcp/p80");
    }

    #[test]
    fn group_chains_name_their_chain_and_group() {
        let port = ServicePortName {
            service: crate::model::NamespacedName::new("ns", "svc"),
            port: "g1".into(),
            protocol: crate::net::L4Proto::Tcp,
        };
        let chain = format!("service-{}", service_port_base(&port));
        assert_eq!(of_group_chain(&chain), None, "a port named g1 is not a group");
        assert_eq!(of_group_chain(&group_chain(&chain, 12)), Some((chain.as_str(), 12)));
        assert_eq!(of_group_chain("service-x_g012"), None);
        let long = format!("service-{}", hash_and_truncate(&"a/".repeat(200)));
        assert!(group_chain(&long, 1023).len() <= 255);
    }

    #[test]
    fn long_names_are_truncated_with_an_ellipsis() {
        let long = format!("{}/{}/tcp/{}", "a".repeat(63), "b".repeat(63), "c".repeat(200));
        let name = hash_and_truncate(&long);
        assert_eq!(name.len(), NAME_BASE_MAX);
        assert!(name.ends_with("..."));
    }
}
