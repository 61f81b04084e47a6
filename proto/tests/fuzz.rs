//! Fuzzing what an actuator does with the bytes a brain (or anyone holding a stream) sends it:
//! decoding an `Update` and its body, joining the parts of one update the way the actuator does
//! (actuator/src/client.rs: snapshot parts folded into a model, delta parts joined with
//! `parts::join`), and `Model::apply`, `Model::diff` and `Model::digest` on whatever decodes.
//!
//! Why: an update is input. A malformed or adversarial one must be refused (a NACK), never
//! crash the actuator, whose table then stays as it was ("fail static", "atomic",
//! docs/invariants.md). The properties below are that nothing here panics on any input, and
//! that the model's incrementally kept digest always equals the digest of its content.
//!
//! Each property runs 256 cases by default, a few seconds in all; `PROPTEST_CASES=N` runs N
//! (for example `PROPTEST_CASES=100000 cargo test -p splitproxy-proto --test fuzz`).

use bytes::Bytes;
use proptest::prelude::*;
use prost::Message;
use splitproxy_proto::frames::{UpdateFrame, encode_node_part, encode_parts, encode_tail};
use splitproxy_proto::model::{Model, canonicalize, element_key_bytes};
use splitproxy_proto::parts::{self, PartsError};
use splitproxy_proto::v1::{
    Chain, Datum, Element, Family, Ruleset, RulesetDelta, Set, SetElements, Table, TableRemoval,
    Update, datum::Value, update::Body,
};

// ---- strategies: small name pools, so that generated removals and upserts collide ----

fn family() -> impl Strategy<Value = i32> {
    prop_oneof![
        4 => Just(Family::Ip as i32),
        2 => Just(Family::Ip6 as i32),
        1 => Just(Family::Inet as i32),
        1 => Just(Family::Unspecified as i32),
        1 => any::<i32>(),
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::sample::select(vec!["splitproxy", "t", "a", "b"]).prop_map(str::to_owned),
        1 => Just(String::new()),
        1 => "[a-z\\x00-\\x1f]{0,300}",
    ]
}

fn datum() -> impl Strategy<Value = Datum> {
    let value = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..6).prop_map(Value::Ipv4),
        prop::collection::vec(any::<u8>(), 0..18).prop_map(Value::Ipv6),
        (0u32..4).prop_map(Value::Proto),
        (0u32..4).prop_map(Value::Port),
        any::<u32>().prop_map(Value::U32),
    ];
    prop::option::weighted(0.9, value).prop_map(|value| Datum { value })
}

fn element() -> impl Strategy<Value = Element> {
    (
        prop::collection::vec(datum(), 0..3),
        prop::collection::vec(datum(), 0..2),
        prop::collection::vec(datum(), 0..3),
        prop::option::of((0i32..8, name())),
        prop::option::weighted(0.1, any::<u64>()),
        prop::option::weighted(0.1, "\\PC{0,200}"),
    )
        .prop_map(|(key, key_end, data, verdict, timeout, comment)| Element {
            key,
            key_end,
            data,
            verdict: verdict.map(|(code, chain)| splitproxy_proto::v1::Verdict { code, chain }),
            timeout_ms: timeout.unwrap_or(0),
            comment: comment.unwrap_or_default(),
        })
}

fn set() -> impl Strategy<Value = Set> {
    (
        prop::sample::select(vec!["s", "m", "x"]),
        prop::collection::vec(
            prop::sample::select(vec![0, 1, 4, 7, 8, 12, 13, 19, 99]),
            0..3,
        ),
        prop::collection::vec(prop::sample::select(vec![0, 1, 4, 7, 13]), 0..2),
        any::<(bool, bool, bool)>(),
        0i32..4,
        prop::collection::vec(element(), 0..6),
    )
        .prop_map(
            |(name, key, data, (interval, timeout, dynamic), conntrack, elements)| Set {
                name: name.to_owned(),
                key,
                data,
                interval,
                timeout,
                dynamic,
                conntrack,
                elements,
                ..Set::default()
            },
        )
}

