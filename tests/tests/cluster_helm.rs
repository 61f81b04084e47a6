//! splitproxy installed with `helm install` on a real cluster (issue #11): `tools/cluster.sh`
//! with two real kubelet nodes and no kube-proxy, the chart's images imported into each node's
//! containerd (`tools/image.sh`), and real workloads whose EndpointSlices the real
//! kube-controller-manager writes. Everything is observed as a user would: `kubectl`, `helm`,
//! probes from pods (`kubectl exec`) and from outside the nodes, and the actuators' metrics.
//!
//! One test, in the order a platform team goes: install, `helm test`, traffic, scaling,
//! `helm upgrade` under a connection loop, a brain pod killed and a node drained under the same
//! loop, `helm uninstall` and the documented clean-up.
//!
//! Needs root and the `cluster` binaries (`tools/build-tools.sh cluster`, which `tools/test.sh`
//! runs); the images are built here with `tools/image.sh --repository localhost/splitproxy`
//! (the same release build as the chart's image test, so a second build costs nothing).
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use splitproxy_tests::cluster::{API_IP, Cluster};
use splitproxy_tests::deploy::metric;
use splitproxy_tests::images;
use splitproxy_tests::netns::Netns;
use splitproxy_tests::probe::{self, HttpResult, ProbeResult, Proto};
use splitproxy_tests::process::wait_until;
use splitproxy_tests::tools::workspace_root;

const NODES: usize = 2;
const NS: &str = "echo";
const RELEASE_NS: &str = "splitproxy";

/// One echo pod as `kubectl get` shows it.
struct EchoPod {
    name: String,
    ip: Option<IpAddr>,
    node: String,
    /// Deleted, still terminating.
    terminating: bool,
    ready: bool,
}

fn list_echo_pods(cluster: &Cluster) -> Vec<EchoPod> {
    let out = cluster
        .kubectl(&[
            "-n",
            NS,
            "get",
            "pods",
            "-l",
            "app=echo",
            "-o",
            r#"jsonpath={range .items[*]}{.metadata.name}|{.status.podIP}|{.spec.nodeName}|{.metadata.deletionTimestamp}|{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}"#,
        ])
        .unwrap();
    out.lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split('|').collect();
            (w.len() == 5).then(|| EchoPod {
                name: w[0].to_string(),
                ip: w[1].parse().ok(),
                node: w[2].to_string(),
                terminating: !w[3].is_empty(),
                ready: w[4] == "True",
            })
        })
        .collect()
}

/// The echo pods not terminating: name -> (pod IP, node).
fn echo_pods(cluster: &Cluster) -> BTreeMap<String, (IpAddr, String)> {
    list_echo_pods(cluster)
        .into_iter()
        .filter(|p| !p.terminating)
        .filter_map(|p| Some((p.name, (p.ip?, p.node))))
        .collect()
}

/// Ready echo pods, not terminating.
fn ready_echo_pods(cluster: &Cluster) -> BTreeSet<String> {
    list_echo_pods(cluster)
        .into_iter()
        .filter(|p| p.ready && !p.terminating)
        .map(|p| p.name)
        .collect()
}

fn jsonpath(cluster: &Cluster, args: &[&str], path: &str) -> String {
    let mut all = args.to_vec();
    let p = format!("jsonpath={path}");
    all.extend(["-o", p.as_str()]);
    cluster.kubectl(&all).unwrap().trim().to_string()
}

fn client(i: usize) -> String {
    format!("client-node-{i}")
}

/// The handle of node `i`'s `ip splitproxy` table: a table deleted and made again (flushed)
/// gets a new one.
fn table_handle(cluster: &Cluster, i: usize) -> Option<String> {
    let out = cluster
        .in_netns(
            &cluster.node_netns(i),
            &["nft", "-a", "list", "table", "ip", "splitproxy"],
        )
        .ok()?;
    let first = out.lines().next()?;
    first
        .split("# handle ")
        .nth(1)
        .map(|h| h.trim().to_string())
}

