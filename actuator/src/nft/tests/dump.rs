//! Reads rules and set elements back from the kernel with netlink dumps (NLM_F_DUMP), decoded
//! with the encoder's own test decoders: what the kernel holds must equal the IR we sent,
//! down to the expressions `nft` leaves out when it prints a rule (the `meta l4proto tcp`
//! before `reject with tcp reset`).

use splitproxy_proto::v1::{Element, Rule, Set};

use crate::netlink::attr::{Attrs, NlaBuf};
use crate::netlink::message::{Messages, nfnl_header};
use crate::nft::batch::HEADER_LEN;
use crate::nft::consts::*;
use crate::nft::set::SetLayout;
use crate::nft::{element, rule};

/// Sends one dump request with `attrs` and returns the attributes of every reply message.
fn dump(msg_type: u8, family: u8, attrs: &NlaBuf) -> Vec<Vec<u8>> {
    let sock = crate::netlink::open(std::time::Duration::from_secs(5), false).unwrap();
    let mut req = nfnl_header(
        (NFNL_SUBSYS_NFTABLES << 8) | u16::from(msg_type),
        NLM_F_REQUEST | NLM_F_DUMP,
        1,
        family,
        0,
        HEADER_LEN + attrs.len(),
    )
    .to_vec();
    req.extend_from_slice(attrs.bytes());
    sock.send(&req, 0).unwrap();

    let mut out = Vec::new();
    let mut buf = Vec::with_capacity(1 << 20);
    loop {
        buf.clear();
        let n = sock.recv(&mut buf, 0).unwrap();
        for msg in Messages::new(&buf[..n]) {
            let msg = msg.unwrap();
            if let Some(errno) = msg.done().or_else(|| msg.ack().map(|a| a.errno)) {
                assert_eq!(
                    errno,
                    0,
                    "dump failed: {}",
                    std::io::Error::from_raw_os_error(errno)
                );
                return out;
            }
            out.push(msg.nfnl_attrs().unwrap().to_vec());
        }
    }
}

/// The rules of `chain`, in order, as IR.
pub(crate) fn rules(family: u8, table: &str, chain: &str) -> Vec<Rule> {
    let mut attrs = NlaBuf::new();
    attrs.put_strz(NFTA_RULE_TABLE, table);
    attrs.put_strz(NFTA_RULE_CHAIN, chain);
    dump(NFT_MSG_GETRULE, family, &attrs)
        .iter()
        .map(|m| rule::tests::decode(&Attrs::new(m)))
        .filter(|(t, c, _)| t == table && c == chain)
        .map(|(_, _, r)| r)
        .collect()
}

/// The elements of `set` (whose definition gives the layout), as IR.
pub(crate) fn elements(family: u8, table: &str, set: &Set) -> Vec<Element> {
    let layout = SetLayout::new(set).unwrap();
    let mut attrs = NlaBuf::new();
    attrs.put_strz(NFTA_SET_ELEM_LIST_TABLE, table);
    attrs.put_strz(NFTA_SET_ELEM_LIST_SET, &set.name);
    dump(NFT_MSG_GETSETELEM, family, &attrs)
        .iter()
        .flat_map(|m| {
            Attrs::new(m)
                .find(NFTA_SET_ELEM_LIST_ELEMENTS)
                .map(|list| element::tests::decode(&layout, &list))
                .unwrap_or_default()
        })
        .collect()
}
