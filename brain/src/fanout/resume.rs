//! Where a node that connects resumes ([`Fanout::resume_point`]): the state this brain saw it
//! ack, a remembered publication whose digest it presents (another replica's, or this brain's
//! before a restart: by content), or a window of recent publications covering the API state it
//! presents (a restating delta); else nothing, and it gets a snapshot.
use super::{Fanout, Held, Resume, node_state};
use crate::api_state::ApiState;
use crate::metrics::Resumption;

impl Fanout {
    /// Where a resuming node stands, counted by kind
    /// (`splitproxy_brain_resumptions_total`): the state this brain knows it acked under this
    /// epoch; else, by content, the newest remembered publication at which the node would have
    /// held exactly the digest it presents (another replica's state, or this brain's before a
    /// restart, computed from the same API state); else nothing, and it gets a snapshot. The
    /// digest equality is the proof that the node holds the base a delta is computed from, and
    /// the actuator checks it again (`Update.base_digest`) and the digest after applying.
    ///
    /// A node whose digest matches nothing remembered but that presents the API state its
    /// ruleset was computed from (another replica's batches) is placed in a window of recent
    /// publications instead, and gets a restating delta ([`Resume::Window`], crate::restate).
    pub fn resume_point(
        &self,
        node: &str,
        applied: Option<&splitproxy_proto::v1::Applied>,
    ) -> Option<Resume> {
        let (resume, kind) = match self.resume(node, applied) {
            Some((held, kind)) => (Some(Resume::Exact(held)), kind),
            None => match self.window(node, applied) {
                Some((start, api)) => (Some(Resume::Window(start, api)), Resumption::Restated),
                None => (None, Resumption::Snapshot),
            },
        };
        self.metrics.resumed(kind);
        tracing::info!(
            node,
            resumption = kind.as_str(),
            version = resume.as_ref().map(Resume::version),
            api = ?applied.map(|a| &a.resource_versions),
            "resuming node"
        );
        resume
    }

    /// The start of the window of recent publications the node's state lies in (see
    /// [`crate::history::History::window_start`]), when it presents the API state its ruleset
    /// was computed from. The node does not hold it: nothing is recorded as acked.
    pub(super) fn window(
        &self,
        node: &str,
        applied: Option<&splitproxy_proto::v1::Applied>,
    ) -> Option<(u64, ApiState)> {
        let applied = applied.filter(|a| !a.digest.is_empty())?;
        let api = ApiState::from_wire(&applied.resource_versions)?;
        let start = self.history.window_start(&api)?;
        if let Ok(mut nodes) = self.nodes.lock() {
            let st = node_state(&mut nodes, node);
            st.acked = None;
            st.acked_generation = 0;
        }
        Some((start, api))
    }

    pub(super) fn resume(
        &self,
        node: &str,
        applied: Option<&splitproxy_proto::v1::Applied>,
    ) -> Option<(Held, Resumption)> {
        let applied = applied?;
        if applied.digest.is_empty() {
            return None; // nothing applied
        }
        let mut nodes = self.nodes.lock().ok()?;
        if applied.brain_epoch == self.epoch
            && let Some(st) = nodes.get(node)
            && let Some(held) = &st.acked
            && st.acked_generation == applied.generation
            && held.digest() == applied.digest
        {
            return Some((held.clone(), Resumption::SameEpoch));
        }
        let held = self.history.find(node, &applied.digest)?;
        // What the node holds now; not acked under a generation of this brain (0), so its next
        // delta names its base by digest.
        let st = node_state(&mut nodes, node);
        st.acked = Some(held.clone());
        st.acked_generation = 0;
        Some((held, Resumption::ByContent))
    }
}
