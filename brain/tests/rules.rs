//! Unit tier of the brain (docs/testing.md): Services and EndpointSlices in,
//! ruleset IR out, through the same reductions the watches use (`objects::service`,
//! `objects::slice`), the index and `rules::ruleset`.
//!
//! Each case of the table states what it expects twice: as explicit facts (which Service ports
//! forward to which endpoints, which ClusterIPs are active, how many objects were skipped) and
//! as a golden file in nft syntax under `tests/golden/`. `UPDATE_GOLDEN=1 cargo test -p
//! splitproxy-brain --test rules` rewrites the golden files; read the diff before keeping it.
//!
//! Every ruleset computed here, and a larger generated cluster, is also checked against the
//! invariants of the ruleset's shape (see `brain/src/rules/mod.rs`): no jump or goto outside
//! the base chains' fixed jumps, every Service port in exactly one of `no-endpoint-services` /
//! `service-ports-N`, exactly slots `0..N` in `service-endpoints` for a port with N endpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{Value, json};
use splitproxy_brain::index::Index;
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, ObjectKey};
use splitproxy_brain::rules::{self, PREALLOCATED_COUNTS, RulesConfig};
use splitproxy_proto::model::Model;
use splitproxy_proto::render;
use splitproxy_proto::v1::{
    DataType, Element, Family, Ruleset, Set, Table, VerdictCode, datum, expr::Kind,
};

const NS: &str = "default";

// ---- Kubernetes objects ----

/// A Service of `type`; `ports` are (name, protocol, port, targetPort), an empty name is left
/// out as the API server does for a single unnamed port.
fn service_of(
    name: &str,
    ty: &str,
    cluster_ips: &[&str],
    ports: &[(&str, &str, i32, i32)],
) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|(n, proto, port, target)| {
            let mut p = json!({"protocol": proto, "port": port, "targetPort": target});
            if !n.is_empty() {
                p["name"] = json!(n);
            }
            p
        })
        .collect();
    let mut spec = json!({"type": ty, "ports": ports});
    if let Some(first) = cluster_ips.first() {
        spec["clusterIP"] = json!(first);
        spec["clusterIPs"] = json!(cluster_ips);
    }
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": NS, "name": name},
        "spec": spec,
    })
}

fn service(name: &str, cluster_ip: &str, ports: &[(&str, &str, i32, i32)]) -> Value {
    service_of(name, "ClusterIP", &[cluster_ip], ports)
}

/// An EndpointSlice of Service `service`; `ports` are (name, protocol, port).
fn slice_of(
    name: &str,
    service: &str,
    address_type: &str,
    ports: &[(&str, &str, i32)],
    endpoints: Vec<Value>,
) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|(n, proto, port)| {
            let mut p = json!({"protocol": proto, "port": port});
            if !n.is_empty() {
                p["name"] = json!(n);
            }
            p
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": NS,
            "name": name,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": address_type,
        "ports": ports,
        "endpoints": endpoints,
    })
}

fn slice(name: &str, service: &str, ports: &[(&str, &str, i32)], endpoints: Vec<Value>) -> Value {
    slice_of(name, service, "IPv4", ports, endpoints)
}

fn ready(ip: &str) -> Value {
    json!({"addresses": [ip], "conditions": {"ready": true, "serving": true, "terminating": false}})
}

fn not_ready(ip: &str) -> Value {
    json!({"addresses": [ip], "conditions": {"ready": false, "serving": false, "terminating": false}})
}

/// An endpoint without conditions: `ready` unset counts as ready.
fn unconditioned(ip: &str) -> Value {
    json!({"addresses": [ip]})
}

/// `n` ready endpoints 10.244.`third`.1 .. 10.244.`third`.n.
fn ready_range(third: u8, n: u8) -> Vec<Value> {
    (1..=n)
        .map(|i| ready(&format!("10.244.{third}.{i}")))
        .collect()
}

// ---- the pipeline under test ----

struct Cluster {
    index: Index,
    metrics: Metrics,
    config: RulesConfig,
}

impl Cluster {
    fn new(service_cidrs: &[&str]) -> Self {
        Cluster {
            index: Index::default(),
            metrics: Metrics::default(),
            config: RulesConfig {
                service_cidrs: service_cidrs
                    .iter()
                    .map(|c| c.parse().expect("test CIDR"))
                    .collect(),
                ..RulesConfig::default()
            },
        }
    }

    fn apply_service(&mut self, v: Value) {
        let svc: Service = serde_json::from_value(v).expect("test Service");
        let filter = objects::ServiceFilter {
            proxy_name: self.config.service_proxy_name.clone(),
        };
        let info = objects::service(&svc, &filter, &self.metrics);
        self.index.apply_service(ObjectKey::of(&svc), info);
    }

    fn delete_service(&mut self, name: &str) {
        self.index.apply_service(ObjectKey::new(NS, name), None);
    }

    fn apply_slice(&mut self, v: Value) {
        let s: EndpointSlice = serde_json::from_value(v).expect("test EndpointSlice");
        let info = objects::slice(&s, &self.metrics);
        self.index.apply_slice(ObjectKey::of(&s), info);
    }

