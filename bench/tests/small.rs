//! The whole benchmark at small scale (200 Services x 5 endpoints, 50 nodes: 2 real actuators,
//! kube-proxy, 47 virtual nodes), so that it cannot rot: every phase must produce figures for
//! every node, kube-proxy must sync, and the JSON result, the report and the plots must be
//! written. Runs the real binary as a child, bounded in time, writing into a temp dir.
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(300);

/// Runs the bench binary with `args` into a temp dir, bounded by `limit`; returns the JSON
/// result, the report and the printed lines.
fn run_bench(args: &[&str], limit: Duration) -> (serde_json::Value, String, Vec<String>) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the benchmark creates network namespaces: run the tests as root (tools/test.sh)"
    );
    let dir = tempfile::Builder::new()
        .prefix("splitproxy-bench-test-")
        .tempdir()
        .unwrap();
    let out = dir.path().join("out");
    let report = dir.path().join("RESULTS.md");
    let mut child = Command::new(env!("CARGO_BIN_EXE_splitproxy-bench"))
        .args(args)
        .arg("--out")
        .arg(&out)
        .arg("--report")
        .arg(&report)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the bench binary starts");
    let stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::{BufRead, BufReader};
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            println!("{line}");
            lines.push(line);
        }
        lines
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            // SIGTERM lets the bench stop its components and remove its namespaces.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            std::thread::sleep(Duration::from_secs(10));
            let _ = child.kill();
            let _ = child.wait();
            panic!("the small benchmark took more than {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let lines = reader.join().unwrap();
    assert!(status.success(), "the bench failed: {status}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("result.json")).unwrap()).unwrap();
    let md = std::fs::read_to_string(&report).unwrap();
    for png in ["npl_cdf.png", "apply_times.png"] {
        let bytes = std::fs::read(out.join(png)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{png} is a PNG");
    }
    (json, md, lines)
}

#[test]
fn small_scale_run_measures_every_phase_on_every_node() {
    let (json, md, lines) = run_bench(
        &[
            "--services",
            "200",
            "--endpoints",
            "5",
            "--nodes",
            "50",
            "--real",
            "2",
            "--virtual",
            "47",
            "--single-changes",
            "5",
            "--churn-seconds",
            "5",
            "--storm-seconds",
            "5",
            "--phase-timeout-seconds",
            "60",
            "--kube-proxy-timeout-seconds",
            "120",
        ],
        LIMIT,
    );
    assert!(
        lines.first().is_some_and(|l| l.contains("--services 200")),
        "the command is printed first"
    );

    for field in [
        "command",
        "started_at",
        "seconds",
        "versions",
        "machine",
        "config",
        "workload",
        "cold_start",
        "kube_proxy_cold_start",
        "phases",
        "watches",
        "targets",
        "notes",
    ] {
        assert!(
            !json[field].is_null(),
            "result.json lacks {field}: {json:#}"
        );
    }
    assert!(json["command"].as_str().unwrap().contains("--virtual 47"));
    assert_eq!(json["workload"]["nodes"], 50);
    assert_eq!(json["workload"]["services"], 201);

    let cold = &json["cold_start"];
    assert!(cold["brain_ready_seconds"].is_number(), "{cold:#}");
    assert!(cold["fleet_in_sync_seconds"].is_number(), "{cold:#}");
    assert!(cold["all_in_sync_seconds"].is_number(), "{cold:#}");
    assert_eq!(cold["real_first_apply"].as_object().unwrap().len(), 2);
    assert!(cold["brain_watches"].as_f64().unwrap() >= 1.0);
    // The snapshot's large parts went compressed, and the real actuators applied them (their
    // first apply above, the digest checked).
    assert!(
        cold["brain_compressed_parts"].as_f64().unwrap() >= 1.0,
        "{cold:#}"
    );

    let kp = &json["kube_proxy_cold_start"];
    assert!(
        kp["first_sync_seconds"].is_number(),
        "kube-proxy synced: {kp:#}"
    );
    assert!(kp["watches"].as_f64().unwrap() >= 2.0, "{kp:#}");

    let phases = json["phases"].as_array().unwrap();
    let names: Vec<&str> = phases.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "endpoint_flip",
            "rolling_update",
            "service_add",
            "service_delete",
            "churn"
        ]
    );
    for p in phases {
        let name = p["name"].as_str().unwrap();
        let sp = &p["splitproxy"];
        assert_eq!(sp["nodes_total"], 49, "{name}");
        assert_eq!(
            sp["nodes_with_samples"], 49,
            "{name}: latency samples from every node: {sp:#}"
        );
        assert!(sp["npl"]["n"].as_u64().unwrap() >= 47, "{name}: {sp:#}");
        assert!(sp["npl"]["p99"].is_number(), "{name}");
        assert!(
            p["converged_seconds"].is_number(),
            "{name} converged: {p:#}"
        );
        assert_eq!(sp["real_apply"].as_object().unwrap().len(), 2, "{name}");
        let kp = &p["kube_proxy"];
        assert_eq!(
            kp["caught_up"], true,
            "{name}: kube-proxy caught up: {kp:#}"
        );
        assert!(
            kp["sync"]["count"].as_f64().unwrap() >= 1.0,
            "{name}: {kp:#}"
        );
        if name != "service_delete" {
            assert!(
                kp["npl"]["count"].as_f64().unwrap() >= 1.0,
                "{name}: {kp:#}"
            );
        }
        assert!(p["processes"]["brain"]["peak_rss_bytes"].as_u64().unwrap() > 0);
    }
    let w = &json["watches"];
    assert_eq!(w["storm_requested"], 150);
    assert_eq!(w["storm_established"], 150, "{w:#}");
    assert!(
        w["storm"]["watches"].as_f64().unwrap()
            >= w["baseline"]["watches"].as_f64().unwrap() + 150.0,
        "{w:#}"
    );
    assert!(json["targets"].as_array().unwrap().len() >= 8);

    // The fan-out floor ran to as many streams as nodes, with the churn phase's update size.
    let floor = &json["floor"];
    assert_eq!(floor["nodes"], 50, "{floor:#}");
    assert!(floor["update_bytes"].as_u64().unwrap() > 0, "{floor:#}");
    assert!(
        floor["round_mean_seconds"].as_f64().unwrap() > 0.0,
        "{floor:#}"
    );
    assert!(
        floor["brain_cpu_per_update"].as_f64().unwrap() >= 0.0,
        "{floor:#}"
    );
    assert_eq!(floor["tls"], false, "{floor:#}");
    // And again over TLS, reported beside it.
    let tls = &json["floor_tls"];
    assert_eq!(tls["tls"], true, "{tls:#}");
    assert_eq!(tls["nodes"], 50, "{tls:#}");
    assert_eq!(tls["update_bytes"], floor["update_bytes"], "{tls:#}");
    assert!(tls["round_mean_seconds"].as_f64().unwrap() > 0.0, "{tls:#}");
    // And on tokio, without and with HTTP/2: every floor a row of the report's table.
    for (key, stack) in [
        ("floor_tokio", "tokio"),
        ("floor_h2", "h2"),
        ("floor_hyper", "hyper"),
    ] {
        let f = &json[key];
        assert_eq!(
            (&f["tls"], &f["stack"]),
            (&true.into(), &stack.into()),
            "{f:#}"
        );
        assert_eq!(f["nodes"], 50, "{f:#}");
        assert_eq!(f["update_bytes"], floor["update_bytes"], "{f:#}");
        assert!(f["node_cpu_per_update"].as_f64().unwrap() > 0.0, "{f:#}");
    }
    for row in [
        "bare TCP",
        "TLS",
        "TLS on tokio",
        "TLS, tokio and HTTP/2",
        "TLS, tokio and hyper's HTTP/2 server",
    ] {
        assert!(md.contains(&format!("| floor, {row} | ")), "{row}: {md}");
    }
    // The binary says which commit it was built from.
    assert!(
        !json["versions"]["build_commit"]
            .as_str()
            .unwrap()
            .is_empty(),
        "{:#}",
        json["versions"]
    );

    // Single changes as distributions: every node's sample of every change.
    let single = &json["single_changes"];
    assert_eq!(single["changes"], 5, "{single:#}");
    assert!(single["npl"]["n"].as_u64().unwrap() >= 5 * 49, "{single:#}");
    assert_eq!(
        single["npl_real"]["n"], 10,
        "2 real nodes x 5 changes: {single:#}"
    );
    assert_eq!(single["real_per_change"]["n"], 5, "{single:#}");
    assert!(
        single["real_apply"]["n"].as_u64().unwrap() >= 5,
        "{single:#}"
    );
    assert!(single["real_apply"]["p99"].is_number(), "{single:#}");
    assert_eq!(single["kube_proxy_exact"]["n"], 5, "{single:#}");
    // One brain, no failover; the restart resumes every node without a snapshot.
    assert!(json["failover"].is_null());
    check_restart(&json, 49);

    assert!(
        md.contains("--services 200")
            && md.contains("## Targets")
            && md.contains("## Single changes")
            && md.contains("## Restart"),
        "{md}"
    );
}

