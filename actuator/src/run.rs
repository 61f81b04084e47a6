//! Wires the actuator together: netlink socket, applier, health server, brain stream, and what
//! follows each commit (guarded map entries and conntrack cleanup, health check servers).
//! Nothing here flushes the table on exit: the node keeps forwarding with the last applied
//! rules.
use std::sync::{Arc, Mutex};

use anyhow::Context;

use crate::after_commit::AfterCommit;
use crate::apply::Applier;
use crate::client;
use crate::config::Config;
use crate::health::{self, Health};
use crate::nft::NftSocket;

pub async fn run(config: Config) -> anyhow::Result<()> {
    // Fail fast on a misconfiguration; the client reads the files again at every connection.
    for p in [&config.tls.ca, &config.tls.cert, &config.tls.key] {
        std::fs::metadata(p).with_context(|| format!("reading {}", p.display()))?;
    }
    let socket = NftSocket::open().context("opening the nf_tables netlink socket")?;
    let applier = Arc::new(Mutex::new(Applier::new(socket, config.table.clone())));
    let health = Arc::new(Health::default());

    // Health on the healthz address (load balancers probe it on the node's addresses),
    // metrics on the metrics address only; one server for both when the flags are equal.
    let shared = config.metrics_bind_address == config.healthz_bind_address;
    let healthz = health::bind(config.healthz_bind_address)
        .await
        .context("binding healthz address")?;
    tokio::spawn(log_err(
        "healthz server",
        health::serve(
            healthz,
            health.clone(),
            health::Endpoints {
                health: true,
                metrics: shared,
            },
        ),
    ));
    if !shared {
        let metrics = health::bind(config.metrics_bind_address)
            .await
            .context("binding metrics address")?;
        tokio::spawn(log_err(
            "metrics server",
            health::serve(
                metrics,
                health.clone(),
                health::Endpoints {
                    health: false,
                    metrics: true,
                },
            ),
        ));
    }
    let after = Arc::new(AfterCommit::new(
        config.table.clone(),
        health.clone(),
        config.health_check_addresses.clone(),
    ));
    tracing::info!(node = %config.node, brains = ?config.brains, table = %config.table, "starting actuator");
    tokio::select! {
        r = client::run(config.client(), applier, health, after) => r?,
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
