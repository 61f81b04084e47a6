//! Small constructors for IR expressions, so that rule builders read like the nft rules they
//! produce. Byte orders follow the kernel: addresses and ports in network order, marks, ct bits
//! and integers in host order.
use std::net::IpAddr;

use splitproxy_proto::family::IpFamily;
use splitproxy_proto::v1::{
    self, Bitwise, Cmp, CmpOp, Ct, CtKey, Datum, Expr, Immediate, Lookup, Meta, MetaKey, Nat,
    NatType, Numgen, NumgenType, Payload, PayloadBase, Reject, RejectType, Verdict, VerdictCode,
    datum::Value, expr::Kind,
};

fn e(kind: Kind) -> Expr {
    Expr { kind: Some(kind) }
}

/// Registers (4 bytes each) an address of `family` takes: 1 or 4.
pub fn addr_regs(family: IpFamily) -> u32 {
    family.addr_len() / 4
}

/// `ip daddr` (or `ip6 daddr`) into `reg`.
pub fn daddr(family: IpFamily, reg: u32) -> Expr {
    let offset = match family {
        IpFamily::V4 => 16,
        IpFamily::V6 => 24,
    };
    payload(PayloadBase::Network, offset, family.addr_len(), reg)
}

/// `ip saddr` (or `ip6 saddr`) into `reg`.
pub fn saddr(family: IpFamily, reg: u32) -> Expr {
    let offset = match family {
        IpFamily::V4 => 12,
        IpFamily::V6 => 8,
    };
    payload(PayloadBase::Network, offset, family.addr_len(), reg)
}

/// `th dport` into `reg`.
pub fn dport(reg: u32) -> Expr {
    payload(PayloadBase::Transport, 2, 2, reg)
}

pub fn payload(base: PayloadBase, offset: u32, len: u32, dreg: u32) -> Expr {
    e(Kind::Payload(Payload {
        base: base as i32,
        offset,
        len,
        dreg,
    }))
}

pub fn meta(key: MetaKey, dreg: u32) -> Expr {
    e(Kind::Meta(Meta {
        key: key as i32,
        dreg,
        set: false,
        sreg: 0,
    }))
}

pub fn ct(key: CtKey, dreg: u32) -> Expr {
    e(Kind::Ct(Ct {
        key: key as i32,
        dreg,
        ..Default::default()
    }))
}

pub fn cmp(op: CmpOp, sreg: u32, data: Vec<u8>) -> Expr {
    e(Kind::Cmp(Cmp {
        op: op as i32,
        sreg,
        data,
    }))
}

pub fn bitwise(sreg: u32, dreg: u32, mask: Vec<u8>) -> Expr {
    let xor = vec![0; mask.len()];
    e(Kind::Bitwise(Bitwise {
        sreg,
        dreg,
        mask,
        xor,
    }))
}

/// `ct state new`.
pub fn ct_state_new() -> Vec<Expr> {
    const NEW: u32 = 8;
    vec![
        ct(CtKey::State, 0),
        bitwise(0, 0, NEW.to_ne_bytes().to_vec()),
        cmp(CmpOp::Neq, 0, 0u32.to_ne_bytes().to_vec()),
    ]
}

/// `ct status dnat`: the connection's destination was translated, through `reg`.
pub fn ct_status_dnat(reg: u32) -> Vec<Expr> {
    /// The kernel's `IPS_DST_NAT`.
    const DST_NAT: u32 = 1 << 5;
    vec![
        ct(CtKey::Status, reg),
        bitwise(reg, reg, DST_NAT.to_ne_bytes().to_vec()),
        cmp(CmpOp::Neq, reg, 0u32.to_ne_bytes().to_vec()),
    ]
}

/// `ip daddr PREFIX` as a mask and a compare.
pub fn daddr_in(net: ipnet::IpNet) -> Vec<Expr> {
    let (mask, addr) = match net {
        ipnet::IpNet::V4(n) => (n.netmask().octets().to_vec(), n.network().octets().to_vec()),
        ipnet::IpNet::V6(n) => (n.netmask().octets().to_vec(), n.network().octets().to_vec()),
    };
    vec![
        daddr(IpFamily::of_net(net), 0),
        bitwise(0, 0, mask),
        cmp(CmpOp::Eq, 0, addr),
    ]
}

