//! The update a node placed in a window of publications gets ([`Resume::Window`]): a restating
//! delta (crate::restate), its shared part built once for every node in the same window.
//!
//! [`Resume::Window`]: super::Resume::Window
use std::sync::Arc;

use splitproxy_proto::frames::encode_parts;
use splitproxy_proto::v1::update::Body;

use super::{Base, BodyKey, EncodedBody, Fanout, Next, Publication};
use crate::history::steps::Step;
use crate::restate::{self, Touched};

impl Fanout {
    /// The restating delta for `node`, which holds some state in the window that starts at
    /// version `start` (a publication of this brain), towards `desired`. `None` when the
    /// window is no longer remembered whole (half a minute of publications since, or a rebuild):
    /// the node then needs a snapshot.
    pub fn restating_update(&self, node: &str, start: u64, desired: &Publication) -> Option<Next> {
        let target = desired.held(node)?;
        let steps = self.history.steps(start, desired.version)?;
        let key: BodyKey = (start, desired.version, true);
        let touched = self.window_changes(&key, &steps);
        let shared = self.body(&key, || {
            EncodedBody::new(encode_parts(
                Body::Delta(restate::shared(&target.shared, &touched)),
                self.part_elements,
            ))
        });
        let mut own_touched = Touched::default();
        for step in &steps {
            if let Some(t) = step.overlays.get(node) {
                own_touched.extend(t);
            }
        }
        let own = Body::Delta(restate::own(&target.overlay, &own_touched, &touched));
        // What the node holds is another replica's: which changes are news to it is not known,
        // as for a snapshot.
        let news_after = self.news_after(node, &target);
        let tail = self.tail((news_after, desired.version), desired.api);
        let frames = self.frames(node, &shared, tail, own, &target, Base::Window)?;
        Some(Next::Send(frames, target))
    }

    /// What changed in the shared model over `steps`, computed once per window.
    fn window_changes(&self, key: &BodyKey, steps: &[Arc<Step>]) -> Arc<Touched> {
        if let Some(t) = self.windows.lock().ok().and_then(|c| c.get(key).cloned()) {
            return t;
        }
        let mut touched = Touched::default();
        for step in steps {
            touched.extend(&step.shared);
        }
        let touched = Arc::new(touched);
        if let Ok(mut c) = self.windows.lock() {
            // Windows towards older versions are no longer needed: only the latest is sent.
            c.retain(|k, _| k.1 == key.1);
            c.insert(*key, touched.clone());
        }
        touched
    }
}
