//! One benchmark run from start to finish: control plane and namespaces, workload, cold start,
//! kube-proxy, the change phases, the watch comparison, then the JSON result, the plots and the
//! report. A phase that fails becomes a note and the run goes on, so that one run always leaves
//! a result; every component is stopped when the rig drops, also on error.
use std::path::Path;
use std::time::Instant;

use anyhow::Context;

use crate::cli::BenchArgs;
use crate::fleet;
use crate::measure::procstat::Watched;
use crate::measure::stats::LatencyHist;
use crate::phases::{Bench, changes, cold, failover, restart, single, watches};
use crate::results::{BenchResult, Config};
use crate::rig::Rig;
use crate::workload::{Workload, Writer, node_name};

/// The environment variable through which tools/bench.sh passes the command the user typed.
pub const COMMAND_ENV: &str = "SPLITPROXY_BENCH_COMMAND";

/// The command line to print and record.
pub fn command_line() -> String {
    if let Ok(c) = std::env::var(COMMAND_ENV)
        && !c.trim().is_empty()
    {
        return c;
    }
    std::env::args()
        .map(|a| {
            if a.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./=,:".contains(c))
            {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Raises the open-file limit of this process (and so of every component it spawns): 5,000
/// gRPC streams, the brain's side of them and the watch storm need far more than 1,024.
pub fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let want: u64 = 1 << 20;
    if setrlimit(Resource::RLIMIT_NOFILE, want, want).is_err()
        && let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
    {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
    if let Ok((soft, _)) = getrlimit(Resource::RLIMIT_NOFILE) {
        println!("[bench] open files limit {soft}");
    }
}

/// Runs the benchmark and writes its outputs. Returns the result (also on partial failure).
pub async fn run(args: BenchArgs) -> anyhow::Result<BenchResult> {
    args.validate()?;
    let command = command_line();
    println!("[bench] command: {command}");
    let started = Instant::now();
    let mut result = BenchResult {
        command,
        started_at: k8s_openapi::jiff::Timestamp::now()
            .round(k8s_openapi::jiff::Unit::Second)?
            .to_string(),
        machine: crate::machine::machine(),
        versions: crate::machine::versions(!args.skip_kube_proxy),
        config: Config {
            services: args.services,
            endpoints: args.endpoints,
            nodes: args.nodes,
            real: args.real,
            virtual_nodes: args.virtual_count(),
            churn_seconds: args.churn_seconds,
            churn_percent: args.churn_percent,
            churn_per_second: args.churn_per_second(),
            storm_seconds: args.storm_seconds,
            kube_proxy: !args.skip_kube_proxy,
            watch_storm: !args.skip_watch_storm,
            brains: args.brains,
            brain_worker_threads: args.brain_worker_threads,
            single_changes: args.single_changes,
            churn_bursts: args.churn_bursts.max(1),
        },
        ..Default::default()
    };
    raise_nofile();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let logs = args.out.join("logs");
    let _ = std::fs::remove_dir_all(&logs);

    println!(
        "[bench] starting etcd, kube-apiserver and {} node namespaces",
        args.real + 1
    );
    let exe = std::env::current_exe().context("locating this binary")?;
    let mut rig = Rig::start(exe, &logs, args.real).await?;
    rig.brain_args = args.brain_args.clone();
    rig.brain_worker_threads = args.brain_worker_threads;
    let mut watched = Watched::default();
    watched.add("kube-apiserver", rig.cp.apiserver_pid());
    watched.add("etcd", rig.cp.etcd_pid());
    watched.add(
        "bench (virtual fleet, writer, watch storm)",
        Some(std::process::id()),
    );

    let workload = Workload::new(args.services, args.endpoints, args.nodes, &rig.node_ips());
    let writer = Writer::new(rig.cp.client(), args.write_concurrency);
    println!(
        "[bench] writing {} Nodes, {} Services and their EndpointSlices ({} in flight)",
        args.nodes,
        args.services + 1,
        args.write_concurrency
    );
    result.workload = writer.write_all(&workload).await?;
    println!(
        "[bench] workload written: {} objects in {:.1} s ({:.0}/s)",
        result.workload.objects, result.workload.seconds, result.workload.objects_per_second
    );

    let fleet_names: Vec<String> = (args.real + 1..args.real + 1 + args.virtual_count())
        .map(node_name)
        .collect();
    println!(
        "[bench] issuing {} virtual node certificates",
        fleet_names.len()
    );
    let fleet_nodes = fleet::issue(&rig.pki, &fleet_names).await?;

    let mut b = Bench {
        args: args.clone(),
        rig,
        writer,
        workload,
        watched,
        notes: Vec::new(),
        npl_all: LatencyHist::default(),
    };
    // A failed cold start (the brain exiting, for one) still leaves a result that says so.
    let alive = match cold::splitproxy(&mut b, fleet_nodes).await {
        Ok(c) => {
            result.cold_start = c;
            true
        }
        Err(e) => {
            println!("[bench] cold start failed: {e:#}");
            b.notes
                .push(format!("cold start failed, no further phase ran: {e:#}"));
            false
        }
    };
    if alive {
        changes_and_watches(&mut b, &args, &mut result).await;
    }
    result.seconds = started.elapsed().as_secs_f64();
    result.targets = crate::report::targets(&result, &b.npl_all.summary());
    result.notes.append(&mut b.notes);
    write_outputs(&args, &mut result, &b.npl_all)?;
    println!("[bench] stopping every component");
    drop(b);
    Ok(result)
}

/// kube-proxy, the change phases and the watch comparison; failures become notes.
async fn changes_and_watches(b: &mut Bench, args: &BenchArgs, result: &mut BenchResult) {
    if !args.skip_kube_proxy {
        match cold::kube_proxy(b).await {
            Ok(k) => result.kube_proxy_cold_start = Some(k),
            Err(e) => b.notes.push(format!("kube-proxy: {e:#}")),
        }
    }

    match single::endpoint_flip(b).await {
        Ok((p, s)) => {
            result.phases.push(p);
            result.single_changes = Some(s);
        }
        Err(e) => b.notes.push(format!("phase endpoint_flip failed: {e:#}")),
    }
    let phases: [(&str, PhaseFn); 3] = [
        ("rolling_update", |b| {
            Box::pin(async { Ok(vec![changes::rolling_update(b).await?]) })
        }),
        ("service_add_delete", |b| {
            Box::pin(async {
                let (a, d) = changes::service_add_delete(b).await?;
                Ok(vec![a, d])
            })
        }),
        ("churn", |b| {
            Box::pin(async { Ok(vec![changes::churn(b).await?]) })
        }),
    ];
    for (name, f) in phases {
        match f(b).await {
            Ok(p) => result.phases.extend(p),
            Err(e) => b.notes.push(format!("phase {name} failed: {e:#}")),
        }
    }
    if !args.skip_floor {
        use crate::floor::Stack;
        for (tls, stack) in [
            (false, Stack::Epoll),
            (true, Stack::Epoll),
            (true, Stack::Tokio),
            (true, Stack::H2),
            (true, Stack::Hyper),
        ] {
            let measured = fanout_floor(result, tls, stack).await;
            let slot = match (tls, stack) {
                (false, Stack::Epoll) => &mut result.floor,
                (_, Stack::Epoll) => &mut result.floor_tls,
                (_, Stack::Tokio) => &mut result.floor_tokio,
                (_, Stack::H2) => &mut result.floor_h2,
                (_, Stack::Hyper) => &mut result.floor_hyper,
            };
            match measured {
                Ok(f) => *slot = Some(f),
                Err(e) => b.notes.push(format!(
                    "fan-out floor ({}) not measured: {e:#}",
                    crate::floor::label(tls, stack)
                )),
            }
        }
    }
    if args.failover() {
        match failover::failover(b).await {
            Ok((p, f)) => {
                result.phases.push(p);
                result.failover = Some(f);
            }
            Err(e) => b.notes.push(format!("phase failover failed: {e:#}")),
        }
    }
    if !args.skip_restart {
        match restart::restart(b, result.cold_start.brain_bytes_sent).await {
            Ok(r) => result.restart = Some(r),
            Err(e) => b.notes.push(format!("phase restart failed: {e:#}")),
        }
    }
    if !args.skip_watch_storm {
        match watches::compare(b).await {
            Ok(w) => result.watches = Some(w),
            Err(e) => b.notes.push(format!("watch comparison failed: {e:#}")),
        }
    }
}

/// The fan-out floor ([`crate::floor`]) to as many nodes as the fleet has, with updates as long
/// as the churn phase's, over bare TCP or TLS, on `stack`: run while the brain and the fleet are
/// idle between phases, in processes of its own (the fleet's streams hold as many descriptors
/// as the floor's).
async fn fanout_floor(
    result: &BenchResult,
    tls: bool,
    stack: crate::floor::Stack,
) -> anyhow::Result<crate::floor::Floor> {
    let churn = crate::report::phase(result, "churn")
        .context("no churn phase to take the update size from")?;
    let update_bytes = match (churn.splitproxy.bytes_sent, churn.splitproxy.updates_sent) {
        (Some(bytes), Some(updates)) if updates > 0.0 => (bytes / updates).round() as usize,
        _ => anyhow::bail!("the churn phase has no update sizes"),
    };
    let nodes = result.config.nodes;
    let over = crate::floor::label(tls, stack);
    println!(
        "[bench] fan-out floor: {nodes} loopback streams, {over}, {update_bytes}-byte updates"
    );
    let f = tokio::task::spawn_blocking(move || {
        crate::floor::measure_apart(
            nodes,
            update_bytes,
            FLOOR_ACK_BYTES,
            FLOOR_ROUNDS,
            tls,
            stack,
        )
    })
    .await??;
    println!(
        "[bench]   floor, {over}: {:.1} µs CPU per update on the sending side, {:.1} µs on the nodes' side; a round to every node {:.1} ms (worst {:.1} ms)",
        f.brain_cpu_per_update * 1e6,
        f.node_cpu_per_update * 1e6,
        f.round_mean_seconds * 1e3,
        f.round_max_seconds * 1e3
    );
    Ok(f)
}

/// An ack as a node sends it: the `Ack` message, its gRPC prefix, the HTTP/2 frame header.
const FLOOR_ACK_BYTES: usize = 48;
/// Rounds of the floor measurement (each an update to every node and its ack). 20 rounds at
/// 5,000 nodes (a second of CPU) moved by half from one run to the next on this machine; 100
/// (about 4 s over TCP, 8 over TLS, 13 on tokio and 20 with HTTP/2) stayed within 10 %.
const FLOOR_ROUNDS: usize = 100;

type PhaseFn = for<'a> fn(
    &'a mut Bench,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = anyhow::Result<Vec<crate::results::Phase>>> + 'a>,
>;

/// The JSON result, the plots and the report.
fn write_outputs(
    args: &BenchArgs,
    r: &mut BenchResult,
    npl_all: &LatencyHist,
) -> anyhow::Result<()> {
    let plots = match crate::plots::draw_all(r, npl_all, &args.out) {
        Ok(p) => p,
        Err(e) => {
            r.notes.push(format!("plots skipped: {e:#}"));
            Vec::new()
        }
    };
    let json = args.out.join("result.json");
    std::fs::write(&json, serde_json::to_vec_pretty(r)?)
        .with_context(|| format!("writing {}", json.display()))?;
    println!("[bench] wrote {}", json.display());
    write_report(&args.report, &args.out, r, &plots)?;
    println!("[bench] wrote {}", args.report.display());
    for t in &r.targets {
        println!(
            "[bench] target {}: {} (target {}; kube-proxy {}){}",
            t.figure,
            t.measured,
            t.target,
            t.kube_proxy,
            match (t.met, &t.under_floor) {
                (Some(true), _) => " met",
                (Some(false), Some(_)) => " MISSED, under this machine's floor",
                (Some(false), None) => " MISSED",
                (None, _) => "",
            }
        );
    }
    Ok(())
}

fn write_report(
    report: &Path,
    out: &Path,
    r: &BenchResult,
    plots: &[String],
) -> anyhow::Result<()> {
    if let Some(dir) = report.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let rel = crate::report::relative(report, out);
    std::fs::write(report, crate::report::markdown(r, &rel, plots))
        .with_context(|| format!("writing {}", report.display()))
}
