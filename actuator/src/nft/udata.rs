//! libnftnl "userdata": the TLVs (u8 type, u8 length, value) that `nft` stores in the kernel
//! next to tables, chains, rules, sets and elements. The kernel keeps them opaque; `nft list`
//! reads them back for comments and for the byte order of integer set keys.

/// A userdata blob under construction.
#[derive(Debug, Default)]
pub(crate) struct Udata(Vec<u8>);

impl Udata {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A u32 in host byte order, as `nftnl_udata_put_u32` writes it.
    pub(crate) fn put_u32(&mut self, ty: u8, v: u32) -> &mut Self {
        self.0.extend_from_slice(&[ty, 4]);
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }

    /// Raw bytes (at most 255).
    pub(crate) fn put(&mut self, ty: u8, v: &[u8]) -> &mut Self {
        let len = u8::try_from(v.len()).unwrap_or(u8::MAX);
        self.0.extend_from_slice(&[ty, len]);
        self.0.extend_from_slice(&v[..usize::from(len)]);
        self
    }

    /// A NUL-terminated string; callers keep it under 255 bytes (see `check::comment`).
    pub(crate) fn put_strz(&mut self, ty: u8, s: &str) -> &mut Self {
        let len = u8::try_from(s.len() + 1).unwrap_or(u8::MAX);
        self.0.extend_from_slice(&[ty, len]);
        self.0
            .extend_from_slice(&s.as_bytes()[..usize::from(len) - 1]);
        self.0.push(0);
        self
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// Userdata holding only a comment, or nothing for an empty comment.
    pub(crate) fn comment(ty: u8, comment: &str) -> Self {
        let mut u = Self::new();
        if !comment.is_empty() {
            u.put_strz(ty, comment);
        }
        u
    }
}

/// Reads a userdata blob back as (type, value) pairs; a truncated TLV ends the list.
pub(crate) fn parse(mut raw: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    while let [ty, len, rest @ ..] = raw {
        let len = usize::from(*len);
        let Some(value) = rest.get(..len) else { break };
        out.push((*ty, value));
        raw = &rest[len..];
    }
    out
}

/// The comment stored under `ty`, if any.
pub(crate) fn comment_of(raw: &[u8], ty: u8) -> String {
    parse(raw)
        .into_iter()
        .find(|(t, _)| *t == ty)
        .map(|(_, v)| String::from_utf8_lossy(v.strip_suffix(&[0]).unwrap_or(v)).into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut u = Udata::new();
        u.put_u32(0, 1).put_strz(7, "hello");
        let parsed = parse(u.bytes());
        assert_eq!(parsed[0], (0, &1u32.to_ne_bytes()[..]));
        assert_eq!(parsed[1], (7, &b"hello\0"[..]));
        assert_eq!(comment_of(u.bytes(), 7), "hello");
        assert!(Udata::comment(0, "").is_empty());
    }
}
