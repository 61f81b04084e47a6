//! `up`: the lab's supervisor. It owns the whole lab (processes, namespaces, pods) and serves the
//! control socket until `down`, SIGTERM or Ctrl-C, then tears everything down.
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use splitproxy_tests::install::{self, InstallOptions};
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
    cmd.arg("--state-dir")
        .arg(state_dir)
        .arg("up")
        .args(supervisor_args(args));
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

/// The `up` arguments of the background supervisor: every option that shapes the lab, so a
/// detached lab is the lab the command line asked for (the probes and their output stay with
/// the caller).
fn supervisor_args(args: &UpArgs) -> Vec<std::ffi::OsString> {
    let mut out: Vec<std::ffi::OsString> = Vec::new();
    let mut flag = |name: &str, value: std::ffi::OsString| {
        out.push(name.into());
        out.push(value);
    };
    if let Some(n) = args.nodes {
        flag("--nodes", n.to_string().into());
    }
    if let Some(b) = args.brains {
        flag("--brains", b.to_string().into());
    }
    if let Some(s) = &args.service_cidr {
        flag("--service-cidr", s.into());
    }
    if let Some(dir) = &args.scenario {
        flag("--scenario", dir.into());
    }
    for value in &args.set {
        flag("--set", value.into());
    }
    if args.chart {
        out.push("--chart".into());
    }
    out
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
    if args.chart {
        // The pods' volumes live in the lab's directory, which must not be under /run (each
        // container gets a tmpfs there): with the default state directory, a temporary one.
        if opts.dir.as_deref().is_some_and(install::under_run) {
            opts.dir = Some(std::env::temp_dir().join("splitproxy-lab-chart"));
        }
        // The chart's brains replace the lab's: as many replicas as asked, or two, and never
        // more than there are nodes (the chart's required anti-affinity).
        let nodes = opts.effective_nodes().len();
        let defaults = InstallOptions::default();
        opts.install = Some(InstallOptions {
            brains: args.brains.unwrap_or(defaults.brains.min(nodes)),
            set: args.set.clone(),
            ..defaults
        });
    }
    Ok((opts, scenario))
}

