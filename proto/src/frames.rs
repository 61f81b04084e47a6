//! Updates whose body is encoded once and shared.
//!
//! Thousands of nodes standing at the same version get the same delta (or snapshot) of the
//! shared ruleset. Protobuf fields may be encoded in any order and concatenated, so an `Update`
//! is written as the few per-node fields (epoch, generation, base generation) followed by the
//! shared, pre-encoded rest: the shared parts ([`encode_parts`]), then a last frame carrying the
//! shared tail ([`encode_tail`]: trigger times, objects) and the node's own small part
//! ([`encode_node_part`]: its overlay's change and the digest). The brain pays the shared
//! encoding once per distinct update, and per node only its own part and the copy into the
//! stream ("cost follows the change", docs/invariants.md).
use bytes::{Buf, BufMut, Bytes};
use prost::Message;
use prost::encoding::{DecodeContext, WireType};

use crate::model::Model;
use crate::v1::{Set, Table, Update, update::Body};

/// Wire-identical to [`Update`]; only ever encoded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UpdateFrame {
    pub brain_epoch: u64,
    pub generation: u64,
    pub base_generation: u64,
    /// Fields 4 and up of `Update`, already encoded (see [`encode_parts`], [`encode_tail`]).
    pub shared: Bytes,
    /// More such fields, written after `shared` (a node's own part of a shared update).
    pub extra: Bytes,
}

/// The shared parts of an update that a node-specific part completes: every part says `more`,
/// none carries the tail. Empty for an empty delta.
pub fn encode_parts(body: Body, max_elements: usize) -> Vec<Bytes> {
    if matches!(&body, Body::Delta(d) if d.is_empty()) {
        return Vec::new();
    }
    crate::parts::split(body, max_elements)
        .into_iter()
        .map(|part| {
            Bytes::from(
                Update {
                    body: Some(part),
                    more: true,
                    ..Default::default()
                }
                .encode_to_vec(),
            )
        })
        .collect()
}

/// The parts of a snapshot of `model`, byte for byte what
/// `encode_parts(Body::Snapshot(model.to_ruleset()), max_elements)` gives, written from the
/// model's encoded elements as they are: a snapshot of 10,000 Services is over 100,000
/// elements, and decoding each into an `Element` only to encode it again cost the brain about
/// 100 MiB at the moment of its peak (a cold start) and the CPU of both.
pub fn encode_snapshot_parts(model: &Model, max_elements: usize) -> Vec<Bytes> {
    let max = max_elements.max(1);
    let mut parts = vec![Bytes::from(
        Update {
            body: Some(Body::Snapshot(model.shells())),
            more: true,
            ..Default::default()
        }
        .encode_to_vec(),
    )];
    for ((family, name), tm) in &model.tables {
        let table = Table {
            family: *family as i32,
            name: name.clone(),
            comment: tm.comment.clone(),
            ..Default::default()
        }
        .encode_to_vec();
        for sm in tm.sets.values() {
            // A Set's fields in field-number order: those before `elements` (9), the elements,
            // those after it.
            let before = Set {
                conntrack: 0,
                guards: String::new(),
                ..(*sm.def).clone()
            }
            .encode_to_vec();
            let after = Set {
                conntrack: sm.def.conntrack,
                guards: sm.def.guards.clone(),
                ..Default::default()
            }
            .encode_to_vec();
            let elements: Vec<&[u8]> = sm.elements.values().map(|e| &e[..]).collect();
            for chunk in elements.chunks(max) {
                parts.push(snapshot_part(&table, &before, chunk, &after));
            }
        }
    }
    parts
}

/// `Update { snapshot: Ruleset { tables: [table + Set { before, elements, after }] }, more }`,
/// each length computed from the bytes inside it.
fn snapshot_part(table: &[u8], before: &[u8], elements: &[&[u8]], after: &[u8]) -> Bytes {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len};
    let field = |tag: u32, len: usize| key_len(tag) + encoded_len_varint(len as u64) + len;
    let set_len = before.len()
        + elements
            .iter()
            .map(|e| field(SET_ELEMENTS, e.len()))
            .sum::<usize>()
        + after.len();
    let table_len = table.len() + field(TABLE_SETS, set_len);
    let ruleset_len = field(RULESET_TABLES, table_len);
    let total = field(UPDATE_SNAPSHOT, ruleset_len) + key_len(UPDATE_MORE) + 1;
    let mut buf = Vec::with_capacity(total);
    let nested = |buf: &mut Vec<u8>, tag: u32, len: usize| {
        encode_key(tag, WireType::LengthDelimited, buf);
        encode_varint(len as u64, buf);
    };
    nested(&mut buf, UPDATE_SNAPSHOT, ruleset_len);
    nested(&mut buf, RULESET_TABLES, table_len);
    buf.extend_from_slice(table);
    nested(&mut buf, TABLE_SETS, set_len);
    buf.extend_from_slice(before);
    for e in elements {
        nested(&mut buf, SET_ELEMENTS, e.len());
        buf.extend_from_slice(e);
    }
    buf.extend_from_slice(after);
    encode_key(UPDATE_MORE, WireType::Varint, &mut buf);
    encode_varint(1, &mut buf);
    debug_assert_eq!(buf.len(), total);
    Bytes::from(buf)
}

