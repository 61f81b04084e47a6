//! Restart: every brain replica stopped (SIGTERM, as an orchestrator stops a pod) and started
//! again at its address on the same cluster state. A restarted brain has a new epoch and no
//! memory of its nodes; each node's Hello names the digest it holds, and the brain, having
//! computed the same rulesets from the same API state, resumes it by content (docs/protocol.md,
//! "Resumption"): a delta or nothing, not a snapshot. The phase reports the time from the
//! restart until every node is in sync, the sessions by how they resumed, the updates by kind
//! and the bytes sent against a full resync's (the cold start's).
use std::time::{Duration, Instant};

use super::{BYTES_SENT, Bench, BrainDelta, UPDATES_SENT};
use crate::results::Restart;
use crate::rig::{Rig, all_in_sync};

const SNAPSHOTS_SENT: &str = "splitproxy_brain_snapshots_sent_total";
const RESUMPTIONS: &str = "splitproxy_brain_resumptions_total";
const HANDSHAKES: &str = "splitproxy_brain_tls_handshakes_total";
const ACT_SNAPSHOTS: &str = "splitproxy_actuator_snapshots_applied_total";
const ACT_DELTAS: &str = "splitproxy_actuator_deltas_applied_total";
const PUBLICATIONS: &str = "splitproxy_brain_publications_total";
/// Longer than the brain's spacing of publications (200 ms by default) with room to spare: no
/// new publication in this long means no change is waiting in the brain.
const QUIET: Duration = Duration::from_secs(1);

/// Publications so far, summed over the replicas; `None` if one could not be scraped.
fn publications(scrapes: &[Option<crate::measure::prom::Scrape>]) -> Option<f64> {
    scrapes
        .iter()
        .map(|s| s.as_ref()?.sum_where(PUBLICATIONS, |_| true))
        .sum()
}

