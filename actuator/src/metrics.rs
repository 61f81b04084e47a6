//! The actuator's Prometheus metrics, under kube-proxy's names where the meaning is the same so
//! that existing dashboards keep working.
use std::fmt::Write;

use splitproxy_proto::prom::Histogram;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// Buckets of kube-proxy's sync and network-programming histograms (seconds).
const SYNC_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096,
    8.192, 16.384,
];
const NPL_BUCKETS: &[f64] = &[
    0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    20.0, 25.0, 30.0, 45.0, 60.0, 120.0, 300.0,
];

#[derive(Debug, Clone)]
struct Inner {
    sync: Histogram,
    npl: Histogram,
    last_sync: Option<SystemTime>,
    applied_generation: u64,
    apply_errors: u64,
    snapshots: u64,
    deltas: u64,
    connected: bool,
    elements: u64,
    conntrack_deleted: u64,
    conntrack_errors: u64,
    guarded_deleted: u64,
    guarded_errors: u64,
    reconcile_checks: u64,
    reconcile_reads: u64,
    reconcile_read_seconds: f64,
    reconcile_errors: u64,
    /// Repairs by kind of object that drifted (see `apply::reconcile::Drift::kinds`).
    drift_repairs: std::collections::BTreeMap<&'static str, u64>,
    drift_repair_errors: u64,
    adopted: bool,
    brains_known: u64,
    discovery_lists_ok: u64,
    discovery_lists_error: u64,
}

#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            inner: Mutex::new(Inner {
                sync: Histogram::new(SYNC_BUCKETS),
                npl: Histogram::new(NPL_BUCKETS),
                last_sync: None,
                applied_generation: 0,
                apply_errors: 0,
                snapshots: 0,
                deltas: 0,
                connected: false,
                elements: 0,
                conntrack_deleted: 0,
                conntrack_errors: 0,
                guarded_deleted: 0,
                guarded_errors: 0,
                reconcile_checks: 0,
                reconcile_reads: 0,
                reconcile_read_seconds: 0.0,
                reconcile_errors: 0,
                drift_repairs: Default::default(),
                drift_repair_errors: 0,
                adopted: false,
                brains_known: 0,
                discovery_lists_ok: 0,
                discovery_lists_error: 0,
            }),
        }
    }
}

impl Metrics {
    fn with(&self, f: impl FnOnce(&mut Inner)) {
        if let Ok(mut i) = self.inner.lock() {
            f(&mut i)
        }
    }

    pub fn applied(&self, generation: u64, took: Duration, snapshot: bool, elements: usize) {
        self.with(|i| {
            i.sync.observe(took.as_secs_f64());
            i.last_sync = Some(SystemTime::now());
            i.applied_generation = generation;
            i.elements = elements as u64;
            if snapshot {
                i.snapshots += 1
            } else {
                i.deltas += 1
            }
        })
    }

    pub fn apply_failed(&self) {
        self.with(|i| i.apply_errors += 1)
    }

    pub fn network_programming(&self, latency: Duration) {
        self.with(|i| i.npl.observe(latency.as_secs_f64()))
    }

    /// Stale UDP conntrack entries deleted after a commit.
    pub fn conntrack_deleted(&self, n: u64) {
        self.with(|i| i.conntrack_deleted += n)
    }

    /// A conntrack cleanup that failed, whole or in part.
    pub fn conntrack_cleanup_failed(&self) {
        self.with(|i| i.conntrack_errors += 1)
    }

    /// Guarded map entries (session affinity) deleted after a commit removed their guard.
    pub fn guarded_deleted(&self, n: u64) {
        self.with(|i| i.guarded_deleted += n)
    }

    /// A guarded entries cleanup that failed.
    pub fn guarded_cleanup_failed(&self) {
        self.with(|i| i.guarded_errors += 1)
    }

    /// One reconciliation check (a generation read, and a table read if it moved).
    pub fn reconcile_checked(&self) {
        self.with(|i| i.reconcile_checks += 1)
    }

    /// The tables were read back from the kernel, taking `took`.
    pub fn reconcile_read(&self, took: Duration) {
        self.with(|i| {
            i.reconcile_reads += 1;
            i.reconcile_read_seconds = took.as_secs_f64();
        })
    }

    /// A check that could not run (netlink failed).
    pub fn reconcile_failed(&self) {
        self.with(|i| i.reconcile_errors += 1)
    }

