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
fn service_endpoints_map_decodes_as_a_concatenated_data_map() {
    let msgs = parse_all(&fixture_batch());
    let attrs = msgs
        .iter()
        .find_map(|m| match m {
            NfTablesMessage::NewSet(s)
                if s.attributes
                    .contains(&SetAttribute::Name("service-endpoints".to_owned())) =>
            {
                Some(s.attributes.clone())
            }
            _ => None,
        })
        .unwrap();
    // ipv4_addr . inet_proto . inet_service . mark (the slot), each field in 4 bytes.
    assert!(attrs.contains(&SetAttribute::KeyLen(16)));
    assert!(attrs.contains(&SetAttribute::KeyType(
        (7 << 18) | (12 << 12) | (13 << 6) | 19
    )));
    // : ipv4_addr . inet_service
    assert!(attrs.contains(&SetAttribute::DataType((7 << 6) | 13)));
    assert!(attrs.contains(&SetAttribute::DataLen(8)));
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
fn service_ports_set_decodes_as_a_concatenated_set() {
    let msgs = parse_all(&fixture_batch());
    let attrs = msgs
        .iter()
        .find_map(|m| match m {
            NfTablesMessage::NewSet(s)
                if s.attributes
                    .contains(&SetAttribute::Name("service-ports-2".to_owned())) =>
            {
                Some(s.attributes.clone())
            }
            _ => None,
        })
        .unwrap();
    assert!(attrs.contains(&SetAttribute::KeyLen(12)));
    assert!(attrs.contains(&SetAttribute::KeyType((7 << 12) | (12 << 6) | 13)));
    assert!(
        !attrs
            .iter()
            .any(|a| matches!(a, SetAttribute::DataType(_) | SetAttribute::DataLen(_)))
    );
    assert!(
        !attrs
            .iter()
            .any(|a| matches!(a, SetAttribute::Flags(f) if f.contains(SetFlags::Map)))
    );
}

/// The expressions of the one rule in `batch`, in order.
fn rule_expressions(batch: &Batch) -> Vec<(String, Expressions)> {
    let msgs = parse_all(batch);
    let NfTablesMessage::NewRule(r) = &msgs[0] else {
        panic!("{:?}", msgs[0])
    };
    let exprs = r
        .attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Expressions(e) => Some(e),
            _ => None,
        })
        .unwrap();
    exprs
        .iter()
        .map(|e| match e {
            ListAttribute::Element(attrs) => (
                attrs
                    .iter()
                    .find_map(|a| match a {
                        ExpressionAttribute::Name(n) => Some(n.clone()),
                        _ => None,
                    })
                    .unwrap(),
                attrs
                    .iter()
                    .find_map(|a| match a {
                        ExpressionAttribute::Data(d) => Some(d.clone()),
                        _ => None,
                    })
                    .unwrap(),
            ),
            other => panic!("{other:?}"),
        })
        .collect()
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
    let exprs = rule_expressions(&batch);
    let names: Vec<&str> = exprs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "payload", "meta", "payload", "lookup", "numgen", "lookup", "nat"
        ]
    );
    let data: Vec<&Expressions> = exprs.iter().map(|(_, d)| d).collect();
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
    // `@service-ports-2`: a plain set match on the key in registers 0-2, no result.
    let Expressions::Lookup(set) = data[3] else {
        panic!("{:?}", data[3])
    };
    assert_eq!(
        set,
        &vec![
            Lookup::Set("service-ports-2".to_owned()),
            Lookup::SourceRegister(Register::Reg32_00),
        ]
    );
    // No decoder for numgen and nat in netlink-packet-netfilter: they stay raw, but named.
    assert!(
        matches!(data[4], Expressions::Other { expression_type, .. } if expression_type == "numgen"),
        "{:?}",
        data[4]
    );
    // `map @service-endpoints`: key . slot in registers 0-3, endpoint into registers 0-1.
    let Expressions::Lookup(map) = data[5] else {
        panic!("{:?}", data[5])
    };
    assert_eq!(
        map,
        &vec![
            Lookup::Set("service-endpoints".to_owned()),
            Lookup::SourceRegister(Register::Reg32_00),
            Lookup::DestinationRegister(Register::Reg32_00),
        ]
    );
    assert!(
        !exprs
            .iter()
            .any(|(_, d)| matches!(d, Expressions::Lookup(l) if l.contains(&Lookup::DestinationRegister(Register::Verdict)))),
        "no verdict map in the services rule"
    );
}

#[test]
fn verdict_map_elements_decode_with_their_verdicts() {
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
        .find(|l| l.contains(&SetElementList::Set("nodeport-dispatch".to_owned())))
        .unwrap();
    let elems = dispatch
        .iter()
        .find_map(|a| match a {
            SetElementList::Elements(e) => Some(e),
            _ => None,
        })
        .unwrap();
    assert_eq!(elems.len(), 2);
    let verdict_of = |i: usize| {
        let ListAttribute::Element(attrs) = &elems[i] else {
            panic!()
        };
        let key = attrs
            .iter()
            .find_map(|a| match a {
                SetElementAttribute::Key(DataAttribute::Value(k)) => Some(k.clone()),
                _ => None,
            })
            .unwrap();
        let verdict = attrs
            .iter()
            .find_map(|a| match a {
                SetElementAttribute::Data(DataAttribute::Verdict(v)) => Some(format!("{v:?}")),
                _ => None,
            })
            .unwrap();
        (key, verdict)
    };
    // tcp . 30443 : goto services, each field padded to 4 bytes.
    let (key, verdict) = verdict_of(0);
    assert_eq!(key, [6, 0, 0, 0, 0x76, 0xeb, 0, 0]);
    assert!(
        verdict.contains("Code(Goto)") && verdict.contains("Chain(\"services\")"),
        "{verdict}"
    );
    // udp . 30053 : drop (NF_DROP is 0, which the decoder has no name for)
    let (key, verdict) = verdict_of(1);
    assert_eq!(key, [17, 0, 0, 0, 0x75, 0x65, 0, 0]);
    assert!(
        verdict.contains("Code(Other(0))") && !verdict.contains("Chain("),
        "{verdict}"
    );
}
