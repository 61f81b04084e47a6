//! The index state machine: watch events in, publications out.
//!
//! Driven by plain [`kube::runtime::watcher::Event`] values of Services, EndpointSlices, Nodes
//! and ServiceCIDRs, so it runs (and is tested) without an API server; [`crate::watch`] only
//! feeds it and paces [`Indexer::publish`].
//!
//! Nothing is published before every initial list is complete, and a relist swaps its resource
//! in whole when it is done: meanwhile the brain reports itself unsynced and nodes keep the last
//! complete state, so they never see a half-loaded cluster ("no empty push",
//! docs/invariants.md). Between lists, each change marks what it touches (a Service, the
//! Services of a slice before and after, a Node), and a publication recomputes only that
//! ("cost follows the change").
use std::sync::Arc;
use std::time::Instant;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::watcher::Event;

use super::Index;
use super::listing::Listing;
use crate::api_state::{ApiState, Resource};
use crate::desired::SharedRuleset;
use crate::fanout::Fanout;
use crate::metrics::Metrics;
use crate::objects::{self, ObjectKey};
use crate::overlay::{NodeOverlays, Overlays};
use crate::rules::RulesConfig;
use crate::trace::{self, Change};

/// One watch event of a resource the index follows. Boxed: events carry whole objects of very
/// different sizes.
#[derive(Debug)]
pub enum WatchEvent {
    Service(Box<Event<Service>>),
    Slice(Box<Event<EndpointSlice>>),
    Node(Box<Event<Node>>),
    ServiceCidr(Box<Event<ServiceCIDR>>),
}

/// Folds watch events into the [`Index`] and turns it into publications of a [`Fanout`].
pub struct Indexer {
    index: Index,
    filter: objects::ServiceFilter,
    config: RulesConfig,
    metrics: Arc<Metrics>,
    services: Listing<(ObjectKey, Arc<objects::ServiceInfo>)>,
    slices: Listing<(ObjectKey, Arc<objects::SliceInfo>)>,
    nodes: Listing<objects::NodeInfo>,
    service_cidr_objects: Listing<(String, Vec<ipnet::IpNet>)>,
    /// Whether ServiceCIDR objects are watched (their list gates publication).
    watch_service_cidrs: bool,
    /// CIDRs of the ServiceCIDR objects, by object name.
    cidrs_by_object: HashMap<String, Vec<ipnet::IpNet>>,
    /// `--service-cidr`.
    flag_cidrs: Vec<ipnet::IpNet>,
    /// The ruleset every node shares, maintained incrementally; `None` until the first
    /// publication and after the service CIDRs change (then it is built anew).
    shared: Option<SharedRuleset>,
    /// Each node's own elements, maintained incrementally.
    overlays: Overlays,
    /// The overlays as last published.
    published_overlays: NodeOverlays,
    /// Services to recompute at the next publication.
    dirty: HashSet<ObjectKey>,
    /// Nodes whose facts changed since the last publication.
    dirty_nodes: HashSet<String>,
    /// Recompute everything (after a list or relist completes).
    rebuild: bool,
    /// Trigger times and names of the objects changed since the last publication.
    trigger_times: Vec<prost_types::Timestamp>,
    objects: Vec<String>,
    /// When the brain saw each of those changes: the publication observes how long each waited
    /// in the brain (`splitproxy_brain_change_queue_seconds`).
    seen: Vec<Instant>,
    /// The sampled traces of those changes (crate::trace), at most [`trace::MAX_LINKS`]: the
    /// next publication continues them.
    traces: Vec<opentelemetry::trace::SpanContext>,
    /// Where the folded events stand in each watch stream, published with the state
    /// (crate::api_state): every event counts, also one that changed nothing.
    api: ApiState,
    /// The same for the lists under way.
    listing: ApiState,
}

