//! Single changes as a distribution: `--single-changes` endpoints of different Services turn
//! not ready one at a time, each alone (every splitproxy node converged and kube-proxy synced
//! before the next, at least `--single-gap-ms` apart and a second after kube-proxy's last sync,
//! its minimum sync period), so that a single change's network
//! programming latency, kernel apply and time to the real nodes are percentiles over K changes
//! and every node, not one sample per node.
use std::time::{Duration, Instant, SystemTime};

use super::{Bench, LAST_SYNC, SYNC, SYNC_ON_CPU, mean_of, unix};
use crate::measure::prom::Scrape;
use crate::measure::stats::LatencyHist;
use crate::results::{Phase, SingleChanges};

/// How long kube-proxy may take to count one change before the phase moves on without it.
const KUBE_PROXY_WAIT: Duration = Duration::from_secs(30);
/// kube-proxy's `--min-sync-period` in nftables mode (its default, which the bench keeps): a
/// change arriving sooner after its last sync waits for the rest of it. The next single change
/// comes no sooner, so that kube-proxy too sees each change after a quiet period and its
/// figure is its reaction to one change, not its rate limit.
const KUBE_PROXY_MIN_SYNC: Duration = Duration::from_secs(1);

/// The endpoint_flip phase: K single-endpoint changes.
pub async fn endpoint_flip(b: &mut Bench) -> anyhow::Result<(Phase, SingleChanges)> {
    let k = b.args.single_changes;
    let gap = b.args.single_gap();
    let mut run = b.begin("endpoint_flip").await;
    let plain = b.workload.plain_services();
    let real = b.rig.real;
    let mut out = SingleChanges {
        changes: k,
        gap_seconds: gap.as_secs_f64(),
        ..Default::default()
    };
    let mut npl_real = LatencyHist::default();
    let mut real_per_change = LatencyHist::default();
    let mut real_apply = LatencyHist::default();
    let mut real_apply_on_cpu = LatencyHist::default();
    let mut kp_exact = LatencyHist::default();
    let mut kp_sync = LatencyHist::default();
    let mut converged = LatencyHist::default();
    let mut last = SystemTime::now();
    for c in 0..k {
        let real_before: Vec<Option<Scrape>> =
            (0..real).map(|i| b.rig.actuator_scrape(i).ok()).collect();
        let kp_before = b.kube_proxy_scrape();
        let began = Instant::now();
        let svc = &mut b.workload.services[c % plain];
        let ep = &mut svc.slices[0].endpoints[0];
        ep.ready = !ep.ready;
        let (name, slice) = (svc.name.clone(), svc.slices[0].clone());
        let t = b.writer.update_slice(&name, &slice).await?;
        last = t;
        run.changes += 1;
        if b.wait_splitproxy(&mut run, t).await
            && let Some(d) = run.last_converged()
        {
            converged.record(d.as_secs_f64());
        }

        // The real actuators: the change's one sync, exactly.
        let mut reached = Vec::new();
        for (i, before) in real_before.iter().enumerate() {
            let Ok(after) = b.rig.actuator_scrape(i) else {
                continue;
            };
            if let Some(last_sync) = after.max(LAST_SYNC)
                && last_sync >= unix(t)
            {
                let exact = last_sync - unix(t);
                run.real_exact.push(exact);
                npl_real.record(exact);
                reached.push(exact);
            }
            let d = after
                .histogram(SYNC)
                .map(|h| h.since(before.as_ref().and_then(|b| b.histogram(SYNC)).as_ref()));
            match d {
                Some(d) if d.count == 1.0 => {
                    real_apply.record(d.sum);
                    if let Some(on_cpu) = after.increase_since(SYNC_ON_CPU, before.as_ref()) {
                        real_apply_on_cpu.record(on_cpu);
                    }
                }
                _ => out.real_apply_inexact += 1,
            }
        }
        let per_change = mean_of(reached.into_iter());
        if let Some(v) = per_change {
            real_per_change.record(v);
        }
        out.real_per_change_seconds.push(per_change);

        // kube-proxy: its first sync that counted the change.
        if b.rig.kube_proxy.is_some() {
            let before = kp_before.unwrap_or_default();
            let counted_before = before.npl.as_ref().map_or(0.0, |h| h.count);
            let deadline = Instant::now() + KUBE_PROXY_WAIT;
            let mut exact = None;
            let mut synced_at = None;
            while Instant::now() < deadline {
                if let Some(now) = b.kube_proxy_scrape() {
                    let counted = now.npl.as_ref().map_or(0.0, |h| h.count) - counted_before;
                    let last_sync = now.last_sync.unwrap_or(0.0);
                    if counted >= 1.0 && last_sync >= unix(t) {
                        exact = Some(last_sync - unix(t));
                        synced_at = Some(last_sync);
                        if let Some(d) = now
                            .sync
                            .as_ref()
                            .map(|h| h.since(before.sync.as_ref()))
                            .filter(|d| d.count > 0.0)
                        {
                            kp_sync.record(d.sum / d.count);
                        }
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            match exact {
                Some(e) => kp_exact.record(e),
                None => out.kube_proxy_missed += 1,
            }
            out.kube_proxy_per_change_seconds.push(exact);
            if let Some(at) = synced_at {
                let quiet = at + KUBE_PROXY_MIN_SYNC.as_secs_f64() - unix(SystemTime::now());
                if quiet > 0.0 {
                    tokio::time::sleep(Duration::from_secs_f64(quiet)).await;
                }
            }
        }
        // Alone: the next change comes no sooner than `gap` after this one.
        if let Some(rest) = gap.checked_sub(began.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }
    out.npl_real = npl_real.summary();
    out.real_per_change = real_per_change.summary();
    out.real_apply = real_apply.summary();
    out.real_apply_on_cpu = real_apply_on_cpu.summary();
    out.kube_proxy_exact = kp_exact.summary();
    out.kube_proxy_sync = kp_sync.summary();
    out.converged = converged.summary();
    if out.kube_proxy_missed > 0 {
        run.notes.push(format!(
            "kube-proxy did not count {} of {k} single changes within {KUBE_PROXY_WAIT:?}",
            out.kube_proxy_missed
        ));
    }
    let desc = format!(
        "{k} single changes, each alone: one endpoint of one Service turns not ready (or \
         ready again), the next at least {} ms later and only once every node holds it",
        gap.as_millis()
    );
    let phase = b.finish(run, &desc, last, k, None).await;
    out.npl = phase.splitproxy.npl.clone();
    out.npl_virtual = phase.splitproxy.npl_virtual.clone();
    println!(
        "[bench]   endpoint_flip: {k} changes; NPL p50 {} p99 {}; real nodes reached after {} \
         (mean), p50 {}; kernel apply p50 {} p99 {} (on CPU p50 {} p99 {}); kube-proxy {} (mean), p50 {}",
        ms(out.npl.p50),
        ms(out.npl.p99),
        ms(out.real_per_change.mean),
        ms(out.real_per_change.p50),
        ms(out.real_apply.p50),
        ms(out.real_apply.p99),
        ms(out.real_apply_on_cpu.p50),
        ms(out.real_apply_on_cpu.p99),
        ms(out.kube_proxy_exact.mean),
        ms(out.kube_proxy_exact.p50),
    );
    Ok((phase, out))
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:.1} ms", v * 1e3))
}
