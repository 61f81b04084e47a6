//! The brain's configuration: its command-line flags ([`Args`]) and the typed configuration the
//! brain runs with ([`BrainConfig`]). Where a flag means what a kube-proxy flag means, it has its
//! name.
//!
//! This file is the one place that knows the flags: [`BrainConfig::try_from`] parses and defaults
//! them once, and [`BrainConfig::to_args`] renders a typed configuration back to flags for whoever
//! spawns a brain process (the test harness, the lab, the benchmark), so no caller writes flag
//! strings of its own. A new flag is a field of [`Args`], a field of [`BrainConfig`] (or of one of
//! its parts), and a line in each direction here; the round-trip test below fails until all of
//! them exist.
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::ValueEnum;

use crate::rules::{DetectLocalMode, NodePortAddresses, RulesConfig};

/// `--max-concurrent-snapshots`' default.
pub const DEFAULT_MAX_CONCURRENT_SNAPSHOTS: usize = 32;
/// `--update-part-elements`' default.
pub const DEFAULT_UPDATE_PART_ELEMENTS: usize = 1024;
/// `--min-publish-interval-ms`' default.
pub const DEFAULT_MIN_PUBLISH_INTERVAL_MS: u64 = 200;
/// `--tls-handshake-timeout-ms`' default.
pub const DEFAULT_TLS_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// `--max-connections`' default: every node of a 5,000-node cluster on one replica, operators,
/// and room for a reconnect wave.
pub const DEFAULT_MAX_CONNECTIONS: usize = 20_000;
/// `--max-connections-per-ip`' default: a node needs one connection.
pub const DEFAULT_MAX_CONNECTIONS_PER_IP: usize = 64;
/// `--api-staleness-bound-ms`' default.
pub const DEFAULT_API_STALENESS_BOUND_MS: u64 = 10_000;
/// `--api-probe-interval-ms`' default.
pub const DEFAULT_API_PROBE_INTERVAL_MS: u64 = 2_000;
/// `--tls-server-name`'s default: the name actuators verify the brain's managed certificate for.
pub const DEFAULT_TLS_SERVER_NAME: &str = "splitproxy-brain";
/// `--tls-ca-validity`'s default: five years (365-day years), renewed after two thirds.
pub const DEFAULT_TLS_CA_VALIDITY: Duration = Duration::from_secs(5 * 365 * 86_400);
/// `--tls-cert-validity`'s default: 90 days, renewed after 60.
pub const DEFAULT_TLS_CERT_VALIDITY: Duration = Duration::from_secs(90 * 86_400);

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
    /// Server certificate (PEM), with `--tls-key`: a certificate someone else issues (cert-manager,
    /// your own PKI). The alternative to `--tls-secret`.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM), with `--tls-cert`.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// `namespace/name` of a Secret in which the brain keeps a CA of its own and its serving
    /// certificate (keys `tls.crt`, `tls.key`, `ca.crt`, `ca.key`), creating and rotating them;
    /// every replica serves from it. The alternative to `--tls-cert` and `--tls-key`.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub tls_secret: Option<ObjectRef>,
    /// `namespace/name` of the Lease through which one replica at a time writes the Secret and
    /// the ConfigMap. Default: the Secret's namespace and name. Only with `--tls-secret`.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub tls_lease: Option<ObjectRef>,
    /// `namespace/name` of the ConfigMap whose `ca.crt` the brain publishes its CA bundle in (the
    /// current CA and, until it expires, the previous one), for actuators to verify it with.
    /// Default: the Secret's namespace, name `<secret>-ca`. Only with `--tls-secret`.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub ca_configmap: Option<ObjectRef>,
    /// Names of the managed serving certificate (DNS or IP SANs; the first is also its common
    /// name); actuators verify the brain for one of them. Default: `splitproxy-brain`.
    /// Comma-separated. Only with `--tls-secret`.
    #[arg(long, value_delimiter = ',')]
    pub tls_server_name: Vec<String>,
    /// Lifetime of the managed CA (`90d`, `2160h`, `30m`, `45s`); a new one is made after two
    /// thirds of it. Default: 1825d. Only with `--tls-secret`.
    #[arg(long, value_parser = parse_duration)]
    pub tls_ca_validity: Option<Duration>,
    /// Lifetime of the managed serving certificate (never past its CA's); a new one is issued
    /// after two thirds of it. Default: 90d. Only with `--tls-secret`.
    #[arg(long, value_parser = parse_duration)]
    pub tls_cert_validity: Option<Duration>,
    /// CA that signs client (actuator and operator) certificates (PEM). Optional: without it
    /// the brain asks for no client certificate and callers authenticate with bearer tokens
    /// (`--token-audience`); with it, a client certificate identifies its caller first.
    #[arg(long)]
    pub client_ca: Option<PathBuf>,
    /// Sign the PodCertificateRequests of this signer name (for example `splitproxy.io/node`)
    /// with the brain's own CA, for the actuators of `--node-service-account`, and trust that CA
    /// for client certificates (node certificates from the kubelet, mTLS as with files). Needs
    /// `--tls-secret` and `--node-service-account`; not with `--client-ca`.
    #[arg(long, value_name = "DOMAIN/PATH")]
    pub pod_certificate_signer: Option<String>,
    /// Audience of the bearer tokens callers may send (gRPC metadata `authorization: Bearer
    /// <token>`), checked with TokenReview. Empty disables tokens (then `--client-ca` is
    /// required).
    #[arg(long, default_value = crate::tokens::DEFAULT_AUDIENCE)]
    pub token_audience: String,
    /// `<namespace>/<name>` of the actuators' ServiceAccount: its tokens bound to a pod on a
    /// node (`authentication.kubernetes.io/node-name`) get the node role for that node only.
    /// Without it no token gets the node role.
    #[arg(long)]
    pub node_service_account: Option<crate::tokens::ServiceAccountRef>,
    /// Service CIDRs: unallocated addresses inside them are dropped (Services are served
    /// whatever range their ClusterIPs come from). Repeatable or comma-separated. When unset, the brain follows the cluster's
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
    #[arg(long, default_value_t = DEFAULT_MAX_CONCURRENT_SNAPSHOTS)]
    pub max_concurrent_snapshots: usize,
    /// Set elements per message: larger snapshots and deltas are sent in parts of this size,
    /// which every node joins and applies as one transaction. Keeps every message (and every
    /// stream's encode buffer) small: each stream's buffers follow the largest message it
    /// carried, so at 5,000 nodes 2,048 elements (about 80 KB) cost the brain 1,100 MiB, 1,024
    /// cost 720 MiB with the same churn latency, and 512 saved no more but added 0.4 s to it.
    #[arg(long, default_value_t = DEFAULT_UPDATE_PART_ELEMENTS)]
    pub update_part_elements: usize,
    /// Minimum time between two publications of desired state (milliseconds). Changes within
    /// it are folded into one update per node, like kube-proxy's minimum sync period.
    #[arg(long, default_value_t = DEFAULT_MIN_PUBLISH_INTERVAL_MS)]
    pub min_publish_interval_ms: u64,
    /// Threads serving the nodes' connections (TLS, HTTP/2, the sessions' fan-out); 0 (the
    /// default): one per CPU this process may use. The watches and the index have a thread of
    /// their own besides. Set it to the CPUs the brain should take when it shares its machine:
    /// fewer threads cost less CPU under churn but get a smaller share of contended cores
    /// (docs/performance.md, "How many threads serve the nodes").
    #[arg(long, default_value_t = 0)]
    pub worker_threads: usize,
    /// After --min-publish-interval-ms, a publication also waits (up to 1 s after the last one)
    /// until no more than this share (0 to 1) of the nodes has yet to ack the last one, so that
    /// an overloaded fan-out is not handed the next publication before it reached most nodes
    /// (docs/performance.md: at 10,000 nodes churn's p99 fell from 4.5-6.7 s to 1.5-1.7 s). A
    /// change after a quiet period is not held. 1: no wait.
    #[arg(long, default_value_t = crate::pacing::DEFAULT_WHEN_UNSETTLED, value_parser = crate::pacing::parse_share)]
    pub publish_when_unsettled: f64,
    /// Certificate Organization (group) whose members are nodes: they may open `Sync` for the
    /// node their common name or DNS SAN names, and read only that node's state.
    #[arg(long, default_value = crate::auth::DEFAULT_NODE_GROUP)]
    pub node_group: String,
    /// Certificate Organization (group) whose members are operators: they may call the
    /// introspection RPCs (`ListNodes`, `GetNodeRuleset` of any node), and may not open `Sync`.
    #[arg(long, default_value = crate::auth::DEFAULT_OPERATOR_GROUP)]
    pub operator_group: String,
    /// A TLS handshake not done within this time (milliseconds) is abandoned and counted.
    #[arg(long, default_value_t = DEFAULT_TLS_HANDSHAKE_TIMEOUT_MS)]
    pub tls_handshake_timeout_ms: u64,
    /// gRPC connections held at once, handshaking or established; more are closed at once.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// gRPC connections held at once from one peer address. Raise it when nodes reach the brain
    /// through a source NAT.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS_PER_IP)]
    pub max_connections_per_ip: usize,
    /// How long the brain may go without a confirmed contact with the API server (a watch
    /// event, or an answer to its probe) before it stops claiming to be current (milliseconds):
    /// past it, /readyz and gRPC health turn, ListNodes says stale, and node streams are closed
    /// and refused so that nodes move to a replica that is current ("never silently stale").
    #[arg(long, default_value_t = DEFAULT_API_STALENESS_BOUND_MS)]
    pub api_staleness_bound_ms: u64,
    /// How often the brain probes the API server (`GET /version`, milliseconds), so that an
    /// idle cluster, whose watches carry nothing, is not taken for a partition. While the API
    /// server does not answer, it probes eight times as often, to resume as soon as it does.
    #[arg(long, default_value_t = DEFAULT_API_PROBE_INTERVAL_MS)]
    pub api_probe_interval_ms: u64,
    /// Write the addresses actually bound (`grpc=ADDR`, `metrics=ADDR`) to this file once
    /// listening; with port 0 this lets a supervisor learn the ports without races.
    #[arg(long)]
    pub bound_address_file: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    pub log_format: String,
}

