//! From the index to a node's ruleset IR.
//!
//! The shape is chosen for the kernel's costs (see DESIGN.md, "nftables facts"): Services live
//! in a few large sets and maps, never in chains of their own, and no rule or element a Service
//! change touches carries a jump or goto, so the kernel never re-validates the table for it:
//!
//! ```text
//! services:  one rule per endpoint count N in use (1..=16 always):
//!            ip daddr . meta l4proto . th dport @service-ports-N
//!              dnat ip to ip daddr . meta l4proto . th dport . numgen random mod N map @service-endpoints
//! service-ports-N:      ClusterIP . proto . port of the Service ports with N endpoints
//! service-endpoints:    ClusterIP . proto . port . slot -> endpoint address . port
//! no-endpoint-services: ClusterIP . proto . port  (refused in the filter chains)
//! cluster-ips:          active ClusterIPs (unknown ports are refused, unallocated addresses
//!                       inside the service CIDRs are dropped)
//! ```
//!
//! A Service added, removed or changing its endpoints moves elements between these sets; a
//! new endpoint count adds a set and a rule without any jump. Every object is one `nft` can
//! list, so operators can still read the table with `nft list ruleset`.
mod endpoints;
pub mod ir;

use splitproxy_proto::v1::{
    BaseChain, Chain, ChainType, CmpOp, DataType, Element, Expr, Family, Hook, MetaKey, Rule,
    Ruleset, Set, Table,
};

use crate::index::Index;
use crate::objects::ServiceInfo;
pub use endpoints::{ServicePortEndpoints, service_port_endpoints};

/// Endpoint counts whose sets and rules always exist, so that endpoint changes of ordinary
/// Services only move elements.
pub const PREALLOCATED_COUNTS: u32 = 16;

const DSTNAT: i32 = -100;

#[derive(Debug, Clone)]
pub struct RulesConfig {
    /// Name of the tables splitproxy owns (`ip NAME` and `ip6 NAME`).
    pub table: String,
    /// Unallocated addresses inside these ranges are dropped.
    pub service_cidrs: Vec<ipnet::IpNet>,
}

impl Default for RulesConfig {
    fn default() -> Self {
        RulesConfig {
            table: "splitproxy".into(),
            service_cidrs: Vec::new(),
        }
    }
}

/// Per-node inputs to the ruleset. Nodes with equal views get the same ruleset, computed once.
/// Everything in scope so far (ClusterIP Services) is the same on every node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct NodeView {}

/// The ruleset a node with `view` must hold, computed from scratch. The brain maintains the
/// same thing incrementally ([`crate::desired::Desired`]); this is the reference it must equal.
pub fn ruleset(index: &Index, config: &RulesConfig, view: &NodeView) -> Ruleset {
    let mut d = crate::desired::Desired::new(config.clone(), view.clone());
    d.rebuild(index);
    d.model().to_ruleset()
}

/// Whether the ip6 table must exist even without IPv6 Services.
pub fn wants_ipv6(config: &RulesConfig) -> bool {
    config
        .service_cidrs
        .iter()
        .any(|n| matches!(n, ipnet::IpNet::V6(_)))
}

pub fn family(ipv6: bool) -> Family {
    if ipv6 { Family::Ip6 } else { Family::Ip }
}

/// One Service's share of a family's table: the elements it adds to each set, and the
/// endpoint counts it uses (each needs its `service-ports-N` set and rule).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Contribution {
    /// (set, element).
    pub elements: Vec<(&'static str, Element)>,
    /// Elements going to `service-ports-N`: (N, element).
    pub counted: Vec<(u32, Element)>,
}

impl Contribution {
    pub fn is_empty(&self) -> bool {
        self.elements.is_empty() && self.counted.is_empty()
    }
}

