//! `lookup`: look the key starting at `sreg` up in a named set. For a data map the value is
//! loaded into `dreg` (and the following registers); for a verdict map the verdict register
//! receives the element's verdict (`vmap`). A miss ends the rule, unless inverted.

use splitproxy_proto::v1::Lookup;

use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

pub(super) fn encode(e: &Lookup, b: &mut NlaBuf) -> Result<(), EncodeError> {
    check::name("set", &e.set)?;
    let dreg = match (e.verdict, e.has_dreg) {
        (true, true) => {
            return Err(EncodeError::Invalid(
                "lookup: verdict and dreg are exclusive".to_owned(),
            ));
        }
        (true, false) => Some(NFT_REG_VERDICT),
        (false, true) => Some(check::reg("lookup.dreg", e.dreg)?),
        (false, false) => None,
    };
    if e.invert && dreg.is_some() {
        return Err(EncodeError::Invalid(
            "lookup: an inverted lookup cannot load a value".to_owned(),
        ));
    }
    b.put_strz(NFTA_LOOKUP_SET, &e.set);
    b.put_u32_be(NFTA_LOOKUP_SREG, check::reg("lookup.sreg", e.sreg)?);
    if let Some(dreg) = dreg {
        b.put_u32_be(NFTA_LOOKUP_DREG, dreg);
    }
    if e.invert {
        b.put_u32_be(NFTA_LOOKUP_FLAGS, NFT_LOOKUP_F_INV);
    }
    Ok(())
}

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Lookup {
    use super::decode::{reg_of, u32_of};
    let dreg = a.find(NFTA_LOOKUP_DREG).and_then(|x| x.u32_be());
    Lookup {
        set: a
            .find(NFTA_LOOKUP_SET)
            .and_then(|x| x.str())
            .unwrap_or_default()
            .to_owned(),
        sreg: reg_of(a, NFTA_LOOKUP_SREG),
        has_dreg: matches!(dreg, Some(r) if r != NFT_REG_VERDICT),
        dreg: match dreg {
            Some(r) if r != NFT_REG_VERDICT => super::decode::ir_reg(r),
            _ => 0,
        },
        verdict: dreg == Some(NFT_REG_VERDICT),
        invert: u32_of(a, NFTA_LOOKUP_FLAGS) & NFT_LOOKUP_F_INV != 0,
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    fn lookup(set: &str) -> Lookup {
        Lookup {
            set: set.to_owned(),
            ..Lookup::default()
        }
    }

    #[test]
    fn round_trip_set_map_vmap_and_inverted() {
        let plain = lookup("no-endpoint-services");
        let map = Lookup {
            sreg: 0,
            has_dreg: true,
            dreg: 3,
            ..lookup("service-ips")
        };
        let vmap = Lookup {
            sreg: 3,
            verdict: true,
            ..lookup("service-dispatch")
        };
        let inv = Lookup {
            invert: true,
            ..lookup("cluster-ips")
        };
        for l in [plain, map, vmap, inv] {
            assert_eq!(round_trip(Kind::Lookup(l.clone())), Kind::Lookup(l));
        }
    }

    #[test]
    fn refuses_contradictions() {
        let both = Lookup {
            has_dreg: true,
            verdict: true,
            ..lookup("m")
        };
        assert!(matches!(
            encode_err(Kind::Lookup(both)),
            EncodeError::Invalid(_)
        ));
        let inv_map = Lookup {
            has_dreg: true,
            invert: true,
            ..lookup("m")
        };
        assert!(matches!(
            encode_err(Kind::Lookup(inv_map)),
            EncodeError::Invalid(_)
        ));
        assert!(matches!(
            encode_err(Kind::Lookup(lookup(""))),
            EncodeError::InvalidName { .. }
        ));
    }
}