/// Field numbers of the messages [`snapshot_part`] writes (dataplane.proto, ruleset.proto).
const UPDATE_SNAPSHOT: u32 = 4;
const UPDATE_MORE: u32 = 9;
const RULESET_TABLES: u32 = 1;
const TABLE_SETS: u32 = 5;
const SET_ELEMENTS: u32 = 9;

/// The last part's shared fields: trigger times, objects and the API state of the target.
pub fn encode_tail(
    trigger_times: Vec<prost_types::Timestamp>,
    objects: Vec<String>,
    resource_versions: Vec<u64>,
) -> Bytes {
    Bytes::from(
        Update {
            trigger_times,
            objects,
            resource_versions,
            ..Default::default()
        }
        .encode_to_vec(),
    )
}

/// The last part's node-specific fields: the node's own body and the digest of everything.
pub fn encode_node_part(body: Body, digest: Vec<u8>) -> Bytes {
    Bytes::from(
        Update {
            body: Some(body),
            digest,
            ..Default::default()
        }
        .encode_to_vec(),
    )
}

/// Adds the trace context of the span that sends `frame` (field `traceparent`) to its node's
/// own part. Only sampled traces reach this (docs/observability.md); nothing else ever pays for
/// the field, and the shared bytes stay shared.
pub fn set_traceparent(frame: &mut UpdateFrame, traceparent: String) {
    let field = Update {
        traceparent,
        ..Default::default()
    };
    let mut extra = Vec::with_capacity(frame.extra.len() + field.encoded_len());
    extra.extend_from_slice(&frame.extra);
    field.encode_raw(&mut extra);
    frame.extra = Bytes::from(extra);
}

impl UpdateFrame {
    /// Writes the frame's own fields, which come before its pre-encoded `shared` and `extra`
    /// bytes: an encoder may send those as they are, without copying them (the brain's `Sync`
    /// responses do).
    pub fn encode_head(&self, buf: &mut impl BufMut) {
        if self.brain_epoch != 0 {
            prost::encoding::uint64::encode(1, &self.brain_epoch, buf);
        }
        if self.generation != 0 {
            prost::encoding::uint64::encode(2, &self.generation, buf);
        }
        if self.base_generation != 0 {
            prost::encoding::uint64::encode(3, &self.base_generation, buf);
        }
    }
}

impl Message for UpdateFrame {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.encode_head(buf);
        buf.put_slice(&self.shared);
        buf.put_slice(&self.extra);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        match tag {
            1 => prost::encoding::uint64::merge(wire_type, &mut self.brain_epoch, buf, ctx),
            2 => prost::encoding::uint64::merge(wire_type, &mut self.generation, buf, ctx),
            3 => prost::encoding::uint64::merge(wire_type, &mut self.base_generation, buf, ctx),
            _ => prost::encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let f = |tag, v: &u64| {
            if *v != 0 {
                prost::encoding::uint64::encoded_len(tag, v)
            } else {
                0
            }
        };
        f(1, &self.brain_epoch)
            + f(2, &self.generation)
            + f(3, &self.base_generation)
            + self.shared.len()
            + self.extra.len()
    }

