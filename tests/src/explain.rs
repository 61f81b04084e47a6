//! Every probe explained by the brain (`ExplainPacket` over gRPC) and the explanation held
//! against what the real packet did: the proof that the explanation is a faithful evaluation
//! of what the nodes hold, not a story.
//!
//! A probe's packet meets the rulesets of one or more nodes: a pod's packet enters its node
//! through its veth (or the pod bridge), a node's own packet starts in its output hook, an
//! external client's packet enters the node that owns the destination (on the fabric) or its
//! `via` node. When a node lets the packet through untouched towards another node's address,
//! that node's ruleset is explained next. The last explanation must agree with every result:
//!
//! - answered: the endpoint that answered is one of the explanation's destinations (a DNAT
//!   candidate, or the destination itself when untouched), and the source the pod saw is the
//!   client's own exactly when that outcome does not masquerade;
//! - refused: an outcome rejects, or delivers to a destination where no server of the lab
//!   listens (the kernel there refuses);
//! - dropped (timed out): an outcome drops, or sends the packet untouched to an address no
//!   member of the lab owns (the fabric swallows it);
//! - unreachable: an outcome rejects, or sends it to an address nobody owns.
use std::net::{IpAddr, SocketAddr};

use splitproxy_proto::v1::dataplane_client::DataplaneClient;
use splitproxy_proto::v1::explain_packet_request::{ConnState, Origin as ReqOrigin};
use splitproxy_proto::v1::{
    ExplainPacketRequest, ExplainPacketResponse, PacketFate, PacketOutcome,
};
use tonic::transport::Channel;

use crate::Result;
use crate::lab::{Lab, Origin, ProbeSource};
use crate::probe::{ProbeResult, Proto};
use crate::topology::{POD_BRIDGE, PodNetwork};

/// Nodes a probe's packet is followed through at most.
const MAX_HOPS: usize = 3;

/// A brain to ask.
pub type Explainer = DataplaneClient<Channel>;

/// One node's explanation of the probe's packet.
#[derive(Debug, Clone)]
pub struct Hop {
    pub node: String,
    pub response: ExplainPacketResponse,
}

/// A probe explained, and where the explanation disagrees with its results.
#[derive(Debug, Clone, Default)]
pub struct ProbeExplanation {
    pub hops: Vec<Hop>,
    pub disagreements: Vec<String>,
}

impl ProbeExplanation {
    /// One line per node: its verdict.
    pub fn summary(&self) -> Vec<String> {
        self.hops
            .iter()
            .map(|h| {
                let verdict = h
                    .response
                    .text
                    .lines()
                    .find_map(|l| l.strip_prefix("verdict: "))
                    .unwrap_or_default();
                let mut line = format!("{}: {verdict}", h.node);
                if h.response.outcomes.len() > 1 {
                    for o in &h.response.outcomes {
                        line.push_str(&format!("\n      - {}", o.summary));
                    }
                }
                line
            })
            .collect()
    }
}

/// Where an outcome sends the packet: its DNAT target, or the destination when untouched.
fn target(o: &PacketOutcome, dst: SocketAddr) -> Option<SocketAddr> {
    match PacketFate::try_from(o.fate).ok()? {
        PacketFate::Dnat => Some(SocketAddr::new(
            o.dnat_address.parse().ok()?,
            u16::try_from(o.dnat_port).ok()?,
        )),
        PacketFate::Accepted => Some(dst),
        _ => None,
    }
}

fn fate(o: &PacketOutcome) -> PacketFate {
    PacketFate::try_from(o.fate).unwrap_or(PacketFate::Unspecified)
}

impl Lab {
    /// A client of the first running brain, with the operator's certificate.
    pub async fn explainer(&self) -> Result<Explainer> {
        let i = self
            .brains
            .iter()
            .position(Option::is_some)
            .ok_or_else(|| anyhow::anyhow!("no brain runs"))?;
        self.operator_client(i).await
    }

