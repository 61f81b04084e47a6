//! The actuator's stream to a brain: connect over TLS to one of several brains, say what is
//! applied, apply every update and answer it. When the stream breaks, back off and try the next
//! brain; the kernel keeps the last applied rules meanwhile (fail static, docs/invariants.md).
//!
//! Which brain: every node orders the brains it knows (`--brain`, and those found in the brain
//! Service's EndpointSlices, discovery.rs) by rendezvous hashing of its own name and each
//! address ([`brain_order`]), so nodes spread evenly over the replicas and each node's
//! preferred replica stays the same while the set of addresses does. When a replica goes, only
//! its nodes move, each to the next address in its own order, and they arrive spread in time
//! ([`Pacing`]): 5,000 nodes losing a replica must not reach the next one in the same instant.
//! When every known brain has failed in a row, the brains are listed again (discovery.rs), and
//! the order is recomputed over the new set, which moves only the nodes whose brains changed.
//! A node on another replica than its preferred one goes back to it once that one serves again
//! (`REBALANCE_MIN`), so a failover or a rolling restart does not leave every node on one
//! replica. Moving costs little: the brain resumes a node by the content it holds
//! (docs/protocol.md, "Resumption").
//!
//! Credentials (credentials.rs) are read again at every connection, and the token for every
//! request: a stream the brain ends because its token or certificate expired (UNAUTHENTICATED
//! after it was accepted) is opened again on the same brain at once, with the rotated one.
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use splitproxy_proto::model::Model;
use splitproxy_proto::transport;
use splitproxy_proto::v1::dataplane_client::DataplaneClient;
use splitproxy_proto::v1::{self, Hello, SyncRequest, Update, sync_request, update::Body};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Uri};

use crate::after_commit::AfterCommit;
use crate::apply::kernel::Kernel;
use crate::apply::{Applied, Applier};
use crate::credentials::Credentials;
use crate::discovery::{Brains, DiscoveryConfig, EndpointSlices, SliceSource};
use crate::health::Health;
use crate::tls_client::TlsClient;

mod answer;
mod order;

pub use answer::{MAX_ERROR_BYTES, nack};
use answer::{Work, apply};
pub use order::{Pacing, brain_order};

/// A stream counts as healthy once it delivered an update, or once the brain accepted it and it
/// stayed open this long (a node the brain resumes with nothing to send gets no update); only a
/// stream that never got there grows the backoff.
const HEALTHY_AFTER: Duration = Duration::from_secs(1);
/// A node on another replica than its preferred one checks, after a random time between this
/// and twice this, whether a replica it prefers serves again, and moves back if so.
const REBALANCE_MIN: Duration = Duration::from_secs(30);
/// Time allowed to a replica's health check.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// What the stream to the brains needs; built from the actuator's
/// [`Config`](crate::config::Config).
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The static brain addresses (`--brain`); see [`brain_order`] for the order tried. Empty
    /// only when `discovery` is set.
    pub brains: Vec<Uri>,
    /// Where brains are found besides (`--brain-service`).
    pub discovery: Option<DiscoveryConfig>,
    pub server_name: Option<String>,
    pub node: String,
    pub credentials: Credentials,
    /// The TLS client, kept across reconnects for its session tickets.
    pub tls: Arc<TlsClient>,
}

/// How one stream ended.
enum End {
    /// It broke or was closed; `healthy` if it had been working (see [`HEALTHY_AFTER`]).
    Broken { healthy: bool },
    /// The brain ended a working stream with UNAUTHENTICATED: the token (or certificate) it was
    /// opened with expired. The files hold the rotated one: reconnect to the same brain.
    Expired,
    /// A replica this node prefers serves again: go there (its index in the node's order).
    MoveBack(usize),
}

