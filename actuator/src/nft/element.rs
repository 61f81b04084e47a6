//! Set elements: the entries of NFT_MSG_NEWSETELEM / NFT_MSG_DELSETELEM messages.
//!
//! An element is `NFTA_LIST_ELEM { KEY { VALUE }, [KEY_END], [DATA], [TIMEOUT], [USERDATA] }`.
//! Ranges of a single field are stored by the kernel's rbtree as two entries, the start and
//! the first value after the range flagged NFT_SET_ELEM_INTERVAL_END (omitted when the range
//! runs to the largest value); concatenated ranges carry their inclusive end in KEY_END.

use splitproxy_proto::v1::Element;

use super::check;
use super::consts::*;
use super::error::{DecodeError, EncodeError};
use super::expr::{put_value, verdict::decode_verdict, verdict::put_verdict};
use super::set::{SetData, SetLayout};
use super::udata::{Udata, comment_of};
use crate::netlink::attr::{Attr, Attrs, NlaBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Add,
    /// Only the key (and range end) identify the element; data, timeout and comment are not
    /// sent, so a caller may pass the element as it was added.
    Delete,
}

/// Appends the list entries of `elem` to `b` and returns how many there are (1 or 2).
/// `key` is scratch space, reused across calls to spare allocations.
pub(crate) fn encode(
    b: &mut NlaBuf,
    layout: &SetLayout,
    elem: &Element,
    index: usize,
    op: Op,
    key: &mut Vec<u8>,
) -> Result<usize, EncodeError> {
    let err = |why: String| EncodeError::element(&layout.name, index, why);
    key.clear();
    layout
        .key
        .encode(&elem.key, key)
        .map_err(|why| err(format!("key: {why}")))?;
    let key_len = key.len();
    if !elem.key_end.is_empty() {
        if !layout.interval {
            return Err(err("key_end in a set without intervals".to_owned()));
        }
        layout
            .key
            .encode(&elem.key_end, key)
            .map_err(|why| err(format!("key_end: {why}")))?;
        // Bytewise order is numeric order only for one big-endian field.
        let comparable = !layout.key.is_concat() && layout.key.byteorder() == BYTEORDER_BIG_ENDIAN;
        if comparable && key[key_len..] < key[..key_len] {
            return Err(err("key_end is before key".to_owned()));
        }
    } else if layout.interval {
        key.extend_from_within(..key_len);
    }
    let (start, end) = key.split_at_mut(key_len);

    let entry = b.begin_nest(NFTA_LIST_ELEM);
    put_value(b, NFTA_SET_ELEM_KEY, start);
    if layout.concat_interval() {
        put_value(b, NFTA_SET_ELEM_KEY_END, end);
    }
    if op == Op::Add {
        encode_payload(b, layout, elem).map_err(err)?;
    }
    b.end_nest(entry);

    // A single-field range also needs its exclusive end, unless it runs to the maximum.
    if layout.interval && !layout.concat_interval() && layout.key.increment(end) {
        let entry = b.begin_nest(NFTA_LIST_ELEM);
        put_value(b, NFTA_SET_ELEM_KEY, end);
        b.put_u32_be(NFTA_SET_ELEM_FLAGS, NFT_SET_ELEM_INTERVAL_END);
        b.end_nest(entry);
        return Ok(2);
    }
    Ok(1)
}

/// Appends the list entry of an element identified by its key bytes as the kernel holds them
/// (from a dump), for a deletion.
pub(crate) fn encode_key(b: &mut NlaBuf, key: &[u8]) {
    let entry = b.begin_nest(NFTA_LIST_ELEM);
    put_value(b, NFTA_SET_ELEM_KEY, key);
    b.end_nest(entry);
}

/// An element as a dump returns it: its key and, for a data map, its data, as bytes in the
/// layout of the set (datum.rs). What the bytes mean is up to whoever knows the set's layout.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RawElement {
    pub key: Vec<u8>,
    /// Empty for plain sets and verdict maps.
    pub data: Vec<u8>,
}