/// What `svc` puts into the `ipv6` (or ip) table.
pub fn contribution(index: &Index, svc: &ServiceInfo, ipv6: bool) -> Contribution {
    let mut c = Contribution::default();
    for &cip in svc.cluster_ips.iter().filter(|ip| ip.is_ipv6() == ipv6) {
        c.elements.push((
            "cluster-ips",
            Element {
                key: vec![ir::ip(cip)],
                ..Default::default()
            },
        ));
        for port in &svc.ports {
            let eps = service_port_endpoints(index, svc, port, ipv6);
            let key = vec![
                ir::ip(cip),
                ir::proto(port.protocol as u8),
                ir::port(port.port),
            ];
            // nftables keeps comments up to 127 bytes; Kubernetes names (ASCII) may be longer.
            let comment: String = format!("{}:{}", svc.key, port.name)
                .chars()
                .take(127)
                .collect();
            if eps.endpoints.is_empty() {
                c.elements.push((
                    "no-endpoint-services",
                    Element {
                        key,
                        comment,
                        ..Default::default()
                    },
                ));
                continue;
            }
            for (slot, (ip, p)) in eps.endpoints.iter().enumerate() {
                let mut k = key.clone();
                k.push(ir::int(slot as u32));
                let e = Element {
                    key: k,
                    data: vec![ir::ip(*ip), ir::port(*p)],
                    ..Default::default()
                };
                c.elements.push(("service-endpoints", e));
            }
            let n = eps.endpoints.len() as u32;
            c.counted.push((
                n,
                Element {
                    key,
                    comment,
                    ..Default::default()
                },
            ));
        }
    }
    c
}

/// A family's table without any Service: hooks, checks, the shared sets, and the
/// `service-ports-N` sets and rules for `counts`.
pub fn skeleton(
    config: &RulesConfig,
    ipv6: bool,
    counts: impl IntoIterator<Item = u32> + Clone,
) -> Table {
    let addr = if ipv6 {
        DataType::Ipv6Addr
    } else {
        DataType::Ipv4Addr
    };
    let tuple = vec![addr, DataType::InetProto, DataType::InetService];
    let mut sets = vec![
        set("cluster-ips", vec![addr], vec![], "Active ClusterIPs"),
        set(
            "no-endpoint-services",
            tuple.clone(),
            vec![],
            "Service ports without endpoints",
        ),
        set(
            "service-endpoints",
            [tuple.as_slice(), &[DataType::Integer]].concat(),
            vec![addr, DataType::InetService],
            "Service port . slot -> endpoint",
        ),
    ];
    sets.extend(counts.clone().into_iter().map(|n| count_set(n, ipv6)));
    let mut chains = base_chains();
    chains.push(services_chain(counts, ipv6));
    chains.extend(check_chains(config, ipv6));
    Table {
        family: family(ipv6) as i32,
        name: config.table.clone(),
        comment: "rules for splitproxy".into(),
        chains,
        sets,
    }
}

/// The set of Service ports with `n` endpoints.
pub fn count_set(n: u32, ipv6: bool) -> Set {
    let addr = if ipv6 {
        DataType::Ipv6Addr
    } else {
        DataType::Ipv4Addr
    };
    let endpoints = if n == 1 {
        "1 endpoint".to_string()
    } else {
        format!("{n} endpoints")
    };
    set(
        &count_set_name(n),
        vec![addr, DataType::InetProto, DataType::InetService],
        vec![],
        &format!("Service ports with {endpoints}"),
    )
}

pub fn count_set_name(n: u32) -> String {
    format!("service-ports-{n}")
}

/// `services`: one DNAT rule per endpoint count, in ascending order.
pub fn services_chain(counts: impl IntoIterator<Item = u32>, ipv6: bool) -> Chain {
    let mut counts: Vec<u32> = counts.into_iter().collect();
    counts.sort_unstable();
    counts.dedup();
    chain(
        "services",
        counts
            .into_iter()
            .map(|n| dnat_rule(&count_set_name(n), n, ipv6))
            .collect(),
    )
}

fn set(name: &str, key: Vec<DataType>, data: Vec<DataType>, comment: &str) -> Set {
    Set {
        name: name.into(),
        key: key.into_iter().map(|t| t as i32).collect(),
        data: data.into_iter().map(|t| t as i32).collect(),
        comment: comment.into(),
        ..Default::default()
    }
}

fn base(name: &str, hook: Hook, ty: ChainType, priority: i32, jumps: &[&str]) -> Chain {
    Chain {
        name: name.into(),
        base: Some(BaseChain {
            hook: hook as i32,
            r#type: ty as i32,
            priority,
            policy_drop: false,
        }),
        rules: jumps
            .iter()
            .map(|target| {
                let mut exprs = Vec::new();
                if ty == ChainType::Filter {
                    exprs.extend(ir::ct_state_new());
                }
                exprs.push(ir::jump(target));
                Rule {
                    exprs,
                    ..Default::default()
                }
            })
            .collect(),
        ..Default::default()
    }
}

