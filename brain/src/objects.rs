//! Kubernetes objects reduced to what the dataplane needs, validated on the way in. A malformed
//! object (or the malformed part of one) is logged with its name, counted and skipped; it never
//! stops the others.
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use splitproxy_proto::family::IpFamily;

use crate::metrics::Metrics;

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// The kind of object a validation skips (in part): the `kind` label of
/// `splitproxy_brain_invalid_objects_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ObjectKind {
    Service,
    EndpointSlice,
}

impl ObjectKind {
    /// The metric label: the Kubernetes kind.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectKind::Service => "Service",
            ObjectKind::EndpointSlice => "EndpointSlice",
        }
    }
}

impl std::fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an object, or a part of one, was skipped: the `reason` label of
/// `splitproxy_brain_invalid_objects_total`. Each reason belongs to one kind of object, so a
/// count can never pair a reason with the wrong kind. The labels are an interface (dashboards
/// and the end-to-end tests read them): a variant may be added, a label never changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum InvalidReason {
    /// A clusterIP that is not an address.
    ClusterIpUnparsable,
    /// A Service port whose protocol is not TCP, UDP or SCTP.
    ProtocolUnknown,
    /// A Service port number outside 0..=65535.
    PortOutOfRange,
    /// An externalIP that is not a usable unicast address.
    ExternalIpInvalid,
    /// A load balancer ingress IP that is not a usable unicast address.
    LoadBalancerIpInvalid,
    /// A loadBalancerSourceRange that is not a prefix.
    SourceRangeInvalid,
    /// An EndpointSlice port without a known protocol or a non-zero number.
    SlicePortInvalid,
    /// An endpoint address that is not a unicast address of the slice's family.
    EndpointAddressUnusable,
    /// An EndpointSlice without a port matching a port of its Service (by name and protocol).
    NoMatchingServicePort,
}

impl InvalidReason {
    pub const ALL: [InvalidReason; 9] = [
        InvalidReason::ClusterIpUnparsable,
        InvalidReason::ProtocolUnknown,
        InvalidReason::PortOutOfRange,
        InvalidReason::ExternalIpInvalid,
        InvalidReason::LoadBalancerIpInvalid,
        InvalidReason::SourceRangeInvalid,
        InvalidReason::SlicePortInvalid,
        InvalidReason::EndpointAddressUnusable,
        InvalidReason::NoMatchingServicePort,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            InvalidReason::ClusterIpUnparsable => "cluster_ip_unparsable",
            InvalidReason::ProtocolUnknown => "protocol_unknown",
            InvalidReason::PortOutOfRange => "port_out_of_range",
            InvalidReason::ExternalIpInvalid => "external_ip_invalid",
            InvalidReason::LoadBalancerIpInvalid => "load_balancer_ip_invalid",
            InvalidReason::SourceRangeInvalid => "source_range_invalid",
            InvalidReason::SlicePortInvalid => "port_invalid",
            InvalidReason::EndpointAddressUnusable => "endpoint_address_unusable",
            InvalidReason::NoMatchingServicePort => "no_matching_service_port",
        }
    }

    /// The kind of object this reason skips.
    pub fn kind(self) -> ObjectKind {
        match self {
            InvalidReason::ClusterIpUnparsable
            | InvalidReason::ProtocolUnknown
            | InvalidReason::PortOutOfRange
            | InvalidReason::ExternalIpInvalid
            | InvalidReason::LoadBalancerIpInvalid
            | InvalidReason::SourceRangeInvalid => ObjectKind::Service,
            InvalidReason::SlicePortInvalid
            | InvalidReason::EndpointAddressUnusable
            | InvalidReason::NoMatchingServicePort => ObjectKind::EndpointSlice,
        }
    }
}

