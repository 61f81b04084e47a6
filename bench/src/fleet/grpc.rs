//! One virtual node's `Sync` call as gRPC over HTTP/2 over mTLS, driven by the node's own task.
//!
//! The brain sees exactly what a real actuator sends: a TLS connection with the node's client
//! certificate, one HTTP/2 stream to `/splitproxy.v1.Dataplane/Sync` with the same windows as
//! the actuator's client (hyper's defaults: 2 MiB per stream, 5 MiB per connection), and
//! length-prefixed protobuf messages both ways. What differs is only on the fleet's side:
//! tonic's channel spreads one node over three tasks (the HTTP/2 connection, the request body's
//! pipe, the caller) and an mpsc channel, so every update and ack woke all of them. Here the
//! node's task polls its connection itself, writes each ack straight into the stream, and
//! decodes each update from the received bytes without copying its bodies. At 5,000 nodes on
//! the brain's machine that overhead was CPU the brain's fan-out did not get.
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use h2::client::{Connection, SendRequest};
use h2::{RecvStream, SendStream};
use prost::Message;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use splitproxy_proto::v1::SyncRequest;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::envelope::Envelope;

const SYNC_PATH: &str = "/splitproxy.v1.Dataplane/Sync";
/// The actuator's client windows (tonic leaves hyper's defaults).
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;
/// gRPC's length prefix: a compressed flag and a 4-byte big-endian length.
const PREFIX: usize = 5;

/// The roots every node trusts, parsed once for the whole fleet.
pub(super) fn roots(ca_pem: &[u8]) -> anyhow::Result<Arc<rustls::RootCertStore>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(cert.context("parsing the brain's CA")?)?;
    }
    Ok(Arc::new(roots))
}

/// A node's TLS client: the fleet's roots, the node's certificate, HTTP/2 by ALPN.
pub(super) fn tls_config(
    roots: Arc<rustls::RootCertStore>,
    cert_pem: &[u8],
    key_pem: &[u8],
) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .context("parsing the node's certificate")?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).context("parsing the node's key")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// An open `Sync` call: updates in, acks out.
pub(super) struct SyncCall {
    conn: Connection<TlsStream<TcpStream>, Bytes>,
    /// Kept so the connection stays open while the call runs.
    _requests: SendRequest<Bytes>,
    send: SendStream<Bytes>,
    /// The response body; taken out while it is read (the read borrows the connection too).
    body: Option<RecvStream>,
    /// The last received chunk, while it starts with whole messages: they are taken from it
    /// as they are, without a copy (an update is usually one chunk). Empty while `buf` is not.
    front: Bytes,
    /// Received bytes of a message that spans chunks, gathered until it is whole.
    buf: BytesMut,
    max_message: usize,
}

