//! Why a target was missed, said from the figures that compose it (the report's notes under
//! its targets table).
use crate::results::{BenchResult, Phase};

use super::format::{before_brain_cell, dist_cell, ms, num};
use super::{phase, role_cpu};

/// Why a target was missed, from the figures that compose it.
pub(super) fn why(r: &BenchResult, figure: &str) -> String {
    let churn = phase(r, "churn");
    if figure.starts_with("network programming latency") {
        let (compute, fanout, apply) = churn
            .map(|p| {
                (
                    p.splitproxy.compute.as_ref().and_then(|h| h.p99),
                    p.splitproxy.fanout.as_ref().and_then(|h| h.p99),
                    p.splitproxy.virtual_apply.p99,
                )
            })
            .unwrap_or_default();
        let cores = |p: &Phase, role: &str| role_cpu(p, role) / p.seconds.max(1e-9);
        let brain_cpu = churn.map(|p| cores(p, "brain"));
        let bench_cpu = churn
            .filter(|p| p.processes.iter().any(|(k, _)| k.starts_with("bench")))
            .map(|p| cores(p, "bench"));
        let before = churn
            .map(|p| {
                before_brain_cell(
                    p.splitproxy.publish_latency.as_ref(),
                    p.splitproxy.change_queue.as_ref(),
                )
            })
            .unwrap_or_else(|| "n/a".into());
        return format!(
            "In the churn phase a change reached the brain's watch {} after its trigger time, on average (the API server's write and watch); \
             the brain's compute p99 was {}, fan-out (publication to last ack) p99 {}, a virtual node's decode+apply p99 {}; \
             the brain used {} cores and the bench process (virtual fleet, writer) {} cores of {}: the latency is mostly queueing for CPU \
             when both share the machine.",
            before,
            ms(compute),
            ms(fanout),
            ms(apply),
            num(brain_cpu),
            num(bench_cpu),
            r.machine.nproc
        );
    }
    if figure == "one endpoint change, kernel apply"
        && let Some(s) = r
            .single_changes
            .as_ref()
            .filter(|s| s.real_apply_on_cpu.n > 0)
    {
        let (wall, cpu) = (&s.real_apply, &s.real_apply_on_cpu);
        return format!(
            "On a CPU the applying thread took p50 {} p99 {} (max {}) of the sync's p50 {} p99 {} (max {}): {}",
            ms(cpu.p50),
            ms(cpu.p99),
            ms(cpu.max),
            ms(wall.p50),
            ms(wall.p99),
            ms(wall.max),
            if cpu.p99.is_some_and(|c| c <= 0.002) {
                "the transaction itself fits the target, and the rest is the thread waiting, for a CPU the \
                 brain and the virtual fleet share with it on this machine (or asleep in the kernel)."
            } else {
                "the transaction itself costs that much; every commit walks the table's chains and validates \
                 new jumps (see docs/ruleset.md), so its floor follows the ruleset's shape."
            }
        );
    }
    if figure.contains("kernel apply") || figure.contains("cold start") {
        return "The actuator's apply is one nf_tables transaction; every commit walks the table's chains and validates \
                new jumps (see docs/ruleset.md), so its floor follows the ruleset's shape."
            .into();
    }
    if figure.starts_with("brain CPU per node-update") {
        if let Some(p) = churn {
            let cpu = role_cpu(p, "brain");
            return format!(
                "In the churn phase the brain replicas used {cpu:.2} CPU seconds for {} updates sent \
                 ({} publications).",
                num(p.splitproxy.updates_sent),
                num(p.splitproxy.publications)
            );
        }
        return String::new();
    }
    if figure.starts_with("brain replica killed") {
        if let Some(f) = &r.failover {
            return format!(
                "Per moved node: {}; nodes spread their reconnects over up to a second after a \
                 healthy stream breaks (the actuator's pacing, which the virtual nodes mirror). \
                 Every moved node had resumed on a survivor (connected, one of its updates acked) \
                 after {} (per node {}); in sync means holding the newest publication, which \
                 under churn waits for the fan-out of the last write, {} after the kill. \
                 {} snapshots received, {} sent by the survivors.",
                dist_cell(&f.back_in_sync),
                ms(f.resumed_seconds),
                dist_cell(&f.resumed),
                ms(f.last_write_after_kill_seconds),
                f.snapshots_received as f64 + f.real_snapshots_applied,
                num(f.snapshots_sent)
            );
        }
        return String::new();
    }
    if figure.starts_with("brain restarted") {
        if let Some(x) = &r.restart {
            return format!(
                "Sessions by resumption: {:?}; {} of {} replicas needed SIGKILL to stop.",
                x.resumptions, x.killed_after_grace, x.replicas
            );
        }
        return String::new();
    }
    if figure.contains("memory") {
        return "Peak RSS includes the decoded updates held during apply and the allocator's retained pages.".into();
    }
    String::new()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::measure::stats::Stats;
    use crate::results::SingleChanges;

    fn stats(p50: f64, p99: f64) -> Stats {
        Stats {
            n: 60,
            p50: Some(p50),
            p99: Some(p99),
            max: Some(p99),
            ..Stats::default()
        }
    }

    #[test]
    fn a_slow_apply_says_whether_the_transaction_or_the_wait_took_the_time() {
        let mut r = BenchResult {
            single_changes: Some(SingleChanges {
                real_apply: stats(0.00015, 0.0024),
                real_apply_on_cpu: stats(0.0001, 0.0003),
                ..SingleChanges::default()
            }),
            ..BenchResult::default()
        };
        let figure = "one endpoint change, kernel apply";
        let waited = why(&r, figure);
        assert!(waited.contains("p99 0.30 ms"), "{waited}");
        assert!(
            waited.contains("the rest is the thread waiting"),
            "{waited}"
        );
        r.single_changes.as_mut().unwrap().real_apply_on_cpu = stats(0.0001, 0.0023);
        let costly = why(&r, figure);
        assert!(costly.contains("the transaction itself costs"), "{costly}");
        // Results from before the CPU time was measured keep the old explanation.
        r.single_changes.as_mut().unwrap().real_apply_on_cpu = Stats::default();
        assert!(why(&r, figure).contains("every commit walks"));
    }
}
