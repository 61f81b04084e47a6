use clap::Parser;
use splitproxy_brain::config::{Args, BrainConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = BrainConfig::try_from(Args::parse())?;
    splitproxy_brain::init_logging(&config.log_format);
    splitproxy_brain::run::run(config).await
}