    fn ruleset(&self) -> Ruleset {
        rules::ruleset(&self.index, &self.config)
    }
}

// ---- reading a ruleset back ----

/// An element's key in nft syntax, without comment or data: `10.96.0.10 . tcp . 80`.
fn key_text(set: &Set, e: &Element) -> String {
    render::element(
        set,
        &Element {
            key: e.key.clone(),
            key_end: e.key_end.clone(),
            ..Element::default()
        },
    )
}

/// An element's data in nft syntax: `10.244.1.1 . 8080`.
fn data_text(set: &Set, e: &Element) -> String {
    let full = render::element(set, e);
    let key = render::element(
        set,
        &Element {
            key: e.key.clone(),
            ..Element::default()
        },
    );
    full.strip_prefix(&key)
        .and_then(|rest| rest.strip_prefix(" : "))
        .unwrap_or(&full)
        .to_owned()
}

fn set<'a>(table: &'a Table, name: &str) -> &'a Set {
    table
        .sets
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no set {name} in table {}", table.name))
}

/// N of a `service-ports-N` set name.
fn endpoint_count(set_name: &str) -> Option<usize> {
    set_name.strip_prefix("service-ports-")?.parse().ok()
}

/// What a table forwards: Service port (`ip . proto . port`) -> the endpoints it DNATs to, in
/// slot order (empty for ports in `no-endpoint-services`). Only consistent tables (see
/// [`check_invariants`]) give a meaningful answer.
fn forwarding(table: &Table) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for e in &set(table, "no-endpoint-services").elements {
        out.insert(key_text(set(table, "no-endpoint-services"), e), Vec::new());
    }
    let endpoints = set(table, "service-endpoints");
    let mut slots: BTreeMap<String, BTreeMap<u32, String>> = BTreeMap::new();
    for e in &endpoints.elements {
        let prefix = Element {
            key: e.key[..3].to_vec(),
            ..Element::default()
        };
        let port_set = set(table, "no-endpoint-services"); // same key layout, 3 fields
        slots
            .entry(key_text(port_set, &prefix))
            .or_default()
            .insert(slot(e), data_text(endpoints, e));
    }
    for s in &table.sets {
        if endpoint_count(&s.name).is_some() {
            for e in &s.elements {
                let k = key_text(s, e);
                let eps = slots.get(&k).map(|m| m.values().cloned().collect());
                out.insert(k, eps.unwrap_or_default());
            }
        }
    }
    out
}

fn slot(e: &Element) -> u32 {
    match e.key.get(3).and_then(|d| d.value.as_ref()) {
        Some(datum::Value::U32(s)) => *s,
        other => panic!("service-endpoints element without a slot: {other:?}"),
    }
}

fn cluster_ips(table: &Table) -> Vec<String> {
    let s = set(table, "cluster-ips");
    s.elements.iter().map(|e| key_text(s, e)).collect()
}

/// nftables stores comments as NUL-terminated user data of at most 128 bytes
/// (NFTNL_UDATA_COMMENT_MAXLEN); the actuator refuses longer ones.
const COMMENT_MAX_BYTES: usize = 127;

