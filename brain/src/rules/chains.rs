//! The chains of a family's table. Only these rules ever jump, and they never change with
//! Services: Services live in sets and maps (see [`super::sets`]), and the per-count DNAT rules
//! are jump-free.
//!
//! ```text
//! filter-prerouting / filter-output (-110): ct state new jump firewall-check          LB source ranges
//! filter-input / forward / output (-110):   ct state new jump service-endpoints-check no endpoints
//! filter-forward, filter-output-post-dnat:   ct state new jump cluster-ips-check      unknown ports, free IPs
//! filter-input / forward, output-post-dnat:  ct state new jump affinity-record        remember the endpoint
//! nat-prerouting / nat-output (-100):        jump services            mark, affinity, DNAT
//! nat-postrouting (100):                     jump masquerading
//! ```
use splitproxy_proto::family::IpFamily;
use splitproxy_proto::v1::{BaseChain, Chain, ChainType, CmpOp, CtKey, Expr, Hook, MetaKey, Rule};

use super::sets::{self, DynSet, Kind};
use super::{DetectLocalMode, RulesConfig, ir};

const DSTNAT: i32 = -100;
const SRCNAT: i32 = 100;
/// The packet mark bit that asks for masquerading (kube-proxy's 0x4000).
pub const MASQUERADE_MARK: u32 = 0x4000;

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
                // As kube-proxy: the checks judge a connection once, by its first packet. An
                // established flow is never re-checked, so a client taken out of
                // loadBalancerSourceRanges keeps its open connections, and packets of
                // established flows cost no lookups here.
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

pub fn chain(name: &str, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.into(),
        rules,
        ..Default::default()
    }
}

fn rule(exprs: Vec<Expr>, comment: &str) -> Rule {
    Rule {
        exprs,
        comment: comment.into(),
    }
}

/// Every chain but `services` and `affinity-record`, which depend on the sets in use.
pub fn fixed_chains(config: &RulesConfig, family: IpFamily) -> Vec<Chain> {
    use {ChainType::*, Hook::*};
    vec![
        base(
            "filter-prerouting",
            Prerouting,
            Filter,
            DSTNAT - 10,
            &["firewall-check"],
        ),
        base(
            "filter-input",
            Input,
            Filter,
            DSTNAT - 10,
            &["service-endpoints-check", "affinity-record"],
        ),
        base(
            "filter-forward",
            Forward,
            Filter,
            DSTNAT - 10,
            &[
                "service-endpoints-check",
                "cluster-ips-check",
                "affinity-record",
            ],
        ),
        base(
            "filter-output",
            Output,
            Filter,
            DSTNAT - 10,
            &["service-endpoints-check", "firewall-check"],
        ),
        base(
            "filter-output-post-dnat",
            Output,
            Filter,
            DSTNAT + 10,
            &["cluster-ips-check", "affinity-record"],
        ),
        base("nat-prerouting", Prerouting, Nat, DSTNAT, &["services"]),
        base("nat-output", Output, Nat, DSTNAT, &["services"]),
        base(
            "nat-postrouting",
            Postrouting,
            Nat,
            SRCNAT,
            &["masquerading"],
        ),
        endpoints_check(family),
        cluster_ips_check(config, family),
        firewall_check(family),
        masquerading(family),
    ]
}

/// Loads the destination key of `nodeport` space into registers 0..; returns the expressions
/// (a NodePort key first checks `ip daddr @nodeport-ips`) and the first free register.
fn key(nodeport: bool, family: IpFamily) -> (Vec<Expr>, u32) {
    if nodeport {
        (
            vec![
                ir::daddr(family, 0),
                ir::lookup(sets::NODEPORT_IPS, 0),
                ir::meta(MetaKey::L4proto, 0),
                ir::dport(1),
            ],
            2,
        )
    } else {
        ir::service_tuple(family)
    }
}

/// The register holding `meta l4proto` after [`key`].
fn l4_reg(nodeport: bool, family: IpFamily) -> u32 {
    if nodeport { 0 } else { ir::addr_regs(family) }
}

/// Matches packets that come from a pod on this node, per `--detect-local-mode`; `None` when
/// the mode cannot tell (None, or no cluster CIDR of this family).
pub fn local_source(config: &RulesConfig, family: IpFamily, local: bool) -> Option<Vec<Expr>> {
    match config.detect_local {
        DetectLocalMode::ClusterCidr => {
            let nets: Vec<_> = config
                .cluster_cidrs
                .iter()
                .filter(|n| family.holds_net(**n))
                .collect();
            // kube-proxy uses one CIDR per family.
            let net = nets.first()?;
            Some(ir::saddr_in(**net, local, 0))
        }
        DetectLocalMode::NodeCidr => Some(vec![
            ir::saddr(family, 0),
            if local {
                ir::lookup(sets::LOCAL_POD_CIDRS, 0)
            } else {
                ir::lookup_invert(sets::LOCAL_POD_CIDRS, 0)
            },
        ]),
        DetectLocalMode::InterfaceNamePrefix if !config.pod_interface_name_prefix.is_empty() => {
            Some(ir::iifname(
                &config.pod_interface_name_prefix,
                false,
                local,
                0,
            ))
        }
        DetectLocalMode::BridgeInterface if !config.pod_bridge_interface.is_empty() => {
            Some(ir::iifname(&config.pod_bridge_interface, true, local, 0))
        }
        _ => None,
    }
}

