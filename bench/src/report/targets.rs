//! The targets table judged against a run: what each figure measured, against kube-proxy
//! in the same run where it has one, and whether it is met or ruled out by the same run's floor.
use crate::measure::stats::Stats;
use crate::results::{BenchResult, Target};

use super::format::{dist, fmt_ratio, gb, kube_proxy_cold_text, mib, ms, num};
use super::{
    CHURN_P99, CPU_PER_UPDATE, MIB, SINGLE_CHANGE_P99, cpu_per_update, floors, kp_sync_mean,
    kube_proxy_npl, peak_rss, phase, ratio, real_apply_mean,
};

/// The targets table of the issue, with what this run measured.
pub fn targets(r: &BenchResult, npl_all: &Stats) -> Vec<Target> {
    let mut out = Vec::new();
    let scale = format!(
        "at {} Services x {} endpoints, {} nodes",
        r.config.services, r.config.endpoints, r.config.nodes
    );

    // Node cold start: the real actuators' first apply.
    let first_apply = r
        .cold_start
        .real_first_apply
        .values()
        .map(|h| h.sum)
        .reduce(f64::max);
    let kp_first = r.kube_proxy_cold_start.as_ref().and_then(|k| {
        k.full_sync
            .as_ref()
            .or(k.sync.as_ref())
            .and_then(|h| h.max_bucket.or(h.mean))
            .or(k.first_sync_seconds)
    });
    out.push(Target {
        figure: "node cold start, full apply".into(),
        target: "≤ 1 s".into(),
        measured: ms(first_apply),
        kube_proxy: kube_proxy_cold_text(r),
        ratio: ratio(first_apply, kp_first),
        met: first_apply.map(|v| v <= 1.0),
        note: format!("slowest real actuator's kernel apply of its first state, {scale}"),
        under_floor: None,
    });

    // Single changes, as distributions over --single-changes changes (the endpoint_flip phase).
    let single = r.single_changes.as_ref();
    let apply = single.map(|s| &s.real_apply);
    let kp_apply = single.map(|s| &s.kube_proxy_sync);
    out.push(Target {
        figure: "one endpoint change, kernel apply".into(),
        target: "≤ 2 ms".into(),
        measured: match single.map(|s| &s.real_apply_on_cpu).filter(|c| c.n > 0) {
            Some(c) => format!(
                "{}; on a CPU p50 {} p99 {}",
                dist(apply),
                ms(c.p50),
                ms(c.p99)
            ),
            None => dist(apply),
        },
        kube_proxy: dist(kp_apply),
        ratio: ratio(apply.and_then(|a| a.p50), kp_apply.and_then(|k| k.p50)),
        met: apply.and_then(|a| a.p99).map(|v| v <= 0.002),
        note: format!(
            "p99 judged (the wall time); each real actuator's one sync per change, exact (its sync histogram's sum before and after), over {} single changes, and of it the applying thread's CPU time; kube-proxy: its sync per change",
            single.map_or(0, |s| s.changes)
        ),
        under_floor: None,
    });
    let npl = single.map(|s| &s.npl);
    let flip = phase(r, "endpoint_flip");
    let kp_flip = flip
        .and_then(|p| p.kube_proxy.as_ref())
        .and_then(|k| k.npl.as_ref());
    out.push(Target {
        figure: "network programming latency p99, single changes".into(),
        target: "≤ 150 ms".into(),
        measured: format!(
            "p99 {} (p50 {}, {} samples)",
            ms(npl.and_then(|n| n.p99)),
            ms(npl.and_then(|n| n.p50)),
            npl.map_or(0, |n| n.n)
        ),
        kube_proxy: format!(
            "p99 ≤ {} (p50 ≤ {})",
            ms(kp_flip.and_then(|h| h.p99)),
            ms(kp_flip.and_then(|h| h.p50))
        ),
        ratio: ratio(npl.and_then(|n| n.p99), kp_flip.and_then(|h| h.p99)),
        met: npl.and_then(|n| n.p99).map(|v| v <= SINGLE_CHANGE_P99),
        note: "every node and single change: the virtual nodes' exact samples and the real actuators' (sync timestamp - trigger time); kube-proxy: upper bound of its histogram bucket".into(),
        under_floor: floors::single_change(r, SINGLE_CHANGE_P99),
    });
    let reach = single.map(|s| &s.real_per_change);
    let kp_reach = single.map(|s| &s.kube_proxy_exact);
    let reach_ratio = ratio(reach.and_then(|s| s.mean), kp_reach.and_then(|s| s.mean));
    out.push(Target {
        figure: "single change reaching the real nodes, against kube-proxy in the same run".into(),
        target: "≤ 0.3× kube-proxy's".into(),
        measured: format!(
            "mean {} p50 {} over {} changes",
            ms(reach.and_then(|s| s.mean)),
            ms(reach.and_then(|s| s.p50)),
            reach.map_or(0, |s| s.n)
        ),
        kube_proxy: format!(
            "mean {} p50 {} over {} changes",
            ms(kp_reach.and_then(|s| s.mean)),
            ms(kp_reach.and_then(|s| s.p50)),
            kp_reach.map_or(0, |s| s.n)
        ),
        ratio: reach_ratio,
        met: reach_ratio.map(|v| v <= 0.3),
        note: "per change: the mean over the real actuators of (end of the sync that applied it - trigger time); kube-proxy: the end of its first sync that counted it - trigger time; ratio of the means".into(),
        under_floor: None,
    });

    let add = phase(r, "service_add");
    let v = add.and_then(real_apply_mean);
    let k = add.and_then(kp_sync_mean);
    out.push(Target {
        figure: "one Service added, kernel apply".into(),
        target: "≤ 5 ms".into(),
        measured: ms(v),
        kube_proxy: ms(k),
        ratio: ratio(v, k),
        met: v.map(|v| v <= 0.005),
        note: "mean over the real actuators".into(),
        under_floor: None,
    });

    let del = phase(r, "service_delete");
    let v = del.and_then(real_apply_mean);
    let k = del.and_then(kp_sync_mean);
    out.push(Target {
        figure: "one Service deleted, kernel apply".into(),
        target: "(no target)".into(),
        measured: ms(v),
        kube_proxy: ms(k),
        ratio: ratio(v, k),
        met: None,
        note: "mean over the real actuators".into(),
        under_floor: None,
    });

    let kp_npl = kube_proxy_npl(r);
    let kp_p99 = kp_npl.as_ref().and_then(|h| h.quantile(0.99));
    out.push(Target {
        figure: format!("network programming latency p99, all {} nodes", r.config.real + r.config.virtual_nodes),
        target: "≤ 1 s".into(),
        measured: format!("{} ({} samples)", ms(npl_all.p99), npl_all.n),
        kube_proxy: format!(
            "≤ {} ({} samples, 1 node)",
            ms(kp_p99),
            kp_npl.as_ref().map_or(0.0, |h| h.count)
        ),
        ratio: ratio(npl_all.p99, kp_p99),
        met: npl_all.p99.map(|v| v <= 1.0),
        note: "every change phase; splitproxy: exact samples of every virtual node plus the real actuators' single-change samples; kube-proxy: upper bound of its histogram bucket".into(),
        under_floor: None,
    });

    let churn = phase(r, "churn");
    let churn_npl = churn.map(|p| &p.splitproxy.npl);
    let kp_churn = churn
        .and_then(|p| p.kube_proxy.as_ref())
        .and_then(|k| k.npl.as_ref());
    out.push(Target {
        figure: format!(
            "network programming latency p99, all nodes, {} %/s churn",
            r.config.churn_percent
        ),
        target: "≤ 300 ms".into(),
        measured: format!(
            "{} ({} samples)",
            ms(churn_npl.and_then(|s| s.p99)),
            churn_npl.map_or(0, |s| s.n)
        ),
        kube_proxy: format!("≤ {}", ms(kp_churn.and_then(|h| h.p99))),
        ratio: ratio(churn_npl.and_then(|s| s.p99), kp_churn.and_then(|h| h.p99)),
        met: churn_npl.and_then(|s| s.p99).map(|v| v <= CHURN_P99),
        note: "the churn phase alone".into(),
        under_floor: floors::churn(r, CHURN_P99),
    });
    let per_update = churn.and_then(|p| cpu_per_update(p, "brain"));
    out.push(Target {
        figure: "brain CPU per node-update".into(),
        target: "≤ 10 µs".into(),
        measured: per_update.map_or("n/a".into(), |v| format!("{:.1} µs", v * 1e6)),
        kube_proxy: "n/a".into(),
        ratio: None,
        met: per_update.map(|v| v <= CPU_PER_UPDATE),
        under_floor: floors::cpu_per_update(r, CPU_PER_UPDATE),
        note: {
            let against: Vec<String> = floors(r)
                .iter()
                .map(|f| {
                    format!(
                        "{} {:.1} µs ({}×)",
                        f.label(),
                        f.brain_cpu_per_update * 1e6,
                        fmt_ratio(per_update.map(|v| v / f.brain_cpu_per_update))
                    )
                })
                .collect();
            let mut note = "churn phase: CPU seconds of every brain replica / updates they sent".to_string();
            if !against.is_empty() {
                note += &format!(
                    "; the fan-out floors of the same run, sending side (see Fan-out floor), and this against each: {}",
                    against.join(", ")
                );
            }
            note
        },
    });
    let cs = &r.cold_start;
    out.push(Target {
        figure: "every node holds the state, from brain start".into(),
        target: "≤ 5 s, ≤ 4 GB".into(),
        measured: format!(
            "{}, {} sent",
            ms(cs.all_in_sync_seconds),
            gb(cs.brain_bytes_sent)
        ),
        kube_proxy: kube_proxy_cold_text(r),
        ratio: None,
        met: match (cs.all_in_sync_seconds, cs.brain_bytes_sent) {
            (Some(t), Some(b)) => Some(t <= 5.0 && b <= 4e9),
            _ => None,
        },
        note: format!(
            "cold start with {} brain replica(s): the brains' ListNodes, every node connected and in sync; bytes: their update bytes",
            r.config.brains
        ),
        under_floor: None,
    });
    if let Some(f) = &r.failover {
        // What the moved nodes received, and what the survivors say they sent: the same
        // snapshots counted at both ends (the sent count also holds any to a node that did not
        // move), so they are shown side by side, not added.
        let received = f.snapshots_received as f64 + f.real_snapshots_applied;
        let sent = f.snapshots_sent.unwrap_or(0.0);
        out.push(Target {
            figure: "brain replica killed: every node back in sync through another replica"
                .into(),
            target: "≤ 3 s, no full snapshots when the state is the same".into(),
            measured: format!(
                "{} for {} nodes; {} snapshots (the survivors sent {}), {} deltas",
                ms(f.back_in_sync_seconds),
                f.moved_nodes,
                received,
                sent,
                f.deltas_received as f64 + f.real_deltas_applied
            ),
            kube_proxy: "n/a".into(),
            ratio: None,
            met: f
                .back_in_sync_seconds
                .map(|t| t <= 3.0 && received == 0.0 && sent == 0.0),
            note: "from the SIGKILL to every moved node connected and in sync on a surviving replica (their ListNodes, polled every 100 ms), during churn; snapshots the moved nodes received, and in parentheses those the survivors sent".into(),
            under_floor: None,
        });
        if let Some(c) = &f.connections {
            out.push(Target {
                figure: "connections failed on the real actuators during the failover".into(),
                target: "0".into(),
                measured: format!("{} of {}", c.failed, c.attempted),
                kube_proxy: "n/a".into(),
                ratio: None,
                met: Some(c.failed == 0 && c.attempted > 0),
                note: format!(
                    "new TCP connections back to back from a pod on {} to a ClusterIP served on {}",
                    c.client_node, c.server_node
                ),
                under_floor: None,
            });
        }
    }
    if let Some(x) = &r.restart {
        out.push(Target {
            figure: "brain restarted (same version, same cluster state)".into(),
            target: "deltas only; bytes ≤ 1 % of a full resync".into(),
            measured: format!(
                "{} snapshots, {} deltas, {} current; {} bytes = {} of a full resync; in sync after {}",
                num(x.snapshots_sent),
                num(x.deltas_sent),
                num(x.current),
                num(x.bytes_sent),
                x.bytes_ratio
                    .map_or("n/a".into(), |r| format!("{:.3} %", r * 100.0)),
                ms(x.all_in_sync_seconds)
            ),
            kube_proxy: "n/a".into(),
            ratio: None,
            met: match (x.snapshots_sent, x.bytes_ratio) {
                (Some(s), Some(b)) => Some(s == 0.0 && b <= 0.01),
                _ => None,
            },
            note: "every replica stopped (SIGTERM) and started again; full resync: the bytes the cold start sent".into(),
            under_floor: None,
        });
    }

    let brain_watches = r.cold_start.brain_watches;
    let kp_watches = r.kube_proxy_cold_start.as_ref().and_then(|k| k.watches);
    out.push(Target {
        figure: "API watches".into(),
        target: "a few per brain replica, whatever N".into(),
        measured: format!(
            "{} ({} brain replica(s), 3 each expected)",
            num(brain_watches),
            r.config.brains
        ),
        kube_proxy: format!(
            "{} per node, {} for {} nodes",
            num(kp_watches),
            num(kp_watches.map(|w| w * r.config.nodes as f64)),
            r.config.nodes
        ),
        ratio: ratio(brain_watches, kp_watches.map(|w| w * r.config.nodes as f64)),
        met: brain_watches.map(|w| w <= 8.0 * r.config.brains.max(1) as f64),
        note: "the API server's WATCH gauge before and after each started".into(),
        under_floor: None,
    });

    let compute = churn.and_then(|p| p.splitproxy.compute.as_ref());
    let bytes = churn.and_then(|p| p.splitproxy.bytes_per_publication);
    out.push(Target {
        figure: "brain work per change".into(),
        target: "independent of N except copying bytes to streams".into(),
        measured: format!(
            "compute p50 ≤ {} p99 ≤ {}; {} bytes per publication to {} nodes",
            ms(compute.and_then(|c| c.p50)),
            ms(compute.and_then(|c| c.p99)),
            num(bytes),
            r.config.real + r.config.virtual_nodes
        ),
        kube_proxy: "every node recomputes".into(),
        ratio: None,
        met: None,
        note: "judged across runs at different --nodes (one run cannot show independence)".into(),
        under_floor: None,
    });

    let act = peak_rss(r, "actuator");
    out.push(Target {
        figure: format!("actuator memory at {} Services", r.config.services),
        target: "≤ 50 MiB RSS".into(),
        measured: mib(act),
        kube_proxy: mib(peak_rss(r, "kube-proxy")),
        ratio: ratio(act, peak_rss(r, "kube-proxy")),
        met: act.map(|v| v <= 50.0 * MIB),
        note: "peak RSS (VmHWM) of the largest real actuator over the run".into(),
        under_floor: None,
    });

    let brain = peak_rss(r, "brain");
    out.push(Target {
        figure: format!(
            "brain memory at {} Services, {} endpoints, {} nodes",
            r.config.services,
            r.config.services * r.config.endpoints,
            r.config.nodes
        ),
        target: "≤ 512 MiB".into(),
        measured: mib(brain),
        kube_proxy: "n/a".into(),
        ratio: None,
        met: brain.map(|v| v <= 512.0 * MIB),
        note: "peak RSS (VmHWM) of the largest brain replica over the run".into(),
        under_floor: None,
    });
    out
}
