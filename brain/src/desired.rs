//! The ruleset every node holds, kept up to date incrementally.
//!
//! Each Service's share of the ruleset (its [`Contribution`]) is remembered, so a change to a
//! Service or its slices costs recomputing that Service and moving its elements, whatever the
//! size of the cluster ("cost follows the change", docs/invariants.md). The model is persistent: publishing it is an O(1) clone,
//! and versions share structure so that nodes' deltas are cheap diffs.
//!
//! Node overlays ([`crate::overlay`]) add elements to the sets defined here; dynamic sets
//! (per-count, per-timeout) they use are reference-counted here too, so a set exists exactly
//! while some node or the shared state uses it.
use std::collections::BTreeMap;
use std::sync::Arc;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use prost::Message;
use splitproxy_proto::family::{IpFamily, PerFamily};
use splitproxy_proto::model::{Model, TableKey, element_key_bytes};
use splitproxy_proto::v1::{RulesetDelta, Set};

use crate::index::Index;
use crate::objects::ObjectKey;
use crate::rules::contribution::ServiceEndpoints;
use crate::rules::{self, Contribution, DynSet, RulesConfig, chains, contribution};

/// A Service's contributions to the ip and ip6 tables.
type ServiceShare = PerFamily<Contribution>;

/// The shared ruleset (every node's rules without its own overlay), built incrementally.
pub struct SharedRuleset {
    config: RulesConfig,
    model: Model,
    shares: HashMap<ObjectKey, ServiceShare>,
    /// Uses of each dynamic set, per family, by Services and overlays.
    dyn_refs: BTreeMap<(IpFamily, DynSet), usize>,
    /// Services with any IPv6 share (the ip6 table exists while there are any).
    v6_services: HashSet<ObjectKey>,
    /// Grows whenever a table appears or goes, so overlays know to recompute.
    layout: u64,
    /// The endpoints computed by the last [`SharedRuleset::update`], handed to the overlays of the
    /// same publication ([`SharedRuleset::take_endpoints`]) so a change computes them once.
    computed: HashMap<ObjectKey, Arc<ServiceEndpoints>>,
}

impl SharedRuleset {
    pub fn new(config: RulesConfig) -> Self {
        let mut d = SharedRuleset {
            config,
            model: Model::default(),
            shares: HashMap::new(),
            dyn_refs: BTreeMap::new(),
            v6_services: HashSet::new(),
            layout: 0,
            computed: HashMap::new(),
        };
        d.reset();
        d
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn layout(&self) -> u64 {
        self.layout
    }

    pub fn table_key(&self, family: IpFamily) -> TableKey {
        (family.into(), self.config.table.clone())
    }

    pub fn has_table(&self, family: IpFamily) -> bool {
        self.model.tables.contains_key(&self.table_key(family))
    }

    /// The definition of a set of a family's table.
    pub fn set_def(&self, family: IpFamily, name: &str) -> Option<Set> {
        self.model
            .set(&self.table_key(family), name)
            .map(|s| (*s.def).clone())
    }

    /// Drops every Service and starts from the skeleton.
    fn reset(&mut self) {
        self.model = Model::default();
        self.shares.clear();
        self.dyn_refs.clear();
        self.v6_services.clear();
        self.computed.clear();
        self.layout += 1;
        self.add_skeleton(IpFamily::V4);
        if rules::wants_ipv6(&self.config) {
            self.add_skeleton(IpFamily::V6);
        }
    }

    fn add_skeleton(&mut self, family: IpFamily) {
        let table = rules::skeleton(&self.config, family, &rules::preallocated());
        self.model.apply(&RulesetDelta {
            upsert: vec![table],
            remove: vec![],
        });
        self.layout += 1;
    }

    /// Recomputes everything from the index (start-up and relists).
    pub fn rebuild(&mut self, index: &Index) {
        self.reset();
        let keys: Vec<ObjectKey> = index.services().map(|s| s.key.clone()).collect();
        self.update(index, keys.iter());
    }

    /// Brings the Services named in `dirty` (changed, added or deleted) up to date.
    pub fn update<'a>(&mut self, index: &Index, dirty: impl Iterator<Item = &'a ObjectKey>) {
        for key in dirty {
            let new = match index.service(key) {
                Some(svc) => {
                    let eps = Arc::new(ServiceEndpoints::of(index, svc));
                    self.computed.insert(key.clone(), eps.clone());
                    PerFamily::from_fn(|family| contribution::global(svc, &eps, family))
                }
                None => ServiceShare::default(),
            };
            let old = self.shares.remove(key).unwrap_or_default();
            let holds_any = new.values().any(|c| !c.is_empty());
            if old == new {
                if holds_any {
                    self.shares.insert(key.clone(), new);
                }
                continue;
            }
            if !new.v6.is_empty() && !self.has_table(IpFamily::V6) {
                self.add_skeleton(IpFamily::V6);
            }
            for family in IpFamily::ALL {
                self.replace(family, &old[family], &new[family]);
            }
            if new.v6.is_empty() {
                self.v6_services.remove(key);
            } else {
                self.v6_services.insert(key.clone());
            }
            if holds_any {
                self.shares.insert(key.clone(), new);
            }
        }
    }

