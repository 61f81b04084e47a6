//! Service semantics at the IR level, node by node: which destinations a node forwards to which
//! endpoints, under which policy, for representative Services (NodePort, LoadBalancer with
//! source ranges, externalTrafficPolicy / internalTrafficPolicy Local, session affinity,
//! topology hints, terminating endpoints, service-proxy-name).
//!
//! Each case states its expectations as facts about set contents per node, and keeps a golden
//! file (`brain/tests/golden/semantics/<case>.<node>.nft`) with the node's non-empty sets in nft
//! syntax, so a reviewer can read what a node holds. `UPDATE_GOLDEN=1` rewrites them.
//!
//! Packets through these rules are tested end to end, in the lab's namespaces:
//! `tests/tests/e2e_external.rs` (NodePort, LoadBalancer source ranges, externalIPs,
//! externalTrafficPolicy Local, healthCheckNodePort, masquerading and hairpin per
//! `--detect-local-mode`), `tests/tests/e2e_internal.rs` (internalTrafficPolicy Local, topology
//! hints, session affinity, terminating endpoints, service-proxy-name) and
//! `tests/tests/e2e_lab_scenario.rs` (the `tests/lab/scenarios` replays: a Local-policy NodePort,
//! LoadBalancer source ranges). `docs/semantics.md` maps each behaviour to its tests.

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{Value, json};
use splitproxy_brain::index::Index;
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, ObjectKey, ServiceFilter};
use splitproxy_brain::rules::{self, RulesConfig};
use splitproxy_proto::render;
use splitproxy_proto::v1::{Element, Family, Ruleset, Table};

const NS: &str = "default";

struct Cluster {
    index: Index,
    config: RulesConfig,
    metrics: Metrics,
}

impl Cluster {
    /// Two nodes: node-a (zone-1, 192.168.77.1) and node-b (zone-2, 192.168.77.2).
    fn new() -> Self {
        let mut c = Cluster {
            index: Index::default(),
            config: RulesConfig {
                service_cidrs: vec!["10.96.0.0/16".parse().unwrap()],
                cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
                detect_local: rules::DetectLocalMode::ClusterCidr,
                ..RulesConfig::default()
            },
            metrics: Metrics::default(),
        };
        for (i, (name, zone)) in [("node-a", "zone-1"), ("node-b", "zone-2")]
            .into_iter()
            .enumerate()
        {
            let n: Node = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
                "spec": {"podCIDRs": [format!("10.244.{}.0/24", i + 1)]},
                "status": {"addresses": [
                    {"type": "InternalIP", "address": format!("192.168.77.{}", i + 1)},
                    {"type": "ExternalIP", "address": format!("203.0.113.{}", i + 1)},
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

    fn node(&self, node: &str) -> Ruleset {
        rules::node_ruleset(&self.index, &self.config, node)
    }
}

/// `name` with ports (port, nodePort) over TCP.
fn svc(name: &str, ty: &str, cip: &str, ports: &[(i32, i32)], extra: Value) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .enumerate()
        .map(|(i, (p, np))| {
            let mut v =
                json!({"name": format!("p{i}"), "protocol": "TCP", "port": p, "targetPort": 8080});
            if *np != 0 {
                v["nodePort"] = json!(np);
            }
            v
        })
        .collect();
    let mut spec = json!({"type": ty, "clusterIP": cip, "clusterIPs": [cip], "ports": ports});
    let mut status = json!({});
    if let Value::Object(m) = extra {
        for (k, v) in m {
            if k == "status" {
                status = v;
            } else if k == "labels" {
                continue;
            } else {
                spec[k] = v;
            }
        }
    }
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": NS, "name": name},
        "spec": spec, "status": status,
    })
}

/// A slice of `service` with port p0 = 8080 (and p1 = 8081) and the endpoints given as
/// (ip, node, ready, serving, terminating, zone hint).
fn slice(name: &str, service: &str, eps: &[(&str, &str, bool, bool, bool, &str)]) -> Value {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|(ip, node, ready, serving, terminating, hint)| {
            let mut e = json!({
                "addresses": [ip], "nodeName": node,
                "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
            });
            if !hint.is_empty() {
                e["hints"] = json!({"forZones": [{"name": hint}]});
            }
            e
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": NS, "name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "p0", "protocol": "TCP", "port": 8080}, {"name": "p1", "protocol": "TCP", "port": 8081}],
        "endpoints": endpoints,
    })
}

