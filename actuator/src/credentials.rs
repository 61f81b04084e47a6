//! How the actuator proves who it is to a brain, and how it knows the brain is one: the CA that
//! signed the brain's certificate, and a client certificate (files mode), a projected
//! ServiceAccount token, or both.
//!
//! Every file is read again when it is used, never kept: the kubelet rotates a projected token
//! (at 80% of its lifetime) and a certificate or CA may be rotated by whoever manages them, and
//! the actuator must pick each up without a restart. The CA and the certificate are read at every
//! connection ([`Credentials::material`]); the token at every connection and for every request
//! ([`Bearer`]), so a stream opened after a rotation presents the new token even on a connection
//! made before it. A file caught mid-rewrite fails one attempt, and the next one reads it whole.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;

/// Longest token file read. A ServiceAccount token is about 1 KiB; anything much larger is not
/// a token, and must not be sent on every request.
pub const MAX_TOKEN_BYTES: u64 = 64 * 1024;

/// A client certificate and its key (PEM files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    /// Client certificate naming this node.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

/// Where the actuator's credentials are; at least one of `client_cert` and `token_file` is set
/// (config.rs refuses a configuration without either).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// CA that signed the brain's certificate (PEM; may hold several, for a CA rotation).
    pub ca: PathBuf,
    /// Presented in the TLS handshake when set (`--tls-cert`, `--tls-key`).
    pub client_cert: Option<CertFiles>,
    /// A projected ServiceAccount token, sent as `authorization: Bearer` (`--token-file`).
    pub token_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0} is empty")]
    Empty(PathBuf),
    #[error("{path} holds {len} bytes, more than a token's {MAX_TOKEN_BYTES}")]
    TooLarge { path: PathBuf, len: u64 },
    #[error("{0} holds characters a bearer token cannot carry")]
    NotAToken(PathBuf),
}

impl Credentials {
    /// The CA bundle and client certificate as the files hold them now, for the TLS client
    /// ([`crate::tls_client`]).
    pub fn material(&self) -> Result<Material, CredentialError> {
        let client = match &self.client_cert {
            Some(c) => Some((read_pem(&c.cert)?, read_pem(&c.key)?)),
            None => None,
        };
        Ok(Material {
            ca: read_pem(&self.ca)?,
            client,
        })
    }

    /// What adds the token to each request (nothing without a token file).
    pub fn bearer(&self) -> Bearer {
        Bearer {
            token_file: self.token_file.as_deref().map(Arc::from),
        }
    }

    /// Every file there, readable now: a misconfiguration shows at start, not as a stream of
    /// failed connections.
    pub fn check(&self) -> Result<(), CredentialError> {
        read_pem(&self.ca)?;
        if let Some(c) = &self.client_cert {
            read_pem(&c.cert)?;
            read_pem(&c.key)?;
        }
        if let Some(t) = &self.token_file {
            authorization(t)?;
        }
        Ok(())
    }
}

/// The contents of the TLS files: the CA bundle, and the client certificate and key.
#[derive(PartialEq, Eq)]
pub struct Material {
    pub ca: Vec<u8>,
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

fn read_pem(path: &Path) -> Result<Vec<u8>, CredentialError> {
    let pem = std::fs::read(path).map_err(|source| CredentialError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    if pem.is_empty() {
        return Err(CredentialError::Empty(path.to_path_buf()));
    }
    Ok(pem)
}

/// `Bearer <token>` from the token file as it is now.
pub fn authorization(path: &Path) -> Result<AsciiMetadataValue, CredentialError> {
    use std::io::Read;
    let read = |source| CredentialError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read)?;
    let mut text = String::new();
    let len = file
        .take(MAX_TOKEN_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read)? as u64;
    if len > MAX_TOKEN_BYTES {
        return Err(CredentialError::TooLarge {
            path: path.to_path_buf(),
            len,
        });
    }
    let token = text.trim();
    if token.is_empty() {
        return Err(CredentialError::Empty(path.to_path_buf()));
    }
    // A JWT is base64url and dots; a space or a control character would split the header.
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(CredentialError::NotAToken(path.to_path_buf()));
    }
    MetadataValue::try_from(format!("Bearer {token}"))
        .map_err(|_| CredentialError::NotAToken(path.to_path_buf()))
}

