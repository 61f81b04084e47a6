//! Command-line flags, and the typed [`Config`] they become once, at start. Where a flag means
//! what a kube-proxy flag means, it has its name; the test harness and the lab spawn the
//! binary with these flags, so their names and meanings do not change.
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use http::Uri;

use crate::client::ClientConfig;
use crate::credentials::{CertFiles, Credentials};
use crate::discovery::DiscoveryConfig;
use crate::healthcheck;

/// The name the brain's certificate carries when brains are discovered (the brain's
/// `--tls-server-name` default): their addresses are IPs, which it does not name.
pub const DEFAULT_BRAIN_SERVER_NAME: &str = "splitproxy-brain";

#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "splitproxy-actuator",
    version,
    about = "splitproxy actuator: applies the brain's ruleset deltas to this node's nftables over netlink"
)]
pub struct Args {
    /// Brain addresses (https://host:port); each node prefers one by rendezvous hashing of its
    /// name, and tries the others in its own order when a stream fails. Repeatable or
    /// comma-separated. Optional with --brain-service; both together: the union.
    #[arg(long = "brain", value_delimiter = ',')]
    pub brains: Vec<String>,
    /// The brains' headless Service, NAMESPACE/NAME: brains are found by listing its
    /// EndpointSlices (ready addresses, the port --brain-port-name) at start and whenever every
    /// known brain failed. Never a watch, never DNS or a ClusterIP.
    #[arg(long)]
    pub brain_service: Option<String>,
    /// The name of the brains' gRPC port in the Service (empty: its unnamed port).
    #[arg(long, default_value = "grpc")]
    pub brain_port_name: String,
    /// kubeconfig for listing the EndpointSlices; in-cluster configuration (the pod's
    /// ServiceAccount) when absent.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Name the brain's certificate must carry (defaults to each address's host, or to
    /// `splitproxy-brain` with --brain-service, whose addresses are IPs).
    #[arg(long)]
    pub brain_server_name: Option<String>,
    /// This node's name; must match the client certificate or the token's node.
    #[arg(long = "hostname-override", env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// CA that signed the brain's certificate (PEM), read again at every connection.
    #[arg(long, required_unless_present = "cleanup")]
    pub ca: Option<PathBuf>,
    /// Client certificate naming this node (PEM); with --tls-key. Read at every connection.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// Client private key (PEM); with --tls-cert.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// A projected ServiceAccount token (audience `splitproxy`), sent as
    /// `authorization: Bearer`; read again for every request, so the kubelet's rotations are
    /// used without a restart. This, or --tls-cert and --tls-key, or both.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Name of the nftables tables this actuator owns (`ip NAME`, `ip6 NAME`); it refuses to
    /// touch any other.
    #[arg(long, default_value = "splitproxy")]
    pub table: String,
    /// /healthz and /readyz (every node address by default, for load balancers' health checks).
    #[arg(long = "healthz-bind-address", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: SocketAddr,
    /// /metrics, served there only (loopback by default). When it equals the healthz address,
    /// that one server answers both.
    #[arg(long = "metrics-bind-address", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: SocketAddr,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    pub log_format: String,
    /// How often the kernel's tables are checked against the applied model: a generation
    /// read (microseconds), and a read of the tables only when someone else committed
    /// (kernel is the truth, docs/invariants.md). `500ms`, `1s`, `2m`, or seconds.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub reconcile_interval: Duration,
    /// Delete this node's `ip` and `ip6` tables named --table (and nothing else), then exit:
    /// what is left on a node after `helm uninstall` (kube-proxy's --cleanup). Every other
    /// flag is ignored.
    #[arg(long)]
    pub cleanup: bool,
}

