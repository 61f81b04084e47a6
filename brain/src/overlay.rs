//! Per-node overlays: the elements only one node holds, on top of the shared ruleset
//! ([`crate::desired`]).
//!
//! A node's table is the shared model plus its overlay: the addresses its NodePorts answer on,
//! its local endpoints of Local-policy Services, its topology choice, hairpin pairs for its
//! endpoints, its health check counts, the load balancer IPs it admits as sources. The overlay holds only elements, in sets the shared
//! model defines, and never a key the shared model holds in the same set, so the node's digest
//! is the sum of both and the shared part of every update stays encoded once for all nodes.
//!
//! A change to a Service recomputes the overlays of the nodes that hold or held a share of it
//! (usually the few hosting its endpoints), so the cost follows the change.
use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::sync::Arc;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use prost::Message;
use splitproxy_proto::family::{IpFamily, PerFamily};
use splitproxy_proto::model::{Model, TableKey, element_key_bytes};
use splitproxy_proto::v1::{Element, RulesetDelta, SetElements, TableRemoval};

use crate::desired::SharedRuleset;
use crate::index::Index;
use crate::objects::{NodeInfo, ObjectKey};
use crate::rules::RulesConfig;
use crate::rules::contribution::{self, Contribution, ServiceEndpoints};
use crate::rules::sets::DynSet;

/// Every node's overlay, by node name. Persistent, so a publication clones it in O(1). Every
/// update the brain sends looks its node up here, thousands per publication: in a churn profile
/// the lookup was 3.7 % of the brain's CPU, of it 0.55 % SipHash (imbl's default hasher), which
/// foldhash removes. The rest is the walk through the trie, mostly cache misses.
pub type NodeOverlays = imbl::GenericHashMap<
    String,
    Arc<Model>,
    foldhash::quality::RandomState,
    imbl::shared_ptr::DefaultSharedPtr,
>;

/// What one Service (or the node's facts) puts in a node's overlay, per family.
type Share = PerFamily<Kept>;

/// A set of the shared model, named without allocating.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum SetRef {
    Fixed(&'static str),
    Dynamic(DynSet),
}

impl SetRef {
    fn name(self) -> Cow<'static, str> {
        match self {
            SetRef::Fixed(s) => Cow::Borrowed(s),
            SetRef::Dynamic(d) => Cow::Owned(d.name()),
        }
    }
}

/// (set, element key, encoded element).
type KeptElement = (SetRef, Box<[u8]>, Box<[u8]>);

/// A contribution as an overlay keeps it: its elements keyed as the model keys them and sorted,
/// and the dynamic sets they use. A node keeps one per Service with an endpoint on it (100k at
/// 5,000 nodes), and decoded contributions took several times the memory.
#[derive(Debug, Default, PartialEq, Eq)]
struct Kept {
    /// Sorted by set and key.
    elements: Box<[KeptElement]>,
    /// One entry per element in a dynamic set (each holds the set once).
    dynamic: Box<[DynSet]>,
}

impl Kept {
    fn of(c: &Contribution) -> Kept {
        let mut elements: Vec<_> = c
            .elements
            .iter()
            .map(|(set, e)| (SetRef::Fixed(set), e))
            .chain(c.dynamic.iter().map(|(d, e)| (SetRef::Dynamic(*d), e)))
            .map(|(set, e)| {
                (
                    set,
                    element_key_bytes(e),
                    e.encode_to_vec().into_boxed_slice(),
                )
            })
            .collect();
        elements.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        // A key listed twice counts once, as in a map.
        elements.dedup_by(|b, a| (a.0, &a.1) == (b.0, &b.1));
        Kept {
            elements: elements.into_boxed_slice(),
            dynamic: c.dynamic.iter().map(|(d, _)| *d).collect(),
        }
    }

    fn is_empty(&self) -> bool {
        self.elements.is_empty() && self.dynamic.is_empty()
    }
}

/// The shares `contribution` computes for each family, as kept.
fn kept(contribution: impl Fn(IpFamily) -> Contribution) -> Share {
    PerFamily::from_fn(|family| Kept::of(&contribution(family)))
}

