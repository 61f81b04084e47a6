//! The chart installed on the lab's nodes as a cluster runs it (tests/src/install.rs): its
//! rendered objects applied to the real API server (Node authorizer and NodeRestriction on),
//! brains and actuators started with exactly the rendered command lines, environment and
//! mounted files, ServiceAccount tokens from the TokenRequest API bound to Pods on their nodes,
//! the brains' own CA in the Secret and ConfigMap they write, and the brains found through the
//! EndpointSlices of their headless Service. No certificate is made by the test.
//!
//! 1. Every actuator becomes ready and a Service answers from a pod through its ClusterIP, with
//!    the chart's RBAC, identity and discovery only.
//! 2. Refusals on the real path: a node's token claiming another node, another account's token
//!    (with and without the operator ClusterRole), a token for the API server's audience, and
//!    no credentials at all; each refused and counted by reason.
//! 3. `helm test` (the chart's test pod, run the same way) passes.
//! 4. The brain serving the client's node is killed (its Pod deleted, so its endpoint leaves the
//!    EndpointSlice): every node is back in sync through the other brain, found by listing the
//!    EndpointSlices, and a bounded connection loop through the ClusterIP loses nothing.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use splitproxy_proto::v1::{Hello, ListNodesRequest, SyncRequest, sync_request};
use splitproxy_tests::install::InstallOptions;
use splitproxy_tests::lab::{Lab, LabOptions};
use splitproxy_tests::traffic::{ConnectionLoop, web_service_with_client};
use tokio_stream::wrappers::ReceiverStream;

const WEB: &str = "10.96.3.10";

