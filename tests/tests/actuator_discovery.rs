//! The actuator finds its brains through the EndpointSlices of their headless Service, against
//! the real API server (issue #10, "Finding the brains"): no `--brain` address, only
//! `--brain-service`, and the chart's own objects for it, rendered with helm
//! (`splitproxy_tests::install::render`): the brains' headless Service, and the actuator's
//! ServiceAccount with its Role and RoleBinding, whose one rule lets it list EndpointSlices in
//! the release's namespace and nothing else. The actuator runs with a token of that account.
//!
//! Two brains on host loopback, reached from the node namespace through forwarders at
//! 192.0.2.2:9443 and 192.0.2.3:9443 (addresses of the namespace's `lo`: the API server refuses
//! loopback addresses in a slice), the addresses the slice names, as brains on host network at
//! the same port on two nodes:
//!
//! 0. the chart's Role without any one of its rules (today its only one, `list` on
//!    EndpointSlices): the actuator's discovery fails, says so in its log (the API server's
//!    refusal) and counts it (`splitproxy_actuator_discovery_lists_total{result="error"}`),
//!    finds no brain and connects to none, although both brains are in the slice;
//! 1. with the chart's Role as rendered, the actuator syncs with the brain its rendezvous order
//!    over the discovered set prefers;
//! 2. that brain killed and dropped from the slice: the node is in sync on the other;
//! 3. a third brain (192.0.2.4) replaces the survivor in the slice, and the survivor is killed:
//!    every brain the node knew has failed, so it lists the slices again, finds the third, and
//!    is in sync there.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use http::Uri;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::Api;
use kube::api::{DynamicObject, PostParams};
use nix::sys::signal::Signal;
use serde_json::Value;
use splitproxy_actuator::client::brain_order;
use splitproxy_proto::v1::ListNodesRequest;
use splitproxy_tests::certs::{Pki, TlsFiles};
use splitproxy_tests::controlplane::{ControlPlane, ControlPlaneOptions};
use splitproxy_tests::deploy::{
    ACTUATOR_METRICS, Brain, BrainOptions, grpc_client, http_get_in, labelled, metric,
};
use splitproxy_tests::fixtures::{Ep, slice};
use splitproxy_tests::install;
use splitproxy_tests::manifests;
use splitproxy_tests::netns::Netns;
use splitproxy_tests::portfwd::{Forwarder, forward_port};
use splitproxy_tests::process::Child;

/// The release's namespace, as the chart is rendered.
const NS: &str = install::NAMESPACE;
/// The brains' headless Service and the actuators' account, as the chart names them.
const SERVICE: &str = "splitproxy-brain";
const ACCOUNT: &str = "splitproxy-actuator";
const NODE: &str = "node-0";
/// The port the slice names; each brain is at its own address in the node namespace.
const PORT: u16 = 9443;
const SYNC: Duration = Duration::from_secs(30);

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"))
}

/// The brain's address as the node sees it (and the slice names it): 192.0.2.(2 + i), on the
/// node namespace's `lo` (TEST-NET-1: nothing outside the namespace).
fn node_address(i: usize) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, 2 + i as u8], PORT))
}

fn uri(i: usize) -> Uri {
    format!("https://{}", node_address(i)).parse().unwrap()
}

fn kind(o: &DynamicObject) -> &str {
    o.types.as_ref().map(|t| t.kind.as_str()).unwrap_or("")
}

/// The chart's objects discovery rests on, rendered with its default values: the brains'
/// headless Service, and the actuator's ServiceAccount, Role and RoleBinding.
fn chart_objects() -> Vec<DynamicObject> {
    let objects: Vec<DynamicObject> = install::render(&[], &[])
        .expect("helm template")
        .into_iter()
        .filter(|o| {
            let name = o.metadata.name.as_deref().unwrap_or("");
            match kind(o) {
                "Service" => name == SERVICE,
                "ServiceAccount" | "Role" | "RoleBinding" => name == ACCOUNT,
                _ => false,
            }
        })
        .collect();
    let kinds: Vec<&str> = objects.iter().map(kind).collect();
    assert_eq!(
        kinds.len(),
        4,
        "the chart's discovery objects changed: {kinds:?}"
    );
    let binding = objects.iter().find(|o| kind(o) == "RoleBinding").unwrap();
    assert_eq!(
        binding.data["subjects"],
        serde_json::json!([{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NS}]),
        "the Role is bound to the actuators' account"
    );
    objects
}

