//! Set element messages both ways, without libnftnl: the list a `NEWSETELEM`/`DELSETELEM`
//! carries, written straight into one buffer, and the elements of a `GETSETELEM` dump, read
//! straight from the messages. A cold sync writes and a restart reads hundreds of thousands of
//! elements; one libnftnl object per element costs a few allocations each way. The layout is
//! libnftnl's (tests compare the bytes and the parse with it).

use crate::nft::wire::consts;
use crate::nft::wire::{WireData, WireElement, WireKey};

/// The attributes of a `NEWSETELEM`/`DELSETELEM` message, as libnftnl would write them for a set
/// object holding these elements (table, set, the set's id in this batch, then the list; each
/// element nested under its place in the list): written straight into one buffer, as one
/// libnftnl object per element costs a few allocations each.
pub(super) fn element_list<'a>(
    table: &str,
    set: &str,
    set_id: Option<u32>,
    elements: impl Iterator<Item = (&'a WireKey, Option<&'a WireElement>)>,
) -> Vec<u8> {
    use attr::*;
    let mut out = Attributes::default();
    out.strz(LIST_SET, set);
    if let Some(id) = set_id {
        out.u32_be(LIST_SET_ID, id);
    }
    out.strz(LIST_TABLE, table);
    let list = out.nest_start(LIST_ELEMENTS);
    for (i, (key, element)) in elements.enumerate() {
        let nest = out.nest_start(u16::try_from(i + 1).unwrap_or(u16::MAX));
        if key.interval_end {
            out.u32_be(ELEM_FLAGS, consts::ELEM_INTERVAL_END);
        }
        let k = out.nest_start(ELEM_KEY);
        out.bytes(DATA_VALUE, &key.bytes);
        out.nest_end(k);
        if let Some(element) = element {
            match &element.data {
                WireData::None => {}
                WireData::Verdict { code, chain } => {
                    let data = out.nest_start(ELEM_DATA);
                    let verdict = out.nest_start(DATA_VERDICT);
                    out.u32_be(VERDICT_CODE, *code as u32);
                    if let Some(c) = chain {
                        out.strz(VERDICT_CHAIN, c);
                    }
                    out.nest_end(verdict);
                    out.nest_end(data);
                }
                WireData::Bytes(b) => {
                    let data = out.nest_start(ELEM_DATA);
                    out.bytes(DATA_VALUE, b);
                    out.nest_end(data);
                }
            }
            if let Some(ud) = &element.userdata {
                out.bytes(ELEM_USERDATA, ud);
            }
        }
        out.nest_end(nest);
    }
    out.nest_end(list);
    out.0
}

/// The nf_tables attribute numbers the element encoder writes (`linux/netfilter/nf_tables.h`).
mod attr {
    pub(super) const LIST_TABLE: u16 = 1;
    pub(super) const LIST_SET: u16 = 2;
    pub(super) const LIST_ELEMENTS: u16 = 3;
    pub(super) const LIST_SET_ID: u16 = 4;
    pub(super) const ELEM_KEY: u16 = 1;
    pub(super) const ELEM_DATA: u16 = 2;
    pub(super) const ELEM_FLAGS: u16 = 3;
    pub(super) const ELEM_USERDATA: u16 = 6;
    pub(super) const DATA_VALUE: u16 = 1;
    pub(super) const DATA_VERDICT: u16 = 2;
    pub(super) const VERDICT_CODE: u16 = 1;
    pub(super) const VERDICT_CHAIN: u16 = 2;
}

/// Netlink attributes being written: each a length, a type and its value, padded to 4 bytes.
#[derive(Default)]
struct Attributes(Vec<u8>);

impl Attributes {
    /// `NLA_F_NESTED`, as libmnl sets it on every nest.
    const NESTED: u16 = 0x8000;