/// The restart phase. `full_resync_bytes`: what the cold start sent every node.
pub async fn restart(b: &mut Bench, full_resync_bytes: Option<f64>) -> anyhow::Result<Restart> {
    let n = b.rig.brains.len();
    println!("[bench] phase restart: {n} brain replica(s) stopped and started again");
    let expected = b.rig.splitproxy_nodes();
    // Start from a fleet in sync with a brain that has published every change it saw
    // (bounded): the restart, not a late change, is measured. "In sync" alone is not enough: a
    // change the brain still holds back (publications are spaced, --min-publish-interval-ms)
    // is published by the restarted brain only, which the nodes then cannot resume into.
    let deadline = Instant::now() + b.args.phase_timeout();
    while Instant::now() < deadline {
        let before = publications(&b.rig.brain_scrapes());
        tokio::time::sleep(QUIET).await;
        let after = publications(&b.rig.brain_scrapes());
        if before.is_some() && before == after && all_in_sync(&b.rig.view().await, expected) {
            break;
        }
    }
    let mut out = Restart {
        replicas: n,
        full_resync_bytes,
        ..Default::default()
    };
    let fleet_before = b.rig.fleet.as_ref().map(|f| f.node_stats());
    let real_before: Vec<_> = (0..b.rig.real)
        .map(|i| b.rig.actuator_scrape(i).ok())
        .collect();

    let stopping = Instant::now();
    for i in 0..n {
        b.watched.remove(&Rig::brain_role(i, n));
    }
    out.killed_after_grace = b.rig.stop_brains()?;
    out.stop_seconds = stopping.elapsed().as_secs_f64();
    if out.killed_after_grace > 0 {
        out.notes.push(format!(
            "{} of {n} replicas did not exit on SIGTERM within the {:?} grace period and were \
             killed (SIGKILL): their nodes' streams ended only then",
            out.killed_after_grace,
            splitproxy_tests::process::DEFAULT_GRACE
        ));
    }
    let t0 = Instant::now();
    for i in 0..n {
        b.rig.restart_brain(i, 2)?;
        let pid = b.rig.brains[i].as_ref().and_then(|x| x.child.id());
        b.watched.add(&Rig::brain_role(i, n), pid);
    }
    let mark = b.watched.mark();
    let deadline = t0 + b.args.phase_timeout();
    while Instant::now() < deadline {
        if out.ready_seconds.is_none() && b.rig.brain_ready() {
            out.ready_seconds = Some(t0.elapsed().as_secs_f64());
        }
        let view = b.rig.view().await;
        if view.synced() && all_in_sync(&view, expected) {
            out.all_in_sync_seconds = Some(t0.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if out.all_in_sync_seconds.is_none() {
        out.notes.push(format!(
            "not every node was in sync within {:?} of the restart",
            b.args.phase_timeout()
        ));
    }
    // Late acks and the metrics' last increments.
    tokio::time::sleep(Duration::from_millis(500)).await;
    out.processes = b.watched.since(&mark);

    // Every replica from its start: everything it counted is the restart's.
    let scrapes = b.rig.brain_scrapes();
    let all = BrainDelta {
        before: &[],
        after: &scrapes,
    };
    for kind in ["same_epoch", "by_content", "restated", "snapshot"] {
        if let Some(v) = all.counter_where(RESUMPTIONS, |l| {
            l.iter().any(|(k, v)| k == "kind" && v == kind)
        }) {
            out.resumptions.insert(kind.to_string(), v);
        }
    }
    for kind in ["full", "resumed"] {
        if let Some(v) = all.counter_where(HANDSHAKES, |l| {
            l.iter().any(|(k, v)| k == "kind" && v == kind)
        }) {
            out.tls_handshakes.insert(kind.to_string(), v);
        }
    }
    out.updates_sent = all.counter(UPDATES_SENT);
    out.snapshots_sent = all.counter(SNAPSHOTS_SENT);
    out.bytes_sent = all.counter(BYTES_SENT);
    out.deltas_sent = match (out.updates_sent, out.snapshots_sent) {
        (Some(u), Some(s)) => Some((u - s).max(0.0)),
        _ => None,
    };
    let sessions: f64 = out.resumptions.values().sum();
    out.current = out.updates_sent.map(|u| (sessions - u).max(0.0));
    out.bytes_ratio = match (out.bytes_sent, full_resync_bytes) {
        (Some(b), Some(f)) if f > 0.0 => Some(b / f),
        _ => None,
    };
    if let (Some(before), Some(f)) = (fleet_before, &b.rig.fleet) {
        for (a, z) in before.iter().zip(f.node_stats()) {
            let (s, d) = (z.snapshots - a.snapshots, z.deltas - a.deltas);
            out.virtual_snapshots += s;
            out.virtual_deltas += d;
            out.virtual_bytes += z.bytes - a.bytes;
            if s + d == 0 {
                out.virtual_nothing += 1;
            }
        }
    }
    for (i, before) in real_before.iter().enumerate() {
        let Ok(after) = b.rig.actuator_scrape(i) else {
            continue;
        };
        let d = |m: &str| {
            after.sum(m).unwrap_or(0.0) - before.as_ref().and_then(|s| s.sum(m)).unwrap_or(0.0)
        };
        out.real_snapshots_applied += d(ACT_SNAPSHOTS);
        out.real_deltas_applied += d(ACT_DELTAS);
    }
    println!(
        "[bench]   restart: every node in sync {} after the restart (ready after {}); \
         resumptions {:?}; TLS handshakes {:?}; {} updates ({} snapshots), {} bytes = {} of a \
         full resync; virtual nodes: {} snapshots, {} deltas, {} nothing",
        secs(out.all_in_sync_seconds),
        secs(out.ready_seconds),
        out.resumptions,
        out.tls_handshakes,
        out.updates_sent.unwrap_or(0.0),
        out.snapshots_sent.unwrap_or(0.0),
        out.bytes_sent.unwrap_or(0.0),
        out.bytes_ratio
            .map_or("-".into(), |r| format!("{:.3} %", r * 100.0)),
        out.virtual_snapshots,
        out.virtual_deltas,
        out.virtual_nothing,
    );
    for note in &out.notes {
        println!("[bench]   note: {note}");
    }
    Ok(out)
}

fn secs(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2} s"))
}