fn ready(
    ip: &'static str,
    node: &'static str,
) -> (&'static str, &'static str, bool, bool, bool, &'static str) {
    (ip, node, true, true, false, "")
}

fn ip_table(rs: &Ruleset) -> &Table {
    rs.tables
        .iter()
        .find(|t| t.family == Family::Ip as i32)
        .expect("ip table")
}

/// Every non-empty set: name -> elements in nft syntax.
fn contents(rs: &Ruleset) -> BTreeMap<String, Vec<String>> {
    let t = ip_table(rs);
    t.sets
        .iter()
        .filter(|s| !s.elements.is_empty())
        .map(|s| {
            let els = s
                .elements
                .iter()
                .map(|e| {
                    render::element(
                        s,
                        &Element {
                            comment: String::new(),
                            ..e.clone()
                        },
                    )
                })
                .collect();
            (s.name.clone(), els)
        })
        .collect()
}

fn has(c: &BTreeMap<String, Vec<String>>, set: &str, element: &str) -> bool {
    c.get(set).is_some_and(|e| e.iter().any(|x| x == element))
}

fn golden(case: &str, node: &str, c: &BTreeMap<String, Vec<String>>) {
    let mut text = String::new();
    for (set, els) in c {
        text.push_str(&format!("{set}\n"));
        for e in els {
            text.push_str(&format!("\t{e}\n"));
        }
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/semantics")
        .join(format!("{case}.{node}.nft"));
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| !v.is_empty() && v != "0") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; UPDATE_GOLDEN=1 creates it", path.display()));
    assert_eq!(
        want,
        text,
        "{} differs (UPDATE_GOLDEN=1 rewrites it)",
        path.display()
    );
}

#[test]
fn nodeport_cluster_policy_is_masqueraded_on_node_addresses() {
    let mut c = Cluster::new();
    c.service(svc(
        "np",
        "NodePort",
        "10.96.0.20",
        &[(80, 30080)],
        json!({}),
    ));
    c.slice(slice(
        "np-1",
        "np",
        &[ready("10.244.1.5", "node-a"), ready("10.244.2.5", "node-b")],
    ));
    for node in ["node-a", "node-b"] {
        let s = contents(&c.node(node));
        assert!(has(&s, "nodeport-cluster-services", "tcp . 30080"));
        assert!(has(&s, "nodeport-ports-2", "tcp . 30080"));
        assert!(has(
            &s,
            "nodeport-endpoints",
            "tcp . 30080 . 0 : 10.244.1.5 . 8080"
        ));
        assert!(has(&s, "service-ports-2", "10.96.0.20 . tcp . 80"));
        // Primary address only (kube-proxy's nftables default), never loopback.
        let ip = if node == "node-a" {
            "192.168.77.1"
        } else {
            "192.168.77.2"
        };
        assert_eq!(s.get("nodeport-ips"), Some(&vec![ip.to_string()]));
        golden("nodeport", node, &s);
    }
}

#[test]
fn nodeport_addresses_select_among_node_addresses() {
    let mut c = Cluster::new();
    c.config.nodeport_addresses =
        rules::NodePortAddresses::Cidrs(vec!["203.0.113.0/24".parse().unwrap()]);
    c.service(svc(
        "np",
        "NodePort",
        "10.96.0.20",
        &[(80, 30080)],
        json!({}),
    ));
    let s = contents(&c.node("node-b"));
    assert_eq!(
        s.get("nodeport-ips"),
        Some(&vec!["203.0.113.2".to_string()])
    );
}

