//! The explanation in words: one line per step, indented by where the step happens (hook,
//! chain, rule, what the rule did).
use std::fmt::Write as _;

use super::eval::describe_reject;
use super::{Origin, Packet};
use crate::v1::{ExplainPacketResponse, PacketFate, PacketOutcome, PathStep, path_step::Kind};

fn proto_name(p: u8) -> String {
    match p {
        6 => "tcp".into(),
        17 => "udp".into(),
        132 => "sctp".into(),
        p => format!("protocol {p}"),
    }
}

fn sock(ip: std::net::IpAddr, port: u16) -> String {
    std::net::SocketAddr::new(ip, port).to_string()
}

/// One outcome in a sentence.
pub fn outcome_summary(o: &PacketOutcome, v6: bool) -> String {
    let mut s = match PacketFate::try_from(o.fate).unwrap_or(PacketFate::Unspecified) {
        PacketFate::Dnat => {
            let ip: Option<std::net::IpAddr> = o.dnat_address.parse().ok();
            let to = match (ip, u16::try_from(o.dnat_port)) {
                (Some(ip), Ok(p)) => sock(ip, p),
                _ => format!("{} port {}", o.dnat_address, o.dnat_port),
            };
            format!("DNAT to {to}")
        }
        PacketFate::Rejected => format!(
            "REJECTED with {}",
            o.reject
                .as_ref()
                .map(|r| describe_reject(r, v6))
                .unwrap_or_default()
        ),
        PacketFate::Dropped => "DROPPED".to_string(),
        PacketFate::Accepted => "ACCEPTED without translation".to_string(),
        PacketFate::Unspecified => "unknown".to_string(),
    };
    if o.modulus > 0 {
        let mut slots = o.slots.clone();
        slots.sort_unstable();
        let list: Vec<String> = slots.iter().map(ToString::to_string).collect();
        let _ = write!(
            s,
            " (numgen value{} {} of mod {}: {:.1}% of new connections)",
            if slots.len() == 1 { "" } else { "s" },
            list.join(","),
            o.modulus,
            o.share * 100.0
        );
    }
    if o.masquerade {
        s.push_str(", source masqueraded");
    } else if o.fate == PacketFate::Dnat as i32 || o.fate == PacketFate::Accepted as i32 {
        s.push_str(", source kept");
    }
    for d in &o.dynsets {
        let _ = write!(s, ", remembered in @{} for {}s", d.set, d.timeout_ms / 1000);
    }
    if !o.route.is_empty()
        && o.fate != PacketFate::Dropped as i32
        && o.fate != PacketFate::Rejected as i32
    {
        let _ = write!(s, "; {}", o.route);
    }
    s
}

/// Outcomes whose own path the text shows.
const MAX_TEXT_PATHS: usize = 8;

fn indent(step: &PathStep) -> usize {
    let d = step.depth as usize;
    match Kind::try_from(step.kind).unwrap_or(Kind::Unspecified) {
        Kind::Hook => 1,
        Kind::Note if step.chain.is_empty() => 2,
        Kind::Chain | Kind::Note => 2 + d,
        Kind::Rule | Kind::NoMatch | Kind::Verdict => 3 + d,
        Kind::Lookup | Kind::Effect => 4 + d,
        Kind::Unspecified => 1,
    }
}

fn steps(out: &mut String, steps: &[PathStep], base: usize) {
    for s in steps {
        let _ = writeln!(out, "{}{}", "  ".repeat(base + indent(s)), s.text);
    }
}

/// The whole explanation: the packet, the verdict, the path, the assumptions.
pub fn render(p: &Packet, r: &ExplainPacketResponse) -> String {
    let mut out = String::new();
    let origin = match p.origin {
        Origin::Arriving => format!(
            "arriving{}",
            match &p.iifname {
                Some(i) if !i.is_empty() => format!(" on {i}"),
                _ => " (ingress interface unknown)".into(),
            }
        ),
        Origin::Local => "sent by the node itself".into(),
    };
    let _ = writeln!(
        out,
        "packet: {} {} -> {}, {origin}, {}",
        proto_name(p.l4proto),
        sock(p.saddr, p.sport),
        sock(p.daddr, p.dport),
        if p.established {
            "established connection"
        } else {
            "new connection"
        }
    );
    let _ = writeln!(
        out,
        "verdict: {}{}",
        match r.outcomes.as_slice() {
            [one] => one.summary.clone(),
            many => format!("{} outcomes", many.len()),
        },
        if r.affinity {
            " (session affinity: a client seen before goes back to its remembered endpoint)"
        } else {
            ""
        }
    );
    if r.outcomes.len() > 1 {
        for o in &r.outcomes {
            let _ = writeln!(out, "  - {}", o.summary);
        }
    }
    let _ = writeln!(out, "path:");
    steps(&mut out, &r.path, 0);
    if r.outcomes.len() > 1 || r.outcomes.iter().any(|o| !o.path.is_empty()) {
        let with_path: Vec<_> = r.outcomes.iter().filter(|o| !o.path.is_empty()).collect();
        for o in with_path.iter().take(MAX_TEXT_PATHS) {
            let _ = writeln!(out, "  then, for {}:", o.summary);
            steps(&mut out, &o.path, 1);
        }
        if with_path.len() > MAX_TEXT_PATHS {
            let _ = writeln!(
                out,
                "  ({} more outcomes: their paths differ in the values they looked up; see outcomes[].path)",
                with_path.len() - MAX_TEXT_PATHS
            );
        }
    }
    if !r.assumptions.is_empty() {
        let _ = writeln!(out, "assumptions:");
        for a in &r.assumptions {
            let _ = writeln!(out, "  - {a}");
        }
    }
    out
}
