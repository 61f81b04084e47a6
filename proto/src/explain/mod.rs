//! `ExplainPacket`: what a node's ruleset does to one packet, found by evaluating the IR, not
//! by knowing what a Service is.
//!
//! The evaluation is an interpreter of the nf_tables expressions of `ruleset.proto` over a
//! node's [`Model`] (the one `GetNodeRuleset` returns): the hooks a packet passes
//! (prerouting, then input or forward and postrouting; or output and postrouting for a packet
//! the node sends), every base chain of a hook in priority order, rules in order, and in a
//! rule each expression over the sixteen registers as the kernel runs it (payload, meta, ct,
//! fib, cmp, bitwise, lookups in sets, data maps and verdict maps with concatenated keys,
//! numgen, nat, masquerade, reject, dynset, counter, verdict, immediate), jumps, gotos and
//! returns with the kernel's jump stack. So an explanation is only as right as the
//! interpreter, and never right because it shares a mistake with the rule builders: it knows
//! no set by name.
//!
//! What a packet alone does not determine is handled openly, and said in `assumptions`:
//! - random numbers (`numgen`): every value is evaluated, and the outcomes carry the values
//!   that lead to them and their share, so DNAT weights are exact;
//! - conntrack: a new connection unless the request says established; the original tuple is
//!   the packet as it arrived; NAT chains run once per connection and kind, as the kernel's
//!   `nf_nat_inet_fn` runs them;
//! - `fib ... type`: an address is local when it is one of the addresses the caller gives
//!   ([`Packet::local`]) or a loopback address;
//! - dynamic sets the packet path fills (session affinity): the model holds none of their
//!   entries, so lookups in them miss; the explanation says so and reports the entries the
//!   packet itself would add, with their timeouts;
//! - a value no field of the request gives (an unknown ingress interface, the outgoing
//!   interface): a rule that compares it is taken as not matching, and the explanation is
//!   marked inexact.
mod eval;
pub mod regs;
#[cfg(test)]
mod tests;
mod text;

use std::collections::HashMap;
use std::net::IpAddr;

use crate::model::Model;
use crate::v1::{
    ExplainPacketRequest, ExplainPacketResponse, Family, PacketFate, PacketOutcome, PathStep,
    explain_packet_request::{ConnState, Origin as ReqOrigin},
};
use eval::{Run, RunResult, TableView};

/// Runs (one per list of random choices) before the enumeration stops.
const MAX_RUNS: usize = 4096;
/// Values of one numgen enumerated at most.
const MAX_MODULUS: u32 = 1024;
/// Outcomes that carry their own path; the paths of further outcomes (more endpoints than
/// that) are left out, so that an answer stays small enough for grpcurl's 4 MB default.
const MAX_OUTCOME_PATHS: usize = 32;
/// Source port of a packet whose request gives none.
pub const DEFAULT_SOURCE_PORT: u16 = 40000;

/// Where a packet starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// From outside the node's network namespace: prerouting first.
    Arriving,
    /// From a process of the node: output first.
    Local,
}

/// The packet to explain, every field decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Packet {
    pub saddr: IpAddr,
    pub sport: u16,
    pub daddr: IpAddr,
    pub dport: u16,
    /// IP protocol number (6 tcp, 17 udp, 132 sctp).
    pub l4proto: u8,
    /// The ingress interface; `None`: unknown.
    pub iifname: Option<String>,
    pub origin: Origin,
    /// A packet of a connection conntrack knows (not its first).
    pub established: bool,
    pub mark: u32,
    /// The node's addresses: local delivery and `fib ... type local`.
    pub local: Vec<IpAddr>,
}

impl Packet {
    /// Whether `ip` is an address of the node.
    pub fn is_local(&self, ip: IpAddr) -> bool {
        ip.is_loopback() || self.local.contains(&ip)
    }
}

