//! Brain computation and kernel apply at scale, without an API server: S Services x E endpoints
//! through the brain's index and incremental desired state (full rebuild, single-Service
//! changes, diffs between versions, encoded sizes), then applied by the actuator's applier in a
//! private network namespace as a snapshot (cold start) and as deltas (one endpoint change, one
//! Service added, one deleted). With N > 0, endpoints are spread over N Nodes and the brain
//! also builds every node's overlay ([`splitproxy_brain::overlay`]): the memory that grows with
//! nodes. As root:
//! `cargo run --release -p splitproxy-tests --example scale -- [S] [E] [N]`.
use std::sync::Arc;
use std::time::Instant;

use splitproxy_actuator::apply::Applier;
use splitproxy_actuator::nft::NftSocket;
use splitproxy_brain::desired::SharedRuleset;
use splitproxy_brain::index::Index;
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, NodeInfo, ObjectKey};
use splitproxy_brain::overlay::Overlays;
use splitproxy_brain::rules::RulesConfig;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{Update, update::Body};

fn service(i: u32) -> k8s_openapi::api::core::v1::Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("s{i}"), "namespace": "bench"},
        "spec": {"clusterIP": format!("10.{}.{}.{}", 96 + i / 65536, (i / 256) % 256, i % 256),
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}
    }))
    .unwrap()
}

/// Endpoints of Service `i`; with `nodes` > 0, each on one of them (`nodeName`).
fn slice(i: u32, e: u32, round: u32, nodes: u32) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    let eps: Vec<_> = (0..e)
        .map(|k| {
            let n = i * e + k + round * 7;
            let mut ep = serde_json::json!({"addresses": [format!("10.{}.{}.{}", 128 + (n / 65536) % 64, (n / 256) % 256, n % 256)],
                               "conditions": {"ready": true}});
            if nodes > 0 {
                ep["nodeName"] = format!("node-{}", n % nodes).into();
            }
            ep
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

/// A hundred single-Service endpoint changes: the brain's compute and diff per change.
/// With nodes, each change also updates the overlays of the nodes it touches, as the brain's
/// publication does.
fn brain_changes(
    index: &mut Index,
    d: &mut SharedRuleset,
    overlays: &mut Overlays,
    metrics: &Metrics,
    (s, e, nodes): (u32, u32, u32),
) {
    let mut prev = Arc::new(d.model().clone());
    let (mut compute, mut diff, mut size) = (Vec::new(), Vec::new(), Vec::new());
    let mut touched = Vec::new();
    for k in 0..100u32 {
        let i = (k * 97) % s;
        let sl = slice(i, e, 1000 + k, nodes);
        let t = Instant::now();
        index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, metrics));
        let key = [ObjectKey::new("bench", format!("s{i}"))];
        d.update(index, key.iter());
        if nodes > 0 {
            overlays.update(index, d, key.iter(), std::iter::empty());
            d.prune();
            touched.push(overlays.changed_models().len());
        }
        let next = Arc::new(d.model().clone());
        compute.push(t.elapsed());
        let t = Instant::now();
        let delta = prev.diff(&next);
        diff.push(t.elapsed());
        size.push(prost::Message::encoded_len(&delta));
        prev = next;
    }
    compute.sort();
    diff.sort();
    size.sort();
    println!(
        "brain: one Service change: compute p50 {:?} max {:?}; diff p50 {:?} max {:?}; delta p50 {} bytes; overlays changed per change {:?}",
        compute[50],
        compute[99],
        diff[50],
        diff[99],
        size[50],
        touched.iter().max()
    );
}

/// Counts live heap bytes, which RSS blurs with the allocator's retained pages.
struct Counting;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        LIVE.fetch_sub(l.size(), std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live_mib() -> f64 {
    LIVE.load(std::sync::atomic::Ordering::Relaxed) as f64 / (1 << 20) as f64
}

fn rss() -> String {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let get = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .unwrap_or_default()
            .split_whitespace()
            .nth(1)
            .unwrap_or("?")
            .to_string()
    };
    format!(
        "heap {:.1} MiB, RSS {} kB, peak {} kB",
        live_mib(),
        get("VmRSS"),
        get("VmHWM")
    )
}

