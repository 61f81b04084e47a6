//! The digest of a ruleset, which brain and actuator compute the same way so that a resuming
//! actuator can prove what it holds. Tables, chains, sets and elements are sorted first, so the
//! digest does not depend on the order in which objects were produced.
use prost::Message;
use sha2::{Digest, Sha256};

use crate::v1::{Element, Ruleset};

/// Sorts a ruleset into its canonical order in place.
pub fn canonicalize(ruleset: &mut Ruleset) {
    ruleset
        .tables
        .sort_by(|a, b| (a.family, &a.name).cmp(&(b.family, &b.name)));
    for table in &mut ruleset.tables {
        table.chains.sort_by(|a, b| a.name.cmp(&b.name));
        table.sets.sort_by(|a, b| a.name.cmp(&b.name));
        for set in &mut table.sets {
            set.elements.sort_by_cached_key(element_key_bytes);
        }
    }
}

/// The bytes that identify an element within its set: its key and, for intervals, its end.
pub fn element_key_bytes(element: &Element) -> Vec<u8> {
    let mut k = Element {
        key: element.key.clone(),
        key_end: element.key_end.clone(),
        ..Default::default()
    }
    .encode_to_vec();
    k.shrink_to_fit();
    k
}

/// SHA-256 of the canonical protobuf encoding. `ruleset` must already be canonical.
pub fn digest(ruleset: &Ruleset) -> Vec<u8> {
    Sha256::digest(ruleset.encode_to_vec()).to_vec()
}
