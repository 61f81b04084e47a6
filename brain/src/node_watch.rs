//! `WatchNodes`: node status changes as a live stream, so `grpcurl ... WatchNodes` is a live view
//! of which nodes are connected, refusing updates or lagging.
//!
//! The stream compares the same statuses `ListNodes` shows, a few times a second, with what it
//! sent last ([`changes`], a pure function): the brain's fan-out path carries no extra work and no
//! per-watcher channel, a slow watcher costs only itself (its stream is bounded and ends when it
//! stops reading), and a change shorter than the poll interval may be seen only as its outcome.
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use splitproxy_proto::v1::{NodeEvent, NodeStatus, node_event::Kind};

/// How often a watch compares the nodes' statuses.
pub const POLL: Duration = Duration::from_millis(250);
/// `WatchNodesRequest.lag_threshold` when unset, and its minimum.
pub const DEFAULT_LAG_THRESHOLD: Duration = Duration::from_secs(5);
pub const MIN_LAG_THRESHOLD: Duration = Duration::from_secs(1);
/// Events a watcher may have unread before its stream ends (it is not keeping up).
pub const BUFFER: usize = 1024;

/// What a watch remembers of a node: the facts whose changes it reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    connected: bool,
    in_sync: bool,
    lagging: bool,
    last_error: String,
    drifts: u64,
}

impl Seen {
    fn of(status: &NodeStatus, threshold: Duration) -> Seen {
        let lag = status
            .lag
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or_default();
        Seen {
            connected: status.connected,
            in_sync: status.in_sync,
            lagging: status.connected && !status.in_sync && lag > threshold,
            last_error: status.last_error.clone(),
            drifts: status.drifts,
        }
    }
}

/// The events that turn `before` into `now` (sorted by node), and what to remember next.
/// `first`: the stream's first round, every node reported as it is (INITIAL).
pub fn changes(
    before: &BTreeMap<String, Seen>,
    now: &[NodeStatus],
    threshold: Duration,
    first: bool,
) -> (Vec<(Kind, NodeStatus)>, BTreeMap<String, Seen>) {
    let mut events = Vec::new();
    let mut next = BTreeMap::new();
    for status in now {
        let seen = Seen::of(status, threshold);
        match before.get(&status.node) {
            _ if first => events.push((Kind::Initial, status.clone())),
            // A node the brain did not know: it connected (or reappeared).
            None => events.push((Kind::Connected, status.clone())),
            Some(old) => {
                for kind in transitions(old, &seen) {
                    events.push((kind, status.clone()));
                }
            }
        }
        next.insert(status.node.clone(), seen);
    }
    for (node, _) in before.iter().filter(|(n, _)| !next.contains_key(*n)) {
        let status = NodeStatus {
            node: node.clone(),
            ..Default::default()
        };
        events.push((Kind::Forgotten, status));
    }
    (events, next)
}

/// What changed between two observations of one node, in the order a reader expects.
fn transitions(old: &Seen, new: &Seen) -> Vec<Kind> {
    let mut kinds = Vec::new();
    if old.connected != new.connected {
        kinds.push(if new.connected {
            Kind::Connected
        } else {
            Kind::Disconnected
        });
    }
    if !new.last_error.is_empty() && new.last_error != old.last_error {
        kinds.push(Kind::Nacked);
    }
    if new.drifts > old.drifts {
        kinds.push(Kind::Drifted);
    }
    if new.lagging && !old.lagging {
        kinds.push(Kind::Lagging);
    }
    if new.connected && new.in_sync && !(old.in_sync && old.connected) {
        kinds.push(Kind::InSync);
    }
    kinds
}

/// An event for the wire.
pub fn event(kind: Kind, status: NodeStatus, brain_epoch: u64) -> NodeEvent {
    NodeEvent {
        kind: kind as i32,
        status: Some(status),
        at: Some(SystemTime::now().into()),
        brain_epoch,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, connected: bool, in_sync: bool, lag_s: u64, error: &str) -> NodeStatus {
        NodeStatus {
            node: name.into(),
            connected,
            in_sync,
            lag: Duration::from_secs(lag_s).try_into().ok(),
            last_error: error.into(),
            ..Default::default()
        }
    }

    fn kinds(events: &[(Kind, NodeStatus)]) -> Vec<(Kind, String)> {
        events.iter().map(|(k, s)| (*k, s.node.clone())).collect()
    }

    #[test]
    fn the_first_round_reports_every_node_as_it_is() {
        let now = [node("a", true, true, 0, ""), node("b", false, false, 0, "")];
        let (events, _) = changes(&BTreeMap::new(), &now, DEFAULT_LAG_THRESHOLD, true);
        assert_eq!(
            kinds(&events),
            [(Kind::Initial, "a".into()), (Kind::Initial, "b".into())]
        );
    }

    #[test]
    fn each_change_is_reported_once() {
        let t = DEFAULT_LAG_THRESHOLD;
        let (_, seen) = changes(&BTreeMap::new(), &[node("a", true, true, 0, "")], t, true);
        // Nothing changed: nothing reported.
        let (events, seen) = changes(&seen, &[node("a", true, true, 0, "")], t, false);
        assert!(events.is_empty(), "{events:?}");
        // Behind, but within the threshold: nothing yet; past it: LAGGING, once.
        let (events, seen) = changes(&seen, &[node("a", true, false, 2, "")], t, false);
        assert!(events.is_empty(), "{events:?}");
        let (events, seen) = changes(&seen, &[node("a", true, false, 6, "")], t, false);
        assert_eq!(kinds(&events), [(Kind::Lagging, "a".into())]);
        let (events, seen) = changes(&seen, &[node("a", true, false, 9, "")], t, false);
        assert!(events.is_empty(), "{events:?}");
        // A NACK, then in sync again.
        let (events, seen) = changes(&seen, &[node("a", true, false, 9, "EINVAL")], t, false);
        assert_eq!(kinds(&events), [(Kind::Nacked, "a".into())]);
        let (events, seen) = changes(&seen, &[node("a", true, true, 0, "")], t, false);
        assert_eq!(kinds(&events), [(Kind::InSync, "a".into())]);
        // Disconnected, reconnected and in sync; a new node; a node forgotten.
        let (events, seen) = changes(&seen, &[node("a", false, true, 0, "")], t, false);
        assert_eq!(kinds(&events), [(Kind::Disconnected, "a".into())]);
        let (events, seen) = changes(
            &seen,
            &[node("a", true, true, 0, ""), node("b", true, false, 0, "")],
            t,
            false,
        );
        assert_eq!(
            kinds(&events),
            [
                (Kind::Connected, "a".into()),
                (Kind::InSync, "a".into()),
                (Kind::Connected, "b".into())
            ]
        );
        let (events, _) = changes(&seen, &[node("b", true, true, 0, "")], t, false);
        assert_eq!(
            kinds(&events),
            [(Kind::InSync, "b".into()), (Kind::Forgotten, "a".into())]
        );
    }
}
