use clap::Parser;
use splitproxy_brain::config::{Args, BrainConfig};

fn main() -> anyhow::Result<()> {
    let config = BrainConfig::try_from(Args::parse())?;
    splitproxy_brain::run::runtime(&config.tuning)?.block_on(async {
        let telemetry = splitproxy_brain::init_telemetry(&config.log_format);
        let result = splitproxy_brain::run::run(config).await;
        telemetry.shutdown().await;
        result
    })
}
