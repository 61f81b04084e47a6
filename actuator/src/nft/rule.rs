//! Rule messages: NFT_MSG_NEWRULE appends a rule (its expressions, and its comment as
//! libnftnl userdata) to the end of a chain.

use splitproxy_proto::v1::Rule;

use super::check;
use super::consts::*;
use super::error::{DecodeError, EncodeError};
use super::expr::{self, Ctx};
use super::udata::{Udata, comment_of};
use crate::netlink::attr::{Attrs, NlaBuf};

pub(crate) fn encode_add(
    b: &mut NlaBuf,
    ctx: Ctx,
    table: &str,
    chain: &str,
    rule: &Rule,
) -> Result<(), EncodeError> {
    check::name("table", table)?;
    check::name("chain", chain)?;
    check::comment("rule", &rule.comment)?;
    if rule.exprs.is_empty() {
        return Err(EncodeError::Missing("rule expressions"));
    }
    b.put_strz(NFTA_RULE_TABLE, table);
    b.put_strz(NFTA_RULE_CHAIN, chain);
    let list = b.begin_nest(NFTA_RULE_EXPRESSIONS);
    for (i, e) in rule.exprs.iter().enumerate() {
        expr::encode(e, ctx, b)
            .map_err(|err| EncodeError::Invalid(format!("expression {i}: {err}")))?;
    }
    b.end_nest(list);
    let udata = Udata::comment(NFTNL_UDATA_RULE_COMMENT, &rule.comment);
    if !udata.is_empty() {
        b.put(NFTA_RULE_USERDATA, udata.bytes());
    }
    Ok(())
}

/// (table, chain, rule) of a rule message's attributes (NFT_MSG_NEWRULE, as a dump returns
/// it: the handle and position it also carries are not IR).
pub(crate) fn decode(attrs: &Attrs<'_>) -> Result<(String, String, Rule), DecodeError> {
    let s = |ty| {
        attrs
            .find(ty)
            .and_then(|a| a.str())
            .unwrap_or_default()
            .to_owned()
    };
    let exprs = match attrs.find(NFTA_RULE_EXPRESSIONS) {
        Some(l) => l
            .nested()
            .map(|e| expr::decode(&e))
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let comment = attrs
        .find(NFTA_RULE_USERDATA)
        .map(|a| comment_of(a.value, NFTNL_UDATA_RULE_COMMENT))
        .unwrap_or_default();
    Ok((
        s(NFTA_RULE_TABLE),
        s(NFTA_RULE_CHAIN),
        Rule { exprs, comment },
    ))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// [`super::decode`], for tests.
    pub(crate) fn decode(attrs: &Attrs<'_>) -> (String, String, Rule) {
        super::decode(attrs).unwrap()
    }

    #[test]
    fn round_trip_the_services_rule() {
        let rule = crate::nft::tests::fixture::services_rule();
        let mut b = NlaBuf::new();
        encode_add(
            &mut b,
            Ctx {
                family: NFPROTO_IPV4,
            },
            "splitproxy",
            "services",
            &rule,
        )
        .unwrap();
        let (t, c, back) = decode(&Attrs::new(b.bytes()));
        assert_eq!((t.as_str(), c.as_str()), ("splitproxy", "services"));
        assert_eq!(back, rule);
    }

    #[test]
    fn a_bad_expression_names_its_position() {
        let mut rule = crate::nft::tests::fixture::services_rule();
        rule.exprs[2].kind = None;
        let err = encode_add(
            &mut NlaBuf::new(),
            Ctx {
                family: NFPROTO_IPV4,
            },
            "t",
            "c",
            &rule,
        );
        assert!(err.unwrap_err().to_string().starts_with("expression 2:"));
        let empty = Rule::default();
        assert!(
            encode_add(
                &mut NlaBuf::new(),
                Ctx {
                    family: NFPROTO_IPV4
                },
                "t",
                "c",
                &empty
            )
            .is_err()
        );
    }
}
