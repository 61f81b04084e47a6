//! A node's acks and drift reports: what it holds from then on, and when a publication has
//! reached the nodes that were connected when it went out (the fan-out's timing, and the share
//! still unsettled that publication pacing waits on).
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use splitproxy_proto::v1::Ack;

use super::{CHANGE_LOG, Fanout, Held, NodeState, node_state};

impl Fanout {
    /// Records a drift report from a node: counted and kept for ListNodes, logged. The node
    /// repaired its tables back to what it acked, so nothing else changes.
    pub fn record_drift(&self, node: &str, drift: splitproxy_proto::v1::Drift) {
        tracing::warn!(
            node,
            summary = %drift.summary,
            kinds = ?drift.kinds,
            repaired = drift.repaired,
            error = %drift.error,
            "node reported drift in its tables"
        );
        let Ok(mut nodes) = self.nodes.lock() else {
            return;
        };
        let st = node_state(&mut nodes, node);
        st.drifts += 1;
        st.last_drift = Some(drift);
    }

    /// Records a node's answer to the update that took it to `sent` (version and model).
    pub fn record_ack(&self, node: &str, ack: &Ack, sent: Held) -> bool {
        let apply = ack
            .apply_duration
            .as_ref()
            .map(|d| Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32));
        let version = sent.version;
        let mut settled = None;
        {
            let Ok(mut nodes) = self.nodes.lock() else {
                return false;
            };
            let st = node_state(&mut nodes, node);
            st.last_apply = apply;
            if ack.ok {
                settled = self.unsettled(st, Some(version));
                st.acked_generation = ack.generation;
                st.news_after = sent.version;
                st.hello_digest.clear();
                st.behind_since = None;
                st.acked = Some(sent);
                st.last_error.clear();
                st.last_errno = 0;
                st.last_refused_message.clear();
                st.last_kernel_message.clear();
            } else {
                st.acked = None;
                // It still holds what it had (a refused update changes nothing), and is behind
                // at least since the publication it could not apply.
                st.behind_since = Some(
                    self.published_at(version)
                        .unwrap_or_else(Instant::now)
                        .min(st.behind_since.unwrap_or_else(Instant::now)),
                );
                st.last_error = ack.error.clone();
                st.last_errno = ack.errno;
                st.last_refused_message = ack.refused_message.clone();
                st.last_kernel_message = ack.kernel_message.clone();
                self.metrics
                    .nacks
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        self.settle(settled, true);
        ack.ok
    }

    /// The publications `st`'s node was counted in and no longer holds up once it holds
    /// `version` (all of them when it left, `None`): after its `settled`, up to `version` and
    /// the newest counted. A publication counted after this (with the nodes locked, as the
    /// caller holds them) does not count a node that left, and one that stays settles it with a
    /// later ack. `None` when there is none.
    pub(super) fn unsettled(&self, st: &mut NodeState, version: Option<u64>) -> Option<(u64, u64)> {
        let counted = self.counted.load(Ordering::Relaxed);
        let upto = version.map_or(counted, |v| v.min(counted));
        (upto > st.settled).then(|| (std::mem::replace(&mut st.settled, upto), upto))
    }

    /// The share of the nodes connected at the newest publication that have not acked it (nor
    /// left): 0 once every one has, or when none was connected.
    pub fn newest_unsettled_share(&self) -> f64 {
        let newest = self.counted.load(Ordering::Relaxed);
        let Ok(pending) = self.pending.lock() else {
            return 0.0;
        };
        pending
            .get(&newest)
            .map_or(0.0, |p| p.waiting as f64 / p.counted.max(1) as f64)
    }

    /// A node no longer holds up the publications after `range.0` up to `range.1` (from
    /// [`Fanout::unsettled`]); publications every node has settled are timed. `acked`: it holds
    /// them (not: it left), and its ack latency counts in their rollouts.
    pub(super) fn settle(&self, range: Option<(u64, u64)>, acked: bool) {
        let Some((after, upto)) = range else {
            return;
        };
        let Ok(mut pending) = self.pending.lock() else {
            return;
        };
        let now = Instant::now();
        // An ack (not a disconnect) times each publication it settles for this node: no
        // allocation on this per-node path, one clock read.
        let mut rollouts = acked.then(|| self.rollouts.lock().ok()).flatten();
        let mut done = Vec::new();
        for (v, p) in pending.range_mut(after + 1..=upto) {
            let took = now.saturating_duration_since(p.published);
            p.waiting = p.waiting.saturating_sub(1);
            if let Some(rollouts) = rollouts.as_mut() {
                rollouts.entry(*v).or_default().record(took);
            }
            if p.waiting == 0 {
                done.push((*v, took));
            }
        }
        if let Some(rollouts) = rollouts.as_mut() {
            while rollouts.len() > CHANGE_LOG {
                rollouts.pop_first();
            }
        }
        drop(rollouts);
        for (v, took) in done {
            pending.remove(&v);
            self.metrics.observe_fanout(took);
        }
    }
}
