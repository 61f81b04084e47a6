//! The actuator's stream to a brain: connect over mTLS to one of several brains, say what is
//! applied, apply every update and answer it. When the stream breaks, back off and try the next
//! brain; the kernel keeps the last applied rules meanwhile (fail static, docs/invariants.md).
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::Context;
use splitproxy_proto::model::Model;
use splitproxy_proto::transport;
use splitproxy_proto::v1::dataplane_client::DataplaneClient;
use splitproxy_proto::v1::{self, Ack, Hello, SyncRequest, Update, sync_request, update::Body};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::after_commit::AfterCommit;
use crate::apply::Applier;
use crate::health::Health;
use crate::{conntrack, guards};

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

pub struct ClientConfig {
    pub brains: Vec<String>,
    pub server_name: Option<String>,
    pub node: String,
    /// Read again at every connection, so rotated certificates are picked up without a
    /// restart (and a file caught mid-rewrite heals on the next attempt).
    pub ca: std::path::PathBuf,
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

/// Runs forever: one stream at a time, reconnecting with exponential backoff and jitter.
/// `after` runs after every committed update (guarded map entries and conntrack
/// cleanup, health check servers).
pub async fn run(
    config: ClientConfig,
    applier: Arc<Mutex<Applier>>,
    health: Arc<Health>,
    after: Arc<AfterCommit>,
) {
    let mut backoff = BACKOFF_MIN;
    let mut attempt = 0usize;
    loop {
        let brain = &config.brains[attempt % config.brains.len()];
        attempt += 1;
        let started = std::time::Instant::now();
        match stream_once(&config, brain, &applier, &health, &after).await {
            Ok(()) => tracing::info!(%brain, "brain closed the stream"),
            Err(e) => tracing::warn!(%brain, error = format!("{e:#}"), "stream to brain failed"),
        }
        health.metrics.set_connected(false);
        if started.elapsed() > Duration::from_secs(30) {
            backoff = BACKOFF_MIN; // the stream was healthy for a while: start over
        }
        let jitter = rand::random_range(0.0..0.5) * backoff.as_secs_f64();
        tokio::time::sleep(backoff + Duration::from_secs_f64(jitter)).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

fn read(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    anyhow::ensure!(!pem.is_empty(), "{} is empty", path.display());
    Ok(pem)
}

async fn connect(config: &ClientConfig, brain: &str) -> anyhow::Result<Channel> {
    let uri: tonic::transport::Uri = brain
        .parse()
        .with_context(|| format!("brain address {brain:?}"))?;
    let domain = config
        .server_name
        .clone()
        .or_else(|| uri.host().map(|h| h.trim_matches(['[', ']']).to_string()))
        .unwrap_or_default();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(&config.ca)?))
        .identity(Identity::from_pem(read(&config.cert)?, read(&config.key)?))
        .domain_name(domain);
    Ok(Channel::builder(uri)
        .tls_config(tls)?
        .connect_timeout(transport::CONNECT_TIMEOUT)
        .http2_keep_alive_interval(transport::KEEPALIVE_INTERVAL)
        .keep_alive_timeout(transport::KEEPALIVE_TIMEOUT)
        .connect()
        .await?)
}

async fn stream_once(
    config: &ClientConfig,
    brain: &str,
    applier: &Arc<Mutex<Applier>>,
    health: &Arc<Health>,
    after: &AfterCommit,
) -> anyhow::Result<()> {
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
    health.metrics.set_connected(true);
    // Parts of one update (same generation, `more` on all but the last) are applied as one
    // transaction. Snapshot parts are folded into a model as they arrive, so a node never holds
    // a whole decoded snapshot; delta parts (small) are joined.
    let mut pending: Option<Pending> = None;
    while let Some(update) = updates.next().await {
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
            (None, deltas) => Work::Update(Update {
                body: Some(splitproxy_proto::parts::join(deltas)?),
                ..p.meta
            }),
            _ => anyhow::bail!("update mixes snapshot and delta parts"),
        };
        let (ack, committed) = apply(work, applier, health).await;
        let sent = tx
            .send(SyncRequest {
                msg: Some(sync_request::Msg::Ack(ack)),
            })
            .await;
        // The kernel has the new rules whether or not the brain hears of it.
        if let Some(c) = committed {
            after.run(c.stale, c.guarded, &c.model).await;
        }
        sent?;
    }
    Ok(())
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

/// What a committed update leaves for [`AfterCommit`].
struct Committed {
    stale: conntrack::Plan,
    guarded: guards::Plan,
    /// The applied model (a cheap clone: versions share structure).
    model: Model,
}

/// Applies one update off the async runtime (netlink is blocking) and builds its answer, and,
/// when it committed, what follows.
async fn apply(
    work: Work,
    applier: &Arc<Mutex<Applier>>,
    health: &Arc<Health>,
) -> (Ack, Option<Committed>) {
    let (generation, snapshot) = match &work {
        Work::Update(u) => (u.generation, u.base_generation == 0),
        Work::Snapshot(u, _) => (u.generation, true),
    };
    let applier = applier.clone();
    let (update, result) = tokio::task::spawn_blocking(move || {
        let Ok(mut a) = applier.lock() else {
            let e = crate::apply::ApplyError::Kernel("applier poisoned".into());
            return (Update::default(), Err(e));
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
        let result = result.map(|took| {
            let committed = Committed {
                stale: a.take_stale_conntrack(),
                guarded: a.take_stale_guarded(),
                model: a.model().clone(),
            };
            (took, a.model().element_count(), committed)
        });
        (update, result)
    })
    .await
    .unwrap_or_else(|e| {
        (
            Update::default(),
            Err(crate::apply::ApplyError::Kernel(e.to_string())),
        )
    });
    match result {
        Ok((took, elements, committed)) => {
            health.metrics.applied(generation, took, snapshot, elements);
            health
                .ready
                .store(true, std::sync::atomic::Ordering::Relaxed);
            health
                .apply_failing
                .store(false, std::sync::atomic::Ordering::Relaxed);
            let now = SystemTime::now();
            for t in &update.trigger_times {
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
                error: String::new(),
                apply_duration: took.try_into().ok(),
            };
            (ack, Some(committed))
        }
        Err(e) => {
            health.metrics.apply_failed();
            health
                .apply_failing
                .store(true, std::sync::atomic::Ordering::Relaxed);
            tracing::error!(generation, snapshot, error = %e, "update failed; previous rules stay in place");
            let ack = Ack {
                generation,
                ok: false,
                error: e.to_string(),
                apply_duration: None,
            };
            (ack, None)
        }
    }
}
