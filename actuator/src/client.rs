//! The actuator's stream to a brain: connect over mTLS to one of several brains, say what is
//! applied, apply every update and answer it. When the stream breaks, back off and try the next
//! brain; the kernel keeps the last applied rules meanwhile (fail static, docs/invariants.md).
//!
//! Which brain: every node orders the `--brain` addresses by rendezvous hashing of its own name
//! and each address ([`brain_order`]), so nodes spread evenly over the replicas and each node's
//! preferred replica stays the same while the set of addresses does. When a replica goes, only
//! its nodes move, each to the next address in its own order, and they arrive spread in time
//! ([`Pacing`]): 5,000 nodes losing a replica must not reach the next one in the same instant.
//! A node on another replica than its preferred one goes back to it once that one serves again
//! ([`REBALANCE_MIN`]), so a failover or a rolling restart does not leave every node on one
//! replica. Moving costs little: the brain resumes a node by the content it holds
//! (docs/protocol.md, "Resumption").
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use splitproxy_proto::model::Model;
use splitproxy_proto::transport;
use splitproxy_proto::v1::dataplane_client::DataplaneClient;
use splitproxy_proto::v1::{self, Ack, Hello, SyncRequest, Update, sync_request, update::Body};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity, Uri};

use crate::after_commit::AfterCommit;
use crate::apply::kernel::Kernel;
use crate::apply::{Applier, ApplyError, Outcome};
use crate::config::TlsFiles;
use crate::health::Health;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// After a healthy stream breaks, the first reconnect waits a random time up to this: every
/// node of a replica that died notices at the same instant, and this spreads their arrival at
/// the next replica over the interval.
const RECONNECT_SPREAD: Duration = Duration::from_secs(1);
/// A stream counts as healthy once it delivered an update, or once the brain accepted it and it
/// stayed open this long (a node the brain resumes with nothing to send gets no update); only a
/// stream that never got there grows the backoff.
const HEALTHY_AFTER: Duration = Duration::from_secs(1);
/// A node on another replica than its preferred one checks, after a random time between this
/// and twice this, whether a replica it prefers serves again, and moves back if so.
const REBALANCE_MIN: Duration = Duration::from_secs(30);
/// Time allowed to a replica's health check.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest error text a NACK carries (each of its strings): a refused 60 KiB element message
/// or a long chain of causes must not make the ack itself a burden (bounded under slow nodes,
/// docs/invariants.md).
pub const MAX_ERROR_BYTES: usize = 4096;

/// What the stream to the brains needs; built from the actuator's
/// [`Config`](crate::config::Config).
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The brain replicas, in the order given (see [`brain_order`] for the order tried); never
    /// empty.
    pub brains: Vec<Uri>,
    pub server_name: Option<String>,
    pub node: String,
    pub tls: TlsFiles,
}

/// The brain addresses in `node`'s order of preference: by rendezvous (highest random weight)
/// hashing of (node, address), highest weight first. Each node prefers one address, the
/// preferences spread evenly over the addresses, and removing an address moves only the nodes
/// that preferred it (each to its own next choice); adding one takes only the nodes that now
/// prefer it. The weight is a fixed function of the two strings, the same in every process and
/// version, so a node's order survives restarts.
pub fn brain_order(node: &str, brains: &[Uri]) -> Vec<Uri> {
    let mut weighted: Vec<(u64, String, &Uri)> = brains
        .iter()
        .map(|b| {
            let address = b.to_string();
            (rendezvous_weight(node, &address), address, b)
        })
        .collect();
    // Ties (practically never) are broken by the address, so the order is total.
    weighted.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    weighted.into_iter().map(|(_, _, b)| b.clone()).collect()
}

