//! The interpreter on hand-built tables: each test states what the kernel would do with the
//! expressions, independently of splitproxy's rule builders (those are covered, with real
//! rulesets, by `brain/tests/explain.rs`).
use std::net::IpAddr;

use super::*;
use crate::v1::{
    self, BaseChain, Chain, ChainType, CmpOp, DataType, Datum, Element, Expr, Hook, MetaKey,
    PayloadBase, Rule, Ruleset, Set, Table, VerdictCode, datum::Value, expr::Kind as K,
};

fn e(k: K) -> Expr {
    Expr { kind: Some(k) }
}
fn payload(base: PayloadBase, offset: u32, len: u32, dreg: u32) -> Expr {
    e(K::Payload(v1::Payload {
        base: base as i32,
        offset,
        len,
        dreg,
    }))
}
fn daddr(reg: u32) -> Expr {
    payload(PayloadBase::Network, 16, 4, reg)
}
fn saddr(reg: u32) -> Expr {
    payload(PayloadBase::Network, 12, 4, reg)
}
fn dport(reg: u32) -> Expr {
    payload(PayloadBase::Transport, 2, 2, reg)
}
fn meta(key: MetaKey, dreg: u32) -> Expr {
    e(K::Meta(v1::Meta {
        key: key as i32,
        dreg,
        ..Default::default()
    }))
}
fn cmp(op: CmpOp, sreg: u32, data: Vec<u8>) -> Expr {
    e(K::Cmp(v1::Cmp {
        op: op as i32,
        sreg,
        data,
    }))
}
fn lookup(set: &str, sreg: u32) -> Expr {
    e(K::Lookup(v1::Lookup {
        set: set.into(),
        sreg,
        ..Default::default()
    }))
}
fn verdict(code: VerdictCode, chain: &str) -> Expr {
    e(K::Verdict(v1::Verdict {
        code: code as i32,
        chain: chain.into(),
    }))
}
fn ip(s: &str) -> Datum {
    regs::ip_datum(s.parse().unwrap())
}
fn val(v: Value) -> Datum {
    Datum { value: Some(v) }
}
fn rule(exprs: Vec<Expr>) -> Rule {
    Rule {
        exprs,
        comment: String::new(),
    }
}
fn base(name: &str, hook: Hook, ty: ChainType, priority: i32, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.into(),
        base: Some(BaseChain {
            hook: hook as i32,
            r#type: ty as i32,
            priority,
            policy_drop: false,
        }),
        rules,
        comment: String::new(),
    }
}
fn chain(name: &str, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.into(),
        rules,
        ..Default::default()
    }
}

/// `ip daddr . meta l4proto . th dport` into registers 0, 1, 2.
fn tuple() -> Vec<Expr> {
    vec![daddr(0), meta(MetaKey::L4proto, 1), dport(2)]
}

fn tuple_key(addr: &str, proto: u32, port: u32) -> Vec<Datum> {
    vec![ip(addr), val(Value::Proto(proto)), val(Value::Port(port))]
}

const TUPLE: [DataType; 3] = [
    DataType::Ipv4Addr,
    DataType::InetProto,
    DataType::InetService,
];

fn types(t: &[DataType]) -> Vec<i32> {
    t.iter().map(|t| *t as i32).collect()
}