/// Appends the elements of an NFTA_SET_ELEM_LIST_ELEMENTS attribute to `out`. Interval-end
/// entries and entries without a key value are skipped.
pub(crate) fn decode_raw(list: &Attr<'_>, out: &mut Vec<RawElement>) {
    let value = |a: &Attrs<'_>, ty| -> Option<Vec<u8>> {
        Some(a.find(ty)?.nested().find(NFTA_DATA_VALUE)?.value.to_vec())
    };
    for entry in list.nested() {
        let a = entry.nested();
        let flags = a
            .find(NFTA_SET_ELEM_FLAGS)
            .and_then(|f| f.u32_be())
            .unwrap_or(0);
        if flags & NFT_SET_ELEM_INTERVAL_END != 0 {
            continue;
        }
        let Some(key) = value(&a, NFTA_SET_ELEM_KEY) else {
            continue;
        };
        out.push(RawElement {
            key,
            data: value(&a, NFTA_SET_ELEM_DATA).unwrap_or_default(),
        });
    }
}

/// One entry of an element dump, before interval ends are folded into their ranges.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    key: Vec<u8>,
    /// An NFT_SET_ELEM_INTERVAL_END entry: the first value after a single-field range.
    end: bool,
    element: Element,
}

/// Decodes the entries of an NFTA_SET_ELEM_LIST_ELEMENTS attribute (one dump message) into
/// `out`; [`decode`] turns all of a set's entries into IR elements.
pub(crate) fn decode_entries(
    layout: &SetLayout,
    list: &Attr<'_>,
    out: &mut Vec<Entry>,
) -> Result<(), DecodeError> {
    let err = |why: String| DecodeError::new("set element", format!("set {}: {why}", layout.name));
    let value = |a: &Attrs<'_>, ty| -> Option<Vec<u8>> {
        Some(a.find(ty)?.nested().find(NFTA_DATA_VALUE)?.value.to_vec())
    };
    for entry in list.nested() {
        let a = entry.nested();
        let key = value(&a, NFTA_SET_ELEM_KEY).ok_or_else(|| err("no key".to_owned()))?;
        let flags = a
            .find(NFTA_SET_ELEM_FLAGS)
            .and_then(|f| f.u32_be())
            .unwrap_or(0);
        if flags & NFT_SET_ELEM_INTERVAL_END != 0 {
            out.push(Entry {
                key,
                end: true,
                element: Element::default(),
            });
            continue;
        }
        let decode_key = |bytes: &[u8]| {
            layout
                .key
                .decode(bytes)
                .ok_or_else(|| err("key of the wrong length".to_owned()))
        };
        let mut e = Element {
            key: decode_key(&key)?,
            ..Element::default()
        };
        if let Some(end) = value(&a, NFTA_SET_ELEM_KEY_END) {
            e.key_end = decode_key(&end)?;
        }
        match &layout.data {
            SetData::None => {}
            SetData::Verdict => e.verdict = Some(decode_verdict(&a, NFTA_SET_ELEM_DATA)?),
            SetData::Value(f) => {
                let data =
                    value(&a, NFTA_SET_ELEM_DATA).ok_or_else(|| err("no data".to_owned()))?;
                e.data = f
                    .decode(&data)
                    .ok_or_else(|| err("data of the wrong length".to_owned()))?;
            }
        }
        e.timeout_ms = match a.find(NFTA_SET_ELEM_TIMEOUT) {
            None => 0,
            Some(t) => u64::from_be_bytes(
                t.value
                    .try_into()
                    .map_err(|_| err("timeout is not 8 bytes".to_owned()))?,
            ),
        };
        e.comment = a
            .find(NFTA_SET_ELEM_USERDATA)
            .map(|u| comment_of(u.value, NFTNL_UDATA_SET_ELEM_COMMENT))
            .unwrap_or_default();
        out.push(Entry {
            key,
            end: false,
            element: e,
        });
    }
    Ok(())
}