#[derive(Default)]
struct NodeOverlay {
    model: Model,
    /// The node facts the overlay was computed from.
    info: NodeInfo,
    facts: Share,
    shares: HashMap<ObjectKey, Share>,
    /// Elements (family, set, key) used by more than one share, with the number of uses beyond
    /// the first: two Services may share a pod (hairpin). Most elements have one use and no
    /// entry.
    extra_uses: HashMap<(IpFamily, String, Box<[u8]>), usize>,
}

impl NodeOverlay {
    /// Gives back the dynamic sets this overlay uses.
    fn release(&self, desired: &mut SharedRuleset) {
        for share in std::iter::once(&self.facts).chain(self.shares.values()) {
            for (family, k) in share.iter() {
                for d in &k.dynamic {
                    desired.release(family, *d);
                }
            }
        }
    }

    /// One more use of an element; the first puts it in the model.
    fn add_use(
        &mut self,
        desired: &SharedRuleset,
        (family, table): (IpFamily, &TableKey),
        set: SetRef,
        key: &[u8],
        value: &[u8],
    ) {
        let name = set.name();
        let present = self
            .model
            .set(table, &name)
            .is_some_and(|s| s.elements.contains_key(key));
        if present {
            *self
                .extra_uses
                .entry((family, name.into_owned(), key.into()))
                .or_default() += 1;
            return;
        }
        if self.model.set(table, &name).is_none() {
            let Some(def) = desired.set_def(family, &name) else {
                tracing::warn!(set = %name, "overlay element for a set the shared model lacks");
                return;
            };
            self.model.upsert_table(table, "rules for splitproxy");
            self.model.upsert_set(table, &def);
        }
        self.model
            .insert_element(table, &name, key.into(), value.into());
    }

    /// One use fewer; the last takes it out of the model.
    fn remove_use(&mut self, (family, table): (IpFamily, &TableKey), set: SetRef, key: &[u8]) {
        let name = set.name();
        let rk = (family, name.into_owned(), Box::<[u8]>::from(key));
        match self.extra_uses.get_mut(&rk) {
            Some(c) => {
                *c -= 1;
                if *c == 0 {
                    self.extra_uses.remove(&rk);
                }
            }
            None => self.model.remove_element(table, &rk.1, key),
        }
    }
}

pub struct Overlays {
    config: RulesConfig,
    nodes: HashMap<String, NodeOverlay>,
    /// Nodes holding a share of each Service.
    by_service: HashMap<ObjectKey, BTreeSet<String>>,
    /// Services whose endpoints name each node (known to the index or not), so that a node
    /// appearing later gets its shares.
    by_node_name: HashMap<String, HashSet<ObjectKey>>,
    node_names_of: HashMap<ObjectKey, HashSet<String>>,
    /// Services any node may hold a share of, recomputed when a Node changes (topology hints,
    /// source ranges judged on the node's addresses).
    everywhere: HashSet<ObjectKey>,
    /// The shared model's layout these overlays were computed against.
    layout: u64,
    /// Nodes whose overlay changed since [`Overlays::take_changed`].
    changed: HashSet<String>,
    /// Endpoints the shared state computed for this publication ([`SharedRuleset::take_endpoints`]).
    computed: HashMap<ObjectKey, Arc<ServiceEndpoints>>,
}

impl Overlays {
    pub fn new(config: RulesConfig) -> Self {
        Overlays {
            config,
            nodes: HashMap::new(),
            by_service: HashMap::new(),
            by_node_name: HashMap::new(),
            node_names_of: HashMap::new(),
            everywhere: HashSet::new(),
            layout: 0,
            changed: HashSet::new(),
            computed: HashMap::new(),
        }
    }

    pub fn model(&self, node: &str) -> Option<&Model> {
        self.nodes.get(node).map(|n| &n.model)
    }

    /// Nodes whose overlay changed since the last call.
    pub fn take_changed(&mut self) -> HashSet<String> {
        std::mem::take(&mut self.changed)
    }

