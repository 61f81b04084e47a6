//! The floor's rounds on tokio tasks: TLS by tokio-rustls, and optionally HTTP/2 by `h2`.
//!
//! The epoll floor says what the system calls and TLS cost. Between it and the brain sit the
//! async runtime and HTTP/2 with gRPC's framing, and whether those two are what the brain pays
//! for, or what it does itself, is the question a change of transport turns on. So the same
//! rounds run twice more, each side on a single-threaded tokio runtime (one thread, so its CPU
//! is the thread's, as the epoll floor's is):
//!
//! - [`Stack::Tokio`]: a task per stream over tokio-rustls, writing each update and reading
//!   each ack as bytes, what a length-prefixed protocol over mTLS would pay at least;
//! - [`Stack::H2`]: the same with one HTTP/2 stream per connection (the `h2` crate, the one
//!   hyper and tonic use), request and response headers as a gRPC call has them, each update
//!   and ack a DATA frame, flow-control windows released as the data is taken; one task per
//!   connection drives both the connection and its stream, as the virtual fleet's nodes do;
//! - [`Stack::Hyper`]: the sending side served as the brain's streams are, by hyper's HTTP/2
//!   server (the one under tonic): a task for the connection, one hyper spawns for the stream,
//!   and the response body polled by it taking the acks from the request body and the next
//!   update, as the brain's session is polled by its body. The nodes' side is `H2`'s.
//!
//! No protobuf, no allocation per message beyond what the libraries make, and one shared
//! `Bytes` sent to every stream: what is measured is the stack, not the brain's work. A round
//! starts for every stream through one `watch` channel, and the task whose ack completes a
//! round wakes the round's driver.
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::Stream;
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio_stream::wrappers::WatchStream;

use super::link::{SERVER_NAME, Wire};
use super::{LIMIT, Sizes, thread_cpu};

/// What carries the floor's rounds above the sockets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Stack {
    /// One epoll loop a side, no runtime: bare TCP or TLS by rustls.
    #[default]
    Epoll,
    /// A tokio task per stream, TLS by tokio-rustls, updates and acks as bytes.
    Tokio,
    /// As `Tokio`, with an HTTP/2 stream per connection carrying them as DATA frames.
    H2,
    /// As `H2`, the sending side served by hyper's HTTP/2 server.
    Hyper,
}

/// The windows the actuator's client announces (hyper's defaults, as tonic leaves them).
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;

/// Counts shared by a side's tasks and its driver.
#[derive(Default)]
struct Progress {
    /// Streams past their handshakes.
    ready: AtomicUsize,
    /// Messages taken whole: acks on the sending side, updates on the nodes' side.
    done: AtomicUsize,
    /// A stream failed where no task ends with it: under hyper a failed response body resets
    /// its stream and the connection's task goes on.
    failed: AtomicBool,
    /// Woken when `ready` reaches every stream, when `done` completes a round and on a failure.
    wake: Notify,
}

impl Progress {
    fn add_ready(&self, nodes: usize) {
        if self.ready.fetch_add(1, Ordering::Relaxed) + 1 == nodes {
            self.wake.notify_one();
        }
    }

    fn add_done(&self, nodes: usize) {
        if (self.done.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(nodes) {
            self.wake.notify_one();
        }
    }

    /// A stream failed: the rounds stop at once rather than at the time limit.
    fn fail(&self) {
        self.failed.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }

    /// Waits until `reached` holds, failing as soon as any task ends (no task ends while the
    /// rounds run, unless its stream failed) or a stream says it failed.
    async fn until(
        &self,
        tasks: &mut JoinSet<anyhow::Result<()>>,
        reached: impl Fn(&Progress) -> bool,
    ) -> anyhow::Result<()> {
        while !reached(self) {
            if self.failed.load(Ordering::Relaxed) {
                bail!("a stream failed before the rounds ended");
            }
            tokio::select! {
                _ = self.wake.notified() => {}
                Some(ended) = tasks.join_next() => {
                    ended.context("a stream's task panicked")??;
                    bail!("a stream ended before the rounds did");
                }
            }
        }
        Ok(())
    }
}

/// A stream's bytes counted into whole messages of one size (HTTP/2 may split or join them).
struct Whole {
    size: usize,
    got: usize,
}

impl Whole {
    fn new(size: usize) -> Self {
        Whole { size, got: 0 }
    }

