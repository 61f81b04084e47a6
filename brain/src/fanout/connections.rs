//! Which nodes are connected and on which session, what their Hello said, and how far behind
//! the latest publication each is (`ListNodes`, the lag metrics).
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Fanout, LAG_THRESHOLD, NEXT_SESSION, NodeState, node_state};

impl Fanout {
    /// A stream for `node` from `peer` starts serving: it becomes the node's session. An older
    /// session of the same node still open is told to end (a newer stream replaces it: the node
    /// reconnected before the old connection was noticed dead). Returns the session's id and what
    /// tells it to end.
    pub fn connect(&self, node: &str, peer: &str) -> (u64, Arc<tokio::sync::Notify>) {
        let id = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
        let end = Arc::new(tokio::sync::Notify::new());
        let version = self.publication().version;
        if let Ok(mut nodes) = self.nodes.lock() {
            let st = node_state(&mut nodes, node);
            if !st.connected {
                // Counted from the next publication on; a session replacing a connected one
                // still holds up what the node was counted in.
                st.settled = self.counted.load(Ordering::Relaxed);
            }
            if let Some(older) = st.end_session.replace(end.clone()) {
                older.notify_one();
            }
            st.session = id;
            st.connected = true;
            st.peer = peer.to_string();
            st.disconnected_at = None;
            let now = Instant::now();
            st.connected_at = Some(now);
            st.news_after = version;
            st.behind_since = Some(now);
        }
        (id, end)
    }

    /// Session `session` of `node` ended. Only the node's current session marks it
    /// disconnected: a replaced one ending says nothing about the node.
    pub fn disconnect(&self, node: &str, session: u64) {
        let settled = match self.nodes.lock() {
            Ok(mut nodes) => match nodes.get_mut(node) {
                Some(st) if st.session == session => {
                    st.connected = false;
                    st.session = 0;
                    st.end_session = None;
                    st.disconnected_at = Some(Instant::now());
                    st.connected_at = None;
                    st.behind_since = None;
                    self.unsettled(st, None)
                }
                _ => None,
            },
            Err(_) => None,
        };
        self.settle(settled, false);
    }

    /// Marks `node` connected through a new session, or ends its current session, for callers
    /// that hold no session of their own (tests of the fan-out).
    pub fn set_connected(&self, node: &str, connected: bool, peer: &str) {
        if connected {
            self.connect(node, peer);
        } else {
            let session = self
                .nodes
                .lock()
                .ok()
                .and_then(|n| n.get(node).map(|st| st.session));
            if let Some(session) = session {
                self.disconnect(node, session);
            }
        }
    }

    /// Forgets nodes disconnected for longer than `grace` that the cluster does not know (no
    /// Node object in the latest publication): a node deleted from the cluster, or a name that
    /// never was one, does not stay in `ListNodes` forever. Nodes of the cluster stay listed
    /// while disconnected, which is what an operator needs to see.
    pub fn prune_disconnected(&self, now: Instant, grace: Duration) {
        let publication = self.publication();
        if let Ok(mut nodes) = self.nodes.lock() {
            nodes.retain(|name, st| {
                st.connected
                    || publication.overlays.contains_key(name)
                    || st
                        .disconnected_at
                        .is_none_or(|at| now.saturating_duration_since(at) < grace)
            });
        }
    }

    /// What a connecting node said it holds (its Hello's digest): if that is the state it is
    /// about to be sent, the update carries no trigger times (see [`Fanout::next_update`]).
    pub fn hello(&self, node: &str, applied: Option<&splitproxy_proto::v1::Applied>) {
        if let Ok(mut nodes) = self.nodes.lock() {
            let st = node_state(&mut nodes, node);
            st.hello_digest = applied.map(|a| a.digest.clone()).unwrap_or_default();
        }
    }

    /// The encodings the node's Hello says it reads (`Hello.encodings`): large shared parts go
    /// to it compressed when it reads zstd.
    pub fn accept_encodings(&self, node: &str, encodings: &[String]) {
        if let Ok(mut nodes) = self.nodes.lock() {
            let st = node_state(&mut nodes, node);
            st.zstd = encodings
                .iter()
                .any(|e| e == splitproxy_proto::compress::ZSTD);
        }
    }

    /// How long a node has been behind the latest publication: zero when it holds it or is not
    /// connected, otherwise the time since the oldest publication it lacks (or since the brain
    /// lost track of what it holds), but never more than it has been connected.
    pub fn lag(&self, st: &NodeState, latest: u64, now: Instant) -> Duration {
        let Some(connected_at) = st.connected.then_some(st.connected_at).flatten() else {
            return Duration::ZERO;
        };
        let since = match &st.acked {
            Some(h) if h.version >= latest => return Duration::ZERO,
            Some(h) => self
                .published_at(h.version + 1)
                .or(self.oldest_publication()),
            None if latest == 0 => return Duration::ZERO,
            None => st.behind_since,
        };
        now.saturating_duration_since(since.unwrap_or(connected_at).max(connected_at))
    }

    /// The longest lag among connected nodes, and how many lag more than [`LAG_THRESHOLD`]:
    /// figures whose size does not grow with the number of nodes, for metrics.
    pub fn lag_summary(&self) -> (Duration, usize) {
        let latest = self.publication().version;
        let now = Instant::now();
        let Ok(nodes) = self.nodes.lock() else {
            return (Duration::ZERO, 0);
        };
        nodes
            .values()
            .map(|st| self.lag(st, latest, now))
            .fold((Duration::ZERO, 0), |(max, n), lag| {
                (max.max(lag), n + usize::from(lag > LAG_THRESHOLD))
            })
    }

    pub fn connected_nodes(&self) -> usize {
        self.nodes
            .lock()
            .map(|n| n.values().filter(|s| s.connected).count())
            .unwrap_or(0)
    }
}
