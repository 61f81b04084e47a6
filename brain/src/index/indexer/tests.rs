//! The index state machine, driven by watch events as the watches deliver them, observed
//! through what it publishes into a [`Fanout`]: the sync gate, the relist swap, and what single
//! changes publish. References are computed from scratch from the same index
//! ([`rules::ruleset`]).
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::watcher::Event;
use serde_json::json;
use splitproxy_proto::model::Model;
use splitproxy_proto::render;

use super::{Indexer, WatchEvent};
use crate::fanout::{Fanout, Publication};
use crate::metrics::Metrics;
use crate::rules::{self, RulesConfig};

// ---- objects ----

/// A ClusterIP Service with one port, 80/TCP to 8080.
fn service(name: &str, ip: &str) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": "default", "name": name},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": ip,
            "clusterIPs": [ip],
            "ports": [{"protocol": "TCP", "port": 80, "targetPort": 8080}],
        },
    }))
    .expect("test Service")
}

/// A slice of Service `service` with ready endpoints on 8080/TCP.
fn slice(name: &str, service: &str, ips: &[&str]) -> EndpointSlice {
    let endpoints: Vec<_> = ips
        .iter()
        .map(|ip| json!({"addresses": [ip], "conditions": {"ready": true}}))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": "default",
            "name": name,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"protocol": "TCP", "port": 8080}],
        "endpoints": endpoints,
    }))
    .expect("test EndpointSlice")
}

fn node(name: &str, ip: &str) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]},
    }))
    .expect("test Node")
}

fn service_cidr(name: &str, cidr: &str) -> ServiceCIDR {
    serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": [cidr]},
    }))
    .expect("test ServiceCIDR")
}

// ---- events ----

fn svc(e: Event<Service>) -> WatchEvent {
    WatchEvent::Service(Box::new(e))
}
fn sl(e: Event<EndpointSlice>) -> WatchEvent {
    WatchEvent::Slice(Box::new(e))
}
fn nd(e: Event<Node>) -> WatchEvent {
    WatchEvent::Node(Box::new(e))
}
fn cidr(e: Event<ServiceCIDR>) -> WatchEvent {
    WatchEvent::ServiceCidr(Box::new(e))
}

/// A whole list: `Init`, one `InitApply` per object, `InitDone`.
fn list<K>(wrap: fn(Event<K>) -> WatchEvent, objects: Vec<K>) -> Vec<WatchEvent> {
    std::iter::once(wrap(Event::Init))
        .chain(objects.into_iter().map(|o| wrap(Event::InitApply(o))))
        .chain([wrap(Event::InitDone)])
        .collect()
}

// ---- the machine under test ----

struct Rig {
    indexer: Indexer,
    fanout: Arc<Fanout>,
}

impl Rig {
    fn new(watch_service_cidrs: bool) -> Self {
        let fanout = Fanout::new(Arc::new(Metrics::default()), 4, 1024);
        Rig {
            indexer: Indexer::new(
                RulesConfig::default(),
                fanout.metrics.clone(),
                watch_service_cidrs,
            ),
            fanout,
        }
    }

    /// The Services a, b with one endpoint each, Nodes n1, n2, and no ServiceCIDRs, listed and
    /// published.
    fn synced() -> Self {
        let mut r = Rig::new(false);
        r.events(list(
            svc,
            vec![service("a", "10.96.0.10"), service("b", "10.96.0.20")],
        ));
        r.events(list(
            sl,
            vec![
                slice("a-1", "a", &["10.244.1.1"]),
                slice("b-1", "b", &["10.244.2.1"]),
            ],
        ));
        r.events(list(
            nd,
            vec![node("n1", "192.168.0.1"), node("n2", "192.168.0.2")],
        ));
        assert!(r.fanout.synced());
        assert_eq!(r.version(), 1);
        r
    }

    /// Handles one event and publishes, as the watch loop does; true when it recomputed.
    fn event(&mut self, ev: WatchEvent) -> bool {
        self.indexer.handle(ev);
        self.indexer.publish(&self.fanout)
    }

    fn events(&mut self, evs: Vec<WatchEvent>) {
        for ev in evs {
            self.event(ev);
        }
    }

    fn publication(&self) -> Arc<Publication> {
        self.fanout.publication()
    }

    fn version(&self) -> u64 {
        self.publication().version
    }

    fn publications(&self) -> u64 {
        self.fanout.metrics.publications.load(Ordering::Relaxed)
    }

    /// The published shared ruleset in nft syntax.
    fn text(&self) -> String {
        render::ruleset(&self.publication().shared.to_ruleset())
    }

