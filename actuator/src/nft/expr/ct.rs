//! `ct`: load a conntrack field of the packet's connection into a register.
//!
//! Two kinds of keys: connection-wide ones (state, status, mark; `ct state` is a bitmask in host
//! byte order, new = 8), which the kernel refuses with a direction (EINVAL), and tuple fields
//! (addresses, ports), which it refuses without one: `ct original ip daddr` reads the
//! destination the client sent to, `ct reply ip saddr` the endpoint a DNAT chose. The l4
//! protocol is the same in both tuples; the kernel takes it with or without a direction (nft
//! sends one for `ct original protocol`). Addresses load 4 or 16 bytes, ports 2 bytes in network
//! order, the protocol 1 byte.

use splitproxy_proto::v1::{Ct, CtDirection, CtKey};

use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

/// Whether the key needs a direction: `Some(true)` required, `Some(false)` refused, `None`
/// either.
fn needs_direction(k: CtKey) -> Option<bool> {
    match k {
        CtKey::State | CtKey::Status | CtKey::Mark => Some(false),
        CtKey::Protocol | CtKey::Unspecified => None,
        CtKey::SrcIp
        | CtKey::DstIp
        | CtKey::SrcIp6
        | CtKey::DstIp6
        | CtKey::ProtoSrc
        | CtKey::ProtoDst => Some(true),
    }
}

fn kernel_key(k: CtKey) -> Option<u32> {
    Some(match k {
        CtKey::State => NFT_CT_STATE,
        CtKey::Status => NFT_CT_STATUS,
        CtKey::Mark => NFT_CT_MARK,
        CtKey::SrcIp => NFT_CT_SRC_IP,
        CtKey::DstIp => NFT_CT_DST_IP,
        CtKey::SrcIp6 => NFT_CT_SRC_IP6,
        CtKey::DstIp6 => NFT_CT_DST_IP6,
        CtKey::ProtoSrc => NFT_CT_PROTO_SRC,
        CtKey::ProtoDst => NFT_CT_PROTO_DST,
        CtKey::Protocol => NFT_CT_PROTOCOL,
        CtKey::Unspecified => return None,
    })
}

fn kernel_direction(d: CtDirection) -> Option<u8> {
    match d {
        CtDirection::Unspecified => None,
        CtDirection::Original => Some(IP_CT_DIR_ORIGINAL),
        CtDirection::Reply => Some(IP_CT_DIR_REPLY),
    }
}

pub(super) fn encode(e: &Ct, b: &mut NlaBuf) -> Result<(), EncodeError> {
    let ir_key = check::enum_value::<CtKey>("ct.key", e.key)?;
    let key = kernel_key(ir_key).ok_or(EncodeError::Enum {
        field: "ct.key",
        value: e.key,
    })?;
    let dir = kernel_direction(check::enum_value::<CtDirection>(
        "ct.direction",
        e.direction,
    )?);
    match (needs_direction(ir_key), dir) {
        (Some(true), None) => {
            return Err(EncodeError::Invalid(format!(
                "ct {}: a tuple field needs a direction (original or reply)",
                ir_key.as_str_name()
            )));
        }
        (Some(false), Some(_)) => {
            return Err(EncodeError::Invalid(format!(
                "ct {}: the kernel takes no direction for this key",
                ir_key.as_str_name()
            )));
        }
        _ => {}
    }
    b.put_u32_be(NFTA_CT_DREG, check::reg("ct.dreg", e.dreg)?);
    b.put_u32_be(NFTA_CT_KEY, key);
    if let Some(d) = dir {
        b.put_u8(NFTA_CT_DIRECTION, d);
    }
    Ok(())
}

