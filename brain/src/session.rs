//! One node's `Sync` session, run by the task that writes its response.
//!
//! A session waits for the desired state to move, computes the node's next update, hands it
//! over, and waits for the node's ack before the next one. It used to be a task of its own that
//! handed each update over a channel to the response body, which HTTP/2's per-stream task
//! polled: every update of every node woke two tasks on the brain before the connection's
//! (the session's, then the body's), and every ack woke the session's. [`Session`] is the
//! session as the stream of its updates instead: whoever polls it for the next update (the
//! response body, [`crate::sync_route::FrameBody`]) runs the session until it has one, so an
//! update wakes only the stream's task and an ack wakes the same task, which then polls the
//! session on. A stream that is not polled runs no session, and a session whose stream is
//! dropped (the node reset it, its connection closed) ends there and marks the node
//! disconnected.
//!
//! The cost: HTTP/2 polls a response body only while the stream may send. A node that stops
//! reading with a whole flow-control window unread (2 MiB by default, with one update in flight
//! at a time: a larger snapshot than that, half read) holds its session still until it reads
//! again or its connection's keepalive fails, and its ack timeout, expiry and replacement take
//! effect then. A node that stops reading within the window is timed out as before.
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use splitproxy_proto::frames::UpdateFrame;
use splitproxy_proto::v1::{Hello, SyncRequest, sync_request};
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};

use crate::ack_deadline::AckDeadline;
use crate::auth;
use crate::fanout::{Fanout, Next, Publication, Resume};
use crate::freshness::Freshness;

/// How long the brain waits for an ack before it gives up on the stream.
const ACK_TIMEOUT: Duration = Duration::from_secs(60);
/// Pause after a NACK before the next attempt (a snapshot), unless the state changes first.
const NACK_BACKOFF: Duration = Duration::from_secs(2);
/// How long a node placed in a window waits for a publication that covers the API state it
/// presents: it holds changes another replica published and this one has not yet, which a
/// restating delta covers only once they are published here (crate::restate). After that it
/// is sent one anyway, which its digest check may refuse (then a snapshot).
const WINDOW_WAIT: Duration = Duration::from_secs(1);

/// What ends a session besides the node: its credential's expiry, and the brain turning stale.
pub(crate) struct Bounds {
    /// When the caller's certificate or token expires.
    pub expires: Option<std::time::SystemTime>,
    /// The status a stream ends with at that expiry.
    pub expired: String,
    /// The last contact with the API server, for the status a stale brain ends streams with.
    pub freshness: Arc<Freshness>,
}

/// A session until it ends: how it ended is the status its stream ends with.
type Running = Pin<Box<dyn Future<Output = Result<(), Status>> + Send>>;

/// One node's session as the stream of its updates: each item is one update's frames, and a
/// session that ended with an error yields that status last.
pub struct Session {
    /// The session until it ends; `None` after.
    run: Option<Running>,
    /// Where the session puts each update while it is being polled.
    outbox: Outbox,
    /// The status the session ended with, after its last update.
    end: Option<Status>,
}

impl Session {
    /// Starts the session of the node that sent `hello` on a stream from `peer`: the node is
    /// connected from now until the session ends or is dropped.
    pub(crate) fn start(
        fanout: Arc<Fanout>,
        hello: Hello,
        inbound: Streaming<SyncRequest>,
        peer: String,
        bounds: Bounds,
    ) -> Session {
        let outbox = Outbox::default();
        let run = run(fanout, hello, inbound, peer, bounds, outbox.clone());
        Session {
            run: Some(Box::pin(run)),
            outbox,
            end: None,
        }
    }
}

impl Stream for Session {
    type Item = Result<Vec<UpdateFrame>, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(run) = &mut this.run
            && let Poll::Ready(ended) = run.as_mut().poll(cx)
        {
            this.end = ended.err();
            this.run = None;
        }
        if let Some(frames) = this.outbox.take() {
            return Poll::Ready(Some(Ok(frames)));
        }
        if this.run.is_some() {
            Poll::Pending
        } else {
            Poll::Ready(this.end.take().map(Err))
        }
    }
}

