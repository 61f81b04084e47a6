//! The applier's decisions against the [`Recording`] kernel: what each update sends, and that
//! an update the kernel refuses (or that is refused before the kernel is asked) leaves the
//! applier exactly as it was ("atomic", "own table only", "cost follows the change",
//! "restart without disruption", docs/invariants.md). The kernel tests (nft/tests, and the
//! conntrack and guards kernel tests) check that the kernel takes what is sent.

use splitproxy_proto::family::IpFamily;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{
    Chain, Element, Family, Ruleset, RulesetDelta, Set, SetElements, Table, TableRemoval, Update,
    update::Body,
};

use super::kernel::{Kernel, Recording};
use super::*;
use crate::conntrack::tests::{endpoint, endpoints_map};
use crate::guards::tests::{MEMBERS, affinity_map, member, members_set};

const TABLE: &str = "splitproxy";
const ENDPOINTS: &str = "service-endpoints";
const UDP: u32 = 17;

/// `n` UDP endpoints of 10.96.0.10:53, one per slot.
fn endpoints(n: u32) -> Vec<Element> {
    (0..n)
        .map(|slot| {
            let ep = format!("10.244.{}.{}", slot / 250, slot % 250 + 1);
            endpoint("10.96.0.10", UDP, 53, slot, &ep, 5353)
        })
        .collect()
}

fn members() -> Vec<Element> {
    vec![
        member("10.96.0.10", UDP, 53, "10.244.0.1", 5353),
        member("10.96.0.10", UDP, 53, "10.244.0.2", 5353),
    ]
}

/// Table `ip splitproxy`: a chain, an endpoints map marked for conntrack cleanup with `n`
/// elements, and a guarded map with its guard set.
fn ruleset(n: u32) -> Ruleset {
    Ruleset {
        tables: vec![Table {
            family: Family::Ip as i32,
            name: TABLE.to_owned(),
            comment: "managed by splitproxy".to_owned(),
            chains: vec![Chain {
                name: "services".to_owned(),
                ..Chain::default()
            }],
            sets: vec![
                endpoints_map(ENDPOINTS, IpFamily::V4, endpoints(n)),
                affinity_map(IpFamily::V4),
                members_set(IpFamily::V4, members()),
            ],
        }],
    }
}

fn snapshot(brain_epoch: u64, generation: u64, rs: &Ruleset) -> Update {
    Update {
        brain_epoch,
        generation,
        digest: Model::from_ruleset(rs).digest(),
        body: Some(Body::Snapshot(rs.clone())),
        ..Update::default()
    }
}

/// The delta from what `a` applied to its next generation, with the digest it leads to.
fn delta<K: Kernel>(a: &Applier<K>, d: RulesetDelta) -> Update {
    let mut next = a.model().clone();
    next.apply(&d);
    Update {
        brain_epoch: a.applied().brain_epoch,
        base_generation: a.applied().generation,
        generation: a.applied().generation + 1,
        digest: next.digest(),
        body: Some(Body::Delta(d)),
        ..Update::default()
    }
}

/// Removes elements of `set` from table `ip splitproxy`.
fn remove(set: &str, elements: Vec<Element>) -> RulesetDelta {
    RulesetDelta {
        upsert: vec![],
        remove: vec![TableRemoval {
            family: Family::Ip as i32,
            name: TABLE.to_owned(),
            elements: vec![SetElements {
                set: set.to_owned(),
                elements,
            }],
            ..TableRemoval::default()
        }],
    }
}

/// Adds `elements` to `set` (its definition) in table `ip splitproxy`.
fn add(set: Set, elements: Vec<Element>) -> RulesetDelta {
    RulesetDelta {
        upsert: vec![Table {
            family: Family::Ip as i32,
            name: TABLE.to_owned(),
            comment: "managed by splitproxy".to_owned(),
            sets: vec![Set { elements, ..set }],
            ..Table::default()
        }],
        remove: vec![],
    }
}

/// An applier that applied `ruleset(n)` as its first snapshot (epoch 1, generation 1).
fn adopted(n: u32) -> Applier<Recording> {
    let mut a = Applier::new(Recording::new(), TABLE.to_owned());
    a.apply(&snapshot(1, 1, &ruleset(n))).unwrap();
    a
}

/// Everything a refused update must leave as it was.
fn state<K: Kernel>(a: &Applier<K>) -> (Model, Applied, bool) {
    (a.model().clone(), a.applied().clone(), a.adopted)
}

fn stale(o: &Outcome) -> Vec<crate::conntrack::Stale> {
    o.conntrack.iter().copied().collect()
}

