//! Netlink attributes (NLA): a writer that appends them to one growing buffer, and a reader.
//!
//! The writer works on a single `Vec<u8>` rather than on attribute objects so that a batch of
//! 100,000 set elements costs a few memcpys, not 100,000 allocations. An attribute header is
//! `nla_len: u16, nla_type: u16` in host byte order, the value follows, padded to 4 bytes.
//! nf_tables values are mostly big-endian; the caller picks the byte order of each value.

use super::consts::{NLA_F_NESTED, NLA_HDRLEN, NLA_MAX_LEN, NLA_TYPE_MASK};

/// Round up to the netlink alignment of 4 bytes.
pub(crate) const fn align4(len: usize) -> usize {
    (len + 3) & !3
}

/// The bytes of a batch under construction, with a sticky flag for attributes that outgrew
/// `nla_len`. The flag lets the encoders write without checking every call; whoever finishes a
/// message checks [`NlaBuf::overflowed`] once.
#[derive(Debug, Default, Clone)]
pub(crate) struct NlaBuf {
    bytes: Vec<u8>,
    overflow: bool,
}

/// An open nested attribute; close it with [`NlaBuf::end_nest`].
#[must_use]
pub(crate) struct Nest(usize);

impl NlaBuf {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Drops everything written after `len` (to roll back a message that failed to encode).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.bytes.truncate(len);
    }

    pub(crate) fn overflowed(&self) -> bool {
        self.overflow
    }

    pub(crate) fn clear_overflow(&mut self) {
        self.overflow = false;
    }

    pub(crate) fn clear(&mut self) {
        self.bytes.clear();
        self.overflow = false;
    }

    /// Appends raw, already aligned bytes (a header, or an attribute encoded elsewhere).
    pub(crate) fn extend_raw(&mut self, raw: &[u8]) {
        self.bytes.extend_from_slice(raw);
    }

    pub(crate) fn put_u16_ne_at(&mut self, at: usize, v: u16) {
        self.bytes[at..at + 2].copy_from_slice(&v.to_ne_bytes());
    }

    pub(crate) fn put_u32_ne_at(&mut self, at: usize, v: u32) {
        self.bytes[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }

    pub(crate) fn put(&mut self, ty: u16, value: &[u8]) {
        let len = NLA_HDRLEN + value.len();
        if len > NLA_MAX_LEN {
            self.overflow = true;
            return;
        }
        self.bytes.extend_from_slice(&(len as u16).to_ne_bytes());
        self.bytes.extend_from_slice(&ty.to_ne_bytes());
        self.bytes.extend_from_slice(value);
        self.pad();
    }

    pub(crate) fn put_u8(&mut self, ty: u16, v: u8) {
        self.put(ty, &[v]);
    }

    pub(crate) fn put_u32_be(&mut self, ty: u16, v: u32) {
        self.put(ty, &v.to_be_bytes());
    }

    pub(crate) fn put_i32_be(&mut self, ty: u16, v: i32) {
        self.put(ty, &v.to_be_bytes());
    }

    pub(crate) fn put_u64_be(&mut self, ty: u16, v: u64) {
        self.put(ty, &v.to_be_bytes());
    }

    /// A NUL-terminated string, as libmnl's `mnl_attr_put_strz` writes it. Callers validate
    /// that `s` holds no NUL of its own.
    pub(crate) fn put_strz(&mut self, ty: u16, s: &str) {
        let len = NLA_HDRLEN + s.len() + 1;
        if len > NLA_MAX_LEN {
            self.overflow = true;
            return;
        }
        self.bytes.extend_from_slice(&(len as u16).to_ne_bytes());
        self.bytes.extend_from_slice(&ty.to_ne_bytes());
        self.bytes.extend_from_slice(s.as_bytes());
        self.bytes.push(0);
        self.pad();
    }

    pub(crate) fn begin_nest(&mut self, ty: u16) -> Nest {
        let at = self.bytes.len();
        self.bytes.extend_from_slice(&0u16.to_ne_bytes());
        self.bytes
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        Nest(at)
    }

    pub(crate) fn end_nest(&mut self, nest: Nest) {
        let len = self.bytes.len() - nest.0;
        if len > NLA_MAX_LEN {
            self.overflow = true;
            return;
        }
        self.put_u16_ne_at(nest.0, len as u16);
    }

    fn pad(&mut self) {
        let padded = align4(self.bytes.len());
        self.bytes.resize(padded, 0);
    }
}

