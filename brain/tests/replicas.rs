//! Replicas computing from the same API state publish the same rulesets, with the same digests,
//! whatever order the events reached them in and whatever path (one initial list, or a list and
//! a stream of changes) brought them there. Resumption by content (a node failing over to
//! another replica, or to a restarted brain, `brain/src/history.rs`) rests on this: the digest a
//! node presents is the digest the other replica computed for the same state.
//!
//! Three replicas, each driven through the real index state machine into a `Fanout`:
//! - `incremental`: lists the first state, then follows the changes one event at a time,
//!   publishing after each (as a long-running replica);
//! - `late`: lists the final state in another order, in one go (a replica started later, or
//!   a brain restarted);
//! - `shuffled`: lists the first state in reverse, then gets the same changes in another order,
//!   folded into fewer publications.
//!
//! The cluster is varied on purpose: NodePorts and LoadBalancers (per-node addresses in the
//! overlays), Local traffic policies (per-node endpoints), affinity with several timeouts and
//! Services of several endpoint counts (dynamic sets created and dropped by reference counts),
//! topology hints, endpoints listed in two slices with different conditions, dual stack.
use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use prost::Message;
use serde_json::{Value, json};
use splitproxy_brain::fanout::{Fanout, Next, Resume};
use splitproxy_brain::index::{Indexer, WatchEvent};
use splitproxy_brain::metrics::{Metrics, Resumption};
use splitproxy_brain::rules::{DetectLocalMode, RulesConfig};
use splitproxy_proto::v1::{Applied, Update, update::Body};
use splitproxy_proto::{parts, render};

const NODES: [(&str, &str); 3] = [
    ("node-a", "zone-1"),
    ("node-b", "zone-2"),
    ("node-c", "zone-1"),
];

fn config() -> RulesConfig {
    RulesConfig {
        service_cidrs: vec![
            "10.96.0.0/16".parse().unwrap(),
            "fd00:96::/112".parse().unwrap(),
        ],
        cluster_cidrs: vec![
            "10.244.0.0/16".parse().unwrap(),
            "fd00:244::/48".parse().unwrap(),
        ],
        detect_local: DetectLocalMode::ClusterCidr,
        ..RulesConfig::default()
    }
}

fn node(i: usize, address_round: u32) -> Node {
    let (name, zone) = NODES[i];
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
        "spec": {"podCIDRs": [format!("10.244.{}.0/24", i + 1), format!("fd00:244:{}::/64", i + 1)]},
        "status": {"addresses": [
            {"type": "InternalIP", "address": format!("192.168.{}.{}", 77 + address_round, i + 1)},
            {"type": "InternalIP", "address": format!("fd00:77::{}", i + 1)},
        ]},
    }))
    .unwrap()
}

/// Service `i`, its shape chosen by `i` and `round` (a later round changes it).
fn service(i: u32, round: u32) -> Service {
    let k = i + round;
    let ty = ["ClusterIP", "NodePort", "LoadBalancer"][(k % 3) as usize];
    let mut spec = json!({
        "type": ty,
        "clusterIP": format!("10.96.1.{}", 10 + i),
        "clusterIPs": [format!("10.96.1.{}", 10 + i)],
        "ports": [
            {"name": "p0", "protocol": "TCP", "port": 80, "targetPort": 8080},
            {"name": "p1", "protocol": "UDP", "port": 53, "targetPort": 8081},
        ],
    });
    if ty != "ClusterIP" {
        spec["ports"][0]["nodePort"] = json!(30100 + i);
        spec["ports"][1]["nodePort"] = json!(30200 + i);
    }
    if i % 4 == 1 {
        spec["ipFamilies"] = json!(["IPv4", "IPv6"]);
        spec["ipFamilyPolicy"] = json!("PreferDualStack");
        spec["clusterIPs"] = json!([
            format!("10.96.1.{}", 10 + i),
            format!("fd00:96::{:x}", 10 + i)
        ]);
    }
    match k % 5 {
        0 => {
            spec["sessionAffinity"] = json!("ClientIP");
            spec["sessionAffinityConfig"] =
                json!({"clientIP": {"timeoutSeconds": 60 + 30 * (i % 3)}});
        }
        1 if ty != "ClusterIP" => {
            spec["externalTrafficPolicy"] = json!("Local");
            spec["healthCheckNodePort"] = json!(32000 + i);
        }
        2 => spec["internalTrafficPolicy"] = json!("Local"),
        3 => spec["trafficDistribution"] = json!("PreferClose"),
        _ => {}
    }
    let status = if ty == "LoadBalancer" {
        json!({"loadBalancer": {"ingress": [{"ip": format!("198.51.100.{}", 10 + i)}]}})
    } else {
        json!({})
    };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "default", "name": format!("s{i}")},
        "spec": spec, "status": status,
    }))
    .unwrap()
}

