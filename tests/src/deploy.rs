//! splitproxy's own processes for tests and the lab: a brain on host loopback, and actuators
//! inside node namespaces that reach it through a port forwarder (so nothing touches the host's
//! interfaces). Both run from the multi-call `splitproxy-lab` binary (`splitproxy-lab brain ...`
//! is exactly `splitproxy-brain ...`), which lets integration tests spawn real processes.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};

use crate::Result;
use crate::certs::{Pki, TlsFiles};
use crate::netns::Netns;
use crate::portfwd::{Forwarder, forward_port};
use crate::process::{Child, wait_for};

/// The port actuators use inside their node namespace to reach brain `i` (forwarded).
pub fn brain_port_in_node(i: usize) -> u16 {
    9443 + i as u16
}

/// Where actuators serve /healthz and /readyz inside their node namespace (the address to reach
/// them at from the node).
pub const ACTUATOR_HEALTHZ: &str = "127.0.0.1:10256";

/// What actuators bind for /healthz and /readyz: every address of the node, both families, like
/// kube-proxy's default `0.0.0.0:10256`, so that external clients can health check nodes as load
/// balancers do.
pub const ACTUATOR_HEALTHZ_BIND: &str = "[::]:10256";

/// Where actuators serve /metrics: the node's loopback only, as kube-proxy's default
/// `127.0.0.1:10249` (read from inside the namespace, [`http_get_in`]).
pub const ACTUATOR_METRICS: &str = "127.0.0.1:10249";

/// A brain process listening on host loopback.
pub struct Brain {
    pub child: Child,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    pub tls: TlsFiles,
    /// What it was started with.
    pub config: BrainConfig,
}

// The brain's own configuration types: tests build them directly, and the brain renders them to
// its flags (`BrainConfig::to_args`), so nothing here describes a flag a second time.
pub use splitproxy_brain::config::{BrainConfig, ManagedTls, Serving, Surface, TlsConfig, Tuning};
pub use splitproxy_brain::rules::{DetectLocalMode, NodePortAddresses, RulesConfig};

/// How a brain is started besides its certificates, addresses and API server, which
/// [`Brain::start`] fills in.
#[derive(Debug, Clone)]
pub struct BrainOptions {
    /// What the rulesets say: service CIDRs, the kube-proxy-like settings, the table.
    pub rules: RulesConfig,
    /// How the brain paces and sizes its work.
    pub tuning: Tuning,
    /// Its groups and connection bounds. Default: the brain's, except that one peer address
    /// may hold as many connections as the total bound, because in the harness every node
    /// (real ones through their forwarders, virtual ones directly) connects from 127.0.0.1.
    pub surface: Surface,
    /// Flags a person wrote (lab.yaml's `brainArgs`, the bench's `--brain-arg`), passed
    /// verbatim after the typed ones; a flag written here replaces the typed one of the same
    /// name (the brain refuses a flag given twice).
    pub extra_args: Vec<String>,
    /// The brain manages its own CA and serving certificate in this Secret (`--tls-secret`)
    /// instead of serving the certificate [`Brain::start`] writes; clients still present
    /// certificates from the test's `Pki` (`--client-ca`).
    pub managed_tls: Option<ManagedTls>,
    /// Environment variables set for the brain's process (e.g. the OTEL_* of a trace receiver).
    pub env: Vec<(String, String)>,
    /// A serving certificate and key to serve instead of one issued for this brain: replicas
    /// of one Deployment share a single Secret, and with it their TLS session tickets' key.
    pub serving: Option<TlsFiles>,
}

impl Default for BrainOptions {
    fn default() -> Self {
        let mut surface = Surface::default();
        surface.limits.max_connections_per_ip = surface.limits.max_connections;
        BrainOptions {
            rules: RulesConfig::default(),
            tuning: Tuning::default(),
            surface,
            extra_args: Vec::new(),
            managed_tls: None,
            env: Vec::new(),
            serving: None,
        }
    }
}

impl BrainOptions {
    /// Default options with these service CIDRs.
    pub fn with_service_cidrs(service_cidrs: &[ipnet::IpNet]) -> BrainOptions {
        let mut opts = BrainOptions::default();
        opts.rules.service_cidrs = service_cidrs.to_vec();
        opts
    }

    /// The flags these options give the brain (for reports; [`Brain::start`] renders the whole
    /// configuration).
    pub fn args(&self) -> Vec<String> {
        let mut args = self.rules.to_args();
        args.extend(self.tuning.to_args());
        args.extend(self.surface.to_args());
        with_written(args, &self.extra_args)
    }
}