async fn supervise(state_dir: &Path, args: &UpArgs) -> anyhow::Result<()> {
    let (opts, scenario) = options(state_dir, args)?;
    match &opts.install {
        Some(install) => eprintln!(
            "bringing up etcd and kube-apiserver, and installing the chart: {} brain(s) and {} node(s) ...",
            install.brains,
            opts.effective_nodes().len()
        ),
        None => eprintln!(
            "bringing up etcd, kube-apiserver, {} brain(s) and {} node(s) ...",
            opts.brains,
            opts.effective_nodes().len()
        ),
    }
    let lab = Arc::new(Lab::start(opts).await?);
    let chart = match ChartAccess::new(&lab, lab.dir()).await {
        Ok(chart) => chart,
        Err(e) => {
            eprintln!("the chart's brains cannot be reached with grpcurl: {e:#}");
            None
        }
    };
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
    let chart = chart.map(Arc::new);
    eprintln!(
        "{}",
        serde_json::to_string_pretty(&status(&lab, chart.as_deref()))?
    );
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
                let chart = chart.clone();
                let down = down_tx.clone();
                tokio::spawn(async move {
                    if handle(&lab, chart.as_deref(), stream).await {
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
    drop(chart);
    drop(lab);
    Ok(())
}

fn error(e: anyhow::Error) -> serde_json::Value {
    serde_json::json!({"error": format!("{e:#}")})
}

/// Serves one request; true when the lab should go down.
async fn handle(lab: &Lab, chart: Option<&ChartAccess>, stream: tokio::net::UnixStream) -> bool {
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
    let answer = answer(lab, chart, request).await.unwrap_or_else(error);
    let _ = w.write_all(format!("{answer}\n").as_bytes()).await;
    down
}

async fn answer(
    lab: &Lab,
    chart: Option<&ChartAccess>,
    request: Request,
) -> anyhow::Result<serde_json::Value> {
    Ok(match request {
        Request::Down => serde_json::json!({"ok": true}),
        Request::Status => status(lab, chart),
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

pub fn status(lab: &Lab, chart: Option<&ChartAccess>) -> serde_json::Value {
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
    if let Some(chart) = chart {
        v["grpcurl"] = chart.grpcurl.clone().into();
    }
    v
}

/// How an operator reaches the chart's brains from the host, as on a cluster: the brains' CA
/// bundle from the ConfigMap they publish, a ServiceAccount token bound to the chart's operator
/// ClusterRole, and a link from host loopback into the first brain pod's node.
pub struct ChartAccess {
    _link: splitproxy_tests::portfwd::Forwarder,
    grpcurl: String,
}

impl ChartAccess {
    /// `None` without the chart; the CA and the token are written into `dir`.
    async fn new(lab: &Lab, dir: &Path) -> anyhow::Result<Option<ChartAccess>> {
        let Some(install) = &lab.install else {
            return Ok(None);
        };
        let pod = install
            .pods_of("brain")
            .into_iter()
            .next()
            .context("no brain pod")?
            .0;
        let link = install.brain_link(&pod)?;
        let ca = dir.join("brain-ca.crt");
        std::fs::write(&ca, install.brain_ca().await?)?;
        let token = dir.join("operator.token");
        {
            use std::io::Write as _;
            use std::os::unix::fs::OpenOptionsExt as _;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&token)?
                .write_all(
                    install
                        .operator_token("lab-operator", true)
                        .await?
                        .as_bytes(),
                )?;
        }
        let server_name = install
            .brain_arg("--tls-server-name")
            .unwrap_or_else(|| "splitproxy-brain".into());
        let grpcurl = format!(
            "{} -cacert {} -servername {server_name} -H \"authorization: Bearer $(cat {})\" {} list",
            splitproxy_tests::tools::cached_path("grpcurl").display(),
            ca.display(),
            token.display(),
            link.local_addr()
        );
        Ok(Some(ChartAccess {
            _link: link,
            grpcurl,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    /// The detached supervisor is started with every option that shapes the lab: a flag
    /// dropped there (as `--chart` would be) starts another lab than the one asked for.
    #[test]
    fn a_detached_lab_is_the_lab_asked_for() {
        let asked = "splitproxy-lab up --detach --nodes 4 --brains 3 --service-cidr 10.97.0.0/16 \
                     --scenario /tmp/s --chart --set identity.mode=podCertificate --set logLevel=debug";
        let up = |argv: Vec<std::ffi::OsString>| match crate::cli::Cli::parse_from(argv).command {
            crate::cli::Command::Up(up) => up,
            other => panic!("{other:?}"),
        };
        let args = up(asked.split_whitespace().map(Into::into).collect());
        let mut argv: Vec<std::ffi::OsString> = vec!["splitproxy-lab".into(), "up".into()];
        argv.extend(supervisor_args(&args));
        let again = up(argv);
        assert_eq!(
            format!("{again:?}"),
            format!(
                "{:?}",
                UpArgs {
                    detach: false,
                    ..args.clone()
                }
            )
        );

        // (Without the scenario, which options() would read.)
        let no_scenario = UpArgs {
            scenario: None,
            ..args
        };
        let (opts, _) = options(Path::new("/tmp/lab"), &no_scenario).unwrap();
        assert_eq!(opts.dir.as_deref(), Some(Path::new("/tmp/lab/run")));
        let install = opts.install.expect("--chart installs the chart");
        assert_eq!(install.brains, 3);
        assert_eq!(
            install.set,
            ["identity.mode=podCertificate", "logLevel=debug"]
        );
    }

    /// Two brains by default, never more than there are nodes; no chart without --chart, and
    /// no chart value without it either.
    #[test]
    fn the_charts_brains_fit_the_nodes() {
        let up = |argv: &[&str]| match crate::cli::Cli::try_parse_from(argv).map(|c| c.command) {
            Ok(crate::cli::Command::Up(up)) => Ok(up),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        let brains = |argv: &[&str]| {
            let (opts, _) = options(Path::new("/tmp/lab"), &up(argv).unwrap()).unwrap();
            opts.install.map(|i| i.brains)
        };
        assert_eq!(brains(&["lab", "up", "--chart"]), Some(2));
        assert_eq!(brains(&["lab", "up", "--chart", "--nodes", "1"]), Some(1));
        assert_eq!(brains(&["lab", "up"]), None);
        // Under /run (the default state directory), the pods' volumes would be hidden.
        let dir = |argv: &[&str]| {
            options(Path::new("/run/splitproxy-lab"), &up(argv).unwrap())
                .unwrap()
                .0
                .dir
        };
        assert_eq!(
            dir(&["lab", "up", "--chart"]),
            Some(std::env::temp_dir().join("splitproxy-lab-chart"))
        );
        assert_eq!(
            dir(&["lab", "up"]),
            Some(std::path::PathBuf::from("/run/splitproxy-lab/run"))
        );
        assert!(up(&["lab", "up", "--set", "a=b"]).is_err());
    }
}
