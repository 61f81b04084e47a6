//! Applying rendered manifests (`helm template` output, multi-document YAML of any kind) to the
//! API server with server-side apply, so that the API server itself validates every object:
//! its schema, defaulting and admission, exactly as `kubectl apply --server-side` would.
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Scope, pinned_kind};
use serde::Deserialize as _;

use crate::Result;

/// The field manager of objects applied here.
pub const FIELD_MANAGER: &str = "splitproxy-tests";

/// One object as applied: kind, namespace (empty for cluster-scoped objects) and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

/// The YAML documents of `yaml` as objects, skipping empty documents (helm renders some).
pub fn documents(yaml: &str) -> Result<Vec<DynamicObject>> {
    let mut objects = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let value = serde_yaml::Value::deserialize(doc).context("parsing a YAML document")?;
        if value.is_null() {
            continue;
        }
        let obj: DynamicObject =
            serde_yaml::from_value(value).context("a YAML document is not a Kubernetes object")?;
        objects.push(obj);
    }
    Ok(objects)
}

/// Applies every object of `yaml` server-side (forcing ownership), in order, with
/// `default_namespace` for namespaced objects that name none. `dry_run` asks the API server to
/// validate and admit without persisting. Kinds are resolved through discovery; a kind whose
/// CRD was just created is retried for up to 10 s while it becomes established.
pub async fn apply(
    client: &kube::Client,
    yaml: &str,
    default_namespace: &str,
    dry_run: bool,
) -> Result<Vec<Applied>> {
    let mut applied = Vec::new();
    for mut obj in documents(yaml)? {
        let types = obj
            .types
            .clone()
            .context("an object without apiVersion and kind")?;
        let (group, version) = types
            .api_version
            .split_once('/')
            .unwrap_or(("", &types.api_version));
        let gvk = GroupVersionKind::gvk(group, version, &types.kind);
        let deadline = Instant::now() + Duration::from_secs(10);
        let (resource, caps) = loop {
            match pinned_kind(client, &gvk).await {
                Ok(found) => break found,
                // A new CRD is served a moment after its creation.
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("resolving {}", types.kind));
                }
            }
        };
        let name = obj
            .metadata
            .name
            .clone()
            .with_context(|| format!("a {} without a name", types.kind))?;
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Namespaced => {
                let ns = obj
                    .metadata
                    .namespace
                    .get_or_insert_with(|| default_namespace.to_string())
                    .clone();
                Api::namespaced_with(client.clone(), &ns, &resource)
            }
            Scope::Cluster => Api::all_with(client.clone(), &resource),
        };
        let mut params = PatchParams::apply(FIELD_MANAGER).force();
        params.dry_run = dry_run;
        api.patch(&name, &params, &Patch::Apply(&obj))
            .await
            .with_context(|| {
                format!(
                    "the API server refused {} {}/{}",
                    types.kind,
                    obj.metadata.namespace.as_deref().unwrap_or(""),
                    name
                )
            })?;
        applied.push(Applied {
            kind: types.kind.clone(),
            namespace: obj.metadata.namespace.clone().unwrap_or_default(),
            name,
        });
    }
    if applied.is_empty() {
        bail!("no object to apply");
    }
    Ok(applied)
}
