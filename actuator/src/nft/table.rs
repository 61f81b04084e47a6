//! Table messages: NFT_MSG_NEWTABLE, NFT_MSG_DELTABLE, NFT_MSG_DESTROYTABLE. The family
//! travels in the nfgenmsg header, the rest as attributes.

use super::check;
use super::consts::*;
use super::error::{DecodeError, EncodeError};
use super::udata::{Udata, comment_of};
use crate::netlink::attr::{Attrs, NlaBuf};

/// Attributes of a table creation: its name and its comment (libnftnl userdata).
pub(crate) fn encode_add(b: &mut NlaBuf, name: &str, comment: &str) -> Result<(), EncodeError> {
    check::name("table", name)?;
    check::comment("table", comment)?;
    b.put_strz(NFTA_TABLE_NAME, name);
    let udata = Udata::comment(NFTNL_UDATA_TABLE_COMMENT, comment);
    if !udata.is_empty() {
        b.put(NFTA_TABLE_USERDATA, udata.bytes());
    }
    Ok(())
}

/// Attributes of a table deletion: the name only. An empty name is refused: without a name
/// the kernel deletes every table of the family.
pub(crate) fn encode_del(b: &mut NlaBuf, name: &str) -> Result<(), EncodeError> {
    check::name("table", name)?;
    b.put_strz(NFTA_TABLE_NAME, name);
    Ok(())
}

/// (name, comment) of a table message's attributes (NFT_MSG_NEWTABLE, as a dump returns it).
pub(crate) fn decode(attrs: &Attrs<'_>) -> Result<(String, String), DecodeError> {
    let name = attrs
        .find(NFTA_TABLE_NAME)
        .and_then(|a| a.str())
        .ok_or_else(|| DecodeError::new("table", "no name"))?
        .to_owned();
    let comment = attrs
        .find(NFTA_TABLE_USERDATA)
        .map(|a| comment_of(a.value, NFTNL_UDATA_TABLE_COMMENT))
        .unwrap_or_default();
    Ok((name, comment))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// [`super::decode`], for tests.
    pub(crate) fn decode(attrs: &Attrs<'_>) -> (String, String) {
        super::decode(attrs).unwrap()
    }

    #[test]
    fn round_trip_add_and_del() {
        let mut b = NlaBuf::new();
        encode_add(&mut b, "splitproxy", "owned by splitproxy").unwrap();
        assert_eq!(
            decode(&Attrs::new(b.bytes())),
            ("splitproxy".to_owned(), "owned by splitproxy".to_owned())
        );
        let mut b = NlaBuf::new();
        encode_del(&mut b, "splitproxy").unwrap();
        assert_eq!(decode(&Attrs::new(b.bytes())).0, "splitproxy");
        assert!(encode_del(&mut NlaBuf::new(), "").is_err());
    }
}