/// The rendezvous weight of (node, address): 64-bit FNV-1a over both (separated by a byte no
/// UTF-8 string holds), then the MurmurHash3 finalizer so that names differing in one character
/// get unrelated weights. Not a secret: it only spreads load.
fn rendezvous_weight(node: &str, address: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let bytes = node.bytes().chain([0xff]).chain(address.bytes());
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// When to try again after a stream ended: full jitter on an exponential backoff after
/// failures (a random time between zero and the backoff, so retries of many nodes do not
/// synchronise), and after a healthy stream a random time up to [`RECONNECT_SPREAD`] with the
/// backoff reset.
#[derive(Debug, Clone)]
pub struct Pacing {
    backoff: Duration,
}

impl Default for Pacing {
    fn default() -> Self {
        Pacing {
            backoff: BACKOFF_MIN,
        }
    }
}

impl Pacing {
    /// The wait before the next attempt, for a stream that ended `healthy` or not; `random` is
    /// uniform in [0, 1).
    pub fn next_delay(&mut self, healthy: bool, random: f64) -> Duration {
        let random = random.clamp(0.0, 1.0);
        if healthy {
            self.backoff = BACKOFF_MIN;
            return RECONNECT_SPREAD.mul_f64(random);
        }
        let delay = self.backoff.mul_f64(random);
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        delay
    }
}

/// How one stream ended.
enum End {
    /// It broke or was closed; `healthy` if it had been working (see [`HEALTHY_AFTER`]).
    Broken { healthy: bool },
    /// A replica this node prefers serves again: go there (its index in the node's order).
    MoveBack(usize),
}

/// Runs forever: one stream at a time, to the brains in this node's order ([`brain_order`]),
/// moving to the next one when a stream fails, paced by [`Pacing`]. `after` runs after every
/// committed update (guarded map entries and conntrack cleanup, health check servers). Returns
/// only when there is no brain to connect to.
pub async fn run<K: Kernel + Send + 'static>(
    config: ClientConfig,
    applier: Arc<Mutex<Applier<K>>>,
    health: Arc<Health>,
    after: Arc<AfterCommit>,
) -> anyhow::Result<()> {
    anyhow::ensure!(!config.brains.is_empty(), "no brain address to connect to");
    let order = brain_order(&config.node, &config.brains);
    tracing::info!(node = %config.node, order = ?order.iter().map(ToString::to_string).collect::<Vec<_>>(), "brain order");
    let mut pacing = Pacing::default();
    let mut at = 0usize;
    loop {
        let brain = &order[at];
        let preferred = &order[..at];
        let end = stream_once(&config, brain, preferred, &applier, &health, &after).await;
        health.metrics.set_connected(false);
        let delay = match end {
            End::MoveBack(to) => {
                tracing::info!(from = %brain, to = %order[to], "a preferred brain serves again; moving back");
                at = to;
                Duration::ZERO
            }
            End::Broken { healthy } => {
                at = (at + 1) % order.len();
                pacing.next_delay(healthy, rand::random_range(0.0..1.0))
            }
        };
        tokio::time::sleep(delay).await;
    }
}

fn read(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    anyhow::ensure!(!pem.is_empty(), "{} is empty", path.display());
    Ok(pem)
}

async fn connect(config: &ClientConfig, brain: &Uri) -> anyhow::Result<Channel> {
    let domain = config
        .server_name
        .clone()
        .or_else(|| brain.host().map(|h| h.trim_matches(['[', ']']).to_string()))
        .unwrap_or_default();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(&config.tls.ca)?))
        .identity(Identity::from_pem(
            read(&config.tls.cert)?,
            read(&config.tls.key)?,
        ))
        .domain_name(domain);
    Ok(Channel::builder(brain.clone())
        .tls_config(tls)?
        .connect_timeout(transport::CONNECT_TIMEOUT)
        .http2_keep_alive_interval(transport::KEEPALIVE_INTERVAL)
        .keep_alive_timeout(transport::KEEPALIVE_TIMEOUT)
        .connect()
        .await?)
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
        Err(e) => tracing::warn!(%brain, error = format!("{e:#}"), "stream to brain failed"),
    }
    End::Broken { healthy }
}

