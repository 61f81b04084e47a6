//! Scenario directories: a lab configuration, Kubernetes objects and probes, replayable without
//! writing code (`splitproxy-lab up --scenario DIR --probe`, `splitproxy-lab replay DIR`) and
//! loadable from tests.
//!
//! ```text
//! DIR/
//!   lab.yaml       optional: nodes, zones, CIDRs, the brain's kube-proxy-like flags
//!   *.yaml         Namespaces, Services, EndpointSlices, Nodes, applied in file-name order
//!   probes.yaml    optional: [{from, to, protocol, count, expect}]
//! ```
//!
//! The format is documented with an example in `tests/lab/scenarios/README.md`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::Result;
use crate::deploy::{DetectLocalMode, NodePortAddresses};
use crate::lab::{ExternalSpec, Lab, LabOptions, NodeSpec, PodSpec};
use crate::probe::{ProbeResult, Proto};
use crate::topology::PodNetwork;

/// The lab configuration file of a scenario.
pub const LAB_FILE: &str = "lab.yaml";
/// The probes file of a scenario.
pub const PROBES_FILE: &str = "probes.yaml";

/// The Kubernetes YAML files of `path`: the file itself, or a directory's `*.yaml`, `*.yml` and
/// `*.json` files in name order, without [`LAB_FILE`] and [`PROBES_FILE`].
pub fn object_files(path: &Path) -> Result<Vec<PathBuf>> {
    if !path.is_dir() {
        if !path.exists() {
            bail!("{} does not exist", path.display());
        }
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for e in std::fs::read_dir(path).with_context(|| format!("reading {}", path.display()))? {
        let p = e?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name == LAB_FILE || name == PROBES_FILE || !p.is_file() {
            continue;
        }
        if matches!(
            p.extension().and_then(|x| x.to_str()),
            Some("yaml" | "yml" | "json")
        ) {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// A list of CIDRs (or of `nodePortAddresses` values): a YAML list, or one comma-separated
/// string as kube-proxy's `clusterCIDR` takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "a list of strings or one comma-separated string"
)]
pub enum StringList {
    One(String),
    Many(Vec<String>),
}

impl StringList {
    /// The entries, split at commas and trimmed.
    pub fn items(&self) -> Vec<String> {
        let all = match self {
            StringList::One(s) => vec![s.clone()],
            StringList::Many(v) => v.clone(),
        };
        all.iter()
            .flat_map(|s| s.split(','))
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    }
}

/// `nodes:` in `lab.yaml`: a count (`node-0` ...) or a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "a number of nodes, or a list of {name, zone, addresses, labels}"
)]
pub enum NodesConfig {
    Count(usize),
    List(Vec<NodeConfig>),
}

/// One node in `lab.yaml`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeConfig {
    pub name: String,
    /// `topology.kubernetes.io/zone`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Extra addresses (InternalIPs after the fabric ones), e.g. `192.168.77.60` (on the
    /// fabric) or `10.0.5.10/32` (routed to the node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    /// Further Node labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// One external client in `lab.yaml`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExternalConfig {
    pub name: String,
    /// Node its default routes point to (default: the first node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// Its addresses, one per family, in 192.168.77.0/24 and fd00:77::/64 (default: picked).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
}

/// A pod in `lab.yaml`, created when the lab starts (a client to probe from, or a server).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodConfig {
    pub name: String,
    pub node: String,
    /// One per family (default: picked from the node's pod CIDRs, dual stack).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tcp: Vec<u16>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub udp: Vec<u16>,
}

