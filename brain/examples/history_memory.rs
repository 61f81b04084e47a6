//! What the brain's history of recent publications costs in memory (`brain/src/history.rs`):
//! S Services x E endpoints over N nodes (every node's overlay built), then single-Service
//! endpoint changes published one after another, as the brain publishes them, each recorded in
//! the history. Live heap is counted by the allocator. Then the history is made to hold the
//! newest publication only, which frees what the older versions alone held; and a rebuild (a
//! relist) is recorded, after which the history keeps one state from before it. More changes
//! than the history keeps publications show what the step log costs beyond them
//! (`brain/src/history/steps.rs`), and how long recording a publication takes.
//!
//! `cargo run --release -p splitproxy-brain --example history_memory -- [S] [E] [N] [changes]`
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use splitproxy_brain::desired::SharedRuleset;
use splitproxy_brain::fanout::Publication;
use splitproxy_brain::history::{HISTORY_VERSIONS, History};
use splitproxy_brain::index::Index;
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, NodeInfo, ObjectKey};
use splitproxy_brain::overlay::Overlays;
use splitproxy_brain::rules::RulesConfig;

/// Counts live heap bytes, which RSS blurs with the allocator's retained pages.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { std::alloc::System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn mib() -> f64 {
    LIVE.load(Ordering::Relaxed) as f64 / (1 << 20) as f64
}

fn service(i: u32) -> k8s_openapi::api::core::v1::Service {
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
fn slice(i: u32, e: u32, round: u32, nodes: u32) -> k8s_openapi::api::discovery::v1::EndpointSlice {
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
fn publication(
    version: u64,
    d: &SharedRuleset,
    overlays: &mut Overlays,
    published: &mut splitproxy_brain::overlay::NodeOverlays,
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
        api: Default::default(),
    })
}

fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let s = args.first().copied().unwrap_or(10_000);
    let e = args.get(1).copied().unwrap_or(10);
    let nodes = args.get(2).copied().unwrap_or(5_000);
    let changes = args.get(3).copied().unwrap_or(HISTORY_VERSIONS as u32 - 1);
    let metrics = Metrics::default();
    let mut index = Index::default();
    for i in 0..s {
        let svc = service(i);
        index.apply_service(
            ObjectKey::of(&svc),
            objects::service(&svc, &Default::default(), &metrics),
        );
        let sl = slice(i, e, 0, nodes);
        index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
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
    let config = RulesConfig::default();
    let mut d = SharedRuleset::new(config.clone());
    let mut overlays = Overlays::new(config.clone());
    let t = Instant::now();
    d.rebuild(&index);
    overlays.rebuild(&index, &mut d);
    d.prune();
    let mut published = splitproxy_brain::overlay::NodeOverlays::default();
    let history = History::default();
    let mut version = 1;
    history.record(publication(version, &d, &mut overlays, &mut published));
    let state = mib();
    println!(
        "{s} Services x {e} endpoints, {nodes} nodes: built in {:?}, {} shared elements; live heap {state:.1} MiB (index, state, one publication)",
        t.elapsed(),
        d.model().element_count(),
    );

    let mut recording = std::time::Duration::ZERO;
    for k in 0..changes {
        let i = (k * 97) % s;
        let sl = slice(i, e, 1000 + k, nodes);
        index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
        let key = [ObjectKey::new("bench", format!("s{i}"))];
        d.update(&index, key.iter());
        overlays.update(&index, &mut d, key.iter(), std::iter::empty());
        d.prune();
        version += 1;
        let p = publication(version, &d, &mut overlays, &mut published);
        let t = Instant::now();
        history.record(p);
        recording += t.elapsed();
    }
    let full = mib();
    println!(
        "history of {} versions and {} steps naming {} objects (after {changes} one-Service endpoint changes): live heap {full:.1} MiB; recording took {:?} per publication (the step log's diff)",
        history.versions().len(),
        history.step_versions().len(),
        history.step_objects(),
        recording / changes.max(1),
    );

    // Only the newest, many times over: what the older versions alone held is freed.
    let newest = publication(version, &d, &mut overlays, &mut published);
    for _ in 0..HISTORY_VERSIONS {
        history.record(newest.clone());
    }
    let one = mib();
    println!(
        "history of the newest version only: live heap {one:.1} MiB; the {changes} older versions held {:.2} MiB ({:.1} KiB each)",
        full - one,
        (full - one) * 1024.0 / changes.max(1) as f64
    );

    // A rebuild (a relist with a change): everything built anew, nothing shared.
    let sl = slice(0, e, 9999, nodes);
    index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
    d.rebuild(&index);
    overlays.rebuild(&index, &mut d);
    d.prune();
    version += 1;
    history.record(publication(version, &d, &mut overlays, &mut published));
    drop(newest);
    println!(
        "after a rebuild: history {:?}, live heap {:.1} MiB (the state from before the rebuild is kept: {:.1} MiB)",
        history.versions(),
        mib(),
        mib() - one
    );
}