impl Indexer {
    /// `watch_service_cidrs`: whether ServiceCIDR objects are watched, so that their initial
    /// list gates publication like the others'.
    pub fn new(config: RulesConfig, metrics: Arc<Metrics>, watch_service_cidrs: bool) -> Self {
        let mut service_cidr_objects = Listing::default();
        if !watch_service_cidrs {
            service_cidr_objects.finish();
        }
        Indexer {
            index: Index::default(),
            filter: objects::ServiceFilter {
                proxy_name: config.service_proxy_name.clone(),
            },
            config: config.clone(),
            metrics,
            services: Listing::default(),
            slices: Listing::default(),
            nodes: Listing::default(),
            service_cidr_objects,
            watch_service_cidrs,
            cidrs_by_object: HashMap::new(),
            flag_cidrs: config.service_cidrs.clone(),
            shared: None,
            overlays: Overlays::new(config.clone()),
            published_overlays: NodeOverlays::default(),
            dirty: HashSet::new(),
            dirty_nodes: HashSet::new(),
            rebuild: false,
            trigger_times: Vec::new(),
            objects: Vec::new(),
            seen: Vec::new(),
            traces: Vec::new(),
            api: ApiState::default(),
            listing: ApiState::default(),
        }
    }

    pub fn handle(&mut self, ev: WatchEvent) {
        match ev {
            WatchEvent::Service(ev) => self.service_event(*ev),
            WatchEvent::Slice(ev) => self.slice_event(*ev),
            WatchEvent::Node(ev) => self.node_event(*ev),
            WatchEvent::ServiceCidr(ev) => self.service_cidr_event(*ev),
        }
    }

    fn service_event(&mut self, ev: Event<Service>) {
        let filter = &self.filter;
        match ev {
            Event::Init => {
                self.services.start();
                self.listing.restart(Resource::Services);
            }
            Event::InitApply(svc) => {
                self.listing
                    .list(Resource::Services, version(&svc.metadata));
                if let Some(info) = objects::service(&svc, filter, &self.metrics) {
                    self.services.push((info.key.clone(), info));
                }
            }
            Event::InitDone => {
                let all = self.services.finish();
                tracing::info!(services = all.len(), "services listed");
                self.index.reset_services(all);
                self.api.take(Resource::Services, &self.listing);
                self.rebuild = true;
            }
            Event::Apply(svc) => {
                self.api.fold(Resource::Services, version(&svc.metadata));
                let key = ObjectKey::of(&svc);
                let info = objects::service(&svc, filter, &self.metrics);
                self.index.apply_service(key.clone(), info);
                self.check_ports(&key);
                self.dirty.insert(key.clone());
                self.changed(format!("Service {key}"), None);
                self.trace("Service", &svc.metadata, Change::Apply);
            }
            Event::Delete(svc) => {
                self.api.fold(Resource::Services, version(&svc.metadata));
                let key = ObjectKey::of(&svc);
                self.index.apply_service(key.clone(), None);
                self.dirty.insert(key.clone());
                self.changed(format!("Service {key}"), None);
                self.trace("Service", &svc.metadata, Change::Delete);
            }
        }
    }

    fn slice_event(&mut self, ev: Event<EndpointSlice>) {
        match ev {
            Event::Init => {
                self.slices.start();
                self.listing.restart(Resource::EndpointSlices);
            }
            Event::InitApply(s) => {
                self.listing
                    .list(Resource::EndpointSlices, version(&s.metadata));
                if let Some(info) = objects::slice(&s, &self.metrics) {
                    self.slices.push((info.key.clone(), info));
                }
            }
            Event::InitDone => {
                let all = self.slices.finish();
                tracing::info!(slices = all.len(), "endpoint slices listed");
                self.index.reset_slices(all);
                self.api.take(Resource::EndpointSlices, &self.listing);
                self.rebuild = true;
            }
            Event::Apply(s) => {
                self.api
                    .fold(Resource::EndpointSlices, version(&s.metadata));
                let key = ObjectKey::of(&s);
                let info = objects::slice(&s, &self.metrics);
                let trigger = info.as_ref().and_then(|i| i.trigger_time);
                let service = info.as_ref().map(|i| i.service.clone());
                // A slice that moved to another Service changes both.
                let before = self.index.apply_slice(key.clone(), info);
                self.dirty.extend(before);
                if let Some(svc) = service {
                    self.check_ports(&svc);
                    self.dirty.insert(svc);
                }
                self.changed(format!("EndpointSlice {key}"), trigger);
                self.trace("EndpointSlice", &s.metadata, Change::Apply);
            }
            Event::Delete(s) => {
                self.api
                    .fold(Resource::EndpointSlices, version(&s.metadata));
                let key = ObjectKey::of(&s);
                let before = self.index.apply_slice(key.clone(), None);
                self.dirty.extend(before);
                self.changed(format!("EndpointSlice {key}"), None);
                self.trace("EndpointSlice", &s.metadata, Change::Delete);
            }
        }
    }

