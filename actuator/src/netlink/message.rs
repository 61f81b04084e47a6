//! Netlink messages: the nfnetlink header every request starts with, and the walk over the
//! messages of a received datagram with the decoding of NLMSG_ERROR (acknowledgements and
//! refusals, with the extended-ack text) and NLMSG_DONE.
//!
//! Layout reference: uapi `linux/netlink.h`. A datagram holds messages back to back, each
//! `nlmsghdr { len: u32, type: u16, flags: u16, seq: u32, pid: u32 }` (host byte order) and
//! its payload, padded to 4 bytes.

use super::attr::{Attrs, align4};
use super::consts::*;

/// nlmsghdr and nfgenmsg of an nfnetlink message: `ty` is `subsystem << 8 | message` (or a
/// control type such as a batch marker), `len` the whole message's length (0 when the caller
/// fills it in later), `res_id` the nfgenmsg's resource id (host order here, written
/// big-endian).
pub(crate) fn nfnl_header(
    ty: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    len: usize,
) -> [u8; NFNL_HEADER_LEN] {
    let mut m = [0u8; NFNL_HEADER_LEN];
    m[0..4].copy_from_slice(&(len as u32).to_ne_bytes());
    m[4..6].copy_from_slice(&ty.to_ne_bytes());
    m[6..8].copy_from_slice(&flags.to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    // m[12..16]: port id 0, the kernel's
    m[16] = family;
    m[17] = NFNETLINK_V0;
    m[18..20].copy_from_slice(&res_id.to_be_bytes());
    m
}

/// One message of a received datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Message<'a> {
    pub ty: u16,
    pub flags: u16,
    pub seq: u32,
    /// What follows the nlmsghdr, without the padding.
    pub payload: &'a [u8],
}

/// An NLMSG_ERROR: an acknowledgement when `errno` is 0, a refusal otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ack {
    pub seq: u32,
    /// Positive errno, 0 for success.
    pub errno: i32,
    /// NLMSGERR_ATTR_MSG: the kernel's extended-ack text.
    pub message: Option<String>,
    /// NLMSGERR_ATTR_OFFS: offset of the offending attribute in the original message.
    pub bad_attr: Option<u32>,
}

impl<'a> Message<'a> {
    /// The attributes of an nfnetlink message (after its nfgenmsg); `None` if it has no room
    /// for one.
    pub(crate) fn nfnl_attrs(&self) -> Option<&'a [u8]> {
        self.payload.get(NFGENMSG_LEN..)
    }

    /// The acknowledgement or refusal, if this is an NLMSG_ERROR with its error code.
    ///
    /// `struct nlmsgerr { int error; struct nlmsghdr msg; }`, then the original message's
    /// payload unless capped (NLM_F_CAPPED), then the extended-ack attributes if
    /// NLM_F_ACK_TLVS.
    pub(crate) fn ack(&self) -> Option<Ack> {
        if self.ty != NLMSG_ERROR {
            return None;
        }
        let error = i32::from_ne_bytes(self.payload.get(0..4)?.try_into().ok()?);
        let mut ack = Ack {
            seq: self.seq,
            errno: error.saturating_neg(),
            message: None,
            bad_attr: None,
        };
        if self.flags & NLM_F_ACK_TLVS == 0 {
            return Some(ack);
        }
        let Some(orig) = self.payload.get(4..4 + NLMSG_HDRLEN) else {
            return Some(ack);
        };
        let orig_len = u32::from_ne_bytes([orig[0], orig[1], orig[2], orig[3]]) as usize;
        let echoed = if self.flags & NLM_F_CAPPED != 0 {
            NLMSG_HDRLEN
        } else {
            align4(orig_len.max(NLMSG_HDRLEN))
        };
        for a in Attrs::new(self.payload.get(4 + echoed..).unwrap_or_default()) {
            match a.ty {
                NLMSGERR_ATTR_MSG => ack.message = a.str().map(str::to_owned),
                NLMSGERR_ATTR_OFFS => ack.bad_attr = a.u32_ne(),
                _ => {}
            }
        }
        Some(ack)
    }

    /// The positive errno a dump ended with (0: complete), if this is an NLMSG_DONE.
    pub(crate) fn done(&self) -> Option<i32> {
        if self.ty != NLMSG_DONE {
            return None;
        }
        let status = self
            .payload
            .get(0..4)
            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .unwrap_or(0);
        Some(status.saturating_neg().max(0))
    }
}

