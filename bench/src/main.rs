//! `splitproxy-bench`: the scale benchmark (see the library's documentation), and the brain and
//! actuator it spawns (`splitproxy-bench brain|actuator ...`).
#![forbid(unsafe_code)]

use clap::Parser;
use splitproxy_bench::cli::{Cli, Component};

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.component {
        Some(Component::Brain(args)) => {
            let config = splitproxy_brain::config::BrainConfig::try_from(*args)?;
            splitproxy_brain::init_logging(&config.log_format);
            runtime.block_on(splitproxy_brain::run::run(config))
        }
        Some(Component::Actuator(args)) => {
            splitproxy_actuator::init_logging(&args.log_format);
            runtime.block_on(splitproxy_actuator::run::run((*args).try_into()?))
        }
        None => runtime.block_on(async {
            // On SIGINT or SIGTERM the run is dropped, which stops every component it started
            // and removes its namespaces.
            tokio::select! {
                r = splitproxy_bench::run::run(cli.bench) => r.map(drop),
                _ = splitproxy_proto::process::shutdown_signal() => {
                    eprintln!("[bench] interrupted: stopping every component");
                    Err(anyhow::anyhow!("interrupted by a signal"))
                }
            }
        }),
    }
}
