//! Splitting large update bodies into parts, and joining them back.
//!
//! A snapshot of 10,000 Services is megabytes; sent as one message it would be buffered whole in
//! every stream's encoder (for as long as the stream lives) and decoded whole by every node.
//! Split into parts of a bounded number of elements, each message stays small. The parts of one
//! update are applied together, as one transaction, so splitting changes nothing a node sees.
use crate::v1::{Ruleset, RulesetDelta, Set, SetElements, Table, TableRemoval, update::Body};

/// Splits `body` into parts of at most about `max_elements` set elements each. The first part
/// carries every table, chain, set definition and whole removal; later parts carry elements.
pub fn split(body: Body, max_elements: usize) -> Vec<Body> {
    let max = max_elements.max(1);
    match body {
        Body::Snapshot(r) => split_tables(r.tables, max)
            .into_iter()
            .map(|tables| Body::Snapshot(Ruleset { tables }))
            .collect(),
        Body::Delta(d) => {
            let mut parts: Vec<RulesetDelta> = Vec::new();
            let mut first = RulesetDelta::default();
            let mut removals: Vec<TableRemoval> = Vec::new();
            for mut rm in d.remove {
                let elements = std::mem::take(&mut rm.elements);
                first.remove.push(rm.clone());
                for se in elements {
                    for chunk in se.elements.chunks(max) {
                        removals.push(TableRemoval {
                            family: rm.family,
                            name: rm.name.clone(),
                            elements: vec![SetElements {
                                set: se.set.clone(),
                                elements: chunk.to_vec(),
                            }],
                            ..Default::default()
                        });
                    }
                }
            }
            let upserts = split_tables(d.upsert, max);
            let mut it = upserts.into_iter();
            first.upsert = it.next().unwrap_or_default();
            parts.push(first);
            parts.extend(removals.into_iter().map(|r| RulesetDelta {
                remove: vec![r],
                upsert: vec![],
            }));
            parts.extend(it.map(|upsert| RulesetDelta {
                upsert,
                remove: vec![],
            }));
            // Removals must precede upserts of the same update; joining restores the order
            // (removals first), so the parts may come in any order.
            parts.into_iter().map(Body::Delta).collect()
        }
    }
}

/// Table shells (with chains and empty set definitions) first, then element chunks.
fn split_tables(tables: Vec<Table>, max: usize) -> Vec<Vec<Table>> {
    let mut shells = Vec::new();
    let mut chunks = Vec::new();
    for mut t in tables {
        let sets = std::mem::take(&mut t.sets);
        let mut shell = t.clone();
        for mut s in sets {
            // Moved into their chunks, not cloned: a snapshot's elements are most of the
            // brain's transient memory while it encodes one.
            let mut elements = std::mem::take(&mut s.elements).into_iter().peekable();
            shell.sets.push(s.clone());
            while elements.peek().is_some() {
                chunks.push(vec![Table {
                    family: t.family,
                    name: t.name.clone(),
                    comment: t.comment.clone(),
                    chains: Vec::new(),
                    sets: vec![Set {
                        elements: elements.by_ref().take(max).collect(),
                        ..s.clone()
                    }],
                }]);
            }
        }
        shells.push(shell);
    }
    let mut out = vec![shells];
    out.extend(chunks);
    out
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PartsError {
    #[error("parts of one update mix snapshot and delta")]
    Mixed,
    #[error("no parts")]
    Empty,
}

/// Joins the parts of one update back into one body.
pub fn join(parts: impl IntoIterator<Item = Body>) -> Result<Body, PartsError> {
    let mut acc: Option<Body> = None;
    for p in parts {
        acc = Some(match (acc, p) {
            (None, p) => p,
            (Some(Body::Snapshot(mut a)), Body::Snapshot(b)) => {
                merge_tables(&mut a.tables, b.tables);
                Body::Snapshot(a)
            }
            (Some(Body::Delta(mut a)), Body::Delta(b)) => {
                merge_tables(&mut a.upsert, b.upsert);
                merge_removals(&mut a.remove, b.remove);
                Body::Delta(a)
            }
            _ => return Err(PartsError::Mixed),
        });
    }
    acc.ok_or(PartsError::Empty)
}

fn merge_tables(into: &mut Vec<Table>, from: Vec<Table>) {
    for t in from {
        let Some(dst) = into
            .iter_mut()
            .find(|d| d.family == t.family && d.name == t.name)
        else {
            into.push(t);
            continue;
        };
        dst.chains.extend(t.chains);
        for s in t.sets {
            match dst.sets.iter_mut().find(|d| d.name == s.name) {
                Some(ds) => ds.elements.extend(s.elements),
                None => dst.sets.push(s),
            }
        }
    }
}

fn merge_removals(into: &mut Vec<TableRemoval>, from: Vec<TableRemoval>) {
    for r in from {
        let Some(dst) = into
            .iter_mut()
            .find(|d| d.family == r.family && d.name == r.name)
        else {
            into.push(r);
            continue;
        };
        dst.whole |= r.whole;
        dst.chains.extend(r.chains);
        dst.sets.extend(r.sets);
        for se in r.elements {
            match dst.elements.iter_mut().find(|d| d.set == se.set) {
                Some(d) => d.elements.extend(se.elements),
                None => dst.elements.push(se),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Model;
    use crate::v1::{Chain, Datum, Element, datum::Value};

    fn elem(k: u32) -> Element {
        Element {
            key: vec![Datum {
                value: Some(Value::U32(k)),
            }],
            ..Default::default()
        }
    }

    fn ruleset(range: std::ops::Range<u32>) -> Ruleset {
        Ruleset {
            tables: vec![Table {
                family: 2,
                name: "t".into(),
                comment: "c".into(),
                chains: vec![Chain {
                    name: "a".into(),
                    ..Default::default()
                }],
                sets: vec![
                    Set {
                        name: "s1".into(),
                        key: vec![4],
                        elements: range.clone().map(elem).collect(),
                        ..Default::default()
                    },
                    Set {
                        name: "s2".into(),
                        key: vec![4],
                        elements: range.map(|k| elem(k + 7)).collect(),
                        ..Default::default()
                    },
                ],
            }],
        }
    }

    #[test]
    fn snapshot_parts_join_to_the_same_model() {
        let r = ruleset(0..1000);
        let parts = split(Body::Snapshot(r.clone()), 64);
        assert!(parts.len() > 30, "{} parts", parts.len());
        let Body::Snapshot(joined) = join(parts).unwrap() else {
            panic!()
        };
        assert_eq!(
            Model::from_ruleset(&joined).to_ruleset(),
            Model::from_ruleset(&r).to_ruleset()
        );
    }

    #[test]
    fn delta_parts_join_to_the_same_effect() {
        let a = Model::from_ruleset(&ruleset(0..1000));
        let b = Model::from_ruleset(&ruleset(500..1700));
        let delta = a.diff(&b);
        let parts = split(Body::Delta(delta.clone()), 50);
        assert!(parts.len() > 10);
        let Body::Delta(joined) = join(parts).unwrap() else {
            panic!()
        };
        let mut via_parts = a.clone();
        via_parts.apply(&joined);
        assert_eq!(via_parts.digest(), b.digest());
        assert_eq!(join(vec![]), Err(PartsError::Empty));
        assert_eq!(
            join(vec![Body::Delta(delta), Body::Snapshot(Ruleset::default())]),
            Err(PartsError::Mixed)
        );
    }
}
