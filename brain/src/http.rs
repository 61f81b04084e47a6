//! The brain's local HTTP endpoints: Prometheus metrics, liveness, and readiness (ready once
//! every initial list is complete and while no relist is pending).
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::fanout::Fanout;

pub async fn serve(listener: tokio::net::TcpListener, fanout: Arc<Fanout>) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(fanout);
    tracing::info!(addr = %listener.local_addr()?, "serving metrics and health");
    axum::serve(listener, app).await
}

async fn metrics(State(f): State<Arc<Fanout>>) -> String {
    f.metrics.render(f.connected_nodes())
}

async fn readyz(State(f): State<Arc<Fanout>>) -> (StatusCode, &'static str) {
    if f.synced() {
        (StatusCode::OK, "ok\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "initial lists not complete\n",
        )
    }
}
