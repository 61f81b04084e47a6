//! How a ruleset's objects print: chain types, hooks and priorities by nft's names, set types,
//! element lists, intervals, verdicts, timeouts and quoted strings.
use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

use crate::v1::{self, ChainType, DataType, Hook, Set, Verdict, VerdictCode, datum};

use super::element;
use super::values::{Kind, format_bytes, proto_name};

pub(super) fn chain_type_name(t: i32) -> &'static str {
    match ChainType::try_from(t) {
        Ok(ChainType::Filter) => "filter",
        Ok(ChainType::Nat) => "nat",
        Ok(ChainType::Route) => "route",
        _ => "unknown",
    }
}

pub(super) fn hook_name(h: i32) -> &'static str {
    match Hook::try_from(h) {
        Ok(Hook::Prerouting) => "prerouting",
        Ok(Hook::Input) => "input",
        Ok(Hook::Forward) => "forward",
        Ok(Hook::Output) => "output",
        Ok(Hook::Postrouting) => "postrouting",
        _ => "unknown",
    }
}

/// nft's `prio2str`: the first standard priority within 10 of `prio` names it (`dstnat - 10`)
/// when it is valid for the hook; otherwise the number.
pub(super) fn priority_name(hook: i32, prio: i32) -> String {
    const STD: [(i64, &str); 6] = [
        (-300, "raw"),
        (-150, "mangle"),
        (-100, "dstnat"),
        (0, "filter"),
        (50, "security"),
        (100, "srcnat"),
    ];
    let hook = Hook::try_from(hook).ok();
    for (value, name) in STD {
        let offset = i64::from(prio) - value;
        if offset.abs() > 10 {
            continue;
        }
        let compatible = match name {
            "dstnat" => matches!(hook, Some(Hook::Prerouting | Hook::Output)),
            "srcnat" => matches!(hook, Some(Hook::Input | Hook::Postrouting)),
            _ => true,
        };
        if !compatible {
            break;
        }
        return match offset {
            0 => name.to_string(),
            o if o > 0 => format!("{name} + {o}"),
            o => format!("{name} - {}", -o),
        };
    }
    prio.to_string()
}

pub(super) fn type_name(t: i32) -> String {
    match DataType::try_from(t) {
        Ok(DataType::Verdict) => "verdict".into(),
        Ok(DataType::Integer) => "integer".into(),
        Ok(DataType::Ipv4Addr) => "ipv4_addr".into(),
        Ok(DataType::Ipv6Addr) => "ipv6_addr".into(),
        Ok(DataType::InetProto) => "inet_proto".into(),
        Ok(DataType::InetService) => "inet_service".into(),
        Ok(DataType::Mark) => "mark".into(),
        Ok(DataType::Unspecified) => "invalid".into(),
        Err(_) => format!("type_{t}"),
    }
}

pub(super) fn type_names(types: &[i32]) -> String {
    if types.is_empty() {
        return "invalid".into();
    }
    types
        .iter()
        .map(|&t| type_name(t))
        .collect::<Vec<_>>()
        .join(" . ")
}

/// The `{ a, b,\n\t\t\t     c }` list, wrapped the way nft's `calculate_delim` does: one
/// element per line for maps, concatenations, timeouts and commented elements; otherwise two
/// addresses or five numbers per line.
pub(super) fn elements(s: &Set) -> String {
    const NEWLINE: &str = ",\n\t\t\t     ";
    let force_newline = !s.data.is_empty()
        || s.timeout
        || s.default_timeout_ms > 0
        || s.key.len() != 1
        || s.elements.iter().any(|e| !e.comment.is_empty());
    let per_line = if force_newline {
        1
    } else {
        match s.key.first().and_then(|&t| DataType::try_from(t).ok()) {
            Some(
                DataType::Integer | DataType::InetProto | DataType::InetService | DataType::Mark,
            ) => 5,
            Some(DataType::Ipv4Addr) => 2,
            _ => 1,
        }
    };
    let mut out = String::from("{ ");
    for (i, e) in s.elements.iter().enumerate() {
        if i > 0 {
            out.push_str(if i % per_line == 0 { NEWLINE } else { ", " });
        }
        out.push_str(&element(s, e));
    }
    out.push_str(" }");
    out
}

pub(super) fn datum_text(d: &v1::Datum, ty: Option<i32>) -> String {
    match &d.value {
        Some(datum::Value::Ipv4(b)) => format_bytes(Kind::Ipv4, b),
        Some(datum::Value::Ipv6(b)) => format_bytes(Kind::Ipv6, b),
        Some(datum::Value::Proto(p)) => match u8::try_from(*p) {
            Ok(p) => proto_name(p),
            Err(_) => p.to_string(),
        },
        Some(datum::Value::Port(p)) => p.to_string(),
        Some(datum::Value::U32(v)) => {
            if ty == Some(DataType::Mark as i32) {
                format!("0x{v:08x}")
            } else {
                v.to_string()
            }
        }
        None => "<none>".into(),
    }
}

