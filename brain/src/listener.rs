//! The brain's gRPC listener: TCP accepted here, bounded, and the TLS handshake run here with a
//! timeout, before tonic sees the connection.
//!
//! tonic's own TLS runs the handshake without a deadline, so a client that connects and sends
//! nothing holds a socket and a task for as long as it likes (500 half-open connections were held
//! for a whole minute, issue #9). Here:
//!
//! - connections are bounded in total and per peer address (`--max-connections`,
//!   `--max-connections-per-ip`); one over the bound is closed at once and counted;
//! - the handshake must finish within `--tls-handshake-timeout-ms`, with the TLS configuration of
//!   the moment ([`ReloadingTls`]: rotated files are picked up);
//! - a connection that starts no request within [`FIRST_REQUEST_TIMEOUT`] is closed;
//! - a connection is closed when its client certificate expires (the actuator reconnects with
//!   its rotated one);
//! - every refused handshake is counted by reason
//!   (`splitproxy_brain_tls_handshake_failures_total{reason}`) and logged at warn, at most one
//!   line per [`LOG_EVERY`] with the count of those not logged, so a flood cannot flood the log.
//!
//! What a connection's certificate vouches for travels with each request as a [`PeerInfo`]
//! extension. [`Gate`] (`listener/gate.rs`) runs before any service: a request on a connection
//! without a client certificate is identified by its bearer token ([`crate::tokens`], reviewed
//! asynchronously and cached), whose identity replaces the connection's in the request's
//! [`PeerInfo`]; a caller with no credential or no role at all is refused there. What the
//! listener counts and its rate-limited log lines are in `listener/accounting.rs`.
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tonic::transport::server::Connected;

use crate::auth::{Identity, Refusal};
use crate::metrics::Metrics;
use crate::tls::{self, ReloadingTls};

mod accounting;
mod deadline;
mod gate;

pub use accounting::{HANDSHAKE_FAILURES, RateLimitedLog, SurfaceMetrics};
use accounting::{HANDSHAKE_LOG, LIMIT_LOG, handshake_failure};
use deadline::Deadline;
pub use gate::{Gate, refuse};

/// A connection that has not started a request this long after its handshake is closed.
pub const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Streams one connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): a
/// node needs its `Sync` stream and a few unary calls, grpcurl a reflection stream and a call.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 16;
/// A connection is closed this long after its client certificate expired: its `Sync` stream ends
/// at the expiry itself with a status saying why (`server.rs`); this catches everything else.
pub const EXPIRY_GRACE: Duration = Duration::from_secs(5);
/// At most one warning line per this interval for each kind of refusal.
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// The listener's bounds (flags of the same names, see [`crate::config::Surface`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub handshake_timeout: Duration,
    pub max_connections: usize,
    pub max_connections_per_ip: usize,
}

/// What the server knows about the peer of one connection; every request on it carries a clone
/// (as a request extension).
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub remote: SocketAddr,
    /// What its client certificate vouches for; in a request without one, what its bearer
    /// token does ([`Gate`] puts it there).
    pub identity: Arc<Identity>,
    /// Set once the connection starts its first request.
    started: Arc<AtomicBool>,
}

impl PeerInfo {
    /// The peer of a request: from this listener, or (a server with tonic's own TLS) from
    /// tonic's connection info.
    pub fn of<T>(request: &tonic::Request<T>) -> Option<PeerInfo> {
        if let Some(p) = request.extensions().get::<PeerInfo>() {
            return Some(p.clone());
        }
        let certs = request.peer_certs()?;
        Some(PeerInfo {
            remote: request.remote_addr()?,
            identity: Arc::new(tls::identity_of_chain(&certs)?),
            started: Arc::new(AtomicBool::new(true)),
        })
    }
}

/// Connections held, in total and per peer address.
#[derive(Debug)]
struct Counts {
    limits: Limits,
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
}