    /// The endpoints of the Services the last update computed, by Service.
    pub fn take_endpoints(&mut self) -> HashMap<ObjectKey, Arc<ServiceEndpoints>> {
        std::mem::take(&mut self.computed)
    }

    /// Removes the ip6 table when nothing needs it any more (after Services and overlays are
    /// up to date, so that no overlay still counts on it).
    pub fn prune(&mut self) {
        if self.v6_services.is_empty()
            && !rules::wants_ipv6(&self.config)
            && self.has_table(IpFamily::V6)
        {
            let key = self.table_key(IpFamily::V6);
            self.model.remove_table(&key);
            self.dyn_refs
                .retain(|(family, _), _| *family != IpFamily::V6);
            self.layout += 1;
        }
    }

    /// A Service or a node overlay starts using a dynamic set.
    pub fn acquire(&mut self, family: IpFamily, d: DynSet) {
        let c = self.dyn_refs.entry((family, d)).or_default();
        *c += 1;
        if *c == 1 && !rules::is_preallocated(d) && self.has_table(family) {
            let table = self.table_key(family);
            self.model.upsert_set(&table, &d.def(family));
            self.refresh_chains(family);
        }
    }

    /// ... and stops using it.
    pub fn release(&mut self, family: IpFamily, d: DynSet) {
        let Some(c) = self.dyn_refs.get_mut(&(family, d)) else {
            return;
        };
        *c = c.saturating_sub(1);
        if *c == 0 {
            self.dyn_refs.remove(&(family, d));
            if !rules::is_preallocated(d) && self.has_table(family) {
                let table = self.table_key(family);
                self.model.remove_set(&table, &d.name());
                self.refresh_chains(family);
            }
        }
    }

    fn refresh_chains(&mut self, family: IpFamily) {
        let mut in_use = rules::preallocated();
        in_use.extend(
            self.dyn_refs
                .keys()
                .filter(|(f, _)| *f == family)
                .map(|(_, d)| *d),
        );
        let table = self.table_key(family);
        self.model.upsert_chain(
            &table,
            chains::services_chain(&self.config, family, &in_use),
        );
        self.model
            .upsert_chain(&table, chains::affinity_record_chain(family, &in_use));
    }

    /// Swaps one family's old contribution for the new one: removes what went away, adds what
    /// came, and keeps the dynamic sets and their rules for the ones in use.
    fn replace(&mut self, family: IpFamily, old: &Contribution, new: &Contribution) {
        if old == new {
            return;
        }
        let table = self.table_key(family);
        let (old_k, new_k) = (keyed(old), keyed(new));
        for (set, key) in old_k.keys().filter(|k| !new_k.contains_key(*k)) {
            self.model.remove_element(&table, set, key);
        }
        // Sets the new contribution uses first, then release the old ones, so that a Service
        // keeping its count never drops and re-creates the set.
        for (d, _) in &new.dynamic {
            self.acquire(family, *d);
        }
        for (d, _) in &old.dynamic {
            self.release(family, *d);
        }
        for ((set, key), value) in new_k {
            if old_k.get(&(set.clone(), key.clone())) != Some(&value) {
                self.model
                    .insert_element(&table, &set, key, value.into_boxed_slice());
            }
        }
    }
}

/// A contribution's elements by (set, key), encoded.
pub fn keyed(c: &Contribution) -> HashMap<(String, Box<[u8]>), Vec<u8>> {
    c.elements
        .iter()
        .map(|(set, e)| ((set.to_string(), element_key_bytes(e)), e.encode_to_vec()))
        .chain(
            c.dynamic
                .iter()
                .map(|(d, e)| ((d.name(), element_key_bytes(e)), e.encode_to_vec())),
        )
        .collect()
}
