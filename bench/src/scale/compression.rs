//! What zstd's level and the part size do to a cold start's bytes: the shared parts of a
//! snapshot, the bulk of what a brain sends every node that starts, compressed as the brain
//! compresses them (once per distinct part, kept only where it saves a quarter) at each level,
//! and decompressed as a node decompresses them.
//!
//! The brain pays the compression once for the whole fleet; every node pays the bytes through
//! TLS and TCP on both ends, and its own decompression. So a slower level can be worth it where
//! its time, once, is smaller than what the fleet saves: the figures here say by how much.
use std::time::{Duration, Instant};

use bytes::Bytes;
use prost::Message;
use splitproxy_proto::compress::{compress_part_at, decompress};
use splitproxy_proto::frames::encode_snapshot_parts;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::Update;

/// The levels weighed: zstd's fast end (the brain's) up to where its time grows steeply.
pub const LEVELS: [i32; 5] = [1, 3, 6, 9, 12];

/// One level's cost over one snapshot.
#[derive(Debug, Clone, Copy)]
pub struct LevelCost {
    pub part_elements: usize,
    pub level: i32,
    /// The snapshot's parts as encoded, and as sent (compressed where that pays).
    pub plain_bytes: usize,
    pub sent_bytes: usize,
    /// Compressing every part once (the brain, for the whole fleet).
    pub compress: Duration,
    /// Decompressing every compressed part (each node that starts).
    pub decompress: Duration,
}

impl LevelCost {
    pub fn ratio(&self) -> f64 {
        self.plain_bytes as f64 / self.sent_bytes.max(1) as f64
    }
}

/// The snapshot of `model` split at `part_elements` elements per part, at `level`.
pub fn measure(model: &Model, part_elements: usize, level: i32) -> anyhow::Result<LevelCost> {
    let parts = encode_snapshot_parts(model, part_elements);
    let plain_bytes = parts.iter().map(Bytes::len).sum();
    let t = Instant::now();
    let sent: Vec<Bytes> = parts
        .iter()
        .map(|p| compress_part_at(p, level).unwrap_or_else(|| p.clone()))
        .collect();
    let compress = t.elapsed();
    let sent_bytes = sent.iter().map(Bytes::len).sum();
    let t = Instant::now();
    for part in &sent {
        let update = Update::decode(&part[..])?;
        if !update.zstd.is_empty() {
            std::hint::black_box(decompress(&update.zstd, usize::MAX)?);
        }
    }
    Ok(LevelCost {
        part_elements,
        level,
        plain_bytes,
        sent_bytes,
        compress,
        decompress: t.elapsed(),
    })
}

/// One line per level and part size, as the scale mode prints them.
pub fn report(model: &Model, part_elements: &[usize], nodes: usize) -> anyhow::Result<()> {
    for &elements in part_elements {
        let base = measure(model, elements, LEVELS[0])?;
        for level in LEVELS {
            let c = if level == base.level {
                base
            } else {
                measure(model, elements, level)?
            };
            let saved = base.sent_bytes as f64 - c.sent_bytes as f64;
            println!(
                "compression: snapshot parts of {elements} elements at zstd level {level}: \
                 {} bytes sent of {} ({:.2}x), compressed once in {:?}, decompressed on a node \
                 in {:?}; against level {}: {:+.1} % bytes, {:+.1} MB for {nodes} nodes",
                c.sent_bytes,
                c.plain_bytes,
                c.ratio(),
                c.compress,
                c.decompress,
                base.level,
                -100.0 * saved / base.sent_bytes.max(1) as f64,
                -saved * nodes as f64 / 1e6,
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use splitproxy_proto::v1::update::Body;

    #[test]
    fn every_level_sends_fewer_bytes_than_the_plain_parts_and_decodes_back() {
        let w = crate::workload::Workload::new(300, 10, 4, &[]);
        let mut brain = crate::scale::brain::Brain::load(&w).unwrap();
        brain.rebuild(&w);
        let model = brain.model();
        for level in LEVELS {
            let c = measure(model, 256, level).unwrap();
            assert!(c.sent_bytes < c.plain_bytes, "level {level}: {c:?}");
        }
        // The bytes sent are the snapshot: decompressed, they join into the same model.
        let parts: Vec<Body> = encode_snapshot_parts(model, 256)
            .iter()
            .map(|p| {
                let mut u =
                    Update::decode(&compress_part_at(p, 9).unwrap_or(p.clone())[..]).unwrap();
                splitproxy_proto::compress::inflate(&mut u, usize::MAX).unwrap();
                u.body.unwrap()
            })
            .collect();
        let Body::Snapshot(joined) = splitproxy_proto::parts::join(parts).unwrap() else {
            panic!("not a snapshot");
        };
        assert_eq!(Model::from_ruleset(&joined).digest(), model.digest());
    }
}