#[test]
fn external_traffic_policy_local_uses_only_this_nodes_endpoints() {
    let mut c = Cluster::new();
    c.service(svc(
        "lb",
        "LoadBalancer",
        "10.96.0.30",
        &[(80, 30081)],
        json!({
            "externalTrafficPolicy": "Local",
            "healthCheckNodePort": 32000,
            "externalIPs": ["198.51.100.7"],
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.10"}, {"ip": "198.51.100.11", "ipMode": "Proxy"}]}},
        }),
    ));
    c.slice(slice(
        "lb-1",
        "lb",
        &[
            ready("10.244.1.5", "node-a"),
            ready("10.244.1.6", "node-a"),
            ready("10.244.2.5", "node-b"),
        ],
    ));
    let a = contents(&c.node("node-a"));
    let b = contents(&c.node("node-b"));
    for s in [&a, &b] {
        // From pods and the node itself: all endpoints (the cluster choice).
        assert!(has(s, "service-ports-3", "198.51.100.10 . tcp . 80"));
        assert!(has(s, "service-ports-3", "198.51.100.7 . tcp . 80"));
        assert!(has(s, "nodeport-ports-3", "tcp . 30081"));
        assert!(has(
            s,
            "external-local-services",
            "198.51.100.10 . tcp . 80"
        ));
        assert!(has(s, "nodeport-local-services", "tcp . 30081"));
        // ipMode Proxy: left to the load balancer.
        assert!(!s.values().flatten().any(|e| e.contains("198.51.100.11")));
        assert!(has(s, "health-check-nodeports", "32000 : 0"));
    }
    assert!(has(
        &a,
        "external-local-ports-2",
        "198.51.100.10 . tcp . 80"
    ));
    assert!(has(&a, "nodeport-local-ports-2", "tcp . 30081"));
    assert!(has(
        &a,
        "local-endpoints",
        "198.51.100.10 . tcp . 80 . 1 : 10.244.1.6 . 8080"
    ));
    assert!(has(&a, "health-check-local-endpoints", "32000 : 2"));
    assert!(has(&b, "nodeport-local-ports-1", "tcp . 30081"));
    assert!(has(&b, "health-check-local-endpoints", "32000 : 1"));
    golden("etp-local", "node-a", &a);

    // node-b loses its endpoint: it has no local choice (the drop rule applies) and reports 0.
    c.slice(slice(
        "lb-1",
        "lb",
        &[ready("10.244.1.5", "node-a"), ready("10.244.1.6", "node-a")],
    ));
    let b = contents(&c.node("node-b"));
    assert!(!b.keys().any(|k| k.starts_with("nodeport-local-ports-")));
    assert!(!b.contains_key("health-check-local-endpoints"));
    assert!(has(&b, "nodeport-local-services", "tcp . 30081"));
    golden("etp-local", "node-b", &b);
}

#[test]
fn load_balancer_source_ranges_and_no_node_ports() {
    let mut c = Cluster::new();
    c.service(svc(
        "fw",
        "LoadBalancer",
        "10.96.0.31",
        &[(443, 0)],
        json!({
            "allocateLoadBalancerNodePorts": false,
            "loadBalancerSourceRanges": ["192.0.2.0/24"],
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.20"}]}},
        }),
    ));
    c.slice(slice("fw-1", "fw", &[ready("10.244.2.9", "node-b")]));
    let s = contents(&c.node("node-a"));
    assert!(has(&s, "firewall-ips", "198.51.100.20 . tcp . 443"));
    assert!(has(
        &s,
        "firewall-allow",
        "198.51.100.20 . tcp . 443 . 192.0.2.0/24"
    ));
    assert!(has(
        &s,
        "external-cluster-services",
        "198.51.100.20 . tcp . 443"
    ));
    assert!(
        s.keys()
            .all(|k| !k.starts_with("nodeport") || k == "nodeport-ips"),
        "no NodePort: {s:?}"
    );
    golden("lb-source-ranges", "node-a", &s);
}

