//! nf_tables expressions, one module per expression: each lowers one IR expression to the
//! attributes of its NFTA_EXPR_DATA, and (in tests) reads them back.
//!
//! On the wire a rule's expression is `NFTA_LIST_ELEM { NFTA_EXPR_NAME "payload",
//! NFTA_EXPR_DATA { ... } }`; attribute values are big-endian unless noted.

mod bitwise;
mod cmp;
mod counter;
mod ct;
mod dynset;
mod fib;
mod immediate;
mod lookup;
mod masquerade;
mod meta;
mod nat;
mod numgen;
mod payload;
mod reject;
pub(crate) mod verdict;

use splitproxy_proto::v1::{Expr, expr::Kind};

use super::consts::{NFTA_DATA_VALUE, NFTA_EXPR_DATA, NFTA_EXPR_NAME, NFTA_LIST_ELEM};
use super::error::EncodeError;
use crate::netlink::attr::NlaBuf;

/// What an expression needs to know about where it is going.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx {
    /// NFPROTO_* of the table.
    pub family: u8,
}

/// Appends `expr` as one element of an NFTA_RULE_EXPRESSIONS list.
pub(crate) fn encode(expr: &Expr, ctx: Ctx, b: &mut NlaBuf) -> Result<(), EncodeError> {
    let kind = expr
        .kind
        .as_ref()
        .ok_or(EncodeError::Missing("expression kind"))?;
    let elem = b.begin_nest(NFTA_LIST_ELEM);
    b.put_strz(NFTA_EXPR_NAME, name(kind));
    let data = b.begin_nest(NFTA_EXPR_DATA);
    match kind {
        Kind::Payload(e) => payload::encode(e, b)?,
        Kind::Meta(e) => meta::encode(e, b)?,
        Kind::Ct(e) => ct::encode(e, b)?,
        Kind::Fib(e) => fib::encode(e, b)?,
        Kind::Cmp(e) => cmp::encode(e, b)?,
        Kind::Bitwise(e) => bitwise::encode(e, b)?,
        Kind::Lookup(e) => lookup::encode(e, b)?,
        Kind::Numgen(e) => numgen::encode(e, b)?,
        Kind::Nat(e) => nat::encode(e, ctx, b)?,
        Kind::Masquerade(e) => masquerade::encode(e, b)?,
        Kind::Reject(e) => reject::encode(e, b)?,
        Kind::Dynset(e) => dynset::encode(e, b)?,
        Kind::Counter(e) => counter::encode(e, b)?,
        Kind::Verdict(e) => verdict::encode(e, b)?,
        Kind::Immediate(e) => immediate::encode(e, b)?,
    }
    b.end_nest(data);
    b.end_nest(elem);
    Ok(())
}

/// The kernel's name of the expression (`struct nft_expr_type.name`).
fn name(kind: &Kind) -> &'static str {
    match kind {
        Kind::Payload(_) => "payload",
        Kind::Meta(_) => "meta",
        Kind::Ct(_) => "ct",
        Kind::Fib(_) => "fib",
        Kind::Cmp(_) => "cmp",
        Kind::Bitwise(_) => "bitwise",
        Kind::Lookup(_) => "lookup",
        Kind::Numgen(_) => "numgen",
        Kind::Nat(_) => "nat",
        Kind::Masquerade(_) => "masq",
        Kind::Reject(_) => "reject",
        Kind::Dynset(_) => "dynset",
        Kind::Counter(_) => "counter",
        Kind::Verdict(_) | Kind::Immediate(_) => "immediate",
    }
}

/// `ty { NFTA_DATA_VALUE bytes }`, the nest that carries constants.
pub(crate) fn put_value(b: &mut NlaBuf, ty: u16, bytes: &[u8]) {
    let n = b.begin_nest(ty);
    b.put(NFTA_DATA_VALUE, bytes);
    b.end_nest(n);
}

pub(crate) use decode::decode;

/// The inverse of [`encode`]: expressions as the kernel dumps them, back into IR. Used by the
/// reader (nft/read.rs) and by the tests. Register numbers and constants are taken as they
/// come: a value no IR expression produces decodes into an expression the model does not hold,
/// which the comparison reports as drift.
mod decode {
    use splitproxy_proto::v1::{Expr, expr::Kind};

    use super::*;
    use crate::netlink::attr::{Attr, Attrs};
    use crate::nft::DecodeError;
    use crate::nft::consts::{NFT_REG_VERDICT, NFTA_IMMEDIATE_DREG};

