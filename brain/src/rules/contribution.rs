//! One Service's elements: what every node holds ([`global`]) and what only one node holds
//! ([`node`]: its local endpoints, its topology choice, its hairpin pairs, its health check
//! count). The two never share a key in one set, so a node's table is their disjoint union.
use std::collections::BTreeSet;
use std::net::IpAddr;

use splitproxy_proto::family::{IpFamily, PerFamily};
use splitproxy_proto::v1::{Datum, Element};

use super::endpoints::{self, PortEndpoint};
use super::ir;
use super::sets::{self, DynSet, Kind};
use crate::index::Index;
use crate::objects::{NodeInfo, ServiceInfo, ServicePort};

/// Every port's endpoints of a Service, per family, computed once per change and shared by the
/// global and per-node contributions.
pub struct ServiceEndpoints(Vec<PerFamily<Vec<PortEndpoint>>>);

impl ServiceEndpoints {
    pub fn of(index: &Index, svc: &ServiceInfo) -> Self {
        ServiceEndpoints(
            svc.ports
                .iter()
                .map(|p| {
                    PerFamily::from_fn(|family| endpoints::port_endpoints(index, svc, p, family))
                })
                .collect(),
        )
    }

    fn port(&self, i: usize, family: IpFamily) -> &[PortEndpoint] {
        self.0.get(i).map(|f| f[family].as_slice()).unwrap_or(&[])
    }

    /// Whether topology hints make nodes choose differently for any port.
    pub fn topology_dependent(&self) -> bool {
        self.0
            .iter()
            .flat_map(|f| f.values())
            .any(|eps| endpoints::topology_dependent(eps))
    }

    /// Every endpoint node name mentioned, known to the index or not.
    pub fn node_names(&self) -> impl Iterator<Item = &str> {
        self.0
            .iter()
            .flat_map(|f| f.values().flatten())
            .filter_map(|e| e.node.as_deref())
    }
}

/// A share of one family's table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Contribution {
    /// (set, element) in fixed sets.
    pub elements: Vec<(&'static str, Element)>,
    /// Elements of sets that exist while used (per-count and per-timeout sets).
    pub dynamic: Vec<(DynSet, Element)>,
}

impl Contribution {
    pub fn is_empty(&self) -> bool {
        self.elements.is_empty() && self.dynamic.is_empty()
    }

    fn add(&mut self, set: &'static str, key: Vec<Datum>) {
        self.elements.push((
            set,
            Element {
                key,
                ..Default::default()
            },
        ));
    }

    /// Session affinity for `key`: the key in its per-timeout set, and one `key . endpoint`
    /// member (which guards the clients' entries) per usable endpoint.
    fn affinity(
        &mut self,
        set: DynSet,
        members_set: &'static str,
        key: Vec<Datum>,
        members: &BTreeSet<(IpAddr, u16)>,
    ) {
        for (ip, port) in members {
            let mut k = key.clone();
            k.extend([ir::ip(*ip), ir::port(*port)]);
            self.add(members_set, k);
        }
        self.dynamic.push((
            set,
            Element {
                key,
                ..Default::default()
            },
        ));
    }

    /// `n` endpoints for `key`: the key in its count set, one map element per slot.
    fn choose(&mut self, kind: Kind, key: Vec<Datum>, eps: &[(IpAddr, u16)], comment: &str) {
        if eps.is_empty() {
            return;
        }
        for (slot, (ip, p)) in eps.iter().enumerate() {
            let mut k = key.clone();
            k.push(ir::int(slot as u32));
            self.elements.push((
                kind.map(),
                Element {
                    key: k,
                    data: vec![ir::ip(*ip), ir::port(*p)],
                    ..Default::default()
                },
            ));
        }
        self.dynamic.push((
            DynSet::Count(kind, eps.len() as u32),
            Element {
                key,
                comment: comment.into(),
                ..Default::default()
            },
        ));
    }
}

/// nftables keeps comments up to 127 bytes; Kubernetes names (ASCII) may be longer.
fn comment(svc: &ServiceInfo, port: &ServicePort) -> String {
    format!("{}:{}", svc.key, port.name)
        .chars()
        .take(127)
        .collect()
}

fn addr_key(ip: IpAddr, port: &ServicePort) -> Vec<Datum> {
    vec![
        ir::ip(ip),
        ir::proto(port.protocol as u8),
        ir::port(port.port),
    ]
}

fn nodeport_key(port: &ServicePort, node_port: u16) -> Vec<Datum> {
    vec![ir::proto(port.protocol as u8), ir::port(node_port)]
}

/// The Service's addresses of one family, by role.
struct Destinations {
    cluster: Vec<IpAddr>,
    /// externalIPs and load balancer IPs.
    external: Vec<IpAddr>,
    load_balancer: Vec<IpAddr>,
    /// NodePorts exist in this family's table when the Service has this family.
    nodeports: bool,
}

