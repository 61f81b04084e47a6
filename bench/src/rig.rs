//! Assembly of the benchmark cluster from the harness's parts.
//!
//! The lab (`splitproxy_tests::lab::Lab`) creates its own Node objects and starts the brain at
//! once; the benchmark needs the opposite order (the workload, with thousands of Node objects,
//! exists before the brain starts, so cold start is measured against it), so it assembles the
//! same parts itself: the control plane, node namespaces, the PKI, `deploy::Brain` (one per
//! replica, each at a fixed address so that a replica started again is found where it was),
//! `deploy::Actuator`, kube-proxy and the virtual fleet. Fields drop in declaration order, so the
//! clients go before the brain, the brain before the namespaces, and the control plane last.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use splitproxy_proto::v1::dataplane_client::DataplaneClient;
use splitproxy_proto::v1::{ListNodesRequest, ListNodesResponse};
use splitproxy_tests::certs::{Pki, TlsFiles};
use splitproxy_tests::deploy::{
    ACTUATOR_HEALTHZ, ACTUATOR_METRICS, Actuator, Brain, BrainOptions, http_get_in,
};
use splitproxy_tests::{Cluster, ClusterSpec, ControlPlane, ControlPlaneOptions};
use tonic::transport::Channel;

use crate::fleet::Fleet;
use crate::kubeproxy::KubeProxy;
use crate::measure::prom::Scrape;
use crate::workload::{SERVICE_CIDR, node_name};

pub struct Rig {
    pub fleet: Option<Fleet>,
    pub kube_proxy: Option<KubeProxy>,
    pub actuators: Vec<Actuator>,
    /// The brain replicas, by index; `None` while a replica is down (killed by the failover
    /// phase, stopped by the restart phase).
    pub brains: Vec<Option<Brain>>,
    /// Each replica's gRPC address, fixed at its first start: a replica started again listens
    /// where it did, as a restarted pod behind the same address would, so nodes find it.
    pub brain_addrs: Vec<SocketAddr>,
    /// Node namespaces: `real` actuator nodes, then kube-proxy's.
    pub cluster: Cluster,
    pub cp: ControlPlane,
    pub pki: Arc<Pki>,
    pub operator_tls: TlsFiles,
    pub exe: PathBuf,
    pub dir: PathBuf,
    pub real: usize,
    /// Flags every replica gets after the benchmark's own (`--brain-arg`).
    pub brain_args: Vec<String>,
    /// Every replica's `--worker-threads` (`--brain-worker-threads`).
    pub brain_worker_threads: usize,
    /// The serving certificate every replica serves (written by [`Rig::start_brains`]).
    brain_tls: Option<TlsFiles>,
    /// One operator connection per replica, reused by every poll (a TLS handshake per poll
    /// would load the brain being measured).
    operators: Vec<tokio::sync::OnceCell<DataplaneClient<Channel>>>,
}

/// What every replica's ListNodes said at one moment (`None`: it did not answer).
#[derive(Debug, Clone, Default)]
pub struct View {
    pub replicas: Vec<Option<ListNodesResponse>>,
}

impl View {
    /// Distinct nodes connected and in sync on some replica that answered.
    pub fn in_sync(&self) -> usize {
        self.in_sync_nodes().len()
    }

    /// The nodes connected and in sync on some replica that answered.
    pub fn in_sync_nodes(&self) -> std::collections::HashSet<&str> {
        self.nodes_where(|n| n.connected && n.in_sync)
    }

    /// The nodes connected to some replica that answered and holding a state it confirmed:
    /// they acked one of its updates, or it found what they presented current (resumed by
    /// content with nothing published since). A node moved to another replica is resumed once
    /// here, however far the fan-out lags behind the newest publication.
    pub fn resumed_nodes(&self) -> std::collections::HashSet<&str> {
        self.nodes_where(|n| n.connected && (n.acked_generation > 0 || n.in_sync))
    }

    /// The nodes some replica that answered reports as `keep` says.
    fn nodes_where(
        &self,
        keep: impl Fn(&splitproxy_proto::v1::NodeStatus) -> bool,
    ) -> std::collections::HashSet<&str> {
        self.replicas
            .iter()
            .flatten()
            .flat_map(|r| r.nodes.iter())
            .filter(|n| keep(n))
            .map(|n| n.node.as_str())
            .collect()
    }

