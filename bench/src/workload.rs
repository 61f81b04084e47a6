//! The synthetic cluster written into the API server: Node objects, ClusterIP Services and their
//! EndpointSlices, and the changes the phases make to them. The scale mode ([`crate::scale`])
//! feeds the same objects straight into the brain's index, so both modes measure one workload.
//!
//! There is no controller-manager, so the bench plays the EndpointSlice controller: every slice
//! it writes carries `endpoints.kubernetes.io/last-change-trigger-time`, stamped at write time,
//! which is what both kube-proxy and splitproxy measure network programming latency from.
//! Addresses are synthetic: Services in 10.96.0.0/12, endpoints in 10.128.0.0/9, virtual nodes in
//! 100.64.0.0/10. Nothing is ever sent to them; they only exist as rules in node namespaces.
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Instant, SystemTime};

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde::Serialize;
use serde_json::json;

/// The namespace holding every benchmark Service and slice.
pub const NAMESPACE: &str = "bench";
/// `--service-cluster-ip-range` of the API server and `--service-cidr` of the brain.
pub const SERVICE_CIDR: &str = "10.96.0.0/12";
/// Where endpoint addresses come from (kube-proxy's `--cluster-cidr`).
pub const POD_CIDR: &str = "10.128.0.0/9";
pub const TRIGGER_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// At most this many endpoints per slice, like the EndpointSlice controller's default.
pub const MAX_PER_SLICE: usize = 100;
/// The port every Service exposes and the target port of its endpoints.
const PORT: i32 = 80;
const TARGET_PORT: i32 = 8080;
/// ClusterIPs start above the first addresses, which the API server keeps for itself.
const CLUSTER_IP_OFFSET: u32 = 1024;
/// Fresh endpoint addresses (churn, rolling update, new Services) start here, far above the
/// initial ones.
const FRESH_BASE: u32 = 0x0040_0000; // 10.192.0.0

/// The Service the rolling-update phase rolls: always 100 endpoints.
pub const ROLLOUT_ENDPOINTS: usize = 100;

pub fn node_name(i: usize) -> String {
    format!("node-{i}")
}

pub fn service_name(i: usize) -> String {
    format!("svc-{i}")
}

/// The ClusterIP of Service index `i` (index `services` is the rollout Service, above it the
/// extra ones of the add/delete phase).
pub fn cluster_ip(i: usize) -> Ipv4Addr {
    let base = u32::from(Ipv4Addr::new(10, 96, 0, 0));
    Ipv4Addr::from(base + CLUSTER_IP_OFFSET + i as u32)
}

fn pod_ip(k: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + k)
}

/// A synthetic node address for Node objects that no namespace backs.
fn virtual_node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(100, 64, 0, 0)) + i as u32)
}

/// The time now, as the annotation carries it (RFC 3339 with nanoseconds).
pub fn trigger_now() -> (SystemTime, String) {
    let now = SystemTime::now();
    let text = k8s_openapi::jiff::Timestamp::try_from(now)
        .map(|t| format!("{t:.9}"))
        .unwrap_or_default();
    (now, text)
}

#[derive(Debug, Clone, Serialize)]
pub struct Endpoint {
    pub ip: Ipv4Addr,
    pub node: String,
    pub ready: bool,
}

#[derive(Debug, Clone)]
pub struct SliceState {
    pub name: String,
    pub endpoints: Vec<Endpoint>,
}

#[derive(Debug, Clone)]
pub struct ServiceState {
    pub name: String,
    pub ip: Ipv4Addr,
    pub slices: Vec<SliceState>,
}

/// Everything the bench wrote, so that the phases can change it.
#[derive(Debug)]
pub struct Workload {
    pub nodes: Vec<NodeObject>,
    /// Index `i < services` is `svc-i`; the last one is the rollout Service.
    pub services: Vec<ServiceState>,
    pub endpoints_per_service: usize,
    next_fresh: AtomicU32,
    /// Nodes endpoints are spread over.
    spread: usize,
}

#[derive(Debug, Clone)]
pub struct NodeObject {
    pub name: String,
    pub ip: Ipv4Addr,
    pub zone: String,
}

/// What writing the workload took.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct WriteFigures {
    pub nodes: usize,
    pub services: usize,
    pub slices: usize,
    pub endpoints: usize,
    pub objects: usize,
    pub seconds: f64,
    pub objects_per_second: f64,
    pub concurrency: usize,
}

