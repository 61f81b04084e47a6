//! What a node's TLS handshake costs the brain and the node: a full one against one that
//! resumes a session from a ticket another replica issued (crate::session_tickets).
//!
//! The brain's own server configuration (`tls::server_config`, serving certificate and client
//! CA from files, as a replica reads them) and a client configured as the actuator's
//! (`actuator/src/tls_client.rs`: the brain's CA, a node certificate, HTTP/2 by ALPN) run
//! their handshakes in memory, one after the other, and the time each side spends in rustls
//! is summed apart. Every resumed handshake is made with the ticket of the handshake before
//! it, at the other of two replicas: what a node moving to a surviving replica, or back to a
//! restarted one, costs.
//!
//! The second argument picks the algorithm of every key (CA, brain, node): `p256` (the
//! default, as the brain's own CA and the chart's pod certificates make them), `p384` or
//! `ed25519`.
//!
//! ```sh
//! cargo run --release -p splitproxy-brain --example handshake_cost -- 2000 ed25519
//! ```
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConnection, HandshakeKind, ServerConfig, ServerConnection};
use splitproxy_brain::tls::{ClientAuth, ServingSource, server_config};

fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2000);
    let alg_name = std::env::args().nth(2).unwrap_or_else(|| "p256".into());
    let alg = match alg_name.as_str() {
        "p256" => &rcgen::PKCS_ECDSA_P256_SHA256,
        "p384" => &rcgen::PKCS_ECDSA_P384_SHA384,
        "ed25519" => &rcgen::PKCS_ED25519,
        other => anyhow::bail!("unknown key algorithm {other}: p256, p384 or ed25519"),
    };
    let dir = tempfile::tempdir()?;
    let ca_key = KeyPair::generate_for(alg)?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "ca");
    let ca_pem = ca.self_signed(&ca_key)?.pem();
    let issuer = Issuer::new(ca, ca_key);
    let leaf = |cn: &str, usage| -> anyhow::Result<(String, String)> {
        let key = KeyPair::generate_for(alg)?;
        let mut p = CertificateParams::new(vec![cn.to_string()])?;
        p.distinguished_name.push(DnType::CommonName, cn);
        p.extended_key_usages = vec![usage];
        Ok((p.signed_by(&key, &issuer)?.pem(), key.serialize_pem()))
    };
    let (brain_cert, brain_key) = leaf("brain", ExtendedKeyUsagePurpose::ServerAuth)?;
    let (node_cert, node_key) = leaf("node-1", ExtendedKeyUsagePurpose::ClientAuth)?;
    let (cert, key, client_ca) = (
        dir.path().join("tls.crt"),
        dir.path().join("tls.key"),
        dir.path().join("ca.crt"),
    );
    std::fs::write(&cert, brain_cert)?;
    std::fs::write(&key, brain_key)?;
    std::fs::write(&client_ca, &ca_pem)?;
    let serving = ServingSource::Files { cert, key };
    let auth = ClientAuth {
        ca: Some(client_ca),
        optional: false,
        own: None,
    };
    // Two replicas: the same files, a configuration (and ticketer) each.
    let replicas = [
        Arc::new(server_config(&serving, &auth)?),
        Arc::new(server_config(&serving, &auth)?),
    ];
    let client = || -> anyhow::Result<Arc<rustls::ClientConfig>> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_slice(ca_pem.as_bytes())?)?;
        let chain = vec![CertificateDer::from_pem_slice(node_cert.as_bytes())?];
        let key = PrivateKeyDer::from_pem_slice(node_key.as_bytes())?;
        let mut c = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)?;
        c.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(c))
    };

    // Full: a new client configuration each time (an empty session cache, as every
    // connection of an actuator had with tonic's TLS settings).
    let mut full = Cost::default();
    for i in 0..n {
        full.add(handshake(&replicas[i % 2], client()?)?, HandshakeKind::Full)?;
    }
    // Resumed: one client, each ticket used at the other replica.
    let node = client()?;
    handshake(&replicas[0], node.clone())?;
    let mut resumed = Cost::default();
    for i in 0..n {
        resumed.add(
            handshake(&replicas[(i + 1) % 2], node.clone())?,
            HandshakeKind::Resumed,
        )?;
    }
    println!(
        "command: cargo run --release -p splitproxy-brain --example handshake_cost -- {n} {alg_name}"
    );
    for (what, c) in [("full", &full), ("resumed at another replica", &resumed)] {
        println!(
            "{what:>28}: brain {:.1} us, node {:.1} us per handshake ({n} handshakes)",
            c.per(c.server, n),
            c.per(c.client, n)
        );
    }
    println!(
        "resumed / full: brain {:.2}, node {:.2}",
        resumed.server.as_secs_f64() / full.server.as_secs_f64(),
        resumed.client.as_secs_f64() / full.client.as_secs_f64()
    );
    Ok(())
}

#[derive(Default)]
struct Cost {
    server: Duration,
    client: Duration,
}

impl Cost {
    fn add(&mut self, (kind, server, client): Shake, want: HandshakeKind) -> anyhow::Result<()> {
        anyhow::ensure!(kind == want, "a {want:?} handshake was {kind:?}");
        self.server += server;
        self.client += client;
        Ok(())
    }

    fn per(&self, total: Duration, n: usize) -> f64 {
        total.as_secs_f64() * 1e6 / n as f64
    }
}

/// How the server saw the handshake, and the time each side spent in rustls.
type Shake = (HandshakeKind, Duration, Duration);

/// One handshake in memory, until the client holds the server's ticket.
fn handshake(
    server: &Arc<ServerConfig>,
    client: Arc<rustls::ClientConfig>,
) -> anyhow::Result<Shake> {
    let (mut s_time, mut c_time) = (Duration::ZERO, Duration::ZERO);
    let t = Instant::now();
    let mut s = ServerConnection::new(server.clone())?;
    s_time += t.elapsed();
    let t = Instant::now();
    let mut c = ClientConnection::new(client, ServerName::try_from("brain")?)?;
    c_time += t.elapsed();
    let mut buf = Vec::new();
    for _ in 0..16 {
        buf.clear();
        while c.wants_write() {
            c.write_tls(&mut buf)?;
        }
        if !buf.is_empty() {
            let t = Instant::now();
            s.read_tls(&mut buf.as_slice())?;
            s.process_new_packets()?;
            s_time += t.elapsed();
        }
        buf.clear();
        let t = Instant::now();
        while s.wants_write() {
            s.write_tls(&mut buf)?;
        }
        s_time += t.elapsed();
        if !buf.is_empty() {
            let t = Instant::now();
            c.read_tls(&mut buf.as_slice())?;
            c.process_new_packets()?;
            c_time += t.elapsed();
        }
        if !s.is_handshaking() && !c.is_handshaking() && !s.wants_write() && !c.wants_write() {
            let kind = s.handshake_kind().unwrap_or(HandshakeKind::Full);
            return Ok((kind, s_time, c_time));
        }
    }
    anyhow::bail!("the handshake did not finish")
}
