//! The splitproxy brain: watch the API server once, index, compute each node's ruleset IR, and
//! stream snapshots and deltas to the actuators over mTLS gRPC.
#![forbid(unsafe_code)]

pub mod config;
pub mod desired;
pub mod fanout;
pub mod http;
pub mod index;
pub mod metrics;
pub mod objects;
pub mod overlay;
pub mod rules;
pub mod run;
pub mod server;
pub mod tls;
pub mod watch;

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
