//! One watch per resource on the API server (streaming lists), feeding a single task that owns
//! the [`Indexer`] and publishes, spaced as [`crate::pacing`] says. What the events do to the
//! index and whether a publication may go out at all (never before every list is complete: "no
//! empty push", docs/invariants.md) is the indexer's ([`crate::index`]).
//!
//! The same task keeps the brain's freshness ([`crate::freshness`], "never silently stale"):
//! every watch event and every answer to the periodic probe is a contact with the API server.
//! When the probe answers again after failing, every watch is restarted on new connections: a
//! watch whose connection was blackholed may never fail by itself, and one that backed off
//! during an outage would wait out its backoff. The restarted watches relist, and the brain
//! serves again when their lists are complete.
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::fanout::Fanout;
use crate::freshness::{Freshness, RESTART_AFTER_FAILED_PROBES};
use crate::index::{Indexer, WatchEvent};
use crate::metrics::Metrics;
use crate::pacing::Pacing;
use crate::rules::RulesConfig;
use crate::service_view::{ServiceQuery, ServiceView};

/// The API server ends each watch request after this long and the watch resumes from where it
/// was (no relist). kube-runtime also gives up on a watch silent for this long plus 5 s, so a
/// watch connection that died without an error while the probe still answers (a middlebox that
/// lost its state) is replaced within about a minute, not the default five.
const WATCH_TIMEOUT_SECS: u32 = 60;

/// What the watch task is told.
enum Input {
    /// An event of the watches of this generation (events of replaced watches are dropped).
    Event(u64, WatchEvent),
    /// The probe's outcome: answered, or the error.
    Probe(Result<(), String>),
    /// An operator's question about one Service (`GetService`).
    Query(ServiceQuery),
}

/// How the watches run.
pub struct WatchOptions {
    pub streaming_lists: bool,
    /// How publications are spaced.
    pub pacing: Pacing,
    /// How often the API server is probed.
    pub probe_interval: Duration,
    /// Questions about one Service (`GetService`), answered between events from the index.
    pub queries: Option<mpsc::Receiver<ServiceQuery>>,
}

/// Watches Services, EndpointSlices, Nodes (and ServiceCIDRs) with clients built from
/// `kube_config`, and keeps `fanout` published and `freshness` up to date until the brain
/// stops (the watches retry with backoff, and restart after an outage).
pub async fn run(
    kube_config: kube::Config,
    config: RulesConfig,
    fanout: Arc<Fanout>,
    freshness: Arc<Freshness>,
    mut options: WatchOptions,
) {
    let client = match Client::try_from(kube_config.clone()) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot create the API client");
            return;
        }
    };
    let (tx, mut rx) = mpsc::channel(4096);
    if let Some(mut queries) = options.queries.take() {
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some(q) = queries.recv().await {
                if tx.send(Input::Query(q)).await.is_err() {
                    break;
                }
            }
        });
    }
    let mut wc = watcher::Config::default().timeout(WATCH_TIMEOUT_SECS);
    if options.streaming_lists {
        wc = wc.streaming_lists();
    }
    let with_cidrs = config.service_cidrs.is_empty() && serves_service_cidrs(&client).await;
    let mut watches = Watches {
        kube_config: kube_config.clone(),
        wc,
        with_cidrs,
        tx: tx.clone(),
        metrics: fanout.metrics.clone(),
        generation: 0,
        tasks: Vec::new(),
    };
    watches.start(client);
    tokio::spawn(probe(
        kube_config,
        options.probe_interval,
        tx,
        fanout.metrics.clone(),
    ));

    let mut state = Runner {
        indexer: Indexer::new(config, fanout.metrics.clone(), with_cidrs),
        watches,
        fanout: fanout.clone(),
        freshness,
        failed_probes: 0,
    };
    let mut last_publish: Option<tokio::time::Instant> = None;
    while let Some(input) = rx.recv().await {
        state.handle(input);
        // Publications are spaced ([`crate::pacing`]): under churn the events of a while are
        // folded into one publication; after a quiet period a change goes out at once.
        if let Some(at) = last_publish {
            let unsettled = || fanout.newest_unsettled_share();
            if !options
                .pacing
                .hold(at, &mut rx, unsettled, |i| state.handle(i))
                .await
            {
                break;
            }
        }
        // Fold in whatever else is already queued before recomputing.
        while let Ok(input) = rx.try_recv() {
            state.handle(input);
        }
        if state.indexer.publish(&fanout) {
            last_publish = Some(tokio::time::Instant::now());
        }
    }
}

