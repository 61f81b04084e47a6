//! The Secret and the ConfigMap: their keys, and reading and writing them. Every write of the
//! Secret carries the resourceVersion it was decided from, so two writers (a holder whose Lease
//! just expired, and its successor) cannot overwrite each other's certificates: the second one
//! gets a conflict and decides again from what the first wrote.
use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use kube::api::{ObjectMeta, PostParams};

use super::PkiError;
use crate::config::ObjectRef;

/// The serving certificate (PEM, leaf first): the `kubernetes.io/tls` Secret's key.
pub const TLS_CRT: &str = "tls.crt";
/// The serving certificate's private key (PKCS#8 PEM).
pub const TLS_KEY: &str = "tls.key";
/// The CA bundle (PEM): the current CA first, then earlier ones until they expire. Also the
/// ConfigMap's key.
pub const CA_CRT: &str = "ca.crt";
/// The current CA's private key (PKCS#8 PEM).
pub const CA_KEY: &str = "ca.key";
/// The Secret's type: `tls.crt` and `tls.key`, as Ingress controllers and cert-manager write.
pub const SECRET_TYPE: &str = "kubernetes.io/tls";
/// The label on both objects: who writes them.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "splitproxy-brain");

/// The four entries of the Secret, as text (empty when absent). `Debug` never shows the keys.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Material {
    pub ca_crt: String,
    pub ca_key: String,
    pub tls_crt: String,
    pub tls_key: String,
}

impl std::fmt::Debug for Material {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Material")
            .field("ca_crt", &self.ca_crt.len())
            .field("tls_crt", &self.tls_crt.len())
            .finish_non_exhaustive()
    }
}

impl Material {
    /// What a Secret holds; entries that are not UTF-8 read as absent.
    pub fn of(secret: &Secret) -> Material {
        let get = |key: &str| {
            secret
                .data
                .as_ref()
                .and_then(|d| d.get(key))
                .and_then(|v| String::from_utf8(v.0.clone()).ok())
                .unwrap_or_default()
        };
        Material {
            ca_crt: get(CA_CRT),
            ca_key: get(CA_KEY),
            tls_crt: get(TLS_CRT),
            tls_key: get(TLS_KEY),
        }
    }

    fn data(&self) -> BTreeMap<String, ByteString> {
        [
            (CA_CRT, &self.ca_crt),
            (CA_KEY, &self.ca_key),
            (TLS_CRT, &self.tls_crt),
            (TLS_KEY, &self.tls_key),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
        .collect()
    }
}

fn api_error(what: String) -> impl FnOnce(kube::Error) -> PkiError {
    move |source| PkiError::Api { what, source }
}

/// The Secret, if it exists.
pub async fn read_secret(api: &Api<Secret>, at: &ObjectRef) -> Result<Option<Secret>, PkiError> {
    api.get_opt(&at.name)
        .await
        .map_err(api_error(format!("reading Secret {at}")))
}

/// Writes `material` into the Secret read as `read` (`None`: it did not exist, so it is
/// created). Other entries, labels and annotations of an existing Secret are kept.
pub async fn write_secret(
    api: &Api<Secret>,
    at: &ObjectRef,
    read: Option<Secret>,
    material: &Material,
) -> Result<(), PkiError> {
    let what = format!("writing Secret {at}");
    match read {
        Some(mut secret) => {
            let mut data = secret.data.take().unwrap_or_default();
            data.extend(material.data());
            secret.data = Some(data);
            // `stringData` is write-only, but a Secret read back never has it; be sure.
            secret.string_data = None;
            api.replace(&at.name, &PostParams::default(), &secret)
                .await
                .map_err(api_error(what))?;
        }
        None => {
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(at.name.clone()),
                    namespace: Some(at.namespace.clone()),
                    labels: Some(label()),
                    ..Default::default()
                },
                type_: Some(SECRET_TYPE.to_string()),
                data: Some(material.data()),
                ..Default::default()
            };
            api.create(&PostParams::default(), &secret)
                .await
                .map_err(api_error(what))?;
        }
    }
    Ok(())
}

fn label() -> BTreeMap<String, String> {
    BTreeMap::from([(MANAGED_BY.0.to_string(), MANAGED_BY.1.to_string())])
}

/// The ConfigMap that publishes the bundle, if it exists ([`published_bundle`] reads it).
pub async fn read_published(
    api: &Api<ConfigMap>,
    at: &ObjectRef,
) -> Result<Option<ConfigMap>, PkiError> {
    api.get_opt(&at.name)
        .await
        .map_err(api_error(format!("reading ConfigMap {at}")))
}

/// The bundle a ConfigMap publishes.
pub fn published_bundle(cm: &ConfigMap) -> Option<&str> {
    cm.data.as_ref()?.get(CA_CRT).map(String::as_str)
}

/// Publishes `bundle` as the ConfigMap's `ca.crt`, in the ConfigMap read as `read` (`None`: it
/// is created). Its other entries are kept.
pub async fn publish(
    api: &Api<ConfigMap>,
    at: &ObjectRef,
    read: Option<ConfigMap>,
    bundle: &str,
) -> Result<(), PkiError> {
    let what = format!("publishing the CA bundle in ConfigMap {at}");
    match read {
        Some(mut cm) => {
            cm.data
                .get_or_insert_with(Default::default)
                .insert(CA_CRT.to_string(), bundle.to_string());
            api.replace(&at.name, &PostParams::default(), &cm)
                .await
                .map_err(api_error(what))?;
        }
        None => {
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(at.name.clone()),
                    namespace: Some(at.namespace.clone()),
                    labels: Some(label()),
                    ..Default::default()
                },
                data: Some(BTreeMap::from([(CA_CRT.to_string(), bundle.to_string())])),
                ..Default::default()
            };
            api.create(&PostParams::default(), &cm)
                .await
                .map_err(api_error(what))?;
        }
    }
    Ok(())
}