/// Where a running session puts an update for the stream that polls it. Only touched from
/// inside [`Session::poll_next`], so the lock is never contended.
#[derive(Clone, Default)]
struct Outbox(Arc<Mutex<Vec<UpdateFrame>>>);

impl Outbox {
    /// Queues an update's frames behind any not yet taken (a node cannot ack an update before
    /// it has it, so there is at most one, but a second one is not lost).
    fn put(&self, frames: Vec<UpdateFrame>) {
        let mut queued = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if queued.is_empty() {
            *queued = frames;
        } else {
            queued.extend(frames);
        }
    }

    fn take(&self) -> Option<Vec<UpdateFrame>> {
        let mut queued = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        (!queued.is_empty()).then(|| std::mem::take(&mut *queued))
    }
}

/// The node is connected while this lives: dropping it (the session ended, or its stream was
/// dropped mid-way) marks the session's node disconnected.
struct Connected {
    fanout: Arc<Fanout>,
    node: String,
    session: u64,
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.fanout.disconnect(&self.node, self.session);
    }
}

/// The session and what may end it first: a newer stream for the node, the credential's
/// expiry, the brain turning stale or stopping.
async fn run(
    fanout: Arc<Fanout>,
    hello: Hello,
    inbound: Streaming<SyncRequest>,
    peer: String,
    bounds: Bounds,
    outbox: Outbox,
) -> Result<(), Status> {
    let node = hello.node.clone();
    let (session_id, replaced) = fanout.connect(&node, &peer);
    let _connected = Connected {
        fanout: fanout.clone(),
        node: node.clone(),
        session: session_id,
    };
    fanout.hello(&node, hello.applied.as_ref());
    fanout.accept_encodings(&node, &hello.encodings);
    let ended = tokio::select! {
        r = session(&fanout, &hello, inbound, &outbox) => r,
        _ = replaced.notified() => Err(Status::aborted("a newer stream for this node replaced this one")),
        _ = until(bounds.expires) => Err(Status::unauthenticated(bounds.expired)),
        () = until_stale(&fanout) => Err(crate::server::stale_status(&bounds.freshness)),
        () = fanout.stopping() => Err(Status::unavailable("brain shutting down")),
    };
    // The stream ends with this status, so the node learns why if it still listens
    // (UNAVAILABLE when this brain went stale: the node moves to another replica, never
    // silently stale).
    if let Err(e) = &ended {
        tracing::info!(%node, session = session_id, error = %e, "node stream ended");
    }
    ended
}