/// kube-proxy's `allowFromNode`: when a source range holds the node's IP, the Service's load
/// balancer IPs are admitted as sources too (a VIP-style load balancer makes the VIP a local
/// address of its backends, so a node's request to it loops back from the VIP; some clouds SNAT
/// a node's own traffic to it). The node's IP decides, so only that node's overlay holds them.
#[test]
fn load_balancer_ips_are_sources_where_a_range_holds_the_node() {
    let mut c = Cluster::new();
    c.service(svc(
        "snat",
        "LoadBalancer",
        "10.96.0.32",
        &[(443, 0)],
        json!({
            "allocateLoadBalancerNodePorts": false,
            // node-a's InternalIP, and nested ranges (the inner one is covered by the outer).
            "loadBalancerSourceRanges": ["192.168.77.1/32", "10.0.0.0/8", "10.1.0.0/16"],
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.21"}, {"ip": "198.51.100.22"}]}},
        }),
    ));
    c.slice(slice("snat-1", "snat", &[ready("10.244.2.9", "node-b")]));
    let a = contents(&c.node("node-a"));
    let b = contents(&c.node("node-b"));
    for vip in ["198.51.100.21", "198.51.100.22"] {
        for source in ["198.51.100.21", "198.51.100.22"] {
            let e = format!("{vip} . tcp . 443 . {source}");
            assert!(has(&a, "firewall-allow", &e), "node-a admits {e}: {a:?}");
            assert!(!has(&b, "firewall-allow", &e), "node-b does not: {b:?}");
        }
        for s in [&a, &b] {
            assert!(has(s, "firewall-ips", &format!("{vip} . tcp . 443")));
            assert!(has(
                s,
                "firewall-allow",
                &format!("{vip} . tcp . 443 . 192.168.77.1")
            ));
            assert!(has(
                s,
                "firewall-allow",
                &format!("{vip} . tcp . 443 . 10.0.0.0/8")
            ));
            assert!(
                !has(
                    s,
                    "firewall-allow",
                    &format!("{vip} . tcp . 443 . 10.1.0.0/16")
                ),
                "a range inside another never reaches the interval set"
            );
        }
    }
    golden("lb-source-ranges-node-ip", "node-a", &a);
    golden("lb-source-ranges-node-ip", "node-b", &b);

    // The Node's address decides, live: node-a moves out of the ranges, node-b into them.
    for (name, ip) in [("node-a", "192.168.77.9"), ("node-b", "192.168.77.1")] {
        let n: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "status": {"addresses": [{"type": "InternalIP", "address": ip}]},
        }))
        .unwrap();
        c.index.apply_node(name.into(), Some(objects::node(&n)));
    }
    let a = contents(&c.node("node-a"));
    let b = contents(&c.node("node-b"));
    let e = "198.51.100.21 . tcp . 443 . 198.51.100.22";
    assert!(!has(&a, "firewall-allow", e) && has(&b, "firewall-allow", e));

    // A range that holds a load balancer IP admits it already: no element of its own (the
    // kernel refuses an interval beginning inside another of the set).
    c.service(svc(
        "snat",
        "LoadBalancer",
        "10.96.0.32",
        &[(443, 0)],
        json!({
            "allocateLoadBalancerNodePorts": false,
            "loadBalancerSourceRanges": ["192.168.77.0/24", "198.51.100.16/28"],
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.21"}, {"ip": "198.51.100.40"}]}},
        }),
    ));
    let b = contents(&c.node("node-b"));
    assert!(has(
        &b,
        "firewall-allow",
        "198.51.100.21 . tcp . 443 . 198.51.100.40"
    ));
    assert!(!has(
        &b,
        "firewall-allow",
        "198.51.100.21 . tcp . 443 . 198.51.100.21"
    ));
    assert!(has(
        &b,
        "firewall-allow",
        "198.51.100.21 . tcp . 443 . 198.51.100.16/28"
    ));
}

