//! An indexed, persistent view of a [`Ruleset`], shared by both ends of the stream: the brain
//! keeps one per published version and diffs the version a node acked against the latest; the
//! actuator applies deltas to the model it last committed.
//!
//! Why persistent maps: cloning a model is O(1) and two versions of one model share every
//! subtree that did not change, so [`Model::diff`] skips shared subtrees and costs what changed,
//! not what exists ("cost follows the change", docs/invariants.md). Why an additive digest: the digest is a sum of per-object
//! hashes, updated on every insert and remove, so proving what a node holds never re-hashes the
//! whole ruleset.
//!
//! Elements are kept encoded (key bytes -> protobuf bytes): at 100k elements that is a few MB
//! rather than tens of MB of nested structs, which matters on every node.
use std::sync::Arc;

use imbl::OrdMap;
use imbl::ordmap::DiffItem;
use prost::Message;
use sha2::{Digest, Sha256};

use crate::v1::{
    Chain, Element, Family, Ruleset, RulesetDelta, Set, SetElements, Table, TableRemoval,
};

/// Identifies a table: its family and its name. A wire family number that names no family
/// reads as [`Family::Unspecified`] (the message getters' rule); no valid table has that family,
/// so the actuator refuses such a table rather than applying it.
pub type TableKey = (Family, String);

/// `set` without its elements. A snapshot part's sets carry a thousand elements each, so
/// cloning the set and then dropping them cost a node's first apply a copy of every element;
/// every field is named (no `..`), so a field added to `Set` must be added here.
fn definition(set: &Set) -> Set {
    let Set {
        name,
        key,
        data,
        interval,
        timeout,
        default_timeout_ms,
        dynamic,
        comment,
        elements: _,
        conntrack,
        guards,
    } = set;
    Set {
        name: name.clone(),
        key: key.clone(),
        data: data.clone(),
        interval: *interval,
        timeout: *timeout,
        default_timeout_ms: *default_timeout_ms,
        dynamic: *dynamic,
        comment: comment.clone(),
        elements: Vec::new(),
        conntrack: *conntrack,
        guards: guards.clone(),
    }
}

/// The key of a table message (an upsert or a removal).
fn key_of(family: Family, name: &str) -> TableKey {
    (family, name.to_owned())
}

/// The bytes that identify an element within its set: its key and, for intervals, its end.
pub fn element_key_bytes(element: &Element) -> Box<[u8]> {
    Element {
        key: element.key.clone(),
        key_end: element.key_end.clone(),
        ..Default::default()
    }
    .encode_to_vec()
    .into_boxed_slice()
}