/// `lab.yaml`: every field is optional; absent fields keep the defaults of [`LabOptions`]
/// (3 nodes, 1 brain, dual-stack CIDRs, ClusterCIDR mode, one external client).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LabConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodesConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub brains: Option<usize>,
    /// `--cluster-cidr` (default 10.244.0.0/16 and fd00:244::/48).
    #[serde(
        default,
        rename = "clusterCIDRs",
        alias = "clusterCIDR",
        skip_serializing_if = "Option::is_none"
    )]
    pub cluster_cidrs: Option<StringList>,
    /// Service CIDRs of the API server and the brain (default 10.96.0.0/16 and fd00:96::/112).
    #[serde(
        default,
        rename = "serviceCIDRs",
        alias = "serviceCIDR",
        skip_serializing_if = "Option::is_none"
    )]
    pub service_cidrs: Option<StringList>,
    /// ClusterCIDR (default), NodeCIDR, InterfaceNamePrefix, BridgeInterface or None.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detect_local_mode: Option<String>,
    /// Default with InterfaceNamePrefix: `pod` (the lab's pod interface prefix).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_interface_name_prefix: Option<String>,
    /// Default with BridgeInterface: `cbr0` (pods are then attached to that bridge).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_bridge_interface: Option<String>,
    /// `--nodeport-addresses` (default `[primary]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_port_addresses: Option<StringList>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masquerade_all: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_proxy_name: Option<String>,
    /// `routed` (default) or `bridge`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_network: Option<PodNetwork>,
    /// Default: one client named `external` via the first node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_clients: Option<Vec<ExternalConfig>>,
    /// Pods to create at start.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PodConfig>,
    /// Further brain flags, appended last.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub brain_args: Vec<String>,
}

fn parse_net(text: &str) -> Result<IpNet> {
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .with_context(|| format!("{text:?} is neither an address nor a CIDR"))
}

impl LabConfig {
    /// Reads `lab.yaml`.
    pub fn load(path: &Path) -> Result<LabConfig> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let config: Option<LabConfig> =
            serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        Ok(config.unwrap_or_default())
    }

    /// Sets the options this configuration names; the others keep their values.
    pub fn apply_to(&self, opts: &mut LabOptions) -> Result<()> {
        match &self.nodes {
            Some(NodesConfig::Count(n)) => {
                opts.nodes = *n;
                opts.node_specs.clear();
            }
            Some(NodesConfig::List(list)) => {
                opts.node_specs = list
                    .iter()
                    .map(|n| -> Result<NodeSpec> {
                        Ok(NodeSpec {
                            name: n.name.clone(),
                            zone: n.zone.clone(),
                            addresses: n
                                .addresses
                                .iter()
                                .map(|a| parse_net(a))
                                .collect::<Result<_>>()
                                .with_context(|| format!("addresses of node {}", n.name))?,
                            labels: n.labels.clone(),
                        })
                    })
                    .collect::<Result<_>>()?;
                opts.nodes = list.len();
            }
            None => {}
        }
        if let Some(b) = self.brains {
            opts.brains = b;
        }
        let rules = &mut opts.brain.rules;
        if let Some(c) = &self.cluster_cidrs {
            rules.cluster_cidrs = c
                .items()
                .iter()
                .map(|c| c.parse().with_context(|| format!("cluster CIDR {c:?}")))
                .collect::<Result<_>>()?;
        }
        if let Some(mode) = &self.detect_local_mode {
            rules.detect_local = detect_local_mode(mode)?;
        }
        if let Some(p) = &self.pod_interface_name_prefix {
            rules.pod_interface_name_prefix = p.clone();
        }
        if let Some(b) = &self.pod_bridge_interface {
            rules.pod_bridge_interface = b.clone();
        }
        if let Some(a) = &self.node_port_addresses {
            rules.nodeport_addresses =
                NodePortAddresses::parse(&a.items()).map_err(anyhow::Error::msg)?;
        }
        if let Some(m) = self.masquerade_all {
            rules.masquerade_all = m;
        }
        if let Some(n) = &self.service_proxy_name {
            rules.service_proxy_name = n.clone();
        }
        opts.brain
            .extra_args
            .extend(self.brain_args.iter().cloned());
        if let Some(c) = &self.service_cidrs {
            opts.service_cidrs = c
                .items()
                .iter()
                .map(|c| c.parse().with_context(|| format!("service CIDR {c:?}")))
                .collect::<Result<_>>()?;
        }
        if let Some(p) = self.pod_network {
            opts.pod_network = Some(p);
        }
        if let Some(clients) = &self.external_clients {
            opts.external_clients = clients
                .iter()
                .map(|c| -> Result<ExternalSpec> {
                    Ok(ExternalSpec {
                        name: c.name.clone(),
                        via: c.via.clone(),
                        addresses: c
                            .addresses
                            .iter()
                            .map(|a| a.parse::<IpAddr>())
                            .collect::<Result<_, _>>()
                            .with_context(|| format!("addresses of external client {}", c.name))?,
                    })
                })
                .collect::<Result<_>>()?;
        }
        for p in &self.pods {
            opts.pods.push(PodSpec {
                name: p.name.clone(),
                node: p.node.clone(),
                addresses: p
                    .addresses
                    .iter()
                    .map(|a| a.parse::<IpAddr>())
                    .collect::<Result<_, _>>()
                    .with_context(|| format!("addresses of pod {}", p.name))?,
                tcp: p.tcp.clone(),
                udp: p.udp.clone(),
            });
        }
        Ok(())
    }
}

