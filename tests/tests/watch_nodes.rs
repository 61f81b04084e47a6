//! `WatchNodes` (issue #13, "which nodes are unhealthy, live?"): a lab with two nodes and a brain;
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
    eprintln!("[watch_nodes] DISCONNECTED after {:.1?}", stopped.elapsed());
    lab.start_actuator(1).unwrap();
    let kinds = until(&mut stream, "node-1", Kind::InSync, Duration::from_secs(20)).await;
    assert!(kinds.contains(&Kind::Connected), "{kinds:?}");

    // The same through plain grpcurl and reflection, ended by its own time limit.
    let grpcurl = splitproxy_tests::tools::binary("grpcurl").unwrap();
    let op = &lab.operator_tls;
    let out = std::process::Command::new(&grpcurl)
        .arg("-cacert")
        .arg(&op.ca)
        .arg("-cert")
        .arg(&op.cert)
        .arg("-key")
        .arg(&op.key)
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
