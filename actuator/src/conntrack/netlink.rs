//! ctnetlink, the kernel's conntrack table over NETLINK_NETFILTER (subsystem
//! NFNL_SUBSYS_CTNETLINK), encoded by hand like the nf_tables messages: two requests and one
//! reply shape are all the cleanup needs.
//!
//! - IPCTNL_MSG_CT_GET with NLM_F_DUMP lists the entries of one family; a CTA_FILTER on the
//!   original tuple's protocol number (kernel 5.8+) keeps the dump to UDP, so a node with a
//!   million TCP connections does not copy them all to find its few UDP flows.
//! - IPCTNL_MSG_CT_DELETE removes one entry by its original tuple, with its CTA_ID (the kernel
//!   then refuses with ENOENT if the tuple now belongs to a newer connection) and its zone.
//!   A delete without a tuple flushes the whole table: [`delete_request`] always writes one.
//!
//! Layout reference: `include/uapi/linux/netfilter/nfnetlink_conntrack.h`; every value is
//! network byte order except the CTA_FILTER flags (host order, NLA_U32).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use netlink_sys::Socket;

use crate::netlink;
use crate::netlink::attr::{Attrs, NlaBuf};
use crate::netlink::consts::{
    NFNL_HEADER_LEN as HEADER_LEN, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR,
};
use crate::netlink::message::{Messages, nfnl_header};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;

// enum ctattr_type
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_ID: u16 = 12;
const CTA_ZONE: u16 = 18;
const CTA_FILTER: u16 = 25;
// enum ctattr_tuple
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
// enum ctattr_ip
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
// enum ctattr_l4proto
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
// enum ctattr_filter, and CTA_FILTER_F_CTA_PROTO_NUM from nf_internals.h
const CTA_FILTER_ORIG_FLAGS: u16 = 1;
const CTA_FILTER_REPLY_FLAGS: u16 = 2;
const CTA_FILTER_F_CTA_PROTO_NUM: u32 = 1 << 3;

pub const AF_INET: u8 = 2;
pub const AF_INET6: u8 = 10;
pub const IPPROTO_UDP: u8 = 17;

/// Deletes sent in one datagram; their acknowledgements must fit the receive buffer.
const DELETES_PER_SEND: usize = 64;
const RX_BUF_LEN: usize = 256 * 1024;
const TIMEOUT: Duration = Duration::from_secs(5);
const ENOENT: i32 = 2;
const EINVAL: i32 = 22;
const EOPNOTSUPP: i32 = 95;

/// One direction of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuple {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
}

/// A conntrack entry as the dump reports it: what deleting it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub family: u8,
    pub orig: Tuple,
    pub reply: Tuple,
    /// CTA_ID as sent by the kernel (network order).
    pub id: Option<[u8; 4]>,
    /// CTA_ZONE as sent by the kernel (network order).
    pub zone: Option<[u8; 2]>,
}

impl std::fmt::Display for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (o, r) = (&self.orig, &self.reply);
        write!(
            f,
            "proto {} src={} dst={} sport={} dport={} reply src={} dst={} sport={} dport={}",
            o.proto, o.src, o.dst, o.sport, o.dport, r.src, r.dst, r.sport, r.dport
        )
    }
}

/// What one batch of deletes came to.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Deleted {
    pub deleted: usize,
    /// Gone already (expired, or the tuple now belongs to another connection).
    pub missing: usize,
    pub failed: usize,
}

/// A ctnetlink socket in the network namespace of the thread that opened it.
pub struct CtSocket {
    sock: Socket,
    seq: u32,
    rx: Vec<u8>,
}

