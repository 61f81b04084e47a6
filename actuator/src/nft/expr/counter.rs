//! `counter`: count packets and bytes that reach it. Starts at zero (no attributes).

use splitproxy_proto::v1::Counter;

use crate::netlink::attr::NlaBuf;
use crate::nft::error::EncodeError;

pub(super) fn encode(_: &Counter, _: &mut NlaBuf) -> Result<(), EncodeError> {
    Ok(())
}

pub(super) fn decode(_: &crate::netlink::attr::Attrs<'_>) -> Counter {
    Counter {}
}

#[cfg(test)]
mod tests {
    use super::super::tests::round_trip;
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_counter() {
        assert_eq!(
            round_trip(Kind::Counter(Counter {})),
            Kind::Counter(Counter {})
        );
    }
}