#[test]
fn the_first_snapshot_replaces_the_tables_in_one_batch() {
    let mut a = Applier::new(Recording::new(), TABLE.to_owned());
    let rs = ruleset(3);
    let outcome = a.apply(&snapshot(4, 1, &rs)).unwrap();

    let sent = a.kernel().committed();
    assert_eq!(sent.len(), 1, "one transaction");
    let m = &sent[0].messages;
    // Whatever a previous run left goes in the same transaction that adds the new tables.
    assert_eq!(m[0], "destroy table ip splitproxy");
    assert_eq!(m[1], "destroy table ip6 splitproxy");
    assert_eq!(m[2], "add table ip splitproxy");
    assert!(m.contains(&"add chain services".to_owned()), "{m:?}");
    for set in [ENDPOINTS, "affinity", MEMBERS] {
        assert!(m.contains(&format!("add set {set}")), "{m:?}");
    }
    assert!(
        m.contains(&format!(
            "add elements to set {ENDPOINTS} (elements 0..=2 of the call)"
        )),
        "{m:?}"
    );
    assert_eq!(
        a.applied(),
        &Applied {
            brain_epoch: 4,
            generation: 1,
            digest: Model::from_ruleset(&rs).digest(),
            resource_versions: vec![],
        }
    );
    assert_eq!(a.model(), &Model::from_ruleset(&rs));
    // No model to compare with: conntrack resyncs from the new one, no guard is judged.
    assert!(outcome.conntrack.resyncs() && stale(&outcome).is_empty());
    assert!(outcome.guards.is_empty());
    assert_eq!(outcome.model, Model::from_ruleset(&rs));
}

/// `ruleset(n)` with the `services` chain dispatching to the endpoints map, as the brain's
/// DNAT rules do (a lookup into a map: the kernel checks the map's elements when it binds it).
fn dispatching(n: u32) -> Ruleset {
    let mut rs = ruleset(n);
    let t = &mut rs.tables[0];
    t.chains[0].rules = vec![crate::nft::tests::fixture::dnat_rule(2)];
    t.sets.push(Set {
        name: "service-ports-2".to_owned(),
        key: t.sets[0].key[..3].to_vec(),
        ..Set::default()
    });
    rs
}

/// Whether every rule of `messages` comes before every element added.
fn rules_before_elements(messages: &[String]) -> bool {
    let last_rule = messages.iter().rposition(|m| m.starts_with("add rule"));
    let first_elements = messages.iter().position(|m| m.starts_with("add elements"));
    matches!((last_rule, first_elements), (Some(r), Some(e)) if r < e)
}

/// A rule that binds a map makes the kernel check every element the map holds by then: rules
/// go first, so that a first commit's maps are empty when they are bound (half its kernel time
/// at 10,000 Services otherwise).
#[test]
fn rules_are_added_before_the_elements_of_the_maps_they_bind() {
    let mut a = Applier::new(Recording::new(), TABLE.to_owned());
    a.apply(&snapshot(1, 1, &dispatching(3))).unwrap();
    let first = &a.kernel().committed()[0].messages;
    assert!(first[0].starts_with("destroy table"), "{first:?}");
    assert!(rules_before_elements(first), "{first:?}");

    // A later snapshot that brings the chain's rule back with new elements (diffed, not a
    // replacement) keeps the same order.
    a.apply(&snapshot(1, 2, &ruleset(3))).unwrap();
    a.apply(&snapshot(1, 3, &dispatching(5))).unwrap();
    let later = &a.kernel().committed()[2].messages;
    assert!(!later[0].starts_with("destroy table"), "{later:?}");
    assert!(rules_before_elements(later), "{later:?}");
    assert_eq!(a.model(), &Model::from_ruleset(&dispatching(5)));
}

#[test]
fn a_later_snapshot_sends_only_the_difference() {
    let mut a = adopted(3);
    let mut rs = ruleset(3);
    // Endpoint slot 1 leaves; a guard element leaves.
    rs.tables[0].sets[0].elements.remove(1);
    rs.tables[0].sets[2].elements.remove(0);
    let outcome = a.apply(&snapshot(1, 2, &rs)).unwrap();

    let sent = a.kernel().committed();
    assert_eq!(sent.len(), 2);
    let mut m = sent[1].messages.clone();
    m.sort();
    assert_eq!(
        m,
        vec![
            format!("delete elements from set {MEMBERS} (elements 0..=0 of the call)"),
            format!("delete elements from set {ENDPOINTS} (elements 0..=0 of the call)"),
        ]
    );
    assert_eq!(a.model(), &Model::from_ruleset(&rs));
    assert_eq!(a.applied().generation, 2);
    assert!(!outcome.conntrack.resyncs());
    assert_eq!(stale(&outcome).len(), 1, "{:?}", outcome.conntrack);
    assert_eq!(outcome.guards.len(), 1);

    // The same state again: nothing to send, and the generation still moves.
    let outcome = a.apply(&snapshot(1, 3, &rs)).unwrap();
    assert_eq!(
        a.kernel().committed().len(),
        2,
        "an empty batch is not sent"
    );
    assert_eq!(a.applied().generation, 3);
    assert!(outcome.conntrack.is_empty() && outcome.guards.is_empty());
}

