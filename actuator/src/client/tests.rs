//! The stream's credentials against small TLS gRPC servers that record what each `Sync` call
//! carried: the token as the file holds it at each connection, and a stream the brain ends
//! because its credential expired opened again on the same brain, with the rotated token.
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use splitproxy_proto::v1::dataplane_server::{Dataplane, DataplaneServer};
use splitproxy_proto::v1::{
    GetNodeRulesetRequest, GetNodeRulesetResponse, ListNodesRequest, ListNodesResponse,
    SyncRequest, Update,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Identity, Server, ServerTlsConfig, Uri};
use tonic::{Request, Response, Status, Streaming};

use super::*;
use crate::apply::kernel::Recording;

/// What a server sends a stream's updates through.
type Updates = mpsc::Sender<Result<Update, Status>>;

/// One `Sync` call a server received.
#[derive(Debug, Clone)]
struct Call {
    server: usize,
    authorization: Option<String>,
    at: Instant,
}

/// A brain that records each `Sync` call and, when `expire_after` is set, ends the first stream
/// it accepted with UNAUTHENTICATED after that long (as the brain does when a token expires);
/// other streams stay open, sending nothing.
#[derive(Clone)]
struct Recorder {
    server: usize,
    calls: Arc<Mutex<Vec<Call>>>,
    expire_after: Option<Duration>,
    /// Streams held open.
    open: Arc<Mutex<Vec<Updates>>>,
}

#[tonic::async_trait]
impl Dataplane for Recorder {
    type SyncStream = ReceiverStream<Result<Update, Status>>;
    type WatchNodesStream = ReceiverStream<Result<splitproxy_proto::v1::NodeEvent, Status>>;
    type WatchServiceStream =
        ReceiverStream<Result<splitproxy_proto::v1::GetServiceResponse, Status>>;

