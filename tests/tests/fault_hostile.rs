//! Hostile and broken clients against a brain, with a connection loop through a ClusterIP
//! running the whole time (issue #9, "a closed gRPC surface"; docs/protocol.md, "Who may call
//! what"): half-open connections are dropped after the handshake timeout and bounded per peer;
//! an operator certificate may not open `Sync`; a node certificate reads only its own state; a
//! certificate in no group is refused; a 60 MB NACK is cut, and `ListNodes` keeps working; a
//! second session for a live node ending leaves the node connected; a stream ends when its
//! certificate expires; a silent `Sync` is dropped after the Hello timeout; a rotated client CA
//! is picked up without a restart. Through all of it the nodes stay in sync and no connection
//! through the ClusterIP fails.
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use splitproxy_proto::v1::dataplane_client::DataplaneClient;
use splitproxy_proto::v1::{
    Ack, GetNodeRulesetRequest, Hello, ListNodesRequest, ListNodesResponse, SyncRequest, Update,
    sync_request,
};
use splitproxy_tests::Pod;
use splitproxy_tests::certs::{CertPair, Pki, TlsFiles};
use splitproxy_tests::deploy::{grpc_client, labelled};
use splitproxy_tests::lab::{Lab, LabOptions};
use splitproxy_tests::traffic::{ConnectionLoop, web_service_with_client};
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

const WEB: &str = "10.96.2.10:80";
/// The brain's handshake timeout in this lab.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
/// Connections one peer address may hold in this lab (the nodes and the test's clients come
/// from 127.0.0.1, the flood from 127.0.0.2).
const PER_IP: usize = 100;
/// Half-open connections the flood opens.
const FLOOD: usize = 300;

async fn setup() -> (Lab, Pod) {
    let mut opts = LabOptions::new(env!("CARGO_BIN_EXE_splitproxy-lab"));
    opts.brain.surface.limits.handshake_timeout = HANDSHAKE_TIMEOUT;
    opts.brain.surface.limits.max_connections_per_ip = PER_IP;
    let lab = Lab::start(opts).await.expect("lab starts");
    let client = web_service_with_client(&lab, "hostile", "10.96.2.10").await;
    (lab, client)
}

/// Certificates issued into a directory of their own (issuing rewrites the directory's ca.crt,
/// which the lab's processes read).
fn issue(pki: &Pki, dir: &Path, name: &str, pair: &CertPair) -> TlsFiles {
    pki.write(dir, name, pair).unwrap()
}

async fn list(client: &mut DataplaneClient<tonic::transport::Channel>) -> ListNodesResponse {
    client
        .list_nodes(ListNodesRequest {})
        .await
        .expect("ListNodes")
        .into_inner()
}

/// Both real nodes connected and holding the latest state, within `timeout`.
async fn wait_in_sync(lab: &Lab, timeout: Duration) {
    let start = Instant::now();
    loop {
        if let Ok(mut c) = lab.operator_client(0).await
            && let Ok(r) = c.list_nodes(ListNodesRequest {}).await
        {
            let r = r.into_inner();
            let real: Vec<_> = r
                .nodes
                .iter()
                .filter(|n| n.node == "node-0" || n.node == "node-1")
                .collect();
            if r.synced && real.len() == 2 && real.iter().all(|n| n.connected && n.in_sync) {
                return;
            }
        }
        assert!(
            start.elapsed() < timeout,
            "nodes not in sync within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Idle connections the test opens.
const IDLE: usize = 5;

/// A connection, handshake done, that never starts a request.
async fn idle_channel(addr: SocketAddr, tls: &TlsFiles) -> tonic::transport::Channel {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let cfg = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&tls.ca).unwrap()))
        .identity(Identity::from_pem(
            std::fs::read(&tls.cert).unwrap(),
            std::fs::read(&tls.key).unwrap(),
        ))
        .domain_name("127.0.0.1");
    Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(cfg)
        .unwrap()
        .connect()
        .await
        .expect("connects")
}

/// A node's stream, driven by hand.
struct FakeNode {
    tx: mpsc::Sender<SyncRequest>,
    updates: tonic::Streaming<Update>,
}

impl FakeNode {
    async fn open(addr: SocketAddr, tls: &TlsFiles, node: &str) -> Result<FakeNode, tonic::Status> {
        let mut client = grpc_client(addr, tls)
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let (tx, rx) = mpsc::channel(4);
        tx.send(SyncRequest {
            msg: Some(sync_request::Msg::Hello(Hello {
                node: node.into(),
                version: "fault_hostile".into(),
                ..Default::default()
            })),
        })
        .await
        .unwrap();
        let updates = client.sync(ReceiverStream::new(rx)).await?.into_inner();
        Ok(FakeNode { tx, updates })
    }

