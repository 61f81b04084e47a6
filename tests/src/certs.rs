//! Throwaway PKI for tests: a CA, server certificates and client certificates.
//!
//! The brain and the actuators talk mTLS, and the actuator's client certificate decides which
//! node's state it may receive ("node scoped", docs/invariants.md), so end-to-end tests need a CA, a brain serving
//! certificate and one client certificate per node whose CN (and a DNS SAN) is the node name, in
//! the brain's node group ([`Pki::node_cert`]); operators' certificates are in its operator
//! group ([`Pki::operator_cert`]) (docs/protocol.md, "Who may call what").
//! The control plane uses the same CA for the API server's serving certificate and for client
//! authentication. Keys are ECDSA P-256 in PKCS#8 PEM, which rustls, Go and kube-apiserver read.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::Result;

/// A certificate and its private key, both PEM.
#[derive(Clone, Debug)]
pub struct CertPair {
    pub cert_pem: String,
    pub key_pem: String,
}

/// The group (certificate Organization) of node certificates: the brain's `--node-group` default.
pub const NODE_GROUP: &str = splitproxy_brain::auth::DEFAULT_NODE_GROUP;
/// The group of operator certificates: the brain's `--operator-group` default.
pub const OPERATOR_GROUP: &str = splitproxy_brain::auth::DEFAULT_OPERATOR_GROUP;

/// Paths of a written CA certificate, certificate and key.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A certificate authority that issues server and client certificates.
pub struct Pki {
    name: String,
    ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Pki {
    /// Creates a self-signed CA whose common name is `name`.
    pub fn new(name: &str) -> Result<Pki> {
        let key = KeyPair::generate().context("generating CA key")?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).context("self-signing CA")?;
        Ok(Pki {
            name: name.to_string(),
            ca_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A server certificate for `sans`: entries that parse as IP addresses become IP SANs
    /// (e.g. "127.0.0.1"), the others DNS SANs. The first entry is also the common name.
    pub fn server_cert(&self, sans: &[&str]) -> Result<CertPair> {
        let mut params = leaf_params(sans)?;
        if let Some(first) = sans.first() {
            params.distinguished_name.push(DnType::CommonName, *first);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params)
    }

    /// A client certificate with CN `common_name` and a DNS SAN of the same name, in no group:
    /// the brain refuses it (see [`Pki::node_cert`] and [`Pki::operator_cert`]).
    pub fn client_cert(&self, common_name: &str) -> Result<CertPair> {
        self.client_cert_with_groups(common_name, &[])
    }

    /// An actuator's certificate: CN and DNS SAN `node`, in the node group.
    pub fn node_cert(&self, node: &str) -> Result<CertPair> {
        self.client_cert_with_groups(node, &[NODE_GROUP])
    }

    /// An operator's certificate (grpcurl, tests reading `ListNodes`), in the operator group.
    pub fn operator_cert(&self, name: &str) -> Result<CertPair> {
        self.client_cert_with_groups(name, &[OPERATOR_GROUP])
    }

    /// A node certificate that expires `valid_for` from now (for tests of what happens then).
    pub fn node_cert_expiring(
        &self,
        node: &str,
        valid_for: std::time::Duration,
    ) -> Result<CertPair> {
        let mut params = leaf_params(&[node])?;
        params.distinguished_name.push(DnType::CommonName, node);
        params
            .distinguished_name
            .push(DnType::OrganizationName, NODE_GROUP);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let now = std::time::SystemTime::now();
        params.not_before = (now - std::time::Duration::from_secs(60)).into();
        params.not_after = (now + valid_for).into();
        self.sign(params)
    }

    /// A client certificate with CN `common_name`, a DNS SAN of the same name, and an
    /// organization for the group (Kubernetes maps O to groups, e.g. "system:masters"). rcgen
    /// writes one Organization per subject: with several groups, the last one is kept.
    pub fn client_cert_with_groups(&self, common_name: &str, groups: &[&str]) -> Result<CertPair> {
        let mut params = leaf_params(&[common_name])?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        for group in groups {
            params
                .distinguished_name
                .push(DnType::OrganizationName, *group);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params)
    }

    /// A certificate usable both as server and client (for peers that do both).
    pub fn peer_cert(&self, common_name: &str, sans: &[&str]) -> Result<CertPair> {
        let mut params = leaf_params(sans)?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> Result<CertPair> {
        let key = KeyPair::generate().context("generating key")?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .with_context(|| format!("signing certificate with CA {}", self.name))?;
        Ok(CertPair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Writes `ca.crt`, `<name>.crt` and `<name>.key` into `dir` (created if needed).
    pub fn write(&self, dir: &Path, name: &str, pair: &CertPair) -> Result<TlsFiles> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let files = TlsFiles {
            ca: dir.join("ca.crt"),
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
        };
        write_file(&files.ca, &self.ca_pem)?;
        write_file(&files.cert, &pair.cert_pem)?;
        write_file(&files.key, &pair.key_pem)?;
        Ok(files)
    }
}

fn leaf_params(sans: &[&str]) -> Result<CertificateParams> {
    let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
    let mut params = CertificateParams::new(sans).context("invalid subject alternative name")?;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.use_authority_key_identifier_extension = true;
    Ok(params)
}

/// Writes `contents` to `path`; private keys and certificates alike get mode 0600.
/// Writes `contents` to `path` atomically (a temporary file renamed over it), so that a process
/// reading the file while another certificate is issued into the same directory (every issue
/// rewrites `ca.crt`) sees the whole old or the whole new file, never a truncated one.
pub(crate) fn write_file(path: &Path, contents: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if fs::read(path).is_ok_and(|old| old == contents.as_bytes()) {
        return Ok(());
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut file = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    file.write_all(contents.as_bytes())
        .with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}
