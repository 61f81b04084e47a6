//! `reject`: drop the packet and tell the sender, with an ICMP error (family specific code,
//! e.g. 3 = port unreachable), an ICMPX code (mapped to ICMP or ICMPv6 by the kernel), or a
//! TCP reset.

use splitproxy_proto::v1::{Reject, RejectType};

use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

pub(super) fn encode(e: &Reject, b: &mut NlaBuf) -> Result<(), EncodeError> {
    let (ty, code) = match check::enum_value::<RejectType>("reject.type", e.r#type)? {
        RejectType::IcmpUnreach => (NFT_REJECT_ICMP_UNREACH, Some(e.code)),
        RejectType::IcmpxUnreach if e.code > 3 => {
            return Err(EncodeError::Invalid(format!(
                "reject: icmpx code {} > 3",
                e.code
            )));
        }
        RejectType::IcmpxUnreach => (NFT_REJECT_ICMPX_UNREACH, Some(e.code)),
        RejectType::TcpRst => (NFT_REJECT_TCP_RST, None),
    };
    b.put_u32_be(NFTA_REJECT_TYPE, ty);
    if let Some(code) = code {
        let code = u8::try_from(code)
            .map_err(|_| EncodeError::Invalid(format!("reject: icmp code {code} > 255")))?;
        b.put_u8(NFTA_REJECT_ICMP_CODE, code);
    }
    Ok(())
}

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Reject {
    Reject {
        r#type: super::decode::u32_of(a, NFTA_REJECT_TYPE) as i32,
        code: a
            .find(NFTA_REJECT_ICMP_CODE)
            .and_then(|x| x.value.first().copied())
            .map(u32::from)
            .unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_icmp_icmpx_tcp_reset() {
        for (ty, code) in [
            (RejectType::IcmpUnreach, 3),
            (RejectType::IcmpxUnreach, 1),
            (RejectType::TcpRst, 0),
        ] {
            let r = Reject {
                r#type: ty as i32,
                code,
            };
            assert_eq!(round_trip(Kind::Reject(r)), Kind::Reject(r));
        }
        let bad = Reject {
            r#type: RejectType::IcmpUnreach as i32,
            code: 300,
        };
        assert!(matches!(
            encode_err(Kind::Reject(bad)),
            EncodeError::Invalid(_)
        ));
    }
}
