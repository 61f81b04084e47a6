//! The server every test pod runs: it tells who answered, on which address, and whom it saw.
//!
//! Service tests need three facts per connection: which backend answered (load balancing,
//! topology, traffic policies), on which address and port the connection arrived (the endpoint
//! a DNAT chose, for Services with several ports or families), and whether the client's source
//! address survived (masquerade rules, `externalTrafficPolicy: Local`). The server answers each
//! TCP connection and each UDP datagram with one line,
//!
//! ```text
//! <name> <local_ip>:<local_port> <peer_ip>:<peer_port>\n
//! ```
//!
//! (IPv6 addresses in brackets, `[fd00:244::11]:8080`), which [`crate::probe()`] parses. IPv4 and
//! IPv6 are served by separate sockets on the same port (the IPv6 one `IPV6_V6ONLY`), so every
//! address is reported in its own family. UDP sockets read the destination of each datagram
//! (`IP_PKTINFO` / `IPV6_PKTINFO`) and answer from exactly that address, as a DNATed reply must.
//!
//! Its sockets are created inside the pod's namespace and served by a private tokio runtime
//! on a thread of its own, so it works from sync and async tests alike and never competes with
//! the test's runtime (a blocking probe on a single-threaded test runtime cannot starve it).
//! Dropping the server closes its sockets before `drop` returns.

use std::io::{IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, OwnedFd};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use nix::sys::socket::{
    AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    SockaddrIn, SockaddrIn6, SockaddrStorage, bind, listen, recvmsg, sendmsg, setsockopt, socket,
    sockopt,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
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
    /// (IPv4 and IPv6) on the given TCP and UDP ports. Port 0 picks a free port; see
    /// [`PodServer::tcp_addrs`] / [`PodServer::udp_addrs`].
    pub fn start(
        ns: impl AsRef<Netns>,
        name: &str,
        ports_tcp: &[u16],
        ports_udp: &[u16],
    ) -> Result<PodServer> {
        let ns = ns.as_ref();
        let (tcp_ports, udp_ports) = (ports_tcp.to_vec(), ports_udp.to_vec());
        let sockets = ns
            .run(move || bind_all(&tcp_ports, &udp_ports))?
            .with_context(|| format!("binding pod server {name} in {}", ns.name()))?;
        PodServer::serve_sockets(name, sockets)
    }

    /// [`PodServer::start`] in the calling thread's own namespace: the server a container
    /// image runs (`splitproxy-echo`), where the process already lives in the pod's namespace.
    pub fn start_here(name: &str, ports_tcp: &[u16], ports_udp: &[u16]) -> Result<PodServer> {
        let sockets =
            bind_all(ports_tcp, ports_udp).with_context(|| format!("binding pod server {name}"))?;
        PodServer::serve_sockets(name, sockets)
    }

    /// Serves bound sockets on a thread of its own.
    fn serve_sockets(name: &str, (tcp, udp): (Vec<OwnedFd>, Vec<OwnedFd>)) -> Result<PodServer> {
        let tcp: Vec<std::net::TcpListener> = tcp.into_iter().map(Into::into).collect();
        let udp: Vec<std::net::UdpSocket> = udp.into_iter().map(Into::into).collect();
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

    /// Local addresses of the TCP listeners (wildcard address of each family, actual port).
    pub fn tcp_addrs(&self) -> &[SocketAddr] {
        &self.tcp
    }

    /// Local addresses of the UDP sockets (wildcard address of each family, actual port).
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

/// The line the server sends: `"<name> <local> <peer>\n"`, addresses in canonical form (an
/// IPv4-mapped IPv6 address is printed as IPv4).
pub fn answer_line(name: &str, local: SocketAddr, peer: SocketAddr) -> String {
    let canon = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    format!("{name} {} {}\n", canon(local), canon(peer))
}

fn nix_err(what: &str) -> impl Fn(nix::Error) -> anyhow::Error + '_ {
    move |e| anyhow::Error::from(std::io::Error::from(e)).context(what.to_string())
}

/// Binds every TCP and UDP port (both families): (TCP sockets, UDP sockets).
fn bind_all(ports_tcp: &[u16], ports_udp: &[u16]) -> Result<(Vec<OwnedFd>, Vec<OwnedFd>)> {
    let mut tcp = Vec::new();
    for &port in ports_tcp {
        tcp.extend(bind_pair(SockType::Stream, port)?);
    }
    let mut udp = Vec::new();
    for &port in ports_udp {
        udp.extend(bind_pair(SockType::Datagram, port)?);
    }
    Ok((tcp, udp))
}

/// Binds an IPv4 socket and an IPv6-only socket of type `ty` on `port` (the IPv6 one on the
/// port the IPv4 one got when `port` is 0). Without IPv6 in the namespace, only the IPv4 one.
fn bind_pair(ty: SockType, port: u16) -> Result<Vec<OwnedFd>> {
    let v4 = bind_one(ty, SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
        .with_context(|| format!("binding {ty:?} port {port} (IPv4)"))?;
    let port = match nix::sys::socket::getsockname::<SockaddrIn>(v4.as_raw_fd()) {
        Ok(addr) => addr.port(),
        Err(_) => port,
    };
    let mut out = vec![v4];
    match bind_one(ty, SocketAddr::from((Ipv6Addr::UNSPECIFIED, port))) {
        Ok(v6) => out.push(v6),
        Err(err) => {
            let unsupported = err.chain().any(|e| {
                e.downcast_ref::<std::io::Error>()
                    .and_then(std::io::Error::raw_os_error)
                    == Some(nix::libc::EAFNOSUPPORT)
            });
            if !unsupported {
                return Err(err.context(format!("binding {ty:?} port {port} (IPv6)")));
            }
        }
    }
    Ok(out)
}

fn bind_one(ty: SockType, addr: SocketAddr) -> Result<OwnedFd> {
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::Inet,
        SocketAddr::V6(_) => AddressFamily::Inet6,
    };
    let fd = socket(
        family,
        ty,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(nix_err("socket"))?;
    setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(nix_err("SO_REUSEADDR"))?;
    match addr {
        SocketAddr::V4(a) => {
            if ty == SockType::Datagram {
                setsockopt(&fd, sockopt::Ipv4PacketInfo, &true).map_err(nix_err("IP_PKTINFO"))?;
            }
            bind(fd.as_raw_fd(), &SockaddrIn::from(a)).map_err(nix_err("bind"))?;
        }
        SocketAddr::V6(a) => {
            setsockopt(&fd, sockopt::Ipv6V6Only, &true).map_err(nix_err("IPV6_V6ONLY"))?;
            if ty == SockType::Datagram {
                setsockopt(&fd, sockopt::Ipv6RecvPacketInfo, &true)
                    .map_err(nix_err("IPV6_RECVPKTINFO"))?;
            }
            bind(fd.as_raw_fd(), &SockaddrIn6::from(a)).map_err(nix_err("bind"))?;
        }
    }
    if ty == SockType::Stream {
        listen(&fd, Backlog::new(256).map_err(nix_err("backlog"))?).map_err(nix_err("listen"))?;
    }
    Ok(fd)
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
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let line = answer_line(&name, local, peer);
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

/// One received datagram: who sent it, and to which local address.
struct Datagram {
    peer: SocketAddr,
    local: Option<IpAddr>,
}

fn recv_datagram(fd: i32, buf: &mut [u8]) -> std::io::Result<Datagram> {
    let mut cmsg = nix::cmsg_space!(nix::libc::in6_pktinfo);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<SockaddrStorage>(fd, &mut iov, Some(&mut cmsg), MsgFlags::empty())?;
    let peer = msg
        .address
        .and_then(|a| {
            a.as_sockaddr_in()
                .map(|s| SocketAddr::from(SocketAddrV4::from(*s)))
                .or_else(|| {
                    a.as_sockaddr_in6()
                        .map(|s| SocketAddr::from(SocketAddrV6::from(*s)))
                })
        })
        .ok_or_else(|| std::io::Error::other("datagram without a source address"))?;
    let mut local = None;
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            match c {
                ControlMessageOwned::Ipv4PacketInfo(info) => {
                    local = Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                        info.ipi_addr.s_addr,
                    ))));
                }
                ControlMessageOwned::Ipv6PacketInfo(info) => {
                    local = Some(IpAddr::V6(Ipv6Addr::from(info.ipi6_addr.s6_addr)));
                }
                _ => {}
            }
        }
    }
    Ok(Datagram { peer, local })
}

