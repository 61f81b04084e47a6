//! Recent publications, so that a node may resume by the content it holds.
//!
//! A node that reconnects to another replica, or to a restarted brain, presents generations of
//! another epoch, which mean nothing here. What it holds is still known by its digest: replicas
//! that computed from the same API state published the same rulesets, with the same digests
//! (the shared/overlay split and the element encodings do not depend on the order events
//! arrived in; `brain/tests/replicas.rs`). So the brain keeps its last few publications, and a
//! node whose digest equals what it would have held at one of them resumes from that version
//! with a delta, or with nothing when that version is the current one (docs/protocol.md,
//! "Resumption").
//!
//! Publications are persistent models that share structure with their predecessors, so keeping
//! a few dozen of them costs what they changed, not their size. The exception is a rebuild (an
//! initial list, a relist, new service CIDRs): it builds every model anew and shares nothing
//! with what came before. The history therefore never keeps more than one publication from
//! before a rebuild, and none when the rebuild published the same content again, so it holds at
//! most two independent copies of the cluster ("bounded under slow nodes", docs/invariants.md).
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use splitproxy_proto::model::Model;

use crate::fanout::{Held, Publication};

/// Publications kept, the current one included.
pub const HISTORY_VERSIONS: usize = 32;

/// The last [`HISTORY_VERSIONS`] publications, oldest first.
#[derive(Default)]
pub struct History {
    recent: Mutex<VecDeque<Arc<Publication>>>,
}

impl History {
    /// Remembers a new publication (the newest).
    pub fn record(&self, publication: Arc<Publication>) {
        let Ok(mut recent) = self.recent.lock() else {
            return;
        };
        if let Some(last) = recent.back().cloned()
            && !same_lineage(&last.shared, &publication.shared)
        {
            // A rebuild: nothing is shared with what came before. Keep the last state only,
            // which is what nodes most likely hold, and not even that if it is the same.
            recent.clear();
            if !same_content(&last, &publication) {
                recent.push_back(last);
            }
        }
        recent.push_back(publication);
        while recent.len() > HISTORY_VERSIONS {
            recent.pop_front();
        }
    }

    /// What `node` held at the newest remembered version where its digest was `digest`.
    pub fn find(&self, node: &str, digest: &[u8]) -> Option<Held> {
        let recent = self.recent.lock().ok()?;
        recent
            .iter()
            .rev()
            .filter_map(|p| p.held(node))
            .find(|h| h.digest() == digest)
    }

    /// The versions remembered, oldest first.
    pub fn versions(&self) -> Vec<u64> {
        self.recent
            .lock()
            .map(|r| r.iter().map(|p| p.version).collect())
            .unwrap_or_default()
    }
}

/// Whether `b` was derived from `a` by changes, sharing its structure, rather than built anew:
/// some set keeps the very definition it had. Changes keep a set's definition (and its
/// allocation) unless they redefine the set; a rebuild allocates every one afresh.
fn same_lineage(a: &Model, b: &Model) -> bool {
    a.tables.iter().any(|(key, ta)| {
        b.tables.get(key).is_some_and(|tb| {
            ta.sets.iter().any(|(name, sa)| {
                tb.sets
                    .get(name)
                    .is_some_and(|sb| Arc::ptr_eq(&sa.def, &sb.def))
            })
        })
    })
}

/// Whether two publications give every node the same content.
fn same_content(a: &Publication, b: &Publication) -> bool {
    let overlay_digest = |p: &Publication, node: &str| {
        p.overlays
            .get(node)
            .map(|m| Model::default().digest_with(m))
    };
    a.shared.digest() == b.shared.digest()
        && a.overlays.len() == b.overlays.len()
        && a.overlays
            .keys()
            .all(|node| overlay_digest(a, node) == overlay_digest(b, node))
}

#[cfg(test)]
mod tests {
    use super::*;
    use splitproxy_proto::model::element_key_bytes;
    use splitproxy_proto::v1::{DataType, Datum, Element, Family, Ruleset, Set, Table, datum};

    fn element(i: u32) -> Element {
        Element {
            key: vec![Datum {
                value: Some(datum::Value::U32(i)),
            }],
            ..Element::default()
        }
    }