/// Without endpoints the ranges still hold, as kube-proxy's firewall runs before its
/// endpoint check: clients outside them are dropped, clients inside refused.
#[test]
fn load_balancer_source_ranges_hold_without_endpoints() {
    let mut c = Cluster::new();
    c.service(svc(
        "empty",
        "LoadBalancer",
        "10.96.0.33",
        &[(443, 0)],
        json!({
            "allocateLoadBalancerNodePorts": false,
            "loadBalancerSourceRanges": ["192.0.2.0/24"],
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.23"}]}},
        }),
    ));
    let s = contents(&c.node("node-a"));
    assert!(has(&s, "firewall-ips", "198.51.100.23 . tcp . 443"));
    assert!(has(
        &s,
        "firewall-allow",
        "198.51.100.23 . tcp . 443 . 192.0.2.0/24"
    ));
    assert!(has(&s, "no-endpoint-services", "198.51.100.23 . tcp . 443"));
}

#[test]
fn internal_traffic_policy_local() {
    let mut c = Cluster::new();
    c.service(svc(
        "itp",
        "ClusterIP",
        "10.96.0.40",
        &[(80, 0)],
        json!({"internalTrafficPolicy": "Local"}),
    ));
    c.slice(slice("itp-1", "itp", &[ready("10.244.1.5", "node-a")]));
    let a = contents(&c.node("node-a"));
    let b = contents(&c.node("node-b"));
    assert!(has(&a, "local-ports-1", "10.96.0.40 . tcp . 80"));
    assert!(has(
        &a,
        "local-endpoints",
        "10.96.0.40 . tcp . 80 . 0 : 10.244.1.5 . 8080"
    ));
    for s in [&a, &b] {
        assert!(has(s, "internal-local-services", "10.96.0.40 . tcp . 80"));
        assert!(!s.keys().any(|k| k.starts_with("service-ports-")));
    }
    assert!(!b.contains_key("local-endpoints"));
    golden("itp-local", "node-a", &a);
}

#[test]
fn terminating_endpoints_serve_only_when_none_is_ready() {
    let mut c = Cluster::new();
    c.service(svc("t", "ClusterIP", "10.96.0.50", &[(80, 0)], json!({})));
    c.slice(slice(
        "t-1",
        "t",
        &[
            ("10.244.1.5", "node-a", false, true, true, ""),
            ("10.244.1.6", "node-a", false, false, true, ""),
            ("10.244.2.5", "node-b", true, true, false, ""),
        ],
    ));
    let s = contents(&c.node("node-a"));
    assert!(has(&s, "service-ports-1", "10.96.0.50 . tcp . 80"));
    assert!(has(
        &s,
        "service-endpoints",
        "10.96.0.50 . tcp . 80 . 0 : 10.244.2.5 . 8080"
    ));
    // The ready endpoint goes: the serving-and-terminating one takes over, the not-serving
    // one never does.
    c.slice(slice(
        "t-1",
        "t",
        &[
            ("10.244.1.5", "node-a", false, true, true, ""),
            ("10.244.1.6", "node-a", false, false, true, ""),
        ],
    ));
    let s = contents(&c.node("node-a"));
    assert!(has(
        &s,
        "service-endpoints",
        "10.96.0.50 . tcp . 80 . 0 : 10.244.1.5 . 8080"
    ));
    assert!(has(&s, "service-ports-1", "10.96.0.50 . tcp . 80"));
    golden("terminating", "node-a", &s);
    // None serving: refused.
    c.slice(slice(
        "t-1",
        "t",
        &[("10.244.1.6", "node-a", false, false, true, "")],
    ));
    let s = contents(&c.node("node-a"));
    assert!(has(&s, "no-endpoint-services", "10.96.0.50 . tcp . 80"));
}

