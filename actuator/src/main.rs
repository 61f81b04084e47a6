use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = splitproxy_actuator::config::Args::parse();
    let telemetry = splitproxy_actuator::init_telemetry(&args.log_format);
    if args.cleanup {
        let result = splitproxy_actuator::cleanup::delete_tables(&args.table);
        if result.is_ok() {
            tracing::info!(table = %args.table, "deleted the tables ip and ip6 {}", args.table);
        }
        telemetry.shutdown().await;
        return result;
    }
    let result = splitproxy_actuator::run::run(args.try_into()?).await;
    telemetry.shutdown().await;
    result
}
