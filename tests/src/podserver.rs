//! The server every test pod runs: it tells who answered and which source address it saw.
//!
//! Service tests need two facts per connection: which backend answered (load balancing,
//! topology, traffic policies) and whether the client's source address survived (masquerade
//! rules, `externalTrafficPolicy: Local`). The server answers each TCP connection and each UDP
//! datagram with one line, `"<name> <peer_ip>:<peer_port>\n"`, which [`crate::probe`] parses.
//!
//! Its sockets are created inside the pod's namespace and served by a private tokio runtime
//! on a thread of its own, so it works from sync and async tests alike and never competes with
//! the test's runtime (a blocking probe on a single-threaded test runtime cannot starve it).
//! Dropping the server closes its sockets before `drop` returns.

use std::net::{Ipv6Addr, SocketAddr};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

use crate::Result;
use crate::netns::Netns;

/// A running pod server; stops on drop.
#[derive(Debug)]
pub struct PodServer {
    name: String,
    tcp: Vec<SocketAddr>,
    udp: Vec<SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl PodServer {
    /// Starts a server named `name` inside `ns`, listening on every address of the namespace
    /// (IPv4 and IPv6 when available) on the given TCP and UDP ports. Port 0 picks a free port;
    /// see [`PodServer::tcp_addrs`] / [`PodServer::udp_addrs`].
    pub fn start(
        ns: impl AsRef<Netns>,
        name: &str,
        ports_tcp: &[u16],
        ports_udp: &[u16],
    ) -> Result<PodServer> {
        let ns = ns.as_ref();
        let tcp_ports = ports_tcp.to_vec();
        let udp_ports = ports_udp.to_vec();
        let (tcp, udp) = ns
            .run(move || -> Result<_> {
                let tcp = tcp_ports
                    .iter()
                    .map(|&port| bind_tcp(port))
                    .collect::<Result<Vec<_>>>()?;
                let udp = udp_ports
                    .iter()
                    .map(|&port| bind_udp(port))
                    .collect::<Result<Vec<_>>>()?;
                Ok((tcp, udp))
            })?
            .with_context(|| format!("binding pod server {name} in {}", ns.name()))?;

        let tcp_addrs = tcp
            .iter()
            .map(std::net::TcpListener::local_addr)
            .collect::<std::io::Result<Vec<_>>>()?;
        let udp_addrs = udp
            .iter()
            .map(std::net::UdpSocket::local_addr)
            .collect::<std::io::Result<Vec<_>>>()?;

        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("building pod server runtime")?;
        let (stop_tx, stop_rx) = oneshot::channel();
        let server_name = name.to_string();
        let thread = std::thread::Builder::new()
            .name(format!("podserver-{name}"))
            .spawn(move || {
                runtime.block_on(serve(server_name, tcp, udp, stop_rx));
                // Dropping the runtime here drops every connection task and socket.
            })
            .context("spawning pod server thread")?;

        Ok(PodServer {
            name: name.to_string(),
            tcp: tcp_addrs,
            udp: udp_addrs,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The name the server answers with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Local addresses of the TCP listeners (wildcard address, actual port).
    pub fn tcp_addrs(&self) -> &[SocketAddr] {
        &self.tcp
    }

    /// Local addresses of the UDP sockets (wildcard address, actual port).
    pub fn udp_addrs(&self) -> &[SocketAddr] {
        &self.udp
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The line the server sends to `peer`.
pub fn answer_line(name: &str, peer: SocketAddr) -> String {
    let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
    format!("{name} {peer}\n")
}

/// Binds a dual-stack wildcard listener, falling back to IPv4 when IPv6 is unavailable.
fn bind_tcp(port: u16) -> Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind((Ipv6Addr::UNSPECIFIED, port))
        .or_else(|_| std::net::TcpListener::bind(("0.0.0.0", port)))
        .with_context(|| format!("binding TCP port {port}"))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

fn bind_udp(port: u16) -> Result<std::net::UdpSocket> {
    let socket = std::net::UdpSocket::bind((Ipv6Addr::UNSPECIFIED, port))
        .or_else(|_| std::net::UdpSocket::bind(("0.0.0.0", port)))
        .with_context(|| format!("binding UDP port {port}"))?;
    socket.set_nonblocking(true)?;
    Ok(socket)
}

async fn serve(
    name: String,
    tcp: Vec<std::net::TcpListener>,
    udp: Vec<std::net::UdpSocket>,
    stop: oneshot::Receiver<()>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    for listener in tcp {
        match tokio::net::TcpListener::from_std(listener) {
            Ok(listener) => {
                tasks.spawn(serve_tcp(name.clone(), listener));
            }
            Err(err) => eprintln!("[splitproxy-tests] pod server {name}: {err}"),
        }
    }
    for socket in udp {
        match tokio::net::UdpSocket::from_std(socket) {
            Ok(socket) => {
                tasks.spawn(serve_udp(name.clone(), socket));
            }
            Err(err) => eprintln!("[splitproxy-tests] pod server {name}: {err}"),
        }
    }
    let _ = stop.await;
    tasks.abort_all();
}

async fn serve_tcp(name: String, listener: tokio::net::TcpListener) {
    loop {
        let Ok((mut stream, peer)) = listener.accept().await else {
            // Out of file descriptors or similar: back off instead of spinning.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let line = answer_line(&name, peer);
        tokio::spawn(async move {
            if stream.write_all(line.as_bytes()).await.is_err() {
                return;
            }
            let _ = stream.shutdown().await;
            // Drain what the client sends until it closes, so that unread data never turns
            // our close into a reset that could destroy the answer in flight.
            let mut sink = [0u8; 1024];
            let _ = tokio::time::timeout(Duration::from_secs(2), async {
                while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
            })
            .await;
        });
    }
}

async fn serve_udp(name: String, socket: tokio::net::UdpSocket) {
    let mut buf = vec![0u8; 65536];
    loop {
        let Ok((_, peer)) = socket.recv_from(&mut buf).await else {
            // Errors concern one earlier datagram only; pause briefly so a persistent one
            // cannot spin the thread.
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        let line = answer_line(&name, peer);
        let _ = socket.send_to(line.as_bytes(), peer).await;
    }
}
