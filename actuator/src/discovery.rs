//! Which brains there are: the `--brain` addresses, and the ready addresses of the brains'
//! headless Service, read from its EndpointSlices (`--brain-service`).
//!
//! Why EndpointSlices and not the Service: a ClusterIP or the Service's DNS name works only once
//! a Service proxy does, and splitproxy is the Service proxy. The addresses in the slices are
//! the brain pods' own (host network), reachable without one.
//!
//! Why a list and not a watch: one watch per node is the watch storm splitproxy exists to remove
//! (README). The actuator lists at start and again only when every brain it knows has failed in
//! a row (client.rs), no more often than [`LIST_MIN_INTERVAL`] doubling to
//! [`LIST_MAX_INTERVAL`] while no stream becomes healthy. A list that fails or finds no ready
//! brain keeps the set it had: brains that answered once may answer again, and an actuator with
//! no address to try can do nothing better.
use std::collections::BTreeSet;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::health::Health;

/// Longest a list may take: past it, the actuator goes on with the brains it knows.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(10);
/// Least time between two lists, after a stream was healthy.
pub const LIST_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// Most time between two lists while every brain keeps failing: thousands of nodes whose brains
/// are all down (an outage) must not turn into a list storm on the API server.
pub const LIST_MAX_INTERVAL: Duration = Duration::from_secs(30);

/// The label the EndpointSlice controller puts on a Service's slices.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// `--brain-service`: the brains' headless Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrainService {
    pub namespace: String,
    pub name: String,
}

impl std::str::FromStr for BrainService {
    type Err = String;

