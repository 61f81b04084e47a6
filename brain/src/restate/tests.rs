//! Restating deltas take any state a node can hold inside a window to the latest one, whatever
//! batches another replica folded the same changes in, and a state outside the window does not
//! reach the brain's digest (so the node refuses it).
use prost::Message;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use splitproxy_proto::model::{Model, TableKey, element_key_bytes};
use splitproxy_proto::v1::{
    Chain, DataType, Datum, Element, Family, Rule, RulesetDelta, Set, Table, datum,
};

use super::{Touched, own, shared};

fn table() -> TableKey {
    (Family::Ip, "splitproxy".to_string())
}

fn element(key: u32, value: u32) -> Element {
    let d = |v| Datum {
        value: Some(datum::Value::U32(v)),
    };
    Element {
        key: vec![d(key)],
        data: vec![d(value)],
        ..Element::default()
    }
}

fn set_def(name: &str, comment: &str) -> Set {
    Set {
        name: name.into(),
        key: vec![DataType::Integer as i32],
        data: vec![DataType::Integer as i32],
        comment: comment.into(),
        ..Set::default()
    }
}

/// One change, as an event folded into the shared model and a node's overlay makes it.
#[derive(Debug, Clone)]
enum Change {
    /// Shared element `key` of set `set` set to `value`.
    Put(usize, u32, u32),
    Remove(usize, u32),
    /// The node's own element (in set 0).
    Own(u32, Option<u32>),
    /// Chain `n` gets a rule with this comment, or goes.
    Chain(u32, Option<u32>),
    /// Set `set` redefined (its comment), which empties it.
    Redefine(usize, u32),
}

const SETS: [&str; 3] = ["a", "b", "c"];

/// The shared model and one node's overlay.
#[derive(Clone)]
struct State {
    shared: Model,
    overlay: Model,
}

impl State {
    fn new() -> Self {
        let mut shared = Model::default();
        shared.upsert_table(&table(), "splitproxy");
        for s in SETS {
            shared.upsert_set(&table(), &set_def(s, "v0"));
        }
        let mut overlay = Model::default();
        overlay.upsert_table(&table(), "splitproxy");
        overlay.upsert_set(&table(), &set_def("a", "v0"));
        State { shared, overlay }
    }

    fn digest(&self) -> Vec<u8> {
        self.shared.digest_with(&self.overlay)
    }

    fn apply(&mut self, c: &Change) {
        let t = table();
        match c {
            Change::Put(s, k, v) => {
                // Keys are the shared model's or the node's, never both (own keys are >= 1000).
                let e = element(*k, *v);
                self.shared.insert_element(
                    &t,
                    SETS[*s],
                    element_key_bytes(&e),
                    e.encode_to_vec().into(),
                );
            }
            Change::Remove(s, k) => {
                self.shared
                    .remove_element(&t, SETS[*s], &element_key_bytes(&element(*k, 0)))
            }
            Change::Own(k, v) => match v {
                Some(v) => {
                    let e = element(*k, *v);
                    self.overlay.insert_element(
                        &t,
                        "a",
                        element_key_bytes(&e),
                        e.encode_to_vec().into(),
                    );
                }
                None => self
                    .overlay
                    .remove_element(&t, "a", &element_key_bytes(&element(*k, 0))),
            },
            Change::Chain(n, rule) => match rule {
                Some(r) => self.shared.upsert_chain(
                    &t,
                    Chain {
                        name: format!("chain-{n}"),
                        rules: vec![Rule {
                            comment: format!("rule {r}"),
                            ..Rule::default()
                        }],
                        ..Chain::default()
                    },
                ),
                None => self.shared.remove_chain(&t, &format!("chain-{n}")),
            },
            Change::Redefine(s, v) => {
                let def = set_def(SETS[*s], &format!("v{v}"));
                self.shared.upsert_set(&t, &def);
                if *s == 0 {
                    // The overlay holds elements in the shared set: a redefinition empties
                    // them on the node, and the overlay follows the shared definition.
                    self.overlay.upsert_set(&t, &def);
                }
            }
        }
    }
}

/// A change among many objects, as churn across a cluster is: the same object seldom changes
/// twice within a batch. Set "c" is seldom filled, so that its redefinitions seldom meet an
/// element change in the same batch.
fn random_change(rng: &mut StdRng) -> Change {
    let set = |rng: &mut StdRng| {
        if rng.random_bool(0.03) {
            2
        } else {
            rng.random_range(0..2)
        }
    };
    match rng.random_range(0..80) {
        0..=31 => Change::Put(set(rng), rng.random_range(0..900), rng.random_range(0..4)),
        32..=47 => Change::Remove(set(rng), rng.random_range(0..900)),
        48..=63 => Change::Own(
            1000 + rng.random_range(0..400),
            rng.random_bool(0.6).then(|| rng.random_range(0..4)),
        ),
        64..=78 => Change::Chain(
            rng.random_range(0..300),
            rng.random_bool(0.7).then(|| rng.random_range(0..4)),
        ),
        _ => Change::Redefine(
            if rng.random_bool(0.95) {
                2
            } else {
                rng.random_range(0..2)
            },
            rng.random_range(0..3),
        ),
    }
}

/// The delta a node in the window from `published[start]` gets: both parts, joined as the
/// actuator joins them.
fn restating(published: &[State], start: usize) -> RulesetDelta {
    let (mut shared_touched, mut own_touched) = (Touched::default(), Touched::default());
    for w in published[start..].windows(2) {
        shared_touched.shared_step(&w[0].shared, &w[1].shared);
        own_touched.overlay_step(&w[0].overlay, &w[1].overlay);
    }
    let latest = published.last().unwrap();
    let a = shared(&latest.shared, &shared_touched);
    let b = own(&latest.overlay, &own_touched, &shared_touched);
    RulesetDelta {
        upsert: a.upsert.into_iter().chain(b.upsert).collect(),
        remove: a.remove.into_iter().chain(b.remove).collect(),
    }
}

