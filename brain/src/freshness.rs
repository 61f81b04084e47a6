//! How current the brain's picture of the cluster is: the time of its last confirmed contact
//! with the API server, and the bound past which it stops claiming to be current ("never
//! silently stale", docs/invariants.md).
//!
//! A brain cut off from the API server keeps its last complete state and, without this, keeps
//! serving it as if it were current: its watches may fail and retry for ever (or, on a
//! blackholed connection, never even fail), while nodes apply rules in which a removed endpoint
//! still receives traffic. So every sign of life from the API server counts as contact: a
//! watch event of any resource, and the answer to a cheap probe (`GET /version`) sent every
//! `--api-probe-interval-ms`, which is what keeps an idle but healthy cluster (whose watches
//! carry nothing) from being taken for a partition. When the last contact is older than
//! `--api-staleness-bound-ms`, [`monitor`] marks the [`Fanout`] stale: /readyz answers 503,
//! gRPC health says NOT_SERVING, ListNodes says stale with the contact's age, and node
//! streams are closed and refused with UNAVAILABLE, so that actuators move to a replica that
//! is current. Nothing is pushed meanwhile: the last complete state stays as it was ("no
//! empty push").
//!
//! Contact coming back does not make the brain current by itself: its watches may sit on dead
//! connections. The watch loop ([`crate::watch`]) restarts them when the probe answers after
//! failing, and the brain serves again only once their lists are complete.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::fanout::Fanout;

/// How often [`monitor`] compares the last contact's age with the bound.
pub const MONITOR_TICK: Duration = Duration::from_millis(250);

/// Consecutive failed probes after which the watches are restarted once the API server answers
/// again: one lost probe is a blip, two mean the connections may be gone.
pub const RESTART_AFTER_FAILED_PROBES: u32 = 2;

/// The time of the last confirmed contact with the API server.
#[derive(Debug)]
pub struct Freshness {
    origin: Instant,
    /// Milliseconds from `origin` to the last contact, plus one; 0 before the first.
    last_contact: AtomicU64,
    bound: Duration,
}

impl Freshness {
    /// `bound`: how old the last contact may be while the brain claims to be current.
    pub fn new(bound: Duration) -> Arc<Self> {
        Arc::new(Freshness {
            origin: Instant::now(),
            last_contact: AtomicU64::new(0),
            bound,
        })
    }

    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// The API server answered (a watch event, a list, a probe).
    pub fn contact(&self) {
        self.contact_at(Instant::now());
    }

    fn contact_at(&self, at: Instant) {
        let ms = at.saturating_duration_since(self.origin).as_millis() as u64 + 1;
        self.last_contact.fetch_max(ms, Ordering::AcqRel);
    }

    /// Time since the last contact; before the first one, time since the brain started (a
    /// brain that never reached the API server is as stale as one that lost it).
    pub fn age(&self) -> Duration {
        self.age_at(Instant::now())
    }

    fn age_at(&self, now: Instant) -> Duration {
        let since_origin = now.saturating_duration_since(self.origin);
        match self.last_contact.load(Ordering::Acquire) {
            0 => since_origin,
            ms => since_origin.saturating_sub(Duration::from_millis(ms - 1)),
        }
    }

    /// Whether the last contact is recent enough to claim the state is current.
    pub fn fresh(&self) -> bool {
        self.age() <= self.bound
    }
}

/// Keeps `fanout`'s freshness equal to `freshness` (checked every [`MONITOR_TICK`]), logging
/// each change. Runs until the fan-out's last subscriber is gone (the brain shuts down).
pub async fn monitor(freshness: Arc<Freshness>, fanout: Arc<Fanout>) {
    let mut tick = tokio::time::interval(MONITOR_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let fresh = freshness.fresh();
        if fresh != fanout.fresh() {
            let age = freshness.age();
            if fresh {
                tracing::info!(
                    age_ms = age.as_millis() as u64,
                    "the API server answers again: current again once every list is complete"
                );
            } else {
                tracing::warn!(
                    age_ms = age.as_millis() as u64,
                    bound_ms = freshness.bound().as_millis() as u64,
                    "no contact with the API server within the staleness bound: not ready, closing node streams so nodes move to a current replica"
                );
            }
            fanout.set_fresh(fresh);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn age_counts_from_the_last_contact_or_the_start() {
        let f = Freshness::new(Duration::from_secs(10));
        let t0 = f.origin;
        assert_eq!(
            f.age_at(t0 + Duration::from_secs(3)),
            Duration::from_secs(3)
        );
        f.contact_at(t0 + Duration::from_secs(5));
        assert_eq!(
            f.age_at(t0 + Duration::from_secs(7)),
            Duration::from_secs(2)
        );
        // An older contact reported late does not move the last one back.
        f.contact_at(t0 + Duration::from_secs(4));
        assert_eq!(
            f.age_at(t0 + Duration::from_secs(7)),
            Duration::from_secs(2)
        );
        assert_eq!(f.age_at(t0 + Duration::from_secs(1)), Duration::ZERO);
    }

    #[test]
    fn fresh_within_the_bound_only() {
        let f = Freshness::new(Duration::from_millis(50));
        assert!(f.fresh(), "a brain just started is within the bound");
        std::thread::sleep(Duration::from_millis(80));
        assert!(!f.fresh(), "no contact since the start, past the bound");
        f.contact();
        assert!(f.fresh());
    }

    /// The monitor turns the fan-out stale past the bound and back once contact returns.
    #[tokio::test]
    async fn the_monitor_follows_the_contacts() {
        let fanout = Fanout::new(Arc::new(crate::metrics::Metrics::default()), 1, 1024);
        let f = Freshness::new(Duration::from_millis(300));
        f.contact();
        let task = tokio::spawn(monitor(f.clone(), fanout.clone()));
        let mut fresh = fanout.subscribe_fresh();
        assert!(*fresh.borrow_and_update());
        tokio::time::timeout(Duration::from_secs(5), fresh.wait_for(|f| !*f))
            .await
            .expect("stale within the bound and a tick")
            .expect("fan-out alive");
        assert!(!fanout.fresh());
        f.contact();
        tokio::time::timeout(Duration::from_secs(5), fresh.wait_for(|f| *f))
            .await
            .expect("fresh again within a tick")
            .expect("fan-out alive");
        task.abort();
    }
}
