//! The brain's spans of a change, exported in memory: who is whose parent, what is linked, and
//! that a node is sent a trace context only for a sampled change of a process that traces.
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use opentelemetry::trace::{SpanContext, TracerProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, Sampler, SdkTracerProvider, SpanData};
use prost::Message;
use splitproxy_proto::frames::UpdateFrame;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{Ack, Update};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;

use super::*;
use crate::fanout::{Fanout, Next};
use crate::metrics::Metrics;

/// A subscriber that exports our spans to memory, as `telemetry::init` does to a collector.
fn traced(
    sampler: Sampler,
) -> (
    impl tracing::Subscriber,
    SdkTracerProvider,
    InMemorySpanExporter,
) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .with_sampler(sampler)
        .build();
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("test"))
        .with_filter(splitproxy_proto::telemetry::otel_filter());
    (
        tracing_subscriber::registry().with(layer),
        provider,
        exporter,
    )
}

fn slice_meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        namespace: Some("ns".into()),
        name: Some(name.into()),
        resource_version: Some("42".into()),
        annotations: Some([(TRIGGER_TIME.to_string(), "2026-01-02T03:04:05Z".to_string())].into()),
        ..ObjectMeta::default()
    }
}

/// A publication of one change (traced as `trace` says), and what node `n1` is sent for it:
/// its frames and its send, if traced.
fn publish_and_send(trace: Option<SpanContext>) -> (Vec<UpdateFrame>, Option<NodeSend>) {
    let fanout = Fanout::new(Arc::new(Metrics::default()), 4, 1024);
    let shared = Arc::new(Model::default());
    let version = fanout.publish_traced(
        shared,
        Default::default(),
        vec![],
        vec![],
        trace,
        Default::default(),
    );
    assert_eq!(version, Some(1));
    let Some(Next::Send(mut frames, _)) = fanout.next_update("n1", None, &fanout.publication())
    else {
        panic!("a snapshot for n1");
    };
    let send = node_send(&fanout, "n1", None, 1, &mut frames);
    (frames, send)
}

fn decoded(frames: &[UpdateFrame]) -> Update {
    Update::decode(frames.last().unwrap().encode_to_vec().as_slice()).unwrap()
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|s| s.name == name).collect()
}

#[test]
fn off_no_span_and_no_traceparent() {
    // No layer wants our spans: nothing is sampled, and a publication is never traced.
    assert_eq!(
        api_change("EndpointSlice", &slice_meta("a"), Change::Apply),
        None
    );
    assert!(publication(&[], 1, false).is_none());
    let (frames, send) = publish_and_send(None);
    assert!(send.is_none());
    assert_eq!(decoded(&frames).traceparent, "");
    // Even a publication named traced sends nothing from a process whose spans go nowhere.
    let (subscriber, _p, _e) = traced(Sampler::AlwaysOn);
    let sc = tracing::subscriber::with_default(subscriber, || {
        api_change("EndpointSlice", &slice_meta("a"), Change::Apply)
    });
    let (frames, send) = publish_and_send(sc);
    assert!(send.is_none());
    assert_eq!(decoded(&frames).traceparent, "");
}

#[test]
fn not_sampled_sends_no_traceparent() {
    let (subscriber, provider, exporter) = traced(Sampler::AlwaysOff);
    tracing::subscriber::with_default(subscriber, || {
        let change = api_change("EndpointSlice", &slice_meta("a"), Change::Apply);
        assert_eq!(change, None, "not sampled");
        let (frames, send) = publish_and_send(change);
        assert!(send.is_none());
        assert_eq!(decoded(&frames).traceparent, "");
    });
    provider.force_flush().unwrap();
    assert!(exporter.get_finished_spans().unwrap().is_empty());
}

#[test]
fn a_sampled_change_reaches_the_node_and_its_ack() {
    let (subscriber, provider, exporter) = traced(Sampler::AlwaysOn);
    let traceparent = tracing::subscriber::with_default(subscriber, || {
        let change = api_change("EndpointSlice", &slice_meta("a"), Change::Apply).unwrap();
        let span = publication(std::slice::from_ref(&change), 1, false).unwrap();
        let sc = splitproxy_proto::telemetry::sampled(&span);
        let (frames, send) = publish_and_send(sc);
        drop(span);
        let send = send.expect("a sampled publication's send is traced");
        let tp = decoded(&frames).traceparent;
        send.ack(
            "n1",
            &Ack {
                generation: 1,
                ok: true,
                ..Ack::default()
            },
        );
        tp
    });
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let [event] = named(&spans, "api.change")[..] else {
        panic!("{spans:#?}")
    };
    let [publish] = named(&spans, "brain.publish")[..] else {
        panic!("{spans:#?}")
    };
    let [send] = named(&spans, "brain.send")[..] else {
        panic!("{spans:#?}")
    };
    let [ack] = named(&spans, "brain.ack")[..] else {
        panic!("{spans:#?}")
    };
    let trace_id = event.span_context.trace_id();
    assert_eq!(event.parent_span_id, opentelemetry::trace::SpanId::INVALID);
    let attr = |s: &SpanData, k: &str| {
        s.attributes
            .iter()
            .find(|kv| kv.key.as_str() == k)
            .map(|kv| kv.value.to_string())
    };
    assert_eq!(
        attr(event, "k8s.object.kind").as_deref(),
        Some("EndpointSlice")
    );
    assert_eq!(
        attr(event, "k8s.object.resource_version").as_deref(),
        Some("42")
    );
    assert_eq!(
        attr(event, TRIGGER_TIME).as_deref(),
        Some("2026-01-02T03:04:05Z")
    );
    assert_eq!(publish.parent_span_id, event.span_context.span_id());
    assert_eq!(send.parent_span_id, publish.span_context.span_id());
    assert_eq!(ack.parent_span_id, send.span_context.span_id());
    for s in [publish, send, ack] {
        assert_eq!(s.span_context.trace_id(), trace_id, "{}", s.name);
    }
    // The node's apply continues the send: the traceparent names it.
    assert_eq!(
        traceparent,
        format!("00-{}-{}-01", trace_id, send.span_context.span_id())
    );
}