/// `typed` flags without those `written` names too, then `written`: a flag a person wrote
/// replaces the one the options render. A typed flag's value is the word after it unless it
/// is another flag, or after its `=`.
fn with_written<T: AsRef<std::ffi::OsStr> + From<String>>(
    typed: Vec<T>,
    written: &[String],
) -> Vec<T> {
    let name = |w: &str| {
        w.strip_prefix("--")
            .map(|f| f.split('=').next().unwrap_or(f).to_string())
    };
    let text = |w: &T| w.as_ref().to_str().map(str::to_string);
    let replaced: std::collections::HashSet<String> =
        written.iter().filter_map(|w| name(w)).collect();
    let mut out = Vec::with_capacity(typed.len() + written.len());
    let mut words = typed.into_iter().peekable();
    while let Some(word) = words.next() {
        let flag = text(&word);
        match flag.as_deref().and_then(name) {
            Some(f) if replaced.contains(&f) => {
                let has_value = flag.is_some_and(|w| w.contains('='));
                if !has_value
                    && words
                        .peek()
                        .and_then(text)
                        .is_some_and(|v| !v.starts_with("--"))
                {
                    words.next();
                }
            }
            _ => out.push(word),
        }
    }
    out.extend(written.iter().cloned().map(T::from));
    out
}

impl Brain {
    /// A serving certificate from `pki` for a brain called `name` (also its file names), for
    /// 127.0.0.1 and localhost. Given to several replicas as [`BrainOptions::serving`], it is
    /// their one Secret.
    pub fn serving_files(pki: &Pki, dir: &Path, name: &str) -> Result<TlsFiles> {
        pki.write(
            dir,
            name,
            &pki.server_cert(&["127.0.0.1", "localhost", name])?,
        )
    }

    /// Starts a brain against the API server of `kubeconfig`, with mTLS from `pki`, and waits
    /// until its gRPC port accepts connections. `grpc` may be given to reuse an address.
    pub fn start(
        exe: &Path,
        kubeconfig: &Path,
        pki: &Pki,
        dir: &Path,
        name: &str,
        grpc: Option<SocketAddr>,
        opts: &BrainOptions,
    ) -> Result<Brain> {
        std::fs::create_dir_all(dir)?;
        let tls = match &opts.serving {
            Some(files) => files.clone(),
            None => Brain::serving_files(pki, dir, name)?,
        };
        let bound = dir.join(format!("{name}.addresses"));
        let _ = std::fs::remove_file(&bound);
        let listen = grpc.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
        let config = BrainConfig {
            kubeconfig: Some(kubeconfig.to_path_buf()),
            listen,
            tls: TlsConfig {
                serving: match &opts.managed_tls {
                    Some(managed) => Serving::Managed(managed.clone()),
                    None => Serving::Files {
                        cert: tls.cert.clone(),
                        key: tls.key.clone(),
                    },
                },
                client_ca: Some(tls.ca.clone()),
                client_cert_optional: opts.surface.tokens.enabled(),
                pod_certificate_signer: None,
            },
            metrics_bind_address: SocketAddr::from(([127, 0, 0, 1], 0)),
            bound_address_file: Some(bound.clone()),
            log_format: "text".into(),
            rules: opts.rules.clone(),
            tuning: opts.tuning.clone(),
            surface: opts.surface.clone(),
        };
        // A profiler to run the brain under (`heaptrack`, `perf record -g --`): the words of
        // SPLITPROXY_BRAIN_WRAPPER go before the brain's command line.
        let wrapper = std::env::var("SPLITPROXY_BRAIN_WRAPPER").unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        let mut cmd = match words.next() {
            Some(first) => {
                let mut c = Command::new(first);
                c.args(words).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        cmd.arg("brain")
            .args(with_written(config.to_args(), &opts.extra_args))
            // Who the brain is to the Lease of a managed certificate: its name in the test.
            .env("POD_NAME", name)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(opts.env.iter().map(|(k, v)| (k, v)));
        let child = Child::spawn(name, cmd, &dir.join(format!("{name}.log")))?;
        // The brain writes the addresses it bound, so no other process's port can be mistaken
        // for it.
        let addrs = wait_for(Duration::from_secs(30), Duration::from_millis(20), || {
            let text = std::fs::read_to_string(&bound).ok()?;
            let get = |k: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(k))
                    .and_then(|v| v.parse::<SocketAddr>().ok())
            };
            Some((get("grpc=")?, get("metrics=")?))
        });
        let (grpc, metrics) = match addrs {
            Ok(a) => a,
            Err(e) => bail!(
                "brain did not start listening: {e:#}\n{}",
                child.log_tail(30)
            ),
        };
        Ok(Brain {
            child,
            grpc,
            metrics,
            tls,
            config,
        })
    }

