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
//!
//! A node placed in a window instead (another replica's state, crate::restate) needs only what
//! changed in each step since: that is kept for half a minute ([`steps`]), far longer than the
//! publications themselves.
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use splitproxy_proto::model::Model;

use crate::api_state::ApiState;
use crate::fanout::{Held, Publication};

pub mod steps;

use steps::{Step, StepLog};

/// Publications kept, the current one included.
pub const HISTORY_VERSIONS: usize = 32;

/// The last [`HISTORY_VERSIONS`] publications, oldest first, and the last half minute's steps.
#[derive(Default)]
pub struct History {
    recent: Mutex<VecDeque<Arc<Publication>>>,
    steps: Mutex<StepLog>,
}

impl History {
    /// Remembers a new publication (the newest).
    pub fn record(&self, publication: Arc<Publication>) {
        let derived = self.record_recent(publication.clone());
        if let Ok(mut steps) = self.steps.lock() {
            steps.record(derived.as_deref(), &publication);
        }
    }

    /// Keeps `publication` among the recent ones; the one before it, unless `publication` is a
    /// rebuild (which shares nothing with it, so no step between them can be taken).
    fn record_recent(&self, publication: Arc<Publication>) -> Option<Arc<Publication>> {
        let Ok(mut recent) = self.recent.lock() else {
            return None;
        };
        let mut last = recent.back().cloned();
        if let Some(before) = last.take_if(|l| !same_lineage(&l.shared, &publication.shared)) {
            // A rebuild: nothing is shared with what came before. Keep the last state only,
            // which is what nodes most likely hold, and not even that if it is the same.
            recent.clear();
            if !same_content(&before, &publication) {
                recent.push_back(before);
            }
        }
        recent.push_back(publication);
        while recent.len() > HISTORY_VERSIONS {
            recent.pop_front();
        }
        last
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

    /// Where a node that holds a state this brain never published stands: the newest
    /// remembered publication made from API state that `api` (the state the node's ruleset was
    /// computed from, by another replica) covers, by version. Every event folded in there is
    /// folded in the node's state too, so what the node holds differs from that publication only
    /// in objects that changed after it (crate::restate). Searched in the step log, which
    /// reaches further back than the publications. `None` when no such publication is
    /// remembered, or `api` names nothing.
    pub fn window_start(&self, api: &ApiState) -> Option<u64> {
        self.steps.lock().ok()?.window_start(api)
    }

    /// The steps after version `from` up to `to`, in order: what a restating delta over that
    /// window restates. `None` unless every one of them is remembered and each was derived from
    /// the one before (a rebuild in between shares nothing, and restating it would cost a
    /// snapshot).
    pub fn steps(&self, from: u64, to: u64) -> Option<Vec<Arc<Step>>> {
        self.steps.lock().ok()?.between(from, to)
    }

    /// The versions the step log remembers, oldest first.
    pub fn step_versions(&self) -> Vec<u64> {
        self.steps.lock().map(|s| s.versions()).unwrap_or_default()
    }

    /// How many objects the step log names ([`steps::STEP_LOG_OBJECTS`] at most).
    pub fn step_objects(&self) -> usize {
        self.steps.lock().map(|s| s.objects()).unwrap_or_default()
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
        at(version, shared, overlay, [version, 0, 0, 0])
    }

    fn at(
        version: u64,
        shared: &Model,
        overlay: Option<&Model>,
        api: [u64; 4],
    ) -> Arc<Publication> {
        Arc::new(Publication {
            version,
            shared: Arc::new(shared.clone()),
            overlays: overlay
                .map(|o| ("n1".to_string(), Arc::new(o.clone())))
                .into_iter()
                .collect(),
            api: ApiState::from_wire(&api).unwrap(),
        })
    }

    #[test]
    fn a_window_starts_at_the_newest_publication_the_nodes_api_state_covers() {
        let h = History::default();
        let mut m = built([1]);
        // Services at 10; slices at 20, 25, 31, 40.
        for (v, slices) in [(1, 20), (2, 25), (3, 31), (4, 40)] {
            m = changed(&m, v as u32 + 10);
            h.record(at(v, &m, None, [10, slices, 5, 0]));
        }
        let start = |api: [u64; 4]| h.window_start(&ApiState::from_wire(&api).unwrap());
        // Another replica published after slice event 28: between versions 2 and 3.
        assert_eq!(start([10, 28, 5, 0]), Some(2));
        assert_eq!(start([10, 31, 5, 0]), Some(3));
        assert_eq!(start([10, 99, 5, 0]), Some(4));
        // Behind this brain on services: nothing here is covered.
        assert_eq!(start([9, 99, 5, 0]), None);
        // Before every remembered publication, or naming nothing.
        assert_eq!(start([10, 19, 5, 0]), None);
        assert_eq!(start([0, 0, 0, 0]), None);
    }

    fn step_versions(s: Option<Vec<Arc<Step>>>) -> Option<Vec<u64>> {
        s.map(|s| s.iter().map(|p| p.version).collect())
    }

    #[test]
    fn steps_are_consecutive_derived_publications() {
        let h = History::default();
        let mut m = built([1]);
        h.record(publication(1, &m, None));
        for v in 2..=4 {
            m = changed(&m, v as u32);
            h.record(publication(v, &m, None));
        }
        assert_eq!(step_versions(h.steps(2, 4)), Some(vec![3, 4]));
        assert_eq!(step_versions(h.steps(4, 4)), Some(vec![]));
        assert_eq!(step_versions(h.steps(2, 9)), None, "not published yet");
        assert_eq!(step_versions(h.steps(0, 4)), None, "not remembered");
        // A rebuild in between shares nothing: no steps across it, and windows start again.
        h.record(publication(5, &built([1, 2, 3, 4, 5, 6]), None));
        assert_eq!(step_versions(h.steps(4, 5)), None);
        assert_eq!(h.step_versions(), [5]);
    }

    /// The step log reaches back further than the publications: a node placed at a version
    /// the history no longer holds is restated over every step since.
    #[test]
    fn steps_outlive_the_publications() {
        let h = History::default();
        let mut m = built([0]);
        h.record(at(1, &m, None, [1, 0, 0, 0]));
        for v in 2..=100u64 {
            m = changed(&m, v as u32);
            h.record(at(v, &m, None, [v, 0, 0, 0]));
        }
        assert_eq!(h.versions().len(), HISTORY_VERSIONS);
        assert_eq!(h.step_versions(), (1..=100).collect::<Vec<_>>());
        // Another replica's state, after Service event 5.
        let start = h.window_start(&ApiState::from_wire(&[5, 0, 0, 0]).unwrap());
        assert_eq!(start, Some(5));
        let steps = h.steps(5, 100).expect("remembered");
        assert_eq!(steps.len(), 95);
        let mut touched = crate::restate::Touched::default();
        for s in &steps {
            assert_eq!(s.shared.len(), 1, "one element added in step {}", s.version);
            touched.extend(&s.shared);
        }
        assert_eq!(touched.len(), 95);
    }

    #[test]
    fn the_step_log_is_bounded() {
        let h = History::default();
        let mut m = built([0]);
        h.record(publication(1, &m, None));
        let last = steps::STEP_LOG_VERSIONS as u64 + 10;
        for v in 2..=last {
            m = changed(&m, v as u32);
            h.record(publication(v, &m, None));
        }
        let versions = h.step_versions();
        assert_eq!(versions.len(), steps::STEP_LOG_VERSIONS);
        assert_eq!(versions.last(), Some(&last));
        // A mass change names more objects than the log keeps: it is all that is left.
        let mut big = m.clone();
        for i in 0..steps::STEP_LOG_OBJECTS as u32 + 1 {
            big = changed(&big, 1_000_000 + i);
        }
        h.record(publication(last + 1, &big, None));
        assert_eq!(h.step_versions(), [last + 1]);
    }

    /// Only the nodes whose own elements changed are named in a step, with those elements.
    #[test]
    fn a_step_names_the_nodes_whose_overlay_changed() {
        let h = History::default();
        let m = built([1]);
        let n1 = Arc::new(built([100]));
        let n2 = Arc::new(built([200]));
        let overlays = |n1: &Arc<Model>, n2: &Arc<Model>| -> crate::overlay::NodeOverlays {
            [
                ("n1".to_string(), n1.clone()),
                ("n2".to_string(), n2.clone()),
            ]
            .into_iter()
            .collect()
        };
        let publish = |version: u64, shared: &Model, overlays| {
            h.record(Arc::new(Publication {
                version,
                shared: Arc::new(shared.clone()),
                overlays,
                api: ApiState::from_wire(&[version, 0, 0, 0]).unwrap(),
            }))
        };
        publish(1, &m, overlays(&n1, &n2));
        let n2b = Arc::new(changed(&n2, 201));
        publish(2, &changed(&m, 2), overlays(&n1, &n2b));
        let steps = h.steps(1, 2).unwrap();
        assert_eq!(steps[0].overlays.len(), 1);
        assert_eq!(steps[0].overlays["n2"].len(), 1);
        // A node gone: every element it had.
        let mut only_n1 = overlays(&n1, &n2b);
        only_n1.remove("n2");
        publish(3, &changed(&m, 3), only_n1);
        let steps = h.steps(2, 3).unwrap();
        assert_eq!(steps[0].overlays["n2"].len(), 2);
        assert!(!steps[0].overlays.contains_key("n1"));
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
