//! How long an apply took, and how much of that its thread was on a CPU.
//!
//! The kernel runs an nf_tables commit in the sending thread (the batch is processed inside
//! `sendmsg`), so the thread's CPU time over the commit is the commit's own cost: encoding
//! the acks, validating the ruleset, building the new generation. What the wall time adds
//! is the thread waiting: for a CPU on a busy node, or asleep in the kernel. An apply that
//! took 3 ms on the wall and 0.2 ms on a CPU is a busy node, not a costly transaction, and
//! the two are exported side by side (metrics.rs) so that an operator, or the benchmark,
//! can tell which.
use std::time::{Duration, Instant};

use nix::time::{ClockId, clock_gettime};

/// A wall clock and the calling thread's CPU clock, started together.
pub struct Stopwatch {
    wall: Instant,
    cpu: Option<Duration>,
}

/// What a [`Stopwatch`] measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Took {
    pub wall: Duration,
    /// Time the thread ran on a CPU, at most `wall`; `None` when the kernel has no
    /// per-thread CPU clock (never on Linux).
    pub on_cpu: Option<Duration>,
}

impl Stopwatch {
    pub fn start() -> Stopwatch {
        Stopwatch {
            cpu: thread_cpu(),
            wall: Instant::now(),
        }
    }

    /// Reads both clocks. Must run on the thread that started the stopwatch: the CPU clock
    /// is per thread (the apply is synchronous, so it does).
    pub fn stop(&self) -> Took {
        let wall = self.wall.elapsed();
        let on_cpu = match (self.cpu, thread_cpu()) {
            // The two clocks tick apart; CPU time beyond the wall is rounding.
            (Some(a), Some(b)) => Some(b.saturating_sub(a).min(wall)),
            _ => None,
        };
        Took { wall, on_cpu }
    }
}

fn thread_cpu() -> Option<Duration> {
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID)
        .ok()
        .map(Duration::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sleeping_thread_is_off_cpu() {
        let sw = Stopwatch::start();
        std::thread::sleep(Duration::from_millis(30));
        let took = sw.stop();
        assert!(took.wall >= Duration::from_millis(30), "{took:?}");
        let on_cpu = took.on_cpu.expect("Linux has a thread CPU clock");
        assert!(on_cpu < Duration::from_millis(10), "{took:?}");
    }

    #[test]
    fn a_spinning_thread_is_on_cpu() {
        let sw = Stopwatch::start();
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let took = sw.stop();
        let on_cpu = took.on_cpu.expect("Linux has a thread CPU clock");
        assert!(on_cpu <= took.wall, "{took:?}");
        // Other threads of the test binary may take the CPU for a while; most of 30 ms of
        // spinning still runs.
        assert!(on_cpu >= Duration::from_millis(5), "{took:?}");
    }
}
