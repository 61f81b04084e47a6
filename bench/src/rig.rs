//! Assembly of the benchmark cluster from the harness's parts.
//!
//! The lab (`splitproxy_tests::lab::Lab`) creates its own Node objects and starts the brain at
//! once; the benchmark needs the opposite order (the workload, with thousands of Node objects,
//! exists before the brain starts, so cold start is measured against it), so it assembles the
//! same parts itself: the control plane, node namespaces, the PKI, `deploy::Brain`,
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
    pub brain: Option<Brain>,
    /// Node namespaces: `real` actuator nodes, then kube-proxy's.
    pub cluster: Cluster,
    pub cp: ControlPlane,
    pub pki: Arc<Pki>,
    pub operator_tls: TlsFiles,
    pub exe: PathBuf,
    pub dir: PathBuf,
    pub real: usize,
    /// One operator connection to the brain, reused by every poll (a TLS handshake per poll
    /// would load the brain being measured).
    operator: tokio::sync::OnceCell<DataplaneClient<Channel>>,
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
            brain: None,
            cluster,
            cp,
            pki,
            operator_tls,
            exe,
            dir: dir.to_path_buf(),
            real,
            operator: tokio::sync::OnceCell::new(),
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

    pub fn start_brain(&mut self) -> anyhow::Result<&Brain> {
        let brain = Brain::start(
            &self.exe,
            self.cp.kubeconfig_path(),
            &self.pki,
            &self.dir,
            "brain",
            None,
            &BrainOptions::with_service_cidrs(&[SERVICE_CIDR
                .parse()
                .context("the benchmark's service CIDR")?]),
        )?;
        Ok(self.brain.insert(brain))
    }

    pub fn brain(&self) -> anyhow::Result<&Brain> {
        self.brain.as_ref().context("the brain is not running")
    }

    pub fn brain_grpc(&self) -> anyhow::Result<SocketAddr> {
        Ok(self.brain()?.grpc)
    }

    /// Starts one actuator per real node namespace.
    pub fn start_actuators(&mut self) -> anyhow::Result<()> {
        let brain = self.brain_grpc()?;
        for i in 0..self.real {
            let node = self.cluster.node(i);
            let a = Actuator::start(
                &self.exe,
                node.netns(),
                node.name(),
                &[brain],
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

    pub fn brain_scrape(&self) -> anyhow::Result<Scrape> {
        let (code, body) = self.brain()?.http_get("/metrics")?;
        anyhow::ensure!(code == 200, "brain /metrics answered {code}");
        Ok(Scrape::parse(&body))
    }

    pub fn brain_ready(&self) -> bool {
        self.brain()
            .and_then(|b| b.http_get("/readyz"))
            .is_ok_and(|(code, _)| code == 200)
    }

    /// The brain's ListNodes, through an operator client.
    pub async fn list_nodes(&self) -> anyhow::Result<ListNodesResponse> {
        let mut client = self
            .operator
            .get_or_try_init(|| async {
                splitproxy_tests::deploy::grpc_client(self.brain_grpc()?, &self.operator_tls).await
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

    /// The number of splitproxy nodes (real and virtual).
    pub fn splitproxy_nodes(&self) -> usize {
        self.real + self.fleet.as_ref().map_or(0, |f| f.size)
    }

    /// Log files, for the report.
    pub fn logs(&self) -> Vec<PathBuf> {
        let mut out = vec![self.cp.apiserver_log(), self.cp.etcd_log()];
        if let Some(b) = &self.brain
            && let Some(p) = b.child.log_path()
        {
            out.push(p.to_path_buf());
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

/// Every node the brain lists is connected and holds its latest state, and there are `expected`.
pub fn all_in_sync(ln: &ListNodesResponse, expected: usize) -> bool {
    ln.nodes.iter().filter(|n| n.connected && n.in_sync).count() >= expected
}
