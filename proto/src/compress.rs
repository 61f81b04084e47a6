//! Update parts compressed once for the whole fleet (`Update.zstd`).
//!
//! A snapshot of 10,000 Services is megabytes, and a brain sends it to every node that starts:
//! at 5,000 nodes that is tens of gigabytes through TLS and TCP. The shared parts of an update
//! are encoded once ([`crate::frames`]); compressing those bytes once too makes every node's
//! transfer smaller for the cost of one compression per distinct part, where gRPC's own
//! per-message compression would compress the same bytes again for every stream. A part is
//! sent compressed only to nodes that said in their Hello that they read zstd
//! (`Hello.encodings`), and only when compression saves enough to be worth the node's
//! decompression.
use bytes::Bytes;
use prost::Message;

use crate::v1::Update;

/// The encoding's name in `Hello.encodings`.
pub const ZSTD: &str = "zstd";

/// Parts smaller than this are sent as they are: a few hundred bytes gain nothing worth a
/// decompression on the node.
pub const MIN_COMPRESSED_PART: usize = 4096;

/// zstd's level: the fast end. Parts are compressed once per distinct update, on the brain's
/// publication path, so speed matters more than the last percent of ratio.
const LEVEL: i32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum CompressError {
    #[error("compressed update part does not decompress within {limit} bytes: {source}")]
    Decompress {
        limit: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("decompressed update part does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("compressed update part names another compressed part")]
    Nested,
    #[error("compressed update part does not say its size, or says more than {limit} bytes")]
    Size { limit: usize },
}

/// `encoded` (fields of an `Update`) as an `Update` carrying them compressed, when that is
/// at most 3/4 of the size; `None` when it is small or does not compress.
pub fn compress_part(encoded: &[u8]) -> Option<Bytes> {
    compress_part_at(encoded, LEVEL)
}

/// [`compress_part`] at another zstd level (the scale benchmark weighs the levels).
pub fn compress_part_at(encoded: &[u8], level: i32) -> Option<Bytes> {
    if encoded.len() < MIN_COMPRESSED_PART {
        return None;
    }
    let compressed = zstd::bulk::compress(encoded, level).ok()?;
    if compressed.len() * 4 > encoded.len() * 3 {
        return None;
    }
    Some(Bytes::from(
        Update {
            zstd: compressed,
            ..Default::default()
        }
        .encode_to_vec(),
    ))
}

/// The encoded fields inside `Update.zstd`, at most `limit` bytes. The brain's frames say their
/// size ([`compress_part`] compresses in one go); the buffer is allocated for exactly that,
/// never for the limit.
pub fn decompress(compressed: &[u8], limit: usize) -> Result<Vec<u8>, CompressError> {
    let size = match zstd::zstd_safe::get_frame_content_size(compressed) {
        Ok(Some(n)) if n <= limit as u64 => n as usize,
        _ => return Err(CompressError::Size { limit }),
    };
    zstd::bulk::decompress(compressed, size)
        .map_err(|source| CompressError::Decompress { limit, source })
}

/// Decodes `update.zstd`, if any, into `update` itself, as if the decompressed fields had been
/// sent in its place; at most `limit` bytes once decompressed (a broken or hostile peer cannot
/// make the node allocate more than the largest message it accepts anyway).
pub fn inflate(update: &mut Update, limit: usize) -> Result<(), CompressError> {
    if update.zstd.is_empty() {
        return Ok(());
    }
    let compressed = std::mem::take(&mut update.zstd);
    let plain = decompress(&compressed, limit)?;
    update.merge(plain.as_slice())?;
    if !update.zstd.is_empty() {
        return Err(CompressError::Nested);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{RulesetDelta, Set, SetElements, Table, TableRemoval, update::Body};

    fn big_delta() -> Update {
        let elements = (0..2000u32)
            .map(|i| crate::v1::Element {
                key: vec![crate::v1::Datum {
                    value: Some(crate::v1::datum::Value::Ipv4(vec![
                        10,
                        (i >> 16) as u8,
                        (i >> 8) as u8,
                        i as u8,
                    ])),
                }],
                ..Default::default()
            })
            .collect();
        Update {
            body: Some(Body::Delta(RulesetDelta {
                upsert: vec![Table {
                    name: "splitproxy".into(),
                    sets: vec![Set {
                        name: "cluster-ips".into(),
                        elements,
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                remove: vec![TableRemoval {
                    name: "splitproxy".into(),
                    elements: vec![SetElements {
                        set: "cluster-ips".into(),
                        elements: vec![],
                    }],
                    ..Default::default()
                }],
            })),
            more: true,
            ..Default::default()
        }
    }

    #[test]
    fn a_compressed_part_decodes_to_the_same_update_with_the_nodes_fields() {
        let part = big_delta();
        let encoded = part.encode_to_vec();
        let compressed = compress_part(&encoded).expect("large and repetitive: compressed");
        assert!(
            compressed.len() < encoded.len() / 2,
            "{} of {}",
            compressed.len(),
            encoded.len()
        );
        // The per-node header fields are written beside the compressed bytes (frames.rs).
        let mut wire = Update {
            brain_epoch: 7,
            generation: 3,
            ..Default::default()
        }
        .encode_to_vec();
        wire.extend_from_slice(&compressed);
        let mut got = Update::decode(wire.as_slice()).unwrap();
        assert!(!got.zstd.is_empty());
        inflate(&mut got, 1 << 30).unwrap();
        assert_eq!(
            got,
            Update {
                brain_epoch: 7,
                generation: 3,
                ..part
            }
        );
    }

    #[test]
    fn small_or_incompressible_parts_stay_plain() {
        assert!(compress_part(&[1u8; 100]).is_none());
        // xorshift64: bytes zstd cannot shrink.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let noise: Vec<u8> = (0..8192)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert!(compress_part(&noise).is_none());
    }

    #[test]
    fn decompression_is_bounded() {
        let encoded = big_delta().encode_to_vec();
        let mut u = Update::decode(compress_part(&encoded).unwrap()).unwrap();
        let err = inflate(&mut u, 1024).unwrap_err();
        assert!(matches!(err, CompressError::Size { limit: 1024 }), "{err}");
    }

    #[test]
    fn a_part_that_decompresses_into_another_compressed_part_is_refused() {
        let inner = compress_part(&big_delta().encode_to_vec()).unwrap();
        let mut padded = inner.to_vec();
        // Make it large enough to be compressed again.
        padded.extend(
            Update {
                objects: vec!["x".repeat(8192)],
                ..Default::default()
            }
            .encode_to_vec(),
        );
        let mut u = Update::decode(compress_part(&padded).unwrap()).unwrap();
        assert!(matches!(
            inflate(&mut u, 1 << 30),
            Err(CompressError::Nested)
        ));
    }
}
