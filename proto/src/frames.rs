//! Updates whose body is encoded once and shared.
//!
//! Thousands of nodes standing at the same version get the same delta (or snapshot). Protobuf
//! fields may be encoded in any order and concatenated, so an `Update` is written as the few
//! per-node fields (epoch, generation, base generation) followed by the shared, pre-encoded
//! rest (body, trigger times, objects, digest). The brain pays the encoding once per distinct
//! update, and per node only the copy into the stream (invariant 4).
use bytes::{Buf, BufMut, Bytes};
use prost::Message;
use prost::encoding::{DecodeContext, WireType};

use crate::v1::{Update, update::Body};

/// Wire-identical to [`Update`]; only ever encoded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UpdateFrame {
    pub brain_epoch: u64,
    pub generation: u64,
    pub base_generation: u64,
    /// Fields 4 and up of `Update`, already encoded (see [`encode_shared`]).
    pub shared: Bytes,
    /// More such fields, written after `shared` (a node's own part of a shared update).
    pub extra: Bytes,
}

/// Encodes the fields every node at the same base shares: body, trigger times, objects,
/// digest, split into parts of at most `max_elements` elements (see [`crate::parts`]). Each
/// result is the `shared` of one frame; send them in order.
pub fn encode_shared(
    body: Body,
    trigger_times: Vec<prost_types::Timestamp>,
    objects: Vec<String>,
    digest: Vec<u8>,
    max_elements: usize,
) -> Vec<Bytes> {
    let parts = crate::parts::split(body, max_elements);
    let last = parts.len().saturating_sub(1);
    let mut tail = Some((trigger_times, objects, digest));
    parts
        .into_iter()
        .enumerate()
        .map(|(i, part)| {
            let mut u = Update {
                body: Some(part),
                more: i < last,
                ..Default::default()
            };
            if i == last
                && let Some((t, o, d)) = tail.take()
            {
                (u.trigger_times, u.objects, u.digest) = (t, o, d);
            }
            Bytes::from(u.encode_to_vec())
        })
        .collect()
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

/// The last part's shared fields: trigger times and objects.
pub fn encode_tail(trigger_times: Vec<prost_types::Timestamp>, objects: Vec<String>) -> Bytes {
    Bytes::from(
        Update {
            trigger_times,
            objects,
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

impl Message for UpdateFrame {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if self.brain_epoch != 0 {
            prost::encoding::uint64::encode(1, &self.brain_epoch, buf);
        }
        if self.generation != 0 {
            prost::encoding::uint64::encode(2, &self.generation, buf);
        }
        if self.base_generation != 0 {
            prost::encoding::uint64::encode(3, &self.base_generation, buf);
        }
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
    use crate::v1::{Ruleset, RulesetDelta, Table};

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
        let mut shared = encode_shared(
            Body::Delta(delta.clone()),
            vec![prost_types::Timestamp {
                seconds: 5,
                nanos: 6,
            }],
            vec!["EndpointSlice a/b".into()],
            vec![1, 2, 3],
            1000,
        );
        assert_eq!(shared.len(), 1);
        let shared = shared.remove(0);
        let frame = UpdateFrame {
            brain_epoch: 7,
            generation: 9,
            base_generation: 8,
            shared,
            ..Default::default()
        };
        let bytes = frame.encode_to_vec();
        assert_eq!(bytes.len(), frame.encoded_len());
        let u = Update::decode(&bytes[..]).unwrap();
        assert_eq!((u.brain_epoch, u.generation, u.base_generation), (7, 9, 8));
        assert_eq!(u.body, Some(Body::Delta(delta)));
        assert_eq!(u.trigger_times[0].nanos, 6);
        assert_eq!(u.objects, vec!["EndpointSlice a/b".to_string()]);
        assert_eq!(u.digest, vec![1, 2, 3]);
        assert!(!u.more);
        // A snapshot frame too.
        let shared = encode_shared(
            Body::Snapshot(Ruleset::default()),
            vec![],
            vec![],
            vec![],
            1000,
        )
        .remove(0);
        let u = Update::decode(
            &UpdateFrame {
                generation: 1,
                shared,
                ..Default::default()
            }
            .encode_to_vec()[..],
        )
        .unwrap();
        assert_eq!(u.body, Some(Body::Snapshot(Ruleset::default())));
    }
}
