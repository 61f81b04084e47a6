//! A real etcd and kube-apiserver on host loopback, with throwaway state.
//!
//! The brain is tested against a real API server rather than a fake, because what matters
//! (streaming lists, watch bookmarks, 410 Gone, ServiceCIDR allocation, RBAC) is exactly what
//! fakes get wrong. [`ControlPlane::start`] starts etcd (`--unsafe-no-fsync`, data in a temp dir)
//! and kube-apiserver on 127.0.0.1 with free ports, a serving certificate from a fresh CA, an
//! admin token (group `system:masters`), client-certificate authentication against the same CA,
//! and service-account keys; it waits until `/readyz` answers and the default ServiceCIDR is
//! ready. Dropping it stops both processes and removes the temp dir.
//!
//! Logs are files in the temp dir. They are kept (and their path printed) when the environment
//! variable `SPLITPROXY_KEEP_LOGS` is set or when the control plane is dropped during a panic.

use std::fmt::Write as _;
use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use base64::Engine as _;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::Result;
use crate::certs::{self, Pki};
use crate::process::{self, Child};
use crate::tools;

/// Environment variable that keeps the control plane's logs and state after drop.
pub const KEEP_LOGS_ENV: &str = "SPLITPROXY_KEEP_LOGS";

/// The ServiceCIDR that kube-apiserver creates from `--service-cluster-ip-range`.
const DEFAULT_SERVICE_CIDR_NAME: &str = "kubernetes";

/// How [`ControlPlane::start`] configures the control plane.
#[derive(Clone, Debug)]
pub struct ControlPlaneOptions {
    /// `--service-cluster-ip-range`, e.g. "10.96.0.0/16" or "10.96.0.0/16,fd00:10:96::/112".
    pub service_cluster_ip_range: String,
    /// Extra kube-apiserver flags, appended last (so they override the defaults).
    pub extra_apiserver_args: Vec<String>,
    /// How long to wait for the API server to become ready.
    pub ready_timeout: Duration,
    /// The address published in the `default/kubernetes` Service's endpoints. kube-apiserver
    /// refuses to publish a loopback address, so with `None` it advertises 127.0.0.1 but runs
    /// no endpoint reconciler (the Service then has no endpoints). With `Some(ip)` (for
    /// example an address that a forwarder serves inside the test network), the endpoints are
    /// `ip:<secure port>`.
    pub advertise_address: Option<IpAddr>,
}

impl Default for ControlPlaneOptions {
    fn default() -> Self {
        ControlPlaneOptions {
            service_cluster_ip_range: "10.96.0.0/16".to_string(),
            extra_apiserver_args: Vec::new(),
            ready_timeout: Duration::from_secs(90),
            advertise_address: None,
        }
    }
}