    /// Takes `n` more bytes; returns how many messages they completed.
    fn add(&mut self, n: usize) -> usize {
        self.got += n;
        let whole = self.got / self.size;
        self.got %= self.size;
        whole
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// The sending side's TLS acceptor, from the server configuration in `wire`.
fn acceptor(wire: &Wire) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    match wire {
        Wire::TlsServer(cfg) => Ok(cfg.clone().into()),
        _ => bail!("the floor on tokio runs over TLS only"),
    }
}

/// The sending side on `stack`: accept every node, then the rounds. Returns its CPU seconds,
/// the rounds' total and worst wall time.
pub(super) fn sending_side(
    listener: &std::net::TcpListener,
    wire: &Wire,
    stack: Stack,
    nodes_gone: &mut dyn FnMut() -> bool,
    (nodes, update_bytes, ack_bytes, rounds): Sizes,
    started: Instant,
) -> anyhow::Result<(f64, Duration, Duration)> {
    let acceptor = acceptor(wire)?;
    let listener = listener.try_clone()?;
    let left = LIMIT.saturating_sub(started.elapsed());
    runtime()?.block_on(async move {
        let listener = TcpListener::from_std(listener)?;
        let progress = Arc::new(Progress::default());
        let (round, next_round) = watch::channel(0_usize);
        let update = Bytes::from(vec![0x5a_u8; update_bytes]);
        let mut tasks = JoinSet::new();
        let run = async {
            let mut accepted = 0;
            while accepted < nodes {
                tokio::select! {
                    a = listener.accept() => {
                        let (s, _) = a.context("accepting")?;
                        s.set_nodelay(true)?;
                        let side = SendingStream {
                            progress: progress.clone(),
                            next_round: next_round.clone(),
                            update: update.clone(),
                            nodes,
                            ack_bytes,
                        };
                        tasks.spawn(side.run(acceptor.clone(), s, stack));
                        accepted += 1;
                    }
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {
                        if nodes_gone() {
                            bail!("the nodes stopped connecting");
                        }
                    }
                }
            }
            progress
                .until(&mut tasks, |p| p.ready.load(Ordering::Relaxed) == nodes)
                .await?;
            let cpu0 = thread_cpu();
            let (mut total, mut worst) = (Duration::ZERO, Duration::ZERO);
            for r in 1..=rounds {
                let start = Instant::now();
                round.send_replace(r);
                progress
                    .until(&mut tasks, |p| p.done.load(Ordering::Relaxed) == r * nodes)
                    .await?;
                let took = start.elapsed();
                total += took;
                worst = worst.max(took);
            }
            anyhow::Ok((thread_cpu() - cpu0, total, worst))
        };
        tokio::time::timeout(left, run)
            .await
            .map_err(|_| anyhow::anyhow!("the measurement took longer than {LIMIT:?}"))?
    })
}

/// One node's stream on the sending side.
struct SendingStream {
    progress: Arc<Progress>,
    next_round: watch::Receiver<usize>,
    update: Bytes,
    nodes: usize,
    ack_bytes: usize,
}

impl SendingStream {
    async fn run(
        self,
        acceptor: tokio_rustls::TlsAcceptor,
        s: TcpStream,
        stack: Stack,
    ) -> anyhow::Result<()> {
        let tls = acceptor.accept(s).await.context("the TLS handshake")?;
        match stack {
            Stack::H2 => self.over_h2(tls).await,
            Stack::Hyper => self.over_hyper(tls).await,
            _ => self.over_tls(tls).await,
        }
    }