/// Everything the brain runs with, typed. Built once from the flags ([`BrainConfig::try_from`]);
/// test code builds it directly and spawns a brain with [`BrainConfig::to_args`].
#[derive(Debug, Clone)]
pub struct BrainConfig {
    /// `--kubeconfig`; in-cluster configuration when `None`.
    pub kubeconfig: Option<PathBuf>,
    /// `--listen`: the gRPC address.
    pub listen: SocketAddr,
    /// Where the server's certificate and key come from, and the CA of its clients.
    pub tls: TlsConfig,
    /// `--metrics-bind-address`.
    pub metrics_bind_address: SocketAddr,
    /// `--bound-address-file`.
    pub bound_address_file: Option<PathBuf>,
    /// `--log-format`: `text` or `json` (see [`splitproxy_proto::process::init_logging`]).
    pub log_format: String,
    /// What the rulesets say: the kube-proxy-like flags and the table name.
    pub rules: RulesConfig,
    /// How the brain paces and sizes its work.
    pub tuning: Tuning,
    /// Who may call what, and the listener's bounds.
    pub surface: Surface,
}

/// The gRPC surface: the groups that carry the node and operator roles ([`crate::auth`]), how
/// bearer tokens map to them ([`crate::tokens`]) and the listener's bounds
/// ([`crate::listener`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Surface {
    /// `--node-group` and `--operator-group`.
    pub groups: crate::auth::Groups,
    /// `--token-audience` and `--node-service-account`.
    pub tokens: crate::tokens::TokenSettings,
    /// `--tls-handshake-timeout-ms`, `--max-connections`, `--max-connections-per-ip`.
    pub limits: crate::listener::Limits,
}

