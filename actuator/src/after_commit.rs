//! What follows a committed transaction: guarded map entries whose guard element went are
//! deleted (guards.rs), then stale UDP conntrack entries (conntrack.rs), and the
//! healthCheckNodePort servers follow the model, ports and addresses (healthcheck.rs). They run after the update is
//! acknowledged, so none delays the ack, and before the next update is applied, so they always
//! see the model they follow. None can fail the update: the kernel has the new rules already.
//! Each run takes what the applier returned for its commit ([`Outcome`]) as is.
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use crate::apply::Outcome;
use crate::health::Health;
use crate::healthcheck::HealthCheckServers;
use crate::{conntrack, guards};

pub struct AfterCommit {
    table: String,
    health: Arc<Health>,
    /// Blocking netlink: used from `spawn_blocking`.
    conntrack: Arc<Mutex<conntrack::Cleaner>>,
    /// Blocking netlink: used from `spawn_blocking`.
    guards: Arc<Mutex<guards::Cleaner>>,
    health_checks: tokio::sync::Mutex<HealthCheckServers>,
}

impl AfterCommit {
    /// `table`: the actuator's table name (the health check ports are a set of `ip <table>`);
    /// `health_check_addresses`: where the health check servers listen while the model names no
    /// NodePort address (see [`crate::healthcheck::DEFAULT_ADDRESSES`]).
    pub fn new(table: String, health: Arc<Health>, health_check_addresses: Vec<IpAddr>) -> Self {
        AfterCommit {
            table,
            health_checks: tokio::sync::Mutex::new(HealthCheckServers::new(
                health_check_addresses,
                health.clone(),
            )),
            health,
            conntrack: Arc::new(Mutex::new(conntrack::Cleaner::new())),
            guards: Arc::new(Mutex::new(guards::Cleaner::new())),
        }
    }

    /// Runs after the commit that had `outcome`: its model, the conntrack entries and the
    /// guarded map entries it left behind.
    pub async fn run(&self, outcome: Outcome) {
        let Outcome {
            conntrack: stale,
            guards: guarded,
            model,
            ..
        } = outcome;
        self.health_checks
            .lock()
            .await
            .reconcile_model(&model, &self.table)
            .await;
        if stale.is_empty() && guarded.is_empty() {
            return;
        }
        let (ct_cleaner, guard_cleaner, health) = (
            self.conntrack.clone(),
            self.guards.clone(),
            self.health.clone(),
        );
        let (ct_due, guards_due) = (!stale.is_empty(), !guarded.is_empty());
        let cleaned = tokio::task::spawn_blocking(move || {
            // Guarded entries first: a UDP flow whose conntrack entry goes next is looked up
            // again as new, and must not find its old endpoint through a remembered entry.
            if guards_due && let Ok(mut g) = guard_cleaner.lock() {
                g.clean(&guarded, &health.metrics);
            }
            if ct_due && let Ok(mut c) = ct_cleaner.lock() {
                c.clean(&stale, &health.metrics);
            }
        })
        .await;
        if let Err(e) = cleaned {
            if guards_due {
                self.health.metrics.guarded_cleanup_failed();
            }
            if ct_due {
                self.health.metrics.conntrack_cleanup_failed();
            }
            tracing::warn!(error = %e, "cleanup after commit did not run");
        }
    }
}
