//! Golden tests of the nft-syntax rendering of the ruleset IR.
use splitproxy_proto::render::{self, Context};
use splitproxy_proto::v1::{
    BaseChain, Bitwise, Chain, ChainType, Cmp, CmpOp, Counter, Ct, CtDirection, CtKey, DataType,
    Datum, Dynset, DynsetOp, Element, Expr, Family, Fib, FibResult, Hook, Immediate, Lookup,
    Masquerade, Meta, MetaKey, Nat, NatType, Numgen, NumgenType, Payload, PayloadBase, Reject,
    RejectType, Rule, Ruleset, Set, Table, Verdict, VerdictCode, datum, expr,
};

// ---- IR builders ----

fn x(kind: expr::Kind) -> Expr {
    Expr { kind: Some(kind) }
}

fn payload(base: PayloadBase, offset: u32, len: u32, dreg: u32) -> Expr {
    x(expr::Kind::Payload(Payload {
        base: base as i32,
        offset,
        len,
        dreg,
    }))
}

fn ip_saddr(dreg: u32) -> Expr {
    payload(PayloadBase::Network, 12, 4, dreg)
}

fn ip_daddr(dreg: u32) -> Expr {
    payload(PayloadBase::Network, 16, 4, dreg)
}

fn ip6_saddr(dreg: u32) -> Expr {
    payload(PayloadBase::Network, 8, 16, dreg)
}

fn ip6_daddr(dreg: u32) -> Expr {
    payload(PayloadBase::Network, 24, 16, dreg)
}

fn th_dport(dreg: u32) -> Expr {
    payload(PayloadBase::Transport, 2, 2, dreg)
}

fn meta(key: MetaKey, dreg: u32) -> Expr {
    x(expr::Kind::Meta(Meta {
        key: key as i32,
        dreg,
        set: false,
        sreg: 0,
    }))
}

fn meta_set(key: MetaKey, sreg: u32) -> Expr {
    x(expr::Kind::Meta(Meta {
        key: key as i32,
        dreg: 0,
        set: true,
        sreg,
    }))
}

fn l4proto(dreg: u32) -> Expr {
    meta(MetaKey::L4proto, dreg)
}

fn ct(key: CtKey, dreg: u32) -> Expr {
    x(expr::Kind::Ct(Ct {
        key: key as i32,
        dreg,
        ..Default::default()
    }))
}

fn ct_dir(key: CtKey, direction: CtDirection, dreg: u32) -> Expr {
    x(expr::Kind::Ct(Ct {
        key: key as i32,
        dreg,
        direction: direction as i32,
    }))
}

fn cmp(op: CmpOp, sreg: u32, data: &[u8]) -> Expr {
    x(expr::Kind::Cmp(Cmp {
        op: op as i32,
        sreg,
        data: data.to_vec(),
    }))
}

fn bitwise(sreg: u32, dreg: u32, mask: &[u8], xor: &[u8]) -> Expr {
    x(expr::Kind::Bitwise(Bitwise {
        sreg,
        dreg,
        mask: mask.to_vec(),
        xor: xor.to_vec(),
    }))
}

fn lookup(set: &str, sreg: u32) -> Expr {
    x(expr::Kind::Lookup(Lookup {
        set: set.into(),
        sreg,
        ..Default::default()
    }))
}

fn lookup_not(set: &str, sreg: u32) -> Expr {
    x(expr::Kind::Lookup(Lookup {
        set: set.into(),
        sreg,
        invert: true,
        ..Default::default()
    }))
}

fn lookup_map(set: &str, sreg: u32, dreg: u32) -> Expr {
    x(expr::Kind::Lookup(Lookup {
        set: set.into(),
        sreg,
        has_dreg: true,
        dreg,
        ..Default::default()
    }))
}

fn lookup_vmap(set: &str, sreg: u32) -> Expr {
    x(expr::Kind::Lookup(Lookup {
        set: set.into(),
        sreg,
        verdict: true,
        ..Default::default()
    }))
}

fn numgen_random(modulus: u32, dreg: u32) -> Expr {
    x(expr::Kind::Numgen(Numgen {
        r#type: NumgenType::Random as i32,
        modulus,
        offset: 0,
        dreg,
    }))
}

fn dnat(family: Family, reg_addr: Option<u32>, reg_proto: Option<u32>) -> Expr {
    x(expr::Kind::Nat(Nat {
        r#type: NatType::Dnat as i32,
        family: family as i32,
        has_addr: reg_addr.is_some(),
        reg_addr: reg_addr.unwrap_or(0),
        has_proto: reg_proto.is_some(),
        reg_proto: reg_proto.unwrap_or(0),
        flags: 0,
    }))
}

fn imm(dreg: u32, data: &[u8]) -> Expr {
    x(expr::Kind::Immediate(Immediate {
        dreg,
        data: data.to_vec(),
    }))
}

fn masquerade(flags: u32) -> Expr {
    x(expr::Kind::Masquerade(Masquerade { flags }))
}

fn reject(t: RejectType, code: u32) -> Expr {
    x(expr::Kind::Reject(Reject {
        r#type: t as i32,
        code,
    }))
}

fn counter() -> Expr {
    x(expr::Kind::Counter(Counter {}))
}

fn vd(code: VerdictCode, chain: &str) -> Verdict {
    Verdict {
        code: code as i32,
        chain: chain.into(),
    }
}

fn verdict(code: VerdictCode, chain: &str) -> Expr {
    x(expr::Kind::Verdict(vd(code, chain)))
}

fn rule(exprs: Vec<Expr>) -> Rule {
    Rule {
        exprs,
        comment: String::new(),
    }
}

fn commented(exprs: Vec<Expr>, comment: &str) -> Rule {
    Rule {
        exprs,
        comment: comment.into(),
    }
}

fn v4(a: [u8; 4]) -> Datum {
    Datum {
        value: Some(datum::Value::Ipv4(a.to_vec())),
    }
}

fn v6(s: &str) -> Datum {
    let a: std::net::Ipv6Addr = s.parse().unwrap();
    Datum {
        value: Some(datum::Value::Ipv6(a.octets().to_vec())),
    }
}

fn proto(p: u32) -> Datum {
    Datum {
        value: Some(datum::Value::Proto(p)),
    }
}

fn port(p: u32) -> Datum {
    Datum {
        value: Some(datum::Value::Port(p)),
    }
}

fn int(v: u32) -> Datum {
    Datum {
        value: Some(datum::Value::U32(v)),
    }
}

fn key(key: Vec<Datum>) -> Element {
    Element {
        key,
        ..Default::default()
    }
}

fn set(name: &str, key: &[DataType], data: &[DataType], elements: Vec<Element>) -> Set {
    Set {
        name: name.into(),
        key: key.iter().map(|&t| t as i32).collect(),
        data: data.iter().map(|&t| t as i32).collect(),
        elements,
        ..Default::default()
    }
}

fn base(hook: Hook, t: ChainType, priority: i32) -> Option<BaseChain> {
    Some(BaseChain {
        hook: hook as i32,
        r#type: t as i32,
        priority,
        policy_drop: false,
    })
}

