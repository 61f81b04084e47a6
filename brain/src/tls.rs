//! TLS for the brain's gRPC server: a server certificate, and client certificates verified
//! against a CA when `--client-ca` is given (optional in the handshake when bearer tokens are
//! enabled, see [`crate::tokens`]). What a client certificate vouches for (its names, groups and expiry)
//! becomes an [`Identity`], from which [`crate::auth`] decides what the caller may do ("node
//! scoped", docs/invariants.md).
//!
//! The server's certificate and key come from one of two sources ([`ServingSource`]): PEM files that
//! someone else issues, or the Secret in which the brain keeps a certificate of its own
//! ([`ServingCert`], filled by [`crate::pki`]). Either way a rotated certificate is used for the
//! next handshake without a restart ([`ReloadingTls`]: changed files are read again, and a
//! certificate installed from the Secret is what the next handshake resolves), as the actuator
//! does with its own certificate; so is a changed client CA file.
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use crate::auth::{Credential, Identity};
use crate::metrics::Metrics;
use crate::session_tickets::{self, ServingSeed, SharedTickets, Trust};

/// How often the files' metadata is looked at, at most (on a handshake).
const RELOAD_CHECK: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Pem { path: String, what: String },
    #[error("TLS configuration: {0}")]
    Rustls(String),
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn pem_error(path: &Path, what: impl std::fmt::Display) -> TlsError {
    TlsError::Pem {
        path: path.display().to_string(),
        what: what.to_string(),
    }
}

/// Where the server's certificate chain and key come from.
#[derive(Debug, Clone)]
pub enum ServingSource {
    /// PEM files (`--tls-cert`, `--tls-key`), read again when they change.
    Files { cert: PathBuf, key: PathBuf },
    /// The certificate last installed from the brain's Secret (`--tls-secret`), resolved at
    /// every handshake.
    Managed(Arc<ServingCert>),
}

/// Which client certificates the server asks for.
#[derive(Debug, Clone)]
pub struct ClientAuth {
    /// `--client-ca`: the CA client certificates are verified against; without it no client
    /// certificate is asked for.
    pub ca: Option<PathBuf>,
    /// Whether a caller may complete the handshake without one although `ca` is set (bearer
    /// tokens are enabled).
    pub optional: bool,
    /// The brain's own CA instead of `ca` (`--pod-certificate-signer`: the nodes' certificates
    /// are the brain's), followed as the Secret changes.
    pub own: Option<Arc<crate::pki::own_ca::OwnCa>>,
}

/// The files a server configuration is read from, besides a managed certificate.
fn files<'a>(serving: &'a ServingSource, client: &'a ClientAuth) -> Vec<&'a Path> {
    let mut files: Vec<&Path> = match serving {
        ServingSource::Files { cert, key } => vec![cert, key],
        ServingSource::Managed(_) => Vec::new(),
    };
    files.extend(client.ca.as_deref());
    files
}

/// A chain (leaf first) from PEM; `origin` names it in errors.
fn chain_from_pem(pem: &[u8], origin: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| pem_error(origin, e))?;
    if chain.is_empty() {
        return Err(pem_error(origin, "no certificate"));
    }
    Ok(chain)
}

