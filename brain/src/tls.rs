//! mTLS for the brain's gRPC server: a server certificate, and client certificates required
//! and verified against a CA. A node's certificate names the node (common name or DNS SAN), and
//! that name decides which node's state the stream may receive ("node scoped", docs/invariants.md).
use std::path::Path;

use tonic::Request;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// Server TLS that requires a client certificate signed by `client_ca`.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Result<ServerTlsConfig, TlsError> {
    let identity = Identity::from_pem(read(cert)?, read(key)?);
    Ok(ServerTlsConfig::new()
        .identity(identity)
        .client_ca_root(Certificate::from_pem(read(client_ca)?))
        .client_auth_optional(false))
}

/// The names the peer's leaf certificate vouches for: its common names and DNS SANs.
pub fn peer_identities<T>(request: &Request<T>) -> Vec<String> {
    let Some(certs) = request.peer_certs() else {
        return Vec::new();
    };
    let Some(leaf) = certs.first() else {
        return Vec::new();
    };
    identities_of(leaf.as_ref())
}

pub fn identities_of(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let mut out: Vec<String> = cert
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok().map(str::to_string))
        .collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::DNSName(d) = name {
                out.push(d.to_string());
            }
        }
    }
    out
}
