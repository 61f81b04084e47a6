//! `cmp`: compare a register with a constant; a false comparison ends the rule.

use splitproxy_proto::v1::{Cmp, CmpOp};

use super::put_value;
use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

pub(super) fn encode(e: &Cmp, b: &mut NlaBuf) -> Result<(), EncodeError> {
    // CmpOp's numbers are the kernel's NFT_CMP_*.
    let op = check::enum_value::<CmpOp>("cmp.op", e.op)?;
    check::length("cmp.data", e.data.len(), NFT_DATA_VALUE_MAXLEN)?;
    b.put_u32_be(NFTA_CMP_SREG, check::reg("cmp.sreg", e.sreg)?);
    b.put_u32_be(NFTA_CMP_OP, op as u32);
    put_value(b, NFTA_CMP_DATA, &e.data);
    Ok(())
}

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Cmp {
    use super::decode::{reg_of, u32_of, value};
    Cmp {
        op: u32_of(a, NFTA_CMP_OP) as i32,
        sreg: reg_of(a, NFTA_CMP_SREG),
        data: value(a, NFTA_CMP_DATA),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_every_operator() {
        for op in 0..=5 {
            let c = Cmp {
                op,
                sreg: 1,
                data: vec![10, 96, 0, 0],
            };
            assert_eq!(round_trip(Kind::Cmp(c.clone())), Kind::Cmp(c));
        }
    }

    #[test]
    fn refuses_empty_or_oversized_data_and_unknown_ops() {
        let empty = Cmp {
            op: 0,
            sreg: 0,
            data: vec![],
        };
        assert!(matches!(
            encode_err(Kind::Cmp(empty)),
            EncodeError::Length { .. }
        ));
        let big = Cmp {
            op: 0,
            sreg: 0,
            data: vec![0; 65],
        };
        assert!(matches!(
            encode_err(Kind::Cmp(big)),
            EncodeError::Length { .. }
        ));
        let op = Cmp {
            op: 9,
            sreg: 0,
            data: vec![1],
        };
        assert!(matches!(
            encode_err(Kind::Cmp(op)),
            EncodeError::Enum { .. }
        ));
    }
}