/// A small table in the shape of splitproxy's: a Service 10.96.0.10:80/tcp with three
/// endpoints (one rule, numgen mod 3, a data map), 10.96.0.11:80 without endpoints (reject
/// in filter), a masquerade mark for sources outside 10.244.0.0/16, masquerade of marked
/// packets in postrouting, then a jump that masquerade's accept must cut off.
fn model() -> Model {
    let mut ports3 = Set {
        name: "ports-3".into(),
        key: types(&TUPLE),
        ..Default::default()
    };
    ports3.elements.push(Element {
        key: tuple_key("10.96.0.10", 6, 80),
        ..Default::default()
    });
    let mut key = types(&TUPLE);
    key.push(DataType::Integer as i32);
    let mut endpoints = Set {
        name: "endpoints".into(),
        key,
        data: types(&[DataType::Ipv4Addr, DataType::InetService]),
        ..Default::default()
    };
    for (slot, addr) in ["10.244.1.1", "10.244.1.2", "10.244.2.1"]
        .iter()
        .enumerate()
    {
        let mut k = tuple_key("10.96.0.10", 6, 80);
        k.push(val(Value::U32(slot as u32)));
        endpoints.elements.push(Element {
            key: k,
            data: vec![ip(addr), val(Value::Port(8080))],
            ..Default::default()
        });
    }
    let mut none = Set {
        name: "no-endpoints".into(),
        key: types(&TUPLE),
        ..Default::default()
    };
    none.elements.push(Element {
        key: tuple_key("10.96.0.11", 6, 80),
        ..Default::default()
    });
    let mut pods = Set {
        name: "pods".into(),
        key: types(&[DataType::Ipv4Addr]),
        interval: true,
        ..Default::default()
    };
    pods.elements.push(Element {
        key: vec![ip("10.244.0.0")],
        key_end: vec![ip("10.244.255.255")],
        ..Default::default()
    });
    let mut record = Set {
        name: "seen".into(),
        key: types(&[DataType::Ipv4Addr]),
        dynamic: true,
        timeout: true,
        default_timeout_ms: 60_000,
        ..Default::default()
    };
    record.elements.clear();

    let mark_bit: u32 = 0x4000;
    let mut services = vec![];
    // Mark sources outside the pod network.
    let mut r = vec![saddr(0), lookup_invert("pods", 0)];
    r.extend([
        meta(MetaKey::Mark, 0),
        e(K::Bitwise(v1::Bitwise {
            sreg: 0,
            dreg: 0,
            mask: (!mark_bit).to_ne_bytes().to_vec(),
            xor: mark_bit.to_ne_bytes().to_vec(),
        })),
        e(K::Meta(v1::Meta {
            key: MetaKey::Mark as i32,
            set: true,
            sreg: 0,
            dreg: 0,
        })),
    ]);
    services.push(rule(r));
    let mut r = tuple();
    r.push(lookup("ports-3", 0));
    r.push(e(K::Numgen(v1::Numgen {
        r#type: v1::NumgenType::Random as i32,
        modulus: 3,
        offset: 0,
        dreg: 3,
    })));
    r.push(e(K::Lookup(v1::Lookup {
        set: "endpoints".into(),
        sreg: 0,
        has_dreg: true,
        dreg: 0,
        ..Default::default()
    })));
    r.push(e(K::Nat(v1::Nat {
        r#type: v1::NatType::Dnat as i32,
        family: v1::Family::Ip as i32,
        has_addr: true,
        reg_addr: 0,
        has_proto: true,
        reg_proto: 1,
        flags: 0,
    })));
    services.push(rule(r));

    let mut reject = tuple();
    reject.push(lookup("no-endpoints", 0));
    reject.push(cmp(CmpOp::Eq, 1, vec![6]));
    reject.push(e(K::Reject(v1::Reject {
        r#type: v1::RejectType::TcpRst as i32,
        code: 0,
    })));

    let masq = vec![
        meta(MetaKey::Mark, 0),
        e(K::Bitwise(v1::Bitwise {
            sreg: 0,
            dreg: 0,
            mask: mark_bit.to_ne_bytes().to_vec(),
            xor: vec![0; 4],
        })),
        cmp(CmpOp::Neq, 0, vec![0; 4]),
        e(K::Masquerade(v1::Masquerade { flags: 16 })),
    ];
    let record_rule = vec![
        saddr(0),
        e(K::Dynset(v1::Dynset {
            set: "seen".into(),
            op: v1::DynsetOp::Update as i32,
            sreg_key: 0,
            ..Default::default()
        })),
    ];
    let table = Table {
        family: Family::Ip as i32,
        name: "t".into(),
        comment: String::new(),
        chains: vec![
            base(
                "filter-forward",
                Hook::Forward,
                ChainType::Filter,
                -110,
                vec![rule(vec![verdict(VerdictCode::Jump, "check")])],
            ),
            base(
                "filter-output",
                Hook::Output,
                ChainType::Filter,
                -110,
                vec![rule(vec![verdict(VerdictCode::Jump, "check")])],
            ),
            chain("check", vec![rule(reject)]),
            base(
                "nat-prerouting",
                Hook::Prerouting,
                ChainType::Nat,
                -100,
                vec![rule(vec![verdict(VerdictCode::Jump, "services")])],
            ),
            base(
                "nat-output",
                Hook::Output,
                ChainType::Nat,
                -100,
                vec![rule(vec![verdict(VerdictCode::Jump, "services")])],
            ),
            chain("services", services),
            base(
                "nat-postrouting",
                Hook::Postrouting,
                ChainType::Nat,
                100,
                vec![
                    rule(vec![verdict(VerdictCode::Jump, "masq")]),
                    rule(vec![verdict(VerdictCode::Jump, "record")]),
                ],
            ),
            chain("masq", vec![rule(masq)]),
            chain("record", vec![rule(record_rule)]),
        ],
        sets: vec![ports3, endpoints, none, pods, record],
    };
    Model::from_ruleset(&Ruleset {
        tables: vec![table],
    })
}