    /// The nodes each replica serves (connected), by replica.
    pub fn connected(&self) -> Vec<std::collections::BTreeSet<String>> {
        self.replicas
            .iter()
            .map(|r| {
                r.iter()
                    .flat_map(|r| r.nodes.iter())
                    .filter(|n| n.connected)
                    .map(|n| n.node.clone())
                    .collect()
            })
            .collect()
    }

    /// Each replica's desired version (0 for one that did not answer).
    pub fn versions(&self) -> Vec<u64> {
        self.replicas
            .iter()
            .map(|r| r.as_ref().map_or(0, |r| r.desired_version))
            .collect()
    }

    /// Every replica that answered published a state newer than `before` (its versions when
    /// a step began), and at least one answered.
    pub fn newer_than(&self, before: &[u64]) -> bool {
        let mut any = false;
        for (i, r) in self.replicas.iter().enumerate() {
            if let Some(r) = r {
                any = true;
                if r.desired_version <= before.get(i).copied().unwrap_or(0) {
                    return false;
                }
            }
        }
        any
    }

    /// Every replica that answered is synced, and at least one answered.
    pub fn synced(&self) -> bool {
        let mut answered = self.replicas.iter().flatten().peekable();
        answered.peek().is_some() && answered.all(|r| r.synced)
    }
}

impl Rig {
    /// Starts the control plane and creates the node namespaces; nothing of splitproxy runs yet.
    pub async fn start(exe: PathBuf, dir: &Path, real: usize) -> anyhow::Result<Rig> {
        std::fs::create_dir_all(dir)?;
        let cp = ControlPlane::start(ControlPlaneOptions {
            service_cluster_ip_range: SERVICE_CIDR.to_string(),
            extra_apiserver_args: vec![
                // Writing the workload fast and holding a watch storm: more requests in flight,
                // and as many HTTP/2 streams per connection as the storm multiplexes.
                "--max-requests-inflight=3000".into(),
                "--max-mutating-requests-inflight=1000".into(),
                "--http2-max-streams-per-connection=1000".into(),
            ],
            ready_timeout: Duration::from_secs(180),
            ..Default::default()
        })
        .await
        .context("starting etcd and kube-apiserver")?;
        let names: Vec<String> = (0..=real).map(node_name).collect();
        let cluster = Cluster::new(ClusterSpec::with_node_names(names))
            .context("creating node namespaces")?;
        let pki = Arc::new(Pki::new("splitproxy-bench")?);
        let operator_tls = pki.write(dir, "operator", &pki.operator_cert("operator")?)?;
        Ok(Rig {
            fleet: None,
            kube_proxy: None,
            actuators: Vec::new(),
            brains: Vec::new(),
            brain_addrs: Vec::new(),
            cluster,
            cp,
            pki,
            operator_tls,
            exe,
            dir: dir.to_path_buf(),
            real,
            brain_args: Vec::new(),
            brain_worker_threads: 0,
            brain_tls: None,
            operators: Vec::new(),
        })
    }

    /// The node namespaces' addresses, in node order (for their Node objects).
    pub fn node_ips(&self) -> Vec<std::net::Ipv4Addr> {
        self.cluster.nodes().iter().map(|n| n.ip()).collect()
    }

    /// kube-proxy's node (the last namespace).
    pub fn kube_proxy_node(&self) -> &splitproxy_tests::Node {
        self.cluster.node(self.real)
    }

    /// The role (process name, log and certificate name) of replica `i` of `n`: "brain" when
    /// there is one, as before replicas existed, "brain-i" otherwise.
    pub fn brain_role(i: usize, n: usize) -> String {
        if n == 1 {
            "brain".to_string()
        } else {
            format!("brain-{i}")
        }
    }

