//! The virtual nodes' streams: thousands of real gRPC streams to a real brain, each acking like
//! an actuator, applying into an in-memory model instead of a kernel.
//!
//! Each virtual node has its own mTLS identity and stream, so the brain's fan-out is exercised
//! exactly as with real nodes. What they share is the work a real node would repeat: the parts
//! of an update every node at the same base receives are applied once (`shared.rs`). So
//! one machine can play 5,000 nodes.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use splitproxy_proto::v1::{self, Ack, Hello, SyncRequest, sync_request};

use super::envelope::Envelope;
use super::grpc::{self, SyncCall};
use super::shared::{Held, SharedModels};

/// One virtual node: its name and the client certificate that names it.
pub struct FleetNode {
    pub name: String,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

/// Where the fleet connects and as whom.
pub struct FleetConfig {
    /// The brain replicas, "https://127.0.0.1:PORT" each. Virtual node `i` (its index in
    /// `nodes`) starts on replica `i % brains.len()` and, when its stream fails, moves on to
    /// the next replica in turn: each node is served by one replica at a time, and a dead
    /// replica's nodes are shared among the others (as real actuators do, docs/protocol.md,
    /// "Which brain").
    pub brains: Vec<String>,
    pub server_name: Option<String>,
    pub ca_pem: Vec<u8>,
    pub nodes: Vec<FleetNode>,
}

/// The fleet at one moment.
#[derive(Debug, Clone, Default)]
pub struct FleetStatus {
    pub nodes: usize,
    pub connected: usize,
    pub updates_applied: u64,
    pub bytes_received: u64,
    /// How many nodes hold each applied digest.
    pub digests: HashMap<Vec<u8>, usize>,
}

/// One applied update of one node: when, and which changes (trigger times) it carried.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Shared with the fleet's own copy of the name: a sample per node and update must not
    /// allocate one.
    pub node: Arc<str>,
    pub generation: u64,
    pub applied_at: SystemTime,
    pub trigger_times: Vec<SystemTime>,
    pub decode_and_apply: Duration,
}

/// What one virtual node received since the fleet started, for the failover and restart
/// phases: how many bytes, snapshots and deltas, and through which replica.
#[derive(Debug, Clone, Default)]
pub struct NodeStats {
    pub name: String,
    /// The replica (index into [`FleetConfig::brains`]) of its current or last stream.
    pub replica: usize,
    /// Streams it opened (the first, then one per reconnect).
    pub streams: u64,
    pub bytes: u64,
    pub snapshots: u64,
    pub deltas: u64,
    /// Wire size of the last snapshot it received: what a full resync costs this node.
    pub last_snapshot_bytes: u64,
}

/// [`NodeStats`] as the streams update them, and the digest the node last applied.
#[derive(Default)]
struct NodeCounters {
    /// Its own lock, so nodes do not contend for one map; the buffer is reused.
    applied: Mutex<Option<Vec<u8>>>,
    replica: AtomicUsize,
    streams: AtomicU64,
    bytes: AtomicU64,
    snapshots: AtomicU64,
    deltas: AtomicU64,
    last_snapshot_bytes: AtomicU64,
}

