//! The issue's targets judged against a run, and the Markdown report (bench/RESULTS.md).
use std::fmt::Write as _;
use std::path::Path;

use crate::floor::Floor;
use crate::measure::prom::HistSummary;
use crate::measure::stats::Stats;
use crate::results::{BenchResult, Phase, Target};

mod floors;

const MIB: f64 = 1024.0 * 1024.0;
/// The issue's targets that a run can find under this machine's floor ([`floors`]), seconds.
const SINGLE_CHANGE_P99: f64 = 0.150;
const CHURN_P99: f64 = 0.300;
const CPU_PER_UPDATE: f64 = 10e-6;

fn ms(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => {
            if v >= 10.0 {
                format!("{v:.1} s")
            } else if v >= 0.1 {
                format!("{:.0} ms", v * 1e3)
            } else {
                format!("{:.2} ms", v * 1e3)
            }
        }
        Some(_) => "> last bucket".into(),
        None => "n/a".into(),
    }
}

fn mib(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{:.1} MiB", v / MIB))
}

fn num(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| {
        if v.fract() == 0.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    })
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a.is_finite() && b.is_finite() => Some(a / b),
        _ => None,
    }
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or("n/a".into(), |r| {
        if r < 0.01 {
            format!("{r:.4}")
        } else {
            format!("{r:.2}")
        }
    })
}

pub fn phase<'a>(r: &'a BenchResult, name: &str) -> Option<&'a Phase> {
    r.phases.iter().find(|p| p.name == name)
}

/// Mean kernel apply time over the real actuators in a phase.
fn real_apply_mean(p: &Phase) -> Option<f64> {
    crate::phases::mean_of(p.splitproxy.real_apply.values().filter_map(|h| h.mean))
}

fn kp_sync_mean(p: &Phase) -> Option<f64> {
    p.kube_proxy.as_ref()?.sync.as_ref()?.mean
}

/// The largest peak RSS of processes whose role starts with `prefix`, over the whole run.
fn peak_rss(r: &BenchResult, prefix: &str) -> Option<f64> {
    let cold = r.cold_start.processes.iter();
    let kp = r
        .kube_proxy_cold_start
        .iter()
        .flat_map(|k| k.processes.iter());
    let phases = r.phases.iter().flat_map(|p| p.processes.iter());
    cold.chain(kp)
        .chain(phases)
        .filter(|(role, _)| role.starts_with(prefix))
        .map(|(_, u)| u.peak_rss_bytes as f64)
        .reduce(f64::max)
}

/// kube-proxy's NPL over every change phase, merged.
pub fn kube_proxy_npl(r: &BenchResult) -> Option<crate::measure::prom::Histogram> {
    let mut all: Option<crate::measure::prom::Histogram> = None;
    for p in &r.phases {
        if let Some(h) = p.kube_proxy.as_ref().and_then(|k| k.npl_histogram.as_ref()) {
            match all.as_mut() {
                Some(a) => a.merge(h),
                None => all = Some(h.clone()),
            }
        }
    }
    all
}

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

/// CPU seconds in a phase of the processes whose role starts with `role` ("brain": every
/// replica; "bench": the virtual fleet and the API writer).
fn role_cpu(p: &Phase, role: &str) -> f64 {
    p.processes
        .iter()
        .filter(|(r, _)| r.starts_with(role))
        .map(|(_, u)| u.cpu_seconds)
        .sum()
}

/// [`role_cpu`] per update the brains sent in the phase.
fn cpu_per_update(p: &Phase, role: &str) -> Option<f64> {
    match p.splitproxy.updates_sent {
        Some(u) if u > 0.0 => Some(role_cpu(p, role) / u),
        _ => None,
    }
}

/// Which code ran: the binary's commit, and the checkout's when it differs (or when an older
/// result has no binary commit).
fn commits(v: &crate::results::Versions) -> String {
    match (v.build_commit.as_str(), v.git_commit.as_str()) {
        ("", checkout) => format!("checkout {checkout}"),
        (built, checkout) if built == checkout => built.to_string(),
        (built, checkout) => format!("built from {built}, run from checkout {checkout}"),
    }
}

