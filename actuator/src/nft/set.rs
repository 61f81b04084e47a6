//! Set messages: NFT_MSG_NEWSET declares a named set or map (its key and data layout, flags,
//! default timeout), NFT_MSG_DELSET removes it. Elements are separate messages (element.rs).
//!
//! Types are told to the kernel the way `nft` does, so that `nft list ruleset` prints them:
//! nft type ids, concatenations folded 6 bits per field, NFTA_SET_DESC_CONCAT with the field
//! lengths, and the key/data byte order in the userdata.

use splitproxy_proto::v1::{DataType, Set};

use super::check;
use super::consts::*;
use super::datum::Fields;
use super::error::EncodeError;
use super::udata::Udata;
use crate::netlink::attr::NlaBuf;

/// What a set's elements carry besides their key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SetData {
    None,
    Verdict,
    Value(Fields),
}

/// A set definition checked and lowered once, then used for the set and for its elements.
#[derive(Debug, Clone)]
pub(crate) struct SetLayout {
    pub name: String,
    pub key: Fields,
    pub data: SetData,
    pub interval: bool,
    pub timeout: bool,
    pub default_timeout_ms: u64,
    pub dynamic: bool,
}

impl SetLayout {
    pub(crate) fn new(set: &Set) -> Result<Self, EncodeError> {
        check::name("set", &set.name)?;
        let err = |why: String| EncodeError::set(&set.name, why);
        let key = Fields::new(&set.key).map_err(|why| err(format!("key: {why}")))?;
        let data = match set.data.as_slice() {
            [] => SetData::None,
            [v] if *v == DataType::Verdict as i32 => SetData::Verdict,
            raw => SetData::Value(Fields::new(raw).map_err(|why| err(format!("data: {why}")))?),
        };
        Ok(Self {
            name: set.name.clone(),
            key,
            data,
            interval: set.interval,
            timeout: set.timeout || set.default_timeout_ms > 0,
            default_timeout_ms: set.default_timeout_ms,
            dynamic: set.dynamic,
        })
    }

    /// Concatenated ranges use the kernel's pipapo backend: NFT_SET_CONCAT, with each element's
    /// range end in NFTA_SET_ELEM_KEY_END. Single-field ranges use interval-end elements.
    pub(crate) fn concat_interval(&self) -> bool {
        self.interval && self.key.is_concat()
    }

    pub(crate) fn flags(&self) -> u32 {
        let mut flags = 0;
        if self.interval {
            flags |= NFT_SET_INTERVAL;
        }
        // Since Linux 6.2 the kernel wants NFT_SET_CONCAT exactly when NFTA_SET_DESC_CONCAT
        // describes more than one field, as `nft` sends it for every concatenation.
        if self.key.is_concat() {
            flags |= NFT_SET_CONCAT;
        }
        if self.data != SetData::None {
            flags |= NFT_SET_MAP;
        }
        if self.timeout {
            flags |= NFT_SET_TIMEOUT;
        }
        if self.dynamic {
            flags |= NFT_SET_EVAL;
        }
        flags
    }
}

/// How a data map's entries are laid out in bytes, to match entries dumped from the kernel
/// (whose keys and data come back as bytes) against IR values without decoding them.
///
/// An entry's "tail" is its key without its first `skip` fields, followed by its data: the
/// bytes from the key field's offset on, as the whole key lays them out (4-byte slots in a
/// concatenation), then the data bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataMapLayout {
    key: Fields,
    data: Fields,
}

impl DataMapLayout {
    /// The layout of `map`, which must be a data map (not a set, not a verdict map).
    pub fn new(map: &Set) -> Result<Self, EncodeError> {
        let layout = SetLayout::new(map)?;
        match layout.data {
            SetData::Value(data) => Ok(Self {
                key: layout.key,
                data,
            }),
            _ => Err(EncodeError::set(&map.name, "not a data map".to_owned())),
        }
    }

    /// Number of key fields.
    pub fn key_fields(&self) -> usize {
        self.key.len()
    }

    /// Number of data fields.
    pub fn data_fields(&self) -> usize {
        self.data.len()
    }

    /// Appends the tail of an entry whose key fields from `skip` on and whose data fields hold
    /// `values`, in that order.
    pub fn encode_tail(
        &self,
        skip: usize,
        values: &[splitproxy_proto::v1::Datum],
        out: &mut Vec<u8>,
    ) -> Result<(), String> {
        let key_values = self.key.len().saturating_sub(skip);
        if skip > self.key.len() || values.len() != key_values + self.data.len() {
            return Err(format!(
                "{} values for the last {key_values} key fields and {} data fields",
                values.len(),
                self.data.len()
            ));
        }
        let (key, data) = values.split_at(key_values);
        self.key
            .encode_from(skip, key, out)
            .map_err(|why| format!("key: {why}"))?;
        self.data
            .encode(data, out)
            .map_err(|why| format!("data: {why}"))
    }

