//! The API watch comparison: the same churn with splitproxy's watches only, then with one
//! watcher set per node added (as N kube-proxies would hold), measuring the API server's watch
//! count, CPU and memory in each.
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Bench;
use super::changes::churn_for;
use crate::measure::procstat::Watched;
use crate::results::{StormRun, Watches};
use crate::watchstorm::{Storm, Target, apiserver_watches};

pub async fn compare(b: &mut Bench) -> anyhow::Result<Watches> {
    let secs = b.args.storm_seconds;
    println!("[bench] phase watches: {secs} s of churn with splitproxy's watches only");
    let baseline = churn_run(b, secs).await;
    let nodes: Vec<String> = b.workload.nodes.iter().map(|n| n.name.clone()).collect();
    println!(
        "[bench] phase watches: opening {} watches (Services, EndpointSlices, own Node for each of {} nodes)",
        nodes.len() * 3,
        nodes.len()
    );
    let target = Target {
        addr: b.rig.cp.addr(),
        ca_pem: b.rig.cp.pki().ca_pem().to_string(),
        token: b.rig.cp.token().to_string(),
    };
    let storm = Storm::open(b.rig.cp.client(), &target, &nodes).await?;
    let st = storm.stats.clone();
    println!(
        "[bench]   {} established, {} failed; {secs} s of churn with them",
        st.established.load(Ordering::Relaxed),
        st.failed.load(Ordering::Relaxed)
    );
    let bytes_before = st.bytes.load(Ordering::Relaxed);
    let ended_before = st.ended.load(Ordering::Relaxed);
    let started = Instant::now();
    let storm_run = churn_run(b, secs).await;
    let bytes = st.bytes.load(Ordering::Relaxed) - bytes_before;
    let out = Watches {
        seconds: secs,
        storm_requested: st.requested.load(Ordering::Relaxed),
        storm_established: st.established.load(Ordering::Relaxed),
        storm_failed: st.failed.load(Ordering::Relaxed),
        storm_bytes_received: bytes,
        storm_events_bytes_per_second: bytes as f64 / started.elapsed().as_secs_f64().max(1e-9),
        storm_ended_early: st.ended.load(Ordering::Relaxed) - ended_before,
        baseline,
        storm: storm_run,
    };
    drop(storm);
    println!(
        "[bench]   API server watches {:?} -> {:?}; CPU {:.2} -> {:.2} cores; RSS {} -> {} MiB",
        out.baseline.watches,
        out.storm.watches,
        out.baseline.apiserver_cpu_cores,
        out.storm.apiserver_cpu_cores,
        out.baseline.apiserver_peak_rss_bytes >> 20,
        out.storm.apiserver_peak_rss_bytes >> 20
    );
    Ok(out)
}

/// `secs` seconds of churn, measuring the API server.
async fn churn_run(b: &mut Bench, secs: u64) -> StormRun {
    let mut api = Watched::default();
    api.add("kube-apiserver", b.rig.cp.apiserver_pid());
    let (w0, r0) = apiserver_watches(&b.writer).await;
    let mark = api.mark();
    let started = Instant::now();
    let (_, changes, _) = churn_for(b, secs, None).await;
    let elapsed = started.elapsed().as_secs_f64();
    let (w1, r1) = apiserver_watches(&b.writer).await;
    let usage = api
        .since(&mark)
        .remove("kube-apiserver")
        .unwrap_or_default();
    let max = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    StormRun {
        watches: max(w0, w1),
        registered_watchers: max(r0, r1),
        apiserver_cpu_seconds: usage.cpu_seconds,
        apiserver_cpu_cores: usage.cpu_seconds / elapsed.max(1e-9),
        apiserver_rss_bytes: usage.rss_bytes,
        apiserver_peak_rss_bytes: usage.peak_rss_bytes,
        changes,
    }
}