fn destinations(svc: &ServiceInfo, family: IpFamily) -> Destinations {
    let of = |v: &[IpAddr]| -> Vec<IpAddr> {
        v.iter().copied().filter(|ip| family.holds(*ip)).collect()
    };
    let cluster = of(&svc.cluster_ips);
    let load_balancer = of(&svc.load_balancer_ips);
    let mut external = of(&svc.external_ips);
    external.extend(load_balancer.iter().copied());
    external.sort();
    external.dedup();
    Destinations {
        nodeports: !cluster.is_empty(),
        cluster,
        external,
        load_balancer,
    }
}

/// What `svc` puts into every node's table of `family`.
pub fn global(svc: &ServiceInfo, all: &ServiceEndpoints, family: IpFamily) -> Contribution {
    let mut c = Contribution::default();
    let dst = destinations(svc, family);
    for &cip in &dst.cluster {
        c.add(sets::CLUSTER_IPS, vec![ir::ip(cip)]);
    }
    // The health check sets live in the ip table only (see `sets::fixed_sets`).
    if family == IpFamily::V4
        && let Some(hc) = svc.health_check_node_port
    {
        c.elements.push((
            sets::HEALTH_CHECK_NODEPORTS,
            Element {
                key: vec![ir::port(hc)],
                data: vec![ir::int(0)],
                comment: svc.key.to_string().chars().take(127).collect(),
                ..Default::default()
            },
        ));
    }
    for (i, port) in svc.ports.iter().enumerate() {
        let eps = all.port(i, family);
        let comment = comment(svc, port);
        let node_port = port.node_port.filter(|_| dst.nodeports);
        if !endpoints::has_usable(eps) {
            for &ip in dst.cluster.iter().chain(&dst.external) {
                c.add(sets::NO_ENDPOINT_SERVICES, addr_key(ip, port));
            }
            if let Some(np) = node_port {
                c.add(sets::NO_ENDPOINT_NODEPORTS, nodeport_key(port, np));
            }
            continue;
        }
        // With topology hints in effect each node chooses for itself (see `node`).
        let cluster =
            (!endpoints::topology_dependent(eps)).then(|| endpoints::cluster_endpoints(eps, None));
        for &cip in &dst.cluster {
            let key = addr_key(cip, port);
            if svc.internal_local {
                c.add(sets::INTERNAL_LOCAL, key);
            } else if let Some(chosen) = &cluster {
                c.choose(Kind::Service, key, chosen, &comment);
            }
        }
        for &ip in &dst.external {
            let key = addr_key(ip, port);
            c.add(
                if svc.external_local {
                    sets::EXTERNAL_LOCAL
                } else {
                    sets::EXTERNAL_CLUSTER
                },
                key.clone(),
            );
            // Cluster-policy traffic, and Local-policy traffic from pods and the node itself.
            if let Some(chosen) = &cluster {
                c.choose(Kind::Service, key, chosen, &comment);
            }
        }
        if let Some(np) = node_port {
            let key = nodeport_key(port, np);
            c.add(
                if svc.external_local {
                    sets::NODEPORT_LOCAL
                } else {
                    sets::NODEPORT_CLUSTER
                },
                key.clone(),
            );
            if let Some(chosen) = &cluster {
                c.choose(Kind::NodePort, key, chosen, &comment);
            }
        }
        if !svc.source_ranges.is_empty() {
            for &ip in &dst.load_balancer {
                let key = addr_key(ip, port);
                c.add(sets::FIREWALL_IPS, key.clone());
                for net in svc.source_ranges.iter().filter(|n| family.holds_net(**n)) {
                    let mut start = key.clone();
                    start.push(ir::ip(net.network()));
                    let mut end = key.clone();
                    end.push(ir::ip(net.broadcast()));
                    c.elements.push((
                        sets::FIREWALL_ALLOW,
                        Element {
                            key: start,
                            key_end: end,
                            ..Default::default()
                        },
                    ));
                }
            }
        }
        if let Some(t) = svc.affinity_timeout {
            let members: BTreeSet<(IpAddr, u16)> = eps
                .iter()
                .filter(|e| e.usable())
                .map(PortEndpoint::addr)
                .collect();
            if let Some(np) = node_port {
                c.affinity(
                    DynSet::NodePortAffinity(t),
                    sets::NODEPORT_AFFINITY_MEMBERS,
                    nodeport_key(port, np),
                    &members,
                );
            }
            for &ip in dst.cluster.iter().chain(&dst.external) {
                c.affinity(
                    DynSet::Affinity(t),
                    sets::AFFINITY_MEMBERS,
                    addr_key(ip, port),
                    &members,
                );
            }
        }
    }
    c
}

