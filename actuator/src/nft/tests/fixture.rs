//! The ruleset the brain produces, as IR: table `ip splitproxy` with its sets, maps, base
//! chains and rules, and a few elements. Shared by the round-trip and the kernel tests.

use splitproxy_proto::v1::{
    BaseChain, Bitwise, Chain, ChainType, Cmp, CmpOp, Counter, Ct, CtKey, DataType, Dynset,
    DynsetOp, Element, Expr, Family, Fib, FibResult, Hook, Immediate, Lookup, Masquerade, Meta,
    MetaKey, Nat, NatType, Numgen, NumgenType, Payload, PayloadBase, Reject, RejectType, Rule, Set,
    Table, Verdict, VerdictCode, expr::Kind,
};

use crate::nft::datum::tests::{int, ip4, port, proto};
use crate::nft::{Batch, EncodeError};

pub(crate) const TABLE: &str = "splitproxy";
pub(crate) const TCP: u32 = 6;
pub(crate) const UDP: u32 = 17;

fn e(kind: Kind) -> Expr {
    Expr { kind: Some(kind) }
}

pub(crate) fn payload(base: PayloadBase, offset: u32, len: u32, dreg: u32) -> Expr {
    e(Kind::Payload(Payload {
        base: base as i32,
        offset,
        len,
        dreg,
    }))
}

pub(crate) fn ip_daddr(dreg: u32) -> Expr {
    payload(PayloadBase::Network, 16, 4, dreg)
}

pub(crate) fn th_dport(dreg: u32) -> Expr {
    payload(PayloadBase::Transport, 2, 2, dreg)
}

pub(crate) fn meta(key: MetaKey, dreg: u32) -> Expr {
    e(Kind::Meta(Meta {
        key: key as i32,
        dreg,
        set: false,
        sreg: 0,
    }))
}

pub(crate) fn cmp(op: CmpOp, sreg: u32, data: &[u8]) -> Expr {
    e(Kind::Cmp(Cmp {
        op: op as i32,
        sreg,
        data: data.to_vec(),
    }))
}

pub(crate) fn lookup(set: &str, sreg: u32) -> Lookup {
    Lookup {
        set: set.to_owned(),
        sreg,
        ..Lookup::default()
    }
}

pub(crate) fn verdict(code: VerdictCode, chain: &str) -> Verdict {
    Verdict {
        code: code as i32,
        chain: chain.to_owned(),
    }
}

pub(crate) fn jump(chain: &str) -> Rule {
    Rule {
        exprs: vec![e(Kind::Verdict(verdict(VerdictCode::Jump, chain)))],
        comment: String::new(),
    }
}

/// ip daddr . meta l4proto . th dport into registers 0, 1, 2.
fn service_key() -> Vec<Expr> {
    vec![ip_daddr(0), meta(MetaKey::L4proto, 1), th_dport(2)]
}

/// `ip daddr . meta l4proto . th dport map @service-ips vmap @service-dispatch`.
pub(crate) fn services_rule() -> Rule {
    let mut exprs = service_key();
    exprs.push(e(Kind::Lookup(Lookup {
        has_dreg: true,
        dreg: 3,
        ..lookup("service-ips", 0)
    })));
    exprs.push(e(Kind::Lookup(Lookup {
        verdict: true,
        ..lookup("service-dispatch", 3)
    })));
    Rule {
        exprs,
        comment: "dispatch to the service's endpoints".to_owned(),
    }
}

/// `dnat ip to ip daddr . meta l4proto . th dport . numgen random mod N map @service-endpoints`.
pub(crate) fn endpoints_rule(n: u32) -> Rule {
    let mut exprs = service_key();
    exprs.push(e(Kind::Numgen(Numgen {
        r#type: NumgenType::Random as i32,
        modulus: n,
        offset: 0,
        dreg: 3,
    })));
    exprs.push(e(Kind::Lookup(Lookup {
        has_dreg: true,
        dreg: 0,
        ..lookup("service-endpoints", 0)
    })));
    exprs.push(e(Kind::Nat(Nat {
        r#type: NatType::Dnat as i32,
        family: Family::Ip as i32,
        has_addr: true,
        reg_addr: 0,
        has_proto: true,
        reg_proto: 1,
        flags: 0,
    })));
    Rule {
        exprs,
        comment: String::new(),
    }
}

