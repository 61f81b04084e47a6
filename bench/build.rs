//! Records the commit the bench binary is built from. The brain and the actuators the bench
//! runs are this same binary (it is multi-call), so the report can say which code it measured,
//! and not only which commit was checked out when it ran: a binary built earlier and run from
//! a newer checkout would otherwise be credited to the newer commit. A tree with uncommitted
//! changes to the code the binary is built from gives the commit a `-dirty` suffix (as `git
//! describe --dirty` does): `tools/bench.sh` builds before it runs, so an edit made while a
//! series of runs goes on (`tools/bench-scaling.sh`) would otherwise be credited to the commit.
use std::path::Path;
use std::process::Command;

/// What the binary is built from, relative to the workspace root.
const CODE: [&str; 9] = [
    "Cargo.toml",
    "Cargo.lock",
    "proto",
    "brain/src",
    "brain/Cargo.toml",
    "actuator/src",
    "actuator/Cargo.toml",
    "bench/src",
    "bench/Cargo.toml",
];

fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(root)
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let root = Path::new(&manifest).parent().unwrap_or(Path::new("."));
    let mut commit = git(root, &["rev-parse", "--short", "HEAD"]).unwrap_or_default();
    let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
    status.extend(CODE);
    if !commit.is_empty() && git(root, &status).is_some_and(|s| !s.is_empty()) {
        commit.push_str("-dirty");
    }
    println!("cargo:rustc-env=SPLITPROXY_BUILD_COMMIT={commit}");
    // Built again when the code changes, to say whether it still differs from the commit.
    for path in CODE.iter().map(|p| root.join(p)).filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    // Built again when HEAD moves: a new commit on the branch (its ref, loose or packed), or
    // another branch checked out. Only paths that exist: cargo takes a missing one for changed
    // and would run this again, and rebuild the crate, on every build.
    if let Some(dir) = git(root, &["rev-parse", "--absolute-git-dir"]) {
        let mut watched = vec![format!("{dir}/HEAD"), format!("{dir}/packed-refs")];
        if let Some(head) = git(root, &["symbolic-ref", "-q", "HEAD"]) {
            watched.push(format!("{dir}/{head}"));
            // A branch whose ref is packed gets a loose file at its next commit.
            if let Some((parent, _)) = head.rsplit_once('/') {
                watched.push(format!("{dir}/{parent}"));
            }
        }
        for path in watched.iter().filter(|p| Path::new(p).exists()) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
