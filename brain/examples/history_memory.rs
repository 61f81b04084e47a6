//! What the brain's history of recent publications costs in memory (`brain/src/history.rs`):
//! S Services x E endpoints over N nodes (every node's overlay built), then single-Service
//! endpoint changes published one after another, as the brain publishes them, each recorded in
//! the history. Live heap is counted by the allocator. Then the history is made to hold the
//! newest publication only, which frees what the older versions alone held; and a rebuild (a
//! relist) is recorded, after which the history keeps one state from before it.
//!
//! `cargo run --release -p splitproxy-brain --example history_memory -- [S] [E] [N] [changes]`
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

mod workload;

use splitproxy_brain::desired::SharedRuleset;
use splitproxy_brain::history::{HISTORY_VERSIONS, History};
use splitproxy_brain::metrics::Metrics;
use splitproxy_brain::objects::{self, ObjectKey};
use splitproxy_brain::overlay::Overlays;
use splitproxy_brain::rules::RulesConfig;

/// Counts live heap bytes, which RSS blurs with the allocator's retained pages.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { std::alloc::System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn mib() -> f64 {
    LIVE.load(Ordering::Relaxed) as f64 / (1 << 20) as f64
}

fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let s = args.first().copied().unwrap_or(10_000);
    let e = args.get(1).copied().unwrap_or(10);
    let nodes = args.get(2).copied().unwrap_or(5_000);
    let changes = args.get(3).copied().unwrap_or(HISTORY_VERSIONS as u32 - 1);
    let metrics = Metrics::default();
    let mut index = workload::index(s, e, nodes, &metrics);
    let config = RulesConfig::default();
    let mut d = SharedRuleset::new(config.clone());
    let mut overlays = Overlays::new(config.clone());
    let t = Instant::now();
    d.rebuild(&index);
    overlays.rebuild(&index, &mut d);
    d.prune();
    let mut published = imbl::HashMap::new();
    let history = History::default();
    let mut version = 1;
    history.record(workload::publication(
        version,
        &d,
        &mut overlays,
        &mut published,
    ));
    let state = mib();
    println!(
        "{s} Services x {e} endpoints, {nodes} nodes: built in {:?}, {} shared elements; live heap {state:.1} MiB (index, state, one publication)",
        t.elapsed(),
        d.model().element_count(),
    );

    for k in 0..changes {
        let i = (k * 97) % s;
        let sl = workload::slice(i, e, 1000 + k, nodes);
        index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
        let key = [ObjectKey::new("bench", format!("s{i}"))];
        d.update(&index, key.iter());
        overlays.update(&index, &mut d, key.iter(), std::iter::empty());
        d.prune();
        version += 1;
        history.record(workload::publication(
            version,
            &d,
            &mut overlays,
            &mut published,
        ));
    }
    let full = mib();
    println!(
        "history of {} versions (after {changes} one-Service endpoint changes): live heap {full:.1} MiB",
        history.versions().len()
    );

    // Only the newest, many times over: what the older versions alone held is freed.
    let newest = workload::publication(version, &d, &mut overlays, &mut published);
    for _ in 0..HISTORY_VERSIONS {
        history.record(newest.clone());
    }
    let one = mib();
    println!(
        "history of the newest version only: live heap {one:.1} MiB; the {changes} older versions held {:.2} MiB ({:.1} KiB each)",
        full - one,
        (full - one) * 1024.0 / changes.max(1) as f64
    );

    // A rebuild (a relist with a change): everything built anew, nothing shared.
    let sl = workload::slice(0, e, 9999, nodes);
    index.apply_slice(ObjectKey::of(&sl), objects::slice(&sl, &metrics));
    d.rebuild(&index);
    overlays.rebuild(&index, &mut d);
    d.prune();
    version += 1;
    history.record(workload::publication(
        version,
        &d,
        &mut overlays,
        &mut published,
    ));
    drop(newest);
    println!(
        "after a rebuild: history {:?}, live heap {:.1} MiB (the state from before the rebuild is kept: {:.1} MiB)",
        history.versions(),
        mib(),
        mib() - one
    );
}
