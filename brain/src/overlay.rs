//! Per-node overlays: the elements only one node holds, on top of the shared ruleset
//! ([`crate::desired`]).
//!
//! A node's table is the shared model plus its overlay: the addresses its NodePorts answer on,
//! its local endpoints of Local-policy Services, its topology choice, hairpin pairs for its
//! endpoints, its health check counts. The overlay holds only elements, in sets the shared
//! model defines, and never a key the shared model holds in the same set, so the node's digest
//! is the sum of both and the shared part of every update stays encoded once for all nodes.
//!
//! A change to a Service recomputes the overlays of the nodes that hold or held a share of it
//! (usually the few hosting its endpoints), so the cost follows the change.
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use splitproxy_proto::model::Model;

use crate::desired::{Desired, keyed};
use crate::index::Index;
use crate::objects::{NodeInfo, ObjectKey};
use crate::rules::RulesConfig;
use crate::rules::contribution::{self, Contribution, ServiceEndpoints};

type Share = [Contribution; 2];

#[derive(Default)]
struct NodeOverlay {
    model: Model,
    /// The node facts the overlay was computed from.
    info: NodeInfo,
    facts: Share,
    shares: HashMap<ObjectKey, Share>,
    /// Uses of each element (family, set, key): two Services may share a pod (hairpin).
    refs: HashMap<(bool, String, Box<[u8]>), usize>,
}

impl NodeOverlay {
    /// Gives back the dynamic sets this overlay uses.
    fn release(&self, desired: &mut Desired) {
        for share in std::iter::once(&self.facts).chain(self.shares.values()) {
            for (v6, c) in [(false, &share[0]), (true, &share[1])] {
                for (d, _) in &c.dynamic {
                    desired.release(v6, *d);
                }
            }
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
    /// Services every node holds a share of (topology hints).
    everywhere: HashSet<ObjectKey>,
    /// The shared model's layout these overlays were computed against.
    layout: u64,
    /// Nodes whose overlay changed since [`Overlays::take_changed`].
    changed: HashSet<String>,
    /// Endpoints the shared state computed for this publication ([`Desired::take_endpoints`]).
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
    pub fn rebuild(&mut self, index: &Index, desired: &mut Desired) {
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
        desired: &mut Desired,
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

    fn release_all(&mut self, desired: &mut Desired) {
        for n in self.nodes.values() {
            n.release(desired);
        }
    }

    /// Nodes added, changed or removed: their facts, and every Service share that depends on
    /// the node (topology, endpoints naming it).
    fn update_nodes<'a>(
        &mut self,
        index: &Index,
        desired: &mut Desired,
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
            let facts = [
                contribution::node_facts(&self.config, info, false),
                contribution::node_facts(&self.config, info, true),
            ];
            let overlay = self.nodes.entry(name.clone()).or_default();
            overlay.info = info.clone();
            let old = std::mem::replace(&mut overlay.facts, facts.clone());
            replace(overlay, desired, &old, &facts);
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
        desired: &mut Desired,
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
            let new_nodes: BTreeSet<String> = match &eps {
                Some(e) => contribution::nodes_of(index, e)
                    .into_iter()
                    .map(str::to_string)
                    .collect(),
                None => BTreeSet::new(),
            };
            if eps.as_ref().is_some_and(|e| e.topology_dependent()) {
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
                    (Some(s), Some(e)) if new_nodes.contains(name) => [
                        contribution::node(s, e, info, false),
                        contribution::node(s, e, info, true),
                    ],
                    _ => Share::default(),
                };
                let old = overlay.shares.remove(key).unwrap_or_default();
                if old != new {
                    replace(overlay, desired, &old, &new);
                    self.changed.insert(name.clone());
                }
                if !new[0].is_empty() || !new[1].is_empty() {
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
fn replace(overlay: &mut NodeOverlay, desired: &mut Desired, old: &Share, new: &Share) {
    for ipv6 in [false, true] {
        let (o, n) = (&old[ipv6 as usize], &new[ipv6 as usize]);
        if o == n {
            continue;
        }
        if !desired.has_table(ipv6) {
            continue;
        }
        let table = desired.table_key(ipv6);
        for (d, _) in &n.dynamic {
            desired.acquire(ipv6, *d);
        }
        let (old_k, new_k) = (keyed(o), keyed(n));
        for (set, key) in old_k.keys().filter(|k| !new_k.contains_key(*k)) {
            let rk = (ipv6, set.clone(), key.clone());
            if let Some(c) = overlay.refs.get_mut(&rk) {
                *c -= 1;
                if *c == 0 {
                    overlay.refs.remove(&rk);
                    overlay.model.remove_element(&table, set, key);
                }
            }
        }
        for ((set, key), value) in new_k {
            match old_k.get(&(set.clone(), key.clone())) {
                Some(v) if *v == value => {}
                Some(_) => {
                    overlay
                        .model
                        .insert_element(&table, &set, key, value.into_boxed_slice());
                }
                None => {
                    let rk = (ipv6, set.clone(), key.clone());
                    let c = overlay.refs.entry(rk).or_default();
                    *c += 1;
                    if *c == 1 {
                        if overlay.model.set(&table, &set).is_none() {
                            let Some(def) = desired.set_def(ipv6, &set) else {
                                tracing::warn!(%set, "overlay element for a set the shared model lacks");
                                continue;
                            };
                            overlay.model.upsert_table(&table, "rules for splitproxy");
                            overlay.model.upsert_set(&table, &def);
                        }
                        overlay
                            .model
                            .insert_element(&table, &set, key, value.into_boxed_slice());
                    }
                }
            }
        }
        for (d, _) in &o.dynamic {
            desired.release(ipv6, *d);
        }
    }
}
