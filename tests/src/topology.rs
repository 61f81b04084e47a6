//! A small dual-stack cluster network made of namespaces: fabric, nodes, pods and external
//! clients.
//!
//! End-to-end tests need packets that take the paths they take in a real cluster: pod to
//! ClusterIP on the same or another node, external client to NodePort, node to pod. This
//! module builds that network from namespaces only, so that the actuator's nftables table on
//! each node sees real traffic while the host stays untouched:
//!
//! ```text
//!                fabric namespace: bridge br0, 192.168.77.1/24 + fd00:77::1/64
//!          +-----------------------+-----------------------+--------------------------+
//!       node-0 (eth0)           node-1 (eth0)            ...          external client (eth0)
//!     192.168.77.10/24        192.168.77.11/24                       e.g. 192.168.77.200/24
//!     fd00:77::10/64          fd00:77::11/64                              fd00:77::200/64
//!     pods 10.244.0.0/24      pods 10.244.1.0/24                     default routes via a node
//!          fd00:244::/64           fd00:244:0:1::/64
//!       |        |               |
//!     pod0     pod1            pod0    (node ends of the pods' veths: POD_INTERFACE_PREFIX + n)
//!       |        |               |
//!     pod-a    pod-b           pod-c   (eth0: IPv4 /32 and/or IPv6 /128, default via
//!                                       169.254.1.1 and fe80::1 = the node end of the veth)
//! ```
//!
//! Address plan (every IPv6 address mirrors the digits of its IPv4 twin, see [`twin6`]):
//!
//! | what | IPv4 | IPv6 |
//! |---|---|---|
//! | fabric gateway | 192.168.77.1 | fd00:77::1 |
//! | node i | 192.168.77.(10+i) | fd00:77::(10+i) |
//! | node i pod CIDR | 10.244.i.0/24 | fd00:244:0:i::/64 |
//! | cluster CIDR | 10.244.0.0/16 | fd00:244::/48 |
//! | pod 10.244.i.n | 10.244.i.n | fd00:244:0:i::n |
//! | external clients | 192.168.77.200+ | fd00:77::200+ |
//!
//! Node namespaces forward both families, route every other node's pod CIDRs via that node's
//! fabric addresses, and have default routes via the fabric so that a packet to a ClusterIP is
//! routed before nftables DNATs it, as on a real node. The fabric does not forward, so a packet
//! that nothing translated disappears there. External clients have default routes (both
//! families) via one node, as if that node were their router.
//!
//! Pods are attached in one of two ways ([`PodNetwork`]):
//!
//! - **Routed** (default, Calico's layout): the pod's addresses are a /32 and a /128, its default
//!   gateways are the link-local 169.254.1.1 and fe80::1, both resolved by permanent neighbour
//!   entries to the MAC of the node end of the veth, and the node has a host route to each pod
//!   address over that veth (with proxy ARP for anything else the pod asks for). The node ends are
//!   named [`POD_INTERFACE_PREFIX`]`<n>`, so kube-proxy's `--detect-local-mode
//!   InterfaceNamePrefix --pod-interface-name-prefix pod` recognises pod traffic.
//! - **Bridge** (kubenet's attachment): the node ends of the veths are ports of the bridge
//!   [`POD_BRIDGE`] and pod traffic reaches the node's IP layer on that bridge, so
//!   `--detect-local-mode BridgeInterface --pod-bridge-interface cbr0` applies. Pods keep /32 and
//!   /128 addresses with the bridge as their gateway, so that every packet between pods, also on
//!   the same node, is routed by the node (this stands in for `br_netfilter`, which the harness
//!   does not load because it is a host-wide module).
//!
//! Every interface is created with `ip -n <namespace>` directly in its namespace; none ever
//! exists in the host namespace. Everything is deleted when the [`Cluster`] (and every [`Pod`]
//! or [`ExternalClient`] handle cloned from it) is dropped.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{Context, bail};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::Result;
use crate::netns::Netns;

/// The fabric bridge's IPv4 address; every node's IPv4 default gateway.
pub const FABRIC_GATEWAY: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
/// The fabric bridge's IPv6 address; every node's IPv6 default gateway.
pub const FABRIC_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 1);
/// The IPv4 node network. Node i is 192.168.77.(10+i); .200 and above are left for clients.
pub const NODE_NETWORK: &str = "192.168.77.0/24";
/// The IPv6 node network. Node i is fd00:77::(10+i); ::200 and above are left for clients.
pub const NODE_NETWORK6: &str = "fd00:77::/64";
/// The IPv4 cluster (pod) CIDR; node i gets 10.244.i.0/24.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The IPv6 cluster (pod) CIDR; node i gets fd00:244:0:i::/64.
pub const CLUSTER_CIDR6: &str = "fd00:244::/48";
/// The default IPv4 Service CIDR.
pub const DEFAULT_SERVICE_CIDR: &str = "10.96.0.0/16";
/// The default IPv6 Service CIDR.
pub const DEFAULT_SERVICE_CIDR6: &str = "fd00:96::/112";
/// The pods' IPv4 default gateway (link-local, answered by the node end of the veth).
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// The pods' IPv6 default gateway (link-local, an address of the node end of the veth).
pub const POD_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// MAC of the node end of every pod veth (each veth is its own link, so they may share it), and
/// of the pod bridge in [`PodNetwork::Bridge`] mode.
const POD_GATEWAY_MAC: &str = "ee:ee:ee:ee:ee:ee";
/// The lab's pod interface prefix: the node end of pod veths is named `pod0`, `pod1`, ... in the
/// node's namespace (for `--pod-interface-name-prefix`).
pub const POD_INTERFACE_PREFIX: &str = "pod";
/// The bridge pods are attached to in [`PodNetwork::Bridge`] mode (for `--pod-bridge-interface`).
pub const POD_BRIDGE: &str = "cbr0";
/// At most this many nodes (node IPs .10 to .109).
pub const MAX_NODES: usize = 100;