    async fn over_hyper(
        self,
        tls: impl AsyncRead + AsyncWrite + Unpin + Send + 'static,
    ) -> anyhow::Result<()> {
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            self.progress.add_ready(self.nodes);
            let body = RoundBody {
                acks: request.into_body(),
                rounds: WatchStream::from_changes(self.next_round.clone()),
                update: self.update.clone(),
                progress: self.progress.clone(),
                nodes: self.nodes,
                acks_taken: Whole::new(self.ack_bytes),
            };
            let response = http::Response::builder()
                .header("content-type", "application/grpc")
                .body(body);
            std::future::ready(response)
        });
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(tls), service)
            .await
            .context("serving the connection")
    }

    async fn over_tls(
        mut self,
        mut tls: impl AsyncRead + AsyncWrite + Unpin,
    ) -> anyhow::Result<()> {
        self.progress.add_ready(self.nodes);
        let mut ack = vec![0_u8; self.ack_bytes];
        while self.next_round.changed().await.is_ok() {
            tls.write_all(&self.update).await?;
            tls.flush().await?;
            tls.read_exact(&mut ack).await?;
            self.progress.add_done(self.nodes);
        }
        Ok(())
    }

    async fn over_h2(
        mut self,
        tls: impl AsyncRead + AsyncWrite + Unpin + Send,
    ) -> anyhow::Result<()> {
        let mut conn = h2::server::handshake(tls)
            .await
            .context("the HTTP/2 handshake")?;
        let (request, mut respond) = conn
            .accept()
            .await
            .context("the connection closed before its call")??;
        let head = http::Response::builder()
            .header("content-type", "application/grpc")
            .body(())?;
        let mut send = respond.send_response(head, false)?;
        let mut body = request.into_body();
        self.progress.add_ready(self.nodes);
        let mut acks = Whole::new(self.ack_bytes);
        loop {
            tokio::select! {
                biased;
                closed = poll_fn(|cx| conn.poll_closed(cx)) => {
                    closed?;
                    return Ok(());
                }
                changed = self.next_round.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    send.send_data(self.update.clone(), false)?;
                }
                data = body.data() => {
                    let data = data.context("the call ended")??;
                    body.flow_control().release_capacity(data.len())?;
                    for _ in 0..acks.add(data.len()) {
                        self.progress.add_done(self.nodes);
                    }
                }
            }
        }
    }
}

/// A stream's response body under hyper: each poll takes the acks that arrived from the
/// request body, then the next round's update if it started.
struct RoundBody {
    acks: Incoming,
    rounds: WatchStream<usize>,
    update: Bytes,
    progress: Arc<Progress>,
    nodes: usize,
    acks_taken: Whole,
}