#[test]
fn a_one_element_delta_sends_one_small_message() {
    let mut a = adopted(1000);
    let first = a.kernel().committed()[0].clone();

    let d = delta(
        &a,
        add(
            members_set(IpFamily::V4, vec![]),
            vec![member("10.96.0.10", UDP, 53, "10.244.0.3", 5353)],
        ),
    );
    a.apply(&d).unwrap();
    let sent = a.kernel().last().unwrap();
    assert_eq!(
        sent.messages,
        vec![format!(
            "add elements to set {MEMBERS} (elements 0..=0 of the call)"
        )]
    );
    assert!(
        sent.bytes * 100 < first.bytes,
        "{} bytes for one element, {} for the table",
        sent.bytes,
        first.bytes
    );

    let d = delta(&a, remove(ENDPOINTS, vec![endpoints(1000).remove(500)]));
    let outcome = a.apply(&d).unwrap();
    let sent = a.kernel().last().unwrap();
    assert_eq!(
        sent.messages,
        vec![format!(
            "delete elements from set {ENDPOINTS} (elements 0..=0 of the call)"
        )]
    );
    assert!(sent.bytes * 100 < first.bytes);
    assert_eq!(stale(&outcome).len(), 1);
    assert_eq!(a.applied().generation, 3);
    assert_eq!(a.model().element_count(), 1000 - 1 + 3);
}

#[test]
fn a_refused_update_leaves_everything_as_it_was() {
    let mut a = adopted(3);
    let mut twin = adopted(3);
    let before = state(&a);
    let committed = a.kernel().committed().len();

    // The kernel refuses the removal of endpoint 1 and guard element 0.
    let mut refused = remove(ENDPOINTS, vec![endpoints(3).remove(1)]);
    refused.remove[0].elements.push(SetElements {
        set: MEMBERS.to_owned(),
        elements: vec![members().remove(0)],
    });
    let d = delta(&a, refused);
    a.kernel_mut().refuse_next(2, "No such file or directory");
    let err = a.apply(&d).unwrap_err();
    assert!(
        matches!(err, ApplyError::Kernel(CommitError::Rejected { .. })),
        "{err:?}"
    );
    assert_eq!(err.errno(), Some(2));
    let failure = err.refused().unwrap();
    assert!(
        failure.description.starts_with("delete elements from set"),
        "{failure:?}"
    );
    assert_eq!(
        failure.kernel_message.as_deref(),
        Some("No such file or directory")
    );
    assert_eq!(
        state(&a),
        before,
        "model, applied version and adoption unchanged"
    );
    assert_eq!(a.kernel().committed().len(), committed);
    assert_eq!(a.kernel().refused().len(), 1);

    // The next update still applies on the same base, and what it leaves for after the
    // commit is what it leaves on an applier that never saw the refused one.
    let next = remove(ENDPOINTS, vec![endpoints(3).remove(2)]);
    let mine = a.apply(&delta(&a, next.clone())).unwrap();
    let theirs = twin.apply(&delta(&twin, next)).unwrap();
    assert_eq!(stale(&mine), stale(&theirs));
    assert_eq!(stale(&mine).len(), 1);
    assert_eq!(mine.conntrack.resyncs(), theirs.conntrack.resyncs());
    assert_eq!(mine.guards, theirs.guards);
    assert!(
        mine.guards.is_empty(),
        "the refused guard removal is not carried over"
    );
    assert_eq!(mine.model, theirs.model);
    assert_eq!(a.applied(), twin.applied());
    assert_eq!(a.kernel().committed(), twin.kernel().committed());
}

