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
//! extension. [`Gate`] runs before any service: a request on a connection without a client
//! certificate is identified by its bearer token ([`crate::tokens`], reviewed asynchronously and
//! cached), whose identity replaces the connection's in the request's [`PeerInfo`]; a caller
//! with no credential or no role at all is refused there.
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tonic::transport::server::Connected;

use crate::auth::{self, Credential, Groups, Identity, Refusal};
use crate::metrics::Metrics;
use crate::tls::{self, ReloadingTls};
use crate::tokens::{Authenticator, Rejected};

mod deadline;
use deadline::Deadline;

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

/// The brain's counters for its surface: refusals by reason, failed handshakes by reason, open
/// connections, TLS reloads. Rendered with the brain's other metrics.
#[derive(Debug, Default)]
pub struct SurfaceMetrics {
    refused: Mutex<BTreeMap<Refusal, u64>>,
    handshake_failures: Mutex<BTreeMap<&'static str, u64>>,
    closed: Mutex<BTreeMap<&'static str, u64>>,
    pub open_connections: AtomicU64,
    pub tls_reloads: AtomicU64,
    pub tls_reload_errors: AtomicU64,
    /// Handshakes completed with the client's chain verified, and by resuming a session.
    pub handshakes_full: AtomicU64,
    pub handshakes_resumed: AtomicU64,
}

impl SurfaceMetrics {
    pub fn refused(&self, reason: Refusal) {
        if let Ok(mut m) = self.refused.lock() {
            *m.entry(reason).or_default() += 1;
        }
    }

