//! How figures read in the report: durations, sizes, ratios and distributions as table cells.
use crate::measure::prom::HistSummary;
use crate::measure::stats::Stats;
use crate::results::BenchResult;

use super::{MIB, before_brain_mean};

pub(super) fn ms(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => {
            if v >= 10.0 {
                format!("{v:.1} s")
            } else if v >= 0.1 {
                format!("{:.0} ms", v * 1e3)
            } else {
                format!("{:.2} ms", v * 1e3)
            }
        }
        Some(_) => "> last bucket".into(),
        None => "n/a".into(),
    }
}

pub(super) fn mib(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{:.1} MiB", v / MIB))
}

pub(super) fn num(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| {
        if v.fract() == 0.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    })
}

pub(super) fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or("n/a".into(), |r| {
        if r < 0.01 {
            format!("{r:.4}")
        } else {
            format!("{r:.2}")
        }
    })
}

/// Which code ran: the binary's commit, and the checkout's when it differs (or when an older
/// result has no binary commit).
pub(super) fn commits(v: &crate::results::Versions) -> String {
    match (v.build_commit.as_str(), v.git_commit.as_str()) {
        ("", checkout) => format!("checkout {checkout}"),
        (built, checkout) if built == checkout => built.to_string(),
        (built, checkout) => format!("built from {built}, run from checkout {checkout}"),
    }
}

pub(super) fn gb(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| {
        if v >= 1e9 {
            format!("{:.2} GB", v / 1e9)
        } else {
            format!("{:.1} MB", v / 1e6)
        }
    })
}

/// "p50 X p99 Y (n=N)" of a distribution.
pub(super) fn dist(s: Option<&Stats>) -> String {
    match s {
        Some(s) if s.n > 0 => format!("p50 {} p99 {} (n={})", ms(s.p50), ms(s.p99), s.n),
        _ => "n/a".into(),
    }
}

pub(super) fn kube_proxy_cold_text(r: &BenchResult) -> String {
    match &r.kube_proxy_cold_start {
        None => "not run".into(),
        Some(k) => match k.first_sync_seconds {
            Some(s) => format!(
                "first sync done {:.1} s after start (sync {})",
                s,
                ms(k.full_sync
                    .as_ref()
                    .or(k.sync.as_ref())
                    .and_then(|h| h.max_bucket.or(h.mean)))
            ),
            None => format!("no sync within {:.0} s", k.timeout_seconds),
        },
    }
}

pub(super) fn hist_cell(h: Option<&HistSummary>) -> String {
    match h {
        Some(h) if h.count > 0.0 => format!(
            "n={} mean {} p50 ≤ {} p99 ≤ {} max ≤ {}",
            h.count,
            ms(h.mean),
            ms(h.p50),
            ms(h.p99),
            if h.above_last_bucket {
                "∞".into()
            } else {
                ms(h.max_bucket)
            }
        ),
        Some(_) => "none".into(),
        None => "metric absent".into(),
    }
}

/// [`before_brain_mean`] as a cell of the report, or why there is none.
pub(super) fn before_brain_cell(
    publish: Option<&HistSummary>,
    queue: Option<&HistSummary>,
) -> String {
    if let Some((mean, changes)) = before_brain_mean(publish, queue) {
        return format!("{} (over {changes} changes)", ms(Some(mean)));
    }
    match (publish, queue) {
        (Some(p), Some(q)) if p.count > 0.0 && p.count == q.count => "none".into(),
        (Some(p), Some(q)) if p.count > 0.0 || q.count > 0.0 => {
            format!("n/a ({} and {} changes counted)", p.count, q.count)
        }
        (Some(_), Some(_)) => "none".into(),
        _ => "metric absent".into(),
    }
}

pub(super) fn stats_cell(s: &Stats) -> String {
    if s.n == 0 {
        return "none".into();
    }
    format!(
        "n={} p50 {} p99 {} max {}",
        s.n,
        ms(s.p50),
        ms(s.p99),
        ms(s.max)
    )
}

pub(super) fn dist_cell(s: &Stats) -> String {
    if s.n == 0 {
        return "none".into();
    }
    format!(
        "n={} mean {} p50 {} p99 {} max {}",
        s.n,
        ms(s.mean),
        ms(s.p50),
        ms(s.p99),
        ms(s.max)
    )
}

/// Counts by kind, "full 10, resumed 4990"; "-" when the brain reported none.
pub(super) fn by_kind(m: &std::collections::BTreeMap<String, f64>) -> String {
    if m.is_empty() {
        return "-".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A histogram's summary that knows only its count and mean, for tests.
#[cfg(test)]
pub(super) fn summary(count: f64, mean: f64) -> HistSummary {
    HistSummary {
        count,
        sum: count * mean,
        mean: Some(mean),
        p50: None,
        p99: None,
        max_bucket: None,
        above_last_bucket: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_before_the_brain_is_the_difference_of_the_means_over_the_same_changes() {
        let cell = before_brain_cell(Some(&summary(6000.0, 0.432)), Some(&summary(6000.0, 0.137)));
        assert_eq!(cell, "295 ms (over 6000 changes)");
        assert_eq!(
            before_brain_cell(Some(&summary(20.0, 0.4)), Some(&summary(19.0, 0.1))),
            "n/a (20 and 19 changes counted)",
            "different changes: no difference of means"
        );
        assert_eq!(
            before_brain_cell(Some(&summary(0.0, 0.0)), Some(&summary(0.0, 0.0))),
            "none"
        );
        assert_eq!(
            before_brain_cell(None, Some(&summary(1.0, 0.1))),
            "metric absent"
        );
    }
}