fn lookup_invert(set: &str, sreg: u32) -> Expr {
    e(K::Lookup(v1::Lookup {
        set: set.into(),
        sreg,
        invert: true,
        ..Default::default()
    }))
}

fn packet(src: &str, dst: &str, dport: u16, origin: Origin) -> Packet {
    Packet {
        saddr: src.parse().unwrap(),
        sport: 40000,
        daddr: dst.parse().unwrap(),
        dport,
        l4proto: 6,
        iifname: Some("eth0".into()),
        origin,
        established: false,
        mark: 0,
        local: vec!["192.168.77.10".parse().unwrap()],
    }
}

fn dnat_targets(r: &ExplainPacketResponse) -> Vec<(String, u32, Vec<u32>, bool)> {
    let mut v: Vec<_> = r
        .outcomes
        .iter()
        .map(|o| {
            (
                o.dnat_address.clone(),
                o.dnat_port,
                o.slots.clone(),
                o.masquerade,
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn numgen_is_enumerated_and_each_slot_maps_to_its_endpoint() {
    let r = explain(
        &model(),
        &packet("10.244.3.5", "10.96.0.10", 80, Origin::Arriving),
        vec![],
    );
    assert_eq!(r.fate, PacketFate::Dnat as i32, "{}", r.text);
    assert_eq!(
        dnat_targets(&r),
        vec![
            ("10.244.1.1".into(), 8080, vec![0], false),
            ("10.244.1.2".into(), 8080, vec![1], false),
            ("10.244.2.1".into(), 8080, vec![2], false),
        ],
        "{}",
        r.text
    );
    for o in &r.outcomes {
        assert!((o.share - 1.0 / 3.0).abs() < 1e-9);
        assert_eq!(o.modulus, 3);
        assert!(o.route.starts_with("forwarded to 10.244."), "{}", o.route);
    }
    assert!(r.exact, "{}", r.text);
    // The path up to the random choice is shared; the lookup of each slot is the outcome's.
    assert!(
        r.path.iter().any(|s| s.set == "ports-3" && s.matched),
        "{}",
        r.text
    );
    assert!(r.outcomes.iter().all(|o| {
        o.path
            .iter()
            .any(|s| s.set == "endpoints" && s.element.contains(&o.dnat_address))
    }));
    assert!(r.text.contains("numgen random mod 3"), "{}", r.text);
}

#[test]
fn masquerade_accept_ends_the_hook_before_a_later_jump() {
    // From outside the pod network: marked, then masqueraded in postrouting, whose accept
    // ends nat-postrouting: the second jump (record) never runs.
    let r = explain(
        &model(),
        &packet("192.168.77.200", "10.96.0.10", 80, Origin::Arriving),
        vec![],
    );
    assert!(r.outcomes.iter().all(|o| o.masquerade), "{}", r.text);
    assert!(
        r.outcomes.iter().all(|o| o.dynsets.is_empty()),
        "{}",
        r.text
    );
    assert!(r.text.contains("meta mark set 0x00004000"), "{}", r.text);
    // From a pod: not marked, not masqueraded, and the record chain runs (a dynset).
    let r = explain(
        &model(),
        &packet("10.244.3.5", "10.96.0.10", 80, Origin::Arriving),
        vec![],
    );
    assert!(r.outcomes.iter().all(|o| !o.masquerade));
    assert!(r.outcomes.iter().all(|o| o.dynsets.len() == 1
        && o.dynsets[0].set == "seen"
        && o.dynsets[0].key == "10.244.3.5"
        && o.dynsets[0].timeout_ms == 60_000));
}

#[test]
fn reject_refuses_and_a_miss_accepts_untouched() {
    let r = explain(
        &model(),
        &packet("10.244.3.5", "10.96.0.11", 80, Origin::Arriving),
        vec![],
    );
    assert_eq!(r.fate, PacketFate::Rejected as i32, "{}", r.text);
    let o = &r.outcomes[0];
    assert_eq!(
        o.reject.as_ref().map(|r| r.r#type),
        Some(v1::RejectType::TcpRst as i32)
    );
    assert!(r.text.contains("REJECTED with a TCP reset"), "{}", r.text);
    // The jump to check and its rule appear in the path.
    assert!(
        r.path
            .iter()
            .any(|s| s.chain == "check" && s.kind == path_step_kind(v1::path_step::Kind::Rule))
    );
    // UDP to the same destination: the rule's protocol cmp fails: untouched.
    let mut p = packet("10.244.3.5", "10.96.0.11", 80, Origin::Arriving);
    p.l4proto = 17;
    let r = explain(&model(), &p, vec![]);
    assert_eq!(r.fate, PacketFate::Accepted as i32, "{}", r.text);
    assert_eq!(r.outcomes.len(), 1);
    assert_eq!(r.outcomes[0].route, "forwarded to 10.96.0.11:80");
}

fn path_step_kind(k: v1::path_step::Kind) -> i32 {
    k as i32
}

#[test]
fn local_packets_take_output_and_postrouting() {
    let r = explain(
        &model(),
        &packet("192.168.77.10", "10.96.0.10", 80, Origin::Local),
        vec![],
    );
    let hooks: Vec<i32> = r
        .path
        .iter()
        .chain(r.outcomes[0].path.iter())
        .filter(|s| s.kind == v1::path_step::Kind::Hook as i32)
        .map(|s| s.hook)
        .collect();
    assert_eq!(hooks, vec![Hook::Output as i32, Hook::Postrouting as i32]);
    assert_eq!(r.outcomes.len(), 3);
    // 192.168.77.10 is outside the pod CIDRs: marked and masqueraded.
    assert!(r.outcomes.iter().all(|o| o.masquerade));
    // An established connection: NAT chains skipped, nothing translated.
    let mut p = packet("10.244.3.5", "10.96.0.10", 80, Origin::Arriving);
    p.established = true;
    let r = explain(&model(), &p, vec![]);
    assert_eq!(r.fate, PacketFate::Accepted as i32);
    assert!(
        r.text
            .contains("NAT chains see only a connection's first packet"),
        "{}",
        r.text
    );
}

#[test]
fn verdict_maps_goto_and_return_follow_the_kernel() {
    // vmap: 80 -> goto a, 81 -> jump b; a returns at once (back to the base chain's caller
    // level, i.e. the base chain, which goes on to drop); b accepts.
    let mut vmap = Set {
        name: "vm".into(),
        key: types(&[DataType::InetService]),
        data: types(&[DataType::Verdict]),
        ..Default::default()
    };
    for (port, code, target) in [(80, VerdictCode::Goto, "a"), (81, VerdictCode::Jump, "b")] {
        vmap.elements.push(Element {
            key: vec![val(Value::Port(port))],
            verdict: Some(v1::Verdict {
                code: code as i32,
                chain: target.into(),
            }),
            ..Default::default()
        });
    }
    let table = Table {
        family: Family::Ip as i32,
        name: "t".into(),
        comment: String::new(),
        chains: vec![
            base(
                "in",
                Hook::Prerouting,
                ChainType::Filter,
                0,
                vec![
                    rule(vec![verdict(VerdictCode::Jump, "outer")]),
                    rule(vec![verdict(VerdictCode::Drop, "")]),
                ],
            ),
            chain(
                "outer",
                vec![rule(vec![
                    dport(0),
                    e(K::Lookup(v1::Lookup {
                        set: "vm".into(),
                        sreg: 0,
                        verdict: true,
                        ..Default::default()
                    })),
                ])],
            ),
            chain("a", vec![rule(vec![verdict(VerdictCode::Return, "")])]),
            chain("b", vec![rule(vec![verdict(VerdictCode::Accept, "")])]),
        ],
        sets: vec![vmap],
    };
    let m = Model::from_ruleset(&Ruleset {
        tables: vec![table],
    });
    // goto a, return: back to where `outer` was jumped from, the base chain's next rule: drop.
    let r = explain(
        &m,
        &packet("1.1.1.1", "2.2.2.2", 80, Origin::Arriving),
        vec![],
    );
    assert_eq!(r.fate, PacketFate::Dropped as i32, "{}", r.text);
    // jump b: accept.
    let r = explain(
        &m,
        &packet("1.1.1.1", "2.2.2.2", 81, Origin::Arriving),
        vec![],
    );
    assert_eq!(r.fate, PacketFate::Accepted as i32, "{}", r.text);
    // No element: the lookup misses, outer ends, back in the base chain: drop.
    let r = explain(
        &m,
        &packet("1.1.1.1", "2.2.2.2", 82, Origin::Arriving),
        vec![],
    );
    assert_eq!(r.fate, PacketFate::Dropped as i32, "{}", r.text);
}

#[test]
fn an_unknown_interface_is_said_and_makes_the_answer_inexact() {
    let table = Table {
        family: Family::Ip as i32,
        name: "t".into(),
        comment: String::new(),
        chains: vec![base(
            "in",
            Hook::Prerouting,
            ChainType::Filter,
            0,
            vec![rule(vec![
                meta(MetaKey::Iifname, 0),
                cmp(CmpOp::Eq, 0, b"pod".to_vec()),
                verdict(VerdictCode::Drop, ""),
            ])],
        )],
        sets: vec![],
    };
    let m = Model::from_ruleset(&Ruleset {
        tables: vec![table],
    });
    let mut p = packet("1.1.1.1", "2.2.2.2", 80, Origin::Arriving);
    p.iifname = Some("pod7".into());
    let r = explain(&m, &p, vec![]);
    assert_eq!(
        r.fate,
        PacketFate::Dropped as i32,
        "a prefix match: {}",
        r.text
    );
    assert!(r.exact);
    p.iifname = Some("eth0".into());
    assert_eq!(explain(&m, &p, vec![]).fate, PacketFate::Accepted as i32);
    p.iifname = None;
    let r = explain(&m, &p, vec![]);
    assert_eq!(r.fate, PacketFate::Accepted as i32);
    assert!(!r.exact);
    assert!(
        r.assumptions
            .iter()
            .any(|a| a.contains("compares a value the request does not determine")),
        "{:?}",
        r.assumptions
    );
}

#[test]
fn requests_get_defaults_and_bad_ones_are_refused() {
    let node: Vec<IpAddr> = vec![
        "192.168.77.10".parse().unwrap(),
        "fd00:77::10".parse().unwrap(),
    ];
    let req = ExplainPacketRequest {
        node: "n".into(),
        destination_ip: "10.96.0.10".into(),
        destination_port: 80,
        ..Default::default()
    };
    let (p, assumed) = packet_of(&req, &node).unwrap();
    assert_eq!(p.saddr, "192.168.77.10".parse::<IpAddr>().unwrap());
    assert_eq!(p.origin, Origin::Local);
    assert_eq!(
        (p.sport, p.l4proto, p.established),
        (DEFAULT_SOURCE_PORT, 6, false)
    );
    assert!(assumed.len() >= 4, "{assumed:?}");
    let req = ExplainPacketRequest {
        source_ip: "10.244.1.5".into(),
        source_port: 5000,
        protocol: "UDP".into(),
        ingress_interface: "pod3".into(),
        conn_state: v1::explain_packet_request::ConnState::New as i32,
        ..req
    };
    let (p, _) = packet_of(&req, &node).unwrap();
    assert_eq!(p.origin, Origin::Arriving);
    assert_eq!((p.sport, p.l4proto), (5000, 17));
    assert_eq!(p.iifname.as_deref(), Some("pod3"));
    for bad in [
        ExplainPacketRequest {
            destination_ip: "fd00::1".into(),
            ..req.clone()
        },
        ExplainPacketRequest {
            protocol: "icmp".into(),
            ..req.clone()
        },
        ExplainPacketRequest {
            destination_port: 70000,
            ..req.clone()
        },
        ExplainPacketRequest {
            destination_ip: String::new(),
            ..req.clone()
        },
        ExplainPacketRequest {
            ingress_interface: "a very long interface name".into(),
            ..req.clone()
        },
    ] {
        assert!(packet_of(&bad, &node).is_err(), "{bad:?}");
    }
}

#[test]
fn slots_without_an_element_are_one_outcome_with_their_share() {
    // The DNAT rule's numgen modulus raised to 40 while the map holds slots 0..2 only: the
    // 37 other values miss the map, end the rule, and leave the packet untouched.
    let mut rs = model().to_ruleset();
    for c in &mut rs.tables[0].chains {
        for r in &mut c.rules {
            for e in &mut r.exprs {
                if let Some(K::Numgen(n)) = &mut e.kind {
                    n.modulus = 40;
                }
            }
        }
    }
    let m = Model::from_ruleset(&rs);
    let r = explain(
        &m,
        &packet("10.244.3.5", "10.96.0.10", 80, Origin::Arriving),
        vec![],
    );
    assert_eq!(r.outcomes.len(), 4, "{}", r.text);
    let untouched = r
        .outcomes
        .iter()
        .find(|o| o.fate == PacketFate::Accepted as i32)
        .unwrap();
    assert_eq!(untouched.slots, (3..40).collect::<Vec<u32>>());
    assert!((untouched.share - 37.0 / 40.0).abs() < 1e-9);
    assert!(r.text.contains("numgen values 3,4,5"), "{}", r.text);
    for o in r
        .outcomes
        .iter()
        .filter(|o| o.fate == PacketFate::Dnat as i32)
    {
        assert!((o.share - 1.0 / 40.0).abs() < 1e-9);
    }
}
