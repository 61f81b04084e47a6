//! The actuator's local HTTP endpoints: /healthz (the process is up), /readyz (a first update
//! has been applied, or the tables a previous run left were adopted at start-up and decode;
//! never goes back to false, since the node keeps forwarding with the last applied rules when
//! the brain is away) on `--healthz-bind-address`, and /metrics on `--metrics-bind-address` only
//! (loopback by default): health is for load balancers on the node's addresses, metrics are not
//! for everyone who can reach the node. When both flags name the same address, one server
//! answers both.
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

/// Which endpoints one server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoints {
    /// /healthz and /readyz.
    pub health: bool,
    /// /metrics.
    pub metrics: bool,
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    health: Arc<Health>,
    endpoints: Endpoints,
) -> std::io::Result<()> {
    axum::serve(listener, router(health, endpoints)).await
}

fn router(health: Arc<Health>, endpoints: Endpoints) -> Router {
    let mut app = Router::new();
    if endpoints.health {
        app = app
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz));
    }
    if endpoints.metrics {
        app = app.route(
            "/metrics",
            get(|State(h): State<Arc<Health>>| async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        crate::metrics::CONTENT_TYPE,
                    )],
                    h.metrics.render(),
                )
            }),
        );
    }
    app.with_state(health)
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

#[cfg(test)]
mod tests {
    use super::*;

    async fn get_status(endpoints: Endpoints, path: &str) -> u16 {
        let answer = get(endpoints, path).await;
        answer.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// The whole HTTP answer, head and body.
    async fn get(endpoints: Endpoints, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(listener, Arc::new(Health::default()), endpoints));
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).await.unwrap();
        server.abort();
        answer
    }

    /// /metrics is OpenMetrics text, complete (`# EOF`) and labelled as such.
    #[tokio::test]
    async fn metrics_are_openmetrics() {
        let metrics = Endpoints {
            health: false,
            metrics: true,
        };
        let answer = get(metrics, "/metrics").await.to_lowercase();
        assert!(
            answer.contains(&format!(
                "content-type: {}\r\n",
                crate::metrics::CONTENT_TYPE
            )),
            "{answer}"
        );
        assert!(answer.ends_with("# eof\n"), "{answer}");
        assert!(
            answer.contains("\nsplitproxy_actuator_apply_errors_total 0\n"),
            "{answer}"
        );
    }

    /// /metrics only where the metrics flag says, health only where the healthz flag says.
    #[tokio::test]
    async fn each_server_answers_only_its_endpoints() {
        let health = Endpoints {
            health: true,
            metrics: false,
        };
        let metrics = Endpoints {
            health: false,
            metrics: true,
        };
        assert_eq!(get_status(health, "/healthz").await, 200);
        assert_eq!(get_status(health, "/readyz").await, 503);
        assert_eq!(get_status(health, "/metrics").await, 404);
        assert_eq!(get_status(metrics, "/metrics").await, 200);
        assert_eq!(get_status(metrics, "/healthz").await, 404);
    }
}