impl Default for Surface {
    fn default() -> Self {
        Surface {
            groups: crate::auth::Groups::default(),
            tokens: crate::tokens::TokenSettings::default(),
            limits: crate::listener::Limits {
                handshake_timeout: Duration::from_millis(DEFAULT_TLS_HANDSHAKE_TIMEOUT_MS),
                max_connections: DEFAULT_MAX_CONNECTIONS,
                max_connections_per_ip: DEFAULT_MAX_CONNECTIONS_PER_IP,
            },
        }
    }
}

impl Surface {
    /// The flags that give a brain this surface (see [`BrainConfig::to_args`]).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "--node-group".into(),
            self.groups.node.clone(),
            "--operator-group".into(),
            self.groups.operator.clone(),
            // An empty audience (tokens disabled) is an empty argument.
            "--token-audience".into(),
            self.tokens.audience.clone(),
            "--tls-handshake-timeout-ms".into(),
            self.limits.handshake_timeout.as_millis().to_string(),
            "--max-connections".into(),
            self.limits.max_connections.to_string(),
            "--max-connections-per-ip".into(),
            self.limits.max_connections_per_ip.to_string(),
        ];
        if let Some(account) = &self.tokens.node_service_account {
            args.push("--node-service-account".into());
            args.push(account.to_string());
        }
        args
    }
}

/// The gRPC server's TLS: its own certificate and key, the CA of its clients, and whether
/// callers must present a client certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    /// Where the serving certificate and key come from.
    pub serving: Serving,
    /// `--client-ca`: without it no client certificate is asked for.
    pub client_ca: Option<PathBuf>,
    /// Whether a caller may complete the handshake without a client certificate although
    /// `client_ca` is set: true when bearer tokens are enabled (`--token-audience` not empty),
    /// so token callers and certificate callers share the listener. Follows from the flags.
    pub client_cert_optional: bool,
    /// `--pod-certificate-signer`: the brain signs the nodes' PodCertificateRequests with its own
    /// CA and trusts that CA for client certificates.
    pub pod_certificate_signer: Option<String>,
}

/// Where the serving certificate and key come from: exactly one of the two.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Serving {
    /// `--tls-cert` and `--tls-key`: PEM files someone else issues, reread when they change.
    Files { cert: PathBuf, key: PathBuf },
    /// `--tls-secret` and its companions: the brain's own CA and certificate ([`crate::pki`]).
    Managed(ManagedTls),
}

/// The brain's own CA and serving certificate ([`crate::pki`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagedTls {
    /// `--tls-secret`: the CA, its key and the serving certificate and key.
    pub secret: ObjectRef,
    /// `--tls-lease`: who may write the Secret and the ConfigMap.
    pub lease: ObjectRef,
    /// `--ca-configmap`: the published CA bundle (`ca.crt`).
    pub ca_configmap: ObjectRef,
    /// `--tls-server-name`: the serving certificate's names (never empty).
    pub server_names: Vec<String>,
    /// `--tls-ca-validity`.
    pub ca_validity: Duration,
    /// `--tls-cert-validity`.
    pub cert_validity: Duration,
}

impl ManagedTls {
    /// A Secret managed with the defaults: the Lease of the same name, the ConfigMap
    /// `<secret>-ca`, the default server name and lifetimes.
    pub fn with_defaults(secret: ObjectRef) -> ManagedTls {
        ManagedTls {
            lease: secret.clone(),
            ca_configmap: ObjectRef {
                namespace: secret.namespace.clone(),
                name: format!("{}-ca", secret.name),
            },
            secret,
            server_names: vec![DEFAULT_TLS_SERVER_NAME.to_string()],
            ca_validity: DEFAULT_TLS_CA_VALIDITY,
            cert_validity: DEFAULT_TLS_CERT_VALIDITY,
        }
    }
}

/// A namespaced object named on the command line as `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectRef {
    pub namespace: String,
    pub name: String,
}

impl std::str::FromStr for ObjectRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(ObjectRef {
                    namespace: ns.to_string(),
                    name: name.to_string(),
                })
            }
            _ => Err(format!("{s:?} is not namespace/name")),
        }
    }
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A lifetime as certificates are usually given one: a whole number of seconds, minutes, hours
/// or days (`45s`, `30m`, `2160h`, `90d`), more than zero.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (at, unit) = s
        .char_indices()
        .last()
        .ok_or_else(|| "empty duration".to_string())?;
    let seconds = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86_400,
        _ => {
            return Err(format!(
                "{s:?}: give a unit, s, m, h or d (for example 90d)"
            ));
        }
    };
    let n: u64 = s[..at]
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number of s, m, h or d"))?;
    match n.checked_mul(seconds) {
        Some(0) => Err(format!("{s:?}: must be more than zero")),
        Some(total) => Ok(Duration::from_secs(total)),
        None => Err(format!("{s:?} is too long")),
    }
}

