//! The node's side of the scale mode: the actuator's applier commits the brain's updates into
//! nf_tables, one transaction each ("atomic"), in a private network namespace of one thread:
//! the host's ruleset is never opened, let alone changed.
//!
//! "kernel" is the time the applier reports for the netlink transaction, "total" adds building
//! the batch from the update.
use std::time::Instant;

use anyhow::Context;
use splitproxy_actuator::apply::Applier;
use splitproxy_actuator::nft::NftSocket;
use splitproxy_proto::v1::Update;

use super::brain::Updates;
use super::heap;
use super::samples::Samples;

/// The table the updates are applied into.
const TABLE: &str = "splitproxy";

/// Applies `updates` in order in a fresh network namespace and prints each figure. The
/// namespace is the thread's own and goes with it.
pub fn apply(updates: Updates, services: usize, endpoints: usize) -> anyhow::Result<()> {
    std::thread::Builder::new()
        .name("scale-kernel".into())
        .spawn(move || in_private_namespace(updates, services, endpoints))
        .context("starting the kernel thread")?
        .join()
        .map_err(|_| anyhow::anyhow!("the kernel thread panicked"))?
}

fn in_private_namespace(updates: Updates, services: usize, endpoints: usize) -> anyhow::Result<()> {
    // Before any netlink socket exists: everything below sees only this namespace.
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
        .context("creating a private network namespace (run as root)")?;
    let mut applier = Applier::new(
        NftSocket::open().context("opening the nf_tables socket")?,
        TABLE.into(),
    );
    let Updates {
        snapshot,
        endpoint_changes,
        service_added,
        service_deleted,
    } = updates;

    let t = Instant::now();
    let kernel = apply_one(&mut applier, &snapshot)?;
    println!(
        "cold start, {services} Services x {endpoints}: kernel {kernel:?}, total {:?}, {}",
        t.elapsed(),
        heap::memory()
    );
    drop(snapshot);

    let (mut kernel, mut total) = (Samples::default(), Samples::default());
    for u in &endpoint_changes {
        let t = Instant::now();
        kernel.push(apply_one(&mut applier, u)?);
        total.push(t.elapsed());
    }
    if !kernel.is_empty() {
        println!(
            "one endpoint change ({} changes, one endpoint of one Service replaced each): \
             kernel p50 {:?} p99 {:?} max {:?}; total p50 {:?} p99 {:?}",
            kernel.len(),
            kernel.quantile(0.5),
            kernel.quantile(0.99),
            kernel.max(),
            total.quantile(0.5),
            total.quantile(0.99)
        );
    }

    for (name, u) in [
        ("one Service added", &service_added),
        ("one Service deleted", &service_deleted),
    ] {
        let t = Instant::now();
        let kernel = apply_one(&mut applier, u)?;
        println!("{name}: kernel {kernel:?}, total {:?}", t.elapsed());
    }
    println!("after: {}", heap::memory());
    Ok(())
}

fn apply_one(applier: &mut Applier, u: &Update) -> anyhow::Result<std::time::Duration> {
    applier
        .apply(u)
        .map(|outcome| outcome.took)
        .with_context(|| format!("applying generation {}", u.generation))
}
