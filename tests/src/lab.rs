//! A whole splitproxy installation on one machine: etcd and a dual-stack kube-apiserver on
//! loopback, node namespaces wired into a dual-stack cluster network with Node objects, one or
//! more brains, an actuator per node, and external clients. End-to-end tests and the
//! `splitproxy-lab` command both build on it.
//!
//! Applying Kubernetes YAML also creates a pod (namespace + server) for every endpoint address of
//! every EndpointSlice, on the node the endpoint names (or whose pod CIDR holds the address),
//! listening on the slice's TCP and UDP ports; an endpoint address that is a node's own address
//! (a host-network pod) gets a server in that node's namespace. So a scenario is just a
//! directory of objects (see [`crate::scenario`]).
//!
//! ```no_run
//! # async fn example() -> anyhow::Result<()> {
//! use splitproxy_tests::lab::{Lab, LabOptions};
//! use splitproxy_tests::deploy::DetectLocalMode;
//! use splitproxy_tests::Proto;
//!
//! // In an integration test: LabOptions::new(env!("CARGO_BIN_EXE_splitproxy-lab")).
//! let mut opts = LabOptions::new("target/debug/splitproxy-lab");
//! opts.nodes = 2;
//! opts.brain.rules.detect_local = DetectLocalMode::InterfaceNamePrefix;
//! let lab = Lab::start(opts).await?;
//! lab.apply_path(std::path::Path::new("tests/lab/scenarios/nodeport-local")).await?;
//! let client = lab.add_pod("node-1", "client", &[])?; // dual stack, addresses picked for it
//! let r = lab.probe("external", Proto::Tcp, "192.168.77.10:30080".parse()?).await;
//! println!("{} {:?} {:?}", r, r.endpoint(), r.source());
//! let r = lab.probe("10.244.1.2", Proto::Udp, "[fd00:96::53]:53".parse()?).await;
//! # Ok(()) }
//! ```
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, bail};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Namespace, Node as K8sNode, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

use crate::Result;
use crate::certs::Pki;
use crate::controlplane::{ControlPlane, ControlPlaneOptions};
use crate::deploy::{
    ACTUATOR_HEALTHZ, ACTUATOR_METRICS, Actuator, ActuatorOptions, Brain, BrainOptions,
    DetectLocalMode, RulesConfig, http_get_in,
};
use crate::netns::Netns;
use crate::podserver::PodServer;
use crate::probe::{
    HttpResult, ProbeResult, Proto, bind_addr, http_get_async, probe_repeat_bound_async,
};
use crate::process::wait_until;
use crate::topology::{
    CLUSTER_CIDR, CLUSTER_CIDR6, Cluster, ClusterSpec, DEFAULT_SERVICE_CIDR, DEFAULT_SERVICE_CIDR6,
    ExternalClient, POD_BRIDGE, POD_INTERFACE_PREFIX, Pod, PodNetwork,
};

/// The label kube-proxy reads a node's zone from.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// The default probe timeout of the `probe`/`http` helpers.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(1500);

/// One node of the lab, as configured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeSpec {
    /// Node name (namespace label, Node object, actuator identity).
    pub name: String,
    /// `topology.kubernetes.io/zone` label of the Node object.
    pub zone: Option<String>,
    /// Extra addresses, added to the node's fabric interface and listed as InternalIPs of the
    /// Node object after the fabric addresses (see [`Cluster::add_node_address`]).
    pub addresses: Vec<IpNet>,
    /// Further Node labels.
    pub labels: BTreeMap<String, String>,
}

impl NodeSpec {
    /// A node called `name` with no zone and no extra addresses.
    pub fn new(name: impl Into<String>) -> NodeSpec {
        NodeSpec {
            name: name.into(),
            ..Default::default()
        }
    }

    /// The same node in zone `zone`.
    pub fn zone(mut self, zone: impl Into<String>) -> NodeSpec {
        self.zone = Some(zone.into());
        self
    }
}

/// One external client of the lab.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExternalSpec {
    /// Client name (for `--from`).
    pub name: String,
    /// Name of the node its default routes point to; the first node when `None`.
    pub via: Option<String>,
    /// Its fabric addresses (one per family); the next free 192.168.77.200+ and its IPv6 twin
    /// when empty.
    pub addresses: Vec<IpAddr>,
}

impl ExternalSpec {
    /// A client called `name` with addresses picked for it, routed via the first node.
    pub fn new(name: impl Into<String>) -> ExternalSpec {
        ExternalSpec {
            name: name.into(),
            ..Default::default()
        }
    }
}

/// A pod the lab creates when it starts (for example a client to probe from).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodSpec {
    pub name: String,
    /// Node name.
    pub node: String,
    /// At most one per family; empty: the next free IPv4 address of the node's pod CIDR and
    /// its IPv6 twin.
    pub addresses: Vec<IpAddr>,
    /// Ports its server answers on.
    pub tcp: Vec<u16>,
    pub udp: Vec<u16>,
}

impl PodSpec {
    /// A dual-stack pod `name` on node `node` with no open ports.
    pub fn new(name: impl Into<String>, node: impl Into<String>) -> PodSpec {
        PodSpec {
            name: name.into(),
            node: node.into(),
            ..Default::default()
        }
    }
}

