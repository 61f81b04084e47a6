//! External access end to end, checked the way an operator checks a Service by hand: real
//! packets from external clients, nodes and pods to NodePorts, LoadBalancer IPs, externalIPs and
//! ClusterIPs, asserting which endpoint answered, which source address it saw, refused versus
//! dropped, and the healthCheckNodePort's answers. kube-proxy in nftables mode is the reference.
//!
//! What probes alone can check lives in lab scenarios, replayed by `e2e_lab_scenario`:
//! `tests/lab/scenarios/external-cluster-cidr` (`--detect-local-mode ClusterCIDR`, NodePorts on
//! the primary addresses: NodePort with `externalTrafficPolicy` Cluster and Local, a NodePort
//! without endpoints, LoadBalancer IPs with `ipMode: Proxy`, `loadBalancerSourceRanges` and
//! `allocateLoadBalancerNodePorts: false`, externalIPs, masquerading and hairpin) and
//! `tests/lab/scenarios/external-interface-prefix` (`--detect-local-mode InterfaceNamePrefix`,
//! `--nodeport-addresses 10.0.5.0/24`: NodePorts only on the node addresses inside that CIDR,
//! masquerading and hairpin again). Here, what needs HTTP, the API or steps:
//!
//! - [`cluster_cidr_scenario_health_check_no_node_ports_and_source_range_change`] (the
//!   `external-cluster-cidr` lab): the healthCheckNodePort's answer on the primary address, the
//!   nodePorts the API server did not allocate, and a change of `loadBalancerSourceRanges` that
//!   keeps an established flow.
//! - [`health_check_node_port_reports_local_endpoints`] checks the healthCheckNodePort's answers
//!   as endpoints come and go and the Service goes away.
//!
//! Every check is recorded rather than asserted on the spot, so one run reports every behaviour
//! that differs; on failure the nodes' kernel rulesets, the brain's view of them and conntrack
//! tables are saved for inspection (the path is printed).
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kube::Api;
use serde_json::{Value, json};
use splitproxy_tests::deploy::DetectLocalMode;
use splitproxy_tests::lab::{ExternalSpec, Lab, LabOptions};
use splitproxy_tests::scenario::Scenario;
use splitproxy_tests::{HttpResult, ProbeResult, Proto};

/// Namespace of every object.
const NS: &str = "ext";
/// Primary (first InternalIP) addresses of the two nodes.
const N0: &str = "192.168.77.10";
const N1: &str = "192.168.77.11";
const N0_V6: &str = "fd00:77::10";
/// How long a positive expectation may take to come true (rules on their way).
const SETTLE: Duration = Duration::from_secs(10);
/// Probe timeout; a probe that gets nothing back within it counts as dropped.
const TIMEOUT: Duration = Duration::from_millis(1000);

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_splitproxy-lab")
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("test socket address")
}

// ---------------------------------------------------------------------------------------------
// Objects
// ---------------------------------------------------------------------------------------------

/// A Service port: TCP ports target 8080, UDP ports 5353.
fn port(name: &str, proto: &str, port: u16, node_port: Option<u16>) -> Value {
    let target = if proto == "UDP" { 5353 } else { 8080 };
    let mut p = json!({"name": name, "protocol": proto, "port": port, "targetPort": target});
    if let Some(np) = node_port {
        p["nodePort"] = json!(np);
    }
    p
}

/// A selectorless Service with `spec` and, for LoadBalancers, `status`.
fn service(name: &str, spec: Value, status: Option<Value>) -> Value {
    let mut v = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    });
    if let Some(s) = status {
        v["status"] = s;
    }
    v
}

/// `status.loadBalancer.ingress` with these entries.
fn ingress(entries: Value) -> Option<Value> {
    Some(json!({"loadBalancer": {"ingress": entries}}))
}

/// An IPv4 EndpointSlice of `svc` serving TCP 8080 (`http`); endpoints are (address, node,
/// pod), all ready.
fn slice(name: &str, svc: &str, eps: &[(&str, &str, &str)]) -> Value {
    let ports = vec![json!({"name": "http", "protocol": "TCP", "port": 8080})];
    let endpoints: Vec<Value> = eps
        .iter()
        .map(|(addr, node, pod)| {
            json!({
                "addresses": [addr],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": node,
                "targetRef": {"kind": "Pod", "namespace": NS, "name": pod},
            })
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS,
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": endpoints,
    })
}

