//! The report's sections for the runs that have them: single changes as a distribution, the
//! fan-out floors beside splitproxy, a replica killed (failover) and every replica restarted.
use std::fmt::Write as _;

use crate::results::BenchResult;

use super::format::{by_kind, dist_cell, fmt_ratio, hist_cell, mib, ms, num};
use super::{cpu_per_update, floors, phase, ratio};

pub(super) fn single_section(w: &mut String, r: &BenchResult) {
    let Some(s) = &r.single_changes else {
        return;
    };
    let _ = writeln!(
        w,
        "## Single changes\n\n{} single-endpoint changes (the endpoint_flip phase), each alone: the next one \
         only once every node held it and kube-proxy had synced it, at least {:.0} ms later and a second after \
         kube-proxy's last sync (its minimum sync period).\n",
        s.changes,
        s.gap_seconds * 1e3
    );
    let _ = writeln!(w, "| figure | splitproxy | kube-proxy |\n|---|---|---|");
    let _ = writeln!(
        w,
        "| network programming latency, every node and change | {} | {} |",
        dist_cell(&s.npl),
        phase(r, "endpoint_flip")
            .and_then(|p| p.kube_proxy.as_ref())
            .map_or("not run".into(), |k| hist_cell(k.npl.as_ref()))
    );
    let _ = writeln!(w, "| virtual nodes | {} | |", dist_cell(&s.npl_virtual));
    let _ = writeln!(w, "| real actuators | {} | |", dist_cell(&s.npl_real));
    let _ = writeln!(
        w,
        "| time to the real nodes, per change (mean over the nodes) | {} | {} |",
        dist_cell(&s.real_per_change),
        dist_cell(&s.kube_proxy_exact)
    );
    let _ = writeln!(
        w,
        "| kernel apply (sync) per node and change | {} | {} |",
        dist_cell(&s.real_apply),
        dist_cell(&s.kube_proxy_sync)
    );
    if s.real_apply_on_cpu.n > 0 {
        let _ = writeln!(
            w,
            "| of it, the applying thread on a CPU | {} | |",
            dist_cell(&s.real_apply_on_cpu)
        );
    }
    let _ = writeln!(
        w,
        "| every splitproxy node converged, per change | {} | |",
        dist_cell(&s.converged)
    );
    if s.real_apply_inexact > 0 || s.kube_proxy_missed > 0 {
        let _ = writeln!(
            w,
            "| left out | {} node-changes with other than one sync | {} changes not counted in time |",
            s.real_apply_inexact, s.kube_proxy_missed
        );
    }
    let per_change = |v: &[Option<f64>]| {
        v.iter()
            .map(|x| x.map_or("-".into(), |x| format!("{:.1}", x * 1e3)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        w,
        "\nPer change, ms to the real nodes: splitproxy {}; kube-proxy {}.\n",
        per_change(&s.real_per_change_seconds),
        per_change(&s.kube_proxy_per_change_seconds)
    );
}

pub(super) fn failover_section(w: &mut String, r: &BenchResult) {
    let Some(f) = &r.failover else {
        return;
    };
    let _ = writeln!(
        w,
        "## Failover\n\n{} brain replicas; brain-{} killed with SIGKILL {:.1} s into {} s of churn. \
         It served {} nodes ({} real: {}).\n",
        f.replicas,
        f.victim,
        f.killed_at_seconds,
        f.churn_seconds,
        f.moved_nodes,
        f.moved_real.len(),
        if f.moved_real.is_empty() {
            "none".to_string()
        } else {
            f.moved_real.join(", ")
        }
    );
    let _ = writeln!(w, "| figure | value |\n|---|---|");
    let _ = writeln!(
        w,
        "| every moved node connected and in sync on another replica, from the kill | {} |",
        ms(f.back_in_sync_seconds)
    );
    let _ = writeln!(w, "| per moved node | {} |", dist_cell(&f.back_in_sync));
    let _ = writeln!(
        w,
        "| every moved node resumed on another replica (connected, an update of it acked), from \
         the kill | {} |",
        ms(f.resumed_seconds)
    );
    let _ = writeln!(w, "| per moved node | {} |", dist_cell(&f.resumed));
    let _ = writeln!(
        w,
        "| the last churn write, from the kill | {} |",
        ms(f.last_write_after_kill_seconds)
    );
    if f.not_back > 0 {
        let _ = writeln!(w, "| moved nodes never back | {} |", f.not_back);
    }
    let _ = writeln!(
        w,
        "| network programming latency of the moved virtual nodes | {} |",
        dist_cell(&f.npl_moved)
    );
    for (n, h) in &f.npl_moved_real {
        let _ = writeln!(w, "| {n} (moved) NPL histogram | {} |", hist_cell(Some(h)));
    }
    let _ = writeln!(
        w,
        "| bytes the moved virtual nodes received after the kill | {} in all, {} per node |",
        f.moved_bytes,
        num(f.moved_bytes_per_node.map(f64::round))
    );
    let _ = writeln!(
        w,
        "| a full snapshot, per node | {} bytes ({}) |",
        num(f.full_snapshot_bytes_per_node.map(f64::round)),
        fmt_ratio(ratio(
            f.moved_bytes_per_node,
            f.full_snapshot_bytes_per_node
        )) + " of it received"
    );
    let _ = writeln!(
        w,
        "| snapshots / deltas received (virtual) | {} / {} |",
        f.snapshots_received, f.deltas_received
    );
    let _ = writeln!(
        w,
        "| snapshots / deltas applied (real, moved) | {} / {} |",
        f.real_snapshots_applied, f.real_deltas_applied
    );
    let _ = writeln!(
        w,
        "| survivors' resumptions (splitproxy_brain_resumptions_total) | {} |",
        f.resumptions
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        w,
        "| survivors' TLS handshakes (splitproxy_brain_tls_handshakes_total) | {} |",
        by_kind(&f.tls_handshakes)
    );
    let _ = writeln!(
        w,
        "| survivors' snapshots sent | {} |",
        num(f.snapshots_sent)
    );
    match &f.connections {
        Some(c) => {
            let _ = writeln!(
                w,
                "| connections from {} to a ClusterIP served on {}: failed / made | {} / {} |",
                c.client_node, c.server_node, c.failed, c.attempted
            );
            for x in &c.failures {
                let _ = writeln!(w, "| failed connection | {x} |");
            }
        }
        None => {
            let _ = writeln!(w, "| connection loop | not run |");
        }
    }
    for n in &f.notes {
        let _ = writeln!(w, "\nNote: {n}");
    }
    let _ = writeln!(w);
}

/// The fan-out floors beside what splitproxy did in the same run: CPU per update on each side
/// and a single change's fan-out to every node, one row per floor, from the barest up.
pub(super) fn floor_section(w: &mut String, r: &BenchResult) {
    let all = floors(r);
    let Some(f) = all.first() else {
        return;
    };
    let _ = writeln!(
        w,
        "## Fan-out floor\n\nWhat a stream per node and an ack per update cost at least on this machine, \
         measured in this run (src/floor.rs): {} loopback connections, {} rounds of a {}-byte update to each and a \
         {}-byte ack back, no protobuf and no work beyond moving the bytes. The rows add one layer each: bare TCP \
         in one epoll loop a side; TLS (rustls with the brain's crypto provider, TLS 1.3, handshakes before the \
         rounds); the same on tokio, a task per stream (src/floor/tasks.rs); an HTTP/2 stream per connection \
         carrying each update and ack as a DATA frame, as a gRPC call does, by the `h2` crate (the one under hyper \
         and tonic) on one task per connection; and the sending side served by hyper's HTTP/2 server instead, as \
         the brain's streams are (a task for the connection, one for the stream, the response body polled for \
         the acks and the next update). Each ratio is splitproxy's figure over the floor's: what is left above \
         the last row is what splitproxy does itself (tonic's routing, the sessions, the encoding, the \
         bookkeeping, a multi-threaded runtime).",
        f.nodes, f.rounds, f.update_bytes, f.ack_bytes
    );
    let churn = phase(r, "churn");
    let brain = churn.and_then(|p| cpu_per_update(p, "brain"));
    let fleet = churn.and_then(|p| cpu_per_update(p, "bench"));
    let single = r.single_changes.as_ref().and_then(|s| s.npl.p50);
    let us = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{:.1} µs", v * 1e6));
    let _ = writeln!(
        w,
        "\n| | CPU per update, sending side | the brain ÷ it | CPU per update, nodes' side | the fleet ÷ it \
         | one change to every node | single-change NPL p50 ÷ it | worst round |\n|---|---|---|---|---|---|---|---|"
    );
    let _ = writeln!(
        w,
        "| splitproxy (churn; nodes' side: the bench process, virtual fleet and writer; one change: single-change NPL p50) \
         | {} | | {} | | {} | | |",
        us(brain),
        us(fleet),
        ms(single)
    );
    for f in all {
        let ratio = |ours: Option<f64>, floor: f64| fmt_ratio(ours.map(|v| v / floor));
        let _ = writeln!(
            w,
            "| floor, {} | {} | {} | {} | {} | {} | {} | {} |",
            f.label(),
            us(Some(f.brain_cpu_per_update)),
            ratio(brain, f.brain_cpu_per_update),
            us(Some(f.node_cpu_per_update)),
            ratio(fleet, f.node_cpu_per_update),
            ms(Some(f.round_mean_seconds)),
            ratio(single, f.round_mean_seconds),
            ms(Some(f.round_max_seconds)),
        );
    }
    let _ = writeln!(w);
}

pub(super) fn restart_section(w: &mut String, r: &BenchResult) {
    let Some(x) = &r.restart else {
        return;
    };
    let _ = writeln!(
        w,
        "## Restart\n\nEvery brain replica ({}) stopped with SIGTERM ({:.2} s) and started again at its address, \
         on the same cluster state.\n",
        x.replicas, x.stop_seconds
    );
    let _ = writeln!(w, "| figure | value |\n|---|---|");
    let _ = writeln!(
        w,
        "| every replica ready, from the restart | {} |",
        ms(x.ready_seconds)
    );
    let _ = writeln!(
        w,
        "| every node in sync, from the restart | {} |",
        ms(x.all_in_sync_seconds)
    );
    let _ = writeln!(
        w,
        "| sessions by resumption | {} |",
        x.resumptions
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        w,
        "| TLS handshakes (splitproxy_brain_tls_handshakes_total) | {} |",
        by_kind(&x.tls_handshakes)
    );
    let _ = writeln!(
        w,
        "| updates sent: snapshots / deltas / sessions sent nothing (current) | {} / {} / {} |",
        num(x.snapshots_sent),
        num(x.deltas_sent),
        num(x.current)
    );
    let _ = writeln!(
        w,
        "| bytes sent, against a full resync (the cold start's {}) | {} ({}) |",
        num(x.full_resync_bytes),
        num(x.bytes_sent),
        x.bytes_ratio
            .map_or("n/a".into(), |r| format!("{:.3} %", r * 100.0))
    );
    let _ = writeln!(
        w,
        "| virtual nodes: snapshots / deltas / received nothing; bytes | {} / {} / {}; {} |",
        x.virtual_snapshots, x.virtual_deltas, x.virtual_nothing, x.virtual_bytes
    );
    let _ = writeln!(
        w,
        "| real actuators: snapshots / deltas applied | {} / {} |",
        x.real_snapshots_applied, x.real_deltas_applied
    );
    for (role, u) in &x.processes {
        let _ = writeln!(
            w,
            "| {role}: CPU, RSS, peak RSS | {:.2} s, {}, {} |",
            u.cpu_seconds,
            mib(Some(u.rss_bytes as f64)),
            mib(Some(u.peak_rss_bytes as f64))
        );
    }
    for n in &x.notes {
        let _ = writeln!(w, "\nNote: {n}");
    }
    let _ = writeln!(w);
}