/// How a kubeconfig authenticates.
enum Auth<'a> {
    Token(&'a str),
    ClientCert(&'a certs::CertPair),
}

/// A running etcd + kube-apiserver pair; stopped and cleaned up on drop.
pub struct ControlPlane {
    apiserver: Option<Child>,
    etcd: Option<Child>,
    apiserver_bin: PathBuf,
    apiserver_args: Vec<String>,
    opts: ControlPlaneOptions,
    port: u16,
    etcd_url: String,
    token: String,
    pki: Pki,
    kubeconfig: PathBuf,
    client: kube::Client,
    config: kube::Config,
    dir_path: PathBuf,
    dir: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("url", &self.url())
            .field("dir", &self.dir_path)
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver and waits until the API server is ready.
    ///
    /// Must be called inside a tokio runtime; the returned [`ControlPlane::client`] belongs to
    /// that runtime (use [`ControlPlane::new_client`] from another one).
    pub async fn start(opts: ControlPlaneOptions) -> Result<ControlPlane> {
        let etcd_bin = tools::binary("etcd")?;
        let apiserver_bin = tools::binary("kube-apiserver")?;

        let dir = tempfile::Builder::new()
            .prefix("splitproxy-cp-")
            .tempdir()
            .context("creating control plane temp dir")?;
        let dir_path = dir.path().to_path_buf();

        let result = Self::start_in(opts, &dir_path, &etcd_bin, apiserver_bin).await;
        match result {
            Ok(mut cp) => {
                cp.dir = Some(dir);
                Ok(cp)
            }
            Err(err) => {
                let kept = if keep_logs() {
                    format!("; logs kept in {}", keep_only_logs(dir).display())
                } else {
                    format!("; set {KEEP_LOGS_ENV}=1 to keep the logs")
                };
                Err(err.context(format!("starting the control plane failed{kept}")))
            }
        }
    }

    async fn start_in(
        opts: ControlPlaneOptions,
        dir: &Path,
        etcd_bin: &Path,
        apiserver_bin: PathBuf,
    ) -> Result<ControlPlane> {
        let etcd = start_etcd(etcd_bin, dir)?;
        let etcd_url = etcd.1;
        let etcd = etcd.0;

        // Certificates: one CA signs the serving certificate and authenticates clients.
        let pki = Pki::new("splitproxy-test-ca")?;
        let service_ips = first_service_ips(&opts.service_cluster_ip_range)?;
        let mut sans: Vec<String> = vec![
            "127.0.0.1".into(),
            "localhost".into(),
            "kubernetes".into(),
            "kubernetes.default".into(),
            "kubernetes.default.svc".into(),
            "kubernetes.default.svc.cluster.local".into(),
        ];
        sans.extend(service_ips.iter().map(IpAddr::to_string));
        let san_refs: Vec<&str> = sans.iter().map(String::as_str).collect();
        let serving = pki.server_cert(&san_refs)?;
        let pki_dir = dir.join("pki");
        let serving_files = pki.write(&pki_dir, "apiserver", &serving)?;

        // Service-account signing key (ECDSA P-256, PKCS#8) and its public key (SPKI).
        let sa_key = rcgen::KeyPair::generate().context("generating service account key")?;
        let sa_key_path = pki_dir.join("sa.key");
        let sa_pub_path = pki_dir.join("sa.pub");
        certs::write_file(&sa_key_path, &sa_key.serialize_pem())?;
        certs::write_file(&sa_pub_path, &sa_key.public_key_pem())?;

        let token = random_token()?;
        let token_file = pki_dir.join("tokens.csv");
        certs::write_file(
            &token_file,
            &format!("{token},splitproxy-admin,splitproxy-admin,\"system:masters\"\n"),
        )?;

        let port = process::free_port()?;
        let cert_dir = dir.join("apiserver-certs");
        std::fs::create_dir_all(&cert_dir)?;
        let mut apiserver_args = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--cert-dir={}", cert_dir.display()),
            format!("--tls-cert-file={}", serving_files.cert.display()),
            format!("--tls-private-key-file={}", serving_files.key.display()),
            format!("--client-ca-file={}", serving_files.ca.display()),
            format!("--token-auth-file={}", token_file.display()),
            format!("--secure-port={port}"),
            "--bind-address=127.0.0.1".into(),
            format!(
                "--service-cluster-ip-range={}",
                opts.service_cluster_ip_range
            ),
            // As a real cluster: kubelets are confined to their own node's objects (the Node
            // authorizer and NodeRestriction), which is what makes a pod-bound ServiceAccount
            // token's node-name claim trustworthy.
            "--authorization-mode=Node,RBAC".into(),
            "--enable-admission-plugins=NodeRestriction".into(),
            "--allow-privileged=true".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", sa_pub_path.display()),
            format!(
                "--service-account-signing-key-file={}",
                sa_key_path.display()
            ),
        ];
        match opts.advertise_address {
            Some(ip) => apiserver_args.push(format!("--advertise-address={ip}")),
            None => apiserver_args.extend([
                "--advertise-address=127.0.0.1".to_string(),
                "--endpoint-reconciler-type=none".to_string(),
            ]),
        }
        apiserver_args.extend(opts.extra_apiserver_args.iter().cloned());

        let kubeconfig = dir.join("kubeconfig");
        let url = format!("https://127.0.0.1:{port}");
        std::fs::write(
            &kubeconfig,
            render_kubeconfig(&url, pki.ca_pem(), Auth::Token(&token)),
        )
        .with_context(|| format!("writing {}", kubeconfig.display()))?;
        let config = config_from_file(&kubeconfig).await?;
        let client = kube::Client::try_from(config.clone()).context("building kube client")?;

        let mut cp = ControlPlane {
            apiserver: None,
            etcd: Some(etcd),
            apiserver_bin,
            apiserver_args,
            opts,
            port,
            etcd_url,
            token,
            pki,
            kubeconfig,
            client,
            config,
            dir_path: dir.to_path_buf(),
            dir: None,
        };
        // The port was free when picked but may have been taken since; retry with a new one.
        for attempt in 0.. {
            match cp.start_apiserver().await {
                Ok(()) => break,
                Err(err)
                    if attempt < 2 && format!("{err:#}").contains("address already in use") =>
                {
                    cp.stop_apiserver()?;
                    cp.set_port(process::free_port()?).await?;
                }
                Err(err) => return Err(err),
            }
        }
        Ok(cp)
    }

    /// Points the flags, the kubeconfig and the client at a new secure port.
    async fn set_port(&mut self, port: u16) -> Result<()> {
        self.port = port;
        for arg in &mut self.apiserver_args {
            if arg.starts_with("--secure-port=") {
                *arg = format!("--secure-port={port}");
            }
        }
        std::fs::write(
            &self.kubeconfig,
            render_kubeconfig(&self.url(), self.pki.ca_pem(), Auth::Token(&self.token)),
        )
        .with_context(|| format!("writing {}", self.kubeconfig.display()))?;
        self.config = config_from_file(&self.kubeconfig).await?;
        self.client =
            kube::Client::try_from(self.config.clone()).context("building kube client")?;
        Ok(())
    }

    /// The API server URL, `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The API server's port on host loopback.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The API server's address on host loopback.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// etcd's client URL.
    pub fn etcd_url(&self) -> &str {
        &self.etcd_url
    }

    /// A kube client (admin token) bound to the runtime that called [`ControlPlane::start`].
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// A new kube client for the current tokio runtime.
    pub fn new_client(&self) -> Result<kube::Client> {
        kube::Client::try_from(self.config.clone()).context("building kube client")
    }

    /// The kube client configuration (admin token).
    pub fn config(&self) -> &kube::Config {
        &self.config
    }

    /// A kubeconfig with the admin token and the CA data, pointing at [`ControlPlane::url`].
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// Writes a kubeconfig with the admin token that points at `server` instead (for example a
    /// port forwarded into a node namespace: the serving certificate is valid for 127.0.0.1
    /// and the `kubernetes.default.svc` names). Returns its path in the temp dir.
    pub fn kubeconfig_for_server(&self, server: &str) -> Result<PathBuf> {
        let path = self.unique_path("kubeconfig-server");
        certs::write_file(
            &path,
            &render_kubeconfig(server, self.pki.ca_pem(), Auth::Token(&self.token)),
        )?;
        Ok(path)
    }

    /// Writes a kubeconfig that authenticates with a client certificate for `user` in
    /// `groups`, issued by the control plane's CA. Returns its path in the temp dir.
    pub fn kubeconfig_for_user(&self, user: &str, groups: &[&str]) -> Result<PathBuf> {
        let pair = self.pki.client_cert_with_groups(user, groups)?;
        let path = self.unique_path("kubeconfig-user");
        certs::write_file(
            &path,
            &render_kubeconfig(&self.url(), self.pki.ca_pem(), Auth::ClientCert(&pair)),
        )?;
        Ok(path)
    }

    /// Writes a kubeconfig that authenticates with a bearer `token` (for example a
    /// ServiceAccount token from the TokenRequest API, so that a process runs with exactly that
    /// account's RBAC). Returns its path in the temp dir.
    pub fn kubeconfig_for_token(&self, token: &str) -> Result<PathBuf> {
        let path = self.unique_path("kubeconfig-token");
        certs::write_file(
            &path,
            &render_kubeconfig(&self.url(), self.pki.ca_pem(), Auth::Token(token)),
        )?;
        Ok(path)
    }

    fn unique_path(&self, stem: &str) -> PathBuf {
        for n in 0.. {
            let path = self.dir_path.join(format!("{stem}-{n}"));
            if !path.exists() {
                return path;
            }
        }
        unreachable!("u32 range of file names exhausted")
    }

    /// The kube-apiserver's process id while it runs (for CPU and memory readings).
    pub fn apiserver_pid(&self) -> Option<u32> {
        self.apiserver.as_ref().and_then(Child::id)
    }

    /// etcd's process id while it runs.
    pub fn etcd_pid(&self) -> Option<u32> {
        self.etcd.as_ref().and_then(Child::id)
    }

    /// The admin bearer token (user `splitproxy-admin`, group `system:masters`).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The CA that signed the serving certificate and that authenticates client certificates.
    pub fn pki(&self) -> &Pki {
        &self.pki
    }

    /// The temp dir holding state, certificates, kubeconfigs and logs.
    pub fn dir(&self) -> &Path {
        &self.dir_path
    }

    /// `token`, a JWT this API server issued, with its claims changed by `edit` and signed
    /// again with the API server's own service-account key (ES256, the same key id): a token
    /// the API server could have issued itself. TokenRequest allows no `exp` in the past and none
    /// sooner than 10 minutes; tests of expiry need both.
    pub fn resign_token(
        &self,
        token: &str,
        edit: impl FnOnce(&mut serde_json::Value),
    ) -> Result<String> {
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let mut parts = token.split('.');
        let (Some(header), Some(payload), Some(_), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            bail!("not a JWT: {} parts", token.split('.').count());
        };
        let mut claims: serde_json::Value = serde_json::from_slice(&b64.decode(payload)?)?;
        edit(&mut claims);
        let input = format!("{header}.{}", b64.encode(serde_json::to_vec(&claims)?));
        let pem = std::fs::read_to_string(self.dir_path.join("pki/sa.key"))?;
        let der = rcgen::KeyPair::from_pem(&pem)?.serialize_der();
        let rng = ring::rand::SystemRandom::new();
        let key = ring::signature::EcdsaKeyPair::from_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &der,
            &rng,
        )
        .map_err(|e| anyhow!("the service-account key: {e}"))?;
        let signature = key
            .sign(&rng, input.as_bytes())
            .map_err(|e| anyhow!("signing: {e}"))?;
        Ok(format!("{input}.{}", b64.encode(signature.as_ref())))
    }

    /// [`ControlPlane::resign_token`] with every time claim moved so that `exp` is `exp` (seconds
    /// since the epoch) and the token was issued 10 minutes before it: exactly the token, expired
    /// or expiring then.
    pub fn token_expiring_at(&self, token: &str, exp: i64) -> Result<String> {
        self.resign_token(token, |claims| {
            let issued = exp - 600;
            claims["iat"] = serde_json::json!(issued);
            claims["nbf"] = serde_json::json!(issued);
            claims["exp"] = serde_json::json!(exp);
            if claims["kubernetes.io"]["warnafter"].is_number() {
                claims["kubernetes.io"]["warnafter"] = serde_json::json!(issued);
            }
        })
    }

    /// The kube-apiserver log file.
    pub fn apiserver_log(&self) -> PathBuf {
        self.dir_path.join("kube-apiserver.log")
    }

    /// The etcd log file.
    pub fn etcd_log(&self) -> PathBuf {
        self.dir_path.join("etcd.log")
    }

    /// The options the control plane was started with.
    pub fn options(&self) -> &ControlPlaneOptions {
        &self.opts
    }

    /// Stops kube-apiserver (SIGTERM, then SIGKILL), leaving etcd and its data in place, to test
    /// how clients behave while the API server is down.
    pub fn stop_apiserver(&mut self) -> Result<()> {
        if let Some(mut apiserver) = self.apiserver.take() {
            apiserver.stop()?;
        }
        Ok(())
    }

    /// (Re)starts kube-apiserver on the same port with the same flags and waits until it is
    /// ready. Does nothing if it is running.
    pub async fn start_apiserver(&mut self) -> Result<()> {
        if let Some(apiserver) = self.apiserver.as_mut()
            && apiserver.is_running()
        {
            return Ok(());
        }
        let mut cmd = Command::new(&self.apiserver_bin);
        cmd.args(&self.apiserver_args);
        let log = self.apiserver_log();
        let child = Child::spawn("kube-apiserver", cmd, &log)?;
        self.apiserver = Some(child);
        self.wait_ready().await.with_context(|| {
            format!(
                "kube-apiserver did not become ready (log {}):\n{}",
                log.display(),
                process::log_tail(&log, 40)
            )
        })
    }

    /// Waits for `/readyz`, the `default` namespace and a ready default ServiceCIDR: before
    /// those exist, creating Services fails.
    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.opts.ready_timeout;
        loop {
            if let Some(apiserver) = self.apiserver.as_mut()
                && let Some(status) = apiserver.try_wait()?
            {
                bail!("kube-apiserver exited with {status}");
            }
            let last = match tokio::time::timeout(Duration::from_secs(5), self.ready_once()).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(err)) => format!("{err:#}"),
                Err(_) => "readiness check timed out".to_string(),
            };
            if Instant::now() >= deadline {
                bail!(
                    "not ready within {:?}; last check: {last}",
                    self.opts.ready_timeout
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn ready_once(&self) -> Result<()> {
        let request = http::Request::get("/readyz")
            .body(Vec::new())
            .context("building /readyz request")?;
        let body = self.client.request_text(request).await.context("/readyz")?;
        if body.trim() != "ok" {
            bail!("/readyz answered {body:?}");
        }
        Api::<Namespace>::all(self.client.clone())
            .get("default")
            .await
            .context("namespace default")?;
        let cidr = Api::<ServiceCIDR>::all(self.client.clone())
            .get(DEFAULT_SERVICE_CIDR_NAME)
            .await
            .context("default ServiceCIDR")?;
        let ready = cidr
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        if !ready {
            bail!("default ServiceCIDR is not ready yet");
        }
        Ok(())
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        drop(self.apiserver.take());
        drop(self.etcd.take());
        if (std::thread::panicking() || keep_logs())
            && let Some(dir) = self.dir.take()
        {
            eprintln!(
                "[splitproxy-tests] control plane logs kept in {} (kube-apiserver.log, etcd.log)",
                keep_only_logs(dir).display()
            );
        }
    }
}

/// Keeps a control plane's directory for its logs but deletes etcd's data (tens of MB each):
/// a run of failing tests must not fill the disk it needs to report them.
fn keep_only_logs(dir: tempfile::TempDir) -> PathBuf {
    let path = dir.keep();
    if let Ok(entries) = std::fs::read_dir(&path) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("etcd-data") {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    path
}

fn keep_logs() -> bool {
    std::env::var_os(KEEP_LOGS_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Starts etcd on free loopback ports and waits until it accepts connections. A port taken
/// between picking and binding shows as an early exit; that is retried with new ports.
fn start_etcd(bin: &Path, dir: &Path) -> Result<(Child, String)> {
    let log = dir.join("etcd.log");
    let mut last_err = anyhow!("etcd was not started");
    for attempt in 0..3 {
        let client_port = process::free_port()?;
        let peer_port = process::free_port()?;
        if client_port == peer_port {
            continue;
        }
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let data_dir = dir.join(format!("etcd-data-{attempt}"));
        let mut cmd = Command::new(bin);
        cmd.arg("--name=default")
            .arg(format!("--data-dir={}", data_dir.display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=default={peer_url}"))
            .arg("--unsafe-no-fsync");
        let mut child = Child::spawn("etcd", cmd, &log)?;
        let addr = SocketAddr::from(([127, 0, 0, 1], client_port));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait()? {
                last_err = anyhow!(
                    "etcd exited with {status} (log {}):\n{}",
                    log.display(),
                    process::log_tail(&log, 20)
                );
                break;
            }
            if etcd_healthy(addr) {
                return Ok((child, client_url));
            }
            if Instant::now() >= deadline {
                bail!(
                    "etcd did not become healthy within 30 s (log {}):\n{}",
                    log.display(),
                    process::log_tail(&log, 20)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Err(last_err)
}

/// Whether etcd at `addr` answers `GET /health` with `"health":"true"`.
fn etcd_healthy(addr: SocketAddr) -> bool {
    use std::io::Write;
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200))
    else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut response = String::new();
    let _ = stream.take(64 * 1024).read_to_string(&mut response);
    response.contains("\"health\":\"true\"")
}

/// The first address of each range in a comma-separated `--service-cluster-ip-range`: the
/// ClusterIP of the `kubernetes` Service, which the serving certificate must cover.
fn first_service_ips(ranges: &str) -> Result<Vec<IpAddr>> {
    ranges
        .split(',')
        .map(|range| {
            let net: ipnet::IpNet = range
                .trim()
                .parse()
                .with_context(|| format!("invalid service CIDR {range:?}"))?;
            let first = match net {
                ipnet::IpNet::V4(n) => IpAddr::V4((u32::from(n.network()) + 1).into()),
                ipnet::IpNet::V6(n) => IpAddr::V6((u128::from(n.network()) + 1).into()),
            };
            Ok(first)
        })
        .collect()
}

/// Renders a kubeconfig for `server` that trusts `ca_pem` and authenticates with `auth`.
fn render_kubeconfig(server: &str, ca_pem: &str, auth: Auth<'_>) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    let mut out = String::new();
    let _ = write!(
        out,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: splitproxy-test\n  cluster:\n    \
         server: {server}\n    certificate-authority-data: {}\ncontexts:\n- name: \
         splitproxy-test\n  context:\n    cluster: splitproxy-test\n    user: \
         splitproxy-test\ncurrent-context: splitproxy-test\nusers:\n- name: splitproxy-test\n  \
         user:\n",
        b64(ca_pem)
    );
    match auth {
        Auth::Token(token) => {
            let _ = writeln!(out, "    token: {token}");
        }
        Auth::ClientCert(pair) => {
            let _ = writeln!(
                out,
                "    client-certificate-data: {}\n    client-key-data: {}",
                b64(&pair.cert_pem),
                b64(&pair.key_pem)
            );
        }
    }
    out
}

/// Loads a kube client configuration from a kubeconfig file.
pub async fn config_from_file(path: &Path) -> Result<kube::Config> {
    let kubeconfig =
        Kubeconfig::read_from(path).with_context(|| format!("reading {}", path.display()))?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading {}", path.display()))
}

/// Builds a kube client from a kubeconfig file (for the current tokio runtime).
pub async fn client_from_file(path: &Path) -> Result<kube::Client> {
    let config = config_from_file(path).await?;
    kube::Client::try_from(config).context("building kube client")
}

/// 128 random bits from the kernel, hex encoded.
fn random_token() -> Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom")?;
    Ok(bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_service_ips_of_single_and_dual_stack_ranges() {
        assert_eq!(
            first_service_ips("10.96.0.0/16").unwrap(),
            vec!["10.96.0.1".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(
            first_service_ips("10.100.0.0/24, fd00:10:96::/112").unwrap(),
            vec![
                "10.100.0.1".parse::<IpAddr>().unwrap(),
                "fd00:10:96::1".parse::<IpAddr>().unwrap()
            ]
        );
        assert!(first_service_ips("nonsense").is_err());
    }

    #[test]
    fn kubeconfig_parses_with_kube() {
        let pki = Pki::new("t").unwrap();
        let text = render_kubeconfig("https://127.0.0.1:1234", pki.ca_pem(), Auth::Token("abc"));
        let kc = Kubeconfig::from_yaml(&text).unwrap();
        assert_eq!(
            kc.clusters[0].cluster.as_ref().unwrap().server.as_deref(),
            Some("https://127.0.0.1:1234")
        );
        let pair = pki.client_cert("u").unwrap();
        let text = render_kubeconfig("https://x:1", pki.ca_pem(), Auth::ClientCert(&pair));
        assert!(Kubeconfig::from_yaml(&text).is_ok());
    }
}
