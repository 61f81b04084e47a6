//! Never silently stale (docs/invariants.md), with real packets: a brain cut off from the API
//! server stops serving its nodes, which move to the replica that is current and apply a change
//! made during the partition within 15 s; changes made right after an API server restart reach
//! every node within 2 s. A connection loop to a Service the faults do not change loses no
//! connection meanwhile.
use std::time::{Duration, Instant};

use splitproxy_proto::v1::{Hello, ListNodesRequest, ListNodesResponse, SyncRequest, sync_request};
use splitproxy_tests::fixtures::{Ep, docs, namespace, service, slice};
use splitproxy_tests::lab::{Lab, LabOptions};
use splitproxy_tests::traffic::ConnectionLoop;
use splitproxy_tests::{Pod, ProbeResult, Proto, probe_async};
use tokio_stream::StreamExt;

/// The Service the tests change: web-a on node-0, web-b on node-1.
const WEB: &str = "10.96.3.10:80";
/// The Service nothing changes, under a connection loop.
const STEADY: &str = "10.96.3.20:80";

fn web_slice(eps: &[Ep]) -> String {
    slice("ff", "web-1", "web", &[("http", "TCP", 8080)], eps)
}

fn web_a() -> Ep {
    Ep::new("10.244.0.21", "node-0", "web-a")
}

fn web_b() -> Ep {
    Ep::new("10.244.1.21", "node-1", "web-b")
}

/// A lab with two brains, the two Services, and a client pod on each node, every node
/// answering both Services.
async fn setup(mut opts: LabOptions) -> (Lab, Vec<Pod>) {
    opts.brains = 2;
    let lab = Lab::start(opts).await.expect("lab starts");
    lab.apply_yaml(&docs(&[
        namespace("ff"),
        service("ff", "web", "10.96.3.10", &[("http", "TCP", 80, 8080)]),
        web_slice(&[web_a(), web_b()]),
        service("ff", "steady", "10.96.3.20", &[("http", "TCP", 80, 8080)]),
        slice(
            "ff",
            "steady-1",
            "steady",
            &[("http", "TCP", 8080)],
            &[
                Ep::new("10.244.0.31", "node-0", "steady-a"),
                Ep::new("10.244.1.31", "node-1", "steady-b"),
            ],
        ),
    ]))
    .await
    .unwrap();
    let clients: Vec<Pod> = (0..2)
        .map(|i| {
            lab.ensure_pod(
                i,
                &format!("client-{i}"),
                format!("10.244.{i}.100").parse().unwrap(),
                &Default::default(),
                &Default::default(),
            )
            .unwrap()
        })
        .collect();
    lab.wait_synced(Duration::from_secs(30))
        .await
        .expect("every node in sync");
    for c in &clients {
        for dst in [WEB, STEADY] {
            let r = probe(c, dst, Duration::from_secs(2)).await;
            assert!(r.is_answered(), "{} to {dst}: {r:?}", c.name());
        }
    }
    (lab, clients)
}

async fn probe(client: &Pod, dst: &str, timeout: Duration) -> ProbeResult {
    probe_async(
        client.netns(),
        Proto::Tcp,
        dst.parse().unwrap(),
        None,
        timeout,
    )
    .await
}

/// Waits until every client's connections to WEB reach only web-a, `CONSECUTIVE` times in a
/// row each, and returns when the last client's run began (counted from `since`): the time the
/// change took to reach every node. Fails if that is later than `timeout`.
async fn wait_only_web_a(clients: &[Pod], since: Instant, timeout: Duration) -> Duration {
    const CONSECUTIVE: usize = 12;
    let mut runs: Vec<(usize, Instant)> = vec![(0, Instant::now()); clients.len()];
    loop {
        for (i, c) in clients.iter().enumerate() {
            let r = probe(c, WEB, Duration::from_millis(500)).await;
            if r.pod() == Some("web-a") {
                if runs[i].0 == 0 {
                    runs[i].1 = Instant::now();
                }
                runs[i].0 += 1;
            } else {
                runs[i].0 = 0;
            }
        }
        if runs.iter().all(|(n, _)| *n >= CONSECUTIVE) {
            let last = runs.iter().map(|(_, at)| *at).max().unwrap_or(since);
            let took = last.saturating_duration_since(since);
            assert!(
                took <= timeout,
                "the change took {took:?} to reach every node"
            );
            return took;
        }
        assert!(
            since.elapsed() < timeout + Duration::from_secs(5),
            "web-b still receives connections {:?} after the change",
            since.elapsed()
        );
    }
}