    /// Drift repaired; `kinds` says what had drifted ("table", "chain", "set", "element",
    /// "undecodable").
    pub fn drift_repaired(&self, kinds: &[&'static str]) {
        self.with(|i| {
            for k in kinds {
                *i.drift_repairs.entry(k).or_default() += 1;
            }
        })
    }

    /// Drift found whose repair the kernel refused.
    pub fn drift_repair_failed(&self) {
        self.with(|i| i.drift_repair_errors += 1)
    }

    /// The tables a previous run left were adopted as the model at start-up.
    pub fn set_adopted(&self, elements: usize) {
        self.with(|i| {
            i.adopted = true;
            i.elements = elements as u64;
        })
    }

    /// How many brains this node knows (`--brain` and those found in the EndpointSlices).
    pub fn set_brains_known(&self, n: usize) {
        self.with(|i| i.brains_known = n as u64)
    }

    /// One list of the brains' EndpointSlices, which succeeded or not (discovery.rs).
    pub fn discovery_listed(&self, ok: bool) {
        self.with(|i| {
            if ok {
                i.discovery_lists_ok += 1
            } else {
                i.discovery_lists_error += 1
            }
        })
    }

    pub fn set_connected(&self, c: bool) {
        self.with(|i| i.connected = c)
    }

    pub fn render(&self) -> String {
        let Ok(i) = self.inner.lock().map(|i| i.clone()) else {
            return String::new();
        };
        let mut out = String::new();
        i.sync.render(
            &mut out,
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "Time the actuator took to apply one update to the kernel (one nf_tables transaction).",
        );
        i.npl.render(
            &mut out,
            "kubeproxy_network_programming_duration_seconds",
            "From an endpoint or Service change to its rules being applied on this node.",
        );
        let last = i
            .last_sync
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let gauges = [
            (
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                "gauge",
                "When the last update was applied.",
                last,
            ),
            (
                "splitproxy_actuator_applied_generation",
                "gauge",
                "Generation of the last applied update.",
                i.applied_generation as f64,
            ),
            (
                "splitproxy_actuator_apply_errors_total",
                "counter",
                "Updates the kernel rejected.",
                i.apply_errors as f64,
            ),
            (
                "splitproxy_actuator_snapshots_applied_total",
                "counter",
                "Snapshot updates applied.",
                i.snapshots as f64,
            ),
            (
                "splitproxy_actuator_deltas_applied_total",
                "counter",
                "Delta updates applied.",
                i.deltas as f64,
            ),
            (
                "splitproxy_actuator_connected",
                "gauge",
                "1 while a brain stream is open.",
                i.connected as u8 as f64,
            ),
            (
                "splitproxy_actuator_set_elements",
                "gauge",
                "Set and map elements in the applied model.",
                i.elements as f64,
            ),
            (
                "splitproxy_actuator_conntrack_entries_deleted_total",
                "counter",
                "Stale UDP conntrack entries deleted after commits (endpoints gone, or destinations that got endpoints).",
                i.conntrack_deleted as f64,
            ),
            (
                "splitproxy_actuator_conntrack_cleanup_errors_total",
                "counter",
                "Conntrack cleanups that failed in whole or in part; the entries expire by themselves.",
                i.conntrack_errors as f64,
            ),
            (
                "splitproxy_actuator_affinity_entries_deleted_total",
                "counter",
                "Entries the packet path added to a guarded map (session affinity) deleted after a commit removed the set element that vouched for them.",
                i.guarded_deleted as f64,
            ),
            (
                "splitproxy_actuator_affinity_cleanup_errors_total",
                "counter",
                "Cleanups of guarded map entries (session affinity) that failed; the entries time out by themselves.",
                i.guarded_errors as f64,
            ),
        ];
        let reconcile = [
            (
                "splitproxy_actuator_reconcile_checks_total",
                "counter",
                "Checks of the kernel's tables against the applied model (a generation read each).",
                i.reconcile_checks as f64,
            ),
            (
                "splitproxy_actuator_reconcile_reads_total",
                "counter",
                "Checks that read the tables back because someone else committed.",
                i.reconcile_reads as f64,
            ),
            (
                "splitproxy_actuator_reconcile_read_duration_seconds",
                "gauge",
                "Time the last read of the tables took.",
                i.reconcile_read_seconds,
            ),
            (
                "splitproxy_actuator_reconcile_errors_total",
                "counter",
                "Checks that could not run.",
                i.reconcile_errors as f64,
            ),
            (
                "splitproxy_actuator_drift_repair_errors_total",
                "counter",
                "Drift found whose repair the kernel refused (the next snapshot replaces the tables).",
                i.drift_repair_errors as f64,
            ),
            (
                "splitproxy_actuator_adopted",
                "gauge",
                "1 when the tables a previous run left were adopted at start-up.",
                i.adopted as u8 as f64,
            ),
            (
                "splitproxy_actuator_brains_known",
                "gauge",
                "Brains this node knows: --brain addresses and those found in the brain Service's EndpointSlices.",
                i.brains_known as f64,
            ),
        ];
        for (name, kind, help, v) in gauges.into_iter().chain(reconcile) {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        let name = "splitproxy_actuator_drift_repairs_total";
        let _ = writeln!(
            out,
            "# HELP {name} Repairs of the kernel's tables, by kind of object that had drifted from the applied model.\n# TYPE {name} counter"
        );
        for what in ["table", "chain", "set", "element", "undecodable"] {
            let v = i.drift_repairs.get(what).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}{{what=\"{what}\"}} {v}");
        }
        let name = "splitproxy_actuator_discovery_lists_total";
        let _ = writeln!(
            out,
            "# HELP {name} Lists of the brain Service's EndpointSlices, by result (ok, error).\n# TYPE {name} counter"
        );
        for (result, v) in [
            ("ok", i.discovery_lists_ok),
            ("error", i.discovery_lists_error),
        ] {
            let _ = writeln!(out, "{name}{{result=\"{result}\"}} {v}");
        }
        out
    }
}