impl std::fmt::Display for InvalidReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// namespace/name of a namespaced object. Shared strings: the overlays keep a key per (node,
/// Service) pair in several indexes, 100k pairs at 5,000 nodes, and a clone must not allocate.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ObjectKey {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ObjectKey {
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
        ObjectKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
    pub fn of<K: ResourceExt>(obj: &K) -> Self {
        ObjectKey::new(obj.namespace().unwrap_or_default(), obj.name_any())
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Transport protocols, numbered as in the IP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp = 6,
    Udp = 17,
    Sctp = 132,
}

impl Protocol {
    pub fn parse(s: Option<&str>) -> Option<Protocol> {
        match s.unwrap_or("TCP") {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
    /// Allocated for NodePort and LoadBalancer Services (unless
    /// `allocateLoadBalancerNodePorts: false`).
    pub node_port: Option<u16>,
}

/// A Service the dataplane forwards for. Headless and ExternalName Services never become one.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceInfo {
    pub key: ObjectKey,
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`, except `ipMode: Proxy` ones (the load balancer
    /// proxies those itself, so kube-proxy leaves them alone).
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges`, without the ranges another one contains: when set,
    /// only these clients may use the LB IPs of their family.
    pub source_ranges: Vec<ipnet::IpNet>,
    /// `externalTrafficPolicy: Local` on a Service reachable from outside (NodePort,
    /// LoadBalancer or externalIPs).
    pub external_local: bool,
    /// `internalTrafficPolicy: Local`.
    pub internal_local: bool,
    /// `sessionAffinity: ClientIP`: how long a client keeps its endpoint, in seconds.
    pub affinity_timeout: Option<u32>,
    /// `spec.healthCheckNodePort` of a LoadBalancer Service with `externalTrafficPolicy: Local`.
    pub health_check_node_port: Option<u16>,
}

impl ServiceInfo {
    /// NodePort, LoadBalancer or with externalIPs: the external traffic policy applies.
    pub fn externally_accessible(&self) -> bool {
        self.ports.iter().any(|p| p.node_port.is_some())
            || !self.external_ips.is_empty()
            || !self.load_balancer_ips.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub addresses: Vec<IpAddr>,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
    pub zone: Option<String>,
    /// `hints.forZones`: zones whose nodes should prefer this endpoint.
    pub zone_hints: Vec<String>,
    /// `hints.forNodes`: nodes that should prefer this endpoint.
    pub node_hints: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceInfo {
    pub key: ObjectKey,
    /// The Service this slice belongs to (its `kubernetes.io/service-name` label).
    pub service: ObjectKey,
    /// `addressType`: every address of the slice is of this family.
    pub family: IpFamily,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, if the controller set it.
    pub trigger_time: Option<k8s_openapi::jiff::Timestamp>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Hash)]
pub struct NodeInfo {
    pub name: String,
    /// InternalIPs first (in the Node's order), then ExternalIPs.
    pub addresses: Vec<IpAddr>,
    /// The first InternalIP of each family (kube-proxy's node IPs); ExternalIPs when a family
    /// has no InternalIP.
    pub primary: Vec<IpAddr>,
    pub zone: Option<String>,
    /// `spec.podCIDRs`.
    pub pod_cidrs: Vec<ipnet::IpNet>,
}

pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// A Service or EndpointSlice with this label (any value) is no Service proxy's: kube-proxy
/// lists both through one selector that excludes it (`!service.kubernetes.io/headless`), so a
/// slice that gains it stops being served, as if deleted (the upstream e2e test "should
/// implement service.kubernetes.io/headless").
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
/// kube-proxy's default session affinity timeout (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;

/// What the brain needs to reduce Services. The service CIDRs are not part of it: like
/// kube-proxy, the brain serves a Service whatever range its ClusterIP came from (a cluster
/// grows its ranges with ServiceCIDR objects the brain may not follow, for example with
/// `--service-cidr`); the ranges only say which unallocated addresses to drop
/// ([`crate::rules::chains`]).
#[derive(Debug, Clone, Default)]
pub struct ServiceFilter {
    /// `--service-proxy-name`: Services labelled for another proxy are not ours.
    pub proxy_name: String,
}

/// Reduces a Service; `None` for Services that get no rules or are invalid.
pub fn service(
    svc: &Service,
    filter: &ServiceFilter,
    metrics: &Metrics,
) -> Option<Arc<ServiceInfo>> {
    let key = ObjectKey::of(svc);
    // Like kube-proxy: a Service labelled for another proxy is that proxy's; with a name set,
    // only Services labelled with it are ours.
    let proxy = svc
        .labels()
        .get(SERVICE_PROXY_NAME_LABEL)
        .map(String::as_str);
    if proxy.unwrap_or("") != filter.proxy_name {
        return None;
    }
    if svc.labels().contains_key(HEADLESS_LABEL) {
        return None;
    }
    let spec = svc.spec.as_ref()?;
    let ty = spec.type_.as_deref().unwrap_or("ClusterIP");
    if ty == "ExternalName" {
        return None;
    }
    let raw_ips: Vec<&String> = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.iter().collect(),
        _ => spec.cluster_ip.iter().collect(),
    };
    if raw_ips.iter().any(|ip| ip.as_str() == "None") {
        return None; // headless
    }
    let mut cluster_ips = Vec::new();
    for raw in raw_ips {
        match raw.parse::<IpAddr>() {
            Ok(ip) => cluster_ips.push(ip),
            Err(_) => {
                metrics.invalid(InvalidReason::ClusterIpUnparsable);
                tracing::warn!(service = %key, cluster_ip = %raw, "skipping unparsable clusterIP");
            }
        }
    }
    let with_node_ports = ty == "NodePort" || ty == "LoadBalancer";
    let mut ports = Vec::new();
    for p in spec.ports.iter().flatten() {
        let Some(protocol) = Protocol::parse(p.protocol.as_deref()) else {
            metrics.invalid(InvalidReason::ProtocolUnknown);
            tracing::warn!(service = %key, protocol = ?p.protocol, "skipping port with unknown protocol");
            continue;
        };
        let Ok(port) = u16::try_from(p.port) else {
            metrics.invalid(InvalidReason::PortOutOfRange);
            tracing::warn!(service = %key, port = p.port, "skipping port out of range");
            continue;
        };
        let node_port = p
            .node_port
            .filter(|_| with_node_ports)
            .and_then(|n| u16::try_from(n).ok())
            .filter(|n| *n != 0);
        ports.push(ServicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol,
            port,
            node_port,
        });
    }
    let addresses = |raw: &mut dyn Iterator<Item = &String>, why: InvalidReason| {
        let mut out = Vec::new();
        for r in raw {
            match r.parse::<IpAddr>() {
                Ok(ip) if usable_endpoint_ip(ip) => out.push(ip),
                _ => {
                    metrics.invalid(why);
                    tracing::warn!(service = %key, address = %r, reason = %why, "skipping unusable address");
                }
            }
        }
        out.sort();
        out.dedup();
        out
    };
    let external_ips = addresses(
        &mut spec.external_ips.iter().flatten(),
        InvalidReason::ExternalIpInvalid,
    );
    let load_balancer_ips = if ty == "LoadBalancer" {
        let ingress = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref());
        addresses(
            &mut ingress
                .into_iter()
                .flatten()
                .filter(|i| i.ip_mode.as_deref() != Some("Proxy"))
                .filter_map(|i| i.ip.as_ref()),
            InvalidReason::LoadBalancerIpInvalid,
        )
    } else {
        Vec::new()
    };
    let mut source_ranges = Vec::new();
    if ty == "LoadBalancer" {
        for r in spec.load_balancer_source_ranges.iter().flatten() {
            match r.trim().parse::<ipnet::IpNet>() {
                Ok(n) => source_ranges.push(n.trunc()),
                Err(_) => {
                    metrics.invalid(InvalidReason::SourceRangeInvalid);
                    tracing::warn!(service = %key, range = %r, "skipping invalid loadBalancerSourceRange");
                }
            }
        }
    }
    let source_ranges = outermost(source_ranges);
    let affinity_timeout = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .filter(|t| *t > 0)
            .unwrap_or(DEFAULT_AFFINITY_TIMEOUT)
    });
    let mut info = ServiceInfo {
        key,
        cluster_ips,
        ports,
        external_ips,
        load_balancer_ips,
        source_ranges,
        external_local: false,
        internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
        affinity_timeout,
        health_check_node_port: None,
    };
    info.external_local =
        info.externally_accessible() && spec.external_traffic_policy.as_deref() == Some("Local");
    if ty == "LoadBalancer" && info.external_local {
        info.health_check_node_port = spec
            .health_check_node_port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0);
    }
    Some(Arc::new(info))
}

