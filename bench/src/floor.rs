//! The fan-out floor of this machine, measured in the same run as splitproxy: what the system
//! calls alone cost when every node has its own TCP stream and acks every update.
//!
//! N loopback TCP connections. Each round, one thread (the "brain") writes an update to every
//! connection and then reads one ack from each; another thread (the "nodes") reads each update
//! and answers with an ack. Updates are as long as the brain's were in the churn phase, acks as
//! long as a node's ack with its framing. No TLS, no HTTP/2, no protobuf, no allocation per
//! message, one `epoll` loop each side: any design that keeps a stream per node and an ack per
//! update pays at least this on this machine, whatever its user space does. On loopback the
//! sender's `write` also runs the receiver's TCP processing, as it does for the brain and the
//! virtual fleet, so the comparison is like for like. Measured again with TLS on every stream
//! (`link`), then on tokio without and with HTTP/2, by `h2` and by hyper's server
//! (`tasks`), it says which part of the gap to splitproxy each layer takes, and what is left
//! for splitproxy's own work.
//!
//! The brain's CPU per node-update and a single change's fan-out to every node are reported
//! against it (`report/targets.rs`, `report/sections.rs`), as kube-proxy's figures are: a ratio
//! to a peer measured in the same run, not to a number from another day.
use std::io::ErrorKind;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mio::{Events, Interest, Poll, Token};
use serde::{Deserialize, Serialize};

mod apart;
mod link;
mod tasks;
pub use apart::{FloorArgs, command, measure_apart};
use link::{Link, Wire};
pub use tasks::Stack;

/// What the floor measurement found.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Floor {
    /// Whether every stream carried TLS.
    #[serde(default)]
    pub tls: bool,
    /// What carried the rounds above the sockets.
    #[serde(default)]
    pub stack: Stack,
    pub nodes: usize,
    pub rounds: usize,
    pub update_bytes: usize,
    pub ack_bytes: usize,
    /// CPU seconds of the writing side per update (write, and read of the ack).
    pub brain_cpu_per_update: f64,
    /// CPU seconds of the nodes' side per update (read, and write of the ack).
    pub node_cpu_per_update: f64,
    /// Wall time of one round (an update to every node and every ack back): mean and worst.
    pub round_mean_seconds: f64,
    pub round_max_seconds: f64,
}

impl Floor {
    /// What carried the rounds, in words.
    pub fn label(&self) -> &'static str {
        label(self.tls, self.stack)
    }
}

/// The floor over TLS or not, on `stack`, in words.
pub fn label(tls: bool, stack: Stack) -> &'static str {
    match (stack, tls) {
        (Stack::Epoll, false) => "bare TCP",
        (Stack::Epoll, true) => "TLS",
        (Stack::Tokio, _) => "TLS on tokio",
        (Stack::H2, _) => "TLS, tokio and HTTP/2",
        (Stack::Hyper, _) => "TLS, tokio and hyper's HTTP/2 server",
    }
}

/// Longest a measurement may take before it is abandoned.
const LIMIT: Duration = Duration::from_secs(120);

/// Runs `rounds` rounds to `nodes` connections on `stack`, over TLS if `tls` (the tokio stacks
/// always are), the nodes' side on a thread of this process; blocking (run it off the async
/// runtime). Both sides then share this process's open-file limit: [`measure_apart`] runs
/// them in processes of their own.
pub fn measure(
    nodes: usize,
    update_bytes: usize,
    ack_bytes: usize,
    rounds: usize,
    tls: bool,
    stack: Stack,
) -> anyhow::Result<Floor> {
    let (wire, theirs) = if tls || stack != Stack::Epoll {
        let (wire, der) = link::tls_server()?;
        (wire, link::tls_client(&der)?)
    } else {
        (Wire::Tcp, Wire::Tcp)
    };
    let sizes = (nodes, update_bytes, ack_bytes, rounds);
    measure_with(sizes, &wire, stack, |addr, started| {
        let side = std::thread::Builder::new()
            .name("floor-nodes".into())
            .spawn(move || nodes_side(addr, &theirs, stack, sizes, started))?;
        Ok(Box::new(side))
    })
}

/// Nodes, update bytes, ack bytes, rounds.
type Sizes = (usize, usize, usize, usize);

/// The nodes' side while the sending side runs: a thread, or a process ([`apart`]).
trait NodesSide {
    /// Whether it has ended: it then stopped connecting, or failed.
    fn ended(&mut self) -> bool;
    /// Its CPU seconds from the first update on, once the sending side is done (its
    /// connections are closed then, and not before).
    fn finish(self: Box<Self>) -> anyhow::Result<f64>;
}