/// Conditions of rules that apply to external sources only: not a local pod (when that can be
/// told) and not the node itself.
fn external_source(config: &RulesConfig, family: IpFamily) -> Vec<Expr> {
    let mut exprs = local_source(config, family, false).unwrap_or_default();
    exprs.extend(ir::fib_saddr_local(false, 0));
    exprs
}

/// `services`: marks for masquerading, session affinity, then one DNAT rule per count set in
/// use, local policies first, each followed by its drop for nodes without local endpoints.
pub fn services_chain(config: &RulesConfig, family: IpFamily, dynsets: &[DynSet]) -> Chain {
    let mut rules = masquerade_marks(config, family);
    rules.push(affinity_rule(family));
    rules.push(nodeport_affinity_rule(family));
    let counts = |kind: Kind| {
        let mut ns: Vec<u32> = dynsets
            .iter()
            .filter_map(|d| match d {
                DynSet::Count(k, n) if *k == kind => Some(*n),
                _ => None,
            })
            .collect();
        ns.sort_unstable();
        ns.dedup();
        ns
    };
    for kind in Kind::ALL {
        for n in counts(kind) {
            rules.push(dnat_rule(config, kind, n, family));
        }
        let drop = match kind {
            Kind::Local => Some((false, sets::INTERNAL_LOCAL, "internalTrafficPolicy Local")),
            Kind::ExternalLocal => {
                Some((false, sets::EXTERNAL_LOCAL, "externalTrafficPolicy Local"))
            }
            Kind::NodePortLocal => {
                Some((true, sets::NODEPORT_LOCAL, "externalTrafficPolicy Local"))
            }
            _ => None,
        };
        if let Some((nodeport, set, policy)) = drop {
            let mut exprs = if kind.external_only() {
                external_source(config, family)
            } else {
                Vec::new()
            };
            exprs.extend(key(nodeport, family).0);
            exprs.push(ir::lookup(set, 0));
            exprs.push(ir::drop());
            rules.push(rule(
                exprs,
                &format!("{policy} without local endpoints: drop"),
            ));
        }
    }
    chain("services", rules)
}

fn masquerade_marks(config: &RulesConfig, family: IpFamily) -> Vec<Rule> {
    let mark = || ir::mark_set_bit(MASQUERADE_MARK, 0);
    let mut rules = Vec::new();
    let cluster = if config.masquerade_all {
        Some(Vec::new())
    } else {
        local_source(config, family, false)
    };
    if let Some(mut exprs) = cluster {
        exprs.push(ir::daddr(family, 0));
        exprs.push(ir::lookup(sets::CLUSTER_IPS, 0));
        exprs.extend(mark());
        rules.push(rule(
            exprs,
            "Masquerade traffic to ClusterIPs from outside the pod network",
        ));
    }
    for nodeport in [false, true] {
        let (mut exprs, _) = key(nodeport, family);
        exprs.push(ir::lookup(
            if nodeport {
                sets::NODEPORT_CLUSTER
            } else {
                sets::EXTERNAL_CLUSTER
            },
            0,
        ));
        exprs.extend(mark());
        rules.push(rule(
            exprs,
            "Masquerade external traffic of Cluster-policy Services",
        ));
        let mut exprs = ir::fib_saddr_local(true, 0);
        exprs.extend(key(nodeport, family).0);
        exprs.push(ir::lookup(
            if nodeport {
                sets::NODEPORT_LOCAL
            } else {
                sets::EXTERNAL_LOCAL
            },
            0,
        ));
        exprs.extend(mark());
        rules.push(rule(
            exprs,
            "Masquerade the node's own traffic to Local-policy Services",
        ));
    }
    rules
}

/// A client with an affinity entry goes back to its endpoint. Entries whose endpoint left the
/// Service are deleted by the actuator (`affinity-members` guards them).
fn affinity_rule(family: IpFamily) -> Rule {
    // v4: saddr r0, daddr r1, l4proto r2, dport r3 -> endpoint r0 (addr) r1 (port).
    // v6: saddr r0-3, daddr r4-7, l4proto r8, dport r9 -> endpoint r0-3, r4.
    let w = ir::addr_regs(family);
    let exprs = vec![
        ir::saddr(family, 0),
        ir::daddr(family, w),
        ir::meta(MetaKey::L4proto, 2 * w),
        ir::dport(2 * w + 1),
        ir::lookup_map(sets::AFFINITY, 0, 0),
        ir::dnat(family, 0, w),
    ];
    rule(exprs, "Session affinity")
}

