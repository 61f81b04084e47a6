//! The brain's in-memory index of the cluster: Services, their EndpointSlices and Nodes, as
//! reduced by [`crate::objects`]. Each resource follows the contract apply / delete / reset
//! (a relist replaces the whole resource at once), so a relist never exposes half a cluster.
//!
//! [`Indexer`] is the state machine around it: it folds watch events into the index, holds
//! publications until every list is complete, and publishes the state computed from it.
mod indexer;
mod listing;

use std::collections::BTreeSet;
use std::sync::Arc;

use foldhash::HashMap;

use crate::objects::{NodeInfo, ObjectKey, ServiceInfo, SliceInfo};

pub use indexer::{Indexer, WatchEvent};

/// The cluster as the rules see it, by object.
#[derive(Debug, Default, Clone)]
pub struct Index {
    services: HashMap<ObjectKey, Arc<ServiceInfo>>,
    slices: HashMap<ObjectKey, Arc<SliceInfo>>,
    slices_by_service: HashMap<ObjectKey, BTreeSet<ObjectKey>>,
    nodes: HashMap<String, NodeInfo>,
}

impl Index {
    pub fn services(&self) -> impl Iterator<Item = &Arc<ServiceInfo>> {
        self.services.values()
    }

    pub fn service(&self, key: &ObjectKey) -> Option<&Arc<ServiceInfo>> {
        self.services.get(key)
    }

    /// The slices labelled with the Service's name, in name order.
    pub fn slices_of(&self, service: &ObjectKey) -> impl Iterator<Item = &Arc<SliceInfo>> {
        self.slices_by_service
            .get(service)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.get(k))
    }

    pub fn nodes(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes.values()
    }

    pub fn node(&self, name: &str) -> Option<&NodeInfo> {
        self.nodes.get(name)
    }

    pub fn apply_service(&mut self, key: ObjectKey, svc: Option<Arc<ServiceInfo>>) {
        match svc {
            Some(s) => {
                self.services.insert(key, s);
            }
            None => {
                self.services.remove(&key);
            }
        }
    }

    pub fn reset_services(&mut self, all: impl IntoIterator<Item = (ObjectKey, Arc<ServiceInfo>)>) {
        self.services = all.into_iter().collect();
    }

    /// Applies (or, with `None`, deletes) a slice; returns the Service it belonged to before,
    /// which also needs recomputing if the slice moved.
    pub fn apply_slice(
        &mut self,
        key: ObjectKey,
        slice: Option<Arc<SliceInfo>>,
    ) -> Option<ObjectKey> {
        let old_service = self.slices.remove(&key).map(|old| old.service.clone());
        if let Some(svc) = &old_service
            && let Some(set) = self.slices_by_service.get_mut(svc)
        {
            set.remove(&key);
            if set.is_empty() {
                self.slices_by_service.remove(svc);
            }
        }
        if let Some(s) = slice {
            self.slices_by_service
                .entry(s.service.clone())
                .or_default()
                .insert(key.clone());
            self.slices.insert(key, s);
        }
        old_service
    }

    pub fn reset_slices(&mut self, all: impl IntoIterator<Item = (ObjectKey, Arc<SliceInfo>)>) {
        self.slices.clear();
        self.slices_by_service.clear();
        for (k, s) in all {
            self.apply_slice(k, Some(s));
        }
    }

    pub fn apply_node(&mut self, name: String, node: Option<NodeInfo>) {
        match node {
            Some(n) => {
                self.nodes.insert(name, n);
            }
            None => {
                self.nodes.remove(&name);
            }
        }
    }

    pub fn reset_nodes(&mut self, all: impl IntoIterator<Item = NodeInfo>) {
        self.nodes = all.into_iter().map(|n| (n.name.clone(), n)).collect();
    }
}