    /// `NAMESPACE/NAME`, both Kubernetes names (lowercase letters, digits, `-`).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            || format!("{s:?} is not NAMESPACE/NAME (for example kube-system/splitproxy-brain)");
        let (namespace, name) = s.split_once('/').ok_or_else(bad)?;
        let is_name = |n: &str| {
            !n.is_empty()
                && n.len() <= 63
                && n.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !n.starts_with('-')
                && !n.ends_with('-')
        };
        if !is_name(namespace) || !is_name(name) {
            return Err(bad());
        }
        Ok(BrainService {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl std::fmt::Display for BrainService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// How to find the brains through the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryConfig {
    pub service: BrainService,
    /// The name of the gRPC port in the slices (`--brain-port-name`; empty: the unnamed port).
    pub port_name: String,
    /// `--kubeconfig`; in-cluster configuration (the pod's ServiceAccount) when `None`.
    pub kubeconfig: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("API client configuration: {0}")]
    Config(String),
    #[error("listing the EndpointSlices of {service}: {source}")]
    List {
        service: String,
        source: kube::Error,
    },
    #[error("listing the EndpointSlices of {0} took more than {LIST_TIMEOUT:?}")]
    Timeout(String),
}

/// The brain addresses in `slices`: `https://IP:PORT` for every address of an endpoint that is
/// not known to be unready (`conditions.ready` absent counts as ready, as the API says), with
/// the TCP port named `port_name` of its slice. Slices without that port, of type FQDN, and
/// addresses that are not IPs are skipped: a name would need DNS. Sorted, each once.
pub fn brains_from_slices(slices: &[EndpointSlice], port_name: &str) -> Vec<Uri> {
    let mut found = BTreeSet::new();
    for slice in slices {
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            continue;
        }
        let port = slice
            .ports
            .iter()
            .flatten()
            .filter(|p| p.name.as_deref().unwrap_or("") == port_name)
            .filter(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
            .find_map(|p| p.port.and_then(|n| u16::try_from(n).ok()))
            .filter(|n| *n != 0);
        let Some(port) = port else { continue };
        for endpoint in slice.endpoints.iter().flatten() {
            if endpoint.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            for address in &endpoint.addresses {
                if let Ok(ip) = address.parse::<IpAddr>() {
                    found.insert(SocketAddr::new(ip, port));
                }
            }
        }
    }
    found
        .into_iter()
        .filter_map(|a| format!("https://{a}").parse().ok())
        .collect()
}

/// What lists the slices: the API server ([`EndpointSlices`]), or a fake in tests.
pub trait SliceSource: Send + Sync {
    fn list(
        &self,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<EndpointSlice>, DiscoveryError>> + Send + '_>>;
}

/// The brain Service's EndpointSlices on the API server.
pub struct EndpointSlices {
    api: kube::Api<EndpointSlice>,
    service: BrainService,
}

impl EndpointSlices {
    /// A client for `config`'s API server (`--kubeconfig`, or in-cluster). Fails at start when
    /// there is none, rather than at the first list.
    pub async fn connect(config: &DiscoveryConfig) -> Result<Self, DiscoveryError> {
        let kube_config = match &config.kubeconfig {
            Some(path) => {
                let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| {
                    DiscoveryError::Config(format!("reading {}: {e}", path.display()))
                })?;
                kube::Config::from_custom_kubeconfig(kc, &Default::default())
                    .await
                    .map_err(|e| DiscoveryError::Config(format!("{}: {e}", path.display())))?
            }
            None => kube::Config::incluster().map_err(|e| {
                DiscoveryError::Config(format!(
                    "in-cluster configuration (pass --kubeconfig outside a cluster): {e}"
                ))
            })?,
        };
        let client = kube::Client::try_from(kube_config)
            .map_err(|e| DiscoveryError::Config(e.to_string()))?;
        Ok(EndpointSlices {
            api: kube::Api::namespaced(client, &config.service.namespace),
            service: config.service.clone(),
        })
    }
}

impl SliceSource for EndpointSlices {
    fn list(
        &self,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<EndpointSlice>, DiscoveryError>> + Send + '_>> {
        Box::pin(async move {
            let params = kube::api::ListParams::default()
                .labels(&format!("{SERVICE_NAME_LABEL}={}", self.service.name));
            match tokio::time::timeout(LIST_TIMEOUT, self.api.list(&params)).await {
                Ok(Ok(list)) => Ok(list.items),
                Ok(Err(source)) => Err(DiscoveryError::List {
                    service: self.service.to_string(),
                    source,
                }),
                Err(_) => Err(DiscoveryError::Timeout(self.service.to_string())),
            }
        })
    }
}

/// How long after a list the next one may run: the interval, with jitter (half of it to all of
/// it, so that nodes that failed together do not list together), doubling from
/// [`LIST_MIN_INTERVAL`] to [`LIST_MAX_INTERVAL`] with each list, until a stream is healthy.
#[derive(Debug, Clone)]
struct ListPacing {
    interval: Duration,
}

impl Default for ListPacing {
    fn default() -> Self {
        ListPacing {
            interval: LIST_MIN_INTERVAL,
        }
    }
}

impl ListPacing {
    /// The wait after a list; `random` is uniform in [0, 1).
    fn after_list(&mut self, random: f64) -> Duration {
        let wait = self.interval.mul_f64(0.5 + random.clamp(0.0, 1.0) / 2.0);
        self.interval = (self.interval * 2).min(LIST_MAX_INTERVAL);
        wait
    }
}

/// The brains this node knows: the static addresses and the last ones discovered.
pub struct Brains {
    statics: Vec<Uri>,
    source: Option<(Box<dyn SliceSource>, String)>,
    discovered: Vec<Uri>,
    /// Lists that failed since the last one that succeeded (logged at the first only).
    failed_lists: u32,
    /// No list before this.
    next_list: Option<tokio::time::Instant>,
    pacing: ListPacing,
    health: Arc<Health>,
}

impl Brains {
    /// `statics`: `--brain`; `source`: where the slices come from, and the port's name.
    pub fn new(
        statics: Vec<Uri>,
        source: Option<(Box<dyn SliceSource>, String)>,
        health: Arc<Health>,
    ) -> Self {
        let brains = Brains {
            statics,
            source,
            discovered: Vec::new(),
            failed_lists: 0,
            next_list: None,
            pacing: ListPacing::default(),
            health,
        };
        brains.health.metrics.set_brains_known(brains.all().len());
        brains
    }

    /// Whether the set can change (brains are discovered).
    pub fn discovers(&self) -> bool {
        self.source.is_some()
    }

    /// Every known brain, each once.
    pub fn all(&self) -> Vec<Uri> {
        let mut seen = BTreeSet::new();
        self.statics
            .iter()
            .chain(&self.discovered)
            .filter(|u| seen.insert(u.to_string()))
            .cloned()
            .collect()
    }

    /// Whether a list may run now (see [`LIST_MIN_INTERVAL`]).
    pub fn list_due(&self) -> bool {
        self.source.is_some()
            && self
                .next_list
                .is_none_or(|at| tokio::time::Instant::now() >= at)
    }

    /// A stream to a brain became healthy: the next failure burst may list again soon.
    pub fn stream_healthy(&mut self) {
        self.pacing = ListPacing::default();
    }

