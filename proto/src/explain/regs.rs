//! The sixteen 32-bit data registers of an nf_tables rule, with what the evaluation knows of
//! each byte, and the layout of typed set keys and map data in them.
//!
//! The layout is the kernel's, as the actuator writes elements (`actuator/src/nft/datum.rs`):
//! each field of a concatenation starts a new register (padded to 4 bytes), a single field is
//! not padded; addresses, protocols and ports in network order, integers and marks in host
//! order. A load writes its bytes and zeroes the rest of its last register, as the kernel's
//! loads do, so padding compares equal.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::v1::{DataType, Datum, datum::Value};

/// NFT_REG32_00..15.
pub const NREGS: usize = 16;
const BYTES: usize = NREGS * 4;

/// The data registers: bytes, and whether each byte holds a value the evaluation knows.
#[derive(Debug, Clone)]
pub struct Registers {
    bytes: [u8; BYTES],
    known: [bool; BYTES],
}

impl Default for Registers {
    fn default() -> Self {
        // The kernel does not clear registers between rules; a rule reading one it never
        // loaded reads garbage, which the evaluation treats as unknown.
        Registers {
            bytes: [0; BYTES],
            known: [false; BYTES],
        }
    }
}

/// Why a register access is invalid (outside the sixteen registers).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("register {reg} with {len} bytes is outside the 16 registers")]
pub struct OutOfRange {
    pub reg: u32,
    pub len: usize,
}

fn range(reg: u32, len: usize) -> Result<std::ops::Range<usize>, OutOfRange> {
    let start = reg as usize * 4;
    match start.checked_add(len) {
        Some(end) if end <= BYTES && (reg as usize) < NREGS => Ok(start..end),
        _ => Err(OutOfRange { reg, len }),
    }
}

impl Registers {
    /// Loads `value` at `reg` (zeroing the rest of its last register); `known` false marks the
    /// bytes as a value the evaluation cannot know.
    pub fn load(&mut self, reg: u32, value: &[u8], known: bool) -> Result<(), OutOfRange> {
        let padded = value.len().div_ceil(4) * 4;
        let r = range(reg, padded.max(value.len()))?;
        let start = r.start;
        self.bytes[r.clone()].fill(0);
        self.known[r].fill(known);
        self.bytes[start..start + value.len()].copy_from_slice(value);
        Ok(())
    }

    /// `len` bytes from `reg`, or `None` when any of them is unknown.
    pub fn read(&self, reg: u32, len: usize) -> Result<Option<&[u8]>, OutOfRange> {
        let r = range(reg, len)?;
        if self.known[r.clone()].iter().all(|k| *k) {
            Ok(Some(&self.bytes[r]))
        } else {
            Ok(None)
        }
    }
}

/// Unpadded length of one field of type `t`; `None` for types that are not values.
pub fn field_len(t: DataType) -> Option<usize> {
    match t {
        DataType::Ipv4Addr | DataType::Integer | DataType::Mark => Some(4),
        DataType::Ipv6Addr => Some(16),
        DataType::InetProto => Some(1),
        DataType::InetService => Some(2),
        DataType::Verdict | DataType::Unspecified => None,
    }
}

/// Typed fields of a key or of map data, as the set declares them (raw enum values).
pub fn fields(raw: &[i32]) -> Option<Vec<DataType>> {
    raw.iter()
        .map(|&t| {
            DataType::try_from(t)
                .ok()
                .filter(|t| field_len(*t).is_some())
        })
        .collect()
}

fn slot_len(fields: &[DataType], t: DataType) -> usize {
    let len = field_len(t).unwrap_or(0);
    if fields.len() > 1 {
        len.div_ceil(4) * 4
    } else {
        len
    }
}

/// Bytes the fields take in registers.
pub fn byte_len(fields: &[DataType]) -> usize {
    fields.iter().map(|t| slot_len(fields, *t)).sum()
}