/// Every virtual node's stream and what they applied.
pub struct VirtualFleet {
    nodes: usize,
    names: Vec<Arc<str>>,
    counters: Vec<NodeCounters>,
    connected: AtomicUsize,
    updates: AtomicU64,
    bytes: AtomicU64,
    samples: Mutex<Vec<Sample>>,
    shared: SharedModels,
    stop: AtomicBool,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl VirtualFleet {
    /// Spawns one stream per node on the current tokio runtime.
    pub fn start(cfg: FleetConfig) -> anyhow::Result<Arc<VirtualFleet>> {
        let fleet = Arc::new(VirtualFleet {
            nodes: cfg.nodes.len(),
            names: cfg
                .nodes
                .iter()
                .map(|n| Arc::from(n.name.as_str()))
                .collect(),
            counters: cfg.nodes.iter().map(|_| NodeCounters::default()).collect(),
            connected: AtomicUsize::new(0),
            updates: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            samples: Mutex::new(Vec::new()),
            shared: SharedModels::default(),
            stop: AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
        });
        let roots = grpc::roots(&cfg.ca_pem)?;
        let shared = Arc::new((cfg.brains, cfg.server_name, roots));
        let mut tasks = Vec::with_capacity(cfg.nodes.len());
        for (index, node) in cfg.nodes.into_iter().enumerate() {
            let (fleet, shared) = (fleet.clone(), shared.clone());
            tasks.push(tokio::spawn(async move {
                fleet
                    .run_node(
                        index,
                        node,
                        &shared.0,
                        shared.1.as_deref(),
                        shared.2.clone(),
                    )
                    .await
            }));
        }
        if let Ok(mut t) = fleet.tasks.lock() {
            *t = tasks;
        }
        Ok(fleet)
    }

    pub fn status(&self) -> FleetStatus {
        let mut digests = HashMap::new();
        for c in &self.counters {
            if let Ok(a) = c.applied.lock()
                && let Some(d) = a.as_ref()
            {
                *digests.entry(d.clone()).or_default() += 1;
            }
        }
        FleetStatus {
            nodes: self.nodes,
            connected: self.connected.load(Ordering::Relaxed),
            updates_applied: self.updates.load(Ordering::Relaxed),
            bytes_received: self.bytes.load(Ordering::Relaxed),
            digests,
        }
    }

    /// What each node received so far, in node order.
    pub fn node_stats(&self) -> Vec<NodeStats> {
        self.names
            .iter()
            .zip(&self.counters)
            .map(|(name, c)| NodeStats {
                name: name.to_string(),
                replica: c.replica.load(Ordering::Relaxed),
                streams: c.streams.load(Ordering::Relaxed),
                bytes: c.bytes.load(Ordering::Relaxed),
                snapshots: c.snapshots.load(Ordering::Relaxed),
                deltas: c.deltas.load(Ordering::Relaxed),
                last_snapshot_bytes: c.last_snapshot_bytes.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Drains the samples recorded since the last call.
    pub fn take_samples(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default()
    }

    /// Closes every stream.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Ok(t) = self.tasks.lock() {
            for h in t.iter() {
                h.abort();
            }
        }
    }

    /// Keeps node `index` connected: to replica `index % brains`, then, whenever a stream
    /// ends, to the next replica. Reconnects are paced like a real actuator's
    /// (`splitproxy_actuator::client::Pacing`): after a healthy stream a random wait up to a
    /// second, so that a dead replica's nodes do not reach the next one together; after
    /// failed attempts a jittered exponential backoff. What the node holds survives the
    /// stream, so its Hello names it and the next replica resumes it by content.
    async fn run_node(
        self: Arc<Self>,
        index: usize,
        node: FleetNode,
        brains: &[String],
        server_name: Option<&str>,
        roots: Arc<rustls::RootCertStore>,
    ) {
        let tls = match grpc::tls_config(roots, &node.cert_pem, &node.key_pem) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(node = %node.name, error = %e, "virtual node has no usable identity");
                return;
            }
        };
        let mut held: Option<Held> = None;
        let mut pacing = splitproxy_actuator::client::Pacing::default();
        let mut replica = index % brains.len().max(1);
        let mut attempt: u64 = 0;
        while !self.stop.load(Ordering::Relaxed) {
            let Some(brain) = brains.get(replica) else {
                return;
            };
            self.counters[index]
                .replica
                .store(replica, Ordering::Relaxed);
            let mut healthy = false;
            match self
                .stream(
                    index,
                    &node,
                    brain,
                    server_name,
                    tls.clone(),
                    &mut held,
                    &mut healthy,
                )
                .await
            {
                Ok(()) => {}
                Err(e) => {
                    tracing::debug!(node = %node.name, error = %e, "virtual node stream ended")
                }
            }
            replica = (replica + 1) % brains.len();
            attempt += 1;
            let delay = pacing.next_delay(healthy, spread(index, attempt));
            tokio::time::sleep(delay).await;
        }
    }