/// The same for NodePorts (keyed by client . proto . port on the node's addresses).
fn nodeport_affinity_rule(family: IpFamily) -> Rule {
    let w = ir::addr_regs(family);
    let exprs = vec![
        ir::daddr(family, 0),
        ir::lookup(sets::NODEPORT_IPS, 0),
        ir::saddr(family, 0),
        ir::meta(MetaKey::L4proto, w),
        ir::dport(w + 1),
        ir::lookup_map(sets::NODEPORT_AFFINITY, 0, 0),
        ir::dnat(family, 0, w),
    ];
    rule(exprs, "Session affinity (NodePorts)")
}

/// `affinity-record`: a new connection DNATed for a Service port with session affinity
/// remembers its client's endpoint, for that port's timeout (refreshed by every new connection,
/// as kube-proxy's `update @affinity-…` in its endpoint chains).
///
/// Where it runs, and why: the entry needs the endpoint DNAT chose, which a rule can read only
/// after the NAT hook rewrote the packet, so it cannot sit in `services` itself (a `dnat`
/// verdict ends that traversal, and recording there would take a rule per endpoint count and
/// timeout). It must not run in a NAT chain after DNAT either: the kernel runs the NAT chains of
/// a hook, across all tables, only until one sets up a translation, so in `nat-postrouting` a
/// `masquerade` (ours, or an earlier SNAT chain of another table) would end the traversal before
/// the record — which is how every masqueraded connection (external clients of Cluster-policy
/// Services, the node's own traffic, hairpin) once lost its affinity. So it runs from the filter
/// hooks that follow DNAT on every path: `filter-forward` (to a pod elsewhere or behind this
/// node), `filter-input` (to this node's own addresses) and `filter-output-post-dnat` (the
/// node's own connections; they pass `filter-input` too when local, an idempotent update).
/// These already run `ct state new` checks there, so this costs no new hook, and it runs after
/// those checks: a refused or dropped connection records nothing. `ct status dnat` keeps out a
/// connection that was not translated (a UDP flow or a retried SYN from before its Service's
/// rules arrived: its conntrack entry, untranslated, is still `new` until the actuator's
/// conntrack clean-up), which would otherwise record the Service address itself as its
/// endpoint. (In `nat-postrouting` that check was implicit: NAT chains see only a
/// connection's first packet.)
pub fn affinity_record_chain(family: IpFamily, dynsets: &[DynSet]) -> Chain {
    let w = ir::addr_regs(family);
    let (src, dst) = match family {
        IpFamily::V4 => (CtKey::SrcIp, CtKey::DstIp),
        IpFamily::V6 => (CtKey::SrcIp6, CtKey::DstIp6),
    };
    let mut dynsets: Vec<DynSet> = dynsets.to_vec();
    dynsets.sort_unstable();
    dynsets.dedup();
    let rules = dynsets
        .into_iter()
        .filter_map(|d| match d {
            DynSet::NodePortAffinity(t) => Some(rule(
                [
                    ir::ct_status_dnat(0),
                    vec![
                        ir::ct_original(dst, 0),
                        ir::lookup(sets::NODEPORT_IPS, 0),
                        ir::ct_original(CtKey::Protocol, w),
                        ir::ct_original(CtKey::ProtoDst, w + 1),
                        ir::lookup(&d.name(), w),
                        ir::ct_original(src, 0),
                        ir::ct_original(CtKey::Protocol, w),
                        ir::ct_original(CtKey::ProtoDst, w + 1),
                        ir::daddr(family, w + 2),
                        ir::dport(2 * w + 2),
                        ir::dynset_update(sets::NODEPORT_AFFINITY, 0, w + 2, u64::from(t) * 1000),
                    ],
                ]
                .concat(),
                "",
            )),
            DynSet::Affinity(t) => Some(rule(
                [
                    ir::ct_status_dnat(0),
                    vec![
                        ir::ct_original(dst, w),
                        ir::ct_original(CtKey::Protocol, 2 * w),
                        ir::ct_original(CtKey::ProtoDst, 2 * w + 1),
                        ir::lookup(&d.name(), w),
                        ir::ct_original(src, 0),
                        ir::daddr(family, 2 * w + 2),
                        ir::dport(3 * w + 2),
                        ir::dynset_update(sets::AFFINITY, 0, 2 * w + 2, u64::from(t) * 1000),
                    ],
                ]
                .concat(),
                "",
            )),
            DynSet::Count(..) => None,
        })
        .collect();
    chain("affinity-record", rules)
}