/// How [`Lab::start`] builds the lab.
#[derive(Debug, Clone)]
pub struct LabOptions {
    /// The multi-call binary (`splitproxy-lab`) that runs brains and actuators.
    pub exe: PathBuf,
    /// Number of nodes named `node-0`, `node-1`, ... (ignored when `node_specs` is not empty).
    pub nodes: usize,
    /// The nodes, when names, zones or extra addresses matter.
    pub node_specs: Vec<NodeSpec>,
    /// Brain replicas.
    pub brains: usize,
    /// Each brain reaches the API server through a forwarder of its own, which a fault test
    /// can cut ([`Lab::cut_brain_api`]) to partition that brain from the API server.
    pub brain_api_links: bool,
    /// Service CIDRs: kube-apiserver's `--service-cluster-ip-range` (dual stack by default:
    /// 10.96.0.0/16 and fd00:96::/112) and, unless `brain.rules.service_cidrs` is set, the
    /// brain's.
    pub service_cidrs: Vec<IpNet>,
    /// How pods are attached; `None`: bridged when `brain.rules.detect_local` is
    /// `BridgeInterface`, routed otherwise.
    pub pod_network: Option<PodNetwork>,
    /// External clients. Default: one named `external` (192.168.77.200, fd00:77::200) routed
    /// via the first node.
    pub external_clients: Vec<ExternalSpec>,
    /// Pods created at start (before any object is applied).
    pub pods: Vec<PodSpec>,
    /// The brain's configuration. Default: cluster CIDRs 10.244.0.0/16 and fd00:244::/48,
    /// detect-local mode ClusterCIDR, the service CIDRs above. With `InterfaceNamePrefix` and no
    /// prefix, the lab's `pod` prefix is used; with `BridgeInterface` and no bridge, `cbr0` (and
    /// pods are bridged). See [`LabOptions::effective_brain_options`].
    pub brain: BrainOptions,
    /// Where logs and certificates go; a temporary directory when `None`.
    pub dir: Option<PathBuf>,
    /// Install the chart instead of starting brains and actuators directly
    /// ([`crate::install`]): brains and actuators run on the nodes as their pods would, with
    /// the chart's arguments, identity, RBAC and discovery. `brains` and `brain` are then
    /// ignored (the chart's values say what the brains do).
    pub install: Option<crate::install::InstallOptions>,
    /// How long [`Lab::start`] waits for every actuator to be ready.
    pub ready_timeout: Duration,
    /// How the actuators are started (environment, forwarders to the harness's services).
    pub actuator: ActuatorOptions,
}

impl LabOptions {
    pub fn new(exe: impl Into<PathBuf>) -> Self {
        LabOptions {
            exe: exe.into(),
            nodes: 2,
            node_specs: Vec::new(),
            brains: 1,
            brain_api_links: false,
            service_cidrs: vec![
                DEFAULT_SERVICE_CIDR.parse().expect("constant CIDR"),
                DEFAULT_SERVICE_CIDR6.parse().expect("constant CIDR"),
            ],
            pod_network: None,
            external_clients: vec![ExternalSpec::new("external")],
            pods: Vec::new(),
            brain: BrainOptions {
                rules: RulesConfig {
                    cluster_cidrs: vec![
                        CLUSTER_CIDR.parse().expect("constant CIDR"),
                        CLUSTER_CIDR6.parse().expect("constant CIDR"),
                    ],
                    detect_local: DetectLocalMode::ClusterCidr,
                    ..Default::default()
                },
                ..Default::default()
            },
            dir: None,
            install: None,
            ready_timeout: Duration::from_secs(60),
            actuator: ActuatorOptions::default(),
        }
    }

    /// The node specs in effect (`node_specs`, or `nodes` nodes named `node-<i>`).
    pub fn effective_nodes(&self) -> Vec<NodeSpec> {
        if self.node_specs.is_empty() {
            (0..self.nodes)
                .map(|i| NodeSpec::new(format!("node-{i}")))
                .collect()
        } else {
            self.node_specs.clone()
        }
    }

    /// The pod attachment in effect.
    pub fn effective_pod_network(&self) -> PodNetwork {
        self.pod_network.unwrap_or(
            if self.brain.rules.detect_local == DetectLocalMode::BridgeInterface {
                PodNetwork::Bridge
            } else {
                PodNetwork::Routed
            },
        )
    }

    /// The brain's options in effect: the lab's service CIDRs unless the brain has its own, and
    /// the lab's pod interface prefix or bridge when the detect-local mode needs one.
    pub fn effective_brain_options(&self) -> BrainOptions {
        let mut opts = self.brain.clone();
        let rules = &mut opts.rules;
        match rules.detect_local {
            DetectLocalMode::InterfaceNamePrefix if rules.pod_interface_name_prefix.is_empty() => {
                rules.pod_interface_name_prefix = POD_INTERFACE_PREFIX.into();
            }
            DetectLocalMode::BridgeInterface if rules.pod_bridge_interface.is_empty() => {
                rules.pod_bridge_interface = POD_BRIDGE.into();
            }
            _ => {}
        }
        if rules.service_cidrs.is_empty() {
            rules.service_cidrs = self.service_cidrs.clone();
        }
        opts
    }
}

struct PodEntry {
    pod: Pod,
    tcp: BTreeSet<u16>,
    udp: BTreeSet<u16>,
    server: Option<PodServer>,
}

/// A server in a node's namespace, for endpoints at a node's own address (host network).
struct HostEntry {
    name: String,
    tcp: BTreeSet<u16>,
    udp: BTreeSet<u16>,
    server: Option<PodServer>,
}

/// Where a probe starts.
#[derive(Clone, Debug)]
pub enum Origin {
    Pod(Pod),
    /// Node index.
    Node(usize),
    External(ExternalClient),
}

/// A resolved `--from`: the namespace to probe from and the source address to bind, if one was
/// given.
#[derive(Clone, Debug)]
pub struct ProbeSource {
    pub origin: Origin,
    pub bind: Option<IpAddr>,
}

impl ProbeSource {
    /// The namespace the probe runs in.
    pub fn netns<'a>(&'a self, lab: &'a Lab) -> &'a Netns {
        match &self.origin {
            Origin::Pod(p) => p.netns(),
            Origin::Node(i) => lab.cluster.node(*i).netns(),
            Origin::External(e) => e.netns(),
        }
    }

    /// "pod client", "node node-0", "external external".
    pub fn describe(&self, lab: &Lab) -> String {
        match &self.origin {
            Origin::Pod(p) => format!("pod {}", p.name()),
            Origin::Node(i) => format!("node {}", lab.cluster.node(*i).name()),
            Origin::External(e) => format!("external {}", e.name()),
        }
    }
}

