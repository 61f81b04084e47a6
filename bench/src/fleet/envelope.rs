//! An `Update` as a virtual node reads it: the header decoded, the bodies left encoded.
//!
//! The bodies stay as bytes because most of them are the shared parts every node at the same
//! base receives with identical bytes; [`super::shared`] decodes those once for the whole fleet,
//! keyed by the bytes themselves.
use std::time::{Duration, SystemTime};

use bytes::{Buf, BufMut, Bytes};
use prost::Message;
use prost::encoding::{DecodeContext, WireType};

/// An `Update` whose body stays encoded until someone needs it; the parts of a split update
/// are absorbed into the first.
#[derive(Debug, Clone, Default)]
pub(super) struct Envelope {
    pub brain_epoch: u64,
    pub generation: u64,
    pub base_generation: u64,
    pub snapshot: bool,
    /// Encoded bodies of every part so far.
    pub bodies: Vec<Body>,
    /// While the fields of a decompressed part are merged: the hash of its compressed bytes,
    /// and how many bodies it has yielded (a body's key is both).
    inflating: Option<(u64, u64)>,
    pub trigger_times: Vec<SystemTime>,
    pub digest: Vec<u8>,
    /// A delta resumed by content names its base by digest (`base_generation` 0).
    pub base_digest: Vec<u8>,
    /// The API state the update's ruleset was computed from (`Update.resource_versions`), which
    /// the node presents in its next Hello. In the last part.
    pub resource_versions: Vec<u64>,
    /// A delta resumed by API state, applied to whatever the node holds (`Update.restating`).
    /// In the last part.
    pub restating: bool,
    pub more: bool,
    pub wire_len: usize,
}

/// One encoded body (a snapshot's or a delta's part) as it arrived.
#[derive(Debug, Clone)]
pub(super) struct Body {
    pub bytes: Bytes,
    /// For a body that came inside a compressed part: the key of its content, from the
    /// compressed bytes (see [`Body::key`]).
    inner: Option<u64>,
}

impl Body {
    /// What identifies the body's content: a hash of the bytes it came in on the wire.
    /// [`super::shared`] keys shared models by it; for a body that came compressed that is the
    /// hash of the compressed bytes (already made to find them decompressed), not of the
    /// decompressed ones: a cold start's snapshot is a few hundred kilobytes compressed but
    /// megabytes decompressed, and hashing those for every node was 13 % of the fleet's CPU in
    /// a cold start at 5,000 nodes.
    pub fn key(&self) -> u64 {
        self.inner.unwrap_or_else(|| content_key(&self.bytes))
    }
}

impl Envelope {
    /// Appends the next part of the same update (same generation).
    pub fn absorb(&mut self, next: Envelope) {
        self.bodies.extend(next.bodies);
        self.trigger_times.extend(next.trigger_times);
        self.wire_len += next.wire_len;
        // What only the last part carries is the update's: the latest part's, as the actuator
        // keeps the last part's fields (client.rs).
        self.digest = next.digest;
        self.base_digest = next.base_digest;
        self.resource_versions = next.resource_versions;
        self.restating = next.restating;
        self.more = next.more;
    }
}

/// A hash of `bytes` as received, which stands for their content.
///
/// foldhash rather than SipHash: every node hashes its own copy (a cold start's snapshot is
/// hundreds of kilobytes compressed, an update under churn a few kilobytes), and SipHash over
/// them was 5 % of the fleet's CPU. A collision cannot go unnoticed: the node's digest check
/// after applying would fail ([`super::shared`]).
pub(super) fn content_key(bytes: &[u8]) -> u64 {
    use std::hash::BuildHasher;
    foldhash::quality::FixedState::with_seed(0x5eed).hash_one(bytes)
}

/// The key of the `n`th body inside the decompressed part whose compressed bytes have the
/// key `blob`.
fn inner_key(blob: u64, n: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = foldhash::quality::FixedState::with_seed(0x5eed).build_hasher();
    h.write_u64(blob);
    h.write_u64(n);
    h.finish()
}

