//! The whole benchmark at small scale (200 Services x 5 endpoints, 50 nodes: 2 real actuators,
//! kube-proxy, 47 virtual nodes), so that it cannot rot: every phase must produce figures for
//! every node, kube-proxy must sync, and the JSON result, the report and the plots must be
//! written. Runs the real binary as a child, bounded in time, writing into a temp dir.
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(300);

#[test]
fn small_scale_run_measures_every_phase_on_every_node() {
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
        .args([
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
            "--churn-seconds",
            "5",
            "--storm-seconds",
            "5",
            "--phase-timeout-seconds",
            "60",
            "--kube-proxy-timeout-seconds",
            "120",
        ])
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
        if started.elapsed() > LIMIT {
            // SIGTERM lets the bench stop its components and remove its namespaces.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            std::thread::sleep(Duration::from_secs(10));
            let _ = child.kill();
            let _ = child.wait();
            panic!("the small benchmark took more than {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let lines = reader.join().unwrap();
    assert!(status.success(), "the bench failed: {status}");
    assert!(
        lines.first().is_some_and(|l| l.contains("--services 200")),
        "the command is printed first"
    );

    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("result.json")).unwrap()).unwrap();
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

    let md = std::fs::read_to_string(&report).unwrap();
    assert!(
        md.contains("--services 200") && md.contains("## Targets"),
        "{md}"
    );
    for png in ["npl_cdf.png", "apply_times.png"] {
        let bytes = std::fs::read(out.join(png)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{png} is a PNG");
    }
}