/// `500ms`, `10s`, `2m`, or a plain number of seconds; more than zero.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let (number, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a duration such as 500ms, 10s or 2m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("{s:?}: unit must be ms, s or m")),
    };
    if !(secs > 0.0 && secs < 86_400.0) {
        return Err(format!("{s:?} must be more than 0 and less than a day"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// What [`crate::run::run`] takes: the flags resolved and checked once, so that tests and the
/// lab can build it directly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// This node's name (--hostname-override, NODE_NAME, or the hostname).
    pub node: String,
    /// Static brain addresses (`--brain`), tried in this node's order (`client::brain_order`)
    /// together with those discovered; empty only with `discovery`.
    pub brains: Vec<Uri>,
    /// How brains are found through the API server (`--brain-service`).
    pub discovery: Option<DiscoveryConfig>,
    /// Name the brain's certificate must carry (defaults to each address's host).
    pub brain_server_name: Option<String>,
    /// The CA, the client certificate and the token (read again when used).
    pub credentials: Credentials,
    /// Name of the tables this actuator owns (own table only, docs/invariants.md).
    pub table: String,
    pub healthz_bind_address: SocketAddr,
    /// May equal `healthz_bind_address`, which then serves both.
    pub metrics_bind_address: SocketAddr,
    /// Where the health check servers listen while the model names no NodePort address
    /// (not a flag: [`healthcheck::DEFAULT_ADDRESSES`]).
    pub health_check_addresses: Vec<IpAddr>,
    /// How often the kernel's tables are checked against the model (reconcile.rs).
    pub reconcile_interval: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("no brain to connect to: give --brain addresses, or --brain-service NAMESPACE/NAME")]
    NoBrain,
    #[error("--brain-service: {0}")]
    BrainService(String),
    #[error("no credential for the brain: give --token-file, or --tls-cert and --tls-key, or both")]
    NoCredential,
    #[error("--tls-cert and --tls-key go together; only {0} was given")]
    HalfKeyPair(&'static str),
    #[error("brain address {address:?}: {source}")]
    Brain {
        address: String,
        source: http::uri::InvalidUri,
    },
    #[error("reading the hostname (or pass --hostname-override): {0}")]
    Hostname(io::Error),
    #[error("the hostname is empty; pass --hostname-override")]
    EmptyHostname,
    #[error("--ca is required (the CA of the brains' certificate)")]
    NoCa,
}

impl TryFrom<Args> for Config {
    type Error = ConfigError;

    fn try_from(args: Args) -> Result<Self, ConfigError> {
        Config::resolve(args, || {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
        })
    }
}

impl Config {
    /// `args` made typed; `hostname` is asked only when no node name was given.
    fn resolve(
        args: Args,
        hostname: impl FnOnce() -> io::Result<String>,
    ) -> Result<Self, ConfigError> {
        let node = match args.node_name.filter(|n| !n.is_empty()) {
            Some(n) => n,
            None => {
                let h = hostname().map_err(ConfigError::Hostname)?;
                let h = h.trim();
                if h.is_empty() {
                    return Err(ConfigError::EmptyHostname);
                }
                h.to_owned()
            }
        };
        let brains = args
            .brains
            .iter()
            .map(|address| {
                address.parse::<Uri>().map_err(|source| ConfigError::Brain {
                    address: address.clone(),
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let discovery = args
            .brain_service
            .as_deref()
            .map(|s| {
                Ok::<_, ConfigError>(DiscoveryConfig {
                    service: s.parse().map_err(ConfigError::BrainService)?,
                    port_name: args.brain_port_name.clone(),
                    kubeconfig: args.kubeconfig.clone(),
                })
            })
            .transpose()?;
        if brains.is_empty() && discovery.is_none() {
            return Err(ConfigError::NoBrain);
        }
        let client_cert = match (args.tls_cert, args.tls_key) {
            (Some(cert), Some(key)) => Some(CertFiles { cert, key }),
            (None, None) => None,
            (Some(_), None) => return Err(ConfigError::HalfKeyPair("--tls-cert")),
            (None, Some(_)) => return Err(ConfigError::HalfKeyPair("--tls-key")),
        };
        if client_cert.is_none() && args.token_file.is_none() {
            return Err(ConfigError::NoCredential);
        }
        let ca = args.ca.ok_or(ConfigError::NoCa)?;
        // Discovered addresses are IPs, which the brain's certificate does not name.
        let brain_server_name = args.brain_server_name.or_else(|| {
            discovery
                .as_ref()
                .map(|_| DEFAULT_BRAIN_SERVER_NAME.to_owned())
        });
        Ok(Config {
            node,
            brains,
            discovery,
            brain_server_name,
            credentials: Credentials {
                ca,
                client_cert,
                token_file: args.token_file,
            },
            table: args.table,
            healthz_bind_address: args.healthz_bind_address,
            metrics_bind_address: args.metrics_bind_address,
            health_check_addresses: healthcheck::DEFAULT_ADDRESSES.to_vec(),
            reconcile_interval: args.reconcile_interval,
        })
    }

    /// What the brain stream needs of it.
    pub fn client(&self) -> ClientConfig {
        ClientConfig {
            brains: self.brains.clone(),
            discovery: self.discovery.clone(),
            server_name: self.brain_server_name.clone(),
            node: self.node.clone(),
            credentials: self.credentials.clone(),
            tls: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn cleanup_needs_no_brain_flags_and_everything_else_needs_the_ca() {
        let a =
            Args::try_parse_from(["splitproxy-actuator", "--cleanup", "--table", "sp"]).unwrap();
        assert!(a.cleanup);
        assert_eq!(a.table, "sp");
        let e =
            Args::try_parse_from(["splitproxy-actuator", "--brain", "https://b:9443"]).unwrap_err();
        assert!(e.to_string().contains("--ca"), "{e}");
        assert!(!args(&[]).cleanup);
    }

    fn args(extra: &[&str]) -> Args {
        let base = [
            "splitproxy-actuator",
            "--brain",
            "https://10.0.0.1:9443,https://[fd00::1]:9443",
            "--ca",
            "/etc/sp/ca.pem",
            "--tls-cert",
            "/etc/sp/node.pem",
            "--tls-key",
            "/etc/sp/node.key",
        ];
        Args::try_parse_from(base.iter().chain(extra)).unwrap()
    }

    fn no_hostname() -> io::Result<String> {
        panic!("the hostname is read only when no node name is given")
    }

    #[test]
    fn flags_become_a_typed_config() {
        let c = Config::resolve(
            args(&[
                "--hostname-override",
                "node-1",
                "--brain",
                "https://b:1",
                "--table",
                "t",
                "--metrics-bind-address",
                "0.0.0.0:10256",
            ]),
            no_hostname,
        )
        .unwrap();
        assert_eq!(c.node, "node-1");
        let brains: Vec<String> = c.brains.iter().map(Uri::to_string).collect();
        assert_eq!(
            brains,
            vec![
                "https://10.0.0.1:9443/",
                "https://[fd00::1]:9443/",
                "https://b:1/"
            ]
        );
        assert_eq!(
            c.credentials.client_cert.as_ref().unwrap().cert,
            PathBuf::from("/etc/sp/node.pem")
        );
        assert_eq!(c.credentials.token_file, None);
        assert_eq!(
            (c.discovery.as_ref(), c.brain_server_name.as_deref()),
            (None, None)
        );
        assert_eq!(c.table, "t");
        assert_eq!(c.healthz_bind_address, c.metrics_bind_address);
        assert_eq!(c.health_check_addresses, healthcheck::DEFAULT_ADDRESSES);
        let client = c.client();
        assert_eq!((client.node.as_str(), client.brains.len()), ("node-1", 3));
        assert_eq!(client.credentials, c.credentials);
        assert_eq!(c.reconcile_interval, Duration::from_secs(1));
    }

    #[test]
    fn the_reconcile_interval_takes_units() {
        for (flag, want) in [
            ("500ms", Duration::from_millis(500)),
            ("10s", Duration::from_secs(10)),
            ("2m", Duration::from_secs(120)),
            ("3", Duration::from_secs(3)),
        ] {
            let c = Config::resolve(
                args(&["--hostname-override", "n", "--reconcile-interval", flag]),
                no_hostname,
            )
            .unwrap();
            assert_eq!(c.reconcile_interval, want, "{flag}");
        }
        for bad in ["0s", "-1s", "1h", "soon"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_node_name_falls_back_to_the_hostname() {
        // NODE_NAME may be set where the tests run: the flag's value is set here instead.
        let unnamed = |name: Option<&str>| Args {
            node_name: name.map(str::to_owned),
            ..args(&[])
        };
        let c = Config::resolve(unnamed(None), || Ok("worker-7\n".to_owned())).unwrap();
        assert_eq!(c.node, "worker-7");
        let c = Config::resolve(unnamed(Some("")), || Ok("w".to_owned()));
        assert_eq!(c.unwrap().node, "w");
        assert!(matches!(
            Config::resolve(unnamed(None), || Ok(" \n".to_owned())),
            Err(ConfigError::EmptyHostname)
        ));
        assert!(matches!(
            Config::resolve(unnamed(None), || Err(io::ErrorKind::NotFound.into())),
            Err(ConfigError::Hostname(_))
        ));
    }

    #[test]
    fn a_malformed_brain_address_is_refused_at_start() {
        let e = Config::resolve(
            args(&["--hostname-override", "n", "--brain", "https://a b"]),
            no_hostname,
        )
        .unwrap_err();
        assert!(
            matches!(&e, ConfigError::Brain { address, .. } if address == "https://a b"),
            "{e}"
        );
    }

    /// Without a Service to find brains in, static addresses are needed; with one, they are
    /// optional, and the brain's name defaults to the brain's serving certificate name.
    #[test]
    fn brains_come_from_addresses_or_a_service() {
        let base = |extra: &[&str]| {
            let argv = ["splitproxy-actuator", "--ca", "/ca", "--token-file", "/t"];
            Args::try_parse_from(argv.iter().chain(extra)).unwrap()
        };
        assert!(matches!(
            Config::resolve(base(&["--hostname-override", "n"]), no_hostname),
            Err(ConfigError::NoBrain)
        ));
        let c = Config::resolve(
            base(&[
                "--hostname-override",
                "n",
                "--brain-service",
                "kube-system/splitproxy-brain",
            ]),
            no_hostname,
        )
        .unwrap();
        let d = c.discovery.clone().unwrap();
        assert_eq!(d.service.to_string(), "kube-system/splitproxy-brain");
        assert_eq!((d.port_name.as_str(), d.kubeconfig), ("grpc", None));
        assert!(c.brains.is_empty());
        assert_eq!(
            c.brain_server_name.as_deref(),
            Some(DEFAULT_BRAIN_SERVER_NAME)
        );
        assert_eq!(c.client().discovery, c.discovery);
        // Both: the union; every flag of discovery taken.
        let c = Config::resolve(
            base(&[
                "--hostname-override",
                "n",
                "--brain",
                "https://10.0.0.1:9443",
                "--brain-service",
                "ns/b",
                "--brain-port-name",
                "rpc",
                "--kubeconfig",
                "/k",
                "--brain-server-name",
                "brain.example",
            ]),
            no_hostname,
        )
        .unwrap();
        let d = c.discovery.unwrap();
        assert_eq!(
            (
                d.port_name.as_str(),
                d.kubeconfig.unwrap().to_str().unwrap()
            ),
            ("rpc", "/k")
        );
        assert_eq!(c.brains.len(), 1);
        assert_eq!(c.brain_server_name.as_deref(), Some("brain.example"));
        let e = Config::resolve(
            base(&[
                "--hostname-override",
                "n",
                "--brain-service",
                "splitproxy-brain",
            ]),
            no_hostname,
        )
        .unwrap_err();
        assert!(matches!(e, ConfigError::BrainService(_)), "{e}");
        assert!(e.to_string().contains("NAMESPACE/NAME"), "{e}");
    }

    /// A token, a key pair, or both; half a key pair is refused, naming what is missing.
    #[test]
    fn credentials_are_a_token_or_a_key_pair() {
        let parse = |extra: &[&str]| {
            let argv = [
                "splitproxy-actuator",
                "--brain",
                "https://b:1",
                "--hostname-override",
                "n",
                "--ca",
                "/ca",
            ];
            Config::resolve(
                Args::try_parse_from(argv.iter().chain(extra)).unwrap(),
                no_hostname,
            )
        };
        let c = parse(&["--token-file", "/var/run/secrets/splitproxy/token"]).unwrap();
        assert_eq!(
            c.credentials.token_file.as_deref(),
            Some(std::path::Path::new("/var/run/secrets/splitproxy/token"))
        );
        assert_eq!(c.credentials.client_cert, None);
        assert_eq!(
            c.brain_server_name, None,
            "static addresses keep their host"
        );
        let c = parse(&["--token-file", "/t", "--tls-cert", "/c", "--tls-key", "/k"]).unwrap();
        assert!(c.credentials.token_file.is_some() && c.credentials.client_cert.is_some());
        assert!(matches!(parse(&[]), Err(ConfigError::NoCredential)));
        let e = parse(&["--tls-cert", "/c"]).unwrap_err();
        assert!(matches!(e, ConfigError::HalfKeyPair("--tls-cert")), "{e}");
        let e = parse(&["--token-file", "/t", "--tls-key", "/k"]).unwrap_err();
        assert!(e.to_string().contains("only --tls-key"), "{e}");
    }
}