/// One attribute read back: its type (flags stripped), its value, and where it starts in the
/// buffer the iterator was created on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attr<'a> {
    pub ty: u16,
    pub value: &'a [u8],
    pub offset: usize,
}

impl<'a> Attr<'a> {
    pub(crate) fn u32_be(&self) -> Option<u32> {
        Some(u32::from_be_bytes(self.value.get(..4)?.try_into().ok()?))
    }

    pub(crate) fn u32_ne(&self) -> Option<u32> {
        Some(u32::from_ne_bytes(self.value.get(..4)?.try_into().ok()?))
    }

    /// The string value without its terminating NUL.
    pub(crate) fn str(&self) -> Option<&'a str> {
        let raw = self.value.split(|b| *b == 0).next()?;
        std::str::from_utf8(raw).ok()
    }

    /// The attributes nested in this one; their offsets are relative to the same buffer as
    /// this attribute's.
    pub(crate) fn nested(&self) -> Attrs<'a> {
        Attrs::with_base(self.value, self.offset + NLA_HDRLEN)
    }
}

/// Iterates the attributes of a buffer; stops at the first malformed one.
#[derive(Debug, Clone)]
pub(crate) struct Attrs<'a> {
    buf: &'a [u8],
    pos: usize,
    base: usize,
}

impl<'a> Attrs<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self::with_base(buf, 0)
    }

    /// `base` is added to every reported offset, so that offsets can be made relative to an
    /// enclosing message.
    pub(crate) fn with_base(buf: &'a [u8], base: usize) -> Self {
        Self { buf, pos: 0, base }
    }

    /// The first attribute of type `ty`.
    pub(crate) fn find(&self, ty: u16) -> Option<Attr<'a>> {
        let mut attrs = self.clone();
        Iterator::find(&mut attrs, |a| a.ty == ty)
    }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Attr<'a>;

    fn next(&mut self) -> Option<Attr<'a>> {
        let rest = self.buf.get(self.pos..)?;
        if rest.len() < NLA_HDRLEN {
            return None;
        }
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        let ty = u16::from_ne_bytes([rest[2], rest[3]]) & NLA_TYPE_MASK;
        if len < NLA_HDRLEN || len > rest.len() {
            return None;
        }
        let attr = Attr {
            ty,
            value: &rest[NLA_HDRLEN..len],
            offset: self.base + self.pos,
        };
        self.pos += align4(len);
        Some(attr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_aligned_attributes_and_nests() {
        let mut b = NlaBuf::new();
        b.put_strz(1, "ab");
        let n = b.begin_nest(2);
        b.put_u32_be(3, 0x0102_0304);
        b.put_u8(4, 9);
        b.end_nest(n);
        assert!(!b.overflowed());
        // "ab\0" = 3 bytes -> len 7 padded to 8; nest = 4 + 8 + 8 = 20.
        assert_eq!(b.len(), 8 + 20);
        let attrs: Vec<_> = Attrs::new(b.bytes()).collect();
        assert_eq!(attrs.len(), 2);
        assert_eq!(attrs[0].str(), Some("ab"));
        assert_eq!(attrs[1].ty, 2);
        let inner: Vec<_> = attrs[1].nested().collect();
        assert_eq!(inner[0].u32_be(), Some(0x0102_0304));
        assert_eq!(inner[0].offset, 12);
        assert_eq!(inner[1].value, &[9]);
    }

    #[test]
    fn oversized_attribute_sets_the_flag() {
        let mut b = NlaBuf::new();
        let n = b.begin_nest(1);
        b.put(2, &vec![0; 40_000]);
        b.put(2, &vec![0; 40_000]);
        b.end_nest(n);
        assert!(b.overflowed());
    }

    #[test]
    fn reader_stops_on_truncated_input() {
        let mut b = NlaBuf::new();
        b.put_u32_be(1, 1);
        let bytes = &b.bytes()[..6];
        assert_eq!(Attrs::new(bytes).count(), 0);
    }
}
