//! In-cluster Service semantics end to end, checked the way an operator checks a Service by
//! hand: real packets from client pods to ClusterIPs, asserting which endpoint (pod, ip:port)
//! answered, which source it saw, and whether a connection was refused or dropped.
//! kube-proxy's nftables mode is the reference.
//!
//! What probes alone can check lives in lab scenarios, replayed by `e2e_lab_scenario`:
//! `tests/lab/scenarios/clusterip-semantics` (named target ports over TCP and UDP; endpoints
//! spread over three slices; ready / serving+terminating / not-serving endpoints; refusals and
//! drops; headless, ExternalName and other-proxy Services; dual-stack and IPv6-only Services)
//! and `tests/lab/scenarios/traffic-policy-and-topology` (internalTrafficPolicy Local, topology
//! hints for zones and nodes, kube-proxy's fallbacks). Here, what needs more than probes:
//! - [`clusterip_scenario_sctp_dnat_slots_and_ignored_services`] (the `clusterip-semantics`
//!   lab): SCTP DNAT to named ports with raw INIT packets, one DNAT slot per distinct endpoint,
//!   no rules for ignored Services (read from the nodes' rulesets).
//! - [`session_affinity_and_udp_conntrack`] (3 nodes in two zones): ClientIP session affinity
//!   as its endpoint goes and for masqueraded connections (an external client through a
//!   Cluster-policy NodePort, the node itself to a ClusterIP), and UDP flows that must follow
//!   endpoint changes (conntrack cleanup).
//! - [`topology_fallback_applies_as_a_delta_and_reports_in_sync`]: the change from per-node
//!   topology choices to kube-proxy's fallback, applied as a delta and reported in sync.
//!
//! An answer is written `pod@ip:port`: the pod that answered and the endpoint address the
//! connection arrived on, after DNAT.
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{
    AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, SockaddrIn, recv, sendto, socket,
};
use serde_json::{Value, json};
use splitproxy_proto::v1::{ListNodesRequest, NodeStatus};
use splitproxy_tests::deploy::metric;
use splitproxy_tests::lab::{Lab, LabOptions, NodeSpec, PodSpec};
use splitproxy_tests::scenario::Scenario;
use splitproxy_tests::{Netns, ProbeResult, Proto};

const NS: &str = "internal";
/// Per probe.
const TIMEOUT: Duration = Duration::from_millis(1500);
/// How long the rules may take to follow an object change once the brain reports every node
/// in sync (they should already have).
const SETTLE: Duration = Duration::from_secs(8);
/// How long a UDP flow may keep a stale conntrack entry after its endpoint changed.
const CONNTRACK_CLEANUP: Duration = Duration::from_secs(5);

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_splitproxy-lab")
}

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