fn chain(name: &str, base: Option<BaseChain>, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.into(),
        base,
        comment: String::new(),
        rules,
    }
}

fn ne(v: u32) -> [u8; 4] {
    v.to_ne_bytes()
}

fn lines(l: &[&str]) -> String {
    let mut s = l.join("\n");
    s.push('\n');
    s
}

use DataType::{InetProto, InetService, Integer, Ipv4Addr, Ipv6Addr, Mark};

/// The table the brain produces, in small.
fn splitproxy_table() -> Table {
    let tuple = [Ipv4Addr, InetProto, InetService];
    Table {
        family: Family::Ip as i32,
        name: "splitproxy".into(),
        comment: "rules for splitproxy".into(),
        sets: vec![
            Set {
                comment: "Active ClusterIPs".into(),
                ..set(
                    "cluster-ips",
                    &[Ipv4Addr],
                    &[],
                    vec![
                        key(vec![v4([10, 96, 0, 1])]),
                        key(vec![v4([10, 96, 0, 10])]),
                        key(vec![v4([10, 96, 0, 11])]),
                    ],
                )
            },
            set(
                "no-endpoint-services",
                &tuple,
                &[],
                vec![Element {
                    comment: "demo/legacy:http".into(),
                    ..key(vec![v4([10, 96, 0, 20]), proto(6), port(80)])
                }],
            ),
            set(
                "service-ips",
                &tuple,
                &[Integer],
                vec![
                    Element {
                        data: vec![int(2)],
                        ..key(vec![v4([10, 96, 0, 10]), proto(17), port(53)])
                    },
                    Element {
                        data: vec![int(3)],
                        ..key(vec![v4([10, 96, 0, 10]), proto(6), port(53)])
                    },
                ],
            ),
            set(
                "service-dispatch",
                &[Integer],
                &[DataType::Verdict],
                vec![
                    Element {
                        verdict: Some(vd(VerdictCode::Goto, "endpoints-2")),
                        ..key(vec![int(2)])
                    },
                    Element {
                        verdict: Some(vd(VerdictCode::Goto, "endpoints-3")),
                        ..key(vec![int(3)])
                    },
                ],
            ),
            set(
                "service-endpoints",
                &[Ipv4Addr, InetProto, InetService, Integer],
                &[Ipv4Addr, InetService],
                vec![
                    Element {
                        data: vec![v4([10, 244, 1, 5]), port(53)],
                        ..key(vec![v4([10, 96, 0, 10]), proto(6), port(53), int(0)])
                    },
                    Element {
                        data: vec![v4([10, 244, 2, 7]), port(5353)],
                        ..key(vec![v4([10, 96, 0, 10]), proto(6), port(53), int(1)])
                    },
                ],
            ),
        ],
        chains: vec![
            chain(
                "nat-prerouting",
                base(Hook::Prerouting, ChainType::Nat, -100),
                vec![rule(vec![verdict(VerdictCode::Jump, "services")])],
            ),
            chain(
                "services",
                None,
                vec![rule(vec![
                    ip_daddr(0),
                    l4proto(1),
                    th_dport(2),
                    lookup_map("service-ips", 0, 3),
                    lookup_vmap("service-dispatch", 3),
                ])],
            ),
            chain(
                "endpoints-3",
                None,
                vec![rule(vec![
                    ip_daddr(0),
                    l4proto(1),
                    th_dport(2),
                    numgen_random(3, 3),
                    lookup_map("service-endpoints", 0, 0),
                    dnat(Family::Ip, Some(0), Some(1)),
                ])],
            ),
            chain(
                "filter-forward",
                base(Hook::Forward, ChainType::Filter, -110),
                vec![
                    rule(vec![
                        ct(CtKey::State, 0),
                        bitwise(0, 0, &ne(8), &[0; 4]),
                        cmp(CmpOp::Neq, 0, &[0; 4]),
                        ip_daddr(0),
                        l4proto(1),
                        th_dport(2),
                        lookup("no-endpoint-services", 0),
                        reject(RejectType::IcmpUnreach, 3),
                    ]),
                    commented(
                        vec![
                            ip_daddr(0),
                            bitwise(0, 0, &[255, 255, 0, 0], &[0; 4]),
                            cmp(CmpOp::Eq, 0, &[10, 96, 0, 0]),
                            verdict(VerdictCode::Drop, ""),
                        ],
                        "Drop traffic to unallocated ClusterIPs",
                    ),
                ],
            ),
        ],
    }
}

#[test]
fn the_brains_table() {
    let want = lines(&[
        "table ip splitproxy {",
        "\tcomment \"rules for splitproxy\"",
        "\tset cluster-ips {",
        "\t\ttype ipv4_addr",
        "\t\tcomment \"Active ClusterIPs\"",
        "\t\telements = { 10.96.0.1, 10.96.0.10,",
        "\t\t\t     10.96.0.11 }",
        "\t}",
        "",
        "\tset no-endpoint-services {",
        "\t\ttype ipv4_addr . inet_proto . inet_service",
        "\t\telements = { 10.96.0.20 . tcp . 80 comment \"demo/legacy:http\" }",
        "\t}",
        "",
        "\tmap service-ips {",
        "\t\ttype ipv4_addr . inet_proto . inet_service : integer",
        "\t\telements = { 10.96.0.10 . udp . 53 : 2,",
        "\t\t\t     10.96.0.10 . tcp . 53 : 3 }",
        "\t}",
        "",
        "\tmap service-dispatch {",
        "\t\ttype integer : verdict",
        "\t\telements = { 2 : goto endpoints-2,",
        "\t\t\t     3 : goto endpoints-3 }",
        "\t}",
        "",
        "\tmap service-endpoints {",
        "\t\ttype ipv4_addr . inet_proto . inet_service . integer : ipv4_addr . inet_service",
        "\t\telements = { 10.96.0.10 . tcp . 53 . 0 : 10.244.1.5 . 53,",
        "\t\t\t     10.96.0.10 . tcp . 53 . 1 : 10.244.2.7 . 5353 }",
        "\t}",
        "",
        "\tchain nat-prerouting {",
        "\t\ttype nat hook prerouting priority dstnat; policy accept;",
        "\t\tjump services",
        "\t}",
        "",
        "\tchain services {",
        "\t\tip daddr . meta l4proto . th dport map @service-ips vmap @service-dispatch",
        "\t}",
        "",
        "\tchain endpoints-3 {",
        "\t\tdnat ip to ip daddr . meta l4proto . th dport . numgen random mod 3 map @service-endpoints",
        "\t}",
        "",
        "\tchain filter-forward {",
        "\t\ttype filter hook forward priority -110; policy accept;",
        "\t\tct state new ip daddr . meta l4proto . th dport @no-endpoint-services reject",
        "\t\tip daddr 10.96.0.0/16 drop comment \"Drop traffic to unallocated ClusterIPs\"",
        "\t}",
        "}",
    ]);
    let t = splitproxy_table();
    assert_eq!(render::table(&t), want);
    // A ruleset is its tables one after the other.
    let rs = Ruleset {
        tables: vec![t.clone(), t],
    };
    assert_eq!(render::ruleset(&rs), format!("{want}{want}"));
}

