//! What the control loops do for the lab's chart pods: readiness probes, the EndpointSlices of
//! the chart's Services, and ConfigMap volumes following their ConfigMaps.
use super::kubelet::refresh_config_maps;
use super::*;

impl Install {
    /// What the kubelets' probes, their ConfigMap updates and the EndpointSlice controller do,
    /// every 300 ms until the install is dropped.
    pub(super) fn spawn_controllers(&self) -> tokio::task::JoinHandle<()> {
        let client = self.client.clone();
        let pods = self.pods.clone();
        let services: Vec<Service> = self
            .of_kind("Service")
            .into_iter()
            .filter_map(|o| serde_json::to_value(o).ok())
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect();
        let netns: Vec<_> = self.netns.iter().map(|n| n.handle()).collect();
        let node_ips = self.node_ips.clone();
        let node_names = self.node_names.clone();
        tokio::spawn(async move {
            let mut written: BTreeMap<String, serde_json::Value> = BTreeMap::new();
            let mut rounds = 0u64;
            loop {
                rounds += 1;
                let ready = probe_all(&pods, &netns).await;
                for svc in &services {
                    let slice = endpoint_slice(svc, &pods, &ready, &node_ips, &node_names);
                    let name = slice["metadata"]["name"].as_str().unwrap_or("").to_string();
                    if written.get(&name) == Some(&slice) {
                        continue;
                    }
                    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), NAMESPACE);
                    match api
                        .patch(
                            &name,
                            &PatchParams::apply(MANAGER).force(),
                            &Patch::Apply(&slice),
                        )
                        .await
                    {
                        Ok(_) => {
                            written.insert(name, slice);
                        }
                        Err(e) => eprintln!("[install] EndpointSlice {name}: {e}"),
                    }
                }
                if rounds.is_multiple_of(3) {
                    refresh_config_maps(&client, &pods).await;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    }
}

/// Which running pods pass their readiness probe (`httpGet` on the pod's node).
async fn probe_all(
    pods: &Arc<Mutex<BTreeMap<String, RunningPod>>>,
    netns: &[crate::netns::Netns],
) -> BTreeSet<String> {
    let targets: Vec<(String, usize, u16, String)> = lock(pods)
        .iter()
        .filter_map(|(name, p)| {
            let c = p.pod.spec.as_ref()?.containers.first()?;
            let get = c.readiness_probe.as_ref()?.http_get.as_ref()?;
            let port = match &get.port {
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => *n,
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => {
                    c.ports
                        .iter()
                        .flatten()
                        .find(|p| p.name.as_deref() == Some(s.as_str()))?
                        .container_port
                }
            };
            Some((
                name.clone(),
                p.node,
                port as u16,
                get.path.clone().unwrap_or("/".into()),
            ))
        })
        .collect();
    let mut ready = BTreeSet::new();
    for (name, node, port, path) in targets {
        let ns = netns[node].handle();
        let ok = tokio::task::spawn_blocking(move || {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            matches!(crate::deploy::http_get_in(&ns, addr, &path), Ok((200, _)))
        })
        .await
        .unwrap_or(false);
        if ok {
            ready.insert(name);
        }
    }
    ready
}

/// The EndpointSlice of `svc` as the EndpointSlice controller writes it: the running pods its
/// selector matches, ready when their readiness probe passes.
fn endpoint_slice(
    svc: &Service,
    pods: &Arc<Mutex<BTreeMap<String, RunningPod>>>,
    ready: &BTreeSet<String>,
    node_ips: &[IpAddr],
    node_names: &[String],
) -> serde_json::Value {
    let name = svc.metadata.name.clone().unwrap_or_default();
    let spec = svc.spec.clone().unwrap_or_default();
    let selector = spec.selector.clone().unwrap_or_default();
    let mut endpoints = Vec::new();
    let mut container_ports: BTreeMap<String, i32> = BTreeMap::new();
    for (pod_name, p) in lock(pods).iter() {
        let labels = p.pod.metadata.labels.clone().unwrap_or_default();
        if selector.is_empty() || !selector.iter().all(|(k, v)| labels.get(k) == Some(v)) {
            continue;
        }
        if p.child.is_none() {
            continue;
        }
        for c in p.pod.spec.iter().flat_map(|s| s.containers.iter()) {
            for port in c.ports.iter().flatten() {
                if let Some(n) = &port.name {
                    container_ports.insert(n.clone(), port.container_port);
                }
            }
        }
        let is_ready = ready.contains(pod_name);
        endpoints.push(json!({
            "addresses": [node_ips[p.node].to_string()],
            "conditions": {"ready": is_ready, "serving": is_ready, "terminating": false},
            "nodeName": node_names[p.node],
            "targetRef": {"kind": "Pod", "name": pod_name, "namespace": NAMESPACE,
                          "uid": p.pod.metadata.uid},
        }));
    }
    let ports: Vec<serde_json::Value> = spec
        .ports
        .iter()
        .flatten()
        .map(|p| {
            let port = match &p.target_port {
                Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s)) => {
                    container_ports.get(s).copied().unwrap_or(p.port)
                }
                Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n)) => *n,
                None => p.port,
            };
            json!({"name": p.name, "port": port, "protocol": p.protocol.clone().unwrap_or("TCP".into())})
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{name}-lab"),
            "namespace": NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "splitproxy-lab",
            },
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": ports,
    })
}
