//! `GetService`: one Service as the brain knows it, and whether its latest change is live on
//! every node.
//!
//! The index belongs to the watch task alone ([`crate::watch`]); the gRPC side asks it for one
//! Service through a [`ServiceQuery`] (a small channel, answered between watch events), so the
//! watch path pays nothing until an operator asks. Where each node stands comes from the
//! fan-out: the publication that carries the Service's latest change (from its change log) and
//! each node's acked version, and the latency of that publication's acks
//! ([`crate::fanout::Fanout::rollout_latency`]). How each node sees the Service's endpoints
//! comes from the rulesets of the latest publication ([`variants`]), computed on the gRPC side
//! once per publication and Service, and kept for the streams that ask again.
mod render;
pub mod variants;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use splitproxy_proto::v1::{
    EndpointView, GetServiceResponse, RolloutLatency, ServicePortView, ServiceRollout,
    service_rollout::State,
};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::fanout::{NodeState, Publication};
use crate::index::Index;
use crate::objects::{ObjectKey, ServiceInfo, SliceInfo};
use variants::Variants;

/// How many questions may wait for the watch task.
pub const QUERIES: usize = 64;
/// Variants kept, by Service and publication: enough for the Services being watched at once.
const KEPT_VARIANTS: usize = 32;
/// How long the watch task may take to answer.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// A question for the watch task: this Service and its slices, now; with `zones`, also every
/// node's zone (asked only when the variants are computed).
pub struct ServiceQuery {
    pub key: ObjectKey,
    pub zones: bool,
    pub reply: oneshot::Sender<Option<ServiceView>>,
}

/// One Service and its EndpointSlices, as the index holds them.
#[derive(Debug, Clone)]
pub struct ServiceView {
    pub info: Arc<ServiceInfo>,
    pub slices: Vec<Arc<SliceInfo>>,
    /// Node name to zone, for the nodes with one; empty unless the query asked.
    pub zones: HashMap<String, String>,
}

impl ServiceView {
    /// The answer to `query` from `index` (on the watch task: clones of a few `Arc`s, and the
    /// nodes' zones only when asked).
    pub fn of(index: &Index, query: &ServiceQuery) -> Option<ServiceView> {
        let info = index.service(&query.key)?.clone();
        let zones = if query.zones {
            index
                .nodes()
                .filter_map(|n| Some((n.name.clone(), n.zone.clone()?)))
                .collect()
        } else {
            HashMap::new()
        };
        Some(ServiceView {
            info,
            slices: index.slices_of(&query.key).cloned().collect(),
            zones,
        })
    }

    /// The change-log names of its objects (see the indexer): the Service and its slices.
    pub fn object_names(&self) -> Vec<String> {
        let mut names = vec![format!("Service {}", self.info.key)];
        names.extend(
            self.slices
                .iter()
                .map(|s| format!("EndpointSlice {}", s.key)),
        );
        names
    }
}

/// Variants computed lately: (Service, publication version, variants), oldest first.
type Kept = VecDeque<(ObjectKey, u64, Arc<Variants>)>;

/// Where questions go, and the variants computed lately.
#[derive(Clone)]
pub struct Queries {
    tx: mpsc::Sender<ServiceQuery>,
    kept: Arc<Mutex<Kept>>,
    /// Held while variants are computed: one computation at a time, so that streams watching
    /// the same Service compute each publication's variants once, and never more than one
    /// blocking thread works on them.
    computing: Arc<tokio::sync::Mutex<()>>,
}

/// The gRPC side's end and the watch task's end of the question channel.
pub fn channel() -> (Queries, mpsc::Receiver<ServiceQuery>) {
    let (tx, rx) = mpsc::channel(QUERIES);
    (
        Queries {
            tx,
            kept: Arc::default(),
            computing: Arc::default(),
        },
        rx,
    )
}

impl Queries {
    /// The Service `key` as the index holds it now (`None`: no such Service splitproxy serves).
    pub async fn ask(&self, key: &ObjectKey, zones: bool) -> Result<Option<ServiceView>, Status> {
        let (reply, answer) = oneshot::channel();
        let asked = self.tx.try_send(ServiceQuery {
            key: key.clone(),
            zones,
            reply,
        });
        if asked.is_err() {
            return Err(Status::unavailable("too many questions at once; try again"));
        }
        tokio::time::timeout(ANSWER_WITHIN, answer)
            .await
            .map_err(|_| Status::unavailable("the index did not answer in time"))?
            .map_err(|_| Status::unavailable("the index is gone"))
    }