#[test]
fn rules_render_alike_without_the_table() {
    // Without set definitions the key of a lookup is the run of registers loaded in order.
    let t = splitproxy_table();
    let rules: Vec<String> = t
        .chains
        .iter()
        .flat_map(|c| &c.rules)
        .map(render::rule)
        .collect();
    assert_eq!(
        rules,
        [
            "jump services",
            "ip daddr . meta l4proto . th dport map @service-ips vmap @service-dispatch",
            "dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 3 map @service-endpoints",
            "ct state new ip daddr . meta l4proto . th dport @no-endpoint-services reject with icmp port-unreachable",
            "ip daddr 10.96.0.0/16 drop comment \"Drop traffic to unallocated ClusterIPs\"",
        ]
    );
    // A lone chain is the block as it appears in the table.
    assert_eq!(
        render::chain(&t.chains[0]),
        "\tchain nat-prerouting {\n\t\ttype nat hook prerouting priority dstnat; policy accept;\n\t\tjump services\n\t}\n"
    );
    let ctx = Context::of(&t);
    assert_eq!(
        render::rule_in(&ctx, &t.chains[3].rules[0]),
        "ct state new ip daddr . meta l4proto . th dport @no-endpoint-services reject"
    );
}

#[test]
fn kube_proxy_rules_as_nft_lists_them() {
    let t = Table {
        family: Family::Ip as i32,
        name: "kube-proxy".into(),
        comment: String::new(),
        sets: vec![
            set("cluster-ips", &[Ipv4Addr], &[], vec![]),
            set(
                "hairpin-connections",
                &[Ipv4Addr, Ipv4Addr, InetProto, InetService],
                &[],
                vec![],
            ),
            Set {
                dynamic: true,
                timeout: true,
                default_timeout_ms: 3 * 3600 * 1000,
                ..set(
                    "affinity-x",
                    &[Ipv4Addr],
                    &[],
                    vec![key(vec![v4([172, 20, 211, 52])])],
                )
            },
        ],
        chains: vec![],
    };
    let ctx = Context::of(&t);
    let r = |exprs: Vec<Expr>| render::rule_in(&ctx, &rule(exprs));
    assert_eq!(
        render::rule_in(
            &ctx,
            &commented(
                vec![
                    ip_daddr(0),
                    lookup("cluster-ips", 0),
                    ip_saddr(0),
                    bitwise(0, 0, &[255, 255, 0, 0], &[0; 4]),
                    cmp(CmpOp::Neq, 0, &[172, 20, 0, 0]),
                    meta(MetaKey::Mark, 0),
                    bitwise(0, 0, &ne(!0x4000), &ne(0x4000)),
                    meta_set(MetaKey::Mark, 0),
                ],
                "masquerade clusterIP traffic from outside cluster",
            )
        ),
        "ip daddr @cluster-ips ip saddr != 172.20.0.0/16 meta mark set meta mark | 0x00004000 comment \"masquerade clusterIP traffic from outside cluster\""
    );
    assert_eq!(
        r(vec![
            meta(MetaKey::Mark, 0),
            bitwise(0, 0, &ne(0x4000), &[0; 4]),
            cmp(CmpOp::Neq, 0, &[0; 4]),
            meta(MetaKey::Mark, 0),
            bitwise(0, 0, &[0xff; 4], &ne(0x4000)),
            meta_set(MetaKey::Mark, 0),
            masquerade(16),
        ]),
        "meta mark & 0x00004000 != 0x00000000 meta mark set meta mark ^ 0x00004000 masquerade fully-random"
    );
    assert_eq!(
        r(vec![
            ct(CtKey::Status, 0),
            bitwise(0, 0, &ne(0x20), &[0; 4]),
            cmp(CmpOp::Neq, 0, &[0; 4]),
            ip_saddr(0),
            ip_daddr(1),
            l4proto(2),
            th_dport(3),
            lookup("hairpin-connections", 0),
            masquerade(16),
        ]),
        "ct status dnat ip saddr . ip daddr . meta l4proto . th dport @hairpin-connections masquerade fully-random"
    );
    assert_eq!(
        r(vec![
            x(expr::Kind::Fib(Fib {
                flags: 1,
                result: FibResult::Addrtype as i32,
                dreg: 0,
            })),
            cmp(CmpOp::Eq, 0, &ne(2)),
            meta(MetaKey::Mark, 0),
            bitwise(0, 0, &ne(!0x4000), &ne(0x4000)),
            meta_set(MetaKey::Mark, 0),
        ]),
        "fib saddr type local meta mark set meta mark | 0x00004000"
    );
    // An immediate destination in an ip table: nft leaves the family out.
    assert_eq!(
        r(vec![
            l4proto(0),
            cmp(CmpOp::Eq, 0, &[6]),
            imm(1, &[172, 20, 172, 17]),
            imm(2, &8080u16.to_be_bytes()),
            dnat(Family::Ip, Some(1), Some(2)),
        ]),
        "meta l4proto tcp dnat to 172.20.172.17:8080"
    );
    assert_eq!(
        r(vec![
            ip_saddr(0),
            x(expr::Kind::Dynset(Dynset {
                set: "affinity-x".into(),
                op: DynsetOp::Update as i32,
                sreg_key: 0,
                ..Default::default()
            })),
        ]),
        "update @affinity-x { ip saddr }"
    );
    assert_eq!(
        r(vec![
            ip_saddr(0),
            lookup("affinity-x", 0),
            verdict(VerdictCode::Goto, "endpoint-x")
        ]),
        "ip saddr @affinity-x goto endpoint-x"
    );
    assert_eq!(
        render::set(&t.sets[2]),
        lines(&[
            "\tset affinity-x {",
            "\t\ttype ipv4_addr",
            "\t\tflags dynamic,timeout",
            "\t\ttimeout 3h",
            "\t\telements = { 172.20.211.52 }",
            "\t}",
        ])
    );
}

