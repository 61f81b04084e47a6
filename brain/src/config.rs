//! Command-line flags. Where a flag means what a kube-proxy flag means, it has its name.
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "splitproxy-brain",
    version,
    about = "splitproxy brain: watches the API server once and streams per-node nftables deltas over mTLS gRPC"
)]
pub struct Args {
    /// kubeconfig file; in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// gRPC listen address for actuators and operators.
    #[arg(long, default_value = "0.0.0.0:9443")]
    pub listen: SocketAddr,
    /// Server certificate (PEM).
    #[arg(long)]
    pub tls_cert: PathBuf,
    /// Server private key (PEM).
    #[arg(long)]
    pub tls_key: PathBuf,
    /// CA that signs client (actuator and operator) certificates (PEM).
    #[arg(long)]
    pub client_ca: PathBuf,
    /// Service CIDRs: ClusterIPs outside them are skipped, unallocated addresses inside are
    /// dropped. Repeatable or comma-separated. When unset, the brain follows the cluster's
    /// ServiceCIDR objects (networking.k8s.io/v1), as kube-proxy's nftables mode does.
    #[arg(long = "service-cidr", value_delimiter = ',')]
    pub service_cidrs: Vec<ipnet::IpNet>,
    /// Pod CIDRs of the cluster (kube-proxy's `--cluster-cidr`): with `--detect-local-mode
    /// ClusterCIDR`, traffic to Services from outside them is masqueraded. Comma-separated, one
    /// per family.
    #[arg(long = "cluster-cidr", value_delimiter = ',')]
    pub cluster_cidrs: Vec<ipnet::IpNet>,
    /// How a packet is told to come from a local pod (kube-proxy's `--detect-local-mode`):
    /// ClusterCIDR (source inside `--cluster-cidr`), NodeCIDR (source inside the node's
    /// `spec.podCIDRs`), InterfaceNamePrefix (arrives on an interface named
    /// `--pod-interface-name-prefix*`), BridgeInterface (arrives on `--pod-bridge-interface`), or
    /// None. Default: ClusterCIDR when `--cluster-cidr` is set, otherwise None.
    #[arg(long)]
    pub detect_local_mode: Option<crate::rules::DetectLocalMode>,
    /// Interface name prefix of pod interfaces (InterfaceNamePrefix mode).
    #[arg(long, default_value = "")]
    pub pod_interface_name_prefix: String,
    /// Bridge the pods are attached to (BridgeInterface mode).
    #[arg(long, default_value = "")]
    pub pod_bridge_interface: String,
    /// Addresses NodePorts are reachable on (kube-proxy's `--nodeport-addresses`): `primary`
    /// (the Node object's first InternalIP of each family, kube-proxy's nftables default), or
    /// CIDRs selecting among the Node object's addresses (`0.0.0.0/0` for all of them).
    /// Comma-separated.
    #[arg(
        long = "nodeport-addresses",
        value_delimiter = ',',
        default_value = "primary"
    )]
    pub nodeport_addresses: Vec<String>,
    /// Masquerade all traffic to Services, as kube-proxy's `--masquerade-all`.
    #[arg(long)]
    pub masquerade_all: bool,
    /// Serve only Services labelled `service.kubernetes.io/service-proxy-name` with this value
    /// (empty: only Services without the label), as kube-proxy's `--service-proxy-name`.
    #[arg(long, default_value = "")]
    pub service_proxy_name: String,
    /// Name of the nftables tables the actuators own.
    #[arg(long, default_value = "splitproxy")]
    pub table: String,
    /// HTTP address for /metrics, /healthz and /readyz.
    #[arg(long = "metrics-bind-address", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: SocketAddr,
    /// Use streaming lists (sendInitialEvents) for the initial lists; `false` uses paged lists.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub streaming_lists: bool,
    /// Snapshots streamed at once; more nodes needing one wait their turn. Bounds the brain's
    /// memory when many nodes connect together (each in-flight snapshot is buffered per stream).
    #[arg(long, default_value_t = 32)]
    pub max_concurrent_snapshots: usize,
    /// Set elements per message: larger snapshots and deltas are sent in parts of this size,
    /// which every node joins and applies as one transaction. Keeps every message (and every
    /// stream's encode buffer) small: each stream's buffers follow the largest message it
    /// carried, so at 5,000 nodes 2,048 elements (about 80 KB) cost the brain 1,100 MiB, 1,024
    /// cost 720 MiB with the same churn latency, and 512 saved no more but added 0.4 s to it.
    #[arg(long, default_value_t = 1024)]
    pub update_part_elements: usize,
    /// Minimum time between two publications of desired state (milliseconds). Changes within
    /// it are folded into one update per node, like kube-proxy's minimum sync period.
    #[arg(long, default_value_t = 200)]
    pub min_publish_interval_ms: u64,
    /// Write the addresses actually bound (`grpc=ADDR`, `metrics=ADDR`) to this file once
    /// listening; with port 0 this lets a supervisor learn the ports without races.
    #[arg(long)]
    pub bound_address_file: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    pub log_format: String,
}
