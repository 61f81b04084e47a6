//! The actuator's Prometheus metrics, under kube-proxy's names where the meaning is the same so
//! that existing dashboards keep working. Kept in a `prometheus_client` registry and rendered
//! in the OpenMetrics text format (see `health.rs`).
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::time::{Duration, SystemTime};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
/// What `Metrics::render` writes: OpenMetrics text, which ends in `# EOF`.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Buckets of kube-proxy's sync and network-programming histograms (seconds).
const SYNC_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096,
    8.192, 16.384,
];
const NPL_BUCKETS: &[f64] = &[
    0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    20.0, 25.0, 30.0, 45.0, 60.0, 120.0, 300.0,
];

/// The kinds of drifted object `drift_repaired` counts, all exposed from the start.
const DRIFT_KINDS: [&str; 5] = ["table", "chain", "set", "element", "undecodable"];

/// One label, `what` or `result`: every series of these families is created up front, so a
/// zero shows (alerts on `increase()` need the series before the first event).
type ByLabel = Family<[(&'static str, &'static str); 1], Counter>;

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    sync: Histogram,
    /// Of the time `sync` counts, the seconds the applying thread ran on a CPU.
    sync_on_cpu: Counter<f64, AtomicU64>,
    npl: Histogram,
    last_sync: Gauge<f64, AtomicU64>,
    applied_generation: Gauge<i64, AtomicI64>,
    apply_errors: Counter,
    snapshots: Counter,
    deltas: Counter,
    connected: Gauge<i64, AtomicI64>,
    elements: Gauge<i64, AtomicI64>,
    conntrack_deleted: Counter,
    conntrack_errors: Counter,
    guarded_deleted: Counter,
    guarded_errors: Counter,
    reconcile_checks: Counter,
    reconcile_reads: Counter,
    reconcile_read_seconds: Gauge<f64, AtomicU64>,
    reconcile_errors: Counter,
    /// Repairs by kind of object that drifted (see `apply::reconcile::Drift::kinds`).
    drift_repairs: ByLabel,
    drift_repair_errors: Counter,
    adopted: Gauge<i64, AtomicI64>,
    brains_known: Gauge<i64, AtomicI64>,
    discovery_lists: ByLabel,
}

impl Default for Metrics {
    fn default() -> Self {
        let m = Metrics {
            registry: Registry::default(),
            sync: Histogram::new(SYNC_BUCKETS.iter().copied()),
            sync_on_cpu: Counter::default(),
            npl: Histogram::new(NPL_BUCKETS.iter().copied()),
            last_sync: Gauge::default(),
            applied_generation: Gauge::default(),
            apply_errors: Counter::default(),
            snapshots: Counter::default(),
            deltas: Counter::default(),
            connected: Gauge::default(),
            elements: Gauge::default(),
            conntrack_deleted: Counter::default(),
            conntrack_errors: Counter::default(),
            guarded_deleted: Counter::default(),
            guarded_errors: Counter::default(),
            reconcile_checks: Counter::default(),
            reconcile_reads: Counter::default(),
            reconcile_read_seconds: Gauge::default(),
            reconcile_errors: Counter::default(),
            drift_repairs: ByLabel::default(),
            drift_repair_errors: Counter::default(),
            adopted: Gauge::default(),
            brains_known: Gauge::default(),
            discovery_lists: ByLabel::default(),
        };
        for what in DRIFT_KINDS {
            let _ = m.drift_repairs.get_or_create(&[("what", what)]);
        }
        for result in ["ok", "error"] {
            let _ = m.discovery_lists.get_or_create(&[("result", result)]);
        }
        m.registered()
    }
}

impl Metrics {
    /// An update committed in `took` (wall), `on_cpu` of it on a CPU.
    pub fn applied(
        &self,
        generation: u64,
        took: Duration,
        on_cpu: Option<Duration>,
        snapshot: bool,
        elements: usize,
    ) {
        self.sync.observe(took.as_secs_f64());
        if let Some(on_cpu) = on_cpu {
            self.sync_on_cpu.inc_by(on_cpu.as_secs_f64());
        }
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        self.last_sync.set(now);
        self.applied_generation.set(generation as i64);
        self.elements.set(elements as i64);
        if snapshot {
            self.snapshots.inc();
        } else {
            self.deltas.inc();
        }
    }

    pub fn apply_failed(&self) {
        self.apply_errors.inc();
    }

    pub fn network_programming(&self, latency: Duration) {
        self.npl.observe(latency.as_secs_f64());
    }

    /// Stale UDP conntrack entries deleted after a commit.
    pub fn conntrack_deleted(&self, n: u64) {
        self.conntrack_deleted.inc_by(n);
    }

    /// A conntrack cleanup that failed, whole or in part.
    pub fn conntrack_cleanup_failed(&self) {
        self.conntrack_errors.inc();
    }

    /// Guarded map entries (session affinity) deleted after a commit removed their guard.
    pub fn guarded_deleted(&self, n: u64) {
        self.guarded_deleted.inc_by(n);
    }

    /// A guarded entries cleanup that failed.
    pub fn guarded_cleanup_failed(&self) {
        self.guarded_errors.inc();
    }

    /// One reconciliation check (a generation read, and a table read if it moved).
    pub fn reconcile_checked(&self) {
        self.reconcile_checks.inc();
    }

    /// The tables were read back from the kernel, taking `took`.
    pub fn reconcile_read(&self, took: Duration) {
        self.reconcile_reads.inc();
        self.reconcile_read_seconds.set(took.as_secs_f64());
    }

