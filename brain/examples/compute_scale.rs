//! Brain computation at scale, without an API server: S Services x E endpoints through the
//! index, a full rebuild, then single-Service changes, diffs between versions and the encoded
//! size of a snapshot and of a delta. `cargo run --release -p splitproxy-brain --example
//! compute_scale -- [S] [E]`.
use std::sync::Arc;
use std::time::Instant;

use prost::Message;
use splitproxy_brain::desired::Desired;
use splitproxy_brain::index::Index;
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, ObjectKey};
use splitproxy_brain::rules::{NodeView, RulesConfig};

fn service(i: u32) -> k8s_openapi::api::core::v1::Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("s{i}"), "namespace": "bench"},
        "spec": {"clusterIP": format!("10.{}.{}.{}", 96 + i / 65536, (i / 256) % 256, i % 256),
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}
    }))
    .unwrap()
}

fn slice(i: u32, e: u32, round: u32) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    let eps: Vec<_> = (0..e)
        .map(|k| {
            let n = i * e + k + round * 7;
            serde_json::json!({"addresses": [format!("10.{}.{}.{}", 128 + (n / 65536) % 64, (n / 256) % 256, n % 256)],
                               "conditions": {"ready": true}})
        })
        .collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("s{i}-1"), "namespace": "bench", "labels": {"kubernetes.io/service-name": format!("s{i}")}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": eps,
    }))
    .unwrap()
}

fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (s, e) = (
        args.first().copied().unwrap_or(10_000),
        args.get(1).copied().unwrap_or(10),
    );
    let metrics = Metrics::default();
    let mut index = Index::default();
    let t = Instant::now();
    for i in 0..s {
        let svc = service(i);
        index.apply_service(ObjectKey::of(&svc), objects::service(&svc, &[], &metrics));
        let sl = slice(i, e, 0);
        index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
    }
    println!("index of {s} Services x {e} endpoints: {:?}", t.elapsed());
    let mut d = Desired::new(RulesConfig::default(), NodeView::default());
    let t = Instant::now();
    d.rebuild(&index);
    println!(
        "full rebuild: {:?}, {} elements",
        t.elapsed(),
        d.model().element_count()
    );
    let v0 = Arc::new(d.model().clone());
    let t = Instant::now();
    let snap = v0.to_ruleset().encode_to_vec();
    println!(
        "snapshot: {} bytes, built and encoded in {:?}",
        snap.len(),
        t.elapsed()
    );
    // One endpoint change, one Service at a time, 100 times.
    let mut times = Vec::new();
    let mut prev = v0.clone();
    let mut diffs = Vec::new();
    let mut sizes = Vec::new();
    for k in 0..100u32 {
        let i = (k * 97) % s;
        let sl = slice(i, e, k + 1);
        let t = Instant::now();
        index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
        d.update(&index, [ObjectKey::new("bench", format!("s{i}"))].iter());
        let next = Arc::new(d.model().clone());
        times.push(t.elapsed());
        let t = Instant::now();
        let delta = prev.diff(&next);
        diffs.push(t.elapsed());
        sizes.push(delta.encode_to_vec().len());
        prev = next;
    }
    times.sort();
    diffs.sort();
    println!(
        "one Service change: compute p50 {:?} max {:?}; diff p50 {:?} max {:?}; delta {} bytes",
        times[50], times[99], diffs[50], diffs[99], sizes[50]
    );
    let rss = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let line = rss
        .lines()
        .find(|l| l.starts_with("VmRSS"))
        .unwrap_or_default()
        .to_string();
    println!("{line}");
}