    /// Lists the slices once (bounded by [`LIST_TIMEOUT`]) and takes the ready brains found, or
    /// keeps the set on an error or an empty answer. Returns whether the set changed.
    pub async fn refresh(&mut self) -> bool {
        let Some((source, port_name)) = &self.source else {
            return false;
        };
        let wait = self.pacing.after_list(rand::random_range(0.0..1.0));
        self.next_list = Some(tokio::time::Instant::now() + wait);
        let found = match source.list().await {
            Ok(slices) => {
                self.health.metrics.discovery_listed(true);
                if self.failed_lists > 0 {
                    tracing::info!(
                        failed = self.failed_lists,
                        "listed the brains' EndpointSlices again after failures"
                    );
                }
                self.failed_lists = 0;
                brains_from_slices(&slices, port_name)
            }
            Err(e) => {
                self.health.metrics.discovery_listed(false);
                if self.failed_lists == 0 {
                    tracing::warn!(error = %e, known = self.discovered.len(), "finding the brains failed; keeping the brains known (logged once until a list succeeds)");
                } else {
                    tracing::debug!(error = %e, failed = self.failed_lists + 1, "finding the brains failed again");
                }
                self.failed_lists = self.failed_lists.saturating_add(1);
                return false;
            }
        };
        if found.is_empty() {
            tracing::warn!(
                known = self.discovered.len(),
                "no ready brain in the EndpointSlices; keeping the brains known"
            );
            return false;
        }
        if found == self.discovered {
            return false;
        }
        tracing::info!(
            brains = ?found.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "brains found in the EndpointSlices"
        );
        self.discovered = found;
        self.health.metrics.set_brains_known(self.all().len());
        true
    }

    /// Lists until some brain is known (at once when `--brain` gave some), waiting between lists
    /// as [`Brains::refresh`] allows.
    pub async fn until_known(&mut self) {
        if self.source.is_some() {
            self.refresh().await;
        }
        while self.all().is_empty() {
            if let Some(at) = self.next_list {
                tokio::time::sleep_until(at).await;
            }
            self.refresh().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};
    use std::sync::Mutex;

    fn endpoint(addresses: &[&str], ready: Option<bool>, serving: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: addresses.iter().map(|a| a.to_string()).collect(),
            conditions: Some(EndpointConditions {
                ready,
                serving,
                terminating: None,
            }),
            ..Endpoint::default()
        }
    }

    fn slice(
        family: &str,
        ports: &[(Option<&str>, i32)],
        endpoints: Vec<Endpoint>,
    ) -> EndpointSlice {
        EndpointSlice {
            address_type: family.to_owned(),
            endpoints: Some(endpoints),
            ports: Some(
                ports
                    .iter()
                    .map(|(name, port)| EndpointPort {
                        name: name.map(str::to_owned),
                        port: Some(*port),
                        protocol: Some("TCP".to_owned()),
                        ..EndpointPort::default()
                    })
                    .collect(),
            ),
            ..EndpointSlice::default()
        }
    }