/// Runs forever: one stream at a time, to the brains in this node's order ([`brain_order`]),
/// moving to the next one when a stream fails, paced by [`Pacing`], and listing the brains again
/// when every known one failed. `after` runs after every committed update (guarded map entries
/// and conntrack cleanup, health check servers). Returns only when the API server cannot be
/// configured for discovery (at start).
pub async fn run<K: Kernel + Send + 'static>(
    config: ClientConfig,
    applier: Arc<Mutex<Applier<K>>>,
    health: Arc<Health>,
    after: Arc<AfterCommit>,
) -> anyhow::Result<()> {
    let source = match &config.discovery {
        Some(d) => {
            let slices: Box<dyn SliceSource> = Box::new(EndpointSlices::connect(d).await?);
            tracing::info!(service = %d.service, port = %d.port_name, "finding brains in the EndpointSlices of their Service");
            Some((slices, d.port_name.clone()))
        }
        None => None,
    };
    let mut brains = Brains::new(config.brains.clone(), source, health.clone());
    anyhow::ensure!(
        brains.discovers() || !brains.all().is_empty(),
        "no brain address to connect to"
    );
    brains.until_known().await;
    let mut order = brain_order(&config.node, &brains.all());
    log_order(&config.node, &order);
    let mut pacing = Pacing::default();
    let mut at = 0usize;
    // Brains that failed in a row: when it reaches the number known, list again.
    let mut failed = 0usize;
    loop {
        let brain = order[at].clone();
        let end = stream_once(&config, &brain, &order[..at], &applier, &health, &after).await;
        health.metrics.set_connected(false);
        let delay = match end {
            End::MoveBack(to) => {
                tracing::info!(from = %brain, to = %order[to], "a preferred brain serves again; moving back");
                at = to;
                failed = 0;
                Duration::ZERO
            }
            End::Expired => {
                tracing::info!(%brain, "the brain ended the stream: its credential expired; reconnecting with the files' current one");
                failed = 0;
                brains.stream_healthy();
                pacing.next_delay(true, rand::random_range(0.0..1.0))
            }
            End::Broken { healthy } => {
                if healthy {
                    brains.stream_healthy();
                    failed = 1;
                } else {
                    failed += 1;
                }
                at = (at + 1) % order.len();
                if failed >= order.len() && brains.list_due() {
                    failed = 0;
                    if brains.refresh().await {
                        order = brain_order(&config.node, &brains.all());
                        log_order(&config.node, &order);
                        at = 0;
                    }
                }
                pacing.next_delay(healthy, rand::random_range(0.0..1.0))
            }
        };
        tokio::time::sleep(delay).await;
    }
}

fn log_order(node: &str, order: &[Uri]) {
    tracing::info!(node, order = ?order.iter().map(ToString::to_string).collect::<Vec<_>>(), "brain order");
}

/// A channel to `brain`, with the credentials as the files hold them now.
async fn connect(config: &ClientConfig, brain: &Uri) -> anyhow::Result<Channel> {
    let domain = config
        .server_name
        .clone()
        .or_else(|| brain.host().map(|h| h.trim_matches(['[', ']']).to_string()))
        .unwrap_or_default();
    let tls = config.tls.config(&config.credentials)?;
    // The token is sent with each request (credentials::Bearer); reading it here too makes an
    // unreadable token fail before a connection is made, with the reason.
    if let Some(token) = &config.credentials.token_file {
        crate::credentials::authorization(token)?;
    }
    // The channel's own address is plain: the TLS is the connector's (crate::tls_client).
    let plain = Uri::builder()
        .scheme("http")
        .authority(brain.authority().map(|a| a.as_str()).unwrap_or_default())
        .path_and_query("/")
        .build()?;
    let endpoint = Channel::builder(plain)
        .connect_timeout(transport::CONNECT_TIMEOUT)
        .http2_keep_alive_interval(transport::KEEPALIVE_INTERVAL)
        .keep_alive_timeout(transport::KEEPALIVE_TIMEOUT);
    crate::tls_client::connect(endpoint, brain, &domain, tls).await
}

/// One stream to `brain`, logged when it ends. `preferred`: the brains this node prefers to it,
/// checked now and then (see [`REBALANCE_MIN`]).
async fn stream_once<K: Kernel + Send + 'static>(
    config: &ClientConfig,
    brain: &Uri,
    preferred: &[Uri],
    applier: &Arc<Mutex<Applier<K>>>,
    health: &Arc<Health>,
    after: &AfterCommit,
) -> End {
    let mut progress = Progress::default();
    let result = stream(
        config,
        brain,
        preferred,
        applier,
        health,
        after,
        &mut progress,
    )
    .await;
    let healthy = progress.delivered
        || progress
            .opened
            .is_some_and(|at| at.elapsed() >= HEALTHY_AFTER);
    match result {
        Ok(Some(to)) => return End::MoveBack(to),
        Ok(None) => tracing::info!(%brain, "brain closed the stream"),
        Err(e) if healthy && unauthenticated(&e) => {
            tracing::info!(%brain, error = format!("{e:#}"), "stream to brain ended");
            return End::Expired;
        }
        Err(e) => tracing::warn!(%brain, error = format!("{e:#}"), "stream to brain failed"),
    }
    End::Broken { healthy }
}

