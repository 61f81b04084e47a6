//! Layout of set keys and map data: which bytes a list of typed fields occupies.
//!
//! A concatenation is laid out the way registers hold it: each field starts a new 32-bit
//! register, so every field is padded to 4 bytes (ipv4 4, ipv6 16, inet_proto 1+3,
//! inet_service 2+2, integer/mark 4). A single field is not padded, as `nft` does it (a set of
//! `inet_service` has a 2-byte key), so that the kernel and `nft list` agree on the key length.
//!
//! Byte order: addresses, protocols and ports are in network order, as the packet carries them.
//! integer and mark are in host order, as the kernel's meta, ct and numgen expressions write
//! them into registers; a map key holding a numgen result must match those bytes.

use splitproxy_proto::v1::{DataType, Datum, datum::Value};

use super::consts::{BYTEORDER_BIG_ENDIAN, BYTEORDER_HOST_ENDIAN, NFT_REG32_COUNT, TYPE_BITS};
use super::error::type_name;
use crate::netlink::attr::align4;

/// Unpadded length in bytes of one field of type `t`; `None` for types that are not values.
pub(crate) fn field_len(t: DataType) -> Option<usize> {
    match t {
        DataType::Ipv4Addr | DataType::Integer | DataType::Mark => Some(4),
        DataType::Ipv6Addr => Some(16),
        DataType::InetProto => Some(1),
        DataType::InetService => Some(2),
        DataType::Verdict | DataType::Unspecified => None,
    }
}

/// A validated list of value fields: a set key, or the data of a data map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fields(Vec<DataType>);

impl Fields {
    /// Checks the raw protobuf enum values: 1 to 5 value types. nft packs a concatenation's
    /// type id in 6 bits per field, so a u32 holds at most 5 fields.
    pub(crate) fn new(raw: &[i32]) -> Result<Self, String> {
        if raw.is_empty() {
            return Err("no fields".to_owned());
        }
        if raw.len() > 5 {
            return Err(format!("{} fields, at most 5 are supported", raw.len()));
        }
        let mut fields = Vec::with_capacity(raw.len());
        for &v in raw {
            let t = DataType::try_from(v).map_err(|_| format!("unknown data type {v}"))?;
            if field_len(t).is_none() {
                return Err(format!("{} is not a value type here", type_name(t)));
            }
            fields.push(t);
        }
        let f = Self(fields);
        if f.byte_len() > NFT_REG32_COUNT as usize * 4 {
            return Err("longer than the 16 registers".to_owned());
        }
        Ok(f)
    }

    pub(crate) fn is_concat(&self) -> bool {
        self.0.len() > 1
    }

    fn slot_len(&self, t: DataType) -> usize {
        let len = field_len(t).unwrap_or(0);
        if self.is_concat() { align4(len) } else { len }
    }

    /// NFTA_SET_KEY_LEN / NFTA_SET_DATA_LEN.
    pub(crate) fn byte_len(&self) -> usize {
        self.0.iter().map(|t| self.slot_len(*t)).sum()
    }

    /// NFTA_SET_KEY_TYPE / NFTA_SET_DATA_TYPE: nft's type id, folded for concatenations as
    /// nft's `concat_type_alloc` does (first field in the highest bits).
    ///
    /// The kernel ignores it; `nft list` uses it to print elements. nft's `integer` has no
    /// size, and inside a concatenation `nft list ruleset` (1.0.6) aborts on it
    /// (`concat_expr_msort_value: Assertion 'ilen > 0'`). A 32-bit host-order integer is byte
    /// for byte a `mark`, so inside concatenations it is announced as one.
    pub(crate) fn type_id(&self) -> u32 {
        let concat = self.is_concat();
        self.0.iter().fold(0, |acc, t| {
            let id = match t {
                DataType::Integer if concat => DataType::Mark,
                t => *t,
            };
            (acc << TYPE_BITS) | id as u32
        })
    }

