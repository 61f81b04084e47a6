//! Every replica, holder or not, serves the certificate the Secret holds: a watch on that one
//! Secret installs each new `tls.crt`/`tls.key` into the [`ServingCert`] the TLS listener
//! resolves at every handshake, so a rotation reaches every replica without a restart. A pair
//! that does not load is counted and logged (never its content), and the previous one is kept.
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

use super::store::Material;
use crate::config::ObjectRef;
use crate::metrics::Metrics;
use crate::tls::ServingCert;

/// Installs `secret`'s serving certificate, if it holds one and it is new.
pub fn install(serving: &ServingCert, at: &ObjectRef, secret: &Secret, metrics: &Metrics) {
    let material = Material::of(secret);
    if material.tls_crt.is_empty() {
        return;
    }
    match serving.install(material.tls_crt.as_bytes(), material.tls_key.as_bytes()) {
        Ok(false) => {}
        Ok(true) => {
            metrics.surface.tls_reloads.fetch_add(1, Relaxed);
            let leaf = serving.leaf();
            let expires = leaf
                .as_ref()
                .map(|l| crate::tls::identity_of(l.as_ref()))
                .and_then(|id| id.expires);
            if let Some(secs) =
                expires.and_then(|t| t.duration_since(std::time::SystemTime::UNIX_EPOCH).ok())
            {
                metrics
                    .tls_certificate_not_after
                    .store(secs.as_secs(), Relaxed);
            }
            tracing::info!(secret = %at, ?expires, "serving the Secret's certificate");
        }
        Err(e) => {
            metrics.surface.tls_reload_errors.fetch_add(1, Relaxed);
            tracing::warn!(secret = %at, error = %e,
                "the Secret's certificate does not load; keeping the previous one");
        }
    }
}

/// Watches the Secret for ever (the watcher relists and backs off by itself).
pub async fn run(
    client: kube::Client,
    at: ObjectRef,
    serving: Arc<ServingCert>,
    own_ca: Option<Arc<super::own_ca::OwnCa>>,
    metrics: Arc<Metrics>,
) {
    let api: Api<Secret> = Api::namespaced(client, &at.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={}", at.name));
    let mut events = watcher::watcher(api, config).default_backoff().boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Apply(secret) | Event::InitApply(secret)) => {
                install(&serving, &at, &secret, &metrics);
                if let Some(own) = &own_ca
                    && own.update(&Material::of(&secret))
                {
                    tracing::info!(secret = %at, "trusting the Secret's CA bundle for node certificates");
                }
            }
            // A deleted Secret: keep serving what we have; the holder writes a new one.
            Ok(_) => {}
            Err(e) => tracing::warn!(secret = %at, error = %e, "watching the TLS Secret"),
        }
    }
}
