use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = splitproxy_actuator::config::Args::parse();
    splitproxy_actuator::init_logging(&args.log_format);
    splitproxy_actuator::run::run(args.try_into()?).await
}
