//! External access end to end, checked the way an operator checks a Service by hand: real
//! packets from external clients, nodes and pods to NodePorts, LoadBalancer IPs, externalIPs and
//! ClusterIPs, asserting which endpoint answered, which source address it saw, refused versus
//! dropped, and the healthCheckNodePort's answers. kube-proxy in nftables mode is the reference.
//!
//! Three labs (each start costs seconds), with many Services in the first two:
//!
//! - [`external_traffic_with_cluster_cidr_detection`] runs `--detect-local-mode ClusterCIDR`,
//!   NodePorts on the primary addresses (the default): NodePort with `externalTrafficPolicy`
//!   Cluster and Local, a NodePort without endpoints, LoadBalancer IPs (`ipMode: Proxy`,
//!   `loadBalancerSourceRanges`, `allocateLoadBalancerNodePorts: false`), externalIPs,
//!   masquerading and hairpin.
//! - [`external_traffic_with_interface_prefix_and_nodeport_cidrs`] runs `--detect-local-mode
//!   InterfaceNamePrefix` (prefix `pod`) and `--nodeport-addresses 10.0.5.0/24`: NodePorts only
//!   on the node addresses inside that CIDR, masquerading and hairpin again.
//! - [`health_check_node_port_reports_local_endpoints`] checks the healthCheckNodePort's answers
//!   as endpoints come and go and the Service goes away.
//!
//! Every check is recorded rather than asserted on the spot, so one run reports every behaviour
//! that differs; on failure the nodes' kernel rulesets, the brain's view of them and conntrack
//! tables are saved for inspection (the path is printed).
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kube::Api;
use serde_json::{Value, json};
use splitproxy_tests::deploy::{DetectLocalMode, NodePortAddresses};
use splitproxy_tests::lab::{ExternalSpec, Lab, LabOptions, NodeSpec, PodSpec};
use splitproxy_tests::{HttpResult, ProbeResult, Proto};

/// Namespace of every object.
const NS: &str = "ext";
/// Primary (first InternalIP) addresses of the two nodes.
const N0: &str = "192.168.77.10";
const N1: &str = "192.168.77.11";
const N0_V6: &str = "fd00:77::10";
const N1_V6: &str = "fd00:77::11";
/// A second address of node-0 on the shared network, listed after the primary one.
const N0_EXTRA: &str = "192.168.77.60";
/// A pod address outside the cluster CIDR 10.244.0.0/16 (pod `stray` on node-0).
const STRAY: &str = "10.99.0.5";
/// How long a positive expectation may take to come true (rules on their way).
const SETTLE: Duration = Duration::from_secs(10);
/// Probe timeout; a probe that gets nothing back within it counts as dropped.
const TIMEOUT: Duration = Duration::from_millis(1000);
/// A refusal comes back at once, well under this.
const REFUSED_FAST: Duration = Duration::from_millis(500);

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