impl Workload {
    /// Lays out `services` Services of `endpoints` endpoints over `nodes` Node objects. Nodes
    /// `0..real_nodes.len()` get the given addresses (node namespaces); the rest synthetic ones.
    pub fn new(services: usize, endpoints: usize, nodes: usize, real_nodes: &[Ipv4Addr]) -> Self {
        let nodes: Vec<NodeObject> = (0..nodes)
            .map(|i| NodeObject {
                name: node_name(i),
                ip: real_nodes
                    .get(i)
                    .copied()
                    .unwrap_or_else(|| virtual_node_ip(i)),
                zone: format!("zone-{}", i % 3),
            })
            .collect();
        let spread = nodes.len().max(1);
        let mut next = 0u32;
        let mut alloc = |n: usize, svc: usize| -> Vec<Endpoint> {
            (0..n)
                .map(|j| {
                    let ip = pod_ip(next);
                    next += 1;
                    Endpoint {
                        ip,
                        node: node_name((svc * 7 + j) % spread),
                        ready: true,
                    }
                })
                .collect()
        };
        let mut all = Vec::with_capacity(services + 1);
        for i in 0..services {
            all.push(service_state(
                service_name(i),
                cluster_ip(i),
                alloc(endpoints, i),
            ));
        }
        all.push(service_state(
            "rollout".to_string(),
            cluster_ip(services),
            alloc(ROLLOUT_ENDPOINTS, services),
        ));
        Workload {
            nodes,
            services: all,
            endpoints_per_service: endpoints,
            next_fresh: AtomicU32::new(FRESH_BASE),
            spread,
        }
    }

    /// The number of plain Services (without the rollout one).
    pub fn plain_services(&self) -> usize {
        self.services.len() - 1
    }

    pub fn rollout_index(&self) -> usize {
        self.services.len() - 1
    }

    /// A never-used endpoint on some node.
    pub fn fresh_endpoint(&self, salt: usize) -> Endpoint {
        let k = self.next_fresh.fetch_add(1, Ordering::Relaxed);
        Endpoint {
            ip: pod_ip(k),
            node: node_name(salt % self.spread),
            ready: true,
        }
    }

    /// A Service that is not part of the workload (for the add/delete phase).
    pub fn extra_service(&self, n: usize) -> ServiceState {
        let index = self.services.len() + n;
        let eps = (0..self.endpoints_per_service)
            .map(|j| self.fresh_endpoint(index + j))
            .collect();
        service_state(format!("extra-{n}"), cluster_ip(index), eps)
    }
}

fn service_state(name: String, ip: Ipv4Addr, eps: Vec<Endpoint>) -> ServiceState {
    let slices = eps
        .chunks(MAX_PER_SLICE)
        .enumerate()
        .map(|(k, c)| SliceState {
            name: format!("{name}-{k}"),
            endpoints: c.to_vec(),
        })
        .collect();
    ServiceState { name, ip, slices }
}

fn node_json(n: &NodeObject) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": n.name, "labels": {
            "kubernetes.io/hostname": n.name,
            "topology.kubernetes.io/zone": n.zone,
        }},
        "status": {
            "addresses": [{"type": "InternalIP", "address": n.ip.to_string()},
                          {"type": "Hostname", "address": n.name}],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    })
}

fn service_json(s: &ServiceState) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": s.name, "namespace": NAMESPACE},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": s.ip.to_string(),
            "clusterIPs": [s.ip.to_string()],
            "ports": [{"name": "http", "protocol": "TCP", "port": PORT, "targetPort": TARGET_PORT}],
        },
    })
}

fn endpoints_json(eps: &[Endpoint]) -> serde_json::Value {
    eps.iter()
        .map(|e| {
            json!({
                "addresses": [e.ip.to_string()],
                "conditions": {"ready": e.ready, "serving": e.ready, "terminating": false},
                "nodeName": e.node,
            })
        })
        .collect()
}

fn slice_json(svc: &str, s: &SliceState, trigger: &str) -> serde_json::Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": s.name, "namespace": NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": svc,
                "endpointslice.kubernetes.io/managed-by": "splitproxy-bench",
            },
            "annotations": {TRIGGER_ANNOTATION: trigger},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "protocol": "TCP", "port": TARGET_PORT}],
        "endpoints": endpoints_json(&s.endpoints),
    })
}

/// The Node object of `n`, as the bench writes it.
pub fn node_object(n: &NodeObject) -> Result<Node, serde_json::Error> {
    serde_json::from_value(node_json(n))
}

/// The Service object of `s`, as the bench writes it.
pub fn service_object(s: &ServiceState) -> Result<Service, serde_json::Error> {
    serde_json::from_value(service_json(s))
}

/// Slice `s` of Service `svc`, stamped with `trigger` (see [`trigger_now`]).
pub fn slice_object(
    svc: &str,
    s: &SliceState,
    trigger: &str,
) -> Result<EndpointSlice, serde_json::Error> {
    serde_json::from_value(slice_json(svc, s, trigger))
}