#[test]
fn topology_hints_choose_per_zone_with_fallback() {
    let mut c = Cluster::new();
    c.service(svc(
        "topo",
        "ClusterIP",
        "10.96.0.60",
        &[(80, 0)],
        json!({"trafficDistribution": "PreferClose"}),
    ));
    let eps = [
        ("10.244.1.5", "node-a", true, true, false, "zone-1"),
        ("10.244.2.5", "node-b", true, true, false, "zone-2"),
        ("10.244.2.6", "node-b", true, true, false, "zone-2"),
    ];
    c.slice(slice("topo-1", "topo", &eps));
    let a = contents(&c.node("node-a"));
    let b = contents(&c.node("node-b"));
    assert!(has(&a, "service-ports-1", "10.96.0.60 . tcp . 80"));
    assert!(has(
        &a,
        "service-endpoints",
        "10.96.0.60 . tcp . 80 . 0 : 10.244.1.5 . 8080"
    ));
    assert!(has(&b, "service-ports-2", "10.96.0.60 . tcp . 80"));
    golden("topology", "node-a", &a);
    // One endpoint without hints: every node uses all of them (kube-proxy's fallback).
    let mut eps = eps.to_vec();
    eps[2].5 = "";
    c.slice(slice("topo-1", "topo", &eps));
    for node in ["node-a", "node-b"] {
        assert!(has(
            &contents(&c.node(node)),
            "service-ports-3",
            "10.96.0.60 . tcp . 80"
        ));
    }
}

#[test]
fn session_affinity_and_hairpin_and_proxy_name() {
    let mut c = Cluster::new();
    c.service(svc(
        "aff",
        "ClusterIP",
        "10.96.0.70",
        &[(80, 0)],
        json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}}}),
    ));
    c.slice(slice(
        "aff-1",
        "aff",
        &[ready("10.244.1.5", "node-a"), ready("10.244.2.5", "node-b")],
    ));
    let a = contents(&c.node("node-a"));
    assert!(has(&a, "affinity-services-30", "10.96.0.70 . tcp . 80"));
    assert!(has(
        &a,
        "affinity-members",
        "10.96.0.70 . tcp . 80 . 10.244.1.5 . 8080"
    ));
    assert!(has(&a, "hairpin-endpoints", "10.244.1.5 . 10.244.1.5"));
    assert!(!has(&a, "hairpin-endpoints", "10.244.2.5 . 10.244.2.5"));
    let rs = c.node("node-a");
    let rules = render::ruleset(&rs);
    assert!(
        rules.contains("timeout 30s"),
        "affinity timeout rule:\n{rules}"
    );
    golden("affinity", "node-a", &a);

    // A Service labelled for another proxy is not ours.
    let mut other = svc("other", "ClusterIP", "10.96.0.71", &[(80, 0)], json!({}));
    other["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "other-proxy"});
    c.service(other);
    assert!(!has(
        &contents(&c.node("node-a")),
        "cluster-ips",
        "10.96.0.71"
    ));
}

/// `service.kubernetes.io/headless` on an EndpointSlice or a Service takes it away from every
/// Service proxy, as kube-proxy's list selector does: a slice that gains the label stops
/// serving (the Service rejects, having no endpoints), and a labelled Service is not ours.
#[test]
fn the_headless_label_hides_slices_and_services() {
    let mut c = Cluster::new();
    c.service(svc(
        "custom",
        "ClusterIP",
        "10.96.0.72",
        &[(80, 0)],
        json!({}),
    ));
    let mut s = slice("custom-1", "custom", &[ready("10.244.1.7", "node-a")]);
    c.slice(s.clone());
    let served = contents(&c.node("node-a"));
    assert!(has(&served, "service-ports-1", "10.96.0.72 . tcp . 80"));
    s["metadata"]["labels"]["service.kubernetes.io/headless"] = json!("");
    c.slice(s);
    let hidden = contents(&c.node("node-a"));
    assert!(!has(&hidden, "service-ports-1", "10.96.0.72 . tcp . 80"));
    assert!(has(
        &hidden,
        "no-endpoint-services",
        "10.96.0.72 . tcp . 80"
    ));

    let mut labelled = svc("labelled", "ClusterIP", "10.96.0.73", &[(80, 0)], json!({}));
    labelled["metadata"]["labels"] = json!({"service.kubernetes.io/headless": ""});
    c.service(labelled);
    c.slice(slice(
        "labelled-1",
        "labelled",
        &[ready("10.244.1.8", "node-a")],
    ));
    assert!(!has(
        &contents(&c.node("node-a")),
        "cluster-ips",
        "10.96.0.73"
    ));
}

