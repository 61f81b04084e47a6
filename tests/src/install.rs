//! The chart, installed and run as a cluster runs it, on the lab's nodes and without kubelets.
//!
//! [`Install::start`] renders `charts/splitproxy` with `helm template`, applies every object
//! server-side to the lab's real API server (so RBAC, admission and the Node authorizer are the
//! real ones), then does what the scheduler, the kubelets and the EndpointSlice controller would:
//!
//! - one Pod object per Deployment replica (on distinct nodes: the chart's anti-affinity) and per
//!   node for the DaemonSet, created through the API server, so the ServiceAccount admission
//!   plugin adds the API token volume as it does on a cluster;
//! - each container runs with exactly its rendered arguments and environment (plus what a kubelet
//!   injects: `KUBERNETES_SERVICE_HOST/PORT` of the `kubernetes` Service unless the container
//!   sets them), host network in its node's namespace, and its volumes at their mount paths:
//!   ServiceAccount tokens obtained with the TokenRequest API bound to the Pod (so they carry the
//!   node-name claim), ConfigMaps and Secrets the chart or the brains create, downward API files;
//!   a ConfigMap that does not exist yet holds the container back, as a kubelet would;
//! - readiness probes (`httpGet`) decide the endpoints of the chart's Services, written as
//!   EndpointSlices, which is how the actuators find the brains.
//!
//! What differs from a kubelet, deliberately: the binaries are the workspace's (the image's
//! entrypoint is mapped to `splitproxy-lab brain|actuator` or `splitproxy-check`), the
//! containers share their node's root file system except under `/run` (each process gets a
//! private mount namespace with a tmpfs on `/run` and its volumes bound under it, so nothing is
//! mounted on the host and everything goes with the process; the chart mounts every volume under
//! `/var/run/secrets`, a link to `/run/secrets`), and processes run as root.
//!
//! Each node reaches the API server at 127.0.0.1:[`NODE_API_PORT`] (a forwarder in its
//! namespace), the way nodes of many clusters reach it through a local proxy; the chart is
//! installed with `kubeProxy.mode=replace` and `k8sServiceHost=127.0.0.1`.
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Pod, PodSpec, Secret, Service, ServiceAccount, Volume,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::Result;
use crate::controlplane::ControlPlane;
use crate::portfwd::{Forwarder, forward_into, forward_port};
use crate::process::Child;
use crate::topology::Cluster;

/// Where every node reaches the API server (its own loopback, forwarded).
pub const NODE_API_PORT: u16 = 6443;
/// The release's name and namespace.
pub const RELEASE: &str = "splitproxy";
pub const NAMESPACE: &str = "kube-system";
/// The Kubernetes version the chart is rendered for: the API server the lab runs.
pub const KUBE_VERSION: &str = "1.37.2";
/// The field manager of the objects this module writes as controllers would.
const MANAGER: &str = "splitproxy-lab";

/// How the chart is installed.
#[derive(Debug, Clone)]
pub struct InstallOptions {
    /// `--set` values after the lab's own (`kubeProxy.mode=replace`, `k8sServiceHost`, ports).
    pub set: Vec<String>,
    /// Brain replicas (`brain.replicas`), on the first nodes.
    pub brains: usize,
}

impl Default for InstallOptions {
    fn default() -> Self {
        InstallOptions {
            set: Vec::new(),
            brains: 2,
        }
    }
}

