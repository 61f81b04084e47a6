//! [`NftSocket`]: a NETLINK_NETFILTER socket that commits a [`Batch`] as one transaction.
//!
//! The whole batch goes out in one `sendmsg`: NFNL_MSG_BATCH_BEGIN, the messages (from the
//! batch's own buffer), BATCH_END. The kernel processes it synchronously inside that call,
//! commits or rolls back, and queues one acknowledgement per message on our socket. Two limits
//! make naive clients fail on big batches, and both are lifted here:
//! - the send buffer: a datagram longer than SO_SNDBUF fails (EMSGSIZE); it is raised with
//!   SO_SNDBUFFORCE (as `nft` does; CAP_NET_ADMIN, which nf_tables needs anyway), falling back
//!   to SO_SNDBUF, which net.core.wmem_max caps;
//! - the receive buffer: acknowledgements that do not fit are dropped (ENOBUFS), leaving the
//!   outcome unknown; it is raised to hold one per message, and acknowledgements are capped
//!   (NETLINK_CAP_ACK) so that an error does not echo a 60 KiB message back.

use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use netlink_sys::Socket;
use nix::sys::socket::{MsgFlags, sendmsg, setsockopt, sockopt};

use splitproxy_proto::v1::Family;

use super::batch::{Batch, HEADER_LEN};
use super::check;
use super::consts::*;
use super::element::{self, RawElement};
use super::error::{CommitError, MessageFailure};
use crate::netlink;
use crate::netlink::attr::{Attrs, NlaBuf};
use crate::netlink::message::{Ack, Messages, nfnl_header};

/// Longest wait for an acknowledgement. Batches are processed synchronously within `send`, so
/// the acknowledgements are normally queued before we read; this only bounds the unexpected.
const ACK_TIMEOUT: Duration = Duration::from_secs(10);
/// Receive buffer accounted per queued acknowledgement (skb overhead included).
const RCVBUF_PER_ACK: usize = 2048;
/// Headroom on top of the batch length for the send buffer.
const SNDBUF_HEADROOM: usize = 64 * 1024;
const RX_BUF_LEN: usize = 64 * 1024;

/// A netlink socket to nf_tables in the network namespace of the thread that opened it.
#[derive(Debug)]
pub struct NftSocket {
    sock: Socket,
    seq: u32,
    /// The requests other than commits (a few bytes each), reused. A commit is sent from its
    /// batch's own buffer, not copied here: a node's first commit is its whole ruleset
    /// (megabytes at 10,000 Services), and a copy would double the actuator's peak memory and,
    /// kept for the next commit, stay resident for the life of the process.
    out: Vec<u8>,
    rx: Vec<u8>,
    sndbuf: usize,
    rcvbuf: usize,
}

/// Sequence number of message `i` of a batch whose BATCH_BEGIN has `base`.
fn seq_of(base: u32, i: usize) -> u32 {
    base.wrapping_add(1).wrapping_add(i as u32)
}

