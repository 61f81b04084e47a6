//! From the index to a node's ruleset IR.
//!
//! The shape is chosen for the kernel's costs (see docs/ruleset.md, "What the kernel charges"): Services live
//! in a few large sets and maps, never in chains of their own, and no rule or element a Service
//! change touches carries a jump or goto, so the kernel never re-validates the table for it.
//! Destinations are keyed `addr . proto . port` (ClusterIPs, externalIPs, LB IPs) or
//! `proto . port` (NodePorts, on the addresses in `nodeport-ips`):
//!
//! ```text
//! services chain, in order:
//!   masquerade marks      ClusterIPs from outside the pod network (--detect-local-mode),
//!                         external destinations of Cluster-policy Services, the node's own
//!                         traffic to Local-policy ones
//!   session affinity      saddr . key -> endpoint in @affinity, if still in @affinity-members
//!   Local policies        key @local-ports-N / @external-local-ports-N / @nodeport-local-ports-N
//!                         dnat to key . numgen random mod N map @local-endpoints, then drop what
//!                         has no local endpoint (@internal-local-services, @external-local-...)
//!   cluster choice        key @service-ports-N / @nodeport-ports-N
//!                         dnat to key . numgen random mod N map @service-endpoints
//! filter hooks:           @no-endpoint-services / -nodeports rejected, unknown ClusterIP ports
//!                         rejected, free service-CIDR addresses dropped, LB source ranges;
//!                         after DNAT (forward, input, output), record affinity of DNATed
//!                         connections from conntrack's original tuple
//! postrouting:            masquerade marked packets and hairpin pairs (@hairpin-endpoints)
//! ```
//!
//! What every node holds comes from [`contribution::global`]; what only one node holds (its
//! local endpoints, its topology choice, its NodePort addresses, its hairpin pairs, its health
//! check counts, the load balancer IPs it admits as sources because a source range holds its
//! IP) from [`contribution::node`] and [`contribution::node_facts`], kept in per-node overlays
//! ([`crate::overlay`]). A Service added, removed or changing its endpoints moves elements;
//! a new endpoint count adds a set and a rule without any jump. Every object is one `nft` can
//! list, so operators can still read the table with `nft list ruleset`.
pub mod chains;
pub mod contribution;
pub mod endpoints;
pub mod ir;
pub mod sets;

use splitproxy_proto::family::IpFamily;
use splitproxy_proto::v1::{Family, Ruleset, Table};

use crate::index::Index;
pub use contribution::Contribution;
pub use sets::{DynSet, Kind};

/// Endpoint counts whose sets and rules always exist, so that endpoint changes of ordinary
/// Services only move elements.
pub const PREALLOCATED_COUNTS: u32 = 16;
/// The same for a node's own endpoints (Local traffic policies), which are usually few.
pub const PREALLOCATED_LOCAL_COUNTS: u32 = 4;

fn preallocated_counts(kind: Kind) -> u32 {
    match kind {
        Kind::Service | Kind::NodePort => PREALLOCATED_COUNTS,
        Kind::Local | Kind::ExternalLocal | Kind::NodePortLocal => PREALLOCATED_LOCAL_COUNTS,
    }
}

/// How a packet is recognised as coming from a pod on this node (kube-proxy's
/// `--detect-local-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum DetectLocalMode {
    #[value(name = "ClusterCIDR")]
    ClusterCidr,
    #[value(name = "NodeCIDR")]
    NodeCidr,
    #[value(name = "InterfaceNamePrefix")]
    InterfaceNamePrefix,
    #[value(name = "BridgeInterface")]
    BridgeInterface,
    #[value(name = "None")]
    None,
}

/// Which Node addresses NodePorts listen on (kube-proxy's `--nodeport-addresses`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum NodePortAddresses {
    /// The node's first InternalIP of each family (kube-proxy's nftables default).
    #[default]
    Primary,
    /// The node's addresses inside any of these prefixes.
    Cidrs(Vec<ipnet::IpNet>),
}

