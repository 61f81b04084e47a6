//! Adversarial updates against the applier: random but decodable updates (wrong families,
//! foreign tables, elements whose key does not fit their set, data on plain sets, removals of
//! what does not exist, duplicates, chains and sets redefined in place, wrong bases and
//! digests, names and comments too long, empty bodies), applied in sequences through the
//! [`Recording`] kernel and, in kernel.rs, through a real kernel in a private network namespace.
//!
//! What must hold for every update ("atomic", "own table only", docs/invariants.md): applying
//! never panics, and the update is either
//! - applied whole: the model is exactly the old model with the update applied, the applied
//!   (epoch, generation, digest) are the update's, at most one batch was sent, and that batch
//!   and the batch that encodes the whole new model (what a restarted actuator sends) are made
//!   of well-formed messages; or
//! - refused whole: an error (which the client turns into a NACK), the model, the applied
//!   version and the adoption unchanged, nothing sent or one refused batch; and what later
//!   updates leave for after the commit (conntrack and guard plans) is what they leave on a twin
//!   applier that never saw the refused update.
//!
//! 256 cases of up to 5 updates by default; `PROPTEST_CASES=N` runs N, for example
//! `PROPTEST_CASES=20000 cargo test -p splitproxy-actuator --lib fuzz_`.

mod kernel;

use proptest::prelude::*;
use splitproxy_proto::family::IpFamily;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{
    BaseChain, Chain, ConntrackRole, DataType, Datum, Element, Family, Rule, Ruleset, RulesetDelta,
    Set, SetElements, Table, TableRemoval, Update, Verdict, datum::Value, update::Body,
};

use super::kernel::{Kernel, Recording};
use super::{Applied, Applier, ApplyError, Outcome};
use crate::client::{MAX_ERROR_BYTES, nack};
use crate::guards::tests::{affinity_map, member, members_set};
use crate::nft::tests::fixture::{self, TABLE};

/// The guarded map and its guard set, renamed so as not to clash with the fixture's
/// `affinity` set.
const GUARDED: &str = "client-affinity";
const GUARDS: &str = "client-affinity-members";

/// The table the brain would send: the nft fixture (base chains, rules, maps, a verdict map),
/// with the endpoints map and the no-endpoint set marked for conntrack clean-up, and a guarded
/// map with its guard set. The kernel takes it (kernel.rs).
pub(super) fn base_table() -> Table {
    let mut t = fixture::table();
    for s in &mut t.sets {
        match s.name.as_str() {
            "service-endpoints" => s.conntrack = ConntrackRole::Endpoints as i32,
            "no-endpoint-services" => s.conntrack = ConntrackRole::NoEndpoints as i32,
            _ => {}
        }
    }
    t.sets.push(Set {
        name: GUARDED.to_owned(),
        ..affinity_map(IpFamily::V4)
    });
    t.sets.push(Set {
        name: GUARDS.to_owned(),
        guards: GUARDED.to_owned(),
        ..members_set(
            IpFamily::V4,
            vec![
                member("10.96.0.1", 6, 443, "10.244.1.5", 6443),
                member("10.96.0.1", 6, 443, "10.244.2.7", 6443),
            ],
        )
    });
    t
}

pub(super) fn base_ruleset() -> Ruleset {
    Ruleset {
        tables: vec![base_table()],
    }
}

fn set_names() -> Vec<String> {
    base_table().sets.into_iter().map(|s| s.name).collect()
}

fn chain_names() -> Vec<String> {
    base_table().chains.into_iter().map(|c| c.name).collect()
}

fn base_elements() -> Vec<Element> {
    base_table()
        .sets
        .into_iter()
        .flat_map(|s| s.elements)
        .collect()
}

fn base_rules() -> Vec<Rule> {
    base_table()
        .chains
        .into_iter()
        .flat_map(|c| c.rules)
        .collect()
}

// ---- strategies ----