impl NftSocket {
    /// Opens the socket in the current thread's network namespace.
    pub fn open() -> io::Result<Self> {
        let sock = netlink::open(ACK_TIMEOUT, true)?;
        // Like libmnl, start from the clock so that a restarted process does not reuse the
        // previous one's sequence numbers.
        let seq = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as u32)
            .unwrap_or(1);
        Ok(Self {
            sock,
            seq,
            out: Vec::new(),
            rx: Vec::with_capacity(RX_BUF_LEN),
            sndbuf: 0,
            rcvbuf: 0,
        })
    }

    /// Sends `batch` as one transaction and waits for every acknowledgement. On error the
    /// kernel has rolled the whole transaction back (see [`CommitError::rolled_back`]). The
    /// batch's messages are numbered in place for this socket (see `seq_of`).
    pub fn commit(&mut self, batch: &mut Batch) -> Result<(), CommitError> {
        if let Some(e) = batch.error() {
            return Err(CommitError::Encode(e.clone()));
        }
        if batch.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let base = self.seq;
        self.seq = base.wrapping_add(batch.len() as u32 + 2);
        let (begin, end) = number(batch, base);
        let total = batch.byte_len() + 2 * HEADER_LEN;
        let send_err = |source| CommitError::Send {
            messages: batch.len(),
            bytes: batch.byte_len(),
            source,
        };
        self.drain_stale();
        self.size_buffers(total, batch.len()).map_err(send_err)?;
        // One datagram from three pieces: the kernel takes a netlink message whole.
        let sent = sendmsg::<()>(
            self.sock.as_raw_fd(),
            &[
                IoSlice::new(&begin),
                IoSlice::new(batch.bytes()),
                IoSlice::new(&end),
            ],
            &[],
            MsgFlags::empty(),
            None,
        )
        .map_err(|e| send_err(io::Error::from(e)))?;
        if sent != total {
            return Err(send_err(io::Error::other(format!(
                "short send: {sent} of {total} bytes"
            ))));
        }
        let r = self.read_acks(batch, base);
        tracing::debug!(
            messages = batch.len(),
            bytes = total,
            elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
            ok = r.is_ok(),
            "nft commit"
        );
        r
    }

    /// Lists the elements of set `set` in table `family table` (an NFT_MSG_GETSETELEM dump),
    /// as bytes. Meant for what only the kernel knows, such as the entries the packet path
    /// adds to a dynamic map; what the actuator sent, it reads from its model instead.
    pub fn dump_elements(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> io::Result<Vec<RawElement>> {
        let invalid = |e: super::EncodeError| io::Error::new(io::ErrorKind::InvalidInput, e);
        let nfproto = check::family(family).map_err(invalid)?;
        check::name("table", table).map_err(invalid)?;
        check::name("set", set).map_err(invalid)?;
        let mut attrs = NlaBuf::new();
        attrs.put_strz(NFTA_SET_ELEM_LIST_TABLE, table);
        attrs.put_strz(NFTA_SET_ELEM_LIST_SET, set);
        let mut out = Vec::new();
        self.dump(NFT_MSG_GETSETELEM, nfproto, &attrs, |attrs| {
            if let Some(list) = Attrs::new(attrs).find(NFTA_SET_ELEM_LIST_ELEMENTS) {
                element::decode_raw(&list, &mut out);
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Runs one dump (`get`: NFT_MSG_GET*, with NLM_F_DUMP) in family `nfproto` filtered by
    /// `attrs`, calling `each` with the attributes of every object message of the reply. An
    /// error the kernel answers instead (ENOENT for a missing table or set) is returned as
    /// such; a dump the kernel marks interrupted (NLM_F_DUMP_INTR: a commit happened while it
    /// ran) is an `Interrupted` error, for the caller to retry.
    pub(crate) fn dump(
        &mut self,
        get: u8,
        nfproto: u8,
        attrs: &NlaBuf,
        mut each: impl FnMut(&[u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        let seq = self.request(get, NLM_F_DUMP, nfproto, attrs.bytes())?;
        let mut interrupted = false;
        // The kernel fills one datagram per read (at most 32 KiB), until NLMSG_DONE.
        loop {
            self.rx.clear();
            let n = self.sock.recv(&mut self.rx, 0)?.min(self.rx.len());
            for msg in Messages::new(&self.rx[..n]) {
                let msg = msg?;
                if msg.seq != seq {
                    continue; // not ours: left over from an earlier request
                }
                // NLMSG_DONE carries the dump's result, NLMSG_ERROR a refusal of the request.
                match msg.done().or_else(|| msg.ack().map(|a| a.errno)) {
                    Some(0) if interrupted => {
                        return Err(io::Error::new(
                            io::ErrorKind::Interrupted,
                            "the ruleset changed during the dump",
                        ));
                    }
                    Some(0) => return Ok(()),
                    Some(errno) => return Err(io::Error::from_raw_os_error(errno)),
                    None => {
                        interrupted |= msg.flags & NLM_F_DUMP_INTR != 0;
                        each(msg.nfnl_attrs().unwrap_or_default())?;
                    }
                }
            }
        }
    }

    /// The nf_tables generation of this network namespace (NFT_MSG_GETGEN): a number the
    /// kernel bumps with every committed transaction, whoever sent it. Equal numbers mean
    /// nothing was committed in between.
    pub fn generation(&mut self) -> io::Result<u32> {
        let mut id = None;
        self.get(NFT_MSG_GETGEN, |attrs| {
            id = Attrs::new(attrs).find(NFTA_GEN_ID).and_then(|a| a.u32_be());
        })?;
        id.ok_or_else(|| io::Error::other("NFT_MSG_NEWGEN without NFTA_GEN_ID"))
    }

    /// One request that is not a dump, answered with one message (`each` sees its
    /// attributes) and an acknowledgement.
    fn get(&mut self, get: u8, mut each: impl FnMut(&[u8])) -> io::Result<()> {
        let seq = self.request(get, NLM_F_ACK, AF_UNSPEC, &[])?;
        let mut answered = false;
        loop {
            self.rx.clear();
            let n = self.sock.recv(&mut self.rx, 0)?.min(self.rx.len());
            for msg in Messages::new(&self.rx[..n]) {
                let msg = msg?;
                if msg.seq != seq {
                    continue;
                }
                match msg.ack() {
                    Some(a) if a.errno != 0 => return Err(io::Error::from_raw_os_error(a.errno)),
                    Some(_) if answered => return Ok(()),
                    Some(_) => {
                        return Err(io::Error::other("acknowledged without an answer"));
                    }
                    None => {
                        answered = true;
                        each(msg.nfnl_attrs().unwrap_or_default());
                    }
                }
            }
        }
    }

    /// Sends one nf_tables request (`get` with `flags` besides NLM_F_REQUEST, for `nfproto`,
    /// carrying `attrs`) under the next sequence number, after dropping whatever an earlier
    /// request left unread, and returns that number: the answers to look for.
    fn request(&mut self, get: u8, flags: u16, nfproto: u8, attrs: &[u8]) -> io::Result<u32> {
        let seq = self.seq;
        self.seq = seq.wrapping_add(1);
        self.out.clear();
        self.out.extend_from_slice(&nfnl_header(
            (NFNL_SUBSYS_NFTABLES << 8) | u16::from(get),
            NLM_F_REQUEST | flags,
            seq,
            nfproto,
            0,
            HEADER_LEN + attrs.len(),
        ));
        self.out.extend_from_slice(attrs);
        self.drain_stale();
        let sent = self.sock.send(&self.out, 0)?;
        if sent != self.out.len() {
            return Err(io::Error::other(format!(
                "short send: {sent} of {} bytes",
                self.out.len()
            )));
        }
        Ok(seq)
    }

    /// Raises the socket buffers so the datagram fits and every acknowledgement can queue.
    fn size_buffers(&mut self, bytes: usize, messages: usize) -> io::Result<()> {
        // The kernel doubles the value it is given, an int.
        let max = (i32::MAX / 2) as usize;
        let snd = (bytes + SNDBUF_HEADROOM).min(max);
        if snd > self.sndbuf {
            if setsockopt(&self.sock, sockopt::SndBufForce, &snd).is_err() {
                setsockopt(&self.sock, sockopt::SndBuf, &snd).map_err(io::Error::from)?;
            }
            self.sndbuf = snd;
        }
        let rcv = ((messages + 2) * RCVBUF_PER_ACK + RX_BUF_LEN).min(max);
        if rcv > self.rcvbuf {
            if setsockopt(&self.sock, sockopt::RcvBufForce, &rcv).is_err() {
                setsockopt(&self.sock, sockopt::RcvBuf, &rcv).map_err(io::Error::from)?;
            }
            self.rcvbuf = rcv;
        }
        Ok(())
    }

    /// Discards whatever an earlier, interrupted commit left queued.
    fn drain_stale(&mut self) {
        loop {
            self.rx.clear();
            match self.sock.recv(&mut self.rx, libc_flags::MSG_DONTWAIT) {
                Ok(_) => continue,
                Err(e) if e.raw_os_error() == Some(libc_flags::ENOBUFS) => continue,
                Err(_) => return,
            }
        }
    }

    fn read_acks(&mut self, batch: &Batch, base: u32) -> Result<(), CommitError> {
        let expected = batch.len();
        let mut acked = vec![false; expected];
        let mut received = 0;
        let mut failures: Vec<MessageFailure> = Vec::new();
        // After an error on the batch itself the kernel may send nothing more: stop waiting.
        let mut drain_only = false;
        let mut last_err: Option<io::Error> = None;
        while received < expected {
            self.rx.clear();
            let flags = if drain_only {
                libc_flags::MSG_DONTWAIT
            } else {
                0
            };
            let n = match self.sock.recv(&mut self.rx, flags) {
                Ok(n) => n.min(self.rx.len()),
                Err(e) if e.raw_os_error() == Some(libc_flags::ENOBUFS) => {
                    // Some acknowledgements were dropped; read what is left, without waiting.
                    last_err = Some(e);
                    drain_only = true;
                    continue;
                }
                Err(e) => {
                    last_err = Some(e);
                    break;
                }
            };
            for ack in parse_acks(&self.rx[..n]) {
                let rel = ack.seq.wrapping_sub(base) as usize;
                if rel == 0 || rel == expected + 1 {
                    if ack.errno != 0 {
                        failures.push(MessageFailure {
                            errno: ack.errno,
                            message: None,
                            description: "the transaction".to_owned(),
                            kernel_message: ack.message,
                        });
                        drain_only = true;
                    }
                    continue;
                }
                let Some(i) = rel.checked_sub(1).filter(|i| *i < expected) else {
                    continue; // not ours: a stale acknowledgement
                };
                if !acked[i] {
                    acked[i] = true;
                    received += 1;
                }
                if ack.errno != 0 {
                    failures.push(MessageFailure {
                        errno: ack.errno,
                        message: Some(i),
                        description: batch.describe(i, ack.bad_attr),
                        kernel_message: ack.message,
                    });
                }
            }
        }
        if !failures.is_empty() {
            // Report batch-level errors after the messages that caused them, if any.
            failures.sort_by_key(|f| f.message.unwrap_or(usize::MAX));
            return Err(CommitError::Rejected { failures });
        }
        if received < expected {
            return Err(CommitError::AcksLost {
                expected,
                received,
                source: last_err.unwrap_or_else(|| io::Error::from(io::ErrorKind::TimedOut)),
            });
        }
        Ok(())
    }
}

/// The few libc numbers needed here, without a direct libc dependency.
mod libc_flags {
    pub const MSG_DONTWAIT: i32 = nix::sys::socket::MsgFlags::MSG_DONTWAIT.bits();
    pub const ENOBUFS: i32 = nix::errno::Errno::ENOBUFS as i32;
}

/// Numbers the messages of `batch` from `base + 1` and returns the BATCH_BEGIN (numbered
/// `base`) and BATCH_END that go before and after them.
fn number(batch: &mut Batch, base: u32) -> ([u8; HEADER_LEN], [u8; HEADER_LEN]) {
    batch.stamp_sequence(|i| seq_of(base, i));
    (
        batch_marker(NFNL_MSG_BATCH_BEGIN, base),
        batch_marker(NFNL_MSG_BATCH_END, seq_of(base, batch.len())),
    )
}

/// NFNL_MSG_BATCH_BEGIN or _END for the nf_tables subsystem.
fn batch_marker(ty: u16, seq: u32) -> [u8; HEADER_LEN] {
    nfnl_header(
        ty,
        NLM_F_REQUEST,
        seq,
        AF_UNSPEC,
        NFNL_SUBSYS_NFTABLES,
        HEADER_LEN,
    )
}

/// The acknowledgements in one received datagram; other message types are skipped, and so
/// is whatever follows a malformed message.
fn parse_acks(buf: &[u8]) -> Vec<Ack> {
    Messages::new(buf)
        .map_while(Result::ok)
        .filter_map(|m| m.ack())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::netlink::message::fixtures::error;

    /// A message of type `ty` of a dump, with `body`.
    fn message(ty: u16, seq: u32, body: &[u8]) -> Vec<u8> {
        crate::netlink::message::fixtures::message(
            ty,
            netlink_packet_core::NLM_F_MULTIPART,
            seq,
            body,
        )
    }

    fn elements_message(seq: u32, keys: &[[u8; 4]]) -> Vec<u8> {
        let mut b = NlaBuf::new();
        b.extend_raw(&[NFPROTO_IPV4, NFNETLINK_V0, 0, 0]);
        b.put_strz(NFTA_SET_ELEM_LIST_TABLE, "t");
        b.put_strz(NFTA_SET_ELEM_LIST_SET, "m");
        let list = b.begin_nest(NFTA_SET_ELEM_LIST_ELEMENTS);
        for k in keys {
            let entry = b.begin_nest(NFTA_LIST_ELEM);
            crate::nft::expr::put_value(&mut b, NFTA_SET_ELEM_KEY, k);
            crate::nft::expr::put_value(&mut b, NFTA_SET_ELEM_DATA, &[9, 9, 9, 9]);
            b.end_nest(entry);
        }
        b.end_nest(list);
        let ty = (NFNL_SUBSYS_NFTABLES << 8) | u16::from(NFT_MSG_NEWSETELEM);
        message(ty, seq, b.bytes())
    }

    #[test]
    fn collects_the_acks_of_a_datagram_up_to_a_malformed_message() {
        let mut tlvs = NlaBuf::new();
        tlvs.put_strz(NLMSGERR_ATTR_MSG, "bad thing");
        let mut dgram = error(7, 0, &[]);
        dgram.extend(elements_message(7, &[[1; 4]]));
        dgram.extend(error(8, -2, tlvs.bytes()));
        let whole = dgram.len();
        dgram.extend(error(9, -1, &[]));
        let acks = parse_acks(&dgram[..whole + 10]);
        let got: Vec<(u32, i32, Option<&str>)> = acks
            .iter()
            .map(|a| (a.seq, a.errno, a.message.as_deref()))
            .collect();
        assert_eq!(got, vec![(7, 0, None), (8, 2, Some("bad thing"))]);
        assert!(parse_acks(&dgram[..10]).is_empty());
    }

    #[test]
    fn numbers_the_batch_with_consecutive_sequence_numbers() {
        let mut batch = Batch::new();
        batch.add_table(splitproxy_proto::v1::Family::Ip, "t", "");
        batch.del_set(splitproxy_proto::v1::Family::Ip, "t", "s");
        let (begin, end) = number(&mut batch, 7);
        // Numbered again for another commit: the numbers are overwritten, not added to.
        let (begin2, end2) = number(&mut batch, 100);
        assert_ne!((begin, end), (begin2, end2));
        let out = [&begin2[..], batch.bytes(), &end2[..]].concat();
        assert_eq!(out.len(), batch.byte_len() + 2 * HEADER_LEN);
        let mut seqs = Vec::new();
        let mut types = Vec::new();
        let mut rest = &out[..];
        while !rest.is_empty() {
            let len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
            types.push(u16::from_ne_bytes([rest[4], rest[5]]));
            seqs.push(u32::from_ne_bytes(rest[8..12].try_into().unwrap()));
            rest = &rest[len..];
        }
        assert_eq!(seqs, vec![100, 101, 102, 103]);
        let nft = |msg: u8| (NFNL_SUBSYS_NFTABLES << 8) | u16::from(msg);
        assert_eq!(
            types,
            vec![16, nft(NFT_MSG_NEWTABLE), nft(NFT_MSG_DELSET), 17]
        );
    }

    #[test]
    fn batch_markers_address_the_nftables_subsystem() {
        let m = batch_marker(NFNL_MSG_BATCH_BEGIN, 5);
        assert_eq!(&m[18..20], &[0, 10]);
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), 16);
        assert_eq!(seq_of(u32::MAX, 0), 0);
    }
}
