//! One writer at a time: a `coordination.k8s.io/v1` Lease, as client-go's leader election uses
//! one. The holder renews it every [`RENEW_INTERVAL`]; another replica takes it over once it has
//! seen the Lease unchanged for its `leaseDurationSeconds` ([`LEASE_DURATION`]). Expiry is judged
//! by when this replica last saw the Lease change (its resourceVersion), not by the holder's
//! `renewTime`, so clocks that disagree between nodes do not matter. Every write carries the
//! resourceVersion it was decided from: of two replicas taking over at once, one gets a conflict.
//!
//! A holder that cannot renew stops writing after [`RENEW_DEADLINE`], before anyone may take over.
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Api;
use kube::api::{ObjectMeta, PostParams};

use crate::config::ObjectRef;

/// `leaseDurationSeconds` of the Lease this brain writes.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How often the holder renews.
pub const RENEW_INTERVAL: Duration = Duration::from_secs(5);
/// How often a replica that does not hold the Lease looks at it.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(2);
/// How long a holder keeps writing without a successful renewal.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(10);

/// What to do with the Lease as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// There is none: create it, held by us.
    Create,
    /// We hold it: renew.
    Renew,
    /// Nobody holds it, or its holder stopped renewing: take it.
    TakeOver,
    /// Someone else holds it.
    Follow,
}

/// The decision, from the Lease read and how long this replica has seen it unchanged.
pub fn decide(me: &str, lease: Option<&Lease>, unchanged_for: Duration) -> Step {
    let Some(lease) = lease else {
        return Step::Create;
    };
    let spec = lease.spec.as_ref();
    let holder = spec
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or("");
    let duration = spec
        .and_then(|s| s.lease_duration_seconds)
        .and_then(|s| u64::try_from(s).ok())
        .map_or(LEASE_DURATION, Duration::from_secs);
    if holder == me {
        Step::Renew
    } else if holder.is_empty() || unchanged_for >= duration {
        Step::TakeOver
    } else {
        Step::Follow
    }
}