/// JSON documents as one YAML stream (JSON is YAML).
fn yaml(docs: &[Value]) -> String {
    docs.iter()
        .map(Value::to_string)
        .collect::<Vec<_>>()
        .join("\n---\n")
}

fn namespace() -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
}

// ---------------------------------------------------------------------------------------------
// Expectations
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Want {
    /// Answered by one of these pods, which saw not the client's address but an address of one
    /// of the lab's nodes (a masquerade).
    Masqueraded(Vec<&'static str>),
    /// Nothing came back in time (not refused, not unreachable).
    Dropped,
}

/// Records the checks of one lab; fails the test at the end with every failure.
struct Checks<'a> {
    lab: &'a Lab,
    label: &'static str,
    section: String,
    failures: Vec<String>,
    passed: usize,
    /// Every address of every node (masquerade targets).
    node_ips: BTreeSet<IpAddr>,
}

impl<'a> Checks<'a> {
    fn new(lab: &'a Lab, label: &'static str) -> Checks<'a> {
        let node_ips = lab.cluster.nodes().iter().flat_map(|n| n.ips()).collect();
        Checks {
            lab,
            label,
            section: String::new(),
            failures: Vec::new(),
            passed: 0,
            node_ips,
        }
    }

    fn section(&mut self, name: &str) {
        eprintln!("== [{}] {name}", self.label);
        self.section = name.to_string();
    }

    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if ok {
            self.passed += 1;
        } else {
            let msg = format!("[{}] {}", self.section, what());
            eprintln!("   FAIL {msg}");
            self.failures.push(msg);
        }
    }

    /// Why `r` does not meet `want`, if it does not.
    fn judge(&self, r: &ProbeResult, want: &Want) -> Option<String> {
        match (want, r) {
            (
                Want::Masqueraded(pods),
                ProbeResult::Answered {
                    pod,
                    source,
                    client,
                    ..
                },
            ) => {
                if !pods.contains(&pod.as_str()) {
                    return Some(format!("answered by {pod}, not by one of {pods:?}"));
                }
                let ok = source.ip() != client.ip() && self.node_ips.contains(&source.ip());
                (!ok).then(|| format!("{pod} saw source {source} (client {client}), not a node's"))
            }
            (Want::Masqueraded(_), other) => Some(format!("not answered: {other}")),
            (Want::Dropped, ProbeResult::TimedOut) => None,
            (_, other) => Some(format!("got {other}")),
        }
    }

    /// Probes `from` -> `dst` until one result meets `want` (within [`SETTLE`]: rules may be on
    /// their way), then `count - 1` more, each of which must meet it too.
    async fn expect(
        &mut self,
        what: &str,
        from: &str,
        proto: Proto,
        dst: SocketAddr,
        count: usize,
        want: Want,
    ) {
        let start = Instant::now();
        let first = loop {
            let r = self.probe(from, proto, dst).await;
            let verdict = self.judge(&r, &want);
            if verdict.is_none() || start.elapsed() >= SETTLE {
                break (r, verdict);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let mut results = vec![first.0];
        let mut problems: Vec<String> = first.1.into_iter().collect();
        if count > 1 && problems.is_empty() {
            let rest = self.lab.probe_n(from, proto, dst, count - 1, TIMEOUT).await;
            problems.extend(rest.iter().filter_map(|r| self.judge(r, &want)));
            results.extend(rest);
        }
        // The brain's explanation of the packet must agree with what it did
        // (`splitproxy_tests::explain`).
        match self.lab.explainer().await {
            Ok(mut brain) => {
                let x = self
                    .lab
                    .explain_probe(&mut brain, from, proto, dst, None, &results)
                    .await;
                problems.extend(
                    x.disagreements
                        .iter()
                        .map(|d| format!("ExplainPacket: {d}")),
                );
                if x.hops.is_empty() {
                    problems.push("ExplainPacket explained nothing".into());
                }
            }
            Err(e) => problems.push(format!("no brain to explain with: {e:#}")),
        }
        let summary = summarize(&results);
        eprintln!("   {what}: {from} -> {proto} {dst}: {summary}");
        self.check(problems.is_empty(), || {
            format!(
                "{what}: {from} -> {proto} {dst}: want {want:?}: {} (results: {summary})",
                problems.join("; ")
            )
        });
    }

    async fn probe(&self, from: &str, proto: Proto, dst: SocketAddr) -> ProbeResult {
        self.lab
            .probe_n(from, proto, dst, 1, TIMEOUT)
            .await
            .pop()
            .unwrap_or_else(|| ProbeResult::Error("no probe ran".into()))
    }

    /// GETs `url` from `from` until the status is `status` (within [`SETTLE`]) and checks the
    /// answer is kube-proxy's: JSON with the Service's name and `local` endpoints, its headers.
    /// Returns how long the status took to show up.
    async fn health(
        &mut self,
        what: &str,
        from: &str,
        url: &str,
        status: u16,
        svc: &str,
        local: u32,
    ) -> Duration {
        let start = Instant::now();
        let r = loop {
            let r = self.lab.http_get(from, url, TIMEOUT).await;
            if r.status() == Some(status) || start.elapsed() >= SETTLE {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let took = start.elapsed();
        eprintln!(
            "   {what}: GET {url} from {from}: {} after {took:?}",
            r.to_json()
        );
        let Some(resp) = r.response() else {
            self.check(false, || format!("{what}: GET {url} from {from}: {r}"));
            return took;
        };
        let mut problems = Vec::new();
        if resp.status != status {
            problems.push(format!("status {}, want {status}", resp.status));
        }
        for (name, value) in [
            ("Content-Type", "application/json".to_string()),
            ("X-Content-Type-Options", "nosniff".to_string()),
            ("X-Load-Balancing-Endpoint-Weight", local.to_string()),
        ] {
            if resp.header(name) != Some(value.as_str()) {
                problems.push(format!(
                    "header {name}: {:?}, want {value:?}",
                    resp.header(name)
                ));
            }
        }
        let want_body = json!({
            "service": {"namespace": NS, "name": svc},
            "localEndpoints": local,
            "serviceProxyHealthy": true,
        });
        if resp.json().as_ref() != Some(&want_body) {
            problems.push(format!("body {:?}, want {want_body}", resp.body));
        }
        if !problems.is_empty() {
            problems.push(format!(
                "the node's kernel table holds: {}",
                self.health_maps(url)
            ));
        }
        self.check(problems.is_empty(), || {
            format!(
                "{what}: GET {url} from {from}: {}:\n{}",
                problems.join("; "),
                HttpResult::Response(resp.clone())
            )
        });
        took
    }

    /// The health check maps of the node whose address `url` names, as `nft` lists them.
    fn health_maps(&self, url: &str) -> String {
        let node = splitproxy_tests::probe::parse_http_url(url)
            .ok()
            .and_then(|(addr, _, _)| self.lab.cluster.node_by_ip(addr.ip()));
        let Some(node) = node else {
            return "(no node has that address)".into();
        };
        let mut out = String::new();
        for map in ["health-check-nodeports", "health-check-local-endpoints"] {
            let text = match node
                .netns()
                .exec(&["nft", "list", "map", "ip", "splitproxy", map])
            {
                Ok(o) => String::from_utf8_lossy(&o.stdout).to_string(),
                Err(err) => format!("{err:#}"),
            };
            let elements = text
                .lines()
                .find(|l| l.trim_start().starts_with("elements"))
                .map_or("no elements", str::trim);
            let _ = write!(out, "{} {map}: {elements}; ", node.name());
        }
        out
    }

    /// Fails the test with every recorded failure, after saving the nodes' state.
    async fn finish(self) {
        eprintln!(
            "[{}] {} checks passed, {} failed",
            self.label,
            self.passed,
            self.failures.len()
        );
        if self.failures.is_empty() {
            return;
        }
        let saved = save_state(self.lab, self.label).await;
        panic!(
            "[{}] {} of {} checks failed (node state saved in {saved}):\n  {}",
            self.label,
            self.failures.len(),
            self.failures.len() + self.passed,
            self.failures.join("\n  ")
        );
    }
}

/// "answered by web-a (source 192.168.77.10:4711) x3, DROPPED x1".
fn summarize(results: &[ProbeResult]) -> String {
    let mut counts: Vec<(String, usize)> = Vec::new();
    for r in results {
        let key = match r {
            ProbeResult::Answered { pod, source, .. } => {
                format!("{pod} (saw {})", source.ip())
            }
            other => other.to_string(),
        };
        match counts.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => *n += 1,
            None => counts.push((key, 1)),
        }
    }
    let mut s = String::new();
    for (i, (k, n)) in counts.iter().enumerate() {
        let _ = write!(s, "{}{k} x{n}", if i > 0 { ", " } else { "" });
    }
    s
}

/// Saves every node's `nft list ruleset`, `conntrack -L` and the brain's GetNodeRuleset into a
/// directory that outlives the lab; returns its path.
async fn save_state(lab: &Lab, label: &str) -> String {
    let dir = std::env::temp_dir().join(format!(
        "splitproxy-e2e-external-{label}-{}",
        std::process::id()
    ));
    if std::fs::create_dir_all(&dir).is_err() {
        return "(nowhere: cannot create a directory)".into();
    }
    for node in lab.cluster.nodes() {
        for (file, cmd) in [
            ("nft", &["nft", "list", "ruleset"][..]),
            ("conntrack", &["conntrack", "-L"][..]),
            ("addr", &["ip", "addr"][..]),
        ] {
            let text = match node.netns().exec(cmd) {
                Ok(out) => format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
                Err(err) => format!("{err:#}"),
            };
            let _ = std::fs::write(dir.join(format!("{}.{file}", node.name())), text);
        }
        if let Ok(mut client) = lab.operator_client(0).await
            && let Ok(resp) = client
                .get_node_ruleset(splitproxy_proto::v1::GetNodeRulesetRequest {
                    node: node.name().to_string(),
                })
                .await
        {
            let _ = std::fs::write(
                dir.join(format!("{}.brain.nft", node.name())),
                resp.into_inner().nft,
            );
        }
    }
    dir.display().to_string()
}

async fn wait_synced(lab: &Lab) {
    lab.wait_synced(Duration::from_secs(20))
        .await
        .expect("every node applies the objects");
}

/// The slice of `lb-local`: web-local-0 on node-0 and/or web-local-1 on node-1.
fn lb_local_slice(nodes: &[usize]) -> Value {
    let all = [
        ("10.244.0.30", "node-0", "web-local-0"),
        ("10.244.1.35", "node-1", "web-local-1"),
    ];
    let eps: Vec<_> = nodes.iter().map(|i| all[*i]).collect();
    slice("lb-local-1", "lb-local", &eps)
}

/// `lb-local`: LoadBalancer, externalTrafficPolicy Local, healthCheckNodePort 32100, NodePort
/// 30020, ingress 198.51.100.20.
fn lb_local() -> Value {
    service(
        "lb-local",
        json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local",
               "healthCheckNodePort": 32100, "clusterIP": "10.96.20.20",
               "ports": [port("http", "TCP", 80, Some(30020))]}),
        ingress(json!([{"ip": "198.51.100.20"}])),
    )
}

