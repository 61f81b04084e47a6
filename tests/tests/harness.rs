//! Tests of the harness itself: each building block does what end-to-end tests rely on.
//!
//! Every test creates its own namespaces (unique names) and uses only ephemeral ports, so the
//! tests run in parallel with each other and with other test binaries.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::Api;
use kube::api::PostParams;
use splitproxy_tests::certs::Pki;
use splitproxy_tests::controlplane::client_from_file;
use splitproxy_tests::process::Child;
use splitproxy_tests::{
    Cluster, ClusterSpec, ControlPlane, ControlPlaneOptions, Netns, PodServer, ProbeResult, Proto,
    forward_port, netns, probe, probe_async, tools,
};

const TIMEOUT: Duration = Duration::from_secs(3);

fn addr(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

fn assert_answered(result: &ProbeResult, pod: &str, source: IpAddr) {
    assert_eq!(
        result.pod(),
        Some(pod),
        "expected {pod} to answer, got: {result}"
    );
    assert_eq!(
        result.seen_source().map(|s| s.ip()),
        Some(source),
        "expected {pod} to see source {source}, got: {result}"
    );
}

#[test]
fn tools_finds_pinned_binaries() {
    for name in ["etcd", "kube-apiserver"] {
        let path = tools::binary(name).expect(name);
        assert!(path.is_file(), "{} is not a file", path.display());
        let out = Command::new(&path).arg("--version").output().unwrap();
        assert!(out.status.success(), "{name} --version failed: {out:?}");
    }
    let out = Command::new(tools::binary("kube-apiserver").unwrap())
        .arg("--version")
        .output()
        .unwrap();
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(version.contains("v1.37.2"), "unexpected version {version}");
    assert!(tools::binary("../etcd").is_err());
}

#[test]
fn tools_links_a_built_binary_into_an_empty_cache() {
    // A cache that holds etcd's versioned build but no bin/ link: binary_in() must run
    // build-tools.sh, which links the existing build instead of compiling.
    let real = std::fs::canonicalize(tools::binary("etcd").unwrap()).unwrap();
    let version_dir = real.parent().unwrap().file_name().unwrap();
    let cache = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(cache.path().join(version_dir)).unwrap();
    std::os::unix::fs::symlink(&real, cache.path().join(version_dir).join("etcd")).unwrap();
    let found = tools::binary_in(cache.path(), "etcd").unwrap();
    assert_eq!(found, cache.path().join("bin/etcd"));
    assert_eq!(std::fs::canonicalize(&found).unwrap(), real);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_serves_namespaces_and_services() {
    let mut cp = ControlPlane::start(ControlPlaneOptions {
        service_cluster_ip_range: "10.100.0.0/16".into(),
        ..Default::default()
    })
    .await
    .expect("control plane starts");
    assert!(cp.url().starts_with("https://127.0.0.1:"));

    let client = cp.client();
    let namespace: Namespace = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "harness"}
    }))
    .unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("namespace created");

    let service: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "harness"},
        "spec": {
            "selector": {"app": "web"},
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
        }
    }))
    .unwrap();
    let services = Api::<Service>::namespaced(client.clone(), "harness");
    let created = services
        .create(&PostParams::default(), &service)
        .await
        .expect("service created");
    let cluster_ip: Ipv4Addr = created
        .spec
        .as_ref()
        .and_then(|s| s.cluster_ip.as_deref())
        .expect("cluster IP allocated")
        .parse()
        .unwrap();
    let range: ipnet::Ipv4Net = "10.100.0.0/16".parse().unwrap();
    assert!(range.contains(&cluster_ip), "{cluster_ip} not in {range}");

    // The kubeconfig file on disk works for a client built from scratch.
    let from_file = client_from_file(cp.kubeconfig_path()).await.unwrap();
    let fetched = Api::<Service>::namespaced(from_file, "harness")
        .get("web")
        .await
        .expect("service readable through the kubeconfig file");
    assert_eq!(fetched.metadata.uid, created.metadata.uid);

    // Client certificates from the control plane's CA authenticate; RBAC applies to groups.
    let admin = client_from_file(
        &cp.kubeconfig_for_user("cert-admin", &["system:masters"])
            .unwrap(),
    )
    .await
    .unwrap();
    Api::<Service>::namespaced(admin, "harness")
        .get("web")
        .await
        .expect("client certificate in system:masters may read services");
    let nobody = client_from_file(&cp.kubeconfig_for_user("nobody", &[]).unwrap())
        .await
        .unwrap();
    match Api::<Service>::namespaced(nobody, "harness")
        .get("web")
        .await
    {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 403, "{status:?}"),
        other => panic!("expected 403 for a user without roles, got {other:?}"),
    }

    // The API server can be restarted; state lives in etcd.
    cp.stop_apiserver().unwrap();
    let down = tokio::time::timeout(Duration::from_secs(20), services.get("web")).await;
    assert!(
        !matches!(down, Ok(Ok(_))),
        "API server still answers after stop"
    );
    cp.start_apiserver().await.expect("API server restarts");
    let again = Api::<Service>::namespaced(cp.new_client().unwrap(), "harness")
        .get("web")
        .await
        .expect("service survives an API server restart");
    assert_eq!(again.metadata.uid, created.metadata.uid);

    let dir = cp.dir().to_path_buf();
    drop(cp);
    if std::env::var_os("SPLITPROXY_KEEP_LOGS").is_none() {
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
}

