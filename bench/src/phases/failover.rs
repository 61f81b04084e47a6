//! Failover: during churn, one brain replica is killed with SIGKILL (`--brains` 2 or more).
//! Its nodes, virtual and real, move to the other replicas, which resume them by the content
//! they hold (docs/protocol.md, "Resumption"): the phase reports how long until every moved
//! node is in sync again through another replica, their network programming latency, what
//! they received after the kill against a full snapshot's size, snapshots against deltas, and
//! a bounded connection loop through a ClusterIP from a pod on a real node the killed replica
//! served, which should lose nothing (the actuator keeps its rules while it reconnects).
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use splitproxy_tests::podserver::PodServer;
use splitproxy_tests::traffic::ConnectionLoop;
use splitproxy_tests::{Pod, Proto, probe_async};
use tokio::time::MissedTickBehavior;

use super::changes::Churner;
use super::{Bench, BrainDelta, NPL};
use crate::measure::prom::Scrape;
use crate::measure::stats::LatencyHist;
use crate::results::{Connections, Failover, Phase};
use crate::rig::Rig;
use crate::workload::{Endpoint, ServiceState, SliceState, cluster_ip, node_name};

const SNAPSHOTS_SENT: &str = "splitproxy_brain_snapshots_sent_total";
const RESUMPTIONS: &str = "splitproxy_brain_resumptions_total";
const HANDSHAKES: &str = "splitproxy_brain_tls_handshakes_total";
const ACT_SNAPSHOTS: &str = "splitproxy_actuator_snapshots_applied_total";
const ACT_DELTAS: &str = "splitproxy_actuator_deltas_applied_total";
/// The Service port and the pod server's port (the workload's ports).
const PROBE_PORT: u16 = 80;
const PROBE_TARGET_PORT: u16 = 8080;
/// How often the moved nodes are looked for on the surviving replicas.
const POLL: Duration = Duration::from_millis(100);

