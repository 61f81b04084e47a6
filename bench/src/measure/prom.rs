//! Reading Prometheus text exposition: counters, gauges and histograms, summed over every label
//! set except `le`. kube-proxy, the actuators, the brain and kube-apiserver all expose their
//! figures this way, and a phase's figure is the difference between two scrapes.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One parsed sample line: metric name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Parses the sample lines of an exposition; malformed lines are skipped.
pub fn parse(text: &str) -> Vec<Line> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Line> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let close = open + line[open..].find('}')?;
            (
                &line[..open],
                parse_labels(&line[open + 1..close]),
                &line[close + 1..],
            )
        }
        None => {
            let sp = line.find(' ')?;
            (&line[..sp], Vec::new(), &line[sp..])
        }
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Line {
        name: name.to_string(),
        labels,
        value,
    })
}

fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_string();
        let after = &rest[eq + 1..];
        let Some(after) = after.strip_prefix('"') else {
            break;
        };
        // Values may contain escaped quotes.
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let Some(end) = end else { break };
        out.push((key, after[..end].to_string()));
        rest = &after[end + 1..];
    }
    out
}

/// A parsed scrape.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    lines: Vec<Line>,
}

impl Scrape {
    pub fn parse(text: &str) -> Scrape {
        Scrape { lines: parse(text) }
    }

    /// Sum of every series of `name` (any labels); `None` when the metric is absent.
    pub fn sum(&self, name: &str) -> Option<f64> {
        self.sum_where(name, |_| true)
    }

    /// Sum of the series of `name` whose labels satisfy `pred`.
    pub fn sum_where(&self, name: &str, pred: impl Fn(&[(String, String)]) -> bool) -> Option<f64> {
        let mut found = false;
        let mut total = 0.0;
        for l in self.lines.iter().filter(|l| l.name == name) {
            if pred(&l.labels) {
                found = true;
                total += l.value;
            }
        }
        found.then_some(total)
    }

    /// How much the counter `name` (summed over labels) grew since `earlier`; `None` when
    /// either scrape lacks it. A counter that went down belongs to a restarted process: all of
    /// it is new.
    pub fn increase_since(&self, name: &str, earlier: Option<&Scrape>) -> Option<f64> {
        let now = self.sum(name)?;
        let before = earlier?.sum(name)?;
        Some(if now >= before { now - before } else { now })
    }

    /// The largest value of any series of `name`.
    pub fn max(&self, name: &str) -> Option<f64> {
        self.max_where(name, |_| true)
    }

    /// The largest value of the series of `name` whose labels satisfy `pred`.
    pub fn max_where(&self, name: &str, pred: impl Fn(&[(String, String)]) -> bool) -> Option<f64> {
        self.lines
            .iter()
            .filter(|l| l.name == name && pred(&l.labels))
            .map(|l| l.value)
            .reduce(f64::max)
    }

    /// The histogram `name` (from `name_bucket`, `name_sum`, `name_count`), summed over labels.
    pub fn histogram(&self, name: &str) -> Option<Histogram> {
        self.histogram_where(name, |_| true)
    }

