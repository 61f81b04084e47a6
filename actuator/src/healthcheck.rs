//! healthCheckNodePort servers: for each `externalTrafficPolicy: Local` LoadBalancer Service,
//! an HTTP server on its health check port that tells the cloud load balancer whether this
//! node has local endpoints, answering exactly as kube-proxy's
//! `pkg/proxy/healthcheck/service_health.go` does, so load balancers configured for kube-proxy
//! keep working.
//!
//! The actuator knows no Services; the brain states what to serve in two maps of the table
//! `ip <table>`: [`SET`] (key `inet_service`, the port; comment `namespace/name`; the same on
//! every node) and [`LOCAL_SET`] (port -> `integer`, this node's local endpoints of the Service;
//! absent means none). The kernel never uses them (no rule refers to them); they travel with
//! the ruleset so that they are applied, acknowledged and resumed like the rest.
//!
//! After every commit [`HealthCheckServers::reconcile_model`] starts servers for new ports,
//! stops those of removed ports and updates the others in place (their connections stay). A
//! port that cannot be bound is logged and tried again at the next commit.
//!
//! Like kube-proxy, the servers listen on the node's NodePort addresses (`--nodeport-addresses`):
//! the elements of [`NODEPORT_IPS`] in `ip <table>` and `ip6 <table>`. When those change, every
//! server moves to the new addresses. When the brain names none (a Node without addresses),
//! the addresses given to [`HealthCheckServers::new`] are used.
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::Full;
use hyper_util::rt::{TokioIo, TokioTimer};
use splitproxy_proto::model::{Model, SetModel};
use splitproxy_proto::v1::{Element, Family, datum::Value};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::health::Health;

/// The set that lists the health check ports.
pub const SET: &str = "health-check-nodeports";
/// The map of this node's local endpoint counts by health check port.
pub const LOCAL_SET: &str = "health-check-local-endpoints";
/// The addresses NodePorts (and so health checks) answer on, in both families' tables.
pub const NODEPORT_IPS: &str = "nodeport-ips";

/// Where the servers listen when the model names no NodePort address: every address (the IPv6
/// one IPV6_V6ONLY, and optional: a node without IPv6 serves IPv4 only).
pub const DEFAULT_ADDRESSES: [IpAddr; 2] = [
    IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
    IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
];

/// What one health check port reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    pub local_endpoints: u32,
}

/// The health check ports `model` asks for, from the [`SET`] of `ip <table>`. Malformed
/// elements are skipped.
pub fn desired(model: &Model, table: &str) -> BTreeMap<u16, Service> {
    let key = (Family::Ip, table.to_owned());
    let mut out: BTreeMap<u16, Service> = model.set(&key, SET).map(desired_of).unwrap_or_default();
    if let Some(local) = model.set(&key, LOCAL_SET) {
        for (port, counted) in desired_of(local) {
            if let Some(svc) = out.get_mut(&port) {
                svc.local_endpoints = counted.local_endpoints;
            }
        }
    }
    out
}

fn desired_of(set: &SetModel) -> BTreeMap<u16, Service> {
    set.decoded().filter_map(|e| service_of(&e)).collect()
}

fn service_of(e: &Element) -> Option<(u16, Service)> {
    let port = match e.key.first()?.value.as_ref()? {
        Value::Port(p) => u16::try_from(*p).ok()?,
        _ => return None,
    };
    let local_endpoints = match e.data.first()?.value.as_ref()? {
        Value::U32(n) => *n,
        _ => return None,
    };
    let (namespace, name) = e.comment.split_once('/').unwrap_or(("", &e.comment));
    Some((
        port,
        Service {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            local_endpoints,
        },
    ))
}

/// kube-proxy's answer, on any path: 200 when the node has local endpoints and the proxy is
/// healthy, else 503; the same headers and the same (tab-indented) JSON body.
pub fn response(svc: &Service, proxy_healthy: bool) -> Response<Full<Bytes>> {
    let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    let body = format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {},\n\t\"serviceProxyHealthy\": {}\n}}",
        quote(&svc.namespace),
        quote(&svc.name),
        svc.local_endpoints,
        proxy_healthy
    );
    let status = if svc.local_endpoints > 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
    h.insert(header::X_CONTENT_TYPE_OPTIONS, "nosniff".parse().unwrap());
    h.insert(
        "x-load-balancing-endpoint-weight",
        svc.local_endpoints.into(),
    );
    r
}

/// A port being served: what it reports, and how to stop it.
struct Running {
    service: Arc<Mutex<Service>>,
    /// Dropped to stop: listeners close at once, open connections with them.
    stop: watch::Sender<()>,
    listeners: Vec<JoinHandle<()>>,
}

impl Running {
    async fn stop(self) {
        drop(self.stop);
        for l in self.listeners {
            let _ = l.await;
        }
    }
}

/// The NodePort addresses `model` names for this node, IPv4 first.
pub fn nodeport_addresses(model: &Model, table: &str) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for family in [Family::Ip, Family::Ip6] {
        let key = (family, table.to_owned());
        let Some(set) = model.set(&key, NODEPORT_IPS) else {
            continue;
        };
        out.extend(
            set.decoded()
                .filter_map(|e| match e.key.first()?.value.as_ref()? {
                    Value::Ipv4(b) => <[u8; 4]>::try_from(b.as_slice()).ok().map(IpAddr::from),
                    Value::Ipv6(b) => <[u8; 16]>::try_from(b.as_slice()).ok().map(IpAddr::from),
                    _ => None,
                }),
        );
    }
    out
}