/// `ip daddr . meta l4proto . th dport` into registers 0.. (ipv4: 0,1,2; ipv6: 0-3,4,5).
/// Returns the expressions and the first free register.
pub fn service_tuple(family: IpFamily) -> (Vec<Expr>, u32) {
    let a = addr_regs(family);
    (
        vec![daddr(family, 0), meta(MetaKey::L4proto, a), dport(a + 1)],
        a + 2,
    )
}

pub fn lookup(set: &str, sreg: u32) -> Expr {
    e(Kind::Lookup(Lookup {
        set: set.into(),
        sreg,
        ..Default::default()
    }))
}

pub fn lookup_map(set: &str, sreg: u32, dreg: u32) -> Expr {
    e(Kind::Lookup(Lookup {
        set: set.into(),
        sreg,
        has_dreg: true,
        dreg,
        ..Default::default()
    }))
}

pub fn vmap(set: &str, sreg: u32) -> Expr {
    e(Kind::Lookup(Lookup {
        set: set.into(),
        sreg,
        verdict: true,
        ..Default::default()
    }))
}

pub fn numgen_random(modulus: u32, dreg: u32) -> Expr {
    e(Kind::Numgen(Numgen {
        r#type: NumgenType::Random as i32,
        modulus,
        offset: 0,
        dreg,
    }))
}

pub fn dnat(family: IpFamily, reg_addr: u32, reg_proto: u32) -> Expr {
    e(Kind::Nat(Nat {
        r#type: NatType::Dnat as i32,
        family: v1::Family::from(family) as i32,
        has_addr: true,
        reg_addr,
        has_proto: true,
        reg_proto,
        flags: 0,
    }))
}

/// `reject` with ICMP (v6) port unreachable, which a TCP client sees as "connection refused".
pub fn reject(family: IpFamily) -> Expr {
    let code = match family {
        IpFamily::V4 => 3,
        IpFamily::V6 => 4,
    };
    e(Kind::Reject(Reject {
        r#type: RejectType::IcmpUnreach as i32,
        code,
    }))
}

/// `reject with tcp reset`.
pub fn reject_tcp_reset() -> Expr {
    e(Kind::Reject(Reject {
        r#type: RejectType::TcpRst as i32,
        code: 0,
    }))
}

pub fn verdict(code: VerdictCode, chain: &str) -> Expr {
    e(Kind::Verdict(Verdict {
        code: code as i32,
        chain: chain.into(),
    }))
}

pub fn jump(chain: &str) -> Expr {
    verdict(VerdictCode::Jump, chain)
}

pub fn goto(chain: &str) -> Verdict {
    Verdict {
        code: VerdictCode::Goto as i32,
        chain: chain.into(),
    }
}

pub fn drop() -> Expr {
    verdict(VerdictCode::Drop, "")
}

pub fn immediate(dreg: u32, data: Vec<u8>) -> Expr {
    e(Kind::Immediate(Immediate { dreg, data }))
}

pub fn ip(addr: IpAddr) -> Datum {
    match addr {
        IpAddr::V4(a) => Datum {
            value: Some(Value::Ipv4(a.octets().to_vec())),
        },
        IpAddr::V6(a) => Datum {
            value: Some(Value::Ipv6(a.octets().to_vec())),
        },
    }
}

pub fn proto(p: u8) -> Datum {
    Datum {
        value: Some(Value::Proto(p.into())),
    }
}

pub fn port(p: u16) -> Datum {
    Datum {
        value: Some(Value::Port(p.into())),
    }
}

pub fn int(v: u32) -> Datum {
    Datum {
        value: Some(Value::U32(v)),
    }
}

/// `meta mark set mark | bit` (as `(mark & !bit) ^ bit`), through `reg`.
pub fn mark_set_bit(bit: u32, reg: u32) -> Vec<Expr> {
    vec![
        meta(MetaKey::Mark, reg),
        e(Kind::Bitwise(Bitwise {
            sreg: reg,
            dreg: reg,
            mask: (!bit).to_ne_bytes().to_vec(),
            xor: bit.to_ne_bytes().to_vec(),
        })),
        meta_set(MetaKey::Mark, reg),
    ]
}