/// The hooks, as kube-proxy's nftables mode places them: service checks before DNAT on the
/// filter hooks, the ClusterIP check after DNAT for locally generated traffic.
fn base_chains() -> Vec<Chain> {
    use {ChainType::*, Hook::*};
    vec![
        base("nat-prerouting", Prerouting, Nat, DSTNAT, &["services"]),
        base("nat-output", Output, Nat, DSTNAT, &["services"]),
        base(
            "filter-input",
            Input,
            Filter,
            DSTNAT - 10,
            &["service-endpoints-check"],
        ),
        base(
            "filter-forward",
            Forward,
            Filter,
            DSTNAT - 10,
            &["service-endpoints-check", "cluster-ips-check"],
        ),
        base(
            "filter-output",
            Output,
            Filter,
            DSTNAT - 10,
            &["service-endpoints-check"],
        ),
        base(
            "filter-output-post-dnat",
            Output,
            Filter,
            DSTNAT + 10,
            &["cluster-ips-check"],
        ),
    ]
}

/// The checks on the filter hooks: Service ports without endpoints and unknown ports of
/// ClusterIPs are refused, unallocated addresses of the service CIDRs dropped.
fn check_chains(config: &RulesConfig, ipv6: bool) -> Vec<Chain> {
    let (tuple, free) = ir::service_tuple(ipv6);
    let l4 = free - 2;
    let mut no_ep = tuple;
    no_ep.push(ir::lookup("no-endpoint-services", 0));
    let unknown_port = vec![
        ir::daddr(ipv6, 0),
        ir::lookup("cluster-ips", 0),
        ir::meta(MetaKey::L4proto, l4),
    ];
    let mut check = refused(
        unknown_port,
        l4,
        ipv6,
        "Reject traffic to invalid ports of ClusterIPs",
    );
    for net in config
        .service_cidrs
        .iter()
        .filter(|n| n.addr().is_ipv6() == ipv6)
    {
        let mut exprs = ir::daddr_in(*net);
        exprs.push(ir::drop());
        check.push(Rule {
            exprs,
            comment: "Drop traffic to unallocated ClusterIPs".into(),
        });
    }
    vec![
        chain(
            "service-endpoints-check",
            refused(
                no_ep,
                l4,
                ipv6,
                "Reject traffic to Services without endpoints",
            ),
        ),
        chain("cluster-ips-check", check),
    ]
}

/// Rules that refuse what `matched` selects: TCP with a reset, everything else with ICMP port
/// unreachable. Both read as "connection refused" to a client; the reset, unlike ICMP, is not
/// subject to the kernel's per-destination ICMP rate limit, so a client retrying a Service
/// without endpoints is refused every time, at once. `l4` holds `meta l4proto`.
fn refused(matched: Vec<Expr>, l4: u32, ipv6: bool, comment: &str) -> Vec<Rule> {
    let mut tcp = matched.clone();
    tcp.push(ir::cmp(CmpOp::Eq, l4, vec![6]));
    tcp.push(ir::reject_tcp_reset());
    let mut other = matched;
    other.push(ir::reject(ipv6));
    vec![
        Rule {
            exprs: tcp,
            comment: comment.into(),
        },
        Rule {
            exprs: other,
            comment: comment.into(),
        },
    ]
}

/// The rule for Service ports with `n` endpoints: match the port in its set, pick one of the
/// `n` slots at random, DNAT to the endpoint in that slot.
fn dnat_rule(set: &str, n: u32, ipv6: bool) -> Rule {
    let (mut exprs, slot) = ir::service_tuple(ipv6);
    exprs.push(ir::lookup(set, 0));
    exprs.push(ir::numgen_random(n, slot));
    exprs.push(ir::lookup_map("service-endpoints", 0, 0));
    let port_reg = if ipv6 { 4 } else { 1 };
    exprs.push(ir::dnat(ipv6, 0, port_reg));
    Rule {
        exprs,
        ..Default::default()
    }
}

fn chain(name: &str, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.into(),
        rules,
        ..Default::default()
    }
}
