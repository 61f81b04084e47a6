//! The variants on rulesets the brain computes from objects, and the grouping held against an
//! evaluation of every node one by one.
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{Value, json};
use splitproxy_proto::v1::{PacketFate, ServiceTraffic, service_traffic::Kind};

use super::*;
use crate::desired::SharedRuleset;
use crate::index::Index;
use crate::metrics::Metrics;
use crate::objects::{self, ObjectKey, ServiceFilter};
use crate::overlay::Overlays;
use crate::rules::{DetectLocalMode, RulesConfig};
use crate::service_view::{ServiceQuery, ServiceView, render};

struct Cluster {
    index: Index,
    config: RulesConfig,
}

impl Cluster {
    /// `nodes` as (name, zone), addresses 192.168.77.(i+1), pods 10.244.(i+1).0/24.
    fn new(nodes: &[(&str, &str)]) -> Cluster {
        let mut c = Cluster {
            index: Index::default(),
            config: RulesConfig {
                service_cidrs: vec!["10.96.0.0/16".parse().unwrap()],
                cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
                detect_local: DetectLocalMode::ClusterCidr,
                ..RulesConfig::default()
            },
        };
        for (i, (name, zone)) in nodes.iter().enumerate() {
            let mut labels = json!({});
            if !zone.is_empty() {
                labels["topology.kubernetes.io/zone"] = json!(zone);
            }
            let n: Node = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": labels},
                "spec": {"podCIDRs": [format!("10.244.{}.0/24", i + 1)]},
                "status": {"addresses": [
                    {"type": "InternalIP", "address": format!("192.168.77.{}", i + 1)},
                ]},
            }))
            .unwrap();
            c.index
                .apply_node(name.to_string(), Some(objects::node(&n)));
        }
        c
    }

    fn service(&mut self, v: Value) {
        let svc: Service = serde_json::from_value(v).unwrap();
        let filter = ServiceFilter {
            proxy_name: String::new(),
        };
        let info = objects::service(&svc, &filter, &Metrics::default());
        self.index.apply_service(ObjectKey::of(&svc), info);
    }

    fn slice(&mut self, v: Value) {
        let s: EndpointSlice = serde_json::from_value(v).unwrap();
        let info = objects::slice(&s, &Metrics::default());
        self.index.apply_slice(ObjectKey::of(&s), info);
    }

    /// What the brain would publish: the shared model and every node's overlay.
    fn publication(&self) -> Publication {
        let mut shared = SharedRuleset::new(self.config.clone());
        shared.rebuild(&self.index);
        let mut overlays = Overlays::new(self.config.clone());
        overlays.rebuild(&self.index, &mut shared);
        shared.prune();
        Publication {
            version: 7,
            api: Default::default(),
            shared: Arc::new(shared.model().clone()),
            overlays: self
                .index
                .nodes()
                .map(|n| {
                    let o = overlays.model(&n.name).cloned().unwrap_or_default();
                    (n.name.clone(), Arc::new(o))
                })
                .collect(),
        }
    }

    fn view(&self, name: &str) -> ServiceView {
        let (reply, _) = tokio::sync::oneshot::channel();
        let q = ServiceQuery {
            key: ObjectKey::new("default", name),
            zones: true,
            reply,
        };
        ServiceView::of(&self.index, &q).expect("the Service")
    }

    fn variants(&self, name: &str) -> Variants {
        let p = self.publication();
        let v = compute(&self.view(name), &p);
        check_against_every_node(&self.view(name), &p, &v);
        v
    }
}

