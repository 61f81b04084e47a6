//! The operators' questions beyond ListNodes (issue #13), in a lab with two nodes and a brain.
//!
//! `WatchNodes` ("which nodes are unhealthy, live?"):
//! an operator's stream first reports both nodes as they are (INITIAL, connected and in sync),
//! then an actuator stopped is reported DISCONNECTED and, started again, CONNECTED and IN_SYNC;
//! plain grpcurl through reflection shows the same live view; a node's own certificate sees only
//! itself.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use splitproxy_proto::v1::node_event::Kind;
use splitproxy_proto::v1::{NodeEvent, WatchNodesRequest};
use splitproxy_tests::lab::{Lab, LabOptions};

/// The next event of `stream`, within `limit`.
async fn next(stream: &mut tonic::Streaming<NodeEvent>, limit: Duration) -> NodeEvent {
    tokio::time::timeout(limit, stream.message())
        .await
        .expect("an event in time")
        .expect("the stream stays open")
        .expect("the stream did not end")
}

/// Reads events until `node` gets `kind`; returns the kinds seen for it on the way.
async fn until(
    stream: &mut tonic::Streaming<NodeEvent>,
    node: &str,
    kind: Kind,
    limit: Duration,
) -> Vec<Kind> {
    let deadline = Instant::now() + limit;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no {kind:?} for {node} within {limit:?}: {seen:?}"
        );
        let event = next(stream, left).await;
        let got = event.kind();
        let status = event.status.unwrap_or_default();
        if status.node == node {
            seen.push(got);
            if got == kind {
                return seen;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn watch_nodes_is_a_live_view_of_connections() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let mut opts = LabOptions::new(exe);
    opts.nodes = 2;
    let mut lab = Lab::start(opts).await.unwrap();
    lab.wait_synced(Duration::from_secs(20)).await.unwrap();

    let mut client = lab.operator_client(0).await.unwrap();
    let mut stream = client
        .watch_nodes(WatchNodesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let mut initial = Vec::new();
    for _ in 0..2 {
        let event = next(&mut stream, Duration::from_secs(5)).await;
        assert_eq!(event.kind(), Kind::Initial, "{event:?}");
        let status = event.status.clone().unwrap();
        assert!(status.connected && status.in_sync, "{status:?}");
        initial.push(status.node);
    }
    assert_eq!(initial, ["node-0", "node-1"]);

    let stopped = Instant::now();
    lab.stop_actuator(1).unwrap();
    until(
        &mut stream,
        "node-1",
        Kind::Disconnected,
        Duration::from_secs(10),
    )
    .await;
    eprintln!(
        "[introspection] DISCONNECTED after {:.1?}",
        stopped.elapsed()
    );
    lab.start_actuator(1).unwrap();
    let kinds = until(&mut stream, "node-1", Kind::InSync, Duration::from_secs(20)).await;
    assert!(kinds.contains(&Kind::Connected), "{kinds:?}");

    // The same through plain grpcurl and reflection, ended by its own time limit.
    let out = splitproxy_tests::tools::grpcurl(&lab.operator_tls)
        .unwrap()
        .args(["-max-time", "2"])
        .arg(lab.brain(0).grpc.to_string())
        .arg("splitproxy.v1.Dataplane/WatchNodes")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.matches("\"kind\": \"INITIAL\"").count() == 2
            && text.contains("node-0")
            && text.contains("node-1"),
        "grpcurl WatchNodes:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A node sees only itself.
    let node0 = lab
        .pki
        .write(
            lab.dir(),
            "node0-watch",
            &lab.pki.node_cert("node-0").unwrap(),
        )
        .unwrap();
    let mut own = splitproxy_tests::deploy::grpc_client(lab.brain(0).grpc, &node0)
        .await
        .unwrap();
    let mut mine = own
        .watch_nodes(WatchNodesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let event = next(&mut mine, Duration::from_secs(5)).await;
    assert_eq!(event.status.unwrap().node, "node-0");
    assert!(
        tokio::time::timeout(Duration::from_millis(800), mine.message())
            .await
            .is_err(),
        "node-0's watch shows another node"
    );
}

/// `GetService` (issue #13, "is my change live everywhere?"): a Service's ports and endpoints,
/// the publication that carries its latest change, where each node stands with it, a summary
/// line, and the change's rollout latency. A change made while one node is disconnected shows
/// as applied on the other only; a node's certificate may not ask.
#[tokio::test(flavor = "multi_thread")]
async fn get_service_says_where_a_change_is_live() {
    use splitproxy_proto::v1::GetServiceRequest;
    use splitproxy_proto::v1::service_rollout::State;
    use splitproxy_tests::fixtures::{Ep, docs, slice};

    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let mut opts = LabOptions::new(exe);
    opts.nodes = 2;
    let mut lab = Lab::start(opts).await.unwrap();
    let _client =
        splitproxy_tests::traffic::web_service_with_client(&lab, "gs", "10.96.4.10").await;
    lab.wait_synced(Duration::from_secs(20)).await.unwrap();
    let ask = || GetServiceRequest {
        namespace: "gs".into(),
        name: "web".into(),
    };
    let mut op = lab.operator_client(0).await.unwrap();
    let before = op.get_service(ask()).await.unwrap().into_inner();
    assert_eq!(before.cluster_ips, ["10.96.4.10"]);
    assert_eq!(before.ports.len(), 1, "{:?}", before.ports);
    assert_eq!(
        (before.ports[0].port, before.ports[0].protocol.as_str()),
        (80, "TCP")
    );
    assert_eq!(before.endpoints.len(), 2, "{:?}", before.endpoints);
    assert!(before.changed_version > 0, "{before:?}");
    assert!(
        before.changed_objects.iter().any(|o| o.contains("gs/web")),
        "{:?}",
        before.changed_objects
    );
    assert_eq!(before.summary, "applied on 2 of 2 nodes", "{before:?}");
    let latency = before.latency.expect("the change's rollout latency");
    assert!(latency.nodes >= 1 && latency.max.is_some(), "{latency:?}");

    // The same as a stream, followed below to the last node.
    let mut watch = op.watch_service(ask()).await.unwrap().into_inner();
    let first = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.changed_version, before.changed_version);

    // node-1 away, one endpoint removed: live on node-0 only.
    lab.stop_actuator(1).unwrap();
    lab.apply_yaml(&docs(&[slice(
        "gs",
        "web-1",
        "web",
        &[("http", "TCP", 8080)],
        &[Ep::new("10.244.0.21", "node-0", "web-a")],
    )]))
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let now = op.get_service(ask()).await.unwrap().into_inner();
        let applied0 = now
            .nodes
            .iter()
            .any(|n| n.node == "node-0" && n.state() == State::Applied);
        if now.changed_version > before.changed_version && now.endpoints.len() == 1 && applied0 {
            break now;
        }
        assert!(
            Instant::now() < deadline,
            "the change never showed: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let node1 = after.nodes.iter().find(|n| n.node == "node-1").unwrap();
    assert_eq!(node1.state(), State::Disconnected, "{after:?}");
    assert_eq!(after.summary, "applied on 1 of 2 nodes, 1 disconnected");

    // The stream shows the partial rollout (read before node-1 comes back, so no poll can miss
    // it), then, node-1 back, the change reaching it.
    let read = |limit: Duration| {
        let deadline = Instant::now() + limit;
        move || deadline.saturating_duration_since(Instant::now())
    };
    let left = read(Duration::from_secs(10));
    loop {
        let next = tokio::time::timeout(left(), watch.message())
            .await
            .expect("the stream never showed the partial rollout")
            .unwrap()
            .unwrap();
        if next.changed_version == after.changed_version
            && next.summary == "applied on 1 of 2 nodes, 1 disconnected"
        {
            break;
        }
    }
    lab.start_actuator(1).unwrap();
    let left = read(Duration::from_secs(20));
    loop {
        let next = tokio::time::timeout(left(), watch.message())
            .await
            .expect("the rollout never completed")
            .unwrap()
            .unwrap();
        if next.changed_version == after.changed_version
            && next.summary == "applied on 2 of 2 nodes"
        {
            break;
        }
    }

    // Unknown Services and nodes' certificates.
    let err = op
        .get_service(GetServiceRequest {
            namespace: "gs".into(),
            name: "nothing".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    let node0 = lab
        .pki
        .write(lab.dir(), "node0-gs", &lab.pki.node_cert("node-0").unwrap())
        .unwrap();
    let mut node = splitproxy_tests::deploy::grpc_client(lab.brain(0).grpc, &node0)
        .await
        .unwrap();
    let err = node.get_service(ask()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
}

/// `ExplainPacket` (issue #13, "what happens to this packet on that node?"): through plain
/// grpcurl and reflection, a pod's packet to a ClusterIP explained with both candidates at
/// half each and the path; the same through the generated client; invalid requests refused;
/// a node's certificate may ask about its own node only.
#[tokio::test(flavor = "multi_thread")]
async fn explain_packet_through_grpcurl_and_the_node_scope() {
    use splitproxy_proto::v1::{ExplainPacketRequest, PacketFate};

    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let mut opts = LabOptions::new(exe);
    opts.nodes = 2;
    let lab = Lab::start(opts).await.unwrap();
    let _client =
        splitproxy_tests::traffic::web_service_with_client(&lab, "xp", "10.96.6.10").await;
    lab.wait_synced(Duration::from_secs(20)).await.unwrap();

    let run = |args: &[&str]| {
        splitproxy_tests::tools::grpcurl(&lab.operator_tls)
            .unwrap()
            .args(args)
            .output()
            .unwrap()
    };
    let brain = lab.brain(0).grpc.to_string();
    let methods = run(&[&brain, "list", "splitproxy.v1.Dataplane"]);
    let methods = String::from_utf8_lossy(&methods.stdout);
    assert!(
        methods.contains("splitproxy.v1.Dataplane.ExplainPacket"),
        "{methods}"
    );
    let out = run(&[
        "-d",
        r#"{"node": "node-0", "source_ip": "10.244.0.100", "destination_ip": "10.96.6.10", "destination_port": 80, "protocol": "tcp", "ingress_interface": "pod0"}"#,
        &brain,
        "splitproxy.v1.Dataplane/ExplainPacket",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && text.contains("\"fate\": \"PACKET_FATE_DNAT\"")
            && text.contains("\"dnatAddress\": \"10.244.0.21\"")
            && text.contains("\"dnatAddress\": \"10.244.1.21\"")
            && text.contains("\"share\": 0.5")
            && text.contains("@service-ports-2"),
        "grpcurl ExplainPacket:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let ask = |node: &str, dst: &str| ExplainPacketRequest {
        node: node.into(),
        source_ip: "10.244.0.100".into(),
        destination_ip: dst.into(),
        destination_port: 80,
        ingress_interface: "pod0".into(),
        ..Default::default()
    };
    let mut client = lab.operator_client(0).await.unwrap();
    let r = client
        .explain_packet(ask("node-0", "10.96.6.10"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.fate(), PacketFate::Dnat, "{}", r.text);
    assert!(r.generation > 0);
    assert!(r.text.contains("verdict: 2 outcomes"), "{}", r.text);
    // An unallocated address of the service CIDR: dropped.
    let r = client
        .explain_packet(ask("node-0", "10.96.6.99"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.fate(), PacketFate::Dropped, "{}", r.text);
    let err = client
        .explain_packet(ask("node-0", "not-an-address"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");

    // A node's certificate: its own node only.
    let node0 = lab
        .pki
        .write(lab.dir(), "node0-xp", &lab.pki.node_cert("node-0").unwrap())
        .unwrap();
    let mut node = splitproxy_tests::deploy::grpc_client(lab.brain(0).grpc, &node0)
        .await
        .unwrap();
    let own = node.explain_packet(ask("node-0", "10.96.6.10")).await;
    assert!(own.is_ok(), "{own:?}");
    let err = node
        .explain_packet(ask("node-1", "10.96.6.10"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
}
