//! Command line. Two benchmarks, one binary: without a subcommand the end-to-end benchmark
//! ([`BenchArgs`]), `splitproxy-bench scale` the brain and kernel alone ([`ScaleArgs`]). The
//! binary is also multi-call (`splitproxy-bench brain ...`, `splitproxy-bench actuator ...`),
//! like the lab's, so that the harness can spawn the real brain and actuators from the binary
//! that is running the benchmark, with no second build to find.
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;

#[derive(Debug, clap::Parser)]
#[command(
    name = "splitproxy-bench",
    version,
    about = "splitproxy's scale benchmarks. Without a subcommand: end to end, splitproxy (brain, \
             real actuators in node namespaces, a virtual fleet over real gRPC) side by side with \
             kube-proxy against one real API server. `scale`: brain compute and kernel apply \
             alone, without an API server",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(flatten)]
    pub bench: BenchArgs,
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The scale mode, and the real components run from this binary by the harness.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Brain compute and kernel apply at scale, without an API server: full rebuild, every
    /// node's overlay, single-Service changes, then a node's cold start, single-endpoint changes
    /// and a Service added and deleted, applied in a private network namespace (run as root).
    Scale(ScaleArgs),
    /// Run a brain (same as splitproxy-brain).
    #[command(hide = true)]
    Brain(Box<splitproxy_brain::config::Args>),
    /// Run an actuator (same as splitproxy-actuator).
    #[command(hide = true)]
    Actuator(Box<splitproxy_actuator::config::Args>),
    /// One side of the fan-out floor, in a process of its own (the benchmark runs it).
    #[command(hide = true)]
    Floor(crate::floor::FloorArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Services (ClusterIP, TCP) in the workload.
    #[arg(long, default_value_t = 10_000)]
    pub services: usize,
    /// Endpoints per Service (at most 100 per EndpointSlice).
    #[arg(long, default_value_t = 10)]
    pub endpoints: usize,
    /// Node objects in the workload.
    #[arg(long, default_value_t = 5_000)]
    pub nodes: usize,
    /// Real actuators, each in its own node namespace with real nftables.
    #[arg(long, default_value_t = 3)]
    pub real: usize,
    /// Virtual nodes served over real gRPC, applying into the in-memory model only
    /// (default: every node that is neither real nor kube-proxy's, N - R - 1).
    #[arg(long = "virtual")]
    pub virtual_nodes: Option<usize>,
    /// Brain replicas, each watching the API server once. Node i (virtual, and real actuator
    /// i) starts on replica i % N and moves to another when its stream fails.
    #[arg(long, default_value_t = 1)]
    pub brains: usize,
    /// Threads each brain replica serves its nodes' connections on (its `--worker-threads`;
    /// 0, the default: one per CPU, as a brain runs unless told). With 1 on this 2-core machine
    /// the churn phase sent a fifth fewer updates for less CPU, but with kube-proxy syncing
    /// beside it a single change took longer (docs/performance.md).
    #[arg(long, default_value_t = 0)]
    pub brain_worker_threads: usize,
    /// Single-endpoint changes in the endpoint_flip phase, each made alone (every node
    /// converged and kube-proxy synced before the next): their NPL, kernel apply and time to
    /// the real nodes as distributions.
    #[arg(long, default_value_t = 20)]
    pub single_changes: usize,
    /// Least spacing between two single changes, milliseconds.
    #[arg(long, default_value_t = 400)]
    pub single_gap_ms: u64,
    /// Duration of the churn during which the failover phase kills one replica (with
    /// --brains 2 or more), seconds; the kill comes a third of the way in.
    #[arg(long, default_value_t = 10)]
    pub failover_seconds: u64,
    /// Do not run the failover phase (a replica killed during churn).
    #[arg(long)]
    pub skip_failover: bool,
    /// Do not run the restart phase (every replica stopped and started again).
    #[arg(long)]
    pub skip_restart: bool,
    /// Do not measure the fan-out floor (bare loopback TCP to as many nodes, src/floor.rs).
    #[arg(long)]
    pub skip_floor: bool,
    /// Duration of the steady-churn phase, seconds.
    #[arg(long, default_value_t = 60)]
    pub churn_seconds: u64,
    /// Services changed per second during churn, in percent of --services.
    #[arg(long, default_value_t = 1.0)]
    pub churn_percent: f64,
    /// How many evenly spaced bursts each second's churn writes are split into. 1 writes them
    /// all at once, as earlier runs did; more is closer to a cluster's churn, which arrives
    /// spread out, and makes replicas fold the same changes in different batches (their
    /// publications then differ, and a failover resumes nodes by restating deltas).
    #[arg(long, default_value_t = 1)]
    pub churn_bursts: u32,
    /// Duration of each churn run of the API watch comparison (without and with one watcher set
    /// per node), seconds.
    #[arg(long, default_value_t = 20)]
    pub storm_seconds: u64,
    /// Do not run kube-proxy side by side (its node object still exists).
    #[arg(long)]
    pub skip_kube_proxy: bool,
    /// Do not run the API watch comparison.
    #[arg(long)]
    pub skip_watch_storm: bool,
    /// How long to wait for kube-proxy's first full sync (it takes minutes at 10k Services).
    #[arg(long, default_value_t = 600)]
    pub kube_proxy_timeout_seconds: u64,
    /// How long to wait for one phase's change to reach every node.
    #[arg(long, default_value_t = 120)]
    pub phase_timeout_seconds: u64,
    /// Concurrent API writes while creating the workload.
    #[arg(long, default_value_t = 48)]
    pub write_concurrency: usize,
    /// A flag for every brain replica, passed as it is after the benchmark's own (repeat it for
    /// more): runs that differ in one brain setting, e.g.
    /// `--brain-arg=--min-publish-interval-ms=50`. The report's command line shows them.
    #[arg(long = "brain-arg", allow_hyphen_values = true)]
    pub brain_args: Vec<String>,
    /// Directory for the JSON result, the plots and the component logs.
    #[arg(long, default_value = "bench/results")]
    pub out: PathBuf,
    /// Markdown report, regenerated on each run.
    #[arg(long, default_value = "bench/RESULTS.md")]
    pub report: PathBuf,
}