    /// Recomputes every overlay. `desired` was just rebuilt (its dynamic set counts start from
    /// the shared state alone), so nothing is released.
    pub fn rebuild(&mut self, index: &Index, desired: &mut SharedRuleset) {
        self.computed = desired.take_endpoints();
        self.changed.extend(self.nodes.keys().cloned());
        self.nodes.clear();
        self.by_service.clear();
        self.by_node_name.clear();
        self.node_names_of.clear();
        self.everywhere.clear();
        self.layout = desired.layout();
        let names: Vec<String> = index.nodes().map(|n| n.name.clone()).collect();
        self.update_nodes(index, desired, names.iter());
        let keys: Vec<ObjectKey> = index.services().map(|s| s.key.clone()).collect();
        self.update_services(index, desired, keys.iter());
        self.computed.clear();
    }

    /// Brings overlays up to date after Services (`services`) and Nodes (`nodes`) changed.
    pub fn update<'a>(
        &mut self,
        index: &Index,
        desired: &mut SharedRuleset,
        services: impl Iterator<Item = &'a ObjectKey>,
        nodes: impl Iterator<Item = &'a String>,
    ) {
        if desired.layout() != self.layout {
            // A table appeared or went: recompute everything against the new layout, giving
            // back the dynamic sets the old overlays held.
            self.release_all(desired);
            self.rebuild(index, desired);
            return;
        }
        self.computed = desired.take_endpoints();
        let nodes: Vec<&String> = nodes.collect();
        self.update_nodes(index, desired, nodes.into_iter());
        self.update_services(index, desired, services);
        self.computed.clear();
    }

    fn release_all(&mut self, desired: &mut SharedRuleset) {
        for n in self.nodes.values() {
            n.release(desired);
        }
    }

    /// Nodes added, changed or removed: their facts, and every Service share that depends on
    /// the node (topology, endpoints naming it).
    fn update_nodes<'a>(
        &mut self,
        index: &Index,
        desired: &mut SharedRuleset,
        names: impl Iterator<Item = &'a String>,
    ) {
        for name in names {
            let Some(info) = index.node(name) else {
                if let Some(gone) = self.nodes.remove(name) {
                    gone.release(desired);
                    for svc in gone.shares.keys() {
                        if let Some(s) = self.by_service.get_mut(svc) {
                            s.remove(name);
                        }
                    }
                    self.changed.insert(name.clone());
                }
                continue;
            };
            let known = self.nodes.get(name).is_some_and(|n| n.info == *info);
            if known {
                continue;
            }
            let facts = kept(|family| contribution::node_facts(&self.config, info, family));
            let overlay = self.nodes.entry(name.clone()).or_default();
            overlay.info = info.clone();
            let old = std::mem::take(&mut overlay.facts);
            replace(overlay, desired, &old, &facts);
            overlay.facts = facts;
            self.changed.insert(name.clone());
            let mut affected: HashSet<ObjectKey> = self.everywhere.clone();
            affected.extend(self.by_node_name.get(name).into_iter().flatten().cloned());
            affected.extend(overlay.shares.keys().cloned());
            let affected: Vec<ObjectKey> = affected.into_iter().collect();
            self.update_services(index, desired, affected.iter());
        }
    }

    fn update_services<'a>(
        &mut self,
        index: &Index,
        desired: &mut SharedRuleset,
        keys: impl Iterator<Item = &'a ObjectKey>,
    ) {
        for key in keys {
            let svc = index.service(key);
            let eps = svc.map(|s| {
                self.computed
                    .remove(key)
                    .unwrap_or_else(|| Arc::new(ServiceEndpoints::of(index, s)))
            });
            // Which nodes' endpoints the Service names, for nodes that appear later.
            let names: HashSet<String> = eps
                .iter()
                .flat_map(|e| e.node_names())
                .map(str::to_string)
                .collect();
            let old_names = self.node_names_of.remove(key).unwrap_or_default();
            for n in old_names.difference(&names) {
                if let Some(s) = self.by_node_name.get_mut(n) {
                    s.remove(key);
                    if s.is_empty() {
                        self.by_node_name.remove(n);
                    }
                }
            }
            for n in &names {
                self.by_node_name
                    .entry(n.clone())
                    .or_default()
                    .insert(key.clone());
            }
            if !names.is_empty() {
                self.node_names_of.insert(key.clone(), names);
            }
            let new_nodes: BTreeSet<String> = match (svc, &eps) {
                (Some(s), Some(e)) => contribution::nodes_of(index, s, e)
                    .into_iter()
                    .map(str::to_string)
                    .collect(),
                _ => BTreeSet::new(),
            };
            // Topology hints, and source ranges judged on each node's addresses.
            if eps.as_ref().is_some_and(|e| e.topology_dependent())
                || svc.is_some_and(|s| contribution::depends_on_node_addresses(s))
            {
                self.everywhere.insert(key.clone());
            } else {
                self.everywhere.remove(key);
            }
            let old_nodes = self.by_service.remove(key).unwrap_or_default();
            for name in old_nodes.union(&new_nodes) {
                let (Some(overlay), Some(info)) = (self.nodes.get_mut(name), index.node(name))
                else {
                    continue;
                };
                let new: Share = match (svc, &eps) {
                    (Some(s), Some(e)) if new_nodes.contains(name) => {
                        kept(|family| contribution::node(s, e, info, family))
                    }
                    _ => Share::default(),
                };
                let old = overlay.shares.remove(key).unwrap_or_default();
                if old != new {
                    replace(overlay, desired, &old, &new);
                    self.changed.insert(name.clone());
                }
                if new.values().any(|k| !k.is_empty()) {
                    overlay.shares.insert(key.clone(), new);
                }
            }
            let holding: BTreeSet<String> = new_nodes
                .into_iter()
                .filter(|n| {
                    self.nodes
                        .get(n)
                        .is_some_and(|o| o.shares.contains_key(key))
                })
                .collect();
            if !holding.is_empty() {
                self.by_service.insert(key.clone(), holding);
            }
        }
    }

    /// The overlays of the nodes that changed, as shared models for publication.
    pub fn changed_models(&mut self) -> Vec<(String, Option<Arc<Model>>)> {
        self.take_changed()
            .into_iter()
            .map(|n| {
                let m = self.nodes.get(&n).map(|o| Arc::new(o.model.clone()));
                (n, m)
            })
            .collect()
    }
}

