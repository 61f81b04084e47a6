//! `dynset`: add, update or delete the key in `sreg_key` (and data in `sreg_data`) of a set
//! from the packet path, e.g. to remember a client for session affinity with a timeout.

use splitproxy_proto::v1::{Dynset, DynsetOp};

use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

pub(super) fn encode(e: &Dynset, b: &mut NlaBuf) -> Result<(), EncodeError> {
    check::name("set", &e.set)?;
    // DynsetOp's numbers are the kernel's NFT_DYNSET_OP_*.
    let op = check::enum_value::<DynsetOp>("dynset.op", e.op)?;
    b.put_strz(NFTA_DYNSET_SET_NAME, &e.set);
    b.put_u32_be(NFTA_DYNSET_OP, op as u32);
    b.put_u32_be(
        NFTA_DYNSET_SREG_KEY,
        check::reg("dynset.sreg_key", e.sreg_key)?,
    );
    if e.has_data {
        b.put_u32_be(
            NFTA_DYNSET_SREG_DATA,
            check::reg("dynset.sreg_data", e.sreg_data)?,
        );
    }
    if e.timeout_ms != 0 {
        b.put_u64_be(NFTA_DYNSET_TIMEOUT, e.timeout_ms);
    }
    Ok(())
}

pub(super) fn decode(
    a: &crate::netlink::attr::Attrs<'_>,
) -> Result<Dynset, crate::nft::DecodeError> {
    use super::decode::{reg_of, u32_of};
    let has_data = a.find(NFTA_DYNSET_SREG_DATA).is_some();
    let timeout_ms = match a.find(NFTA_DYNSET_TIMEOUT) {
        None => 0,
        Some(x) => u64::from_be_bytes(
            x.value
                .try_into()
                .map_err(|_| crate::nft::DecodeError::new("dynset", "timeout is not 8 bytes"))?,
        ),
    };
    Ok(Dynset {
        set: a
            .find(NFTA_DYNSET_SET_NAME)
            .and_then(|x| x.str())
            .unwrap_or_default()
            .to_owned(),
        op: u32_of(a, NFTA_DYNSET_OP) as i32,
        sreg_key: reg_of(a, NFTA_DYNSET_SREG_KEY),
        has_data,
        sreg_data: if has_data {
            reg_of(a, NFTA_DYNSET_SREG_DATA)
        } else {
            0
        },
        timeout_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_update_with_data_and_timeout() {
        let d = Dynset {
            set: "affinity".to_owned(),
            op: DynsetOp::Update as i32,
            sreg_key: 0,
            has_data: true,
            sreg_data: 2,
            timeout_ms: 10_800_000,
        };
        assert_eq!(round_trip(Kind::Dynset(d.clone())), Kind::Dynset(d));
        let add = Dynset {
            set: "seen".to_owned(),
            op: DynsetOp::Add as i32,
            ..Dynset::default()
        };
        assert_eq!(round_trip(Kind::Dynset(add.clone())), Kind::Dynset(add));
        assert!(matches!(
            encode_err(Kind::Dynset(Dynset::default())),
            EncodeError::InvalidName { .. }
        ));
    }
}