    /// Appends the tail of an entry dumped as `key` and `data` bytes; false (and nothing
    /// appended) when their lengths are not this layout's.
    pub fn entry_tail(&self, skip: usize, key: &[u8], data: &[u8], out: &mut Vec<u8>) -> bool {
        if key.len() != self.key.byte_len() || data.len() != self.data.byte_len() {
            return false;
        }
        let Some(tail) = key.get(self.key.offset(skip.min(self.key.len()))..) else {
            return false;
        };
        out.extend_from_slice(tail);
        out.extend_from_slice(data);
        true
    }
}

/// Attributes of a set declaration. `id` is unique within the transaction (the kernel requires
/// NFTA_SET_ID, which lets later messages of the same batch name the set by id).
pub(crate) fn encode_add(
    b: &mut NlaBuf,
    table: &str,
    layout: &SetLayout,
    comment: &str,
    id: u32,
) -> Result<(), EncodeError> {
    check::name("table", table)?;
    check::comment("set", comment)?;
    b.put_strz(NFTA_SET_TABLE, table);
    b.put_strz(NFTA_SET_NAME, &layout.name);
    b.put_u32_be(NFTA_SET_ID, id);
    b.put_u32_be(NFTA_SET_FLAGS, layout.flags());
    b.put_u32_be(NFTA_SET_KEY_TYPE, layout.key.type_id());
    b.put_u32_be(NFTA_SET_KEY_LEN, layout.key.byte_len() as u32);
    match &layout.data {
        SetData::None => {}
        SetData::Verdict => b.put_u32_be(NFTA_SET_DATA_TYPE, NFT_DATA_VERDICT),
        SetData::Value(data) => {
            b.put_u32_be(NFTA_SET_DATA_TYPE, data.type_id());
            b.put_u32_be(NFTA_SET_DATA_LEN, data.byte_len() as u32);
        }
    }
    if layout.default_timeout_ms > 0 {
        b.put_u64_be(NFTA_SET_TIMEOUT, layout.default_timeout_ms);
    }
    if layout.key.is_concat() {
        let desc = b.begin_nest(NFTA_SET_DESC);
        let concat = b.begin_nest(NFTA_SET_DESC_CONCAT);
        for len in layout.key.field_lens() {
            let field = b.begin_nest(NFTA_LIST_ELEM);
            b.put_u32_be(NFTA_SET_FIELD_LEN, len);
            b.end_nest(field);
        }
        b.end_nest(concat);
        b.end_nest(desc);
    }
    let mut udata = Udata::new();
    udata.put_u32(NFTNL_UDATA_SET_KEYBYTEORDER, layout.key.byteorder());
    if let SetData::Value(data) = &layout.data {
        udata.put_u32(NFTNL_UDATA_SET_DATABYTEORDER, data.byteorder());
    }
    if !comment.is_empty() {
        udata.put_strz(NFTNL_UDATA_SET_COMMENT, comment);
    }
    b.put(NFTA_SET_USERDATA, udata.bytes());
    Ok(())
}