fn gb(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| {
        if v >= 1e9 {
            format!("{:.2} GB", v / 1e9)
        } else {
            format!("{:.1} MB", v / 1e6)
        }
    })
}

/// "p50 X p99 Y (n=N)" of a distribution.
fn dist(s: Option<&Stats>) -> String {
    match s {
        Some(s) if s.n > 0 => format!("p50 {} p99 {} (n={})", ms(s.p50), ms(s.p99), s.n),
        _ => "n/a".into(),
    }
}

fn kube_proxy_cold_text(r: &BenchResult) -> String {
    match &r.kube_proxy_cold_start {
        None => "not run".into(),
        Some(k) => match k.first_sync_seconds {
            Some(s) => format!(
                "first sync done {:.1} s after start (sync {})",
                s,
                ms(k.full_sync
                    .as_ref()
                    .or(k.sync.as_ref())
                    .and_then(|h| h.max_bucket.or(h.mean)))
            ),
            None => format!("no sync within {:.0} s", k.timeout_seconds),
        },
    }
}

fn hist_cell(h: Option<&HistSummary>) -> String {
    match h {
        Some(h) if h.count > 0.0 => format!(
            "n={} mean {} p50 ≤ {} p99 ≤ {} max ≤ {}",
            h.count,
            ms(h.mean),
            ms(h.p50),
            ms(h.p99),
            if h.above_last_bucket {
                "∞".into()
            } else {
                ms(h.max_bucket)
            }
        ),
        Some(_) => "none".into(),
        None => "metric absent".into(),
    }
}

/// How long the changes took to reach the brain at all, and over how many changes: the mean of
/// trigger time → publication less the mean of watch event → publication, when both count the
/// same changes. On a shared machine the API server's write and watch can be a large part of
/// the NPL, and no brain change shortens it.
fn before_brain_mean(
    publish: Option<&HistSummary>,
    queue: Option<&HistSummary>,
) -> Option<(f64, f64)> {
    let (p, q) = (publish?, queue?);
    if p.count > 0.0 && p.count == q.count {
        Some((p.mean? - q.mean?, p.count))
    } else {
        None
    }
}

/// [`before_brain_mean`] as a cell of the report, or why there is none.
fn before_brain_cell(publish: Option<&HistSummary>, queue: Option<&HistSummary>) -> String {
    if let Some((mean, changes)) = before_brain_mean(publish, queue) {
        return format!("{} (over {changes} changes)", ms(Some(mean)));
    }
    match (publish, queue) {
        (Some(p), Some(q)) if p.count > 0.0 && p.count == q.count => "none".into(),
        (Some(p), Some(q)) if p.count > 0.0 || q.count > 0.0 => {
            format!("n/a ({} and {} changes counted)", p.count, q.count)
        }
        (Some(_), Some(_)) => "none".into(),
        _ => "metric absent".into(),
    }
}

fn stats_cell(s: &Stats) -> String {
    if s.n == 0 {
        return "none".into();
    }
    format!(
        "n={} p50 {} p99 {} max {}",
        s.n,
        ms(s.p50),
        ms(s.p99),
        ms(s.max)
    )
}