#[test]
fn payload_meta_ct_fib_numgen() {
    let r = |exprs: Vec<Expr>| render::rule(&rule(exprs));
    assert_eq!(
        r(vec![
            payload(PayloadBase::Transport, 0, 2, 0),
            cmp(CmpOp::Eq, 0, &[0, 22])
        ]),
        "th sport 22"
    );
    assert_eq!(
        r(vec![
            payload(PayloadBase::Network, 9, 1, 0),
            cmp(CmpOp::Eq, 0, &[17])
        ]),
        "ip protocol udp"
    );
    assert_eq!(
        r(vec![
            payload(PayloadBase::Network, 8, 1, 0),
            cmp(CmpOp::Lt, 0, &[2])
        ]),
        "ip ttl < 2"
    );
    assert_eq!(
        r(vec![
            payload(PayloadBase::Network, 0, 1, 0),
            cmp(CmpOp::Eq, 0, &[0x45])
        ]),
        "@nh,0,8 0x45"
    );
    assert_eq!(
        r(vec![
            payload(PayloadBase::Transport, 13, 1, 0),
            cmp(CmpOp::Neq, 0, &[2])
        ]),
        "@th,104,8 != 0x2"
    );
    assert_eq!(
        r(vec![
            payload(PayloadBase::Link, 12, 2, 0),
            cmp(CmpOp::Eq, 0, &[0x08, 0])
        ]),
        "@ll,96,16 0x800"
    );
    assert_eq!(
        r(vec![
            meta(MetaKey::Iifname, 0),
            cmp(CmpOp::Eq, 0, b"eth0\0\0\0\0\0\0\0\0\0\0\0\0")
        ]),
        "iifname \"eth0\""
    );
    assert_eq!(
        r(vec![meta(MetaKey::Oifname, 0), cmp(CmpOp::Neq, 0, b"veth")]),
        "oifname != \"veth*\""
    );
    assert_eq!(
        r(vec![meta(MetaKey::Iif, 0), cmp(CmpOp::Eq, 0, &ne(3))]),
        "iif 3"
    );
    assert_eq!(
        r(vec![meta(MetaKey::Len, 0), cmp(CmpOp::Gt, 0, &ne(1400))]),
        "meta length > 1400"
    );
    assert_eq!(
        r(vec![
            meta(MetaKey::Protocol, 0),
            cmp(CmpOp::Eq, 0, &[0x86, 0xdd])
        ]),
        "meta protocol ip6"
    );
    assert_eq!(
        r(vec![meta(MetaKey::Nfproto, 0), cmp(CmpOp::Eq, 0, &[2])]),
        "meta nfproto ipv4"
    );
    assert_eq!(
        r(vec![meta(MetaKey::Pkttype, 0), cmp(CmpOp::Neq, 0, &[0])]),
        "meta pkttype != host"
    );
    assert_eq!(
        r(vec![meta(MetaKey::Mark, 0), cmp(CmpOp::Eq, 0, &ne(0x4000))]),
        "meta mark 0x00004000"
    );
    assert_eq!(
        r(vec![
            l4proto(0),
            cmp(CmpOp::Eq, 0, &[58]),
            l4proto(0),
            cmp(CmpOp::Neq, 0, &[132])
        ]),
        "meta l4proto ipv6-icmp meta l4proto != sctp"
    );
    // ct state: flag tests, explicit equality, several bits.
    assert_eq!(
        r(vec![
            ct(CtKey::State, 0),
            bitwise(0, 0, &ne(6), &[0; 4]),
            cmp(CmpOp::Neq, 0, &[0; 4]),
            verdict(VerdictCode::Accept, ""),
        ]),
        "ct state established,related accept"
    );
    assert_eq!(
        r(vec![
            ct(CtKey::State, 0),
            bitwise(0, 0, &ne(1), &[0; 4]),
            cmp(CmpOp::Eq, 0, &[0; 4])
        ]),
        "ct state ! invalid"
    );
    assert_eq!(
        r(vec![ct(CtKey::State, 0), cmp(CmpOp::Eq, 0, &ne(8))]),
        "ct state == new"
    );
    assert_eq!(
        r(vec![
            ct(CtKey::State, 0),
            bitwise(0, 0, &ne(8), &[0; 4]),
            cmp(CmpOp::Eq, 0, &ne(8))
        ]),
        "ct state & new == new"
    );
    assert_eq!(
        r(vec![
            ct(CtKey::Status, 0),
            bitwise(0, 0, &ne(0x20), &[0; 4]),
            cmp(CmpOp::Eq, 0, &[0; 4])
        ]),
        "ct status ! dnat"
    );
    assert_eq!(
        r(vec![ct(CtKey::Mark, 0), cmp(CmpOp::Eq, 0, &ne(1))]),
        "ct mark 0x00000001"
    );
    // fib
    let fib = |flags, result: FibResult| {
        x(expr::Kind::Fib(Fib {
            flags,
            result: result as i32,
            dreg: 0,
        }))
    };
    assert_eq!(
        r(vec![
            fib(2, FibResult::Addrtype),
            cmp(CmpOp::Neq, 0, &ne(2))
        ]),
        "fib daddr type != local"
    );
    assert_eq!(
        r(vec![
            fib(1 | 8, FibResult::Oif),
            cmp(CmpOp::Eq, 0, &ne(0)),
            verdict(VerdictCode::Drop, "")
        ]),
        "fib saddr . iif oif 0 drop"
    );
    assert_eq!(
        r(vec![fib(2 | 32, FibResult::Oif), cmp(CmpOp::Eq, 0, &[0])]),
        "fib daddr oif missing"
    );
    // numgen with an offset, mapped through a map the renderer does not know.
    assert_eq!(
        r(vec![
            x(expr::Kind::Numgen(Numgen {
                r#type: NumgenType::Incremental as i32,
                modulus: 2,
                offset: 10,
                dreg: 0,
            })),
            meta_set(MetaKey::Mark, 0),
        ]),
        "meta mark set numgen inc mod 2 offset 10"
    );
    // counter, verdicts and the low-level forms of odd bitwise ops.
    assert_eq!(
        r(vec![counter(), verdict(VerdictCode::Return, "")]),
        "counter return"
    );
    assert_eq!(r(vec![verdict(VerdictCode::Continue, "")]), "continue");
    assert_eq!(
        r(vec![
            meta(MetaKey::Mark, 0),
            bitwise(0, 1, &ne(0xffff_0000), &ne(0x10)),
            meta_set(MetaKey::Mark, 1),
        ]),
        "meta mark set meta mark & 0xffff0010 | 0x00000010"
    );
    assert_eq!(
        r(vec![
            meta(MetaKey::Mark, 0),
            bitwise(0, 0, &ne(0xff), &ne(0x11)),
            cmp(CmpOp::Eq, 0, &ne(1)),
        ]),
        "meta mark & 0x000000ff ^ 0x00000011 == 0x00000001"
    );
    // A mask that is no prefix stays a mask.
    assert_eq!(
        r(vec![
            ip_daddr(0),
            bitwise(0, 0, &[255, 0, 255, 0], &[0; 4]),
            cmp(CmpOp::Eq, 0, &[10, 0, 1, 0])
        ]),
        "ip daddr & 255.0.255.0 == 10.0.1.0"
    );
    // An immediate mark.
    assert_eq!(
        r(vec![imm(0, &ne(0x4000)), meta_set(MetaKey::Mark, 0)]),
        "meta mark set 0x00004000"
    );
}

