//! One malloc arena for the actuator.
//!
//! glibc gives threads that allocate at the same time arenas of their own (up to eight per
//! CPU) and keeps what is freed in each for reuse there. The actuator decodes updates on the
//! runtime's threads and applies them on blocking threads, so under churn every new version
//! of its model left freed pages behind in several arenas: its RSS grew from 36.7 to 44.4 MiB
//! over 60 churn seconds at 10,000 Services, past its size after the cold start, and with one
//! arena it stayed at 36.5 (`MALLOC_ARENA_MAX=1`, the quick run of `tools/bench.sh`,
//! docs/performance.md). The actuator allocates little and rarely at the same time on two
//! threads, so one arena costs it nothing measurable. An operator's `MALLOC_ARENA_MAX` is left
//! to win.
#![allow(unsafe_code)]

/// The arenas the actuator keeps when `MALLOC_ARENA_MAX` does not say otherwise.
pub const ARENAS: i32 = 1;

/// Limits glibc's malloc to [`ARENAS`] arenas, unless `MALLOC_ARENA_MAX` is set. Call it
/// first in `main`, before any other thread starts (arenas already made stay). Whether the
/// limit was set: false elsewhere than glibc, or when the environment chose.
pub fn limit_arenas() -> bool {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return false;
    }
    set_arena_max(ARENAS)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_arena_max(n: i32) -> bool {
    // SAFETY: mallopt only sets one of malloc's parameters, for arenas made from now on; it
    // takes no pointer and is safe to call at any time.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, n) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_arena_max(_n: i32) -> bool {
    false
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_the_limit() {
        assert!(super::set_arena_max(super::ARENAS));
    }
}