impl SyncCall {
    /// Connects to `addr` as the node `tls` names, opens the call and sends `hello`; returns
    /// once the brain answered with its response headers (as tonic's `streaming` does).
    pub async fn open(
        addr: &str,
        server_name: &str,
        tls: Arc<rustls::ClientConfig>,
        hello: SyncRequest,
        max_message: usize,
        timeout: Duration,
    ) -> anyhow::Result<SyncCall> {
        let (conn, mut requests) = tokio::time::timeout(timeout, async {
            let tcp = TcpStream::connect(addr).await.context("connecting")?;
            tcp.set_nodelay(true)?;
            let name = ServerName::try_from(server_name.to_string())?;
            let stream = tokio_rustls::TlsConnector::from(tls)
                .connect(name, tcp)
                .await
                .context("TLS handshake")?;
            let (requests, conn) = h2::client::Builder::new()
                .initial_window_size(STREAM_WINDOW)
                .initial_connection_window_size(CONNECTION_WINDOW)
                .handshake::<_, Bytes>(stream)
                .await
                .context("HTTP/2 handshake")?;
            anyhow::Ok((conn, requests))
        })
        .await
        .context("connect timed out")??;
        let request = http::Request::post(format!("https://{addr}{SYNC_PATH}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())?;
        let (response, mut send) = requests.send_request(request, false)?;
        send.send_data(frame(&hello), false)?;
        let mut call = SyncCall {
            conn,
            _requests: requests,
            send,
            body: None,
            front: Bytes::new(),
            buf: BytesMut::new(),
            max_message,
        };
        let response = call.drive(response).await?.context("opening the call")?;
        let (head, body) = response.into_parts();
        if head.status != http::StatusCode::OK {
            bail!("the brain answered HTTP {}", head.status);
        }
        // A refusal is a response with the status and no body ("trailers only").
        status(&head.headers)?;
        call.body = Some(body);
        Ok(call)
    }

    /// Polls `fut` while driving the connection (its reads and the acks' writes).
    async fn drive<F: Future>(&mut self, fut: F) -> anyhow::Result<F::Output> {
        tokio::pin!(fut);
        tokio::select! {
            biased;
            r = &mut self.conn => {
                r.context("connection")?;
                bail!("the brain closed the connection")
            }
            out = &mut fut => Ok(out),
        }
    }

    /// The next update; `None` when the brain ended the call with status OK.
    pub async fn next(&mut self) -> anyhow::Result<Option<Envelope>> {
        loop {
            if self.buf.is_empty() {
                if let Some(msg) = take_whole(&mut self.front, self.max_message)? {
                    return Ok(Some(Envelope::decode(msg)?));
                }
                // A message that continues in the next chunk: gathered from here on.
                self.buf.extend_from_slice(&std::mem::take(&mut self.front));
            }
            if let Some(msg) = take_message(&mut self.buf, self.max_message)? {
                return Ok(Some(Envelope::decode(msg)?));
            }
            let mut body = self.body.take().context("the call has ended")?;
            let chunk = self.drive(body.data()).await;
            let chunk = match chunk {
                Ok(Some(Ok(c))) => {
                    let _ = body.flow_control().release_capacity(c.len());
                    self.body = Some(body);
                    c
                }
                Ok(Some(Err(e))) => return Err(e).context("reading the stream"),
                Ok(None) => {
                    let trailers = self.drive(body.trailers()).await?;
                    if let Some(t) = trailers.context("reading the trailers")? {
                        status(&t)?;
                    }
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            if self.buf.is_empty() {
                self.front = chunk;
            } else {
                self.buf.extend_from_slice(&chunk);
            }
        }
    }

    /// Queues `msg`; the connection writes it when next driven.
    pub fn send(&mut self, msg: &SyncRequest) -> anyhow::Result<()> {
        self.send
            .send_data(frame(msg), false)
            .context("sending on the stream")
    }
}

/// The length of the gRPC message at the start of `buf`, once all of it has arrived.
fn whole_message(buf: &[u8], max_message: usize) -> anyhow::Result<Option<usize>> {
    if buf.len() < PREFIX {
        return Ok(None);
    }
    if buf[0] != 0 {
        bail!("a compressed gRPC message; the brain compresses inside its updates");
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > max_message {
        bail!("a {len}-byte message is above the {max_message} limit");
    }
    Ok((buf.len() >= PREFIX + len).then_some(len))
}

/// One whole gRPC message off the front of `buf`, without its prefix; `None` until all of it
/// has arrived.
fn take_message(buf: &mut BytesMut, max_message: usize) -> anyhow::Result<Option<Bytes>> {
    let Some(len) = whole_message(buf, max_message)? else {
        return Ok(None);
    };
    let mut msg = buf.split_to(PREFIX + len).freeze();
    msg.advance(PREFIX);
    Ok(Some(msg))
}

/// [`take_message`] off a received chunk, which the message then shares instead of copying.
fn take_whole(chunk: &mut Bytes, max_message: usize) -> anyhow::Result<Option<Bytes>> {
    let Some(len) = whole_message(chunk, max_message)? else {
        return Ok(None);
    };
    let msg = chunk.slice(PREFIX..PREFIX + len);
    chunk.advance(PREFIX + len);
    Ok(Some(msg))
}

/// `msg` with its gRPC length prefix.
fn frame(msg: &SyncRequest) -> Bytes {
    let len = msg.encoded_len();
    let mut b = BytesMut::with_capacity(PREFIX + len);
    b.put_u8(0);
    b.put_u32(len as u32);
    msg.encode(&mut b)
        .expect("the buffer was sized for the message");
    b.freeze()
}

/// An error for a `grpc-status` other than OK.
fn status(headers: &http::HeaderMap) -> anyhow::Result<()> {
    let Some(code) = headers.get("grpc-status") else {
        return Ok(());
    };
    if code == "0" {
        return Ok(());
    }
    let message = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .unwrap_or_default();
    bail!(
        "the brain ended the call: grpc-status {} {message}",
        code.to_str().unwrap_or("?")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefixed(flag: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![flag];
        v.extend_from_slice(&(body.len() as u32).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn messages_are_taken_whole_and_in_order_as_their_bytes_arrive() {
        let mut wire = prefixed(0, b"first");
        wire.extend(prefixed(0, b"second"));
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        // One byte at a time: a message is only taken once all of it is there.
        for b in wire {
            buf.extend_from_slice(&[b]);
            while let Some(m) = take_message(&mut buf, 100).unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got, vec![Bytes::from("first"), Bytes::from("second")]);
        assert!(buf.is_empty());
    }

    #[test]
    fn whole_messages_of_a_chunk_are_taken_without_a_copy_and_the_rest_is_left() {
        let mut wire = prefixed(0, b"first");
        wire.extend(prefixed(0, b"second"));
        wire.extend(&prefixed(0, b"third")[..4]);
        let mut chunk = Bytes::from(wire);
        let start = chunk.as_ptr() as usize;
        let first = take_whole(&mut chunk, 100).unwrap().unwrap();
        assert_eq!(first, Bytes::from("first"));
        // The chunk's own bytes, not a copy.
        assert_eq!(first.as_ptr() as usize, start + PREFIX);
        assert_eq!(
            take_whole(&mut chunk, 100).unwrap().unwrap(),
            Bytes::from("second")
        );
        assert!(take_whole(&mut chunk, 100).unwrap().is_none());
        assert_eq!(chunk.len(), 4, "the start of the third is left");
        let mut empty = Bytes::new();
        assert!(take_whole(&mut empty, 100).unwrap().is_none());
        let mut compressed = Bytes::from(prefixed(1, b"x"));
        assert!(take_whole(&mut compressed, 100).is_err());
    }

    #[test]
    fn a_compressed_or_oversized_message_is_an_error() {
        let mut buf = BytesMut::from(&prefixed(1, b"x")[..]);
        assert!(take_message(&mut buf, 100).is_err());
        let mut buf = BytesMut::from(&prefixed(0, &[0; 101])[..5]);
        assert!(take_message(&mut buf, 100).is_err());
    }

    #[test]
    fn a_framed_request_reads_back_as_the_same_message() {
        let msg = SyncRequest {
            msg: Some(splitproxy_proto::v1::sync_request::Msg::Ack(
                splitproxy_proto::v1::Ack {
                    generation: 7,
                    ok: true,
                    ..Default::default()
                },
            )),
        };
        let mut buf = BytesMut::from(&frame(&msg)[..]);
        let body = take_message(&mut buf, 100).unwrap().unwrap();
        assert_eq!(SyncRequest::decode(body).unwrap(), msg);
    }
}