#[test]
fn nat_masquerade_reject() {
    let ip = Table {
        family: Family::Ip as i32,
        ..Default::default()
    };
    let ip6 = Table {
        family: Family::Ip6 as i32,
        ..Default::default()
    };
    let inet = Table {
        family: Family::Inet as i32,
        ..Default::default()
    };
    let (ip, ip6, inet) = (Context::of(&ip), Context::of(&ip6), Context::of(&inet));
    let r = |ctx: &Context<'_>, exprs: Vec<Expr>| render::rule_in(ctx, &rule(exprs));
    let addr6: std::net::Ipv6Addr = "fd00::1".parse().unwrap();
    let six = || {
        vec![
            imm(0, &addr6.octets()),
            imm(4, &[0x1f, 0x90]),
            dnat(Family::Ip6, Some(0), Some(4)),
        ]
    };
    assert_eq!(r(&ip6, six()), "dnat to [fd00::1]:8080");
    assert_eq!(r(&inet, six()), "dnat ip6 to [fd00::1]:8080");
    assert_eq!(
        r(
            &ip6,
            vec![imm(0, &addr6.octets()), dnat(Family::Ip6, Some(0), None)]
        ),
        "dnat to fd00::1"
    );
    assert_eq!(
        r(&ip, vec![imm(1, &[0, 80]), dnat(Family::Ip, None, Some(1))]),
        "dnat to :80"
    );
    assert_eq!(
        r(
            &ip,
            vec![ip_daddr(0), th_dport(1), dnat(Family::Ip, Some(0), Some(1))]
        ),
        "dnat to ip daddr:th dport"
    );
    assert_eq!(
        r(
            &ip,
            vec![
                imm(0, &[192, 168, 1, 1]),
                x(expr::Kind::Nat(Nat {
                    r#type: NatType::Snat as i32,
                    family: Family::Ip as i32,
                    has_addr: true,
                    reg_addr: 0,
                    flags: 1 | 4 | 8,
                    ..Default::default()
                })),
            ]
        ),
        "snat to 192.168.1.1 random,persistent"
    );
    assert_eq!(r(&ip, vec![masquerade(0)]), "masquerade");
    assert_eq!(
        r(&ip, vec![masquerade(4 | 16 | 8)]),
        "masquerade random,fully-random,persistent"
    );
    // reject
    assert_eq!(r(&ip, vec![reject(RejectType::IcmpUnreach, 3)]), "reject");
    assert_eq!(
        r(&ip, vec![reject(RejectType::IcmpUnreach, 13)]),
        "reject with icmp admin-prohibited"
    );
    assert_eq!(r(&ip6, vec![reject(RejectType::IcmpUnreach, 4)]), "reject");
    assert_eq!(
        r(&ip6, vec![reject(RejectType::IcmpUnreach, 1)]),
        "reject with icmpv6 admin-prohibited"
    );
    assert_eq!(
        r(&ip, vec![reject(RejectType::TcpRst, 0)]),
        "reject with tcp reset"
    );
    assert_eq!(
        r(&inet, vec![reject(RejectType::IcmpxUnreach, 1)]),
        "reject"
    );
    assert_eq!(
        r(&inet, vec![reject(RejectType::IcmpxUnreach, 2)]),
        "reject with icmpx host-unreachable"
    );
}

#[test]
fn ipv6_table() {
    let t = Table {
        family: Family::Ip6 as i32,
        name: "splitproxy".into(),
        comment: String::new(),
        sets: vec![
            set(
                "cluster-ips",
                &[Ipv6Addr],
                &[],
                vec![
                    key(vec![v6("fd00:10:96::1")]),
                    key(vec![v6("fd00:10:96::a")]),
                ],
            ),
            set(
                "service-ips",
                &[Ipv6Addr, InetProto, InetService],
                &[DataType::Verdict],
                vec![Element {
                    verdict: Some(vd(VerdictCode::Goto, "svc-dns")),
                    ..key(vec![v6("fd00:10:96::a"), proto(17), port(53)])
                }],
            ),
            set(
                "endpoints",
                &[Ipv6Addr, InetService, Integer],
                &[Ipv6Addr, InetService],
                vec![Element {
                    data: vec![v6("fd00:10:244::5"), port(53)],
                    ..key(vec![v6("fd00:10:96::a"), port(53), int(0)])
                }],
            ),
        ],
        chains: vec![chain(
            "services",
            base(Hook::Output, ChainType::Nat, -100),
            vec![
                rule(vec![
                    ip6_saddr(0),
                    bitwise(
                        0,
                        0,
                        &[0xff; 8].iter().chain(&[0; 8]).copied().collect::<Vec<_>>(),
                        &[0; 16],
                    ),
                    cmp(CmpOp::Eq, 0, &v6_bytes("fd00:10:244::")),
                    verdict(VerdictCode::Return, ""),
                ]),
                rule(vec![
                    ip6_daddr(0),
                    l4proto(4),
                    th_dport(5),
                    lookup_vmap("service-ips", 0),
                ]),
                rule(vec![
                    ip6_daddr(0),
                    th_dport(4),
                    numgen_random(2, 5),
                    lookup_map("endpoints", 0, 0),
                    dnat(Family::Ip6, Some(0), Some(4)),
                ]),
                rule(vec![
                    ip6_daddr(0),
                    cmp(CmpOp::Neq, 0, &v6_bytes("::1")),
                    reject(RejectType::IcmpUnreach, 4),
                ]),
            ],
        )],
    };
    assert_eq!(
        render::table(&t),
        lines(&[
            "table ip6 splitproxy {",
            "\tset cluster-ips {",
            "\t\ttype ipv6_addr",
            "\t\telements = { fd00:10:96::1,",
            "\t\t\t     fd00:10:96::a }",
            "\t}",
            "",
            "\tmap service-ips {",
            "\t\ttype ipv6_addr . inet_proto . inet_service : verdict",
            "\t\telements = { fd00:10:96::a . udp . 53 : goto svc-dns }",
            "\t}",
            "",
            "\tmap endpoints {",
            "\t\ttype ipv6_addr . inet_service . integer : ipv6_addr . inet_service",
            "\t\telements = { fd00:10:96::a . 53 . 0 : fd00:10:244::5 . 53 }",
            "\t}",
            "",
            "\tchain services {",
            "\t\ttype nat hook output priority dstnat; policy accept;",
            "\t\tip6 saddr fd00:10:244::/64 return",
            "\t\tip6 daddr . meta l4proto . th dport vmap @service-ips",
            "\t\tdnat ip6 to ip6 daddr . th dport . numgen random mod 2 map @endpoints",
            "\t\tip6 daddr != ::1 reject",
            "\t}",
            "}",
        ])
    );
    // Without the table: the map's width is guessed from the nat family.
    assert_eq!(
        render::rule(&t.chains[0].rules[2]),
        "dnat ip6 to ip6 daddr . th dport . numgen random mod 2 map @endpoints"
    );
}

fn v6_bytes(s: &str) -> Vec<u8> {
    s.parse::<std::net::Ipv6Addr>().unwrap().octets().to_vec()
}

