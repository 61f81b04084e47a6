//! Chain messages: NFT_MSG_NEWCHAIN (a regular chain, or a base chain with its hook, type,
//! priority and policy) and NFT_MSG_DELCHAIN. A chain's rules are separate messages.

use splitproxy_proto::v1::{BaseChain, Chain, ChainType, Hook};

use super::check;
use super::consts::*;
use super::error::{DecodeError, EncodeError};
use super::udata::{Udata, comment_of};
use crate::netlink::attr::{Attrs, NlaBuf};

fn hook_number(hook: i32) -> Result<u32, EncodeError> {
    Ok(match check::enum_value::<Hook>("chain.base.hook", hook)? {
        Hook::Prerouting => NF_INET_PRE_ROUTING,
        Hook::Input => NF_INET_LOCAL_IN,
        Hook::Forward => NF_INET_FORWARD,
        Hook::Output => NF_INET_LOCAL_OUT,
        Hook::Postrouting => NF_INET_POST_ROUTING,
        Hook::Unspecified => {
            return Err(EncodeError::Enum {
                field: "chain.base.hook",
                value: hook,
            });
        }
    })
}

fn type_name(ty: i32) -> Result<&'static str, EncodeError> {
    Ok(
        match check::enum_value::<ChainType>("chain.base.type", ty)? {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
            ChainType::Route => "route",
            ChainType::Unspecified => {
                return Err(EncodeError::Enum {
                    field: "chain.base.type",
                    value: ty,
                });
            }
        },
    )
}

/// Attributes of a chain declaration.
pub(crate) fn encode_add(b: &mut NlaBuf, table: &str, chain: &Chain) -> Result<(), EncodeError> {
    check::name("table", table)?;
    check::name("chain", &chain.name)?;
    check::comment("chain", &chain.comment)?;
    b.put_strz(NFTA_CHAIN_TABLE, table);
    b.put_strz(NFTA_CHAIN_NAME, &chain.name);
    if let Some(base) = &chain.base {
        encode_base(b, base)?;
    }
    let udata = Udata::comment(NFTNL_UDATA_CHAIN_COMMENT, &chain.comment);
    if !udata.is_empty() {
        b.put(NFTA_CHAIN_USERDATA, udata.bytes());
    }
    Ok(())
}

fn encode_base(b: &mut NlaBuf, base: &BaseChain) -> Result<(), EncodeError> {
    let hooknum = hook_number(base.hook)?;
    let ty = type_name(base.r#type)?;
    let hook = b.begin_nest(NFTA_CHAIN_HOOK);
    b.put_u32_be(NFTA_HOOK_HOOKNUM, hooknum);
    b.put_i32_be(NFTA_HOOK_PRIORITY, base.priority);
    b.end_nest(hook);
    let policy = if base.policy_drop { NF_DROP } else { NF_ACCEPT };
    b.put_i32_be(NFTA_CHAIN_POLICY, policy);
    b.put_strz(NFTA_CHAIN_TYPE, ty);
    Ok(())
}

/// Attributes naming a chain: for NFT_MSG_DELCHAIN, and for NFT_MSG_DELRULE, which without a
/// rule handle deletes every rule of the chain.
pub(crate) fn encode_name(
    b: &mut NlaBuf,
    table: &str,
    chain: &str,
    table_attr: u16,
    chain_attr: u16,
) -> Result<(), EncodeError> {
    check::name("table", table)?;
    check::name("chain", chain)?;
    b.put_strz(table_attr, table);
    b.put_strz(chain_attr, chain);
    Ok(())
}

/// (table, chain) of a chain message's attributes (NFT_MSG_NEWCHAIN, as a dump returns it);
/// the rules are separate messages.
pub(crate) fn decode(attrs: &Attrs<'_>) -> Result<(String, Chain), DecodeError> {
    let err = |why: &str| DecodeError::new("chain", why.to_owned());
    let s = |ty| {
        attrs
            .find(ty)
            .and_then(|a| a.str())
            .unwrap_or_default()
            .to_owned()
    };
    let base = match attrs.find(NFTA_CHAIN_HOOK) {
        None => None,
        Some(h) => {
            let h = h.nested();
            let num = h
                .find(NFTA_HOOK_HOOKNUM)
                .and_then(|a| a.u32_be())
                .ok_or_else(|| err("no hook number"))?;
            let hook = [
                Hook::Prerouting,
                Hook::Input,
                Hook::Forward,
                Hook::Output,
                Hook::Postrouting,
            ]
            .into_iter()
            .find(|k| hook_number(*k as i32).ok() == Some(num))
            .ok_or_else(|| err("unknown hook"))?;
            let ty = [ChainType::Filter, ChainType::Nat, ChainType::Route]
                .into_iter()
                .find(|t| type_name(*t as i32).ok() == Some(s(NFTA_CHAIN_TYPE).as_str()))
                .ok_or_else(|| err("unknown type"))?;
            let policy = attrs
                .find(NFTA_CHAIN_POLICY)
                .and_then(|a| a.u32_be())
                .ok_or_else(|| err("no policy"))?;
            let priority = h
                .find(NFTA_HOOK_PRIORITY)
                .and_then(|a| a.u32_be())
                .ok_or_else(|| err("no priority"))?;
            Some(BaseChain {
                hook: hook as i32,
                r#type: ty as i32,
                priority: priority as i32,
                policy_drop: policy == NF_DROP as u32,
            })
        }
    };
    let comment = attrs
        .find(NFTA_CHAIN_USERDATA)
        .map(|a| comment_of(a.value, NFTNL_UDATA_CHAIN_COMMENT))
        .unwrap_or_default();
    let chain = Chain {
        name: s(NFTA_CHAIN_NAME),
        base,
        comment,
        rules: vec![],
    };
    Ok((s(NFTA_CHAIN_TABLE), chain))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// [`super::decode`], for tests.
    pub(crate) fn decode(attrs: &Attrs<'_>) -> (String, Chain) {
        super::decode(attrs).unwrap()
    }

    #[test]
    fn round_trip_base_and_regular_chains() {
        let base = Chain {
            name: "nat-prerouting".to_owned(),
            base: Some(BaseChain {
                hook: Hook::Prerouting as i32,
                r#type: ChainType::Nat as i32,
                priority: -100,
                policy_drop: false,
            }),
            comment: "dnat to services".to_owned(),
            rules: vec![],
        };
        let drop = Chain {
            name: "filter-input".to_owned(),
            base: Some(BaseChain {
                hook: Hook::Input as i32,
                r#type: ChainType::Filter as i32,
                priority: -110,
                policy_drop: true,
            }),
            comment: String::new(),
            rules: vec![],
        };
        let regular = Chain {
            name: "services".to_owned(),
            ..Chain::default()
        };
        for c in [base, drop, regular] {
            let mut b = NlaBuf::new();
            encode_add(&mut b, "splitproxy", &c).unwrap();
            assert_eq!(decode(&Attrs::new(b.bytes())), ("splitproxy".to_owned(), c));
        }
    }

    #[test]
    fn base_chain_needs_hook_and_type() {
        let c = Chain {
            name: "x".to_owned(),
            base: Some(BaseChain::default()),
            ..Chain::default()
        };
        assert!(matches!(
            encode_add(&mut NlaBuf::new(), "t", &c),
            Err(EncodeError::Enum { .. })
        ));
    }
}