#[test]
fn pods_reach_each_other_directly() {
    let cluster = Cluster::new(ClusterSpec::new(2)).unwrap();
    let a = cluster.add_pod(0, "pod-a").unwrap();
    let b = cluster.add_pod(1, "pod-b").unwrap();
    let c = cluster.add_pod(0, "pod-c").unwrap();
    assert!(cluster.node(0).pod_cidrs_contain(a.ip()));
    assert!(cluster.node(1).pod_cidrs_contain(b.ip()));
    assert_ne!(a.ip(), c.ip());

    let _server_b = PodServer::start(&b, "pod-b", &[8080], &[5353]).unwrap();
    let _server_c = PodServer::start(&c, "pod-c", &[8080], &[5353]).unwrap();

    for (target, port, proto) in [
        (&b, 8080, Proto::Tcp),
        (&b, 5353, Proto::Udp),
        (&c, 8080, Proto::Tcp),
        (&c, 5353, Proto::Udp),
    ] {
        let result = probe(a.netns(), proto, addr(target.ip(), port), None, TIMEOUT);
        assert_answered(&result, target.name(), a.ip());
    }

    // An explicit source address is used as given.
    let result = probe(
        a.netns(),
        Proto::Tcp,
        addr(b.ip(), 8080),
        Some(a.ip()),
        TIMEOUT,
    );
    assert_answered(&result, "pod-b", a.ip());

    // A node reaches a pod on another node with its node IP.
    let node0 = cluster.node(0);
    let result = probe(node0.netns(), Proto::Udp, addr(b.ip(), 5353), None, TIMEOUT);
    assert_answered(&result, "pod-b", node0.ip().into());
}

#[tokio::test]
async fn probe_async_does_not_block_the_runtime() {
    // A single-threaded runtime: the pod server must not depend on it.
    let cluster = Cluster::new(ClusterSpec::new(1)).unwrap();
    let a = cluster.add_pod(0, "a").unwrap();
    let b = cluster.add_pod(0, "b").unwrap();
    let _server = PodServer::start(&b, "b", &[80], &[80]).unwrap();
    let (tcp, udp) = tokio::join!(
        probe_async(a.netns(), Proto::Tcp, addr(b.ip(), 80), None, TIMEOUT),
        probe_async(a.netns(), Proto::Udp, addr(b.ip(), 80), None, TIMEOUT),
    );
    assert_answered(&tcp, "b", a.ip());
    assert_answered(&udp, "b", a.ip());
}

