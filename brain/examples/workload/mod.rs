//! The workload the brain's examples compute: S NodePort Services with E ready endpoints each,
//! spread over N nodes, as the API server would send them (decoded from JSON like a watch's).
use std::sync::Arc;

use splitproxy_brain::desired::SharedRuleset;
use splitproxy_brain::fanout::Publication;
use splitproxy_brain::index::Index;
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, NodeInfo, ObjectKey};
use splitproxy_brain::overlay::Overlays;
use splitproxy_proto::model::Model;

/// The index of `s` Services with `e` endpoints each over `nodes` nodes (every slice in its
/// round 0).
pub fn index(s: u32, e: u32, nodes: u32, metrics: &Metrics) -> Index {
    let mut index = Index::default();
    for i in 0..s {
        let svc = service(i);
        index.apply_service(
            ObjectKey::of(&svc),
            objects::service(&svc, &Default::default(), metrics),
        );
        let sl = slice(i, e, 0, nodes);
        index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, metrics));
    }
    for n in 0..nodes {
        let ip = format!("192.168.{}.{}", n / 256, n % 256).parse().unwrap();
        let name = format!("node-{n}");
        index.apply_node(
            name.clone(),
            Some(NodeInfo {
                name,
                addresses: vec![ip],
                primary: vec![ip],
                ..Default::default()
            }),
        );
    }
    index
}

pub fn service(i: u32) -> k8s_openapi::api::core::v1::Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("s{i}"), "namespace": "bench"},
        "spec": {"type": "NodePort",
                 "clusterIP": format!("10.{}.{}.{}", 96 + i / 65536, (i / 256) % 256, i % 256),
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP",
                            "nodePort": 30000 + (i % 2700)}]}
    }))
    .unwrap()
}

/// Endpoints of Service `i`, each on one of `nodes` nodes.
pub fn slice(
    i: u32,
    e: u32,
    round: u32,
    nodes: u32,
) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    let eps: Vec<_> = (0..e)
        .map(|k| {
            let n = i * e + k + round * 7;
            serde_json::json!({
                "addresses": [format!("10.{}.{}.{}", 128 + (n / 65536) % 64, (n / 256) % 256, n % 256)],
                "conditions": {"ready": true},
                "nodeName": format!("node-{}", n % nodes.max(1)),
            })
        })
        .collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("s{i}-1"), "namespace": "bench",
                     "labels": {"kubernetes.io/service-name": format!("s{i}")}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": eps,
    }))
    .unwrap()
}

/// The publication of the current state, overlays updated with what changed.
pub fn publication(
    version: u64,
    d: &SharedRuleset,
    overlays: &mut Overlays,
    published: &mut imbl::HashMap<String, Arc<Model>>,
) -> Arc<Publication> {
    for (node, m) in overlays.changed_models() {
        match m {
            Some(m) => {
                published.insert(node, m);
            }
            None => {
                published.remove(&node);
            }
        }
    }
    Arc::new(Publication {
        version,
        shared: Arc::new(d.model().clone()),
        overlays: published.clone(),
    })
}
