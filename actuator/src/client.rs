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
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity, Uri};

use crate::after_commit::AfterCommit;
use crate::apply::kernel::Kernel;
use crate::apply::{Applier, ApplyError, Outcome};
use crate::config::TlsFiles;
use crate::health::Health;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Longest error text a NACK carries (each of its strings): a refused 60 KiB element message
/// or a long chain of causes must not make the ack itself a burden (bounded under slow nodes,
/// docs/invariants.md).
pub const MAX_ERROR_BYTES: usize = 4096;

/// What the stream to the brains needs; built from the actuator's
/// [`Config`](crate::config::Config).
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Tried in turn; never empty.
    pub brains: Vec<Uri>,
    pub server_name: Option<String>,
    pub node: String,
    pub tls: TlsFiles,
}

/// Runs forever: one stream at a time, reconnecting with exponential backoff and jitter.
/// `after` runs after every committed update (guarded map entries and conntrack
/// cleanup, health check servers). Returns only when there is no brain to connect to.
pub async fn run<K: Kernel + Send + 'static>(
    config: ClientConfig,
    applier: Arc<Mutex<Applier<K>>>,
    health: Arc<Health>,
    after: Arc<AfterCommit>,
) -> anyhow::Result<()> {
    anyhow::ensure!(!config.brains.is_empty(), "no brain address to connect to");
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

async fn stream_once<K: Kernel + Send + 'static>(
    config: &ClientConfig,
    brain: &Uri,
    applier: &Arc<Mutex<Applier<K>>>,
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
    let _drift = DriftForwarder::start(tx.clone(), health.clone());
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
        let (ack, outcome) = apply(work, applier, health).await;
        let sent = tx
            .send(SyncRequest {
                msg: Some(sync_request::Msg::Ack(ack)),
            })
            .await;
        // The kernel has the new rules whether or not the brain hears of it.
        if let Some(outcome) = outcome {
            after.run(outcome).await;
        }
        sent?;
    }
    Ok(())
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
        Work::Update(u) => (u.generation, u.base_generation == 0),
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

    /// The whole path from a refusing kernel to the answer the brain gets, and the answer to
    /// the update that follows.
    #[tokio::test]
    async fn a_refused_commit_is_answered_with_the_kernels_errno() {
        use crate::apply::kernel::Recording;
        use splitproxy_proto::v1::{Ruleset, Table};

        let applier = Arc::new(Mutex::new(Applier::new(
            Recording::new(),
            "splitproxy".to_owned(),
        )));
        let health = Arc::new(Health::default());
        let rs = Ruleset {
            tables: vec![Table {
                family: v1::Family::Ip as i32,
                name: "splitproxy".to_owned(),
                ..Table::default()
            }],
        };
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
