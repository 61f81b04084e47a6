//! The brain's local HTTP endpoints: Prometheus metrics, liveness, and readiness: ready once
//! every initial list is complete, while no relist is pending, and while the last contact with
//! the API server is within the staleness bound ("never silently stale", docs/invariants.md),
//! and, when the brain manages its certificate in a Secret, once it has one to serve with.
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::fanout::Fanout;
use crate::freshness::Freshness;
use crate::metrics::Live;
use crate::tls::ServingCert;

#[derive(Clone)]
struct AppState {
    fanout: Arc<Fanout>,
    freshness: Arc<Freshness>,
    /// The managed serving certificate (`--tls-secret`), if that is where it comes from.
    serving: Option<Arc<ServingCert>>,
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    fanout: Arc<Fanout>,
    freshness: Arc<Freshness>,
    serving: Option<Arc<ServingCert>>,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AppState {
            fanout,
            freshness,
            serving,
        });
    tracing::info!(addr = %listener.local_addr()?, "serving metrics and health");
    axum::serve(listener, app).await
}

async fn metrics(
    State(s): State<AppState>,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    let (max_node_lag, nodes_lagging) = s.fanout.lag_summary();
    let live = Live {
        max_node_lag,
        nodes_lagging,
        api_contact_age: s.freshness.age(),
    };
    let text = s
        .fanout
        .metrics
        .render_with(s.fanout.connected_nodes(), &live);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::metrics::CONTENT_TYPE,
        )],
        text,
    )
}

async fn readyz(State(s): State<AppState>) -> (StatusCode, String) {
    if s.serving.as_ref().is_some_and(|c| !c.is_ready()) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "no serving certificate in the TLS Secret yet\n".into(),
        )
    } else if !s.fanout.fresh() {
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
