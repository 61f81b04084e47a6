//! A node's `Sync` connection served on one task: its HTTP/2 and its session together.
//!
//! Through the general gRPC server (tonic on hyper) every update took two tasks: the stream's,
//! which ran the session and handed the update to HTTP/2, and the connection's, which HTTP/2
//! woke to encrypt and write it; every ack went the same way back, through about ten layers of
//! boxed bodies and services. At thousands of nodes those hops were a good part of the brain's
//! CPU per update. A node that asks for it by ALPN ([`splitproxy_proto::transport::SYNC_ALPN`])
//! gets a connection that carries its `Sync` stream and nothing else, served here: one task
//! polls the HTTP/2 connection ([`h2`] directly) and the session's response body
//! ([`FrameBody`], the same encoder as on the general server), so an update is written by the
//! task that made it and an ack is read by the task that waits for it.
//!
//! What the general server does for a stream is done here too, with the same code: the gate
//! ([`Gate::admit`]: certificate roles, bearer tokens, refusals counted), the Hello and the
//! session ([`DataplaneService::open_sync`]), the message limits, keepalive PINGs (HTTP/2
//! windows are hyper's defaults, as the general server's), and the connection's deadlines and
//! bounds ([`Conn`]). The bytes on the wire are gRPC over HTTP/2, as on an `h2` connection. A
//! call for any other method on such a connection is answered UNIMPLEMENTED, and the connection
//! allows one stream at a time (SETTINGS_MAX_CONCURRENT_STREAMS 1): a node opens one.
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use h2::server::{Connection, SendResponse};
use h2::{Ping, PingPong, RecvStream, SendStream};
use http_body::{Body, Frame, SizeHint};
use splitproxy_proto::transport::{KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT};
use tokio::time::{Instant, Sleep};
use tonic::Status;
use tonic::transport::server::Connected;

use crate::listener::{Admission, Conn, Gate, PeerInfo};
use crate::server::DataplaneService;
use crate::session::Session;
use crate::sync_route::{FrameBody, SYNC_PATH, inbound, refuse_encoding};

/// HTTP/2 flow-control windows and limits: hyper's server defaults, which the general server
/// runs with, so a node sees the same connection whichever server answers it.
const STREAM_WINDOW: u32 = 1024 * 1024;
const CONNECTION_WINDOW: u32 = 1024 * 1024;
const MAX_HEADER_LIST: u32 = 16 * 1024;
const MAX_SEND_BUFFER: usize = 400 * 1024;

/// What serves `Sync` connections, shared by all of them.
pub struct SyncServer {
    pub service: DataplaneService,
    pub gate: Gate,
    /// The largest message a node may send, and the largest update frame sent.
    pub max_request: usize,
    pub max_message: usize,
    /// Connections being served, so that a brain on its way out lets them finish.
    open: AtomicUsize,
    closed: tokio::sync::Notify,
}

impl SyncServer {
    pub fn new(
        service: DataplaneService,
        gate: Gate,
        max_request: usize,
        max_message: usize,
    ) -> Arc<Self> {
        Arc::new(SyncServer {
            service,
            gate,
            max_request,
            max_message,
            open: AtomicUsize::new(0),
            closed: tokio::sync::Notify::new(),
        })
    }

    /// Serves `conn` on a task of its own until the node or the brain closes it.
    pub fn spawn(self: &Arc<Self>, conn: Conn) {
        self.open.fetch_add(1, Ordering::Relaxed);
        let gauge = &self.gate.metrics.surface.sync_connections;
        gauge.fetch_add(1, Ordering::Relaxed);
        let server = self.clone();
        tokio::spawn(async move {
            let remote = conn.connect_info().remote;
            if let Err(e) = server.serve(conn).await {
                tracing::debug!(%remote, error = %e, "sync connection ended");
            }
            let gauge = &server.gate.metrics.surface.sync_connections;
            gauge.fetch_sub(1, Ordering::Relaxed);
            if server.open.fetch_sub(1, Ordering::AcqRel) == 1 {
                server.closed.notify_waiters();
            }
        });
    }

