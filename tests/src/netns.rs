//! Network namespaces owned by a test.
//!
//! Every dataplane test runs its nftables, routes, interfaces and traffic inside namespaces it
//! created, never in the host namespace. A [`Netns`] is a named namespace (`ip netns add`, so
//! `ip netns exec` and `nsenter --net=/run/netns/NAME` work for debugging) that is deleted when
//! dropped, also during a panic.
//!
//! Names are `sp-<label>-<pid>x<counter>`: unique across parallel tests in one process (the
//! counter) and across processes (the pid). The pid also lets [`cleanup_stale`] remove
//! namespaces left behind by a test process that was killed before its destructors ran.
//!
//! Code runs inside a namespace in two ways: commands through `ip netns exec` ([`Netns::exec`])
//! or processes forked from a thread inside it ([`Netns::spawn`]), and closures on a fresh thread
//! that has entered it ([`Netns::run`]). Sockets created by such a closure stay in the namespace
//! for their whole life, so they can be returned and used from any thread or tokio runtime.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use nix::sched::{CloneFlags, setns};

use crate::Result;
use crate::process::{self, Child};

/// Prefix of every namespace the harness creates.
pub const PREFIX: &str = "sp-";

static COUNTER: AtomicU32 = AtomicU32::new(0);
static SWEEP: Once = Once::new();

/// A network namespace that is deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    path: PathBuf,
    /// Whether dropping this value deletes the namespace (false for a [`Netns::handle`]).
    owned: bool,
}

