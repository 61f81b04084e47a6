//! The signer's decision for one PodCertificateRequest, as a pure function: whom the request is
//! for, whether splitproxy issues it, and the certificate it issues.
//!
//! The API server has already checked what only it can (the request was created by the kubelet
//! of `spec.nodeName`, for a pod bound to that node running as `spec.serviceAccountName`, with a
//! CSR signed by the key it names: the Node authorizer, NodeRestriction and the request's
//! admission). The signer adds its own policy: only the actuator's ServiceAccount in the
//! actuator's namespace gets a certificate, and the certificate names exactly the request's node,
//! in the node group, so the brain's existing role decision ([`crate::auth::roles`]) applies to
//! it unchanged ("node scoped", docs/invariants.md).
use std::time::{Duration, SystemTime};

use x509_parser::prelude::FromDer;

/// What the signer does with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Issue this chain (leaf first, PEM), valid over this window.
    Issue(Issued),
    /// A `Denied` condition with this reason and message (the request can never be issued).
    Deny {
        reason: &'static str,
        message: String,
    },
}

/// An issued certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    pub chain_pem: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// When the kubelet should ask again: half-way, so a brain outage of half a lifetime costs
    /// nothing.
    pub begin_refresh_at: SystemTime,
}

/// The request fields the decision reads.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub namespace: &'a str,
    pub service_account: &'a str,
    pub node: &'a str,
    pub max_expiration_seconds: Option<i32>,
    /// The kubelet's stub PKCS#10 request (DER): only its public key is used.
    pub stub_csr_der: &'a [u8],
}

/// Who may have a certificate and what it says.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The actuator's ServiceAccount (`namespace`, `name`).
    pub service_account: (String, String),
    /// The Organization of issued certificates: the brain's node group.
    pub node_group: String,
    /// The longest lifetime issued (the request may ask for less).
    pub max_lifetime: Duration,
}

/// The issuing CA: its certificate and key (PEM).
pub struct Ca<'a> {
    pub cert_pem: &'a str,
    pub key_pem: &'a str,
}

/// The shortest lifetime the API server accepts for a pod certificate.
const MIN_LIFETIME: Duration = Duration::from_secs(3600);
/// Clock skew allowed for between the brain and the nodes.
const BACKDATE: Duration = Duration::from_secs(120);

/// Why issuing failed (a `Failed` condition would be wrong: these are the signer's own
/// problems, retried).
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error("the CA cannot sign: {0}")]
    Ca(String),
    #[error("signing failed: {0}")]
    Sign(#[from] rcgen::Error),
}

/// Decides on `request` under `policy`, signing with `ca` at `now`.
pub fn decide(
    request: &Request<'_>,
    policy: &Policy,
    ca: &Ca<'_>,
    now: SystemTime,
) -> Result<Decision, IssueError> {
    let (ns, sa) = &policy.service_account;
    if request.namespace != ns || request.service_account != sa {
        return Ok(Decision::Deny {
            reason: "ServiceAccountNotAllowed",
            message: format!(
                "splitproxy issues node certificates to the actuator's ServiceAccount {ns}/{sa} only, not {}/{}",
                request.namespace, request.service_account
            ),
        });
    }
    if !crate::auth::valid_node_name(request.node) {
        return Ok(Decision::Deny {
            reason: "InvalidNodeName",
            message: "the node name is not a Kubernetes object name".into(),
        });
    }
    let key = match public_key(request.stub_csr_der) {
        Ok(k) => k,
        Err(message) => {
            return Ok(Decision::Deny {
                reason: "UnsupportedKeyType",
                message: format!("{message}; use ECDSAP256 (or ECDSAP384, ED25519)"),
            });
        }
    };
    let asked = request
        .max_expiration_seconds
        .map(|s| Duration::from_secs(s.max(0) as u64))
        .unwrap_or(policy.max_lifetime);
    let lifetime = asked.min(policy.max_lifetime).max(MIN_LIFETIME);
    // Whole seconds: the certificate holds no more, and the request's status must repeat its
    // validity exactly.
    let now = SystemTime::UNIX_EPOCH
        + Duration::from_secs(
            now.duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or(Duration::ZERO)
                .as_secs(),
        );
    let not_before = now.checked_sub(BACKDATE).unwrap_or(now);
    let not_after = not_before + lifetime;

    let mut params = rcgen::CertificateParams::new(vec![request.node.to_string()])?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, request.node);
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, policy.node_group.as_str());
    params.not_before = not_before.into();
    params.not_after = not_after.into();
    params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    let ca_key = rcgen::KeyPair::from_pem(ca.key_pem).map_err(|e| IssueError::Ca(e.to_string()))?;
    let issuer = rcgen::Issuer::from_ca_cert_pem(ca.cert_pem, ca_key)
        .map_err(|e| IssueError::Ca(e.to_string()))?;
    let leaf = params.signed_by(&key, &issuer)?;
    Ok(Decision::Issue(Issued {
        chain_pem: leaf.pem(),
        not_before,
        not_after,
        begin_refresh_at: not_before + lifetime / 2,
    }))
}

/// A subject public key taken from a CSR.
struct SubjectKey {
    der: Vec<u8>,
    alg: &'static rcgen::SignatureAlgorithm,
}

impl rcgen::PublicKeyData for SubjectKey {
    fn der_bytes(&self) -> &[u8] {
        &self.der
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        self.alg
    }
}

