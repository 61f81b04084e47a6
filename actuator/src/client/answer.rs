//! Applying one update and the answer the brain gets: an ack with the apply time, or a NACK
//! with the kernel's errno and what it refused, bounded in size.
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use splitproxy_proto::v1::{Ack, Update, update::Body};

use crate::apply::kernel::Kernel;
use crate::apply::{Applier, ApplyError, Outcome};
use crate::health::Health;
use splitproxy_proto::model::Model;

/// Longest error text a NACK carries (each of its strings): a refused 60 KiB element message
/// or a long chain of causes must not make the ack itself a burden (bounded under slow nodes,
/// docs/invariants.md).
pub const MAX_ERROR_BYTES: usize = 4096;

/// What to apply: an update, or a snapshot already folded into a model.
pub(super) enum Work {
    Update(Update),
    Snapshot(Update, Model),
}

/// Applies one update off the async runtime (netlink is blocking) and builds its answer, and,
/// when it committed, what follows.
pub(super) async fn apply<K: Kernel + Send + 'static>(
    work: Work,
    applier: &Arc<Mutex<Applier<K>>>,
    health: &Arc<Health>,
) -> (Ack, Option<Outcome>) {
    let (generation, snapshot, traceparent) = match &work {
        Work::Update(u) => (
            u.generation,
            matches!(u.body, Some(Body::Snapshot(_))),
            &u.traceparent,
        ),
        Work::Snapshot(u, _) => (u.generation, true, &u.traceparent),
    };
    // The brain's trace of the change continues here when it sent one (sampled changes only).
    let span = crate::trace::apply_span(traceparent, generation, snapshot);
    let in_span = span.clone();
    let applier = applier.clone();
    let (update, result) = tokio::task::spawn_blocking(move || {
        let _entered = in_span.as_ref().map(|s| s.enter());
        let Ok(mut a) = applier.lock() else {
            return (Update::default(), Err(ApplyError::Panicked));
        };
        let (update, result) = match work {
            Work::Update(u) => {
                let r = a.apply(&u);
                (u, r)
            }
            Work::Snapshot(u, model) => {
                let r = a.apply_snapshot(&u, model);
                (u, r)
            }
        };
        (update, result)
    })
    .await
    .unwrap_or_else(|e| {
        tracing::error!(error = %e, "applying an update panicked");
        (Update::default(), Err(ApplyError::Panicked))
    });
    match result {
        Ok(outcome) => {
            let elements = outcome.model.element_count();
            let took = outcome.took;
            health
                .metrics
                .applied(generation, took, outcome.took_on_cpu, snapshot, elements);
            health
                .ready
                .store(true, std::sync::atomic::Ordering::Relaxed);
            health
                .apply_failing
                .store(false, std::sync::atomic::Ordering::Relaxed);
            let now = SystemTime::now();
            // Only an update that changed the kernel programmed anything: one that found its
            // content in place (a reconnect, a resumption) would report the age of old changes.
            let programmed = if outcome.changed {
                &update.trigger_times[..]
            } else {
                &[]
            };
            for t in programmed {
                let at = SystemTime::UNIX_EPOCH
                    + Duration::new(t.seconds.max(0) as u64, t.nanos.max(0) as u32);
                if let Ok(latency) = now.duration_since(at) {
                    health.metrics.network_programming(latency);
                }
            }
            if let Some(span) = &span {
                crate::trace::applied(span, &outcome);
            }
            tracing::info!(generation, snapshot, ?took, objects = ?update.objects, "applied update");
            let ack = Ack {
                generation,
                ok: true,
                apply_duration: took.try_into().ok(),
                ..Ack::default()
            };
            (ack, Some(outcome))
        }
        Err(e) => {
            health.metrics.apply_failed();
            health
                .apply_failing
                .store(true, std::sync::atomic::Ordering::Relaxed);
            if let Some(span) = &span {
                crate::trace::failed(span, &e.to_string());
            }
            tracing::error!(generation, snapshot, error = %e, "update failed; previous rules stay in place");
            (nack(generation, &e), None)
        }
    }
}

