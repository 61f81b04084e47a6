//! Reading what the Secret and the ConfigMap hold into the [`Facts`] the decision takes: the
//! bundle's CAs and their windows, which of them the Secret's `ca.key` belongs to, and the
//! serving certificate's window, issuer and names. Nothing here logs or returns key material.
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use rcgen::{KeyPair, PublicKeyData};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use super::plan::{Facts, Issuer, Leaf, Window};
use super::store::Material;

/// One CA of a bundle: its PEM block as written, and what the decision needs of it.
#[derive(Debug, Clone)]
pub struct Ca {
    pub pem: String,
    pub window: Window,
    subject: Vec<u8>,
    public_key: Vec<u8>,
}

/// The `CERTIFICATE` blocks of a PEM text, each as written (with a final newline).
pub fn pem_blocks(text: &str) -> Vec<String> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut blocks = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(BEGIN) {
        let Some(len) = rest[start..].find(END) else {
            break;
        };
        let end = start + len + END.len();
        blocks.push(format!("{}\n", &rest[start..end]));
        rest = &rest[end..];
    }
    blocks
}

/// Several PEM blocks as one bundle text.
pub fn bundle_text<'a>(blocks: impl IntoIterator<Item = &'a str>) -> String {
    blocks.into_iter().collect()
}

fn time(t: x509_parser::time::ASN1Time) -> SystemTime {
    match u64::try_from(t.timestamp()) {
        Ok(s) => SystemTime::UNIX_EPOCH + Duration::from_secs(s),
        Err(_) => SystemTime::UNIX_EPOCH,
    }
}

fn window_of(cert: &X509Certificate<'_>) -> Window {
    Window {
        not_before: time(cert.validity().not_before),
        not_after: time(cert.validity().not_after),
    }
}

fn der_of(block: &str) -> Option<CertificateDer<'static>> {
    CertificateDer::from_pem_slice(block.as_bytes()).ok()
}

/// The CAs of a bundle text; blocks that do not parse are left out.
pub fn parse_bundle(text: &str) -> Vec<Ca> {
    pem_blocks(text)
        .into_iter()
        .filter_map(|pem| {
            let der = der_of(&pem)?;
            let (_, cert) = X509Certificate::from_der(der.as_ref()).ok()?;
            Some(Ca {
                window: window_of(&cert),
                subject: cert.subject().as_raw().to_vec(),
                public_key: cert.public_key().subject_public_key.data.to_vec(),
                pem,
            })
        })
        .collect()
}

/// The raw public key of a PEM private key, if it is one.
fn public_key_of(key_pem: &str) -> Option<Vec<u8>> {
    KeyPair::from_pem(key_pem)
        .ok()
        .map(|k| k.der_bytes().to_vec())
}

/// The CA of `bundle` whose key `ca_key` is.
pub fn current_ca<'a>(bundle: &'a [Ca], ca_key: &str) -> Option<&'a Ca> {
    let public = public_key_of(ca_key)?;
    bundle.iter().find(|ca| ca.public_key == public)
}

/// A name as a certificate states it: IP addresses in their canonical text.
fn canonical(name: &str) -> String {
    name.parse::<IpAddr>()
        .map(|ip| ip.to_string())
        .unwrap_or_else(|_| name.to_string())
}

