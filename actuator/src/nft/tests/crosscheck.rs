//! Our bytes, read by someone else's decoder: every message of the fixture batch must parse
//! with `netlink-packet-netfilter` into the attributes we meant, with nothing left unknown.

use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::nftables::{
    ChainAttribute, DataAttribute, ExpressionAttribute, Expressions, ListAttribute, Lookup,
    NfTablesMessage, Payload, Register, RuleAttribute, SetAttribute, SetElementAttribute,
    SetElementList, SetFlags, TableAttribute,
};
use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner};

use super::fixture;
use crate::nft::Batch;

fn parse_all(batch: &Batch) -> Vec<NfTablesMessage> {
    batch
        .messages()
        .map(|raw| {
            let msg = NetlinkMessage::<NetfilterMessage>::deserialize(raw)
                .unwrap_or_else(|e| panic!("undecodable message {raw:02x?}: {e}"));
            assert_eq!(msg.header.length as usize, raw.len());
            let NetlinkPayload::InnerMessage(NetfilterMessage {
                inner: NetfilterMessageInner::NfTables(m),
                ..
            }) = msg.payload
            else {
                panic!("not an nf_tables message: {:?}", msg.payload)
            };
            m
        })
        .collect()
}

fn fixture_batch() -> Batch {
    let mut batch = Batch::new();
    fixture::add_table(&mut batch, &fixture::table()).unwrap();
    batch
}

#[test]
fn every_message_decodes_with_netlink_packet_netfilter() {
    let batch = fixture_batch();
    let msgs = parse_all(&batch);
    assert_eq!(msgs.len(), batch.len());

    let NfTablesMessage::NewTable(t) = &msgs[0] else {
        panic!("{:?}", msgs[0])
    };
    assert!(
        t.attributes
            .contains(&TableAttribute::Name("splitproxy".to_owned()))
    );

    let mut sets = 0;
    let mut chains = 0;
    let mut rules = 0;
    let mut elements = 0;
    for m in &msgs {
        match m {
            NfTablesMessage::NewTable(t) => {
                assert!(
                    !t.attributes
                        .iter()
                        .any(|a| matches!(a, TableAttribute::Other(_)))
                );
            }
            NfTablesMessage::NewSet(s) => {
                sets += 1;
                assert!(
                    !s.attributes
                        .iter()
                        .any(|a| matches!(a, SetAttribute::Other(_)))
                );
            }
            NfTablesMessage::NewChain(c) => {
                chains += 1;
                assert!(
                    !c.attributes
                        .iter()
                        .any(|a| matches!(a, ChainAttribute::Other(_)))
                );
            }
            NfTablesMessage::NewRule(r) => {
                rules += 1;
                assert!(
                    !r.attributes
                        .iter()
                        .any(|a| matches!(a, RuleAttribute::Other(_)))
                );
            }
            NfTablesMessage::NewSetElement(e) => {
                elements += 1;
                assert!(
                    !e.attributes
                        .iter()
                        .any(|a| matches!(a, SetElementList::Other(_)))
                );
            }
            other => panic!("unexpected message {other:?}"),
        }
    }
    let t = fixture::table();
    assert_eq!(sets, t.sets.len());
    assert_eq!(chains, t.chains.len());
    assert_eq!(rules, t.chains.iter().map(|c| c.rules.len()).sum::<usize>());
    assert_eq!(
        elements,
        t.sets.iter().filter(|s| !s.elements.is_empty()).count()
    );
}

#[test]
fn service_ips_set_decodes_as_a_concatenated_data_map() {
    let msgs = parse_all(&fixture_batch());
    let attrs = msgs
        .iter()
        .find_map(|m| match m {
            NfTablesMessage::NewSet(s)
                if s.attributes
                    .contains(&SetAttribute::Name("service-ips".to_owned())) =>
            {
                Some(s.attributes.clone())
            }
            _ => None,
        })
        .unwrap();
    assert!(attrs.contains(&SetAttribute::KeyLen(12)));
    assert!(attrs.contains(&SetAttribute::KeyType((7 << 12) | (12 << 6) | 13)));
    assert!(attrs.contains(&SetAttribute::DataType(4)));
    assert!(attrs.contains(&SetAttribute::DataLen(4)));
    assert!(
        attrs
            .iter()
            .any(|a| matches!(a, SetAttribute::Flags(f) if f.contains(SetFlags::Map)))
    );
    assert!(
        attrs
            .iter()
            .any(|a| matches!(a, SetAttribute::Description(_)))
    );
}

#[test]
fn services_rule_expressions_decode() {
    let mut batch = Batch::new();
    batch
        .add_rule(
            splitproxy_proto::v1::Family::Ip,
            "splitproxy",
            "services",
            &fixture::services_rule(),
        )
        .unwrap();
    let msgs = parse_all(&batch);
    let NfTablesMessage::NewRule(r) = &msgs[0] else {
        panic!()
    };
    let exprs = r
        .attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Expressions(e) => Some(e),
            _ => None,
        })
        .unwrap();
    let data: Vec<&Expressions> = exprs
        .iter()
        .map(|e| match e {
            ListAttribute::Element(attrs) => attrs
                .iter()
                .find_map(|a| match a {
                    ExpressionAttribute::Data(d) => Some(d),
                    _ => None,
                })
                .unwrap(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(data.len(), 5);
    let Expressions::Payload(p) = data[0] else {
        panic!("{:?}", data[0])
    };
    assert_eq!(
        p,
        &vec![
            Payload::DestinationRegister(Register::Reg32_00),
            Payload::Base(1),
            Payload::Offset(16),
            Payload::Len(4),
        ]
    );
    assert!(matches!(data[1], Expressions::Meta(_)));
    let Expressions::Lookup(map) = data[3] else {
        panic!("{:?}", data[3])
    };
    assert_eq!(
        map,
        &vec![
            Lookup::Set("service-ips".to_owned()),
            Lookup::SourceRegister(Register::Reg32_00),
            Lookup::DestinationRegister(Register::Reg32_03),
        ]
    );
    let Expressions::Lookup(vmap) = data[4] else {
        panic!()
    };
    assert!(vmap.contains(&Lookup::DestinationRegister(Register::Verdict)));
}

#[test]
fn verdict_map_elements_decode_with_their_goto() {
    let msgs = parse_all(&fixture_batch());
    let lists: Vec<&Vec<SetElementList>> = msgs
        .iter()
        .filter_map(|m| match m {
            NfTablesMessage::NewSetElement(e) => Some(&e.attributes),
            _ => None,
        })
        .collect();
    let dispatch = lists
        .iter()
        .find(|l| l.contains(&SetElementList::Set("service-dispatch".to_owned())))
        .unwrap();
    let elems = dispatch
        .iter()
        .find_map(|a| match a {
            SetElementList::Elements(e) => Some(e),
            _ => None,
        })
        .unwrap();
    assert_eq!(elems.len(), 2);
    let ListAttribute::Element(first) = &elems[0] else {
        panic!()
    };
    assert!(
        first.contains(&SetElementAttribute::Key(DataAttribute::Value(
            1u32.to_ne_bytes().to_vec()
        )))
    );
    let verdict = first
        .iter()
        .find_map(|a| match a {
            SetElementAttribute::Data(DataAttribute::Verdict(v)) => Some(v),
            _ => None,
        })
        .unwrap();
    assert!(format!("{verdict:?}").contains("endpoints-1"));
}
