//! The brain against a real kube-apiserver: the initial sync gate, the per-node ruleset for a
//! handful of Services (golden nft text), mTLS, and gRPC reflection through grpcurl.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use splitproxy_proto::v1::dataplane_client::DataplaneClient;
use splitproxy_proto::v1::{Hello, SyncRequest, Update, sync_request, update::Body};
use splitproxy_tests::certs::Pki;
use splitproxy_tests::controlplane::{ControlPlane, ControlPlaneOptions};
use splitproxy_tests::deploy::{Brain, BrainOptions, grpc_client};
use splitproxy_tests::fixtures::{Ep, docs, namespace, service, slice};
use tokio_stream::StreamExt;

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"))
}

fn opts() -> BrainOptions {
    BrainOptions::with_service_cidrs(&["10.96.0.0/16".parse().unwrap()])
}

async fn apply(cp: &ControlPlane, yaml: &str) {
    use kube::api::{Api, DynamicObject, Patch, PatchParams};
    use kube::discovery::ApiResource;
    let client = cp.client();
    for doc in yaml.split("\n---\n") {
        let obj: DynamicObject = serde_yaml::from_str(doc).unwrap();
        let tm = obj.types.clone().unwrap();
        let (group, version) = tm
            .api_version
            .split_once('/')
            .unwrap_or(("", &tm.api_version));
        let ar = ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: tm.api_version.clone(),
            kind: tm.kind.clone(),
            plural: format!("{}s", tm.kind.to_lowercase()).replace("sliceses", "slices"),
        };
        let api: Api<DynamicObject> = match &obj.metadata.namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        let name = obj.metadata.name.clone().unwrap();
        api.patch(
            &name,
            &PatchParams::apply("test").force(),
            &Patch::Apply(&obj),
        )
        .await
        .unwrap();
    }
}

/// A brain against `cp` with a CA of its own, and an operator's certificate from that CA.
struct Fixture {
    dir: tempfile::TempDir,
    pki: Pki,
    brain: Brain,
    op: splitproxy_tests::certs::TlsFiles,
}

fn brain_for(cp: &ControlPlane, name: &str) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(name).unwrap();
    let brain = Brain::start(
        &exe(),
        cp.kubeconfig_path(),
        &pki,
        dir.path(),
        "brain",
        None,
        &opts(),
    )
    .unwrap();
    let op = pki
        .write(
            dir.path(),
            "operator",
            &pki.operator_cert("operator").unwrap(),
        )
        .unwrap();
    Fixture {
        dir,
        pki,
        brain,
        op,
    }
}

/// Opens a node's Sync stream with `tls` and returns the stream of updates.
async fn sync_as(
    brain: &Brain,
    tls: &splitproxy_tests::certs::TlsFiles,
    node: &str,
) -> Result<tonic::Streaming<Update>, tonic::Status> {
    let mut client: DataplaneClient<_> = grpc_client(brain.grpc, tls)
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let hello = SyncRequest {
        msg: Some(sync_request::Msg::Hello(Hello {
            node: node.into(),
            ..Default::default()
        })),
    };
    // Keep the request stream open (an ended request stream ends the session).
    let outbound = tokio_stream::iter(vec![hello]).chain(tokio_stream::pending());
    Ok(client.sync(outbound).await?.into_inner())
}

