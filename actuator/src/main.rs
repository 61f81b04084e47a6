use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = splitproxy_actuator::config::Args::parse();
    let telemetry = splitproxy_actuator::init_telemetry(&args.log_format);
    let result = splitproxy_actuator::run::run(args.try_into()?).await;
    telemetry.shutdown().await;
    result
}
