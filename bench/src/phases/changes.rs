//! The change phases, each a sequence of writes the way a controller would make them, measured
//! from each write's trigger time to its application on every node.
use std::time::{Duration, Instant, SystemTime};

use tokio::time::MissedTickBehavior;

use super::Bench;
use crate::results::Phase;

/// A 100-endpoint Service replaces its endpoints in 10 steps of 10, each a slice update.
pub async fn rolling_update(b: &mut Bench) -> anyhow::Result<Phase> {
    let mut run = b.begin("rolling_update").await;
    let idx = b.workload.rollout_index();
    let steps = 10;
    let per_step = b.workload.services[idx].slices[0].endpoints.len() / steps;
    let mut last = SystemTime::now();
    for step in 0..steps {
        for k in 0..per_step {
            let fresh = b.workload.fresh_endpoint(step * per_step + k);
            b.workload.services[idx].slices[0].endpoints[step * per_step + k] = fresh;
        }
        let svc = &b.workload.services[idx];
        last = b.writer.update_slice(&svc.name, &svc.slices[0]).await?;
        run.changes += 1;
        b.wait_splitproxy(&mut run, last).await;
    }
    Ok(b.finish(
        run,
        "a 100-endpoint Service replaces its endpoints, 10 at a time, in 10 slice updates",
        last,
        steps,
        None,
    )
    .await)
}

/// A new Service with its slice, then its deletion: two phases.
pub async fn service_add_delete(b: &mut Bench) -> anyhow::Result<(Phase, Phase)> {
    let extra = b.workload.extra_service(0);
    let mut run = b.begin("service_add").await;
    let times = b.writer.create_service(&extra).await?;
    let last = times.iter().max().copied().unwrap_or_else(SystemTime::now);
    run.changes = 1 + extra.slices.len();
    b.wait_splitproxy(&mut run, last).await;
    let single = (times.len() == 1).then_some(last);
    let add = b
        .finish(
            run,
            "a Service and its EndpointSlice are created",
            last,
            times.len(),
            single,
        )
        .await;

    let mut run = b.begin("service_delete").await;
    let t = SystemTime::now();
    b.writer.delete_service(&extra).await?;
    run.changes = 1 + extra.slices.len();
    b.wait_splitproxy(&mut run, t).await;
    let delete = b
        .finish(
            run,
            "the Service and its EndpointSlice are deleted (no trigger-time annotation: \
             splitproxy measures from when the brain saw the deletion, kube-proxy counts none)",
            t,
            0,
            Some(t),
        )
        .await;
    Ok((add, delete))
}

/// Every second, `--churn-percent` of the Services get one endpoint replaced, for
/// `--churn-seconds`; then waits until every node caught up.
pub async fn churn(b: &mut Bench) -> anyhow::Result<Phase> {
    let mut run = b.begin("churn").await;
    let (last, changes, notes) = churn_for(b, b.args.churn_seconds, Some(&mut run)).await;
    run.changes = changes;
    run.notes.extend(notes);
    b.wait_splitproxy(&mut run, last).await;
    let desc = format!(
        "{} % of the Services ({} slice updates) every second for {} s",
        b.args.churn_percent,
        b.args.churn_per_second(),
        b.args.churn_seconds
    );
    Ok(b.finish(run, &desc, last, changes, None).await)
}

/// How long one tick's writes may take before the tick counts as failed.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Churn writes, tick by tick: each tick (a second) replaces one endpoint in each of the next
/// `--churn-percent` of the plain Services, round robin, in `--churn-bursts` evenly spaced
/// bursts.
pub struct Churner {
    cursor: usize,
    per_tick: usize,
    bursts: u32,
}

impl Churner {
    pub fn new(b: &Bench) -> Churner {
        Churner {
            cursor: 0,
            per_tick: b.args.churn_per_second(),
            bursts: b.args.churn_bursts.max(1),
        }
    }

    /// The bursts of a tick.
    pub fn bursts(&self) -> u32 {
        self.bursts
    }

    /// When burst `burst` of a tick that began at `start` is written.
    pub fn burst_at(&self, start: Instant, burst: u32) -> Instant {
        start + Duration::from_secs(1) * burst / self.bursts
    }

    /// Writes the whole of tick `tick`, burst by burst at their times; returns the trigger
    /// times.
    pub async fn tick(&mut self, b: &mut Bench, tick: u64) -> anyhow::Result<Vec<SystemTime>> {
        let start = Instant::now();
        let mut times = Vec::with_capacity(self.per_tick);
        for burst in 0..self.bursts {
            tokio::time::sleep_until(self.burst_at(start, burst).into()).await;
            times.extend(self.burst(b, tick, burst).await?);
        }
        Ok(times)
    }

    /// Writes burst `burst` of tick `tick`'s slice updates (bounded by `WRITE_TIMEOUT`);
    /// returns their trigger times.
    pub async fn burst(
        &mut self,
        b: &mut Bench,
        tick: u64,
        burst: u32,
    ) -> anyhow::Result<Vec<SystemTime>> {
        let plain = b.workload.plain_services();
        let bursts = self.bursts as usize;
        let burst = burst as usize;
        // This burst's share of the tick's writes, so that the bursts add up to it.
        let count = self.per_tick * (burst + 1) / bursts - self.per_tick * burst / bursts;
        let mut updates = Vec::with_capacity(count);
        for _ in 0..count {
            let i = self.cursor % plain;
            self.cursor += 1;
            let svc = &mut b.workload.services[i];
            let j = tick as usize % svc.slices[0].endpoints.len();
            let fresh = b.workload.fresh_endpoint(i + j);
            let svc = &mut b.workload.services[i];
            svc.slices[0].endpoints[j] = fresh;
            updates.push((svc.name.clone(), svc.slices[0].clone()));
        }
        if updates.is_empty() {
            return Ok(Vec::new());
        }
        // Bounded: a write the API server never answers must not stall the loop.
        tokio::time::timeout(WRITE_TIMEOUT, b.writer.update_slices(&updates))
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {WRITE_TIMEOUT:?}")))
    }
}

/// The churn loop, also used by the watch comparison: returns the last write's time, the number
/// of writes and notes about writes that failed or fell behind. Bounded by `seconds` ticks.
pub async fn churn_for(
    b: &mut Bench,
    seconds: u64,
    mut run: Option<&mut super::PhaseRun>,
) -> (SystemTime, usize, Vec<String>) {
    let mut churner = Churner::new(b);
    let mut last = SystemTime::now();
    let mut changes = 0;
    let mut failed = 0;
    let mut late = 0;
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    for tick in 0..seconds {
        interval.tick().await;
        let tick_start = std::time::Instant::now();
        match churner.tick(b, tick).await {
            Ok(times) => {
                changes += times.len();
                if let Some(t) = times.into_iter().max() {
                    last = last.max(t);
                }
            }
            Err(e) => {
                failed += 1;
                if failed == 1 {
                    println!("[bench]   churn write failed: {e:#}");
                }
            }
        }
        if tick_start.elapsed() > Duration::from_secs(1) {
            late += 1;
        }
        if let Some(run) = run.as_deref_mut() {
            b.drain(run);
        }
    }
    let mut notes = Vec::new();
    if failed > 0 {
        notes.push(format!("{failed} churn ticks had failed writes"));
    }
    if late > 0 {
        notes.push(format!(
            "{late} of {seconds} churn ticks took longer than a second to write (the API server \
             fell behind; the achieved rate is {changes} writes)"
        ));
    }
    (last, changes, notes)
}
