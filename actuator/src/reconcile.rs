//! Keeps the kernel's tables equal to the applied model ("kernel is the truth",
//! docs/invariants.md), off the change path: a loop that asks the applier to reconcile
//! (apply/reconcile.rs) under the applier's lock, so never while an update is applied.
//!
//! Cost: every `--reconcile-interval` (default 1 s) the ruleset generation is compared with
//! the one after the last commit, one netlink round trip of a few microseconds; the tables are
//! read back only when someone else committed. Reads are held to a tenth of the time (a read
//! that took T is followed by no other for 9 T), so a node where another program commits all
//! the time spends at most a tenth of a core reading, at any table size. Every
//! [`FULL_CHECK_EVERY`] the tables are read whatever the generation says, which also catches a
//! commit that slipped in between one of ours and the generation read after it.
//!
//! Drift found is repaired in one transaction, counted
//! (`splitproxy_actuator_drift_repairs_total{what}`), logged at warn with what drifted, and
//! queued for the brain ([`DriftReports`], sent by client.rs as a `Drift` message).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use splitproxy_proto::v1;
use tokio::sync::Notify;

use crate::after_commit::AfterCommit;
use crate::apply::Applier;
use crate::apply::kernel::Kernel;
use crate::apply::reconcile::{Drift, ReconcileError, Reconciled};
use crate::health::Health;

/// How often the tables are read back even when the generation did not move.
pub const FULL_CHECK_EVERY: Duration = Duration::from_secs(300);
/// Drift reports kept while no brain listens; older ones are dropped first.
const MAX_REPORTS: usize = 16;
/// A read that took T allows the next one after `READ_COOLDOWN` x T.
const READ_COOLDOWN: u32 = 9;

/// Drift reports waiting for a brain stream to carry them.
#[derive(Debug, Default)]
pub struct DriftReports {
    queue: Mutex<VecDeque<v1::Drift>>,
    ready: Notify,
}

impl DriftReports {
    pub fn push(&self, report: v1::Drift) {
        if let Ok(mut q) = self.queue.lock() {
            if q.len() == MAX_REPORTS {
                q.pop_front();
            }
            q.push_back(report);
        }
        self.ready.notify_one();
    }

    /// Puts back a report a stream could not send, to go first on the next one.
    pub fn requeue(&self, report: v1::Drift) {
        if let Ok(mut q) = self.queue.lock()
            && q.len() < MAX_REPORTS
        {
            q.push_front(report);
        }
    }

    pub fn pop(&self) -> Option<v1::Drift> {
        self.queue.lock().ok()?.pop_front()
    }

    /// Waits for the next report.
    pub async fn next(&self) -> v1::Drift {
        loop {
            if let Some(r) = self.pop() {
                return r;
            }
            self.ready.notified().await;
        }
    }
}

/// The report the brain gets for one drift.
pub fn report(drift: &Drift, repaired: bool, error: Option<String>) -> v1::Drift {
    v1::Drift {
        detected_at: Some(SystemTime::now().into()),
        summary: drift.to_string(),
        kinds: drift.kinds().into_iter().map(str::to_owned).collect(),
        repaired,
        error: error.unwrap_or_default(),
    }
}

