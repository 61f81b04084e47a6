//! "Kernel is the truth" and "restart without disruption" (docs/invariants.md) under real
//! faults, in the lab with real packets.
//!
//! [`tampering_is_repaired_within_10s`]: with a bounded connection loop through a ClusterIP
//! running from a pod on node-0, four kinds of tampering are done with `nft` inside node-0's
//! namespace: one endpoint element deleted, the endpoints map flushed, a rogue element added,
//! the whole `ip splitproxy` table deleted. For each, the test asserts:
//! - repaired within 10 s: the tables, read from the kernel with the actuator's own reader
//!   in node-0's namespace, have the digest of what `GetNodeRuleset` says node-0 should hold
//!   (packet-path elements of dynamic sets aside), measured from the `nft` command's return;
//! - counted: `splitproxy_actuator_drift_repairs_total{what=...}` of node-0 went up for the
//!   kind of object tampered with, and `ListNodes` shows node-0's `drifts` count going up with a
//!   `last_drift` that was repaired;
//! - traffic: every connection of the loop that failed was started between a tampering that
//!   breaks forwarding (deleted endpoint element, flushed map, deleted table) and the moment
//!   the test saw the repair; none failed outside those windows, none during the rogue element's.
//!
//! [`restart_without_any_brain_serves_health_checks_and_traffic`]: every brain stopped, node-0's
//! actuator restarted: its /readyz answers 200 and its healthCheckNodePort answers 200 with its
//! one local endpoint, without any brain, and new connections through the ClusterIP succeed.
use std::time::{Duration, Instant};

use serde_json::json;
use splitproxy_actuator::nft::{NftSocket, comparable};
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{GetNodeRulesetRequest, ListNodesRequest, NodeStatus, datum::Value};
use splitproxy_tests::deploy::metric;
use splitproxy_tests::lab::{Lab, LabOptions};
use splitproxy_tests::traffic::ConnectionLoop;
use splitproxy_tests::{HttpResult, Pod, Proto, probe_async};

const NS: &str = "fk";
const WEB: &str = "10.96.3.10:80";
/// node-1's endpoint of `web` (node-0's is 10.244.0.31).
const WEB_B: &str = "10.244.1.31";
const HEALTH_PORT: u16 = 32110;
/// The target.
const REPAIR_WITHIN: Duration = Duration::from_secs(10);
/// Bounds of the connection loop.
const LOOP_MAX_CONNECTIONS: usize = 20_000;
const LOOP_MAX_DURATION: Duration = Duration::from_secs(240);
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_splitproxy-lab")
}

/// `web`: a LoadBalancer Service with externalTrafficPolicy Local (so it has a
/// healthCheckNodePort), ClusterIP 10.96.3.10, one endpoint on each node.
fn objects() -> String {
    let docs = [
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}),
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": NS},
            "spec": {"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                     "healthCheckNodePort": HEALTH_PORT, "clusterIP": "10.96.3.10",
                     "ports": [{"name": "http", "protocol": "TCP", "port": 80,
                                "targetPort": 8080, "nodePort": 30110}]},
        }),
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-1", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
            "endpoints": [
                {"addresses": ["10.244.0.31"], "conditions": {"ready": true},
                 "nodeName": "node-0", "targetRef": {"kind": "Pod", "namespace": NS, "name": "web-a"}},
                {"addresses": [WEB_B], "conditions": {"ready": true},
                 "nodeName": "node-1", "targetRef": {"kind": "Pod", "namespace": NS, "name": "web-b"}},
            ],
        }),
    ];
    docs.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("\n---\n")
}

async fn setup() -> (Lab, Pod) {
    let lab = Lab::start(LabOptions::new(exe()))
        .await
        .expect("lab starts");
    lab.apply_yaml(&objects()).await.expect("objects apply");
    let client = lab
        .ensure_pod(
            0,
            "client",
            "10.244.0.100".parse().unwrap(),
            &Default::default(),
            &Default::default(),
        )
        .unwrap();
    lab.wait_synced(Duration::from_secs(30))
        .await
        .expect("nodes in sync");
    let start = Instant::now();
    while !probe_async(
        client.netns(),
        Proto::Tcp,
        WEB.parse().unwrap(),
        None,
        PROBE_TIMEOUT,
    )
    .await
    .is_answered()
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "service never answered"
        );
    }
    (lab, client)
}