    /// The shared ruleset computed from scratch from the index as it stands.
    fn scratch(&self) -> Model {
        Model::from_ruleset(&rules::ruleset(self.indexer.index(), &self.indexer.config))
    }

    /// Publishes `ev` and checks it made exactly one publication, equal to the ruleset computed
    /// from scratch, changing what the from-scratch rulesets before and after differ in (and
    /// nothing else). Returns the change, one line per chain, set or element.
    fn change(&mut self, ev: WatchEvent) -> BTreeSet<String> {
        let before = self.publication();
        let scratch_before = self.scratch();
        assert_eq!(before.shared.digest(), scratch_before.digest());
        assert!(self.event(ev), "a change recomputes");
        let after = self.publication();
        assert_eq!(after.version, before.version + 1, "one publication");
        assert_eq!(
            after.shared.digest(),
            self.scratch().digest(),
            "published state equals the state computed from scratch"
        );
        let change = delta_lines(&before.shared, &after.shared);
        assert_eq!(change, delta_lines(&scratch_before, &self.scratch()));
        assert!(!change.is_empty());
        change
    }

    /// The objects the publication of `version` folded in.
    fn objects_of(&self, version: u64) -> Vec<String> {
        self.fanout.changes_between(version - 1, version).1
    }
}

/// What turns `before` into `after`, one readable line per chain, set and element.
fn delta_lines(before: &Model, after: &Model) -> BTreeSet<String> {
    let delta = before.diff(after);
    let mut out = BTreeSet::new();
    for t in &delta.upsert {
        for c in &t.chains {
            out.insert(format!("+chain {}", c.name));
        }
        for s in &t.sets {
            if before.set(&(t.family(), t.name.clone()), &s.name).is_none() {
                out.insert(format!("+set {}", s.name));
            }
            for e in &s.elements {
                out.insert(format!("+{} {}", s.name, render::element(s, e)));
            }
        }
    }
    for r in &delta.remove {
        if r.whole {
            out.insert(format!("-table {}", r.name));
        }
        out.extend(r.chains.iter().map(|c| format!("-chain {c}")));
        out.extend(r.sets.iter().map(|s| format!("-set {s}")));
        for se in &r.elements {
            let def = &before
                .set(&(r.family(), r.name.clone()), &se.set)
                .expect("removed from an existing set")
                .def;
            for e in &se.elements {
                out.insert(format!("-{} {}", se.set, render::element(def, e)));
            }
        }
    }
    out
}

fn assert_not_published(r: &Rig, step: &str) {
    assert!(!r.fanout.synced(), "{step}: synced too early");
    assert!(!r.indexer.synced(), "{step}: indexer synced too early");
    assert_eq!(r.version(), 0, "{step}: published too early");
    assert_eq!(r.publications(), 0, "{step}: published too early");
    assert!(r.publication().held("n1").is_none(), "{step}: servable");
}

// ---- the sync gate ----

/// Every publication waits for every initial list (Services, slices, Nodes, ServiceCIDRs):
/// changes arriving meanwhile are held too, and the first publication has everything.
#[test]
fn nothing_is_published_before_every_initial_list_is_done() {
    let mut r = Rig::new(true);
    assert!(!r.indexer.publish(&r.fanout));
    assert_not_published(&r, "start");
    r.events(list(svc, vec![service("a", "10.96.0.10")]));
    assert_not_published(&r, "Services listed");
    // A change of a listed resource while others are still listing.
    assert!(!r.event(svc(Event::Apply(service("b", "10.96.0.20")))));
    assert_not_published(&r, "Service applied");
    r.events(list(sl, vec![slice("a-1", "a", &["10.244.1.1"])]));
    assert_not_published(&r, "slices listed");
    r.events(list(nd, vec![node("n1", "192.168.0.1")]));
    assert_not_published(&r, "Nodes listed");
    r.event(cidr(Event::Init));
    r.event(cidr(Event::InitApply(service_cidr("main", "10.96.0.0/16"))));
    assert_not_published(&r, "ServiceCIDRs listing");

    assert!(r.event(cidr(Event::InitDone)));
    assert!(r.fanout.synced());
    assert!(r.indexer.synced());
    assert_eq!(r.version(), 1);
    assert_eq!(r.publications(), 1, "the initial state is one publication");
    let text = r.text();
    for expected in ["10.96.0.10", "10.96.0.20", "10.244.1.1", "10.96.0.0/16"] {
        assert!(text.contains(expected), "{expected} missing from\n{text}");
    }
    assert_eq!(r.publication().shared.digest(), r.scratch().digest());
    assert!(
        r.publication().overlays.contains_key("n1"),
        "the Node's overlay is published with it"
    );
}

