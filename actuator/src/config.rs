//! Command-line flags. Where a flag means what a kube-proxy flag means, it has its name.
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "splitproxy-actuator",
    version,
    about = "splitproxy actuator: applies the brain's ruleset deltas to this node's nftables over netlink"
)]
pub struct Args {
    /// Brain addresses (https://host:port); tried in turn. Repeatable or comma-separated.
    #[arg(long = "brain", required = true, value_delimiter = ',')]
    pub brains: Vec<String>,
    /// Name the brain's certificate must carry (defaults to each address's host).
    #[arg(long)]
    pub brain_server_name: Option<String>,
    /// This node's name; must match the client certificate.
    #[arg(long = "hostname-override", env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// CA that signed the brain's certificate (PEM).
    #[arg(long)]
    pub ca: PathBuf,
    /// Client certificate naming this node (PEM).
    #[arg(long)]
    pub tls_cert: PathBuf,
    /// Client private key (PEM).
    #[arg(long)]
    pub tls_key: PathBuf,
    /// Name of the nftables tables this actuator owns (`ip NAME`, `ip6 NAME`); it refuses to
    /// touch any other.
    #[arg(long, default_value = "splitproxy")]
    pub table: String,
    /// /healthz and /readyz.
    #[arg(long = "healthz-bind-address", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: SocketAddr,
    /// /metrics (may equal the healthz address, which then serves both).
    #[arg(long = "metrics-bind-address", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: SocketAddr,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    pub log_format: String,
}
