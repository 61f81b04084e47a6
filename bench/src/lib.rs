//! splitproxy's synthetic scale benchmarks, one binary with two modes.
//!
//! End to end (the default, [`run`]): one command writes S Services x E endpoints and N Node objects into a real kube-apiserver,
//! starts the brain (`--brains` replicas) against it, R real actuators in node namespaces and V
//! virtual nodes over real gRPC, then kube-proxy v1.37.2 in nftables mode side by side on the
//! same workload, and measures cold start and each change phase (single endpoint changes as
//! distributions, a rolling update, a Service added and deleted, steady churn, a replica killed
//! during churn, every replica restarted) on every node, plus the API server's load with and
//! without one watcher set per node. It writes a JSON result, PNG plots and bench/RESULTS.md. See the targets
//! in [`report::targets`].
//!
//! Scale (`splitproxy-bench scale`, [`scale`]): the same workload through the brain's index,
//! desired state and overlays, then the actuator's applier in a private network namespace,
//! without an API server: what the brain's compute and a node's kernel apply cost at scale.
#![forbid(unsafe_code)]

pub mod cli;
pub mod fleet;
pub mod floor;
pub mod kubeproxy;
pub mod machine;
pub mod measure;
pub mod phases;
pub mod plots;
pub mod report;
pub mod results;
pub mod rig;
pub mod run;
pub mod scale;
pub mod watchstorm;
pub mod workload;