/// Swaps a share of a node's overlay: elements counted per key (so a pod serving two Services
/// keeps its hairpin pair until both let go), dynamic sets acquired from the shared model.
fn replace(overlay: &mut NodeOverlay, desired: &mut SharedRuleset, old: &Share, new: &Share) {
    for family in IpFamily::ALL {
        let (o, n) = (&old[family], &new[family]);
        if o == n || !desired.has_table(family) {
            continue;
        }
        let table = desired.table_key(family);
        let at = (family, &table);
        for d in &n.dynamic {
            desired.acquire(family, *d);
        }
        // Both sorted by (set, key): one merge walk.
        let (mut a, mut b) = (o.elements.iter().peekable(), n.elements.iter().peekable());
        loop {
            let order = match (a.peek(), b.peek()) {
                (None, None) => break,
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (Some(x), Some(y)) => (x.0, &x.1).cmp(&(y.0, &y.1)),
            };
            match order {
                Ordering::Less => {
                    let (set, key, _) = a.next().expect("peeked");
                    overlay.remove_use(at, *set, key);
                }
                Ordering::Greater => {
                    let (set, key, value) = b.next().expect("peeked");
                    overlay.add_use(desired, at, *set, key, value);
                }
                Ordering::Equal => {
                    let ((_, _, was), (set, key, value)) =
                        (a.next().expect("peeked"), b.next().expect("peeked"));
                    if was != value {
                        let name = set.name();
                        overlay
                            .model
                            .insert_element(&table, &name, key.clone(), value.clone());
                    }
                }
            }
        }
        for d in &o.dynamic {
            desired.release(family, *d);
        }
    }
}