/// Whether the brain ended the stream with UNAUTHENTICATED (a credential that expired).
fn unauthenticated(e: &anyhow::Error) -> bool {
    e.downcast_ref::<tonic::Status>()
        .is_some_and(|s| s.code() == tonic::Code::Unauthenticated)
}

/// Whether `brain` answers its gRPC health check as serving (synced, docs/protocol.md).
async fn serving(config: &ClientConfig, brain: &Uri) -> bool {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let check = async {
        let channel = connect(config, brain).await?;
        let response = HealthClient::with_interceptor(channel, config.credentials.bearer())
            .check(HealthCheckRequest::default())
            .await?;
        anyhow::Ok(response.into_inner().status == ServingStatus::Serving as i32)
    };
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, check).await,
        Ok(Ok(true))
    )
}

/// The first of `preferred` that serves, by its index.
async fn first_serving(config: &ClientConfig, preferred: &[Uri]) -> Option<usize> {
    for (i, brain) in preferred.iter().enumerate() {
        if serving(config, brain).await {
            return Some(i);
        }
    }
    None
}

/// A health check of the preferred brains running beside the stream (the index of the first
/// that serves); aborted when the stream ends.
#[derive(Default)]
struct Probe(Option<tokio::task::JoinHandle<Option<usize>>>);

impl Drop for Probe {
    fn drop(&mut self) {
        if let Some(probe) = self.0.take() {
            probe.abort();
        }
    }
}

/// The random time until the next check for a preferred replica.
fn rebalance_interval() -> Duration {
    REBALANCE_MIN.mul_f64(1.0 + rand::random_range(0.0..1.0))
}

/// How far a stream got.
#[derive(Debug, Default)]
struct Progress {
    /// When the brain accepted the stream.
    opened: Option<Instant>,
    /// An update was applied.
    delivered: bool,
}

/// The stream itself: `Ok(Some(i))` when it was left for `preferred[i]`, `Ok(None)` when the
/// brain closed it.
async fn stream<K: Kernel + Send + 'static>(
    config: &ClientConfig,
    brain: &Uri,
    preferred: &[Uri],
    applier: &Arc<Mutex<Applier<K>>>,
    health: &Arc<Health>,
    after: &AfterCommit,
    progress: &mut Progress,
) -> anyhow::Result<Option<usize>> {
    let channel = connect(config, brain).await?;
    let mut client = DataplaneClient::with_interceptor(channel, config.credentials.bearer())
        .max_decoding_message_size(transport::MAX_UPDATE_MESSAGE);
    let applied = applier
        .lock()
        .map_err(|_| anyhow::anyhow!("applier poisoned"))?
        .applied()
        .clone();
    let (tx, rx) = mpsc::channel(4);
    tx.send(SyncRequest {
        msg: Some(sync_request::Msg::Hello(hello(&config.node, applied))),
    })
    .await?;
    let mut updates = client.sync(ReceiverStream::new(rx)).await?.into_inner();
    tracing::info!(%brain, node = %config.node, "stream open");
    progress.opened = Some(Instant::now());
    health.metrics.set_connected(true);
    let _drift = DriftForwarder::start(tx.clone(), health.clone());
    // Parts of one update (same generation, `more` on all but the last) are applied as one
    // transaction. Snapshot parts are folded into a model as they arrive, so a node never holds
    // a whole decoded snapshot; delta parts (small) are joined.
    let mut pending: Option<Pending> = None;
    let mut rebalance_at = tokio::time::Instant::now() + rebalance_interval();
    // The health checks of preferred brains run beside the stream, which keeps applying
    // updates meanwhile.
    let mut probe = Probe::default();
    loop {
        let update = tokio::select! {
            update = updates.next() => update,
            _ = tokio::time::sleep_until(rebalance_at), if !preferred.is_empty() && probe.0.is_none() => {
                rebalance_at = tokio::time::Instant::now() + rebalance_interval();
                let (config, preferred) = (config.clone(), preferred.to_vec());
                probe.0 = Some(tokio::spawn(async move {
                    first_serving(&config, &preferred).await
                }));
                continue;
            }
            found = async {
                match probe.0.as_mut() {
                    Some(check) => check.await.ok().flatten(),
                    None => std::future::pending().await,
                }
            }, if probe.0.is_some() => {
                probe.0 = None;
                // Never in the middle of an update's parts.
                if pending.is_none()
                    && let Some(to) = found
                {
                    return Ok(Some(to));
                }
                continue;
            }
        };
        let Some(update) = update else { break };
        let mut update = update?;
        // A compressed part (`Update.zstd`) is decoded into the update in its place.
        splitproxy_proto::compress::inflate(&mut update, transport::MAX_UPDATE_MESSAGE)?;
        let Some(work) = take_part(&mut pending, update)? else {
            continue;
        };
        let (ack, outcome) = apply(work, applier, health).await;
        let sent = tx
            .send(SyncRequest {
                msg: Some(sync_request::Msg::Ack(ack)),
            })
            .await;
        // The kernel has the new rules whether or not the brain hears of it.
        if let Some(outcome) = outcome {
            progress.delivered = true;
            after.run(outcome).await;
        }
        sent?;
    }
    Ok(None)
}

