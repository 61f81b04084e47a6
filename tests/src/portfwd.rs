//! TCP forwarding from inside a namespace to host loopback.
//!
//! Actuators (and kube-proxy in comparisons) run inside node namespaces but must reach the
//! brain and the API server, which listen on the host's 127.0.0.1. Giving the namespaces a
//! route to the host would mean changing host interfaces, which the harness never does.
//! Instead, [`forward_port`] opens a listener inside the namespace (e.g. on its own
//! 127.0.0.1) and proxies every accepted connection to a target that is dialled from the
//! harness process's namespace. Sockets keep the namespace they were created in, so a single
//! private runtime can serve both sides.
//!
//! A forwarder is also the link a fault test cuts: [`Forwarder::cut`] blackholes it (every
//! forwarded connection stops carrying bytes but stays open, new connections are accepted and
//! never answered, as behind a partition that drops packets), and [`Forwarder::heal`] lets new
//! connections through again. Connections from before the cut stay blackholed for good, as
//! connections whose state a middlebox lost: a client must notice and open new ones.
//! [`forward_local`] forwards on the host's loopback (a brain's path to the API server), and
//! [`forward_into`] the other way, from host loopback into a namespace (a test's path to a
//! brain that runs on a node, as the chart runs it).

use std::net::SocketAddr;
use std::thread::JoinHandle;

use anyhow::Context;
use tokio::sync::{oneshot, watch};

use crate::Result;
use crate::netns::Netns;

/// A running forwarder; stops listening and closes forwarded connections on drop.
#[derive(Debug)]
pub struct Forwarder {
    listen: SocketAddr,
    target: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    link: watch::Sender<LinkState>,
}

/// Whether a forwarder's link is cut, and how many cuts it has seen (a connection forwarded
/// before a cut stays blackholed after the heal).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct LinkState {
    cut: bool,
    cuts: u64,
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

    /// Blackholes the link: forwarded connections stop carrying bytes (both ends stay open),
    /// and new ones are accepted but never forwarded.
    pub fn cut(&self) {
        self.link.send_modify(|s| {
            if !s.cut {
                s.cut = true;
                s.cuts += 1;
            }
        });
    }

    /// New connections are forwarded again; those from before the cut stay blackholed.
    pub fn heal(&self) {
        self.link.send_modify(|s| s.cut = false);
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
        .run(move || bind(listen))?
        .with_context(|| format!("listening on {listen} in {}", ns.name()))?;
    spawn(listener, target, None)
}

/// How long [`bind`] waits for an address a dropped forwarder held to come free.
const REBIND_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Binds a non-blocking listener on `listen`, waiting (up to [`REBIND_WAIT`]) while the address
/// is still in use.
///
/// A test that relinks a node drops its forwarders and binds their addresses again at once.
/// Dropping a forwarder closes its listener, but a process that another thread of the test
/// binary forked in the meantime holds a copy of every descriptor until it execs (close-on-exec
/// only closes them then), and the copy keeps the address listening for that moment: CI once
/// failed on exactly that `EADDRINUSE`. Any other holder is still an error after the wait.
fn bind(listen: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let deadline = std::time::Instant::now() + REBIND_WAIT;
    loop {
        match std::net::TcpListener::bind(listen) {
            Ok(listener) => {
                listener.set_nonblocking(true)?;
                return Ok(listener);
            }
            Err(err)
                if err.kind() == std::io::ErrorKind::AddrInUse
                    && listen.port() != 0
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(err) => return Err(err),
        }
    }
}

/// Listens on `listen` in the calling thread's namespace (host loopback) and forwards each
/// connection to `target` dialled from inside `ns`.
pub fn forward_into(ns: &Netns, listen: SocketAddr, target: SocketAddr) -> Result<Forwarder> {
    let listener = bind(listen).with_context(|| format!("listening on {listen}"))?;
    spawn(listener, target, Some(ns.path().to_path_buf()))
}

/// Listens on `listen` in the calling thread's namespace (normally host loopback) and forwards
/// each connection to `target`: a path a test can [`Forwarder::cut`].
pub fn forward_local(listen: SocketAddr, target: SocketAddr) -> Result<Forwarder> {
    let listener = bind(listen).with_context(|| format!("listening on {listen}"))?;
    spawn(listener, target, None)
}

/// Serves `listener` on a thread of its own, dialling `target` from the namespace at `dial_in`
/// (the caller's when `None`).
fn spawn(
    listener: std::net::TcpListener,
    target: SocketAddr,
    dial_in: Option<std::path::PathBuf>,
) -> Result<Forwarder> {
    let local = listener.local_addr()?;
    let (link, link_rx) = watch::channel(LinkState::default());

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building forwarder runtime")?;
    let (stop_tx, stop_rx) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name(format!("portfwd-{}", local.port()))
        .spawn(move || {
            if let Some(path) = dial_in
                && let Err(err) = crate::netns::enter(&path)
            {
                eprintln!("[splitproxy-tests] forwarder {local}: {err:#}");
                return;
            }
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
                    () = accept_loop(listener, target, link_rx) => {}
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
        link,
    })
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    target: SocketAddr,
    link: watch::Receiver<LinkState>,
) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let mut link = link.clone();
        tokio::spawn(async move {
            let at = *link.borrow_and_update();
            if at.cut {
                // Accepted and never answered; closed when the forwarder stops.
                let _held = inbound;
                std::future::pending::<()>().await;
                return;
            }
            // From the forwarder thread's namespace: the host's, or the one of `forward_into`.
            let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                return; // dropping `inbound` closes the client's connection
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => return,
                _ = link.wait_for(|s| s.cuts != at.cuts) => {}
            }
            // Cut: both connections stay open and carry nothing, until the forwarder stops.
            let _held = (inbound, outbound);
            std::future::pending::<()>().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    use super::*;

    /// Another process holding a copy of a dropped listener (here as its stdin, as a child
    /// forked by another thread holds every descriptor until it execs) keeps the address in
    /// use for a moment; binding it again waits that moment out instead of failing.
    #[test]
    fn an_address_held_for_a_moment_by_another_process_is_bound_again() {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = first.local_addr().unwrap();
        let copy = std::os::fd::OwnedFd::from(first.try_clone().unwrap());
        let mut holder = Command::new("sleep")
            .arg("0.5")
            .stdin(Stdio::from(copy))
            .spawn()
            .unwrap();
        drop(first);
        assert_eq!(
            std::net::TcpListener::bind(addr).unwrap_err().kind(),
            std::io::ErrorKind::AddrInUse,
            "the other process's copy keeps the address listening"
        );
        let again = bind(addr).expect("bound once the other process let go");
        assert_eq!(again.local_addr().unwrap(), addr);
        holder.wait().unwrap();
    }
}
