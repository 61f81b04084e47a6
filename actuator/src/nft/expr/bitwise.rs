//! `bitwise`: dreg = (sreg & mask) ^ xor over `mask.len()` bytes, e.g. `ct state & new` or an
//! address prefix match.

use splitproxy_proto::v1::Bitwise;

use super::put_value;
use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

pub(super) fn encode(e: &Bitwise, b: &mut NlaBuf) -> Result<(), EncodeError> {
    let len = e.mask.len();
    check::length("bitwise.mask", len, NFT_DATA_VALUE_MAXLEN)?;
    // An empty xor means "no xor"; the kernel still wants one of the mask's length.
    let zeros;
    let xor = if e.xor.is_empty() {
        zeros = vec![0; len];
        &zeros
    } else if e.xor.len() == len {
        &e.xor
    } else {
        return Err(EncodeError::Invalid(format!(
            "bitwise: xor has {} bytes, mask {len}",
            e.xor.len()
        )));
    };
    b.put_u32_be(NFTA_BITWISE_SREG, check::reg("bitwise.sreg", e.sreg)?);
    b.put_u32_be(NFTA_BITWISE_DREG, check::reg("bitwise.dreg", e.dreg)?);
    b.put_u32_be(NFTA_BITWISE_LEN, len as u32);
    put_value(b, NFTA_BITWISE_MASK, &e.mask);
    put_value(b, NFTA_BITWISE_XOR, xor);
    Ok(())
}

pub(super) fn decode(
    a: &crate::netlink::attr::Attrs<'_>,
) -> Result<Bitwise, crate::nft::DecodeError> {
    use super::decode::{reg_of, u32_of, value};
    let mask = value(a, NFTA_BITWISE_MASK);
    if u32_of(a, NFTA_BITWISE_LEN) as usize != mask.len() {
        return Err(crate::nft::DecodeError::new(
            "bitwise",
            "length differs from the mask's",
        ));
    }
    Ok(Bitwise {
        sreg: reg_of(a, NFTA_BITWISE_SREG),
        dreg: reg_of(a, NFTA_BITWISE_DREG),
        mask,
        xor: value(a, NFTA_BITWISE_XOR),
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_with_and_without_xor() {
        let ct_new = Bitwise {
            sreg: 0,
            dreg: 0,
            mask: 8u32.to_ne_bytes().to_vec(),
            xor: vec![],
        };
        // An empty xor goes out as zeros.
        let back = round_trip(Kind::Bitwise(ct_new.clone()));
        assert_eq!(
            back,
            Kind::Bitwise(Bitwise {
                xor: vec![0; 4],
                ..ct_new
            })
        );
        let full = Bitwise {
            sreg: 2,
            dreg: 3,
            mask: vec![255, 255, 0, 0],
            xor: vec![0, 0, 0, 1],
        };
        assert_eq!(round_trip(Kind::Bitwise(full.clone())), Kind::Bitwise(full));
    }

    #[test]
    fn refuses_xor_of_another_length() {
        let bad = Bitwise {
            sreg: 0,
            dreg: 0,
            mask: vec![255; 4],
            xor: vec![0; 2],
        };
        assert!(matches!(
            encode_err(Kind::Bitwise(bad)),
            EncodeError::Invalid(_)
        ));
    }
}