/// Sends the reconciler's drift reports (reconcile.rs) on the open stream, until the stream
/// ends (dropped). A report the stream could not take goes back for the next one.
struct DriftForwarder(tokio::task::JoinHandle<()>);

impl DriftForwarder {
    fn start(tx: mpsc::Sender<SyncRequest>, health: Arc<Health>) -> Self {
        DriftForwarder(tokio::spawn(async move {
            loop {
                let report = health.drift.next().await;
                let msg = SyncRequest {
                    msg: Some(sync_request::Msg::Drift(report.clone())),
                };
                if tx.send(msg).await.is_err() {
                    health.drift.requeue(report);
                    return;
                }
            }
        }))
    }
}

impl Drop for DriftForwarder {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The `Hello` that opens a stream: the node, and what it has applied. Its resource versions
/// (non-empty once an update that carried them was applied) also tell the brain that this
/// actuator applies restating deltas (docs/protocol.md, "Resumption").
fn hello(node: &str, applied: Applied) -> Hello {
    Hello {
        node: node.to_owned(),
        applied: Some(v1::Applied {
            brain_epoch: applied.brain_epoch,
            generation: applied.generation,
            digest: applied.digest,
            resource_versions: applied.resource_versions,
        }),
        version: env!("CARGO_PKG_VERSION").into(),
        encodings: vec![splitproxy_proto::compress::ZSTD.into()],
    }
}

/// An update whose parts are still arriving.
struct Pending {
    /// Everything but the body, from the latest part (trigger times and objects collected):
    /// what the last part alone carries (digest, base digest, resource versions, restating,
    /// trace context, `more = false`) is the update's.
    meta: Update,
    snapshot: Option<Model>,
    deltas: Vec<Body>,
}

/// Takes one (inflated) part of an update into `pending`; once the last part arrived, the
/// whole update to apply. Parts of two generations interleaving, or snapshot and delta parts
/// in one update, are protocol errors that end the stream.
fn take_part(pending: &mut Option<Pending>, mut update: Update) -> anyhow::Result<Option<Work>> {
    if let Some(p) = pending.as_ref()
        && p.meta.generation != update.generation
    {
        anyhow::bail!(
            "update parts of generations {} and {} interleave",
            p.meta.generation,
            update.generation
        );
    }
    let p = pending.get_or_insert_with(|| Pending {
        meta: Update::default(),
        snapshot: None,
        deltas: Vec::new(),
    });
    match update.body.take() {
        Some(Body::Snapshot(r)) => {
            let model = p.snapshot.get_or_insert_with(Model::default);
            model.apply(&v1::RulesetDelta {
                upsert: r.tables,
                remove: Vec::new(),
            });
        }
        Some(body @ Body::Delta(_)) => p.deltas.push(body),
        None => {}
    }
    p.meta.trigger_times.append(&mut update.trigger_times);
    p.meta.objects.append(&mut update.objects);
    p.meta = Update {
        trigger_times: std::mem::take(&mut p.meta.trigger_times),
        objects: std::mem::take(&mut p.meta.objects),
        ..update
    };
    if p.meta.more {
        return Ok(None);
    }
    let Some(p) = pending.take() else {
        return Ok(None);
    };
    Ok(Some(match (p.snapshot, p.deltas) {
        (Some(model), deltas) if deltas.is_empty() => Work::Snapshot(p.meta, model),
        // Delta parts only join (no body at all: the applier refuses it, a NACK).
        (None, deltas) => Work::Update(Update {
            body: splitproxy_proto::parts::join(deltas).ok(),
            ..p.meta
        }),
        _ => anyhow::bail!("update mixes snapshot and delta parts"),
    }))
}

#[cfg(test)]
mod tests;
