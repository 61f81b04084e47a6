//! Process plumbing every splitproxy binary shares: logging set-up and the shutdown signal.
//! It lives here because this is the one crate the brain, the actuator and the test and
//! benchmark binaries all depend on.

/// Installs the tracing subscriber on stderr: `RUST_LOG` filters (default `info`), `format` is
/// "text" or "json". No OpenTelemetry (the brain and the actuator use
/// [`crate::telemetry::init`]).
pub fn init_logging(format: &str) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(crate::telemetry::log_filter())
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Resolves on SIGTERM (what the kubelet sends) or SIGINT. If the SIGTERM handler cannot be
/// installed, only SIGINT ends the wait.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