/// The chart's Role's rules.
fn role_rules(objects: &[DynamicObject]) -> Vec<Value> {
    let role = objects.iter().find(|o| kind(o) == "Role").unwrap();
    role.data["rules"].as_array().cloned().unwrap_or_default()
}

/// `objects` as YAML, with the Role's rules replaced by `rules`.
fn with_rules(objects: &[DynamicObject], rules: &[Value]) -> String {
    objects
        .iter()
        .map(|o| {
            let mut o = o.clone();
            if kind(&o) == "Role" {
                o.data["rules"] = Value::Array(rules.to_vec());
            }
            serde_yaml::to_string(&o).unwrap()
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

/// Whether the authorizer lets the actuators' account do what `rule` names first (its first
/// verb on its first resource in [`NS`]).
async fn allowed(cp: &ControlPlane, rule: &Value) -> bool {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(format!("system:serviceaccount:{NS}:{ACCOUNT}")),
            groups: Some(vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{NS}"),
                "system:authenticated".into(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(NS.into()),
                group: rule["apiGroups"][0].as_str().map(String::from),
                resource: rule["resources"][0].as_str().map(String::from),
                verb: rule["verbs"][0].as_str().map(String::from),
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

/// Applies the chart's objects with the Role's `rules` and waits until the authorizer says
/// `rule` is (`granted`) or is not allowed (RBAC takes effect asynchronously).
async fn apply_rbac(
    cp: &ControlPlane,
    objects: &[DynamicObject],
    rules: &[Value],
    rule: &Value,
    granted: bool,
) {
    manifests::apply(&cp.client(), &with_rules(objects, rules), NS, false)
        .await
        .expect("the chart's objects");
    let deadline = Instant::now() + Duration::from_secs(20);
    while allowed(cp, rule).await != granted {
        assert!(
            Instant::now() < deadline,
            "RBAC never took effect: {rule} granted={granted}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A kubeconfig with a token of the actuators' account.
async fn account_kubeconfig(cp: &ControlPlane) -> PathBuf {
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let token = Api::<ServiceAccount>::namespaced(cp.client(), NS)
        .create_token_request(ACCOUNT, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
        .unwrap();
    cp.kubeconfig_for_token(&token).unwrap()
}

/// The Service's one EndpointSlice, with the brains `brains` (by index) ready.
fn brain_slice(brains: &[usize]) -> String {
    let eps: Vec<Ep> = brains
        .iter()
        .map(|i| {
            Ep::new(
                node_address(*i).ip().to_string(),
                format!("brain-node-{i}"),
                format!("brain-{i}"),
            )
        })
        .collect();
    slice(
        NS,
        &format!("{SERVICE}-a"),
        SERVICE,
        &[("grpc", "TCP", PORT)],
        &eps,
    )
}

/// Starts brain `i` and forwards its node-side address to it.
fn start_brain(
    cp: &ControlPlane,
    pki: &Pki,
    dir: &Path,
    ns: &Netns,
    i: usize,
) -> (Brain, Forwarder) {
    let brain = Brain::start(
        &exe(),
        cp.kubeconfig_path(),
        pki,
        dir,
        &format!("brain-{i}"),
        None,
        &BrainOptions::with_service_cidrs(&["10.96.0.0/16".parse().unwrap()]),
    )
    .expect("brain starts");
    let address = format!("{}/32", node_address(i).ip());
    ns.ip(&["addr", "add", &address, "dev", "lo"])
        .expect("brain address");
    let fwd = forward_port(ns, node_address(i), brain.grpc).expect("forwarder");
    (brain, fwd)
}

/// Whether the brain at `grpc` serves `NODE` connected and in sync.
async fn serves_in_sync(grpc: SocketAddr, op: &TlsFiles) -> bool {
    let Ok(mut c) = grpc_client(grpc, op).await else {
        return false;
    };
    let Ok(r) = c.list_nodes(ListNodesRequest {}).await else {
        return false;
    };
    let r = r.into_inner();
    r.synced
        && r.nodes
            .iter()
            .any(|n| n.node == NODE && n.connected && n.in_sync)
}

/// Waits until brain `grpc` serves the node in sync; panics with the actuator's log otherwise.
async fn wait_in_sync(grpc: SocketAddr, op: &TlsFiles, actuator: &Child, what: &str) {
    let start = Instant::now();
    while !serves_in_sync(grpc, op).await {
        assert!(
            start.elapsed() < SYNC,
            "{what}: not in sync after {SYNC:?}; actuator log:\n{}",
            actuator.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn actuator_metric(ns: &Netns, name: &str) -> f64 {
    let (_, text) = http_get_in(ns, ACTUATOR_METRICS.parse().unwrap(), "/metrics").unwrap();
    metric(&text, name).unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// The actuator with discovery only, in `ns`, with `kubeconfig`; its log is `log`.
fn start_actuator(ns: &Netns, kubeconfig: &Path, node_tls: &TlsFiles, log: &Path) -> Child {
    let mut cmd = Command::new(exe());
    cmd.arg("actuator")
        .arg(format!("--brain-service={NS}/{SERVICE}"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        // The harness's brain certificates name 127.0.0.1 and localhost, not splitproxy-brain.
        .args([
            "--brain-server-name",
            "localhost",
            "--hostname-override",
            NODE,
        ])
        .arg("--ca")
        .arg(&node_tls.ca)
        .arg("--tls-cert")
        .arg(&node_tls.cert)
        .arg("--tls-key")
        .arg(&node_tls.key)
        .args(["--healthz-bind-address", "127.0.0.1:10256"])
        .args(["--metrics-bind-address", ACTUATOR_METRICS])
        .env("RUST_LOG", "info");
    ns.spawn("actuator", cmd, log).expect("actuator starts")
}

/// `splitproxy_actuator_discovery_lists_total{result}` of the actuator in `ns`.
fn lists(ns: &Netns, result: &str) -> f64 {
    let (_, text) = http_get_in(ns, ACTUATOR_METRICS.parse().unwrap(), "/metrics").unwrap();
    labelled(
        &text,
        "splitproxy_actuator_discovery_lists_total",
        "result",
        result,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_actuator_finds_its_brains_in_the_endpointslices() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane");
    let client = cp.client();
    let objects = chart_objects();
    let rules = role_rules(&objects);
    assert!(!rules.is_empty(), "the chart's actuator Role has no rule");
    manifests::apply(&client, &with_rules(&objects, &rules), NS, false)
        .await
        .expect("the chart's objects");
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new("splitproxy-brains").unwrap();
    let node_tls = pki
        .write(dir.path(), "node", &pki.node_cert(NODE).unwrap())
        .unwrap();
    let op = pki
        .write(dir.path(), "op", &pki.operator_cert("op").unwrap())
        .unwrap();

    let ns = Netns::create("discovery").expect("node namespace");
    let (mut brain0, _fwd0) = start_brain(&cp, &pki, dir.path(), &ns, 0);
    let (mut brain1, _fwd1) = start_brain(&cp, &pki, dir.path(), &ns, 1);
    let brains = [brain0.grpc, brain1.grpc];
    manifests::apply(&client, &brain_slice(&[0, 1]), NS, false)
        .await
        .expect("the brains' EndpointSlice");
    // The API server, at the address the account's kubeconfig names, from the node.
    let _api = forward_port(&ns, cp.addr(), cp.addr()).expect("API forwarder");
    let kubeconfig = account_kubeconfig(&cp).await;

    // ---- 0. without any one rule of the chart's Role, discovery fails ----
    for (i, rule) in rules.iter().enumerate() {
        let mut less = rules.clone();
        less.remove(i);
        apply_rbac(&cp, &objects, &less, rule, false).await;
        let log = dir.path().join(format!("actuator-without-rule-{i}.log"));
        let mut actuator = start_actuator(&ns, &kubeconfig, &node_tls, &log);
        let started = Instant::now();
        // The metrics server is up before the first list; lists are then paced 1, 2, 4 s apart.
        while http_get_in(&ns, ACTUATOR_METRICS.parse().unwrap(), "/metrics").is_err()
            || lists(&ns, "error") < 2.0
        {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "without {rule}: no failed list counted; actuator log:\n{}",
                actuator.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(lists(&ns, "ok"), 0.0, "without {rule}");
        assert_eq!(
            actuator_metric(&ns, "splitproxy_actuator_brains_known"),
            0.0,
            "without {rule}"
        );
        assert_eq!(
            actuator_metric(&ns, "splitproxy_actuator_connected"),
            0.0,
            "without {rule}"
        );
        for brain in brains {
            assert!(!serves_in_sync(brain, &op).await, "without {rule}");
        }
        let text = std::fs::read_to_string(&log).unwrap();
        let line = text
            .lines()
            .find(|l| l.contains("finding the brains failed"))
            .unwrap_or_else(|| panic!("without {rule}: no discovery error logged:\n{text}"));
        assert!(
            line.contains(&format!("listing the EndpointSlices of {NS}/{SERVICE}"))
                && line.contains("forbidden")
                && line.contains(&format!("system:serviceaccount:{NS}:{ACCOUNT}")),
            "without {rule}: {line}"
        );
        eprintln!("without {rule}: {line}");
        actuator.stop().expect("the actuator stops");
    }
    // The chart's Role as rendered.
    apply_rbac(&cp, &objects, &rules, &rules[0], true).await;
    let actuator = start_actuator(
        &ns,
        &kubeconfig,
        &node_tls,
        &dir.path().join("actuator.log"),
    );

    // ---- 1. in sync on the brain the node prefers among those discovered ----
    let order = brain_order(NODE, &[uri(0), uri(1)]);
    let first = usize::from(order[0] == uri(1));
    let other = 1 - first;
    wait_in_sync(brains[first], &op, &actuator, "the preferred brain").await;
    assert!(!serves_in_sync(brains[other], &op).await, "one stream only");
    assert_eq!(
        actuator_metric(&ns, "splitproxy_actuator_brains_known"),
        2.0
    );
    let ok_lists = |ns: &Netns| lists(ns, "ok");
    assert_eq!(ok_lists(&ns), 1.0, "one list at start, no watch");
    assert_eq!(lists(&ns, "error"), 0.0);

    // ---- 2. the brain it uses killed and dropped from the slice: the other one ----
    let killed = Instant::now();
    let kill = |b: &mut Brain| b.child.signal(Signal::SIGKILL).expect("kill -9 the brain");
    kill(if first == 0 { &mut brain0 } else { &mut brain1 });
    manifests::apply(&client, &brain_slice(&[other]), NS, false)
        .await
        .expect("slice without the killed brain");
    wait_in_sync(brains[other], &op, &actuator, "the other brain").await;
    eprintln!(
        "in sync on the other brain {:?} after the kill",
        killed.elapsed()
    );

    // ---- 3. every known brain fails: the slices are listed again ----
    let (brain2, _fwd2) = start_brain(&cp, &pki, dir.path(), &ns, 2);
    manifests::apply(&client, &brain_slice(&[2]), NS, false)
        .await
        .expect("slice with the third brain only");
    let lists_before = ok_lists(&ns);
    kill(if other == 0 { &mut brain0 } else { &mut brain1 });
    wait_in_sync(
        brain2.grpc,
        &op,
        &actuator,
        "the brain found by listing again",
    )
    .await;
    assert!(ok_lists(&ns) > lists_before, "listed again");
    assert_eq!(
        actuator_metric(&ns, "splitproxy_actuator_brains_known"),
        1.0
    );
    assert_eq!(
        actuator_metric(&ns, "splitproxy_actuator_connected"),
        1.0,
        "{}",
        actuator.log_tail(20)
    );
}
