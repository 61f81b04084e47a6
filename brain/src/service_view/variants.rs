//! `GetService`'s variants: the Service's endpoints as each node sees them.
//!
//! Nodes see different endpoints (Local traffic policies, topology hints, the terminating
//! fallback, their own overlay), and the answer must say what the nodes' rulesets really do,
//! not what the Service object suggests. So nothing here decides what a Service means: for each
//! destination of the Service (a ClusterIP, a NodePort on the node's address, an externalIP, a
//! load-balancer IP, per port) a packet is built and evaluated against a node's ruleset by
//! ExplainPacket's interpreter (`splitproxy_proto::explain`), the same evaluation the lab holds
//! against real packets; the DNAT outcomes are the endpoints, with their weights, and a
//! connection that finds none is dropped, rejected or left alone as the rules say.
//!
//! Evaluating 5,000 nodes one by one would cost seconds, and nearly all of them hold the same
//! thing. A node's ruleset is the shared model plus its overlay (`crate::overlay`), and the
//! overlay holds only elements; a packet to one of the Service's destinations looks up keys that
//! begin with that destination (`addr . proto . port`, or `proto . port` for a NodePort, the key
//! layout of `crate::rules::sets`). Nodes whose overlays hold the same elements under every
//! destination of the Service (and that have a NodePort address of the same families) therefore
//! evaluate alike: they are grouped first, and one node of each group is evaluated. The unit
//! tests hold the grouped answer against an evaluation of every node.
//!
//! Bounded whatever the cluster's size: at most [`MAX_DESTINATIONS`] destinations and
//! [`MAX_GROUPS`] groups are evaluated (the largest groups first), [`MAX_VARIANTS`] variants
//! listed with [`SAMPLE_NODES`] node names each, [`MAX_ENDPOINTS`] endpoints per traffic; what
//! is left out is counted. It runs on the gRPC side, from the latest publication (persistent, so
//! holding it costs nothing), never on the watch path.
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::Bound;

use prost::Message;
use splitproxy_proto::explain::{self, Origin, Packet};
use splitproxy_proto::family::IpFamily;
use splitproxy_proto::model::{Model, TableKey, element_key_bytes};
use splitproxy_proto::v1::datum::Value;
use splitproxy_proto::v1::{
    Element, PacketFate, ServiceTraffic, ServiceVariant, TrafficEndpoint, service_traffic::Kind,
};

use super::ServiceView;
use crate::fanout::Publication;
use crate::objects::ServiceInfo;
use crate::rules::{ir, sets};

/// Destinations evaluated per Service (ports times addresses).
pub const MAX_DESTINATIONS: usize = 32;
/// Groups of nodes with distinct rulesets under the Service's destinations evaluated.
pub const MAX_GROUPS: usize = 64;
/// Variants listed.
pub const MAX_VARIANTS: usize = 16;
/// Node names listed per variant.
pub const SAMPLE_NODES: usize = 10;
/// Endpoints listed per traffic.
pub const MAX_ENDPOINTS: usize = 32;

/// The client outside the cluster that external traffic comes from (documentation ranges, so
/// no cluster's pod or node address), unless source ranges restrict the destination.
const EXTERNAL_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7));
const EXTERNAL_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 7));
/// The interface external traffic arrives on: no pod interface prefix or bridge a
/// `--detect-local-mode` names is a prefix of it in practice (veth, cali, lxc, cni0, cbr0...).
const EXTERNAL_INTERFACE: &str = "ext0";

/// Where a destination is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Address(IpAddr),
    /// A NodePort on the node's own NodePort address of this family.
    NodeAddress(IpFamily),
}

/// One destination of the Service and the kind of traffic sent to it.
#[derive(Debug, Clone)]
struct Destination {
    kind: Kind,
    port_name: String,
    protocol: u8,
    protocol_name: String,
    target: Target,
    port: u16,
}