/// `detectLocalMode`, as the brain's flag takes it but in any case (`clusterCIDR`).
fn detect_local_mode(text: &str) -> Result<DetectLocalMode> {
    use clap::ValueEnum;
    DetectLocalMode::from_str(text, true).map_err(|_| {
        let names: Vec<String> = DetectLocalMode::value_variants()
            .iter()
            .filter_map(|m| m.to_possible_value())
            .map(|v| v.get_name().to_string())
            .collect();
        anyhow::anyhow!("unknown detect-local mode {text:?} ({})", names.join(", "))
    })
}

/// What a probe's answers must look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Answered,
    Refused,
    #[serde(alias = "timed_out", alias = "timeout")]
    Dropped,
    Unreachable,
    Error,
}

impl Outcome {
    fn name(&self) -> &'static str {
        match self {
            Outcome::Answered => "answered",
            Outcome::Refused => "refused",
            Outcome::Dropped => "dropped",
            Outcome::Unreachable => "unreachable",
            Outcome::Error => "error",
        }
    }
}

fn answered() -> Outcome {
    Outcome::Answered
}

/// A detailed expectation: every answer must have `result`, and when it is `answered`, come from
/// one of `pods` / `endpoints` with the given `source`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExpectDetail {
    #[serde(default = "answered")]
    pub result: Outcome,
    /// Every answer comes from one of these pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<Vec<String>>,
    /// Each of `pods` answers at least once (load is spread over all of them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub every_pod: bool,
    /// Every answer's endpoint (`ip:port`, or `ip` for any port) is one of these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Vec<String>>,
    /// The source the pod saw: `preserved` (exactly the probe's own address and port),
    /// `masqueraded` (anything else), or an IP address (any port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// `expect:` of a probe: an outcome (`answered`, `refused`, `dropped`, `unreachable`) or an
/// [`ExpectDetail`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "an outcome (answered, refused, dropped, unreachable, error) or a map with \
                 result, pods, everyPod, endpoints, source"
)]
pub enum Expect {
    Outcome(Outcome),
    Detail(ExpectDetail),
}

impl Expect {
    /// The detailed form.
    pub fn detail(&self) -> ExpectDetail {
        match self {
            Expect::Outcome(o) => ExpectDetail {
                result: *o,
                pods: None,
                every_pod: false,
                endpoints: None,
                source: None,
            },
            Expect::Detail(d) => d.clone(),
        }
    }