/// Sorts a ruleset into the canonical order [`Model::to_ruleset`] produces.
pub fn canonicalize(ruleset: &mut Ruleset) {
    ruleset
        .tables
        .sort_by(|a, b| (a.family, &a.name).cmp(&(b.family, &b.name)));
    for table in &mut ruleset.tables {
        table.chains.sort_by(|a, b| a.name.cmp(&b.name));
        table.sets.sort_by(|a, b| a.name.cmp(&b.name));
        for set in &mut table.sets {
            set.elements.sort_by_cached_key(element_key_bytes);
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Model {
    pub tables: OrdMap<TableKey, TableModel>,
    /// Sum (mod 2^128) of the hashes of every object; see [`Model::digest`].
    sum: u128,
    /// The part of `sum` that comes from set elements.
    element_sum: u128,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct TableModel {
    pub comment: String,
    pub chains: OrdMap<String, Arc<Chain>>,
    pub sets: OrdMap<String, SetModel>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct SetModel {
    /// The set's definition, with `elements` empty.
    pub def: Arc<Set>,
    /// Encoded elements keyed by [`element_key_bytes`].
    pub elements: OrdMap<Box<[u8]>, Box<[u8]>>,
}

impl SetModel {
    pub fn len(&self) -> usize {
        self.elements.len()
    }

    pub fn is_empty(&self) -> bool {
        self.elements.is_empty()
    }

    /// The element with this key, decoded.
    pub fn get(&self, key: &[u8]) -> Option<Element> {
        self.elements
            .get(key)
            .and_then(|b| Element::decode(&b[..]).ok())
    }

    /// Every element, decoded, in key order.
    pub fn decoded(&self) -> impl Iterator<Item = Element> + '_ {
        self.elements
            .values()
            .filter_map(|b| Element::decode(&b[..]).ok())
    }
}

/// Hash of one object as a number, so that the digest of a model is the sum of its objects'.
fn object_hash(parts: &[&[u8]]) -> u128 {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    let d = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    u128::from_le_bytes(b)
}

fn table_hash(key: &TableKey, comment: &str) -> u128 {
    object_hash(&[
        b"table",
        &(key.0 as i32).to_le_bytes(),
        key.1.as_bytes(),
        comment.as_bytes(),
    ])
}

fn chain_hash(key: &TableKey, chain: &Chain) -> u128 {
    object_hash(&[
        b"chain",
        &(key.0 as i32).to_le_bytes(),
        key.1.as_bytes(),
        &chain.encode_to_vec(),
    ])
}

fn set_hash(key: &TableKey, def: &Set) -> u128 {
    object_hash(&[
        b"set",
        &(key.0 as i32).to_le_bytes(),
        key.1.as_bytes(),
        &def.encode_to_vec(),
    ])
}

fn element_hash(key: &TableKey, set: &str, encoded: &[u8]) -> u128 {
    object_hash(&[
        b"element",
        &(key.0 as i32).to_le_bytes(),
        key.1.as_bytes(),
        set.as_bytes(),
        encoded,
    ])
}

impl Model {
    pub fn from_ruleset(ruleset: &Ruleset) -> Self {
        let mut model = Model::default();
        model.upsert(&ruleset.tables);
        model
    }

    /// The canonical ruleset: tables, chains, sets and elements in key order.
    pub fn to_ruleset(&self) -> Ruleset {
        self.ruleset_with(|sm| Set {
            elements: sm.decoded().collect(),
            ..(*sm.def).clone()
        })
    }

    /// The canonical ruleset without any set's elements: tables, chains and set definitions.
    pub fn shells(&self) -> Ruleset {
        self.ruleset_with(|sm| (*sm.def).clone())
    }

    fn ruleset_with(&self, set: impl Fn(&SetModel) -> Set) -> Ruleset {
        Ruleset {
            tables: self
                .tables
                .iter()
                .map(|((family, name), tm)| Table {
                    family: *family as i32,
                    name: name.clone(),
                    comment: tm.comment.clone(),
                    chains: tm.chains.values().map(|c| (**c).clone()).collect(),
                    sets: tm.sets.values().map(&set).collect(),
                })
                .collect(),
        }
    }

    /// 16 bytes identifying the content: the sum of per-object SHA-256 prefixes. Equal models
    /// have equal digests however they were built.
    pub fn digest(&self) -> Vec<u8> {
        self.sum.to_le_bytes().to_vec()
    }

    /// The digest of this model with `overlay`'s elements added (a node's table: the shared
    /// model plus its own elements, in sets this model defines). Valid when no element of the
    /// overlay has a key this model holds in the same set.
    pub fn digest_with(&self, overlay: &Model) -> Vec<u8> {
        self.sum
            .wrapping_add(overlay.element_sum)
            .to_le_bytes()
            .to_vec()
    }

    pub fn element_count(&self) -> usize {
        self.tables
            .values()
            .flat_map(|t| t.sets.values())
            .map(|s| s.len())
            .sum()
    }

    pub fn set(&self, table: &TableKey, name: &str) -> Option<&SetModel> {
        self.tables.get(table)?.sets.get(name)
    }

    // ---- mutation, keeping the digest ----

    /// Creates the table if missing, or sets its comment.
    pub fn upsert_table(&mut self, key: &TableKey, comment: &str) {
        match self.tables.get_mut(key) {
            Some(tm) => {
                if tm.comment != comment {
                    self.sum = self
                        .sum
                        .wrapping_sub(table_hash(key, &tm.comment))
                        .wrapping_add(table_hash(key, comment));
                    tm.comment = comment.to_string();
                }
            }
            None => {
                self.sum = self.sum.wrapping_add(table_hash(key, comment));
                self.tables.insert(
                    key.clone(),
                    TableModel {
                        comment: comment.into(),
                        ..Default::default()
                    },
                );
            }
        }
    }

    pub fn remove_table(&mut self, key: &TableKey) {
        let Some(tm) = self.tables.remove(key) else {
            return;
        };
        let mut sub = table_hash(key, &tm.comment);
        for c in tm.chains.values() {
            sub = sub.wrapping_add(chain_hash(key, c));
        }
        let mut elements = 0u128;
        for (name, s) in tm.sets.iter() {
            sub = sub.wrapping_add(set_hash(key, &s.def));
            for e in s.elements.values() {
                elements = elements.wrapping_add(element_hash(key, name, e));
            }
        }
        self.sum = self.sum.wrapping_sub(sub).wrapping_sub(elements);
        self.element_sum = self.element_sum.wrapping_sub(elements);
    }

    pub fn upsert_chain(&mut self, key: &TableKey, chain: Chain) {
        self.upsert_table_if_missing(key);
        let Some(tm) = self.tables.get_mut(key) else {
            return;
        };
        let new = chain_hash(key, &chain);
        if let Some(old) = tm.chains.insert(chain.name.clone(), Arc::new(chain)) {
            self.sum = self.sum.wrapping_sub(chain_hash(key, &old));
        }
        self.sum = self.sum.wrapping_add(new);
    }

    pub fn remove_chain(&mut self, key: &TableKey, name: &str) {
        if let Some(tm) = self.tables.get_mut(key)
            && let Some(old) = tm.chains.remove(name)
        {
            self.sum = self.sum.wrapping_sub(chain_hash(key, &old));
        }
    }

    /// Creates the set if missing. A set whose definition differs is replaced (and emptied).
    pub fn upsert_set(&mut self, key: &TableKey, def: &Set) {
        let def = definition(def);
        let same = self.set(key, &def.name).is_some_and(|s| *s.def == def);
        if same {
            return;
        }
        self.remove_set(key, &def.name);
        self.upsert_table_if_missing(key);
        if let Some(tm) = self.tables.get_mut(key) {
            self.sum = self.sum.wrapping_add(set_hash(key, &def));
            tm.sets.insert(
                def.name.clone(),
                SetModel {
                    def: Arc::new(def),
                    elements: OrdMap::new(),
                },
            );
        }
    }

    pub fn remove_set(&mut self, key: &TableKey, name: &str) {
        let Some(tm) = self.tables.get_mut(key) else {
            return;
        };
        let Some(sm) = tm.sets.remove(name) else {
            return;
        };
        let mut elements = 0u128;
        for e in sm.elements.values() {
            elements = elements.wrapping_add(element_hash(key, name, e));
        }
        self.sum = self
            .sum
            .wrapping_sub(set_hash(key, &sm.def))
            .wrapping_sub(elements);
        self.element_sum = self.element_sum.wrapping_sub(elements);
    }

    /// Inserts or replaces an element (encoded) in an existing set; false if the set is absent.
    pub fn insert_element(
        &mut self,
        key: &TableKey,
        set: &str,
        elem_key: Box<[u8]>,
        encoded: Box<[u8]>,
    ) -> bool {
        let Some(sm) = self.tables.get_mut(key).and_then(|t| t.sets.get_mut(set)) else {
            return false;
        };
        let add = element_hash(key, set, &encoded);
        if let Some(old) = sm.elements.insert(elem_key, encoded) {
            let sub = element_hash(key, set, &old);
            self.sum = self.sum.wrapping_sub(sub);
            self.element_sum = self.element_sum.wrapping_sub(sub);
        }
        self.sum = self.sum.wrapping_add(add);
        self.element_sum = self.element_sum.wrapping_add(add);
        true
    }

    pub fn remove_element(&mut self, key: &TableKey, set: &str, elem_key: &[u8]) {
        if let Some(sm) = self.tables.get_mut(key).and_then(|t| t.sets.get_mut(set))
            && let Some(old) = sm.elements.remove(elem_key)
        {
            let sub = element_hash(key, set, &old);
            self.sum = self.sum.wrapping_sub(sub);
            self.element_sum = self.element_sum.wrapping_sub(sub);
        }
    }

    fn upsert_table_if_missing(&mut self, key: &TableKey) {
        if !self.tables.contains_key(key) {
            self.upsert_table(key, "");
        }
    }

    /// Applies a delta: removals first, then upserts, as the protocol defines.
    pub fn apply(&mut self, delta: &RulesetDelta) {
        for rm in &delta.remove {
            let key = key_of(rm.family(), &rm.name);
            if rm.whole {
                self.remove_table(&key);
                continue;
            }
            for c in &rm.chains {
                self.remove_chain(&key, c);
            }
            for s in &rm.sets {
                self.remove_set(&key, s);
            }
            for se in &rm.elements {
                for e in &se.elements {
                    self.remove_element(&key, &se.set, &element_key_bytes(e));
                }
            }
        }
        self.upsert(&delta.upsert);
    }

    /// A delta's upserts: tables, chains and sets created or replaced, elements added.
    fn upsert(&mut self, tables: &[Table]) {
        for up in tables {
            let key = key_of(up.family(), &up.name);
            self.upsert_table(&key, &up.comment);
            for c in &up.chains {
                self.upsert_chain(&key, c.clone());
            }
            for s in &up.sets {
                self.upsert_set(&key, s);
                for e in &s.elements {
                    self.insert_element(
                        &key,
                        &s.name,
                        element_key_bytes(e),
                        e.encode_to_vec().into_boxed_slice(),
                    );
                }
            }
        }
    }

    /// What turns `self` into `target`. Versions of one model share structure, and shared
    /// subtrees are skipped, so this costs what changed. Set definitions are immutable by name:
    /// a set whose definition changed is removed and re-created with all its elements.
    pub fn diff(&self, target: &Model) -> RulesetDelta {
        let mut delta = RulesetDelta::default();
        let empty = TableModel::default();
        let mut touched: Vec<(&TableKey, Option<&TableModel>, &TableModel)> = Vec::new();
        for item in self.tables.diff(&target.tables) {
            match item {
                DiffItem::Add(k, new) => touched.push((k, None, new)),
                DiffItem::Update {
                    old: (k, old),
                    new: (_, new),
                } => touched.push((k, Some(old), new)),
                DiffItem::Remove(k, _) => delta.remove.push(TableRemoval {
                    family: k.0 as i32,
                    name: k.1.clone(),
                    whole: true,
                    ..Default::default()
                }),
            }
        }
        for (key, existing, new) in touched {
            let old = existing.unwrap_or(&empty);
            let mut up = Table {
                family: key.0 as i32,
                name: key.1.clone(),
                comment: new.comment.clone(),
                ..Default::default()
            };
            let mut rm = TableRemoval {
                family: key.0 as i32,
                name: key.1.clone(),
                ..Default::default()
            };
            for item in old.chains.diff(&new.chains) {
                match item {
                    DiffItem::Add(_, c) | DiffItem::Update { new: (_, c), .. } => {
                        up.chains.push((**c).clone())
                    }
                    DiffItem::Remove(name, _) => rm.chains.push(name.clone()),
                }
            }
            for item in old.sets.diff(&new.sets) {
                match item {
                    DiffItem::Add(_, s) => up.sets.push(Set {
                        elements: s.decoded().collect(),
                        ..(*s.def).clone()
                    }),
                    DiffItem::Remove(name, _) => rm.sets.push(name.clone()),
                    DiffItem::Update {
                        old: (name, o),
                        new: (_, n),
                    } if o.def != n.def => {
                        rm.sets.push(name.clone());
                        up.sets.push(Set {
                            elements: n.decoded().collect(),
                            ..(*n.def).clone()
                        });
                    }
                    DiffItem::Update {
                        old: (name, o),
                        new: (_, n),
                    } => {
                        let mut added = Vec::new();
                        let mut gone = Vec::new();
                        for e in o.elements.diff(&n.elements) {
                            match e {
                                DiffItem::Add(_, b) | DiffItem::Update { new: (_, b), .. } => {
                                    if let Ok(el) = Element::decode(&b[..]) {
                                        added.push(el);
                                    }
                                }
                                DiffItem::Remove(k, _) => {
                                    if let Ok(el) = Element::decode(&k[..]) {
                                        gone.push(el);
                                    }
                                }
                            }
                        }
                        if !added.is_empty() {
                            up.sets.push(Set {
                                elements: added,
                                ..(*n.def).clone()
                            });
                        }
                        if !gone.is_empty() {
                            rm.elements.push(SetElements {
                                set: name.clone(),
                                elements: gone,
                            });
                        }
                    }
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
}

impl RulesetDelta {
    pub fn is_empty(&self) -> bool {
        self.upsert.is_empty() && self.remove.is_empty()
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

    /// Tables of every family, in an order neither canonical nor by family.
    fn families() -> Ruleset {
        let table = |family: Family, name: &str| Table {
            family: family as i32,
            name: name.into(),
            chains: vec![Chain {
                name: "c".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        Ruleset {
            tables: vec![
                table(Family::Ip6, "a"),
                table(Family::Inet, "b"),
                table(Family::Ip, "b"),
                table(Family::Ip, "a"),
            ],
        }
    }

    #[test]
    fn tables_are_keyed_by_family_in_wire_order() {
        let model = Model::from_ruleset(&families());
        let keys: Vec<TableKey> = model.tables.keys().cloned().collect();
        assert_eq!(
            keys,
            [
                (Family::Inet, "b".to_string()),
                (Family::Ip, "a".to_string()),
                (Family::Ip, "b".to_string()),
                (Family::Ip6, "a".to_string()),
            ]
        );
        // The typed keys sort as the wire numbers do, so the model's order is canonical.
        let mut canonical = families();
        canonicalize(&mut canonical);
        assert_eq!(model.to_ruleset(), canonical);
    }

    #[test]
    fn digest_hashes_the_wire_family() {
        // Pinned (computed independently of this code): the digest is what both ends of the
        // stream compare, across versions too, and hashes the family as its wire number.
        let hex: String = Model::from_ruleset(&families())
            .digest()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(hex, "6ca64dff41c399f7651763e990ca7f37");
    }

    #[test]
    fn a_set_keeps_its_definition_apart_from_its_elements() {
        let rs = ruleset(vec![u32_elem(1, 10), u32_elem(2, 20)], &["c"]);
        let model = Model::from_ruleset(&rs);
        let key = (Family::Ip, "t".to_string());
        let sm = model.set(&key, "m").expect("the set");
        // The definition holds every field but the elements, which the model keys itself.
        let mut def = rs.tables[0].sets[0].clone();
        def.elements.clear();
        assert_eq!(*sm.def, def);
        assert_eq!(sm.len(), 2);
        assert_eq!(model.to_ruleset().tables[0].sets, rs.tables[0].sets);
    }

    #[test]
    fn unknown_wire_family_is_unspecified() {
        let mut r = families();
        r.tables.truncate(1);
        r.tables[0].family = 7;
        let model = Model::from_ruleset(&r);
        assert!(
            model
                .tables
                .contains_key(&(Family::Unspecified, "a".to_string()))
        );
    }

    #[test]
    fn diff_then_apply_reaches_target() {
        let a = Model::from_ruleset(&ruleset(vec![u32_elem(1, 1), u32_elem(2, 2)], &["a", "b"]));
        let b = Model::from_ruleset(&ruleset(vec![u32_elem(2, 3), u32_elem(4, 4)], &["b", "c"]));
        let d = a.diff(&b);
        let mut applied = a.clone();
        applied.apply(&d);
        assert_eq!(applied.to_ruleset(), b.to_ruleset());
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
        assert_eq!(empty.to_ruleset(), a.to_ruleset());
        assert_eq!(empty.digest(), a.digest());
        let back = a.diff(&Model::default());
        assert!(back.remove[0].whole);
    }

    #[test]
    fn digest_depends_on_content_not_history() {
        let mut a =
            Model::from_ruleset(&ruleset((0..50).map(|i| u32_elem(i, i)).collect(), &["a"]));
        let b = Model::from_ruleset(&ruleset((10..60).map(|i| u32_elem(i, i)).collect(), &["a"]));
        assert_ne!(a.digest(), b.digest());
        let d = a.diff(&b);
        a.apply(&d);
        assert_eq!(a.digest(), b.digest());
        // Removing everything returns the digest of an empty model.
        a.apply(&a.diff(&Model::default()));
        assert_eq!(a.digest(), Model::default().digest());
    }

    #[test]
    fn versions_share_structure_and_diff_costs_the_change() {
        let big = Model::from_ruleset(&ruleset(
            (0..100_000).map(|i| u32_elem(i, i)).collect(),
            &["a"],
        ));
        let mut next = big.clone();
        let t = (Family::Ip, "t".to_string());
        next.insert_element(
            &t,
            "m",
            element_key_bytes(&u32_elem(7, 7)),
            u32_elem(7, 8).encode_to_vec().into(),
        );
        next.remove_element(&t, "m", &element_key_bytes(&u32_elem(9, 9)));
        let start = std::time::Instant::now();
        let d = big.diff(&next);
        let took = start.elapsed();
        assert_eq!(d.upsert[0].sets[0].elements.len(), 1);
        assert_eq!(d.remove[0].elements[0].elements.len(), 1);
        // A linear walk of 100k elements takes milliseconds; skipping shared subtrees does not.
        assert!(
            took < std::time::Duration::from_millis(20),
            "diff took {took:?}"
        );
    }
}