#[test]
fn external_client_reaches_pods_through_a_node() {
    let cluster = Cluster::new(ClusterSpec::new(2)).unwrap();
    let pod0 = cluster.add_pod(0, "web-0").unwrap();
    let pod1 = cluster.add_pod(1, "web-1").unwrap();
    let _s0 = PodServer::start(&pod0, "web-0", &[80], &[53]).unwrap();
    let _s1 = PodServer::start(&pod1, "web-1", &[80], &[53]).unwrap();
    let client = cluster
        .add_external_client("client", Ipv4Addr::new(192, 168, 77, 200))
        .unwrap();
    assert_eq!(client.via(), cluster.node(0).ip());

    for pod in [&pod0, &pod1] {
        for (proto, port) in [(Proto::Tcp, 80), (Proto::Udp, 53)] {
            let result = probe(client.netns(), proto, addr(pod.ip(), port), None, TIMEOUT);
            assert_answered(&result, pod.name(), client.ip());
        }
    }

    // Node IPs on the fabric are reachable too (NodePort tests target them).
    let result = probe(
        client.netns(),
        Proto::Tcp,
        addr(cluster.node(1).ip(), 1),
        None,
        TIMEOUT,
    );
    assert_eq!(result, ProbeResult::Refused, "{result}");
}

#[test]
fn probe_to_closed_port_is_refused() {
    let cluster = Cluster::new(ClusterSpec::new(2)).unwrap();
    let a = cluster.add_pod(0, "a").unwrap();
    let b = cluster.add_pod(1, "b").unwrap();
    let _server = PodServer::start(&b, "b", &[80], &[80]).unwrap();
    for proto in [Proto::Tcp, Proto::Udp] {
        let result = probe(a.netns(), proto, addr(b.ip(), 81), None, TIMEOUT);
        assert_eq!(result, ProbeResult::Refused, "{proto}: {result}");
    }
}

#[test]
fn probe_to_unrouted_address_times_out_or_is_unreachable() {
    // Inside the cluster the packet leaves through the fabric, which does not forward.
    let cluster = Cluster::new(ClusterSpec::new(1)).unwrap();
    let a = cluster.add_pod(0, "a").unwrap();
    let short = Duration::from_millis(600);
    for proto in [Proto::Tcp, Proto::Udp] {
        let started = Instant::now();
        let result = probe(a.netns(), proto, addr([10, 250, 0, 1], 80), None, short);
        assert!(
            matches!(result, ProbeResult::TimedOut | ProbeResult::Unreachable(_)),
            "{proto}: {result}"
        );
        assert!(started.elapsed() < short + Duration::from_secs(2));
    }

    // A namespace with only loopback has no route at all: the kernel says so at once.
    let bare = Netns::create("bare").unwrap();
    for proto in [Proto::Tcp, Proto::Udp] {
        let result = probe(&bare, proto, addr([10, 250, 0, 1], 80), None, TIMEOUT);
        assert!(
            matches!(result, ProbeResult::Unreachable(_)),
            "{proto}: {result}"
        );
    }
    // Serialisation for reports.
    let json = serde_json::to_value(&ProbeResult::TimedOut).unwrap();
    assert_eq!(json["result"], "dropped");
}