/// One connection's place in [`Counts`], given back when the connection is dropped.
struct Slot {
    counts: Arc<Mutex<Counts>>,
    ip: IpAddr,
    metrics: Arc<Metrics>,
}

fn take_slot(
    counts: &Arc<Mutex<Counts>>,
    ip: IpAddr,
    metrics: &Arc<Metrics>,
) -> Result<Slot, Refusal> {
    let ip = ip.to_canonical();
    let mut c = counts.lock().map_err(|_| Refusal::ConnectionLimit)?;
    if c.total >= c.limits.max_connections {
        return Err(Refusal::ConnectionLimit);
    }
    let max_per_ip = c.limits.max_connections_per_ip;
    let n = c.per_ip.entry(ip).or_default();
    if *n >= max_per_ip {
        return Err(Refusal::PeerConnectionLimit);
    }
    *n += 1;
    c.total += 1;
    metrics
        .surface
        .open_connections
        .fetch_add(1, Ordering::Relaxed);
    Ok(Slot {
        counts: counts.clone(),
        ip,
        metrics: metrics.clone(),
    })
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut c) = self.counts.lock() {
            c.total = c.total.saturating_sub(1);
            if let Some(n) = c.per_ip.get_mut(&self.ip) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    c.per_ip.remove(&self.ip);
                }
            }
        }
        self.metrics
            .surface
            .open_connections
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// An established connection, as tonic serves it: the TLS stream, the peer's [`PeerInfo`], its
/// place in the connection bounds, and its two deadlines (no first request, certificate expiry).
pub struct Conn {
    io: TlsStream<TcpStream>,
    info: PeerInfo,
    slot: Slot,
    first_request: Option<Deadline>,
    expiry: Option<(SystemTime, Deadline)>,
}

impl Connected for Conn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

/// The instant `at` (wall clock) falls on, if it can be represented.
fn instant_of(at: SystemTime) -> Option<tokio::time::Instant> {
    let left = at
        .duration_since(SystemTime::now())
        .unwrap_or(Duration::ZERO);
    tokio::time::Instant::now().checked_add(left)
}