/// The actuators' network programming latency histogram on node `i` (count, sum in seconds),
/// scraped from the node's metrics port as Prometheus would.
fn npl(fabric: &Netns, i: usize) -> (f64, f64) {
    let url = format!("http://{}:10249/metrics", Cluster::node_ip(i));
    let HttpResult::Response(resp) = probe::http_get(fabric, None, &url, Duration::from_secs(3))
    else {
        panic!("no metrics from node-{i}");
    };
    let text = resp.body;
    let name = "kubeproxy_network_programming_duration_seconds";
    (
        metric(&text, &format!("{name}_count")).unwrap_or(0.0),
        metric(&text, &format!("{name}_sum")).unwrap_or(0.0),
    )
}

/// A bounded connection loop through a ClusterIP from every client pod, run in the background
/// until stopped; every probe's result is kept.
struct ConnectionLoop {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<Vec<ProbeResult>>>,
}

impl ConnectionLoop {
    fn start(dir: PathBuf, prefix: &str, clients: Vec<String>, dst: String) -> ConnectionLoop {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = clients
            .into_iter()
            .map(|pod| {
                let (stop, dst, dir, prefix) =
                    (stop.clone(), dst.clone(), dir.clone(), prefix.to_string());
                std::thread::spawn(move || {
                    let cluster = Cluster::attach(&dir, &prefix, NODES);
                    let deadline = Instant::now() + Duration::from_secs(300);
                    let mut all = Vec::new();
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        match cluster.probe_from_pod(
                            NS,
                            &pod,
                            "tcp",
                            &dst,
                            20,
                            Duration::from_millis(50),
                        ) {
                            Ok(results) => all.extend(results),
                            Err(e) => all.push(ProbeResult::Error(format!("{pod}: {e:#}"))),
                        }
                    }
                    all
                })
            })
            .collect();
        ConnectionLoop { stop, threads }
    }

    /// Stops the loop; (probes answered, the others).
    fn finish(self) -> (usize, Vec<ProbeResult>) {
        self.stop.store(true, Ordering::Relaxed);
        let mut ok = 0;
        let mut failed = Vec::new();
        for t in self.threads {
            for r in t.join().unwrap() {
                if r.is_answered() {
                    ok += 1;
                } else {
                    failed.push(r);
                }
            }
        }
        (ok, failed)
    }
}

/// Asserts that a loop lost nothing.
fn assert_lossless(what: &str, (ok, failed): (usize, Vec<ProbeResult>)) {
    eprintln!(
        "[cluster_helm] {what}: {ok} connections answered, {} failed",
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "{what}: {} failed: {failed:?}",
        failed.len()
    );
    assert!(ok >= 40, "{what}: only {ok} connections");
}

