use clap::Parser;

fn main() -> anyhow::Result<()> {
    // Before the runtime starts its threads (see malloc.rs).
    splitproxy_actuator::malloc::limit_arenas();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> anyhow::Result<()> {
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
