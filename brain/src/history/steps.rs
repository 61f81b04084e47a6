//! What each recent publication changed, remembered for longer than the publications.
//!
//! A restating delta (crate::restate) needs two things of the window a node is placed in: the
//! API state of the publication it starts at, and which objects changed in each step from there
//! to the latest publication. It needs no older ruleset: every object it names is restated with
//! its value in the latest one. Keeping whole publications costs what their changes copied of
//! the persistent maps (about 100 KiB per one-Service change at 10,000 Services and 5,000 nodes,
//! `history_memory` example), so the history keeps only [`super::HISTORY_VERSIONS`] of them:
//! 6.4 s at the brain's fastest publication pace (one per 200 ms), which churn spread over each
//! second reaches. A failover at 10,000 nodes takes longer than that to reach its last nodes,
//! and those were placed nowhere and got a snapshot (418 of 5,000 in
//! bench/results/failover-spread/nodes-10000, whose moved nodes were back in sync up to 9.9 s
//! after the kill, most after 8 s). A step's record is the names of what changed, up to about
//! 4 KiB per changed Service (every endpoint replaced), so the log keeps half a minute of them.
//!
//! Steps are taken between consecutive publications of one lineage; a rebuild (a relist, new
//! service CIDRs) shares nothing with what came before and is not diffed: the log starts again
//! at it.
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use splitproxy_proto::model::Model;

use crate::api_state::ApiState;
use crate::fanout::Publication;
use crate::restate::{CompactTouched, Touched};

/// How long a step is kept: longer than the slowest failover measured (13 s for 5,000 nodes
/// moving at 10,000 nodes, bench/SCALING.md), with room.
pub const STEP_LOG_AGE: Duration = Duration::from_secs(30);
/// At most this many steps (30 s at the default 200 ms between publications is 150).
pub const STEP_LOG_VERSIONS: usize = 1024;
/// At most this many objects named over all steps. Each costs about 120 bytes of heap, kept
/// flat ([`CompactTouched`]; `history_memory` example: 24,988 objects after 807 one-Service
/// changes at 10,000 Services and 5,000 nodes, 2.9 MiB), so the log stays near 3 MiB at most:
/// a mass change (every Deployment rolled at once) shortens the log instead of growing the
/// brain.
pub const STEP_LOG_OBJECTS: usize = 25_000;

/// One publication, as far as restating needs it.
pub struct Step {
    pub version: u64,
    /// The API state it was computed from.
    pub api: ApiState,
    /// What changed in the shared model since the publication before; nothing for the first
    /// of a lineage, which windows may start at but not cross.
    pub shared: CompactTouched,
    /// The nodes whose own elements changed since the publication before, and which.
    pub overlays: HashMap<String, CompactTouched>,
    objects: usize,
    at: Instant,
}

/// The recent steps, oldest first; all after the first are derived from the one before.
#[derive(Default)]
pub struct StepLog {
    steps: VecDeque<Arc<Step>>,
    objects: usize,
}

impl StepLog {
    /// Records `publication`; `previous` is the publication before it when it was derived
    /// from it (same lineage), `None` after a rebuild. A step is taken only from the version
    /// just before, and the log starts again otherwise.
    pub fn record(&mut self, previous: Option<&Publication>, publication: &Publication) {
        let now = Instant::now();
        let mut step = Step {
            version: publication.version,
            api: publication.api,
            shared: CompactTouched::default(),
            overlays: HashMap::new(),
            objects: 0,
            at: now,
        };
        let derived = previous.filter(|p| {
            self.steps
                .back()
                .is_some_and(|last| last.version == p.version)
                && publication.version == p.version + 1
        });
        match derived {
            Some(previous) => {
                let mut shared = Touched::default();
                shared.shared_step(&previous.shared, &publication.shared);
                step.shared = shared.compact();
                step.overlays = overlay_steps(previous, publication);
            }
            None => {
                self.steps.clear();
                self.objects = 0;
            }
        }
        step.objects = step.shared.len()
            + step
                .overlays
                .values()
                .map(CompactTouched::len)
                .sum::<usize>();
        self.objects += step.objects;
        self.steps.push_back(Arc::new(step));
        while self.steps.len() > 1
            && (self.steps.len() > STEP_LOG_VERSIONS
                || self.objects > STEP_LOG_OBJECTS
                || self
                    .steps
                    .front()
                    .is_some_and(|s| now - s.at > STEP_LOG_AGE))
        {
            if let Some(gone) = self.steps.pop_front() {
                self.objects -= gone.objects;
            }
        }
    }

    /// The newest step whose API state `api` covers: where a node holding a state computed
    /// from `api` stands (see [`super::History::window_start`]).
    pub fn window_start(&self, api: &ApiState) -> Option<u64> {
        if !api.known() {
            return None;
        }
        self.steps
            .iter()
            .rev()
            .find(|s| api.covers(&s.api))
            .map(|s| s.version)
    }

    /// The steps after version `from` up to `to`, in order: `None` unless `from` and every
    /// step to `to` are remembered (each is derived from the one before).
    pub fn between(&self, from: u64, to: u64) -> Option<Vec<Arc<Step>>> {
        let first = self.steps.iter().position(|s| s.version == from)?;
        let steps: Vec<Arc<Step>> = self
            .steps
            .iter()
            .skip(first + 1)
            .take_while(|s| s.version <= to)
            .cloned()
            .collect();
        let last = steps.last().map_or(from, |s| s.version);
        (last == to).then_some(steps)
    }

    /// The versions remembered, oldest first.
    pub fn versions(&self) -> Vec<u64> {
        self.steps.iter().map(|s| s.version).collect()
    }

    /// How many objects the remembered steps name.
    pub fn objects(&self) -> usize {
        self.objects
    }
}

/// Each node's own elements that changed between two publications. Unchanged overlays are
/// the same allocation in both, so this costs a pointer comparison per node and a diff per
/// changed overlay.
fn overlay_steps(a: &Publication, b: &Publication) -> HashMap<String, CompactTouched> {
    let mut steps = HashMap::new();
    if a.overlays.ptr_eq(&b.overlays) {
        return steps;
    }
    let empty = Model::default();
    let mut step = |node: &String, old: Option<&Arc<Model>>, new: Option<&Arc<Model>>| {
        let mut t = Touched::default();
        t.overlay_step(old.map_or(&empty, |m| m), new.map_or(&empty, |m| m));
        if !t.is_empty() {
            steps.insert(node.clone(), t.compact());
        }
    };
    for (node, new) in b.overlays.iter() {
        match a.overlays.get(node) {
            Some(old) if Arc::ptr_eq(old, new) => {}
            old => step(node, old, Some(new)),
        }
    }
    for (node, old) in a.overlays.iter() {
        if !b.overlays.contains_key(node) {
            step(node, Some(old), None);
        }
    }
    steps
}
