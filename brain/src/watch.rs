//! One watch per resource on the API server (streaming lists), feeding a single task that owns
//! the index. Nothing is published before every initial list is complete, and a relist swaps the
//! resource in whole when it is done, so nodes never see a half-loaded cluster ("no empty push", docs/invariants.md).
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use splitproxy_proto::model::Model;
use tokio::sync::mpsc;

use crate::desired::Desired;
use crate::fanout::Fanout;
use crate::index::Index;
use crate::metrics::Metrics;
use crate::objects::{self, ObjectKey};
use crate::overlay::Overlays;
use crate::rules::{NodeView, RulesConfig};

/// Boxed: watch events carry whole objects of very different sizes.
enum IndexEvent {
    Service(Box<Event<Service>>),
    Slice(Box<Event<EndpointSlice>>),
    Node(Box<Event<Node>>),
    ServiceCidr(Box<Event<ServiceCIDR>>),
}

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
        IndexEvent::Service,
        fanout.metrics.clone(),
    );
    spawn_watch(
        Api::<EndpointSlice>::all(client.clone()),
        wc.clone(),
        tx.clone(),
        IndexEvent::Slice,
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
            IndexEvent::ServiceCidr,
            fanout.metrics.clone(),
        );
    }
    spawn_watch(
        Api::<Node>::all(client),
        wc,
        tx,
        IndexEvent::Node,
        fanout.metrics.clone(),
    );

    let mut state = IndexState::new(config, fanout.metrics.clone());
    if !with_cidrs {
        state.service_cidr_objects.done();
    }
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
    tx: mpsc::Sender<IndexEvent>,
    wrap: fn(Box<Event<K>>) -> IndexEvent,
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

/// A resource's list state: the index holds the last complete list plus watch events; a relist
/// collects into `buffer` until it is done.
struct ListState<T> {
    synced: bool,
    buffer: Option<Vec<T>>,
}

impl<T> Default for ListState<T> {
    fn default() -> Self {
        ListState {
            synced: false,
            buffer: None,
        }
    }
}

impl<T> ListState<T> {
    fn init(&mut self) {
        self.buffer = Some(Vec::new());
    }
    fn done(&mut self) -> Vec<T> {
        self.synced = true;
        self.buffer.take().unwrap_or_default()
    }
    fn relisting(&self) -> bool {
        self.buffer.is_some()
    }
}

struct IndexState {
    index: Index,
    filter: objects::ServiceFilter,
    config: RulesConfig,
    metrics: Arc<Metrics>,
    services: ListState<(ObjectKey, Arc<objects::ServiceInfo>)>,
    slices: ListState<(ObjectKey, Arc<objects::SliceInfo>)>,
    nodes: ListState<objects::NodeInfo>,
    service_cidr_objects: ListState<(String, Vec<ipnet::IpNet>)>,
    /// CIDRs of the ServiceCIDR objects, by object name.
    cidrs_by_object: HashMap<String, Vec<ipnet::IpNet>>,
    /// `--service-cidr`.
    flag_cidrs: Vec<ipnet::IpNet>,
    /// The desired state per node variant, maintained incrementally.
    desired: HashMap<NodeView, Desired>,
    /// Each node's own elements, maintained incrementally.
    overlays: Overlays,
    /// The overlays as last published.
    published_overlays: imbl::HashMap<String, Arc<Model>>,
    /// Services to recompute at the next publication.
    dirty: HashSet<ObjectKey>,
    /// Nodes whose facts changed since the last publication.
    dirty_nodes: HashSet<String>,
    /// Recompute everything (after a list or relist completes).
    rebuild: bool,
    /// The distinct node views, derived from the Nodes; `None` after a Node change.
    views: Option<HashSet<NodeView>>,
    trigger_times: Vec<prost_types::Timestamp>,
    objects: Vec<String>,
}

impl IndexState {
    fn new(config: RulesConfig, metrics: Arc<Metrics>) -> Self {
        IndexState {
            index: Index::default(),
            filter: objects::ServiceFilter {
                service_cidrs: config.service_cidrs.clone(),
                proxy_name: config.service_proxy_name.clone(),
            },
            config: config.clone(),
            metrics,
            services: ListState::default(),
            slices: ListState::default(),
            nodes: ListState::default(),
            service_cidr_objects: ListState::default(),
            cidrs_by_object: HashMap::new(),
            flag_cidrs: config.service_cidrs.clone(),
            desired: HashMap::new(),
            overlays: Overlays::new(config.clone()),
            published_overlays: imbl::HashMap::new(),
            dirty: HashSet::new(),
            dirty_nodes: HashSet::new(),
            rebuild: false,
            views: None,
            trigger_times: Vec::new(),
            objects: Vec::new(),
        }
    }

    fn handle(&mut self, ev: IndexEvent) {
        match ev {
            IndexEvent::Service(ev) => self.service_event(*ev),
            IndexEvent::Slice(ev) => self.slice_event(*ev),
            IndexEvent::Node(ev) => self.node_event(*ev),
            IndexEvent::ServiceCidr(ev) => self.service_cidr_event(*ev),
        }
    }