    fn clear(&mut self) {
        *self = UpdateFrame::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{Chain, Datum, Element, Family, Ruleset, RulesetDelta, datum::Value};

    /// Two tables of different families; sets with and without elements, one with the fields
    /// that come after `elements` (conntrack, guards), elements with a comment or a verdict.
    fn model() -> Model {
        let elem = |k: u32, comment: &str| Element {
            key: vec![Datum {
                value: Some(Value::U32(k)),
            }],
            data: vec![Datum {
                value: Some(Value::U32(k * 7)),
            }],
            comment: comment.into(),
            ..Default::default()
        };
        let table = |family: Family, name: &str| Table {
            family: family as i32,
            name: name.into(),
            comment: format!("{name} table"),
            chains: vec![Chain {
                name: "c".into(),
                ..Default::default()
            }],
            sets: vec![
                Set {
                    name: "a".into(),
                    key: vec![4],
                    data: vec![4],
                    comment: "with guards".into(),
                    conntrack: 1,
                    guards: "g".into(),
                    elements: (0..7)
                        .map(|k| elem(k, if k % 2 == 0 { "x" } else { "" }))
                        .collect(),
                    ..Default::default()
                },
                Set {
                    name: "b".into(),
                    key: vec![4],
                    ..Default::default()
                },
                Set {
                    name: "c".into(),
                    key: vec![4],
                    data: vec![4],
                    interval: true,
                    timeout: true,
                    default_timeout_ms: 5_000,
                    elements: (100..103).map(|k| elem(k, "")).collect(),
                    ..Default::default()
                },
            ],
        };
        Model::from_ruleset(&Ruleset {
            tables: vec![table(Family::Ip, "t4"), table(Family::Ip6, "t6")],
        })
    }

    #[test]
    fn snapshot_parts_from_the_model_are_those_of_its_ruleset() {
        let model = model();
        for max in [1, 2, 3, 1024] {
            assert_eq!(
                encode_snapshot_parts(&model, max),
                encode_parts(Body::Snapshot(model.to_ruleset()), max),
                "{max} elements per part"
            );
        }
        assert_eq!(
            encode_snapshot_parts(&Model::default(), 4),
            encode_parts(Body::Snapshot(Ruleset::default()), 4)
        );
        // And they decode into the whole ruleset again.
        let parts = encode_snapshot_parts(&model, 2)
            .iter()
            .map(|p| Update::decode(&p[..]).unwrap().body.unwrap())
            .collect::<Vec<_>>();
        let Body::Snapshot(joined) = crate::parts::join(parts).unwrap() else {
            panic!("not a snapshot");
        };
        assert_eq!(Model::from_ruleset(&joined).digest(), model.digest());
    }

    #[test]
    fn frames_decode_as_updates() {
        let delta = RulesetDelta {
            upsert: vec![Table {
                family: 2,
                name: "splitproxy".into(),
                ..Default::default()
            }],
            remove: vec![],
        };
        let frame = |shared: Bytes, extra: Bytes| UpdateFrame {
            brain_epoch: 7,
            generation: 9,
            base_generation: 8,
            shared,
            extra,
        };
        let decode = |f: &UpdateFrame| {
            let bytes = f.encode_to_vec();
            assert_eq!(bytes.len(), f.encoded_len());
            Update::decode(&bytes[..]).unwrap()
        };
        // A shared part: the body, more to follow, no tail.
        let mut parts = encode_parts(Body::Delta(delta.clone()), 1000);
        assert_eq!(parts.len(), 1);
        let u = decode(&frame(parts.remove(0), Bytes::new()));
        assert_eq!((u.brain_epoch, u.generation, u.base_generation), (7, 9, 8));
        assert_eq!(u.body, Some(Body::Delta(delta.clone())));
        assert!(u.more && u.trigger_times.is_empty() && u.digest.is_empty());
        // The last frame: the shared tail and the node's own part.
        let tail = encode_tail(
            vec![prost_types::Timestamp {
                seconds: 5,
                nanos: 6,
            }],
            vec!["EndpointSlice a/b".into()],
            vec![11, 12, 13, 0],
        );
        let own = encode_node_part(Body::Delta(delta.clone()), vec![1, 2, 3]);
        let u = decode(&frame(tail, own));
        assert_eq!(u.body, Some(Body::Delta(delta)));
        assert_eq!(u.resource_versions, vec![11, 12, 13, 0]);
        assert_eq!(u.trigger_times[0].nanos, 6);
        assert_eq!(u.objects, vec!["EndpointSlice a/b".to_string()]);
        assert_eq!(u.digest, vec![1, 2, 3]);
        assert!(!u.more);
        assert!(u.traceparent.is_empty(), "no trace context unless set");
        // A trace context joins the node's part; the rest decodes as before.
        let own = encode_node_part(Body::Delta(RulesetDelta::default()), vec![1, 2, 3]);
        let tail = encode_tail(vec![], vec!["Service a/b".into()], vec![]);
        let mut traced = frame(tail, own);
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        set_traceparent(&mut traced, tp.into());
        let u = decode(&traced);
        assert_eq!(u.traceparent, tp);
        assert_eq!(
            (u.digest.as_slice(), u.objects.len()),
            (&[1u8, 2, 3][..], 1)
        );
        // An empty shared delta has no parts; a snapshot part decodes as a snapshot.
        assert!(encode_parts(Body::Delta(RulesetDelta::default()), 1000).is_empty());
        let mut parts = encode_parts(Body::Snapshot(Ruleset::default()), 1000);
        let u = decode(&frame(parts.remove(0), Bytes::new()));
        assert_eq!(u.body, Some(Body::Snapshot(Ruleset::default())));
    }
}
