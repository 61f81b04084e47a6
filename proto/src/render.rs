//! Renders the ruleset IR as `nft` syntax, as close as practical to what `nft list ruleset`
//! prints, for logs, gRPC introspection and golden tests.
//!
//! Rules in the IR are register-level (the way netlink carries them), so rendering a rule is a
//! small decompilation: every load (payload, meta, ct, fib, numgen, immediate, data-map lookup,
//! bitwise) records in a model of the sixteen 32-bit registers what the register holds as an nft
//! expression, and every consumer (cmp, lookup, nat, meta set, dynset) prints a statement from
//! those expressions, formatting constants after the type of what they are compared with.
//!
//! Rendering never fails and never panics: whatever cannot be prettified is printed in a
//! faithful low-level form (`reg 3` for a register that holds nothing known, `0x...` for bytes
//! of unknown type, `@nh,OFFSET,LEN` for unnamed header fields).
//!
//! Where the renderer knows the table (see [`Context`]), lookups use the set definitions for
//! the number and types of key fields. Without it ([`rule`], [`chain`]) the key of a lookup is
//! guessed as the run of registers loaded one after the other from `sreg`.
//!
//! Layout, priorities (`dstnat - 10`, or the number where nft prints one), flag forms
//! (`ct state new`, `ct status ! dnat`), prefixes, mark arithmetic, nat and reject follow nft's
//! printer and were checked against `nft list ruleset` (nft 1.0.6, private network namespace).
//! Differences, by design:
//! - nested map lookups print as `KEY map @a vmap @b`, which nft cannot parse;
//! - `counter` prints without `packets N bytes M` (the IR has no counts), set elements without
//!   `expires`, dynamic sets without `size`;
//! - transport ports print as `th sport`/`th dport`, where nft says `tcp dport` after a
//!   protocol match; interface indexes print as numbers, where nft prints names;
//! - element lists wrap like current nft (1.1): one element per line in maps, concatenations,
//!   sets with timeouts or commented elements; nft 1.0 packs single-type maps five to a line;
//! - two cmps that make a range stay two cmps; `"` in comments is escaped.
use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

use crate::v1::{
    self, Chain, ChainType, CmpOp, CtDirection, CtKey, DataType, DynsetOp, Element, Family,
    FibResult, Hook, MetaKey, NatType, NumgenType, PayloadBase, RejectType, Rule, Ruleset, Set,
    Table, Verdict, VerdictCode, datum, expr,
};

/// Number of 32-bit data registers (NFT_REG32_00..15).
const NREGS: usize = 16;

// NF_NAT_RANGE_* flags.
const NAT_RANGE_MAP_IPS: u32 = 1;
const NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
const NAT_RANGE_PROTO_RANDOM: u32 = 4;
const NAT_RANGE_PERSISTENT: u32 = 8;
const NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 16;

// NFTA_FIB_F_* flags.
const FIB_F_PRESENT: u32 = 32;

/// What a rule is rendered against: the table family (payload names, nat and reject syntax) and
/// the table's sets (key and data layout of lookups, dynsets and data maps).
pub struct Context<'a> {
    family: i32,
    sets: HashMap<&'a str, &'a Set>,
}

impl<'a> Context<'a> {
    /// A context of a table family (`Family` as its i32 value) and the sets rules may name.
    pub fn new(family: i32, sets: &'a [Set]) -> Self {
        Self {
            family,
            sets: sets.iter().map(|s| (s.name.as_str(), s)).collect(),
        }
    }

    /// The context of a table: its family and its sets.
    pub fn of(table: &'a Table) -> Self {
        Self::new(table.family, &table.sets)
    }

    /// No table known: family unspecified, no sets.
    pub fn empty() -> Context<'static> {
        Context {
            family: Family::Unspecified as i32,
            sets: HashMap::new(),
        }
    }

    fn family(&self) -> Option<Family> {
        Family::try_from(self.family).ok()
    }
}

/// Every table, one after the other, as `nft list ruleset` prints them.
pub fn ruleset(r: &Ruleset) -> String {
    r.tables.iter().map(table).collect()
}

/// A table with its sets and maps first (in the given order), then its chains.
pub fn table(t: &Table) -> String {
    let ctx = Context::of(t);
    let mut out = format!("table {} {} {{\n", t.family().nft_name(), t.name);
    if !t.comment.is_empty() {
        let _ = writeln!(out, "\tcomment {}", quoted(&t.comment));
    }
    let mut delim = "";
    for s in &t.sets {
        out.push_str(delim);
        out.push_str(&set(s));
        delim = "\n";
    }
    for c in &t.chains {
        out.push_str(delim);
        out.push_str(&chain_in(&ctx, c));
        delim = "\n";
    }
    out.push_str("}\n");
    out
}

/// A chain block as it appears inside a table (one tab of indentation), rendered without table
/// context: see [`chain_in`] to give the family and sets.
pub fn chain(c: &Chain) -> String {
    chain_in(&Context::empty(), c)
}