/// Without a ServiceCIDR watch (`--service-cidr` given, or an API server without them) the gate
/// waits for the other three lists only.
#[test]
fn without_service_cidrs_the_gate_waits_for_the_other_lists() {
    let mut r = Rig::new(false);
    r.events(list(svc, vec![service("a", "10.96.0.10")]));
    r.events(list(sl, vec![]));
    assert_not_published(&r, "Nodes not listed");
    r.events(list(nd, vec![]));
    assert!(r.fanout.synced());
    assert_eq!(r.version(), 1);
}

// ---- relists ----

/// A relist after being synced swaps its resource in one step: while it runs the brain is
/// unsynced and the last complete state stays published (nodes keep it); no publication shows
/// part of the list; when it is done, objects absent from it are gone and new ones are there,
/// in one publication.
#[test]
fn a_relist_swaps_the_resource_in_one_step() {
    let mut r = Rig::synced();
    let before = r.publication();
    assert!(before.held("n1").is_some());

    // Services relist: a stays, b is gone, c is new.
    assert!(!r.event(svc(Event::Init)));
    assert!(!r.fanout.synced(), "relisting: not serving new updates");
    for s in [service("a", "10.96.0.10"), service("c", "10.96.0.30")] {
        assert!(!r.event(svc(Event::InitApply(s))));
    }
    // A change of another resource during the relist is held as well.
    assert!(!r.event(sl(Event::Apply(slice("c-1", "c", &["10.244.3.1"])))));
    assert!(!r.fanout.synced());
    assert!(
        Arc::ptr_eq(&r.publication(), &before),
        "the last complete state stays published during the relist"
    );
    let text = r.text();
    assert!(text.contains("10.96.0.20") && !text.contains("10.96.0.30"));

    assert!(r.event(svc(Event::InitDone)));
    assert!(r.fanout.synced());
    assert_eq!(
        r.version(),
        before.version + 1,
        "the swap is one publication"
    );
    let text = r.text();
    assert!(text.contains("10.96.0.10"), "a, listed again, stays");
    assert!(
        !text.contains("10.96.0.20"),
        "b, absent from the relist, is gone"
    );
    assert!(text.contains("10.96.0.30") && text.contains("10.244.3.1"));
    assert_eq!(r.publication().shared.digest(), r.scratch().digest());

    // Slices relist: b's slice is gone with it, a's slice loses its endpoint to a new one.
    let before = r.publication();
    r.event(sl(Event::Init));
    r.event(sl(Event::InitApply(slice("a-1", "a", &["10.244.1.9"]))));
    assert!(!r.fanout.synced());
    assert!(Arc::ptr_eq(&r.publication(), &before));
    assert!(r.event(sl(Event::InitDone)));
    assert!(r.fanout.synced());
    assert_eq!(r.version(), before.version + 1);
    let text = r.text();
    assert!(text.contains("10.244.1.9"));
    assert!(!text.contains("10.244.1.1"), "the old endpoint is gone");
    assert!(!text.contains("10.244.3.1"), "c's slice, absent, is gone");
    assert_eq!(r.publication().shared.digest(), r.scratch().digest());
}

/// A relist that finds what the brain already has serves again without a new publication.
#[test]
fn a_relist_without_changes_serves_again() {
    let mut r = Rig::new(true);
    r.events(list(svc, vec![service("a", "10.96.0.10")]));
    r.events(list(sl, vec![]));
    r.events(list(nd, vec![node("n1", "192.168.0.1")]));
    r.events(list(cidr, vec![service_cidr("main", "10.96.0.0/16")]));
    assert!(r.fanout.synced());
    let before = r.publication();

    r.event(cidr(Event::Init));
    assert!(!r.fanout.synced());
    r.event(cidr(Event::InitApply(service_cidr("main", "10.96.0.0/16"))));
    r.event(cidr(Event::InitDone));
    assert!(r.fanout.synced(), "same ServiceCIDRs: serving again");
    assert!(Arc::ptr_eq(&r.publication(), &before));

    // A rebuilt resource republishes every overlay (they are compared by identity, not
    // content), but what each node holds is the same.
    r.events(list(nd, vec![node("n1", "192.168.0.1")]));
    assert!(r.fanout.synced(), "same Nodes: serving again");
    let (old, new) = (
        before.held("n1").expect("published"),
        r.publication().held("n1").expect("published"),
    );
    assert_eq!(old.digest(), new.digest());
}

// ---- single changes ----

