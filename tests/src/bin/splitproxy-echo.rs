//! `splitproxy-echo`: the test server and client that real clusters run as pods.
//!
//! The lab starts its pod servers in-process ([`splitproxy_tests::podserver`]); on a cluster
//! with real kubelets the same server must be a container image, and probes must come from
//! inside pods (`kubectl exec`), as a user's traffic would. Both sides are the lab's own code,
//! so an answer means the same thing on either:
//!
//! - `splitproxy-echo serve --name NAME --tcp 8080 --udp 8080` answers every TCP connection and
//!   UDP datagram with `<name> <local address> <peer address>`; it runs until SIGTERM (as PID 1
//!   of a container, a signal with its default action would be ignored, so it is handled),
//!   and `--drain-seconds` longer.
//! - `splitproxy-echo probe tcp|udp ADDRESS:PORT [--count N] [--interval-ms MS]` sends N probes
//!   one after the other (a bounded connection loop) and prints one JSON line per probe (answered by whom and from which
//!   source seen, refused, dropped), as `tools/lab.sh probe` does.
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use splitproxy_tests::podserver::PodServer;
use splitproxy_tests::probe::{Proto, probe_here};

#[derive(Debug, Parser)]
#[command(
    name = "splitproxy-echo",
    version,
    about = "Test server and client for pods"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Answer connections and datagrams with who answered and whom it saw.
    Serve {
        /// The name answered with (the pod's name, from the downward API).
        #[arg(long, env = "POD_NAME")]
        name: String,
        /// TCP ports to serve.
        #[arg(long = "tcp")]
        tcp: Vec<u16>,
        /// UDP ports to serve.
        #[arg(long = "udp")]
        udp: Vec<u16>,
        /// After SIGTERM, go on serving this long before exiting, as a well-behaved server
        /// does while its endpoint turns terminating and the Service proxies stop sending it
        /// new connections (set below the pod's terminationGracePeriodSeconds).
        #[arg(long, default_value_t = 0)]
        drain_seconds: u64,
    },
    /// Probe a destination and print one JSON line per probe.
    Probe {
        proto: Proto,
        destination: SocketAddr,
        /// Probes sent, one after the other (at most 1,000).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
        count: u32,
        /// How long each probe waits for its answer.
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
        /// Pause between two probes: with `--count`, a bounded connection loop.
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
    },
}

fn main() -> anyhow::Result<()> {
    match Args::parse().command {
        Command::Serve {
            name,
            tcp,
            udp,
            drain_seconds,
        } => {
            anyhow::ensure!(!tcp.is_empty() || !udp.is_empty(), "no port to serve");
            let server = PodServer::start_here(&name, &tcp, &udp)?;
            eprintln!(
                "splitproxy-echo {name}: tcp {:?} udp {:?}",
                server.tcp_addrs(),
                server.udp_addrs()
            );
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("building the signal runtime")?
                .block_on(async {
                    let mut term =
                        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = tokio::signal::ctrl_c() => {}
                    }
                    eprintln!("splitproxy-echo {name}: terminating in {drain_seconds} s");
                    tokio::time::sleep(Duration::from_secs(drain_seconds)).await;
                    anyhow::Ok(())
                })?;
            drop(server);
            Ok(())
        }
        Command::Probe {
            proto,
            destination,
            count,
            timeout_ms,
            interval_ms,
        } => {
            let timeout = Duration::from_millis(timeout_ms);
            for i in 0..count {
                if i > 0 {
                    std::thread::sleep(Duration::from_millis(interval_ms));
                }
                println!(
                    "{}",
                    probe_here(proto, destination, None, timeout).to_json()
                );
            }
            Ok(())
        }
    }
}
