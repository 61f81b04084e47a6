//! Published desired state and per-node streams.
//!
//! The index task publishes a new [`Publication`] (the shared model every node holds plus each
//! node's overlay, all persistent) through a `watch` channel; a node's session waits for its previous update to be acked, then sends
//! whatever changed since, so a slow node is never queued more than one update and always gets
//! the coalesced latest state ("bounded under slow nodes", docs/invariants.md).
//!
//! Every distinct update body (a delta between two published versions of the shared model, or
//! a snapshot of one) is computed and encoded once and shared, as bytes, by every node that
//! needs it; per node the brain only writes a few header fields (see `splitproxy_proto::frames`).
mod restating;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use foldhash::{HashMap, HashMapExt};
use splitproxy_proto::frames::{
    UpdateFrame, encode_node_part, encode_parts, encode_snapshot_parts, encode_tail,
};
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{Ack, update::Body};
use tokio::sync::watch;

use crate::api_state::ApiState;
use crate::history::History;
use crate::metrics::{Metrics, Resumption};
use crate::overlay::NodeOverlays;

/// Changes remembered for trigger times and object names; a node further behind than this gets
/// the state without the older trigger times.
const CHANGE_LOG: usize = 4096;
/// Encoded update bodies kept for reuse.
const BODY_CACHE: usize = 512;
/// Publications whose fan-out is still being timed.
const FANOUT_TRACKED: usize = 1024;
/// A connected node behind the latest publication for longer than this counts as lagging
/// (`splitproxy_brain_nodes_lagging`).
pub const LAG_THRESHOLD: Duration = Duration::from_secs(5);

/// One published desired state: the ruleset every node shares, and each node's own elements.
#[derive(Debug, Clone, Default)]
pub struct Publication {
    /// Grows by one per publication; 0 before the first (nothing to serve yet).
    pub version: u64,
    /// The ruleset every node holds ([`crate::desired::SharedRuleset`]).
    pub shared: Arc<Model>,
    /// Each node's own elements on top of the shared model (see [`crate::overlay`]); persistent,
    /// so a publication clones it in O(1).
    pub overlays: NodeOverlays,
    /// The API state it was computed from (crate::api_state).
    pub api: ApiState,
}

/// What a node needs next.
pub enum Next {
    /// These frames, taking it to this state.
    Send(Vec<UpdateFrame>, Held),
    /// Nothing: it holds this state already.
    Current(Held),
}

/// Where a reconnecting node resumes ([`Fanout::resume_point`]).
#[derive(Debug, Clone)]
pub enum Resume {
    /// It holds this state: a delta from it, or nothing.
    Exact(Held),
    /// It holds a state in the window that starts at this version, computed from this API
    /// state: a restating delta ([`Fanout::restating_update`]), once a publication covers that
    /// state.
    Window(u64, ApiState),
}

impl Resume {
    /// The version the node is placed at (for a window, where it starts).
    pub fn version(&self) -> u64 {
        match self {
            Resume::Exact(h) => h.version,
            Resume::Window(v, _) => *v,
        }
    }
}

/// What a node holds (or is sent): a version of the shared model and its overlay.
#[derive(Debug, Clone)]
pub struct Held {
    pub version: u64,
    pub shared: Arc<Model>,
    pub overlay: Arc<Model>,
}

impl Held {
    pub fn digest(&self) -> Vec<u8> {
        self.shared.digest_with(&self.overlay)
    }

    /// The node's whole ruleset.
    pub fn full(&self) -> Model {
        let mut m = (*self.shared).clone();
        m.apply(&Model::default().diff(&self.overlay));
        m
    }
}

/// What an update applies on.
enum Base<'a> {
    /// Nothing: a snapshot.
    Snapshot,
    /// A state this brain published (acked here, or resumed by content).
    Held(&'a Held),
    /// Any state in a window of this brain's publications (crate::restate).
    Window,
}

/// How an update names the base it applies on, beyond its generation.
enum Named {
    /// By generation (or none: a snapshot).
    Generation,
    /// Resumed by content: by the digest of the base (see [`Fanout::resume_point`]).
    Digest(Vec<u8>),
    /// A restating delta, which applies to any state in its window (crate::restate).
    Restating,
}

/// The last part's node-specific fields: the node's own body and its digest, and for a delta
/// resumed by content the digest of its base, or the restating flag.
fn node_part(own: Body, digest: Vec<u8>, named: Named) -> Bytes {
    let part = encode_node_part(own, digest);
    let base = match named {
        Named::Generation => return part,
        Named::Digest(base_digest) => splitproxy_proto::v1::Update {
            base_digest,
            ..Default::default()
        },
        Named::Restating => splitproxy_proto::v1::Update {
            restating: true,
            ..Default::default()
        },
    };
    let mut joined = Vec::with_capacity(part.len() + prost::Message::encoded_len(&base));
    joined.extend_from_slice(&part);
    prost::Message::encode_raw(&base, &mut joined);
    Bytes::from(joined)
}