fn chain() -> impl Strategy<Value = Chain> {
    (prop::sample::select(vec!["c", "d"]), "\\PC{0,8}").prop_map(|(name, comment)| Chain {
        name: name.to_owned(),
        comment,
        ..Chain::default()
    })
}

fn table() -> impl Strategy<Value = Table> {
    (
        family(),
        name(),
        prop::option::weighted(0.2, "\\PC{0,40}"),
        prop::collection::vec(chain(), 0..3),
        prop::collection::vec(set(), 0..4),
    )
        .prop_map(|(family, name, comment, chains, sets)| Table {
            family,
            name,
            comment: comment.unwrap_or_default(),
            chains,
            sets,
        })
}

fn removal() -> impl Strategy<Value = TableRemoval> {
    (
        family(),
        name(),
        prop::bool::weighted(0.2),
        prop::collection::vec(
            prop::sample::select(vec!["c", "d"]).prop_map(str::to_owned),
            0..2,
        ),
        prop::collection::vec(
            prop::sample::select(vec!["s", "m"]).prop_map(str::to_owned),
            0..2,
        ),
        prop::collection::vec(
            (
                prop::sample::select(vec!["s", "m", "x"]),
                prop::collection::vec(element(), 0..4),
            ),
            0..3,
        ),
    )
        .prop_map(
            |(family, name, whole, chains, sets, elements)| TableRemoval {
                family,
                name,
                whole,
                chains,
                sets,
                elements: elements
                    .into_iter()
                    .map(|(set, elements)| SetElements {
                        set: set.to_owned(),
                        elements,
                    })
                    .collect(),
            },
        )
}

fn ruleset() -> impl Strategy<Value = Ruleset> {
    prop::collection::vec(table(), 0..4).prop_map(|tables| Ruleset { tables })
}

fn delta() -> impl Strategy<Value = RulesetDelta> {
    (
        prop::collection::vec(table(), 0..3),
        prop::collection::vec(removal(), 0..3),
    )
        .prop_map(|(upsert, remove)| RulesetDelta { upsert, remove })
}

fn body() -> impl Strategy<Value = Body> {
    prop_oneof![
        ruleset().prop_map(Body::Snapshot),
        delta().prop_map(Body::Delta),
    ]
}

/// Byte-level damage to a valid encoding: flips, truncation, insertion, deletion, splicing.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Set(usize, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 1usize..8).prop_map(|(i, n)| Mutation::Delete(i, n)),
        // Varint and length bytes that say "huge" or "negative".
        (
            any::<usize>(),
            prop::sample::select(vec![0x00, 0x7f, 0x80, 0xff])
        )
            .prop_map(|(i, b)| Mutation::Set(i, b)),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutations: &[Mutation]) {
    for m in mutations {
        let len = bytes.len();
        let at = |i: usize| if len == 0 { 0 } else { i % len };
        match m {
            Mutation::Flip(i, x) if len > 0 => bytes[at(*i)] ^= x,
            Mutation::Set(i, b) if len > 0 => bytes[at(*i)] = *b,
            Mutation::Truncate(i) => bytes.truncate(at(*i)),
            Mutation::Insert(i, b) => {
                let i = if len == 0 { 0 } else { i % (len + 1) };
                bytes.splice(i..i, b.iter().copied());
            }
            Mutation::Delete(i, n) if len > 0 => {
                let i = at(*i);
                bytes.drain(i..(i + n).min(len));
            }
            _ => {}
        }
    }
}

// ---- what the actuator does with what decodes ----

/// Everything the model offers, on a model and a delta; panics are the failure.
fn exercise(model: &Model, delta: &RulesetDelta) {
    let mut next = model.clone();
    next.apply(delta);
    assert_digest_is_content(&next);
    let back = next.diff(model);
    let mut undone = next.clone();
    undone.apply(&back);
    assert_eq!(undone.digest(), model.digest(), "diff undoes an apply");
    let forward = model.diff(&next);
    let mut redone = model.clone();
    redone.apply(&forward);
    assert_eq!(redone, next, "diff then apply reaches the target");
    let _ = next.element_count();
    let _ = next.digest_with(model);
}

