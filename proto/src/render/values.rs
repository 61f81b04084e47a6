//! How constants print after the type of what they are compared with: addresses, ports,
//! protocols, marks, flag words (`ct state`, `ct status`), masks as prefixes and raw bytes.
use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

use crate::v1::{self, CtDirection, CtKey, DataType};

use super::objects::quoted;
use super::registers::NREGS;

/// The nft datatype of what a register holds, which decides how constants print.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Ipv4,
    Ipv6,
    L4Proto,
    /// Transport port, network byte order.
    Port,
    /// Packet or conntrack mark, host byte order, printed 0x%08x.
    Mark,
    /// Integer in host byte order (meta length, numgen, set integers).
    Int,
    /// Integer in network byte order, printed in decimal (`ip ttl`).
    IntBe,
    /// Raw header bits (`@nh,...`), printed in hex as nft does.
    RawBe,
    CtState,
    CtStatus,
    FibAddrType,
    IfIndex,
    IfName,
    EtherType,
    NfProto,
    PktType,
    Bool,
    /// Unknown: the bytes in hex.
    Raw,
}

impl Kind {
    pub(super) fn of_data_type(t: i32) -> Kind {
        match DataType::try_from(t) {
            Ok(DataType::Integer) => Kind::Int,
            Ok(DataType::Ipv4Addr) => Kind::Ipv4,
            Ok(DataType::Ipv6Addr) => Kind::Ipv6,
            Ok(DataType::InetProto) => Kind::L4Proto,
            Ok(DataType::InetService) => Kind::Port,
            Ok(DataType::Mark) => Kind::Mark,
            _ => Kind::Raw,
        }
    }

    pub(super) fn is_bitmask(self) -> bool {
        matches!(self, Kind::CtState | Kind::CtStatus)
    }
}

/// Registers a field of a set key or data takes: each field of a concatenation is padded to
/// whole registers.
pub(super) fn data_type_regs(t: i32) -> usize {
    match DataType::try_from(t) {
        Ok(DataType::Ipv6Addr) => 4,
        _ => 1,
    }
}

pub(super) fn regs_for_len(len: usize) -> usize {
    len.div_ceil(4).clamp(1, NREGS)
}

pub(super) fn hex(bytes: &[u8]) -> String {
    let mut out = String::from("0x");
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// The bytes past `n` are padding (zero), as when a short value sits in a register.
pub(super) fn padded(bytes: &[u8], n: usize) -> Option<&[u8]> {
    if bytes.len() >= n && bytes[n..].iter().all(|&b| b == 0) {
        Some(&bytes[..n])
    } else {
        None
    }
}

pub(super) fn host_uint(bytes: &[u8]) -> Option<u64> {
    Some(match bytes.len() {
        1 => u64::from(bytes[0]),
        2 => u64::from(u16::from_ne_bytes([bytes[0], bytes[1]])),
        4 => u64::from(u32::from_ne_bytes(bytes.try_into().ok()?)),
        8 => u64::from_ne_bytes(bytes.try_into().ok()?),
        _ => return None,
    })
}

pub(super) fn host_u32(bytes: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(bytes.try_into().ok()?))
}

/// The protocol name nft prints (from /etc/protocols) for the common protocols.
pub(super) fn proto_name(p: u8) -> String {
    let name = match p {
        1 => "icmp",
        2 => "igmp",
        4 => "ipencap",
        6 => "tcp",
        17 => "udp",
        33 => "dccp",
        41 => "ipv6",
        47 => "gre",
        50 => "esp",
        51 => "ah",
        58 => "ipv6-icmp",
        89 => "ospf",
        94 => "ipip",
        103 => "pim",
        112 => "vrrp",
        115 => "l2tp",
        132 => "sctp",
        136 => "udplite",
        p => return p.to_string(),
    };
    name.to_string()
}

