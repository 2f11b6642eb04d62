//! The ruleset generation: a number the kernel increments with every transaction it commits in
//! the network namespace (any table's), read with `GETGEN`. A batch can carry the generation it
//! expects (`NFNL_BATCH_GENID` in its BEGIN message): the kernel then refuses it whole with
//! `ERESTART`, applying nothing, when another transaction committed since. So a process that
//! knows the generation its own last commit produced can tell, at the cost of one round trip,
//! that nobody changed anything since, and its next transaction cannot silently overwrite a
//! change it has not seen.

use super::error::NetlinkError;
use super::socket::Socket;

/// `NFNL_SUBSYS_NFTABLES`
const SUBSYS_NFTABLES: u16 = 10;
/// `NFT_MSG_GETGEN`
const MSG_GETGEN: u16 = 16;
/// `NFT_MSG_NEWGEN`
const MSG_NEWGEN: u16 = 15;
/// `NFTA_GEN_ID`
const GEN_ID: u16 = 1;
/// `NFNL_BATCH_GENID`
const BATCH_GENID: u16 = 1;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;

/// The kernel's `ERESTART`: the batch expected another generation.
pub(super) const ERESTART: i32 = 85;

/// The current generation.
pub(super) fn read(socket: &mut Socket) -> Result<u32, NetlinkError> {
    let seq = socket.next_seq();
    let mut req = Vec::with_capacity(NLMSG_HDRLEN + NFGENMSG_LEN);
    req.extend_from_slice(&((NLMSG_HDRLEN + NFGENMSG_LEN) as u32).to_ne_bytes());
    req.extend_from_slice(&((SUBSYS_NFTABLES << 8) | MSG_GETGEN).to_ne_bytes());
    req.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    req.extend_from_slice(&seq.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    // nfgenmsg: AF_UNSPEC, NFNETLINK_V0, res_id 0.
    req.extend_from_slice(&[0, 0, 0, 0]);
    let mut found = None;
    socket.exchange(&req, seq, |msg| {
        let kind = u16::from_ne_bytes([msg[4], msg[5]]);
        if kind == (SUBSYS_NFTABLES << 8) | MSG_NEWGEN {
            found =
                attribute(msg, GEN_ID).and_then(|v| v.get(..4)).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        }
        Ok(())
    })?;
    found.ok_or(NetlinkError::Malformed("GETGEN answered without a generation"))
}

/// The value of attribute `kind` of an nfnetlink message (after its header and nfgenmsg).
fn attribute(msg: &[u8], kind: u16) -> Option<&[u8]> {
    let mut off = NLMSG_HDRLEN + NFGENMSG_LEN;
    while off + 4 <= msg.len() {
        let len = usize::from(u16::from_ne_bytes([msg[off], msg[off + 1]]));
        let ty = u16::from_ne_bytes([msg[off + 2], msg[off + 3]]) & 0x3fff;
        if len < 4 || off + len > msg.len() {
            return None;
        }
        if ty == kind {
            return msg.get(off + 4..off + len);
        }
        off += len.div_ceil(4) * 4;
    }
    None
}

/// A copy of a batch's BEGIN message (`begin`: the whole message, as the batch holds it) that
/// also carries the generation the batch expects.
pub(super) fn begin_expecting(begin: &[u8], genid: u32) -> Vec<u8> {
    let mut out = begin.to_vec();
    out.extend_from_slice(&8u16.to_ne_bytes());
    out.extend_from_slice(&BATCH_GENID.to_ne_bytes());
    out.extend_from_slice(&genid.to_be_bytes());
    let len = u32::try_from(out.len()).unwrap_or(u32::MAX);
    out[..4].copy_from_slice(&len.to_ne_bytes());
    out
}

/// The generation after `genid` (the kernel skips 0, which means "no generation").
pub(crate) fn next(genid: u32) -> u32 {
    match genid.wrapping_add(1) {
        0 => 1,
        n => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_begin_message_grows_by_one_attribute() {
        let mut begin = vec![0u8; 20];
        begin[..4].copy_from_slice(&20u32.to_ne_bytes());
        begin[4..6].copy_from_slice(&0x10u16.to_ne_bytes());
        let out = begin_expecting(&begin, 0x0102_0304);
        assert_eq!(u32::from_ne_bytes([out[0], out[1], out[2], out[3]]), 28);
        assert_eq!(&out[4..20], &begin[4..20]);
        assert_eq!(attribute(&out, BATCH_GENID), Some(&[1u8, 2, 3, 4][..]));
        assert_eq!(next(u32::MAX), 1);
        assert_eq!(next(7), 8);
    }
}