/// A dual-stack client pod on node `node` with addresses 10.244.<node>.200 and its twin.
fn client_pod(name: &str, node: usize) -> PodSpec {
    PodSpec {
        addresses: vec![
            format!("10.244.{node}.200").parse().unwrap(),
            format!("fd00:244:0:{node}::200").parse().unwrap(),
        ],
        ..PodSpec::new(name, format!("node-{node}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Objects, as JSON (which is YAML), so that every field kube-proxy reads can be written.

fn to_yaml(objs: &[Value]) -> String {
    objs.iter()
        .map(|o| serde_json::to_string(o).expect("JSON"))
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// Service ports (name, protocol, port), each targeting the named port of its own name.
fn ports(list: &[(&str, &str, u16)]) -> Value {
    list.iter()
        .map(|(name, proto, port)| {
            json!({"name": name, "protocol": proto, "port": port, "targetPort": name})
        })
        .collect()
}

/// A selectorless single-stack IPv4 ClusterIP Service; `extra` is merged into its spec.
fn cluster_ip(name: &str, ip: &str, p: &[(&str, &str, u16)], extra: Value) -> Value {
    let mut spec = json!({"clusterIP": ip, "clusterIPs": [ip], "ports": ports(p)});
    if let (Value::Object(s), Value::Object(e)) = (&mut spec, extra) {
        s.extend(e);
    }
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    })
}

/// A ready endpoint: one address, on `node`, backed by pod `pod` (the lab creates the pod on
/// that node, serving the slice's TCP and UDP ports).
fn ep(ip: &str, node: &str, pod: &str) -> Value {
    json!({
        "addresses": [ip],
        "conditions": {"ready": true, "serving": true, "terminating": false},
        "nodeName": node,
        "targetRef": {"kind": "Pod", "namespace": NS, "name": pod},
    })
}

/// [`ep`] in `zone`, with hints for these zones and nodes (empty lists are left out).
fn ep_hints(ip: &str, node: &str, pod: &str, zone: &str, zones: &[&str], nodes: &[&str]) -> Value {
    let mut e = ep(ip, node, pod);
    e["zone"] = json!(zone);
    let mut hints = serde_json::Map::new();
    if !zones.is_empty() {
        hints.insert(
            "forZones".into(),
            zones.iter().map(|z| json!({"name": z})).collect(),
        );
    }
    if !nodes.is_empty() {
        hints.insert(
            "forNodes".into(),
            nodes.iter().map(|n| json!({"name": n})).collect(),
        );
    }
    if !hints.is_empty() {
        e["hints"] = Value::Object(hints);
    }
    e
}

/// An IPv4 EndpointSlice of Service `svc` with ports (name, protocol, port).
fn slice(name: &str, svc: &str, p: &[(&str, &str, u16)], eps: Vec<Value>) -> Value {
    let ports: Vec<Value> = p
        .iter()
        .map(|(n, proto, port)| json!({"name": n, "protocol": proto, "port": port}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS,
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": eps,
    })
}

/// Applies `objs` (creating pods for their endpoints) and waits until every node has the
/// resulting rules.
async fn apply(lab: &Lab, objs: &[Value]) {
    let yaml = to_yaml(objs);
    lab.apply_yaml(&yaml)
        .await
        .unwrap_or_else(|e| panic!("applying objects: {e:#}\n{yaml}"));
    if let Err(e) = wait_applied(lab).await {
        panic!(
            "the nodes did not all apply the change: {e}\n{yaml}\n{}",
            logs(lab)
        );
    }
}

/// Like [`Lab::wait_synced`], bounded by 20 s, except that a node with nothing outstanding
/// (connected, its latest update acknowledged without error) counts as synced even when the
/// brain reports it out of sync. The brain's ListNodes compares what a node acknowledged with
/// the latest publication, so a publication that changes only other nodes' rules (one node's
/// topology choice, say) leaves the untouched nodes "out of sync" until some later change
/// reaches them; `Lab::wait_synced` then times out although every node holds its rules. (That
/// report is checked strictly in [`topology_fallback_applies_as_a_delta_and_reports_in_sync`].)
async fn wait_applied(lab: &Lab) -> Result<(), String> {
    tokio::time::sleep(Duration::from_millis(400)).await; // longer than a publication interval
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < Duration::from_secs(20) {
        if let Ok(mut client) = lab.operator_client(0).await
            && let Ok(resp) = client.list_nodes(ListNodesRequest {}).await
        {
            let resp = resp.into_inner();
            let done = |n: &NodeStatus| {
                n.connected
                    && (n.in_sync
                        || (n.acked_generation == n.desired_generation && n.last_error.is_empty()))
            };
            if resp.synced && resp.nodes.len() == lab.actuators.len() && resp.nodes.iter().all(done)
            {
                return Ok(());
            }
            last = format!("{:?}", resp.nodes);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "not every node applied its latest update in 20 s: {last}"
    ))
}

/// The tail of every actuator's and the brain's log, for failure messages.
fn logs(lab: &Lab) -> String {
    let mut logs = String::new();
    for a in &lab.actuators {
        logs.push_str(&format!("--- actuator {}:\n{}\n", a.node, a.log_tail(20)));
    }
    logs.push_str(&format!("--- brain:\n{}", lab.brain(0).child.log_tail(20)));
    logs
}

/// Every node applied every update it got (none was refused by the kernel).
fn assert_no_apply_errors(lab: &Lab, what: &str) {
    for (i, a) in lab.actuators.iter().enumerate() {
        let m = lab.actuator_metrics(i).expect("actuator metrics");
        let errors = metric(&m, "splitproxy_actuator_apply_errors_total");
        assert_eq!(
            errors,
            Some(0.0),
            "{what}: node {} failed to apply updates\n{}",
            a.node,
            logs(lab)
        );
    }
}

async fn lab_with(nodes: Vec<NodeSpec>, clients: &[(&str, usize)]) -> Lab {
    let mut opts = LabOptions::new(exe());
    opts.node_specs = nodes;
    opts.pods = clients.iter().map(|(n, i)| client_pod(n, *i)).collect();
    let lab = Lab::start(opts).await.expect("lab starts");
    apply(
        &lab,
        &[json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})],
    )
    .await;
    lab
}

// ---------------------------------------------------------------------------------------------
// Probes.

/// `pod@ip:port` for an answer, else `REFUSED`, `DROPPED`, `UNREACHABLE` or `ERROR`.
fn key(r: &ProbeResult) -> String {
    match r {
        ProbeResult::Answered { pod, endpoint, .. } => format!("{pod}@{endpoint}"),
        other => other.kind().to_uppercase(),
    }
}

type Tally = BTreeMap<String, usize>;

/// One kind of request: from a pod (by name) to a destination, over one protocol.
struct Req<'a> {
    lab: &'a Lab,
    from: &'a str,
    proto: Proto,
    dst: SocketAddr,
}

fn tcp<'a>(lab: &'a Lab, from: &'a str, dst: &str) -> Req<'a> {
    Req {
        lab,
        from,
        proto: Proto::Tcp,
        dst: sa(dst),
    }
}

fn udp<'a>(lab: &'a Lab, from: &'a str, dst: &str) -> Req<'a> {
    Req {
        proto: Proto::Udp,
        ..tcp(lab, from, dst)
    }
}