/// Overlays kept incrementally over a churn of Services, slices and Nodes equal overlays
/// computed from scratch, node by node, and their digests add up to the node's whole table.
#[test]
fn incremental_overlays_equal_rebuilt_ones() {
    use splitproxy_brain::desired::SharedRuleset;
    use splitproxy_brain::overlay::Overlays;
    use splitproxy_proto::model::Model;

    let mut c = Cluster::new();
    let mut d = SharedRuleset::new(c.config.clone());
    d.rebuild(&c.index);
    let mut o = Overlays::new(c.config.clone());
    o.rebuild(&c.index, &mut d);
    let policies = [
        json!({}),
        json!({"externalTrafficPolicy": "Local", "healthCheckNodePort": 32001}),
        json!({"internalTrafficPolicy": "Local"}),
        json!({"trafficDistribution": "PreferClose"}),
    ];
    let nodes = ["node-a", "node-b"];
    for step in 0..120u32 {
        let i = step % 7;
        let name = format!("s{i}");
        let mut dirty = vec![ObjectKey::new(NS, name.as_str())];
        let mut dirty_nodes = Vec::new();
        match step % 5 {
            0..=2 => {
                let policy = policies[(step as usize / 3) % policies.len()].clone();
                let ty = if step % 2 == 0 {
                    "LoadBalancer"
                } else {
                    "NodePort"
                };
                let mut extra = policy;
                if ty == "LoadBalancer" {
                    extra["status"] = json!({"loadBalancer": {"ingress": [{"ip": format!("198.51.100.{}", 10 + i)}]}});
                    if step % 3 == 1 {
                        // Judged on each node's address, which the Node steps below move in
                        // and out of the first range.
                        extra["loadBalancerSourceRanges"] =
                            json!(["192.168.78.0/25", "192.168.77.1/32", "192.0.2.0/24"]);
                    }
                }
                c.service(svc(
                    &name,
                    ty,
                    &format!("10.96.1.{}", 10 + i),
                    &[(80, 30100 + i as i32)],
                    extra,
                ));
                let n = (step % 4) as usize;
                let eps: Vec<(&str, &str, bool, bool, bool, &str)> = (0..n)
                    .map(|k| {
                        let ip: &'static str =
                            Box::leak(format!("10.244.{}.{}", k % 2 + 1, 10 + i).into_boxed_str());
                        let zone = if step % 3 == 0 {
                            if k % 2 == 0 { "zone-1" } else { "zone-2" }
                        } else {
                            ""
                        };
                        (
                            ip,
                            nodes[k % 2],
                            k != 2 || step % 2 == 0,
                            true,
                            k == 2,
                            zone,
                        )
                    })
                    .collect();
                c.slice(slice(&format!("{name}-1"), &name, &eps));
            }
            3 => c
                .index
                .apply_service(ObjectKey::new(NS, name.as_str()), None),
            _ => {
                // A node changes zone and addresses, or goes and comes back.
                let node = nodes[(step as usize / 5) % 2];
                dirty.clear();
                dirty_nodes.push(node.to_string());
                if step % 2 == 0 {
                    c.index.apply_node(node.into(), None);
                } else {
                    let n: Node = serde_json::from_value(json!({
                        "apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": node, "labels": {"topology.kubernetes.io/zone": format!("zone-{}", step % 3)}},
                        "status": {"addresses": [{"type": "InternalIP", "address": format!("192.168.78.{}", step % 200)}]},
                    }))
                    .unwrap();
                    c.index.apply_node(node.into(), Some(objects::node(&n)));
                }
            }
        }
        d.update(&c.index, dirty.iter());
        o.update(&c.index, &mut d, dirty.iter(), dirty_nodes.iter());
        d.prune();
        for node in nodes {
            if c.index.node(node).is_none() {
                continue;
            }
            let mut whole = d.model().clone();
            let overlay = o.model(node).cloned().unwrap_or_default();
            whole.apply(&Model::default().diff(&overlay));
            let want = Model::from_ruleset(&c.node(node));
            assert_eq!(
                render::ruleset(&whole.to_ruleset()),
                render::ruleset(&want.to_ruleset()),
                "step {step}, {node}"
            );
            assert_eq!(
                d.model().digest_with(&overlay),
                want.digest(),
                "step {step}, {node}: digest"
            );
        }
    }
}

