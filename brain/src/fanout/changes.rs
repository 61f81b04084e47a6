//! The change log: which API changes (trigger times, object names) each recent publication
//! folded in, read for network programming latency, traces and `GetService`; and how long each
//! recent publication took to be acked.
use super::{Fanout, Rollout};

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

    /// Trigger times and objects of the publications after `after` up to `upto`. Versions in
    /// the log are consecutive, so the range is found by arithmetic, not by a scan: this runs for
    /// every distinct update body.
    pub(crate) fn changes_between(
        &self,
        after: u64,
        upto: u64,
    ) -> (Vec<prost_types::Timestamp>, Vec<String>) {
        let mut times = Vec::new();
        let mut objects = Vec::new();
        if let Ok(log) = self.changes.lock()
            && let Some(first) = log.front().map(|c| c.version)
        {
            let start = (after + 1).saturating_sub(first) as usize;
            let end = (upto + 1).saturating_sub(first) as usize;
            for c in log.range(start.min(log.len())..end.min(log.len())) {
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
}
