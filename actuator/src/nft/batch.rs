//! [`Batch`]: the messages of one nf_tables transaction, encoded back to back in one buffer.
//!
//! Every message asks for an acknowledgement (NLM_F_ACK) so that a refusal can be traced to
//! the message, and the batch remembers what each message does. Sequence numbers and the
//! BATCH_BEGIN/END framing are added by [`super::NftSocket::commit`].

use std::collections::HashMap;
use std::ops::Range;

use splitproxy_proto::v1::{Chain, Element, Family, Rule, Set};

use super::check;
use super::consts::*;
use super::element::{self, Op};
use super::error::EncodeError;
use super::expr::Ctx;
use super::set::SetLayout;
use super::{chain, rule, set, table};
use crate::netlink::attr::{Attr, Attrs, Nest, NlaBuf, align4};
use crate::netlink::message::nfnl_header;

/// Upper bound of one message's element list. `nla_len` is a u16, so a nested list cannot
/// exceed 64 KiB; many messages of this size go into one transaction instead.
const ELEMENTS_PER_MESSAGE_BYTES: usize = 60 * 1024;

/// Length of nlmsghdr + nfgenmsg, where every message's attributes start.
pub(crate) const HEADER_LEN: usize = NFNL_HEADER_LEN;

/// An element message being filled.
struct OpenElements {
    start: usize,
    list: Nest,
    list_start: usize,
    entries: Vec<u32>,
}

/// What one message of the batch is, for error reports.
#[derive(Debug, Clone)]
struct MsgInfo {
    bytes: Range<usize>,
    what: String,
    /// Element messages: for each list entry, the index of its element in the caller's slice.
    entries: Vec<u32>,
}

/// One nf_tables transaction under construction.
///
/// Methods that take IR objects return an [`EncodeError`] and leave the batch as it was when the
/// object cannot be encoded. The name-only methods (`add_table`, `del_chain`, ...) cannot fail
/// for valid names; an invalid one (empty, NUL, too long, unspecified family) poisons the batch
/// instead: [`Batch::error`] reports it and the commit refuses to send anything.
#[derive(Debug, Default)]
pub struct Batch {
    buf: NlaBuf,
    msgs: Vec<MsgInfo>,
    error: Option<EncodeError>,
    rules_per_chain: HashMap<String, usize>,
    /// Last NFTA_SET_ID handed out in this batch.
    next_set_id: u32,
}

fn family_name(family: Family) -> &'static str {
    match family {
        Family::Ip => "ip",
        Family::Ip6 => "ip6",
        Family::Inet => "inet",
        Family::Unspecified => "unspecified",
    }
}

impl Batch {
    pub fn new() -> Self {
        Self::default()
    }

    /// NFT_MSG_NEWTABLE; no error if the table exists (its comment is then left as is).
    pub fn add_table(&mut self, family: Family, name: &str, comment: &str) {
        let what = format!("add table {} {name}", family_name(family));
        let r = self.message(NFT_MSG_NEWTABLE, family, NLM_F_CREATE, what, |b| {
            table::encode_add(b, name, comment)
        });
        self.poison(r);
    }

    /// NFT_MSG_DESTROYTABLE (Linux >= 6.3): deletes the table and everything in it; no error
    /// if it does not exist.
    pub fn destroy_table(&mut self, family: Family, name: &str) {
        let what = format!("destroy table {} {name}", family_name(family));
        let r = self.message(NFT_MSG_DESTROYTABLE, family, 0, what, |b| {
            table::encode_del(b, name)
        });
        self.poison(r);
    }

    /// NFT_MSG_DELTABLE: deletes the table and everything in it; ENOENT if absent.
    pub fn del_table(&mut self, family: Family, name: &str) {
        let what = format!("delete table {} {name}", family_name(family));
        let r = self.message(NFT_MSG_DELTABLE, family, 0, what, |b| {
            table::encode_del(b, name)
        });
        self.poison(r);
    }