impl CtSocket {
    pub fn open() -> io::Result<Self> {
        let sock = netlink::open(TIMEOUT, false)?;
        Ok(CtSocket {
            sock,
            seq: 1,
            rx: Vec::with_capacity(RX_BUF_LEN),
        })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Every UDP entry of `family` (AF_INET or AF_INET6). Kernels older than 5.8 refuse the
    /// protocol filter; they get an unfiltered dump, filtered here.
    pub fn dump_udp(&mut self, family: u8) -> io::Result<Vec<Entry>> {
        match self.dump(family, true) {
            Err(e) if matches!(e.raw_os_error(), Some(EINVAL | EOPNOTSUPP)) => {
                self.dump(family, false)
            }
            r => r,
        }
    }

    fn dump(&mut self, family: u8, filtered: bool) -> io::Result<Vec<Entry>> {
        let seq = self.next_seq();
        self.sock.send(&dump_request(seq, family, filtered), 0)?;
        let mut out = Vec::new();
        loop {
            for msg in self.recv()? {
                match msg {
                    Msg::Done(s) if s == seq => return Ok(out),
                    Msg::Error(s, errno) if s == seq => {
                        return Err(io::Error::from_raw_os_error(errno));
                    }
                    Msg::Data(s, payload) if s == seq => {
                        if let Some(e) = parse_entry(&payload)
                            && e.orig.proto == IPPROTO_UDP
                        {
                            out.push(e);
                        }
                    }
                    _ => {} // a stale reply to an earlier, interrupted request
                }
            }
        }
    }

    /// Deletes `entries`, several per datagram, each acknowledged on its own.
    pub fn delete(&mut self, entries: &[Entry]) -> io::Result<Deleted> {
        let mut result = Deleted::default();
        for chunk in entries.chunks(DELETES_PER_SEND) {
            let first = self.seq.wrapping_add(1);
            let mut out = Vec::new();
            for e in chunk {
                let seq = self.next_seq();
                out.extend_from_slice(&delete_request(seq, e));
            }
            self.sock.send(&out, 0)?;
            let mut pending = chunk.len();
            while pending > 0 {
                for msg in self.recv()? {
                    let Msg::Error(seq, errno) = msg else {
                        continue;
                    };
                    if (seq.wrapping_sub(first) as usize) >= chunk.len() {
                        continue;
                    }
                    pending = pending.saturating_sub(1);
                    match errno {
                        0 => result.deleted += 1,
                        ENOENT => result.missing += 1,
                        _ => result.failed += 1,
                    }
                }
            }
        }
        Ok(result)
    }

    fn recv(&mut self) -> io::Result<Vec<Msg>> {
        self.rx.clear();
        let n = self.sock.recv(&mut self.rx, 0)?;
        if n > self.rx.len() {
            return Err(io::Error::other(format!(
                "netlink datagram of {n} bytes truncated"
            )));
        }
        Ok(parse_messages(&self.rx[..n]))
    }
}

/// A netlink message of interest in a received datagram.
#[derive(Debug, PartialEq, Eq)]
enum Msg {
    /// A conntrack message: its sequence number and the attributes after the nfgenmsg.
    Data(u32, Vec<u8>),
    /// NLMSG_ERROR: sequence number and positive errno (0: acknowledged).
    Error(u32, i32),
    Done(u32),
}

/// The messages of interest in a datagram, up to a malformed one if any.
fn parse_messages(buf: &[u8]) -> Vec<Msg> {
    Messages::new(buf)
        .map_while(Result::ok)
        .filter_map(|m| match m.ty {
            NLMSG_DONE => Some(Msg::Done(m.seq)),
            NLMSG_ERROR => m.ack().map(|a| Msg::Error(a.seq, a.errno)),
            ty if ty >> 8 == NFNL_SUBSYS_CTNETLINK => {
                m.nfnl_attrs().map(|a| Msg::Data(m.seq, a.to_vec()))
            }
            _ => None,
        })
        .collect()
}

/// nlmsghdr + nfgenmsg for a ctnetlink message, then `attrs`.
fn message(msg: u16, flags: u16, seq: u32, family: u8, attrs: &NlaBuf) -> Vec<u8> {
    let len = HEADER_LEN + attrs.len();
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&nfnl_header(
        (NFNL_SUBSYS_CTNETLINK << 8) | msg,
        flags,
        seq,
        family,
        0,
        len,
    ));
    m.extend_from_slice(attrs.bytes());
    m
}

/// Dump of one family's entries; `filtered`: UDP only, the kernel filtering on the original
/// tuple's protocol.
fn dump_request(seq: u32, family: u8, filtered: bool) -> Vec<u8> {
    let mut a = NlaBuf::new();
    if !filtered {
        return message(
            IPCTNL_MSG_CT_GET,
            NLM_F_REQUEST | NLM_F_DUMP,
            seq,
            family,
            &a,
        );
    }
    let orig = a.begin_nest(CTA_TUPLE_ORIG);
    let proto = a.begin_nest(CTA_TUPLE_PROTO);
    a.put_u8(CTA_PROTO_NUM, IPPROTO_UDP);
    a.end_nest(proto);
    a.end_nest(orig);
    let filter = a.begin_nest(CTA_FILTER);
    a.put(
        CTA_FILTER_ORIG_FLAGS,
        &CTA_FILTER_F_CTA_PROTO_NUM.to_ne_bytes(),
    );
    a.put(CTA_FILTER_REPLY_FLAGS, &0u32.to_ne_bytes());
    a.end_nest(filter);
    message(
        IPCTNL_MSG_CT_GET,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        family,
        &a,
    )
}

