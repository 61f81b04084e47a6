//! In-cluster Service semantics end to end, checked the way an operator checks a Service by
//! hand: real packets from client pods to ClusterIPs, asserting which endpoint (pod, ip:port)
//! answered, which source it saw, and whether a connection was refused or dropped.
//! kube-proxy's nftables mode is the reference.
//!
//! Two labs, run in parallel, each a sequence of sections that apply their own Services:
//! - [`ports_slices_conditions_ignored_and_dual_stack`] (2 nodes): named target ports over
//!   TCP, UDP and SCTP; endpoints spread over three slices; ready / serving+terminating /
//!   not-serving endpoints; refusals and drops; headless, ExternalName and other-proxy
//!   Services; dual-stack and IPv6-only Services.
//! - [`traffic_policy_topology_affinity_and_udp_conntrack`] (3 nodes in two zones):
//!   internalTrafficPolicy Local, topology hints (zones, nodes, fallback), ClientIP session
//!   affinity, and UDP flows that must follow endpoint changes (conntrack cleanup).
//!
//! [`topology_fallback_applies_as_a_delta_and_reports_in_sync`] (ignored until fixed) checks
//! strictly the two faults the topology section runs into (see its documentation).
//!
//! An answer is written `pod@ip:port`: the pod that answered and the endpoint address the
//! connection arrived on, after DNAT.
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{
    AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, SockaddrIn, recv, sendto, socket,
};
use serde_json::{Value, json};
use splitproxy_proto::family::IpFamily;
use splitproxy_proto::v1::{ListNodesRequest, NodeStatus};
use splitproxy_tests::deploy::metric;
use splitproxy_tests::lab::{Lab, LabOptions, NodeSpec, PodSpec};
use splitproxy_tests::{Netns, ProbeResult, Proto};

const NS: &str = "internal";
/// Per probe, when an answer or a refusal is expected.
const TIMEOUT: Duration = Duration::from_millis(1500);
/// Per probe, when a drop is expected: nothing may come back in this long.
const DROP_TIMEOUT: Duration = Duration::from_millis(1000);
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

/// A selectorless Service: `labels` go to its metadata.
fn service(name: &str, labels: Value, spec: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": spec,
    })
}

/// Service ports (name, protocol, port), each targeting the named port of its own name.
fn ports(list: &[(&str, &str, u16)]) -> Value {
    list.iter()
        .map(|(name, proto, port)| {
            json!({"name": name, "protocol": proto, "port": port, "targetPort": name})
        })
        .collect()
}