/// What a node must apply to its table to go from overlay `base` to overlay `target`: element
/// changes only.
///
/// An overlay holds elements in sets (and a table) that the shared model defines; it carries
/// the definitions only so that its elements can be sent. Which definitions an overlay holds
/// depends on its history: an incremental update keeps a set it emptied, a rebuild (after a
/// relist) creates only the sets it puts elements in. A plain [`Model::diff`] of two overlays
/// would then remove a set or the whole table, and on the node, where the overlay and the
/// shared model are one table, that removes the shared set (or table) with it: the node's
/// digest differs from the brain's and it NACKs until a snapshot. So what an overlay no longer
/// holds is removed element by element, and sets and tables are left to the shared model.
pub fn delta(base: &Model, target: &Model) -> RulesetDelta {
    let mut d = base.diff(target);
    let mut extra: Vec<TableRemoval> = Vec::new();
    d.remove.retain_mut(|rm| {
        let key: TableKey = (rm.family(), rm.name.clone());
        let Some(old) = base.tables.get(&key) else {
            return false;
        };
        let gone: Vec<String> = if rm.whole {
            old.sets.keys().cloned().collect()
        } else {
            // A set whose definition changed is removed and sent again whole (the shared
            // model does the same); one that went from the overlay only loses its elements.
            let recreated = |name: &String| target.set(&key, name).is_some();
            let (keep, gone): (Vec<String>, Vec<String>) = std::mem::take(&mut rm.sets)
                .into_iter()
                .partition(recreated);
            rm.sets = keep;
            gone
        };
        let elements = gone.iter().filter_map(|name| {
            let sm = old.sets.get(name)?;
            let keys: Vec<Element> = sm
                .elements
                .keys()
                .filter_map(|k| Element::decode(&k[..]).ok())
                .collect();
            (!keys.is_empty()).then(|| SetElements {
                set: name.clone(),
                elements: keys,
            })
        });
        if rm.whole {
            extra.push(TableRemoval {
                family: rm.family,
                name: rm.name.clone(),
                elements: elements.collect(),
                ..Default::default()
            });
            return false;
        }
        rm.elements.extend(elements);
        !(rm.chains.is_empty() && rm.sets.is_empty() && rm.elements.is_empty())
    });
    d.remove
        .extend(extra.into_iter().filter(|rm| !rm.elements.is_empty()));
    d
}

#[cfg(test)]
mod tests {
    use splitproxy_proto::v1::{DataType, Datum, Family, Ruleset, Set, Table, datum};

    use super::*;

    fn element(i: u32) -> Element {
        Element {
            key: vec![Datum {
                value: Some(datum::Value::U32(i)),
            }],
            ..Element::default()
        }
    }

    /// One table with sets `s` and `u` holding these elements.
    fn model(s: &[u32], u: &[u32]) -> Model {
        let set = |name: &str, elements: &[u32]| Set {
            name: name.into(),
            key: vec![DataType::Integer as i32],
            elements: elements.iter().copied().map(element).collect(),
            ..Set::default()
        };
        Model::from_ruleset(&Ruleset {
            tables: vec![Table {
                family: Family::Ip as i32,
                name: "splitproxy".into(),
                sets: vec![set("s", s), set("u", u)],
                ..Table::default()
            }],
        })
    }

    /// An overlay that no longer holds a set, or anything at all, loses its elements on the
    /// node; the sets and the table, which the shared model owns, stay.
    #[test]
    fn an_overlay_delta_never_removes_sets_or_tables() {
        let shared = model(&[1], &[2]);
        let base = model(&[10, 11], &[20]);
        let node = |overlay: &Model| {
            let mut m = shared.clone();
            m.apply(&Model::default().diff(overlay));
            m
        };
        let mut only_s = base.clone();
        let table = (Family::Ip, "splitproxy".to_string());
        only_s.remove_set(&table, "u");
        for target in [only_s, Model::default()] {
            let d = delta(&base, &target);
            assert!(
                d.remove.iter().all(|r| !r.whole && r.sets.is_empty()),
                "{d:?}"
            );
            let mut held = node(&base);
            held.apply(&d);
            assert_eq!(held.digest(), shared.digest_with(&target));
            assert!(held.set(&table, "u").is_some(), "the shared set stays");
        }
    }
}
