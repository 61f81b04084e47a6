//! The names of the header and metadata fields a rule reads: payload offsets as `ip daddr` or
//! `th dport`, meta, ct and fib keys, ICMP codes and nat flags.
use crate::v1::{Family, FibResult, MetaKey, PayloadBase};

use super::values::Kind;

// NF_NAT_RANGE_* flags.
const NAT_RANGE_MAP_IPS: u32 = 1;
const NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
const NAT_RANGE_PROTO_RANDOM: u32 = 4;
const NAT_RANGE_PERSISTENT: u32 = 8;
const NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 16;

// NFTA_FIB_F_* flags.
const FIB_F_PRESENT: u32 = 32;

pub(super) fn icmp_code(code: u32) -> String {
    match code {
        0 => "net-unreachable".into(),
        1 => "host-unreachable".into(),
        2 => "prot-unreachable".into(),
        3 => "port-unreachable".into(),
        4 => "frag-needed".into(),
        9 => "net-prohibited".into(),
        10 => "host-prohibited".into(),
        13 => "admin-prohibited".into(),
        c => c.to_string(),
    }
}

pub(super) fn icmpv6_code(code: u32) -> String {
    match code {
        0 => "no-route".into(),
        1 => "admin-prohibited".into(),
        3 => "addr-unreachable".into(),
        4 => "port-unreachable".into(),
        5 => "policy-fail".into(),
        6 => "reject-route".into(),
        c => c.to_string(),
    }
}

/// ` random,fully-random,persistent` as nft prints NAT flags; the bits the encoder derives
/// (map-ips, proto-specified) are left out, unknown bits print in hex.
pub(super) fn nat_flags(flags: u32) -> String {
    let mut parts = Vec::new();
    if flags & NAT_RANGE_PROTO_RANDOM != 0 {
        parts.push("random".to_string());
    }
    if flags & NAT_RANGE_PROTO_RANDOM_FULLY != 0 {
        parts.push("fully-random".to_string());
    }
    if flags & NAT_RANGE_PERSISTENT != 0 {
        parts.push("persistent".to_string());
    }
    let known = NAT_RANGE_MAP_IPS
        | NAT_RANGE_PROTO_SPECIFIED
        | NAT_RANGE_PROTO_RANDOM
        | NAT_RANGE_PROTO_RANDOM_FULLY
        | NAT_RANGE_PERSISTENT;
    if flags & !known != 0 {
        parts.push(format!("0x{:x}", flags & !known));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" {}", parts.join(","))
    }
}

/// The nft name and type of a header field, `@nh,OFFSET,LEN` (in bits) when it has none.
pub(super) fn payload_name(
    family: Option<Family>,
    base: i32,
    offset: u32,
    len: u32,
) -> (String, Kind) {
    let ip4 = !matches!(family, Some(Family::Ip6));
    let ip6 = !matches!(family, Some(Family::Ip));
    let named = match PayloadBase::try_from(base) {
        Ok(PayloadBase::Network) => match (offset, len) {
            (12, 4) if ip4 => Some(("ip saddr", Kind::Ipv4)),
            (16, 4) if ip4 => Some(("ip daddr", Kind::Ipv4)),
            (9, 1) if ip4 => Some(("ip protocol", Kind::L4Proto)),
            (8, 1) if ip4 => Some(("ip ttl", Kind::IntBe)),
            (2, 2) if ip4 => Some(("ip length", Kind::IntBe)),
            (4, 2) if ip4 => Some(("ip id", Kind::IntBe)),
            (8, 16) if ip6 => Some(("ip6 saddr", Kind::Ipv6)),
            (24, 16) if ip6 => Some(("ip6 daddr", Kind::Ipv6)),
            (6, 1) if ip6 => Some(("ip6 nexthdr", Kind::L4Proto)),
            (7, 1) if ip6 => Some(("ip6 hoplimit", Kind::IntBe)),
            (4, 2) if ip6 => Some(("ip6 length", Kind::IntBe)),
            _ => None,
        },
        Ok(PayloadBase::Transport) => match (offset, len) {
            (0, 2) => Some(("th sport", Kind::Port)),
            (2, 2) => Some(("th dport", Kind::Port)),
            _ => None,
        },
        _ => None,
    };
    if let Some((name, kind)) = named {
        return (name.to_string(), kind);
    }
    let base = match PayloadBase::try_from(base) {
        Ok(PayloadBase::Link) => "ll".to_string(),
        Ok(PayloadBase::Network) => "nh".to_string(),
        Ok(PayloadBase::Transport) => "th".to_string(),
        _ => format!("base{base}"),
    };
    (
        format!("@{base},{},{}", u64::from(offset) * 8, u64::from(len) * 8),
        Kind::RawBe,
    )
}

/// The nft name, value type and length in bytes of a meta key.
pub(super) fn meta_info(key: i32) -> (String, Kind, usize) {
    let (name, kind, len) = match MetaKey::try_from(key) {
        Ok(MetaKey::Len) => ("meta length", Kind::Int, 4),
        Ok(MetaKey::Protocol) => ("meta protocol", Kind::EtherType, 2),
        Ok(MetaKey::Mark) => ("meta mark", Kind::Mark, 4),
        Ok(MetaKey::Iif) => ("iif", Kind::IfIndex, 4),
        Ok(MetaKey::Oif) => ("oif", Kind::IfIndex, 4),
        Ok(MetaKey::Iifname) => ("iifname", Kind::IfName, 16),
        Ok(MetaKey::Oifname) => ("oifname", Kind::IfName, 16),
        Ok(MetaKey::Nfproto) => ("meta nfproto", Kind::NfProto, 1),
        Ok(MetaKey::L4proto) => ("meta l4proto", Kind::L4Proto, 1),
        Ok(MetaKey::Pkttype) => ("meta pkttype", Kind::PktType, 1),
        _ => return (format!("meta key {key}"), Kind::Raw, 4),
    };
    (name.to_string(), kind, len)
}

/// `fib saddr . iif type` and the type and length of its result.
pub(super) fn fib_info(flags: u32, result: i32) -> (String, Kind, usize) {
    const FLAGS: [(u32, &str); 5] = [
        (1, "saddr"),
        (2, "daddr"),
        (4, "mark"),
        (8, "iif"),
        (16, "oif"),
    ];
    let mut parts: Vec<String> = Vec::new();
    let mut rest = flags & !FIB_F_PRESENT;
    for (bit, name) in FLAGS {
        if rest & bit != 0 {
            parts.push(name.to_string());
            rest &= !bit;
        }
    }
    if rest != 0 {
        parts.push(format!("0x{rest:x}"));
    }
    let (res, kind, len) = match FibResult::try_from(result) {
        Ok(FibResult::Oif) => ("oif".to_string(), Kind::IfIndex, 4),
        Ok(FibResult::Oifname) => ("oifname".to_string(), Kind::IfName, 16),
        Ok(FibResult::Addrtype) => ("type".to_string(), Kind::FibAddrType, 4),
        _ => (format!("result {result}"), Kind::Raw, 4),
    };
    let (kind, len) = if flags & FIB_F_PRESENT != 0 {
        (Kind::Bool, 1)
    } else {
        (kind, len)
    };
    let mut text = String::from("fib ");
    if !parts.is_empty() {
        text.push_str(&parts.join(" . "));
        text.push(' ');
    }
    text.push_str(&res);
    (text, kind, len)
}