#[test]
fn port_forwarder_reaches_host_loopback_from_a_namespace() {
    // A line-echo server on host loopback, bounded to a few connections.
    let host = TcpListener::bind("127.0.0.1:0").unwrap();
    let host_addr = host.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let Ok((stream, _)) = host.accept() else {
                return;
            };
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut line = String::new();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            if reader.read_line(&mut line).is_ok() {
                let _ = (&stream).write_all(format!("host:{line}").as_bytes());
            }
        }
    });

    let ns = Netns::create("fwd").unwrap();
    // The host listener is not visible from inside the namespace...
    let direct = ns
        .run(move || TcpStream::connect_timeout(&host_addr, Duration::from_secs(1)))
        .unwrap();
    assert!(direct.is_err(), "namespace reached host loopback directly");

    // ...but the forwarder on the namespace's own loopback is.
    let forwarder = forward_port(&ns, addr([127, 0, 0, 1], 0), host_addr).unwrap();
    let listen = forwarder.local_addr();
    assert_ne!(listen.port(), 0);
    let exchange = |message: &'static str| {
        ns.run(move || -> std::io::Result<String> {
            let mut stream = TcpStream::connect_timeout(&listen, TIMEOUT)?;
            stream.set_read_timeout(Some(TIMEOUT))?;
            stream.write_all(message.as_bytes())?;
            let mut line = String::new();
            BufReader::new(stream).read_line(&mut line)?;
            Ok(line)
        })
        .unwrap()
        .unwrap()
    };
    assert_eq!(exchange("one\n"), "host:one\n");
    assert_eq!(exchange("two\n"), "host:two\n");
    server.join().unwrap();

    drop(forwarder);
    let after = ns
        .run(move || TcpStream::connect_timeout(&listen, Duration::from_secs(1)))
        .unwrap();
    assert!(after.is_err(), "forwarder still listening after drop");
}

#[test]
fn netns_run_and_spawn_stay_inside_the_namespace() {
    let ns = Netns::create("inside").unwrap();
    assert!(ns.path().starts_with("/run/netns"));
    assert!(ns.name().starts_with(netns::PREFIX));

    // The closure's thread sees only the namespace's interfaces.
    let devices = ns
        .run(|| std::fs::read_to_string("/proc/thread-self/net/dev"))
        .unwrap()
        .unwrap();
    let names: Vec<&str> = devices
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(names, ["lo"], "{devices}");
    let links = ns.exec_ok(&["ip", "-o", "link"]).unwrap();
    assert_eq!(links.lines().count(), 1, "{links}");
    assert!(links.contains("lo:") && links.contains("UP"), "{links}");

    // A spawned process lives in the namespace and is stopped by its guard.
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = Command::new("sleep");
    cmd.arg("60");
    let child = ns.spawn("sleep", cmd, log.path()).unwrap();
    let pid = child.id().unwrap();
    let child_ns = std::fs::metadata(format!("/proc/{pid}/ns/net")).unwrap();
    let ns_file = std::fs::metadata(ns.path()).unwrap();
    assert_eq!(
        (child_ns.dev(), child_ns.ino()),
        (ns_file.dev(), ns_file.ino())
    );
    drop(child);
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());

    // Only net.* sysctls, and only in the namespace.
    ns.sysctl("net.ipv4.ip_forward", "1").unwrap();
    let inside = ns
        .run(|| std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward"))
        .unwrap()
        .unwrap();
    assert_eq!(inside.trim(), "1");
    assert!(ns.sysctl("kernel.hostname", "x").is_err());
}

#[test]
fn child_guard_escalates_to_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stubborn.log");
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "trap '' TERM; echo ready; sleep 60"]);
    let mut child = Child::spawn("stubborn", cmd, &log).unwrap();
    child.set_grace(Duration::from_millis(300));
    let pid = child.id().unwrap();
    splitproxy_tests::process::wait_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        || child.log_tail(5).contains("ready"),
    )
    .unwrap();
    let started = Instant::now();
    let status = child.stop().unwrap().expect("exit status");
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(!status.success());
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
}