/// A rustls server configuration: the server's chain and key (from the files, or resolved from
/// the managed certificate at each handshake), client certificates verified against the client
/// CA when there is one (required, unless bearer tokens are enabled: then a caller may also come
/// without one), HTTP/2 by ALPN (gRPC clients such as grpc-go insist on it).
pub fn server_config(
    serving: &ServingSource,
    client: &ClientAuth,
) -> Result<ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(rustls::ALL_VERSIONS)
        .map_err(|e| TlsError::Rustls(e.to_string()))?;
    // What a session ticket is bound to besides the serving key (crate::session_tickets).
    let mut trust = Trust::Fixed(session_tickets::trust_digest(b""));
    let builder = match (&client.own, &client.ca) {
        (Some(own), _) => {
            trust = Trust::Own(own.clone());
            builder.with_client_cert_verifier(own.clone())
        }
        (None, None) => builder.with_no_client_auth(),
        (None, Some(client_ca)) => {
            let mut roots = rustls::RootCertStore::empty();
            let bundle = read(client_ca)?;
            trust = Trust::Fixed(session_tickets::trust_digest(&bundle));
            for ca in CertificateDer::pem_slice_iter(&bundle) {
                let ca = ca.map_err(|e| pem_error(client_ca, e))?;
                roots.add(ca).map_err(|e| pem_error(client_ca, e))?;
            }
            let mut verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            if client.optional {
                verifier = verifier.allow_unauthenticated();
            }
            let verifier = verifier
                .build()
                .map_err(|e| TlsError::Rustls(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let (mut config, seed) = match serving {
        ServingSource::Files { cert, key } => {
            let chain = chain_from_pem(&read(cert)?, cert)?;
            let key = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| pem_error(key, e))?;
            let seed = ServingSeed::Fixed(session_tickets::key_digest(key.secret_der()));
            let config = builder
                .with_single_cert(chain, key)
                .map_err(|e| TlsError::Rustls(e.to_string()))?;
            (config, seed)
        }
        ServingSource::Managed(current) => (
            builder.with_cert_resolver(current.clone()),
            ServingSeed::Managed(current.clone()),
        ),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    // Tickets any replica opens (a node failing over resumes its session); one per
    // connection, as a node holds one connection at a time.
    config.ticketer = Arc::new(SharedTickets::new(seed, trust));
    config.send_tls13_tickets = 1;
    Ok(config)
}

/// The brain's own serving certificate, as last installed from its Secret by [`crate::pki`]:
/// what every handshake is answered with. Until one is installed, handshakes fail and the brain
/// is not ready (`/readyz`). A certificate that does not load is refused, and the previous one
/// stays.
#[derive(Default)]
pub struct ServingCert {
    current: RwLock<Option<Arc<CertifiedKey>>>,
    /// A digest of its key, for the session tickets' key (never the key itself).
    ticket_seed: RwLock<Option<[u8; 32]>>,
}

impl std::fmt::Debug for ServingCert {
    // Never the key: only whether there is a certificate.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingCert")
            .field("installed", &self.is_ready())
            .finish()
    }
}

impl ServingCert {
    /// Installs a chain (leaf first) and its key, both PEM, for the next handshakes. Returns
    /// whether the certificate changed (the same leaf again is a no-op). A chain whose key does
    /// not match, or that does not parse, is an error and changes nothing.
    pub fn install(&self, chain_pem: &[u8], key_pem: &[u8]) -> Result<bool, TlsError> {
        let origin = Path::new("the Secret's tls.crt");
        let chain = chain_from_pem(chain_pem, origin)?;
        if self.leaf().as_ref() == chain.first() {
            return Ok(false);
        }
        // The key's parse error is not shown: it could quote key material.
        let key = PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|_| pem_error(Path::new("the Secret's tls.key"), "not a PEM private key"))?;
        let seed = session_tickets::key_digest(key.secret_der());
        let provider = rustls::crypto::ring::default_provider();
        let certified = CertifiedKey::from_der(chain, key, &provider)
            .map_err(|e| TlsError::Rustls(e.to_string()))?;
        // The seed first: a handshake answered with the new certificate issues tickets under
        // its key (one in between issues a ticket that opens nowhere, never a wrong one).
        if let Ok(mut s) = self.ticket_seed.write() {
            *s = Some(seed);
        }
        if let Ok(mut c) = self.current.write() {
            *c = Some(Arc::new(certified));
        }
        Ok(true)
    }

    /// Whether a certificate is installed.
    pub fn is_ready(&self) -> bool {
        self.current.read().map(|c| c.is_some()).unwrap_or(false)
    }

    /// The digest of the installed key the session tickets' key is derived from.
    pub fn ticket_seed(&self) -> Option<[u8; 32]> {
        *self.ticket_seed.read().ok()?
    }

    /// The leaf certificate served now.
    pub fn leaf(&self) -> Option<CertificateDer<'static>> {
        let current = self.current.read().ok()?;
        current.as_ref()?.cert.first().cloned()
    }
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok()?.clone()
    }
}

/// What identifies one version of the files: each one's modification time and length.
type Stamp = Vec<Option<(SystemTime, u64)>>;

fn stamp(files: &[&Path]) -> Stamp {
    files
        .iter()
        // `metadata` follows symlinks: a Kubernetes Secret volume swaps a symlink.
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
}

