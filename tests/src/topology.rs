//! A small cluster network made of namespaces: fabric, nodes, pods and external clients.
//!
//! End-to-end tests need packets that take the paths they take in a real cluster: pod to
//! ClusterIP on the same or another node, external client to NodePort, node to pod. This
//! module builds that network from namespaces only, so that the actuator's nftables table on
//! each node sees real traffic while the host stays untouched:
//!
//! ```text
//!                       fabric namespace: bridge br0, 192.168.77.1/24
//!          +-----------------+-----------------+--------------------+
//!       node-0 (eth0)     node-1 (eth0)      ...            external client (eth0)
//!     192.168.77.10/24  192.168.77.11/24                  e.g. 192.168.77.200/24
//!     pods 10.244.0.0/24 pods 10.244.1.0/24               routes cluster and service
//!       |        |         |                              CIDRs via a node
//!     pod-a    pod-b     pod-c   (eth0 = IP/32, default via 169.254.1.1 = the node's veth)
//! ```
//!
//! Node namespaces forward (`ip_forward=1`), route every other node's pod CIDR via that node's
//! IP, and have a default route via the fabric (192.168.77.1) so that a packet to a ClusterIP
//! is routed before nftables DNATs it, as on a real node. The fabric does not forward, so a
//! ClusterIP packet that nothing translated disappears there. Pods use the Calico layout: the
//! pod's address is a /32, its default gateway is the link-local 169.254.1.1 whose MAC (a
//! permanent neighbour entry) is the node end of the veth, and the node has a /32 route to the
//! pod over that veth (with proxy ARP for anything else the pod might ask for).
//!
//! Every interface is created with `ip -n <namespace>` directly in its namespace; none ever
//! exists in the host namespace. Everything is deleted when the [`Cluster`] (and every [`Pod`]
//! or [`ExternalClient`] handle cloned from it) is dropped.

use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{Context, bail};
use ipnet::Ipv4Net;

use crate::Result;
use crate::netns::Netns;

/// The fabric bridge's address; every node's default gateway.
pub const FABRIC_GATEWAY: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
/// The node network. Node i is 192.168.77.(10+i); .200 and above are left for clients.
pub const NODE_NETWORK: &str = "192.168.77.0/24";
/// The cluster (pod) CIDR; node i gets 10.244.i.0/24.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The default Service CIDR (kube-apiserver's `--service-cluster-ip-range` default here).
pub const DEFAULT_SERVICE_CIDR: &str = "10.96.0.0/16";
/// The pods' default gateway (link-local, answered by the node end of the veth).
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// MAC of the node end of every pod veth (each veth is its own link, so they may share it).
const POD_GATEWAY_MAC: &str = "ee:ee:ee:ee:ee:ee";
/// At most this many nodes (node IPs .10 to .109).
pub const MAX_NODES: usize = 100;

/// What [`Cluster::new`] builds.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// Node names (Kubernetes Node names, also the actuators' identities); node i gets
    /// 192.168.77.(10+i) and 10.244.i.0/24.
    pub node_names: Vec<String>,
    /// Service CIDRs routed from external clients towards a node.
    pub service_cidrs: Vec<Ipv4Net>,
}

impl ClusterSpec {
    /// `nodes` nodes named `node-0`, `node-1`, ... and the default Service CIDR.
    pub fn new(nodes: usize) -> ClusterSpec {
        ClusterSpec::with_node_names((0..nodes).map(|i| format!("node-{i}")))
    }

    /// Nodes with the given names and the default Service CIDR.
    pub fn with_node_names<I, S>(names: I) -> ClusterSpec
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ClusterSpec {
            node_names: names.into_iter().map(Into::into).collect(),
            service_cidrs: vec![DEFAULT_SERVICE_CIDR.parse().expect("constant CIDR")],
        }
    }

    /// Replaces the Service CIDRs routed from external clients.
    pub fn service_cidrs(mut self, cidrs: &[Ipv4Net]) -> ClusterSpec {
        self.service_cidrs = cidrs.to_vec();
        self
    }
}

/// A node: a namespace with one leg on the fabric and one veth per pod.
#[derive(Debug)]
pub struct Node {
    name: String,
    index: usize,
    ip: Ipv4Addr,
    pod_cidr: Ipv4Net,
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

    /// The node IP on the fabric, 192.168.77.(10+index).
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The node's pod CIDR, 10.244.index.0/24.
    pub fn pod_cidr(&self) -> Ipv4Net {
        self.pod_cidr
    }

    /// The node's namespace (run the actuator and nft here).
    pub fn netns(&self) -> &Netns {
        &self.netns
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
    ip: Ipv4Addr,
    node_veth: String,
    netns: Netns,
}

/// A pod: a namespace with one veth to its node. Cheap to clone; the namespace is deleted when
/// the cluster and every clone are gone (or after [`Cluster::remove_pod`] and the last clone).
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