impl http_body::Body for RoundBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        loop {
            match Pin::new(&mut this.acks).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        for _ in 0..this.acks_taken.add(data.len()) {
                            this.progress.add_done(this.nodes);
                        }
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.progress.fail();
                    return Poll::Ready(Some(Err(e)));
                }
                // The node ends its call only after the sending side has closed the streams,
                // once the rounds are over; sooner, the rounds cannot complete.
                Poll::Ready(None) => {
                    this.progress.fail();
                    return Poll::Ready(None);
                }
                Poll::Pending => break,
            }
        }
        match Pin::new(&mut this.rounds).poll_next(cx) {
            Poll::Ready(Some(_)) => Poll::Ready(Some(Ok(Frame::data(this.update.clone())))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The nodes' side on `stack`: connect every node, answer every whole update with an ack.
/// Returns its CPU seconds from the first update on, once every update is answered and the
/// sending side has closed its streams (acks queued in HTTP/2 are written only while the
/// connection is driven, so it is driven until then).
pub(super) fn nodes_side(
    addr: std::net::SocketAddr,
    wire: &Wire,
    stack: Stack,
    (nodes, update_bytes, ack_bytes, rounds): Sizes,
    started: Instant,
) -> anyhow::Result<f64> {
    let Wire::TlsClient(cfg) = wire else {
        bail!("the floor on tokio runs over TLS only");
    };
    let connector = tokio_rustls::TlsConnector::from(cfg.clone());
    let left = LIMIT.saturating_sub(started.elapsed());
    runtime()?.block_on(async move {
        let progress = Arc::new(Progress::default());
        let ack = Bytes::from(vec![0xa5_u8; ack_bytes]);
        let mut tasks = JoinSet::new();
        let run = async {
            for _ in 0..nodes {
                let s = TcpStream::connect(addr).await.context("connecting")?;
                s.set_nodelay(true)?;
                let node = NodeStream {
                    progress: progress.clone(),
                    ack: ack.clone(),
                    nodes,
                    update_bytes,
                };
                tasks.spawn(node.run(connector.clone(), s, stack));
            }
            progress
                .until(&mut tasks, |p| p.ready.load(Ordering::Relaxed) == nodes)
                .await?;
            let cpu0 = thread_cpu();
            progress
                .until(&mut tasks, |p| {
                    p.done.load(Ordering::Relaxed) == rounds * nodes
                })
                .await?;
            let cpu = thread_cpu() - cpu0;
            // The sending side closes its streams once it has every ack; what its closing does
            // to a stream (an error or a clean end) no longer matters.
            while tasks.join_next().await.is_some() {}
            anyhow::Ok(cpu)
        };
        tokio::time::timeout(left, run)
            .await
            .map_err(|_| anyhow::anyhow!("the measurement took longer than {LIMIT:?}"))?
    })
}

/// One node's stream on the nodes' side.
struct NodeStream {
    progress: Arc<Progress>,
    ack: Bytes,
    nodes: usize,
    update_bytes: usize,
}

impl NodeStream {
    async fn run(
        self,
        connector: tokio_rustls::TlsConnector,
        s: TcpStream,
        stack: Stack,
    ) -> anyhow::Result<()> {
        let name = ServerName::try_from(SERVER_NAME)?;
        let tls = connector
            .connect(name, s)
            .await
            .context("the TLS handshake")?;
        match stack {
            Stack::H2 | Stack::Hyper => self.over_h2(tls).await,
            _ => self.over_tls(tls).await,
        }
    }

    async fn over_tls(self, mut tls: impl AsyncRead + AsyncWrite + Unpin) -> anyhow::Result<()> {
        self.progress.add_ready(self.nodes);
        let mut update = vec![0_u8; self.update_bytes];
        loop {
            tls.read_exact(&mut update).await?;
            tls.write_all(&self.ack).await?;
            tls.flush().await?;
            self.progress.add_done(self.nodes);
        }
    }

    async fn over_h2(self, tls: impl AsyncRead + AsyncWrite + Unpin + Send) -> anyhow::Result<()> {
        let (mut requests, mut conn) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .handshake::<_, Bytes>(tls)
            .await
            .context("the HTTP/2 handshake")?;
        let request = http::Request::post(format!("https://{SERVER_NAME}/floor.v1.Floor/Sync"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())?;
        let (response, mut send) = requests.send_request(request, false)?;
        let response = tokio::select! {
            closed = &mut conn => {
                closed?;
                bail!("the connection closed before the call's response");
            }
            response = response => response?,
        };
        let mut body = response.into_body();
        self.progress.add_ready(self.nodes);
        let mut updates = Whole::new(self.update_bytes);
        loop {
            tokio::select! {
                biased;
                closed = &mut conn => return Ok(closed?),
                data = body.data() => {
                    let data = data.context("the call ended")??;
                    body.flow_control().release_capacity(data.len())?;
                    for _ in 0..updates.add(data.len()) {
                        send.send_data(self.ack.clone(), false)?;
                        self.progress.add_done(self.nodes);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream that fails where its task goes on (a hyper stream's body) stops the wait at
    /// once, not at the measurement's time limit.
    #[tokio::test]
    async fn a_failed_stream_ends_the_wait_for_a_round() {
        let progress = Arc::new(Progress::default());
        let mut tasks: JoinSet<anyhow::Result<()>> = JoinSet::new();
        // A task that outlives the wait, as a hyper connection's does after its stream reset.
        tasks.spawn(async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(())
        });
        let failing = progress.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            failing.fail();
        });
        let waited = tokio::time::timeout(
            Duration::from_secs(10),
            progress.until(&mut tasks, |p| p.done.load(Ordering::Relaxed) == 1),
        )
        .await
        .expect("the wait ends with the failure, long before any limit");
        assert!(waited.is_err(), "the wait failed with the stream");
        progress.add_done(1);
        assert!(
            progress
                .until(&mut tasks, |p| p.done.load(Ordering::Relaxed) == 1)
                .await
                .is_ok(),
            "a wait already reached is not failed"
        );
    }
}