pub(super) fn flag_names(v: u32, names: &[(u32, &str)]) -> String {
    let mut parts = Vec::new();
    let mut rest = v;
    for &(bit, name) in names {
        if v & bit != 0 {
            parts.push(name.to_string());
            rest &= !bit;
        }
    }
    if rest != 0 || parts.is_empty() {
        parts.push(format!("0x{rest:x}"));
    }
    parts.join(",")
}

pub(super) const CT_STATE_BITS: [(u32, &str); 5] = [
    (1, "invalid"),
    (2, "established"),
    (4, "related"),
    (8, "new"),
    (64, "untracked"),
];

pub(super) const CT_STATUS_BITS: [(u32, &str); 7] = [
    (0x1, "expected"),
    (0x2, "seen-reply"),
    (0x4, "assured"),
    (0x8, "confirmed"),
    (0x10, "snat"),
    (0x20, "dnat"),
    (0x200, "dying"),
];

/// Formats register bytes as a value of `kind`; bytes that do not fit the kind print in hex.
pub(super) fn format_bytes(kind: Kind, bytes: &[u8]) -> String {
    let formatted = match kind {
        Kind::Ipv4 => <[u8; 4]>::try_from(bytes)
            .ok()
            .map(|a| Ipv4Addr::from(a).to_string()),
        Kind::Ipv6 => <[u8; 16]>::try_from(bytes)
            .ok()
            .map(|a| Ipv6Addr::from(a).to_string()),
        Kind::L4Proto => padded(bytes, 1).map(|b| proto_name(b[0])),
        Kind::Port => padded(bytes, 2).map(|b| u16::from_be_bytes([b[0], b[1]]).to_string()),
        Kind::Mark => host_u32(bytes).map(|v| format!("0x{v:08x}")),
        Kind::Int | Kind::IfIndex => host_uint(bytes).map(|v| v.to_string()),
        Kind::IntBe if !bytes.is_empty() && bytes.len() <= 8 => Some(
            bytes
                .iter()
                .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
                .to_string(),
        ),
        Kind::RawBe if !bytes.is_empty() && bytes.len() <= 8 => Some(format!(
            "0x{:x}",
            bytes.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
        )),
        Kind::CtState => host_u32(bytes).map(|v| flag_names(v, &CT_STATE_BITS)),
        Kind::CtStatus => host_u32(bytes).map(|v| flag_names(v, &CT_STATUS_BITS)),
        Kind::FibAddrType => host_u32(bytes).map(|v| {
            const TYPES: [&str; 9] = [
                "unspec",
                "unicast",
                "local",
                "broadcast",
                "anycast",
                "multicast",
                "blackhole",
                "unreachable",
                "prohibit",
            ];
            usize::try_from(v)
                .ok()
                .and_then(|i| TYPES.get(i))
                .map_or_else(|| v.to_string(), |s| (*s).to_string())
        }),
        Kind::IfName => {
            let end = bytes.iter().position(|&b| b == 0);
            let name = String::from_utf8_lossy(&bytes[..end.unwrap_or(bytes.len())]);
            // A name compared without its terminating NUL is a prefix match.
            let wildcard = if end.is_none() && bytes.len() < 16 {
                "*"
            } else {
                ""
            };
            Some(quoted(&format!("{name}{wildcard}")))
        }
        Kind::EtherType => padded(bytes, 2).map(|b| match u16::from_be_bytes([b[0], b[1]]) {
            0x0800 => "ip".into(),
            0x86dd => "ip6".into(),
            0x0806 => "arp".into(),
            0x8100 => "8021q".into(),
            v => format!("0x{v:04x}"),
        }),
        Kind::NfProto => padded(bytes, 1).map(|b| match b[0] {
            2 => "ipv4".into(),
            10 => "ipv6".into(),
            v => v.to_string(),
        }),
        Kind::PktType => padded(bytes, 1).map(|b| match b[0] {
            0 => "host".into(),
            1 => "broadcast".into(),
            2 => "multicast".into(),
            3 => "other".into(),
            v => v.to_string(),
        }),
        Kind::Bool => Some(
            if bytes.iter().any(|&b| b != 0) {
                "exists"
            } else {
                "missing"
            }
            .into(),
        ),
        Kind::IntBe | Kind::RawBe | Kind::Raw => None,
    };
    formatted.unwrap_or_else(|| hex(bytes))
}