/// The nodes that hold a share of `svc`: those hosting its endpoints, and every node when
/// topology hints make each node choose.
pub fn nodes_of<'a>(index: &'a Index, all: &ServiceEndpoints) -> BTreeSet<&'a str> {
    if all.topology_dependent() {
        return index.nodes().map(|n| n.name.as_str()).collect();
    }
    all.0
        .iter()
        .flat_map(|f| f.values())
        .flat_map(|eps| endpoints::hosting_nodes(eps))
        .filter_map(|n| index.node(n))
        .map(|n| n.name.as_str())
        .collect()
}

/// What `svc` puts into `node`'s table of `family` only.
pub fn node(
    svc: &ServiceInfo,
    all: &ServiceEndpoints,
    node: &NodeInfo,
    family: IpFamily,
) -> Contribution {
    let mut c = Contribution::default();
    let dst = destinations(svc, family);
    let mut hairpin = BTreeSet::new();
    let mut local_ips = BTreeSet::new();
    for (i, port) in svc.ports.iter().enumerate() {
        let eps = all.port(i, family);
        if !endpoints::has_usable(eps) {
            continue;
        }
        let comment = comment(svc, port);
        let node_port = port.node_port.filter(|_| dst.nodeports);
        let local = endpoints::local_endpoints(eps, &node.name);
        hairpin.extend(local.iter().map(|(ip, _)| *ip));
        local_ips.extend(
            eps.iter()
                .filter(|e| e.ready && e.node.as_deref() == Some(node.name.as_str()))
                .map(|e| e.ip),
        );
        if svc.internal_local {
            for &cip in &dst.cluster {
                c.choose(Kind::Local, addr_key(cip, port), &local, &comment);
            }
        }
        if svc.external_local {
            for &ip in &dst.external {
                c.choose(Kind::ExternalLocal, addr_key(ip, port), &local, &comment);
            }
            if let Some(np) = node_port {
                c.choose(
                    Kind::NodePortLocal,
                    nodeport_key(port, np),
                    &local,
                    &comment,
                );
            }
        }
        if endpoints::topology_dependent(eps) {
            let chosen = endpoints::cluster_endpoints(eps, Some(node));
            if !svc.internal_local {
                for &cip in &dst.cluster {
                    c.choose(Kind::Service, addr_key(cip, port), &chosen, &comment);
                }
            }
            for &ip in &dst.external {
                c.choose(Kind::Service, addr_key(ip, port), &chosen, &comment);
            }
            if let Some(np) = node_port {
                c.choose(Kind::NodePort, nodeport_key(port, np), &chosen, &comment);
            }
        }
    }
    for ip in hairpin {
        c.add(sets::HAIRPIN, vec![ir::ip(ip), ir::ip(ip)]);
    }
    // The health check sets live in the ip table only (see `sets::fixed_sets`).
    if family == IpFamily::V4
        && let Some(hc) = svc.health_check_node_port
    {
        // kube-proxy counts the node's ready endpoints of the Service, all families.
        let mut ips = local_ips;
        for i in 0..svc.ports.len() {
            ips.extend(
                all.port(i, IpFamily::V6)
                    .iter()
                    .filter(|e| e.ready && e.node.as_deref() == Some(node.name.as_str()))
                    .map(|e| e.ip),
            );
        }
        if !ips.is_empty() {
            c.elements.push((
                sets::HEALTH_CHECK_LOCAL_ENDPOINTS,
                Element {
                    key: vec![ir::port(hc)],
                    data: vec![ir::int(ips.len() as u32)],
                    ..Default::default()
                },
            ));
        }
    }
    c
}

/// What the node's own facts put into its table: the addresses NodePorts answer on, and its
/// pod CIDRs (for `--detect-local-mode NodeCIDR`).
pub fn node_facts(config: &super::RulesConfig, node: &NodeInfo, family: IpFamily) -> Contribution {
    let mut c = Contribution::default();
    let addrs: Vec<IpAddr> = match &config.nodeport_addresses {
        super::NodePortAddresses::Primary => node.primary.clone(),
        super::NodePortAddresses::Cidrs(nets) => node
            .addresses
            .iter()
            .copied()
            .filter(|a| nets.iter().any(|n| n.contains(a)))
            .collect(),
    };
    let mut addrs: Vec<IpAddr> = addrs
        .into_iter()
        .filter(|a| family.holds(*a) && !a.is_loopback())
        .collect();
    addrs.sort();
    addrs.dedup();
    for a in addrs {
        c.add(sets::NODEPORT_IPS, vec![ir::ip(a)]);
    }
    for net in node.pod_cidrs.iter().filter(|n| family.holds_net(**n)) {
        c.elements.push((
            sets::LOCAL_POD_CIDRS,
            Element {
                key: vec![ir::ip(net.network())],
                key_end: vec![ir::ip(net.broadcast())],
                ..Default::default()
            },
        ));
    }
    c
}
