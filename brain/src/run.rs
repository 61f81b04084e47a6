//! Wires the brain together: API client, watches and index, gRPC server with mTLS (its
//! certificate from files, or managed in a Secret by [`crate::pki`]), reflection and health, and
//! the HTTP endpoints.
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use splitproxy_proto::frames_server::dataplane_server::DataplaneServer;
use splitproxy_proto::transport;
use tonic::transport::Server;
use tonic_health::ServingStatus;

use crate::config::{BrainConfig, Serving, Tuning};
use crate::fanout::Fanout;
use crate::freshness::{self, Freshness};
use crate::metrics::Metrics;
use crate::pacing::Pacing;
use crate::pki::{self, Pki};
use crate::server::DataplaneService;
use crate::sync_route::SyncRoute;
use crate::{http, listener, tls, tokens, watch};

/// The runtime [`run`] serves the nodes' connections on: `--worker-threads` threads, or one per
/// CPU this process may use (cgroup quotas included) when that is 0.
pub fn runtime(tuning: &Tuning) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if tuning.worker_threads > 0 {
        builder.worker_threads(tuning.worker_threads);
    }
    builder.enable_all().build()
}

/// Runs the brain with `config` (see [`crate::config`] for how flags become one) until SIGTERM or
/// SIGINT.
pub async fn run(config: BrainConfig) -> anyhow::Result<()> {
    // Fail fast on a bad kubeconfig; the watch thread builds its own clients on its runtime.
    // This one (on the server's runtime) reviews bearer tokens and keeps the brain's own TLS.
    let api = kube_client(config.kubeconfig.as_deref()).await?;
    let freshness = Freshness::new(config.tuning.api_staleness_bound);
    let metrics = Arc::new(Metrics::default());
    let fanout = Fanout::new(
        metrics,
        config.tuning.max_concurrent_snapshots,
        config.tuning.update_part_elements,
    );
    tracing::info!(epoch = fanout.epoch, listen = %config.listen, ?config, "starting brain");

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    health
        .set_not_serving::<DataplaneServer<DataplaneService>>()
        .await;
    tokio::spawn(freshness::monitor(freshness.clone(), fanout.clone()));
    {
        // gRPC health follows readiness: serving only while synced and not stale.
        let (_, mut synced) = fanout.subscribe();
        let mut fresh = fanout.subscribe_fresh();
        tokio::spawn(async move {
            loop {
                let serving = *synced.borrow_and_update() && *fresh.borrow_and_update();
                let status = if serving {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                health.set_service_status("", status).await;
                health
                    .set_service_status("splitproxy.v1.Dataplane", status)
                    .await;
                let changed = tokio::select! {
                    r = synced.changed() => r,
                    r = fresh.changed() => r,
                };
                if changed.is_err() {
                    return;
                }
            }
        });
    }
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(splitproxy_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building reflection service")?;

    // Bind both listeners before anything else, so a port conflict fails the start.
    let grpc = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    let metrics = tokio::net::TcpListener::bind(config.metrics_bind_address)
        .await
        .with_context(|| format!("binding {}", config.metrics_bind_address))?;
    let (grpc_addr, metrics_addr) = (grpc.local_addr()?, metrics.local_addr()?);
    tracing::info!(grpc = %grpc_addr, metrics = %metrics_addr, "listening");
    if let Some(path) = &config.bound_address_file {
        std::fs::write(path, format!("grpc={grpc_addr}\nmetrics={metrics_addr}\n"))
            .with_context(|| format!("writing {}", path.display()))?;
    }

    // The watches and the index run on a runtime of their own, on their own thread: however
    // busy the fan-out to thousands of streams gets, watch events are taken in as they come.
    // GetService asks the index through a channel.
    let (queries, queries_rx) = crate::service_view::channel();
    {
        let fanout = fanout.clone();
        let freshness = freshness.clone();
        let (kubeconfig, rules, tuning) = (
            config.kubeconfig.clone(),
            config.rules.clone(),
            config.tuning.clone(),
        );
        std::thread::Builder::new()
            .name("brain-watch".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot start the watch runtime");
                        std::process::exit(1);
                    }
                };
                rt.block_on(async move {
                    let kube_config = match kube_config(kubeconfig.as_deref()).await {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::error!(
                                error = format!("{e:#}"),
                                "cannot read the API client's configuration"
                            );
                            std::process::exit(1);
                        }
                    };
                    watch::run(
                        kube_config,
                        rules,
                        fanout,
                        freshness,
                        watch::WatchOptions {
                            streaming_lists: tuning.streaming_lists,
                            pacing: Pacing {
                                min_interval: tuning.min_publish_interval,
                                when_unsettled: tuning.publish_when_unsettled,
                            },
                            probe_interval: tuning.api_probe_interval,
                            queries: Some(queries_rx),
                        },
                    )
                    .await;
                });
            })?;
    }

    // The serving certificate: files, or the Secret this brain manages with the other replicas
    // (not ready until it holds a certificate).
    // With --pod-certificate-signer, the brain's own CA signs the nodes' certificates and
    // verifies them.
    let own_ca = config
        .tls
        .pod_certificate_signer
        .as_ref()
        .map(|_| Arc::new(pki::own_ca::OwnCa::new(config.tls.client_cert_optional)));
    let (serving, pki) = match &config.tls.serving {
        Serving::Files { cert, key } => (
            tls::ServingSource::Files {
                cert: cert.clone(),
                key: key.clone(),
            },
            None,
        ),
        Serving::Managed(managed) => {
            let cert = Arc::new(tls::ServingCert::default());
            let pki = Pki::start(
                api.clone(),
                managed.clone(),
                pki::lease::identity(),
                cert.clone(),
                own_ca.clone(),
                fanout.metrics.clone(),
            );
            (tls::ServingSource::Managed(cert), Some(pki))
        }
    };
    let managed_cert = match &serving {
        tls::ServingSource::Managed(cert) => Some(cert.clone()),
        tls::ServingSource::Files { .. } => None,
    };

    tokio::spawn({
        let fanout = fanout.clone();
        let freshness = freshness.clone();
        async move {
            if let Err(e) = http::serve(metrics, fanout, freshness, managed_cert).await {
                tracing::error!(error = %e, "metrics server failed");
            }
        }
    });

    let metrics = fanout.metrics.clone();
    let tls = Arc::new(tls::ReloadingTls::new(
        serving,
        tls::ClientAuth {
            ca: config.tls.client_ca.clone(),
            optional: config.tls.client_cert_optional,
            own: own_ca.clone(),
        },
        metrics.clone(),
    )?);
    if let (Some(signer), Some(own), Some(account)) = (
        &config.tls.pod_certificate_signer,
        &own_ca,
        &config.surface.tokens.node_service_account,
    ) {
        let signer = crate::podcert::Signer {
            name: signer.clone(),
            namespace: account.namespace.clone(),
            policy: crate::podcert::Policy {
                service_account: (account.namespace.clone(), account.name.clone()),
                node_group: config.surface.groups.node.clone(),
                max_lifetime: crate::podcert::MAX_LIFETIME,
            },
        };
        tokio::spawn(crate::podcert::run(
            api.clone(),
            signer,
            own.clone(),
            metrics.clone(),
        ));
    }
    let groups = Arc::new(config.surface.groups.clone());
    let tokens = config.surface.tokens.enabled().then(|| {
        Arc::new(tokens::Authenticator::new(
            config.surface.tokens.clone(),
            config.surface.groups.clone(),
            Arc::new(tokens::api::ApiReviewer::new(api)),
            metrics.clone(),
        ))
    });
    let stopping = fanout.clone();
    // A change held back by the spacing of publications is out within one interval.
    let drain_publish = config.tuning.min_publish_interval + Duration::from_millis(100);
    let service = DataplaneService {
        fanout,
        groups: groups.clone(),
        freshness,
        queries: Some(queries),
    };
    // TLS is terminated by our own listener (handshake timeout, connection bounds, reloaded
    // files); tonic serves the established connections.
    Server::builder()
        .http2_keepalive_interval(Some(transport::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(transport::KEEPALIVE_TIMEOUT))
        .max_concurrent_streams(listener::MAX_STREAMS_PER_CONNECTION)
        .layer(listener::Gate {
            groups,
            metrics: metrics.clone(),
            tokens,
        })
        .add_service(health_service)
        .add_service(reflection)
        // Sync is answered by the brain's own encoder (shared parts are not copied per node),
        // every other method by the generated server.
        .add_service(SyncRoute::new(
            service.clone(),
            transport::MAX_REQUEST_MESSAGE,
            transport::MAX_ENCODED_MESSAGE,
            DataplaneServer::new(service)
                .max_decoding_message_size(transport::MAX_REQUEST_MESSAGE)
                .max_encoding_message_size(transport::MAX_ENCODED_MESSAGE),
        ))
        .serve_with_incoming_shutdown(
            listener::incoming(grpc, tls, config.surface.limits, metrics),
            async move {
                shutdown().await;
                // What the brain saw goes out before it goes (bounded), so that its nodes
                // hold what a restarted brain or a peer computes from the same API state.
                stopping.drain(drain_publish, SHUTDOWN_ACK_WAIT).await;
                // Node streams and operator watches never end by themselves: without this
                // the graceful shutdown waited for them until the kubelet's SIGKILL, while
                // nodes kept streaming from a brain on its way out.
                stopping.stop();
            },
        )
        .await
        .context("gRPC server")?;
    if let Some(pki) = pki {
        pki.stop().await;
    }
    Ok(())
}

async fn kube_client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    Ok(kube::Client::try_from(kube_config(kubeconfig).await?)?)
}

async fn kube_config(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Config> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::incluster()
            .context("in-cluster config (pass --kubeconfig outside a cluster)")?,
    };
    Ok(config)
}

/// How long a stopping brain waits for its connected nodes to ack its latest publication
/// before it ends their streams (a node that is slow or gone is not waited for longer).
const SHUTDOWN_ACK_WAIT: Duration = Duration::from_secs(2);

async fn shutdown() {
    splitproxy_proto::process::shutdown_signal().await;
    tracing::info!("shutting down");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_has_the_worker_threads_asked_for() {
        let threads = |worker_threads| {
            let tuning = Tuning {
                worker_threads,
                ..Tuning::default()
            };
            runtime(&tuning).unwrap().metrics().num_workers()
        };
        assert_eq!(threads(1), 1);
        assert_eq!(threads(3), 3);
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
            assert_eq!(threads(0), cpus, "0 is one per CPU");
        }
    }
}
