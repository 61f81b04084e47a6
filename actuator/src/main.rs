use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = splitproxy_actuator::config::Args::parse();
    splitproxy_actuator::init_logging(&args.log_format);
    if args.cleanup {
        splitproxy_actuator::cleanup::delete_tables(&args.table)?;
        tracing::info!(table = %args.table, "deleted the tables ip and ip6 {}", args.table);
        return Ok(());
    }
    splitproxy_actuator::run::run(args.try_into()?).await
}
