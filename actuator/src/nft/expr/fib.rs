//! `fib`: look the packet up in the routing table (`fib daddr type local`) and load the
//! result (output interface, its name, or the address type) into a register.

use splitproxy_proto::v1::{Fib, FibResult};

use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

/// NFTA_FIB_F_* bits the kernel knows (saddr..present).
const KNOWN_FLAGS: u32 = 0x3f;

pub(super) fn encode(e: &Fib, b: &mut NlaBuf) -> Result<(), EncodeError> {
    let result = check::enum_value::<FibResult>("fib.result", e.result)?;
    if result == FibResult::Unspecified {
        return Err(EncodeError::Enum {
            field: "fib.result",
            value: e.result,
        });
    }
    if e.flags & !KNOWN_FLAGS != 0 {
        return Err(EncodeError::Invalid(format!(
            "fib.flags: unknown bits {:#x}",
            e.flags & !KNOWN_FLAGS
        )));
    }
    b.put_u32_be(NFTA_FIB_DREG, check::reg("fib.dreg", e.dreg)?);
    // FibResult's numbers are the kernel's NFT_FIB_RESULT_*.
    b.put_u32_be(NFTA_FIB_RESULT, result as u32);
    b.put_u32_be(NFTA_FIB_FLAGS, e.flags);
    Ok(())
}

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Fib {
    use super::decode::{reg_of, u32_of};
    Fib {
        flags: u32_of(a, NFTA_FIB_FLAGS),
        result: u32_of(a, NFTA_FIB_RESULT) as i32,
        dreg: reg_of(a, NFTA_FIB_DREG),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_daddr_type() {
        let f = Fib {
            flags: 2,
            result: FibResult::Addrtype as i32,
            dreg: 0,
        };
        assert_eq!(round_trip(Kind::Fib(f)), Kind::Fib(f));
        assert!(matches!(
            encode_err(Kind::Fib(Fib::default())),
            EncodeError::Enum { .. }
        ));
        let bad_flags = Fib { flags: 0x100, ..f };
        assert!(matches!(
            encode_err(Kind::Fib(bad_flags)),
            EncodeError::Invalid(_)
        ));
    }
}
