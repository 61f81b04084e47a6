//! The holder's work: read the Secret and the ConfigMap, decide ([`plan::next`]), and do one
//! step. Each step is one write, and the next one is decided from what the API server then
//! holds, so a step lost to a conflict, a crash or a lost Lease is simply decided again.
use std::time::SystemTime;

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;

use super::PkiError;
use super::inspect::{self, bundle_text, current_ca, parse_bundle};
use super::issue::{self, Issued};
use super::plan::{self, Action};
use super::store::{self, Material};
use crate::config::ManagedTls;

/// The API objects the holder writes.
pub struct Target {
    pub config: ManagedTls,
    pub secrets: Api<Secret>,
    pub config_maps: Api<ConfigMap>,
}

impl Target {
    pub fn new(client: kube::Client, config: ManagedTls) -> Target {
        Target {
            secrets: Api::namespaced(client.clone(), &config.secret.namespace),
            config_maps: Api::namespaced(client, &config.ca_configmap.namespace),
            config,
        }
    }
}

/// Reads the objects, decides, and does at most one step; returns what it did (a
/// [`Action::Wait`] when nothing).
pub async fn step(target: &Target, now: SystemTime) -> Result<Action, PkiError> {
    let config = &target.config;
    let secret = store::read_secret(&target.secrets, &config.secret).await?;
    let material = secret.as_ref().map(Material::of).unwrap_or_default();
    let cm = store::read_published(&target.config_maps, &config.ca_configmap).await?;
    let published = cm.as_ref().and_then(store::published_bundle);
    let facts = inspect::facts(&material, published, &config.server_names);
    let action = plan::next(now, &facts);
    let bundle = parse_bundle(&material.ca_crt);
    match action {
        Action::Wait(_) => {}
        Action::NewCa => {
            let ca = issue::new_ca(now, config.ca_validity)?;
            // The previous CAs stay until they expire: what they signed is still served.
            let kept = bundle
                .iter()
                .filter(|c| !c.window.expired(now))
                .map(|c| c.pem.as_str());
            let next = Material {
                ca_crt: bundle_text(std::iter::once(ca.cert_pem.as_str()).chain(kept)),
                ca_key: ca.key_pem,
                ..material
            };
            store::write_secret(&target.secrets, &config.secret, secret, &next).await?;
            tracing::info!(secret = %config.secret, cas = parse_bundle(&next.ca_crt).len(),
                validity = ?config.ca_validity, "made a new CA");
        }
        Action::Prune => {
            let current = current_ca(&bundle, &material.ca_key).map(|c| c.pem.clone());
            let kept = bundle
                .iter()
                .filter(|c| !c.window.expired(now) || Some(&c.pem) == current.as_ref())
                .map(|c| c.pem.as_str());
            let next = Material {
                ca_crt: bundle_text(kept),
                ..material.clone()
            };
            store::write_secret(&target.secrets, &config.secret, secret, &next).await?;
            tracing::info!(secret = %config.secret, "dropped expired CAs from the bundle");
        }
        Action::Publish => {
            store::publish(
                &target.config_maps,
                &config.ca_configmap,
                cm,
                &material.ca_crt,
            )
            .await?;
            tracing::info!(configmap = %config.ca_configmap, cas = bundle.len(),
                "published the CA bundle");
        }
        Action::Issue => {
            let Some(ca) = current_ca(&bundle, &material.ca_key) else {
                return Err(PkiError::Certificate("no current CA to issue from".into()));
            };
            let ca_not_after = ca.window.not_after;
            let ca = Issued {
                cert_pem: ca.pem.clone(),
                key_pem: material.ca_key.clone(),
            };
            let leaf = issue::new_serving(
                &ca,
                &config.server_names,
                now,
                config.cert_validity,
                ca_not_after,
            )?;
            let next = Material {
                tls_crt: leaf.cert_pem,
                tls_key: leaf.key_pem,
                ..material
            };
            store::write_secret(&target.secrets, &config.secret, secret, &next).await?;
            tracing::info!(secret = %config.secret, names = ?config.server_names,
                validity = ?config.cert_validity, "issued a serving certificate");
        }
    }
    Ok(action)
}