/// Runs forever: checks every `interval`, and at once when the applier asks (`wake`: a
/// refusal that says the model and the kernel disagree).
/// After a repair, `after` resyncs conntrack against the model (see
/// [`Applier::after_repair`]); tests pass `None`.
pub async fn run<K: Kernel + Send + 'static>(
    applier: Arc<Mutex<Applier<K>>>,
    health: Arc<Health>,
    after: Option<Arc<AfterCommit>>,
    wake: Arc<Notify>,
    interval: Duration,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut read_allowed = Instant::now();
    let mut last_full = Instant::now();
    loop {
        let woken = tokio::select! {
            _ = ticker.tick() => false,
            _ = wake.notified() => true,
        };
        if !woken && Instant::now() < read_allowed {
            continue;
        }
        let full = last_full.elapsed() >= FULL_CHECK_EVERY;
        if full {
            last_full = Instant::now();
        }
        let a = applier.clone();
        let result = tokio::task::spawn_blocking(move || {
            let mut a = a.lock().map_err(|_| None)?;
            if full {
                a.request_reconcile();
            }
            let r = a.reconcile().map_err(Some)?;
            let outcome = matches!(r, Reconciled::Repaired { .. }).then(|| a.after_repair());
            Ok((r, outcome))
        })
        .await;
        health.metrics.reconcile_checked();
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "reconciliation panicked");
                health.metrics.reconcile_failed();
                continue;
            }
        };
        let result = match result {
            Ok((r, outcome)) => {
                if let (Some(outcome), Some(after)) = (outcome, &after) {
                    after.run(outcome).await;
                }
                Ok(r)
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(Reconciled::NoModel | Reconciled::Unchanged) => {}
            Ok(Reconciled::Clean { read }) => {
                health.metrics.reconcile_read(read);
                read_allowed = Instant::now() + read * READ_COOLDOWN;
                tracing::debug!(?read, "kernel tables equal the model");
            }
            Ok(Reconciled::Repaired {
                drift,
                read,
                repair,
            }) => {
                health.metrics.reconcile_read(read);
                health.metrics.drift_repaired(&drift.kinds());
                read_allowed = Instant::now() + read * READ_COOLDOWN;
                tracing::warn!(
                    drift = %drift,
                    kinds = ?drift.kinds(),
                    ?read,
                    ?repair,
                    "the kernel's tables drifted from the applied model; replaced them from the model in one transaction"
                );
                health.drift.push(report(&drift, true, None));
            }
            Err(Some(ReconcileError::Repair { drift, source })) => {
                health.metrics.drift_repair_failed();
                tracing::error!(drift = %drift, error = %source, "the kernel's tables drifted and the repair was refused; the next snapshot replaces them");
                health
                    .drift
                    .push(report(&drift, false, Some(source.to_string())));
            }
            Err(Some(ReconcileError::Read(e))) => {
                health.metrics.reconcile_failed();
                tracing::warn!(error = %e, "could not check the kernel's tables");
            }
            Err(None) => {
                health.metrics.reconcile_failed();
                tracing::error!("the applier is poisoned; reconciliation stops");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_wait_bounded_and_go_back_first() {
        let r = DriftReports::default();
        for i in 0..20 {
            r.push(v1::Drift {
                summary: format!("{i}"),
                ..v1::Drift::default()
            });
        }
        let first = r.pop().unwrap();
        assert_eq!(first.summary, "4", "the oldest are dropped");
        r.requeue(first);
        assert_eq!(r.pop().unwrap().summary, "4");
        let d = Drift {
            missing_elements: 2,
            ..Drift::default()
        };
        let rep = report(&d, true, None);
        assert_eq!(
            (rep.summary.as_str(), rep.kinds, rep.repaired),
            ("missing elements: 2", vec!["element".to_owned()], true)
        );
    }

    /// The loop against the recording fake: tampering is repaired and reported.
    #[tokio::test]
    async fn the_loop_repairs_and_reports_drift() {
        use crate::apply::kernel::Recording;
        use splitproxy_proto::model::Model;
        use splitproxy_proto::v1::{Family, Ruleset, Table, Update, update::Body};

        let rs = Ruleset {
            tables: vec![Table {
                family: Family::Ip as i32,
                name: "splitproxy".to_owned(),
                ..Table::default()
            }],
        };
        let model = Model::from_ruleset(&rs);
        let wake = Arc::new(Notify::new());
        let mut a = Applier::new(Recording::new(), "splitproxy".to_owned())
            .with_reconcile_wake(wake.clone());
        a.apply(&Update {
            brain_epoch: 1,
            generation: 1,
            digest: model.digest(),
            body: Some(Body::Snapshot(rs)),
            ..Update::default()
        })
        .unwrap();
        a.kernel_mut().tamper(Model::default());
        let applier = Arc::new(Mutex::new(a));
        let health = Arc::new(Health::default());
        let task = tokio::spawn(run(
            applier.clone(),
            health.clone(),
            None,
            wake,
            Duration::from_millis(10),
        ));
        let got = tokio::time::timeout(Duration::from_secs(5), health.drift.next())
            .await
            .unwrap();
        task.abort();
        assert!(got.repaired);
        assert_eq!(got.kinds, vec!["table".to_owned()]);
        assert!(
            health
                .metrics
                .render()
                .contains("splitproxy_actuator_drift_repairs_total{what=\"table\"} 1")
        );
    }
}
