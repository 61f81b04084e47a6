//! OpenTelemetry traces of one API change (issue #13, "Traces and metrics"), exported by a real
//! brain and real actuators over OTLP gRPC to the harness's receiver ([`OtlpReceiver`]).
//!
//! A lab of two nodes, configured only through the standard OTEL_* variables (the brain samples
//! every new trace; the actuators keep the default sampler, parent-based, so they follow the
//! brain's decision carried in the update). One EndpointSlice change must give one trace: the
//! brain's watch event (kind, namespace, name, resourceVersion, the slice's trigger time), its
//! publication (a child, with the version it produced), and for every node the brain's send (a
//! child of the publication), the actuator's apply (a child of the send, in another process:
//! the trace id crossed in the Update) and the brain's record of the ack (a child of the send).
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use splitproxy_tests::fixtures::{Ep, docs, namespace, service, slice};
use splitproxy_tests::lab::{Lab, LabOptions};
use splitproxy_tests::otlp::{OtlpReceiver, ReceivedSpan};

/// Where actuators reach the receiver from inside their node namespace.
const RECEIVER_IN_NODE: &str = "127.0.0.1:14317";
const TRIGGER: &str = "2026-01-02T03:04:05Z";
const NODES: [&str; 2] = ["node-0", "node-1"];

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The trace of the change to slice `tr/web-1`, once every span of it has arrived: the watch
/// event, the publication and, per node, send, apply and ack.
fn complete_trace(spans: &[ReceivedSpan]) -> Option<Vec<ReceivedSpan>> {
    let event = spans.iter().rev().find(|s| {
        s.name == "api.change"
            && s.attr("k8s.object.kind") == Some("EndpointSlice")
            && s.attr("k8s.object.name") == Some("web-1")
    })?;
    let trace: Vec<ReceivedSpan> = spans
        .iter()
        .filter(|s| s.trace_id == event.trace_id)
        .cloned()
        .collect();
    let count = |name: &str| trace.iter().filter(|s| s.name == name).count();
    let done = count("brain.publish") == 1
        && count("brain.send") == NODES.len()
        && count("actuator.apply") == NODES.len()
        && count("brain.ack") == NODES.len();
    done.then_some(trace)
}

#[tokio::test(flavor = "multi_thread")]
async fn one_change_is_one_trace_across_brain_and_nodes() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let inside: SocketAddr = RECEIVER_IN_NODE.parse().unwrap();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let mut opts = LabOptions::new(exe);
    opts.nodes = NODES.len();
    let brain_endpoint = receiver.endpoint();
    opts.brain.env = env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &brain_endpoint),
        ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
        ("OTEL_TRACES_SAMPLER_ARG", "1.0"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ]);
    opts.actuator.forwards = vec![(inside, receiver.addr())];
    let actuator_endpoint = format!("http://{inside}");
    opts.actuator.env = env(&[
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &actuator_endpoint),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ]);
    let lab = Lab::start(opts).await.unwrap();
    lab.wait_synced(Duration::from_secs(20)).await.unwrap();

    // The Service first, then the change under test alone in its publication.
    lab.apply_yaml(&docs(&[
        namespace("tr"),
        service("tr", "web", "10.96.7.10", &[("http", "TCP", 80, 8080)]),
    ]))
    .await
    .unwrap();
    lab.wait_synced(Duration::from_secs(20)).await.unwrap();
    let annotated = slice(
        "tr",
        "web-1",
        "web",
        &[("http", "TCP", 8080)],
        &[
            Ep::new("10.244.0.31", "node-0", "web-a"),
            Ep::new("10.244.1.31", "node-1", "web-b"),
        ],
    )
    .replacen(
        "metadata:\n",
        &format!(
            "metadata:\n  annotations:\n    endpoints.kubernetes.io/last-change-trigger-time: \"{TRIGGER}\"\n"
        ),
        1,
    );
    lab.apply_yaml(&docs(&[annotated])).await.unwrap();
    lab.wait_synced(Duration::from_secs(20)).await.unwrap();

    let deadline = Instant::now() + Duration::from_secs(30);
    let trace = loop {
        if let Some(t) = complete_trace(&receiver.spans()) {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "no complete trace of the slice change within 30 s; received: {:#?}\nbrain log:\n{}",
            receiver
                .spans()
                .iter()
                .map(|s| (&s.service, &s.name, &s.trace_id))
                .collect::<Vec<_>>(),
            lab.brain(0).child.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let one = |name: &str| trace.iter().find(|s| s.name == name).unwrap().clone();
    let event = one("api.change");
    assert_eq!(event.service, "splitproxy-brain");
    assert!(
        event.parent_span_id.is_empty(),
        "the watch event is the root"
    );
    assert_eq!(event.attr("k8s.namespace.name"), Some("tr"));
    assert!(
        event
            .attr("k8s.object.resource_version")
            .is_some_and(|v| !v.is_empty()),
        "{event:?}"
    );
    assert_eq!(
        event.attr("endpoints.kubernetes.io/last-change-trigger-time"),
        Some(TRIGGER)
    );

    let publish = one("brain.publish");
    assert_eq!(publish.parent_span_id, event.span_id, "{publish:?}");
    let version: u64 = publish
        .attr("splitproxy.version")
        .and_then(|v| v.parse().ok())
        .expect("the publication names the version it produced");
    assert!(version > 0);

    for node in NODES {
        let send = trace
            .iter()
            .find(|s| s.name == "brain.send" && s.attr("k8s.node.name") == Some(node))
            .unwrap_or_else(|| panic!("no send to {node}: {trace:#?}"));
        assert_eq!(send.parent_span_id, publish.span_id, "{send:?}");
        assert_eq!(
            send.attr("splitproxy.version"),
            Some(version.to_string().as_str())
        );
        let generation = send.attr("splitproxy.generation").unwrap();

        let applies: Vec<_> = trace
            .iter()
            .filter(|s| s.name == "actuator.apply" && s.parent_span_id == send.span_id)
            .collect();
        assert_eq!(
            applies.len(),
            1,
            "{node}'s apply under its send: {trace:#?}"
        );
        let apply = applies[0];
        assert_eq!(apply.service, "splitproxy-actuator");
        assert_eq!(apply.attr("splitproxy.generation"), Some(generation));
        assert_eq!(apply.attr("splitproxy.ok"), Some("true"), "{apply:?}");
        let messages: u64 = apply
            .attr("splitproxy.transaction.messages")
            .and_then(|v| v.parse().ok())
            .unwrap();
        assert!(messages > 0, "the change was committed: {apply:?}");
        assert!(apply.attr("splitproxy.kernel_ms").is_some(), "{apply:?}");

        let ack = trace
            .iter()
            .find(|s| s.name == "brain.ack" && s.parent_span_id == send.span_id)
            .unwrap_or_else(|| panic!("no ack of {node} under its send: {trace:#?}"));
        assert_eq!(ack.service, "splitproxy-brain");
        assert_eq!(ack.attr("splitproxy.ack.ok"), Some("true"));
        assert_eq!(ack.attr("splitproxy.generation"), Some(generation));
    }
}