    /// What is wrong with `results`; empty when they meet the expectation.
    pub fn check(&self, results: &[ProbeResult]) -> Vec<String> {
        let d = self.detail();
        let mut failures = Vec::new();
        if results.is_empty() {
            failures.push("no results".to_string());
        }
        for (i, r) in results.iter().enumerate() {
            let n = i + 1;
            if r.kind() != d.result.name() {
                failures.push(format!("#{n}: expected {}, got {r}", d.result.name()));
                continue;
            }
            let ProbeResult::Answered {
                pod,
                endpoint,
                source,
                client,
            } = r
            else {
                continue;
            };
            if let Some(pods) = &d.pods
                && !pods.contains(pod)
            {
                failures.push(format!("#{n}: answered by {pod}, not one of {pods:?}"));
            }
            if let Some(eps) = &d.endpoints {
                let matches = eps.iter().any(|e| {
                    e.parse::<SocketAddr>().ok() == Some(*endpoint)
                        || e.parse::<IpAddr>().ok() == Some(endpoint.ip())
                });
                if !matches {
                    failures.push(format!("#{n}: endpoint {endpoint}, not one of {eps:?}"));
                }
            }
            match d.source.as_deref() {
                None => {}
                Some("preserved") if source != client => {
                    failures.push(format!(
                        "#{n}: source {source} was not preserved (the probe used {client})"
                    ));
                }
                Some("masqueraded") if source == client => {
                    failures.push(format!("#{n}: source {source} was not masqueraded"));
                }
                Some("preserved" | "masqueraded") => {}
                Some(ip) => match ip.parse::<IpAddr>() {
                    Ok(want) if want == source.ip() => {}
                    Ok(want) => {
                        failures.push(format!("#{n}: pod saw source {}, not {want}", source.ip()))
                    }
                    Err(_) => failures.push(format!(
                        "bad expectation source {ip:?} (preserved, masqueraded or an IP)"
                    )),
                },
            }
        }
        if d.every_pod
            && let Some(pods) = &d.pods
        {
            for want in pods {
                if !results.iter().any(|r| r.pod() == Some(want)) {
                    failures.push(format!("{want} never answered"));
                }
            }
        }
        failures
    }

    /// A short text form, e.g. `answered, source preserved, pods [web-0]`.
    pub fn describe(&self) -> String {
        let d = self.detail();
        let mut s = d.result.name().to_string();
        if let Some(src) = &d.source {
            let _ = write!(s, ", source {src}");
        }
        if let Some(pods) = &d.pods {
            let _ = write!(
                s,
                ", {}pods {}",
                if d.every_pod { "every one of " } else { "" },
                pods.join(" ")
            );
        }
        if let Some(eps) = &d.endpoints {
            let _ = write!(s, ", endpoints {}", eps.join(" "));
        }
        s
    }
}

fn one() -> usize {
    1
}

/// One entry of `probes.yaml`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProbeSpec {
    /// What the probe shows (printed with its results).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A pod, node or external client name, or an address of one (then bound as source).
    pub from: String,
    /// `ip:port`; IPv6 as `"[fd00:96::10]:80"` (quoted in YAML).
    pub to: SocketAddr,
    #[serde(default)]
    pub protocol: Proto,
    /// New connections to make (default 1).
    #[serde(default = "one")]
    pub count: usize,
    /// Per-connection timeout (default 1500 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Fixed source port for every connection (default: a new one each time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<Expect>,
}

impl ProbeSpec {
    /// `from -> proto to` (and `xN`).
    pub fn describe(&self) -> String {
        let mut s = format!("{} -> {} {}", self.from, self.protocol, self.to);
        if self.count > 1 {
            let _ = write!(s, " x{}", self.count);
        }
        s
    }
}

/// Reads a probes file (a YAML list of [`ProbeSpec`]).
pub fn load_probes(path: &Path) -> Result<Vec<ProbeSpec>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let probes: Option<Vec<ProbeSpec>> =
        serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(probes.unwrap_or_default())
}

/// A scenario directory, loaded.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub dir: PathBuf,
    pub config: LabConfig,
    /// The Kubernetes YAML files, in the order they are applied.
    pub object_files: Vec<PathBuf>,
    pub probes: Vec<ProbeSpec>,
}

impl Scenario {
    /// Loads `dir` (`lab.yaml` and `probes.yaml` are optional).
    pub fn load(dir: &Path) -> Result<Scenario> {
        if !dir.is_dir() {
            bail!("scenario {} is not a directory", dir.display());
        }
        let lab = dir.join(LAB_FILE);
        let config = if lab.exists() {
            LabConfig::load(&lab)?
        } else {
            LabConfig::default()
        };
        let probes_path = dir.join(PROBES_FILE);
        let probes = if probes_path.exists() {
            load_probes(&probes_path)?
        } else {
            Vec::new()
        };
        Ok(Scenario {
            dir: dir.to_path_buf(),
            config,
            object_files: object_files(dir)?,
            probes,
        })
    }

    /// Lab options for this scenario: `base` with what `lab.yaml` sets.
    pub fn lab_options(&self, mut base: LabOptions) -> Result<LabOptions> {
        self.config
            .apply_to(&mut base)
            .with_context(|| format!("in {}", self.dir.join(LAB_FILE).display()))?;
        Ok(base)
    }
}