/// The scale mode's workload and how many changes it measures.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// Services (ClusterIP, TCP).
    #[arg(long, default_value_t = 10_000)]
    pub services: usize,
    /// Endpoints per Service.
    #[arg(long, default_value_t = 10)]
    pub endpoints: usize,
    /// Node objects endpoints are spread over; 0: none, and no per-node overlays.
    #[arg(long, default_value_t = 5_000)]
    pub nodes: usize,
    /// Single-Service changes timed in the brain.
    #[arg(long, default_value_t = 100)]
    pub service_changes: usize,
    /// Single-endpoint changes applied to the kernel, for their distribution.
    #[arg(long, default_value_t = 200)]
    pub endpoint_changes: usize,
    /// Churn publications timed in the brain...
    #[arg(long, default_value_t = 20)]
    pub churn_publications: usize,
    /// ... of this many changed Services each (the end-to-end mode's churn writes 1 % of the
    /// Services a second, 100 at its defaults).
    #[arg(long, default_value_t = 100)]
    pub churn_batch: usize,
    /// Part sizes (elements per update part) the snapshot's compression is weighed at, each at
    /// several zstd levels (the brain's `--update-part-elements` is 1,024).
    #[arg(long, value_delimiter = ',', default_value = "1024,4096")]
    pub compression_part_elements: Vec<usize>,
}

impl ScaleArgs {
    /// Rejects workloads the address ranges cannot hold.
    pub fn validate(&self) -> anyhow::Result<()> {
        validate_workload(self.services, self.endpoints)?;
        if self.nodes > MAX_NODES {
            bail!("--nodes above {MAX_NODES} do not fit 100.64.0.0/10");
        }
        if self.service_changes == 0
            || self.endpoint_changes == 0
            || self.churn_publications == 0
            || self.churn_batch == 0
            || self.compression_part_elements.contains(&0)
        {
            bail!(
                "--service-changes, --endpoint-changes, --churn-publications, --churn-batch and \
                 --compression-part-elements must be positive"
            );
        }
        Ok(())
    }
}

/// Node objects the workload can address (100.64.0.0/10).
const MAX_NODES: usize = 1 << 22;

/// The limits of the workload's address ranges (see [`crate::workload`]).
fn validate_workload(services: usize, endpoints: usize) -> anyhow::Result<()> {
    if services == 0 || endpoints == 0 {
        bail!("--services and --endpoints must be positive");
    }
    if services > 400_000 {
        bail!("--services above 400000 do not fit the Service CIDR used here");
    }
    if services * endpoints > 4_000_000 {
        bail!("more than 4,000,000 endpoints do not fit 10.128.0.0/9 with room for churn");
    }
    Ok(())
}

impl BenchArgs {
    /// The number of virtual nodes, after defaults.
    pub fn virtual_count(&self) -> usize {
        self.virtual_nodes
            .unwrap_or_else(|| self.nodes.saturating_sub(self.real + 1))
    }

    pub fn phase_timeout(&self) -> Duration {
        Duration::from_secs(self.phase_timeout_seconds)
    }

    pub fn single_gap(&self) -> Duration {
        Duration::from_millis(self.single_gap_ms)
    }

    /// Whether the failover phase runs.
    pub fn failover(&self) -> bool {
        self.brains >= 2 && !self.skip_failover
    }

    pub fn kube_proxy_timeout(&self) -> Duration {
        Duration::from_secs(self.kube_proxy_timeout_seconds)
    }

    /// Services changed per churn tick (at least one).
    pub fn churn_per_second(&self) -> usize {
        ((self.services as f64 * self.churn_percent / 100.0).round() as usize).max(1)
    }

    /// Rejects combinations that cannot describe a cluster.
    pub fn validate(&self) -> anyhow::Result<()> {
        validate_workload(self.services, self.endpoints)?;
        if self.real == 0 {
            bail!("--real must be at least 1: kernel apply times come from real actuators");
        }
        // Node namespaces: one per real actuator plus kube-proxy's.
        if self.real + 1 > splitproxy_tests::topology::MAX_NODES {
            bail!(
                "--real must be below {} (node namespaces)",
                splitproxy_tests::topology::MAX_NODES
            );
        }
        let needed = self.real + 1 + self.virtual_count();
        if needed > self.nodes {
            bail!(
                "--nodes {} is too few for {} real + 1 kube-proxy + {} virtual nodes",
                self.nodes,
                self.real,
                self.virtual_count()
            );
        }
        if self.nodes > MAX_NODES {
            bail!("--nodes above {MAX_NODES} do not fit 100.64.0.0/10");
        }
        if !(self.churn_percent > 0.0 && self.churn_percent <= 100.0) {
            bail!("--churn-percent must be in (0, 100]");
        }
        if self.write_concurrency == 0 {
            bail!("--write-concurrency must be positive");
        }
        if self.brains == 0 || self.brains > 16 {
            bail!("--brains must be between 1 and 16");
        }
        if self.single_changes == 0 {
            bail!("--single-changes must be positive");
        }
        if self.failover_seconds < 3 {
            bail!("--failover-seconds must be at least 3 (churn before, at and after the kill)");
        }
        Ok(())
    }
}