/// The server's TLS configuration, rebuilt from the files when they change. Each handshake asks
/// for [`ReloadingTls::current`]; at most every `RELOAD_CHECK` that costs a `stat` per file. A
/// file caught mid-rewrite, or a new set that does not load, keeps the previous configuration
/// (and is tried again at the next check). A managed certificate needs no rebuild: the
/// configuration resolves it at each handshake.
pub struct ReloadingTls {
    serving: ServingSource,
    client: ClientAuth,
    current: RwLock<(Arc<ServerConfig>, Stamp)>,
    checked: Mutex<Instant>,
    metrics: Arc<Metrics>,
}

impl ReloadingTls {
    /// Loads the files once; an error here fails the start.
    pub fn new(
        serving: ServingSource,
        client: ClientAuth,
        metrics: Arc<Metrics>,
    ) -> Result<Self, TlsError> {
        let st = stamp(&files(&serving, &client));
        let config = Arc::new(server_config(&serving, &client)?);
        Ok(ReloadingTls {
            serving,
            client,
            current: RwLock::new((config, st)),
            checked: Mutex::new(Instant::now()),
            metrics,
        })
    }

    /// The configuration for the next handshake.
    pub fn current(&self) -> Arc<ServerConfig> {
        let due = self.checked.lock().is_ok_and(|mut at| {
            let due = at.elapsed() >= RELOAD_CHECK;
            if due {
                *at = Instant::now();
            }
            due
        });
        if due {
            self.reload_if_changed();
        }
        self.current
            .read()
            .map(|c| c.0.clone())
            .unwrap_or_else(|p| p.into_inner().0.clone())
    }

    /// Rebuilds the configuration if a file changed since it was built; returns whether it did.
    pub fn reload_if_changed(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let now = stamp(&files(&self.serving, &self.client));
        let changed = self.current.read().map(|c| c.1 != now).unwrap_or(true);
        if !changed {
            return false;
        }
        match server_config(&self.serving, &self.client) {
            Ok(config) => {
                if let Ok(mut c) = self.current.write() {
                    *c = (Arc::new(config), now);
                }
                self.metrics.surface.tls_reloads.fetch_add(1, Relaxed);
                tracing::info!(client_ca = ?self.client.ca, "TLS files changed: reloaded");
                true
            }
            Err(e) => {
                self.metrics.surface.tls_reload_errors.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "TLS files changed but do not load; keeping the previous ones");
                false
            }
        }
    }

    /// Where the serving certificate comes from.
    pub fn serving(&self) -> &ServingSource {
        &self.serving
    }
}

/// What the peer's leaf certificate vouches for: its common names and DNS SANs as names, its
/// Organizations as groups (as Kubernetes reads client certificates), its notAfter as expiry.
/// An unparsable certificate vouches for nothing.
pub fn identity_of(der: &[u8]) -> Identity {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Identity::default();
    };
    let text = |it: &mut dyn Iterator<Item = &x509_parser::x509::AttributeTypeAndValue<'_>>| {
        it.filter_map(|a| a.as_str().ok().map(str::to_string))
            .collect::<Vec<_>>()
    };
    let mut names = text(&mut cert.subject().iter_common_name());
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::DNSName(d) = name {
                names.push(d.to_string());
            }
        }
    }
    names.sort();
    names.dedup();
    let groups = text(&mut cert.subject().iter_organization());
    let not_after = cert.validity().not_after.timestamp();
    let expires = u64::try_from(not_after)
        .ok()
        .map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s));
    Identity {
        names,
        groups,
        expires,
        credential: Credential::Certificate,
    }
}

