//! PNG plots of a run: network-programming latency CDFs (splitproxy vs kube-proxy), the brain's
//! fan-out latency, and kernel apply times per phase.
//!
//! Text needs a font; plotters' `ab_glyph` backend takes the font file's bytes, so no fontconfig
//! is involved. The font is Debian's DejaVu Sans (`fonts-dejavu-core`, installed by
//! tools/setup.sh); without it the plots are skipped with a note.
use std::path::Path;

use anyhow::{Context, anyhow};
use plotters::prelude::*;

use crate::measure::prom::Histogram;
use crate::measure::stats::LatencyHist;
use crate::results::BenchResult;

pub const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
const SIZE: (u32, u32) = (1000, 620);

/// Registers the font once; an error says why plots cannot have text.
fn font() -> anyhow::Result<()> {
    static REGISTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let bytes = std::fs::read(FONT).map_err(|e| format!("reading {FONT}: {e}"))?;
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{FONT} is not a usable font"))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// Draws every plot into `out`; returns the file names written.
pub fn draw_all(r: &BenchResult, npl_all: &LatencyHist, out: &Path) -> anyhow::Result<Vec<String>> {
    font()?;
    let mut written = Vec::new();
    let kp = crate::report::kube_proxy_npl(r);
    if npl_all.n > 0 || kp.as_ref().is_some_and(|h| h.count > 0.0) {
        npl_cdf(npl_all, kp.as_ref(), &out.join("npl_cdf.png"))?;
        written.push("npl_cdf.png".to_string());
    }
    let fanouts: Vec<(String, Histogram)> = r
        .phases
        .iter()
        .filter_map(|p| {
            let h = p.splitproxy.fanout_histogram.clone()?;
            (h.count > 0.0).then(|| (p.name.clone(), h))
        })
        .collect();
    if !fanouts.is_empty() {
        hist_cdfs(
            "brain fan-out latency (publication → last node's ack)",
            &fanouts,
            &out.join("fanout_cdf.png"),
        )?;
        written.push("fanout_cdf.png".to_string());
    }
    if apply_bars(r, &out.join("apply_times.png"))? {
        written.push("apply_times.png".to_string());
    }
    Ok(written)
}

/// Axis labels without float noise (0.3, not 0.30000000000000004).
fn secs_label(x: &f64) -> String {
    if *x >= 0.001 {
        let s = format!("{x:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{x:.0e}")
    }
}

/// Points of a cumulative Prometheus histogram as a CDF (finite buckets only).
fn hist_points(h: &Histogram) -> Vec<(f64, f64)> {
    if h.count <= 0.0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (le, c) in h.buckets.iter().filter(|(le, _)| le.is_finite()) {
        let f = c / h.count;
        // Leading empty buckets and the flat top carry no information.
        if f <= 0.0 {
            out.clear();
        }
        out.push((*le, f));
        if f >= 1.0 {
            break;
        }
    }
    out
}

fn x_range(points: &[&[(f64, f64)]]) -> (f64, f64) {
    let xs = points.iter().flat_map(|p| p.iter().map(|(x, _)| *x));
    let lo = xs
        .clone()
        .filter(|x| *x > 0.0)
        .fold(f64::INFINITY, f64::min);
    let hi = xs.fold(0.0, f64::max);
    let lo = if lo.is_finite() { lo / 2.0 } else { 1e-4 };
    let hi = if hi > lo { hi * 2.0 } else { lo * 100.0 };
    (lo.max(1e-6), hi)
}

fn npl_cdf(sp: &LatencyHist, kp: Option<&Histogram>, path: &Path) -> anyhow::Result<()> {
    let sp_points = sp.cdf();
    let kp_points = kp.map(hist_points).unwrap_or_default();
    let (lo, hi) = x_range(&[&sp_points, &kp_points]);
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Network programming latency, every change phase (CDF)",
            ("sans-serif", 24),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.0)?;
    chart
        .configure_mesh()
        .x_label_formatter(&secs_label)
        .x_desc("seconds from trigger time to applied on the node (log)")
        .y_desc("fraction of (node, change) samples")
        .label_style(("sans-serif", 15))
        .draw()?;
    if !sp_points.is_empty() {
        chart
            .draw_series(LineSeries::new(
                sp_points.iter().copied(),
                BLUE.stroke_width(3),
            ))?
            .label(format!("splitproxy, every node (exact, n={})", sp.n))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(3)));
    }
    if !kp_points.is_empty() {
        chart
            .draw_series(LineSeries::new(
                kp_points.iter().copied(),
                RED.stroke_width(3),
            ))?
            .label(format!(
                "kube-proxy, 1 node (its histogram buckets, n={})",
                kp.map_or(0.0, |h| h.count)
            ))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(3)));
        chart.draw_series(kp_points.iter().map(|p| Circle::new(*p, 4, RED.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()?;
    root.present().context("writing the NPL plot")?;
    Ok(())
}

fn hist_cdfs(title: &str, series: &[(String, Histogram)], path: &Path) -> anyhow::Result<()> {
    let points: Vec<Vec<(f64, f64)>> = series.iter().map(|(_, h)| hist_points(h)).collect();
    let refs: Vec<&[(f64, f64)]> = points.iter().map(Vec::as_slice).collect();
    let (lo, hi) = x_range(&refs);
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.0)?;
    chart
        .configure_mesh()
        .x_label_formatter(&secs_label)
        .x_desc("seconds (log; histogram bucket bounds)")
        .y_desc("fraction of publications")
        .label_style(("sans-serif", 15))
        .draw()?;
    for (i, ((name, h), pts)) in series.iter().zip(&points).enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(3)))?
            .label(format!("{name} (n={})", h.count))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()?;
    root.present().context("writing a CDF plot")?;
    Ok(())
}