    fn strings(uris: &[Uri]) -> Vec<String> {
        uris.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn ready_addresses_with_the_named_port_become_brains() {
        let slices = [
            slice(
                "IPv4",
                &[(Some("metrics"), 9090), (Some("grpc"), 9443)],
                vec![
                    endpoint(&["10.0.0.2"], Some(true), Some(true)),
                    // No conditions known: ready, as the API defines it.
                    endpoint(&["10.0.0.1"], None, None),
                    // Terminating but still serving: not ready, not a brain to go to.
                    endpoint(&["10.0.0.3"], Some(false), Some(true)),
                    endpoint(&["10.0.0.4"], Some(false), Some(false)),
                    // Twice in two slices (a slice being replaced): once.
                    endpoint(&["10.0.0.2", "not-an-ip"], Some(true), None),
                ],
            ),
            slice(
                "IPv6",
                &[(Some("grpc"), 9443)],
                vec![endpoint(&["fd00::7"], Some(true), None)],
            ),
            // Without the port: skipped.
            slice(
                "IPv4",
                &[(Some("metrics"), 9090)],
                vec![endpoint(&["10.0.0.9"], Some(true), None)],
            ),
            // Names would need DNS.
            slice(
                "FQDN",
                &[(Some("grpc"), 9443)],
                vec![endpoint(&["brain.example"], Some(true), None)],
            ),
        ];
        assert_eq!(
            strings(&brains_from_slices(&slices, "grpc")),
            [
                "https://10.0.0.1:9443/",
                "https://10.0.0.2:9443/",
                "https://[fd00::7]:9443/"
            ]
        );
        assert!(brains_from_slices(&slices, "health").is_empty());
        // The IPv6 URI keeps its brackets where a connection needs them.
        let v6 = &brains_from_slices(&slices[1..2], "grpc")[0];
        assert_eq!((v6.host(), v6.port_u16()), (Some("[fd00::7]"), Some(9443)));
    }

    #[test]
    fn an_empty_port_name_is_the_unnamed_port_and_bad_ports_are_skipped() {
        let slices = [
            slice(
                "IPv4",
                &[(None, 9443)],
                vec![endpoint(&["10.0.0.1"], None, None)],
            ),
            slice(
                "IPv4",
                &[(Some(""), 0)],
                vec![endpoint(&["10.0.0.2"], None, None)],
            ),
            slice(
                "IPv4",
                &[(None, 70_000)],
                vec![endpoint(&["10.0.0.3"], None, None)],
            ),
        ];
        assert_eq!(
            strings(&brains_from_slices(&slices, "")),
            ["https://10.0.0.1:9443/"]
        );
        let mut udp = slices[0].clone();
        udp.ports.as_mut().unwrap()[0].protocol = Some("UDP".into());
        assert!(brains_from_slices(&[udp], "").is_empty());
    }

    #[test]
    fn brain_service_is_namespace_slash_name() {
        let s: BrainService = "kube-system/splitproxy-brain".parse().unwrap();
        assert_eq!(
            (s.namespace.as_str(), s.name.as_str()),
            ("kube-system", "splitproxy-brain")
        );
        assert_eq!(s.to_string(), "kube-system/splitproxy-brain");
        for bad in [
            "splitproxy-brain",
            "/x",
            "x/",
            "a/b/c",
            "Kube/x",
            "a/-b",
            "",
        ] {
            assert!(bad.parse::<BrainService>().is_err(), "{bad}");
        }
    }

    /// Answers given in advance, in order.
    struct Fake(Mutex<Vec<Result<Vec<EndpointSlice>, DiscoveryError>>>);

    impl SliceSource for Fake {
        fn list(
            &self,
        ) -> Pin<Box<dyn Future<Output = Result<Vec<EndpointSlice>, DiscoveryError>> + Send + '_>>
        {
            let next = self.0.lock().unwrap().remove(0);
            Box::pin(async move { next })
        }
    }

    fn ready(addresses: &[&str]) -> Result<Vec<EndpointSlice>, DiscoveryError> {
        Ok(vec![slice(
            "IPv4",
            &[(Some("grpc"), 9443)],
            addresses
                .iter()
                .map(|a| endpoint(&[a], Some(true), None))
                .collect(),
        )])
    }

    fn metric(health: &Health, line: &str) -> bool {
        health.metrics.render().lines().any(|l| l == line)
    }

    /// A list replaces the discovered set; a failed or empty one keeps it; static addresses
    /// stay; each list is counted and the set's size shown.
    #[tokio::test]
    async fn a_failed_or_empty_list_keeps_the_brains_known() {
        let health = Arc::new(Health::default());
        let fake = Fake(Mutex::new(vec![
            ready(&["10.0.0.1", "10.0.0.2"]),
            Err(DiscoveryError::Timeout("ns/b".into())),
            ready(&[]),
            ready(&["10.0.0.2", "10.0.0.3"]),
            ready(&["10.0.0.3", "10.0.0.2"]),
        ]));
        let statics = vec!["https://10.0.0.1:9443".parse().unwrap()];
        let mut brains = Brains::new(
            statics,
            Some((Box::new(fake), "grpc".into())),
            health.clone(),
        );
        assert!(metric(&health, "splitproxy_actuator_brains_known 1"));
        assert!(brains.list_due());
        brains.until_known().await;
        // The static address and the same discovered one are one brain.
        assert_eq!(
            strings(&brains.all()),
            ["https://10.0.0.1:9443/", "https://10.0.0.2:9443/"]
        );
        assert!(!brains.list_due(), "not again at once");
        assert!(!brains.refresh().await, "an error keeps the set");
        assert!(!brains.refresh().await, "no ready brain keeps the set");
        assert_eq!(brains.all().len(), 2);
        assert!(brains.refresh().await, "a new set");
        assert_eq!(
            strings(&brains.all()),
            [
                "https://10.0.0.1:9443/",
                "https://10.0.0.2:9443/",
                "https://10.0.0.3:9443/"
            ]
        );
        assert!(
            !brains.refresh().await,
            "the same set in another order is no change"
        );
        assert!(metric(&health, "splitproxy_actuator_brains_known 3"));
        assert!(metric(
            &health,
            "splitproxy_actuator_discovery_lists_total{result=\"ok\"} 4"
        ));
        assert!(metric(
            &health,
            "splitproxy_actuator_discovery_lists_total{result=\"error\"} 1"
        ));
    }

    /// Lists are spaced: half the interval to all of it, doubling while no stream is healthy,
    /// capped.
    #[test]
    fn lists_back_off_until_a_stream_is_healthy() {
        let mut p = ListPacing::default();
        assert_eq!(p.after_list(0.0), LIST_MIN_INTERVAL / 2);
        assert_eq!(p.after_list(1.0), LIST_MIN_INTERVAL * 2);
        assert_eq!(p.after_list(0.5), LIST_MIN_INTERVAL * 3);
        for _ in 0..10 {
            p.after_list(0.5);
        }
        assert_eq!(p.after_list(1.0), LIST_MAX_INTERVAL);
        assert_eq!(ListPacing::default().after_list(1.0), LIST_MIN_INTERVAL);
    }
}
