//! TLS session tickets that every brain replica can open, so that a node moving to another
//! replica (failover) or back to a restarted one resumes its TLS session instead of running a
//! full handshake.
//!
//! A full handshake costs the brain a signature, the verification of the client's chain and
//! its signature, and a key exchange (about 0.3 ms of CPU, and as much on the node); a resumed
//! one only the key exchange (`psk_dhe_ke`: forward secrecy is kept). When a replica dies, its
//! nodes reconnect to the others within a second or so, thousands of handshakes on replicas that
//! are busy serving their own nodes. rustls' own ticketer keys are random per process, and its
//! session cache is per process too, so no ticket survived a failover or a restart.
//!
//! The ticket key is derived (HKDF-SHA256) from what every replica shares and nothing else
//! has: a digest of the serving private key (every replica serves the same certificate, from
//! the same files or Secret), and a digest of the client trust (the client CA bundle). So:
//!
//! - a ticket one replica issued opens at every other replica, and at a restarted one;
//! - rotating the serving key, or changing the client CA (dropping a CA that must no longer be
//!   trusted), invalidates every ticket: the next connection is a full handshake, verified
//!   against the trust of the moment;
//! - keys roll every [`PERIOD_SECS`] seconds: a ticket opens in the period it was issued in and the next one
//!   (at most two periods old), and is refused after.
//!
//! What a resumed session carries is the client's certificate chain as verified at the full
//! handshake: the identity, groups and expiry the brain reads from it are the same, and the
//! listener still closes the connection when that certificate expires.
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf::{HKDF_SHA256, Salt};
use ring::rand::{SecureRandom, SystemRandom};
use rustls::server::ProducesTickets;
use sha2::{Digest, Sha256};

use crate::pki::own_ca::OwnCa;
use crate::tls::ServingCert;

/// How long one ticket key is used for issuing; it still opens tickets during the next period.
pub const PERIOD_SECS: u64 = 1800;

/// The ticket format's version, the first byte of every ticket.
const VERSION: u8 = 1;
/// Version and period, authenticated (the AEAD's associated data).
const HEADER: usize = 1 + 8;
const TAG: usize = 16;
/// Separates this use of the key digest from any other.
const SALT: &[u8] = b"splitproxy brain TLS session tickets v1";

/// A digest of the serving key: 32 bytes that only holders of the key can compute.
pub fn key_digest(key_der: &[u8]) -> [u8; 32] {
    Sha256::new()
        .chain_update(b"splitproxy ticket seed")
        .chain_update(key_der)
        .finalize()
        .into()
}

/// A digest of the client trust (PEM bundle; empty when no client certificate is asked for).
pub fn trust_digest(bundle: &[u8]) -> [u8; 32] {
    Sha256::new()
        .chain_update(b"splitproxy client trust")
        .chain_update(bundle)
        .finalize()
        .into()
}

/// Where the serving key's digest comes from.
#[derive(Debug, Clone)]
pub enum ServingSeed {
    /// Read from `--tls-key` with the configuration (rebuilt when the file changes).
    Fixed([u8; 32]),
    /// The certificate last installed from the Secret, followed as it rotates.
    Managed(Arc<ServingCert>),
}

/// Where the client trust's digest comes from.
#[derive(Debug, Clone)]
pub enum Trust {
    /// The `--client-ca` file read with the configuration (or no client CA).
    Fixed([u8; 32]),
    /// The brain's own CA bundle, followed as the Secret changes.
    Own(Arc<OwnCa>),
}

/// The replicas' shared ticketer (rustls' [`ProducesTickets`]).
pub struct SharedTickets {
    serving: ServingSeed,
    trust: Trust,
    rng: SystemRandom,
}

impl std::fmt::Debug for SharedTickets {
    // Never key material.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedTickets").finish_non_exhaustive()
    }
}

impl SharedTickets {
    pub fn new(serving: ServingSeed, trust: Trust) -> Self {
        SharedTickets {
            serving,
            trust,
            rng: SystemRandom::new(),
        }
    }

    /// The key of `period`, from the serving key and the client trust of the moment; `None`
    /// before there is a serving certificate or a CA to trust.
    fn key(&self, period: u64) -> Option<LessSafeKey> {
        let seed = match &self.serving {
            ServingSeed::Fixed(d) => *d,
            ServingSeed::Managed(cert) => cert.ticket_seed()?,
        };
        let trust = match &self.trust {
            Trust::Fixed(d) => *d,
            Trust::Own(ca) => trust_digest(ca.bundle()?.as_bytes()),
        };
        let prk = Salt::new(HKDF_SHA256, SALT).extract(&[seed, trust].concat());
        let period = period.to_be_bytes();
        let info = [&period[..]];
        let okm = prk.expand(&info, &AES_256_GCM).ok()?;
        Some(LessSafeKey::new(UnboundKey::from(okm)))
    }