async fn list_nodes(lab: &Lab, brain: usize) -> Option<ListNodesResponse> {
    let mut c = lab.operator_client(brain).await.ok()?;
    Some(c.list_nodes(ListNodesRequest {}).await.ok()?.into_inner())
}

/// Nodes connected to each brain.
async fn connected(lab: &Lab) -> Vec<usize> {
    let mut out = Vec::new();
    for b in 0..lab.brains.len() {
        let n = match list_nodes(lab, b).await {
            Some(r) => r.nodes.iter().filter(|n| n.connected).count(),
            None => 0,
        };
        out.push(n);
    }
    out
}

fn assert_no_apply_errors(lab: &Lab) {
    for i in 0..2 {
        let m = lab.actuator_metrics(i).unwrap();
        assert_eq!(
            splitproxy_tests::deploy::metric(&m, "splitproxy_actuator_apply_errors_total"),
            Some(0.0),
            "node-{i} applied everything"
        );
    }
}

/// (a) One brain is partitioned from the API server (its connections blackholed, not closed);
/// an endpoint is removed. Within 15 s every node has left that brain for the other one and
/// no longer sends connections to the removed endpoint; the partitioned brain says it is stale
/// (ListNodes, /readyz) and, once the partition heals, is current and ready again. A connection
/// loop to an unchanged Service loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_brain_cut_off_from_the_api_server_hands_its_nodes_to_a_current_one() {
    let mut opts = LabOptions::new(env!("CARGO_BIN_EXE_splitproxy-lab"));
    opts.brain_api_links = true;
    let (lab, clients) = setup(opts).await;
    // The brain holding (most of) the nodes is the one cut off.
    let per_brain = connected(&lab).await;
    let cut = if per_brain[1] > per_brain[0] { 1 } else { 0 };
    let other = 1 - cut;
    assert!(per_brain[cut] > 0, "nodes connected: {per_brain:?}");

    let looper = ConnectionLoop::start(
        clients.clone(),
        STEADY.parse().unwrap(),
        20_000,
        Duration::from_secs(90),
        Duration::from_secs(2),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;

    lab.cut_brain_api(cut).unwrap();
    let cut_at = Instant::now();
    lab.apply_yaml(&web_slice(&[web_a()])).await.unwrap();
    let changed_at = Instant::now();
    let took = wait_only_web_a(&clients, changed_at, Duration::from_secs(15)).await;
    eprintln!("every node serves the change {took:?} after it was made (partitioned brain-{cut})");

    // Every node is on the current brain, in sync.
    let start = Instant::now();
    loop {
        let r = list_nodes(&lab, other)
            .await
            .expect("current brain answers");
        let on_other = r.nodes.iter().filter(|n| n.connected && n.in_sync).count();
        if r.synced && !r.stale && on_other == 2 {
            break;
        }
        assert!(
            changed_at.elapsed() < Duration::from_secs(15),
            "nodes not in sync on brain-{other} 15 s after the change: {:?}",
            r.nodes
        );
        assert!(start.elapsed() < Duration::from_secs(15));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The partitioned brain says so.
    let r = list_nodes(&lab, cut)
        .await
        .expect("partitioned brain answers ListNodes");
    assert!(
        r.stale && !r.synced,
        "stale: {}, synced: {}",
        r.stale,
        r.synced
    );
    let age = r.api_contact_age.expect("contact age");
    assert!(age.seconds >= 10, "contact age {age:?}");
    assert!(r.nodes.iter().all(|n| !n.connected), "{:?}", r.nodes);
    assert_eq!(lab.brain(cut).http_get("/readyz").unwrap().0, 503);
    let m = lab.brain(cut).http_get("/metrics").unwrap().1;
    assert_eq!(
        splitproxy_tests::deploy::metric(&m, "splitproxy_brain_stale"),
        Some(1.0)
    );
    // And refuses a node that tries it.
    let tls = lab
        .pki
        .write(
            lab.dir(),
            "probe-node-0",
            &lab.pki.node_cert("node-0").unwrap(),
        )
        .unwrap();
    let mut node_client = splitproxy_tests::deploy::grpc_client(lab.brain(cut).grpc, &tls)
        .await
        .unwrap();
    let hello = SyncRequest {
        msg: Some(sync_request::Msg::Hello(Hello {
            node: "node-0".into(),
            ..Default::default()
        })),
    };
    let outbound = tokio_stream::iter(vec![hello]).chain(tokio_stream::pending());
    match node_client.sync(outbound).await {
        Err(status) => assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}"),
        Ok(_) => panic!("a stale brain accepted a node's stream"),
    }
    eprintln!(
        "brain-{cut} reports its last contact with the API server {}s ago, {:?} after the cut",
        age.seconds,
        cut_at.elapsed()
    );

    // The partition heals: the brain restarts its watches, relists, and is ready again.
    lab.heal_brain_api(cut).unwrap();
    let healed_at = Instant::now();
    loop {
        let ready = matches!(lab.brain(cut).http_get("/readyz"), Ok((200, _)));
        if ready
            && let Some(r) = list_nodes(&lab, cut).await
            && r.synced
            && !r.stale
        {
            break;
        }
        assert!(
            healed_at.elapsed() < Duration::from_secs(20),
            "brain-{cut} not ready 20 s after the partition healed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "brain-{cut} ready again {:?} after the heal",
        healed_at.elapsed()
    );
    let m = lab.brain(cut).http_get("/metrics").unwrap().1;
    assert!(
        splitproxy_tests::deploy::metric(&m, "splitproxy_brain_watch_restarts_total")
            .unwrap_or(0.0)
            >= 1.0,
        "its watches were restarted"
    );
    // What it serves now has the change.
    let mut op = lab.operator_client(cut).await.unwrap();
    let nft = op
        .get_node_ruleset(splitproxy_proto::v1::GetNodeRulesetRequest {
            node: "node-0".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .nft;
    assert!(
        nft.contains("10.244.0.21") && !nft.contains("10.244.1.21"),
        "brain-{cut} has the change:\n{nft}"
    );

    let (failures, n) = looper.stop().await;
    assert!(n > 50, "the loop made {n} connections");
    assert!(
        failures.is_empty(),
        "{} of {n} connections to an unchanged Service failed: {failures:?}",
        failures.len()
    );
    assert_no_apply_errors(&lab);
}

/// (b) The API server restarts. A change written as soon as it accepts writes reaches every
/// node within 2 s (the watches used to wait out a backoff grown during the outage: 8-28 s),
/// and a connection loop to an unchanged Service loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changes_right_after_an_api_server_restart_converge_within_2_s() {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::api::{Api, Patch, PatchParams};

    let opts = LabOptions::new(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let (mut lab, clients) = setup(opts).await;
    let looper = ConnectionLoop::start(
        clients.clone(),
        STEADY.parse().unwrap(),
        20_000,
        Duration::from_secs(90),
        Duration::from_secs(2),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;

    let client = lab.cp.new_client().unwrap();
    let change: serde_json::Value = serde_yaml::from_str(&web_slice(&[web_a()])).unwrap();
    let down_at = Instant::now();
    lab.cp.stop_apiserver().unwrap();
    let stopped = down_at.elapsed();
    // From now on: note the API server's first answer, write the change as soon as it is
    // accepted, and time it until every node serves it (while the harness still waits for the
    // API server to be ready).
    let probing = clients.clone();
    let writer = tokio::spawn(async move {
        let bounded = |since: Instant| {
            assert!(
                since.elapsed() < Duration::from_secs(120),
                "the API server did not come back"
            )
        };
        let start = Instant::now();
        let answered = loop {
            let v = tokio::time::timeout(Duration::from_millis(500), client.apiserver_version());
            if matches!(v.await, Ok(Ok(_))) {
                break Instant::now();
            }
            bounded(start);
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let api = Api::<EndpointSlice>::namespaced(client, "ff");
        let pp = PatchParams::apply("splitproxy-lab").force();
        let patch = Patch::Apply(&change);
        let written = loop {
            let w = tokio::time::timeout(Duration::from_secs(1), api.patch("web-1", &pp, &patch));
            if matches!(w.await, Ok(Ok(_))) {
                break Instant::now();
            }
            bounded(start);
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let took = wait_only_web_a(&probing, written, Duration::from_secs(2)).await;
        (answered, written, took)
    });
    // Down for long enough (with the stop's own seconds) that every watch failed and backed
    // off several times, and shorter than the brains' staleness bound (10 s): this measures
    // how fast the watches resume, not how fast nodes reconnect.
    tokio::time::sleep(Duration::from_secs(1)).await;
    lab.cp.start_apiserver().await.expect("API server restarts");
    let (answered, written, took) = writer.await.unwrap();
    eprintln!(
        "API server: stopped in {stopped:?}, answered {:?} after the stop, accepted the change {:?} later",
        answered - down_at,
        written - answered
    );
    eprintln!(
        "every node serves the change {took:?} after it was written, {:?} after the API server answered",
        took + (written - answered)
    );

    let (failures, n) = looper.stop().await;
    assert!(n > 50, "the loop made {n} connections");
    assert!(
        failures.is_empty(),
        "{} of {n} connections to an unchanged Service failed: {failures:?}",
        failures.len()
    );
    assert_no_apply_errors(&lab);
}