/// A single-stack IPv4 ClusterIP Service; `extra` is merged into its spec.
fn cluster_ip(name: &str, ip: &str, p: &[(&str, &str, u16)], extra: Value) -> Value {
    let mut spec = json!({"clusterIP": ip, "clusterIPs": [ip], "ports": ports(p)});
    if let (Value::Object(s), Value::Object(e)) = (&mut spec, extra) {
        s.extend(e);
    }
    service(name, json!({}), spec)
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

/// [`ep`] with other conditions.
fn ep_cond(ip: &str, node: &str, pod: &str, ready: bool, serving: bool, term: bool) -> Value {
    let mut e = ep(ip, node, pod);
    e["conditions"] = json!({"ready": ready, "serving": serving, "terminating": term});
    e
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

/// An EndpointSlice of Service `svc` with ports (name, protocol, port).
fn slice(
    name: &str,
    svc: &str,
    family: IpFamily,
    p: &[(&str, &str, u16)],
    eps: Vec<Value>,
) -> Value {
    let ports: Vec<Value> = p
        .iter()
        .map(|(n, proto, port)| json!({"name": n, "protocol": proto, "port": port}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS,
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": match family { IpFamily::V4 => "IPv4", IpFamily::V6 => "IPv6" },
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

    /// Refused, and at once: a reject, not a timeout. (UDP refusals are ICMP errors, which the
    /// kernel rate-limits per client; keep them few.)
    async fn refused(&self, what: &str) {
        let start = Instant::now();
        let r = self
            .lab
            .probe_n(self.from, self.proto, self.dst, 1, Duration::from_secs(3))
            .await
            .pop()
            .expect("one probe");
        let took = start.elapsed();
        assert_eq!(
            r,
            ProbeResult::Refused,
            "{what}: {} must be REFUSED, got {r}",
            self.describe()
        );
        assert!(
            took < Duration::from_millis(500),
            "{what}: {} refused only after {took:?}, not at once",
            self.describe()
        );
    }

    /// Nothing comes back, twice: no answer, no refusal.
    async fn dropped(&self, what: &str) {
        for r in self
            .lab
            .probe_n(self.from, self.proto, self.dst, 2, DROP_TIMEOUT)
            .await
        {
            assert_eq!(
                r,
                ProbeResult::TimedOut,
                "{what}: {} must be DROPPED, got {r}",
                self.describe()
            );
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
// Lab 1: node-0 and node-1, a client pod on each.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ports_slices_conditions_ignored_and_dual_stack() {
    let lab = lab_with(
        vec![NodeSpec::new("node-0"), NodeSpec::new("node-1")],
        &[("client-a", 0), ("client-b", 1)],
    )
    .await;
    let started = Instant::now();
    named_ports(&lab).await;
    sctp_named_port(&lab).await;
    endpoints_over_three_slices(&lab).await;
    endpoint_conditions_refusals_and_drops(&lab).await;
    ignored_services(&lab).await;
    dual_stack(&lab).await;
    assert_no_apply_errors(&lab, "lab 1");
    eprintln!("lab 1: sections took {:?}", started.elapsed());
}

/// Section 1: A multi-port Service with named target ports. The two pods name different port
/// numbers (as during a rolling update that moves a named port): each Service port reaches, on each
/// endpoint, the port its slice gives that name. Wrong protocol or unknown port: refused.
async fn named_ports(lab: &Lab) {
    apply(
        lab,
        &[
            cluster_ip(
                "multi",
                "10.96.20.10",
                &[
                    ("http", "TCP", 80),
                    ("admin", "TCP", 81),
                    ("dns", "UDP", 53),
                    ("sctp", "SCTP", 9999),
                ],
                json!({}),
            ),
            slice(
                "multi-1",
                "multi",
                IpFamily::V4,
                &[
                    ("http", "TCP", 8080),
                    ("admin", "TCP", 9090),
                    ("dns", "UDP", 5353),
                    ("sctp", "SCTP", 7777),
                ],
                vec![ep("10.244.0.20", "node-0", "multi-a")],
            ),
            slice(
                "multi-2",
                "multi",
                IpFamily::V4,
                &[
                    ("sctp", "SCTP", 7778),
                    ("dns", "UDP", 5354),
                    ("admin", "TCP", 9091),
                    ("http", "TCP", 8081),
                ],
                vec![ep("10.244.1.20", "node-1", "multi-b")],
            ),
        ],
    )
    .await;
    for client in ["client-a", "client-b"] {
        tcp(lab, client, "10.96.20.10:80")
            .exactly(
                &["multi-a@10.244.0.20:8080", "multi-b@10.244.1.20:8081"],
                "TCP 80 -> http",
            )
            .await;
        tcp(lab, client, "10.96.20.10:81")
            .exactly(
                &["multi-a@10.244.0.20:9090", "multi-b@10.244.1.20:9091"],
                "TCP 81 -> admin",
            )
            .await;
        udp(lab, client, "10.96.20.10:53")
            .exactly(
                &["multi-a@10.244.0.20:5353", "multi-b@10.244.1.20:5354"],
                "UDP 53 -> dns",
            )
            .await;
    }
    tcp(lab, "client-a", "10.96.20.10:8080")
        .refused("a target port is no Service port")
        .await;
    udp(lab, "client-a", "10.96.20.10:80")
        .refused("TCP port asked over UDP")
        .await;
    tcp(lab, "client-b", "10.96.20.10:53")
        .refused("UDP port asked over TCP")
        .await;
}

/// Section 1b: SCTP 9999 -> "sctp": 7777 on multi-a, 7778 on multi-b (Service of [`named_ports`]).
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

/// Section 2: Four distinct endpoints over three slices, one of them (spread-b) in two slices:
/// every one answers, nothing else does, and the duplicate has one slot, not two.
async fn endpoints_over_three_slices(lab: &Lab) {
    let http = [("http", "TCP", 8080)];
    apply(
        lab,
        &[
            cluster_ip("spread", "10.96.20.20", &[("http", "TCP", 80)], json!({})),
            slice(
                "spread-1",
                "spread",
                IpFamily::V4,
                &http,
                vec![
                    ep("10.244.0.21", "node-0", "spread-a"),
                    ep("10.244.1.21", "node-1", "spread-b"),
                ],
            ),
            slice(
                "spread-2",
                "spread",
                IpFamily::V4,
                &http,
                vec![
                    ep("10.244.0.22", "node-0", "spread-c"),
                    ep("10.244.1.21", "node-1", "spread-b"),
                ],
            ),
            slice(
                "spread-3",
                "spread",
                IpFamily::V4,
                &http,
                vec![ep("10.244.1.22", "node-1", "spread-d")],
            ),
        ],
    )
    .await;
    let seen = tcp(lab, "client-a", "10.96.20.20:80")
        .exactly(
            &[
                "spread-a@10.244.0.21:8080",
                "spread-b@10.244.1.21:8080",
                "spread-c@10.244.0.22:8080",
                "spread-d@10.244.1.22:8080",
            ],
            "endpoints over three slices",
        )
        .await;
    eprintln!("three slices, four endpoints: {seen:?}");
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

/// Section 3: Ready endpoints get new connections; with none ready, serving+terminating ones do;
/// not-serving ones never do. Nothing usable: refused at once. Unknown port of an allocated
/// ClusterIP: refused. Unallocated address of the service CIDR: dropped.
async fn endpoint_conditions_refusals_and_drops(lab: &Lab) {
    let svc_ports = [("http", "TCP", 80), ("dns", "UDP", 53)];
    let slice_ports = [("http", "TCP", 8080), ("dns", "UDP", 5353)];
    let cond = |ready: bool, terminating: bool| {
        let mut eps = Vec::new();
        if ready {
            eps.push(ep("10.244.0.30", "node-0", "cond-ready"));
        }
        if terminating {
            eps.push(ep_cond(
                "10.244.1.30",
                "node-1",
                "cond-terminating",
                false,
                true,
                true,
            ));
        }
        // Never to get a new connection: terminating and not serving; plainly not ready.
        eps.push(ep_cond(
            "10.244.1.31",
            "node-1",
            "cond-not-serving",
            false,
            false,
            true,
        ));
        eps.push(ep_cond(
            "10.244.0.31",
            "node-0",
            "cond-not-ready",
            false,
            false,
            false,
        ));
        slice("cond-1", "cond", IpFamily::V4, &slice_ports, eps)
    };
    apply(
        lab,
        &[
            cluster_ip("cond", "10.96.20.30", &svc_ports, json!({})),
            cond(true, true),
            cluster_ip("empty", "10.96.20.31", &svc_ports, json!({})),
        ],
    )
    .await;
    let what = "ready endpoint, beside terminating and not-ready ones";
    for client in ["client-a", "client-b"] {
        tcp(lab, client, "10.96.20.30:80")
            .only("cond-ready@10.244.0.30:8080", 20, what)
            .await;
        udp(lab, client, "10.96.20.30:53")
            .only("cond-ready@10.244.0.30:5353", 10, what)
            .await;
    }

    apply(lab, &[cond(false, true)]).await;
    let what = "no ready endpoint: the serving+terminating one, never the not-serving ones";
    tcp(lab, "client-a", "10.96.20.30:80")
        .converge(10, what, |t| {
            t.len() == 1 && t.keys().all(|k| k.starts_with("cond-terminating@"))
        })
        .await;
    for client in ["client-a", "client-b"] {
        tcp(lab, client, "10.96.20.30:80")
            .only("cond-terminating@10.244.1.30:8080", 20, what)
            .await;
        udp(lab, client, "10.96.20.30:53")
            .only("cond-terminating@10.244.1.30:5353", 10, what)
            .await;
    }

    apply(lab, &[cond(false, false)]).await;
    let what = "only not-serving and not-ready endpoints";
    tcp(lab, "client-a", "10.96.20.30:80")
        .converge(4, what, |t| t.keys().all(|k| k == "REFUSED"))
        .await;
    for client in ["client-a", "client-b"] {
        tcp(lab, client, "10.96.20.30:80").refused(what).await;
        udp(lab, client, "10.96.20.30:53").refused(what).await;
    }
    let what = "Service without any slice";
    tcp(lab, "client-a", "10.96.20.31:80").refused(what).await;
    udp(lab, "client-b", "10.96.20.31:53").refused(what).await;
    let what = "unknown port of an allocated ClusterIP";
    tcp(lab, "client-b", "10.96.20.30:8443").refused(what).await;
    udp(lab, "client-a", "10.96.20.30:5353").refused(what).await;
    let what = "unallocated address of the service CIDR";
    tcp(lab, "client-a", "10.96.20.99:80").dropped(what).await;
    udp(lab, "client-b", "10.96.20.99:53").dropped(what).await;
}

/// Section 7: Headless and ExternalName Services, and Services labelled for another proxy, get no
/// rules: their endpoints (which exist and answer directly) appear in no node's table, and the
/// other proxy's ClusterIP is, for us, an unallocated service address: dropped.
async fn ignored_services(lab: &Lab) {
    let http = [("http", "TCP", 8080)];
    let web = ports(&[("http", "TCP", 80)]);
    apply(
        lab,
        &[
            service(
                "headless",
                json!({}),
                json!({"clusterIP": "None", "ports": web}),
            ),
            slice(
                "headless-1",
                "headless",
                IpFamily::V4,
                &http,
                vec![ep("10.244.0.40", "node-0", "headless-a")],
            ),
            service(
                "external-name",
                json!({}),
                json!({"type": "ExternalName", "externalName": "db.example.com"}),
            ),
            slice(
                "external-name-1",
                "external-name",
                IpFamily::V4,
                &http,
                vec![ep("10.244.0.41", "node-0", "external-name-a")],
            ),
            service(
                "other-proxy",
                json!({"service.kubernetes.io/service-proxy-name": "other"}),
                json!({"clusterIP": "10.96.20.40", "clusterIPs": ["10.96.20.40"], "ports": web}),
            ),
            slice(
                "other-proxy-1",
                "other-proxy",
                IpFamily::V4,
                &http,
                vec![ep("10.244.0.42", "node-0", "other-proxy-a")],
            ),
        ],
    )
    .await;
    for (pod, ip) in [
        ("headless-a", "10.244.0.40:8080"),
        ("external-name-a", "10.244.0.41:8080"),
        ("other-proxy-a", "10.244.0.42:8080"),
    ] {
        tcp(lab, "client-b", ip)
            .only(&format!("{pod}@{ip}"), 1, "the pod itself answers")
            .await;
    }
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
    tcp(lab, "client-a", "10.96.20.40:80")
        .dropped("ClusterIP of a Service for another proxy")
        .await;
}

/// Section 8: Dual stack: RequireDualStack (IPv4 first), PreferDualStack (IPv6 first) and
/// SingleStack IPv6 Services with IPv4 and IPv6 slices: each family's ClusterIP is answered by that
/// family's endpoints, with the client's own address of that family as source.
async fn dual_stack(lab: &Lab) {
    let web_dns = [("http", "TCP", 80), ("dns", "UDP", 53)];
    let slice_ports = [("http", "TCP", 8080), ("dns", "UDP", 5353)];
    let http = [("http", "TCP", 8080)];
    apply(
        lab,
        &[
            service(
                "dual",
                json!({}),
                json!({"ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv4", "IPv6"],
                       "clusterIP": "10.96.20.50", "clusterIPs": ["10.96.20.50", "fd00:96::2050"],
                       "ports": ports(&web_dns)}),
            ),
            slice(
                "dual-v4",
                "dual",
                IpFamily::V4,
                &slice_ports,
                vec![
                    ep("10.244.0.50", "node-0", "dual-a"),
                    ep("10.244.1.50", "node-1", "dual-b"),
                ],
            ),
            slice(
                "dual-v6",
                "dual",
                IpFamily::V6,
                &slice_ports,
                vec![
                    ep("fd00:244::50", "node-0", "dual-a"),
                    ep("fd00:244:0:1::50", "node-1", "dual-b"),
                ],
            ),
            service(
                "prefer-dual",
                json!({}),
                json!({"ipFamilyPolicy": "PreferDualStack", "ipFamilies": ["IPv6", "IPv4"],
                       "clusterIP": "fd00:96::2051", "clusterIPs": ["fd00:96::2051", "10.96.20.51"],
                       "ports": ports(&[("http", "TCP", 80)])}),
            ),
            slice(
                "prefer-dual-v6",
                "prefer-dual",
                IpFamily::V6,
                &http,
                vec![ep("fd00:244:0:1::51", "node-1", "prefer-b")],
            ),
            slice(
                "prefer-dual-v4",
                "prefer-dual",
                IpFamily::V4,
                &http,
                vec![ep("10.244.0.51", "node-0", "prefer-a")],
            ),
            service(
                "v6-only",
                json!({}),
                json!({"ipFamilyPolicy": "SingleStack", "ipFamilies": ["IPv6"],
                       "clusterIP": "fd00:96::2052", "clusterIPs": ["fd00:96::2052"],
                       "ports": ports(&web_dns)}),
            ),
            slice(
                "v6-only-1",
                "v6-only",
                IpFamily::V6,
                &slice_ports,
                vec![
                    ep("fd00:244::52", "node-0", "v6-a"),
                    ep("fd00:244:0:1::52", "node-1", "v6-b"),
                ],
            ),
        ],
    )
    .await;
    for client in ["client-a", "client-b"] {
        let what = "RequireDualStack, IPv4 ClusterIP";
        tcp(lab, client, "10.96.20.50:80")
            .exactly(
                &["dual-a@10.244.0.50:8080", "dual-b@10.244.1.50:8080"],
                what,
            )
            .await;
        udp(lab, client, "10.96.20.50:53")
            .exactly(
                &["dual-a@10.244.0.50:5353", "dual-b@10.244.1.50:5353"],
                what,
            )
            .await;
        let what = "RequireDualStack, IPv6 ClusterIP";
        tcp(lab, client, "[fd00:96::2050]:80")
            .exactly(
                &[
                    "dual-a@[fd00:244::50]:8080",
                    "dual-b@[fd00:244:0:1::50]:8080",
                ],
                what,
            )
            .await;
        udp(lab, client, "[fd00:96::2050]:53")
            .exactly(
                &[
                    "dual-a@[fd00:244::50]:5353",
                    "dual-b@[fd00:244:0:1::50]:5353",
                ],
                what,
            )
            .await;
        tcp(lab, client, "[fd00:96::2051]:80")
            .only(
                "prefer-b@[fd00:244:0:1::51]:8080",
                5,
                "PreferDualStack, IPv6 primary",
            )
            .await;
        tcp(lab, client, "10.96.20.51:80")
            .only(
                "prefer-a@10.244.0.51:8080",
                5,
                "PreferDualStack, IPv4 secondary",
            )
            .await;
        let what = "SingleStack IPv6";
        tcp(lab, client, "[fd00:96::2052]:80")
            .exactly(
                &["v6-a@[fd00:244::52]:8080", "v6-b@[fd00:244:0:1::52]:8080"],
                what,
            )
            .await;
        udp(lab, client, "[fd00:96::2052]:53")
            .exactly(
                &["v6-a@[fd00:244::52]:5353", "v6-b@[fd00:244:0:1::52]:5353"],
                what,
            )
            .await;
    }
    let r = lab
        .probe("client-b", Proto::Tcp, sa("[fd00:96::2052]:80"))
        .await;
    assert_eq!(
        r.source().map(|s| s.ip()),
        Some("fd00:244:0:1::200".parse().unwrap()),
        "the endpoint sees the client's IPv6 address: {r}"
    );
    tcp(lab, "client-a", "[fd00:96::2052]:8443")
        .refused("unknown port of an IPv6 ClusterIP")
        .await;
    udp(lab, "client-b", "[fd00:96::2050]:80")
        .refused("TCP port of an IPv6 ClusterIP asked over UDP")
        .await;
    tcp(lab, "client-a", "[fd00:96::99]:80")
        .dropped("unallocated address of the IPv6 service CIDR")
        .await;
}

// =============================================================================================
// Lab 2: node-0 in zone-a, node-1 and node-2 in zone-b; client-<i> on node-<i>.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn traffic_policy_topology_affinity_and_udp_conntrack() {
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
    internal_traffic_policy_local(&lab).await;
    session_affinity(&lab).await;
    udp_flow_follows_endpoint_removal(&lab).await;
    udp_flow_refused_then_answered(&lab).await;
    assert_no_apply_errors(&lab, "lab 2 before topology");
    // Last: the change from per-node topology choices back to one choice for all nodes is
    // not applied as a delta by nodes whose choice changes (they recover through a snapshot
    // about 2 s later); see topology_fallback_applies_as_a_delta_and_reports_in_sync.
    topology_hints(&lab).await;
    eprintln!("lab 2: sections took {:?}", started.elapsed());
}

/// Section 4: internalTrafficPolicy Local, endpoints on node-0 and node-2: a pod reaches its own
/// node's endpoint only; a pod on node-1, which has none, is dropped.
async fn internal_traffic_policy_local(lab: &Lab) {
    apply(
        lab,
        &[
            cluster_ip(
                "itp",
                "10.96.21.10",
                &[("http", "TCP", 80)],
                json!({"internalTrafficPolicy": "Local"}),
            ),
            slice(
                "itp-1",
                "itp",
                IpFamily::V4,
                &[("http", "TCP", 8080)],
                vec![
                    ep("10.244.0.60", "node-0", "itp-0"),
                    ep("10.244.2.60", "node-2", "itp-2"),
                ],
            ),
        ],
    )
    .await;
    tcp(lab, "client-0", "10.96.21.10:80")
        .only("itp-0@10.244.0.60:8080", 20, "itp Local on node-0")
        .await;
    tcp(lab, "client-2", "10.96.21.10:80")
        .only("itp-2@10.244.2.60:8080", 20, "itp Local on node-2")
        .await;
    tcp(lab, "client-1", "10.96.21.10:80")
        .dropped("itp Local on node-1, which has no endpoint")
        .await;
}

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
    slice(
        "topo-1",
        "topo",
        IpFamily::V4,
        &[("http", "TCP", 8080)],
        eps,
    )
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
    slice(
        "near-1",
        "near",
        IpFamily::V4,
        &[("http", "TCP", 8080)],
        eps,
    )
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

/// Section 5: Topology. Zone hints (PreferClose) keep a zone's traffic in the zone; one endpoint
/// without hints makes every node use every endpoint (kube-proxy's fallback). Node hints
/// (PreferSameNode, with zone hints beside them) keep traffic on the node, where zone hints alone
/// would not; a node no endpoint is hinted for falls back to its zone's hints.
async fn topology_hints(lab: &Lab) {
    apply(lab, &topology_objects()).await;
    tcp(lab, "client-0", "10.96.21.20:80")
        .only("topo-0@10.244.0.61:8080", 20, "zone hints, zone-a client")
        .await;
    for client in ["client-1", "client-2"] {
        tcp(lab, client, "10.96.21.20:80")
            .exactly(
                &["topo-1@10.244.1.61:8080", "topo-2@10.244.2.61:8080"],
                "zone hints, zone-b client",
            )
            .await;
    }
    for (i, client) in ["client-0", "client-1", "client-2"].iter().enumerate() {
        tcp(lab, client, "10.96.21.21:80")
            .only(
                &format!("near-{i}@10.244.{i}.62:8080"),
                20,
                "node hints: the node's own endpoint (zone-b has two)",
            )
            .await;
    }

    apply(lab, &[topo_slice(false), near_slice(false)]).await;
    let what = "one endpoint without hints: every endpoint, from every zone";
    tcp(lab, "client-0", "10.96.21.20:80")
        .converge(24, what, |t| t.len() == 3)
        .await;
    let all = [
        "topo-0@10.244.0.61:8080",
        "topo-1@10.244.1.61:8080",
        "topo-2@10.244.2.61:8080",
    ];
    for client in ["client-0", "client-1", "client-2"] {
        tcp(lab, client, "10.96.21.20:80").exactly(&all, what).await;
    }
    tcp(lab, "client-2", "10.96.21.21:80")
        .only(
            "near-1@10.244.1.62:8080",
            20,
            "node hints, none for node-2 any more: zone-b's hints",
        )
        .await;
}

/// Section 6: ClientIP session affinity (timeout 30 s): every new connection of a client goes to
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
        slice("aff-1", "aff", IpFamily::V4, &http, eps)
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
                IpFamily::V4,
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

/// Section 9a: A long-lived UDP flow (one source port) keeps its endpoint through its conntrack
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
        slice("udp-1", "udp", IpFamily::V4, &dns, eps)
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

/// Section 9b: A UDP flow refused while its Service had no endpoints is answered, same source port,
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
            slice("udp-late-1", "udp-late", IpFamily::V4, &dns, vec![]),
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
            IpFamily::V4,
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
