//! Where in the API's history a publication stands, so that a replica can place a node's state
//! that another replica computed.
//!
//! Replicas fold the same watch events, but in batches of their own: under churn one replica
//! may publish the state after 7 of a second's EndpointSlice changes and another after 5 and
//! then 12. A node that held the first replica's state and moves to the second holds a ruleset
//! the second never published, so resumption by digest cannot find it (docs/protocol.md,
//! "Resumption"). What both replicas share is the order of each watch stream. So every
//! publication names, per watched resource, the resourceVersion of the last event it folded in;
//! the node keeps that with what it applied and presents it in its Hello, and the replica it
//! reaches finds two of its own publications around it ([`crate::history::History::window_start`])
//! and restates what changed between them ([`crate::restate`]).
//!
//! resourceVersions are opaque to clients by the API's contract; an etcd-backed API server
//! gives the etcd revision, a number that grows with every write, and only those are used
//! here. One that is not a number leaves its resource at 0, as if nothing were folded; a state
//! with nothing folded at all is never placed, and its node resumes by digest or by snapshot, as
//! before. A wrong placement costs a round trip, never correctness: the node checks the digest
//! the restated delta reaches before it commits anything.

/// The watched resources, in the order of `Update.resource_versions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    Services = 0,
    EndpointSlices = 1,
    Nodes = 2,
    ServiceCidrs = 3,
}

/// Per [`Resource`], the resourceVersion of the last event folded in (0: none yet, or not a
/// number).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ApiState([u64; 4]);

impl ApiState {
    /// A state as a node presents it (`Applied.resource_versions`); `None` unless it names
    /// every resource.
    pub fn from_wire(versions: &[u64]) -> Option<Self> {
        let v: [u64; 4] = versions.try_into().ok()?;
        Some(ApiState(v))
    }

    pub fn to_wire(self) -> Vec<u64> {
        self.0.to_vec()
    }

    /// Notes that an event of `resource` with this resourceVersion was folded in. Each watch
    /// stream delivers its events in order, so the last one folded is the newest.
    pub fn fold(&mut self, resource: Resource, resource_version: Option<&str>) {
        self.0[resource as usize] = resource_version.and_then(|v| v.parse().ok()).unwrap_or(0);
    }

    /// Notes a listed object: a list stands at the newest resourceVersion among its objects
    /// (start from [`ApiState::restart`]). A list at revision R holds every object as of R,
    /// so two replicas that listed at different revisions without a change of that resource
    /// between them agree here, though their lists' revisions differ. (A deletion between
    /// them is seen in neither list; the replicas then disagree on this resource until its
    /// next event, and a node placed by it fails the digest check and gets a snapshot.)
    pub fn list(&mut self, resource: Resource, resource_version: Option<&str>) {
        let v = resource_version.and_then(|v| v.parse().ok()).unwrap_or(0);
        let at = &mut self.0[resource as usize];
        *at = (*at).max(v);
    }

    /// A new list of `resource` begins.
    pub fn restart(&mut self, resource: Resource) {
        self.0[resource as usize] = 0;
    }

    /// Takes `resource`'s position from `other` (a completed list).
    pub fn take(&mut self, resource: Resource, other: &ApiState) {
        self.0[resource as usize] = other.0[resource as usize];
    }

    /// Whether anything is known, so that the state can be placed among others.
    pub fn known(&self) -> bool {
        self.0.iter().any(|v| *v != 0)
    }

    /// Whether every event folded into `other` is folded into `self` too: `self` is at or
    /// after `other` on every resource.
    pub fn covers(&self, other: &ApiState) -> bool {
        self.0.iter().zip(other.0.iter()).all(|(a, b)| a >= b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covers_is_per_resource() {
        let a = ApiState([10, 20, 30, 40]);
        let b = ApiState([10, 21, 30, 40]);
        assert!(b.covers(&a));
        assert!(!a.covers(&b));
        assert!(a.covers(&a));
        // Ahead on one resource and behind on another: neither covers the other.
        let c = ApiState([11, 19, 30, 40]);
        assert!(!c.covers(&a) && !a.covers(&c));
    }

    #[test]
    fn folds_the_last_event_and_a_list_its_newest_object() {
        let mut s = ApiState::default();
        assert!(!s.known());
        s.fold(Resource::Services, Some("17"));
        s.fold(Resource::EndpointSlices, Some("18"));
        let mut list = ApiState::default();
        for v in ["3", "9", "4"] {
            list.list(Resource::Nodes, Some(v));
        }
        s.take(Resource::Nodes, &list);
        assert_eq!(s.to_wire(), vec![17, 18, 9, 0]);
        assert!(s.known());
        // Not a number: as if nothing of that resource were folded.
        s.fold(Resource::Services, Some("not-a-number"));
        assert_eq!(s.to_wire(), vec![0, 18, 9, 0]);
        assert_eq!(ApiState::from_wire(&s.to_wire()), Some(s));
        assert_eq!(ApiState::from_wire(&[1, 2, 3]), None);
    }
}
