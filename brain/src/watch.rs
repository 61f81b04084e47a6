//! One watch per resource on the API server (streaming lists), feeding a single task that owns
//! the [`Indexer`], and the pacing of its publications. What the events do to the index and
//! when a publication may go out (never before every list is complete: "no empty push",
//! docs/invariants.md) is the indexer's ([`crate::index`]).
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::mpsc;

use crate::fanout::Fanout;
use crate::index::{Indexer, WatchEvent};
use crate::metrics::Metrics;
use crate::rules::RulesConfig;

/// Watches Services, EndpointSlices and Nodes and keeps `fanout` published until the watches
/// end (they retry with backoff, so only on shutdown).
pub async fn run(
    client: Client,
    config: RulesConfig,
    fanout: Arc<Fanout>,
    streaming: bool,
    min_interval: std::time::Duration,
) {
    let (tx, mut rx) = mpsc::channel(4096);
    let wc = if streaming {
        watcher::Config::default().streaming_lists()
    } else {
        watcher::Config::default()
    };
    spawn_watch(
        Api::<Service>::all(client.clone()),
        wc.clone(),
        tx.clone(),
        WatchEvent::Service,
        fanout.metrics.clone(),
    );
    spawn_watch(
        Api::<EndpointSlice>::all(client.clone()),
        wc.clone(),
        tx.clone(),
        WatchEvent::Slice,
        fanout.metrics.clone(),
    );
    // With --service-cidr the operator's ranges are authoritative. Without it the service
    // CIDRs are the ServiceCIDR objects' (networking.k8s.io/v1), as kube-proxy's nftables mode
    // reads them; an API server that does not serve them (before Kubernetes 1.33) must not hold
    // the brain unsynced forever.
    let cidr_api = Api::<ServiceCIDR>::all(client.clone());
    let with_cidrs = config.service_cidrs.is_empty()
        && match cidr_api
            .list(&kube::api::ListParams::default().limit(1))
            .await
        {
            Ok(_) => true,
            Err(kube::Error::Api(e)) if e.code == 404 => {
                tracing::info!("the API server serves no ServiceCIDRs and --service-cidr is unset");
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "listing ServiceCIDRs failed; watching them anyway");
                true
            }
        };
    if with_cidrs {
        spawn_watch(
            cidr_api,
            wc.clone(),
            tx.clone(),
            WatchEvent::ServiceCidr,
            fanout.metrics.clone(),
        );
    }
    spawn_watch(
        Api::<Node>::all(client),
        wc,
        tx,
        WatchEvent::Node,
        fanout.metrics.clone(),
    );

    let mut state = Indexer::new(config, fanout.metrics.clone(), with_cidrs);
    let mut last_publish: Option<tokio::time::Instant> = None;
    while let Some(ev) = rx.recv().await {
        state.handle(ev);
        // Publications are at least `min_interval` apart (kube-proxy's min sync period has the
        // same purpose): every publication costs one update per node, so under churn the events
        // of an interval are folded into one publication instead of thousands of streams each
        // chasing every event.
        if let Some(at) = last_publish {
            let deadline = at + min_interval;
            while let Ok(Some(ev)) = tokio::time::timeout_at(deadline, rx.recv()).await {
                state.handle(ev);
            }
        }
        // Fold in whatever else is already queued before recomputing.
        while let Ok(ev) = rx.try_recv() {
            state.handle(ev);
        }
        if state.publish(&fanout) {
            last_publish = Some(tokio::time::Instant::now());
        }
    }
}

fn spawn_watch<K>(
    api: Api<K>,
    wc: watcher::Config,
    tx: mpsc::Sender<WatchEvent>,
    wrap: fn(Box<Event<K>>) -> WatchEvent,
    metrics: Arc<Metrics>,
) where
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
    tokio::spawn(async move {
        let mut stream = watcher::watcher(api, wc).default_backoff().boxed();
        while let Some(item) = stream.next().await {
            match item {
                Ok(ev) => {
                    if tx.send(wrap(Box::new(ev))).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    metrics
                        .relists
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(%kind, error = %e, "watch failed; retrying with backoff");
                }
            }
        }
    });
}