    fn node_event(&mut self, ev: Event<Node>) {
        match ev {
            Event::Init => {
                self.nodes.start();
                self.listing.restart(Resource::Nodes);
            }
            Event::InitApply(n) => {
                self.listing.list(Resource::Nodes, version(&n.metadata));
                self.nodes.push(objects::node(&n));
            }
            Event::InitDone => {
                let all = self.nodes.finish();
                tracing::info!(nodes = all.len(), "nodes listed");
                self.index.reset_nodes(all);
                self.api.take(Resource::Nodes, &self.listing);
                self.rebuild = true;
            }
            Event::Apply(n) => {
                // Every event moves the stream's position, also one that changes nothing
                // here: positions are compared with other replicas', which took it too.
                self.api.fold(Resource::Nodes, version(&n.metadata));
                // Nodes report status often; only a change of what the rules use (addresses,
                // zone, pod CIDRs) recomputes anything.
                let info = objects::node(&n);
                if self.index.node(&info.name) == Some(&info) {
                    return;
                }
                self.dirty_nodes.insert(info.name.clone());
                self.changed(format!("Node {}", info.name), None);
                self.trace("Node", &n.metadata, Change::Apply);
                self.index.apply_node(info.name.clone(), Some(info));
            }
            Event::Delete(n) => {
                self.api.fold(Resource::Nodes, version(&n.metadata));
                let name = kube::ResourceExt::name_any(&n);
                self.index.apply_node(name.clone(), None);
                self.dirty_nodes.insert(name.clone());
                self.changed(format!("Node {name}"), None);
                self.trace("Node", &n.metadata, Change::Delete);
            }
        }
    }

    fn changed(&mut self, object: String, trigger: Option<k8s_openapi::jiff::Timestamp>) {
        self.objects.push(object);
        self.seen.push(Instant::now());
        let t = trigger.unwrap_or_else(k8s_openapi::jiff::Timestamp::now);
        self.trigger_times.push(prost_types::Timestamp {
            seconds: t.as_second(),
            nanos: t.subsec_nanosecond(),
        });
    }