/// Slice `j` (0 or 1) of Service `i`: endpoints spread over the nodes, some listed in both
/// slices with other conditions, hints on some.
fn slice(i: u32, j: u32, round: u32, family: &str) -> EndpointSlice {
    let count = (i + round + j) % 5;
    let endpoints: Vec<Value> = (0..count)
        .map(|k| {
            // Slice 1 repeats slice 0's first endpoint, not ready.
            let n = if j == 1 && k == 0 { 0 } else { k + 10 * j };
            let node = (i + n) as usize % NODES.len();
            let address = if family == "IPv6" {
                format!("fd00:244:{}::{:x}", node + 1, 100 + i * 20 + n)
            } else {
                format!("10.244.{}.{}", node + 1, 100 + i * 20 + n)
            };
            let ready = !(j == 1 && k == 0) && (round + k) % 7 != 3;
            let mut e = json!({
                "addresses": [address], "nodeName": NODES[node].0,
                "conditions": {"ready": ready, "serving": ready || k % 2 == 0, "terminating": !ready},
            });
            if (i + round) % 4 == 3 {
                e["hints"] = json!({"forZones": [{"name": NODES[node].1}]});
            }
            e
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "namespace": "default",
            "name": format!("s{i}-{j}-{}", family.to_lowercase()),
            "labels": {"kubernetes.io/service-name": format!("s{i}")},
        },
        "addressType": family,
        "ports": [
            {"name": "p0", "protocol": "TCP", "port": 8080},
            {"name": "p1", "protocol": "UDP", "port": 8081},
        ],
        "endpoints": endpoints,
    }))
    .unwrap()
}

const SERVICES: u32 = 12;

/// The objects of a state: Services, slices (two per Service, IPv6 ones for dual-stack
/// Services), Nodes.
struct State {
    services: Vec<Service>,
    slices: Vec<EndpointSlice>,
    nodes: Vec<Node>,
}

fn state(services: impl Iterator<Item = u32> + Clone, round: u32, node_round: u32) -> State {
    State {
        services: services.clone().map(|i| service(i, round)).collect(),
        slices: services
            .flat_map(|i| {
                let mut v = vec![slice(i, 0, round, "IPv4"), slice(i, 1, round, "IPv4")];
                if i % 4 == 1 {
                    v.push(slice(i, 0, round, "IPv6"));
                }
                v
            })
            .collect(),
        nodes: (0..NODES.len()).map(|n| node(n, node_round)).collect(),
    }
}

fn first() -> State {
    state(0..SERVICES, 0, 0)
}

/// The changes from [`first`] to [`last`], as watch events: Services 0..4 change shape and
/// endpoints, 4..6 go, 12..14 come, node-b changes address.
fn changes() -> Vec<WatchEvent> {
    let mut evs = Vec::new();
    let changed = state(0..4, 1, 0);
    for s in changed.services {
        evs.push(WatchEvent::Service(Box::new(Event::Apply(s))));
    }
    for s in changed.slices {
        evs.push(WatchEvent::Slice(Box::new(Event::Apply(s))));
    }
    let gone = state(4..6, 0, 0);
    for s in gone.slices {
        evs.push(WatchEvent::Slice(Box::new(Event::Delete(s))));
    }
    for s in gone.services {
        evs.push(WatchEvent::Service(Box::new(Event::Delete(s))));
    }
    let new = state(SERVICES..SERVICES + 2, 0, 0);
    for s in new.slices {
        evs.push(WatchEvent::Slice(Box::new(Event::Apply(s))));
    }
    for s in new.services {
        evs.push(WatchEvent::Service(Box::new(Event::Apply(s))));
    }
    evs.push(WatchEvent::Node(Box::new(Event::Apply(node(1, 1)))));
    evs
}

