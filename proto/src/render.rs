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

use crate::v1::{Chain, Element, Family, Rule, Ruleset, Set, Table};

use self::objects::{
    chain_type_name, datum_text, duration, elements, hook_name, interval, priority_name, quoted,
    type_names, verdict,
};
use self::registers::Decompiler;

mod fields;
mod objects;
mod registers;
mod values;

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