/// Adds `authorization: Bearer <token>` to every request, reading the token file each time (a
/// small read of a tmpfs file, a few times per connection: the `Sync` stream, health checks).
/// Without a token file it adds nothing. A token file that cannot be read fails the request
/// before it is sent, with UNAUTHENTICATED and the reason.
#[derive(Debug, Clone, Default)]
pub struct Bearer {
    token_file: Option<Arc<Path>>,
}

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(path) = &self.token_file {
            let value = authorization(path)
                .map_err(|e| tonic::Status::unauthenticated(format!("token file: {e}")))?;
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request_through(bearer: &mut Bearer) -> Result<Option<String>, tonic::Status> {
        let r = bearer.call(tonic::Request::new(()))?;
        Ok(r.metadata()
            .get("authorization")
            .map(|v| v.to_str().unwrap().to_owned()))
    }

    /// The token is read for every request: a rotation shows on the next one, without a new
    /// interceptor.
    #[test]
    fn every_request_carries_the_token_as_it_is_now() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first.jwt.sig\n").unwrap();
        let creds = Credentials {
            ca: dir.path().join("ca"),
            client_cert: None,
            token_file: Some(path.clone()),
        };
        let mut bearer = creds.bearer();
        assert_eq!(
            request_through(&mut bearer).unwrap().as_deref(),
            Some("Bearer first.jwt.sig")
        );
        // The kubelet writes a new file and swaps it in.
        let next = dir.path().join("token.new");
        std::fs::write(&next, "second.jwt.sig").unwrap();
        std::fs::rename(&next, &path).unwrap();
        assert_eq!(
            request_through(&mut bearer).unwrap().as_deref(),
            Some("Bearer second.jwt.sig")
        );
        // Gone: the request fails before it leaves, and says why.
        std::fs::remove_file(&path).unwrap();
        let e = request_through(&mut bearer).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("token"), "{}", e.message());
    }

    #[test]
    fn no_token_file_adds_nothing() {
        assert_eq!(request_through(&mut Bearer::default()).unwrap(), None);
    }

    #[test]
    fn what_is_not_a_token_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        for (content, want) in [
            ("", "empty"),
            (" \n", "empty"),
            ("two words", "characters"),
            ("tab\there", "characters"),
            ("é", "characters"),
        ] {
            std::fs::write(&path, content).unwrap();
            let e = authorization(&path).unwrap_err().to_string();
            assert!(e.contains(want), "{content:?}: {e}");
        }
        std::fs::write(&path, "x".repeat(MAX_TOKEN_BYTES as usize + 1)).unwrap();
        assert!(matches!(
            authorization(&path),
            Err(CredentialError::TooLarge { .. })
        ));
    }

    /// The files are checked at start; the TLS settings are built from them at each connection.
    #[test]
    fn check_names_the_file_that_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.crt");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").unwrap();
        let mut creds = Credentials {
            ca: ca.clone(),
            client_cert: Some(CertFiles {
                cert: dir.path().join("tls.crt"),
                key: dir.path().join("tls.key"),
            }),
            token_file: None,
        };
        let e = creds.check().unwrap_err().to_string();
        assert!(e.contains("tls.crt"), "{e}");
        creds.client_cert = None;
        creds.token_file = Some(dir.path().join("token"));
        let e = creds.check().unwrap_err().to_string();
        assert!(e.contains("token"), "{e}");
        std::fs::write(dir.path().join("token"), "t").unwrap();
        creds.check().unwrap();
        std::fs::write(&ca, "").unwrap();
        assert!(matches!(creds.check(), Err(CredentialError::Empty(p)) if p == ca));
    }
}