/// Mean kernel apply per phase: real actuators (mean over nodes) and kube-proxy's sync.
fn apply_bars(r: &BenchResult, path: &Path) -> anyhow::Result<bool> {
    let mut rows: Vec<(String, Option<f64>, Option<f64>)> = Vec::new();
    let first = crate::phases::mean_of(
        r.cold_start
            .real_first_apply
            .values()
            .map(|h| h.sum / h.count.max(1.0)),
    );
    let kp_first = r
        .kube_proxy_cold_start
        .as_ref()
        .and_then(|k| k.sync.as_ref())
        .and_then(|h| h.mean);
    rows.push(("cold start".into(), first, kp_first));
    for p in &r.phases {
        let sp = crate::phases::mean_of(p.splitproxy.real_apply.values().filter_map(|h| h.mean));
        let kp = p
            .kube_proxy
            .as_ref()
            .and_then(|k| k.sync.as_ref())
            .and_then(|h| h.mean);
        rows.push((p.name.clone(), sp, kp));
    }
    let values: Vec<f64> = rows
        .iter()
        .flat_map(|(_, a, b)| [*a, *b])
        .flatten()
        .filter(|v| *v > 0.0)
        .collect();
    if values.is_empty() {
        return Ok(false);
    }
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min) / 3.0;
    let hi = values.iter().copied().fold(0.0, f64::max) * 3.0;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let n = rows.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Kernel apply time per update (mean), by phase",
            ("sans-serif", 24),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..n as f64, (lo..hi).log_scale())?;
    let labels: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 0.01 {
                labels.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("seconds (log)")
        .label_style(("sans-serif", 14))
        .draw()?;
    let bar = |i: usize, left: bool, v: f64, color: RGBColor| {
        let x0 = i as f64 + if left { 0.12 } else { 0.5 };
        Rectangle::new([(x0, lo), (x0 + 0.38, v)], color.filled())
    };
    chart
        .draw_series(
            rows.iter()
                .enumerate()
                .filter_map(|(i, r)| r.1.map(|v| bar(i, true, v, BLUE))),
        )?
        .label("splitproxy real actuators (one nf_tables transaction)")
        .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], BLUE.filled()));
    chart
        .draw_series(
            rows.iter()
                .enumerate()
                .filter_map(|(i, r)| r.2.map(|v| bar(i, false, v, RED))),
        )?
        .label("kube-proxy sync (nftables mode)")
        .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], RED.filled()));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()?;
    root.present().context("writing the apply plot")?;
    Ok(true)
}
