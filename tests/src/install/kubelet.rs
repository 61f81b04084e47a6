//! What a kubelet does for the lab's chart pods: their volumes (tokens from TokenRequest bound to
//! the Pod, ConfigMaps, Secrets, downward API), their environment, and their processes in their
//! node's network namespace with the volumes at their mount paths.
use super::*;

/// A ConfigMap's keys in a volume directory, followed as a kubelet follows them.
#[derive(Debug, Clone)]
pub(super) struct ConfigMapVolume {
    dir: PathBuf,
    name: String,
    /// Key → path; every key when empty.
    items: Vec<(String, String)>,
}

impl Install {
    pub(super) async fn start_container(&self, pod: Pod, node: usize) -> Result<()> {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let spec = pod.spec.clone().context("a Pod without spec")?;
        let [container] = spec.containers.as_slice() else {
            bail!("Pod {name}: the lab runs pods of one container");
        };
        if !spec.host_network.unwrap_or(false) {
            bail!("Pod {name}: the lab runs host-network pods only");
        }
        let root = self.dir.join(&name);
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root)?;
        let mut config_maps = Vec::new();
        let mut mounts = Vec::new();
        for m in container.volume_mounts.iter().flatten() {
            let volume = spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == m.name)
                .with_context(|| format!("Pod {name}: no volume {}", m.name))?;
            let dir = root.join("volumes").join(&volume.name);
            std::fs::create_dir_all(&dir)?;
            self.materialise(&pod, volume, &dir, &mut config_maps)
                .await
                .with_context(|| format!("Pod {name}: volume {}", volume.name))?;
            mounts.push((dir, PathBuf::from(&m.mount_path)));
        }
        let env = self.environment(&pod, container, node)?;
        let mut cmd = self.command(container)?;
        cmd.env_clear().envs(env);
        mount_namespace(&mut cmd, &mounts)?;
        let log = self.dir.join(format!("{name}.log"));
        let child = self.netns[node].spawn(&name, cmd, &log)?;
        lock(&self.pods).insert(
            name,
            RunningPod {
                pod,
                node,
                child: Some(child),
                config_maps,
                log,
            },
        );
        Ok(())
    }

    /// The process of an image: the workspace's binary of the same name.
    fn command(&self, container: &Container) -> Result<Command> {
        let image = container.image.as_deref().unwrap_or("");
        let repository = image.split(['@', ':']).next().unwrap_or("");
        let base = repository.rsplit('/').next().unwrap_or("");
        let mut cmd = match base {
            "splitproxy-brain" => {
                let mut c = Command::new(&self.exe);
                c.arg("brain");
                c
            }
            "splitproxy-actuator" => {
                let mut c = Command::new(&self.exe);
                c.arg("actuator");
                c
            }
            "splitproxy-check" => Command::new(
                self.check_exe
                    .as_ref()
                    .context("the splitproxy-check binary is not built")?,
            ),
            other => bail!("the lab has no binary for the image {image:?} ({other})"),
        };
        if container.command.is_some() {
            bail!("the lab runs the images' entrypoints only (container.command is set)");
        }
        cmd.args(container.args.iter().flatten());
        Ok(cmd)
    }

    /// The container's environment: what a kubelet injects, then the container's own.
    fn environment(
        &self,
        pod: &Pod,
        container: &Container,
        node: usize,
    ) -> Result<Vec<(String, String)>> {
        let (host, port) = &self.kubernetes_service;
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        env.insert("KUBERNETES_SERVICE_HOST".into(), host.clone());
        env.insert("KUBERNETES_SERVICE_PORT".into(), port.to_string());
        env.insert("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into());
        env.insert("HOSTNAME".into(), self.node_names[node].clone());
        let node_ip = self.node_ips[node].to_string();
        for e in container.env.iter().flatten() {
            let value = match (&e.value, &e.value_from) {
                (Some(v), _) => v.clone(),
                (None, Some(from)) => {
                    let field = from
                        .field_ref
                        .as_ref()
                        .map(|f| f.field_path.as_str())
                        .with_context(|| format!("env {}: only fieldRef is supported", e.name))?;
                    match field {
                        "metadata.name" => pod.metadata.name.clone().unwrap_or_default(),
                        "metadata.namespace" => NAMESPACE.to_string(),
                        "spec.nodeName" => self.node_names[node].clone(),
                        "spec.serviceAccountName" => pod
                            .spec
                            .as_ref()
                            .and_then(|s| s.service_account_name.clone())
                            .unwrap_or_default(),
                        "status.podIP" | "status.hostIP" => node_ip.clone(),
                        other => bail!("env {}: fieldRef {other} is not supported", e.name),
                    }
                }
                (None, None) => String::new(),
            };
            env.insert(e.name.clone(), value);
        }
        if let Ok(level) = std::env::var("RUST_LOG") {
            env.insert("RUST_LOG".into(), level);
        }
        Ok(env.into_iter().collect())
    }

    /// Writes a volume's files into `dir` as a kubelet would.
    async fn materialise(
        &self,
        pod: &Pod,
        volume: &Volume,
        dir: &Path,
        config_maps: &mut Vec<ConfigMapVolume>,
    ) -> Result<()> {
        if let Some(cm) = &volume.config_map {
            let items = key_paths(cm.items.iter().flatten().map(|i| (&i.key, &i.path)));
            self.write_config_map(&cm.name, &items, dir).await?;
            config_maps.push(ConfigMapVolume {
                dir: dir.to_path_buf(),
                name: cm.name.clone(),
                items,
            });
            return Ok(());
        }
        if let Some(secret) = &volume.secret {
            let name = secret
                .secret_name
                .clone()
                .context("a secret without a name")?;
            let items = key_paths(secret.items.iter().flatten().map(|i| (&i.key, &i.path)));
            return self.write_secret(&name, &items, dir).await;
        }
        let Some(projected) = &volume.projected else {
            bail!("only configMap, secret and projected volumes are supported");
        };
        for source in projected.sources.iter().flatten() {
            if let Some(t) = &source.service_account_token {
                let token = self
                    .token(pod, t.audience.as_deref(), t.expiration_seconds)
                    .await?;
                write_atomically(&dir.join(&t.path), token.as_bytes())?;
            }
            if let Some(cm) = &source.config_map {
                let items = key_paths(cm.items.iter().flatten().map(|i| (&i.key, &i.path)));
                self.write_config_map(&cm.name, &items, dir).await?;
                config_maps.push(ConfigMapVolume {
                    dir: dir.to_path_buf(),
                    name: cm.name.clone(),
                    items,
                });
            }
            if let Some(secret) = &source.secret {
                let items = key_paths(secret.items.iter().flatten().map(|i| (&i.key, &i.path)));
                self.write_secret(&secret.name, &items, dir).await?;
            }
            if let Some(pc) = &source.pod_certificate {
                self.pod_certificate(pod, pc, dir).await?;
            }
            if let Some(d) = &source.downward_api {
                for item in d.items.iter().flatten() {
                    let field = item.field_ref.as_ref().map(|f| f.field_path.as_str());
                    let value = match field {
                        Some("metadata.namespace") => NAMESPACE.to_string(),
                        Some("metadata.name") => pod.metadata.name.clone().unwrap_or_default(),
                        other => bail!("downwardAPI {other:?} is not supported"),
                    };
                    write_atomically(&dir.join(&item.path), value.as_bytes())?;
                }
            }
        }
        Ok(())
    }

    /// A `podCertificate` projection, as the kubelet serves it: a fresh key of the requested
    /// type, a PodCertificateRequest created with the node's own credentials (so the API server
    /// checks the pod, its node and its account), the signer's answer awaited (bounded), and the
    /// key and chain written where the projection says.
    async fn pod_certificate(
        &self,
        pod: &Pod,
        projection: &k8s_openapi::api::core::v1::PodCertificateProjection,
        dir: &Path,
    ) -> Result<()> {
        use k8s_openapi::api::certificates::v1::PodCertificateRequest;
        let spec = pod.spec.as_ref().context("a Pod without spec")?;
        let node_name = spec.node_name.clone().context("a Pod on no node")?;
        let node = self
            .node_names
            .iter()
            .position(|n| *n == node_name)
            .with_context(|| format!("no node {node_name}"))?;
        let alg = match projection.key_type.as_str() {
            "ECDSAP256" => &rcgen::PKCS_ECDSA_P256_SHA256,
            "ECDSAP384" => &rcgen::PKCS_ECDSA_P384_SHA384,
            "ED25519" => &rcgen::PKCS_ED25519,
            other => bail!("the lab's kubelet makes no {other} keys"),
        };
        let key = rcgen::KeyPair::generate_for(alg)?;
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        let stub = params.serialize_request(&key)?;
        let account = spec
            .service_account_name
            .clone()
            .unwrap_or_else(|| "default".into());
        let sa: ServiceAccount = Api::namespaced(self.client.clone(), NAMESPACE)
            .get(&account)
            .await?;
        let node_object: k8s_openapi::api::core::v1::Node =
            Api::all(self.client.clone()).get(&node_name).await?;
        let request: PodCertificateRequest = serde_json::from_value(json!({
            "apiVersion": "certificates.k8s.io/v1", "kind": "PodCertificateRequest",
            "metadata": {
                "generateName": format!("req-{}-", pod.metadata.name.as_deref().unwrap_or("pod")),
                "namespace": NAMESPACE,
            },
            "spec": {
                "signerName": projection.signer_name,
                "podName": pod.metadata.name,
                "podUID": pod.metadata.uid,
                "serviceAccountName": account,
                "serviceAccountUID": sa.metadata.uid,
                "nodeName": node_name,
                "nodeUID": node_object.metadata.uid,
                "maxExpirationSeconds": projection.max_expiration_seconds,
                "stubPKCS10Request": base64_encode(stub.der()),
                "unverifiedUserAnnotations": projection.user_annotations,
            },
        }))?;
        let api: Api<PodCertificateRequest> =
            Api::namespaced(self.node_clients[node].clone(), NAMESPACE);
        let created = api
            .create(&PostParams::default(), &request)
            .await
            .context("creating the PodCertificateRequest as the node")?;
        let name = created.metadata.name.clone().unwrap_or_default();
        let deadline = tokio::time::Instant::now() + self.volume_timeout;
        let chain = loop {
            // The Node authorizer learns of a new request asynchronously: a read right after the
            // create may be refused for a moment, so errors are retried until the deadline.
            let status = match api.get(&name).await {
                Ok(current) => current.status.unwrap_or_default(),
                Err(e) if tokio::time::Instant::now() > deadline => {
                    return Err(e).context("reading the PodCertificateRequest as the node");
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            if let Some(chain) = status.certificate_chain.filter(|c| !c.is_empty()) {
                break chain;
            }
            if let Some(c) = status
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "Denied" || c.type_ == "Failed")
            {
                bail!(
                    "PodCertificateRequest {name}: {} ({}): {}",
                    c.type_,
                    c.reason,
                    c.message
                );
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "PodCertificateRequest {name} was not answered in {:?}",
                    self.volume_timeout
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let key_pem = key.serialize_pem();
        if let Some(path) = &projection.credential_bundle_path {
            write_atomically(&dir.join(path), format!("{key_pem}{chain}").as_bytes())?;
        }
        if let Some(path) = &projection.key_path {
            write_atomically(&dir.join(path), key_pem.as_bytes())?;
        }
        if let Some(path) = &projection.certificate_chain_path {
            write_atomically(&dir.join(path), chain.as_bytes())?;
        }
        Ok(())
    }

    /// A token of the pod's ServiceAccount bound to the pod, as the kubelet requests it.
    pub(super) async fn token(
        &self,
        pod: &Pod,
        audience: Option<&str>,
        expiration: Option<i64>,
    ) -> Result<String> {
        let account = pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into());
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: audience.map(|a| vec![a.to_string()]),
                expiration_seconds: expiration,
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: pod.metadata.name.clone(),
                    uid: pod.metadata.uid.clone(),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), NAMESPACE);
        let answer = accounts
            .create_token_request(&account, &PostParams::default(), &request)
            .await
            .with_context(|| format!("TokenRequest for {account}"))?;
        answer
            .status
            .and_then(|s| s.token)
            .context("a TokenRequest answered without a token")
    }

    /// Writes ConfigMap `name`'s keys into `dir`, waiting (bounded) until it exists, as a
    /// kubelet holds a container back until its non-optional ConfigMap is there.
    async fn write_config_map(
        &self,
        name: &str,
        items: &[(String, String)],
        dir: &Path,
    ) -> Result<()> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), NAMESPACE);
        let deadline = tokio::time::Instant::now() + self.volume_timeout;
        let cm = loop {
            if let Some(cm) = api.get_opt(name).await? {
                break cm;
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "ConfigMap {name} did not appear in {:?}",
                    self.volume_timeout
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let data = cm.data.unwrap_or_default();
        write_items(&data, items, dir)
    }

    async fn write_secret(&self, name: &str, items: &[(String, String)], dir: &Path) -> Result<()> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), NAMESPACE);
        let secret = api
            .get(name)
            .await
            .with_context(|| format!("Secret {name}"))?;
        let data: BTreeMap<String, String> = secret
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
            .collect();
        write_items(&data, items, dir)
    }
}