impl Destination {
    fn family(&self) -> IpFamily {
        match self.target {
            Target::Address(ip) => IpFamily::of(ip),
            Target::NodeAddress(f) => f,
        }
    }

    fn text(&self) -> String {
        match self.target {
            Target::Address(ip) => SocketAddr::new(ip, self.port).to_string(),
            Target::NodeAddress(_) => format!("<node>:{}", self.port),
        }
    }

    /// The bytes every element keyed by this destination begins with: the model keys
    /// elements by their encoded key, and a concatenated key encodes as its parts in order.
    fn prefix(&self) -> Box<[u8]> {
        let key = match self.target {
            Target::Address(ip) => vec![ir::ip(ip), ir::proto(self.protocol), ir::port(self.port)],
            Target::NodeAddress(_) => vec![ir::proto(self.protocol), ir::port(self.port)],
        };
        element_key_bytes(&Element {
            key,
            ..Default::default()
        })
    }
}

/// The Service's destinations, in port order: ClusterIPs, NodePorts (in the families of its
/// ClusterIPs), externalIPs, load-balancer IPs; and how many were left out.
fn destinations(info: &ServiceInfo) -> (Vec<Destination>, usize) {
    let mut out = Vec::new();
    for p in &info.ports {
        let d = |kind, target, port| Destination {
            kind,
            port_name: p.name.clone(),
            protocol: p.protocol as u8,
            protocol_name: format!("{:?}", p.protocol).to_uppercase(),
            target,
            port,
        };
        for ip in &info.cluster_ips {
            out.push(d(Kind::ClusterIp, Target::Address(*ip), p.port));
        }
        if let Some(np) = p.node_port {
            for family in IpFamily::ALL {
                if info.cluster_ips.iter().any(|ip| family.holds(*ip)) {
                    out.push(d(Kind::NodePort, Target::NodeAddress(family), np));
                }
            }
        }
        for ip in &info.external_ips {
            out.push(d(Kind::ExternalIp, Target::Address(*ip), p.port));
        }
        for ip in &info.load_balancer_ips {
            out.push(d(Kind::LoadBalancerIp, Target::Address(*ip), p.port));
        }
    }
    let left_out = out.len().saturating_sub(MAX_DESTINATIONS);
    out.truncate(MAX_DESTINATIONS);
    (out, left_out)
}

/// Elements of `model` under `prefix` in every set of the table `table`.
fn under<'a>(
    model: &'a Model,
    table: &TableKey,
    prefix: &'a [u8],
) -> impl Iterator<Item = (&'a str, &'a [u8], &'a [u8])> + 'a {
    model
        .tables
        .get(table)
        .into_iter()
        .flat_map(|t| t.sets.iter())
        .flat_map(move |(name, set)| {
            set.elements
                .range::<_, [u8]>((Bound::Included(prefix), Bound::Unbounded))
                .take_while(move |(k, _)| k.starts_with(prefix))
                .map(move |(k, v)| (name.as_str(), &k[..], &v[..]))
        })
}

/// What decides how a node's ruleset treats the Service, beyond the shared model: its overlay's
/// elements under the Service's destinations, and the families it has a NodePort address in.
#[derive(Debug, PartialEq, Eq, Hash)]
struct Signature<'a> {
    /// Sorted by destination.
    elements: Vec<ElementRef<'a>>,
    nodeport_families: [bool; 2],
}

/// (destination, set, key, element) of an overlay element under one of the destinations.
type ElementRef<'a> = (usize, &'a str, &'a [u8], &'a [u8]);

impl<'a> Signature<'a> {
    /// The elements under destination `d`.
    fn under(&self, d: usize) -> &[ElementRef<'a>] {
        let start = self.elements.partition_point(|e| e.0 < d);
        let end = self.elements.partition_point(|e| e.0 <= d);
        &self.elements[start..end]
    }
}

