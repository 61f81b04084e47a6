//! `ExplainPacket`'s interpreter (`splitproxy_proto::explain`) on the rulesets the brain really
//! computes: the golden rulesets of `tests/golden/` (rebuilt here from the same objects, and
//! checked to render exactly as the golden files, so the explained IR is the one a reviewer
//! reads there) and per-node rulesets of representative Services (NodePort, traffic policies,
//! masquerading, hairpin, session affinity, source ranges, dual stack).
//!
//! The expectations are Service semantics (docs/semantics.md), stated independently of the
//! rules: a disagreement means either the interpreter or the rules are wrong. The same
//! interpreter is checked against real packets in the lab (`tests/src/scenario.rs`, every
//! scenario's probes explained through the brain's gRPC).
use std::net::IpAddr;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{Value, json};
use splitproxy_brain::index::Index;
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, ObjectKey, ServiceFilter};
use splitproxy_brain::rules::{self, RulesConfig};
use splitproxy_proto::explain::{self, Origin, Packet};
use splitproxy_proto::model::Model;
use splitproxy_proto::render;
use splitproxy_proto::v1::{ExplainPacketResponse, PacketFate, RejectType, Ruleset};

const NS: &str = "default";

struct Cluster {
    index: Index,
    config: RulesConfig,
    metrics: Metrics,
}

impl Cluster {
    /// No nodes, as the golden cases of `tests/rules.rs`.
    fn bare(service_cidrs: &[&str]) -> Self {
        Cluster {
            index: Index::default(),
            config: RulesConfig {
                service_cidrs: service_cidrs.iter().map(|c| c.parse().unwrap()).collect(),
                ..RulesConfig::default()
            },
            metrics: Metrics::default(),
        }
    }

    /// Two dual-stack nodes, as `tests/semantics.rs` (ClusterCIDR mode): node-a
    /// (192.168.77.1, fd00:77::1, pods 10.244.1.0/24) and node-b (.2, pods 10.244.2.0/24).
    fn nodes() -> Self {
        let mut c = Cluster {
            index: Index::default(),
            config: RulesConfig {
                service_cidrs: vec![
                    "10.96.0.0/16".parse().unwrap(),
                    "fd00:96::/112".parse().unwrap(),
                ],
                cluster_cidrs: vec![
                    "10.244.0.0/16".parse().unwrap(),
                    "fd00:244::/48".parse().unwrap(),
                ],
                detect_local: rules::DetectLocalMode::ClusterCidr,
                ..RulesConfig::default()
            },
            metrics: Metrics::default(),
        };
        for (i, name) in ["node-a", "node-b"].into_iter().enumerate() {
            let n: Node = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name},
                "spec": {"podCIDRs": [format!("10.244.{}.0/24", i + 1), format!("fd00:244:0:{}::/64", i + 1)]},
                "status": {"addresses": [
                    {"type": "InternalIP", "address": format!("192.168.77.{}", i + 1)},
                    {"type": "InternalIP", "address": format!("fd00:77::{}", i + 1)},
                ]},
            }))
            .unwrap();
            c.index.apply_node(name.into(), Some(objects::node(&n)));
        }
        c
    }

    fn service(&mut self, v: Value) {
        let svc: Service = serde_json::from_value(v).expect("test Service");
        let filter = ServiceFilter {
            proxy_name: self.config.service_proxy_name.clone(),
        };
        let info = objects::service(&svc, &filter, &self.metrics);
        self.index.apply_service(ObjectKey::of(&svc), info);
    }

    fn slice(&mut self, v: Value) {
        let s: EndpointSlice = serde_json::from_value(v).expect("test EndpointSlice");
        let info = objects::slice(&s, &self.metrics);
        self.index.apply_slice(ObjectKey::of(&s), info);
    }

    fn node(&self, node: &str) -> Model {
        Model::from_ruleset(&rules::node_ruleset(&self.index, &self.config, node))
    }
}

