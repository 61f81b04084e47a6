//! A real Kubernetes cluster for tests: `tools/cluster.sh` (real kubelets, containerd, the
//! controller manager and the scheduler, every daemon in namespaces the script creates) driven
//! from Rust, and stopped when the value is dropped, also when the test panics.
//!
//! The lab (`crate::lab`) runs brains and actuators as processes; this runs them as the chart's
//! pods, pulled by no one (the images are imported into every node's containerd), so that the
//! chart's probes, RBAC, identity and host networking meet real kubelets. Tests talk to it the
//! way a user does: `kubectl` and `helm` (through the script), `kubectl exec` into client pods
//! for traffic, and the nodes' metrics ports for what the actuators measured.
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::Result;
use crate::probe::ProbeResult;
use crate::tools::workspace_root;

/// A running cluster; `tools/cluster.sh stop` on drop.
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    prefix: String,
    nodes: usize,
    stopped: bool,
}

/// The addressing `tools/cluster.sh` uses.
pub const API_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);

impl Cluster {
    /// Starts a cluster of `nodes` kubelet nodes with its state under `dir` and its namespaces
    /// named `<prefix>-...`. Fails (having stopped what started) when it is not up in time.
    pub fn start(dir: &Path, prefix: &str, nodes: usize) -> Result<Cluster> {
        let mut cluster = Cluster {
            dir: dir.to_path_buf(),
            prefix: prefix.to_string(),
            nodes,
            stopped: false,
        };
        let out = cluster.script(&["start", &nodes.to_string()])?;
        if !out.status.success() {
            cluster.stopped = true; // start stops what it started when it fails
            bail!("tools/cluster.sh start failed:\n{}", text(&out));
        }
        Ok(cluster)
    }

    /// A handle on a cluster another value started, for work on other threads; dropping it
    /// stops nothing.
    pub fn attach(dir: &Path, prefix: &str, nodes: usize) -> Cluster {
        Cluster {
            dir: dir.to_path_buf(),
            prefix: prefix.to_string(),
            nodes,
            stopped: true,
        }
    }

    /// Number of kubelet nodes (named `node-0` ...).
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// The name of node `i`.
    pub fn node_name(i: usize) -> String {
        format!("node-{i}")
    }

    /// The address of node `i` (its InternalIP and NodePort address).
    pub fn node_ip(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(192, 168, 77, 10 + i as u8)
    }

    /// The network namespace of node `i`, where its host-network pods and nftables live.
    pub fn node_netns(&self, i: usize) -> String {
        format!("{}-node-{i}", self.prefix)
    }

    /// The namespace of the control plane, which is off every node: traffic from it to a node
    /// is external traffic.
    pub fn fabric_netns(&self) -> String {
        format!("{}-fabric", self.prefix)
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Runs `tools/cluster.sh ARGS` for this cluster and returns its output.
    pub fn script(&self, args: &[&str]) -> Result<Output> {
        Command::new(workspace_root().join("tools/cluster.sh"))
            .args(args)
            .env("SPLITPROXY_CLUSTER_DIR", &self.dir)
            .env("SPLITPROXY_CLUSTER_PREFIX", &self.prefix)
            .output()
            .context("running tools/cluster.sh")
    }

    /// [`Cluster::script`], failing unless it succeeds; returns its stdout.
    pub fn script_ok(&self, args: &[&str]) -> Result<String> {
        let out = self.script(args)?;
        if !out.status.success() {
            bail!("tools/cluster.sh {}:\n{}", args.join(" "), text(&out));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `kubectl ARGS` as cluster-admin; its stdout.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        let mut all = vec!["kubectl"];
        all.extend_from_slice(args);
        self.script_ok(&all)
    }

    /// Waits (at most 120 s) until `kubectl rollout status` of `what` (e.g.
    /// `deployment/echo`) in `namespace` says it is complete.
    pub fn rollout(&self, namespace: &str, what: &str) -> Result<()> {
        self.kubectl(&["-n", namespace, "rollout", "status", what, "--timeout=120s"])
            .map(drop)
    }

    /// `kubectl apply` of a manifest given as text.
    pub fn apply(&self, manifest: &str) -> Result<()> {
        let file = tempfile::Builder::new()
            .suffix(".yaml")
            .tempfile()
            .context("temporary manifest")?;
        std::fs::write(file.path(), manifest)?;
        let path = file.path().to_string_lossy().into_owned();
        self.kubectl(&["apply", "-f", &path]).map(drop)
    }

    /// `helm ARGS` against this cluster; its stdout.
    pub fn helm(&self, args: &[&str]) -> Result<String> {
        let mut all = vec!["helm"];
        all.extend_from_slice(args);
        self.script_ok(&all)
    }

    /// Probes `proto` `dst` `count` times from pod `pod` (namespace `namespace`, running the
    /// splitproxy-echo image) with `kubectl exec`, `interval` apart; one result per probe.
    pub fn probe_from_pod(
        &self,
        namespace: &str,
        pod: &str,
        proto: &str,
        dst: &str,
        count: u32,
        interval: Duration,
    ) -> Result<Vec<ProbeResult>> {
        let count = count.to_string();
        let interval = interval.as_millis().to_string();
        let out = self.kubectl(&[
            "-n",
            namespace,
            "exec",
            pod,
            "--",
            "splitproxy-echo",
            "probe",
            proto,
            dst,
            "--count",
            &count,
            "--interval-ms",
            &interval,
            "--timeout-ms",
            "1000",
        ])?;
        out.lines()
            .map(|l| serde_json::from_str(l).with_context(|| format!("probe output {l:?}")))
            .collect()
    }

    /// Runs `cmd` in the namespace `netns` of this cluster (a node's or the fabric's).
    pub fn in_netns(&self, netns: &str, cmd: &[&str]) -> Result<String> {
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .arg("--")
            .args(cmd)
            .output()
            .context("running nsenter")?;
        if !out.status.success() {
            bail!("{} in {netns}:\n{}", cmd.join(" "), text(&out));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Stops the cluster and reports what `stop` could not clean.
    pub fn stop(mut self) -> Result<()> {
        self.stopped = true;
        self.script_ok(&["stop"]).map(drop)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !self.stopped {
            match self.script(&["stop"]) {
                Ok(out) if out.status.success() => {}
                Ok(out) => eprintln!("[cluster] stop left something behind:\n{}", text(&out)),
                Err(e) => eprintln!("[cluster] stop failed: {e:#}"),
            }
        }
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
