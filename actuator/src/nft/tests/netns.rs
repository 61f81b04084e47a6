//! Runs a test inside a private network namespace, never in the host's.
//!
//! The test body runs on a fresh thread that has called `unshare(CLONE_NEWNET)`: sockets it
//! opens, [`super::super::NftSocket`] included, live in that namespace, which disappears with
//! the thread. `nft` runs through `nsenter --net=/proc/<pid>/task/<tid>/ns/net`, so it sees the
//! same namespace. If the namespace cannot be created, the body does not run at all.

use std::process::Command;

use nix::sched::{CloneFlags, unshare};
use nix::unistd::{Pid, geteuid, gettid};

/// Handle on the namespace of the thread running the test.
pub(crate) struct Netns {
    tid: Pid,
}

impl Netns {
    /// Runs `nft args...` inside the namespace; panics on failure.
    pub(crate) fn nft(&self, args: &[&str]) -> String {
        self.run("nft", args)
    }

    /// Runs `program args...` inside the namespace (`ip`, `conntrack`, ...); panics on failure.
    pub(crate) fn run(&self, program: &str, args: &[&str]) -> String {
        let out = Command::new("nsenter")
            .arg(format!("--net={}", self.path()))
            .arg("--")
            .arg(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("run nsenter {program}: {e}"));
        assert!(
            out.status.success(),
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("output is UTF-8")
    }

    /// The namespace as a path `nsenter --net=` and `ip netns` helpers accept.
    pub(crate) fn path(&self) -> String {
        format!("/proc/{}/task/{}/ns/net", std::process::id(), self.tid)
    }

    /// `nft -j list ruleset`, parsed.
    pub(crate) fn ruleset(&self) -> serde_json::Value {
        serde_json::from_str(&self.nft(&["-j", "list", "ruleset"])).expect("nft JSON")
    }
}

pub(crate) fn tool_works(cmd: &str, arg: &str) -> bool {
    Command::new(cmd)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Runs `body` in a new network namespace and returns its result, or `None` (with a message
/// on stderr) when this environment cannot: not root, `nft`/`nsenter` missing, or no
/// permission to create a namespace.
pub(crate) fn run<T: Send + 'static>(
    test: &str,
    body: impl FnOnce(&Netns) -> T + Send + 'static,
) -> Option<T> {
    if !geteuid().is_root() {
        eprintln!("SKIP {test}: needs root to create a network namespace");
        return None;
    }
    if !tool_works("nft", "--version") || !tool_works("nsenter", "--version") {
        eprintln!("SKIP {test}: `nft` or `nsenter` is not installed");
        return None;
    }
    let test = test.to_owned();
    let handle = std::thread::spawn(move || {
        if let Err(e) = unshare(CloneFlags::CLONE_NEWNET) {
            eprintln!("SKIP {test}: unshare(CLONE_NEWNET) failed: {e}");
            return None;
        }
        Some(body(&Netns { tid: gettid() }))
    });
    match handle.join() {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}