pub struct Lab {
    pub opts: LabOptions,
    pub cp: ControlPlane,
    pub cluster: Cluster,
    pub pki: Pki,
    pub brains: Vec<Option<Brain>>,
    brain_addrs: Vec<SocketAddr>,
    /// With `brain_api_links`: brain `i`'s path to the API server, and the kubeconfig using it.
    api_links: Vec<(crate::portfwd::Forwarder, PathBuf)>,
    pub actuators: Vec<Actuator>,
    /// The chart, when the lab installed it ([`LabOptions::install`]).
    pub install: Option<crate::install::Install>,
    /// A client certificate for operators (grpcurl) and tests.
    pub operator_tls: crate::certs::TlsFiles,
    node_specs: Vec<NodeSpec>,
    pods: Mutex<BTreeMap<String, PodEntry>>,
    host_servers: Mutex<BTreeMap<usize, HostEntry>>,
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
        let node_specs = opts.effective_nodes();
        let spec = ClusterSpec::with_node_names(node_specs.iter().map(|n| n.name.clone()))
            .service_cidrs(&opts.service_cidrs)
            .pod_network(opts.effective_pod_network());
        // The network first: it fails fast (names, addresses) and needs no API server.
        let cluster = Cluster::new(spec)?;
        for (i, node) in node_specs.iter().enumerate() {
            for addr in &node.addresses {
                cluster
                    .add_node_address(i, *addr)
                    .with_context(|| format!("adding {addr} to node {}", node.name))?;
            }
        }
        let cp = ControlPlane::start(ControlPlaneOptions {
            service_cluster_ip_range: opts
                .service_cidrs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
            ..Default::default()
        })
        .await?;
        let pki = Pki::new("splitproxy-lab")?;
        let operator_tls = pki.write(&dir, "operator", &pki.operator_cert("operator")?)?;
        let mut lab = Lab {
            cp,
            cluster,
            pki,
            brains: Vec::new(),
            brain_addrs: Vec::new(),
            api_links: Vec::new(),
            actuators: Vec::new(),
            install: None,
            operator_tls,
            node_specs,
            pods: Mutex::new(BTreeMap::new()),
            host_servers: Mutex::new(BTreeMap::new()),
            dir,
            _tmp: tmp,
            opts,
        };
        for client in lab.opts.external_clients.clone() {
            lab.add_external_client(&client)?;
        }
        for pod in lab.opts.pods.clone() {
            let node = lab.node_index(&pod.node)?;
            lab.ensure_pod_ips(
                node,
                &pod.name,
                &pod.addresses,
                &pod.tcp.iter().copied().collect(),
                &pod.udp.iter().copied().collect(),
            )
            .with_context(|| format!("creating pod {}", pod.name))?;
        }
        lab.create_node_objects().await?;
        if let Some(opts) = lab.opts.install.clone() {
            let install = crate::install::Install::start(
                &lab.cp,
                &lab.cluster,
                &lab.opts.exe,
                &lab.dir,
                &opts.with_lab_values(&lab.opts),
            )
            .await?;
            lab.install = Some(install);
        } else {
            lab.start_processes()?;
        }
        lab.wait_ready_async(lab.opts.ready_timeout).await?;
        Ok(lab)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts the brains and the actuators directly (without the chart).
    fn start_processes(&mut self) -> Result<()> {
        if self.opts.brain_api_links {
            for _ in 0..self.opts.brains {
                let link = crate::portfwd::forward_local(
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    self.cp.addr(),
                )?;
                let kubeconfig = self
                    .cp
                    .kubeconfig_for_server(&format!("https://{}", link.local_addr()))?;
                self.api_links.push((link, kubeconfig));
            }
        }
        // Every replica serves one certificate, as the chart's replicas share one Secret (and
        // with it the key of their TLS session tickets: a node failing over resumes its session).
        if self.opts.brain.serving.is_none() && self.opts.brain.managed_tls.is_none() {
            self.opts.brain.serving = Some(Brain::serving_files(&self.pki, &self.dir, "brain")?);
        }
        for i in 0..self.opts.brains {
            let brain = self.spawn_brain(i, None)?;
            self.brain_addrs.push(brain.grpc);
            self.brains.push(Some(brain));
        }
        for i in 0..self.cluster.nodes().len() {
            let node = self.cluster.node(i);
            let a = Actuator::start_with(
                &self.opts.exe,
                node.netns(),
                node.name(),
                &self.brain_addrs,
                &self.pki,
                &self.dir,
                &self.opts.actuator,
            )?;
            self.actuators.push(a);
        }
        Ok(())
    }

    /// The nodes as configured (names, zones, extra addresses, labels).
    pub fn node_specs(&self) -> &[NodeSpec] {
        &self.node_specs
    }

    /// The index of the node named `name`.
    pub fn node_index(&self, name: &str) -> Result<usize> {
        self.cluster
            .nodes()
            .iter()
            .position(|n| n.name() == name)
            .with_context(|| format!("no node named {name:?}"))
    }

    fn spawn_brain(&self, i: usize, addr: Option<SocketAddr>) -> Result<Brain> {
        let kubeconfig = match self.api_links.get(i) {
            Some((_, path)) => path.as_path(),
            None => self.cp.kubeconfig_path(),
        };
        Brain::start(
            &self.opts.exe,
            kubeconfig,
            &self.pki,
            &self.dir,
            &format!("brain-{i}"),
            addr,
            &self.opts.effective_brain_options(),
        )
    }

    pub fn brain(&self, i: usize) -> &Brain {
        self.brains[i].as_ref().expect("brain is running")
    }

    /// Stops brain `i` (SIGTERM); actuators keep their rules.
    pub fn stop_brain(&mut self, i: usize) -> Result<()> {
        self.stop_brain_status(i).map(drop)
    }

