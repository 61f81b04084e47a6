//! Spawned processes that cannot outlive the test, and bounded wait helpers.
//!
//! A test that panics halfway must not leave etcd, kube-apiserver, brains or actuators running:
//! they would hold ports and keep namespaces alive. [`Child`] therefore stops its process (and
//! the process group it leads) on drop: SIGTERM first so the process can clean up, SIGKILL after
//! a grace period, then reaps it. Output goes to a log file that tests can print on failure.
//!
//! Every wait in the harness goes through [`wait_until`] / [`wait_for`] (or their async forms)
//! so that no loop is unbounded in time.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use crate::Result;

/// Default time between SIGTERM and SIGKILL.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// A spawned process that is terminated and reaped when dropped.
///
/// The process is started as the leader of a new process group, so that helpers it starts are
/// signalled with it.
#[derive(Debug)]
pub struct Child {
    name: String,
    inner: Option<std::process::Child>,
    log: Option<PathBuf>,
    grace: Duration,
    exit: Option<ExitStatus>,
}

impl Child {
    /// Spawns `cmd` in the caller's network namespace with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, cmd: Command, log: &Path) -> Result<Child> {
        let mut cmd = cmd;
        Self::prepare(&mut cmd, log)?;
        let child = cmd
            .spawn()
            .with_context(|| format!("spawning {name} ({:?})", cmd.get_program()))?;
        Ok(Self::from_std(name, child, Some(log.to_path_buf())))
    }

    /// Redirects stdout/stderr of `cmd` to `log`, stdin from /dev/null, and makes the process
    /// lead a new process group. Used by [`Child::spawn`] and `Netns::spawn`.
    pub(crate) fn prepare(cmd: &mut Command, log: &Path) -> Result<()> {
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening log {}", log.display()))?;
        let err = out.try_clone().context("duplicating log file handle")?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .process_group(0);
        Ok(())
    }

    /// Wraps an already spawned process. It must lead its own process group (see
    /// [`CommandExt::process_group`]) if its helpers should be signalled too.
    pub fn from_std(name: &str, child: std::process::Child, log: Option<PathBuf>) -> Child {
        Child {
            name: name.to_string(),
            inner: Some(child),
            log,
            grace: DEFAULT_GRACE,
            exit: None,
        }
    }

    /// Sets the time between SIGTERM and SIGKILL used by [`Child::stop`] and on drop.
    pub fn set_grace(&mut self, grace: Duration) {
        self.grace = grace;
    }

    /// The process id.
    pub fn id(&self) -> Option<u32> {
        self.inner.as_ref().map(std::process::Child::id)
    }

    /// The name given at spawn time (for messages).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The log file receiving stdout and stderr, if any.
    pub fn log_path(&self) -> Option<&Path> {
        self.log.as_deref()
    }

    /// The last `lines` lines of the log file (empty if there is none).
    pub fn log_tail(&self, lines: usize) -> String {
        self.log
            .as_deref()
            .map(|p| log_tail(p, lines))
            .unwrap_or_default()
    }

    /// Returns the exit status if the process has exited, without blocking.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if let Some(status) = self.exit {
            return Ok(Some(status));
        }
        let Some(child) = self.inner.as_mut() else {
            return Ok(None);
        };
        let status = child
            .try_wait()
            .with_context(|| format!("waiting for {}", self.name))?;
        self.exit = status;
        Ok(status)
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.try_wait(), Ok(None))
    }

    /// Sends `signal` to the process group led by the process.
    pub fn signal(&mut self, signal: Signal) -> Result<()> {
        if self.try_wait()?.is_some() {
            bail!("{} has already exited", self.name);
        }
        let pid = self.pid().context("process already reaped")?;
        killpg(pid, signal).with_context(|| format!("sending {signal} to {}", self.name))?;
        Ok(())
    }

    fn pid(&self) -> Option<Pid> {
        self.id()
            .and_then(|id| i32::try_from(id).ok())
            .map(Pid::from_raw)
    }

    /// Stops the process: SIGTERM to its process group, SIGKILL after the grace period, then
    /// reaps it. Returns its exit status. Calling it again returns the same status.
    pub fn stop(&mut self) -> Result<Option<ExitStatus>> {
        let Some(pid) = self.pid() else {
            return Ok(self.exit);
        };
        if self.try_wait()?.is_none() {
            let _ = killpg(pid, Signal::SIGTERM);
            let deadline = Instant::now() + self.grace;
            while Instant::now() < deadline && self.try_wait()?.is_none() {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // Also catches helpers left in the group after the leader exited.
        let _ = killpg(pid, Signal::SIGKILL);
        if let Some(mut child) = self.inner.take()
            && self.exit.is_none()
        {
            self.exit = Some(
                child
                    .wait()
                    .with_context(|| format!("reaping {}", self.name))?,
            );
        }
        Ok(self.exit)
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Err(err) = self.stop() {
            eprintln!("[splitproxy-tests] stopping {}: {err:#}", self.name);
        }
    }
}

/// The last `lines` lines of the file at `path` (reads at most the last 256 KiB).
pub fn log_tail(path: &Path, lines: usize) -> String {
    const MAX: u64 = 256 * 1024;
    let Ok(mut file) = File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    if len > MAX && file.seek(SeekFrom::Start(len - MAX)).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    if file.read_to_end(&mut buf).is_err() {
        return String::new();
    }
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Polls `f` every `poll` until it returns true; fails after `timeout`.
pub fn wait_until<F>(timeout: Duration, poll: Duration, mut f: F) -> Result<()>
where
    F: FnMut() -> bool,
{
    wait_for(timeout, poll, || f().then_some(()))
}

/// Polls `f` every `poll` until it returns `Some`; fails after `timeout`.
pub fn wait_for<T, F>(timeout: Duration, poll: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Option<T>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = f() {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("condition not met within {timeout:?}");
        }
        std::thread::sleep(poll);
    }
}

/// Async form of [`wait_until`]: polls the future-returning `f` until it yields true.
pub async fn wait_until_async<F, Fut>(timeout: Duration, poll: Duration, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if tokio::time::timeout_at(deadline, f()).await == Ok(true) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("condition not met within {timeout:?}");
        }
        tokio::time::sleep(poll).await;
    }
}

/// Waits until a TCP connection to `addr` (in the caller's namespace) succeeds.
pub fn wait_for_port(addr: SocketAddr, timeout: Duration) -> Result<()> {
    wait_until(timeout, Duration::from_millis(50), || {
        TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
    })
    .with_context(|| format!("nothing listens on {addr}"))
}

/// Picks a currently free TCP port on 127.0.0.1 of the caller's namespace.
///
/// The port is released before returning, so another process may take it first; callers that
/// hand it to a server should be prepared to retry.
pub fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}