/// Turns a set's dumped entries into IR elements. A single-field range is two entries, its
/// start and (flagged) the first value after it, which the kernel lists in its own order: the
/// entries are sorted by value, and each start takes the end that follows it (inclusive, like
/// the IR), or runs to the largest value when a start or nothing follows. Concatenated ranges
/// carry their end in the element itself.
pub(crate) fn decode(
    layout: &SetLayout,
    mut entries: Vec<Entry>,
    out: &mut Vec<Element>,
) -> Result<(), DecodeError> {
    if !layout.interval || layout.concat_interval() {
        if entries.iter().any(|e| e.end) {
            return Err(DecodeError::new(
                "set element",
                format!(
                    "set {}: an interval end outside a single-field interval set",
                    layout.name
                ),
            ));
        }
        out.extend(entries.into_iter().map(|e| e.element));
        return Ok(());
    }
    // At equal values an end sorts before a start: adjacent ranges share that value.
    entries.sort_by_cached_key(|e| (layout.key.order_key(&e.key), !e.end));
    let mut open: Option<Element> = None;
    for entry in entries {
        if entry.end {
            let Some(mut e) = open.take() else {
                return Err(DecodeError::new(
                    "set element",
                    format!("set {}: an interval end without a start", layout.name),
                ));
            };
            let mut end = entry.key;
            // Undo the +1 of the exclusive end.
            if !layout.key.decrement(&mut end) {
                return Err(DecodeError::new(
                    "set element",
                    format!("set {}: an interval end at zero", layout.name),
                ));
            }
            e.key_end = layout.key.decode(&end).unwrap_or_default();
            out.push(e);
        } else {
            if let Some(mut e) = open.take() {
                e.key_end = layout.key.decode(&max_of(layout)).unwrap_or_default();
                out.push(e);
            }
            open = Some(entry.element);
        }
    }
    if let Some(mut e) = open.take() {
        e.key_end = layout.key.decode(&max_of(layout)).unwrap_or_default();
        out.push(e);
    }
    Ok(())
}

/// The largest key of a single-field set: all ones, whatever the byte order.
fn max_of(layout: &SetLayout) -> Vec<u8> {
    vec![0xff; layout.key.byte_len()]
}

