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
    pub bodies: Vec<Bytes>,
    pub trigger_times: Vec<SystemTime>,
    pub digest: Vec<u8>,
    /// A delta resumed by content names its base by digest (`base_generation` 0).
    pub base_digest: Vec<u8>,
    pub more: bool,
    pub wire_len: usize,
}

impl Envelope {
    /// Appends the next part of the same update (same generation).
    pub fn absorb(&mut self, next: Envelope) {
        self.bodies.extend(next.bodies);
        self.trigger_times.extend(next.trigger_times);
        self.wire_len += next.wire_len;
        self.digest = next.digest;
        self.base_digest = next.base_digest;
        self.more = next.more;
    }
}

/// Decompressed parts (`Update.zstd`) by a hash of their compressed bytes: every node at the same
/// base gets the same compressed part, and the fleet decompresses it once, as it decodes shared
/// parts once ([`super::shared`]); a real actuator decompresses its own copy
/// (`splitproxy_proto::compress::inflate`); the fleet keeps the encoded fields, which it merges
/// into the envelope itself.
fn inflated(compressed: &Bytes) -> Result<Bytes, String> {
    use std::collections::HashMap;
    use std::hash::BuildHasher;
    use std::sync::{Mutex, OnceLock};
    /// Distinct parts kept; more are dropped all at once (they are the older states').
    const KEEP: usize = 512;
    static CACHE: OnceLock<Mutex<HashMap<u64, Bytes>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // foldhash rather than SipHash: every node hashes its own copy (a cold start's snapshot is
    // hundreds of kilobytes compressed), see `shared::shared_key`.
    let key = foldhash::quality::FixedState::with_seed(0x5eed).hash_one(compressed);
    if let Some(b) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(b);
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
    Ok(plain)
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
                self.bodies.push(b);
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
            12 => {
                let mut compressed = Bytes::new();
                bytes::merge(wire_type, &mut compressed, buf, ctx)?;
                // prost has no other public way to say why a field does not decode.
                #[allow(deprecated)]
                let plain = inflated(&compressed).map_err(prost::DecodeError::new)?;
                // The fields inside count as what they took on the wire: the compressed bytes.
                let wire_len = self.wire_len;
                let r = self.merge(plain);
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