fn signature<'a>(
    overlay: &'a Model,
    tables: &[TableKey; 2],
    prefixes: &'a [(IpFamily, Box<[u8]>)],
) -> Signature<'a> {
    let mut elements = Vec::new();
    for (i, (family, prefix)) in prefixes.iter().enumerate() {
        let table = &tables[family_index(*family)];
        elements.extend(under(overlay, table, prefix).map(|(s, k, v)| (i, s, k, v)));
    }
    let nodeport_families = [IpFamily::V4, IpFamily::V6].map(|f| {
        overlay
            .set(&tables[family_index(f)], sets::NODEPORT_IPS)
            .is_some_and(|s| !s.is_empty())
    });
    Signature {
        elements,
        nodeport_families,
    }
}

fn family_index(f: IpFamily) -> usize {
    match f {
        IpFamily::V4 => 0,
        IpFamily::V6 => 1,
    }
}

/// The table of each family, as the shared model names them.
fn table_keys(shared: &Model) -> [TableKey; 2] {
    let name = shared
        .tables
        .keys()
        .next()
        .map(|(_, n)| n.clone())
        .unwrap_or_default();
    [IpFamily::V4, IpFamily::V6].map(|f| (f.table_family(), name.clone()))
}

/// The variants of one Service at one publication, ready for the answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Variants {
    pub version: u64,
    pub variants: Vec<ServiceVariant>,
    pub left_out: u32,
    pub nodes_left_out: u32,
    pub destinations_left_out: u32,
}

