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
    /// The API state the held ruleset was computed from, as the update that brought it said;
    /// presented in Hello, so the brain may resume the node with a restating delta.
    pub resource_versions: Vec<u64>,
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
        // A delta names its base by generation, or, resumed by content, by digest, or,
        // restating (resumed by API state), not at all: it applies to whatever the node holds,
        // and only the digest after applying says whether that was right.
        let by_content = env.base_generation == 0 && !env.snapshot && !env.base_digest.is_empty();
        let restating = env.restating
            && env.base_generation == 0
            && !env.snapshot
            && env.base_digest.is_empty();
        let on_held = env.base_generation != 0 || by_content || restating;
        if on_held {
            let h = held.ok_or("delta without a base")?;
            let same = if restating {
                true
            } else if by_content {
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
        let base = held.filter(|_| on_held);
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
            return Err(if restating {
                "restating delta does not reach the brain's digest from what this node holds"
            } else {
                "digest after applying differs from the brain's"
            }
            .into());
        }
        Ok(Held {
            epoch: env.brain_epoch,
            generation: env.generation,
            model,
            overlay: Arc::new(overlay),
            resource_versions: env.resource_versions.clone(),
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
///
/// How the delta names its base (generation, digest, or not at all for a restating delta)
/// does not enter the key: it decides only whether a node may apply it, and the result of
/// applying the same parts to the same base content is the same model either way. A restating
/// delta applied to two different bases gets two keys, as their digests differ.
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

#[cfg(test)]
mod tests {
    use super::*;
    use splitproxy_proto::v1::{Chain, Family, Table, Update, update};

    /// Table `ip splitproxy` with the chains `names` (each chain is one shared object).
    fn table(names: &[&str]) -> Table {
        Table {
            family: Family::Ip as i32,
            name: "splitproxy".to_owned(),
            chains: names
                .iter()
                .map(|n| Chain {
                    name: (*n).to_owned(),
                    ..Chain::default()
                })
                .collect(),
            ..Table::default()
        }
    }

    fn model(names: &[&str]) -> Model {
        Model::from_ruleset(&Ruleset {
            tables: vec![table(names)],
        })
    }

    /// The envelope of one update, as a node reads it: `shared` parts then the node's own
    /// (empty) part, with the digest of `target` and the last part's fields.
    fn envelope(update: Update, shared: Vec<update::Body>) -> Envelope {
        let mut env = Envelope::default();
        let parts = shared.into_iter().chain([match &update.body {
            Some(update::Body::Snapshot(_)) => update::Body::Snapshot(Ruleset::default()),
            _ => update::Body::Delta(RulesetDelta::default()),
        }]);
        let n = parts.clone().count();
        for (i, body) in parts.enumerate() {
            let part = Update {
                body: Some(body),
                more: i + 1 < n,
                ..update.clone()
            };
            let next = Envelope::decode(&part.encode_to_vec()[..]).unwrap();
            if i == 0 {
                env = next;
            } else {
                env.absorb(next);
            }
        }
        env
    }

    /// A node that applied a snapshot of chains `names` (epoch 1, generation `generation`).
    fn holding(shared: &SharedModels, names: &[&str], generation: u64) -> Held {
        let m = model(names);
        let env = envelope(
            Update {
                brain_epoch: 1,
                generation,
                digest: m.digest_with(&Model::default()),
                resource_versions: vec![generation, 0, 0, 0],
                body: Some(update::Body::Snapshot(Ruleset::default())),
                ..Update::default()
            },
            vec![update::Body::Snapshot(Ruleset {
                tables: vec![table(names)],
            })],
        );
        shared.next_state(&env, None).unwrap()
    }

    /// A restating delta from another replica (epoch 9): restates chain "b" and adds "c", so
    /// from {a} (its notional base) or from {a, b} it reaches {a, b, c}.
    fn restating_delta(restating: bool, digest: Vec<u8>) -> Envelope {
        envelope(
            Update {
                brain_epoch: 9,
                generation: 4,
                base_generation: 0,
                restating,
                digest,
                resource_versions: vec![10, 20, 30, 40],
                body: Some(update::Body::Delta(RulesetDelta::default())),
                ..Update::default()
            },
            vec![update::Body::Delta(RulesetDelta {
                upsert: vec![table(&["b", "c"])],
                remove: vec![],
            })],
        )
    }

    #[test]
    fn a_restating_delta_applies_to_what_the_node_holds_when_the_digest_matches() {
        let shared = SharedModels::default();
        let target = model(&["a", "b", "c"]);
        let env = restating_delta(true, target.digest());
        assert!(env.restating && env.base_digest.is_empty());
        assert_eq!(env.resource_versions, vec![10, 20, 30, 40]);

        // Two nodes at different bases, neither the brain's notional one for both.
        let on_a = holding(&shared, &["a"], 1);
        let on_ab = holding(&shared, &["a", "b"], 2);
        assert_eq!(on_ab.resource_versions, vec![2, 0, 0, 0]);
        for h in [&on_a, &on_ab] {
            let next = shared.next_state(&env, Some(h)).unwrap();
            assert_eq!(*next.model, target);
            assert_eq!(next.digest(), target.digest());
            assert_eq!((next.epoch, next.generation), (9, 4));
            assert_eq!(next.resource_versions, vec![10, 20, 30, 40]);
        }
        // Not a restating delta: no base named is no base.
        let plain = restating_delta(false, target.digest());
        assert!(shared.next_state(&plain, Some(&on_ab)).is_err());
        // The same parts on two bases are two shared states, not one cached result.
        assert_ne!(
            shared_key(Some(&*on_a.model), false, &env.bodies[..1]),
            shared_key(Some(&*on_ab.model), false, &env.bodies[..1])
        );
    }

    #[test]
    fn a_restating_delta_that_misses_the_digest_is_refused() {
        let shared = SharedModels::default();
        // Reaches {a, b, c} from {a} or {a, b}, but not from {a, b, d}.
        let env = restating_delta(true, model(&["a", "b", "c"]).digest());
        let on_abd = holding(&shared, &["a", "b", "d"], 3);
        let e = shared.next_state(&env, Some(&on_abd)).err().unwrap();
        assert!(e.contains("restating delta does not reach"), "{e}");
        // The held state is untouched (shared, never mutated).
        assert_eq!(*on_abd.model, model(&["a", "b", "d"]));
        // A wrong digest is refused whatever the base.
        let wrong = restating_delta(true, vec![0; 16]);
        let on_a = holding(&shared, &["a"], 1);
        assert!(shared.next_state(&wrong, Some(&on_a)).is_err());
        // And a node holding nothing has no base to restate.
        assert!(shared.next_state(&env, None).is_err());
    }
}