    /// The node whose ruleset a probe's packet meets first, how it meets it, and on which
    /// interface.
    fn first_hop(&self, src: &ProbeSource, dst: IpAddr) -> (usize, ReqOrigin, String) {
        match &src.origin {
            Origin::Pod(p) => {
                let iif = match self.opts.effective_pod_network() {
                    PodNetwork::Bridge => POD_BRIDGE.to_string(),
                    PodNetwork::Routed => p.node_veth().to_string(),
                };
                (p.node_index(), ReqOrigin::Arriving, iif)
            }
            Origin::Node(i) => (*i, ReqOrigin::Local, String::new()),
            Origin::External(e) => {
                let node = self
                    .cluster
                    .node_by_ip(dst)
                    .map(|n| n.index())
                    .unwrap_or_else(|| e.via_node());
                (node, ReqOrigin::Arriving, "eth0".into())
            }
        }
    }

    /// The address a probe's packet leaves with: the bound one, the one the kernel chose (an
    /// answer says), or the source's own address of the destination's family.
    fn probe_source(&self, src: &ProbeSource, dst: IpAddr, results: &[ProbeResult]) -> IpAddr {
        if let Some(b) = src.bind {
            return b;
        }
        let answered = results.iter().find_map(|r| match r {
            ProbeResult::Answered { client, .. } if !client.ip().is_unspecified() => {
                Some(client.ip())
            }
            _ => None,
        });
        if let Some(a) = answered {
            return a.to_canonical();
        }
        match &src.origin {
            Origin::Pod(p) => p.ip_like(dst).unwrap_or(p.ip()),
            Origin::Node(i) => {
                let n = self.cluster.node(*i);
                if dst.is_ipv4() {
                    n.ip().into()
                } else {
                    n.ip6().into()
                }
            }
            Origin::External(e) => e.ip_like(dst).unwrap_or(e.ip()),
        }
    }

    fn owns(&self, ip: IpAddr) -> bool {
        self.pod_by_ip(ip).is_some()
            || self.cluster.node_by_ip(ip).is_some()
            || self.cluster.external_client_by_ip(ip).is_some()
    }

    /// Explains one probe (`from` to `dst`) node by node and checks the explanation against
    /// `results`.
    pub async fn explain_probe(
        &self,
        brain: &mut Explainer,
        from: &str,
        proto: Proto,
        dst: SocketAddr,
        source_port: Option<u16>,
        results: &[ProbeResult],
    ) -> ProbeExplanation {
        let mut out = ProbeExplanation::default();
        let src = match self.resolve(from) {
            Ok(s) => s,
            Err(e) => {
                out.disagreements.push(format!("cannot explain: {e:#}"));
                return out;
            }
        };
        let dst = SocketAddr::new(dst.ip().to_canonical(), dst.port());
        let source = self.probe_source(&src, dst.ip(), results);
        let sport = source_port.unwrap_or_else(|| {
            results
                .iter()
                .find_map(|r| match r {
                    ProbeResult::Answered { client, .. } => Some(client.port()),
                    _ => None,
                })
                .unwrap_or(0)
        });
        let (mut node, mut origin, mut iif) = self.first_hop(&src, dst.ip());
        loop {
            let n = self.cluster.node(node);
            let req = ExplainPacketRequest {
                node: n.name().to_string(),
                source_ip: source.to_string(),
                source_port: u32::from(sport),
                destination_ip: dst.ip().to_string(),
                destination_port: u32::from(dst.port()),
                protocol: proto.to_string(),
                ingress_interface: iif.clone(),
                origin: origin as i32,
                conn_state: ConnState::New as i32,
                mark: 0,
                node_addresses: n.ips().iter().map(ToString::to_string).collect(),
            };
            let response = match brain.explain_packet(req).await {
                Ok(r) => r.into_inner(),
                Err(e) => {
                    out.disagreements
                        .push(format!("ExplainPacket on {} failed: {e}", n.name()));
                    return out;
                }
            };
            out.hops.push(Hop {
                node: n.name().to_string(),
                response: response.clone(),
            });
            // Untouched and not masqueraded towards another node's address: that node next.
            let onward = match response.outcomes.as_slice() {
                [o] if fate(o) == PacketFate::Accepted && !o.masquerade => self
                    .cluster
                    .node_by_ip(dst.ip())
                    .map(|m| m.index())
                    .filter(|m| *m != node),
                _ => None,
            };
            match onward {
                Some(next) if out.hops.len() < MAX_HOPS => {
                    node = next;
                    origin = ReqOrigin::Arriving;
                    iif = "eth0".into();
                }
                _ => break,
            }
        }
        if let Some(last) = out.hops.last() {
            for r in results {
                if let Some(d) = self.disagreement(r, &last.response, dst, proto) {
                    out.disagreements.push(format!(
                        "{d}\n      explanation on {}:\n{}",
                        last.node,
                        indent(&last.response.text, 8)
                    ));
                }
            }
        }
        out
    }

