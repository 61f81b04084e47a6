//! The sets and maps of a family's table: their names, key types and what they mean.
//!
//! Destinations come in two key spaces: an address key `addr . inet_proto . inet_service`
//! (ClusterIPs, externalIPs, load balancer IPs) and a NodePort key `inet_proto . inet_service`
//! (reached on the node's addresses in `nodeport-ips`). Each space has its own maps, because nft
//! cannot put a constant address into a concatenation.
use splitproxy_proto::family::IpFamily;
use splitproxy_proto::v1::{ConntrackRole, DataType, Set};

pub const CLUSTER_IPS: &str = "cluster-ips";
pub const NODEPORT_IPS: &str = "nodeport-ips";
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
pub const SERVICE_ENDPOINTS: &str = "service-endpoints";
pub const NODEPORT_ENDPOINTS: &str = "nodeport-endpoints";
pub const LOCAL_ENDPOINTS: &str = "local-endpoints";
pub const NODEPORT_LOCAL_ENDPOINTS: &str = "nodeport-local-endpoints";
/// externalIPs / LB IPs / NodePorts of `externalTrafficPolicy: Cluster` Services: masqueraded.
pub const EXTERNAL_CLUSTER: &str = "external-cluster-services";
pub const NODEPORT_CLUSTER: &str = "nodeport-cluster-services";
/// The same for `externalTrafficPolicy: Local`: to local endpoints, unmasqueraded.
pub const EXTERNAL_LOCAL: &str = "external-local-services";
pub const NODEPORT_LOCAL: &str = "nodeport-local-services";
/// ClusterIP ports of `internalTrafficPolicy: Local` Services with endpoints somewhere.
pub const INTERNAL_LOCAL: &str = "internal-local-services";
pub const FIREWALL_IPS: &str = "firewall-ips";
pub const FIREWALL_ALLOW: &str = "firewall-allow";
pub const AFFINITY: &str = "affinity";
pub const AFFINITY_MEMBERS: &str = "affinity-members";
pub const NODEPORT_AFFINITY: &str = "nodeport-affinity";
pub const NODEPORT_AFFINITY_MEMBERS: &str = "nodeport-affinity-members";
pub const HAIRPIN: &str = "hairpin-endpoints";
pub const LOCAL_POD_CIDRS: &str = "local-pod-cidrs";
/// The actuator serves a kube-proxy-style health check on each port of this set (comment:
/// `namespace/name`), answering with the count in `health-check-local-endpoints` (0 if absent).
pub const HEALTH_CHECK_NODEPORTS: &str = "health-check-nodeports";
pub const HEALTH_CHECK_LOCAL_ENDPOINTS: &str = "health-check-local-endpoints";

/// Families of per-count sets: the Service ports whose chosen endpoints number N, one DNAT
/// rule per family and N.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Cluster-wide choice for address keys.
    Service,
    /// Cluster-wide choice for NodePorts.
    NodePort,
    /// `internalTrafficPolicy: Local` ClusterIPs: this node's endpoints, every source.
    Local,
    /// `externalTrafficPolicy: Local` address keys: this node's endpoints, external sources.
    ExternalLocal,
    /// `externalTrafficPolicy: Local` NodePorts: this node's endpoints, external sources.
    NodePortLocal,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::Local,
        Kind::ExternalLocal,
        Kind::NodePortLocal,
        Kind::Service,
        Kind::NodePort,
    ];

    pub fn set_name(self, n: u32) -> String {
        let prefix = match self {
            Kind::Service => "service-ports",
            Kind::NodePort => "nodeport-ports",
            Kind::Local => "local-ports",
            Kind::ExternalLocal => "external-local-ports",
            Kind::NodePortLocal => "nodeport-local-ports",
        };
        format!("{prefix}-{n}")
    }

    pub fn map(self) -> &'static str {
        match self {
            Kind::Service => SERVICE_ENDPOINTS,
            Kind::NodePort => NODEPORT_ENDPOINTS,
            Kind::Local | Kind::ExternalLocal => LOCAL_ENDPOINTS,
            Kind::NodePortLocal => NODEPORT_LOCAL_ENDPOINTS,
        }
    }

    pub fn nodeport(self) -> bool {
        matches!(self, Kind::NodePort | Kind::NodePortLocal)
    }

    /// Applies to traffic from outside only (neither a local pod nor the node itself).
    pub fn external_only(self) -> bool {
        matches!(self, Kind::ExternalLocal | Kind::NodePortLocal)
    }

    fn describe(self) -> &'static str {
        match self {
            Kind::Service => "Service ports",
            Kind::NodePort => "NodePorts",
            Kind::Local => "internal-local Service ports",
            Kind::ExternalLocal => "external-local Service ports",
            Kind::NodePortLocal => "external-local NodePorts",
        }
    }
}

