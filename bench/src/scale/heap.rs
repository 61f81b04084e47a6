//! Live heap bytes and the process's resident memory, for the scale mode's memory figures.
//!
//! RSS blurs what the brain holds with the pages the allocator keeps after frees, so the scale
//! mode also reports live heap bytes. They are counted by the allocator the `splitproxy-bench`
//! binary installs (src/main.rs), which calls [`allocated`] and [`freed`]; counting is off until
//! [`start_counting`], so that the brain, actuators and virtual fleet the end-to-end mode runs
//! from the same binary pay one relaxed load per allocation, not a contended atomic add.
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

static COUNTING: AtomicBool = AtomicBool::new(false);
/// Signed: blocks allocated before counting started may be freed after.
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// Counts allocations from now on.
pub fn start_counting() {
    COUNTING.store(true, Ordering::Relaxed);
}

/// Whether live heap bytes are being counted (only in the bench binary, after
/// [`start_counting`]).
pub fn counting() -> bool {
    COUNTING.load(Ordering::Relaxed)
}

/// The allocator allocated `bytes`.
#[inline]
pub fn allocated(bytes: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_add(bytes as isize, Ordering::Relaxed);
    }
}

/// The allocator freed `bytes`.
#[inline]
pub fn freed(bytes: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_sub(bytes as isize, Ordering::Relaxed);
    }
}

/// Live heap, MiB (allocated and not freed since counting started).
pub fn live_mib() -> f64 {
    LIVE.load(Ordering::Relaxed).max(0) as f64 / (1 << 20) as f64
}

/// "heap X MiB, RSS Y kB, peak Z kB": the live heap and /proc/self/status's VmRSS and VmHWM.
pub fn memory() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let get = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or("?")
            .to_string()
    };
    format!(
        "heap {:.1} MiB, RSS {} kB, peak {} kB",
        live_mib(),
        get("VmRSS:"),
        get("VmHWM:")
    )
}