/// Resolves when the brain turns stale (never, if the fan-out goes away first).
async fn until_stale(fanout: &Fanout) {
    let mut fresh = fanout.subscribe_fresh();
    if fresh.wait_for(|f| !*f).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// One node's session: wait until the brain is synced (no empty push), then send an update
/// whenever the desired state moves and the previous update has been answered.
async fn session(
    fanout: &Fanout,
    hello: &splitproxy_proto::v1::Hello,
    mut inbound: Streaming<SyncRequest>,
    outbox: &Outbox,
) -> Result<(), Status> {
    let node = hello.node.as_str();
    let (mut desired_rx, mut synced_rx) = fanout.subscribe();
    synced_rx
        .wait_for(|s| *s)
        .await
        .map_err(|_| Status::unavailable("brain shutting down"))?;
    // What the node holds: a state this brain published (`base`), or one in a window of them
    // (`window`, another replica's; crate::restate), or nothing known (a snapshot).
    let (mut base, mut window) = match fanout.resume_point(node, hello.applied.as_ref()) {
        Some(Resume::Exact(held)) => (Some(held), None),
        Some(Resume::Window(start, api)) => (None, Some((start, api))),
        None => (None, None),
    };
    let window_wait = tokio::time::Instant::now() + WINDOW_WAIT;
    let mut ack_deadline = AckDeadline::new(ACK_TIMEOUT);
    // Debug only: `resume_point` has logged how the node resumes ("resuming node"), and at
    // thousands of nodes a third line per connection is noise.
    tracing::debug!(
        node,
        resume = base.is_some(),
        window = window.is_some(),
        "serving node"
    );
    loop {
        let desired = desired_rx.borrow_and_update().clone();
        if !fanout.synced() {
            // Stale (relisting): keep what the node has, send nothing until synced again.
            synced_rx
                .wait_for(|s| *s)
                .await
                .map_err(|_| Status::unavailable("shutting down"))?;
            continue;
        }
        if let Some((_, api)) = &window
            && !desired.api.covers(api)
            && tokio::time::Instant::now() < window_wait
        {
            // The node holds changes this brain has not published yet.
            tokio::select! {
                r = desired_rx.changed() => r.map_err(|_| Status::unavailable("shutting down"))?,
                _ = tokio::time::sleep_until(window_wait) => {}
                msg = next_inbound(fanout, node, &mut inbound) => return unexpected(msg),
            }
            continue;
        }
        // A snapshot is the whole ruleset, copied into the stream's buffers until the node has
        // read it; bounding how many are in flight bounds the brain's memory when thousands of
        // nodes (re)connect at once. The permit is held until the node acks.
        let _permit = match (&base, &window) {
            (None, None) => Some(
                fanout
                    .snapshot_permits
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| Status::unavailable("shutting down"))?,
            ),
            _ => None,
        };
        let restating = window.take().map(|(start, _)| start);
        let next = match &restating {
            Some(start) => match fanout.restating_update(node, *start, &desired) {
                Some(next) => Some(next),
                // The window is no longer remembered whole: a snapshot, with a permit.
                None => continue,
            },
            None => fanout.next_update(node, base.as_ref(), &desired),
        };
        let (mut frames, target) = match next {
            Some(Next::Send(frames, target)) => (frames, target),
            other => {
                if let Some(Next::Current(held)) = other {
                    base = Some(held);
                }
                tokio::select! {
                    r = desired_rx.changed() => r.map_err(|_| Status::unavailable("shutting down"))?,
                    msg = next_inbound(fanout, node, &mut inbound) => return unexpected(msg),
                }
                continue;
            }
        };
        let generation = frames.first().map(|f| f.generation).unwrap_or_default();
        let parts = frames.len();
        // Only for a sampled change: its trace context goes to the node with the update.
        let traced = crate::trace::node_send(
            fanout,
            node,
            base.as_ref().map(|b| b.version).or(restating),
            target.version,
            &mut frames,
        );
        tracing::debug!(
            node,
            generation,
            parts,
            snapshot = base.is_none() && restating.is_none(),
            restating = restating.is_some(),
            "sending update"
        );
        outbox.put(frames);
        let sent = tokio::time::Instant::now();
        let ack = match ack_deadline
            .wait(sent, next_inbound(fanout, node, &mut inbound))
            .await
        {
            Err(_) => return Err(Status::deadline_exceeded("no ack")),
            Ok(Some(Ok(SyncRequest {
                msg: Some(sync_request::Msg::Ack(ack)),
            }))) => ack,
            Ok(other) => return unexpected(other),
        };
        let ack = bounded_ack(ack);
        if let Some(t) = traced {
            t.ack(node, &ack);
        }
        if ack.generation != generation {
            return Err(Status::invalid_argument(format!(
                "ack for generation {} while {} is outstanding",
                ack.generation, generation
            )));
        }
        if fanout.record_ack(node, &ack, target.clone()) {
            base = Some(target);
        } else {
            tracing::warn!(node, generation, error = %ack.error, "node failed to apply update; next is a snapshot");
            base = None;
            NackBackoff::new(desired.version, Instant::now(), NACK_BACKOFF)
                .wait(&mut desired_rx)
                .await;
        }
    }
}

/// When a node that NACKed an update gets its next attempt (a snapshot): after `backoff`, or
/// as soon as the desired state moves past the version it failed on, whichever comes first. A
/// node whose kernel keeps rejecting the same state is not sent it in a tight loop, and a node
/// that failed on a state already replaced is not kept waiting for the backoff.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NackBackoff {
    /// The publication the failed update was computed from.
    nacked_version: u64,
    retry_at: Instant,
}

