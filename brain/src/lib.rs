//! The splitproxy brain: watch the API server once, index, compute each node's ruleset IR, and
//! stream snapshots and deltas to the actuators over mTLS gRPC.
#![forbid(unsafe_code)]

pub mod ack_deadline;
pub mod api_state;
pub mod auth;
pub mod config;
pub mod desired;
pub mod explain;
pub mod fanout;
pub mod freshness;
pub mod history;
pub mod http;
pub mod index;
pub mod listener;
pub mod metrics;
pub mod node_watch;
pub mod objects;
pub mod overlay;
pub mod pacing;
pub mod pki;
pub mod podcert;
pub mod restate;
pub mod rules;
pub mod run;
pub mod server;
pub mod service_view;
pub mod session;
pub mod session_tickets;
pub mod sync_route;
pub mod tls;
pub mod tokens;
pub mod trace;
pub mod watch;

pub use splitproxy_proto::process::init_logging;

/// Logging, and OpenTelemetry tracing when the OTEL_* environment asks for it
/// (docs/observability.md), for the brain's process; inside the Tokio runtime.
pub fn init_telemetry(format: &str) -> splitproxy_proto::telemetry::Telemetry {
    splitproxy_proto::telemetry::init(format, "splitproxy-brain")
}