/// A name from the pool (so removals and upserts meet what exists), or a bad one.
fn name_from(pool: Vec<String>, fresh: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![
        80 => prop::sample::select(pool),
        8 => Just(fresh.to_owned()),
        1 => Just(String::new()),
        1 => Just("x".repeat(300)),
        1 => Just("a\0b".to_owned()),
    ]
}

fn set_name() -> impl Strategy<Value = String> {
    name_from(set_names(), "new-set")
}

fn chain_name() -> impl Strategy<Value = String> {
    name_from(chain_names(), "new-chain")
}

/// Family and name of a table: mostly this actuator's own.
fn table_ref() -> impl Strategy<Value = (i32, String)> {
    prop_oneof![
        120 => Just((Family::Ip as i32, TABLE.to_owned())),
        6 => Just((Family::Ip6 as i32, TABLE.to_owned())),
        1 => Just((Family::Ip as i32, "kube-proxy".to_owned())),
        1 => Just((Family::Inet as i32, TABLE.to_owned())),
        1 => Just((Family::Unspecified as i32, TABLE.to_owned())),
        1 => any::<i32>().prop_map(|f| (f, TABLE.to_owned())),
        1 => Just((Family::Ip as i32, "x".repeat(300))),
    ]
}

/// A comment: usually empty, sometimes longer than the kernel takes, or with a NUL.
fn comment() -> impl Strategy<Value = String> {
    prop_oneof![
        30 => Just(String::new()),
        6 => "[a-z/:-]{1,20}",
        1 => Just("c".repeat(200)),
        1 => Just("a\0b".to_owned()),
    ]
}

fn datum() -> impl Strategy<Value = Datum> {
    let value = prop_oneof![
        prop::collection::vec(any::<u8>(), 4).prop_map(Value::Ipv4),
        prop::collection::vec(any::<u8>(), 0..7).prop_map(Value::Ipv4),
        prop::collection::vec(any::<u8>(), 16).prop_map(Value::Ipv6),
        prop::sample::select(vec![6u32, 17, 132, 256, u32::MAX]).prop_map(Value::Proto),
        prop::sample::select(vec![53u32, 443, 0, 65535, 65536]).prop_map(Value::Port),
        any::<u32>().prop_map(Value::U32),
    ];
    prop::option::weighted(0.95, value).prop_map(|value| Datum { value })
}

/// Mostly a verdict the kernel takes (accept, drop, jump or goto to a chain of the table),
/// sometimes an unknown code, a code that takes no chain with one, or a missing chain.
fn verdict() -> impl Strategy<Value = Verdict> {
    prop_oneof![
        2 => prop::sample::select(vec![1i32, 2]).prop_map(|code| Verdict {
            code,
            chain: String::new(),
        }),
        3 => (prop::sample::select(vec![5i32, 6]), prop::sample::select(chain_names()))
            .prop_map(|(code, chain)| Verdict { code, chain }),
        1 => (-1i32..9, chain_name()).prop_map(|(code, chain)| Verdict { code, chain }),
    ]
}

/// An element of any shape: one the table holds, one of its elements with other data or
/// another comment, or random fields (mostly not the shape of any set).
fn element() -> impl Strategy<Value = Element> {
    let random = (
        prop::collection::vec(datum(), 0..6),
        prop::collection::vec(datum(), 0..2),
        prop::collection::vec(datum(), 0..3),
        prop::option::weighted(0.2, verdict()),
        prop::sample::select(vec![0u64, 0, 0, 1000, u64::MAX]),
        comment(),
    )
        .prop_map(
            |(key, key_end, data, verdict, timeout_ms, comment)| Element {
                key,
                key_end,
                data,
                verdict,
                timeout_ms,
                comment,
            },
        );
    prop_oneof![
        6 => prop::sample::select(base_elements()),
        1 => (prop::sample::select(base_elements()), prop::collection::vec(datum(), 0..3))
            .prop_map(|(e, data)| Element { data, ..e }),
        1 => (prop::sample::select(base_elements()), comment())
            .prop_map(|(e, comment)| Element { comment, ..e }),
        2 => random,
        // Far more fields than any set has.
        1 => prop::collection::vec(datum(), 20..80).prop_map(|key| Element {
            key,
            ..Element::default()
        }),
    ]
}

