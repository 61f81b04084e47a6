//! The brain's own CA as a client CA, for node certificates it issued itself
//! (`--pod-certificate-signer`, [`crate::podcert`]): the listener verifies client certificates
//! against the CA bundle the Secret holds now (current and previous CAs, so certificates from
//! before a CA rotation stay valid until they expire), and the signer signs with the current CA.
//! [`super::follow`] updates it with every new version of the Secret; no restart, no file.
use std::sync::{Arc, RwLock};

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

use super::store::Material;

/// The CA material last seen in the Secret, and a verifier built from its bundle.
pub struct OwnCa {
    /// Whether a caller may come without a client certificate (bearer tokens enabled).
    optional: bool,
    provider: Arc<rustls::crypto::CryptoProvider>,
    current: RwLock<Option<Current>>,
}

struct Current {
    bundle: String,
    ca_cert: String,
    ca_key: String,
    verifier: Arc<dyn ClientCertVerifier>,
}

impl std::fmt::Debug for OwnCa {
    // Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ready = self.current.read().map(|c| c.is_some()).unwrap_or(false);
        f.debug_struct("OwnCa").field("ready", &ready).finish()
    }
}

impl OwnCa {
    pub fn new(optional: bool) -> Self {
        OwnCa {
            optional,
            provider: Arc::new(rustls::crypto::ring::default_provider()),
            current: RwLock::new(None),
        }
    }

    /// Takes the Secret's CA bundle and key; returns whether they changed. A bundle that does
    /// not load keeps the previous one.
    pub fn update(&self, material: &Material) -> bool {
        if material.ca_crt.is_empty() || material.ca_key.is_empty() {
            return false;
        }
        let same = self
            .current
            .read()
            .map(|c| {
                c.as_ref()
                    .is_some_and(|c| c.bundle == material.ca_crt && c.ca_key == material.ca_key)
            })
            .unwrap_or(false);
        if same {
            return false;
        }
        let mut roots = rustls::RootCertStore::empty();
        let mut first = None;
        for der in <CertificateDer<'_> as rustls::pki_types::pem::PemObject>::pem_slice_iter(
            material.ca_crt.as_bytes(),
        )
        .flatten()
        {
            first.get_or_insert_with(|| der.clone());
            let _ = roots.add(der);
        }
        let Some(first) = first else {
            return false;
        };
        let mut builder =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), self.provider.clone());
        if self.optional {
            builder = builder.allow_unauthenticated();
        }
        let Ok(verifier) = builder.build() else {
            tracing::warn!(
                "the Secret's CA bundle does not load as a client CA; keeping the previous one"
            );
            return false;
        };
        let ca_cert = pem(&first);
        if let Ok(mut c) = self.current.write() {
            *c = Some(Current {
                bundle: material.ca_crt.clone(),
                ca_cert,
                ca_key: material.ca_key.clone(),
                verifier,
            });
        }
        true
    }

    /// The CA bundle client certificates are verified against now (PEM).
    pub fn bundle(&self) -> Option<String> {
        self.current.read().ok()?.as_ref().map(|c| c.bundle.clone())
    }

    fn verifier(&self) -> Option<Arc<dyn ClientCertVerifier>> {
        self.current
            .read()
            .ok()?
            .as_ref()
            .map(|c| c.verifier.clone())
    }
}

fn pem(der: &CertificateDer<'_>) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

impl crate::podcert::CaSource for OwnCa {
    fn signing_ca(&self) -> Option<(String, String)> {
        let c = self.current.read().ok()?;
        c.as_ref().map(|c| (c.ca_cert.clone(), c.ca_key.clone()))
    }
}

impl ClientCertVerifier for OwnCa {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        !self.optional
    }

    // No hints: clients present the one certificate they have.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        match self.verifier() {
            Some(v) => v.verify_client_cert(end_entity, intermediates, now),
            None => Err(rustls::Error::General(
                "the brain has no CA of its own yet".into(),
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