    pub fn refused_count(&self, reason: Refusal) -> u64 {
        self.refused
            .lock()
            .map(|m| m.get(&reason).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    fn handshake_failed(&self, reason: &'static str) {
        if let Ok(mut m) = self.handshake_failures.lock() {
            *m.entry(reason).or_default() += 1;
        }
    }

    fn closed(&self, reason: &'static str) {
        if let Ok(mut m) = self.closed.lock() {
            *m.entry(reason).or_default() += 1;
        }
    }

    /// Adds the surface's metrics to a scrape (`crate::metrics::Exposition`).
    pub fn expose(&self, out: &mut crate::metrics::Exposition) {
        fn by_reason<K: Ord>(
            m: &Mutex<BTreeMap<K, u64>>,
            reasons: impl IntoIterator<Item = (K, &'static str)>,
        ) -> Vec<(crate::metrics::Labels, u64)> {
            let Ok(m) = m.lock() else { return Vec::new() };
            reasons
                .into_iter()
                .map(|(k, label)| {
                    let n = m.get(&k).copied().unwrap_or(0);
                    (vec![("reason", label)], n)
                })
                .collect()
        }
        out.counters(
            "splitproxy_brain_refused_total",
            "Connections and calls refused, by reason (see docs/protocol.md, \"Who may call what\").",
            by_reason(&self.refused, Refusal::ALL.map(|r| (r, r.as_str()))),
        );
        out.counters(
            "splitproxy_brain_tls_handshake_failures_total",
            "TLS handshakes that failed or timed out, by reason.",
            by_reason(&self.handshake_failures, HANDSHAKE_FAILURES.map(|r| (r, r))),
        );
        out.counters(
            "splitproxy_brain_connections_closed_total",
            "Established connections the brain closed: no request in time (idle), client certificate expired.",
            by_reason(
                &self.closed,
                ["idle", "certificate_expired"].map(|r| (r, r)),
            ),
        );
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.gauge(
            "splitproxy_brain_open_connections",
            "gRPC connections held, handshaking or established.",
            g(&self.open_connections) as i64,
        );
        out.counters(
            "splitproxy_brain_tls_handshakes_total",
            "TLS handshakes completed, by kind: full (the client's chain verified) or resumed (a session ticket any replica issued; docs/protocol.md, \"Session tickets\").",
            [
                (vec![("kind", "full")], g(&self.handshakes_full)),
                (vec![("kind", "resumed")], g(&self.handshakes_resumed)),
            ],
        );
        out.counters(
            "splitproxy_brain_tls_reloads_total",
            "Reloads of the server's TLS files after they changed, by result.",
            [
                (vec![("result", "ok")], g(&self.tls_reloads)),
                (vec![("result", "error")], g(&self.tls_reload_errors)),
            ],
        );
    }
}

/// The `reason` values of `splitproxy_brain_tls_handshake_failures_total`.
pub const HANDSHAKE_FAILURES: [&str; 8] = [
    "timeout",
    "no_client_certificate",
    "expired_certificate",
    "unknown_issuer",
    "bad_certificate",
    "alert_received",
    "protocol",
    "closed",
];

/// Why a handshake failed, as a metric label.
fn handshake_failure(e: &io::Error) -> &'static str {
    use rustls::{CertificateError, Error};
    match e.get_ref().and_then(|i| i.downcast_ref::<Error>()) {
        Some(Error::NoCertificatesPresented) => "no_client_certificate",
        Some(Error::InvalidCertificate(
            CertificateError::Expired | CertificateError::ExpiredContext { .. },
        )) => "expired_certificate",
        Some(Error::InvalidCertificate(CertificateError::UnknownIssuer)) => "unknown_issuer",
        Some(Error::InvalidCertificate(_)) => "bad_certificate",
        Some(Error::AlertReceived(_)) => "alert_received",
        Some(_) => "protocol",
        None => match e.kind() {
            io::ErrorKind::InvalidData => "protocol",
            _ => "closed",
        },
    }
}

/// At most one log line per interval; counts the lines it held back.
#[derive(Debug)]
pub struct RateLimitedLog {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimitedLog {
    pub const fn new(every: Duration) -> Self {
        RateLimitedLog {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(held back since the last line)` when a line may be written now.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().ok()?;
        match s.0 {
            Some(last) if now.duration_since(last) < self.every => {
                s.1 += 1;
                None
            }
            _ => {
                let held = s.1;
                *s = (Some(now), 0);
                Some(held)
            }
        }
    }
}

static HANDSHAKE_LOG: RateLimitedLog = RateLimitedLog::new(LOG_EVERY);
static LIMIT_LOG: RateLimitedLog = RateLimitedLog::new(LOG_EVERY);

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

/// A tower layer over every service of the server: marks the connection as having started a
/// request (see [`FIRST_REQUEST_TIMEOUT`]), identifies a caller without a client certificate by
/// its bearer token, and refuses callers with no credential or no role at all, whatever
/// service they call (reflection and health too). A client certificate comes first: a request
/// on a connection that presented one is judged by it, whatever metadata it sends.
#[derive(Clone)]
pub struct Gate {
    pub groups: Arc<Groups>,
    pub metrics: Arc<Metrics>,
    /// Bearer tokens, when enabled (`--token-audience` not empty).
    pub tokens: Option<Arc<Authenticator>>,
}

/// What a request's `authorization` metadata holds.
#[derive(Debug, PartialEq, Eq)]
enum Bearer<'a> {
    None,
    Token(&'a str),
    /// Present, but not `Bearer <token>`.
    Malformed,
}

fn bearer(headers: &tonic::codegen::http::HeaderMap) -> Bearer<'_> {
    let Some(value) = headers.get(tonic::codegen::http::header::AUTHORIZATION) else {
        return Bearer::None;
    };
    let Ok(value) = value.to_str() else {
        return Bearer::Malformed;
    };
    match value.split_once(' ') {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => match token.trim() {
            "" => Bearer::Malformed,
            token => Bearer::Token(token),
        },
        _ => Bearer::Malformed,
    }
}

impl<S> tower::Layer<S> for Gate {
    type Service = GateService<S>;

    fn layer(&self, inner: S) -> GateService<S> {
        GateService {
            inner,
            gate: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct GateService<S> {
    inner: S,
    gate: Gate,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<tonic::codegen::http::Request<B>> for GateService<S>
where
    S: tower::Service<
            tonic::codegen::http::Request<B>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: tonic::codegen::http::Request<B>) -> Self::Future {
        let Some(peer) = request.extensions().get::<PeerInfo>().cloned() else {
            return Box::pin(self.inner.call(request));
        };
        peer.started.store(true, Ordering::Relaxed);
        let refused = |status: tonic::Status| -> Self::Future {
            Box::pin(async move { Ok(status.into_http()) })
        };
        let metrics = &self.gate.metrics;
        if peer.identity.credential == Credential::Certificate {
            if let Err(reason) = auth::roles(&peer.identity, &self.gate.groups).any() {
                return refused(refuse(metrics, reason, &peer, request.uri().path()));
            }
            return Box::pin(self.inner.call(request));
        }
        let token = match (bearer(request.headers()), &self.gate.tokens) {
            (Bearer::Token(token), Some(tokens)) => (token.to_string(), tokens.clone()),
            (Bearer::Malformed, Some(_)) => {
                let rejected = Rejected {
                    reason: Refusal::BadToken,
                    detail: "the authorization metadata is not \"Bearer <token>\"".into(),
                };
                return refused(refuse_token(
                    metrics,
                    &rejected,
                    &peer,
                    request.uri().path(),
                ));
            }
            _ => {
                return refused(refuse(
                    metrics,
                    Refusal::NoIdentity,
                    &peer,
                    request.uri().path(),
                ));
            }
        };
        // The inner service was made ready for this call: take it, leave a fresh clone.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let gate = self.gate.clone();
        Box::pin(async move {
            let (token, tokens) = token;
            let what = request.uri().path().to_string();
            let identity = match tokens.identity(&token).await {
                Ok(identity) => identity,
                Err(rejected) => {
                    return Ok(refuse_token(&gate.metrics, &rejected, &peer, &what).into_http());
                }
            };
            let peer = PeerInfo {
                identity: Arc::new(identity),
                ..peer
            };
            if let Err(reason) = auth::roles(&peer.identity, &gate.groups).any() {
                return Ok(refuse(&gate.metrics, reason, &peer, &what).into_http());
            }
            request.extensions_mut().insert(peer);
            inner.call(request).await
        })
    }
}

/// One rate limiter per refusal reason, so that a flood of one kind hides no other kind.
static REFUSAL_LOGS: [RateLimitedLog; Refusal::ALL.len()] =
    [const { RateLimitedLog::new(LOG_EVERY) }; Refusal::ALL.len()];

fn refusal_log(reason: Refusal) -> &'static RateLimitedLog {
    let i = Refusal::ALL
        .iter()
        .position(|r| *r == reason)
        .unwrap_or_default();
    &REFUSAL_LOGS[i]
}

/// Counts and logs (rate limited) a refused call, and the status that answers it.
pub fn refuse(metrics: &Metrics, reason: Refusal, peer: &PeerInfo, what: &str) -> tonic::Status {
    refuse_with(metrics, reason, peer, what, None)
}

/// [`refuse`] for a bearer token that was not accepted, with the reason the review gave.
pub fn refuse_token(
    metrics: &Metrics,
    rejected: &Rejected,
    peer: &PeerInfo,
    what: &str,
) -> tonic::Status {
    refuse_with(metrics, rejected.reason, peer, what, Some(&rejected.detail))
}

fn refuse_with(
    metrics: &Metrics,
    reason: Refusal,
    peer: &PeerInfo,
    what: &str,
    detail: Option<&str>,
) -> tonic::Status {
    metrics.surface.refused(reason);
    let names = &peer.identity.names;
    let groups = &peer.identity.groups;
    let credential = &peer.identity.credential;
    let message = match reason {
        Refusal::NoIdentity => {
            "no client certificate and no bearer token (authorization: Bearer <token>)".to_string()
        }
        Refusal::NoRole => match credential {
            Credential::Token { .. } => format!(
                "{credential} has no role: it is not the node ServiceAccount's, and SubjectAccessReview does not allow it to get {}/{}",
                crate::tokens::INTROSPECTION_GROUP,
                crate::tokens::INTROSPECTION_RESOURCE
            ),
            _ => format!(
                "{credential} (names {names:?}, groups {groups:?}) is in neither the node nor the operator group"
            ),
        },
        Refusal::BadToken | Refusal::NoNodeClaim | Refusal::TokenReviewUnavailable => {
            let what = match reason {
                Refusal::BadToken => "the bearer token was not accepted",
                Refusal::NoNodeClaim => "the bearer token names no node",
                _ => "the bearer token could not be reviewed; try again",
            };
            match detail {
                Some(d) => format!("{what}: {d}"),
                None => what.to_string(),
            }
        }
        Refusal::NotANode => "only node identities may open Sync".to_string(),
        Refusal::OtherNode => format!("{credential} identifies node(s) {names:?} only"),
        Refusal::NotAnOperator => "only operator identities may call this".to_string(),
        Refusal::BadHello => "the first message must be a valid Hello".to_string(),
        Refusal::HelloTimeout => "no Hello in time".to_string(),
        Refusal::PeerConnectionLimit | Refusal::ConnectionLimit => "too many connections".into(),
    };
    if let Some(held) = refusal_log(reason).admit() {
        tracing::warn!(
            peer = %peer.remote,
            %credential,
            ?names,
            ?groups,
            what = %auth::bounded(what, 256),
            reason = reason.as_str(),
            held_back = held,
            "call refused: {message}"
        );
    }
    match reason {
        Refusal::BadHello => tonic::Status::invalid_argument(message),
        Refusal::HelloTimeout => tonic::Status::deadline_exceeded(message),
        Refusal::NoIdentity | Refusal::BadToken => tonic::Status::unauthenticated(message),
        // Not the caller's fault: it should try again (or another brain), not give up.
        Refusal::TokenReviewUnavailable => tonic::Status::unavailable(message),
        _ => tonic::Status::permission_denied(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gate: a certificate comes first (a bad token beside it changes nothing); without
    /// one, the token's identity replaces the connection's for the services; no credential, a
    /// malformed or refused token, or tokens disabled are refused before any service runs.
    #[tokio::test]
    async fn the_gate_judges_certificates_first_and_tokens_otherwise() {
        use std::sync::atomic::AtomicUsize;

        use tonic::codegen::http;
        use tower::ServiceExt as _;

        use crate::tokens::{
            BoxFuture, ReviewError, Reviewer, TokenReviewed, TokenSettings, UserInfo,
        };

        struct Fake;
        impl Reviewer for Fake {
            fn review_token<'a>(
                &'a self,
                token: &'a str,
                _audience: &'a str,
            ) -> BoxFuture<'a, Result<TokenReviewed, ReviewError>> {
                Box::pin(async move {
                    Ok(match token {
                        "node-0-token" => TokenReviewed::Authenticated(UserInfo {
                            username: "system:serviceaccount:kube-system:actuator".into(),
                            extra: [(
                                crate::tokens::NODE_NAME_CLAIM.to_string(),
                                vec!["node-0".to_string()],
                            )]
                            .into(),
                            ..Default::default()
                        }),
                        _ => TokenReviewed::Unauthenticated("invalid bearer token".into()),
                    })
                })
            }
            fn may_introspect<'a>(
                &'a self,
                _user: &'a UserInfo,
            ) -> BoxFuture<'a, Result<bool, ReviewError>> {
                Box::pin(async { Ok(false) })
            }
        }

        let metrics = Arc::new(Metrics::default());
        let settings = TokenSettings {
            audience: "splitproxy".into(),
            node_service_account: Some("kube-system/actuator".parse().unwrap()),
        };
        let tokens = Arc::new(Authenticator::new(
            settings,
            Groups::default(),
            Arc::new(Fake),
            metrics.clone(),
        ));
        let seen = Arc::new(Mutex::new(Vec::<Identity>::new()));
        let served = Arc::new(AtomicUsize::new(0));
        let inner = {
            let (seen, served) = (seen.clone(), served.clone());
            tower::service_fn(move |r: http::Request<()>| {
                let (seen, served) = (seen.clone(), served.clone());
                async move {
                    served.fetch_add(1, Ordering::SeqCst);
                    if let Some(p) = r.extensions().get::<PeerInfo>() {
                        seen.lock().unwrap().push(p.identity.as_ref().clone());
                    }
                    Ok::<_, std::convert::Infallible>(http::Response::new(
                        tonic::body::Body::empty(),
                    ))
                }
            })
        };
        let gate = |tokens: Option<Arc<Authenticator>>| {
            tower::Layer::layer(
                &Gate {
                    groups: Arc::new(Groups::default()),
                    metrics: metrics.clone(),
                    tokens,
                },
                inner.clone(),
            )
        };
        let with_tokens = gate(Some(tokens));
        let without_tokens = gate(None);
        let request = |identity: Identity, authorization: Option<&str>| {
            let mut r = http::Request::builder().uri("/splitproxy.v1.Dataplane/ListNodes");
            if let Some(a) = authorization {
                r = r.header("authorization", a);
            }
            let mut r = r.body(()).unwrap();
            r.extensions_mut().insert(PeerInfo {
                remote: "127.0.0.1:1".parse().unwrap(),
                identity: Arc::new(identity),
                started: Arc::new(AtomicBool::new(false)),
            });
            r
        };
        let status = |r: &http::Response<tonic::body::Body>| {
            r.headers()
                .get("grpc-status")
                .map(|v| v.to_str().unwrap().to_string())
        };
        let certificate = |groups: &[&str]| Identity {
            names: vec!["node-0".into()],
            groups: groups.iter().map(|g| g.to_string()).collect(),
            expires: None,
            credential: Credential::Certificate,
        };

        // A certificate in the node group, with a bad token beside it: the certificate.
        let r = with_tokens
            .clone()
            .oneshot(request(
                certificate(&[auth::DEFAULT_NODE_GROUP]),
                Some("Bearer nonsense"),
            ))
            .await
            .unwrap();
        assert_eq!(status(&r), None, "served");
        assert_eq!(
            seen.lock().unwrap().pop().unwrap().credential,
            Credential::Certificate
        );
        // A certificate in no group is refused, token or not.
        let r = with_tokens
            .clone()
            .oneshot(request(certificate(&[]), Some("Bearer node-0-token")))
            .await
            .unwrap();
        assert_eq!(status(&r).as_deref(), Some("7"), "PERMISSION_DENIED");
        // No certificate: the token's identity reaches the service.
        let r = with_tokens
            .clone()
            .oneshot(request(Identity::default(), Some("Bearer node-0-token")))
            .await
            .unwrap();
        assert_eq!(status(&r), None, "served");
        let identity = seen.lock().unwrap().pop().unwrap();
        assert_eq!(identity.names, ["node-0"]);
        assert_eq!(identity.groups, [auth::DEFAULT_NODE_GROUP]);
        // Refused before any service: no credential, a bad token, a malformed header, and a
        // token when tokens are disabled.
        for (gate, authorization, code, reason) in [
            (&with_tokens, None, "16", Refusal::NoIdentity),
            (&with_tokens, Some("Bearer bad"), "16", Refusal::BadToken),
            (
                &with_tokens,
                Some("Basic dXNlcg=="),
                "16",
                Refusal::BadToken,
            ),
            (
                &without_tokens,
                Some("Bearer node-0-token"),
                "16",
                Refusal::NoIdentity,
            ),
        ] {
            let before = metrics.surface.refused_count(reason);
            let r = gate
                .clone()
                .oneshot(request(Identity::default(), authorization))
                .await
                .unwrap();
            assert_eq!(status(&r).as_deref(), Some(code), "{authorization:?}");
            assert_eq!(metrics.surface.refused_count(reason), before + 1);
        }
        assert_eq!(
            served.load(Ordering::SeqCst),
            2,
            "only the two accepted calls"
        );
    }

    #[test]
    fn bearer_tokens_are_read_from_the_authorization_metadata() {
        use tonic::codegen::http::{HeaderMap, HeaderValue, header::AUTHORIZATION};
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            h
        };
        assert_eq!(bearer(&HeaderMap::new()), Bearer::None);
        assert_eq!(bearer(&with("Bearer abc.def")), Bearer::Token("abc.def"));
        assert_eq!(bearer(&with("bearer  abc ")), Bearer::Token("abc"));
        for bad in ["Basic dXNlcg==", "Bearer", "Bearer ", "abc"] {
            assert_eq!(bearer(&with(bad)), Bearer::Malformed, "{bad:?}");
        }
    }

    #[test]
    fn the_log_admits_one_line_per_interval_and_counts_the_rest() {
        let log = RateLimitedLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.admit_at(t0), Some(0));
        for i in 1..=500 {
            assert_eq!(log.admit_at(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(log.admit_at(t0 + Duration::from_secs(10)), Some(500));
    }

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