/// The invariants of the ruleset's shape, for every table of `rs`.
fn check_invariants(rs: &Ruleset) {
    for t in &rs.tables {
        let ctx = format!("table {}", t.name);
        // Jumps and gotos only as the base chains' fixed jumps; no verdict maps at all.
        let base_jumps = BTreeMap::from([
            ("nat-prerouting", vec!["services"]),
            ("nat-output", vec!["services"]),
            ("filter-prerouting", vec!["firewall-check"]),
            (
                "filter-input",
                vec!["service-endpoints-check", "affinity-record"],
            ),
            (
                "filter-forward",
                vec![
                    "service-endpoints-check",
                    "cluster-ips-check",
                    "affinity-record",
                ],
            ),
            (
                "filter-output",
                vec!["service-endpoints-check", "firewall-check"],
            ),
            (
                "filter-output-post-dnat",
                vec!["cluster-ips-check", "affinity-record"],
            ),
            ("nat-postrouting", vec!["masquerading"]),
        ]);
        for c in &t.chains {
            let mut jumps = Vec::new();
            for r in &c.rules {
                assert!(
                    r.comment.len() <= COMMENT_MAX_BYTES,
                    "{ctx}: rule comment too long"
                );
                for e in &r.exprs {
                    match &e.kind {
                        Some(Kind::Verdict(v))
                            if v.code == VerdictCode::Jump as i32
                                || v.code == VerdictCode::Goto as i32 =>
                        {
                            jumps.push(v.chain.as_str())
                        }
                        Some(Kind::Lookup(l)) => {
                            assert!(!l.verdict, "{ctx}: verdict map lookup in chain {}", c.name)
                        }
                        _ => {}
                    }
                }
            }
            match base_jumps.get(c.name.as_str()) {
                Some(want) => {
                    assert!(c.base.is_some(), "{ctx}: {} is not a base chain", c.name);
                    assert_eq!(&jumps, want, "{ctx}: jumps of {}", c.name);
                }
                None => {
                    assert!(c.base.is_none(), "{ctx}: unexpected base chain {}", c.name);
                    assert!(jumps.is_empty(), "{ctx}: {} jumps to {jumps:?}", c.name);
                }
            }
        }
        let chains: BTreeSet<&str> = t.chains.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            chains,
            base_jumps
                .keys()
                .copied()
                .chain([
                    "services",
                    "service-endpoints-check",
                    "cluster-ips-check",
                    "firewall-check",
                    "masquerading",
                    "affinity-record",
                ])
                .collect(),
            "{ctx}: chains"
        );
        for s in &t.sets {
            assert!(
                !s.data.contains(&(DataType::Verdict as i32)),
                "{ctx}: verdict map {}",
                s.name
            );
            for e in &s.elements {
                assert!(e.verdict.is_none(), "{ctx}: verdict in {}", s.name);
                assert!(
                    e.comment.len() <= COMMENT_MAX_BYTES,
                    "{ctx}: comment of {} too long for nftables ({} bytes): {}",
                    s.name,
                    e.comment.len(),
                    e.comment
                );
            }
        }

        // Every Service port in exactly one of no-endpoint-services / service-ports-N.
        let mut home: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for s in &t.sets {
            let n = endpoint_count(&s.name);
            if n.is_none() && s.name != "no-endpoint-services" {
                continue;
            }
            for e in &s.elements {
                let k = key_text(s, e);
                home.entry(k.clone()).or_default().push(s.name.clone());
                if let Some(n) = n {
                    counts.insert(k, n);
                }
            }
        }
        for (k, sets) in &home {
            assert_eq!(sets.len(), 1, "{ctx}: {k} is in {sets:?}");
        }

        // Preallocated counts always exist; every count has its one DNAT rule.
        let services = t
            .chains
            .iter()
            .find(|c| c.name == "services")
            .expect("services chain");
        let ns: Vec<usize> = t
            .sets
            .iter()
            .filter_map(|s| endpoint_count(&s.name))
            .collect();
        for n in 1..=PREALLOCATED_COUNTS as usize {
            assert!(ns.contains(&n), "{ctx}: service-ports-{n} missing");
        }
        let ctx_r = render::Context::of(t);
        let count_rules = services
            .rules
            .iter()
            .filter(|r| render::rule_in(&ctx_r, r).contains("@service-ports-"))
            .count();
        assert_eq!(count_rules, ns.len(), "{ctx}: one rule per count");
        for n in &ns {
            let want = format!(
                "{} daddr . meta l4proto . th dport @service-ports-{n} dnat {} to {} daddr . meta l4proto . th dport . numgen random mod {n} map @service-endpoints",
                if t.family == Family::Ip as i32 {
                    "ip"
                } else {
                    "ip6"
                },
                if t.family == Family::Ip as i32 {
                    "ip"
                } else {
                    "ip6"
                },
                if t.family == Family::Ip as i32 {
                    "ip"
                } else {
                    "ip6"
                },
            );
            let found = services
                .rules
                .iter()
                .filter(|r| render::rule_in(&ctx_r, r) == want)
                .count();
            assert_eq!(found, 1, "{ctx}: rule `{want}`");
        }

        // service-endpoints: exactly slots 0..N for each port with N endpoints, nothing else.
        let endpoints = set(t, "service-endpoints");
        let mut slots: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for e in &endpoints.elements {
            let prefix = Element {
                key: e.key[..3].to_vec(),
                ..Element::default()
            };
            slots
                .entry(key_text(set(t, "no-endpoint-services"), &prefix))
                .or_default()
                .push(slot(e));
        }
        for (k, n) in &counts {
            let mut got = slots.remove(k).unwrap_or_default();
            got.sort_unstable();
            assert_eq!(
                got,
                (0..*n as u32).collect::<Vec<_>>(),
                "{ctx}: slots of {k} (service-ports-{n})"
            );
        }
        assert!(
            slots.is_empty(),
            "{ctx}: endpoints of ports in no service-ports-N set: {slots:?}"
        );

        // Every Service port's address is an active ClusterIP.
        let ips: BTreeSet<String> = cluster_ips(t).into_iter().collect();
        for k in home.keys() {
            let ip = k.split(" . ").next().unwrap_or_default();
            assert!(ips.contains(ip), "{ctx}: {ip} of {k} not in cluster-ips");
        }
    }
}

// ---- golden files ----

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.nft"))
}

/// Compares `rs` rendered in nft syntax with `tests/golden/NAME.nft`, or rewrites the file when
/// `UPDATE_GOLDEN` is set.
fn golden(name: &str, rs: &Ruleset) {
    let text: String = rs.tables.iter().map(render::table).collect();
    let path = golden_path(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| !v.is_empty() && v != "0") {
        std::fs::create_dir_all(path.parent().expect("golden dir")).expect("create golden dir");
        std::fs::write(&path, &text).expect("write golden file");
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with UPDATE_GOLDEN=1 to create it",
            path.display()
        )
    });
    if text != want {
        let (line, (got_l, want_l)) = text
            .lines()
            .chain(std::iter::repeat("<end>"))
            .zip(want.lines().chain(std::iter::repeat("<end>")))
            .enumerate()
            .find(|(_, (a, b))| a != b)
            .unwrap_or((0, ("", "")));
        panic!(
            "{name}: ruleset differs from {} at line {}:\n  got:  {got_l}\n  want: {want_l}\n\
             full output:\n{text}\n(UPDATE_GOLDEN=1 rewrites the golden file)",
            path.display(),
            line + 1
        );
    }
}