    /// Like [`Scrape::histogram`], over the series whose labels satisfy `pred`.
    pub fn histogram_where(
        &self,
        name: &str,
        pred: impl Fn(&[(String, String)]) -> bool,
    ) -> Option<Histogram> {
        let bucket = format!("{name}_bucket");
        let mut buckets: BTreeMap<OrdF64, f64> = BTreeMap::new();
        for l in self
            .lines
            .iter()
            .filter(|l| l.name == bucket && pred(&l.labels))
        {
            let Some(le) = l.labels.iter().find(|(k, _)| k == "le") else {
                continue;
            };
            let le = match le.1.as_str() {
                "+Inf" => f64::INFINITY,
                v => match v.parse() {
                    Ok(v) => v,
                    Err(_) => continue,
                },
            };
            *buckets.entry(OrdF64(le)).or_default() += l.value;
        }
        let count = self.sum_where(&format!("{name}_count"), &pred)?;
        let sum = self.sum_where(&format!("{name}_sum"), &pred).unwrap_or(0.0);
        Some(Histogram {
            buckets: buckets.into_iter().map(|(k, v)| (k.0, v)).collect(),
            sum,
            count,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct OrdF64(f64);
impl Eq for OrdF64 {}
impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for OrdF64 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// A cumulative Prometheus histogram: `(upper bound, cumulative count)` in ascending order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// `self - earlier`, bucket by bucket (what was observed in between). A missing earlier
    /// scrape counts as empty; a counter reset (the process restarted) keeps `self`.
    pub fn since(&self, earlier: Option<&Histogram>) -> Histogram {
        let Some(e) = earlier else {
            return self.clone();
        };
        if e.count > self.count {
            return self.clone();
        }
        let buckets = self
            .buckets
            .iter()
            .map(|(le, c)| {
                let before = e
                    .buckets
                    .iter()
                    .find(|(l, _)| l == le)
                    .map(|(_, c)| *c)
                    .unwrap_or(0.0);
                (*le, (c - before).max(0.0))
            })
            .collect();
        Histogram {
            buckets,
            sum: self.sum - e.sum,
            count: self.count - e.count,
        }
    }

    /// An upper bound of the q-quantile (0..=1): the bound of the bucket it falls in. Buckets
    /// are coarse (kube-proxy's network-programming buckets start at 250 ms), so interpolating
    /// inside one, as `histogram_quantile` does, would claim a precision the data lacks. When it
    /// falls above the last finite bound, that bound is returned (see `above_last_bucket`).
    /// `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = (q.clamp(0.0, 1.0) * self.count).max(f64::MIN_POSITIVE);
        let mut last_finite = 0.0;
        for &(le, c) in &self.buckets {
            if le.is_finite() {
                last_finite = le;
            }
            if c >= rank {
                return Some(if le.is_finite() { le } else { last_finite });
            }
        }
        Some(last_finite)
    }

    /// The upper bound of the highest non-empty bucket (the "max bucket").
    pub fn max_bucket(&self) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        self.buckets
            .iter()
            .find(|(_, c)| *c >= self.count)
            .map(|(le, _)| *le)
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// Adds another histogram with the same bounds (bounds missing here are appended).
    pub fn merge(&mut self, other: &Histogram) {
        for &(le, c) in &other.buckets {
            match self.buckets.iter_mut().find(|(l, _)| *l == le) {
                Some(b) => b.1 += c,
                None => self.buckets.push((le, c)),
            }
        }
        self.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        self.sum += other.sum;
        self.count += other.count;
    }

    /// A summary for the report.
    pub fn summary(&self) -> HistSummary {
        HistSummary {
            count: self.count,
            sum: self.sum,
            mean: self.mean(),
            p50: self.quantile(0.5),
            p99: self.quantile(0.99),
            max_bucket: self.max_bucket().filter(|v| v.is_finite()),
            above_last_bucket: self.max_bucket().is_some_and(f64::is_infinite),
        }
    }
}

/// What the report says about a histogram taken across a phase.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HistSummary {
    pub count: f64,
    pub sum: f64,
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    /// Upper bound of the highest non-empty bucket.
    pub max_bucket: Option<f64>,
    /// Some observation was above the last finite bucket.
    pub above_last_bucket: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP x_seconds a histogram
# TYPE x_seconds histogram
x_seconds_bucket{le="0.001"} 1
x_seconds_bucket{le="0.01"} 3
x_seconds_bucket{le="0.1"} 4
x_seconds_bucket{le="+Inf"} 4
x_seconds_sum 0.05
x_seconds_count 4
apiserver_longrunning_requests{component="apiserver",group="",resource="services",scope="cluster",subresource="",verb="WATCH",version="v1"} 3
apiserver_longrunning_requests{component="apiserver",group="",resource="nodes",scope="cluster",subresource="",verb="LIST",version="v1"} 7
plain 42
"#;

    #[test]
    fn parses_histograms_and_labelled_gauges() {
        let s = Scrape::parse(TEXT);
        let h = s.histogram("x_seconds").unwrap();
        assert_eq!(h.count, 4.0);
        assert_eq!(h.buckets.len(), 4);
        assert_eq!(h.max_bucket(), Some(0.1));
        assert_eq!(h.quantile(0.5), Some(0.01));
        assert_eq!(h.quantile(0.25), Some(0.001));
        assert_eq!(h.quantile(1.0), Some(0.1));
        assert_eq!(s.sum("plain"), Some(42.0));
        let watches = s.sum_where("apiserver_longrunning_requests", |l| {
            l.iter().any(|(k, v)| k == "verb" && v == "WATCH")
        });
        assert_eq!(watches, Some(3.0));
        assert_eq!(s.sum("absent"), None);
    }

    #[test]
    fn delta_of_two_scrapes() {
        let a = Scrape::parse(TEXT).histogram("x_seconds").unwrap();
        let mut b = a.clone();
        b.buckets[2].1 += 2.0;
        b.buckets[3].1 += 2.0;
        b.count += 2.0;
        b.sum += 0.1;
        let d = b.since(Some(&a));
        assert_eq!(d.count, 2.0);
        assert_eq!(d.max_bucket(), Some(0.1));
        assert!((d.mean().unwrap() - 0.05).abs() < 1e-9);
        assert_eq!(Histogram::default().quantile(0.5), None);
    }

    #[test]
    fn a_counter_grows_since_an_earlier_scrape_or_restarts() {
        let before = Scrape::parse("c_total 2.5\n");
        let after = Scrape::parse("c_total 4\n");
        assert_eq!(after.increase_since("c_total", Some(&before)), Some(1.5));
        assert_eq!(before.increase_since("c_total", Some(&after)), Some(2.5));
        assert_eq!(after.increase_since("c_total", None), None);
        assert_eq!(after.increase_since("absent", Some(&before)), None);
    }
}
