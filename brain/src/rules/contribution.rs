//! One Service's elements: what every node holds ([`global`]) and what only one node holds
//! ([`node`]: its local endpoints, its topology choice, its hairpin pairs, its health check
//! count, the load balancer IPs it admits as sources). The two never share a key in one set, so a node's table is their disjoint union.
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

/// A `firewall-allow` element: `key` from any source in `first..=last`.
fn firewall_allow(key: &[Datum], first: IpAddr, last: IpAddr) -> (&'static str, Element) {
    let mut start = key.to_vec();
    start.push(ir::ip(first));
    let mut end = key.to_vec();
    end.push(ir::ip(last));
    (
        sets::FIREWALL_ALLOW,
        Element {
            key: start,
            key_end: end,
            ..Default::default()
        },
    )
}

/// The `loadBalancerSourceRanges` of `family` when they restrict the Service's load balancer
/// IPs of that family, as kube-proxy judges each family on its own: no LB IP or no range of the
/// family means no restriction, and so does a range of length 0 ("allow any").
fn firewall_ranges(svc: &ServiceInfo, family: IpFamily) -> Option<Vec<ipnet::IpNet>> {
    if !svc.load_balancer_ips.iter().any(|ip| family.holds(*ip)) {
        return None;
    }
    let ranges: Vec<ipnet::IpNet> = svc
        .source_ranges
        .iter()
        .copied()
        .filter(|n| family.holds_net(*n))
        .collect();
    (!ranges.is_empty() && ranges.iter().all(|n| n.prefix_len() > 0)).then_some(ranges)
}

/// Whether `node` also admits the Service's own load balancer IPs as sources in `family`:
/// kube-proxy does when a source range holds the node's IP of that family (its node IP, here
/// the Node's primary address), because a VIP-style load balancer often makes the VIP a local
/// address of its backends, and a node's request to the VIP then loops back with the VIP as its
/// source (or a cloud SNATs the node's own traffic to it).
pub fn admits_load_balancer_sources(svc: &ServiceInfo, node: &NodeInfo, family: IpFamily) -> bool {
    firewall_ranges(svc, family).is_some_and(|ranges| {
        node.primary
            .iter()
            .filter(|ip| family.holds(**ip))
            .any(|ip| ranges.iter().any(|n| n.contains(ip)))
    })
}

/// Whether what `svc` puts into a node's table depends on the node's addresses (see
/// [`admits_load_balancer_sources`]), so that a Node changing its addresses must recompute it.
pub fn depends_on_node_addresses(svc: &ServiceInfo) -> bool {
    IpFamily::ALL
        .iter()
        .any(|f| firewall_ranges(svc, *f).is_some())
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
    let ranges = firewall_ranges(svc, family);
    for (i, port) in svc.ports.iter().enumerate() {
        let eps = all.port(i, family);
        let comment = comment(svc, port);
        let node_port = port.node_port.filter(|_| dst.nodeports);
        // Judged before the endpoints, as kube-proxy's firewall-check: a client outside the
        // ranges is dropped even when the Service has nothing to serve with.
        if let Some(ranges) = &ranges {
            for &ip in &dst.load_balancer {
                let key = addr_key(ip, port);
                c.add(sets::FIREWALL_IPS, key.clone());
                for net in ranges {
                    c.elements
                        .push(firewall_allow(&key, net.network(), net.broadcast()));
                }
            }
        }
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

/// The nodes that hold a share of `svc`: those hosting its endpoints, those that admit its load
/// balancer IPs as sources ([`admits_load_balancer_sources`]), and every node when topology
/// hints make each node choose.
pub fn nodes_of<'a>(
    index: &'a Index,
    svc: &ServiceInfo,
    all: &ServiceEndpoints,
) -> BTreeSet<&'a str> {
    if all.topology_dependent() {
        return index.nodes().map(|n| n.name.as_str()).collect();
    }
    let mut nodes: BTreeSet<&'a str> = all
        .0
        .iter()
        .flat_map(|f| f.values())
        .flat_map(|eps| endpoints::hosting_nodes(eps))
        .filter_map(|n| index.node(n))
        .map(|n| n.name.as_str())
        .collect();
    if depends_on_node_addresses(svc) {
        nodes.extend(
            index
                .nodes()
                .filter(|n| {
                    IpFamily::ALL
                        .iter()
                        .any(|f| admits_load_balancer_sources(svc, n, *f))
                })
                .map(|n| n.name.as_str()),
        );
    }
    nodes
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
    if admits_load_balancer_sources(svc, node, family) {
        // Every load balancer IP of the family as a source of each of them, as kube-proxy's
        // firewall chain lists them, except where a range already admits it: the shared part
        // holds those ranges, and the kernel refuses an interval beginning inside another.
        let ranges = firewall_ranges(svc, family).unwrap_or_default();
        let sources: Vec<IpAddr> = dst
            .load_balancer
            .iter()
            .copied()
            .filter(|ip| !ranges.iter().any(|n| n.contains(ip)))
            .collect();
        for port in &svc.ports {
            for &ip in &dst.load_balancer {
                let key = addr_key(ip, port);
                for &source in &sources {
                    c.elements.push(firewall_allow(&key, source, source));
                }
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn lb(ips: &[&str], ranges: &[&str]) -> ServiceInfo {
        ServiceInfo {
            load_balancer_ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
            source_ranges: ranges.iter().map(|r| r.parse().unwrap()).collect(),
            ..Default::default()
        }
    }

    fn node_at(ips: &[&str]) -> NodeInfo {
        let ips: Vec<IpAddr> = ips.iter().map(|i| i.parse().unwrap()).collect();
        NodeInfo {
            name: "n".into(),
            addresses: ips.clone(),
            primary: ips,
            ..Default::default()
        }
    }

    /// kube-proxy judges each family on its own: ranges of one family do not close the load
    /// balancer IPs of the other, and a zero-length range is "allow any".
    #[test]
    fn source_ranges_apply_per_family() {
        let s = lb(&["198.51.100.1", "2001:db8::1"], &["192.0.2.0/24"]);
        assert!(firewall_ranges(&s, IpFamily::V4).is_some());
        assert!(firewall_ranges(&s, IpFamily::V6).is_none());
        let any = lb(&["198.51.100.1"], &["192.0.2.0/24", "0.0.0.0/0"]);
        assert!(firewall_ranges(&any, IpFamily::V4).is_none());
        assert!(!depends_on_node_addresses(&any));
        let no_lb = lb(&[], &["192.0.2.0/24"]);
        assert!(!depends_on_node_addresses(&no_lb));
    }

    /// Only the node's IP of the family (its primary address) counts, as kube-proxy's node IP.
    #[test]
    fn the_nodes_primary_address_decides() {
        let s = lb(
            &["198.51.100.1", "2001:db8::1"],
            &["192.0.2.0/24", "2001:db8:1::/48"],
        );
        let inside = node_at(&["192.0.2.7", "2001:db8:2::7"]);
        assert!(admits_load_balancer_sources(&s, &inside, IpFamily::V4));
        assert!(!admits_load_balancer_sources(&s, &inside, IpFamily::V6));
        let mut secondary = node_at(&["203.0.113.7"]);
        secondary.addresses.push("192.0.2.7".parse().unwrap());
        assert!(!admits_load_balancer_sources(&s, &secondary, IpFamily::V4));
    }
}