    fn header(&mut self, kind: u16, len: usize) {
        let len = u16::try_from(4 + len).unwrap_or(u16::MAX);
        self.0.extend_from_slice(&len.to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
    }

    fn pad(&mut self) {
        self.0.resize(self.0.len().div_ceil(4) * 4, 0);
    }

    fn bytes(&mut self, kind: u16, value: &[u8]) {
        self.header(kind, value.len());
        self.0.extend_from_slice(value);
        self.pad();
    }

    fn strz(&mut self, kind: u16, value: &str) {
        self.header(kind, value.len() + 1);
        self.0.extend_from_slice(value.as_bytes());
        self.0.push(0);
        self.pad();
    }

    fn u32_be(&mut self, kind: u16, value: u32) {
        self.bytes(kind, &value.to_be_bytes());
    }

    /// Starts a nest; [`Attributes::nest_end`] writes its length.
    fn nest_start(&mut self, kind: u16) -> usize {
        let at = self.0.len();
        self.header(kind | Self::NESTED, 0);
        at
    }

    fn nest_end(&mut self, at: usize) {
        let len = u16::try_from(self.0.len() - at).unwrap_or(u16::MAX);
        self.0[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }
}

/// One element of a dump, borrowing the message's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct DumpedElement<'a> {
    pub key: &'a [u8],
    pub flags: u32,
    pub data: Option<&'a [u8]>,
    pub verdict: Option<(i32, Option<&'a str>)>,
    pub userdata: Option<&'a [u8]>,
}

/// Calls `each` with every element of one `NEWSETELEM` message of a dump (its netlink header
/// and `nfgenmsg` included). Malformed attributes end the walk of their nest.
pub(super) fn each_dumped_element<'a>(message: &'a [u8], mut each: impl FnMut(DumpedElement<'a>)) {
    const HEADERS: usize = 16 + 4;
    let Some(body) = message.get(HEADERS..) else { return };
    for (kind, list) in attributes(body) {
        if kind != attr::LIST_ELEMENTS {
            continue;
        }
        for (_, element) in attributes(list) {
            let mut out = DumpedElement { key: &[], flags: 0, data: None, verdict: None, userdata: None };
            for (kind, value) in attributes(element) {
                match kind {
                    attr::ELEM_KEY => out.key = data_value(value).unwrap_or_default(),
                    attr::ELEM_FLAGS => out.flags = be32(value).unwrap_or(0),
                    attr::ELEM_USERDATA => out.userdata = Some(value),
                    attr::ELEM_DATA => {
                        for (kind, value) in attributes(value) {
                            match kind {
                                attr::DATA_VALUE => out.data = Some(value),
                                attr::DATA_VERDICT => {
                                    let (mut code, mut chain) = (None, None);
                                    for (kind, value) in attributes(value) {
                                        match kind {
                                            attr::VERDICT_CODE => code = be32(value).map(|c| c as i32),
                                            attr::VERDICT_CHAIN => chain = strz(value),
                                            _ => {}
                                        }
                                    }
                                    out.verdict = code.map(|c| (c, chain));
                                }
                                _ => {}
                            }
                        }
                    }
                    _ => {}
                }
            }
            each(out);
        }
    }
}

/// The attributes in `bytes`: type (without its flags) and value, each padded to 4 bytes.
fn attributes(bytes: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        let header = rest.get(..4)?;
        let len = usize::from(u16::from_ne_bytes([header[0], header[1]]));
        let kind = u16::from_ne_bytes([header[2], header[3]]) & 0x3fff;
        let value = rest.get(4..len)?;
        rest = rest.get(len.div_ceil(4) * 4..).unwrap_or_default();
        Some((kind, value))
    })
}

/// The `NFTA_DATA_VALUE` of a data nest.
fn data_value(nest: &[u8]) -> Option<&[u8]> {
    attributes(nest).find(|(kind, _)| *kind == attr::DATA_VALUE).map(|(_, v)| v)
}

fn be32(value: &[u8]) -> Option<u32> {
    value.first_chunk::<4>().map(|b| u32::from_be_bytes(*b))
}