/// The public key of a DER PKCS#10 request, if it is of a type the brain signs for.
fn public_key(csr_der: &[u8]) -> Result<SubjectKey, String> {
    use x509_parser::oid_registry::{
        OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_NIST_EC_P384, OID_SIG_ED25519,
    };
    let (_, csr) = x509_parser::certification_request::X509CertificationRequest::from_der(csr_der)
        .map_err(|e| format!("the request's CSR does not parse: {e}"))?;
    let spki = &csr.certification_request_info.subject_pki;
    let alg = &spki.algorithm;
    let der = spki.subject_public_key.data.to_vec();
    let chosen = if alg.algorithm == OID_SIG_ED25519 {
        &rcgen::PKCS_ED25519
    } else if alg.algorithm == OID_KEY_TYPE_EC_PUBLIC_KEY {
        let curve = alg
            .parameters
            .as_ref()
            .and_then(|p| p.as_oid().ok())
            .ok_or("an EC key without a named curve")?;
        if curve == OID_EC_P256 {
            &rcgen::PKCS_ECDSA_P256_SHA256
        } else if curve == OID_NIST_EC_P384 {
            &rcgen::PKCS_ECDSA_P384_SHA384
        } else {
            return Err(format!("the EC curve {curve} is not supported"));
        }
    } else {
        return Err(format!("the key type {} is not supported", alg.algorithm));
    };
    Ok(SubjectKey { der, alg: chosen })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "test ca");
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn stub(alg: &'static rcgen::SignatureAlgorithm) -> Vec<u8> {
        let key = rcgen::KeyPair::generate_for(alg).unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.serialize_request(&key).unwrap().der().to_vec()
    }

    fn policy() -> Policy {
        Policy {
            service_account: ("kube-system".into(), "splitproxy-actuator".into()),
            node_group: "splitproxy:nodes".into(),
            max_lifetime: Duration::from_secs(86400),
        }
    }

    fn request<'a>(csr: &'a [u8], sa: &'a str, max: Option<i32>) -> Request<'a> {
        Request {
            namespace: "kube-system",
            service_account: sa,
            node: "node-1",
            max_expiration_seconds: max,
            stub_csr_der: csr,
        }
    }

    #[test]
    fn the_actuators_account_gets_a_certificate_naming_its_node_in_the_node_group() {
        let (cert, key) = ca();
        let ca = Ca {
            cert_pem: &cert,
            key_pem: &key,
        };
        let now = SystemTime::now();
        for alg in [
            &rcgen::PKCS_ECDSA_P256_SHA256,
            &rcgen::PKCS_ECDSA_P384_SHA384,
            &rcgen::PKCS_ED25519,
        ] {
            let csr = stub(alg);
            let Decision::Issue(issued) = decide(
                &request(&csr, "splitproxy-actuator", Some(7200)),
                &policy(),
                &ca,
                now,
            )
            .unwrap() else {
                panic!("not issued for {alg:?}");
            };
            // What the brain reads from a client certificate: the same function as for files.
            use rustls::pki_types::CertificateDer;
            use rustls::pki_types::pem::PemObject;
            let der = CertificateDer::pem_slice_iter(issued.chain_pem.as_bytes())
                .next()
                .unwrap()
                .unwrap();
            let identity = crate::tls::identity_of_chain(&[der]).unwrap();
            assert!(
                identity.names.contains(&"node-1".to_string()),
                "{identity:?}"
            );
            assert_eq!(identity.groups, vec!["splitproxy:nodes".to_string()]);
            let lifetime = issued.not_after.duration_since(issued.not_before).unwrap();
            assert_eq!(lifetime, Duration::from_secs(7200), "the request's maximum");
            assert!(issued.begin_refresh_at > issued.not_before);
            assert!(issued.begin_refresh_at < issued.not_after);
        }
    }

    #[test]
    fn other_accounts_and_key_types_are_denied() {
        let (cert, key) = ca();
        let ca = Ca {
            cert_pem: &cert,
            key_pem: &key,
        };
        let now = SystemTime::now();
        let csr = stub(&rcgen::PKCS_ECDSA_P256_SHA256);
        let d = decide(&request(&csr, "default", None), &policy(), &ca, now).unwrap();
        assert!(
            matches!(
                d,
                Decision::Deny {
                    reason: "ServiceAccountNotAllowed",
                    ..
                }
            ),
            "{d:?}"
        );
        let d = decide(
            &request(b"garbage", "splitproxy-actuator", None),
            &policy(),
            &ca,
            now,
        )
        .unwrap();
        assert!(
            matches!(
                d,
                Decision::Deny {
                    reason: "UnsupportedKeyType",
                    ..
                }
            ),
            "{d:?}"
        );
    }

    #[test]
    fn lifetimes_stay_within_the_api_servers_bounds() {
        let (cert, key) = ca();
        let ca = Ca {
            cert_pem: &cert,
            key_pem: &key,
        };
        let csr = stub(&rcgen::PKCS_ECDSA_P256_SHA256);
        let now = SystemTime::now();
        for (asked, want) in [(None, 86400), (Some(600), 3600), (Some(10_000_000), 86400)] {
            let Decision::Issue(i) = decide(
                &request(&csr, "splitproxy-actuator", asked),
                &policy(),
                &ca,
                now,
            )
            .unwrap() else {
                panic!("denied")
            };
            let lifetime = i.not_after.duration_since(i.not_before).unwrap();
            assert_eq!(lifetime, Duration::from_secs(want), "{asked:?}");
        }
    }
}
