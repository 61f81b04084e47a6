//! The register model: a rule's expressions decompiled into statements. Every load records in
//! a model of the sixteen 32-bit registers what a register holds as an nft expression, and every
//! consumer (cmp, lookup, nat, meta set, dynset) prints a statement from those expressions.
use std::fmt::Write as _;

use crate::v1::{self, CmpOp, DynsetOp, Family, NatType, NumgenType, RejectType, expr};

use super::Context;
use super::fields::{fib_info, icmp_code, icmpv6_code, meta_info, nat_flags, payload_name};
use super::objects::{duration, verdict};
use super::values::{
    Kind, ct_info, data_type_regs, format_bytes, format_fields, hex, mask_prefix, regs_for_len,
};

/// Number of 32-bit data registers (NFT_REG32_00..15).
pub(super) const NREGS: usize = 16;

/// What a data-map lookup put in a register.
#[derive(Clone, Debug)]
pub(super) enum MapResult {
    /// The data types of the map, from its definition.
    Known(Vec<i32>),
    /// The map is not known to the renderer.
    Unknown,
}

#[derive(Clone, Debug)]
pub(super) struct Val {
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
pub(super) enum Slot {
    Empty,
    Head(Val),
    /// Part of the multi-register value that starts at the given register.
    Cont(usize),
}

pub(super) struct Decompiler<'c, 'a> {
    ctx: &'c Context<'a>,
    regs: Vec<Slot>,
    seq: u64,
    pub(super) out: Vec<String>,
}

pub(super) fn reg_index(reg: u32) -> Option<usize> {
    usize::try_from(reg).ok().filter(|&r| r < NREGS)
}

impl<'c, 'a> Decompiler<'c, 'a> {
    pub(super) fn new(ctx: &'c Context<'a>) -> Self {
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

    pub(super) fn expr(&mut self, e: &v1::Expr) {
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
