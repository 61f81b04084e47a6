//! The brain as the signer of PodCertificateRequests (`certificates.k8s.io/v1`, GA in
//! Kubernetes 1.37) for its own signer name (`--pod-certificate-signer`, for example
//! `splitproxy.io/node`): an actuator pod with a `podCertificate` projected volume gets, from its
//! kubelet, a key and a certificate naming its node, issued here with the brain's own CA
//! ([`crate::pki`]), and connects with mTLS as with certificates from files; no token, and no
//! TokenReview per connection.
//!
//! Every replica watches the requests of its signer name in its namespace and answers those not
//! answered yet; two replicas racing on one request are resolved by the API server (the loser's
//! status update conflicts and is dropped), so no lease is needed. Denials are final (a
//! `Denied` condition); the signer's own failures (no CA yet) are retried every second. The decision itself is [`issue::decide`].
pub mod issue;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use k8s_openapi::api::certificates::v1::{PodCertificateRequest, PodCertificateRequestStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

pub use issue::{Ca, Decision, Policy};

/// The longest pod certificate the brain issues (the API server's default maximum, and what
/// its own `kubernetes.io` signers issue at most); a request may ask for less.
pub const MAX_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// Where the signer's CA comes from (the brain's own CA, which may rotate).
pub trait CaSource: Send + Sync {
    /// The current CA certificate and key (PEM), or `None` before there is one.
    fn signing_ca(&self) -> Option<(String, String)>;
}

/// What the signer counts (`splitproxy_brain_pod_certificates_total{outcome}`).
pub trait Outcomes: Send + Sync {
    fn pod_certificate(&self, outcome: &'static str);
}

/// The signer's configuration.
#[derive(Debug, Clone)]
pub struct Signer {
    /// The signer name requests must carry (`--pod-certificate-signer`).
    pub name: String,
    /// The namespace whose requests it answers (the actuator's).
    pub namespace: String,
    pub policy: Policy,
}

/// Answers requests until the brain stops.
pub async fn run(
    client: kube::Client,
    signer: Signer,
    ca: Arc<dyn CaSource>,
    outcomes: Arc<dyn Outcomes>,
) {
    let api: Api<PodCertificateRequest> = Api::namespaced(client, &signer.namespace);
    let config = watcher::Config::default().fields(&format!("spec.signerName={}", signer.name));
    let mut events = watcher::watcher(api.clone(), config)
        .default_backoff()
        .boxed();
    tracing::info!(signer = %signer.name, namespace = %signer.namespace, "answering PodCertificateRequests");
    // Requests that came before the CA (a fresh install: the kubelets ask while the first brain
    // is still making it), or whose answer failed: tried again every second until answered, as
    // last seen by the watch (no read of its own: the watch keeps them current).
    let mut pending: std::collections::BTreeMap<String, PodCertificateRequest> = Default::default();
    let mut retry = tokio::time::interval(RETRY);
    loop {
        let request = tokio::select! {
            event = events.next() => match event {
                None => return,
                Some(Ok(Event::Apply(r) | Event::InitApply(r))) => {
                    pending.remove(r.metadata.name.as_deref().unwrap_or_default());
                    r
                }
                Some(Ok(Event::Delete(r))) => {
                    pending.remove(r.metadata.name.as_deref().unwrap_or_default());
                    continue;
                }
                Some(Ok(_)) => continue,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "watching PodCertificateRequests");
                    continue;
                }
            },
            _ = retry.tick(), if !pending.is_empty() => {
                let Some((_, r)) = pending.pop_first() else { continue };
                r
            }
        };
        if answered(&request) {
            continue;
        }
        let name = request.metadata.name.clone().unwrap_or_default();
        let outcome = answer(&api, &signer, ca.as_ref(), request.clone()).await;
        if matches!(outcome, "no_ca" | "error") && pending.len() < MAX_PENDING {
            pending.insert(name, request);
        }
        outcomes.pod_certificate(outcome);
    }
}

/// How often unanswered requests are tried again.
const RETRY: Duration = Duration::from_secs(1);
/// At most this many requests wait for a retry (one per node at a fresh install).
const MAX_PENDING: usize = 100_000;

/// Whether a request already has its answer (a chain, or a final condition).
fn answered(request: &PodCertificateRequest) -> bool {
    let Some(status) = &request.status else {
        return false;
    };
    status
        .certificate_chain
        .as_deref()
        .is_some_and(|c| !c.is_empty())
        || status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Denied" || c.type_ == "Failed")
}

/// Decides and writes the answer; returns the outcome label.
async fn answer(
    api: &Api<PodCertificateRequest>,
    signer: &Signer,
    ca: &dyn CaSource,
    mut request: PodCertificateRequest,
) -> &'static str {
    let name = request.metadata.name.clone().unwrap_or_default();
    let spec = request.spec.clone();
    let Some((cert_pem, key_pem)) = ca.signing_ca() else {
        tracing::info!(request = %name, "no CA yet; trying again in a second");
        return "no_ca";
    };
    let req = issue::Request {
        namespace: &signer.namespace,
        service_account: &spec.service_account_name,
        node: &spec.node_name,
        max_expiration_seconds: spec.max_expiration_seconds,
        stub_csr_der: &spec.stub_pkc_s10_request.0,
    };
    let ca = Ca {
        cert_pem: &cert_pem,
        key_pem: &key_pem,
    };
    let now = SystemTime::now();
    let decision = match issue::decide(&req, &signer.policy, &ca, now) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(request = %name, error = %e, "cannot issue a pod certificate");
            return "error";
        }
    };
    let generation = request.metadata.generation;
    let (status, outcome) = match decision {
        Decision::Issue(issued) => (
            PodCertificateRequestStatus {
                certificate_chain: Some(issued.chain_pem),
                not_before: Some(time(issued.not_before)),
                not_after: Some(time(issued.not_after)),
                begin_refresh_at: Some(time(issued.begin_refresh_at)),
                conditions: Some(vec![condition(
                    "Issued",
                    "Issued",
                    format!("a client certificate for node {}", spec.node_name),
                    generation,
                    now,
                )]),
            },
            "issued",
        ),
        Decision::Deny { reason, message } => {
            tracing::warn!(request = %name, node = %spec.node_name, reason, %message, "denied a pod certificate");
            (
                PodCertificateRequestStatus {
                    conditions: Some(vec![condition("Denied", reason, message, generation, now)]),
                    ..Default::default()
                },
                "denied",
            )
        }
    };
    request.status = Some(status);
    match api
        .replace_status(&name, &PostParams::default(), &request)
        .await
    {
        Ok(_) => {
            if outcome == "issued" {
                tracing::info!(request = %name, node = %spec.node_name, "issued a node certificate");
            }
            outcome
        }
        // Another replica answered first.
        Err(kube::Error::Api(e)) if e.code == 409 => "conflict",
        Err(e) => {
            tracing::warn!(request = %name, error = %e, "writing a PodCertificateRequest's status");
            "error"
        }
    }
}

fn time(t: SystemTime) -> Time {
    let since = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    Time(
        k8s_openapi::jiff::Timestamp::from_second(since.as_secs() as i64)
            .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    )
}

fn condition(
    type_: &str,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: SystemTime,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: "True".into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time: time(now),
    }
}
