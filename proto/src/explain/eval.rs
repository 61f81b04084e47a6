//! One run of a packet through a node's tables: the hooks it passes, the base chains of each
//! hook in priority order, and every rule's expressions evaluated over registers as the kernel
//! evaluates them (`nft_do_chain`). A run takes its random numbers (numgen) from a list of
//! choices; [`super::explain`] enumerates the lists.
use std::collections::HashMap;
use std::net::IpAddr;

use super::regs::{self, Registers};
use super::{Origin, Packet};
use crate::model::{Model, SetModel, element_key_bytes};
use crate::render;
use crate::v1::{
    self, Chain, ChainType, CmpOp, CtDirection, CtKey, DynsetEffect, DynsetOp, Element, Family,
    FibResult, Hook, MetaKey, NatType, NumgenType, PathStep, PayloadBase, Reject, RejectType,
    VerdictCode, expr::Kind as ExprKind, path_step::Kind,
};

/// Deepest jump stack the kernel allows (NFT_JUMP_STACK_SIZE).
const JUMP_STACK: usize = 16;
/// Rules evaluated in one run before it gives up (a loop the kernel would have refused).
const MAX_RULES: usize = 100_000;

// NFTA_FIB_F_* flags.
const FIB_F_SADDR: u32 = 1;
const FIB_F_IIF: u32 = 8;
// Route types (RTN_*).
const RTN_UNICAST: u32 = 1;
const RTN_LOCAL: u32 = 2;
const RTN_BROADCAST: u32 = 3;
const RTN_MULTICAST: u32 = 5;
// ct state bits.
const CT_STATE_ESTABLISHED: u32 = 2;
const CT_STATE_NEW: u32 = 8;
// ct status bits.
const IPS_SEEN_REPLY: u32 = 0x2;
const IPS_SRC_NAT: u32 = 0x10;
const IPS_DST_NAT: u32 = 0x20;

/// A table as a run reads it: its base chains, regular chains, sets and the set definitions
/// the renderer needs.
pub struct TableView<'a> {
    pub family: Family,
    pub name: &'a str,
    pub chains: HashMap<&'a str, &'a Chain>,
    pub sets: &'a imbl::OrdMap<String, SetModel>,
    pub defs: Vec<v1::Set>,
}

impl<'a> TableView<'a> {
    /// The tables of `model` that see packets of `family` (its own and `inet`).
    pub fn of(model: &'a Model, family: Family) -> Vec<TableView<'a>> {
        model
            .tables
            .iter()
            .filter(|((f, _), _)| *f == family || *f == Family::Inet)
            .map(|((f, name), t)| TableView {
                family: *f,
                name: name.as_str(),
                chains: t.chains.iter().map(|(n, c)| (n.as_str(), &**c)).collect(),
                sets: &t.sets,
                defs: t.sets.values().map(|s| (*s.def).clone()).collect(),
            })
            .collect()
    }

    fn ctx(&self) -> render::Context<'_> {
        render::Context::new(self.family as i32, &self.defs)
    }
}

/// The packet's headers as they are now (after any translation).
#[derive(Debug, Clone, PartialEq)]
pub struct Headers {
    pub saddr: IpAddr,
    pub sport: u16,
    pub daddr: IpAddr,
    pub dport: u16,
}

/// What ended a hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Terminal {
    Accept,
    Drop,
}

enum Flow {
    /// The rule stopped (a comparison or lookup did not match).
    Break,
    /// Every expression ran, without a verdict.
    Done,
    Verdict(Verdict),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    Accept,
    Drop,
    Continue,
    Return,
    Jump(String),
    Goto(String),
}

impl Verdict {
    fn of(v: &v1::Verdict) -> Option<Verdict> {
        Some(match VerdictCode::try_from(v.code).ok()? {
            VerdictCode::Accept => Verdict::Accept,
            VerdictCode::Drop => Verdict::Drop,
            VerdictCode::Continue => Verdict::Continue,
            VerdictCode::Return => Verdict::Return,
            VerdictCode::Jump => Verdict::Jump(v.chain.clone()),
            VerdictCode::Goto => Verdict::Goto(v.chain.clone()),
            VerdictCode::Unspecified => return None,
        })
    }
}

/// The result of one run.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    pub steps: Vec<PathStep>,
    /// Moduli of the numgen expressions evaluated, in order.
    pub numgens: Vec<u32>,
    pub dnat: Option<(IpAddr, u16)>,
    pub snat: Option<IpAddr>,
    pub masquerade: bool,
    pub dropped: bool,
    pub reject: Option<Reject>,
    pub route: String,
    pub dynsets: Vec<DynsetEffect>,
    /// Dynamic maps a lookup consulted (whose packet-path entries the model does not hold).
    pub dynamic_lookups: Vec<String>,
    /// Values a rule read that the run could not know, and what it assumed.
    pub unknowns: Vec<String>,
}

