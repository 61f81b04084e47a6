//! Which endpoints serve one Service port, as kube-proxy's `CategorizeEndpoints`
//! (pkg/proxy/topology.go) decides: the slices of the Service merged, the slice port matched by
//! name and protocol, duplicates counted once; ready endpoints first, serving-and-terminating
//! ones only when none is ready; topology hints honoured when every ready endpoint has them.
use std::collections::BTreeMap;
use std::net::IpAddr;

use splitproxy_proto::family::IpFamily;

use crate::index::Index;
use crate::objects::{NodeInfo, ServiceInfo, ServicePort};

/// One endpoint of one Service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortEndpoint {
    pub ip: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node: Option<String>,
    pub zone_hints: Vec<String>,
    pub node_hints: Vec<String>,
}

impl PortEndpoint {
    pub fn addr(&self) -> (IpAddr, u16) {
        (self.ip, self.port)
    }
    fn serving_terminating(&self) -> bool {
        self.serving && self.terminating
    }
    /// May get new connections in some case (ready, or serving while terminating).
    pub fn usable(&self) -> bool {
        self.ready || self.serving_terminating()
    }
    fn is_local(&self, node: &str) -> bool {
        self.node.as_deref() == Some(node)
    }
}

/// Every endpoint of `port` of `svc` in the given family, sorted by address, one per ip:port.
/// When slices disagree about an endpoint, the ready (then serving) copy wins, as in kube-proxy's
/// endpoint slice cache.
pub fn port_endpoints(
    index: &Index,
    svc: &ServiceInfo,
    port: &ServicePort,
    family: IpFamily,
) -> Vec<PortEndpoint> {
    let mut all: BTreeMap<(IpAddr, u16), PortEndpoint> = BTreeMap::new();
    for slice in index.slices_of(&svc.key).filter(|s| s.family == family) {
        // kube-proxy matches a slice port to a Service port by name (and protocol); a slice
        // without a matching port contributes nothing to this Service port.
        let Some(sp) = slice
            .ports
            .iter()
            .find(|p| p.name == port.name && p.protocol == port.protocol)
        else {
            continue;
        };
        for ep in &slice.endpoints {
            // Addresses of one endpoint are fungible; like kube-proxy, use the first one.
            let Some(ip) = ep.addresses.first() else {
                continue;
            };
            let candidate = PortEndpoint {
                ip: *ip,
                port: sp.port,
                ready: ep.ready,
                serving: ep.serving,
                terminating: ep.terminating,
                node: ep.node_name.clone(),
                zone_hints: ep.zone_hints.clone(),
                node_hints: ep.node_hints.clone(),
            };
            let rank = |e: &PortEndpoint| (e.ready, e.serving);
            match all.get(&candidate.addr()) {
                Some(existing) if rank(existing) >= rank(&candidate) => {}
                _ => {
                    all.insert(candidate.addr(), candidate);
                }
            }
        }
    }
    all.into_values().collect()
}

/// How hints narrow a node's choice (kube-proxy's `topologyModeFromHints`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Topology {
    All,
    SameNode,
    SameZone,
}

fn topology_mode(eps: &[PortEndpoint], node: &str, zone: Option<&str>) -> Topology {
    let ready = || eps.iter().filter(|e| e.ready);
    let all_node_hints = ready().all(|e| !e.node_hints.is_empty());
    if all_node_hints && ready().any(|e| e.node_hints.iter().any(|n| n == node)) {
        return Topology::SameNode;
    }
    let all_zone_hints = ready().all(|e| !e.zone_hints.is_empty());
    if let Some(zone) = zone
        && all_zone_hints
        && ready().any(|e| e.zone_hints.iter().any(|z| z == zone))
    {
        return Topology::SameZone;
    }
    Topology::All
}

/// Whether hints can make nodes choose differently: every ready endpoint (and there is one)
/// carries zone or node hints.
pub fn topology_dependent(eps: &[PortEndpoint]) -> bool {
    let mut ready = eps.iter().filter(|e| e.ready).peekable();
    ready.peek().is_some()
        && (eps
            .iter()
            .filter(|e| e.ready)
            .all(|e| !e.node_hints.is_empty())
            || eps
                .iter()
                .filter(|e| e.ready)
                .all(|e| !e.zone_hints.is_empty()))
}

/// The endpoints for cluster-wide traffic policy: ready ones (for `node`, those its topology
/// hints select), or, when there are none, serving-and-terminating ones. `node = None` ignores
/// hints.
pub fn cluster_endpoints(eps: &[PortEndpoint], node: Option<&NodeInfo>) -> Vec<(IpAddr, u16)> {
    let mode = match node {
        Some(n) => topology_mode(eps, &n.name, n.zone.as_deref()),
        None => Topology::All,
    };
    let fits = |e: &PortEndpoint| match (mode, node) {
        (Topology::SameNode, Some(n)) => e.node_hints.contains(&n.name),
        (Topology::SameZone, Some(n)) => e
            .zone_hints
            .iter()
            .any(|h| Some(h.as_str()) == n.zone.as_deref()),
        _ => true,
    };
    let ready: Vec<_> = eps
        .iter()
        .filter(|e| e.ready && fits(e))
        .map(PortEndpoint::addr)
        .collect();
    if !ready.is_empty() {
        return ready;
    }
    eps.iter()
        .filter(|e| e.serving_terminating() && fits(e))
        .map(PortEndpoint::addr)
        .collect()
}

/// The endpoints for node-local traffic policy on `node`: its ready endpoints, or, when it has
/// none, its serving-and-terminating ones.
pub fn local_endpoints(eps: &[PortEndpoint], node: &str) -> Vec<(IpAddr, u16)> {
    let ready: Vec<_> = eps
        .iter()
        .filter(|e| e.ready && e.is_local(node))
        .map(PortEndpoint::addr)
        .collect();
    if !ready.is_empty() {
        return ready;
    }
    eps.iter()
        .filter(|e| e.serving_terminating() && e.is_local(node))
        .map(PortEndpoint::addr)
        .collect()
}

/// Any endpoint that may get new connections anywhere (otherwise the port is refused).
pub fn has_usable(eps: &[PortEndpoint]) -> bool {
    eps.iter().any(PortEndpoint::usable)
}

/// The nodes hosting usable endpoints.
pub fn hosting_nodes(eps: &[PortEndpoint]) -> impl Iterator<Item = &str> {
    eps.iter()
        .filter(|e| e.usable())
        .filter_map(|e| e.node.as_deref())
}
