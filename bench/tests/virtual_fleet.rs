//! Virtual nodes (as the scale benchmark uses them) against a real brain: each one a real mTLS
//! stream, all converging on the brain's state, with deltas after the first snapshot and
//! trigger times carried to them. The lab runs its brain and real actuators from the bench
//! binary, which is multi-call like the lab's (`splitproxy-bench brain|actuator ...`).
use std::time::{Duration, Instant};

use splitproxy_bench::fleet::{FleetConfig, FleetNode, VirtualFleet};
use splitproxy_tests::deploy::metric;
use splitproxy_tests::fixtures::{Ep, docs, namespace, service, slice};
use splitproxy_tests::lab::{Lab, LabOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn virtual_nodes_converge_and_share_encoded_updates() {
    let lab = Lab::start(LabOptions::new(env!("CARGO_BIN_EXE_splitproxy-bench")))
        .await
        .expect("lab starts");
    lab.apply_yaml(&docs(&[
        namespace("vf"),
        service("vf", "web", "10.96.7.10", &[("http", "TCP", 80, 8080)]),
        slice(
            "vf",
            "web-1",
            "web",
            &[("http", "TCP", 8080)],
            &[Ep::new("10.244.0.71", "node-0", "web-a")],
        ),
    ]))
    .await
    .unwrap();
    let nodes: Vec<FleetNode> = (0..40)
        .map(|i| {
            let c = lab.pki.node_cert(&format!("virtual-{i}")).unwrap();
            FleetNode {
                name: format!("virtual-{i}"),
                cert_pem: c.cert_pem.into_bytes(),
                key_pem: c.key_pem.into_bytes(),
            }
        })
        .collect();
    let fleet = VirtualFleet::start(FleetConfig {
        brains: vec![format!("https://{}", lab.brain(0).grpc)],
        server_name: Some("127.0.0.1".into()),
        ca_pem: lab.pki.ca_pem().as_bytes().to_vec(),
        nodes,
    })
    .expect("the fleet's CA parses");
    // Every node connected and holding one and the same state, other than `not`.
    let converged = |not: Option<&Vec<u8>>| {
        let s = fleet.status();
        s.connected == 40
            && s.digests.len() == 1
            && s.digests
                .iter()
                .next()
                .is_some_and(|(d, n)| *n == 40 && Some(d) != not)
    };
    let start = Instant::now();
    while !converged(None) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "fleet did not converge: {:?}",
            fleet.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every node applied at least its snapshot (a node that connected while a publication was
    // under way also applied the delta that followed).
    let first = fleet.take_samples();
    let nodes: std::collections::BTreeSet<_> = first.iter().map(|s| s.node.clone()).collect();
    assert_eq!(nodes.len(), 40);

    let before_change = fleet.status().digests.into_keys().next().unwrap();
    // A change reaches every virtual node as a delta carrying its trigger time.
    let before = lab.brain(0).http_get("/metrics").unwrap().1;
    let encodes_before = metric(&before, "splitproxy_brain_encodes_total").unwrap();
    lab.apply_yaml(&slice(
        "vf",
        "web-1",
        "web",
        &[("http", "TCP", 8080)],
        &[
            Ep::new("10.244.0.71", "node-0", "web-a"),
            Ep::new("10.244.1.71", "node-1", "web-b"),
        ],
    ))
    .await
    .unwrap();
    let start = Instant::now();
    while !converged(Some(&before_change)) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "fleet did not take the change: {:?}",
            fleet.status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let samples = fleet.take_samples();
    let nodes: std::collections::BTreeSet<_> = samples.iter().map(|s| s.node.clone()).collect();
    assert_eq!(nodes.len(), 40, "every node applied the change");
    assert!(
        samples.iter().all(|s| !s.trigger_times.is_empty()),
        "trigger times reach the nodes"
    );
    let worst = samples
        .iter()
        .filter_map(|s| {
            s.applied_at
                .duration_since(*s.trigger_times.iter().min().unwrap())
                .ok()
        })
        .max()
        .unwrap();
    eprintln!("network programming latency, worst of 40 virtual nodes: {worst:?}");
    // The delta was encoded once (or a few times, for nodes at different versions), not 42 times.
    let after = lab.brain(0).http_get("/metrics").unwrap().1;
    let encodes = metric(&after, "splitproxy_brain_encodes_total").unwrap() - encodes_before;
    assert!(
        encodes <= 3.0,
        "{encodes} encodes for one change to 42 nodes"
    );
    assert!(
        metric(&after, "splitproxy_brain_fanout_duration_seconds_count").unwrap() >= 1.0,
        "{after}"
    );
    // The real actuators joined the parts too: they forward to both endpoints. The fleet's
    // convergence says nothing of theirs: wait until the brain has their acks for the change.
    lab.wait_synced(Duration::from_secs(10))
        .await
        .expect("the real actuators take the change");
    let client = lab
        .ensure_pod(
            0,
            "client",
            "10.244.0.100".parse().unwrap(),
            &Default::default(),
            &Default::default(),
        )
        .unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..40 {
        let r = splitproxy_tests::probe_async(
            client.netns(),
            splitproxy_tests::Proto::Tcp,
            "10.96.7.10:80".parse().unwrap(),
            None,
            Duration::from_secs(1),
        )
        .await;
        seen.insert(r.pod().unwrap_or("none").to_string());
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        vec!["web-a".to_string(), "web-b".to_string()]
    );
    for i in 0..2 {
        assert_eq!(
            metric(
                &lab.actuator_metrics(i).unwrap(),
                "splitproxy_actuator_apply_errors_total"
            ),
            Some(0.0)
        );
    }
    fleet.stop();
}