    /// Waits until every connection has closed, at most `limit`: their streams end when the
    /// brain stops (`Fanout::stop`), and each connection is then shut down gracefully.
    pub async fn drained(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, async {
            loop {
                let closed = self.closed.notified();
                if self.open.load(Ordering::Acquire) == 0 {
                    return;
                }
                closed.await;
            }
        })
        .await;
    }

    async fn serve(&self, conn: Conn) -> anyhow::Result<()> {
        let peer = conn.connect_info();
        let mut h2 = h2::server::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_header_list_size(MAX_HEADER_LIST)
            .max_send_buffer_size(MAX_SEND_BUFFER)
            .max_concurrent_streams(1)
            .handshake::<_, Bytes>(conn)
            .await?;
        let received = Arc::new(AtomicU64::new(0));
        let mut state = State {
            call: None,
            keepalive: Keepalive::new(h2.ping_pong(), received.clone()),
            received,
            shutting_down: false,
        };
        std::future::poll_fn(|cx| self.poll_conn(cx, &mut h2, &peer, &mut state)).await
    }

    /// Drives the connection: its call first (what it queues is written by the connection's
    /// poll right after), then the connection, then its keepalive.
    fn poll_conn(
        &self,
        cx: &mut Context<'_>,
        h2: &mut Connection<Conn, Bytes>,
        peer: &PeerInfo,
        state: &mut State,
    ) -> Poll<anyhow::Result<()>> {
        loop {
            if let Some(call) = &mut state.call
                && self.poll_call(cx, call).is_ready()
            {
                state.call = None;
                if self.service.fanout.stopped() && !state.shutting_down {
                    state.shutting_down = true;
                    h2.graceful_shutdown();
                }
            }
            match h2.poll_accept(cx) {
                Poll::Ready(Some(Ok((request, mut respond)))) => {
                    if state.call.is_some() {
                        // Opened before the client saw the limit of one stream: the node's
                        // session goes on.
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                    } else {
                        state.call = self.open(request, respond, peer, &state.received);
                    }
                    continue;
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e.into())),
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => {}
            }
            if let Poll::Ready(Err(e)) = state.keepalive.poll(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Pending;
        }
    }

    /// A new stream: a `Sync` call admitted by the gate goes on to wait for its Hello; anything
    /// else is answered at once.
    fn open(
        &self,
        request: http::Request<RecvStream>,
        mut respond: SendResponse<Bytes>,
        peer: &PeerInfo,
        received: &Arc<AtomicU64>,
    ) -> Option<Call> {
        let path = request.uri().path();
        let refused = if path != SYNC_PATH {
            Some(Status::unimplemented(format!(
                "{path}: this connection carries {} only ({} by ALPN)",
                SYNC_PATH,
                String::from_utf8_lossy(splitproxy_proto::transport::SYNC_ALPN)
            )))
        } else {
            refuse_encoding(request.headers())
        };
        let admission = match refused {
            Some(status) => Admission::Refused(status),
            None => self.gate.admit(peer.clone(), request.headers(), SYNC_PATH),
        };
        let review = match admission {
            Admission::Refused(status) => {
                respond_with(&mut respond, &status);
                return None;
            }
            Admission::Admitted => None,
            Admission::Review(review) => Some(review),
        };
        let (parts, body) = request.into_parts();
        let body = Inbound {
            stream: body,
            received: received.clone(),
        };
        let mut request = http::Request::from_parts(parts, inbound(body, self.max_request));
        let service = self.service.clone();
        let peer = peer.clone();
        let opening = async move {
            let peer = match review {
                Some(review) => review.run(SYNC_PATH).await?,
                None => peer,
            };
            request.extensions_mut().insert(peer);
            service.open_sync(tonic::Request::from_http(request)).await
        };
        Some(Call::Opening {
            respond,
            opening: Box::pin(opening),
        })
    }

    /// Runs a call until its response has ended.
    fn poll_call(&self, cx: &mut Context<'_>, call: &mut Call) -> Poll<()> {
        loop {
            match call {
                Call::Opening { respond, opening } => {
                    let session = match opening.as_mut().poll(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(session)) => session,
                        Poll::Ready(Err(status)) => {
                            respond_with(respond, &status);
                            return Poll::Ready(());
                        }
                    };
                    let response = http::Response::builder()
                        .header(http::header::CONTENT_TYPE, "application/grpc")
                        .body(())
                        .unwrap_or_default();
                    match respond.send_response(response, false) {
                        Ok(send) => {
                            *call = Call::Serving {
                                body: FrameBody::new(session, self.max_message),
                                send,
                            }
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "sync stream gone before its response");
                            return Poll::Ready(());
                        }
                    }
                }
                Call::Serving { body, send } => {
                    return match pump(cx, body, send) {
                        Poll::Pending => Poll::Pending,
                        Poll::Ready(Err(e)) => {
                            tracing::debug!(error = %e, "sync stream ended early");
                            Poll::Ready(())
                        }
                        Poll::Ready(Ok(())) => Poll::Ready(()),
                    };
                }
            }
        }
    }
}

/// The connection's state between polls.
struct State {
    call: Option<Call>,
    keepalive: Keepalive,
    /// Chunks received on the connection's call, for the keepalive: a connection that reads
    /// acks needs no PING to tell it is alive.
    received: Arc<AtomicU64>,
    shutting_down: bool,
}

/// The connection's one call.
enum Call {
    /// Admitted (or its token under review), waiting for the node's Hello.
    Opening {
        respond: SendResponse<Bytes>,
        opening: Pin<Box<dyn Future<Output = Result<Session, Status>> + Send>>,
    },
    /// Streaming updates.
    Serving {
        body: FrameBody<Session>,
        send: SendStream<Bytes>,
    },
}

/// Answers a stream with `status` alone (a gRPC "trailers-only" response).
fn respond_with(respond: &mut SendResponse<Bytes>, status: &Status) {
    let (parts, _) = status.clone().into_http::<()>().into_parts();
    let response = http::Response::from_parts(parts, ());
    if let Err(e) = respond.send_response(response, true) {
        tracing::debug!(error = %e, "refusal not sent: the stream is gone");
    }
}