    /// Starts `n` brain replicas, each watching the API server itself, with serving
    /// certificates from the same CA the nodes trust.
    pub fn start_brains(&mut self, n: usize) -> anyhow::Result<()> {
        // One serving certificate for every replica and restart, as a Deployment's replicas
        // share one Secret (and so the key their TLS session tickets are made with).
        self.brain_tls = Some(Brain::serving_files(&self.pki, &self.dir, "brain")?);
        for i in 0..n {
            let brain = self.spawn_brain(i, n, None, "")?;
            self.brain_addrs.push(brain.grpc);
            self.brains.push(Some(brain));
            self.operators.push(tokio::sync::OnceCell::new());
        }
        Ok(())
    }

    /// Starts replica `i` again at its address (after a kill or a stop); `attempt` tells its
    /// log apart from the earlier process's.
    pub fn restart_brain(&mut self, i: usize, attempt: usize) -> anyhow::Result<()> {
        let n = self.brains.len();
        let addr = *self
            .brain_addrs
            .get(i)
            .with_context(|| format!("no brain replica {i}"))?;
        let brain = self.spawn_brain(i, n, Some(addr), &format!("-run{attempt}"))?;
        self.brains[i] = Some(brain);
        // A fresh operator connection: the old one may have given up on the dead process.
        self.operators[i] = tokio::sync::OnceCell::new();
        Ok(())
    }

    fn spawn_brain(
        &self,
        i: usize,
        n: usize,
        addr: Option<SocketAddr>,
        suffix: &str,
    ) -> anyhow::Result<Brain> {
        let mut opts = BrainOptions::with_service_cidrs(&[SERVICE_CIDR
            .parse()
            .context("the benchmark's service CIDR")?]);
        opts.serving = self.brain_tls.clone();
        opts.tuning.worker_threads = self.brain_worker_threads;
        opts.extra_args = self.brain_args.clone();
        Brain::start(
            &self.exe,
            self.cp.kubeconfig_path(),
            &self.pki,
            &self.dir,
            &format!("{}{suffix}", Self::brain_role(i, n)),
            addr,
            &opts,
        )
    }

    /// Kills replica `i` with SIGKILL (no goodbye to its nodes) and forgets it.
    pub fn kill_brain(&mut self, i: usize) -> anyhow::Result<()> {
        let mut brain = self
            .brains
            .get_mut(i)
            .and_then(Option::take)
            .with_context(|| format!("brain replica {i} is not running"))?;
        brain.child.signal(nix::sys::signal::Signal::SIGKILL)?;
        let _ = brain.child.stop();
        Ok(())
    }

    /// Stops every replica the way an orchestrator does, all at once: SIGTERM to each, then
    /// each reaped (SIGKILL after its grace period). Stopping them one after the other would
    /// chase nodes from one stopping replica to the next and grow their reconnect backoff.
    /// Returns how many did not exit on SIGTERM within the grace period and were killed.
    pub fn stop_brains(&mut self) -> anyhow::Result<usize> {
        use nix::sys::signal::Signal;
        let grace = splitproxy_tests::process::DEFAULT_GRACE;
        for brain in self.brains.iter_mut().flatten() {
            // One that already exited is reaped below.
            let _ = brain.child.signal(Signal::SIGTERM);
        }
        // One grace period for all of them, as for the containers of one pod.
        let deadline = std::time::Instant::now() + grace;
        while std::time::Instant::now() < deadline
            && self
                .brains
                .iter_mut()
                .flatten()
                .any(|b| b.child.is_running())
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut killed = 0;
        for slot in &mut self.brains {
            if let Some(mut brain) = slot.take() {
                if brain.child.is_running() {
                    killed += 1;
                    let _ = brain.child.signal(Signal::SIGKILL);
                }
                brain.child.stop()?;
            }
        }
        Ok(killed)
    }

    /// The first running replica.
    pub fn brain(&self) -> anyhow::Result<&Brain> {
        self.brains
            .iter()
            .flatten()
            .next()
            .context("no brain replica is running")
    }

