//! A few hundred timings, kept exactly: the scale mode's distributions are small enough to sort,
//! and one sample of a sub-millisecond kernel apply says little (scheduling, a cold cache).
use std::time::Duration;

#[derive(Debug, Clone, Default)]
pub struct Samples(Vec<Duration>);

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The q-quantile by nearest rank (the smallest sample with at least q of them at or
    /// below it); zero without samples.
    pub fn quantile(&self, q: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort_unstable();
        let rank = (q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize;
        v.get(rank.saturating_sub(1)).copied().unwrap_or_default()
    }

    pub fn max(&self) -> Duration {
        self.0.iter().max().copied().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let mut s = Samples::default();
        assert_eq!(s.quantile(0.5), Duration::ZERO);
        for ms in (1..=200).rev() {
            s.push(Duration::from_millis(ms));
        }
        assert_eq!(s.len(), 200);
        assert_eq!(s.quantile(0.5), Duration::from_millis(100));
        assert_eq!(s.quantile(0.99), Duration::from_millis(198));
        assert_eq!(s.quantile(1.0), Duration::from_millis(200));
        assert_eq!(s.max(), Duration::from_millis(200));
        assert_eq!(s.quantile(0.0), Duration::from_millis(1));
    }
}