fn service(name: &str, ty: &str, ips: &[&str], ports: Value, extra: Value) -> Value {
    let mut spec = json!({"type": ty, "clusterIP": ips[0], "clusterIPs": ips, "ports": ports});
    if ips.len() > 1 {
        spec["ipFamilyPolicy"] = json!("RequireDualStack");
    }
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
           "metadata": {"namespace": NS, "name": name}, "spec": spec, "status": status})
}

/// An EndpointSlice: `ports` (name, protocol, port), endpoints (address, node).
fn slice(name: &str, svc: &str, family: &str, ports: Value, eps: &[(&str, &str)]) -> Value {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|(ip, node)| {
            let mut e = json!({"addresses": [ip], "conditions": {"ready": true, "serving": true, "terminating": false}});
            if !node.is_empty() {
                e["nodeName"] = json!(node);
            }
            e
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"namespace": NS, "name": name, "labels": {"kubernetes.io/service-name": svc}},
           "addressType": family, "ports": ports, "endpoints": endpoints})
}

fn golden(name: &str, rs: &Ruleset) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.nft"));
    let want = std::fs::read_to_string(&path).unwrap();
    let got: String = rs.tables.iter().map(render::table).collect();
    assert!(
        got == want,
        "{name}: the rebuilt ruleset is not the golden one"
    );
}

/// A packet from `src` to `dst:port` arriving from outside the node (or sent by it).
fn pkt(src: &str, dst: &str, port: u16, proto: u8, origin: Origin, local: &[&str]) -> Packet {
    Packet {
        saddr: src.parse().unwrap(),
        sport: 40000,
        daddr: dst.parse().unwrap(),
        dport: port,
        l4proto: proto,
        iifname: Some(if origin == Origin::Local { "" } else { "eth0" }.into()),
        origin,
        established: false,
        mark: 0,
        local: local.iter().map(|a| a.parse().unwrap()).collect(),
    }
}

fn arriving(src: &str, dst: &str, port: u16) -> Packet {
    pkt(src, dst, port, 6, Origin::Arriving, &[])
}

/// (endpoint, share, masquerade) per DNAT outcome, sorted.
fn candidates(r: &ExplainPacketResponse) -> Vec<(String, u32, bool)> {
    let mut v: Vec<_> = r
        .outcomes
        .iter()
        .filter(|o| o.fate == PacketFate::Dnat as i32)
        .map(|o| {
            let ip: IpAddr = o.dnat_address.parse().unwrap();
            (
                std::net::SocketAddr::new(ip, o.dnat_port as u16).to_string(),
                (o.share * 1000.0).round() as u32,
                o.masquerade,
            )
        })
        .collect();
    v.sort();
    v
}

fn fate(r: &ExplainPacketResponse) -> PacketFate {
    PacketFate::try_from(r.fate).unwrap()
}

fn explain(m: &Model, p: &Packet) -> ExplainPacketResponse {
    explain::explain(m, p, vec![])
}

fn c(ep: &str, share: u32, masq: bool) -> (String, u32, bool) {
    (ep.to_string(), share, masq)
}