    /// The running replicas, with their index.
    pub fn running_brains(&self) -> impl Iterator<Item = (usize, &Brain)> {
        self.brains
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (i, b)))
    }

    /// Starts one actuator per real node namespace.
    pub fn start_actuators(&mut self) -> anyhow::Result<()> {
        for i in 0..self.real {
            let node = self.cluster.node(i);
            let brains = actuator_brains(i, node.name(), &self.brain_addrs);
            let a = Actuator::start(
                &self.exe,
                node.netns(),
                node.name(),
                &brains,
                &self.pki,
                &self.dir,
            )?;
            self.actuators.push(a);
        }
        Ok(())
    }

    /// Whether the actuator of real node `i` answers /readyz with 200.
    pub fn actuator_ready(&self, i: usize) -> bool {
        let ns = self.cluster.node(i).netns();
        let Ok(addr) = ACTUATOR_HEALTHZ.parse() else {
            return false;
        };
        matches!(http_get_in(ns, addr, "/readyz"), Ok((200, _)))
    }

    /// The actuator of real node `i`: its /metrics.
    pub fn actuator_scrape(&self, i: usize) -> anyhow::Result<Scrape> {
        let ns = self.cluster.node(i).netns();
        let (code, body) = http_get_in(ns, ACTUATOR_METRICS.parse()?, "/metrics")?;
        anyhow::ensure!(code == 200, "actuator /metrics answered {code}");
        Ok(Scrape::parse(&body))
    }

    /// Every replica's /metrics, by index (`None` for one that is down or did not answer).
    pub fn brain_scrapes(&self) -> Vec<Option<Scrape>> {
        self.brains
            .iter()
            .map(|b| {
                let (code, body) = b.as_ref()?.http_get("/metrics").ok()?;
                (code == 200).then(|| Scrape::parse(&body))
            })
            .collect()
    }

    /// Every running replica answers /readyz with 200.
    pub fn brain_ready(&self) -> bool {
        let mut running = self.running_brains().peekable();
        running.peek().is_some()
            && running.all(|(_, b)| b.http_get("/readyz").is_ok_and(|(code, _)| code == 200))
    }

    /// Replica `i`'s ListNodes, through an operator client.
    pub async fn list_nodes_of(&self, i: usize) -> anyhow::Result<ListNodesResponse> {
        let addr = *self.brain_addrs.get(i).context("no such replica")?;
        self.brains
            .get(i)
            .and_then(Option::as_ref)
            .context("the replica is not running")?;
        let mut client = self.operators[i]
            .get_or_try_init(|| async {
                splitproxy_tests::deploy::grpc_client(addr, &self.operator_tls).await
            })
            .await?
            .clone();
        let resp = tokio::time::timeout(
            Duration::from_secs(30),
            client.list_nodes(ListNodesRequest {}),
        )
        .await
        .context("ListNodes timed out")??;
        Ok(resp.into_inner())
    }

    /// Every running replica's ListNodes, asked together.
    pub async fn view(&self) -> View {
        let asks = (0..self.brains.len()).map(|i| self.list_nodes_of(i));
        View {
            replicas: futures::future::join_all(asks)
                .await
                .into_iter()
                .map(Result::ok)
                .collect(),
        }
    }

    /// The number of splitproxy nodes (real and virtual).
    pub fn splitproxy_nodes(&self) -> usize {
        self.real + self.fleet.as_ref().map_or(0, |f| f.size)
    }

    /// Log files, for the report.
    pub fn logs(&self) -> Vec<PathBuf> {
        let mut out = vec![self.cp.apiserver_log(), self.cp.etcd_log()];
        for (_, b) in self.running_brains() {
            if let Some(p) = b.child.log_path() {
                out.push(p.to_path_buf());
            }
        }
        for a in &self.actuators {
            if let Some(p) = a.child.log_path() {
                out.push(p.to_path_buf());
            }
        }
        if let Some(k) = &self.kube_proxy
            && let Some(p) = k.child.log_path()
        {
            out.push(p.to_path_buf());
        }
        out
    }
}