/// With --service-cidr the operator's ranges are authoritative. Without it the service CIDRs
/// are the ServiceCIDR objects' (networking.k8s.io/v1), as kube-proxy's nftables mode reads
/// them; an API server that does not serve them (before Kubernetes 1.33) must not hold the
/// brain unsynced forever.
/// Bounded, so that an unreachable API server cannot keep the watches (and the probe) from
/// starting.
async fn serves_service_cidrs(client: &Client) -> bool {
    let list = Api::<ServiceCIDR>::all(client.clone());
    let params = kube::api::ListParams::default().limit(1);
    match tokio::time::timeout(Duration::from_secs(10), list.list(&params)).await {
        Ok(Ok(_)) => true,
        Ok(Err(kube::Error::Api(e))) if e.code == 404 => {
            tracing::info!("the API server serves no ServiceCIDRs and --service-cidr is unset");
            false
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "listing ServiceCIDRs failed; watching them anyway");
            true
        }
        Err(_) => {
            tracing::warn!("listing ServiceCIDRs got no answer within 10 s; watching them anyway");
            true
        }
    }
}

/// The watch task's state: the index, the watches, and the probe's recent outcomes.
struct Runner {
    indexer: Indexer,
    watches: Watches,
    fanout: Arc<Fanout>,
    freshness: Arc<Freshness>,
    /// Probes failed in a row.
    failed_probes: u32,
}

impl Runner {
    fn handle(&mut self, input: Input) {
        match input {
            Input::Event(generation, ev) => {
                if generation != self.watches.generation {
                    return; // from a watch that was replaced
                }
                if is_contact(&ev) {
                    self.freshness.contact();
                }
                self.indexer.handle(ev);
            }
            Input::Probe(Ok(())) => {
                if self.failed_probes >= RESTART_AFTER_FAILED_PROBES {
                    tracing::info!(
                        failed_probes = self.failed_probes,
                        "the API server answers again: restarting every watch on new connections"
                    );
                    // Unsynced first, then the contact: a brain whose view is current again
                    // serves only once the new lists are complete ("no empty push").
                    self.indexer.relist_all();
                    self.indexer.publish(&self.fanout);
                    self.watches.restart();
                } else if self.failed_probes > 0 {
                    tracing::info!("the API server answers again");
                }
                self.failed_probes = 0;
                self.freshness.contact();
            }
            Input::Query(q) => {
                let view = ServiceView::of(self.indexer.index(), &q);
                let _ = q.reply.send(view);
            }
            Input::Probe(Err(e)) => {
                self.failed_probes = self.failed_probes.saturating_add(1);
                if self.failed_probes == 1 {
                    tracing::warn!(error = %e, "the API server did not answer the probe");
                } else {
                    tracing::debug!(error = %e, failed = self.failed_probes, "probe failed again");
                }
            }
        }
    }
}

/// Whether an event proves the API server answered: everything but `Init`, which a paged list
/// announces before asking anything.
fn is_contact(ev: &WatchEvent) -> bool {
    fn data<K>(e: &Event<K>) -> bool {
        !matches!(e, Event::Init)
    }
    match ev {
        WatchEvent::Service(e) => data(e),
        WatchEvent::Slice(e) => data(e),
        WatchEvent::Node(e) => data(e),
        WatchEvent::ServiceCidr(e) => data(e),
    }
}

/// The running watches, one task per resource, and how to start them over.
struct Watches {
    kube_config: kube::Config,
    wc: watcher::Config,
    with_cidrs: bool,
    tx: mpsc::Sender<Input>,
    metrics: Arc<Metrics>,
    /// Grows with every (re)start; tags the events of the watches it started.
    generation: u64,
    tasks: Vec<JoinHandle<()>>,
}

impl Watches {
    fn start(&mut self, client: Client) {
        self.generation += 1;
        let g = self.generation;
        let (wc, tx, m) = (&self.wc, &self.tx, &self.metrics);
        self.tasks = vec![
            spawn_watch(
                Api::<Service>::all(client.clone()),
                wc,
                tx,
                g,
                WatchEvent::Service,
                m,
            ),
            spawn_watch(
                Api::<EndpointSlice>::all(client.clone()),
                wc,
                tx,
                g,
                WatchEvent::Slice,
                m,
            ),
            spawn_watch(
                Api::<Node>::all(client.clone()),
                wc,
                tx,
                g,
                WatchEvent::Node,
                m,
            ),
        ];
        if self.with_cidrs {
            self.tasks.push(spawn_watch(
                Api::<ServiceCIDR>::all(client),
                wc,
                tx,
                g,
                WatchEvent::ServiceCidr,
                m,
            ));
        }
    }

