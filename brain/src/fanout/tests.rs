//! The fan-out state machine without streams: publications in, a node's next update out, its
//! answers recorded, as `session::session` drives it.
use std::sync::Arc;
use std::sync::atomic::Ordering;

use prost::Message;
use prost_types::Timestamp;
use splitproxy_proto::frames::UpdateFrame;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{
    Ack, Applied, DataType, Element, Family, Ruleset, Set, Table, Update, datum, update::Body,
};

use super::{Fanout, Held, Next};
use crate::api_state::ApiState;
use crate::metrics::Metrics;

// ---- models and publications ----

/// A one-table, one-set model holding the integers `elements`.
fn model(elements: impl IntoIterator<Item = u32>) -> Arc<Model> {
    let elements = elements
        .into_iter()
        .map(|i| Element {
            key: vec![splitproxy_proto::v1::Datum {
                value: Some(datum::Value::U32(i)),
            }],
            ..Element::default()
        })
        .collect();
    Arc::new(Model::from_ruleset(&Ruleset {
        tables: vec![Table {
            family: Family::Ip as i32,
            name: "splitproxy".into(),
            sets: vec![Set {
                name: "numbers".into(),
                key: vec![DataType::Integer as i32],
                elements,
                ..Set::default()
            }],
            ..Table::default()
        }],
    }))
}

/// `base` with the integer `i` added, as an incremental change makes it: a new version sharing
/// the structure of `base` (a rebuilt model would share none, and the history keeps little from
/// before a rebuild, `crate::history`).
fn grown(base: &Arc<Model>, i: u32) -> Arc<Model> {
    let e = Element {
        key: vec![splitproxy_proto::v1::Datum {
            value: Some(datum::Value::U32(i)),
        }],
        ..Element::default()
    };
    let mut m = (**base).clone();
    let inserted = m.insert_element(
        &(Family::Ip, "splitproxy".into()),
        "numbers",
        splitproxy_proto::model::element_key_bytes(&e),
        e.encode_to_vec().into_boxed_slice(),
    );
    assert!(inserted);
    Arc::new(m)
}

/// Sessions started so far, by kind: same epoch, by content, restated, snapshot.
fn resumptions(f: &Fanout) -> [u64; 4] {
    crate::metrics::Resumption::ALL.map(|k| f.metrics.resumptions(k))
}

/// [`Fanout::resume_point`] for a node at a state the brain published: the state, if found.
trait ResumeExact {
    fn resume_exact(&self, node: &str, applied: Option<&Applied>) -> Option<Held>;
}

impl ResumeExact for Fanout {
    fn resume_exact(&self, node: &str, applied: Option<&Applied>) -> Option<Held> {
        match self.resume_point(node, applied)? {
            super::Resume::Exact(held) => Some(held),
            super::Resume::Window(start, _) => panic!("placed in a window from {start}"),
        }
    }
}

fn at(seconds: i64) -> Timestamp {
    Timestamp { seconds, nanos: 0 }
}

fn fanout() -> Arc<Fanout> {
    Fanout::new(Arc::new(Metrics::default()), 4, 1024)
}

type Overlays = crate::overlay::NodeOverlays;

fn overlays(nodes: &[(&str, u32)]) -> Overlays {
    nodes
        .iter()
        .map(|(n, e)| (n.to_string(), model([*e])))
        .collect()
}

/// Publishes `shared` with `overlays`, one change triggered at `trigger` seconds.
fn publish(f: &Fanout, shared: Arc<Model>, overlays: &Overlays, trigger: i64) -> u64 {
    f.publish(
        shared,
        overlays.clone(),
        vec![at(trigger)],
        vec![format!("change {trigger}")],
    );
    f.publication().version
}

// ---- a node ----

/// The update `node` standing at `base` gets now; panics when there is none to send.
fn send(f: &Fanout, node: &str, base: Option<&Held>) -> (Vec<UpdateFrame>, Held) {
    match f.next_update(node, base, &f.publication()) {
        Some(Next::Send(frames, held)) => (frames, held),
        Some(Next::Current(held)) => panic!("{node} is current at {}", held.version),
        None => panic!("nothing published"),
    }
}

/// The node's answer to `frames`.
fn answer(f: &Fanout, node: &str, frames: &[UpdateFrame], sent: Held, ok: bool) -> bool {
    let ack = Ack {
        generation: frames[0].generation,
        ok,
        error: if ok {
            String::new()
        } else {
            "kernel says no".into()
        },
        apply_duration: Some(prost_types::Duration {
            seconds: 0,
            nanos: 5_000_000,
        }),
        errno: if ok { 0 } else { 2 },
        refused_message: if ok {
            String::new()
        } else {
            "delete elements from set service-ips".into()
        },
        kernel_message: String::new(),
    };
    f.record_ack(node, &ack, sent)
}

