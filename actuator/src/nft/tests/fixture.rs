//! The ruleset the brain produces, as IR: table `ip splitproxy` with its sets, maps, base
//! chains and rules, and a few elements, in the shape of `brain/src/rules/mod.rs`:
//!
//! ```text
//! services:                one rule per endpoint count N:
//!                          ip daddr . meta l4proto . th dport @service-ports-N
//!                            dnat ip to ip daddr . meta l4proto . th dport . numgen random mod N map @service-endpoints
//! service-endpoints-check: ip daddr . meta l4proto . th dport @no-endpoint-services
//!                            (meta l4proto tcp reject with tcp reset | reject)
//! cluster-ips-check:       ip daddr @cluster-ips (meta l4proto tcp reject with tcp reset | reject),
//!                          ip daddr SERVICE-CIDR drop
//! base chains:             jump services (nat), ct state new jump ...-check (filter)
//! ```
//!
//! Plus expressions the brain does not use yet, for coverage: a verdict map with goto and drop
//! elements, fib, dynset with timeout, meta mark set, masquerade, counter.
//! Shared by the round-trip, cross-check and kernel tests.

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

/// `ip daddr . meta l4proto . th dport @service-ports-N dnat ip to ip daddr . meta l4proto .
/// th dport . numgen random mod N map @service-endpoints`: match the Service port in the set of
/// ports with N endpoints, pick a slot at random, DNAT to the endpoint in that slot.
pub(crate) fn dnat_rule(n: u32) -> Rule {
    let mut exprs = service_key();
    exprs.push(e(Kind::Lookup(lookup(&format!("service-ports-{n}"), 0))));
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
        comment: "dispatch to the service's endpoints".to_owned(),
    }
}

/// The rule of the `services` chain for Service ports with two endpoints.
pub(crate) fn services_rule() -> Rule {
    dnat_rule(2)
}

/// `meta l4proto tcp reject with tcp reset` after `matched` when `tcp`, else `reject` (ICMP
/// port unreachable), as the brain refuses connections. `meta l4proto` is in register 1.
fn refuse(mut exprs: Vec<Expr>, tcp: bool, comment: &str) -> Rule {
    if tcp {
        exprs.push(cmp(CmpOp::Eq, 1, &[6]));
        exprs.push(e(Kind::Reject(Reject {
            r#type: RejectType::TcpRst as i32,
            code: 0,
        })));
    } else {
        exprs.push(e(Kind::Reject(Reject {
            r#type: RejectType::IcmpUnreach as i32,
            code: 3,
        })));
    }
    Rule {
        exprs,
        comment: comment.to_owned(),
    }
}

/// `ip daddr . meta l4proto . th dport @no-endpoint-services [meta l4proto tcp reject with
/// tcp reset | reject]`.
pub(crate) fn no_endpoints_rule(tcp: bool) -> Rule {
    let mut exprs = service_key();
    exprs.push(e(Kind::Lookup(lookup("no-endpoint-services", 0))));
    refuse(exprs, tcp, "Reject traffic to Services without endpoints")
}

/// `ip daddr @cluster-ips [meta l4proto tcp reject with tcp reset | reject]`.
pub(crate) fn unknown_port_rule(tcp: bool) -> Rule {
    let exprs = vec![
        ip_daddr(0),
        e(Kind::Lookup(lookup("cluster-ips", 0))),
        meta(MetaKey::L4proto, 1),
    ];
    refuse(exprs, tcp, "Reject traffic to invalid ports of ClusterIPs")
}

/// `ct state new jump CHAIN`, the brain's filter base chain rule.
pub(crate) fn ct_new_jump(chain: &str) -> Rule {
    Rule {
        exprs: vec![
            e(Kind::Ct(Ct {
                key: CtKey::State as i32,
                dreg: 0,
                ..Ct::default()
            })),
            e(Kind::Bitwise(Bitwise {
                sreg: 0,
                dreg: 0,
                mask: 8u32.to_ne_bytes().to_vec(), // NF_CT_STATE_BIT(IP_CT_NEW)
                xor: vec![0; 4],
            })),
            cmp(CmpOp::Neq, 0, &[0; 4]),
            e(Kind::Verdict(verdict(VerdictCode::Jump, chain))),
        ],
        comment: String::new(),
    }
}

/// `meta l4proto . th dport vmap @nodeport-dispatch`.
pub(crate) fn nodeport_dispatch_rule() -> Rule {
    Rule {
        exprs: vec![
            meta(MetaKey::L4proto, 0),
            th_dport(1),
            e(Kind::Lookup(Lookup {
                verdict: true,
                ..lookup("nodeport-dispatch", 0)
            })),
        ],
        comment: String::new(),
    }
}