/// The failover phase; `None` figures when it could not run.
pub async fn failover(b: &mut Bench) -> anyhow::Result<(Phase, Failover)> {
    let n = b.rig.brains.len();
    anyhow::ensure!(n >= 2, "failover needs two brain replicas or more");
    let seconds = b.args.failover_seconds;
    let kill_tick = (seconds / 3).max(1);

    // The connection loop first, so that its Service is in place before the phase measures.
    let probe = match Probe::start(b, seconds).await {
        Ok(p) => Some(p),
        Err(e) => {
            b.notes.push(format!("failover: no connection loop: {e:#}"));
            None
        }
    };

    let mut run = b.begin("failover").await;
    let view = b.rig.view().await;
    let connected = view.connected();
    // The victim is the replica serving the client's node (real node 0), so that the
    // connection loop crosses the failover.
    let client_node = node_name(0);
    let victim = connected
        .iter()
        .position(|s| s.contains(&client_node))
        .unwrap_or(0);
    let moved: BTreeSet<String> = connected.get(victim).cloned().unwrap_or_default();
    let real_names: Vec<String> = (0..b.rig.real).map(node_name).collect();
    let mut out = Failover {
        replicas: n,
        victim,
        churn_seconds: seconds,
        moved_nodes: moved.len(),
        moved_real: real_names
            .iter()
            .filter(|r| moved.contains(*r))
            .cloned()
            .collect(),
        ..Default::default()
    };
    println!(
        "[bench]   failover: replicas serve {:?} nodes; killing brain-{victim} ({} nodes, {} real) \
         {kill_tick} s into {seconds} s of churn",
        connected.iter().map(|c| c.len()).collect::<Vec<_>>(),
        moved.len(),
        out.moved_real.len()
    );
    run.collector.subset = moved.iter().map(|n| n.as_str().into()).collect();

    let mut churner = Churner::new(b);
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let began = Instant::now();
    let mut last = SystemTime::now();
    let mut killed: Option<Instant> = None;
    // The kill on the clock the trigger times are on, for the last write's distance from it.
    let mut killed_wall: Option<SystemTime> = None;
    let mut fleet_at_kill = Vec::new();
    let mut real_at_kill: Vec<Option<Scrape>> = Vec::new();
    let mut back = Seen::default();
    let mut failed_ticks = 0;
    for tick in 0..seconds {
        interval.tick().await;
        if tick == kill_tick {
            fleet_at_kill = b
                .rig
                .fleet
                .as_ref()
                .map(|f| f.node_stats())
                .unwrap_or_default();
            real_at_kill = (0..b.rig.real)
                .map(|i| b.rig.actuator_scrape(i).ok())
                .collect();
            b.rig.kill_brain(victim)?;
            killed = Some(Instant::now());
            killed_wall = Some(SystemTime::now());
            out.killed_at_seconds = began.elapsed().as_secs_f64();
            b.watched.remove(&Rig::brain_role(victim, n));
            println!("[bench]   brain-{victim} killed (SIGKILL)");
        }
        // The tick's bursts, and between them (after the kill) the moved nodes looked for.
        let tick_start = Instant::now();
        let mut failed = false;
        for burst in 0..churner.bursts() {
            match churner.burst(b, tick, burst).await {
                Ok(times) => {
                    run.changes += times.len();
                    if let Some(t) = times.into_iter().max() {
                        last = last.max(t);
                    }
                }
                Err(_) => failed = true,
            }
            b.drain(&mut run);
            let next = churner.burst_at(tick_start, burst + 1);
            if let Some(k) = killed {
                let until = next.min(tick_start + Duration::from_millis(900));
                while Instant::now() < until && !back.all(&moved) {
                    look_for_moved(b, &moved, k, &mut back).await;
                    tokio::time::sleep(POLL).await;
                }
            }
            if burst + 1 < churner.bursts() {
                tokio::time::sleep_until(next.into()).await;
            }
        }
        failed_ticks += usize::from(failed);
    }
    if failed_ticks > 0 {
        run.notes
            .push(format!("{failed_ticks} churn ticks had failed writes"));
    }
    // Every moved node back, bounded.
    if let Some(k) = killed {
        let deadline = Instant::now() + b.args.phase_timeout();
        while !back.all(&moved) && Instant::now() < deadline {
            look_for_moved(b, &moved, k, &mut back).await;
            tokio::time::sleep(POLL).await;
        }
    }
    b.wait_splitproxy(&mut run, last).await;
    out.last_write_after_kill_seconds =
        killed_wall.map(|k| last.duration_since(k).map_or(0.0, |d| d.as_secs_f64()));
    out.not_back = moved.len() - back.in_sync.len();
    if moved.len() == back.resumed.len() {
        out.resumed_seconds = back.resumed.values().copied().reduce(f64::max);
    }
    out.resumed = summary(back.resumed.values());
    if out.not_back == 0 {
        out.back_in_sync_seconds = back.in_sync.values().copied().reduce(f64::max);
    } else {
        out.notes.push(format!(
            "{} of {} moved nodes were not in sync on another replica within {:?}",
            out.not_back,
            moved.len(),
            b.args.phase_timeout()
        ));
    }
    out.back_in_sync = summary(back.in_sync.values());

    // What the moved virtual nodes received after the kill.
    if let Some(f) = &b.rig.fleet {
        let now = f.node_stats();
        let mut snapshot_sizes = Vec::new();
        let mut moved_virtual = 0usize;
        for (before, after) in fleet_at_kill.iter().zip(&now) {
            if !moved.contains(&after.name) {
                continue;
            }
            moved_virtual += 1;
            out.moved_bytes += after.bytes - before.bytes;
            out.snapshots_received += after.snapshots - before.snapshots;
            out.deltas_received += after.deltas - before.deltas;
            if before.last_snapshot_bytes > 0 {
                snapshot_sizes.push(before.last_snapshot_bytes as f64);
            }
        }
        if moved_virtual > 0 {
            out.moved_bytes_per_node = Some(out.moved_bytes as f64 / moved_virtual as f64);
        }
        out.full_snapshot_bytes_per_node = super::mean_of(snapshot_sizes.into_iter());
    }
    out.npl_moved = run.collector.npl_subset.summary();
    // The moved real actuators.
    for (i, name) in real_names.iter().enumerate() {
        if !moved.contains(name) {
            continue;
        }
        let Ok(after) = b.rig.actuator_scrape(i) else {
            continue;
        };
        let at_kill = real_at_kill.get(i).and_then(Option::as_ref);
        let counter =
            |m: &str| after.sum(m).unwrap_or(0.0) - at_kill.and_then(|s| s.sum(m)).unwrap_or(0.0);
        out.real_snapshots_applied += counter(ACT_SNAPSHOTS);
        out.real_deltas_applied += counter(ACT_DELTAS);
        let before = run.real_scrape(i);
        if let Some(h) = after.histogram(NPL) {
            let d = h.since(before.and_then(|b| b.histogram(NPL)).as_ref());
            out.npl_moved_real.insert(name.clone(), d.summary());
        }
    }
    // The survivors: how they resumed the moved nodes.
    let after = b.rig.brain_scrapes();
    let delta = BrainDelta {
        before: run.brain_scrapes(),
        after: &after,
    };
    for kind in ["same_epoch", "by_content", "restated", "snapshot"] {
        if let Some(v) = delta.counter_where(RESUMPTIONS, |l| {
            l.iter().any(|(k, v)| k == "kind" && v == kind)
        }) {
            out.resumptions.insert(kind.to_string(), v);
        }
    }
    for kind in ["full", "resumed"] {
        if let Some(v) = delta.counter_where(HANDSHAKES, |l| {
            l.iter().any(|(k, v)| k == "kind" && v == kind)
        }) {
            out.tls_handshakes.insert(kind.to_string(), v);
        }
    }
    out.snapshots_sent = delta.counter(SNAPSHOTS_SENT);

    if let Some(p) = probe {
        out.connections = Some(p.stop(b).await);
    }
    run.notes.extend(out.notes.iter().cloned());
    let desc = format!(
        "{}% of the Services changed every second for {seconds} s; brain-{victim} of {n} \
         killed with SIGKILL after {:.0} s",
        b.args.churn_percent, out.killed_at_seconds
    );
    let changes = run.changes;
    let phase = b.finish(run, &desc, last, changes, None).await;

    // The victim comes back at its address, for the phases that follow; nodes stay where they
    // moved (real actuators drift back to their preferred replica later).
    b.rig.restart_brain(victim, 1)?;
    let pid = b.rig.brains[victim].as_ref().and_then(|x| x.child.id());
    b.watched.add(&Rig::brain_role(victim, n), pid);
    let deadline = Instant::now() + b.args.phase_timeout();
    while !b.rig.brain_ready() && Instant::now() < deadline {
        tokio::time::sleep(POLL).await;
    }
    println!(
        "[bench]   failover: {} moved nodes resumed after {} (p50 {}), back in sync after {} \
         (p50 {}; the last write {} after the kill); {} bytes per moved node against a {} byte \
         snapshot; {} snapshots, {} deltas; resumptions {:?}; TLS handshakes {:?}; connections \
         {}",
        out.moved_nodes,
        secs(out.resumed_seconds),
        secs(out.resumed.p50),
        secs(out.back_in_sync_seconds),
        secs(out.back_in_sync.p50),
        secs(out.last_write_after_kill_seconds),
        out.moved_bytes_per_node
            .map_or("-".into(), |v| format!("{v:.0}")),
        out.full_snapshot_bytes_per_node
            .map_or("-".into(), |v| format!("{v:.0}")),
        out.snapshots_received,
        out.deltas_received,
        out.resumptions,
        out.tls_handshakes,
        out.connections
            .as_ref()
            .map_or("not run".into(), |c| format!(
                "{} of {} failed",
                c.failed, c.attempted
            )),
    );
    Ok((phase, out))
}