/// A duration in the form [`parse_duration`] reads, in the largest unit that divides it (whole
/// seconds; anything below a second is dropped, which certificates cannot express anyway).
pub fn format_duration(d: Duration) -> String {
    let secs = d.as_secs();
    for (unit, n) in [('d', 86_400), ('h', 3600), ('m', 60)] {
        if secs > 0 && secs.is_multiple_of(n) {
            return format!("{}{unit}", secs / n);
        }
    }
    format!("{secs}s")
}

/// How the brain paces and sizes its work; the defaults are the flags' defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Tuning {
    /// `--streaming-lists`.
    pub streaming_lists: bool,
    /// `--max-concurrent-snapshots`.
    pub max_concurrent_snapshots: usize,
    /// `--update-part-elements`.
    pub update_part_elements: usize,
    /// `--min-publish-interval-ms`: changes within it are folded into one update per node.
    pub min_publish_interval: Duration,
    /// `--api-staleness-bound-ms`: see [`crate::freshness`].
    pub api_staleness_bound: Duration,
    /// `--api-probe-interval-ms`: see [`crate::freshness`].
    pub api_probe_interval: Duration,
    /// `--worker-threads`: threads serving the nodes' connections; 0 is one per CPU.
    pub worker_threads: usize,
    /// `--publish-when-unsettled`.
    pub publish_when_unsettled: f64,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            streaming_lists: true,
            max_concurrent_snapshots: DEFAULT_MAX_CONCURRENT_SNAPSHOTS,
            update_part_elements: DEFAULT_UPDATE_PART_ELEMENTS,
            min_publish_interval: Duration::from_millis(DEFAULT_MIN_PUBLISH_INTERVAL_MS),
            api_staleness_bound: Duration::from_millis(DEFAULT_API_STALENESS_BOUND_MS),
            api_probe_interval: Duration::from_millis(DEFAULT_API_PROBE_INTERVAL_MS),
            worker_threads: 0,
            publish_when_unsettled: crate::pacing::DEFAULT_WHEN_UNSETTLED,
        }
    }
}

/// A flag value the brain cannot run with.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    NodePortAddresses(String),
    #[error(
        "no way to authenticate callers: give --client-ca, or a non-empty --token-audience (the default)"
    )]
    NoAuthentication,
    #[error("{0}")]
    Tls(String),
}

impl TryFrom<Args> for BrainConfig {
    type Error = ConfigError;

    /// All parsing and defaulting of the flags.
    fn try_from(args: Args) -> Result<Self, Self::Error> {
        let detect_local = args
            .detect_local_mode
            .unwrap_or(if args.cluster_cidrs.is_empty() {
                DetectLocalMode::None
            } else {
                DetectLocalMode::ClusterCidr
            });
        let nodeport_addresses = NodePortAddresses::parse(&args.nodeport_addresses)
            .map_err(ConfigError::NodePortAddresses)?;
        let serving = serving(&args)?;
        let tokens = crate::tokens::TokenSettings {
            audience: args.token_audience,
            node_service_account: args.node_service_account,
        };
        if let Some(signer) = &args.pod_certificate_signer {
            let fail = |m: String| Err(ConfigError::Tls(m));
            if !matches!(serving, Serving::Managed(_)) {
                return fail(
                    "--pod-certificate-signer signs with the brain's own CA: it needs --tls-secret"
                        .into(),
                );
            }
            if args.client_ca.is_some() {
                return fail("--pod-certificate-signer trusts the brain's own CA for client certificates: not with --client-ca".into());
            }
            if tokens.node_service_account.is_none() {
                return fail("--pod-certificate-signer issues to the actuators' account: it needs --node-service-account".into());
            }
            if !valid_signer_name(signer) {
                return fail(format!(
                    "--pod-certificate-signer {signer:?}: a signer name is DOMAIN/PATH, and not kubernetes.io/..."
                ));
            }
        } else if args.client_ca.is_none() && !tokens.enabled() {
            return Err(ConfigError::NoAuthentication);
        }
        Ok(BrainConfig {
            kubeconfig: args.kubeconfig,
            listen: args.listen,
            tls: TlsConfig {
                serving,
                client_ca: args.client_ca,
                client_cert_optional: tokens.enabled(),
                pod_certificate_signer: args.pod_certificate_signer,
            },
            metrics_bind_address: args.metrics_bind_address,
            bound_address_file: args.bound_address_file,
            log_format: args.log_format,
            rules: RulesConfig {
                table: args.table,
                service_cidrs: args.service_cidrs,
                cluster_cidrs: args.cluster_cidrs,
                detect_local,
                pod_interface_name_prefix: args.pod_interface_name_prefix,
                pod_bridge_interface: args.pod_bridge_interface,
                nodeport_addresses,
                masquerade_all: args.masquerade_all,
                service_proxy_name: args.service_proxy_name,
            },
            tuning: Tuning {
                streaming_lists: args.streaming_lists,
                max_concurrent_snapshots: args.max_concurrent_snapshots,
                update_part_elements: args.update_part_elements,
                min_publish_interval: Duration::from_millis(args.min_publish_interval_ms),
                api_staleness_bound: Duration::from_millis(args.api_staleness_bound_ms),
                api_probe_interval: Duration::from_millis(args.api_probe_interval_ms),
                worker_threads: args.worker_threads,
                publish_when_unsettled: args.publish_when_unsettled,
            },
            surface: Surface {
                groups: crate::auth::Groups {
                    node: args.node_group,
                    operator: args.operator_group,
                },
                tokens,
                limits: crate::listener::Limits {
                    handshake_timeout: Duration::from_millis(args.tls_handshake_timeout_ms),
                    max_connections: args.max_connections,
                    max_connections_per_ip: args.max_connections_per_ip,
                },
            },
        })
    }
}

