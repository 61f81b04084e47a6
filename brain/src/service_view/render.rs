//! The variants in words (`GetServiceResponse.variants_summary`): a line per variant, then a
//! line per traffic entry, so `grpcurl ... | jq -r .variantsSummary` reads like a report.
use std::fmt::Write;
use std::net::{IpAddr, SocketAddr};

use splitproxy_proto::v1::{
    PacketFate, ServiceTraffic, ServiceVariant, TrafficEndpoint, service_traffic::Kind,
};

use super::variants::Variants;

pub fn variants(v: &Variants) -> String {
    if v.version == 0 {
        return "no desired state published yet".into();
    }
    let nodes: u32 = v.variants.iter().map(|x| x.node_count).sum::<u32>() + v.nodes_left_out;
    let count = v.variants.len() as u32 + v.left_out;
    let mut s = format!(
        "{} over {} (publication {})",
        plural(count, "variant"),
        plural(nodes, "node"),
        v.version
    );
    if v.left_out > 0 {
        let _ = write!(
            s,
            "; {} with {} not listed",
            plural(v.left_out, "variant"),
            plural(v.nodes_left_out, "node")
        );
    }
    if v.destinations_left_out > 0 {
        let _ = write!(
            s,
            "; {} destinations not evaluated",
            v.destinations_left_out
        );
    }
    s.push('\n');
    for variant in &v.variants {
        variant_lines(&mut s, variant);
    }
    s
}

fn plural(n: u32, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

fn variant_lines(s: &mut String, v: &ServiceVariant) {
    let more = (v.node_count as usize).saturating_sub(v.nodes.len());
    let _ = write!(
        s,
        "  {} ({}",
        plural(v.node_count, "node"),
        v.nodes.join(", ")
    );
    if more > 0 {
        let _ = write!(s, ", {more} more");
    }
    s.push(')');
    if !v.zone.is_empty() {
        let _ = write!(s, ", zone {}", v.zone);
    }
    s.push_str(":\n");
    for t in &v.traffic {
        let _ = writeln!(s, "    {}", traffic_line(t));
    }
}

fn kind_word(t: &ServiceTraffic) -> &'static str {
    match t.kind() {
        Kind::ClusterIp => "ClusterIP",
        Kind::NodePort => "NodePort",
        Kind::ExternalIp => "externalIP",
        Kind::LoadBalancerIp => "load balancer",
        Kind::Unspecified => "traffic",
    }
}

/// "ClusterIP 10.96.0.10:80 (TCP http, from the node itself) -> 10.244.1.5:8080 50%, ...".
pub fn traffic_line(t: &ServiceTraffic) -> String {
    let mut s = format!(
        "{} {} ({} {}, from {})",
        kind_word(t),
        t.destinations.join(", "),
        t.protocol,
        if t.port_name.is_empty() {
            "unnamed port"
        } else {
            &t.port_name
        },
        t.client
    );
    match t.fate() {
        PacketFate::Dnat => {
            let eps: Vec<String> = t.endpoints.iter().map(endpoint).collect();
            let _ = write!(s, " -> {}", eps.join(", "));
            if t.endpoints_left_out > 0 {
                let _ = write!(s, " and {} more", t.endpoints_left_out);
            }
            if t.terminating_fallback {
                s.push_str(" (terminating endpoints: none is ready)");
            }
        }
        PacketFate::Dropped => s.push_str(" -> no endpoint: dropped"),
        PacketFate::Rejected => s.push_str(" -> no endpoint: rejected"),
        PacketFate::Accepted => s.push_str(" -> untouched (no rule of splitproxy takes it)"),
        PacketFate::Unspecified => {}
    }
    if t.affinity {
        s.push_str(", session affinity");
    }
    if !t.note.is_empty() {
        let _ = write!(s, " [{}]", t.note);
    }
    if !t.exact {
        s.push_str(" [inexact]");
    }
    s
}

fn endpoint(e: &TrafficEndpoint) -> String {
    let addr = match e.address.parse::<IpAddr>() {
        Ok(ip) => SocketAddr::new(ip, e.port as u16).to_string(),
        Err(_) => format!("{}:{}", e.address, e.port),
    };
    let mut s = addr;
    if e.modulus > 1 {
        let _ = write!(s, " {:.0}%", e.share * 100.0);
    }
    if e.terminating {
        s.push_str(" (terminating)");
    }
    s
}
