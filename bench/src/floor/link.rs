//! One floor stream: bare TCP, or TCP with TLS as the brain's streams have it.
//!
//! The TLS floor answers what the gap between the bare floor and splitproxy is made of: the
//! same rounds, with every update and ack sealed and opened by rustls (the brain's TLS library
//! and crypto provider, TLS 1.3, a P-256 certificate), in the same epoll loops. What is left
//! above it is the async runtime, HTTP/2 with gRPC's framing ([`super::tasks`] measures both)
//! and splitproxy's own work. The handshakes are done before the
//! rounds and not counted; session tickets are off, so no ticket arrives mid-round.
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use mio::net::TcpStream as MioStream;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConnection, Connection, ServerConnection};

/// The name the sending side's certificate is for.
pub(super) const SERVER_NAME: &str = "floor.splitproxy.invalid";

/// What the streams carry the bytes over.
#[derive(Clone)]
pub enum Wire {
    Tcp,
    /// TLS: the sending side serves this configuration.
    TlsServer(Arc<rustls::ServerConfig>),
    /// TLS: the nodes' side trusts this configuration's roots.
    TlsClient(Arc<rustls::ClientConfig>),
}

/// A self-signed certificate for the sending side, and the DER the nodes' side trusts.
pub fn tls_server() -> anyhow::Result<(Wire, Vec<u8>)> {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let cert = rcgen::CertificateParams::new(vec![SERVER_NAME.to_string()])?.self_signed(&key)?;
    let der = cert.der().to_vec();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![CertificateDer::from(der.clone())], key)?;
    cfg.send_tls13_tickets = 0;
    Ok((Wire::TlsServer(Arc::new(cfg)), der))
}

/// The nodes' side of [`tls_server`]: trusts the certificate `der`.
pub fn tls_client(der: &[u8]) -> anyhow::Result<Wire> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from(der.to_vec()))?;
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Wire::TlsClient(Arc::new(cfg)))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// One stream, ready for the rounds: non-blocking, and past its handshake.
pub struct Link {
    pub stream: MioStream,
    tls: Option<Connection>,
}

impl Link {
    /// Sets `s` up for the rounds; over TLS, does the handshake first (blocking, at most
    /// `limit`: the other side handshakes its streams in the same order).
    pub fn open(s: TcpStream, wire: &Wire, limit: Duration) -> anyhow::Result<Link> {
        s.set_nodelay(true)?;
        let tls = match wire {
            Wire::Tcp => None,
            Wire::TlsServer(cfg) => Some(Connection::from(ServerConnection::new(cfg.clone())?)),
            Wire::TlsClient(cfg) => {
                let name = ServerName::try_from(SERVER_NAME)?;
                Some(Connection::from(ClientConnection::new(cfg.clone(), name)?))
            }
        };
        let tls = match tls {
            Some(mut c) => {
                let mut s = &s;
                s.set_read_timeout(Some(limit.max(Duration::from_millis(1))))?;
                while c.is_handshaking() {
                    c.complete_io(&mut s).context("the TLS handshake")?;
                }
                Some(c)
            }
            None => None,
        };
        s.set_nonblocking(true)?;
        Ok(Link {
            stream: MioStream::from_std(s),
            tls,
        })
    }

    /// Sends all of `data`; the socket buffers are far larger than one update, so a full
    /// buffer means something is wrong rather than something to wait for.
    pub fn send(&mut self, data: &[u8]) -> anyhow::Result<()> {
        match &mut self.tls {
            None => write_all(&mut self.stream, data),
            Some(c) => {
                c.writer().write_all(data)?;
                while c.wants_write() {
                    match c.write_tls(&mut self.stream) {
                        Ok(_) => {}
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) => return Err(e).context("writing to a loopback socket"),
                    }
                }
                Ok(())
            }
        }
    }

    /// Reads what the socket holds (one `read` when it returns less than asked, as tokio
    /// assumes a socket is then drained); returns the bytes of payload it carried.
    pub fn recv(&mut self, buf: &mut [u8]) -> anyhow::Result<usize> {
        let Some(c) = &mut self.tls else {
            return read_available(&mut self.stream, buf);
        };
        let mut total = 0;
        loop {
            match c.read_tls(&mut self.stream) {
                Ok(0) => bail!("a connection closed"),
                Ok(n) => {
                    c.process_new_packets()?;
                    loop {
                        match c.reader().read(buf) {
                            Ok(0) => bail!("a connection closed"),
                            Ok(got) => total += got,
                            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                            Err(e) => return Err(e.into()),
                        }
                    }
                    if n < TLS_READ {
                        return Ok(total);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(total),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// rustls asks the socket for at least this much at each read: a read that returns less has
/// drained it.
const TLS_READ: usize = 4096;

fn read_available(s: &mut MioStream, buf: &mut [u8]) -> anyhow::Result<usize> {
    let mut total = 0;
    loop {
        match s.read(buf) {
            Ok(0) => bail!("a connection closed"),
            Ok(n) => {
                total += n;
                if n < buf.len() {
                    return Ok(total);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(total),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
}

fn write_all(s: &mut MioStream, data: &[u8]) -> anyhow::Result<()> {
    let mut at = 0;
    while at < data.len() {
        match s.write(&data[at..]) {
            Ok(n) => at += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("writing to a loopback socket"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn recv_exactly(link: &mut Link, n: usize) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = vec![0; 64 * 1024];
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while got.len() < n {
            assert!(std::time::Instant::now() < until, "timed out");
            let k = link.recv(&mut buf).unwrap();
            got.extend_from_slice(&buf[..k]);
            if k == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        got
    }

    /// Over TLS the floor's streams are TLS 1.3 with the brain's provider, and every byte sent
    /// arrives: updates larger than one read of rustls's, and small acks back.
    #[test]
    fn a_tls_link_carries_updates_and_acks() {
        let (server, der) = tls_server().unwrap();
        let client = tls_client(&der).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let limit = Duration::from_secs(10);
        let node = std::thread::spawn(move || {
            let mut link = Link::open(TcpStream::connect(addr).unwrap(), &client, limit).unwrap();
            let update = recv_exactly(&mut link, 20_000);
            link.send(b"ack").unwrap();
            (update, link)
        });
        let mut brain = Link::open(listener.accept().unwrap().0, &server, limit).unwrap();
        let tls = brain.tls.as_ref().unwrap();
        assert_eq!(
            tls.protocol_version(),
            Some(rustls::ProtocolVersion::TLSv1_3)
        );
        let update: Vec<u8> = (0..20_000).map(|i| (i % 251) as u8).collect();
        brain.send(&update).unwrap();
        assert_eq!(recv_exactly(&mut brain, 3), b"ack");
        let (got, _link) = node.join().unwrap();
        assert_eq!(got, update);
    }

    #[test]
    fn a_node_that_does_not_trust_the_certificate_fails_its_handshake() {
        let (server, _) = tls_server().unwrap();
        let (_, other) = tls_server().unwrap();
        let client = tls_client(&other).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let limit = Duration::from_secs(10);
        let node = std::thread::spawn(move || {
            Link::open(TcpStream::connect(addr).unwrap(), &client, limit)
        });
        let brain = Link::open(listener.accept().unwrap().0, &server, limit);
        assert!(node.join().unwrap().is_err());
        assert!(brain.is_err());
    }
}
