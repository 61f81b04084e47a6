//! The TLS client of the connections to brains, kept across reconnects so that they resume
//! their TLS session.
//!
//! Brains issue session tickets that every replica opens (the brain's `session_tickets`
//! module, docs/protocol.md "Session tickets"). A ticket is only worth something if the client
//! keeps it: tonic's `ClientTlsConfig` builds a new rustls configuration, with an empty session
//! cache, for every channel. So the actuator builds its own and keeps it while the credential
//! files hold the same bytes; the connection's TLS is done here (a connector for tonic's
//! channel), with the same checks as before: the brain's certificate verified against the CA
//! for the server name, the client certificate presented when configured, HTTP/2 by ALPN.
//! When a brain dies, its nodes reconnect to another replica with a resumed session (a key
//! exchange) instead of a full handshake (signatures made and verified on both sides).
//!
//! The files are still read at every connection: a rotated CA or certificate gives a new
//! configuration (and a full handshake) at the next one.
use std::sync::{Arc, Mutex};

use anyhow::{Context, bail};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tonic::transport::{Channel, Endpoint, Uri};

use crate::credentials::{Credentials, Material};

/// The rustls client configuration last built, and the file contents it was built from.
#[derive(Default)]
pub struct TlsClient {
    kept: Mutex<Option<(Material, Arc<rustls::ClientConfig>)>>,
}

impl std::fmt::Debug for TlsClient {
    // Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClient").finish_non_exhaustive()
    }
}

impl TlsClient {
    /// The configuration for `credentials` as the files are now: the kept one (with its
    /// session tickets) while they hold the same bytes, a new one when they changed.
    pub fn config(&self, credentials: &Credentials) -> anyhow::Result<Arc<rustls::ClientConfig>> {
        let material = credentials.material()?;
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((m, config)) = kept.as_ref()
            && *m == material
        {
            return Ok(config.clone());
        }
        let config = Arc::new(build(&material)?);
        *kept = Some((material, config.clone()));
        Ok(config)
    }
}

/// A client configuration from the CA bundle and, if any, the client certificate and key.
fn build(material: &Material) -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&material.ca) {
        roots
            .add(cert.context("parsing the brain's CA")?)
            .context("adding the brain's CA")?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut config = match &material.client {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(cert)
                .collect::<Result<Vec<_>, _>>()
                .context("parsing the client certificate")?;
            let key = PrivateKeyDer::from_pem_slice(key)
                .map_err(|_| anyhow::anyhow!("the client key is not a PEM private key"))?;
            builder.with_client_auth_cert(chain, key)?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// A channel to `endpoint`'s brain over TLS with `config`, the brain's certificate verified for
/// `server_name`. `endpoint` carries the channel's settings (timeouts, keepalive); its address
/// is `brain`'s, whose scheme must be `https`.
pub async fn connect(
    endpoint: Endpoint,
    brain: &Uri,
    server_name: &str,
    config: Arc<rustls::ClientConfig>,
) -> anyhow::Result<Channel> {
    if brain.scheme_str() != Some("https") {
        bail!("{brain}: a brain is reached over https");
    }
    let host = brain.host().context("a brain address without a host")?;
    let host = host.trim_matches(['[', ']']).to_string();
    let port = brain.port_u16().unwrap_or(443);
    let name = ServerName::try_from(server_name.to_string())
        .with_context(|| format!("{server_name:?} is not a server name"))?;
    let connector = tower::service_fn(move |_: Uri| {
        let (host, name, config) = (host.clone(), name.clone(), config.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await?;
            if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
                return Err(std::io::Error::other("the brain did not negotiate HTTP/2"));
            }
            Ok(TokioIo::new(tls))
        }
    });
    Ok(endpoint.connect_with_connector(connector).await?)
}

#[cfg(test)]
mod tests {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

    use super::*;

    fn ca_pem() -> String {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.self_signed(&key).unwrap().pem()
    }

    /// The configuration, and with it the session cache, lives as long as the files hold the
    /// same bytes; a rotated CA gives a new one at the next connection.
    #[test]
    fn the_configuration_is_kept_while_the_files_hold_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.crt");
        std::fs::write(&ca, ca_pem()).unwrap();
        let creds = Credentials {
            ca: ca.clone(),
            client_cert: None,
            token_file: None,
        };
        let tls = TlsClient::default();
        let first = tls.config(&creds).unwrap();
        assert!(Arc::ptr_eq(&first, &tls.config(&creds).unwrap()));
        assert_eq!(first.alpn_protocols, [b"h2".to_vec()]);
        std::fs::write(&ca, ca_pem()).unwrap();
        let rotated = tls.config(&creds).unwrap();
        assert!(!Arc::ptr_eq(&first, &rotated));
        assert!(Arc::ptr_eq(&rotated, &tls.config(&creds).unwrap()));
        std::fs::write(&ca, "").unwrap();
        assert!(tls.config(&creds).is_err(), "an empty CA file is refused");
    }
}