/// The grouped answer equals evaluating every node on its own: each node evaluates to its
/// variant's traffic, and every node is in exactly one variant.
fn check_against_every_node(view: &ServiceView, p: &Publication, v: &Variants) {
    let (dests, _) = destinations(&view.info);
    let tables = table_keys(&p.shared);
    let terminating = terminating_addresses(view);
    let mut seen = 0;
    for (node, _) in p.overlays.iter() {
        let model = p.held(node).unwrap().full();
        let addresses = crate::explain::node_addresses(&model);
        let own: Vec<ServiceTraffic> = merge(
            dests
                .iter()
                .map(|d| {
                    let client = external_client(
                        &p.shared,
                        &tables[family_index(d.family())],
                        d,
                        &d.prefix(),
                    );
                    evaluate(&model, &addresses, d, client, &terminating)
                })
                .collect(),
        );
        let variant = v
            .variants
            .iter()
            .find(|x| x.nodes.iter().any(|n| n == node))
            .unwrap_or_else(|| panic!("{node} in no variant: {v:#?}"));
        assert_eq!(variant.traffic, own, "{node}'s own evaluation differs");
        seen += 1;
    }
    let counted: u32 = v.variants.iter().map(|x| x.node_count).sum();
    assert_eq!(counted as usize, seen);
}

fn service(name: &str, ty: &str, ip: &str, ports: Value, extra: Value) -> Value {
    let mut spec = json!({"type": ty, "clusterIP": ip, "clusterIPs": [ip], "ports": ports});
    let mut status = json!({});
    if let Value::Object(m) = extra {
        for (k, v) in m {
            if k == "status" {
                status = v;
            } else {
                spec[k] = v;
            }
        }
    }
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"namespace": "default", "name": name}, "spec": spec, "status": status})
}

/// An endpoint: address, node, zone hint ("" for none), ready (else serving and terminating).
type Ep<'a> = (&'a str, &'a str, &'a str, bool);

fn slice(name: &str, svc: &str, eps: &[Ep]) -> Value {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|(ip, node, hint, ready)| {
            let mut e = json!({"addresses": [ip], "nodeName": node,
                "conditions": {"ready": ready, "serving": true, "terminating": !ready}});
            if !hint.is_empty() {
                e["hints"] = json!({"forZones": [{"name": hint}]});
            }
            e
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"namespace": "default", "name": name,
                        "labels": {"kubernetes.io/service-name": svc}},
           "addressType": "IPv4",
           "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
           "endpoints": endpoints})
}

fn http(node_port: Option<u16>) -> Value {
    let mut p = json!({"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080});
    if let Some(np) = node_port {
        p["nodePort"] = json!(np);
    }
    json!([p])
}

fn traffic(v: &ServiceVariant, kind: Kind) -> &ServiceTraffic {
    v.traffic
        .iter()
        .find(|t| t.kind() == kind)
        .unwrap_or_else(|| panic!("no {kind:?} traffic in {v:#?}"))
}

/// (address:port, share in per mille) of a traffic entry.
fn eps(t: &ServiceTraffic) -> Vec<(String, u32)> {
    t.endpoints
        .iter()
        .map(|e| {
            (
                format!("{}:{}", e.address, e.port),
                (e.share * 1000.0).round() as u32,
            )
        })
        .collect()
}

fn variant_of<'a>(v: &'a Variants, node: &str) -> &'a ServiceVariant {
    v.variants
        .iter()
        .find(|x| x.nodes.iter().any(|n| n == node))
        .unwrap()
}

#[test]
fn a_plain_service_is_one_variant() {
    let mut c = Cluster::new(&[("node-a", ""), ("node-b", ""), ("node-c", "")]);
    c.service(service(
        "web",
        "ClusterIP",
        "10.96.0.10",
        http(None),
        json!({}),
    ));
    c.slice(slice(
        "web-1",
        "web",
        &[
            ("10.244.1.5", "node-a", "", true),
            ("10.244.2.5", "node-b", "", true),
        ],
    ));
    let v = c.variants("web");
    assert_eq!(v.version, 7);
    assert_eq!(v.variants.len(), 1, "{v:#?}");
    let only = &v.variants[0];
    assert_eq!(only.node_count, 3);
    assert_eq!(only.nodes, ["node-a", "node-b", "node-c"]);
    assert_eq!(only.traffic.len(), 1);
    let t = traffic(only, Kind::ClusterIp);
    assert_eq!(t.destinations, ["10.96.0.10:80"]);
    assert_eq!(t.fate(), PacketFate::Dnat);
    assert_eq!(
        eps(t),
        [
            ("10.244.1.5:8080".into(), 500),
            ("10.244.2.5:8080".into(), 500)
        ]
    );
    assert!(t.exact && !t.terminating_fallback);
    let text = render::variants(&v);
    assert!(
        text.starts_with("1 variant over 3 nodes (publication 7)")
            && text.contains("ClusterIP 10.96.0.10:80 (TCP http, from the node itself) -> 10.244.1.5:8080 50%, 10.244.2.5:8080 50%"),
        "{text}"
    );
}