/// What node-0 should hold, as the brain says (`GetNodeRuleset`), without what the packet
/// path owns.
async fn desired(lab: &Lab) -> Model {
    let mut c = lab.operator_client(0).await.unwrap();
    let rs = c
        .get_node_ruleset(GetNodeRulesetRequest {
            node: "node-0".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .ruleset
        .unwrap();
    comparable(&Model::from_ruleset(&rs))
}

/// node-0's tables as the kernel holds them, read with the actuator's reader in node-0's
/// namespace; `None` if they cannot be read back (e.g. a set `nft` made).
fn held(lab: &Lab) -> Option<Model> {
    lab.cluster
        .node(0)
        .netns()
        .run(|| {
            NftSocket::open()
                .ok()
                .and_then(|mut s| s.read_tables("splitproxy").ok())
                .map(|r| r.model)
        })
        .unwrap()
}

fn nft(lab: &Lab, args: &[&str]) {
    let mut cmd = vec!["nft"];
    cmd.extend_from_slice(args);
    lab.cluster
        .node(0)
        .netns()
        .exec_ok(&cmd)
        .unwrap_or_else(|e| panic!("nft {args:?}: {e:#}"));
}

fn node0(nodes: &[NodeStatus]) -> NodeStatus {
    nodes.iter().find(|n| n.node == "node-0").unwrap().clone()
}

async fn list_nodes(lab: &Lab) -> Vec<NodeStatus> {
    let mut c = lab.operator_client(0).await.unwrap();
    c.list_nodes(ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes
}

fn repairs(lab: &Lab, what: &str) -> f64 {
    let m = lab.actuator_metrics(0).unwrap();
    let line = format!("splitproxy_actuator_drift_repairs_total{{what=\"{what}\"}}");
    m.lines()
        .find(|l| l.starts_with(&line))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line} not exported:\n{m}"))
}

/// node-0's `service-endpoints` element for `WEB_B`, as `nft` takes it.
async fn web_b_element(lab: &Lab) -> String {
    let mut c = lab.operator_client(0).await.unwrap();
    let rs = c
        .get_node_ruleset(GetNodeRulesetRequest {
            node: "node-0".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .ruleset
        .unwrap();
    let set = rs
        .tables
        .iter()
        .filter(|t| t.name == "splitproxy" && t.family == splitproxy_proto::v1::Family::Ip as i32)
        .flat_map(|t| t.sets.iter())
        .find(|s| s.name == "service-endpoints")
        .expect("service-endpoints");
    let b: std::net::Ipv4Addr = WEB_B.parse().unwrap();
    let e = set
        .elements
        .iter()
        .find(|e| matches!(&e.data[0].value, Some(Value::Ipv4(a)) if a[..] == b.octets()))
        .expect("web-b's element");
    let field = |v: &Option<Value>| match v {
        Some(Value::Ipv4(a)) => format!("{}.{}.{}.{}", a[0], a[1], a[2], a[3]),
        Some(Value::Proto(6)) => "tcp".into(),
        Some(Value::Proto(p)) => p.to_string(),
        Some(Value::Port(p)) => p.to_string(),
        Some(Value::U32(v)) => v.to_string(),
        other => panic!("unexpected key field {other:?}"),
    };
    e.key
        .iter()
        .map(|d| field(&d.value))
        .collect::<Vec<_>>()
        .join(" . ")
}

/// One tampering and what the test saw of it.
struct Window {
    what: &'static str,
    tampered: Instant,
    repaired: Instant,
    breaks_traffic: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tampering_is_repaired_within_10s() {
    let (lab, client) = setup().await;
    let want = desired(&lab).await;
    let now = held(&lab).expect("node-0's tables read back");
    assert!(
        now.digest() == want.digest(),
        "before any tampering, node-0's tables are what the brain says; they differ by {:?}\n\nthe brain's: {:?}",
        now.diff(&want),
        want.diff(&now)
    );
    let element = web_b_element(&lab).await;
    let rogue_cluster_ip = "10.96.99.99";

    let looper = ConnectionLoop::start(
        vec![client.clone()],
        WEB.parse().unwrap(),
        LOOP_MAX_CONNECTIONS,
        LOOP_MAX_DURATION,
        PROBE_TIMEOUT,
    );
    tokio::time::sleep(Duration::from_millis(500)).await;

    let tamperings: Vec<(&'static str, &'static str, bool, Vec<String>)> = vec![
        (
            "delete one endpoint element",
            "element",
            true,
            vec![
                "delete".into(),
                "element".into(),
                "ip".into(),
                "splitproxy".into(),
                "service-endpoints".into(),
                format!("{{ {element} }}"),
            ],
        ),
        (
            "flush the endpoints map",
            "element",
            true,
            ["flush", "map", "ip", "splitproxy", "service-endpoints"]
                .map(String::from)
                .to_vec(),
        ),
        (
            "add a rogue element",
            "element",
            false,
            vec![
                "add".into(),
                "element".into(),
                "ip".into(),
                "splitproxy".into(),
                "cluster-ips".into(),
                format!("{{ {rogue_cluster_ip} }}"),
            ],
        ),
        (
            "delete the whole ip table",
            "table",
            true,
            ["delete", "table", "ip", "splitproxy"]
                .map(String::from)
                .to_vec(),
        ),
    ];
    let mut windows = Vec::<Window>::new();
    for (what, kind, breaks_traffic, args) in tamperings {
        let repairs_before = repairs(&lab, kind);
        let drifts_before = node0(&list_nodes(&lab).await).drifts;
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        nft(&lab, &args);
        let tampered = Instant::now();
        assert_ne!(
            held(&lab).map(|m| m.digest()),
            Some(want.digest()),
            "{what}: the tampering changed nothing"
        );
        // Repaired: the kernel holds what the brain says, again.
        let repaired = loop {
            if held(&lab).is_some_and(|m| m.digest() == want.digest()) {
                break Instant::now();
            }
            assert!(
                tampered.elapsed() < REPAIR_WITHIN,
                "{what}: not repaired within {REPAIR_WITHIN:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        eprintln!(
            "{what}: repaired after {:?}",
            repaired.duration_since(tampered)
        );
        windows.push(Window {
            what,
            tampered,
            repaired,
            breaks_traffic,
        });
        // Counted on the node, and visible in ListNodes.
        let start = Instant::now();
        loop {
            let counted = repairs(&lab, kind) > repairs_before;
            let n0 = node0(&list_nodes(&lab).await);
            if counted && n0.drifts > drifts_before && n0.last_drift_repaired {
                eprintln!("{what}: ListNodes says {:?}", n0.last_drift);
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "{what}: drift not counted (repairs {} -> {}) or not in ListNodes ({} -> {}, {:?})",
                repairs_before,
                repairs(&lab, kind),
                drifts_before,
                n0.drifts,
                n0.last_drift
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Let traffic run on the repaired table before the next tampering.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }

    let (failures, n) = looper.stop().await;
    assert!(n > 100, "the loop made {n} connections");
    let mut outside = Vec::new();
    for f in &failures {
        let inside = windows.iter().find(|w| {
            // A connection whose first packet met the damaged table; the probe's own start is
            // taken a moment before the `nft` command returned at the earliest.
            f.started + Duration::from_millis(100) >= w.tampered && f.started <= w.repaired
        });
        match inside {
            Some(w) if w.breaks_traffic => {}
            Some(w) => outside.push(format!("during {:?}: {:?}", w.what, f.result)),
            None => outside.push(format!("outside any tampering: {:?}", f.result)),
        }
    }
    eprintln!(
        "{n} connections, {} failed, all while a tampering had broken the table",
        failures.len()
    );
    assert!(
        outside.is_empty(),
        "{} of {n} connections failed where the rules were whole: {outside:?}",
        outside.len()
    );
    // The node is still in sync and never NACKed: the brain's view did not move.
    let n0 = node0(&list_nodes(&lab).await);
    assert!(n0.connected && n0.in_sync, "{n0:?}");
    assert_eq!(
        metric(
            &lab.actuator_metrics(0).unwrap(),
            "splitproxy_actuator_apply_errors_total"
        ),
        Some(0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restart_without_any_brain_serves_health_checks_and_traffic() {
    let (mut lab, client) = setup().await;
    let node0_ip = lab.cluster.node(0).ips()[0];
    let health_url = format!("http://{node0_ip}:{HEALTH_PORT}/healthz");
    let health = |r: &HttpResult| match r {
        HttpResult::Response(r) => Some((r.status, r.body.clone())),
        _ => None,
    };
    let before = lab.http_get("node-0", &health_url, PROBE_TIMEOUT).await;
    assert_eq!(
        health(&before).map(|(s, _)| s),
        Some(200),
        "with a brain: {before:?}"
    );

    for i in 0..lab.brains.len() {
        lab.stop_brain(i).unwrap();
    }
    lab.stop_actuator(0).unwrap();
    lab.start_actuator(0).unwrap();
    // Ready without any brain: the tables were adopted.
    lab.wait_ready(Duration::from_secs(10))
        .expect("ready without a brain");
    let m = lab.actuator_metrics(0).unwrap();
    assert_eq!(metric(&m, "splitproxy_actuator_adopted"), Some(1.0), "{m}");
    assert_eq!(metric(&m, "splitproxy_actuator_connected"), Some(0.0));
    // The healthCheckNodePort answers, with node-0's one local endpoint.
    let start = Instant::now();
    let answer = loop {
        let r = lab.http_get("node-0", &health_url, PROBE_TIMEOUT).await;
        if let Some((200, body)) = health(&r) {
            break body;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "health check without a brain: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        answer.contains("\"localEndpoints\": 1") || answer.contains("\"localEndpoints\":1"),
        "{answer}"
    );
    // Traffic flows.
    for _ in 0..20 {
        let r = probe_async(
            client.netns(),
            Proto::Tcp,
            WEB.parse().unwrap(),
            None,
            Duration::from_secs(2),
        )
        .await;
        assert!(r.is_answered(), "without a brain: {r:?}");
    }
}

/// The brain's own rules for 10,000 Services x 10 endpoints (every 100th with ClientIP
/// affinity, every 10th of the first 2,000 a NodePort), applied by the actuator's applier in a
/// private network namespace and read back with its reader: the digests are equal, and the
/// time the read and the generation check take is printed (debug build here; see
/// docs/invariants.md for the figures).
#[test]
fn brain_rules_at_10k_services_read_back_equal() {
    use splitproxy_actuator::apply::Applier;
    use splitproxy_brain::desired::SharedRuleset;
    use splitproxy_brain::index::Index;
    use splitproxy_brain::metrics::Metrics;
    use splitproxy_brain::objects::{self, ObjectKey};
    use splitproxy_brain::rules::RulesConfig;
    use splitproxy_proto::v1::{Update, update::Body};

    let (services, endpoints) = (10_000u32, 10u32);
    let metrics = Metrics::default();
    let mut index = Index::default();
    for i in 0..services {
        let mut spec = json!({
            "clusterIP": format!("10.{}.{}.{}", 96 + i / 65536, (i / 256) % 256, i % 256),
            "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
        });
        if i % 100 == 0 {
            spec["sessionAffinity"] = json!("ClientIP");
        }
        if i < 2000 && i % 10 == 2 {
            spec["type"] = json!("NodePort");
            spec["ports"][0]["nodePort"] = json!(30000 + i);
        }
        let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(json!({
            "metadata": {"name": format!("s{i}"), "namespace": "bench"},
            "spec": spec,
        }))
        .unwrap();
        index.apply_service(
            ObjectKey::of(&svc),
            objects::service(&svc, &Default::default(), &metrics),
        );
        let eps: Vec<_> = (0..endpoints)
            .map(|k| {
                let n = i * endpoints + k;
                json!({"addresses": [format!("10.{}.{}.{}", 128 + (n / 65536) % 64, (n / 256) % 256, n % 256)],
                       "conditions": {"ready": true}})
            })
            .collect();
        let sl: k8s_openapi::api::discovery::v1::EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": format!("s{i}-1"), "namespace": "bench",
                         "labels": {"kubernetes.io/service-name": format!("s{i}")}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": eps,
        }))
        .unwrap();
        index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
    }
    let mut d = SharedRuleset::new(RulesConfig::default());
    d.rebuild(&index);
    let model = d.model().clone();
    let snapshot = Update {
        brain_epoch: 1,
        generation: 1,
        digest: model.digest(),
        body: Some(Body::Snapshot(model.to_ruleset())),
        ..Default::default()
    };
    let elements = model.element_count();
    std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let mut applier = Applier::new(NftSocket::open().unwrap(), "splitproxy".into());
        applier.apply(&snapshot).unwrap();
        let want = comparable(applier.model());
        let t = Instant::now();
        let read = applier.kernel_mut().read_tables("splitproxy").unwrap();
        let took = t.elapsed();
        let t = Instant::now();
        let generation = applier.kernel_mut().generation().unwrap();
        let gen_took = t.elapsed();
        eprintln!(
            "brain rules, {services} Services x {endpoints}: {elements} elements read back in \
             {took:?}; generation check {gen_took:?}"
        );
        assert_eq!(generation, read.generation);
        assert!(
            read.model.digest() == want.digest(),
            "the brain's rules read back differently: {:?}",
            want.diff(&read.model)
        );
        assert_eq!(read.model.digest(), applier.applied().digest);
    })
    .join()
    .unwrap();
}
