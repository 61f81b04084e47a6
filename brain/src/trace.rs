//! The brain's spans of one API change (docs/observability.md): the watch event (a root), the
//! publication that folds it in (its child, linking every other change folded into the same
//! publication), each node's send (a child of the publication, carrying its trace context to
//! the node in `Update.traceparent`) and the node's ack (a child of the send; the actuator's
//! apply is another).
//!
//! Every span has the target [`TARGET`], which no layer wants unless OpenTelemetry is
//! configured ([`splitproxy_proto::telemetry`]): off, each costs an interest check. Node spans
//! exist only for sampled publications, so a change not sampled costs nothing per node, however
//! many nodes there are ("cost follows the change", docs/invariants.md).
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use opentelemetry::trace::{SpanContext, TraceContextExt};
use splitproxy_proto::frames::{UpdateFrame, set_traceparent};
use splitproxy_proto::telemetry::{TARGET, sampled, traceparent};
use splitproxy_proto::v1::Ack;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::fanout::Fanout;

/// The EndpointSlice annotation with the time of the change that made the controller write it.
const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// At most this many changes are linked from one span (a churn of thousands folded into one
/// publication does not make one span of thousands of links).
pub const MAX_LINKS: usize = 128;

/// What a watch event did to an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Apply,
    Delete,
}

/// The root span of one API change, as the watch delivered it: the object's kind, namespace,
/// name and resourceVersion, and for EndpointSlices their trigger time. Its context when the
/// trace is sampled (the publication continues it); `None` otherwise.
pub fn api_change(kind: &'static str, meta: &ObjectMeta, change: Change) -> Option<SpanContext> {
    let trigger = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(TRIGGER_TIME))
        .map(String::as_str)
        .unwrap_or("");
    let span = tracing::info_span!(
        target: TARGET,
        parent: None,
        "api.change",
        k8s.object.kind = kind,
        k8s.namespace.name = meta.namespace.as_deref().unwrap_or(""),
        k8s.object.name = meta.name.as_deref().unwrap_or(""),
        k8s.object.resource_version = meta.resource_version.as_deref().unwrap_or(""),
        k8s.event.type = if change == Change::Apply { "apply" } else { "delete" },
        "endpoints.kubernetes.io/last-change-trigger-time" = trigger,
    );
    sampled(&span)
}

/// The span of one publication: recomputation and publishing. A child of the first sampled
/// change it folds in, with a link to every other (several changes, one publication: none of
/// them is chosen over the others, and each trace leads to it). `None` when no change folded in
/// is sampled.
pub fn publication(
    changes: &[SpanContext],
    services: usize,
    rebuild: bool,
) -> Option<tracing::Span> {
    let (first, others) = changes.split_first()?;
    let span = tracing::info_span!(
        target: TARGET,
        parent: None,
        "brain.publish",
        splitproxy.changes = changes.len(),
        splitproxy.services = services,
        splitproxy.rebuild = rebuild,
        splitproxy.version = tracing::field::Empty,
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(first.clone()));
    for other in others.iter().take(MAX_LINKS) {
        span.add_link(other.clone());
    }
    Some(span)
}

/// A node's update on its way, from the send to the ack.
#[derive(Debug)]
pub struct NodeSend {
    span: tracing::Span,
}

/// Starts the span of sending `frames` to `node` (from the version it holds, `base`, or a
/// snapshot, to `target`) when a publication the update folds in is sampled, as a child of the
/// newest such publication, linking the others; and puts its trace context in the last frame,
/// which the actuator applies. `None`, and the frames untouched, otherwise.
pub fn node_send(
    fanout: &Fanout,
    node: &str,
    base: Option<u64>,
    target: u64,
    frames: &mut [UpdateFrame],
) -> Option<NodeSend> {
    let after = base.unwrap_or(target.saturating_sub(1));
    let traces = fanout.traces_between(after, target);
    let (parent, others) = traces.split_first()?;
    let parts = frames.len();
    let last = frames.last_mut()?;
    let span = tracing::info_span!(
        target: TARGET,
        parent: None,
        "brain.send",
        k8s.node.name = node,
        splitproxy.generation = last.generation,
        splitproxy.base_generation = last.base_generation,
        splitproxy.version = target,
        splitproxy.snapshot = base.is_none(),
        splitproxy.parts = parts,
        otel.status_code = tracing::field::Empty,
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent.clone()));
    for other in others.iter().take(MAX_LINKS) {
        span.add_link(other.clone());
    }
    let tp = traceparent(&span)?;
    set_traceparent(last, tp);
    Some(NodeSend { span })
}

impl NodeSend {
    /// Records the node's answer (a child span: applied, or the kernel's error) and ends the
    /// send.
    pub fn ack(self, node: &str, ack: &Ack) {
        let apply_ms = ack
            .apply_duration
            .map(|d| d.seconds as f64 * 1e3 + d.nanos as f64 / 1e6)
            .unwrap_or(0.0);
        let span = tracing::info_span!(
            target: TARGET,
            parent: &self.span,
            "brain.ack",
            k8s.node.name = node,
            splitproxy.generation = ack.generation,
            splitproxy.ack.ok = ack.ok,
            splitproxy.apply_ms = apply_ms,
            splitproxy.error = ack.error.as_str(),
            splitproxy.errno = ack.errno,
            otel.status_code = if ack.ok { "ok" } else { "error" },
        );
        drop(span);
        if !ack.ok {
            self.span.record("otel.status_code", "error");
        }
    }
}

#[cfg(test)]
mod tests;