/// Sends `data` to `peer` from source address `local` (when known).
fn send_datagram(
    fd: i32,
    data: &[u8],
    peer: SocketAddr,
    local: Option<IpAddr>,
) -> std::io::Result<()> {
    let iov = [IoSlice::new(data)];
    let dst = SockaddrStorage::from(peer);
    match local {
        Some(IpAddr::V4(src)) => {
            let info = nix::libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: nix::libc::in_addr {
                    s_addr: u32::from(src).to_be(),
                },
                ipi_addr: nix::libc::in_addr { s_addr: 0 },
            };
            sendmsg(
                fd,
                &iov,
                &[ControlMessage::Ipv4PacketInfo(&info)],
                MsgFlags::empty(),
                Some(&dst),
            )?;
        }
        Some(IpAddr::V6(src)) => {
            let info = nix::libc::in6_pktinfo {
                ipi6_addr: nix::libc::in6_addr {
                    s6_addr: src.octets(),
                },
                ipi6_ifindex: 0,
            };
            sendmsg(
                fd,
                &iov,
                &[ControlMessage::Ipv6PacketInfo(&info)],
                MsgFlags::empty(),
                Some(&dst),
            )?;
        }
        None => {
            sendmsg::<SockaddrStorage>(fd, &iov, &[], MsgFlags::empty(), Some(&dst))?;
        }
    }
    Ok(())
}

async fn serve_udp(name: String, socket: tokio::net::UdpSocket) {
    let fd = socket.as_raw_fd();
    let port = socket.local_addr().map(|a| a.port()).unwrap_or(0);
    let mut buf = vec![0u8; 65536];
    loop {
        let received = socket
            .async_io(Interest::READABLE, || recv_datagram(fd, &mut buf))
            .await;
        let Ok(Datagram { peer, local }) = received else {
            // Errors concern one earlier datagram only; pause briefly so a persistent one
            // cannot spin the thread.
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        let local_addr = SocketAddr::new(
            local.unwrap_or(match peer {
                SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            }),
            port,
        );
        let line = answer_line(&name, local_addr, peer);
        let _ = socket
            .async_io(Interest::WRITABLE, || {
                send_datagram(fd, line.as_bytes(), peer, local)
            })
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_lines_use_canonical_addresses() {
        let mapped: SocketAddr = "[::ffff:10.244.0.5]:8080".parse().unwrap();
        let peer: SocketAddr = "[::ffff:10.244.1.7]:40000".parse().unwrap();
        assert_eq!(
            answer_line("web-0", mapped, peer),
            "web-0 10.244.0.5:8080 10.244.1.7:40000\n"
        );
        let v6: SocketAddr = "[fd00:244::5]:80".parse().unwrap();
        assert_eq!(
            answer_line("a", v6, v6),
            "a [fd00:244::5]:80 [fd00:244::5]:80\n"
        );
    }
}
