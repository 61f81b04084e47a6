//! The change log: when each recent publication was made and which API changes (trigger
//! times, object names, sampled traces) it folded in, read for network programming latency,
//! traces, lag and `GetService`; and how long each recent publication took to be acked.
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Change, Fanout, Rollout};

/// The log's publications after `after` up to `upto`. Versions in the log are consecutive, so
/// the range is found by arithmetic, not by a scan.
fn between(
    log: &VecDeque<Change>,
    after: u64,
    upto: u64,
) -> std::collections::vec_deque::Iter<'_, Change> {
    let first = log.front().map_or(0, |c| c.version);
    let start = ((after + 1).saturating_sub(first) as usize).min(log.len());
    let end = ((upto + 1).saturating_sub(first) as usize).min(log.len());
    log.range(start..end)
}

impl Fanout {
    /// The newest recent publication that folded in a change of one of `objects` (change-log
    /// names, "Service ns/name"): its version, its first trigger time and every object it
    /// changed. `None` when none of the recent ones did.
    pub fn last_change_of(
        &self,
        objects: &[String],
    ) -> Option<(u64, Option<prost_types::Timestamp>, Vec<String>)> {
        let log = self.changes.lock().ok()?;
        let c = log
            .iter()
            .rev()
            .find(|c| c.objects.iter().any(|o| objects.contains(o)))?;
        let at = c
            .objects
            .iter()
            .zip(&c.trigger_times)
            .find(|(o, _)| objects.contains(o))
            .map(|(_, t)| *t);
        Some((c.version, at, c.objects.clone()))
    }

    /// How long publication `version` took to be acked, by the nodes connected when it was
    /// published (recorded for the recent ones).
    pub fn rollout_latency(&self, version: u64) -> Option<Rollout> {
        self.rollouts.lock().ok()?.get(&version).cloned()
    }

    /// Trigger times and objects of the publications after `after` up to `upto` (found by
    /// arithmetic, not by a scan: this runs for every distinct update body).
    pub(crate) fn changes_between(
        &self,
        after: u64,
        upto: u64,
    ) -> (Vec<prost_types::Timestamp>, Vec<String>) {
        let mut times = Vec::new();
        let mut objects = Vec::new();
        if let Ok(log) = self.changes.lock() {
            for c in between(&log, after, upto) {
                times.extend(c.trigger_times.iter().cloned());
                if objects.len() < 64 {
                    objects.extend(c.objects.iter().cloned());
                }
            }
        }
        objects.sort();
        objects.dedup();
        objects.truncate(64);
        (times, objects)
    }

    /// The sampled trace contexts of the publications after `after` up to `upto`, newest
    /// first: what an update between those versions folds in. One atomic load when none of
    /// them is traced (tracing off, or nothing sampled lately).
    pub fn traces_between(&self, after: u64, upto: u64) -> Vec<opentelemetry::trace::SpanContext> {
        if self.newest_traced.load(Ordering::Relaxed) <= after {
            return Vec::new();
        }
        let mut traces = Vec::new();
        if let Ok(log) = self.changes.lock() {
            for c in between(&log, after, upto).rev() {
                traces.extend(c.trace.clone());
            }
        }
        traces
    }

    /// When the publication of `version` was made, if the change log still holds it.
    pub(super) fn published_at(&self, version: u64) -> Option<Instant> {
        let log = self.changes.lock().ok()?;
        let first = log.front()?.version;
        let i = usize::try_from(version.checked_sub(first)?).ok()?;
        log.get(i).map(|c| c.published)
    }

    /// When the oldest publication the change log still holds was made.
    pub(super) fn oldest_publication(&self) -> Option<Instant> {
        self.changes.lock().ok()?.front().map(|c| c.published)
    }
}