const ALL_KEYS: [CtKey; 10] = [
    CtKey::State,
    CtKey::Status,
    CtKey::Mark,
    CtKey::SrcIp,
    CtKey::DstIp,
    CtKey::SrcIp6,
    CtKey::DstIp6,
    CtKey::ProtoSrc,
    CtKey::ProtoDst,
    CtKey::Protocol,
];

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Result<Ct, crate::nft::DecodeError> {
    use super::decode::{reg_of, u32_of};
    let raw = u32_of(a, NFTA_CT_KEY);
    let key = ALL_KEYS
        .into_iter()
        .find(|k| kernel_key(*k) == Some(raw))
        .unwrap_or(CtKey::Unspecified);
    let direction = match a.find(NFTA_CT_DIRECTION).map(|d| d.value.first().copied()) {
        // The kernel keeps no direction for the protocol (the same in both tuples): read it as
        // `ct original protocol`, as the brain writes it. The reader's comparison treats an IR
        // protocol without direction the same way (nft/read.rs, `comparable`).
        None if key == CtKey::Protocol => CtDirection::Original,
        None => CtDirection::Unspecified,
        Some(Some(IP_CT_DIR_ORIGINAL)) => CtDirection::Original,
        Some(Some(IP_CT_DIR_REPLY)) => CtDirection::Reply,
        Some(other) => {
            return Err(crate::nft::DecodeError::new(
                "ct",
                format!("direction {other:?}"),
            ));
        }
    };
    Ok(Ct {
        key: key as i32,
        dreg: reg_of(a, NFTA_CT_DREG),
        direction: direction as i32,
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use crate::netlink::attr::{Attrs, NlaBuf};
    use splitproxy_proto::v1::expr::Kind;

    fn ct(key: CtKey, direction: CtDirection, dreg: u32) -> Ct {
        Ct {
            key: key as i32,
            dreg,
            direction: direction as i32,
        }
    }

    #[test]
    fn round_trip_every_key() {
        for key in ALL_KEYS {
            let dirs: &[CtDirection] = match needs_direction(key) {
                Some(false) => &[CtDirection::Unspecified],
                Some(true) => &[CtDirection::Original, CtDirection::Reply],
                None => &[
                    CtDirection::Unspecified,
                    CtDirection::Original,
                    CtDirection::Reply,
                ],
            };
            for &dir in dirs {
                let c = ct(key, dir, 3);
                // Without a direction, the protocol reads back as the original one's.
                let back = match (key, dir) {
                    (CtKey::Protocol, CtDirection::Unspecified) => {
                        ct(key, CtDirection::Original, 3)
                    }
                    _ => c,
                };
                assert_eq!(round_trip(Kind::Ct(c)), Kind::Ct(back), "{key:?} {dir:?}");
            }
        }
    }

    #[test]
    fn wire_format_of_ct_original_ip_daddr() {
        let mut b = NlaBuf::new();
        encode(&ct(CtKey::DstIp, CtDirection::Original, 1), &mut b).unwrap();
        let attrs: Vec<_> = Attrs::new(b.bytes()).map(|a| (a.ty, a.value)).collect();
        assert_eq!(
            attrs,
            vec![
                (NFTA_CT_DREG, &(NFT_REG32_00 + 1).to_be_bytes()[..]),
                (NFTA_CT_KEY, &20u32.to_be_bytes()[..]),
                (NFTA_CT_DIRECTION, &[0u8][..]),
            ]
        );
        let mut b = NlaBuf::new();
        encode(&ct(CtKey::SrcIp6, CtDirection::Reply, 0), &mut b).unwrap();
        let dir = Attrs::new(b.bytes()).find(NFTA_CT_DIRECTION).unwrap();
        assert_eq!(dir.value, &[1]);
        let key = Attrs::new(b.bytes()).find(NFTA_CT_KEY).unwrap();
        assert_eq!(key.value, &21u32.to_be_bytes());
    }

    #[test]
    fn refuses_what_the_kernel_refuses() {
        assert!(matches!(
            encode_err(Kind::Ct(Ct::default())),
            EncodeError::Enum { .. }
        ));
        // A tuple field without a direction, a connection-wide key with one.
        for c in [
            ct(CtKey::ProtoDst, CtDirection::Unspecified, 0),
            ct(CtKey::DstIp, CtDirection::Unspecified, 0),
            ct(CtKey::State, CtDirection::Original, 0),
            ct(CtKey::Mark, CtDirection::Reply, 0),
        ] {
            assert!(
                matches!(encode_err(Kind::Ct(c)), EncodeError::Invalid(_)),
                "{c:?}"
            );
        }
        assert!(matches!(
            encode_err(Kind::Ct(Ct {
                direction: 7,
                ..ct(CtKey::DstIp, CtDirection::Original, 0)
            })),
            EncodeError::Enum {
                field: "ct.direction",
                ..
            }
        ));
    }
}