/// Why a datagram could not be walked to its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Malformed {
    #[error("netlink message of {len} bytes where {left} are left")]
    Truncated { len: usize, left: usize },
    #[error("{0} trailing bytes after the last netlink message")]
    Trailing(usize),
}

impl From<Malformed> for std::io::Error {
    fn from(e: Malformed) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }
}

/// The messages of one datagram, in order. A malformed message ends the walk with one
/// [`Malformed`]; callers that only look for what they know take `.map_while(Result::ok)`.
#[derive(Debug, Clone)]
pub(crate) struct Messages<'a> {
    buf: &'a [u8],
    failed: bool,
}

impl<'a> Messages<'a> {
    pub(crate) fn new(datagram: &'a [u8]) -> Self {
        Messages {
            buf: datagram,
            failed: false,
        }
    }
}

impl<'a> Iterator for Messages<'a> {
    type Item = Result<Message<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.buf.is_empty() {
            return None;
        }
        let buf = self.buf;
        if buf.len() < NLMSG_HDRLEN {
            self.failed = true;
            return Some(Err(Malformed::Trailing(buf.len())));
        }
        let len = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            self.failed = true;
            return Some(Err(Malformed::Truncated {
                len,
                left: buf.len(),
            }));
        }
        let msg = Message {
            ty: u16::from_ne_bytes([buf[4], buf[5]]),
            flags: u16::from_ne_bytes([buf[6], buf[7]]),
            seq: u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]),
            payload: &buf[NLMSG_HDRLEN..len],
        };
        self.buf = buf.get(align4(len)..).unwrap_or_default();
        Some(Ok(msg))
    }
}