/// `ct state new ip daddr . meta l4proto . th dport @no-endpoint-services reject`.
pub(crate) fn no_endpoints_rule() -> Rule {
    let mut exprs = vec![
        e(Kind::Ct(Ct {
            key: CtKey::State as i32,
            dreg: 0,
        })),
        e(Kind::Bitwise(Bitwise {
            sreg: 0,
            dreg: 0,
            mask: 8u32.to_ne_bytes().to_vec(), // NF_CT_STATE_BIT(IP_CT_NEW)
            xor: vec![0; 4],
        })),
        cmp(CmpOp::Neq, 0, &[0; 4]),
    ];
    exprs.extend(service_key());
    exprs.push(e(Kind::Lookup(lookup("no-endpoint-services", 0))));
    exprs.push(e(Kind::Reject(Reject {
        r#type: RejectType::IcmpUnreach as i32,
        code: 3,
    })));
    Rule {
        exprs,
        comment: "services without endpoints".to_owned(),
    }
}

/// `ip daddr & 255.255.255.0 == 203.0.113.0 counter drop`.
pub(crate) fn drop_rule() -> Rule {
    Rule {
        exprs: vec![
            ip_daddr(0),
            e(Kind::Bitwise(Bitwise {
                sreg: 0,
                dreg: 0,
                mask: vec![255, 255, 255, 0],
                xor: vec![0; 4],
            })),
            cmp(CmpOp::Eq, 0, &[203, 0, 113, 0]),
            e(Kind::Counter(Counter {})),
            e(Kind::Verdict(verdict(VerdictCode::Drop, ""))),
        ],
        comment: String::new(),
    }
}

/// `update @affinity { ip saddr }` then `meta mark set 0x40`.
pub(crate) fn affinity_rule() -> Rule {
    Rule {
        exprs: vec![
            payload(PayloadBase::Network, 12, 4, 0),
            e(Kind::Dynset(Dynset {
                set: "affinity".to_owned(),
                op: DynsetOp::Update as i32,
                sreg_key: 0,
                has_data: false,
                sreg_data: 0,
                timeout_ms: 10_800_000,
            })),
            e(Kind::Immediate(Immediate {
                dreg: 4,
                data: 0x40u32.to_ne_bytes().to_vec(),
            })),
            e(Kind::Meta(Meta {
                key: MetaKey::Mark as i32,
                dreg: 0,
                set: true,
                sreg: 4,
            })),
        ],
        comment: String::new(),
    }
}

/// `fib daddr type local jump nodeports`.
pub(crate) fn nodeports_rule() -> Rule {
    Rule {
        exprs: vec![
            e(Kind::Fib(Fib {
                flags: 2, // NFTA_FIB_F_DADDR
                result: FibResult::Addrtype as i32,
                dreg: 0,
            })),
            cmp(CmpOp::Eq, 0, &2u32.to_ne_bytes()), // RTN_LOCAL
            e(Kind::Verdict(verdict(VerdictCode::Jump, "nodeports"))),
        ],
        comment: String::new(),
    }
}

/// `meta mark & 0x4000 != 0 masquerade fully-random`.
pub(crate) fn masquerade_rule() -> Rule {
    Rule {
        exprs: vec![
            meta(MetaKey::Mark, 0),
            e(Kind::Bitwise(Bitwise {
                sreg: 0,
                dreg: 0,
                mask: 0x4000u32.to_ne_bytes().to_vec(),
                xor: vec![0; 4],
            })),
            cmp(CmpOp::Neq, 0, &[0; 4]),
            e(Kind::Masquerade(Masquerade { flags: 16 })),
        ],
        comment: String::new(),
    }
}

fn set(name: &str, key: &[DataType], data: &[DataType], elements: Vec<Element>) -> Set {
    Set {
        name: name.to_owned(),
        key: key.iter().map(|t| *t as i32).collect(),
        data: data.iter().map(|t| *t as i32).collect(),
        elements,
        ..Set::default()
    }
}

pub(crate) fn key(addr: [u8; 4], p: u32, dport: u32) -> Vec<splitproxy_proto::v1::Datum> {
    vec![ip4(addr), proto(p), port(dport)]
}

pub(crate) fn endpoint(
    addr: [u8; 4],
    p: u32,
    dport: u32,
    slot: u32,
    to: [u8; 4],
    to_port: u32,
) -> Element {
    let mut k = key(addr, p, dport);
    k.push(int(slot));
    Element {
        key: k,
        data: vec![ip4(to), port(to_port)],
        ..Element::default()
    }
}

pub(crate) fn service_ip(addr: [u8; 4], p: u32, dport: u32, endpoints: u32) -> Element {
    Element {
        key: key(addr, p, dport),
        data: vec![int(endpoints)],
        ..Element::default()
    }
}