    /// Why `result` contradicts `explained`, with what this lab knows: which addresses its
    /// servers listen on, which addresses its members own.
    fn disagreement(
        &self,
        result: &ProbeResult,
        explained: &ExplainPacketResponse,
        dst: SocketAddr,
        proto: Proto,
    ) -> Option<String> {
        disagreement(
            result,
            explained,
            dst,
            |t| self.serves(t.ip(), proto, t.port()),
            |ip| self.owns(ip),
        )
    }
}

/// Why `result` contradicts `explained` (see the module's rules), if it does. `serves`: a
/// server of the lab listens on that address; `owns`: a member of the lab has that address.
pub fn disagreement(
    result: &ProbeResult,
    explained: &ExplainPacketResponse,
    dst: SocketAddr,
    serves: impl Fn(SocketAddr) -> bool,
    owns: impl Fn(IpAddr) -> bool,
) -> Option<String> {
    let outcomes = &explained.outcomes;
    let nobody_owns = |o: &PacketOutcome| {
        fate(o) == PacketFate::Accepted && !owns(dst.ip()) && !o.route.starts_with("delivered")
    };
    match result {
        ProbeResult::Answered {
            pod,
            endpoint,
            source,
            client,
        } => {
            let endpoint = SocketAddr::new(endpoint.ip().to_canonical(), endpoint.port());
            let Some(o) = outcomes.iter().find(|o| target(o, dst) == Some(endpoint)) else {
                let all: Vec<String> = outcomes
                    .iter()
                    .filter_map(|o| target(o, dst))
                    .map(|t| t.to_string())
                    .collect();
                return Some(format!(
                    "{pod} answered on {endpoint}, which is none of the explained destinations [{}]",
                    all.join(", ")
                ));
            };
            if client.ip().is_unspecified() {
                return None;
            }
            let kept = source.ip().to_canonical() == client.ip().to_canonical()
                && source.port() == client.port();
            match (o.masquerade, kept) {
                (true, true) => Some(format!(
                    "explained as masqueraded, but {pod} saw the client's own {client}"
                )),
                (false, false) => Some(format!(
                    "explained with the source kept, but {pod} saw {source} for {client}"
                )),
                _ => None,
            }
        }
        ProbeResult::Refused => {
            let ok = outcomes.iter().any(|o| {
                fate(o) == PacketFate::Rejected || target(o, dst).is_some_and(|t| !serves(t))
            });
            (!ok).then(|| {
                "refused, but the explanation neither rejects nor delivers where nothing listens"
                    .to_string()
            })
        }
        ProbeResult::TimedOut => {
            let ok = outcomes
                .iter()
                .any(|o| fate(o) == PacketFate::Dropped || nobody_owns(o));
            (!ok).then(|| {
                "dropped (no answer), but the explanation neither drops nor sends it where nothing owns the address"
                    .to_string()
            })
        }
        ProbeResult::Unreachable(why) => {
            let ok = outcomes
                .iter()
                .any(|o| fate(o) == PacketFate::Rejected || nobody_owns(o));
            (!ok).then(|| {
                format!("unreachable ({why}), but the explanation neither rejects nor sends it where nothing owns the address")
            })
        }
        ProbeResult::Error(_) => None,
    }
}

