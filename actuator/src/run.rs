//! Wires the actuator together: netlink socket, applier, health server, brain stream, and what
//! follows each commit (guarded map entries and conntrack cleanup, health check servers).
//! Nothing here flushes the table on exit: the node keeps forwarding with the last applied
//! rules.
//!
//! At start, before any brain is asked, the tables a previous run left are adopted as the
//! applied model (restart without disruption): the node is ready, serves its health check
//! ports and resyncs conntrack at once, even with every brain away. The reconciler then keeps
//! the kernel's tables equal to the model (kernel is the truth).
use std::sync::{Arc, Mutex};

use anyhow::Context;

use crate::after_commit::AfterCommit;
use crate::apply::Applier;
use crate::client;
use crate::config::Config;
use crate::health::{self, Health};
use crate::nft::NftSocket;
use crate::reconcile;

pub async fn run(config: Config) -> anyhow::Result<()> {
    // Fail fast on a misconfiguration; the client reads the files again at every connection
    // (and the token for every request).
    config
        .credentials
        .check()
        .context("the credentials for the brain")?;
    let socket = NftSocket::open().context("opening the nf_tables netlink socket")?;
    let wake = Arc::new(tokio::sync::Notify::new());
    let applier = Arc::new(Mutex::new(
        Applier::new(socket, config.table.clone()).with_reconcile_wake(wake.clone()),
    ));
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
    tracing::info!(
        node = %config.node,
        brains = ?config.brains,
        brain_service = ?config.discovery.as_ref().map(|d| d.service.to_string()),
        token = config.credentials.token_file.is_some(),
        certificate = config.credentials.client_cert.is_some(),
        table = %config.table,
        "starting actuator"
    );
    adopt(&applier, &health, &after).await;
    tokio::spawn(reconcile::run(
        applier.clone(),
        health.clone(),
        Some(after.clone()),
        wake,
        config.reconcile_interval,
    ));
    tokio::select! {
        r = client::run(config.client(), applier, health, after) => r?,
        _ = shutdown() => {}
    }
    Ok(())
}

/// Takes the tables a previous run left as the applied model, before any brain answers: ready,
/// health check servers up, conntrack resynced. Tables that are absent or that this actuator
/// cannot read back are left to the first snapshot, which replaces them as before.
async fn adopt(applier: &Arc<Mutex<Applier>>, health: &Arc<Health>, after: &AfterCommit) {
    let a = applier.clone();
    let adopted = tokio::task::spawn_blocking(move || match a.lock() {
        Ok(mut a) => a.adopt().map_err(|e| e.to_string()),
        Err(_) => Err("the applier is poisoned".to_owned()),
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()));
    match adopted {
        Ok(Some(outcome)) => {
            let elements = outcome.model.element_count();
            tracing::info!(
                elements,
                took = ?outcome.took,
                digest = %hex(&outcome.model.digest()),
                "adopted the tables a previous run left as the applied model; ready without a brain"
            );
            health.metrics.set_adopted(elements);
            health
                .ready
                .store(true, std::sync::atomic::Ordering::Relaxed);
            after.run(outcome).await;
        }
        Ok(None) => tracing::info!("no table from a previous run; waiting for a brain's snapshot"),
        Err(e) => tracing::warn!(
            error = %e,
            "the tables in the kernel were not adopted; the first snapshot replaces them"
        ),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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