    /// The change's root span (crate::trace); its context is kept for the next publication
    /// when the trace is sampled.
    fn trace(
        &mut self,
        kind: &'static str,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        change: Change,
    ) {
        if let Some(cx) = trace::api_change(kind, meta, change)
            && self.traces.len() < trace::MAX_LINKS
        {
            self.traces.push(cx);
        }
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
            Event::Init => {
                self.service_cidr_objects.start();
                self.listing.restart(Resource::ServiceCidrs);
            }
            Event::InitApply(o) => {
                self.listing
                    .list(Resource::ServiceCidrs, version(&o.metadata));
                self.service_cidr_objects.push(reduce(&o));
            }
            Event::InitDone => {
                let all = self.service_cidr_objects.finish();
                self.api.take(Resource::ServiceCidrs, &self.listing);
                self.cidrs_by_object = all.into_iter().collect();
                self.apply_service_cidrs();
            }
            Event::Apply(o) => {
                self.api.fold(Resource::ServiceCidrs, version(&o.metadata));
                let (name, cidrs) = reduce(&o);
                self.cidrs_by_object.insert(name, cidrs);
                self.apply_service_cidrs();
            }
            Event::Delete(o) => {
                self.api.fold(Resource::ServiceCidrs, version(&o.metadata));
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
        self.config.service_cidrs = cidrs;
        self.shared = None;
        self.overlays = Overlays::new(self.config.clone());
        self.published_overlays = NodeOverlays::default();
        self.rebuild = true;
    }

    /// Every watch is about to start over (restarted on new connections after the API server
    /// was unreachable): each resource waits for its new list, so nothing is published, and the
    /// brain is unsynced, until all of them are complete again. Events the old watches sent are
    /// the caller's to drop.
    pub fn relist_all(&mut self) {
        self.services.start();
        self.slices.start();
        self.nodes.start();
        if self.watch_service_cidrs {
            self.service_cidr_objects.start();
        }
    }

    /// Whether every followed resource is complete: listed, and not relisting.
    pub fn synced(&self) -> bool {
        self.services.complete()
            && self.slices.complete()
            && self.nodes.complete()
            && self.service_cidr_objects.complete()
    }

    /// The index as the events so far left it.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Brings `fanout` up to date with the index: marks it unsynced while a list is under way
    /// (holding every publication until the list is done), otherwise recomputes what changed,
    /// publishes it, and marks it synced. True when it recomputed.
    pub fn publish(&mut self, fanout: &Fanout) -> bool {
        let synced = self.synced();
        if !synced {
            if fanout.synced() {
                tracing::warn!("relisting: holding the last complete state until the list is done");
                fanout.set_synced(false);
            }
            return false;
        }
        if !self.rebuild && self.dirty.is_empty() && self.dirty_nodes.is_empty() {
            // A relist that changed nothing (its resource swapped for an equal one, or only
            // ServiceCIDRs with the same ranges): the last publication is current again.
            if !fanout.synced() && fanout.publication().version > 0 {
                tracing::info!("relist complete without changes; serving nodes");
                fanout.set_synced(true);
            }
            return false;
        }
        let start = Instant::now();
        let rebuild = self.rebuild || self.shared.is_none();
        let span = trace::publication(&self.traces, self.dirty.len(), rebuild);
        self.traces.clear();
        let entered = span.as_ref().map(|s| s.enter());
        let shared = self
            .shared
            .get_or_insert_with(|| SharedRuleset::new(self.config.clone()));
        // The shared ruleset first: overlays extend its sets.
        if rebuild {
            shared.rebuild(&self.index);
            self.overlays.rebuild(&self.index, shared);
        } else {
            shared.update(&self.index, self.dirty.iter());
            self.overlays.update(
                &self.index,
                shared,
                self.dirty.iter(),
                self.dirty_nodes.iter(),
            );
        }
        // Overlays may have created or dropped dynamic sets in the shared model.
        shared.prune();
        let model = Arc::new(shared.model().clone());
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
        let took = start.elapsed();
        self.metrics.observe_compute(took);
        tracing::debug!(
            ?took,
            services = self.dirty.len(),
            rebuild,
            "recomputed desired state"
        );
        self.dirty.clear();
        self.dirty_nodes.clear();
        self.rebuild = false;
        let trace = span.as_ref().and_then(splitproxy_proto::telemetry::sampled);
        // Each change's wait ends here, as its trigger-time wait does in publish_traced, and
        // counts only when a publication carries it (as there).
        let now = Instant::now();
        let seen = std::mem::take(&mut self.seen);
        let version = fanout.publish_traced(
            model,
            self.published_overlays.clone(),
            std::mem::take(&mut self.trigger_times),
            std::mem::take(&mut self.objects),
            trace,
            self.api,
        );
        drop(entered);
        if version.is_some() {
            for seen in seen {
                self.metrics.observe_change_queue(now - seen);
            }
        }
        if let (Some(span), Some(v)) = (&span, version) {
            span.record("splitproxy.version", v);
        }
        if !fanout.synced() {
            tracing::info!("every initial list is complete; serving nodes");
            fanout.set_synced(true);
        }
        true
    }
}

/// An object's resourceVersion, as [`ApiState`] takes it.
fn version(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<&str> {
    meta.resource_version.as_deref()
}

#[cfg(test)]
mod tests;
