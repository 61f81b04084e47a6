//! Logging and OpenTelemetry tracing, set up once per process: the brain and the actuator
//! share it, so it lives in the one crate both depend on.
//!
//! Tracing is off unless the standard OTLP variables name a collector
//! (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`; `OTEL_SDK_DISABLED=true`
//! or `OTEL_TRACES_EXPORTER=none` keep it off). Then spans of the target [`TARGET`] (and only
//! those: the process's own logs stay on stderr, filtered by `RUST_LOG`) are exported over OTLP
//! gRPC by a batch processor, which the SDK configures from `OTEL_BSP_*`. The SDK reads
//! `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` and
//! `OTEL_TRACES_SAMPLER_ARG` itself; without a sampler named, ours is parent-based with a
//! ratio of [`DEFAULT_RATIO`] for new traces, so that a change fanned out to 5,000 nodes costs
//! 5,000 node spans only for the few changes sampled ("cost follows the change",
//! docs/invariants.md).
//!
//! Off, the spans of [`TARGET`] are disabled at their call sites (no layer wants them), so the
//! instrumented paths cost one cached interest check, and no trace context is ever sent.
use std::collections::HashMap;
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanContext, TraceContextExt, TracerProvider};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The tracing target of every span exported to OpenTelemetry.
pub const TARGET: &str = "splitproxy::trace";

/// Share of new traces sampled when `OTEL_TRACES_SAMPLER` is unset (parent-based: a node
/// continues whatever the brain decided).
pub const DEFAULT_RATIO: f64 = 0.01;

/// How long the last spans may take to leave at shutdown.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// The tracer provider while tracing is on; flushed by [`Telemetry::shutdown`].
#[must_use = "flush the spans at shutdown with Telemetry::shutdown"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn enabled(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports the spans still queued and stops the exporter (bounded). Blocks a thread of its
    /// own, not the runtime: the exporter's connection runs on the runtime.
    pub async fn shutdown(self) {
        let Some(provider) = self.provider else {
            return;
        };
        let done =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(FLUSH_TIMEOUT));
        match tokio::time::timeout(FLUSH_TIMEOUT + Duration::from_secs(1), done).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "flushing the last spans failed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "flushing the last spans panicked"),
            Err(_) => tracing::warn!("flushing the last spans timed out"),
        }
    }
}

/// Installs logging on stderr (`RUST_LOG` filters, default `info`; `format` "text" or "json")
/// and, when the environment configures it, OpenTelemetry tracing for `service` (the
/// `service.name` unless `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES` give one). Must run
/// inside the Tokio runtime: the gRPC exporter's connection lives there.
pub fn init(format: &str, service: &'static str) -> Telemetry {
    let provider = if configured(|k| std::env::var(k).ok()) {
        match provider(service) {
            Ok(p) => Some(p),
            Err(e) => {
                // Logging is not up yet.
                eprintln!("OpenTelemetry tracing is configured but cannot start: {e}");
                None
            }
        }
    } else {
        None
    };
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if format == "json" {
        fmt.json().boxed()
    } else {
        fmt.boxed()
    };
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer(service))
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_filter(otel_filter())
    });
    tracing_subscriber::registry()
        .with(fmt.with_filter(log_filter()))
        .with(otel)
        .init();
    if provider.is_some() {
        tracing::info!(service, "OpenTelemetry tracing on (OTLP gRPC)");
    }
    Telemetry { provider }
}

/// What the log output shows: `RUST_LOG` (default `info`), never the spans of [`TARGET`]. Those
/// are for the OpenTelemetry layer alone, so that without it no layer wants them and they cost
/// nothing.
pub fn log_filter() -> tracing_subscriber::EnvFilter {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    match format!("{TARGET}=off").parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    }
}