    /// The Service `key` and its variants at `publication`: computed off the async threads
    /// when not kept already (once per publication and Service, however many streams ask).
    pub async fn ask_with_variants(
        &self,
        key: &ObjectKey,
        publication: Arc<Publication>,
    ) -> Result<Option<(ServiceView, Arc<Variants>)>, Status> {
        let version = publication.version;
        let kept = self.kept(key, version);
        let Some(view) = self.ask(key, kept.is_none()).await? else {
            return Ok(None);
        };
        if let Some(v) = kept {
            return Ok(Some((view, v)));
        }
        let _computing = self.computing.lock().await;
        if let Some(v) = self.kept(key, version) {
            return Ok(Some((view, v))); // another caller computed them meanwhile
        }
        let for_compute = view.clone();
        let computed =
            tokio::task::spawn_blocking(move || variants::compute(&for_compute, &publication))
                .await
                .map_err(|_| Status::internal("computing the variants failed"))?;
        let computed = Arc::new(computed);
        self.keep(key, version, computed.clone());
        Ok(Some((view, computed)))
    }

    fn kept(&self, key: &ObjectKey, version: u64) -> Option<Arc<Variants>> {
        let kept = self.kept.lock().ok()?;
        kept.iter()
            .find(|(k, v, _)| k == key && *v == version)
            .map(|(_, _, x)| x.clone())
    }

    fn keep(&self, key: &ObjectKey, version: u64, variants: Arc<Variants>) {
        if let Ok(mut kept) = self.kept.lock() {
            kept.retain(|(k, _, _)| k != key);
            kept.push_back((key.clone(), version, variants));
            while kept.len() > KEPT_VARIANTS {
                kept.pop_front();
            }
        }
    }
}

/// Puts the variants into the answer, with their summary in words.
pub fn fill(out: &mut GetServiceResponse, v: &Variants) {
    out.variants = v.variants.clone();
    out.variants_version = v.version;
    out.variants_left_out = v.left_out;
    out.variant_nodes_left_out = v.nodes_left_out;
    out.destinations_left_out = v.destinations_left_out;
    out.variants_summary = render::variants(v);
}

/// The Service's own part of the answer: ports, addresses, policies, endpoints.
pub fn describe(view: &ServiceView, brain_epoch: u64) -> GetServiceResponse {
    let info = &view.info;
    let ips = |v: &[std::net::IpAddr]| v.iter().map(ToString::to_string).collect();
    let mut endpoints = Vec::new();
    for slice in &view.slices {
        for ep in &slice.endpoints {
            endpoints.push(EndpointView {
                addresses: ips(&ep.addresses),
                ready: ep.ready,
                serving: ep.serving,
                terminating: ep.terminating,
                node: ep.node_name.clone().unwrap_or_default(),
                zone: ep.zone.clone().unwrap_or_default(),
                slice: slice.key.name.to_string(),
            });
        }
    }
    GetServiceResponse {
        namespace: info.key.namespace.to_string(),
        name: info.key.name.to_string(),
        cluster_ips: ips(&info.cluster_ips),
        ports: info
            .ports
            .iter()
            .map(|p| ServicePortView {
                name: p.name.clone(),
                protocol: format!("{:?}", p.protocol).to_uppercase(),
                port: p.port.into(),
                node_port: p.node_port.map(u32::from).unwrap_or(0),
            })
            .collect(),
        external_ips: ips(&info.external_ips),
        load_balancer_ips: ips(&info.load_balancer_ips),
        external_traffic_policy_local: info.external_local,
        internal_traffic_policy_local: info.internal_local,
        affinity_timeout_seconds: info.affinity_timeout.unwrap_or(0),
        endpoints,
        brain_epoch,
        ..Default::default()
    }
}

/// Where `node` stands with the change published as `version`.
pub fn rollout(node: &str, st: &NodeState, version: u64) -> ServiceRollout {
    let acked = st.acked.as_ref().map(|h| h.version);
    let state = if !st.connected {
        State::Disconnected
    } else if acked.is_some_and(|a| a >= version) {
        State::Applied
    } else if !st.last_error.is_empty() {
        State::Nacked
    } else {
        State::Pending
    };
    ServiceRollout {
        node: node.to_string(),
        state: state as i32,
        acked_version: acked.unwrap_or(0),
        last_error: st.last_error.clone(),
    }
}

