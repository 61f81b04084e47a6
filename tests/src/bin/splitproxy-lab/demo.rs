//! `demo`: a lab with demo Services and live traffic through their ClusterIPs.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cli::UpArgs;
use splitproxy_tests::probe::Proto;

use crate::control::{self, Request, describe};

/// The demo objects, shipped with the source.
fn demo_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/lab/demo"))
}

pub fn run(state_dir: &Path, mut up: UpArgs) -> anyhow::Result<()> {
    if control::call(state_dir, &Request::Status).is_err() {
        up.detach = true;
        crate::supervisor::up(state_dir, up)?;
    } else {
        eprintln!("a lab is already running; applying the demo to it");
    }
    let dir = demo_dir();
    println!("\n$ splitproxy-lab apply {}", dir.display());
    control::apply(state_dir, &dir)?;
    let client = Request::AddPod {
        node: "node-0".into(),
        name: "client".into(),
        ips: vec!["10.244.0.100".parse()?, "fd00:244::100".parse()?],
        tcp: vec![],
        udp: vec![],
    };
    control::call(state_dir, &client)?;
    println!("created pod client (10.244.0.100, fd00:244::100) on node-0");

    // The rules reach every node within moments, the demo's objects possibly in several
    // publications (the chart's brains space them 200 ms apart): wait until the first and the
    // last of them show, bounded.
    let deadline = Instant::now() + Duration::from_secs(15);
    let first_and_last = [
        (probe("10.96.0.100:80", false, 1), "answered"),
        (probe("10.96.0.53:53", true, 1), "answered"),
        (probe("10.96.0.200:80", false, 1), "refused"),
    ];
    for (request, expected) in &first_and_last {
        while Instant::now() < deadline {
            let v = control::call(state_dir, request)?;
            if v["results"][0]["result"] == *expected {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    show(
        state_dir,
        "ClusterIP hello (TCP, 3 endpoints on 3 nodes)",
        "10.96.0.100:80",
        false,
        6,
    )?;
    show(
        state_dir,
        "ClusterIP dns (UDP, 2 endpoints)",
        "10.96.0.53:53",
        true,
        4,
    )?;
    show(
        state_dir,
        "legacy-api has no endpoints: refused at once",
        "10.96.0.200:80",
        false,
        1,
    )?;
    show(
        state_dir,
        "a port hello does not have: refused",
        "10.96.0.100:8080",
        false,
        1,
    )?;
    show(
        state_dir,
        "an unallocated address in the service CIDR: dropped",
        "10.96.0.99:80",
        false,
        1,
    )?;

    let status = control::call(state_dir, &Request::Status)?;
    let grpcurl = status["grpcurl"].as_str().unwrap_or_default();
    let base = grpcurl.trim_end_matches(" list");
    let exe = std::env::current_exe()?;
    let sd = state_dir.display();
    println!("\nThe brain, through gRPC reflection:");
    println!("  {grpcurl}");
    println!("  {base} splitproxy.v1.Dataplane/ListNodes");
    println!(
        "  {} -d '{{\"node\":\"node-0\"}}' {} splitproxy.v1.Dataplane/GetNodeRuleset",
        base.rsplit_once(' ').map(|(a, _)| a).unwrap_or(base),
        base.rsplit(' ').next().unwrap_or("")
    );
    println!("\nThe lab keeps running. Try:");
    println!(
        "  {} --state-dir {sd} probe --from client 10.96.0.100:80 --count 5",
        exe.display()
    );
    println!(
        "  {} --state-dir {sd} probe --from external 10.96.0.100:80",
        exe.display()
    );
    println!(
        "  {} --state-dir {sd} http --from external http://192.168.77.10:10256/healthz",
        exe.display()
    );
    println!("  {} --state-dir {sd} apply DIR_OF_YAML", exe.display());
    println!("  {} --state-dir {sd} status", exe.display());
    println!("  {} --state-dir {sd} down", exe.display());
    println!(
        "  kubectl --kubeconfig {} get svc,endpointslices -A",
        status["kubeconfig"].as_str().unwrap_or_default()
    );
    println!(
        "\nScenarios to replay (up --scenario DIR --probe): {}",
        concat!(env!("CARGO_MANIFEST_DIR"), "/lab/scenarios/README.md")
    );
    Ok(())
}

fn probe(dst: &str, udp: bool, count: usize) -> Request {
    Request::Probe {
        from: "client".into(),
        protocol: if udp { Proto::Udp } else { Proto::Tcp },
        dst: dst.parse().expect("constant address"),
        count,
        source_port: 0,
        timeout_ms: 1000,
    }
}

fn show(state_dir: &Path, title: &str, dst: &str, udp: bool, count: usize) -> anyhow::Result<()> {
    let proto = if udp { "udp" } else { "tcp" };
    println!(
        "\n# {title}\n$ splitproxy-lab probe --from client{} {dst}{}",
        if udp { " --udp" } else { "" },
        if count > 1 {
            format!(" --count {count}")
        } else {
            String::new()
        }
    );
    let v = control::call(state_dir, &probe(dst, udp, count))?;
    for r in v["results"].as_array().into_iter().flatten() {
        println!("client -> {proto} {dst}: {}", describe(r));
    }
    Ok(())
}