fn indent(text: &str, n: usize) -> String {
    text.lines()
        .map(|l| format!("{}{l}", " ".repeat(n)))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(fate: PacketFate, to: &str, masquerade: bool) -> PacketOutcome {
        let (addr, port) = match to.parse::<SocketAddr>() {
            Ok(a) => (a.ip().to_string(), u32::from(a.port())),
            Err(_) => (String::new(), 0),
        };
        PacketOutcome {
            fate: fate as i32,
            dnat_address: addr,
            dnat_port: port,
            masquerade,
            route: "forwarded".into(),
            ..Default::default()
        }
    }

    fn explained(outcomes: Vec<PacketOutcome>) -> ExplainPacketResponse {
        ExplainPacketResponse {
            outcomes,
            ..Default::default()
        }
    }

    fn answered(endpoint: &str, source: &str, client: &str) -> ProbeResult {
        ProbeResult::Answered {
            pod: "p".into(),
            endpoint: endpoint.parse().unwrap(),
            source: source.parse().unwrap(),
            client: client.parse().unwrap(),
        }
    }

    #[test]
    fn results_are_held_against_the_explanation() {
        let dst: SocketAddr = "10.96.0.10:80".parse().unwrap();
        let serves = |t: SocketAddr| t.ip().to_string().starts_with("10.244.");
        let owns = |ip: IpAddr| ip.to_string().starts_with("10.244.");
        let check =
            |r: &ProbeResult, x: &ExplainPacketResponse| disagreement(r, x, dst, serves, owns);
        let two = explained(vec![
            outcome(PacketFate::Dnat, "10.244.0.5:8080", false),
            outcome(PacketFate::Dnat, "10.244.1.5:8080", true),
        ]);
        // An answer from a candidate, with the source as explained.
        assert_eq!(
            check(
                &answered("10.244.0.5:8080", "10.244.9.9:4000", "10.244.9.9:4000"),
                &two
            ),
            None
        );
        assert_eq!(
            check(
                &answered("10.244.1.5:8080", "192.168.77.10:5000", "10.244.9.9:4000"),
                &two
            ),
            None
        );
        // From an endpoint that is no candidate; masquerade contradicted either way.
        assert!(
            check(
                &answered("10.244.2.5:8080", "10.244.9.9:4000", "10.244.9.9:4000"),
                &two
            )
            .is_some()
        );
        assert!(
            check(
                &answered("10.244.0.5:8080", "192.168.77.10:5000", "10.244.9.9:4000"),
                &two
            )
            .is_some()
        );
        assert!(
            check(
                &answered("10.244.1.5:8080", "10.244.9.9:4000", "10.244.9.9:4000"),
                &two
            )
            .is_some()
        );
        // Refused, dropped, unreachable against DNAT to serving endpoints: all contradictions.
        for r in [
            ProbeResult::Refused,
            ProbeResult::TimedOut,
            ProbeResult::Unreachable("x".into()),
        ] {
            assert!(check(&r, &two).is_some(), "{r:?}");
        }
        let rejected = explained(vec![outcome(PacketFate::Rejected, "", false)]);
        assert_eq!(check(&ProbeResult::Refused, &rejected), None);
        assert!(check(&ProbeResult::TimedOut, &rejected).is_some());
        assert!(
            check(
                &answered("10.244.0.5:8080", "10.244.9.9:1", "10.244.9.9:1"),
                &rejected
            )
            .is_some()
        );
        let dropped = explained(vec![outcome(PacketFate::Dropped, "", false)]);
        assert_eq!(check(&ProbeResult::TimedOut, &dropped), None);
        assert!(check(&ProbeResult::Refused, &dropped).is_some());
        // Untouched towards an address nobody owns: the fabric swallows it.
        let untouched = explained(vec![outcome(PacketFate::Accepted, "", false)]);
        assert_eq!(check(&ProbeResult::TimedOut, &untouched), None);
        // Refused where nothing listens (the DNAT target has no server).
        let nowhere = explained(vec![outcome(PacketFate::Dnat, "192.0.2.1:80", false)]);
        assert_eq!(check(&ProbeResult::Refused, &nowhere), None);
        // Errors are not compared.
        assert_eq!(check(&ProbeResult::Error("e".into()), &two), None);
    }
}