fn put_tuple(a: &mut NlaBuf, ty: u16, t: &Tuple) {
    let tuple = a.begin_nest(ty);
    let ip = a.begin_nest(CTA_TUPLE_IP);
    match (t.src, t.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            a.put(CTA_IP_V4_SRC, &s.octets());
            a.put(CTA_IP_V4_DST, &d.octets());
        }
        (s, d) => {
            a.put(CTA_IP_V6_SRC, &v6(s).octets());
            a.put(CTA_IP_V6_DST, &v6(d).octets());
        }
    }
    a.end_nest(ip);
    let proto = a.begin_nest(CTA_TUPLE_PROTO);
    a.put_u8(CTA_PROTO_NUM, t.proto);
    a.put(CTA_PROTO_SRC_PORT, &t.sport.to_be_bytes());
    a.put(CTA_PROTO_DST_PORT, &t.dport.to_be_bytes());
    a.end_nest(proto);
    a.end_nest(tuple);
}

fn v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    }
}

/// Delete of exactly `e`: its original tuple (never omitted: that would flush the table), its
/// id and its zone.
fn delete_request(seq: u32, e: &Entry) -> Vec<u8> {
    let mut a = NlaBuf::new();
    put_tuple(&mut a, CTA_TUPLE_ORIG, &e.orig);
    if let Some(id) = e.id {
        a.put(CTA_ID, &id);
    }
    if let Some(zone) = e.zone {
        a.put(CTA_ZONE, &zone);
    }
    message(
        IPCTNL_MSG_CT_DELETE,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        e.family,
        &a,
    )
}

fn parse_tuple(attrs: Attrs<'_>) -> Option<Tuple> {
    let ip = attrs.find(CTA_TUPLE_IP)?.nested();
    let addr = |ty4: u16, ty6: u16| -> Option<IpAddr> {
        if let Some(a) = ip.find(ty4) {
            let b: [u8; 4] = a.value.try_into().ok()?;
            return Some(Ipv4Addr::from(b).into());
        }
        let b: [u8; 16] = ip.find(ty6)?.value.try_into().ok()?;
        Some(Ipv6Addr::from(b).into())
    };
    let proto = attrs.find(CTA_TUPLE_PROTO)?.nested();
    let port = |ty: u16| -> Option<u16> {
        let b: [u8; 2] = proto.find(ty)?.value.try_into().ok()?;
        Some(u16::from_be_bytes(b))
    };
    Some(Tuple {
        src: addr(CTA_IP_V4_SRC, CTA_IP_V6_SRC)?,
        dst: addr(CTA_IP_V4_DST, CTA_IP_V6_DST)?,
        proto: *proto.find(CTA_PROTO_NUM)?.value.first()?,
        sport: port(CTA_PROTO_SRC_PORT).unwrap_or(0),
        dport: port(CTA_PROTO_DST_PORT).unwrap_or(0),
    })
}

