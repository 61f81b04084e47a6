//! What a node is sent next ([`Fanout::next_update`]): the update from the state it holds to
//! the latest publication, as frames whose shared parts are encoded once for every node that
//! needs the same body (kept in a small cache), followed by the node's own part and a tail
//! with the trigger times, objects and API state that update carries.
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::Bytes;
use splitproxy_proto::frames::{UpdateFrame, encode_parts, encode_snapshot_parts, encode_tail};
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::update::Body;

use super::{
    BODY_CACHE, Base, BodyKey, EncodedBody, Fanout, Held, Named, Next, Publication, TailKey,
    node_part, node_state,
};
use crate::api_state::ApiState;

impl Fanout {
    /// The next update for a node standing at `base`, towards `desired`, as the frames to send
    /// in order: the shared parts of the body (encoded once for every node at the same base),
    /// then one last part with the node's own overlay change and the digest. `Current` when the
    /// node already holds the desired state; `None` before the first publication.
    pub fn next_update(
        &self,
        node: &str,
        base: Option<&Held>,
        desired: &Publication,
    ) -> Option<Next> {
        let target = desired.held(node)?;
        let same = |a: &Arc<Model>, b: &Arc<Model>| Arc::ptr_eq(a, b) || a.digest() == b.digest();
        if let Some(b) = base
            && same(&b.shared, &target.shared)
            && same(&b.overlay, &target.overlay)
        {
            if b.version != target.version {
                self.record_current(node, target.clone());
            }
            return Some(Next::Current(target));
        }
        let base_version = base.map(|b| b.version).unwrap_or(0);
        let key = (base_version, desired.version, false);
        let shared = self.body(&key, || {
            EncodedBody::new(match base {
                Some(b) => encode_parts(
                    Body::Delta(b.shared.diff(&target.shared)),
                    self.part_elements,
                ),
                // Written from the model's encoded elements, without decoding them.
                None => encode_snapshot_parts(&target.shared, self.part_elements),
            })
        });
        let news_after = match base {
            Some(b) => b.version,
            None => self.news_after(node, &target),
        };
        let tail = self.tail((news_after, desired.version), desired.api);
        let own = match base {
            Some(b) => Body::Delta(crate::overlay::delta(&b.overlay, &target.overlay)),
            None => Body::Snapshot(target.overlay.to_ruleset()),
        };
        let named = match base {
            Some(b) => Base::Held(b),
            None => Base::Snapshot,
        };
        let frames = self.frames(node, &shared, tail, own, &target, named)?;
        if base.is_none() {
            self.metrics.snapshots_sent.fetch_add(1, Ordering::Relaxed);
        }
        Some(Next::Send(frames, target))
    }

    /// The frames of one update to `node`, towards `target`: `shared`'s parts, then the last
    /// part with `tail` and the node's own body. Counts the update sent.
    pub(super) fn frames(
        &self,
        node: &str,
        shared: &EncodedBody,
        tail: Bytes,
        own: Body,
        target: &Held,
        base: Base,
    ) -> Option<Vec<UpdateFrame>> {
        let (generation, base_generation, named, zstd) = {
            let mut nodes = self.nodes.lock().ok()?;
            let st = node_state(&mut nodes, node);
            st.generation += 1;
            let (base_generation, named) = match base {
                Base::Snapshot => (0, Named::Generation),
                Base::Window => (0, Named::Restating),
                // Acked here: the base is named by its generation.
                Base::Held(_) if st.acked_generation != 0 => {
                    (st.acked_generation, Named::Generation)
                }
                // Resumed by content and not acked here since: by its digest.
                Base::Held(b) => (0, Named::Digest(b.digest())),
            };
            (st.generation, base_generation, named, st.zstd)
        };
        let node_part = node_part(own, target.digest(), named);
        let frame = |shared: Bytes, extra: Bytes| UpdateFrame {
            brain_epoch: self.epoch,
            generation,
            base_generation,
            shared,
            extra,
        };
        let parts = shared.parts_for(zstd, &self.metrics);
        // Sized for the last part too: no second allocation and copy per update.
        let mut frames = Vec::with_capacity(parts.len() + 1);
        frames.extend(parts.iter().map(|part| frame(part.clone(), Bytes::new())));
        frames.push(frame(tail, node_part));
        let bytes: usize = frames.iter().map(prost::Message::encoded_len).sum();
        let m = &self.metrics;
        m.updates_sent.fetch_add(1, Ordering::Relaxed);
        m.update_bytes_sent
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Some(frames)
    }

    /// A node already holds what `held` (a newer version) describes: a publication that changed
    /// other nodes only. It counts as in sync at that version, and as done for fan-out timing.
    pub(super) fn record_current(&self, node: &str, held: Held) {
        let version = held.version;
        let mut settled = None;
        if let Ok(mut nodes) = self.nodes.lock()
            && let Some(st) = nodes.get_mut(node)
        {
            if st.acked.is_some() {
                st.news_after = version;
                st.acked = Some(held);
            }
            settled = self.unsettled(st, Some(version));
        }
        self.settle(settled, true);
    }

    /// The encoded body for `key`, built once.
    pub(super) fn body(
        &self,
        key: &BodyKey,
        build: impl FnOnce() -> EncodedBody,
    ) -> Arc<EncodedBody> {
        if let Some(b) = self.bodies.lock().ok().and_then(|c| c.get(key).cloned()) {
            return b;
        }
        let start = Instant::now();
        let b = Arc::new(build());
        let len = b.parts.iter().map(Bytes::len).sum::<usize>();
        self.metrics.observe_encode(start.elapsed(), len);
        if let Ok(mut c) = self.bodies.lock() {
            if c.len() >= BODY_CACHE {
                // Bodies towards older versions are no longer needed by anyone up to date.
                let newest = key.1;
                c.retain(|k, _| k.1 == newest);
            }
            c.insert(*key, b.clone());
        }
        b
    }

    /// The version after which changes are news to `node`, which is sent a snapshot of
    /// `target` (its base is unknown): none if it said in its Hello that it holds `target`
    /// already, otherwise those after the newest version it is known to hold, or after the one
    /// published when it connected. A node reconnecting after a failover or a restart of the
    /// brain is not sent the trigger times of changes it may well hold: recorded as network
    /// programming latency, those are tens of seconds that measure nothing (kube-proxy, too,
    /// ignores changes from before it started).
    pub(super) fn news_after(&self, node: &str, target: &Held) -> u64 {
        let Ok(nodes) = self.nodes.lock() else {
            return target.version;
        };
        match nodes.get(node) {
            Some(st) if st.hello_digest == target.digest() => target.version,
            Some(st) => st.news_after,
            None => target.version,
        }
    }

    /// The encoded tail for `key`: the trigger times and objects of the changes after `key.0`
    /// up to `key.1`, and the API state of `key.1`, built once.
    pub(super) fn tail(&self, key: TailKey, api: ApiState) -> Bytes {
        if let Some(t) = self.tails.lock().ok().and_then(|c| c.get(&key).cloned()) {
            return t;
        }
        let (trigger_times, objects) = self.changes_between(key.0, key.1);
        let t = encode_tail(trigger_times, objects, api.to_wire());
        if let Ok(mut c) = self.tails.lock() {
            if c.len() >= BODY_CACHE {
                let newest = key.1;
                c.retain(|k, _| k.1 == newest);
            }
            c.insert(key, t.clone());
        }
        t
    }
}
