//! CPU time and memory of a process from /proc, sampled around each phase.
//!
//! CPU seconds are utime + stime from /proc/PID/stat; memory is VmRSS and VmHWM (peak RSS) from
//! /proc/PID/status. Writing "5" to /proc/PID/clear_refs resets VmHWM, so the peak can be taken
//! per phase rather than since the process started.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One reading of one process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcSample {
    pub cpu_seconds: f64,
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
    pub threads: u64,
}

fn clock_ticks() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map(|t| t as f64)
        .filter(|t| *t > 0.0)
        .unwrap_or(100.0)
}

/// Reads one process; `None` when it is gone or unreadable.
pub fn sample(pid: u32) -> Option<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse(&stat, &status, clock_ticks())
}

fn parse(stat: &str, status: &str, ticks: f64) -> Option<ProcSample> {
    // The command name may contain spaces and parentheses; fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat (utime, stime) are at 11 and 12 counting from field 3 (state).
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    let kb = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Some(ProcSample {
        cpu_seconds: (utime + stime) / ticks,
        rss_bytes: kb("VmRSS:") * 1024,
        peak_rss_bytes: kb("VmHWM:") * 1024,
        threads: kb("Threads:"),
    })
}

/// Resets the peak RSS of `pid` (best effort: needs to own the process or be root).
pub fn reset_peak(pid: u32) {
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
}

/// What a process used across a phase.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcUsage {
    pub cpu_seconds: f64,
    /// RSS at the end of the phase.
    pub rss_bytes: u64,
    /// Peak RSS during the phase.
    pub peak_rss_bytes: u64,
}

/// The processes watched during a run, by role ("brain", "actuator node-0", ...).
#[derive(Debug, Clone, Default)]
pub struct Watched {
    pub pids: BTreeMap<String, u32>,
}

/// Readings of every watched process at the start of a phase.
#[derive(Debug, Clone, Default)]
pub struct Mark {
    start: BTreeMap<String, ProcSample>,
}

impl Watched {
    pub fn add(&mut self, role: &str, pid: Option<u32>) {
        if let Some(pid) = pid {
            self.pids.insert(role.to_string(), pid);
        }
    }

    pub fn remove(&mut self, role: &str) {
        self.pids.remove(role);
    }

    /// Resets peaks and takes the starting readings.
    pub fn mark(&self) -> Mark {
        let mut start = BTreeMap::new();
        for (role, pid) in &self.pids {
            reset_peak(*pid);
            if let Some(s) = sample(*pid) {
                start.insert(role.clone(), s);
            }
        }
        Mark { start }
    }

    /// Usage since `mark`, per role.
    pub fn since(&self, mark: &Mark) -> BTreeMap<String, ProcUsage> {
        let mut out = BTreeMap::new();
        for (role, pid) in &self.pids {
            let Some(end) = sample(*pid) else { continue };
            let start = mark.start.get(role).copied().unwrap_or_default();
            out.insert(
                role.clone(),
                ProcUsage {
                    cpu_seconds: (end.cpu_seconds - start.cpu_seconds).max(0.0),
                    rss_bytes: end.rss_bytes,
                    peak_rss_bytes: end.peak_rss_bytes.max(end.rss_bytes),
                },
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_command_names() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 1 2 3";
        let status = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t7\n";
        let s = parse(stat, status, 100.0).unwrap();
        assert!((s.cpu_seconds - 3.0).abs() < 1e-9);
        assert_eq!(s.rss_bytes, 1024 * 1024);
        assert_eq!(s.peak_rss_bytes, 2048 * 1024);
        assert_eq!(s.threads, 7);
    }

    #[test]
    fn reads_own_process() {
        let s = sample(std::process::id()).unwrap();
        assert!(s.rss_bytes > 0);
    }
}
