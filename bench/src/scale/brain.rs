//! The brain's side of the scale mode: the bench's workload ([`crate::workload`]) fed straight
//! into the brain's index, its incremental desired state and every node's overlay, with no API
//! server and no gRPC in between, so that the figures are the brain's compute alone.
//!
//! Objects are built as the end-to-end mode writes them to the API server and reduced by the
//! brain's own `objects` functions, as its watches do; the timers start after an object exists
//! and stop once the desired state holds it, as a watch event's handling would.
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use splitproxy_brain::desired::SharedRuleset;
use splitproxy_brain::index::Index;
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, ObjectKey};
use splitproxy_brain::overlay::Overlays;
use splitproxy_brain::rules::RulesConfig;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{Update, update::Body};

use super::heap;
use super::samples::Samples;
use crate::workload::{self, NAMESPACE, ServiceState, SliceState, Workload};

/// The brain's epoch in every update the scale mode builds.
const EPOCH: u64 = 1;

/// What the kernel part applies, in this order, each update on the one before.
pub struct Updates {
    /// The shared ruleset after the Service changes: the node's cold start.
    pub snapshot: Update,
    /// One endpoint of one Service replaced, per update.
    pub endpoint_changes: Vec<Update>,
    pub service_added: Update,
    pub service_deleted: Update,
}

/// The brain's state over the workload, kept as the brain keeps it.
pub struct Brain {
    metrics: Metrics,
    index: Index,
    desired: SharedRuleset,
    overlays: Overlays,
    /// Every node's overlay model as published, kept alive as the fan-out keeps them.
    published: Vec<(String, Option<Arc<Model>>)>,
    nodes: usize,
}

impl Brain {
    /// The index of every Node, Service and slice of `w` (the rollout Service of the end-to-end
    /// mode is left out: S Services of E endpoints, nothing else).
    pub fn load(w: &Workload) -> anyhow::Result<Brain> {
        let mut b = Brain {
            metrics: Metrics::default(),
            index: Index::default(),
            desired: SharedRuleset::new(RulesConfig::default()),
            overlays: Overlays::new(RulesConfig::default()),
            published: Vec::new(),
            nodes: w.nodes.len(),
        };
        for s in &w.services[..w.plain_services()] {
            b.put_service(s)?;
        }
        for n in &w.nodes {
            let obj = workload::node_object(n).context("building a Node object")?;
            b.index
                .apply_node(n.name.clone(), Some(objects::node(&obj)));
        }
        println!(
            "brain: index of {} Services x {}, {} Nodes: {}",
            w.plain_services(),
            w.endpoints_per_service,
            b.nodes,
            heap::memory()
        );
        Ok(b)
    }

    /// The whole shared ruleset from the index, as after the brain's initial sync.
    pub fn rebuild(&mut self, w: &Workload) {
        let t = Instant::now();
        self.desired.rebuild(&self.index);
        println!(
            "brain: full rebuild of {} Services x {}: {:?}, {} elements, {}",
            w.plain_services(),
            w.endpoints_per_service,
            t.elapsed(),
            self.desired.model().element_count(),
            heap::memory()
        );
    }

    /// The shared ruleset as it stands: what every node's snapshot carries.
    pub fn model(&self) -> &Model {
        self.desired.model()
    }

    /// Every node's overlay (without Nodes, there are none).
    pub fn build_overlays(&mut self) {
        if self.nodes == 0 {
            return;
        }
        let t = Instant::now();
        self.overlays.rebuild(&self.index, &mut self.desired);
        self.published = self.overlays.changed_models();
        let elements: usize = self
            .published
            .iter()
            .filter_map(|(_, m)| m.as_ref())
            .map(|m| m.element_count())
            .sum();
        println!(
            "brain: overlays of {} nodes: {:?}, {elements} elements, {}",
            self.nodes,
            t.elapsed(),
            heap::memory()
        );
    }

