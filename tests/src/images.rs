//! splitproxy's images as the tests use them: built by `tools/image.sh`, exactly as a user
//! builds them, so that the chart's tests and the real cluster run what ships.
use std::path::Path;
use std::process::Command;

use crate::tools;

/// Runs `tools/image.sh --out OUT [--repository REPOSITORY]`; returns its report lines (name,
/// tag, manifest digest, archive). Panics when it fails: every caller is a test.
pub fn build(out: &Path, repository: Option<&str>) -> Vec<Vec<String>> {
    // A plain environment: the variables cargo sets for a test process would make the release
    // build differ from one run by hand, and rebuild every time the two alternate.
    let mut cmd = Command::new(tools::workspace_root().join("tools/image.sh"));
    cmd.env_clear();
    for var in [
        "PATH",
        "HOME",
        "TMPDIR",
        "CARGO_HOME",
        "RUSTUP_HOME",
        "CARGO_TARGET_DIR",
        tools::CACHE_ENV,
    ] {
        if let Some(value) = std::env::var_os(var) {
            cmd.env(var, value);
        }
    }
    cmd.arg("--out").arg(out);
    if let Some(repository) = repository {
        cmd.args(["--repository", repository]);
    }
    let output = cmd.output().expect("running tools/image.sh");
    assert!(
        output.status.success(),
        "tools/image.sh failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}
