//! The models virtual nodes share, so that one machine can play thousands of nodes.
//!
//! An update is the parts every node at the same base receives (identical bytes) followed by
//! one part of the node's own. The shared parts are decoded and applied once, by the first node
//! that needs them, into a model every node at that state shares; each node keeps only its own
//! part as a small overlay ([`Held`]).
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use prost::Message;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{Ruleset, RulesetDelta};

use super::envelope::{Body, Envelope};

/// How many shared states are kept before those no node holds any more are dropped.
const KEEP_STATES: usize = 64;

/// What one virtual node holds after its last applied update.
pub(super) struct Held {
    pub epoch: u64,
    pub generation: u64,
    /// Shared with every node at the same state.
    pub model: Arc<Model>,
    /// The node's own elements.
    pub overlay: Arc<Model>,
}

impl Held {
    /// The digest of the node's whole ruleset, as the brain computes it.
    pub fn digest(&self) -> Vec<u8> {
        self.model.digest_with(&self.overlay)
    }
}

/// Shared models, found by the state they were built on and by their content.
#[derive(Default)]
pub(super) struct SharedModels {
    /// By the base they were built on and the parts applied to it (see [`shared_key`]), so an
    /// update's shared parts are decoded once for all nodes.
    states: Mutex<HashMap<u64, Arc<Model>>>,
    /// By digest: nodes that reached the same state from different bases (a slow node gets a
    /// larger, coalesced delta) hold one model, not one each.
    by_digest: Mutex<HashMap<Vec<u8>, Arc<Model>>>,
}

impl SharedModels {
    /// What a node holding `held` holds after `env`: the shared model after `env`'s shared
    /// parts (built once for every node at the same base) and the node's own overlay after its
    /// last part. Checks the digest the brain sent, as a real actuator does.
    pub fn next_state(&self, env: &Envelope, held: Option<&Held>) -> Result<Held, String> {
        let (own, shared) = env.bodies.split_last().ok_or("update without a body")?;
        // A delta names its base by generation, or, resumed by content, by digest.
        let by_content = env.base_generation == 0 && !env.snapshot && !env.base_digest.is_empty();
        if env.base_generation != 0 || by_content {
            let h = held.ok_or("delta without a base")?;
            let same = if by_content {
                h.model.digest_with(&h.overlay) == env.base_digest
            } else {
                h.epoch == env.brain_epoch && h.generation == env.base_generation
            };
            if !same {
                return Err(format!(
                    "delta on generation {} but {} is held",
                    env.base_generation, h.generation
                ));
            }
        }
        let base = held.filter(|_| env.base_generation != 0 || by_content);
        let key = shared_key(base.map(|h| &*h.model), env.snapshot, shared);
        let cached = self.states.lock().ok().and_then(|s| s.get(&key).cloned());
        let model = match cached {
            Some(m) => m,
            None => {
                let mut m = base.map(|h| (*h.model).clone()).unwrap_or_default();
                for b in shared {
                    apply_part(&mut m, env.snapshot, &b.bytes)?;
                }
                let m = self.dedup(m);
                self.remember(key, m.clone());
                m
            }
        };
        let mut overlay = base.map(|h| (*h.overlay).clone()).unwrap_or_default();
        apply_part(&mut overlay, env.snapshot, &own.bytes)?;
        if model.digest_with(&overlay) != env.digest {
            return Err("digest after applying differs from the brain's".into());
        }
        Ok(Held {
            epoch: env.brain_epoch,
            generation: env.generation,
            model,
            overlay: Arc::new(overlay),
        })
    }

    /// Keeps `m` as the state `key` leads to, first dropping the states no node holds when
    /// there are many: memory stays bounded by the states nodes are at.
    fn remember(&self, key: u64, m: Arc<Model>) {
        let Ok(mut s) = self.states.lock() else {
            return;
        };
        if s.len() > KEEP_STATES {
            // Keep what some node holds: a model in both maps has two references of theirs.
            s.retain(|_, m| Arc::strong_count(m) > 2);
            if let Ok(mut by) = self.by_digest.lock() {
                by.retain(|_, m| Arc::strong_count(m) > 1);
            }
        }
        s.insert(key, m);
    }

    /// The shared model with `m`'s content: an existing one if some node holds it.
    fn dedup(&self, m: Model) -> Arc<Model> {
        let Ok(mut by) = self.by_digest.lock() else {
            return Arc::new(m);
        };
        let digest = m.digest();
        if let Some(existing) = by.get(&digest) {
            return existing.clone();
        }
        let m = Arc::new(m);
        by.insert(digest, m.clone());
        m
    }
}

/// Identifies a shared model by the content of its base (its digest) and the content of the
/// shared parts applied to it (their keys, [`Body::key`]: hashes of the bytes they came in):
/// every node at the same base gets the same bytes. The node's own last part is not hashed.
///
/// By content, not by the path that led there: nodes reach one state along different paths
/// (a slow node gets coalesced deltas), and keying by path gave every path its own key, so
/// after a while of churn each node rebuilt the whole shared model itself on every update and
/// the fleet's CPU went up with nodes times Services. A collision cannot go unnoticed: the
/// node's digest check after applying would fail.
fn shared_key(base: Option<&Model>, snapshot: bool, parts: &[Body]) -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut h = foldhash::quality::FixedState::with_seed(0x5eed).build_hasher();
    base.map(Model::digest).hash(&mut h);
    snapshot.hash(&mut h);
    for p in parts {
        h.write_u64(p.key());
    }
    h.finish()
}

/// Applies one encoded part (a snapshot part folds in as upserts).
fn apply_part(model: &mut Model, snapshot: bool, bytes: &Bytes) -> Result<(), String> {
    if snapshot {
        let r = Ruleset::decode(bytes.clone()).map_err(|e| e.to_string())?;
        model.apply(&RulesetDelta {
            upsert: r.tables,
            remove: Vec::new(),
        });
    } else {
        let d = RulesetDelta::decode(bytes.clone()).map_err(|e| e.to_string())?;
        model.apply(&d);
    }
    Ok(())
}