    /// NFT_MSG_NEWCHAIN: declares the chain (with hook, type, priority and policy for a base
    /// chain), not its rules. No error if it exists.
    pub fn add_chain(&mut self, family: Family, table: &str, chain: &Chain) {
        let kind = if chain.base.is_some() {
            "base chain"
        } else {
            "chain"
        };
        let what = format!("add {kind} {}", chain.name);
        let r = self.message(NFT_MSG_NEWCHAIN, family, NLM_F_CREATE, what, |b| {
            chain::encode_add(b, table, chain)
        });
        self.poison(r);
    }

    /// NFT_MSG_DELRULE with only table and chain: deletes every rule of the chain.
    pub fn flush_chain(&mut self, family: Family, table: &str, chain: &str) {
        let what = format!("flush chain {chain}");
        let r = self.message(NFT_MSG_DELRULE, family, 0, what, |b| {
            chain::encode_name(b, table, chain, NFTA_RULE_TABLE, NFTA_RULE_CHAIN)
        });
        self.rules_per_chain.remove(chain);
        self.poison(r);
    }

    /// NFT_MSG_DELCHAIN: the chain must be empty and unreferenced by then.
    pub fn del_chain(&mut self, family: Family, table: &str, chain: &str) {
        let what = format!("delete chain {chain}");
        let r = self.message(NFT_MSG_DELCHAIN, family, 0, what, |b| {
            chain::encode_name(b, table, chain, NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME)
        });
        self.poison(r);
    }

    /// NFT_MSG_NEWRULE: appends `rule` to the end of `chain`.
    pub fn add_rule(
        &mut self,
        family: Family,
        table: &str,
        chain: &str,
        rule: &Rule,
    ) -> Result<(), EncodeError> {
        let n = self.rules_per_chain.get(chain).copied().unwrap_or(0) + 1;
        let mut what = format!("add rule #{n} to chain {chain}");
        if !rule.comment.is_empty() {
            what.push_str(&format!(" ({:?})", rule.comment));
        }
        let ctx = Ctx {
            family: check::family(family)?,
        };
        self.message(
            NFT_MSG_NEWRULE,
            family,
            NLM_F_CREATE | NLM_F_APPEND,
            what,
            |b| rule::encode_add(b, ctx, table, chain, rule),
        )?;
        self.rules_per_chain.insert(chain.to_owned(), n);
        Ok(())
    }

    /// NFT_MSG_NEWSET: declares the set or map; `set.elements` are not sent (see
    /// [`Batch::add_elements`]). No error if an identical set exists.
    pub fn add_set(&mut self, family: Family, table: &str, set: &Set) -> Result<(), EncodeError> {
        let layout = SetLayout::new(set)?;
        let what = format!("add set {}", set.name);
        let id = self.next_set_id + 1;
        self.message(NFT_MSG_NEWSET, family, NLM_F_CREATE, what, |b| {
            set::encode_add(b, table, &layout, &set.comment, id)
        })?;
        self.next_set_id = id;
        Ok(())
    }

    /// NFT_MSG_DELSET: the set must be unreferenced by then.
    pub fn del_set(&mut self, family: Family, table: &str, set: &str) {
        let what = format!("delete set {set}");
        let r = self.message(NFT_MSG_DELSET, family, 0, what, |b| {
            set::encode_del(b, table, set)
        });
        self.poison(r);
    }

    /// NFT_MSG_NEWSETELEM: adds `elems` to the set defined by `set` (its name, key and data
    /// layout; `set.elements` is ignored), packing as many elements per message as fit.
    /// Re-adding an identical element is not an error.
    pub fn add_elements(
        &mut self,
        family: Family,
        table: &str,
        set: &Set,
        elems: &[Element],
    ) -> Result<(), EncodeError> {
        self.elements(family, table, set, elems, Op::Add)
    }