fn secs(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2} s"))
}

/// The distribution of times, seconds.
fn summary<'a>(times: impl Iterator<Item = &'a f64>) -> crate::measure::stats::Stats {
    let mut hist = LatencyHist::default();
    for v in times {
        hist.record(*v);
    }
    hist.summary()
}

/// When each moved node was first seen on a surviving replica, from the kill: resumed there
/// (connected, holding a state it confirmed) and in sync (holding its newest publication).
#[derive(Default)]
struct Seen {
    resumed: HashMap<String, f64>,
    in_sync: HashMap<String, f64>,
}

impl Seen {
    fn all(&self, moved: &BTreeSet<String>) -> bool {
        self.resumed.len() >= moved.len() && self.in_sync.len() >= moved.len()
    }
}

/// Records, for every moved node newly seen resumed or in sync on a surviving replica, the
/// time since the kill.
async fn look_for_moved(b: &Bench, moved: &BTreeSet<String>, killed: Instant, seen: &mut Seen) {
    let view = b.rig.view().await;
    let at = killed.elapsed().as_secs_f64();
    for (nodes, into) in [
        (view.resumed_nodes(), &mut seen.resumed),
        (view.in_sync_nodes(), &mut seen.in_sync),
    ] {
        for node in nodes {
            if moved.contains(node) && !into.contains_key(node) {
                into.insert(node.to_string(), at);
            }
        }
    }
}