    /// The next whole update (all its parts): its generation.
    async fn next_update(&mut self) -> Result<u64, tonic::Status> {
        loop {
            match tokio::time::timeout(Duration::from_secs(30), self.updates.next()).await {
                Err(_) => return Err(tonic::Status::deadline_exceeded("no update in 30 s")),
                Ok(None) => return Err(tonic::Status::cancelled("stream ended without status")),
                Ok(Some(Err(e))) => return Err(e),
                Ok(Some(Ok(u))) if !u.more => return Ok(u.generation),
                Ok(Some(Ok(_))) => {}
            }
        }
    }

    async fn ack(&self, ack: Ack) {
        self.tx
            .send(SyncRequest {
                msg: Some(sync_request::Msg::Ack(ack)),
            })
            .await
            .expect("stream open");
    }

    /// How the stream ends (its status), within `timeout`.
    async fn ended(mut self, timeout: Duration) -> tonic::Status {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match tokio::time::timeout_at(deadline, self.updates.next()).await {
                Err(_) => panic!("the stream did not end within {timeout:?}"),
                Ok(None) => return tonic::Status::ok(""),
                Ok(Some(Err(e))) => return e,
                Ok(Some(Ok(_))) => {}
            }
        }
    }
}

/// Whether a refusal is PERMISSION_DENIED, whether it comes when the call opens or on its
/// stream.
fn denied<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> tonic::Status {
    match r {
        Err(s) => s,
        Ok(v) => panic!("served: {v:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_clients_are_refused_while_nodes_stay_in_sync() {
    let (lab, client) = setup().await;
    wait_in_sync(&lab, Duration::from_secs(20)).await;
    let brain = lab.brain(0).grpc;
    let certs = tempfile::tempdir().unwrap();
    let pki = &lab.pki;
    let mut operator = lab.operator_client(0).await.unwrap();

    let traffic = ConnectionLoop::start(
        vec![client],
        WEB.parse().unwrap(),
        20_000,
        Duration::from_secs(240),
        Duration::from_secs(2),
    );

    // In the background: a Sync that never says Hello is dropped after the Hello timeout
    // (10 s), and a stream whose certificate expires ends then.
    let silent = {
        let tls = issue(
            pki,
            &certs.path().join("silent"),
            "fake-silent",
            &pki.node_cert("fake-silent").unwrap(),
        );
        tokio::spawn(async move {
            let mut c = grpc_client(brain, &tls).await.unwrap();
            let started = Instant::now();
            let r = c.sync(tokio_stream::pending::<SyncRequest>()).await;
            (r.map(|_| ()), started.elapsed())
        })
    };
    let expiring = {
        let valid = Duration::from_secs(12);
        let tls = issue(
            pki,
            &certs.path().join("expiring"),
            "fake-expiring",
            &pki.node_cert_expiring("fake-expiring", valid).unwrap(),
        );
        let issued = Instant::now();
        tokio::spawn(async move {
            // A second connection with the same certificate, which made one call and stays.
            let mut held = grpc_client(brain, &tls).await.unwrap();
            held.list_nodes(ListNodesRequest {})
                .await
                .expect("a node lists itself");
            let mut node = FakeNode::open(brain, &tls, "fake-expiring").await.unwrap();
            let generation = node.next_update().await.unwrap();
            node.ack(Ack {
                generation,
                ok: true,
                ..Default::default()
            })
            .await;
            let status = node.ended(valid + Duration::from_secs(10)).await;
            let ended = issued.elapsed();
            // The other connection is closed a few seconds later; the certificate opens no new one.
            tokio::time::sleep_until((issued + valid + Duration::from_secs(8)).into()).await;
            let after = held.list_nodes(ListNodesRequest {}).await;
            assert!(
                after.is_err(),
                "served after the certificate expired: {after:?}"
            );
            (status, ended, valid)
        })
    };

    // Connections that finish their handshake but start no request are closed after 30 s.
    let idle = {
        let tls = lab.operator_tls.clone();
        tokio::spawn(async move {
            let mut channels = Vec::new();
            for _ in 0..IDLE {
                channels.push(idle_channel(brain, &tls).await);
            }
            let opened = Instant::now();
            tokio::time::sleep(Duration::from_secs(36)).await;
            (channels.len(), opened.elapsed())
        })
    };

    // 1. Half-open connections from another loopback address: at most PER_IP are held, the
    // rest are closed at once; the held ones are dropped after the handshake timeout. The
    // nodes, and new clients from elsewhere, are served meanwhile.
    let flood_start = Instant::now();
    let mut held = Vec::new();
    for _ in 0..FLOOD {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        held.push(socket.connect(brain).await.expect("TCP connect"));
    }
    let readers: Vec<_> = held
        .into_iter()
        .map(|mut s| {
            tokio::spawn(async move {
                let mut buf = [0u8; 64];
                // EOF or reset: the brain closed it.
                let _ = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf)).await;
                flood_start.elapsed()
            })
        })
        .collect();
    // A fresh operator connection from 127.0.0.1 during the flood is served.
    let fresh = list(
        &mut lab
            .operator_client(0)
            .await
            .expect("fresh client during the flood"),
    )
    .await;
    assert!(fresh.synced);
    let mut closed_at = Vec::new();
    for r in readers {
        closed_at.push(r.await.unwrap());
    }
    closed_at.sort();
    let at_once = closed_at
        .iter()
        .filter(|d| **d < HANDSHAKE_TIMEOUT - Duration::from_millis(500))
        .count();
    let last = *closed_at.last().unwrap();
    println!("flood: {at_once} of {FLOOD} closed at once, the last after {last:?}");
    assert!(
        at_once >= FLOOD - PER_IP,
        "only {at_once} of {FLOOD} closed at once (per-peer bound {PER_IP})"
    );
    assert!(
        last < HANDSHAKE_TIMEOUT + Duration::from_secs(3),
        "a half-open connection was held for {last:?}"
    );
    let metrics = lab.brain(0).http_get("/metrics").unwrap().1;
    let timeouts = labelled(
        &metrics,
        "splitproxy_brain_tls_handshake_failures_total",
        "reason",
        "timeout",
    );
    let over = labelled(
        &metrics,
        "splitproxy_brain_refused_total",
        "reason",
        "peer_connection_limit",
    );
    println!("handshake timeouts {timeouts}, refused over the per-peer bound {over}");
    assert!(timeouts >= (FLOOD - at_once) as f64, "{timeouts}");
    assert!(over >= (FLOOD - PER_IP) as f64, "{over}");
    wait_in_sync(&lab, Duration::from_secs(10)).await;

    // 2. An operator certificate may not open Sync, and leaves no node behind.
    let status = denied(
        FakeNode::open(brain, &lab.operator_tls, "operator")
            .await
            .map(|_| ()),
    );
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        !list(&mut operator)
            .await
            .nodes
            .iter()
            .any(|n| n.node == "operator"),
        "a refused stream created a node entry"
    );

    // 3. A node certificate reads only its own state.
    let node0 = issue(
        pki,
        &certs.path().join("node-0"),
        "node-0",
        &pki.node_cert("node-0").unwrap(),
    );
    let mut as_node0 = grpc_client(brain, &node0).await.unwrap();
    let status = denied(
        as_node0
            .get_node_ruleset(GetNodeRulesetRequest {
                node: "node-1".into(),
            })
            .await,
    );
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let own = as_node0
        .get_node_ruleset(GetNodeRulesetRequest {
            node: "node-0".into(),
        })
        .await
        .expect("a node reads its own ruleset")
        .into_inner();
    assert!(own.nft.contains("table ip splitproxy"), "{}", own.nft);
    let seen: Vec<String> = list(&mut as_node0)
        .await
        .nodes
        .into_iter()
        .map(|n| n.node)
        .collect();
    assert_eq!(seen, ["node-0"], "a node lists itself only");

    // 4. A certificate in no group is refused everywhere.
    let nobody = issue(
        pki,
        &certs.path().join("nobody"),
        "nobody",
        &pki.client_cert("node-0").unwrap(),
    );
    let mut as_nobody = grpc_client(brain, &nobody).await.unwrap();
    let status = denied(as_nobody.list_nodes(ListNodesRequest {}).await);
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("neither"), "{status:?}");

    // 5. A 60 MB NACK: cut to a few KiB; ListNodes keeps working.
    let fake = issue(
        pki,
        &certs.path().join("fake-nack"),
        "fake-nack",
        &pki.node_cert("fake-nack").unwrap(),
    );
    let mut node = FakeNode::open(brain, &fake, "fake-nack").await.unwrap();
    let generation = node.next_update().await.unwrap();
    node.ack(Ack {
        generation,
        ok: false,
        error: "x".repeat(60_000_000),
        refused_message: "y".repeat(1_000_000),
        ..Default::default()
    })
    .await;
    let start = Instant::now();
    let stored = loop {
        let r = list(&mut operator).await;
        if let Some(n) = r
            .nodes
            .iter()
            .find(|n| n.node == "fake-nack" && !n.last_error.is_empty())
        {
            break n.clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the NACK was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        stored.last_error.len() < 4096 && stored.last_refused_message.len() < 4096,
        "kept {} and {} bytes",
        stored.last_error.len(),
        stored.last_refused_message.len()
    );
    drop(node);

    // 6. A second session for a live node: the real actuator's stream is replaced, it
    // reconnects and replaces ours; ours ending leaves node-0 connected.
    let second = FakeNode::open(brain, &node0, "node-0").await.unwrap();
    let status = second.ended(Duration::from_secs(30)).await;
    println!("the second session ended: {status:?}");
    wait_in_sync(&lab, Duration::from_secs(20)).await;
    let watch_from = Instant::now();
    while watch_from.elapsed() < Duration::from_secs(3) {
        let r = list(&mut operator).await;
        let n0 = r
            .nodes
            .iter()
            .find(|n| n.node == "node-0")
            .expect("node-0 listed");
        assert!(
            n0.connected,
            "node-0 marked disconnected by a stale session"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // 7. A rotated client CA is used without a restart: a certificate from a new CA is refused
    // until the brain's CA file also holds the new CA.
    let next = Pki::new("next-ca").unwrap();
    let next_op = issue(
        &next,
        &certs.path().join("next"),
        "op",
        &next.operator_cert("op").unwrap(),
    );
    let mut trusting = next_op.clone();
    trusting.ca = lab.operator_tls.ca.clone(); // it trusts the brain's server certificate
    let refused = match grpc_client(brain, &trusting).await {
        Err(_) => true,
        Ok(mut c) => c.list_nodes(ListNodesRequest {}).await.is_err(),
    };
    assert!(refused, "a certificate from an unknown CA was served");
    let client_ca = &lab.brain(0).tls.ca;
    let both = format!(
        "{}{}",
        std::fs::read_to_string(client_ca).unwrap(),
        next.ca_pem()
    );
    let tmp = client_ca.with_extension("rotating");
    std::fs::write(&tmp, both).unwrap();
    std::fs::rename(&tmp, client_ca).unwrap();
    let start = Instant::now();
    loop {
        if let Ok(mut c) = grpc_client(brain, &trusting).await
            && c.list_nodes(ListNodesRequest {}).await.is_ok()
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the new client CA was never loaded"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!("new client CA in use after {:?}", start.elapsed());

    // The background checks.
    let (silent, waited) = silent.await.unwrap();
    let status = denied(silent);
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(waited < Duration::from_secs(15), "{waited:?}");
    let (status, after, valid) = expiring.await.unwrap();
    println!("the expiring stream ended after {after:?}: {status:?}");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(
        after >= valid - Duration::from_secs(2) && after < valid + Duration::from_secs(5),
        "{after:?}"
    );

    let (opened, after) = idle.await.unwrap();
    let metrics = lab.brain(0).http_get("/metrics").unwrap().1;
    let closed = labelled(
        &metrics,
        "splitproxy_brain_connections_closed_total",
        "reason",
        "idle",
    );
    println!("{closed} idle connections closed, {opened} opened {after:?} before");
    assert!(
        closed >= IDLE as f64,
        "{closed} of {IDLE} idle connections closed"
    );
    let expired = labelled(
        &metrics,
        "splitproxy_brain_connections_closed_total",
        "reason",
        "certificate_expired",
    );
    assert!(
        expired >= 1.0,
        "the expired certificate's connection was not closed"
    );

    // Refusals were counted by reason.
    for reason in ["not_a_node", "other_node", "no_role", "hello_timeout"] {
        let n = labelled(&metrics, "splitproxy_brain_refused_total", "reason", reason);
        assert!(n >= 1.0, "{reason}: {n}");
    }
    assert!(
        labelled(
            &metrics,
            "splitproxy_brain_tls_reloads_total",
            "result",
            "ok"
        ) >= 1.0
    );

    // Through all of it: the nodes in sync, and not one connection through the ClusterIP failed.
    wait_in_sync(&lab, Duration::from_secs(20)).await;
    let (failures, made) = traffic.stop().await;
    println!(
        "{made} connections through the ClusterIP, {} failed",
        failures.len()
    );
    assert!(made > 100, "the connection loop barely ran: {made}");
    assert!(failures.is_empty(), "failed connections: {failures:?}");
}
