//! The scale mode (`splitproxy-bench scale`): brain compute and kernel apply at scale without an
//! API server, gRPC or other nodes, so that each figure is one component's own cost.
//!
//! S Services x E endpoints over N Nodes, laid out by the end-to-end mode's generator
//! ([`crate::workload`]), go through the brain's index and incremental desired state (full
//! rebuild, every node's overlay: the memory that grows with nodes, single-Service changes with
//! their diffs and encoded sizes, publications of many changed Services as churn makes them),
//! then the actuator's applier commits them in a private network namespace: a snapshot (cold
//! start), single-endpoint changes (a distribution: one sample of a sub-millisecond apply cannot
//! be trusted), one Service added and one deleted. It prints one line per figure, after the
//! command that produced them. Needs root (the namespace).
pub mod brain;
pub mod compression;
pub mod heap;
pub mod kernel;
pub mod samples;

use crate::cli::ScaleArgs;
use crate::workload::Workload;

/// Runs the scale measurement and prints its figures.
pub fn run(args: &ScaleArgs) -> anyhow::Result<()> {
    args.validate()?;
    // Checked first: the brain's part takes minutes at full scale, the kernel's needs root.
    if !nix::unistd::geteuid().is_root() {
        anyhow::bail!("the scale mode applies in a private network namespace: run as root");
    }
    println!("command: {}", crate::run::command_line());
    println!("start: {}", heap::memory());
    let mut w = Workload::new(args.services, args.endpoints, args.nodes, &[]);
    // The bench's own description of the workload stays alive to the end: the heap figures
    // below include it, from this baseline.
    println!(
        "workload: {} Services x {} endpoints over {} Nodes laid out: {}",
        args.services,
        args.endpoints,
        args.nodes,
        heap::memory()
    );
    let mut brain = brain::Brain::load(&w)?;
    brain.rebuild(&w);
    brain.build_overlays();
    compression::report(brain.model(), &args.compression_part_elements, args.nodes)?;
    brain.service_changes(&mut w, args.service_changes)?;
    brain.churn_publications(&mut w, args.churn_batch, args.churn_publications)?;
    let updates = brain.updates(&mut w, args.endpoint_changes)?;
    brain.release();
    println!("before applying: {}", heap::memory());
    kernel::apply(updates, args.services, args.endpoints)
}