    /// A check that could not run (netlink failed).
    pub fn reconcile_failed(&self) {
        self.reconcile_errors.inc();
    }

    /// Drift repaired; `kinds` says what had drifted ("table", "chain", "set", "element",
    /// "undecodable").
    pub fn drift_repaired(&self, kinds: &[&'static str]) {
        for k in kinds {
            self.drift_repairs.get_or_create(&[("what", *k)]).inc();
        }
    }

    /// Drift found whose repair the kernel refused.
    pub fn drift_repair_failed(&self) {
        self.drift_repair_errors.inc();
    }

    /// The tables a previous run left were adopted as the model at start-up.
    pub fn set_adopted(&self, elements: usize) {
        self.adopted.set(1);
        self.elements.set(elements as i64);
    }

    /// How many brains this node knows (`--brain` and those found in the EndpointSlices).
    pub fn set_brains_known(&self, n: usize) {
        self.brains_known.set(n as i64);
    }

    /// One list of the brains' EndpointSlices, which succeeded or not (discovery.rs).
    pub fn discovery_listed(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.discovery_lists
            .get_or_create(&[("result", result)])
            .inc();
    }

    pub fn set_connected(&self, c: bool) {
        self.connected.set(c.into());
    }

    /// The metrics in the OpenMetrics text format (ending in `# EOF`).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail; the encoder's errors are its writer's.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// Registers every metric, in the order they have always been exposed. The help texts
    /// leave out their final period: the registry appends one.
    fn registered(mut self) -> Self {
        let r = &mut self.registry;
        r.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "Time the actuator took to apply one update to the kernel (one nf_tables transaction)",
            self.sync.clone(),
        );
        r.register(
            "splitproxy_actuator_sync_on_cpu_seconds",
            "Of kubeproxy_sync_proxy_rules_duration_seconds, the time the applying thread ran on a CPU; \
             the rest it waited, for a CPU on a busy node or asleep in the kernel",
            self.sync_on_cpu.clone(),
        );
        r.register(
            "kubeproxy_network_programming_duration_seconds",
            "From an endpoint or Service change to its rules being applied on this node",
            self.npl.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "When the last update was applied",
            self.last_sync.clone(),
        );
        r.register(
            "splitproxy_actuator_applied_generation",
            "Generation of the last applied update",
            self.applied_generation.clone(),
        );
        r.register(
            "splitproxy_actuator_apply_errors",
            "Updates the kernel rejected",
            self.apply_errors.clone(),
        );
        r.register(
            "splitproxy_actuator_snapshots_applied",
            "Snapshot updates applied",
            self.snapshots.clone(),
        );
        r.register(
            "splitproxy_actuator_deltas_applied",
            "Delta updates applied",
            self.deltas.clone(),
        );
        r.register(
            "splitproxy_actuator_connected",
            "1 while a brain stream is open",
            self.connected.clone(),
        );
        r.register(
            "splitproxy_actuator_set_elements",
            "Set and map elements in the applied model",
            self.elements.clone(),
        );
        r.register(
            "splitproxy_actuator_conntrack_entries_deleted",
            "Stale UDP conntrack entries deleted after commits (endpoints gone, or destinations that got endpoints)",
            self.conntrack_deleted.clone(),
        );
        r.register(
            "splitproxy_actuator_conntrack_cleanup_errors",
            "Conntrack cleanups that failed in whole or in part; the entries expire by themselves",
            self.conntrack_errors.clone(),
        );
        r.register(
            "splitproxy_actuator_affinity_entries_deleted",
            "Entries the packet path added to a guarded map (session affinity) deleted after a commit removed the set element that vouched for them",
            self.guarded_deleted.clone(),
        );
        r.register(
            "splitproxy_actuator_affinity_cleanup_errors",
            "Cleanups of guarded map entries (session affinity) that failed; the entries time out by themselves",
            self.guarded_errors.clone(),
        );
        r.register(
            "splitproxy_actuator_reconcile_checks",
            "Checks of the kernel's tables against the applied model (a generation read each)",
            self.reconcile_checks.clone(),
        );
        r.register(
            "splitproxy_actuator_reconcile_reads",
            "Checks that read the tables back because someone else committed",
            self.reconcile_reads.clone(),
        );
        r.register(
            "splitproxy_actuator_reconcile_read_duration_seconds",
            "Time the last read of the tables took",
            self.reconcile_read_seconds.clone(),
        );
        r.register(
            "splitproxy_actuator_reconcile_errors",
            "Checks that could not run",
            self.reconcile_errors.clone(),
        );
        r.register(
            "splitproxy_actuator_drift_repair_errors",
            "Drift found whose repair the kernel refused (the next snapshot replaces the tables)",
            self.drift_repair_errors.clone(),
        );
        r.register(
            "splitproxy_actuator_adopted",
            "1 when the tables a previous run left were adopted at start-up",
            self.adopted.clone(),
        );
        r.register(
            "splitproxy_actuator_brains_known",
            "Brains this node knows: --brain addresses and those found in the brain Service's EndpointSlices",
            self.brains_known.clone(),
        );
        r.register(
            "splitproxy_actuator_drift_repairs",
            "Repairs of the kernel's tables, by kind of object that had drifted from the applied model",
            self.drift_repairs.clone(),
        );
        r.register(
            "splitproxy_actuator_discovery_lists",
            "Lists of the brain Service's EndpointSlices, by result (ok, error)",
            self.discovery_lists.clone(),
        );
        self
    }
}
