//! The fan-out floor in processes of its own (`splitproxy-bench floor`), where one process
//! could not hold both sides: under an open-file limit of 512, 300 streams (600 descriptors)
//! fit only with each side in its own process, as 10,000 nodes fit under this machine's hard
//! limit of 20,000 only that way. Loopback only, bounded by the floor's own time limit.
use std::process::{Command, Output};

/// `splitproxy-bench floor` to 300 streams, 3 rounds, under an open-file limit of `limit`,
/// with `extra` flags.
fn floor_under(limit: u32, extra: &str) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            r#"ulimit -n {limit} && exec "$0" floor --nodes 300 --update-bytes 3000 --ack-bytes 48 --rounds 3 {extra}"#
        ))
        .arg(env!("CARGO_BIN_EXE_splitproxy-bench"))
        .output()
        .unwrap()
}

#[test]
fn each_side_of_the_floor_holds_only_its_own_streams() {
    measured_under_512("", false);
}

/// Over TLS the nodes' process trusts the certificate the sending process made and passed on.
#[test]
fn the_floor_over_tls_runs_apart_too() {
    measured_under_512("--tls", true);
}

/// On tokio with HTTP/2 both processes run the same stack, and its streams are TLS too.
#[test]
fn the_floor_on_tokio_and_http2_runs_apart_too() {
    let floor = measured_under_512("--stack h2", true);
    assert_eq!(floor["stack"], "h2", "{floor:#}");
}

fn measured_under_512(extra: &str, tls: bool) -> serde_json::Value {
    let out = floor_under(512, extra);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    let floor: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(floor["tls"], tls, "{floor:#}");
    assert_eq!(floor["nodes"], 300, "{floor:#}");
    assert_eq!(floor["rounds"], 3, "{floor:#}");
    assert_eq!(floor["update_bytes"], 3000, "{floor:#}");
    // Both sides' CPU is counted: the nodes' side's comes back from its own process.
    assert!(
        floor["round_mean_seconds"].as_f64().unwrap() > 0.0,
        "{floor:#}"
    );
    assert!(
        floor["node_cpu_per_update"].as_f64().unwrap() > 0.0,
        "{floor:#}"
    );
    assert!(
        floor["brain_cpu_per_update"].as_f64().unwrap() > 0.0,
        "{floor:#}"
    );
    floor
}

#[test]
fn a_side_that_cannot_open_its_streams_fails_the_measurement_with_the_reason() {
    // 64 descriptors cannot hold 300 streams on either side.
    let out = floor_under(64, "");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("Too many open files"), "{stderr}");
}