/// A value of type `t`, from a small range so that generated elements meet existing ones.
fn datum_of(t: i32) -> BoxedStrategy<Datum> {
    let v = |s: BoxedStrategy<Value>| s.prop_map(|v| Datum { value: Some(v) }).boxed();
    match DataType::try_from(t) {
        Ok(DataType::Ipv4Addr) => v((0u8..3, 0u8..12)
            .prop_map(|(a, b)| Value::Ipv4(vec![10, if a == 0 { 96 } else { 244 }, a, b]))
            .boxed()),
        Ok(DataType::Ipv6Addr) => v((0u8..4)
            .prop_map(|b| {
                let mut a = vec![0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
                a[15] = b;
                Value::Ipv6(a)
            })
            .boxed()),
        Ok(DataType::InetProto) => v(prop::sample::select(vec![6u32, 17, 132])
            .prop_map(Value::Proto)
            .boxed()),
        Ok(DataType::InetService) => v(prop::sample::select(vec![53u32, 443, 6443, 30443])
            .prop_map(Value::Port)
            .boxed()),
        Ok(DataType::Integer | DataType::Mark) => v((0u32..4).prop_map(Value::U32).boxed()),
        _ => datum().boxed(),
    }
}

/// An element of the shape of `def`, with a verdict for a verdict map (some of them to a
/// chain that does not exist).
fn typed_element(def: &Set) -> BoxedStrategy<Element> {
    let key: Vec<_> = def.key.iter().map(|t| datum_of(*t)).collect();
    let verdict_map = def.data == [DataType::Verdict as i32];
    let data: Vec<_> = if verdict_map {
        Vec::new()
    } else {
        def.data.iter().map(|t| datum_of(*t)).collect()
    };
    let verdict = if verdict_map {
        prop::option::of(verdict()).boxed()
    } else {
        Just(None).boxed()
    };
    (key, data, verdict, comment())
        .prop_map(|(key, data, verdict, comment)| Element {
            key,
            data,
            verdict,
            comment,
            ..Element::default()
        })
        .boxed()
}

/// An element for the set named `set`: usually of its shape, when the table has such a set.
fn element_for(set: &str) -> BoxedStrategy<Element> {
    match base_table().sets.into_iter().find(|s| s.name == set) {
        Some(def) => prop_oneof![8 => typed_element(&def), 1 => element()].boxed(),
        None => element().boxed(),
    }
}

/// A set definition: one the table holds, the same name with another definition, or new.
fn set_def() -> impl Strategy<Value = Set> {
    let types = prop::sample::select(vec![0i32, 1, 4, 7, 8, 12, 13, 19, 77]);
    let redefined = (
        prop::sample::select(base_table().sets),
        prop_oneof![
            8 => prop::collection::vec(types.clone(), 0..5),
            1 => prop::collection::vec(types.clone(), 20..40),
        ],
        prop::collection::vec(types, 0..3),
        any::<(bool, bool, bool)>(),
        comment(),
    )
        .prop_map(
            |(s, key, data, (interval, timeout, dynamic), comment)| Set {
                key,
                data,
                interval,
                timeout,
                dynamic,
                comment,
                ..s
            },
        );
    prop_oneof![
        24 => prop::sample::select(base_table().sets),
        1 => (prop::sample::select(base_table().sets), set_name())
            .prop_map(|(s, name)| Set { name, ..s }),
        1 => (prop::sample::select(base_table().sets), comment())
            .prop_map(|(s, comment)| Set { comment, ..s }),
        2 => redefined,
    ]
}

fn set() -> impl Strategy<Value = Set> {
    set_def().prop_flat_map(|s| {
        let elements = prop_oneof![
            8 => typed_element(&s),
            1 => element(),
        ];
        (Just(s), prop::collection::vec(elements, 0..5))
            .prop_map(|(s, elements)| Set { elements, ..s })
    })
}

fn rule() -> impl Strategy<Value = Rule> {
    prop_oneof![
        6 => prop::sample::select(base_rules()),
        1 => chain_name().prop_map(|c| fixture::jump(&c)),
        1 => (prop::sample::select(base_rules()), comment())
            .prop_map(|(r, comment)| Rule { comment, ..r }),
        1 => Just(Rule::default()),
    ]
}

/// A chain: one the table holds, with its rules or others, a base chain moved to another hook
/// or priority, or a new chain.
fn chain() -> impl Strategy<Value = Chain> {
    let base = prop::option::weighted(
        0.3,
        (
            0i32..7,
            0i32..5,
            prop::sample::select(vec![-100, 0, 100, i32::MIN]),
            any::<bool>(),
        )
            .prop_map(|(hook, r#type, priority, policy_drop)| BaseChain {
                hook,
                r#type,
                priority,
                policy_drop,
            }),
    );
    prop_oneof![
        4 => prop::sample::select(base_table().chains),
        3 => (prop::sample::select(base_table().chains), prop::collection::vec(rule(), 0..3))
            .prop_map(|(c, rules)| Chain { rules, ..c }),
        1 => (prop::sample::select(base_table().chains), base)
            .prop_map(|(c, base)| Chain { base, ..c }),
        1 => (prop::sample::select(base_table().chains), comment())
            .prop_map(|(c, comment)| Chain { comment, ..c }),
        2 => (chain_name(), prop::collection::vec(rule(), 0..3)).prop_map(|(name, rules)| Chain {
            name,
            rules,
            ..Chain::default()
        }),
    ]
}

fn table() -> impl Strategy<Value = Table> {
    (
        table_ref(),
        prop_oneof![
            6 => Just("managed by splitproxy".to_owned()),
            1 => comment(),
        ],
        prop::collection::vec(chain(), 0..3),
        prop::collection::vec(set(), 0..3),
    )
        .prop_map(|((family, name), comment, chains, sets)| Table {
            family,
            name,
            comment,
            chains,
            sets,
        })
}

fn removal() -> impl Strategy<Value = TableRemoval> {
    (
        table_ref(),
        prop::bool::weighted(0.1),
        prop::collection::vec(chain_name(), 0..2),
        prop::collection::vec(set_name(), 0..2),
        prop::collection::vec(
            set_name().prop_flat_map(|set| {
                let elements = prop::collection::vec(element_for(&set), 0..4);
                (Just(set), elements)
            }),
            0..3,
        ),
    )
        .prop_map(
            |((family, name), whole, chains, sets, elements)| TableRemoval {
                family,
                name,
                whole,
                chains,
                sets,
                elements: elements
                    .into_iter()
                    .map(|(set, elements)| SetElements { set, elements })
                    .collect(),
            },
        )
}

fn delta() -> impl Strategy<Value = RulesetDelta> {
    (
        prop::collection::vec(table(), 0..3),
        prop::collection::vec(removal(), 0..3),
    )
        .prop_map(|(upsert, remove)| RulesetDelta { upsert, remove })
}

/// What the update claims besides its body.
#[derive(Debug, Clone)]
pub(super) enum Base {
    /// The applied epoch and generation (what a correct brain sends).
    Right,
    WrongGeneration(u64),
    WrongEpoch(u64),
}

#[derive(Debug, Clone)]
pub(super) enum Digest {
    /// The digest of the model the update leads to, as the actuator computes it.
    Right,
    Empty,
    Wrong(Vec<u8>),
}

/// The body of an update.
#[derive(Debug, Clone)]
pub(super) enum Content {
    Snapshot(Ruleset),
    Delta(RulesetDelta),
    None,
}

/// One adversarial update, with an optional refusal by the kernel (message index).
#[derive(Debug, Clone)]
pub(super) struct Step {
    pub body: Content,
    pub base: Base,
    pub digest: Digest,
    pub refuse: Option<usize>,
}

fn step() -> impl Strategy<Value = Step> {
    let body = prop_oneof![
        12 => delta().prop_map(Content::Delta),
        3 => (prop::collection::vec(table(), 0..2), prop::bool::weighted(0.7)).prop_map(
            |(tables, with_base)| {
                // A snapshot: usually the base table changed, sometimes anything.
                let mut tables = tables;
                if with_base {
                    let mut m = Model::from_ruleset(&base_ruleset());
                    m.apply(&RulesetDelta { upsert: tables, remove: vec![] });
                    tables = m.to_ruleset().tables;
                }
                Content::Snapshot(Ruleset { tables })
            }
        ),
    ];
    let body = prop_oneof![29 => body, 1 => Just(Content::None)];
    let base = prop_oneof![
        20 => Just(Base::Right),
        1 => (1u64..4).prop_map(Base::WrongGeneration),
        1 => (1u64..4).prop_map(Base::WrongEpoch),
    ];
    let digest = prop_oneof![
        16 => Just(Digest::Right),
        1 => Just(Digest::Empty),
        1 => prop::collection::vec(any::<u8>(), 0..33).prop_map(Digest::Wrong),
    ];
    (body, base, digest, prop::option::weighted(0.1, 0usize..40)).prop_map(
        |(body, base, digest, refuse)| Step {
            body,
            base,
            digest,
            refuse,
        },
    )
}

/// Up to five updates, on an applier that adopted the base table or on a fresh one (whose
/// first snapshot replaces the table).
pub(super) fn steps() -> impl Strategy<Value = (bool, Vec<Step>)> {
    (
        prop::bool::weighted(0.8),
        prop::collection::vec(step(), 1..6),
    )
}

/// The update `step` describes for an applier that applied `applied` and holds `model`.
pub(super) fn update_of(step: &Step, applied: &Applied, model: &Model) -> Update {
    let (brain_epoch, base_generation) = match step.base {
        Base::Right => (applied.brain_epoch, applied.generation),
        Base::WrongGeneration(d) => (applied.brain_epoch, applied.generation.wrapping_add(d)),
        Base::WrongEpoch(d) => (applied.brain_epoch.wrapping_add(d), applied.generation),
    };
    let (body, expected) = match &step.body {
        Content::Snapshot(r) => (Some(Body::Snapshot(r.clone())), Model::from_ruleset(r)),
        Content::Delta(d) => {
            let mut next = model.clone();
            next.apply(d);
            (Some(Body::Delta(d.clone())), next)
        }
        Content::None => (None, model.clone()),
    };
    let snapshot = matches!(step.body, Content::Snapshot(_));
    Update {
        brain_epoch,
        generation: applied.generation + 1,
        base_generation: if snapshot { 0 } else { base_generation },
        digest: match &step.digest {
            Digest::Right => expected.digest(),
            Digest::Empty => Vec::new(),
            Digest::Wrong(d) => d.clone(),
        },
        body,
        ..Update::default()
    }
}

/// The model an accepted `update` must leave on an applier holding `model`.
pub(super) fn expected_model(update: &Update, model: &Model) -> Model {
    match &update.body {
        Some(Body::Snapshot(r)) => Model::from_ruleset(r),
        Some(Body::Delta(d)) => {
            let mut next = model.clone();
            next.apply(d);
            next
        }
        None => model.clone(),
    }
}

/// Everything a refused update must leave as it was.
fn state<K: Kernel>(a: &Applier<K>) -> (Model, Applied, bool) {
    (a.model().clone(), a.applied().clone(), a.adopted)
}

/// A message the batch describes is one the encoder made: it names what it does.
fn well_formed(messages: &[String]) -> Result<(), TestCaseError> {
    for m in messages {
        prop_assert!(
            !m.is_empty()
                && !m.starts_with("message ")
                && !m.contains("unspecified")
                && m.len() < 1024,
            "ill-formed message description {m:?}"
        );
    }
    Ok(())
}

/// What the commit leaves for the steps after it, comparable between two appliers.
type AfterCommit = (
    Vec<crate::conntrack::Stale>,
    bool,
    crate::guards::Plan,
    Model,
);

fn after_commit(o: &Outcome) -> AfterCommit {
    (
        o.conntrack.iter().copied().collect(),
        o.conntrack.resyncs(),
        o.guards.clone(),
        o.model.clone(),
    )
}

/// A fresh applier and a snapshot of the base table, epoch 1 generation 1.
pub(super) fn first_snapshot() -> Update {
    let rs = base_ruleset();
    Update {
        brain_epoch: 1,
        generation: 1,
        digest: Model::from_ruleset(&rs).digest(),
        body: Some(Body::Snapshot(rs)),
        ..Update::default()
    }
}

/// Applies `steps` to an applier (adopted or fresh) and checks every update's outcome. The
/// twin gets only the updates that were accepted, and never a refusal from its kernel.
fn run_steps(adopted: bool, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut a = Applier::new(Recording::new(), TABLE.to_owned());
    let mut twin = Applier::new(Recording::new(), TABLE.to_owned());
    if adopted {
        a.apply(&first_snapshot()).unwrap();
        twin.apply(&first_snapshot()).unwrap();
    }
    for step in steps {
        let update = update_of(step, a.applied(), a.model());
        let before = state(&a);
        let (committed, refused) = (a.kernel().committed().len(), a.kernel().refused().len());
        if let Some(i) = step.refuse {
            a.kernel_mut().refuse_next_at(i, 22, "Invalid argument");
        }
        // After a kernel refusal the applier no longer trusts its model to be the kernel's, and
        // replaces the tables whole with its next snapshot (a NACK never loops); the twin, which
        // saw no refusal, diffs.
        let replacing = a.replaces_next_snapshot() && !twin.replaces_next_snapshot();
        let result = a.apply(&update);
        let refused_now = a.kernel().refused().len();
        check(
            &mut a,
            &mut twin,
            &update,
            &before,
            (committed, refused, refused_now),
            replacing,
            result,
        )?;
        // A refusal not used up (nothing reached the kernel) must not leak into the next step.
        if step.refuse.is_some() && refused_now == refused {
            let mut b = crate::nft::Batch::new();
            b.add_table(Family::Ip, TABLE, "");
            let _ = a.kernel_mut().commit(&mut b);
        }
    }
    Ok(())
}

/// The properties of one update's outcome (see the module's doc).
fn check(
    a: &mut Applier<Recording>,
    twin: &mut Applier<Recording>,
    update: &Update,
    before: &(Model, Applied, bool),
    (committed, refused, refused_now): (usize, usize, usize),
    replacing: bool,
    result: Result<Outcome, ApplyError>,
) -> Result<(), TestCaseError> {
    match result {
        Ok(outcome) => {
            let expected = expected_model(update, &before.0);
            prop_assert_eq!(a.model(), &expected, "the model is the update applied");
            prop_assert_eq!(&outcome.model, &expected);
            prop_assert_eq!(
                a.applied(),
                &Applied {
                    brain_epoch: update.brain_epoch,
                    generation: update.generation,
                    digest: update.digest.clone(),
                    resource_versions: update.resource_versions.clone(),
                }
            );
            prop_assert!(a.adopted);
            if !update.digest.is_empty() {
                prop_assert_eq!(expected.digest(), update.digest.clone());
            }
            // Own table only: nothing else ever enters the model.
            for (family, name) in a.model().tables.keys() {
                prop_assert!(
                    matches!(family, Family::Ip | Family::Ip6) && name == TABLE,
                    "foreign table {family:?} {name} accepted"
                );
            }
            let sent = a.kernel().committed();
            prop_assert!(sent.len() <= committed + 1, "one transaction at most");
            prop_assert_eq!(refused_now, refused);
            if sent.len() > committed {
                well_formed(&sent[committed].messages)?;
            }
            // Whatever was accepted, a restarted actuator can send whole.
            let mut fresh = Applier::new(Recording::new(), TABLE.to_owned());
            let whole = fresh.apply_snapshot(
                &Update {
                    digest: expected.digest(),
                    ..update.clone()
                },
                expected.clone(),
            );
            prop_assert!(
                whole.is_ok(),
                "an accepted model cannot be sent whole: {:?}",
                whole.err()
            );
            for batch in fresh.kernel().committed() {
                well_formed(&batch.messages)?;
            }
            // The twin, which never saw a refused update, ends in the same place.
            let twin_committed = twin.kernel().committed().len();
            let theirs = twin.apply(update);
            prop_assert!(theirs.is_ok(), "twin refused: {:?}", theirs.err());
            let theirs = theirs.unwrap();
            prop_assert_eq!(after_commit(&outcome), after_commit(&theirs));
            prop_assert_eq!(twin.applied(), a.applied());
            prop_assert_eq!(twin.model(), a.model());
            // What this update sent, on each side.
            let (ours, theirs) = (
                &a.kernel().committed()[committed..],
                &twin.kernel().committed()[twin_committed..],
            );
            if replacing && matches!(update.body, Some(Body::Snapshot(_))) {
                // A whole replacement: the owned tables destroyed first, in the same batch.
                prop_assert!(
                    ours.iter()
                        .any(|b| b.messages.iter().any(|m| m.starts_with("destroy table"))),
                    "after a refusal the snapshot replaces the tables whole: {ours:?}"
                );
            } else {
                prop_assert_eq!(theirs, ours);
            }
        }
        Err(e) => {
            prop_assert_eq!(&state(a), before, "a refused update changes nothing: {}", e);
            prop_assert_eq!(a.kernel().committed().len(), committed);
            let kernel_refused = refused_now - refused;
            prop_assert!(kernel_refused <= 1);
            prop_assert_eq!(
                kernel_refused == 1,
                matches!(e, ApplyError::Kernel(_)),
                "only a kernel error reaches the kernel: {}",
                e
            );
            if kernel_refused == 1 {
                well_formed(&a.kernel().refused()[refused].messages)?;
            }
            // The NACK the brain gets.
            let ack = nack(update.generation, &e);
            prop_assert!(!ack.ok && !ack.error.is_empty());
            prop_assert!(ack.error.len() <= MAX_ERROR_BYTES);
        }
    }
    Ok(())
}

/// 256 cases unless `PROPTEST_CASES` says otherwise; failures are printed, not saved to files.
pub(super) fn config() -> ProptestConfig {
    ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn fuzz_adversarial_updates_apply_whole_or_not_at_all((adopted, steps) in steps()) {
        run_steps(adopted, &steps)?;
    }
}

// ---- the bugs this fuzzing found, one case each ----

/// An applier holding the base table, and the update that applies `d` to it with the digest
/// it leads to.
fn adopted_and(d: RulesetDelta) -> (Applier<Recording>, Update) {
    let mut a = Applier::new(Recording::new(), TABLE.to_owned());
    a.apply(&first_snapshot()).unwrap();
    let step = Step {
        body: Content::Delta(d),
        base: Base::Right,
        digest: Digest::Right,
        refuse: None,
    };
    let update = update_of(&step, a.applied(), a.model());
    (a, update)
}

fn own(chains: Vec<Chain>, sets: Vec<Set>) -> Table {
    Table {
        family: Family::Ip as i32,
        name: TABLE.to_owned(),
        comment: "managed by splitproxy".to_owned(),
        chains,
        sets,
    }
}

/// A delta that removes the table whole and upserts it again used to end with "delete table":
/// the kernel lost the whole table while the model held it.
#[test]
fn a_table_removed_and_upserted_in_one_delta_stays() {
    let (mut a, update) = adopted_and(RulesetDelta {
        upsert: vec![own(vec![], vec![])],
        remove: vec![TableRemoval {
            family: Family::Ip as i32,
            name: TABLE.to_owned(),
            whole: true,
            ..TableRemoval::default()
        }],
    });
    a.apply(&update).unwrap();
    let sent = &a.kernel().last().unwrap().messages;
    assert!(
        !sent.iter().any(|m| m.starts_with("delete table")),
        "{sent:?}"
    );
    // What goes is everything the upsert did not bring back.
    assert!(
        sent.contains(&"delete set cluster-ips".to_owned()),
        "{sent:?}"
    );
    assert!(
        sent.contains(&"delete chain services".to_owned()),
        "{sent:?}"
    );
}

/// A set upserted under an existing name with another definition used to be left as it was
/// in the kernel (old definition, old elements) while the model replaced and emptied it; an
/// invalid definition was accepted and made every later full encoding fail.
#[test]
fn a_set_redefined_in_place_is_recreated_or_refused() {
    let mut ips = base_table()
        .sets
        .into_iter()
        .find(|s| s.name == "cluster-ips")
        .unwrap();
    ips.elements.clear();
    let (mut a, update) = adopted_and(RulesetDelta {
        upsert: vec![own(
            vec![],
            vec![Set {
                comment: "redefined".to_owned(),
                ..ips.clone()
            }],
        )],
        remove: vec![],
    });
    a.apply(&update).unwrap();
    let sent = &a.kernel().last().unwrap().messages;
    let del = sent.iter().position(|m| m == "delete set cluster-ips");
    let add = sent.iter().position(|m| m == "add set cluster-ips");
    assert!(
        matches!((del, add), (Some(d), Some(a)) if d < a),
        "{sent:?}"
    );

    let (mut a, update) = adopted_and(RulesetDelta {
        upsert: vec![own(vec![], vec![Set { key: vec![], ..ips }])],
        remove: vec![],
    });
    let before = state(&a);
    assert!(matches!(a.apply(&update), Err(ApplyError::Encode(_))));
    assert_eq!(state(&a), before);
}

/// A chain upserted with another hook, type, priority or comment used to get its rules
/// replaced and nothing else: the kernel kept the old base chain (or silently ignored the
/// change) while the model held the new one.
#[test]
fn a_chain_reshaped_in_place_is_recreated_or_refused() {
    let prerouting = base_table()
        .chains
        .into_iter()
        .find(|c| c.name == "nat-prerouting")
        .unwrap();
    for reshaped in [
        Chain {
            base: None,
            ..prerouting.clone()
        },
        Chain {
            comment: "moved".to_owned(),
            ..prerouting.clone()
        },
        Chain {
            base: prerouting.base.map(|b| BaseChain {
                priority: -150,
                ..b
            }),
            ..prerouting.clone()
        },
    ] {
        let (mut a, update) = adopted_and(RulesetDelta {
            upsert: vec![own(vec![reshaped], vec![])],
            remove: vec![],
        });
        a.apply(&update).unwrap();
        let sent = &a.kernel().last().unwrap().messages;
        let del = sent.iter().position(|m| m == "delete chain nat-prerouting");
        let add = sent
            .iter()
            .position(|m| m.starts_with("add ") && m.ends_with("chain nat-prerouting"));
        assert!(
            matches!((del, add), (Some(d), Some(a)) if d < a),
            "{sent:?}"
        );
    }
    // A comment the kernel cannot take is refused, not accepted unchecked.
    let (mut a, update) = adopted_and(RulesetDelta {
        upsert: vec![own(
            vec![Chain {
                comment: "c".repeat(200),
                ..prerouting
            }],
            vec![],
        )],
        remove: vec![],
    });
    let before = state(&a);
    assert!(matches!(a.apply(&update), Err(ApplyError::Encode(_))));
    assert_eq!(state(&a), before);
}

/// A table comment the kernel cannot take, on a table that exists, used to be accepted
/// unchecked into the model, after which every full encoding of it failed.
#[test]
fn a_bad_comment_on_an_existing_table_is_refused() {
    for comment in ["c".repeat(200), "a\0b".to_owned()] {
        let (mut a, update) = adopted_and(RulesetDelta {
            upsert: vec![Table {
                comment,
                ..own(vec![], vec![])
            }],
            remove: vec![],
        });
        let before = state(&a);
        assert!(matches!(a.apply(&update), Err(ApplyError::Encode(_))));
        assert_eq!(state(&a), before);
    }
}