/// The identity of a peer that presented `certs` (leaf first).
pub fn identity_of_chain(certs: &[CertificateDer<'_>]) -> Option<Identity> {
    certs.first().map(|leaf| identity_of(leaf.as_ref()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};

    use super::*;

    struct Ca {
        pem: String,
        issuer: Issuer<'static, KeyPair>,
    }

    fn ca(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let pem = params.self_signed(&key).unwrap().pem();
        Ca {
            pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf from `ca`: (certificate PEM and DER, key PEM).
    fn leaf(ca: &Ca, cn: &str, orgs: &[&str]) -> (String, Vec<u8>, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![cn.to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        for o in orgs {
            params.distinguished_name.push(DnType::OrganizationName, *o);
        }
        params
            .subject_alt_names
            .push(SanType::DnsName("alias.example".try_into().unwrap()));
        let cert = params.signed_by(&key, &ca.issuer).unwrap();
        (cert.pem(), cert.der().to_vec(), key.serialize_pem())
    }

    #[test]
    fn a_certificate_vouches_for_its_names_groups_and_expiry() {
        let ca = ca("ca");
        // rcgen writes one Organization (a later one replaces an earlier one).
        let (_, der, _) = leaf(&ca, "node-1", &["splitproxy:nodes"]);
        let id = identity_of(&der);
        assert_eq!(id.names, ["alias.example", "node-1"]);
        assert_eq!(id.groups, ["splitproxy:nodes"]);
        let left = id
            .expires
            .unwrap()
            .duration_since(SystemTime::now())
            .unwrap();
        assert!(left > Duration::from_secs(3600), "{left:?}");
        assert_eq!(identity_of(b"not a certificate"), Identity::default());
    }

    /// Changed files are used for the next handshake; files that do not load keep the previous
    /// configuration, and are tried again once fixed.
    #[test]
    fn changed_files_are_reloaded_and_broken_ones_keep_the_last_good() {
        let dir = tempfile::tempdir().unwrap();
        struct Paths {
            cert: PathBuf,
            key: PathBuf,
            client_ca: Option<PathBuf>,
            client_cert_optional: bool,
        }
        let paths = Paths {
            cert: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
            client_ca: Some(dir.path().join("ca.crt")),
            client_cert_optional: false,
        };
        let ca = ca("ca");
        let write = |cn: &str| {
            let (cert, _, key) = leaf(&ca, cn, &[]);
            std::fs::write(&paths.cert, cert).unwrap();
            std::fs::write(&paths.key, key).unwrap();
        };
        std::fs::write(paths.client_ca.as_ref().unwrap(), &ca.pem).unwrap();
        write("brain-a");
        let metrics = Arc::new(Metrics::default());
        let serving = ServingSource::Files {
            cert: paths.cert.clone(),
            key: paths.key.clone(),
        };
        let client = ClientAuth {
            ca: paths.client_ca.clone(),
            optional: paths.client_cert_optional,
            own: None,
        };
        let tls = ReloadingTls::new(serving, client, metrics.clone()).unwrap();
        let first = tls.current();
        assert!(!tls.reload_if_changed(), "nothing changed");

        write("brain-b-with-a-longer-name");
        assert!(tls.reload_if_changed());
        let second = tls.current();
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(second.alpn_protocols, [b"h2".to_vec()]);

        std::fs::write(&paths.key, "garbage").unwrap();
        assert!(!tls.reload_if_changed(), "a broken key is not loaded");
        assert!(
            Arc::ptr_eq(&second, &tls.current()),
            "the last good one stays"
        );
        write("brain-c-with-an-even-longer-name");
        assert!(tls.reload_if_changed(), "tried again once fixed");
        use std::sync::atomic::Ordering::Relaxed;
        assert_eq!(metrics.surface.tls_reloads.load(Relaxed), 2);
        assert_eq!(metrics.surface.tls_reload_errors.load(Relaxed), 1);
    }

    /// A managed certificate is served from the next handshake on; one whose key does not
    /// match, or that does not parse, is refused and the previous one stays.
    #[test]
    fn a_managed_certificate_is_installed_only_whole() {
        let ca = ca("ca");
        let serving = ServingCert::default();
        assert!(!serving.is_ready());
        let (cert, der, key) = leaf(&ca, "brain", &[]);
        assert!(serving.install(cert.as_bytes(), key.as_bytes()).unwrap());
        assert!(serving.is_ready());
        assert_eq!(serving.leaf().unwrap().as_ref(), &der[..]);
        assert!(
            !serving.install(cert.as_bytes(), key.as_bytes()).unwrap(),
            "the same certificate again changes nothing"
        );
        let (other, _, other_key) = leaf(&ca, "brain", &[]);
        let err = serving
            .install(other.as_bytes(), key.as_bytes())
            .unwrap_err();
        assert!(!err.to_string().contains("PRIVATE"), "{err}");
        assert!(serving.install(b"", other_key.as_bytes()).is_err());
        assert!(serving.install(other.as_bytes(), b"garbage").is_err());
        assert_eq!(serving.leaf().unwrap().as_ref(), &der[..], "unchanged");
        assert!(
            serving
                .install(other.as_bytes(), other_key.as_bytes())
                .unwrap()
        );
        assert_ne!(serving.leaf().unwrap().as_ref(), &der[..]);
        assert!(!format!("{serving:?}").contains("PRIVATE"));
    }

    /// One handshake of `client` with a server of `server`, over an in-memory pipe, the ticket
    /// the server sends read by the client: how each side saw it, and who the server says the
    /// client is.
    async fn handshake(
        server: Arc<ServerConfig>,
        client: Arc<rustls::ClientConfig>,
    ) -> (rustls::HandshakeKind, rustls::HandshakeKind, Vec<String>) {
        let (c, s) = tokio::io::duplex(64 * 1024);
        let serve = async move {
            let mut tls = tokio_rustls::TlsAcceptor::from(server)
                .accept(s)
                .await
                .unwrap();
            use tokio::io::AsyncWriteExt;
            tls.write_all(b"x").await.unwrap();
            tls.flush().await.unwrap();
            let conn = tls.get_ref().1;
            let names = conn
                .peer_certificates()
                .and_then(identity_of_chain)
                .map(|i| i.names)
                .unwrap_or_default();
            (conn.handshake_kind().unwrap(), names, tls)
        };
        let connect = async move {
            let name = rustls::pki_types::ServerName::try_from("brain").unwrap();
            let mut tls = tokio_rustls::TlsConnector::from(client)
                .connect(name, c)
                .await
                .unwrap();
            use tokio::io::AsyncReadExt;
            let mut byte = [0u8; 1];
            tls.read_exact(&mut byte).await.unwrap();
            tls.get_ref().1.handshake_kind().unwrap()
        };
        let ((server_kind, names, _keep), client_kind) = tokio::join!(serve, connect);
        (client_kind, server_kind, names)
    }

    #[tokio::test]
    async fn a_node_resumes_at_another_replica_until_the_client_ca_changes() {
        let dir = tempfile::tempdir().unwrap();
        let root = ca("ca");
        let (brain_cert, _, brain_key) = leaf(&root, "brain", &[]);
        let (node_cert, _, node_key) = leaf(&root, "node-1", &[]);
        let (cert, key, client_ca) = (
            dir.path().join("tls.crt"),
            dir.path().join("tls.key"),
            dir.path().join("client-ca.crt"),
        );
        std::fs::write(&cert, &brain_cert).unwrap();
        std::fs::write(&key, &brain_key).unwrap();
        std::fs::write(&client_ca, &root.pem).unwrap();
        let serving = ServingSource::Files { cert, key };
        let auth = ClientAuth {
            ca: Some(client_ca.clone()),
            optional: true,
            own: None,
        };
        // Two replicas: the same files, each its own configuration (and ticketer).
        let a = Arc::new(server_config(&serving, &auth).unwrap());
        let b = Arc::new(server_config(&serving, &auth).unwrap());

        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(root.pem.as_bytes()).unwrap())
            .unwrap();
        let chain = vec![CertificateDer::from_pem_slice(node_cert.as_bytes()).unwrap()];
        let node_key = PrivateKeyDer::from_pem_slice(node_key.as_bytes()).unwrap();
        let mut client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, node_key)
        .unwrap();
        client.alpn_protocols = vec![b"h2".to_vec()];
        let client = Arc::new(client);

        let (c, s, _) = handshake(a.clone(), client.clone()).await;
        assert_eq!(
            (c, s),
            (rustls::HandshakeKind::Full, rustls::HandshakeKind::Full)
        );
        // Replica A issued the ticket; replica B opens it, and knows the node from it.
        let (c, s, names) = handshake(b.clone(), client.clone()).await;
        assert_eq!(
            (c, s),
            (
                rustls::HandshakeKind::Resumed,
                rustls::HandshakeKind::Resumed
            )
        );
        assert_eq!(names, ["alias.example", "node-1"]);

        // The client CA bundle changes (another CA added): no ticket issued before opens, and
        // the node is verified again in a full handshake.
        let other = ca("other");
        std::fs::write(&client_ca, format!("{}{}", root.pem, other.pem)).unwrap();
        let c_replica = Arc::new(server_config(&serving, &auth).unwrap());
        let (c, s, names) = handshake(c_replica, client.clone()).await;
        assert_eq!(
            (c, s),
            (rustls::HandshakeKind::Full, rustls::HandshakeKind::Full)
        );
        assert_eq!(names, ["alias.example", "node-1"]);
    }
}