/// A NUL-terminated string attribute.
fn strz(value: &[u8]) -> Option<&str> {
    std::str::from_utf8(value.split(|b| *b == 0).next()?).ok()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::netlink::sys::{self as raw, Body, Received, msg};
    use crate::nft::ast::Owner;
    use crate::nft::wire::udata;
    use nftnl_sys as sys;

    /// The list as the kernel dumps it: every element nested as `NFTA_LIST_ELEM` (libnftnl
    /// numbers them when it writes, and accepts only that when it reads).
    fn as_dumped(attributes: &mut [u8]) {
        let mut at = 0;
        while at + 4 <= attributes.len() {
            let len = usize::from(u16::from_ne_bytes([attributes[at], attributes[at + 1]]));
            let kind = u16::from_ne_bytes([attributes[at + 2], attributes[at + 3]]) & 0x3fff;
            if kind == attr::LIST_ELEMENTS {
                let mut inner = at + 4;
                while inner + 4 <= at + len {
                    let l = usize::from(u16::from_ne_bytes([attributes[inner], attributes[inner + 1]]));
                    attributes[inner + 2..inner + 4].copy_from_slice(&(1u16 | 0x8000).to_ne_bytes());
                    inner += l.div_ceil(4) * 4;
                }
            }
            at += len.div_ceil(4) * 4;
        }
    }

    fn a(attr: u32) -> u16 {
        u16::try_from(attr).unwrap_or(u16::MAX)
    }

    /// What the encoder writes, the parser reads back as libnftnl parses it: keys, flags,
    /// values, verdicts with and without a chain, comments.
    #[test]
    fn dumped_elements_read_as_libnftnl_reads_them() {
        let comment: Arc<[u8]> = Arc::from(udata::comment("ns/svc:p80"));
        let element = |data: WireData, userdata: Option<Arc<[u8]>>| WireElement {
            data,
            userdata,
            owner: Owner::infrastructure(),
        };
        let key = |bytes: &[u8], interval_end: bool| WireKey { bytes: bytes.iter().copied().collect(), interval_end };
        let items: Vec<(WireKey, WireElement)> = vec![
            (key(&[10, 96, 0, 1], false), element(WireData::None, None)),
            (
                key(&[10, 96, 0, 2, 17, 0, 0, 0, 0, 53, 0, 0, 3, 0, 0, 0], false),
                element(
                    WireData::Bytes([10, 128, 0, 7, 0x1f, 0x90, 0, 0].into_iter().collect()),
                    Some(comment.clone()),
                ),
            ),
            (
                key(&[1, 2, 3, 4], false),
                element(WireData::Verdict { code: -4, chain: Some("firewall-X".into()) }, None),
            ),
            (key(&[0, 0, 0, 0], false), element(WireData::Verdict { code: 0, chain: None }, Some(comment))),
            (key(&[0, 16, 0, 0], true), element(WireData::None, None)),
        ];
        let mut attributes = element_list("nftproxy", "s", None, items.iter().map(|(k, e)| (k, Some(e))));
        as_dumped(&mut attributes);
        let bytes = raw::request(msg::NEWSETELEM, 2, 0, 1, Body::Attributes(&attributes));
        let mut ours = Vec::new();
        each_dumped_element(&bytes, |e| {
            ours.push((
                e.key.to_vec(),
                e.flags,
                e.data.map(<[u8]>::to_vec),
                e.verdict.map(|(c, ch)| (c, ch.map(str::to_string))),
                e.userdata.map(<[u8]>::to_vec),
            ));
        });
        let mut theirs = Vec::new();
        raw::each_message(&bytes, |_, message: Received<'_>| {
            let Some(set) = message.set_elements() else { return };
            set.for_each_elem(|e| {
                let verdict =
                    e.u32(a(sys::NFTNL_SET_ELEM_VERDICT)).map(|c| (c as i32, e.str(a(sys::NFTNL_SET_ELEM_CHAIN))));
                theirs.push((
                    e.data(a(sys::NFTNL_SET_ELEM_KEY)).unwrap_or_default(),
                    e.u32(a(sys::NFTNL_SET_ELEM_FLAGS)).unwrap_or(0),
                    e.data(a(sys::NFTNL_SET_ELEM_DATA)),
                    verdict,
                    e.data(a(sys::NFTNL_SET_ELEM_USERDATA)),
                ));
            });
        });
        assert_eq!(ours.len(), items.len());
        assert_eq!(ours, theirs);
        assert_eq!(ours[1].2.as_deref(), Some(&[10, 128, 0, 7, 0x1f, 0x90, 0, 0][..]));
        assert_eq!(ours[2].3, Some((-4, Some("firewall-X".to_string()))));
        assert_eq!(ours[4].1, consts::ELEM_INTERVAL_END);
    }
}