/// The sets and maps, with a few elements.
pub(crate) fn sets() -> Vec<Set> {
    use DataType::*;
    let service = [Ipv4Addr, InetProto, InetService];
    vec![
        set(
            "cluster-ips",
            &[Ipv4Addr],
            &[],
            vec![
                Element {
                    key: vec![ip4([10, 96, 0, 1])],
                    ..Element::default()
                },
                Element {
                    key: vec![ip4([10, 96, 0, 10])],
                    comment: "kube-system/kube-dns".to_owned(),
                    ..Element::default()
                },
            ],
        ),
        set(
            "no-endpoint-services",
            &service,
            &[],
            vec![Element {
                key: key([10, 96, 0, 99], TCP, 80),
                ..Element::default()
            }],
        ),
        set(
            "service-ips",
            &service,
            &[Integer],
            vec![
                service_ip([10, 96, 0, 1], TCP, 443, 2),
                service_ip([10, 96, 0, 10], UDP, 53, 1),
            ],
        ),
        set(
            "service-dispatch",
            &[Integer],
            &[Verdict],
            vec![
                Element {
                    key: vec![int(1)],
                    verdict: Some(verdict(VerdictCode::Goto, "endpoints-1")),
                    ..Element::default()
                },
                Element {
                    key: vec![int(2)],
                    verdict: Some(verdict(VerdictCode::Goto, "endpoints-2")),
                    ..Element::default()
                },
            ],
        ),
        set(
            "service-endpoints",
            &[Ipv4Addr, InetProto, InetService, Integer],
            &[Ipv4Addr, InetService],
            vec![
                endpoint([10, 96, 0, 1], TCP, 443, 0, [10, 244, 1, 5], 6443),
                endpoint([10, 96, 0, 1], TCP, 443, 1, [10, 244, 2, 7], 6443),
                endpoint([10, 96, 0, 10], UDP, 53, 0, [10, 244, 0, 3], 53),
            ],
        ),
        Set {
            timeout: true,
            dynamic: true,
            default_timeout_ms: 10_800_000,
            ..set("affinity", &[Ipv4Addr], &[], vec![])
        },
    ]
}

fn base(name: &str, hook: Hook, ty: ChainType, priority: i32, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.to_owned(),
        base: Some(BaseChain {
            hook: hook as i32,
            r#type: ty as i32,
            priority,
            policy_drop: false,
        }),
        comment: String::new(),
        rules,
    }
}

fn regular(name: &str, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.to_owned(),
        base: None,
        comment: String::new(),
        rules,
    }
}

/// Base chains, each jumping to a regular chain, and the regular chains.
pub(crate) fn chains() -> Vec<Chain> {
    use ChainType::{Filter, Nat};
    vec![
        regular("services", vec![services_rule()]),
        regular("endpoints-1", vec![endpoints_rule(1)]),
        regular("endpoints-2", vec![endpoints_rule(2)]),
        regular("nodeports", vec![]),
        regular(
            "filter-services",
            vec![no_endpoints_rule(), drop_rule(), affinity_rule()],
        ),
        base(
            "nat-prerouting",
            Hook::Prerouting,
            Nat,
            -100,
            vec![jump("services"), nodeports_rule()],
        ),
        base(
            "nat-output",
            Hook::Output,
            Nat,
            -100,
            vec![jump("services")],
        ),
        base(
            "nat-postrouting",
            Hook::Postrouting,
            Nat,
            100,
            vec![masquerade_rule()],
        ),
        base(
            "filter-forward",
            Hook::Forward,
            Filter,
            -110,
            vec![jump("filter-services")],
        ),
        base(
            "filter-input",
            Hook::Input,
            Filter,
            -110,
            vec![jump("filter-services")],
        ),
        base(
            "filter-output",
            Hook::Output,
            Filter,
            -110,
            vec![jump("filter-services")],
        ),
    ]
}

pub(crate) fn table() -> Table {
    Table {
        family: Family::Ip as i32,
        name: TABLE.to_owned(),
        comment: "managed by splitproxy".to_owned(),
        chains: chains(),
        sets: sets(),
    }
}

/// Adds a whole table in dependency order: table, sets, chains, elements (vmap elements name
/// chains), rules (rules name sets and chains).
pub(crate) fn add_table(batch: &mut Batch, t: &Table) -> Result<(), EncodeError> {
    let family = t.family();
    batch.add_table(family, &t.name, &t.comment);
    for s in &t.sets {
        batch.add_set(family, &t.name, s)?;
    }
    for c in &t.chains {
        batch.add_chain(family, &t.name, c);
    }
    for s in &t.sets {
        batch.add_elements(family, &t.name, s, &s.elements)?;
    }
    for c in &t.chains {
        for r in &c.rules {
            batch.add_rule(family, &t.name, &c.name, r)?;
        }
    }
    Ok(())
}
