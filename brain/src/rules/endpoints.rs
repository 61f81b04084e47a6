//! Which endpoints serve one Service port: the slices of the Service merged, the slice port
//! matched by name and protocol, duplicates counted once.
use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::index::Index;
use crate::objects::{ServiceInfo, ServicePort};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServicePortEndpoints {
    /// Endpoint address and target port, sorted, without duplicates.
    pub endpoints: Vec<(IpAddr, u16)>,
}

/// The ready endpoints of `port` of `svc` in the given family.
pub fn service_port_endpoints(
    index: &Index,
    svc: &ServiceInfo,
    port: &ServicePort,
    ipv6: bool,
) -> ServicePortEndpoints {
    let mut set = BTreeSet::new();
    for slice in index.slices_of(&svc.key).filter(|s| s.ipv6 == ipv6) {
        // kube-proxy matches a slice port to a Service port by name (and protocol); a slice
        // without a matching port contributes nothing to this Service port.
        let Some(sp) = slice
            .ports
            .iter()
            .find(|p| p.name == port.name && p.protocol == port.protocol)
        else {
            continue;
        };
        // Addresses of one endpoint are fungible; like kube-proxy, use the first (usable) one.
        for ep in slice.endpoints.iter().filter(|e| e.ready) {
            if let Some(ip) = ep.addresses.first() {
                set.insert((*ip, sp.port));
            }
        }
    }
    ServicePortEndpoints {
        endpoints: set.into_iter().collect(),
    }
}