fn names_of(cert: &X509Certificate<'_>) -> Vec<String> {
    let mut names = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(d) => names.push(d.to_string()),
                GeneralName::IPAddress(bytes) => {
                    let ip = match bytes.len() {
                        4 => <[u8; 4]>::try_from(*bytes).ok().map(IpAddr::from),
                        16 => <[u8; 16]>::try_from(*bytes).ok().map(IpAddr::from),
                        _ => None,
                    };
                    if let Some(ip) = ip {
                        names.push(ip.to_string());
                    }
                }
                _ => {}
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

/// The serving certificate of `material`, if `tls.crt` holds one whose key is `tls.key`.
fn leaf(
    material: &Material,
    bundle: &[Ca],
    current: Option<&Ca>,
    names: &[String],
) -> Option<Leaf> {
    let der = der_of(pem_blocks(&material.tls_crt).first()?)?;
    let (_, cert) = X509Certificate::from_der(der.as_ref()).ok()?;
    if public_key_of(&material.tls_key)? != cert.public_key().subject_public_key.data.as_ref() {
        return None;
    }
    let issuer = cert.issuer().as_raw();
    let issuer = if current.is_some_and(|ca| ca.subject == issuer) {
        Issuer::Current
    } else if bundle.iter().any(|ca| ca.subject == issuer) {
        Issuer::Previous
    } else {
        Issuer::Unknown
    };
    let mut wanted: Vec<String> = names.iter().map(|n| canonical(n)).collect();
    wanted.sort();
    wanted.dedup();
    Some(Leaf {
        window: window_of(&cert),
        issuer,
        names_match: names_of(&cert) == wanted,
    })
}

/// What the writer decides from: the Secret's `material`, the ConfigMap's `ca.crt` if there
/// is one, and the configured server names.
pub fn facts(material: &Material, published: Option<&str>, names: &[String]) -> Facts {
    let bundle = parse_bundle(&material.ca_crt);
    let current = current_ca(&bundle, &material.ca_key);
    Facts {
        ca: current.map(|ca| ca.window),
        bundle: bundle.iter().map(|ca| ca.window).collect(),
        published: !material.ca_crt.is_empty() && published == Some(material.ca_crt.as_str()),
        leaf: leaf(material, &bundle, current, names),
    }
}

#[cfg(test)]
mod tests {
    use super::super::issue::{new_ca, new_serving};
    use super::super::plan::{Action, next};
    use super::*;

    fn names() -> Vec<String> {
        vec!["splitproxy-brain".into(), "127.0.0.1".into()]
    }

    /// Certificates made by `issue` read back as what they are, and the decisions follow.
    #[test]
    fn issued_certificates_read_back_as_facts() {
        let now = SystemTime::now();
        let year = Duration::from_secs(365 * 86_400);
        let ca = new_ca(now, year).unwrap();
        let mut material = Material {
            ca_crt: ca.cert_pem.clone(),
            ca_key: ca.key_pem.clone(),
            ..Material::default()
        };
        let f = facts(&material, None, &names());
        let ca_window = f.ca.unwrap();
        assert_eq!(f.bundle, [ca_window]);
        assert!(!f.published && f.leaf.is_none());
        let secs = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs();
        assert_eq!(secs(ca_window.not_after), secs(now + year));
        assert_eq!(
            secs(ca_window.not_before),
            secs(now - Duration::from_secs(300))
        );
        assert_eq!(next(now, &f), Action::Publish);

        // The leaf: never past its CA, named as configured, issued by the current CA.
        let leaf = new_serving(&ca, &names(), now, 2 * year, ca_window.not_after).unwrap();
        material.tls_crt = leaf.cert_pem.clone();
        material.tls_key = leaf.key_pem.clone();
        let f = facts(&material, Some(&material.ca_crt), &names());
        assert!(f.published);
        let l = f.leaf.unwrap();
        assert_eq!(l.issuer, Issuer::Current);
        assert!(l.names_match);
        assert_eq!(secs(l.window.not_after), secs(ca_window.not_after));
        assert_eq!(
            next(now, &f),
            Action::Wait(l.window.renew_at().min(ca_window.renew_at()))
        );
        // Other names, or a key that is not the certificate's, call for a new certificate.
        let other = facts(&material, Some(&material.ca_crt), &["other".to_string()]);
        assert!(!other.leaf.unwrap().names_match);
        let mut wrong_key = material.clone();
        wrong_key.tls_key = ca.key_pem.clone();
        assert_eq!(
            facts(&wrong_key, Some(&material.ca_crt), &names()).leaf,
            None
        );

        // A new CA at the head of the bundle: the leaf's issuer is now the previous CA, and the
        // bundle is not published until the ConfigMap says so.
        let ca2 = new_ca(now + Duration::from_secs(1), year).unwrap();
        let old_bundle = material.ca_crt.clone();
        material.ca_crt = bundle_text([ca2.cert_pem.as_str(), ca.cert_pem.as_str()]);
        material.ca_key = ca2.key_pem.clone();
        let f = facts(&material, Some(&old_bundle), &names());
        assert_eq!(f.bundle.len(), 2);
        assert!(!f.published);
        assert_eq!(f.leaf.unwrap().issuer, Issuer::Previous);
        assert_eq!(parse_bundle(&material.ca_crt)[1].pem, ca.cert_pem);
        // A key that belongs to no CA of the bundle: no current CA.
        material.ca_key = leaf.key_pem.clone();
        assert_eq!(facts(&material, None, &names()).ca, None);
        // A leaf from a CA not in the bundle is unknown to clients.
        material.ca_crt = ca2.cert_pem.clone();
        material.ca_key = ca2.key_pem.clone();
        assert_eq!(
            facts(&material, None, &names()).leaf.unwrap().issuer,
            Issuer::Unknown
        );
        assert!(!format!("{:?}", ca).contains("PRIVATE"));
    }

    #[test]
    fn pem_blocks_are_split_as_written_and_garbage_is_left_out() {
        let ca = new_ca(SystemTime::now(), Duration::from_secs(60)).unwrap();
        let text = format!("junk\n{}\n\n{}trailing", ca.cert_pem, ca.cert_pem);
        assert_eq!(
            pem_blocks(&text),
            [ca.cert_pem.clone(), ca.cert_pem.clone()]
        );
        let broken = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert_eq!(parse_bundle(&format!("{broken}{}", ca.cert_pem)).len(), 1);
    }
}
