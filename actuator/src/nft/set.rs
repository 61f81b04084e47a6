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
use super::error::{DecodeError, EncodeError};
use super::udata::{Udata, comment_of, parse};
use crate::netlink::attr::{Attrs, NlaBuf};

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
    /// The IR's own `timeout` flag (the kernel's flag is also set by a default timeout).
    pub ir_timeout: bool,
    /// Userspace roles (see [`IrRecord`]).
    pub conntrack: i32,
    pub guards: String,
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
            ir_timeout: set.timeout,
            conntrack: set.conntrack,
            guards: set.guards.clone(),
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
    udata.put(SPLITPROXY_UDATA_SET_IR, &IrRecord::of(layout).encode());
    if udata.bytes().len() > USERDATA_MAXLEN {
        return Err(EncodeError::set(
            &layout.name,
            format!(
                "comment and guarded map name longer than the kernel's {USERDATA_MAXLEN} bytes of userdata"
            ),
        ));
    }
    b.put(NFTA_SET_USERDATA, udata.bytes());
    Ok(())
}

/// What of an IR set the kernel's set does not say, kept in the set's userdata so that a set
/// read back from the kernel (read.rs) is exactly the IR set the brain sent ("kernel is the
/// truth", docs/invariants.md): the field types as the IR names them (the kernel's type id
/// announces an integer inside a concatenation as a mark), the IR's timeout flag, and the
/// userspace roles (conntrack role, guarded map), which steer the actuator's clean-ups after a
/// restart too.
///
/// Layout: version (1), flags (bit 0: timeout), conntrack role (i32, little-endian), key field
/// count and types (one byte each), data field count and types, then the guarded map's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IrRecord {
    pub key: Vec<i32>,
    pub data: Vec<i32>,
    pub timeout: bool,
    pub conntrack: i32,
    pub guards: String,
}

impl IrRecord {
    const VERSION: u8 = 1;

    pub(crate) fn of(layout: &SetLayout) -> Self {
        IrRecord {
            key: layout.key.raw(),
            data: match &layout.data {
                SetData::None => vec![],
                SetData::Verdict => vec![DataType::Verdict as i32],
                SetData::Value(f) => f.raw(),
            },
            timeout: layout.ir_timeout,
            conntrack: layout.conntrack,
            guards: layout.guards.clone(),
        }
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = vec![Self::VERSION, u8::from(self.timeout)];
        out.extend_from_slice(&self.conntrack.to_le_bytes());
        for types in [&self.key, &self.data] {
            out.push(types.len() as u8);
            // Data types are below 64 (nft packs them in 6 bits).
            out.extend(types.iter().map(|t| *t as u8));
        }
        out.extend_from_slice(self.guards.as_bytes());
        out
    }

    pub(crate) fn decode(raw: &[u8]) -> Option<Self> {
        let [version, flags, c0, c1, c2, c3, rest @ ..] = raw else {
            return None;
        };
        if *version != Self::VERSION {
            return None;
        }
        let (&nkey, rest) = rest.split_first()?;
        let (key, rest) = rest.split_at_checked(usize::from(nkey))?;
        let (&ndata, rest) = rest.split_first()?;
        let (data, guards) = rest.split_at_checked(usize::from(ndata))?;
        Some(IrRecord {
            key: key.iter().map(|t| i32::from(*t)).collect(),
            data: data.iter().map(|t| i32::from(*t)).collect(),
            timeout: flags & 1 != 0,
            conntrack: i32::from_le_bytes([*c0, *c1, *c2, *c3]),
            guards: String::from_utf8(guards.to_vec()).ok()?,
        })
    }
}

