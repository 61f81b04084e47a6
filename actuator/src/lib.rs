//! splitproxy actuator: applies the ruleset IR streamed by the brain to the node's kernel.
#![forbid(unsafe_code)]

pub mod after_commit;
pub mod apply;
pub mod client;
pub mod config;
pub mod conntrack;
pub mod guards;
pub mod health;
pub mod healthcheck;
pub mod metrics;
pub mod nft;
pub mod run;
pub mod virtual_fleet;

/// Installs the tracing subscriber: `RUST_LOG` filters, `format` is "text" or "json".
pub fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}
