//! The brain's Prometheus metrics. Counted in atomics where they happen (the call sites read
//! them back in tests), then at every scrape put into a `prometheus_client` registry as
//! constant metrics (labelled counters through a collector), with the histograms and the
//! figures computed at scrape time, and encoded in the OpenMetrics text format (see `http.rs`).
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeMetric,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::objects::InvalidReason;

#[derive(Debug, Default)]
pub struct Metrics {
    /// Objects (or parts of objects) skipped as unusable, by reason (which implies the kind).
    invalid: Mutex<BTreeMap<InvalidReason, u64>>,
    pub recomputes: AtomicU64,
    pub recompute_micros_total: AtomicU64,
    pub updates_sent: AtomicU64,
    pub snapshots_sent: AtomicU64,
    pub update_bytes_sent: AtomicU64,
    pub nacks: AtomicU64,
    pub synced: AtomicU64,
    /// 1 while the last contact with the API server is older than the staleness bound.
    pub stale: AtomicU64,
    pub relists: AtomicU64,
    /// Watches restarted (with fresh connections) after the API server answered again.
    pub watch_restarts: AtomicU64,
    /// Probes of the API server that got no answer in time.
    pub api_probe_failures: AtomicU64,
    pub publications: AtomicU64,
    pub encodes: AtomicU64,
    pub encoded_bytes: AtomicU64,
    /// Distinct update parts compressed (each shared by every node that reads zstd), and the
    /// CPU time that took.
    pub compressed_parts: AtomicU64,
    pub compress_micros_total: AtomicU64,
    /// Sessions started, by how the node was resumed ([`Resumption`]).
    resumptions: [AtomicU64; 4],
    /// Publication to the last connected node's ack.
    fanout: Seconds,
    /// Index change to published desired state.
    compute: Seconds,
    /// A change's trigger time to the publication carrying it.
    publish_latency: Seconds,
    /// The brain seeing a change to the publication carrying it.
    change_queue: Seconds,
    /// Building and encoding one distinct update body.
    encode: Seconds,
    /// The gRPC surface: refusals, failed handshakes, connections, TLS reloads.
    pub surface: crate::listener::SurfaceMetrics,
    /// Bearer tokens: TokenReviews, SubjectAccessReviews, the review cache.
    pub tokens: crate::tokens::TokenMetrics,
    /// With a managed certificate (`crate::pki`): 1 while this replica holds the Lease.
    pub tls_lease_holder: AtomicU64,
    /// With a managed certificate: the served certificate's notAfter (Unix seconds; 0: none).
    pub tls_certificate_not_after: AtomicU64,
    /// With `--pod-certificate-signer`: PodCertificateRequests answered, by outcome.
    pod_certificates: Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

/// Seconds, from 100 µs to about 100 s; finer between 50 ms and 1 s, where network programming
/// latency's targets lie (a quantile read from buckets is only as exact as their bounds).
const BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0,
];

/// What `Metrics::render_with` writes: OpenMetrics text, which ends in `# EOF`.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A histogram of durations in seconds over [`BUCKETS`].
#[derive(Debug, Clone)]
struct Seconds(Histogram);

impl Default for Seconds {
    fn default() -> Self {
        Seconds(Histogram::new(BUCKETS.iter().copied()))
    }
}

fn observe(h: &Seconds, d: Duration) {
    h.0.observe(d.as_secs_f64());
}

/// Labels of one series of a labelled counter.
pub type Labels = Vec<(&'static str, &'static str)>;

/// One scrape's metrics, in a `prometheus_client` registry. Names are given as exposed (a
/// counter's with its `_total`, which the encoder appends itself) and help texts as written
/// (the registry appends a period), so that both can be searched for as they appear.
#[derive(Debug, Default)]
pub struct Exposition {
    registry: Registry,
}

impl Exposition {
    pub fn counter<N>(&mut self, name: &str, help: &str, value: N)
    where
        N: EncodeCounterValue + Debug + Send + Sync + 'static,
    {
        self.registry
            .register(counter_name(name), trim(help), ConstCounter::new(value));
    }

    pub fn gauge<N>(&mut self, name: &str, help: &str, value: N)
    where
        N: EncodeGaugeValue + Debug + Send + Sync + 'static,
    {
        self.registry
            .register(name, trim(help), ConstGauge::new(value));
    }