impl Netns {
    /// Creates a namespace named `sp-<label>-<unique suffix>` with `lo` up.
    ///
    /// `label` is shortened to 16 characters of `[a-z0-9-]`; it only helps humans reading
    /// `ip netns list`.
    pub fn create(label: &str) -> Result<Netns> {
        SWEEP.call_once(cleanup_stale);
        let label = sanitize(label);
        let pid = std::process::id();
        // A leftover namespace of a recycled pid could hold the name; skip to the next counter.
        for _ in 0..16 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let name = format!("{PREFIX}{label}-{pid}x{n}");
            let out = Command::new("ip")
                .args(["netns", "add", &name])
                .output()
                .context("running ip netns add")?;
            if !out.status.success() {
                let stderr = String::from_utf8_lossy(&out.stderr);
                if stderr.contains("exists") {
                    continue;
                }
                bail!("ip netns add {name}: {}", stderr.trim());
            }
            let ns = Netns {
                path: PathBuf::from("/run/netns").join(&name),
                name,
                owned: true,
            };
            ns.ip(&["link", "set", "lo", "up"])?;
            return Ok(ns);
        }
        bail!("could not find a free namespace name for label {label:?}")
    }

    /// The namespace name (as shown by `ip netns list`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace file, `/run/netns/NAME`, for `nsenter --net=` or `setns`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `cmd` inside the namespace with `ip netns exec` and returns its output, whatever
    /// its exit status.
    pub fn exec(&self, cmd: &[&str]) -> Result<Output> {
        let Some((program, args)) = cmd.split_first() else {
            bail!("empty command");
        };
        Command::new("ip")
            .args(["netns", "exec", &self.name, program])
            .args(args)
            .output()
            .with_context(|| format!("running {cmd:?} in {}", self.name))
    }

    /// Like [`Netns::exec`] but fails on a non-zero exit status, with stderr in the error;
    /// returns stdout.
    pub fn exec_ok(&self, cmd: &[&str]) -> Result<String> {
        let out = self.exec(cmd)?;
        check_output(&out, || format!("{cmd:?} in {}", self.name))
    }

    /// Runs `ip -n NAME <args>`, failing on a non-zero exit status; returns stdout.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("ip")
            .args(["-n", &self.name])
            .args(args)
            .output()
            .context("running ip")?;
        check_output(&out, || format!("ip -n {} {}", self.name, args.join(" ")))
    }

    /// Runs several `ip` commands in this namespace with one `ip -n NAME -batch -` process (one
    /// command per entry, without the leading `ip`; the address family follows from the
    /// addresses). Stops at the first failing command and reports it.
    pub fn ip_batch(&self, commands: &[String]) -> Result<()> {
        use std::io::Write;
        if commands.is_empty() {
            return Ok(());
        }
        let mut child = Command::new("ip")
            .args(["-n", &self.name, "-batch", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("running ip -batch")?;
        let mut input = commands.join("\n");
        input.push('\n');
        child
            .stdin
            .take()
            .context("ip -batch has no stdin")?
            .write_all(input.as_bytes())
            .context("writing to ip -batch")?;
        let out = child.wait_with_output().context("waiting for ip -batch")?;
        check_output(&out, || {
            format!("ip -n {} -batch [{}]", self.name, commands.join("; "))
        })
        .map(drop)
    }

    /// Sets a sysctl of this namespace, e.g. `sysctl("net/ipv4/ip_forward", "1")` or
    /// `sysctl("net.ipv4.ip_forward", "1")`. Only `net.*` keys are namespaced, so only those are
    /// accepted.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        let key = key.replace('.', "/");
        if !key.starts_with("net/") {
            bail!("refusing to set non-namespaced sysctl {key}");
        }
        let path = PathBuf::from("/proc/sys").join(&key);
        let value = value.to_string();
        self.run(move || std::fs::write(&path, value))?
            .with_context(|| format!("setting {key} in {}", self.name))
    }

    /// Spawns `cmd` inside the namespace (forked from a thread that entered it), with stdout
    /// and stderr appended to `log`, as a [`Child`] that is stopped on drop.
    ///
    /// Unlike `ip netns exec`, this does not remount `/sys` for the namespace; programs that use
    /// netlink and `/proc/sys/net` (which follow the caller's namespace) are unaffected.
    pub fn spawn(&self, name: &str, cmd: Command, log: &Path) -> Result<Child> {
        let mut cmd = cmd;
        Child::prepare(&mut cmd, log)?;
        let child = self
            .run(move || cmd.spawn())?
            .with_context(|| format!("spawning {name} in {}", self.name))?;
        Ok(Child::from_std(name, child, Some(log.to_path_buf())))
    }

    /// A handle on a namespace someone else made and deletes (`/run/netns/NAME`), e.g. a node
    /// of `tools/cluster.sh`; dropping it deletes nothing.
    pub fn existing(name: &str) -> Result<Netns> {
        let path = PathBuf::from("/run/netns").join(name);
        if !path.exists() {
            bail!("no network namespace {name}");
        }
        Ok(Netns {
            name: name.to_string(),
            path,
            owned: false,
        })
    }

    /// A second handle on this namespace that does not delete it when dropped, for work that
    /// outlives a borrow (a background task); the owner still deletes it.
    pub fn handle(&self) -> Netns {
        Netns {
            name: self.name.clone(),
            path: self.path.clone(),
            owned: false,
        }
    }

    /// Runs `f` on a fresh thread that has entered this namespace and returns its result.
    ///
    /// Sockets created by `f` belong to the namespace for their whole life and may be returned
    /// and used anywhere. A panic in `f` is propagated to the caller. The thread ends after `f`,
    /// so no other code ever runs in the namespace by accident.
    pub fn run<F, T>(&self, f: F) -> Result<T>
    where
        F: FnOnce() -> T + Send,
        T: Send,
    {
        let path = &self.path;
        std::thread::scope(|scope| {
            let handle = scope.spawn(move || -> Result<T> {
                enter(path)?;
                Ok(f())
            });
            match handle.join() {
                Ok(result) => result,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// Async form of [`Netns::run`]: the closure runs on a fresh thread inside the namespace and
    /// the caller's task awaits it without blocking its runtime.
    pub async fn run_async<F, T>(&self, f: F) -> Result<T>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let path = self.path.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name(format!("netns-{}", self.name))
            .spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    enter(&path).map(|()| f())
                }));
                let _ = tx.send(result);
            })
            .context("spawning namespace thread")?;
        match rx.await.context("namespace thread vanished")? {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// Waits until a TCP connection to `addr`, made from inside the namespace, succeeds.
    pub fn wait_for_port(&self, addr: std::net::SocketAddr, timeout: Duration) -> Result<()> {
        process::wait_until(timeout, Duration::from_millis(50), || {
            self.run(|| {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            })
            .unwrap_or(false)
        })
        .with_context(|| format!("nothing listens on {addr} in {}", self.name))
    }
}

