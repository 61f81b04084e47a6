//! Guarded entries: entries the packet path adds to a dynamic map, deleted after the commit
//! that removes the set element vouching for them.
//!
//! Why: a map filled by a dynset `update` rule holds entries the actuator never sent, so its
//! model cannot say which of them are stale, and an entry outlives whatever made it valid until
//! it times out. A set whose `guards` names such a map (in the same table) lists what is valid:
//! each of its elements is an entry's key without its first field, followed by the entry's
//! data. When a commit removes an element, the entries it vouched for are deleted. Session
//! affinity is the example: the map remembers `client . destination -> endpoint`, the guard set
//! holds the `destination . endpoint` pairs in service, and an endpoint that leaves takes the
//! entries that sent clients to it along, so that those clients choose again.
//!
//! Finding the removed elements walks only the changed parts of guard sets (the models share
//! structure), so a commit that removes none costs nothing and sends nothing to the kernel.
//! Otherwise one dump of each guarded map, then one transaction that destroys the matching
//! entries (one that expired in between is skipped, not an error). Entries and guard elements
//! are compared as bytes: the guard element's values laid out as the map lays out the fields
//! they stand for (nft/set.rs, [`DataMapLayout`]).
//!
//! Nothing is done for an element that went with its whole set or table, nor for a map that
//! the commit created or re-created (the kernel's is new and empty).

#[cfg(test)]
mod kernel_tests;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::{BTreeMap, HashSet};

use imbl::ordmap::DiffItem;
use prost::Message;
use splitproxy_proto::model::{Model, TableKey};
use splitproxy_proto::v1::Element;

use crate::metrics::Metrics;
use crate::nft::{Batch, CommitError, DataMapLayout, EncodeError, NftSocket, RawElement};

/// Key fields of a guarded entry that its guard element leaves out: the first (the client).
const SKIPPED_KEY_FIELDS: usize = 1;

/// The entries of one guarded map to delete.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Guarded {
    layout: DataMapLayout,
    /// Tails (key without its first field, then data) of the entries to delete.
    gone: HashSet<Vec<u8>>,
}

impl Guarded {
    fn select<'a>(&self, entries: &'a [RawElement]) -> Vec<&'a RawElement> {
        let mut tail = Vec::new();
        entries
            .iter()
            .filter(|e| {
                tail.clear();
                self.layout
                    .entry_tail(SKIPPED_KEY_FIELDS, &e.key, &e.data, &mut tail)
                    && self.gone.contains(&tail)
            })
            .collect()
    }
}

/// The guarded entries one commit (or several, merged) leaves to delete, by map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    maps: BTreeMap<(TableKey, String), Guarded>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }

    /// Number of guard elements removed.
    pub fn len(&self) -> usize {
        self.maps.values().map(|g| g.gone.len()).sum()
    }

    /// Adds another commit's plan (when one was not carried out yet). A map whose layout
    /// changed in between was re-created: what the older plan wanted from it is moot.
    pub fn extend(&mut self, other: Plan) {
        for (key, g) in other.maps {
            match self.maps.get_mut(&key) {
                Some(mine) if mine.layout == g.layout => mine.gone.extend(g.gone),
                _ => {
                    self.maps.insert(key, g);
                }
            }
        }
    }

    /// What committing `new` over `old` leaves to delete.
    pub fn between(old: &Model, new: &Model) -> Plan {
        let mut plan = Plan::default();
        for (tkey, table) in old.tables.iter() {
            let Some(new_table) = new.tables.get(tkey) else {
                continue;
            };
            for (name, set) in table.sets.iter() {
                let map_name = &set.def.guards;
                if map_name.is_empty() {
                    continue;
                }
                let Some(after) = new_table.sets.get(name) else {
                    continue;
                };
                if after.elements.ptr_eq(&set.elements) {
                    continue;
                }
                // The map as the kernel holds it now: one the commit created or re-created
                // (a definition changed) holds no entry from before.
                let (Some(map_before), Some(map)) =
                    (table.sets.get(map_name), new_table.sets.get(map_name))
                else {
                    continue;
                };
                if map_before.def != map.def {
                    continue;
                }
                let removed: Vec<&[u8]> = set
                    .elements
                    .diff(&after.elements)
                    .filter_map(|item| match item {
                        DiffItem::Remove(_, v) => Some(&v[..]),
                        _ => None,
                    })
                    .collect();
                if removed.is_empty() {
                    continue;
                }
                let layout = match DataMapLayout::new(&map.def) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::warn!(
                            set = %name,
                            map = %map_name,
                            error = %e,
                            "a set guards something that is not a data map; ignored"
                        );
                        continue;
                    }
                };
                let mut gone = HashSet::new();
                let mut misfits = 0usize;
                let mut why = String::new();
                for encoded in removed {
                    let mut tail = Vec::new();
                    let fits = Element::decode(encoded)
                        .map_err(|e| e.to_string())
                        .and_then(|e| layout.encode_tail(SKIPPED_KEY_FIELDS, &e.key, &mut tail));
                    match fits {
                        Ok(()) => {
                            gone.insert(tail);
                        }
                        Err(e) => {
                            misfits += 1;
                            why = e;
                        }
                    }
                }
                if misfits > 0 {
                    tracing::warn!(
                        set = %name,
                        map = %map_name,
                        misfits,
                        error = %why,
                        "guard elements that do not fit their map's layout are ignored"
                    );
                }
                if !gone.is_empty() {
                    plan.extend(Plan {
                        maps: BTreeMap::from([(
                            (tkey.clone(), map_name.clone()),
                            Guarded { layout, gone },
                        )]),
                    });
                }
            }
        }
        plan
    }

    /// The entries of `entries`, dumped from map `map` of table `table`, to delete.
    pub fn select<'a>(
        &self,
        table: &TableKey,
        map: &str,
        entries: &'a [RawElement],
    ) -> Vec<&'a RawElement> {
        self.maps
            .get(&(table.clone(), map.to_owned()))
            .map(|g| g.select(entries))
            .unwrap_or_default()
    }
}

