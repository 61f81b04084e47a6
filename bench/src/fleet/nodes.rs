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
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use super::envelope::Envelope;
use super::shared::{Held, SharedModels};

/// One virtual node: its name and the client certificate that names it.
pub struct FleetNode {
    pub name: String,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

/// Where the fleet connects and as whom.
pub struct FleetConfig {
    /// "https://127.0.0.1:PORT"
    pub brain: String,
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
    pub node: String,
    pub generation: u64,
    pub applied_at: SystemTime,
    pub trigger_times: Vec<SystemTime>,
    pub decode_and_apply: Duration,
}

/// Every virtual node's stream and what they applied.
pub struct VirtualFleet {
    nodes: usize,
    connected: AtomicUsize,
    updates: AtomicU64,
    bytes: AtomicU64,
    applied: Mutex<HashMap<String, Vec<u8>>>,
    samples: Mutex<Vec<Sample>>,
    shared: SharedModels,
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
            shared: SharedModels::default(),
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
            digest: h.digest(),
        });
        tx.send(SyncRequest {
            msg: Some(sync_request::Msg::Hello(Hello {
                node: node.name.clone(),
                applied,
                version: "virtual".into(),
                encodings: vec![splitproxy_proto::compress::ZSTD.into()],
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
        let result = self.shared.next_state(&env, held.as_ref());
        let took = start.elapsed();
        match result {
            Ok(next) => {
                *held = Some(next);
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
}

impl Drop for VirtualFleet {
    fn drop(&mut self) {
        self.stop();
    }
}