fn external(name: &str, via: &str, v4: &str, v6: &str) -> ExternalSpec {
    ExternalSpec {
        name: name.into(),
        via: Some(via.into()),
        addresses: vec![ip(v4), ip(v6)],
    }
}

// ---------------------------------------------------------------------------------------------
// The lab of scenario `external-cluster-cidr`
// ---------------------------------------------------------------------------------------------

/// The lab and objects of scenario `tests/lab/scenarios/external-cluster-cidr` (ClusterCIDR
/// detection, NodePorts on the primary addresses), whose probes (replayed by
/// `e2e_lab_scenario`) check NodePorts under either policy, LoadBalancer IPs, externalIPs,
/// masquerading and hairpin. Here, what probes cannot show: the healthCheckNodePort's HTTP
/// answer on the primary address (the scenario checks that the secondary one refuses), that the
/// API server allocated no nodePort to `lb-no-nodeport`, and a loadBalancerSourceRanges change
/// under an established flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_cidr_scenario_health_check_no_node_ports_and_source_range_change() {
    let started = Instant::now();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("lab/scenarios/external-cluster-cidr");
    let scenario = Scenario::load(&dir).expect("scenario loads");
    let opts = scenario.lab_options(LabOptions::new(exe())).unwrap();
    assert_eq!(opts.brain.rules.detect_local, DetectLocalMode::ClusterCidr);
    let lab = Lab::start(opts).await.expect("lab starts");
    lab.apply_scenario(&scenario)
        .await
        .expect("scenario applies");
    wait_synced(&lab).await;
    eprintln!("lab up and synced after {:?}", started.elapsed());
    let mut c = Checks::new(&lab, "cluster-cidr");

    // As kube-proxy, health check servers listen on the NodePort addresses only.
    c.section("healthCheckNodePort on the primary address");
    c.health(
        "healthCheckNodePort on node-0's primary address",
        "external",
        &format!("http://{N0}:32100/healthz"),
        200,
        "lb-local",
        1,
    )
    .await;

    c.section("allocateLoadBalancerNodePorts false");
    let svc = Api::<Service>::namespaced(lab.cp.client(), NS)
        .get("lb-no-nodeport")
        .await
        .expect("read back lb-no-nodeport");
    let node_ports: Vec<Option<i32>> = svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.clone())
        .unwrap_or_default()
        .iter()
        .map(|p| p.node_port)
        .collect();
    c.check(node_ports == [None], || {
        format!("lb-no-nodeport has nodePorts {node_ports:?}, want none")
    });

    source_range_change_keeps_established_flows(&mut c).await;
    eprintln!("checks done after {:?}", started.elapsed());
    c.finish().await;
}

