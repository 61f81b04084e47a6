//! The `splitproxy.v1.Dataplane` gRPC service: one `Sync` stream per node, plus read-only
//! introspection for operators.
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use splitproxy_proto::frames::UpdateFrame;
use splitproxy_proto::frames_server::dataplane_server::Dataplane;
use splitproxy_proto::v1::{
    ExplainPacketRequest, ExplainPacketResponse, GetNodeRulesetRequest, GetNodeRulesetResponse,
    GetServiceRequest, GetServiceResponse, ListNodesRequest, ListNodesResponse, NodeEvent,
    NodeStatus, SyncRequest, WatchNodesRequest, sync_request,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::ack_deadline::AckDeadline;
use crate::auth::{self, Groups, Refusal, Roles};
use crate::fanout::{Fanout, Next, Publication, Resume};
use crate::freshness::Freshness;
use crate::listener::{self, PeerInfo};
use crate::node_watch;

/// How long the brain waits for an ack before it gives up on the stream.
const ACK_TIMEOUT: Duration = Duration::from_secs(60);
/// Pause after a NACK before the next attempt (a snapshot), unless the state changes first.
const NACK_BACKOFF: Duration = Duration::from_secs(2);
/// How long a node placed in a window waits for a publication that covers the API state it
/// presents: it holds changes another replica published and this one has not yet, which a
/// restating delta covers only once they are published here (crate::restate). After that it
/// is sent one anyway, which its digest check may refuse (then a snapshot).
const WINDOW_WAIT: Duration = Duration::from_secs(1);
/// How long a new `Sync` stream may take to send its Hello.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a disconnected node the cluster does not know stays in `ListNodes`.
pub const NODE_STATE_GRACE: Duration = Duration::from_secs(120);
/// Longest `Hello.version` accepted.
const MAX_VERSION: usize = 256;

#[derive(Clone)]
pub struct DataplaneService {
    pub fanout: Arc<Fanout>,
    /// The groups that carry the node and operator roles (see [`crate::auth`]).
    pub groups: Arc<Groups>,
    /// The last contact with the API server, for ListNodes (the fan-out carries whether the
    /// brain is stale).
    pub freshness: Arc<Freshness>,
    /// Where `GetService` asks the index (the watch task's); `None`: not available.
    pub queries: Option<crate::service_view::Queries>,
}

impl DataplaneService {
    /// The caller of `request` and what it may do: its client certificate's identity, or the
    /// one its bearer token was mapped to ([`listener::Gate`] resolved it before this service
    /// ran); refused when no credential reached us.
    fn caller<T>(&self, request: &Request<T>) -> Result<(PeerInfo, Roles), Status> {
        let Some(peer) = PeerInfo::of(request) else {
            self.fanout.metrics.surface.refused(Refusal::NoIdentity);
            return Err(Status::unauthenticated(
                "no client certificate and no bearer token",
            ));
        };
        let roles = auth::roles(&peer.identity, &self.groups);
        Ok((peer, roles))
    }

    fn refuse(&self, reason: Refusal, peer: &PeerInfo, what: &str) -> Status {
        listener::refuse(&self.fanout.metrics, reason, peer, what)
    }
}

/// A Hello fit to act on: a node name that is a Kubernetes name, a version of sane length.
fn check_hello(hello: &splitproxy_proto::v1::Hello) -> Result<(), String> {
    if !auth::valid_node_name(&hello.node) {
        return Err(format!(
            "Hello.node {:?} is not a node name",
            auth::bounded(&hello.node, 64)
        ));
    }
    if hello.version.len() > MAX_VERSION {
        return Err(format!("Hello.version is longer than {MAX_VERSION} bytes"));
    }
    if hello.applied.as_ref().is_some_and(|a| a.digest.len() > 64) {
        return Err("Hello.applied.digest is too long".into());
    }
    Ok(())
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

type UpdateStream = Pin<Box<dyn Stream<Item = Result<UpdateFrame, Status>> + Send>>;
type NodeEventStream = Pin<Box<dyn Stream<Item = Result<NodeEvent, Status>> + Send>>;
type ServiceStream = Pin<Box<dyn Stream<Item = Result<GetServiceResponse, Status>> + Send>>;

impl DataplaneService {
    /// What `GetService` answers for `req`.
    async fn service_status(&self, req: &GetServiceRequest) -> Result<GetServiceResponse, Status> {
        use crate::service_view;
        if req.namespace.is_empty() || req.name.is_empty() {
            return Err(Status::invalid_argument("namespace and name are required"));
        }
        let key = crate::objects::ObjectKey::new(req.namespace.as_str(), req.name.as_str());
        let queries = self
            .queries
            .as_ref()
            .ok_or_else(|| Status::unavailable("this brain has no index to ask"))?;
        let (view, variants) = queries
            .ask_with_variants(&key, self.fanout.publication())
            .await?
            .ok_or_else(|| {
                Status::not_found(format!(
                    "no Service {key} that splitproxy serves (headless, ExternalName, another proxy's, or none)"
                ))
            })?;
        let mut out = service_view::describe(&view, self.fanout.epoch);
        let change = self.fanout.last_change_of(&view.object_names());
        let version = change.as_ref().map(|c| c.0).unwrap_or(0);
        if let Some((v, at, objects)) = change {
            out.changed_version = v;
            out.changed_at = at;
            out.changed_objects = objects;
            if let Some(r) = self.fanout.rollout_latency(v) {
                out.latency = Some(service_view::latency(&r.buckets, r.max));
            }
        }
        {
            let nodes = self
                .fanout
                .nodes
                .lock()
                .map_err(|_| Status::internal("poisoned"))?;
            out.nodes = nodes
                .iter()
                .map(|(name, st)| service_view::rollout(name, st, version))
                .collect();
        }
        out.nodes.sort_by(|a, b| a.node.cmp(&b.node));
        out.summary = service_view::summary(&out.nodes);
        service_view::fill(&mut out, &variants);
        Ok(out)
    }

    /// Every node's status (only `only`'s, when given), sorted by name: what `ListNodes` shows
    /// and `WatchNodes` compares.
    fn node_statuses(&self, only: Option<&[String]>) -> Result<Vec<NodeStatus>, Status> {
        self.fanout
            .prune_disconnected(Instant::now(), NODE_STATE_GRACE);
        let desired = self.fanout.publication();
        let now = Instant::now();
        let nodes = self
            .fanout
            .nodes
            .lock()
            .map_err(|_| Status::internal("poisoned"))?;
        let mut out: Vec<NodeStatus> = nodes
            .iter()
            .filter(|(name, _)| only.is_none_or(|o| o.contains(name)))
            .map(|(name, st)| NodeStatus {
                node: name.clone(),
                connected: st.connected,
                desired_generation: st.generation,
                acked_generation: st.acked_generation,
                last_apply_duration: st.last_apply.and_then(|d| d.try_into().ok()),
                last_error: st.last_error.clone(),
                last_errno: st.last_errno,
                last_refused_message: st.last_refused_message.clone(),
                last_kernel_message: st.last_kernel_message.clone(),
                drifts: st.drifts,
                last_drift: st
                    .last_drift
                    .as_ref()
                    .map(|d| d.summary.clone())
                    .unwrap_or_default(),
                last_drift_at: st.last_drift.as_ref().and_then(|d| d.detected_at),
                last_drift_repaired: st.last_drift.as_ref().is_some_and(|d| d.repaired),
                peer: st.peer.clone(),
                in_sync: st
                    .acked
                    .as_ref()
                    .is_some_and(|h| h.version == desired.version),
                lag: self.fanout.lag(st, desired.version, now).try_into().ok(),
            })
            .collect();
        out.sort_by(|a, b| a.node.cmp(&b.node));
        Ok(out)
    }
}

#[tonic::async_trait]
impl Dataplane for DataplaneService {
    type SyncStream = UpdateStream;
    type WatchNodesStream = NodeEventStream;
    type WatchServiceStream = ServiceStream;

    async fn sync(
        &self,
        request: Request<Streaming<SyncRequest>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let rx = self.open_sync(request).await?;
        Ok(Response::new(Box::pin(updates(rx))))
    }

    async fn list_nodes(
        &self,
        request: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        let (info, roles) = self.caller(&request)?;
        // An operator sees every node, a node itself only.
        let only: Option<Vec<String>> = match roles.listable() {
            Ok(only) => only.map(<[String]>::to_vec),
            Err(reason) => return Err(self.refuse(reason, &info, "ListNodes")),
        };
        let out = self.node_statuses(only.as_deref())?;
        let desired = self.fanout.publication();
        Ok(Response::new(ListNodesResponse {
            brain_epoch: self.fanout.epoch,
            synced: self.fanout.serving(),
            nodes: out,
            desired_version: desired.version,
            stale: !self.fanout.fresh(),
            api_contact_age: self.freshness.age().try_into().ok(),
        }))
    }

    async fn watch_nodes(
        &self,
        request: Request<WatchNodesRequest>,
    ) -> Result<Response<Self::WatchNodesStream>, Status> {
        let (info, roles) = self.caller(&request)?;
        let only: Option<Vec<String>> = match roles.listable() {
            Ok(only) => only.map(<[String]>::to_vec),
            Err(reason) => return Err(self.refuse(reason, &info, "WatchNodes")),
        };
        let threshold = request
            .get_ref()
            .lag_threshold
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or(node_watch::DEFAULT_LAG_THRESHOLD)
            .max(node_watch::MIN_LAG_THRESHOLD);
        let service = self.clone();
        let (tx, rx) = mpsc::channel(node_watch::BUFFER);
        tokio::spawn(async move {
            let mut seen = Default::default();
            let mut first = true;
            let epoch = service.fanout.epoch;
            loop {
                let statuses = match service.node_statuses(only.as_deref()) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                let (events, next) = node_watch::changes(&seen, &statuses, threshold, first);
                seen = next;
                first = false;
                for (kind, status) in events {
                    // A watcher that stopped reading (or left) ends its own stream only.
                    if tx
                        .try_send(Ok(node_watch::event(kind, status, epoch)))
                        .is_err()
                    {
                        return;
                    }
                }
                tokio::select! {
                    _ = tx.closed() => return,
                    () = service.fanout.stopping() => {
                        let _ = tx.try_send(Err(Status::unavailable("brain shutting down")));
                        return;
                    }
                    _ = tokio::time::sleep(node_watch::POLL) => {}
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_service(
        &self,
        request: Request<GetServiceRequest>,
    ) -> Result<Response<GetServiceResponse>, Status> {
        let (info, roles) = self.caller(&request)?;
        if !roles.operator {
            return Err(self.refuse(Refusal::NotAnOperator, &info, "GetService"));
        }
        Ok(Response::new(self.service_status(request.get_ref()).await?))
    }

    async fn watch_service(
        &self,
        request: Request<GetServiceRequest>,
    ) -> Result<Response<Self::WatchServiceStream>, Status> {
        let (info, roles) = self.caller(&request)?;
        if !roles.operator {
            return Err(self.refuse(Refusal::NotAnOperator, &info, "WatchService"));
        }
        let req = request.into_inner();
        // The first answer, or the error, before the stream starts.
        let first = self.service_status(&req).await?;
        let service = self.clone();
        let (tx, rx) = mpsc::channel(node_watch::BUFFER);
        tokio::spawn(async move {
            let mut last = first.clone();
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    () = service.fanout.stopping() => {
                        let _ = tx.try_send(Err(Status::unavailable("brain shutting down")));
                        return;
                    }
                    _ = tokio::time::sleep(node_watch::POLL) => {}
                }
                let now = match service.service_status(&req).await {
                    Ok(now) => now,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                // The latency moves with every ack, and the publication the variants were read
                // from with every change in the cluster: news only with another change.
                let mut same = now.clone();
                same.latency = last.latency;
                same.variants_version = last.variants_version;
                same.variants_summary = last.variants_summary.clone();
                if same != last && tx.try_send(Ok(now.clone())).is_err() {
                    return;
                }
                last = now;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn explain_packet(
        &self,
        request: Request<ExplainPacketRequest>,
    ) -> Result<Response<ExplainPacketResponse>, Status> {
        let (info, roles) = self.caller(&request)?;
        let req = request.into_inner();
        if let Err(reason) = roles.may_read(&req.node) {
            let what = format!("ExplainPacket for node {}", auth::bounded(&req.node, 64));
            return Err(self.refuse(reason, &info, &what));
        }
        // Evaluation is CPU work (one run per random outcome): off the async threads.
        let service = self.clone();
        let out = tokio::task::spawn_blocking(move || service.explain(&req))
            .await
            .map_err(|_| Status::internal("the evaluation failed"))??;
        Ok(Response::new(out))
    }

    async fn get_node_ruleset(
        &self,
        request: Request<GetNodeRulesetRequest>,
    ) -> Result<Response<GetNodeRulesetResponse>, Status> {
        let (info, roles) = self.caller(&request)?;
        let node = request.into_inner().node;
        if let Err(reason) = roles.may_read(&node) {
            let what = format!("GetNodeRuleset for node {}", auth::bounded(&node, 64));
            return Err(self.refuse(reason, &info, &what));
        }
        let desired = self.fanout.publication();
        let held = desired
            .held(&node)
            .ok_or_else(|| Status::unavailable("no desired state yet"))?;
        let ruleset = held.full().to_ruleset();
        Ok(Response::new(GetNodeRulesetResponse {
            generation: desired.version,
            nft: splitproxy_proto::render::ruleset(&ruleset),
            ruleset: Some(ruleset),
        }))
    }
}

impl DataplaneService {
    /// What `ExplainPacket` answers: the request evaluated against the node's ruleset as
    /// `GetNodeRuleset` shows it (the same publication), by the IR interpreter of
    /// `splitproxy_proto::explain`. The node's addresses it knows are those of its ruleset
    /// (`nodeport-ips`) and those the request adds.
    pub(crate) fn explain(
        &self,
        req: &ExplainPacketRequest,
    ) -> Result<ExplainPacketResponse, Status> {
        let desired = self.fanout.publication();
        let held = desired
            .held(&req.node)
            .ok_or_else(|| Status::unavailable("no desired state yet"))?;
        let known_node = desired.overlays.contains_key(&req.node);
        let model = held.full();
        let addresses = crate::explain::node_addresses(&model);
        let mut out = splitproxy_proto::explain::explain_request(&model, req, &addresses)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        if !known_node {
            out.assumptions.insert(
                0,
                format!(
                    "the brain holds no elements of node {} of its own (no such node, or none yet): the ruleset every node shares was evaluated",
                    auth::bounded(&req.node, 64)
                ),
            );
            out.text.push_str(&format!("  - {}\n", out.assumptions[0]));
        }
        out.generation = desired.version;
        Ok(out)
    }

    /// A stale brain takes no node: it answers UNAVAILABLE, and the actuator tries the next
    /// brain ("never silently stale").
    fn refuse_if_stale(&self) -> Result<(), Status> {
        if self.fanout.fresh() {
            Ok(())
        } else {
            Err(stale_status(&self.freshness))
        }
    }
}

/// Why a stale brain closes or refuses a stream.
fn stale_status(freshness: &Freshness) -> Status {
    Status::unavailable(format!(
        "brain is stale: no contact with the API server for {:.1}s (bound {:.1}s); try another brain",
        freshness.age().as_secs_f64(),
        freshness.bound().as_secs_f64()
    ))
}

/// Resolves when the brain turns stale (never, if the fan-out goes away first).
async fn until_stale(fanout: &Fanout) {
    let mut fresh = fanout.subscribe_fresh();
    if fresh.wait_for(|f| !*f).await.is_err() {
        std::future::pending::<()>().await;
    }
}

impl DataplaneService {
    /// Opens a node's `Sync` stream: the caller authorised, its Hello read and checked, its
    /// session started. Returns where the session hands each update's frames (and, last, the
    /// status it ended with), for tonic's encoder ([`Dataplane::sync`]) or the brain's own
    /// ([`crate::sync_route`]).
    pub(crate) async fn open_sync(
        &self,
        request: Request<Streaming<SyncRequest>>,
    ) -> Result<mpsc::Receiver<Result<Vec<UpdateFrame>, Status>>, Status> {
        let (info, roles) = self.caller(&request)?;
        // Before reading anything: a caller that may never sync is refused at once.
        if roles.nodes.is_none() {
            let reason = if roles.operator {
                Refusal::NotANode
            } else {
                Refusal::NoRole
            };
            return Err(self.refuse(reason, &info, "Sync"));
        }
        let peer = info.remote.to_string();
        self.refuse_if_stale()?;
        let mut inbound = request.into_inner();
        let hello = match tokio::time::timeout(HELLO_TIMEOUT, inbound.next()).await {
            Err(_) => return Err(self.refuse(Refusal::HelloTimeout, &info, "Sync")),
            Ok(Some(Ok(SyncRequest {
                msg: Some(sync_request::Msg::Hello(h)),
            }))) => h,
            Ok(Some(Err(e))) => return Err(e),
            Ok(_) => return Err(self.refuse(Refusal::BadHello, &info, "Sync")),
        };
        if let Err(e) = check_hello(&hello) {
            self.refuse(Refusal::BadHello, &info, "Sync");
            return Err(Status::invalid_argument(e));
        }
        if let Err(reason) = roles.may_sync(&hello.node) {
            return Err(self.refuse(reason, &info, &format!("Sync for node {}", hello.node)));
        }
        tracing::info!(node = %hello.node, %peer, version = %hello.version, applied = ?hello.applied.as_ref().map(|a| (a.brain_epoch, a.generation)), "node connected");
        let (tx, rx) = mpsc::channel(1);
        let fanout = self.fanout.clone();
        let expires = info.identity.expires;
        let expired = format!("{} expired", info.identity.credential);
        let freshness = self.freshness.clone();
        tokio::spawn(async move {
            let node = hello.node.clone();
            let (id, replaced) = fanout.connect(&node, &peer);
            fanout.hello(&node, hello.applied.as_ref());
            fanout.accept_encodings(&node, &hello.encodings);
            let status_tx = tx.clone();
            let ended = tokio::select! {
                r = session(&fanout, &hello, inbound, tx) => r,
                _ = replaced.notified() => Err(Status::aborted("a newer stream for this node replaced this one")),
                _ = until(expires) => Err(Status::unauthenticated(expired)),
                () = until_stale(&fanout) => Err(stale_status(&freshness)),
                () = fanout.stopping() => Err(Status::unavailable("brain shutting down")),
            };
            if let Err(e) = ended {
                tracing::info!(%node, session = id, error = %e, "node stream ended");
                // Tell the node why, if it still listens (UNAVAILABLE when this brain went
                // stale: the node moves to another replica, never silently stale). The channel
                // holds at most one frame; a node that reads nothing is not waited for.
                let _ = tokio::time::timeout(Duration::from_secs(1), status_tx.send(Err(e))).await;
            }
            fanout.disconnect(&node, id);
        });
        Ok(rx)
    }
}

/// The response stream of one node's session: every update's frames are handed over at once,
/// so the encoder finds them all ready and writes them in one go (one TLS record run, one
/// `writev`) instead of one write per frame: with a one-slot channel of single frames, the
/// second frame of every update waited for the first to be written.
fn updates(
    rx: mpsc::Receiver<Result<Vec<UpdateFrame>, Status>>,
) -> impl Stream<Item = Result<UpdateFrame, Status>> + Send {
    futures::StreamExt::flat_map(ReceiverStream::new(rx), |batch| {
        let (frames, error) = match batch {
            Ok(frames) => (frames, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        futures::stream::iter(frames.into_iter().map(Ok).chain(error.map(Err)))
    })
}

/// One node's stream: wait until the brain is synced (no empty push), then send an update
/// whenever the desired state moves and the previous update has been answered.
async fn session(
    fanout: &Fanout,
    hello: &splitproxy_proto::v1::Hello,
    mut inbound: Streaming<SyncRequest>,
    tx: mpsc::Sender<Result<Vec<UpdateFrame>, Status>>,
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
    tracing::info!(
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
        tx.send(Ok(frames))
            .await
            .map_err(|_| Status::cancelled("node went away"))?;
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use splitproxy_proto::model::Model;

    use super::NackBackoff;
    use crate::fanout::Fanout;
    use crate::metrics::Metrics;

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