    /// `count` single-Service changes (every endpoint of one Service replaced): the brain's
    /// compute and diff per change, and the delta's encoded size. With Nodes, each change also
    /// updates the overlays of the nodes it touches, as the brain's publication does.
    pub fn service_changes(&mut self, w: &mut Workload, count: usize) -> anyhow::Result<()> {
        let mut prev = Arc::new(self.desired.model().clone());
        let (mut compute, mut diff) = (Samples::default(), Samples::default());
        let mut sizes = Vec::with_capacity(count);
        let mut touched = Vec::with_capacity(count);
        for k in 0..count {
            let i = (k * 97) % w.plain_services();
            let n: usize = w.services[i].slices.iter().map(|s| s.endpoints.len()).sum();
            let fresh: Vec<_> = (0..n).map(|j| w.fresh_endpoint(i * 7 + j + k)).collect();
            let mut fresh = fresh.into_iter();
            for ep in w.services[i]
                .slices
                .iter_mut()
                .flat_map(|s| s.endpoints.iter_mut())
            {
                if let Some(f) = fresh.next() {
                    *ep = f;
                }
            }
            let svc = &w.services[i];
            let slices = slice_objects(svc)?;
            let t = Instant::now();
            for obj in &slices {
                self.index
                    .apply_slice(ObjectKey::of(obj), objects::slice(obj, &self.metrics));
            }
            let key = [service_key(svc)];
            self.desired.update(&self.index, key.iter());
            if self.nodes > 0 {
                self.overlays.update(
                    &self.index,
                    &mut self.desired,
                    key.iter(),
                    std::iter::empty(),
                );
                self.desired.prune();
                touched.push(self.overlays.changed_models().len());
            }
            let next = Arc::new(self.desired.model().clone());
            compute.push(t.elapsed());
            let t = Instant::now();
            let delta = prev.diff(&next);
            diff.push(t.elapsed());
            sizes.push(prost::Message::encoded_len(&delta));
            prev = next;
        }
        sizes.sort_unstable();
        println!(
            "brain: one Service change ({count} changes, every endpoint of one Service replaced \
             each): compute p50 {:?} max {:?}; diff p50 {:?} max {:?}; delta p50 {} bytes; \
             overlays changed per change {:?}",
            compute.quantile(0.5),
            compute.max(),
            diff.quantile(0.5),
            diff.max(),
            sizes.get(sizes.len() / 2).copied().unwrap_or_default(),
            touched.iter().max()
        );
        Ok(())
    }

    /// `rounds` publications of `batch` changed Services each, one endpoint of each replaced as
    /// the end-to-end mode's churn does: the brain's compute of one churn publication (the
    /// slices into the index, the shared ruleset, the overlays of the nodes they touch, and the
    /// models a publication hands to the fan-out), which a churned change waits for before any
    /// node is sent it.
    pub fn churn_publications(
        &mut self,
        w: &mut Workload,
        batch: usize,
        rounds: usize,
    ) -> anyhow::Result<()> {
        let plain = w.plain_services();
        let batch = batch.min(plain);
        let mut compute = Samples::default();
        let mut cursor = 0;
        for round in 0..rounds {
            let mut changed = Vec::with_capacity(batch);
            for _ in 0..batch {
                let i = (cursor * 97) % plain;
                cursor += 1;
                let j = round % w.services[i].slices[0].endpoints.len();
                let fresh = w.fresh_endpoint(i + j);
                w.services[i].slices[0].endpoints[j] = fresh;
                changed.push((service_key(&w.services[i]), slice_objects(&w.services[i])?));
            }
            let t = Instant::now();
            for (_, slices) in &changed {
                for obj in slices {
                    self.index
                        .apply_slice(ObjectKey::of(obj), objects::slice(obj, &self.metrics));
                }
            }
            let keys: Vec<&ObjectKey> = changed.iter().map(|(k, _)| k).collect();
            self.desired.update(&self.index, keys.iter().copied());
            if self.nodes > 0 {
                self.overlays.update(
                    &self.index,
                    &mut self.desired,
                    keys.iter().copied(),
                    std::iter::empty(),
                );
            }
            self.desired.prune();
            let shared = Arc::new(self.desired.model().clone());
            let overlays = self.overlays.changed_models();
            compute.push(t.elapsed());
            drop((shared, overlays));
        }
        println!(
            "brain: churn publication ({rounds} publications of {batch} Services, one endpoint of \
             each replaced): compute p50 {:?} max {:?}",
            compute.quantile(0.5),
            compute.max(),
        );
        Ok(())
    }