    /// NFT_MSG_DELSETELEM: removes `elems` (identified by their keys) from the set.
    pub fn del_elements(
        &mut self,
        family: Family,
        table: &str,
        set: &Set,
        elems: &[Element],
    ) -> Result<(), EncodeError> {
        self.elements(family, table, set, elems, Op::Delete)
    }

    /// NFT_MSG_DESTROYSETELEM (Linux >= 6.3): removes the elements of set `set` whose keys are
    /// `keys`, as the kernel holds them (bytes from a dump, see
    /// [`super::NftSocket::dump_elements`]). An element that is already gone, expired for
    /// instance, is skipped rather than failing the transaction.
    pub fn destroy_element_keys<'k>(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
        keys: impl IntoIterator<Item = &'k [u8]>,
    ) -> Result<(), EncodeError> {
        let nfproto = check::family(family)?;
        check::name("table", table)?;
        check::name("set", set)?;
        let (buf_mark, msgs_mark) = (self.buf.len(), self.msgs.len());
        let r = self.destroy_keys_inner(nfproto, table, set, keys);
        if r.is_err() {
            self.buf.truncate(buf_mark);
            self.buf.clear_overflow();
            self.msgs.truncate(msgs_mark);
        }
        r
    }

    fn destroy_keys_inner<'k>(
        &mut self,
        nfproto: u8,
        table: &str,
        set: &str,
        keys: impl IntoIterator<Item = &'k [u8]>,
    ) -> Result<(), EncodeError> {
        let verb = "destroy elements of";
        let mut entry = NlaBuf::new();
        let mut open: Option<OpenElements> = None;
        for (i, key) in keys.into_iter().enumerate() {
            entry.clear();
            element::encode_key(&mut entry, key);
            if entry.overflowed() || entry.len() > ELEMENTS_PER_MESSAGE_BYTES {
                return Err(EncodeError::element(set, i, "element too large"));
            }
            let full = open.as_ref().is_some_and(|o| {
                self.buf.len() - o.list_start + entry.len() > ELEMENTS_PER_MESSAGE_BYTES
            });
            if full && let Some(o) = open.take() {
                self.close_elements(o, verb, set)?;
            }
            let o = match &mut open {
                Some(o) => o,
                None => {
                    open.insert(self.open_elements(NFT_MSG_DESTROYSETELEM, nfproto, 0, table, set))
                }
            };
            self.buf.extend_raw(entry.bytes());
            o.entries.push(i as u32);
        }
        if let Some(o) = open {
            self.close_elements(o, verb, set)?;
        }
        Ok(())
    }

    /// Number of messages (BATCH_BEGIN/END not counted).
    pub fn len(&self) -> usize {
        self.msgs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    /// Bytes of all messages.
    pub fn byte_len(&self) -> usize {
        self.buf.len()
    }

    /// The first error of a name-only method, which makes the commit refuse the batch.
    pub fn error(&self) -> Option<&EncodeError> {
        self.error.as_ref()
    }

    /// Forgets every message and error, keeping the allocated buffer.
    pub fn clear(&mut self) {
        self.buf.clear();
        self.msgs.clear();
        self.error = None;
        self.rules_per_chain.clear();
        self.next_set_id = 0;
    }

    /// Every message, back to back: what the kernel is sent between the batch markers. The
    /// sequence numbers are those of the last [`Batch::stamp_sequence`] (0 before it).
    pub(crate) fn bytes(&self) -> &[u8] {
        self.buf.bytes()
    }

    /// Writes `seq(i)` as the sequence number of message `i`, in place, so that the batch is
    /// sent as it is rather than copied to be numbered (a first commit is megabytes).
    pub(crate) fn stamp_sequence(&mut self, seq: impl Fn(usize) -> u32) {
        for (i, m) in self.msgs.iter().enumerate() {
            self.buf.put_u32_ne_at(m.bytes.start + 8, seq(i));
        }
    }

    /// The encoded messages, in order.
    #[cfg(test)]
    pub(crate) fn messages(&self) -> impl Iterator<Item = &[u8]> {
        self.msgs.iter().map(|m| &self.buf.bytes()[m.bytes.clone()])
    }

    /// What message `index` does, narrowed to the element or expression at `bad_attr` (the
    /// kernel's extended-ack offset from the start of the message) when there is one.
    pub(crate) fn describe(&self, index: usize, bad_attr: Option<u32>) -> String {
        let Some(m) = self.msgs.get(index) else {
            return format!("message {index}");
        };
        let range = match (m.entries.first(), m.entries.last()) {
            (Some(first), Some(last)) => format!(" (elements {first}..={last} of the call)"),
            _ => String::new(),
        };
        let Some(off) = bad_attr.map(|o| o as usize) else {
            return format!("{}{range}", m.what);
        };
        let bytes = &self.buf.bytes()[m.bytes.clone()];
        let Some(attrs) = bytes.get(HEADER_LEN..) else {
            return m.what.clone();
        };
        let attrs = Attrs::with_base(attrs, HEADER_LEN);
        let contains =
            |a: &Attr<'_>| (a.offset..a.offset + align4(a.value.len() + NLA_HDRLEN)).contains(&off);
        let msg_type = (u16::from_ne_bytes([bytes[4], bytes[5]]) & 0xff) as u8;
        let (list_attr, elements) = match msg_type {
            NFT_MSG_NEWSETELEM | NFT_MSG_DELSETELEM | NFT_MSG_DESTROYSETELEM => {
                (NFTA_SET_ELEM_LIST_ELEMENTS, true)
            }
            NFT_MSG_NEWRULE => (NFTA_RULE_EXPRESSIONS, false),
            _ => return m.what.clone(),
        };
        let hit = attrs
            .find(list_attr)
            .and_then(|list| list.nested().position(|e| contains(&e)));
        match hit {
            Some(k) if elements => match m.entries.get(k) {
                Some(i) => format!("{} (element {i} of the call)", m.what),
                None => format!("{}{range}", m.what),
            },
            Some(k) => format!("{} (expression {k})", m.what),
            None => format!("{}{range}", m.what),
        }
    }

    fn poison(&mut self, r: Result<(), EncodeError>) {
        if let Err(e) = r {
            tracing::warn!(error = %e, "nft batch: refusing an invalid object");
            self.error.get_or_insert(e);
        }
    }

    /// Appends one message: header, then `body`'s attributes. On error the batch is left as it
    /// was.
    fn message(
        &mut self,
        msg_type: u8,
        family: Family,
        flags: u16,
        what: String,
        body: impl FnOnce(&mut NlaBuf) -> Result<(), EncodeError>,
    ) -> Result<(), EncodeError> {
        let family = check::family(family)?;
        let start = self.begin(msg_type, family, flags);
        let r = body(&mut self.buf).and_then(|()| self.finish(start, &what));
        match r {
            Ok(()) => {
                self.msgs.push(MsgInfo {
                    bytes: start..self.buf.len(),
                    what,
                    entries: Vec::new(),
                });
                Ok(())
            }
            Err(e) => {
                self.buf.truncate(start);
                self.buf.clear_overflow();
                Err(e)
            }
        }
    }

    /// Writes nlmsghdr (length, sequence number and port id filled in later) and nfgenmsg.
    fn begin(&mut self, msg_type: u8, family: u8, flags: u16) -> usize {
        let start = self.buf.len();
        self.buf.extend_raw(&nfnl_header(
            (NFNL_SUBSYS_NFTABLES << 8) | u16::from(msg_type),
            NLM_F_REQUEST | NLM_F_ACK | flags,
            0,
            family,
            0,
            0,
        ));
        start
    }

    /// Sets the message length, after checking that no attribute overflowed.
    fn finish(&mut self, start: usize, what: &str) -> Result<(), EncodeError> {
        if self.buf.overflowed() {
            return Err(EncodeError::TooLarge {
                what: what.to_owned(),
            });
        }
        let len = self.buf.len() - start;
        let len = u32::try_from(len).map_err(|_| EncodeError::TooLarge {
            what: what.to_owned(),
        })?;
        self.buf.put_u32_ne_at(start, len);
        Ok(())
    }

    fn elements(
        &mut self,
        family: Family,
        table: &str,
        set: &Set,
        elems: &[Element],
        op: Op,
    ) -> Result<(), EncodeError> {
        let nfproto = check::family(family)?;
        check::name("table", table)?;
        let layout = SetLayout::new(set)?;
        let (buf_mark, msgs_mark) = (self.buf.len(), self.msgs.len());
        let r = self.elements_inner(nfproto, table, &layout, elems, op);
        if r.is_err() {
            self.buf.truncate(buf_mark);
            self.buf.clear_overflow();
            self.msgs.truncate(msgs_mark);
        }
        r
    }

    fn elements_inner(
        &mut self,
        nfproto: u8,
        table: &str,
        layout: &SetLayout,
        elems: &[Element],
        op: Op,
    ) -> Result<(), EncodeError> {
        let (msg_type, flags, verb) = match op {
            Op::Add => (NFT_MSG_NEWSETELEM, NLM_F_CREATE, "add elements to"),
            Op::Delete => (NFT_MSG_DELSETELEM, 0, "delete elements from"),
        };
        let mut entry = NlaBuf::new();
        let mut key = Vec::new();
        let mut open: Option<OpenElements> = None;
        for (i, e) in elems.iter().enumerate() {
            entry.clear();
            let n = element::encode(&mut entry, layout, e, i, op, &mut key)?;
            if entry.overflowed() || entry.len() > ELEMENTS_PER_MESSAGE_BYTES {
                return Err(EncodeError::element(&layout.name, i, "element too large"));
            }
            let full = open.as_ref().is_some_and(|o| {
                self.buf.len() - o.list_start + entry.len() > ELEMENTS_PER_MESSAGE_BYTES
            });
            if full && let Some(o) = open.take() {
                self.close_elements(o, verb, &layout.name)?;
            }
            let o = match &mut open {
                Some(o) => o,
                None => {
                    open.insert(self.open_elements(msg_type, nfproto, flags, table, &layout.name))
                }
            };
            self.buf.extend_raw(entry.bytes());
            o.entries.extend(std::iter::repeat_n(i as u32, n));
        }
        if let Some(o) = open {
            self.close_elements(o, verb, &layout.name)?;
        }
        Ok(())
    }

    fn open_elements(
        &mut self,
        msg_type: u8,
        nfproto: u8,
        flags: u16,
        table: &str,
        set: &str,
    ) -> OpenElements {
        let start = self.begin(msg_type, nfproto, flags);
        self.buf.put_strz(NFTA_SET_ELEM_LIST_TABLE, table);
        self.buf.put_strz(NFTA_SET_ELEM_LIST_SET, set);
        let list_start = self.buf.len();
        let list = self.buf.begin_nest(NFTA_SET_ELEM_LIST_ELEMENTS);
        OpenElements {
            start,
            list,
            list_start,
            entries: Vec::new(),
        }
    }

    fn close_elements(
        &mut self,
        o: OpenElements,
        verb: &str,
        set: &str,
    ) -> Result<(), EncodeError> {
        self.buf.end_nest(o.list);
        let what = format!("{verb} set {set}");
        self.finish(o.start, &what)?;
        self.msgs.push(MsgInfo {
            bytes: o.start..self.buf.len(),
            what,
            entries: o.entries,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nft::datum::tests::{int, ip4, port, proto};
    use crate::nft::tests::fixture;
    use splitproxy_proto::v1::DataType;

    const IP: Family = Family::Ip;

    fn header(msg: &[u8]) -> (u32, u16, u16, u8) {
        (
            u32::from_ne_bytes(msg[0..4].try_into().unwrap()),
            u16::from_ne_bytes([msg[4], msg[5]]),
            u16::from_ne_bytes([msg[6], msg[7]]),
            msg[16],
        )
    }

    #[test]
    fn messages_carry_type_flags_family_and_length() {
        let mut b = Batch::new();
        b.add_table(Family::Ip6, "splitproxy", "");
        b.add_rule(IP, "splitproxy", "services", &fixture::services_rule())
            .unwrap();
        b.destroy_table(IP, "splitproxy");
        let msgs: Vec<&[u8]> = b.messages().collect();
        assert_eq!(msgs.len(), 3);
        let (len, ty, flags, family) = header(msgs[0]);
        assert_eq!(len as usize, msgs[0].len());
        assert_eq!(ty, (10 << 8) | u16::from(NFT_MSG_NEWTABLE));
        assert_eq!(flags, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE);
        assert_eq!(family, NFPROTO_IPV6);
        let (_, ty, flags, family) = header(msgs[1]);
        assert_eq!(ty & 0xff, u16::from(NFT_MSG_NEWRULE));
        assert_eq!(
            flags,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_APPEND
        );
        assert_eq!(family, NFPROTO_IPV4);
        assert_eq!(header(msgs[2]).1 & 0xff, u16::from(NFT_MSG_DESTROYTABLE));
        assert_eq!(b.byte_len(), msgs.iter().map(|m| m.len()).sum::<usize>());
    }

    #[test]
    fn invalid_names_and_families_poison_the_batch() {
        let mut b = Batch::new();
        b.add_table(IP, "ok", "");
        b.del_table(Family::Unspecified, "splitproxy");
        b.del_chain(IP, "ok", "");
        assert_eq!(b.len(), 1);
        assert_eq!(b.error(), Some(&EncodeError::Family(0)));
        b.clear();
        assert!(b.error().is_none() && b.is_empty());
    }

    #[test]
    fn a_failed_call_leaves_the_batch_unchanged() {
        let mut b = Batch::new();
        b.add_table(IP, "t", "");
        let before = (b.len(), b.byte_len());
        let set = fixture::sets()
            .into_iter()
            .find(|s| s.name == "service-ports-1")
            .unwrap();
        let mut elems = set.elements.clone();
        elems.push(Element {
            key: vec![ip4([1, 2, 3, 4])],
            ..Element::default()
        });
        let err = b.add_elements(IP, "t", &set, &elems).unwrap_err();
        assert!(
            matches!(err, EncodeError::Element { index: 2, .. }),
            "{err}"
        );
        let mut rule = fixture::services_rule();
        rule.exprs[0].kind = None;
        assert!(b.add_rule(IP, "t", "services", &rule).is_err());
        assert_eq!((b.len(), b.byte_len()), before);
        assert!(b.error().is_none());
    }

    /// A set of (ip . proto . port . slot -> ip . port) and `n` elements for it.
    fn endpoints(n: u32) -> (Set, Vec<Element>) {
        use DataType::*;
        let set = Set {
            name: "service-endpoints".to_owned(),
            key: vec![
                Ipv4Addr as i32,
                InetProto as i32,
                InetService as i32,
                Integer as i32,
            ],
            data: vec![Ipv4Addr as i32, InetService as i32],
            ..Set::default()
        };
        let elems = (0..n)
            .map(|i| {
                let [_, a, b, c] = i.to_be_bytes();
                Element {
                    key: vec![ip4([10, a, b, c]), proto(6), port(80), int(i % 3)],
                    data: vec![ip4([10, 244, b, c]), port(8080)],
                    ..Element::default()
                }
            })
            .collect();
        (set, elems)
    }

    #[test]
    fn elements_are_packed_into_messages_under_64k() {
        let (set, elems) = endpoints(10_000);
        let mut b = Batch::new();
        b.add_elements(IP, "t", &set, &elems).unwrap();
        assert!(b.len() > 1, "{} messages", b.len());
        let layout = SetLayout::new(&set).unwrap();
        let mut decoded = Vec::new();
        for msg in b.messages() {
            let attrs = Attrs::with_base(&msg[HEADER_LEN..], HEADER_LEN);
            let list = attrs.find(NFTA_SET_ELEM_LIST_ELEMENTS).unwrap();
            assert!(list.value.len() <= ELEMENTS_PER_MESSAGE_BYTES);
            decoded.extend(element::tests::decode(&layout, &list));
        }
        assert_eq!(decoded, elems);
    }

    #[test]
    fn destroy_by_key_bytes_packs_keys_only() {
        let keys: Vec<Vec<u8>> = (0..6_000u32)
            .map(|i| [i.to_be_bytes(), [0, 0, 0, 80]].concat())
            .collect();
        let mut b = Batch::new();
        b.destroy_element_keys(IP, "t", "affinity", keys.iter().map(Vec::as_slice))
            .unwrap();
        assert!(b.len() > 1, "{} messages", b.len());
        let mut got = Vec::new();
        for msg in b.messages() {
            let (_, ty, flags, family) = header(msg);
            assert_eq!(ty & 0xff, u16::from(NFT_MSG_DESTROYSETELEM));
            assert_eq!(flags, NLM_F_REQUEST | NLM_F_ACK);
            assert_eq!(family, NFPROTO_IPV4);
            let attrs = Attrs::with_base(&msg[HEADER_LEN..], HEADER_LEN);
            let set = attrs.find(NFTA_SET_ELEM_LIST_SET).unwrap();
            assert_eq!(set.str(), Some("affinity"));
            let list = attrs.find(NFTA_SET_ELEM_LIST_ELEMENTS).unwrap();
            assert!(list.value.len() <= ELEMENTS_PER_MESSAGE_BYTES);
            for entry in list.nested() {
                let types: Vec<u16> = entry.nested().map(|a| a.ty).collect();
                assert_eq!(types, vec![NFTA_SET_ELEM_KEY]);
            }
            element::decode_raw(&list, &mut got);
        }
        let got: Vec<Vec<u8>> = got.into_iter().map(|e| e.key).collect();
        assert_eq!(got, keys);
        assert!(
            b.describe(1, None)
                .starts_with("destroy elements of set affinity (elements ")
        );
        // Nothing to destroy: no message.
        let mut empty = Batch::new();
        empty
            .destroy_element_keys(IP, "t", "affinity", std::iter::empty())
            .unwrap();
        assert!(empty.is_empty());
        assert!(
            empty
                .destroy_element_keys(IP, "t", "", std::iter::empty())
                .is_err()
        );
    }

    #[test]
    fn describe_names_the_element_or_expression_at_the_kernels_offset() {
        let (set, elems) = endpoints(2_000);
        let mut b = Batch::new();
        b.add_elements(IP, "t", &set, &elems).unwrap();
        b.add_rule(IP, "t", "services", &fixture::services_rule())
            .unwrap();
        assert_eq!(b.len(), 3);
        // The second message's 11th entry.
        let msg: Vec<&[u8]> = b.messages().collect();
        let attrs = Attrs::with_base(&msg[1][HEADER_LEN..], HEADER_LEN);
        let list = attrs.find(NFTA_SET_ELEM_LIST_ELEMENTS).unwrap();
        let entry = list.nested().nth(10).unwrap();
        let first = b.msgs[1].entries[0] as usize;
        assert_eq!(
            b.describe(1, Some(entry.offset as u32 + 8)),
            format!(
                "add elements to set service-endpoints (element {} of the call)",
                first + 10
            )
        );
        assert!(
            b.describe(1, None)
                .starts_with("add elements to set service-endpoints (elements ")
        );
        let attrs = Attrs::with_base(&msg[2][HEADER_LEN..], HEADER_LEN);
        let exprs = attrs.find(NFTA_RULE_EXPRESSIONS).unwrap();
        let lookup = exprs.nested().nth(3).unwrap();
        assert_eq!(
            b.describe(2, Some(lookup.offset as u32)),
            "add rule #1 to chain services (\"dispatch to the service's endpoints\") (expression 3)"
        );
    }
}