    fn service_event(&mut self, ev: Event<Service>) {
        let cidrs = &self.filter;
        match ev {
            Event::Init => self.services.init(),
            Event::InitApply(svc) => {
                if let Some(info) = objects::service(&svc, cidrs, &self.metrics)
                    && let Some(buf) = self.services.buffer.as_mut()
                {
                    buf.push((info.key.clone(), info));
                }
            }
            Event::InitDone => {
                let all = self.services.done();
                tracing::info!(services = all.len(), "services listed");
                self.index.reset_services(all);
                self.rebuild = true;
            }
            Event::Apply(svc) => {
                let key = ObjectKey::of(&svc);
                let info = objects::service(&svc, cidrs, &self.metrics);
                self.index.apply_service(key.clone(), info);
                self.check_ports(&key);
                self.dirty.insert(key.clone());
                self.changed(format!("Service {key}"), None);
            }
            Event::Delete(svc) => {
                let key = ObjectKey::of(&svc);
                self.index.apply_service(key.clone(), None);
                self.dirty.insert(key.clone());
                self.changed(format!("Service {key}"), None);
            }
        }
    }

    fn slice_event(&mut self, ev: Event<EndpointSlice>) {
        match ev {
            Event::Init => self.slices.init(),
            Event::InitApply(s) => {
                if let Some(info) = objects::slice(&s, &self.metrics)
                    && let Some(buf) = self.slices.buffer.as_mut()
                {
                    buf.push((info.key.clone(), info));
                }
            }
            Event::InitDone => {
                let all = self.slices.done();
                tracing::info!(slices = all.len(), "endpoint slices listed");
                self.index.reset_slices(all);
                self.rebuild = true;
            }
            Event::Apply(s) => {
                let key = ObjectKey::of(&s);
                let info = objects::slice(&s, &self.metrics);
                let trigger = info.as_ref().and_then(|i| i.trigger_time);
                let service = info.as_ref().map(|i| i.service.clone());
                let before = self.index.apply_slice(key.clone(), info);
                self.dirty.extend(before);
                if let Some(svc) = service {
                    self.check_ports(&svc);
                    self.dirty.insert(svc);
                }
                self.changed(format!("EndpointSlice {key}"), trigger);
            }
            Event::Delete(s) => {
                let key = ObjectKey::of(&s);
                let before = self.index.apply_slice(key.clone(), None);
                self.dirty.extend(before);
                self.changed(format!("EndpointSlice {key}"), None);
            }
        }
    }

    fn node_event(&mut self, ev: Event<Node>) {
        match ev {
            Event::Init => self.nodes.init(),
            Event::InitApply(n) => {
                if let Some(buf) = self.nodes.buffer.as_mut() {
                    buf.push(objects::node(&n));
                }
            }
            Event::InitDone => {
                let all = self.nodes.done();
                tracing::info!(nodes = all.len(), "nodes listed");
                self.index.reset_nodes(all);
                self.views = None;
                self.rebuild = true;
            }
            Event::Apply(n) => {
                // Nodes report status often; only a change of what the rules use (addresses,
                // zone, pod CIDRs) recomputes anything.
                let info = objects::node(&n);
                if self.index.node(&info.name) == Some(&info) {
                    return;
                }
                self.dirty_nodes.insert(info.name.clone());
                self.changed(format!("Node {}", info.name), None);
                self.index.apply_node(info.name.clone(), Some(info));
                self.views = None;
            }
            Event::Delete(n) => {
                let name = kube::ResourceExt::name_any(&n);
                self.index.apply_node(name.clone(), None);
                self.dirty_nodes.insert(name.clone());
                self.changed(format!("Node {name}"), None);
                self.views = None;
            }
        }
    }

    fn changed(&mut self, object: String, trigger: Option<k8s_openapi::jiff::Timestamp>) {
        self.objects.push(object);
        let t = trigger.unwrap_or_else(k8s_openapi::jiff::Timestamp::now);
        self.trigger_times.push(prost_types::Timestamp {
            seconds: t.as_second(),
            nanos: t.subsec_nanosecond(),
        });
    }

    /// Logs and counts Service ports that a slice of the Service cannot serve: the slice has no
    /// port of that name and protocol, so it contributes no endpoints to it.
    fn check_ports(&self, service: &ObjectKey) {
        let Some(svc) = self.index.service(service) else {
            return;
        };
        for slice in self.index.slices_of(service) {
            for port in &svc.ports {
                if !slice
                    .ports
                    .iter()
                    .any(|p| p.name == port.name && p.protocol == port.protocol)
                {
                    self.metrics
                        .invalid(objects::InvalidReason::NoMatchingServicePort);
                    tracing::warn!(service = %service, slice = %slice.key, port = %port.name,
                        protocol = port.protocol.name(), "slice has no port matching the Service port; skipped for it");
                }
            }
        }
    }

