//! The actuator's local HTTP endpoints: /healthz (the process is up), /readyz (a first update
//! has been applied, or the tables a previous run left were adopted at start-up and decode;
//! never goes back to false, since the node keeps forwarding with the last applied rules when
//! the brain is away) and /metrics.
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::metrics::Metrics;

#[derive(Debug, Default)]
pub struct Health {
    pub ready: AtomicBool,
    /// The last update the brain sent was refused by the kernel: the rules lag behind the
    /// cluster until a later one applies.
    pub apply_failing: AtomicBool,
    pub metrics: Metrics,
    /// Drift the reconciler found, waiting for a brain stream to report it.
    pub drift: crate::reconcile::DriftReports,
}

impl Health {
    /// What the healthCheckNodePort servers report as `serviceProxyHealthy` (kube-proxy's
    /// proxier health): a first update applied, and the latest one applied too. A brain that
    /// is away does not make the node unhealthy: it keeps forwarding with the last rules.
    pub fn service_proxy_healthy(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && !self.apply_failing.load(Ordering::Relaxed)
    }
}

pub async fn serve(listener: tokio::net::TcpListener, health: Arc<Health>) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route(
            "/metrics",
            get(|State(h): State<Arc<Health>>| async move { h.metrics.render() }),
        )
        .with_state(health);
    axum::serve(listener, app).await
}

pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

async fn readyz(State(h): State<Arc<Health>>) -> (StatusCode, &'static str) {
    if h.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "no update applied and no table adopted yet\n",
        )
    }
}
