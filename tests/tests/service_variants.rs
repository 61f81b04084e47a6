//! `GetService`'s variants against a real kube-apiserver (issue #13, "its endpoints as each
//! node variant sees them"): a brain, three Nodes in two zones, and three Services.
//!
//! - a plain ClusterIP Service: one variant, every node sending to both endpoints;
//! - a NodePort Service with `externalTrafficPolicy: Local` and endpoints on node-a and node-b:
//!   each of those nodes sends external (NodePort) traffic to its own endpoint only, node-c
//!   drops it, and every node sends ClusterIP traffic to both;
//! - a Service with topology hints for zone-1 and zone-2: one variant per zone, named by it;
//!
//! and `WatchService` following the Local Service as node-c gains an endpoint, and plain
//! grpcurl showing the variants in words. The brain serves no actuator here: the variants come
//! from the rulesets it publishes for the nodes, whoever holds them.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use splitproxy_proto::v1::service_traffic::Kind;
use splitproxy_proto::v1::{
    GetServiceRequest, GetServiceResponse, PacketFate, ServiceTraffic, ServiceVariant,
};
use splitproxy_tests::certs::Pki;
use splitproxy_tests::controlplane::{ControlPlane, ControlPlaneOptions};
use splitproxy_tests::deploy::{Brain, BrainOptions, grpc_client};

const NS: &str = "variants";

/// Server-side apply of `value` through `api`.
async fn apply<K>(api: &Api<K>, value: Value)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let name = value["metadata"]["name"].as_str().unwrap().to_string();
    api.patch(
        &name,
        &PatchParams::apply("variants-test").force(),
        &Patch::Apply(&value),
    )
    .await
    .unwrap_or_else(|e| panic!("applying {name}: {e}"));
}

async fn node(cp: &ControlPlane, name: &str, zone: &str, ip: &str) {
    let api: Api<Node> = Api::all(cp.client());
    apply(
        &api,
        json!({"apiVersion": "v1", "kind": "Node",
               "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}}}),
    )
    .await;
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "addresses": [{"type": "InternalIP", "address": ip}],
            "conditions": [{"type": "Ready", "status": "True"}],
        }})),
    )
    .await
    .unwrap();
}

fn service(name: &str, ip: &str, node_port: Option<u16>, extra: Value) -> Value {
    let mut port = json!({"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080});
    let mut spec = json!({"type": "ClusterIP", "clusterIP": ip, "ports": [port.clone()]});
    if let Some(np) = node_port {
        port["nodePort"] = json!(np);
        spec["type"] = json!("NodePort");
        spec["ports"] = json!([port]);
    }
    if let Value::Object(m) = extra {
        for (k, v) in m {
            spec[k] = v;
        }
    }
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"namespace": NS, "name": name}, "spec": spec})
}

/// A slice of `svc`: endpoints as (address, node, zone hint or "").
fn slice(name: &str, svc: &str, eps: &[(&str, &str, &str)]) -> Value {
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|(ip, node, hint)| {
            let mut e = json!({"addresses": [ip], "nodeName": node,
                               "conditions": {"ready": true, "serving": true, "terminating": false}});
            if !hint.is_empty() {
                e["hints"] = json!({"forZones": [{"name": hint}]});
            }
            e
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"namespace": NS, "name": name,
                        "labels": {"kubernetes.io/service-name": svc}},
           "addressType": "IPv4",
           "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
           "endpoints": endpoints})
}

fn ask(name: &str) -> GetServiceRequest {
    GetServiceRequest {
        namespace: NS.into(),
        name: name.into(),
    }
}

fn variant<'a>(r: &'a GetServiceResponse, node: &str) -> &'a ServiceVariant {
    r.variants
        .iter()
        .find(|v| v.nodes.iter().any(|n| n == node))
        .unwrap_or_else(|| panic!("{node} in no variant:\n{}", r.variants_summary))
}

fn traffic(v: &ServiceVariant, kind: Kind) -> &ServiceTraffic {
    v.traffic
        .iter()
        .find(|t| t.kind() == kind)
        .unwrap_or_else(|| panic!("no {kind:?} traffic in {v:?}"))
}

