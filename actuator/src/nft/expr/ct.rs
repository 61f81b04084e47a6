//! `ct`: load a conntrack field (state, status, mark) of the packet's connection into a
//! register. `ct state` is a bitmask in host byte order (new = 8).

use splitproxy_proto::v1::{Ct, CtKey};

use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;
use crate::nft::nla::NlaBuf;

fn kernel_key(k: CtKey) -> Option<u32> {
    Some(match k {
        CtKey::State => NFT_CT_STATE,
        CtKey::Status => NFT_CT_STATUS,
        CtKey::Mark => NFT_CT_MARK,
        CtKey::Unspecified => return None,
    })
}

pub(super) fn encode(e: &Ct, b: &mut NlaBuf) -> Result<(), EncodeError> {
    let key = check::enum_value::<CtKey>("ct.key", e.key)?;
    let key = kernel_key(key).ok_or(EncodeError::Enum {
        field: "ct.key",
        value: e.key,
    })?;
    b.put_u32_be(NFTA_CT_DREG, check::reg("ct.dreg", e.dreg)?);
    b.put_u32_be(NFTA_CT_KEY, key);
    Ok(())
}

#[cfg(test)]
pub(super) fn decode(a: &crate::nft::nla::Attrs<'_>) -> Ct {
    use super::tests::{reg_of, u32_of};
    let raw = u32_of(a, NFTA_CT_KEY);
    let key = [CtKey::State, CtKey::Status, CtKey::Mark]
        .into_iter()
        .find(|k| kernel_key(*k) == Some(raw))
        .unwrap_or(CtKey::Unspecified);
    Ct {
        key: key as i32,
        dreg: reg_of(a, NFTA_CT_DREG),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_state_status_mark() {
        for key in [CtKey::State, CtKey::Status, CtKey::Mark] {
            let c = Ct {
                key: key as i32,
                dreg: 0,
            };
            assert_eq!(round_trip(Kind::Ct(c)), Kind::Ct(c));
        }
        assert!(matches!(
            encode_err(Kind::Ct(Ct::default())),
            EncodeError::Enum { .. }
        ));
    }
}
