//! The machine-readable result of one run (written as JSON into `--out`). Every figure the report
//! and the plots show comes from here, so a report can be regenerated from a JSON file.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::measure::procstat::ProcUsage;
use crate::measure::prom::{HistSummary, Histogram};
use crate::measure::stats::Stats;
use crate::workload::WriteFigures;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BenchResult {
    /// The exact command line.
    pub command: String,
    pub started_at: String,
    pub seconds: f64,
    pub versions: Versions,
    pub machine: Machine,
    pub config: Config,
    pub workload: WriteFigures,
    pub cold_start: ColdStart,
    pub kube_proxy_cold_start: Option<KubeProxyColdStart>,
    /// Change phases in the order they ran.
    pub phases: Vec<Phase>,
    /// The single-change phase (`endpoint_flip`) as distributions over its changes.
    pub single_changes: Option<SingleChanges>,
    /// A replica killed during churn (with `--brains` 2 or more).
    pub failover: Option<Failover>,
    /// Every replica stopped and started again on the same cluster state.
    pub restart: Option<Restart>,
    /// Bare loopback TCP to as many nodes, measured after the churn phase (src/floor.rs).
    #[serde(default)]
    pub floor: Option<crate::floor::Floor>,
    /// The same floor with TLS on every stream (src/floor/link.rs).
    #[serde(default)]
    pub floor_tls: Option<crate::floor::Floor>,
    /// The floor over TLS on tokio tasks, one per stream (src/floor/tasks.rs).
    #[serde(default)]
    pub floor_tokio: Option<crate::floor::Floor>,
    /// The same with an HTTP/2 stream per connection carrying updates and acks.
    #[serde(default)]
    pub floor_h2: Option<crate::floor::Floor>,
    /// The same with the sending side served by hyper's HTTP/2 server, as the brain's is.
    #[serde(default)]
    pub floor_hyper: Option<crate::floor::Floor>,
    pub watches: Option<Watches>,
    pub targets: Vec<Target>,
    /// Things that went wrong or were skipped, in words.
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Versions {
    pub splitproxy: String,
    pub kubernetes: String,
    pub kube_proxy: String,
    pub etcd: String,
    /// The commit checked out when the bench ran.
    pub git_commit: String,
    /// The commit the binary (bench, brain and actuators alike) was built from.
    #[serde(default)]
    pub build_commit: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Machine {
    pub nproc: usize,
    pub memory_bytes: u64,
    pub kernel: String,
    pub cpu_model: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Config {
    pub services: usize,
    pub endpoints: usize,
    pub nodes: usize,
    pub real: usize,
    pub virtual_nodes: usize,
    pub churn_seconds: u64,
    pub churn_percent: f64,
    pub churn_per_second: usize,
    pub storm_seconds: u64,
    pub kube_proxy: bool,
    pub watch_storm: bool,
    /// Brain replicas.
    #[serde(default = "one")]
    pub brains: usize,
    /// Each replica's `--worker-threads` (0: one per CPU). Runs before it had none: 0.
    #[serde(default)]
    pub brain_worker_threads: usize,
    /// Single-endpoint changes of the endpoint_flip phase.
    #[serde(default)]
    pub single_changes: usize,
    /// Bursts each second's churn writes were split into (`--churn-bursts`).
    #[serde(default = "one_u32")]
    pub churn_bursts: u32,
}

fn one_u32() -> u32 {
    1
}

fn one() -> usize {
    1
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ColdStart {
    /// From spawning the brain to /readyz answering 200: every initial list complete and the
    /// state they give computed and published (the log says when the lists were done).
    pub brain_ready_seconds: Option<f64>,
    /// From spawning the brain to each real actuator's /readyz answering 200.
    pub actuators_ready_seconds: BTreeMap<String, Option<f64>>,
    /// From spawning the brain to every virtual node holding the same state.
    pub fleet_in_sync_seconds: Option<f64>,
    /// From spawning the brain to every node (real and virtual) listed in sync by the brain.
    pub all_in_sync_seconds: Option<f64>,
    /// Each real actuator's kernel apply time of its first (full) state.
    pub real_first_apply: BTreeMap<String, HistSummary>,
    /// The brain's compute time for the initial state (its histogram at the end of cold start).
    pub brain_compute: Option<HistSummary>,
    pub brain_fanout: Option<HistSummary>,
    pub brain_bytes_sent: Option<f64>,
    pub brain_updates_sent: Option<f64>,
    /// Distinct parts the brain compressed, and the CPU seconds that took (once for the fleet).
    pub brain_compressed_parts: Option<f64>,
    pub brain_compress_seconds: Option<f64>,
    pub virtual_apply: Stats,
    /// API watches held by the brain replicas (the API server's WATCH gauge before and after
    /// they started).
    pub brain_watches: Option<f64>,
    #[serde(default)]
    pub brain_replicas: usize,
    /// Nodes connected to each replica once every node was in sync.
    #[serde(default)]
    pub connected_per_replica: Vec<usize>,
    pub processes: BTreeMap<String, ProcUsage>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct KubeProxyColdStart {
    /// From spawning kube-proxy to the end of its first sync; `None` when it did not finish
    /// within the time-out.
    pub first_sync_seconds: Option<f64>,
    pub timeout_seconds: f64,
    pub sync: Option<HistSummary>,
    pub full_sync: Option<HistSummary>,
    /// API watches it opened.
    pub watches: Option<f64>,
    pub processes: BTreeMap<String, ProcUsage>,
}

/// One measured change phase.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Phase {
    pub name: String,
    pub description: String,
    /// EndpointSlice or Service writes made.
    pub changes: usize,
    pub seconds: f64,
    /// From the last write to every splitproxy node holding the result.
    pub converged_seconds: Option<f64>,
    pub splitproxy: SplitproxyPhase,
    pub kube_proxy: Option<KubeProxyPhase>,
    pub processes: BTreeMap<String, ProcUsage>,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SplitproxyPhase {
    /// Network programming latency over every node and change: the virtual fleet's exact
    /// samples plus the real actuators' exact ones (single-change phases).
    pub npl: Stats,
    pub npl_virtual: Stats,
    /// CDF of the virtual fleet's samples, (seconds, fraction), for plots.
    pub npl_virtual_cdf: Vec<(f64, f64)>,
    /// Real actuators: their network-programming histogram across the phase.
    pub npl_real: BTreeMap<String, HistSummary>,
    /// Real actuators: exact latency of a single change (sync timestamp - trigger time).
    pub npl_real_exact: BTreeMap<String, f64>,
    /// Real actuators: every exact sample a multi-change phase measured (one per node and
    /// change).
    #[serde(default)]
    pub npl_real_samples: Stats,
    /// Nodes with at least one latency sample in this phase, of `nodes_total`.
    pub nodes_with_samples: usize,
    pub nodes_total: usize,
    pub fanout: Option<HistSummary>,
    pub fanout_histogram: Option<Histogram>,
    /// Each change's trigger time to the brain's publication carrying it (the API server's
    /// write and watch, the pacing, the recompute): NPL before any node is sent anything.
    #[serde(default)]
    pub publish_latency: Option<HistSummary>,
    /// The brain's part of it: each change's watch event to the publication carrying it (the
    /// pacing of publications and the recompute).
    #[serde(default)]
    pub change_queue: Option<HistSummary>,
    pub compute: Option<HistSummary>,
    pub publications: Option<f64>,
    pub updates_sent: Option<f64>,
    pub bytes_sent: Option<f64>,
    pub bytes_per_publication: Option<f64>,
    /// Real actuators' kernel apply time (their sync histogram across the phase).
    pub real_apply: BTreeMap<String, HistSummary>,
    /// Of it, per real actuator, the mean time its applying thread ran on a CPU per sync.
    #[serde(default)]
    pub real_apply_on_cpu_mean: BTreeMap<String, f64>,
    /// Virtual nodes: decode and apply into the in-memory model, per update.
    pub virtual_apply: Stats,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct KubeProxyPhase {
    /// Its network-programming histogram counted every expected change within the time-out.
    pub caught_up: bool,
    /// From the last write until it caught up (or gave up).
    pub waited_seconds: f64,
    pub npl: Option<HistSummary>,
    pub npl_histogram: Option<Histogram>,
    /// Exact latency of a single change: the end of the first sync that counted it - trigger.
    pub npl_exact: Option<f64>,
    pub sync: Option<HistSummary>,
    pub sync_histogram: Option<Histogram>,
    pub partial_sync: Option<HistSummary>,
    pub full_sync: Option<HistSummary>,
    /// Why it did not catch up, when it did not.
    pub note: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Watches {
    pub seconds: u64,
    pub baseline: StormRun,
    pub storm: StormRun,
    /// Watches the simulated fleet asked for and got established.
    pub storm_requested: usize,
    pub storm_established: usize,
    pub storm_failed: usize,
    pub storm_bytes_received: u64,
    pub storm_events_bytes_per_second: f64,
    pub storm_ended_early: usize,
}

/// The API server during one churn run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StormRun {
    /// `apiserver_longrunning_requests{verb="WATCH"}` summed.
    pub watches: Option<f64>,
    /// `apiserver_registered_watchers` summed (absent in some versions).
    pub registered_watchers: Option<f64>,
    pub apiserver_cpu_seconds: f64,
    pub apiserver_cpu_cores: f64,
    pub apiserver_rss_bytes: u64,
    pub apiserver_peak_rss_bytes: u64,
    pub changes: usize,
}

/// One row of the targets table.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Target {
    pub figure: String,
    pub target: String,
    pub measured: String,
    pub kube_proxy: String,
    /// splitproxy / kube-proxy, when both are numbers.
    pub ratio: Option<f64>,
    /// `None` when there is nothing to judge.
    pub met: Option<bool>,
    pub note: String,
    /// Why the target lies under this machine's floor, by what the same run measured beneath
    /// splitproxy (src/report/floors.rs); `None` when the run does not show that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub under_floor: Option<String>,
}

/// K single-endpoint changes, each alone (every node converged and kube-proxy synced before the
/// next, at least `gap_seconds` apart): distributions, not one sample per node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SingleChanges {
    pub changes: usize,
    pub gap_seconds: f64,
    /// Network programming latency over every node and change: the virtual nodes' exact
    /// samples and the real actuators' (sync timestamp - trigger time).
    pub npl: Stats,
    pub npl_virtual: Stats,
    pub npl_real: Stats,
    /// Per change, the mean over the real nodes of the time it took to reach them.
    pub real_per_change: Stats,
    pub real_per_change_seconds: Vec<Option<f64>>,
    /// The real actuators' kernel apply, exact per node and change (the change's one sync:
    /// the difference of the sync histogram's sum).
    pub real_apply: Stats,
    /// Of `real_apply`, the time the actuator's applying thread ran on a CPU, per node and
    /// change (the rest it waited: for a CPU the fleet and the brain share, mostly).
    #[serde(default)]
    pub real_apply_on_cpu: Stats,
    /// Node-changes where the sync histogram counted other than one apply (left out above).
    pub real_apply_inexact: usize,
    /// kube-proxy, per change: the end of the first sync that counted it - trigger time.
    pub kube_proxy_exact: Stats,
    pub kube_proxy_per_change_seconds: Vec<Option<f64>>,
    /// kube-proxy's sync duration per change (difference of its sync histogram's sum).
    pub kube_proxy_sync: Stats,
    /// Changes kube-proxy did not count within the wait.
    pub kube_proxy_missed: usize,
    /// Per change, from the write until every splitproxy node held it.
    pub converged: Stats,
}

/// A brain replica killed with SIGKILL during churn: what its nodes went through.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Failover {
    pub replicas: usize,
    pub victim: usize,
    pub churn_seconds: u64,
    /// Seconds into the churn when the replica was killed.
    pub killed_at_seconds: f64,
    /// Nodes the victim served when it was killed.
    pub moved_nodes: usize,
    pub moved_real: Vec<String>,
    /// From the kill until every moved node was connected and in sync on another replica.
    pub back_in_sync_seconds: Option<f64>,
    /// The same per moved node.
    pub back_in_sync: Stats,
    pub not_back: usize,
    /// From the kill until every moved node was connected to another replica and had acked
    /// one of its updates (or was found current there): resumed, however far the fan-out then
    /// lags behind the newest publication, as it does for every node under churn.
    #[serde(default)]
    pub resumed_seconds: Option<f64>,
    /// The same per moved node.
    #[serde(default)]
    pub resumed: Stats,
    /// The last churn write's trigger time, from the kill: no node is in sync before the
    /// fan-out of that write.
    #[serde(default)]
    pub last_write_after_kill_seconds: Option<f64>,
    /// Network programming latency of the moved virtual nodes over the phase.
    pub npl_moved: Stats,
    /// The moved real actuators' NPL histograms over the phase.
    pub npl_moved_real: BTreeMap<String, HistSummary>,
    /// Bytes the moved virtual nodes received after the kill, in all and per node.
    pub moved_bytes: u64,
    pub moved_bytes_per_node: Option<f64>,
    /// What a full snapshot costs one of them (the last snapshot each received, mean).
    pub full_snapshot_bytes_per_node: Option<f64>,
    pub snapshots_received: u64,
    pub deltas_received: u64,
    /// The moved real actuators' applied snapshots and deltas after the kill.
    pub real_snapshots_applied: f64,
    pub real_deltas_applied: f64,
    /// The surviving replicas' resumptions by kind, and the snapshots they sent, in the phase.
    pub resumptions: BTreeMap<String, f64>,
    /// The surviving replicas' TLS handshakes in the phase, by kind (full, resumed).
    #[serde(default)]
    pub tls_handshakes: BTreeMap<String, f64>,
    pub snapshots_sent: Option<f64>,
    pub connections: Option<Connections>,
    pub notes: Vec<String>,
}

/// A bounded connection loop through a ClusterIP from a client on a real actuator node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Connections {
    pub attempted: usize,
    pub failed: usize,
    pub client_node: String,
    pub server_node: String,
    /// The first failures, in words.
    pub failures: Vec<String>,
}

/// Every brain replica stopped and started again with the same cluster state.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Restart {
    pub replicas: usize,
    /// From the stop signal until every replica had exited.
    pub stop_seconds: f64,
    /// Replicas that did not exit on SIGTERM within the grace period (killed).
    #[serde(default)]
    pub killed_after_grace: usize,
    /// From starting the new processes until every replica answered /readyz.
    pub ready_seconds: Option<f64>,
    /// From starting the new processes until every node was in sync.
    pub all_in_sync_seconds: Option<f64>,
    /// Sessions by how the replicas resumed them (same_epoch, by_content, snapshot).
    pub resumptions: BTreeMap<String, f64>,
    /// The restarted replicas' TLS handshakes, by kind (full, resumed).
    #[serde(default)]
    pub tls_handshakes: BTreeMap<String, f64>,
    pub updates_sent: Option<f64>,
    pub snapshots_sent: Option<f64>,
    /// Updates that were deltas (updates - snapshots).
    pub deltas_sent: Option<f64>,
    /// Sessions resumed at the current state, sent nothing (resumed - deltas - snapshots).
    pub current: Option<f64>,
    pub bytes_sent: Option<f64>,
    /// What a full resync of every node costs: the bytes the cold start sent.
    pub full_resync_bytes: Option<f64>,
    pub bytes_ratio: Option<f64>,
    /// What the virtual nodes received: snapshots, deltas, nodes that received nothing.
    pub virtual_snapshots: u64,
    pub virtual_deltas: u64,
    pub virtual_nothing: usize,
    pub virtual_bytes: u64,
    pub real_snapshots_applied: f64,
    pub real_deltas_applied: f64,
    pub processes: BTreeMap<String, ProcUsage>,
    pub notes: Vec<String>,
}
