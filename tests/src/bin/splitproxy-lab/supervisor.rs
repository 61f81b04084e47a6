//! `up`: the lab's supervisor. It owns the whole lab (processes, namespaces, pods) and serves the
//! control socket until `down`, SIGTERM or Ctrl-C, then tears everything down.
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use splitproxy_tests::lab::{Lab, LabOptions};
use splitproxy_tests::probe::{ProbeResult, Proto, probe_async};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

use crate::cli::UpArgs;
use crate::control::{self, Request};

pub fn up(state_dir: &Path, args: UpArgs) -> anyhow::Result<()> {
    if args.detach {
        return detach(state_dir, &args);
    }
    std::fs::create_dir_all(state_dir)?;
    let sock = control::socket_path(state_dir);
    if sock.exists() {
        if control::call(state_dir, &Request::Status).is_ok() {
            bail!(
                "a lab is already running (state in {}); `down` first",
                state_dir.display()
            );
        }
        std::fs::remove_file(&sock)?;
    }
    let rt = crate::runtime()?;
    let result = rt.block_on(supervise(state_dir, &args));
    let _ = std::fs::remove_file(&sock);
    result
}

/// Starts the supervisor in the background and waits until it answers.
fn detach(state_dir: &Path, args: &UpArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(state_dir)?;
    let log = state_dir.join("lab.log");
    let out = std::fs::File::create(&log)?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .arg("--state-dir")
        .arg(state_dir)
        .arg("up")
        .arg("--nodes")
        .arg(args.nodes.to_string())
        .arg("--brains")
        .arg(args.brains.to_string())
        .arg("--service-cidr")
        .arg(&args.service_cidr)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0)
        .spawn()
        .context("starting the lab supervisor")?;
    eprintln!("starting the lab (log: {}) ...", log.display());
    for _ in 0..1800 {
        if let Some(status) = child.try_wait()? {
            bail!(
                "the lab supervisor exited ({status}); see {}",
                log.display()
            );
        }
        if control::call(state_dir, &Request::Status).is_ok() {
            eprintln!("lab is up (supervisor pid {})", child.id());
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    bail!(
        "the lab did not come up in 3 minutes; see {}",
        log.display()
    )
}

use std::os::unix::process::CommandExt;

async fn supervise(state_dir: &Path, args: &UpArgs) -> anyhow::Result<()> {
    let mut opts = LabOptions::new(std::env::current_exe()?);
    opts.nodes = args.nodes;
    opts.brains = args.brains;
    opts.service_cidr = args.service_cidr.clone();
    opts.brain.service_cidrs = vec![args.service_cidr.clone()];
    opts.dir = Some(state_dir.join("run"));
    eprintln!(
        "bringing up etcd, kube-apiserver, {} brain(s) and {} node(s) ...",
        args.brains, args.nodes
    );
    let lab = Lab::start(opts).await?;
    let listener = UnixListener::bind(control::socket_path(state_dir))?;
    eprintln!("{}", serde_json::to_string_pretty(&status(&lab))?);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            conn = listener.accept() => {
                let (stream, _) = conn?;
                if handle(&lab, stream).await {
                    break;
                }
            }
        }
    }
    eprintln!("tearing the lab down ...");
    drop(lab);
    Ok(())
}

/// Serves one request; true when the lab should go down.
async fn handle(lab: &Lab, stream: tokio::net::UnixStream) -> bool {
    let (r, w) = stream.into_split();
    let mut line = String::new();
    if BufReader::new(r).read_line(&mut line).await.is_err() {
        return false;
    }
    let (answer, down) = match serde_json::from_str::<Request>(&line) {
        Err(e) => (
            serde_json::json!({"error": format!("bad request: {e}")}),
            false,
        ),
        Ok(Request::Down) => (serde_json::json!({"ok": true}), true),
        Ok(Request::Status) => (status(lab), false),
        Ok(Request::Apply { path }) => match lab.apply_path(&path).await {
            Ok(applied) => (serde_json::json!({"ok": true, "applied": applied}), false),
            Err(e) => (serde_json::json!({"error": format!("{e:#}")}), false),
        },
        Ok(Request::AddPod {
            node,
            name,
            ip,
            tcp,
            udp,
        }) => {
            let Some(i) = lab.cluster.nodes().iter().position(|n| n.name() == node) else {
                return reply(
                    w,
                    serde_json::json!({"error": format!("no node {node:?}")}),
                    false,
                )
                .await;
            };
            match lab.ensure_pod(
                i,
                &name,
                ip,
                &tcp.into_iter().collect(),
                &udp.into_iter().collect(),
            ) {
                Ok(_) => (serde_json::json!({"ok": true}), false),
                Err(e) => (serde_json::json!({"error": format!("{e:#}")}), false),
            }
        }
        Ok(Request::Probe {
            from,
            udp,
            dst,
            count,
            timeout_ms,
        }) => (probe(lab, &from, udp, dst, count, timeout_ms).await, false),
    };
    reply(w, answer, down).await
}