#[test]
fn intervals_and_timeouts() {
    let s = Set {
        interval: true,
        comment: "ranges".into(),
        ..set(
            "ranges",
            &[Ipv4Addr],
            &[],
            vec![
                Element {
                    key_end: vec![v4([10, 0, 0, 255])],
                    ..key(vec![v4([10, 0, 0, 0])])
                },
                Element {
                    key_end: vec![v4([10, 0, 1, 5])],
                    ..key(vec![v4([10, 0, 1, 1])])
                },
                key(vec![v4([10, 0, 2, 1])]),
                Element {
                    key_end: vec![v4([10, 0, 2, 2])],
                    ..key(vec![v4([10, 0, 2, 2])])
                },
                Element {
                    key_end: vec![v4([255, 255, 255, 255])],
                    ..key(vec![v4([0, 0, 0, 0])])
                },
            ],
        )
    };
    assert_eq!(
        render::set(&s),
        lines(&[
            "\tset ranges {",
            "\t\ttype ipv4_addr",
            "\t\tflags interval",
            "\t\tcomment \"ranges\"",
            "\t\telements = { 10.0.0.0/24, 10.0.1.1-10.0.1.5,",
            "\t\t\t     10.0.2.1, 10.0.2.2,",
            "\t\t\t     0.0.0.0/0 }",
            "\t}",
        ])
    );
    let ports = Set {
        interval: true,
        ..set(
            "nodeports",
            &[Ipv4Addr, InetProto, InetService],
            &[DataType::Verdict],
            vec![Element {
                key_end: vec![v4([10, 255, 255, 255]), proto(6), port(32767)],
                verdict: Some(vd(VerdictCode::Jump, "nodeports")),
                ..key(vec![v4([10, 0, 0, 0]), proto(6), port(30000)])
            }],
        )
    };
    assert_eq!(
        render::element(&ports, &ports.elements[0]),
        "10.0.0.0/8 . tcp . 30000-32767 : jump nodeports"
    );
    let v6set = set("r6", &[Ipv6Addr], &[], vec![]);
    let e = Element {
        key_end: vec![v6("fd00::ffff")],
        ..key(vec![v6("fd00::")])
    };
    assert_eq!(render::element(&v6set, &e), "fd00::/112");
    let e = Element {
        key_end: vec![v6("fd00::5")],
        ..key(vec![v6("fd00::1")])
    };
    assert_eq!(render::element(&v6set, &e), "fd00::1-fd00::5");

    // Timeouts: the flags line drops when `timeout` is its only flag and a default exists.
    let t = Set {
        timeout: true,
        default_timeout_ms: 10_800_000,
        ..set(
            "affinity",
            &[Ipv4Addr],
            &[],
            vec![
                Element {
                    timeout_ms: 3_723_500,
                    comment: "pinned".into(),
                    ..key(vec![v4([10, 0, 0, 1])])
                },
                key(vec![v4([10, 0, 0, 2])]),
            ],
        )
    };
    assert_eq!(
        render::set(&t),
        lines(&[
            "\tset affinity {",
            "\t\ttype ipv4_addr",
            "\t\ttimeout 3h",
            "\t\telements = { 10.0.0.1 timeout 1h2m3s500ms comment \"pinned\",",
            "\t\t\t     10.0.0.2 }",
            "\t}",
        ])
    );
    let t = Set {
        timeout: true,
        ..set("t", &[Ipv4Addr], &[], vec![])
    };
    assert_eq!(
        render::set(&t),
        "\tset t {\n\t\ttype ipv4_addr\n\t\tflags timeout\n\t}\n"
    );

    // A dynset with a timeout and data, into a map the renderer knows.
    let m = Set {
        dynamic: true,
        timeout: true,
        ..set("seen", &[Ipv4Addr, InetService], &[Mark], vec![])
    };
    let tbl = Table {
        family: Family::Ip as i32,
        sets: vec![m],
        ..Default::default()
    };
    let ctx = Context::of(&tbl);
    assert_eq!(
        render::rule_in(
            &ctx,
            &rule(vec![
                ip_saddr(0),
                th_dport(1),
                meta(MetaKey::Mark, 2),
                x(expr::Kind::Dynset(Dynset {
                    set: "seen".into(),
                    op: DynsetOp::Add as i32,
                    sreg_key: 0,
                    has_data: true,
                    sreg_data: 2,
                    timeout_ms: 60_000,
                })),
            ])
        ),
        "add @seen { ip saddr . th dport timeout 1m : meta mark }"
    );
}

#[test]
fn verdict_maps_and_number_lists() {
    let vmap = set(
        "dispatch",
        &[Integer],
        &[DataType::Verdict],
        vec![
            Element {
                verdict: Some(vd(VerdictCode::Accept, "")),
                ..key(vec![int(0)])
            },
            Element {
                verdict: Some(vd(VerdictCode::Drop, "")),
                ..key(vec![int(1)])
            },
            Element {
                verdict: Some(vd(VerdictCode::Return, "")),
                ..key(vec![int(2)])
            },
            Element {
                verdict: Some(vd(VerdictCode::Jump, "a")),
                ..key(vec![int(3)])
            },
        ],
    );
    assert_eq!(
        render::set(&vmap),
        lines(&[
            "\tmap dispatch {",
            "\t\ttype integer : verdict",
            "\t\telements = { 0 : accept,",
            "\t\t\t     1 : drop,",
            "\t\t\t     2 : return,",
            "\t\t\t     3 : jump a }",
            "\t}",
        ])
    );
    // Five numbers to a line, marks in hex.
    let marks = set(
        "marks",
        &[Mark],
        &[],
        (1..=7).map(|i| key(vec![int(i << 12)])).collect(),
    );
    assert_eq!(
        render::set(&marks),
        lines(&[
            "\tset marks {",
            "\t\ttype mark",
            "\t\telements = { 0x00001000, 0x00002000, 0x00003000, 0x00004000, 0x00005000,",
            "\t\t\t     0x00006000, 0x00007000 }",
            "\t}",
        ])
    );
    let ports = set(
        "ports",
        &[InetService],
        &[],
        vec![key(vec![port(80)]), key(vec![port(443)])],
    );
    assert_eq!(
        render::set(&ports),
        "\tset ports {\n\t\ttype inet_service\n\t\telements = { 80, 443 }\n\t}\n"
    );
    let protos = set(
        "p",
        &[InetProto],
        &[],
        vec![key(vec![proto(6)]), key(vec![proto(253)])],
    );
    assert_eq!(render::element(&protos, &protos.elements[1]), "253");
    // An inverted lookup and a vmap on numgen.
    let r = render::rule(&rule(vec![
        ip_daddr(0),
        lookup_not("cluster-ips", 0),
        verdict(VerdictCode::Drop, ""),
    ]));
    assert_eq!(r, "ip daddr != @cluster-ips drop");
    let r = render::rule(&rule(vec![numgen_random(4, 0), lookup_vmap("dispatch", 0)]));
    assert_eq!(r, "numgen random mod 4 vmap @dispatch");
    // A chain with a comment and a drop policy.
    let c = Chain {
        comment: "entry".into(),
        base: Some(BaseChain {
            hook: Hook::Input as i32,
            r#type: ChainType::Filter as i32,
            priority: 5,
            policy_drop: true,
        }),
        ..chain("in", None, vec![])
    };
    assert_eq!(
        render::chain(&c),
        "\tchain in {\n\t\tcomment \"entry\"\n\t\ttype filter hook input priority filter + 5; policy drop;\n\t}\n"
    );
}