#[test]
fn golden_clusterip_with_three_endpoints_unknown_ports_and_free_addresses() {
    let mut cl = Cluster::bare(&["10.96.0.0/16"]);
    cl.service(service(
        "web",
        "ClusterIP",
        &["10.96.0.10"],
        json!([{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]),
        json!({}),
    ));
    cl.slice(slice(
        "web-abc",
        "web",
        "IPv4",
        json!([{"name": "http", "protocol": "TCP", "port": 8080}]),
        &[("10.244.1.1", ""), ("10.244.1.2", ""), ("10.244.1.3", "")],
    ));
    let rs = rules::ruleset(&cl.index, &cl.config);
    golden("a_tcp_three_endpoints", &rs);
    let m = Model::from_ruleset(&rs);

    let r = explain(&m, &arriving("10.244.5.5", "10.96.0.10", 80));
    assert_eq!(fate(&r), PacketFate::Dnat);
    assert_eq!(
        candidates(&r),
        vec![
            c("10.244.1.1:8080", 333, false),
            c("10.244.1.2:8080", 333, false),
            c("10.244.1.3:8080", 333, false)
        ],
        "{}",
        r.text
    );
    assert!(r.exact, "{}", r.text);
    assert!(
        r.text
            .contains("@service-ports-3: 10.96.0.10 . tcp . 80 matches"),
        "{}",
        r.text
    );
    assert!(r.text.contains("numgen random mod 3"), "{}", r.text);

    // An unknown port of an active ClusterIP: refused in forward (cluster-ips-check).
    let r = explain(&m, &arriving("10.244.5.5", "10.96.0.10", 81));
    assert_eq!(fate(&r), PacketFate::Rejected, "{}", r.text);
    assert_eq!(
        r.outcomes[0].reject.unwrap().r#type,
        RejectType::TcpRst as i32
    );
    assert!(
        r.path.iter().any(|s| s.chain == "cluster-ips-check"),
        "{}",
        r.text
    );
    // UDP: ICMP port unreachable.
    let r = explain(
        &m,
        &pkt("10.244.5.5", "10.96.0.10", 81, 17, Origin::Arriving, &[]),
    );
    assert_eq!(
        r.outcomes[0].reject.unwrap().r#type,
        RejectType::IcmpUnreach as i32,
        "{}",
        r.text
    );
    // An unallocated address of the service CIDR: dropped.
    let r = explain(&m, &arriving("10.244.5.5", "10.96.7.7", 80));
    assert_eq!(fate(&r), PacketFate::Dropped, "{}", r.text);
    // Outside every service CIDR: untouched.
    let r = explain(&m, &arriving("10.244.5.5", "10.97.7.7", 80));
    assert_eq!(fate(&r), PacketFate::Accepted, "{}", r.text);
    assert_eq!(r.outcomes[0].route, "forwarded to 10.97.7.7:80");
}

#[test]
fn golden_no_endpoints_udp_and_dual_stack() {
    // e_no_slices: refused at once.
    let mut cl = Cluster::bare(&["10.96.0.0/16"]);
    cl.service(service(
        "idle",
        "ClusterIP",
        &["10.96.0.50"],
        json!([{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]),
        json!({}),
    ));
    let rs = rules::ruleset(&cl.index, &cl.config);
    golden("e_no_slices", &rs);
    let m = Model::from_ruleset(&rs);
    let r = explain(&m, &arriving("10.244.5.5", "10.96.0.50", 80));
    assert_eq!(fate(&r), PacketFate::Rejected, "{}", r.text);
    assert!(
        r.path
            .iter()
            .any(|s| s.set == "no-endpoint-services" && s.matched),
        "{}",
        r.text
    );
    // From the node itself: refused in output.
    let r = explain(
        &m,
        &pkt(
            "192.168.77.1",
            "10.96.0.50",
            80,
            6,
            Origin::Local,
            &["192.168.77.1"],
        ),
    );
    assert_eq!(fate(&r), PacketFate::Rejected, "{}", r.text);

    // k_udp: two endpoints, half each.
    let mut cl = Cluster::bare(&["10.96.0.0/16"]);
    cl.service(service(
        "dns",
        "ClusterIP",
        &["10.96.0.110"],
        json!([{"name": "dns", "protocol": "UDP", "port": 53, "targetPort": 5353}]),
        json!({}),
    ));
    cl.slice(slice(
        "dns-abc",
        "dns",
        "IPv4",
        json!([{"name": "dns", "protocol": "UDP", "port": 5353}]),
        &[("10.244.11.1", ""), ("10.244.11.2", "")],
    ));
    let rs = rules::ruleset(&cl.index, &cl.config);
    golden("k_udp", &rs);
    let m = Model::from_ruleset(&rs);
    let r = explain(
        &m,
        &pkt("10.244.5.5", "10.96.0.110", 53, 17, Origin::Arriving, &[]),
    );
    assert_eq!(
        candidates(&r),
        vec![
            c("10.244.11.1:5353", 500, false),
            c("10.244.11.2:5353", 500, false)
        ]
    );
    // TCP to the UDP port: not a Service port; refused as an unknown port of the ClusterIP.
    let r = explain(&m, &arriving("10.244.5.5", "10.96.0.110", 53));
    assert_eq!(fate(&r), PacketFate::Rejected, "{}", r.text);

    // l_dual_stack: one IPv4 endpoint, two IPv6 ones.
    let mut cl = Cluster::bare(&["10.96.0.0/16", "fd00:96::/112"]);
    cl.service(service(
        "web",
        "ClusterIP",
        &["10.96.0.120", "fd00:96::120"],
        json!([{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]),
        json!({}),
    ));
    let ports = json!([{"name": "http", "protocol": "TCP", "port": 8080}]);
    cl.slice(slice(
        "web-v4",
        "web",
        "IPv4",
        ports.clone(),
        &[("10.244.12.1", "")],
    ));
    cl.slice(slice(
        "web-v6",
        "web",
        "IPv6",
        ports,
        &[("fd00:244::12:1", ""), ("fd00:244::12:2", "")],
    ));
    let rs = rules::ruleset(&cl.index, &cl.config);
    golden("l_dual_stack", &rs);
    let m = Model::from_ruleset(&rs);
    let r = explain(&m, &arriving("10.244.5.5", "10.96.0.120", 80));
    assert_eq!(
        candidates(&r),
        vec![c("10.244.12.1:8080", 1000, false)],
        "{}",
        r.text
    );
    let r = explain(&m, &arriving("fd00:244::5:5", "fd00:96::120", 80));
    assert_eq!(
        candidates(&r),
        vec![
            c("[fd00:244::12:1]:8080", 500, false),
            c("[fd00:244::12:2]:8080", 500, false)
        ],
        "{}",
        r.text
    );
    // An unallocated IPv6 service address: dropped.
    let r = explain(&m, &arriving("fd00:244::5:5", "fd00:96::999", 80));
    assert_eq!(fate(&r), PacketFate::Dropped, "{}", r.text);
}

fn http_port(node_port: u32) -> Value {
    json!([{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080, "nodePort": node_port}])
}

fn http_slice(name: &str, svc: &str, eps: &[(&str, &str)]) -> Value {
    slice(
        name,
        svc,
        "IPv4",
        json!([{"name": "http", "protocol": "TCP", "port": 8080}]),
        eps,
    )
}

#[test]
fn node_port_cluster_policy_is_masqueraded_from_everywhere() {
    let mut cl = Cluster::nodes();
    cl.service(service(
        "np",
        "NodePort",
        &["10.96.0.20"],
        http_port(30080),
        json!({}),
    ));
    cl.slice(http_slice(
        "np-1",
        "np",
        &[("10.244.1.5", "node-a"), ("10.244.2.5", "node-b")],
    ));
    let a = cl.node("node-a");
    let both = |masq| {
        vec![
            c("10.244.1.5:8080", 500, masq),
            c("10.244.2.5:8080", 500, masq),
        ]
    };
    let node_a = ["192.168.77.1"];
    // From outside, from a pod, from the node itself: masqueraded (Cluster policy).
    let r = explain(
        &a,
        &pkt(
            "192.168.77.200",
            "192.168.77.1",
            30080,
            6,
            Origin::Arriving,
            &node_a,
        ),
    );
    assert_eq!(candidates(&r), both(true), "{}", r.text);
    let r = explain(
        &a,
        &pkt(
            "10.244.2.9",
            "192.168.77.1",
            30080,
            6,
            Origin::Arriving,
            &node_a,
        ),
    );
    assert_eq!(candidates(&r), both(true), "{}", r.text);
    let r = explain(
        &a,
        &pkt(
            "192.168.77.1",
            "192.168.77.1",
            30080,
            6,
            Origin::Local,
            &node_a,
        ),
    );
    assert_eq!(candidates(&r), both(true), "{}", r.text);
    // Not on node-b's address (node-a's NodePorts are its own), nor on another port.
    let r = explain(
        &a,
        &pkt(
            "192.168.77.200",
            "192.168.77.2",
            30080,
            6,
            Origin::Arriving,
            &node_a,
        ),
    );
    assert_eq!(fate(&r), PacketFate::Accepted, "{}", r.text);
    let r = explain(
        &a,
        &pkt(
            "192.168.77.200",
            "192.168.77.1",
            30081,
            6,
            Origin::Arriving,
            &node_a,
        ),
    );
    assert_eq!(fate(&r), PacketFate::Accepted, "{}", r.text);
    assert!(
        r.outcomes[0]
            .route
            .starts_with("delivered to a socket of this node"),
        "{}",
        r.text
    );
    // The ClusterIP: from a pod the source is kept, from outside the pod network masqueraded.
    let r = explain(&a, &arriving("10.244.2.9", "10.96.0.20", 80));
    assert_eq!(candidates(&r), both(false), "{}", r.text);
    let r = explain(&a, &arriving("192.168.77.200", "10.96.0.20", 80));
    assert_eq!(candidates(&r), both(true), "{}", r.text);
}

#[test]
fn external_traffic_policy_local_from_external_and_internal_sources() {
    let mut cl = Cluster::nodes();
    cl.service(service(
        "lb",
        "LoadBalancer",
        &["10.96.0.30"],
        http_port(30081),
        json!({
            "externalTrafficPolicy": "Local",
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.10"}]}},
        }),
    ));
    cl.slice(http_slice(
        "lb-1",
        "lb",
        &[("10.244.1.5", "node-a"), ("10.244.1.6", "node-a")],
    ));
    let a = cl.node("node-a");
    let b = cl.node("node-b");
    let local_a = vec![
        c("10.244.1.5:8080", 500, false),
        c("10.244.1.6:8080", 500, false),
    ];
    // External clients: node-a's own endpoints, source kept; node-b has none: dropped.
    for dst in ["192.168.77.1", "198.51.100.10"] {
        let port = if dst.starts_with("192") { 30081 } else { 80 };
        let r = explain(
            &a,
            &pkt(
                "192.168.77.200",
                dst,
                port,
                6,
                Origin::Arriving,
                &["192.168.77.1"],
            ),
        );
        assert_eq!(candidates(&r), local_a, "{dst}: {}", r.text);
    }
    let r = explain(
        &b,
        &pkt(
            "192.168.77.200",
            "192.168.77.2",
            30081,
            6,
            Origin::Arriving,
            &["192.168.77.2"],
        ),
    );
    assert_eq!(fate(&r), PacketFate::Dropped, "{}", r.text);
    assert!(
        r.text
            .contains("externalTrafficPolicy Local without local endpoints: drop"),
        "{}",
        r.text
    );
    let r = explain(&b, &arriving("192.168.77.200", "198.51.100.10", 80));
    assert_eq!(fate(&r), PacketFate::Dropped, "{}", r.text);
    // A pod on node-b: the cluster-wide endpoints, its source kept.
    let r = explain(&b, &arriving("10.244.2.9", "198.51.100.10", 80));
    assert_eq!(candidates(&r), local_a, "{}", r.text);
    let r = explain(
        &b,
        &pkt(
            "10.244.2.9",
            "192.168.77.2",
            30081,
            6,
            Origin::Arriving,
            &["192.168.77.2"],
        ),
    );
    assert_eq!(fate(&r), PacketFate::Dnat, "{}", r.text);
    // node-b itself: all endpoints, masqueraded (its own traffic to a Local-policy Service).
    let r = explain(
        &b,
        &pkt(
            "192.168.77.2",
            "198.51.100.10",
            80,
            6,
            Origin::Local,
            &["192.168.77.2"],
        ),
    );
    assert_eq!(
        candidates(&r),
        vec![
            c("10.244.1.5:8080", 500, true),
            c("10.244.1.6:8080", 500, true)
        ],
        "{}",
        r.text
    );
}

#[test]
fn hairpin_session_affinity_and_source_ranges() {
    let mut cl = Cluster::nodes();
    cl.service(service("aff", "ClusterIP", &["10.96.0.70"],
        json!([{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]),
        json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}}})));
    cl.slice(http_slice(
        "aff-1",
        "aff",
        &[("10.244.1.5", "node-a"), ("10.244.2.5", "node-b")],
    ));
    let a = cl.node("node-a");
    // A pod of the Service reaching itself: masqueraded (hairpin) for that endpoint only.
    let r = explain(&a, &arriving("10.244.1.5", "10.96.0.70", 80));
    assert_eq!(
        candidates(&r),
        vec![
            c("10.244.1.5:8080", 500, true),
            c("10.244.2.5:8080", 500, false)
        ],
        "{}",
        r.text
    );
    assert!(
        r.text
            .contains("@hairpin-endpoints: 10.244.1.5 . 10.244.1.5 matches"),
        "{}",
        r.text
    );
    // Session affinity: the dynamic map is consulted (the model holds none of its entries),
    // and the choice is remembered for the Service's timeout.
    let r = explain(&a, &arriving("10.244.1.9", "10.96.0.70", 80));
    assert!(r.affinity, "{}", r.text);
    for o in &r.outcomes {
        assert_eq!(o.dynsets.len(), 1, "{}", r.text);
        assert_eq!(o.dynsets[0].set, "affinity");
        assert_eq!(o.dynsets[0].timeout_ms, 30_000);
        assert!(
            o.dynsets[0].data.contains(&o.dnat_address),
            "{:?}",
            o.dynsets
        );
    }
    assert!(
        r.assumptions
            .iter()
            .any(|a| a.contains("@affinity is filled by the packet path")),
        "{:?}",
        r.assumptions
    );

    // loadBalancerSourceRanges: an allowed client is forwarded, another dropped.
    cl.service(service(
        "fw",
        "LoadBalancer",
        &["10.96.0.80"],
        http_port(30090),
        json!({
            "loadBalancerSourceRanges": ["203.0.113.0/24"],
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.20"}]}},
        }),
    ));
    cl.slice(http_slice("fw-1", "fw", &[("10.244.1.7", "node-a")]));
    let a = cl.node("node-a");
    let r = explain(&a, &arriving("203.0.113.9", "198.51.100.20", 80));
    assert_eq!(
        candidates(&r),
        vec![c("10.244.1.7:8080", 1000, true)],
        "{}",
        r.text
    );
    let r = explain(&a, &arriving("192.0.2.9", "198.51.100.20", 80));
    assert_eq!(fate(&r), PacketFate::Dropped, "{}", r.text);
    assert!(
        r.path.iter().any(|s| s.chain == "firewall-check"),
        "{}",
        r.text
    );
    // The NodePort is not covered by the ranges.
    let r = explain(
        &a,
        &pkt(
            "192.0.2.9",
            "192.168.77.1",
            30090,
            6,
            Origin::Arriving,
            &["192.168.77.1"],
        ),
    );
    assert_eq!(fate(&r), PacketFate::Dnat, "{}", r.text);
}

