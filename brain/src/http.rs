//! The brain's local HTTP endpoints: Prometheus metrics, liveness, and readiness: ready once
//! every initial list is complete, while no relist is pending, and while the last contact with
//! the API server is within the staleness bound ("never silently stale", docs/invariants.md).
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::fanout::Fanout;
use crate::freshness::Freshness;
use crate::metrics::Live;

#[derive(Clone)]
struct AppState {
    fanout: Arc<Fanout>,
    freshness: Arc<Freshness>,
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    fanout: Arc<Fanout>,
    freshness: Arc<Freshness>,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AppState { fanout, freshness });
    tracing::info!(addr = %listener.local_addr()?, "serving metrics and health");
    axum::serve(listener, app).await
}

async fn metrics(State(s): State<AppState>) -> String {
    let (max_node_lag, nodes_lagging) = s.fanout.lag_summary();
    let live = Live {
        max_node_lag,
        nodes_lagging,
        api_contact_age: s.freshness.age(),
    };
    s.fanout
        .metrics
        .render_with(s.fanout.connected_nodes(), &live)
}

async fn readyz(State(s): State<AppState>) -> (StatusCode, String) {
    if !s.fanout.fresh() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "stale: no contact with the API server for {:.1}s (bound {:.1}s)\n",
                s.freshness.age().as_secs_f64(),
                s.freshness.bound().as_secs_f64()
            ),
        )
    } else if !s.fanout.synced() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "initial lists not complete\n".into(),
        )
    } else {
        (StatusCode::OK, "ok\n".into())
    }
}
