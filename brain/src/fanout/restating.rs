//! The update a node placed in a window of publications gets ([`Resume::Window`]): a restating
//! delta (crate::restate), its shared part built once for every node in the same window.
//!
//! [`Resume::Window`]: super::Resume::Window
use std::sync::Arc;

use splitproxy_proto::frames::encode_parts;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::update::Body;

use super::{Base, BodyKey, EncodedBody, Fanout, Held, Next, Publication};
use crate::restate::{self, Touched};

impl Fanout {
    /// The restating delta for `node`, which holds some state in the window that starts at
    /// `start` (a publication of this brain), towards `desired`. `None` when the window is no
    /// longer remembered whole (many publications since, or a rebuild): the node then needs a
    /// snapshot.
    pub fn restating_update(
        &self,
        node: &str,
        start: &Held,
        desired: &Publication,
    ) -> Option<Next> {
        let target = desired.held(node)?;
        let steps = self.history.steps(start.version, desired.version)?;
        let key: BodyKey = (start.version, desired.version, true);
        let touched = self.window_changes(&key, &steps);
        let shared = self.body(&key, || {
            EncodedBody::new(encode_parts(
                Body::Delta(restate::shared(&target.shared, &touched)),
                self.part_elements,
            ))
        });
        let mut own_touched = Touched::default();
        let empty = Arc::new(Model::default());
        let overlay = |p: &Publication| p.overlays.get(node).cloned().unwrap_or(empty.clone());
        for w in steps.windows(2) {
            let (a, b) = (overlay(&w[0]), overlay(&w[1]));
            if !Arc::ptr_eq(&a, &b) {
                own_touched.overlay_step(&a, &b);
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
    fn window_changes(&self, key: &BodyKey, steps: &[Arc<Publication>]) -> Arc<Touched> {
        if let Some(t) = self.windows.lock().ok().and_then(|c| c.get(key).cloned()) {
            return t;
        }
        let mut touched = Touched::default();
        for w in steps.windows(2) {
            touched.shared_step(&w[0].shared, &w[1].shared);
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