// ---- the table of cases ----

struct Case {
    name: &'static str,
    service_cidrs: &'static [&'static str],
    services: Vec<Value>,
    slices: Vec<Value>,
    /// What `metrics.invalid_total()` must count once everything is reduced.
    invalid: u64,
    /// Per table (ip, then ip6 if any): Service port -> endpoints in slot order, empty for a
    /// port without endpoints.
    forwarding: Vec<Vec<(&'static str, Vec<&'static str>)>>,
    /// Per table: the active ClusterIPs.
    cluster_ips: Vec<Vec<&'static str>>,
}

const V4: &[&str] = &["10.96.0.0/16"];

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "a_tcp_three_endpoints",
            service_cidrs: V4,
            services: vec![service("web", "10.96.0.10", &[("http", "TCP", 80, 8080)])],
            slices: vec![slice(
                "web-abc",
                "web",
                &[("http", "TCP", 8080)],
                ready_range(1, 3),
            )],
            invalid: 0,
            forwarding: vec![vec![(
                "10.96.0.10 . tcp . 80",
                vec![
                    "10.244.1.1 . 8080",
                    "10.244.1.2 . 8080",
                    "10.244.1.3 . 8080",
                ],
            )]],
            cluster_ips: vec![vec!["10.96.0.10"]],
        },
        Case {
            name: "b_multi_port",
            service_cidrs: V4,
            services: vec![service(
                "app",
                "10.96.0.20",
                &[("http", "TCP", 80, 8080), ("metrics", "TCP", 9090, 9090)],
            )],
            slices: vec![slice(
                "app-abc",
                "app",
                &[("metrics", "TCP", 9090), ("http", "TCP", 8080)],
                ready_range(2, 2),
            )],
            invalid: 0,
            forwarding: vec![vec![
                (
                    "10.96.0.20 . tcp . 80",
                    vec!["10.244.2.1 . 8080", "10.244.2.2 . 8080"],
                ),
                (
                    "10.96.0.20 . tcp . 9090",
                    vec!["10.244.2.1 . 9090", "10.244.2.2 . 9090"],
                ),
            ]],
            cluster_ips: vec![vec!["10.96.0.20"]],
        },
        Case {
            name: "c_not_ready_and_unset_ready",
            service_cidrs: V4,
            services: vec![service("web", "10.96.0.30", &[("", "TCP", 80, 8080)])],
            slices: vec![slice(
                "web-abc",
                "web",
                &[("", "TCP", 8080)],
                vec![
                    ready("10.244.3.1"),
                    not_ready("10.244.3.2"),
                    unconditioned("10.244.3.3"),
                ],
            )],
            invalid: 0,
            forwarding: vec![vec![(
                "10.96.0.30 . tcp . 80",
                vec!["10.244.3.1 . 8080", "10.244.3.3 . 8080"],
            )]],
            cluster_ips: vec![vec!["10.96.0.30"]],
        },
        Case {
            name: "d_two_slices_duplicate_address",
            service_cidrs: V4,
            services: vec![service("web", "10.96.0.40", &[("http", "TCP", 80, 8080)])],
            slices: vec![
                slice(
                    "web-abc",
                    "web",
                    &[("http", "TCP", 8080)],
                    vec![ready("10.244.4.1"), ready("10.244.4.2")],
                ),
                slice(
                    "web-def",
                    "web",
                    &[("http", "TCP", 8080)],
                    vec![ready("10.244.4.2"), ready("10.244.4.3")],
                ),
            ],
            invalid: 0,
            forwarding: vec![vec![(
                "10.96.0.40 . tcp . 80",
                vec![
                    "10.244.4.1 . 8080",
                    "10.244.4.2 . 8080",
                    "10.244.4.3 . 8080",
                ],
            )]],
            cluster_ips: vec![vec!["10.96.0.40"]],
        },
        Case {
            name: "e_no_slices",
            service_cidrs: V4,
            services: vec![service("idle", "10.96.0.50", &[("http", "TCP", 80, 8080)])],
            slices: vec![],
            invalid: 0,
            forwarding: vec![vec![("10.96.0.50 . tcp . 80", vec![])]],
            cluster_ips: vec![vec!["10.96.0.50"]],
        },
        Case {
            name: "f_headless_and_external_name",
            service_cidrs: V4,
            services: vec![
                service_of(
                    "headless",
                    "ClusterIP",
                    &["None"],
                    &[("http", "TCP", 80, 8080)],
                ),
                json!({
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"namespace": NS, "name": "external"},
                    "spec": {"type": "ExternalName", "externalName": "example.com",
                             "ports": [{"name": "http", "protocol": "TCP", "port": 80}]},
                }),
            ],
            slices: vec![slice(
                "headless-abc",
                "headless",
                &[("http", "TCP", 8080)],
                ready_range(6, 2),
            )],
            invalid: 0,
            forwarding: vec![vec![]],
            cluster_ips: vec![vec![]],
        },
        Case {
            name: "g_slice_port_name_mismatch",
            service_cidrs: V4,
            services: vec![service("web", "10.96.0.70", &[("http", "TCP", 80, 8080)])],
            slices: vec![slice(
                "web-abc",
                "web",
                &[("web", "TCP", 8080)],
                ready_range(7, 2),
            )],
            invalid: 0,
            forwarding: vec![vec![("10.96.0.70 . tcp . 80", vec![])]],
            cluster_ips: vec![vec!["10.96.0.70"]],
        },
        Case {
            name: "h_unusable_endpoint_addresses",
            service_cidrs: V4,
            services: vec![service("web", "10.96.0.80", &[("http", "TCP", 80, 8080)])],
            slices: vec![slice(
                "web-abc",
                "web",
                &[("http", "TCP", 8080)],
                vec![
                    ready("224.0.0.1"),
                    ready("10.244.8.1"),
                    ready("127.0.0.1"),
                    ready("169.254.0.5"),
                ],
            )],
            invalid: 3,
            forwarding: vec![vec![("10.96.0.80 . tcp . 80", vec!["10.244.8.1 . 8080"])]],
            cluster_ips: vec![vec!["10.96.0.80"]],
        },
        Case {
            name: "i_cluster_ip_outside_service_cidrs",
            service_cidrs: V4,
            services: vec![service(
                "stray",
                "192.168.0.10",
                &[("http", "TCP", 80, 8080)],
            )],
            slices: vec![slice(
                "stray-abc",
                "stray",
                &[("http", "TCP", 8080)],
                ready_range(9, 1),
            )],
            // Served like any other (kube-proxy does not check the range): the service CIDRs
            // only say which unallocated addresses to drop, and a cluster may allocate from a
            // ServiceCIDR the brain does not follow.
            invalid: 0,
            forwarding: vec![vec![("192.168.0.10 . tcp . 80", vec!["10.244.9.1 . 8080"])]],
            cluster_ips: vec![vec!["192.168.0.10"]],
        },
        Case {
            name: "j_twenty_endpoints",
            service_cidrs: V4,
            services: vec![service("big", "10.96.0.100", &[("http", "TCP", 80, 8080)])],
            slices: vec![slice(
                "big-abc",
                "big",
                &[("http", "TCP", 8080)],
                ready_range(10, 20),
            )],
            invalid: 0,
            forwarding: vec![vec![(
                "10.96.0.100 . tcp . 80",
                vec![
                    "10.244.10.1 . 8080",
                    "10.244.10.2 . 8080",
                    "10.244.10.3 . 8080",
                    "10.244.10.4 . 8080",
                    "10.244.10.5 . 8080",
                    "10.244.10.6 . 8080",
                    "10.244.10.7 . 8080",
                    "10.244.10.8 . 8080",
                    "10.244.10.9 . 8080",
                    "10.244.10.10 . 8080",
                    "10.244.10.11 . 8080",
                    "10.244.10.12 . 8080",
                    "10.244.10.13 . 8080",
                    "10.244.10.14 . 8080",
                    "10.244.10.15 . 8080",
                    "10.244.10.16 . 8080",
                    "10.244.10.17 . 8080",
                    "10.244.10.18 . 8080",
                    "10.244.10.19 . 8080",
                    "10.244.10.20 . 8080",
                ],
            )]],
            cluster_ips: vec![vec!["10.96.0.100"]],
        },
        Case {
            name: "k_udp",
            service_cidrs: V4,
            services: vec![service("dns", "10.96.0.110", &[("dns", "UDP", 53, 5353)])],
            slices: vec![slice(
                "dns-abc",
                "dns",
                &[("dns", "UDP", 5353)],
                ready_range(11, 2),
            )],
            invalid: 0,
            forwarding: vec![vec![(
                "10.96.0.110 . udp . 53",
                vec!["10.244.11.1 . 5353", "10.244.11.2 . 5353"],
            )]],
            cluster_ips: vec![vec!["10.96.0.110"]],
        },
        Case {
            name: "l_dual_stack",
            service_cidrs: &["10.96.0.0/16", "fd00:96::/112"],
            services: vec![service_of(
                "web",
                "ClusterIP",
                &["10.96.0.120", "fd00:96::120"],
                &[("http", "TCP", 80, 8080)],
            )],
            slices: vec![
                slice(
                    "web-v4",
                    "web",
                    &[("http", "TCP", 8080)],
                    ready_range(12, 1),
                ),
                slice_of(
                    "web-v6",
                    "web",
                    "IPv6",
                    &[("http", "TCP", 8080)],
                    vec![ready("fd00:244::12:1"), ready("fd00:244::12:2")],
                ),
            ],
            invalid: 0,
            forwarding: vec![
                vec![("10.96.0.120 . tcp . 80", vec!["10.244.12.1 . 8080"])],
                vec![(
                    "fd00:96::120 . tcp . 80",
                    vec!["fd00:244::12:1 . 8080", "fd00:244::12:2 . 8080"],
                )],
            ],
            cluster_ips: vec![vec!["10.96.0.120"], vec!["fd00:96::120"]],
        },
    ]
}