/// Where the serving certificate comes from: the files, or the managed Secret, never both.
/// Whether `name` is a signer name the API server accepts for a PodCertificateRequest:
/// `DOMAIN/PATH`, the domain a DNS name, not Kubernetes' own.
fn valid_signer_name(name: &str) -> bool {
    let Some((domain, path)) = name.split_once('/') else {
        return false;
    };
    !domain.is_empty()
        && !path.is_empty()
        && domain != "kubernetes.io"
        && !domain.ends_with(".kubernetes.io")
        && domain
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && path
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._/".contains(&b))
}

fn serving(args: &Args) -> Result<Serving, ConfigError> {
    let tls = |m: &str| Err(ConfigError::Tls(m.to_string()));
    match (&args.tls_cert, &args.tls_key, &args.tls_secret) {
        (Some(cert), Some(key), None) => {
            let managed_only = args.tls_lease.is_some()
                || args.ca_configmap.is_some()
                || !args.tls_server_name.is_empty()
                || args.tls_ca_validity.is_some()
                || args.tls_cert_validity.is_some();
            if managed_only {
                return tls(
                    "--tls-lease, --ca-configmap, --tls-server-name, --tls-ca-validity and \
                     --tls-cert-validity go with --tls-secret, not with --tls-cert/--tls-key",
                );
            }
            Ok(Serving::Files {
                cert: cert.clone(),
                key: key.clone(),
            })
        }
        (None, None, Some(secret)) => {
            let mut managed = ManagedTls::with_defaults(secret.clone());
            if let Some(lease) = &args.tls_lease {
                managed.lease = lease.clone();
            }
            if let Some(cm) = &args.ca_configmap {
                managed.ca_configmap = cm.clone();
            }
            if !args.tls_server_name.is_empty() {
                if args.tls_server_name.iter().any(String::is_empty) {
                    return tls("--tls-server-name: an empty name");
                }
                managed.server_names = args.tls_server_name.clone();
            }
            if let Some(v) = args.tls_ca_validity {
                managed.ca_validity = v;
            }
            if let Some(v) = args.tls_cert_validity {
                managed.cert_validity = v;
            }
            Ok(Serving::Managed(managed))
        }
        (_, _, Some(_)) => tls("give either --tls-secret or --tls-cert and --tls-key, not both"),
        (Some(_), None, None) | (None, Some(_), None) => {
            tls("--tls-cert and --tls-key go together")
        }
        (None, None, None) => tls("give --tls-cert and --tls-key, or --tls-secret"),
    }
}

impl Serving {
    /// The flags that give a brain this source of its certificate.
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut flag = |name: &str, value: OsString| {
            args.push(name.into());
            args.push(value);
        };
        match self {
            Serving::Files { cert, key } => {
                flag("--tls-cert", cert.into());
                flag("--tls-key", key.into());
            }
            Serving::Managed(m) => {
                flag("--tls-secret", m.secret.to_string().into());
                flag("--tls-lease", m.lease.to_string().into());
                flag("--ca-configmap", m.ca_configmap.to_string().into());
                flag("--tls-server-name", m.server_names.join(",").into());
                flag("--tls-ca-validity", format_duration(m.ca_validity).into());
                flag(
                    "--tls-cert-validity",
                    format_duration(m.cert_validity).into(),
                );
            }
        }
        args
    }
}

impl BrainConfig {
    /// The command-line arguments (without the program name) that give a brain exactly this
    /// configuration. Paths stay `OsString`s, so any path survives.
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut flag = |name: &str, value: OsString| {
            args.push(name.into());
            args.push(value);
        };
        if let Some(k) = &self.kubeconfig {
            flag("--kubeconfig", k.into());
        }
        flag("--listen", self.listen.to_string().into());
        if let Some(ca) = &self.tls.client_ca {
            flag("--client-ca", ca.into());
        }
        if let Some(signer) = &self.tls.pod_certificate_signer {
            flag("--pod-certificate-signer", signer.into());
        }
        flag(
            "--metrics-bind-address",
            self.metrics_bind_address.to_string().into(),
        );
        if let Some(f) = &self.bound_address_file {
            flag("--bound-address-file", f.into());
        }
        flag("--log-format", self.log_format.clone().into());
        args.extend(self.tls.serving.to_args());
        args.extend(self.rules.to_args().into_iter().map(OsString::from));
        args.extend(self.tuning.to_args().into_iter().map(OsString::from));
        args.extend(self.surface.to_args().into_iter().map(OsString::from));
        args
    }
}

impl RulesConfig {
    /// The flags that give a brain these rules (see [`BrainConfig::to_args`]). Empty lists and
    /// strings are left out, which is what their flags' defaults mean.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        let mut flag = |name: &str, value: String| {
            args.push(name.to_string());
            args.push(value);
        };
        flag("--table", self.table.clone());
        if !self.service_cidrs.is_empty() {
            flag("--service-cidr", join(&self.service_cidrs));
        }
        if !self.cluster_cidrs.is_empty() {
            flag("--cluster-cidr", join(&self.cluster_cidrs));
        }
        // Always explicit: the flag's default depends on `--cluster-cidr`.
        flag("--detect-local-mode", value_name(&self.detect_local));
        if !self.pod_interface_name_prefix.is_empty() {
            flag(
                "--pod-interface-name-prefix",
                self.pod_interface_name_prefix.clone(),
            );
        }
        if !self.pod_bridge_interface.is_empty() {
            flag("--pod-bridge-interface", self.pod_bridge_interface.clone());
        }
        flag(
            "--nodeport-addresses",
            match &self.nodeport_addresses {
                NodePortAddresses::Primary => "primary".to_string(),
                // An empty list has no flag form: the brain rejects the empty value.
                NodePortAddresses::Cidrs(nets) => join(nets),
            },
        );
        if !self.service_proxy_name.is_empty() {
            flag("--service-proxy-name", self.service_proxy_name.clone());
        }
        if self.masquerade_all {
            args.push("--masquerade-all".to_string());
        }
        args
    }
}

