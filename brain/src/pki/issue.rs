//! Making certificates: the brain's CA and the serving certificates it signs. ECDSA P-256 keys
//! (PKCS#8 PEM), which rustls, Go (grpcurl, kubelet-side tools) and openssl all read.
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use super::PkiError;

/// A certificate and its key, PEM. Its `Debug` never shows the key.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issued").finish_non_exhaustive()
    }
}

/// How far notBefore is set in the past, so that a client whose clock is a little behind the
/// brain's accepts a new certificate: five minutes, or a twentieth of a short lifetime.
pub fn backdate(validity: Duration) -> Duration {
    Duration::from_secs(300).min(validity / 20)
}

fn window(params: &mut CertificateParams, now: SystemTime, validity: Duration) {
    params.not_before = (now - backdate(validity)).into();
    params.not_after = (now + validity).into();
}

fn rcgen_error(what: &'static str) -> impl FnOnce(rcgen::Error) -> PkiError {
    move |e| PkiError::Certificate(format!("{what}: {e}"))
}

/// A new self-signed CA valid for `validity` from `now`. Its common name carries the time
/// (`splitproxy-brain-ca@<unix seconds>`), so that the CAs of a bundle have distinct names and
/// a client finds the one that signed a certificate by name.
pub fn new_ca(now: SystemTime, validity: Duration) -> Result<Issued, PkiError> {
    let key = KeyPair::generate().map_err(rcgen_error("generating the CA key"))?;
    let mut params =
        CertificateParams::new(Vec::<String>::new()).map_err(rcgen_error("CA parameters"))?;
    let stamp = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    params
        .distinguished_name
        .push(DnType::CommonName, format!("splitproxy-brain-ca@{stamp}"));
    // It signs serving certificates only, never another CA.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    window(&mut params, now, validity);
    let cert = params
        .self_signed(&key)
        .map_err(rcgen_error("self-signing the CA"))?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A serving certificate for `names` (IP addresses become IP SANs, the rest DNS SANs; the
/// first is also the common name), signed by `ca`, valid for `validity` from `now` but never
/// past `ca_not_after`: a certificate outliving its CA would fail before it is renewed.
pub fn new_serving(
    ca: &Issued,
    names: &[String],
    now: SystemTime,
    validity: Duration,
    ca_not_after: SystemTime,
) -> Result<Issued, PkiError> {
    let ca_key = KeyPair::from_pem(&ca.key_pem)
        .map_err(|_| PkiError::Certificate("ca.key is not a usable key".into()))?;
    let issuer =
        Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key).map_err(rcgen_error("reading the CA"))?;
    let key = KeyPair::generate().map_err(rcgen_error("generating the serving key"))?;
    let mut params = CertificateParams::new(Vec::<String>::new())
        .map_err(rcgen_error("serving certificate parameters"))?;
    for name in names {
        params.subject_alt_names.push(match name.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(
                name.clone()
                    .try_into()
                    .map_err(rcgen_error("a --tls-server-name"))?,
            ),
        });
    }
    if let Some(first) = names.first() {
        params
            .distinguished_name
            .push(DnType::CommonName, first.as_str());
    }
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let left = ca_not_after.duration_since(now).unwrap_or_default();
    window(&mut params, now, validity.min(left));
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(rcgen_error("signing the serving certificate"))?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}
