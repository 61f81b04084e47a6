//! What the run ran on: machine and versions, for the result and the report.
use std::process::Command;

use crate::results::{Machine, Versions};

pub fn machine() -> Machine {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_bytes = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024;
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string())
        .unwrap_or_default();
    Machine {
        nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
        memory_bytes,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        cpu_model,
    }
}

/// First line of `bin --version`, or "" when it cannot run.
fn version_of(tool: &str) -> String {
    let Ok(bin) = splitproxy_tests::tools::binary(tool) else {
        return String::new();
    };
    Command::new(bin)
        .arg("--version")
        .output()
        .ok()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned()
                + &String::from_utf8_lossy(&o.stderr);
            let line = text.lines().next().unwrap_or_default().trim();
            // "Kubernetes v1.37.2", "etcd Version: 3.6.16": keep the version.
            line.rsplit(' ').next().unwrap_or(line).to_string()
        })
        .unwrap_or_default()
}

pub fn versions(kube_proxy: bool) -> Versions {
    let git_commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(splitproxy_tests::tools::workspace_root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    Versions {
        splitproxy: env!("CARGO_PKG_VERSION").to_string(),
        kubernetes: version_of("kube-apiserver"),
        kube_proxy: if kube_proxy {
            version_of("kube-proxy")
        } else {
            "not run".into()
        },
        etcd: version_of("etcd"),
        git_commit,
        build_commit: env!("SPLITPROXY_BUILD_COMMIT").to_string(),
    }
}