    /// The snapshot a node cold-starts from (the shared ruleset now), then the deltas of
    /// `endpoint_changes` single-endpoint changes, one Service added and one deleted.
    pub fn updates(
        &mut self,
        w: &mut Workload,
        endpoint_changes: usize,
    ) -> anyhow::Result<Updates> {
        let v0 = Arc::new(self.desired.model().clone());
        let t = Instant::now();
        let ruleset = v0.to_ruleset();
        let encoded = prost::Message::encoded_len(&ruleset);
        println!(
            "brain: snapshot {encoded} bytes, built and sized in {:?}",
            t.elapsed()
        );
        let snapshot = Update {
            brain_epoch: EPOCH,
            generation: 1,
            digest: v0.digest(),
            body: Some(Body::Snapshot(ruleset)),
            ..Default::default()
        };
        let mut chain = Chain {
            prev: v0,
            generation: 1,
        };
        let mut changes = Vec::with_capacity(endpoint_changes);
        for k in 0..endpoint_changes {
            // Spread over the Services, one endpoint each.
            let i = (k * 89 + 17) % w.plain_services();
            let fresh = w.fresh_endpoint(i + k);
            let svc = &mut w.services[i];
            let key = service_key(svc);
            let Some(sl) = svc.slices.first_mut() else {
                anyhow::bail!("Service {} has no endpoints to change", svc.name);
            };
            let at = k % sl.endpoints.len().max(1);
            match sl.endpoints.get_mut(at) {
                Some(ep) => *ep = fresh,
                None => sl.endpoints.push(fresh),
            }
            let (name, sl) = (svc.name.clone(), sl.clone());
            self.put_slice(&name, &sl)?;
            changes.push(chain.next(&mut self.desired, &self.index, &key));
        }
        let extra = w.extra_service(0);
        self.put_service(&extra)?;
        let service_added = chain.next(&mut self.desired, &self.index, &service_key(&extra));
        let gone = w.services[42 % w.plain_services()].clone();
        self.index.apply_service(service_key(&gone), None);
        for sl in &gone.slices {
            self.index
                .apply_slice(ObjectKey::new(NAMESPACE, sl.name.as_str()), None);
        }
        let service_deleted = chain.next(&mut self.desired, &self.index, &service_key(&gone));
        Ok(Updates {
            snapshot,
            endpoint_changes: changes,
            service_added,
            service_deleted,
        })
    }

    /// Drops everything, reporting with Nodes what the overlays' bookkeeping and their
    /// published models held.
    pub fn release(self) {
        let Brain {
            overlays,
            published,
            desired,
            index,
            nodes,
            ..
        } = self;
        if nodes > 0 && heap::counting() {
            let before = heap::live_mib();
            drop(overlays);
            let models = heap::live_mib();
            drop(published);
            println!(
                "brain: overlays' bookkeeping {:.1} MiB, their models {:.1} MiB",
                before - models,
                models - heap::live_mib()
            );
        } else {
            drop((overlays, published));
        }
        drop(desired);
        drop(index);
    }

    /// Puts a Service and its slices into the index.
    fn put_service(&mut self, s: &ServiceState) -> anyhow::Result<()> {
        let svc = workload::service_object(s).context("building a Service object")?;
        self.index.apply_service(
            ObjectKey::of(&svc),
            objects::service(&svc, &Default::default(), &self.metrics),
        );
        for sl in &s.slices {
            self.put_slice(&s.name, sl)?;
        }
        Ok(())
    }

    fn put_slice(&mut self, svc: &str, sl: &SliceState) -> anyhow::Result<()> {
        let (_, trigger) = workload::trigger_now();
        let obj = workload::slice_object(svc, sl, &trigger).context("building a slice object")?;
        self.index
            .apply_slice(ObjectKey::of(&obj), objects::slice(&obj, &self.metrics));
        Ok(())
    }
}

/// Consecutive updates: each a delta on the one before.
struct Chain {
    prev: Arc<Model>,
    generation: u64,
}

impl Chain {
    /// The delta after Service `key` changed in the index.
    fn next(&mut self, desired: &mut SharedRuleset, index: &Index, key: &ObjectKey) -> Update {
        desired.update(index, std::iter::once(key));
        let next = Arc::new(desired.model().clone());
        self.generation += 1;
        let u = Update {
            brain_epoch: EPOCH,
            generation: self.generation,
            base_generation: self.generation - 1,
            digest: next.digest(),
            body: Some(Body::Delta(self.prev.diff(&next))),
            ..Default::default()
        };
        self.prev = next;
        u
    }
}

fn service_key(s: &ServiceState) -> ObjectKey {
    ObjectKey::new(NAMESPACE, s.name.as_str())
}

/// Every slice object of `s`, built before a timer starts.
fn slice_objects(
    s: &ServiceState,
) -> anyhow::Result<Vec<k8s_openapi::api::discovery::v1::EndpointSlice>> {
    let (_, trigger) = workload::trigger_now();
    s.slices
        .iter()
        .map(|sl| workload::slice_object(&s.name, sl, &trigger).context("building a slice object"))
        .collect()
}