#[test]
fn session_affinity_covers_node_ports() {
    let mut c = Cluster::new();
    c.service(svc(
        "npaff",
        "NodePort",
        "10.96.0.72",
        &[(80, 30072)],
        json!({"sessionAffinity": "ClientIP"}),
    ));
    c.slice(slice("npaff-1", "npaff", &[ready("10.244.1.5", "node-a")]));
    let s = contents(&c.node("node-b"));
    assert!(has(&s, "nodeport-affinity-services-10800", "tcp . 30072"));
    assert!(has(
        &s,
        "nodeport-affinity-members",
        "tcp . 30072 . 10.244.1.5 . 8080"
    ));
    assert!(has(&s, "affinity-services-10800", "10.96.0.72 . tcp . 80"));
}

/// Each `--detect-local-mode` (and `--masquerade-all`) decides which ClusterIP traffic is
/// masqueraded and which external-policy rules apply to pods.
#[test]
fn detect_local_modes_render_their_conditions() {
    let cases = [
        (
            rules::DetectLocalMode::ClusterCidr,
            "",
            "ip saddr != 10.244.0.0/16",
        ),
        (
            rules::DetectLocalMode::NodeCidr,
            "",
            "ip saddr != @local-pod-cidrs",
        ),
        (
            rules::DetectLocalMode::InterfaceNamePrefix,
            "pod",
            "iifname != \"pod*\"",
        ),
        (
            rules::DetectLocalMode::BridgeInterface,
            "cbr0",
            "iifname != \"cbr0\"",
        ),
    ];
    for (mode, iface, want) in cases {
        let mut c = Cluster::new();
        c.config.detect_local = mode;
        c.config.pod_interface_name_prefix = iface.into();
        c.config.pod_bridge_interface = iface.into();
        let text = render::ruleset(&c.node("node-a"));
        let masq = text
            .lines()
            .find(|l| l.contains("Masquerade traffic to ClusterIPs"))
            .unwrap_or_else(|| panic!("{mode:?}: no ClusterIP masquerade rule"));
        assert!(masq.contains(want), "{mode:?}: {masq}");
        assert!(
            text.lines()
                .any(|l| l.contains("@external-local-ports-1") && l.contains(want)),
            "{mode:?}: external-local rules must exclude pods"
        );
    }
    // None: no ClusterIP masquerade (kube-proxy cannot tell pods), unless --masquerade-all.
    let mut c = Cluster::new();
    c.config.detect_local = rules::DetectLocalMode::None;
    assert!(!render::ruleset(&c.node("node-a")).contains("Masquerade traffic to ClusterIPs"));
    c.config.masquerade_all = true;
    let text = render::ruleset(&c.node("node-a"));
    let masq = text
        .lines()
        .find(|l| l.contains("Masquerade traffic to ClusterIPs"))
        .expect("masquerade-all rule");
    assert!(
        masq.trim_start().starts_with("ip daddr @cluster-ips"),
        "{masq}"
    );
}