/// "applied on 4998 of 5000 nodes, 2 pending": the rollout in one line.
pub fn summary(nodes: &[ServiceRollout]) -> String {
    let count = |s: State| nodes.iter().filter(|n| n.state() == s).count();
    let mut line = format!(
        "applied on {} of {} nodes",
        count(State::Applied),
        nodes.len()
    );
    for (state, word) in [
        (State::Pending, "pending"),
        (State::Nacked, "refused it"),
        (State::Disconnected, "disconnected"),
    ] {
        let n = count(state);
        if n > 0 {
            line.push_str(&format!(", {n} {word}"));
        }
    }
    line
}

/// Latency quantiles from a histogram of whole milliseconds in power-of-two buckets (bucket `i`
/// holds latencies below `2^i` ms): each quantile is its bucket's upper bound, the maximum is
/// exact.
pub fn latency(buckets: &[u32], max: Duration) -> RolloutLatency {
    let total: u32 = buckets.iter().sum();
    let quantile = |q: f64| -> Option<prost_types::Duration> {
        if total == 0 {
            return None;
        }
        let want = ((total as f64) * q).ceil().max(1.0) as u32;
        let mut seen = 0;
        for (i, n) in buckets.iter().enumerate() {
            seen += n;
            if seen >= want {
                let bound = Duration::from_millis(1u64 << i).min(max.max(Duration::from_millis(1)));
                return bound.try_into().ok();
            }
        }
        max.try_into().ok()
    };
    RolloutLatency {
        nodes: total,
        p50: quantile(0.5),
        p90: quantile(0.9),
        p99: quantile(0.99),
        max: (total > 0).then(|| max.try_into().ok()).flatten(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_counts_every_state() {
        let r = |node: &str, state: State| ServiceRollout {
            node: node.into(),
            state: state as i32,
            ..Default::default()
        };
        let nodes = [
            r("a", State::Applied),
            r("b", State::Applied),
            r("c", State::Pending),
            r("d", State::Disconnected),
        ];
        assert_eq!(
            summary(&nodes),
            "applied on 2 of 4 nodes, 1 pending, 1 disconnected"
        );
    }

    #[test]
    fn quantiles_are_bucket_bounds_capped_by_the_maximum() {
        // 90 acks under 2 ms, 9 under 64 ms, 1 at 300 ms.
        let mut buckets = vec![0u32; 20];
        buckets[1] = 90;
        buckets[6] = 9;
        buckets[9] = 1;
        let l = latency(&buckets, Duration::from_millis(300));
        let ms =
            |d: Option<prost_types::Duration>| Duration::try_from(d.unwrap()).unwrap().as_millis();
        assert_eq!(l.nodes, 100);
        assert_eq!(ms(l.p50), 2);
        assert_eq!(ms(l.p90), 2);
        assert_eq!(ms(l.p99), 64);
        assert_eq!(ms(l.max), 300);
        assert_eq!(latency(&[0; 20], Duration::ZERO).p50, None);
    }
    /// Variants are computed once per publication and Service, and asked again (with the
    /// nodes' zones) only when the publication moved on.
    #[tokio::test]
    async fn variants_are_kept_per_publication() {
        let (queries, mut rx) = channel();
        let zones_asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = zones_asked.clone();
        tokio::spawn(async move {
            while let Some(q) = rx.recv().await {
                if q.zones {
                    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                let info = ServiceInfo {
                    key: q.key.clone(),
                    cluster_ips: vec!["10.96.0.1".parse().unwrap()],
                    ..Default::default()
                };
                let _ = q.reply.send(Some(ServiceView {
                    info: Arc::new(info),
                    slices: Vec::new(),
                    zones: HashMap::new(),
                }));
            }
        });
        let key = ObjectKey::new("default", "web");
        let at = |version| {
            Arc::new(Publication {
                version,
                ..Default::default()
            })
        };
        let (_, first) = queries
            .ask_with_variants(&key, at(3))
            .await
            .unwrap()
            .unwrap();
        let (_, again) = queries
            .ask_with_variants(&key, at(3))
            .await
            .unwrap()
            .unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(zones_asked.load(std::sync::atomic::Ordering::SeqCst), 1);
        let (_, next) = queries
            .ask_with_variants(&key, at(4))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((first.version, next.version), (3, 4));
        assert_eq!(zones_asked.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
}
