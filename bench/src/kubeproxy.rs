//! kube-proxy v1.37.2 in nftables mode, side by side with splitproxy on the same workload.
//!
//! It runs in its own node namespace (a harness Cluster node whose Node object is part of the
//! workload), so its nftables table, sysctls and conntrack settings stay inside that namespace. It
//! reaches the API server through a port forwarded into the namespace, with a kubeconfig for that
//! address. Flags keep it off anything global: conntrack limits and timeouts are left as they are
//! (`0`), its OOM score is left alone, and it serves metrics and health on the namespace's
//! loopback only.
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use splitproxy_tests::deploy::http_get_in;
use splitproxy_tests::process::Child;
use splitproxy_tests::{ControlPlane, Forwarder, Netns, forward_port};

use crate::measure::prom::{Histogram, Scrape};
use crate::workload::POD_CIDR;

/// Where kube-proxy serves /metrics inside its namespace.
pub const METRICS: &str = "127.0.0.1:10249";
const HEALTHZ: &str = "127.0.0.1:10256";
/// The API server as seen from inside the namespace.
const API_IN_NODE: &str = "127.0.0.1:6443";

pub const SYNC: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
pub const FULL_SYNC: &str = "kubeproxy_sync_full_proxy_rules_duration_seconds";
pub const PARTIAL_SYNC: &str = "kubeproxy_sync_partial_proxy_rules_duration_seconds";
pub const NPL: &str = "kubeproxy_network_programming_duration_seconds";
pub const LAST_SYNC: &str = "kubeproxy_sync_proxy_rules_last_timestamp_seconds";

pub struct KubeProxy {
    pub child: Child,
    _api: Forwarder,
    pub node: String,
    pub started: Instant,
    pub started_wall: SystemTime,
}

impl KubeProxy {
    /// Starts kube-proxy for `node` inside `ns`.
    pub fn start(cp: &ControlPlane, ns: &Netns, node: &str, dir: &Path) -> anyhow::Result<Self> {
        let bin = splitproxy_tests::tools::binary("kube-proxy")?;
        let local: SocketAddr = API_IN_NODE.parse()?;
        let api = forward_port(ns, local, cp.addr()).context("forwarding the API server")?;
        let kubeconfig = cp.kubeconfig_for_server(&format!("https://{API_IN_NODE}"))?;
        // One IP family: the workload is IPv4, and an idle IPv6 proxier would add its own
        // (empty) syncs to the histograms.
        let _ = ns.sysctl("net.ipv6.conf.all.disable_ipv6", "1");
        let mut cmd = Command::new(bin);
        cmd.arg("--proxy-mode=nftables")
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--hostname-override={node}"))
            .arg(format!("--cluster-cidr={POD_CIDR}"))
            .arg(format!("--metrics-bind-address={METRICS}"))
            .arg(format!("--healthz-bind-address={HEALTHZ}"))
            .arg("--conntrack-max-per-core=0")
            .arg("--conntrack-min=0")
            .arg("--conntrack-tcp-timeout-established=0")
            .arg("--conntrack-tcp-timeout-close-wait=0")
            .arg("--conntrack-udp-timeout=0")
            .arg("--conntrack-udp-timeout-stream=0")
            .arg("--oom-score-adj=0")
            .arg("--v=1");
        let log = dir.join("kube-proxy.log");
        let started = Instant::now();
        let started_wall = SystemTime::now();
        let child = ns.spawn("kube-proxy", cmd, &log)?;
        Ok(KubeProxy {
            child,
            _api: api,
            node: node.to_string(),
            started,
            started_wall,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Its /metrics, read inside its namespace.
    pub fn scrape(&self, ns: &Netns) -> anyhow::Result<Scrape> {
        let (code, body) = http_get_in(ns, METRICS.parse()?, "/metrics")?;
        anyhow::ensure!(code == 200, "kube-proxy /metrics answered {code}");
        Ok(Scrape::parse(&body))
    }

    /// Waits (bounded) for its first full sync; returns how long it took from the start, or
    /// `None` on time-out. Fails when kube-proxy exits.
    pub async fn wait_first_sync(
        &mut self,
        ns: &Netns,
        timeout: Duration,
    ) -> anyhow::Result<Option<Duration>> {
        let deadline = Instant::now() + timeout;
        let mut last_note = Instant::now();
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!(
                    "kube-proxy exited with {status}:\n{}",
                    self.child.log_tail(30)
                );
            }
            if let Ok(s) = self.scrape(ns)
                && s.max_where(LAST_SYNC, ipv4).unwrap_or(0.0) > 0.0
            {
                return Ok(Some(self.started.elapsed()));
            }
            if last_note.elapsed() > Duration::from_secs(30) {
                println!(
                    "[bench] still waiting for kube-proxy's first sync ({:.0} s)",
                    self.started.elapsed().as_secs_f64()
                );
                last_note = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Ok(None)
    }
}

/// Only the IPv4 series (kube-proxy labels some metrics by IP family).
fn ipv4(labels: &[(String, String)]) -> bool {
    labels
        .iter()
        .all(|(k, v)| k != "ip_family" || v == "IPv4" || v == "4")
}

/// kube-proxy's figures of one scrape.
#[derive(Debug, Clone, Default)]
pub struct KpScrape {
    pub sync: Option<Histogram>,
    pub full_sync: Option<Histogram>,
    pub partial_sync: Option<Histogram>,
    pub npl: Option<Histogram>,
    pub last_sync: Option<f64>,
}

impl KpScrape {
    pub fn from(s: &Scrape) -> KpScrape {
        let h = |name: &str| s.histogram_where(name, ipv4);
        KpScrape {
            sync: h(SYNC),
            full_sync: h(FULL_SYNC),
            partial_sync: h(PARTIAL_SYNC),
            npl: h(NPL),
            last_sync: s.max_where(LAST_SYNC, ipv4),
        }
    }
}