/// Every DNAT outcome of `r` remembers its endpoint in `map` for `timeout_ms`, and the answer
/// is masqueraded as `masq` says.
fn assert_records_affinity(r: &ExplainPacketResponse, map: &str, timeout_ms: u64, masq: bool) {
    assert_eq!(fate(r), PacketFate::Dnat, "{}", r.text);
    assert!(r.affinity, "{}", r.text);
    for o in &r.outcomes {
        assert_eq!(o.masquerade, masq, "{}", r.text);
        assert_eq!(o.dynsets.len(), 1, "no affinity record: {}", r.text);
        assert_eq!(o.dynsets[0].set, map, "{}", r.text);
        assert_eq!(o.dynsets[0].timeout_ms, timeout_ms, "{}", r.text);
        assert!(
            o.dynsets[0].data.contains(&o.dnat_address),
            "{:?}",
            o.dynsets
        );
    }
}

/// Session affinity is remembered for every connection DNATed to an endpoint, masqueraded or
/// not: an external client of a ClusterIP (masqueraded, it does not come from the pod network)
/// and of a Cluster-policy NodePort, the node itself, and a hairpin pod. (Recorded in
/// `nat-postrouting` after `masquerading`, whose verdict ends the NAT hook, none of these was.)
#[test]
fn session_affinity_is_recorded_for_masqueraded_connections() {
    let mut cl = Cluster::nodes();
    cl.service(service("aff", "NodePort", &["10.96.0.70"], http_port(30070),
        json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}}})));
    cl.slice(http_slice(
        "aff-1",
        "aff",
        &[("10.244.1.5", "node-a"), ("10.244.2.5", "node-b")],
    ));
    let a = cl.node("node-a");
    let node = ["192.168.77.1"];
    let cases = [
        (
            "external client -> ClusterIP",
            pkt("192.0.2.9", "10.96.0.70", 80, 6, Origin::Arriving, &node),
            "affinity",
            true,
        ),
        (
            "external client -> NodePort",
            pkt(
                "192.0.2.9",
                "192.168.77.1",
                30070,
                6,
                Origin::Arriving,
                &node,
            ),
            "nodeport-affinity",
            true,
        ),
        (
            "the node -> ClusterIP",
            pkt("192.168.77.1", "10.96.0.70", 80, 6, Origin::Local, &node),
            "affinity",
            true,
        ),
        (
            "the node -> its NodePort",
            pkt(
                "192.168.77.1",
                "192.168.77.1",
                30070,
                6,
                Origin::Local,
                &node,
            ),
            "nodeport-affinity",
            true,
        ),
        (
            "a pod -> ClusterIP",
            pkt("10.244.1.9", "10.96.0.70", 80, 6, Origin::Arriving, &node),
            "affinity",
            false,
        ),
    ];
    for (what, p, map, masq) in cases {
        let r = explain(&a, &p);
        eprintln!("{what}: {}", r.text.lines().next().unwrap_or_default());
        assert_records_affinity(&r, map, 30_000, masq);
    }
    // A pod reaching itself through the Service: the hairpin outcome is masqueraded, and both
    // outcomes remember their endpoint.
    let r = explain(
        &a,
        &pkt("10.244.1.5", "10.96.0.70", 80, 6, Origin::Arriving, &node),
    );
    assert_eq!(
        candidates(&r),
        vec![
            c("10.244.1.5:8080", 500, true),
            c("10.244.2.5:8080", 500, false)
        ],
        "{}",
        r.text
    );
    for o in &r.outcomes {
        assert_eq!(o.dynsets.len(), 1, "no affinity record: {}", r.text);
        assert!(
            o.dynsets[0].data.contains(&o.dnat_address),
            "{:?}",
            o.dynsets
        );
    }
}

