//! Wires the actuator together: netlink socket, applier, health server, brain stream, and what
//! follows each commit (guarded map entries and conntrack cleanup, health check servers).
//! Nothing here flushes the table on exit: the node keeps forwarding with the last applied
//! rules.
use std::sync::{Arc, Mutex};

use anyhow::Context;

use crate::after_commit::AfterCommit;
use crate::apply::Applier;
use crate::client::{self, ClientConfig};
use crate::config::Args;
use crate::health::{self, Health};
use crate::healthcheck;
use crate::nft::NftSocket;

pub async fn run(args: Args) -> anyhow::Result<()> {
    let node = match args.node_name.clone().filter(|n| !n.is_empty()) {
        Some(n) => n,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("reading hostname (or pass --hostname-override)")?
            .trim()
            .to_string(),
    };
    // Fail fast on a misconfiguration; the client reads the files again at every connection.
    for p in [&args.ca, &args.tls_cert, &args.tls_key] {
        std::fs::metadata(p).with_context(|| format!("reading {}", p.display()))?;
    }
    let config = ClientConfig {
        brains: args.brains.clone(),
        server_name: args.brain_server_name.clone(),
        node: node.clone(),
        ca: args.ca.clone(),
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
    };
    let socket = NftSocket::open().context("opening the nf_tables netlink socket")?;
    let applier = Arc::new(Mutex::new(Applier::new(socket, args.table.clone())));
    let health = Arc::new(Health::default());

    let healthz = health::bind(args.healthz_bind_address)
        .await
        .context("binding healthz address")?;
    tokio::spawn(log_err(
        "healthz server",
        health::serve(healthz, health.clone()),
    ));
    if args.metrics_bind_address != args.healthz_bind_address {
        let metrics = health::bind(args.metrics_bind_address)
            .await
            .context("binding metrics address")?;
        tokio::spawn(log_err(
            "metrics server",
            health::serve(metrics, health.clone()),
        ));
    }
    let after = Arc::new(AfterCommit::new(
        args.table.clone(),
        health.clone(),
        healthcheck::DEFAULT_ADDRESSES.to_vec(),
    ));
    tracing::info!(%node, brains = ?args.brains, table = %args.table, "starting actuator");
    tokio::select! {
        _ = client::run(config, applier, health, after) => {}
        _ = shutdown() => {}
    }
    Ok(())
}

async fn log_err(what: &'static str, f: impl std::future::Future<Output = std::io::Result<()>>) {
    if let Err(e) = f.await {
        tracing::error!(error = %e, "{what} failed");
    }
}

async fn shutdown() {
    splitproxy_proto::process::shutdown_signal().await;
    tracing::info!("shutting down; the applied rules stay in the kernel");
}
