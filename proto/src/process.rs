//! Process plumbing every splitproxy binary shares: logging set-up and the shutdown signal.
//! It lives here because this is the one crate the brain, the actuator and the test and
//! benchmark binaries all depend on.

/// Installs the tracing subscriber on stderr: `RUST_LOG` filters (default `info`), `format` is
/// "text" or "json".
pub fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
