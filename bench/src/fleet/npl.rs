//! Network-programming latency as the virtual nodes see it: from each change's trigger time to
//! the moment a node applied the update carrying it.
use std::sync::Arc;
use std::time::SystemTime;

// foldhash, not SipHash: each of the fleet's updates looks its node up three times here, and
// under churn that is some 25,000 updates a second, on the machine the brain runs on.
use foldhash::{HashMap, HashSet};

use super::Sample;
use crate::measure::stats::LatencyHist;

/// Network-programming latencies of one phase, from changes triggered at or after `since`.
#[derive(Debug, Clone)]
pub struct NplCollector {
    pub since: SystemTime,
    pub npl: LatencyHist,
    /// Time to decode and apply one update into the in-memory model.
    pub apply_seconds: LatencyHist,
    /// Samples per node.
    pub per_node: HashMap<Arc<str>, u64>,
    /// The newest trigger time each node has applied.
    pub latest: HashMap<Arc<str>, SystemTime>,
    /// Nodes followed apart (the failover phase's moved nodes), and their latencies.
    pub subset: HashSet<Arc<str>>,
    pub npl_subset: LatencyHist,
}

impl NplCollector {
    pub fn new(since: SystemTime) -> NplCollector {
        NplCollector {
            since,
            npl: LatencyHist::default(),
            apply_seconds: LatencyHist::default(),
            per_node: HashMap::default(),
            latest: HashMap::default(),
            subset: HashSet::default(),
            npl_subset: LatencyHist::default(),
        }
    }

    /// Counts one node's applied update: its apply time, and a latency for each change it
    /// carried that was triggered in this phase.
    pub fn record(&mut self, s: Sample) {
        self.apply_seconds.record(s.decode_and_apply.as_secs_f64());
        let mut counted = false;
        // Once per update, not per change it carries (tens under churn).
        let followed = self.subset.contains(&s.node);
        for t in &s.trigger_times {
            if *t < self.since {
                continue; // a change from before this phase
            }
            let latency = match s.applied_at.duration_since(*t) {
                Ok(d) => d.as_secs_f64(),
                Err(e) => -e.duration().as_secs_f64(),
            };
            self.npl.record(latency);
            if followed {
                self.npl_subset.record(latency);
            }
            counted = true;
        }
        if counted {
            if let Some(latest) = s.trigger_times.iter().max() {
                let e = self.latest.entry(s.node.clone()).or_insert(*latest);
                *e = (*e).max(*latest);
            }
            *self.per_node.entry(s.node).or_default() += 1;
        }
    }

    /// How many nodes have applied a change triggered at or after `t`.
    pub fn nodes_at(&self, t: SystemTime) -> usize {
        self.latest.values().filter(|l| **l >= t).count()
    }
}
