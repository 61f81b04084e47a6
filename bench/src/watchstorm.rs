//! The API server's watch load: splitproxy's brain watches versus one watcher set per node, as N
//! kube-proxies would open (Services, EndpointSlices and the node's own Node: 3 watches x N).
//!
//! Opening 15,000 watches from one process needs HTTP/2: the API server multiplexes many streams
//! on one connection, so the storm opens one TLS connection per 250 watches and one HTTP/2
//! stream per watch, started at the current resourceVersion (the steady state: no initial
//! lists), and reads and discards every event so the API server never sees a slow watcher.
//! Everything is bounded: establishing waits at most two minutes and the storm ends when
//! dropped.
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::ListParams;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::task::JoinSet;

use crate::measure::prom::Scrape;
use crate::workload::Writer;

/// Watches per HTTP/2 connection (the API server allows 1000 here; Go's default is 250).
const STREAMS_PER_CONNECTION: usize = 250;
const ESTABLISH_TIMEOUT: Duration = Duration::from_secs(120);

/// The API server's watch gauges: `apiserver_longrunning_requests{verb="WATCH"}` and
/// `apiserver_registered_watchers`, each summed over resources (`None` when absent).
pub async fn apiserver_watches(w: &Writer) -> (Option<f64>, Option<f64>) {
    let Ok(text) = w.apiserver_metrics().await else {
        return (None, None);
    };
    let s = Scrape::parse(&text);
    let watches = s.sum_where("apiserver_longrunning_requests", |l| {
        l.iter().any(|(k, v)| k == "verb" && v == "WATCH")
    });
    (watches, s.sum("apiserver_registered_watchers"))
}

#[derive(Debug, Default)]
pub struct StormStats {
    pub requested: AtomicUsize,
    pub established: AtomicUsize,
    pub failed: AtomicUsize,
    /// Watches the API server ended while the storm was running.
    pub ended: AtomicUsize,
    pub bytes: AtomicU64,
}

/// A running storm; dropping it closes every watch.
pub struct Storm {
    pub stats: Arc<StormStats>,
    tasks: JoinSet<()>,
}

impl Drop for Storm {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

/// Where and how to reach the API server.
pub struct Target {
    pub addr: SocketAddr,
    pub ca_pem: String,
    pub token: String,
}

impl Storm {
    /// Opens Services, EndpointSlices and own-Node watches for every node in `nodes`, and waits
    /// (bounded) until each is established or failed.
    pub async fn open(
        client: kube::Client,
        target: &Target,
        nodes: &[String],
    ) -> anyhow::Result<Storm> {
        let rv = Api::<Service>::all(client)
            .list_metadata(&ListParams::default().limit(1))
            .await
            .context("reading the current resourceVersion")?
            .metadata
            .resource_version
            .context("list without resourceVersion")?;
        let mut paths = Vec::with_capacity(nodes.len() * 3);
        for node in nodes {
            paths.push(format!(
                "/api/v1/services?watch=1&allowWatchBookmarks=true&resourceVersion={rv}\
                 &labelSelector=%21service.kubernetes.io%2Fheadless%2C%21service.kubernetes.io%2Fservice-proxy-name"
            ));
            paths.push(format!(
                "/apis/discovery.k8s.io/v1/endpointslices?watch=1&allowWatchBookmarks=true\
                 &resourceVersion={rv}&labelSelector=%21service.kubernetes.io%2Fheadless%2C\
                 %21service.kubernetes.io%2Fservice-proxy-name"
            ));
            paths.push(format!(
                "/api/v1/nodes?watch=1&allowWatchBookmarks=true&resourceVersion={rv}\
                 &fieldSelector=metadata.name%3D{node}"
            ));
        }
        let tls = tls_config(&target.ca_pem)?;
        let stats = Arc::new(StormStats::default());
        stats.requested.store(paths.len(), Ordering::Relaxed);
        let mut tasks = JoinSet::new();
        for chunk in paths.chunks(STREAMS_PER_CONNECTION) {
            let chunk = chunk.to_vec();
            let tls = tls.clone();
            let stats = stats.clone();
            let addr = target.addr;
            let token = target.token.clone();
            tasks.spawn(async move {
                let n = chunk.len();
                if let Err(e) = connection(addr, tls, token, chunk, stats.clone()).await {
                    stats.failed.fetch_add(n, Ordering::Relaxed);
                    eprintln!("[bench] watch storm connection failed: {e:#}");
                }
            });
        }
        let storm = Storm { stats, tasks };
        let deadline = Instant::now() + ESTABLISH_TIMEOUT;
        let mut last_note = Instant::now();
        loop {
            let s = &storm.stats;
            let done = s.established.load(Ordering::Relaxed) + s.failed.load(Ordering::Relaxed);
            if done >= paths.len() || Instant::now() > deadline {
                break;
            }
            if last_note.elapsed() > Duration::from_secs(10) {
                println!(
                    "[bench]   watch storm: {}/{} watches established",
                    s.established.load(Ordering::Relaxed),
                    paths.len()
                );
                last_note = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(storm)
    }
}

fn tls_config(ca_pem: &str) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.context("parsing the API server CA")?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// One HTTP/2 connection carrying `paths.len()` watches until the task is aborted.
async fn connection(
    addr: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    token: String,
    paths: Vec<String>,
    stats: Arc<StormStats>,
) -> anyhow::Result<()> {
    let tcp = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(addr),
    )
    .await
    .context("connect timed out")??;
    tcp.set_nodelay(true)?;
    let name = ServerName::IpAddress(addr.ip().into());
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .context("TLS handshake")?;
    if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
        bail!("the API server did not agree to HTTP/2");
    }
    let (send, conn) = h2::client::Builder::new()
        .initial_window_size(1 << 20)
        .initial_connection_window_size(16 << 20)
        .handshake::<_, Bytes>(stream)
        .await
        .context("HTTP/2 handshake")?;
    let mut streams = JoinSet::new();
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    for path in paths {
        let mut send = send.clone().ready().await.context("HTTP/2 stream slot")?;
        let req = http::Request::get(format!("https://{addr}{path}"))
            .header("authorization", format!("Bearer {token}"))
            .header("accept", "application/vnd.kubernetes.protobuf, */*")
            .header(
                "user-agent",
                "kube-proxy/v1.37.2 (splitproxy-bench watch storm)",
            )
            .body(())?;
        let (resp, _) = match send.send_request(req, true) {
            Ok(r) => r,
            Err(e) => {
                stats.failed.fetch_add(1, Ordering::Relaxed);
                eprintln!("[bench] watch request failed: {e}");
                continue;
            }
        };
        let stats = stats.clone();
        streams.spawn(async move {
            let resp = match resp.await {
                Ok(r) if r.status() == http::StatusCode::OK => r,
                Ok(r) => {
                    stats.failed.fetch_add(1, Ordering::Relaxed);
                    eprintln!("[bench] watch answered {}", r.status());
                    return;
                }
                Err(_) => {
                    stats.failed.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            };
            stats.established.fetch_add(1, Ordering::Relaxed);
            let mut body = resp.into_body();
            while let Some(chunk) = body.data().await {
                let Ok(chunk) = chunk else { break };
                let _ = body.flow_control().release_capacity(chunk.len());
                stats.bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
            stats.ended.fetch_add(1, Ordering::Relaxed);
        });
    }
    // Holds the streams until the storm is dropped (which aborts this task and so `streams`).
    while streams.join_next().await.is_some() {}
    driver.abort();
    Ok(())
}
