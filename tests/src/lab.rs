//! A whole splitproxy installation on one machine: etcd and kube-apiserver on loopback, node
//! namespaces wired into a cluster network with Node objects, one or more brains, and an
//! actuator per node. End-to-end tests and the `splitproxy-lab` command both build on it.
//!
//! Applying Kubernetes YAML also creates a pod (namespace + server) for every endpoint address of
//! every EndpointSlice that falls in a node's pod CIDR, listening on the slice's ports, so a
//! scenario is just a directory of objects.
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Namespace, Node as K8sNode, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, Patch, PatchParams};

use crate::Result;
use crate::certs::Pki;
use crate::controlplane::{ControlPlane, ControlPlaneOptions};
use crate::deploy::{ACTUATOR_HEALTHZ, Actuator, Brain, BrainOptions, http_get_in};
use crate::podserver::PodServer;
use crate::process::wait_until;
use crate::topology::{Cluster, ClusterSpec, Pod};

#[derive(Debug, Clone)]
pub struct LabOptions {
    /// The multi-call binary (`splitproxy-lab`) that runs brains and actuators.
    pub exe: PathBuf,
    pub nodes: usize,
    pub brains: usize,
    pub service_cidr: String,
    /// Extra brain flags.
    pub brain: BrainOptions,
    /// Where logs and certificates go; a temporary directory when `None`.
    pub dir: Option<PathBuf>,
}

impl LabOptions {
    pub fn new(exe: impl Into<PathBuf>) -> Self {
        LabOptions {
            exe: exe.into(),
            nodes: 2,
            brains: 1,
            service_cidr: "10.96.0.0/16".into(),
            brain: BrainOptions {
                service_cidrs: vec!["10.96.0.0/16".into()],
                extra_args: Vec::new(),
            },
            dir: None,
        }
    }
}

struct PodEntry {
    pod: Pod,
    tcp: BTreeSet<u16>,
    udp: BTreeSet<u16>,
    server: Option<PodServer>,
}

