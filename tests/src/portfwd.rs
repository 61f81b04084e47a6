//! TCP forwarding from inside a namespace to host loopback.
//!
//! Actuators (and kube-proxy in comparisons) run inside node namespaces but must reach the
//! brain and the API server, which listen on the host's 127.0.0.1. Giving the namespaces a
//! route to the host would mean changing host interfaces, which the harness never does.
//! Instead, [`forward_port`] opens a listener inside the namespace (e.g. on its own
//! 127.0.0.1) and proxies every accepted connection to a target that is dialled from the
//! harness process's namespace. Sockets keep the namespace they were created in, so a single
//! private runtime can serve both sides.

use std::net::SocketAddr;
use std::thread::JoinHandle;

use anyhow::Context;
use tokio::sync::oneshot;

use crate::Result;
use crate::netns::Netns;

/// A running forwarder; stops listening and closes forwarded connections on drop.
#[derive(Debug)]
pub struct Forwarder {
    listen: SocketAddr,
    target: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// The address the forwarder listens on inside the namespace (the actual port if `listen`
    /// had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listen
    }

    /// The target dialled from the harness's namespace.
    pub fn target(&self) -> SocketAddr {
        self.target
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Listens on `listen` inside `ns` and forwards each connection to `target` as seen from the
/// calling thread's namespace (normally the host, e.g. the brain on 127.0.0.1:port).
///
/// Must be called from a thread in the harness's own namespace (not from inside
/// [`Netns::run`]), since that is where the target is dialled.
pub fn forward_port(ns: &Netns, listen: SocketAddr, target: SocketAddr) -> Result<Forwarder> {
    let listener = ns
        .run(move || -> std::io::Result<std::net::TcpListener> {
            let listener = std::net::TcpListener::bind(listen)?;
            listener.set_nonblocking(true)?;
            Ok(listener)
        })?
        .with_context(|| format!("listening on {listen} in {}", ns.name()))?;
    let local = listener.local_addr()?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building forwarder runtime")?;
    let (stop_tx, stop_rx) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name(format!("portfwd-{}", local.port()))
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => listener,
                    Err(err) => {
                        eprintln!("[splitproxy-tests] forwarder {local}: {err}");
                        return;
                    }
                };
                tokio::select! {
                    _ = stop_rx => {}
                    () = accept_loop(listener, target) => {}
                }
            });
            // Dropping the runtime closes every forwarded connection.
        })
        .context("spawning forwarder thread")?;
    Ok(Forwarder {
        listen: local,
        target,
        stop: Some(stop_tx),
        thread: Some(thread),
    })
}

async fn accept_loop(listener: tokio::net::TcpListener, target: SocketAddr) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        tokio::spawn(async move {
            // The runtime thread never entered a namespace, so this dials from the host's.
            let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                return; // dropping `inbound` closes the client's connection
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        });
    }
}
