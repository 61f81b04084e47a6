//! Validation shared by the encoders: names, families, registers, enums, comments.
//!
//! The kernel would refuse most of these too, but only at commit time and for the whole
//! transaction; refusing them while encoding names the IR object at fault.

use splitproxy_proto::v1::Family;

use super::consts::{COMMENT_MAXLEN, NAME_MAXLEN, NFPROTO_INET, NFPROTO_IPV4, NFPROTO_IPV6};
use super::consts::{NFT_REG32_00, NFT_REG32_COUNT};
use super::error::EncodeError;

/// Table, chain and set names: non-empty (an absent name can mean "all" to the kernel), no NUL,
/// shorter than NFT_NAME_MAXLEN.
pub(crate) fn name(what: &'static str, name: &str) -> Result<(), EncodeError> {
    let why = if name.is_empty() {
        "empty"
    } else if name.contains('\0') {
        "contains NUL"
    } else if name.len() >= NAME_MAXLEN {
        "too long"
    } else {
        return Ok(());
    };
    Err(EncodeError::InvalidName {
        what,
        name: name.to_owned(),
        why,
    })
}

/// Comments travel NUL-terminated in libnftnl userdata, 128 bytes at most like `nft` allows.
pub(crate) fn comment(what: &'static str, comment: &str) -> Result<(), EncodeError> {
    if comment.contains('\0') {
        return Err(EncodeError::Invalid(format!("{what} comment contains NUL")));
    }
    if comment.len() + 1 > COMMENT_MAXLEN {
        return Err(EncodeError::CommentTooLong {
            what,
            max: COMMENT_MAXLEN - 1,
        });
    }
    Ok(())
}

/// NFPROTO_* of a table family. Unspecified is refused: to the kernel, AF_UNSPEC on a table
/// deletion means every family.
pub(crate) fn family(family: Family) -> Result<u8, EncodeError> {
    match family {
        Family::Ip => Ok(NFPROTO_IPV4),
        Family::Ip6 => Ok(NFPROTO_IPV6),
        Family::Inet => Ok(NFPROTO_INET),
        Family::Unspecified => Err(EncodeError::Family(family as i32)),
    }
}

/// Kernel number of IR 32-bit register `reg` (NFT_REG32_00 + reg).
pub(crate) fn reg(field: &'static str, reg: u32) -> Result<u32, EncodeError> {
    if reg < NFT_REG32_COUNT {
        Ok(NFT_REG32_00 + reg)
    } else {
        Err(EncodeError::Register { field, reg })
    }
}

/// A known, specified value of a protobuf enum field.
pub(crate) fn enum_value<T>(field: &'static str, value: i32) -> Result<T, EncodeError>
where
    T: TryFrom<i32>,
{
    T::try_from(value).map_err(|_| EncodeError::Enum { field, value })
}

/// Length of a constant: 1..=max bytes.
pub(crate) fn length(field: &'static str, len: usize, max: usize) -> Result<(), EncodeError> {
    if (1..=max).contains(&len) {
        Ok(())
    } else {
        Err(EncodeError::Length { field, len, max })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(name("table", "splitproxy").is_ok());
        assert!(name("table", "").is_err());
        assert!(name("table", "a\0b").is_err());
        assert!(name("table", &"x".repeat(256)).is_err());
    }

    #[test]
    fn registers_map_to_32_bit_kernel_registers() {
        assert_eq!(reg("r", 0), Ok(8));
        assert_eq!(reg("r", 15), Ok(23));
        assert!(reg("r", 16).is_err());
    }

    #[test]
    fn unspecified_family_is_refused() {
        assert!(family(Family::Unspecified).is_err());
        assert_eq!(family(Family::Ip), Ok(2));
    }
}
