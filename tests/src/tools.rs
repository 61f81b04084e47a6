//! Locating the pinned third-party binaries (etcd, kube-apiserver, grpcurl, ...).
//!
//! The binaries are built from the Go module proxy by `tools/build-tools.sh` at pinned versions
//! and cached outside the repository, because distribution packages are too old (Debian's etcd
//! 3.4 cannot serve kube-apiserver 1.37) and downloading release tarballs is not an option here.
//! Tests call [`binary`] and get a path; a missing binary is built on first use, and a build that
//! is already running (for instance one started by hand in the background) is waited for rather
//! than started a second time, since the Kubernetes builds take tens of minutes.

use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::fcntl::{Flock, FlockArg};

use crate::Result;

/// Environment variable that overrides the cache root (default `~/.cache/splitproxy-tools`).
pub const CACHE_ENV: &str = "SPLITPROXY_TOOLS_CACHE";

/// How long [`binary`] waits for a build that another process is already running.
const WAIT_FOR_FOREIGN_BUILD: Duration = Duration::from_secs(90 * 60);

/// Serialises builds inside this process; the file lock below serialises them across processes.
static BUILD_LOCK: Mutex<()> = Mutex::new(());

/// The root of the binary cache: `$SPLITPROXY_TOOLS_CACHE` or `~/.cache/splitproxy-tools`.
pub fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os(CACHE_ENV).filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/splitproxy-tools")
}

/// The workspace root, found from this crate's manifest directory.
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Where the cache links binary `name` (whether or not it exists yet).
pub fn cached_path(name: &str) -> PathBuf {
    cache_root().join("bin").join(name)
}

/// Returns the path of the pinned binary `name`, building it with `tools/build-tools.sh <name>`
/// if it is not in the cache yet.
///
/// If another process is already running `build-tools.sh` (or a `go build` into the cache's
/// `<name>-*.partial` directory), this waits for it to finish instead of starting a competing
/// build, and builds only if the binary is still missing afterwards.
pub fn binary(name: &str) -> Result<PathBuf> {
    binary_in(&cache_root(), name)
}

/// A `grpcurl` command that authenticates the brain with `tls.ca` and itself with `tls`'s
/// certificate, as an operator's copyable command does; the caller adds the rest.
pub fn grpcurl(tls: &crate::certs::TlsFiles) -> Result<std::process::Command> {
    let mut cmd = std::process::Command::new(binary("grpcurl")?);
    cmd.arg("-cacert")
        .arg(&tls.ca)
        .arg("-cert")
        .arg(&tls.cert)
        .arg("-key")
        .arg(&tls.key);
    Ok(cmd)
}

/// [`binary`] with an explicit cache root instead of [`cache_root`].
pub fn binary_in(root: &Path, name: &str) -> Result<PathBuf> {
    if name.is_empty() || name.contains('/') {
        bail!("invalid tool name {name:?}");
    }
    let path = root.join("bin").join(name);
    if is_executable(&path) {
        return Ok(path);
    }

    let _in_process = BUILD_LOCK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if is_executable(&path) {
        return Ok(path);
    }

    wait_for_foreign_build(root, name, &path)?;
    if is_executable(&path) {
        return Ok(path);
    }

    fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    let lock_path = root.join(format!(".build-{name}.lock"));
    let lock_file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("opening {}", lock_path.display()))?;
    let _cross_process: Flock<File> = Flock::lock(lock_file, FlockArg::LockExclusive)
        .map_err(|(_, errno)| anyhow::anyhow!("locking {}: {errno}", lock_path.display()))?;
    if is_executable(&path) {
        return Ok(path);
    }

    let script = workspace_root().join("tools/build-tools.sh");
    eprintln!(
        "[splitproxy-tests] {name} is not in {}; building it with {} (this can take tens of minutes)",
        root.display(),
        script.display()
    );
    let status = Command::new("bash")
        .arg(&script)
        .arg(name)
        .env(CACHE_ENV, root)
        .stdout(std::process::Stdio::null())
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("{} {name} failed: {status}", script.display());
    }
    if !is_executable(&path) {
        bail!(
            "{} {name} succeeded but {} is missing",
            script.display(),
            path.display()
        );
    }
    Ok(path)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Waits (bounded) while some other process builds `name` into the cache.
fn wait_for_foreign_build(root: &Path, name: &str, path: &Path) -> Result<()> {
    let needle = format!("{}/{name}-", root.display());
    let started = Instant::now();
    let mut announced = false;
    while foreign_build_running(&needle) {
        if is_executable(path) {
            return Ok(());
        }
        if started.elapsed() > WAIT_FOR_FOREIGN_BUILD {
            bail!(
                "a build of the tools has been running for more than {:?}; giving up on {name}",
                WAIT_FOR_FOREIGN_BUILD
            );
        }
        if !announced {
            eprintln!("[splitproxy-tests] waiting for a running build of {name} to finish");
            announced = true;
        }
        std::thread::sleep(Duration::from_secs(5));
    }
    Ok(())
}

/// Whether another process runs `build-tools.sh` (for any set of tools: two runs must never
/// share the cache's `.partial` directories), or a command whose line contains `needle` and
/// `.partial` (a `go build` writing into the cache).
fn foreign_build_running(needle: &str) -> bool {
    let Ok(entries) = fs::read_dir("/proc") else {
        return false;
    };
    let me = std::process::id().to_string();
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name.to_str() else {
            continue;
        };
        if pid == me || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(cmdline) = fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        let args: Vec<&str> = cmdline.split('\0').collect();
        if runs_build_script(&args) || (cmdline.contains(needle) && cmdline.contains(".partial")) {
            return true;
        }
    }
    false
}

/// Whether `args` (a process's argv) is an execution of `build-tools.sh` (directly or through
/// a shell), as opposed to, say, an editor that has the script open.
fn runs_build_script(args: &[&str]) -> bool {
    let base = |arg: &str| arg.rsplit('/').next().unwrap_or_default().to_string();
    match args {
        [program, ..] if base(program) == "build-tools.sh" => true,
        [shell, script, ..] => {
            matches!(base(shell).as_str(), "bash" | "sh") && base(script) == "build-tools.sh"
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_build_script_runs_only() {
        assert!(runs_build_script(&[
            "bash",
            "tools/build-tools.sh",
            "bench"
        ]));
        assert!(runs_build_script(&["/bin/sh", "/w/tools/build-tools.sh"]));
        assert!(runs_build_script(&["/w/tools/build-tools.sh", "etcd"]));
        assert!(!runs_build_script(&["vim", "tools/build-tools.sh"]));
        assert!(!runs_build_script(&["bash"]));
        assert!(!runs_build_script(&[]));
    }
}