#[test]
fn explaining_a_whole_node_table_is_fast_enough_for_an_rpc() {
    // 300 Services of 16 endpoints: a request evaluates 16 runs; bounded well below a second
    // in a debug build.
    let mut cl = Cluster::nodes();
    for i in 0..300u32 {
        let name = format!("s{i}");
        cl.service(service(
            &name,
            "ClusterIP",
            &[&format!("10.96.{}.{}", i / 200 + 1, i % 200 + 1)],
            json!([{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]),
            json!({}),
        ));
        let eps: Vec<(String, &str)> = (0..16)
            .map(|j| (format!("10.244.{}.{}", i % 200 + 1, j + 1), ""))
            .collect();
        let eps: Vec<(&str, &str)> = eps.iter().map(|(a, n)| (a.as_str(), *n)).collect();
        cl.slice(http_slice(&format!("{name}-1"), &name, &eps));
    }
    let a = cl.node("node-a");
    let start = std::time::Instant::now();
    let r = explain(&a, &arriving("10.244.1.9", "10.96.2.100", 80));
    assert_eq!(r.outcomes.len(), 16, "{}", r.text);
    // The text shows the first outcomes' own paths, and says how many it left out.
    assert!(r.text.contains("(8 more outcomes"), "{}", r.text);
    assert!(r.outcomes.iter().all(|o| !o.path.is_empty()));
    assert!(
        start.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
}
