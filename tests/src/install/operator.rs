//! The test's side of an installed chart: operator tokens and gRPC clients of the brain pods,
//! the brains' flags, CA and HTTP port.
use super::*;

/// A gRPC client of a brain pod, with the credential it was made with.
pub type BrainClient = splitproxy_proto::v1::dataplane_client::DataplaneClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>,
>;

/// Sends `authorization: Bearer <token>` with every call, or nothing.
#[derive(Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(bearer) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", bearer.clone());
        }
        Ok(request)
    }
}

#[derive(Default)]
pub(super) struct Operator {
    token: Option<String>,
    links: BTreeMap<String, Forwarder>,
}

impl Install {
    /// A token for an operator: ServiceAccount `name` in the release's namespace, bound to the
    /// chart's operator ClusterRole when `authorised`, for the brain's audience.
    pub async fn operator_token(&self, name: &str, authorised: bool) -> Result<String> {
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), NAMESPACE);
        let sa: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": name, "namespace": NAMESPACE}}))?;
        if accounts.get_opt(name).await?.is_none() {
            accounts.create(&PostParams::default(), &sa).await?;
        }
        if authorised {
            let role = self
                .of_kind("ClusterRole")
                .into_iter()
                .find(|o| {
                    o.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.ends_with("-operator"))
                })
                .context("the chart has no operator ClusterRole")?;
            let binding: ClusterRoleBinding = serde_json::from_value(json!({
                "metadata": {"name": format!("lab-{name}")},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": role.metadata.name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}],
            }))?;
            let api: Api<ClusterRoleBinding> = Api::all(self.client.clone());
            if api.get_opt(&format!("lab-{name}")).await?.is_none() {
                api.create(&PostParams::default(), &binding).await?;
            }
        }
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: Some(vec![self.audience()]),
                expiration_seconds: Some(3600),
                ..Default::default()
            }),
            ..Default::default()
        };
        let answer = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await?;
        answer
            .status
            .and_then(|s| s.token)
            .context("a TokenRequest answered without a token")
    }

    /// A gRPC client of brain pod `pod` as the lab's operator (a ServiceAccount bound to the
    /// chart's operator ClusterRole, its token for the brains' audience, the brains' published
    /// CA, the brains' server name), through a link from host loopback into the pod's node.
    pub async fn operator_client(&self, pod: &str) -> Result<BrainClient> {
        let token = {
            let mut operator = self.operator.lock().await;
            if operator.token.is_none() {
                operator.token = Some(self.operator_token("lab-operator", true).await?);
            }
            operator.token.clone().unwrap_or_default()
        };
        self.client_with_token(pod, Some(&token)).await
    }

    /// A gRPC client of brain pod `pod` that presents `token` (or nothing) as a bearer token,
    /// over TLS verified with the brains' published CA.
    pub async fn client_with_token(&self, pod: &str, token: Option<&str>) -> Result<BrainClient> {
        self.client_as(pod, token, None).await
    }

    /// A gRPC client of brain pod `pod` that presents the client certificate the kubelet gave
    /// pod `holder` in its volume `volume` (files `tls.crt`, `tls.key`: a `podCertificate`
    /// projection).
    pub async fn client_with_certificate_of(
        &self,
        pod: &str,
        holder: &str,
        volume: &str,
    ) -> Result<BrainClient> {
        let dir = self.dir.join(holder).join("volumes").join(volume);
        let identity = tonic::transport::Identity::from_pem(
            std::fs::read(dir.join("tls.crt"))?,
            std::fs::read(dir.join("tls.key"))?,
        );
        self.client_as(pod, None, Some(identity)).await
    }

    async fn client_as(
        &self,
        pod: &str,
        token: Option<&str>,
        identity: Option<tonic::transport::Identity>,
    ) -> Result<BrainClient> {
        use tonic::transport::{Certificate, Channel, ClientTlsConfig};
        let addr = {
            let mut operator = self.operator.lock().await;
            if !operator.links.contains_key(pod) {
                operator
                    .links
                    .insert(pod.to_string(), self.brain_link(pod)?);
            }
            operator.links[pod].local_addr()
        };
        let bearer: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>> = match token {
            Some(t) => Some(format!("Bearer {t}").parse()?),
            None => None,
        };
        let server_name = self
            .brain_arg("--tls-server-name")
            .unwrap_or_else(|| "splitproxy-brain".into());
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(self.brain_ca().await?))
            .domain_name(server_name);
        if let Some(identity) = identity {
            tls = tls.identity(identity);
        }
        let channel = Channel::from_shared(format!("https://{addr}"))?
            .tls_config(tls)?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await?;
        let client = splitproxy_proto::v1::dataplane_client::DataplaneClient::with_interceptor(
            channel,
            Bearer(bearer),
        )
        .max_decoding_message_size(splitproxy_proto::transport::MAX_UPDATE_MESSAGE);
        Ok(client)
    }

    /// A file the kubelet wrote into pod `pod`'s volume `volume`.
    pub fn volume_file(&self, pod: &str, volume: &str, file: &str) -> Result<String> {
        let path = self.dir.join(pod).join("volumes").join(volume).join(file);
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    }

    /// A token of pod `pod`'s ServiceAccount for `audience`, bound to the Pod, requested as its
    /// kubelet requests the pod's own (tests make variants of it: another audience).
    pub async fn pod_token(&self, pod: &str, audience: &str) -> Result<String> {
        let object = lock(&self.pods)
            .get(pod)
            .map(|p| p.pod.clone())
            .with_context(|| format!("no pod {pod}"))?;
        self.token(&object, Some(audience), Some(600)).await
    }

    /// The token the kubelet gave pod `pod` in its volume `volume` (file `token`).
    pub fn token_of(&self, pod: &str, volume: &str) -> Result<String> {
        self.volume_file(pod, volume, "token")
    }

    /// GET `path` on brain pod `pod`'s health and metrics port, inside its node.
    pub fn brain_http(&self, pod: &str, path: &str) -> Result<(u16, String)> {
        let node = lock(&self.pods)
            .get(pod)
            .map(|p| p.node)
            .with_context(|| format!("no pod {pod}"))?;
        let port = self
            .brain_arg("--metrics-bind-address")
            .and_then(|l| l.parse::<SocketAddr>().ok())
            .context("the brain's --metrics-bind-address")?
            .port();
        crate::deploy::http_get_in(
            &self.netns[node],
            SocketAddr::from(([127, 0, 0, 1], port)),
            path,
        )
    }

    /// The brains' token audience, from their rendered arguments.
    pub fn audience(&self) -> String {
        self.brain_arg("--token-audience")
            .unwrap_or_else(|| "splitproxy".into())
    }

    /// The value of a rendered brain flag.
    pub fn brain_arg(&self, flag: &str) -> Option<String> {
        let deploy = self.of_kind("Deployment").into_iter().next()?;
        let args = deploy.data["spec"]["template"]["spec"]["containers"][0]["args"].as_array()?;
        args.iter()
            .filter_map(|a| a.as_str())
            .find_map(|a| a.strip_prefix(&format!("{flag}=")).map(str::to_string))
    }

    /// The brains' CA bundle, from the ConfigMap the actuators mount.
    pub async fn brain_ca(&self) -> Result<String> {
        let name = self
            .brain_arg("--ca-configmap")
            .and_then(|v| v.split_once('/').map(|(_, n)| n.to_string()))
            .context("the brains publish no CA ConfigMap (tls.source is not brain)")?;
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), NAMESPACE);
        let cm = api.get(&name).await?;
        cm.data
            .and_then(|d| d.get("ca.crt").cloned())
            .context("the CA ConfigMap has no ca.crt")
    }

    /// A host loopback address that reaches brain pod `pod`'s gRPC port (inside its node).
    pub fn brain_link(&self, pod: &str) -> Result<Forwarder> {
        let node = lock(&self.pods)
            .get(pod)
            .map(|p| p.node)
            .with_context(|| format!("no pod {pod}"))?;
        let listen = self
            .brain_arg("--listen")
            .and_then(|l| l.parse::<SocketAddr>().ok())
            .context("the brain's --listen")?;
        forward_into(
            &self.netns[node],
            SocketAddr::from(([127, 0, 0, 1], 0)),
            SocketAddr::new(self.node_ips[node], listen.port()),
        )
    }
}
