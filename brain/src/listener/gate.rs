//! [`Gate`]: who a request comes from, decided before any service runs. A connection's client
//! certificate comes first; without one, the request's bearer token is reviewed
//! ([`crate::tokens`], asynchronously and cached) and its identity replaces the connection's in
//! the request's [`PeerInfo`]. A caller with no credential or no role is refused here, counted
//! and logged at a bounded rate ([`refuse`]).
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use crate::auth::{self, Credential, Groups, Refusal};
use crate::metrics::Metrics;
use crate::tokens::{Authenticator, Rejected};

use super::accounting::RateLimitedLog;
use super::{LOG_EVERY, PeerInfo};

/// A tower layer over every service of the server: marks the connection as having started a
/// request (see [`super::FIRST_REQUEST_TIMEOUT`]), identifies a caller without a client
/// certificate by its bearer token, and refuses callers with no credential or no role at all,
/// whatever service they call (reflection and health too). A client certificate comes first: a
/// request on a connection that presented one is judged by it, whatever metadata it sends.
#[derive(Clone)]
pub struct Gate {
    pub groups: Arc<Groups>,
    pub metrics: Arc<Metrics>,
    /// Bearer tokens, when enabled (`--token-audience` not empty).
    pub tokens: Option<Arc<Authenticator>>,
}

/// What a request's `authorization` metadata holds.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Bearer<'a> {
    None,
    Token(&'a str),
    /// Present, but not `Bearer <token>`.
    Malformed,
}

pub(super) fn bearer(headers: &tonic::codegen::http::HeaderMap) -> Bearer<'_> {
    let Some(value) = headers.get(tonic::codegen::http::header::AUTHORIZATION) else {
        return Bearer::None;
    };
    let Ok(value) = value.to_str() else {
        return Bearer::Malformed;
    };
    match value.split_once(' ') {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => match token.trim() {
            "" => Bearer::Malformed,
            token => Bearer::Token(token),
        },
        _ => Bearer::Malformed,
    }
}

impl<S> tower::Layer<S> for Gate {
    type Service = GateService<S>;

    fn layer(&self, inner: S) -> GateService<S> {
        GateService {
            inner,
            gate: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct GateService<S> {
    inner: S,
    gate: Gate,
}

pub(super) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<tonic::codegen::http::Request<B>> for GateService<S>
where
    S: tower::Service<
            tonic::codegen::http::Request<B>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: tonic::codegen::http::Request<B>) -> Self::Future {
        let Some(peer) = request.extensions().get::<PeerInfo>().cloned() else {
            return Box::pin(self.inner.call(request));
        };
        peer.started.store(true, Ordering::Relaxed);
        let refused = |status: tonic::Status| -> Self::Future {
            Box::pin(async move { Ok(status.into_http()) })
        };
        let metrics = &self.gate.metrics;
        if peer.identity.credential == Credential::Certificate {
            if let Err(reason) = auth::roles(&peer.identity, &self.gate.groups).any() {
                return refused(refuse(metrics, reason, &peer, request.uri().path()));
            }
            return Box::pin(self.inner.call(request));
        }
        let token = match (bearer(request.headers()), &self.gate.tokens) {
            (Bearer::Token(token), Some(tokens)) => (token.to_string(), tokens.clone()),
            (Bearer::Malformed, Some(_)) => {
                let rejected = Rejected {
                    reason: Refusal::BadToken,
                    detail: "the authorization metadata is not \"Bearer <token>\"".into(),
                };
                return refused(refuse_token(
                    metrics,
                    &rejected,
                    &peer,
                    request.uri().path(),
                ));
            }
            _ => {
                return refused(refuse(
                    metrics,
                    Refusal::NoIdentity,
                    &peer,
                    request.uri().path(),
                ));
            }
        };
        // The inner service was made ready for this call: take it, leave a fresh clone.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let gate = self.gate.clone();
        Box::pin(async move {
            let (token, tokens) = token;
            let what = request.uri().path().to_string();
            let identity = match tokens.identity(&token).await {
                Ok(identity) => identity,
                Err(rejected) => {
                    return Ok(refuse_token(&gate.metrics, &rejected, &peer, &what).into_http());
                }
            };
            let peer = PeerInfo {
                identity: Arc::new(identity),
                ..peer
            };
            if let Err(reason) = auth::roles(&peer.identity, &gate.groups).any() {
                return Ok(refuse(&gate.metrics, reason, &peer, &what).into_http());
            }
            request.extensions_mut().insert(peer);
            inner.call(request).await
        })
    }
}

/// One rate limiter per refusal reason, so that a flood of one kind hides no other kind.
pub(super) static REFUSAL_LOGS: [RateLimitedLog; Refusal::ALL.len()] =
    [const { RateLimitedLog::new(LOG_EVERY) }; Refusal::ALL.len()];

pub(super) fn refusal_log(reason: Refusal) -> &'static RateLimitedLog {
    let i = Refusal::ALL
        .iter()
        .position(|r| *r == reason)
        .unwrap_or_default();
    &REFUSAL_LOGS[i]
}