    /// Unpadded field lengths, for NFTA_SET_DESC_CONCAT.
    pub(crate) fn field_lens(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().map(|t| field_len(*t).unwrap_or(0) as u32)
    }

    /// nft's byte order hint for the key or data (set userdata), which `nft list` needs to
    /// print plain integer keys right.
    pub(crate) fn byteorder(&self) -> u32 {
        match self.0.as_slice() {
            [DataType::Integer | DataType::Mark] => BYTEORDER_HOST_ENDIAN,
            _ => BYTEORDER_BIG_ENDIAN,
        }
    }

    /// Appends the bytes of `datums` laid out for these fields.
    pub(crate) fn encode(&self, datums: &[Datum], out: &mut Vec<u8>) -> Result<(), String> {
        self.encode_from(0, datums, out)
    }

    /// Number of fields.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Byte offset of field `field` (the byte length when `field` is the number of fields).
    pub(crate) fn offset(&self, field: usize) -> usize {
        self.0.iter().take(field).map(|t| self.slot_len(*t)).sum()
    }

    /// Appends the bytes of the fields from `first` on, laid out as in the whole key (so that
    /// they equal `encode`'s bytes from [`Fields::offset`]`(first)` on), for `datums`, the values
    /// of those fields only.
    pub(crate) fn encode_from(
        &self,
        first: usize,
        datums: &[Datum],
        out: &mut Vec<u8>,
    ) -> Result<(), String> {
        let fields = self.0.get(first..).unwrap_or_default();
        if datums.len() != fields.len() {
            return Err(format!(
                "{} values for {} fields",
                datums.len(),
                fields.len()
            ));
        }
        for (i, (t, d)) in fields.iter().zip(datums).enumerate() {
            let start = out.len();
            encode_field(*t, d, out).map_err(|why| format!("field {}: {why}", first + i))?;
            out.resize(start + self.slot_len(*t), 0);
        }
        Ok(())
    }

    /// For single-field interval sets, whose ranges the kernel stores as [start, end + 1):
    /// turns `bytes` (one encoded field) into the next value. `false` when `bytes` is the
    /// largest value, which has no successor.
    pub(crate) fn increment(&self, bytes: &mut [u8]) -> bool {
        match self.0.as_slice() {
            [DataType::Integer | DataType::Mark] => {
                let Ok(raw) = <[u8; 4]>::try_from(&*bytes) else {
                    return false;
                };
                match u32::from_ne_bytes(raw).checked_add(1) {
                    Some(next) => {
                        bytes.copy_from_slice(&next.to_ne_bytes());
                        true
                    }
                    None => false,
                }
            }
            _ => {
                for b in bytes.iter_mut().rev() {
                    let (v, carry) = b.overflowing_add(1);
                    *b = v;
                    if !carry {
                        return true;
                    }
                }
                false
            }
        }
    }

    /// The inverse of [`Fields::increment`]: the value before `bytes`; `false` at zero.
    pub(crate) fn decrement(&self, bytes: &mut [u8]) -> bool {
        match self.0.as_slice() {
            [DataType::Integer | DataType::Mark] => {
                let Ok(raw) = <[u8; 4]>::try_from(&*bytes) else {
                    return false;
                };
                match u32::from_ne_bytes(raw).checked_sub(1) {
                    Some(prev) => {
                        bytes.copy_from_slice(&prev.to_ne_bytes());
                        true
                    }
                    None => false,
                }
            }
            _ => {
                if bytes.iter().all(|b| *b == 0) {
                    return false;
                }
                for b in bytes.iter_mut().rev() {
                    let (v, borrow) = b.overflowing_sub(1);
                    *b = v;
                    if !borrow {
                        break;
                    }
                }
                true
            }
        }
    }