fn key_paths<'a>(items: impl Iterator<Item = (&'a String, &'a String)>) -> Vec<(String, String)> {
    items.map(|(k, p)| (k.clone(), p.clone())).collect()
}

/// Writes `items` (key → path; every key when empty) of `data` into `dir`.
pub(super) fn write_items(
    data: &BTreeMap<String, String>,
    items: &[(String, String)],
    dir: &Path,
) -> Result<()> {
    let pairs: Vec<(String, String)> = if items.is_empty() {
        data.keys().map(|k| (k.clone(), k.clone())).collect()
    } else {
        items.to_vec()
    };
    for (key, path) in pairs {
        let value = data.get(&key).with_context(|| format!("no key {key}"))?;
        write_atomically(&dir.join(path), value.as_bytes())?;
    }
    Ok(())
}

/// Replaces `path` by a rename, so a reader sees the old or the new content, never half.
fn write_atomically(path: &Path, content: &[u8]) -> Result<()> {
    if std::fs::read(path).is_ok_and(|old| old == content) {
        return Ok(());
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let tmp = path.with_extension("tmp-write");
    std::fs::write(&tmp, content)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Rewrites the files of every ConfigMap volume whose ConfigMap changed (the kubelet's sync).
pub(super) async fn refresh_config_maps(
    client: &kube::Client,
    pods: &Arc<Mutex<BTreeMap<String, RunningPod>>>,
) {
    let volumes: Vec<ConfigMapVolume> = lock(pods)
        .values()
        .flat_map(|p| p.config_maps.clone())
        .collect();
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
    for ConfigMapVolume { dir, name, items } in volumes {
        if let Ok(Some(cm)) = api.get_opt(&name).await {
            let data = cm.data.unwrap_or_default();
            if let Err(e) = write_items(&data, &items, &dir) {
                eprintln!("[install] ConfigMap {name} into {}: {e:#}", dir.display());
            }
        }
    }
}

/// Makes `cmd` run in a private mount namespace with a tmpfs on `/run` and each `(source,
/// target)` directory bound at its target (which must lie under `/run` or `/var/run`), so that
/// its volumes exist only for it and vanish with it.
#[allow(unsafe_code)]
fn mount_namespace(cmd: &mut Command, mounts: &[(PathBuf, PathBuf)]) -> Result<()> {
    let mut dirs: Vec<CString> = Vec::new();
    let mut binds: Vec<(CString, CString)> = Vec::new();
    for (source, target) in mounts {
        let target = match target.strip_prefix("/var/run") {
            Ok(rest) => Path::new("/run").join(rest),
            Err(_) => target.clone(),
        };
        let rest = target.strip_prefix("/run").with_context(|| {
            format!(
                "the lab mounts volumes under /run or /var/run only, not at {}",
                target.display()
            )
        })?;
        let mut at = PathBuf::from("/run");
        for part in rest.components() {
            at.push(part);
            let c = CString::new(at.as_os_str().as_encoded_bytes())?;
            if !dirs.contains(&c) {
                dirs.push(c);
            }
        }
        binds.push((
            CString::new(source.as_os_str().as_encoded_bytes())?,
            CString::new(target.as_os_str().as_encoded_bytes())?,
        ));
    }
    // SAFETY: the closure runs in the forked child before exec and only makes system calls on
    // strings prepared above (no allocation, no locks).
    unsafe {
        cmd.pre_exec(move || {
            use nix::mount::{MsFlags, mount};
            use nix::sched::{CloneFlags, unshare};
            let io = |e: nix::Error| std::io::Error::from_raw_os_error(e as i32);
            unshare(CloneFlags::CLONE_NEWNS).map_err(io)?;
            mount(
                None::<&std::ffi::CStr>,
                c"/",
                None::<&std::ffi::CStr>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&std::ffi::CStr>,
            )
            .map_err(io)?;
            mount(
                Some(c"tmpfs"),
                c"/run",
                Some(c"tmpfs"),
                MsFlags::empty(),
                Some(c"mode=0755"),
            )
            .map_err(io)?;
            for d in &dirs {
                match nix::unistd::mkdir(
                    d.as_c_str(),
                    nix::sys::stat::Mode::from_bits_truncate(0o755),
                ) {
                    Ok(()) | Err(nix::Error::EEXIST) => {}
                    Err(e) => return Err(io(e)),
                }
            }
            for (source, target) in &binds {
                mount(
                    Some(source.as_c_str()),
                    target.as_c_str(),
                    None::<&std::ffi::CStr>,
                    MsFlags::MS_BIND,
                    None::<&std::ffi::CStr>,
                )
                .map_err(io)?;
            }
            Ok(())
        });
    }
    Ok(())
}

/// Standard base64 (the JSON form of a Kubernetes `[]byte` field).
fn base64_encode(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}