/// externalTrafficPolicy Local: a node with local endpoints sends external traffic to them
/// only, a node without drops it; cluster traffic goes everywhere on every node.
#[test]
fn external_traffic_policy_local_gives_each_node_its_own_endpoints() {
    let mut c = Cluster::new(&[("node-a", ""), ("node-b", ""), ("node-c", "")]);
    c.service(service(
        "lb",
        "LoadBalancer",
        "10.96.0.20",
        http(Some(30080)),
        json!({"externalTrafficPolicy": "Local",
               "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.20"}]}}}),
    ));
    c.slice(slice(
        "lb-1",
        "lb",
        &[
            ("10.244.1.5", "node-a", "", true),
            ("10.244.1.6", "node-a", "", true),
            ("10.244.2.5", "node-b", "", true),
        ],
    ));
    let v = c.variants("lb");
    assert_eq!(v.variants.len(), 3, "{v:#?}");
    let all = [
        ("10.244.1.5:8080".to_string(), 333),
        ("10.244.1.6:8080".to_string(), 333),
        ("10.244.2.5:8080".to_string(), 333),
    ];
    for node in ["node-a", "node-b", "node-c"] {
        let var = variant_of(&v, node);
        assert_eq!(var.node_count, 1);
        assert_eq!(eps(traffic(var, Kind::ClusterIp)), all, "{node}");
    }
    let a = variant_of(&v, "node-a");
    let np = traffic(a, Kind::NodePort);
    assert_eq!(np.destinations, ["<node>:30080"]);
    assert_eq!(
        eps(np),
        [
            ("10.244.1.5:8080".into(), 500),
            ("10.244.1.6:8080".into(), 500)
        ]
    );
    assert_eq!(eps(traffic(a, Kind::LoadBalancerIp)), eps(np));
    let b = variant_of(&v, "node-b");
    assert_eq!(
        eps(traffic(b, Kind::NodePort)),
        [("10.244.2.5:8080".into(), 1000)]
    );
    let none = variant_of(&v, "node-c");
    for kind in [Kind::NodePort, Kind::LoadBalancerIp] {
        let t = traffic(none, kind);
        assert_eq!(t.fate(), PacketFate::Dropped, "{t:?}");
        assert!(t.endpoints.is_empty());
    }
    let text = render::variants(&v);
    assert!(
        text.contains("NodePort <node>:30080 (TCP http, from a client outside the cluster (203.0.113.7)) -> no endpoint: dropped"),
        "{text}"
    );
}

/// Topology hints: each zone's nodes use the endpoints hinted for their zone, and the variant
/// names the zone.
#[test]
fn topology_hints_make_a_variant_per_zone() {
    let mut c = Cluster::new(&[
        ("node-a", "zone-1"),
        ("node-b", "zone-1"),
        ("node-c", "zone-2"),
    ]);
    c.service(service(
        "topo",
        "ClusterIP",
        "10.96.0.30",
        http(None),
        json!({}),
    ));
    c.slice(slice(
        "topo-1",
        "topo",
        &[
            ("10.244.1.5", "node-a", "zone-1", true),
            ("10.244.3.5", "node-c", "zone-2", true),
        ],
    ));
    let v = c.variants("topo");
    assert_eq!(v.variants.len(), 2, "{v:#?}");
    let z1 = &v.variants[0];
    assert_eq!((z1.node_count, z1.zone.as_str()), (2, "zone-1"));
    assert_eq!(z1.nodes, ["node-a", "node-b"]);
    assert_eq!(
        eps(traffic(z1, Kind::ClusterIp)),
        [("10.244.1.5:8080".into(), 1000)]
    );
    let z2 = &v.variants[1];
    assert_eq!((z2.node_count, z2.zone.as_str()), (1, "zone-2"));
    assert_eq!(
        eps(traffic(z2, Kind::ClusterIp)),
        [("10.244.3.5:8080".into(), 1000)]
    );
}