impl NodePortAddresses {
    /// Parses the flag's values: `primary`, or CIDRs.
    pub fn parse(values: &[String]) -> Result<Self, String> {
        if values.is_empty() || values.iter().all(|v| v == "primary") {
            return Ok(NodePortAddresses::Primary);
        }
        values
            .iter()
            .map(|v| {
                v.parse::<ipnet::IpNet>()
                    .map_err(|e| format!("--nodeport-addresses {v:?}: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(NodePortAddresses::Cidrs)
    }
}

#[derive(Debug, Clone)]
pub struct RulesConfig {
    /// Name of the tables splitproxy owns (`ip NAME` and `ip6 NAME`).
    pub table: String,
    /// Unallocated addresses inside these ranges are dropped.
    pub service_cidrs: Vec<ipnet::IpNet>,
    /// The cluster's pod CIDRs (`--cluster-cidr`).
    pub cluster_cidrs: Vec<ipnet::IpNet>,
    pub detect_local: DetectLocalMode,
    pub pod_interface_name_prefix: String,
    pub pod_bridge_interface: String,
    pub nodeport_addresses: NodePortAddresses,
    pub masquerade_all: bool,
    /// `--service-proxy-name`.
    pub service_proxy_name: String,
}

impl Default for RulesConfig {
    fn default() -> Self {
        RulesConfig {
            table: "splitproxy".into(),
            service_cidrs: Vec::new(),
            cluster_cidrs: Vec::new(),
            detect_local: DetectLocalMode::None,
            pod_interface_name_prefix: String::new(),
            pod_bridge_interface: String::new(),
            nodeport_addresses: NodePortAddresses::Primary,
            masquerade_all: false,
            service_proxy_name: String::new(),
        }
    }
}

/// The ruleset every node holds (without its own overlay), computed from scratch. The brain
/// maintains the same thing incrementally ([`crate::desired::SharedRuleset`]); this is the
/// reference it must equal.
pub fn ruleset(index: &Index, config: &RulesConfig) -> Ruleset {
    let mut d = crate::desired::SharedRuleset::new(config.clone());
    d.rebuild(index);
    d.model().to_ruleset()
}

/// The full ruleset of `node`: the shared one plus its overlay, computed from scratch.
pub fn node_ruleset(index: &Index, config: &RulesConfig, node: &str) -> Ruleset {
    let mut d = crate::desired::SharedRuleset::new(config.clone());
    d.rebuild(index);
    let mut overlays = crate::overlay::Overlays::new(config.clone());
    overlays.rebuild(index, &mut d);
    let mut model = d.model().clone();
    if let Some(o) = overlays.model(node) {
        model.apply(&splitproxy_proto::model::Model::default().diff(o));
    }
    model.to_ruleset()
}

/// Whether the ip6 table must exist even without IPv6 Services.
pub fn wants_ipv6(config: &RulesConfig) -> bool {
    config
        .service_cidrs
        .iter()
        .chain(&config.cluster_cidrs)
        .any(|n| IpFamily::V6.holds_net(*n))
}

/// The dynamic sets that always exist: counts 1..=16 of every kind, the default affinity.
pub fn preallocated() -> Vec<DynSet> {
    Kind::ALL
        .iter()
        .flat_map(|k| (1..=preallocated_counts(*k)).map(|n| DynSet::Count(*k, n)))
        .chain([
            DynSet::Affinity(crate::objects::DEFAULT_AFFINITY_TIMEOUT),
            DynSet::NodePortAffinity(crate::objects::DEFAULT_AFFINITY_TIMEOUT),
        ])
        .collect()
}

pub fn is_preallocated(d: DynSet) -> bool {
    match d {
        DynSet::Count(k, n) => (1..=preallocated_counts(k)).contains(&n),
        DynSet::Affinity(t) | DynSet::NodePortAffinity(t) => {
            t == crate::objects::DEFAULT_AFFINITY_TIMEOUT
        }
    }
}

/// A family's table without any Service: hooks, checks, the fixed sets, and the dynamic sets
/// `dynsets` with the rules that use them.
pub fn skeleton(config: &RulesConfig, family: IpFamily, dynsets: &[DynSet]) -> Table {
    let mut sets = sets::fixed_sets(family);
    sets.extend(dynsets.iter().map(|d| d.def(family)));
    let mut chains = chains::fixed_chains(config, family);
    chains.push(chains::services_chain(config, family, dynsets));
    chains.push(chains::affinity_record_chain(family, dynsets));
    Table {
        family: Family::from(family) as i32,
        name: config.table.clone(),
        comment: "rules for splitproxy".into(),
        chains,
        sets,
    }
}