/// The node's whole table: the shared model and its overlay as one model.
fn whole(s: &State) -> Model {
    let mut m = s.shared.clone();
    m.apply(&Model::default().diff(&s.overlay));
    m
}

/// The objects a change touches, so that a batch with two changes of one object is found.
/// An element and its set's redefinition collide; two elements of one set do not.
fn changes_an_object_twice(batch: &[Change]) -> bool {
    let mut elements = std::collections::HashSet::new();
    let mut redefined = std::collections::HashSet::new();
    let mut filled = std::collections::HashSet::new();
    let mut chains = std::collections::HashSet::new();
    for c in batch {
        let twice = match c {
            Change::Put(s, k, _) | Change::Remove(s, k) => {
                filled.insert(*s);
                !elements.insert((*s, *k)) || redefined.contains(s)
            }
            Change::Own(k, _) => {
                filled.insert(0);
                !elements.insert((0, *k)) || redefined.contains(&0)
            }
            Change::Chain(n, _) => !chains.insert(*n),
            Change::Redefine(s, _) => !redefined.insert(*s) || filled.contains(s),
        };
        if twice {
            return true;
        }
    }
    false
}

/// One replica folds a run of changes in batches of its own; another in others. A node that
/// held any state the other published, reaching this one, is restated from the newest of this
/// one's publications that folded no more changes than the node's, and lands exactly on this
/// one's latest state, as long as no batch of this one changed an object twice (what a brain
/// under churn of many objects folds in a fraction of a second). When one did, the node may
/// hold a value this brain never published: the delta then misses the digest (the node
/// refuses it), and is never a wrong state with the right digest.
#[test]
fn any_batching_inside_the_window_reaches_the_latest_state() {
    let (mut exact, mut refused) = (0, 0);
    for seed in 0..600u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let changes: Vec<Change> = (0..60).map(|_| random_change(&mut rng)).collect();
        // This replica's publications: after each of its batches (cut points).
        let mut cuts: Vec<usize> = (0..12).map(|_| rng.random_range(0..=60)).collect();
        cuts.extend([0, 60]);
        cuts.sort();
        cuts.dedup();
        let twice = cuts
            .windows(2)
            .any(|w| changes_an_object_twice(&changes[w[0]..w[1]]));
        let mut state = State::new();
        let mut published = Vec::new();
        let mut done = 0;
        for &cut in &cuts {
            for c in &changes[done..cut] {
                state.apply(c);
            }
            done = cut;
            published.push(state.clone());
        }
        // The other replica's state: after any number of changes.
        let node_at = rng.random_range(0..=60);
        let mut node = State::new();
        for c in &changes[..node_at] {
            node.apply(c);
        }
        let start = cuts.iter().rposition(|&c| c <= node_at).unwrap();
        let mut held = whole(&node);
        held.apply(&restating(&published, start));
        let latest = published.last().unwrap();
        let reached = held.digest() == latest.digest();
        assert_eq!(
            reached,
            held == whole(latest),
            "seed {seed}: the digest tells the latest state from another"
        );
        if twice {
            refused += usize::from(!reached);
            continue;
        }
        assert!(
            reached,
            "seed {seed}: node after {node_at} changes, window from cut {}",
            cuts[start]
        );
        exact += 1;
    }
    assert!(
        exact > 200,
        "{exact} batchings without an object changed twice"
    );
    assert!(refused > 0, "the limit is exercised too");
}

/// A state from outside the window (the node holds a change older than the window's start
/// that was undone since) does not reach the brain's digest: the node refuses the delta.
#[test]
fn a_state_outside_the_window_misses_the_digest() {
    let mut before = State::new();
    before.apply(&Change::Put(0, 1, 1));
    // The node holds element 1 = 2, a value this brain's window never saw change.
    let mut node = before.clone();
    node.apply(&Change::Put(0, 1, 2));
    let mut after = before.clone();
    after.apply(&Change::Put(1, 5, 5));
    let published = vec![before, after];
    let mut held = whole(&node);
    held.apply(&restating(&published, 0));
    assert_ne!(held.digest(), published[1].digest());
}

/// What a window restates: only what changed in it, not the cluster.
#[test]
fn restates_only_what_changed() {
    let mut state = State::new();
    for k in 0..500 {
        state.apply(&Change::Put(k % 3, k as u32, 1));
    }
    let mut next = state.clone();
    next.apply(&Change::Put(0, 7, 3));
    next.apply(&Change::Remove(2, 8));
    next.apply(&Change::Own(1001, Some(1)));
    let mut last = next.clone();
    last.apply(&Change::Put(0, 7, 1)); // changed back: still restated
    let delta = restating(&[state, next, last], 0);
    let elements = |tables: &[Table]| -> usize {
        tables
            .iter()
            .flat_map(|t| &t.sets)
            .map(|s| s.elements.len())
            .sum()
    };
    assert_eq!(elements(&delta.upsert), 2, "{delta:?}"); // 7 in the shared set, 1001 own
    let removed: usize = delta
        .remove
        .iter()
        .flat_map(|r| &r.elements)
        .map(|s| s.elements.len())
        .sum();
    assert_eq!(removed, 1, "{delta:?}"); // 8
    assert!(delta.remove.iter().all(|r| !r.whole && r.sets.is_empty()));
}