    /// Stops brain `i` as [`Lab::stop_brain`] does, and says how it ended and how long that
    /// took: a brain told to stop must end its streams and exit, not wait to be killed.
    pub fn stop_brain_status(
        &mut self,
        i: usize,
    ) -> Result<Option<(std::process::ExitStatus, std::time::Duration)>> {
        let Some(mut b) = self.brains[i].take() else {
            return Ok(None);
        };
        let start = std::time::Instant::now();
        let status = b.child.stop()?;
        Ok(status.map(|s| (s, start.elapsed())))
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

    /// Kills brain `i` with SIGKILL, as a crash or an OOM kill would: no clean-up, its streams
    /// simply break.
    pub fn kill_brain(&mut self, i: usize) -> Result<()> {
        if let Some(mut b) = self.brains[i].take() {
            b.child.signal(nix::sys::signal::Signal::SIGKILL)?;
            b.child.stop()?; // reaps it
        }
        Ok(())
    }

    /// Starts brain `i` again on the address it had, so every node's forwarder reaches it as
    /// before and no other connection is cut (a restarted pod behind the same Service). Falls
    /// back to [`Lab::start_brain`] (a fresh port, every forwarder relinked) if the address is
    /// taken meanwhile.
    pub fn restart_brain(&mut self, i: usize) -> Result<()> {
        match self.spawn_brain(i, Some(self.brain_addrs[i])) {
            Ok(b) => {
                self.brains[i] = Some(b);
                Ok(())
            }
            Err(_) => self.start_brain(i),
        }
    }

    /// The `--brain` addresses the actuators were given, in order (as node namespaces see
    /// them).
    pub fn actuator_brain_urls(&self) -> Vec<String> {
        (0..self.brain_addrs.len())
            .map(|j| {
                format!(
                    "https://{}",
                    SocketAddr::from(([127, 0, 0, 1], crate::deploy::brain_port_in_node(j)))
                )
            })
            .collect()
    }

    /// Partitions brain `i` from the API server (needs `brain_api_links`): its connections
    /// to the API server are blackholed, not closed.
    pub fn cut_brain_api(&self, i: usize) -> Result<()> {
        let (link, _) = self
            .api_links
            .get(i)
            .context("cutting a brain's API path needs LabOptions::brain_api_links")?;
        link.cut();
        Ok(())
    }

    /// Ends brain `i`'s partition: new connections to the API server get through again.
    pub fn heal_brain_api(&self, i: usize) -> Result<()> {
        let (link, _) = self
            .api_links
            .get(i)
            .context("healing a brain's API path needs LabOptions::brain_api_links")?;
        link.heal();
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
        self.actuators[i] = Actuator::start_with(
            &self.opts.exe,
            node.netns(),
            node.name(),
            &self.brain_addrs,
            &self.pki,
            &self.dir,
            &self.opts.actuator,
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

    /// [`Lab::wait_ready`] without blocking the runtime's thread: the lab's own tasks (the
    /// chart install's controllers among them) keep running while it waits.
    pub async fn wait_ready_async(&self, timeout: Duration) -> Result<()> {
        let start = std::time::Instant::now();
        let addr: SocketAddr = ACTUATOR_HEALTHZ.parse()?;
        for i in 0..self.cluster.nodes().len() {
            loop {
                let ns = self.cluster.node(i).netns().handle();
                let ready = tokio::task::spawn_blocking(move || {
                    matches!(http_get_in(&ns, addr, "/readyz"), Ok((200, _)))
                })
                .await
                .unwrap_or(false);
                if ready {
                    break;
                }
                if start.elapsed() > timeout {
                    return Err(self.not_ready(i, timeout));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }

    /// Waits until every actuator has applied a first update.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        for i in 0..self.cluster.nodes().len() {
            let ns = self.cluster.node(i).netns();
            let addr: SocketAddr = ACTUATOR_HEALTHZ.parse()?;
            let ok = wait_until(timeout, Duration::from_millis(100), || {
                matches!(http_get_in(ns, addr, "/readyz"), Ok((200, _)))
            });
            if ok.is_err() {
                return Err(self.not_ready(i, timeout));
            }
        }
        Ok(())
    }

    /// Node `i`'s actuator is not ready after `timeout`: the error, with its log.
    fn not_ready(&self, i: usize, timeout: Duration) -> anyhow::Error {
        let node = self.cluster.node(i).name();
        let log = match (&self.install, self.actuators.get(i)) {
            (Some(install), _) => install
                .pods_of("actuator")
                .into_iter()
                .filter(|(_, n)| *n == i)
                .map(|(pod, _)| install.log_tail(&pod, 40))
                .collect::<Vec<_>>()
                .join("\n"),
            (None, Some(a)) => a.log_tail(40),
            (None, None) => String::new(),
        };
        anyhow::anyhow!("actuator {node} not ready after {timeout:?}:\n{log}")
    }

    /// Waits (bounded by `timeout`) until a brain reports every node connected and holding its
    /// latest desired state. Call it after changing objects: it first lets the brain see the
    /// change and publish (a short pause longer than its minimum publish interval).
    pub async fn wait_synced(&self, timeout: Duration) -> Result<()> {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let deadline = tokio::time::Instant::now() + timeout;
        let want: BTreeSet<String> = self
            .cluster
            .nodes()
            .iter()
            .map(|n| n.name().to_string())
            .collect();
        loop {
            let mut synced = BTreeSet::new();
            for pod in self.install.iter().flat_map(|i| i.pods_of("brain")) {
                let install = self.install.as_ref().expect("iterating its pods");
                let Ok(mut client) = install.operator_client(&pod.0).await else {
                    continue;
                };
                let Ok(resp) = client
                    .list_nodes(splitproxy_proto::v1::ListNodesRequest {})
                    .await
                else {
                    continue;
                };
                let resp = resp.into_inner();
                if resp.synced {
                    synced.extend(
                        resp.nodes
                            .iter()
                            .filter(|n| n.connected && n.in_sync)
                            .map(|n| n.node.clone()),
                    );
                }
            }
            for (i, b) in self.brains.iter().enumerate() {
                if b.is_none() {
                    continue;
                }
                let Ok(mut client) = self.operator_client(i).await else {
                    continue;
                };
                let Ok(resp) = client
                    .list_nodes(splitproxy_proto::v1::ListNodesRequest {})
                    .await
                else {
                    continue;
                };
                let resp = resp.into_inner();
                if !resp.synced {
                    continue;
                }
                synced.extend(
                    resp.nodes
                        .iter()
                        .filter(|n| n.connected && n.in_sync)
                        .map(|n| n.node.clone()),
                );
            }
            if want.is_subset(&synced) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                let missing: Vec<_> = want.difference(&synced).collect();
                bail!("nodes not in sync after {timeout:?}: {missing:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The actuator's /metrics text for node `i`.
    pub fn actuator_metrics(&self, i: usize) -> Result<String> {
        let ns = self.cluster.node(i).netns();
        Ok(http_get_in(ns, ACTUATOR_METRICS.parse()?, "/metrics")?.1)
    }

    /// The Node object the lab writes for node `i`: hostname and zone labels, both pod CIDRs,
    /// InternalIPs (IPv4 and IPv6 fabric addresses, then extra ones), Ready.
    pub fn node_object(&self, i: usize) -> serde_json::Value {
        let node = self.cluster.node(i);
        let spec = self.node_specs.get(i).cloned().unwrap_or_default();
        let mut labels = serde_json::Map::new();
        labels.insert("kubernetes.io/hostname".into(), node.name().into());
        labels.insert("kubernetes.io/os".into(), "linux".into());
        if let Some(zone) = &spec.zone {
            labels.insert(ZONE_LABEL.into(), zone.clone().into());
        }
        for (k, v) in &spec.labels {
            labels.insert(k.clone(), v.clone().into());
        }
        let mut addresses: Vec<serde_json::Value> = node
            .ips()
            .iter()
            .map(|ip| serde_json::json!({"type": "InternalIP", "address": ip.to_string()}))
            .collect();
        addresses.push(serde_json::json!({"type": "Hostname", "address": node.name()}));
        let cidrs: Vec<String> = node.pod_cidrs().iter().map(ToString::to_string).collect();
        serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node.name(), "labels": labels},
            "spec": {"podCIDR": cidrs[0], "podCIDRs": cidrs},
            "status": {
                "addresses": addresses,
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        })
    }

    async fn create_node_objects(&self) -> Result<()> {
        for i in 0..self.cluster.nodes().len() {
            let obj = self.node_object(i);
            self.put_node(obj)
                .await
                .with_context(|| format!("creating Node {}", self.cluster.node(i).name()))?;
        }
        Ok(())
    }

    /// Creates Node `value` or merges it into the existing one (objects merge key by key, any
    /// other value replaces; `null` removes), status included.
    async fn put_node(&self, value: serde_json::Value) -> Result<String> {
        let api: Api<K8sNode> = Api::all(self.cp.client());
        let name = value["metadata"]["name"]
            .as_str()
            .context("Node without metadata.name")?
            .to_string();
        let merged = match api.get_opt(&name).await? {
            Some(existing) => {
                let mut current = serde_json::to_value(&existing)?;
                merge_json(&mut current, &value);
                let node: K8sNode = serde_json::from_value(current.clone())?;
                let replaced = api.replace(&name, &PostParams::default(), &node).await?;
                let mut status = replaced;
                status.status = node.status;
                status
            }
            None => {
                let node: K8sNode = serde_json::from_value(value.clone())?;
                let created = api.create(&PostParams::default(), &node).await?;
                let mut status = created;
                status.status = node.status;
                status
            }
        };
        api.replace_status(&name, &PostParams::default(), &merged)
            .await
            .with_context(|| format!("setting status of Node {name}"))?;
        Ok(name)
    }

    /// Applies every YAML file in `path` (a file or a directory, in name order) with server-side
    /// apply, then makes sure a pod serves every endpoint address of the slices applied. In a
    /// directory, `lab.yaml` and `probes.yaml` (a scenario's lab configuration and probes) are
    /// skipped.
    pub async fn apply_path(&self, path: &Path) -> Result<Vec<String>> {
        let mut applied = Vec::new();
        for f in crate::scenario::object_files(path)? {
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
    /// Supported kinds: Namespace, Service (with its status, e.g. LoadBalancer ingress IPs),
    /// EndpointSlice (pods are created for their endpoints), Node (merged into the lab's Node of
    /// that name, status included), ServiceCIDR (an extra Service range of the API server).
    pub async fn apply_yaml(&self, text: &str) -> Result<Vec<String>> {
        let client = self.cp.client();
        let pp = PatchParams::apply("splitproxy-lab").force();
        let mut out = Vec::new();
        // Parse everything first: the YAML parser must not live across an await (it is not
        // Send), and a syntax error then applies nothing.
        let docs = serde_yaml::Deserializer::from_str(text)
            .map(serde_json::Value::deserialize_yaml)
            .collect::<Result<Vec<_>>>()?;
        for value in docs {
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
                    out.push(format!("{kind} {name}"));
                    continue;
                }
                "Node" => {
                    self.put_node(value.clone()).await?;
                    out.push(format!("{kind} {name}"));
                    continue;
                }
                "Service" => {
                    let api = Api::<Service>::namespaced(client.clone(), &ns);
                    api.patch(&name, &pp, &Patch::Apply(&value)).await?;
                    // Status (a LoadBalancer's ingress IPs) is a subresource of its own.
                    if value.get("status").is_some_and(|s| !s.is_null()) {
                        api.patch_status(&name, &pp, &Patch::Apply(&value))
                            .await
                            .with_context(|| format!("setting status of Service {ns}/{name}"))?;
                    }
                }
                "EndpointSlice" => {
                    // The pods serve before their endpoints exist, as in a cluster, where an
                    // endpoint is ready only once its pod is: the other way round, a
                    // connection that reached a new endpoint before its server listened was
                    // refused by the pod, not by the dataplane.
                    let slice: EndpointSlice = serde_json::from_value(value.clone())
                        .with_context(|| format!("EndpointSlice {ns}/{name}"))?;
                    self.ensure_pods_for(&slice)?;
                    Api::<EndpointSlice>::namespaced(client.clone(), &ns)
                        .patch(&name, &pp, &Patch::Apply(&value))
                        .await?;
                }
                "ServiceCIDR" => {
                    let c = Api::<ServiceCIDR>::all(client.clone())
                        .patch(&name, &pp, &Patch::Apply(&value))
                        .await?;
                    self.wait_allocatable(&c).await?;
                    out.push(format!("{kind} {name}"));
                    continue;
                }
                other => {
                    bail!(
                        "unsupported kind {other:?} (Namespace, Node, Service, EndpointSlice, ServiceCIDR)"
                    )
                }
            }
            out.push(format!("{kind} {ns}/{name}"));
        }
        Ok(out)
    }

    /// Waits until the API server allocates ClusterIPs from a ServiceCIDR just applied (its
    /// allocator learns of new ranges through a watch), so that a Service applied next may take
    /// an address from it: a dry-run create of a Service at the range's first address succeeds.
    async fn wait_allocatable(&self, cidr: &ServiceCIDR) -> Result<()> {
        let nets = cidr
            .spec
            .as_ref()
            .and_then(|s| s.cidrs.clone())
            .unwrap_or_default();
        for net in nets {
            let net: IpNet = net
                .parse()
                .with_context(|| format!("ServiceCIDR {net:?}"))?;
            // The first address after the network's (which IPv6 ranges never allocate).
            let Some(ip) = net.hosts().find(|ip| *ip != net.network()) else {
                continue;
            };
            let probe: Service = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "splitproxy-lab-cidr-check", "namespace": "default"},
                "spec": {"clusterIP": ip.to_string(), "clusterIPs": [ip.to_string()],
                         "ipFamilies": [if ip.is_ipv4() { "IPv4" } else { "IPv6" }],
                         "ports": [{"port": 80}]},
            }))?;
            let api = Api::<Service>::namespaced(self.cp.client(), "default");
            let pp = PostParams {
                dry_run: true,
                ..Default::default()
            };
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                match api.create(&pp, &probe).await {
                    Ok(_) => break,
                    Err(e) if e.to_string().contains("already allocated") => break,
                    Err(e) if std::time::Instant::now() > deadline => {
                        bail!("ServiceCIDR {net}: the API server allocates no address from it: {e}")
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        }
        Ok(())
    }

    /// Deletes an object of a supported kind (`ns` is ignored for Nodes and Namespaces).
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
            "Node" => drop(Api::<K8sNode>::all(c).delete(name, &dp).await?),
            "Namespace" => drop(Api::<Namespace>::all(c).delete(name, &dp).await?),
            "ServiceCIDR" => drop(Api::<ServiceCIDR>::all(c).delete(name, &dp).await?),
            other => bail!("unsupported kind {other:?}"),
        }
        Ok(())
    }

    /// A pod for every endpoint address of `slice` (IPv4 or IPv6), on the node the endpoint
    /// names (or, without `nodeName`, the node whose pod CIDRs hold the address), serving the
    /// slice's TCP and UDP ports; a server in the node's namespace for an address of the node
    /// itself. Endpoints on nodes the lab does not have are skipped.
    fn ensure_pods_for(&self, slice: &EndpointSlice) -> Result<()> {
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            return Ok(());
        }
        let mut tcp = BTreeSet::new();
        let mut udp = BTreeSet::new();
        for p in slice.ports.iter().flatten() {
            let Some(port) = p.port.and_then(|p| u16::try_from(p).ok()) else {
                continue;
            };
            match p.protocol.as_deref().unwrap_or("TCP") {
                "UDP" => {
                    udp.insert(port);
                }
                "TCP" => {
                    tcp.insert(port);
                }
                _ => {} // SCTP: no server
            }
        }
        for ep in slice.endpoints.iter().flatten() {
            let named_node = match ep.node_name.as_deref() {
                Some(n) => match self.cluster.node_by_name(n) {
                    Some(node) => Some(node.index()),
                    None => continue,
                },
                None => None,
            };
            let pod_name = ep.target_ref.as_ref().and_then(|r| r.name.clone());
            for addr in &ep.addresses {
                let Ok(ip) = addr.parse::<IpAddr>() else {
                    continue;
                };
                if let Some(node) = self.cluster.node_by_ip(ip) {
                    let name = pod_name.clone().unwrap_or_else(|| node.name().to_string());
                    self.ensure_host_server(node.index(), &name, &tcp, &udp)?;
                    continue;
                }
                let Some(node) =
                    named_node.or_else(|| self.cluster.node_for_pod_ip(ip).map(|n| n.index()))
                else {
                    continue;
                };
                let name = pod_name
                    .clone()
                    .unwrap_or_else(|| format!("pod-{}", ip.to_string().replace(['.', ':'], "-")));
                self.ensure_pod_ips(node, &name, &[ip], &tcp, &udp)?;
            }
        }
        Ok(())
    }

