//! Desired state and per-node streams.
//!
//! The index task publishes a new [`Desired`] (one model per node variant) through a `watch`
//! channel; a node's session waits for its previous update to be acked, then sends whatever
//! changed since, so a slow node is never queued more than one update and always gets the
//! coalesced latest state (invariant 8). Deltas between two published versions are computed once
//! and shared by every node that stands at the same version.
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{Ack, RulesetDelta, Update, update::Body};
use tokio::sync::watch;

use crate::metrics::Metrics;
use crate::rules::NodeView;

/// Changes remembered for trigger times and object names; a node further behind than this gets
/// the state without the older trigger times.
const CHANGE_LOG: usize = 4096;
/// Deltas cached between published versions.
const DELTA_CACHE: usize = 256;

/// One published desired state.
#[derive(Debug, Clone, Default)]
pub struct Desired {
    /// Grows by one per publication.
    pub version: u64,
    /// Models per node variant; every node maps to exactly one.
    pub variants: HashMap<NodeView, Arc<Model>>,
}

/// What one publication changed, for network programming latency and logs.
#[derive(Debug, Clone)]
struct Change {
    version: u64,
    trigger_times: Vec<prost_types::Timestamp>,
    objects: Vec<String>,
}

/// A node as the brain sees it.
#[derive(Debug, Clone, Default)]
pub struct NodeState {
    pub connected: bool,
    pub peer: String,
    pub generation: u64,
    pub acked_generation: u64,
    /// What the node holds after `acked_generation`, and the version it came from.
    pub acked: Option<(u64, Arc<Model>)>,
    pub last_apply: Option<Duration>,
    pub last_error: String,
}

pub struct Fanout {
    pub epoch: u64,
    desired_tx: watch::Sender<Arc<Desired>>,
    synced_tx: watch::Sender<bool>,
    changes: Mutex<VecDeque<Change>>,
    deltas: Mutex<HashMap<(u64, u64, NodeView), Arc<RulesetDelta>>>,
    pub nodes: Mutex<HashMap<String, NodeState>>,
    pub metrics: Arc<Metrics>,
}