/// An EndpointSlice of `svc` (IPv6 when `v6`) serving TCP 8080 (`http`) and, with `dns`, UDP
/// 5353; endpoints are (address, node, pod), all ready.
fn slice(name: &str, svc: &str, v6: bool, dns: bool, eps: &[(&str, &str, &str)]) -> Value {
    let mut ports = vec![json!({"name": "http", "protocol": "TCP", "port": 8080})];
    if dns {
        ports.push(json!({"name": "dns", "protocol": "UDP", "port": 5353}));
    }
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
        "addressType": if v6 { "IPv6" } else { "IPv4" },
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

/// ClusterIP Service `masq` (endpoint web-m on node-1) and `hairpin` (whose only endpoint is
/// the pod `hairpin` on node-0, which also probes it): the masquerading section's Services.
fn masquerade_objects() -> Vec<Value> {
    vec![
        service(
            "masq",
            json!({"clusterIP": "10.96.20.70", "ports": [port("http", "TCP", 80, None)]}),
            None,
        ),
        slice(
            "masq-1",
            "masq",
            false,
            false,
            &[("10.244.1.70", "node-1", "web-m")],
        ),
        service(
            "hairpin",
            json!({"clusterIP": "10.96.20.80", "ports": [port("http", "TCP", 80, None)]}),
            None,
        ),
        slice(
            "hairpin-1",
            "hairpin",
            false,
            false,
            &[("10.244.0.80", "node-0", "hairpin")],
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// Expectations
// ---------------------------------------------------------------------------------------------

/// What the answering pod must have seen as the source.
#[derive(Clone, Debug)]
enum Src {
    /// Exactly the probing socket's address and port.
    Preserved,
    /// Not the client's address, but an address of one of the lab's nodes (a masquerade).
    Masqueraded,
    /// This address (any port).
    Ip(IpAddr),
    /// Anything but this address.
    Not(IpAddr),
}

#[derive(Clone, Debug)]
enum Want {
    /// Answered by one of `pods` (any pod when empty), with the source `src`.
    Answered(Vec<&'static str>, Src),
    /// TCP reset or ICMP port unreachable, at once.
    Refused,
    /// Nothing came back in time (not refused, not unreachable).
    Dropped,
    /// No pod of the Service answered: dropped or unreachable.
    NotForwarded,
}

fn answered(pods: &[&'static str], src: Src) -> Want {
    Want::Answered(pods.to_vec(), src)
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
                Want::Answered(pods, src),
                ProbeResult::Answered {
                    pod,
                    source,
                    client,
                    ..
                },
            ) => {
                if !pods.is_empty() && !pods.contains(&pod.as_str()) {
                    return Some(format!("answered by {pod}, not by one of {pods:?}"));
                }
                let ok = match src {
                    Src::Preserved => r.source_preserved() == Some(true),
                    Src::Masqueraded => {
                        source.ip() != client.ip() && self.node_ips.contains(&source.ip())
                    }
                    Src::Ip(want) => source.ip() == *want,
                    Src::Not(other) => source.ip() != *other,
                };
                (!ok).then(|| format!("{pod} saw source {source} (client {client}), want {src:?}"))
            }
            (Want::Answered(..), other) => Some(format!("not answered: {other}")),
            (Want::Refused, ProbeResult::Refused) | (Want::Dropped, ProbeResult::TimedOut) => None,
            (Want::NotForwarded, ProbeResult::TimedOut | ProbeResult::Unreachable(_)) => None,
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
            let t = Instant::now();
            let r = self.probe(from, proto, dst).await;
            let mut verdict = self.judge(&r, &want);
            if verdict.is_none() && matches!(want, Want::Refused) && t.elapsed() > REFUSED_FAST {
                verdict = Some(format!("refused only after {:?}", t.elapsed()));
            }
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
        let summary = summarize(&results);
        eprintln!("   {what}: {from} -> {proto} {dst}: {summary}");
        self.check(problems.is_empty(), || {
            format!(
                "{what}: {from} -> {proto} {dst}: want {want:?}: {} (results: {summary})",
                problems.join("; ")
            )
        });
    }

    /// TCP probes `from` -> `dst` in rounds of 12 until one round is answered by `pods` only,
    /// with source `src`, each of them at least once (within [`SETTLE`], at most 10 rounds).
    async fn expect_spread(
        &mut self,
        what: &str,
        from: &str,
        dst: SocketAddr,
        pods: &[&'static str],
        src: Src,
    ) {
        let want = answered(pods, src);
        let mut results = Vec::new();
        let mut problems = Vec::new();
        let start = Instant::now();
        // Rounds of 12: a round missing one of two backends by chance has odds 2^-11.
        for _ in 0..10 {
            let round = self.lab.probe_n(from, Proto::Tcp, dst, 12, TIMEOUT).await;
            let bad: Vec<String> = round.iter().filter_map(|r| self.judge(r, &want)).collect();
            let seen: BTreeSet<String> = round
                .iter()
                .filter_map(|r| r.pod().map(str::to_string))
                .collect();
            results.extend(round);
            // One clean round in which every pod answered.
            if bad.is_empty() && pods.iter().all(|p| seen.contains(*p)) {
                problems.clear();
                break;
            }
            problems = bad;
            if problems.is_empty() {
                problems.push(format!("only {seen:?} answered"));
            }
            if start.elapsed() >= SETTLE {
                break;
            }
        }
        let summary = summarize(&results[results.len().saturating_sub(12)..]);
        eprintln!("   {what}: {from} -> {dst}: {summary}");
        self.check(problems.is_empty(), || {
            format!(
                "{what}: {from} -> {dst}: want every one of {pods:?} with {want:?}: {} (last round: {summary})",
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

// ---------------------------------------------------------------------------------------------
// Shared section: masquerading and hairpin
// ---------------------------------------------------------------------------------------------

/// Pod -> ClusterIP keeps the pod's source; the node's own traffic and external traffic to a
/// ClusterIP is masqueraded; a pod reaching itself through its Service sees another source.
/// A pod on node-0 whose address is outside the cluster CIDR (`stray`, [`STRAY`]) tells the
/// detect-local modes apart: ClusterCIDR takes it for an outsider (masqueraded), an interface
/// prefix for a local pod (`stray_masqueraded` false).
/// Needs [`masquerade_objects`], the pods `client-0` (10.244.0.100) and `stray` on node-0, the
/// extra node-0 address [`N0_EXTRA`] and the external client `external` routed via node-0.
async fn masquerade_and_hairpin(c: &mut Checks<'_>, stray_masqueraded: bool) {
    c.section("masquerade: ClusterIP from a pod, the node, outside; hairpin");
    let masq = sa("10.96.20.70:80");
    let (what, src) = if stray_masqueraded {
        (
            "pod outside the cluster CIDR -> ClusterIP is masqueraded (ClusterCIDR detection)",
            Src::Ip(ip(N0)),
        )
    } else {
        (
            "pod outside the cluster CIDR -> ClusterIP keeps its address (pod interface)",
            Src::Preserved,
        )
    };
    c.expect(what, STRAY, Proto::Tcp, masq, 3, answered(&["web-m"], src))
        .await;
    c.expect(
        "pod -> ClusterIP keeps the pod's address",
        "client-0",
        Proto::Tcp,
        masq,
        3,
        answered(&["web-m"], Src::Ip(ip("10.244.0.100"))),
    )
    .await;
    c.expect(
        "pod -> ClusterIP keeps the pod's port too",
        "10.244.0.100",
        Proto::Tcp,
        masq,
        1,
        answered(&["web-m"], Src::Preserved),
    )
    .await;
    // Bound to the node's second address: only a masquerade turns it into the primary one.
    c.expect(
        "node -> ClusterIP is masqueraded (from a secondary node address)",
        N0_EXTRA,
        Proto::Tcp,
        masq,
        3,
        answered(&["web-m"], Src::Ip(ip(N0))),
    )
    .await;
    c.expect(
        "node -> ClusterIP answered with a node address",
        "node-0",
        Proto::Tcp,
        masq,
        1,
        answered(&["web-m"], Src::Ip(ip(N0))),
    )
    .await;
    c.expect(
        "external client -> ClusterIP via node-0 is masqueraded",
        "external",
        Proto::Tcp,
        masq,
        3,
        answered(&["web-m"], Src::Ip(ip(N0))),
    )
    .await;
    c.expect(
        "hairpin: a pod reaching itself through its ClusterIP sees another source",
        "hairpin",
        Proto::Tcp,
        sa("10.96.20.80:80"),
        3,
        answered(&["hairpin"], Src::Not(ip("10.244.0.80"))),
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Lab 1: ClusterCIDR detection, NodePorts on primary addresses
// ---------------------------------------------------------------------------------------------

fn lab1_objects() -> Vec<Value> {
    let mut docs = vec![
        namespace(),
        // NodePort, Cluster policy, dual stack, TCP and UDP, an endpoint on each node.
        service(
            "np-cluster",
            json!({
                "type": "NodePort",
                "ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv4", "IPv6"],
                "clusterIP": "10.96.20.10", "clusterIPs": ["10.96.20.10", "fd00:96::2010"],
                "ports": [port("http", "TCP", 80, Some(30010)), port("dns", "UDP", 53, Some(30011))],
            }),
            None,
        ),
        slice(
            "np-cluster-v4",
            "np-cluster",
            false,
            true,
            &[
                ("10.244.0.20", "node-0", "web-a"),
                ("10.244.1.20", "node-1", "web-b"),
            ],
        ),
        slice(
            "np-cluster-v6",
            "np-cluster",
            true,
            true,
            &[
                ("fd00:244::20", "node-0", "web-a"),
                ("fd00:244:0:1::20", "node-1", "web-b"),
            ],
        ),
        // NodePort without endpoints.
        service(
            "np-empty",
            json!({"type": "NodePort", "clusterIP": "10.96.20.11",
                   "ports": [port("http", "TCP", 80, Some(30012)),
                             port("dns", "UDP", 53, Some(30013))]}),
            None,
        ),
        slice("np-empty-1", "np-empty", false, true, &[]),
        // LoadBalancer, Local policy, explicit healthCheckNodePort, endpoint on node-0 only.
        lb_local(),
        lb_local_slice(&[0]),
        // LoadBalancer, Cluster policy, one VIP ingress and one ipMode Proxy ingress.
        service(
            "lb-cluster",
            json!({"type": "LoadBalancer", "clusterIP": "10.96.20.30",
                   "ports": [port("http", "TCP", 80, Some(30030))]}),
            ingress(json!([{"ip": "198.51.100.10"}, {"ip": "198.51.100.11", "ipMode": "Proxy"}])),
        ),
        slice(
            "lb-cluster-1",
            "lb-cluster",
            false,
            false,
            &[("10.244.1.31", "node-1", "web-lb")],
        ),
        // LoadBalancer restricted to one client.
        lb_ranges("192.168.77.200/32"),
        slice(
            "lb-ranges-1",
            "lb-ranges",
            false,
            true,
            &[("10.244.0.40", "node-0", "web-ranges")],
        ),
        // LoadBalancer without NodePorts.
        service(
            "lb-no-nodeport",
            json!({"type": "LoadBalancer", "allocateLoadBalancerNodePorts": false,
                   "clusterIP": "10.96.20.50", "ports": [port("http", "TCP", 80, None)]}),
            ingress(json!([{"ip": "198.51.100.40"}])),
        ),
        slice(
            "lb-no-nodeport-1",
            "lb-no-nodeport",
            false,
            false,
            &[("10.244.1.50", "node-1", "web-nonp")],
        ),
        // externalIPs on a ClusterIP Service.
        service(
            "ext-ips",
            json!({"clusterIP": "10.96.20.60", "externalIPs": ["203.0.113.60"],
                   "ports": [port("http", "TCP", 80, None)]}),
            None,
        ),
        slice(
            "ext-ips-1",
            "ext-ips",
            false,
            false,
            &[("10.244.1.60", "node-1", "web-ext")],
        ),
    ];
    docs.extend(masquerade_objects());
    docs
}

/// `lb-ranges`: LoadBalancer 198.51.100.30 (TCP 80, UDP 53) open to the clients in `range`.
fn lb_ranges(range: &str) -> Value {
    service(
        "lb-ranges",
        json!({"type": "LoadBalancer", "clusterIP": "10.96.20.40",
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
    let endpoint = answered(&["web-ranges"], Src::Masqueraded);
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

/// The slice of `lb-local`: web-local-0 on node-0 and/or web-local-1 on node-1.
fn lb_local_slice(nodes: &[usize]) -> Value {
    let all = [
        ("10.244.0.30", "node-0", "web-local-0"),
        ("10.244.1.35", "node-1", "web-local-1"),
    ];
    let eps: Vec<_> = nodes.iter().map(|i| all[*i]).collect();
    slice("lb-local-1", "lb-local", false, false, &eps)
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

fn pod(name: &str, node: &str, addr: &str) -> PodSpec {
    PodSpec {
        addresses: vec![ip(addr)],
        ..PodSpec::new(name, node)
    }
}

fn external(name: &str, via: &str, v4: &str, v6: &str) -> ExternalSpec {
    ExternalSpec {
        name: name.into(),
        via: Some(via.into()),
        addresses: vec![ip(v4), ip(v6)],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn external_traffic_with_cluster_cidr_detection() {
    let started = Instant::now();
    let mut opts = LabOptions::new(exe());
    opts.node_specs = vec![
        NodeSpec {
            addresses: vec![format!("{N0_EXTRA}/32").parse().unwrap()],
            ..NodeSpec::new("node-0")
        },
        NodeSpec::new("node-1"),
    ];
    opts.external_clients = vec![
        external("external", "node-0", "192.168.77.200", "fd00:77::200"),
        // Outside loadBalancerSourceRanges.
        external("outsider", "node-0", "192.168.77.201", "fd00:77::201"),
        // Sends LoadBalancer IPs to node-1 instead.
        external("external-1", "node-1", "192.168.77.202", "fd00:77::202"),
    ];
    opts.pods = vec![
        pod("client-0", "node-0", "10.244.0.100"),
        pod("client-1", "node-1", "10.244.1.100"),
        pod("stray", "node-0", STRAY),
    ];
    assert_eq!(opts.brain.rules.detect_local, DetectLocalMode::ClusterCidr);
    let lab = Lab::start(opts).await.expect("lab starts");
    lab.apply_yaml(&yaml(&lab1_objects()))
        .await
        .expect("objects apply");
    wait_synced(&lab).await;
    eprintln!("lab 1 up and synced after {:?}", started.elapsed());
    let mut c = Checks::new(&lab, "cluster-cidr");

    // -- NodePort, externalTrafficPolicy: Cluster ----------------------------------------------
    c.section("NodePort, Cluster policy");
    for node_ip in [N0, N1] {
        c.expect_spread(
            "external -> NodePort, endpoints on both nodes answer, masqueraded",
            "external",
            SocketAddr::new(ip(node_ip), 30010),
            &["web-a", "web-b"],
            Src::Masqueraded,
        )
        .await;
    }
    c.expect(
        "external -> NodePort over UDP, masqueraded",
        "external",
        Proto::Udp,
        sa("192.168.77.11:30011"),
        4,
        answered(&["web-a", "web-b"], Src::Masqueraded),
    )
    .await;
    for node_ip in [N0_V6, N1_V6] {
        c.expect(
            "external -> IPv6 NodePort, masqueraded",
            "external",
            Proto::Tcp,
            SocketAddr::new(ip(node_ip), 30010),
            4,
            answered(&["web-a", "web-b"], Src::Masqueraded),
        )
        .await;
    }
    c.expect(
        "pod -> its own node's NodePort (Cluster policy: masqueraded)",
        "client-1",
        Proto::Tcp,
        sa("192.168.77.11:30010"),
        3,
        answered(&["web-a", "web-b"], Src::Ip(ip(N1))),
    )
    .await;
    c.expect(
        "node -> 127.0.0.1:nodePort is not a NodePort (nftables mode)",
        "node-0",
        Proto::Tcp,
        sa("127.0.0.1:30010"),
        1,
        Want::Refused,
    )
    .await;
    c.expect(
        "external -> a secondary node address is not a NodePort address (primary only)",
        "external",
        Proto::Tcp,
        SocketAddr::new(ip(N0_EXTRA), 30010),
        1,
        Want::Refused,
    )
    .await;
    // As kube-proxy, health check servers listen on the NodePort addresses only.
    c.health(
        "healthCheckNodePort on node-0's primary address",
        "external",
        &format!("http://{N0}:32100/healthz"),
        200,
        "lb-local",
        1,
    )
    .await;
    c.expect(
        "healthCheckNodePort is not served on a secondary node address (primary only)",
        "external",
        Proto::Tcp,
        SocketAddr::new(ip(N0_EXTRA), 32100),
        1,
        Want::Refused,
    )
    .await;

    // -- NodePort without endpoints --------------------------------------------------------------
    c.section("NodePort without endpoints");
    for node_ip in [N0, N1] {
        c.expect(
            "external -> NodePort of a Service without endpoints is refused",
            "external",
            Proto::Tcp,
            SocketAddr::new(ip(node_ip), 30012),
            2,
            Want::Refused,
        )
        .await;
    }
    c.expect(
        "external -> UDP NodePort of a Service without endpoints is refused (port unreachable)",
        "external",
        Proto::Udp,
        sa("192.168.77.11:30013"),
        2,
        Want::Refused,
    )
    .await;

    // -- externalTrafficPolicy: Local, endpoint on node-0 only -----------------------------------
    c.section("externalTrafficPolicy Local, endpoint on node-0 only");
    c.expect(
        "external -> node-0's NodePort: node-0's endpoint, client address preserved",
        "external",
        Proto::Tcp,
        sa("192.168.77.10:30020"),
        5,
        answered(&["web-local-0"], Src::Preserved),
    )
    .await;
    c.expect(
        "external -> node-1's NodePort (no local endpoint) is dropped",
        "external",
        Proto::Tcp,
        sa("192.168.77.11:30020"),
        2,
        Want::Dropped,
    )
    .await;
    c.expect(
        "pod on node-1 -> node-1's NodePort short-circuits to all endpoints",
        "client-1",
        Proto::Tcp,
        sa("192.168.77.11:30020"),
        3,
        answered(&["web-local-0"], Src::Ip(ip("10.244.1.100"))),
    )
    .await;
    c.expect(
        "node-0 -> its own NodePort",
        "node-0",
        Proto::Tcp,
        sa("192.168.77.10:30020"),
        2,
        answered(&["web-local-0"], Src::Ip(ip(N0))),
    )
    .await;
    c.expect(
        "node-1 -> its own NodePort (no local endpoint): to the cluster's endpoints, masqueraded",
        "node-1",
        Proto::Tcp,
        sa("192.168.77.11:30020"),
        2,
        answered(&["web-local-0"], Src::Ip(ip(N1))),
    )
    .await;
    c.expect(
        "external via node-0 -> LoadBalancer IP: node-0's endpoint, client address preserved",
        "external",
        Proto::Tcp,
        sa("198.51.100.20:80"),
        3,
        answered(&["web-local-0"], Src::Preserved),
    )
    .await;
    c.expect(
        "external via node-1 -> LoadBalancer IP (no local endpoint on node-1) is dropped",
        "external-1",
        Proto::Tcp,
        sa("198.51.100.20:80"),
        1,
        Want::Dropped,
    )
    .await;
    c.expect(
        "pod on node-1 -> ClusterIP (internal policy Cluster)",
        "client-1",
        Proto::Tcp,
        sa("10.96.20.20:80"),
        2,
        answered(&["web-local-0"], Src::Preserved),
    )
    .await;
    c.expect(
        "pod on node-1 -> LoadBalancer IP short-circuits to all endpoints",
        "client-1",
        Proto::Tcp,
        sa("198.51.100.20:80"),
        2,
        answered(&["web-local-0"], Src::Preserved),
    )
    .await;
    c.expect(
        "node-1 -> LoadBalancer IP (no local endpoint): to the cluster's endpoints, masqueraded",
        "node-1",
        Proto::Tcp,
        sa("198.51.100.20:80"),
        2,
        answered(&["web-local-0"], Src::Ip(ip(N1))),
    )
    .await;

    // -- node-1 gets an endpoint too -------------------------------------------------------------
    // (The healthCheckNodePort's answers are checked in health_check_node_port_*.)
    c.section("externalTrafficPolicy Local, node-1 gets an endpoint");
    lab.apply_yaml(&yaml(&[lb_local_slice(&[0, 1])]))
        .await
        .expect("slice update applies");
    wait_synced(&lab).await;
    c.expect(
        "external -> node-1's NodePort: only node-1's endpoint, client address preserved",
        "external",
        Proto::Tcp,
        sa("192.168.77.11:30020"),
        8,
        answered(&["web-local-1"], Src::Preserved),
    )
    .await;
    c.expect(
        "external -> node-0's NodePort: only node-0's endpoint, client address preserved",
        "external",
        Proto::Tcp,
        sa("192.168.77.10:30020"),
        8,
        answered(&["web-local-0"], Src::Preserved),
    )
    .await;
    c.expect(
        "external via node-1 -> LoadBalancer IP: node-1's endpoint, client address preserved",
        "external-1",
        Proto::Tcp,
        sa("198.51.100.20:80"),
        4,
        answered(&["web-local-1"], Src::Preserved),
    )
    .await;
    c.expect_spread(
        "pod on node-1 -> node-1's NodePort reaches every endpoint",
        "client-1",
        sa("192.168.77.11:30020"),
        &["web-local-0", "web-local-1"],
        Src::Ip(ip("10.244.1.100")),
    )
    .await;

    // -- LoadBalancer, Cluster policy ------------------------------------------------------------
    c.section("LoadBalancer, Cluster policy, ipMode Proxy");
    c.expect(
        "external via node-0 -> LoadBalancer IP, endpoint on node-1, masqueraded by node-0",
        "external",
        Proto::Tcp,
        sa("198.51.100.10:80"),
        3,
        answered(&["web-lb"], Src::Ip(ip(N0))),
    )
    .await;
    c.expect(
        "external -> the LoadBalancer's NodePort on node-1",
        "external",
        Proto::Tcp,
        sa("192.168.77.11:30030"),
        2,
        answered(&["web-lb"], Src::Masqueraded),
    )
    .await;
    c.expect(
        "external via node-0 -> an ipMode Proxy ingress IP is not forwarded",
        "external",
        Proto::Tcp,
        sa("198.51.100.11:80"),
        2,
        Want::NotForwarded,
    )
    .await;

    // -- loadBalancerSourceRanges ----------------------------------------------------------------
    c.section("loadBalancerSourceRanges 192.168.77.200/32");
    c.expect(
        "client inside the range -> LoadBalancer IP",
        "external",
        Proto::Tcp,
        sa("198.51.100.30:80"),
        3,
        answered(&["web-ranges"], Src::Masqueraded),
    )
    .await;
    c.expect(
        "client outside the range -> LoadBalancer IP is dropped",
        "outsider",
        Proto::Tcp,
        sa("198.51.100.30:80"),
        2,
        Want::Dropped,
    )
    .await;
    c.expect(
        "client outside the range -> NodePort (source ranges cover LoadBalancer IPs only)",
        "outsider",
        Proto::Tcp,
        sa("192.168.77.10:30040"),
        2,
        answered(&["web-ranges"], Src::Masqueraded),
    )
    .await;
    source_range_change_keeps_established_flows(&mut c).await;

    // -- allocateLoadBalancerNodePorts: false ----------------------------------------------------
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
    c.expect(
        "external -> LoadBalancer IP of a Service without NodePorts",
        "external",
        Proto::Tcp,
        sa("198.51.100.40:80"),
        3,
        answered(&["web-nonp"], Src::Ip(ip(N0))),
    )
    .await;

    // -- externalIPs -----------------------------------------------------------------------------
    c.section("externalIPs");
    c.expect(
        "external via node-0 -> externalIP, endpoint on node-1, masqueraded",
        "external",
        Proto::Tcp,
        sa("203.0.113.60:80"),
        3,
        answered(&["web-ext"], Src::Ip(ip(N0))),
    )
    .await;
    c.expect(
        "pod -> externalIP of a Cluster-policy Service is masqueraded too",
        "client-0",
        Proto::Tcp,
        sa("203.0.113.60:80"),
        2,
        answered(&["web-ext"], Src::Not(ip("10.244.0.100"))),
    )
    .await;
    c.expect(
        "external -> externalIP on a port the Service does not have is not forwarded",
        "external",
        Proto::Tcp,
        sa("203.0.113.60:81"),
        1,
        Want::NotForwarded,
    )
    .await;

    masquerade_and_hairpin(&mut c, true).await;

    eprintln!("lab 1 checks done after {:?}", started.elapsed());
    c.finish().await;
}

// ---------------------------------------------------------------------------------------------
// Lab 2: InterfaceNamePrefix detection, NodePorts on addresses inside 10.0.5.0/24
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn external_traffic_with_interface_prefix_and_nodeport_cidrs() {
    let started = Instant::now();
    let mut opts = LabOptions::new(exe());
    opts.node_specs = vec![
        NodeSpec {
            addresses: vec![
                format!("{N0_EXTRA}/32").parse().unwrap(),
                "10.0.5.10/32".parse().unwrap(),
            ],
            ..NodeSpec::new("node-0")
        },
        NodeSpec {
            addresses: vec!["10.0.5.11/32".parse().unwrap()],
            ..NodeSpec::new("node-1")
        },
    ];
    opts.external_clients = vec![external(
        "external",
        "node-0",
        "192.168.77.200",
        "fd00:77::200",
    )];
    opts.pods = vec![
        pod("client-0", "node-0", "10.244.0.100"),
        pod("client-1", "node-1", "10.244.1.100"),
        pod("stray", "node-0", STRAY),
    ];
    // The lab passes its pod interface prefix, `pod`.
    opts.brain.rules.detect_local = DetectLocalMode::InterfaceNamePrefix;
    opts.brain.rules.nodeport_addresses =
        NodePortAddresses::Cidrs(vec!["10.0.5.0/24".parse().unwrap()]);
    let lab = Lab::start(opts).await.expect("lab starts");
    let mut docs = vec![
        namespace(),
        service(
            "np",
            json!({"type": "NodePort", "clusterIP": "10.96.20.10",
                   "ports": [port("http", "TCP", 80, Some(30010))]}),
            None,
        ),
        slice(
            "np-1",
            "np",
            false,
            false,
            &[
                ("10.244.0.20", "node-0", "web-a"),
                ("10.244.1.20", "node-1", "web-b"),
            ],
        ),
    ];
    docs.extend([lb_local(), lb_local_slice(&[0])]);
    docs.extend(masquerade_objects());
    lab.apply_yaml(&yaml(&docs)).await.expect("objects apply");
    wait_synced(&lab).await;
    eprintln!("lab 2 up and synced after {:?}", started.elapsed());
    let mut c = Checks::new(&lab, "interface-prefix");

    c.section("nodePortAddresses 10.0.5.0/24");
    for node_ip in ["10.0.5.10", "10.0.5.11"] {
        c.expect_spread(
            "external -> NodePort on the node address inside the CIDR",
            "external",
            SocketAddr::new(ip(node_ip), 30010),
            &["web-a", "web-b"],
            Src::Masqueraded,
        )
        .await;
    }
    for node_ip in [N0, N1] {
        c.expect(
            "external -> NodePort on the primary address, outside the CIDR, is not served",
            "external",
            Proto::Tcp,
            SocketAddr::new(ip(node_ip), 30010),
            1,
            Want::Refused,
        )
        .await;
    }
    c.expect(
        "pod on node-1 -> its node's NodePort address (Cluster policy: masqueraded)",
        "client-1",
        Proto::Tcp,
        sa("10.0.5.11:30010"),
        3,
        answered(&["web-a", "web-b"], Src::Ip(ip(N1))),
    )
    .await;

    c.section("externalTrafficPolicy Local, endpoint on node-0 only, pods told by interface");
    c.expect(
        "external -> node-0's NodePort: node-0's endpoint, client address preserved",
        "external",
        Proto::Tcp,
        sa("10.0.5.10:30020"),
        3,
        answered(&["web-local-0"], Src::Preserved),
    )
    .await;
    c.expect(
        "external -> node-1's NodePort (no local endpoint) is dropped",
        "external",
        Proto::Tcp,
        sa("10.0.5.11:30020"),
        1,
        Want::Dropped,
    )
    .await;
    c.expect(
        "pod on node-1 -> node-1's NodePort short-circuits to all endpoints",
        "client-1",
        Proto::Tcp,
        sa("10.0.5.11:30020"),
        3,
        answered(&["web-local-0"], Src::Preserved),
    )
    .await;

    masquerade_and_hairpin(&mut c, false).await;

    eprintln!("lab 2 checks done after {:?}", started.elapsed());
    c.finish().await;
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
