//! Measuring: Prometheus scrapes and their deltas, exact latency distributions, and process CPU
//! and memory from /proc.
pub mod procstat;
pub mod prom;
pub mod stats;
