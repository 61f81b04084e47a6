//! `splitproxy-lab`: a local splitproxy installation in network namespaces, scriptable.
//!
//! `up` starts etcd, kube-apiserver, brains and one actuator per node namespace (with `--chart`,
//! the Helm chart's brains and actuators, installed as `splitproxy_tests::install` does for the
//! chart-driven test) and stays in the foreground as the lab's supervisor (or in the background
//! with `--detach`); with `--scenario
//! DIR` it is configured by `DIR/lab.yaml`, applies DIR's objects and (`--probe`) runs
//! `DIR/probes.yaml`. `apply`, `probe`, `http`, `replay`, `pod`, `external`, `status` and `down`
//! talk to it over a Unix socket; `demo` brings a lab up with demo Services and shows traffic. `brain` and `actuator` run the real components (the same code as the
//! `splitproxy-brain` and `splitproxy-actuator` binaries), so the lab and the tests spawn real
//! processes from one binary.
#![forbid(unsafe_code)]

mod cli;
mod control;
mod demo;
mod supervisor;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let cli = cli::Cli::parse();
    match cli.command {
        cli::Command::Brain(args) => {
            let config = splitproxy_brain::config::BrainConfig::try_from(*args)?;
            runtime()?.block_on(async {
                let telemetry = splitproxy_brain::init_telemetry(&config.log_format);
                let result = splitproxy_brain::run::run(config).await;
                telemetry.shutdown().await;
                result
            })
        }
        cli::Command::Actuator(args) => runtime()?.block_on(async {
            let telemetry = splitproxy_actuator::init_telemetry(&args.log_format);
            let result = splitproxy_actuator::run::run((*args).try_into()?).await;
            telemetry.shutdown().await;
            result
        }),
        cli::Command::Up(up) => supervisor::up(&cli.state_dir, up),
        cli::Command::Demo(up) => demo::run(&cli.state_dir, up),
        cli::Command::Apply { path } => control::apply(&cli.state_dir, &path),
        cli::Command::Probe(p) => control::probe(&cli.state_dir, p),
        cli::Command::Http(h) => control::http(&cli.state_dir, h),
        cli::Command::Replay(r) => control::replay(&cli.state_dir, r),
        cli::Command::Pod {
            node,
            name,
            ip,
            tcp,
            udp,
        } => {
            let v = control::call(
                &cli.state_dir,
                &control::Request::AddPod {
                    node,
                    name: name.clone(),
                    ips: ip,
                    tcp,
                    udp,
                },
            )?;
            println!("pod {name} ({}) is up", addresses(&v));
            Ok(())
        }
        cli::Command::External { name, ip, via } => {
            let v = control::call(
                &cli.state_dir,
                &control::Request::AddExternal {
                    name: name.clone(),
                    ips: ip,
                    via,
                },
            )?;
            println!("external client {name} ({}) is up", addresses(&v));
            Ok(())
        }
        cli::Command::Status => control::status(&cli.state_dir),
        cli::Command::Down => control::down(&cli.state_dir),
    }
}

/// "a, b" from an answer's `ips`.
fn addresses(v: &serde_json::Value) -> String {
    v["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}