fn main() -> anyhow::Result<()> {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (s, e, nodes) = (
        args.first().copied().unwrap_or(10_000),
        args.get(1).copied().unwrap_or(10),
        args.get(2).copied().unwrap_or(0),
    );
    println!("start: {}", rss());
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
        let ip = format!("192.168.{}.{}", n / 256, n % 256).parse()?;
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
    println!(
        "brain: index of {s} Services x {e}, {nodes} Nodes: {}",
        rss()
    );
    let mut d = SharedRuleset::new(RulesConfig::default());
    let t = Instant::now();
    d.rebuild(&index);
    println!(
        "brain: full rebuild of {s} Services x {e}: {:?}, {} elements, {}",
        t.elapsed(),
        d.model().element_count(),
        rss()
    );
    // Kept alive to the end, as the brain keeps them.
    let mut overlays = Overlays::new(RulesConfig::default());
    let mut published = Vec::new();
    if nodes > 0 {
        let t = Instant::now();
        overlays.rebuild(&index, &mut d);
        published = overlays.changed_models();
        let elements: usize = published
            .iter()
            .filter_map(|(_, m)| m.as_ref())
            .map(|m| m.element_count())
            .sum();
        println!(
            "brain: overlays of {nodes} nodes: {:?}, {elements} elements, {}",
            t.elapsed(),
            rss()
        );
    }
    brain_changes(&mut index, &mut d, &mut overlays, &metrics, (s, e, nodes));
    // The kernel's cold start is this state, so that each step below is one change on it.
    let v0 = Arc::new(d.model().clone());
    let t = Instant::now();
    let encoded = prost::Message::encoded_len(&v0.to_ruleset());
    println!(
        "brain: snapshot {encoded} bytes, built and sized in {:?}",
        t.elapsed()
    );
    let snapshot = Update {
        brain_epoch: 1,
        generation: 1,
        digest: v0.digest(),
        body: Some(Body::Snapshot(v0.to_ruleset())),
        ..Default::default()
    };
    let mut steps: Vec<(String, Update)> = Vec::new();
    let mut prev = v0.clone();
    let mut generation = 1;
    let mut step = |name: &str,
                    index: &mut Index,
                    d: &mut SharedRuleset,
                    svc: &str,
                    f: &mut dyn FnMut(&mut Index)| {
        f(index);
        d.update(index, [ObjectKey::new("bench", svc)].iter());
        let next: Arc<Model> = Arc::new(d.model().clone());
        generation += 1;
        let u = Update {
            brain_epoch: 1,
            generation,
            base_generation: generation - 1,
            digest: next.digest(),
            body: Some(Body::Delta(prev.diff(&next))),
            ..Default::default()
        };
        prev = next;
        steps.push((name.to_string(), u));
    };
    step(
        "one endpoint change",
        &mut index,
        &mut d,
        "s17",
        &mut |ix| {
            let sl = slice(17, e, 1, nodes);
            ix.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
        },
    );
    step(
        "one Service added",
        &mut index,
        &mut d,
        &format!("s{s}"),
        &mut |ix| {
            let svc = service(s);
            ix.apply_service(
                ObjectKey::of(&svc),
                objects::service(&svc, &Default::default(), &metrics),
            );
            let sl = slice(s, e, 0, nodes);
            ix.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
        },
    );
    step(
        "one Service deleted",
        &mut index,
        &mut d,
        "s42",
        &mut |ix| {
            ix.apply_service(ObjectKey::new("bench", "s42"), None);
            ix.apply_slice(ObjectKey::new("bench", "s42-1"), None);
        },
    );
    if nodes > 0 {
        let before = live_mib();
        drop(overlays);
        let models = live_mib();
        drop(published);
        println!(
            "brain: overlays' bookkeeping {:.1} MiB, their models {:.1} MiB",
            before - models,
            models - live_mib()
        );
    } else {
        drop((overlays, published));
    }
    drop(d);
    drop(index);
    println!("before applying: {}", rss());

    // Everything below happens in a private network namespace of this thread.
    std::thread::spawn(move || -> anyhow::Result<()> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
        let mut applier = Applier::new(NftSocket::open()?, "splitproxy".into());
        let t = Instant::now();
        let kernel = applier
            .apply(&snapshot)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .took;
        println!(
            "cold start, {s} Services x {e}: kernel {kernel:?}, total {:?}, {}",
            t.elapsed(),
            rss()
        );
        drop(snapshot);
        for (name, u) in &steps {
            let t = Instant::now();
            let kernel = applier.apply(u).map_err(|e| anyhow::anyhow!("{e}"))?.took;
            println!("{name}: kernel {kernel:?}, total {:?}", t.elapsed());
        }
        println!("after: {}", rss());
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("panicked"))??;
    Ok(())
}
