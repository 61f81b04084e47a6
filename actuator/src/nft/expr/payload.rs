//! `payload`: load `len` bytes at `offset` of the link, network or transport header into a
//! register (e.g. `ip daddr` = network offset 16 len 4, `th dport` = transport offset 2 len 2).

use splitproxy_proto::v1::{Payload, PayloadBase};

use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

pub(super) fn encode(e: &Payload, b: &mut NlaBuf) -> Result<(), EncodeError> {
    let base = match check::enum_value::<PayloadBase>("payload.base", e.base)? {
        PayloadBase::Link => NFT_PAYLOAD_LL_HEADER,
        PayloadBase::Network => NFT_PAYLOAD_NETWORK_HEADER,
        PayloadBase::Transport => NFT_PAYLOAD_TRANSPORT_HEADER,
        PayloadBase::Unspecified => {
            return Err(EncodeError::Enum {
                field: "payload.base",
                value: e.base,
            });
        }
    };
    check::length("payload.len", e.len as usize, NFT_DATA_VALUE_MAXLEN)?;
    b.put_u32_be(NFTA_PAYLOAD_DREG, check::reg("payload.dreg", e.dreg)?);
    b.put_u32_be(NFTA_PAYLOAD_BASE, base);
    b.put_u32_be(NFTA_PAYLOAD_OFFSET, e.offset);
    b.put_u32_be(NFTA_PAYLOAD_LEN, e.len);
    Ok(())
}

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Payload {
    use super::decode::{reg_of, u32_of};
    let base = match u32_of(a, NFTA_PAYLOAD_BASE) {
        NFT_PAYLOAD_LL_HEADER => PayloadBase::Link,
        NFT_PAYLOAD_NETWORK_HEADER => PayloadBase::Network,
        _ => PayloadBase::Transport,
    };
    Payload {
        base: base as i32,
        offset: u32_of(a, NFTA_PAYLOAD_OFFSET),
        len: u32_of(a, NFTA_PAYLOAD_LEN),
        dreg: reg_of(a, NFTA_PAYLOAD_DREG),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_ip_daddr_and_th_dport() {
        for (base, offset, len, dreg) in [
            (PayloadBase::Network, 16, 4, 0),
            (PayloadBase::Transport, 2, 2, 2),
            (PayloadBase::Link, 12, 2, 15),
        ] {
            let p = Payload {
                base: base as i32,
                offset,
                len,
                dreg,
            };
            assert_eq!(round_trip(Kind::Payload(p)), Kind::Payload(p));
        }
    }

    #[test]
    fn refuses_bad_fields() {
        let ok = Payload {
            base: PayloadBase::Network as i32,
            offset: 16,
            len: 4,
            dreg: 0,
        };
        let mut p = ok;
        p.base = 0;
        assert!(matches!(
            encode_err(Kind::Payload(p)),
            EncodeError::Enum { .. }
        ));
        let mut p = ok;
        p.len = 0;
        assert!(matches!(
            encode_err(Kind::Payload(p)),
            EncodeError::Length { .. }
        ));
        let mut p = ok;
        p.dreg = 16;
        assert!(matches!(
            encode_err(Kind::Payload(p)),
            EncodeError::Register { .. }
        ));
    }
}