/// What the OpenTelemetry layer sees: our spans, and the log events (info and above) emitted
/// inside them, which become span events (an apply's kernel error, say).
pub fn otel_filter() -> tracing_subscriber::filter::FilterFn<impl Fn(&tracing::Metadata<'_>) -> bool>
{
    tracing_subscriber::filter::filter_fn(|m| {
        if m.is_span() {
            m.target() == TARGET
        } else {
            *m.level() <= tracing::Level::INFO
        }
    })
}

/// Whether the environment (read through `var`) asks for traces.
fn configured(var: impl Fn(&str) -> Option<String>) -> bool {
    let set = |k: &str| var(k).is_some_and(|v| !v.trim().is_empty());
    let is = |k: &str, v: &str| var(k).is_some_and(|x| x.trim().eq_ignore_ascii_case(v));
    if is("OTEL_SDK_DISABLED", "true") || is("OTEL_TRACES_EXPORTER", "none") {
        return false;
    }
    set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") || set("OTEL_EXPORTER_OTLP_ENDPOINT")
}

fn provider(service: &'static str) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| e.to_string())?;
    let mut resource = opentelemetry_sdk::Resource::builder().build();
    let named = resource
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|v| !v.as_str().starts_with("unknown_service"));
    if !named {
        resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(service)
            .build();
    }
    let mut builder = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource);
    // The SDK has read OTEL_TRACES_SAMPLER (and its argument) already; only its absence gets
    // our default.
    if std::env::var("OTEL_TRACES_SAMPLER").is_err() {
        builder = builder.with_sampler(default_sampler());
    }
    Ok(builder.build())
}

/// Parent-based, [`DEFAULT_RATIO`] of new traces.
pub fn default_sampler() -> Sampler {
    Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(DEFAULT_RATIO)))
}

/// The `traceparent` of `span`'s OpenTelemetry span when its trace is sampled; `None` when
/// tracing is off, the span is disabled, or the trace is not sampled (nothing is sent then).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    traceparent_of(&sc)
}

/// The sampled span context of `span`, for links and later children.
pub fn sampled(span: &tracing::Span) -> Option<SpanContext> {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if span.is_disabled() {
        return None;
    }
    let sc = span.context().span().span_context().clone();
    (sc.is_valid() && sc.is_sampled()).then_some(sc)
}

/// W3C `traceparent` of a sampled span context.
pub fn traceparent_of(sc: &SpanContext) -> Option<String> {
    if !sc.is_valid() || !sc.is_sampled() {
        return None;
    }
    let cx = opentelemetry::Context::new().with_remote_span_context(sc.clone());
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// The remote parent named by a `traceparent` (as sent in an Update); `None` when it is empty
/// or malformed.
pub fn remote_parent(traceparent: &str) -> Option<opentelemetry::Context> {
    if traceparent.is_empty() {
        return None;
    }
    let mut carrier = HashMap::with_capacity(1);
    carrier.insert("traceparent".to_string(), traceparent.to_string());
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_unless_an_endpoint_is_set() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(!configured(env(&[])));
        assert!(!configured(env(&[("OTEL_SERVICE_NAME", "x")])));
        assert!(!configured(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])));
        assert!(configured(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://c:4317"
        )])));
        assert!(configured(env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://c:4317"
        )])));
        assert!(!configured(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_SDK_DISABLED", "TRUE"),
        ])));
        assert!(!configured(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ])));
    }

    #[test]
    fn traceparent_round_trips_and_only_when_sampled() {
        use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};
        let sc = |flags| {
            SpanContext::new(
                TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
                SpanId::from_hex("b7ad6b7169203331").unwrap(),
                flags,
                false,
                TraceState::default(),
            )
        };
        let tp = traceparent_of(&sc(TraceFlags::SAMPLED)).unwrap();
        assert_eq!(
            tp,
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
        let parent = remote_parent(&tp).unwrap();
        let got = parent.span().span_context().clone();
        assert_eq!(got.trace_id(), sc(TraceFlags::SAMPLED).trace_id());
        assert!(got.is_remote() && got.is_sampled());
        assert_eq!(traceparent_of(&sc(TraceFlags::default())), None);
        assert!(remote_parent("").is_none());
        assert!(remote_parent("garbage").is_none());
        // Off: no subscriber wants the span, so there is nothing to send.
        let span = tracing::info_span!(target: TARGET, "off");
        assert_eq!(traceparent(&span), None);
    }

    #[test]
    fn the_log_output_never_wants_our_spans() {
        use tracing_subscriber::layer::SubscriberExt;
        // As a process without OpenTelemetry is set up: the log output only.
        let logs = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::sink)
                .with_filter(log_filter()),
        );
        tracing::subscriber::with_default(logs, || {
            let ours = tracing::info_span!(target: TARGET, "api.change");
            assert!(ours.is_disabled(), "no layer wants it: it costs nothing");
            assert_eq!(sampled(&ours), None);
            let theirs = tracing::info_span!(target: "splitproxy_brain::watch", "other");
            assert!(
                !theirs.is_disabled(),
                "other info spans are logged as before"
            );
        });
    }
}
