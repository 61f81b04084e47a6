//! The lab's command line.
use std::net::IpAddr;
use std::path::PathBuf;

#[derive(Debug, clap::Parser)]
#[command(
    name = "splitproxy-lab",
    version,
    about = "A local splitproxy lab in network namespaces",
    after_help = "Addresses: node i is 192.168.77.(10+i) and fd00:77::(10+i), its pods are in \
10.244.i.0/24 and fd00:244:0:i::/64, external clients start at 192.168.77.200 / fd00:77::200, \
Services at 10.96.0.0/16 and fd00:96::/112. The node end of a pod's veth is named pod<N> (the \
lab's pod interface prefix is `pod`). Scenario format: tests/lab/scenarios/README.md."
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
    /// Bring a lab up: API server, brains, actuators in node namespaces, external clients;
    /// with --scenario DIR, configured by DIR/lab.yaml and with DIR's objects applied.
    Up(UpArgs),
    /// Bring a lab up in the background, apply the demo Services, show traffic, print how to
    /// reach the brain with grpcurl. `down` tears it down.
    Demo(UpArgs),
    /// Apply a Kubernetes YAML file or directory to the lab (pods are created for endpoint
    /// addresses of EndpointSlices; Nodes merge into the lab's Node objects).
    Apply { path: PathBuf },
    /// Probe TCP or UDP connections from a pod, node, external client or address to ip:port.
    Probe(ProbeArgs),
    /// HTTP GET from a pod, node, external client or address (e.g. a healthCheckNodePort).
    Http(HttpArgs),
    /// Run a scenario's probes.yaml (or a probes file) against the running lab.
    Replay(ReplayArgs),
    /// Add a pod (a namespace on a node, with a server answering its name, the endpoint address
    /// and the source address it saw), for example a client to probe from.
    Pod {
        #[arg(long)]
        node: String,
        #[arg(long)]
        name: String,
        /// Its addresses, at most one per family (comma-separated or repeated); default: the
        /// next free IPv4 address of the node's pod CIDR and its IPv6 twin.
        #[arg(long, value_delimiter = ',')]
        ip: Vec<IpAddr>,
        /// TCP ports to serve (comma-separated).
        #[arg(long, value_delimiter = ',')]
        tcp: Vec<u16>,
        /// UDP ports to serve (comma-separated).
        #[arg(long, value_delimiter = ',')]
        udp: Vec<u16>,
    },
    /// Add an external client (a namespace on the fabric routing via a node).
    External {
        #[arg(long)]
        name: String,
        /// Its addresses in 192.168.77.0/24 and/or fd00:77::/64; default: the next free pair
        /// from 192.168.77.200 / fd00:77::200.
        #[arg(long, value_delimiter = ',')]
        ip: Vec<IpAddr>,
        /// The node its default routes point to (default: the first node).
        #[arg(long)]
        via: Option<String>,
    },
    /// Show the lab: nodes, pods, clients, brain addresses, kubeconfig, grpcurl command.
    Status,
    /// Tear the lab down.
    Down,
    /// Run a brain (same as splitproxy-brain).
    #[command(hide = true)]
    Brain(Box<splitproxy_brain::config::Args>),
    /// Run an actuator (same as splitproxy-actuator).
    #[command(hide = true)]
    Actuator(Box<splitproxy_actuator::config::Args>),
}

#[derive(Debug, Clone, Default, clap::Args)]
pub struct UpArgs {
    /// Number of node namespaces (each with an actuator); default 3, or what lab.yaml says.
    #[arg(long)]
    pub nodes: Option<usize>,
    /// Number of brain replicas; default 1, or what lab.yaml says (with --chart: 2, at most one
    /// per node, as the chart's anti-affinity wants).
    #[arg(long)]
    pub brains: Option<usize>,
    /// Service CIDRs of the API server and the brain (comma-separated); default
    /// 10.96.0.0/16,fd00:96::/112, or what lab.yaml says.
    #[arg(long)]
    pub service_cidr: Option<String>,
    /// A scenario directory: lab.yaml configures the lab, the other YAML files are applied in
    /// name order, probes.yaml is run with --probe.
    #[arg(long)]
    pub scenario: Option<PathBuf>,
    /// After applying the scenario, run its probes.yaml and print the results.
    #[arg(long, requires = "scenario")]
    pub probe: bool,
    /// Probe results as JSON, one object per probe.
    #[arg(long)]
    pub json: bool,
    /// Return once the lab is up, leaving the supervisor in the background.
    #[arg(long)]
    pub detach: bool,
    /// Install the Helm chart (charts/splitproxy) instead of starting brains and actuators
    /// directly, as the chart-driven test does (tests/src/install/): its rendered objects
    /// applied to the API server, a Pod per brain replica and per node, each container run in
    /// its node's namespace with exactly its rendered arguments, environment and volumes
    /// (ServiceAccount tokens, the brains' own CA, brains found through their EndpointSlices).
    #[arg(long)]
    pub chart: bool,
    /// A chart value (KEY=VALUE, as `helm --set` takes it; repeatable), after the lab's own.
    #[arg(long = "set", value_name = "KEY=VALUE", requires = "chart")]
    pub set: Vec<String>,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ProbeArgs {
    /// Destination ip:port (`[v6]:port` for IPv6).
    pub dst: std::net::SocketAddr,
    /// Where the connection starts: a pod, node or external client name, or an address of one
    /// (which the probe then binds as its source).
    #[arg(long)]
    pub from: String,
    /// UDP instead of TCP.
    #[arg(long)]
    pub udp: bool,
    /// Number of new connections.
    #[arg(long, default_value_t = 1)]
    pub count: usize,
    /// Fixed source port for every connection (default: a new one each time).
    #[arg(long, default_value_t = 0)]
    pub source_port: u16,
    /// Per-connection timeout in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub timeout_ms: u64,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// `http://IP:PORT/path` (an IPv6 address in brackets).
    pub url: String,
    /// Where the request starts: a pod, node or external client name, or an address of one.
    #[arg(long)]
    pub from: String,
    /// Timeout in milliseconds.
    #[arg(long, default_value_t = 3000)]
    pub timeout_ms: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ReplayArgs {
    /// A scenario directory (its probes.yaml is run) or a probes file.
    pub path: PathBuf,
    /// Apply the scenario's Kubernetes objects first.
    #[arg(long)]
    pub apply: bool,
    /// How long probes whose expectation fails are retried, in milliseconds (the rules may still
    /// be on their way).
    #[arg(long, default_value_t = 10_000)]
    pub settle_ms: u64,
    /// One JSON object per probe instead of text.
    #[arg(long)]
    pub json: bool,
}
