//! Restating deltas: how a replica resumes a node that holds a state it never published.
//!
//! Replicas fold the same watch events in batches of their own, so under churn a node that
//! moves from one replica to another often holds a ruleset the new one never computed
//! (crate::api_state). Its digest then matches no remembered publication, and a plain delta
//! needs a base the brain knows. But the brain knows where the node's state lies: after the
//! newest of its publications whose API state the node's covers ([`History::window_start`]).
//! Every object the node holds differently from that publication was changed by an event
//! folded after it, so it is among the objects that changed in some step from that publication
//! to the latest. A restating delta gives each of those objects its value in the latest
//! publication, or removes it, so it takes any state in that window to the latest one. The
//! node applies it to what it holds and commits only if the digest it reaches is the brain's
//! (`Update.restating`, docs/protocol.md), so a wrong placement (an object that changed and
//! changed back inside one of this brain's batches, a deletion between two replicas' lists)
//! costs a NACK and a snapshot, never a wrong ruleset.
//!
//! What it costs: the objects that changed since the window's start, restated once for every
//! node in that window (the shared part is encoded once per window, like a delta), against a
//! snapshot of the whole cluster.
//!
//! [`History::window_start`]: crate::history::History::window_start
use std::collections::{BTreeMap, BTreeSet};

use imbl::ordmap::DiffItem;
use prost::Message;
use splitproxy_proto::model::{Model, SetModel, TableKey, TableModel};
use splitproxy_proto::v1::{Element, RulesetDelta, Set, SetElements, Table, TableRemoval};

/// Objects that changed in some step of a window, by key.
#[derive(Debug, Default)]
pub struct Touched {
    /// Tables created or removed: restated whole.
    tables: BTreeSet<TableKey>,
    /// Tables whose comment changed.
    comments: BTreeSet<TableKey>,
    chains: BTreeSet<(TableKey, String)>,
    /// Sets created, removed or redefined: restated whole.
    sets: BTreeSet<(TableKey, String)>,
    /// Elements added, changed or removed, by set: a set's names once, not once per element
    /// (the step log keeps thousands of these, crate::history::steps).
    elements: BTreeMap<(TableKey, String), BTreeSet<Box<[u8]>>>,
}

impl Touched {
    /// Adds the objects of a shared model that differ between `a` and `b` (two versions of
    /// one model share structure, so this costs what changed).
    pub fn shared_step(&mut self, a: &Model, b: &Model) {
        for item in a.tables.diff(&b.tables) {
            match item {
                DiffItem::Add(key, _) | DiffItem::Remove(key, _) => {
                    self.tables.insert(key.clone());
                }
                DiffItem::Update {
                    old: (key, old),
                    new: (_, new),
                } => self.table_step(key, old, new),
            }
        }
    }

    fn table_step(&mut self, key: &TableKey, old: &TableModel, new: &TableModel) {
        if old.comment != new.comment {
            self.comments.insert(key.clone());
        }
        for item in old.chains.diff(&new.chains) {
            let name = match item {
                DiffItem::Add(name, _) | DiffItem::Remove(name, _) => name,
                DiffItem::Update { new: (name, _), .. } => name,
            };
            self.chains.insert((key.clone(), name.clone()));
        }
        for item in old.sets.diff(&new.sets) {
            match item {
                DiffItem::Add(name, _) | DiffItem::Remove(name, _) => {
                    self.sets.insert((key.clone(), name.clone()));
                }
                DiffItem::Update {
                    old: (name, o),
                    new: (_, n),
                } if o.def != n.def => {
                    self.sets.insert((key.clone(), name.clone()));
                }
                DiffItem::Update {
                    old: (name, o),
                    new: (_, n),
                } => self.element_step(key, name, o, n),
            }
        }
    }

    fn element_step(&mut self, key: &TableKey, set: &str, old: &SetModel, new: &SetModel) {
        let mut changed = old
            .elements
            .diff(&new.elements)
            .map(|item| match item {
                DiffItem::Add(k, _) | DiffItem::Remove(k, _) => k,
                DiffItem::Update { new: (k, _), .. } => k,
            })
            .peekable();
        if changed.peek().is_some() {
            self.set_elements(key, set).extend(changed.cloned());
        }
    }

    /// The changed elements of one set, made on first use.
    fn set_elements(&mut self, key: &TableKey, set: &str) -> &mut BTreeSet<Box<[u8]>> {
        self.elements
            .entry((key.clone(), set.to_owned()))
            .or_default()
    }