impl InstallOptions {
    /// These options plus the values that give the chart's brains the lab's settings: brain
    /// replicas, cluster CIDRs, detect-local mode and interface, nodePort addresses and
    /// masquerading, and the lab's Service CIDRs only when the lab's brain sets its own
    /// (otherwise the brains follow the ServiceCIDR objects, as the chart's default does).
    pub fn with_lab_values(&self, lab: &crate::lab::LabOptions) -> InstallOptions {
        let rules = lab.effective_brain_options().rules;
        let list = |v: Vec<String>| format!("{{{}}}", v.join(","));
        let mut set = vec![format!("brain.replicas={}", self.brains)];
        if !rules.cluster_cidrs.is_empty() {
            set.push(format!(
                "proxy.clusterCIDRs={}",
                list(
                    rules
                        .cluster_cidrs
                        .iter()
                        .map(ToString::to_string)
                        .collect()
                )
            ));
        }
        if !lab.brain.rules.service_cidrs.is_empty() {
            set.push(format!(
                "proxy.serviceCIDRs={}",
                list(
                    rules
                        .service_cidrs
                        .iter()
                        .map(ToString::to_string)
                        .collect()
                )
            ));
        }
        // The brain's own flags, as it renders them (one source of truth for their spelling).
        let args = rules.to_args();
        let flag = |name: &str| {
            let at = args.iter().position(|a| *a == format!("--{name}"))?;
            args.get(at + 1).cloned()
        };
        if let Some(mode) = flag("detect-local-mode") {
            set.push(format!("proxy.detectLocalMode={mode}"));
        }
        if let Some(prefix) = flag("pod-interface-name-prefix") {
            set.push(format!("proxy.podInterfaceNamePrefix={prefix}"));
        }
        if let Some(bridge) = flag("pod-bridge-interface") {
            set.push(format!("proxy.podBridgeInterface={bridge}"));
        }
        if let Some(addresses) = flag("nodeport-addresses") {
            set.push(format!("proxy.nodePortAddresses={{{addresses}}}"));
        }
        if args.iter().any(|a| a == "--masquerade-all") {
            set.push("proxy.masqueradeAll=true".into());
        }
        set.extend(self.set.iter().cloned());
        InstallOptions {
            set,
            brains: self.brains,
        }
    }
}

/// A ConfigMap's keys in a volume directory, followed as a kubelet follows them.
#[derive(Debug, Clone)]
struct ConfigMapVolume {
    dir: PathBuf,
    name: String,
    /// Key → path; every key when empty.
    items: Vec<(String, String)>,
}

/// One running pod: its object as the API server holds it, its node and its process.
struct RunningPod {
    pod: Pod,
    node: usize,
    child: Option<Child>,
    /// ConfigMap volumes to follow: volume directory → (ConfigMap name, items).
    config_maps: Vec<ConfigMapVolume>,
    log: PathBuf,
}

/// The chart, installed on the lab's nodes.
pub struct Install {
    client: kube::Client,
    exe: PathBuf,
    check_exe: Option<PathBuf>,
    dir: PathBuf,
    /// The rendered objects, test hooks apart.
    objects: Vec<DynamicObject>,
    /// The `helm test` hooks.
    hooks: Vec<DynamicObject>,
    pods: Arc<Mutex<BTreeMap<String, RunningPod>>>,
    node_names: Vec<String>,
    node_ips: Vec<IpAddr>,
    netns: Vec<crate::netns::Netns>,
    _api_links: Vec<Forwarder>,
    controllers: Option<tokio::task::JoinHandle<()>>,
    kubernetes_service: (String, u16),
    /// The test's operator: its token and its links to brain pods.
    operator: tokio::sync::Mutex<Operator>,
}