#[derive(Debug, thiserror::Error)]
enum CleanError {
    #[error("opening a netlink socket: {0}")]
    Open(std::io::Error),
    #[error("listing map {map} of table {table}: {source}")]
    Dump {
        table: String,
        map: String,
        source: std::io::Error,
    },
    #[error("encoding: {0}")]
    Encode(#[from] EncodeError),
    #[error("deleting: {0}")]
    Commit(#[from] CommitError),
}

/// Deletes the entries a [`Plan`] names. Holds its netlink socket across commits, opened on
/// first use (a node that never removes a guard element never opens it) and reopened after a
/// failure.
#[derive(Debug, Default)]
pub struct Cleaner {
    socket: Option<NftSocket>,
}

impl Cleaner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Deletes what `plan` names and returns how many entries went. Failures are logged and
    /// counted, never returned: the commit they follow has succeeded, and the entries time out
    /// by themselves.
    pub fn clean(&mut self, plan: &Plan, metrics: &Metrics) -> usize {
        if plan.is_empty() {
            return 0;
        }
        match self.try_clean(plan) {
            Ok(deleted) => {
                metrics.guarded_deleted(deleted as u64);
                tracing::debug!(
                    deleted,
                    guards_removed = plan.len(),
                    "guarded entries cleanup done"
                );
                deleted
            }
            Err(e) => {
                self.socket = None;
                metrics.guarded_cleanup_failed();
                tracing::warn!(
                    error = %e,
                    "deleting guarded map entries failed; they stay until they time out"
                );
                0
            }
        }
    }

    fn try_clean(&mut self, plan: &Plan) -> Result<usize, CleanError> {
        let sock = match &mut self.socket {
            Some(s) => s,
            None => self
                .socket
                .insert(NftSocket::open().map_err(CleanError::Open)?),
        };
        let mut batch = Batch::new();
        let mut deleted = 0;
        for (((family, table), map), guarded) in &plan.maps {
            let family = *family;
            let entries =
                sock.dump_elements(family, table, map)
                    .map_err(|source| CleanError::Dump {
                        table: table.clone(),
                        map: map.clone(),
                        source,
                    })?;
            let stale = guarded.select(&entries);
            tracing::debug!(
                %table,
                %map,
                entries = entries.len(),
                stale = stale.len(),
                "guarded map listed"
            );
            batch.destroy_element_keys(family, table, map, stale.iter().map(|e| &e.key[..]))?;
            deleted += stale.len();
        }
        if !batch.is_empty() {
            sock.commit(&mut batch)?;
        }
        Ok(deleted)
    }
}