    async fn sync(
        &self,
        request: Request<Streaming<SyncRequest>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let first = {
            let mut calls = self.calls.lock().unwrap();
            calls.push(Call {
                server: self.server,
                authorization,
                at: Instant::now(),
            });
            calls.iter().filter(|c| c.server == self.server).count() == 1
        };
        let (tx, rx) = mpsc::channel(1);
        match self.expire_after {
            Some(after) if first => {
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let _ = tx
                        .send(Err(Status::unauthenticated("the token expired")))
                        .await;
                });
            }
            _ => self.open.lock().unwrap().push(tx),
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn list_nodes(
        &self,
        _: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn get_node_ruleset(
        &self,
        _: Request<GetNodeRulesetRequest>,
    ) -> Result<Response<GetNodeRulesetResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn watch_nodes(
        &self,
        _: Request<splitproxy_proto::v1::WatchNodesRequest>,
    ) -> Result<Response<Self::WatchNodesStream>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn get_service(
        &self,
        _: Request<splitproxy_proto::v1::GetServiceRequest>,
    ) -> Result<Response<splitproxy_proto::v1::GetServiceResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn watch_service(
        &self,
        _: Request<splitproxy_proto::v1::GetServiceRequest>,
    ) -> Result<Response<Self::WatchServiceStream>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn explain_packet(
        &self,
        _: Request<splitproxy_proto::v1::ExplainPacketRequest>,
    ) -> Result<Response<splitproxy_proto::v1::ExplainPacketResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

/// A CA (written to `dir/ca.crt`) and a serving identity for `splitproxy-brain` from it.
fn pki(dir: &Path) -> Identity {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    std::fs::write(dir.join("ca.crt"), ca_cert.pem()).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["splitproxy-brain".to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    Identity::from_pem(cert.pem(), key.serialize_pem())
}

/// Serves `recorder` on a new port of 127.0.0.1; its address.
async fn serve(recorder: Recorder, identity: Identity) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        Server::builder()
            .tls_config(ServerTlsConfig::new().identity(identity))
            .unwrap()
            .add_service(DataplaneServer::new(recorder))
            .serve_with_incoming(incoming),
    );
    addr
}

/// Polls `calls` until `n` were received, for at most 10 s.
async fn calls(calls: &Mutex<Vec<Call>>, n: usize) -> Vec<Call> {
    for _ in 0..200 {
        let c = calls.lock().unwrap().clone();
        if c.len() >= n {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{n} calls expected: {:?}", calls.lock().unwrap());
}

/// Two brains; the node's preferred one ends its stream because the token expired. The node
/// comes back to that brain at once (not to the other, and without a long backoff), with the
/// token the file holds now; each connection carried the token current at the time.
#[tokio::test]
async fn an_expired_token_reconnects_at_once_to_the_same_brain_with_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let identity = pki(dir.path());
    let token = dir.path().join("token");
    std::fs::write(&token, "token-1\n").unwrap();
    let recorded = Arc::new(Mutex::new(Vec::new()));
    let node = "node-1";
    // Which of the two the node prefers decides which one expires its stream: both are told
    // to, and only the first one the node reaches gets to.
    let mut uris = Vec::new();
    for server in 0..2 {
        let recorder = Recorder {
            server,
            calls: recorded.clone(),
            expire_after: Some(Duration::from_millis(1_500)),
            open: Arc::default(),
        };
        let addr = serve(recorder, identity.clone()).await;
        uris.push(format!("https://{addr}").parse::<Uri>().unwrap());
    }
    let preferred = brain_order(node, &uris)[0].clone();
    let preferred_index = uris.iter().position(|u| *u == preferred).unwrap();

    let config = ClientConfig {
        brains: uris,
        discovery: None,
        server_name: Some("splitproxy-brain".to_owned()),
        node: node.to_owned(),
        credentials: Credentials {
            ca: dir.path().join("ca.crt"),
            client_cert: None,
            token_file: Some(token.clone()),
        },
        tls: Default::default(),
    };
    let health = Arc::new(Health::default());
    let applier = Arc::new(Mutex::new(Applier::new(
        Recording::new(),
        "splitproxy".to_owned(),
    )));
    let after = Arc::new(AfterCommit::new(
        "splitproxy".to_owned(),
        health.clone(),
        Vec::new(),
    ));
    let client = tokio::spawn(run(config, applier, health.clone(), after));

    let first = calls(&recorded, 1).await;
    assert_eq!(
        first[0].server, preferred_index,
        "the preferred brain first"
    );
    assert_eq!(first[0].authorization.as_deref(), Some("Bearer token-1"));
    // The kubelet rotates the token while the stream is open.
    std::fs::write(dir.path().join("token.new"), "token-2").unwrap();
    std::fs::rename(dir.path().join("token.new"), &token).unwrap();

    let both = calls(&recorded, 2).await;
    let again = &both[1];
    assert_eq!(
        again.server, preferred_index,
        "back to the same brain: {both:?}"
    );
    assert_eq!(again.authorization.as_deref(), Some("Bearer token-2"));
    let gap = again.at - first[0].at;
    assert!(
        gap < Duration::from_millis(1_500) + RECONNECT_WITHIN,
        "reconnected {gap:?} after the first stream opened"
    );
    client.abort();
}

/// How soon after the brain ends an expired stream the node is back (the reconnect spread after
/// a healthy stream, plus a connection on loopback).
const RECONNECT_WITHIN: Duration = Duration::from_millis(1_500);

/// A token file the node cannot read fails the connection before anything is sent, with the
/// file's name in the error, and a certificate-only node sends no authorization header.
#[tokio::test]
async fn without_a_token_nothing_is_sent_and_an_unreadable_one_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let identity = pki(dir.path());
    let recorded = Arc::new(Mutex::new(Vec::new()));
    let addr = serve(
        Recorder {
            server: 0,
            calls: recorded.clone(),
            expire_after: None,
            open: Arc::default(),
        },
        identity,
    )
    .await;
    let brain: Uri = format!("https://{addr}").parse().unwrap();
    let mut config = ClientConfig {
        brains: vec![brain.clone()],
        discovery: None,
        server_name: Some("splitproxy-brain".to_owned()),
        node: "n".to_owned(),
        credentials: Credentials {
            ca: dir.path().join("ca.crt"),
            client_cert: None,
            token_file: Some(dir.path().join("missing-token")),
        },
        tls: Default::default(),
    };
    let e = connect(&config, &brain).await.unwrap_err();
    assert!(format!("{e:#}").contains("missing-token"), "{e:#}");

    config.credentials.token_file = None;
    let channel = connect(&config, &brain).await.unwrap();
    let (_tx, rx) = mpsc::channel::<SyncRequest>(1);
    let _stream = DataplaneClient::with_interceptor(channel, config.credentials.bearer())
        .sync(ReceiverStream::new(rx))
        .await
        .unwrap();
    let c = calls(&recorded, 1).await;
    assert_eq!(c[0].authorization, None);
}

// ---- what the stream sends and how it joins parts, without a brain ----

/// The Hello presents what the applier applied, resource versions included: they also say the
/// node applies restating deltas.
#[test]
fn hello_presents_the_applied_state_with_its_resource_versions() {
    let applied = Applied {
        brain_epoch: 3,
        generation: 7,
        digest: vec![1; 16],
        resource_versions: vec![10, 20, 30, 40],
    };
    let h = hello("node-1", applied);
    assert_eq!(h.node, "node-1");
    assert_eq!(
        h.applied,
        Some(v1::Applied {
            brain_epoch: 3,
            generation: 7,
            digest: vec![1; 16],
            resource_versions: vec![10, 20, 30, 40],
        })
    );
    // Nothing applied: zero values, no resource versions (no restating delta for it).
    let h = hello("node-1", Applied::default());
    assert_eq!(h.applied, Some(v1::Applied::default()));
}

/// The table `ip splitproxy` with `comment` and one chain `name`, as a part's body.
fn shell(comment: &str, chain: &str) -> v1::Table {
    v1::Table {
        family: v1::Family::Ip as i32,
        name: "splitproxy".to_owned(),
        comment: comment.to_owned(),
        chains: vec![v1::Chain {
            name: chain.to_owned(),
            ..v1::Chain::default()
        }],
        ..v1::Table::default()
    }
}

/// What the brain puts in the last part only (digest, resource versions, restating) reaches
/// the update the applier gets, for joined delta parts and for snapshot parts folded into a
/// model; the applier then keeps the resource versions with what it applied.
#[tokio::test]
async fn the_last_part_brings_resource_versions_and_restating_to_the_joined_update() {
    let delta_part = |chain: &str, more: bool| Update {
        brain_epoch: 2,
        generation: 4,
        body: Some(Body::Delta(v1::RulesetDelta {
            upsert: vec![shell("t", chain)],
            remove: vec![],
        })),
        more,
        ..Update::default()
    };
    let mut target = Model::default();
    target.apply(&v1::RulesetDelta {
        upsert: vec![shell("t", "a"), shell("t", "b")],
        remove: vec![],
    });
    let last = Update {
        digest: target.digest(),
        resource_versions: vec![1, 2, 3, 4],
        restating: true,
        ..delta_part("b", false)
    };
    let mut pending = None;
    assert!(
        take_part(&mut pending, delta_part("a", true))
            .unwrap()
            .is_none()
    );
    let Some(Work::Update(joined)) = take_part(&mut pending, last).unwrap() else {
        panic!("the last part completes a delta update")
    };
    assert!(pending.is_none());
    assert_eq!(joined.resource_versions, vec![1, 2, 3, 4]);
    assert!(joined.restating && !joined.more);
    assert_eq!(joined.digest, target.digest());
    let Some(Body::Delta(d)) = &joined.body else {
        panic!("joined delta body")
    };
    assert_eq!(d.upsert[0].chains.len(), 2, "both parts' chains");

    // A restating delta names no base, so a fresh applier takes it: it reaches the digest.
    let applier = Arc::new(Mutex::new(Applier::new(
        Recording::new(),
        "splitproxy".to_owned(),
    )));
    let health = Arc::new(Health::default());
    let (ack, outcome) = answer::apply(Work::Update(joined), &applier, &health).await;
    assert!(ack.ok, "{}", ack.error);
    assert!(outcome.is_some());
    assert_eq!(
        applier.lock().unwrap().applied().resource_versions,
        vec![1, 2, 3, 4]
    );

    // Snapshot parts fold into a model; the metadata kept for it is the last part's.
    let snapshot_part = |chain: &str, more: bool| Update {
        brain_epoch: 2,
        generation: 5,
        body: Some(Body::Snapshot(v1::Ruleset {
            tables: vec![shell("t", chain)],
        })),
        more,
        ..Update::default()
    };
    assert!(
        take_part(&mut pending, snapshot_part("a", true))
            .unwrap()
            .is_none()
    );
    let last = Update {
        digest: target.digest(),
        resource_versions: vec![5, 6, 7, 8],
        ..snapshot_part("b", false)
    };
    let Some(Work::Snapshot(meta, model)) = take_part(&mut pending, last).unwrap() else {
        panic!("the last part completes a snapshot")
    };
    assert_eq!(model, target);
    assert_eq!(meta.resource_versions, vec![5, 6, 7, 8]);
    let (ack, _) = answer::apply(Work::Snapshot(meta, model), &applier, &health).await;
    assert!(ack.ok, "{}", ack.error);
    assert_eq!(
        applier.lock().unwrap().applied().resource_versions,
        vec![5, 6, 7, 8]
    );

    // Parts of two generations interleaving end the stream.
    assert!(
        take_part(&mut pending, snapshot_part("a", true))
            .unwrap()
            .is_none()
    );
    assert!(take_part(&mut pending, delta_part("a", false)).is_err());
}