    /// The pod IP.
    pub fn ip(&self) -> Ipv4Addr {
        self.0.ip
    }

    /// The node end of the pod's veth (an interface in the node namespace).
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
    ip: Ipv4Addr,
    via: Ipv4Addr,
    netns: Netns,
}

/// A client outside the cluster: a namespace on the fabric that routes the cluster and Service
/// CIDRs via one node. Cheap to clone, like [`Pod`].
#[derive(Clone, Debug)]
pub struct ExternalClient(Arc<ExternalInner>);

impl ExternalClient {
    /// The client name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The client's address on the fabric.
    pub fn ip(&self) -> Ipv4Addr {
        self.0.ip
    }

    /// The node IP its cluster and Service routes point to.
    pub fn via(&self) -> Ipv4Addr {
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
    used_ips: HashSet<Ipv4Addr>,
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
        fabric.ip(&["link", "add", "br0", "type", "bridge"])?;
        fabric.ip(&["addr", "add", &format!("{FABRIC_GATEWAY}/24"), "dev", "br0"])?;
        fabric.ip(&["link", "set", "br0", "up"])?;
        // The fabric is a switch, not a router: unmatched traffic ends here.
        fabric.sysctl("net.ipv4.ip_forward", "0")?;

        let mut members = Members::default();
        members.used_ips.insert(FABRIC_GATEWAY);
        let mut nodes = Vec::with_capacity(count);
        for (index, name) in spec.node_names.iter().enumerate() {
            let node =
                make_node(&fabric, index, name).with_context(|| format!("creating node {name}"))?;
            members.used_ips.insert(node.ip);
            nodes.push(node);
        }
        for node in &nodes {
            for other in nodes.iter().filter(|o| o.index != node.index) {
                node.netns.ip(&[
                    "route",
                    "add",
                    &other.pod_cidr.to_string(),
                    "via",
                    &other.ip.to_string(),
                    "dev",
                    "eth0",
                ])?;
            }
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

    /// The fabric namespace (holds bridge `br0`, 192.168.77.1).
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

    /// All pods currently part of the cluster.
    pub fn pods(&self) -> Vec<Pod> {
        self.lock().pods.clone()
    }

    /// All external clients.
    pub fn external_clients(&self) -> Vec<ExternalClient> {
        self.lock().externals.clone()
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

    /// Adds a pod named `name` on node `node` with the next free IP of the node's pod CIDR.
    pub fn add_pod(&self, node: usize, name: &str) -> Result<Pod> {
        let node_ref = self.node_checked(node)?;
        let ip = {
            let members = self.lock();
            node_ref
                .pod_cidr
                .hosts()
                .skip(1) // .1 is left out, as CNI plugins keep it for a gateway
                .find(|ip| !members.used_ips.contains(ip))
                .with_context(|| format!("pod CIDR of {} is full", node_ref.name))?
        };
        self.add_pod_with_ip(node, name, ip)
    }

    /// Adds a pod named `name` on node `node` with address `ip`. The address should be in the
    /// node's pod CIDR for other nodes to reach it.
    pub fn add_pod_with_ip(&self, node: usize, name: &str, ip: Ipv4Addr) -> Result<Pod> {
        let node = self.node_checked(node)?;
        {
            let mut members = self.lock();
            if members.pods.iter().any(|p| p.name() == name) {
                bail!("a pod named {name} exists already");
            }
            if !members.used_ips.insert(ip) {
                bail!("address {ip} is in use already");
            }
        }
        let made = make_pod(node, name, ip);
        let mut members = self.lock();
        match made {
            Ok(pod) => {
                members.pods.push(pod.clone());
                Ok(pod)
            }
            Err(err) => {
                members.used_ips.remove(&ip);
                Err(err.context(format!("creating pod {name} on {}", node.name)))
            }
        }
    }

    /// Removes a pod from the cluster; its namespace goes when the last handle is dropped.
    pub fn remove_pod(&self, name: &str) -> Option<Pod> {
        let mut members = self.lock();
        let index = members.pods.iter().position(|p| p.name() == name)?;
        let pod = members.pods.remove(index);
        members.used_ips.remove(&pod.ip());
        Some(pod)
    }

    /// Adds an external client at `ip` (in 192.168.77.0/24, e.g. 192.168.77.200) that reaches
    /// the cluster and Service CIDRs through node 0.
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
        let via = self.node_checked(via)?.ip;
        let network: Ipv4Net = NODE_NETWORK.parse()?;
        if !network.contains(&ip) || ip == network.network() || ip == network.broadcast() {
            bail!("external client address {ip} must be a host address of {NODE_NETWORK}");
        }
        let port = {
            let mut members = self.lock();
            if members.externals.iter().any(|e| e.name() == name) {
                bail!("an external client named {name} exists already");
            }
            if !members.used_ips.insert(ip) {
                bail!("address {ip} is in use already");
            }
            members.next_fabric_port += 1;
            format!("x{}", members.next_fabric_port)
        };
        let made = make_external(&self.fabric, &port, name, ip, via, &self.spec.service_cidrs);
        let mut members = self.lock();
        match made {
            Ok(client) => {
                members.externals.push(client.clone());
                Ok(client)
            }
            Err(err) => {
                members.used_ips.remove(&ip);
                Err(err.context(format!("creating external client {name}")))
            }
        }
    }

    fn node_checked(&self, index: usize) -> Result<&Node> {
        self.nodes
            .get(index)
            .with_context(|| format!("no node {index} (cluster has {})", self.nodes.len()))
    }
}

fn make_node(fabric: &Netns, index: usize, name: &str) -> Result<Node> {
    let octet = u8::try_from(10 + index).context("too many nodes")?;
    let pod_octet = u8::try_from(index).context("too many nodes")?;
    let ip = Ipv4Addr::new(192, 168, 77, octet);
    let pod_cidr = Ipv4Net::new(Ipv4Addr::new(10, 244, pod_octet, 0), 24)?;
    let netns = Netns::create(name)?;

    // Defaults first, so interfaces created below inherit them.
    for (key, value) in [
        ("net.ipv4.ip_forward", "1"),
        ("net.ipv4.conf.all.rp_filter", "0"),
        ("net.ipv4.conf.default.rp_filter", "0"),
        ("net.ipv4.conf.all.send_redirects", "0"),
        ("net.ipv4.conf.default.send_redirects", "0"),
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
    netns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
    netns.ip(&["link", "set", "eth0", "up"])?;
    netns.ip(&[
        "route",
        "add",
        "default",
        "via",
        &FABRIC_GATEWAY.to_string(),
        "dev",
        "eth0",
    ])?;
    Ok(Node {
        name: name.to_string(),
        index,
        ip,
        pod_cidr,
        netns,
        next_veth: AtomicU32::new(0),
    })
}

fn make_pod(node: &Node, name: &str, ip: Ipv4Addr) -> Result<Pod> {
    let netns = Netns::create(&format!("p-{name}"))?;
    let veth = format!("vp{}", node.next_veth.fetch_add(1, Ordering::Relaxed));
    netns.ip(&[
        "link",
        "add",
        "eth0",
        "type",
        "veth",
        "peer",
        "name",
        &veth,
        "address",
        POD_GATEWAY_MAC,
        "netns",
        node.netns.name(),
    ])?;
    let node_ns = &node.netns;
    node_ns.sysctl(&format!("net/ipv4/conf/{veth}/proxy_arp"), "1")?;
    node_ns.sysctl(&format!("net/ipv4/neigh/{veth}/proxy_delay"), "0")?;
    node_ns.ip(&["link", "set", &veth, "up"])?;
    node_ns.ip(&["route", "add", &format!("{ip}/32"), "dev", &veth])?;

    let gateway = POD_GATEWAY.to_string();
    netns.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"])?;
    netns.ip(&["link", "set", "eth0", "up"])?;
    netns.ip(&[
        "neigh",
        "replace",
        &gateway,
        "lladdr",
        POD_GATEWAY_MAC,
        "dev",
        "eth0",
        "nud",
        "permanent",
    ])?;
    netns.ip(&["route", "add", &gateway, "dev", "eth0", "scope", "link"])?;
    netns.ip(&["route", "add", "default", "via", &gateway, "dev", "eth0"])?;
    Ok(Pod(Arc::new(PodInner {
        name: name.to_string(),
        node: node.name.clone(),
        ip,
        node_veth: veth,
        netns,
    })))
}

fn make_external(
    fabric: &Netns,
    fabric_port: &str,
    name: &str,
    ip: Ipv4Addr,
    via: Ipv4Addr,
    service_cidrs: &[Ipv4Net],
) -> Result<ExternalClient> {
    let netns = Netns::create(&format!("x-{name}"))?;
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
    netns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
    netns.ip(&["link", "set", "eth0", "up"])?;
    let via = via.to_string();
    let cluster_cidr = CLUSTER_CIDR.to_string();
    for cidr in std::iter::once(cluster_cidr).chain(service_cidrs.iter().map(|c| c.to_string())) {
        netns.ip(&["route", "add", &cidr, "via", &via, "dev", "eth0"])?;
    }
    Ok(ExternalClient(Arc::new(ExternalInner {
        name: name.to_string(),
        ip,
        via: via.parse()?,
        netns,
    })))
}
