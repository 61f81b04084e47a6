//! The targets judged against a run, and the Markdown report (bench/RESULTS.md): each
//! target judged (`targets`), which ones the same run's fan-out floor rules out (`floors`), why
//! one was missed (`why`), the report (`markdown`) and the sections of the phases that have their
//! own (`sections`), and how figures read in its tables (`format`). What more than one of them
//! reads from a result is here.
use std::path::Path;

use crate::floor::Floor;
use crate::measure::prom::HistSummary;
use crate::results::{BenchResult, Phase};

mod floors;
mod format;
mod markdown;
mod sections;
mod targets;
mod why;

pub use markdown::markdown;
pub use targets::targets;

const MIB: f64 = 1024.0 * 1024.0;
/// The targets that a run can find under this machine's floor (`floors`), seconds.
const SINGLE_CHANGE_P99: f64 = 0.150;
const CHURN_P99: f64 = 0.300;
const CPU_PER_UPDATE: f64 = 10e-6;

pub fn phase<'a>(r: &'a BenchResult, name: &str) -> Option<&'a Phase> {
    r.phases.iter().find(|p| p.name == name)
}

/// Mean kernel apply time over the real actuators in a phase.
fn real_apply_mean(p: &Phase) -> Option<f64> {
    crate::phases::mean_of(p.splitproxy.real_apply.values().filter_map(|h| h.mean))
}

fn kp_sync_mean(p: &Phase) -> Option<f64> {
    p.kube_proxy.as_ref()?.sync.as_ref()?.mean
}

/// The largest peak RSS of processes whose role starts with `prefix`, over the whole run.
fn peak_rss(r: &BenchResult, prefix: &str) -> Option<f64> {
    let cold = r.cold_start.processes.iter();
    let kp = r
        .kube_proxy_cold_start
        .iter()
        .flat_map(|k| k.processes.iter());
    let phases = r.phases.iter().flat_map(|p| p.processes.iter());
    cold.chain(kp)
        .chain(phases)
        .filter(|(role, _)| role.starts_with(prefix))
        .map(|(_, u)| u.peak_rss_bytes as f64)
        .reduce(f64::max)
}

/// kube-proxy's NPL over every change phase, merged.
pub fn kube_proxy_npl(r: &BenchResult) -> Option<crate::measure::prom::Histogram> {
    let mut all: Option<crate::measure::prom::Histogram> = None;
    for p in &r.phases {
        if let Some(h) = p.kube_proxy.as_ref().and_then(|k| k.npl_histogram.as_ref()) {
            match all.as_mut() {
                Some(a) => a.merge(h),
                None => all = Some(h.clone()),
            }
        }
    }
    all
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a.is_finite() && b.is_finite() => Some(a / b),
        _ => None,
    }
}

/// CPU seconds in a phase of the processes whose role starts with `role` ("brain": every
/// replica; "bench": the virtual fleet and the API writer).
fn role_cpu(p: &Phase, role: &str) -> f64 {
    p.processes
        .iter()
        .filter(|(r, _)| r.starts_with(role))
        .map(|(_, u)| u.cpu_seconds)
        .sum()
}

/// [`role_cpu`] per update the brains sent in the phase.
fn cpu_per_update(p: &Phase, role: &str) -> Option<f64> {
    match p.splitproxy.updates_sent {
        Some(u) if u > 0.0 => Some(role_cpu(p, role) / u),
        _ => None,
    }
}

/// How long the changes took to reach the brain at all, and over how many changes: the mean of
/// trigger time → publication less the mean of watch event → publication, when both count the
/// same changes. On a shared machine the API server's write and watch can be a large part of
/// the NPL, and no brain change shortens it.
fn before_brain_mean(
    publish: Option<&HistSummary>,
    queue: Option<&HistSummary>,
) -> Option<(f64, f64)> {
    let (p, q) = (publish?, queue?);
    if p.count > 0.0 && p.count == q.count {
        Some((p.mean? - q.mean?, p.count))
    } else {
        None
    }
}

/// The floors a run measured, from the barest up: bare TCP, TLS, TLS on tokio, HTTP/2 by `h2`
/// and by hyper's server.
fn floors(r: &BenchResult) -> Vec<&Floor> {
    [
        &r.floor,
        &r.floor_tls,
        &r.floor_tokio,
        &r.floor_h2,
        &r.floor_hyper,
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The report's path to `out`: relative when `out` is beside or below the report.
pub fn relative(report: &Path, out: &Path) -> String {
    let base = report.parent().unwrap_or(Path::new("."));
    let abs = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let (b, o) = (abs(base), abs(out));
    match o.strip_prefix(&b) {
        Ok(rel) if !rel.as_os_str().is_empty() => rel.display().to_string(),
        _ => o.display().to_string(),
    }
}