impl AsRef<Netns> for Netns {
    fn as_ref(&self) -> &Netns {
        self
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if let Err(err) = delete(&self.name) {
            eprintln!("[splitproxy-tests] {err:#}");
        }
    }
}

/// Moves the calling thread into the namespace at `path` and checks that it arrived.
///
/// The check compares the thread's own namespace inode with the file's, so that a failed or
/// skipped `setns` can never let namespace-only work (sysctls, routes) reach the host.
pub(crate) fn enter(path: &Path) -> Result<()> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    setns(&file, CloneFlags::CLONE_NEWNET).with_context(|| format!("setns {}", path.display()))?;
    let want = file.metadata().context("stat namespace file")?;
    let have = std::fs::metadata("/proc/thread-self/ns/net").context("stat own namespace")?;
    if (want.dev(), want.ino()) != (have.dev(), have.ino()) {
        bail!("thread did not enter {}", path.display());
    }
    Ok(())
}

fn delete(name: &str) -> Result<()> {
    let out = Command::new("ip")
        .args(["netns", "delete", name])
        .output()
        .context("running ip netns delete")?;
    check_output(&out, || format!("ip netns delete {name}")).map(drop)
}

fn check_output(out: &Output, what: impl FnOnce() -> String) -> Result<String> {
    if !out.status.success() {
        bail!(
            "{} failed ({}): {}{}",
            what(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn sanitize(label: &str) -> String {
    let cleaned: String = label
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(16)
        .collect();
    if cleaned.is_empty() {
        "ns".to_string()
    } else {
        cleaned
    }
}

/// Names of all namespaces currently listed by `ip netns list`.
pub fn list() -> Result<Vec<String>> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .context("running ip netns list")?;
    let text = check_output(&out, || "ip netns list".to_string())?;
    Ok(text
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_string)
        .collect())
}

/// Deletes harness namespaces whose creating process no longer exists.
///
/// Destructors do not run when a test process is killed (SIGKILL, timeout), so each process
/// sweeps once before creating its first namespace. Only names of the exact form
/// `sp-<label>-<pid>x<counter>` whose pid is not running are deleted.
pub fn cleanup_stale() {
    let Ok(names) = list() else {
        return;
    };
    for name in names {
        let Some(pid) = owner_pid(&name) else {
            continue;
        };
        if Path::new("/proc").join(pid.to_string()).exists() {
            continue;
        }
        if let Err(err) = delete(&name) {
            eprintln!("[splitproxy-tests] removing stale namespace: {err:#}");
        }
    }
}

/// The pid encoded in a harness namespace name, if `name` has the harness's form.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX)?;
    let (_, suffix) = rest.rsplit_once('-')?;
    let (pid, counter) = suffix.split_once('x')?;
    if pid.is_empty() || counter.is_empty() || !counter.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pid_parses_only_harness_names() {
        assert_eq!(owner_pid("sp-node-0-1234x7"), Some(1234));
        assert_eq!(owner_pid("sp-a-1x0"), Some(1));
        assert_eq!(owner_pid("sp-node-1234"), None);
        assert_eq!(owner_pid("other-1234x7"), None);
        assert_eq!(owner_pid("sp-a-12x"), None);
        assert_eq!(owner_pid("sp-a-x3"), None);
    }

    #[test]
    fn sanitize_keeps_names_short_and_safe() {
        assert_eq!(sanitize("Pod_A/1"), "pod-a-1");
        assert_eq!(sanitize(""), "ns");
        assert_eq!(sanitize("a-very-long-label-indeed").len(), 16);
    }
}