/// The running health check servers.
pub struct HealthCheckServers {
    /// Used when the model names no NodePort address; the first must bind, the others may
    /// fail (IPv6 absent).
    fallback: Vec<IpAddr>,
    /// Where the running servers listen: the model's NodePort addresses, or `fallback`.
    addresses: Vec<IpAddr>,
    health: Arc<Health>,
    running: BTreeMap<u16, Running>,
    /// The maps and addresses reconciled last, to skip commits that left them alone.
    seen: Option<(Option<SetModel>, Option<SetModel>, Vec<IpAddr>)>,
    /// Some port failed to bind: the next reconcile retries even if the set did not change.
    retry: bool,
}

impl HealthCheckServers {
    /// `fallback`: where to listen while the model names no NodePort address.
    pub fn new(fallback: Vec<IpAddr>, health: Arc<Health>) -> Self {
        HealthCheckServers {
            addresses: fallback.clone(),
            fallback,
            health,
            running: BTreeMap::new(),
            seen: None,
            retry: false,
        }
    }

    /// Ports served now.
    pub fn ports(&self) -> Vec<u16> {
        self.running.keys().copied().collect()
    }

    /// Brings the servers in line with `model` (see the module doc). Cheap when the set did
    /// not change and no port is waiting for a retry.
    pub async fn reconcile_model(&mut self, model: &Model, table: &str) {
        let key = (Family::Ip, table.to_owned());
        let mut addresses = nodeport_addresses(model, table);
        if addresses.is_empty() {
            addresses = self.fallback.clone();
        }
        let seen = (
            model.set(&key, SET).cloned(),
            model.set(&key, LOCAL_SET).cloned(),
            addresses.clone(),
        );
        if !self.retry && self.seen.as_ref() == Some(&seen) {
            return;
        }
        if addresses != self.addresses {
            tracing::info!(
                ?addresses,
                "health check servers move to the NodePort addresses"
            );
            self.stop_all().await;
            self.addresses = addresses;
        }
        self.reconcile(desired(model, table)).await;
        self.seen = Some(seen);
    }

    async fn stop_all(&mut self) {
        for (_, r) in std::mem::take(&mut self.running) {
            r.stop().await;
        }
    }

    /// Stops the servers of ports not in `desired` (waiting until their listeners are closed,
    /// so a port can be taken again at once), updates the others in place, and starts the
    /// missing ones.
    pub async fn reconcile(&mut self, desired: BTreeMap<u16, Service>) {
        let gone: Vec<u16> = self
            .running
            .keys()
            .filter(|p| !desired.contains_key(p))
            .copied()
            .collect();
        for port in gone {
            if let Some(r) = self.running.remove(&port) {
                let svc = r.service.lock().map(|s| s.clone()).ok();
                tracing::info!(port, service = ?svc, "closing health check server");
                r.stop().await;
            }
        }
        self.retry = false;
        for (port, svc) in desired {
            if let Some(r) = self.running.get(&port) {
                if let Ok(mut cur) = r.service.lock() {
                    *cur = svc;
                }
                continue;
            }
            match self.start(port, svc.clone()) {
                Ok(r) => {
                    tracing::info!(port, namespace = %svc.namespace, name = %svc.name, "opened health check server");
                    self.running.insert(port, r);
                }
                Err(e) => {
                    self.retry = true;
                    tracing::warn!(port, namespace = %svc.namespace, name = %svc.name, error = %e,
                        "cannot open health check server; retrying at the next update");
                }
            }
        }
    }

    fn start(&self, port: u16, svc: Service) -> io::Result<Running> {
        let service = Arc::new(Mutex::new(svc));
        let (stop, stopped) = watch::channel(());
        let mut listeners = Vec::new();
        let mut first_error = None;
        for ip in &self.addresses {
            let addr = SocketAddr::new(*ip, port);
            match bind(addr) {
                Ok(l) => listeners.push(tokio::spawn(serve(
                    l,
                    service.clone(),
                    self.health.clone(),
                    stopped.clone(),
                ))),
                Err(e) => {
                    tracing::debug!(%addr, error = %e, "health check server not on this address");
                    first_error.get_or_insert(e);
                }
            }
        }
        // Served if any address took it (an IPv6 address may be absent on the node).
        if listeners.is_empty() {
            return Err(first_error.unwrap_or_else(|| io::Error::other("no address to listen on")));
        }
        Ok(Running {
            service,
            stop,
            listeners,
        })
    }
}

/// A listening socket with SO_REUSEADDR (as Go's listeners have), IPv6 ones IPV6_V6ONLY so
/// that `[::]:port` and `0.0.0.0:port` can both be bound.
fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let sock = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        let s = TcpSocket::new_v6()?;
        nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Ipv6V6Only, &true)?;
        s
    };
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    sock.listen(1024)
}

/// Accepts until stopped; each connection is served over HTTP/1.1 until it closes or the
/// server stops.
async fn serve(
    listener: TcpListener,
    service: Arc<Mutex<Service>>,
    health: Arc<Health>,
    mut stop: watch::Receiver<()>,
) {
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of file descriptors and the like: do not spin.
                    tracing::debug!(error = %e, "health check accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let (service, health, mut stop) = (service.clone(), health.clone(), stop.clone());
        tokio::spawn(async move {
            let answer = hyper::service::service_fn(move |_req| {
                let svc = service.lock().map(|s| s.clone()).ok();
                let healthy = health.service_proxy_healthy();
                async move {
                    let r = match svc {
                        Some(svc) => response(&svc, healthy),
                        None => {
                            let mut r = Response::new(Full::new(Bytes::new()));
                            *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                            r
                        }
                    };
                    Ok::<_, Infallible>(r)
                }
            });
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10));
            let conn = http.serve_connection(TokioIo::new(stream), answer);
            tokio::select! {
                _ = conn => {}
                _ = stop.changed() => {}
            }
        });
    }
}

#[cfg(test)]
mod tests;