    /// A counter by label, declared (HELP and TYPE) even with no series yet, as a family
    /// such as `splitproxy_brain_invalid_objects_total` is before its first object: alerts and
    /// the chart's check refer to it. A registry skips empty families, so this is a collector.
    pub fn counters(
        &mut self,
        name: &str,
        help: &str,
        series: impl IntoIterator<Item = (Labels, u64)>,
    ) {
        self.registry.register_collector(Box::new(DeclaredCounter {
            name: counter_name(name).to_string(),
            help: help.to_string(),
            series: series.into_iter().collect(),
        }));
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Seconds) {
        self.registry.register(name, trim(help), h.0.clone());
    }

    /// The OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail; the encoder's errors are its writer's.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// A labelled counter's series, read at scrape time.
#[derive(Debug)]
struct DeclaredCounter {
    name: String,
    help: String,
    series: Vec<(Labels, u64)>,
}

impl Collector for DeclaredCounter {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family =
            encoder.encode_descriptor(&self.name, &self.help, None, MetricType::Counter)?;
        for (labels, n) in &self.series {
            ConstCounter::new(*n).encode(family.encode_family(labels)?)?;
        }
        Ok(())
    }
}

fn counter_name(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

fn trim(help: &str) -> &str {
    help.strip_suffix('.').unwrap_or(help)
}

/// How a node's session started (`splitproxy_brain_resumptions_total{kind}`; see
/// `Fanout::resume_point`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resumption {
    /// From the state this brain knows the node acked, under its own epoch.
    SameEpoch,
    /// From a recent publication whose content the node's digest proves it holds.
    ByContent,
    /// From the window of recent publications the API state the node presents lies in, by a
    /// restating delta (crate::restate): another replica's state this brain never published.
    Restated,
    /// Nothing known: a snapshot.
    Snapshot,
}

impl Resumption {
    pub const ALL: [Resumption; 4] = [
        Resumption::SameEpoch,
        Resumption::ByContent,
        Resumption::Restated,
        Resumption::Snapshot,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Resumption::SameEpoch => "same_epoch",
            Resumption::ByContent => "by_content",
            Resumption::Restated => "restated",
            Resumption::Snapshot => "snapshot",
        }
    }
}