    /// GET on the brain's HTTP endpoint; returns status code and body.
    pub fn http_get(&self, path: &str) -> Result<(u16, String)> {
        http_get(self.metrics, path)
    }
}

/// How an actuator is started besides its node, brains and certificates.
#[derive(Debug, Clone, Default)]
pub struct ActuatorOptions {
    /// Environment variables set for its process (e.g. the OTEL_* of a trace receiver).
    pub env: Vec<(String, String)>,
    /// More forwarders from the node namespace to host loopback, `(inside, target)`: how an
    /// actuator reaches a service of the harness (a trace receiver) at `inside`.
    pub forwards: Vec<(SocketAddr, SocketAddr)>,
}

/// An actuator process inside a node namespace.
pub struct Actuator {
    pub node: String,
    pub child: Child,
    /// Forwarders from inside the node namespace to each brain.
    pub forwarders: Vec<Forwarder>,
    pub tls: TlsFiles,
    log: PathBuf,
}

impl Actuator {
    /// Starts an actuator for `node` in `ns`, connected to `brains` (host loopback addresses)
    /// through forwarders in the namespace.
    pub fn start(
        exe: &Path,
        ns: &Netns,
        node: &str,
        brains: &[SocketAddr],
        pki: &Pki,
        dir: &Path,
    ) -> Result<Actuator> {
        Self::start_with(exe, ns, node, brains, pki, dir, &ActuatorOptions::default())
    }

    /// [`Actuator::start`] with `opts`.
    pub fn start_with(
        exe: &Path,
        ns: &Netns,
        node: &str,
        brains: &[SocketAddr],
        pki: &Pki,
        dir: &Path,
        opts: &ActuatorOptions,
    ) -> Result<Actuator> {
        std::fs::create_dir_all(dir)?;
        let tls = pki.write(dir, &format!("actuator-{node}"), &pki.node_cert(node)?)?;
        let mut forwarders = Vec::new();
        let mut urls = Vec::new();
        for (i, b) in brains.iter().enumerate() {
            let local = SocketAddr::from(([127, 0, 0, 1], brain_port_in_node(i)));
            forwarders.push(forward_port(ns, local, *b).context("forwarding to the brain")?);
            urls.push(format!("https://{local}"));
        }
        for (inside, target) in &opts.forwards {
            forwarders.push(forward_port(ns, *inside, *target).context("forwarding")?);
        }
        let mut cmd = Command::new(exe);
        cmd.arg("actuator")
            .arg("--brain")
            .arg(urls.join(","))
            .arg("--hostname-override")
            .arg(node)
            .arg("--ca")
            .arg(&tls.ca)
            .arg("--tls-cert")
            .arg(&tls.cert)
            .arg("--tls-key")
            .arg(&tls.key)
            .arg("--healthz-bind-address")
            .arg(ACTUATOR_HEALTHZ_BIND)
            .arg("--metrics-bind-address")
            .arg(ACTUATOR_METRICS)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(opts.env.iter().map(|(k, v)| (k, v)));
        let log = dir.join(format!("actuator-{node}.log"));
        let child = ns.spawn(&format!("actuator-{node}"), cmd, &log)?;
        Ok(Actuator {
            node: node.to_string(),
            child,
            forwarders,
            tls,
            log,
        })
    }

    pub fn log_tail(&self, lines: usize) -> String {
        crate::process::log_tail(&self.log, lines)
    }
}

/// GET `path` from an HTTP/1.1 server; returns the status code and body.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(buf.len());
    let head = String::from_utf8_lossy(&buf[..split]);
    let body = buf.get(split + 4..).unwrap_or_default();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad HTTP answer from {addr}: {head:?}"))?;
    let chunked = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding")
                && v.trim().eq_ignore_ascii_case("chunked")
        })
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Decodes a `Transfer-Encoding: chunked` body (Go servers, such as kube-proxy's, send large
/// responses that way even to HTTP/1.1 clients that close the connection).
pub(crate) fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rest.len());
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let line = String::from_utf8_lossy(&rest[..eol]);
        let Ok(size) = usize::from_str_radix(line.split(';').next().unwrap_or_default().trim(), 16)
        else {
            break;
        };
        let data = &rest[eol + 2..];
        if size == 0 {
            break;
        }
        if data.len() < size {
            out.extend_from_slice(data);
            break;
        }
        out.extend_from_slice(&data[..size]);
        rest = data[size..].strip_prefix(b"\r\n").unwrap_or(&data[size..]);
    }
    out
}

