//! Reading the element counters of nftproxy's counted sets and maps (issue 16): one element
//! dump per set, keeping only what the per-service metrics need.

use std::collections::HashMap;
use std::sync::Arc;

use nftnl_sys as sys;

use super::decode::{a, absent_is_empty, dump_elements};
use super::error::NetlinkError;
use super::socket::Socket;
use crate::net::IpFamily;
use crate::nft::lower::nfproto;
use crate::nft::wire::udata;

/// One counted element as the kernel holds it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CountedElement {
    /// The family of the table the set is in.
    pub family: IpFamily,
    /// The set or map's name.
    pub set: Arc<str>,
    /// The key, as the kernel stores it (each field padded to 4 bytes).
    pub key: Vec<u8>,
    /// The element comment (nftproxy's name for the owning service port: `namespace/name:port`).
    pub comment: Option<Arc<str>>,
    /// A verdict map element's verdict code (`NF_DROP` is 0, `NFT_GOTO` -4).
    pub verdict: Option<i32>,
    /// Packets the element's counter has seen (new connections: the sets are looked up in nat
    /// chains, which see a connection's first packet only).
    pub packets: u64,
}

/// Appends the counted elements of `sets` in table `table` of `family` to `out`. A table or set
/// that does not exist adds nothing; elements without a counter are left out.
pub(super) fn read_counted(
    sock: &mut Socket,
    family: IpFamily,
    table: &str,
    sets: &[&str],
    out: &mut Vec<CountedElement>,
) -> Result<(), NetlinkError> {
    let fam = u16::try_from(nfproto(family)).unwrap_or(2);
    // Elements of one service port share one comment: parsed once per distinct blob.
    let mut comments: HashMap<Vec<u8>, Option<Arc<str>>> = HashMap::new();
    for set in sets {
        let name: Arc<str> = Arc::from(*set);
        let dumped = dump_elements(sock, fam, table, set, |e| {
            let (Some(key), Some((packets, _bytes))) = (e.data(a(sys::NFTNL_SET_ELEM_KEY)), e.counter()) else {
                return;
            };
            let comment = e.data(a(sys::NFTNL_SET_ELEM_USERDATA)).and_then(|u| {
                comments.entry(u).or_insert_with_key(|u| udata::find_comment(u, udata::COMMENT).map(Arc::from)).clone()
            });
            let verdict = e.u32(a(sys::NFTNL_SET_ELEM_VERDICT)).map(|code| code as i32);
            out.push(CountedElement { family, set: Arc::clone(&name), key, comment, verdict, packets });
        });
        absent_is_empty(dumped)?;
    }
    Ok(())
}