/// The digest kept by every insert and removal equals the digest of the content rebuilt from
/// scratch: what the actuator compares with the brain's digest is what it holds.
fn assert_digest_is_content(model: &Model) {
    let rebuilt = Model::from_ruleset(&model.to_ruleset());
    assert_eq!(model.digest(), rebuilt.digest());
    assert_eq!(model, &rebuilt);
}

/// The actuator's join (actuator/src/client.rs): snapshot parts folded into a model as they
/// arrive, delta parts joined with `parts::join`; a mix is refused.
fn join_like_the_actuator(parts: Vec<Update>) -> Result<(Option<Model>, Option<Body>), String> {
    let mut snapshot: Option<Model> = None;
    let mut deltas = Vec::new();
    for part in parts {
        match part.body {
            Some(Body::Snapshot(r)) => {
                snapshot
                    .get_or_insert_with(Model::default)
                    .apply(&RulesetDelta {
                        upsert: r.tables,
                        remove: Vec::new(),
                    })
            }
            Some(body @ Body::Delta(_)) => deltas.push(body),
            None => {}
        }
    }
    match (snapshot, deltas.is_empty()) {
        (Some(m), true) => Ok((Some(m), None)),
        (None, _) => match parts::join(deltas) {
            Ok(body) => Ok((None, Some(body))),
            Err(PartsError::Empty) => Ok((None, None)),
            Err(e) => Err(e.to_string()),
        },
        (Some(_), false) => Err("snapshot and delta parts mixed".into()),
    }
}

enum Kind {
    Snapshot,
    Delta,
}

/// What the brain would send for `body` and `digest`: shared parts, then the last frame with
/// the tail and the node's own (empty) part, each an encoded `Update`.
fn frames_of(body: Body, max_elements: usize, digest: Vec<u8>) -> Vec<Vec<u8>> {
    let header = |shared: Bytes, extra: Bytes| UpdateFrame {
        brain_epoch: 7,
        generation: 3,
        base_generation: 2,
        shared,
        extra,
    };
    let body_kind = match &body {
        Body::Snapshot(_) => Kind::Snapshot,
        Body::Delta(_) => Kind::Delta,
    };
    let mut frames: Vec<Vec<u8>> = encode_parts(body, max_elements)
        .into_iter()
        .map(|shared| header(shared, Bytes::new()).encode_to_vec())
        .collect();
    let tail = encode_tail(
        vec![prost_types::Timestamp {
            seconds: 1,
            nanos: 2,
        }],
        vec!["EndpointSlice a/b".into()],
        vec![1, 2, 3, 4],
    );
    // The node's own part has the body's kind, as the brain sends it (brain/src/fanout.rs).
    let own = match body_kind {
        Kind::Snapshot => Body::Snapshot(Ruleset::default()),
        Kind::Delta => Body::Delta(RulesetDelta::default()),
    };
    let own = encode_node_part(own, digest);
    frames.push(header(tail, own).encode_to_vec());
    frames
}

