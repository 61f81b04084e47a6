//! Published desired state and per-node streams.
//!
//! The index task publishes a new [`Publication`] (the shared model every node holds plus each
//! node's overlay, all persistent) through a `watch` channel; a node's session waits for its
//! previous update to be acked, then sends whatever changed since, so a slow node is never
//! queued more than one update and always gets the coalesced latest state ("bounded under slow
//! nodes", docs/invariants.md).
//!
//! The submodules hold what happens per node: its next update (`updates`), where it resumes
//! when it connects (`resume`, `restating`), its acks (`acks`), its session and lag
//! (`connections`), and the change log its updates carry (`changes`).
//!
//! Every distinct update body (a delta between two published versions of the shared model, or
//! a snapshot of one) is computed and encoded once and shared, as bytes, by every node that
//! needs it; per node the brain only writes a few header fields (see `splitproxy_proto::frames`).
mod acks;
mod changes;
mod connections;
mod restating;
mod resume;
mod updates;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use foldhash::{HashMap, HashMapExt};
use splitproxy_proto::frames::{UpdateFrame, encode_node_part};
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::update::Body;
use tokio::sync::watch;

use crate::api_state::ApiState;
use crate::history::History;
use crate::metrics::Metrics;
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