    /// One stream to `brain`; `healthy` is set once it delivered an update or stayed open a
    /// second, as the real actuator judges it.
    #[allow(clippy::too_many_arguments)]
    async fn stream(
        &self,
        index: usize,
        node: &FleetNode,
        brain: &str,
        server_name: Option<&str>,
        tls: Arc<rustls::ClientConfig>,
        held: &mut Option<Held>,
        healthy: &mut bool,
    ) -> anyhow::Result<()> {
        let addr = brain.trim_start_matches("https://");
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        let applied = held.as_ref().map(|h| v1::Applied {
            brain_epoch: h.epoch,
            generation: h.generation,
            digest: h.digest(),
            resource_versions: h.resource_versions.clone(),
        });
        let hello = SyncRequest {
            msg: Some(sync_request::Msg::Hello(Hello {
                node: node.name.clone(),
                applied,
                version: "virtual".into(),
                encodings: vec![splitproxy_proto::compress::ZSTD.into()],
            })),
        };
        let mut call = SyncCall::open(
            addr,
            server_name.unwrap_or(host),
            tls,
            hello,
            splitproxy_proto::transport::MAX_UPDATE_MESSAGE,
            Duration::from_secs(30),
        )
        .await?;
        self.connected.fetch_add(1, Ordering::Relaxed);
        self.counters[index].streams.fetch_add(1, Ordering::Relaxed);
        let opened = Instant::now();
        let result = async {
            let mut pending: Option<Envelope> = None;
            while let Some(env) = call.next().await? {
                *healthy = true;
                let env = match pending.take() {
                    Some(mut first) if first.generation == env.generation => {
                        first.absorb(env);
                        first
                    }
                    _ => env,
                };
                if env.more {
                    pending = Some(env);
                    continue;
                }
                self.count(index, &env);
                let ack = self.apply(index, env, held);
                call.send(&SyncRequest {
                    msg: Some(sync_request::Msg::Ack(ack)),
                })?;
            }
            anyhow::Ok(())
        }
        .await;
        self.connected.fetch_sub(1, Ordering::Relaxed);
        if opened.elapsed() >= Duration::from_secs(1) {
            *healthy = true;
        }
        result
    }

    /// Counts a whole update (all its parts) node `index` received.
    fn count(&self, index: usize, env: &Envelope) {
        let c = &self.counters[index];
        c.bytes.fetch_add(env.wire_len as u64, Ordering::Relaxed);
        if env.snapshot {
            c.snapshots.fetch_add(1, Ordering::Relaxed);
            c.last_snapshot_bytes
                .store(env.wire_len as u64, Ordering::Relaxed);
        } else {
            c.deltas.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Applies one update to node `index`'s (shared) model and builds its ack.
    fn apply(&self, index: usize, mut env: Envelope, held: &mut Option<Held>) -> Ack {
        let start = Instant::now();
        self.bytes.fetch_add(env.wire_len as u64, Ordering::Relaxed);
        let result = self.shared.next_state(&env, held.as_ref());
        let took = start.elapsed();
        match result {
            Ok(next) => {
                *held = Some(next);
                self.updates.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut a) = self.counters[index].applied.lock() {
                    let d = a.get_or_insert_with(Vec::new);
                    d.clear();
                    d.extend_from_slice(&env.digest);
                }
                let sample = Sample {
                    node: self.names[index].clone(),
                    generation: env.generation,
                    applied_at: SystemTime::now(),
                    trigger_times: std::mem::take(&mut env.trigger_times),
                    decode_and_apply: took,
                };
                if let Ok(mut s) = self.samples.lock() {
                    s.push(sample);
                }
                Ack {
                    generation: env.generation,
                    ok: true,
                    error: String::new(),
                    apply_duration: took.try_into().ok(),
                    ..Ack::default()
                }
            }
            Err(e) => {
                *held = None;
                Ack {
                    generation: env.generation,
                    ok: false,
                    error: e,
                    apply_duration: None,
                    ..Ack::default()
                }
            }
        }
    }
}

/// A number in [0, 1) that differs between nodes and attempts, for the reconnect jitter (no
/// random source is needed: it only has to spread nodes apart).
fn spread(index: usize, attempt: u64) -> f64 {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15 ^ (index as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= attempt.wrapping_mul(0x94d0_49bb_1331_11eb) ^ u64::from(nanos);
    h ^= h >> 31;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 29;
    (h >> 11) as f64 / (1u64 << 53) as f64
}

impl Drop for VirtualFleet {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::spread;

    #[test]
    fn reconnect_spread_is_a_fraction_that_differs_between_nodes() {
        let values: Vec<f64> = (0..1000).map(|i| spread(i, 1)).collect();
        assert!(values.iter().all(|v| (0.0..1.0).contains(v)));
        let low = values.iter().filter(|v| **v < 0.5).count();
        assert!((350..650).contains(&low), "{low} of 1000 below 0.5");
    }
}