/// Sends `node` its next update and acks it; returns the state it holds then.
fn sync(f: &Fanout, node: &str, base: Option<&Held>) -> Held {
    let (frames, held) = send(f, node, base);
    assert!(answer(f, node, &frames, held.clone(), true));
    held
}

/// The frames as the node decodes them.
fn decode(frames: &[UpdateFrame]) -> Vec<Update> {
    frames
        .iter()
        .map(|f| Update::decode(&f.encode_to_vec()[..]).expect("an Update"))
        .collect()
}

/// The shared body of an update: its shared parts joined, as the actuator joins them (the last
/// frame's body is the node's own).
fn shared_body(updates: &[Update]) -> Body {
    let (_own, shared) = updates.split_last().expect("frames");
    assert!(
        shared.iter().all(|u| u.more),
        "every shared part says more follows"
    );
    splitproxy_proto::parts::join(shared.iter().filter_map(|u| u.body.clone()))
        .expect("parts of one body")
}

fn node_state(f: &Fanout, node: &str) -> super::NodeState {
    f.nodes
        .lock()
        .unwrap()
        .get(node)
        .cloned()
        .unwrap_or_default()
}

fn applied(f: &Fanout, node: &str) -> Applied {
    let st = node_state(f, node);
    Applied {
        brain_epoch: f.epoch,
        generation: st.acked_generation,
        digest: st.acked.expect("acked").digest(),
        resource_versions: Vec::new(),
    }
}

// ---- coalescing ----

/// Publications made while a node has not acked fold into its next update: it goes from what
/// the node holds straight to the latest, as one generation, with the trigger times of every
/// publication in between.
#[test]
fn a_busy_node_gets_the_latest_state_with_every_trigger_time() {
    let f = fanout();
    f.set_connected("n1", true, "peer");
    let none = Overlays::new();
    publish(&f, model([1]), &none, 1);
    let v1 = sync(&f, "n1", None);

    // The node is idle, holding v1: v2..v4 are published meanwhile.
    for i in 2..=4 {
        publish(&f, model(1..=i), &none, i as i64);
    }
    let (frames, held) = send(&f, "n1", Some(&v1));
    assert_eq!(held.version, 4, "straight to the latest");
    assert!(frames.iter().all(|fr| fr.generation == 2), "one update");
    assert!(frames.iter().all(|fr| fr.base_generation == 1));
    let updates = decode(&frames);
    let Body::Delta(delta) = shared_body(&updates) else {
        panic!("a delta from what the node holds")
    };
    let mut m = (*v1.shared).clone();
    m.apply(&delta);
    assert_eq!(m.digest(), model(1..=4).digest());
    let last = updates.last().expect("frames");
    assert_eq!(last.trigger_times, vec![at(2), at(3), at(4)]);
    assert_eq!(last.objects, vec!["change 2", "change 3", "change 4"]);
    assert_eq!(last.digest, held.digest());
    assert!(answer(&f, "n1", &frames, held.clone(), true));

    // An update in flight (v5) while v6 and v7 come: after its ack, the next one goes from v5
    // to v7 with only their trigger times.
    publish(&f, model(1..=5), &none, 5);
    let (frames, v5) = send(&f, "n1", Some(&held));
    publish(&f, model(1..=6), &none, 6);
    publish(&f, model(1..=7), &none, 7);
    assert!(answer(&f, "n1", &frames, v5.clone(), true));
    let (frames, v7) = send(&f, "n1", Some(&v5));
    assert_eq!(v7.version, 7);
    assert_eq!(
        decode(&frames).last().expect("frames").trigger_times,
        vec![at(6), at(7)]
    );
}