/// How pods are attached to their node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PodNetwork {
    /// A routed veth per pod (node end `pod<n>`), Calico's layout.
    #[default]
    Routed,
    /// Every pod veth is a port of bridge `cbr0` on its node; pods route through the bridge.
    Bridge,
}

/// The IPv6 twin of a harness IPv4 address: 192.168.77.x becomes fd00:77::x and 10.244.a.b
/// becomes fd00:244:0:a::b (the decimal digits are reused as hexadecimal ones, so the two read
/// alike). `None` for other addresses.
pub fn twin6(ip: Ipv4Addr) -> Option<Ipv6Addr> {
    let [a, b, c, d] = ip.octets();
    let text = match (a, b) {
        (192, 168) if c == 77 => format!("fd00:77::{d}"),
        (10, 244) => format!("fd00:244:0:{c}::{d}"),
        _ => return None,
    };
    text.parse().ok()
}

/// The IPv6 pod CIDR of node `index`, fd00:244:0:index::/64.
fn pod_cidr6(index: usize) -> Result<Ipv6Net> {
    Ok(format!("fd00:244:0:{index}::/64").parse()?)
}

/// What [`Cluster::new`] builds.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// Node names (Kubernetes Node names, also the actuators' identities); node i gets
    /// 192.168.77.(10+i), fd00:77::(10+i), 10.244.i.0/24 and fd00:244:0:i::/64.
    pub node_names: Vec<String>,
    /// Service CIDRs; kept for reference (external clients route everything via their node).
    pub service_cidrs: Vec<IpNet>,
    /// How pods are attached to nodes.
    pub pod_network: PodNetwork,
}

impl ClusterSpec {
    /// `nodes` nodes named `node-0`, `node-1`, ... and the default Service CIDRs.
    pub fn new(nodes: usize) -> ClusterSpec {
        ClusterSpec::with_node_names((0..nodes).map(|i| format!("node-{i}")))
    }

    /// Nodes with the given names and the default Service CIDRs.
    pub fn with_node_names<I, S>(names: I) -> ClusterSpec
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ClusterSpec {
            node_names: names.into_iter().map(Into::into).collect(),
            service_cidrs: vec![
                DEFAULT_SERVICE_CIDR.parse().expect("constant CIDR"),
                DEFAULT_SERVICE_CIDR6.parse().expect("constant CIDR"),
            ],
            pod_network: PodNetwork::Routed,
        }
    }

    /// Replaces the Service CIDRs.
    pub fn service_cidrs(mut self, cidrs: &[IpNet]) -> ClusterSpec {
        self.service_cidrs = cidrs.to_vec();
        self
    }

    /// Chooses how pods are attached.
    pub fn pod_network(mut self, mode: PodNetwork) -> ClusterSpec {
        self.pod_network = mode;
        self
    }
}

/// A node: a namespace with one leg on the fabric and one veth per pod.
#[derive(Debug)]
pub struct Node {
    name: String,
    index: usize,
    ip: Ipv4Addr,
    ip6: Ipv6Addr,
    pod_cidr: Ipv4Net,
    pod_cidr6: Ipv6Net,
    extra: Mutex<Vec<IpNet>>,
    netns: Netns,
    next_veth: AtomicU32,
}

impl Node {
    /// The node name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Position in [`ClusterSpec::node_names`].
    pub fn index(&self) -> usize {
        self.index
    }

    /// The node's IPv4 address on the fabric, 192.168.77.(10+index).
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The node's IPv6 address on the fabric, fd00:77::(10+index).
    pub fn ip6(&self) -> Ipv6Addr {
        self.ip6
    }

    /// Every address of the node: IPv4 and IPv6 fabric addresses, then the extra ones.
    pub fn ips(&self) -> Vec<IpAddr> {
        let mut all = vec![IpAddr::V4(self.ip), IpAddr::V6(self.ip6)];
        all.extend(self.extra_addresses().iter().map(IpNet::addr));
        all
    }

    /// Addresses added with [`Cluster::add_node_address`] (with their prefix lengths).
    pub fn extra_addresses(&self) -> Vec<IpNet> {
        self.extra.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether `ip` is one of the node's addresses.
    pub fn has_ip(&self, ip: IpAddr) -> bool {
        self.ips().contains(&ip.to_canonical())
    }

    /// The node's IPv4 pod CIDR, 10.244.index.0/24.
    pub fn pod_cidr(&self) -> Ipv4Net {
        self.pod_cidr
    }

    /// The node's IPv6 pod CIDR, fd00:244:0:index::/64.
    pub fn pod_cidr6(&self) -> Ipv6Net {
        self.pod_cidr6
    }

    /// Both pod CIDRs (the Node object's `spec.podCIDRs`).
    pub fn pod_cidrs(&self) -> Vec<IpNet> {
        vec![IpNet::V4(self.pod_cidr), IpNet::V6(self.pod_cidr6)]
    }

    /// Whether `ip` is inside one of the node's pod CIDRs.
    pub fn pod_cidrs_contain(&self, ip: IpAddr) -> bool {
        match ip.to_canonical() {
            IpAddr::V4(v4) => self.pod_cidr.contains(&v4),
            IpAddr::V6(v6) => self.pod_cidr6.contains(&v6),
        }
    }

    /// The node's namespace (run the actuator and nft here).
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    fn fabric_ip_of(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(_) => IpAddr::V4(self.ip),
            IpAddr::V6(_) => IpAddr::V6(self.ip6),
        }
    }
}