    /// Reads encoded bytes back into data: the inverse of [`Fields::encode`]. `None` when
    /// `bytes` is not exactly this layout's length.
    pub(crate) fn decode(&self, bytes: &[u8]) -> Option<Vec<Datum>> {
        if bytes.len() != self.byte_len() {
            return None;
        }
        let mut rest = bytes;
        let mut out = Vec::with_capacity(self.0.len());
        for t in &self.0 {
            let f = rest.get(..field_len(*t)?)?;
            let value = match t {
                DataType::Ipv4Addr => Value::Ipv4(f.to_vec()),
                DataType::Ipv6Addr => Value::Ipv6(f.to_vec()),
                DataType::InetProto => Value::Proto(u32::from(*f.first()?)),
                DataType::InetService => {
                    Value::Port(u32::from(u16::from_be_bytes(f.try_into().ok()?)))
                }
                _ => Value::U32(u32::from_ne_bytes(f.try_into().ok()?)),
            };
            out.push(Datum { value: Some(value) });
            rest = rest.get(self.slot_len(*t)..)?;
        }
        Some(out)
    }

    /// `bytes` (one encoded key) as a big-endian number, so that byte order is numeric order:
    /// for sorting the entries of a single-field interval set as the kernel dumped them.
    pub(crate) fn order_key(&self, bytes: &[u8]) -> Vec<u8> {
        match self.0.as_slice() {
            [DataType::Integer | DataType::Mark] => match <[u8; 4]>::try_from(bytes) {
                Ok(raw) => u32::from_ne_bytes(raw).to_be_bytes().to_vec(),
                Err(_) => bytes.to_vec(),
            },
            _ => bytes.to_vec(),
        }
    }

    /// The raw protobuf values of the fields (the inverse of [`Fields::new`]).
    pub(crate) fn raw(&self) -> Vec<i32> {
        self.0.iter().map(|t| *t as i32).collect()
    }
}

fn encode_field(t: DataType, d: &Datum, out: &mut Vec<u8>) -> Result<(), String> {
    match (t, &d.value) {
        (DataType::Ipv4Addr, Some(Value::Ipv4(a))) if a.len() == 4 => out.extend_from_slice(a),
        (DataType::Ipv6Addr, Some(Value::Ipv6(a))) if a.len() == 16 => out.extend_from_slice(a),
        (DataType::InetProto, Some(Value::Proto(p))) => {
            let p = u8::try_from(*p).map_err(|_| format!("protocol {p} > 255"))?;
            out.push(p);
        }
        (DataType::InetService, Some(Value::Port(p))) => {
            let p = u16::try_from(*p).map_err(|_| format!("port {p} > 65535"))?;
            out.extend_from_slice(&p.to_be_bytes());
        }
        (DataType::Integer | DataType::Mark, Some(Value::U32(v))) => {
            out.extend_from_slice(&v.to_ne_bytes());
        }
        (t, v) => return Err(format!("{} expected, got {}", type_name(t), describe(v))),
    }
    Ok(())
}