    /// Stops every watch and starts new ones with a new client, so that no connection of the
    /// old ones (possibly blackholed, never to fail) is reused.
    fn restart(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        self.metrics
            .watch_restarts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match Client::try_from(self.kube_config.clone()) {
            Ok(client) => self.start(client),
            Err(e) => tracing::error!(error = %e, "cannot create an API client for the watches"),
        }
    }
}

fn spawn_watch<K>(
    api: Api<K>,
    wc: &watcher::Config,
    tx: &mpsc::Sender<Input>,
    generation: u64,
    wrap: fn(Box<Event<K>>) -> WatchEvent,
    metrics: &Arc<Metrics>,
) -> JoinHandle<()>
where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let (wc, tx, metrics) = (wc.clone(), tx.clone(), metrics.clone());
    tokio::spawn(async move {
        let mut stream = watcher::watcher(api, wc).boxed();
        let mut backoff = Backoff::default();
        while let Some(item) = stream.next().await {
            match item {
                Ok(ev) => {
                    if !matches!(ev, Event::Init) {
                        backoff.reset();
                    }
                    if tx
                        .send(Input::Event(generation, wrap(Box::new(ev))))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                Err(e) => {
                    metrics
                        .relists
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let wait = backoff.next_wait();
                    tracing::warn!(%kind, error = %e, wait_ms = wait.as_millis() as u64, "watch failed; retrying");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    })
}

/// Probes the API server (`GET /version`) every `interval` (eight times as often while it does
/// not answer), each probe bounded by `interval`, and reports every outcome. After a failure
/// the next probe uses a new client: a blackholed connection kept in the old one's pool must
/// not fail the probes after the path is back.
async fn probe(
    kube_config: kube::Config,
    interval: Duration,
    tx: mpsc::Sender<Input>,
    metrics: Arc<Metrics>,
) {
    let interval = interval.max(Duration::from_millis(100));
    let mut client: Option<Client> = None;
    loop {
        let c = match client.take() {
            Some(c) => c,
            None => match Client::try_from(kube_config.clone()) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "cannot create an API client for the probe");
                    return;
                }
            },
        };
        let outcome = match tokio::time::timeout(interval, c.apiserver_version()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {interval:?}")),
        };
        let answered = outcome.is_ok();
        if answered {
            client = Some(c);
        } else {
            metrics
                .api_probe_failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if tx.send(Input::Probe(outcome)).await.is_err() {
            return;
        }
        tokio::time::sleep(if answered { interval } else { interval / 8 }).await;
    }
}

/// A watch's retry backoff: 100 ms doubling to 5 s, with up to 50 % jitter, back to 100 ms as
/// soon as the API server answers (any event but `Init`). kube-runtime's default (800 ms to
/// 30 s, reset only after 120 s without errors) let an API server restart cost 8 to 28 s of
/// staleness.
#[derive(Debug)]
struct Backoff {
    next: Duration,
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next: BACKOFF_MIN }
    }
}

impl Backoff {
    fn reset(&mut self) {
        self.next = BACKOFF_MIN;
    }

    /// The wait before the next attempt (jittered), doubling the one after it.
    fn next_wait(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(BACKOFF_MAX);
        base.mul_f64(1.0 + rand::random_range(0.0..0.5))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_bound_and_resets() {
        let mut b = Backoff::default();
        let waits: Vec<Duration> = (0..10).map(|_| b.next_wait()).collect();
        for (i, w) in waits.iter().enumerate() {
            let base = (BACKOFF_MIN * 2u32.pow(i as u32)).min(BACKOFF_MAX);
            assert!(*w >= base && *w <= base.mul_f64(1.5), "wait {i}: {w:?}");
        }
        assert!(waits[9] <= BACKOFF_MAX.mul_f64(1.5), "bounded");
        b.reset();
        assert!(b.next_wait() <= BACKOFF_MIN.mul_f64(1.5), "reset");
    }

    #[test]
    fn init_is_no_contact() {
        assert!(!is_contact(&WatchEvent::Service(Box::new(Event::Init))));
        assert!(is_contact(&WatchEvent::Service(Box::new(Event::InitDone))));
    }
}