impl AsRef<Netns> for Node {
    fn as_ref(&self) -> &Netns {
        &self.netns
    }
}

#[derive(Debug)]
struct PodInner {
    name: String,
    node: String,
    node_index: usize,
    ips: Mutex<Vec<IpAddr>>,
    node_veth: String,
    netns: Netns,
}

/// A pod: a namespace with one veth to its node, with an IPv4 and/or an IPv6 address. Cheap to
/// clone; the namespace is deleted when the cluster and every clone are gone (or after
/// [`Cluster::remove_pod`] and the last clone).
#[derive(Clone, Debug)]
pub struct Pod(Arc<PodInner>);

impl Pod {
    /// The pod name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The name of the node the pod runs on.
    pub fn node(&self) -> &str {
        &self.0.node
    }

    /// The index of the node the pod runs on.
    pub fn node_index(&self) -> usize {
        self.0.node_index
    }

    /// The pod's first address: its IPv4 address if it has one, else its IPv6 address.
    pub fn ip(&self) -> IpAddr {
        let ips = self.ips();
        ips.iter()
            .find(|ip| ip.is_ipv4())
            .or(ips.first())
            .copied()
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
    }

    /// The pod's IPv4 address, if any.
    pub fn ip4(&self) -> Option<Ipv4Addr> {
        self.ips().into_iter().find_map(|ip| match ip {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        })
    }

    /// The pod's IPv6 address, if any.
    pub fn ip6(&self) -> Option<Ipv6Addr> {
        self.ips().into_iter().find_map(|ip| match ip {
            IpAddr::V6(v6) => Some(v6),
            IpAddr::V4(_) => None,
        })
    }

    /// The pod's address of the same family as `other`, if any (for example the source it
    /// uses towards a Service IP).
    pub fn ip_like(&self, other: IpAddr) -> Option<IpAddr> {
        self.ips()
            .into_iter()
            .find(|ip| ip.is_ipv4() == other.to_canonical().is_ipv4())
    }

    /// Every address of the pod.
    pub fn ips(&self) -> Vec<IpAddr> {
        self.0.ips.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether `ip` is one of the pod's addresses.
    pub fn has_ip(&self, ip: IpAddr) -> bool {
        self.ips().contains(&ip.to_canonical())
    }

    /// The node end of the pod's veth (an interface in the node namespace, named
    /// [`POD_INTERFACE_PREFIX`]`<n>`).
    pub fn node_veth(&self) -> &str {
        &self.0.node_veth
    }

    /// The pod's namespace.
    pub fn netns(&self) -> &Netns {
        &self.0.netns
    }
}

impl AsRef<Netns> for Pod {
    fn as_ref(&self) -> &Netns {
        &self.0.netns
    }
}

#[derive(Debug)]
struct ExternalInner {
    name: String,
    ips: Vec<IpAddr>,
    via: usize,
    via_ip: Ipv4Addr,
    netns: Netns,
}

/// A client outside the cluster: a namespace on the fabric whose default routes (IPv4 and IPv6)
/// point to one node. Cheap to clone, like [`Pod`].
#[derive(Clone, Debug)]
pub struct ExternalClient(Arc<ExternalInner>);

impl ExternalClient {
    /// The client name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The client's first address: IPv4 if it has one.
    pub fn ip(&self) -> IpAddr {
        self.ips()
            .iter()
            .find(|ip| ip.is_ipv4())
            .or(self.0.ips.first())
            .copied()
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
    }

    /// The client's IPv4 address, if any.
    pub fn ip4(&self) -> Option<Ipv4Addr> {
        self.0.ips.iter().find_map(|ip| match ip {
            IpAddr::V4(v4) => Some(*v4),
            IpAddr::V6(_) => None,
        })
    }

    /// The client's IPv6 address, if any.
    pub fn ip6(&self) -> Option<Ipv6Addr> {
        self.0.ips.iter().find_map(|ip| match ip {
            IpAddr::V6(v6) => Some(*v6),
            IpAddr::V4(_) => None,
        })
    }

    /// The client's address of the same family as `other`, if any.
    pub fn ip_like(&self, other: IpAddr) -> Option<IpAddr> {
        self.0
            .ips
            .iter()
            .find(|ip| ip.is_ipv4() == other.to_canonical().is_ipv4())
            .copied()
    }

    /// Every address of the client.
    pub fn ips(&self) -> &[IpAddr] {
        &self.0.ips
    }

    /// Whether `ip` is one of the client's addresses.
    pub fn has_ip(&self, ip: IpAddr) -> bool {
        self.0.ips.contains(&ip.to_canonical())
    }

    /// The IPv4 address of the node its default routes point to.
    pub fn via(&self) -> Ipv4Addr {
        self.0.via_ip
    }

    /// The index of the node its default routes point to.
    pub fn via_node(&self) -> usize {
        self.0.via
    }

