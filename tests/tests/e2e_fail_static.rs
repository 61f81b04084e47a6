//! Fail static and restart without disruption (docs/invariants.md), with real traffic:
//! a node keeps forwarding while the brain is gone, resyncs when it returns, and an actuator
//! restart neither flushes nor interrupts anything.
use std::time::{Duration, Instant};

use splitproxy_tests::fixtures::{Ep, slice};
use splitproxy_tests::lab::{Lab, LabOptions};
use splitproxy_tests::traffic::{ConnectionLoop, web_service_with_client};
use splitproxy_tests::{Pod, Proto, probe_async};

const WEB: &str = "10.96.2.10:80";

async fn setup() -> (Lab, Pod) {
    let lab = Lab::start(LabOptions::new(env!("CARGO_BIN_EXE_splitproxy-lab")))
        .await
        .expect("lab starts");
    let client = web_service_with_client(&lab, "fs", "10.96.2.10").await;
    (lab, client)
}

async fn wait_in_sync(lab: &Lab, timeout: Duration) {
    let start = Instant::now();
    loop {
        if let Ok(mut c) = lab.operator_client(0).await
            && let Ok(r) = c
                .list_nodes(splitproxy_proto::v1::ListNodesRequest {})
                .await
        {
            let r = r.into_inner();
            if r.synced && r.nodes.len() == 2 && r.nodes.iter().all(|n| n.connected && n.in_sync) {
                return;
            }
        }
        assert!(
            start.elapsed() < timeout,
            "nodes did not resync within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn brain_outage_keeps_traffic_flowing_and_resync_drops_nothing() {
    let (mut lab, client) = setup().await;
    lab.stop_brain(0).unwrap();
    // New connections still succeed with the brain gone.
    for _ in 0..20 {
        let r = probe_async(
            client.netns(),
            Proto::Tcp,
            WEB.parse().unwrap(),
            None,
            Duration::from_secs(2),
        )
        .await;
        assert!(r.is_answered(), "with the brain down: {r:?}");
    }
    // Give the actuators time to notice and back off.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for i in 0..2 {
        let m = lab.actuator_metrics(i).unwrap();
        assert_eq!(
            splitproxy_tests::deploy::metric(&m, "splitproxy_actuator_connected"),
            Some(0.0),
            "node {i} noticed"
        );
    }

    // Start the brain again with a connection loop running: not one connection fails.
    let looper = ConnectionLoop::start(
        vec![client.clone()],
        WEB.parse().unwrap(),
        5000,
        Duration::from_secs(120),
        Duration::from_secs(2),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    lab.start_brain(0).unwrap();
    wait_in_sync(&lab, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (failures, n) = looper.stop().await;
    assert!(n > 20, "the loop made {n} connections");
    assert!(
        failures.is_empty(),
        "{} of {n} connections failed during resync: {failures:?}",
        failures.len()
    );
    // The fresh brain (a new epoch) computed the same state from the API server: the nodes
    // resumed on it by the content they hold, without a second snapshot (docs/protocol.md,
    // "Resumption").
    for i in 0..2 {
        let m = lab.actuator_metrics(i).unwrap();
        assert_eq!(
            splitproxy_tests::deploy::metric(&m, "splitproxy_actuator_snapshots_applied_total"),
            Some(1.0)
        );
        assert_eq!(
            splitproxy_tests::deploy::metric(&m, "splitproxy_actuator_apply_errors_total"),
            Some(0.0)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn actuator_restart_keeps_rules_and_drops_nothing() {
    let (mut lab, client) = setup().await;
    let looper = ConnectionLoop::start(
        vec![client.clone()],
        WEB.parse().unwrap(),
        5000,
        Duration::from_secs(120),
        Duration::from_secs(2),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Exit never flushes: with both actuators stopped, traffic still flows.
    lab.stop_actuator(0).unwrap();
    lab.stop_actuator(1).unwrap();
    let table = lab
        .cluster
        .node(0)
        .netns()
        .exec_ok(&["nft", "list", "table", "ip", "splitproxy"])
        .unwrap();
    assert!(
        table.contains("10.96.2.10 . tcp . 80"),
        "rules stay after exit:\n{table}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A restarted actuator adopts its table (one atomic replace) without disruption.
    lab.start_actuator(0).unwrap();
    lab.start_actuator(1).unwrap();
    lab.wait_ready(Duration::from_secs(30)).unwrap();
    wait_in_sync(&lab, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (failures, n) = looper.stop().await;
    assert!(n > 20, "the loop made {n} connections");
    assert!(
        failures.is_empty(),
        "{} of {n} connections failed across actuator restarts: {failures:?}",
        failures.len()
    );
    let table = lab
        .cluster
        .node(0)
        .netns()
        .exec_ok(&["nft", "list", "table", "ip", "splitproxy"])
        .unwrap();
    assert_eq!(table.matches("table ip splitproxy").count(), 1);
    assert_eq!(
        table.matches("10.244.0.21 . 8080").count(),
        1,
        "the adopted table holds each element once:\n{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reconnecting_to_the_same_brain_resumes_with_deltas() {
    let (mut lab, client) = setup().await;
    wait_in_sync(&lab, Duration::from_secs(10)).await;
    let count = |lab: &Lab, name: &str| {
        splitproxy_tests::deploy::metric(&lab.actuator_metrics(0).unwrap(), name).unwrap()
    };
    let snapshots = count(&lab, "splitproxy_actuator_snapshots_applied_total");
    let deltas = count(&lab, "splitproxy_actuator_deltas_applied_total");
    assert_eq!(snapshots, 1.0, "a node starts with one snapshot");

    // A blip: node-0's stream breaks; it reconnects to the same brain, which still knows the
    // generation it acked, so it is not sent a snapshot again.
    lab.relink_actuator(0).unwrap();
    let start = Instant::now();
    loop {
        let mut c = lab.operator_client(0).await.unwrap();
        let nodes = c
            .list_nodes(splitproxy_proto::v1::ListNodesRequest {})
            .await
            .unwrap()
            .into_inner()
            .nodes;
        let n0 = nodes.iter().find(|n| n.node == "node-0").unwrap();
        // The brain records the new connection's peer address.
        if n0.connected
            && n0.in_sync
            && count(&lab, "splitproxy_actuator_connected") == 1.0
            && start.elapsed() > Duration::from_millis(500)
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "node-0 did not reconnect"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The next change arrives as a delta on top of the resumed generation.
    lab.apply_yaml(&slice(
        "fs",
        "web-1",
        "web",
        &[("http", "TCP", 8080)],
        &[Ep::new("10.244.0.21", "node-0", "web-a")],
    ))
    .await
    .unwrap();
    let start = Instant::now();
    loop {
        let seen = probe_async(
            client.netns(),
            Proto::Tcp,
            WEB.parse().unwrap(),
            None,
            Duration::from_millis(500),
        )
        .await;
        if seen.pod() == Some("web-a")
            && count(&lab, "splitproxy_actuator_deltas_applied_total") > deltas
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the change did not arrive: {seen:?}"
        );
    }
    assert_eq!(
        count(&lab, "splitproxy_actuator_snapshots_applied_total"),
        snapshots,
        "resumed without a snapshot"
    );
    assert_eq!(count(&lab, "splitproxy_actuator_apply_errors_total"), 0.0);
}