    /// Creates pod `name` on node `node` with `ip` if absent, and (re)starts its server so that
    /// it listens on at least the given ports. A pod that already has `ip` is reused whatever
    /// its name.
    pub fn ensure_pod(
        &self,
        node: usize,
        name: &str,
        ip: IpAddr,
        tcp: &BTreeSet<u16>,
        udp: &BTreeSet<u16>,
    ) -> Result<Pod> {
        self.ensure_pod_ips(node, name, &[ip], tcp, udp)
    }

    /// Creates pod `name` on node `node` with addresses `ips` (one per family; empty: a
    /// dual-stack pair picked from the node's pod CIDRs) if absent, adds any of `ips` it lacks,
    /// and (re)starts its server so that it listens on at least the given ports (on every
    /// address of both families).
    pub fn ensure_pod_ips(
        &self,
        node: usize,
        name: &str,
        ips: &[IpAddr],
        tcp: &BTreeSet<u16>,
        udp: &BTreeSet<u16>,
    ) -> Result<Pod> {
        let mut pods = lock(&self.pods);
        let key = match pods.get(name) {
            Some(_) => name.to_string(),
            None => match ips.iter().find_map(|ip| {
                pods.iter()
                    .find(|(_, e)| e.pod.has_ip(*ip))
                    .map(|(k, _)| k.clone())
            }) {
                Some(existing) => existing,
                None => {
                    let pod = if ips.is_empty() {
                        self.cluster.add_pod(node, name)?
                    } else {
                        self.cluster.add_pod_with_ips(node, name, ips)?
                    };
                    pods.insert(
                        name.to_string(),
                        PodEntry {
                            pod,
                            tcp: BTreeSet::new(),
                            udp: BTreeSet::new(),
                            server: None,
                        },
                    );
                    name.to_string()
                }
            },
        };
        let e = pods.get_mut(&key).context("pod vanished")?;
        if e.pod.node_index() != node {
            bail!(
                "pod {} runs on {}, not on {}",
                e.pod.name(),
                e.pod.node(),
                self.cluster.node(node).name()
            );
        }
        for ip in ips {
            if !e.pod.has_ip(*ip) {
                self.cluster.add_pod_address(e.pod.name(), *ip)?;
            }
        }
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

    /// Adds a pod on node `node` (by name) with addresses `ips` (empty: a dual-stack pair picked
    /// for it) and no open ports: a client to probe from.
    pub fn add_pod(&self, node: &str, name: &str, ips: &[IpAddr]) -> Result<Pod> {
        let node = self.node_index(node)?;
        self.ensure_pod_ips(node, name, ips, &BTreeSet::new(), &BTreeSet::new())
    }

    /// Starts (or widens) the server in node `node`'s own namespace, for endpoints at the node's
    /// addresses (host-network pods). It answers with `name` (the first name given wins).
    pub fn ensure_host_server(
        &self,
        node: usize,
        name: &str,
        tcp: &BTreeSet<u16>,
        udp: &BTreeSet<u16>,
    ) -> Result<()> {
        let mut hosts = lock(&self.host_servers);
        let e = hosts.entry(node).or_insert_with(|| HostEntry {
            name: name.to_string(),
            tcp: BTreeSet::new(),
            udp: BTreeSet::new(),
            server: None,
        });
        if e.server.is_none() || !tcp.is_subset(&e.tcp) || !udp.is_subset(&e.udp) {
            e.tcp.extend(tcp);
            e.udp.extend(udp);
            e.server = None;
            let t: Vec<u16> = e.tcp.iter().copied().collect();
            let u: Vec<u16> = e.udp.iter().copied().collect();
            e.server = Some(PodServer::start(
                self.cluster.node(node).netns(),
                &e.name,
                &t,
                &u,
            )?);
        }
        Ok(())
    }

    /// The pod named `name`, if the lab made one.
    pub fn pod(&self, name: &str) -> Option<Pod> {
        lock(&self.pods).get(name).map(|e| e.pod.clone())
    }

    /// The pod with address `ip`, if the lab made one.
    pub fn pod_by_ip(&self, ip: IpAddr) -> Option<Pod> {
        lock(&self.pods)
            .values()
            .find(|e| e.pod.has_ip(ip))
            .map(|e| e.pod.clone())
    }

    /// Every pod the lab made, with the TCP and UDP ports it serves.
    pub fn pods(&self) -> Vec<(Pod, Vec<u16>, Vec<u16>)> {
        lock(&self.pods)
            .values()
            .map(|e| {
                (
                    e.pod.clone(),
                    e.tcp.iter().copied().collect(),
                    e.udp.iter().copied().collect(),
                )
            })
            .collect()
    }

    /// Whether a server of the lab answers on `ip`:`port` over `proto`: a pod's while it
    /// serves, or a node's host-network one.
    pub fn serves(&self, ip: IpAddr, proto: Proto, port: u16) -> bool {
        let has = |tcp: &BTreeSet<u16>, udp: &BTreeSet<u16>| match proto {
            Proto::Tcp => tcp.contains(&port),
            Proto::Udp => udp.contains(&port),
        };
        let ip = ip.to_canonical();
        if let Some(e) = lock(&self.pods).values().find(|e| e.pod.has_ip(ip)) {
            return e.server.is_some() && has(&e.tcp, &e.udp);
        }
        match self.cluster.node_by_ip(ip) {
            Some(node) => lock(&self.host_servers)
                .get(&node.index())
                .is_some_and(|e| e.server.is_some() && has(&e.tcp, &e.udp)),
            None => false,
        }
    }

    /// Stops (or restarts) the server of the pod with address `ip`, keeping its namespace.
    pub fn set_pod_serving(&self, ip: IpAddr, serving: bool) -> Result<()> {
        let mut pods = lock(&self.pods);
        let e = pods
            .values_mut()
            .find(|e| e.pod.has_ip(ip))
            .context("no such pod")?;
        e.server = None;
        if serving {
            let t: Vec<u16> = e.tcp.iter().copied().collect();
            let u: Vec<u16> = e.udp.iter().copied().collect();
            e.server = Some(PodServer::start(e.pod.netns(), e.pod.name(), &t, &u)?);
        }
        Ok(())
    }

    /// Adds an external client.
    pub fn add_external_client(&self, spec: &ExternalSpec) -> Result<ExternalClient> {
        let via = match &spec.via {
            Some(name) => self.node_index(name)?,
            None => 0,
        };
        let ips = if spec.addresses.is_empty() {
            let (v4, v6) = self.cluster.next_external_ips()?;
            vec![IpAddr::V4(v4), IpAddr::V6(v6)]
        } else {
            spec.addresses.clone()
        };
        self.cluster.add_external_client_with(&spec.name, &ips, via)
    }

    /// The external client named `name`.
    pub fn external(&self, name: &str) -> Option<ExternalClient> {
        self.cluster.external_client(name)
    }

    /// Resolves a probe's `from`: a pod name, a node name, an external client name, or an
    /// address (of a pod, a node, or an external client), in which case the probe binds it.
    pub fn resolve(&self, from: &str) -> Result<ProbeSource> {
        if let Ok(ip) = from.parse::<IpAddr>() {
            let ip = ip.to_canonical();
            let origin = if let Some(pod) = self.cluster.pod_by_ip(ip) {
                Origin::Pod(pod)
            } else if let Some(node) = self.cluster.node_by_ip(ip) {
                Origin::Node(node.index())
            } else if let Some(client) = self.cluster.external_client_by_ip(ip) {
                Origin::External(client)
            } else {
                bail!("no pod, node or external client has address {ip}");
            };
            return Ok(ProbeSource {
                origin,
                bind: Some(ip),
            });
        }
        let origin = if let Some(pod) = self.cluster.pod(from) {
            Origin::Pod(pod)
        } else if let Some(node) = self.cluster.node_by_name(from) {
            Origin::Node(node.index())
        } else if let Some(client) = self.cluster.external_client(from) {
            Origin::External(client)
        } else {
            bail!("{from:?} is neither a pod, a node, an external client nor an address of one");
        };
        Ok(ProbeSource { origin, bind: None })
    }

    /// One probe from `from` (see [`Lab::resolve`]) to `dst` with the default timeout.
    pub async fn probe(&self, from: &str, proto: Proto, dst: SocketAddr) -> ProbeResult {
        self.probe_n(from, proto, dst, 1, PROBE_TIMEOUT)
            .await
            .pop()
            .unwrap_or_else(|| ProbeResult::Error("no probe ran".into()))
    }

    /// `count` probes (new connections, one after the other) from `from` to `dst`.
    pub async fn probe_n(
        &self,
        from: &str,
        proto: Proto,
        dst: SocketAddr,
        count: usize,
        timeout: Duration,
    ) -> Vec<ProbeResult> {
        self.probe_n_from_port(from, proto, dst, 0, count, timeout)
            .await
    }

    /// One probe from `from` to `dst` from source port `port` (every probe of a 5-tuple test,
    /// such as a conntrack test, uses the same one).
    pub async fn probe_from_port(
        &self,
        from: &str,
        proto: Proto,
        dst: SocketAddr,
        port: u16,
    ) -> ProbeResult {
        self.probe_n_from_port(from, proto, dst, port, 1, PROBE_TIMEOUT)
            .await
            .pop()
            .unwrap_or_else(|| ProbeResult::Error("no probe ran".into()))
    }

    /// `count` probes from `from` to `dst` from source port `port` (0: a new one each time).
    pub async fn probe_n_from_port(
        &self,
        from: &str,
        proto: Proto,
        dst: SocketAddr,
        port: u16,
        count: usize,
        timeout: Duration,
    ) -> Vec<ProbeResult> {
        match self.resolve(from) {
            Ok(src) => {
                let bind = bind_addr(dst, src.bind, port);
                probe_repeat_bound_async(src.netns(self), proto, dst, bind, timeout, count).await
            }
            Err(err) => vec![ProbeResult::Error(format!("{err:#}")); count.max(1)],
        }
    }

    /// An HTTP GET of `url` (`http://IP:PORT/path`) from `from`.
    pub async fn http_get(&self, from: &str, url: &str, timeout: Duration) -> HttpResult {
        match self.resolve(from) {
            Ok(src) => http_get_async(src.netns(self), src.bind, url, timeout).await,
            Err(err) => HttpResult::Error(format!("{err:#}")),
        }
    }

    /// The lab as JSON: API server, brains, nodes (addresses, pod CIDRs, zones), pods, external
    /// clients, flags; with the chart, its pods (`chart`).
    pub fn status(&self) -> serde_json::Value {
        let brain_opts = self.opts.effective_brain_options();
        let mut status = serde_json::json!({
            "kubeconfig": self.cp.kubeconfig_path(),
            "apiserver": self.cp.url(),
            "service_cidrs": self.opts.service_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "brain_flags": brain_opts.args(),
            "pod_network": self.opts.effective_pod_network(),
            "pod_interface_prefix": POD_INTERFACE_PREFIX,
            "brains": self.brains.iter().flatten().map(|b| serde_json::json!({
                "grpc": b.grpc.to_string(),
                "metrics": format!("http://{}/metrics", b.metrics),
            })).collect::<Vec<_>>(),
            "nodes": self.cluster.nodes().iter().enumerate().map(|(i, n)| serde_json::json!({
                "name": n.name(),
                "ips": n.ips().iter().map(ToString::to_string).collect::<Vec<_>>(),
                "pod_cidrs": n.pod_cidrs().iter().map(ToString::to_string).collect::<Vec<_>>(),
                "zone": self.node_specs.get(i).and_then(|s| s.zone.clone()),
                "netns": n.netns().name(),
            })).collect::<Vec<_>>(),
            "pods": self.cluster.pods().iter().map(|p| {
                let ports = lock(&self.pods).get(p.name()).map(|e| (
                    e.tcp.iter().copied().collect::<Vec<_>>(),
                    e.udp.iter().copied().collect::<Vec<_>>(),
                ));
                serde_json::json!({
                    "name": p.name(),
                    "ips": p.ips().iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "node": p.node(),
                    "veth": p.node_veth(),
                    "tcp": ports.as_ref().map(|p| p.0.clone()),
                    "udp": ports.as_ref().map(|p| p.1.clone()),
                    "netns": p.netns().name(),
                })
            }).collect::<Vec<_>>(),
            "host_servers": lock(&self.host_servers).iter().map(|(i, e)| serde_json::json!({
                "node": self.cluster.node(*i).name(), "name": e.name,
                "tcp": e.tcp, "udp": e.udp,
            })).collect::<Vec<_>>(),
            "external_clients": self.cluster.external_clients().iter().map(|e| serde_json::json!({
                "name": e.name(),
                "ips": e.ips().iter().map(ToString::to_string).collect::<Vec<_>>(),
                "via": self.cluster.node(e.via_node()).name(),
                "netns": e.netns().name(),
            })).collect::<Vec<_>>(),
            "logs": self.dir(),
        });
        // Installed, the brains run with the chart's arguments, not the lab's.
        if let Some(install) = &self.install {
            let chart = install.status();
            status["brain_flags"] = chart["brain_args"].clone();
            status["chart"] = chart;
        }
        status
    }
}

impl Drop for Lab {
    /// Stops what runs inside the namespaces first (pod servers, actuators, brains), then the
    /// control plane, then the network.
    fn drop(&mut self) {
        lock(&self.pods).clear();
        lock(&self.host_servers).clear();
        self.install = None;
        self.actuators.clear();
        self.brains.clear();
    }
}

/// JSON merge patch (RFC 7386): objects merge key by key, `null` removes a key, anything else
/// replaces.
pub fn merge_json(target: &mut serde_json::Value, patch: &serde_json::Value) {
    match (target, patch) {
        (serde_json::Value::Object(t), serde_json::Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_json(t.entry(k.clone()).or_insert(serde_json::Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_like_a_json_merge_patch() {
        let mut node = serde_json::json!({
            "metadata": {"name": "n", "labels": {"a": "1", "b": "2"}},
            "status": {"addresses": [{"type": "InternalIP", "address": "1.1.1.1"}]},
        });
        merge_json(
            &mut node,
            &serde_json::json!({
                "metadata": {"labels": {"b": null, "c": "3"}},
                "status": {"addresses": [{"type": "InternalIP", "address": "2.2.2.2"}]},
            }),
        );
        assert_eq!(
            node,
            serde_json::json!({
                "metadata": {"name": "n", "labels": {"a": "1", "c": "3"}},
                "status": {"addresses": [{"type": "InternalIP", "address": "2.2.2.2"}]},
            })
        );
    }

    #[test]
    fn options_render_brain_flags() {
        let mut opts = LabOptions::new("/bin/true");
        let brain = opts.effective_brain_options();
        assert_eq!(
            brain.rules.service_cidrs,
            [
                "10.96.0.0/16".parse::<IpNet>().unwrap(),
                "fd00:96::/112".parse().unwrap()
            ]
        );
        let args = brain.args().join(" ");
        assert!(
            args.contains("--service-cidr 10.96.0.0/16,fd00:96::/112")
                && args.contains("--cluster-cidr 10.244.0.0/16,fd00:244::/48")
                && args.contains("--detect-local-mode ClusterCIDR")
                && !args.contains("--pod-"),
            "{args}"
        );
        opts.brain.rules.detect_local = DetectLocalMode::InterfaceNamePrefix;
        assert_eq!(
            opts.effective_brain_options()
                .rules
                .pod_interface_name_prefix,
            POD_INTERFACE_PREFIX
        );
        assert!(
            opts.effective_brain_options()
                .args()
                .join(" ")
                .contains("--pod-interface-name-prefix pod")
        );
        assert_eq!(opts.effective_pod_network(), PodNetwork::Routed);
        opts.brain.rules.detect_local = DetectLocalMode::BridgeInterface;
        assert_eq!(
            opts.effective_brain_options().rules.pod_bridge_interface,
            POD_BRIDGE
        );
        assert!(
            opts.effective_brain_options()
                .args()
                .join(" ")
                .contains("--pod-bridge-interface cbr0")
        );
        assert_eq!(opts.effective_pod_network(), PodNetwork::Bridge);
        opts.brain.rules.service_cidrs = vec!["10.96.0.0/20".parse().unwrap()];
        assert_eq!(
            opts.effective_brain_options().rules.service_cidrs,
            ["10.96.0.0/20".parse::<IpNet>().unwrap()]
        );
        assert_eq!(opts.effective_nodes().len(), 2);
    }
}
