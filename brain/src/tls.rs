//! TLS for the brain's gRPC server: a server certificate, and client certificates verified
//! against a CA when `--client-ca` is given (optional in the handshake when bearer tokens are
//! enabled, see [`crate::tokens`]). What a client certificate vouches for (its names, groups and expiry)
//! becomes an [`Identity`], from which [`crate::auth`] decides what the caller may do ("node
//! scoped", docs/invariants.md).
//!
//! The files are read again when they change ([`ReloadingTls`]): a rotated server certificate,
//! key or client CA is used for the next handshake without a restart, as the actuator does with
//! its own certificate.
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use crate::auth::{Credential, Identity};
use crate::config::TlsPaths;
use crate::metrics::Metrics;

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

/// A rustls server configuration from the PEM files: the server's chain and key, client
/// certificates verified against the client CA when there is one (required, unless bearer
/// tokens are enabled: then a caller may also come without one), HTTP/2 by ALPN (gRPC clients
/// such as grpc-go insist on it).
pub fn server_config(paths: &TlsPaths) -> Result<ServerConfig, TlsError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read(&paths.cert)?)
        .collect::<Result<_, _>>()
        .map_err(|e| pem_error(&paths.cert, e))?;
    if chain.is_empty() {
        return Err(pem_error(&paths.cert, "no certificate"));
    }
    let key =
        PrivateKeyDer::from_pem_slice(&read(&paths.key)?).map_err(|e| pem_error(&paths.key, e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(rustls::ALL_VERSIONS)
        .map_err(|e| TlsError::Rustls(e.to_string()))?;
    let builder = match &paths.client_ca {
        None => builder.with_no_client_auth(),
        Some(client_ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for ca in CertificateDer::pem_slice_iter(&read(client_ca)?) {
                let ca = ca.map_err(|e| pem_error(client_ca, e))?;
                roots.add(ca).map_err(|e| pem_error(client_ca, e))?;
            }
            let mut verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            if paths.client_cert_optional {
                verifier = verifier.allow_unauthenticated();
            }
            let verifier = verifier
                .build()
                .map_err(|e| TlsError::Rustls(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Rustls(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// What identifies one version of the files: each one's modification time and length.
type Stamp = Vec<Option<(SystemTime, u64)>>;

fn stamp(paths: &TlsPaths) -> Stamp {
    [
        Some(&paths.cert),
        Some(&paths.key),
        paths.client_ca.as_ref(),
    ]
    .into_iter()
    .flatten()
    // `metadata` follows symlinks: a Kubernetes Secret volume swaps a symlink.
    .map(|p| {
        std::fs::metadata(p)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())))
    })
    .collect()
}

/// The server's TLS configuration, rebuilt from the files when they change. Each handshake asks
/// for [`ReloadingTls::current`]; at most every [`RELOAD_CHECK`] that costs three `stat`s. A
/// file caught mid-rewrite, or a new set that does not load, keeps the previous configuration
/// (and is tried again at the next check).
pub struct ReloadingTls {
    paths: TlsPaths,
    current: RwLock<(Arc<ServerConfig>, Stamp)>,
    checked: Mutex<Instant>,
    metrics: Arc<Metrics>,
}

impl ReloadingTls {
    /// Loads the files once; an error here fails the start.
    pub fn new(paths: TlsPaths, metrics: Arc<Metrics>) -> Result<Self, TlsError> {
        let st = stamp(&paths);
        let config = Arc::new(server_config(&paths)?);
        Ok(ReloadingTls {
            paths,
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
        let now = stamp(&self.paths);
        let changed = self.current.read().map(|c| c.1 != now).unwrap_or(true);
        if !changed {
            return false;
        }
        match server_config(&self.paths) {
            Ok(config) => {
                if let Ok(mut c) = self.current.write() {
                    *c = (Arc::new(config), now);
                }
                self.metrics.surface.tls_reloads.fetch_add(1, Relaxed);
                tracing::info!(cert = %self.paths.cert.display(), "TLS files changed: reloaded");
                true
            }
            Err(e) => {
                self.metrics.surface.tls_reload_errors.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "TLS files changed but do not load; keeping the previous ones");
                false
            }
        }
    }

    pub fn paths(&self) -> &TlsPaths {
        &self.paths
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
        let paths = TlsPaths {
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
        let tls = ReloadingTls::new(paths.clone(), metrics.clone()).unwrap();
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
}