/// The rule for `kind` ports with `n` endpoints: match the key in its count set, pick one of
/// the `n` slots at random, DNAT to the endpoint in that slot.
fn dnat_rule(config: &RulesConfig, kind: Kind, n: u32, family: IpFamily) -> Rule {
    let mut exprs = if kind.external_only() {
        external_source(config, family)
    } else {
        Vec::new()
    };
    let (k, slot) = key(kind.nodeport(), family);
    exprs.extend(k);
    exprs.push(ir::lookup(&kind.set_name(n), 0));
    exprs.push(ir::numgen_random(n, slot));
    exprs.push(ir::lookup_map(kind.map(), 0, 0));
    let port_reg = ir::addr_regs(family);
    exprs.push(ir::dnat(family, 0, port_reg));
    rule(exprs, "")
}

/// Service ports and NodePorts without endpoints are refused.
fn endpoints_check(family: IpFamily) -> Chain {
    let mut rules = Vec::new();
    for nodeport in [false, true] {
        let (mut exprs, _) = key(nodeport, family);
        exprs.push(ir::lookup(
            if nodeport {
                sets::NO_ENDPOINT_NODEPORTS
            } else {
                sets::NO_ENDPOINT_SERVICES
            },
            0,
        ));
        rules.extend(refused(
            exprs,
            l4_reg(nodeport, family),
            family,
            "Reject traffic to Services without endpoints",
        ));
    }
    chain("service-endpoints-check", rules)
}

/// Unknown ports of ClusterIPs are refused, unallocated addresses of the service CIDRs dropped.
fn cluster_ips_check(config: &RulesConfig, family: IpFamily) -> Chain {
    let (_, free) = ir::service_tuple(family);
    let l4 = free - 2;
    let unknown_port = vec![
        ir::daddr(family, 0),
        ir::lookup(sets::CLUSTER_IPS, 0),
        ir::meta(MetaKey::L4proto, l4),
    ];
    let mut rules = refused(
        unknown_port,
        l4,
        family,
        "Reject traffic to invalid ports of ClusterIPs",
    );
    for net in config
        .service_cidrs
        .iter()
        .filter(|n| family.holds_net(**n))
    {
        let mut exprs = ir::daddr_in(*net);
        exprs.push(ir::drop());
        rules.push(rule(exprs, "Drop traffic to unallocated ClusterIPs"));
    }
    chain("cluster-ips-check", rules)
}

/// Load balancer ports with source ranges drop every other client.
fn firewall_check(family: IpFamily) -> Chain {
    let (mut exprs, free) = ir::service_tuple(family);
    exprs.push(ir::lookup(sets::FIREWALL_IPS, 0));
    exprs.push(ir::saddr(family, free));
    exprs.push(ir::lookup_invert(sets::FIREWALL_ALLOW, 0));
    exprs.push(ir::drop());
    chain(
        "firewall-check",
        vec![rule(
            exprs,
            "Drop load balancer traffic from outside loadBalancerSourceRanges",
        )],
    )
}

/// Masquerade what the services chain marked, and hairpin traffic (a pod reaching itself
/// through a Service, which must not see its own address as the source).
fn masquerading(family: IpFamily) -> Chain {
    let mut marked = ir::mark_has_bit(MASQUERADE_MARK, 0);
    marked.extend(ir::mark_clear_bit(MASQUERADE_MARK, 0));
    marked.push(ir::masquerade());
    let w = ir::addr_regs(family);
    let hairpin = vec![
        ir::saddr(family, 0),
        ir::daddr(family, w),
        ir::lookup(sets::HAIRPIN, 0),
        ir::masquerade(),
    ];
    chain(
        "masquerading",
        vec![
            rule(marked, "Masquerade marked Service traffic"),
            rule(hairpin, "Masquerade hairpin Service traffic"),
        ],
    )
}

/// Rules that refuse what `matched` selects: TCP with a reset, everything else with ICMP port
/// unreachable. Both read as "connection refused" to a client; the reset, unlike ICMP, is not
/// subject to the kernel's per-destination ICMP rate limit, so a client retrying a Service
/// without endpoints is refused every time, at once. `l4` holds `meta l4proto`.
fn refused(matched: Vec<Expr>, l4: u32, family: IpFamily, comment: &str) -> Vec<Rule> {
    let mut tcp = matched.clone();
    tcp.push(ir::cmp(CmpOp::Eq, l4, vec![6]));
    tcp.push(ir::reject_tcp_reset());
    let mut other = matched;
    other.push(ir::reject(family));
    vec![rule(tcp, comment), rule(other, comment)]
}