impl Tuning {
    /// The flags that give a brain this tuning (see [`BrainConfig::to_args`]).
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "--streaming-lists".into(),
            self.streaming_lists.to_string(),
            "--max-concurrent-snapshots".into(),
            self.max_concurrent_snapshots.to_string(),
            "--update-part-elements".into(),
            self.update_part_elements.to_string(),
            "--min-publish-interval-ms".into(),
            self.min_publish_interval.as_millis().to_string(),
            "--api-staleness-bound-ms".into(),
            self.api_staleness_bound.as_millis().to_string(),
            "--api-probe-interval-ms".into(),
            self.api_probe_interval.as_millis().to_string(),
            "--worker-threads".into(),
            self.worker_threads.to_string(),
            "--publish-when-unsettled".into(),
            self.publish_when_unsettled.to_string(),
        ]
    }
}

/// Comma-separated, as the list flags take them.
fn join(nets: &[ipnet::IpNet]) -> String {
    nets.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The name a `ValueEnum` value has on the command line, e.g. `ClusterCIDR`.
fn value_name<T: ValueEnum>(value: &T) -> String {
    // Every variant has a name (none is skipped); an empty one would be rejected loudly.
    value
        .to_possible_value()
        .map(|v| v.get_name().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    fn parse(args: &[OsString]) -> BrainConfig {
        let argv = std::iter::once(OsString::from("splitproxy-brain")).chain(args.iter().cloned());
        BrainConfig::try_from(Args::try_parse_from(argv).unwrap()).unwrap()
    }

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    /// Every field differs from its default, so a field that either direction forgets comes
    /// back as its default and fails the comparison.
    fn everything_set() -> BrainConfig {
        BrainConfig {
            kubeconfig: Some("/k/kubeconfig".into()),
            listen: "127.0.0.2:7443".parse().unwrap(),
            tls: TlsConfig {
                serving: Serving::Files {
                    cert: "/k/cert.pem".into(),
                    key: "/k/key.pem".into(),
                },
                client_ca: Some("/k/ca.pem".into()),
                client_cert_optional: true,
                pod_certificate_signer: None,
            },
            metrics_bind_address: "[::1]:9000".parse().unwrap(),
            bound_address_file: Some("/k/bound".into()),
            log_format: "json".into(),
            rules: RulesConfig {
                table: "other".into(),
                service_cidrs: vec![
                    "10.96.0.0/16".parse().unwrap(),
                    "fd00:96::/112".parse().unwrap(),
                ],
                cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
                detect_local: DetectLocalMode::BridgeInterface,
                pod_interface_name_prefix: "veth".into(),
                pod_bridge_interface: "cbr0".into(),
                nodeport_addresses: NodePortAddresses::Cidrs(vec![
                    "192.168.77.0/24".parse().unwrap(),
                    "fd00:77::/64".parse().unwrap(),
                ]),
                masquerade_all: true,
                service_proxy_name: "sp".into(),
            },
            tuning: Tuning {
                streaming_lists: false,
                max_concurrent_snapshots: 3,
                update_part_elements: 7,
                min_publish_interval: Duration::from_millis(1500),
                api_staleness_bound: Duration::from_millis(4500),
                api_probe_interval: Duration::from_millis(700),
                worker_threads: 3,
                publish_when_unsettled: 1.0,
            },
            surface: Surface {
                groups: crate::auth::Groups {
                    node: "n".into(),
                    operator: "o".into(),
                },
                tokens: crate::tokens::TokenSettings {
                    audience: "aud".into(),
                    node_service_account: Some("kube-system/actuator".parse().unwrap()),
                },
                limits: crate::listener::Limits {
                    handshake_timeout: Duration::from_millis(2500),
                    max_connections: 9,
                    max_connections_per_ip: 4,
                },
            },
        }
    }

    /// [`everything_set`] with the managed certificate instead of files, every part of it
    /// different from its default.
    fn everything_set_managed() -> BrainConfig {
        let mut config = everything_set();
        config.tls.serving = Serving::Managed(ManagedTls {
            secret: "sp/brain-tls".parse().unwrap(),
            lease: "sp/brain-writer".parse().unwrap(),
            ca_configmap: "other/brain-ca".parse().unwrap(),
            server_names: vec!["brain.sp.svc".into(), "10.0.0.1".into()],
            ca_validity: Duration::from_secs(400 * 86_400),
            cert_validity: Duration::from_secs(90),
        });
        config
    }

    #[test]
    fn the_pod_certificate_signer_round_trips_and_needs_its_own_ca() {
        let mut config = everything_set_managed();
        config.tls.client_ca = None;
        config.tls.pod_certificate_signer = Some("splitproxy.io/node".into());
        let again = parse(&config.to_args());
        assert_eq!(format!("{again:?}"), format!("{config:?}"));
        let base = [
            "--tls-secret=sp/brain-tls",
            "--node-service-account=sp/actuator",
            "--pod-certificate-signer=splitproxy.io/node",
        ];
        let refused = |extra: &[&str], drop: &str| {
            let mut flags: Vec<&str> = base
                .iter()
                .copied()
                .filter(|f| !f.starts_with(drop))
                .collect();
            flags.extend_from_slice(extra);
            let args = Args::try_parse_from(
                std::iter::once("splitproxy-brain").chain(flags.iter().copied()),
            )
            .unwrap();
            BrainConfig::try_from(args).err().map(|e| e.to_string())
        };
        assert_eq!(refused(&[], "--none"), None);
        for (extra, drop, mention) in [
            (
                &["--tls-cert=/c", "--tls-key=/k"][..],
                "--tls-secret",
                "--tls-secret",
            ),
            (&["--client-ca=/ca"][..], "--none", "--client-ca"),
            (&[][..], "--node-service-account", "--node-service-account"),
            (
                &["--pod-certificate-signer=kubernetes.io/x"][..],
                "--pod-certificate-signer",
                "DOMAIN/PATH",
            ),
        ] {
            let err =
                refused(extra, drop).unwrap_or_else(|| panic!("accepted {extra:?} without {drop}"));
            assert!(err.contains(mention), "{err}");
        }
    }

    #[test]
    fn flags_round_trip_through_the_typed_config() {
        let expected = everything_set();
        // Args -> config, from flags written by hand.
        let by_hand = parse(&os(&[
            "--kubeconfig=/k/kubeconfig",
            "--listen=127.0.0.2:7443",
            "--tls-cert=/k/cert.pem",
            "--tls-key=/k/key.pem",
            "--client-ca=/k/ca.pem",
            "--metrics-bind-address=[::1]:9000",
            "--bound-address-file=/k/bound",
            "--log-format=json",
            "--table=other",
            "--service-cidr=10.96.0.0/16",
            "--service-cidr=fd00:96::/112",
            "--cluster-cidr=10.244.0.0/16",
            "--detect-local-mode=BridgeInterface",
            "--pod-interface-name-prefix=veth",
            "--pod-bridge-interface=cbr0",
            "--nodeport-addresses=192.168.77.0/24,fd00:77::/64",
            "--masquerade-all",
            "--service-proxy-name=sp",
            "--streaming-lists=false",
            "--max-concurrent-snapshots=3",
            "--update-part-elements=7",
            "--min-publish-interval-ms=1500",
            "--worker-threads=3",
            "--publish-when-unsettled=1",
            "--node-group=n",
            "--operator-group=o",
            "--token-audience=aud",
            "--node-service-account=kube-system/actuator",
            "--tls-handshake-timeout-ms=2500",
            "--max-connections=9",
            "--max-connections-per-ip=4",
            "--api-staleness-bound-ms=4500",
            "--api-probe-interval-ms=700",
        ]));
        assert_eq!(format!("{by_hand:?}"), format!("{expected:?}"));
        // config -> args -> config.
        let rendered = expected.to_args();
        let again = parse(&rendered);
        assert_eq!(format!("{again:?}"), format!("{expected:?}"));
        // The same with the managed certificate, whose flags exclude the files': by hand (the
        // other flags as rendered above), and config -> args -> config.
        let managed = everything_set_managed();
        let mut others = Vec::new();
        let mut rest = rendered.iter();
        while let Some(a) = rest.next() {
            if a == "--tls-cert" || a == "--tls-key" {
                rest.next();
            } else {
                others.push(a.clone());
            }
        }
        let by_hand_tls = parse(
            &[
                others,
                os(&[
                    "--tls-secret=sp/brain-tls",
                    "--tls-lease=sp/brain-writer",
                    "--ca-configmap=other/brain-ca",
                    "--tls-server-name=brain.sp.svc,10.0.0.1",
                    "--tls-ca-validity=400d",
                    "--tls-cert-validity=90s",
                ]),
            ]
            .concat(),
        );
        assert_eq!(
            format!("{:?}", parse(&managed.to_args())),
            format!("{managed:?}")
        );
        assert_eq!(format!("{by_hand_tls:?}"), format!("{managed:?}"));
        // Every flag the brain has is rendered (by one of the two sources, or with the pod
        // certificate signer): one added to `Args` but not to `to_args` fails.
        let mut signing = managed.clone();
        signing.tls.client_ca = None;
        signing.tls.pod_certificate_signer = Some("splitproxy.io/node".into());
        let rendered: Vec<String> = rendered
            .iter()
            .chain(&managed.to_args())
            .chain(&signing.to_args())
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        for arg in Args::command().get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if matches!(long, "help" | "version") {
                continue;
            }
            assert!(
                rendered.contains(&format!("--{long}")),
                "--{long} is not rendered by to_args: {rendered:?}"
            );
        }
    }

    #[test]
    fn defaults_are_the_flags_defaults() {
        let tls = os(&["--tls-cert=c", "--tls-key=k", "--client-ca=a"]);
        let config = parse(&tls);
        assert_eq!(config.listen, "0.0.0.0:9443".parse().unwrap());
        assert_eq!(
            config.metrics_bind_address,
            "127.0.0.1:10249".parse().unwrap()
        );
        assert_eq!(config.log_format, "text");
        assert_eq!(config.tuning, Tuning::default());
        assert_eq!(config.surface, Surface::default());
        assert_eq!(
            format!("{:?}", config.rules),
            format!("{:?}", RulesConfig::default())
        );
        assert_eq!(
            format!("{:?}", parse(&config.to_args())),
            format!("{config:?}")
        );
        // detect-local mode: ClusterCIDR once there is a cluster CIDR.
        let with_cidr = parse(&[tls.clone(), os(&["--cluster-cidr=10.244.0.0/16"])].concat());
        assert_eq!(with_cidr.rules.detect_local, DetectLocalMode::ClusterCidr);
        let explicit = parse(
            &[
                tls.clone(),
                os(&[
                    "--cluster-cidr=10.244.0.0/16",
                    "--detect-local-mode=NodeCIDR",
                ]),
            ]
            .concat(),
        );
        assert_eq!(explicit.rules.detect_local, DetectLocalMode::NodeCidr);
    }

    /// `--client-ca` is optional when tokens are on; with it and tokens, a certificate is
    /// optional in the handshake; without tokens it is required; with neither the brain cannot
    /// authenticate anybody and refuses to start.
    #[test]
    fn client_ca_and_tokens_decide_how_callers_authenticate() {
        let tokens_only = parse(&os(&["--tls-cert=c", "--tls-key=k"]));
        assert_eq!(tokens_only.tls.client_ca, None);
        assert_eq!(tokens_only.surface.tokens.audience, "splitproxy");
        assert!(tokens_only.surface.tokens.enabled());
        assert_eq!(
            format!("{:?}", parse(&tokens_only.to_args())),
            format!("{tokens_only:?}")
        );
        let both = parse(&os(&["--tls-cert=c", "--tls-key=k", "--client-ca=a"]));
        assert!(both.tls.client_cert_optional);
        let certs_only = parse(&os(&[
            "--tls-cert=c",
            "--tls-key=k",
            "--client-ca=a",
            "--token-audience=",
        ]));
        assert!(!certs_only.surface.tokens.enabled());
        assert!(!certs_only.tls.client_cert_optional);
        assert_eq!(
            format!("{:?}", parse(&certs_only.to_args())),
            format!("{certs_only:?}")
        );
        let neither =
            Args::try_parse_from(["b", "--tls-cert=c", "--tls-key=k", "--token-audience="])
                .unwrap();
        assert!(matches!(
            BrainConfig::try_from(neither),
            Err(ConfigError::NoAuthentication)
        ));
        for bad in ["nons", "/x", "x/", "a/b/c"] {
            assert!(
                Args::try_parse_from([
                    "b",
                    "--tls-cert=c",
                    "--tls-key=k",
                    &format!("--node-service-account={bad}"),
                ])
                .is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_managed_certificate_has_defaults_and_excludes_the_files() {
        let config = parse(&os(&["--tls-secret=kube-system/sp-tls", "--client-ca=a"]));
        let Serving::Managed(m) = &config.tls.serving else {
            panic!("{config:?}")
        };
        assert_eq!(m.secret.to_string(), "kube-system/sp-tls");
        assert_eq!(m.lease.to_string(), "kube-system/sp-tls");
        assert_eq!(m.ca_configmap.to_string(), "kube-system/sp-tls-ca");
        assert_eq!(m.server_names, [DEFAULT_TLS_SERVER_NAME]);
        assert_eq!(m.ca_validity, Duration::from_secs(1825 * 86_400));
        assert_eq!(m.cert_validity, Duration::from_secs(90 * 86_400));
        assert_eq!(
            format!("{:?}", parse(&config.to_args())),
            format!("{config:?}")
        );
        let refused = |args: &[&str]| {
            let argv = std::iter::once("splitproxy-brain").chain(args.iter().copied());
            match Args::try_parse_from(argv) {
                Err(e) => e.to_string(),
                Ok(args) => BrainConfig::try_from(args).unwrap_err().to_string(),
            }
        };
        for (args, why) in [
            (
                &["--client-ca=a"][..],
                "give --tls-cert and --tls-key, or --tls-secret",
            ),
            (&["--client-ca=a", "--tls-cert=c"], "go together"),
            (
                &[
                    "--client-ca=a",
                    "--tls-cert=c",
                    "--tls-key=k",
                    "--tls-secret=a/b",
                ],
                "not both",
            ),
            (
                &[
                    "--client-ca=a",
                    "--tls-cert=c",
                    "--tls-key=k",
                    "--tls-cert-validity=1d",
                ],
                "go with --tls-secret",
            ),
            (
                &["--client-ca=a", "--tls-secret=nonamespace"],
                "namespace/name",
            ),
            (
                &["--client-ca=a", "--tls-secret=a/b", "--tls-ca-validity=5y"],
                "unit",
            ),
            (
                &["--client-ca=a", "--tls-secret=a/b", "--tls-ca-validity=0d"],
                "more than zero",
            ),
        ] {
            let err = refused(args);
            assert!(err.contains(why), "{args:?}: {err}");
        }
    }

    #[test]
    fn durations_round_trip_in_their_largest_unit() {
        for (text, secs) in [
            ("45s", 45),
            ("90m", 5400),
            ("2160h", 90 * 86_400),
            ("90d", 90 * 86_400),
            ("1825d", 1825 * 86_400),
        ] {
            let d = parse_duration(text).unwrap();
            assert_eq!(d, Duration::from_secs(secs), "{text}");
            assert_eq!(parse_duration(&format_duration(d)).unwrap(), d);
        }
        assert_eq!(format_duration(Duration::from_secs(90 * 86_400)), "90d");
        assert_eq!(format_duration(Duration::from_secs(61)), "61s");
        for bad in ["", "d", "-1d", "1.5h", "10", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn bad_nodeport_addresses_are_refused() {
        let args = Args::try_parse_from([
            "splitproxy-brain",
            "--tls-cert=c",
            "--tls-key=k",
            "--client-ca=a",
            "--nodeport-addresses=10.0.0.0/8,nonsense",
        ])
        .unwrap();
        let err = BrainConfig::try_from(args).unwrap_err();
        assert!(err.to_string().contains("nonsense"), "{err}");
    }
}