/// A ClusterIP served by a pod on the last real node, and a bounded connection loop to it from
/// a pod on real node 0. Traffic stays inside the bench's namespaces.
struct Probe {
    looper: ConnectionLoop,
    _server: PodServer,
    pods: Vec<Pod>,
    client_node: String,
    server_node: String,
}

impl Probe {
    async fn start(b: &mut Bench, seconds: u64) -> anyhow::Result<Probe> {
        anyhow::ensure!(b.rig.real >= 1, "no real actuator node");
        let server_idx = b.rig.real - 1;
        let server = b.rig.cluster.add_pod(server_idx, "probe-web")?;
        let pods = vec![server.clone()];
        let srv = PodServer::start(server.netns(), "probe-web", &[PROBE_TARGET_PORT], &[])?;
        let client = b.rig.cluster.add_pod(0, "probe-client")?;
        let pods = [pods, vec![client.clone()]].concat();
        let ip = server.ip4().context("the probe pod has no IPv4 address")?;
        // A ClusterIP above the workload's and the add/delete phase's.
        let svc = ServiceState {
            name: "probe-web".into(),
            ip: cluster_ip(b.workload.services.len() + 1000),
            slices: vec![SliceState {
                name: "probe-web-0".into(),
                endpoints: vec![Endpoint {
                    ip,
                    node: node_name(server_idx),
                    ready: true,
                }],
            }],
        };
        b.writer.create_service(&svc).await?;
        let dst = SocketAddr::from((svc.ip, PROBE_PORT));
        // Bounded: the Service must answer before the loop counts failures.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let r = probe_async(
                client.netns(),
                Proto::Tcp,
                dst,
                None,
                Duration::from_millis(500),
            )
            .await;
            if r.is_answered() {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{dst} did not answer the client on {} within 60 s: {}",
                node_name(0),
                r.kind()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let looper = ConnectionLoop::start(
            vec![client],
            dst,
            1_000_000,
            Duration::from_secs(seconds + 600),
            Duration::from_secs(2),
        );
        Ok(Probe {
            looper,
            _server: srv,
            pods,
            client_node: node_name(0),
            server_node: node_name(server_idx),
        })
    }

    async fn stop(self, b: &Bench) -> Connections {
        let (failures, attempted) = self.looper.stop().await;
        for p in &self.pods {
            b.rig.cluster.remove_pod(p.name());
        }
        Connections {
            attempted,
            failed: failures.len(),
            client_node: self.client_node,
            server_node: self.server_node,
            failures: failures
                .iter()
                .take(10)
                .map(|f| {
                    format!(
                        "{}, {:.1} s before the loop ended",
                        f.result.kind(),
                        f.started.elapsed().as_secs_f64()
                    )
                })
                .collect(),
        }
    }
}