/// The typed values `bytes` (laid out for `fields`) hold.
pub fn decode(fields: &[DataType], bytes: &[u8]) -> Option<Vec<Datum>> {
    let mut out = Vec::with_capacity(fields.len());
    let mut at = 0;
    for t in fields {
        let len = field_len(*t)?;
        let b = bytes.get(at..at + len)?;
        let value = match t {
            DataType::Ipv4Addr => Value::Ipv4(b.to_vec()),
            DataType::Ipv6Addr => Value::Ipv6(b.to_vec()),
            DataType::InetProto => Value::Proto(u32::from(b[0])),
            DataType::InetService => Value::Port(u32::from(u16::from_be_bytes([b[0], b[1]]))),
            DataType::Integer | DataType::Mark => {
                Value::U32(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            }
            DataType::Verdict | DataType::Unspecified => return None,
        };
        out.push(Datum { value: Some(value) });
        at += slot_len(fields, *t);
    }
    Some(out)
}

/// The bytes of `datums` laid out for `fields` (the inverse of [`decode`]).
pub fn encode(fields: &[DataType], datums: &[Datum]) -> Option<Vec<u8>> {
    if fields.len() != datums.len() {
        return None;
    }
    let mut out = Vec::new();
    for (t, d) in fields.iter().zip(datums) {
        let start = out.len();
        match (t, d.value.as_ref()?) {
            (DataType::Ipv4Addr, Value::Ipv4(b)) if b.len() == 4 => out.extend_from_slice(b),
            (DataType::Ipv6Addr, Value::Ipv6(b)) if b.len() == 16 => out.extend_from_slice(b),
            (DataType::InetProto, Value::Proto(p)) => out.push(u8::try_from(*p).ok()?),
            (DataType::InetService, Value::Port(p)) => {
                out.extend_from_slice(&u16::try_from(*p).ok()?.to_be_bytes())
            }
            (DataType::Integer | DataType::Mark, Value::U32(v)) => {
                out.extend_from_slice(&v.to_ne_bytes())
            }
            _ => return None,
        }
        out.resize(start + slot_len(fields, *t), 0);
    }
    Some(out)
}

/// A datum as a number, for interval comparisons: addresses and ports as the unsigned numbers
/// they are in network order, integers as their value.
pub fn ordinal(d: &Datum) -> Option<u128> {
    Some(match d.value.as_ref()? {
        Value::Ipv4(b) => u128::from(u32::from_be_bytes(<[u8; 4]>::try_from(&b[..]).ok()?)),
        Value::Ipv6(b) => u128::from_be_bytes(<[u8; 16]>::try_from(&b[..]).ok()?),
        Value::Proto(v) | Value::Port(v) | Value::U32(v) => u128::from(*v),
    })
}

/// An address as a datum.
pub fn ip_datum(ip: IpAddr) -> Datum {
    Datum {
        value: Some(match ip {
            IpAddr::V4(a) => Value::Ipv4(a.octets().to_vec()),
            IpAddr::V6(a) => Value::Ipv6(a.octets().to_vec()),
        }),
    }
}

/// The address `bytes` hold (4 or 16 of them).
pub fn ip_of(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => <[u8; 4]>::try_from(bytes)
            .ok()
            .map(|b| Ipv4Addr::from(b).into()),
        16 => <[u8; 16]>::try_from(bytes)
            .ok()
            .map(|b| Ipv6Addr::from(b).into()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concatenations_pad_each_field_and_round_trip() {
        let fields = [
            DataType::Ipv4Addr,
            DataType::InetProto,
            DataType::InetService,
            DataType::Integer,
        ];
        assert_eq!(byte_len(&fields), 16);
        let datums = vec![
            ip_datum("10.96.0.10".parse().unwrap()),
            Datum {
                value: Some(Value::Proto(6)),
            },
            Datum {
                value: Some(Value::Port(80)),
            },
            Datum {
                value: Some(Value::U32(2)),
            },
        ];
        let bytes = encode(&fields, &datums).unwrap();
        assert_eq!(&bytes[..8], &[10, 96, 0, 10, 6, 0, 0, 0]);
        assert_eq!(&bytes[8..12], &[0, 80, 0, 0]);
        assert_eq!(decode(&fields, &bytes).unwrap(), datums);
        // A single field is not padded.
        assert_eq!(byte_len(&[DataType::InetService]), 2);
    }

    #[test]
    fn loads_zero_their_last_register_and_unknown_bytes_read_as_none() {
        let mut r = Registers::default();
        assert_eq!(r.read(0, 4), Ok(None));
        r.load(1, &[6], true).unwrap();
        assert_eq!(r.read(1, 4), Ok(Some(&[6u8, 0, 0, 0][..])));
        r.load(2, &[1, 2], false).unwrap();
        assert_eq!(r.read(1, 8), Ok(None));
        assert!(r.load(15, &[0; 8], true).is_err());
        assert!(r.read(16, 1).is_err());
    }
}
