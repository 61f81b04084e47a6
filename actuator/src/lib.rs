//! splitproxy actuator: applies the ruleset IR streamed by the brain to the node's kernel.
// The only unsafe code is one call to glibc's mallopt (malloc.rs).
#![deny(unsafe_code)]

pub mod after_commit;
pub mod apply;
pub mod cleanup;
pub mod client;
pub mod config;
pub mod conntrack;
pub mod credentials;
pub mod discovery;
pub mod guards;
pub mod health;
pub mod healthcheck;
pub mod malloc;
pub mod metrics;
pub(crate) mod netlink;
pub mod nft;
pub mod reconcile;
pub mod run;
pub mod tls_client;
pub mod trace;

pub use splitproxy_proto::process::init_logging;

/// Logging, and OpenTelemetry tracing when the OTEL_* environment asks for it
/// (docs/observability.md), for the actuator's process; inside the Tokio runtime.
pub fn init_telemetry(format: &str) -> splitproxy_proto::telemetry::Telemetry {
    splitproxy_proto::telemetry::init(format, "splitproxy-actuator")
}