/// Who this replica is to the Lease: `POD_NAME` (the Downward API), or else the host name and
/// process id.
pub fn identity() -> String {
    if let Ok(pod) = std::env::var("POD_NAME")
        && !pod.is_empty()
    {
        return pod;
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let host = if host.is_empty() {
        "brain".into()
    } else {
        host
    };
    format!("{host}_{}", std::process::id())
}

fn micro_now() -> Option<MicroTime> {
    let micros = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .ok()?
        .as_micros();
    let micros = i64::try_from(micros).ok()?;
    k8s_openapi::jiff::Timestamp::from_microsecond(micros)
        .ok()
        .map(MicroTime)
}

/// This replica's side of the Lease.
pub struct Elector {
    api: Api<Lease>,
    at: ObjectRef,
    identity: String,
    /// The resourceVersion last seen, and since when.
    seen: Option<(String, Instant)>,
    /// When this replica last acquired or renewed the Lease.
    renewed: Option<Instant>,
}

impl Elector {
    pub fn new(client: kube::Client, at: ObjectRef, identity: String) -> Elector {
        Elector {
            api: Api::namespaced(client, &at.namespace),
            at,
            identity,
            seen: None,
            renewed: None,
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether this replica may write now: it renewed within [`RENEW_DEADLINE`].
    pub fn holding(&self) -> bool {
        self.renewed.is_some_and(|at| at.elapsed() < RENEW_DEADLINE)
    }

    /// One round: read the Lease and create, renew or take it as [`decide`] says (a holder
    /// renewed within [`RENEW_INTERVAL`] skips the round). Returns whether this replica holds it.
    pub async fn round(&mut self) -> bool {
        if self.renewed.is_some_and(|at| at.elapsed() < RENEW_INTERVAL) {
            return true;
        }
        let lease = match self.api.get_opt(&self.at.name).await {
            Ok(lease) => lease,
            Err(e) => {
                tracing::warn!(lease = %self.at, error = %e, "cannot read the Lease");
                return self.holding();
            }
        };
        let version = lease
            .as_ref()
            .and_then(|l| l.metadata.resource_version.clone())
            .unwrap_or_default();
        let since = match &self.seen {
            Some((v, since)) if *v == version => *since,
            _ => Instant::now(),
        };
        self.seen = Some((version, since));
        let step = decide(&self.identity, lease.as_ref(), since.elapsed());
        let was = self.holding();
        let result = match (step, lease) {
            (Step::Follow, _) => {
                self.renewed = None;
                return false;
            }
            (Step::Create, _) => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.at.name.clone()),
                        namespace: Some(self.at.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.identity.clone()),
                        lease_duration_seconds: Some(LEASE_DURATION.as_secs() as i32),
                        acquire_time: micro_now(),
                        renew_time: micro_now(),
                        lease_transitions: Some(0),
                        ..Default::default()
                    }),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            (Step::Renew | Step::TakeOver, None) => return self.holding(),
            (Step::Renew, Some(mut lease)) => {
                let spec = lease.spec.get_or_insert_with(Default::default);
                spec.renew_time = micro_now();
                spec.lease_duration_seconds = Some(LEASE_DURATION.as_secs() as i32);
                self.api
                    .replace(&self.at.name, &PostParams::default(), &lease)
                    .await
            }
            (Step::TakeOver, Some(mut lease)) => {
                let spec = lease.spec.get_or_insert_with(Default::default);
                spec.holder_identity = Some(self.identity.clone());
                spec.acquire_time = micro_now();
                spec.renew_time = micro_now();
                spec.lease_duration_seconds = Some(LEASE_DURATION.as_secs() as i32);
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                self.api
                    .replace(&self.at.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match result {
            Ok(_) => {
                self.renewed = Some(Instant::now());
                if !was {
                    tracing::info!(lease = %self.at, identity = %self.identity, ?step,
                        "holding the Lease: this replica writes the TLS Secret and the CA ConfigMap");
                }
                true
            }
            Err(e) => {
                // A conflict: someone else wrote first; decided again at the next round. Any
                // other error (a refusal, an outage) is the operator's to see.
                match &e {
                    kube::Error::Api(status) if status.code == 409 => {
                        tracing::debug!(lease = %self.at, ?step, error = %e, "Lease not written");
                    }
                    _ => {
                        tracing::warn!(lease = %self.at, ?step, error = %e, "cannot write the Lease")
                    }
                }
                if matches!(step, Step::Create | Step::TakeOver) {
                    self.renewed = None;
                }
                let holding = self.holding();
                if was && !holding {
                    tracing::warn!(lease = %self.at, "lost the Lease: no longer writing the TLS Secret");
                }
                holding
            }
        }
    }

    /// Gives the Lease up (at shutdown), so that another replica takes it over at once.
    pub async fn release(&mut self) {
        if !self.holding() {
            return;
        }
        self.renewed = None;
        if let Ok(Some(mut lease)) = self.api.get_opt(&self.at.name).await {
            let spec = lease.spec.get_or_insert_with(Default::default);
            if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
                return;
            }
            spec.holder_identity = None;
            if let Err(e) = self
                .api
                .replace(&self.at.name, &PostParams::default(), &lease)
                .await
            {
                tracing::debug!(lease = %self.at, error = %e, "Lease not released");
            } else {
                tracing::info!(lease = %self.at, "released the Lease");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, seconds: Option<i32>) -> Lease {
        Lease {
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                lease_duration_seconds: seconds,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_lease_is_taken_only_when_free_or_left_unrenewed() {
        let s = Duration::from_secs;
        assert_eq!(decide("a", None, s(0)), Step::Create);
        assert_eq!(
            decide("a", Some(&lease(Some("a"), Some(15))), s(99)),
            Step::Renew
        );
        assert_eq!(
            decide("a", Some(&lease(Some("b"), Some(15))), s(14)),
            Step::Follow
        );
        assert_eq!(
            decide("a", Some(&lease(Some("b"), Some(15))), s(15)),
            Step::TakeOver
        );
        assert_eq!(
            decide("a", Some(&lease(Some("b"), Some(60))), s(30)),
            Step::Follow
        );
        assert_eq!(
            decide("a", Some(&lease(Some("b"), None)), s(15)),
            Step::TakeOver
        );
        assert_eq!(
            decide("a", Some(&lease(None, Some(15))), s(0)),
            Step::TakeOver
        );
        assert_eq!(
            decide("a", Some(&lease(Some(""), Some(15))), s(0)),
            Step::TakeOver
        );
        assert_eq!(decide("a", Some(&Lease::default()), s(0)), Step::TakeOver);
        // The holder stops writing before anyone else may start.
        assert!(RENEW_DEADLINE < LEASE_DURATION && RENEW_INTERVAL < RENEW_DEADLINE);
    }
}