    fn service_cidr_event(&mut self, ev: Event<ServiceCIDR>) {
        let reduce = |o: &ServiceCIDR| {
            let cidrs = o
                .spec
                .as_ref()
                .and_then(|s| s.cidrs.as_ref())
                .into_iter()
                .flatten()
                .filter_map(|c| c.parse::<ipnet::IpNet>().ok())
                .collect::<Vec<_>>();
            (kube::ResourceExt::name_any(o), cidrs)
        };
        match ev {
            Event::Init => self.service_cidr_objects.init(),
            Event::InitApply(o) => {
                if let Some(buf) = self.service_cidr_objects.buffer.as_mut() {
                    buf.push(reduce(&o));
                }
            }
            Event::InitDone => {
                let all = self.service_cidr_objects.done();
                self.cidrs_by_object = all.into_iter().collect();
                self.apply_service_cidrs();
            }
            Event::Apply(o) => {
                let (name, cidrs) = reduce(&o);
                self.cidrs_by_object.insert(name, cidrs);
                self.apply_service_cidrs();
            }
            Event::Delete(o) => {
                self.cidrs_by_object
                    .remove(&kube::ResourceExt::name_any(&o));
                self.apply_service_cidrs();
            }
        }
    }

    /// The service CIDRs are `--service-cidr` plus every ServiceCIDR object's. When they change
    /// (rare: a cluster growing its service range) every node's rules are rebuilt.
    fn apply_service_cidrs(&mut self) {
        let mut cidrs = self.flag_cidrs.clone();
        for c in self.cidrs_by_object.values().flatten() {
            if !cidrs.contains(c) {
                cidrs.push(*c);
            }
        }
        cidrs.sort();
        if cidrs == self.config.service_cidrs {
            return;
        }
        tracing::info!(?cidrs, "service CIDRs changed");
        self.config.service_cidrs = cidrs.clone();
        self.filter.service_cidrs = cidrs;
        self.desired.clear();
        self.overlays = Overlays::new(self.config.clone());
        self.published_overlays = imbl::HashMap::new();
        self.views = None;
        self.rebuild = true;
    }

    fn synced(&self) -> bool {
        let all = self.services.synced
            && self.slices.synced
            && self.nodes.synced
            && self.service_cidr_objects.synced;
        all && !self.services.relisting()
            && !self.slices.relisting()
            && !self.nodes.relisting()
            && !self.service_cidr_objects.relisting()
    }

    /// Recomputes and publishes if anything changed; true when it did.
    fn publish(&mut self, fanout: &Fanout) -> bool {
        let synced = self.synced();
        if synced != fanout.synced() && !synced {
            tracing::warn!("relisting: holding the last complete state until the list is done");
            fanout.set_synced(false);
        }
        if !synced || (!self.rebuild && self.dirty.is_empty() && self.dirty_nodes.is_empty()) {
            return false;
        }
        let start = Instant::now();
        // Node views change only with Nodes: derive them then, not on every publication.
        let views = self
            .views
            .get_or_insert_with(|| {
                let index = &self.index;
                index
                    .nodes()
                    .map(|n| fanout.view_of(&n.name))
                    .chain([NodeView::default()])
                    .collect()
            })
            .clone();
        self.desired.retain(|v, _| views.contains(v));
        let mut variants: HashMap<NodeView, Arc<Model>> = HashMap::new();
        for view in views {
            let d = match self.desired.entry(view.clone()) {
                std::collections::hash_map::Entry::Occupied(e) => {
                    let d = e.into_mut();
                    if self.rebuild {
                        d.rebuild(&self.index);
                    } else {
                        d.update(&self.index, self.dirty.iter());
                    }
                    d
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    let d = e.insert(Desired::new(self.config.clone(), view.clone()));
                    d.rebuild(&self.index);
                    d
                }
            };
            variants.insert(view, Arc::new(d.model().clone()));
        }
        // Overlays extend the one shared variant (all nodes share a view today).
        if let Some(d) = self.desired.get_mut(&NodeView::default()) {
            if self.rebuild {
                self.overlays.rebuild(&self.index, d);
            } else {
                self.overlays
                    .update(&self.index, d, self.dirty.iter(), self.dirty_nodes.iter());
            }
            d.prune();
            // Overlays may have created or dropped dynamic sets in the shared model.
            variants.insert(NodeView::default(), Arc::new(d.model().clone()));
            for (node, model) in self.overlays.changed_models() {
                match model {
                    Some(m) => {
                        self.published_overlays.insert(node, m);
                    }
                    None => {
                        self.published_overlays.remove(&node);
                    }
                }
            }
        }
        let took = start.elapsed();
        self.metrics.observe_compute(took);
        tracing::debug!(
            ?took,
            services = self.dirty.len(),
            rebuild = self.rebuild,
            "recomputed desired state"
        );
        self.dirty.clear();
        self.dirty_nodes.clear();
        self.rebuild = false;
        fanout.publish(
            variants,
            self.published_overlays.clone(),
            std::mem::take(&mut self.trigger_times),
            std::mem::take(&mut self.objects),
        );
        if !fanout.synced() {
            tracing::info!("every initial list is complete; serving nodes");
            fanout.set_synced(true);
        }
        true
    }
}