/// Test fixtures: messages as the kernel writes them.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    /// A message of type `ty` with `body`, padded.
    pub(crate) fn message(ty: u16, flags: u16, seq: u32, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&flags.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(body);
        m.resize(align4(m.len()), 0);
        m
    }

    /// An NLMSG_ERROR with `error` (0 or a negative errno) for a capped original message,
    /// then the extended-ack attributes `tlvs`.
    pub(crate) fn error(seq: u32, error: i32, tlvs: &[u8]) -> Vec<u8> {
        let flags = NLM_F_CAPPED | if tlvs.is_empty() { 0 } else { NLM_F_ACK_TLVS };
        let mut body = error.to_ne_bytes().to_vec();
        body.extend_from_slice(&[0; NLMSG_HDRLEN]);
        body.extend_from_slice(tlvs);
        message(NLMSG_ERROR, flags, seq, &body)
    }

    /// An NLMSG_DONE ending a dump with `status` (0 or a negative errno).
    pub(crate) fn done(seq: u32, status: i32) -> Vec<u8> {
        message(
            NLMSG_DONE,
            netlink_packet_core::NLM_F_MULTIPART,
            seq,
            &status.to_ne_bytes(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;
    use crate::netlink::attr::NlaBuf;

    #[test]
    fn walks_the_messages_of_a_datagram() {
        let mut dgram = message(0x0a0c, 2, 5, &[2, 0, 0, 0, 8, 0, 1, 0, 1, 2, 3, 4]);
        // A body whose length is not a multiple of 4: the next message starts padded.
        dgram.extend(message(0x0102, 0, 6, &[1, 2, 3]));
        dgram.extend(done(5, 0));
        let msgs: Vec<Message<'_>> = Messages::new(&dgram).map(Result::unwrap).collect();
        assert_eq!(msgs.len(), 3);
        assert_eq!((msgs[0].ty, msgs[0].flags, msgs[0].seq), (0x0a0c, 2, 5));
        let attrs: Vec<_> = Attrs::new(msgs[0].nfnl_attrs().unwrap()).collect();
        assert_eq!((attrs[0].ty, attrs[0].value), (1, &[1, 2, 3, 4][..]));
        assert_eq!(msgs[1].payload, &[1, 2, 3]);
        assert_eq!(msgs[1].ack(), None);
        assert_eq!(msgs[2].done(), Some(0));
        assert_eq!(msgs[0].done(), None);
    }

    #[test]
    fn a_malformed_datagram_ends_the_walk_with_one_error() {
        let whole = message(0x0a0c, 0, 1, &[0; 8]);
        let mut dgram = whole.clone();
        dgram.extend_from_slice(&whole[..10]);
        let walked: Vec<_> = Messages::new(&dgram).collect();
        assert_eq!(walked.len(), 2);
        assert!(walked[0].is_ok());
        assert_eq!(walked[1], Err(Malformed::Trailing(10)));

        let walked: Vec<_> = Messages::new(&whole[..20]).collect();
        assert_eq!(
            walked,
            vec![Err(Malformed::Truncated { len: 24, left: 20 })]
        );
        // A length shorter than the header cannot be stepped over.
        let mut zero = whole.clone();
        zero[0..4].copy_from_slice(&0u32.to_ne_bytes());
        assert_eq!(
            Messages::new(&zero).collect::<Vec<_>>(),
            vec![Err(Malformed::Truncated { len: 0, left: 24 })]
        );
        assert_eq!(Messages::new(&[]).count(), 0);
        let e: std::io::Error = Malformed::Trailing(3).into();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn decodes_acks_refusals_and_extended_acks() {
        let mut tlvs = NlaBuf::new();
        tlvs.put_strz(NLMSGERR_ATTR_MSG, "bad thing");
        tlvs.put(NLMSGERR_ATTR_OFFS, &44u32.to_ne_bytes());
        let mut dgram = error(7, 0, &[]);
        dgram.extend(error(8, -2, tlvs.bytes()));
        let acks: Vec<Ack> = Messages::new(&dgram)
            .map_while(Result::ok)
            .filter_map(|m| m.ack())
            .collect();
        assert_eq!(
            acks,
            vec![
                Ack {
                    seq: 7,
                    errno: 0,
                    message: None,
                    bad_attr: None
                },
                Ack {
                    seq: 8,
                    errno: 2,
                    message: Some("bad thing".to_owned()),
                    bad_attr: Some(44)
                },
            ]
        );
    }

    #[test]
    fn an_uncapped_error_echoes_the_original_message_before_its_tlvs() {
        // The original message (24 bytes) echoed whole, then the TLVs.
        let orig = message(0x0a06, NLM_F_REQUEST, 9, &[0xee; 8]);
        let mut tlvs = NlaBuf::new();
        tlvs.put_strz(NLMSGERR_ATTR_MSG, "no such chain");
        let mut body = (-2i32).to_ne_bytes().to_vec();
        body.extend_from_slice(&orig);
        body.extend_from_slice(tlvs.bytes());
        let dgram = message(NLMSG_ERROR, NLM_F_ACK_TLVS, 9, &body);
        let ack = Messages::new(&dgram)
            .next()
            .unwrap()
            .unwrap()
            .ack()
            .unwrap();
        assert_eq!(ack.errno, 2);
        assert_eq!(ack.message.as_deref(), Some("no such chain"));
    }

    #[test]
    fn a_dump_ends_with_its_status() {
        let m = done(3, -4);
        let msg = Messages::new(&m).next().unwrap().unwrap();
        assert_eq!(msg.done(), Some(4));
        // An NLMSG_DONE without a status is a complete dump.
        let bare = message(NLMSG_DONE, 0, 3, &[]);
        assert_eq!(
            Messages::new(&bare).next().unwrap().unwrap().done(),
            Some(0)
        );
        // An error without its code is not read as an acknowledgement.
        let short = message(NLMSG_ERROR, 0, 3, &[1, 2]);
        assert_eq!(Messages::new(&short).next().unwrap().unwrap().ack(), None);
    }

    #[test]
    fn nfnetlink_headers_carry_type_flags_family_and_subsystem() {
        let h = nfnl_header(0x0a06, NLM_F_REQUEST | NLM_F_ACK, 42, 2, 10, 64);
        assert_eq!(u32::from_ne_bytes(h[0..4].try_into().unwrap()), 64);
        assert_eq!(u16::from_ne_bytes([h[4], h[5]]), 0x0a06);
        assert_eq!(u16::from_ne_bytes([h[6], h[7]]), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(u32::from_ne_bytes(h[8..12].try_into().unwrap()), 42);
        assert_eq!(&h[16..20], &[2, NFNETLINK_V0, 0, 10]);
        let walked = Messages::new(&h[..16]).next().unwrap();
        assert_eq!(walked, Err(Malformed::Truncated { len: 64, left: 16 }));
    }
}