/// A request that cannot be explained.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadRequest {
    #[error("{field} {value:?} is not an IP address")]
    Address { field: &'static str, value: String },
    #[error("{field} {value} is not a port")]
    Port { field: &'static str, value: u32 },
    #[error("protocol {0:?} is none of tcp, udp, sctp")]
    Protocol(String),
    #[error("source {0} and destination {1} are of different families")]
    Families(IpAddr, IpAddr),
    #[error("destination_ip is required")]
    NoDestination,
    #[error("no source_ip given and the node has no known address of the destination's family")]
    NoSource,
    #[error("ingress_interface {0:?} is not an interface name")]
    Interface(String),
}

fn port(field: &'static str, value: u32) -> Result<u16, BadRequest> {
    u16::try_from(value).map_err(|_| BadRequest::Port { field, value })
}

fn address(field: &'static str, value: &str) -> Result<IpAddr, BadRequest> {
    value.trim().parse().map_err(|_| BadRequest::Address {
        field,
        value: bounded(value),
    })
}

fn bounded(s: &str) -> String {
    s.chars().take(64).collect()
}

/// The packet a request describes, its defaults filled, and the assumptions those defaults
/// are. `node_addresses`: what the caller knows of the node's addresses (the request's own
/// `node_addresses` are added).
pub fn packet_of(
    req: &ExplainPacketRequest,
    node_addresses: &[IpAddr],
) -> Result<(Packet, Vec<String>), BadRequest> {
    let mut assumptions = Vec::new();
    let mut local: Vec<IpAddr> = node_addresses.to_vec();
    for a in &req.node_addresses {
        local.push(address("node_addresses", a)?);
    }
    local.sort();
    local.dedup();
    if req.destination_ip.trim().is_empty() {
        return Err(BadRequest::NoDestination);
    }
    let daddr = address("destination_ip", &req.destination_ip)?;
    let dport = port("destination_port", req.destination_port)?;
    let saddr = if req.source_ip.trim().is_empty() {
        let s = local
            .iter()
            .copied()
            .find(|a| a.is_ipv4() == daddr.is_ipv4() && !a.is_loopback())
            .ok_or(BadRequest::NoSource)?;
        assumptions.push(format!(
            "no source given: {s}, an address of the node (a packet the node sends)"
        ));
        s
    } else {
        address("source_ip", &req.source_ip)?
    };
    if saddr.is_ipv4() != daddr.is_ipv4() {
        return Err(BadRequest::Families(saddr, daddr));
    }
    let sport = match port("source_port", req.source_port)? {
        0 => DEFAULT_SOURCE_PORT,
        p => p,
    };
    let l4proto = match req.protocol.trim().to_ascii_lowercase().as_str() {
        "" => {
            assumptions.push("no protocol given: tcp".into());
            6
        }
        "tcp" => 6,
        "udp" => 17,
        "sctp" => 132,
        other => return Err(BadRequest::Protocol(bounded(other))),
    };
    let iif = req.ingress_interface.trim();
    if iif.len() > 15 || iif.contains(char::is_whitespace) {
        return Err(BadRequest::Interface(bounded(iif)));
    }
    let is_local = |ip: IpAddr| ip.is_loopback() || local.contains(&ip);
    let origin = match ReqOrigin::try_from(req.origin).unwrap_or(ReqOrigin::Unspecified) {
        ReqOrigin::Arriving => Origin::Arriving,
        ReqOrigin::Local => Origin::Local,
        ReqOrigin::Unspecified if is_local(saddr) => {
            assumptions.push(format!(
                "origin not given: {saddr} is an address of the node, so the node sends the packet (output)"
            ));
            Origin::Local
        }
        ReqOrigin::Unspecified => {
            assumptions.push(format!(
                "origin not given: {saddr} is not an address of the node, so the packet arrives from outside it (prerouting)"
            ));
            Origin::Arriving
        }
    };
    let established = match ConnState::try_from(req.conn_state).unwrap_or(ConnState::Unspecified) {
        ConnState::Established => true,
        ConnState::New => false,
        ConnState::Unspecified => {
            assumptions.push(
                "connection state not given: the first packet of a new connection (ct state new)"
                    .into(),
            );
            false
        }
    };
    let iifname = match (origin, iif.is_empty()) {
        (Origin::Arriving, false) => Some(iif.to_string()),
        (Origin::Arriving, true) => None,
        (Origin::Local, _) => Some(String::new()),
    };
    if req.source_port == 0 {
        assumptions.push(format!("no source port given: {DEFAULT_SOURCE_PORT}"));
    }
    Ok((
        Packet {
            saddr,
            sport,
            daddr,
            dport,
            l4proto,
            iifname,
            origin,
            established,
            mark: req.mark,
            local,
        },
        assumptions,
    ))
}

/// Explains `req` against `model`: [`packet_of`], then [`explain`].
pub fn explain_request(
    model: &Model,
    req: &ExplainPacketRequest,
    node_addresses: &[IpAddr],
) -> Result<ExplainPacketResponse, BadRequest> {
    let (packet, assumptions) = packet_of(req, node_addresses)?;
    Ok(explain(model, &packet, assumptions))
}

fn fate_of(r: &RunResult) -> PacketFate {
    if r.reject.is_some() {
        PacketFate::Rejected
    } else if r.dropped {
        PacketFate::Dropped
    } else if r.dnat.is_some() {
        PacketFate::Dnat
    } else {
        PacketFate::Accepted
    }
}

/// What `model` does to `packet`: every outcome with its share, the path, and the text.
/// `assumptions` are the request's defaults (see [`packet_of`]); the evaluation adds its own.
pub fn explain(model: &Model, packet: &Packet, assumptions: Vec<String>) -> ExplainPacketResponse {
    let family = if packet.daddr.is_ipv4() {
        Family::Ip
    } else {
        Family::Ip6
    };
    let tables = TableView::of(model, family);
    // Depth first over the lists of random choices: a run that evaluated more numgens than it
    // had choices for stands for all its continuations, which are evaluated instead.
    let mut leaves: Vec<(Vec<u32>, RunResult)> = Vec::new();
    let mut pending: Vec<Vec<u32>> = vec![Vec::new()];
    let mut runs = 0;
    let mut truncated = false;
    while let Some(choices) = pending.pop() {
        runs += 1;
        if runs > MAX_RUNS {
            truncated = true;
            break;
        }
        let r = Run::new(&tables, packet, &choices).go();
        if let Some(&m) = r.numgens.get(choices.len()) {
            if m > MAX_MODULUS {
                truncated = true;
            }
            for v in (0..m.clamp(1, MAX_MODULUS)).rev() {
                let mut c = choices.clone();
                c.push(v);
                pending.push(c);
            }
        } else {
            leaves.push((choices, r));
        }
    }

    let mut assumptions = assumptions;
    let mut exact = !truncated;
    if truncated {
        assumptions.push(format!(
            "too many random outcomes: only the first {MAX_RUNS} evaluations are reported"
        ));
    }
    let mut dynamic_noted = Vec::new();
    for (_, r) in &leaves {
        for u in &r.unknowns {
            exact = false;
            if !assumptions.contains(u) {
                assumptions.push(u.clone());
            }
        }
        for set in &r.dynamic_lookups {
            if !dynamic_noted.contains(set) {
                dynamic_noted.push(set.clone());
                assumptions.push(format!(
                    "@{set} is filled by the packet path on the node; the model holds none of its entries, so the lookup is taken to miss (a client with an entry goes where the entry says)"
                ));
            }
        }
    }

    // The steps every leaf shares.
    let common = leaves
        .iter()
        .map(|(_, r)| r.steps.as_slice())
        .reduce(|a, b| {
            let n = a.iter().zip(b).take_while(|(x, y)| x == y).count();
            &a[..n]
        })
        .unwrap_or_default()
        .len();
    let path: Vec<PathStep> = leaves
        .first()
        .map(|(_, r)| r.steps[..common].to_vec())
        .unwrap_or_default();

    // Leaves with the same result are one outcome.
    let mut outcomes: Vec<PacketOutcome> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut affinity = false;
    let v6 = packet.daddr.is_ipv6();
    for (choices, r) in &leaves {
        let share: f64 = r
            .numgens
            .iter()
            .map(|m| 1.0 / f64::from((*m).max(1)))
            .product();
        let fate = fate_of(r);
        affinity |= r.dynsets.iter().any(|d| r.dynamic_lookups.contains(&d.set));
        let key = format!(
            "{fate:?}|{:?}|{}|{:?}|{:?}|{}|{:?}",
            r.dnat, r.masquerade, r.snat, r.reject, r.route, r.dynsets
        );
        match index.get(&key) {
            Some(&i) => {
                let o = &mut outcomes[i];
                o.share += share;
                if let Some(&first) = choices.first() {
                    o.slots.push(first);
                }
            }
            None => {
                index.insert(key, outcomes.len());
                outcomes.push(PacketOutcome {
                    fate: fate as i32,
                    slots: choices.first().copied().into_iter().collect(),
                    modulus: r.numgens.first().copied().unwrap_or(0),
                    share,
                    dnat_address: r.dnat.map(|(a, _)| a.to_string()).unwrap_or_default(),
                    dnat_port: r.dnat.map(|(_, p)| u32::from(p)).unwrap_or_default(),
                    masquerade: r.masquerade,
                    reject: r.reject,
                    route: r.route.clone(),
                    dynsets: r.dynsets.clone(),
                    path: r.steps[common..].to_vec(),
                    summary: String::new(),
                });
            }
        }
    }
    for (i, o) in outcomes.iter_mut().enumerate() {
        o.summary = text::outcome_summary(o, v6);
        if i >= MAX_OUTCOME_PATHS {
            o.path.clear();
        }
    }
    if outcomes.len() > MAX_OUTCOME_PATHS {
        assumptions.push(format!(
            "{} outcomes: only the first {MAX_OUTCOME_PATHS} carry their own path (the others differ in the values they looked up)",
            outcomes.len()
        ));
    }
    let fates: Vec<i32> = outcomes.iter().map(|o| o.fate).collect();
    let fate = if fates.contains(&(PacketFate::Dnat as i32)) {
        PacketFate::Dnat as i32
    } else {
        fates.first().copied().unwrap_or_default()
    };
    let mut out = ExplainPacketResponse {
        generation: 0,
        fate,
        outcomes,
        path,
        assumptions,
        text: String::new(),
        exact,
        affinity,
    };
    out.text = text::render(packet, &out);
    out
}