#[test]
fn constants_in_concatenations_follow_the_set_types() {
    let tbl = Table {
        family: Family::Ip as i32,
        sets: vec![set("svc", &[Ipv4Addr, InetProto, InetService], &[], vec![])],
        ..Default::default()
    };
    let ctx = Context::of(&tbl);
    let r = render::rule_in(
        &ctx,
        &rule(vec![
            ip_daddr(0),
            imm(1, &[6]),
            imm(2, &[0, 53]),
            lookup("svc", 0),
        ]),
    );
    assert_eq!(r, "ip daddr . tcp . 53 @svc");
    // One immediate may carry several fields.
    let r = render::rule_in(
        &ctx,
        &rule(vec![
            ip_daddr(0),
            imm(1, &[17, 0, 0, 0, 0, 53, 0, 0]),
            lookup("svc", 0),
        ]),
    );
    assert_eq!(r, "ip daddr . udp . 53 @svc");
    // A register the rule never loaded.
    let r = render::rule_in(
        &ctx,
        &rule(vec![ip_daddr(0), th_dport(2), lookup("svc", 0)]),
    );
    assert_eq!(r, "ip daddr . reg 1 . th dport @svc");
}

/// Conntrack tuple fields print as nft lists them (checked against `nft list ruleset` in the
/// actuator's kernel test `kernel_ct_tuple_fields_load_and_match`).
#[test]
fn ct_tuple_fields() {
    use CtDirection::{Original, Reply};
    let tbl = Table {
        family: Family::Ip as i32,
        sets: vec![
            set(
                "flows",
                &[Ipv4Addr, Ipv4Addr, InetProto, InetService],
                &[],
                vec![],
            ),
            set("flows6", &[Ipv6Addr, InetService], &[], vec![]),
        ],
        ..Default::default()
    };
    let ctx = Context::of(&tbl);
    let r = |exprs: Vec<Expr>| render::rule_in(&ctx, &rule(exprs));
    assert_eq!(
        r(vec![
            ct_dir(CtKey::SrcIp, Original, 0),
            ct_dir(CtKey::DstIp, Original, 1),
            ct_dir(CtKey::Protocol, Original, 2),
            ct_dir(CtKey::ProtoDst, Original, 3),
            lookup("flows", 0),
            counter(),
        ]),
        // nft lists `ct original protocol` as `ct protocol`: the kernel keeps no direction for it.
        "ct original ip saddr . ct original ip daddr . ct protocol . ct original proto-dst @flows counter"
    );
    // An IPv6 address takes four registers: the port that follows starts at register 4.
    assert_eq!(
        r(vec![
            ct_dir(CtKey::DstIp6, Original, 0),
            ct_dir(CtKey::ProtoDst, Original, 4),
            lookup("flows6", 0),
        ]),
        "ct original ip6 daddr . ct original proto-dst @flows6"
    );
    // Constants follow the field's type.
    assert_eq!(
        r(vec![
            ct_dir(CtKey::Protocol, Original, 0),
            cmp(CmpOp::Eq, 0, &[17]),
            ct_dir(CtKey::ProtoDst, Original, 1),
            cmp(CmpOp::Eq, 1, &[0x14, 0xe9]),
            ct_dir(CtKey::SrcIp, Reply, 2),
            cmp(CmpOp::Neq, 2, &[10, 244, 1, 5]),
            ct_dir(CtKey::SrcIp6, Reply, 4),
            cmp(CmpOp::Eq, 4, &v6_bytes("fd00::5")),
            ct_dir(CtKey::ProtoSrc, Reply, 8),
            cmp(CmpOp::Eq, 8, &[0, 53]),
        ]),
        "ct protocol udp ct original proto-dst 5353 ct reply ip saddr != 10.244.1.5 \
         ct reply ip6 saddr fd00::5 ct reply proto-src 53"
    );
    assert_eq!(
        r(vec![ct(CtKey::Protocol, 0), cmp(CmpOp::Eq, 0, &[6])]),
        "ct protocol tcp"
    );
    // Without a direction (which the kernel refuses for address and port fields) nothing is
    // invented.
    assert_eq!(
        r(vec![ct(CtKey::DstIp, 0), cmp(CmpOp::Eq, 0, &[10, 0, 0, 1])]),
        "ct ip daddr 10.0.0.1"
    );
}

#[test]
fn registers_that_were_overwritten_or_never_loaded() {
    let r = |exprs: Vec<Expr>| render::rule(&rule(exprs));
    assert_eq!(r(vec![cmp(CmpOp::Eq, 3, &[1, 2])]), "reg 3 == 0x0102");
    // An ipv6 address spans four registers; overwriting its tail forgets it.
    assert_eq!(
        r(vec![ip6_daddr(0), l4proto(2), cmp(CmpOp::Eq, 0, &[0; 16])]),
        "reg 0 == 0x00000000000000000000000000000000"
    );
    // Reading the middle of a wide value.
    assert_eq!(
        r(vec![ip6_daddr(0), cmp(CmpOp::Eq, 1, &[0; 4])]),
        "reg 1 == 0x00000000"
    );
    // Writing over a head keeps a later head alive.
    assert_eq!(
        r(vec![
            ip6_daddr(0),
            ip_daddr(0),
            cmp(CmpOp::Eq, 0, &[1, 2, 3, 4])
        ]),
        "ip daddr 1.2.3.4"
    );
    assert_eq!(r(vec![lookup("nowhere", 7)]), "reg 7 @nowhere");
    assert_eq!(r(vec![meta_set(MetaKey::Mark, 9)]), "meta mark set reg 9");
}