/// The state after [`changes`].
fn last() -> State {
    let mut s = state(
        (0..4).chain(6..SERVICES).chain(SERVICES..SERVICES + 2),
        0,
        0,
    );
    let changed = state(0..4, 1, 0);
    s.services.splice(0..4, changed.services);
    s.slices.retain(|sl| {
        let name = sl.metadata.name.as_deref().unwrap_or_default();
        !(0..4).any(|i| name.starts_with(&format!("s{i}-")))
    });
    s.slices.extend(changed.slices);
    s.nodes[1] = node(1, 1);
    s
}

/// The shared digest, and per node its digest and whole ruleset in nft syntax.
type Outcome = (Vec<u8>, BTreeMap<String, (Vec<u8>, String)>);

struct Replica {
    indexer: Indexer,
    fanout: Arc<Fanout>,
}

impl Replica {
    fn new() -> Self {
        let fanout = Fanout::new(Arc::new(Metrics::default()), 4, 1024);
        Replica {
            indexer: Indexer::new(config(), fanout.metrics.clone(), false),
            fanout,
        }
    }

    fn handle(&mut self, ev: WatchEvent) {
        self.indexer.handle(ev);
    }

    fn publish(&mut self) {
        self.indexer.publish(&self.fanout);
    }

    /// Lists `s`: Nodes, Services and slices each in the order given (reversed if `reverse`),
    /// the resources one after another in the order of `resources`.
    fn list(&mut self, s: State, reverse: bool, resources: [usize; 3]) {
        fn ordered<T>(mut v: Vec<T>, reverse: bool) -> Vec<T> {
            if reverse {
                v.reverse();
            }
            v
        }
        let mut lists: [Vec<WatchEvent>; 3] = [
            std::iter::once(WatchEvent::Service(Box::new(Event::Init)))
                .chain(
                    ordered(s.services, reverse)
                        .into_iter()
                        .map(|o| WatchEvent::Service(Box::new(Event::InitApply(o)))),
                )
                .chain([WatchEvent::Service(Box::new(Event::InitDone))])
                .collect(),
            std::iter::once(WatchEvent::Slice(Box::new(Event::Init)))
                .chain(
                    ordered(s.slices, reverse)
                        .into_iter()
                        .map(|o| WatchEvent::Slice(Box::new(Event::InitApply(o)))),
                )
                .chain([WatchEvent::Slice(Box::new(Event::InitDone))])
                .collect(),
            std::iter::once(WatchEvent::Node(Box::new(Event::Init)))
                .chain(
                    ordered(s.nodes, reverse)
                        .into_iter()
                        .map(|o| WatchEvent::Node(Box::new(Event::InitApply(o)))),
                )
                .chain([WatchEvent::Node(Box::new(Event::InitDone))])
                .collect(),
        ];
        for r in resources {
            for ev in std::mem::take(&mut lists[r]) {
                self.handle(ev);
            }
        }
        self.publish();
        assert!(self.fanout.synced());
    }

    /// Each node's whole ruleset (nft text) and digest, and the shared digest.
    fn outcome(&self) -> Outcome {
        let p = self.fanout.publication();
        let nodes = NODES
            .iter()
            .map(|(n, _)| {
                let held = p.held(n).expect("published");
                (
                    n.to_string(),
                    (held.digest(), render::ruleset(&held.full().to_ruleset())),
                )
            })
            .collect();
        (p.shared.digest(), nodes)
    }
}