/// How [`Lab::replay`] runs probes.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// How long a probe whose expectation fails is retried (the rules may still be on their
    /// way), counted from the start of the replay.
    pub settle: Duration,
    /// How long to wait first for every node to hold the brain's latest state.
    pub sync_timeout: Duration,
    /// Explain every probe through the brain's `ExplainPacket` and hold the explanation
    /// against the results ([`crate::explain`]): a disagreement fails the probe.
    pub explain: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            settle: Duration::from_secs(10),
            sync_timeout: Duration::from_secs(15),
            explain: true,
        }
    }
}

/// The results of one probe of a replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeReport {
    /// Position in the probes file, from 1.
    pub probe: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub from: String,
    pub to: SocketAddr,
    pub protocol: Proto,
    pub results: Vec<ProbeResult>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<Expect>,
    /// `None` without an expectation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<String>,
    /// Rounds run before the expectation held (or the settle time ran out).
    pub attempts: usize,
    /// The brain's explanation of the probe's packet, one line per node it met.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub explained: Vec<String>,
    /// Where the explanation contradicts the results (fails the probe).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disagreements: Vec<String>,
}

impl ProbeReport {
    /// Human-readable form: a header line, one line per result, the verdict.
    pub fn to_text(&self) -> String {
        let mut s = format!("probe {}", self.probe);
        if let Some(name) = &self.name {
            let _ = write!(s, " ({name})");
        }
        let _ = writeln!(s, ": {} -> {} {}", self.from, self.protocol, self.to);
        for r in &self.results {
            let _ = writeln!(s, "  {r}");
        }
        for e in &self.explained {
            let _ = writeln!(s, "  explained on {e}");
        }
        for d in &self.disagreements {
            let _ = writeln!(s, "  DISAGREES: {d}");
        }
        match (self.pass, &self.expect) {
            (Some(true), Some(e)) => {
                let _ = writeln!(s, "  PASS (expected {})", e.describe());
            }
            (Some(false), Some(e)) => {
                let _ = writeln!(
                    s,
                    "  FAIL (expected {}; after {} attempts)",
                    e.describe(),
                    self.attempts
                );
                for f in &self.failures {
                    let _ = writeln!(s, "    {f}");
                }
            }
            _ => {}
        }
        s
    }
}

impl Lab {
    /// Applies the scenario's Kubernetes objects in order (the lab should have been started
    /// with [`Scenario::lab_options`]).
    pub async fn apply_scenario(&self, scenario: &Scenario) -> Result<Vec<String>> {
        let mut applied = Vec::new();
        for f in &scenario.object_files {
            applied.extend(self.apply_path(f).await?);
        }
        Ok(applied)
    }