/// Garbage never panics, and a rule stays on one line.
#[test]
fn garbage_does_not_panic() {
    let weird = vec![
        Expr { kind: None },
        payload(PayloadBase::Network, u32::MAX, u32::MAX, u32::MAX),
        payload(PayloadBase::Unspecified, 0, 0, 0),
        x(expr::Kind::Payload(Payload {
            base: 77,
            offset: 1,
            len: 3,
            dreg: 15,
        })),
        x(expr::Kind::Meta(Meta {
            key: 1234,
            dreg: 15,
            set: false,
            sreg: 0,
        })),
        x(expr::Kind::Meta(Meta {
            key: -1,
            dreg: 0,
            set: true,
            sreg: u32::MAX,
        })),
        x(expr::Kind::Ct(Ct {
            key: 99,
            dreg: 14,
            direction: 9,
        })),
        x(expr::Kind::Fib(Fib {
            flags: u32::MAX,
            result: 42,
            dreg: 13,
        })),
        x(expr::Kind::Cmp(Cmp {
            op: 99,
            sreg: 15,
            data: vec![],
        })),
        bitwise(15, 15, &[], &[1, 2, 3]),
        bitwise(100, 100, &[0xff; 64], &[]),
        x(expr::Kind::Lookup(Lookup {
            set: String::new(),
            sreg: u32::MAX,
            has_dreg: true,
            dreg: 15,
            verdict: false,
            invert: true,
        })),
        x(expr::Kind::Numgen(Numgen {
            r#type: 9,
            modulus: 0,
            offset: u32::MAX,
            dreg: 15,
        })),
        x(expr::Kind::Nat(Nat {
            r#type: 17,
            family: 99,
            has_addr: true,
            reg_addr: u32::MAX,
            has_proto: true,
            reg_proto: u32::MAX,
            flags: u32::MAX,
        })),
        x(expr::Kind::Reject(Reject {
            r#type: 55,
            code: u32::MAX,
        })),
        x(expr::Kind::Dynset(Dynset {
            set: "x".into(),
            op: 12,
            sreg_key: 40,
            has_data: true,
            sreg_data: u32::MAX,
            timeout_ms: u64::MAX,
        })),
        x(expr::Kind::Verdict(Verdict {
            code: 77,
            chain: String::new(),
        })),
        imm(15, &[0; 100]),
        imm(0, &[]),
        masquerade(u32::MAX),
    ];
    let text = render::rule(&rule(weird.clone()));
    assert!(!text.contains('\n'), "{text}");
    assert!(text.starts_with("unknown "), "{text}");
    assert!(text.contains("reject type 55 code 4294967295"), "{text}");
    assert!(text.contains("verdict 77"), "{text}");

    // The same through a table full of odd sets.
    let t = Table {
        family: 1234,
        name: String::new(),
        comment: "quote \" and\nnewline".into(),
        sets: vec![
            Set {
                name: "x".into(),
                key: vec![],
                data: vec![999, DataType::Ipv6Addr as i32],
                elements: vec![
                    Element::default(),
                    Element {
                        key: vec![Datum { value: None }, v4([1, 2, 3, 4])],
                        key_end: vec![v6("::1"), v4([1, 2, 3, 4]), v4([9, 9, 9, 9])],
                        data: vec![
                            int(1),
                            Datum {
                                value: Some(datum::Value::Ipv4(vec![1, 2])),
                            },
                            proto(1 << 20),
                        ],
                        verdict: None,
                        timeout_ms: u64::MAX,
                        comment: String::new(),
                    },
                ],
                default_timeout_ms: u64::MAX,
                ..Default::default()
            },
            set("", &[Ipv6Addr], &[], vec![key(vec![v4([1, 2, 3, 4])])]),
        ],
        chains: vec![
            Chain {
                name: "c".into(),
                base: Some(BaseChain {
                    hook: 99,
                    r#type: -5,
                    priority: i32::MAX,
                    policy_drop: false,
                }),
                comment: String::new(),
                rules: vec![rule(weird)],
            },
            Chain::default(),
        ],
    };
    let text = render::table(&t);
    assert!(
        text.starts_with("table unknown  {\n\tcomment \"quote \\\" and\\nnewline\"\n"),
        "{text}"
    );
    assert!(
        text.contains("type unknown hook unknown priority 2147483647; policy accept;"),
        "{text}"
    );
    assert!(text.ends_with("}\n"), "{text}");

    // Random IR: deterministic, never a panic, one line per rule.
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let sets = vec![
        set("a", &[Ipv4Addr, InetProto, InetService], &[Integer], vec![]),
        set("b", &[Integer], &[DataType::Verdict], vec![]),
        set("c", &[Ipv6Addr, Integer], &[Ipv6Addr, InetService], vec![]),
        set("d", &[], &[], vec![]),
    ];
    for family in [Family::Ip, Family::Ip6, Family::Inet, Family::Unspecified] {
        let ctx = Context::new(family as i32, &sets);
        for _ in 0..2000 {
            let n = rng.below(12);
            let exprs: Vec<Expr> = (0..n).map(|_| random_expr(&mut rng)).collect();
            let r = rule(exprs);
            let a = render::rule_in(&ctx, &r);
            assert_eq!(a, render::rule_in(&ctx, &r));
            assert!(!a.contains('\n'), "{a}");
            let _ = render::rule(&r);
        }
    }
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn reg(&mut self) -> u32 {
        // Mostly valid registers, sometimes not.
        if self.below(10) == 0 {
            self.next() as u32
        } else {
            self.below(17) as u32
        }
    }

    fn bytes(&mut self) -> Vec<u8> {
        let len = [0, 1, 2, 4, 8, 16, 17][self.below(7) as usize];
        (0..len).map(|_| self.next() as u8).collect()
    }

    fn small(&mut self) -> i32 {
        self.below(14) as i32 - 1
    }
}

fn random_expr(rng: &mut XorShift) -> Expr {
    let names = ["a", "b", "c", "d", "zz"];
    let kind = match rng.below(16) {
        0 => expr::Kind::Payload(Payload {
            base: rng.small(),
            offset: rng.below(30) as u32,
            len: [1, 2, 4, 16, 0, 300][rng.below(6) as usize],
            dreg: rng.reg(),
        }),
        1 => expr::Kind::Meta(Meta {
            key: rng.small(),
            dreg: rng.reg(),
            set: rng.below(3) == 0,
            sreg: rng.reg(),
        }),
        2 => expr::Kind::Ct(Ct {
            key: rng.small(),
            dreg: rng.reg(),
            direction: rng.below(4) as i32,
        }),
        3 => expr::Kind::Fib(Fib {
            flags: rng.next() as u32,
            result: rng.small(),
            dreg: rng.reg(),
        }),
        4 => expr::Kind::Cmp(Cmp {
            op: rng.small(),
            sreg: rng.reg(),
            data: rng.bytes(),
        }),
        5 => expr::Kind::Bitwise(Bitwise {
            sreg: rng.reg(),
            dreg: rng.reg(),
            mask: rng.bytes(),
            xor: rng.bytes(),
        }),
        6 => expr::Kind::Lookup(Lookup {
            set: names[rng.below(5) as usize].into(),
            sreg: rng.reg(),
            has_dreg: rng.below(2) == 0,
            dreg: rng.reg(),
            verdict: rng.below(3) == 0,
            invert: rng.below(4) == 0,
        }),
        7 => expr::Kind::Numgen(Numgen {
            r#type: rng.small(),
            modulus: rng.next() as u32,
            offset: rng.below(3) as u32,
            dreg: rng.reg(),
        }),
        8 => expr::Kind::Nat(Nat {
            r#type: rng.small(),
            family: [0, 1, 2, 10, 7][rng.below(5) as usize],
            has_addr: rng.below(2) == 0,
            reg_addr: rng.reg(),
            has_proto: rng.below(2) == 0,
            reg_proto: rng.reg(),
            flags: rng.next() as u32,
        }),
        9 => expr::Kind::Masquerade(Masquerade {
            flags: rng.next() as u32,
        }),
        10 => expr::Kind::Reject(Reject {
            r#type: rng.small(),
            code: rng.below(20) as u32,
        }),
        11 => expr::Kind::Dynset(Dynset {
            set: names[rng.below(5) as usize].into(),
            op: rng.small(),
            sreg_key: rng.reg(),
            has_data: rng.below(2) == 0,
            sreg_data: rng.reg(),
            timeout_ms: rng.next(),
        }),
        12 => expr::Kind::Counter(Counter {}),
        13 => expr::Kind::Verdict(Verdict {
            code: rng.small(),
            chain: "x".into(),
        }),
        14 => expr::Kind::Immediate(Immediate {
            dreg: rng.reg(),
            data: rng.bytes(),
        }),
        _ => return Expr { kind: None },
    };
    x(kind)
}