impl NodesSide for std::thread::JoinHandle<anyhow::Result<(f64, Vec<Link>)>> {
    fn ended(&mut self) -> bool {
        self.is_finished()
    }

    fn finish(self: Box<Self>) -> anyhow::Result<f64> {
        let (cpu, _conns) = self
            .join()
            .map_err(|_| anyhow::anyhow!("the nodes' thread panicked"))??;
        Ok(cpu)
    }
}

/// The measurement, the sending side over `wire` on `stack`, with the nodes' side started by
/// `start` (given the sending side's address and the measurement's start, for its time limit).
fn measure_with(
    (nodes, update_bytes, ack_bytes, rounds): Sizes,
    wire: &Wire,
    stack: Stack,
    start: impl FnOnce(std::net::SocketAddr, Instant) -> anyhow::Result<Box<dyn NodesSide>>,
) -> anyhow::Result<Floor> {
    if nodes == 0 || rounds == 0 || update_bytes == 0 || ack_bytes == 0 {
        bail!("nothing to measure");
    }
    let listener = TcpListener::bind("127.0.0.1:0").context("binding on loopback")?;
    let addr = listener.local_addr()?;
    let started = Instant::now();
    let mut node_side = start(addr, started).context("starting the nodes' side")?;
    listener.set_nonblocking(true)?;
    let sizes = (nodes, update_bytes, ack_bytes, rounds);
    let mut nodes_gone = || node_side.ended();
    let sending = match stack {
        Stack::Epoll => sending_side(&listener, wire, &mut nodes_gone, sizes, started),
        _ => tasks::sending_side(&listener, wire, stack, &mut nodes_gone, sizes, started),
    };
    drop(listener);
    // Finished after the sending side dropped its connections: a failed side ends the other's
    // loop (it reads a closed connection) instead of leaving it waiting.
    let receiving = node_side.finish();
    let ((brain_cpu, total, worst), node_cpu) = match (sending, receiving) {
        (Ok(s), Ok(r)) => (s, r),
        (Err(s), Ok(_)) => return Err(s.context("the sending side")),
        (Ok(_), Err(r)) => return Err(r.context("the nodes' side")),
        (Err(s), Err(r)) => bail!("the sending side: {s:#}; the nodes' side: {r:#}"),
    };
    let updates = (nodes * rounds) as f64;
    Ok(Floor {
        tls: !matches!(wire, Wire::Tcp),
        stack,
        nodes,
        rounds,
        update_bytes,
        ack_bytes,
        brain_cpu_per_update: brain_cpu / updates,
        node_cpu_per_update: node_cpu / updates,
        round_mean_seconds: total.as_secs_f64() / rounds as f64,
        round_max_seconds: worst.as_secs_f64(),
    })
}

/// The sending side: accept every node, then the rounds. Returns its CPU seconds, the rounds'
/// total and worst wall time.
fn sending_side(
    listener: &TcpListener,
    wire: &Wire,
    nodes_gone: &mut dyn FnMut() -> bool,
    (nodes, update_bytes, ack_bytes, rounds): Sizes,
    started: Instant,
) -> anyhow::Result<(f64, Duration, Duration)> {
    let mut poll = Poll::new()?;
    let mut conns = Vec::with_capacity(nodes);
    while conns.len() < nodes {
        match listener.accept() {
            Ok((s, _)) => conns.push(register(&poll, s, wire, conns.len(), started)?),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if nodes_gone() {
                    bail!("the nodes stopped connecting");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e).context("accepting"),
        }
        if started.elapsed() > LIMIT {
            bail!("connecting took longer than {LIMIT:?}");
        }
    }
    let update = vec![0x5a_u8; update_bytes];
    let mut buf = vec![0_u8; 64 * 1024];
    let mut events = Events::with_capacity(1024);
    let cpu0 = thread_cpu();
    let (mut total, mut worst) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let round = Instant::now();
        for c in conns.iter_mut() {
            c.send(&update)?;
        }
        let mut acked = 0_usize;
        let mut pending_bytes = 0_usize;
        while acked < nodes {
            poll_some(&mut poll, &mut events, started)?;
            for ev in events.iter() {
                let got = conns[ev.token().0].recv(&mut buf)?;
                pending_bytes += got;
                acked += pending_bytes / ack_bytes;
                pending_bytes %= ack_bytes;
            }
        }
        let took = round.elapsed();
        total += took;
        worst = worst.max(took);
    }
    Ok((thread_cpu() - cpu0, total, worst))
}