/// (table, set definition) of a set message's attributes (NFT_MSG_NEWSET, as a dump returns
/// it), elements aside. The IR comes from splitproxy's userdata record; what the kernel says
/// (type ids, lengths, flags, default timeout) must agree with it, or the set is not one this
/// actuator made and the result is an error.
pub(crate) fn decode(attrs: &Attrs<'_>) -> Result<(String, Set), DecodeError> {
    let s = |ty| {
        attrs
            .find(ty)
            .and_then(|a| a.str())
            .unwrap_or_default()
            .to_owned()
    };
    let name = s(NFTA_SET_NAME);
    let err = |why: String| DecodeError::new("set", format!("{name}: {why}"));
    let u32_of = |ty| attrs.find(ty).and_then(|a| a.u32_be());
    let udata = attrs
        .find(NFTA_SET_USERDATA)
        .map(|a| a.value)
        .unwrap_or_default();
    let record = parse(udata)
        .into_iter()
        .find(|(t, _)| *t == SPLITPROXY_UDATA_SET_IR)
        .and_then(|(_, v)| IrRecord::decode(v))
        .ok_or_else(|| err("no splitproxy userdata: not a set this actuator made".to_owned()))?;
    let default_timeout_ms = match attrs.find(NFTA_SET_TIMEOUT) {
        None => 0,
        Some(a) => u64::from_be_bytes(
            a.value
                .try_into()
                .map_err(|_| err("timeout is not 8 bytes".to_owned()))?,
        ),
    };
    let flags = u32_of(NFTA_SET_FLAGS).unwrap_or(0);
    let set = Set {
        name: name.clone(),
        key: record.key,
        data: record.data,
        interval: flags & NFT_SET_INTERVAL != 0,
        timeout: record.timeout,
        default_timeout_ms,
        dynamic: flags & NFT_SET_EVAL != 0,
        comment: comment_of(udata, NFTNL_UDATA_SET_COMMENT),
        elements: vec![],
        conntrack: record.conntrack,
        guards: record.guards,
    };
    let layout = SetLayout::new(&set).map_err(|e| err(e.to_string()))?;
    let (data_type, data_len) = match &layout.data {
        SetData::None => (None, None),
        SetData::Verdict => (Some(NFT_DATA_VERDICT), u32_of(NFTA_SET_DATA_LEN)),
        SetData::Value(f) => (Some(f.type_id()), Some(f.byte_len() as u32)),
    };
    let agrees = layout.flags() == flags
        && u32_of(NFTA_SET_KEY_TYPE) == Some(layout.key.type_id())
        && u32_of(NFTA_SET_KEY_LEN) == Some(layout.key.byte_len() as u32)
        && u32_of(NFTA_SET_DATA_TYPE) == data_type
        && u32_of(NFTA_SET_DATA_LEN) == data_len;
    if !agrees {
        return Err(err(
            "the kernel's set differs from its userdata record".to_owned()
        ));
    }
    Ok((s(NFTA_SET_TABLE), set))
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

    /// [`super::decode`], for tests.
    pub(crate) fn decode(attrs: &Attrs<'_>) -> (String, Set) {
        super::decode(attrs).unwrap()
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
    fn userspace_roles_travel_only_in_the_sets_userdata() {
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
                let set = Attrs::new(b.bytes());
                let without_udata: Vec<(u16, Vec<u8>)> = set
                    .filter(|a| a.ty != NFTA_SET_USERDATA)
                    .map(|a| (a.ty, a.value.to_vec()))
                    .collect();
                (without_udata, elements, decode(&Attrs::new(b.bytes())).1)
            };
            let plain = encode(&set);
            for role in [ConntrackRole::Endpoints, ConntrackRole::NoEndpoints] {
                let with_role = Set {
                    conntrack: role as i32,
                    ..set.clone()
                };
                let got = encode(&with_role);
                assert_eq!((&got.0, &got.1), (&plain.0, &plain.1), "set {}", set.name);
                assert_eq!(got.2.conntrack, role as i32);
            }
            let guarding = Set {
                guards: "affinity".to_owned(),
                ..set.clone()
            };
            let got = encode(&guarding);
            assert_eq!((&got.0, &got.1), (&plain.0, &plain.1), "set {}", set.name);
            assert_eq!(got.2.guards, "affinity");
        }
    }

    #[test]
    fn an_integer_in_a_concatenation_reads_back_as_an_integer() {
        use DataType::*;
        for key in [[Ipv4Addr, Integer], [Ipv4Addr, Mark]] {
            let s = Set {
                name: "m".to_owned(),
                key: key.iter().map(|t| *t as i32).collect(),
                ..Set::default()
            };
            assert_eq!(round_trip(&s), s);
        }
    }

    #[test]
    fn userdata_longer_than_the_kernel_takes_is_refused() {
        let s = Set {
            name: "s".to_owned(),
            key: vec![DataType::Ipv4Addr as i32],
            comment: "c".repeat(120),
            guards: "g".repeat(200),
            ..Set::default()
        };
        let layout = SetLayout::new(&s).unwrap();
        assert!(encode_add(&mut NlaBuf::new(), "t", &layout, &s.comment, 1).is_err());
        assert_eq!(IrRecord::decode(&[9, 0, 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(IrRecord::decode(&[1, 0, 0, 0, 0, 0, 5, 7]), None);
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
