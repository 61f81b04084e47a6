//! Traffic a fault test keeps running while it breaks something: new TCP connections back to
//! back through a Service, so that "0 failed connections" is measured with real packets rather
//! than assumed. Every loop is bounded in count and in time, whatever the test does.
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::fixtures::{Ep, docs, namespace, service, slice};
use crate::lab::Lab;
use crate::{Pod, ProbeResult, Proto, probe_async};

/// Pause between two connections: enough to leave the machine to the components under test.
const PAUSE: Duration = Duration::from_millis(10);

/// A connection that did not get an answer.
#[derive(Debug, Clone)]
pub struct Failure {
    /// When the probe began (its first packet left at about that time).
    pub started: Instant,
    pub result: ProbeResult,
}

/// A running connection loop; [`ConnectionLoop::stop`] ends it and reports.
pub struct ConnectionLoop {
    stop: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<(Vec<Failure>, usize)>,
}

impl ConnectionLoop {
    /// New TCP connections to `dst`, from `clients` in turn, each waiting at most
    /// `probe_timeout` for its answer, until [`ConnectionLoop::stop`], `max` connections or
    /// `max_time`, whichever comes first.
    pub fn start(
        clients: Vec<Pod>,
        dst: SocketAddr,
        max: usize,
        max_time: Duration,
        probe_timeout: Duration,
    ) -> ConnectionLoop {
        assert!(!clients.is_empty(), "a connection loop needs a client");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = tokio::spawn(async move {
            let began = Instant::now();
            let mut failures = Vec::new();
            let mut n = 0;
            while !flag.load(Ordering::Relaxed) && n < max && began.elapsed() < max_time {
                let client = &clients[n % clients.len()];
                let started = Instant::now();
                let result =
                    probe_async(client.netns(), Proto::Tcp, dst, None, probe_timeout).await;
                if !result.is_answered() {
                    failures.push(Failure { started, result });
                }
                n += 1;
                tokio::time::sleep(PAUSE).await;
            }
            (failures, n)
        });
        ConnectionLoop { stop, handle }
    }

    /// Ends the loop; returns every connection that failed, and how many were made.
    pub async fn stop(self) -> (Vec<Failure>, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.await.expect("the connection loop panicked")
    }
}

/// Probes `dst` from `client` until it answers; panics after `limit`.
pub async fn wait_answered(client: &Pod, dst: SocketAddr, limit: Duration) {
    let start = Instant::now();
    while !probe_async(
        client.netns(),
        Proto::Tcp,
        dst,
        None,
        Duration::from_millis(500),
    )
    .await
    .is_answered()
    {
        assert!(
            start.elapsed() < limit,
            "{dst} never answered within {limit:?}"
        );
    }
}

/// The Service a fault test keeps traffic on: `web` in namespace `ns` at `cluster_ip`, port 80,
/// with one endpoint (port 8080) on each of node-0 (`10.244.0.21`, pod `web-a`) and node-1
/// (`10.244.1.21`, pod `web-b`), and a client pod on node-0 (`10.244.0.100`). Returns the client
/// once the Service answers it.
pub async fn web_service_with_client(lab: &Lab, ns: &str, cluster_ip: &str) -> Pod {
    lab.apply_yaml(&docs(&[
        namespace(ns),
        service(ns, "web", cluster_ip, &[("http", "TCP", 80, 8080)]),
        slice(
            ns,
            "web-1",
            "web",
            &[("http", "TCP", 8080)],
            &[
                Ep::new("10.244.0.21", "node-0", "web-a"),
                Ep::new("10.244.1.21", "node-1", "web-b"),
            ],
        ),
    ]))
    .await
    .expect("the web Service applies");
    let client = lab
        .ensure_pod(
            0,
            "client",
            "10.244.0.100".parse().expect("an address"),
            &Default::default(),
            &Default::default(),
        )
        .expect("the client pod starts");
    let dst = SocketAddr::new(cluster_ip.parse().expect("a ClusterIP"), 80);
    wait_answered(&client, dst, Duration::from_secs(10)).await;
    client
}