/// How the nodes of `publication` see the Service of `view`.
pub fn compute(view: &ServiceView, publication: &Publication) -> Variants {
    let mut out = Variants {
        version: publication.version,
        ..Default::default()
    };
    if publication.version == 0 {
        return out;
    }
    let (dests, dests_left_out) = destinations(&view.info);
    out.destinations_left_out = dests_left_out as u32;
    let tables = table_keys(&publication.shared);
    let prefixes: Vec<(IpFamily, Box<[u8]>)> =
        dests.iter().map(|d| (d.family(), d.prefix())).collect();
    let clients: Vec<IpAddr> = dests
        .iter()
        .zip(&prefixes)
        .map(|(d, (f, p))| external_client(&publication.shared, &tables[family_index(*f)], d, p))
        .collect();

    // Nodes grouped by what their overlays hold under the Service's destinations.
    let mut groups: HashMap<Signature<'_>, Vec<&str>> = HashMap::new();
    for (node, overlay) in publication.overlays.iter() {
        groups
            .entry(signature(overlay, &tables, &prefixes))
            .or_default()
            .push(node.as_str());
    }
    let mut groups: Vec<(Signature<'_>, Vec<&str>)> = groups.into_iter().collect();
    for (_, g) in &mut groups {
        g.sort_unstable();
    }
    groups.sort_by(|(_, a), (_, b)| b.len().cmp(&a.len()).then_with(|| a[0].cmp(b[0])));

    // One node of each group evaluated, each destination once per distinct content under it
    // (the same argument, per destination: a node's packet to it reads only elements under
    // it); groups that evaluate alike are one variant.
    let terminating = terminating_addresses(view);
    let mut evaluated: HashMap<(usize, &[ElementRef<'_>], bool), ServiceTraffic> = HashMap::new();
    let mut found: Vec<(Vec<ServiceTraffic>, Vec<&str>)> = Vec::new();
    for (i, (signature, group)) in groups.iter().enumerate() {
        if i >= MAX_GROUPS {
            out.left_out += 1;
            out.nodes_left_out += group.len() as u32;
            continue;
        }
        let mut node: Option<(Model, Vec<IpAddr>)> = None;
        let mut traffic = Vec::with_capacity(dests.len());
        for (d, dest) in dests.iter().enumerate() {
            let key = (
                d,
                signature.under(d),
                signature.nodeport_families[family_index(dest.family())],
            );
            if let Some(t) = evaluated.get(&key) {
                traffic.push(t.clone());
                continue;
            }
            if node.is_none() {
                node = publication.held(group[0]).map(|held| {
                    let model = held.full();
                    let addresses = crate::explain::node_addresses(&model);
                    (model, addresses)
                });
            }
            let Some((model, addresses)) = node.as_ref() else {
                break;
            };
            let t = evaluate(model, addresses, dest, clients[d], &terminating);
            evaluated.insert(key, t.clone());
            traffic.push(t);
        }
        let traffic = merge(traffic);
        match found.iter_mut().find(|(t, _)| *t == traffic) {
            Some((_, nodes)) => nodes.extend(group.iter().copied()),
            None => found.push((traffic, group.clone())),
        }
    }
    for (_, nodes) in &mut found {
        nodes.sort_unstable();
    }
    found.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then_with(|| a.1[0].cmp(b.1[0])));
    for (i, (traffic, nodes)) in found.into_iter().enumerate() {
        if i >= MAX_VARIANTS {
            out.left_out += 1;
            out.nodes_left_out += nodes.len() as u32;
            continue;
        }
        out.variants.push(ServiceVariant {
            node_count: nodes.len() as u32,
            zone: common_zone(view, &nodes),
            nodes: nodes
                .iter()
                .take(SAMPLE_NODES)
                .map(|n| n.to_string())
                .collect(),
            traffic,
        });
    }
    out
}

/// The zone every one of `nodes` is in, if they share one (empty otherwise or unknown).
fn common_zone(view: &ServiceView, nodes: &[&str]) -> String {
    let mut zones = nodes.iter().map(|n| view.zones.get(*n));
    match zones.next().flatten() {
        Some(first) if zones.all(|z| z == Some(first)) => first.clone(),
        _ => String::new(),
    }
}

/// The addresses the index lists as terminating only (serving, not ready): the DNAT of a
/// connection to one of them is the terminating fallback.
fn terminating_addresses(view: &ServiceView) -> HashMap<IpAddr, bool> {
    let mut out: HashMap<IpAddr, bool> = HashMap::new();
    for slice in &view.slices {
        for ep in &slice.endpoints {
            let only_terminating = ep.terminating && !ep.ready;
            for a in &ep.addresses {
                let e = out.entry(*a).or_insert(true);
                *e &= only_terminating;
            }
        }
    }
    out
}

/// The client of external traffic to `dest`: one the destination's source ranges admit (the
/// first range of the shared model's `firewall-allow` under it), else a documentation address.
fn external_client(shared: &Model, table: &TableKey, dest: &Destination, prefix: &[u8]) -> IpAddr {
    let fallback = match dest.family() {
        IpFamily::V4 => EXTERNAL_V4,
        IpFamily::V6 => EXTERNAL_V6,
    };
    if dest.kind == Kind::ClusterIp {
        return fallback;
    }
    let Some(set) = shared.set(table, sets::FIREWALL_ALLOW) else {
        return fallback;
    };
    let prefix_len = match dest.target {
        Target::Address(_) => 3,
        Target::NodeAddress(_) => 2,
    };
    set.elements
        .range::<_, [u8]>((Bound::Included(prefix), Bound::Unbounded))
        .take_while(|(k, _)| k.starts_with(prefix))
        .find_map(|(_, v)| {
            let e = Element::decode(&v[..]).ok()?;
            match e.key.get(prefix_len)?.value.as_ref()? {
                Value::Ipv4(b) => <[u8; 4]>::try_from(&b[..]).ok().map(IpAddr::from),
                Value::Ipv6(b) => <[u8; 16]>::try_from(&b[..]).ok().map(IpAddr::from),
                _ => None,
            }
        })
        .unwrap_or(fallback)
}

/// What the node's ruleset `model` does with a new connection to `dest`.
fn evaluate(
    model: &Model,
    addresses: &[IpAddr],
    dest: &Destination,
    external: IpAddr,
    terminating: &HashMap<IpAddr, bool>,
) -> ServiceTraffic {
    let family = dest.family();
    let node_address = addresses.iter().copied().find(|a| family.holds(*a));
    let mut t = ServiceTraffic {
        kind: dest.kind as i32,
        port_name: dest.port_name.clone(),
        protocol: dest.protocol_name.clone(),
        destinations: vec![dest.text()],
        exact: true,
        ..Default::default()
    };
    let (saddr, daddr, origin, iifname) = match (dest.kind, dest.target) {
        (Kind::ClusterIp, Target::Address(ip)) => {
            let loopback = match family {
                IpFamily::V4 => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpFamily::V6 => IpAddr::V6(Ipv6Addr::LOCALHOST),
            };
            t.client = "the node itself".into();
            (node_address.unwrap_or(loopback), ip, Origin::Local, "")
        }
        (_, target) => {
            let daddr = match target {
                Target::Address(ip) => ip,
                Target::NodeAddress(_) => match node_address {
                    Some(a) => a,
                    None => {
                        t.exact = false;
                        t.note = format!(
                            "the node has no NodePort address of family {}",
                            family.nft_name()
                        );
                        return t;
                    }
                },
            };
            t.client = format!("a client outside the cluster ({external})");
            (external, daddr, Origin::Arriving, EXTERNAL_INTERFACE)
        }
    };
    let packet = Packet {
        saddr,
        sport: explain::DEFAULT_SOURCE_PORT,
        daddr,
        dport: dest.port,
        l4proto: dest.protocol,
        iifname: Some(iifname.into()),
        origin,
        established: false,
        mark: 0,
        local: addresses.to_vec(),
    };
    let r = explain::explain(model, &packet, Vec::new());
    t.fate = r.fate;
    t.exact = r.exact;
    if !r.exact {
        // What the evaluation could not know or left out (the packet's own defaults are
        // given, so these are all the evaluation's).
        t.note = r.assumptions.join("; ");
    }
    t.affinity = r.affinity;
    let mut endpoints: BTreeMap<(IpAddr, u16), TrafficEndpoint> = BTreeMap::new();
    for o in r
        .outcomes
        .iter()
        .filter(|o| o.fate == PacketFate::Dnat as i32)
    {
        let Ok(ip) = o.dnat_address.parse::<IpAddr>() else {
            continue;
        };
        let port = u16::try_from(o.dnat_port).unwrap_or_default();
        let e = endpoints
            .entry((ip, port))
            .or_insert_with(|| TrafficEndpoint {
                address: ip.to_string(),
                port: port.into(),
                modulus: o.modulus,
                terminating: terminating.get(&ip).copied().unwrap_or(false),
                ..Default::default()
            });
        e.slots += (o.slots.len() as u32).max(1);
        e.share += o.share;
    }
    let total = endpoints.len();
    t.terminating_fallback = total > 0 && endpoints.values().all(|e| e.terminating);
    t.endpoints = endpoints.into_values().take(MAX_ENDPOINTS).collect();
    t.endpoints_left_out = total.saturating_sub(MAX_ENDPOINTS) as u32;
    t
}

/// Destinations of the same kind and port treated alike become one traffic entry.
fn merge(evaluated: Vec<ServiceTraffic>) -> Vec<ServiceTraffic> {
    let mut out: Vec<ServiceTraffic> = Vec::new();
    for t in evaluated {
        let same = |o: &ServiceTraffic| {
            let mut a = o.clone();
            a.destinations.clear();
            let mut b = t.clone();
            b.destinations.clear();
            a == b
        };
        match out.iter_mut().find(|o| same(o)) {
            Some(o) => o.destinations.extend(t.destinations),
            None => out.push(t),
        }
    }
    out
}

#[cfg(test)]
#[path = "variants_tests.rs"]
mod tests;