/// Decompressed parts (`Update.zstd`) by a hash of their compressed bytes, which is returned
/// with them: every node at the same base gets the same compressed part, and the fleet
/// decompresses it once, as it decodes shared parts once ([`super::shared`]); a real actuator
/// decompresses its own copy (`splitproxy_proto::compress::inflate`); the fleet keeps the
/// encoded fields, which it merges into the envelope itself.
fn inflated(compressed: &Bytes) -> Result<(u64, Bytes), String> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    /// Distinct parts kept; more are dropped all at once (they are the older states').
    const KEEP: usize = 512;
    static CACHE: OnceLock<Mutex<HashMap<u64, Bytes>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = content_key(compressed);
    if let Some(b) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok((key, b));
    }
    let plain = splitproxy_proto::compress::decompress(
        compressed,
        splitproxy_proto::transport::MAX_UPDATE_MESSAGE,
    )
    .map(Bytes::from)
    .map_err(|e| e.to_string())?;
    if let Ok(mut c) = cache.lock() {
        if c.len() >= KEEP {
            c.clear();
        }
        c.insert(key, plain.clone());
    }
    Ok((key, plain))
}

/// Decodes the fields of `splitproxy.v1.Update` by tag (proto/proto/splitproxy/v1/dataplane.proto);
/// unknown fields are skipped, so a newer brain's additions do not break the fleet.
impl Message for Envelope {
    fn encode_raw(&self, _buf: &mut impl BufMut) {
        // Only ever decoded.
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        use prost::encoding::{bytes, message, uint64};
        let before = buf.remaining();
        let r = match tag {
            1 => uint64::merge(wire_type, &mut self.brain_epoch, buf, ctx),
            2 => uint64::merge(wire_type, &mut self.generation, buf, ctx),
            3 => uint64::merge(wire_type, &mut self.base_generation, buf, ctx),
            4 | 5 => {
                let mut b = Bytes::new();
                bytes::merge(wire_type, &mut b, buf, ctx)?;
                self.snapshot = tag == 4;
                // Inside a decompressed part: named by its compressed bytes (and its place
                // among the bodies they hold), not hashed again decompressed.
                let inner = self.inflating.as_mut().map(|(blob, n)| {
                    *n += 1;
                    inner_key(*blob, *n)
                });
                self.bodies.push(Body { bytes: b, inner });
                Ok(())
            }
            6 => {
                let mut t = prost_types::Timestamp::default();
                message::merge(wire_type, &mut t, buf, ctx)?;
                if self.trigger_times.capacity() == 0 {
                    // Under churn an update carries dozens: fewer reallocations.
                    self.trigger_times.reserve(16);
                }
                self.trigger_times.push(
                    SystemTime::UNIX_EPOCH
                        + Duration::new(t.seconds.max(0) as u64, t.nanos.max(0) as u32),
                );
                Ok(())
            }
            8 => bytes::merge(wire_type, &mut self.digest, buf, ctx),
            9 => prost::encoding::bool::merge(wire_type, &mut self.more, buf, ctx),
            10 => bytes::merge(wire_type, &mut self.base_digest, buf, ctx),
            // Packed or not: merge_repeated takes both.
            13 => uint64::merge_repeated(wire_type, &mut self.resource_versions, buf, ctx),
            14 => prost::encoding::bool::merge(wire_type, &mut self.restating, buf, ctx),
            12 => {
                let mut compressed = Bytes::new();
                bytes::merge(wire_type, &mut compressed, buf, ctx)?;
                // prost has no other public way to say why a field does not decode.
                #[allow(deprecated)]
                let (key, plain) = inflated(&compressed).map_err(prost::DecodeError::new)?;
                // The fields inside count as what they took on the wire: the compressed bytes.
                let wire_len = self.wire_len;
                let outer = self.inflating.replace((key, 0));
                let r = self.merge(plain);
                self.inflating = outer;
                self.wire_len = wire_len;
                r
            }
            _ => prost::encoding::skip_field(wire_type, tag, buf, ctx),
        };
        self.wire_len += before - buf.remaining();
        r
    }

    fn encoded_len(&self) -> usize {
        0
    }