#[derive(Default)]
struct Operator {
    token: Option<String>,
    links: BTreeMap<String, Forwarder>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `helm template` of the chart with the lab's values and `set`: every document.
pub fn render(set: &[String]) -> Result<Vec<DynamicObject>> {
    let chart = crate::tools::workspace_root().join("charts/splitproxy");
    let mut cmd = Command::new(crate::tools::binary("helm")?);
    cmd.args(["template", RELEASE]).arg(&chart).args([
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
    ]);
    for s in set {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().context("running helm template")?;
    if !out.status.success() {
        bail!(
            "helm template failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    crate::manifests::documents(&String::from_utf8_lossy(&out.stdout))
}

fn is_hook(obj: &DynamicObject) -> bool {
    obj.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key("helm.sh/hook"))
}

fn kind(obj: &DynamicObject) -> &str {
    obj.types.as_ref().map(|t| t.kind.as_str()).unwrap_or("")
}

fn yaml_of(objects: &[DynamicObject]) -> Result<String> {
    let mut out = String::new();
    for o in objects {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(o)?);
    }
    Ok(out)
}

impl Install {
    /// Renders and applies the chart, then runs its brains and, once the brains published their
    /// CA, its actuators. Returns when every container was started (not when it is ready).
    pub async fn start(
        cp: &ControlPlane,
        cluster: &Cluster,
        exe: &Path,
        dir: &Path,
        opts: &InstallOptions,
    ) -> Result<Install> {
        let dir = dir.join("install");
        std::fs::create_dir_all(&dir)?;
        let mut set = vec![
            "kubeProxy.mode=replace".to_string(),
            "k8sServiceHost=127.0.0.1".to_string(),
            format!("k8sServicePort={NODE_API_PORT}"),
            "logFormat=text".to_string(),
        ];
        set.extend(opts.set.iter().cloned());
        let (hooks, objects): (Vec<_>, Vec<_>) = render(&set)?.into_iter().partition(is_hook);
        let client = cp.client();
        crate::manifests::apply(&client, &yaml_of(&objects)?, NAMESPACE, false)
            .await
            .context("applying the rendered chart")?;
        // What kube-controller-manager's root CA publisher writes into every namespace.
        let root_ca = cp.pki().ca_pem().to_string();
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
        cms.patch(
            "kube-root-ca.crt",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "kube-root-ca.crt"},
                "data": {"ca.crt": root_ca},
            })),
        )
        .await?;
        let svc: Service = Api::namespaced(client.clone(), "default")
            .get("kubernetes")
            .await?;
        let kubernetes_service = (
            svc.spec
                .and_then(|s| s.cluster_ip)
                .context("the kubernetes Service has no ClusterIP")?,
            443,
        );
        let mut api_links = Vec::new();
        for node in cluster.nodes() {
            api_links.push(forward_port(
                node.netns(),
                SocketAddr::from(([127, 0, 0, 1], NODE_API_PORT)),
                cp.addr(),
            )?);
        }
        let check_exe = exe.parent().map(|d| d.join("splitproxy-check"));
        let mut install = Install {
            client,
            exe: exe.to_path_buf(),
            check_exe: check_exe.filter(|p| p.exists()),
            dir,
            objects,
            hooks,
            pods: Arc::new(Mutex::new(BTreeMap::new())),
            node_names: cluster
                .nodes()
                .iter()
                .map(|n| n.name().to_string())
                .collect(),
            node_ips: cluster.nodes().iter().map(|n| IpAddr::V4(n.ip())).collect(),
            netns: cluster.nodes().iter().map(|n| n.netns().handle()).collect(),
            _api_links: api_links,
            controllers: None,
            kubernetes_service,
            operator: Default::default(),
        };
        install.controllers = Some(install.spawn_controllers());
        // The brains first: with tls.source=brain the actuators' CA ConfigMap is theirs.
        for deploy in install.of_kind("Deployment") {
            let replicas = deploy.data["spec"]["replicas"].as_u64().unwrap_or(1) as usize;
            if replicas > install.node_names.len() {
                bail!("{replicas} brains need as many nodes (required anti-affinity)");
            }
            let name = deploy.metadata.name.clone().unwrap_or_default();
            for i in 0..replicas {
                install.run_pod(&deploy, &format!("{name}-{i}"), i).await?;
            }
        }
        for ds in install.of_kind("DaemonSet") {
            let name = ds.metadata.name.clone().unwrap_or_default();
            for i in 0..install.node_names.len() {
                let pod = format!("{name}-{}", install.node_names[i]);
                install.run_pod(&ds, &pod, i).await?;
            }
        }
        Ok(install)
    }

    fn of_kind(&self, k: &str) -> Vec<DynamicObject> {
        self.objects
            .iter()
            .filter(|o| kind(o) == k)
            .cloned()
            .collect()
    }

    /// The rendered objects (test hooks apart).
    pub fn objects(&self) -> &[DynamicObject] {
        &self.objects
    }

    /// The names of the pods of `component` (`brain` or `actuator`), and their nodes.
    pub fn pods_of(&self, component: &str) -> Vec<(String, usize)> {
        lock(&self.pods)
            .iter()
            .filter(|(_, p)| {
                p.pod
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("app.kubernetes.io/component"))
                    .is_some_and(|c| c == component)
            })
            .map(|(n, p)| (n.clone(), p.node))
            .collect()
    }

    /// The last lines of a pod's log.
    pub fn log_tail(&self, pod: &str, lines: usize) -> String {
        match lock(&self.pods).get(pod) {
            Some(p) => crate::process::log_tail(&p.log, lines),
            None => format!("(no pod {pod})"),
        }
    }

    /// Kills a pod's process with SIGKILL (a crash, or a node lost) and deletes the Pod object,
    /// as its controller would before replacing it; its endpoints go with it.
    pub async fn kill_pod(&self, name: &str) -> Result<()> {
        let child = lock(&self.pods)
            .remove(name)
            .and_then(|mut p| p.child.take());
        if let Some(mut child) = child {
            child.signal(nix::sys::signal::Signal::SIGKILL)?;
            child.stop()?;
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NAMESPACE);
        pods.delete(name, &DeleteParams::default().grace_period(0))
            .await
            .with_context(|| format!("deleting Pod {name}"))?;
        Ok(())
    }

    /// Creates the Pod `name` from `owner`'s template on node `node` and starts its container.
    async fn run_pod(&self, owner: &DynamicObject, name: &str, node: usize) -> Result<()> {
        let template = &owner.data["spec"]["template"];
        let mut spec: PodSpec = serde_json::from_value(template["spec"].clone())
            .with_context(|| format!("the pod template of {name}"))?;
        spec.node_name = Some(self.node_names[node].clone());
        let mut pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "labels": template["metadata"]["labels"],
                "annotations": template["metadata"]["annotations"],
            },
        }))?;
        pod.spec = Some(spec);
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NAMESPACE);
        let pod = pods
            .create(&PostParams::default(), &pod)
            .await
            .with_context(|| format!("creating Pod {name}"))?;
        self.start_container(pod, node).await
    }

    async fn start_container(&self, pod: Pod, node: usize) -> Result<()> {
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

    /// A token of the pod's ServiceAccount bound to the pod, as the kubelet requests it.
    async fn token(
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
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let cm = loop {
            if let Some(cm) = api.get_opt(name).await? {
                break cm;
            }
            if tokio::time::Instant::now() > deadline {
                bail!("ConfigMap {name} did not appear in 60 s");
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

    /// What the kubelets' probes, their ConfigMap updates and the EndpointSlice controller do,
    /// every 300 ms until the install is dropped.
    fn spawn_controllers(&self) -> tokio::task::JoinHandle<()> {
        let client = self.client.clone();
        let pods = self.pods.clone();
        let services: Vec<Service> = self
            .of_kind("Service")
            .into_iter()
            .filter_map(|o| serde_json::to_value(o).ok())
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect();
        let netns: Vec<_> = self.netns.iter().map(|n| n.handle()).collect();
        let node_ips = self.node_ips.clone();
        let node_names = self.node_names.clone();
        tokio::spawn(async move {
            let mut written: BTreeMap<String, serde_json::Value> = BTreeMap::new();
            let mut rounds = 0u64;
            loop {
                rounds += 1;
                let ready = probe_all(&pods, &netns).await;
                for svc in &services {
                    let slice = endpoint_slice(svc, &pods, &ready, &node_ips, &node_names);
                    let name = slice["metadata"]["name"].as_str().unwrap_or("").to_string();
                    if written.get(&name) == Some(&slice) {
                        continue;
                    }
                    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), NAMESPACE);
                    match api
                        .patch(
                            &name,
                            &PatchParams::apply(MANAGER).force(),
                            &Patch::Apply(&slice),
                        )
                        .await
                    {
                        Ok(_) => {
                            written.insert(name, slice);
                        }
                        Err(e) => eprintln!("[install] EndpointSlice {name}: {e}"),
                    }
                }
                if rounds.is_multiple_of(3) {
                    refresh_config_maps(&client, &pods).await;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    }

    /// Runs the chart's `helm test` pod the way `helm test` does (its hook objects applied, the
    /// pod created and run) and returns whether it passed, with its log.
    pub async fn helm_test(&self, node: usize) -> Result<(bool, String)> {
        let (pods, others): (Vec<_>, Vec<_>) =
            self.hooks.iter().cloned().partition(|o| kind(o) == "Pod");
        crate::manifests::apply(&self.client, &yaml_of(&others)?, NAMESPACE, false).await?;
        let [pod] = pods.as_slice() else {
            bail!("the chart has {} test pods", pods.len());
        };
        let mut object: Pod = serde_json::from_value(serde_json::to_value(pod)?)?;
        let name = object.metadata.name.clone().unwrap_or_default();
        if let Some(spec) = object.spec.as_mut() {
            spec.node_name = Some(self.node_names[node].clone());
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), NAMESPACE);
        let _ = api
            .delete(&name, &DeleteParams::default().grace_period(0))
            .await;
        let created = api.create(&PostParams::default(), &object).await?;
        self.start_container(created, node).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
        loop {
            let status = {
                let mut pods = lock(&self.pods);
                let p = pods.get_mut(&name).context("the test pod vanished")?;
                p.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
            };
            if let Some(status) = status {
                return Ok((status.success(), self.log_tail(&name, 60)));
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "the helm test pod did not end:\n{}",
                    self.log_tail(&name, 60)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A token for an operator: ServiceAccount `name` in the release's namespace, bound to the
    /// chart's operator ClusterRole when `authorised`, for the brain's audience.
    pub async fn operator_token(&self, name: &str, authorised: bool) -> Result<String> {
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), NAMESPACE);
        let sa: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": name, "namespace": NAMESPACE}}))?;
        if accounts.get_opt(name).await?.is_none() {
            accounts.create(&PostParams::default(), &sa).await?;
        }
        if authorised {
            let role = self
                .of_kind("ClusterRole")
                .into_iter()
                .find(|o| {
                    o.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.ends_with("-operator"))
                })
                .context("the chart has no operator ClusterRole")?;
            let binding: ClusterRoleBinding = serde_json::from_value(json!({
                "metadata": {"name": format!("lab-{name}")},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": role.metadata.name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}],
            }))?;
            let api: Api<ClusterRoleBinding> = Api::all(self.client.clone());
            if api.get_opt(&format!("lab-{name}")).await?.is_none() {
                api.create(&PostParams::default(), &binding).await?;
            }
        }
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: Some(vec![self.audience()]),
                expiration_seconds: Some(3600),
                ..Default::default()
            }),
            ..Default::default()
        };
        let answer = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await?;
        answer
            .status
            .and_then(|s| s.token)
            .context("a TokenRequest answered without a token")
    }

    /// A gRPC client of brain pod `pod` as the lab's operator (a ServiceAccount bound to the
    /// chart's operator ClusterRole, its token for the brains' audience, the brains' published
    /// CA, the brains' server name), through a link from host loopback into the pod's node.
    pub async fn operator_client(
        &self,
        pod: &str,
    ) -> Result<
        splitproxy_proto::v1::dataplane_client::DataplaneClient<
            tonic::service::interceptor::InterceptedService<
                tonic::transport::Channel,
                impl tonic::service::Interceptor + use<>,
            >,
        >,
    > {
        let token = {
            let mut operator = self.operator.lock().await;
            if operator.token.is_none() {
                operator.token = Some(self.operator_token("lab-operator", true).await?);
            }
            operator.token.clone().unwrap_or_default()
        };
        self.client_with_token(pod, Some(&token)).await
    }

    /// A gRPC client of brain pod `pod` that presents `token` (or nothing) as a bearer token,
    /// over TLS verified with the brains' published CA.
    pub async fn client_with_token(
        &self,
        pod: &str,
        token: Option<&str>,
    ) -> Result<
        splitproxy_proto::v1::dataplane_client::DataplaneClient<
            tonic::service::interceptor::InterceptedService<
                tonic::transport::Channel,
                impl tonic::service::Interceptor + use<>,
            >,
        >,
    > {
        use tonic::transport::{Certificate, Channel, ClientTlsConfig};
        let addr = {
            let mut operator = self.operator.lock().await;
            if !operator.links.contains_key(pod) {
                operator
                    .links
                    .insert(pod.to_string(), self.brain_link(pod)?);
            }
            operator.links[pod].local_addr()
        };
        let bearer: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>> = match token {
            Some(t) => Some(format!("Bearer {t}").parse()?),
            None => None,
        };
        let server_name = self
            .brain_arg("--tls-server-name")
            .unwrap_or_else(|| "splitproxy-brain".into());
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(self.brain_ca().await?))
            .domain_name(server_name);
        let channel = Channel::from_shared(format!("https://{addr}"))?
            .tls_config(tls)?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await?;
        let client = splitproxy_proto::v1::dataplane_client::DataplaneClient::with_interceptor(
            channel,
            move |mut request: tonic::Request<()>| {
                if let Some(bearer) = &bearer {
                    request
                        .metadata_mut()
                        .insert("authorization", bearer.clone());
                }
                Ok(request)
            },
        )
        .max_decoding_message_size(splitproxy_proto::transport::MAX_UPDATE_MESSAGE);
        Ok(client)
    }

    /// The token the kubelet gave pod `pod` in its volume `volume` (file `token`).
    pub fn token_of(&self, pod: &str, volume: &str) -> Result<String> {
        let path = self
            .dir
            .join(pod)
            .join("volumes")
            .join(volume)
            .join("token");
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    }

    /// GET `path` on brain pod `pod`'s health and metrics port, inside its node.
    pub fn brain_http(&self, pod: &str, path: &str) -> Result<(u16, String)> {
        let node = lock(&self.pods)
            .get(pod)
            .map(|p| p.node)
            .with_context(|| format!("no pod {pod}"))?;
        let port = self
            .brain_arg("--metrics-bind-address")
            .and_then(|l| l.parse::<SocketAddr>().ok())
            .context("the brain's --metrics-bind-address")?
            .port();
        crate::deploy::http_get_in(
            &self.netns[node],
            SocketAddr::from(([127, 0, 0, 1], port)),
            path,
        )
    }

    /// The brains' token audience, from their rendered arguments.
    pub fn audience(&self) -> String {
        self.brain_arg("--token-audience")
            .unwrap_or_else(|| "splitproxy".into())
    }

    /// The value of a rendered brain flag.
    pub fn brain_arg(&self, flag: &str) -> Option<String> {
        let deploy = self.of_kind("Deployment").into_iter().next()?;
        let args = deploy.data["spec"]["template"]["spec"]["containers"][0]["args"].as_array()?;
        args.iter()
            .filter_map(|a| a.as_str())
            .find_map(|a| a.strip_prefix(&format!("{flag}=")).map(str::to_string))
    }

    /// The brains' CA bundle, from the ConfigMap the actuators mount.
    pub async fn brain_ca(&self) -> Result<String> {
        let name = self
            .brain_arg("--ca-configmap")
            .and_then(|v| v.split_once('/').map(|(_, n)| n.to_string()))
            .context("the brains publish no CA ConfigMap (tls.source is not brain)")?;
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), NAMESPACE);
        let cm = api.get(&name).await?;
        cm.data
            .and_then(|d| d.get("ca.crt").cloned())
            .context("the CA ConfigMap has no ca.crt")
    }

    /// A host loopback address that reaches brain pod `pod`'s gRPC port (inside its node).
    pub fn brain_link(&self, pod: &str) -> Result<Forwarder> {
        let node = lock(&self.pods)
            .get(pod)
            .map(|p| p.node)
            .with_context(|| format!("no pod {pod}"))?;
        let listen = self
            .brain_arg("--listen")
            .and_then(|l| l.parse::<SocketAddr>().ok())
            .context("the brain's --listen")?;
        forward_into(
            &self.netns[node],
            SocketAddr::from(([127, 0, 0, 1], 0)),
            SocketAddr::new(self.node_ips[node], listen.port()),
        )
    }
}