/// A chain block as it appears inside a table, its rules rendered against `ctx`.
pub fn chain_in(ctx: &Context<'_>, c: &Chain) -> String {
    let mut out = format!("\tchain {} {{\n", c.name);
    if !c.comment.is_empty() {
        let _ = writeln!(out, "\t\tcomment {}", quoted(&c.comment));
    }
    if let Some(base) = &c.base {
        let _ = writeln!(
            out,
            "\t\ttype {} hook {} priority {}; policy {};",
            chain_type_name(base.r#type),
            hook_name(base.hook),
            priority_name(base.hook, base.priority),
            if base.policy_drop { "drop" } else { "accept" },
        );
    }
    for r in &c.rules {
        out.push_str("\t\t");
        out.push_str(&rule_in(ctx, r));
        out.push('\n');
    }
    out.push_str("\t}\n");
    out
}

/// A set or map block as it appears inside a table (one tab of indentation).
pub fn set(s: &Set) -> String {
    let kind = if s.data.is_empty() { "set" } else { "map" };
    let mut out = format!("\t{kind} {} {{\n\t\ttype {}", s.name, type_names(&s.key));
    if !s.data.is_empty() {
        let _ = write!(out, " : {}", type_names(&s.data));
    }
    out.push('\n');
    // As nft: the flags line is left out when its only flag would be `timeout` and the set
    // has a default timeout; when printed, it lists every flag.
    if s.dynamic || s.interval || (s.timeout && s.default_timeout_ms == 0) {
        let mut flags = Vec::new();
        if s.dynamic {
            flags.push("dynamic");
        }
        if s.interval {
            flags.push("interval");
        }
        if s.timeout {
            flags.push("timeout");
        }
        let _ = writeln!(out, "\t\tflags {}", flags.join(","));
    }
    if s.default_timeout_ms > 0 {
        let _ = writeln!(out, "\t\ttimeout {}", duration(s.default_timeout_ms));
    }
    if !s.comment.is_empty() {
        let _ = writeln!(out, "\t\tcomment {}", quoted(&s.comment));
    }
    if !s.elements.is_empty() {
        let _ = writeln!(out, "\t\telements = {}", elements(s));
    }
    out.push_str("\t}\n");
    out
}

/// One rule on one line, rendered without table context: see [`rule_in`].
pub fn rule(r: &Rule) -> String {
    rule_in(&Context::empty(), r)
}

/// One rule on one line, rendered against `ctx`.
pub fn rule_in(ctx: &Context<'_>, r: &Rule) -> String {
    let mut d = Decompiler::new(ctx);
    for e in &r.exprs {
        d.expr(e);
    }
    let mut out = d.out.join(" ");
    if !r.comment.is_empty() {
        if !out.is_empty() {
            out.push(' ');
        }
        let _ = write!(out, "comment {}", quoted(&r.comment));
    }
    out
}

/// One element of `set` as it appears in its `elements = { ... }` list, without a delimiter:
/// `10.96.0.10 . tcp . 53 comment "ns/svc:dns" : goto endpoints-2`.
pub fn element(set: &Set, e: &Element) -> String {
    let mut out = String::new();
    if e.key.is_empty() {
        out.push_str("<empty>");
    }
    for (i, k) in e.key.iter().enumerate() {
        if i > 0 {
            out.push_str(" . ");
        }
        let ty = set.key.get(i).copied();
        match e.key_end.get(i) {
            Some(end) if end != k => out.push_str(&interval(k, end, ty)),
            _ => out.push_str(&datum_text(k, ty)),
        }
    }
    if e.timeout_ms > 0 {
        let _ = write!(out, " timeout {}", duration(e.timeout_ms));
    }
    if !e.comment.is_empty() {
        let _ = write!(out, " comment {}", quoted(&e.comment));
    }
    if let Some(v) = &e.verdict {
        let _ = write!(out, " : {}", verdict(v));
    } else if !e.data.is_empty() {
        let data: Vec<String> = e
            .data
            .iter()
            .enumerate()
            .map(|(i, d)| datum_text(d, set.data.get(i).copied()))
            .collect();
        let _ = write!(out, " : {}", data.join(" . "));
    }
    out
}

// ---- objects ----

fn chain_type_name(t: i32) -> &'static str {
    match ChainType::try_from(t) {
        Ok(ChainType::Filter) => "filter",
        Ok(ChainType::Nat) => "nat",
        Ok(ChainType::Route) => "route",
        _ => "unknown",
    }
}

