//! Kernel apply times at scale, in a private network namespace: a brain-computed ruleset of S
//! Services x E endpoints applied by the actuator's applier as a snapshot (cold start), then one
//! endpoint change, one Service added and one deleted, each as a delta. As root:
//! `cargo run --release -p splitproxy-tests --example apply_scale -- [S] [E]`.
use std::sync::Arc;
use std::time::Instant;

use splitproxy_actuator::apply::Applier;
use splitproxy_actuator::nft::NftSocket;
use splitproxy_brain::desired::Desired;
use splitproxy_brain::index::Index;
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, ObjectKey};
use splitproxy_brain::rules::{NodeView, RulesConfig};
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
    format!("RSS {} kB, peak {} kB", get("VmRSS"), get("VmHWM"))
}

fn main() -> anyhow::Result<()> {
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
    for i in 0..s {
        let svc = service(i);
        index.apply_service(ObjectKey::of(&svc), objects::service(&svc, &[], &metrics));
        let sl = slice(i, e, 0);
        index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
    }
    let mut d = Desired::new(RulesConfig::default(), NodeView::default());
    d.rebuild(&index);
    let v0 = Arc::new(d.model().clone());
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
                    d: &mut Desired,
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
            let sl = slice(17, e, 1);
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
            ix.apply_service(ObjectKey::of(&svc), objects::service(&svc, &[], &metrics));
            let sl = slice(s, e, 0);
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
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        println!(
            "cold start, {s} Services x {e}: kernel {kernel:?}, total {:?}, {}",
            t.elapsed(),
            rss()
        );
        drop(snapshot);
        for (name, u) in &steps {
            let t = Instant::now();
            let kernel = applier.apply(u).map_err(|e| anyhow::anyhow!("{e}"))?;
            println!("{name}: kernel {kernel:?}, total {:?}", t.elapsed());
        }
        println!("after: {}", rss());
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("panicked"))??;
    Ok(())
}