/// Sets created and deleted with their use: per-count sets and per-timeout affinity sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DynSet {
    Count(Kind, u32),
    /// Session affinity with this timeout (seconds).
    Affinity(u32),
    /// The same for NodePorts.
    NodePortAffinity(u32),
}

impl DynSet {
    pub fn name(self) -> String {
        match self {
            DynSet::Count(k, n) => k.set_name(n),
            DynSet::Affinity(t) => format!("affinity-services-{t}"),
            DynSet::NodePortAffinity(t) => format!("nodeport-affinity-services-{t}"),
        }
    }

    pub fn def(self, family: IpFamily) -> Set {
        match self {
            DynSet::Count(k, n) => {
                let endpoints = if n == 1 {
                    "1 endpoint".to_string()
                } else {
                    format!("{n} endpoints")
                };
                set(
                    &self.name(),
                    key_of(k.nodeport(), family),
                    vec![],
                    &format!("{} with {endpoints}", k.describe()),
                )
            }
            DynSet::Affinity(t) => set(
                &self.name(),
                key_of(false, family),
                vec![],
                &format!("Service ports with session affinity for {t}s"),
            ),
            DynSet::NodePortAffinity(t) => set(
                &self.name(),
                key_of(true, family),
                vec![],
                &format!("NodePorts with session affinity for {t}s"),
            ),
        }
    }
}

pub fn addr_type(family: IpFamily) -> DataType {
    match family {
        IpFamily::V4 => DataType::Ipv4Addr,
        IpFamily::V6 => DataType::Ipv6Addr,
    }
}

/// `addr . inet_proto . inet_service`, or `inet_proto . inet_service` for NodePorts.
pub fn key_of(nodeport: bool, family: IpFamily) -> Vec<DataType> {
    let mut k = vec![DataType::InetProto, DataType::InetService];
    if !nodeport {
        k.insert(0, addr_type(family));
    }
    k
}

pub fn set(name: &str, key: Vec<DataType>, data: Vec<DataType>, comment: &str) -> Set {
    Set {
        name: name.into(),
        key: key.into_iter().map(|t| t as i32).collect(),
        data: data.into_iter().map(|t| t as i32).collect(),
        comment: comment.into(),
        ..Default::default()
    }
}