/// Writes objects concurrently (bounded) through the admin client.
#[derive(Clone)]
pub struct Writer {
    client: kube::Client,
    concurrency: usize,
}

impl Writer {
    pub fn new(client: kube::Client, concurrency: usize) -> Writer {
        Writer {
            client,
            concurrency: concurrency.max(1),
        }
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }
    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), NAMESPACE)
    }
    fn slices(&self) -> Api<EndpointSlice> {
        Api::namespaced(self.client.clone(), NAMESPACE)
    }

    /// Creates the namespace, every Node, every Service and every slice; prints progress.
    pub async fn write_all(&self, w: &Workload) -> anyhow::Result<WriteFigures> {
        let start = Instant::now();
        let ns: Namespace = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}
        }))?;
        Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .context("creating the bench namespace")?;

        let pp = PostParams::default();
        let nodes = self.nodes();
        let total = w.nodes.len();
        let done = AtomicU32::new(0);
        futures::stream::iter(w.nodes.iter().map(Ok::<_, anyhow::Error>))
            .try_for_each_concurrent(self.concurrency, |n| {
                let (nodes, pp, done) = (&nodes, &pp, &done);
                async move {
                    let obj = node_object(n)?;
                    nodes
                        .create(pp, &obj)
                        .await
                        .with_context(|| format!("creating Node {}", n.name))?;
                    progress(done.fetch_add(1, Ordering::Relaxed) + 1, total, "Nodes");
                    Ok(())
                }
            })
            .await?;
        self.ensure_node_status(w).await?;

        let services = self.services();
        let slices = self.slices();
        let total = w.services.len();
        let done = AtomicU32::new(0);
        futures::stream::iter(w.services.iter().map(Ok::<_, anyhow::Error>))
            .try_for_each_concurrent(self.concurrency, |s| {
                let (services, slices, pp, done) = (&services, &slices, &pp, &done);
                async move {
                    let obj = service_object(s)?;
                    services
                        .create(pp, &obj)
                        .await
                        .with_context(|| format!("creating Service {}", s.name))?;
                    for sl in &s.slices {
                        let (_, trigger) = trigger_now();
                        let obj = slice_object(&s.name, sl, &trigger)?;
                        slices
                            .create(pp, &obj)
                            .await
                            .with_context(|| format!("creating EndpointSlice {}", sl.name))?;
                    }
                    progress(
                        done.fetch_add(1, Ordering::Relaxed) + 1,
                        total,
                        "Services with their slices",
                    );
                    Ok(())
                }
            })
            .await?;

        let seconds = start.elapsed().as_secs_f64();
        let slices: usize = w.services.iter().map(|s| s.slices.len()).sum();
        let endpoints: usize = w
            .services
            .iter()
            .flat_map(|s| &s.slices)
            .map(|s| s.endpoints.len())
            .sum();
        let objects = 1 + w.nodes.len() + w.services.len() + slices;
        Ok(WriteFigures {
            nodes: w.nodes.len(),
            services: w.services.len(),
            slices,
            endpoints,
            objects,
            seconds,
            objects_per_second: objects as f64 / seconds.max(1e-9),
            concurrency: self.concurrency,
        })
    }

    /// Node status is normally written by the kubelet through the status subresource. The API
    /// server keeps the status given at creation; should a version drop it, write it here.
    async fn ensure_node_status(&self, w: &Workload) -> anyhow::Result<()> {
        let Some(first) = w.nodes.first() else {
            return Ok(());
        };
        let got = self.nodes().get(&first.name).await?;
        let has = got
            .status
            .and_then(|s| s.addresses)
            .is_some_and(|a| !a.is_empty());
        if has {
            return Ok(());
        }
        println!("[bench] the API server dropped Node status on create; writing it");
        let nodes = self.nodes();
        futures::stream::iter(w.nodes.iter().map(Ok::<_, anyhow::Error>))
            .try_for_each_concurrent(self.concurrency, |n| {
                let nodes = &nodes;
                async move {
                    let patch = json!({"status": node_json(n)["status"].clone()});
                    nodes
                        .patch_status(&n.name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .with_context(|| format!("writing status of Node {}", n.name))?;
                    Ok(())
                }
            })
            .await
    }

    /// Writes a slice's endpoints with a fresh trigger time; returns that time.
    pub async fn update_slice(&self, svc: &str, s: &SliceState) -> anyhow::Result<SystemTime> {
        let (t, trigger) = trigger_now();
        let patch = json!({
            "metadata": {"annotations": {TRIGGER_ANNOTATION: trigger},
                         "labels": {"kubernetes.io/service-name": svc}},
            "endpoints": endpoints_json(&s.endpoints),
        });
        self.slices()
            .patch(&s.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("updating EndpointSlice {}", s.name))?;
        Ok(t)
    }

    /// Updates many slices concurrently; returns each write's trigger time.
    pub async fn update_slices(
        &self,
        updates: &[(String, SliceState)],
    ) -> anyhow::Result<Vec<SystemTime>> {
        futures::stream::iter(updates.iter())
            .map(|(svc, s)| self.update_slice(svc, s))
            .buffer_unordered(self.concurrency)
            .try_collect()
            .await
    }

    /// Creates a Service and its slices; returns the slices' trigger times.
    pub async fn create_service(&self, s: &ServiceState) -> anyhow::Result<Vec<SystemTime>> {
        let obj = service_object(s)?;
        self.services()
            .create(&PostParams::default(), &obj)
            .await
            .with_context(|| format!("creating Service {}", s.name))?;
        let mut times = Vec::new();
        for sl in &s.slices {
            let (t, trigger) = trigger_now();
            let obj = slice_object(&s.name, sl, &trigger)?;
            self.slices()
                .create(&PostParams::default(), &obj)
                .await
                .with_context(|| format!("creating EndpointSlice {}", sl.name))?;
            times.push(t);
        }
        Ok(times)
    }

    /// Deletes a Service and its slices.
    pub async fn delete_service(&self, s: &ServiceState) -> anyhow::Result<()> {
        self.services()
            .delete(&s.name, &DeleteParams::default())
            .await
            .with_context(|| format!("deleting Service {}", s.name))?;
        for sl in &s.slices {
            self.slices()
                .delete(&sl.name, &DeleteParams::default())
                .await
                .with_context(|| format!("deleting EndpointSlice {}", sl.name))?;
        }
        Ok(())
    }

    /// The API server's /metrics (admin token).
    pub async fn apiserver_metrics(&self) -> anyhow::Result<String> {
        let req = http::Request::get("/metrics").body(Vec::new())?;
        let text = self
            .client
            .request_text(req)
            .await
            .context("reading the API server's /metrics")?;
        if text.is_empty() {
            bail!("empty /metrics from the API server");
        }
        Ok(text)
    }
}