    /// The client's namespace.
    pub fn netns(&self) -> &Netns {
        &self.0.netns
    }
}

impl AsRef<Netns> for ExternalClient {
    fn as_ref(&self) -> &Netns {
        &self.0.netns
    }
}

#[derive(Debug, Default)]
struct Members {
    pods: Vec<Pod>,
    externals: Vec<ExternalClient>,
    used_ips: HashSet<IpAddr>,
    /// Addresses that only one node can deliver (pod addresses outside their node's pod CIDRs,
    /// extra node addresses off the fabric networks), with that node: every other node routes
    /// them via it; external clients route extra node addresses directly to their node.
    host_routes: Vec<(IpAddr, usize, bool)>,
    next_fabric_port: u32,
}

/// The whole network. Fields drop in order: pods and clients, then nodes, then the fabric.
#[derive(Debug)]
pub struct Cluster {
    members: Mutex<Members>,
    nodes: Vec<Node>,
    fabric: Netns,
    spec: ClusterSpec,
}

/// Sysctls for every namespace that holds interfaces: no IPv6 duplicate address detection (so
/// addresses are usable at once) and no redirects.
const COMMON_SYSCTLS: &[(&str, &str)] = &[
    ("net.ipv6.conf.all.disable_ipv6", "0"),
    ("net.ipv6.conf.default.disable_ipv6", "0"),
    ("net.ipv6.conf.all.accept_dad", "0"),
    ("net.ipv6.conf.default.accept_dad", "0"),
    ("net.ipv6.conf.all.accept_redirects", "0"),
    ("net.ipv6.conf.default.accept_redirects", "0"),
    ("net.ipv6.conf.all.accept_ra", "0"),
    ("net.ipv6.conf.default.accept_ra", "0"),
    ("net.ipv4.conf.all.accept_redirects", "0"),
    ("net.ipv4.conf.default.accept_redirects", "0"),
];

fn common_sysctls(ns: &Netns) -> Result<()> {
    if !ns.run(|| std::path::Path::new("/proc/sys/net/ipv6").exists())? {
        bail!("IPv6 is disabled in this kernel; the harness needs it (dual-stack topology)");
    }
    for (key, value) in COMMON_SYSCTLS {
        ns.sysctl(key, value)?;
    }
    Ok(())
}

impl Cluster {
    /// Builds the fabric and the nodes of `spec`.
    pub fn new(spec: ClusterSpec) -> Result<Cluster> {
        let count = spec.node_names.len();
        if count == 0 || count > MAX_NODES {
            bail!("a cluster needs 1 to {MAX_NODES} nodes, not {count}");
        }
        let mut seen = HashSet::new();
        for name in &spec.node_names {
            if !seen.insert(name) {
                bail!("duplicate node name {name}");
            }
        }

        let fabric = Netns::create("fabric")?;
        common_sysctls(&fabric)?;
        // The fabric is a switch, not a router: unmatched traffic ends here.
        fabric.sysctl("net.ipv4.ip_forward", "0")?;
        fabric.sysctl("net.ipv6.conf.all.forwarding", "0")?;
        // No multicast snooping: neighbour discovery must never depend on MLD state.
        fabric.ip(&[
            "link",
            "add",
            "br0",
            "type",
            "bridge",
            "mcast_snooping",
            "0",
        ])?;
        fabric.ip(&["addr", "add", &format!("{FABRIC_GATEWAY}/24"), "dev", "br0"])?;
        fabric.ip(&[
            "addr",
            "add",
            &format!("{FABRIC_GATEWAY6}/64"),
            "dev",
            "br0",
            "nodad",
        ])?;
        fabric.ip(&["link", "set", "br0", "up"])?;

        let mut members = Members::default();
        members.used_ips.insert(FABRIC_GATEWAY.into());
        members.used_ips.insert(FABRIC_GATEWAY6.into());
        let mut nodes = Vec::with_capacity(count);
        for (index, name) in spec.node_names.iter().enumerate() {
            let node = make_node(&fabric, index, name, spec.pod_network)
                .with_context(|| format!("creating node {name}"))?;
            members.used_ips.insert(node.ip.into());
            members.used_ips.insert(node.ip6.into());
            nodes.push(node);
        }
        for node in &nodes {
            let mut batch = Vec::new();
            for other in nodes.iter().filter(|o| o.index != node.index) {
                batch.push(format!(
                    "route add {} via {} dev eth0",
                    other.pod_cidr, other.ip
                ));
                batch.push(format!(
                    "route add {} via {} dev eth0",
                    other.pod_cidr6, other.ip6
                ));
            }
            node.netns.ip_batch(&batch)?;
        }
        Ok(Cluster {
            members: Mutex::new(members),
            nodes,
            fabric,
            spec,
        })
    }

    /// The spec the cluster was built from.
    pub fn spec(&self) -> &ClusterSpec {
        &self.spec
    }

    /// The fabric namespace (holds bridge `br0`, 192.168.77.1 and fd00:77::1).
    pub fn fabric(&self) -> &Netns {
        &self.fabric
    }

    /// All nodes, in spec order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Node `index`. Panics if out of range (a test bug).
    pub fn node(&self, index: usize) -> &Node {
        &self.nodes[index]
    }

