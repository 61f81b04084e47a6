//! The brain's Prometheus metrics, rendered in the text exposition format. Few enough that a
//! small registry of atomics beats a metrics framework.
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Metrics {
    /// Objects (or parts of objects) skipped as unusable, by kind and reason.
    invalid: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    pub recomputes: AtomicU64,
    pub recompute_micros_total: AtomicU64,
    pub updates_sent: AtomicU64,
    pub snapshots_sent: AtomicU64,
    pub update_bytes_sent: AtomicU64,
    pub nacks: AtomicU64,
    pub synced: AtomicU64,
    pub relists: AtomicU64,
}

impl Metrics {
    pub fn invalid(&self, kind: &'static str, reason: &'static str) {
        if let Ok(mut m) = self.invalid.lock() {
            *m.entry((kind, reason)).or_default() += 1;
        }
    }

    pub fn invalid_total(&self) -> u64 {
        self.invalid.lock().map(|m| m.values().sum()).unwrap_or(0)
    }

    pub fn render(&self, connected_nodes: usize) -> String {
        let mut out = String::new();
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.push_str("# HELP splitproxy_brain_invalid_objects_total Kubernetes objects or parts of them skipped as unusable.\n");
        out.push_str("# TYPE splitproxy_brain_invalid_objects_total counter\n");
        if let Ok(m) = self.invalid.lock() {
            for ((kind, reason), n) in m.iter() {
                let _ = writeln!(
                    out,
                    "splitproxy_brain_invalid_objects_total{{kind=\"{kind}\",reason=\"{reason}\"}} {n}"
                );
            }
        }
        let simple = [
            (
                "splitproxy_brain_synced",
                "gauge",
                "1 once every initial list is complete and no relist is pending.",
                g(&self.synced),
            ),
            (
                "splitproxy_brain_relists_total",
                "counter",
                "Watches that had to relist.",
                g(&self.relists),
            ),
            (
                "splitproxy_brain_recomputes_total",
                "counter",
                "Desired-state recomputations.",
                g(&self.recomputes),
            ),
            (
                "splitproxy_brain_recompute_seconds_total",
                "counter",
                "Time spent recomputing desired state.",
                0,
            ),
            (
                "splitproxy_brain_updates_sent_total",
                "counter",
                "Updates streamed to nodes.",
                g(&self.updates_sent),
            ),
            (
                "splitproxy_brain_snapshots_sent_total",
                "counter",
                "Snapshot updates streamed to nodes.",
                g(&self.snapshots_sent),
            ),
            (
                "splitproxy_brain_update_bytes_sent_total",
                "counter",
                "Encoded bytes of updates streamed to nodes.",
                g(&self.update_bytes_sent),
            ),
            (
                "splitproxy_brain_nacks_total",
                "counter",
                "Updates a node failed to apply.",
                g(&self.nacks),
            ),
            (
                "splitproxy_brain_connected_nodes",
                "gauge",
                "Nodes with an open stream.",
                connected_nodes as u64,
            ),
        ];
        for (name, kind, help, value) in simple {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            if name == "splitproxy_brain_recompute_seconds_total" {
                let secs = g(&self.recompute_micros_total) as f64 / 1e6;
                let _ = writeln!(out, "{name} {secs}");
            } else {
                let _ = writeln!(out, "{name} {value}");
            }
        }
        out
    }
}