/// Prints a progress line every 10% (and at the end).
fn progress(done: u32, total: usize, what: &str) {
    let step = (total / 10).max(1);
    if (done as usize).is_multiple_of(step) || done as usize == total {
        println!("[bench] wrote {done}/{total} {what}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_addressed_in_its_ranges() {
        let w = Workload::new(250, 5, 20, &["192.168.77.10".parse().unwrap()]);
        assert_eq!(w.services.len(), 251);
        assert_eq!(w.services[0].slices.len(), 1);
        assert_eq!(w.services[250].name, "rollout");
        assert_eq!(w.services[250].slices[0].endpoints.len(), 100);
        assert_eq!(w.nodes[0].ip.to_string(), "192.168.77.10");
        assert_eq!(w.nodes[1].ip.to_string(), "100.64.0.1");
        let svc: ipnet::Ipv4Net = SERVICE_CIDR.parse().unwrap();
        let pods: ipnet::Ipv4Net = POD_CIDR.parse().unwrap();
        assert!(svc.contains(&cluster_ip(400_000)));
        for s in &w.services {
            assert!(svc.contains(&s.ip));
            for e in s.slices.iter().flat_map(|s| &s.endpoints) {
                assert!(pods.contains(&e.ip), "{}", e.ip);
            }
        }
        let f = w.fresh_endpoint(3);
        assert!(pods.contains(&f.ip));
        assert!(f.ip > w.services[250].slices[0].endpoints[99].ip);
        let extra = w.extra_service(0);
        assert!(svc.contains(&extra.ip));
        assert_eq!(extra.slices[0].endpoints.len(), 5);
    }

    #[test]
    fn many_endpoints_split_into_slices() {
        let w = Workload::new(1, 250, 3, &[]);
        let sizes: Vec<usize> = w.services[0]
            .slices
            .iter()
            .map(|s| s.endpoints.len())
            .collect();
        assert_eq!(sizes, vec![100, 100, 50]);
    }

    #[test]
    fn trigger_times_are_rfc3339_with_nanoseconds() {
        let (_, t) = trigger_now();
        assert!(t.ends_with('Z') && t.contains('.'), "{t}");
        let parsed: k8s_openapi::jiff::Timestamp = t.parse().unwrap();
        assert!(parsed.as_second() > 0);
    }
}
