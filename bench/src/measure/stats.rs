//! Latency distributions of exact samples.
//!
//! At full scale the virtual fleet yields one network-programming sample per node per change:
//! 5,000 nodes x 6,000 churn changes is 30 million samples, too many to keep as a list. A
//! log-bucketed histogram (1% wide buckets from 1 µs to 3 hours) keeps percentiles within 1%,
//! exact minimum, maximum and mean, and the data for CDF plots, in constant memory.
use serde::{Deserialize, Serialize};

const MIN_S: f64 = 1e-6;
/// Buckets grow by 1% each.
const GROWTH: f64 = 1.01;
const BUCKETS: usize = 2400; // 1e-6 * 1.01^2400 ≈ 2e4 s

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatencyHist {
    counts: Vec<u64>,
    pub n: u64,
    pub sum: f64,
    pub min: f64,
    pub max: f64,
    /// Samples below zero (clock skew between the writer and the node): counted as zero.
    pub negative: u64,
}

impl Default for LatencyHist {
    fn default() -> Self {
        LatencyHist {
            counts: vec![0; BUCKETS + 1],
            n: 0,
            sum: 0.0,
            min: f64::INFINITY,
            max: 0.0,
            negative: 0,
        }
    }
}

fn index(v: f64) -> usize {
    if v <= MIN_S {
        return 0;
    }
    let i = ((v / MIN_S).ln() / GROWTH.ln()).ceil();
    (i as usize).min(BUCKETS)
}

fn upper(i: usize) -> f64 {
    MIN_S * GROWTH.powi(i as i32)
}

impl LatencyHist {
    pub fn record(&mut self, seconds: f64) {
        let v = if seconds < 0.0 {
            self.negative += 1;
            0.0
        } else {
            seconds
        };
        self.counts[index(v)] += 1;
        self.n += 1;
        self.sum += v;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    pub fn merge(&mut self, other: &LatencyHist) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.n += other.n;
        self.sum += other.sum;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        self.negative += other.negative;
    }

    /// The q-quantile (upper bound of its bucket, capped by the exact maximum).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.n == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(upper(i).min(self.max).max(self.min));
            }
        }
        Some(self.max)
    }

    /// (latency, fraction of samples at or below it) for every non-empty bucket: a CDF.
    pub fn cdf(&self) -> Vec<(f64, f64)> {
        let mut out = Vec::new();
        let mut seen = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            if *c == 0 {
                continue;
            }
            seen += c;
            out.push((upper(i).min(self.max), seen as f64 / self.n as f64));
        }
        out
    }

    pub fn summary(&self) -> Stats {
        Stats {
            n: self.n,
            p50: self.quantile(0.5),
            p90: self.quantile(0.9),
            p99: self.quantile(0.99),
            max: (self.n > 0).then_some(self.max),
            min: (self.n > 0).then_some(self.min),
            mean: (self.n > 0).then(|| self.sum / self.n as f64),
        }
    }
}

/// Percentiles of a distribution, seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub n: u64,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
    pub min: Option<f64>,
    pub mean: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_within_one_percent() {
        let mut h = LatencyHist::default();
        for i in 1..=1000 {
            h.record(i as f64 / 1000.0);
        }
        let s = h.summary();
        assert_eq!(s.n, 1000);
        let p50 = s.p50.unwrap();
        assert!((p50 - 0.5).abs() / 0.5 < 0.011, "{p50}");
        let p99 = s.p99.unwrap();
        assert!((p99 - 0.99).abs() / 0.99 < 0.011, "{p99}");
        assert_eq!(s.max, Some(1.0));
        let cdf = h.cdf();
        assert_eq!(cdf.last().map(|p| p.1), Some(1.0));
    }

    #[test]
    fn negative_and_huge_samples_are_kept() {
        let mut h = LatencyHist::default();
        h.record(-0.5);
        h.record(1e9);
        assert_eq!(h.n, 2);
        assert_eq!(h.negative, 1);
        assert_eq!(h.summary().max, Some(1e9));
        assert!(LatencyHist::default().summary().p50.is_none());
    }
}
