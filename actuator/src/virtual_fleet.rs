//! Virtual nodes for scale benchmarks: thousands of real gRPC streams to a real brain, each
//! acking like an actuator, applying into an in-memory model instead of a kernel.
//!
//! Each virtual node has its own mTLS identity and stream, so the brain's fan-out is exercised
//! exactly as with real nodes. What they share is the work a real node would repeat. An update
//! is the parts every node at the same base receives (identical bytes) followed by one part of
//! the node's own; the shared parts are decoded and applied once, by the first node that needs
//! them, into a model every node at that state shares, and each node keeps only its own part as
//! a small overlay. So one machine can play 5,000 nodes.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::{Buf, BufMut, Bytes};
use prost::Message;
use prost::encoding::{DecodeContext, WireType};
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{self, Ack, Hello, Ruleset, RulesetDelta, SyncRequest, sync_request};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

pub struct FleetNode {
    pub name: String,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

pub struct FleetConfig {
    /// "https://127.0.0.1:PORT"
    pub brain: String,
    pub server_name: Option<String>,
    pub ca_pem: Vec<u8>,
    pub nodes: Vec<FleetNode>,
}

#[derive(Debug, Clone, Default)]
pub struct FleetStatus {
    pub nodes: usize,
    pub connected: usize,
    pub updates_applied: u64,
    pub bytes_received: u64,
    /// How many nodes hold each applied digest.
    pub digests: HashMap<Vec<u8>, usize>,
}

#[derive(Debug, Clone)]
pub struct Sample {
    pub node: String,
    pub generation: u64,
    pub applied_at: SystemTime,
    pub trigger_times: Vec<SystemTime>,
    pub decode_and_apply: Duration,
}

pub struct VirtualFleet {
    nodes: usize,
    connected: AtomicUsize,
    updates: AtomicU64,
    bytes: AtomicU64,
    applied: Mutex<HashMap<String, Vec<u8>>>,
    samples: Mutex<Vec<Sample>>,
    /// Shared models by the base they were built on and the parts applied to it (see
    /// [`shared_key`]), so an update's shared parts are decoded once for all nodes.
    states: Mutex<HashMap<u64, Arc<Model>>>,
    /// Shared models by digest: nodes that reached the same state from different bases (a slow
    /// node gets a larger, coalesced delta) hold one model, not one each.
    by_digest: Mutex<HashMap<Vec<u8>, Arc<Model>>>,
    stop: AtomicBool,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl VirtualFleet {
    /// Spawns one stream per node on the current tokio runtime.
    pub fn start(cfg: FleetConfig) -> Arc<VirtualFleet> {
        let fleet = Arc::new(VirtualFleet {
            nodes: cfg.nodes.len(),
            connected: AtomicUsize::new(0),
            updates: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            applied: Mutex::new(HashMap::new()),
            samples: Mutex::new(Vec::new()),
            states: Mutex::new(HashMap::new()),
            by_digest: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
        });
        let shared = Arc::new((cfg.brain, cfg.server_name, cfg.ca_pem));
        let mut tasks = Vec::with_capacity(cfg.nodes.len());
        for node in cfg.nodes {
            let (fleet, shared) = (fleet.clone(), shared.clone());
            tasks.push(tokio::spawn(async move {
                fleet
                    .run_node(node, &shared.0, shared.1.as_deref(), &shared.2)
                    .await
            }));
        }
        if let Ok(mut t) = fleet.tasks.lock() {
            *t = tasks;
        }
        fleet
    }

    pub fn status(&self) -> FleetStatus {
        let mut digests = HashMap::new();
        if let Ok(a) = self.applied.lock() {
            for d in a.values() {
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

    async fn run_node(
        self: Arc<Self>,
        node: FleetNode,
        brain: &str,
        server_name: Option<&str>,
        ca: &[u8],
    ) {
        let mut held: Option<Held> = None;
        let mut backoff = Duration::from_millis(100);
        while !self.stop.load(Ordering::Relaxed) {
            match self.stream(&node, brain, server_name, ca, &mut held).await {
                Ok(()) => {}
                Err(e) => {
                    tracing::debug!(node = %node.name, error = %e, "virtual node stream ended")
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    async fn stream(
        &self,
        node: &FleetNode,
        brain: &str,
        server_name: Option<&str>,
        ca: &[u8],
        held: &mut Option<Held>,
    ) -> anyhow::Result<()> {
        let uri: tonic::transport::Uri = brain.parse()?;
        let domain = server_name
            .map(str::to_string)
            .or_else(|| uri.host().map(str::to_string))
            .unwrap_or_default();
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .identity(Identity::from_pem(&node.cert_pem, &node.key_pem))
            .domain_name(domain);
        let channel = Channel::builder(uri)
            .tls_config(tls)?
            .connect_timeout(Duration::from_secs(30))
            .connect()
            .await?;
        let mut grpc = tonic::client::Grpc::new(channel)
            .max_decoding_message_size(splitproxy_proto::transport::MAX_UPDATE_MESSAGE);
        grpc.ready().await?;
        let (tx, rx) = mpsc::channel(4);
        let applied = held.as_ref().map(|h| v1::Applied {
            brain_epoch: h.epoch,
            generation: h.generation,
            digest: h.model.digest_with(&h.overlay),
        });
        tx.send(SyncRequest {
            msg: Some(sync_request::Msg::Hello(Hello {
                node: node.name.clone(),
                applied,
                version: "virtual".into(),
            })),
        })
        .await?;
        let codec = tonic_prost::ProstCodec::<SyncRequest, Envelope>::default();
        let path = http::uri::PathAndQuery::from_static("/splitproxy.v1.Dataplane/Sync");
        let mut updates = grpc
            .streaming(tonic::Request::new(ReceiverStream::new(rx)), path, codec)
            .await?
            .into_inner();
        self.connected.fetch_add(1, Ordering::Relaxed);
        let result = async {
            let mut pending: Option<Envelope> = None;
            while let Some(env) = updates.next().await {
                let env = match (pending.take(), env?) {
                    (Some(mut first), next) if first.generation == next.generation => {
                        first.absorb(next);
                        first
                    }
                    (_, next) => next,
                };
                if env.more {
                    pending = Some(env);
                    continue;
                }
                let ack = self.apply(&node.name, env, held);
                tx.send(SyncRequest {
                    msg: Some(sync_request::Msg::Ack(ack)),
                })
                .await?;
            }
            Ok(())
        }
        .await;
        self.connected.fetch_sub(1, Ordering::Relaxed);
        result
    }

    /// Applies one update to the node's (shared) model and builds its ack.
    fn apply(&self, node: &str, env: Envelope, held: &mut Option<Held>) -> Ack {
        let start = Instant::now();
        self.bytes.fetch_add(env.wire_len as u64, Ordering::Relaxed);
        let result = self.next_state(&env, held.as_ref());
        let took = start.elapsed();
        match result {
            Ok((model, overlay)) => {
                *held = Some(Held {
                    epoch: env.brain_epoch,
                    generation: env.generation,
                    model,
                    overlay,
                });
                self.updates.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut a) = self.applied.lock() {
                    a.insert(node.to_string(), env.digest.clone());
                }
                let sample = Sample {
                    node: node.to_string(),
                    generation: env.generation,
                    applied_at: SystemTime::now(),
                    trigger_times: env.trigger_times.clone(),
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

    /// The shared model after `env`'s shared parts (built once for every node at the same
    /// base), and the node's own overlay after its last part.
    fn next_state(
        &self,
        env: &Envelope,
        held: Option<&Held>,
    ) -> Result<(Arc<Model>, Arc<Model>), String> {
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
                    apply_part(&mut m, env.snapshot, b)?;
                }
                let m = self.dedup(m);
                if let Ok(mut s) = self.states.lock() {
                    if s.len() > 64 {
                        // Keep what some node holds: a model in both maps has two references
                        // of theirs.
                        s.retain(|_, m| Arc::strong_count(m) > 2);
                        if let Ok(mut by) = self.by_digest.lock() {
                            by.retain(|_, m| Arc::strong_count(m) > 1);
                        }
                    }
                    s.insert(key, m.clone());
                }
                m
            }
        };
        let mut overlay = base.map(|h| (*h.overlay).clone()).unwrap_or_default();
        apply_part(&mut overlay, env.snapshot, own)?;
        if model.digest_with(&overlay) != env.digest {
            return Err("digest after applying differs from the brain's".into());
        }
        Ok((model, Arc::new(overlay)))
    }
}

impl VirtualFleet {
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

/// Identifies a shared model by the content of its base (its digest) and the bytes of the
/// shared parts applied to it: every node at the same base gets the same bytes.
///
/// By content, not by the path that led there: nodes reach one state along different paths
/// (a slow node gets coalesced deltas), and keying by path gave every path its own key, so
/// after a while of churn each node rebuilt the whole shared model itself on every update and
/// the fleet's CPU went up with nodes times Services.
fn shared_key(base: Option<&Model>, snapshot: bool, parts: &[Bytes]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    base.map(Model::digest).hash(&mut h);
    snapshot.hash(&mut h);
    for p in parts {
        p.hash(&mut h);
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

impl Drop for VirtualFleet {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Held {
    epoch: u64,
    generation: u64,
    model: Arc<Model>,
    /// The node's own elements.
    overlay: Arc<Model>,
}

/// An `Update` whose body stays encoded until someone needs it; the parts of a split update
/// are absorbed into the first.
#[derive(Debug, Clone, Default)]
struct Envelope {
    brain_epoch: u64,
    generation: u64,
    base_generation: u64,
    snapshot: bool,
    /// Encoded bodies of every part so far.
    bodies: Vec<Bytes>,
    trigger_times: Vec<SystemTime>,
    digest: Vec<u8>,
    /// For a delta resumed by content: the digest of its base (docs/protocol.md).
    base_digest: Vec<u8>,
    more: bool,
    wire_len: usize,
}

impl Envelope {
    fn absorb(&mut self, next: Envelope) {
        self.bodies.extend(next.bodies);
        self.trigger_times.extend(next.trigger_times);
        self.wire_len += next.wire_len;
        self.digest = next.digest;
        self.base_digest = next.base_digest;
        self.more = next.more;
    }
}

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
                self.trigger_times.push(
                    SystemTime::UNIX_EPOCH
                        + Duration::new(t.seconds.max(0) as u64, t.nanos.max(0) as u32),
                );
                Ok(())
            }
            8 => bytes::merge(wire_type, &mut self.digest, buf, ctx),
            9 => prost::encoding::bool::merge(wire_type, &mut self.more, buf, ctx),
            10 => bytes::merge(wire_type, &mut self.base_digest, buf, ctx),
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
