//! Reads rules and set elements back from the kernel with netlink dumps (NLM_F_DUMP), decoded
//! with the encoder's own test decoders: what the kernel holds must equal the IR we sent,
//! down to the expressions `nft` leaves out when it prints a rule (the `meta l4proto tcp`
//! before `reject with tcp reset`).

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
use splitproxy_proto::v1::{Element, Rule, Set};

use crate::nft::batch::HEADER_LEN;
use crate::nft::consts::*;
use crate::nft::nla::{Attrs, NlaBuf};
use crate::nft::set::SetLayout;
use crate::nft::{element, rule};

const NFT_MSG_GETRULE: u8 = 7;

/// Sends one dump request with `attrs` and returns the attributes of every reply message.
fn dump(msg_type: u8, family: u8, attrs: &NlaBuf) -> Vec<Vec<u8>> {
    let mut sock = Socket::new(NETLINK_NETFILTER).unwrap();
    sock.bind_auto().unwrap();
    sock.connect(&SocketAddr::new(0, 0)).unwrap();
    let mut req = vec![0u8; HEADER_LEN];
    req.extend_from_slice(attrs.bytes());
    let len = req.len() as u32;
    req[0..4].copy_from_slice(&len.to_ne_bytes());
    let ty = (NFNL_SUBSYS_NFTABLES << 8) | u16::from(msg_type);
    req[4..6].copy_from_slice(&ty.to_ne_bytes());
    req[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    req[16] = family;
    sock.send(&req, 0).unwrap();

    let mut out = Vec::new();
    let mut buf = Vec::with_capacity(1 << 20);
    loop {
        buf.clear();
        let n = sock.recv(&mut buf, 0).unwrap();
        let mut rest = &buf[..n];
        while rest.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
            let ty = u16::from_ne_bytes([rest[4], rest[5]]);
            match ty {
                NLMSG_DONE => return out,
                NLMSG_ERROR => {
                    let err = i32::from_ne_bytes(rest[16..20].try_into().unwrap());
                    panic!("dump failed: {}", std::io::Error::from_raw_os_error(-err));
                }
                _ => out.push(rest[HEADER_LEN..len].to_vec()),
            }
            rest = &rest[crate::nft::nla::align4(len).min(rest.len())..];
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