/// The restart phase: every node in sync again, no snapshot, a small fraction of a full
/// resync's bytes.
fn check_restart(json: &serde_json::Value, nodes: u64) {
    let r = &json["restart"];
    assert!(r["all_in_sync_seconds"].is_number(), "{r:#}");
    assert_eq!(
        r["snapshots_sent"], 0.0,
        "no snapshot after a restart: {r:#}"
    );
    assert_eq!(r["virtual_snapshots"], 0, "{r:#}");
    assert_eq!(r["real_snapshots_applied"], 0.0, "{r:#}");
    let sessions: f64 = r["resumptions"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .sum();
    assert!(sessions >= nodes as f64, "every node resumed: {r:#}");
    assert_eq!(r["resumptions"]["snapshot"], 0.0, "{r:#}");
    assert!(
        r["bytes_ratio"].as_f64().unwrap() <= 0.01,
        "at most 1 % of a full resync: {r:#}"
    );
}

/// Two brain replicas at tiny scale: nodes spread over both, one killed during churn (its
/// nodes back in sync on the other, resumed by content or by restating deltas, never by a
/// snapshot, no connection lost on the real nodes), then both restarted. The churn is written
/// in two bursts a second (`--churn-bursts`). kube-proxy and the watch comparison are left to
/// the test above.
#[test]
fn two_brains_fail_over_and_restart_without_snapshots() {
    let (json, md, _) = run_bench(
        &[
            "--services",
            "50",
            "--endpoints",
            "3",
            "--nodes",
            "20",
            "--real",
            "2",
            "--virtual",
            "17",
            "--brains",
            "2",
            "--single-changes",
            "3",
            "--churn-seconds",
            "2",
            "--churn-bursts",
            "2",
            "--failover-seconds",
            "4",
            "--skip-kube-proxy",
            "--skip-watch-storm",
            "--phase-timeout-seconds",
            "30",
        ],
        Duration::from_secs(150),
    );
    assert_eq!(json["config"]["brains"], 2);
    let cold = &json["cold_start"];
    let per_replica: Vec<u64> = cold["connected_per_replica"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(per_replica.len(), 2, "{cold:#}");
    assert!(
        per_replica.iter().all(|n| *n >= 5),
        "nodes spread: {cold:#}"
    );
    assert_eq!(per_replica.iter().sum::<u64>(), 19, "{cold:#}");
    assert!(
        cold["brain_watches"].as_f64().unwrap() >= 6.0,
        "each replica watches the API: {cold:#}"
    );
    assert!(
        cold["processes"]["brain-0"]["peak_rss_bytes"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(
        cold["processes"]["brain-1"]["peak_rss_bytes"]
            .as_u64()
            .unwrap()
            > 0
    );

    let names: Vec<&str> = json["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"failover"), "{names:?}");
    let f = &json["failover"];
    assert!(f["moved_nodes"].as_u64().unwrap() >= 5, "{f:#}");
    assert!(
        f["moved_real"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("node-0")),
        "the client's node moved: {f:#}"
    );
    assert_eq!(f["not_back"], 0, "{f:#}");
    assert!(f["back_in_sync_seconds"].as_f64().unwrap() < 10.0, "{f:#}");
    assert_eq!(f["snapshots_received"], 0, "resumed by content: {f:#}");
    assert_eq!(f["real_snapshots_applied"], 0.0, "{f:#}");
    assert_eq!(f["snapshots_sent"], 0.0, "{f:#}");
    let resumed = f["resumptions"]["by_content"].as_f64().unwrap()
        + f["resumptions"]["restated"].as_f64().unwrap();
    assert!(resumed >= f["moved_nodes"].as_f64().unwrap(), "{f:#}");
    assert!(
        f["moved_bytes_per_node"].as_f64().unwrap()
            < f["full_snapshot_bytes_per_node"].as_f64().unwrap(),
        "less than a snapshot each: {f:#}"
    );
    assert!(f["npl_moved"]["n"].as_u64().unwrap() > 0, "{f:#}");
    let c = &f["connections"];
    assert!(c["attempted"].as_u64().unwrap() > 20, "{c:#}");
    assert_eq!(c["failed"], 0, "no connection lost: {c:#}");
    check_restart(&json, 19);
    assert!(
        md.contains("## Failover") && md.contains("## Restart"),
        "{md}"
    );
}
