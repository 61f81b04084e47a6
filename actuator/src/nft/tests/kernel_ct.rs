//! `ct` tuple fields against the kernel: a rule that loads `ct original ip saddr . ct original
//! ip daddr . ct original protocol . ct original proto-dst` into four registers and looks the
//! concatenation up in a set must be accepted, read back identically, be listed by `nft` the
//! way our renderer prints it, and match real traffic (which proves the register layout: the
//! protocol byte and the port padded to whole registers, as set keys are).
//!
//! One kernel fact shows here: `ct protocol` takes a direction but keeps none (the l4 protocol
//! is the same in both tuples), so it dumps and lists without one.

use serde_json::{Value, json};
use splitproxy_proto::v1::datum::Value as DatumValue;
use splitproxy_proto::v1::{
    BaseChain, Chain, ChainType, CmpOp, Counter, Ct, CtDirection, CtKey, DataType, Datum, Element,
    Expr, Family, Hook, Rule, Set, Table, expr::Kind,
};

use super::fixture::{TCP, UDP, add_table, cmp, lookup};
use super::{dump, netns};
use crate::nft::consts::{NFPROTO_IPV4, NFPROTO_IPV6};
use crate::nft::datum::tests::{ip4, port, proto};
use crate::nft::{Batch, NftSocket};

const TABLE: &str = "ct-test";
const PORT: u16 = 5353;

fn e(kind: Kind) -> Expr {
    Expr { kind: Some(kind) }
}

fn ct(key: CtKey, dir: CtDirection, dreg: u32) -> Expr {
    e(Kind::Ct(Ct {
        key: key as i32,
        dreg,
        direction: dir as i32,
    }))
}

fn counter() -> Expr {
    e(Kind::Counter(Counter {}))
}

fn rule(exprs: Vec<Expr>) -> Rule {
    Rule {
        exprs,
        comment: String::new(),
    }
}

fn set(name: &str, key: &[DataType], elements: Vec<Vec<Datum>>) -> Set {
    Set {
        name: name.to_owned(),
        key: key.iter().map(|t| *t as i32).collect(),
        elements: elements
            .into_iter()
            .map(|key| Element {
                key,
                ..Element::default()
            })
            .collect(),
        ..Set::default()
    }
}

fn ip6(a: std::net::Ipv6Addr) -> Datum {
    Datum {
        value: Some(DatumValue::Ipv6(a.octets().to_vec())),
    }
}

fn output_chain(rules: Vec<Rule>) -> Chain {
    Chain {
        name: "output".to_owned(),
        base: Some(BaseChain {
            hook: Hook::Output as i32,
            r#type: ChainType::Filter as i32,
            priority: 0,
            policy_drop: false,
        }),
        comment: String::new(),
        rules,
    }
}

/// `ct original ip saddr . ct original ip daddr . ct original protocol . ct original proto-dst
/// @SET counter`.
fn four_tuple_rule(set: &str) -> Rule {
    use CtDirection::Original;
    rule(vec![
        ct(CtKey::SrcIp, Original, 0),
        ct(CtKey::DstIp, Original, 1),
        ct(CtKey::Protocol, Original, 2),
        ct(CtKey::ProtoDst, Original, 3),
        e(Kind::Lookup(lookup(set, 0))),
        counter(),
    ])
}

fn ip_table() -> Table {
    use DataType::*;
    let lo = [127, 0, 0, 1];
    let key4 = [Ipv4Addr, Ipv4Addr, InetProto, InetService];
    Table {
        family: Family::Ip as i32,
        name: TABLE.to_owned(),
        comment: String::new(),
        sets: vec![
            set(
                "flows",
                &key4,
                vec![vec![ip4(lo), ip4(lo), proto(UDP), port(PORT.into())]],
            ),
            // Same flow but TCP: must not match the UDP packet.
            set(
                "tcp-flows",
                &key4,
                vec![vec![ip4(lo), ip4(lo), proto(TCP), port(PORT.into())]],
            ),
            set(
                "replies",
                &[Ipv4Addr, InetService],
                vec![vec![ip4(lo), port(PORT.into())]],
            ),
        ],
        chains: vec![output_chain(vec![
            four_tuple_rule("flows"),
            four_tuple_rule("tcp-flows"),
            // `ct reply ip saddr . ct reply proto-src @replies counter`
            rule(vec![
                ct(CtKey::SrcIp, CtDirection::Reply, 0),
                ct(CtKey::ProtoSrc, CtDirection::Reply, 1),
                e(Kind::Lookup(lookup("replies", 0))),
                counter(),
            ]),
            // `ct original protocol udp ct original proto-dst 5353 counter`
            rule(vec![
                ct(CtKey::Protocol, CtDirection::Original, 0),
                cmp(CmpOp::Eq, 0, &[UDP as u8]),
                ct(CtKey::ProtoDst, CtDirection::Original, 1),
                cmp(CmpOp::Eq, 1, &PORT.to_be_bytes()),
                counter(),
            ]),
        ])],
    }
}

/// `ct original ip6 daddr . ct original proto-dst @flows6 counter`.
fn ip6_table() -> Table {
    Table {
        family: Family::Ip6 as i32,
        name: TABLE.to_owned(),
        comment: String::new(),
        sets: vec![set(
            "flows6",
            &[DataType::Ipv6Addr, DataType::InetService],
            vec![vec![ip6(std::net::Ipv6Addr::LOCALHOST), port(PORT.into())]],
        )],
        chains: vec![output_chain(vec![rule(vec![
            ct(CtKey::DstIp6, CtDirection::Original, 0),
            ct(CtKey::ProtoDst, CtDirection::Original, 4),
            e(Kind::Lookup(lookup("flows6", 0))),
            counter(),
        ])])],
    }
}

