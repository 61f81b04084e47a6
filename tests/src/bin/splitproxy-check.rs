//! `splitproxy-check`: the chart's `helm test` program. It passes when every node that runs an
//! actuator pod holds its brain's latest desired state, and fails (exit 1, with a table of what
//! each node lacks) when that is not so within `--timeout`.
//!
//! Where the answer comes from: the actuator DaemonSet's pods (which nodes must be in sync), the
//! EndpointSlices of the brains' headless Service (which brains to ask: no ClusterIP and no DNS,
//! so the check works without a Service proxy), and each brain's ListNodes over TLS as an
//! operator: with a bearer token (`--token-file`, a projected ServiceAccount token of the brain's
//! audience whose account the chart binds to the operator ClusterRole) or an operator client
//! certificate (`--cert`, `--key`). A node is in sync when some brain that has completed its initial lists
//! reports it connected, `in_sync` and without an error. Its API access: list Pods and
//! EndpointSlices in the release's namespace, nothing else (the chart's test Role).
//!
//! It lives in the test crate for now because it is test code for the chart and this crate
//! already has every dependency it needs; `tools/image.sh` builds it into an image of its own.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use splitproxy_proto::v1::ListNodesRequest;
use splitproxy_proto::v1::dataplane_client::DataplaneClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

#[derive(Debug, Parser)]
#[command(
    name = "splitproxy-check",
    version,
    about = "Passes when every actuator's node holds its brain's latest desired state"
)]
struct Args {
    /// kubeconfig file; in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Namespace of the release.
    #[arg(long)]
    namespace: String,
    /// Label selector of the actuator pods.
    #[arg(long)]
    actuator_selector: String,
    /// Name of the brains' headless Service.
    #[arg(long)]
    brain_service: String,
    /// Name of the gRPC port in the Service.
    #[arg(long, default_value = "grpc")]
    brain_port_name: String,
    /// Name the brains' certificate carries.
    #[arg(long)]
    server_name: String,
    /// CA of the brains' certificate (PEM).
    #[arg(long)]
    ca: PathBuf,
    /// Operator client certificate (PEM).
    #[arg(long, requires = "key")]
    cert: Option<PathBuf>,
    /// Operator client key (PEM).
    #[arg(long, requires = "cert")]
    key: Option<PathBuf>,
    /// A token of the brain's audience, sent as `authorization: Bearer` (reread each round).
    #[arg(long, required_unless_present = "cert")]
    token_file: Option<PathBuf>,
    /// How long to wait for every node to be in sync (seconds).
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

/// What one node lacks, or nothing when it is in sync.
type Report = BTreeMap<String, String>;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::incluster().context("in-cluster configuration")?,
    };
    let client = kube::Client::try_from(config)?;
    let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(&args.ca)?))
        .domain_name(args.server_name.clone());
    if let (Some(cert), Some(key)) = (&args.cert, &args.key) {
        tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout);
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let report = check_once(&client, &args, &tls).await;
        match &report {
            Ok(lacking) if lacking.values().all(String::is_empty) => {
                println!("every node is in sync ({} nodes)", lacking.len());
                for node in lacking.keys() {
                    println!("  {node}: in sync");
                }
                return Ok(());
            }
            _ if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Ok(lacking) => {
                println!("not every node is in sync after {attempt} attempts:");
                for (node, why) in lacking {
                    let why = if why.is_empty() { "in sync" } else { why };
                    println!("  {node}: {why}");
                }
                std::process::exit(1);
            }
            Err(e) => bail!("after {attempt} attempts: {e:#}"),
        }
    }
}

/// One round: which nodes must be in sync, and what each brain says about them.
async fn check_once(
    client: &kube::Client,
    args: &Args,
    tls: &ClientTlsConfig,
) -> anyhow::Result<Report> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &args.namespace);
    let pods = pods
        .list(&ListParams::default().labels(&args.actuator_selector))
        .await
        .context("listing the actuator pods")?;
    let nodes: BTreeSet<String> = pods
        .items
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();

    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &args.namespace);
    let slices = slices
        .list(&ListParams::default().labels(&format!(
            "kubernetes.io/service-name={}",
            args.brain_service
        )))
        .await
        .context("listing the brains' EndpointSlices")?;
    let mut brains = BTreeSet::new();
    for slice in &slices.items {
        let port = slice
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(args.brain_port_name.as_str()))
            .and_then(|p| p.port);
        let Some(port) = port else { continue };
        for ep in slice.endpoints.iter().flatten() {
            if ep.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            for address in &ep.addresses {
                if let Ok(ip) = address.parse::<IpAddr>() {
                    brains.insert(std::net::SocketAddr::new(ip, port as u16));
                }
            }
        }
    }
    if brains.is_empty() {
        bail!(
            "no ready brain in the EndpointSlices of {}",
            args.brain_service
        );
    }

    let mut in_sync = BTreeSet::new();
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    for brain in &brains {
        let answer = async {
            let channel = Channel::from_shared(format!("https://{brain}"))?
                .tls_config(tls.clone())?
                .connect_timeout(Duration::from_secs(5))
                .timeout(Duration::from_secs(10))
                .connect()
                .await?;
            let mut grpc = DataplaneClient::new(channel)
                .max_decoding_message_size(splitproxy_proto::transport::MAX_UPDATE_MESSAGE);
            let mut request = tonic::Request::new(ListNodesRequest {});
            if let Some(path) = &args.token_file {
                let token = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let value = format!("Bearer {}", token.trim())
                    .parse()
                    .context("the token is not a valid header value")?;
                request.metadata_mut().insert("authorization", value);
            }
            anyhow::Ok(grpc.list_nodes(request).await?.into_inner())
        }
        .await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                println!("brain {brain}: {e:#}");
                continue;
            }
        };
        if !answer.synced {
            println!("brain {brain}: initial lists not complete");
            continue;
        }
        for node in answer.nodes {
            if node.connected && node.in_sync && node.last_error.is_empty() {
                in_sync.insert(node.node.clone());
            } else {
                let why = format!(
                    "brain {brain}: connected={} acked={} desired={} error={:?}",
                    node.connected, node.acked_generation, node.desired_generation, node.last_error
                );
                seen.insert(node.node.clone(), why);
            }
        }
    }
    Ok(nodes
        .into_iter()
        .map(|node| {
            let why = if in_sync.contains(&node) {
                String::new()
            } else {
                seen.remove(&node)
                    .unwrap_or_else(|| "no brain knows this node's actuator".to_string())
            };
            (node, why)
        })
        .collect())
}