/// Counts and logs (rate limited) a refused call, and the status that answers it.
pub fn refuse(metrics: &Metrics, reason: Refusal, peer: &PeerInfo, what: &str) -> tonic::Status {
    refuse_with(metrics, reason, peer, what, None)
}

/// [`refuse`] for a bearer token that was not accepted, with the reason the review gave.
pub fn refuse_token(
    metrics: &Metrics,
    rejected: &Rejected,
    peer: &PeerInfo,
    what: &str,
) -> tonic::Status {
    refuse_with(metrics, rejected.reason, peer, what, Some(&rejected.detail))
}

pub(super) fn refuse_with(
    metrics: &Metrics,
    reason: Refusal,
    peer: &PeerInfo,
    what: &str,
    detail: Option<&str>,
) -> tonic::Status {
    metrics.surface.refused(reason);
    let names = &peer.identity.names;
    let groups = &peer.identity.groups;
    let credential = &peer.identity.credential;
    let message = match reason {
        Refusal::NoIdentity => {
            "no client certificate and no bearer token (authorization: Bearer <token>)".to_string()
        }
        Refusal::NoRole => match credential {
            Credential::Token { .. } => format!(
                "{credential} has no role: it is not the node ServiceAccount's, and SubjectAccessReview does not allow it to get {}/{}",
                crate::tokens::INTROSPECTION_GROUP,
                crate::tokens::INTROSPECTION_RESOURCE
            ),
            _ => format!(
                "{credential} (names {names:?}, groups {groups:?}) is in neither the node nor the operator group"
            ),
        },
        Refusal::BadToken | Refusal::NoNodeClaim | Refusal::TokenReviewUnavailable => {
            let what = match reason {
                Refusal::BadToken => "the bearer token was not accepted",
                Refusal::NoNodeClaim => "the bearer token names no node",
                _ => "the bearer token could not be reviewed; try again",
            };
            match detail {
                Some(d) => format!("{what}: {d}"),
                None => what.to_string(),
            }
        }
        Refusal::NotANode => "only node identities may open Sync".to_string(),
        Refusal::OtherNode => format!("{credential} identifies node(s) {names:?} only"),
        Refusal::NotAnOperator => "only operator identities may call this".to_string(),
        Refusal::BadHello => "the first message must be a valid Hello".to_string(),
        Refusal::HelloTimeout => "no Hello in time".to_string(),
        Refusal::PeerConnectionLimit | Refusal::ConnectionLimit => "too many connections".into(),
    };
    if let Some(held) = refusal_log(reason).admit() {
        tracing::warn!(
            peer = %peer.remote,
            %credential,
            ?names,
            ?groups,
            what = %auth::bounded(what, 256),
            reason = reason.as_str(),
            held_back = held,
            "call refused: {message}"
        );
    }
    match reason {
        Refusal::BadHello => tonic::Status::invalid_argument(message),
        Refusal::HelloTimeout => tonic::Status::deadline_exceeded(message),
        Refusal::NoIdentity | Refusal::BadToken => tonic::Status::unauthenticated(message),
        // Not the caller's fault: it should try again (or another brain), not give up.
        Refusal::TokenReviewUnavailable => tonic::Status::unavailable(message),
        _ => tonic::Status::permission_denied(message),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::auth::Identity;

    /// The gate: a certificate comes first (a bad token beside it changes nothing); without
    /// one, the token's identity replaces the connection's for the services; no credential, a
    /// malformed or refused token, or tokens disabled are refused before any service runs.
    #[tokio::test]
    async fn the_gate_judges_certificates_first_and_tokens_otherwise() {
        use std::sync::atomic::AtomicUsize;

        use tonic::codegen::http;
        use tower::ServiceExt as _;

        use crate::tokens::{
            BoxFuture, ReviewError, Reviewer, TokenReviewed, TokenSettings, UserInfo,
        };

        struct Fake;
        impl Reviewer for Fake {
            fn review_token<'a>(
                &'a self,
                token: &'a str,
                _audience: &'a str,
            ) -> BoxFuture<'a, Result<TokenReviewed, ReviewError>> {
                Box::pin(async move {
                    Ok(match token {
                        "node-0-token" => TokenReviewed::Authenticated(UserInfo {
                            username: "system:serviceaccount:kube-system:actuator".into(),
                            extra: [(
                                crate::tokens::NODE_NAME_CLAIM.to_string(),
                                vec!["node-0".to_string()],
                            )]
                            .into(),
                            ..Default::default()
                        }),
                        _ => TokenReviewed::Unauthenticated("invalid bearer token".into()),
                    })
                })
            }
            fn may_introspect<'a>(
                &'a self,
                _user: &'a UserInfo,
            ) -> BoxFuture<'a, Result<bool, ReviewError>> {
                Box::pin(async { Ok(false) })
            }
        }

        let metrics = Arc::new(Metrics::default());
        let settings = TokenSettings {
            audience: "splitproxy".into(),
            node_service_account: Some("kube-system/actuator".parse().unwrap()),
        };
        let tokens = Arc::new(Authenticator::new(
            settings,
            Groups::default(),
            Arc::new(Fake),
            metrics.clone(),
        ));
        let seen = Arc::new(Mutex::new(Vec::<Identity>::new()));
        let served = Arc::new(AtomicUsize::new(0));
        let inner = {
            let (seen, served) = (seen.clone(), served.clone());
            tower::service_fn(move |r: http::Request<()>| {
                let (seen, served) = (seen.clone(), served.clone());
                async move {
                    served.fetch_add(1, Ordering::SeqCst);
                    if let Some(p) = r.extensions().get::<PeerInfo>() {
                        seen.lock().unwrap().push(p.identity.as_ref().clone());
                    }
                    Ok::<_, std::convert::Infallible>(http::Response::new(
                        tonic::body::Body::empty(),
                    ))
                }
            })
        };
        let gate = |tokens: Option<Arc<Authenticator>>| {
            tower::Layer::layer(
                &Gate {
                    groups: Arc::new(Groups::default()),
                    metrics: metrics.clone(),
                    tokens,
                },
                inner.clone(),
            )
        };
        let with_tokens = gate(Some(tokens));
        let without_tokens = gate(None);
        let request = |identity: Identity, authorization: Option<&str>| {
            let mut r = http::Request::builder().uri("/splitproxy.v1.Dataplane/ListNodes");
            if let Some(a) = authorization {
                r = r.header("authorization", a);
            }
            let mut r = r.body(()).unwrap();
            r.extensions_mut().insert(PeerInfo {
                remote: "127.0.0.1:1".parse().unwrap(),
                identity: Arc::new(identity),
                started: Arc::new(AtomicBool::new(false)),
            });
            r
        };
        let status = |r: &http::Response<tonic::body::Body>| {
            r.headers()
                .get("grpc-status")
                .map(|v| v.to_str().unwrap().to_string())
        };
        let certificate = |groups: &[&str]| Identity {
            names: vec!["node-0".into()],
            groups: groups.iter().map(|g| g.to_string()).collect(),
            expires: None,
            credential: Credential::Certificate,
        };

        // A certificate in the node group, with a bad token beside it: the certificate.
        let r = with_tokens
            .clone()
            .oneshot(request(
                certificate(&[auth::DEFAULT_NODE_GROUP]),
                Some("Bearer nonsense"),
            ))
            .await
            .unwrap();
        assert_eq!(status(&r), None, "served");
        assert_eq!(
            seen.lock().unwrap().pop().unwrap().credential,
            Credential::Certificate
        );
        // A certificate in no group is refused, token or not.
        let r = with_tokens
            .clone()
            .oneshot(request(certificate(&[]), Some("Bearer node-0-token")))
            .await
            .unwrap();
        assert_eq!(status(&r).as_deref(), Some("7"), "PERMISSION_DENIED");
        // No certificate: the token's identity reaches the service.
        let r = with_tokens
            .clone()
            .oneshot(request(Identity::default(), Some("Bearer node-0-token")))
            .await
            .unwrap();
        assert_eq!(status(&r), None, "served");
        let identity = seen.lock().unwrap().pop().unwrap();
        assert_eq!(identity.names, ["node-0"]);
        assert_eq!(identity.groups, [auth::DEFAULT_NODE_GROUP]);
        // Refused before any service: no credential, a bad token, a malformed header, and a
        // token when tokens are disabled.
        for (gate, authorization, code, reason) in [
            (&with_tokens, None, "16", Refusal::NoIdentity),
            (&with_tokens, Some("Bearer bad"), "16", Refusal::BadToken),
            (
                &with_tokens,
                Some("Basic dXNlcg=="),
                "16",
                Refusal::BadToken,
            ),
            (
                &without_tokens,
                Some("Bearer node-0-token"),
                "16",
                Refusal::NoIdentity,
            ),
        ] {
            let before = metrics.surface.refused_count(reason);
            let r = gate
                .clone()
                .oneshot(request(Identity::default(), authorization))
                .await
                .unwrap();
            assert_eq!(status(&r).as_deref(), Some(code), "{authorization:?}");
            assert_eq!(metrics.surface.refused_count(reason), before + 1);
        }
        assert_eq!(
            served.load(Ordering::SeqCst),
            2,
            "only the two accepted calls"
        );
    }

    #[test]
    fn bearer_tokens_are_read_from_the_authorization_metadata() {
        use tonic::codegen::http::{HeaderMap, HeaderValue, header::AUTHORIZATION};
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            h
        };
        assert_eq!(bearer(&HeaderMap::new()), Bearer::None);
        assert_eq!(bearer(&with("Bearer abc.def")), Bearer::Token("abc.def"));
        assert_eq!(bearer(&with("bearer  abc ")), Bearer::Token("abc"));
        for bad in ["Basic dXNlcg==", "Bearer", "Bearer ", "abc"] {
            assert_eq!(bearer(&with(bad)), Bearer::Malformed, "{bad:?}");
        }
    }
}