/// Every fixed set of a family's table.
pub fn fixed_sets(family: IpFamily) -> Vec<Set> {
    let addr = addr_type(family);
    let k = key_of(false, family);
    let np = key_of(true, family);
    let slot = |mut key: Vec<DataType>| {
        key.push(DataType::Integer);
        key
    };
    let ep = vec![addr, DataType::InetService];
    let endpoints = |name: &str, key: Vec<DataType>, comment: &str| Set {
        conntrack: ConntrackRole::Endpoints as i32,
        ..set(name, slot(key), ep.clone(), comment)
    };
    let no_endpoints = |name: &str, key: Vec<DataType>, comment: &str| Set {
        conntrack: ConntrackRole::NoEndpoints as i32,
        ..set(name, key, vec![], comment)
    };
    let mut sets = vec![
        set(CLUSTER_IPS, vec![addr], vec![], "Active ClusterIPs"),
        set(
            NODEPORT_IPS,
            vec![addr],
            vec![],
            "Addresses NodePorts are reachable on",
        ),
        no_endpoints(
            NO_ENDPOINT_SERVICES,
            k.clone(),
            "Service ports without endpoints",
        ),
        no_endpoints(
            NO_ENDPOINT_NODEPORTS,
            np.clone(),
            "NodePorts without endpoints",
        ),
        endpoints(
            SERVICE_ENDPOINTS,
            k.clone(),
            "Service port . slot -> endpoint",
        ),
        endpoints(
            NODEPORT_ENDPOINTS,
            np.clone(),
            "NodePort . slot -> endpoint",
        ),
        endpoints(
            LOCAL_ENDPOINTS,
            k.clone(),
            "Service port . slot -> endpoint on this node",
        ),
        endpoints(
            NODEPORT_LOCAL_ENDPOINTS,
            np.clone(),
            "NodePort . slot -> endpoint on this node",
        ),
        set(
            EXTERNAL_CLUSTER,
            k.clone(),
            vec![],
            "External destinations of Cluster-policy Services (masqueraded)",
        ),
        set(
            NODEPORT_CLUSTER,
            np.clone(),
            vec![],
            "NodePorts of Cluster-policy Services (masqueraded)",
        ),
        set(
            EXTERNAL_LOCAL,
            k.clone(),
            vec![],
            "External destinations of Local-policy Services",
        ),
        set(
            NODEPORT_LOCAL,
            np.clone(),
            vec![],
            "NodePorts of Local-policy Services",
        ),
        set(
            INTERNAL_LOCAL,
            k.clone(),
            vec![],
            "ClusterIP ports of internalTrafficPolicy Local Services",
        ),
        set(
            FIREWALL_IPS,
            k.clone(),
            vec![],
            "Load balancer ports with source ranges",
        ),
        Set {
            interval: true,
            ..set(
                FIREWALL_ALLOW,
                [k.as_slice(), &[addr]].concat(),
                vec![],
                "Load balancer port . allowed source range",
            )
        },
        Set {
            timeout: true,
            dynamic: true,
            ..set(
                AFFINITY,
                [&[addr][..], k.as_slice()].concat(),
                ep.clone(),
                "Client . Service port -> endpoint (session affinity)",
            )
        },
        Set {
            timeout: true,
            dynamic: true,
            ..set(
                NODEPORT_AFFINITY,
                [&[addr][..], np.as_slice()].concat(),
                ep.clone(),
                "Client . NodePort -> endpoint (session affinity)",
            )
        },
        Set {
            guards: NODEPORT_AFFINITY.into(),
            ..set(
                NODEPORT_AFFINITY_MEMBERS,
                [np.as_slice(), ep.as_slice()].concat(),
                vec![],
                "NodePort . endpoint pairs valid for session affinity",
            )
        },
        Set {
            guards: AFFINITY.into(),
            ..set(
                AFFINITY_MEMBERS,
                [k.as_slice(), ep.as_slice()].concat(),
                vec![],
                "Service port . endpoint pairs valid for session affinity",
            )
        },
        set(
            HAIRPIN,
            vec![addr, addr],
            vec![],
            "Endpoint . itself for this node's endpoints (hairpin masquerade)",
        ),
        Set {
            interval: true,
            ..set(LOCAL_POD_CIDRS, vec![addr], vec![], "This node's pod CIDRs")
        },
    ];
    // One health check server per node port, whatever the Service's families: the sets live
    // in the ip table only.
    if family == IpFamily::V4 {
        sets.push(set(
            HEALTH_CHECK_NODEPORTS,
            vec![DataType::InetService],
            vec![DataType::Integer],
            "healthCheckNodePorts served by the actuator",
        ));
        sets.push(set(
            HEALTH_CHECK_LOCAL_ENDPOINTS,
            vec![DataType::InetService],
            vec![DataType::Integer],
            "healthCheckNodePort -> this node's endpoints",
        ));
    }
    sets
}