/// `ip daddr 10.96.0.0/16 counter drop`: unallocated addresses of the service CIDR (the brain
/// has no counter; the fixture adds one for coverage).
pub(crate) fn drop_rule() -> Rule {
    Rule {
        exprs: vec![
            ip_daddr(0),
            e(Kind::Bitwise(Bitwise {
                sreg: 0,
                dreg: 0,
                mask: vec![255, 255, 0, 0],
                xor: vec![0; 4],
            })),
            cmp(CmpOp::Eq, 0, &[10, 96, 0, 0]),
            e(Kind::Counter(Counter {})),
            e(Kind::Verdict(verdict(VerdictCode::Drop, ""))),
        ],
        comment: "Drop traffic to unallocated ClusterIPs".to_owned(),
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

/// A Service port element of `no-endpoint-services` or `service-ports-N`.
pub(crate) fn service_port(addr: [u8; 4], p: u32, dport: u32, comment: &str) -> Element {
    Element {
        key: key(addr, p, dport),
        comment: comment.to_owned(),
        ..Element::default()
    }
}

/// The sets and maps, with a few elements: kubernetes (2 endpoints), kube-dns (UDP and TCP,
/// one endpoint), a Service without endpoints.
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
                Element {
                    key: vec![ip4([10, 96, 0, 99])],
                    ..Element::default()
                },
            ],
        ),
        set(
            "no-endpoint-services",
            &service,
            &[],
            vec![service_port([10, 96, 0, 99], TCP, 80, "default/idle:http")],
        ),
        set(
            "service-ports-1",
            &service,
            &[],
            vec![
                service_port([10, 96, 0, 10], UDP, 53, "kube-system/kube-dns:dns"),
                service_port([10, 96, 0, 10], TCP, 53, "kube-system/kube-dns:dns-tcp"),
            ],
        ),
        set(
            "service-ports-2",
            &service,
            &[],
            vec![service_port(
                [10, 96, 0, 1],
                TCP,
                443,
                "default/kubernetes:https",
            )],
        ),
        set(
            "service-endpoints",
            &[Ipv4Addr, InetProto, InetService, Integer],
            &[Ipv4Addr, InetService],
            vec![
                endpoint([10, 96, 0, 1], TCP, 443, 0, [10, 244, 1, 5], 6443),
                endpoint([10, 96, 0, 1], TCP, 443, 1, [10, 244, 2, 7], 6443),
                endpoint([10, 96, 0, 10], UDP, 53, 0, [10, 244, 0, 3], 53),
                endpoint([10, 96, 0, 10], TCP, 53, 0, [10, 244, 0, 3], 53),
            ],
        ),
        set(
            "nodeport-dispatch",
            &[InetProto, InetService],
            &[Verdict],
            vec![
                Element {
                    key: vec![proto(TCP), port(30443)],
                    verdict: Some(verdict(VerdictCode::Goto, "services")),
                    ..Element::default()
                },
                Element {
                    key: vec![proto(UDP), port(30053)],
                    verdict: Some(verdict(VerdictCode::Drop, "")),
                    ..Element::default()
                },
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

/// Base chains, jumping to regular chains, and the regular chains.
pub(crate) fn chains() -> Vec<Chain> {
    use ChainType::{Filter, Nat};
    vec![
        regular("services", vec![dnat_rule(1), dnat_rule(2)]),
        regular(
            "service-endpoints-check",
            vec![no_endpoints_rule(true), no_endpoints_rule(false)],
        ),
        regular(
            "cluster-ips-check",
            vec![
                unknown_port_rule(true),
                unknown_port_rule(false),
                drop_rule(),
            ],
        ),
        regular("nodeports", vec![affinity_rule(), nodeport_dispatch_rule()]),
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
            vec![
                ct_new_jump("service-endpoints-check"),
                ct_new_jump("cluster-ips-check"),
            ],
        ),
        base(
            "filter-input",
            Hook::Input,
            Filter,
            -110,
            vec![ct_new_jump("service-endpoints-check")],
        ),
        base(
            "filter-output",
            Hook::Output,
            Filter,
            -110,
            vec![ct_new_jump("service-endpoints-check")],
        ),
        base(
            "filter-output-post-dnat",
            Hook::Output,
            Filter,
            -90,
            vec![ct_new_jump("cluster-ips-check")],
        ),
    ]
}

/// The rules of fixture chain `name`.
pub(crate) fn rules_of(name: &str) -> Vec<Rule> {
    chains()
        .into_iter()
        .find(|c| c.name == name)
        .map(|c| c.rules)
        .unwrap_or_else(|| panic!("no fixture chain {name}"))
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
