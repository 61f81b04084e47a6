//! An indexed view of a [`Ruleset`], shared by both ends of the stream: the brain diffs the model
//! it last sent against the model it wants, the actuator applies deltas to the model it last
//! committed. Keyed maps make a delta's cost follow the size of the change.
use std::collections::BTreeMap;

use crate::digest::element_key_bytes;
use crate::v1::{
    Chain, Element, Family, Ruleset, RulesetDelta, Set, SetElements, Table, TableRemoval,
};

/// Identifies a table: its family (as the kernel's NFPROTO number) and its name.
pub type TableKey = (i32, String);

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Model {
    pub tables: BTreeMap<TableKey, TableModel>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct TableModel {
    pub comment: String,
    pub chains: BTreeMap<String, Chain>,
    pub sets: BTreeMap<String, SetModel>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct SetModel {
    /// The set's definition, with `elements` empty.
    pub def: Set,
    /// Elements keyed by [`element_key_bytes`].
    pub elements: BTreeMap<Vec<u8>, Element>,
}

impl SetModel {
    pub fn new(mut def: Set) -> Self {
        let elements = std::mem::take(&mut def.elements)
            .into_iter()
            .map(|e| (element_key_bytes(&e), e))
            .collect();
        SetModel { def, elements }
    }
}

impl Model {
    pub fn from_ruleset(ruleset: &Ruleset) -> Self {
        let mut model = Model::default();
        for table in &ruleset.tables {
            let tm = model
                .tables
                .entry((table.family, table.name.clone()))
                .or_default();
            tm.comment = table.comment.clone();
            for chain in &table.chains {
                tm.chains.insert(chain.name.clone(), chain.clone());
            }
            for set in &table.sets {
                tm.sets.insert(set.name.clone(), SetModel::new(set.clone()));
            }
        }
        model
    }

    /// The canonical ruleset: tables, chains, sets and elements in key order.
    pub fn to_ruleset(&self) -> Ruleset {
        Ruleset {
            tables: self
                .tables
                .iter()
                .map(|((family, name), tm)| Table {
                    family: *family,
                    name: name.clone(),
                    comment: tm.comment.clone(),
                    chains: tm.chains.values().cloned().collect(),
                    sets: tm
                        .sets
                        .values()
                        .map(|sm| Set {
                            elements: sm.elements.values().cloned().collect(),
                            ..sm.def.clone()
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    /// SHA-256 of the canonical encoding, as carried in `Update.digest` and `Applied.digest`.
    pub fn digest(&self) -> Vec<u8> {
        crate::digest::digest(&self.to_ruleset())
    }

    pub fn element_count(&self) -> usize {
        self.tables
            .values()
            .flat_map(|t| t.sets.values())
            .map(|s| s.elements.len())
            .sum()
    }

    /// What turns `self` into `target`. Set definitions are immutable by name: a set whose
    /// definition changed is removed and re-created with all its elements.
    pub fn diff(&self, target: &Model) -> RulesetDelta {
        let mut delta = RulesetDelta::default();
        for key in self.tables.keys() {
            if !target.tables.contains_key(key) {
                delta.remove.push(TableRemoval {
                    family: key.0,
                    name: key.1.clone(),
                    whole: true,
                    ..Default::default()
                });
            }
        }
        let empty = TableModel::default();
        for (key, new) in &target.tables {
            let existing = self.tables.get(key);
            let old = existing.unwrap_or(&empty);
            let mut up = Table {
                family: key.0,
                name: key.1.clone(),
                comment: new.comment.clone(),
                ..Default::default()
            };
            let mut rm = TableRemoval {
                family: key.0,
                name: key.1.clone(),
                ..Default::default()
            };
            for name in old.chains.keys() {
                if !new.chains.contains_key(name) {
                    rm.chains.push(name.clone());
                }
            }
            for (name, chain) in &new.chains {
                if old.chains.get(name) != Some(chain) {
                    up.chains.push(chain.clone());
                }
            }
            for (name, old_set) in &old.sets {
                match new.sets.get(name) {
                    Some(new_set) if new_set.def == old_set.def => {
                        let gone: Vec<Element> = old_set
                            .elements
                            .iter()
                            .filter(|(k, _)| !new_set.elements.contains_key(*k))
                            .map(|(_, e)| key_only(e))
                            .collect();
                        if !gone.is_empty() {
                            rm.elements.push(SetElements {
                                set: name.clone(),
                                elements: gone,
                            });
                        }
                    }
                    _ => rm.sets.push(name.clone()),
                }
            }
            for (name, new_set) in &new.sets {
                let old_set = old.sets.get(name).filter(|s| s.def == new_set.def);
                let added: Vec<Element> = new_set
                    .elements
                    .iter()
                    .filter(|(k, e)| old_set.and_then(|s| s.elements.get(*k)) != Some(e))
                    .map(|(_, e)| e.clone())
                    .collect();
                if old_set.is_none() || !added.is_empty() {
                    up.sets.push(Set {
                        elements: added,
                        ..new_set.def.clone()
                    });
                }
            }
            let table_changed = existing.is_none() || old.comment != new.comment;
            if table_changed || !up.chains.is_empty() || !up.sets.is_empty() {
                delta.upsert.push(up);
            }
            if !rm.chains.is_empty() || !rm.sets.is_empty() || !rm.elements.is_empty() {
                delta.remove.push(rm);
            }
        }
        delta
    }

    /// Applies a delta: removals first, then upserts, as the protocol defines.
    pub fn apply(&mut self, delta: &RulesetDelta) {
        for rm in &delta.remove {
            let key = (rm.family, rm.name.clone());
            if rm.whole {
                self.tables.remove(&key);
                continue;
            }
            let Some(tm) = self.tables.get_mut(&key) else {
                continue;
            };
            for c in &rm.chains {
                tm.chains.remove(c);
            }
            for s in &rm.sets {
                tm.sets.remove(s);
            }
            for se in &rm.elements {
                if let Some(sm) = tm.sets.get_mut(&se.set) {
                    for e in &se.elements {
                        sm.elements.remove(&element_key_bytes(e));
                    }
                }
            }
        }
        for up in &delta.upsert {
            let tm = self.tables.entry((up.family, up.name.clone())).or_default();
            tm.comment = up.comment.clone();
            for c in &up.chains {
                tm.chains.insert(c.name.clone(), c.clone());
            }
            for s in &up.sets {
                let sm = tm.sets.entry(s.name.clone()).or_insert_with(|| {
                    SetModel::new(Set {
                        elements: Vec::new(),
                        ..s.clone()
                    })
                });
                for e in &s.elements {
                    sm.elements.insert(element_key_bytes(e), e.clone());
                }
            }
        }
    }
}

impl RulesetDelta {
    pub fn is_empty(&self) -> bool {
        self.upsert.is_empty() && self.remove.is_empty()
    }
}

/// The family of a table key as the generated enum, for display.
pub fn family_name(family: i32) -> &'static str {
    match Family::try_from(family) {
        Ok(Family::Ip) => "ip",
        Ok(Family::Ip6) => "ip6",
        Ok(Family::Inet) => "inet",
        _ => "unknown",
    }
}

fn key_only(e: &Element) -> Element {
    Element {
        key: e.key.clone(),
        key_end: e.key_end.clone(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{Datum, datum::Value};

    fn u32_elem(k: u32, d: u32) -> Element {
        Element {
            key: vec![Datum {
                value: Some(Value::U32(k)),
            }],
            data: vec![Datum {
                value: Some(Value::U32(d)),
            }],
            ..Default::default()
        }
    }

    fn ruleset(elems: Vec<Element>, chains: &[&str]) -> Ruleset {
        Ruleset {
            tables: vec![Table {
                family: Family::Ip as i32,
                name: "t".into(),
                chains: chains
                    .iter()
                    .map(|c| Chain {
                        name: c.to_string(),
                        ..Default::default()
                    })
                    .collect(),
                sets: vec![Set {
                    name: "m".into(),
                    key: vec![4],
                    data: vec![4],
                    elements: elems,
                    ..Default::default()
                }],
                ..Default::default()
            }],
        }
    }

    #[test]
    fn diff_then_apply_reaches_target() {
        let a = Model::from_ruleset(&ruleset(vec![u32_elem(1, 1), u32_elem(2, 2)], &["a", "b"]));
        let b = Model::from_ruleset(&ruleset(vec![u32_elem(2, 3), u32_elem(4, 4)], &["b", "c"]));
        let d = a.diff(&b);
        let mut applied = a.clone();
        applied.apply(&d);
        assert_eq!(applied, b);
        assert_eq!(applied.digest(), b.digest());
        // Only the changed element is re-sent, the removed one goes by key.
        assert_eq!(d.upsert[0].sets[0].elements.len(), 2);
        assert_eq!(d.remove[0].elements[0].elements.len(), 1);
        assert_eq!(d.remove[0].chains, vec!["a".to_string()]);
    }

    #[test]
    fn no_change_is_empty_delta() {
        let a = Model::from_ruleset(&ruleset(vec![u32_elem(1, 1)], &["a"]));
        assert!(a.diff(&a.clone()).is_empty());
        let mut empty = Model::default();
        let d = empty.diff(&a);
        empty.apply(&d);
        assert_eq!(empty, a);
        let back = a.diff(&Model::default());
        assert!(back.remove[0].whole);
    }
}