/// Serving, terminating endpoints are used when none is ready, and the answer says so;
/// internalTrafficPolicy Local drops on a node without one.
#[test]
fn terminating_fallback_and_internal_local() {
    let mut c = Cluster::new(&[("node-a", ""), ("node-b", "")]);
    c.service(service(
        "old",
        "ClusterIP",
        "10.96.0.40",
        http(None),
        json!({}),
    ));
    c.slice(slice(
        "old-1",
        "old",
        &[("10.244.1.5", "node-a", "", false)],
    ));
    let v = c.variants("old");
    assert_eq!(v.variants.len(), 1);
    let t = traffic(&v.variants[0], Kind::ClusterIp);
    assert!(
        t.terminating_fallback && t.endpoints[0].terminating,
        "{t:?}"
    );
    assert!(render::variants(&v).contains("(terminating)"));

    c.service(service(
        "itp",
        "ClusterIP",
        "10.96.0.41",
        http(None),
        json!({"internalTrafficPolicy": "Local"}),
    ));
    c.slice(slice("itp-1", "itp", &[("10.244.1.7", "node-a", "", true)]));
    let v = c.variants("itp");
    assert_eq!(v.variants.len(), 2, "{v:#?}");
    let a = traffic(variant_of(&v, "node-a"), Kind::ClusterIp);
    assert_eq!(eps(a), [("10.244.1.7:8080".into(), 1000)]);
    let b = traffic(variant_of(&v, "node-b"), Kind::ClusterIp);
    assert_eq!(b.fate(), PacketFate::Dropped, "{b:?}");
}

/// A Service without endpoints is rejected everywhere, in one variant.
#[test]
fn no_endpoints_is_one_rejecting_variant() {
    let mut c = Cluster::new(&[("node-a", ""), ("node-b", "")]);
    c.service(service(
        "empty",
        "NodePort",
        "10.96.0.50",
        http(Some(30050)),
        json!({}),
    ));
    let v = c.variants("empty");
    assert_eq!(v.variants.len(), 1, "{v:#?}");
    for kind in [Kind::ClusterIp, Kind::NodePort] {
        assert_eq!(
            traffic(&v.variants[0], kind).fate(),
            PacketFate::Rejected,
            "{kind:?}"
        );
    }
}

/// Bounded: 40 nodes each with an endpoint of its own under externalTrafficPolicy Local are 41
/// variants (one without); 16 are listed, the rest counted, and each lists at most 10 nodes.
#[test]
fn variants_and_their_nodes_are_capped() {
    let names: Vec<String> = (0..60).map(|i| format!("node-{i:02}")).collect();
    let nodes: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "")).collect();
    let mut c = Cluster::new(&nodes);
    c.service(service(
        "ds",
        "NodePort",
        "10.96.0.60",
        http(Some(30060)),
        json!({"externalTrafficPolicy": "Local"}),
    ));
    let ips: Vec<String> = (0..40).map(|i| format!("10.244.{}.9", i + 1)).collect();
    let eps: Vec<Ep> = (0..40)
        .map(|i| (ips[i].as_str(), names[i].as_str(), "", true))
        .collect();
    c.slice(slice("ds-1", "ds", &eps));
    let p = c.publication();
    let v = compute(&c.view("ds"), &p);
    assert_eq!(v.variants.len(), MAX_VARIANTS);
    assert_eq!(v.left_out as usize, 41 - MAX_VARIANTS, "{v:#?}");
    let listed: u32 = v.variants.iter().map(|x| x.node_count).sum();
    assert_eq!(listed + v.nodes_left_out, 60);
    // The 20 nodes without an endpoint come first, with 10 names.
    assert_eq!(v.variants[0].node_count, 20);
    assert_eq!(v.variants[0].nodes.len(), SAMPLE_NODES);
    assert_eq!(v.variants[0].nodes[0], "node-40");
    let text = render::variants(&v);
    assert!(
        text.starts_with(
            "41 variants over 60 nodes (publication 7); 25 variants with 25 nodes not listed"
        ),
        "{text}"
    );
    assert!(
        text.contains("(node-40, node-41,") && text.contains(", 10 more)"),
        "{text}"
    );
}