    /// Reads one NFTA_LIST_ELEM of an expression list back into IR.
    pub(crate) fn decode(elem: &Attr<'_>) -> Result<Expr, DecodeError> {
        let attrs = elem.nested();
        let name = attrs
            .find(NFTA_EXPR_NAME)
            .and_then(|a| a.str())
            .ok_or_else(|| DecodeError::new("expression", "no name"))?;
        let data = attrs
            .find(NFTA_EXPR_DATA)
            .map(|a| a.nested())
            .unwrap_or_else(|| Attrs::new(&[]));
        let kind = match name {
            "payload" => Kind::Payload(payload::decode(&data)),
            "meta" => Kind::Meta(meta::decode(&data)),
            "ct" => Kind::Ct(ct::decode(&data)?),
            "fib" => Kind::Fib(fib::decode(&data)),
            "cmp" => Kind::Cmp(cmp::decode(&data)),
            "bitwise" => Kind::Bitwise(bitwise::decode(&data)?),
            "lookup" => Kind::Lookup(lookup::decode(&data)),
            "numgen" => Kind::Numgen(numgen::decode(&data)),
            "nat" => Kind::Nat(nat::decode(&data)),
            "masq" => Kind::Masquerade(masquerade::decode(&data)),
            "reject" => Kind::Reject(reject::decode(&data)),
            "dynset" => Kind::Dynset(dynset::decode(&data)?),
            "counter" => Kind::Counter(counter::decode(&data)),
            "immediate" => {
                let dreg = data.find(NFTA_IMMEDIATE_DREG).and_then(|a| a.u32_be());
                if dreg == Some(NFT_REG_VERDICT) {
                    Kind::Verdict(verdict::decode(&data)?)
                } else {
                    Kind::Immediate(immediate::decode(&data))
                }
            }
            other => {
                return Err(DecodeError::new(
                    "expression",
                    format!("unknown kind {other}"),
                ));
            }
        };
        Ok(Expr { kind: Some(kind) })
    }

    /// The bytes of `ty { NFTA_DATA_VALUE bytes }`.
    pub(crate) fn value(data: &Attrs<'_>, ty: u16) -> Vec<u8> {
        data.find(ty)
            .and_then(|a| a.nested().find(NFTA_DATA_VALUE))
            .map(|a| a.value.to_vec())
            .unwrap_or_default()
    }

    /// u32 attribute `ty`, or 0.
    pub(crate) fn u32_of(data: &Attrs<'_>, ty: u16) -> u32 {
        data.find(ty).and_then(|a| a.u32_be()).unwrap_or(0)
    }

    /// IR register of kernel register attribute `ty`.
    pub(crate) fn reg_of(data: &Attrs<'_>, ty: u16) -> u32 {
        ir_reg(u32_of(data, ty))
    }

    /// IR register of a kernel register number. Dumps from the kernel name the 32-bit
    /// registers that start a legacy 128-bit register (REG32_00, _04, _08, _12) NFT_REG_1..4.
    /// A number that is neither maps to a register no IR names (wrapping), so that the rule
    /// compares unequal instead of panicking.
    pub(crate) fn ir_reg(raw: u32) -> u32 {
        match raw {
            1..=4 => (raw - 1) * 4,
            _ => raw.wrapping_sub(crate::nft::consts::NFT_REG32_00),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::netlink::attr::Attrs;
    use crate::nft::consts::NFPROTO_IPV4;

    /// Encodes `kind` in an ip table and decodes it back.
    pub(crate) fn round_trip(kind: Kind) -> Kind {
        let expr = Expr { kind: Some(kind) };
        let mut b = NlaBuf::new();
        encode(
            &expr,
            Ctx {
                family: NFPROTO_IPV4,
            },
            &mut b,
        )
        .unwrap();
        assert!(!b.overflowed());
        let elems: Vec<_> = Attrs::new(b.bytes()).collect();
        assert_eq!(elems.len(), 1);
        assert_eq!(elems[0].ty, NFTA_LIST_ELEM);
        let back = decode(&elems[0]).unwrap();
        back.kind.unwrap()
    }

    /// Encodes `kind` and returns the error.
    pub(crate) fn encode_err(kind: Kind) -> EncodeError {
        let expr = Expr { kind: Some(kind) };
        encode(
            &expr,
            Ctx {
                family: NFPROTO_IPV4,
            },
            &mut NlaBuf::new(),
        )
        .unwrap_err()
    }

    #[test]
    fn an_expression_needs_a_kind() {
        let err = encode(
            &Expr { kind: None },
            Ctx {
                family: NFPROTO_IPV4,
            },
            &mut NlaBuf::new(),
        );
        assert_eq!(err, Err(EncodeError::Missing("expression kind")));
    }
}