/// `meta mark & bit != 0` through `reg`.
pub fn mark_has_bit(bit: u32, reg: u32) -> Vec<Expr> {
    vec![
        meta(MetaKey::Mark, reg),
        bitwise(reg, reg, bit.to_ne_bytes().to_vec()),
        cmp(CmpOp::Neq, reg, 0u32.to_ne_bytes().to_vec()),
    ]
}

/// `meta mark set mark & !bit` through `reg`.
pub fn mark_clear_bit(bit: u32, reg: u32) -> Vec<Expr> {
    vec![
        meta(MetaKey::Mark, reg),
        bitwise(reg, reg, (!bit).to_ne_bytes().to_vec()),
        meta_set(MetaKey::Mark, reg),
    ]
}

pub fn meta_set(key: MetaKey, sreg: u32) -> Expr {
    e(Kind::Meta(Meta {
        key: key as i32,
        dreg: 0,
        set: true,
        sreg,
    }))
}

/// `fib saddr type local` (or `!= local` when `local` is false) through `reg`.
pub fn fib_saddr_local(local: bool, reg: u32) -> Vec<Expr> {
    const SADDR: u32 = 1;
    const RTN_LOCAL: u32 = 2;
    vec![
        e(Kind::Fib(v1::Fib {
            flags: SADDR,
            result: v1::FibResult::Addrtype as i32,
            dreg: reg,
        })),
        cmp(
            if local { CmpOp::Eq } else { CmpOp::Neq },
            reg,
            RTN_LOCAL.to_ne_bytes().to_vec(),
        ),
    ]
}

/// `ip saddr PREFIX` (`!=` when `inside` is false) through `reg`.
pub fn saddr_in(net: ipnet::IpNet, inside: bool, reg: u32) -> Vec<Expr> {
    let (mask, addr) = match net {
        ipnet::IpNet::V4(n) => (n.netmask().octets().to_vec(), n.network().octets().to_vec()),
        ipnet::IpNet::V6(n) => (n.netmask().octets().to_vec(), n.network().octets().to_vec()),
    };
    vec![
        saddr(IpFamily::of_net(net), reg),
        bitwise(reg, reg, mask),
        cmp(if inside { CmpOp::Eq } else { CmpOp::Neq }, reg, addr),
    ]
}

/// `iifname "PREFIX*"` (a prefix match) or, with `exact`, `iifname "NAME"`; negated when
/// `equal` is false.
pub fn iifname(name: &str, exact: bool, equal: bool, reg: u32) -> Vec<Expr> {
    let mut data = name.as_bytes().to_vec();
    if exact {
        data.push(0);
    }
    vec![
        meta(MetaKey::Iifname, reg),
        cmp(if equal { CmpOp::Eq } else { CmpOp::Neq }, reg, data),
    ]
}

/// A conntrack tuple field of the original direction.
pub fn ct_original(key: CtKey, dreg: u32) -> Expr {
    e(Kind::Ct(Ct {
        key: key as i32,
        dreg,
        direction: v1::CtDirection::Original as i32,
    }))
}

pub fn lookup_invert(set: &str, sreg: u32) -> Expr {
    e(Kind::Lookup(Lookup {
        set: set.into(),
        sreg,
        invert: true,
        ..Default::default()
    }))
}

/// `masquerade fully-random`.
pub fn masquerade() -> Expr {
    const FULLY_RANDOM: u32 = 16;
    e(Kind::Masquerade(v1::Masquerade {
        flags: FULLY_RANDOM,
    }))
}

/// `update @set { key : data } timeout T` with key and data from registers.
pub fn dynset_update(set: &str, sreg_key: u32, sreg_data: u32, timeout_ms: u64) -> Expr {
    e(Kind::Dynset(v1::Dynset {
        set: set.into(),
        op: v1::DynsetOp::Update as i32,
        sreg_key,
        has_data: true,
        sreg_data,
        timeout_ms,
    }))
}

pub fn accept() -> Expr {
    verdict(VerdictCode::Accept, "")
}