    fn clear(&mut self) {
        *self = Envelope::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use splitproxy_proto::v1::{Ruleset, RulesetDelta, Update, update::Body};

    /// An encoded part carrying `body`, as the brain frames it.
    fn part(body: Body) -> Vec<u8> {
        Update {
            body: Some(body),
            more: true,
            ..Default::default()
        }
        .encode_to_vec()
    }

    /// A snapshot part large and repetitive enough for the brain to compress it.
    fn big_snapshot(table: &str) -> Vec<u8> {
        part(Body::Snapshot(Ruleset {
            tables: vec![splitproxy_proto::v1::Table {
                name: table.repeat(8192),
                ..Default::default()
            }],
        }))
    }

    fn decode(wire: &[u8]) -> Envelope {
        Envelope::decode(wire).unwrap()
    }

    #[test]
    fn a_plain_body_is_keyed_by_its_bytes() {
        let wire = part(Body::Delta(RulesetDelta {
            remove: vec![splitproxy_proto::v1::TableRemoval {
                name: "x".into(),
                whole: true,
                ..Default::default()
            }],
            ..Default::default()
        }));
        let env = decode(&wire);
        assert_eq!(env.bodies.len(), 1);
        assert_eq!(env.bodies[0].key(), content_key(&env.bodies[0].bytes));
    }

    #[test]
    fn a_compressed_body_is_keyed_by_its_compressed_bytes_not_hashed_again() {
        let plain = big_snapshot("a");
        let wire = splitproxy_proto::compress::compress_part(&plain).expect("compresses");
        let (one, two) = (decode(&wire), decode(&wire));
        assert_eq!(one.bodies[0].bytes, two.bodies[0].bytes);
        assert_eq!(one.bodies.len(), 1);
        assert_eq!(one.bodies[0].key(), two.bodies[0].key());
        // Not the key of the decompressed body: that one is never hashed.
        assert_ne!(one.bodies[0].key(), content_key(&one.bodies[0].bytes));
        assert_eq!(one.bodies[0].bytes, decode(&plain).bodies[0].bytes);
        // What it took on the wire: the compressed bytes, not the decompressed.
        assert!(one.wire_len <= wire.len() && wire.len() < plain.len());
        // Other content, another key.
        let other = splitproxy_proto::compress::compress_part(&big_snapshot("b")).unwrap();
        assert_ne!(decode(&other).bodies[0].key(), one.bodies[0].key());
    }

    #[test]
    fn the_last_part_brings_resource_versions_and_restating() {
        let last = Update {
            generation: 3,
            body: Some(Body::Delta(RulesetDelta::default())),
            digest: vec![7; 16],
            resource_versions: vec![10, 0, 30, u64::MAX],
            restating: true,
            ..Default::default()
        }
        .encode_to_vec();
        let mut env = decode(&part(Body::Delta(RulesetDelta::default())));
        assert!(env.more && !env.restating && env.resource_versions.is_empty());
        env.absorb(decode(&last));
        assert_eq!(env.resource_versions, vec![10, 0, 30, u64::MAX]);
        assert!(env.restating && !env.more);
        assert_eq!(env.digest, vec![7; 16]);
        assert_eq!(env.bodies.len(), 2);

        // Unpacked repeated values (a proto2-style encoder) read the same.
        let mut unpacked = Vec::new();
        for v in [10u64, 0, 30, u64::MAX] {
            prost::encoding::uint64::encode(13, &v, &mut unpacked);
        }
        prost::encoding::bool::encode(14, &true, &mut unpacked);
        let env = decode(&unpacked);
        assert_eq!(env.resource_versions, vec![10, 0, 30, u64::MAX]);
        assert!(env.restating);

        // Inside a compressed part too.
        let mut big = Update::decode(&big_snapshot("a")[..]).unwrap();
        big.more = false;
        big.resource_versions = vec![1, 2, 3, 4];
        let wire = splitproxy_proto::compress::compress_part(&big.encode_to_vec()).unwrap();
        assert_eq!(decode(&wire).resource_versions, vec![1, 2, 3, 4]);
    }

    #[test]
    fn absorbed_parts_keep_one_key_per_body() {
        let first = splitproxy_proto::compress::compress_part(&big_snapshot("a")).unwrap();
        let second = part(Body::Snapshot(Ruleset::default()));
        let mut env = decode(&first);
        env.absorb(decode(&second));
        assert_eq!(env.bodies.len(), 2);
        assert_ne!(env.bodies[0].key(), content_key(&env.bodies[0].bytes));
        assert_eq!(env.bodies[1].key(), content_key(&env.bodies[1].bytes));
    }
}
