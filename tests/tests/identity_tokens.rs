//! Node and operator identity from Kubernetes ServiceAccount tokens, against the real API
//! server (issue #10, "Node identity without hand-made certificates"; docs/protocol.md, "Who
//! may call what"): TokenRequest tokens bound to Pod objects on Node objects, checked by the
//! brain with TokenReview and SubjectAccessReview, with the brain running under exactly the RBAC
//! it documents. The right node token gets its node's ruleset; a node token claiming another
//! node, an expired token, a token for another audience, a token of a deleted pod, a
//! node-account token bound to
//! no pod, another account's token and no credential at all are refused, each with a clear
//! message, a log line and a count; an operator is one iff RBAC lets it get
//! `splitproxy.io/introspection`, and a binding granted later takes effect within the negative
//! cache's 10 s; an API server that does not answer makes token calls UNAVAILABLE. A node's live
//! stream ends with UNAUTHENTICATED when its token expires.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{
    BoundObjectReference, TokenRequest, TokenRequestSpec, TokenReview, TokenReviewSpec,
};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use splitproxy_proto::v1::dataplane_client::DataplaneClient;
use splitproxy_proto::v1::{ListNodesRequest, SyncRequest, Update, sync_request, update::Body};
use splitproxy_tests::certs::{Pki, TlsFiles};
use splitproxy_tests::controlplane::{ControlPlane, ControlPlaneOptions};
use splitproxy_tests::deploy::{Brain, BrainOptions, labelled, metric};
use tokio_stream::StreamExt;
use tonic::Code;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const NS: &str = "splitproxy-tokens";
const NODE_SA: &str = "splitproxy-actuator";
const OTHER_SA: &str = "other";
const BRAIN_SA: &str = "splitproxy-brain";
const AUDIENCE: &str = "splitproxy";

/// Adds `authorization: Bearer <token>` to every call, when there is a token.
#[derive(Clone)]
struct Bearer(Option<MetadataValue<Ascii>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            r.metadata_mut().insert("authorization", v.clone());
        }
        Ok(r)
    }
}

type Client = DataplaneClient<InterceptedService<Channel, Bearer>>;

/// A client of `brain` that trusts its CA and presents `cert` (if any) and `token` (if any).
async fn client(brain: &Brain, cert: Option<&TlsFiles>, token: Option<&str>) -> Client {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&brain.tls.ca).unwrap()))
        .domain_name("127.0.0.1");
    if let Some(c) = cert {
        tls = tls.identity(Identity::from_pem(
            std::fs::read(&c.cert).unwrap(),
            std::fs::read(&c.key).unwrap(),
        ));
    }
    let channel = Channel::from_shared(format!("https://{}", brain.grpc))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("TLS without a client certificate is accepted");
    let bearer = Bearer(token.map(|t| format!("Bearer {t}").parse().unwrap()));
    DataplaneClient::with_interceptor(channel, bearer)
}

/// Opens `Sync` as `node` and returns its first update, or the status that refused it.
async fn first_update(client: &mut Client, node: &str) -> Result<Update, tonic::Status> {
    let hello = SyncRequest {
        msg: Some(sync_request::Msg::Hello(splitproxy_proto::v1::Hello {
            node: node.into(),
            version: "identity_tokens".into(),
            ..Default::default()
        })),
    };
    // Keep the request stream open (an ended request stream ends the session).
    let outbound = tokio_stream::iter(vec![hello]).chain(tokio_stream::pending());
    let mut updates = client.sync(outbound).await?.into_inner();
    match tokio::time::timeout(Duration::from_secs(30), updates.next()).await {
        Err(_) => Err(tonic::Status::deadline_exceeded("no update in 30 s")),
        Ok(None) => Err(tonic::Status::cancelled("stream ended without a status")),
        Ok(Some(r)) => r,
    }
}

fn refused<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> tonic::Status {
    match r {
        Err(s) => s,
        Ok(v) => panic!("served: {v:?}"),
    }
}

async fn create<K>(api: &Api<K>, value: serde_json::Value) -> K
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let object: K = serde_json::from_value(value).unwrap();
    // A Pod naming a ServiceAccount created a moment ago may be refused until the admission
    // plugin's cache has it: try again, briefly.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match api.create(&PostParams::default(), &object).await {
            Ok(created) => return created,
            Err(e) if Instant::now() < deadline => {
                eprintln!("creating {object:?} failed, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("creating {object:?}: {e}"),
        }
    }
}