/// `rules` as a dump reads them back: the kernel keeps no direction for the protocol, which
/// the decoder reads as original (expr/ct.rs).
fn without_protocol_direction(rules: &[Rule]) -> Vec<Rule> {
    let mut rules = rules.to_vec();
    for x in rules.iter_mut().flat_map(|r| r.exprs.iter_mut()) {
        if let Some(Kind::Ct(c)) = &mut x.kind
            && c.key == CtKey::Protocol as i32
        {
            c.direction = CtDirection::Original as i32;
        }
    }
    rules
}

/// Packets counted by each rule of `chain`, in order.
fn counters(rs: &Value, family: &str, chain: &str) -> Vec<u64> {
    rs["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("rule"))
        .filter(|r| r["family"] == family && r["table"] == TABLE && r["chain"] == chain)
        .map(|r| {
            r["expr"]
                .as_array()
                .unwrap()
                .iter()
                .find_map(|x| x["counter"]["packets"].as_u64())
                .unwrap()
        })
        .collect()
}

fn rule_exprs(rs: &Value, family: &str, index: usize) -> Value {
    rs["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("rule"))
        .filter(|r| r["family"] == family && r["table"] == TABLE)
        .nth(index)
        .unwrap()["expr"]
        .clone()
}

#[test]
fn kernel_ct_tuple_fields_load_and_match() {
    netns::run("kernel_ct_tuple_fields_load_and_match", |ns| {
        ns.run("ip", &["link", "set", "lo", "up"]);
        let (t4, t6) = (ip_table(), ip6_table());
        let mut sock = NftSocket::open().unwrap();
        let mut batch = Batch::new();
        add_table(&mut batch, &t4).unwrap();
        add_table(&mut batch, &t6).unwrap();
        sock.commit(&mut batch).unwrap();

        // What the kernel holds is what we sent, direction included.
        // The kernel keeps no direction for `ct protocol` (the same in both tuples): it
        // accepts one, as nft sends it for `ct original protocol`, and dumps none.
        assert_eq!(
            dump::rules(NFPROTO_IPV4, TABLE, "output"),
            without_protocol_direction(&t4.chains[0].rules)
        );
        assert_eq!(
            dump::rules(NFPROTO_IPV6, TABLE, "output"),
            t6.chains[0].rules
        );

        // nft's reading of the rules.
        let rs = ns.ruleset();
        let ct_json = |key: &str, dir: &str| json!({"ct": {"key": key, "dir": dir}});
        assert_eq!(
            rule_exprs(&rs, "ip", 0)[0]["match"],
            json!({
                "op": "==",
                "left": {"concat": [
                    ct_json("ip saddr", "original"),
                    ct_json("ip daddr", "original"),
                    json!({"ct": {"key": "protocol"}}),
                    ct_json("proto-dst", "original"),
                ]},
                "right": "@flows",
            })
        );
        assert_eq!(
            rule_exprs(&rs, "ip", 2)[0]["match"]["left"],
            json!({"concat": [ct_json("ip saddr", "reply"), ct_json("proto-src", "reply")]})
        );
        assert_eq!(
            rule_exprs(&rs, "ip6", 0)[0]["match"]["left"],
            json!({"concat": [ct_json("ip6 daddr", "original"), ct_json("proto-dst", "original")]})
        );
        // ... and the renderer's: every rendered line is how nft lists the rule (nft adds the
        // counter's values).
        for (family, t) in [("ip", &t4), ("ip6", &t6)] {
            let ctx = splitproxy_proto::render::Context::of(t);
            let listed = ns.nft(&["list", "chain", family, TABLE, "output"]);
            for r in &t.chains[0].rules {
                let line = splitproxy_proto::render::rule_in(&ctx, r);
                assert!(
                    listed.lines().any(|l| l.trim().starts_with(&line)),
                    "`{line}` not listed by nft:\n{listed}"
                );
            }
        }

        // Real traffic: one UDP datagram to 127.0.0.1:5353 (and [::1]:5353) from this
        // namespace. Nothing listens; the ICMP error it draws is related to the same
        // connection, so a rule may count up to two packets.
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        udp.send_to(b"ping", ("127.0.0.1", PORT)).unwrap();
        let six = std::net::UdpSocket::bind("[::1]:0")
            .and_then(|s| s.send_to(b"ping", ("::1", PORT)))
            .is_ok();
        let rs = ns.ruleset();
        let c4 = counters(&rs, "ip", "output");
        assert!((1..=2).contains(&c4[0]), "4-tuple lookup: {c4:?}");
        assert_eq!(c4[1], 0, "the TCP tuple must not match: {c4:?}");
        assert!((1..=2).contains(&c4[2]), "reply tuple lookup: {c4:?}");
        assert!((1..=2).contains(&c4[3]), "protocol and port cmp: {c4:?}");
        if six {
            let c6 = counters(&rs, "ip6", "output");
            assert!((1..=2).contains(&c6[0]), "ip6 lookup: {c6:?}");
        } else {
            eprintln!("no IPv6 loopback in this namespace; ip6 traffic not checked");
        }
    });
}
