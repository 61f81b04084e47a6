//! `splitproxy-bench`: the scale benchmarks (see the library's documentation): end to end by
//! default, `splitproxy-bench scale` for the brain and kernel alone; and the brain and actuator
//! the end-to-end benchmark spawns (`splitproxy-bench brain|actuator ...`).
// The only unsafe code is the counting allocator below.
#![deny(unsafe_code)]

use clap::Parser;
use splitproxy_bench::cli::{Cli, Command};
use splitproxy_bench::scale::heap;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Scale(args)) => {
            heap::start_counting();
            splitproxy_bench::scale::run(&args)
        }
        Some(Command::Brain(args)) => {
            let config = splitproxy_brain::config::BrainConfig::try_from(*args)?;
            splitproxy_brain::init_logging(&config.log_format);
            // A diagnostic for the brain's memory: its live heap against its RSS, every 5 s,
            // into its log (the heap that RSS blurs with what the allocator keeps).
            if std::env::var_os("SPLITPROXY_BENCH_BRAIN_HEAP").is_some() {
                heap::start_counting();
                std::thread::spawn(|| {
                    for _ in 0..720 {
                        eprintln!("[brain heap] {}", heap::memory());
                        std::thread::sleep(std::time::Duration::from_secs(5));
                    }
                });
            }
            splitproxy_brain::run::runtime(&config.tuning)?
                .block_on(splitproxy_brain::run::run(config))
        }
        Some(Command::Actuator(args)) => {
            // As the actuator's own main does, before any thread starts.
            splitproxy_actuator::malloc::limit_arenas();
            splitproxy_actuator::init_logging(&args.log_format);
            runtime()?.block_on(splitproxy_actuator::run::run((*args).try_into()?))
        }
        Some(Command::Floor(args)) => splitproxy_bench::floor::command(&args),
        None => {
            bench_logging();
            runtime()?.block_on(async {
                // On SIGINT or SIGTERM the run is dropped, which stops every component it
                // started and removes its namespaces.
                tokio::select! {
                    r = splitproxy_bench::run::run(cli.bench) => r.map(drop),
                    _ = splitproxy_proto::process::shutdown_signal() => {
                        eprintln!("[bench] interrupted: stopping every component");
                        Err(anyhow::anyhow!("interrupted by a signal"))
                    }
                }
            })
        }
    }
}

/// The bench process's own log: warnings and errors (a virtual node without a usable identity,
/// say) to stderr, `RUST_LOG` for more. Without a subscriber they went nowhere, and every span
/// of the virtual nodes' HTTP/2 connections was still offered to the `log` crate (tracing's
/// `log` feature, which kube-client turns on, does that while no subscriber is set): 1-2 % of
/// the fleet's CPU in churn, on the cores the brain is measured on. kube-client's own errors are
/// left out: it logs one for every poll of an API server still starting, and the bench reports
/// the requests that matter with their context.
fn bench_logging() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,kube_client=off"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

/// The system allocator, telling [`heap`] what it allocates and frees, so that the scale mode
/// reports live heap bytes, which RSS blurs with the pages the allocator retains. Counting is
/// off (one relaxed load) except in the scale mode.
#[allow(unsafe_code)]
mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};

    use splitproxy_bench::scale::heap;

    pub struct Counting;

    // SAFETY: every call is forwarded to the system allocator with the caller's arguments,
    // which satisfy GlobalAlloc's contract; the counters are atomics and never allocate.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            heap::allocated(layout.size());
            // SAFETY: forwarded unchanged (see above).
            unsafe { System.alloc(layout) }
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            heap::allocated(layout.size());
            // SAFETY: forwarded unchanged (see above).
            unsafe { System.alloc_zeroed(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            heap::freed(layout.size());
            // SAFETY: forwarded unchanged (see above).
            unsafe { System.dealloc(ptr, layout) }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: forwarded unchanged (see above).
            let p = unsafe { System.realloc(ptr, layout, new_size) };
            if !p.is_null() {
                heap::freed(layout.size());
                heap::allocated(new_size);
            }
            p
        }
    }

    #[global_allocator]
    static ALLOC: Counting = Counting;
}
