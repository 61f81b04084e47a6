//! `up`: the lab's supervisor. It owns the whole lab (processes, namespaces, pods) and serves the
//! control socket until `down`, SIGTERM or Ctrl-C, then tears everything down.
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use splitproxy_tests::lab::{ExternalSpec, Lab, LabOptions};
use splitproxy_tests::scenario::{ReplayOptions, Scenario, load_probes};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

use crate::cli::UpArgs;
use crate::control::{self, Request};

pub fn up(state_dir: &Path, mut args: UpArgs) -> anyhow::Result<()> {
    if let Some(dir) = &args.scenario {
        args.scenario = Some(
            std::fs::canonicalize(dir).with_context(|| format!("scenario {}", dir.display()))?,
        );
    }
    if args.detach {
        detach(state_dir, &args)?;
        if args.probe {
            let scenario = args.scenario.clone().context("--probe needs --scenario")?;
            let v = control::call(
                state_dir,
                &Request::Replay {
                    path: scenario,
                    apply: false,
                    settle_ms: 10_000,
                },
            )?;
            control::print_reports(&v, args.json)?;
        }
        return Ok(());
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
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.arg("--state-dir").arg(state_dir).arg("up");
    if let Some(n) = args.nodes {
        cmd.arg("--nodes").arg(n.to_string());
    }
    if let Some(b) = args.brains {
        cmd.arg("--brains").arg(b.to_string());
    }
    if let Some(s) = &args.service_cidr {
        cmd.arg("--service-cidr").arg(s);
    }
    if let Some(dir) = &args.scenario {
        cmd.arg("--scenario").arg(dir);
    }
    let mut child = cmd
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

/// Lab options from the command line and the scenario's lab.yaml (the command line wins).
fn options(state_dir: &Path, args: &UpArgs) -> anyhow::Result<(LabOptions, Option<Scenario>)> {
    let mut opts = LabOptions::new(std::env::current_exe()?);
    opts.nodes = 3;
    opts.dir = Some(state_dir.join("run"));
    let scenario = match &args.scenario {
        Some(dir) => Some(Scenario::load(dir)?),
        None => None,
    };
    if let Some(s) = &scenario {
        opts = s.lab_options(opts)?;
    }
    if let Some(n) = args.nodes {
        opts.nodes = n;
        opts.node_specs.clear();
    }
    if let Some(b) = args.brains {
        opts.brains = b;
    }
    if let Some(s) = &args.service_cidr {
        opts.service_cidrs = s
            .split(',')
            .map(|c| {
                c.trim()
                    .parse()
                    .with_context(|| format!("service CIDR {c:?}"))
            })
            .collect::<anyhow::Result<_>>()?;
    }
    Ok((opts, scenario))
}

async fn supervise(state_dir: &Path, args: &UpArgs) -> anyhow::Result<()> {
    let (opts, scenario) = options(state_dir, args)?;
    eprintln!(
        "bringing up etcd, kube-apiserver, {} brain(s) and {} node(s) ...",
        opts.brains,
        opts.effective_nodes().len()
    );
    let lab = Arc::new(Lab::start(opts).await?);
    if let Some(s) = &scenario {
        eprintln!("applying scenario {} ...", s.dir.display());
        for applied in lab.apply_scenario(s).await? {
            eprintln!("applied {applied}");
        }
        if args.probe {
            let reports = lab.replay(&s.probes, &ReplayOptions::default()).await;
            let v = serde_json::json!({"ok": true, "reports": reports});
            if let Err(err) = control::print_reports(&v, args.json) {
                eprintln!("{err:#}");
            }
        }
    }
    let listener = UnixListener::bind(control::socket_path(state_dir))?;
    eprintln!("{}", serde_json::to_string_pretty(&status(&lab))?);
    let signal = splitproxy_proto::process::shutdown_signal();
    tokio::pin!(signal);
    let (down_tx, mut down_rx) = tokio::sync::mpsc::channel::<()>(1);
    loop {
        tokio::select! {
            _ = &mut signal => break,
            _ = down_rx.recv() => break,
            conn = listener.accept() => {
                let (stream, _) = conn?;
                let lab = lab.clone();
                let down = down_tx.clone();
                tokio::spawn(async move {
                    if handle(&lab, stream).await {
                        let _ = down.send(()).await;
                    }
                });
            }
        }
    }
    eprintln!("tearing the lab down ...");
    // Requests still running hold clones; give them a moment, then drop what is left.
    for _ in 0..50 {
        if Arc::strong_count(&lab) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(lab);
    Ok(())
}

fn error(e: anyhow::Error) -> serde_json::Value {
    serde_json::json!({"error": format!("{e:#}")})
}

/// Serves one request; true when the lab should go down.
async fn handle(lab: &Lab, stream: tokio::net::UnixStream) -> bool {
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    if BufReader::new(r).read_line(&mut line).await.is_err() {
        return false;
    }
    let request = match serde_json::from_str::<Request>(&line) {
        Ok(request) => request,
        Err(e) => {
            let answer = serde_json::json!({"error": format!("bad request: {e}")});
            let _ = w.write_all(format!("{answer}\n").as_bytes()).await;
            return false;
        }
    };
    let down = matches!(request, Request::Down);
    let answer = answer(lab, request).await.unwrap_or_else(error);
    let _ = w.write_all(format!("{answer}\n").as_bytes()).await;
    down
}

async fn answer(lab: &Lab, request: Request) -> anyhow::Result<serde_json::Value> {
    Ok(match request {
        Request::Down => serde_json::json!({"ok": true}),
        Request::Status => status(lab),
        Request::Apply { path } => {
            let applied = lab.apply_path(&path).await?;
            serde_json::json!({"ok": true, "applied": applied})
        }
        Request::AddPod {
            node,
            name,
            ips,
            tcp,
            udp,
        } => {
            let i = lab.node_index(&node)?;
            let pod = lab.ensure_pod_ips(
                i,
                &name,
                &ips,
                &tcp.into_iter().collect(),
                &udp.into_iter().collect(),
            )?;
            serde_json::json!({"ok": true, "ips": pod.ips()})
        }
        Request::AddExternal { name, ips, via } => {
            let client = lab.add_external_client(&ExternalSpec {
                name,
                via,
                addresses: ips,
            })?;
            serde_json::json!({"ok": true, "ips": client.ips()})
        }
        Request::Probe {
            from,
            protocol,
            dst,
            count,
            source_port,
            timeout_ms,
        } => {
            // Resolve first, so that a typo is an error rather than N error results.
            lab.resolve(&from)?;
            let results = lab
                .probe_n_from_port(
                    &from,
                    protocol,
                    dst,
                    source_port,
                    count.clamp(1, 10_000),
                    Duration::from_millis(timeout_ms.clamp(10, 60_000)),
                )
                .await;
            serde_json::json!({"ok": true, "results": results})
        }
        Request::Http {
            from,
            url,
            timeout_ms,
        } => {
            lab.resolve(&from)?;
            let r = lab
                .http_get(
                    &from,
                    &url,
                    Duration::from_millis(timeout_ms.clamp(10, 60_000)),
                )
                .await;
            serde_json::json!({"ok": true, "response": r.to_json_value()})
        }
        Request::Replay {
            path,
            apply,
            settle_ms,
        } => {
            let probes = if path.is_dir() {
                let scenario = Scenario::load(&path)?;
                if apply {
                    lab.apply_scenario(&scenario).await?;
                }
                scenario.probes
            } else {
                if apply {
                    bail!("--apply needs a scenario directory, not a probes file");
                }
                load_probes(&path)?
            };
            let opts = ReplayOptions {
                settle: Duration::from_millis(settle_ms),
                ..Default::default()
            };
            let reports = lab.replay(&probes, &opts).await;
            serde_json::json!({"ok": true, "reports": reports})
        }
    })
}

pub fn status(lab: &Lab) -> serde_json::Value {
    let mut v = lab.status();
    if let Some(b) = lab.brains.iter().flatten().next() {
        let op = &lab.operator_tls;
        v["grpcurl"] = format!(
            "{} -cacert {} -cert {} -key {} {} list",
            splitproxy_tests::tools::cached_path("grpcurl").display(),
            op.ca.display(),
            op.cert.display(),
            op.key.display(),
            b.grpc
        )
        .into();
    }
    v
}