/// Applying and deleting a Service each publish exactly that Service's share; a Node that only
/// reports status publishes nothing.
#[test]
fn a_service_change_publishes_exactly_the_change() {
    let mut r = Rig::synced();
    let added = r.change(svc(Event::Apply(service("c", "10.96.0.30"))));
    assert!(
        added.iter().all(|l| l.contains("10.96.0.30")),
        "only c's elements: {added:#?}"
    );
    assert!(added.iter().all(|l| l.starts_with('+')), "{added:#?}");
    assert_eq!(r.objects_of(r.version()), vec!["Service default/c"]);

    let removed = r.change(svc(Event::Delete(service("c", "10.96.0.30"))));
    let undone: BTreeSet<String> = added.iter().map(|l| l.replacen('+', "-", 1)).collect();
    assert_eq!(
        removed, undone,
        "the delete takes away what the apply added"
    );
    assert_eq!(r.objects_of(r.version()), vec!["Service default/c"]);

    let v = r.version();
    assert!(!r.event(nd(Event::Apply(node("n1", "192.168.0.1")))));
    assert_eq!(r.version(), v, "an unchanged Node publishes nothing");
}

/// Applying and deleting a slice each publish exactly the change of its Service's endpoints.
#[test]
fn a_slice_change_publishes_exactly_the_change() {
    let mut r = Rig::synced();
    let added = r.change(sl(Event::Apply(slice("a-2", "a", &["10.244.1.2"]))));
    assert!(
        added.iter().all(|l| l.contains("10.96.0.10")),
        "only a's elements: {added:#?}"
    );
    assert!(added.iter().any(|l| l.contains("10.244.1.2")), "{added:#?}");
    assert!(
        !added.iter().any(|l| l.contains("10.96.0.20")),
        "b untouched"
    );
    assert_eq!(r.objects_of(r.version()), vec!["EndpointSlice default/a-2"]);

    let removed = r.change(sl(Event::Delete(slice("a-2", "a", &["10.244.1.2"]))));
    assert!(
        removed.iter().all(|l| l.contains("10.96.0.10")),
        "{removed:#?}"
    );
    // Back to one endpoint: slot 1 goes (removals name keys only), the port moves sets.
    for line in [
        "-service-endpoints 10.96.0.10 . tcp . 80 . 1",
        "-service-ports-2 10.96.0.10 . tcp . 80",
    ] {
        assert!(removed.contains(line), "{line} not in {removed:#?}");
    }
    assert!(!r.text().contains("10.244.1.2"));
}

/// A slice relabelled to another Service recomputes both: the old one loses the endpoint (here
/// its only one), the new one gains it.
#[test]
fn a_slice_moving_to_another_service_recomputes_both() {
    let mut r = Rig::synced();
    let moved = r.change(sl(Event::Apply(slice("a-1", "b", &["10.244.1.1"]))));
    let has = |sign: &str, set: &str, what: &str| {
        moved
            .iter()
            .any(|l| l.starts_with(&format!("{sign}{set} ")) && l.contains(what))
    };
    assert!(
        has("+", "no-endpoint-services", "10.96.0.10"),
        "a has no endpoint left: {moved:#?}"
    );
    assert!(has("-", "service-ports-1", "10.96.0.10"), "{moved:#?}");
    assert!(
        has("+", "service-ports-2", "10.96.0.20"),
        "b has two: {moved:#?}"
    );
    assert_eq!(r.objects_of(r.version()), vec!["EndpointSlice default/a-1"]);
}

// ---- what a node holding an older state can apply ----

/// A slice of Service `service` whose endpoints run on the given nodes.
fn slice_on(name: &str, service: &str, eps: &[(&str, &str)]) -> EndpointSlice {
    let mut s = slice(name, service, &[]);
    s.endpoints = eps
        .iter()
        .map(|(ip, node)| {
            serde_json::from_value(json!({
                "addresses": [ip],
                "conditions": {"ready": true},
                "nodeName": node,
            }))
            .expect("test endpoint")
        })
        .collect();
    s
}

/// Takes `node`, holding `base`, to the latest publication as the actuator would: the update's
/// parts joined (the shared ones and the node's own) and applied to the whole table it holds.
/// Returns the digest it ends with and the one the brain says it must have.
fn apply_next(r: &Rig, node: &str, base: &crate::fanout::Held) -> (Vec<u8>, Vec<u8>) {
    use prost::Message;
    use splitproxy_proto::v1::{Update, update::Body};
    let desired = r.publication();
    let Some(crate::fanout::Next::Send(frames, target)) =
        r.fanout.next_update(node, Some(base), &desired)
    else {
        panic!("{node} has an update to apply");
    };
    let updates: Vec<Update> = frames
        .iter()
        .map(|f| Update::decode(&f.encode_to_vec()[..]).expect("an Update"))
        .collect();
    let digest = updates.last().expect("frames").digest.clone();
    assert_eq!(digest, target.digest());
    let Body::Delta(delta) =
        splitproxy_proto::parts::join(updates.into_iter().filter_map(|u| u.body)).expect("parts")
    else {
        panic!("a delta for a node whose base is known");
    };
    let mut held = base.full();
    held.apply(&delta);
    (held.digest(), digest)
}

