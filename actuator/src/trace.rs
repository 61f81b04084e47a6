//! The actuator's span of one update's apply, continuing the brain's trace of the API change
//! (docs/observability.md): only when the update carries a trace context (`traceparent`), which
//! the brain sends for sampled changes only. Without one nothing is created, so an update that
//! is not traced costs nothing here.
use std::time::Duration;

use splitproxy_proto::telemetry::{TARGET, remote_parent};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::apply::Outcome;

/// The span of applying one update (`generation`, a snapshot or not), a child of the brain's
/// send named by `traceparent`; `None` when it names none.
pub fn apply_span(traceparent: &str, generation: u64, snapshot: bool) -> Option<tracing::Span> {
    let parent = remote_parent(traceparent)?;
    let span = tracing::info_span!(
        target: TARGET,
        parent: None,
        "actuator.apply",
        splitproxy.generation = generation,
        splitproxy.snapshot = snapshot,
        splitproxy.ok = tracing::field::Empty,
        splitproxy.changed = tracing::field::Empty,
        splitproxy.transaction.messages = tracing::field::Empty,
        splitproxy.transaction.bytes = tracing::field::Empty,
        splitproxy.kernel_ms = tracing::field::Empty,
        splitproxy.kernel_on_cpu_ms = tracing::field::Empty,
        splitproxy.error = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    let _ = span.set_parent(parent);
    Some(span)
}

/// Records a committed apply: the transaction's size and how long the kernel took.
pub fn applied(span: &tracing::Span, outcome: &Outcome) {
    span.record("splitproxy.ok", true);
    span.record("splitproxy.changed", outcome.changed);
    span.record("splitproxy.transaction.messages", outcome.messages as u64);
    span.record("splitproxy.transaction.bytes", outcome.bytes as u64);
    span.record("splitproxy.kernel_ms", ms(outcome.took));
    if let Some(on_cpu) = outcome.took_on_cpu {
        span.record("splitproxy.kernel_on_cpu_ms", ms(on_cpu));
    }
}

/// Records a refused apply and why.
pub fn failed(span: &tracing::Span, error: &str) {
    span.record("splitproxy.ok", false);
    span.record("splitproxy.error", error);
    span.record("otel.status_code", "error");
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
