//! What the brain's recompute costs, alone on the machine: the full recompute a brain makes at
//! start-up and after a relist, then publications of B changed Services each (every one a new
//! set of endpoints), as the churn phase of the end-to-end benchmark makes them. Each step is
//! timed as `Indexer::publish` times it (the shared ruleset, then the node overlays, then the
//! publication's models), so the figures compare with the brain's
//! `splitproxy_brain_compute_seconds`, without the CPU the bench's other processes take.
//!
//! `cargo run --release -p splitproxy-brain --example recompute -- [S] [E] [N] [B] [rounds]`
//! (defaults: 10,000 Services x 10 endpoints, 5,000 nodes, 100 Services, 30 rounds)
mod workload;

use std::time::{Duration, Instant};

use splitproxy_brain::desired::SharedRuleset;
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, ObjectKey};
use splitproxy_brain::overlay::Overlays;
use splitproxy_brain::rules::RulesConfig;

fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let s = args.first().copied().unwrap_or(10_000);
    let e = args.get(1).copied().unwrap_or(10);
    let nodes = args.get(2).copied().unwrap_or(5_000);
    let batch = args.get(3).copied().unwrap_or(100).clamp(1, s.max(1));
    let rounds = args.get(4).copied().unwrap_or(30).max(1);
    let metrics = Metrics::default();
    let mut index = workload::index(s, e, nodes, &metrics);
    let config = RulesConfig::default();
    let mut shared = SharedRuleset::new(config.clone());
    let mut overlays = Overlays::new(config);
    let mut published = imbl::HashMap::new();

    let t = Instant::now();
    shared.rebuild(&index);
    overlays.rebuild(&index, &mut shared);
    shared.prune();
    let _ = workload::publication(1, &shared, &mut overlays, &mut published);
    println!(
        "{s} Services x {e} endpoints, {nodes} nodes: full recompute {:.1} ms",
        ms(t.elapsed())
    );

    let mut times = Vec::with_capacity(rounds as usize);
    for round in 0..rounds {
        // The Services of a round are spread over the index, as the bench's churn picks them.
        let keys: Vec<ObjectKey> = (0..batch)
            .map(|b| {
                let i = ((round * batch + b) * 97) % s;
                let sl = workload::slice(i, e, 1 + round, nodes);
                index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
                ObjectKey::new("bench", format!("s{i}"))
            })
            .collect();
        let t = Instant::now();
        shared.update(&index, keys.iter());
        overlays.update(&index, &mut shared, keys.iter(), std::iter::empty());
        shared.prune();
        let _ = workload::publication(2 + round as u64, &shared, &mut overlays, &mut published);
        times.push(t.elapsed());
    }
    times.sort();
    let mean = times.iter().sum::<Duration>() / rounds;
    println!(
        "{rounds} publications of {batch} changed Services: mean {:.2} ms, p50 {:.2} ms, max {:.2} ms",
        ms(mean),
        ms(times[times.len() / 2]),
        ms(times[times.len() - 1])
    );
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