impl Drop for Install {
    fn drop(&mut self) {
        if let Some(c) = self.controllers.take() {
            c.abort();
        }
        // Children stop (SIGTERM, then SIGKILL) when dropped; their mounts go with them.
        lock(&self.pods).clear();
    }
}

fn key_paths<'a>(items: impl Iterator<Item = (&'a String, &'a String)>) -> Vec<(String, String)> {
    items.map(|(k, p)| (k.clone(), p.clone())).collect()
}

/// Writes `items` (key → path; every key when empty) of `data` into `dir`.
fn write_items(
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

/// Which running pods pass their readiness probe (`httpGet` on the pod's node).
async fn probe_all(
    pods: &Arc<Mutex<BTreeMap<String, RunningPod>>>,
    netns: &[crate::netns::Netns],
) -> BTreeSet<String> {
    let targets: Vec<(String, usize, u16, String)> = lock(pods)
        .iter()
        .filter_map(|(name, p)| {
            let c = p.pod.spec.as_ref()?.containers.first()?;
            let get = c.readiness_probe.as_ref()?.http_get.as_ref()?;
            let port = match &get.port {
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => *n,
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => {
                    c.ports
                        .iter()
                        .flatten()
                        .find(|p| p.name.as_deref() == Some(s.as_str()))?
                        .container_port
                }
            };
            Some((
                name.clone(),
                p.node,
                port as u16,
                get.path.clone().unwrap_or("/".into()),
            ))
        })
        .collect();
    let mut ready = BTreeSet::new();
    for (name, node, port, path) in targets {
        let ns = netns[node].handle();
        let ok = tokio::task::spawn_blocking(move || {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            matches!(crate::deploy::http_get_in(&ns, addr, &path), Ok((200, _)))
        })
        .await
        .unwrap_or(false);
        if ok {
            ready.insert(name);
        }
    }
    ready
}

/// The EndpointSlice of `svc` as the EndpointSlice controller writes it: the running pods its
/// selector matches, ready when their readiness probe passes.
fn endpoint_slice(
    svc: &Service,
    pods: &Arc<Mutex<BTreeMap<String, RunningPod>>>,
    ready: &BTreeSet<String>,
    node_ips: &[IpAddr],
    node_names: &[String],
) -> serde_json::Value {
    let name = svc.metadata.name.clone().unwrap_or_default();
    let spec = svc.spec.clone().unwrap_or_default();
    let selector = spec.selector.clone().unwrap_or_default();
    let mut endpoints = Vec::new();
    let mut container_ports: BTreeMap<String, i32> = BTreeMap::new();
    for (pod_name, p) in lock(pods).iter() {
        let labels = p.pod.metadata.labels.clone().unwrap_or_default();
        if selector.is_empty() || !selector.iter().all(|(k, v)| labels.get(k) == Some(v)) {
            continue;
        }
        if p.child.is_none() {
            continue;
        }
        for c in p.pod.spec.iter().flat_map(|s| s.containers.iter()) {
            for port in c.ports.iter().flatten() {
                if let Some(n) = &port.name {
                    container_ports.insert(n.clone(), port.container_port);
                }
            }
        }
        let is_ready = ready.contains(pod_name);
        endpoints.push(json!({
            "addresses": [node_ips[p.node].to_string()],
            "conditions": {"ready": is_ready, "serving": is_ready, "terminating": false},
            "nodeName": node_names[p.node],
            "targetRef": {"kind": "Pod", "name": pod_name, "namespace": NAMESPACE,
                          "uid": p.pod.metadata.uid},
        }));
    }
    let ports: Vec<serde_json::Value> = spec
        .ports
        .iter()
        .flatten()
        .map(|p| {
            let port = match &p.target_port {
                Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s)) => {
                    container_ports.get(s).copied().unwrap_or(p.port)
                }
                Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n)) => *n,
                None => p.port,
            };
            json!({"name": p.name, "port": port, "protocol": p.protocol.clone().unwrap_or("TCP".into())})
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{name}-lab"),
            "namespace": NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "splitproxy-lab",
            },
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": ports,
    })
}

/// Rewrites the files of every ConfigMap volume whose ConfigMap changed (the kubelet's sync).
async fn refresh_config_maps(
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