/// Renders the whole report. `plots` are file names inside `out_rel`.
pub fn markdown(r: &BenchResult, out_rel: &str, plots: &[String]) -> String {
    let mut m = String::new();
    let w = &mut m;
    let _ = writeln!(w, "# splitproxy scale benchmark\n");
    let _ = writeln!(
        w,
        "Regenerated by every run of `tools/bench.sh`; the numbers below come from one run, \
         recorded in `{out_rel}/result.json`.\n"
    );
    let _ = writeln!(w, "Command:\n\n```\n{}\n```\n", r.command);
    let _ = writeln!(
        w,
        "Run {} on {} cores, {:.1} GiB, kernel {} ({}); splitproxy {} ({}), Kubernetes {}, kube-proxy {}, etcd {}. Took {:.0} s.\n",
        r.started_at,
        r.machine.nproc,
        r.machine.memory_bytes as f64 / (1024.0 * MIB),
        r.machine.kernel,
        r.machine.cpu_model,
        r.versions.splitproxy,
        commits(&r.versions),
        r.versions.kubernetes,
        r.versions.kube_proxy,
        r.versions.etcd,
        r.seconds
    );
    let c = &r.config;
    let _ = writeln!(
        w,
        "Workload: {} Services x {} endpoints (plus one 100-endpoint Service for the rolling update), {} Node objects; \
         {} brain replica(s) ({}), {} real actuators in node namespaces, {} virtual nodes over real gRPC, kube-proxy {}; churn {} % ({} slices) per second for {} s{}.\n",
        c.services,
        c.endpoints,
        c.nodes,
        c.brains.max(1),
        match c.brain_worker_threads {
            0 => "worker threads: one per CPU".to_string(),
            n => format!("{n} worker thread(s) each"),
        },
        c.real,
        c.virtual_nodes,
        if c.kube_proxy {
            "side by side in its own node namespace"
        } else {
            "skipped"
        },
        c.churn_percent,
        c.churn_per_second,
        c.churn_seconds,
        if c.churn_bursts > 1 {
            format!(
                ", written in {} evenly spaced bursts a second",
                c.churn_bursts
            )
        } else {
            String::new()
        }
    );

    let _ = writeln!(w, "## Targets\n");
    let _ = writeln!(
        w,
        "| figure | target | splitproxy | kube-proxy | splitproxy / kube-proxy | met | how measured |\n|---|---|---|---|---|---|---|"
    );
    for t in &r.targets {
        let met = match (t.met, &t.under_floor) {
            (Some(true), _) => "yes",
            (Some(false), Some(_)) => "**no**, under this machine's floor",
            (Some(false), None) => "**no**",
            (None, _) => "-",
        };
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {} | {} |",
            t.figure,
            t.target,
            t.measured,
            t.kube_proxy,
            fmt_ratio(t.ratio),
            met,
            t.note
        );
    }

    let wl = &r.workload;
    let _ = writeln!(
        w,
        "\n## Workload write\n\n{} objects ({} Nodes, {} Services, {} EndpointSlices, {} endpoints) in {:.1} s: {:.0} objects/s with {} writes in flight.\n",
        wl.objects,
        wl.nodes,
        wl.services,
        wl.slices,
        wl.endpoints,
        wl.seconds,
        wl.objects_per_second,
        wl.concurrency
    );

    let cs = &r.cold_start;
    let _ = writeln!(w, "## Cold start\n");
    let _ = writeln!(w, "| figure | value |\n|---|---|");
    let _ = writeln!(
        w,
        "| brain ready (every initial list done and the state it gives published), from its start | {} |",
        ms(cs.brain_ready_seconds)
    );
    for (n, s) in &cs.actuators_ready_seconds {
        let _ = writeln!(w, "| real actuator {n} ready | {} |", ms(*s));
    }
    let _ = writeln!(
        w,
        "| every virtual node holds the same state | {} |",
        ms(cs.fleet_in_sync_seconds)
    );
    let _ = writeln!(
        w,
        "| every node in sync (brain's ListNodes) | {} |",
        ms(cs.all_in_sync_seconds)
    );
    for (n, h) in &cs.real_first_apply {
        let _ = writeln!(
            w,
            "| {n}: kernel apply of the first state(s) | {} in {} update(s) |",
            ms(Some(h.sum)),
            h.count
        );
    }
    let _ = writeln!(
        w,
        "| brain compute | {} |",
        hist_cell(cs.brain_compute.as_ref())
    );
    let _ = writeln!(
        w,
        "| brain fan-out | {} |",
        hist_cell(cs.brain_fanout.as_ref())
    );
    let _ = writeln!(
        w,
        "| brain bytes sent / updates sent | {} / {} |",
        num(cs.brain_bytes_sent),
        num(cs.brain_updates_sent)
    );
    let _ = writeln!(
        w,
        "| brain parts compressed (once for the fleet) / compression CPU | {} / {} s |",
        num(cs.brain_compressed_parts),
        num(cs.brain_compress_seconds)
    );
    let _ = writeln!(
        w,
        "| virtual node decode + apply per update | {} |",
        stats_cell(&cs.virtual_apply)
    );
    let _ = writeln!(
        w,
        "| API watches held by the brain replicas ({}) | {} |",
        cs.brain_replicas.max(1),
        num(cs.brain_watches)
    );
    if cs.connected_per_replica.len() > 1 {
        let _ = writeln!(
            w,
            "| nodes served by each replica | {} |",
            cs.connected_per_replica
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(" / ")
        );
    }
    for (role, u) in &cs.processes {
        let _ = writeln!(
            w,
            "| {role}: CPU, RSS, peak RSS | {:.2} s, {}, {} |",
            u.cpu_seconds,
            mib(Some(u.rss_bytes as f64)),
            mib(Some(u.peak_rss_bytes as f64))
        );
    }
    if let Some(k) = &r.kube_proxy_cold_start {
        let _ = writeln!(w, "| kube-proxy first sync | {} |", kube_proxy_cold_text(r));
        let _ = writeln!(
            w,
            "| kube-proxy sync histogram | {} |",
            hist_cell(k.sync.as_ref())
        );
        let _ = writeln!(w, "| kube-proxy API watches | {} |", num(k.watches));
        for (role, u) in k
            .processes
            .iter()
            .filter(|(r, _)| r.starts_with("kube-proxy"))
        {
            let _ = writeln!(
                w,
                "| {role}: CPU, peak RSS | {:.2} s, {} |",
                u.cpu_seconds,
                mib(Some(u.peak_rss_bytes as f64))
            );
        }
    }

    let _ = writeln!(w, "\n## Change phases\n");
    for p in &r.phases {
        let sp = &p.splitproxy;
        let _ = writeln!(
            w,
            "### {}\n\n{} ({} writes, {:.1} s).\n",
            p.name, p.description, p.changes, p.seconds
        );
        let _ = writeln!(
            w,
            "| figure | splitproxy | kube-proxy | ratio |\n|---|---|---|---|"
        );
        let kp = p.kube_proxy.as_ref();
        let kp_npl = kp.and_then(|k| k.npl.as_ref());
        let _ = writeln!(
            w,
            "| network programming latency p50 | {} | ≤ {} | {} |",
            ms(sp.npl.p50),
            ms(kp_npl.and_then(|h| h.p50)),
            fmt_ratio(ratio(sp.npl.p50, kp_npl.and_then(|h| h.p50)))
        );
        let _ = writeln!(
            w,
            "| network programming latency p99 | {} | ≤ {} | {} |",
            ms(sp.npl.p99),
            ms(kp_npl.and_then(|h| h.p99)),
            fmt_ratio(ratio(sp.npl.p99, kp_npl.and_then(|h| h.p99)))
        );
        let _ = writeln!(
            w,
            "| network programming latency max | {} | ≤ {} | |",
            ms(sp.npl.max),
            ms(kp_npl.and_then(|h| h.max_bucket))
        );
        if !sp.npl_real_exact.is_empty() || kp.and_then(|k| k.npl_exact).is_some() {
            let real = crate::phases::mean_of(sp.npl_real_exact.values().copied());
            let _ = writeln!(
                w,
                "| single change, exact (real nodes' mean) | {} | {} | {} |",
                ms(real),
                ms(kp.and_then(|k| k.npl_exact)),
                fmt_ratio(ratio(real, kp.and_then(|k| k.npl_exact)))
            );
        }
        let ra = real_apply_mean(p);
        let ka = kp.and_then(|k| k.sync.as_ref()).and_then(|h| h.mean);
        let _ = writeln!(
            w,
            "| kernel apply (sync) mean | {} | {} | {} |",
            ms(ra),
            ms(ka),
            fmt_ratio(ratio(ra, ka))
        );
        if !sp.real_apply_on_cpu_mean.is_empty() {
            let _ = writeln!(
                w,
                "| of it, the applying thread on a CPU, mean | {} | | |",
                ms(crate::phases::mean_of(
                    sp.real_apply_on_cpu_mean.values().copied()
                ))
            );
        }
        let _ = writeln!(
            w,
            "| nodes with latency samples | {} of {} | {} | |",
            sp.nodes_with_samples,
            sp.nodes_total,
            kp.map_or("not run".to_string(), |k| if k.caught_up {
                format!("caught up after {:.1} s", k.waited_seconds)
            } else {
                format!("did NOT catch up in {:.0} s", k.waited_seconds)
            })
        );
        let _ = writeln!(
            w,
            "| every node converged after the last write | {} | | |",
            ms(p.converged_seconds)
        );
        let _ = writeln!(
            w,
            "| virtual nodes' NPL | {} | | |",
            stats_cell(&sp.npl_virtual)
        );
        for (n, h) in &sp.npl_real {
            let _ = writeln!(w, "| {n} NPL histogram | {} | | |", hist_cell(Some(h)));
        }
        for (n, h) in &sp.real_apply {
            let _ = writeln!(w, "| {n} kernel apply | {} | | |", hist_cell(Some(h)));
        }
        if let Some(k) = kp {
            let _ = writeln!(
                w,
                "| kube-proxy sync | | {} | |",
                hist_cell(k.sync.as_ref())
            );
            let _ = writeln!(
                w,
                "| kube-proxy partial / full syncs | | {} / {} | |",
                hist_cell(k.partial_sync.as_ref()),
                hist_cell(k.full_sync.as_ref())
            );
        }
        let _ = writeln!(
            w,
            "| brain: trigger time → publication | {} | | |",
            hist_cell(sp.publish_latency.as_ref())
        );
        let _ = writeln!(
            w,
            "| brain: watch event → publication (pacing, recompute) | {} | | |",
            hist_cell(sp.change_queue.as_ref())
        );
        let _ = writeln!(
            w,
            "| before the brain: trigger time → watch event (API server write and watch), mean | {} | | |",
            before_brain_cell(sp.publish_latency.as_ref(), sp.change_queue.as_ref())
        );
        let _ = writeln!(
            w,
            "| brain fan-out (publication → last ack) | {} | | |",
            hist_cell(sp.fanout.as_ref())
        );
        let _ = writeln!(
            w,
            "| brain compute per change | {} | | |",
            hist_cell(sp.compute.as_ref())
        );
        let _ = writeln!(
            w,
            "| brain publications, updates sent, bytes sent, bytes per publication | {}, {}, {}, {} | | |",
            num(sp.publications),
            num(sp.updates_sent),
            num(sp.bytes_sent),
            num(sp.bytes_per_publication)
        );
        let _ = writeln!(
            w,
            "| virtual node decode + apply per update | {} | | |",
            stats_cell(&sp.virtual_apply)
        );
        for (role, u) in &p.processes {
            let _ = writeln!(
                w,
                "| {role}: CPU s, peak RSS | {:.2} s, {} | | |",
                u.cpu_seconds,
                mib(Some(u.peak_rss_bytes as f64))
            );
        }
        for n in &p.notes {
            let _ = writeln!(w, "\nNote: {n}");
        }
        let _ = writeln!(w);
    }

    single_section(w, r);
    floor_section(w, r);
    failover_section(w, r);
    restart_section(w, r);

    if let Some(wt) = &r.watches {
        let _ = writeln!(w, "## API server watches\n");
        let _ = writeln!(
            w,
            "The same churn for {} s, once with splitproxy's watches only (plus the one real kube-proxy), once with one watcher set per node added \
             (Services, EndpointSlices, own Node: {} requested, {} established, {} failed), as {} kube-proxies would hold.\n",
            wt.seconds, wt.storm_requested, wt.storm_established, wt.storm_failed, r.config.nodes
        );
        let _ = writeln!(
            w,
            "| figure | splitproxy | with the kube-proxy watch storm | ratio |\n|---|---|---|---|"
        );
        let b = &wt.baseline;
        let s = &wt.storm;
        let _ = writeln!(
            w,
            "| WATCH requests held | {} | {} | {} |",
            num(b.watches),
            num(s.watches),
            fmt_ratio(ratio(b.watches, s.watches))
        );
        let _ = writeln!(
            w,
            "| registered watchers | {} | {} | {} |",
            num(b.registered_watchers),
            num(s.registered_watchers),
            fmt_ratio(ratio(b.registered_watchers, s.registered_watchers))
        );
        let _ = writeln!(
            w,
            "| API server CPU (cores) | {:.2} | {:.2} | {} |",
            b.apiserver_cpu_cores,
            s.apiserver_cpu_cores,
            fmt_ratio(ratio(
                Some(b.apiserver_cpu_cores),
                Some(s.apiserver_cpu_cores)
            ))
        );
        let _ = writeln!(
            w,
            "| API server peak RSS | {} | {} | {} |",
            mib(Some(b.apiserver_peak_rss_bytes as f64)),
            mib(Some(s.apiserver_peak_rss_bytes as f64)),
            fmt_ratio(ratio(
                Some(b.apiserver_peak_rss_bytes as f64),
                Some(s.apiserver_peak_rss_bytes as f64)
            ))
        );
        let _ = writeln!(
            w,
            "| slice writes during the run | {} | {} | |",
            b.changes, s.changes
        );
        let _ = writeln!(
            w,
            "| watch event bytes delivered | | {:.0} /s | |",
            wt.storm_events_bytes_per_second
        );
        let _ = writeln!(
            w,
            "| watches the API server ended during the run | | {} | |\n",
            wt.storm_ended_early
        );
    }

    let _ = writeln!(w, "## Missed targets\n");
    let missed: Vec<&Target> = r.targets.iter().filter(|t| t.met == Some(false)).collect();
    if missed.is_empty() {
        let _ = writeln!(w, "None of the judged targets was missed at this scale.\n");
    }
    for t in missed {
        let _ = writeln!(
            w,
            "- **{}**: {} against {}. {}{}",
            t.figure,
            t.measured,
            t.target,
            why(r, &t.figure),
            t.under_floor
                .as_ref()
                .map_or(String::new(), |u| format!(" {u}"))
        );
    }
    let _ = writeln!(
        w,
        "\nProfile: `perf` is not used; the brain's own compute and fan-out histograms and the per-phase CPU seconds above \
         stand for it (CPU seconds per process and phase from /proc/PID/stat, peak RSS from VmHWM reset at each phase).\n"
    );

    if !plots.is_empty() {
        let _ = writeln!(w, "## Plots\n");
        for p in plots {
            let _ = writeln!(w, "![{p}]({out_rel}/{p})\n");
        }
    }
    if !r.notes.is_empty() {
        let _ = writeln!(w, "## Notes\n");
        for n in &r.notes {
            let _ = writeln!(w, "- {n}");
        }
    }
    m
}