impl Metrics {
    /// Counts a session started as `kind`.
    pub fn resumed(&self, kind: Resumption) {
        self.resumptions[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Sessions started as `kind` so far.
    pub fn resumptions(&self, kind: Resumption) -> u64 {
        self.resumptions[kind as usize].load(Ordering::Relaxed)
    }

    /// Counts an object, or a part of one, skipped for `reason`.
    pub fn invalid(&self, reason: InvalidReason) {
        if let Ok(mut m) = self.invalid.lock() {
            *m.entry(reason).or_default() += 1;
        }
    }

    pub fn observe_fanout(&self, d: Duration) {
        observe(&self.fanout, d)
    }

    /// One change's wait from its trigger time to the publication that carries it: the part
    /// of network programming latency spent before any node is sent anything (the API server's
    /// write and watch, the pacing of publications, the recompute).
    pub fn observe_publish_latency(&self, d: Duration) {
        observe(&self.publish_latency, d)
    }

    /// One change's wait from its watch event to the publication that carries it: the brain's
    /// own share of [`Metrics::observe_publish_latency`] (the pacing and the recompute).
    pub fn observe_change_queue(&self, d: Duration) {
        observe(&self.change_queue, d)
    }

    pub fn observe_compute(&self, d: Duration) {
        self.recomputes.fetch_add(1, Ordering::Relaxed);
        self.recompute_micros_total
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
        observe(&self.compute, d)
    }

    pub fn observe_encode(&self, d: Duration, bytes: usize) {
        self.encodes.fetch_add(1, Ordering::Relaxed);
        self.encoded_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        observe(&self.encode, d)
    }

    pub fn invalid_total(&self) -> u64 {
        self.invalid.lock().map(|m| m.values().sum()).unwrap_or(0)
    }

    /// Renders every metric; `live` holds the figures computed at scrape time.
    pub fn render_with(&self, connected_nodes: usize, live: &Live) -> String {
        let mut out = self.exposition(connected_nodes);
        out.gauge(
            "splitproxy_brain_node_lag_seconds",
            "The longest time a connected node has been behind the latest published desired state (0 when every node holds it).",
            live.max_node_lag.as_secs_f64(),
        );
        out.gauge(
            "splitproxy_brain_nodes_lagging",
            "Connected nodes behind the latest published desired state for more than 5 s.",
            live.nodes_lagging as i64,
        );
        out.gauge(
            "splitproxy_brain_api_contact_age_seconds",
            "Time since the last confirmed contact with the API server (a watch event or a probe's answer).",
            live.api_contact_age.as_secs_f64(),
        );
        out.encode()
    }

    /// Every metric but those computed at scrape time, in the OpenMetrics text format.
    pub fn render(&self, connected_nodes: usize) -> String {
        self.exposition(connected_nodes).encode()
    }

    fn exposition(&self, connected_nodes: usize) -> Exposition {
        let mut out = Exposition::default();
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let invalid: Vec<(Labels, u64)> = self
            .invalid
            .lock()
            .map(|m| {
                m.iter()
                    .map(|(reason, n)| {
                        let labels = vec![
                            ("kind", reason.kind().as_str()),
                            ("reason", reason.as_str()),
                        ];
                        (labels, *n)
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.counters(
            "splitproxy_brain_invalid_objects_total",
            "Kubernetes objects or parts of them skipped as unusable.",
            invalid,
        );
        fn one(out: &mut Exposition, name: &str, kind: &str, help: &str, value: u64) {
            if kind == "counter" {
                out.counter(name, help, value)
            } else {
                out.gauge(name, help, value as i64)
            }
        }
        let c = g;
        one(
            &mut out,
            "splitproxy_brain_synced",
            "gauge",
            "1 once every initial list is complete and no relist is pending.",
            c(&self.synced),
        );
        one(
            &mut out,
            "splitproxy_brain_stale",
            "gauge",
            "1 while the last contact with the API server is older than --api-staleness-bound-ms: the brain is not ready and serves no node.",
            c(&self.stale),
        );
        one(
            &mut out,
            "splitproxy_brain_tls_lease_holder",
            "gauge",
            "1 while this replica holds the Lease of its managed certificate (--tls-secret) and so writes the Secret and the CA ConfigMap.",
            c(&self.tls_lease_holder),
        );
        one(
            &mut out,
            "splitproxy_brain_tls_certificate_expiry_timestamp_seconds",
            "gauge",
            "With --tls-secret: when the served certificate expires (Unix seconds; 0 before there is one). Renewed after two thirds of its life.",
            c(&self.tls_certificate_not_after),
        );
        one(
            &mut out,
            "splitproxy_brain_watch_restarts_total",
            "counter",
            "Times every watch was restarted on new connections, after the API server answered again following failed probes.",
            c(&self.watch_restarts),
        );
        one(
            &mut out,
            "splitproxy_brain_api_probe_failures_total",
            "counter",
            "Probes of the API server (GET /version) that got no answer in time.",
            c(&self.api_probe_failures),
        );
        one(
            &mut out,
            "splitproxy_brain_relists_total",
            "counter",
            "Watch failures that led to a retry or relist.",
            c(&self.relists),
        );
        one(
            &mut out,
            "splitproxy_brain_recomputes_total",
            "counter",
            "Desired-state computations.",
            c(&self.recomputes),
        );
        let secs = g(&self.recompute_micros_total) as f64 / 1e6;
        out.counter(
            "splitproxy_brain_recompute_seconds_total",
            "Time spent computing desired state.",
            secs,
        );
        one(
            &mut out,
            "splitproxy_brain_publications_total",
            "counter",
            "Desired states published (changes that reached the streams).",
            c(&self.publications),
        );
        one(
            &mut out,
            "splitproxy_brain_updates_sent_total",
            "counter",
            "Updates streamed to nodes.",
            c(&self.updates_sent),
        );
        one(
            &mut out,
            "splitproxy_brain_snapshots_sent_total",
            "counter",
            "Snapshot updates streamed to nodes.",
            c(&self.snapshots_sent),
        );
        one(
            &mut out,
            "splitproxy_brain_update_bytes_sent_total",
            "counter",
            "Bytes of updates streamed to nodes.",
            c(&self.update_bytes_sent),
        );
        one(
            &mut out,
            "splitproxy_brain_encodes_total",
            "counter",
            "Distinct update bodies encoded (each shared by every node that needs it).",
            c(&self.encodes),
        );
        one(
            &mut out,
            "splitproxy_brain_encoded_bytes_total",
            "counter",
            "Bytes of distinct update bodies encoded.",
            c(&self.encoded_bytes),
        );
        one(
            &mut out,
            "splitproxy_brain_compressed_parts_total",
            "counter",
            "Distinct update parts compressed with zstd (once for every node that reads it).",
            c(&self.compressed_parts),
        );
        out.counter(
            "splitproxy_brain_compress_seconds_total",
            "Time spent compressing distinct update parts.",
            self.compress_micros_total.load(Ordering::Relaxed) as f64 / 1e6,
        );
        one(
            &mut out,
            "splitproxy_brain_nacks_total",
            "counter",
            "Updates a node failed to apply.",
            c(&self.nacks),
        );
        one(
            &mut out,
            "splitproxy_brain_connected_nodes",
            "gauge",
            "Nodes with an open stream.",
            connected_nodes as u64,
        );
        out.counters(
            "splitproxy_brain_resumptions_total",
            "Node sessions started, by how the node was resumed: same_epoch (from what it acked here), by_content (from a recent publication its digest matches: failover, brain restart), snapshot.",
            Resumption::ALL.map(|kind| (vec![("kind", kind.as_str())], self.resumptions(kind))),
        );
        let pod_certificates: Vec<(Labels, u64)> = self
            .pod_certificates
            .lock()
            .map(|counts| {
                counts
                    .iter()
                    .map(|(outcome, n)| (vec![("outcome", *outcome)], *n))
                    .collect()
            })
            .unwrap_or_default();
        out.counters(
            "splitproxy_brain_pod_certificates_total",
            "PodCertificateRequests of --pod-certificate-signer answered, by outcome: issued, denied, conflict (another replica answered), no_ca, error.",
            pod_certificates,
        );
        out.histogram(
            "splitproxy_brain_fanout_duration_seconds",
            "From publishing a desired state to the last node connected at that time acking it.",
            &self.fanout,
        );
        out.histogram(
            "splitproxy_brain_compute_duration_seconds",
            "From a batch of watch events to the published desired state.",
            &self.compute,
        );
        out.histogram(
            "splitproxy_brain_publish_latency_seconds",
            "From each change's trigger time (an EndpointSlice's endpoints.kubernetes.io/last-change-trigger-time, else when the brain saw the change) to the publication carrying it; with fanout_duration, the brain's share of network programming latency.",
            &self.publish_latency,
        );
        out.histogram(
            "splitproxy_brain_change_queue_seconds",
            "From the brain seeing each change (its watch event) to the publication carrying it: the pacing of publications and the recompute, the brain's part of publish_latency.",
            &self.change_queue,
        );
        out.histogram(
            "splitproxy_brain_encode_duration_seconds",
            "Computing and encoding one distinct update body.",
            &self.encode,
        );
        self.surface.expose(&mut out);
        self.tokens.expose(&mut out);
        out
    }
}

/// Figures computed when metrics are scraped.
#[derive(Debug, Default, Clone, Copy)]
pub struct Live {
    pub max_node_lag: Duration,
    pub nodes_lagging: usize,
    pub api_contact_age: Duration,
}

impl crate::podcert::Outcomes for Metrics {
    fn pod_certificate(&self, outcome: &'static str) {
        if let Ok(mut counts) = self.pod_certificates.lock() {
            *counts.entry(outcome).or_default() += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Alerts name these families before they have a series.
    #[test]
    fn empty_labelled_counters_are_declared() {
        let text = Metrics::default().render(0);
        for family in [
            "splitproxy_brain_invalid_objects",
            "splitproxy_brain_pod_certificates",
        ] {
            assert!(
                text.lines()
                    .any(|l| l == format!("# TYPE {family} counter")),
                "{family} not declared:\n{text}"
            );
            assert!(!text.contains(&format!("{family}_total{{")), "{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn invalid_objects_render_by_kind_and_reason() {
        let m = Metrics::default();
        m.invalid(InvalidReason::ClusterIpUnparsable);
        m.invalid(InvalidReason::ClusterIpUnparsable);
        m.invalid(InvalidReason::NoMatchingServicePort);
        assert_eq!(m.invalid_total(), 3);
        let text = m.render(0);
        // The encoder keeps no order among a family's series: compare them as a set.
        let lines: std::collections::BTreeSet<&str> = text
            .lines()
            .filter(|l| l.starts_with("splitproxy_brain_invalid_objects_total{"))
            .collect();
        assert_eq!(
            lines,
            std::collections::BTreeSet::from([
                "splitproxy_brain_invalid_objects_total{kind=\"EndpointSlice\",reason=\"no_matching_service_port\"} 1",
                "splitproxy_brain_invalid_objects_total{kind=\"Service\",reason=\"cluster_ip_unparsable\"} 2",
            ])
        );
    }
}