#[test]
fn a_refused_first_snapshot_is_adopted_again_by_the_next() {
    let mut a = Applier::new(Recording::new(), TABLE.to_owned());
    a.kernel_mut().refuse_next_at(1, 12, "");
    let err = a.apply(&snapshot(1, 1, &ruleset(2))).unwrap_err();
    let failure = err.refused().unwrap();
    assert_eq!((failure.errno, failure.message), (12, Some(1)));
    assert_eq!(failure.description, "destroy table ip6 splitproxy");
    assert_eq!(failure.kernel_message, None);
    assert_eq!(state(&a), (Model::default(), Applied::default(), false));

    let outcome = a.apply(&snapshot(1, 2, &ruleset(2))).unwrap();
    let m = &a.kernel().committed()[0].messages;
    assert_eq!(
        m[0], "destroy table ip splitproxy",
        "still replaces what a previous run left"
    );
    assert!(outcome.conntrack.resyncs());
}

#[test]
fn a_delta_on_another_generation_or_epoch_is_refused() {
    let mut a = adopted(3);
    let before = state(&a);
    let good = delta(&a, remove(ENDPOINTS, vec![endpoints(3).remove(0)]));
    for wrong in [
        Update {
            base_generation: 0,
            ..good.clone()
        },
        Update {
            base_generation: 2,
            ..good.clone()
        },
        Update {
            brain_epoch: 2,
            ..good.clone()
        },
    ] {
        let err = a.apply(&wrong).unwrap_err();
        assert!(
            matches!(
                err,
                ApplyError::WrongBase {
                    applied: 1,
                    applied_epoch: 1,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(state(&a), before);
    }
    assert_eq!(a.kernel().committed().len(), 1, "nothing sent");
    a.apply(&good).unwrap();
    assert_eq!(a.applied().generation, 2);
}

// ---- restating deltas: resumed by API state, applied to whatever the node holds ----

/// A restating delta (another replica's node resumed by API state) taking what it applies to
/// to `target`: epoch 9, no base named, the digest of `target`.
fn restating(d: RulesetDelta, target: &Model) -> Update {
    Update {
        brain_epoch: 9,
        generation: 5,
        base_generation: 0,
        base_digest: Vec::new(),
        restating: true,
        resource_versions: vec![10, 20, 30, 40],
        digest: target.digest(),
        body: Some(Body::Delta(d)),
        ..Update::default()
    }
}

/// Restates endpoint slots 2 and 3 and adds a member: from the brain's notional base
/// `ruleset(2)`, or from `ruleset(3)` (within the window), it reaches the same target.
fn restating_delta() -> (RulesetDelta, Model) {
    let new_member = member("10.96.0.10", UDP, 53, "10.244.0.3", 5353);
    let mut d = add(
        endpoints_map(ENDPOINTS, IpFamily::V4, vec![]),
        endpoints(4)[2..].to_vec(),
    );
    d.upsert[0].sets.push(Set {
        elements: vec![new_member],
        ..members_set(IpFamily::V4, vec![])
    });
    let mut target = Model::from_ruleset(&ruleset(2));
    target.apply(&d);
    (d, target)
}

#[test]
fn a_restating_delta_applies_to_what_the_node_holds_when_it_reaches_the_digest() {
    let (d, target) = restating_delta();
    // The node holds ruleset(3), not the brain's notional base ruleset(2).
    let mut a = adopted(3);
    assert_ne!(
        a.model().digest(),
        Model::from_ruleset(&ruleset(2)).digest()
    );
    let update = restating(d, &target);
    a.apply(&update).unwrap();

    assert_eq!(a.model(), &target);
    assert_eq!(
        a.applied(),
        &Applied {
            brain_epoch: 9,
            generation: 5,
            digest: target.digest(),
            resource_versions: vec![10, 20, 30, 40],
        },
        "the node now stands on the new brain's generations"
    );
    // The kernel got the difference of the models, not the delta as sent: slot 2, which the
    // node held with the same value, is not sent again.
    let sent = a.kernel().committed();
    assert_eq!(sent.len(), 2);
    let mut m = sent[1].messages.clone();
    m.sort();
    assert_eq!(
        m,
        vec![
            format!("add elements to set {MEMBERS} (elements 0..=0 of the call)"),
            format!("add elements to set {ENDPOINTS} (elements 0..=0 of the call)"),
        ]
    );
    // The same batch as a delta by generation carrying that difference.
    let mut twin = adopted(3);
    twin.apply(&delta(&twin, twin.model().diff(&target)))
        .unwrap();
    assert_eq!(
        twin.kernel().last().unwrap().messages,
        sent[1].messages,
        "the batch is the model diff"
    );

    // The next delta names its base by the new generation again.
    let next = delta(&a, remove(ENDPOINTS, vec![endpoints(4).remove(3)]));
    assert_eq!((next.brain_epoch, next.base_generation), (9, 5));
    a.apply(&next).unwrap();
    assert_eq!(a.applied().generation, 6);
}

#[test]
fn a_restating_delta_that_misses_the_digest_is_refused_with_nothing_sent() {
    // Removes endpoint slot 0: from ruleset(2) (the digest's base), not from ruleset(3).
    let d = remove(ENDPOINTS, vec![endpoints(3).remove(0)]);
    let mut target = Model::from_ruleset(&ruleset(2));
    target.apply(&d);
    let mut a = adopted(3);
    let before = state(&a);
    for update in [
        restating(d.clone(), &target),
        // No digest: nothing would prove what it leads to.
        Update {
            digest: Vec::new(),
            ..restating(d.clone(), &target)
        },
    ] {
        let err = a.apply(&update).unwrap_err();
        assert!(
            matches!(
                err,
                ApplyError::Restating {
                    applied_epoch: 1,
                    applied: 1
                }
            ),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("restating delta does not reach the brain's digest"),
            "{err}"
        );
        assert_eq!(state(&a), before, "model and applied version unchanged");
        assert_eq!(a.kernel().committed().len(), 1, "nothing sent");
        assert!(a.kernel().refused().is_empty());
        assert!(!a.replaces_next_snapshot(), "the kernel was not asked");
    }
    // The brain's snapshot follows, diffed against the untouched model.
    a.apply(&snapshot(9, 6, &ruleset(2))).unwrap();
    assert_eq!(a.model(), &Model::from_ruleset(&ruleset(2)));
}

#[test]
fn a_delta_naming_no_base_is_refused_unless_it_is_restating() {
    let (d, target) = restating_delta();
    let mut a = adopted(3);
    let before = state(&a);
    for wrong in [
        // Neither generation nor digest nor restating: no base at all.
        Update {
            restating: false,
            ..restating(d.clone(), &target)
        },
        // Restating only when no base is named: a wrong base digest is still a wrong base.
        Update {
            base_digest: vec![0; 16],
            ..restating(d.clone(), &target)
        },
        // And a base generation is checked as always.
        Update {
            base_generation: 4,
            ..restating(d.clone(), &target)
        },
    ] {
        let err = a.apply(&wrong).unwrap_err();
        assert!(matches!(err, ApplyError::WrongBase { .. }), "{err:?}");
        assert_eq!(state(&a), before);
    }
    assert_eq!(a.kernel().committed().len(), 1, "nothing sent");
}

#[test]
fn applied_resource_versions_follow_the_last_committed_update() {
    let mut a = Applier::new(Recording::new(), TABLE.to_owned());
    assert!(a.applied().resource_versions.is_empty());
    a.apply(&Update {
        resource_versions: vec![1, 2, 3, 4],
        ..snapshot(1, 1, &ruleset(3))
    })
    .unwrap();
    assert_eq!(a.applied().resource_versions, vec![1, 2, 3, 4]);

    let d = delta(&a, remove(ENDPOINTS, vec![endpoints(3).remove(2)]));
    a.apply(&Update {
        resource_versions: vec![1, 5, 3, 4],
        ..d
    })
    .unwrap();
    assert_eq!(a.applied().resource_versions, vec![1, 5, 3, 4]);

    // A refused update leaves them as they were.
    let d = delta(&a, remove(ENDPOINTS, vec![endpoints(3).remove(1)]));
    let refused = Update {
        resource_versions: vec![9, 9, 9, 9],
        digest: vec![0; 16],
        ..d.clone()
    };
    assert!(a.apply(&refused).is_err());
    assert_eq!(a.applied().resource_versions, vec![1, 5, 3, 4]);
    a.kernel_mut().refuse_next(2, "No such file or directory");
    assert!(
        a.apply(&Update {
            resource_versions: vec![9, 9, 9, 9],
            ..d
        })
        .is_err()
    );
    assert_eq!(a.applied().resource_versions, vec![1, 5, 3, 4]);

    // A restating delta's, and a snapshot folded from parts (metadata apart from the model).
    let (d, target) = restating_delta();
    let mut b = adopted(3);
    b.apply(&restating(d, &target)).unwrap();
    assert_eq!(b.applied().resource_versions, vec![10, 20, 30, 40]);
    let rs = ruleset(2);
    let meta = Update {
        body: None,
        resource_versions: vec![11, 21, 31, 41],
        ..snapshot(9, 6, &rs)
    };
    b.apply_snapshot(&meta, Model::from_ruleset(&rs)).unwrap();
    assert_eq!(b.applied().resource_versions, vec![11, 21, 31, 41]);
    // An update from a brain that does not send them: unknown again, not the old ones.
    b.apply(&snapshot(9, 7, &rs)).unwrap();
    assert!(b.applied().resource_versions.is_empty());
}

#[test]
fn foreign_tables_are_refused_before_anything_is_sent() {
    let renamed = |family: Family, name: &str| {
        let mut rs = ruleset(1);
        rs.tables[0].family = family as i32;
        rs.tables[0].name = name.to_owned();
        rs
    };
    // The first snapshot, and a later one.
    for mut a in [Applier::new(Recording::new(), TABLE.to_owned()), adopted(1)] {
        let before = state(&a);
        let sent = a.kernel().committed().len();
        for rs in [
            renamed(Family::Ip, "kube-proxy"),
            renamed(Family::Ip6, "other"),
            renamed(Family::Inet, TABLE),
        ] {
            let err = a.apply(&snapshot(1, 2, &rs)).unwrap_err();
            assert!(matches!(err, ApplyError::ForeignTable(..)), "{err:?}");
            assert_eq!(state(&a), before);
        }
        assert_eq!(a.kernel().committed().len(), sent);
    }

    let mut a = adopted(1);
    let before = state(&a);
    let mut upsert = add(members_set(IpFamily::V4, vec![]), members());
    upsert.upsert[0].name = "nat".to_owned();
    let mut removal = remove(ENDPOINTS, endpoints(1));
    removal.remove[0].family = Family::Inet as i32;
    for d in [upsert, removal] {
        let err = a.apply(&delta(&a, d)).unwrap_err();
        assert!(matches!(err, ApplyError::ForeignTable(..)), "{err:?}");
        assert_eq!(state(&a), before);
    }
    assert_eq!(a.kernel().committed().len(), 1);
}

#[test]
fn a_digest_mismatch_commits_nothing() {
    let mut a = Applier::new(Recording::new(), TABLE.to_owned());
    let wrong = Update {
        digest: vec![0; 32],
        ..snapshot(1, 1, &ruleset(2))
    };
    assert!(matches!(a.apply(&wrong), Err(ApplyError::Digest)));
    assert!(a.kernel().committed().is_empty());
    assert_eq!(state(&a), (Model::default(), Applied::default(), false));

    let mut a = adopted(2);
    let before = state(&a);
    let d = Update {
        digest: vec![0; 32],
        ..delta(&a, remove(ENDPOINTS, endpoints(1)))
    };
    assert!(matches!(a.apply(&d), Err(ApplyError::Digest)));
    assert_eq!(a.kernel().committed().len(), 1);
    assert_eq!(state(&a), before);
}

#[test]
fn an_object_the_kernel_cannot_be_told_about_sends_nothing() {
    let mut a = adopted(1);
    let before = state(&a);
    // A set without a key type cannot be encoded.
    let d = delta(
        &a,
        add(
            Set {
                name: "broken".to_owned(),
                ..Set::default()
            },
            vec![],
        ),
    );
    let err = a.apply(&d).unwrap_err();
    assert!(matches!(err, ApplyError::Encode(_)), "{err:?}");
    assert_eq!(err.errno(), None);
    assert!(err.refused().is_none());
    assert_eq!(state(&a), before);
    assert_eq!(a.kernel().committed().len(), 1);
    assert!(a.kernel().refused().is_empty());
}

// ---- kernel is the truth: a NACK never loops, drift is repaired, tables are adopted ----

use super::reconcile::{Drift, Reconciled};

/// The model of `ruleset(n)` without the endpoint of slot `slot`.
fn without_endpoint(n: u32, slot: u32) -> Model {
    let mut m = Model::from_ruleset(&ruleset(n));
    m.apply(&remove(
        ENDPOINTS,
        vec![endpoints(n)[slot as usize].clone()],
    ));
    m
}

#[test]
fn after_a_refusal_the_next_snapshot_replaces_the_tables() {
    let mut a = adopted(3);
    assert!(!a.replaces_next_snapshot());
    // The kernel lost an element behind the model's back: deleting it is refused (ENOENT).
    a.kernel_mut().refuse_next(2, "No such file or directory");
    let d = delta(&a, remove(ENDPOINTS, vec![endpoints(3)[2].clone()]));
    let err = a.apply(&d).unwrap_err();
    assert_eq!(err.errno(), Some(2));
    assert!(
        a.replaces_next_snapshot(),
        "the model may not be the kernel's"
    );

    // The brain's recovery snapshot (same content as the refused delta's target) is not
    // diffed against the stale model: it replaces the tables in one transaction.
    let before = a.kernel().committed().len();
    a.apply(&snapshot(1, 3, &ruleset(2))).unwrap();
    let sent = &a.kernel().committed()[before..];
    assert_eq!(sent.len(), 1, "one transaction");
    assert_eq!(sent[0].messages[0], "destroy table ip splitproxy");
    assert_eq!(sent[0].messages[1], "destroy table ip6 splitproxy");
    assert!(!a.replaces_next_snapshot());
    assert_eq!(a.model(), &Model::from_ruleset(&ruleset(2)));

    // From then on, snapshots are diffed again.
    let before = a.kernel().committed().len();
    a.apply(&snapshot(1, 4, &ruleset(3))).unwrap();
    let sent = &a.kernel().committed()[before..];
    assert!(
        sent[0]
            .messages
            .iter()
            .all(|m| !m.starts_with("destroy table")),
        "{:?}",
        sent[0].messages
    );
}

#[test]
fn after_a_commit_of_unknown_outcome_the_next_snapshot_replaces_the_tables() {
    let mut a = adopted(3);
    let before = state(&a);
    a.kernel_mut().lose_acks_next();
    let d = delta(&a, remove(ENDPOINTS, vec![endpoints(3)[2].clone()]));
    assert!(matches!(
        a.apply(&d),
        Err(ApplyError::Kernel(CommitError::AcksLost { .. }))
    ));
    // The model stays (the kernel may or may not have taken the batch) ...
    assert_eq!(state(&a), before);
    // ... and is not trusted for the next snapshot.
    assert!(a.replaces_next_snapshot());
    let n = a.kernel().committed().len();
    a.apply(&snapshot(1, 3, &ruleset(2))).unwrap();
    assert_eq!(
        a.kernel().committed()[n].messages[0],
        "destroy table ip splitproxy"
    );
}

#[test]
fn a_refusal_that_says_the_kernel_disagrees_wakes_the_reconciler() {
    let wake = std::sync::Arc::new(tokio::sync::Notify::new());
    let mut a = Applier::new(Recording::new(), TABLE.to_owned()).with_reconcile_wake(wake.clone());
    a.apply(&snapshot(1, 1, &ruleset(3))).unwrap();
    a.kernel_mut().hold(Model::from_ruleset(&ruleset(3)));
    a.kernel_mut().refuse_next(17, "File exists");
    let d = delta(
        &a,
        add(endpoints_map(ENDPOINTS, IpFamily::V4, vec![]), endpoints(4)),
    );
    assert!(a.apply(&d).is_err());
    // Woken: the permit is stored even though nobody waits yet.
    let woken = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(async {
            tokio::time::timeout(std::time::Duration::from_millis(100), wake.notified())
                .await
                .is_ok()
        });
    assert!(woken);
    // The generation did not move (the refused batch changed nothing), yet the tables are read.
    assert!(matches!(a.reconcile().unwrap(), Reconciled::Clean { .. }));
    assert_eq!(a.kernel().reads(), 1);
    // The kernel equals the model: the next snapshot is diffed again.
    assert!(!a.replaces_next_snapshot());
    // Nothing committed since: the next check reads nothing.
    assert_eq!(a.reconcile().unwrap(), Reconciled::Unchanged);
    assert_eq!(a.kernel().reads(), 1);
}

#[test]
fn reconciliation_reads_only_when_the_generation_moved_and_repairs_in_one_batch() {
    let mut a = Applier::new(Recording::new(), TABLE.to_owned());
    assert_eq!(a.reconcile().unwrap(), Reconciled::NoModel);
    a.apply(&snapshot(1, 1, &ruleset(3))).unwrap();
    a.kernel_mut().hold(Model::from_ruleset(&ruleset(3)));
    assert_eq!(a.reconcile().unwrap(), Reconciled::Unchanged);
    assert_eq!(a.kernel().reads(), 0);

    // Someone commits without changing the owned tables: read, found clean.
    a.kernel_mut().tamper(Model::from_ruleset(&ruleset(3)));
    assert!(matches!(a.reconcile().unwrap(), Reconciled::Clean { .. }));
    assert_eq!(a.reconcile().unwrap(), Reconciled::Unchanged);

    // Someone deletes an endpoint: repaired by one transaction that replaces the tables.
    let (model, applied) = (a.model().clone(), a.applied().clone());
    a.kernel_mut().tamper(without_endpoint(3, 1));
    let before = a.kernel().committed().len();
    let Reconciled::Repaired { drift, .. } = a.reconcile().unwrap() else {
        panic!("not repaired")
    };
    assert_eq!(drift.missing_elements, 1, "{drift}");
    assert_eq!(drift.kinds(), vec!["element"]);
    let sent = &a.kernel().committed()[before..];
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].messages[0], "destroy table ip splitproxy");
    assert!(
        sent[0]
            .messages
            .contains(&"add table ip splitproxy".to_owned())
    );
    // The model and what the brain was told do not move.
    assert_eq!((a.model(), a.applied()), (&model, &applied));
    a.kernel_mut().hold(model.clone());
    assert_eq!(a.reconcile().unwrap(), Reconciled::Unchanged);

    // The whole table deleted.
    a.kernel_mut().tamper(Model::default());
    let Reconciled::Repaired { drift, .. } = a.reconcile().unwrap() else {
        panic!("not repaired")
    };
    assert_eq!(drift.missing_tables, vec!["ip splitproxy".to_owned()]);
    a.kernel_mut().hold(model.clone());

    // Something the reader cannot decode (a set `nft` made).
    a.kernel_mut()
        .tamper_undecodable("rogue: no splitproxy userdata");
    let Reconciled::Repaired { drift, .. } = a.reconcile().unwrap() else {
        panic!("not repaired")
    };
    assert_eq!(drift.kinds(), vec!["undecodable"]);

    // A repair the kernel refuses is an error, and the next snapshot replaces the tables.
    a.kernel_mut().tamper(without_endpoint(3, 0));
    a.kernel_mut().refuse_next(12, "Cannot allocate memory");
    assert!(a.reconcile().is_err());
    assert!(a.replaces_next_snapshot());
}

#[test]
fn drift_names_what_is_missing_and_what_is_rogue() {
    let model = Model::from_ruleset(&ruleset(3));
    assert!(Drift::between(&model, &model).is_empty());

    let mut rogue = model.clone();
    rogue.apply(&add(
        endpoints_map(ENDPOINTS, IpFamily::V4, vec![]),
        vec![endpoint("10.96.0.99", UDP, 53, 0, "10.244.9.9", 53)],
    ));
    let d = Drift::between(&model, &rogue);
    assert_eq!((d.rogue_elements, d.missing_elements), (1, 0), "{d}");

    // A flushed map: every element missing.
    let mut flushed = model.clone();
    flushed.apply(&remove(ENDPOINTS, endpoints(3)));
    let d = Drift::between(&model, &flushed);
    assert_eq!(d.missing_elements, 3, "{d}");
    assert_eq!(d.to_string(), "missing elements: 3");

    // A set gone.
    let mut no_set = model.clone();
    no_set.remove_set(&(Family::Ip, TABLE.to_owned()), MEMBERS);
    let d = Drift::between(&model, &no_set);
    assert_eq!((d.missing_sets, d.kinds()), (1, vec!["set"]), "{d}");

    // A table that should not be there.
    let d = Drift::between(&Model::default(), &model);
    assert_eq!(d.rogue_tables, vec!["ip splitproxy".to_owned()]);
}

#[test]
fn adoption_takes_the_kernels_tables_as_the_applied_model() {
    let mut a = Applier::new(Recording::new(), TABLE.to_owned());
    // No table: nothing adopted, the first snapshot replaces as before.
    assert!(a.adopt().unwrap().is_none());
    assert!(a.replaces_next_snapshot());

    let held = Model::from_ruleset(&ruleset(3));
    a.kernel_mut().hold(held.clone());
    let outcome = a.adopt().unwrap().unwrap();
    assert_eq!(outcome.model, held);
    assert!(
        outcome.conntrack.resyncs(),
        "endpoints may have gone meanwhile"
    );
    assert_eq!(
        a.applied(),
        &Applied {
            brain_epoch: 0,
            generation: 0,
            digest: held.digest(),
            resource_versions: vec![],
        }
    );
    // The brain's snapshot of the same state costs nothing; of another, the difference.
    a.apply(&snapshot(1, 1, &ruleset(3))).unwrap();
    assert!(a.kernel().committed().is_empty());
    a.apply(&snapshot(1, 2, &ruleset(2))).unwrap();
    let m = &a.kernel().committed()[0].messages;
    assert!(m.iter().all(|m| !m.starts_with("destroy table")), "{m:?}");

    // Tables it cannot read back are not adopted.
    let mut b = Applier::new(Recording::new(), TABLE.to_owned());
    b.kernel_mut().tamper_undecodable("rogue");
    assert!(b.adopt().is_err());
    assert!(b.replaces_next_snapshot());
}
