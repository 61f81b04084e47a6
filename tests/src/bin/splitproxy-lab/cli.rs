//! The lab's command line.
use std::path::PathBuf;

#[derive(Debug, clap::Parser)]
#[command(
    name = "splitproxy-lab",
    version,
    about = "A local splitproxy lab in network namespaces"
)]
pub struct Cli {
    /// Where the running lab keeps its state file and control socket.
    #[arg(long, global = true, default_value = "/run/splitproxy-lab")]
    pub state_dir: PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Bring a lab up: API server, brains, actuators in node namespaces.
    Up(UpArgs),
    /// Bring a lab up in the background, apply the demo Services, show traffic, print how to
    /// reach the brain with grpcurl. `down` tears it down.
    Demo(UpArgs),
    /// Apply a Kubernetes YAML file or directory to the lab (pods are created for endpoint
    /// addresses of EndpointSlices).
    Apply { path: PathBuf },
    /// Probe a connection from a pod, node or namespace to ip:port.
    Probe(ProbeArgs),
    /// Add a pod (a namespace on a node, with a server answering its name and the source
    /// address it saw) — for example a client to probe from.
    Pod {
        #[arg(long)]
        node: String,
        #[arg(long)]
        name: String,
        #[arg(long)]
        ip: std::net::Ipv4Addr,
        /// TCP ports to serve (comma-separated).
        #[arg(long, value_delimiter = ',')]
        tcp: Vec<u16>,
        /// UDP ports to serve (comma-separated).
        #[arg(long, value_delimiter = ',')]
        udp: Vec<u16>,
    },
    /// Show the lab: nodes, pods, brain addresses, kubeconfig, grpcurl command.
    Status,
    /// Tear the lab down.
    Down,
    /// Run a brain (same as splitproxy-brain).
    #[command(hide = true)]
    Brain(splitproxy_brain::config::Args),
    /// Run an actuator (same as splitproxy-actuator).
    #[command(hide = true)]
    Actuator(splitproxy_actuator::config::Args),
}

#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Number of node namespaces (each with an actuator).
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Number of brain replicas.
    #[arg(long, default_value_t = 1)]
    pub brains: usize,
    /// Service CIDR of the API server and the brain.
    #[arg(long, default_value = "10.96.0.0/16")]
    pub service_cidr: String,
    /// Return once the lab is up, leaving the supervisor in the background.
    #[arg(long)]
    pub detach: bool,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ProbeArgs {
    /// Destination ip:port.
    pub dst: std::net::SocketAddr,
    /// Where the connection starts: a pod name, a node name, or a source address of one.
    #[arg(long)]
    pub from: String,
    /// UDP instead of TCP.
    #[arg(long)]
    pub udp: bool,
    /// Number of new connections.
    #[arg(long, default_value_t = 1)]
    pub count: usize,
    /// Per-connection timeout in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub timeout_ms: u64,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
}