/// 256 cases unless `PROPTEST_CASES` says otherwise; failures are printed, not saved to files.
fn config() -> ProptestConfig {
    ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    /// Arbitrary bytes, decoded as every message the actuator decodes: no panic, and what
    /// decodes goes through the model without one.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(u) = Update::decode(&bytes[..]) {
            let _ = join_like_the_actuator(vec![u]);
        }
        if let Ok(r) = Ruleset::decode(&bytes[..]) {
            let model = Model::from_ruleset(&r);
            assert_digest_is_content(&model);
            exercise(&model, &RulesetDelta::default());
        }
        if let Ok(d) = RulesetDelta::decode(&bytes[..]) {
            exercise(&Model::default(), &d);
        }
        if let Ok(e) = Element::decode(&bytes[..]) {
            let key = element_key_bytes(&e);
            prop_assert!(Element::decode(&key[..]).is_ok());
        }
        let _ = Set::decode(&bytes[..]);
        let _ = Table::decode(&bytes[..]);
    }

    /// Valid update frames, damaged byte by byte, decoded and joined as the actuator joins
    /// them and applied to a model.
    #[test]
    fn mutated_frames_never_panic(
        base in ruleset(),
        body in body(),
        max in 1usize..6,
        which in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let base = Model::from_ruleset(&base);
        let mut frames = frames_of(body, max, base.digest());
        let i = which.index(frames.len());
        mutate(&mut frames[i], &mutations);
        let decoded: Vec<Update> =
            frames.iter().filter_map(|f| Update::decode(&f[..]).ok()).collect();
        if let Ok((snapshot, delta)) = join_like_the_actuator(decoded) {
            if let Some(m) = snapshot {
                assert_digest_is_content(&m);
                let _ = base.diff(&m);
                let _ = m.diff(&base);
            }
            if let Some(Body::Delta(d)) = delta {
                exercise(&base, &d);
            }
        }
    }

    /// Any delta on any model: apply, diff both ways, digest; the digest always matches the
    /// content, and diff and apply are inverse.
    #[test]
    fn any_delta_on_any_model(base in ruleset(), d in delta()) {
        exercise(&Model::from_ruleset(&base), &d);
    }

    /// A body as a brain sends it (a model's content, or the diff between two models) split
    /// into parts, sent as frames and joined as the actuator joins them, has the effect of the
    /// whole body, however small the parts.
    ///
    /// Only such bodies: one that lists a set twice in a table with two definitions joins
    /// differently from the whole (the element parts go to the first set of that name), which
    /// the digest check then refuses (a NACK); `mutated_frames_never_panic` covers those.
    #[test]
    fn parts_join_to_the_whole(
        base in ruleset(),
        target in ruleset(),
        snapshot in any::<bool>(),
        max in 1usize..6,
    ) {
        let base = Model::from_ruleset(&base);
        let target = Model::from_ruleset(&target);
        let body = if snapshot {
            Body::Snapshot(target.to_ruleset())
        } else {
            Body::Delta(base.diff(&target))
        };
        let whole = match body.clone() {
            Body::Snapshot(r) => Model::from_ruleset(&r),
            Body::Delta(d) => {
                let mut m = base.clone();
                m.apply(&d);
                m
            }
        };
        let frames = frames_of(body.clone(), max, whole.digest());
        let decoded: Vec<Update> =
            frames.iter().map(|f| Update::decode(&f[..]).unwrap()).collect();
        let last = decoded.last().unwrap();
        prop_assert!(!last.more && last.digest == whole.digest());
        prop_assert!(decoded[..decoded.len() - 1].iter().all(|u| u.more));
        let (snapshot, delta) = join_like_the_actuator(decoded).unwrap();
        let joined = match (snapshot, delta) {
            (Some(m), _) => m,
            (None, Some(Body::Delta(d))) => {
                let mut m = base.clone();
                m.apply(&d);
                m
            }
            (None, _) => base.clone(), // an empty delta has no shared part
        };
        prop_assert_eq!(&whole, &target);
        prop_assert_eq!(joined.digest(), whole.digest());
        prop_assert_eq!(joined, whole);
    }

    /// The digest depends on content only: the same ruleset in another order, or built
    /// through any delta path, has the same digest.
    #[test]
    fn digest_is_order_free(r in ruleset(), d in delta()) {
        let model = Model::from_ruleset(&r);
        // Within one table and set the last of equal keys wins, so the generated ruleset
        // cannot simply be reordered: reorder the model's content instead.
        let mut reversed = model.to_ruleset();
        reversed.tables.reverse();
        for t in &mut reversed.tables {
            t.chains.reverse();
            t.sets.reverse();
            for s in &mut t.sets {
                s.elements.reverse();
            }
        }
        prop_assert_eq!(Model::from_ruleset(&reversed).digest(), model.digest());
        let mut canonical = model.to_ruleset();
        canonicalize(&mut canonical);
        prop_assert_eq!(Model::from_ruleset(&canonical).digest(), model.digest());
        let mut next = model.clone();
        next.apply(&d);
        let mut via_diff = Model::default();
        via_diff.apply(&Model::default().diff(&next));
        prop_assert_eq!(via_diff.digest(), next.digest());
    }
}