fn describe(v: &Option<Value>) -> String {
    match v {
        None => "nothing".to_owned(),
        Some(Value::Ipv4(a)) => format!("ipv4 of {} bytes", a.len()),
        Some(Value::Ipv6(a)) => format!("ipv6 of {} bytes", a.len()),
        Some(Value::Proto(_)) => "proto".to_owned(),
        Some(Value::Port(_)) => "port".to_owned(),
        Some(Value::U32(_)) => "u32".to_owned(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn ip4(a: [u8; 4]) -> Datum {
        Datum {
            value: Some(Value::Ipv4(a.to_vec())),
        }
    }
    pub(crate) fn proto(p: u32) -> Datum {
        Datum {
            value: Some(Value::Proto(p)),
        }
    }
    pub(crate) fn port(p: u32) -> Datum {
        Datum {
            value: Some(Value::Port(p)),
        }
    }
    pub(crate) fn int(v: u32) -> Datum {
        Datum {
            value: Some(Value::U32(v)),
        }
    }

    fn fields(t: &[DataType]) -> Fields {
        Fields::new(&t.iter().map(|t| *t as i32).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn concatenation_pads_every_field_to_a_register() {
        use DataType::*;
        let f = fields(&[Ipv4Addr, InetProto, InetService, Integer]);
        assert_eq!(f.byte_len(), 16);
        assert_eq!(f.field_lens().collect::<Vec<_>>(), vec![4, 1, 2, 4]);
        // integer is announced as mark inside a concatenation (see type_id).
        assert_eq!(f.type_id(), (((7 << 6 | 12) << 6 | 13) << 6) | 19);
        let key = [ip4([10, 0, 0, 1]), proto(6), port(80), int(3)];
        let mut out = Vec::new();
        f.encode(&key, &mut out).unwrap();
        let mut want = vec![10, 0, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0];
        want.extend_from_slice(&3u32.to_ne_bytes());
        assert_eq!(out, want);
        assert_eq!(f.decode(&out).unwrap(), key);
    }

    #[test]
    fn a_key_without_its_first_fields_keeps_the_whole_keys_layout() {
        use DataType::*;
        let f = fields(&[Ipv4Addr, Ipv4Addr, InetProto, InetService]);
        assert_eq!(
            (f.len(), f.offset(0), f.offset(1), f.offset(4)),
            (4, 0, 4, 16)
        );
        let key = [ip4([10, 0, 0, 1]), ip4([10, 96, 0, 1]), proto(17), port(53)];
        let mut whole = Vec::new();
        f.encode(&key, &mut whole).unwrap();
        let mut tail = Vec::new();
        f.encode_from(1, &key[1..], &mut tail).unwrap();
        assert_eq!(tail, whole[f.offset(1)..]);
        assert_eq!(tail, vec![10, 96, 0, 1, 17, 0, 0, 0, 0, 53, 0, 0]);
        // Even when one field is left (a lone field would not be padded).
        let mut last = Vec::new();
        f.encode_from(3, &key[3..], &mut last).unwrap();
        assert_eq!(last, vec![0, 53, 0, 0]);
        assert!(f.encode_from(1, &key, &mut Vec::new()).is_err());
    }

    #[test]
    fn single_fields_are_not_padded() {
        let f = fields(&[DataType::InetService]);
        assert_eq!(f.byte_len(), 2);
        let mut out = Vec::new();
        f.encode(&[port(443)], &mut out).unwrap();
        assert_eq!(out, vec![1, 187]);
        assert_eq!(f.byteorder(), BYTEORDER_BIG_ENDIAN);
        assert_eq!(
            fields(&[DataType::Integer]).byteorder(),
            BYTEORDER_HOST_ENDIAN
        );
    }

    #[test]
    fn mismatched_values_are_refused() {
        let f = fields(&[DataType::Ipv4Addr, DataType::InetService]);
        let mut out = Vec::new();
        assert!(f.encode(&[ip4([1, 2, 3, 4])], &mut out).is_err());
        assert!(f.encode(&[ip4([1, 2, 3, 4]), proto(6)], &mut out).is_err());
        assert!(
            f.encode(&[ip4([1, 2, 3, 4]), port(70000)], &mut out)
                .is_err()
        );
        assert!(Fields::new(&[DataType::Verdict as i32]).is_err());
        assert!(Fields::new(&[]).is_err());
        assert!(Fields::new(&[99]).is_err());
    }

    #[test]
    fn increment_carries_and_detects_the_maximum() {
        let f = fields(&[DataType::Ipv4Addr]);
        let mut b = [10, 0, 0, 255];
        assert!(f.increment(&mut b));
        assert_eq!(b, [10, 0, 1, 0]);
        let mut max = [255; 4];
        assert!(!f.increment(&mut max));
        let g = fields(&[DataType::Mark]);
        let mut m = 7u32.to_ne_bytes();
        assert!(g.increment(&mut m));
        assert_eq!(m, 8u32.to_ne_bytes());
    }
}