#[test]
fn rulesets_match_golden_files() {
    let mut failures = Vec::new();
    for case in cases() {
        let name = case.name;
        let result = std::panic::catch_unwind(move || run_case(case));
        if let Err(e) = result {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            failures.push(format!("{name}: {msg}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

fn run_case(case: Case) {
    let mut c = Cluster::new(case.service_cidrs);
    for s in case.services {
        c.apply_service(s);
    }
    for s in case.slices {
        c.apply_slice(s);
    }
    assert_eq!(c.metrics.invalid_total(), case.invalid, "invalid objects");
    let rs = c.ruleset();
    check_invariants(&rs);
    assert_eq!(rs.tables.len(), case.forwarding.len(), "tables");
    for (i, t) in rs.tables.iter().enumerate() {
        let want: BTreeMap<String, Vec<String>> = case.forwarding[i]
            .iter()
            .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
            .collect();
        assert_eq!(forwarding(t), want, "forwarding of table {i}");
        assert_eq!(
            cluster_ips(t),
            case.cluster_ips[i],
            "cluster-ips of table {i}"
        );
    }
    golden(case.name, &rs);
}

/// The rulesets are a function of the index: applying the same objects in another order gives
/// the same ruleset, and so the same digest on every brain replica.
#[test]
fn ruleset_does_not_depend_on_order() {
    // One cluster of many Services, applied forwards and backwards.
    let objects = generated_cluster(7, 60);
    let mut fwd = Cluster::new(V4);
    for o in &objects {
        o.apply(&mut fwd);
    }
    let mut back = Cluster::new(V4);
    for o in objects.iter().rev() {
        o.apply(&mut back);
    }
    let (a, b) = (fwd.ruleset(), back.ruleset());
    assert_eq!(a, b);
    assert_eq!(
        Model::from_ruleset(&a).digest(),
        Model::from_ruleset(&b).digest()
    );
}

// ---- a larger generated cluster ----

/// A small deterministic generator (64-bit LCG), so that failures reproduce.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

enum Object {
    Service(Value),
    Slice(Value),
}

impl Object {
    fn apply(&self, c: &mut Cluster) {
        match self {
            Object::Service(v) => c.apply_service(v.clone()),
            Object::Slice(v) => c.apply_slice(v.clone()),
        }
    }
}

/// Generated Service `i`: its name, ClusterIP and ports (name, protocol, port, targetPort).
struct GenService {
    name: String,
    ip: String,
    ports: Vec<(String, &'static str, i32, i32)>,
    /// Ready, distinct endpoint addresses.
    ready: BTreeSet<String>,
}

/// `n` Services with 0..25 ready endpoints each (some ports without any), spread over up to
/// three slices with duplicates across slices and not-ready endpoints mixed in.
fn generated(seed: u64, n: usize) -> (Vec<GenService>, Vec<Object>) {
    let mut rng = Lcg(seed);
    let mut services = Vec::new();
    let mut objects = Vec::new();
    for i in 0..n {
        let name = format!("svc-{i}");
        let ip = format!("10.96.{}.{}", i / 200, i % 200 + 1);
        let nports = 1 + rng.below(3) as usize;
        let ports: Vec<(String, &'static str, i32, i32)> = (0..nports)
            .map(|p| {
                let proto = if rng.below(4) == 0 { "UDP" } else { "TCP" };
                (format!("p{p}"), proto, 80 + p as i32, 8080 + p as i32)
            })
            .collect();
        let want = rng.below(26) as usize;
        let addr = |k: usize| format!("10.{}.{}.{}", 100 + i / 250, i % 250, k + 1);
        let ready: BTreeSet<String> = (0..want).map(addr).collect();
        let port_json: Vec<(String, &'static str, i32)> = ports
            .iter()
            .map(|(n, proto, _, target)| (n.clone(), *proto, *target))
            .collect();
        let port_refs: Vec<(&str, &str, i32)> = port_json
            .iter()
            .map(|(n, p, t)| (n.as_str(), *p, *t))
            .collect();
        objects.push(Object::Service(service(
            &name,
            &ip,
            &ports
                .iter()
                .map(|(n, p, port, t)| (n.as_str(), *p, *port, *t))
                .collect::<Vec<_>>(),
        )));
        if want > 0 || rng.below(2) == 0 {
            let nslices = 1 + rng.below(3) as usize;
            let mut per_slice: Vec<Vec<Value>> = vec![Vec::new(); nslices];
            for (k, a) in ready.iter().enumerate() {
                per_slice[k % nslices].push(ready_or_unset(&mut rng, a));
                // A duplicate in another slice.
                if nslices > 1 && rng.below(5) == 0 {
                    per_slice[(k + 1) % nslices].push(ready_or_unset(&mut rng, a));
                }
            }
            // Not-ready endpoints never count.
            for k in 0..rng.below(4) as usize {
                per_slice[k % nslices].push(not_ready(&addr(200 + k)));
            }
            for (s, eps) in per_slice.into_iter().enumerate() {
                objects.push(Object::Slice(slice(
                    &format!("{name}-{s}"),
                    &name,
                    &port_refs,
                    eps,
                )));
            }
        }
        services.push(GenService {
            name,
            ip,
            ports,
            ready,
        });
    }
    (services, objects)
}

fn ready_or_unset(rng: &mut Lcg, a: &str) -> Value {
    if rng.below(3) == 0 {
        unconditioned(a)
    } else {
        ready(a)
    }
}

fn generated_cluster(seed: u64, n: usize) -> Vec<Object> {
    generated(seed, n).1
}

#[test]
fn generated_cluster_keeps_the_invariants() {
    let (services, objects) = generated(42, 300);
    let mut c = Cluster::new(V4);
    for o in &objects {
        o.apply(&mut c);
    }
    assert_eq!(c.metrics.invalid_total(), 0);
    let rs = c.ruleset();
    assert_eq!(rs.tables.len(), 1);
    check_invariants(&rs);

    // What it forwards is what the objects say.
    let mut want = BTreeMap::new();
    let mut total = 0;
    for s in &services {
        for (_, proto, port, target) in &s.ports {
            let eps: Vec<String> = s
                .ready
                .iter()
                .map(|a| a.parse::<std::net::Ipv4Addr>().expect("address"))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .map(|a| format!("{a} . {target}"))
                .collect();
            total += eps.len();
            want.insert(format!("{} . {} . {port}", s.ip, proto.to_lowercase()), eps);
        }
    }
    let t = &rs.tables[0];
    assert_eq!(forwarding(t), want);
    assert_eq!(set(t, "service-endpoints").elements.len(), total);
    assert_eq!(cluster_ips(t).len(), services.len());
    // The generator did produce the interesting cases.
    let counts: BTreeSet<usize> = want.values().map(Vec::len).collect();
    assert!(counts.contains(&0) && counts.iter().any(|n| *n > PREALLOCATED_COUNTS as usize));
    assert!(
        t.sets
            .iter()
            .any(|s| endpoint_count(&s.name).is_some_and(|n| n > PREALLOCATED_COUNTS as usize))
    );
}

/// Service churn and endpoint churn move elements only: the chains a delta carries are the
/// `services` chain when a count above the preallocated ones appears or goes, and never with a
/// jump (docs/ruleset.md: every added jump makes the kernel validate the whole table).
#[test]
fn churn_moves_elements_not_jumps() {
    let (services, objects) = generated(7, 100);
    let mut c = Cluster::new(V4);
    for o in &objects {
        o.apply(&mut c);
    }
    let mut before = Model::from_ruleset(&c.ruleset());
    // The brain's incremental state, fed only the name of the Service each step touches, must
    // stay equal to the ruleset computed from scratch.
    let mut incremental = splitproxy_brain::desired::SharedRuleset::new(c.config.clone());
    incremental.rebuild(&c.index);
    let mut rng = Lcg(99);
    let mut chain_changes = 0;
    for step in 0..150 {
        let s = &services[rng.below(services.len() as u64) as usize];
        let ports: Vec<(&str, &str, i32)> = s
            .ports
            .iter()
            .map(|(n, p, _, t)| (n.as_str(), *p, *t))
            .collect();
        match rng.below(4) {
            // The Service goes away, or comes back.
            0 => {
                if c.index
                    .service(&ObjectKey::new(NS, s.name.as_str()))
                    .is_some()
                {
                    c.delete_service(&s.name);
                } else {
                    c.apply_service(service(
                        &s.name,
                        &s.ip,
                        &s.ports
                            .iter()
                            .map(|(n, p, port, t)| (n.as_str(), *p, *port, *t))
                            .collect::<Vec<_>>(),
                    ));
                }
            }
            // Its first slice gets 0..=24 endpoints.
            _ => {
                let n = rng.below(25) as u8;
                c.apply_slice(slice(
                    &format!("{}-0", s.name),
                    &s.name,
                    &ports,
                    (1..=n)
                        .map(|k| ready(&format!("10.250.{step}.{k}")))
                        .collect(),
                ));
            }
        }
        let rs = c.ruleset();
        if step % 10 == 0 {
            check_invariants(&rs);
        }
        incremental.update(&c.index, [ObjectKey::new(NS, s.name.as_str())].iter());
        assert_eq!(
            incremental.model().to_ruleset(),
            rs,
            "step {step}: incremental state diverged"
        );
        let after = Model::from_ruleset(&rs);
        assert_eq!(
            incremental.model().digest(),
            after.digest(),
            "step {step}: digest diverged"
        );
        let delta = before.diff(&after);
        for t in &delta.upsert {
            for ch in &t.chains {
                assert_eq!(
                    ch.name, "services",
                    "step {step}: chain {} changed",
                    ch.name
                );
                chain_changes += 1;
                for r in &ch.rules {
                    for e in &r.exprs {
                        assert!(
                            !matches!(&e.kind, Some(Kind::Verdict(v)) if v.code == VerdictCode::Jump as i32 || v.code == VerdictCode::Goto as i32),
                            "step {step}: a jump in {}",
                            ch.name
                        );
                    }
                }
            }
        }
        for t in &delta.remove {
            assert!(!t.whole && t.chains.is_empty(), "step {step}: {t:?}");
            for s in &t.sets {
                let n = endpoint_count(s).unwrap_or(0);
                assert!(
                    n > PREALLOCATED_COUNTS as usize,
                    "step {step}: set {s} removed"
                );
            }
        }
        let mut applied = before.clone();
        applied.apply(&delta);
        assert_eq!(applied, after, "step {step}: diff then apply");
        before = after;
    }
    check_invariants(&c.ruleset());
    // The walk did cross the preallocated counts at least once.
    assert!(chain_changes > 0);
}

/// The invariant checker itself catches what it is meant to catch.
#[test]
fn invariant_checker_catches_violations() {
    let mut c = Cluster::new(V4);
    c.apply_service(service("web", "10.96.0.10", &[("http", "TCP", 80, 8080)]));
    c.apply_slice(slice(
        "web-abc",
        "web",
        &[("http", "TCP", 8080)],
        ready_range(1, 3),
    ));
    let good = c.ruleset();
    check_invariants(&good);
    fn table(rs: &mut Ruleset) -> &mut Table {
        &mut rs.tables[0]
    }
    fn set_mut(t: &Table, name: &str) -> usize {
        t.sets
            .iter()
            .position(|s| s.name == name)
            .expect("set in the good ruleset")
    }
    type Mutation = (&'static str, fn(&mut Ruleset));
    let mutations: Vec<Mutation> = vec![
        ("a jump in the services chain", |rs| {
            let t = table(rs);
            let i = t.chains.iter().position(|c| c.name == "services").unwrap();
            let mut r = t.chains[i].rules[0].clone();
            if let Some(Kind::Nat(_)) = r.exprs.last().and_then(|e| e.kind.clone()) {
                r.exprs.pop();
            }
            let jump = t.chains[0].clone(); // any chain name
            r.exprs.push(splitproxy_proto::v1::Expr {
                kind: Some(Kind::Verdict(splitproxy_proto::v1::Verdict {
                    code: VerdictCode::Jump as i32,
                    chain: jump.name,
                })),
            });
            t.chains[i].rules.push(r);
        }),
        ("a port in two sets", |rs| {
            let t = table(rs);
            let from = set_mut(t, "service-ports-3");
            let e = t.sets[from].elements[0].clone();
            let to = set_mut(t, "no-endpoint-services");
            t.sets[to].elements.push(e);
        }),
        ("a missing slot", |rs| {
            let t = table(rs);
            let i = set_mut(t, "service-endpoints");
            t.sets[i].elements.remove(1);
        }),
        ("a slot too many", |rs| {
            let t = table(rs);
            let i = set_mut(t, "service-endpoints");
            let mut e = t.sets[i].elements[0].clone();
            e.key[3] = splitproxy_proto::v1::Datum {
                value: Some(datum::Value::U32(3)),
            };
            t.sets[i].elements.push(e);
        }),
        ("a missing DNAT rule", |rs| {
            let t = table(rs);
            let i = t.chains.iter().position(|c| c.name == "services").unwrap();
            t.chains[i]
                .rules
                .retain(|r| !format!("{r:?}").contains("\"service-ports-2\""));
        }),
        ("a verdict map", |rs| {
            let t = table(rs);
            let mut s = t.sets[0].clone();
            s.name = "dispatch".into();
            s.data = vec![DataType::Verdict as i32];
            t.sets.push(s);
        }),
    ];
    for (what, mutate) in mutations {
        let mut bad = good.clone();
        mutate(&mut bad);
        let caught = std::panic::catch_unwind(|| check_invariants(&bad)).is_err();
        assert!(caught, "check_invariants missed {what}");
    }
}

/// Kubernetes allows 63-character namespaces and Service names and 15-character port names,
/// so `namespace/name:port` can reach 143 bytes; nftables keeps 127.
#[test]
fn long_names_fit_nftables_comments() {
    let ns = "n".repeat(63);
    let name = "s".repeat(63);
    let port = "p".repeat(15);
    let mut c = Cluster::new(V4);
    let mut svc = service(&name, "10.96.0.5", &[(port.as_str(), "TCP", 80, 8080)]);
    svc["metadata"]["namespace"] = json!(ns);
    c.apply_service(svc);
    let mut idle = service(&name, "10.96.0.6", &[(port.as_str(), "TCP", 80, 8080)]);
    idle["metadata"]["namespace"] = json!(format!("{}x", &ns[1..]));
    c.apply_service(idle);
    let mut s = slice(
        &format!("{name}-abc"),
        &name,
        &[(port.as_str(), "TCP", 8080)],
        ready_range(1, 1),
    );
    s["metadata"]["namespace"] = json!(ns);
    c.apply_slice(s);
    let rs = c.ruleset();
    assert_eq!(
        forwarding(&rs.tables[0]).len(),
        2,
        "both Services are in the ruleset"
    );
    check_invariants(&rs);
}