    /// The node named `name`.
    pub fn node_by_name(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The node that owns address `ip` (fabric or extra address).
    pub fn node_by_ip(&self, ip: IpAddr) -> Option<&Node> {
        self.nodes.iter().find(|n| n.has_ip(ip))
    }

    /// The node whose pod CIDRs contain `ip`.
    pub fn node_for_pod_ip(&self, ip: IpAddr) -> Option<&Node> {
        self.nodes.iter().find(|n| n.pod_cidrs_contain(ip))
    }

    /// All pods currently part of the cluster.
    pub fn pods(&self) -> Vec<Pod> {
        self.lock().pods.clone()
    }

    /// The pod named `name`.
    pub fn pod(&self, name: &str) -> Option<Pod> {
        self.lock().pods.iter().find(|p| p.name() == name).cloned()
    }

    /// The pod that has address `ip`.
    pub fn pod_by_ip(&self, ip: IpAddr) -> Option<Pod> {
        self.lock().pods.iter().find(|p| p.has_ip(ip)).cloned()
    }

    /// All external clients.
    pub fn external_clients(&self) -> Vec<ExternalClient> {
        self.lock().externals.clone()
    }

    /// The external client named `name`.
    pub fn external_client(&self, name: &str) -> Option<ExternalClient> {
        self.lock()
            .externals
            .iter()
            .find(|e| e.name() == name)
            .cloned()
    }

    /// The external client that has address `ip`.
    pub fn external_client_by_ip(&self, ip: IpAddr) -> Option<ExternalClient> {
        self.lock().externals.iter().find(|e| e.has_ip(ip)).cloned()
    }

    /// Names of every namespace of the cluster (fabric, nodes, pods, clients).
    pub fn namespace_names(&self) -> Vec<String> {
        let members = self.lock();
        std::iter::once(self.fabric.name())
            .chain(self.nodes.iter().map(|n| n.netns.name()))
            .chain(members.pods.iter().map(|p| p.netns().name()))
            .chain(members.externals.iter().map(|e| e.netns().name()))
            .map(str::to_string)
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, Members> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next free IPv4 address of node `node`'s pod CIDR (skipping .1, as CNI plugins keep
    /// it for a gateway) and its IPv6 twin.
    pub fn next_pod_ips(&self, node: usize) -> Result<(Ipv4Addr, Ipv6Addr)> {
        let node_ref = self.node_checked(node)?;
        let members = self.lock();
        node_ref
            .pod_cidr
            .hosts()
            .skip(1)
            .filter_map(|ip| Some((ip, twin6(ip)?)))
            .find(|(v4, v6)| {
                !members.used_ips.contains(&IpAddr::V4(*v4))
                    && !members.used_ips.contains(&IpAddr::V6(*v6))
            })
            .with_context(|| format!("pod CIDR of {} is full", node_ref.name))
    }

    /// Adds a dual-stack pod named `name` on node `node` with the next free IPv4 address of the
    /// node's pod CIDR and its IPv6 twin (10.244.i.n and fd00:244:0:i::n).
    pub fn add_pod(&self, node: usize, name: &str) -> Result<Pod> {
        let (v4, v6) = self.next_pod_ips(node)?;
        self.add_pod_with_ips(node, name, &[v4.into(), v6.into()])
    }

    /// Adds a single-address pod named `name` on node `node` with address `ip` (IPv4 or IPv6).
    pub fn add_pod_with_ip(&self, node: usize, name: &str, ip: impl Into<IpAddr>) -> Result<Pod> {
        self.add_pod_with_ips(node, name, &[ip.into()])
    }

    /// Adds a pod named `name` on node `node` with the given addresses (at most one per family).
    /// Addresses outside the node's pod CIDRs work too: every other node gets a host route to
    /// them via this node.
    pub fn add_pod_with_ips(&self, node: usize, name: &str, ips: &[IpAddr]) -> Result<Pod> {
        let node = self.node_checked(node)?;
        let ips: Vec<IpAddr> = ips.iter().map(|ip| ip.to_canonical()).collect();
        if ips.is_empty() {
            bail!("pod {name} needs at least one address");
        }
        if ips.iter().filter(|ip| ip.is_ipv4()).count() > 1
            || ips.iter().filter(|ip| ip.is_ipv6()).count() > 1
        {
            bail!("pod {name}: at most one address per family, not {ips:?}");
        }
        {
            let mut members = self.lock();
            if members.pods.iter().any(|p| p.name() == name) {
                bail!("a pod named {name} exists already");
            }
            for (i, ip) in ips.iter().enumerate() {
                if !members.used_ips.insert(*ip) {
                    for taken in &ips[..i] {
                        members.used_ips.remove(taken);
                    }
                    bail!("address {ip} is in use already");
                }
            }
        }
        let made = make_pod(node, self.spec.pod_network, name, &ips)
            .and_then(|pod| self.route_off_cidr(node, &ips).map(|()| pod));
        let mut members = self.lock();
        match made {
            Ok(pod) => {
                members.pods.push(pod.clone());
                Ok(pod)
            }
            Err(err) => {
                for ip in &ips {
                    members.used_ips.remove(ip);
                }
                Err(err.context(format!("creating pod {name} on {}", node.name)))
            }
        }
    }

    /// Adds address `ip` to pod `name` (for example its IPv6 address, when an IPv6
    /// EndpointSlice names a pod that an IPv4 slice created).
    pub fn add_pod_address(&self, name: &str, ip: IpAddr) -> Result<Pod> {
        let ip = ip.to_canonical();
        let pod = self.pod(name).with_context(|| format!("no pod {name}"))?;
        if pod.has_ip(ip) {
            return Ok(pod);
        }
        if pod.ips().iter().any(|have| have.is_ipv4() == ip.is_ipv4()) {
            bail!("pod {name} already has an address of the family of {ip}");
        }
        if !self.lock().used_ips.insert(ip) {
            bail!("address {ip} is in use already");
        }
        let node = self.node_checked(pod.node_index())?;
        let result = add_pod_ip(node, self.spec.pod_network, &pod, ip)
            .and_then(|()| self.route_off_cidr(node, &[ip]));
        if let Err(err) = result {
            self.lock().used_ips.remove(&ip);
            return Err(err.context(format!("adding {ip} to pod {name}")));
        }
        pod.0.ips.lock().unwrap_or_else(|p| p.into_inner()).push(ip);
        Ok(pod)
    }

    /// Host routes on every other node for pod addresses outside `node`'s pod CIDRs.
    fn route_off_cidr(&self, node: &Node, ips: &[IpAddr]) -> Result<()> {
        for ip in ips.iter().filter(|ip| !node.pod_cidrs_contain(**ip)) {
            self.add_host_route(*ip, node.index, false)?;
        }
        Ok(())
    }

    fn add_host_route(&self, ip: IpAddr, owner: usize, for_externals: bool) -> Result<()> {
        let owner_node = self.node_checked(owner)?;
        let (cidr, flag) = host_net(ip);
        let via = owner_node.fabric_ip_of(ip);
        for other in self.nodes.iter().filter(|n| n.index != owner) {
            other
                .netns
                .ip(&[flag, "route", "replace", &cidr, "via", &via.to_string()])?;
        }
        let mut members = self.lock();
        if for_externals {
            for client in &members.externals {
                client
                    .netns()
                    .ip(&[flag, "route", "replace", &cidr, "via", &via.to_string()])?;
            }
        }
        members.host_routes.push((ip, owner, for_externals));
        Ok(())
    }

    /// Removes a pod from the cluster; its namespace goes when the last handle is dropped.
    pub fn remove_pod(&self, name: &str) -> Option<Pod> {
        let mut members = self.lock();
        let index = members.pods.iter().position(|p| p.name() == name)?;
        let pod = members.pods.remove(index);
        for ip in pod.ips() {
            members.used_ips.remove(&ip);
        }
        Some(pod)
    }

    /// Adds an address to node `node`'s fabric interface (and so to its Node object, when the
    /// lab writes one). An address without a prefix length inside the fabric networks gets
    /// their prefix (/24, /64) and is on-link for every fabric member; any other address is
    /// routed to the node by every other node and every external client.
    pub fn add_node_address(&self, node: usize, addr: IpNet) -> Result<()> {
        let node_ref = self.node_checked(node)?;
        let ip = addr.addr().to_canonical();
        let fabric4: Ipv4Net = NODE_NETWORK.parse()?;
        let fabric6: Ipv6Net = NODE_NETWORK6.parse()?;
        let on_fabric = match ip {
            IpAddr::V4(v4) => fabric4.contains(&v4),
            IpAddr::V6(v6) => fabric6.contains(&v6),
        };
        let with_prefix = if on_fabric && addr.prefix_len() == addr.max_prefix_len() {
            match ip {
                IpAddr::V4(_) => IpNet::new(ip, fabric4.prefix_len())?,
                IpAddr::V6(_) => IpNet::new(ip, fabric6.prefix_len())?,
            }
        } else {
            addr
        };
        if !self.lock().used_ips.insert(ip) {
            bail!("address {ip} is in use already");
        }
        let added = node_ref.netns.ip(&[
            "addr",
            "add",
            &with_prefix.to_string(),
            "dev",
            "eth0",
            "nodad",
        ]);
        if let Err(err) = added {
            self.lock().used_ips.remove(&ip);
            return Err(err);
        }
        node_ref
            .extra
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(with_prefix);
        if !on_fabric {
            self.add_host_route(ip, node, true)?;
        }
        Ok(())
    }

    /// Adds an external client at `ip` (a host address of 192.168.77.0/24, e.g. 192.168.77.200)
    /// and its IPv6 twin (fd00:77::200), with default routes via node 0.
    pub fn add_external_client(&self, name: &str, ip: Ipv4Addr) -> Result<ExternalClient> {
        self.add_external_client_via(name, ip, 0)
    }

    /// Like [`Cluster::add_external_client`], routing through node `via`.
    pub fn add_external_client_via(
        &self,
        name: &str,
        ip: Ipv4Addr,
        via: usize,
    ) -> Result<ExternalClient> {
        let mut ips = vec![IpAddr::V4(ip)];
        ips.extend(twin6(ip).map(IpAddr::V6));
        self.add_external_client_with(name, &ips, via)
    }

    /// Adds an external client with the given fabric addresses (at most one per family, inside
    /// 192.168.77.0/24 and fd00:77::/64), with default routes via node `via`.
    pub fn add_external_client_with(
        &self,
        name: &str,
        ips: &[IpAddr],
        via: usize,
    ) -> Result<ExternalClient> {
        let via_node = self.node_checked(via)?;
        let network: Ipv4Net = NODE_NETWORK.parse()?;
        let network6: Ipv6Net = NODE_NETWORK6.parse()?;
        let ips: Vec<IpAddr> = ips.iter().map(|ip| ip.to_canonical()).collect();
        if ips.is_empty()
            || ips.iter().filter(|ip| ip.is_ipv4()).count() > 1
            || ips.iter().filter(|ip| ip.is_ipv6()).count() > 1
        {
            bail!("external client {name}: one or two addresses, one per family, not {ips:?}");
        }
        for ip in &ips {
            let ok = match ip {
                IpAddr::V4(v4) => {
                    network.contains(v4) && *v4 != network.network() && *v4 != network.broadcast()
                }
                IpAddr::V6(v6) => network6.contains(v6) && *v6 != network6.network(),
            };
            if !ok {
                bail!(
                    "external client address {ip} must be a host address of {NODE_NETWORK} or {NODE_NETWORK6}"
                );
            }
        }
        let (port, host_routes) = {
            let mut members = self.lock();
            if members.externals.iter().any(|e| e.name() == name) {
                bail!("an external client named {name} exists already");
            }
            for (i, ip) in ips.iter().enumerate() {
                if !members.used_ips.insert(*ip) {
                    for taken in &ips[..i] {
                        members.used_ips.remove(taken);
                    }
                    bail!("address {ip} is in use already");
                }
            }
            members.next_fabric_port += 1;
            let routes: Vec<(IpAddr, IpAddr)> = members
                .host_routes
                .iter()
                .filter(|(_, _, for_externals)| *for_externals)
                .map(|(ip, owner, _)| (*ip, self.nodes[*owner].fabric_ip_of(*ip)))
                .collect();
            (format!("x{}", members.next_fabric_port), routes)
        };
        let made =
            make_external(&self.fabric, &port, name, &ips, via_node, &host_routes).map(|netns| {
                ExternalClient(Arc::new(ExternalInner {
                    name: name.to_string(),
                    ips: ips.clone(),
                    via,
                    via_ip: via_node.ip,
                    netns,
                }))
            });
        let mut members = self.lock();
        match made {
            Ok(client) => {
                members.externals.push(client.clone());
                Ok(client)
            }
            Err(err) => {
                for ip in &ips {
                    members.used_ips.remove(ip);
                }
                Err(err.context(format!("creating external client {name}")))
            }
        }
    }

    /// The next free external client addresses, 192.168.77.200 (and its twin) upwards.
    pub fn next_external_ips(&self) -> Result<(Ipv4Addr, Ipv6Addr)> {
        let members = self.lock();
        (200..=254u8)
            .map(|d| Ipv4Addr::new(192, 168, 77, d))
            .filter_map(|v4| Some((v4, twin6(v4)?)))
            .find(|(v4, v6)| {
                !members.used_ips.contains(&IpAddr::V4(*v4))
                    && !members.used_ips.contains(&IpAddr::V6(*v6))
            })
            .context("no free external client address left")
    }

    fn node_checked(&self, index: usize) -> Result<&Node> {
        self.nodes
            .get(index)
            .with_context(|| format!("no node {index} (cluster has {})", self.nodes.len()))
    }
}

/// `ip/32` or `ip/128`, and the `ip` family flag.
fn host_net(ip: IpAddr) -> (String, &'static str) {
    match ip {
        IpAddr::V4(_) => (format!("{ip}/32"), "-4"),
        IpAddr::V6(_) => (format!("{ip}/128"), "-6"),
    }
}

fn make_node(fabric: &Netns, index: usize, name: &str, mode: PodNetwork) -> Result<Node> {
    let octet = u8::try_from(10 + index).context("too many nodes")?;
    let pod_octet = u8::try_from(index).context("too many nodes")?;
    let ip = Ipv4Addr::new(192, 168, 77, octet);
    let ip6 = twin6(ip).context("node address has no IPv6 twin")?;
    let pod_cidr = Ipv4Net::new(Ipv4Addr::new(10, 244, pod_octet, 0), 24)?;
    let pod_cidr6 = pod_cidr6(index)?;
    let netns = Netns::create(name)?;

    // Defaults first, so interfaces created below inherit them.
    common_sysctls(&netns)?;
    for (key, value) in [
        ("net.ipv4.ip_forward", "1"),
        ("net.ipv4.conf.all.rp_filter", "0"),
        ("net.ipv4.conf.default.rp_filter", "0"),
        ("net.ipv4.conf.all.send_redirects", "0"),
        ("net.ipv4.conf.default.send_redirects", "0"),
        ("net.ipv6.conf.all.forwarding", "1"),
        ("net.ipv6.conf.default.forwarding", "1"),
    ] {
        netns.sysctl(key, value)?;
    }

    let fabric_port = format!("n{index}");
    netns.ip(&[
        "link",
        "add",
        "eth0",
        "type",
        "veth",
        "peer",
        "name",
        &fabric_port,
        "netns",
        fabric.name(),
    ])?;
    fabric.ip(&["link", "set", &fabric_port, "master", "br0", "up"])?;
    netns.ip_batch(&[
        format!("addr add {ip}/24 dev eth0"),
        format!("addr add {ip6}/64 dev eth0 nodad"),
        "link set eth0 up".to_string(),
        format!("route add default via {FABRIC_GATEWAY} dev eth0"),
        format!("route add default via {FABRIC_GATEWAY6} dev eth0"),
    ])?;
    if mode == PodNetwork::Bridge {
        netns.ip_batch(&[
            format!(
                "link add name {POD_BRIDGE} address {POD_GATEWAY_MAC} type bridge mcast_snooping 0"
            ),
            format!("addr add {POD_GATEWAY6}/64 dev {POD_BRIDGE} nodad"),
            format!("link set {POD_BRIDGE} up"),
        ])?;
    }
    Ok(Node {
        name: name.to_string(),
        index,
        ip,
        ip6,
        pod_cidr,
        pod_cidr6,
        extra: Mutex::new(Vec::new()),
        netns,
        next_veth: AtomicU32::new(0),
    })
}

fn make_pod(node: &Node, mode: PodNetwork, name: &str, ips: &[IpAddr]) -> Result<Pod> {
    let netns = Netns::create(&format!("p-{name}"))?;
    common_sysctls(&netns)?;
    let veth = format!(
        "{POD_INTERFACE_PREFIX}{}",
        node.next_veth.fetch_add(1, Ordering::Relaxed)
    );
    let mut link = vec!["link", "add", "eth0", "type", "veth", "peer", "name", &veth];
    if mode == PodNetwork::Routed {
        link.extend(["address", POD_GATEWAY_MAC]);
    }
    link.extend(["netns", node.netns.name()]);
    netns.ip(&link)?;

    let node_ns = &node.netns;
    match mode {
        PodNetwork::Routed => {
            node_ns.sysctl(&format!("net/ipv4/conf/{veth}/proxy_arp"), "1")?;
            node_ns.sysctl(&format!("net/ipv4/neigh/{veth}/proxy_delay"), "0")?;
            node_ns.ip_batch(&[
                format!("addr add {POD_GATEWAY6}/64 dev {veth} nodad"),
                format!("link set {veth} up"),
            ])?;
        }
        PodNetwork::Bridge => {
            node_ns.ip(&["link", "set", &veth, "master", POD_BRIDGE, "up"])?;
        }
    }

    netns.ip_batch(&[
        "link set eth0 up".to_string(),
        format!("neigh replace {POD_GATEWAY} lladdr {POD_GATEWAY_MAC} dev eth0 nud permanent"),
        format!("route add {POD_GATEWAY} dev eth0 scope link"),
        format!("route add default via {POD_GATEWAY} dev eth0"),
        format!("neigh replace {POD_GATEWAY6} lladdr {POD_GATEWAY_MAC} dev eth0 nud permanent"),
        format!("route add default via {POD_GATEWAY6} dev eth0"),
    ])?;
    let pod = Pod(Arc::new(PodInner {
        name: name.to_string(),
        node: node.name.clone(),
        node_index: node.index,
        ips: Mutex::new(Vec::new()),
        node_veth: veth,
        netns,
    }));
    for ip in ips {
        add_pod_ip(node, mode, &pod, *ip)?;
        pod.0
            .ips
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(*ip);
    }
    Ok(pod)
}

/// Puts `ip` on the pod's eth0 and routes it from the node.
fn add_pod_ip(node: &Node, mode: PodNetwork, pod: &Pod, ip: IpAddr) -> Result<()> {
    let (host, flag) = host_net(ip);
    pod.netns()
        .ip(&[flag, "addr", "add", &host, "dev", "eth0", "nodad"])?;
    let dev = match mode {
        PodNetwork::Routed => pod.node_veth(),
        PodNetwork::Bridge => POD_BRIDGE,
    };
    node.netns.ip(&[flag, "route", "add", &host, "dev", dev])?;
    Ok(())
}

fn make_external(
    fabric: &Netns,
    fabric_port: &str,
    name: &str,
    ips: &[IpAddr],
    via: &Node,
    host_routes: &[(IpAddr, IpAddr)],
) -> Result<Netns> {
    let netns = Netns::create(&format!("x-{name}"))?;
    common_sysctls(&netns)?;
    netns.ip(&[
        "link",
        "add",
        "eth0",
        "type",
        "veth",
        "peer",
        "name",
        fabric_port,
        "netns",
        fabric.name(),
    ])?;
    fabric.ip(&["link", "set", fabric_port, "master", "br0", "up"])?;
    let mut batch = Vec::new();
    for ip in ips {
        match ip {
            IpAddr::V4(_) => batch.push(format!("addr add {ip}/24 dev eth0")),
            IpAddr::V6(_) => batch.push(format!("addr add {ip}/64 dev eth0 nodad")),
        }
    }
    batch.push("link set eth0 up".into());
    // Both families route everything else via the node, as through a router; what the node
    // neither translates nor routes disappears in the fabric.
    batch.push(format!("route add default via {} dev eth0", via.ip));
    batch.push(format!("route add default via {} dev eth0", via.ip6));
    for (ip, gateway) in host_routes {
        let (host, _) = host_net(*ip);
        batch.push(format!("route replace {host} via {gateway} dev eth0"));
    }
    netns.ip_batch(&batch)?;
    Ok(netns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twins_mirror_the_digits() {
        assert_eq!(
            twin6(Ipv4Addr::new(192, 168, 77, 200)),
            Some("fd00:77::200".parse().unwrap())
        );
        assert_eq!(
            twin6(Ipv4Addr::new(10, 244, 1, 11)),
            Some("fd00:244:0:1::11".parse().unwrap())
        );
        assert_eq!(
            twin6(Ipv4Addr::new(10, 244, 255, 255)),
            Some("fd00:244:0:255::255".parse().unwrap())
        );
        assert_eq!(twin6(Ipv4Addr::new(10, 1, 1, 1)), None);
        assert_eq!(
            pod_cidr6(3).unwrap(),
            "fd00:244:0:3::/64".parse::<Ipv6Net>().unwrap()
        );
        let cluster6: Ipv6Net = CLUSTER_CIDR6.parse().unwrap();
        assert!(cluster6.contains(&pod_cidr6(99).unwrap()));
    }
}