pub struct Lab {
    pub opts: LabOptions,
    pub cp: ControlPlane,
    pub cluster: Cluster,
    pub pki: Pki,
    pub brains: Vec<Option<Brain>>,
    brain_addrs: Vec<SocketAddr>,
    pub actuators: Vec<Actuator>,
    /// A client certificate for operators (grpcurl) and tests.
    pub operator_tls: crate::certs::TlsFiles,
    pods: Mutex<BTreeMap<String, PodEntry>>,
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl Lab {
    pub async fn start(opts: LabOptions) -> Result<Lab> {
        let (dir, tmp) = match &opts.dir {
            Some(d) => {
                std::fs::create_dir_all(d)?;
                (d.clone(), None)
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("splitproxy-lab-")
                    .tempdir()?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let cp = ControlPlane::start(ControlPlaneOptions {
            service_cluster_ip_range: opts.service_cidr.clone(),
            ..Default::default()
        })
        .await?;
        let cluster = Cluster::new(ClusterSpec::new(opts.nodes))?;
        let pki = Pki::new("splitproxy-lab")?;
        let operator_tls = pki.write(&dir, "operator", &pki.client_cert("operator")?)?;
        let mut lab = Lab {
            cp,
            cluster,
            pki,
            brains: Vec::new(),
            brain_addrs: Vec::new(),
            actuators: Vec::new(),
            operator_tls,
            pods: Mutex::new(BTreeMap::new()),
            dir,
            _tmp: tmp,
            opts,
        };
        lab.create_node_objects().await?;
        for i in 0..lab.opts.brains {
            let brain = lab.spawn_brain(i, None)?;
            lab.brain_addrs.push(brain.grpc);
            lab.brains.push(Some(brain));
        }
        for i in 0..lab.cluster.nodes().len() {
            let node = lab.cluster.node(i);
            let a = Actuator::start(
                &lab.opts.exe,
                node.netns(),
                node.name(),
                &lab.brain_addrs,
                &lab.pki,
                &lab.dir,
            )?;
            lab.actuators.push(a);
        }
        lab.wait_ready(Duration::from_secs(60))?;
        Ok(lab)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn spawn_brain(&self, i: usize, addr: Option<SocketAddr>) -> Result<Brain> {
        Brain::start(
            &self.opts.exe,
            self.cp.kubeconfig_path(),
            &self.pki,
            &self.dir,
            &format!("brain-{i}"),
            addr,
            &self.opts.brain,
        )
    }

    pub fn brain(&self, i: usize) -> &Brain {
        self.brains[i].as_ref().expect("brain is running")
    }

    /// Stops brain `i` (SIGTERM); actuators keep their rules.
    pub fn stop_brain(&mut self, i: usize) -> Result<()> {
        if let Some(mut b) = self.brains[i].take() {
            b.child.stop()?;
        }
        Ok(())
    }

    /// Starts brain `i` again. It binds a fresh port (its old one may have been taken by any
    /// process meanwhile) and every node's forwarder is pointed at it.
    pub fn start_brain(&mut self, i: usize) -> Result<()> {
        let b = self.spawn_brain(i, None)?;
        self.brain_addrs[i] = b.grpc;
        self.brains[i] = Some(b);
        for n in 0..self.actuators.len() {
            self.relink_actuator(n)?;
        }
        Ok(())
    }

    /// Stops the actuator of node `i` (SIGTERM); its rules stay in the kernel.
    pub fn stop_actuator(&mut self, i: usize) -> Result<()> {
        self.actuators[i].child.stop()?;
        Ok(())
    }

    /// Starts the actuator of node `i` again (it adopts the table it finds).
    pub fn start_actuator(&mut self, i: usize) -> Result<()> {
        let node = self.cluster.node(i);
        self.actuators[i].forwarders.clear(); // free the forwarded ports for the new process
        self.actuators[i] = Actuator::start(
            &self.opts.exe,
            node.netns(),
            node.name(),
            &self.brain_addrs,
            &self.pki,
            &self.dir,
        )?;
        Ok(())
    }

    /// Cuts node `i`'s connections to the brains (as a network blip would) and lets it
    /// reconnect: the forwarders close every proxied connection and listen again.
    pub fn relink_actuator(&mut self, i: usize) -> Result<()> {
        let ns = self.cluster.node(i).netns();
        self.actuators[i].forwarders.clear();
        for (j, b) in self.brain_addrs.iter().enumerate() {
            let local = SocketAddr::from(([127, 0, 0, 1], crate::deploy::brain_port_in_node(j)));
            self.actuators[i]
                .forwarders
                .push(crate::portfwd::forward_port(ns, local, *b)?);
        }
        Ok(())
    }

    /// A gRPC client of brain `i` with the operator's certificate.
    pub async fn operator_client(
        &self,
        i: usize,
    ) -> Result<splitproxy_proto::v1::dataplane_client::DataplaneClient<tonic::transport::Channel>>
    {
        crate::deploy::grpc_client(self.brain(i).grpc, &self.operator_tls).await
    }

    /// Waits until every actuator has applied a first update.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        for (i, a) in self.actuators.iter().enumerate() {
            let ns = self.cluster.node(i).netns();
            let addr: SocketAddr = ACTUATOR_HEALTHZ.parse()?;
            let ok = wait_until(timeout, Duration::from_millis(100), || {
                matches!(http_get_in(ns, addr, "/readyz"), Ok((200, _)))
            });
            if ok.is_err() {
                bail!(
                    "actuator {} not ready after {timeout:?}:\n{}",
                    a.node,
                    a.log_tail(40)
                );
            }
        }
        Ok(())
    }

    /// The actuator's /metrics text for node `i`.
    pub fn actuator_metrics(&self, i: usize) -> Result<String> {
        let ns = self.cluster.node(i).netns();
        Ok(http_get_in(ns, ACTUATOR_HEALTHZ.parse()?, "/metrics")?.1)
    }

    async fn create_node_objects(&self) -> Result<()> {
        let api: Api<K8sNode> = Api::all(self.cp.client());
        for node in self.cluster.nodes() {
            let obj: K8sNode = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": node.name(), "labels": {"kubernetes.io/hostname": node.name()}},
                "spec": {"podCIDR": node.pod_cidr().to_string(), "podCIDRs": [node.pod_cidr().to_string()]},
            }))?;
            let created = api
                .create(&Default::default(), &obj)
                .await
                .with_context(|| format!("creating Node {}", node.name()))?;
            let mut status = created.clone();
            status.status = Some(serde_json::from_value(serde_json::json!({
                "addresses": [{"type": "InternalIP", "address": node.ip().to_string()},
                              {"type": "Hostname", "address": node.name()}],
                "conditions": [{"type": "Ready", "status": "True"}],
            }))?);
            api.replace_status(node.name(), &Default::default(), &status)
                .await
                .with_context(|| format!("setting status of Node {}", node.name()))?;
        }
        Ok(())
    }

    /// Applies every YAML file in `path` (a file or a directory, in name order) with server-side
    /// apply, then makes sure a pod serves every endpoint address of the slices applied.
    pub async fn apply_path(&self, path: &Path) -> Result<Vec<String>> {
        let mut files = Vec::new();
        if path.is_dir() {
            for e in std::fs::read_dir(path)? {
                let p = e?.path();
                if matches!(
                    p.extension().and_then(|x| x.to_str()),
                    Some("yaml" | "yml" | "json")
                ) {
                    files.push(p);
                }
            }
            files.sort();
        } else {
            files.push(path.to_path_buf());
        }
        let mut applied = Vec::new();
        for f in files {
            let text =
                std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
            applied.extend(
                self.apply_yaml(&text)
                    .await
                    .with_context(|| format!("applying {}", f.display()))?,
            );
        }
        Ok(applied)
    }

    /// Applies the objects of a (multi-document) YAML text; returns "Kind ns/name" for each.
    pub async fn apply_yaml(&self, text: &str) -> Result<Vec<String>> {
        let client = self.cp.client();
        let pp = PatchParams::apply("splitproxy-lab").force();
        let mut out = Vec::new();
        for doc in serde_yaml::Deserializer::from_str(text) {
            let value = serde_json::Value::deserialize_yaml(doc)?;
            if value.is_null() {
                continue;
            }
            let kind = value["kind"].as_str().unwrap_or_default().to_string();
            let name = value["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let ns = value["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string();
            match kind.as_str() {
                "Namespace" => {
                    Api::<Namespace>::all(client.clone())
                        .patch(&name, &pp, &Patch::Apply(&value))
                        .await?;
                }
                "Node" => {
                    Api::<K8sNode>::all(client.clone())
                        .patch(&name, &pp, &Patch::Apply(&value))
                        .await?;
                }
                "Service" => {
                    Api::<Service>::namespaced(client.clone(), &ns)
                        .patch(&name, &pp, &Patch::Apply(&value))
                        .await?;
                }
                "EndpointSlice" => {
                    let s = Api::<EndpointSlice>::namespaced(client.clone(), &ns)
                        .patch(&name, &pp, &Patch::Apply(&value))
                        .await?;
                    self.ensure_pods_for(&s)?;
                }
                other => {
                    bail!("unsupported kind {other:?} (Namespace, Node, Service, EndpointSlice)")
                }
            }
            out.push(format!("{kind} {ns}/{name}"));
        }
        Ok(out)
    }

    /// Deletes a namespaced object of a supported kind.
    pub async fn delete(&self, kind: &str, ns: &str, name: &str) -> Result<()> {
        let c = self.cp.client();
        let dp = DeleteParams::default();
        match kind {
            "Service" => drop(Api::<Service>::namespaced(c, ns).delete(name, &dp).await?),
            "EndpointSlice" => drop(
                Api::<EndpointSlice>::namespaced(c, ns)
                    .delete(name, &dp)
                    .await?,
            ),
            other => bail!("unsupported kind {other:?}"),
        }
        Ok(())
    }

    /// A pod for every IPv4 endpoint address inside a node's pod CIDR, serving the slice's ports.
    fn ensure_pods_for(&self, slice: &EndpointSlice) -> Result<()> {
        let mut tcp = BTreeSet::new();
        let mut udp = BTreeSet::new();
        for p in slice.ports.iter().flatten() {
            let Some(port) = p.port.and_then(|p| u16::try_from(p).ok()) else {
                continue;
            };
            match p.protocol.as_deref().unwrap_or("TCP") {
                "UDP" => udp.insert(port),
                _ => tcp.insert(port),
            };
        }
        for ep in slice.endpoints.iter().flatten() {
            for addr in &ep.addresses {
                let Ok(ip) = addr.parse::<Ipv4Addr>() else {
                    continue;
                };
                let Some(node) = self
                    .cluster
                    .nodes()
                    .iter()
                    .position(|n| n.pod_cidr().contains(&ip))
                else {
                    continue;
                };
                let name = ep
                    .target_ref
                    .as_ref()
                    .and_then(|r| r.name.clone())
                    .unwrap_or_else(|| format!("pod-{}", ip.to_string().replace('.', "-")));
                self.ensure_pod(node, &name, ip, &tcp, &udp)?;
            }
        }
        Ok(())
    }

    /// Creates pod `name` on node `node` with `ip` if absent, and (re)starts its server so that
    /// it listens on at least the given ports.
    pub fn ensure_pod(
        &self,
        node: usize,
        name: &str,
        ip: Ipv4Addr,
        tcp: &BTreeSet<u16>,
        udp: &BTreeSet<u16>,
    ) -> Result<Pod> {
        let mut pods = self.pods.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let key = ip.to_string();
        if !pods.contains_key(&key) {
            let pod = self.cluster.add_pod_with_ip(node, name, ip)?;
            pods.insert(
                key.clone(),
                PodEntry {
                    pod,
                    tcp: BTreeSet::new(),
                    udp: BTreeSet::new(),
                    server: None,
                },
            );
        }
        let e = pods.get_mut(&key).expect("inserted above");
        if e.server.is_none() || !tcp.is_subset(&e.tcp) || !udp.is_subset(&e.udp) {
            e.tcp.extend(tcp);
            e.udp.extend(udp);
            e.server = None; // close the old listeners before binding again
            let t: Vec<u16> = e.tcp.iter().copied().collect();
            let u: Vec<u16> = e.udp.iter().copied().collect();
            e.server = Some(PodServer::start(e.pod.netns(), e.pod.name(), &t, &u)?);
        }
        Ok(e.pod.clone())
    }

    /// The pod with address `ip`, if the lab made one.
    pub fn pod_by_ip(&self, ip: IpAddr) -> Option<Pod> {
        self.pods
            .lock()
            .ok()?
            .get(&ip.to_string())
            .map(|e| e.pod.clone())
    }

    /// Stops (or restarts) the server of the pod with address `ip`, keeping its namespace.
    pub fn set_pod_serving(&self, ip: IpAddr, serving: bool) -> Result<()> {
        let mut pods = self.pods.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let e = pods.get_mut(&ip.to_string()).context("no such pod")?;
        e.server = None;
        if serving {
            let t: Vec<u16> = e.tcp.iter().copied().collect();
            let u: Vec<u16> = e.udp.iter().copied().collect();
            e.server = Some(PodServer::start(e.pod.netns(), e.pod.name(), &t, &u)?);
        }
        Ok(())
    }
}

/// serde_yaml documents to JSON values (Kubernetes objects are JSON underneath).
trait FromYamlDoc: Sized {
    fn deserialize_yaml(doc: serde_yaml::Deserializer<'_>) -> Result<Self>;
}

impl FromYamlDoc for serde_json::Value {
    fn deserialize_yaml(doc: serde_yaml::Deserializer<'_>) -> Result<Self> {
        use serde::Deserialize;
        Ok(serde_json::Value::deserialize(doc)?)
    }
}