/// An interval element: a prefix when it is one (`10.0.0.0/24`), else `start-end`.
pub(super) fn interval(start: &v1::Datum, end: &v1::Datum, ty: Option<i32>) -> String {
    use datum::Value::{Ipv4, Ipv6};
    let prefix = match (&start.value, &end.value) {
        (Some(Ipv4(a)), Some(Ipv4(b))) => {
            match (<[u8; 4]>::try_from(&a[..]), <[u8; 4]>::try_from(&b[..])) {
                (Ok(a), Ok(b)) => range_prefix(
                    u128::from(u32::from_be_bytes(a)),
                    u128::from(u32::from_be_bytes(b)),
                    32,
                )
                .map(|len| format!("{}/{len}", Ipv4Addr::from(a))),
                _ => None,
            }
        }
        (Some(Ipv6(a)), Some(Ipv6(b))) => {
            match (<[u8; 16]>::try_from(&a[..]), <[u8; 16]>::try_from(&b[..])) {
                (Ok(a), Ok(b)) => range_prefix(u128::from_be_bytes(a), u128::from_be_bytes(b), 128)
                    .map(|len| format!("{}/{len}", Ipv6Addr::from(a))),
                _ => None,
            }
        }
        _ => None,
    };
    prefix.unwrap_or_else(|| format!("{}-{}", datum_text(start, ty), datum_text(end, ty)))
}

/// The prefix length when `[start, end]` is exactly one prefix of a `bits`-wide address.
pub(super) fn range_prefix(start: u128, end: u128, bits: u32) -> Option<u32> {
    let host = start ^ end;
    if start > end || host & host.wrapping_add(1) != 0 || start & host != 0 {
        return None;
    }
    Some(bits - (128 - host.leading_zeros()))
}

pub(super) fn verdict(v: &Verdict) -> String {
    match VerdictCode::try_from(v.code) {
        Ok(VerdictCode::Accept) => "accept".into(),
        Ok(VerdictCode::Drop) => "drop".into(),
        Ok(VerdictCode::Continue) => "continue".into(),
        Ok(VerdictCode::Return) => "return".into(),
        Ok(VerdictCode::Jump) => format!("jump {}", v.chain),
        Ok(VerdictCode::Goto) => format!("goto {}", v.chain),
        _ => format!("verdict {}", v.code),
    }
}

/// nft's `time_print`: `1d2h3m4s5ms`, zero components left out.
pub(super) fn duration(ms: u64) -> String {
    if ms == 0 {
        return "0s".into();
    }
    let mut out = String::new();
    let mut rest = ms;
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
        ("ms", 1),
    ] {
        let n = rest / size;
        rest %= size;
        if n > 0 {
            let _ = write!(out, "{n}{unit}");
        }
    }
    out
}

pub(super) fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::Hook;

    #[test]
    fn durations_print_like_nft() {
        assert_eq!(duration(10_800_000), "3h");
        assert_eq!(duration(10_799_157), "2h59m59s157ms");
        assert_eq!(duration(90_061_001), "1d1h1m1s1ms");
        assert_eq!(duration(500), "500ms");
        assert_eq!(duration(0), "0s");
    }

    #[test]
    fn priorities_use_standard_names_where_nft_does() {
        let pre = Hook::Prerouting as i32;
        let fwd = Hook::Forward as i32;
        let post = Hook::Postrouting as i32;
        let out = Hook::Output as i32;
        assert_eq!(priority_name(pre, -100), "dstnat");
        assert_eq!(priority_name(pre, -110), "dstnat - 10");
        assert_eq!(priority_name(out, -95), "dstnat + 5");
        assert_eq!(priority_name(fwd, -110), "-110");
        assert_eq!(priority_name(fwd, -100), "-100");
        assert_eq!(priority_name(fwd, 0), "filter");
        assert_eq!(priority_name(fwd, 10), "filter + 10");
        assert_eq!(priority_name(fwd, 11), "11");
        assert_eq!(priority_name(fwd, 40), "security - 10");
        assert_eq!(priority_name(post, 100), "srcnat");
        assert_eq!(priority_name(post, 110), "srcnat + 10");
        assert_eq!(priority_name(fwd, 100), "100");
        assert_eq!(priority_name(pre, -300), "raw");
        assert_eq!(priority_name(pre, -150), "mangle");
        assert_eq!(priority_name(pre, i32::MIN), i32::MIN.to_string());
        assert_eq!(priority_name(999, 0), "filter");
    }
}