/// Attributes of a set deletion.
pub(crate) fn encode_del(b: &mut NlaBuf, table: &str, set: &str) -> Result<(), EncodeError> {
    check::name("table", table)?;
    check::name("set", set)?;
    b.put_strz(NFTA_SET_TABLE, table);
    b.put_strz(NFTA_SET_NAME, set);
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::netlink::attr::Attrs;
    use crate::nft::udata::{comment_of, parse};

    /// Rebuilds the IR set definition from a NEWSET message's attributes (elements aside).
    /// Field types come from the folded type id; the lengths are checked against it.
    pub(crate) fn decode(attrs: &Attrs<'_>) -> (String, Set) {
        let s = |ty| {
            attrs
                .find(ty)
                .and_then(|a| a.str())
                .unwrap_or_default()
                .to_owned()
        };
        let u32_of = |ty| attrs.find(ty).and_then(|a| a.u32_be());
        let flags = u32_of(NFTA_SET_FLAGS).unwrap();
        let unfold = |mut id: u32| {
            let mut v = vec![];
            while id != 0 {
                v.insert(0, (id & ((1 << TYPE_BITS) - 1)) as i32);
                id >>= TYPE_BITS;
            }
            v
        };
        let mut key = unfold(u32_of(NFTA_SET_KEY_TYPE).unwrap());
        if key.len() > 1 {
            // Integers are announced as marks inside concatenations (datum.rs); the fixtures
            // hold no mark in a concatenated key, so read them back as integers.
            for t in &mut key {
                if *t == DataType::Mark as i32 {
                    *t = DataType::Integer as i32;
                }
            }
        }
        let key_fields = Fields::new(&key).unwrap();
        assert_eq!(u32_of(NFTA_SET_KEY_LEN), Some(key_fields.byte_len() as u32));
        if key_fields.is_concat() {
            let desc = attrs.find(NFTA_SET_DESC).unwrap().nested();
            let lens: Vec<u32> = desc
                .find(NFTA_SET_DESC_CONCAT)
                .unwrap()
                .nested()
                .map(|f| {
                    f.nested()
                        .find(NFTA_SET_FIELD_LEN)
                        .unwrap()
                        .u32_be()
                        .unwrap()
                })
                .collect();
            assert_eq!(lens, key_fields.field_lens().collect::<Vec<_>>());
        }
        let data = match u32_of(NFTA_SET_DATA_TYPE) {
            None => vec![],
            Some(NFT_DATA_VERDICT) => vec![DataType::Verdict as i32],
            Some(id) => {
                let d = unfold(id);
                let len = Fields::new(&d).unwrap().byte_len() as u32;
                assert_eq!(u32_of(NFTA_SET_DATA_LEN), Some(len));
                d
            }
        };
        assert_eq!(flags & NFT_SET_MAP != 0, !data.is_empty());
        let udata = attrs.find(NFTA_SET_USERDATA).unwrap().value;
        assert_eq!(parse(udata)[0].0, NFTNL_UDATA_SET_KEYBYTEORDER);
        let default_timeout_ms = attrs
            .find(NFTA_SET_TIMEOUT)
            .map(|a| u64::from_be_bytes(a.value.try_into().unwrap()))
            .unwrap_or(0);
        let set = Set {
            name: s(NFTA_SET_NAME),
            key,
            data,
            interval: flags & NFT_SET_INTERVAL != 0,
            timeout: flags & NFT_SET_TIMEOUT != 0,
            default_timeout_ms,
            dynamic: flags & NFT_SET_EVAL != 0,
            comment: comment_of(udata, NFTNL_UDATA_SET_COMMENT),
            elements: vec![],
            // Userspace only: never on the wire.
            conntrack: 0,
            guards: String::new(),
        };
        (s(NFTA_SET_TABLE), set)
    }

    fn round_trip(set: &Set) -> Set {
        let layout = SetLayout::new(set).unwrap();
        let mut b = NlaBuf::new();
        encode_add(&mut b, "splitproxy", &layout, &set.comment, 1).unwrap();
        let (table, back) = decode(&Attrs::new(b.bytes()));
        assert_eq!(table, "splitproxy");
        back
    }

    #[test]
    fn round_trip_the_splitproxy_sets() {
        for set in crate::nft::tests::fixture::sets() {
            assert_eq!(
                round_trip(&set),
                Set {
                    elements: vec![],
                    ..set
                }
            );
        }
    }

    #[test]
    fn round_trip_interval_timeout_dynamic() {
        use DataType::*;
        let set = Set {
            name: "affinity".to_owned(),
            key: vec![Ipv4Addr as i32, Ipv4Addr as i32],
            data: vec![Ipv4Addr as i32, InetService as i32],
            interval: false,
            timeout: true,
            default_timeout_ms: 10_800_000,
            dynamic: true,
            comment: "session affinity".to_owned(),
            elements: vec![],
            conntrack: 0,
            guards: String::new(),
        };
        assert_eq!(round_trip(&set), set);
        let ranges = Set {
            name: "ranges".to_owned(),
            key: vec![Ipv4Addr as i32, InetService as i32],
            interval: true,
            ..Set::default()
        };
        let layout = SetLayout::new(&ranges).unwrap();
        assert_eq!(layout.flags(), NFT_SET_INTERVAL | NFT_SET_CONCAT);
        assert_eq!(round_trip(&ranges), ranges);
    }

    /// `Set.conntrack` tells the actuator how to clean conntrack, `Set.guards` which map entries
    /// to delete; the kernel sees neither: a set and its elements encode to the same bytes
    /// whatever their values.
    #[test]
    fn conntrack_role_is_not_sent_to_the_kernel() {
        use splitproxy_proto::v1::ConntrackRole;
        for set in crate::nft::tests::fixture::sets() {
            let encode = |s: &Set| {
                let layout = SetLayout::new(s).unwrap();
                let mut b = NlaBuf::new();
                encode_add(&mut b, "splitproxy", &layout, &s.comment, 1).unwrap();
                let mut batch = crate::nft::Batch::new();
                batch
                    .add_elements(splitproxy_proto::v1::Family::Ip, "t", s, &s.elements)
                    .unwrap();
                let elements: Vec<Vec<u8>> = batch.messages().map(<[u8]>::to_vec).collect();
                (b.bytes().to_vec(), elements)
            };
            for role in [ConntrackRole::Endpoints, ConntrackRole::NoEndpoints] {
                let with_role = Set {
                    conntrack: role as i32,
                    ..set.clone()
                };
                assert_eq!(encode(&with_role), encode(&set), "set {}", set.name);
            }
            // Nor is the map a set guards.
            let guarding = Set {
                guards: "affinity".to_owned(),
                ..set.clone()
            };
            assert_eq!(encode(&guarding), encode(&set), "set {}", set.name);
        }
    }

    #[test]
    fn data_map_layout_tails() {
        use crate::nft::datum::tests::{ip4, port, proto};
        use DataType::*;
        let map = Set {
            name: "affinity".to_owned(),
            key: vec![
                Ipv4Addr as i32,
                Ipv4Addr as i32,
                InetProto as i32,
                InetService as i32,
            ],
            data: vec![Ipv4Addr as i32, InetService as i32],
            timeout: true,
            dynamic: true,
            ..Set::default()
        };
        let layout = DataMapLayout::new(&map).unwrap();
        assert_eq!((layout.key_fields(), layout.data_fields()), (4, 2));
        let values = [
            ip4([10, 96, 0, 10]),
            proto(6),
            port(80),
            ip4([10, 244, 1, 5]),
            port(8080),
        ];
        let mut want = Vec::new();
        layout.encode_tail(1, &values, &mut want).unwrap();
        // Laid out by hand: 4-byte slots, ports in network order.
        assert_eq!(
            want,
            [
                10, 96, 0, 10, 6, 0, 0, 0, 0, 80, 0, 0, 10, 244, 1, 5, 0x1f, 0x90, 0, 0
            ]
        );
        let key = [
            10, 0, 0, 1, 10, 96, 0, 10, 6, 0, 0, 0, 0, 80, 0, 0, //
        ];
        let data = [10, 244, 1, 5, 0x1f, 0x90, 0, 0];
        let mut got = Vec::new();
        assert!(layout.entry_tail(1, &key, &data, &mut got));
        assert_eq!(got, want);
        // Wrong lengths, wrong values.
        assert!(!layout.entry_tail(1, &key[..12], &data, &mut got));
        assert!(!layout.entry_tail(1, &key, &data[..4], &mut got));
        assert_eq!(got, want, "nothing appended");
        assert!(
            layout
                .encode_tail(1, &values[1..], &mut Vec::new())
                .is_err()
        );
        assert!(
            layout
                .encode_tail(
                    1,
                    &[port(80), port(80), port(80), port(80), port(80)],
                    &mut Vec::new()
                )
                .is_err()
        );
        assert!(layout.encode_tail(9, &values, &mut Vec::new()).is_err());
        // Only data maps.
        let plain = Set {
            data: vec![],
            ..map.clone()
        };
        assert!(DataMapLayout::new(&plain).is_err());
        let verdicts = Set {
            data: vec![Verdict as i32],
            ..map
        };
        assert!(DataMapLayout::new(&verdicts).is_err());
    }

    #[test]
    fn refuses_bad_definitions() {
        use DataType::*;
        let no_key = Set {
            name: "s".to_owned(),
            ..Set::default()
        };
        assert!(matches!(
            SetLayout::new(&no_key),
            Err(EncodeError::Set { .. })
        ));
        let verdict_in_concat = Set {
            name: "s".to_owned(),
            key: vec![Integer as i32],
            data: vec![Verdict as i32, Integer as i32],
            ..Set::default()
        };
        assert!(SetLayout::new(&verdict_in_concat).is_err());
        let unnamed = Set {
            key: vec![Integer as i32],
            ..Set::default()
        };
        assert!(matches!(
            SetLayout::new(&unnamed),
            Err(EncodeError::InvalidName { .. })
        ));
    }
}
