//! The brain's own CA and serving certificate (`--tls-secret`), so that an installation needs
//! no certificate made by hand.
//!
//! - One Secret (`kubernetes.io/tls`) holds everything: `tls.crt` and `tls.key` (the serving
//!   certificate and its key), `ca.crt` (the CA bundle: the current CA first, then earlier
//!   ones until they expire) and `ca.key` (the current CA's key). See [`store`].
//! - One replica at a time writes it, the holder of a Lease ([`lease`]); it makes the CA, renews
//!   it and the serving certificate after two thirds of their lives, and publishes the bundle
//!   in a ConfigMap's `ca.crt` for actuators to verify the brain with ([`rotate`], deciding
//!   with [`plan`], which is pure). A new CA is published before anything it signs is served.
//! - Every replica serves what the Secret holds ([`follow`]), reloaded on every change, and is
//!   not ready until it has a certificate.
//!
//! Keys never leave the Secret: nothing here logs them, and the types that hold them print
//! without them.
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::config::ManagedTls;
use crate::metrics::Metrics;
use crate::tls::ServingCert;

pub mod follow;
pub mod inspect;
pub mod issue;
pub mod lease;
pub mod own_ca;
pub mod plan;
pub mod rotate;
pub mod store;

/// Steps the holder takes in one round at most (a new Secret takes three: CA, publish, issue).
const MAX_STEPS_PER_ROUND: usize = 5;
/// How soon the holder tries again after a failed step (a conflict, an API error).
const RETRY_AFTER_ERROR: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("certificate: {0}")]
    Certificate(String),
}

/// The running writer and follower; [`Pki::stop`] gives the Lease up.
pub struct Pki {
    stop: watch::Sender<bool>,
    writer: tokio::task::JoinHandle<()>,
}

impl Pki {
    /// Starts following the Secret into `serving` and competing for the Lease as `identity`.
    pub fn start(
        client: kube::Client,
        config: ManagedTls,
        identity: String,
        serving: Arc<ServingCert>,
        own_ca: Option<Arc<own_ca::OwnCa>>,
        metrics: Arc<Metrics>,
    ) -> Pki {
        tracing::info!(secret = %config.secret, lease = %config.lease,
            configmap = %config.ca_configmap, %identity, "managing the serving certificate");
        let metrics_for_writer = metrics.clone();
        tokio::spawn(follow::run(
            client.clone(),
            config.secret.clone(),
            serving,
            own_ca,
            metrics,
        ));
        let (stop, stopped) = watch::channel(false);
        let writer = tokio::spawn(write(client, config, identity, stopped, metrics_for_writer));
        Pki { stop, writer }
    }

    /// Stops writing and releases the Lease if this replica holds it, so that another takes
    /// over without waiting for it to expire. Bounded: a slow API server costs at most 3 s.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(3), self.writer).await;
    }
}

/// The writer's loop: a Lease round, then, while holding, steps until there is nothing to do;
/// then sleep until the next renewal or the next thing due, whichever comes first.
async fn write(
    client: kube::Client,
    config: ManagedTls,
    identity: String,
    mut stopped: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
) {
    let mut elector = lease::Elector::new(client.clone(), config.lease.clone(), identity);
    let target = rotate::Target::new(client, config);
    loop {
        let holding = elector.round().await;
        metrics
            .tls_lease_holder
            .store(u64::from(holding), std::sync::atomic::Ordering::Relaxed);
        let mut wait = if holding {
            lease::RENEW_INTERVAL
        } else {
            lease::RETRY_INTERVAL
        };
        for step in 0.. {
            if !elector.holding() {
                break;
            }
            if step == MAX_STEPS_PER_ROUND {
                // More to do than a round allows (a step undone by a concurrent write?): soon.
                wait = wait.min(RETRY_AFTER_ERROR);
                break;
            }
            let now = SystemTime::now();
            match rotate::step(&target, now).await {
                Ok(plan::Action::Wait(until)) => {
                    let until = until.duration_since(now).unwrap_or_default();
                    // Certificates count whole seconds: wake just after the moment.
                    wait = wait.min(until + Duration::from_millis(20));
                    break;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "managing the TLS Secret");
                    wait = wait.min(RETRY_AFTER_ERROR);
                    break;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stopped.changed() => break,
        }
    }
    elector.release().await;
    metrics
        .tls_lease_holder
        .store(0, std::sync::atomic::Ordering::Relaxed);
}
