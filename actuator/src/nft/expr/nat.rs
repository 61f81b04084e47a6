//! `nat`: source or destination NAT to the address and/or port held in registers
//! (`dnat ip to ip daddr . th dport map @m`). The NF_NAT_RANGE_MAP_IPS and
//! NF_NAT_RANGE_PROTO_SPECIFIED flags follow from which registers are given.

use splitproxy_proto::v1::{Family, Nat, NatType};

use super::Ctx;
use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

pub(super) fn encode(e: &Nat, ctx: Ctx, b: &mut NlaBuf) -> Result<(), EncodeError> {
    let ty = match check::enum_value::<NatType>("nat.type", e.r#type)? {
        NatType::Snat => NFT_NAT_SNAT,
        NatType::Dnat => NFT_NAT_DNAT,
        NatType::Unspecified => {
            return Err(EncodeError::Enum {
                field: "nat.type",
                value: e.r#type,
            });
        }
    };
    // The address family NATed to; in an ip or ip6 table it can only be the table's.
    let family = match check::enum_value::<Family>("nat.family", e.family)? {
        Family::Unspecified if ctx.family != NFPROTO_INET => ctx.family,
        Family::Ip => NFPROTO_IPV4,
        Family::Ip6 => NFPROTO_IPV6,
        _ => {
            return Err(EncodeError::Invalid(
                "nat.family must be ip or ip6 (required in inet tables)".to_owned(),
            ));
        }
    };
    let mut flags = e.flags;
    b.put_u32_be(NFTA_NAT_TYPE, ty);
    b.put_u32_be(NFTA_NAT_FAMILY, u32::from(family));
    if e.has_addr {
        b.put_u32_be(
            NFTA_NAT_REG_ADDR_MIN,
            check::reg("nat.reg_addr", e.reg_addr)?,
        );
        flags |= NF_NAT_RANGE_MAP_IPS;
    }
    if e.has_proto {
        b.put_u32_be(
            NFTA_NAT_REG_PROTO_MIN,
            check::reg("nat.reg_proto", e.reg_proto)?,
        );
        flags |= NF_NAT_RANGE_PROTO_SPECIFIED;
    }
    if flags != 0 {
        b.put_u32_be(NFTA_NAT_FLAGS, flags);
    }
    Ok(())
}

pub(super) fn decode(a: &crate::netlink::attr::Attrs<'_>) -> Nat {
    use super::decode::{reg_of, u32_of};
    let has_addr = a.find(NFTA_NAT_REG_ADDR_MIN).is_some();
    let has_proto = a.find(NFTA_NAT_REG_PROTO_MIN).is_some();
    let derived = if has_addr { NF_NAT_RANGE_MAP_IPS } else { 0 }
        | if has_proto {
            NF_NAT_RANGE_PROTO_SPECIFIED
        } else {
            0
        };
    Nat {
        r#type: if u32_of(a, NFTA_NAT_TYPE) == NFT_NAT_DNAT {
            NatType::Dnat as i32
        } else {
            NatType::Snat as i32
        },
        // Family's numbers are the kernel's NFPROTO_*.
        family: u32_of(a, NFTA_NAT_FAMILY) as i32,
        has_addr,
        reg_addr: if has_addr {
            reg_of(a, NFTA_NAT_REG_ADDR_MIN)
        } else {
            0
        },
        has_proto,
        reg_proto: if has_proto {
            reg_of(a, NFTA_NAT_REG_PROTO_MIN)
        } else {
            0
        },
        flags: u32_of(a, NFTA_NAT_FLAGS) & !derived,
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_dnat_to_address_and_port_registers() {
        let dnat = Nat {
            r#type: NatType::Dnat as i32,
            family: Family::Ip as i32,
            has_addr: true,
            reg_addr: 0,
            has_proto: true,
            reg_proto: 1,
            flags: 0,
        };
        assert_eq!(round_trip(Kind::Nat(dnat)), Kind::Nat(dnat));
        let snat = Nat {
            r#type: NatType::Snat as i32,
            family: Family::Ip as i32,
            has_addr: true,
            reg_addr: 4,
            flags: 16,
            ..Nat::default()
        };
        assert_eq!(round_trip(Kind::Nat(snat)), Kind::Nat(snat));
    }

    #[test]
    fn unspecified_family_takes_the_tables_and_type_is_required() {
        let n = Nat {
            r#type: NatType::Dnat as i32,
            has_addr: true,
            ..Nat::default()
        };
        let Kind::Nat(back) = round_trip(Kind::Nat(n)) else {
            panic!()
        };
        assert_eq!(back.family, Family::Ip as i32);
        assert!(matches!(
            encode_err(Kind::Nat(Nat::default())),
            EncodeError::Enum { .. }
        ));
    }
}
