//! The floor with each side in a process of its own (`splitproxy-bench floor`).
//!
//! N streams take 2N descriptors, N on each side, and the benchmark's own process already holds
//! the virtual fleet's N streams while the floor runs. Where the hard open-file limit cannot be
//! raised (20,000 on this project's machines, also as root), 10,000 nodes did not fit in one
//! process: the floor went unmeasured at the largest size, the one it matters most at. So the
//! benchmark runs the sending side in a child process, which runs the nodes' side in a child of
//! its own: each side holds N streams and nothing else.
use std::io::{BufRead, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};

use super::link::{self, Wire};
use super::{Floor, NodesSide, Sizes, Stack, measure_with, nodes_side};

/// `splitproxy-bench floor`: one side of the floor measurement, for the benchmark to spawn.
#[derive(Debug, Clone, clap::Args)]
pub struct FloorArgs {
    /// Streams, one per node.
    #[arg(long)]
    pub nodes: usize,
    /// Bytes of each update.
    #[arg(long)]
    pub update_bytes: usize,
    /// Bytes of each ack.
    #[arg(long)]
    pub ack_bytes: usize,
    /// Rounds (an update to every node and its ack).
    #[arg(long)]
    pub rounds: usize,
    /// Every stream over TLS (the sending side makes a certificate and passes it on).
    #[arg(long)]
    pub tls: bool,
    /// What carries the rounds above the sockets (the tokio stacks always run over TLS).
    #[arg(long, value_enum, default_value_t = Stack::Epoll)]
    pub stack: Stack,
    /// The nodes' side over TLS: the sending side's certificate, DER in hex.
    #[arg(long)]
    pub trust: Option<String>,
    /// Be the nodes' side of the sending side listening here. Without it: the sending side,
    /// which starts the nodes' side and prints the [`Floor`] as one line of JSON.
    #[arg(long)]
    pub nodes_of: Option<SocketAddr>,
}

/// Runs the side `args` names. The sending side prints the [`Floor`] as JSON; the nodes' side
/// prints its CPU seconds once every update is acked, then keeps its streams open until its
/// standard input closes (the sending side closes it once it is done with them).
pub fn command(args: &FloorArgs) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    let sizes = (args.nodes, args.update_bytes, args.ack_bytes, args.rounds);
    match args.nodes_of {
        Some(addr) => {
            let wire = match &args.trust {
                Some(der) => link::tls_client(&hex::decode(der).context("--trust")?)?,
                None => Wire::Tcp,
            };
            let (cpu, conns) = nodes_side(addr, &wire, args.stack, sizes, Instant::now())?;
            writeln!(out, "{cpu}")?;
            out.flush()?;
            std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink())?;
            drop(conns);
        }
        None => {
            let exe = std::env::current_exe().context("locating this binary")?;
            let (wire, trust) = if args.tls || args.stack != Stack::Epoll {
                let (wire, der) = link::tls_server()?;
                (wire, Some(hex::encode(der)))
            } else {
                (Wire::Tcp, None)
            };
            let f = measure_with(sizes, &wire, args.stack, |addr, _| {
                Ok(Box::new(Process::start(
                    &exe, sizes, args.stack, trust, addr,
                )?))
            })?;
            writeln!(out, "{}", serde_json::to_string(&f)?)?;
        }
    }
    Ok(())
}

/// Runs the measurement on `stack`, over TLS if `tls` (the tokio stacks always are), in
/// processes of its own (see the module's documentation), from this binary; blocking. Both
/// sides end within the floor's time limit, so this does too.
pub fn measure_apart(
    nodes: usize,
    update_bytes: usize,
    ack_bytes: usize,
    rounds: usize,
    tls: bool,
    stack: Stack,
) -> anyhow::Result<Floor> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let out = Command::new(exe)
        .arg("floor")
        .args(side_args((nodes, update_bytes, ack_bytes, rounds), stack))
        .args(tls.then_some("--tls"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .context("running the floor's sending side")?;
    if !out.status.success() {
        bail!(
            "the floor's processes failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let line = out.stdout.lines().map_while(Result::ok).last();
    serde_json::from_str(line.as_deref().unwrap_or_default()).context("reading the floor's result")
}

fn side_args((nodes, update_bytes, ack_bytes, rounds): Sizes, stack: Stack) -> Vec<String> {
    let stack = clap::ValueEnum::to_possible_value(&stack)
        .map(|v| v.get_name().to_string())
        .unwrap_or_default();
    let mut args: Vec<String> = [
        ("--nodes", nodes),
        ("--update-bytes", update_bytes),
        ("--ack-bytes", ack_bytes),
        ("--rounds", rounds),
    ]
    .into_iter()
    .flat_map(|(flag, n)| [flag.to_string(), n.to_string()])
    .collect();
    args.extend(["--stack".to_string(), stack]);
    args
}

/// The nodes' side as a child process.
struct Process {
    child: Child,
    /// Closed to end it once the sending side is done.
    stdin: Option<ChildStdin>,
}

impl Process {
    fn start(
        exe: &std::path::Path,
        sizes: Sizes,
        stack: Stack,
        trust: Option<String>,
        addr: SocketAddr,
    ) -> anyhow::Result<Self> {
        let mut child = Command::new(exe)
            .arg("floor")
            .args(side_args(sizes, stack))
            .args(
                trust
                    .map(|der| ["--trust".to_string(), der])
                    .into_iter()
                    .flatten(),
            )
            .arg("--nodes-of")
            .arg(addr.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the nodes' side")?;
        let stdin = child.stdin.take();
        Ok(Process { child, stdin })
    }
}

impl NodesSide for Process {
    fn ended(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)) | Err(_))
    }

    fn finish(mut self: Box<Self>) -> anyhow::Result<f64> {
        drop(self.stdin.take());
        let mut printed = String::new();
        if let Some(mut stdout) = self.child.stdout.take() {
            stdout.read_to_string(&mut printed)?;
        }
        let status = self.child.wait()?;
        if !status.success() {
            bail!("exited with {status}");
        }
        printed
            .trim()
            .parse()
            .with_context(|| format!("reading its CPU seconds from {printed:?}"))
    }
}

impl Drop for Process {
    /// A side that is still running when the measurement fails is not left behind.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
