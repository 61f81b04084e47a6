//! `numgen`: a number in [offset, offset + modulus), random or round robin, in host byte
//! order. splitproxy feeds it straight into the endpoint map's key to pick a backend.

use splitproxy_proto::v1::{Numgen, NumgenType};

use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

pub(super) fn encode(e: &Numgen, b: &mut NlaBuf) -> Result<(), EncodeError> {
    // NumgenType's numbers are the kernel's NFT_NG_*.
    let ty = check::enum_value::<NumgenType>("numgen.type", e.r#type)?;
    if e.modulus == 0 {
        return Err(EncodeError::Invalid("numgen: modulus 0".to_owned()));
    }
    if e.offset.checked_add(e.modulus - 1).is_none() {
        return Err(EncodeError::Invalid(
            "numgen: offset + modulus overflows".to_owned(),
        ));
    }
    b.put_u32_be(NFTA_NG_DREG, check::reg("numgen.dreg", e.dreg)?);
    b.put_u32_be(NFTA_NG_MODULUS, e.modulus);
    b.put_u32_be(NFTA_NG_TYPE, ty as u32);
    if e.offset != 0 {
        b.put_u32_be(NFTA_NG_OFFSET, e.offset);
    }
    Ok(())
}

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Numgen {
    use super::decode::{reg_of, u32_of};
    Numgen {
        r#type: u32_of(a, NFTA_NG_TYPE) as i32,
        modulus: u32_of(a, NFTA_NG_MODULUS),
        offset: u32_of(a, NFTA_NG_OFFSET),
        dreg: reg_of(a, NFTA_NG_DREG),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_random_and_incremental() {
        let random = Numgen {
            r#type: NumgenType::Random as i32,
            modulus: 3,
            offset: 0,
            dreg: 3,
        };
        let inc = Numgen {
            r#type: NumgenType::Incremental as i32,
            modulus: 10,
            offset: 5,
            dreg: 0,
        };
        for n in [random, inc] {
            assert_eq!(round_trip(Kind::Numgen(n)), Kind::Numgen(n));
        }
        assert!(matches!(
            encode_err(Kind::Numgen(Numgen::default())),
            EncodeError::Invalid(_)
        ));
    }
}
