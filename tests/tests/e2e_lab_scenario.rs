//! The lab as scenarios use it: a lab configured by a scenario's lab.yaml, dual-stack Node
//! objects, pods made from IPv4 and IPv6 EndpointSlices, probes from pods, nodes, external
//! clients and addresses, host-network endpoints, Node merges, HTTP to node health checks, and
//! the replay of every probe of the scenario (ClusterIPs and a Local-policy NodePort).
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use splitproxy_tests::lab::{Lab, LabOptions, Origin};
use splitproxy_tests::scenario::{ReplayOptions, Scenario};
use splitproxy_tests::{ProbeResult, Proto};

fn scenario() -> Scenario {
    Scenario::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("lab/scenarios/nodeport-local"))
        .expect("scenario loads")
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_scenario_lab_is_dual_stack_and_probes_from_anywhere() {
    let scenario = scenario();
    let opts = scenario
        .lab_options(LabOptions::new(env!("CARGO_BIN_EXE_splitproxy-lab")))
        .unwrap();
    let lab = Lab::start(opts).await.expect("lab starts");
    let applied = lab
        .apply_scenario(&scenario)
        .await
        .expect("scenario applies");
    assert!(
        applied.iter().any(|a| a == "EndpointSlice np/web-ipv6"),
        "{applied:?}"
    );

    // The brain got the kube-proxy-like flags.
    let pid = lab.brain(0).child.id().unwrap();
    let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .replace('\0', " ");
    assert!(
        cmdline.contains("--cluster-cidr 10.244.0.0/16,fd00:244::/48")
            && cmdline.contains("--detect-local-mode ClusterCIDR")
            && cmdline.contains("--service-cidr 10.96.0.0/16,fd00:96::/112"),
        "{cmdline}"
    );

    // Node objects: both families, zone, pod CIDRs.
    let nodes: Api<Node> = Api::all(lab.cp.client());
    let node0 = nodes.get("node-0").await.unwrap();
    let labels = node0.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("topology.kubernetes.io/zone")
            .map(String::as_str),
        Some("zone-a")
    );
    assert_eq!(
        node0.spec.as_ref().unwrap().pod_cidrs.clone().unwrap(),
        ["10.244.0.0/24", "fd00:244::/64"]
    );
    let internal: Vec<String> = node0
        .status
        .as_ref()
        .unwrap()
        .addresses
        .iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP")
        .map(|a| a.address.clone())
        .collect();
    assert_eq!(internal, ["192.168.77.10", "fd00:77::10"]);

    // A Node in YAML merges into the lab's: labels add up, addresses are replaced (here by
    // the same two plus an ExternalIP: the node's addresses are facts the rules use, and the
    // scenario's NodePort probes below expect both primary addresses).
    lab.apply_yaml(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-1\n  labels: {example.com/rack: r7}\n\
         status:\n  addresses:\n  - {type: InternalIP, address: 192.168.77.11}\n\
         \x20 - {type: InternalIP, address: \"fd00:77::11\"}\n\
         \x20 - {type: ExternalIP, address: 203.0.113.11}\n",
    )
    .await
    .unwrap();
    let node1 = nodes.get("node-1").await.unwrap();
    let labels = node1.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels.get("example.com/rack").map(String::as_str),
        Some("r7")
    );
    assert_eq!(
        labels
            .get("topology.kubernetes.io/zone")
            .map(String::as_str),
        Some("zone-b")
    );
    assert_eq!(node1.status.unwrap().addresses.unwrap().len(), 3);

    // Pods: web-0 from two slices has both addresses; the configured client exists.
    let web = lab.pod("web-0").expect("web-0 created from the slices");
    assert_eq!(web.node(), "node-0");
    assert_eq!(web.ips(), ips(&["10.244.0.10", "fd00:244::10"]));
    let client = lab.pod("client").expect("client from lab.yaml");
    assert_eq!(client.ips(), ips(&["10.244.1.100", "fd00:244:0:1::100"]));

    // `from` resolves names and addresses.
    for (from, want) in [
        ("192.168.77.11", "node node-1"),
        ("fd00:77::10", "node node-0"),
        ("fd00:77::200", "external external"),
        ("10.244.0.10", "pod web-0"),
        ("client", "pod client"),
        ("node-0", "node node-0"),
        ("external", "external external"),
    ] {
        let src = lab.resolve(from).unwrap();
        assert_eq!(src.describe(&lab), want, "{from}");
        assert_eq!(src.bind.is_some(), from.parse::<IpAddr>().is_ok());
    }
    assert!(matches!(
        lab.resolve("fd00:244::10").unwrap().origin,
        Origin::Pod(_)
    ));
    assert!(lab.resolve("10.9.9.9").is_err() && lab.resolve("nobody").is_err());

    // Every probe of the scenario passes: ClusterIPs over both families, and its NodePort
    // with externalTrafficPolicy Local (answered with the client's source on the node with the
    // endpoint, dropped on the other, short-circuited for pods).
    assert!(scenario.probes.len() >= 6);
    let reports = lab
        .replay(&scenario.probes, &ReplayOptions::default())
        .await;
    for r in &reports {
        assert_eq!(r.pass, Some(true), "{}", r.to_text());
        assert!(!r.explained.is_empty(), "not explained: {}", r.to_text());
    }

    // Probes report the endpoint after DNAT and the source seen, over both families.
    let r = lab
        .probe("client", Proto::Tcp, "[fd00:96::1010]:80".parse().unwrap())
        .await;
    assert_eq!(
        r.endpoint(),
        Some("[fd00:244::10]:8080".parse().unwrap()),
        "{r}"
    );
    assert_eq!(
        r.source().map(|s| s.ip()),
        Some("fd00:244:0:1::100".parse().unwrap())
    );
    let r = lab
        .probe(
            "10.244.1.100",
            Proto::Tcp,
            "10.96.10.10:80".parse().unwrap(),
        )
        .await;
    assert_eq!(r.source_preserved(), Some(true), "{r}");

    // A host-network endpoint: the node's own namespace answers on the node's address.
    lab.apply_yaml(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: host-1\n  \
         namespace: np\n  labels: {kubernetes.io/service-name: host}\naddressType: IPv4\n\
         ports: [{name: dns, protocol: UDP, port: 5353}]\nendpoints:\n\
         - addresses: [192.168.77.11]\n  nodeName: node-1\n  targetRef: {kind: Pod, name: host-dns}\n",
    )
    .await
    .unwrap();
    let dst: SocketAddr = "192.168.77.11:5353".parse().unwrap();
    let r = lab.probe("external", Proto::Udp, dst).await;
    match &r {
        ProbeResult::Answered { pod, endpoint, .. } => {
            assert_eq!((pod.as_str(), *endpoint), ("host-dns", dst));
        }
        other => panic!("host-network server did not answer: {other}"),
    }

    // A Service's status (LoadBalancer ingress) is applied too.
    lab.apply_yaml(
        "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: np}\nspec:\n  \
         type: LoadBalancer\n  clusterIP: 10.96.10.20\n  ports: [{name: http, port: 80, \
         targetPort: 8080, nodePort: 30081}]\nstatus:\n  loadBalancer:\n    \
         ingress: [{ip: 203.0.113.10}]\n",
    )
    .await
    .unwrap();
    let lb = Api::<k8s_openapi::api::core::v1::Service>::namespaced(lab.cp.client(), "np")
        .get("lb")
        .await
        .unwrap();
    let ingress = lb.status.unwrap().load_balancer.unwrap().ingress.unwrap();
    assert_eq!(ingress[0].ip.as_deref(), Some("203.0.113.10"));

    // A fixed source port is kept (or the pod sees it masqueraded).
    let r = lab
        .probe_from_port(
            "client",
            Proto::Tcp,
            "10.96.10.10:80".parse().unwrap(),
            41000,
        )
        .await;
    assert_eq!(r.client().map(|c| c.port()), Some(41000), "{r}");

    // Node health checks over HTTP, from outside, both families.
    for url in [
        "http://192.168.77.10:10256/healthz",
        "http://[fd00:77::11]:10256/readyz",
    ] {
        let r = lab.http_get("external", url, Duration::from_secs(3)).await;
        assert_eq!(r.status(), Some(200), "{url}: {r}");
    }
}

/// Every other scenario under `tests/lab/scenarios/` replays with all its expectations met, as
/// `splitproxy-lab up --scenario DIR --probe` would report them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_scenario_replays() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("lab/scenarios");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("lab.yaml").exists() && !p.ends_with("nodeport-local"))
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no scenarios besides nodeport-local");
    for dir in dirs {
        let scenario = Scenario::load(&dir).expect("scenario loads");
        let opts = scenario
            .lab_options(LabOptions::new(env!("CARGO_BIN_EXE_splitproxy-lab")))
            .unwrap();
        let lab = Lab::start(opts).await.expect("lab starts");
        lab.apply_scenario(&scenario)
            .await
            .expect("scenario applies");
        let reports = lab
            .replay(&scenario.probes, &ReplayOptions::default())
            .await;
        assert!(!reports.is_empty(), "{}: no probes", dir.display());
        for r in &reports {
            // The expectations held, and the brain's ExplainPacket agreed with every result
            // (a disagreement fails the probe).
            assert_eq!(r.pass, Some(true), "{}: {}", dir.display(), r.to_text());
            assert!(
                !r.explained.is_empty() && r.disagreements.is_empty(),
                "{}: {}",
                dir.display(),
                r.to_text()
            );
        }
    }
}
