//! `immediate` with a data register: load constant bytes into a register.
//! (Verdicts are `immediate` into the verdict register; see `verdict.rs`.)

use splitproxy_proto::v1::Immediate;

use super::put_value;
use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

pub(super) fn encode(e: &Immediate, b: &mut NlaBuf) -> Result<(), EncodeError> {
    check::length("immediate.data", e.data.len(), NFT_DATA_VALUE_MAXLEN)?;
    b.put_u32_be(NFTA_IMMEDIATE_DREG, check::reg("immediate.dreg", e.dreg)?);
    put_value(b, NFTA_IMMEDIATE_DATA, &e.data);
    Ok(())
}

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Immediate {
    use super::decode::{reg_of, value};
    Immediate {
        dreg: reg_of(a, NFTA_IMMEDIATE_DREG),
        data: value(a, NFTA_IMMEDIATE_DATA),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_constant() {
        let i = Immediate {
            dreg: 5,
            data: vec![0xde, 0xad, 0xbe, 0xef],
        };
        assert_eq!(round_trip(Kind::Immediate(i.clone())), Kind::Immediate(i));
        assert!(matches!(
            encode_err(Kind::Immediate(Immediate::default())),
            EncodeError::Length { .. }
        ));
    }
}
