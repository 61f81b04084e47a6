//! The measured phases: cold start ([`cold`]) and the change phases ([`changes`]), on a shared
//! frame ([`PhaseRun`]) that scrapes every component before and after, follows the virtual
//! fleet's samples, waits (bounded) until the change reached every node, and turns the
//! differences into a [`Phase`].
pub mod changes;
pub mod cold;
pub mod failover;
pub mod restart;
pub mod single;
pub mod watches;

use std::time::{Duration, Instant, SystemTime};

use crate::cli::BenchArgs;
use crate::fleet::NplCollector;
use crate::kubeproxy::KpScrape;
use crate::measure::procstat::{Mark, Watched};
use crate::measure::prom::{Histogram, Scrape};
use crate::measure::stats::LatencyHist;
use crate::results::{KubeProxyPhase, Phase, SplitproxyPhase};
use crate::rig::{Rig, all_in_sync};
use crate::workload::{Workload, Writer};

pub const FANOUT: &str = "splitproxy_brain_fanout_duration_seconds";
pub const PUBLISH_LATENCY: &str = "splitproxy_brain_publish_latency_seconds";
pub const CHANGE_QUEUE: &str = "splitproxy_brain_change_queue_seconds";
pub const COMPUTE: &str = "splitproxy_brain_compute_duration_seconds";
pub const PUBLICATIONS: &str = "splitproxy_brain_publications_total";
pub const BYTES_SENT: &str = "splitproxy_brain_update_bytes_sent_total";
/// Distinct update parts the brain compressed (once each for every node that reads zstd).
pub const COMPRESSED_PARTS: &str = "splitproxy_brain_compressed_parts_total";
pub const COMPRESS_SECONDS: &str = "splitproxy_brain_compress_seconds_total";
pub const UPDATES_SENT: &str = "splitproxy_brain_updates_sent_total";
pub const SYNC: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
pub const NPL: &str = "kubeproxy_network_programming_duration_seconds";
pub const LAST_SYNC: &str = "kubeproxy_sync_proxy_rules_last_timestamp_seconds";
/// Of the sync time, what the actuator's applying thread ran on a CPU.
pub const SYNC_ON_CPU: &str = "splitproxy_actuator_sync_on_cpu_seconds_total";

/// Everything a phase works on.
pub struct Bench {
    pub args: BenchArgs,
    pub rig: Rig,
    pub writer: Writer,
    pub workload: Workload,
    pub watched: Watched,
    pub notes: Vec<String>,
    /// splitproxy's network-programming latencies over every change phase.
    pub npl_all: LatencyHist,
}

/// Readings at the start of a phase, and what was collected since.
pub struct PhaseRun {
    pub name: &'static str,
    started: Instant,
    /// Every replica's scrape at the start.
    brains: Vec<Option<Scrape>>,
    real: Vec<Option<Scrape>>,
    kp: Option<KpScrape>,
    /// Each replica's desired version when the phase (or its last step) began.
    versions: Vec<u64>,
    mark: Mark,
    pub collector: NplCollector,
    pub changes: usize,
    pub notes: Vec<String>,
    /// Convergence time of each step, from its last write.
    converged: Vec<Option<Duration>>,
    /// Exact network-programming latencies of real actuators measured by the phase itself
    /// (single changes: sync timestamp - trigger time, one per node and change).
    pub real_exact: Vec<f64>,
}