/// The brains real actuator `i` is given, in the order of its forwarders (the forwarder of
/// brain `j` listens at `brain_port_in_node(j)` in the node): arranged so that the address its
/// rendezvous order prefers (`brain_order`) leads to replica `i % n`, the next one to replica
/// `i + 1`, and so on. The actuator keeps its own order; the bench only chooses where each
/// address leads, so real node `i` starts on replica `i % n` as virtual node `i` does.
pub fn actuator_brains(i: usize, node: &str, addrs: &[SocketAddr]) -> Vec<SocketAddr> {
    let n = addrs.len();
    let urls: Vec<http::Uri> = (0..n)
        .filter_map(|j| {
            format!(
                "https://127.0.0.1:{}",
                splitproxy_tests::deploy::brain_port_in_node(j)
            )
            .parse()
            .ok()
        })
        .collect();
    let order = splitproxy_actuator::client::brain_order(node, &urls);
    let mut out = addrs.to_vec();
    for (k, uri) in order.iter().enumerate() {
        if let Some(port) = urls.iter().position(|u| u == uri) {
            out[port] = addrs[(i + k) % n];
        }
    }
    out
}

/// Every node is connected to some replica and holds that replica's latest state, and there
/// are `expected`.
pub fn all_in_sync(view: &View, expected: usize) -> bool {
    view.in_sync() >= expected
}

#[cfg(test)]
mod tests {
    use splitproxy_proto::v1::NodeStatus;

    use super::*;

    fn addrs(n: usize) -> Vec<SocketAddr> {
        (0..n)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 20_000 + i as u16)))
            .collect()
    }

    #[test]
    fn real_node_i_prefers_replica_i_mod_n_whatever_its_rendezvous_order() {
        for n in 1..=4 {
            let a = addrs(n);
            for i in 0..12 {
                let node = format!("node-{i}");
                let given = actuator_brains(i, &node, &a);
                // Every replica once.
                let mut sorted = given.clone();
                sorted.sort();
                assert_eq!(sorted, a, "n={n} i={i}");
                // The address the actuator tries first leads to replica i % n, then i + 1...
                let urls: Vec<http::Uri> = (0..n)
                    .map(|j| {
                        format!(
                            "https://127.0.0.1:{}",
                            splitproxy_tests::deploy::brain_port_in_node(j)
                        )
                        .parse()
                        .unwrap()
                    })
                    .collect();
                let order = splitproxy_actuator::client::brain_order(&node, &urls);
                for (k, uri) in order.iter().enumerate() {
                    let port = urls.iter().position(|u| u == uri).unwrap();
                    assert_eq!(given[port], a[(i + k) % n], "n={n} i={i} k={k}");
                }
            }
        }
    }

    fn status(node: &str, connected: bool, in_sync: bool) -> NodeStatus {
        NodeStatus {
            node: node.into(),
            connected,
            in_sync,
            ..Default::default()
        }
    }

    fn replica(version: u64, synced: bool, nodes: Vec<NodeStatus>) -> Option<ListNodesResponse> {
        Some(ListNodesResponse {
            synced,
            desired_version: version,
            nodes,
            ..Default::default()
        })
    }

    #[test]
    fn a_view_counts_each_node_once_on_the_replica_that_serves_it() {
        let view = View {
            replicas: vec![
                replica(
                    7,
                    true,
                    vec![
                        status("a", true, true),
                        status("b", false, false),
                        status("c", true, false),
                    ],
                ),
                replica(
                    3,
                    true,
                    vec![status("b", true, true), status("a", false, true)],
                ),
                None,
            ],
        };
        assert_eq!(view.in_sync(), 2, "a and b; c is behind");
        assert!(all_in_sync(&view, 2) && !all_in_sync(&view, 3));
        assert_eq!(view.versions(), vec![7, 3, 0]);
        assert_eq!(
            view.connected().iter().map(|c| c.len()).collect::<Vec<_>>(),
            vec![2, 1, 0]
        );
        // Every replica that answers must have moved on; one that is down does not count.
        assert!(view.newer_than(&[6, 2, 100]));
        assert!(!view.newer_than(&[6, 3, 0]), "replica 1 did not publish");
        assert!(view.synced());
        let mut behind = view.clone();
        behind.replicas[1].as_mut().unwrap().synced = false;
        assert!(!behind.synced());
        let none = View {
            replicas: vec![None, None],
        };
        assert!(!none.synced() && !none.newer_than(&[0, 0]));
    }
}
