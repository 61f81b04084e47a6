//! Cold start: the brain starts against the complete workload, real actuators and the virtual
//! fleet connect at once (as after a control-plane restart), and the phase ends when every node
//! holds the brain's state. Then kube-proxy starts on the same workload and its first full sync
//! is timed.
use std::time::{Duration, Instant};

use super::{
    BYTES_SENT, Bench, BrainDelta, COMPRESS_SECONDS, COMPRESSED_PARTS, COMPUTE, FANOUT, SYNC,
    UPDATES_SENT,
};
use crate::fleet::{Fleet, FleetNode, NplCollector};
use crate::kubeproxy::{KpScrape, KubeProxy};
use crate::results::{ColdStart, KubeProxyColdStart};
use crate::rig::all_in_sync;
use crate::watchstorm::apiserver_watches;

/// Starts splitproxy (`--brains` replicas, real actuators, virtual fleet) and measures until
/// every node is in sync, bounded by five phase time-outs.
pub async fn splitproxy(b: &mut Bench, fleet_nodes: Vec<FleetNode>) -> anyhow::Result<ColdStart> {
    println!(
        "[bench] phase cold_start: {} brain replica(s), {} real actuators, {} virtual nodes",
        b.args.brains,
        b.rig.real,
        fleet_nodes.len()
    );
    let watches_before = apiserver_watches(&b.writer).await.0;
    let mark = b.watched.mark();
    let t0 = Instant::now();
    let since = std::time::SystemTime::now();
    b.rig.start_brains(b.args.brains)?;
    let n = b.args.brains;
    for i in 0..n {
        let pid = b.rig.brains[i].as_ref().and_then(|x| x.child.id());
        b.watched.add(&crate::rig::Rig::brain_role(i, n), pid);
    }
    b.rig.start_actuators()?;
    for a in &b.rig.actuators {
        b.watched.add(&format!("actuator {}", a.node), a.child.id());
    }
    if !fleet_nodes.is_empty() {
        let addrs = b.rig.brain_addrs.clone();
        b.rig.fleet = Some(Fleet::start(&addrs, b.rig.pki.ca_pem(), fleet_nodes)?);
    }

    let mut out = ColdStart::default();
    let mut collector = NplCollector::new(since);
    let expected = b.rig.splitproxy_nodes();
    let deadline = t0 + b.args.phase_timeout() * 5;
    let mut last_note = Instant::now();
    while Instant::now() < deadline {
        for brain in b.rig.brains.iter_mut().flatten() {
            if let Some(status) = brain.child.try_wait()? {
                anyhow::bail!(
                    "{} exited with {status}:\n{}",
                    brain.child.name(),
                    brain.child.log_tail(40)
                );
            }
        }
        let elapsed = t0.elapsed().as_secs_f64();
        if out.brain_ready_seconds.is_none() && b.rig.brain_ready() {
            out.brain_ready_seconds = Some(elapsed);
            println!("[bench]   brain ready after {elapsed:.2} s");
        }
        for i in 0..b.rig.real {
            let name = b.rig.cluster.node(i).name().to_string();
            if out
                .actuators_ready_seconds
                .get(&name)
                .copied()
                .flatten()
                .is_none()
            {
                let ready = b.rig.actuator_ready(i).then_some(elapsed);
                out.actuators_ready_seconds.insert(name, ready);
            }
        }
        if let Some(f) = &b.rig.fleet {
            f.drain(&mut collector);
            if out.fleet_in_sync_seconds.is_none() && f.all_applied() {
                out.fleet_in_sync_seconds = Some(elapsed);
                println!("[bench]   every virtual node applied its state after {elapsed:.2} s");
            }
        }
        let actuators_ready = out.actuators_ready_seconds.values().all(Option::is_some);
        let fleet_ok = b.rig.fleet.is_none() || out.fleet_in_sync_seconds.is_some();
        if out.brain_ready_seconds.is_some()
            && actuators_ready
            && fleet_ok
            && all_in_sync(&b.rig.view().await, expected)
        {
            out.all_in_sync_seconds = Some(t0.elapsed().as_secs_f64());
            break;
        }
        if last_note.elapsed() > Duration::from_secs(10) {
            let fleet = b.rig.fleet.as_ref().map(|f| f.status());
            println!(
                "[bench]   cold start: {:.0} s; brain ready {}; fleet connected {}/{}",
                elapsed,
                out.brain_ready_seconds.is_some(),
                fleet.as_ref().map_or(0, |s| s.connected),
                b.rig.fleet.as_ref().map_or(0, |f| f.size),
            );
            last_note = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match out.all_in_sync_seconds {
        Some(s) => println!("[bench]   all {expected} nodes in sync after {s:.2} s"),
        None => b.notes.push(format!(
            "cold start: not every node was in sync within {:?}",
            b.args.phase_timeout() * 5
        )),
    }
    // Every replica from its start: the sums are the whole cold start.
    let scrapes = b.rig.brain_scrapes();
    let all = BrainDelta {
        before: &[],
        after: &scrapes,
    };
    out.brain_compute = all.histogram(COMPUTE).map(|h| h.summary());
    out.brain_fanout = all.histogram(FANOUT).map(|h| h.summary());
    out.brain_bytes_sent = all.counter(BYTES_SENT);
    out.brain_updates_sent = all.counter(UPDATES_SENT);
    out.brain_compressed_parts = all.counter(COMPRESSED_PARTS);
    out.brain_compress_seconds = all.counter(COMPRESS_SECONDS);
    out.brain_replicas = n;
    out.connected_per_replica = b
        .rig
        .view()
        .await
        .connected()
        .iter()
        .map(|c| c.len())
        .collect();
    for i in 0..b.rig.real {
        let name = b.rig.cluster.node(i).name().to_string();
        if let Some(h) = b
            .rig
            .actuator_scrape(i)
            .ok()
            .and_then(|s| s.histogram(SYNC))
        {
            println!(
                "[bench]   {name}: first apply {:.1} ms ({} updates)",
                h.sum * 1e3,
                h.count
            );
            out.real_first_apply.insert(name, h.summary());
        }
    }
    out.virtual_apply = collector.apply_seconds.summary();
    let watches_after = apiserver_watches(&b.writer).await.0;
    out.brain_watches = watches_after.zip(watches_before).map(|(a, b)| a - b);
    out.processes = b.watched.since(&mark);
    Ok(out)
}

/// Starts kube-proxy and waits (bounded by `--kube-proxy-timeout-seconds`) for its first sync.
pub async fn kube_proxy(b: &mut Bench) -> anyhow::Result<KubeProxyColdStart> {
    println!(
        "[bench] phase kube_proxy_cold_start (waits up to {} s for its first sync)",
        b.args.kube_proxy_timeout_seconds
    );
    let watches_before = apiserver_watches(&b.writer).await.0;
    let mark = b.watched.mark();
    let node = b.rig.kube_proxy_node();
    let mut kp = KubeProxy::start(&b.rig.cp, node.netns(), node.name(), &b.rig.dir)?;
    b.watched.add("kube-proxy", kp.pid());
    let took = kp
        .wait_first_sync(node.netns(), b.args.kube_proxy_timeout())
        .await;
    let scrape = kp.scrape(node.netns()).ok().map(|s| KpScrape::from(&s));
    b.rig.kube_proxy = Some(kp);
    let took = took?;
    match took {
        Some(t) => println!(
            "[bench]   kube-proxy's first sync done after {:.2} s",
            t.as_secs_f64()
        ),
        None => b.notes.push(format!(
            "kube-proxy did not finish its first sync within {} s",
            b.args.kube_proxy_timeout_seconds
        )),
    }
    let watches_after = apiserver_watches(&b.writer).await.0;
    Ok(KubeProxyColdStart {
        first_sync_seconds: took.map(|d| d.as_secs_f64()),
        timeout_seconds: b.args.kube_proxy_timeout_seconds as f64,
        sync: scrape
            .as_ref()
            .and_then(|s| s.sync.as_ref())
            .map(|h| h.summary()),
        full_sync: scrape
            .as_ref()
            .and_then(|s| s.full_sync.as_ref())
            .map(|h| h.summary()),
        watches: watches_after.zip(watches_before).map(|(a, b)| a - b),
        processes: b.watched.since(&mark),
    })
}
