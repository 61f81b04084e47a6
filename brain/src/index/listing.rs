//! Where one watched resource stands in its list cycle.
//!
//! A watch starts with a list (`Init`, `InitApply`…, `InitDone`) and relists the same way after
//! it loses its place. The objects of a list are collected aside and handed over whole at
//! `InitDone`, so the index (and any publication) sees either the last complete list or the new
//! one, never a mix ("no empty push", docs/invariants.md).

/// One resource's list state: whether a complete list has been seen, and the objects of a list
/// under way.
#[derive(Debug)]
pub(super) struct Listing<T> {
    listed: bool,
    /// `Some` between `Init` and `InitDone`.
    buffer: Option<Vec<T>>,
}

impl<T> Default for Listing<T> {
    fn default() -> Self {
        Listing {
            listed: false,
            buffer: None,
        }
    }
}

impl<T> Listing<T> {
    /// A list starts (`Init`): objects go aside until it is done.
    pub(super) fn start(&mut self) {
        self.buffer = Some(Vec::new());
    }

    /// One object of the list under way (`InitApply`); ignored outside a list.
    pub(super) fn push(&mut self, item: T) {
        if let Some(buf) = self.buffer.as_mut() {
            buf.push(item);
        }
    }

    /// The list is done (`InitDone`): everything it held, to replace the resource with.
    pub(super) fn finish(&mut self) -> Vec<T> {
        self.listed = true;
        self.buffer.take().unwrap_or_default()
    }

    /// Whether the resource is complete: listed at least once and not relisting.
    pub(super) fn complete(&self) -> bool {
        self.listed && self.buffer.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::Listing;

    #[test]
    fn complete_only_between_lists() {
        let mut l = Listing::default();
        assert!(!l.complete(), "nothing listed yet");
        l.push(0); // outside a list: dropped
        l.start();
        l.push(1);
        l.push(2);
        assert!(!l.complete(), "first list under way");
        assert_eq!(l.finish(), vec![1, 2]);
        assert!(l.complete());
        l.start();
        assert!(!l.complete(), "relisting");
        l.push(3);
        assert_eq!(l.finish(), vec![3]);
        assert!(l.complete());
        assert!(
            l.finish().is_empty(),
            "a finish without a start hands over nothing"
        );
    }
}