/// How a Sync stream opened with `token` as `node` ends or continues: `Ok` when an update
/// arrived, the refusal otherwise.
async fn open_sync(lab: &Lab, brain: &str, token: Option<&str>, node: &str) -> tonic::Code {
    let install = lab.install.as_ref().unwrap();
    let mut client = install.client_with_token(brain, token).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(SyncRequest {
        msg: Some(sync_request::Msg::Hello(Hello {
            node: node.into(),
            version: "chart_lab".into(),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut updates = match client.sync(ReceiverStream::new(rx)).await {
        Ok(s) => s.into_inner(),
        Err(status) => return status.code(),
    };
    match tokio::time::timeout(Duration::from_secs(10), updates.message()).await {
        Ok(Ok(Some(_))) => tonic::Code::Ok,
        Ok(Ok(None)) => tonic::Code::Cancelled,
        Ok(Err(status)) => status.code(),
        Err(_) => tonic::Code::DeadlineExceeded,
    }
}

/// Which nodes each brain pod serves (connected), by pod.
async fn served(lab: &Lab) -> Vec<(String, Vec<String>)> {
    let install = lab.install.as_ref().unwrap();
    let mut out = Vec::new();
    for (pod, _) in install.pods_of("brain") {
        let nodes = match install.operator_client(&pod).await {
            Ok(mut c) => match c.list_nodes(ListNodesRequest {}).await {
                Ok(r) => r
                    .into_inner()
                    .nodes
                    .into_iter()
                    .filter(|n| n.connected)
                    .map(|n| n.node)
                    .collect(),
                Err(_) => Vec::new(),
            },
            Err(_) => Vec::new(),
        };
        out.push((pod, nodes));
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_installed_chart_serves_refuses_and_fails_over() {
    let began = Instant::now();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let mut opts = LabOptions::new(exe);
    opts.nodes = 3;
    opts.install = Some(InstallOptions::default());
    let mut lab = Lab::start(opts)
        .await
        .expect("the chart installs and every actuator is ready");
    eprintln!(
        "[chart_lab] installed, every actuator ready: {:.1?}",
        began.elapsed()
    );
    let install = lab.install.as_ref().unwrap();

    // No certificate anywhere in the command lines: tokens and the brains' own CA.
    let brains = install.pods_of("brain");
    let actuators = install.pods_of("actuator");
    assert_eq!(brains.len(), 2, "{brains:?}");
    assert_eq!(actuators.len(), 3, "{actuators:?}");
    assert!(install.brain_arg("--tls-secret").is_some());
    assert!(install.brain_arg("--client-ca").is_none());

    // 1. A Service through its ClusterIP.
    let client = web_service_with_client(&lab, "cl", WEB).await;
    lab.wait_synced(Duration::from_secs(30)).await.unwrap();

    // 2. Refusals on the real path.
    let install = lab.install.as_ref().unwrap();
    let brain = &brains[0].0;
    let node1_pod = &actuators.iter().find(|(_, n)| *n == 1).unwrap().0;
    let node1_token = install.token_of(node1_pod, "brain-token").unwrap();
    assert_eq!(
        open_sync(&lab, brain, Some(&node1_token), "node-1").await,
        tonic::Code::Ok,
        "node-1's own token opens node-1's stream"
    );
    let other = install.operator_token("lab-somebody", false).await.unwrap();
    let operator = install.operator_token("lab-operator", true).await.unwrap();
    let cases: [(&str, Option<&str>, tonic::Code, &str); 4] = [
        (
            "node-1's token claiming node-0",
            Some(&node1_token),
            tonic::Code::PermissionDenied,
            "other_node",
        ),
        (
            "another account's token",
            Some(&other),
            tonic::Code::PermissionDenied,
            "no_role",
        ),
        (
            "an operator's token",
            Some(&operator),
            tonic::Code::PermissionDenied,
            "not_a_node",
        ),
        (
            "no credentials",
            None,
            tonic::Code::Unauthenticated,
            "no_identity",
        ),
    ];
    for (what, token, code, reason) in cases {
        let before = refused(&lab, brain, reason);
        let got = open_sync(&lab, brain, token, "node-0").await;
        assert_eq!(got, code, "{what}");
        let after = refused(&lab, brain, reason);
        assert!(
            after > before,
            "{what}: refused_total{{reason={reason}}} {before} -> {after}"
        );
    }
    eprintln!("[chart_lab] refusals checked: {:.1?}", began.elapsed());

    // 3. helm test.
    let (passed, log) = install.helm_test(2).await.unwrap();
    assert!(passed, "helm test failed:\n{log}");
    eprintln!("[chart_lab] helm test passed: {:.1?}", began.elapsed());

    // 4. Kill the brain serving the client's node (node-0), under traffic.
    let serving = served(&lab).await;
    let victim = serving
        .iter()
        .find(|(_, nodes)| nodes.iter().any(|n| n == "node-0"))
        .map(|(pod, _)| pod.clone())
        .unwrap_or_else(|| panic!("no brain serves node-0: {serving:?}"));
    let dst = SocketAddr::new(WEB.parse().unwrap(), 80);
    let traffic = ConnectionLoop::start(
        vec![client.clone()],
        dst,
        400,
        Duration::from_secs(40),
        Duration::from_secs(2),
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = Instant::now();
    install.kill_pod(&victim).await.unwrap();
    let survivor = brains
        .iter()
        .map(|(p, _)| p.clone())
        .find(|p| *p != victim)
        .unwrap();
    let all = ["node-0", "node-1", "node-2"];
    let moved = loop {
        let serving = served(&lab).await;
        let on_survivor = serving
            .iter()
            .find(|(p, _)| *p == survivor)
            .map(|(_, n)| n.clone())
            .unwrap_or_default();
        if all.iter().all(|n| on_survivor.iter().any(|m| m == n)) {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "the nodes did not move to {survivor}: {serving:?}\n{}",
            install.log_tail(&actuators[0].0, 30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    lab.wait_synced(Duration::from_secs(20)).await.unwrap();
    let (failures, made) = traffic.stop().await;
    eprintln!(
        "[chart_lab] brain {victim} killed: every node on {survivor} after {moved:.1?}; \
         {made} connections, {} failed",
        failures.len()
    );
    assert!(made > 10, "the loop made only {made} connections");
    assert!(
        failures.is_empty(),
        "{} of {made} connections failed: {:?}",
        failures.len(),
        failures.iter().map(|f| &f.result).collect::<Vec<_>>()
    );
    lab.install = None;
    eprintln!("[chart_lab] total {:.1?}", began.elapsed());
}

/// `splitproxy_brain_refused_total{reason}` on brain pod `brain`.
fn refused(lab: &Lab, brain: &str, reason: &str) -> f64 {
    let install = lab.install.as_ref().unwrap();
    let (_, text) = install.brain_http(brain, "/metrics").unwrap();
    let series = format!("splitproxy_brain_refused_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}