#[test]
fn helm_install_on_real_kubelets_serves_upgrades_and_uninstalls_without_loss() {
    let began = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("splitproxy-cluster-test-")
        .tempdir_in("/tmp")
        .unwrap();
    let oci = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let built = images::build(oci.path(), Some("localhost/splitproxy"));
    assert_eq!(built.len(), 4, "{built:?}");
    eprintln!("[cluster_helm] tools/image.sh: {:.1?}", t.elapsed());
    let prefix = format!("spct{}", std::process::id() % 10_000);
    let cluster = Cluster::start(dir.path(), &prefix, NODES).unwrap();
    eprintln!("[cluster_helm] cluster up: {:.1?}", began.elapsed());
    cluster
        .script_ok(&["images", oci.path().to_str().unwrap()])
        .unwrap();
    let fabric = Netns::existing(&cluster.fabric_netns()).unwrap();

    // 1. helm install: the brains and the actuators become Ready with the chart's probes, RBAC
    //    and identity (tokens, the brains' own TLS); no certificate made by hand.
    let t = Instant::now();
    cluster.script_ok(&["install"]).unwrap();
    eprintln!("[cluster_helm] helm install --wait: {:.1?}", t.elapsed());
    let ready = |kind: &str, path: &str| jsonpath(&cluster, &["-n", RELEASE_NS, "get", kind], path);
    assert_eq!(
        ready("deployment/splitproxy-brain", "{.status.readyReplicas}"),
        NODES.to_string()
    );
    assert_eq!(
        ready("daemonset/splitproxy-actuator", "{.status.numberReady}"),
        NODES.to_string()
    );
    // 7. helm test.
    cluster
        .helm(&["test", "splitproxy", "-n", RELEASE_NS, "--timeout", "3m"])
        .unwrap();

    // 2. Real workloads, Services created the normal way.
    let manifests = workspace_root().join("tests/cluster");
    cluster
        .apply(&std::fs::read_to_string(manifests.join("echo.yaml")).unwrap())
        .unwrap();
    let client_yaml = std::fs::read_to_string(manifests.join("client.yaml")).unwrap();
    for i in 0..NODES {
        cluster
            .apply(&client_yaml.replace("NODE", &Cluster::node_name(i)))
            .unwrap();
    }
    cluster.rollout(NS, "deployment/echo").unwrap();
    cluster
        .kubectl(&[
            "-n",
            NS,
            "wait",
            "--for=condition=Ready",
            "pod",
            "-l",
            "app=client",
            "--timeout=120s",
        ])
        .unwrap();
    let cluster_ip = jsonpath(
        &cluster,
        &["-n", NS, "get", "service/echo"],
        "{.spec.clusterIP}",
    );
    let service = format!("{cluster_ip}:80");
    let pods = echo_pods(&cluster);
    assert_eq!(pods.len(), 4, "{pods:?}");
    let client_ip = |i: usize| -> IpAddr {
        jsonpath(
            &cluster,
            &["-n", NS, "get", "pod", &client(i)],
            "{.status.podIP}",
        )
        .parse()
        .unwrap()
    };

    // From a pod on each node: ClusterIP (TCP and UDP) reaches the echo pods with the client's
    // own address; NodePort on every node answers.
    for i in 0..NODES {
        let results = cluster
            .probe_from_pod(NS, &client(i), "tcp", &service, 16, Duration::ZERO)
            .unwrap();
        let mut seen = BTreeSet::new();
        for r in &results {
            let pod = r.pod().unwrap_or_else(|| panic!("node-{i}: {r}"));
            assert!(pods.contains_key(pod), "answered by {pod}");
            assert_eq!(r.seen_source().map(|s| s.ip()), Some(client_ip(i)), "{r}");
            seen.insert(pod.to_string());
        }
        assert!(seen.len() >= 2, "node-{i}: one backend only: {seen:?}");
        let udp = cluster
            .probe_from_pod(NS, &client(i), "udp", &service, 4, Duration::ZERO)
            .unwrap();
        assert!(udp.iter().all(ProbeResult::is_answered), "{udp:?}");
        for j in 0..NODES {
            let dst = format!("{}:30080", Cluster::node_ip(j));
            let np = cluster
                .probe_from_pod(NS, &client(i), "tcp", &dst, 4, Duration::ZERO)
                .unwrap();
            assert!(np.iter().all(ProbeResult::is_answered), "{dst}: {np:?}");
        }
    }
    // externalTrafficPolicy: Local, from outside every node: a local endpoint answers and sees
    // the client's own address.
    let external = |node: usize, count: usize| -> Vec<ProbeResult> {
        let dst = SocketAddr::from((Cluster::node_ip(node), 30081));
        (0..count)
            .map(|_| probe::probe(&fabric, Proto::Tcp, dst, None, Duration::from_secs(1)))
            .collect()
    };
    for j in 0..NODES {
        for r in external(j, 6) {
            let pod = r.pod().unwrap_or_else(|| panic!("node-{j} :30081: {r}"));
            assert_eq!(pods[pod].1, Cluster::node_name(j), "{r}");
            assert_eq!(
                r.seen_source().map(|s| s.ip()),
                Some(IpAddr::from(API_IP)),
                "{r}"
            );
        }
    }
    eprintln!("[cluster_helm] traffic checked: {:.1?}", began.elapsed());

    // 3. Scaling: traffic follows, and the actuators measure network programming latency from
    //    the EndpointSlice trigger time to their apply.
    let before: Vec<_> = (0..NODES).map(|i| npl(&fabric, i)).collect();
    let follows = |want: &BTreeSet<String>| {
        wait_until(Duration::from_secs(60), Duration::from_millis(500), || {
            (0..NODES).all(|i| {
                cluster
                    .probe_from_pod(NS, &client(i), "tcp", &service, 12, Duration::ZERO)
                    .is_ok_and(|rs| {
                        let got: BTreeSet<String> = rs
                            .iter()
                            .filter_map(|r| r.pod().map(String::from))
                            .collect();
                        rs.iter().all(ProbeResult::is_answered) && got.is_subset(want)
                    })
            })
        })
    };
    cluster
        .kubectl(&["-n", NS, "scale", "deployment/echo", "--replicas=1"])
        .unwrap();
    wait_until(Duration::from_secs(60), Duration::from_millis(250), || {
        list_echo_pods(&cluster).len() == 1 && ready_echo_pods(&cluster).len() == 1
    })
    .expect("scaled down to one pod");
    let one = ready_echo_pods(&cluster);
    follows(&one).expect("traffic follows the scale-down");
    // The node without the remaining pod drops externalTrafficPolicy: Local traffic.
    let survivor_node = echo_pods(&cluster).values().next().unwrap().1.clone();
    let empty_node = (0..NODES)
        .find(|&i| Cluster::node_name(i) != survivor_node)
        .unwrap();
    for r in external(empty_node, 2) {
        assert!(
            r.is_dropped(),
            "node-{empty_node} has no local endpoint: {r}"
        );
    }
    cluster
        .kubectl(&["-n", NS, "scale", "deployment/echo", "--replicas=4"])
        .unwrap();
    cluster.rollout(NS, "deployment/echo").unwrap();
    let four = ready_echo_pods(&cluster);
    assert_eq!(four.len(), 4);
    wait_until(Duration::from_secs(60), Duration::from_millis(500), || {
        let mut seen = BTreeSet::new();
        for i in 0..NODES {
            if let Ok(rs) =
                cluster.probe_from_pod(NS, &client(i), "tcp", &service, 24, Duration::ZERO)
            {
                seen.extend(rs.iter().filter_map(|r| r.pod().map(String::from)));
            }
        }
        seen == four
    })
    .expect("traffic reaches all four pods again");
    for (i, (count0, sum0)) in before.iter().enumerate() {
        let (count, sum) = npl(&fabric, i);
        let n = count - count0;
        assert!(n >= 2.0, "node-{i}: {n} latencies measured");
        let mean = (sum - sum0) / n;
        eprintln!(
            "[cluster_helm] node-{i}: network programming latency over {n} changes: mean {:.0} ms",
            mean * 1000.0
        );
        assert!(
            mean < 5.0,
            "node-{i}: mean network programming latency {mean} s"
        );
    }

    // 4. helm upgrade to a new image tag rolls brains and actuators under a connection loop: no
    //    connection fails and no node's table is ever flushed.
    let handles: Vec<_> = (0..NODES).map(|i| table_handle(&cluster, i)).collect();
    assert!(handles.iter().all(Option::is_some), "{handles:?}");
    let clients: Vec<String> = (0..NODES).map(client).collect();
    let actuator_pods = || {
        jsonpath(
            &cluster,
            &[
                "-n",
                RELEASE_NS,
                "get",
                "pods",
                "-l",
                "app.kubernetes.io/component=actuator",
            ],
            "{.items[*].metadata.uid}",
        )
    };
    let actuators_before = actuator_pods();
    cluster.script_ok(&["tag", "0.1.0-upgrade"]).unwrap();
    let lp = ConnectionLoop::start(
        dir.path().to_path_buf(),
        &prefix,
        clients.clone(),
        service.clone(),
    );
    std::thread::sleep(Duration::from_secs(2));
    let t = Instant::now();
    cluster
        .script_ok(&[
            "install",
            "--set",
            "image.brain.tag=0.1.0-upgrade",
            "--set",
            "image.actuator.tag=0.1.0-upgrade",
        ])
        .unwrap();
    eprintln!("[cluster_helm] helm upgrade --wait: {:.1?}", t.elapsed());
    std::thread::sleep(Duration::from_secs(2));
    assert_lossless("helm upgrade", lp.finish());
    assert_ne!(
        actuator_pods(),
        actuators_before,
        "the actuators were not replaced"
    );
    let images = jsonpath(
        &cluster,
        &["-n", RELEASE_NS, "get", "pods"],
        "{.items[*].spec.containers[*].image}",
    );
    assert!(
        images
            .split_whitespace()
            .all(|i| i.ends_with(":0.1.0-upgrade")),
        "{images}"
    );
    let after: Vec<_> = (0..NODES).map(|i| table_handle(&cluster, i)).collect();
    assert_eq!(after, handles, "a node's table was deleted and made again");

    // 5. A brain pod killed, then a node drained: the same loop loses nothing.
    let lp = ConnectionLoop::start(
        dir.path().to_path_buf(),
        &prefix,
        clients.clone(),
        service.clone(),
    );
    let brain = jsonpath(
        &cluster,
        &[
            "-n",
            RELEASE_NS,
            "get",
            "pods",
            "-l",
            "app.kubernetes.io/component=brain",
        ],
        "{.items[0].metadata.name}",
    );
    cluster
        .kubectl(&[
            "-n",
            RELEASE_NS,
            "delete",
            "pod",
            &brain,
            "--grace-period=0",
            "--force",
        ])
        .unwrap();
    cluster
        .rollout(RELEASE_NS, "deployment/splitproxy-brain")
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert_lossless("brain pod killed", lp.finish());

    let drained = NODES - 1;
    let lp = ConnectionLoop::start(
        dir.path().to_path_buf(),
        &prefix,
        vec![client(0)],
        service.clone(),
    );
    std::thread::sleep(Duration::from_secs(2));
    cluster
        .kubectl(&[
            "drain",
            &Cluster::node_name(drained),
            "--ignore-daemonsets",
            "--force",
            "--delete-emptydir-data",
            "--timeout=120s",
        ])
        .unwrap();
    cluster.rollout(NS, "deployment/echo").unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert_lossless("node drained", lp.finish());
    assert!(
        echo_pods(&cluster)
            .values()
            .all(|(_, node)| *node != Cluster::node_name(drained))
    );
    cluster
        .kubectl(&["uncordon", &Cluster::node_name(drained)])
        .unwrap();
    assert_eq!(
        (0..NODES)
            .map(|i| table_handle(&cluster, i))
            .collect::<Vec<_>>(),
        handles,
        "a node's table was deleted and made again"
    );

    // 6. helm uninstall leaves each node's tables as they were (the actuator cannot tell an
    //    uninstall from a restart, and a node must never be left without its Services by a
    //    restart); the documented clean-up removes them.
    cluster
        .helm(&[
            "uninstall",
            "splitproxy",
            "-n",
            RELEASE_NS,
            "--wait",
            "--timeout",
            "2m",
        ])
        .unwrap();
    for i in 0..NODES {
        assert!(table_handle(&cluster, i).is_some(), "node-{i}");
    }
    cluster.script_ok(&["cleanup"]).unwrap();
    for i in 0..NODES {
        let tables = cluster
            .in_netns(&cluster.node_netns(i), &["nft", "list", "tables"])
            .unwrap();
        assert!(!tables.contains("splitproxy"), "node-{i}: {tables}");
    }
    drop(fabric);
    cluster.stop().unwrap();
    eprintln!("[cluster_helm] total {:.1?}", began.elapsed());
}