/// The prefixes of `nets` that no other prefix of `nets` contains, sorted, each once. Two
/// prefixes are either nested or disjoint, so these cover exactly what `nets` covers; and the
/// kernel refuses an interval element that begins inside another of the same set (the
/// `firewall-allow` set holds a Service's ranges as intervals), so nested ranges must not
/// reach it.
pub fn outermost(mut nets: Vec<ipnet::IpNet>) -> Vec<ipnet::IpNet> {
    nets.sort();
    nets.dedup();
    let all = nets.clone();
    nets.retain(|n| !all.iter().any(|o| o != n && o.contains(n)));
    nets
}

/// Is `ip` an address a packet may be forwarded to? kube-proxy's dataplane cannot DNAT to
/// unspecified, loopback, multicast, broadcast or link-local addresses.
pub fn usable_endpoint_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            !(v4.is_unspecified()
                || v4.is_loopback()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_link_local())
        }
        IpAddr::V6(v6) => {
            !(v6.is_unspecified()
                || v6.is_loopback()
                || v6.is_multicast()
                || v6.is_unicast_link_local())
        }
    }
}

/// Reduces an EndpointSlice; `None` if it belongs to no Service, is labelled
/// [`HEADLESS_LABEL`], or has an address type the dataplane does not forward to (FQDN).
pub fn slice(slice: &EndpointSlice, metrics: &Metrics) -> Option<Arc<SliceInfo>> {
    if slice.labels().contains_key(HEADLESS_LABEL) {
        return None;
    }
    let key = ObjectKey::of(slice);
    let service_name = slice.labels().get(SERVICE_NAME_LABEL)?.clone();
    let family = match slice.address_type.as_str() {
        "IPv4" => IpFamily::V4,
        "IPv6" => IpFamily::V6,
        _ => return None,
    };
    let mut ports = Vec::new();
    for p in slice.ports.iter().flatten() {
        let protocol = Protocol::parse(p.protocol.as_deref());
        let port = p
            .port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0);
        match (protocol, port) {
            (Some(protocol), Some(port)) => ports.push(SlicePort {
                name: p.name.clone().unwrap_or_default(),
                protocol,
                port,
            }),
            _ => {
                metrics.invalid(InvalidReason::SlicePortInvalid);
                tracing::warn!(slice = %key, port = ?p.port, protocol = ?p.protocol, "skipping invalid slice port");
            }
        }
    }
    let mut endpoints = Vec::new();
    for ep in slice.endpoints.iter().flatten() {
        let mut addresses = Vec::new();
        for raw in &ep.addresses {
            match raw.parse::<IpAddr>() {
                Ok(ip) if family.holds(ip) && usable_endpoint_ip(ip) => addresses.push(ip),
                _ => {
                    metrics.invalid(InvalidReason::EndpointAddressUnusable);
                    tracing::warn!(slice = %key, address = %raw, address_type = %slice.address_type,
                        "skipping endpoint address that is not a unicast address of the slice's family");
                }
            }
        }
        if addresses.is_empty() {
            continue;
        }
        let cond = ep.conditions.as_ref();
        let ready = cond.and_then(|c| c.ready).unwrap_or(true);
        endpoints.push(Endpoint {
            addresses,
            ready,
            serving: cond.and_then(|c| c.serving).unwrap_or(ready),
            terminating: cond.and_then(|c| c.terminating).unwrap_or(false),
            node_name: ep.node_name.clone(),
            zone: ep.zone.clone(),
            zone_hints: ep
                .hints
                .iter()
                .flat_map(|h| h.for_zones.iter().flatten())
                .map(|z| z.name.clone())
                .collect(),
            node_hints: ep
                .hints
                .iter()
                .flat_map(|h| h.for_nodes.iter().flatten())
                .map(|n| n.name.clone())
                .collect(),
        });
    }
    let trigger_time = slice
        .annotations()
        .get(TRIGGER_TIME_ANNOTATION)
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok());
    Some(Arc::new(SliceInfo {
        service: ObjectKey::new(key.namespace.clone(), service_name),
        key,
        family,
        ports,
        endpoints,
        trigger_time,
    }))
}