/// A Pod of ServiceAccount `account` on `node` (never run: there is no kubelet; the Pod object
/// is what the token is bound to).
async fn pod(cp: &ControlPlane, name: &str, account: &str, node: &str) -> Pod {
    create(
        &Api::<Pod>::namespaced(cp.client(), NS),
        json!({
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "nodeName": node,
                "serviceAccountName": account,
                "automountServiceAccountToken": false,
                "containers": [{"name": "actuator", "image": "splitproxy-actuator:test"}],
            },
        }),
    )
    .await
}

/// A TokenRequest token of `account` for `audience`, bound to `pod` when given.
async fn token(cp: &ControlPlane, account: &str, audience: &str, pod: Option<&Pod>) -> String {
    let bound = pod.map(|p| BoundObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: p.metadata.name.clone(),
        uid: p.metadata.uid.clone(),
    });
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec![audience.into()]),
            // The shortest the API allows.
            expiration_seconds: Some(600),
            bound_object_ref: bound,
            ..Default::default()
        }),
        ..Default::default()
    };
    Api::<ServiceAccount>::namespaced(cp.client(), NS)
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
        .unwrap()
}

/// What TokenReview says about `token` for the brain's audience (asked as the admin).
async fn reviewed(cp: &ControlPlane, token: &str) -> bool {
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: token.into(),
            audiences: Some(vec![AUDIENCE.into()]),
        },
        ..Default::default()
    };
    Api::<TokenReview>::all(cp.client())
        .create(&PostParams::default(), &review)
        .await
        .unwrap()
        .status
        .and_then(|s| s.authenticated)
        .unwrap_or(false)
}