/// The answer to an update that failed: the error, and when the kernel refused it, its errno,
/// the message it refused and what it said, so that the brain shows why without a node's logs.
/// Every string is at most [`MAX_ERROR_BYTES`].
pub fn nack(generation: u64, e: &ApplyError) -> Ack {
    let refused = e.refused();
    Ack {
        generation,
        ok: false,
        error: bounded(e.to_string()),
        apply_duration: None,
        errno: e.errno().unwrap_or(0),
        refused_message: refused
            .map(|f| bounded(f.description.clone()))
            .unwrap_or_default(),
        kernel_message: refused
            .and_then(|f| f.kernel_message.clone())
            .map(bounded)
            .unwrap_or_default(),
    }
}

/// `s` cut to at most [`MAX_ERROR_BYTES`] on a character boundary, marked when cut.
fn bounded(mut s: String) -> String {
    const MARK: &str = " [...]";
    if s.len() <= MAX_ERROR_BYTES {
        return s;
    }
    let mut end = MAX_ERROR_BYTES - MARK.len();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push_str(MARK);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nft::{CommitError, MessageFailure};
    use splitproxy_proto::v1;

    #[test]
    fn a_nack_carries_the_kernels_errno_and_the_refused_message() {
        let e = ApplyError::Kernel(CommitError::Rejected {
            failures: vec![MessageFailure {
                errno: 2,
                message: Some(3),
                description: "delete set service-ips".to_owned(),
                kernel_message: Some("no such set".to_owned()),
            }],
        });
        let ack = nack(7, &e);
        assert_eq!(ack.generation, 7);
        assert!(!ack.ok);
        assert_eq!(ack.errno, 2);
        assert_eq!(ack.refused_message, "delete set service-ips");
        assert_eq!(ack.kernel_message, "no such set");
        assert!(
            ack.error.contains("delete set service-ips"),
            "{}",
            ack.error
        );

        let ack = nack(8, &ApplyError::Digest);
        assert_eq!(
            (
                ack.errno,
                ack.refused_message.as_str(),
                ack.kernel_message.as_str()
            ),
            (0, "", "")
        );
        assert!(!ack.error.is_empty());
    }

    /// An applier over the recording kernel fake, the node's health, and a ruleset of one empty
    /// owned table to send it.
    fn recording_node() -> (
        Arc<Mutex<Applier<crate::apply::kernel::Recording>>>,
        Arc<Health>,
        splitproxy_proto::v1::Ruleset,
    ) {
        use splitproxy_proto::v1::{Ruleset, Table};
        let applier = Arc::new(Mutex::new(Applier::new(
            crate::apply::kernel::Recording::new(),
            "splitproxy".to_owned(),
        )));
        let rs = Ruleset {
            tables: vec![Table {
                family: v1::Family::Ip as i32,
                name: "splitproxy".to_owned(),
                ..Table::default()
            }],
        };
        (applier, Arc::new(Health::default()), rs)
    }

    /// The whole path from a refusing kernel to the answer the brain gets, and the answer to
    /// the update that follows.
    #[tokio::test]
    async fn a_refused_commit_is_answered_with_the_kernels_errno() {
        let (applier, health, rs) = recording_node();
        let update = |generation| Update {
            brain_epoch: 1,
            generation,
            body: Some(Body::Snapshot(rs.clone())),
            ..Update::default()
        };
        applier
            .lock()
            .unwrap()
            .kernel_mut()
            .refuse_next_at(2, 17, "File exists");
        let (ack, outcome) = apply(Work::Update(update(1)), &applier, &health).await;
        assert!(outcome.is_none());
        assert_eq!((ack.generation, ack.ok, ack.errno), (1, false, 17));
        assert_eq!(ack.refused_message, "add table ip splitproxy");
        assert_eq!(ack.kernel_message, "File exists");
        assert!(
            health
                .apply_failing
                .load(std::sync::atomic::Ordering::Relaxed)
        );

        let (ack, outcome) = apply(Work::Update(update(2)), &applier, &health).await;
        assert!(ack.ok, "{}", ack.error);
        assert_eq!((ack.generation, ack.errno), (2, 0));
        assert!(ack.refused_message.is_empty() && ack.kernel_message.is_empty());
        assert_eq!(outcome.unwrap().model, Model::from_ruleset(&rs));
        assert!(
            !health
                .apply_failing
                .load(std::sync::atomic::Ordering::Relaxed)
        );
    }

    /// A delta resumed by content (another replica's, or a restarted brain's: another epoch,
    /// base generation 0) applies only on the content its base digest names.
    #[tokio::test]
    async fn a_delta_by_content_applies_only_on_the_content_it_names() {
        use crate::apply::kernel::Recording;
        use splitproxy_proto::v1::{Ruleset, RulesetDelta, Table};

        let applier = Arc::new(Mutex::new(Applier::new(
            Recording::new(),
            "splitproxy".to_owned(),
        )));
        let health = Arc::new(Health::default());
        let table = |comment: &str| Table {
            family: v1::Family::Ip as i32,
            name: "splitproxy".to_owned(),
            comment: comment.to_owned(),
            ..Table::default()
        };
        let digest = |comment: &str| {
            Model::from_ruleset(&Ruleset {
                tables: vec![table(comment)],
            })
            .digest()
        };
        let snapshot = Update {
            brain_epoch: 1,
            generation: 7,
            body: Some(Body::Snapshot(Ruleset {
                tables: vec![table("a")],
            })),
            digest: digest("a"),
            ..Update::default()
        };
        let (ack, _) = apply(Work::Update(snapshot), &applier, &health).await;
        assert!(ack.ok, "{}", ack.error);

        let delta = |base_digest: Vec<u8>| Update {
            brain_epoch: 2,
            generation: 3,
            base_generation: 0,
            base_digest,
            body: Some(Body::Delta(RulesetDelta {
                upsert: vec![table("b")],
                remove: vec![],
            })),
            digest: digest("b"),
            ..Update::default()
        };
        for wrong in [Vec::new(), digest("c"), vec![0; 16]] {
            let (ack, outcome) = apply(Work::Update(delta(wrong)), &applier, &health).await;
            assert!(!ack.ok && outcome.is_none(), "refused");
            assert!(ack.error.contains("delta on epoch 2"), "{}", ack.error);
        }
        let applied = applier.lock().unwrap().applied().clone();
        assert_eq!((applied.brain_epoch, applied.generation), (1, 7));

        let (ack, outcome) = apply(Work::Update(delta(digest("a"))), &applier, &health).await;
        assert!(ack.ok, "{}", ack.error);
        assert!(outcome.is_some());
        let applied = applier.lock().unwrap().applied().clone();
        assert_eq!(
            (applied.brain_epoch, applied.generation, applied.digest),
            (2, 3, digest("b")),
            "the node now stands on the new brain's generations"
        );
        // Counted as a delta, not a snapshot.
        let m = health.metrics.render();
        assert!(
            m.contains("splitproxy_actuator_deltas_applied_total 1"),
            "{m}"
        );
    }

    /// Network programming latency is recorded for an update that changed the kernel, not for
    /// one whose content the node held already (a reconnect that resends the state with old
    /// trigger times would otherwise report their age).
    #[tokio::test]
    async fn only_an_update_that_changed_the_kernel_reports_programming_latency() {
        let (applier, health, rs) = recording_node();
        let a_minute_ago =
            prost_types::Timestamp::from(SystemTime::now() - Duration::from_secs(60));
        let update = |epoch, generation| Update {
            brain_epoch: epoch,
            generation,
            body: Some(Body::Snapshot(rs.clone())),
            trigger_times: vec![a_minute_ago],
            ..Update::default()
        };
        let samples = |health: &Health| {
            health
                .metrics
                .render()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("kubeproxy_network_programming_duration_seconds_count ")
                })
                .map(str::to_owned)
        };
        let (ack, _) = apply(Work::Update(update(1, 1)), &applier, &health).await;
        assert!(ack.ok, "{}", ack.error);
        assert_eq!(
            samples(&health).as_deref(),
            Some("1"),
            "the first apply programmed"
        );
        // The same content again from another brain (a new epoch): nothing to program.
        let (ack, _) = apply(Work::Update(update(2, 1)), &applier, &health).await;
        assert!(ack.ok, "{}", ack.error);
        assert_eq!(
            samples(&health).as_deref(),
            Some("1"),
            "nothing changed, no sample"
        );
    }

    #[test]
    fn nack_strings_are_bounded() {
        let long = "é".repeat(10_000);
        let e = ApplyError::Kernel(CommitError::Rejected {
            failures: vec![MessageFailure {
                errno: 22,
                message: Some(0),
                description: long.clone(),
                kernel_message: Some(long),
            }],
        });
        let ack = nack(1, &e);
        for s in [&ack.error, &ack.refused_message, &ack.kernel_message] {
            assert!(s.len() <= MAX_ERROR_BYTES, "{}", s.len());
            assert!(s.ends_with(" [...]"));
        }
        assert_eq!(bounded("short".to_owned()), "short");
    }
}
