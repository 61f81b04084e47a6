//! The desired ruleset of one node variant, kept up to date incrementally.
//!
//! Each Service's share of the ruleset (its [`Contribution`]) is remembered, so a change to a
//! Service or its slices costs recomputing that Service and moving its elements, whatever the
//! size of the cluster (invariant 4). The model is persistent: publishing it is an O(1) clone,
//! and versions share structure so that nodes' deltas are cheap diffs.
use std::collections::{BTreeMap, HashMap, HashSet};

use prost::Message;
use splitproxy_proto::model::{Model, TableKey, element_key_bytes};

use crate::index::Index;
use crate::objects::ObjectKey;
use crate::rules::{self, Contribution, NodeView, PREALLOCATED_COUNTS, RulesConfig};

/// A Service's contributions to the ip and ip6 tables.
#[derive(Debug, Clone, Default, PartialEq)]
struct ServiceShare {
    v4: Contribution,
    v6: Contribution,
}

pub struct Desired {
    config: RulesConfig,
    view: NodeView,
    model: Model,
    shares: HashMap<ObjectKey, ServiceShare>,
    /// How many Service ports use each endpoint count, per family (false: ip, true: ip6).
    counts: BTreeMap<(bool, u32), usize>,
    /// Services with any IPv6 share (the ip6 table exists while there are any).
    v6_services: HashSet<ObjectKey>,
}

impl Desired {
    pub fn new(config: RulesConfig, view: NodeView) -> Self {
        let mut d = Desired {
            config,
            view,
            model: Model::default(),
            shares: HashMap::new(),
            counts: BTreeMap::new(),
            v6_services: HashSet::new(),
        };
        d.reset();
        d
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn view(&self) -> &NodeView {
        &self.view
    }

    fn table_key(&self, ipv6: bool) -> TableKey {
        (rules::family(ipv6) as i32, self.config.table.clone())
    }

    /// Drops every Service and starts from the skeleton.
    fn reset(&mut self) {
        self.model = Model::default();
        self.shares.clear();
        self.counts.clear();
        self.v6_services.clear();
        self.add_skeleton(false);
        if rules::wants_ipv6(&self.config) {
            self.add_skeleton(true);
        }
    }

    fn add_skeleton(&mut self, ipv6: bool) {
        let table = rules::skeleton(&self.config, ipv6, 1..=PREALLOCATED_COUNTS);
        self.model.apply(&splitproxy_proto::v1::RulesetDelta {
            upsert: vec![table],
            remove: vec![],
        });
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
                Some(svc) => ServiceShare {
                    v4: rules::contribution(index, svc, false),
                    v6: rules::contribution(index, svc, true),
                },
                None => ServiceShare::default(),
            };
            let old = self.shares.remove(key).unwrap_or_default();
            if old == new {
                if !new.v4.is_empty() || !new.v6.is_empty() {
                    self.shares.insert(key.clone(), new);
                }
                continue;
            }
            if !new.v6.is_empty() && !self.v6_table_exists() {
                self.add_skeleton(true);
            }
            self.replace(false, &old.v4, &new.v4);
            self.replace(true, &old.v6, &new.v6);
            if new.v6.is_empty() {
                self.v6_services.remove(key);
            } else {
                self.v6_services.insert(key.clone());
            }
            if !new.v4.is_empty() || !new.v6.is_empty() {
                self.shares.insert(key.clone(), new);
            }
            if self.v6_services.is_empty()
                && !rules::wants_ipv6(&self.config)
                && self.v6_table_exists()
            {
                let key = self.table_key(true);
                self.model.remove_table(&key);
                self.counts.retain(|(v6, _), _| !*v6);
            }
        }
    }

    fn v6_table_exists(&self) -> bool {
        self.model.tables.contains_key(&self.table_key(true))
    }

    /// Swaps one family's old contribution for the new one: removes what went away, adds what
    /// came, and keeps the `service-ports-N` sets and rules for the counts in use.
    fn replace(&mut self, ipv6: bool, old: &Contribution, new: &Contribution) {
        if old == new {
            return;
        }
        let table = self.table_key(ipv6);
        let keyed = |c: &Contribution| -> HashMap<(String, Box<[u8]>), Vec<u8>> {
            c.elements
                .iter()
                .map(|(set, e)| ((set.to_string(), element_key_bytes(e)), e.encode_to_vec()))
                .chain(c.counted.iter().map(|(n, e)| {
                    (
                        (rules::count_set_name(*n), element_key_bytes(e)),
                        e.encode_to_vec(),
                    )
                }))
                .collect()
        };
        let (old_k, new_k) = (keyed(old), keyed(new));
        for (set, key) in old_k.keys().filter(|k| !new_k.contains_key(*k)) {
            self.model.remove_element(&table, set, key);
        }
        // Counts the new contribution uses first, then release the old ones, so that a Service
        // keeping its count never drops and re-creates the set.
        let mut chain_changed = false;
        for (n, _) in &new.counted {
            let c = self.counts.entry((ipv6, *n)).or_default();
            *c += 1;
            if *c == 1 && *n > PREALLOCATED_COUNTS {
                self.model.upsert_set(&table, &rules::count_set(*n, ipv6));
                chain_changed = true;
            }
        }
        for (n, _) in &old.counted {
            let c = self.counts.entry((ipv6, *n)).or_default();
            *c = c.saturating_sub(1);
            if *c == 0 {
                self.counts.remove(&(ipv6, *n));
                if *n > PREALLOCATED_COUNTS {
                    self.model.remove_set(&table, &rules::count_set_name(*n));
                    chain_changed = true;
                }
            }
        }
        for ((set, key), value) in new_k {
            if old_k.get(&(set.clone(), key.clone())) != Some(&value) {
                self.model
                    .insert_element(&table, &set, key, value.into_boxed_slice());
            }
        }
        if chain_changed {
            let counts: Vec<u32> = (1..=PREALLOCATED_COUNTS)
                .chain(
                    self.counts
                        .keys()
                        .filter(|(v6, _)| *v6 == ipv6)
                        .map(|(_, n)| *n),
                )
                .collect();
            self.model
                .upsert_chain(&table, rules::services_chain(counts, ipv6));
        }
    }
}