impl Conn {
    /// Whether a deadline has passed: the connection then ends with an error, which closes it.
    fn poll_deadlines(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if self.first_request.is_some() && self.info.started.load(Ordering::Relaxed) {
            self.first_request = None; // a request started: this deadline is met
        }
        if let Some(d) = &mut self.first_request
            && d.poll(cx).is_ready()
        {
            self.first_request = None;
            if !self.info.started.load(Ordering::Relaxed) {
                self.slot.metrics.surface.closed("idle");
                return Some(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no request on the connection",
                ));
            }
        }
        if let Some((at, d)) = &mut self.expiry
            && d.poll(cx).is_ready()
        {
            if SystemTime::now() >= *at {
                self.expiry = None;
                self.slot.metrics.surface.closed("certificate_expired");
                return Some(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "client certificate expired",
                ));
            }
            // The timer clamps far deadlines: wait again.
            match instant_of(*at) {
                Some(i) => d.reset(i),
                None => self.expiry = None,
            }
        }
        None
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(e) = self.poll_deadlines(cx) {
            tracing::debug!(peer = %self.info.remote, error = %e, "closing connection");
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Accepts connections on `listener` and yields them once their TLS handshake is done, for
/// `Server::serve_with_incoming`. Stops when the server drops the stream.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<ReloadingTls>,
    limits: Limits,
    metrics: Arc<Metrics>,
) -> impl tokio_stream::Stream<Item = io::Result<Conn>> {
    let (tx, rx) = mpsc::channel::<io::Result<Conn>>(64);
    let counts = Arc::new(Mutex::new(Counts {
        limits,
        total: 0,
        per_ip: HashMap::new(),
    }));
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            let (tcp, remote) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, for instance: wait a little instead of spinning.
                    if let Some(held) = LIMIT_LOG.admit() {
                        tracing::warn!(error = %e, held_back = held, "accepting a connection failed");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let slot = match take_slot(&counts, remote.ip(), &metrics) {
                Ok(s) => s,
                Err(reason) => {
                    metrics.surface.refused(reason);
                    if let Some(held) = LIMIT_LOG.admit() {
                        tracing::warn!(%remote, reason = reason.as_str(), held_back = held, "connection refused: too many connections");
                    }
                    continue;
                }
            };
            if let Err(e) = tcp.set_nodelay(true) {
                // An update is written in two parts; the second must not wait for a delayed ACK.
                tracing::debug!(error = %e, "TCP_NODELAY not set on a node connection");
            }
            let acceptor = TlsAcceptor::from(tls.current());
            let (tx, metrics) = (tx.clone(), metrics.clone());
            tokio::spawn(async move {
                let shake =
                    tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp)).await;
                let reason = match shake {
                    Ok(Ok(io)) => {
                        let resumed =
                            io.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
                        let identity = io
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(tls::identity_of_chain)
                            .unwrap_or_default();
                        // A resumed session skips the chain's verification, expiry included
                        // (crate::session_tickets): a certificate that expired since is
                        // refused here, as a full handshake would refuse it.
                        if resumed && identity.expires.is_some_and(|at| at <= SystemTime::now()) {
                            "expired_certificate"
                        } else {
                            let counter = if resumed {
                                &metrics.surface.handshakes_resumed
                            } else {
                                &metrics.surface.handshakes_full
                            };
                            counter.fetch_add(1, Ordering::Relaxed);
                            let conn = established(io, identity, remote, slot);
                            let _ = tx.send(Ok(conn)).await;
                            return;
                        }
                    }
                    Err(_) => "timeout",
                    Ok(Err(e)) => {
                        let reason = handshake_failure(&e);
                        tracing::debug!(%remote, error = %e, reason, "TLS handshake failed");
                        reason
                    }
                };
                metrics.surface.handshake_failed(reason);
                if let Some(held) = HANDSHAKE_LOG.admit() {
                    tracing::warn!(%remote, reason, held_back = held, "TLS handshake refused");
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// The connection as tonic gets it, with what its certificate (`identity`) vouches for.
fn established(
    io: TlsStream<TcpStream>,
    identity: Identity,
    remote: SocketAddr,
    slot: Slot,
) -> Conn {
    let expiry = identity.expires.and_then(|at| {
        let at = at + EXPIRY_GRACE;
        Some((at, Deadline::new(instant_of(at)?)))
    });
    Conn {
        io,
        info: PeerInfo {
            remote,
            identity: Arc::new(identity),
            started: Arc::new(AtomicBool::new(false)),
        },
        slot,
        first_request: Some(Deadline::new(
            tokio::time::Instant::now() + FIRST_REQUEST_TIMEOUT,
        )),
        expiry,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_bounded_in_total_and_per_peer() {
        let metrics = Arc::new(Metrics::default());
        let counts = Arc::new(Mutex::new(Counts {
            limits: Limits {
                handshake_timeout: Duration::from_secs(1),
                max_connections: 3,
                max_connections_per_ip: 2,
            },
            total: 0,
            per_ip: HashMap::new(),
        }));
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        let s1 = take_slot(&counts, a, &metrics).unwrap();
        let _s2 = take_slot(&counts, mapped, &metrics).unwrap();
        assert_eq!(
            take_slot(&counts, a, &metrics).err(),
            Some(Refusal::PeerConnectionLimit)
        );
        let _s3 = take_slot(&counts, b, &metrics).unwrap();
        assert_eq!(
            take_slot(&counts, b, &metrics).err(),
            Some(Refusal::ConnectionLimit)
        );
        assert_eq!(metrics.surface.open_connections.load(Ordering::Relaxed), 3);
        drop(s1);
        assert!(take_slot(&counts, a, &metrics).is_ok());
        assert_eq!(counts.lock().unwrap().total, 2, "the new slot was dropped");
    }
}