/// `node`'s entry, made if new: the per-update paths (send, ack) look a node up thousands of
/// times a second and allocate its name only the first time.
fn node_state<'a>(nodes: &'a mut HashMap<String, NodeState>, node: &str) -> &'a mut NodeState {
    if !nodes.contains_key(node) {
        nodes.insert(node.to_owned(), NodeState::default());
    }
    nodes.get_mut(node).expect("inserted above")
}

impl Publication {
    /// What `node` should hold at this version; `None` before the first publication.
    pub fn held(&self, node: &str) -> Option<Held> {
        (self.version > 0).then(|| Held {
            version: self.version,
            shared: self.shared.clone(),
            overlay: self.overlays.get(node).cloned().unwrap_or_default(),
        })
    }
}

/// What one publication changed, for network programming latency and logs.
#[derive(Debug, Clone)]
struct Change {
    version: u64,
    /// When it was published: a node lacking it is behind since then.
    published: Instant,
    trigger_times: Vec<prost_types::Timestamp>,
    objects: Vec<String>,
    /// The publication's span, when its trace is sampled: node sends continue it
    /// (crate::trace).
    trace: Option<opentelemetry::trace::SpanContext>,
}

/// A node as the brain sees it.
#[derive(Debug, Clone, Default)]
pub struct NodeState {
    pub connected: bool,
    pub peer: String,
    pub generation: u64,
    pub acked_generation: u64,
    /// What the node holds after `acked_generation`.
    pub acked: Option<Held>,
    pub last_apply: Option<Duration>,
    pub last_error: String,
    /// From the last NACK: the kernel's errno, the refused message and the kernel's words.
    pub last_errno: i32,
    pub last_refused_message: String,
    pub last_kernel_message: String,
    /// The session that holds the node's stream (0: none); only it may mark the node
    /// disconnected, and a newer one ends it ([`Fanout::connect`]).
    pub session: u64,
    /// Tells the current session to end (a newer one replaced it).
    pub end_session: Option<Arc<tokio::sync::Notify>>,
    /// When the last session ended, for [`Fanout::prune_disconnected`].
    pub disconnected_at: Option<Instant>,
    /// When the current stream opened.
    pub connected_at: Option<Instant>,
    /// The newest version the node is known to hold, or the one published when it connected:
    /// changes after it are news to the node, and only their trigger times are sent to it
    /// (see [`Fanout::next_update`]).
    pub news_after: u64,
    /// The digest the node said it holds in its Hello, until its first ack.
    pub hello_digest: Vec<u8>,
    /// Whether the node's Hello says it reads zstd-compressed parts (`Hello.encodings`).
    pub zstd: bool,
    /// While the brain does not know what the node holds (before its first ack, after a NACK):
    /// since when it has been behind, for its lag.
    pub behind_since: Option<Instant>,
    /// Drift the node reported ("kernel is the truth"): how many reports, and the latest.
    pub drifts: u64,
    pub last_drift: Option<splitproxy_proto::v1::Drift>,
    /// Fan-out timing: the newest publication the node no longer holds up. A connected node is
    /// counted in every publication after the one current when it connected
    /// ([`Fanout::connect`] sets this to it), so it holds up exactly those after `settled`
    /// ([`Fanout::settle`]).
    settled: u64,
}