    fn encrypt_at(&self, plain: &[u8], now: u64) -> Option<Vec<u8>> {
        let period = now / PERIOD_SECS;
        let key = self.key(period)?;
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).ok()?;
        // One allocation: header, nonce, the state sealed where it lies, the tag.
        let mut out = Vec::with_capacity(HEADER + NONCE_LEN + plain.len() + TAG);
        out.push(VERSION);
        out.extend_from_slice(&period.to_be_bytes());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plain);
        let (head, body) = out.split_at_mut(HEADER + NONCE_LEN);
        let tag = key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&head[..HEADER]),
                body,
            )
            .ok()?;
        out.extend_from_slice(tag.as_ref());
        Some(out)
    }

    fn decrypt_at(&self, ticket: &[u8], now: u64) -> Option<Vec<u8>> {
        if ticket.len() < HEADER + NONCE_LEN + TAG || ticket[0] != VERSION {
            return None;
        }
        let period = u64::from_be_bytes(ticket[1..HEADER].try_into().ok()?);
        let current = now / PERIOD_SECS;
        if period != current && period.checked_add(1) != Some(current) {
            return None;
        }
        let key = self.key(period)?;
        let nonce = Nonce::try_assume_unique_for_key(&ticket[HEADER..HEADER + NONCE_LEN]).ok()?;
        let mut plain = ticket[HEADER + NONCE_LEN..].to_vec();
        let len = key
            .open_in_place(nonce, Aad::from(&ticket[..HEADER]), &mut plain)
            .ok()?
            .len();
        plain.truncate(len);
        Some(plain)
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

impl ProducesTickets for SharedTickets {
    fn enabled(&self) -> bool {
        true
    }

    /// What the client is told: a ticket issued now opens for at least this long.
    fn lifetime(&self) -> u32 {
        PERIOD_SECS as u32
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        self.encrypt_at(plain, now_secs())
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.decrypt_at(cipher, now_secs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tickets(key: &[u8], trust: &[u8]) -> SharedTickets {
        SharedTickets::new(
            ServingSeed::Fixed(key_digest(key)),
            Trust::Fixed(trust_digest(trust)),
        )
    }

    const NOW: u64 = 1_800_000_000;

    #[test]
    fn a_ticket_opens_at_every_replica_with_the_same_key_and_trust() {
        let (a, b) = (tickets(b"key", b"ca"), tickets(b"key", b"ca"));
        let t = a.encrypt_at(b"session state", NOW).unwrap();
        assert_eq!(b.decrypt_at(&t, NOW).unwrap(), b"session state");
        // Random nonces: the same state never gives the same ticket.
        assert_ne!(t, a.encrypt_at(b"session state", NOW).unwrap());
    }

    #[test]
    fn another_serving_key_or_client_trust_opens_nothing() {
        let t = tickets(b"key", b"ca").encrypt_at(b"s", NOW).unwrap();
        assert!(tickets(b"other key", b"ca").decrypt_at(&t, NOW).is_none());
        assert!(tickets(b"key", b"a new ca").decrypt_at(&t, NOW).is_none());
    }

    #[test]
    fn a_ticket_opens_for_its_period_and_the_next_only() {
        let r = tickets(b"key", b"ca");
        let start = NOW - NOW % PERIOD_SECS;
        let t = r.encrypt_at(b"s", start).unwrap();
        assert!(r.decrypt_at(&t, start + PERIOD_SECS - 1).is_some());
        assert!(r.decrypt_at(&t, start + 2 * PERIOD_SECS - 1).is_some());
        assert!(r.decrypt_at(&t, start + 2 * PERIOD_SECS).is_none());
        // Nor before it was issued (a replica whose clock is behind by a period).
        assert!(r.decrypt_at(&t, start - 1).is_none());
    }

    #[test]
    fn a_tampered_or_short_ticket_is_refused() {
        let r = tickets(b"key", b"ca");
        let t = r.encrypt_at(b"session state", NOW).unwrap();
        for i in 0..t.len() {
            let mut bad = t.clone();
            bad[i] ^= 1;
            assert!(r.decrypt_at(&bad, NOW).is_none(), "byte {i} flipped");
        }
        for len in 0..t.len() {
            assert!(r.decrypt_at(&t[..len], NOW).is_none(), "cut at {len}");
        }
    }

    /// A managed certificate (the Secret's) is followed: a rotated key opens no earlier ticket.
    #[test]
    fn a_rotated_managed_key_opens_no_earlier_ticket() {
        let install = |cert: &ServingCert| {
            let key = rcgen::KeyPair::generate().unwrap();
            let pem = rcgen::CertificateParams::new(vec!["brain".to_string()])
                .unwrap()
                .self_signed(&key)
                .unwrap()
                .pem();
            assert!(
                cert.install(pem.as_bytes(), key.serialize_pem().as_bytes())
                    .unwrap()
            );
        };
        let cert = Arc::new(ServingCert::default());
        install(&cert);
        let r = SharedTickets::new(
            ServingSeed::Managed(cert.clone()),
            Trust::Fixed(trust_digest(b"")),
        );
        let t = r.encrypt_at(b"s", NOW).unwrap();
        assert!(r.decrypt_at(&t, NOW).is_some());
        install(&cert);
        assert!(r.decrypt_at(&t, NOW).is_none());
        assert!(r.encrypt_at(b"s", NOW).is_some());
    }

    #[test]
    fn no_ticket_before_there_is_a_serving_certificate() {
        let r = SharedTickets::new(
            ServingSeed::Managed(Arc::new(ServingCert::default())),
            Trust::Fixed(trust_digest(b"")),
        );
        assert!(r.encrypt_at(b"s", NOW).is_none());
    }
}
