//! Targets under this machine's floor: what the same run measured beneath splitproxy (the
//! fan-out floors of src/floor.rs, the API server's own latency) already takes more than the
//! target allows.
//!
//! A target under such a floor is missed whatever splitproxy does on this machine, and a
//! report that only says "missed" leaves the reader to find that out. So each one says so
//! beside the miss, from the figures of its own run: the machine's speed moves from hour to
//! hour, and a fixed claim would be true of one run and false of the next.
use crate::floor::Floor;
use crate::results::BenchResult;

use super::format::ms;
use super::{before_brain_mean, phase};

/// The floor of gRPC's transport in `r` (TLS, tokio and HTTP/2), the cheaper of the two ways it
/// was measured: `h2` driven by one task, and hyper's server as the brain's streams are.
fn grpc_floor(r: &BenchResult) -> Option<&Floor> {
    [&r.floor_h2, &r.floor_hyper]
        .into_iter()
        .flatten()
        .min_by(|a, b| a.round_mean_seconds.total_cmp(&b.round_mean_seconds))
}

/// A single change reaching every node within `target` seconds: under the floor when one round
/// of the gRPC floor (an update to every node and its ack back, nothing else running) takes
/// longer on average. The 99th percentile of 5,000 nodes is among the last fifty, so it waits
/// for nearly the whole round.
pub(super) fn single_change(r: &BenchResult, target: f64) -> Option<String> {
    let f = grpc_floor(r)?;
    (f.round_mean_seconds > target).then(|| {
        let without = r
            .floor_tokio
            .as_ref()
            .map(|t| {
                format!(
                    " Without HTTP/2 (TLS on tokio) the round took {}.",
                    ms(Some(t.round_mean_seconds))
                )
            })
            .unwrap_or_default();
        format!(
            "Under this machine's floor: one round of the fan-out floor over gRPC's transport ({}), \
             an update to each of its {} nodes and the ack back with nothing else running, took {} on \
             average in this run (worst {}), more than the target by itself.{without}",
            f.label(),
            f.nodes,
            ms(Some(f.round_mean_seconds)),
            ms(Some(f.round_max_seconds)),
        )
    })
}

/// Churn's changes reaching every node within `target` seconds: under the floor when the time
/// before the brain (the API server's write and watch, from each change's trigger time to the
/// brain's watch event) is longer than the target on average in the churn phase.
pub(super) fn churn(r: &BenchResult, target: f64) -> Option<String> {
    let p = phase(r, "churn")?;
    let (before, changes) = before_brain_mean(
        p.splitproxy.publish_latency.as_ref(),
        p.splitproxy.change_queue.as_ref(),
    )?;
    (before > target).then(|| {
        format!(
            "Under this machine's floor: before the brain (the API server's write and watch, from \
             the trigger time to the brain's watch event) a change took {} on average over the \
             phase's {changes} changes, more than the target by itself.",
            ms(Some(before))
        )
    })
}

/// Brain CPU per node-update within `target` seconds: under the floor when the TLS floor's
/// sending side (rustls in one epoll loop a side, no runtime, no HTTP/2) costs more per update.
pub(super) fn cpu_per_update(r: &BenchResult, target: f64) -> Option<String> {
    let f = r.floor_tls.as_ref()?;
    (f.brain_cpu_per_update > target).then(|| {
        format!(
            "Under this machine's floor: the sending side of the fan-out floor over TLS (rustls in \
             one epoll loop a side, no runtime, no HTTP/2) took {:.1} µs per update in this run, \
             more than the target by itself.",
            f.brain_cpu_per_update * 1e6
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::floor::Stack;
    use crate::report::format::summary;
    use crate::results::Phase;

    fn floor(stack: Stack, round: f64, per_update: f64) -> Floor {
        Floor {
            tls: true,
            stack,
            nodes: 5000,
            rounds: 100,
            update_bytes: 3480,
            ack_bytes: 48,
            brain_cpu_per_update: per_update,
            node_cpu_per_update: per_update,
            round_mean_seconds: round,
            round_max_seconds: round * 1.5,
        }
    }

    #[test]
    fn a_single_change_is_under_the_floor_only_when_the_cheaper_grpc_round_is_longer() {
        let mut r = BenchResult {
            floor_h2: Some(floor(Stack::H2, 0.2025, 38.6e-6)),
            floor_hyper: Some(floor(Stack::Hyper, 0.2115, 38.3e-6)),
            floor_tokio: Some(floor(Stack::Tokio, 0.1224, 22.7e-6)),
            ..BenchResult::default()
        };
        let said = single_change(&r, 0.150).expect("a 202 ms round is over 150 ms");
        assert!(said.contains("took 202 ms on average"), "{said}");
        assert!(said.contains("worst 304 ms"), "{said}");
        assert!(said.contains("its 5000 nodes"), "{said}");
        assert!(
            said.contains("(TLS on tokio) the round took 122 ms"),
            "{said}"
        );
        assert_eq!(single_change(&r, 0.250), None, "a target above the round");
        r.floor_h2 = Some(floor(Stack::H2, 0.140, 38.6e-6));
        assert_eq!(
            single_change(&r, 0.150),
            None,
            "the cheaper of the two gRPC floors is the bound"
        );
        r.floor_h2 = None;
        r.floor_hyper = None;
        assert_eq!(single_change(&r, 0.150), None, "no gRPC floor measured");
    }

    #[test]
    fn churn_is_under_the_floor_when_the_api_server_alone_takes_longer_on_average() {
        let churn_phase = |publish: f64, queue: f64| {
            let mut p = Phase {
                name: "churn".into(),
                ..Phase::default()
            };
            p.splitproxy.publish_latency = Some(summary(6000.0, publish));
            p.splitproxy.change_queue = Some(summary(6000.0, queue));
            p
        };
        let mut r = BenchResult {
            phases: vec![churn_phase(0.590, 0.241)],
            ..BenchResult::default()
        };
        let said = churn(&r, 0.300).expect("349 ms before the brain is over 300 ms");
        assert!(said.contains("took 349 ms on average"), "{said}");
        assert!(said.contains("6000 changes"), "{said}");
        r.phases = vec![churn_phase(0.400, 0.200)];
        assert_eq!(
            churn(&r, 0.300),
            None,
            "200 ms before the brain is under 300 ms"
        );
        r.phases.clear();
        assert_eq!(churn(&r, 0.300), None, "no churn phase");
    }

    #[test]
    fn cpu_per_update_is_under_the_floor_when_tls_alone_costs_more() {
        let mut r = BenchResult {
            floor_tls: Some(floor(Stack::Epoll, 0.0775, 14.4e-6)),
            ..BenchResult::default()
        };
        let said = cpu_per_update(&r, 10e-6).expect("14.4 us is over 10 us");
        assert!(said.contains("took 14.4 µs per update"), "{said}");
        assert_eq!(cpu_per_update(&r, 20e-6), None);
        r.floor_tls = None;
        assert_eq!(cpu_per_update(&r, 10e-6), None, "no TLS floor measured");
    }
}