#[test]
fn certificates_verify_against_their_ca() {
    let pki = Pki::new("harness-ca").unwrap();
    let server = pki
        .server_cert(&["127.0.0.1", "brain.splitproxy.test"])
        .unwrap();
    let client = pki.client_cert("node-0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let server_files = pki.write(dir.path(), "server", &server).unwrap();
    let client_files = pki.write(dir.path(), "node-0", &client).unwrap();
    assert!(server_files.key.exists() && client_files.key.exists());

    let openssl = |args: &[&str]| {
        let out = Command::new("openssl").args(args).output().unwrap();
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let ca = server_files.ca.to_str().unwrap();
    openssl(&[
        "verify",
        "-CAfile",
        ca,
        "-purpose",
        "sslserver",
        server_files.cert.to_str().unwrap(),
    ]);
    openssl(&[
        "verify",
        "-CAfile",
        ca,
        "-purpose",
        "sslclient",
        client_files.cert.to_str().unwrap(),
    ]);
    let server_text = openssl(&[
        "x509",
        "-noout",
        "-text",
        "-in",
        server_files.cert.to_str().unwrap(),
    ]);
    assert!(
        server_text.contains("IP Address:127.0.0.1"),
        "{server_text}"
    );
    assert!(
        server_text.contains("DNS:brain.splitproxy.test"),
        "{server_text}"
    );
    let client_text = openssl(&[
        "x509",
        "-noout",
        "-text",
        "-in",
        client_files.cert.to_str().unwrap(),
    ]);
    assert!(
        client_text.contains("CN=node-0") || client_text.contains("CN = node-0"),
        "{client_text}"
    );
    assert!(client_text.contains("DNS:node-0"), "{client_text}");
    assert!(
        client_text.contains("TLS Web Client Authentication"),
        "{client_text}"
    );
    openssl(&["pkey", "-noout", "-in", client_files.key.to_str().unwrap()]);
}

#[test]
fn dropping_a_cluster_removes_every_namespace() {
    let names = {
        let cluster = Cluster::new(ClusterSpec::new(3)).unwrap();
        let pod = cluster.add_pod(2, "p").unwrap();
        cluster
            .add_pod_with_ip(1, "q", Ipv4Addr::new(10, 244, 1, 77))
            .unwrap();
        cluster
            .add_external_client("ext", Ipv4Addr::new(192, 168, 77, 201))
            .unwrap();
        assert!(
            cluster
                .add_pod_with_ip(0, "r", Ipv4Addr::new(10, 244, 1, 77))
                .is_err()
        );
        assert!(cluster.add_pod(0, "p").is_err());
        let names = cluster.namespace_names();
        assert_eq!(names.len(), 1 + 3 + 2 + 1);
        let listed = netns::list().unwrap();
        for name in &names {
            assert!(listed.contains(name), "{name} missing from {listed:?}");
        }
        // Every interface lives in a harness namespace.
        let node_links = cluster
            .node(2)
            .netns()
            .exec_ok(&["ip", "-o", "link"])
            .unwrap();
        assert!(node_links.contains(pod.node_veth()), "{node_links}");
        names
    };
    let listed = netns::list().unwrap();
    for name in &names {
        assert!(!listed.contains(name), "{name} left behind");
    }

    // Also when a test panics while holding namespaces.
    let created = Arc::new(Mutex::new(Vec::new()));
    let record = created.clone();
    let panicked = std::panic::catch_unwind(move || {
        let cluster = Cluster::new(ClusterSpec::new(1)).unwrap();
        let _pod = cluster.add_pod(0, "doomed").unwrap();
        record.lock().unwrap().extend(cluster.namespace_names());
        panic!("test failure while the cluster is alive");
    });
    assert!(panicked.is_err());
    let created = created.lock().unwrap().clone();
    assert_eq!(created.len(), 3);
    let listed = netns::list().unwrap();
    for name in &created {
        assert!(!listed.contains(name), "{name} left behind after a panic");
    }
}

#[test]
fn stale_namespaces_of_dead_processes_are_swept() {
    // A pid that has certainly exited (and been reaped) stands for a killed test process.
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let stale = format!("{}stale-{dead_pid}x0", netns::PREFIX);
    let status = Command::new("ip")
        .args(["netns", "add", &stale])
        .status()
        .unwrap();
    assert!(status.success());
    // A live namespace of this process must survive the sweep.
    let live = Netns::create("live").unwrap();

    netns::cleanup_stale();
    let listed = netns::list().unwrap();
    if listed.contains(&stale) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &stale])
            .status();
        panic!("stale namespace {stale} survived the sweep");
    }
    assert!(listed.iter().any(|n| n == live.name()));
}