/// An entry from the attributes of an IPCTNL_MSG_CT_NEW message of a dump.
fn parse_entry(attrs: &[u8]) -> Option<Entry> {
    let a = Attrs::new(attrs);
    let orig = parse_tuple(a.find(CTA_TUPLE_ORIG)?.nested())?;
    let reply = parse_tuple(a.find(CTA_TUPLE_REPLY)?.nested())?;
    Some(Entry {
        family: if orig.dst.is_ipv4() {
            AF_INET
        } else {
            AF_INET6
        },
        orig,
        reply,
        id: a.find(CTA_ID).and_then(|x| x.value.try_into().ok()),
        zone: a.find(CTA_ZONE).and_then(|x| x.value.try_into().ok()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::message::fixtures;
    use splitproxy_proto::family::IpFamily;

    fn entry(family: IpFamily) -> Entry {
        let (c, s, e): (IpAddr, IpAddr, IpAddr) = if family == IpFamily::V6 {
            (
                "fd00::1".parse().unwrap(),
                "fd00:96::a".parse().unwrap(),
                "fd00:244::5".parse().unwrap(),
            )
        } else {
            (
                "10.0.0.1".parse().unwrap(),
                "10.96.0.10".parse().unwrap(),
                "10.244.1.5".parse().unwrap(),
            )
        };
        Entry {
            family: if family == IpFamily::V6 {
                AF_INET6
            } else {
                AF_INET
            },
            orig: Tuple {
                src: c,
                dst: s,
                proto: IPPROTO_UDP,
                sport: 40000,
                dport: 53,
            },
            reply: Tuple {
                src: e,
                dst: c,
                proto: IPPROTO_UDP,
                sport: 5353,
                dport: 40000,
            },
            id: Some([1, 2, 3, 4]),
            zone: None,
        }
    }

    /// The attributes of a dumped entry (as the kernel writes them) parse back into the entry.
    fn dumped(e: &Entry) -> Vec<u8> {
        let mut a = NlaBuf::new();
        put_tuple(&mut a, CTA_TUPLE_ORIG, &e.orig);
        put_tuple(&mut a, CTA_TUPLE_REPLY, &e.reply);
        a.put(CTA_ID, &e.id.unwrap());
        a.bytes().to_vec()
    }

    #[test]
    fn parses_dumped_entries_of_both_families() {
        for family in IpFamily::ALL {
            let e = entry(family);
            assert_eq!(parse_entry(&dumped(&e)), Some(e));
        }
        assert_eq!(parse_entry(&[]), None);
    }

    #[test]
    fn delete_names_exactly_one_entry() {
        let e = entry(IpFamily::V4);
        let m = delete_request(9, &e);
        assert_eq!(
            u32::from_ne_bytes(m[0..4].try_into().unwrap()) as usize,
            m.len()
        );
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), (1 << 8) | 2);
        assert_eq!(u16::from_ne_bytes([m[6], m[7]]), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(m[16], AF_INET);
        let attrs = Attrs::new(&m[HEADER_LEN..]);
        // The original tuple is always there: without it the kernel flushes the table.
        let orig = parse_tuple(attrs.find(CTA_TUPLE_ORIG).unwrap().nested()).unwrap();
        assert_eq!(orig, e.orig);
        assert_eq!(attrs.find(CTA_ID).unwrap().value, &[1, 2, 3, 4]);
        assert!(attrs.find(CTA_TUPLE_REPLY).is_none());
        assert!(attrs.find(CTA_ZONE).is_none());
    }

    #[test]
    fn dump_asks_for_udp_of_one_family() {
        assert_eq!(dump_request(3, AF_INET, false).len(), HEADER_LEN);
        let m = dump_request(3, AF_INET6, true);
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), (1 << 8) | 1);
        assert_eq!(u16::from_ne_bytes([m[6], m[7]]), NLM_F_REQUEST | NLM_F_DUMP);
        assert_eq!(m[16], AF_INET6);
        let attrs = Attrs::new(&m[HEADER_LEN..]);
        let proto = attrs
            .find(CTA_TUPLE_ORIG)
            .unwrap()
            .nested()
            .find(CTA_TUPLE_PROTO)
            .unwrap()
            .nested();
        assert_eq!(proto.find(CTA_PROTO_NUM).unwrap().value, &[17]);
        let filter = attrs.find(CTA_FILTER).unwrap().nested();
        assert_eq!(
            filter.find(CTA_FILTER_ORIG_FLAGS).unwrap().u32_ne(),
            Some(8)
        );
    }

    #[test]
    fn parses_replies_acks_and_done() {
        let mut dgram = message(0, 2, 5, AF_INET, &{
            let mut a = NlaBuf::new();
            a.extend_raw(&dumped(&entry(IpFamily::V4)));
            a
        });
        dgram.extend(fixtures::error(6, -2, &[]));
        dgram.extend(fixtures::done(5, 0));
        // A reply cut short ends the datagram.
        dgram.extend_from_slice(&fixtures::error(7, 0, &[])[..12]);
        let msgs = parse_messages(&dgram);
        assert_eq!(msgs.len(), 3);
        assert!(matches!(&msgs[0], Msg::Data(5, a) if parse_entry(a) == Some(entry(IpFamily::V4))));
        assert_eq!(msgs[1], Msg::Error(6, 2));
        assert_eq!(msgs[2], Msg::Done(5));
    }
}
