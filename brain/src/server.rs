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
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{self, Groups, Refusal, Roles};
use crate::fanout::Fanout;
use crate::freshness::Freshness;
use crate::listener::{self, PeerInfo};
use crate::node_watch;
use crate::session::{Bounds, Session};

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
        let session = self.open_sync(request).await?;
        Ok(Response::new(Box::pin(updates(session))))
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
pub(crate) fn stale_status(freshness: &Freshness) -> Status {
    Status::unavailable(format!(
        "brain is stale: no contact with the API server for {:.1}s (bound {:.1}s); try another brain",
        freshness.age().as_secs_f64(),
        freshness.bound().as_secs_f64()
    ))
}

impl DataplaneService {
    /// Opens a node's `Sync` stream: the caller authorised, its Hello read and checked, its
    /// session started. Returns the session as the stream of its updates' frames (and, last,
    /// the status it ended with), for tonic's encoder ([`Dataplane::sync`]) or the brain's own
    /// ([`crate::sync_route`]); the session runs as that stream is polled.
    pub(crate) async fn open_sync(
        &self,
        request: Request<Streaming<SyncRequest>>,
    ) -> Result<Session, Status> {
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
        let bounds = Bounds {
            expires: info.identity.expires,
            expired: format!("{} expired", info.identity.credential),
            freshness: self.freshness.clone(),
        };
        Ok(Session::start(
            self.fanout.clone(),
            hello,
            inbound,
            peer,
            bounds,
        ))
    }
}

/// The response stream of one node's session: every update's frames are handed over at once,
/// so the encoder finds them all ready and writes them in one go (one TLS record run, one
/// `writev`) instead of one write per frame: with a one-slot channel of single frames, the
/// second frame of every update waited for the first to be written.
fn updates(session: Session) -> impl Stream<Item = Result<UpdateFrame, Status>> + Send {
    futures::StreamExt::flat_map(session, |batch| {
        let (frames, error) = match batch {
            Ok(frames) => (frames, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        futures::stream::iter(frames.into_iter().map(Ok).chain(error.map(Err)))
    })
}