#[test]
fn changes_folded_into_one_publication_are_linked() {
    let (subscriber, provider, exporter) = traced(Sampler::AlwaysOn);
    tracing::subscriber::with_default(subscriber, || {
        let a = api_change("EndpointSlice", &slice_meta("a"), Change::Apply).unwrap();
        let b = api_change("Service", &slice_meta("b"), Change::Delete).unwrap();
        drop(publication(&[a, b], 2, false).unwrap());
    });
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let events = named(&spans, "api.change");
    let [publish] = named(&spans, "brain.publish")[..] else {
        panic!("{spans:#?}")
    };
    assert_eq!(events.len(), 2);
    assert_ne!(
        events[0].span_context.trace_id(),
        events[1].span_context.trace_id(),
        "each change is a trace of its own"
    );
    let first = events
        .iter()
        .find(|e| e.span_context.span_id() == publish.parent_span_id)
        .expect("the publication continues the first change");
    let other = events
        .iter()
        .find(|e| e.span_context.span_id() != first.span_context.span_id())
        .unwrap();
    let linked: Vec<_> = publish
        .links
        .iter()
        .map(|l| l.span_context.span_id())
        .collect();
    assert_eq!(linked, [other.span_context.span_id()]);
}

/// A made-up sampled span context (the brain's own, as a publication's would be).
fn context(span: u64) -> SpanContext {
    use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};
    SpanContext::new(
        TraceId::from(u128::from(span) << 64 | 7),
        SpanId::from(span),
        TraceFlags::SAMPLED,
        false,
        TraceState::default(),
    )
}

#[test]
fn a_node_behind_several_traced_publications_continues_the_newest_and_links_the_others() {
    let fanout = Fanout::new(Arc::new(Metrics::default()), 4, 1024);
    let model = |n: u32| {
        let mut m = Model::default();
        m.apply(&splitproxy_proto::v1::RulesetDelta {
            upsert: vec![splitproxy_proto::v1::Table {
                family: splitproxy_proto::v1::Family::Ip as i32,
                name: format!("t{n}"),
                ..Default::default()
            }],
            remove: vec![],
        });
        Arc::new(m)
    };
    let publish = |n: u32, trace| {
        fanout.publish_traced(
            model(n),
            Default::default(),
            vec![],
            vec![],
            trace,
            Default::default(),
        )
    };
    assert_eq!(publish(1, None), Some(1));
    let Some(Next::Send(_, base)) = fanout.next_update("n1", None, &fanout.publication()) else {
        panic!("a snapshot")
    };
    assert_eq!(publish(2, Some(context(2))), Some(2));
    assert_eq!(publish(3, Some(context(3))), Some(3));
    assert_eq!(publish(4, None), Some(4));
    assert_eq!(fanout.traces_between(1, 4), [context(3), context(2)]);
    assert_eq!(fanout.traces_between(3, 4), []);
    assert_eq!(fanout.traces_between(0, 1), []);

    let (subscriber, provider, exporter) = traced(Sampler::AlwaysOn);
    let traceparent = tracing::subscriber::with_default(subscriber, || {
        let Some(Next::Send(mut frames, _)) =
            fanout.next_update("n1", Some(&base), &fanout.publication())
        else {
            panic!("a delta from version 1 to 4")
        };
        drop(node_send(&fanout, "n1", Some(1), 4, &mut frames).unwrap());
        decoded(&frames).traceparent
    });
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let [send] = named(&spans, "brain.send")[..] else {
        panic!("{spans:#?}")
    };
    assert_eq!(
        send.parent_span_id,
        context(3).span_id(),
        "the newest traced one"
    );
    assert_eq!(send.span_context.trace_id(), context(3).trace_id());
    let linked: Vec<_> = send.links.iter().map(|l| l.span_context.clone()).collect();
    assert_eq!(linked, [context(2)]);
    assert_eq!(
        traceparent,
        format!(
            "00-{}-{}-01",
            context(3).trace_id(),
            send.span_context.span_id()
        )
    );
}