/// Nothing published yet: no variants, said so.
#[test]
fn before_the_first_publication() {
    let mut c = Cluster::new(&[("node-a", "")]);
    c.service(service(
        "web",
        "ClusterIP",
        "10.96.0.10",
        http(None),
        json!({}),
    ));
    let v = compute(&c.view("web"), &Publication::default());
    assert_eq!(v, Variants::default());
    assert_eq!(render::variants(&v), "no desired state published yet");
}

/// The cost at scale (run with `--ignored --nocapture`, in release): 5,000 nodes in three zones;
/// a plain Service, a topology-hinted one, and the worst case, an externalTrafficPolicy Local
/// Service with an endpoint on every node (5,000 distinct views). The answer stays small.
#[test]
#[ignore]
fn at_5000_nodes() {
    use prost::Message;
    const NODES: usize = 5000;
    let names: Vec<String> = (0..NODES).map(|i| format!("node-{i:04}")).collect();
    let zones = ["zone-1", "zone-2", "zone-3"];
    let nodes: Vec<(&str, &str)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), zones[i % 3]))
        .collect();
    let mut c = Cluster::new(&nodes);
    let ip = |i: usize| format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256);
    let ips: Vec<String> = (0..NODES).map(ip).collect();
    c.service(service(
        "web",
        "ClusterIP",
        "10.96.0.10",
        http(None),
        json!({}),
    ));
    let web: Vec<Ep> = (0..10)
        .map(|i| (ips[i].as_str(), names[i].as_str(), "", true))
        .collect();
    c.slice(slice("web-1", "web", &web));
    c.service(service(
        "topo",
        "ClusterIP",
        "10.96.0.11",
        http(None),
        json!({}),
    ));
    let topo: Vec<Ep> = (10..16)
        .map(|i| (ips[i].as_str(), names[i].as_str(), zones[i % 3], true))
        .collect();
    c.slice(slice("topo-1", "topo", &topo));
    c.service(service(
        "ds",
        "NodePort",
        "10.96.0.12",
        http(Some(30012)),
        json!({"externalTrafficPolicy": "Local"}),
    ));
    let ds: Vec<Ep> = (0..NODES)
        .map(|i| (ips[i].as_str(), names[i].as_str(), "", true))
        .collect();
    c.slice(slice("ds-1", "ds", &ds));
    let built = std::time::Instant::now();
    let p = c.publication();
    eprintln!(
        "publication of {NODES} nodes built in {:?}",
        built.elapsed()
    );
    for name in ["web", "topo", "ds"] {
        let view = c.view(name);
        let start = std::time::Instant::now();
        let v = compute(&view, &p);
        let took = start.elapsed();
        let mut out = splitproxy_proto::v1::GetServiceResponse::default();
        crate::service_view::fill(&mut out, &v);
        eprintln!(
            "{name}: {} variants listed, {} left out, computed in {took:?}, {} bytes",
            v.variants.len(),
            v.left_out,
            out.encoded_len()
        );
        assert!(v.variants.len() <= MAX_VARIANTS);
        assert!(out.encoded_len() < 64 * 1024);
    }
}
