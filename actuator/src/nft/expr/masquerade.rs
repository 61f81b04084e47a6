//! `masq`: source NAT to the address of the outgoing interface.

use splitproxy_proto::v1::Masquerade;

use crate::netlink::attr::NlaBuf;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

pub(super) fn encode(e: &Masquerade, b: &mut NlaBuf) -> Result<(), EncodeError> {
    if e.flags != 0 {
        b.put_u32_be(NFTA_MASQ_FLAGS, e.flags);
    }
    Ok(())
}

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Masquerade {
    Masquerade {
        flags: super::decode::u32_of(a, NFTA_MASQ_FLAGS),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::round_trip;
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_plain_and_fully_random() {
        for flags in [0, 16] {
            let m = Masquerade { flags };
            assert_eq!(round_trip(Kind::Masquerade(m)), Kind::Masquerade(m));
        }
    }
}