async fn reply(
    mut w: tokio::net::unix::OwnedWriteHalf,
    answer: serde_json::Value,
    down: bool,
) -> bool {
    let mut text = answer.to_string();
    text.push('\n');
    let _ = w.write_all(text.as_bytes()).await;
    down
}

async fn probe(
    lab: &Lab,
    from: &str,
    udp: bool,
    dst: std::net::SocketAddr,
    count: usize,
    timeout_ms: u64,
) -> serde_json::Value {
    let Some((origin, src)) = resolve(lab, from) else {
        return serde_json::json!({"error": format!("{from:?} is neither a pod, a node nor an address of one")});
    };
    let ns = match &origin {
        Origin::Pod(p) => p.netns(),
        Origin::Node(i) => lab.cluster.node(*i).netns(),
    };
    let proto = if udp { Proto::Udp } else { Proto::Tcp };
    let mut results = Vec::new();
    for _ in 0..count.clamp(1, 1000) {
        let r = probe_async(
            ns,
            proto,
            dst,
            src,
            Duration::from_millis(timeout_ms.clamp(10, 30_000)),
        )
        .await;
        results.push(flat(&r));
    }
    serde_json::json!({"ok": true, "results": results})
}

enum Origin {
    Pod(splitproxy_tests::Pod),
    Node(usize),
}

/// Where a probe starts from, by pod or node name or address, and the source address to bind.
fn resolve(lab: &Lab, from: &str) -> Option<(Origin, Option<std::net::IpAddr>)> {
    let ip: Option<std::net::IpAddr> = from.parse().ok();
    if let Some(pod) = lab
        .cluster
        .pods()
        .into_iter()
        .find(|p| p.name() == from || ip == Some(p.ip().into()))
    {
        return Some((Origin::Pod(pod), ip));
    }
    let node = lab
        .cluster
        .nodes()
        .iter()
        .position(|n| n.name() == from || ip == Some(n.ip().into()))?;
    Some((Origin::Node(node), ip))
}

pub fn flat(r: &ProbeResult) -> serde_json::Value {
    match r {
        ProbeResult::Answered { pod, seen_source } => {
            serde_json::json!({"result": "answered", "pod": pod, "seen_source": seen_source.to_string()})
        }
        ProbeResult::Refused => serde_json::json!({"result": "refused"}),
        ProbeResult::TimedOut => serde_json::json!({"result": "timed_out"}),
        ProbeResult::Unreachable(d) => serde_json::json!({"result": "unreachable", "detail": d}),
        ProbeResult::Error(d) => serde_json::json!({"result": "error", "detail": d}),
    }
}

pub fn status(lab: &Lab) -> serde_json::Value {
    let b = lab.brain(0);
    let op = &lab.operator_tls;
    serde_json::json!({
        "kubeconfig": lab.cp.kubeconfig_path(),
        "apiserver": lab.cp.url(),
        "brains": lab.brains.iter().flatten().map(|b| serde_json::json!({"grpc": b.grpc.to_string(), "metrics": format!("http://{}/metrics", b.metrics)})).collect::<Vec<_>>(),
        "nodes": lab.cluster.nodes().iter().map(|n| serde_json::json!({"name": n.name(), "ip": n.ip().to_string(), "pod_cidr": n.pod_cidr().to_string(), "netns": n.netns().name()})).collect::<Vec<_>>(),
        "pods": lab.cluster.pods().iter().map(|p| serde_json::json!({"name": p.name(), "ip": p.ip().to_string(), "node": p.node(), "netns": p.netns().name()})).collect::<Vec<_>>(),
        "logs": lab.dir(),
        "grpcurl": format!(
            "{} -cacert {} -cert {} -key {} {} list",
            splitproxy_tests::tools::cached_path("grpcurl").display(),
            op.ca.display(), op.cert.display(), op.key.display(), b.grpc
        ),
    })
}