/// Moves the response body into the stream as HTTP/2 lets it: the body (the session) is
/// polled only while the stream has window to send, as hyper does, so a node that stops
/// reading holds its session still instead of the brain buffering updates for it. Ready when
/// the response has ended (its trailers are queued), or the node reset the stream.
fn pump(
    cx: &mut Context<'_>,
    body: &mut FrameBody<Session>,
    send: &mut SendStream<Bytes>,
) -> Poll<Result<(), h2::Error>> {
    loop {
        // Ask for a byte of window to learn when there is some; h2 manages the rest.
        send.reserve_capacity(1);
        if send.capacity() == 0 {
            loop {
                match send.poll_capacity(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(0))) => {}
                    Poll::Ready(Some(Ok(_))) => break,
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                    // The stream is no longer open for sending: reset by the node.
                    Poll::Ready(None) => return Poll::Ready(Ok(())),
                }
            }
        } else if let Poll::Ready(reason) = send.poll_reset(cx)? {
            return Poll::Ready(Err(reason.into()));
        }
        let frame = match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(frame) => frame,
        };
        match frame {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => send.send_data(data, false)?,
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        send.reserve_capacity(0);
                        send.send_trailers(trailers)?;
                        return Poll::Ready(Ok(()));
                    }
                }
            },
            // FrameBody ends with trailers and never fails; either way the stream ends.
            Some(Err(status)) => {
                let mut trailers = http::HeaderMap::new();
                let _ = status.add_header(&mut trailers);
                send.send_trailers(trailers)?;
                return Poll::Ready(Ok(()));
            }
            None => {
                send.send_data(Bytes::new(), true)?;
                return Poll::Ready(Ok(()));
            }
        }
    }
}

/// The node's side of the call as a body for tonic's decoder: each chunk is handed over and
/// its window given back at once (as hyper does), and counted for the keepalive.
struct Inbound {
    stream: RecvStream,
    received: Arc<AtomicU64>,
}

impl Body for Inbound {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        match this.stream.poll_data(cx) {
            Poll::Ready(Some(Ok(data))) => {
                this.received.fetch_add(1, Ordering::Relaxed);
                let _ = this.stream.flow_control().release_capacity(data.len());
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => {}
            Poll::Pending => return Poll::Pending,
        }
        match this.stream.poll_trailers(cx) {
            Poll::Ready(Ok(Some(trailers))) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.stream.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// HTTP/2 PINGs on a connection that has been quiet: one after [`KEEPALIVE_INTERVAL`] without
/// anything read from the node, and the connection closed when its answer has not come within
/// [`KEEPALIVE_TIMEOUT`] (the general server's settings). A node that acks updates is not
/// pinged. Its timer is moved only when it fires, not on every update.
struct Keepalive {
    ping_pong: Option<PingPong>,
    timer: Pin<Box<Sleep>>,
    received: Arc<AtomicU64>,
    /// What `received` said when the timer was last set.
    seen: u64,
    /// When the outstanding PING was sent.
    pinged: Option<Instant>,
}

impl Keepalive {
    fn new(ping_pong: Option<PingPong>, received: Arc<AtomicU64>) -> Self {
        Keepalive {
            ping_pong,
            timer: Box::pin(tokio::time::sleep(KEEPALIVE_INTERVAL)),
            received,
            seen: 0,
            pinged: None,
        }
    }

    /// Ready with an error when the node did not answer a PING in time.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<anyhow::Result<()>> {
        let Some(ping_pong) = &mut self.ping_pong else {
            return Poll::Pending;
        };
        if self.pinged.is_some() {
            match ping_pong.poll_pong(cx) {
                Poll::Ready(Ok(_)) => {
                    self.pinged = None;
                    self.seen = self.received.load(Ordering::Relaxed);
                    self.timer
                        .as_mut()
                        .reset(Instant::now() + KEEPALIVE_INTERVAL);
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Pending => {}
            }
        }
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            if let Some(at) = self.pinged {
                if now >= at + KEEPALIVE_TIMEOUT {
                    return Poll::Ready(Err(anyhow::anyhow!(
                        "no answer to a keepalive PING within {KEEPALIVE_TIMEOUT:?}"
                    )));
                }
                self.timer.as_mut().reset(at + KEEPALIVE_TIMEOUT);
                continue;
            }
            let received = self.received.load(Ordering::Relaxed);
            if received != self.seen {
                self.seen = received;
                self.timer.as_mut().reset(now + KEEPALIVE_INTERVAL);
                continue;
            }
            ping_pong.send_ping(Ping::opaque())?;
            self.pinged = Some(now);
            self.timer.as_mut().reset(now + KEEPALIVE_TIMEOUT);
            // Registers for the answer.
            if let Poll::Ready(Err(e)) = ping_pong.poll_pong(cx) {
                return Poll::Ready(Err(e.into()));
            }
        }
        Poll::Pending
    }
}
