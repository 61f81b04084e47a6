//! The virtual nodes: one real mTLS gRPC stream per node to the real brain, applying into the
//! in-memory model only, so that the brain's fan-out to thousands of nodes is exercised on one
//! machine. Benchmark code, not the production actuator's: it applies nothing to a kernel and
//! speaks the protocol and the model from `splitproxy_proto` itself; of the actuator it uses
//! only the reconnect pacing (`splitproxy_actuator::client::Pacing`), so that virtual nodes
//! come back after a brain failover as real ones do.
//!
//! [`nodes`] runs the streams, `grpc` is one node's `Sync` call on its own task, `shared` holds
//! the models nodes at the same state share, `envelope` reads an update without decoding its
//! bodies, and [`npl`] turns the fleet's samples into network-programming latencies. This
//! module is the bench's only way to the fleet: it issues the nodes' certificates and runs the
//! fleet on a runtime of its own.
mod envelope;
mod grpc;
pub mod nodes;
pub mod npl;
mod shared;

use std::sync::Arc;

use anyhow::Context;
use splitproxy_tests::certs::Pki;

pub use nodes::{FleetConfig, FleetNode, FleetStatus, NodeStats, Sample, VirtualFleet};
pub use npl::NplCollector;

/// Issues one client certificate per node (CN = node name) from the brain's client CA, on all
/// cores: ECDSA key generation is the slow part at 5,000 nodes.
pub async fn issue(pki: &Arc<Pki>, names: &[String]) -> anyhow::Result<Vec<FleetNode>> {
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let chunk = names.len().div_ceil(workers).max(1);
    let mut tasks = Vec::new();
    for part in names.chunks(chunk) {
        let pki = pki.clone();
        let part = part.to_vec();
        tasks.push(tokio::task::spawn_blocking(move || {
            part.into_iter()
                .map(|name| {
                    let pair = pki.node_cert(&name)?;
                    Ok(FleetNode {
                        name,
                        cert_pem: pair.cert_pem.into_bytes(),
                        key_pem: pair.key_pem.into_bytes(),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()
        }));
    }
    let mut out = Vec::with_capacity(names.len());
    for t in tasks {
        out.extend(t.await.context("certificate worker")??);
    }
    Ok(out)
}

/// A running virtual fleet.
pub struct Fleet {
    inner: Arc<VirtualFleet>,
    pub size: usize,
    /// The fleet's own runtime. Thousands of streams decoding and applying updates would
    /// otherwise share the bench's workers with the API writer, whose churn writes then
    /// fell behind and measured the bench, not splitproxy.
    runtime: Option<tokio::runtime::Runtime>,
}

impl Fleet {
    /// Starts every node's stream on a runtime of the fleet's own; node `i` starts on replica
    /// `i % brains.len()`.
    pub fn start(
        brains: &[std::net::SocketAddr],
        ca_pem: &str,
        nodes: Vec<FleetNode>,
    ) -> anyhow::Result<Fleet> {
        let size = nodes.len();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("virtual-fleet")
            .enable_all()
            .build()
            .context("building the virtual fleet's runtime")?;
        let inner = {
            let _on = runtime.enter();
            VirtualFleet::start(FleetConfig {
                brains: brains.iter().map(|b| format!("https://{b}")).collect(),
                server_name: Some("127.0.0.1".to_string()),
                ca_pem: ca_pem.as_bytes().to_vec(),
                nodes,
            })?
        };
        Ok(Fleet {
            inner,
            size,
            runtime: Some(runtime),
        })
    }

    pub fn status(&self) -> FleetStatus {
        self.inner.status()
    }

    /// Every node connected and holding an applied state. Nodes hold different states (each
    /// has its own NodePort addresses and local endpoints), so whether each holds the brain's
    /// latest is asked of the brain (`ListNodes`), not read from the digests.
    pub fn all_applied(&self) -> bool {
        all_applied(&self.status(), self.size)
    }

    /// What each virtual node received so far (bytes, snapshots, deltas, its replica).
    pub fn node_stats(&self) -> Vec<NodeStats> {
        self.inner.node_stats()
    }

    /// Drains the samples recorded since the last call into `into`.
    pub fn drain(&self, into: &mut NplCollector) {
        for s in self.inner.take_samples() {
            into.record(s);
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.inner.stop();
        // Dropped from async code: a blocking shutdown would panic there.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Every one of `size` nodes connected and holding some applied state.
pub fn all_applied(st: &FleetStatus, size: usize) -> bool {
    st.connected >= size && st.digests.values().sum::<usize>() >= size
}