#[test]
fn building_a_cluster_leaves_host_interfaces_alone() {
    let host_links = || {
        let out = Command::new("ip").args(["-o", "link"]).output().unwrap();
        let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split(':').nth(1))
            .map(|n| n.trim().to_string())
            .collect();
        names.sort();
        names
    };
    let before = host_links();
    let cluster = Cluster::new(ClusterSpec::new(2)).unwrap();
    cluster.add_pod(0, "a").unwrap();
    cluster
        .add_external_client("c", Ipv4Addr::new(192, 168, 77, 250))
        .unwrap();
    assert_eq!(
        host_links(),
        before,
        "the host namespace gained or lost interfaces"
    );
}

fn port_addr(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

/// Asserts an answer from `pod` at `endpoint` that saw `source` (ports of the source ignored).
fn assert_endpoint(result: &ProbeResult, pod: &str, endpoint: SocketAddr, source: IpAddr) {
    assert_answered(result, pod, source);
    assert_eq!(result.endpoint(), Some(endpoint), "{result}");
    assert_eq!(
        result.client().map(|c| c.ip()),
        Some(source),
        "the probe reports its own address: {result}"
    );
}

#[test]
fn dual_stack_pods_nodes_and_clients_reach_each_other() {
    use splitproxy_tests::topology::POD_INTERFACE_PREFIX;
    let cluster = Cluster::new(ClusterSpec::new(2)).unwrap();
    let a = cluster.add_pod(0, "a").unwrap();
    let b = cluster.add_pod(1, "b").unwrap();
    let (a4, a6) = (a.ip4().unwrap(), a.ip6().unwrap());
    let (b4, b6) = (b.ip4().unwrap(), b.ip6().unwrap());
    assert_eq!(
        Some(a6),
        splitproxy_tests::topology::twin6(a4),
        "IPv6 twins the IPv4 address"
    );
    assert!(cluster.node(0).pod_cidr6().contains(&a6));
    assert!(cluster.node(1).pod_cidr6().contains(&b6));
    let cluster6: ipnet::Ipv6Net = splitproxy_tests::topology::CLUSTER_CIDR6.parse().unwrap();
    assert!(cluster6.contains(&b6));
    assert!(a.node_veth().starts_with(POD_INTERFACE_PREFIX) && a.node_veth().len() <= 15);

    let _server = PodServer::start(&b, "b", &[8080], &[5353]).unwrap();
    for (dst, src) in [(IpAddr::V4(b4), IpAddr::V4(a4)), (b6.into(), a6.into())] {
        for (proto, port) in [(Proto::Tcp, 8080), (Proto::Udp, 5353)] {
            let result = probe(a.netns(), proto, port_addr(dst, port), None, TIMEOUT);
            assert_endpoint(&result, "b", port_addr(dst, port), src);
            assert_eq!(result.source_preserved(), Some(true));
        }
    }

    // A fixed source port, twice in a row (conntrack tests reuse a 5-tuple), both protocols.
    for (proto, port) in [(Proto::Udp, 5353), (Proto::Tcp, 8080)] {
        for _ in 0..2 {
            let bind = port_addr(a6.into(), 40123);
            let dst = port_addr(b6.into(), port);
            let result = splitproxy_tests::probe::probe_bound(a.netns(), proto, dst, bind, TIMEOUT);
            assert_eq!(result.source(), Some(bind), "{proto}: {result}");
        }
    }

    // Nodes reach pods of other nodes over both families, with their fabric addresses.
    let node0 = cluster.node(0);
    let result = probe(
        node0.netns(),
        Proto::Tcp,
        port_addr(b6.into(), 8080),
        None,
        TIMEOUT,
    );
    assert_endpoint(&result, "b", port_addr(b6.into(), 8080), node0.ip6().into());
    let result = probe(
        node0.netns(),
        Proto::Udp,
        port_addr(b4.into(), 5353),
        None,
        TIMEOUT,
    );
    assert_endpoint(&result, "b", port_addr(b4.into(), 5353), node0.ip().into());

    // External clients have a twin IPv6 address and reach pods through their node.
    let client = cluster
        .add_external_client("ext", Ipv4Addr::new(192, 168, 77, 200))
        .unwrap();
    let ext6 = client.ip6().expect("twin IPv6 address");
    assert_eq!(ext6, "fd00:77::200".parse::<std::net::Ipv6Addr>().unwrap());
    let result = probe(
        client.netns(),
        Proto::Tcp,
        port_addr(b6.into(), 8080),
        None,
        TIMEOUT,
    );
    assert_endpoint(&result, "b", port_addr(b6.into(), 8080), ext6.into());
    let result = probe(
        client.netns(),
        Proto::Udp,
        port_addr(b4.into(), 5353),
        Some(client.ip()),
        TIMEOUT,
    );
    assert_endpoint(&result, "b", port_addr(b4.into(), 5353), client.ip());

    // Node IPv6 addresses are on the fabric: a closed port is refused at once.
    let result = probe(
        client.netns(),
        Proto::Tcp,
        port_addr(cluster.node(1).ip6().into(), 1),
        None,
        TIMEOUT,
    );
    assert_eq!(result, ProbeResult::Refused, "{result}");

    // A single-stack IPv6 pod, and a second address added to a pod later.
    let v6only = cluster
        .add_pod_with_ip(0, "v6only", "fd00:244::77".parse::<IpAddr>().unwrap())
        .unwrap();
    assert_eq!(v6only.ip4(), None);
    let _s = PodServer::start(&v6only, "v6only", &[80], &[]).unwrap();
    let dst = port_addr("fd00:244::77".parse().unwrap(), 80);
    assert_endpoint(
        &probe(b.netns(), Proto::Tcp, dst, None, TIMEOUT),
        "v6only",
        dst,
        b6.into(),
    );
    cluster
        .add_pod_address("v6only", "10.244.0.77".parse().unwrap())
        .unwrap();
    let dst4 = port_addr("10.244.0.77".parse().unwrap(), 80);
    assert_endpoint(
        &probe(b.netns(), Proto::Tcp, dst4, None, TIMEOUT),
        "v6only",
        dst4,
        b4.into(),
    );
    assert!(
        cluster
            .add_pod_address("v6only", "10.244.0.78".parse().unwrap())
            .is_err(),
        "one address per family"
    );
}

#[test]
fn bridged_pods_are_routed_by_their_node() {
    use splitproxy_tests::topology::POD_BRIDGE;
    let cluster =
        Cluster::new(ClusterSpec::new(2).pod_network(splitproxy_tests::PodNetwork::Bridge))
            .unwrap();
    let a = cluster.add_pod(0, "a").unwrap();
    let c = cluster.add_pod(0, "c").unwrap();
    let b = cluster.add_pod(1, "b").unwrap();
    let links = cluster
        .node(0)
        .netns()
        .exec_ok(&["ip", "-o", "link", "show", "master", POD_BRIDGE])
        .unwrap();
    assert!(
        links.contains(a.node_veth()) && links.contains(c.node_veth()),
        "{links}"
    );
    let _sb = PodServer::start(&b, "b", &[80], &[53]).unwrap();
    let _sc = PodServer::start(&c, "c", &[80], &[53]).unwrap();
    for (target, name) in [(&b, "b"), (&c, "c")] {
        for dst in target.ips() {
            let src = a.ip_like(dst).unwrap();
            for (proto, port) in [(Proto::Tcp, 80), (Proto::Udp, 53)] {
                let result = probe(a.netns(), proto, port_addr(dst, port), None, TIMEOUT);
                assert_endpoint(&result, name, port_addr(dst, port), src);
            }
        }
    }
}

#[test]
fn extra_node_addresses_and_off_cidr_pods_are_reachable() {
    let cluster = Cluster::new(ClusterSpec::new(2)).unwrap();
    // On the fabric, and routed to the node.
    cluster
        .add_node_address(1, "192.168.77.61/32".parse().unwrap())
        .unwrap();
    cluster
        .add_node_address(1, "10.0.5.10/32".parse().unwrap())
        .unwrap();
    cluster
        .add_node_address(1, "fd00:77::61/128".parse().unwrap())
        .unwrap();
    let node1 = cluster.node(1);
    assert_eq!(node1.ips().len(), 5);
    let client = cluster
        .add_external_client("ext", Ipv4Addr::new(192, 168, 77, 200))
        .unwrap();
    // A server in the node's own namespace (a host-network endpoint) answers UDP from the
    // address each datagram was sent to.
    let _host = PodServer::start(node1, "host", &[9000], &[9000]).unwrap();
    for ip in ["192.168.77.61", "10.0.5.10", "fd00:77::61", "192.168.77.11"] {
        let dst = port_addr(ip.parse().unwrap(), 9000);
        for proto in [Proto::Tcp, Proto::Udp] {
            let result = probe(client.netns(), proto, dst, None, TIMEOUT);
            assert_endpoint(&result, "host", dst, client.ip_like(dst.ip()).unwrap());
        }
    }

    // A pod whose address lies outside its node's pod CIDRs is routed to it by the others.
    let odd = cluster
        .add_pod_with_ips(1, "odd", &["10.250.0.5".parse().unwrap()])
        .unwrap();
    let _s = PodServer::start(&odd, "odd", &[80], &[]).unwrap();
    let a = cluster.add_pod(0, "a").unwrap();
    let dst = port_addr(odd.ip(), 80);
    assert_endpoint(
        &probe(a.netns(), Proto::Tcp, dst, None, TIMEOUT),
        "odd",
        dst,
        a.ip(),
    );
    assert_eq!(cluster.pod_by_ip(odd.ip()).unwrap().name(), "odd");
    assert_eq!(
        cluster
            .node_by_ip("10.0.5.10".parse().unwrap())
            .unwrap()
            .index(),
        1
    );
}

#[test]
fn http_get_reads_status_headers_and_body() {
    let cluster = Cluster::new(ClusterSpec::new(1)).unwrap();
    let server_pod = cluster.add_pod(0, "web").unwrap();
    let client = cluster.add_pod(0, "client").unwrap();
    let listener = server_pod
        .netns()
        .run(|| TcpListener::bind("[::]:8080"))
        .unwrap()
        .unwrap();
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = [0u8; 1024];
            let n = std::io::Read::read(&mut stream, &mut request).unwrap();
            let request = String::from_utf8_lossy(&request[..n]).to_string();
            let body = format!("{{\"path\":\"{}\"}}", request.split(' ').nth(1).unwrap());
            let _ = write!(
                stream,
                "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        }
    });
    for ip in server_pod.ips() {
        let url = format!("http://{}/healthz", port_addr(ip, 8080));
        let r = splitproxy_tests::http_get(client.netns(), None, &url, TIMEOUT);
        let resp = r.response().unwrap_or_else(|| panic!("{url}: {r}"));
        assert_eq!(resp.status, 503);
        assert_eq!(resp.header("content-type"), Some("application/json"));
        assert_eq!(resp.json().unwrap()["path"], "/healthz");
    }
    server.join().unwrap();
    let r = splitproxy_tests::http_get(
        client.netns(),
        None,
        &format!("http://{}/", port_addr(server_pod.ip(), 8081)),
        TIMEOUT,
    );
    assert_eq!(r, splitproxy_tests::HttpResult::Refused);
}
