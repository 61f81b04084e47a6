//! Kubernetes objects reduced to what the dataplane needs, validated on the way in. A malformed
//! object (or the malformed part of one) is logged with its name, counted and skipped; it never
//! stops the others.
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;

use crate::metrics::Metrics;

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// namespace/name of a namespaced object.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
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
}

/// A Service the dataplane forwards for. Headless and ExternalName Services never become one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceInfo {
    pub key: ObjectKey,
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceInfo {
    pub key: ObjectKey,
    /// The Service this slice belongs to (its `kubernetes.io/service-name` label).
    pub service: ObjectKey,
    pub ipv6: bool,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, if the controller set it.
    pub trigger_time: Option<k8s_openapi::jiff::Timestamp>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeInfo {
    pub name: String,
    pub addresses: Vec<IpAddr>,
    pub zone: Option<String>,
}

/// Reduces a Service; `None` for Services that get no rules or are invalid.
/// ClusterIPs outside `service_cidrs` (when any are configured) are skipped: an address the
/// dataplane does not consider a Service address must not be captured by Service rules.
pub fn service(
    svc: &Service,
    service_cidrs: &[ipnet::IpNet],
    metrics: &Metrics,
) -> Option<Arc<ServiceInfo>> {
    let key = ObjectKey::of(svc);
    let spec = svc.spec.as_ref()?;
    if spec.type_.as_deref() == Some("ExternalName") {
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
            Ok(ip) if service_cidrs.is_empty() || service_cidrs.iter().any(|n| n.contains(&ip)) => {
                cluster_ips.push(ip)
            }
            Ok(ip) => {
                metrics.invalid("Service", "cluster_ip_outside_service_cidr");
                tracing::warn!(service = %key, cluster_ip = %ip, ?service_cidrs,
                    "skipping clusterIP outside the configured service CIDRs");
            }
            Err(_) => {
                metrics.invalid("Service", "cluster_ip_unparsable");
                tracing::warn!(service = %key, cluster_ip = %raw, "skipping unparsable clusterIP");
            }
        }
    }
    let mut ports = Vec::new();
    for p in spec.ports.iter().flatten() {
        let Some(protocol) = Protocol::parse(p.protocol.as_deref()) else {
            metrics.invalid("Service", "protocol_unknown");
            tracing::warn!(service = %key, protocol = ?p.protocol, "skipping port with unknown protocol");
            continue;
        };
        let Ok(port) = u16::try_from(p.port) else {
            metrics.invalid("Service", "port_out_of_range");
            tracing::warn!(service = %key, port = p.port, "skipping port out of range");
            continue;
        };
        ports.push(ServicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol,
            port,
        });
    }
    Some(Arc::new(ServiceInfo {
        key,
        cluster_ips,
        ports,
    }))
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

/// Reduces an EndpointSlice; `None` if it belongs to no Service or has an address type the
/// dataplane does not forward to (FQDN).
pub fn slice(slice: &EndpointSlice, metrics: &Metrics) -> Option<Arc<SliceInfo>> {
    let key = ObjectKey::of(slice);
    let service_name = slice.labels().get(SERVICE_NAME_LABEL)?.clone();
    let ipv6 = match slice.address_type.as_str() {
        "IPv4" => false,
        "IPv6" => true,
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
                metrics.invalid("EndpointSlice", "port_invalid");
                tracing::warn!(slice = %key, port = ?p.port, protocol = ?p.protocol, "skipping invalid slice port");
            }
        }
    }
    let mut endpoints = Vec::new();
    for ep in slice.endpoints.iter().flatten() {
        let mut addresses = Vec::new();
        for raw in &ep.addresses {
            match raw.parse::<IpAddr>() {
                Ok(ip) if ip.is_ipv6() == ipv6 && usable_endpoint_ip(ip) => addresses.push(ip),
                _ => {
                    metrics.invalid("EndpointSlice", "endpoint_address_unusable");
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
        });
    }
    let trigger_time = slice
        .annotations()
        .get(TRIGGER_TIME_ANNOTATION)
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok());
    Some(Arc::new(SliceInfo {
        service: ObjectKey::new(key.namespace.clone(), service_name),
        key,
        ipv6,
        ports,
        endpoints,
        trigger_time,
    }))
}

pub fn node(node: &Node) -> NodeInfo {
    let addresses = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect();
    NodeInfo {
        name: node.name_any(),
        addresses,
        zone: node.labels().get("topology.kubernetes.io/zone").cloned(),
    }
}