/// Session ids, unique within the process.
static NEXT_SESSION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Identifies an encoded body: (base version or 0 for a snapshot, target version, whether it
/// restates the window from that base, crate::restate).
type BodyKey = (u64, u64, bool);

/// The shared part of one update, encoded once for every node at the same base.
struct EncodedBody {
    parts: Vec<Bytes>,
    /// The same parts for nodes that read zstd: each large one compressed, the others as they
    /// are (see `splitproxy_proto::compress`). Made when the first such node needs them.
    compressed: std::sync::OnceLock<Vec<Bytes>>,
}

impl EncodedBody {
    fn new(parts: Vec<Bytes>) -> Self {
        EncodedBody {
            parts,
            compressed: std::sync::OnceLock::new(),
        }
    }

    /// The parts to send a node: compressed if it reads zstd.
    fn parts_for(&self, zstd: bool, metrics: &Metrics) -> &[Bytes] {
        if !zstd {
            return &self.parts;
        }
        self.compressed.get_or_init(|| {
            let start = Instant::now();
            let parts: Vec<Bytes> = self
                .parts
                .iter()
                .map(|p| {
                    splitproxy_proto::compress::compress_part(p)
                        .inspect(|_| {
                            metrics.compressed_parts.fetch_add(1, Ordering::Relaxed);
                        })
                        .unwrap_or_else(|| p.clone())
                })
                .collect();
            metrics
                .compress_micros_total
                .fetch_add(start.elapsed().as_micros() as u64, Ordering::Relaxed);
            parts
        })
    }
}

/// Identifies an encoded tail: (the version after which changes are news, target version).
type TailKey = (u64, u64);

/// A publication whose fan-out is being timed: how many of the nodes connected when it was
/// published have not acked it (or anything newer) yet. Which nodes those are follows from each
/// node's [`NodeState::settled`]: a count, not a set of names, so that a publication costs no
/// copy of every connected node's name and an ack no lookup per publication in flight.
struct Pending {
    published: Instant,
    waiting: usize,
    /// The nodes counted at publication.
    counted: usize,
}

/// Ack latencies of one publication: whole milliseconds in power-of-two buckets (bucket `i`
/// holds latencies below `2^i` ms), and the longest.
#[derive(Debug, Clone, Default)]
pub struct Rollout {
    pub buckets: [u32; ROLLOUT_BUCKETS],
    pub max: Duration,
}

/// Buckets of [`Rollout`]: up to 2^23 ms, about 2.3 hours.
pub const ROLLOUT_BUCKETS: usize = 24;

impl Rollout {
    fn record(&mut self, took: Duration) {
        let ms = took.as_millis().min(u128::from(u64::MAX)) as u64;
        let i = (u64::BITS - ms.leading_zeros()) as usize;
        self.buckets[i.min(ROLLOUT_BUCKETS - 1)] += 1;
        self.max = self.max.max(took);
    }
}

pub struct Fanout {
    pub epoch: u64,
    publication_tx: watch::Sender<Arc<Publication>>,
    synced_tx: watch::Sender<bool>,
    changes: Mutex<VecDeque<Change>>,
    bodies: Mutex<HashMap<BodyKey, Arc<EncodedBody>>>,
    /// Encoded tails (trigger times, objects), shared by nodes to whom the same changes are news.
    tails: Mutex<HashMap<TailKey, Bytes>>,
    /// What changed in the shared model over a window of publications, for restating deltas
    /// (keyed as their bodies): every node in the window needs it for its own part too.
    windows: Mutex<HashMap<BodyKey, Arc<crate::restate::Touched>>>,
    /// Whether the brain's view is recent enough to serve (see [`crate::freshness`]); true
    /// unless a freshness monitor says otherwise.
    fresh_tx: watch::Sender<bool>,
    /// Set once when the brain is told to stop: every stream it serves ends, so that the
    /// server's graceful shutdown does not wait on node streams that never end by themselves.
    stopping_tx: watch::Sender<bool>,
    pending: Mutex<BTreeMap<u64, Pending>>,
    /// The newest publication whose connected nodes were counted into `pending`: written with
    /// `nodes` locked, so that a node connecting or leaving is either counted in a publication
    /// and settles it, or neither.
    counted: AtomicU64,
    /// How long each recent publication took to be acked by each node connected when it was
    /// published (`GetService`'s rollout latency), the last [`CHANGE_LOG`] publications.
    rollouts: Mutex<BTreeMap<u64, Rollout>>,
    /// Recent publications, for nodes that resume by content ([`Fanout::resume_point`]).
    history: History,
    pub nodes: Mutex<HashMap<String, NodeState>>,
    pub metrics: Arc<Metrics>,
    /// Snapshots that may be in flight at once (see `server::session`).
    pub snapshot_permits: Arc<tokio::sync::Semaphore>,
    /// Set elements per message; larger bodies are split into parts.
    part_elements: usize,
    /// The newest version whose publication is traced (0: none), so that a node's send looks
    /// for trace contexts only when there can be one ([`Fanout::traces_between`]).
    newest_traced: std::sync::atomic::AtomicU64,
}

impl Fanout {
    pub fn new(
        metrics: Arc<Metrics>,
        max_concurrent_snapshots: usize,
        part_elements: usize,
    ) -> Arc<Self> {
        let (publication_tx, _) = watch::channel(Arc::new(Publication::default()));
        let (synced_tx, _) = watch::channel(false);
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            ^ rand::random::<u32>() as u64;
        Arc::new(Fanout {
            epoch,
            publication_tx,
            synced_tx,
            changes: Mutex::new(VecDeque::new()),
            bodies: Mutex::new(HashMap::new()),
            tails: Mutex::new(HashMap::new()),
            windows: Mutex::new(HashMap::new()),
            fresh_tx: watch::channel(true).0,
            stopping_tx: watch::channel(false).0,
            pending: Mutex::new(BTreeMap::new()),
            counted: AtomicU64::new(0),
            rollouts: Mutex::new(BTreeMap::new()),
            history: History::default(),
            nodes: Mutex::new(HashMap::new()),
            metrics,
            snapshot_permits: Arc::new(tokio::sync::Semaphore::new(
                max_concurrent_snapshots.max(1),
            )),
            part_elements: part_elements.max(1),
            newest_traced: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Publishes a new desired state: the shared model and every node's overlay, with the
    /// trigger times and names of the objects whose changes it folds in. A publication that
    /// changes neither the shared model's content nor any overlay is dropped, so nothing reaches
    /// the streams.
    pub fn publish(
        &self,
        shared: Arc<Model>,
        overlays: NodeOverlays,
        trigger_times: Vec<prost_types::Timestamp>,
        objects: Vec<String>,
    ) {
        self.publish_traced(
            shared,
            overlays,
            trigger_times,
            objects,
            None,
            ApiState::default(),
        );
    }

    /// [`Fanout::publish`] with the context of the publication's span when its trace is
    /// sampled: every node's send of it continues that trace (crate::trace). The version
    /// published; `None` when nothing changed.
    pub fn publish_traced(
        &self,
        shared: Arc<Model>,
        overlays: NodeOverlays,
        trigger_times: Vec<prost_types::Timestamp>,
        objects: Vec<String>,
        trace: Option<opentelemetry::trace::SpanContext>,
        api: ApiState,
    ) -> Option<u64> {
        let current = self.publication_tx.borrow().clone();
        let unchanged = current.version > 0
            && current.shared.digest() == shared.digest()
            && current.overlays.ptr_eq(&overlays);
        if unchanged {
            return None;
        }
        let version = current.version + 1;
        let now = std::time::SystemTime::now();
        for t in &trigger_times {
            let at = std::time::UNIX_EPOCH
                + Duration::new(t.seconds.max(0) as u64, t.nanos.max(0) as u32);
            // A trigger stamped by a clock ahead of this one counts as no wait.
            self.metrics
                .observe_publish_latency(now.duration_since(at).unwrap_or_default());
        }
        if trace.is_some() {
            self.newest_traced.store(version, Ordering::Relaxed);
        }
        if let Ok(mut log) = self.changes.lock() {
            log.push_back(Change {
                version,
                published: Instant::now(),
                trigger_times,
                objects,
                trace,
            });
            while log.len() > CHANGE_LOG {
                log.pop_front();
            }
        }
        if let Ok(nodes) = self.nodes.lock() {
            // Counted and recorded with the nodes locked: a node connecting or leaving meanwhile
            // is either in this count and settles it, or in neither (see `settle`).
            let waiting = nodes.values().filter(|st| st.connected).count();
            self.counted.store(version, Ordering::Relaxed);
            if waiting > 0
                && let Ok(mut p) = self.pending.lock()
            {
                p.insert(
                    version,
                    Pending {
                        published: Instant::now(),
                        waiting,
                        counted: waiting,
                    },
                );
                while p.len() > FANOUT_TRACKED {
                    p.pop_first();
                }
            }
        }
        self.metrics
            .publications
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let publication = Arc::new(Publication {
            version,
            shared,
            overlays,
            api,
        });
        // Recorded before any stream sees it: a session restating towards it needs its step.
        self.history.record(publication.clone());
        self.publication_tx.send_replace(publication);
        Some(version)
    }

    /// The sampled trace contexts of the publications after `after` up to `upto`, newest
    /// first: what an update between those versions folds in. One atomic load when none of
    /// them is traced (tracing off, or nothing sampled lately).
    pub fn traces_between(&self, after: u64, upto: u64) -> Vec<opentelemetry::trace::SpanContext> {
        if self.newest_traced.load(Ordering::Relaxed) <= after {
            return Vec::new();
        }
        let mut traces = Vec::new();
        if let Ok(log) = self.changes.lock()
            && let Some(first) = log.front().map(|c| c.version)
        {
            let start = (after + 1).saturating_sub(first) as usize;
            let end = (upto + 1).saturating_sub(first) as usize;
            for c in log.range(start.min(log.len())..end.min(log.len())).rev() {
                traces.extend(c.trace.clone());
            }
        }
        traces
    }

    /// Marks the brain ready to serve (every initial list done and the state it gives published)
    /// or stale (relisting).
    pub fn set_synced(&self, synced: bool) {
        self.metrics
            .synced
            .store(synced as u64, std::sync::atomic::Ordering::Relaxed);
        self.synced_tx.send_replace(synced);
    }

    pub fn synced(&self) -> bool {
        *self.synced_tx.borrow()
    }

    /// Marks the brain's view current, or stale: no contact with the API server within the
    /// staleness bound ([`crate::freshness`]). A stale brain closes and refuses node streams.
    pub fn set_fresh(&self, fresh: bool) {
        self.metrics
            .stale
            .store(u64::from(!fresh), std::sync::atomic::Ordering::Relaxed);
        self.fresh_tx.send_replace(fresh);
    }

    pub fn fresh(&self) -> bool {
        *self.fresh_tx.borrow()
    }

    pub fn subscribe_fresh(&self) -> watch::Receiver<bool> {
        self.fresh_tx.subscribe()
    }

    /// The brain is stopping: every node stream and operator watch ends (UNAVAILABLE, so nodes
    /// move to another replica at once).
    pub fn stop(&self) {
        self.stopping_tx.send_replace(true);
    }

    /// Before the streams end on shutdown: waits `publish` for a change the watch task still
    /// holds back (publications are spaced) to go out, then until every connected node holds
    /// the latest publication, at most `acks`. A brain restarted on the same cluster state then
    /// finds its nodes holding what it computes and resumes them by content, not by snapshot;
    /// a node that cannot ack in time is not waited for.
    pub async fn drain(&self, publish: Duration, acks: Duration) {
        tokio::time::sleep(publish).await;
        let deadline = Instant::now() + acks;
        loop {
            let latest = self.publication().version;
            let behind = self.nodes.lock().map_or(0, |nodes| {
                nodes
                    .values()
                    .filter(|st| {
                        st.connected && st.acked.as_ref().is_none_or(|h| h.version < latest)
                    })
                    .count()
            });
            if behind == 0 || Instant::now() >= deadline {
                tracing::info!(version = latest, behind, "drained before shutdown");
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Resolves once [`Fanout::stop`] has been called.
    pub async fn stopping(&self) {
        let mut rx = self.stopping_tx.subscribe();
        if rx.wait_for(|s| *s).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Whether the brain serves nodes: every list complete, and current.
    pub fn serving(&self) -> bool {
        self.synced() && self.fresh()
    }

    pub fn subscribe(&self) -> (watch::Receiver<Arc<Publication>>, watch::Receiver<bool>) {
        (self.publication_tx.subscribe(), self.synced_tx.subscribe())
    }

    /// The latest publication.
    pub fn publication(&self) -> Arc<Publication> {
        self.publication_tx.borrow().clone()
    }

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
    fn frames(
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
    fn record_current(&self, node: &str, held: Held) {
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
    fn body(&self, key: &BodyKey, build: impl FnOnce() -> EncodedBody) -> Arc<EncodedBody> {
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
    fn news_after(&self, node: &str, target: &Held) -> u64 {
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
    fn tail(&self, key: TailKey, api: ApiState) -> Bytes {
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

    /// Trigger times and objects of the publications after `after` up to `upto`. Versions in
    /// the log are consecutive, so the range is found by arithmetic, not by a scan: this runs for
    /// every distinct update body.
    /// The newest recent publication that folded in a change of one of `objects` (change-log
    /// names, "Service ns/name"): its version, its first trigger time and every object it
    /// changed. `None` when none of the recent ones did.
    pub fn last_change_of(
        &self,
        objects: &[String],
    ) -> Option<(u64, Option<prost_types::Timestamp>, Vec<String>)> {
        let log = self.changes.lock().ok()?;
        let c = log
            .iter()
            .rev()
            .find(|c| c.objects.iter().any(|o| objects.contains(o)))?;
        let at = c
            .objects
            .iter()
            .zip(&c.trigger_times)
            .find(|(o, _)| objects.contains(o))
            .map(|(_, t)| *t);
        Some((c.version, at, c.objects.clone()))
    }

    /// How long publication `version` took to be acked, by the nodes connected when it was
    /// published (recorded for the recent ones).
    pub fn rollout_latency(&self, version: u64) -> Option<Rollout> {
        self.rollouts.lock().ok()?.get(&version).cloned()
    }

    pub(crate) fn changes_between(
        &self,
        after: u64,
        upto: u64,
    ) -> (Vec<prost_types::Timestamp>, Vec<String>) {
        let mut times = Vec::new();
        let mut objects = Vec::new();
        if let Ok(log) = self.changes.lock()
            && let Some(first) = log.front().map(|c| c.version)
        {
            let start = (after + 1).saturating_sub(first) as usize;
            let end = (upto + 1).saturating_sub(first) as usize;
            for c in log.range(start.min(log.len())..end.min(log.len())) {
                times.extend(c.trigger_times.iter().cloned());
                if objects.len() < 64 {
                    objects.extend(c.objects.iter().cloned());
                }
            }
        }
        objects.sort();
        objects.dedup();
        objects.truncate(64);
        (times, objects)
    }

    /// Where a resuming node stands, counted by kind
    /// (`splitproxy_brain_resumptions_total`): the state this brain knows it acked under this
    /// epoch; else, by content, the newest remembered publication at which the node would have
    /// held exactly the digest it presents (another replica's state, or this brain's before a
    /// restart, computed from the same API state); else nothing, and it gets a snapshot. The
    /// digest equality is the proof that the node holds the base a delta is computed from, and
    /// the actuator checks it again (`Update.base_digest`) and the digest after applying.
    ///
    /// A node whose digest matches nothing remembered but that presents the API state its
    /// ruleset was computed from (another replica's batches) is placed in a window of recent
    /// publications instead, and gets a restating delta ([`Resume::Window`], crate::restate).
    pub fn resume_point(
        &self,
        node: &str,
        applied: Option<&splitproxy_proto::v1::Applied>,
    ) -> Option<Resume> {
        let (resume, kind) = match self.resume(node, applied) {
            Some((held, kind)) => (Some(Resume::Exact(held)), kind),
            None => match self.window(node, applied) {
                Some((start, api)) => (Some(Resume::Window(start, api)), Resumption::Restated),
                None => (None, Resumption::Snapshot),
            },
        };
        self.metrics.resumed(kind);
        tracing::info!(
            node,
            resumption = kind.as_str(),
            version = resume.as_ref().map(Resume::version),
            api = ?applied.map(|a| &a.resource_versions),
            "resuming node"
        );
        resume
    }

    /// The start of the window of recent publications the node's state lies in (see
    /// [`crate::history::History::window_start`]), when it presents the API state its ruleset
    /// was computed from. The node does not hold it: nothing is recorded as acked.
    fn window(
        &self,
        node: &str,
        applied: Option<&splitproxy_proto::v1::Applied>,
    ) -> Option<(u64, ApiState)> {
        let applied = applied.filter(|a| !a.digest.is_empty())?;
        let api = ApiState::from_wire(&applied.resource_versions)?;
        let start = self.history.window_start(&api)?;
        if let Ok(mut nodes) = self.nodes.lock() {
            let st = node_state(&mut nodes, node);
            st.acked = None;
            st.acked_generation = 0;
        }
        Some((start, api))
    }

    fn resume(
        &self,
        node: &str,
        applied: Option<&splitproxy_proto::v1::Applied>,
    ) -> Option<(Held, Resumption)> {
        let applied = applied?;
        if applied.digest.is_empty() {
            return None; // nothing applied
        }
        let mut nodes = self.nodes.lock().ok()?;
        if applied.brain_epoch == self.epoch
            && let Some(st) = nodes.get(node)
            && let Some(held) = &st.acked
            && st.acked_generation == applied.generation
            && held.digest() == applied.digest
        {
            return Some((held.clone(), Resumption::SameEpoch));
        }
        let held = self.history.find(node, &applied.digest)?;
        // What the node holds now; not acked under a generation of this brain (0), so its next
        // delta names its base by digest.
        let st = node_state(&mut nodes, node);
        st.acked = Some(held.clone());
        st.acked_generation = 0;
        Some((held, Resumption::ByContent))
    }

    /// Records a drift report from a node: counted and kept for ListNodes, logged. The node
    /// repaired its tables back to what it acked, so nothing else changes.
    pub fn record_drift(&self, node: &str, drift: splitproxy_proto::v1::Drift) {
        tracing::warn!(
            node,
            summary = %drift.summary,
            kinds = ?drift.kinds,
            repaired = drift.repaired,
            error = %drift.error,
            "node reported drift in its tables"
        );
        let Ok(mut nodes) = self.nodes.lock() else {
            return;
        };
        let st = node_state(&mut nodes, node);
        st.drifts += 1;
        st.last_drift = Some(drift);
    }

    /// Records a node's answer to the update that took it to `sent` (version and model).
    pub fn record_ack(&self, node: &str, ack: &Ack, sent: Held) -> bool {
        let apply = ack
            .apply_duration
            .as_ref()
            .map(|d| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32));
        let version = sent.version;
        let mut settled = None;
        {
            let Ok(mut nodes) = self.nodes.lock() else {
                return false;
            };
            let st = node_state(&mut nodes, node);
            st.last_apply = apply;
            if ack.ok {
                settled = self.unsettled(st, Some(version));
                st.acked_generation = ack.generation;
                st.news_after = sent.version;
                st.hello_digest.clear();
                st.behind_since = None;
                st.acked = Some(sent);
                st.last_error.clear();
                st.last_errno = 0;
                st.last_refused_message.clear();
                st.last_kernel_message.clear();
            } else {
                st.acked = None;
                // It still holds what it had (a refused update changes nothing), and is behind
                // at least since the publication it could not apply.
                st.behind_since = Some(
                    self.published_at(version)
                        .unwrap_or_else(Instant::now)
                        .min(st.behind_since.unwrap_or_else(Instant::now)),
                );
                st.last_error = ack.error.clone();
                st.last_errno = ack.errno;
                st.last_refused_message = ack.refused_message.clone();
                st.last_kernel_message = ack.kernel_message.clone();
                self.metrics
                    .nacks
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        self.settle(settled, true);
        ack.ok
    }

    /// The publications `st`'s node was counted in and no longer holds up once it holds
    /// `version` (all of them when it left, `None`): after its `settled`, up to `version` and
    /// the newest counted. A publication counted after this (with the nodes locked, as the
    /// caller holds them) does not count a node that left, and one that stays settles it with a
    /// later ack. `None` when there is none.
    fn unsettled(&self, st: &mut NodeState, version: Option<u64>) -> Option<(u64, u64)> {
        let counted = self.counted.load(Ordering::Relaxed);
        let upto = version.map_or(counted, |v| v.min(counted));
        (upto > st.settled).then(|| (std::mem::replace(&mut st.settled, upto), upto))
    }

    /// The share of the nodes connected at the newest publication that have not acked it (nor
    /// left): 0 once every one has, or when none was connected.
    pub fn newest_unsettled_share(&self) -> f64 {
        let newest = self.counted.load(Ordering::Relaxed);
        let Ok(pending) = self.pending.lock() else {
            return 0.0;
        };
        pending
            .get(&newest)
            .map_or(0.0, |p| p.waiting as f64 / p.counted.max(1) as f64)
    }

    /// A node no longer holds up the publications after `range.0` up to `range.1` (from
    /// [`Fanout::unsettled`]); publications every node has settled are timed. `acked`: it holds
    /// them (not: it left), and its ack latency counts in their rollouts.
    fn settle(&self, range: Option<(u64, u64)>, acked: bool) {
        let Some((after, upto)) = range else {
            return;
        };
        let Ok(mut pending) = self.pending.lock() else {
            return;
        };
        let now = Instant::now();
        // An ack (not a disconnect) times each publication it settles for this node: no
        // allocation on this per-node path, one clock read.
        let mut rollouts = acked.then(|| self.rollouts.lock().ok()).flatten();
        let mut done = Vec::new();
        for (v, p) in pending.range_mut(after + 1..=upto) {
            let took = now.saturating_duration_since(p.published);
            p.waiting = p.waiting.saturating_sub(1);
            if let Some(rollouts) = rollouts.as_mut() {
                rollouts.entry(*v).or_default().record(took);
            }
            if p.waiting == 0 {
                done.push((*v, took));
            }
        }
        if let Some(rollouts) = rollouts.as_mut() {
            while rollouts.len() > CHANGE_LOG {
                rollouts.pop_first();
            }
        }
        drop(rollouts);
        for (v, took) in done {
            pending.remove(&v);
            self.metrics.observe_fanout(took);
        }
    }

    /// A stream for `node` from `peer` starts serving: it becomes the node's session. An older
    /// session of the same node still open is told to end (a newer stream replaces it: the node
    /// reconnected before the old connection was noticed dead). Returns the session's id and what
    /// tells it to end.
    pub fn connect(&self, node: &str, peer: &str) -> (u64, Arc<tokio::sync::Notify>) {
        let id = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
        let end = Arc::new(tokio::sync::Notify::new());
        let version = self.publication().version;
        if let Ok(mut nodes) = self.nodes.lock() {
            let st = node_state(&mut nodes, node);
            if !st.connected {
                // Counted from the next publication on; a session replacing a connected one
                // still holds up what the node was counted in.
                st.settled = self.counted.load(Ordering::Relaxed);
            }
            if let Some(older) = st.end_session.replace(end.clone()) {
                older.notify_one();
            }
            st.session = id;
            st.connected = true;
            st.peer = peer.to_string();
            st.disconnected_at = None;
            let now = Instant::now();
            st.connected_at = Some(now);
            st.news_after = version;
            st.behind_since = Some(now);
        }
        (id, end)
    }

    /// Session `session` of `node` ended. Only the node's current session marks it
    /// disconnected: a replaced one ending says nothing about the node.
    pub fn disconnect(&self, node: &str, session: u64) {
        let settled = match self.nodes.lock() {
            Ok(mut nodes) => match nodes.get_mut(node) {
                Some(st) if st.session == session => {
                    st.connected = false;
                    st.session = 0;
                    st.end_session = None;
                    st.disconnected_at = Some(Instant::now());
                    st.connected_at = None;
                    st.behind_since = None;
                    self.unsettled(st, None)
                }
                _ => None,
            },
            Err(_) => None,
        };
        self.settle(settled, false);
    }

    /// Marks `node` connected through a new session, or ends its current session, for callers
    /// that hold no session of their own (tests of the fan-out).
    pub fn set_connected(&self, node: &str, connected: bool, peer: &str) {
        if connected {
            self.connect(node, peer);
        } else {
            let session = self
                .nodes
                .lock()
                .ok()
                .and_then(|n| n.get(node).map(|st| st.session));
            if let Some(session) = session {
                self.disconnect(node, session);
            }
        }
    }

    /// Forgets nodes disconnected for longer than `grace` that the cluster does not know (no
    /// Node object in the latest publication): a node deleted from the cluster, or a name that
    /// never was one, does not stay in `ListNodes` forever. Nodes of the cluster stay listed
    /// while disconnected, which is what an operator needs to see.
    pub fn prune_disconnected(&self, now: Instant, grace: Duration) {
        let publication = self.publication();
        if let Ok(mut nodes) = self.nodes.lock() {
            nodes.retain(|name, st| {
                st.connected
                    || publication.overlays.contains_key(name)
                    || st
                        .disconnected_at
                        .is_none_or(|at| now.saturating_duration_since(at) < grace)
            });
        }
    }

    /// What a connecting node said it holds (its Hello's digest): if that is the state it is
    /// about to be sent, the update carries no trigger times (see [`Fanout::next_update`]).
    pub fn hello(&self, node: &str, applied: Option<&splitproxy_proto::v1::Applied>) {
        if let Ok(mut nodes) = self.nodes.lock() {
            let st = node_state(&mut nodes, node);
            st.hello_digest = applied.map(|a| a.digest.clone()).unwrap_or_default();
        }
    }

    /// The encodings the node's Hello says it reads (`Hello.encodings`): large shared parts go
    /// to it compressed when it reads zstd.
    pub fn accept_encodings(&self, node: &str, encodings: &[String]) {
        if let Ok(mut nodes) = self.nodes.lock() {
            let st = node_state(&mut nodes, node);
            st.zstd = encodings
                .iter()
                .any(|e| e == splitproxy_proto::compress::ZSTD);
        }
    }

    /// When the publication of `version` was made, if the change log still holds it.
    fn published_at(&self, version: u64) -> Option<Instant> {
        let log = self.changes.lock().ok()?;
        let first = log.front()?.version;
        let i = usize::try_from(version.checked_sub(first)?).ok()?;
        log.get(i).map(|c| c.published)
    }

    /// How long a node has been behind the latest publication: zero when it holds it or is not
    /// connected, otherwise the time since the oldest publication it lacks (or since the brain
    /// lost track of what it holds), but never more than it has been connected.
    pub fn lag(&self, st: &NodeState, latest: u64, now: Instant) -> Duration {
        let Some(connected_at) = st.connected.then_some(st.connected_at).flatten() else {
            return Duration::ZERO;
        };
        let since = match &st.acked {
            Some(h) if h.version >= latest => return Duration::ZERO,
            Some(h) => self
                .published_at(h.version + 1)
                .or(self.oldest_publication()),
            None if latest == 0 => return Duration::ZERO,
            None => st.behind_since,
        };
        now.saturating_duration_since(since.unwrap_or(connected_at).max(connected_at))
    }

    fn oldest_publication(&self) -> Option<Instant> {
        self.changes.lock().ok()?.front().map(|c| c.published)
    }

    /// The longest lag among connected nodes, and how many lag more than [`LAG_THRESHOLD`]:
    /// figures whose size does not grow with the number of nodes, for metrics.
    pub fn lag_summary(&self) -> (Duration, usize) {
        let latest = self.publication().version;
        let now = Instant::now();
        let Ok(nodes) = self.nodes.lock() else {
            return (Duration::ZERO, 0);
        };
        nodes
            .values()
            .map(|st| self.lag(st, latest, now))
            .fold((Duration::ZERO, 0), |(max, n), lag| {
                (max.max(lag), n + usize::from(lag > LAG_THRESHOLD))
            })
    }

    pub fn connected_nodes(&self) -> usize {
        self.nodes
            .lock()
            .map(|n| n.values().filter(|s| s.connected).count())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod drift_tests {
    use std::sync::Arc;

    use splitproxy_proto::v1::Drift;

    use super::Fanout;
    use crate::metrics::Metrics;

    #[test]
    fn drift_reports_are_counted_per_node_and_the_latest_kept() {
        let f = Fanout::new(Arc::new(Metrics::default()), 4, 1024);
        for summary in ["missing elements: 1", "missing tables: ip splitproxy"] {
            f.record_drift(
                "node-0",
                Drift {
                    summary: summary.to_owned(),
                    kinds: vec!["element".to_owned()],
                    repaired: true,
                    ..Drift::default()
                },
            );
        }
        let nodes = f.nodes.lock().unwrap();
        let st = &nodes["node-0"];
        assert_eq!(st.drifts, 2);
        let last = st.last_drift.as_ref().unwrap();
        assert_eq!(last.summary, "missing tables: ip splitproxy");
        assert!(last.repaired);
        // Nothing else about the node changes: it acked nothing new.
        assert!(st.acked.is_none() && st.last_error.is_empty());
    }
}