impl Req<'_> {
    fn describe(&self) -> String {
        format!("{} -> {} {}", self.from, self.proto, self.dst)
    }

    /// Pod-to-ClusterIP traffic is never masqueraded: the endpoint sees the client's address.
    /// (Its port may differ: when a new connection's tuple after DNAT clashes with an earlier
    /// one's, conntrack picks another source port, as it would for kube-proxy.)
    fn check_source(&self, r: &ProbeResult, what: &str) {
        if let (Some(seen), Some(client)) = (r.source(), r.client()) {
            assert!(
                client.ip().is_unspecified() || seen.ip() == client.ip(),
                "{what}: {}: the endpoint saw source {seen}, not the client's {client}: {r}",
                self.describe()
            );
        }
    }

    /// `n` new connections (TCP) or datagrams from new sockets (UDP), counted by outcome.
    async fn tally(&self, n: usize, what: &str) -> Tally {
        let mut t = Tally::new();
        for r in self
            .lab
            .probe_n(self.from, self.proto, self.dst, n, TIMEOUT)
            .await
        {
            self.check_source(&r, what);
            *t.entry(key(&r)).or_default() += 1;
        }
        t
    }

    /// Every one of `n` new connections is answered by `only`.
    async fn only(&self, only: &str, n: usize, what: &str) {
        let t = self.tally(n, what).await;
        assert_eq!(
            t,
            Tally::from([(only.to_string(), n)]),
            "{what}: {}: all {n} must be answered by {only}",
            self.describe()
        );
    }

    /// Only answers from `want`, each of them at least once: probes one by one until all were
    /// seen (at most 30 per endpoint); any other outcome fails at once.
    async fn exactly(&self, want: &[&str], what: &str) -> Tally {
        let mut seen = Tally::new();
        for _ in 0..30 * want.len() {
            let r = self.lab.probe(self.from, self.proto, self.dst).await;
            let k = key(&r);
            assert!(
                want.contains(&k.as_str()),
                "{what}: {}: {r}; expected only {want:?} (so far {seen:?})",
                self.describe()
            );
            self.check_source(&r, what);
            *seen.entry(k).or_default() += 1;
            if want.iter().all(|w| seen.contains_key(*w)) {
                return seen;
            }
        }
        panic!(
            "{what}: {}: not every endpoint answered: {seen:?}, want {want:?}",
            self.describe()
        );
    }

    /// Rounds of `n` until a whole round satisfies `pred` (bounded by [`SETTLE`]); returns it.
    async fn converge(&self, n: usize, what: &str, pred: impl Fn(&Tally) -> bool) -> Tally {
        let start = Instant::now();
        loop {
            let t = self.tally(n, what).await;
            if pred(&t) {
                return t;
            }
            assert!(
                start.elapsed() < SETTLE,
                "{what}: {}: not as expected after {SETTLE:?}; last round: {t:?}",
                self.describe()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One datagram from source port `port`: every call with the same port is one UDP flow
    /// (one conntrack entry).
    async fn flow(&self, port: u16) -> ProbeResult {
        let r = self
            .lab
            .probe_from_port(self.from, self.proto, self.dst, port)
            .await;
        self.check_source(&r, "UDP flow");
        r
    }
}

// ---------------------------------------------------------------------------------------------
// Node rulesets, read as an operator reads them.

fn nft_ruleset(lab: &Lab, node: usize) -> String {
    lab.cluster
        .node(node)
        .netns()
        .exec_ok(&["nft", "list", "ruleset"])
        .expect("nft list ruleset in the node's namespace")
}

/// The session affinity maps of node `node`, as `nft` lists them.
fn affinity_maps(lab: &Lab, node: usize) -> String {
    ["affinity", "nodeport-affinity"]
        .iter()
        .map(|map| {
            lab.cluster
                .node(node)
                .netns()
                .exec_ok(&["nft", "list", "map", "ip", "splitproxy", map])
                .unwrap_or_else(|e| format!("{map}: {e:#}"))
        })
        .collect()
}

/// Whether the ruleset text names address `addr` (as a whole address, not a prefix of one).
fn mentions(text: &str, addr: &str) -> bool {
    text.split(|c: char| !(c.is_ascii_hexdigit() || c == '.' || c == ':'))
        .any(|t| t == addr)
}

/// The UDP conntrack entries of node `node`, for failure messages.
fn conntrack_udp(lab: &Lab, node: usize) -> String {
    match lab
        .cluster
        .node(node)
        .netns()
        .exec(&["conntrack", "-L", "-p", "udp"])
    {
        Ok(out) => format!(
            "conntrack -L -p udp on node-{node}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => format!("conntrack -L failed: {e:#}"),
    }
}

// ---------------------------------------------------------------------------------------------
// SCTP without SCTP sockets. The lab's pod servers answer TCP and UDP only, and the kernel may
// have no SCTP stack at all (CONFIG_IP_SCTP); conntrack and NAT handle SCTP without it (and
// raw sockets need no protocol module). So the
// client sends SCTP INIT packets on a raw socket, and each endpoint pod captures SCTP packets
// on a raw socket of its own: where they arrived (after DNAT) and whom they came from.

/// CRC32c (Castagnoli), SCTP's checksum: conntrack checks it on packets that enter a node
/// (net.netfilter.nf_conntrack_checksum), and an invalid packet is not NATed.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// An SCTP packet holding one INIT chunk.
fn sctp_init(sport: u16, dport: u16, tag: u32) -> Vec<u8> {
    let mut p = Vec::with_capacity(32);
    p.extend(sport.to_be_bytes());
    p.extend(dport.to_be_bytes());
    p.extend(0u32.to_be_bytes()); // verification tag: 0 in an INIT
    p.extend(0u32.to_be_bytes()); // checksum, below
    p.extend([1u8, 0]); // INIT, no flags
    p.extend(20u16.to_be_bytes()); // chunk length
    p.extend(tag.to_be_bytes()); // initiate tag
    p.extend(65535u32.to_be_bytes()); // a_rwnd
    p.extend(1u16.to_be_bytes()); // outbound streams
    p.extend(1u16.to_be_bytes()); // inbound streams
    p.extend(tag.to_be_bytes()); // initial TSN
    let crc = crc32c(&p);
    p[8..12].copy_from_slice(&crc.to_le_bytes()); // SCTP stores its CRC32c little-endian
    p
}

fn raw_sctp_socket(ns: &Netns) -> OwnedFd {
    ns.run(|| {
        socket(
            AddressFamily::Inet,
            SockType::Raw,
            SockFlag::SOCK_NONBLOCK,
            SockProtocol::Sctp,
        )
    })
    .expect("entering the namespace")
    .expect("raw SCTP socket")
}

/// (source, destination) of every SCTP packet queued on raw socket `fd`.
fn drain_sctp(fd: &OwnedFd) -> Vec<(SocketAddr, SocketAddr)> {
    let mut out = Vec::new();
    let mut buf = [0u8; 2048];
    for _ in 0..1000 {
        let n = match recv(fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
            Ok(n) => n,
            Err(Errno::EAGAIN) => break,
            Err(e) => panic!("reading the raw SCTP socket: {e}"),
        };
        let ihl = usize::from(buf[0] & 0xf) * 4;
        if n < ihl + 4 {
            continue;
        }
        let addr = |at: usize| Ipv4Addr::new(buf[at], buf[at + 1], buf[at + 2], buf[at + 3]);
        let port = |at: usize| u16::from_be_bytes([buf[at], buf[at + 1]]);
        out.push((
            SocketAddr::new(addr(12).into(), port(ihl)),
            SocketAddr::new(addr(16).into(), port(ihl + 2)),
        ));
    }
    out
}

/// Whether the kernel has its SCTP stack (loaded or built in). Only looked up: creating an
/// SCTP socket to find out could load a kernel module, which is the host's business.
fn kernel_has_sctp() -> bool {
    std::path::Path::new("/sys/module/sctp").exists()
}

// =============================================================================================
// Lab 1: the lab of scenario `clusterip-semantics`.

/// The lab and objects of scenario `tests/lab/scenarios/clusterip-semantics`, whose probes
/// (replayed by `e2e_lab_scenario`) check named ports, endpoints over three slices, endpoint
/// conditions, refusals and drops, ignored Services and dual stack. Here what probes cannot
/// show: SCTP DNAT to named ports, one DNAT slot per distinct endpoint, no rules at all for the
/// ignored Services, and no update refused by a kernel.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clusterip_scenario_sctp_dnat_slots_and_ignored_services() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("lab/scenarios/clusterip-semantics");
    let scenario = Scenario::load(&dir).expect("scenario loads");
    let opts = scenario.lab_options(LabOptions::new(exe())).unwrap();
    let lab = Lab::start(opts).await.expect("lab starts");
    lab.apply_scenario(&scenario)
        .await
        .expect("scenario applies");
    if let Err(e) = wait_applied(&lab).await {
        panic!(
            "the nodes did not all apply the scenario: {e}\n{}",
            logs(&lab)
        );
    }
    sctp_named_port(&lab).await;
    one_dnat_slot_per_distinct_endpoint(&lab);
    ignored_services_have_no_rules(&lab);
    assert_no_apply_errors(&lab, "clusterip-semantics");
}

/// SCTP 9999 -> "sctp": 7777 on multi-a, 7778 on multi-b, each slice listing its ports in another
/// order (Service `multi` of the scenario's `10-named-ports.yaml`).
async fn sctp_named_port(lab: &Lab) {
    let client = lab.pod("client-a").expect("client-a");
    if !kernel_has_sctp() {
        eprintln!(
            "note: no SCTP stack in this kernel (no /sys/module/sctp): the SCTP DNAT is checked \
             with raw INIT packets captured in the endpoint pods, which needs none"
        );
    }
    let receivers: Vec<(&str, SocketAddr, OwnedFd)> = [
        ("multi-a", "10.244.0.20:7777"),
        ("multi-b", "10.244.1.20:7778"),
    ]
    .into_iter()
    .map(|(p, want)| {
        let pod = lab.pod(p).expect("endpoint pod");
        (p, sa(want), raw_sctp_socket(pod.netns()))
    })
    .collect();
    let sender = raw_sctp_socket(client.netns());
    let to = SockaddrIn::from(SocketAddrV4::new(Ipv4Addr::new(10, 96, 20, 10), 0));
    let sports: BTreeSet<u16> = (42000..42024).collect();
    for &sport in &sports {
        let pkt = sctp_init(sport, 9999, 0x1000 + u32::from(sport));
        sendto(sender.as_raw_fd(), &pkt, &to, MsgFlags::empty()).expect("sending an SCTP INIT");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen: BTreeMap<&str, Vec<(SocketAddr, SocketAddr)>> = receivers
        .iter()
        .map(|(pod, _, fd)| (*pod, drain_sctp(fd)))
        .collect();
    let client_ip: IpAddr = "10.244.0.200".parse().unwrap();
    let mut arrived = BTreeSet::new();
    for (pod, want, _) in &receivers {
        for (src, dst) in &seen[pod] {
            assert_eq!(
                dst, want,
                "SCTP to 10.96.20.10:9999 arrived at {pod} on {dst}, not on its sctp port: {seen:?}"
            );
            assert_eq!(src.ip(), client_ip, "SCTP source seen by {pod}: {seen:?}");
            assert!(
                arrived.insert(src.port()),
                "an INIT arrived twice: {seen:?}"
            );
        }
    }
    assert_eq!(
        arrived, sports,
        "every SCTP INIT to 10.96.20.10:9999 reaches exactly one endpoint: {seen:?}"
    );
    assert!(
        seen.values().all(|p| !p.is_empty()),
        "24 SCTP associations use both endpoints: {seen:?}"
    );
}

/// Service `spread` has four distinct endpoints over three slices, one of them (spread-b) in two
/// slices: the duplicate has one DNAT slot, not two.
fn one_dnat_slot_per_distinct_endpoint(lab: &Lab) {
    for node in 0..2 {
        let rs = nft_ruleset(lab, node);
        let slots: Vec<&str> = rs
            .lines()
            .flat_map(|l| l.split(','))
            .filter(|e| e.contains("10.96.20.20 . tcp . 80 . ") && e.contains(" : "))
            .map(str::trim)
            .collect();
        assert_eq!(
            slots.len(),
            4,
            "node-{node}: 10.96.20.20:80 has 4 distinct endpoints, hence 4 DNAT slots: {slots:?}"
        );
    }
}

/// Headless and ExternalName Services, and Services labelled for another proxy, get no rules:
/// their endpoints (which exist and answer directly) and the other proxy's ClusterIP appear in
/// no node's table.
fn ignored_services_have_no_rules(lab: &Lab) {
    for node in 0..2 {
        let rs = nft_ruleset(lab, node);
        assert!(
            mentions(&rs, "10.96.20.10"),
            "node-{node}: the table names ClusterIPs:\n{rs}"
        );
        for addr in ["10.244.0.40", "10.244.0.41", "10.244.0.42", "10.96.20.40"] {
            assert!(
                !mentions(&rs, addr),
                "node-{node}: {addr} belongs to a headless, ExternalName or other-proxy Service \
                 and must not appear in the table:\n{rs}"
            );
        }
    }
}

// =============================================================================================
// Lab 2: node-0 in zone-a, node-1 and node-2 in zone-b; client-<i> on node-<i>. Steps and
// timing: ClientIP affinity as endpoints go and through a masquerade, UDP flows through
// conntrack. (internalTrafficPolicy and topology are scenario `traffic-policy-and-topology`.)

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_affinity_and_udp_conntrack() {
    let lab = lab_with(
        vec![
            NodeSpec::new("node-0").zone("zone-a"),
            NodeSpec::new("node-1").zone("zone-b"),
            NodeSpec::new("node-2").zone("zone-b"),
        ],
        &[("client-0", 0), ("client-1", 1), ("client-2", 2)],
    )
    .await;
    let started = Instant::now();
    session_affinity(&lab).await;
    session_affinity_when_masqueraded(&lab).await;
    udp_flow_follows_endpoint_removal(&lab).await;
    udp_flow_refused_then_answered(&lab).await;
    assert_no_apply_errors(&lab, "lab 2");
    eprintln!("lab 2: sections took {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// Topology objects of the regression test below.

/// Endpoint `<pod>-<i>` at 10.244.<i>.<octet> on node-<i>, in that node's zone (zone-a for
/// node-0, zone-b otherwise), hinted for that zone (`zone`) and for that node (`node`).
fn hinted(pod: &str, i: usize, octet: u8, zone: bool, node: bool) -> Value {
    let z = if i == 0 { "zone-a" } else { "zone-b" };
    let n = format!("node-{i}");
    let zones: Vec<&str> = Some(z).filter(|_| zone).into_iter().collect();
    let nodes: Vec<&str> = Some(n.as_str()).filter(|_| node).into_iter().collect();
    let ip = format!("10.244.{i}.{octet}");
    ep_hints(&ip, &n, &format!("{pod}-{i}"), z, &zones, &nodes)
}

/// The slice of Service `topo` (PreferClose): one endpoint per node with zone hints, but the
/// one on node-2 has none unless `all_hinted`.
fn topo_slice(all_hinted: bool) -> Value {
    let eps = vec![
        hinted("topo", 0, 61, true, false),
        hinted("topo", 1, 61, true, false),
        hinted("topo", 2, 61, all_hinted, false),
    ];
    slice("topo-1", "topo", &[("http", "TCP", 8080)], eps)
}

/// The slice of Service `near` (PreferSameNode): endpoints with node and zone hints on node-0,
/// node-1 and, if `on_node_2`, node-2.
fn near_slice(on_node_2: bool) -> Value {
    let mut eps = vec![
        hinted("near", 0, 62, true, true),
        hinted("near", 1, 62, true, true),
    ];
    if on_node_2 {
        eps.push(hinted("near", 2, 62, true, true));
    }
    slice("near-1", "near", &[("http", "TCP", 8080)], eps)
}

/// Services `topo` (10.96.21.20, PreferClose) and `near` (10.96.21.21, PreferSameNode) with
/// every endpoint hinted.
fn topology_objects() -> Vec<Value> {
    let web = [("http", "TCP", 80)];
    let prefer = |mode: &str| json!({"trafficDistribution": mode});
    vec![
        cluster_ip("topo", "10.96.21.20", &web, prefer("PreferClose")),
        topo_slice(true),
        cluster_ip("near", "10.96.21.21", &web, prefer("PreferSameNode")),
        near_slice(true),
    ]
}

/// ClientIP session affinity (timeout 30 s): every new connection of a client goes to
/// one endpoint, while the same endpoints without affinity spread; when that endpoint leaves the
/// slice, the client moves to another one and sticks to it.
async fn session_affinity(lab: &Lab) {
    let web = [("http", "TCP", 80)];
    let http = [("http", "TCP", 8080)];
    let eps = [
        ("10.244.0.63", "node-0", "aff-0"),
        ("10.244.1.63", "node-1", "aff-1"),
        ("10.244.2.63", "node-2", "aff-2"),
    ];
    let aff = |keep: &dyn Fn(&str) -> bool| {
        let eps = eps
            .iter()
            .filter(|(ip, ..)| keep(ip))
            .map(|(ip, node, pod)| ep(ip, node, pod))
            .collect();
        slice("aff-1", "aff", &http, eps)
    };
    let affinity = json!({"sessionAffinity": "ClientIP",
                          "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}}});
    apply(
        lab,
        &[
            cluster_ip("aff", "10.96.21.30", &web, affinity),
            aff(&|_| true),
            cluster_ip("no-aff", "10.96.21.31", &web, json!({})),
            slice(
                "no-aff-1",
                "no-aff",
                &http,
                eps.iter()
                    .map(|(ip, node, pod)| ep(ip, node, pod))
                    .collect(),
            ),
        ],
    )
    .await;
    let first = tcp(lab, "client-0", "10.96.21.30:80")
        .tally(20, "affinity")
        .await;
    assert!(
        first.len() == 1 && first.keys().all(|k| k.starts_with("aff-")),
        "ClientIP affinity: 20 connections of one client, one endpoint: {first:?}"
    );
    let chosen = first.keys().next().unwrap().clone();
    let spread = tcp(lab, "client-0", "10.96.21.31:80")
        .tally(20, "no affinity")
        .await;
    assert!(
        spread.len() >= 2 && spread.keys().all(|k| k.starts_with("aff-")),
        "without affinity the same client spreads over the same endpoints: {spread:?}"
    );
    let other = tcp(lab, "client-1", "10.96.21.30:80")
        .tally(10, "affinity, another client")
        .await;
    assert_eq!(
        other.len(),
        1,
        "ClientIP affinity, another client: {other:?}"
    );

    // The chosen endpoint leaves; its pod still runs and would answer.
    apply(lab, &[aff(&|ip| !chosen.contains(&format!("@{ip}:")))]).await;
    let moved = tcp(lab, "client-0", "10.96.21.30:80")
        .converge(10, "affinity endpoint removed", |t| {
            t.len() == 1 && !t.contains_key(&chosen) && t.keys().all(|k| k.starts_with("aff-"))
        })
        .await;
    let now = moved.keys().next().unwrap().clone();
    eprintln!("affinity moved from {chosen} to {now}");
    tcp(lab, "client-0", "10.96.21.30:80")
        .only(&now, 20, "affinity to the new endpoint")
        .await;
}

/// ClientIP session affinity for connections that are masqueraded: an external client to a
/// Cluster-policy NodePort, and the node itself to the ClusterIP (a source outside the pod
/// network). Each sends 20 new connections; with three endpoints, one endpoint answering all of
/// them by chance has odds of 3 in 3^20. The affinity entry must be written for a connection
/// whether or not postrouting masquerades it (a masquerade ends the NAT hook's traversal).
async fn session_affinity_when_masqueraded(lab: &Lab) {
    let http = [("http", "TCP", 8080)];
    let eps = [
        ("10.244.0.63", "node-0", "aff-0"),
        ("10.244.1.63", "node-1", "aff-1"),
        ("10.244.2.63", "node-2", "aff-2"),
    ];
    let spec = json!({"type": "NodePort", "externalTrafficPolicy": "Cluster",
                      "ports": [{"name": "http", "protocol": "TCP", "port": 80,
                                 "targetPort": "http", "nodePort": 30033}],
                      "sessionAffinity": "ClientIP",
                      "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}}});
    apply(
        lab,
        &[
            cluster_ip("aff-np", "10.96.21.33", &[], spec),
            slice(
                "aff-np-1",
                "aff-np",
                &http,
                eps.iter()
                    .map(|(ip, node, pod)| ep(ip, node, pod))
                    .collect(),
            ),
        ],
    )
    .await;
    let node_ips: BTreeSet<IpAddr> = lab.cluster.nodes().iter().flat_map(|n| n.ips()).collect();
    let mut failures = Vec::new();
    for (from, dst, what) in [
        (
            "external",
            "192.168.77.10:30033",
            "external client -> Cluster-policy NodePort",
        ),
        ("node-0", "10.96.21.33:80", "the node itself -> ClusterIP"),
    ] {
        let mut answers = Tally::new();
        for r in lab.probe_n(from, Proto::Tcp, sa(dst), 20, TIMEOUT).await {
            if let Some(seen) = r.source() {
                assert!(
                    node_ips.contains(&seen.ip()),
                    "{what}: {from} -> {dst} must be masqueraded to a node's address: {r}"
                );
            }
            *answers.entry(key(&r)).or_default() += 1;
        }
        eprintln!("affinity through a masquerade, {what}: {answers:?}");
        if !(answers.len() == 1 && answers.keys().all(|k| k.starts_with("aff-"))) {
            failures.push(format!("{what} ({from} -> {dst}): {answers:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "ClientIP affinity through a masquerade: 20 connections of one client must reach one \
         endpoint:\n  {}\nnode-0's affinity maps:\n{}",
        failures.join("\n  "),
        affinity_maps(lab, 0)
    );
}

/// A long-lived UDP flow (one source port) keeps its endpoint through its conntrack
/// entry on the client's node; when that endpoint leaves the slice (its pod still runs and would
/// answer), the stale entry must be deleted, and the same flow is answered by the other endpoint
/// within a few seconds.
async fn udp_flow_follows_endpoint_removal(lab: &Lab) {
    const FLOW: u16 = 40053;
    let dns = [("dns", "UDP", 5353)];
    let eps = [
        ("10.244.0.64", "node-0", "udp-0"),
        ("10.244.1.64", "node-1", "udp-1"),
    ];
    let udp_slice = |keep: &dyn Fn(&str) -> bool| {
        let eps = eps
            .iter()
            .filter(|(ip, ..)| keep(ip))
            .map(|(ip, node, pod)| ep(ip, node, pod))
            .collect();
        slice("udp-1", "udp", &dns, eps)
    };
    apply(
        lab,
        &[
            cluster_ip("udp", "10.96.21.40", &[("dns", "UDP", 53)], json!({})),
            udp_slice(&|_| true),
        ],
    )
    .await;
    let flow = udp(lab, "client-2", "10.96.21.40:53");
    let r = flow.flow(FLOW).await;
    let first = key(&r);
    assert!(first.starts_with("udp-"), "UDP flow answered: {r}");
    for _ in 0..5 {
        let r = flow.flow(FLOW).await;
        assert_eq!(
            key(&r),
            first,
            "a UDP flow stays on its endpoint (conntrack): {r}"
        );
    }
    let (gone, other) = if first.starts_with("udp-0@") {
        ("10.244.0.64", "udp-1@10.244.1.64:5353")
    } else {
        ("10.244.1.64", "udp-0@10.244.0.64:5353")
    };
    let entries = udp_flow_entries(lab, 2, FLOW);
    assert!(
        entries.len() == 1 && reply_source(&entries[0]) == Some(gone),
        "node-2 tracks the flow, DNATed to {gone}: {entries:?}"
    );
    apply(lab, &[udp_slice(&|ip| ip != gone)]).await;
    let changed = Instant::now();
    loop {
        let r = flow.flow(FLOW).await;
        if key(&r) == other {
            break;
        }
        assert!(
            changed.elapsed() < CONNTRACK_CLEANUP,
            "UDP flow from port {FLOW} still gets {r} {CONNTRACK_CLEANUP:?} after its endpoint \
             {gone} left the slice (stale conntrack entry on node-2?)\n{}",
            conntrack_udp(lab, 2)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "UDP flow moved from {first} to {other} {:?} after the brain reported the change applied",
        changed.elapsed()
    );
    for _ in 0..3 {
        let r = flow.flow(FLOW).await;
        assert_eq!(key(&r), other, "the flow stays on its new endpoint: {r}");
    }
}

/// A UDP flow refused while its Service had no endpoints is answered, same source port,
/// within a few seconds of the Service getting one.
///
/// splitproxy rejects such a packet before conntrack confirms its entry, so the refusal itself
/// leaves none behind (checked below). A dataplane that forwarded it before its rules were in
/// place would have left an un-NATed entry, which keeps the flow from the DNAT (it is refused
/// again, as a packet to an unknown ClusterIP port) until deleted: the test creates that entry
/// with `conntrack -I` and expects the actuator to delete it when the Service gets its
/// endpoint.
async fn udp_flow_refused_then_answered(lab: &Lab) {
    const FLOW: u16 = 40054;
    let dns = [("dns", "UDP", 5353)];
    apply(
        lab,
        &[
            cluster_ip("udp-late", "10.96.21.41", &[("dns", "UDP", 53)], json!({})),
            slice("udp-late-1", "udp-late", &dns, vec![]),
        ],
    )
    .await;
    let flow = udp(lab, "client-2", "10.96.21.41:53");
    let r = flow.flow(FLOW).await;
    assert_eq!(
        r,
        ProbeResult::Refused,
        "UDP Service without endpoints: {r}"
    );
    let cached = udp_flow_entries(lab, 2, FLOW);
    eprintln!("conntrack entries the refused UDP flow left on node-2: {cached:?}");
    if cached.is_empty() {
        // What a packet forwarded without DNAT leaves: the reply comes from the ClusterIP.
        let insert = format!(
            "conntrack -I -p udp -s 10.244.2.200 -d 10.96.21.41 --sport {FLOW} --dport 53 \
             -r 10.96.21.41 -q 10.244.2.200 --reply-port-src 53 --reply-port-dst {FLOW} \
             -t 120 -u SEEN_REPLY"
        );
        lab.cluster
            .node(2)
            .netns()
            .exec_ok(&insert.split_whitespace().collect::<Vec<_>>())
            .expect("creating an un-NATed conntrack entry for the flow on node-2");
    }
    let entries = udp_flow_entries(lab, 2, FLOW);
    assert!(
        entries.len() == 1 && reply_source(&entries[0]) == Some("10.96.21.41"),
        "node-2 holds one un-NATed entry for the flow: {entries:?}"
    );
    // Established, the flow skips the DNAT and (as in kube-proxy, `ct state new` on every
    // check) the refusal too: it goes wherever routing sends the ClusterIP, and no pod answers.
    let r = flow.flow(FLOW).await;
    assert!(
        !matches!(r, ProbeResult::Answered { .. }),
        "with its un-NATed entry, the flow misses the DNAT (and no endpoint exists yet): {r}"
    );
    apply(
        lab,
        &[slice(
            "udp-late-1",
            "udp-late",
            &dns,
            vec![ep("10.244.0.65", "node-0", "udp-late-0")],
        )],
    )
    .await;
    let added = Instant::now();
    let want = "udp-late-0@10.244.0.65:5353";
    loop {
        let r = flow.flow(FLOW).await;
        if key(&r) == want {
            break;
        }
        assert!(
            added.elapsed() < CONNTRACK_CLEANUP,
            "UDP flow from port {FLOW} still gets {r} {CONNTRACK_CLEANUP:?} after the Service \
             got an endpoint (stale un-NATed conntrack entry on node-2?)\n{}",
            conntrack_udp(lab, 2)
        );
        // Spaced out: each refusal is an ICMP error, rate-limited per client.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "the refused UDP flow was answered {:?} after the brain reported the endpoint applied",
        added.elapsed()
    );
    let entries = udp_flow_entries(lab, 2, FLOW);
    assert!(
        entries.len() == 1 && reply_source(&entries[0]) == Some("10.244.0.65"),
        "node-2 now tracks the flow DNATed to the endpoint: {entries:?}"
    );
}

/// Node `node`'s conntrack entries of UDP flows from source port `sport`.
fn udp_flow_entries(lab: &Lab, node: usize, sport: u16) -> Vec<String> {
    let out = lab
        .cluster
        .node(node)
        .netns()
        .exec_ok(&[
            "conntrack",
            "-L",
            "-p",
            "udp",
            "--sport",
            &sport.to_string(),
        ])
        .expect("conntrack -L in the node's namespace");
    out.lines()
        .filter(|l| l.starts_with("udp"))
        .map(str::to_string)
        .collect()
}

/// The source address of an entry's reply direction: the endpoint its flow was DNATed to, or
/// the original destination when it was not.
fn reply_source(entry: &str) -> Option<&str> {
    entry
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("src="))
        .nth(1)
}

// =============================================================================================
// Regression: the two faults the topology section runs into, checked strictly.

/// When a Service's endpoints stop carrying hints for all (one endpoint loses its zone hint),
/// every node must apply the change as a delta, and the brain must then report every node in
/// sync, also after a change that touches only another node's rules.
///
/// Guards two fixed bugs: the brain's delta moves the Service's DNAT slots from the node's own
/// part (its topology choice) to the shared part, and the actuator, joining the parts, once
/// deleted a slot whose endpoint changes twice (the transaction was refused); and ListNodes once
/// reported nodes untouched by the latest change out of sync for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn topology_fallback_applies_as_a_delta_and_reports_in_sync() {
    let lab = lab_with(
        vec![
            NodeSpec::new("node-0").zone("zone-a"),
            NodeSpec::new("node-1").zone("zone-b"),
            NodeSpec::new("node-2").zone("zone-b"),
        ],
        &[("client-1", 1)],
    )
    .await;
    apply(&lab, &topology_objects()).await;
    assert_no_apply_errors(&lab, "every endpoint hinted");
    let mut failures = Vec::new();

    // Only node-2's choice for `near` changes (near-2 goes, node-2 falls back to zone-b).
    lab.apply_yaml(&to_yaml(&[near_slice(false)]))
        .await
        .unwrap();
    if let Err(e) = lab.wait_synced(Duration::from_secs(5)).await {
        let nodes = lab
            .operator_client(0)
            .await
            .unwrap()
            .list_nodes(ListNodesRequest {})
            .await
            .unwrap()
            .into_inner();
        failures.push(format!(
            "after a change to node-2's rules only, ListNodes: {e:#}\n{:#?}",
            nodes.nodes
        ));
        wait_applied(&lab).await.unwrap();
    }

    // node-1 and node-2 change from {topo-1, topo-2} to all three endpoints.
    lab.apply_yaml(&to_yaml(&[topo_slice(false)]))
        .await
        .unwrap();
    wait_applied(&lab).await.unwrap();
    for (i, a) in lab.actuators.iter().enumerate() {
        let m = lab.actuator_metrics(i).unwrap();
        let errors = metric(&m, "splitproxy_actuator_apply_errors_total");
        if errors != Some(0.0) {
            failures.push(format!(
                "one endpoint of topo lost its hint: node {} failed {errors:?} updates:\n{}",
                a.node,
                a.log_tail(3)
            ));
        }
    }
    tcp(&lab, "client-1", "10.96.21.20:80")
        .exactly(
            &[
                "topo-0@10.244.0.61:8080",
                "topo-1@10.244.1.61:8080",
                "topo-2@10.244.2.61:8080",
            ],
            "after the brain reports the change applied",
        )
        .await;
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
