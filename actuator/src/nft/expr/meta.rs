//! `meta`: load packet metadata (l4proto, mark, interfaces...) into a register, or, with
//! `set`, write a register into the packet's metadata (`meta mark set ...`).

use splitproxy_proto::v1::{Meta, MetaKey};

use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

/// The IR's meta keys are numbered for readability; these are the kernel's.
fn kernel_key(k: MetaKey) -> Option<u32> {
    Some(match k {
        MetaKey::Len => NFT_META_LEN,
        MetaKey::Protocol => NFT_META_PROTOCOL,
        MetaKey::Mark => NFT_META_MARK,
        MetaKey::Iif => NFT_META_IIF,
        MetaKey::Oif => NFT_META_OIF,
        MetaKey::Iifname => NFT_META_IIFNAME,
        MetaKey::Oifname => NFT_META_OIFNAME,
        MetaKey::Nfproto => NFT_META_NFPROTO,
        MetaKey::L4proto => NFT_META_L4PROTO,
        MetaKey::Pkttype => NFT_META_PKTTYPE,
        MetaKey::Unspecified => return None,
    })
}

pub(super) fn encode(e: &Meta, b: &mut NlaBuf) -> Result<(), EncodeError> {
    let key = check::enum_value::<MetaKey>("meta.key", e.key)?;
    let key = kernel_key(key).ok_or(EncodeError::Enum {
        field: "meta.key",
        value: e.key,
    })?;
    b.put_u32_be(NFTA_META_KEY, key);
    if e.set {
        b.put_u32_be(NFTA_META_SREG, check::reg("meta.sreg", e.sreg)?);
    } else {
        b.put_u32_be(NFTA_META_DREG, check::reg("meta.dreg", e.dreg)?);
    }
    Ok(())
}

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Meta {
    use super::decode::{reg_of, u32_of};
    let raw = u32_of(a, NFTA_META_KEY);
    let key = (1..=10)
        .filter_map(|v| MetaKey::try_from(v).ok())
        .find(|k| kernel_key(*k) == Some(raw))
        .unwrap_or(MetaKey::Unspecified);
    let set = a.find(NFTA_META_SREG).is_some();
    Meta {
        key: key as i32,
        dreg: if set { 0 } else { reg_of(a, NFTA_META_DREG) },
        set,
        sreg: if set { reg_of(a, NFTA_META_SREG) } else { 0 },
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_every_key_load_and_set() {
        for v in 1..=10 {
            let m = Meta {
                key: v,
                dreg: 1,
                set: false,
                sreg: 0,
            };
            assert_eq!(round_trip(Kind::Meta(m)), Kind::Meta(m));
        }
        let set = Meta {
            key: MetaKey::Mark as i32,
            dreg: 0,
            set: true,
            sreg: 4,
        };
        assert_eq!(round_trip(Kind::Meta(set)), Kind::Meta(set));
    }

    #[test]
    fn l4proto_is_kernel_key_16() {
        assert_eq!(kernel_key(MetaKey::L4proto), Some(16));
        let err = encode_err(Kind::Meta(Meta::default()));
        assert!(matches!(err, EncodeError::Enum { .. }));
    }
}