/// Whether `brain` answers its gRPC health check as serving (synced, docs/protocol.md).
async fn serving(config: &ClientConfig, brain: &Uri) -> bool {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let check = async {
        let channel = connect(config, brain).await?;
        let response = HealthClient::new(channel)
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
    let mut client =
        DataplaneClient::new(channel).max_decoding_message_size(transport::MAX_UPDATE_MESSAGE);
    let applied = applier
        .lock()
        .map_err(|_| anyhow::anyhow!("applier poisoned"))?
        .applied()
        .clone();
    let (tx, rx) = mpsc::channel(4);
    tx.send(SyncRequest {
        msg: Some(sync_request::Msg::Hello(Hello {
            node: config.node.clone(),
            applied: Some(v1::Applied {
                brain_epoch: applied.brain_epoch,
                generation: applied.generation,
                digest: applied.digest,
            }),
            version: env!("CARGO_PKG_VERSION").into(),
        })),
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
        if let Some(p) = &pending
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
            continue;
        }
        let Some(p) = pending.take() else { continue };
        let work = match (p.snapshot, p.deltas) {
            (Some(model), deltas) if deltas.is_empty() => Work::Snapshot(p.meta, model),
            // Delta parts only join (no body at all: the applier refuses it, a NACK).
            (None, deltas) => Work::Update(Update {
                body: splitproxy_proto::parts::join(deltas).ok(),
                ..p.meta
            }),
            _ => anyhow::bail!("update mixes snapshot and delta parts"),
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

/// An update whose parts are still arriving.
struct Pending {
    /// Everything but the body, from the latest part (trigger times and objects collected).
    meta: Update,
    snapshot: Option<Model>,
    deltas: Vec<Body>,
}

/// What to apply: an update, or a snapshot already folded into a model.
enum Work {
    Update(Update),
    Snapshot(Update, Model),
}

/// Applies one update off the async runtime (netlink is blocking) and builds its answer, and,
/// when it committed, what follows.
async fn apply<K: Kernel + Send + 'static>(
    work: Work,
    applier: &Arc<Mutex<Applier<K>>>,
    health: &Arc<Health>,
) -> (Ack, Option<Outcome>) {
    let (generation, snapshot) = match &work {
        Work::Update(u) => (u.generation, matches!(u.body, Some(Body::Snapshot(_)))),
        Work::Snapshot(u, _) => (u.generation, true),
    };
    let applier = applier.clone();
    let (update, result) = tokio::task::spawn_blocking(move || {
        let Ok(mut a) = applier.lock() else {
            return (Update::default(), Err(ApplyError::Panicked));
        };
        let (update, result) = match work {
            Work::Update(u) => {
                let r = a.apply(&u);
                (u, r)
            }
            Work::Snapshot(u, model) => {
                let r = a.apply_snapshot(&u, model);
                (u, r)
            }
        };
        (update, result)
    })
    .await
    .unwrap_or_else(|e| {
        tracing::error!(error = %e, "applying an update panicked");
        (Update::default(), Err(ApplyError::Panicked))
    });
    match result {
        Ok(outcome) => {
            let took = outcome.took;
            let elements = outcome.model.element_count();
            health.metrics.applied(generation, took, snapshot, elements);
            health
                .ready
                .store(true, std::sync::atomic::Ordering::Relaxed);
            health
                .apply_failing
                .store(false, std::sync::atomic::Ordering::Relaxed);
            let now = SystemTime::now();
            // Only an update that changed the kernel programmed anything: one that found its
            // content in place (a reconnect, a resumption) would report the age of old changes.
            let programmed = if outcome.changed {
                &update.trigger_times[..]
            } else {
                &[]
            };
            for t in programmed {
                let at = SystemTime::UNIX_EPOCH
                    + Duration::new(t.seconds.max(0) as u64, t.nanos.max(0) as u32);
                if let Ok(latency) = now.duration_since(at) {
                    health.metrics.network_programming(latency);
                }
            }
            tracing::info!(generation, snapshot, ?took, objects = ?update.objects, "applied update");
            let ack = Ack {
                generation,
                ok: true,
                apply_duration: took.try_into().ok(),
                ..Ack::default()
            };
            (ack, Some(outcome))
        }
        Err(e) => {
            health.metrics.apply_failed();
            health
                .apply_failing
                .store(true, std::sync::atomic::Ordering::Relaxed);
            tracing::error!(generation, snapshot, error = %e, "update failed; previous rules stay in place");
            (nack(generation, &e), None)
        }
    }
}

/// The answer to an update that failed: the error, and when the kernel refused it, its errno,
/// the message it refused and what it said, so that the brain shows why without a node's logs.
/// Every string is at most [`MAX_ERROR_BYTES`].
pub fn nack(generation: u64, e: &ApplyError) -> Ack {
    let refused = e.refused();
    Ack {
        generation,
        ok: false,
        error: bounded(e.to_string()),
        apply_duration: None,
        errno: e.errno().unwrap_or(0),
        refused_message: refused
            .map(|f| bounded(f.description.clone()))
            .unwrap_or_default(),
        kernel_message: refused
            .and_then(|f| f.kernel_message.clone())
            .map(bounded)
            .unwrap_or_default(),
    }
}

/// `s` cut to at most [`MAX_ERROR_BYTES`] on a character boundary, marked when cut.
fn bounded(mut s: String) -> String {
    const MARK: &str = " [...]";
    if s.len() <= MAX_ERROR_BYTES {
        return s;
    }
    let mut end = MAX_ERROR_BYTES - MARK.len();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push_str(MARK);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nft::{CommitError, MessageFailure};

    #[test]
    fn a_nack_carries_the_kernels_errno_and_the_refused_message() {
        let e = ApplyError::Kernel(CommitError::Rejected {
            failures: vec![MessageFailure {
                errno: 2,
                message: Some(3),
                description: "delete set service-ips".to_owned(),
                kernel_message: Some("no such set".to_owned()),
            }],
        });
        let ack = nack(7, &e);
        assert_eq!(ack.generation, 7);
        assert!(!ack.ok);
        assert_eq!(ack.errno, 2);
        assert_eq!(ack.refused_message, "delete set service-ips");
        assert_eq!(ack.kernel_message, "no such set");
        assert!(
            ack.error.contains("delete set service-ips"),
            "{}",
            ack.error
        );

        let ack = nack(8, &ApplyError::Digest);
        assert_eq!(
            (
                ack.errno,
                ack.refused_message.as_str(),
                ack.kernel_message.as_str()
            ),
            (0, "", "")
        );
        assert!(!ack.error.is_empty());
    }

    /// An applier over the recording kernel fake, the node's health, and a ruleset of one empty
    /// owned table to send it.
    fn recording_node() -> (
        Arc<Mutex<Applier<crate::apply::kernel::Recording>>>,
        Arc<Health>,
        splitproxy_proto::v1::Ruleset,
    ) {
        use splitproxy_proto::v1::{Ruleset, Table};
        let applier = Arc::new(Mutex::new(Applier::new(
            crate::apply::kernel::Recording::new(),
            "splitproxy".to_owned(),
        )));
        let rs = Ruleset {
            tables: vec![Table {
                family: v1::Family::Ip as i32,
                name: "splitproxy".to_owned(),
                ..Table::default()
            }],
        };
        (applier, Arc::new(Health::default()), rs)
    }

    /// The whole path from a refusing kernel to the answer the brain gets, and the answer to
    /// the update that follows.
    #[tokio::test]
    async fn a_refused_commit_is_answered_with_the_kernels_errno() {
        let (applier, health, rs) = recording_node();
        let update = |generation| Update {
            brain_epoch: 1,
            generation,
            body: Some(Body::Snapshot(rs.clone())),
            ..Update::default()
        };
        applier
            .lock()
            .unwrap()
            .kernel_mut()
            .refuse_next_at(2, 17, "File exists");
        let (ack, outcome) = apply(Work::Update(update(1)), &applier, &health).await;
        assert!(outcome.is_none());
        assert_eq!((ack.generation, ack.ok, ack.errno), (1, false, 17));
        assert_eq!(ack.refused_message, "add table ip splitproxy");
        assert_eq!(ack.kernel_message, "File exists");
        assert!(
            health
                .apply_failing
                .load(std::sync::atomic::Ordering::Relaxed)
        );

        let (ack, outcome) = apply(Work::Update(update(2)), &applier, &health).await;
        assert!(ack.ok, "{}", ack.error);
        assert_eq!((ack.generation, ack.errno), (2, 0));
        assert!(ack.refused_message.is_empty() && ack.kernel_message.is_empty());
        assert_eq!(outcome.unwrap().model, Model::from_ruleset(&rs));
        assert!(
            !health
                .apply_failing
                .load(std::sync::atomic::Ordering::Relaxed)
        );
    }

    fn uris(addresses: &[&str]) -> Vec<Uri> {
        addresses.iter().map(|a| a.parse().unwrap()).collect()
    }

    const THREE: [&str; 3] = [
        "https://brain-0.splitproxy:9443",
        "https://brain-1.splitproxy:9443",
        "https://brain-2.splitproxy:9443",
    ];

    /// A node's order depends on its name and the set of addresses only: not on the order the
    /// addresses were given in, nor on the process (the weights are pinned).
    #[test]
    fn the_order_is_stable() {
        let brains = uris(&THREE);
        let mut reversed = brains.clone();
        reversed.reverse();
        for i in 0..100 {
            let node = format!("node-{i}");
            let order = brain_order(&node, &brains);
            assert_eq!(order, brain_order(&node, &brains));
            assert_eq!(order, brain_order(&node, &reversed));
            let mut sorted = order.clone();
            sorted.sort_by_key(ToString::to_string);
            assert_eq!(sorted, brains, "every address once");
        }
        // Pinned: a change of the weight function would move every node of a running cluster.
        // (FNV-1a 64 then the MurmurHash3 finalizer, computed independently.)
        assert_eq!(
            rendezvous_weight("node-0", "https://a:1/"),
            0x2faa_7426_70e3_d992
        );
    }

    /// 10,000 nodes over 3 addresses: each address is preferred by a third of them, within a
    /// few percent, and each is the second choice of a third of those preferring another.
    #[test]
    fn nodes_spread_evenly() {
        let brains = uris(&THREE);
        let mut first = [0usize; 3];
        let mut second = [[0usize; 3]; 3];
        for i in 0..10_000 {
            let order = brain_order(&format!("node-{i}"), &brains);
            let at = |u: &Uri| brains.iter().position(|b| b == u).unwrap();
            first[at(&order[0])] += 1;
            second[at(&order[0])][at(&order[1])] += 1;
        }
        for (b, n) in first.iter().enumerate() {
            assert!(
                (3_033..=3_633).contains(n),
                "address {b} preferred by {n} of 10,000: {first:?}"
            );
        }
        // Where a replica's nodes go when it fails: evenly to the others.
        for (b, row) in second.iter().enumerate() {
            let others: Vec<usize> = (0..3).filter(|o| *o != b).map(|o| row[o]).collect();
            let (lo, hi) = (others[0].min(others[1]), others[0].max(others[1]));
            assert!(
                (hi - lo) as f64 <= 0.1 * first[b] as f64,
                "nodes of {b} fail over unevenly: {row:?}"
            );
        }
        // Names that differ in one character, and short names, spread too.
        let mut short = [0usize; 3];
        for c in 'a'..='z' {
            for d in 0..10 {
                let order = brain_order(&format!("{c}{d}"), &brains);
                short[brains.iter().position(|b| *b == order[0]).unwrap()] += 1;
            }
        }
        assert!(short.iter().all(|n| *n >= 60), "{short:?}");
    }

    /// Removing an address moves only the nodes that preferred it; the others keep their whole
    /// order (minus the removed address). Adding one back takes only the nodes that prefer it.
    #[test]
    fn removing_an_address_moves_only_its_nodes() {
        let brains = uris(&THREE);
        let without: Vec<Uri> = brains[..2].to_vec();
        let mut moved = 0;
        for i in 0..10_000 {
            let node = format!("node-{i}");
            let full = brain_order(&node, &brains);
            let less = brain_order(&node, &without);
            let kept: Vec<Uri> = full.iter().filter(|b| **b != brains[2]).cloned().collect();
            assert_eq!(less, kept, "{node}: the remaining order is unchanged");
            if full[0] != less[0] {
                assert_eq!(full[0], brains[2], "{node} moved though its replica stayed");
                moved += 1;
            }
        }
        assert!((3_033..=3_633).contains(&moved), "{moved}");
    }

    /// After failures: a random wait up to a doubling backoff (full jitter), capped; after a
    /// healthy stream: a random wait up to the spread, and the backoff starts over.
    #[test]
    fn reconnects_are_jittered() {
        let mut p = Pacing::default();
        assert_eq!(
            p.next_delay(false, 0.999_999),
            BACKOFF_MIN.mul_f64(0.999_999)
        );
        assert_eq!(p.next_delay(false, 0.5), BACKOFF_MIN);
        assert_eq!(p.next_delay(false, 0.0), Duration::ZERO);
        for _ in 0..20 {
            p.next_delay(false, 0.5);
        }
        assert_eq!(p.next_delay(false, 1.0), BACKOFF_MAX, "capped");
        assert_eq!(p.next_delay(true, 0.25), RECONNECT_SPREAD / 4);
        assert_eq!(
            p.next_delay(false, 1.0),
            BACKOFF_MIN,
            "the backoff starts over after a healthy stream"
        );
        // Many nodes losing one replica at once arrive spread over the interval.
        let delays: Vec<Duration> = (0..1_000)
            .map(|_| Pacing::default().next_delay(true, rand::random_range(0.0..1.0)))
            .collect();
        let early = delays
            .iter()
            .filter(|d| **d < RECONNECT_SPREAD / 10)
            .count();
        assert!(early < 200, "{early} of 1,000 in the first tenth");
        assert!(delays.iter().all(|d| *d < RECONNECT_SPREAD));
    }

    /// A delta resumed by content (another replica's, or a restarted brain's: another epoch,
    /// base generation 0) applies only on the content its base digest names.
    #[tokio::test]
    async fn a_delta_by_content_applies_only_on_the_content_it_names() {
        use crate::apply::kernel::Recording;
        use splitproxy_proto::v1::{Ruleset, RulesetDelta, Table};

        let applier = Arc::new(Mutex::new(Applier::new(
            Recording::new(),
            "splitproxy".to_owned(),
        )));
        let health = Arc::new(Health::default());
        let table = |comment: &str| Table {
            family: v1::Family::Ip as i32,
            name: "splitproxy".to_owned(),
            comment: comment.to_owned(),
            ..Table::default()
        };
        let digest = |comment: &str| {
            Model::from_ruleset(&Ruleset {
                tables: vec![table(comment)],
            })
            .digest()
        };
        let snapshot = Update {
            brain_epoch: 1,
            generation: 7,
            body: Some(Body::Snapshot(Ruleset {
                tables: vec![table("a")],
            })),
            digest: digest("a"),
            ..Update::default()
        };
        let (ack, _) = apply(Work::Update(snapshot), &applier, &health).await;
        assert!(ack.ok, "{}", ack.error);

        let delta = |base_digest: Vec<u8>| Update {
            brain_epoch: 2,
            generation: 3,
            base_generation: 0,
            base_digest,
            body: Some(Body::Delta(RulesetDelta {
                upsert: vec![table("b")],
                remove: vec![],
            })),
            digest: digest("b"),
            ..Update::default()
        };
        for wrong in [Vec::new(), digest("c"), vec![0; 16]] {
            let (ack, outcome) = apply(Work::Update(delta(wrong)), &applier, &health).await;
            assert!(!ack.ok && outcome.is_none(), "refused");
            assert!(ack.error.contains("delta on epoch 2"), "{}", ack.error);
        }
        let applied = applier.lock().unwrap().applied().clone();
        assert_eq!((applied.brain_epoch, applied.generation), (1, 7));

        let (ack, outcome) = apply(Work::Update(delta(digest("a"))), &applier, &health).await;
        assert!(ack.ok, "{}", ack.error);
        assert!(outcome.is_some());
        let applied = applier.lock().unwrap().applied().clone();
        assert_eq!(
            (applied.brain_epoch, applied.generation, applied.digest),
            (2, 3, digest("b")),
            "the node now stands on the new brain's generations"
        );
        // Counted as a delta, not a snapshot.
        let m = health.metrics.render();
        assert!(
            m.contains("splitproxy_actuator_deltas_applied_total 1"),
            "{m}"
        );
    }

    /// Network programming latency is recorded for an update that changed the kernel, not for
    /// one whose content the node held already (a reconnect that resends the state with old
    /// trigger times would otherwise report their age).
    #[tokio::test]
    async fn only_an_update_that_changed_the_kernel_reports_programming_latency() {
        let (applier, health, rs) = recording_node();
        let a_minute_ago =
            prost_types::Timestamp::from(SystemTime::now() - Duration::from_secs(60));
        let update = |epoch, generation| Update {
            brain_epoch: epoch,
            generation,
            body: Some(Body::Snapshot(rs.clone())),
            trigger_times: vec![a_minute_ago],
            ..Update::default()
        };
        let samples = |health: &Health| {
            health
                .metrics
                .render()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("kubeproxy_network_programming_duration_seconds_count ")
                })
                .map(str::to_owned)
        };
        let (ack, _) = apply(Work::Update(update(1, 1)), &applier, &health).await;
        assert!(ack.ok, "{}", ack.error);
        assert_eq!(
            samples(&health).as_deref(),
            Some("1"),
            "the first apply programmed"
        );
        // The same content again from another brain (a new epoch): nothing to program.
        let (ack, _) = apply(Work::Update(update(2, 1)), &applier, &health).await;
        assert!(ack.ok, "{}", ack.error);
        assert_eq!(
            samples(&health).as_deref(),
            Some("1"),
            "nothing changed, no sample"
        );
    }

    #[test]
    fn nack_strings_are_bounded() {
        let long = "é".repeat(10_000);
        let e = ApplyError::Kernel(CommitError::Rejected {
            failures: vec![MessageFailure {
                errno: 22,
                message: Some(0),
                description: long.clone(),
                kernel_message: Some(long),
            }],
        });
        let ack = nack(1, &e);
        for s in [&ack.error, &ack.refused_message, &ack.kernel_message] {
            assert!(s.len() <= MAX_ERROR_BYTES, "{}", s.len());
            assert!(s.ends_with(" [...]"));
        }
        assert_eq!(bounded("short".to_owned()), "short");
    }
}