pub struct Run<'a> {
    tables: &'a [TableView<'a>],
    packet: &'a Packet,
    choices: &'a [u32],
    cur: Headers,
    mark: u32,
    /// NAT of this connection decided for the destination (prerouting/output) and the
    /// source (input/postrouting): nat chains of that kind run no more.
    nat_dst_done: bool,
    nat_src_done: bool,
    hook: Hook,
    iifname: Option<String>,
    rules_run: usize,
    out: RunResult,
}

fn step(kind: Kind, text: String) -> PathStep {
    PathStep {
        kind: kind as i32,
        text,
        ..Default::default()
    }
}

pub fn hook_name(h: Hook) -> &'static str {
    match h {
        Hook::Prerouting => "prerouting",
        Hook::Input => "input",
        Hook::Forward => "forward",
        Hook::Output => "output",
        Hook::Postrouting => "postrouting",
        Hook::Unspecified => "unknown",
    }
}

fn sock(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

fn reject_text(r: &Reject, v6: bool) -> String {
    match RejectType::try_from(r.r#type) {
        Ok(RejectType::TcpRst) => "a TCP reset".into(),
        Ok(RejectType::IcmpUnreach) => {
            let what = match (v6, r.code) {
                (false, 3) | (true, 4) => "port unreachable".to_string(),
                (false, 1) | (true, 3) => "host unreachable".to_string(),
                (false, 13) | (true, 1) => "administratively prohibited".to_string(),
                (_, c) => format!("code {c}"),
            };
            format!("ICMP{} {what}", if v6 { "v6" } else { "" })
        }
        Ok(RejectType::IcmpxUnreach) => {
            let what = match r.code {
                0 => "no route",
                1 => "port unreachable",
                2 => "host unreachable",
                3 => "administratively prohibited",
                _ => "unknown code",
            };
            format!("ICMP {what}")
        }
        Err(_) => format!("reject type {}", r.r#type),
    }
}

pub fn describe_reject(r: &Reject, v6: bool) -> String {
    reject_text(r, v6)
}

impl<'a> Run<'a> {
    pub fn new(tables: &'a [TableView<'a>], packet: &'a Packet, choices: &'a [u32]) -> Self {
        Run {
            tables,
            packet,
            choices,
            cur: Headers {
                saddr: packet.saddr,
                sport: packet.sport,
                daddr: packet.daddr,
                dport: packet.dport,
            },
            mark: packet.mark,
            nat_dst_done: false,
            nat_src_done: false,
            hook: Hook::Unspecified,
            iifname: None,
            rules_run: 0,
            out: RunResult::default(),
        }
    }

    fn v6(&self) -> bool {
        self.packet.saddr.is_ipv6()
    }

    fn unknown(&mut self, what: String) {
        if !self.out.unknowns.contains(&what) {
            self.out.unknowns.push(what);
        }
    }

    fn note(&mut self, text: String) {
        let mut s = step(Kind::Note, text);
        s.hook = self.hook as i32;
        self.out.steps.push(s);
    }

    /// The whole path: the hooks a packet of its origin passes, the routing decisions between
    /// them, and where it goes at the end.
    pub fn go(mut self) -> RunResult {
        let local = |ip: IpAddr| self.packet.is_local(ip);
        match self.packet.origin {
            Origin::Arriving => {
                self.iifname = self.packet.iifname.clone();
                if self.hook_run(Hook::Prerouting) == Terminal::Drop {
                    return self.dropped();
                }
                if local(self.cur.daddr) {
                    self.note(format!(
                        "routing: {} is an address of this node: local delivery (input)",
                        self.cur.daddr
                    ));
                    if self.hook_run(Hook::Input) == Terminal::Drop {
                        return self.dropped();
                    }
                    self.out.route = format!(
                        "delivered to a socket of this node on {}",
                        sock(self.cur.daddr, self.cur.dport)
                    );
                } else {
                    self.note(format!(
                        "routing: {} is not an address of this node: forwarded",
                        self.cur.daddr
                    ));
                    if self.hook_run(Hook::Forward) == Terminal::Drop
                        || self.hook_run(Hook::Postrouting) == Terminal::Drop
                    {
                        return self.dropped();
                    }
                    self.out.route =
                        format!("forwarded to {}", sock(self.cur.daddr, self.cur.dport));
                }
            }
            Origin::Local => {
                self.iifname = Some(String::new());
                if self.hook_run(Hook::Output) == Terminal::Drop {
                    return self.dropped();
                }
                if self.hook_run(Hook::Postrouting) == Terminal::Drop {
                    return self.dropped();
                }
                if local(self.cur.daddr) {
                    // A packet to the node itself loops back through lo: prerouting and input
                    // again, with the NAT of its connection already decided.
                    self.note(format!(
                        "routing: {} is an address of this node: looped back through lo",
                        self.cur.daddr
                    ));
                    self.iifname = Some("lo".into());
                    if self.hook_run(Hook::Prerouting) == Terminal::Drop
                        || self.hook_run(Hook::Input) == Terminal::Drop
                    {
                        return self.dropped();
                    }
                    self.out.route = format!(
                        "delivered to a socket of this node on {}",
                        sock(self.cur.daddr, self.cur.dport)
                    );
                } else {
                    self.out.route = format!("sent to {}", sock(self.cur.daddr, self.cur.dport));
                }
            }
        }
        self.out
    }

    fn dropped(mut self) -> RunResult {
        self.out.dropped = true;
        self.out.route = if self.out.reject.is_some() {
            "refused".into()
        } else {
            "dropped".into()
        };
        self.out
    }

    /// Every base chain of `hook` in every table, by priority. NAT chains run for a
    /// connection's first packet only, and only until one of them decided the translation
    /// of their kind (the kernel's `nf_nat_inet_fn`).
    fn hook_run(&mut self, hook: Hook) -> Terminal {
        self.hook = hook;
        let mut chains: Vec<(i32, usize, &Chain)> = Vec::new();
        for (t, table) in self.tables.iter().enumerate() {
            for chain in table.chains.values() {
                if let Some(base) = &chain.base
                    && base.hook == hook as i32
                {
                    chains.push((base.priority, t, chain));
                }
            }
        }
        chains.sort_by(|a, b| (a.0, a.1, &a.2.name).cmp(&(b.0, b.1, &b.2.name)));
        let mut s = step(
            Kind::Hook,
            format!(
                "hook {}: {}",
                hook_name(hook),
                if chains.is_empty() {
                    "no base chain".to_string()
                } else {
                    format!("{} base chain(s)", chains.len())
                }
            ),
        );
        s.hook = hook as i32;
        self.out.steps.push(s);
        let dst_kind = matches!(hook, Hook::Prerouting | Hook::Output);
        let mut nat_ran = false;
        for (_, t, chain) in chains {
            let table = &self.tables[t];
            let base = chain.base.unwrap_or_default();
            let is_nat = base.r#type == ChainType::Nat as i32;
            if is_nat {
                let why = if self.packet.established {
                    Some("NAT chains see only a connection's first packet")
                } else if (dst_kind && self.nat_dst_done) || (!dst_kind && self.nat_src_done) {
                    Some("the connection's NAT of this kind is already decided")
                } else {
                    None
                };
                if let Some(why) = why {
                    let mut s = self.chain_step(table, chain, 0);
                    s.kind = Kind::Note as i32;
                    s.text = format!("chain {} skipped: {why}", chain.name);
                    self.out.steps.push(s);
                    continue;
                }
                nat_ran = true;
            }
            let mut s = self.chain_step(table, chain, 0);
            s.text = format!(
                "chain {} of table {} {} (type {}, priority {})",
                chain.name,
                table.family.nft_name(),
                table.name,
                if is_nat { "nat" } else { "filter" },
                base.priority
            );
            self.out.steps.push(s);
            let before = (self.out.dnat, self.out.snat, self.out.masquerade);
            let end = self.run_chain(table, chain, base.policy_drop);
            if is_nat && before != (self.out.dnat, self.out.snat, self.out.masquerade) {
                if dst_kind {
                    self.nat_dst_done = true;
                } else {
                    self.nat_src_done = true;
                }
            }
            if end == Terminal::Drop {
                return Terminal::Drop;
            }
        }
        // Without a translation the kernel binds the connection to none (a null binding).
        if nat_ran {
            if dst_kind {
                self.nat_dst_done = true;
            } else {
                self.nat_src_done = true;
            }
        }
        Terminal::Accept
    }

    fn chain_step(&self, table: &TableView<'_>, chain: &Chain, depth: usize) -> PathStep {
        let mut s = step(Kind::Chain, String::new());
        s.hook = self.hook as i32;
        s.family = table.family as i32;
        s.table = table.name.to_string();
        s.chain = chain.name.clone();
        s.depth = depth as u32;
        s
    }

    /// A base chain and everything it jumps to, until a verdict ends the hook's traversal
    /// (accept, drop) or the base chain ends (its policy).
    fn run_chain(&mut self, table: &TableView<'_>, base: &Chain, policy_drop: bool) -> Terminal {
        let mut stack: Vec<(&Chain, usize)> = Vec::new();
        let mut cur = base;
        let mut idx = 0;
        loop {
            let verdict = if idx >= cur.rules.len() {
                Verdict::Return
            } else {
                self.rules_run += 1;
                if self.rules_run > MAX_RULES {
                    self.unknown(format!(
                        "gave up after {MAX_RULES} rules (a loop?); treated as dropped"
                    ));
                    return Terminal::Drop;
                }
                match self.rule(table, cur, idx, stack.len()) {
                    Flow::Break | Flow::Done => {
                        idx += 1;
                        continue;
                    }
                    Flow::Verdict(v) => v,
                }
            };
            let depth = stack.len();
            let is_goto = matches!(verdict, Verdict::Goto(_));
            match verdict {
                Verdict::Accept => return Terminal::Accept,
                Verdict::Drop => return Terminal::Drop,
                Verdict::Continue => idx += 1,
                Verdict::Return => match stack.pop() {
                    Some((c, i)) => {
                        let mut s = self.chain_step(table, c, depth - 1);
                        s.kind = Kind::Verdict as i32;
                        s.text = format!(
                            "{} chain {}: back in {}",
                            if idx >= cur.rules.len() {
                                "end of"
                            } else {
                                "return from"
                            },
                            cur.name,
                            c.name
                        );
                        self.out.steps.push(s);
                        cur = c;
                        idx = i;
                    }
                    None => {
                        let mut s = self.chain_step(table, cur, 0);
                        s.kind = Kind::Verdict as i32;
                        s.text = format!(
                            "end of base chain {}: policy {}",
                            cur.name,
                            if policy_drop { "drop" } else { "accept" }
                        );
                        self.out.steps.push(s);
                        return if policy_drop {
                            Terminal::Drop
                        } else {
                            Terminal::Accept
                        };
                    }
                },
                Verdict::Jump(name) | Verdict::Goto(name) => {
                    let goto = is_goto;
                    let Some(target) = table.chains.get(name.as_str()).copied() else {
                        self.unknown(format!(
                            "chain {name} does not exist (the kernel would have refused the rule); treated as dropped"
                        ));
                        return Terminal::Drop;
                    };
                    if !goto {
                        if stack.len() >= JUMP_STACK {
                            self.unknown("jump stack overflow; treated as dropped".into());
                            return Terminal::Drop;
                        }
                        stack.push((cur, idx + 1));
                    }
                    cur = target;
                    idx = 0;
                    let mut s = self.chain_step(table, cur, stack.len());
                    s.text = format!(
                        "{} chain {}",
                        if goto { "goto" } else { "jump to" },
                        cur.name
                    );
                    self.out.steps.push(s);
                }
            }
        }
    }
}

/// What one expression did.
enum Ex {
    Next,
    Break,
    Verdict(Verdict),
}

/// What a rule's lookups found, for deciding whether a rule that did not match is worth a step.
#[derive(Default)]
struct RuleTrace {
    steps: Vec<PathStep>,
    /// A lookup matched before the rule stopped.
    hit: bool,
    /// A lookup in a dynamic set found nothing (its entries come from the packet path).
    dynamic_miss: bool,
}

impl Run<'_> {
    /// One rule: its expressions in order until one stops it or gives a verdict.
    fn rule(&mut self, table: &TableView<'_>, chain: &Chain, idx: usize, depth: usize) -> Flow {
        let Some(rule) = chain.rules.get(idx) else {
            return Flow::Break;
        };
        let mut regs = Registers::default();
        let mut trace = RuleTrace::default();
        let mut flow = Flow::Done;
        for e in &rule.exprs {
            match self.expr(table, chain, idx, e, &mut regs, &mut trace) {
                Ex::Next => {}
                Ex::Break => {
                    flow = Flow::Break;
                    break;
                }
                Ex::Verdict(v) => {
                    flow = Flow::Verdict(v);
                    break;
                }
            }
        }
        let matched = !matches!(flow, Flow::Break);
        if matched || trace.hit || trace.dynamic_miss {
            let text = render::rule_in(&table.ctx(), rule);
            let mut s = self.chain_step(table, chain, depth);
            s.kind = if matched { Kind::Rule } else { Kind::NoMatch } as i32;
            s.rule = idx as u32;
            s.matched = matched;
            s.text = format!(
                "rule {idx}: {text}{}",
                if matched { "" } else { "  (no match)" }
            );
            s.rule_text = text;
            self.out.steps.push(s);
            for mut sub in trace.steps {
                sub.hook = self.hook as i32;
                sub.family = table.family as i32;
                sub.table = table.name.to_string();
                sub.chain = chain.name.clone();
                sub.rule = idx as u32;
                sub.depth = depth as u32;
                self.out.steps.push(sub);
            }
            if let Flow::Verdict(v) = &flow {
                let text = match v {
                    Verdict::Accept => Some("accept: the hook's traversal ends here".to_string()),
                    Verdict::Drop => Some("drop".to_string()),
                    Verdict::Continue => None,
                    Verdict::Return => Some(format!("return from {}", chain.name)),
                    // The chain entered is the next step.
                    Verdict::Jump(_) | Verdict::Goto(_) => None,
                };
                if let Some(text) = text {
                    let mut s = self.chain_step(table, chain, depth);
                    s.kind = Kind::Verdict as i32;
                    s.rule = idx as u32;
                    s.text = text;
                    self.out.steps.push(s);
                }
            }
        }
        flow
    }

    fn unknown_read(&mut self, table: &TableView<'_>, chain: &Chain, idx: usize, what: &str) {
        let text = chain
            .rules
            .get(idx)
            .map(|r| render::rule_in(&table.ctx(), r))
            .unwrap_or_default();
        self.unknown(format!(
            "chain {} rule {idx} ({text}) {what} a value the request does not determine; assumed no match",
            chain.name
        ));
    }

    fn expr(
        &mut self,
        table: &TableView<'_>,
        chain: &Chain,
        idx: usize,
        e: &v1::Expr,
        regs: &mut Registers,
        trace: &mut RuleTrace,
    ) -> Ex {
        let Some(kind) = &e.kind else {
            return Ex::Next;
        };
        // A register outside the sixteen: the kernel refuses such a rule; here it stops.
        macro_rules! reg {
            ($e:expr) => {
                match $e {
                    Ok(v) => v,
                    Err(err) => {
                        self.unknown(format!("chain {} rule {idx}: {err}", chain.name));
                        return Ex::Break;
                    }
                }
            };
        }
        match kind {
            ExprKind::Payload(p) => {
                let (bytes, known) = match PayloadBase::try_from(p.base) {
                    Ok(PayloadBase::Network) => self.network_header(),
                    Ok(PayloadBase::Transport) => self.transport_header(),
                    _ => (vec![0; 64], vec![false; 64]),
                };
                let (o, l) = (p.offset as usize, p.len as usize);
                let Some(value) = bytes.get(o..o + l) else {
                    // Past the header: the kernel's load fails and the rule stops.
                    return Ex::Break;
                };
                let k = known[o..o + l].iter().all(|k| *k);
                reg!(regs.load(p.dreg, value, k));
                Ex::Next
            }
            ExprKind::Meta(m) => self.meta(m, regs, chain, idx, trace),
            ExprKind::Ct(c) => {
                let (value, known) = self.ct(c);
                match value {
                    Some(v) => {
                        reg!(regs.load(c.dreg, &v, known));
                        Ex::Next
                    }
                    None => Ex::Break,
                }
            }
            ExprKind::Fib(f) => {
                // saddr, else daddr (FIB_F_DADDR, the only other address flag).
                let addr = if f.flags & FIB_F_SADDR != 0 {
                    self.cur.saddr
                } else {
                    self.cur.daddr
                };
                match FibResult::try_from(f.result) {
                    Ok(FibResult::Addrtype) if f.flags & FIB_F_IIF == 0 && f.flags < 32 => {
                        let t = self.addr_type(addr);
                        reg!(regs.load(f.dreg, &t.to_ne_bytes(), true));
                    }
                    Ok(FibResult::Oifname) => reg!(regs.load(f.dreg, &[0; 16], false)),
                    _ => reg!(regs.load(f.dreg, &[0; 4], false)),
                }
                Ex::Next
            }
            ExprKind::Cmp(c) => {
                let Some(bytes) = reg!(regs.read(c.sreg, c.data.len())) else {
                    self.unknown_read(table, chain, idx, "compares");
                    return Ex::Break;
                };
                let ord = bytes.cmp(&c.data[..]);
                use std::cmp::Ordering::*;
                let ok = match CmpOp::try_from(c.op) {
                    Ok(CmpOp::Eq) => ord == Equal,
                    Ok(CmpOp::Neq) => ord != Equal,
                    Ok(CmpOp::Lt) => ord == Less,
                    Ok(CmpOp::Lte) => ord != Greater,
                    Ok(CmpOp::Gt) => ord == Greater,
                    Ok(CmpOp::Gte) => ord != Less,
                    Err(_) => false,
                };
                if ok { Ex::Next } else { Ex::Break }
            }
            ExprKind::Bitwise(b) => {
                let n = b.mask.len();
                match reg!(regs.read(b.sreg, n)) {
                    Some(src) => {
                        let out: Vec<u8> = (0..n)
                            .map(|i| (src[i] & b.mask[i]) ^ b.xor.get(i).copied().unwrap_or(0))
                            .collect();
                        reg!(regs.load(b.dreg, &out, true));
                    }
                    None => reg!(regs.load(b.dreg, &vec![0; n], false)),
                }
                Ex::Next
            }
            ExprKind::Lookup(l) => self.lookup(table, chain, idx, l, regs, trace),
            ExprKind::Numgen(n) => {
                let which = self.out.numgens.len();
                self.out.numgens.push(n.modulus);
                let v = self.choices.get(which).copied().unwrap_or(0);
                let value = v.wrapping_add(n.offset);
                reg!(regs.load(n.dreg, &value.to_ne_bytes(), true));
                let ty = if n.r#type == NumgenType::Random as i32 {
                    "random"
                } else {
                    "inc"
                };
                trace.steps.push(step(
                    Kind::Effect,
                    format!(
                        "numgen {ty} mod {} = {v}: one of {} equally likely values, each explained",
                        n.modulus, n.modulus
                    ),
                ));
                Ex::Next
            }
            ExprKind::Nat(n) => {
                let alen = match Family::try_from(n.family) {
                    Ok(Family::Ip6) => 16,
                    Ok(Family::Ip) => 4,
                    _ if self.v6() => 16,
                    _ => 4,
                };
                let addr = if n.has_addr {
                    match reg!(regs.read(n.reg_addr, alen)).and_then(regs::ip_of) {
                        Some(a) => Some(a),
                        None => {
                            self.unknown_read(table, chain, idx, "translates to");
                            return Ex::Break;
                        }
                    }
                } else {
                    None
                };
                let port = if n.has_proto {
                    match reg!(regs.read(n.reg_proto, 2)) {
                        Some(b) => Some(u16::from_be_bytes([b[0], b[1]])),
                        None => {
                            self.unknown_read(table, chain, idx, "translates to");
                            return Ex::Break;
                        }
                    }
                } else {
                    None
                };
                if n.r#type == NatType::Snat as i32 {
                    if let Some(a) = addr {
                        self.cur.saddr = a;
                    }
                    if let Some(p) = port {
                        self.cur.sport = p;
                    }
                    self.out.snat = Some(self.cur.saddr);
                    trace.steps.push(step(
                        Kind::Effect,
                        format!(
                            "snat: the source becomes {}",
                            sock(self.cur.saddr, self.cur.sport)
                        ),
                    ));
                } else {
                    if let Some(a) = addr {
                        self.cur.daddr = a;
                    }
                    if let Some(p) = port {
                        self.cur.dport = p;
                    }
                    self.out.dnat = Some((self.cur.daddr, self.cur.dport));
                    trace.steps.push(step(
                        Kind::Effect,
                        format!(
                            "dnat: the destination becomes {}",
                            sock(self.cur.daddr, self.cur.dport)
                        ),
                    ));
                }
                Ex::Verdict(Verdict::Accept)
            }
            ExprKind::Masquerade(_) => {
                self.out.masquerade = true;
                trace.steps.push(step(
                    Kind::Effect,
                    "masquerade: the source becomes the address of the interface the packet leaves by"
                        .into(),
                ));
                Ex::Verdict(Verdict::Accept)
            }
            ExprKind::Reject(r) => {
                let v6 = self.v6();
                self.out.reject = Some(*r);
                trace.steps.push(step(
                    Kind::Effect,
                    format!("reject: {} goes back to the sender", reject_text(r, v6)),
                ));
                Ex::Verdict(Verdict::Drop)
            }
            ExprKind::Dynset(d) => {
                self.dynset(table, chain, idx, d, regs, trace);
                Ex::Next
            }
            ExprKind::Counter(_) => Ex::Next,
            ExprKind::Verdict(v) => match Verdict::of(v) {
                Some(v) => Ex::Verdict(v),
                None => Ex::Next,
            },
            ExprKind::Immediate(i) => {
                reg!(regs.load(i.dreg, &i.data, true));
                Ex::Next
            }
        }
    }

    /// The packet's network header: the fields rules read are known (version, protocol,
    /// addresses), the others (length, TTL, checksum...) are not.
    fn network_header(&self) -> (Vec<u8>, Vec<bool>) {
        let l4 = self.packet.l4proto;
        match (self.cur.saddr, self.cur.daddr) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let mut b = vec![0u8; 20];
                let mut k = vec![false; 20];
                b[0] = 0x45;
                b[9] = l4;
                b[12..16].copy_from_slice(&s.octets());
                b[16..20].copy_from_slice(&d.octets());
                for i in [0, 9].into_iter().chain(12..20) {
                    k[i] = true;
                }
                (b, k)
            }
            (s, d) => {
                let mut b = vec![0u8; 40];
                let mut k = vec![false; 40];
                b[0] = 0x60;
                b[6] = l4;
                if let (IpAddr::V6(s), IpAddr::V6(d)) = (s, d) {
                    b[8..24].copy_from_slice(&s.octets());
                    b[24..40].copy_from_slice(&d.octets());
                    for i in [0, 6].into_iter().chain(8..40) {
                        k[i] = true;
                    }
                }
                (b, k)
            }
        }
    }

    /// The transport header: ports known, the rest not.
    fn transport_header(&self) -> (Vec<u8>, Vec<bool>) {
        let len = match self.packet.l4proto {
            17 => 8,
            132 => 12,
            _ => 20,
        };
        let mut b = vec![0u8; len];
        let mut k = vec![false; len];
        b[0..2].copy_from_slice(&self.cur.sport.to_be_bytes());
        b[2..4].copy_from_slice(&self.cur.dport.to_be_bytes());
        k[0..4].fill(true);
        (b, k)
    }

    fn addr_type(&self, addr: IpAddr) -> u32 {
        if self.packet.is_local(addr) {
            RTN_LOCAL
        } else if addr.is_multicast() {
            RTN_MULTICAST
        } else if addr == IpAddr::V4(std::net::Ipv4Addr::BROADCAST) {
            RTN_BROADCAST
        } else {
            RTN_UNICAST
        }
    }

    fn meta(
        &mut self,
        m: &v1::Meta,
        regs: &mut Registers,
        chain: &Chain,
        idx: usize,
        trace: &mut RuleTrace,
    ) -> Ex {
        let key = MetaKey::try_from(m.key).unwrap_or(MetaKey::Unspecified);
        if m.set {
            let value = match regs.read(m.sreg, 4) {
                Ok(v) => v.map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
                Err(_) => None,
            };
            match (key, value) {
                (MetaKey::Mark, Some(v)) => {
                    self.mark = v;
                    trace
                        .steps
                        .push(step(Kind::Effect, format!("meta mark set 0x{v:08x}")));
                }
                _ => self.unknown(format!(
                    "chain {} rule {idx}: meta {key:?} set with an unknown value; ignored",
                    chain.name
                )),
            }
            return Ex::Next;
        }
        let iif = |name: &Option<String>| -> (Vec<u8>, bool) {
            let mut b = vec![0u8; 16];
            match name {
                Some(n) => {
                    let n = n.as_bytes();
                    let l = n.len().min(15);
                    b[..l].copy_from_slice(&n[..l]);
                    (b, true)
                }
                None => (b, false),
            }
        };
        let (value, known): (Vec<u8>, bool) = match key {
            MetaKey::L4proto => (vec![self.packet.l4proto], true),
            MetaKey::Protocol => (
                if self.v6() { 0x86ddu16 } else { 0x0800 }
                    .to_be_bytes()
                    .to_vec(),
                true,
            ),
            MetaKey::Nfproto => (vec![if self.v6() { 10 } else { 2 }], true),
            MetaKey::Mark => (self.mark.to_ne_bytes().to_vec(), true),
            MetaKey::Iifname => match self.hook {
                Hook::Output | Hook::Postrouting if self.packet.origin == Origin::Local => {
                    (vec![0; 16], true)
                }
                _ => iif(&self.iifname),
            },
            MetaKey::Oifname => match self.hook {
                Hook::Prerouting | Hook::Input => (vec![0; 16], true),
                _ => (vec![0; 16], false),
            },
            MetaKey::Pkttype if self.packet.origin == Origin::Arriving => (vec![0], true),
            _ => (vec![0; 4], false),
        };
        match regs.load(m.dreg, &value, known) {
            Ok(()) => Ex::Next,
            Err(_) => Ex::Break,
        }
    }

    /// A conntrack key: `None` stops the rule (a tuple field of the other family).
    fn ct(&mut self, c: &v1::Ct) -> (Option<Vec<u8>>, bool) {
        let p = self.packet;
        let original = c.direction != CtDirection::Reply as i32;
        let (src, dst, sport, dport) = if original {
            (Some(p.saddr), p.daddr, p.sport, p.dport)
        } else {
            let masq = self.out.masquerade || self.out.snat.is_some();
            (
                Some(self.cur.daddr),
                if masq { self.cur.saddr } else { p.saddr },
                self.cur.dport,
                if masq { 0 } else { p.sport },
            )
        };
        let ip = |a: IpAddr, v6: bool| -> Option<Vec<u8>> {
            match (a, v6) {
                (IpAddr::V4(a), false) => Some(a.octets().to_vec()),
                (IpAddr::V6(a), true) => Some(a.octets().to_vec()),
                _ => None,
            }
        };
        let masq_reply = !original && (self.out.masquerade || self.out.snat.is_some());
        match CtKey::try_from(c.key).unwrap_or(CtKey::Unspecified) {
            CtKey::State => {
                let v = if p.established {
                    CT_STATE_ESTABLISHED
                } else {
                    CT_STATE_NEW
                };
                (Some(v.to_ne_bytes().to_vec()), true)
            }
            CtKey::Status => {
                let mut v = 0;
                if self.out.dnat.is_some() {
                    v |= IPS_DST_NAT;
                }
                if self.out.snat.is_some() || self.out.masquerade {
                    v |= IPS_SRC_NAT;
                }
                if p.established {
                    v |= IPS_SEEN_REPLY;
                }
                (Some(v.to_ne_bytes().to_vec()), true)
            }
            CtKey::Mark => (Some(vec![0; 4]), true),
            CtKey::SrcIp => (src.and_then(|a| ip(a, false)), true),
            CtKey::SrcIp6 => (src.and_then(|a| ip(a, true)), true),
            CtKey::DstIp => (ip(dst, false), !masq_reply),
            CtKey::DstIp6 => (ip(dst, true), !masq_reply),
            CtKey::ProtoSrc => (Some(sport.to_be_bytes().to_vec()), true),
            CtKey::ProtoDst => (Some(dport.to_be_bytes().to_vec()), !masq_reply),
            CtKey::Protocol => (Some(vec![p.l4proto]), true),
            CtKey::Unspecified => (Some(vec![0; 4]), false),
        }
    }

    fn lookup(
        &mut self,
        table: &TableView<'_>,
        chain: &Chain,
        idx: usize,
        l: &v1::Lookup,
        regs: &mut Registers,
        trace: &mut RuleTrace,
    ) -> Ex {
        let Some(set) = table.sets.get(&l.set) else {
            self.unknown(format!(
                "chain {} rule {idx}: set {} does not exist; no match",
                chain.name, l.set
            ));
            return Ex::Break;
        };
        let def = &set.def;
        let Some(fields) = regs::fields(&def.key) else {
            return Ex::Break;
        };
        let bytes = match regs.read(l.sreg, regs::byte_len(&fields)) {
            Ok(Some(b)) => b.to_vec(),
            _ => {
                self.unknown_read(table, chain, idx, "looks up");
                return Ex::Break;
            }
        };
        let Some(key) = regs::decode(&fields, &bytes) else {
            return Ex::Break;
        };
        let found = find(set, &key);
        let key_text = render::element(
            def,
            &Element {
                key: key.clone(),
                ..Default::default()
            },
        );
        let matched = found.is_some() != l.invert;
        let mut s = step(Kind::Lookup, String::new());
        s.set = l.set.clone();
        s.key = key_text.clone();
        s.matched = matched;
        let dynamic = def.dynamic || def.timeout;
        match &found {
            Some(e) => {
                let text = render::element(def, e);
                s.text = if l.invert {
                    format!(
                        "{key_text} is in @{} (element {text}): the rule wants it absent",
                        l.set
                    )
                } else {
                    format!("@{}: {key_text} matches element {text}", l.set)
                };
                s.element = text;
                trace.hit |= !l.invert;
            }
            None => {
                s.text = if l.invert {
                    format!("{key_text} is not in @{}: as the rule wants", l.set)
                } else if dynamic {
                    format!(
                        "@{}: no entry for {key_text} (a map the packet path fills on the node; the model holds none of its entries)",
                        l.set
                    )
                } else {
                    format!("@{}: no element matches {key_text}", l.set)
                };
                if dynamic && !l.invert {
                    trace.dynamic_miss = true;
                    if !self.out.dynamic_lookups.contains(&l.set) {
                        self.out.dynamic_lookups.push(l.set.clone());
                    }
                }
            }
        }
        trace.steps.push(s);
        if !matched {
            return Ex::Break;
        }
        let Some(e) = found.filter(|_| !l.invert) else {
            return Ex::Next;
        };
        if l.verdict {
            return match e.verdict.as_ref().and_then(Verdict::of) {
                Some(v) => Ex::Verdict(v),
                None => Ex::Break,
            };
        }
        if l.has_dreg {
            let data = regs::fields(&def.data).and_then(|f| regs::encode(&f, &e.data));
            match data {
                Some(d) => {
                    if regs.load(l.dreg, &d, true).is_err() {
                        return Ex::Break;
                    }
                }
                None => return Ex::Break,
            }
        }
        Ex::Next
    }

    fn dynset(
        &mut self,
        table: &TableView<'_>,
        chain: &Chain,
        idx: usize,
        d: &v1::Dynset,
        regs: &Registers,
        trace: &mut RuleTrace,
    ) {
        let Some(set) = table.sets.get(&d.set) else {
            return;
        };
        let def = &set.def;
        let read = |types: &[i32], reg: u32| -> Option<Vec<v1::Datum>> {
            let f = regs::fields(types)?;
            let b = regs.read(reg, regs::byte_len(&f)).ok()??;
            regs::decode(&f, b)
        };
        let Some(key) = read(&def.key, d.sreg_key) else {
            self.unknown_read(table, chain, idx, "adds to a set");
            return;
        };
        let data = if d.has_data {
            read(&def.data, d.sreg_data)
        } else {
            Some(Vec::new())
        };
        let Some(data) = data else {
            self.unknown_read(table, chain, idx, "adds to a map");
            return;
        };
        let key_text = render::element(
            def,
            &Element {
                key,
                ..Default::default()
            },
        );
        let data_def = v1::Set {
            key: def.data.clone(),
            ..Default::default()
        };
        let data_text = if data.is_empty() {
            String::new()
        } else {
            render::element(
                &data_def,
                &Element {
                    key: data,
                    ..Default::default()
                },
            )
        };
        let timeout_ms = if d.timeout_ms > 0 {
            d.timeout_ms
        } else {
            def.default_timeout_ms
        };
        let op = match DynsetOp::try_from(d.op) {
            Ok(DynsetOp::Add) => "add",
            Ok(DynsetOp::Delete) => "delete",
            _ => "update",
        };
        let mut s = step(
            Kind::Effect,
            format!(
                "{op} @{} {{ {key_text}{} }}{}: the node remembers this for later packets",
                d.set,
                if data_text.is_empty() {
                    String::new()
                } else {
                    format!(" : {data_text}")
                },
                if timeout_ms > 0 {
                    format!(" timeout {}s", timeout_ms / 1000)
                } else {
                    String::new()
                }
            ),
        );
        s.set = d.set.clone();
        s.key = key_text.clone();
        s.element = data_text.clone();
        trace.steps.push(s);
        self.out.dynsets.push(DynsetEffect {
            set: d.set.clone(),
            key: key_text,
            data: data_text,
            timeout_ms,
        });
    }
}

/// The element of `set` that `key` matches: by its exact key, or for interval sets the
/// element whose every field's range holds the key's field.
fn find(set: &SetModel, key: &[v1::Datum]) -> Option<Element> {
    if !set.def.interval {
        return set.get(&element_key_bytes(&Element {
            key: key.to_vec(),
            ..Default::default()
        }));
    }
    set.decoded().find(|e| {
        e.key.len() == key.len()
            && key.iter().enumerate().all(|(i, k)| {
                let start = e.key.get(i);
                let end = e.key_end.get(i).or(start);
                match (
                    regs::ordinal(k),
                    start.and_then(regs::ordinal),
                    end.and_then(regs::ordinal),
                ) {
                    (Some(v), Some(s), Some(e)) => s <= v && v <= e,
                    _ => false,
                }
            })
    })
}