/// The endpoints of a traffic entry as "address:port", in order.
fn endpoints(t: &ServiceTraffic) -> Vec<String> {
    t.endpoints
        .iter()
        .map(|e| format!("{}:{}", e.address, e.port))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn get_service_shows_each_node_variant() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new("variants").unwrap();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let opts = BrainOptions::with_service_cidrs(&["10.96.0.0/16".parse().unwrap()]);
    let brain = Brain::start(
        &exe,
        cp.kubeconfig_path(),
        &pki,
        dir.path(),
        "brain",
        None,
        &opts,
    )
    .unwrap();
    let op = pki
        .write(
            dir.path(),
            "operator",
            &pki.operator_cert("operator").unwrap(),
        )
        .unwrap();

    node(&cp, "node-a", "zone-1", "192.168.50.1").await;
    node(&cp, "node-b", "zone-1", "192.168.50.2").await;
    node(&cp, "node-c", "zone-2", "192.168.50.3").await;
    apply(
        &Api::<Namespace>::all(cp.client()),
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}),
    )
    .await;
    let services: Api<Service> = Api::namespaced(cp.client(), NS);
    let slices: Api<EndpointSlice> = Api::namespaced(cp.client(), NS);
    apply(&services, service("web", "10.96.20.10", None, json!({}))).await;
    apply(
        &slices,
        slice(
            "web-1",
            "web",
            &[("10.244.1.10", "node-a", ""), ("10.244.2.10", "node-b", "")],
        ),
    )
    .await;
    apply(
        &services,
        service(
            "local",
            "10.96.20.11",
            Some(30111),
            json!({"externalTrafficPolicy": "Local"}),
        ),
    )
    .await;
    apply(
        &slices,
        slice(
            "local-1",
            "local",
            &[("10.244.1.11", "node-a", ""), ("10.244.2.11", "node-b", "")],
        ),
    )
    .await;
    apply(&services, service("topo", "10.96.20.12", None, json!({}))).await;
    apply(
        &slices,
        slice(
            "topo-1",
            "topo",
            &[
                ("10.244.1.12", "node-a", "zone-1"),
                ("10.244.3.12", "node-c", "zone-2"),
            ],
        ),
    )
    .await;

    let mut client = grpc_client(brain.grpc, &op).await.unwrap();
    // Until the brain has published all three with every node (it serves nothing before its
    // lists are complete).
    let deadline = Instant::now() + Duration::from_secs(30);
    let settled = |r: &GetServiceResponse, variants: usize| {
        r.variants_version > 0
            && r.variants.len() == variants
            && r.variants.iter().map(|v| v.node_count).sum::<u32>() == 3
    };
    let mut get = async |name: &str, variants: usize| loop {
        let r = client.get_service(ask(name)).await;
        if let Ok(r) = &r
            && settled(r.get_ref(), variants)
        {
            return r.get_ref().clone();
        }
        assert!(Instant::now() < deadline, "{name} never settled: {r:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    // A plain Service: one variant, every node to both endpoints, half each.
    let web = get("web", 1).await;
    let only = &web.variants[0];
    assert_eq!(only.nodes, ["node-a", "node-b", "node-c"]);
    assert_eq!(only.traffic.len(), 1, "{}", web.variants_summary);
    let t = traffic(only, Kind::ClusterIp);
    assert_eq!(t.destinations, ["10.96.20.10:80"]);
    assert_eq!(t.fate(), PacketFate::Dnat);
    assert_eq!(endpoints(t), ["10.244.1.10:8080", "10.244.2.10:8080"]);
    assert!(
        t.endpoints.iter().all(|e| (e.share - 0.5).abs() < 1e-9),
        "{t:?}"
    );
    eprintln!("[variants] web:\n{}", web.variants_summary);

    // externalTrafficPolicy Local: three variants.
    let local = get("local", 3).await;
    eprintln!("[variants] local:\n{}", local.variants_summary);
    for (n, own) in [
        ("node-a", "10.244.1.11:8080"),
        ("node-b", "10.244.2.11:8080"),
    ] {
        let v = variant(&local, n);
        assert_eq!(v.node_count, 1);
        let np = traffic(v, Kind::NodePort);
        assert_eq!(np.destinations, ["<node>:30111"]);
        assert_eq!(endpoints(np), [own], "{n}");
    }
    let c = variant(&local, "node-c");
    let np = traffic(c, Kind::NodePort);
    assert_eq!(np.fate(), PacketFate::Dropped, "{np:?}");
    assert!(np.endpoints.is_empty());
    for n in ["node-a", "node-b", "node-c"] {
        assert_eq!(
            endpoints(traffic(variant(&local, n), Kind::ClusterIp)),
            ["10.244.1.11:8080", "10.244.2.11:8080"],
            "{n}"
        );
    }
    assert!(
        local
            .variants_summary
            .starts_with("3 variants over 3 nodes (publication ")
            && local
                .variants_summary
                .contains("NodePort <node>:30111 (TCP http, from a client outside the cluster (203.0.113.7)) -> no endpoint: dropped"),
        "{}",
        local.variants_summary
    );

    // Topology hints: one variant per zone, named by it.
    let topo = get("topo", 2).await;
    eprintln!("[variants] topo:\n{}", topo.variants_summary);
    let z1 = variant(&topo, "node-a");
    assert_eq!(
        (z1.zone.as_str(), z1.nodes.clone()),
        ("zone-1", vec!["node-a".to_string(), "node-b".to_string()])
    );
    assert_eq!(
        endpoints(traffic(z1, Kind::ClusterIp)),
        ["10.244.1.12:8080"]
    );
    let z2 = variant(&topo, "node-c");
    assert_eq!((z2.zone.as_str(), z2.node_count), ("zone-2", 1));
    assert_eq!(
        endpoints(traffic(z2, Kind::ClusterIp)),
        ["10.244.3.12:8080"]
    );

    // WatchService follows the Local Service as node-c gains an endpoint of its own.
    let mut watch = client
        .watch_service(ask("local"))
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.variants, local.variants);
    apply(
        &slices,
        slice(
            "local-1",
            "local",
            &[
                ("10.244.1.11", "node-a", ""),
                ("10.244.2.11", "node-b", ""),
                ("10.244.3.11", "node-c", ""),
            ],
        ),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let after = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let next = tokio::time::timeout(left, watch.message())
            .await
            .expect("the stream never showed node-c's own endpoint")
            .unwrap()
            .unwrap();
        let c = variant(&next, "node-c");
        if traffic(c, Kind::NodePort).fate() == PacketFate::Dnat {
            break next;
        }
    };
    assert!(after.variants_version > local.variants_version);
    let c = variant(&after, "node-c");
    assert_eq!(endpoints(traffic(c, Kind::NodePort)), ["10.244.3.11:8080"]);
    assert_eq!(
        endpoints(traffic(c, Kind::ClusterIp)),
        ["10.244.1.11:8080", "10.244.2.11:8080", "10.244.3.11:8080"]
    );

    // A change elsewhere in the cluster is a new publication, but no news for this stream.
    apply(
        &slices,
        slice("web-1", "web", &[("10.244.1.10", "node-a", "")]),
    )
    .await;
    let quiet = tokio::time::timeout(Duration::from_secs(2), watch.message()).await;
    assert!(
        quiet.is_err(),
        "news of another Service's change: {quiet:?}"
    );
    let web = client.get_service(ask("web")).await.unwrap().into_inner();
    assert!(web.variants_version > after.variants_version, "{web:?}");

    // Plain grpcurl through reflection shows the same, in words too.
    let out = splitproxy_tests::tools::grpcurl(&op)
        .unwrap()
        .args(["-d", &format!(r#"{{"namespace":"{NS}","name":"local"}}"#)])
        .arg(brain.grpc.to_string())
        .arg("splitproxy.v1.Dataplane/GetService")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let json: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "grpcurl GetService: {e}\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    // grpcurl writes field names in JSON's camelCase (`jq -r .variantsSummary`).
    let summary = json["variantsSummary"].as_str().unwrap_or_default();
    assert!(
        summary.starts_with("3 variants over 3 nodes")
            && summary.contains("(node-c), zone zone-2:")
            && summary.contains("NodePort <node>:30111 (TCP http, from a client outside the cluster (203.0.113.7)) -> 10.244.3.11:8080"),
        "{summary}"
    );
    assert_eq!(json["variants"].as_array().map(Vec::len), Some(3), "{text}");
}