impl NackBackoff {
    pub(crate) fn new(nacked_version: u64, now: Instant, backoff: Duration) -> Self {
        NackBackoff {
            nacked_version,
            retry_at: now + backoff,
        }
    }

    /// Whether the next attempt may go at `now` while `desired_version` is published.
    pub(crate) fn may_retry(&self, now: Instant, desired_version: u64) -> bool {
        now >= self.retry_at || desired_version != self.nacked_version
    }

    /// Waits until [`NackBackoff::may_retry`] holds (or the publisher is gone).
    pub(crate) async fn wait(&self, desired: &mut watch::Receiver<Arc<Publication>>) {
        tokio::select! {
            _ = tokio::time::sleep_until(self.retry_at.into()) => {}
            _ = desired.wait_for(|p| self.may_retry(Instant::now(), p.version)) => {}
        }
    }
}

/// Resolves when `at` (a certificate's notAfter, a token's `exp`) has passed; never without
/// one.
pub(crate) async fn until(at: Option<std::time::SystemTime>) {
    let Some(at) = at else {
        return std::future::pending().await;
    };
    loop {
        let left = at
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        if left.is_zero() {
            return;
        }
        // Clamped, so a far expiry cannot overflow the timer; checked again on waking.
        tokio::time::sleep(left.min(Duration::from_secs(24 * 3600))).await;
    }
}

/// The node's next message that is not a drift report. Drift reports may come at any point
/// after Hello (the node's reconciler sends them unasked); each is recorded as it arrives.
/// Cancel-safe: a report is recorded before the next message is awaited.
async fn next_inbound(
    fanout: &Fanout,
    node: &str,
    inbound: &mut Streaming<SyncRequest>,
) -> Option<Result<SyncRequest, Status>> {
    loop {
        match inbound.next().await {
            Some(Ok(SyncRequest {
                msg: Some(sync_request::Msg::Drift(drift)),
            })) => fanout.record_drift(node, bounded_drift(drift)),
            other => return other,
        }
    }
}

fn unexpected(msg: Option<Result<SyncRequest, Status>>) -> Result<(), Status> {
    match msg {
        None => Err(Status::cancelled("node closed its stream")),
        Some(Err(e)) => Err(e),
        Some(Ok(_)) => Err(Status::invalid_argument(
            "unexpected message: only acks and drift reports follow Hello",
        )),
    }
}

/// A drift report with every text the node sent bounded, as [`bounded_ack`] does for acks:
/// the brain logs and keeps the latest one per node, and `ListNodes` returns it.
fn bounded_drift(mut drift: splitproxy_proto::v1::Drift) -> splitproxy_proto::v1::Drift {
    const MAX_KINDS: usize = 16;
    for text in [&mut drift.summary, &mut drift.error] {
        if text.len() > auth::MAX_PEER_TEXT {
            *text = auth::bounded(text, auth::MAX_PEER_TEXT);
        }
    }
    drift.kinds.truncate(MAX_KINDS);
    for kind in &mut drift.kinds {
        if kind.len() > 64 {
            *kind = auth::bounded(kind, 64);
        }
    }
    drift
}