pub(crate) fn unix(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl PhaseRun {
    /// Real actuator `i`'s scrape at the start of the phase.
    pub fn real_scrape(&self, i: usize) -> Option<&Scrape> {
        self.real.get(i).and_then(Option::as_ref)
    }

    /// Every replica's scrape at the start of the phase.
    pub fn brain_scrapes(&self) -> &[Option<Scrape>] {
        &self.brains
    }

    /// How long the last step took to converge, when it did.
    pub fn last_converged(&self) -> Option<Duration> {
        self.converged.last().copied().flatten()
    }
}

impl Bench {
    /// Scrapes every component and starts following the fleet.
    pub async fn begin(&mut self, name: &'static str) -> PhaseRun {
        println!("[bench] phase {name}");
        // Samples of earlier phases are not this phase's.
        let since = SystemTime::now();
        if let Some(f) = &self.rig.fleet {
            let mut discard = NplCollector::new(since);
            f.drain(&mut discard);
        }
        let brains = self.rig.brain_scrapes();
        let real = (0..self.rig.real)
            .map(|i| self.rig.actuator_scrape(i).ok())
            .collect();
        let kp = self.kube_proxy_scrape();
        let versions = self.rig.view().await.versions();
        PhaseRun {
            name,
            started: Instant::now(),
            brains,
            real,
            kp,
            versions,
            mark: self.watched.mark(),
            collector: NplCollector::new(since),
            changes: 0,
            notes: Vec::new(),
            converged: Vec::new(),
            real_exact: Vec::new(),
        }
    }

    pub fn kube_proxy_scrape(&self) -> Option<KpScrape> {
        let kp = self.rig.kube_proxy.as_ref()?;
        let ns = self.rig.kube_proxy_node().netns();
        kp.scrape(ns).ok().map(|s| KpScrape::from(&s))
    }

    /// Drains the fleet's samples into the phase.
    pub fn drain(&self, run: &mut PhaseRun) {
        if let Some(f) = &self.rig.fleet {
            f.drain(&mut run.collector);
        }
    }

    /// Waits (bounded by the phase time-out) until every splitproxy node holds the state that
    /// includes the write made at `last_write`: every virtual node has applied a change
    /// triggered at or after it, and the replicas list every node in sync at a newer version
    /// than the step began with. Records the time from `last_write` to then.
    pub async fn wait_splitproxy(&self, run: &mut PhaseRun, last_write: SystemTime) -> bool {
        self.wait_splitproxy_within(run, last_write, self.args.phase_timeout())
            .await
    }

    /// [`Bench::wait_splitproxy`] bounded by `limit`.
    pub async fn wait_splitproxy_within(
        &self,
        run: &mut PhaseRun,
        last_write: SystemTime,
        limit: Duration,
    ) -> bool {
        let wrote = Instant::now()
            .checked_sub(
                SystemTime::now()
                    .duration_since(last_write)
                    .unwrap_or_default(),
            )
            .unwrap_or_else(Instant::now);
        let deadline = Instant::now() + limit;
        let expected = self.rig.splitproxy_nodes();
        let virtual_nodes = self.rig.fleet.as_ref().map_or(0, |f| f.size);
        let mut stable_since: Option<(Vec<u64>, Instant)> = None;
        while Instant::now() < deadline {
            self.drain(run);
            let fleet_done = run.collector.nodes_at(last_write) >= virtual_nodes;
            let fleet_applied = self.rig.fleet.as_ref().is_none_or(|f| f.all_applied());
            let view = self.rig.view().await;
            if view.synced() {
                let versions = view.versions();
                let listed = view.newer_than(&run.versions) && all_in_sync(&view, expected);
                // Fallback when a node's samples lack the last trigger time (a coalesced
                // update past the brain's change log): the same state everywhere for 1 s.
                let steady = match &stable_since {
                    Some((v, t)) if *v == versions => t.elapsed() > Duration::from_secs(1),
                    _ => {
                        stable_since = Some((versions.clone(), Instant::now()));
                        false
                    }
                };
                if listed && (fleet_done || (fleet_applied && steady)) {
                    run.versions = versions;
                    run.converged.push(Some(wrote.elapsed()));
                    self.drain(run);
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        run.notes.push(format!(
            "splitproxy did not converge within {:?} (virtual nodes at the last change: {}/{})",
            self.args.phase_timeout(),
            run.collector.nodes_at(last_write),
            virtual_nodes
        ));
        run.converged.push(None);
        false
    }

    /// Waits for kube-proxy (bounded) and assembles the phase's figures.
    ///
    /// `kp_expected` is the number of trigger-time-carrying slice writes kube-proxy should count
    /// in its network-programming histogram; `single` is the trigger time of a phase made of one
    /// change, for exact latencies.
    pub async fn finish(
        &mut self,
        mut run: PhaseRun,
        description: &str,
        last_write: SystemTime,
        kp_expected: usize,
        single: Option<SystemTime>,
    ) -> Phase {
        let kube_proxy = self
            .wait_kube_proxy(&run, last_write, kp_expected, single)
            .await;
        self.drain(&mut run);
        let mut sp = SplitproxyPhase::default();
        // The brain replicas, summed.
        let after = self.rig.brain_scrapes();
        if after.iter().any(Option::is_some) {
            let delta = BrainDelta {
                before: &run.brains,
                after: &after,
            };
            let hist = |name: &str| delta.histogram(name);
            let counter = |name: &str| delta.counter(name);
            let fanout = hist(FANOUT);
            // One fan-out observation per publication stands in for a publication counter.
            sp.publications = counter(PUBLICATIONS).or(fanout.as_ref().map(|h| h.count));
            sp.fanout = fanout.as_ref().map(Histogram::summary);
            sp.fanout_histogram = fanout;
            sp.compute = hist(COMPUTE).map(|h| h.summary());
            sp.publish_latency = hist(PUBLISH_LATENCY).map(|h| h.summary());
            sp.change_queue = hist(CHANGE_QUEUE).map(|h| h.summary());
            sp.updates_sent = counter(UPDATES_SENT);
            sp.bytes_sent = counter(BYTES_SENT);
            sp.bytes_per_publication = match (sp.bytes_sent, sp.publications) {
                (Some(b), Some(p)) if p > 0.0 => Some(b / p),
                _ => None,
            };
        }
        // Real actuators.
        let mut all = run.collector.npl.clone();
        for v in &run.real_exact {
            all.record(*v);
        }
        let mut real_with_samples = 0;
        for i in 0..self.rig.real {
            let node = self.rig.cluster.node(i).name().to_string();
            let Ok(after) = self.rig.actuator_scrape(i) else {
                run.notes
                    .push(format!("no metrics from the actuator of {node}"));
                continue;
            };
            let before = run.real.get(i).and_then(Option::as_ref);
            let delta = |name: &str| {
                after
                    .histogram(name)
                    .map(|h| h.since(before.and_then(|b| b.histogram(name)).as_ref()))
            };
            if let Some(h) = delta(SYNC) {
                if let Some(on_cpu) = after.increase_since(SYNC_ON_CPU, before)
                    && h.count > 0.0
                {
                    sp.real_apply_on_cpu_mean
                        .insert(node.clone(), on_cpu / h.count);
                }
                sp.real_apply.insert(node.clone(), h.summary());
            }
            let npl = delta(NPL);
            if npl.as_ref().is_some_and(|h| h.count > 0.0) {
                real_with_samples += 1;
            }
            if let Some(h) = npl {
                sp.npl_real.insert(node.clone(), h.summary());
            }
            if let (Some(t), Some(last)) = (single, after.max(LAST_SYNC)) {
                let exact = last - unix(t);
                sp.npl_real_exact.insert(node.clone(), exact);
                all.record(exact);
            }
        }
        sp.npl_virtual = run.collector.npl.summary();
        sp.npl_virtual_cdf = run.collector.npl.cdf();
        sp.npl = all.summary();
        self.npl_all.merge(&all);
        sp.virtual_apply = run.collector.apply_seconds.summary();
        if !run.real_exact.is_empty() {
            let mut real = crate::measure::stats::LatencyHist::default();
            for v in &run.real_exact {
                real.record(*v);
            }
            sp.npl_real_samples = real.summary();
        }
        sp.nodes_with_samples =
            run.collector.per_node.values().filter(|c| **c > 0).count() + real_with_samples;
        sp.nodes_total = self.rig.splitproxy_nodes();

        let converged_seconds = if run.converged.iter().all(Option::is_some) {
            run.converged
                .iter()
                .flatten()
                .map(Duration::as_secs_f64)
                .reduce(f64::max)
        } else {
            None
        };
        let phase = Phase {
            name: run.name.to_string(),
            description: description.to_string(),
            changes: run.changes,
            seconds: run.started.elapsed().as_secs_f64(),
            converged_seconds,
            splitproxy: sp,
            kube_proxy,
            processes: self.watched.since(&run.mark),
            notes: run.notes,
        };
        print_phase(&phase);
        phase
    }

    async fn wait_kube_proxy(
        &self,
        run: &PhaseRun,
        last_write: SystemTime,
        expected: usize,
        single: Option<SystemTime>,
    ) -> Option<KubeProxyPhase> {
        self.rig.kube_proxy.as_ref()?;
        let before = run.kp.clone().unwrap_or_default();
        let base_npl = before.npl.as_ref().map_or(0.0, |h| h.count);
        let started = Instant::now();
        let deadline = started + self.args.phase_timeout();
        let mut out = KubeProxyPhase::default();
        let mut last = None;
        while Instant::now() < deadline {
            if let Some(now) = self.kube_proxy_scrape() {
                let counted = now.npl.as_ref().map_or(0.0, |h| h.count) - base_npl;
                let synced_after = now.last_sync.unwrap_or(0.0) >= unix(last_write);
                if let (Some(t), None, true) = (single, out.npl_exact, counted >= 1.0) {
                    out.npl_exact = now.last_sync.map(|l| l - unix(t));
                }
                let done = counted >= expected as f64 && synced_after;
                last = Some(now);
                if done {
                    out.caught_up = true;
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        out.waited_seconds = started.elapsed().as_secs_f64();
        if let Some(now) = &last
            && !out.caught_up
        {
            out.note = format!(
                "kube-proxy counted {} of {expected} expected network-programming samples; its last \
                 sync ended at {:.3}, the last write was at {:.3} (unix seconds)",
                now.npl.as_ref().map_or(0.0, |h| h.count) - base_npl,
                now.last_sync.unwrap_or(0.0),
                unix(last_write)
            );
        }
        if let Some(now) = last {
            let d = |a: &Option<Histogram>, b: &Option<Histogram>| {
                a.as_ref().map(|a| a.since(b.as_ref()))
            };
            let npl = d(&now.npl, &before.npl);
            out.npl = npl.as_ref().map(Histogram::summary);
            out.npl_histogram = npl;
            let sync = d(&now.sync, &before.sync);
            out.sync = sync.as_ref().map(Histogram::summary);
            out.sync_histogram = sync;
            out.partial_sync = d(&now.partial_sync, &before.partial_sync).map(|h| h.summary());
            out.full_sync = d(&now.full_sync, &before.full_sync).map(|h| h.summary());
        }
        Some(out)
    }
}

/// The brain replicas' metrics across a phase: each replica's difference, summed. A replica
/// that was down at either end is left out; one that restarted counts from zero (its counters
/// started again).
pub struct BrainDelta<'a> {
    pub before: &'a [Option<Scrape>],
    pub after: &'a [Option<Scrape>],
}

impl BrainDelta<'_> {
    fn pairs(&self) -> impl Iterator<Item = (Option<&Scrape>, &Scrape)> {
        self.after.iter().enumerate().filter_map(|(i, a)| {
            let a = a.as_ref()?;
            Some((self.before.get(i).and_then(Option::as_ref), a))
        })
    }

    /// The histogram `name` observed in between, over every replica.
    pub fn histogram(&self, name: &str) -> Option<Histogram> {
        let mut out: Option<Histogram> = None;
        for (b, a) in self.pairs() {
            let Some(h) = a.histogram(name) else { continue };
            let d = h.since(b.and_then(|b| b.histogram(name)).as_ref());
            match out.as_mut() {
                Some(o) => o.merge(&d),
                None => out = Some(d),
            }
        }
        out
    }

    /// The counter `name` (summed over labels) increased by, over every replica.
    pub fn counter(&self, name: &str) -> Option<f64> {
        self.counter_where(name, |_| true)
    }

    /// Like [`BrainDelta::counter`], over the series whose labels satisfy `pred`.
    pub fn counter_where(
        &self,
        name: &str,
        pred: impl Fn(&[(String, String)]) -> bool + Copy,
    ) -> Option<f64> {
        let mut out: Option<f64> = None;
        for (b, a) in self.pairs() {
            let Some(v) = a.sum_where(name, pred) else {
                continue;
            };
            let before = b.and_then(|b| b.sum_where(name, pred)).unwrap_or(0.0);
            // A counter that went down belongs to a restarted process: all of it is new.
            let d = if v >= before { v - before } else { v };
            *out.get_or_insert(0.0) += d;
        }
        out
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:.1} ms", v * 1e3))
}

/// One progress line per phase with its headline figures.
fn print_phase(p: &Phase) {
    let sp = &p.splitproxy;
    println!(
        "[bench]   {}: {} changes in {:.1} s; splitproxy NPL p50 {} p99 {} max {} over {}/{} nodes; \
         converged {}; trigger to publication p50 {} p99 {} (in the brain p50 {} p99 {}); fan-out p99 {}; kernel apply (real, mean) {}",
        p.name,
        p.changes,
        p.seconds,
        ms(sp.npl.p50),
        ms(sp.npl.p99),
        ms(sp.npl.max),
        sp.nodes_with_samples,
        sp.nodes_total,
        ms(p.converged_seconds),
        ms(sp.publish_latency.as_ref().and_then(|f| f.p50)),
        ms(sp.publish_latency.as_ref().and_then(|f| f.p99)),
        ms(sp.change_queue.as_ref().and_then(|f| f.p50)),
        ms(sp.change_queue.as_ref().and_then(|f| f.p99)),
        ms(sp.fanout.as_ref().and_then(|f| f.p99)),
        ms(mean_of(sp.real_apply.values().filter_map(|h| h.mean))),
    );
    if let Some(kp) = &p.kube_proxy {
        println!(
            "[bench]   {}: kube-proxy {} after {:.1} s; NPL p50 {} p99 {} (exact {}); sync mean {}",
            p.name,
            if kp.caught_up {
                "caught up"
            } else {
                "did NOT catch up"
            },
            kp.waited_seconds,
            ms(kp.npl.as_ref().and_then(|h| h.p50)),
            ms(kp.npl.as_ref().and_then(|h| h.p99)),
            ms(kp.npl_exact),
            ms(kp.sync.as_ref().and_then(|h| h.mean)),
        );
    }
    for n in &p.notes {
        println!("[bench]   note: {n}");
    }
}

pub fn mean_of(values: impl Iterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = values.collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT_A: &str = "# TYPE c counter\nc_total{kind=\"x\"} 5\nc_total{kind=\"y\"} 1\n";
    const TEXT_B: &str = "# TYPE c counter\nc_total{kind=\"x\"} 9\nc_total{kind=\"y\"} 1\n";
    const TEXT_RESTARTED: &str = "# TYPE c counter\nc_total{kind=\"x\"} 2\n";

    #[test]
    fn brain_deltas_sum_replicas_and_count_a_restarted_one_from_zero() {
        let before = vec![
            Some(Scrape::parse(TEXT_A)),
            Some(Scrape::parse(TEXT_A)),
            Some(Scrape::parse(TEXT_A)),
        ];
        let after = vec![
            Some(Scrape::parse(TEXT_B)),         // +4 on x
            Some(Scrape::parse(TEXT_RESTARTED)), // restarted: its 2 are new
            None,                                // down: left out
        ];
        let d = BrainDelta {
            before: &before,
            after: &after,
        };
        assert_eq!(d.counter("c_total"), Some(6.0));
        let x = |l: &[(String, String)]| l.iter().any(|(k, v)| k == "kind" && v == "x");
        assert_eq!(d.counter_where("c_total", x), Some(6.0));
        assert_eq!(d.counter("absent_total"), None);
        let all = BrainDelta {
            before: &[],
            after: &after,
        };
        assert_eq!(all.counter("c_total"), Some(12.0));
    }
}