/// `lb-ranges` of the scenario's `30-loadbalancer.yaml`: LoadBalancer 198.51.100.30 (TCP 80,
/// UDP 53) open to the clients in `range`.
fn lb_ranges(range: &str) -> Value {
    service(
        "lb-ranges",
        json!({"type": "LoadBalancer",
               "clusterIP": "10.96.20.40", "clusterIPs": ["10.96.20.40"],
               "loadBalancerSourceRanges": [range],
               "ports": [port("http", "TCP", 80, Some(30040)),
                         port("dns", "UDP", 53, Some(30041))]}),
        ingress(json!([{"ip": "198.51.100.30"}])),
    )
}

/// As in kube-proxy (`ct state new` before the firewall check), a change of
/// `loadBalancerSourceRanges` judges new connections only: a flow admitted before keeps its
/// endpoint, a new flow from the same client is dropped, and the newly admitted client gets in.
/// Leaves `lb-ranges` open to the outsider (192.168.77.201) only.
async fn source_range_change_keeps_established_flows(c: &mut Checks<'_>) {
    const FLOW: u16 = 40061;
    const NEW_FLOW: u16 = 40062;
    c.section("loadBalancerSourceRanges change: established flows keep going");
    let lab = c.lab;
    let dst = sa("198.51.100.30:53");
    let endpoint = Want::Masqueraded(vec!["web-ranges"]);
    let before = lab.probe_from_port("external", Proto::Udp, dst, FLOW).await;
    let verdict = c.judge(&before, &endpoint);
    c.check(verdict.is_none(), || {
        format!("UDP flow from inside the range -> LoadBalancer IP: {verdict:?}")
    });
    lab.apply_yaml(&yaml(&[lb_ranges("192.168.77.201/32")]))
        .await
        .expect("source range update applies");
    wait_synced(lab).await;
    let new = lab
        .probe_from_port("external", Proto::Udp, dst, NEW_FLOW)
        .await;
    let verdict = c.judge(&new, &Want::Dropped);
    c.check(verdict.is_none(), || {
        format!("a new flow from a client taken out of the range is dropped: {verdict:?}")
    });
    let kept = lab.probe_from_port("external", Proto::Udp, dst, FLOW).await;
    let verdict = c.judge(&kept, &endpoint);
    c.check(verdict.is_none(), || {
        format!("the flow admitted before the change keeps its endpoint: {verdict:?}")
    });
    c.expect(
        "the client now in the range -> LoadBalancer IP",
        "outsider",
        Proto::Tcp,
        sa("198.51.100.30:80"),
        2,
        endpoint,
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// healthCheckNodePort
// ---------------------------------------------------------------------------------------------

/// The healthCheckNodePort of a LoadBalancer Service with `externalTrafficPolicy: Local`, as a
/// cloud load balancer sees it: every node answers on it, 200 with kube-proxy's headers and JSON
/// where the Service has local endpoints and 503 elsewhere, following endpoint changes within
/// seconds; the port closes with the Service.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_check_node_port_reports_local_endpoints() {
    let started = Instant::now();
    let mut opts = LabOptions::new(exe());
    opts.external_clients = vec![external(
        "external",
        "node-0",
        "192.168.77.200",
        "fd00:77::200",
    )];
    let lab = Lab::start(opts).await.expect("lab starts");
    lab.apply_yaml(&yaml(&[namespace(), lb_local(), lb_local_slice(&[0])]))
        .await
        .expect("objects apply");
    wait_synced(&lab).await;
    let mut c = Checks::new(&lab, "health-check");
    let url = |node: &str, path: &str| {
        if node.contains(':') {
            format!("http://[{node}]:32100{path}")
        } else {
            format!("http://{node}:32100{path}")
        }
    };

    c.section("endpoint on node-0 only");
    for path in ["/", "/healthz"] {
        c.health(
            "node-0 has a local endpoint",
            "external",
            &url(N0, path),
            200,
            "lb-local",
            1,
        )
        .await;
    }
    c.health(
        "node-0 over IPv6",
        "external",
        &url(N0_V6, "/healthz"),
        200,
        "lb-local",
        1,
    )
    .await;
    c.health(
        "node-1 has no local endpoint",
        "external",
        &url(N1, "/healthz"),
        503,
        "lb-local",
        0,
    )
    .await;

    c.section("node-1 gets an endpoint too");
    lab.apply_yaml(&yaml(&[lb_local_slice(&[0, 1])]))
        .await
        .expect("slice update applies");
    let took = c
        .health(
            "node-1 turns healthy",
            "external",
            &url(N1, "/healthz"),
            200,
            "lb-local",
            1,
        )
        .await;
    c.check(took < Duration::from_secs(5), || {
        format!("node-1's health check took {took:?} to turn 200 (want < 5 s)")
    });
    c.health(
        "node-0 stays healthy",
        "external",
        &url(N0, "/"),
        200,
        "lb-local",
        1,
    )
    .await;

    c.section("node-0 loses its endpoint");
    lab.apply_yaml(&yaml(&[lb_local_slice(&[1])]))
        .await
        .expect("slice update applies");
    c.health(
        "node-0 turns unhealthy",
        "external",
        &url(N0, "/healthz"),
        503,
        "lb-local",
        0,
    )
    .await;
    c.health(
        "node-1 stays healthy",
        "external",
        &url(N1, "/healthz"),
        200,
        "lb-local",
        1,
    )
    .await;

    c.section("the Service is deleted");
    lab.delete("Service", NS, "lb-local")
        .await
        .expect("Service deletes");
    for node in [N0, N1] {
        let u = url(node, "/healthz");
        let start = Instant::now();
        let r = loop {
            let r = lab.http_get("external", &u, TIMEOUT).await;
            if matches!(r, HttpResult::Refused) || start.elapsed() >= SETTLE {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        eprintln!("   GET {u} after the deletion: {}", r.to_json());
        c.check(matches!(r, HttpResult::Refused), || {
            format!("GET {u}: the health check port stays open after the Service is gone: {r}")
        });
    }

    eprintln!("health check checks done after {:?}", started.elapsed());
    c.finish().await;
}
