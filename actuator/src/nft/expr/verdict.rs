//! Verdicts: `accept`, `drop`, `continue`, `return`, `jump chain`, `goto chain`. As a rule
//! expression a verdict is an `immediate` into the verdict register; as the value of a verdict
//! map element it is the same NFTA_DATA_VERDICT nest.

use splitproxy_proto::v1::{Verdict, VerdictCode};

use crate::netlink::attr::NlaBuf;
use crate::nft::check;
use crate::nft::consts::*;
use crate::nft::error::EncodeError;

/// The kernel's verdict code, and the chain for jump and goto.
fn lower(v: &Verdict) -> Result<(i32, Option<&str>), EncodeError> {
    let code = match check::enum_value::<VerdictCode>("verdict.code", v.code)? {
        VerdictCode::Accept => NF_ACCEPT,
        VerdictCode::Drop => NF_DROP,
        VerdictCode::Continue => NFT_CONTINUE,
        VerdictCode::Return => NFT_RETURN,
        VerdictCode::Jump => NFT_JUMP,
        VerdictCode::Goto => NFT_GOTO,
        VerdictCode::Unspecified => {
            return Err(EncodeError::Enum {
                field: "verdict.code",
                value: v.code,
            });
        }
    };
    if code == NFT_JUMP || code == NFT_GOTO {
        check::name("chain", &v.chain)?;
        Ok((code, Some(&v.chain)))
    } else if v.chain.is_empty() {
        Ok((code, None))
    } else {
        Err(EncodeError::Invalid(format!(
            "verdict {code} does not take a chain (got {:?})",
            v.chain
        )))
    }
}

/// `ty { NFTA_DATA_VERDICT { NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN } }`.
pub(crate) fn put_verdict(b: &mut NlaBuf, ty: u16, v: &Verdict) -> Result<(), EncodeError> {
    let (code, chain) = lower(v)?;
    let data = b.begin_nest(ty);
    let verdict = b.begin_nest(NFTA_DATA_VERDICT);
    b.put_i32_be(NFTA_VERDICT_CODE, code);
    if let Some(chain) = chain {
        b.put_strz(NFTA_VERDICT_CHAIN, chain);
    }
    b.end_nest(verdict);
    b.end_nest(data);
    Ok(())
}

pub(super) fn encode(e: &Verdict, b: &mut NlaBuf) -> Result<(), EncodeError> {
    b.put_u32_be(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT);
    put_verdict(b, NFTA_IMMEDIATE_DATA, e)
}

/// Reads `ty { NFTA_DATA_VERDICT {...} }` back (tests only).
pub(crate) fn decode_verdict(
    a: &crate::netlink::attr::Attrs<'_>,
    ty: u16,
) -> Result<Verdict, crate::nft::DecodeError> {
    let missing = || crate::nft::DecodeError::new("verdict", "no verdict code");
    let v = a
        .find(ty)
        .and_then(|d| d.nested().find(NFTA_DATA_VERDICT))
        .ok_or_else(missing)?;
    let attrs = v.nested();
    let code = attrs
        .find(NFTA_VERDICT_CODE)
        .and_then(|x| x.u32_be())
        .ok_or_else(missing)? as i32;
    let code = match code {
        NF_ACCEPT => VerdictCode::Accept,
        NF_DROP => VerdictCode::Drop,
        NFT_CONTINUE => VerdictCode::Continue,
        NFT_RETURN => VerdictCode::Return,
        NFT_JUMP => VerdictCode::Jump,
        NFT_GOTO => VerdictCode::Goto,
        _ => VerdictCode::Unspecified,
    };
    Ok(Verdict {
        code: code as i32,
        chain: attrs
            .find(NFTA_VERDICT_CHAIN)
            .and_then(|x| x.str())
            .unwrap_or_default()
            .to_owned(),
    })
}

pub(super) fn decode(
    a: &crate::netlink::attr::Attrs<'_>,
) -> Result<Verdict, crate::nft::DecodeError> {
    decode_verdict(a, NFTA_IMMEDIATE_DATA)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{encode_err, round_trip};
    use super::*;
    use splitproxy_proto::v1::expr::Kind;

    #[test]
    fn round_trip_every_verdict() {
        for (code, chain) in [
            (VerdictCode::Accept, ""),
            (VerdictCode::Drop, ""),
            (VerdictCode::Continue, ""),
            (VerdictCode::Return, ""),
            (VerdictCode::Jump, "services"),
            (VerdictCode::Goto, "endpoints-3"),
        ] {
            let v = Verdict {
                code: code as i32,
                chain: chain.to_owned(),
            };
            assert_eq!(round_trip(Kind::Verdict(v.clone())), Kind::Verdict(v));
        }
    }

    #[test]
    fn jump_needs_a_chain_and_accept_takes_none() {
        let jump = Verdict {
            code: VerdictCode::Jump as i32,
            chain: String::new(),
        };
        assert!(matches!(
            encode_err(Kind::Verdict(jump)),
            EncodeError::InvalidName { .. }
        ));
        let accept = Verdict {
            code: VerdictCode::Accept as i32,
            chain: "x".to_owned(),
        };
        assert!(matches!(
            encode_err(Kind::Verdict(accept)),
            EncodeError::Invalid(_)
        ));
        assert!(matches!(
            encode_err(Kind::Verdict(Verdict::default())),
            EncodeError::Enum { .. }
        ));
    }
}