/// The nodes: connect over `wire` on `stack`, then answer every whole update with an ack.
/// Returns their CPU seconds from the first update on, and their connections: closed only once
/// the sending side is done, which would otherwise read the end of a node's stream while
/// waiting for another's ack. (The tokio stacks return once the sending side closed them.)
fn nodes_side(
    addr: std::net::SocketAddr,
    wire: &Wire,
    stack: Stack,
    sizes: Sizes,
    started: Instant,
) -> anyhow::Result<(f64, Vec<Link>)> {
    if stack != Stack::Epoll {
        return Ok((
            tasks::nodes_side(addr, wire, stack, sizes, started)?,
            Vec::new(),
        ));
    }
    let (nodes, update_bytes, ack_bytes, rounds) = sizes;
    let mut poll = Poll::new()?;
    let mut conns = Vec::with_capacity(nodes);
    for i in 0..nodes {
        let s = TcpStream::connect(addr).context("connecting")?;
        conns.push(register(&poll, s, wire, i, started)?);
    }
    let ack = vec![0xa5_u8; ack_bytes];
    let mut got = vec![0_usize; nodes];
    let mut buf = vec![0_u8; 64 * 1024];
    let mut events = Events::with_capacity(1024);
    let total = nodes * rounds;
    let mut done = 0;
    let mut cpu0 = None;
    while done < total {
        poll_some(&mut poll, &mut events, started)?;
        cpu0.get_or_insert_with(thread_cpu);
        for ev in events.iter() {
            let i = ev.token().0;
            got[i] += conns[i].recv(&mut buf)?;
            while got[i] >= update_bytes {
                got[i] -= update_bytes;
                conns[i].send(&ack)?;
                done += 1;
            }
        }
    }
    Ok((thread_cpu() - cpu0.unwrap_or(0.0), conns))
}

/// `s` over `wire`, past its handshake, registered for reading as token `i`.
fn register(
    poll: &Poll,
    s: TcpStream,
    wire: &Wire,
    i: usize,
    started: Instant,
) -> anyhow::Result<Link> {
    let mut link = Link::open(s, wire, LIMIT.saturating_sub(started.elapsed()))?;
    poll.registry()
        .register(&mut link.stream, Token(i), Interest::READABLE)?;
    Ok(link)
}

fn poll_some(poll: &mut Poll, events: &mut Events, started: Instant) -> anyhow::Result<()> {
    let left = LIMIT.saturating_sub(started.elapsed());
    if left.is_zero() {
        bail!("the measurement took longer than {LIMIT:?}");
    }
    poll.poll(events, Some(left))?;
    Ok(())
}

/// This thread's CPU seconds (user and system).
fn thread_cpu() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    getrusage(UsageWho::RUSAGE_THREAD).map_or(0.0, |u| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
        t(u.user_time()) + t(u.system_time())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_floor_counts_every_update_and_ack() {
        for tls in [false, true] {
            let f = measure(20, 3000, 40, 5, tls, Stack::Epoll).unwrap();
            assert_eq!(
                (f.tls, f.nodes, f.rounds, f.update_bytes, f.ack_bytes),
                (tls, 20, 5, 3000, 40)
            );
            assert!(f.round_mean_seconds > 0.0 && f.round_max_seconds >= f.round_mean_seconds);
            assert!(f.brain_cpu_per_update >= 0.0 && f.node_cpu_per_update >= 0.0);
        }
    }

    /// On tokio, with and without HTTP/2, by `h2` or hyper's server, every update and ack is
    /// counted too, over TLS.
    #[test]
    fn the_floor_on_tokio_counts_every_update_and_ack() {
        for stack in [Stack::Tokio, Stack::H2, Stack::Hyper] {
            let f = measure(20, 3000, 40, 5, false, stack).unwrap();
            assert_eq!(
                (
                    f.tls,
                    f.stack,
                    f.nodes,
                    f.rounds,
                    f.update_bytes,
                    f.ack_bytes
                ),
                (true, stack, 20, 5, 3000, 40)
            );
            assert!(f.round_mean_seconds > 0.0 && f.round_max_seconds >= f.round_mean_seconds);
            assert!(f.brain_cpu_per_update > 0.0 && f.node_cpu_per_update > 0.0);
        }
    }

    #[test]
    fn nothing_to_measure_is_an_error() {
        assert!(measure(0, 3000, 40, 5, false, Stack::Epoll).is_err());
    }
}