#[test]
fn replicas_agree_on_content_whatever_the_event_order() {
    let mut incremental = Replica::new();
    incremental.list(first(), false, [0, 1, 2]);
    let start = incremental.outcome();
    for ev in changes() {
        incremental.handle(ev);
        incremental.publish();
    }

    let mut late = Replica::new();
    late.list(last(), true, [2, 1, 0]);

    let mut shuffled = Replica::new();
    shuffled.list(first(), true, [1, 2, 0]);
    assert_eq!(shuffled.outcome(), start, "the same first state");
    let mut evs = changes();
    evs.reverse();
    // Nodes first, then the rest in reverse, published every third event.
    evs.rotate_right(1);
    for (k, ev) in evs.into_iter().enumerate() {
        shuffled.handle(ev);
        if k % 3 == 2 {
            shuffled.publish();
        }
    }
    shuffled.publish();

    let want = incremental.outcome();
    assert_ne!(want, start, "the changes changed something");
    for (name, replica) in [("late", &late), ("shuffled", &shuffled)] {
        let got = replica.outcome();
        for (node, (digest, text)) in &want.1 {
            let (got_digest, got_text) = &got.1[node];
            assert_eq!(got_text, text, "{name}: {node}'s ruleset");
            assert_eq!(got_digest, digest, "{name}: {node}'s digest");
        }
        assert_eq!(got.0, want.0, "{name}: the shared/overlay split");
    }
    // The overlays are not empty: the per-node part is exercised.
    let p = incremental.fanout.publication();
    for (n, _) in NODES {
        assert!(
            p.overlays.get(n).is_some_and(|o| o.element_count() > 0),
            "{n} has its own elements"
        );
    }

    // So a node synced on one replica resumes on the others by content, with nothing to send.
    for (n, _) in NODES {
        let held = p.held(n).unwrap();
        let applied = Applied {
            brain_epoch: incremental.fanout.epoch,
            generation: 7,
            digest: held.digest(),
            resource_versions: Vec::new(),
        };
        for replica in [&late, &shuffled] {
            let base = replica
                .fanout
                .resume_point(n, Some(&applied))
                .expect("resumed by content");
            assert!(matches!(base, Resume::Exact(_)), "{base:?}");
            assert_eq!(base.version(), replica.fanout.publication().version);
        }
    }
    for replica in [&late, &shuffled] {
        assert_eq!(
            replica.fanout.metrics.resumptions(Resumption::ByContent),
            NODES.len() as u64
        );
    }
}

/// [`first`]'s objects with the resourceVersions an API server gives them (one etcd revision
/// per write), and [`changes`] as events of later revisions, in the order the API server made
/// them. Every watch stream delivers its resource's events in that order.
fn stamped_first() -> State {
    let mut s = first();
    let mut rv = 0;
    let mut next = || {
        rv += 1;
        Some(rv.to_string())
    };
    s.services
        .iter_mut()
        .for_each(|o| o.metadata.resource_version = next());
    s.slices
        .iter_mut()
        .for_each(|o| o.metadata.resource_version = next());
    s.nodes
        .iter_mut()
        .for_each(|o| o.metadata.resource_version = next());
    s
}

fn stamped(mut evs: Vec<WatchEvent>) -> Vec<WatchEvent> {
    for (k, ev) in evs.iter_mut().enumerate() {
        let rv = Some((1000 + k).to_string());
        let meta = match ev {
            WatchEvent::Service(e) => match &mut **e {
                Event::Apply(o) | Event::Delete(o) => &mut o.metadata,
                _ => unreachable!(),
            },
            WatchEvent::Slice(e) => match &mut **e {
                Event::Apply(o) | Event::Delete(o) => &mut o.metadata,
                _ => unreachable!(),
            },
            WatchEvent::Node(e) => match &mut **e {
                Event::Apply(o) | Event::Delete(o) => &mut o.metadata,
                _ => unreachable!(),
            },
            WatchEvent::ServiceCidr(_) => unreachable!(),
        };
        meta.resource_version = rv;
    }
    evs
}

/// Endpoint churn, as a cluster mostly sees it and as the benchmark makes it: each Service's
/// first slice changes its endpoints (how many, which are ready), Service after Service, three
/// rounds.
fn endpoint_churn() -> Vec<WatchEvent> {
    (1..=3)
        .flat_map(|round| {
            (0..SERVICES)
                .map(move |i| WatchEvent::Slice(Box::new(Event::Apply(slice(i, 0, round, "IPv4")))))
        })
        .collect()
}