    /// Runs `probes` in order, waiting first until every node holds the brain's latest state;
    /// a probe whose expectation fails is run again until it holds or `opts.settle` has passed.
    pub async fn replay(&self, probes: &[ProbeSpec], opts: &ReplayOptions) -> Vec<ProbeReport> {
        let start = tokio::time::Instant::now();
        if let Err(err) = self.wait_synced(opts.sync_timeout).await {
            eprintln!("[splitproxy-lab] probing anyway: {err:#}");
        }
        let deadline = start + opts.settle;
        let mut explainer = match opts.explain {
            true => Some(self.explainer().await.map_err(|e| format!("{e:#}"))),
            false => None,
        };
        let mut reports = Vec::new();
        for (i, p) in probes.iter().enumerate() {
            let timeout = Duration::from_millis(p.timeout_ms.unwrap_or(1500).clamp(10, 60_000));
            let mut attempts = 0;
            loop {
                attempts += 1;
                let results = self
                    .probe_n_from_port(
                        &p.from,
                        p.protocol,
                        p.to,
                        p.source_port.unwrap_or(0),
                        p.count.clamp(1, 10_000),
                        timeout,
                    )
                    .await;
                let failures = p
                    .expect
                    .as_ref()
                    .map(|e| e.check(&results))
                    .unwrap_or_default();
                let (explained, disagreements) = match explainer.as_mut() {
                    None => (Vec::new(), Vec::new()),
                    Some(Err(e)) => (Vec::new(), vec![format!("no brain to explain with: {e}")]),
                    Some(Ok(brain)) => {
                        let x = self
                            .explain_probe(
                                brain,
                                &p.from,
                                p.protocol,
                                p.to,
                                p.source_port,
                                &results,
                            )
                            .await;
                        (x.summary(), x.disagreements)
                    }
                };
                let done = (failures.is_empty() && disagreements.is_empty())
                    || tokio::time::Instant::now() >= deadline;
                if done {
                    let pass = match (&p.expect, disagreements.is_empty()) {
                        (None, true) => None,
                        _ => Some(failures.is_empty() && disagreements.is_empty()),
                    };
                    reports.push(ProbeReport {
                        probe: i + 1,
                        name: p.name.clone(),
                        from: p.from.clone(),
                        to: p.to,
                        protocol: p.protocol,
                        results,
                        expect: p.expect.clone(),
                        pass,
                        failures,
                        attempts,
                        explained,
                        disagreements,
                    });
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        reports
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(pod: &str, endpoint: &str, source: &str, client: &str) -> ProbeResult {
        ProbeResult::Answered {
            pod: pod.into(),
            endpoint: endpoint.parse().unwrap(),
            source: source.parse().unwrap(),
            client: client.parse().unwrap(),
        }
    }

    #[test]
    fn parses_lab_yaml() {
        let config: LabConfig = serde_yaml::from_str(
            r#"
nodes:
  - {name: node-0, zone: zone-a}
  - {name: node-1, zone: zone-b, addresses: ["192.168.77.61", "10.0.5.1/32"], labels: {x: y}}
clusterCIDR: "10.244.0.0/16,fd00:244::/48"
serviceCIDRs: [10.96.0.0/16, "fd00:96::/112"]
detectLocalMode: InterfaceNamePrefix
nodePortAddresses: [192.168.77.0/24]
masqueradeAll: true
serviceProxyName: sp
externalClients:
  - {name: far, via: node-1, addresses: [192.168.77.210]}
pods:
  - {name: client, node: node-1}
  - {name: v6only, node: node-0, addresses: ["fd00:244::50"], udp: [53]}
"#,
        )
        .unwrap();
        let mut opts = LabOptions::new("/bin/true");
        config.apply_to(&mut opts).unwrap();
        assert_eq!(opts.node_specs.len(), 2);
        assert_eq!(opts.node_specs[1].zone.as_deref(), Some("zone-b"));
        assert_eq!(
            opts.node_specs[1].addresses,
            vec![
                "192.168.77.61/32".parse::<IpNet>().unwrap(),
                "10.0.5.1/32".parse().unwrap()
            ]
        );
        assert_eq!(opts.brain.rules.cluster_cidrs.len(), 2);
        assert_eq!(
            opts.service_cidrs,
            [
                "10.96.0.0/16".parse::<IpNet>().unwrap(),
                "fd00:96::/112".parse().unwrap()
            ]
        );
        assert_eq!(
            opts.brain.rules.detect_local,
            DetectLocalMode::InterfaceNamePrefix
        );
        assert_eq!(
            opts.brain.rules.nodeport_addresses,
            NodePortAddresses::Cidrs(vec!["192.168.77.0/24".parse().unwrap()])
        );
        assert!(opts.brain.rules.masquerade_all);
        assert_eq!(opts.external_clients[0].via.as_deref(), Some("node-1"));
        assert_eq!(opts.pods.len(), 2);
        assert_eq!(
            opts.pods[1].addresses,
            vec!["fd00:244::50".parse::<IpAddr>().unwrap()]
        );
        let args = opts.effective_brain_options().args().join(" ");
        assert!(
            args.contains("--pod-interface-name-prefix pod")
                && args.contains("--nodeport-addresses 192.168.77.0/24")
                && args.contains("--service-proxy-name sp"),
            "{args}"
        );

        let count: LabConfig = serde_yaml::from_str("nodes: 4\n").unwrap();
        let mut opts = LabOptions::new("/bin/true");
        count.apply_to(&mut opts).unwrap();
        assert_eq!(opts.effective_nodes().len(), 4);
        assert!(serde_yaml::from_str::<LabConfig>("nodez: 4\n").is_err());
        let bad: LabConfig = serde_yaml::from_str("detectLocalMode: Nope\n").unwrap();
        assert!(bad.apply_to(&mut LabOptions::new("/bin/true")).is_err());
        let bad: LabConfig = serde_yaml::from_str("nodePortAddresses: [nowhere]\n").unwrap();
        assert!(bad.apply_to(&mut LabOptions::new("/bin/true")).is_err());
        let mode: LabConfig = serde_yaml::from_str("detectLocalMode: nodecidr\n").unwrap();
        let mut opts = LabOptions::new("/bin/true");
        mode.apply_to(&mut opts).unwrap();
        assert_eq!(opts.brain.rules.detect_local, DetectLocalMode::NodeCidr);
        let primary: LabConfig = serde_yaml::from_str("nodePortAddresses: primary\n").unwrap();
        primary.apply_to(&mut opts).unwrap();
        assert_eq!(
            opts.brain.rules.nodeport_addresses,
            NodePortAddresses::Primary
        );
    }

    #[test]
    fn parses_probes_and_checks_expectations() {
        let probes: Vec<ProbeSpec> = serde_yaml::from_str(
            r#"
- {from: external, to: 192.168.77.10:30080, expect: answered}
- from: web-client
  to: "[fd00:96::10]:80"
  protocol: UDP
  sourcePort: 5300
  count: 3
  expect: {pods: [web-0, web-1], everyPod: true, source: preserved}
- {from: 192.168.77.200, to: 192.168.77.11:30080, expect: dropped}
"#,
        )
        .unwrap();
        assert_eq!(probes.len(), 3);
        assert_eq!(probes[1].protocol, Proto::Udp);
        assert_eq!(probes[1].source_port, Some(5300));
        assert_eq!(probes[1].to, "[fd00:96::10]:80".parse().unwrap());
        assert_eq!(probes[0].count, 1);

        let ok = answered("web-0", "10.244.0.10:8080", "1.1.1.1:5", "1.1.1.1:5");
        assert!(
            probes[0]
                .expect
                .as_ref()
                .unwrap()
                .check(std::slice::from_ref(&ok))
                .is_empty()
        );
        let e = probes[1].expect.as_ref().unwrap();
        assert_eq!(
            e.check(std::slice::from_ref(&ok)),
            vec!["web-1 never answered"]
        );
        let other = answered("web-1", "10.244.1.10:8080", "1.1.1.1:6", "1.1.1.1:6");
        assert!(e.check(&[ok.clone(), other]).is_empty());
        let masq = answered("web-1", "10.244.1.10:8080", "10.244.1.1:6", "1.1.1.1:6");
        assert_eq!(e.check(&[ok.clone(), masq]).len(), 1);
        assert!(
            probes[2]
                .expect
                .as_ref()
                .unwrap()
                .check(&[ProbeResult::TimedOut])
                .is_empty()
        );
        assert_eq!(
            probes[2].expect.as_ref().unwrap().check(&[ok]).len(),
            1,
            "an answer is not a drop"
        );
        let ep: Expect =
            serde_yaml::from_str("{endpoints: [10.244.0.10], source: 1.1.1.1}").unwrap();
        assert!(
            ep.check(&[answered("a", "10.244.0.10:1", "1.1.1.1:1", "2.2.2.2:2")])
                .is_empty()
        );
        assert!(serde_yaml::from_str::<Vec<ProbeSpec>>("- {from: a, to: nowhere}").is_err());
    }

    #[test]
    fn the_example_scenario_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("lab/scenarios/nodeport-local");
        let s = Scenario::load(&dir).unwrap();
        assert!(!s.probes.is_empty());
        assert!(s.probes.iter().all(|p| p.expect.is_some()));
        assert!(!s.object_files.is_empty());
        assert!(
            s.object_files
                .iter()
                .all(|f| f.file_name().unwrap() != LAB_FILE)
        );
        let opts = s.lab_options(LabOptions::new("/bin/true")).unwrap();
        assert!(!opts.effective_nodes().is_empty());
    }
}
