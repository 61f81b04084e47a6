//! Records the commit the bench binary is built from. The brain and the actuators the bench
//! runs are this same binary (it is multi-call), so the report can say which code it measured,
//! and not only which commit was checked out when it ran: a binary built earlier and run from
//! a newer checkout would otherwise be credited to the newer commit.
use std::path::Path;
use std::process::Command;

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
    let commit = git(root, &["rev-parse", "--short", "HEAD"]).unwrap_or_default();
    println!("cargo:rustc-env=SPLITPROXY_BUILD_COMMIT={commit}");
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