/// An ack with every text the node sent bounded ([`auth::MAX_PEER_TEXT`]): the brain keeps
/// and logs these, and `ListNodes` returns them.
fn bounded_ack(mut ack: splitproxy_proto::v1::Ack) -> splitproxy_proto::v1::Ack {
    for text in [
        &mut ack.error,
        &mut ack.refused_message,
        &mut ack.kernel_message,
    ] {
        if text.len() > auth::MAX_PEER_TEXT {
            *text = auth::bounded(text, auth::MAX_PEER_TEXT);
        }
    }
    ack
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use splitproxy_proto::model::Model;

    use super::NackBackoff;
    use crate::fanout::Fanout;
    use crate::metrics::Metrics;

    /// A node's side of a stream: what it sends goes to the session as gRPC messages.
    struct Node {
        tx: tokio::sync::mpsc::UnboundedSender<
            Result<http_body::Frame<bytes::Bytes>, std::convert::Infallible>,
        >,
    }

    impl Node {
        fn new() -> (Node, tonic::Streaming<splitproxy_proto::v1::SyncRequest>) {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let body = http_body_util::StreamBody::new(
                tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
            );
            let decoder = tonic_prost::ProstDecoder::<splitproxy_proto::v1::SyncRequest>::default();
            let inbound = tonic::Streaming::new_request(decoder, body, None, None);
            (Node { tx }, inbound)
        }

        fn ack(&self, generation: u64) {
            use prost::Message;
            let msg = splitproxy_proto::v1::SyncRequest {
                msg: Some(splitproxy_proto::v1::sync_request::Msg::Ack(
                    splitproxy_proto::v1::Ack {
                        generation,
                        ok: true,
                        ..Default::default()
                    },
                )),
            }
            .encode_to_vec();
            let mut framed = vec![0];
            framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
            framed.extend_from_slice(&msg);
            let _ = self.tx.send(Ok(http_body::Frame::data(framed.into())));
        }
    }

    /// A synced fan-out with one publication and `permits` snapshots at a time.
    fn serving(permits: usize) -> Arc<Fanout> {
        let fanout = Fanout::new(Arc::new(Metrics::default()), permits, 1024);
        fanout.set_synced(true);
        fanout.publish(shared(1), Default::default(), vec![], vec![]);
        fanout
    }

    fn start(fanout: &Arc<Fanout>, node: &str) -> (Node, super::Session) {
        let (peer, inbound) = Node::new();
        let hello = splitproxy_proto::v1::Hello {
            node: node.into(),
            ..Default::default()
        };
        let bounds = super::Bounds {
            expires: None,
            expired: String::new(),
            freshness: crate::freshness::Freshness::new(Duration::from_secs(60)),
        };
        let session = super::Session::start(fanout.clone(), hello, inbound, "peer".into(), bounds);
        (peer, session)
    }

    /// The next update `session` yields (within 5 s).
    async fn next(session: &mut super::Session) -> Vec<splitproxy_proto::frames::UpdateFrame> {
        use futures::StreamExt;
        tokio::time::timeout(Duration::from_secs(5), session.next())
            .await
            .expect("an update")
            .expect("the session goes on")
            .expect("not an error")
    }

    /// The session runs as its stream is polled: the first poll gives the node its snapshot,
    /// its ack and a new publication the next update. Dropping the stream mid-session (the
    /// node reset it, its connection closed) marks the node disconnected.
    #[tokio::test]
    async fn polling_the_stream_runs_the_session_and_dropping_it_disconnects_the_node() {
        use futures::StreamExt;
        let fanout = serving(1);
        let (node, mut session) = start(&fanout, "n1");
        let first = next(&mut session).await;
        assert_eq!(first[0].base_generation, 0, "a snapshot first");
        assert_eq!(fanout.connected_nodes(), 1);
        let generation = first.last().unwrap().generation;
        node.ack(generation);
        fanout.publish(shared(2), Default::default(), vec![], vec![]);
        let second = next(&mut session).await;
        assert_eq!(
            second[0].base_generation, generation,
            "a delta on what it acked"
        );
        // Nothing more to send: the stream waits, with the session waiting inside it.
        assert!(
            tokio::time::timeout(Duration::from_millis(100), session.next())
                .await
                .is_err()
        );
        assert_eq!(fanout.connected_nodes(), 1);
        drop(session);
        assert_eq!(fanout.connected_nodes(), 0, "the dropped stream's node");
    }

    /// A session that ends (here: a newer stream for its node) yields its status last, and
    /// then nothing.
    #[tokio::test]
    async fn a_replaced_session_ends_its_stream_with_the_reason() {
        use futures::StreamExt;
        // Two snapshot permits: the old stream holds one until its node acks.
        let fanout = serving(2);
        let (_old_node, mut old) = start(&fanout, "n1");
        next(&mut old).await;
        let (_node, mut new) = start(&fanout, "n1");
        next(&mut new).await;
        let ended = tokio::time::timeout(Duration::from_secs(5), old.next())
            .await
            .expect("the old stream ends")
            .expect("with a status")
            .expect_err("an error status");
        assert_eq!(ended.code(), tonic::Code::Aborted);
        assert!(old.next().await.is_none());
        assert_eq!(fanout.connected_nodes(), 1, "the newer stream's node stays");
    }

    fn shared(n: usize) -> Arc<Model> {
        let mut m = Model::default();
        m.upsert_table(&(splitproxy_proto::v1::Family::Ip, format!("t{n}")), "");
        Arc::new(m)
    }

    /// A `Sync` stream ends at its identity's expiry (`until` in the session's select): for a
    /// token, the JWT's `exp`, so a node whose token is not renewed stops receiving state.
    #[tokio::test]
    async fn a_token_identity_ends_its_stream_at_the_tokens_exp() {
        use std::time::{SystemTime, UNIX_EPOCH};

        use base64::Engine as _;
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        // Whole seconds, as a JWT carries them: one to two seconds from now.
        let exp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 2;
        let token = format!("{}.{}.sig", b64("{}"), b64(&format!(r#"{{"exp":{exp}}}"#)));
        let expires = crate::tokens::jwt_expiry(&token);
        assert_eq!(expires, Some(UNIX_EPOCH + Duration::from_secs(exp)));
        let start = Instant::now();
        tokio::time::timeout(Duration::from_secs(5), super::until(expires))
            .await
            .expect("the stream ends when the token expires");
        assert!(SystemTime::now() >= UNIX_EPOCH + Duration::from_secs(exp));
        assert!(
            start.elapsed() >= Duration::from_millis(900),
            "{:?}",
            start.elapsed()
        );
        // Without an expiry it never ends on that account.
        assert!(
            tokio::time::timeout(Duration::from_millis(100), super::until(None))
                .await
                .is_err()
        );
    }

    #[test]
    fn after_a_nack_no_retry_before_the_backoff_unless_the_state_moves() {
        let t0 = Instant::now();
        let b = NackBackoff::new(7, t0, Duration::from_secs(2));
        assert!(!b.may_retry(t0, 7));
        assert!(!b.may_retry(t0 + Duration::from_millis(1999), 7));
        assert!(b.may_retry(t0 + Duration::from_secs(2), 7), "backoff over");
        assert!(b.may_retry(t0, 8), "a newer desired state goes at once");
    }

    /// The wait of a session after a NACK: the backoff, cut short by a new publication but not
    /// by one that changes nothing (dropped).
    #[tokio::test]
    async fn the_wait_ends_at_the_backoff_or_at_a_new_publication() {
        let fanout = Fanout::new(Arc::new(Metrics::default()), 1, 1024);
        fanout.publish(shared(1), Default::default(), vec![], vec![]);
        let (mut rx, _) = fanout.subscribe();
        let version = rx.borrow_and_update().version;

        // Nothing new (an equal publication is dropped): the whole backoff.
        fanout.publish(shared(1), Default::default(), vec![], vec![]);
        let start = Instant::now();
        NackBackoff::new(version, start, Duration::from_millis(150))
            .wait(&mut rx)
            .await;
        assert!(start.elapsed() >= Duration::from_millis(150));

        // A new state during a long backoff: the retry goes then.
        let start = Instant::now();
        let backoff = NackBackoff::new(version, start, Duration::from_secs(30));
        let publisher = {
            let fanout = fanout.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                fanout.publish(shared(2), Default::default(), vec![], vec![]);
            })
        };
        tokio::time::timeout(Duration::from_secs(10), backoff.wait(&mut rx))
            .await
            .expect("woken by the new state, long before the backoff");
        assert!(start.elapsed() >= Duration::from_millis(50));
        publisher.await.expect("publisher");

        // A state that moved before the wait started: no wait at all.
        let start = Instant::now();
        tokio::time::timeout(
            Duration::from_secs(10),
            NackBackoff::new(version, start, Duration::from_secs(30)).wait(&mut rx),
        )
        .await
        .expect("no wait");
    }
}