/// A relist that takes away a node's only local endpoint rebuilds that node's overlay, which
/// then lacks the sets the old one had elements in. The node, holding the state from before the
/// relist, must still reach the brain's digest with the delta it is sent (it used to NACK with
/// "digest after applying differs from the brain's" until a snapshot repaired it).
#[test]
fn a_relist_that_removes_a_node_local_endpoint_gives_a_delta_the_node_can_apply() {
    let mut r = Rig::new(false);
    r.events(list(
        svc,
        vec![service("a", "10.96.0.10"), service("b", "10.96.0.20")],
    ));
    r.events(list(
        sl,
        vec![
            slice_on("a-1", "a", &[("10.244.1.1", "n1"), ("10.244.2.1", "n2")]),
            slice_on("b-1", "b", &[("10.244.2.2", "n2")]),
        ],
    ));
    r.events(list(
        nd,
        vec![node("n1", "192.168.0.1"), node("n2", "192.168.0.2")],
    ));
    assert!(r.fanout.synced());
    let before = r.publication();
    let held: Vec<_> = ["n1", "n2"]
        .iter()
        .map(|n| before.held(n).expect("published"))
        .collect();
    assert!(
        render::ruleset(&held[0].full().to_ruleset()).contains("10.244.1.1 . 10.244.1.1"),
        "n1 holds the hairpin pair of its local endpoint"
    );

    // The slices relist without n1's endpoint.
    r.events(list(
        sl,
        vec![
            slice_on("a-1", "a", &[("10.244.2.1", "n2")]),
            slice_on("b-1", "b", &[("10.244.2.2", "n2")]),
        ],
    ));
    assert!(r.fanout.synced());
    assert_eq!(r.version(), before.version + 1);
    for (node, base) in ["n1", "n2"].iter().zip(&held) {
        let (reached, wanted) = apply_next(&r, node, base);
        assert_eq!(reached, wanted, "{node} reaches the brain's digest");
    }

    // And back: a Node relist gives n1 its overlay anew, again from a rebuild.
    let before = r.publication();
    let n1 = before.held("n1").expect("published");
    r.events(list(
        sl,
        vec![
            slice_on("a-1", "a", &[("10.244.1.1", "n1"), ("10.244.2.1", "n2")]),
            slice_on("b-1", "b", &[("10.244.2.2", "n2")]),
        ],
    ));
    let (reached, wanted) = apply_next(&r, "n1", &n1);
    assert_eq!(reached, wanted, "n1 gets its endpoint back");
}

/// Each change's wait in the brain, from its watch event to the publication carrying it, is
/// observed once at that publication; the initial lists are not changes, and a change that
/// publishes nothing is not counted.
#[test]
fn a_publication_observes_each_changes_wait_in_the_brain() {
    let mut r = Rig::synced();
    let count = |r: &Rig, suffix: &str| {
        let prefix = format!("splitproxy_brain_change_queue_seconds_{suffix} ");
        r.fanout
            .metrics
            .render(0)
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()).map(str::to_owned))
    };
    assert_eq!(count(&r, "count").as_deref(), Some("0"), "the lists");
    r.indexer
        .handle(svc(Event::Apply(service("c", "10.96.0.30"))));
    std::thread::sleep(std::time::Duration::from_millis(30));
    r.indexer
        .handle(svc(Event::Apply(service("d", "10.96.0.40"))));
    assert!(r.indexer.publish(&r.fanout));
    assert_eq!(count(&r, "count").as_deref(), Some("2"));
    let under_25ms = count(&r, "bucket{le=\"0.025\"}");
    assert_eq!(
        under_25ms.as_deref(),
        Some("1"),
        "c waited 30 ms, d did not"
    );
    assert!(!r.indexer.publish(&r.fanout), "nothing left to publish");
    assert_eq!(count(&r, "count").as_deref(), Some("2"), "observed once");
    let v = r.version();
    r.event(nd(Event::Apply(node("n1", "192.168.0.1"))));
    assert_eq!(r.version(), v, "an unchanged Node publishes nothing");
    assert_eq!(
        count(&r, "count").as_deref(),
        Some("2"),
        "and waits for nothing"
    );
}
