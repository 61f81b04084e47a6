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
mod controllers;
mod kubelet;
mod operator;

pub use operator::{Bearer, BrainClient};

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

use kubelet::ConfigMapVolume;
use operator::Operator;

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
    /// A rule (or one verb of it) taken out of one of the chart's roles before it is applied: a
    /// test proves the chart's RBAC is all needed.
    pub rbac_edit: Option<RbacEdit>,
    /// How long a kubelet waits for what a pod needs (a ConfigMap, a pod certificate) before
    /// the install fails.
    pub volume_timeout: Duration,
    /// Objects already in the cluster before the install (what an earlier installation left:
    /// an expired Lease, an outdated CA ConfigMap), applied first.
    pub existing: Vec<serde_json::Value>,
}

/// One rule, or one verb of it, removed from a Role or ClusterRole of the chart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbacEdit {
    /// `Role` or `ClusterRole`.
    pub kind: String,
    pub name: String,
    /// The rule's index in the role.
    pub rule: usize,
    /// The verb removed; the whole rule when `None`.
    pub verb: Option<String>,
}

impl RbacEdit {
    /// Applies the edit to the rendered objects; false when the role or rule is not there.
    fn apply(&self, objects: &mut [DynamicObject]) -> bool {
        let Some(role) = objects.iter_mut().find(|o| {
            kind(o) == self.kind && o.metadata.name.as_deref() == Some(self.name.as_str())
        }) else {
            return false;
        };
        let Some(rules) = role.data["rules"].as_array_mut() else {
            return false;
        };
        if self.rule >= rules.len() {
            return false;
        }
        match &self.verb {
            None => {
                rules.remove(self.rule);
                true
            }
            Some(verb) => match rules[self.rule]["verbs"].as_array_mut() {
                Some(verbs) => {
                    let before = verbs.len();
                    verbs.retain(|v| v.as_str() != Some(verb.as_str()));
                    verbs.len() < before
                }
                None => false,
            },
        }
    }
}

impl Default for InstallOptions {
    fn default() -> Self {
        InstallOptions {
            set: Vec::new(),
            brains: 2,
            rbac_edit: None,
            volume_timeout: Duration::from_secs(60),
            existing: Vec::new(),
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
            ..self.clone()
        }
    }
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
    /// Each node's own credentials (`system:node:NAME` in `system:nodes`), for what its kubelet
    /// does in its name (PodCertificateRequests, which the Node authorizer and NodeRestriction
    /// confine to the node's own pods).
    node_clients: Vec<kube::Client>,
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
    /// How long a kubelet waits for what a pod needs.
    volume_timeout: Duration,
    /// The test's operator: its token and its links to brain pods.
    operator: tokio::sync::Mutex<Operator>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the API server serves, as `helm install` sees it (`.Capabilities.APIVersions`): every
/// `group/version` and `group/version/Kind`.
pub async fn api_versions(client: &kube::Client) -> Result<Vec<String>> {
    let discovery = kube::discovery::Discovery::new(client.clone())
        .run()
        .await
        .context("discovering the API server's resources")?;
    let mut out = BTreeSet::new();
    for group in discovery.groups() {
        for (resource, _) in group.recommended_resources() {
            let gv = if resource.group.is_empty() {
                resource.version.clone()
            } else {
                format!("{}/{}", resource.group, resource.version)
            };
            out.insert(format!("{gv}/{}", resource.kind));
            out.insert(gv);
        }
    }
    Ok(out.into_iter().collect())
}

/// `helm template` of the chart with the lab's values and `set`, for a cluster serving
/// `api_versions`: every document.
pub fn render(set: &[String], api_versions: &[String]) -> Result<Vec<DynamicObject>> {
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
    for v in api_versions {
        cmd.args(["--api-versions", v]);
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

/// Whether `dir` lies under `/run` (or `/var/run`), which every container's private mount
/// namespace covers with a tmpfs before binding its volumes there: volumes kept under it would
/// be hidden from their own bind mounts.
pub fn under_run(dir: &Path) -> bool {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    dir.starts_with("/run") || dir.starts_with("/var/run")
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
        if under_run(&dir) {
            bail!(
                "the chart's pods keep their volumes in {}, under /run, which each container's \
                 mount namespace covers with a tmpfs: use a directory elsewhere",
                dir.display()
            );
        }
        let mut set = vec![
            "kubeProxy.mode=replace".to_string(),
            "k8sServiceHost=127.0.0.1".to_string(),
            format!("k8sServicePort={NODE_API_PORT}"),
            "logFormat=text".to_string(),
        ];
        set.extend(opts.set.iter().cloned());
        let client = cp.client();
        if !opts.existing.is_empty() {
            let yaml = opts
                .existing
                .iter()
                .map(serde_yaml::to_string)
                .collect::<Result<Vec<_>, _>>()?
                .join("---\n");
            crate::manifests::apply(&client, &yaml, NAMESPACE, false)
                .await
                .context("applying the objects that exist before the install")?;
        }
        let (hooks, mut objects): (Vec<_>, Vec<_>) = render(&set, &api_versions(&client).await?)?
            .into_iter()
            .partition(is_hook);
        if let Some(edit) = &opts.rbac_edit
            && !edit.apply(&mut objects)
        {
            bail!("the chart has no {edit:?} to remove");
        }
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
        let mut node_clients = Vec::new();
        for node in cluster.nodes() {
            let user = format!("system:node:{}", node.name());
            let kubeconfig = cp.kubeconfig_for_user(&user, &["system:nodes"])?;
            node_clients.push(crate::controlplane::client_from_file(&kubeconfig).await?);
        }
        let mut install = Install {
            client,
            node_clients,
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
            volume_timeout: opts.volume_timeout,
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

    /// The release as the lab's `status` shows it: each pod, its component and node, and its
    /// log; the brains' rendered arguments.
    pub fn status(&self) -> serde_json::Value {
        let pods: Vec<serde_json::Value> = lock(&self.pods)
            .iter()
            .map(|(name, p)| {
                let component = p
                    .pod
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("app.kubernetes.io/component").cloned());
                json!({
                    "pod": name,
                    "component": component,
                    "node": self.node_names[p.node],
                    "running": p.child.is_some(),
                    "log": p.log,
                })
            })
            .collect();
        let brain_args = self
            .of_kind("Deployment")
            .into_iter()
            .next()
            .map(|d| d.data["spec"]["template"]["spec"]["containers"][0]["args"].clone());
        json!({
            "release": RELEASE,
            "namespace": NAMESPACE,
            "pods": pods,
            "brain_args": brain_args,
        })
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