fn count_service_ports(update: &Update) -> usize {
    let Some(Body::Snapshot(r)) = &update.body else {
        panic!("first update must be a snapshot")
    };
    r.tables
        .iter()
        .flat_map(|t| &t.sets)
        .filter(|s| s.name.starts_with("service-ports-") || s.name == "no-endpoint-services")
        .map(|s| s.elements.len())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_update_before_the_initial_lists_complete() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new("gate").unwrap();
    let node_tls = pki
        .write(dir.path(), "node-0", &pki.node_cert("node-0").unwrap())
        .unwrap();

    // A brain whose API server is unreachable serves nobody: no update, not ready.
    let dead = cp.kubeconfig_for_server("https://127.0.0.1:9").unwrap();
    let brain = Brain::start(
        &exe(),
        &dead,
        &pki,
        &dir.path().join("dead"),
        "brain-dead",
        None,
        &opts(),
    )
    .unwrap();
    let mut updates = sync_as(&brain, &node_tls, "node-0").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(3), updates.next()).await;
    assert!(got.is_err(), "an unsynced brain sent {got:?}");
    assert_eq!(brain.http_get("/readyz").unwrap().0, 503);
    let m = brain.http_get("/metrics").unwrap().1;
    assert_eq!(
        splitproxy_tests::deploy::metric(&m, "splitproxy_brain_synced"),
        Some(0.0)
    );
    drop(brain);

    // With 300 Services already in the API server, the very first update holds all of them:
    // a node connected before the lists completed waits, and never sees part of the cluster.
    let mut yaml = vec![namespace("gate")];
    for i in 0..300u32 {
        let ip = format!("10.96.{}.{}", 10 + i / 200, 1 + i % 200);
        yaml.push(service(
            "gate",
            &format!("s{i}"),
            &ip,
            &[("http", "TCP", 80, 8080)],
        ));
        if i % 2 == 0 {
            let ep = Ep::new(
                format!("10.244.{}.{}", i / 200, 1 + i % 200),
                "node-0",
                format!("p{i}"),
            );
            yaml.push(slice(
                "gate",
                &format!("s{i}-1"),
                &format!("s{i}"),
                &[("http", "TCP", 8080)],
                &[ep],
            ));
        }
    }
    apply(&cp, &docs(&yaml)).await;
    let brain = Brain::start(
        &exe(),
        cp.kubeconfig_path(),
        &pki,
        &dir.path().join("live"),
        "brain-live",
        None,
        &opts(),
    )
    .unwrap();
    let start = Instant::now();
    let mut updates = sync_as(&brain, &node_tls, "node-0").await.unwrap();
    // The first update, whole: its parts (snapshots are split) joined.
    let mut parts = Vec::new();
    loop {
        let part = tokio::time::timeout(Duration::from_secs(30), updates.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let more = part.more;
        parts.push(part);
        if !more {
            break;
        }
    }
    assert!(parts.iter().all(|p| p.generation == parts[0].generation));
    let bodies = parts
        .iter_mut()
        .filter_map(|p| p.body.take())
        .collect::<Vec<_>>();
    let mut first = parts.pop().unwrap();
    first.body = Some(splitproxy_proto::parts::join(bodies).unwrap());
    eprintln!(
        "first update after {:?}, {} service ports",
        start.elapsed(),
        count_service_ports(&first)
    );
    // 300 Services plus default/kubernetes.
    assert_eq!(count_service_ports(&first), 301);
    assert_eq!(first.base_generation, 0);
    assert!(!first.digest.is_empty());
    let ready = (0..50).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        matches!(brain.http_get("/readyz"), Ok((200, _)))
    });
    assert!(ready, "a synced brain is ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_ruleset_for_a_handful_of_services_is_golden() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap();
    let ns = "golden";
    apply(
        &cp,
        &docs(&[
            namespace(ns),
            // Two ports; one endpoint not ready.
            service(ns, "web", "10.96.5.10", &[("http", "TCP", 80, 8080), ("metrics", "TCP", 9090, 9090)]),
            slice(
                ns,
                "web-1",
                "web",
                &[("http", "TCP", 8080), ("metrics", "TCP", 9090)],
                &[
                    Ep::new("10.244.0.5", "node-0", "web-a"),
                    Ep::new("10.244.1.5", "node-1", "web-b"),
                    Ep::new("10.244.1.6", "node-1", "web-c").not_ready(),
                ],
            ),
            // UDP.
            service(ns, "dns", "10.96.5.53", &[("dns", "UDP", 53, 5353)]),
            slice(ns, "dns-1", "dns", &[("dns", "UDP", 5353)], &[Ep::new("10.244.0.53", "node-0", "dns-a")]),
            // No endpoints.
            service(ns, "empty", "10.96.5.99", &[("http", "TCP", 80, 80)]),
            // Headless: no rules at all.
            "apiVersion: v1\nkind: Service\nmetadata: {name: headless, namespace: golden}\nspec:\n  clusterIP: None\n  ports: [{name: http, port: 80}]\n".into(),
        ]),
    )
    .await;
    let Fixture {
        dir: _dir,
        pki: _pki,
        brain,
        op,
    } = brain_for(&cp, "golden");
    let mut client = grpc_client(brain.grpc, &op).await.unwrap();
    let golden = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden/clusterip.nft");
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let want = if update {
        String::new()
    } else {
        std::fs::read_to_string(&golden).expect("golden file (UPDATE_GOLDEN=1 writes it)")
    };
    // The objects' events arrive one by one (a loaded machine spreads them over several
    // publications): wait, bounded, for the state that holds all of them.
    let mut nft = String::new();
    for _ in 0..150 {
        if let Ok(r) = client
            .get_node_ruleset(splitproxy_proto::v1::GetNodeRulesetRequest {
                node: "node-0".into(),
            })
            .await
        {
            nft = r.into_inner().nft;
            let complete = if update {
                nft.contains("10.96.5.99") && nft.contains("10.244.1.5 . 9090")
            } else {
                nft == want
            };
            if complete {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if update {
        std::fs::write(&golden, &nft).unwrap();
        return;
    }
    assert_eq!(
        nft,
        want,
        "node-0's ruleset differs from {}",
        golden.display()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mtls_refuses_clients_without_a_valid_certificate() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap();
    let Fixture {
        dir,
        pki,
        brain,
        op,
    } = brain_for(&cp, "mtls");
    let mut good = grpc_client(brain.grpc, &op).await.unwrap();
    assert!(
        good.list_nodes(splitproxy_proto::v1::ListNodesRequest {})
            .await
            .is_ok()
    );

    // No client certificate at all.
    let channel = tonic::transport::Channel::from_shared(format!("https://{}", brain.grpc))
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(pki.ca_pem()))
                .domain_name("127.0.0.1"),
        )
        .unwrap();
    let refused = match channel.connect().await {
        Err(_) => true,
        Ok(ch) => DataplaneClient::new(ch)
            .list_nodes(splitproxy_proto::v1::ListNodesRequest {})
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate was served");

    // A certificate from another CA.
    let other = Pki::new("other").unwrap();
    let mut foreign = other
        .write(
            &dir.path().join("other"),
            "node-0",
            &other.node_cert("node-0").unwrap(),
        )
        .unwrap();
    foreign.ca = op.ca.clone(); // it trusts the brain, but the brain does not trust it
    let refused = match grpc_client(brain.grpc, &foreign).await {
        Err(_) => true,
        Ok(mut c) => c
            .list_nodes(splitproxy_proto::v1::ListNodesRequest {})
            .await
            .is_err(),
    };
    assert!(
        refused,
        "a client with a certificate from another CA was served"
    );

    // A valid certificate for node-0 may not receive node-1's state.
    let node0 = pki
        .write(dir.path(), "node-0", &pki.node_cert("node-0").unwrap())
        .unwrap();
    let err = match sync_as(&brain, &node0, "node-1").await {
        Err(s) => s,
        Ok(mut s) => s
            .next()
            .await
            .expect("stream ends with an error")
            .expect_err("no update for another node"),
    };
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpcurl_lists_services_through_reflection() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap();
    let Fixture {
        dir: _dir,
        pki: _pki,
        brain,
        op,
    } = brain_for(&cp, "grpcurl");
    let run = |args: &[&str]| {
        let out = splitproxy_tests::tools::grpcurl(&op)
            .unwrap()
            .arg(brain.grpc.to_string())
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "grpcurl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let list = run(&["list"]);
    assert!(
        list.lines().any(|l| l == "splitproxy.v1.Dataplane"),
        "{list}"
    );
    assert!(list.lines().any(|l| l == "grpc.health.v1.Health"), "{list}");
    let methods = run(&["list", "splitproxy.v1.Dataplane"]);
    assert!(
        methods.contains("splitproxy.v1.Dataplane.Sync") && methods.contains("ListNodes"),
        "{methods}"
    );
    let start = Instant::now();
    loop {
        let health = run(&["grpc.health.v1.Health/Check"]);
        if health.contains("SERVING") && !health.contains("NOT_SERVING") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "brain never became SERVING: {health}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let nodes = run(&["splitproxy.v1.Dataplane/ListNodes"]);
    assert!(nodes.contains("\"synced\": true"), "{nodes}");
}