    /// Adds the elements of a node's overlay that differ between `a` and `b`. An overlay
    /// holds only elements (its tables and sets are the shared model's, see
    /// [`crate::overlay::delta`]), so a set or table it gained or lost counts by its elements.
    pub fn overlay_step(&mut self, a: &Model, b: &Model) {
        for item in a.tables.diff(&b.tables) {
            match item {
                DiffItem::Add(key, t) | DiffItem::Remove(key, t) => {
                    for (name, s) in t.sets.iter() {
                        self.all_elements(key, name, s);
                    }
                }
                DiffItem::Update {
                    old: (key, old),
                    new: (_, new),
                } => {
                    for item in old.sets.diff(&new.sets) {
                        match item {
                            DiffItem::Add(name, s) | DiffItem::Remove(name, s) => {
                                self.all_elements(key, name, s)
                            }
                            DiffItem::Update {
                                old: (name, o),
                                new: (_, n),
                            } => self.element_step(key, name, o, n),
                        }
                    }
                }
            }
        }
    }

    fn all_elements(&mut self, key: &TableKey, set: &str, s: &SetModel) {
        if !s.elements.is_empty() {
            self.set_elements(key, set)
                .extend(s.elements.keys().cloned());
        }
    }

    /// Adds every object `step` names: the changes of a window are those of its steps.
    pub fn extend(&mut self, step: &CompactTouched) {
        self.tables.extend(step.tables.iter().cloned());
        self.comments.extend(step.comments.iter().cloned());
        self.chains.extend(step.chains.iter().cloned());
        self.sets.extend(step.sets.iter().cloned());
        for (set, elements) in step.elements.iter() {
            self.elements
                .entry(set.clone())
                .or_default()
                .extend(elements.iter().cloned());
        }
    }

    /// The same objects in flat arrays, to be kept (crate::history::steps).
    pub fn compact(self) -> CompactTouched {
        let flat = |s: BTreeSet<TableKey>| s.into_iter().collect();
        let named = |s: BTreeSet<(TableKey, String)>| s.into_iter().collect();
        CompactTouched {
            tables: flat(self.tables),
            comments: flat(self.comments),
            chains: named(self.chains),
            sets: named(self.sets),
            elements: self
                .elements
                .into_iter()
                .map(|(set, elements)| (set, elements.into_iter().collect()))
                .collect(),
        }
    }

    /// How many objects it names.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.tables.len()
            + self.comments.len()
            + self.chains.len()
            + self.sets.len()
            + self.elements.values().map(BTreeSet::len).sum::<usize>()
    }

    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
            && self.comments.is_empty()
            && self.chains.is_empty()
            && self.sets.is_empty()
            && self.elements.is_empty()
    }

    /// Whether the shared restatement replaces `set` of `table` whole (with the shared
    /// elements only), so that a node's own elements in it must be restated too.
    fn replaces_set(&self, table: &TableKey, set: &str) -> bool {
        self.tables.contains(table) || self.sets.contains(&(table.clone(), set.to_owned()))
    }
}

/// A step's [`Touched`], kept: the same objects in flat arrays. Ordered sets allocate a node of
/// eleven entries for even one, so a step's few objects (and each changed node's) cost some
/// kilobytes that way; here they cost about their size.
#[derive(Debug, Default)]
pub struct CompactTouched {
    tables: Box<[TableKey]>,
    comments: Box<[TableKey]>,
    chains: Box<[(TableKey, String)]>,
    sets: Box<[(TableKey, String)]>,
    elements: Box<[ChangedElements]>,
}

/// The changed elements of one set.
type ChangedElements = ((TableKey, String), Box<[Box<[u8]>]>);

impl CompactTouched {
    /// How many objects it names.
    pub fn len(&self) -> usize {
        self.tables.len()
            + self.comments.len()
            + self.chains.len()
            + self.sets.len()
            + self.elements.iter().map(|(_, e)| e.len()).sum::<usize>()
    }

    /// Whether it names nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One table's part of a restating delta.
#[derive(Default)]
struct TableParts {
    upsert: Option<Table>,
    sets: BTreeMap<String, Set>,
    remove: TableRemoval,
    removed_elements: BTreeMap<String, Vec<Element>>,
}

/// A restating delta under construction, table by table.
#[derive(Default)]
struct Builder {
    tables: BTreeMap<TableKey, TableParts>,
}

impl Builder {
    fn parts(&mut self, key: &TableKey) -> &mut TableParts {
        self.tables
            .entry(key.clone())
            .or_insert_with(|| TableParts {
                remove: TableRemoval {
                    family: key.0 as i32,
                    name: key.1.clone(),
                    ..Default::default()
                },
                ..Default::default()
            })
    }