/// Formats the bytes of a concatenation: one field per kind, each padded to whole registers.
pub(super) fn format_fields(kinds: &[Kind], widths: &[usize], bytes: &[u8]) -> String {
    if kinds.len() <= 1 {
        return format_bytes(kinds.first().copied().unwrap_or(Kind::Raw), bytes);
    }
    let mut parts = Vec::new();
    let mut at = 0usize;
    for (i, &k) in kinds.iter().enumerate() {
        if at >= bytes.len() {
            break;
        }
        let w = widths.get(i).copied().unwrap_or(1) * 4;
        let end = if i + 1 == kinds.len() {
            bytes.len()
        } else {
            (at + w).min(bytes.len())
        };
        let field = &bytes[at..end];
        // A field shorter than its registers (an address in a 4-byte slot is exact; a port or
        // protocol is padded) prints through `format_bytes`, which accepts the padding.
        parts.push(format_bytes(k, field));
        at = end;
    }
    if at < bytes.len() {
        parts.push(hex(&bytes[at..]));
    }
    parts.join(" . ")
}

/// The prefix length of a netmask (leading ones, then zeros).
pub(super) fn mask_prefix(mask: &[u8]) -> Option<u32> {
    let mut len = 0u32;
    let mut ended = false;
    for &b in mask {
        if ended {
            if b != 0 {
                return None;
            }
            continue;
        }
        let ones = b.leading_ones();
        if b != (0xffu8.checked_shl(8 - ones).unwrap_or(0)) {
            return None;
        }
        len += ones;
        ended = ones < 8;
    }
    Some(len)
}