/// One replica (`a`) publishes after every event of `changes`; the other (`b`) gets them in
/// `b_order` and publishes every fourth. A node holding each of `a`'s states reaches `b`, which
/// places it by the API state the node presents: by content when `b` published that state too,
/// otherwise in a window, with a restating delta. Returns, for the restated ones, whether the
/// delta took the node to exactly `b`'s latest ruleset; a delta that did not fails the node's
/// digest check (asserted here), so the node refuses it and gets a snapshot, never a wrong
/// ruleset.
fn restate_each_state(
    changes: impl Fn() -> Vec<WatchEvent>,
    b_order: impl Fn(Vec<WatchEvent>) -> Vec<WatchEvent>,
) -> Vec<bool> {
    let mut a = Replica::new();
    a.list(stamped_first(), false, [0, 1, 2]);
    let mut a_states = vec![a.fanout.publication()];
    for ev in stamped(changes()) {
        a.handle(ev);
        a.publish();
        a_states.push(a.fanout.publication());
    }
    let mut b = Replica::new();
    b.list(stamped_first(), true, [2, 1, 0]);
    for (k, ev) in b_order(stamped(changes())).into_iter().enumerate() {
        b.handle(ev);
        if k % 4 == 3 {
            b.publish();
        }
    }
    b.publish();
    let latest = b.fanout.publication();
    assert_eq!(
        a_states.last().unwrap().shared.digest(),
        latest.shared.digest(),
        "the same final state"
    );

    let mut restated = Vec::new();
    for (k, state) in a_states.iter().enumerate() {
        for (n, _) in NODES {
            let held = state.held(n).unwrap();
            let applied = Applied {
                brain_epoch: a.fanout.epoch,
                generation: k as u64 + 1,
                digest: held.digest(),
                resource_versions: state.api.to_wire(),
            };
            let start = match b.fanout.resume_point(n, Some(&applied)) {
                Some(Resume::Window(start, api)) => {
                    assert_eq!(api, state.api);
                    start
                }
                // A state `b` published too: resumed by content, as before.
                Some(Resume::Exact(_)) => continue,
                None => panic!("{n} at a's state {k} not placed ({:?})", state.api),
            };
            let Some(Next::Send(frames, target)) = b.fanout.restating_update(n, start, &latest)
            else {
                panic!("no restating update for {n} at a's state {k}");
            };
            let updates: Vec<Update> = frames
                .iter()
                .map(|f| Update::decode(&f.encode_to_vec()[..]).unwrap())
                .collect();
            let last = updates.last().unwrap();
            assert!(last.restating && last.base_digest.is_empty() && last.base_generation == 0);
            assert_eq!(last.resource_versions, latest.api.to_wire());
            assert_eq!(last.digest, target.digest());
            let Ok(Body::Delta(delta)) = parts::join(updates.iter().filter_map(|u| u.body.clone()))
            else {
                panic!("a restating update is a delta");
            };
            let mut node_model = held.full();
            node_model.apply(&delta);
            let exact = render::ruleset(&node_model.to_ruleset())
                == render::ruleset(&target.full().to_ruleset());
            assert_eq!(
                node_model.digest() == last.digest,
                exact,
                "{n} at a's state {k}: the digest tells a wrong ruleset from the right one"
            );
            restated.push(exact);
        }
    }
    assert_eq!(
        b.fanout.metrics.resumptions(Resumption::Snapshot),
        0,
        "every node placed"
    );
    restated
}

/// Endpoint churn folded in other batches: every state of one replica the other never
/// published is restated exactly.
#[test]
fn endpoint_churn_in_other_batches_is_restated_exactly() {
    let restated = restate_each_state(endpoint_churn, |evs| evs);
    assert!(
        restated.len() > 3 * SERVICES as usize,
        "most of a's states are not b's: {} restated",
        restated.len()
    );
    assert!(restated.iter().all(|exact| *exact), "{restated:?}");
}

/// Services, their slices and a Node changing together, and the streams interleaving
/// differently on each replica (`b` gets the slices first): the node may hold a Service's new
/// shape with its old endpoints, whose objects `b` never had, so some restatements miss. Those
/// fail the digest check (asserted in [`restate_each_state`]); the rest are exact.
#[test]
fn interleaved_streams_are_restated_or_refused() {
    let restated = restate_each_state(changes, |evs| {
        let (slices, others): (Vec<_>, Vec<_>) = evs
            .into_iter()
            .partition(|ev| matches!(ev, WatchEvent::Slice(_)));
        slices.into_iter().chain(others).collect()
    });
    let exact = restated.iter().filter(|e| **e).count();
    assert!(!restated.is_empty() && exact > 0, "{restated:?}");
}