    /// The table's upsert, carrying the comment `target` gives it.
    fn upsert(&mut self, key: &TableKey, target: &TableModel) -> &mut TableParts {
        let parts = self.parts(key);
        parts.upsert.get_or_insert_with(|| Table {
            family: key.0 as i32,
            name: key.1.clone(),
            comment: target.comment.clone(),
            ..Default::default()
        });
        parts
    }

    /// The set's upsert (its definition, no elements yet).
    fn set(&mut self, key: &TableKey, target: &TableModel, set: &SetModel) -> &mut Set {
        self.upsert(key, target)
            .sets
            .entry(set.def.name.clone())
            .or_insert_with(|| (*set.def).clone())
    }

    fn remove_element(&mut self, key: &TableKey, set: &str, element_key: &[u8]) {
        if let Ok(e) = Element::decode(element_key) {
            self.parts(key)
                .removed_elements
                .entry(set.to_owned())
                .or_default()
                .push(e);
        }
    }

    /// Restates an element as `target` has it: upserted if it holds it, removed otherwise.
    fn element(&mut self, target: &Model, key: &TableKey, set: &str, element_key: &[u8]) {
        let found = target.tables.get(key).and_then(|t| {
            let s = t.sets.get(set)?;
            let e = Element::decode(&s.elements.get(element_key)?[..]).ok()?;
            Some((t, s, e))
        });
        match found {
            Some((t, s, e)) => self.set(key, t, s).elements.push(e),
            None => self.remove_element(key, set, element_key),
        }
    }

    fn finish(self) -> RulesetDelta {
        let mut delta = RulesetDelta::default();
        for (_, mut parts) in self.tables {
            parts.remove.elements = parts
                .removed_elements
                .into_iter()
                .map(|(set, elements)| SetElements { set, elements })
                .collect();
            let r = &parts.remove;
            if r.whole || !r.chains.is_empty() || !r.sets.is_empty() || !r.elements.is_empty() {
                delta.remove.push(parts.remove);
            }
            if let Some(mut up) = parts.upsert {
                up.sets = parts.sets.into_values().collect();
                delta.upsert.push(up);
            }
        }
        delta
    }
}

/// The shared part of a restating delta: every object in `touched` as `target` (the latest
/// shared model) has it. A table or set created, removed or redefined in the window is removed
/// and sent again whole, so whatever the node held of it goes.
pub fn shared(target: &Model, touched: &Touched) -> RulesetDelta {
    let mut b = Builder::default();
    for key in &touched.tables {
        b.parts(key).remove.whole = true;
        if let Some(t) = target.tables.get(key) {
            let up = b.upsert(key, t);
            up.upsert.as_mut().expect("just made").chains =
                t.chains.values().map(|c| (**c).clone()).collect();
            for s in t.sets.values() {
                b.set(key, t, s).elements = s.decoded().collect();
            }
        }
    }
    for key in &touched.comments {
        if let Some(t) = target.tables.get(key) {
            b.upsert(key, t);
        }
    }
    for (key, name) in &touched.chains {
        if touched.tables.contains(key) {
            continue;
        }
        match target.tables.get(key) {
            Some(t) => match t.chains.get(name) {
                Some(c) => {
                    let up = b.upsert(key, t).upsert.as_mut().expect("just made");
                    up.chains.push((**c).clone());
                }
                None => b.parts(key).remove.chains.push(name.clone()),
            },
            None => b.parts(key).remove.chains.push(name.clone()),
        }
    }
    for (key, name) in &touched.sets {
        if touched.tables.contains(key) {
            continue;
        }
        b.parts(key).remove.sets.push(name.clone());
        if let Some(t) = target.tables.get(key)
            && let Some(s) = t.sets.get(name)
        {
            b.set(key, t, s).elements = s.decoded().collect();
        }
    }
    for ((key, set), elements) in &touched.elements {
        if touched.replaces_set(key, set) {
            continue;
        }
        for element in elements {
            b.element(target, key, set, element);
        }
    }
    b.finish()
}

/// A node's own part of a restating delta: every element of its overlay that changed in the
/// window (`own`), and every element it has in a table or set the shared part replaces whole
/// (`shared`), as `target` (its latest overlay) has it. Element changes only, as
/// [`crate::overlay::delta`] sends them: tables and sets are the shared model's.
pub fn own(target: &Model, own: &Touched, shared: &Touched) -> RulesetDelta {
    let mut b = Builder::default();
    for ((key, set), elements) in &own.elements {
        for element in elements {
            b.element(target, key, set, element);
        }
    }
    for (key, t) in target.tables.iter() {
        for (name, s) in t.sets.iter() {
            if shared.replaces_set(key, name) {
                b.set(key, t, s).elements = s.decoded().collect();
            }
        }
    }
    b.finish()
}

#[cfg(test)]
mod tests;
