//! The actuator finds its brains through the EndpointSlices of their headless Service, against
//! the real API server (issue #10, "Finding the brains"): no `--brain` address, only
//! `--brain-service`, and a kubeconfig for a user who may list EndpointSlices in the brains'
//! namespace and nothing else (the RBAC the chart gives the actuator).
//!
//! Two brains on host loopback, reached from the node namespace through forwarders at
//! 192.0.2.2:9443 and 192.0.2.3:9443 (addresses of the namespace's `lo`: the API server refuses
//! loopback addresses in a slice), the addresses the slice names, as brains on host network at
//! the same port on two nodes:
//!
//! 1. the actuator syncs with the brain its rendezvous order over the discovered set prefers;
//! 2. that brain killed and dropped from the slice: the node is in sync on the other;
//! 3. a third brain (192.0.2.4) replaces the survivor in the slice, and the survivor is killed:
//!    every brain the node knew has failed, so it lists the slices again, finds the third, and
//!    is in sync there.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use http::Uri;
use nix::sys::signal::Signal;
use splitproxy_actuator::client::brain_order;
use splitproxy_proto::v1::ListNodesRequest;
use splitproxy_tests::certs::{Pki, TlsFiles};
use splitproxy_tests::controlplane::{ControlPlane, ControlPlaneOptions};
use splitproxy_tests::deploy::{
    ACTUATOR_METRICS, Brain, BrainOptions, grpc_client, http_get_in, metric,
};
use splitproxy_tests::fixtures::{Ep, docs, namespace, slice};
use splitproxy_tests::manifests;
use splitproxy_tests::netns::Netns;
use splitproxy_tests::portfwd::{Forwarder, forward_port};
use splitproxy_tests::process::Child;

const NS: &str = "splitproxy-brains";
const SERVICE: &str = "splitproxy-brain";
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

/// The brains' headless Service, and the Role that lets `user` list its EndpointSlices, no more.
fn service_and_rbac(user: &str) -> String {
    let service = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {SERVICE}\n  namespace: {NS}\nspec:\n  \
         clusterIP: None\n  ports:\n    - {{name: grpc, protocol: TCP, port: {PORT}}}\n"
    );
    let role = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata:\n  name: \
         splitproxy-actuator\n  namespace: {NS}\nrules:\n  - apiGroups: [discovery.k8s.io]\n    \
         resources: [endpointslices]\n    verbs: [list]\n"
    );
    let binding = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata:\n  name: \
         splitproxy-actuator\n  namespace: {NS}\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  \
         kind: Role\n  name: splitproxy-actuator\nsubjects:\n  - apiGroup: \
         rbac.authorization.k8s.io\n    kind: User\n    name: {user}\n"
    );
    docs(&[namespace(NS), service, role, binding])
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_actuator_finds_its_brains_in_the_endpointslices() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane");
    let client = cp.client();
    let user = "splitproxy-actuator-test";
    manifests::apply(&client, &service_and_rbac(user), NS, false)
        .await
        .expect("Service and RBAC");
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
    // The API server, at the address the user's kubeconfig names, from the node.
    let _api = forward_port(&ns, cp.addr(), cp.addr()).expect("API forwarder");
    let kubeconfig = cp.kubeconfig_for_user(user, &[]).unwrap();

    let mut cmd = Command::new(exe());
    cmd.arg("actuator")
        .arg(format!("--brain-service={NS}/{SERVICE}"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
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
    let actuator = ns
        .spawn("actuator", cmd, &dir.path().join("actuator.log"))
        .expect("actuator starts");

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
    let lists_ok = "splitproxy_actuator_discovery_lists_total{result=\"ok\"}";
    let ok_lists = |ns: &Netns| {
        let (_, text) = http_get_in(ns, ACTUATOR_METRICS.parse().unwrap(), "/metrics").unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(lists_ok)?.trim().parse::<f64>().ok())
            .unwrap()
    };
    assert_eq!(ok_lists(&ns), 1.0, "one list at start, no watch");

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