impl Fanout {
    pub fn new(metrics: Arc<Metrics>) -> Arc<Self> {
        let (desired_tx, _) = watch::channel(Arc::new(Desired::default()));
        let (synced_tx, _) = watch::channel(false);
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            ^ rand::random::<u32>() as u64;
        Arc::new(Fanout {
            epoch,
            desired_tx,
            synced_tx,
            changes: Mutex::new(VecDeque::new()),
            deltas: Mutex::new(HashMap::new()),
            nodes: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    /// Publishes a new desired state. No-op publications (same models) are dropped, so nothing
    /// reaches the streams.
    pub fn publish(
        &self,
        variants: HashMap<NodeView, Arc<Model>>,
        trigger_times: Vec<prost_types::Timestamp>,
        objects: Vec<String>,
    ) {
        let current = self.desired_tx.borrow().clone();
        if current.version > 0 && current.variants == variants {
            return;
        }
        let version = current.version + 1;
        if let Ok(mut log) = self.changes.lock() {
            log.push_back(Change {
                version,
                trigger_times,
                objects,
            });
            while log.len() > CHANGE_LOG {
                log.pop_front();
            }
        }
        self.desired_tx
            .send_replace(Arc::new(Desired { version, variants }));
    }

    /// Marks the brain ready to serve (every initial list done) or stale (relisting).
    pub fn set_synced(&self, synced: bool) {
        self.metrics
            .synced
            .store(synced as u64, std::sync::atomic::Ordering::Relaxed);
        self.synced_tx.send_replace(synced);
    }

    pub fn synced(&self) -> bool {
        *self.synced_tx.borrow()
    }

    pub fn subscribe(&self) -> (watch::Receiver<Arc<Desired>>, watch::Receiver<bool>) {
        (self.desired_tx.subscribe(), self.synced_tx.subscribe())
    }

    pub fn desired(&self) -> Arc<Desired> {
        self.desired_tx.borrow().clone()
    }

    /// The view of a node. Every node shares one view until per-node semantics arrive.
    pub fn view_of(&self, _node: &str) -> NodeView {
        NodeView::default()
    }

    /// Builds the next update for a node standing at `base` (version and model), towards
    /// `desired`. `None` when the node already holds the desired model.
    pub fn next_update(
        &self,
        node: &str,
        base: Option<&(u64, Arc<Model>)>,
        desired: &Desired,
    ) -> Option<(Update, Arc<Model>)> {
        let view = self.view_of(node);
        let target = desired.variants.get(&view)?.clone();
        let body = match base {
            Some((_, model)) if Arc::ptr_eq(model, &target) || **model == *target => return None,
            Some((version, model)) => {
                let key = (*version, desired.version, view);
                let cached = self.deltas.lock().ok().and_then(|c| c.get(&key).cloned());
                let delta = cached.unwrap_or_else(|| {
                    let d = Arc::new(model.diff(&target));
                    if let Ok(mut c) = self.deltas.lock() {
                        if c.len() >= DELTA_CACHE {
                            c.clear();
                        }
                        c.insert(key, d.clone());
                    }
                    d
                });
                Body::Delta((*delta).clone())
            }
            None => Body::Snapshot(target.to_ruleset()),
        };
        let since = base.map(|(v, _)| *v).unwrap_or(0);
        let (trigger_times, objects) = self.changes_between(since, desired.version);
        let generation = {
            let mut nodes = self.nodes.lock().ok()?;
            let st = nodes.entry(node.to_string()).or_default();
            st.generation += 1;
            st.generation
        };
        let base_generation = match (&body, base) {
            (Body::Delta(_), Some(_)) => self.acked_generation(node),
            _ => 0,
        };
        let update = Update {
            brain_epoch: self.epoch,
            generation,
            base_generation,
            body: Some(body),
            trigger_times,
            objects,
            digest: target.digest(),
        };
        self.metrics
            .updates_sent
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.metrics.update_bytes_sent.fetch_add(
            update.encoded_len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        if base_generation == 0 {
            self.metrics
                .snapshots_sent
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Some((update, target))
    }

    fn acked_generation(&self, node: &str) -> u64 {
        self.nodes
            .lock()
            .ok()
            .and_then(|n| n.get(node).map(|s| s.acked_generation))
            .unwrap_or(0)
    }

    fn changes_between(&self, after: u64, upto: u64) -> (Vec<prost_types::Timestamp>, Vec<String>) {
        let mut times = Vec::new();
        let mut objects = Vec::new();
        if let Ok(log) = self.changes.lock() {
            for c in log
                .iter()
                .filter(|c| c.version > after && c.version <= upto)
            {
                times.extend(c.trigger_times.iter().cloned());
                objects.extend(c.objects.iter().cloned());
            }
        }
        objects.sort();
        objects.dedup();
        objects.truncate(64);
        (times, objects)
    }

    /// Where a resuming node stands: its acked state if it still holds what this brain
    /// remembers sending it under this epoch, otherwise nothing (it gets a snapshot).
    pub fn resume_point(
        &self,
        node: &str,
        applied: Option<&splitproxy_proto::v1::Applied>,
    ) -> Option<(u64, Arc<Model>)> {
        let applied = applied?;
        if applied.brain_epoch != self.epoch {
            return None;
        }
        let nodes = self.nodes.lock().ok()?;
        let st = nodes.get(node)?;
        let (version, model) = st.acked.as_ref()?;
        (st.acked_generation == applied.generation && model.digest() == applied.digest)
            .then(|| (*version, model.clone()))
    }

    /// Records a node's answer to an update.
    pub fn record_ack(&self, node: &str, ack: &Ack, sent: (u64, Arc<Model>)) -> bool {
        let apply = ack
            .apply_duration
            .as_ref()
            .map(|d| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32));
        let Ok(mut nodes) = self.nodes.lock() else {
            return false;
        };
        let st = nodes.entry(node.to_string()).or_default();
        st.last_apply = apply;
        if ack.ok {
            st.acked_generation = ack.generation;
            st.acked = Some(sent);
            st.last_error.clear();
        } else {
            st.acked = None;
            st.last_error = ack.error.clone();
            self.metrics
                .nacks
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        ack.ok
    }

    pub fn set_connected(&self, node: &str, connected: bool, peer: &str) {
        if let Ok(mut nodes) = self.nodes.lock() {
            let st = nodes.entry(node.to_string()).or_default();
            st.connected = connected;
            st.peer = peer.to_string();
        }
    }

    pub fn connected_nodes(&self) -> usize {
        self.nodes
            .lock()
            .map(|n| n.values().filter(|s| s.connected).count())
            .unwrap_or(0)
    }
}