/// What a `ct` load prints as (`ct state`, `ct original ip daddr`, `ct reply proto-src`), the
/// type of its value and the registers it takes. A tuple field prints its direction; a key the
/// renderer does not know prints as `ct key N`. `ct protocol` prints without one whatever the
/// IR says: the l4 protocol is the same in both tuples, the kernel accepts a direction for it
/// but keeps none, and nft lists `ct original protocol` back as `ct protocol`.
pub(super) fn ct_info(c: &v1::Ct) -> (String, Kind, usize) {
    let (field, kind, width) = match CtKey::try_from(c.key) {
        Ok(CtKey::State) => ("state", Kind::CtState, 1),
        Ok(CtKey::Status) => ("status", Kind::CtStatus, 1),
        Ok(CtKey::Mark) => ("mark", Kind::Mark, 1),
        Ok(CtKey::SrcIp) => ("ip saddr", Kind::Ipv4, 1),
        Ok(CtKey::DstIp) => ("ip daddr", Kind::Ipv4, 1),
        Ok(CtKey::SrcIp6) => ("ip6 saddr", Kind::Ipv6, 4),
        Ok(CtKey::DstIp6) => ("ip6 daddr", Kind::Ipv6, 4),
        Ok(CtKey::ProtoSrc) => ("proto-src", Kind::Port, 1),
        Ok(CtKey::ProtoDst) => ("proto-dst", Kind::Port, 1),
        Ok(CtKey::Protocol) => ("protocol", Kind::L4Proto, 1),
        Ok(CtKey::Unspecified) | Err(_) => return (format!("ct key {}", c.key), Kind::Raw, 1),
    };
    let dir = match CtDirection::try_from(c.direction) {
        _ if c.key == CtKey::Protocol as i32 => String::new(),
        Ok(CtDirection::Unspecified) => String::new(),
        Ok(CtDirection::Original) => "original ".into(),
        Ok(CtDirection::Reply) => "reply ".into(),
        Err(_) => format!("direction {} ", c.direction),
    };
    (format!("ct {dir}{field}"), kind, width)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::objects::range_prefix;

    #[test]
    fn prefixes() {
        assert_eq!(mask_prefix(&[255, 255, 0, 0]), Some(16));
        assert_eq!(mask_prefix(&[255, 255, 255, 255]), Some(32));
        assert_eq!(mask_prefix(&[255, 240, 0, 0]), Some(12));
        assert_eq!(mask_prefix(&[0, 0, 0, 0]), Some(0));
        assert_eq!(mask_prefix(&[255, 0, 255, 0]), None);
        assert_eq!(mask_prefix(&[255, 0b1011_0000, 0, 0]), None);
        assert_eq!(range_prefix(0x0a00_0000, 0x0a00_00ff, 32), Some(24));
        assert_eq!(range_prefix(0x0a00_0001, 0x0a00_0005, 32), None);
        assert_eq!(range_prefix(0, u128::MAX, 128), Some(0));
        assert_eq!(range_prefix(5, 4, 32), None);
    }

    #[test]
    fn bytes_format_by_kind() {
        assert_eq!(format_bytes(Kind::Ipv4, &[10, 96, 0, 10]), "10.96.0.10");
        assert_eq!(format_bytes(Kind::Ipv4, &[10, 96, 0]), "0x0a6000");
        assert_eq!(format_bytes(Kind::Port, &[0, 53]), "53");
        assert_eq!(format_bytes(Kind::Port, &[0, 53, 0, 0]), "53");
        assert_eq!(format_bytes(Kind::L4Proto, &[6]), "tcp");
        assert_eq!(format_bytes(Kind::L4Proto, &[17, 0, 0, 0]), "udp");
        assert_eq!(format_bytes(Kind::L4Proto, &[99]), "99");
        assert_eq!(format_bytes(Kind::L4Proto, &[47]), "gre");
        assert_eq!(format_bytes(Kind::RawBe, &[0, 2]), "0x2");
        assert_eq!(
            format_bytes(Kind::Mark, &0x4000u32.to_ne_bytes()),
            "0x00004000"
        );
        assert_eq!(
            format_bytes(Kind::CtState, &6u32.to_ne_bytes()),
            "established,related"
        );
        assert_eq!(
            format_bytes(Kind::CtState, &0x108u32.to_ne_bytes()),
            "new,0x100"
        );
        assert_eq!(format_bytes(Kind::CtStatus, &0x20u32.to_ne_bytes()), "dnat");
        assert_eq!(
            format_bytes(Kind::FibAddrType, &2u32.to_ne_bytes()),
            "local"
        );
        assert_eq!(format_bytes(Kind::FibAddrType, &77u32.to_ne_bytes()), "77");
        assert_eq!(
            format_bytes(Kind::IfName, b"eth0\0\0\0\0\0\0\0\0\0\0\0\0"),
            "\"eth0\""
        );
        assert_eq!(format_bytes(Kind::IfName, b"veth"), "\"veth*\"");
        assert_eq!(format_bytes(Kind::EtherType, &[0x86, 0xdd]), "ip6");
        assert_eq!(format_bytes(Kind::NfProto, &[10]), "ipv6");
        assert_eq!(format_bytes(Kind::PktType, &[1]), "broadcast");
        assert_eq!(format_bytes(Kind::IntBe, &[0, 64]), "64");
        assert_eq!(format_bytes(Kind::Int, &3u32.to_ne_bytes()), "3");
        assert_eq!(format_bytes(Kind::Raw, &[]), "0x");
        assert_eq!(
            format_fields(
                &[Kind::Ipv4, Kind::Port],
                &[1, 1],
                &[10, 0, 0, 1, 0x1f, 0x90, 0, 0]
            ),
            "10.0.0.1 . 8080"
        );
    }
}