fn dist_cell(s: &Stats) -> String {
    if s.n == 0 {
        return "none".into();
    }
    format!(
        "n={} mean {} p50 {} p99 {} max {}",
        s.n,
        ms(s.mean),
        ms(s.p50),
        ms(s.p99),
        ms(s.max)
    )
}

fn single_section(w: &mut String, r: &BenchResult) {
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

fn failover_section(w: &mut String, r: &BenchResult) {
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

/// The floors a run measured, from the barest up: bare TCP, TLS, TLS on tokio, HTTP/2 by `h2`
/// and by hyper's server.
fn floors(r: &BenchResult) -> Vec<&Floor> {
    [
        &r.floor,
        &r.floor_tls,
        &r.floor_tokio,
        &r.floor_h2,
        &r.floor_hyper,
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The fan-out floors beside what splitproxy did in the same run: CPU per update on each side
/// and a single change's fan-out to every node, one row per floor, from the barest up.
fn floor_section(w: &mut String, r: &BenchResult) {
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

fn restart_section(w: &mut String, r: &BenchResult) {
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

/// Why a target was missed, from the figures that compose it.
fn why(r: &BenchResult, figure: &str) -> String {
    let churn = phase(r, "churn");
    if figure.starts_with("network programming latency") {
        let (compute, fanout, apply) = churn
            .map(|p| {
                (
                    p.splitproxy.compute.as_ref().and_then(|h| h.p99),
                    p.splitproxy.fanout.as_ref().and_then(|h| h.p99),
                    p.splitproxy.virtual_apply.p99,
                )
            })
            .unwrap_or_default();
        let cores = |p: &Phase, role: &str| role_cpu(p, role) / p.seconds.max(1e-9);
        let brain_cpu = churn.map(|p| cores(p, "brain"));
        let bench_cpu = churn
            .filter(|p| p.processes.iter().any(|(k, _)| k.starts_with("bench")))
            .map(|p| cores(p, "bench"));
        let before = churn
            .map(|p| {
                before_brain_cell(
                    p.splitproxy.publish_latency.as_ref(),
                    p.splitproxy.change_queue.as_ref(),
                )
            })
            .unwrap_or_else(|| "n/a".into());
        return format!(
            "In the churn phase a change reached the brain's watch {} after its trigger time, on average (the API server's write and watch); \
             the brain's compute p99 was {}, fan-out (publication to last ack) p99 {}, a virtual node's decode+apply p99 {}; \
             the brain used {} cores and the bench process (virtual fleet, writer) {} cores of {}: the latency is mostly queueing for CPU \
             when both share the machine.",
            before,
            ms(compute),
            ms(fanout),
            ms(apply),
            num(brain_cpu),
            num(bench_cpu),
            r.machine.nproc
        );
    }
    if figure == "one endpoint change, kernel apply"
        && let Some(s) = r
            .single_changes
            .as_ref()
            .filter(|s| s.real_apply_on_cpu.n > 0)
    {
        let (wall, cpu) = (&s.real_apply, &s.real_apply_on_cpu);
        return format!(
            "On a CPU the applying thread took p50 {} p99 {} (max {}) of the sync's p50 {} p99 {} (max {}): {}",
            ms(cpu.p50),
            ms(cpu.p99),
            ms(cpu.max),
            ms(wall.p50),
            ms(wall.p99),
            ms(wall.max),
            if cpu.p99.is_some_and(|c| c <= 0.002) {
                "the transaction itself fits the target, and the rest is the thread waiting, for a CPU the \
                 brain and the virtual fleet share with it on this machine (or asleep in the kernel)."
            } else {
                "the transaction itself costs that much; every commit walks the table's chains and validates \
                 new jumps (see docs/ruleset.md), so its floor follows the ruleset's shape."
            }
        );
    }
    if figure.contains("kernel apply") || figure.contains("cold start") {
        return "The actuator's apply is one nf_tables transaction; every commit walks the table's chains and validates \
                new jumps (see docs/ruleset.md), so its floor follows the ruleset's shape."
            .into();
    }
    if figure.starts_with("brain CPU per node-update") {
        if let Some(p) = churn {
            let cpu = role_cpu(p, "brain");
            return format!(
                "In the churn phase the brain replicas used {cpu:.2} CPU seconds for {} updates sent \
                 ({} publications).",
                num(p.splitproxy.updates_sent),
                num(p.splitproxy.publications)
            );
        }
        return String::new();
    }
    if figure.starts_with("brain replica killed") {
        if let Some(f) = &r.failover {
            return format!(
                "Per moved node: {}; nodes spread their reconnects over up to a second after a \
                 healthy stream breaks (the actuator's pacing, which the virtual nodes mirror). \
                 Every moved node had resumed on a survivor (connected, one of its updates acked) \
                 after {} (per node {}); in sync means holding the newest publication, which \
                 under churn waits for the fan-out of the last write, {} after the kill. \
                 {} snapshots received, {} sent by the survivors.",
                dist_cell(&f.back_in_sync),
                ms(f.resumed_seconds),
                dist_cell(&f.resumed),
                ms(f.last_write_after_kill_seconds),
                f.snapshots_received as f64 + f.real_snapshots_applied,
                num(f.snapshots_sent)
            );
        }
        return String::new();
    }
    if figure.starts_with("brain restarted") {
        if let Some(x) = &r.restart {
            return format!(
                "Sessions by resumption: {:?}; {} of {} replicas needed SIGKILL to stop.",
                x.resumptions, x.killed_after_grace, x.replicas
            );
        }
        return String::new();
    }
    if figure.contains("memory") {
        return "Peak RSS includes the decoded updates held during apply and the allocator's retained pages.".into();
    }
    String::new()
}

/// The report's path to `out`: relative when `out` is beside or below the report.
pub fn relative(report: &Path, out: &Path) -> String {
    let base = report.parent().unwrap_or(Path::new("."));
    let abs = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let (b, o) = (abs(base), abs(out));
    match o.strip_prefix(&b) {
        Ok(rel) if !rel.as_os_str().is_empty() => rel.display().to_string(),
        _ => o.display().to_string(),
    }
}

/// Counts by kind, "full 10, resumed 4990"; "-" when the brain reported none.
fn by_kind(m: &std::collections::BTreeMap<String, f64>) -> String {
    if m.is_empty() {
        return "-".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A histogram's summary that knows only its count and mean, for tests.
#[cfg(test)]
fn summary(count: f64, mean: f64) -> HistSummary {
    HistSummary {
        count,
        sum: count * mean,
        mean: Some(mean),
        p50: None,
        p99: None,
        max_bucket: None,
        above_last_bucket: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::SingleChanges;

    #[test]
    fn the_time_before_the_brain_is_the_difference_of_the_means_over_the_same_changes() {
        let cell = before_brain_cell(Some(&summary(6000.0, 0.432)), Some(&summary(6000.0, 0.137)));
        assert_eq!(cell, "295 ms (over 6000 changes)");
        assert_eq!(
            before_brain_cell(Some(&summary(20.0, 0.4)), Some(&summary(19.0, 0.1))),
            "n/a (20 and 19 changes counted)",
            "different changes: no difference of means"
        );
        assert_eq!(
            before_brain_cell(Some(&summary(0.0, 0.0)), Some(&summary(0.0, 0.0))),
            "none"
        );
        assert_eq!(
            before_brain_cell(None, Some(&summary(1.0, 0.1))),
            "metric absent"
        );
    }

    fn stats(p50: f64, p99: f64) -> Stats {
        Stats {
            n: 60,
            p50: Some(p50),
            p99: Some(p99),
            max: Some(p99),
            ..Stats::default()
        }
    }

    #[test]
    fn a_slow_apply_says_whether_the_transaction_or_the_wait_took_the_time() {
        let mut r = BenchResult {
            single_changes: Some(SingleChanges {
                real_apply: stats(0.00015, 0.0024),
                real_apply_on_cpu: stats(0.0001, 0.0003),
                ..SingleChanges::default()
            }),
            ..BenchResult::default()
        };
        let figure = "one endpoint change, kernel apply";
        let waited = why(&r, figure);
        assert!(waited.contains("p99 0.30 ms"), "{waited}");
        assert!(
            waited.contains("the rest is the thread waiting"),
            "{waited}"
        );
        r.single_changes.as_mut().unwrap().real_apply_on_cpu = stats(0.0001, 0.0023);
        let costly = why(&r, figure);
        assert!(costly.contains("the transaction itself costs"), "{costly}");
        // Results from before the CPU time was measured keep the old explanation.
        r.single_changes.as_mut().unwrap().real_apply_on_cpu = Stats::default();
        assert!(why(&r, figure).contains("every commit walks"));
    }
}
