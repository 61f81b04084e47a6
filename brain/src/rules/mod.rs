//! From the index to a node's ruleset IR.
//!
//! The shape is chosen for the kernel's costs (see DESIGN.md, "nftables facts"): every Service
//! lives in a few large maps, never in chains of its own, so adding a Service or changing its
//! endpoints adds map elements and no jump or goto:
//!
//! ```text
//! services:        ip daddr . meta l4proto . th dport map @service-ips vmap @service-dispatch
//! service-ips:     ClusterIP . proto . port            -> number of endpoints N
//! service-dispatch: N                                  -> goto endpoints-N   (one per N in use)
//! endpoints-N:     dnat to ip daddr . meta l4proto . th dport . numgen random mod N
//!                        map @service-endpoints
//! service-endpoints: ClusterIP . proto . port . slot   -> endpoint address . port
//! no-endpoint-services: ClusterIP . proto . port       (rejected in the filter chains)
//! cluster-ips:     active ClusterIPs (unknown ports are rejected, unallocated addresses in the
//!                  service CIDRs are dropped)
//! ```
//!
//! The only chains that come and go are `endpoints-N`, one per distinct endpoint count, and the
//! counts 1..=[`PREALLOCATED_COUNTS`] always exist, so in practice none ever does.
mod endpoints;
pub mod ir;

use std::collections::BTreeSet;
use std::net::IpAddr;

use splitproxy_proto::v1::{
    BaseChain, Chain, ChainType, DataType, Element, Family, Hook, Rule, Ruleset, Set, Table,
};

use crate::index::Index;
pub use endpoints::{ServicePortEndpoints, service_port_endpoints};

/// Endpoint counts whose dispatch chains always exist, so that endpoint changes of ordinary
/// Services never add a chain or a goto.
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

/// The ruleset a node with `view` must hold.
pub fn ruleset(index: &Index, config: &RulesConfig, _view: &NodeView) -> Ruleset {
    let mut tables = vec![family_table(index, config, false)];
    if config
        .service_cidrs
        .iter()
        .any(|n| matches!(n, ipnet::IpNet::V6(_)))
        || index
            .services()
            .any(|s| s.cluster_ips.iter().any(IpAddr::is_ipv6))
    {
        tables.push(family_table(index, config, true));
    }
    let mut r = Ruleset { tables };
    splitproxy_proto::digest::canonicalize(&mut r);
    r
}

fn family_table(index: &Index, config: &RulesConfig, ipv6: bool) -> Table {
    let addr = if ipv6 {
        DataType::Ipv6Addr
    } else {
        DataType::Ipv4Addr
    };
    let tuple = vec![addr, DataType::InetProto, DataType::InetService];
    let mut cluster_ips = BTreeSet::new();
    let mut service_ips = Vec::new();
    let mut endpoints = Vec::new();
    let mut no_endpoints = Vec::new();
    let mut counts: BTreeSet<u32> = (1..=PREALLOCATED_COUNTS).collect();

    for svc in index.services() {
        for &cip in svc.cluster_ips.iter().filter(|ip| ip.is_ipv6() == ipv6) {
            cluster_ips.insert(cip);
            for port in &svc.ports {
                let eps = service_port_endpoints(index, svc, port, ipv6);
                let key = vec![
                    ir::ip(cip),
                    ir::proto(port.protocol as u8),
                    ir::port(port.port),
                ];
                let comment = format!("{}:{}", svc.key, port.name);
                let n = eps.endpoints.len() as u32;
                if n == 0 {
                    no_endpoints.push(Element {
                        key,
                        comment,
                        ..Default::default()
                    });
                    continue;
                }
                counts.insert(n);
                for (slot, (ip, p)) in eps.endpoints.iter().enumerate() {
                    let mut k = key.clone();
                    k.push(ir::int(slot as u32));
                    endpoints.push(Element {
                        key: k,
                        data: vec![ir::ip(*ip), ir::port(*p)],
                        ..Default::default()
                    });
                }
                service_ips.push(Element {
                    key,
                    data: vec![ir::int(n)],
                    comment,
                    ..Default::default()
                });
            }
        }
    }

    let mut sets = vec![
        set("cluster-ips", vec![addr], vec![], "Active ClusterIPs"),
        set(
            "no-endpoint-services",
            tuple.clone(),
            vec![],
            "Service ports without endpoints",
        ),
        set(
            "service-ips",
            tuple.clone(),
            vec![DataType::Integer],
            "Service port -> number of endpoints",
        ),
        set(
            "service-dispatch",
            vec![DataType::Integer],
            vec![DataType::Verdict],
            "Number of endpoints -> chain",
        ),
        set(
            "service-endpoints",
            [tuple.as_slice(), &[DataType::Integer]].concat(),
            vec![addr, DataType::InetService],
            "Service port . slot -> endpoint",
        ),
    ];
    sets[0].elements = cluster_ips
        .into_iter()
        .map(|ip| Element {
            key: vec![ir::ip(ip)],
            ..Default::default()
        })
        .collect();
    sets[1].elements = no_endpoints;
    sets[2].elements = service_ips;
    sets[3].elements = counts
        .iter()
        .map(|n| Element {
            key: vec![ir::int(*n)],
            verdict: Some(ir::goto(&format!("endpoints-{n}"))),
            ..Default::default()
        })
        .collect();
    sets[4].elements = endpoints;

    let mut chains = base_chains();
    chains.extend(regular_chains(config, ipv6));
    chains.extend(counts.iter().map(|n| endpoints_chain(*n, ipv6)));
    Table {
        family: if ipv6 { Family::Ip6 } else { Family::Ip } as i32,
        name: config.table.clone(),
        comment: "rules for splitproxy".into(),
        chains,
        sets,
    }
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

fn regular_chains(config: &RulesConfig, ipv6: bool) -> Vec<Chain> {
    let (tuple, free) = ir::service_tuple(ipv6);
    let mut services = tuple.clone();
    services.push(ir::lookup_map("service-ips", 0, free));
    services.push(ir::vmap("service-dispatch", free));

    let mut no_ep = tuple;
    no_ep.push(ir::lookup("no-endpoint-services", 0));
    no_ep.push(ir::reject(ipv6));

    let mut check = vec![Rule {
        exprs: vec![
            ir::daddr(ipv6, 0),
            ir::lookup("cluster-ips", 0),
            ir::reject(ipv6),
        ],
        comment: "Reject traffic to invalid ports of ClusterIPs".into(),
    }];
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
            "services",
            vec![Rule {
                exprs: services,
                ..Default::default()
            }],
        ),
        chain(
            "service-endpoints-check",
            vec![Rule {
                exprs: no_ep,
                comment: "Reject traffic to Services without endpoints".into(),
            }],
        ),
        chain("cluster-ips-check", check),
    ]
}

/// `endpoints-N`: pick one of N endpoints at random and DNAT to it.
fn endpoints_chain(n: u32, ipv6: bool) -> Chain {
    let (mut exprs, slot) = ir::service_tuple(ipv6);
    exprs.push(ir::numgen_random(n, slot));
    exprs.push(ir::lookup_map("service-endpoints", 0, 0));
    let port_reg = if ipv6 { 4 } else { 1 };
    exprs.push(ir::dnat(ipv6, 0, port_reg));
    chain(
        &format!("endpoints-{n}"),
        vec![Rule {
            exprs,
            ..Default::default()
        }],
    )
}

fn chain(name: &str, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.into(),
        rules,
        ..Default::default()
    }
}