/// Each change's wait from its trigger time to the publication carrying it is observed once,
/// in its bucket; a trigger stamped by a clock ahead of the brain's counts as no wait.
#[test]
fn a_publication_observes_each_changes_wait_since_its_trigger_time() {
    let f = fanout();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970");
    let ago = |ms: u64| {
        let t = now - std::time::Duration::from_millis(ms);
        Timestamp {
            seconds: t.as_secs() as i64,
            nanos: t.subsec_nanos() as i32,
        }
    };
    let ahead = Timestamp {
        seconds: now.as_secs() as i64 + 60,
        nanos: 0,
    };
    f.publish(
        model([1]),
        Overlays::new(),
        vec![ago(120), ago(350), ahead],
        vec!["a".into(), "b".into(), "c".into()],
    );
    let text = f.metrics.render(0);
    let bucket = |le: &str| {
        let line = format!("splitproxy_brain_publish_latency_seconds_bucket{{le=\"{le}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map(str::to_owned)
    };
    assert_eq!(
        bucket("0.0001").as_deref(),
        Some("1"),
        "the trigger from ahead: no wait"
    );
    assert_eq!(bucket("0.1").as_deref(), Some("1"));
    assert_eq!(bucket("0.15").as_deref(), Some("2"), "120 ms");
    assert_eq!(bucket("0.3").as_deref(), Some("2"));
    assert_eq!(bucket("0.4").as_deref(), Some("3"), "350 ms");
}

// ---- acks ----

/// How many publications' fan-outs have been timed (every node counted in them settled), as
/// the metric says.
fn fanouts_timed(f: &Fanout) -> Option<String> {
    f.metrics
        .render(0)
        .lines()
        .find_map(|l| l.strip_prefix("splitproxy_brain_fanout_duration_seconds_count "))
        .map(str::to_owned)
}

/// An ack records the generation and what the node holds; a publication's fan-out is timed
/// once every node connected when it was published has acked it, or left.
#[test]
fn an_ack_records_the_held_state_and_settles_fanout_timing() {
    let f = fanout();
    f.set_connected("n1", true, "peer-1");
    f.set_connected("n2", true, "peer-2");
    let o = overlays(&[("n1", 100), ("n2", 200)]);
    publish(&f, model([1]), &o, 1);
    let fanout_count = || fanouts_timed(&f);
    assert_eq!(fanout_count().as_deref(), Some("0"));

    let (frames, held) = send(&f, "n1", None);
    assert!(answer(&f, "n1", &frames, held, true));
    let st = node_state(&f, "n1");
    assert_eq!((st.generation, st.acked_generation), (1, 1));
    let acked = st.acked.expect("held state recorded");
    assert_eq!(acked.version, 1);
    assert_eq!(acked.digest(), model([1]).digest_with(&model([100])));
    assert_eq!(st.last_apply, Some(std::time::Duration::from_millis(5)));
    assert!(st.last_error.is_empty());
    assert_eq!(fanout_count().as_deref(), Some("0"), "n2 has not acked");

    let n2 = sync(&f, "n2", None);
    assert_eq!(fanout_count().as_deref(), Some("1"), "every node acked v1");
    assert!(f.pending.lock().unwrap().is_empty());

    // A publication that changes only n2's overlay: n1 is current at it without an update.
    let o2 = overlays(&[("n1", 100), ("n2", 201)]);
    publish(&f, model([1]), &o2, 2);
    match f.next_update("n1", Some(&acked), &f.publication()) {
        Some(Next::Current(h)) => assert_eq!(h.version, 2),
        _ => panic!("n1 holds v2 already"),
    }
    assert_eq!(node_state(&f, "n1").acked.expect("acked").version, 2);
    assert_eq!(node_state(&f, "n1").generation, 1, "no update sent");
    // n2 leaves without acking v2: the fan-out of v2 is settled.
    let (_frames, _v2) = send(&f, "n2", Some(&n2));
    f.set_connected("n2", false, "peer-2");
    assert_eq!(fanout_count().as_deref(), Some("2"));
    assert!(f.pending.lock().unwrap().is_empty());
}

/// Fan-out timing counts the nodes connected when each publication was made: a node that
/// connects later does not hold it up, a node whose stream is replaced still does until it
/// acks, and an ack of a newer publication settles every older one the node was counted in.
#[test]
fn fanout_timing_counts_the_nodes_connected_at_each_publication() {
    let f = fanout();
    let timed = |v: u64| -> u32 {
        f.rollout_latency(v)
            .map_or(0, |r| r.buckets.iter().sum::<u32>())
    };
    let fanout_count = || fanouts_timed(&f);
    f.set_connected("n1", true, "peer-1");
    publish(&f, model([1]), &overlays(&[("n1", 100), ("n2", 200)]), 1);
    f.set_connected("n2", true, "peer-2");
    publish(&f, model([1, 2]), &overlays(&[("n1", 100), ("n2", 200)]), 2);
    // A newer stream replaces n1's: n1 stays counted in v1 and v2.
    f.connect("n1", "peer-1b");
    assert_eq!(fanout_count().as_deref(), Some("0"));

    // n2 was counted in v2 only: its ack of v2 times nothing of v1.
    let n2 = sync(&f, "n2", None);
    assert_eq!(fanout_count().as_deref(), Some("0"), "both wait for n1");
    assert_eq!((timed(1), timed(2)), (0, 1));

    // n1 takes v2 at once: that settles v1 too.
    sync(&f, "n1", None);
    assert_eq!(fanout_count().as_deref(), Some("2"));
    assert_eq!((timed(1), timed(2)), (1, 2));
    assert!(f.pending.lock().unwrap().is_empty());

    // Leaving settles what a node was counted in, without timing it as an ack; coming back, it
    // is counted from the next publication only.
    publish(
        &f,
        model([1, 2, 3]),
        &overlays(&[("n1", 100), ("n2", 200)]),
        3,
    );
    f.set_connected("n1", false, "peer-1b");
    f.set_connected("n1", true, "peer-1c");
    sync(&f, "n2", Some(&n2));
    assert_eq!(
        fanout_count().as_deref(),
        Some("3"),
        "n1 left v3, n2 acked it"
    );
    assert_eq!(timed(3), 1);
    publish(
        &f,
        model([1, 2, 3, 4]),
        &overlays(&[("n1", 100), ("n2", 200)]),
        4,
    );
    let pending = |v: u64| f.pending.lock().unwrap().get(&v).map(|p| p.waiting);
    assert_eq!(pending(4), Some(2), "both connected when v4 was published");
}

/// The share of the nodes yet to hold the newest publication, which publication pacing may
/// wait on (`--publish-when-unsettled`): each ack or departure lowers it, a publication starts
/// it over.
#[test]
fn the_newest_publications_unsettled_share_falls_with_each_ack() {
    let f = fanout();
    assert_eq!(f.newest_unsettled_share(), 0.0, "nothing published");
    f.set_connected("n1", true, "peer-1");
    f.set_connected("n2", true, "peer-2");
    let both = overlays(&[("n1", 100), ("n2", 200)]);
    publish(&f, model([1]), &both, 1);
    assert_eq!(f.newest_unsettled_share(), 1.0);
    let n1 = sync(&f, "n1", None);
    assert_eq!(f.newest_unsettled_share(), 0.5);
    publish(&f, model([1, 2]), &both, 2);
    assert_eq!(
        f.newest_unsettled_share(),
        1.0,
        "a new publication starts over"
    );
    sync(&f, "n1", Some(&n1));
    assert_eq!(f.newest_unsettled_share(), 0.5);
    f.set_connected("n2", false, "peer-2");
    assert_eq!(f.newest_unsettled_share(), 0.0, "n1 acked, n2 left");
}

// ---- NACKs ----

/// A NACK drops what the brain believed the node holds: the error is kept, it cannot resume
/// from there, and its next update is a snapshot.
#[test]
fn a_nack_makes_the_next_update_a_snapshot() {
    let f = fanout();
    f.set_connected("n1", true, "peer");
    let none = Overlays::new();
    publish(&f, model([1]), &none, 1);
    let v1 = sync(&f, "n1", None);
    let before = applied(&f, "n1");
    publish(&f, model([1, 2]), &none, 2);
    let (frames, v2) = send(&f, "n1", Some(&v1));
    assert_eq!(frames[0].base_generation, 1, "a delta");

    assert!(!answer(&f, "n1", &frames, v2, false));
    let st = node_state(&f, "n1");
    assert!(st.acked.is_none(), "held state dropped");
    assert_eq!(st.last_error, "kernel says no");
    // The kernel's errno and the refused message reach ListNodes' fields.
    assert_eq!(st.last_errno, 2);
    assert_eq!(
        st.last_refused_message,
        "delete elements from set service-ips"
    );
    assert_eq!(f.metrics.nacks.load(Ordering::Relaxed), 1);
    // A refused update changes nothing on the node: reconnecting, it still holds v1, which
    // its digest proves.
    assert_eq!(
        f.resume_exact("n1", Some(&before)).map(|h| h.version),
        Some(1)
    );

    let snapshots = f.metrics.snapshots_sent.load(Ordering::Relaxed);
    let (frames, held) = send(&f, "n1", None);
    assert!(frames.iter().all(|fr| fr.base_generation == 0));
    assert!(matches!(shared_body(&decode(&frames)), Body::Snapshot(_)));
    assert_eq!(held.version, 2);
    assert_eq!(
        f.metrics.snapshots_sent.load(Ordering::Relaxed),
        snapshots + 1
    );
}

// ---- resumption ----

/// A node reconnecting to the brain it acked resumes from what it acked: same epoch, the
/// generation it last acked, the same digest; its next delta names that generation.
#[test]
fn resumption_on_the_same_brain_names_the_acked_generation() {
    let f = fanout();
    let none = Overlays::new();
    publish(&f, model([1]), &none, 1);
    let v1 = sync(&f, "n1", None);
    let good = applied(&f, "n1");

    let base = f.resume_exact("n1", Some(&good)).expect("known base");
    assert_eq!(base.version, 1);
    assert_eq!(resumptions(&f), [1, 0, 0, 0]);
    assert!(matches!(
        f.next_update("n1", Some(&base), &f.publication()),
        Some(Next::Current(_))
    ));
    publish(&f, grown(&model([1]), 2), &none, 2);
    let (frames, _) = send(&f, "n1", Some(&base));
    assert_eq!(
        frames[0].base_generation, good.generation,
        "a delta on what it holds"
    );
    assert_eq!(v1.version, 1);
    assert!(matches!(shared_body(&decode(&frames)), Body::Delta(_)));
    assert!(decode(&frames).iter().all(|u| u.base_digest.is_empty()));

    // Whatever does not match a remembered state gets a snapshot.
    let unknown = [
        Applied {
            digest: vec![0; 16],
            ..good.clone()
        },
        Applied {
            digest: Vec::new(),
            ..good.clone()
        },
    ];
    for a in &unknown {
        assert!(f.resume_exact("n1", Some(a)).is_none(), "{a:?}");
    }
    assert!(f.resume_exact("n1", None).is_none(), "nothing applied");
    assert_eq!(resumptions(&f), [1, 0, 0, 3]);
}

/// Two replicas fed the same API state publish the same content under their own epochs and
/// versions. A node that fails over from one to the other resumes by content: nothing to send
/// when it holds the current state, else a delta from the version it holds, whose base is named
/// by digest (the node's generation is the other replica's). The delta applied to what the node
/// holds gives the digest the brain announces.
#[test]
fn a_node_fails_over_to_another_replica_by_content() {
    let (a, b) = (fanout(), fanout());
    let o = overlays(&[("n1", 100), ("n2", 200)]);
    let v1 = model([1]);
    for f in [&a, &b] {
        publish(f, v1.clone(), &o, 1);
    }
    // b publishes a version more than a (a's first states were dropped, or b started earlier):
    // versions differ, content does not.
    publish(&b, model([1, 2]), &o, 2);
    publish(&b, v1.clone(), &o, 3);
    assert_eq!((a.publication().version, b.publication().version), (1, 3));

    let held = sync(&a, "n1", None);
    let on_a = applied(&a, "n1");
    assert_eq!(on_a.digest, held.digest());

    // Same content at b's current version: nothing to send.
    let base = b
        .resume_exact("n1", Some(&on_a))
        .expect("resumed by content");
    assert_eq!(base.version, 3);
    assert_eq!(resumptions(&b), [0, 1, 0, 0]);
    assert!(matches!(
        b.next_update("n1", Some(&base), &b.publication()),
        Some(Next::Current(_))
    ));
    let snapshots = b.metrics.snapshots_sent.load(Ordering::Relaxed);

    // b moves on: a delta on the digest the node presented.
    let v4 = grown(&v1, 4);
    publish(&b, v4.clone(), &o, 4);
    let (frames, sent) = send(&b, "n1", Some(&base));
    assert!(frames.iter().all(|fr| fr.base_generation == 0));
    let updates = decode(&frames);
    assert_eq!(updates.last().unwrap().base_digest, on_a.digest);
    assert!(
        updates[..updates.len() - 1]
            .iter()
            .all(|u| u.base_digest.is_empty()),
        "only the last part names it"
    );
    let mut node_model = held.full();
    for u in &updates {
        if let Some(Body::Delta(d)) = &u.body {
            node_model.apply(d);
        }
    }
    assert_eq!(node_model.digest(), updates.last().unwrap().digest);
    assert_eq!(node_model.digest(), v4.digest_with(&model([100])));
    assert_eq!(b.metrics.snapshots_sent.load(Ordering::Relaxed), snapshots);

    // Once acked there, it is b's node like any other: the next delta names b's generation.
    assert!(answer(&b, "n1", &frames, sent.clone(), true));
    publish(&b, grown(&v4, 5), &o, 5);
    let (frames, _) = send(&b, "n1", Some(&sent));
    assert_eq!(frames[0].base_generation, frames[0].generation - 1);
    assert!(decode(&frames).iter().all(|u| u.base_digest.is_empty()));
    // And it resumes on b by generation, or by content, from then on.
    let on_b = applied(&b, "n1");
    assert!(b.resume_exact("n1", Some(&on_b)).is_some());
    assert_eq!(resumptions(&b), [1, 1, 0, 0]);
}

/// A node that reaches a replica long after its state was published there (a failover at
/// 10,000 nodes takes longer than the history's publications last under churn) is placed by
/// the API state it presents, in the step log, and restated exactly: no snapshot.
#[test]
fn a_node_older_than_the_history_is_restated_from_the_step_log() {
    let f = fanout();
    let api = |v: u64| ApiState::from_wire(&[v, v, 1, 0]).unwrap();
    let mut shared = model([1]);
    let mut own = model([100]);
    let mut held_at_5 = None;
    for v in 1..=(crate::history::HISTORY_VERSIONS as u64 + 20) {
        shared = grown(&shared, v as u32 + 1);
        if v % 7 == 0 {
            // The node's own elements change now and then.
            own = grown(&own, 100 + v as u32);
        }
        let o: Overlays = [("n1".to_string(), own.clone())].into_iter().collect();
        f.publish_traced(shared.clone(), o, vec![at(v as i64)], vec![], None, api(v));
        if v == 5 {
            held_at_5 = f.publication().held("n1");
        }
    }
    let held = held_at_5.unwrap();
    let applied = Applied {
        brain_epoch: 0,
        generation: 1,
        digest: held.digest(),
        resource_versions: api(5).to_wire(),
    };
    let latest = f.publication();
    let start = match f.resume_point("n1", Some(&applied)) {
        Some(super::Resume::Window(start, a)) => {
            assert_eq!(a, api(5));
            start
        }
        _ => panic!("not placed in a window"),
    };
    assert_eq!(start, 5);
    assert_eq!(resumptions(&f), [0, 0, 1, 0]);
    let Some(Next::Send(frames, target)) = f.restating_update("n1", start, &latest) else {
        panic!("no restating update");
    };
    let updates = decode(&frames);
    assert!(updates.last().unwrap().restating);
    let mut node_model = held.full();
    let Body::Delta(d) = shared_body(&updates) else {
        panic!("a delta");
    };
    node_model.apply(&d);
    if let Some(Body::Delta(d)) = &updates.last().unwrap().body {
        node_model.apply(d);
    }
    assert_eq!(node_model.digest(), target.digest());
    assert_eq!(node_model.digest(), updates.last().unwrap().digest);
    assert_eq!(f.metrics.snapshots_sent.load(Ordering::Relaxed), 0);
}

/// Replicas' views differ for a moment. A node holding a state the replica it reaches has not
/// published (it is behind) gets a snapshot; a node holding a state the replica published some
/// versions ago (it is ahead) gets a delta from there. Another node's digest proves nothing
/// about this one.
#[test]
fn a_replica_resumes_only_states_it_published_for_that_node() {
    let (ahead, behind) = (fanout(), fanout());
    let o = overlays(&[("n1", 100), ("n2", 200)]);
    let v1 = model([1]);
    publish(&behind, v1.clone(), &o, 1);
    publish(&ahead, v1.clone(), &o, 1);
    let v2 = grown(&v1, 2);
    publish(&ahead, v2.clone(), &o, 2);
    let mut v = v2.clone();
    for i in 3..=10 {
        v = grown(&v, i);
        publish(&ahead, v.clone(), &o, i as i64);
    }

    // n1 synced on the replica ahead, at v2 (then it failed), fails over to the one behind.
    let on_ahead = Applied {
        brain_epoch: ahead.epoch,
        generation: 1,
        digest: v2.digest_with(&model([100])),
        resource_versions: Vec::new(),
    };
    assert!(behind.resume_exact("n1", Some(&on_ahead)).is_none());
    assert_eq!(resumptions(&behind), [0, 0, 0, 1]);

    // n2 synced on the replica behind at v1, fails over to the one ahead: a delta from v1.
    let on_behind = Applied {
        brain_epoch: behind.epoch,
        generation: 1,
        digest: v1.digest_with(&model([200])),
        resource_versions: Vec::new(),
    };
    let base = ahead
        .resume_exact("n2", Some(&on_behind))
        .expect("v1 is remembered");
    assert_eq!(base.version, 1);
    let (frames, sent) = send(&ahead, "n2", Some(&base));
    assert_eq!(sent.version, 10);
    let updates = decode(&frames);
    assert_eq!(updates.last().unwrap().base_digest, on_behind.digest);
    // It carries the trigger times of every version after the one the node holds.
    assert_eq!(updates.last().unwrap().trigger_times.len(), 9);

    // n2's digest is not n1's state.
    assert!(ahead.resume_exact("n1", Some(&on_behind)).is_none());
}

// ---- the shared body cache ----

/// Nodes at the same base share the encoded body: the same bytes, encoded once. Only the last
/// frame's node part is their own.
#[test]
fn nodes_at_the_same_base_share_the_encoded_body() {
    let f = fanout();
    let o = overlays(&[("n1", 100), ("n2", 200)]);
    publish(&f, model([1]), &o, 1);
    let encodes = || f.metrics.encodes.load(Ordering::Relaxed);

    let (s1, h1) = send(&f, "n1", None);
    let (s2, h2) = send(&f, "n2", None);
    assert_eq!(encodes(), 1, "one snapshot body for both");
    for (a, b) in s1.iter().zip(&s2) {
        assert_eq!(a.shared.as_ptr(), b.shared.as_ptr(), "the same bytes");
    }
    assert_ne!(s1.last().unwrap().extra, s2.last().unwrap().extra);
    assert!(answer(&f, "n1", &s1, h1.clone(), true));
    assert!(answer(&f, "n2", &s2, h2.clone(), true));

    publish(&f, model([1, 2]), &o, 2);
    let (d1, _) = send(&f, "n1", Some(&h1));
    let (d2, _) = send(&f, "n2", Some(&h2));
    assert_eq!(encodes(), 2, "one delta body for both");
    assert_eq!(d1.len(), d2.len());
    for (a, b) in d1.iter().zip(&d2) {
        assert_eq!(a.shared.as_ptr(), b.shared.as_ptr(), "the same bytes");
        assert_eq!(a.shared.len(), b.shared.len());
    }
    // A node at another base gets a body of its own.
    let (s3, _) = send(&f, "n3", None);
    assert_eq!(encodes(), 3);
    assert_ne!(s3[0].shared.as_ptr(), d1[0].shared.as_ptr());
}

// ---- dropped publications ----

/// A publication that changes neither the shared model's content nor any overlay is dropped:
/// no new version, nothing for the streams.
#[test]
fn a_publication_that_changes_nothing_is_dropped() {
    let f = fanout();
    let (mut rx, _) = f.subscribe();
    let o = overlays(&[("n1", 100)]);
    assert_eq!(publish(&f, model([1]), &o, 1), 1);
    rx.borrow_and_update();

    // The same content in a new model, the same overlays.
    assert_eq!(publish(&f, model([1]), &o, 2), 1);
    assert!(!rx.has_changed().unwrap(), "the streams are not woken");
    assert_eq!(f.metrics.publications.load(Ordering::Relaxed), 1);

    // A changed overlay is a change.
    let mut o2 = o.clone();
    o2.insert("n2".into(), model([200]));
    assert_eq!(publish(&f, model([1]), &o2, 3), 2);
    assert!(rx.has_changed().unwrap());
    // A changed shared model too.
    assert_eq!(publish(&f, model([1, 2]), &o2, 4), 3);
}

// ---- sessions ----

/// A second session for a node replaces the first, which is told to end; the first ending
/// afterwards leaves the node connected, and only the current session's end disconnects it.
#[tokio::test]
async fn only_the_current_session_disconnects_its_node() {
    let f = fanout();
    let (old, old_end) = f.connect("n1", "peer-1");
    let (new, _new_end) = f.connect("n1", "peer-2");
    assert_ne!(old, new);
    tokio::time::timeout(std::time::Duration::from_secs(1), old_end.notified())
        .await
        .expect("the replaced session is told to end");
    f.disconnect("n1", old);
    let connected = |f: &Fanout| f.nodes.lock().unwrap()["n1"].connected;
    assert!(
        connected(&f),
        "a replaced session ending leaves the node connected"
    );
    assert_eq!(f.nodes.lock().unwrap()["n1"].peer, "peer-2");
    f.disconnect("n1", new);
    assert!(!connected(&f));
}

/// Disconnected nodes the cluster does not know are forgotten after the grace period; nodes of
/// the cluster stay listed, and so do connected ones.
#[test]
fn disconnected_strangers_are_pruned_cluster_nodes_stay() {
    use std::time::{Duration, Instant};
    let f = fanout();
    publish(&f, model([1]), &overlays(&[("member", 1)]), 1);
    for n in ["member", "stranger", "live"] {
        f.set_connected(n, true, "peer");
    }
    f.set_connected("member", false, "peer");
    f.set_connected("stranger", false, "peer");
    let grace = Duration::from_secs(60);
    f.prune_disconnected(Instant::now(), grace);
    assert_eq!(f.nodes.lock().unwrap().len(), 3, "within the grace period");
    f.prune_disconnected(Instant::now() + grace * 2, grace);
    let mut left: Vec<String> = f.nodes.lock().unwrap().keys().cloned().collect();
    left.sort();
    assert_eq!(left, ["live", "member"]);
}

// ---- trigger times after a reconnect ----

/// A node whose base is unknown (it connected, or NACKed) is sent a snapshot with the trigger
/// times of the changes that are news to it only: those published after it connected, or after
/// the last state it acked; none if its Hello said it holds the state already. A snapshot used
/// to carry every logged trigger time, and a node that changed nothing recorded a dozen network
/// programming samples of 15-20 s.
#[test]
fn a_snapshot_carries_only_the_trigger_times_of_changes_news_to_the_node() {
    let f = fanout();
    let none = Overlays::new();
    for i in 1..=3 {
        publish(&f, model(1..=i), &none, i as i64);
    }
    let triggers =
        |frames: &[UpdateFrame]| decode(frames).last().expect("frames").trigger_times.clone();

    // n1 connects at v3 and has nothing from this brain; v4 comes before its first update.
    f.set_connected("n1", true, "peer-1");
    f.hello("n1", None);
    publish(&f, model(1..=4), &none, 4);
    let (frames, v4) = send(&f, "n1", None);
    assert_eq!(frames[0].base_generation, 0, "a snapshot");
    assert_eq!(
        triggers(&frames),
        vec![at(4)],
        "only the change after it connected"
    );
    assert!(answer(&f, "n1", &frames, v4.clone(), true));

    // n2 reconnects (after a failover) holding exactly the current state: nothing is news.
    f.set_connected("n2", true, "peer-2");
    let current = f.publication().held("n2").expect("published");
    f.hello(
        "n2",
        Some(&Applied {
            brain_epoch: f.epoch ^ 1,
            generation: 17,
            digest: current.digest(),
            resource_versions: Vec::new(),
        }),
    );
    let (frames, _) = send(&f, "n2", None);
    assert_eq!(
        frames[0].base_generation, 0,
        "a snapshot (another brain's epoch)"
    );
    assert!(triggers(&frames).is_empty(), "it held the state already");
    // Another node holding something else gets the changes since it connected: none yet.
    f.set_connected("n3", true, "peer-3");
    f.hello(
        "n3",
        Some(&Applied {
            brain_epoch: f.epoch ^ 1,
            generation: 3,
            digest: vec![7; 16],
            resource_versions: Vec::new(),
        }),
    );
    let (frames, _) = send(&f, "n3", None);
    assert!(triggers(&frames).is_empty());

    // n1 NACKs the delta to v5; its snapshot then carries v5's and v6's trigger times: the
    // changes after v4, which it still holds.
    publish(&f, model(1..=5), &none, 5);
    let (frames, v5) = send(&f, "n1", Some(&v4));
    assert_eq!(triggers(&frames), vec![at(5)]);
    assert!(!answer(&f, "n1", &frames, v5, false));
    publish(&f, model(1..=6), &none, 6);
    let (frames, _) = send(&f, "n1", None);
    assert_eq!(frames[0].base_generation, 0);
    assert_eq!(triggers(&frames), vec![at(5), at(6)]);
}

// ---- lag ----

/// A connected node's lag is the time since the oldest publication it lacks; zero once it holds
/// the latest, and for nodes not connected. The summary for metrics is the maximum and a count.
#[test]
fn lag_is_the_time_since_the_oldest_publication_a_node_lacks() {
    use std::time::{Duration, Instant};
    let f = fanout();
    let none = Overlays::new();
    f.set_connected("n1", true, "peer");
    f.set_connected("n2", true, "peer");
    publish(&f, model([1]), &none, 1);
    let v1 = sync(&f, "n1", None);
    let lag = |node: &str| {
        let st = node_state(&f, node);
        f.lag(&st, f.publication().version, Instant::now())
    };
    assert_eq!(lag("n1"), Duration::ZERO, "holds the latest");
    assert!(lag("n2") > Duration::ZERO, "connected, nothing acked yet");

    publish(&f, model([1, 2]), &none, 2);
    std::thread::sleep(Duration::from_millis(30));
    publish(&f, model([1, 2, 3]), &none, 3);
    let l = lag("n1");
    assert!(l >= Duration::from_millis(30), "behind since v2: {l:?}");
    let (max, lagging) = f.lag_summary();
    assert!(max >= l);
    assert_eq!(lagging, 0, "nobody behind for more than the threshold");

    let v3 = sync(&f, "n1", Some(&v1));
    assert_eq!(v3.version, 3);
    assert_eq!(lag("n1"), Duration::ZERO);
    f.set_connected("n2", false, "peer");
    assert_eq!(
        lag("n2"),
        Duration::ZERO,
        "not connected: not this brain's to count"
    );
    assert_eq!(f.lag_summary(), (Duration::ZERO, 0));
}

/// On shutdown the brain waits (bounded) until every connected node holds its latest
/// publication, so that a restarted brain finds its nodes at what it computes; a node that
/// does not ack is waited for only up to the bound, and a disconnected one not at all.
#[tokio::test]
async fn drain_waits_for_connected_nodes_to_hold_the_latest_publication() {
    use std::time::{Duration, Instant};
    let f = fanout();
    let none = Overlays::new();
    f.set_connected("n1", true, "peer");
    f.set_connected("n2", true, "peer");
    publish(&f, model([1]), &none, 1);
    let v1 = sync(&f, "n1", None);
    sync(&f, "n2", None);
    let start = Instant::now();
    f.drain(Duration::ZERO, Duration::from_secs(5)).await;
    assert!(start.elapsed() < Duration::from_millis(500), "both hold v1");

    publish(&f, model([1, 2]), &none, 2);
    let start = Instant::now();
    f.drain(Duration::ZERO, Duration::from_millis(300)).await;
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(300),
        "v2 is not acked: waited the bound, {waited:?}"
    );

    let acker = {
        let f = f.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            sync(&f, "n1", Some(&v1));
            f.set_connected("n2", false, "peer");
        })
    };
    let start = Instant::now();
    f.drain(Duration::ZERO, Duration::from_secs(5)).await;
    let waited = start.elapsed();
    acker.await.unwrap();
    assert!(
        waited >= Duration::from_millis(100) && waited < Duration::from_secs(2),
        "done once n1 acked v2 and n2 left: {waited:?}"
    );
}