/// Data or verdict, timeout and comment of an added element.
fn encode_payload(b: &mut NlaBuf, layout: &SetLayout, elem: &Element) -> Result<(), String> {
    match &layout.data {
        SetData::None => {
            if !elem.data.is_empty() || elem.verdict.is_some() {
                return Err("data or verdict for a plain set".to_owned());
            }
        }
        SetData::Verdict => {
            if !elem.data.is_empty() {
                return Err("data for a verdict map".to_owned());
            }
            let v = elem
                .verdict
                .as_ref()
                .ok_or("verdict map element without verdict")?;
            put_verdict(b, NFTA_SET_ELEM_DATA, v).map_err(|e| e.to_string())?;
        }
        SetData::Value(fields) => {
            if elem.verdict.is_some() {
                return Err("verdict for a data map".to_owned());
            }
            let mut data = Vec::with_capacity(fields.byte_len());
            fields
                .encode(&elem.data, &mut data)
                .map_err(|why| format!("data: {why}"))?;
            put_value(b, NFTA_SET_ELEM_DATA, &data);
        }
    }
    if elem.timeout_ms > 0 {
        if !layout.timeout {
            return Err("timeout in a set without timeouts".to_owned());
        }
        b.put_u64_be(NFTA_SET_ELEM_TIMEOUT, elem.timeout_ms);
    }
    if !elem.comment.is_empty() {
        check::comment("element", &elem.comment).map_err(|e| e.to_string())?;
        let udata = Udata::comment(NFTNL_UDATA_SET_ELEM_COMMENT, &elem.comment);
        b.put(NFTA_SET_ELEM_USERDATA, udata.bytes());
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::nft::datum::tests::{int, ip4, port, proto};
    use splitproxy_proto::v1::{DataType, Set, Verdict, VerdictCode};

    /// [`super::decode`], for tests: panics on what it cannot read.
    pub(crate) fn decode(layout: &SetLayout, list: &Attr<'_>) -> Vec<Element> {
        let mut out = Vec::new();
        let mut entries = Vec::new();
        super::decode_entries(layout, list, &mut entries).unwrap();
        super::decode(layout, entries, &mut out).unwrap();
        out
    }

    fn round_trip(set: &Set, elems: &[Element]) -> (usize, Vec<Element>) {
        let layout = SetLayout::new(set).unwrap();
        let mut b = NlaBuf::new();
        let list = b.begin_nest(NFTA_SET_ELEM_LIST_ELEMENTS);
        let mut entries = 0;
        let mut scratch = Vec::new();
        for (i, e) in elems.iter().enumerate() {
            entries += encode(&mut b, &layout, e, i, Op::Add, &mut scratch).unwrap();
        }
        b.end_nest(list);
        let list = Attrs::new(b.bytes()).next().unwrap();
        (entries, decode(&layout, &list))
    }

    fn set(name: &str, key: &[DataType], data: &[DataType]) -> Set {
        Set {
            name: name.to_owned(),
            key: key.iter().map(|t| *t as i32).collect(),
            data: data.iter().map(|t| *t as i32).collect(),
            ..Set::default()
        }
    }

    #[test]
    fn round_trip_the_splitproxy_maps() {
        for s in crate::nft::tests::fixture::sets() {
            let (entries, back) = round_trip(&s, &s.elements);
            assert_eq!(entries, s.elements.len());
            assert_eq!(back, s.elements, "set {}", s.name);
        }
    }

    #[test]
    fn single_field_ranges_become_start_and_end_entries() {
        use DataType::*;
        let mut s = set("cidrs", &[Ipv4Addr], &[]);
        s.interval = true;
        let elems = vec![
            Element {
                key: vec![ip4([10, 96, 0, 0])],
                key_end: vec![ip4([10, 96, 255, 255])],
                ..Element::default()
            },
            Element {
                key: vec![ip4([192, 168, 1, 1])],
                ..Element::default()
            },
            // Runs to the maximum: no end entry.
            Element {
                key: vec![ip4([240, 0, 0, 0])],
                key_end: vec![ip4([255, 255, 255, 255])],
                ..Element::default()
            },
        ];
        let (entries, back) = round_trip(&s, &elems);
        assert_eq!(entries, 5);
        let mut want = elems.clone();
        want[1].key_end = want[1].key.clone();
        assert_eq!(back, want);
    }

    #[test]
    fn concatenated_ranges_use_key_end() {
        use DataType::*;
        let mut s = set("ranges", &[Ipv4Addr, InetService], &[]);
        s.interval = true;
        let elems = vec![Element {
            key: vec![ip4([10, 0, 0, 0]), port(30000)],
            key_end: vec![ip4([10, 0, 0, 255]), port(32767)],
            ..Element::default()
        }];
        let (entries, back) = round_trip(&s, &elems);
        assert_eq!(entries, 1);
        assert_eq!(back, elems);
    }

    #[test]
    fn timeouts_comments_and_verdicts() {
        let mut s = set("vm", &[DataType::Integer], &[DataType::Verdict]);
        s.timeout = true;
        let elems = vec![Element {
            key: vec![int(7)],
            verdict: Some(Verdict {
                code: VerdictCode::Goto as i32,
                chain: "endpoints-2".to_owned(),
            }),
            timeout_ms: 5000,
            comment: "ns/svc:http".to_owned(),
            ..Element::default()
        }];
        assert_eq!(round_trip(&s, &elems).1, elems);
    }

    #[test]
    fn refuses_elements_that_do_not_fit_the_set() {
        use DataType::*;
        let layout = SetLayout::new(&set("m", &[Ipv4Addr, InetProto], &[Integer])).unwrap();
        let mut scratch = Vec::new();
        let mut enc =
            |e: Element| encode(&mut NlaBuf::new(), &layout, &e, 4, Op::Add, &mut scratch);
        let key = vec![ip4([1, 2, 3, 4]), proto(6)];
        assert!(
            enc(Element {
                key: key.clone(),
                data: vec![int(1)],
                ..Element::default()
            })
            .is_ok()
        );
        let no_data = enc(Element {
            key: key.clone(),
            ..Element::default()
        });
        assert!(matches!(
            no_data,
            Err(EncodeError::Element { index: 4, .. })
        ));
        let wrong_key = enc(Element {
            key: vec![ip4([1, 2, 3, 4]), port(6)],
            data: vec![int(1)],
            ..Element::default()
        });
        assert!(wrong_key.is_err());
        let timeout = enc(Element {
            key: key.clone(),
            data: vec![int(1)],
            timeout_ms: 1,
            ..Element::default()
        });
        assert!(timeout.is_err());
        let range = enc(Element {
            key: key.clone(),
            key_end: key,
            data: vec![int(1)],
            ..Element::default()
        });
        assert!(range.is_err());
    }

    #[test]
    fn delete_sends_only_the_key() {
        use DataType::*;
        let layout = SetLayout::new(&set("m", &[Ipv4Addr], &[Integer])).unwrap();
        let mut b = NlaBuf::new();
        let e = Element {
            key: vec![ip4([1, 2, 3, 4])],
            data: vec![int(1)],
            comment: "x".to_owned(),
            ..Element::default()
        };
        encode(&mut b, &layout, &e, 0, Op::Delete, &mut Vec::new()).unwrap();
        let entry = Attrs::new(b.bytes()).next().unwrap();
        let types: Vec<u16> = entry.nested().map(|a| a.ty).collect();
        assert_eq!(types, vec![NFTA_SET_ELEM_KEY]);
    }
    #[test]
    fn raw_decode_gives_the_key_and_data_bytes() {
        use DataType::*;
        let mut s = set("m", &[Ipv4Addr, InetService], &[Ipv4Addr, InetService]);
        s.timeout = true;
        let layout = SetLayout::new(&s).unwrap();
        let elems = [
            Element {
                key: vec![ip4([10, 0, 0, 1]), port(80)],
                data: vec![ip4([10, 244, 0, 1]), port(8080)],
                timeout_ms: 1000,
                comment: "c".to_owned(),
                ..Element::default()
            },
            Element {
                key: vec![ip4([10, 0, 0, 2]), port(443)],
                data: vec![ip4([10, 244, 0, 2]), port(8443)],
                ..Element::default()
            },
        ];
        let mut b = NlaBuf::new();
        let list = b.begin_nest(NFTA_SET_ELEM_LIST_ELEMENTS);
        for (i, e) in elems.iter().enumerate() {
            encode(&mut b, &layout, e, i, Op::Add, &mut Vec::new()).unwrap();
        }
        b.end_nest(list);
        let mut got = Vec::new();
        decode_raw(&Attrs::new(b.bytes()).next().unwrap(), &mut got);
        assert_eq!(
            got,
            vec![
                RawElement {
                    key: vec![10, 0, 0, 1, 0, 80, 0, 0],
                    data: vec![10, 244, 0, 1, 0x1f, 0x90, 0, 0],
                },
                RawElement {
                    key: vec![10, 0, 0, 2, 1, 187, 0, 0],
                    data: vec![10, 244, 0, 2, 0x20, 0xfb, 0, 0],
                },
            ]
        );
        // And a deletion by those bytes is the deletion the IR element encodes to.
        let mut by_ir = NlaBuf::new();
        encode(
            &mut by_ir,
            &layout,
            &elems[0],
            0,
            Op::Delete,
            &mut Vec::new(),
        )
        .unwrap();
        let mut by_key = NlaBuf::new();
        encode_key(&mut by_key, &got[0].key);
        assert_eq!(by_key.bytes(), by_ir.bytes());
    }
}