    /// A model built from scratch, as a rebuild does.
    fn built(elements: impl IntoIterator<Item = u32>) -> Model {
        Model::from_ruleset(&Ruleset {
            tables: vec![Table {
                family: Family::Ip as i32,
                name: "splitproxy".into(),
                sets: vec![Set {
                    name: "numbers".into(),
                    key: vec![DataType::Integer as i32],
                    elements: elements.into_iter().map(element).collect(),
                    ..Set::default()
                }],
                ..Table::default()
            }],
        })
    }

    /// `m` with one more element, as an incremental change does.
    fn changed(m: &Model, i: u32) -> Model {
        let mut m = m.clone();
        let e = element(i);
        let table = (Family::Ip, "splitproxy".to_string());
        m.insert_element(
            &table,
            "numbers",
            element_key_bytes(&e),
            prost::Message::encode_to_vec(&e).into_boxed_slice(),
        );
        m
    }

    fn publication(version: u64, shared: &Model, overlay: Option<&Model>) -> Arc<Publication> {
        Arc::new(Publication {
            version,
            shared: Arc::new(shared.clone()),
            overlays: overlay
                .map(|o| ("n1".to_string(), Arc::new(o.clone())))
                .into_iter()
                .collect(),
        })
    }

    #[test]
    fn finds_the_newest_version_with_the_nodes_digest() {
        let h = History::default();
        let overlay = built([100]);
        let mut m = built([1]);
        h.record(publication(1, &m, Some(&overlay)));
        let v1 = m.digest_with(&overlay);
        for v in 2..=5 {
            m = changed(&m, v as u32);
            h.record(publication(v, &m, Some(&overlay)));
        }
        assert_eq!(h.versions(), [1, 2, 3, 4, 5]);
        assert_eq!(h.find("n1", &v1).map(|held| held.version), Some(1));
        let v5 = m.digest_with(&overlay);
        assert_eq!(h.find("n1", &v5).map(|held| held.version), Some(5));
        // A node without an overlay holds the shared model alone.
        assert_eq!(h.find("n2", &m.digest()).map(|held| held.version), Some(5));
        assert!(h.find("n1", &m.digest()).is_none(), "n1 has its overlay");
        assert!(h.find("n1", &[0; 16]).is_none());
        assert!(h.find("n1", &[]).is_none());
    }

    #[test]
    fn keeps_a_bounded_number_of_versions() {
        let h = History::default();
        let mut m = built([0]);
        let first = m.digest();
        h.record(publication(1, &m, None));
        for v in 2..=100u64 {
            m = changed(&m, v as u32);
            h.record(publication(v, &m, None));
        }
        let versions = h.versions();
        assert_eq!(versions.len(), HISTORY_VERSIONS);
        assert_eq!(versions.last(), Some(&100));
        assert!(h.find("n1", &first).is_none(), "forgotten");
    }

    /// A rebuild shares nothing with what came before: the history keeps the last state before
    /// it, and not even that when the rebuild published the same content.
    #[test]
    fn a_rebuild_keeps_at_most_one_earlier_state() {
        let h = History::default();
        let mut m = built([1]);
        h.record(publication(1, &m, None));
        for v in 2..=4 {
            m = changed(&m, v as u32);
            h.record(publication(v, &m, None));
        }
        // Rebuilt with other content.
        let r = built([1, 2, 3, 4, 5]);
        h.record(publication(5, &r, None));
        assert_eq!(h.versions(), [4, 5]);
        assert_eq!(h.find("n1", &m.digest()).map(|x| x.version), Some(4));
        // Rebuilt with the same content: only the newest.
        h.record(publication(6, &built([1, 2, 3, 4, 5]), None));
        assert_eq!(h.versions(), [6]);
        assert_eq!(h.find("n1", &r.digest()).map(|x| x.version), Some(6));
        // Changes after it are kept again.
        let next = changed(&h.find("n1", &r.digest()).unwrap().shared, 9);
        h.record(publication(7, &next, None));
        assert_eq!(h.versions(), [6, 7]);
    }
}
