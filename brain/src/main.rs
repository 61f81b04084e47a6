use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = splitproxy_brain::config::Args::parse();
    splitproxy_brain::init_logging(&args.log_format);
    splitproxy_brain::run::run(args).await
}