fn hook_name(h: i32) -> &'static str {
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
fn priority_name(hook: i32, prio: i32) -> String {
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

fn type_name(t: i32) -> String {
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

fn type_names(types: &[i32]) -> String {
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
fn elements(s: &Set) -> String {
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

fn datum_text(d: &v1::Datum, ty: Option<i32>) -> String {
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
fn interval(start: &v1::Datum, end: &v1::Datum, ty: Option<i32>) -> String {
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
fn range_prefix(start: u128, end: u128, bits: u32) -> Option<u32> {
    let host = start ^ end;
    if start > end || host & host.wrapping_add(1) != 0 || start & host != 0 {
        return None;
    }
    Some(bits - (128 - host.leading_zeros()))
}

fn verdict(v: &Verdict) -> String {
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
fn duration(ms: u64) -> String {
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

fn quoted(s: &str) -> String {
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

// ---- values ----

/// The nft datatype of what a register holds, which decides how constants print.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Ipv4,
    Ipv6,
    L4Proto,
    /// Transport port, network byte order.
    Port,
    /// Packet or conntrack mark, host byte order, printed 0x%08x.
    Mark,
    /// Integer in host byte order (meta length, numgen, set integers).
    Int,
    /// Integer in network byte order, printed in decimal (`ip ttl`).
    IntBe,
    /// Raw header bits (`@nh,...`), printed in hex as nft does.
    RawBe,
    CtState,
    CtStatus,
    FibAddrType,
    IfIndex,
    IfName,
    EtherType,
    NfProto,
    PktType,
    Bool,
    /// Unknown: the bytes in hex.
    Raw,
}

impl Kind {
    fn of_data_type(t: i32) -> Kind {
        match DataType::try_from(t) {
            Ok(DataType::Integer) => Kind::Int,
            Ok(DataType::Ipv4Addr) => Kind::Ipv4,
            Ok(DataType::Ipv6Addr) => Kind::Ipv6,
            Ok(DataType::InetProto) => Kind::L4Proto,
            Ok(DataType::InetService) => Kind::Port,
            Ok(DataType::Mark) => Kind::Mark,
            _ => Kind::Raw,
        }
    }

    fn is_bitmask(self) -> bool {
        matches!(self, Kind::CtState | Kind::CtStatus)
    }
}

/// Registers a field of a set key or data takes: each field of a concatenation is padded to
/// whole registers.
fn data_type_regs(t: i32) -> usize {
    match DataType::try_from(t) {
        Ok(DataType::Ipv6Addr) => 4,
        _ => 1,
    }
}

fn regs_for_len(len: usize) -> usize {
    len.div_ceil(4).clamp(1, NREGS)
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::from("0x");
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// The bytes past `n` are padding (zero), as when a short value sits in a register.
fn padded(bytes: &[u8], n: usize) -> Option<&[u8]> {
    if bytes.len() >= n && bytes[n..].iter().all(|&b| b == 0) {
        Some(&bytes[..n])
    } else {
        None
    }
}

fn host_uint(bytes: &[u8]) -> Option<u64> {
    Some(match bytes.len() {
        1 => u64::from(bytes[0]),
        2 => u64::from(u16::from_ne_bytes([bytes[0], bytes[1]])),
        4 => u64::from(u32::from_ne_bytes(bytes.try_into().ok()?)),
        8 => u64::from_ne_bytes(bytes.try_into().ok()?),
        _ => return None,
    })
}

fn host_u32(bytes: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(bytes.try_into().ok()?))
}

/// The protocol name nft prints (from /etc/protocols) for the common protocols.
fn proto_name(p: u8) -> String {
    let name = match p {
        1 => "icmp",
        2 => "igmp",
        4 => "ipencap",
        6 => "tcp",
        17 => "udp",
        33 => "dccp",
        41 => "ipv6",
        47 => "gre",
        50 => "esp",
        51 => "ah",
        58 => "ipv6-icmp",
        89 => "ospf",
        94 => "ipip",
        103 => "pim",
        112 => "vrrp",
        115 => "l2tp",
        132 => "sctp",
        136 => "udplite",
        p => return p.to_string(),
    };
    name.to_string()
}

fn flag_names(v: u32, names: &[(u32, &str)]) -> String {
    let mut parts = Vec::new();
    let mut rest = v;
    for &(bit, name) in names {
        if v & bit != 0 {
            parts.push(name.to_string());
            rest &= !bit;
        }
    }
    if rest != 0 || parts.is_empty() {
        parts.push(format!("0x{rest:x}"));
    }
    parts.join(",")
}

const CT_STATE_BITS: [(u32, &str); 5] = [
    (1, "invalid"),
    (2, "established"),
    (4, "related"),
    (8, "new"),
    (64, "untracked"),
];

const CT_STATUS_BITS: [(u32, &str); 7] = [
    (0x1, "expected"),
    (0x2, "seen-reply"),
    (0x4, "assured"),
    (0x8, "confirmed"),
    (0x10, "snat"),
    (0x20, "dnat"),
    (0x200, "dying"),
];

/// Formats register bytes as a value of `kind`; bytes that do not fit the kind print in hex.
fn format_bytes(kind: Kind, bytes: &[u8]) -> String {
    let formatted = match kind {
        Kind::Ipv4 => <[u8; 4]>::try_from(bytes)
            .ok()
            .map(|a| Ipv4Addr::from(a).to_string()),
        Kind::Ipv6 => <[u8; 16]>::try_from(bytes)
            .ok()
            .map(|a| Ipv6Addr::from(a).to_string()),
        Kind::L4Proto => padded(bytes, 1).map(|b| proto_name(b[0])),
        Kind::Port => padded(bytes, 2).map(|b| u16::from_be_bytes([b[0], b[1]]).to_string()),
        Kind::Mark => host_u32(bytes).map(|v| format!("0x{v:08x}")),
        Kind::Int | Kind::IfIndex => host_uint(bytes).map(|v| v.to_string()),
        Kind::IntBe if !bytes.is_empty() && bytes.len() <= 8 => Some(
            bytes
                .iter()
                .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
                .to_string(),
        ),
        Kind::RawBe if !bytes.is_empty() && bytes.len() <= 8 => Some(format!(
            "0x{:x}",
            bytes.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
        )),
        Kind::CtState => host_u32(bytes).map(|v| flag_names(v, &CT_STATE_BITS)),
        Kind::CtStatus => host_u32(bytes).map(|v| flag_names(v, &CT_STATUS_BITS)),
        Kind::FibAddrType => host_u32(bytes).map(|v| {
            const TYPES: [&str; 9] = [
                "unspec",
                "unicast",
                "local",
                "broadcast",
                "anycast",
                "multicast",
                "blackhole",
                "unreachable",
                "prohibit",
            ];
            usize::try_from(v)
                .ok()
                .and_then(|i| TYPES.get(i))
                .map_or_else(|| v.to_string(), |s| (*s).to_string())
        }),
        Kind::IfName => {
            let end = bytes.iter().position(|&b| b == 0);
            let name = String::from_utf8_lossy(&bytes[..end.unwrap_or(bytes.len())]);
            // A name compared without its terminating NUL is a prefix match.
            let wildcard = if end.is_none() && bytes.len() < 16 {
                "*"
            } else {
                ""
            };
            Some(quoted(&format!("{name}{wildcard}")))
        }
        Kind::EtherType => padded(bytes, 2).map(|b| match u16::from_be_bytes([b[0], b[1]]) {
            0x0800 => "ip".into(),
            0x86dd => "ip6".into(),
            0x0806 => "arp".into(),
            0x8100 => "8021q".into(),
            v => format!("0x{v:04x}"),
        }),
        Kind::NfProto => padded(bytes, 1).map(|b| match b[0] {
            2 => "ipv4".into(),
            10 => "ipv6".into(),
            v => v.to_string(),
        }),
        Kind::PktType => padded(bytes, 1).map(|b| match b[0] {
            0 => "host".into(),
            1 => "broadcast".into(),
            2 => "multicast".into(),
            3 => "other".into(),
            v => v.to_string(),
        }),
        Kind::Bool => Some(
            if bytes.iter().any(|&b| b != 0) {
                "exists"
            } else {
                "missing"
            }
            .into(),
        ),
        Kind::IntBe | Kind::RawBe | Kind::Raw => None,
    };
    formatted.unwrap_or_else(|| hex(bytes))
}

/// Formats the bytes of a concatenation: one field per kind, each padded to whole registers.
fn format_fields(kinds: &[Kind], widths: &[usize], bytes: &[u8]) -> String {
    if kinds.len() <= 1 {
        return format_bytes(kinds.first().copied().unwrap_or(Kind::Raw), bytes);
    }
    let mut parts = Vec::new();
    let mut at = 0usize;
    for (i, &k) in kinds.iter().enumerate() {
        if at >= bytes.len() {
            break;
        }
        let w = widths.get(i).copied().unwrap_or(1) * 4;
        let end = if i + 1 == kinds.len() {
            bytes.len()
        } else {
            (at + w).min(bytes.len())
        };
        let field = &bytes[at..end];
        // A field shorter than its registers (an address in a 4-byte slot is exact; a port or
        // protocol is padded) prints through `format_bytes`, which accepts the padding.
        parts.push(format_bytes(k, field));
        at = end;
    }
    if at < bytes.len() {
        parts.push(hex(&bytes[at..]));
    }
    parts.join(" . ")
}

/// The prefix length of a netmask (leading ones, then zeros).
fn mask_prefix(mask: &[u8]) -> Option<u32> {
    let mut len = 0u32;
    let mut ended = false;
    for &b in mask {
        if ended {
            if b != 0 {
                return None;
            }
            continue;
        }
        let ones = b.leading_ones();
        if b != (0xffu8.checked_shl(8 - ones).unwrap_or(0)) {
            return None;
        }
        len += ones;
        ended = ones < 8;
    }
    Some(len)
}

/// What a `ct` load prints as (`ct state`, `ct original ip daddr`, `ct reply proto-src`), the
/// type of its value and the registers it takes. A tuple field prints its direction; a key the
/// renderer does not know prints as `ct key N`. `ct protocol` prints without one whatever the
/// IR says: the l4 protocol is the same in both tuples, the kernel accepts a direction for it
/// but keeps none, and nft lists `ct original protocol` back as `ct protocol`.
fn ct_info(c: &v1::Ct) -> (String, Kind, usize) {
    let (field, kind, width) = match CtKey::try_from(c.key) {
        Ok(CtKey::State) => ("state", Kind::CtState, 1),
        Ok(CtKey::Status) => ("status", Kind::CtStatus, 1),
        Ok(CtKey::Mark) => ("mark", Kind::Mark, 1),
        Ok(CtKey::SrcIp) => ("ip saddr", Kind::Ipv4, 1),
        Ok(CtKey::DstIp) => ("ip daddr", Kind::Ipv4, 1),
        Ok(CtKey::SrcIp6) => ("ip6 saddr", Kind::Ipv6, 4),
        Ok(CtKey::DstIp6) => ("ip6 daddr", Kind::Ipv6, 4),
        Ok(CtKey::ProtoSrc) => ("proto-src", Kind::Port, 1),
        Ok(CtKey::ProtoDst) => ("proto-dst", Kind::Port, 1),
        Ok(CtKey::Protocol) => ("protocol", Kind::L4Proto, 1),
        Ok(CtKey::Unspecified) | Err(_) => return (format!("ct key {}", c.key), Kind::Raw, 1),
    };
    let dir = match CtDirection::try_from(c.direction) {
        _ if c.key == CtKey::Protocol as i32 => String::new(),
        Ok(CtDirection::Unspecified) => String::new(),
        Ok(CtDirection::Original) => "original ".into(),
        Ok(CtDirection::Reply) => "reply ".into(),
        Err(_) => format!("direction {} ", c.direction),
    };
    (format!("ct {dir}{field}"), kind, width)
}

// ---- the register model ----

/// What a data-map lookup put in a register.
#[derive(Clone, Debug)]
enum MapResult {
    /// The data types of the map, from its definition.
    Known(Vec<i32>),
    /// The map is not known to the renderer.
    Unknown,
}

#[derive(Clone, Debug)]
struct Val {
    /// The nft expression the register holds.
    text: String,
    /// The type of each field (one unless a concatenation, such as a map's data).
    kinds: Vec<Kind>,
    /// Registers of each field.
    widths: Vec<usize>,
    /// Registers taken in all.
    width: usize,
    /// The bytes of an immediate.
    konst: Option<Vec<u8>>,
    /// `base & mask` (no xor): kept apart for the prefix and flag forms of a following cmp.
    masked: Option<(String, Vec<u8>)>,
    /// The text is a binary operation (nft then prints `==`).
    binop: bool,
    map: Option<MapResult>,
    /// Load order, to guess concatenations without set definitions.
    seq: u64,
    /// Read by some statement already.
    used: bool,
}

impl Val {
    fn new(text: String, kind: Kind, width: usize) -> Val {
        Val {
            text,
            kinds: vec![kind],
            widths: vec![width],
            width,
            konst: None,
            masked: None,
            binop: false,
            map: None,
            seq: 0,
            used: false,
        }
    }

    fn kind(&self) -> Kind {
        if self.kinds.len() == 1 {
            self.kinds[0]
        } else {
            Kind::Raw
        }
    }

    /// The value as an operand of type `kind`: constants formatted by the type of their use.
    fn as_kind(&self, kind: Kind) -> String {
        match &self.konst {
            Some(bytes) => format_bytes(kind, bytes),
            None => self.text.clone(),
        }
    }
}

#[derive(Clone, Debug)]
enum Slot {
    Empty,
    Head(Val),
    /// Part of the multi-register value that starts at the given register.
    Cont(usize),
}

struct Decompiler<'c, 'a> {
    ctx: &'c Context<'a>,
    regs: Vec<Slot>,
    seq: u64,
    out: Vec<String>,
}

fn reg_index(reg: u32) -> Option<usize> {
    usize::try_from(reg).ok().filter(|&r| r < NREGS)
}

impl<'c, 'a> Decompiler<'c, 'a> {
    fn new(ctx: &'c Context<'a>) -> Self {
        Self {
            ctx,
            regs: vec![Slot::Empty; NREGS],
            seq: 0,
            out: Vec::new(),
        }
    }

    /// Stores `val` at `reg` and the registers it spans; values it overwrites in part are
    /// forgotten.
    fn write(&mut self, reg: u32, mut val: Val) {
        let Some(r) = reg_index(reg) else { return };
        self.seq += 1;
        val.seq = self.seq;
        let end = (r + val.width.max(1)).min(NREGS);
        for i in r..end {
            self.clobber(i, r, end);
        }
        for i in r + 1..end {
            self.regs[i] = Slot::Cont(r);
        }
        self.regs[r] = Slot::Head(val);
    }

    /// Forgets whatever held register `i` beyond the range `[from, to)` being written.
    fn clobber(&mut self, i: usize, from: usize, to: usize) {
        match std::mem::replace(&mut self.regs[i], Slot::Empty) {
            Slot::Cont(h) if h < from => self.regs[h] = Slot::Empty,
            Slot::Head(v) => {
                for j in i + 1..(i + v.width).min(NREGS) {
                    if j >= to && matches!(self.regs[j], Slot::Cont(h) if h == i) {
                        self.regs[j] = Slot::Empty;
                    }
                }
            }
            _ => {}
        }
    }

    fn head(&self, reg: u32) -> Option<&Val> {
        match reg_index(reg).map(|r| &self.regs[r]) {
            Some(Slot::Head(v)) => Some(v),
            _ => None,
        }
    }

    fn mark_used(&mut self, reg: u32) {
        if let Some(Slot::Head(v)) = reg_index(reg).map(|r| &mut self.regs[r]) {
            v.used = true;
        }
    }

    /// The register as an operand of type `kind`, or `reg N`.
    fn operand(&mut self, reg: u32, kind: Kind) -> String {
        self.mark_used(reg);
        match self.head(reg) {
            Some(v) => v.as_kind(kind),
            None => format!("reg {reg}"),
        }
    }

    /// The concatenation that starts at `sreg`: as many fields as `fields` (a set's key or data
    /// types) when known, else the run of registers loaded one after the other.
    fn concat(&mut self, sreg: u32, fields: Option<&[i32]>) -> String {
        let mut parts = Vec::new();
        let mut used = Vec::new();
        match fields {
            Some(fields) if !fields.is_empty() => {
                let mut pos = usize::try_from(sreg).unwrap_or(usize::MAX);
                let mut i = 0;
                while i < fields.len() {
                    let head = match self.regs.get(pos) {
                        Some(Slot::Head(v)) => Some(v),
                        _ => None,
                    };
                    let Some(v) = head else {
                        parts.push(format!("reg {pos}"));
                        pos = pos.saturating_add(data_type_regs(fields[i]));
                        i += 1;
                        continue;
                    };
                    // One value may cover several fields (a map's concatenated data).
                    let mut covered = 0;
                    let mut n = 0;
                    while i + n < fields.len() {
                        let w = data_type_regs(fields[i + n]);
                        if n > 0 && covered + w > v.width {
                            break;
                        }
                        covered += w;
                        n += 1;
                    }
                    let field_fields = &fields[i..i + n];
                    let text = match &v.konst {
                        Some(bytes) => {
                            let kinds: Vec<Kind> = field_fields
                                .iter()
                                .map(|&t| Kind::of_data_type(t))
                                .collect();
                            let widths: Vec<usize> =
                                field_fields.iter().map(|&t| data_type_regs(t)).collect();
                            format_fields(&kinds, &widths, bytes)
                        }
                        None => v.text.clone(),
                    };
                    parts.push(text);
                    used.push(pos);
                    pos = pos.saturating_add(covered);
                    i += n;
                }
            }
            _ => {
                let mut pos = usize::try_from(sreg).unwrap_or(usize::MAX);
                let mut last_seq = 0;
                while let Some(Slot::Head(v)) = self.regs.get(pos) {
                    if !parts.is_empty() && (v.used || v.seq <= last_seq) {
                        break;
                    }
                    parts.push(v.text.clone());
                    used.push(pos);
                    last_seq = v.seq;
                    pos += v.width.max(1);
                }
                if parts.is_empty() {
                    parts.push(format!("reg {sreg}"));
                }
            }
        }
        for r in used {
            if let Some(Slot::Head(v)) = self.regs.get_mut(r) {
                v.used = true;
            }
        }
        parts.join(" . ")
    }

    fn expr(&mut self, e: &v1::Expr) {
        let Some(kind) = &e.kind else {
            self.out.push("unknown".into());
            return;
        };
        match kind {
            expr::Kind::Payload(p) => {
                let (text, kind) = payload_name(self.ctx.family(), p.base, p.offset, p.len);
                let width = regs_for_len(usize::try_from(p.len).unwrap_or(usize::MAX));
                self.write(p.dreg, Val::new(text, kind, width));
            }
            expr::Kind::Meta(m) => {
                let (name, kind, len) = meta_info(m.key);
                if m.set {
                    let value = self.operand(m.sreg, kind);
                    self.out.push(format!("{name} set {value}"));
                } else {
                    self.write(m.dreg, Val::new(name, kind, regs_for_len(len)));
                }
            }
            expr::Kind::Ct(c) => {
                let (name, kind, width) = ct_info(c);
                self.write(c.dreg, Val::new(name, kind, width));
            }
            expr::Kind::Fib(f) => {
                let (text, kind, len) = fib_info(f.flags, f.result);
                self.write(f.dreg, Val::new(text, kind, regs_for_len(len)));
            }
            expr::Kind::Cmp(c) => self.cmp(c),
            expr::Kind::Bitwise(b) => self.bitwise(b),
            expr::Kind::Lookup(l) => self.lookup(l),
            expr::Kind::Numgen(n) => {
                let ty = match NumgenType::try_from(n.r#type) {
                    Ok(NumgenType::Incremental) => "inc".to_string(),
                    Ok(NumgenType::Random) => "random".to_string(),
                    Err(_) => format!("type {}", n.r#type),
                };
                let mut text = format!("numgen {ty} mod {}", n.modulus);
                if n.offset != 0 {
                    let _ = write!(text, " offset {}", n.offset);
                }
                self.write(n.dreg, Val::new(text, Kind::Int, 1));
            }
            expr::Kind::Nat(n) => self.nat(n),
            expr::Kind::Masquerade(m) => {
                self.out.push(format!("masquerade{}", nat_flags(m.flags)));
            }
            expr::Kind::Reject(r) => self.out.push(self.reject(r)),
            expr::Kind::Dynset(d) => self.dynset(d),
            expr::Kind::Counter(_) => self.out.push("counter".into()),
            expr::Kind::Verdict(v) => self.out.push(verdict(v)),
            expr::Kind::Immediate(i) => {
                let width = regs_for_len(i.data.len());
                let mut val = Val::new(hex(&i.data), Kind::Raw, width);
                val.konst = Some(i.data.clone());
                self.write(i.dreg, val);
            }
        }
    }

    fn cmp(&mut self, c: &v1::Cmp) {
        let op = CmpOp::try_from(c.op).ok();
        let op_text = match op {
            Some(CmpOp::Eq) => "==".to_string(),
            Some(CmpOp::Neq) => "!=".to_string(),
            Some(CmpOp::Lt) => "<".to_string(),
            Some(CmpOp::Lte) => "<=".to_string(),
            Some(CmpOp::Gt) => ">".to_string(),
            Some(CmpOp::Gte) => ">=".to_string(),
            None => format!("op{}", c.op),
        };
        self.mark_used(c.sreg);
        let Some(v) = self.head(c.sreg).cloned() else {
            self.out
                .push(format!("reg {} {op_text} {}", c.sreg, hex(&c.data)));
            return;
        };
        let kind = v.kind();
        let eq_or_neq = matches!(op, Some(CmpOp::Eq | CmpOp::Neq));
        let neq = if op == Some(CmpOp::Neq) { "!= " } else { "" };
        if let (Some((base, mask)), true) = (&v.masked, eq_or_neq) {
            // `ip daddr & 255.255.0.0 == 10.96.0.0` is nft's `ip daddr 10.96.0.0/16`.
            if matches!(kind, Kind::Ipv4 | Kind::Ipv6)
                && mask.len() == c.data.len()
                && c.data.iter().zip(mask).all(|(d, m)| d & !m == 0)
                && let Some(len) = mask_prefix(mask)
            {
                let addr = format_bytes(kind, &c.data);
                self.out.push(format!("{base} {neq}{addr}/{len}"));
                return;
            }
            // `ct state & new != 0` is nft's `ct state new`; `== 0` is `ct state ! new`.
            if kind.is_bitmask() && c.data.iter().all(|&b| b == 0) {
                let flags = format_bytes(kind, mask);
                let bang = if op == Some(CmpOp::Eq) { "! " } else { "" };
                self.out.push(format!("{base} {bang}{flags}"));
                return;
            }
        }
        let value = format_fields(&v.kinds, &v.widths, &c.data);
        let lhs = v.as_kind(kind);
        // nft leaves `==` out unless the left side is a binary operation or the value a
        // bitmask (where the implicit form means "any of these bits").
        let text = if op == Some(CmpOp::Eq) && !v.binop && !kind.is_bitmask() {
            format!("{lhs} {value}")
        } else {
            format!("{lhs} {op_text} {value}")
        };
        self.out.push(text);
    }

    fn bitwise(&mut self, b: &v1::Bitwise) {
        self.mark_used(b.sreg);
        let (base, kind) = match self.head(b.sreg) {
            Some(v) => (v.as_kind(v.kind()), v.kind()),
            None => (format!("reg {}", b.sreg), Kind::Raw),
        };
        let len = b.mask.len().max(b.xor.len());
        let all_ones = |x: &[u8]| x.len() == len && x.iter().all(|&v| v == 0xff);
        let zero = |x: &[u8]| x.iter().all(|&v| v == 0);
        let disjoint =
            b.mask.len() == b.xor.len() && b.mask.iter().zip(&b.xor).all(|(m, x)| m & x == 0);
        let mask = format_bytes(kind, &b.mask);
        let xor = format_bytes(kind, &b.xor);
        let (text, masked) = if zero(&b.xor) {
            (
                format!("{base} & {mask}"),
                Some((base.clone(), b.mask.clone())),
            )
        } else if all_ones(&b.mask) {
            (format!("{base} ^ {xor}"), None)
        } else if disjoint {
            // `(x & m) ^ v` with no bit of v in m is `x & (m | v) | v`, which nft prints
            // without the mask when it keeps every bit: `meta mark | 0x00004000`.
            let kept: Vec<u8> = b.mask.iter().zip(&b.xor).map(|(m, x)| m | x).collect();
            if all_ones(&kept) {
                (format!("{base} | {xor}"), None)
            } else {
                (
                    format!("{base} & {} | {xor}", format_bytes(kind, &kept)),
                    None,
                )
            }
        } else {
            (format!("{base} & {mask} ^ {xor}"), None)
        };
        let mut val = Val::new(text, kind, regs_for_len(len));
        val.masked = masked;
        val.binop = true;
        self.write(b.dreg, val);
    }

    fn lookup(&mut self, l: &v1::Lookup) {
        let set = self.ctx.sets.get(l.set.as_str()).copied();
        let key = self.concat(l.sreg, set.map(|s| s.key.as_slice()));
        if l.verdict {
            self.out.push(format!("{key} vmap @{}", l.set));
        } else if l.has_dreg {
            let text = format!("{key} map @{}", l.set);
            let val = match set {
                Some(s) if !s.data.is_empty() => {
                    let widths: Vec<usize> = s.data.iter().map(|&t| data_type_regs(t)).collect();
                    Val {
                        kinds: s.data.iter().map(|&t| Kind::of_data_type(t)).collect(),
                        width: widths.iter().sum::<usize>().min(NREGS),
                        widths,
                        map: Some(MapResult::Known(s.data.clone())),
                        ..Val::new(text, Kind::Raw, 1)
                    }
                }
                _ => Val {
                    map: Some(MapResult::Unknown),
                    ..Val::new(text, Kind::Raw, 1)
                },
            };
            self.write(l.dreg, val);
        } else if l.invert {
            self.out.push(format!("{key} != @{}", l.set));
        } else {
            self.out.push(format!("{key} @{}", l.set));
        }
    }

    fn nat(&mut self, n: &v1::Nat) {
        let mut text = match NatType::try_from(n.r#type) {
            Ok(NatType::Snat) => "snat".to_string(),
            Ok(NatType::Dnat) => "dnat".to_string(),
            _ => format!("nat type {}", n.r#type),
        };
        let nat_family = Family::try_from(n.family).ok();
        let addr_kind = match nat_family {
            Some(Family::Ip6) => Kind::Ipv6,
            Some(Family::Ip) => Kind::Ipv4,
            _ => Kind::Raw,
        };
        // One map lookup that yields `address . port` feeds both registers: the port is the
        // register right after the address.
        let port_reg = |addr_regs: usize| {
            u32::try_from(addr_regs)
                .ok()
                .and_then(|w| n.reg_addr.checked_add(w))
                == Some(n.reg_proto)
        };
        let concat_map = n.has_addr
            && match self.head(n.reg_addr) {
                Some(Val {
                    map: Some(MapResult::Known(data)),
                    ..
                }) => {
                    data.len() == 2
                        && (!n.has_proto
                            || (port_reg(data_type_regs(data[0]))
                                && matches!(
                                    reg_index(n.reg_proto).map(|r| &self.regs[r]),
                                    Some(Slot::Cont(h)) if Some(*h) == reg_index(n.reg_addr)
                                )))
                }
                Some(Val {
                    map: Some(MapResult::Unknown),
                    seq,
                    ..
                }) => {
                    n.has_proto
                        && port_reg(if addr_kind == Kind::Ipv6 { 4 } else { 1 })
                        && match self.head(n.reg_proto) {
                            Some(p) => p.seq < *seq,
                            None => true,
                        }
                }
                _ => false,
            };
        let in_typed_table = matches!(self.ctx.family(), Some(Family::Ip | Family::Ip6));
        if (n.has_addr || n.has_proto) && (concat_map || !in_typed_table) {
            match nat_family {
                Some(Family::Ip) => text.push_str(" ip"),
                Some(Family::Ip6) => text.push_str(" ip6"),
                _ => {}
            }
        }
        if n.has_addr || n.has_proto {
            text.push_str(" to");
        }
        if concat_map {
            self.mark_used(n.reg_addr);
            let _ = write!(
                text,
                " {}",
                self.head(n.reg_addr).map_or("", |v| v.text.as_str())
            );
        } else {
            if n.has_addr {
                self.mark_used(n.reg_addr);
                let addr = match self.head(n.reg_addr) {
                    Some(v) => match &v.konst {
                        Some(bytes) => {
                            let kind = match (addr_kind, bytes.len()) {
                                (Kind::Raw, 4) => Kind::Ipv4,
                                (Kind::Raw, 16) => Kind::Ipv6,
                                (k, _) => k,
                            };
                            let a = format_bytes(kind, bytes);
                            if n.has_proto && kind == Kind::Ipv6 && bytes.len() == 16 {
                                format!("[{a}]")
                            } else {
                                a
                            }
                        }
                        None => v.text.clone(),
                    },
                    None => format!("reg {}", n.reg_addr),
                };
                let _ = write!(text, " {addr}");
            }
            if n.has_proto {
                if !n.has_addr {
                    text.push(' ');
                }
                let port = self.operand(n.reg_proto, Kind::Port);
                let _ = write!(text, ":{port}");
            }
        }
        text.push_str(&nat_flags(n.flags));
        self.out.push(text);
    }

    fn reject(&self, r: &v1::Reject) -> String {
        match RejectType::try_from(r.r#type) {
            Ok(RejectType::TcpRst) => "reject with tcp reset".into(),
            Ok(RejectType::IcmpxUnreach) => match r.code {
                1 => "reject".into(),
                0 => "reject with icmpx no-route".into(),
                2 => "reject with icmpx host-unreachable".into(),
                3 => "reject with icmpx admin-prohibited".into(),
                c => format!("reject with icmpx {c}"),
            },
            Ok(RejectType::IcmpUnreach) => match self.ctx.family() {
                Some(Family::Ip6) => match r.code {
                    4 => "reject".into(),
                    c => format!("reject with icmpv6 {}", icmpv6_code(c)),
                },
                Some(Family::Ip) if r.code == 3 => "reject".into(),
                _ => format!("reject with icmp {}", icmp_code(r.code)),
            },
            Err(_) => format!("reject type {} code {}", r.r#type, r.code),
        }
    }

    fn dynset(&mut self, d: &v1::Dynset) {
        let set = self.ctx.sets.get(d.set.as_str()).copied();
        let op = match DynsetOp::try_from(d.op) {
            Ok(DynsetOp::Add) => "add".to_string(),
            Ok(DynsetOp::Update) => "update".to_string(),
            Ok(DynsetOp::Delete) => "delete".to_string(),
            Err(_) => format!("op{}", d.op),
        };
        let key = self.concat(d.sreg_key, set.map(|s| s.key.as_slice()));
        let mut text = format!("{op} @{} {{ {key}", d.set);
        if d.timeout_ms > 0 {
            let _ = write!(text, " timeout {}", duration(d.timeout_ms));
        }
        if d.has_data {
            let data = self.concat(d.sreg_data, set.map(|s| s.data.as_slice()));
            let _ = write!(text, " : {data}");
        }
        text.push_str(" }");
        self.out.push(text);
    }
}

fn icmp_code(code: u32) -> String {
    match code {
        0 => "net-unreachable".into(),
        1 => "host-unreachable".into(),
        2 => "prot-unreachable".into(),
        3 => "port-unreachable".into(),
        4 => "frag-needed".into(),
        9 => "net-prohibited".into(),
        10 => "host-prohibited".into(),
        13 => "admin-prohibited".into(),
        c => c.to_string(),
    }
}

fn icmpv6_code(code: u32) -> String {
    match code {
        0 => "no-route".into(),
        1 => "admin-prohibited".into(),
        3 => "addr-unreachable".into(),
        4 => "port-unreachable".into(),
        5 => "policy-fail".into(),
        6 => "reject-route".into(),
        c => c.to_string(),
    }
}

/// ` random,fully-random,persistent` as nft prints NAT flags; the bits the encoder derives
/// (map-ips, proto-specified) are left out, unknown bits print in hex.
fn nat_flags(flags: u32) -> String {
    let mut parts = Vec::new();
    if flags & NAT_RANGE_PROTO_RANDOM != 0 {
        parts.push("random".to_string());
    }
    if flags & NAT_RANGE_PROTO_RANDOM_FULLY != 0 {
        parts.push("fully-random".to_string());
    }
    if flags & NAT_RANGE_PERSISTENT != 0 {
        parts.push("persistent".to_string());
    }
    let known = NAT_RANGE_MAP_IPS
        | NAT_RANGE_PROTO_SPECIFIED
        | NAT_RANGE_PROTO_RANDOM
        | NAT_RANGE_PROTO_RANDOM_FULLY
        | NAT_RANGE_PERSISTENT;
    if flags & !known != 0 {
        parts.push(format!("0x{:x}", flags & !known));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" {}", parts.join(","))
    }
}

/// The nft name and type of a header field, `@nh,OFFSET,LEN` (in bits) when it has none.
fn payload_name(family: Option<Family>, base: i32, offset: u32, len: u32) -> (String, Kind) {
    let ip4 = !matches!(family, Some(Family::Ip6));
    let ip6 = !matches!(family, Some(Family::Ip));
    let named = match PayloadBase::try_from(base) {
        Ok(PayloadBase::Network) => match (offset, len) {
            (12, 4) if ip4 => Some(("ip saddr", Kind::Ipv4)),
            (16, 4) if ip4 => Some(("ip daddr", Kind::Ipv4)),
            (9, 1) if ip4 => Some(("ip protocol", Kind::L4Proto)),
            (8, 1) if ip4 => Some(("ip ttl", Kind::IntBe)),
            (2, 2) if ip4 => Some(("ip length", Kind::IntBe)),
            (4, 2) if ip4 => Some(("ip id", Kind::IntBe)),
            (8, 16) if ip6 => Some(("ip6 saddr", Kind::Ipv6)),
            (24, 16) if ip6 => Some(("ip6 daddr", Kind::Ipv6)),
            (6, 1) if ip6 => Some(("ip6 nexthdr", Kind::L4Proto)),
            (7, 1) if ip6 => Some(("ip6 hoplimit", Kind::IntBe)),
            (4, 2) if ip6 => Some(("ip6 length", Kind::IntBe)),
            _ => None,
        },
        Ok(PayloadBase::Transport) => match (offset, len) {
            (0, 2) => Some(("th sport", Kind::Port)),
            (2, 2) => Some(("th dport", Kind::Port)),
            _ => None,
        },
        _ => None,
    };
    if let Some((name, kind)) = named {
        return (name.to_string(), kind);
    }
    let base = match PayloadBase::try_from(base) {
        Ok(PayloadBase::Link) => "ll".to_string(),
        Ok(PayloadBase::Network) => "nh".to_string(),
        Ok(PayloadBase::Transport) => "th".to_string(),
        _ => format!("base{base}"),
    };
    (
        format!("@{base},{},{}", u64::from(offset) * 8, u64::from(len) * 8),
        Kind::RawBe,
    )
}

/// The nft name, value type and length in bytes of a meta key.
fn meta_info(key: i32) -> (String, Kind, usize) {
    let (name, kind, len) = match MetaKey::try_from(key) {
        Ok(MetaKey::Len) => ("meta length", Kind::Int, 4),
        Ok(MetaKey::Protocol) => ("meta protocol", Kind::EtherType, 2),
        Ok(MetaKey::Mark) => ("meta mark", Kind::Mark, 4),
        Ok(MetaKey::Iif) => ("iif", Kind::IfIndex, 4),
        Ok(MetaKey::Oif) => ("oif", Kind::IfIndex, 4),
        Ok(MetaKey::Iifname) => ("iifname", Kind::IfName, 16),
        Ok(MetaKey::Oifname) => ("oifname", Kind::IfName, 16),
        Ok(MetaKey::Nfproto) => ("meta nfproto", Kind::NfProto, 1),
        Ok(MetaKey::L4proto) => ("meta l4proto", Kind::L4Proto, 1),
        Ok(MetaKey::Pkttype) => ("meta pkttype", Kind::PktType, 1),
        _ => return (format!("meta key {key}"), Kind::Raw, 4),
    };
    (name.to_string(), kind, len)
}

/// `fib saddr . iif type` and the type and length of its result.
fn fib_info(flags: u32, result: i32) -> (String, Kind, usize) {
    const FLAGS: [(u32, &str); 5] = [
        (1, "saddr"),
        (2, "daddr"),
        (4, "mark"),
        (8, "iif"),
        (16, "oif"),
    ];
    let mut parts: Vec<String> = Vec::new();
    let mut rest = flags & !FIB_F_PRESENT;
    for (bit, name) in FLAGS {
        if rest & bit != 0 {
            parts.push(name.to_string());
            rest &= !bit;
        }
    }
    if rest != 0 {
        parts.push(format!("0x{rest:x}"));
    }
    let (res, kind, len) = match FibResult::try_from(result) {
        Ok(FibResult::Oif) => ("oif".to_string(), Kind::IfIndex, 4),
        Ok(FibResult::Oifname) => ("oifname".to_string(), Kind::IfName, 16),
        Ok(FibResult::Addrtype) => ("type".to_string(), Kind::FibAddrType, 4),
        _ => (format!("result {result}"), Kind::Raw, 4),
    };
    let (kind, len) = if flags & FIB_F_PRESENT != 0 {
        (Kind::Bool, 1)
    } else {
        (kind, len)
    };
    let mut text = String::from("fib ");
    if !parts.is_empty() {
        text.push_str(&parts.join(" . "));
        text.push(' ');
    }
    text.push_str(&res);
    (text, kind, len)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn prefixes() {
        assert_eq!(mask_prefix(&[255, 255, 0, 0]), Some(16));
        assert_eq!(mask_prefix(&[255, 255, 255, 255]), Some(32));
        assert_eq!(mask_prefix(&[255, 240, 0, 0]), Some(12));
        assert_eq!(mask_prefix(&[0, 0, 0, 0]), Some(0));
        assert_eq!(mask_prefix(&[255, 0, 255, 0]), None);
        assert_eq!(mask_prefix(&[255, 0b1011_0000, 0, 0]), None);
        assert_eq!(range_prefix(0x0a00_0000, 0x0a00_00ff, 32), Some(24));
        assert_eq!(range_prefix(0x0a00_0001, 0x0a00_0005, 32), None);
        assert_eq!(range_prefix(0, u128::MAX, 128), Some(0));
        assert_eq!(range_prefix(5, 4, 32), None);
    }

    #[test]
    fn bytes_format_by_kind() {
        assert_eq!(format_bytes(Kind::Ipv4, &[10, 96, 0, 10]), "10.96.0.10");
        assert_eq!(format_bytes(Kind::Ipv4, &[10, 96, 0]), "0x0a6000");
        assert_eq!(format_bytes(Kind::Port, &[0, 53]), "53");
        assert_eq!(format_bytes(Kind::Port, &[0, 53, 0, 0]), "53");
        assert_eq!(format_bytes(Kind::L4Proto, &[6]), "tcp");
        assert_eq!(format_bytes(Kind::L4Proto, &[17, 0, 0, 0]), "udp");
        assert_eq!(format_bytes(Kind::L4Proto, &[99]), "99");
        assert_eq!(format_bytes(Kind::L4Proto, &[47]), "gre");
        assert_eq!(format_bytes(Kind::RawBe, &[0, 2]), "0x2");
        assert_eq!(
            format_bytes(Kind::Mark, &0x4000u32.to_ne_bytes()),
            "0x00004000"
        );
        assert_eq!(
            format_bytes(Kind::CtState, &6u32.to_ne_bytes()),
            "established,related"
        );
        assert_eq!(
            format_bytes(Kind::CtState, &0x108u32.to_ne_bytes()),
            "new,0x100"
        );
        assert_eq!(format_bytes(Kind::CtStatus, &0x20u32.to_ne_bytes()), "dnat");
        assert_eq!(
            format_bytes(Kind::FibAddrType, &2u32.to_ne_bytes()),
            "local"
        );
        assert_eq!(format_bytes(Kind::FibAddrType, &77u32.to_ne_bytes()), "77");
        assert_eq!(
            format_bytes(Kind::IfName, b"eth0\0\0\0\0\0\0\0\0\0\0\0\0"),
            "\"eth0\""
        );
        assert_eq!(format_bytes(Kind::IfName, b"veth"), "\"veth*\"");
        assert_eq!(format_bytes(Kind::EtherType, &[0x86, 0xdd]), "ip6");
        assert_eq!(format_bytes(Kind::NfProto, &[10]), "ipv6");
        assert_eq!(format_bytes(Kind::PktType, &[1]), "broadcast");
        assert_eq!(format_bytes(Kind::IntBe, &[0, 64]), "64");
        assert_eq!(format_bytes(Kind::Int, &3u32.to_ne_bytes()), "3");
        assert_eq!(format_bytes(Kind::Raw, &[]), "0x");
        assert_eq!(
            format_fields(
                &[Kind::Ipv4, Kind::Port],
                &[1, 1],
                &[10, 0, 0, 1, 0x1f, 0x90, 0, 0]
            ),
            "10.0.0.1 . 8080"
        );
    }
}