pub fn node(node: &Node) -> NodeInfo {
    let addrs: Vec<(&str, IpAddr)> = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|a| Some((a.type_.as_str(), a.address.parse().ok()?)))
        .collect();
    let of = |ty: &'static str| addrs.iter().filter(move |(t, _)| *t == ty).map(|(_, a)| *a);
    let addresses: Vec<IpAddr> = of("InternalIP").chain(of("ExternalIP")).collect();
    let mut primary = Vec::new();
    for family in IpFamily::ALL {
        if let Some(a) = addresses.iter().find(|a| family.holds(**a)) {
            primary.push(*a);
        }
    }
    let pod_cidrs = node
        .spec
        .as_ref()
        .and_then(|s| {
            s.pod_cidrs
                .clone()
                .or_else(|| s.pod_cidr.clone().map(|c| vec![c]))
        })
        .unwrap_or_default()
        .iter()
        .filter_map(|c| c.parse().ok())
        .collect();
    NodeInfo {
        name: node.name_any(),
        addresses,
        primary,
        zone: node.labels().get("topology.kubernetes.io/zone").cloned(),
        pod_cidrs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The labels are read by dashboards and the end-to-end tests: pinned here, each with its
    /// kind.
    #[test]
    fn invalid_reason_labels_are_pinned() {
        let labels: Vec<(&str, &str)> = InvalidReason::ALL
            .iter()
            .map(|r| (r.kind().as_str(), r.as_str()))
            .collect();
        assert_eq!(
            labels,
            [
                ("Service", "cluster_ip_unparsable"),
                ("Service", "protocol_unknown"),
                ("Service", "port_out_of_range"),
                ("Service", "external_ip_invalid"),
                ("Service", "load_balancer_ip_invalid"),
                ("Service", "source_range_invalid"),
                ("EndpointSlice", "port_invalid"),
                ("EndpointSlice", "endpoint_address_unusable"),
                ("EndpointSlice", "no_matching_service_port"),
            ]
        );
        for r in InvalidReason::ALL {
            assert_eq!(r.to_string(), r.as_str());
        }
        assert_eq!(ObjectKind::EndpointSlice.to_string(), "EndpointSlice");
    }

    #[test]
    fn nested_source_ranges_keep_the_outer_one() {
        let nets =
            |v: &[&str]| -> Vec<ipnet::IpNet> { v.iter().map(|n| n.parse().unwrap()).collect() };
        assert_eq!(
            outermost(nets(&[
                "10.1.0.0/16",
                "192.0.2.0/24",
                "10.0.0.0/8",
                "10.1.2.3/32",
                "192.0.2.0/24",
                "2001:db8::/32",
                "2001:db8:1::/48",
            ])),
            nets(&["10.0.0.0/8", "192.0.2.0/24", "2001:db8::/32"])
        );
    }
}