/// GET from inside a namespace (for actuators' local endpoints).
pub fn http_get_in(ns: &Netns, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let path = path.to_string();
    ns.run(move || http_get(addr, &path))?
}

/// Reads one sample of a Prometheus metric (the first line starting with `name`).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.split([' ', '{']).next() == Some(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The value of the series `name{label="value"}` (one label) in a metrics text. Panics when the
/// series is not there: a test asks only for series its component always exposes.
pub fn labelled(text: &str, name: &str, label: &str, value: &str) -> f64 {
    let prefix = format!("{name}{{{label}=\"{value}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} in the metrics"))
}

/// A gRPC client of a brain at `addr` that presents `tls` (CA, certificate, key).
pub async fn grpc_client(
    addr: SocketAddr,
    tls: &TlsFiles,
) -> Result<splitproxy_proto::v1::dataplane_client::DataplaneClient<tonic::transport::Channel>> {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let cfg = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&tls.ca)?))
        .identity(Identity::from_pem(
            std::fs::read(&tls.cert)?,
            std::fs::read(&tls.key)?,
        ))
        .domain_name("127.0.0.1");
    let channel = Channel::from_shared(format!("https://{addr}"))?
        .tls_config(cfg)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?;
    Ok(
        splitproxy_proto::v1::dataplane_client::DataplaneClient::new(channel)
            .max_decoding_message_size(splitproxy_proto::transport::MAX_UPDATE_MESSAGE),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brain_options_render_flags_the_brain_reads_back() {
        use clap::Parser;
        let mut opts = BrainOptions::with_service_cidrs(&["10.96.0.0/16".parse().unwrap()]);
        opts.rules.cluster_cidrs = vec![
            "10.244.0.0/16".parse().unwrap(),
            "fd00:244::/48".parse().unwrap(),
        ];
        opts.rules.detect_local = DetectLocalMode::InterfaceNamePrefix;
        opts.rules.pod_interface_name_prefix = "pod".into();
        opts.rules.nodeport_addresses =
            NodePortAddresses::Cidrs(vec!["192.168.77.0/24".parse().unwrap()]);
        opts.rules.masquerade_all = true;
        opts.tuning.min_publish_interval = Duration::from_millis(50);
        let args = opts.args().join(" ");
        assert!(
            args.contains("--cluster-cidr 10.244.0.0/16,fd00:244::/48")
                && args.contains("--detect-local-mode InterfaceNamePrefix")
                && args.contains("--nodeport-addresses 192.168.77.0/24")
                && args.contains("--masquerade-all"),
            "{args}"
        );
        let argv = ["brain", "--tls-cert=c", "--tls-key=k", "--client-ca=a"]
            .into_iter()
            .map(String::from)
            .chain(opts.args());
        let config =
            BrainConfig::try_from(splitproxy_brain::config::Args::try_parse_from(argv).unwrap())
                .unwrap();
        assert_eq!(format!("{:?}", config.rules), format!("{:?}", opts.rules));
        assert_eq!(config.tuning, opts.tuning);
    }

    #[test]
    fn a_written_flag_replaces_the_typed_one() {
        let typed = ["--a", "1", "--b=2", "--flag", "--c", "3"]
            .map(String::from)
            .to_vec();
        let written = ["--a=9", "--b", "8", "--flag"].map(String::from);
        assert_eq!(
            with_written(typed, &written),
            ["--c", "3", "--a=9", "--b", "8", "--flag"]
        );
        let opts = BrainOptions {
            extra_args: vec!["--min-publish-interval-ms=75".into()],
            ..Default::default()
        };
        let args = opts.args();
        assert_eq!(
            args.iter()
                .filter(|a| a.starts_with("--min-publish-interval-ms"))
                .count(),
            1,
            "{args:?}"
        );
        assert!(args.contains(&"--min-publish-interval-ms=75".to_string()));
    }

    #[test]
    fn dechunks_bodies() {
        assert_eq!(
            super::dechunk(b"5\r\nhello\r\n7;x=y\r\n world!\r\n0\r\n\r\n"),
            b"hello world!"
        );
        assert!(super::dechunk(b"zz\r\n").is_empty());
    }
}