/// Seconds since the epoch, now.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Whether RBAC lets ServiceAccount `account` of [`NS`] do `verb` on `group/resource`.
async fn allowed(
    cp: &ControlPlane,
    account: &str,
    group: &str,
    resource: &str,
    verb: &str,
) -> bool {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(format!("system:serviceaccount:{NS}:{account}")),
            groups: Some(vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{NS}"),
                "system:authenticated".into(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                group: Some(group.into()),
                resource: Some(resource.into()),
                verb: Some(verb.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<SubjectAccessReview>::all(cp.client())
        .create(&PostParams::default(), &review)
        .await
        .unwrap()
        .status
        .is_some_and(|s| s.allowed)
}

/// Waits until RBAC lets `account` do `verb` on `group/resource` (RBAC objects take effect
/// asynchronously).
async fn wait_allowed(cp: &ControlPlane, account: &str, group: &str, resource: &str, verb: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !allowed(cp, account, group, resource, verb).await {
        assert!(
            Instant::now() < deadline,
            "{account}: RBAC for {verb} {group}/{resource} never took effect"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A ClusterRole with `rules` bound to ServiceAccount `account` of [`NS`], both named `name`.
async fn grant(cp: &ControlPlane, name: &str, account: &str, rules: serde_json::Value) {
    create(
        &Api::<ClusterRole>::all(cp.client()),
        json!({"metadata": {"name": name}, "rules": rules}),
    )
    .await;
    create(
        &Api::<ClusterRoleBinding>::all(cp.client()),
        json!({
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": NS}],
        }),
    )
    .await;
}

/// The brain's RBAC as docs/protocol.md states it: what it watches, plus creating
/// TokenReviews and SubjectAccessReviews.
fn brain_rules() -> serde_json::Value {
    json!([
        {"apiGroups": [""], "resources": ["services", "nodes"], "verbs": ["list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["servicecidrs"], "verbs": ["list", "watch"]},
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
    ])
}

/// The API server with the test's namespace, its three accounts and nodes node-0 and node-1,
/// and a brain running as its own ServiceAccount with exactly the RBAC it documents, ready.
struct Env {
    cp: ControlPlane,
    brain: Brain,
    pki: Pki,
    dir: tempfile::TempDir,
}

async fn start() -> Env {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap();
    create(
        &Api::<Namespace>::all(cp.client()),
        json!({"metadata": {"name": NS}}),
    )
    .await;
    let accounts = Api::<ServiceAccount>::namespaced(cp.client(), NS);
    for account in [NODE_SA, OTHER_SA, BRAIN_SA] {
        create(
            &accounts,
            json!({"metadata": {"name": account, "namespace": NS}}),
        )
        .await;
    }
    for node in ["node-0", "node-1"] {
        create(
            &Api::<Node>::all(cp.client()),
            json!({"metadata": {"name": node}}),
        )
        .await;
    }

    // The brain runs as its own ServiceAccount with exactly the RBAC it documents.
    grant(&cp, BRAIN_SA, BRAIN_SA, brain_rules()).await;
    wait_allowed(
        &cp,
        BRAIN_SA,
        "authorization.k8s.io",
        "subjectaccessreviews",
        "create",
    )
    .await;
    wait_allowed(
        &cp,
        BRAIN_SA,
        "authentication.k8s.io",
        "tokenreviews",
        "create",
    )
    .await;
    let brain_token = Api::<ServiceAccount>::namespaced(cp.client(), NS)
        .create_token_request(
            BRAIN_SA,
            &PostParams::default(),
            &TokenRequest {
                spec: Some(TokenRequestSpec {
                    expiration_seconds: Some(3600),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .await
        .unwrap()
        .status
        .unwrap()
        .token
        .unwrap();
    let kubeconfig = cp.kubeconfig_for_token(&brain_token).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new("identity-tokens").unwrap();
    let mut opts = BrainOptions::with_service_cidrs(&["10.96.0.0/16".parse().unwrap()]);
    opts.surface.tokens.node_service_account = Some(format!("{NS}/{NODE_SA}").parse().unwrap());
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let brain = Brain::start(&exe, &kubeconfig, &pki, dir.path(), "brain", None, &opts).unwrap();
    let ready = Instant::now();
    while !matches!(brain.http_get("/readyz"), Ok((200, _))) {
        assert!(
            ready.elapsed() < Duration::from_secs(30),
            "brain not ready:\n{}",
            brain.child.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Env {
        cp,
        brain,
        pki,
        dir,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn service_account_tokens_identify_nodes_and_operators_and_nothing_else() {
    let start_at = Instant::now();
    let Env {
        mut cp,
        brain,
        pki,
        dir,
    } = start().await;
    let actuator0 = pod(&cp, "actuator-0", NODE_SA, "node-0").await;
    let actuator1 = pod(&cp, "actuator-1", NODE_SA, "node-1").await;
    let gone = pod(&cp, "actuator-gone", NODE_SA, "node-0").await;
    let other0 = pod(&cp, "other-0", OTHER_SA, "node-0").await;

    // The node's token (pod-bound, on node-0) gets node-0's ruleset.
    let node0_token = token(&cp, NODE_SA, AUDIENCE, Some(&actuator0)).await;
    let mut node0 = client(&brain, None, Some(&node0_token)).await;
    let update = first_update(&mut node0, "node-0")
        .await
        .unwrap_or_else(|e| panic!("node-0 refused: {e:?}\n{}", brain.child.log_tail(20)));
    assert!(matches!(update.body, Some(Body::Snapshot(_))), "{update:?}");
    // It reads its own state only.
    let listed = node0
        .list_nodes(ListNodesRequest {})
        .await
        .expect("a node may list itself")
        .into_inner();
    assert!(
        listed.nodes.iter().all(|n| n.node == "node-0"),
        "{listed:?}"
    );

    // node-1's token claiming node-0.
    let node1_token = token(&cp, NODE_SA, AUDIENCE, Some(&actuator1)).await;
    let status = refused(
        first_update(
            &mut client(&brain, None, Some(&node1_token)).await,
            "node-0",
        )
        .await,
    );
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("node-1"), "{status:?}");

    // A token of the node account for another audience.
    let wrong_audience = token(&cp, NODE_SA, "somebody-else", Some(&actuator0)).await;
    let status = refused(
        first_update(
            &mut client(&brain, None, Some(&wrong_audience)).await,
            "node-0",
        )
        .await,
    );
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(
        status.message().contains(
            r#"the token is for audience ["somebody-else"], not "splitproxy"; TokenReview: "#
        ),
        "{status:?}"
    );

    // An expired token: node-0's own, its times an hour in the past, signed again with the API
    // server's key. The same token signed again with its times unchanged is accepted, so the
    // expiry is the only reason for the refusal.
    assert!(reviewed(&cp, &cp.resign_token(&node0_token, |_| {}).unwrap()).await);
    let expired = cp
        .token_expiring_at(&node0_token, unix_now() - 3600)
        .unwrap();
    assert!(
        !reviewed(&cp, &expired).await,
        "an expired token is accepted"
    );
    let status =
        refused(first_update(&mut client(&brain, None, Some(&expired)).await, "node-0").await);
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("the bearer token was not accepted: the token expired ")
            && status.message().contains(" s ago (exp "),
        "{status:?}"
    );

    // A token whose pod was deleted (TokenReview refuses it). Never used before, so no review of
    // it is cached.
    let gone_token = token(&cp, NODE_SA, AUDIENCE, Some(&gone)).await;
    Api::<Pod>::namespaced(cp.client(), NS)
        .delete("actuator-gone", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while reviewed(&cp, &gone_token).await {
        assert!(
            Instant::now() < deadline,
            "the deleted pod's token stays valid"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let status =
        refused(first_update(&mut client(&brain, None, Some(&gone_token)).await, "node-0").await);
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // Not a token at all.
    let status = refused(
        first_update(
            &mut client(&brain, None, Some("not-a-token")).await,
            "node-0",
        )
        .await,
    );
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // The node account's token bound to no pod names no node.
    let unbound = token(&cp, NODE_SA, AUDIENCE, None).await;
    let status =
        refused(first_update(&mut client(&brain, None, Some(&unbound)).await, "node-0").await);
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status
            .message()
            .contains("authentication.kubernetes.io/node-name"),
        "{status:?}"
    );

    // Another account's token, bound to a pod on node-0: neither a node nor an operator.
    let other_token = token(&cp, OTHER_SA, AUDIENCE, Some(&other0)).await;
    let mut other = client(&brain, None, Some(&other_token)).await;
    let status = refused(first_update(&mut other, "node-0").await);
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let status = refused(other.list_nodes(ListNodesRequest {}).await);
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("introspection"), "{status:?}");
    let denied_at = Instant::now();

    // No credential at all.
    let mut anonymous = client(&brain, None, None).await;
    let status = refused(anonymous.list_nodes(ListNodesRequest {}).await);
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    let status = refused(first_update(&mut anonymous, "node-0").await);
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // A client certificate still works, and comes first: an operator certificate with a
    // garbage token is an operator.
    let op = pki
        .write(
            dir.path(),
            "operator",
            &pki.operator_cert("operator").unwrap(),
        )
        .unwrap();
    let mut op = client(&brain, Some(&op), Some("garbage")).await;
    let listed = op
        .list_nodes(ListNodesRequest {})
        .await
        .expect("certificate operator")
        .into_inner();
    assert!(
        listed.nodes.iter().any(|n| n.node == "node-0"),
        "{listed:?}"
    );

    // RBAC makes `other` an operator: ListNodes works once the refusal cached for it (10 s)
    // has passed; Sync stays refused.
    grant(
        &cp,
        "splitproxy-introspection",
        OTHER_SA,
        json!([{"apiGroups": ["splitproxy.io"], "resources": ["introspection"], "verbs": ["get"]}]),
    )
    .await;
    wait_allowed(&cp, OTHER_SA, "splitproxy.io", "introspection", "get").await;
    let operator_at = loop {
        match other.list_nodes(ListNodesRequest {}).await {
            Ok(r) => {
                let r = r.into_inner();
                assert!(r.nodes.iter().any(|n| n.node == "node-0"), "{r:?}");
                break denied_at.elapsed();
            }
            Err(s) => assert_eq!(s.code(), Code::PermissionDenied, "{s:?}"),
        }
        assert!(
            denied_at.elapsed() < Duration::from_secs(25),
            "the new binding never took effect"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    println!("the operator binding took effect {operator_at:?} after the refusal");
    let status = refused(first_update(&mut other, "node-0").await);
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("Sync"), "{status:?}");

    // Every refusal was counted and logged by reason.
    let metrics = brain.http_get("/metrics").unwrap().1;
    let count =
        |reason: &str| labelled(&metrics, "splitproxy_brain_refused_total", "reason", reason);
    for (reason, at_least) in [
        ("other_node", 1.0),
        ("bad_token", 4.0),
        ("no_node_claim", 1.0),
        ("no_role", 2.0),
        ("no_identity", 2.0),
        ("not_a_node", 1.0),
    ] {
        assert!(
            count(reason) >= at_least,
            "{reason}: {}\n{metrics}",
            count(reason)
        );
    }
    assert_eq!(count("token_review_unavailable"), 0.0);
    let reviews = |result: &str| {
        labelled(
            &metrics,
            "splitproxy_brain_token_reviews_total",
            "result",
            result,
        )
    };
    assert!(reviews("authenticated") >= 4.0, "{metrics}");
    assert!(reviews("unauthenticated") >= 3.0, "{metrics}");
    assert!(
        labelled(
            &metrics,
            "splitproxy_brain_token_cache_total",
            "result",
            "hit"
        ) >= 1.0
    );
    let log = std::fs::read_to_string(dir.path().join("brain.log")).unwrap();
    for line in log.lines().filter(|l| l.contains("call refused")) {
        println!("brain: {line}");
    }
    for reason in [
        "other_node",
        "bad_token",
        "no_node_claim",
        "no_role",
        "no_identity",
    ] {
        assert!(
            log.lines()
                .any(|l| l.contains("call refused") && l.contains(reason)),
            "no log line for {reason}:\n{log}"
        );
    }

    // An API server that does not answer: a token not reviewed before is UNAVAILABLE (try
    // again), not refused; one reviewed before is still served from the cache.
    cp.stop_apiserver().unwrap();
    let fresh = token_unseen();
    let status = refused(
        client(&brain, None, Some(&fresh))
            .await
            .list_nodes(ListNodesRequest {})
            .await,
    );
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    node0
        .list_nodes(ListNodesRequest {})
        .await
        .expect("a cached review needs no API server");
    let metrics = brain.http_get("/metrics").unwrap().1;
    assert_eq!(
        labelled(
            &metrics,
            "splitproxy_brain_refused_total",
            "reason",
            "token_review_unavailable"
        ),
        1.0
    );
    assert_eq!(
        labelled(
            &metrics,
            "splitproxy_brain_token_reviews_total",
            "result",
            "error"
        ),
        1.0
    );
    println!("identity_tokens total {:.1?}", start_at.elapsed());
}

/// How long the expiring token of [`a_node_stream_ends_when_its_token_expires`] is valid.
const EXPIRES_IN: i64 = 8;

/// A node's live stream ends when its token expires ("streams end when their token expires",
/// issue #10; `until(expires)` in the brain's Sync session). TokenRequest issues nothing shorter
/// than 10 minutes, so node-0's pod-bound token is signed again by the API server's key with its
/// `exp` [`EXPIRES_IN`] seconds ahead: the API server accepts it, the stream it opens serves (a
/// snapshot, acked, in sync as an operator sees it), and it ends with UNAUTHENTICATED at `exp`,
/// not before and at most 2 s after; the brain logs the end and shows node-0 disconnected. The
/// same token then opens nothing (refused as expired and counted), while the pod's fresh token
/// opens node-0's stream again, as the actuator's next read of the rotated file would.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_stream_ends_when_its_token_expires() {
    use tokio_stream::wrappers::ReceiverStream;
    let Env {
        cp,
        brain,
        pki,
        dir,
    } = start().await;
    let actuator0 = pod(&cp, "actuator-0", NODE_SA, "node-0").await;
    let fresh = token(&cp, NODE_SA, AUDIENCE, Some(&actuator0)).await;
    let exp = unix_now() + EXPIRES_IN;
    let expiring = cp.token_expiring_at(&fresh, exp).unwrap();
    let exp_at = std::time::UNIX_EPOCH + Duration::from_secs(exp as u64);
    assert!(
        reviewed(&cp, &expiring).await,
        "the API server refuses the re-signed token"
    );
    let op = pki
        .write(
            dir.path(),
            "operator",
            &pki.operator_cert("operator").unwrap(),
        )
        .unwrap();
    let mut op = client(&brain, Some(&op), None).await;
    let node0_status = async |op: &mut Client| {
        op.list_nodes(ListNodesRequest {})
            .await
            .expect("operator")
            .into_inner()
            .nodes
            .into_iter()
            .find(|n| n.node == "node-0")
    };

    // The stream serves: a snapshot, acked, and node-0 in sync.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(SyncRequest {
        msg: Some(sync_request::Msg::Hello(splitproxy_proto::v1::Hello {
            node: "node-0".into(),
            version: "identity_tokens".into(),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut updates = client(&brain, None, Some(&expiring))
        .await
        .sync(ReceiverStream::new(rx))
        .await
        .unwrap_or_else(|e| panic!("the expiring token refused: {e:?}"))
        .into_inner();
    let ack = |update: &Update| SyncRequest {
        msg: Some(sync_request::Msg::Ack(splitproxy_proto::v1::Ack {
            generation: update.generation,
            ok: true,
            ..Default::default()
        })),
    };
    // An update may come in parts: the ack follows its last.
    let first = tokio::time::timeout(Duration::from_secs(5), updates.message())
        .await
        .expect("an update within 5 s")
        .expect("served")
        .expect("an update");
    assert!(matches!(first.body, Some(Body::Snapshot(_))), "{first:?}");
    let mut last = first;
    while last.more {
        last = tokio::time::timeout(Duration::from_secs(5), updates.message())
            .await
            .expect("the next part within 5 s")
            .expect("served")
            .expect("a part");
    }
    tx.send(ack(&last)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while !node0_status(&mut op)
        .await
        .is_some_and(|n| n.connected && n.in_sync)
    {
        assert!(Instant::now() < deadline, "node-0 never in sync");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        std::time::SystemTime::now() < exp_at - Duration::from_secs(2),
        "too slow: the token is about to expire before the stream was seen serving"
    );

    // It ends at the token's exp (any later update is acked meanwhile).
    let ended = tokio::time::timeout(Duration::from_secs(EXPIRES_IN as u64 + 5), async {
        loop {
            match updates.message().await {
                Ok(Some(update)) if !update.more => tx.send(ack(&update)).await.unwrap(),
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended without a status"),
                Err(status) => break status,
            }
        }
    })
    .await
    .expect("the stream outlived its token by 5 s");
    let at = std::time::SystemTime::now();
    println!(
        "the stream ended {:?} after the token's exp: {ended:?}",
        at.duration_since(exp_at)
    );
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");
    assert!(
        ended.message().contains(&format!(
            "the token of user \"system:serviceaccount:{NS}:{NODE_SA}\" expired"
        )),
        "{ended:?}"
    );
    assert!(
        at >= exp_at,
        "ended {:?} before exp",
        exp_at.duration_since(at)
    );
    assert!(
        at < exp_at + Duration::from_secs(2),
        "ended {:?} after exp",
        at.duration_since(exp_at)
    );

    // The brain shows node-0 disconnected, counts it among connected nodes no more, and logs
    // why the stream ended.
    let deadline = Instant::now() + Duration::from_secs(3);
    while node0_status(&mut op).await.is_some_and(|n| n.connected) {
        assert!(Instant::now() < deadline, "node-0 still connected");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = brain.http_get("/metrics").unwrap().1;
    assert_eq!(
        metric(&metrics, "splitproxy_brain_connected_nodes"),
        Some(0.0),
        "{metrics}"
    );
    let log = std::fs::read_to_string(dir.path().join("brain.log")).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("node stream ended") && l.contains("expired"))
        .unwrap_or_else(|| panic!("no log line for the stream's end:\n{log}"));
    println!("brain: {line}");

    // The expired token opens nothing now (the API server, with its minute of leeway, may still
    // accept it: the brain does not).
    println!(
        "the API server accepts the expired token: {}",
        reviewed(&cp, &expiring).await
    );
    let bad_token = || {
        let metrics = brain.http_get("/metrics").unwrap().1;
        labelled(
            &metrics,
            "splitproxy_brain_refused_total",
            "reason",
            "bad_token",
        )
    };
    let before = bad_token();
    let status =
        refused(first_update(&mut client(&brain, None, Some(&expiring)).await, "node-0").await);
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("the bearer token was not accepted: the token expired "),
        "{status:?}"
    );
    assert_eq!(bad_token(), before + 1.0);

    // The pod's fresh token opens the stream again.
    let update = first_update(&mut client(&brain, None, Some(&fresh)).await, "node-0")
        .await
        .unwrap_or_else(|e| panic!("the fresh token refused: {e:?}"));
    assert!(update.body.is_some(), "{update:?}");
}

/// A token-shaped string no review has seen.
fn token_unseen() -> String {
    format!(
        "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ1bnNlZW4ifQ.{}",
        std::process::id()
    )
}
